"""``aelastic run``'s command line: torchrun's flags, defaults and PET_* variables; one-line errors with exit status
2 before anything starts; flags that do nothing here explained; addresses; ``--help``.

The flag tables are compared with torch's own parser (``torch.distributed.run.get_args_parser``); the user-facing
behaviour is checked on the real command (``python -m aelastic run`` in a subprocess).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from aelastic._net import format_address, parse_endpoint
from aelastic.cli import build_parser, main
from aelastic.config import PrewarmOptions
from aelastic.config.command import config_from_args
from aelastic.errors import ConfigurationError

TESTS = Path(__file__).parent
PROBE = str(TESTS / "cli_probe.py")
DEADLINE = 120.0  # seconds for one command on a loaded machine


@pytest.fixture(autouse=True)
def no_pet(monkeypatch: pytest.MonkeyPatch) -> None:
    """The parsers read PET_* variables when built: start every test without any."""
    for key in [k for k in os.environ if k.startswith("PET_")]:
        monkeypatch.delenv(key)


def run_parser() -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    parser = sub.choices["run"]
    assert isinstance(parser, argparse.ArgumentParser)
    return parser


def torch_parser() -> argparse.ArgumentParser:
    run = pytest.importorskip("torch.distributed.run")
    parser = run.get_args_parser()
    assert isinstance(parser, argparse.ArgumentParser)
    return parser


def options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {a.dest: a for a in parser._actions if a.option_strings and a.dest != "help"}


def is_switch(action: argparse.Action) -> bool:
    return action.nargs == 0


# --- the flag table, against torch's -----------------------------------------------------------------------------


@pytest.mark.torch
def test_every_torchrun_flag_with_its_spellings_default_and_choices() -> None:
    ours, theirs = options(run_parser()), options(torch_parser())
    missing = sorted(set(theirs) - set(ours))
    assert not missing, f"torchrun flags aelastic lacks: {missing}"
    for dest, action in theirs.items():
        mine = ours[dest]
        assert set(action.option_strings) <= set(mine.option_strings), dest
        assert mine.default == action.default, f"{dest}: default {mine.default!r}, torchrun {action.default!r}"
        assert is_switch(mine) == is_switch(action), dest
        assert mine.choices == action.choices, dest
    extra = sorted(set(ours) - set(theirs))
    # torch 2.14's template flag, and ours
    assert extra == [
        "async_backend", "checkpoint_dir", "checkpoint_memory", "checkpoint_persist_every", "checkpoint_replicas",
        "dry_run", "hang_timeout", "log_line_prefix_template", "max_repeated_failures", "max_restarts_scope",
        "metrics_port", "node_check", "node_check_slowdown", "prewarm", "prewarm_modules", "signals_to_forward",
        "unkillable_timeout", "watchdog_timeout",
    ], extra  # fmt: skip


@pytest.mark.torch
def test_pet_variables_set_the_same_defaults_as_for_torchrun(monkeypatch: pytest.MonkeyPatch) -> None:
    values = {"nnodes": "1:3", "nproc_per_node": "3", "rdzv_backend": "c10d", "rdzv_endpoint": "h:1",
              "rdzv_id": "job", "rdzv_conf": "a=1", "max_restarts": "2", "monitor_interval": "0.5",
              "start_method": "fork", "event_log_handler": "console", "role": "trainer", "log_dir": "/l",
              "redirects": "3", "tee": "1", "local_ranks_filter": "0", "duplicate_stdout_filters": "a,,b,c",
              "duplicate_stderr_filters": "x", "node_rank": "1", "master_addr": "10.0.0.1", "master_port": "1234",
              "local_addr": "10.0.0.2", "signals_to_handle": "SIGTERM", "shutdown_timeout": "5"}  # fmt: skip
    switches = ["standalone", "module", "no_python", "run_path", "virtual_local_rank"]
    for dest, value in values.items():
        monkeypatch.setenv(f"PET_{dest.upper()}", value)
    for dest in switches:
        monkeypatch.setenv(f"PET_{dest.upper()}", "1")
    ours = vars(run_parser().parse_args(["train.py"]))
    theirs = vars(torch_parser().parse_args(["train.py"]))
    compared = [*values, *switches]
    assert {k: ours[k] for k in compared} == {k: theirs[k] for k in compared}
    assert ours["duplicate_stdout_filters"] == ["a,b", "c"]  # ",," is a literal comma
    assert all(ours[k] is True for k in switches)


def test_help_is_grouped_like_torchrun_and_every_flag_shows_its_default(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["run", "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    torch_groups = [  # the sections of torch/distributed/run.py's get_args_parser, in order
        "Worker/node size",
        "Rendezvous",
        "User-code launch",
        "Backwards compatible parameters with caffe2.distributed.launch",
    ]
    groups = [g.title for g in run_parser()._action_groups if g.title not in ("positional arguments", "options")]
    assert groups[:4] == torch_groups
    positions = [text.index(f"\n{title}:\n") for title in groups]
    assert positions == sorted(positions)
    for action in run_parser()._actions:
        if action.option_strings and action.dest != "help":
            assert action.help is not None
            assert "(default: " in action.help or "default: " in action.help, action.dest


# --- bad input: one line, exit 2, nothing started ------------------------------------------------------------------


def aelastic(*args: str, env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("PET_")}
    return subprocess.run(
        [sys.executable, "-m", "aelastic", *args],
        env=base | dict(env or {}),
        capture_output=True,
        text=True,
        timeout=DEADLINE,
        cwd=TESTS,
    )


BAD_INPUTS: list[tuple[list[str], dict[str, str], list[str]]] = [
    (["--nnodes", "4:2"], {}, ["--nnodes '4:2'", "MIN must be <= MAX"]),
    (["--nnodes", "0"], {}, ["--nnodes '0'", "MIN must be >= 1"]),
    (["--nnodes", "two"], {}, ["--nnodes 'two'", "N or MIN:MAX"]),
    (["--nproc-per-node", "-1"], {}, ["--nproc-per-node '-1'", "positive integer"]),
    (["--nproc-per-node", "many"], {}, ["--nproc-per-node 'many'", "positive integer, cpu, gpu or auto"]),
    (["--nproc-per-node", "gpu"], {"CUDA_VISIBLE_DEVICES": ""}, ["--nproc-per-node 'gpu'", "no visible GPU"]),
    (["--rdzv-conf", "foo"], {}, ["--rdzv-conf 'foo'", "not KEY=VALUE"]),
    (["--rdzv-conf", "join_timeout="], {}, ["--rdzv-conf 'join_timeout='", "not KEY=VALUE"]),
    (["--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0", "--rdzv-conf", "join_timeout=soon"], {},
     ["--rdzv-conf join_timeout='soon'", "number of seconds"]),
    (["--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0", "--rdzv-conf", "last_call_timeout=-1"], {},
     ["--rdzv-conf last_call_timeout='-1'", "> 0"]),
    (["--rdzv-backend", "etcd", "--rdzv-endpoint", "localhost:2379", "--rdzv-conf", "close_timeout=x"], {},
     ["--rdzv-conf close_timeout='x'", "number of seconds"]),
    (["--rdzv-backend", "c10d", "--rdzv-endpoint", "host:notaport"], {},
     ["--rdzv-endpoint 'host:notaport'", "port 'notaport' is not an integer 0..65535"]),
    (["--rdzv-backend", "c10d", "--rdzv-endpoint", "[::1:29400"], {}, ["--rdzv-endpoint '[::1:29400'", "[ADDR]"]),
    (["--rdzv-backend", "zookeeper", "--rdzv-endpoint", "h:1"], {},
     ["--rdzv-backend 'zookeeper'", "unknown rendezvous backend", "c10d"]),
    (["--max-restarts", "-1"], {}, ["--max-restarts -1", ">= 0"]),
    (["--signals-to-handle", "SIGTERM,SIGNOPE"], {}, ["--signals-to-handle", "'SIGNOPE' is not a signal name"]),
    (["--redirects", "7"], {}, ["--redirects '7'", "0..3"]),
    (["--logs-specs", "custom"], {}, ["--logs-specs 'custom'", "'torchrun.logs_specs'", "installed: default"]),
    (["-m", "--no-python"], {}, ["-m/--module and --no-python", "cannot be used together"]),
    (["--hang-timeout", "0"], {}, ["--hang-timeout", "'0' is not a number of seconds more than 0"]),
    (["--max-repeated-failures", "-1"], {}, ["--max-repeated-failures -1", ">= 0"]),
    (["--max-restarts-scope", "world"], {}, ["--max-restarts-scope", "invalid choice: 'world'"]),
    (["--watchdog-timeout", "nan"], {}, ["--watchdog-timeout", "'nan' is not a number of seconds more than 0"]),
    ([], {"PET_HANG_TIMEOUT": "soon"}, ["--hang-timeout", "'soon' is not a number of seconds more than 0"]),
    ([], {"PET_NNODES": "4:2"}, ["--nnodes '4:2'", "MIN must be <= MAX"]),
    ([], {"PET_STANDALONE": "yes"}, ["PET_STANDALONE='yes'", "must be 0 or 1"]),
]  # fmt: skip


@pytest.mark.parametrize(("flags", "env", "expected"), BAD_INPUTS, ids=lambda v: str(v) if isinstance(v, list) else "")
def test_bad_input_is_one_line_and_exit_2_before_anything_starts(
    flags: list[str], env: dict[str, str], expected: list[str], tmp_path: Path
) -> None:
    result = aelastic("run", *flags, PROBE, env={"PROBE_OUT": str(tmp_path)} | env)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert re.match(r"aelastic( run)?: error: ", lines[0]), lines[0]  # PET_* are read before the command is known
    for part in expected:
        assert part in lines[0]
    assert result.stdout == ""
    assert list(tmp_path.iterdir()) == []  # no worker ran


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["run", "missing.py"], "training script 'missing.py': no such file"),
        (["run", "--no-python", "no-such-program-here"], "'no-such-program-here': no such executable"),
        (["run"], "the following arguments are required: training_script"),
        (["run", "--nnodes"], "argument --nnodes: expected one argument"),
        (["run", "--start-method", "thread", PROBE], "argument --start-method"),
        (["--log-level", "LOUD", "run", PROBE], "--log-level 'LOUD'"),
        (["run", "--checkpoint", "5", PROBE], "unrecognized arguments: --checkpoint"),  # abbreviates four flags
    ],
)
def test_missing_script_and_malformed_command_lines(args: list[str], expected: str) -> None:
    result = aelastic(*args)
    assert result.returncode == 2, result.stderr
    assert len(result.stderr.splitlines()) == 1, result.stderr
    assert expected in result.stderr
    assert "Traceback" not in result.stderr


def test_script_arguments_that_abbreviate_several_flags_are_the_scripts() -> None:
    """argparse classifies every argument before it knows where the script starts: an abbreviation of several
    flags (``--checkpoint``: ``--checkpoint-dir``, ``--checkpoint-memory``, ...) after the script is the script's."""
    args = build_parser().parse_args(["run", "--standalone", "train.py", "--checkpoint", "ckpt", "--nproc", "2"])
    assert (args.training_script, args.training_script_args) == ("train.py", ["--checkpoint", "ckpt", "--nproc", "2"])
    assert args.nproc_per_node == "1"


