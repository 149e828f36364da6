"""Rendezvous nodes as separate OS processes over the c10d backend; one is killed with SIGKILL."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import pytest
from aelastic.store.server import open_store_server

pytestmark = pytest.mark.anyio

NODE = str(Path(__file__).with_name("rdzv_node.py"))
INTERVAL, ATTEMPTS = 0.2, 3


class NodeProcess:
    def __init__(self, process: anyio.abc.Process) -> None:
        self.process = process
        assert process.stdout is not None
        self._lines = process.stdout

    async def next_event(self) -> dict[str, Any]:
        buffer = b""
        while b"\n" not in buffer:
            buffer += await self._lines.receive(1)
        return dict(json.loads(buffer))


async def spawn(endpoint: str, run_id: str, n: int) -> NodeProcess:
    args = [sys.executable, NODE, endpoint, run_id, str(n), str(n), "is_host=false",
            f"keep_alive_interval={INTERVAL}", f"keep_alive_max_attempt={ATTEMPTS}"]  # fmt: skip
    return NodeProcess(await anyio.open_process(args, stdout=subprocess.PIPE, stderr=None))


@pytest.fixture
async def endpoint() -> AsyncIterator[str]:
    async with open_store_server("127.0.0.1", 0) as server:
        yield f"127.0.0.1:{server.port}"


async def test_sigkilled_node_is_detected_by_the_survivors(endpoint: str) -> None:
    nodes = [await spawn(endpoint, "procs", 3) for _ in range(3)]
    try:
        with anyio.fail_after(30):
            events = [await node.next_event() for node in nodes]
        assert sorted(e["rank"] for e in events) == [0, 1, 2]
        assert {e["world_size"] for e in events} == {3}

        victim, survivors = nodes[1], [nodes[0], nodes[2]]
        victim.process.send_signal(signal.SIGKILL)
        killed_at = anyio.current_time()
        with anyio.fail_after(INTERVAL * ATTEMPTS + 1.0 + 5.0):
            changes = [await node.next_event() for node in survivors]
        detected = anyio.current_time() - killed_at
        assert all(c["event"] == "change" and "round" in c["reason"] for c in changes)
        assert detected <= INTERVAL * ATTEMPTS + 1.0 + INTERVAL
    finally:
        for node in nodes:
            if node.process.returncode is None:
                node.process.kill()
            with anyio.CancelScope(shield=True):
                await node.process.wait()
