"""A job of the restartable trainer (``restartable_trainer.py``) on the fault suite's hosts, and what tests read of
it."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from .conftest import DEADLINE, FAST_CONF, Cluster, Host, Proc

TRAINER = Path(__file__).resolve().parent / "restartable_trainer.py"
RECVMSG = 47  # recvmsg(2) on x86_64: where an idle standby sleeps once its preload is done


def agent(
    cluster: Cluster, host: Host, schedule: Path, *flags: str, steps: int = 100000, env: dict[str, str] | None = None
) -> Proc:
    """``aelastic run`` of the restartable trainer on ``host``: two workers, standbys, c10d on h0."""
    return cluster.spawn(
        host,
        sys.executable, "-m", "aelastic", "--log-level", "DEBUG", "run", "--nnodes", "2", "--nproc-per-node", "2",
        "--prewarm", "--max-restarts", "3", "--shutdown-timeout", "2", "--local-addr", host.addr,
        "--log-dir", host.dir / "logs", *cluster.c10d(FAST_CONF), *flags, TRAINER, cluster.out,
        log="agent",
        env={"FAULTS_HOST": host.name, "FAULTS_STEP_PAUSE": "0.05", "FAULTS_STEPS": str(steps),
             "FAULTS_SCHEDULE": str(schedule), "GLOO_SOCKET_IFNAME": "eth0", "OMP_NUM_THREADS": "1", **(env or {})},
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
            if b"aelastic.worker._standby" not in Path(f"/proc/{child}/cmdline").read_bytes():
                continue
            idle += Path(f"/proc/{child}/syscall").read_text().split()[0] == str(RECVMSG)
        except OSError:
            continue
    return idle >= count


def progress(cluster: Cluster) -> dict[int, dict[str, Any]]:
    """The latest progress record of each pid."""
    return {r["pid"]: r for r in cluster.records("progress")}


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return None


def steady(cluster: Cluster, agents: list[Proc], ranks: int = 4) -> dict[int, int]:
    """Wait until every rank trains and every agent's standbys have preloaded (a job minutes in); each rank's pid."""
    cluster.wait_for(f"{ranks} ranks training", lambda: len({r["rank"] for r in progress(cluster).values()
                                                             if r["step"] >= 5}) == ranks)  # fmt: skip
    workers = set(progress(cluster))
    cluster.wait_for("every standby preloaded", lambda: all(standbys_ready(a, 2, workers) for a in agents))
    return {r["rank"]: r["pid"] for r in progress(cluster).values()}


def resumed(cluster: Cluster, step: int, since: float, ranks: int = 4) -> dict[int, dict[str, Any]]:
    """Wait until every rank is done with ``step`` again after ``since``; each rank's progress record."""

    def check() -> dict[int, dict[str, Any]] | None:
        done = {r["rank"]: r for r in progress(cluster).values() if r["step"] >= step and r["time"] > since}
        return done if len(done) == ranks else None

    return cluster.wait_for(f"every rank past step {step} again", check, DEADLINE)


def go(cluster: Cluster, step: int | None = None) -> None:
    """Say go: for ``step``, or (``None``) for the first step from now."""
    tmp = cluster.out / ".go"
    tmp.write_text("" if step is None else str(step))
    tmp.rename(cluster.out / "go")