# --- accepted, explained, run ------------------------------------------------------------------------------------


def probe_records(out: Path) -> dict[int, dict[str, Any]]:
    return {int(p.stem[len("rank") :]): json.loads(p.read_text()) for p in out.glob("rank*.json")}


def test_flags_that_do_nothing_here_are_accepted_and_explained(tmp_path: Path) -> None:
    flags = ["--numa-binding", "node", "--logs-specs", "default", "--start-method", "fork",
             "--event-log-handler", "console"]  # fmt: skip
    env = {"PROBE_OUT": str(tmp_path)}
    env.pop("OMP_NUM_THREADS", None)
    result = aelastic("run", "--standalone", "--nproc-per-node", "2", *flags, PROBE, env=env)
    assert result.returncode == 0, result.stderr
    for flag in ["--numa-binding node", "--start-method fork"]:
        assert f"{flag}: accepted for torchrun compatibility and ignored" in result.stderr, flag
    # --event-log-handler has its effect now (tests/test_observability.py): torch's events on stderr.
    assert '{"name": "torchelastic.worker.status.SUCCEEDED", "source": "WORKER"' in result.stderr
    assert "Setting OMP_NUM_THREADS environment variable for each process to be 1" in result.stderr
    records = probe_records(tmp_path)
    assert sorted(records) == [0, 1]
    assert {r["env"]["LOCAL_RANK"] for r in records.values()} == {"0", "1"}


