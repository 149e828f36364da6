"""In-process restarts across hosts: healthy workers keep their processes when a peer fails (issue 30).

Two hosts (network namespaces, c10d on h0), two workers each, ``--prewarm``, ``restartable_trainer.py`` (an
in-memory checkpoint every step). A fault is injected once the job is in its steady state (every agent's standbys
have preloaded, as in a job that fails minutes in). The times, from the fault (the failing worker's clock) to every
rank done with the step of the fault again (theirs; one machine, one clock), go to RESULTS.md.
"""

from __future__ import annotations

import json

import pytest

from .conftest import Cluster, report_time
from .restartable_job import agent, go, read_json, resumed, steady

pytestmark = pytest.mark.faults


def test_a_worker_that_raises_is_replaced_and_its_peers_keep_their_processes(cluster: Cluster) -> None:
    schedule = cluster.out / "schedule.json"
    schedule.write_text(json.dumps([["go", 1, "raise"]]))
    h0, h1 = cluster.hosts[:2]
    agents = [agent(cluster, host, schedule) for host in (h0, h1)]
    before = steady(cluster, agents)
    go(cluster)
    fault = cluster.wait_for("the fault", lambda: read_json(cluster.out / "fault-0.json"))
    step, at = fault["step"], fault["time"]
    done = resumed(cluster, step, at)
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
