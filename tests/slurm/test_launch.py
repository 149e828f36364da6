"""No-flag launches on the real Slurm cluster (``slurm_cluster``): ``srun aelastic run --nproc-per-node 2 train.py``
with no rendezvous flag is one job of 4 ranks on 2 nodes (the Slurm source, ``aelastic.config.slurm``); torchrun,
given the same, trains two separate jobs of 2. ``--dry-run`` under srun prints what each node derived.

Set ``AELASTIC_SLURM_SHOW=1`` (with ``-s``) to print each command's real output, as the README quotes it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from pathlib import Path

import pytest

from .cluster import SlurmCluster

pytestmark = pytest.mark.slurm

SLURM_NODES = 2
SLURM_CPUS = 2  # room for two tasks per node (test_more_than_one_task_per_node_...)
SLURM_GPUS = 2  # fake gres/gpu devices: a step with --gpus-per-node=2 sees SLURM_GPUS_ON_NODE=2

HERE = Path(__file__).resolve().parent
TRAIN = HERE.parents[1] / "examples" / "slurm" / "allreduce.py"  # the docs' Slurm transcript runs it
BIN = Path(sys.executable).parent  # the venv's console scripts: aelastic, torchrun
SHOW = os.environ.get("AELASTIC_SLURM_SHOW") == "1"


def _show(title: str, output: str) -> None:
    if SHOW:
        print(f"\n--- {title}\n{output}", flush=True)


def _ranks(folder: Path) -> list[dict[str, object]]:
    return sorted((json.loads(p.read_text()) for p in folder.glob("rank-*.json")), key=lambda r: (r["host"], r["rank"]))


def test_srun_without_rendezvous_flags_is_one_world_of_four(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    """``srun -N2 aelastic run --nproc-per-node 2 train.py``: one gloo world of 4 ranks over both nodes, exit 0."""
    done = slurm_cluster.srun(
        "-N2", "--ntasks-per-node=1", "--kill-on-bad-exit=1", BIN / "aelastic", "run", "--nproc-per-node", "2",
        TRAIN, "4", tmp_path,
    )  # fmt: skip
    _show("srun -N2 aelastic run --nproc-per-node 2 train.py", done.stdout + done.stderr)
    ranks = _ranks(tmp_path)
    assert sorted(r["rank"] for r in ranks) == [0, 1, 2, 3], ranks  # type: ignore[type-var]
    assert {r["world"] for r in ranks} == {4}
    assert {r["sum"] for r in ranks} == {6.0}
    assert sorted(str(r["host"]) for r in ranks) == ["node1", "node1", "node2", "node2"]
    [run_id] = {str(r["run_id"]) for r in ranks}
    assert re.fullmatch(r"slurm-\d+-0", run_id), ranks
    # The one line each agent logs: what it derived, from which variable.
    derived = [line for line in done.stderr.splitlines() if "Slurm step" in line]
    assert len(derived) == 2, done.stderr
    for line in derived:
        assert "--nnodes 2 (SLURM_STEP_NUM_NODES=2)" in line
        assert "--rdzv-endpoint node1:" in line
        assert "first node of SLURM_STEP_NODELIST=node[1-2]" in line
        assert "SLURM_RESTART_COUNT=unset" in line


def test_torchrun_beside_it_trains_two_separate_worlds(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    """torchrun reads no SLURM_* variable: the same command runs a world of 2 on each node (ranks 0 and 1 twice),
    and exits 0: the issue's silent failure, recorded for the README."""
    if shutil.which("torchrun", path=str(BIN)) is None:
        pytest.skip("torchrun is not installed beside this interpreter")
    done = slurm_cluster.srun(
        "-N2", "--ntasks-per-node=1", BIN / "torchrun", "--nproc-per-node", "2", TRAIN, "-", tmp_path
    )
    _show("srun -N2 torchrun --nproc-per-node 2 train.py", done.stdout + done.stderr)
    ranks = _ranks(tmp_path)
    assert [(r["host"], r["rank"], r["world"]) for r in ranks] == [
        ("node1", 0, 2), ("node1", 1, 2), ("node2", 0, 2), ("node2", 1, 2),
    ]  # fmt: skip


