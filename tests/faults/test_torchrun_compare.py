"""torchrun beside aelastic in fault scenarios that torchrun can run the same way: the same hosts, trainer, torchrun
flags and liveness settings (torch takes the keep-alive interval in whole seconds: 1 s, 3 attempts, for both).

Each test records what happened under each launcher in ``benchmarks/out/faults.json``: the recovery time when
the survivors trained on in a smaller world, else what happened instead within the observation window. These
runs are for RESULTS.md, not for CI: they are deselected by default (``pytest -m torchrun_compare tests/faults``
runs them), since torchrun's non-recoveries take the whole window.
"""

from __future__ import annotations

import time

import pytest
from helpers.procs import alive

from .conftest import C10D_PORT, Cluster, Proc, report_time

pytestmark = [pytest.mark.faults, pytest.mark.torch, pytest.mark.torchrun_compare]

CONF = "keep_alive_interval=1,keep_alive_max_attempt=3,heartbeat_timeout=2,last_call_timeout=1"
WINDOW = 45.0  # how long the survivors get: 15 liveness graces, far below gloo's 30-minute timeout
LAUNCHERS = pytest.mark.parametrize("launcher", ["aelastic", "torchrun"])


def start(cluster: Cluster, launcher: str) -> list[Proc]:
    """One agent per host; h0's serves the store. torchrun decides that by the machine's hostname, which names the
    real machine, not the namespace: ``is_host`` says it (for both launchers alike)."""
    endpoint = f"{cluster.hosts[0].addr}:{C10D_PORT}"
    agents = []
    for h in cluster.hosts:
        conf = f"{CONF},is_host={int(h is cluster.hosts[0])}"
        rdzv = ["--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", "compare", "--rdzv-conf", conf]
        agents.append(cluster.agent(h, nnodes="2:3", rdzv=rdzv, max_restarts=3, launcher=launcher))
    return agents


def survivors_recover(cluster: Cluster, first: dict[str, dict[str, object]]) -> float | None:
    """Seconds until h0 and h1 train in a world of 2, or None if they did not within the window."""
    started = time.time()
    try:
        cluster.wait_training(cluster.hosts[:2], 2, old=list(first.values()), timeout=WINDOW)  # type: ignore[arg-type]
    except AssertionError:
        return None
    return time.time() - started


def still_training(cluster: Cluster, host: str, pid: int) -> bool:
    """Whether ``pid``'s progress file on ``host`` moves (a worker of the old world of 3 still all-reducing)."""
    path = cluster.out / host / f"progress-{pid}.json"
    before = path.read_text() if path.exists() else ""
    time.sleep(2)
    return path.exists() and path.read_text() != before


@LAUNCHERS
def test_agent_sigkilled_in_training(cluster: Cluster, launcher: str) -> None:
    start(cluster, launcher)
    first = cluster.wait_training(cluster.hosts, 3)
    victim = cluster.procs[2]
    victim.kill()
    took = survivors_recover(cluster, first)
    orphan = int(first["h2"]["pid"])  # type: ignore[call-overload]
    orphaned = alive(orphan)
    scenario = "agent SIGKILLed in training: survivors training (interval 1 s)"
    if took is not None:
        report_time(
            scenario,
            took,
            "survivors all-reduce in a world of 2",
            system=launcher,
            outcome=f"recovered; the dead agent's worker {'survives' if orphaned else 'died with it'}",
        )
    else:
        training = still_training(cluster, "h0", int(first["h0"]["pid"]))  # type: ignore[call-overload]
        report_time(scenario, None, "survivors all-reduce in a world of 2", system=launcher,
                    outcome=f"no smaller world within {WINDOW:g} s; the dead agent's worker "
                    f"{'survives (an orphan)' if orphaned else 'died'}; the old world of 3 "
                    f"{'keeps training with it' if training else 'is stuck'}")  # fmt: skip
    if launcher == "aelastic":
        assert took is not None, cluster.logs()
        cluster.wait_for(f"h2's worker {orphan} gone with its agent", lambda: not alive(orphan), timeout=10)


@LAUNCHERS
def test_partition(cluster: Cluster, launcher: str) -> None:
    start(cluster, launcher)
    first = cluster.wait_training(cluster.hosts, 3)
    cluster.partition(cluster.hosts[2])
    took = survivors_recover(cluster, first)
    scenario = "partition: survivors training (interval 1 s)"
    if took is not None:
        report_time(scenario, took, "survivors all-reduce in a world of 2", system=launcher, outcome="recovered")
    else:
        old = int(first["h0"]["pid"])  # type: ignore[call-overload]
        state = "stalled" if alive(old) and not still_training(cluster, "h0", old) else "not stalled"
        report_time(scenario, None, "survivors all-reduce in a world of 2", system=launcher,
                    outcome=f"no smaller world within {WINDOW:g} s; the survivors' workers of the world of 3 are "
                    f"alive and {state} (the all-reduce needs the cut-off host; gloo's timeout is 30 min)")  # fmt: skip
    if launcher == "aelastic":
        assert took is not None, cluster.logs()
