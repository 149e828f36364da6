"""``aelastic run`` with the job's own etcd, as a user runs it: four agents on loopback addresses (127.0.0.1-4,
each named by ``--local-addr``), ``--rdzv-backend etcd --rdzv-endpoint embedded:...``, the first three running
the members. Whatever ends the job (success, a worker's failure, Ctrl-C, an agent killed outright), no etcd
process, data directory or port is left behind (issue 33).

The multi-host scenarios (hosts lost, the cluster healed, the job training on) are in ``tests/faults``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.etcd import job_etcd_left_behind
from helpers.procs import free_port_pair, poll_until

pytestmark = pytest.mark.timeout(600)

HOSTS = ("127.0.0.1", "127.0.0.2", "127.0.0.3", "127.0.0.4")
DEADLINE = 120.0  # generous: four agents and three etcd members on a small, shared machine
FAST = "keep_alive_interval=0.5,keep_alive_max_attempt=3,heartbeat_timeout=2,last_call_timeout=1"
WORKER = """\
import os, pathlib, sys, time
folder, mode, rank = pathlib.Path(sys.argv[1]), sys.argv[2], os.environ["RANK"]
(folder / f"started.{rank}").write_text(str(os.getpid()))
if mode == "fail" and rank == "0":
    sys.exit(1)
while mode == "wait":
    time.sleep(1)
"""


class Job:
    """Four agents of one job with its own etcd, each in a process group of its own (as a terminal's job is)."""

    def __init__(self, tmp_path: Path, mode: str, nnodes: str = "4") -> None:
        self.folder = tmp_path
        self.run_id = f"agents{os.getpid()}{tmp_path.name[-6:]}".replace("_", "")
        self.port = free_port_pair(HOSTS)
        script = tmp_path / "worker.py"
        script.write_text(WORKER)
        self.agents = [self._start(i, host, script, mode, nnodes) for i, host in enumerate(HOSTS)]

    def _start(self, i: int, host: str, script: Path, mode: str, nnodes: str) -> subprocess.Popen[bytes]:
        argv = [
            sys.executable, "-m", "aelastic", "--log-level", "INFO", "run", "--nnodes", nnodes, "--nproc-per-node",
            "1", "--max-restarts", "0", "--shutdown-timeout", "2", "--rdzv-backend", "etcd",
            "--rdzv-endpoint", "embedded:" + ",".join(HOSTS), "--rdzv-conf", f"etcd_port={self.port},{FAST}",
            "--rdzv-id", self.run_id, "--local-addr", host, script, self.folder, mode,
        ]  # fmt: skip
        with (self.folder / f"agent{i}.log").open("wb") as log:
            return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                    env={**os.environ, "PYTHONUNBUFFERED": "1"})  # fmt: skip

    def logs(self) -> str:
        return "\n".join(f"--- agent {i}:\n{(self.folder / f'agent{i}.log').read_text()[-3000:]}" for i in range(4))

    def wait_started(self, ranks: int) -> None:
        """Wait until ``ranks`` workers have started (their files appear: no event to await)."""
        poll_until(f"{ranks} workers started", lambda: len(list(self.folder.glob("started.*"))) >= ranks, DEADLINE,
                   0.05, self.logs)  # fmt: skip

    def wait(self) -> list[int]:
        try:
            return [agent.wait(DEADLINE) for agent in self.agents]
        except subprocess.TimeoutExpired:
            raise AssertionError(f"an agent still runs after {DEADLINE:g} s\n{self.logs()}") from None
        finally:
            for agent in self.agents:
                if agent.poll() is None:
                    os.killpg(agent.pid, signal.SIGKILL)
                    agent.wait()

    def left_behind(self) -> list[str]:
        return job_etcd_left_behind(self.run_id, [(h, p) for h in HOSTS for p in (self.port, self.port + 1)])


def test_success_leaves_nothing_behind(tmp_path: Path) -> None:
    job = Job(tmp_path, "ok")
    assert job.wait() == [0, 0, 0, 0], job.logs()
    assert sorted(p.name for p in tmp_path.glob("started.*")) == ["started.0", "started.1", "started.2",
                                                                  "started.3"]  # fmt: skip
    assert job.left_behind() == [], job.logs()
    logs = job.logs()
    assert "the job's etcd: 3 of 3 member(s) up (127.0.0.1, 127.0.0.2, 127.0.0.3): it survives the loss of one " \
           "member's node" in logs  # fmt: skip


def test_a_failed_job_leaves_nothing_behind(tmp_path: Path) -> None:
    job = Job(tmp_path, "fail")
    codes = job.wait()
    assert codes.count(0) < 4, job.logs()
    assert job.left_behind() == [], job.logs()


def test_ctrl_c_leaves_nothing_behind(tmp_path: Path) -> None:
    job = Job(tmp_path, "wait")
    job.wait_started(4)
    for agent in job.agents:
        os.killpg(agent.pid, signal.SIGINT)  # a terminal's Ctrl-C reaches the whole foreground group
    codes = job.wait()
    assert all(code != 0 for code in codes), job.logs()
    assert job.left_behind() == [], job.logs()


def test_an_agent_killed_outright_leaves_nothing_behind(tmp_path: Path) -> None:
    """SIGKILL to a member's agent (its node's loss, as far as its processes go): its guard stops its member and
    removes the data; the others run on in a world of 3 (``--nnodes 3:4``) and are then stopped."""
    job = Job(tmp_path, "wait", nnodes="3:4")
    job.wait_started(4)
    job.agents[0].kill()
    job.agents[0].wait()
    ports = [(HOSTS[0], job.port), (HOSTS[0], job.port + 1)]
    poll_until("the killed agent's member gone", lambda: not job_etcd_left_behind(job.run_id, ports, HOSTS[0]),
               DEADLINE, 0.05, job.logs)  # fmt: skip
    for agent in job.agents[1:]:
        os.killpg(agent.pid, signal.SIGINT)
    job.wait()
    assert job.left_behind() == [], job.logs()