def test_dry_run_under_srun_prints_each_value_and_its_source(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    """``--dry-run`` in a step: each node prints the same resolved rendezvous (sources named) and starts nothing."""
    done = slurm_cluster.srun(
        "-N2", "--ntasks-per-node=1", "--output", tmp_path / "dry-%n.out", BIN / "aelastic", "run", "--dry-run",
        "--nproc-per-node", "2", TRAIN,
    )  # fmt: skip
    outputs = {path.name: path.read_text() for path in sorted(tmp_path.glob("dry-*.out"))}
    assert sorted(outputs) == ["dry-0.out", "dry-1.out"]
    _show("srun -N2 aelastic run --dry-run --nproc-per-node 2 train.py (node1)", outputs["dry-0.out"])
    assert not list(tmp_path.glob("rank-*.json"))
    job = None
    for text in outputs.values():
        rows = {m[1]: (m[2].strip(), m[3]) for m in re.finditer(r"^  (\w+)\s+(.*?)\s+<- (.*)$", text, re.M)}
        assert rows["min_nodes"] == ("2", "SLURM_STEP_NUM_NODES=2") == rows["max_nodes"]
        assert rows["nproc_per_node"] == ("2", "flag --nproc-per-node")
        assert rows["rdzv_backend"][0] == "'c10d'"
        assert rows["rdzv_backend"][1].startswith("Slurm step")
        endpoint, source = rows["rdzv_endpoint"]
        assert re.fullmatch(r"'node1:\d+'", endpoint)
        assert "SLURM_STEP_NODELIST=node[1-2]" in source
        run_id, source = rows["run_id"]
        job = job or re.fullmatch(r"'slurm-(\d+)-0'", run_id)[1]  # type: ignore[index]
        assert run_id == f"'slurm-{job}-0'"
        assert source == f"SLURM_JOB_ID={job}, SLURM_RESTART_COUNT=unset"
        assert int(endpoint.strip("'").split(":")[1]) == 15000 + int(job) % 15000
        assert rows["max_restarts"] == ("0", "default")
    assert done.returncode == 0


def test_more_than_one_task_per_node_is_refused_before_anything_starts(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    """``srun --ntasks-per-node=2`` would start two agents per node: each task exits 2 with one line, no worker ran."""
    done = slurm_cluster.srun(
        "-N2", "--ntasks-per-node=2", BIN / "aelastic", "run", "--nproc-per-node", "2", TRAIN, "4",
        tmp_path, check=False,
    )  # fmt: skip
    _show("srun -N2 --ntasks-per-node=2 aelastic run --nproc-per-node 2 train.py", done.stdout + done.stderr)
    assert done.returncode == 2, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("aelastic run: error:")]
    assert len(errors) == 4, done.stderr
    assert set(errors) == {
        "aelastic run: error: SLURM_STEP_NUM_TASKS=4 on SLURM_STEP_NUM_NODES=2: aelastic run must be one task per "
        "node (it starts the node's workers itself); use 'srun --ntasks-per-node=1 aelastic run', or give --nnodes "
        "and --rdzv-* yourself"
    }
    assert not list(tmp_path.glob("rank-*.json"))


def test_gpus_of_the_step_are_the_workers_per_node(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    """``srun --gpus-per-node=2 aelastic run --dry-run train.py``: --nproc-per-node 2 from SLURM_GPUS_ON_NODE."""
    done = slurm_cluster.srun(
        "-N2", "--ntasks-per-node=1", "--gpus-per-node=2", "--output", tmp_path / "dry-%n.out", BIN / "aelastic",
        "run", "--dry-run", TRAIN,
    )  # fmt: skip
    assert done.returncode == 0
    for path in sorted(tmp_path.glob("dry-*.out")):
        text = path.read_text()
        assert re.search(r"^  nproc_per_node\s+2\s+<- SLURM_GPUS_ON_NODE=2$", text, re.M), text
        assert "--nproc-per-node 2 (SLURM_GPUS_ON_NODE=2)" in text  # the log line, in the same file


def test_head_node_named_on_loopback_is_an_error_naming_host_and_variable(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    """Debian's classic: node1's own /etc/hosts maps its name to 127.0.1.1. node1's agent refuses to start (exit 2,
    the host and the variable named) instead of publishing a loopback master address; srun's --kill-on-bad-exit
    then ends node2's agent, which waits for the rendezvous. Each node's stderr goes to a file of its own (``%N``),
    which slurmstepd opens for the task: srun forwards a task's output and its exit on separate connections, and once
    --kill-on-bad-exit ends the step it may leave before the failed task's last line has reached it."""
    loop_hosts = tmp_path / "hosts-loopback"
    loop_hosts.write_text(
        "".join(
            "127.0.1.1 node1\n" if line.split()[1:] == ["node1"] else line + "\n"
            for line in slurm_cluster.hosts.read_text().splitlines()
        )
    )
    # On node1 only, in a mount namespace of the task's own.
    script = f'[ "$SLURMD_NODENAME" = node1 ] && mount --bind {loop_hosts} /etc/hosts; exec "$@"'
    done = slurm_cluster.srun(
        "-N2", "--ntasks-per-node=1", "--kill-on-bad-exit=1", "--error", tmp_path / "stderr-%N.txt", "unshare",
        "--mount", "sh", "-c", script, "sh", BIN / "aelastic", "run", "--nproc-per-node", "1", TRAIN, "2", tmp_path,
        check=False,
    )  # fmt: skip
    node1 = (tmp_path / "stderr-node1.txt").read_text()
    _show("srun -N2 aelastic run train.py, node1 named 127.0.1.1 in its own /etc/hosts", done.stderr + node1)
    assert done.returncode != 0
    assert "node1: task 0: Exited with exit code 2" in done.stderr, done.stderr
    errors = [line for line in node1.splitlines() if line.startswith("aelastic run: error:")]
    assert errors == [
        "aelastic run: error: rendezvous host 'node1' (from SLURM_STEP_NODELIST=node[1-2]) resolves to loopback "
        "(127.0.1.1), but up to 2 nodes must reach it: fix its /etc/hosts entry or give --rdzv-endpoint ADDR:PORT"
    ], node1
    assert not list(tmp_path.glob("rank-*.json"))
