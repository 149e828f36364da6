"""Rendezvous nodes as separate OS processes (c10d and etcd backends); one is killed with SIGKILL."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import pytest
from etcd3 import Client as Etcd3Client  # type: ignore[import-untyped]
from helpers.etcd import reader

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


async def spawn(endpoint: str, run_id: str, n: int, *conf: str, backend: str = "c10d") -> NodeProcess:
    args = [sys.executable, NODE, backend, endpoint, run_id, str(n), str(n), *conf]
    return NodeProcess(await anyio.open_process(args, stdout=subprocess.PIPE, stderr=None))


async def stop_all(nodes: list[NodeProcess]) -> None:
    with anyio.CancelScope(shield=True):
        for node in nodes:
            if node.process.returncode is None:
                node.process.kill()
            await node.process.wait()


@pytest.fixture
async def endpoint() -> AsyncIterator[str]:
    async with open_store_server("127.0.0.1", 0) as server:
        yield f"127.0.0.1:{server.port}"


async def test_sigkilled_node_is_detected_by_the_survivors(endpoint: str) -> None:
    conf = ("is_host=false", f"keep_alive_interval={INTERVAL}", f"keep_alive_max_attempt={ATTEMPTS}")
    nodes = [await spawn(endpoint, "procs", 3, *conf) for _ in range(3)]
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
        await stop_all(nodes)


def _snapshot(etcd3: Etcd3Client, prefix: str, revision: int) -> dict[bytes, tuple[int, bytes]]:
    kvs = etcd3.range(prefix, prefix=True, revision=revision).kvs or []
    return {kv.key: (kv.mod_revision, kv.value) for kv in kvs}


async def test_sigkilled_node_leaves_the_etcd_rendezvous_when_its_lease_expires(etcd_endpoint: str) -> None:
    """Over etcd a dead node's liveness key is deleted by etcd itself when the node's lease expires: nothing is
    written between the kill and that deletion (etcd3-py reads the history); then a survivor removes it."""
    prefix, run_id = f"/procs/{uuid.uuid4().hex}", "etcd-procs"
    conf = (f"key_prefix={prefix}", "keep_alive_interval=0.5", "keep_alive_max_attempt=2")  # 1 s leases
    nodes = [await spawn(etcd_endpoint, run_id, 3, *conf, backend="etcd") for _ in range(3)]
    try:
        with anyio.fail_after(60):
            events = [await node.next_event() for node in nodes]
        assert sorted(e["rank"] for e in events) == [0, 1, 2]
        etcd3 = reader(etcd_endpoint)
        root = f"{prefix}/{run_id}/"
        victim, survivors = nodes[1], [nodes[0], nodes[2]]
        alive = {kv.key: kv.lease for kv in etcd3.range(f"{root}alive/", prefix=True).kvs}
        assert len(alive) == 3
        (victim_key,) = [k for k in alive if k.decode().endswith(f"_{victim.process.pid}_0")]
        before = etcd3.range(root, prefix=True).header.revision

        victim.process.send_signal(signal.SIGKILL)
        with anyio.fail_after(30):
            changes = [await node.next_event() for node in survivors]
        # Each survivor names the victim as lost. The count is 1 or 2: the survivor that sees the change first
        # rejoins at once, which takes it out of round 0's participants too, before the other one may look.
        victim_id = victim_key.decode().rsplit("/", 1)[-1]
        assert all(
            c["event"] == "change" and c["reason"].startswith("round 0 lost ") and victim_id in c["reason"]
            for c in changes
        ), changes

        now = etcd3.range(root, prefix=True).header.revision
        history = [_snapshot(etcd3, root, r) for r in range(before, now + 1)]
        first_change = next(i for i in range(1, len(history)) if history[i] != history[0])
        expected = dict(history[0])
        del expected[victim_key]
        assert history[first_change] == expected, "the first write after the kill must be etcd deleting its key"
        # The victim's lease is gone (expired: nobody revoked it, and etcd kept the survivors' leases).
        assert etcd3.lease_time_to_live(alive[victim_key]).TTL == -1
        assert all(etcd3.lease_time_to_live(alive[k]).grantedTTL == 1 for k in alive if k != victim_key)
    finally:
        await stop_all(nodes)


async def test_a_c10d_run_does_not_import_the_etcd_driver() -> None:
    """h11 and aelastic.etcd load only for the etcd backend: a whole c10d job (CLI, agent, rendezvous, a worker)
    runs without them."""
    probe = (
        "import sys\n"
        "from aelastic.cli import main\n"
        "code = main(['run', '--standalone', '--nproc-per-node', '1', '--no-python', 'true'])\n"
        "loaded = sorted(m for m in sys.modules if m == 'h11' or m.startswith(('h11.', 'aelastic.etcd')))\n"
        "print(code, loaded)\n"
    )
    with anyio.fail_after(120):
        result = await anyio.run_process([sys.executable, "-c", probe], check=False)
    assert result.returncode == 0, result.stderr.decode()
    assert result.stdout.decode().split() == ["0", "[]"]
