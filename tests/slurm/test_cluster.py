"""Smoke tests of the real Slurm cluster (``slurm_cluster``), and the reference data a Slurm integration is tested on
offline: ``hostlists.json`` (what ``scontrol show hostnames`` makes of each hostlist shape) and ``slurm_env.json``
(the ``SLURM_*`` variables a 2-node step and its batch shell see).

Regenerate both files from the live cluster with ``AELASTIC_SLURM_WRITE=1 pytest -m slurm tests/slurm``; without it
the tests compare what the live cluster says with the committed table.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

from .cluster import SlurmCluster

pytestmark = pytest.mark.slurm

SLURM_NODES = 2
SLURM_GPUS = 2  # fake gres/gpu devices: --gpus-per-node works, SLURM_GPUS_ON_NODE is set

HERE = Path(__file__).resolve().parent
HOSTLISTS = HERE / "hostlists.json"
REJECTED = HERE / "hostlists_rejected.json"
SLURM_ENV = HERE / "slurm_env.json"
WRITE = os.environ.get("AELASTIC_SLURM_WRITE") == "1"

# Hostlist shapes seen in the wild and their edges. Each is expanded by the real scontrol; those it expands go to
# hostlists.json, those it rejects ("Invalid hostlist") or takes literally although malformed to
# hostlists_rejected.json.
HOSTLIST_SHAPES = [
    # plain names
    "node1", "node", "n1,n2", "n1,", "n1 n2", "gpu-a100-01",
    # ranges, lists, zero padding
    "n[1-3]", "n[001-003,7]", "n[5,1-3]", "n[2-2]", "n[001]", "n[0-0]", "n[08-11]", "n[098-101]", "n[9-11]",
    "n[00-10]", "n[01-2]", "n[1-02]", "n0[1-2]", "gpu-a100-[01-02]", "[1-2]",
    # several names and groups
    "a[1-2],b3", "n[1-2],m[3-4]", "n[1-3],,n4", "rack[1-2]-n[01-02]", "n[1-2][3-4]", "n[1-2],m[3-4]x[5-6]",
    "c[1-2]-r[1-2]-n[1-2]",
    # duplicates are kept
    "n[1-2],n2", "n[1,1]",
    # malformed
    "n[1-3]x", "a[1-2]b[3-4]c", "a.b[1-2].c", "n[1-2]-1", "n[1-3]0", "n[3-1]", "n[]", "n[a-b]", "n[-1]", "n[1--2]",
    "n[1-3]-[a]", "n[1-2]]", "n[1-", "n[1-2", "n1-2]", "n[1-65537]",
]  # fmt: skip
# scontrol takes these literally (exit 0, names with brackets in them): malformed for any sane parser.
LITERAL_MALFORMED = {"n[1-", "n[1-2", "n1-2]"}


def _expand(cluster: SlurmCluster, hostlist: str) -> list[str] | None:
    """The names ``scontrol show hostnames`` prints, None if it says "Invalid hostlist" (it exits 0 either way)."""
    done = cluster.scontrol("show", "hostnames", hostlist)
    if "Invalid hostlist" in done.stderr + done.stdout:
        return None
    return done.stdout.split()


def test_srun_on_two_nodes_prints_both_names(slurm_cluster: SlurmCluster) -> None:
    names = slurm_cluster.srun("-N2", "hostname").stdout.split()
    assert sorted(names) == ["node1", "node2"]
    assert slurm_cluster.hostnames(slurm_cluster.nodelist) == ["node1", "node2"]


# Writes what a task sees to the file argv[1] names, PROCID replaced by its SLURM_PROCID (one file per task: srun
# interleaves the tasks' stdout in chunks, which splits long lines).
DUMP = (
    "import json, os, pathlib, socket, sys; "
    "pathlib.Path(sys.argv[1].replace('PROCID', os.environ['SLURM_PROCID'])).write_text(json.dumps({"
    "'hostname': socket.gethostname(), 'prefix': sys.prefix, "
    "'env': {k: v for k, v in sorted(os.environ.items()) if k.startswith(('SLURM', 'CUDA_VISIBLE', 'GPU_DEVICE'))}}))"
)


def _tasks(folder: Path, prefix: str) -> list[dict[str, object]]:
    return [json.loads(path.read_text()) for path in sorted(folder.glob(f"{prefix}-*.json"))]


# Every step task sees these (22.05, srun -N2 --ntasks-per-node=1 --gpus-per-node=2); SLURM_GPUS_PER_NODE and
# SLURM_RESTART_COUNT are not among them: see test_batch_job_environment.
STEP_KEYS = {
    "SLURM_JOB_ID", "SLURM_JOB_NODELIST", "SLURM_NNODES", "SLURM_JOB_NUM_NODES", "SLURM_STEP_NODELIST",
    "SLURM_STEP_NUM_NODES", "SLURM_STEP_NUM_TASKS", "SLURM_NODEID", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS",
    "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "SLURM_STEP_TASKS_PER_NODE", "SLURM_CPUS_ON_NODE",
    "SLURM_GPUS_ON_NODE", "SLURM_STEP_GPUS", "SLURM_STEP_ID", "SLURMD_NODENAME", "SLURM_SUBMIT_HOST",
    "SLURM_LAUNCH_NODE_IPADDR", "SLURM_SRUN_COMM_HOST", "SLURM_CLUSTER_NAME",
}  # fmt: skip


def _check_step(tasks: list[dict[str, object]]) -> dict[str, dict[str, str]]:
    """Both tasks ran in this venv on their own node with a consistent view of the step; their env by host."""
    assert sorted(t["hostname"] for t in tasks) == ["node1", "node2"]  # type: ignore[type-var]
    assert {t["prefix"] for t in tasks} == {sys.prefix}  # the repo's venv on each node
    envs: dict[str, dict[str, str]] = {str(t["hostname"]): t["env"] for t in tasks}  # type: ignore[misc]
    for host, env in envs.items():
        assert set(env) >= STEP_KEYS, f"{host} lacks {sorted(STEP_KEYS - set(env))}"
        assert env["SLURMD_NODENAME"] == host
        assert env["SLURM_JOB_NODELIST"] == env["SLURM_STEP_NODELIST"] == "node[1-2]"
        assert env["SLURM_NNODES"] == env["SLURM_STEP_NUM_NODES"] == "2"
        assert env["SLURM_NTASKS_PER_NODE"] == "1"
        assert env["SLURM_LOCALID"] == "0"
        assert env["SLURM_GPUS_ON_NODE"] == "2"
        assert env["CUDA_VISIBLE_DEVICES"] == "0,1"
        assert env["SLURM_CPUS_ON_NODE"] == "1"
    assert {env["SLURM_NODEID"] for env in envs.values()} == {"0", "1"}
    assert {env["SLURM_PROCID"] for env in envs.values()} == {"0", "1"}
    assert envs["node1"]["SLURM_NODEID"] == "0"  # node ids follow the hostlist's order
    assert len({env["SLURM_JOB_ID"] for env in envs.values()}) == 1
    return envs


def test_step_environment(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    """A 2-node step runs ``python -c`` in the repo's venv on each node, which sees the step's SLURM_* variables."""
    slurm_cluster.srun("-N2", "--ntasks-per-node=1", "--gpus-per-node=2", sys.executable, "-c", DUMP,
                       tmp_path / "step-PROCID.json")  # fmt: skip
    envs = _check_step(_tasks(tmp_path, "step"))
    _record("srun -N2 --ntasks-per-node=1 --gpus-per-node=2 (from the hub, no allocation)", {"step": envs})


def test_batch_job_environment(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    """The same from ``sbatch``: the batch shell's variables and its step's (``srun`` with no option)."""
    script = f"""#!/bin/sh
{sys.executable} -c "{DUMP}" {tmp_path}/batch-PROCID.json
srun {sys.executable} -c "{DUMP}" {tmp_path}/step-PROCID.json
"""
    job = slurm_cluster.sbatch(script, "-N2", "--ntasks-per-node=1", "--gpus-per-node=2")
    record = slurm_cluster.wait_job(job)
    assert record["JobState"] == "COMPLETED", record
    [batch] = _tasks(tmp_path, "batch")
    assert batch["hostname"] == "node1"  # the batch shell runs on the allocation's first node
    envs = _check_step(_tasks(tmp_path, "step"))
    assert batch["env"]["SLURM_JOB_ID"] == job
    assert batch["env"]["SLURM_GPUS_PER_NODE"] == "2"
    assert all(env["SLURM_GPUS_PER_NODE"] == "2" for env in envs.values())  # inherited from the batch shell
    assert "SLURM_RESTART_COUNT" not in batch["env"]  # set only once the job has been requeued
    _record(
        "sbatch -N2 --ntasks-per-node=1 --gpus-per-node=2; the script runs srun with no option",
        {"batch": batch["env"], "step": envs},
    )


def _record(how: str, envs: dict[str, object]) -> None:
    if not WRITE:
        return
    data = json.loads(SLURM_ENV.read_text()) if SLURM_ENV.exists() else {}
    data["slurm"] = "22.05 (Debian bookworm), auth/none, a 2-node cluster in network namespaces (tests/slurm)"
    data[how] = envs
    SLURM_ENV.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")


def test_hostlist_table_matches_scontrol(slurm_cluster: SlurmCluster) -> None:
    """The committed table of hostlist expansions is what the real ``scontrol show hostnames`` says."""
    expanded, invalid, literal = {}, [], {}
    for shape in HOSTLIST_SHAPES:
        names = _expand(slurm_cluster, shape)
        if names is None:
            invalid.append(shape)
        elif shape in LITERAL_MALFORMED:
            literal[shape] = names
        else:
            expanded[shape] = names
    rejected = {
        "about": "hostlists scontrol show hostnames (Slurm 22.05) rejects ('Invalid hostlist', still exit 0), and "
        "malformed ones it takes literally: a hostlist parser should reject both",
        "invalid": invalid,
        "taken_literally": literal,
    }
    if WRITE:
        HOSTLISTS.write_text(
            "{\n" + ",\n".join(f" {json.dumps(k)}: {json.dumps(v)}" for k, v in expanded.items()) + "\n}\n"
        )
        REJECTED.write_text(json.dumps(rejected, indent=1) + "\n")
    assert json.loads(HOSTLISTS.read_text()) == expanded
    assert json.loads(REJECTED.read_text()) == rejected
    # the shapes of the reference, as scontrol expands them
    assert expanded["n[001-003,7]"] == ["n001", "n002", "n003", "n7"]
    assert expanded["a[1-2],b3"] == ["a1", "a2", "b3"]
    assert expanded["rack[1-2]-n[01-02]"] == ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]


def test_partitioned_node_stops_responding_and_heals(slurm_cluster: SlurmCluster) -> None:
    """``partition``: slurmctld loses node2 (``*``: not responding); ``revive`` brings it back to idle."""
    start = time.monotonic()
    slurm_cluster.partition("node2")
    try:
        slurm_cluster.wait_nodes({"idle*", "down*"}, ["node2"])
        lost = time.monotonic() - start
        assert slurm_cluster.node_states()["node1"] == "idle"
    finally:
        slurm_cluster.revive("node2")
    print(f"[slurm] partitioned node2: not responding after {lost:.1f} s, idle again "
          f"{time.monotonic() - start - lost:.1f} s after the heal")  # fmt: skip


def test_killed_node_goes_down_and_revives(slurm_cluster: SlurmCluster) -> None:
    """``kill_node``: node2's slurmd and everything on it die; slurmctld marks it DOWN; ``revive`` restarts its
    slurmd and the node returns to idle (``ReturnToService=2``); a 2-node step runs again."""
    start = time.monotonic()
    slurm_cluster.kill_node("node2")
    try:
        slurm_cluster.wait_nodes({"down*"}, ["node2"])
        down = time.monotonic() - start
    finally:
        slurm_cluster.revive("node2")
    print(f"[slurm] killed node2: down after {down:.1f} s, idle again {time.monotonic() - start - down:.1f} s "
          "after its slurmd restarted")  # fmt: skip
    assert sorted(slurm_cluster.srun("-N2", "hostname").stdout.split()) == ["node1", "node2"]
