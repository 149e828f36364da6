"""No node whose loss ends the job, on the real Slurm cluster (issue 33): ``examples/slurm/job_etcd.sbatch`` on five
nodes: node1 runs the batch script and only launches; node2..node5 each run one ``aelastic run`` step (``--nnodes
2:4``, ``--no-kill``) of ``examples/slurm/train.py``, the rendezvous in the job's own etcd as a new user writes it
(``--rdzv-endpoint embedded``, no ``--rdzv-conf``): its first members are node1..node3 (the job's first nodes), and
node1, which runs no agent, is replaced by a training node. Each node keeps ``/dev/shm`` to itself
(``SLURM_PRIVATE_SHM``), as real nodes do.

node2 (the first member's node, and rank 0's) is killed: node3..node5 train in a world of 3; the spare node replaces its
member (the member list before and after, from etcdctl on a survivor); then node3 (a second member's node) is
killed: node4 and node5 train on in a world of 2, and their steps exit 0. The same with the nodes powered off (their
link down first: nothing of them answers or closes anything) instead of killed. Times (the workers' own records against
the kill: every namespace shares the machine's clock) go to RESULTS.md; the issue's target is 10 s each.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from helpers.results import report_time

from aelastic.etcd.server import find_etcd_binary

from .cluster import SlurmCluster, first_steps, step_exit_code, step_records

pytestmark = pytest.mark.slurm

SLURM_NODES = 5
SLURM_PRIVATE_SHM = True

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = ROOT / "examples" / "slurm" / "job_etcd.sbatch"
TRAIN = ROOT / "examples" / "slurm" / "train.py"
VERDICT = 90.0  # the waits of last resort, far beyond the target


def _members(cluster: SlurmCluster, via: str, port: int) -> list[str]:
    """The member list, as etcdctl on ``via`` reads it from the members at ``port``."""
    etcdctl = str(Path(find_etcd_binary()).with_name("etcdctl"))
    endpoints = ",".join(f"http://node{i}:{port}" for i in range(2, 6))
    out = cluster.run(etcdctl, "--endpoints", endpoints, "--command-timeout", "5s", "member", "list", "-w", "json",
                      where=via)  # fmt: skip
    return sorted(m.get("name", "(starting)") for m in json.loads(out.stdout)["members"])


@pytest.mark.parametrize("silent", [False, True], ids=["killed", "powered off"])
def test_two_member_nodes_lost_one_after_the_other_with_a_batch_node_that_only_launches(
    slurm_cluster: SlurmCluster, tmp_path: Path, silent: bool
) -> None:
    cluster = slurm_cluster
    env = {
        "TRAIN_SCRIPT": str(TRAIN), "TRAIN_LOG": str(tmp_path), "TRAIN_STOP": str(tmp_path / "stop"),
        "PYTHON": sys.executable, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
    }  # fmt: skip
    job = cluster.sbatch(TEMPLATE.read_text(), "-N5", f"--chdir={tmp_path}", env=env)
    port = 15000 + (2 * int(job)) % 15000  # the Slurm source's etcd_port for this job
    found: dict[str, Any] = {"job": job}
    try:
        cluster.wait_for("a world of 4 training", lambda: first_steps(tmp_path, {f"node{i}" for i in range(2, 6)},
                                                                      4, 0), VERDICT)  # fmt: skip
        first = {r["host"]: r["rank"] for r in step_records(tmp_path) if r["event"] == "step" and r["world"] == 4}
        assert first["node2"] == 0, first  # the first member's node is rank 0's

        # node1 never starts its member; the first node without one replaces it.
        def replaced() -> bool:
            members = _members(cluster, "node3", port)
            return len(members) == 3 and not {"node1", "(starting)"} & set(members)

        cluster.wait_for("node1's member replaced", replaced, VERDICT)
        found["members_before"] = _members(cluster, "node3", port)
        spare = ({"node4", "node5"} - set(found["members_before"])).pop()

        lost = time.time()
        cluster.kill_node("node2", silent=silent)
        steps = cluster.wait_for("a world of 3", lambda: first_steps(tmp_path, {"node3", "node4", "node5"}, 3, lost),
                                 VERDICT)  # fmt: skip
        found["world_of_3_after"] = max(steps.values()) - lost
        healed = sorted({*found["members_before"], spare} - {"node2"})
        assert healed == ["node3", "node4", "node5"], found
        cluster.wait_for(f"{spare}'s member", lambda: _members(cluster, "node3", port) == healed, VERDICT)
        found["members_after"] = _members(cluster, "node4", port)

        lost = time.time()
        cluster.kill_node("node3", silent=silent)
        steps = cluster.wait_for("a world of 2", lambda: first_steps(tmp_path, {"node4", "node5"}, 2, lost), VERDICT)
        found["world_of_2_after"] = max(steps.values()) - lost

        (tmp_path / "stop").touch()
        rcs = {}
        for host in ("node4", "node5"):
            rcs[host] = step_exit_code(cluster, tmp_path, host, VERDICT)
        found["exit_codes"] = rcs
        found["job_state"] = cluster.wait_job(job)["JobState"]
    finally:
        cluster.scancel(job, check=False)
        cluster.revive("node2")
        cluster.revive("node3")
    how = "powered off" if silent else "killed"
    print(f"[slurm] job etcd, nodes {how}: {found}")
    report_time("slurm", f"job etcd: first member's (and rank 0's) node {how} (4 nodes, 2:4): survivors training",
                found["world_of_3_after"], "the other three all-reduce in a world of 3, from the loss; plain "
                "--rdzv-endpoint embedded, no --rdzv-conf; the batch node only launches")  # fmt: skip
    report_time("slurm", f"job etcd: a second member's node {how}: survivors training", found["world_of_2_after"],
                "the remaining two all-reduce in a world of 2, from the loss")  # fmt: skip
    assert found["members_after"] == ["node3", "node4", "node5"], found
    assert found["exit_codes"] == {"node4": 0, "node5": 0}, found
    assert found["job_state"] == "COMPLETED", found
