"""A host's link goes down mid-training (a partition), then comes back."""

from __future__ import annotations

import time

import pytest

from .conftest import Cluster, report_time

pytestmark = [pytest.mark.faults, pytest.mark.torch]

RECOVERY = 60.0  # far below any TCP or gloo timeout: a recovery this fast was driven by the heartbeats


def test_partitioned_host_is_dropped_then_rejoins(cluster: Cluster) -> None:
    h0, h1, h2 = cluster.hosts
    # Restarts allowed: when the link is back, h2's stranded worker fails on a reset connection, and that failure
    # must cost h2 one restart, not the job.
    agents = [
        cluster.agent(h, nnodes="2:3", rdzv=cluster.c10d(), backend=b, max_restarts=3)
        for h, b in zip(cluster.hosts, ("asyncio", "trio", "asyncio"), strict=True)
    ]
    first = cluster.wait_training(cluster.hosts, 3)
    # A node that joins more than the last call after the other two makes the world of three a second round: the
    # workers of the first one are old too, and restarts count from the world of three.
    old = cluster.records()

    cut = time.time()
    cluster.partition(h2)
    smaller = cluster.wait_training([h0, h1], 2, old=old, timeout=RECOVERY)
    recovered = time.time() - cut
    evicted = [t for t in (a.logged_at("removing dead node.*" + h2.addr) for a in agents[:2]) if t is not None]
    assert evicted, cluster.logs()
    membership = {smaller[h]["round"][1] - first[h]["round"][1] for h in smaller}
    assert membership == {1}, "one membership restart, no failure restart"
    report_time("partition: dead node removed", min(evicted) - cut, "survivors removed the cut-off host")
    report_time("partition: survivors training", recovered, "survivors all-reduce in the smaller world")

    old = cluster.records()
    healed_at = time.time()
    cluster.heal(h2)
    full = cluster.wait_training(cluster.hosts, 3, old=old, timeout=RECOVERY)
    report_time("partition: host rejoined", time.time() - healed_at, "all three all-reduce again after the heal")
    assert all(a.running() for a in agents), cluster.logs()
    # The survivors restarted once more for the newcomer; h2 restarted once (for its failed worker or for the
    # membership change, whichever it saw first).
    assert [full[h]["round"][1] - first[h]["round"][1] for h in ("h0", "h1")] == [2, 2], (first, full)
    assert sum(full["h2"]["round"]) - sum(first["h2"]["round"]) == 1, (first, full)
