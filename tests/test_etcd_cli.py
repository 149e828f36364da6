"""``aelastic run --rdzv-backend etcd`` end to end: agent processes, a real etcd, real gloo workers; and the one-line
errors a user gets for an etcd endpoint that cannot work."""

from __future__ import annotations

import socket
import sys
import uuid
from pathlib import Path

import anyio
import pytest
from helpers.etcd import reader

pytestmark = pytest.mark.anyio

ALLREDUCE = str(Path(__file__).resolve().parent.parent / "examples" / "allreduce.py")


def aelastic_run(loop: str, endpoint: str, *flags: str) -> list[str]:
    """The agent runs on the test's event loop (asyncio or trio), so the parametrization covers both."""
    return [
        sys.executable, "-m", "aelastic", "--async-backend", loop, "run",
        "--rdzv-backend", "etcd", "--rdzv-endpoint", endpoint, *flags,
    ]  # fmt: skip


async def run(command: list[str]) -> tuple[int, str, str]:
    with anyio.fail_after(120):  # generous: agents and torch workers on a small, shared machine
        result = await anyio.run_process(command, check=False)
    return result.returncode, result.stdout.decode(), result.stderr.decode()


@pytest.mark.torch
async def test_two_agents_run_a_gloo_job_over_etcd(etcd_endpoint: str, anyio_backend: str) -> None:
    run_id, prefix = uuid.uuid4().hex, f"/cli/{uuid.uuid4().hex}"
    command = aelastic_run(
        anyio_backend, etcd_endpoint, "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-id", run_id,
        "--rdzv-conf", f"key_prefix={prefix},last_call_timeout=1", ALLREDUCE,
    )  # fmt: skip
    results: list[tuple[int, str, str]] = []
    async with anyio.create_task_group() as tg:
        for _ in range(2):

            async def agent() -> None:
                results.append(await run(command))

            tg.start_soon(agent)
    assert [code for code, _, _ in results] == [0, 0], [err for _, _, err in results]
    output = "".join(out for _, out, _ in results)
    for rank in (0, 1):  # each worker all-reduced a one over gloo and got the world size
        assert f"rank {rank} world_size 2 tensor([2])" in output, output
    etcd3 = reader(etcd_endpoint)
    assert etcd3.range(f"{prefix}/{run_id}/state").kvs  # the rendezvous ran on etcd, under the prefix asked for
    assert not etcd3.range(f"{prefix}/{run_id}/alive/", prefix=True).kvs  # and both agents revoked their leases


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def assert_one_line(stderr: str, *needles: str) -> None:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert "Traceback" not in stderr, stderr
    errors = [line for line in lines if line.startswith("aelastic run: error: ")]
    assert len(errors) == 1, stderr
    for needle in needles:
        assert needle in errors[0], stderr


async def test_nothing_listening_is_one_line_naming_the_endpoint(anyio_backend: str) -> None:
    endpoint = f"127.0.0.1:{closed_port()}"
    code, _, stderr = await run(aelastic_run(anyio_backend, endpoint, "--rdzv-conf", "read_timeout=20", ALLREDUCE))
    assert code == 1
    assert_one_line(stderr, f"http://{endpoint}", "nothing listening")


async def test_wrong_scheme_is_refused_before_anything_starts(anyio_backend: str) -> None:
    code, _, stderr = await run(aelastic_run(anyio_backend, "ftp://127.0.0.1:2379", ALLREDUCE))
    assert code == 2
    assert_one_line(stderr, "ftp://127.0.0.1:2379", "http:// or https://")


async def test_tls_to_a_plain_etcd_is_one_line(etcd_endpoint: str, anyio_backend: str) -> None:
    endpoint = etcd_endpoint.replace("http://", "https://")
    code, _, stderr = await run(aelastic_run(anyio_backend, endpoint, "--rdzv-conf", "read_timeout=20", ALLREDUCE))
    assert code == 1
    assert_one_line(stderr, endpoint, "TLS")
