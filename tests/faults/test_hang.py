"""Hangs found from outside (``--hang-timeout``, issue 31), and survivors released from a stopped peer (issue 30).

Two hosts (network namespaces, c10d on h0), two workers each, ``restartable_trainer.py`` with ``--prewarm`` and
``--hang-timeout 10``: the agents read their workers' CPU time from ``/proc`` and agree through the round's store
that no rank of the job moves; nothing in the trainer cooperates (no heartbeat).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from .conftest import Cluster, Proc, report_time
from .restartable_job import agent, go, progress, read_json, resumed, steady

pytestmark = [pytest.mark.faults, pytest.mark.torch]

HANG = 10.0
DETECTION = HANG + HANG / 10  # the timeout, and the period the CPU time is sampled at


def start(cluster: Cluster, schedule: list[list[object]], **env: str) -> tuple[list[Proc], dict[int, int]]:
    path = cluster.out / "schedule.json"
    path.write_text(json.dumps(schedule))
    agents = [agent(cluster, host, path, "--hang-timeout", str(HANG), env=env) for host in cluster.hosts[:2]]
    return agents, steady(cluster, agents)


def named(agents: list[Proc], rank: int) -> float | None:
    """When the last agent logged the verdict naming ``rank`` (every node names it), else None."""
    times = [a.logged_at(rf"hang: .* rank {rank} named") for a in agents]
    return None if None in times else max(t for t in times if t is not None)


def test_a_rank_that_sleeps_outside_the_collective_is_named_with_its_stack_and_the_job_restarts(
    cluster: Cluster,
) -> None:
    agents, before = start(cluster, [["go", 3, "sleep"]])
    go(cluster)
    fault = cluster.wait_for("the fault", lambda: read_json(cluster.out / "fault-0.json"))
    at = cluster.wait_for("every agent naming rank 3", lambda: named(agents, 3))
    took = at - fault["time"]
    print(f"[hang] rank 3 sleeps at step {fault['step']}: named {took:.2f} s later")
    report_time("hang: a rank sleeps outside the collective (2 hosts x 2 workers, --hang-timeout 10)", took,
                "from the fault to every agent naming the rank, with its stack")  # fmt: skip
    assert took < HANG + 5, took  # the bound: within 15 s
    for proc in agents:  # every node names rank 3 alone, and sees the others in the all-reduce
        verdict = proc.output[proc.output.index("hang: ") :]
        assert re.search(r"rank 3 named \(the others wait for it in a collective\)", verdict), verdict
        assert re.search(r"rank 3 \(node \d, .*\): sleeping, outside any collective, at fault \(", verdict), verdict
        assert "the others: ranks 0-2 in all_reduce" in verdict, verdict
    host = next(i for i, h in enumerate(cluster.hosts) if h.name == fault["host"])  # rank 3's
    output = cluster.wait_for("the failure report", lambda: "Root Cause" in agents[host].output and agents[host].output)
    report = output[output.index("Root Cause") :]
    assert "rank      : 3 (local_rank: 1)" in report, report
    assert "hung: no rank of the job made progress (CPU time, bytes read or written) for 10 s" in report, report
    assert re.search(r"fault \(.*restartable_trainer\.py:\d+\)", report), report  # its stack, innermost first
    stacks = list(Path(cluster.hosts[host].dir / "logs").glob("*/attempt_0/1/stacks.txt"))
    assert stacks, cluster.hosts[host].dir  # every rank's stack, in its log directory
    assert "hang:" in stacks[0].read_text()
    # The job restarts: rank 3 replaced, its peers in their processes, every rank past the step again.
    done = resumed(cluster, fault["step"], at)
    assert done[3]["pid"] != before[3]
    assert {r: done[r]["pid"] for r in (0, 1, 2)} == {r: before[r] for r in (0, 1, 2)}


def test_a_long_step_whose_cpu_time_moves_is_not_a_hang(cluster: Cluster) -> None:
    agents, before = start(cluster, [["go", 1, "busy"]], FAULTS_BUSY="20")
    go(cluster)
    fault = cluster.wait_for("the busy step", lambda: read_json(cluster.out / "fault-0.json"))
    done = resumed(cluster, fault["step"] + 1, fault["time"] + 20)  # the others waited 20 s in the all-reduce
    assert {r: done[r]["pid"] for r in done} == before
    for proc in agents:
        assert "hang:" not in proc.output, proc.output[-3000:]
        assert proc.running()


def test_a_checkpoint_written_to_slow_storage_is_not_a_hang(cluster: Cluster) -> None:
    """Rank 0 writes 24 MiB at 1 MiB/s (25 s, its CPU nearly idle) while the others wait in the all-reduce: no hang
    is declared under --hang-timeout 10, and every rank goes on in its process."""
    agents, before = start(cluster, [["go", 0, "write"]])
    go(cluster)
    fault = cluster.wait_for("the slow write", lambda: read_json(cluster.out / "fault-0.json"))
    done = resumed(cluster, fault["step"] + 1, fault["time"] + 24)  # the others waited in the all-reduce
    assert {r: done[r]["pid"] for r in done} == before
    for proc in agents:
        assert "hang:" not in proc.output, proc.output[-3000:]
        assert proc.running()


def test_a_rank_stopped_inside_an_all_reduce_is_replaced_and_its_peers_released(cluster: Cluster) -> None:
    """Issue 30: the three peers blocked in the all-reduce with a SIGSTOPped rank are released (its death closes
    their connections) and train in a new round, in their processes, within the detection bound + 1 s."""
    agents, before = start(cluster, [["go", 2, "stop"]])
    step = max(r["step"] for r in progress(cluster).values()) + 10
    go(cluster, step)
    fault = cluster.wait_for("the stop", lambda: read_json(cluster.out / "fault-0.json"))
    done = resumed(cluster, step, fault["time"])
    took = max(r["time"] for r in done.values()) - fault["time"]
    print(f"[hang] rank 2 stopped in an all-reduce at step {step}: every rank past it again {took:.2f} s later")
    report_time("survivors: a rank SIGSTOPped inside an all-reduce (2 hosts x 2 workers, --hang-timeout 10)", took,
                f"from the stop to every rank past its step again; detection bound {DETECTION:g} s")  # fmt: skip
    assert done[2]["pid"] != before[2]
    assert {r: done[r]["pid"] for r in (0, 1, 3)} == {r: before[r] for r in (0, 1, 3)}
    assert took < DETECTION + 10, took  # generous on a shared machine: the figure is what RESULTS.md reports
    assert all(re.search(r"rank 2 named \(its process state\)", a.output) for a in agents)
