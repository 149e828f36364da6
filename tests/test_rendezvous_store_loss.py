"""A node loses the c10d rendezvous store without a connection reset (its host lost power, or a network dropped
it): nothing tells the node, its reads would hang for TCP's retransmission timeout. The handler gives up after
``read_timeout`` without a heartbeat reaching the store, with an error naming the store, and tolerates a shorter
silence.

A relay between the node and the store plays the network (``helpers/relay.py``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import anyio.abc
import pytest
from helpers.relay import Relay, open_relay

from aelastic.errors import RendezvousConnectionError
from aelastic.rendezvous.api import RendezvousParameters
from aelastic.rendezvous.backends.store import _NO_VALUE
from aelastic.rendezvous.registry import open_rendezvous
from aelastic.store.server import open_store_server

pytestmark = pytest.mark.anyio

FAST = {"keep_alive_interval": 0.1, "keep_alive_max_attempt": 3, "heartbeat_timeout": 0.3, "is_host": False}
# Several nodes watch each other: a grace and timeouts a busy machine cannot outrun by accident (a false eviction or
# a lost store declared before the test silences it would end a node without the error under test).
WATCHED = {"keep_alive_interval": 0.1, "keep_alive_max_attempt": 20, "heartbeat_timeout": 1.0, "is_host": False}


@asynccontextmanager
async def open_relayed_store() -> AsyncIterator[Relay]:
    async with open_store_server("127.0.0.1", 0) as server, open_relay(server.port) as relay:
        yield relay


def _params(relay: Relay, run_id: str, read_timeout: float) -> RendezvousParameters:
    return RendezvousParameters("c10d", f"127.0.0.1:{relay.port}", run_id, 1, 1, read_timeout=read_timeout, **FAST)


async def test_a_silent_store_fails_the_node_naming_it_after_read_timeout() -> None:
    read_timeout = 1.0
    async with open_relayed_store() as relay:
        silenced = 0.0

        async def lose_the_store_while_a_member() -> None:
            nonlocal silenced
            async with open_rendezvous(_params(relay, "silent", read_timeout)) as handler:
                info = await handler.next_rendezvous()
                assert (info.rank, info.world_size) == (0, 1)
                relay.silence()
                silenced = anyio.current_time()
                await handler.wait_for_membership_change()  # hangs on the silent store: only the deadline ends it

        with (
            anyio.fail_after(30),
            pytest.raises(RendezvousConnectionError, match=rf"127\.0\.0\.1:{relay.port}.*read_timeout=1s"),
        ):
            await lose_the_store_while_a_member()
        # Not before read_timeout, and long before TCP would give up (minutes): the heartbeats decided it.
        took = anyio.current_time() - silenced
        assert read_timeout <= took < read_timeout + 15.0, took


async def test_a_silence_shorter_than_read_timeout_is_survived() -> None:
    async with open_relayed_store() as relay:
        with anyio.fail_after(30):
            async with open_rendezvous(_params(relay, "blip", read_timeout=10.0)) as handler:
                await handler.next_rendezvous()
                relay.silence()
                await anyio.sleep(1.0)  # several heartbeats time out; the node keeps going
                relay.restore()
                assert not await handler.is_closed()
                await handler.set_closed()
                assert await handler.is_closed()


async def test_a_store_silent_during_a_neighbour_check_fails_both_nodes_after_read_timeout() -> None:
    """The store goes silent with a node's neighbour check in flight (the request swallowed): the check must not
    hang that node's liveness, which is what gives up on the store; both nodes fail naming it."""
    read_timeout = 3.0
    errors: list[RendezvousConnectionError] = []
    async with open_relayed_store() as relay:
        relay.silence_on(b"/alive/", _NO_VALUE)  # the neighbour check's non-blocking read of a counter

        async def member() -> None:
            params = RendezvousParameters(
                "c10d", f"127.0.0.1:{relay.port}", "check", 2, 2, read_timeout=read_timeout, **WATCHED
            )
            try:
                async with open_rendezvous(params) as handler:
                    await handler.next_rendezvous()
                    await handler.wait_for_membership_change()  # only losing the store ends it
            except RendezvousConnectionError as exc:
                errors.append(exc)

        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                tg.start_soon(member)
                tg.start_soon(member)
    assert not relay.audible.is_set(), "no neighbour check was ever sent"
    assert len(errors) == 2
    for error in errors:
        assert f"127.0.0.1:{relay.port}" in str(error)
        assert "read_timeout=3s" in str(error)


async def test_a_store_silent_during_an_eviction_fails_the_evicting_node_after_read_timeout() -> None:
    """A node dies; the store goes silent with its neighbour's eviction in flight (the read of the state that the
    eviction rewrites): the eviction must not hang the evicting node's liveness either."""
    read_timeout = 3.0
    errors: list[RendezvousConnectionError] = []
    victim = anyio.CancelScope()
    completed = 0
    all_completed = anyio.Event()
    async with open_relayed_store() as relay:

        async def member(scope: anyio.CancelScope) -> None:
            nonlocal completed
            params = RendezvousParameters(
                "c10d", f"127.0.0.1:{relay.port}", "evict", 3, 3, read_timeout=read_timeout, **WATCHED
            )
            with scope:
                try:
                    async with open_rendezvous(params) as handler:
                        await handler.next_rendezvous()
                        completed += 1
                        if completed == 3:
                            all_completed.set()
                        await handler.wait_for_membership_change()  # only losing the store ends it
                except RendezvousConnectionError as exc:
                    errors.append(exc)

        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                tg.start_soon(member, victim)
                tg.start_soon(member, anyio.CancelScope())
                tg.start_soon(member, anyio.CancelScope())
                await all_completed.wait()
                relay.silence_on(b"/state")  # after the round, only an eviction reads the whole state
                victim.cancel()  # its heartbeats stop: its neighbour evicts it after the grace
    assert not relay.audible.is_set(), "no eviction was ever sent"
    assert len(errors) == 2
    assert any("evicting the dead node" in str(error) for error in errors), errors
    for error in errors:
        assert f"127.0.0.1:{relay.port}" in str(error)


async def test_a_store_that_goes_away_says_what_was_lost_and_what_would_have_survived() -> None:
    """The store's host crashes (its kernel closes the connections): the node fails at once, in words (issue 33),
    not with the stream's ``EndOfStream()``."""
    crash = anyio.CancelScope()
    async with anyio.create_task_group() as tg:

        async def serve(*, task_status: anyio.abc.TaskStatus[int]) -> None:
            with crash:
                async with open_store_server("127.0.0.1", 0) as server:
                    task_status.started(server.port)
                    await anyio.sleep_forever()

        port = await tg.start(serve)

        async def lose_the_store_while_a_member() -> None:
            params = RendezvousParameters("c10d", f"127.0.0.1:{port}", "gone", 1, 1, read_timeout=60, **FAST)
            async with open_rendezvous(params) as handler:
                await handler.next_rendezvous()
                crash.cancel()  # the server closes every connection
                await handler.wait_for_membership_change()  # only losing the store ends it

        with anyio.fail_after(30), pytest.raises(RendezvousConnectionError) as caught:
            await lose_the_store_while_a_member()
    message = str(caught.value)
    assert message.startswith(f"rendezvous 'gone': lost the rendezvous store at 127.0.0.1:{port} (its connection "
                              "closed): the agent on 127.0.0.1 that served it is gone"), message  # fmt: skip
    assert "--rdzv-endpoint embedded:" in message
    assert "EndOfStream" not in message
    assert "\n" not in message
