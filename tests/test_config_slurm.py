"""The Slurm source of the configuration layer (``aelastic.config.slurm``, ``.sources``, ``.hostlist``), offline.

The hostlist parser is checked against what the real ``scontrol show hostnames`` printed (``tests/slurm/
hostlists.json``, ``hostlists_rejected.json``), and the source against the variables a real 2-node step and its
batch shell saw (``tests/slurm/slurm_env.json``). The same on the live cluster: ``tests/slurm/test_launch.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
from collections.abc import Mapping
from pathlib import Path

import pytest

from aelastic.cli import build_parser, main
from aelastic.config import slurm
from aelastic.config.command import Resolved, resolve
from aelastic.config.hostlist import expand_hostlist
from aelastic.errors import ConfigurationError

TESTS = Path(__file__).parent
PROBE = str(TESTS / "cli_probe.py")
HOSTLISTS = json.loads((TESTS / "slurm" / "hostlists.json").read_text())
REJECTED = json.loads((TESTS / "slurm" / "hostlists_rejected.json").read_text())
SLURM_ENV = json.loads((TESTS / "slurm" / "slurm_env.json").read_text())
_BATCH_RUN = SLURM_ENV["sbatch -N2 --ntasks-per-node=1 --gpus-per-node=2; the script runs srun with no option"]
STEP: dict[str, dict[str, str]] = _BATCH_RUN["step"]  # node1's and node2's, job 3
BATCH: dict[str, str] = _BATCH_RUN["batch"]


@pytest.fixture(autouse=True)
def clean_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    """No PET_* or SLURM_* variable of the machine's (the parser reads PET_* when built)."""
    for key in [k for k in os.environ if k.startswith(("PET_", "SLURM_"))]:
        monkeypatch.delenv(key)


def parse(*argv: str) -> argparse.Namespace:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["run"].parse_args([*argv, PROBE])  # type: ignore[no-any-return]


def resolved(env: Mapping[str, str], *argv: str) -> Resolved:
    return resolve(parse(*argv), env)


# --- hostlists ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "names"), HOSTLISTS.items())
def test_hostlist_expands_as_scontrol_does(text: str, names: list[str]) -> None:
    assert expand_hostlist(text) == names


@pytest.mark.parametrize("text", [*REJECTED["invalid"], *REJECTED["taken_literally"]])
def test_malformed_hostlist_is_one_line_naming_the_variable(text: str) -> None:
    with pytest.raises(ConfigurationError) as info:
        expand_hostlist(text, "SLURM_STEP_NODELIST")
    message = str(info.value)
    assert message.startswith(f"SLURM_STEP_NODELIST={text!r}: ")
    assert "\n" not in message


def test_hostlist_limits() -> None:
    assert len(expand_hostlist("n[1-65536]")) == 65536
    with pytest.raises(ConfigurationError, match="more than"):
        expand_hostlist("n[1-1024]x[1-1025]")
    with pytest.raises(ConfigurationError, match="names no host"):
        expand_hostlist(" , ")


# --- the step's variables ----------------------------------------------------------------------------------------


def test_step_gives_one_world_on_the_first_node_with_a_per_job_port() -> None:
    """Both nodes of the real step derive the same rendezvous: 2 nodes, c10d on node1, port from job 3, GPUs."""
    seen = set()
    for env in STEP.values():
        cfg = resolved(env).command.config
        seen.add((cfg.min_nodes, cfg.max_nodes, cfg.rdzv_backend, cfg.rdzv_endpoint, cfg.run_id, cfg.nproc_per_node))
    assert seen == {(2, 2, "c10d", "node1:15003", "slurm-3-0", 2)}


def test_the_log_line_says_what_came_from_which_variable() -> None:
    line = resolved(STEP["node2"]).slurm_line
    assert "\n" not in line
    assert line.startswith("Slurm step 3.0: --nnodes 2 (SLURM_STEP_NUM_NODES=2); --rdzv-backend c10d; ")
    assert "--rdzv-endpoint node1:15003 (first node of SLURM_STEP_NODELIST=node[1-2], port 15000 + SLURM_JOB_ID" in line
    assert "--rdzv-id slurm-3-0 (SLURM_JOB_ID=3, SLURM_RESTART_COUNT=unset)" in line
    assert "--nproc-per-node 2 (SLURM_GPUS_ON_NODE=2)" in line
    assert "flags win" not in line


def test_batch_shell_derives_nothing_and_says_to_use_srun() -> None:
    """The batch shell (no SLURM_STEP_*) runs on one node: standalone as without Slurm, and a note."""
    result = resolved(BATCH)
    cfg = result.command.config
    assert (cfg.min_nodes, cfg.max_nodes, cfg.rdzv_endpoint, cfg.nproc_per_node) == (1, 1, "localhost:0", 1)
    assert "batch shell of job 3" in result.slurm_line
    assert "srun aelastic run" in result.slurm_line
    assert "SLURM_STEP_ID" not in BATCH