def test_the_file_event_handler_writes_where_its_help_says(tmp_path: Path) -> None:
    """``--event-log-handler file``: events.jsonl in the run's log directory, beside its attempt_<n>/."""
    help_text = run_parser()._option_string_actions["--event-log-handler"].help or ""
    assert "<--log-dir>/<run id>_<random suffix>/, beside attempt_<n>/" in help_text
    logs = tmp_path / "logs"
    result = aelastic("run", "--standalone", "--log-dir", str(logs), "--rdzv-id", "ignored", "--event-log-handler",
                      "file", PROBE, env={"PROBE_OUT": str(tmp_path)})  # fmt: skip
    assert result.returncode == 0, result.stderr
    (run_dir,) = logs.iterdir()
    assert sorted(p.name for p in run_dir.iterdir() if p.name in ("events.jsonl", "attempt_0")) == [
        "attempt_0",
        "events.jsonl",
    ]
    assert '"torchelastic.worker.status.SUCCEEDED"' in (run_dir / "events.jsonl").read_text()


CHATTY = """
import os, sys
rank = os.environ["RANK"]
print(f"step 1 loss 0.5{rank}", flush=True)
print(f"step 1 acc 0.9{rank}", flush=True)
print(f"warning: slow, rank {rank}", file=sys.stderr, flush=True)
"""


