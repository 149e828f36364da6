"""No node whose loss ends the job (issue 33): four hosts, ``--nnodes 2:4``, the rendezvous in the job's own etcd
(``--rdzv-endpoint embedded:h0,h1,h2,h3``: members on h0, h1 and h2), beside the same layout on c10d.

* etcd (agents with ``--prewarm``): h0 (the first member's node, and rank 0's) dies: h1..h3 train in a world of
  3; h3 replaces h0's member (the member list before and after is printed, from etcdctl in a survivor's namespace);
  then h1 (a second member's node, rank 0 by then) dies: h2 and h3 train on in a world of 2 and finish with exit
  status 0. Each host keeps ``/dev/shm`` to itself (a member's data goes with its host, as on separate machines);
  no etcd process is left.
* c10d, the store on h0: h0 dies and every survivor ends, saying what was lost and what would have survived.

A host dies two ways (``test_store_host.py``): its processes crash while its kernel lives on, or it loses power
(``silent``: its link goes down first). Times go to RESULTS.md (``report_time``): the issue's target, 10 s from a
death to the survivors training, is measured there (medians over runs); the test's own bound is the suite's
generous deadline, which a loaded machine cannot reach by accident.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from aelastic.etcd.server import find_etcd_binary

from .conftest import C10D_PORT, FAST_CONF, Cluster, Host, Proc, _namespaces_permitted, report_time

pytestmark = [pytest.mark.faults, pytest.mark.torch]

VERDICT = 60.0  # the wait of last resort: far beyond the target, far below TCP's or gloo's timeouts
HEAL = 60.0  # the replacement of a lost member: its lease expires (2 s), then a member starts and catches up
STORE_LOST = 10.0  # c10d's read_timeout: how long a node may go without reaching the store before it gives up

crash_or_silent = pytest.mark.parametrize(
    "silent", [pytest.param(False, id="crash"), pytest.param(True, id="power-off")]
)


@pytest.fixture
def cluster4(tmp_path: Path) -> Iterator[Cluster]:
    """Four hosts; skipped where network namespaces are not permitted."""
    pytest.importorskip("torch")
    why = _namespaces_permitted()
    if why is not None:
        pytest.skip(why)
    cluster = Cluster(tmp_path, 4)
    try:
        cluster.build()
        yield cluster
    finally:
        cluster.teardown()


def members(cluster: Cluster, via: Host) -> list[str]:
    """The member list, as etcdctl in ``via``'s namespace reads it from the members ``via`` can reach."""
    etcdctl = str(Path(find_etcd_binary()).with_name("etcdctl"))
    endpoints = ",".join(f"http://{h.addr}:2379" for h in cluster.hosts)
    out = subprocess.run(
        via.command(etcdctl, "--endpoints", endpoints, "--command-timeout", "5s", "member", "list", "-w", "json"),
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    return sorted(m.get("name", "(starting)") for m in json.loads(out.stdout)["members"])


def etcd_processes(cluster: Cluster) -> list[str]:
    """etcd members and guards of this cluster's job still running anywhere."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            text = cmdline.read_bytes().replace(b"\0", b" ")
        except OSError:
            continue  # gone meanwhile
        if b"aelastic-etcd-faults-" in text and str(cluster.out).encode() not in text:
            found.append(f"{cmdline.parent.name}: {text[:160]!r}")
    return found


def report_round(agents: list[Proc], pattern: str, died: float, scenario: str) -> None:
    """The rendezvous' share of a recovery: from the death to the last survivor's new round (its agent's log),
    before its workers start (importing torch, joining gloo: the same on every backend)."""
    times = [agent.logged_at(pattern) for agent in agents]
    what = "the survivors' agents complete the rendezvous round of the smaller world, from the death"
    if all(t is not None for t in times):
        report_time(scenario, max(t for t in times if t is not None) - died, what)


def wait_healed(cluster: Cluster, via: Host, expected: list[str], agents: list[Proc]) -> None:
    """Wait until the member list is ``expected`` and every live agent says all its members are up."""
    cluster.wait_for(f"the members {expected}", lambda: members(cluster, via) == expected, HEAL)
    line = f"3 of 3 member(s) up ({', '.join(expected)})"
    cluster.wait_for("the agents to see it", lambda: all(line in a.output for a in agents), HEAL)


@crash_or_silent
def test_the_job_etcd_survives_two_member_nodes_lost_one_after_the_other(cluster4: Cluster, silent: bool) -> None:
    cluster = cluster4
    h0, h1, h2, h3 = cluster.hosts
    rdzv = ["--rdzv-backend", "etcd", "--rdzv-endpoint", "embedded:h0,h1,h2,h3", "--rdzv-id", "faults",
            "--rdzv-conf", FAST_CONF]  # fmt: skip
    # Pre-warmed, as a job that cares how long a loss costs runs: the workers' start after the new round is then the
    # same short one on every backend, and the figure is the rendezvous' (reported on its own too: report_round).
    agents = [
        cluster.agent(h, nnodes="2:4", rdzv=rdzv, max_restarts=3, private_shm=True, flags=["--prewarm"])
        for h in cluster.hosts
    ]
    first = cluster.wait_training(cluster.hosts, 4)
    assert first["h0"]["rank"] == 0, first  # the first member's node is rank 0's
    before = members(cluster, h1)
    assert before == ["h0", "h1", "h2"]
    kind = "silent" if silent else "crash"

    old = cluster.records()
    died = time.time()
    cluster.kill_host(h0, silent=silent)
    cluster.wait_training([h1, h2, h3], 3, old=old, timeout=VERDICT)
    took = time.time() - died
    report_time(f"job etcd: first member's (and rank 0's) host dies ({kind}): survivors training", took,
                "the other three all-reduce in a world of 3, from the death")  # fmt: skip
    report_round(agents[1:], "round 1 complete", died, f"job etcd: first member's host dies ({kind}): new round")
    wait_healed(cluster, h1, ["h1", "h2", "h3"], agents[1:])
    healed = members(cluster, h2)
    print(f"[job etcd] {kind}: world of 3 {took:.2f} s after h0's death; members before {before}, after {healed}")

    old = cluster.records()
    second = time.time()
    cluster.kill_host(h1, silent=silent)
    cluster.wait_training([h2, h3], 2, old=old, timeout=VERDICT)
    took_second = time.time() - second
    report_time(f"job etcd: a second member's host dies ({kind}): survivors training", took_second,
                "the remaining two all-reduce in a world of 2, from the death")  # fmt: skip
    report_round(agents[2:], "round 2 complete", second, f"job etcd: a second member's host dies ({kind}): new round")
    print(f"[job etcd] {kind}: world of 2 {took_second:.2f} s after h1's death; members {members(cluster, h2)}")

    (cluster.out / "stop").touch()
    for agent in agents[2:]:
        assert agent.wait(VERDICT) == 0, agent.output
    assert etcd_processes(cluster) == []
    for agent in agents[2:]:
        assert "the job's etcd: 2 of 3 member(s) up (h1, h2, h3); lost: h1: the loss of one more member's node " \
               "stops every node's rendezvous" in agent.output, agent.output  # fmt: skip


@crash_or_silent
def test_c10d_store_host_death_ends_every_survivor_saying_what_would_have_survived(
    cluster4: Cluster, silent: bool
) -> None:
    """Today's behaviour on c10d in the same layout (recorded beside the job etcd's): every survivor ends."""
    survivors, took = cluster4.store_host_dies(silent=silent, store_lost=STORE_LOST, verdict=VERDICT)
    kind = "silent" if silent else "crash"
    report_time(f"c10d store host dies, 4 hosts ({kind}): job fails", took, "every survivor exited with an error")
    store = f"{cluster4.hosts[0].addr}:{C10D_PORT}"
    for agent in survivors:
        last = agent.output.strip().splitlines()[-1]
        assert last.startswith(f"aelastic run: error: rendezvous 'faults': lost the rendezvous store at {store}"), last
        assert f"the agent on {cluster4.hosts[0].addr} that served it is gone" in last, last
        assert "--rdzv-endpoint embedded:" in last, last
        assert "EndOfStream" not in last, last
    print(f"[c10d] {kind}: {survivors[0].output.strip().splitlines()[-1]}")