def test_no_slurm_no_change() -> None:
    result = resolved({})
    assert result.slurm_line == ""
    assert result.command.config.rdzv_endpoint == "localhost:0"
    assert set(result.sources.values()) <= {"default", "standalone (one node, no endpoint: torch 2.14's rule)"}


def test_a_requeued_job_gets_a_new_rendezvous_id() -> None:
    """Same job id, SLURM_RESTART_COUNT=1: a different run id (the dead predecessor's state is never joined), the
    same port (the predecessor's store is gone with it)."""
    first = resolved(STEP["node1"]).command.config
    again = resolved({**STEP["node1"], "SLURM_RESTART_COUNT": "1"}).command.config
    assert (first.run_id, again.run_id) == ("slurm-3-0", "slurm-3-1")
    assert first.rdzv_endpoint == again.rdzv_endpoint


def test_two_jobs_sharing_a_node_get_different_ports() -> None:
    ports = {slurm.job_port({"SLURM_JOB_ID": str(job)}) for job in range(1000, 1100)}
    assert len(ports) == 100
    assert {slurm.job_port({"SLURM_JOB_ID": str(j)}) for j in (0, 14999, 15000, 10**9)} <= set(range(15000, 30000))


def test_flags_and_pet_variables_win_and_the_line_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    env = STEP["node1"]
    result = resolved(env, "--nnodes", "1:4", "--nproc-per-node", "1", "--rdzv-id", "mine")
    cfg = result.command.config
    assert (cfg.min_nodes, cfg.max_nodes, cfg.nproc_per_node, cfg.run_id) == (1, 4, 1, "mine")
    assert cfg.rdzv_endpoint == "node1:15003"  # still derived: no flag named it
    assert "flags win: flag --nproc-per-node 1 wins over SLURM_GPUS_ON_NODE=2" in result.slurm_line
    result = resolved(env, "--nnodes", "3")
    assert "flag --nnodes 3 wins over SLURM_STEP_NUM_NODES=2" in result.slurm_line
    monkeypatch.setenv("PET_NNODES", "2:3")
    result = resolve(parse(), {**env, "PET_NNODES": "2:3"})
    assert (result.command.config.min_nodes, result.command.config.max_nodes) == (2, 3)
    assert result.sources["min_nodes"] == "PET_NNODES"


def test_the_jobs_own_etcd_runs_on_the_steps_nodes_with_a_per_job_port() -> None:
    """``--rdzv-backend etcd --rdzv-endpoint embedded`` (issue 33): the step's nodes, in order, and two ports of the
    job's own; an etcd_port given stays."""
    seen = set()
    for env in STEP.values():
        result = resolved(env, "--rdzv-backend", "etcd", "--rdzv-endpoint", "embedded")
        cfg = result.command.config
        seen.add((cfg.rdzv_backend, cfg.rdzv_endpoint, cfg.rdzv_configs.get("etcd_port")))
    assert seen == {("etcd", "embedded:node1,node2", "15006")}
    assert "--rdzv-endpoint embedded:node1,node2 (the nodes of SLURM_STEP_NODELIST=node[1-2])" in result.slurm_line
    assert "--rdzv-conf etcd_port=15006 (15000 + (2 * SLURM_JOB_ID) % 15000)" in result.slurm_line
    given = resolved(STEP["node1"], "--rdzv-backend", "etcd", "--rdzv-endpoint", "embedded", "--rdzv-conf",
                     "etcd_port=2479").command.config  # fmt: skip
    assert (given.rdzv_endpoint, given.rdzv_configs["etcd_port"]) == ("embedded:node1,node2", "2479")
    named = resolved(STEP["node1"], "--rdzv-backend", "etcd", "--rdzv-endpoint", "embedded:a,b,c").command.config
    assert named.rdzv_endpoint == "embedded:a,b,c"  # the user's own list: no Slurm value replaces it
    assert named.rdzv_configs["etcd_port"] == "15006"  # but the job's port: jobs sharing a node differ


def test_any_rendezvous_flag_keeps_the_backend_and_endpoint_as_given() -> None:
    env = STEP["node1"]
    cfg = resolved(env, "--rdzv-backend", "c10d", "--rdzv-endpoint", "192.0.2.9:7").command.config
    assert (cfg.rdzv_backend, cfg.rdzv_endpoint, cfg.run_id, cfg.min_nodes) == ("c10d", "192.0.2.9:7", "slurm-3-0", 2)
    cfg = resolved(env, "--master-addr", "192.0.2.9", "--master-port", "7", "--node-rank", "1").command.config
    assert (cfg.rdzv_backend, cfg.rdzv_endpoint) == ("static", "192.0.2.9:7")
    cfg = resolved(env, "--standalone").command.config
    assert (cfg.rdzv_endpoint, cfg.max_nodes) == ("localhost:0", 2)  # torch's --standalone: as given


def test_one_node_step_stays_standalone() -> None:
    env = {**STEP["node1"], "SLURM_STEP_NUM_NODES": "1", "SLURM_STEP_NUM_TASKS": "1", "SLURM_STEP_NODELIST": "node1"}
    result = resolved(env)
    assert result.command.config.rdzv_endpoint == "localhost:0"
    assert "one node: standalone" in result.slurm_line


