"""An agent is SIGKILLed during the rendezvous, during training, and during the exit barrier."""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import pytest

from .conftest import C10D_PORT, PROBE, Cluster, Proc, report_time

pytestmark = [pytest.mark.faults, pytest.mark.torch]

RECOVERY = 60.0  # far below any TCP or gloo timeout: a recovery this fast was driven by the heartbeats


def node_id(agent: Proc) -> str:
    return f"{agent.host.addr}_{agent.pid}_0"


def states(probe: Proc) -> list[dict[str, Any]]:
    return [json.loads(line) for line in probe.output.splitlines() if line.startswith("{")]


def present(state: dict[str, Any], agent: Proc) -> bool:
    """Whether ``agent``'s node is in the state or has a join request pending in it."""
    return node_id(agent) in state["participants"] or any(
        agent.host.addr in r and str(agent.pid) in r for r in state["pending"]
    )


def test_agent_killed_while_waiting_in_the_rendezvous(cluster: Cluster) -> None:
    """min = max = 3: two agents wait for a third; one of them dies; the round must not count it."""
    h0, h1, h2 = cluster.hosts
    rdzv = cluster.c10d()
    waiting = [cluster.agent(h, nnodes="3", rdzv=rdzv) for h in (h0, h1)]
    probe = cluster.spawn(h0, sys.executable, PROBE, "watch", f"{h0.addr}:{C10D_PORT}", "faults", log="probe")
    cluster.wait_for("both agents joined", lambda: any(all(present(s, a) for a in waiting) for s in states(probe)))
    victim = waiting[1]
    victim.kill()
    killed = time.time()
    cluster.wait_for(
        "the dead agent removed",
        lambda: (s := states(probe)) and present(s[-1], waiting[0]) and not present(s[-1], victim),
    )
    report_time("agent SIGKILLed in rendezvous: removed", time.time() - killed, "the waiting dead node was removed")
    assert not any(s["complete"] for s in states(probe)), "no round completed with the dead node"
    # The job goes on with a rescheduled node on h1 and the third host.
    others = [cluster.agent(h1, nnodes="3", rdzv=rdzv, log="agent-again"), cluster.agent(h2, nnodes="3", rdzv=rdzv)]
    cluster.wait_training(cluster.hosts, 3)
    final = next(s for s in states(probe) if s["complete"])
    assert sorted(final["participants"]) == sorted(node_id(a) for a in [waiting[0], *others])


def test_agent_killed_during_training(cluster: Cluster) -> None:
    h0, h1, _ = cluster.hosts
    agents = [cluster.agent(h, nnodes="2:3", rdzv=cluster.c10d(), max_restarts=3) for h in cluster.hosts]
    first = cluster.wait_training(cluster.hosts, 3)
    # A node that joins more than the last call after the other two makes the world of three a second round: the
    # workers of the first one are old too, and restarts count from the world of three.
    old = cluster.records()
    agents[2].kill()
    killed = time.time()
    after = cluster.wait_training([h0, h1], 2, old=old, timeout=RECOVERY)
    report_time("agent SIGKILLed in training: survivors training", time.time() - killed, "survivors all-reduce")
    restarts = {sum(after[h]["round"]) - sum(first[h]["round"]) for h in after}
    assert restarts == {1}, (first, after)  # one restart, of either kind
    orphan = first["h2"]["pid"]
    cluster.wait_for(f"h2's worker {orphan} gone with its agent", lambda: not pid_alive(orphan), timeout=10)


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("victim", ["arrived", "awaited"])
def test_agent_killed_during_the_exit_barrier(cluster: Cluster, victim: str) -> None:
    """h2's worker lingers after the job's last step, so h0 and h1 wait for h2 in the exit barrier; then either
    h1 (arrived in the barrier) or h2 (the one awaited) is SIGKILLed. Nobody waits out exit_barrier_timeout.

    h2's worker is released only once h1 is out of the rendezvous state: finding a node dead that had finished
    its work must not restart h2's workers (that would let h0 leave the barrier and take the store with it)."""
    h0, _, h2 = cluster.hosts
    rdzv = cluster.c10d()
    agents = [cluster.agent(h, nnodes="3", rdzv=rdzv, env={"FAULTS_LINGER": "1"} if h is h2 else None)
              for h in cluster.hosts]  # fmt: skip
    cluster.wait_training(cluster.hosts, 3)
    (cluster.out / "stop").touch()
    cluster.wait_for("all workers done", lambda: len(cluster.records("done")) == 3)
    barrier = "torch.rendezvous.faults.0/torchelastic/agent/terminal_state"

    def arrivals() -> int:
        probe = cluster.spawn(h0, sys.executable, PROBE, "arrived", f"{h0.addr}:{C10D_PORT}", barrier, "3", log="count")
        probe.wait()
        return int(probe.output.split()[-1])

    cluster.wait_for("h0 and h1 in the exit barrier", lambda: arrivals() == 2)
    killed = time.time()
    if victim == "arrived":
        probe = cluster.spawn(h0, sys.executable, PROBE, "watch", f"{h0.addr}:{C10D_PORT}", "faults", log="probe")
        agents[1].kill()
        cluster.wait_for("h1 found dead", lambda: (s := states(probe)) and not present(s[-1], agents[1]))
        (cluster.out / "release").touch()
        survivors = [agents[0], agents[2]]
    else:
        agents[2].kill()
        survivors = agents[:2]
    for agent in survivors:
        assert agent.wait(timeout=RECOVERY) == 0, agent.output
    report_time(f"agent SIGKILLed in exit barrier ({victim}): others exit", time.time() - killed, "survivors exit 0")
