"""A node's agent dies and its kernel closes its connections: the c10d host learns of it from the store server's
connection events (``ServerSettings.on_connection``) and evicts the node after a short grace for a reconnect,
instead of after the keep-alive misses. A silent loss (the relay goes silent: power, partition) still waits for
the keep-alive.

Nodes here are OS processes on one machine (``rdzv_node.py``), each reaching the host's store from
an address of its own on the loopback network (127.0.0.x), as nodes of a cluster reach it from their own hosts.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import pytest

from aelastic.errors import ConfigurationError
from aelastic.rendezvous.api import RendezvousHandler, RendezvousParameters
from aelastic.rendezvous.backends.c10d import c10d_settings
from aelastic.rendezvous.backends.disconnects import DisconnectWatch
from aelastic.rendezvous.dynamic import DynamicRendezvousHandler
from aelastic.rendezvous.registry import open_rendezvous
from aelastic.store.client import open_store_client
from aelastic.store.server import ServerSettings, open_store_server

pytestmark = pytest.mark.anyio


async def test_the_store_server_reports_connections_opening_and_closing() -> None:
    events: list[tuple[str, bool]] = []
    changed = anyio.Event()

    def record(peer: str, opened: bool) -> None:
        events.append((peer, opened))
        changed.set()

    with anyio.fail_after(10):
        async with open_store_server("127.0.0.1", 0, ServerSettings(on_connection=record)) as server:
            async with open_store_client("127.0.0.1", server.port) as client:
                await client.set("k", b"v")
                local = await client.local_address()
                [(peer, opened)] = events
                assert opened
                assert peer.startswith(f"{local}:")
            while len(events) < 2:
                changed = anyio.Event()
                await changed.wait()
            assert events[1] == (peer, False)


# --- a node's agent dies: the host evicts it within the disconnect grace, far inside the keep-alive ---------------

NODE = str(Path(__file__).with_name("rdzv_node.py"))
KEEP_ALIVE = ("keep_alive_interval=0.5", "keep_alive_max_attempt=20")  # a 10 s keep-alive: not what finds the loss


class NodeProcess:
    def __init__(self, process: anyio.abc.Process) -> None:
        self.process = process
        assert process.stdout is not None
        self._out = process.stdout
        self._buffer = b""

    async def next_event(self) -> dict[str, Any]:
        while b"\n" not in self._buffer:
            self._buffer += await self._out.receive()
        line, _, self._buffer = self._buffer.partition(b"\n")
        return dict(json.loads(line))


@asynccontextmanager
async def hosted_run(*conf: str) -> AsyncIterator[tuple[RendezvousHandler, NodeProcess]]:
    """``--nnodes 1:2``: this process hosts the c10d store on every interface (dual stack) and joins as one node,
    from ``::1``; a node process joins from ``127.0.0.1``. Two addresses, as two hosts of a cluster have (the
    kernel picks the loopback source address by destination, so a second node process would share one)."""
    params = RendezvousParameters(
        "c10d", "[::]:0", f"disc-{uuid.uuid4().hex[:8]}", 1, 2, is_host=True, last_call_timeout=60,
        **dict(kv.split("=", 1) for kv in (*KEEP_ALIVE, *conf)),
    )  # fmt: skip
    async with open_rendezvous(params) as host:
        assert isinstance(host, DynamicRendezvousHandler)
        assert host.node.addr == "::1", host.node
        port = host.statistics().stores[0].port
        args = [sys.executable, NODE, "c10d", f"127.0.0.1:{port}", params.run_id, "1", "2",
                "is_host=false", "last_call_timeout=60", *KEEP_ALIVE, *conf]  # fmt: skip
        node = NodeProcess(await anyio.open_process(args, stdout=subprocess.PIPE, stderr=None))
        try:
            first = await host.next_rendezvous()  # a full round: no last call
            assert first.world_size == 2
            assert (await node.next_event())["world_size"] == 2
            yield host, node
        finally:
            with anyio.CancelScope(shield=True):
                if node.process.returncode is None:
                    node.process.kill()
                await node.process.wait()


async def _lost_after(host: RendezvousHandler, victim: NodeProcess, sig: signal.Signals) -> float:
    """Seconds from signalling ``victim`` to ``host`` hearing that its round lost a member."""
    victim.process.send_signal(sig)
    signalled = anyio.current_time()
    reason = await host.wait_for_membership_change()
    assert "lost 1 member" in reason, reason
    return anyio.current_time() - signalled


async def test_a_killed_node_is_evicted_within_the_disconnect_grace_and_the_survivor_regroups() -> None:
    """A SIGKILLed node's connections close: the host evicts it once they stayed closed for the grace (0.5 s),
    not after the keep-alive (10 s here), and carries on alone at once (fast quorum; the last call is 60 s)."""
    with anyio.fail_after(60):
        async with hosted_run("disconnect_grace=0.5") as (host, node):
            took = await _lost_after(host, node, signal.SIGKILL)
            assert 0.5 <= took < 5, f"the loss was found after {took:.1f}s, not by the closed connections"
            began = anyio.current_time()
            again = await host.next_rendezvous()
            assert (again.rank, again.world_size) == (0, 1)
            assert anyio.current_time() - began < 10, "the round after the loss waited for the last call"


@pytest.mark.parametrize(
    ("conf", "sig"),
    [("disconnect_grace=0.5", signal.SIGSTOP), ("disconnect_grace=0", signal.SIGKILL)],
    ids=["silent node", "disconnect_grace=0"],
)
async def test_a_silent_node_and_disconnect_grace_0_wait_for_the_keep_alive(conf: str, sig: signal.Signals) -> None:
    """A stopped node (SIGSTOP: its connections stay open and it sends nothing, as behind a partition) is found by
    the keep-alive only; with ``disconnect_grace=0`` so is a killed one (torch's behaviour)."""
    keep_alive = 0.5 * 20
    with anyio.fail_after(60):
        async with hosted_run(conf) as (host, node):
            took = await _lost_after(host, node, sig)
            assert took >= keep_alive * 0.9, f"found after {took:.1f}s, before the keep-alive's {keep_alive:g}s"


@pytest.mark.parametrize(
    ("key", "value", "words"),
    [
        ("disconnect_grace", "-1", "disconnect_grace=-1.0: must be >= 0 seconds"),
        ("disconnect_grace", "soon", "disconnect_grace='soon': must be a number of seconds"),
        ("fast_quorum", "maybe", "fast_quorum='maybe': must be a boolean"),
    ],
)
def test_bad_keys_are_refused_naming_the_value(key: str, value: str, words: str) -> None:
    params = RendezvousParameters("c10d", "127.0.0.1:29400", "run", 1, 2, **{key: value})
    with pytest.raises(ConfigurationError, match=words):
        c10d_settings(params)


def test_a_close_reported_from_a_plain_asyncio_callback_is_timed() -> None:
    """asyncio's transport reports a close from a protocol callback; in a loop started without anyio
    (``asyncio.run``, as an application embedding ``aelastic.launch`` does) anyio's clock cannot be read there, so
    the hook must not read it (it raised, and the dead node was never evicted)."""

    async def main() -> frozenset[str]:
        watch = DisconnectWatch(0.05)
        watch.on_connection("10.0.0.2:4000", True)
        loop = asyncio.get_running_loop()
        reported: asyncio.Future[None] = loop.create_future()

        def closed() -> None:  # as asyncio runs connection_lost: a callback, outside any task
            try:
                watch.on_connection("10.0.0.2:4000", False)
            except Exception as exc:
                reported.set_exception(exc)
            else:
                reported.set_result(None)

        loop.call_soon(closed)
        await reported
        return await asyncio.wait_for(watch.wait_gone(), 10)

    assert asyncio.run(main()) == frozenset({"10.0.0.2"})
