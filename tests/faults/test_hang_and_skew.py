"""A worker hangs (SIGSTOP) when a restart comes; one host's clocks are ten days ahead."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from .conftest import GRACE, STEP_PAUSE, Cluster, report_time

pytestmark = [pytest.mark.faults, pytest.mark.torch]

SHUTDOWN_GRACE = 2.0  # the agents' --shutdown-timeout (conftest)


def test_stopped_worker_is_killed_after_the_grace_and_the_restart_proceeds(cluster: Cluster) -> None:
    h0, h1, h2 = cluster.hosts
    rdzv = cluster.c10d()
    agents = [cluster.agent(h, nnodes="2:3", rdzv=rdzv) for h in (h0, h1)]
    first = cluster.wait_training([h0, h1], 2)
    hung = first["h1"]["pid"]
    os.kill(hung, signal.SIGSTOP)  # SIGTERM stays pending on a stopped process: only SIGKILL ends it
    joined = time.time()
    agents.append(cluster.agent(h2, nnodes="2:3", rdzv=rdzv))  # a membership change: every agent restarts
    cluster.wait_training(cluster.hosts, 3, old=list(first.values()))
    report_time("worker SIGSTOPped, then a restart: all training", time.time() - joined, "new world all-reduces")
    assert not Path(f"/proc/{hung}").exists() or "Z" in Path(f"/proc/{hung}/stat").read_text().rsplit(")", 1)[1][:3]
    escalated = agents[1].logged_at(rf"did not exit within {SHUTDOWN_GRACE:.1f} s of SIGTERM: sending SIGKILL")
    assert escalated is not None, agents[1].output
    assert escalated - joined >= SHUTDOWN_GRACE - 0.01  # KILL came only after the grace (log times are ms)


SKEW = 10 * 24 * 3600  # ten days


def test_clock_skew_evicts_no_one(cluster: Cluster) -> None:
    """h0 (which also serves the store) runs with CLOCK_MONOTONIC and CLOCK_BOOTTIME ten days ahead.

    aelastic judges liveness on the observer's own monotonic clock (a heartbeat counter that has not moved for
    GRACE of the observer's time), and anyio's clock is CLOCK_MONOTONIC on asyncio and trio; nothing compares
    times written by different hosts. CLOCK_REALTIME cannot be namespaced; aelastic uses it only for log and
    error-file timestamps. A design that compared hosts' clocks would evict h0, or be evicted by it, here.
    """
    h0 = cluster.hosts[0]
    rdzv = cluster.c10d()
    agents = [
        cluster.agent(h, nnodes="3", rdzv=rdzv, backend=b, time_offset=SKEW if h is h0 else 0)
        for h, b in zip(cluster.hosts, ("asyncio", "trio", "asyncio"), strict=True)
    ]
    skewed = ["monotonic", str(SKEW), "0", "boottime", str(SKEW), "0"]
    offsets = Path(f"/proc/{agents[0].pid}/timens_offsets")
    cluster.wait_for("h0's agent in its time namespace", lambda: offsets.read_text().split() == skewed)  # after exec
    first = cluster.wait_training(cluster.hosts, 3)
    # Four liveness graces at least (a step takes STEP_PAUSE or more); each node checks its neighbour every interval.
    steps = max(r["step"] for r in first.values()) + int(4 * GRACE / STEP_PAUSE)
    start = time.time()
    later = cluster.wait_training(cluster.hosts, 3, steps=steps)
    report_time("clock skew 10 days: no eviction", time.time() - start, "observed training without a restart")
    assert {h: r["pid"] for h, r in later.items()} == {h: r["pid"] for h, r in first.items()}, "no restart"
    assert all(r["round"] == [0, 0] for r in later.values())
    for agent in agents:
        assert "removing dead node" not in agent.output, agent.output
