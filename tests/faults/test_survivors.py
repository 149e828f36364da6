"""In-process restarts across hosts: healthy workers keep their processes when a peer fails (issue 30).

Two hosts (network namespaces, c10d on h0), two workers each, ``--prewarm``, ``restartable_trainer.py`` (an
in-memory checkpoint every step). A fault is injected once the job is in its steady state (every agent's standbys
have preloaded, as in a job that fails minutes in). The times, from the fault (the failing worker's clock) to every
rank done with the step of the fault again (theirs; one machine, one clock), go to RESULTS.md.
"""

from __future__ import annotations

import json
import re
import time

import pytest

from .conftest import Cluster, report_time
from .restartable_job import agent, go, progress, read_json, resumed, steady

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


def test_workers_held_in_a_collective_with_a_powered_off_host_are_replaced_without_waiting_out_their_grace(
    cluster: Cluster,
) -> None:
    """h2 (two of six ranks) is powered off: its link down, then every process of it killed; nothing closes. The
    survivors' workers are held in a gloo all-reduce with h2's, which never returns: once the keep-alives find h2
    gone and the agents end the round, each says so, and its agent replaces it at once instead of waiting out the
    abort's grace (LOST_ABORT_GRACE) for a report that cannot come. The four train on in a world of 4."""
    schedule = cluster.out / "schedule.json"
    schedule.write_text("[]")
    agents = [agent(cluster, host, schedule, "--nnodes", "2:3") for host in cluster.hosts]
    before = steady(cluster, agents, ranks=6)
    lost = time.time()
    cluster.kill_host(cluster.hosts[2], silent=True)

    def trained() -> dict[int, int] | None:
        done = {r["rank"]: r["pid"] for r in progress(cluster).values() if r["world_size"] == 4 and r["time"] > lost}
        return done if len(done) == 4 else None

    after = cluster.wait_for("the survivors in a world of 4", trained)
    assert set(after.values()).isdisjoint(before.values()), (before, after)  # every held worker was replaced
    for proc in agents[:2]:
        held = re.findall(r"is held in a collective with a lost peer \((\S+) \(", proc.output)
        assert held == ["all_reduce", "all_reduce"], proc.output
        assert "did not let go of its round" not in proc.output, proc.output
