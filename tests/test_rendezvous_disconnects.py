"""A node's agent dies and its kernel closes its connections: the c10d host learns of it from the store server's
connection events (``ServerSettings.on_connection``) and evicts the node after a short grace for a reconnect,
instead of after the keep-alive misses. A silent loss (the relay goes silent: power, partition) still waits for
the keep-alive.

Nodes here are OS processes on one machine (``rdzv_node.py``-style scripts), each reaching the host's store from
an address of its own on the loopback network (127.0.0.x), as nodes of a cluster reach it from their own hosts.
"""

from __future__ import annotations

import anyio
import pytest

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