def test_steps_of_one_node_of_a_larger_job_meet_on_the_jobs_first_node() -> None:
    """One step per node (the node-loss layout) with --nnodes 2:3: the store is on the job's first node."""
    env = {**STEP["node2"], "SLURM_STEP_NUM_NODES": "1", "SLURM_STEP_NUM_TASKS": "1", "SLURM_STEP_NODELIST": "node2",
           "SLURM_JOB_NODELIST": "node[1-3]"}  # fmt: skip
    result = resolved(env, "--nnodes", "2:3")
    assert result.command.config.rdzv_endpoint == "node1:15003"
    assert "first node of SLURM_JOB_NODELIST=node[1-3]" in result.sources["rdzv_endpoint"]


def test_more_tasks_than_nodes_is_refused() -> None:
    env = {**STEP["node1"], "SLURM_STEP_NUM_TASKS": "4", "SLURM_STEP_TASKS_PER_NODE": "2(x2)"}
    with pytest.raises(ConfigurationError, match=r"SLURM_STEP_NUM_TASKS=4 on SLURM_STEP_NUM_NODES=2: .* one task"):
        resolved(env)


def test_loopback_rendezvous_host_is_refused_naming_host_and_variable() -> None:
    env = {**STEP["node1"], "SLURM_STEP_NODELIST": "localhost,node2"}
    with pytest.raises(ConfigurationError) as info:
        resolved(env)
    assert re.fullmatch(
        r"rendezvous host 'localhost' \(from SLURM_STEP_NODELIST=localhost,node2\) resolves to loopback "
        r"\(127\.0\.0\.1(, ::1)?\), but up to 2 nodes must reach it: .*",
        str(info.value),
    )
    with pytest.raises(ConfigurationError, match=r"'127\.0\.0\.1' \(from flag --rdzv-endpoint\)"):
        resolved(STEP["node1"], "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:5")
    # Outside a multi-node step, a loopback endpoint is several agents on one machine: allowed, as torch allows it.
    assert resolved({}, "--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:5").command


def test_malformed_slurm_variables_exit_2_with_one_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for key, value in {**STEP["node1"], "SLURM_STEP_NODELIST": "node[1-2", "SLURM_STEP_NUM_NODES": ""}.items():
        monkeypatch.setenv(key, value)
    assert main(["run", "--dry-run", PROBE]) == 2
    err = capsys.readouterr().err
    assert err == (
        "aelastic run: error: SLURM_STEP_NODELIST='node[1-2': 'node[1-2' is not a Slurm hostlist name: "
        "unbalanced brackets\n"
    )
    monkeypatch.setenv("SLURM_STEP_NUM_NODES", "two")
    assert main(["run", "--dry-run", PROBE]) == 2
    assert "SLURM_STEP_NUM_NODES='two'" in capsys.readouterr().err


# --- --dry-run ---------------------------------------------------------------------------------------------------


def _rows(text: str) -> dict[str, tuple[str, str]]:
    rows = {}
    for line in text.splitlines()[1:]:
        name, _, rest = line.strip().partition(" ")
        value, _, source = rest.strip().rpartition("<- ")
        rows[name] = (value.strip(), source)
    return rows


def test_dry_run_prints_every_value_and_its_source(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for key, value in STEP["node1"].items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("PET_MAX_RESTARTS", "5")
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "7")
    before = dict(os.environ)
    assert main(["run", "--dry-run", "--rdzv-conf", "join_timeout=60", PROBE, "x"]) == 0
    assert dict(os.environ) == before  # nothing exported (no OMP_NUM_THREADS), nothing started
    out = capsys.readouterr().out
    assert out.startswith("aelastic run --dry-run: the resolved configuration (nothing started)\n")
    rows = _rows(out)
    assert rows["min_nodes"] == ("2", "SLURM_STEP_NUM_NODES=2")
    assert rows["nproc_per_node"] == ("2", "SLURM_GPUS_ON_NODE=2")
    assert rows["run_id"] == ("'slurm-3-0'", "SLURM_JOB_ID=3, SLURM_RESTART_COUNT=unset")
    assert rows["rdzv_configs"] == ("{'join_timeout': '60'}", "flag --rdzv-conf")
    assert rows["max_restarts"] == ("5", "PET_MAX_RESTARTS")
    assert rows["shutdown_grace"] == ("7.0", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT")
    assert rows["role"] == ("'default'", "default")
    assert rows["workers"][0].endswith(f"{PROBE} x")


def test_dry_run_without_slurm_names_the_standalone_rule(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--dry-run", "--nproc_per_node", "3", PROBE]) == 0
    rows = _rows(capsys.readouterr().out)
    assert rows["nproc_per_node"] == ("3", "flag --nproc_per_node")
    assert rows["rdzv_endpoint"] == ("'localhost:0'", "standalone (one node, no endpoint: torch 2.14's rule)")
    assert main(["run", "--dry-run", "--standalone", PROBE]) == 0
    assert _rows(capsys.readouterr().out)["run_id"][1] == "standalone (flag --standalone)"