def test_duplicate_filters_copy_matching_lines_of_every_worker_to_the_attempt_file(tmp_path: Path) -> None:
    script = tmp_path / "chatty.py"
    script.write_text(CHATTY)
    flags = ["--duplicate-stdout-filters", "loss,nan", "--duplicate-stderr-filters", "warning", "--log-dir", tmp_path]
    result = aelastic("run", "--standalone", "--nproc-per-node", "2", *map(str, flags), str(script))
    assert result.returncode == 0, result.stderr
    assert "step 1 acc 0.90" in result.stdout  # the console is unchanged
    (attempt,) = tmp_path.glob("*/attempt_0")
    stdout_lines = sorted((attempt / "filtered_stdout.log").read_text().splitlines())
    assert stdout_lines == ["[default0]:step 1 loss 0.50", "[default1]:step 1 loss 0.51"]
    stderr_lines = sorted((attempt / "filtered_stderr.log").read_text().splitlines())
    assert stderr_lines == ["[default0]:warning: slow, rank 0", "[default1]:warning: slow, rank 1"]


def test_virtual_local_rank_gives_local_rank_0_and_one_device_each(tmp_path: Path) -> None:
    env = {"PROBE_OUT": str(tmp_path), "CUDA_VISIBLE_DEVICES": "3,5"}
    result = aelastic("run", "--standalone", "--nproc-per-node", "2", "--virtual-local-rank", PROBE, env=env)
    assert result.returncode == 0, result.stderr
    records = probe_records(tmp_path)
    assert {rank: (r["env"]["LOCAL_RANK"], r["env"]["CUDA_VISIBLE_DEVICES"]) for rank, r in records.items()} == {
        0: ("0", "3"),
        1: ("0", "5"),
    }


# --- addresses -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("10.1.2.3:29400", ("10.1.2.3", 29400)),
        ("10.1.2.3", ("10.1.2.3", 29400)),
        ("[::1]:29401", ("::1", 29401)),
        ("[fe80::1%eth0]:7", ("fe80::1%eth0", 7)),
        ("::1", ("::1", 29400)),
        ("[2001:db8::5]", ("2001:db8::5", 29400)),
        ("node-7.cluster.local:1", ("node-7.cluster.local", 1)),
        ("localhost", ("localhost", 29400)),
    ],
)
def test_endpoints_ipv4_ipv6_and_hostnames(text: str, expected: tuple[str, int]) -> None:
    assert parse_endpoint(text, 29400) == expected
    assert parse_endpoint(format_address(*expected), None) == expected


