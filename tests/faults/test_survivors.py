"""In-process restarts across hosts: healthy workers keep their processes when a peer fails (issue 30).

Two hosts (network namespaces, c10d on h0), two workers each, ``--prewarm``, ``restartable_trainer.py`` (an
in-memory checkpoint every step). A fault is injected once the job is in its steady state (every agent's standbys
have preloaded, as in a job that fails minutes in). The times, from the fault (the failing worker's clock) to every
rank done with the step of the fault again (theirs; one machine, one clock), go to RESULTS.md.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from .conftest import DEADLINE, FAST_CONF, Cluster, Host, Proc, report_time

pytestmark = pytest.mark.faults

TRAINER = Path(__file__).resolve().parent / "restartable_trainer.py"
RECVMSG = 47  # recvmsg(2) on x86_64: where an idle standby sleeps once its preload is done


def agent(cluster: Cluster, host: Host, schedule: Path, *flags: str, steps: int = 100000) -> Proc:
    """``aelastic run`` of the restartable trainer on ``host``: two workers, standbys, c10d on h0."""
    return cluster.spawn(
        host,
        sys.executable, "-m", "aelastic", "--log-level", "DEBUG", "run", "--nnodes", "2", "--nproc-per-node", "2",
        "--prewarm", "--max-restarts", "3", "--shutdown-timeout", "2", "--local-addr", host.addr,
        "--log-dir", host.dir / "logs", *cluster.c10d(FAST_CONF), *flags, TRAINER, cluster.out,
        log="agent",
        env={"FAULTS_HOST": host.name, "FAULTS_STEP_PAUSE": "0.05", "FAULTS_STEPS": str(steps),
             "FAULTS_SCHEDULE": str(schedule), "GLOO_SOCKET_IFNAME": "eth0", "OMP_NUM_THREADS": "1"},
    )  # fmt: skip


def standbys_ready(agent: Proc, count: int, workers: set[int]) -> bool:
    """Whether ``agent`` has ``count`` standbys, not ``workers``, that finished their preload (asleep in recvmsg)."""
    try:
        children = Path(f"/proc/{agent.pid}/task/{agent.pid}/children").read_text().split()
    except OSError:
        return False
    idle = 0
    for child in (c for c in children if int(c) not in workers):
        try:
            if b"aelastic.agent.prewarm.child" not in Path(f"/proc/{child}/cmdline").read_bytes():
                continue
            idle += Path(f"/proc/{child}/syscall").read_text().split()[0] == str(RECVMSG)
        except OSError:
            continue
    return idle >= count


def progress(cluster: Cluster) -> dict[int, dict[str, Any]]:
    """The latest progress record of each pid."""
    return {r["pid"]: r for r in cluster.records("progress")}


def test_a_worker_that_raises_is_replaced_and_its_peers_keep_their_processes(cluster: Cluster) -> None:
    schedule = cluster.out / "schedule.json"
    schedule.write_text(json.dumps([["go", 1, "raise"]]))
    h0, h1 = cluster.hosts[:2]
    agents = [agent(cluster, host, schedule) for host in (h0, h1)]
    cluster.wait_for("4 ranks training", lambda: len({r["rank"] for r in progress(cluster).values()
                                                         if r["step"] >= 5}) == 4)  # fmt: skip
    workers = set(progress(cluster))
    cluster.wait_for("every standby preloaded", lambda: all(standbys_ready(a, 2, workers) for a in agents))
    before = {r["rank"]: r["pid"] for r in progress(cluster).values()}
    (cluster.out / "go").touch()
    fault = cluster.wait_for("the fault", lambda: _read(cluster.out / "fault-0.json"))
    step, at = fault["step"], fault["time"]

    def resumed() -> dict[int, dict[str, Any]] | None:
        done = {r["rank"]: r for r in progress(cluster).values() if r["call"] >= 1 and r["step"] >= step
                and r["time"] > at}  # fmt: skip
        return done if len(done) == 4 else None

    done = cluster.wait_for("every rank past the step of the fault again", resumed, DEADLINE)
    after = {rank: r["pid"] for rank, r in done.items()}
    assert after[1] != before[1], (before, after)  # the failed worker was replaced
    assert {r: after[r] for r in (0, 2, 3)} == {r: before[r] for r in (0, 2, 3)}, (before, after)  # the others kept
    starts = [json.loads(p.read_text()) for p in cluster.out.glob("h*/start-*.json")]
    second = sorted((s["rank"], s["call"], s["start"], s["loaded"]["source"]) for s in starts
                    if s["loaded"] is not None)  # fmt: skip
    assert second == [(0, 2, step, "memory"), (1, 1, step, "memory"), (2, 2, step, "memory"), (3, 2, step, "memory")]
    took = max(r["time"] for r in done.values()) - at
    print(f"[survivors] fault at step {step}: every rank done with it again {took:.3f} s later")
    report_time("survivors: a worker raises (2 hosts x 2 workers)", took,
                "from the fault to every rank done with the step of the fault again (3 kept, 1 replaced)")  # fmt: skip
    for proc in agents:
        assert proc.running(), proc.output


def _read(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return None
