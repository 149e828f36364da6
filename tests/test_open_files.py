"""Open-file limits (issue 25, item 4): under ``ulimit -S -n 1024`` with a higher hard limit, ``aelastic run`` and
``aelastic store`` raise their soft limit to the hard one (one log line), the store's connection cap follows it, and
the workers inherit it.

1,500 real connections: TCPStore protocol clients (aelastic's, each with torch's validation handshake and a
request), all open at once, then torch's own TCPStore client reads the count.
"""

from __future__ import annotations

import re
import resource
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

CONNECTIONS = 1500
DEADLINE = 240.0  # one command on a loaded machine
AELASTIC = [sys.executable, "-m", "aelastic", "--log-level", "INFO"]

# Opens CONNECTIONS clients to the store at argv[1]:argv[2] (raising its own soft limit first, as any client of
# this many connections must), holds them all open, makes one request on each, then checks the count with torch's
# TCPStore client. Prints its limits before and after.
CLIENT = """
import asyncio, contextlib, os, resource, sys
from datetime import timedelta

host, port, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
print(f"client limit {soft} {hard}", flush=True)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))

from aelastic.store import open_store_client

async def main():
    async with contextlib.AsyncExitStack() as stack:
        clients = [await stack.enter_async_context(open_store_client(host, port)) for _ in range(count)]
        totals = [await client.add("served", 1) for client in clients]
        assert sorted(totals) == list(range(1, count + 1)), totals[-3:]
        import torch.distributed as dist  # the 1501st connection: torch's own client
        store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=60))
        print(f"served {int(store.add('served', 0))} connections at once", flush=True)

asyncio.run(asyncio.wait_for(main(), 90))  # a refused connection is retried: fail, do not hang
"""


@pytest.fixture
def low_soft_limit() -> str:
    """The shell prefix that starts a command under a soft limit of 1024 (hard: at least 4096, where the hard limit
    here is lower and may be raised; else skip)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 4096:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, 4096))  # root only: this test process's hard limit
        except (ValueError, OSError):
            pytest.skip(f"the hard open-file limit is {hard} (< 4096) and cannot be raised here")
    return "ulimit -S -n 1024 && exec"


def test_a_standalone_jobs_store_serves_1500_connections_under_ulimit_1024(low_soft_limit: str, tmp_path: Path) -> None:
    """The worker (the client) inherits the raised limit; the agent's store serves all 1,500 connections."""
    worker = tmp_path / "worker.py"
    worker.write_text(CLIENT.replace("host, port, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])",
                                     "host, port, count = os.environ['MASTER_ADDR'], int(os.environ['MASTER_PORT']), "
                                     f"{CONNECTIONS}"))  # fmt: skip
    command = shlex.join([*AELASTIC, "run", "--standalone", "--nproc-per-node", "1", str(worker)])
    done = subprocess.run(
        ["sh", "-c", f"{low_soft_limit} {command}"], capture_output=True, text=True, timeout=DEADLINE, check=False
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    shown = hard if hard != resource.RLIM_INFINITY else r"\d+"
    assert re.search(
        rf"aelastic run: raised the open-file limit \(ulimit -n\) from 1024 to the hard limit {shown}", out
    )
    assert re.search(r"client limit (\d+) \1", out), out[-3000:]  # the worker inherited soft == hard
    assert "client limit 1024 " not in out
    assert f"served {CONNECTIONS} connections at once" in out


def test_aelastic_store_serves_1500_connections_under_ulimit_1024(low_soft_limit: str) -> None:
    """``aelastic store`` raises its limit before it serves; a client process raising its own serves 1,500."""
    command = shlex.join([*AELASTIC, "store", "--host", "127.0.0.1", "--port", "0"])
    server = subprocess.Popen(
        ["sh", "-c", f"{low_soft_limit} {command}"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert server.stdout is not None
        line = server.stdout.readline()  # the one line it prints once it listens
        found = re.search(r"listening on 127\.0\.0\.1:(\d+)", line)
        assert found, line
        client = subprocess.run(
            [sys.executable, "-c", CLIENT, "127.0.0.1", found[1], str(CONNECTIONS)],
            capture_output=True, text=True, timeout=DEADLINE, check=False,
            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (1024, resource.getrlimit(
                resource.RLIMIT_NOFILE)[1])),
        )  # fmt: skip
        assert client.returncode == 0, client.stdout + client.stderr[-3000:]
        assert "client limit 1024 " in client.stdout  # it started low and raised its own
        assert f"served {CONNECTIONS} connections at once" in client.stdout
    finally:
        server.terminate()
        _, err = server.communicate(timeout=DEADLINE)
    assert server.returncode == 0, err
    assert "aelastic store: raised the open-file limit (ulimit -n) from 1024 to the hard limit" in err


def test_nothing_to_raise_logs_nothing() -> None:
    """Soft already at the hard limit: no change, no line."""
    code = (
        "import logging, resource; logging.basicConfig(level=logging.INFO); "
        "from aelastic.config.limits import raise_open_file_limit as r; "
        "s, h = resource.getrlimit(resource.RLIMIT_NOFILE); resource.setrlimit(resource.RLIMIT_NOFILE, (h, h)); "
        "print(r('x'))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=DEADLINE, check=True)
    assert done.stdout.strip() == "None"
    assert "raised" not in done.stderr
