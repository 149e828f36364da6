"""A node loses the c10d rendezvous store without a connection reset (its host lost power, or a network dropped
it): nothing tells the node, its reads would hang for TCP's retransmission timeout. The handler gives up after
``read_timeout`` without a heartbeat reaching the store, with an error naming the store, and tolerates a shorter
silence.

A relay between the node and the store plays the network (``silent_relay.py``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import pytest
from silent_relay import Relay, open_relay

from aelastic.errors import RendezvousConnectionError
from aelastic.rendezvous.api import RendezvousParameters, open_rendezvous
from aelastic.store.server import open_store_server

pytestmark = pytest.mark.anyio

FAST = {"keep_alive_interval": 0.1, "keep_alive_max_attempt": 3, "heartbeat_timeout": 0.3, "is_host": False}


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
