"""``--node-check`` across hosts (issue 31): a node whose link is slow is left out before training, with the reason on
every node, and the others train without it.

Four hosts (network namespaces, c10d on h0), ``--nnodes 3:4``; h3's link is throttled to 100 Mbit/s both ways (a
token bucket on its veth: exact whatever the CPUs do, where a busy loop on a 2-core machine shared by four agents
would slow everyone a little). Every agent starts at once; the check's time, from the round's completion to the
verdict, as each surviving agent logs it, goes to RESULTS.md.
"""

from __future__ import annotations

import re

import pytest

from .conftest import Cluster, report_time

pytestmark = [pytest.mark.faults, pytest.mark.torch]

CHECK_BOUND = 10.0  # issue 31: at most 10 s of checking
SLOW_RATE = "100mbit"  # a 4 MiB all-reduce takes ~0.7 s through it, ~10 ms through a healthy veth


@pytest.mark.parametrize("cluster", [4], indirect=True)
def test_a_node_with_a_slow_link_is_left_out_and_the_others_train(cluster: Cluster) -> None:
    h0, h1, h2, h3 = cluster.hosts
    cluster.throttle(h3, SLOW_RATE)
    agents = [cluster.agent(h, nnodes="3:4", rdzv=cluster.c10d(), flags=["--node-check"]) for h in cluster.hosts]

    assert agents[3].wait() == 1, cluster.logs()
    left_out = rf"this node {re.escape(h3.addr)} \(rank 3\) is left out: all-reduce .* the median"
    assert re.search(left_out, agents[3].output), agents[3].output
    assert "aelastic run: error: node check: this node (rank 3 of round 0) is left out of the job" in agents[3].output

    cluster.wait_training([h0, h1, h2], 3)
    total, checking = [], []
    for agent in agents[:3]:
        assert re.search(rf"node {re.escape(h3.addr)} \(rank 3\) is left out: all-reduce", agent.output), agent.output
        took = re.search(r"node check of round 0 took ([\d.]+) s \(every check process ready after ([\d.]+) s\)",
                         agent.output)  # fmt: skip
        assert took is not None, agent.output
        total.append(float(took[1]))
        checking.append(float(took[1]) - float(took[2]))
    (cluster.out / "stop").touch()
    for agent in agents[:3]:
        assert agent.wait() == 0, cluster.logs()
    report_time("node check: a slowed node left out", max(checking), "the check of 4 nodes, one link at 100 Mbit/s, "
                "from every check process ready to the verdict (the slowest agent's)")  # fmt: skip
    report_time("node check: with its processes' start", max(total), "the same, from the round's completion: the "
                "four check processes' import of torch on 2 cores included")  # fmt: skip
    assert max(checking) <= CHECK_BOUND, cluster.logs()