def config(*argv: str) -> Any:
    return config_from_args(run_parser().parse_args([*argv, PROBE]))


@pytest.fixture
def restore_environ() -> Iterator[None]:
    saved = dict(os.environ)  # config_from_args sets what torchrun sets in its own environment
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.mark.usefixtures("restore_environ")
def test_addresses_given_are_kept_as_given_never_resolved() -> None:
    cfg, _, _ = config("--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "192.0.2.7:29400")
    assert cfg.rdzv_endpoint == "192.0.2.7:29400"
    cfg, _, _ = config("--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "[2001:db8::7]:29400",
                       "--local-addr", "2001:db8::8")  # fmt: skip
    assert (cfg.rdzv_endpoint, cfg.local_addr) == ("[2001:db8::7]:29400", "2001:db8::8")
    cfg, _, _ = config("--nnodes", "2", "--master-addr", "[::1]", "--master-port", "5000")
    assert (cfg.rdzv_backend, cfg.rdzv_endpoint, cfg.rdzv_configs["rank"]) == ("static", "[::1]:5000", 0)
    cfg, _, _ = config("--nnodes", "2", "--master-addr", "node-0.example", "--node-rank", "1")
    assert (cfg.rdzv_endpoint, cfg.rdzv_configs["rank"]) == ("node-0.example:29500", 1)


@pytest.mark.usefixtures("restore_environ")
def test_standalone_and_torch_2_14_automatic_standalone() -> None:
    run_ids = set()
    for argv in (["--standalone", "--rdzv-backend", "etcd", "--rdzv-id", "x"], []):
        cfg, entrypoint, args = config(*argv)
        assert (cfg.rdzv_backend, cfg.rdzv_endpoint) == ("c10d", "localhost:0")
        parsed = uuid.UUID(cfg.run_id)  # a random version-4 UUID in its text form, as torchrun's
        assert (str(parsed), parsed.version, parsed.variant) == (cfg.run_id, 4, uuid.RFC_4122)
        run_ids.add(cfg.run_id)
        assert (entrypoint, args) == (sys.executable, ["-u", PROBE])
    assert len(run_ids) == 2
    cfg, _, _ = config("--master-port", "29600")  # a port given: static, as torch 2.14
    assert (cfg.rdzv_backend, cfg.rdzv_endpoint) == ("static", "127.0.0.1:29600")


def test_a_user_error_in_config_is_a_configuration_error() -> None:
    with pytest.raises(ConfigurationError, match=r"--nnodes '3:1': MIN must be <= MAX"):
        config("--nnodes", "3:1")


def test_ipv6_loopback_endpoint_end_to_end(tmp_path: Path) -> None:
    result = aelastic("run", "--rdzv-backend", "c10d", "--rdzv-endpoint", "[::1]:0", "--nproc-per-node", "1", PROBE,
                      env={"PROBE_OUT": str(tmp_path)})  # fmt: skip
    assert result.returncode == 0, result.stderr
    (record,) = probe_records(tmp_path).values()
    assert record["env"]["MASTER_ADDR"] == "::1"  # the address the node reached the store at, kept literal


def test_nproc_per_node_cpu_counts_the_affinity_mask_as_torch_does() -> None:
    """``taskset -c 0 torchrun --nproc-per-node cpu`` starts one worker on a machine of several CPUs (torch counts
    ``os.sched_getaffinity``); so does aelastic (torch's test_run.py test_nproc_launch_auto_configurations)."""
    code = "from aelastic.config.values import parse_nproc; print(parse_nproc('cpu', {}), parse_nproc('auto', {}))"
    out = subprocess.run(
        ["taskset", "-c", "0", sys.executable, "-c", code],
        capture_output=True, text=True, check=True, timeout=60, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    )  # fmt: skip
    assert out.stdout.split() == ["1", "1"]


@pytest.mark.usefixtures("restore_environ")
@pytest.mark.parametrize(
    ("visible", "gpu", "auto"),
    [("0,1", 2, 2), ("GPU-5b2c,GPU-77aa,GPU-0f1e", 3, 3), ("0,-1,2", 1, 1), ("", None, len(os.sched_getaffinity(0)))],
)
def test_nproc_per_node_gpu_and_auto_count_visible_gpus(
    visible: str, gpu: int | None, auto: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)  # as CUDA reads it: up to the first invalid entry
    assert config("--nproc-per-node", "auto")[0].nproc_per_node == auto
    assert config("--nproc-per-node", "cpu")[0].nproc_per_node == len(os.sched_getaffinity(0))
    if gpu is None:
        with pytest.raises(ConfigurationError, match=r"--nproc-per-node 'gpu': no visible GPU"):
            config("--nproc-per-node", "gpu")
    else:
        assert config("--nproc-per-node", "gpu")[0].nproc_per_node == gpu


def test_unreachable_rendezvous_is_one_line_and_exit_1(tmp_path: Path) -> None:
    import socket

    with socket.socket() as s:  # bound, never listening: connections are refused
        s.bind(("127.0.0.1", 0))
        endpoint = f"127.0.0.1:{s.getsockname()[1]}"
        flags = ["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-conf",
                 "is_host=false,read_timeout=2"]  # fmt: skip
        result = aelastic("run", *flags, PROBE, env={"PROBE_OUT": str(tmp_path)})
    assert result.returncode == 1
    assert result.stderr.splitlines() == [result.stderr.strip()], result.stderr
    assert f"aelastic run: error: could not reach the rendezvous store at {endpoint}" in result.stderr
    assert list(tmp_path.iterdir()) == []


# --- issue 14: --rdzv-conf keys torchrun passes, and address errors as one line --------------------------------------


def test_rdzv_conf_key_no_backend_uses_is_one_warning_and_the_run_proceeds(tmp_path: Path) -> None:
    flags = ["--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0", "--rdzv-conf", "colour=blue,join_timeout=60"]
    result = aelastic("run", *flags, PROBE, env={"PROBE_OUT": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    warnings = [line for line in result.stderr.splitlines() if "'colour'" in line]
    assert len(warnings) == 1, result.stderr  # once, although the command line and the launch both check
    assert "WARNING" in warnings[0]
    assert "not used by the 'c10d' backend" in warnings[0]
    assert "known keys: auth_token, close_timeout" in warnings[0]
    assert sorted(probe_records(tmp_path)) == [0]


def test_rdzv_conf_timeout_with_c10d_runs_as_under_torchrun(tmp_path: Path) -> None:
    flags = ["--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0", "--rdzv-conf", "timeout=5"]
    result = aelastic("run", *flags, PROBE, env={"PROBE_OUT": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    assert "timeout" not in result.stderr  # torch's own key: neither refused nor warned about
    assert sorted(probe_records(tmp_path)) == [0]


def test_a_known_rdzv_conf_key_with_a_bad_value_stays_an_error(tmp_path: Path) -> None:
    # join_timeout: a key c10d reads (torchrun's `timeout` is read only by static, so c10d lets it pass as torch does)
    flags = ["--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0", "--rdzv-conf", "colour=blue,join_timeout=soon"]
    result = aelastic("run", *flags, PROBE, env={"PROBE_OUT": str(tmp_path)})
    assert result.returncode == 2, result.stderr
    assert (
        result.stderr.splitlines()[-1]
        == "aelastic run: error: --rdzv-conf join_timeout='soon': must be a number of seconds"
    )
    assert list(tmp_path.iterdir()) == []


def test_store_on_a_port_in_use_is_one_line_naming_the_address() -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        result = aelastic("store", "--host", "127.0.0.1", "--port", str(port))
    assert result.returncode == 1, result.stderr
    assert result.stderr.splitlines() == [
        f"aelastic store: error: the store server cannot listen on 127.0.0.1:{port}: Address already in use"
    ], result.stderr


@pytest.mark.parametrize(
    ("host", "reason"),
    [("192.0.2.1", "Cannot assign requested address"), ("no-such-host.invalid", "")],  # TEST-NET-1; RFC 2606
)
def test_store_on_an_address_not_this_hosts_is_one_line_naming_it(host: str, reason: str) -> None:
    result = aelastic("store", "--host", host, "--port", "0")
    assert result.returncode == 1, result.stderr
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"aelastic store: error: the store server cannot listen on {host}:0: {reason}"), line


def test_run_hosting_the_rendezvous_on_an_address_not_this_hosts_is_one_line_naming_it(tmp_path: Path) -> None:
    flags = ["--rdzv-backend", "c10d", "--rdzv-endpoint", "192.0.2.1:29400", "--rdzv-conf", "is_host=true"]
    result = aelastic("run", *flags, PROBE, env={"PROBE_OUT": str(tmp_path)})
    assert result.returncode == 1, result.stderr
    assert result.stderr.splitlines() == [
        "aelastic run: error: rendezvous endpoint: the store server cannot listen on 192.0.2.1:29400: "
        "Cannot assign requested address"
    ], result.stderr
    assert list(tmp_path.iterdir()) == []


def test_etcd_on_a_port_in_use_is_one_line_naming_the_address(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import socket

    import aelastic.etcd.server

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        # The free ports `aelastic etcd` picks are taken between the pick and etcd's bind (a race made certain).
        monkeypatch.setattr(aelastic.etcd.server, "_free_ports", lambda count: [port] * count)
        code = main(["etcd"])
    assert code == 1
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"aelastic etcd: error: etcd aelastic0 (http://127.0.0.1:{port}) exited with"), line
    assert f"listen tcp 127.0.0.1:{port}: bind: address already in use" in line


@pytest.mark.usefixtures("restore_environ")
def test_prewarm_flags_and_their_pet_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg, _, _ = config()
    assert cfg.prewarm == PrewarmOptions(enabled=False, modules=())
    cfg, _, _ = config("--prewarm", "--prewarm-modules", "numpy,json")
    assert cfg.prewarm == PrewarmOptions(enabled=True, modules=("numpy", "json"))
    monkeypatch.setenv("PET_PREWARM", "1")
    monkeypatch.setenv("PET_PREWARM_MODULES", "numpy")
    cfg, _, _ = config()
    assert cfg.prewarm == PrewarmOptions(enabled=True, modules=("numpy",))
    with pytest.raises(ConfigurationError, match="'a-b' is not a module name"):
        config("--prewarm-modules", "a-b")


# --- the command's process -----------------------------------------------------------------------------------------

FREEZE_PROBE = """
import atexit, gc, sys
atexit.register(lambda: print("frozen", gc.get_freeze_count(), "enabled", gc.isenabled(), file=sys.stderr))
sys.argv = ["aelastic", *sys.argv[1:]]
{call}
"""


@pytest.mark.parametrize(
    "call",
    [
        "from aelastic.__main__ import console; console()",
        "import runpy; runpy.run_module('aelastic', run_name='__main__')",
    ],
    ids=["console-script", "python-m"],
)
def test_the_command_freezes_its_imports_out_of_the_collector_and_keeps_main_s_status(call: str) -> None:
    """Both spellings of the command (the ``aelastic`` script, ``python -m aelastic``) freeze the objects of their
    imports out of the cyclic collector (see :func:`aelastic.__main__.console`), leave it enabled, and exit with the
    status :func:`~aelastic.cli.main` returned."""
    proc = subprocess.run(
        [sys.executable, "-c", FREEZE_PROBE.format(call=call), "run", "--nnodes", "0", "train.py"],
        capture_output=True, text=True, timeout=DEADLINE,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    error, report = proc.stderr.splitlines()
    assert error.startswith("aelastic run: error: --nnodes"), error
    frozen, enabled = re.fullmatch(r"frozen (\d+) enabled (\w+)", report).groups()  # type: ignore[union-attr]
    assert int(frozen) > 10_000, report
    assert enabled == "True", report


def test_main_called_in_a_process_of_the_callers_leaves_the_collector_alone() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", "import gc; from aelastic.cli import main; main(['run', '--nnodes', '0', 'train.py']); "
         "print(gc.get_freeze_count(), gc.isenabled())"],
        capture_output=True, text=True, timeout=DEADLINE,
    )  # fmt: skip
    assert proc.stdout.split() == ["0", "True"], proc.stderr
