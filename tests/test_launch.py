"""``aelastic.launch`` (awaited from asyncio and trio) and ``aelastic.run`` (blocking, also inside a running loop),
with real worker processes; and the public surface of ``aelastic``."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import textwrap
from functools import partial
from pathlib import Path
from typing import cast

import anyio
import anyio.abc
import pytest

import aelastic
from aelastic import ChildFailedError, LaunchConfig, LaunchControl, LogOptions
from aelastic.config.streams import Std

pytestmark = pytest.mark.anyio

DEADLINE = 90.0  # generous: the machine is small and shared
HERE = Path(__file__).resolve().parent


def rank_and_double(x: int) -> tuple[int, int, int]:
    return int(os.environ["RANK"]), 2 * x, int(os.environ["WORLD_SIZE"])


def fails_on_rank_one(shard: str) -> None:
    if os.environ["RANK"] == "1":
        raise ValueError(f"bad shard {shard!r}")


def report_pid_and_sleep(port: int) -> None:
    import socket
    import time

    with socket.create_connection(("127.0.0.1", port)) as conn:
        conn.sendall(f"{os.getpid()}\n".encode())
    time.sleep(600)


def exists(pid: int) -> bool:
    """Whether ``pid`` exists at all (a zombie counts: it was not reaped)."""
    return os.path.exists(f"/proc/{pid}")


def children_of_this_process() -> list[int]:
    me = str(os.getpid())
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[1] == me and fields[0] not in ("Z", "X"):
                found.append(int(entry))
    return found


@pytest.fixture
def importable_tests(monkeypatch: pytest.MonkeyPatch) -> None:
    """Workers unpickle this module's functions by reference: let them import it."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))


@pytest.mark.usefixtures("importable_tests")
async def test_launch_returns_values_by_global_rank(tmp_path: Path) -> None:
    config = LaunchConfig(nproc_per_node=2, max_restarts=0, logs=LogOptions(tmp_path))
    with anyio.fail_after(DEADLINE):
        values = await aelastic.launch(config, rank_and_double, 21)
    assert values == {0: (0, 42, 2), 1: (1, 42, 2)}


@pytest.mark.usefixtures("importable_tests")
async def test_launch_raises_child_failed_error_with_the_traceback(tmp_path: Path) -> None:
    config = LaunchConfig(nproc_per_node=2, max_restarts=0, logs=LogOptions(tmp_path))
    with anyio.fail_after(DEADLINE), pytest.raises(ChildFailedError) as caught:
        await aelastic.launch(config, fails_on_rank_one, "s-7")
    rank, failure = caught.value.get_first_failure()
    assert rank == 1
    assert failure.message == "ValueError: bad shard 's-7'"
    assert failure.error_file.endswith("attempt_0/1/error.json")  # the callable runs under record()
    report = str(caught.value)
    assert "fails_on_rank_one FAILED" in report
    assert "Traceback (most recent call last)" in report


@pytest.mark.usefixtures("importable_tests")
async def test_cancelling_launch_leaves_no_process(tmp_path: Path) -> None:
    config = LaunchConfig(nproc_per_node=2, max_restarts=0, logs=LogOptions(tmp_path), shutdown_timeout=5)
    multi = await anyio.create_tcp_listener(local_host="127.0.0.1")
    listener = cast(anyio.abc.SocketListener, multi.listeners[0])
    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    pids = []
    before = set(children_of_this_process())  # e.g. the session's etcd server, started by earlier tests
    with anyio.fail_after(DEADLINE):
        async with multi, anyio.create_task_group() as tg:
            tg.start_soon(aelastic.launch, config, report_pid_and_sleep, port)
            for _ in range(2):  # each worker connects once it runs
                async with await listener.accept() as conn:
                    pids.append(int((await conn.receive()).decode()))
            assert set(pids) <= set(children_of_this_process())  # the workers run, next to the reaper sidecar
            tg.cancel_scope.cancel()
    # launch() returned from its cancellation only after stopping and reaping everything it started.
    assert set(children_of_this_process()) - before == set()
    assert not [pid for pid in pids if exists(pid)]


def report_pid_and_record_the_stop_signal(port: int, out: str) -> None:
    import socket
    import time

    def stopped(signum: int, frame: object) -> None:
        Path(out, f"stopped{os.environ['RANK']}").write_text(signal.Signals(signum).name)
        os._exit(0)

    signal.signal(signal.SIGINT, stopped)
    signal.signal(signal.SIGTERM, stopped)
    with socket.create_connection(("127.0.0.1", port)) as conn:
        conn.sendall(f"{os.getpid()}\n".encode())
    time.sleep(600)


@pytest.mark.usefixtures("importable_tests")
async def test_launch_control_sets_the_stop_signal_and_observes_the_joins(tmp_path: Path) -> None:
    """What the command line steers a launch with, through launch() alone: the signal a cancelled launch stops
    the workers with, and an observer of this node's rendezvous joins."""
    config = LaunchConfig(nproc_per_node=2, max_restarts=0, logs=LogOptions(tmp_path / "logs"), shutdown_timeout=5)
    seen: list[str] = []
    control = LaunchControl(join_observer=lambda node, state, settings, timers, now, action: seen.append(action.name))
    assert control.stop_signal.signum == signal.SIGTERM  # torch's default
    multi = await anyio.create_tcp_listener(local_host="127.0.0.1")
    listener = cast(anyio.abc.SocketListener, multi.listeners[0])
    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    with anyio.fail_after(DEADLINE):
        async with multi, anyio.create_task_group() as tg:
            tg.start_soon(
                partial(
                    aelastic.launch, config, report_pid_and_record_the_stop_signal, port, str(tmp_path), control=control
                )
            )
            for _ in range(2):
                async with await listener.accept() as conn:
                    await conn.receive()
            control.stop_signal.signum = signal.SIGINT  # as the command line does when it receives one
            tg.cancel_scope.cancel()
    stops = sorted(p.read_text() for p in tmp_path.glob("stopped*"))  # noqa: ASYNC240  # the launch has ended
    assert stops == ["SIGINT", "SIGINT"]
    assert seen, "the join observer was never called"


def torch_launch_config_defaults() -> dict[str, object]:
    """Every field of torch's ``LaunchConfig`` that has a default, with that default."""
    api = pytest.importorskip("torch.distributed.launcher.api")
    defaults: dict[str, object] = {}
    for f in dataclasses.fields(api.LaunchConfig):
        if f.default is not dataclasses.MISSING:
            defaults[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            defaults[f.name] = f.default_factory()
    return defaults


@pytest.mark.torch
@pytest.mark.usefixtures("importable_tests")
async def test_a_launch_config_with_torchs_defaults_launches(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 23, item 7: code ported from ``elastic_launch`` passes torch's defaults (``None`` filters and
    ``shutdown_timeout``); every field torch's LaunchConfig has is aelastic's too and launches with its default."""
    monkeypatch.delenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", raising=False)
    defaults = torch_launch_config_defaults()
    ours = {f.name for f in dataclasses.fields(LaunchConfig)}
    assert set(defaults) <= ours, f"torch's fields aelastic lacks: {sorted(set(defaults) - ours)}"
    assert defaults["duplicate_stdout_filters"] is None  # these crashed the launch
    assert defaults["shutdown_timeout"] is None
    # torch's required fields; and a rendezvous this machine has: torch's default backend, etcd, needs an etcd
    # server at an endpoint (torch's default endpoint is '' and fails under torch too).
    defaults |= {"rdzv_backend": "c10d", "rdzv_endpoint": "localhost:0"}
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=2, **defaults)  # type: ignore[arg-type]
    assert config.shutdown_grace == 30.0
    with anyio.fail_after(DEADLINE):
        values = await aelastic.launch(config, rank_and_double, 21)
    assert values == {0: (0, 42, 2), 1: (1, 42, 2)}


@pytest.mark.torch
def test_torchs_launch_config_fields_keep_torchs_meaning(monkeypatch: pytest.MonkeyPatch) -> None:
    defaults = torch_launch_config_defaults()
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "7")
    assert LaunchConfig(**defaults).shutdown_grace == 7.0  # type: ignore[arg-type]  # read when made, as torch
    assert LaunchConfig(shutdown_timeout=0).shutdown_grace == 0.0  # torch's rule: non-negative
    with pytest.raises(aelastic.ConfigurationError, match="shutdown_timeout=-1: must be >= 0"):
        LaunchConfig(shutdown_timeout=-1)
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "soon")
    with pytest.raises(aelastic.ConfigurationError, match="TORCH_ELASTIC_SHUTDOWN_TIMEOUT='soon'"):
        LaunchConfig()
    monkeypatch.delenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT")
    config = LaunchConfig(duplicate_stdout_filters=["loss"], duplicate_stderr_filters=None)
    assert config.duplicate_filters == (("loss",), ())
    params = LaunchConfig(rdzv_backend="c10d", rdzv_timeout=60, rdzv_configs={"timeout": 5}).rendezvous_parameters("r")
    assert params.config["timeout"] == 60  # torch: rdzv_timeout, when given, is rdzv_configs['timeout']
    assert "timeout" not in LaunchConfig(rdzv_backend="c10d").rendezvous_parameters("r").config


MAIN_PROGRAM = """
import asyncio, json, os, sys
import aelastic

def work(x):  # defined in __main__: no worker can import it, so it travels by value
    return {"rank": int(os.environ["RANK"]), "value": x * 2}

config = aelastic.LaunchConfig(nproc_per_node=2, max_restarts=0)

async def main():
    if sys.argv[1] == "launch":
        return await aelastic.launch(config, work, 21)
    await asyncio.sleep(0)
    return aelastic.run(config, work, 21)  # blocking, with this loop running (as in a notebook)

print(json.dumps(asyncio.run(main())))
"""


@pytest.mark.parametrize("mode", ["launch", "run-inside-loop"])
def test_dunder_main_function_from_a_plain_asyncio_program(mode: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(MAIN_PROGRAM), mode],
        capture_output=True, text=True, timeout=DEADLINE, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == {"0": {"rank": 0, "value": 42}, "1": {"rank": 1, "value": 42}}


def test_public_surface() -> None:
    """Every name of ``aelastic.__all__`` (pinned by tests/test_public_surface.py) resolves on first use."""
    for name in aelastic.__all__:
        assert getattr(aelastic, name) is not None, name
    assert callable(aelastic.launch)
    assert callable(aelastic.run)
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        _ = aelastic.nope  # type: ignore[attr-defined]


def test_importing_aelastic_does_not_import_the_launcher() -> None:
    """Workers import aelastic (record, the callable bootstrap): that must not drag in anyio and the agent."""
    code = (
        "import sys, aelastic; from aelastic import record; "
        "print(sorted(m for m in ('anyio', 'aelastic.launcher') if m in sys.modules))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert proc.stdout == "[]\n"


ENDS_ATTEMPT_ZERO = """
import os, signal, sys
for i in range(2000):
    print("out", i)
    print("err", i, file=sys.stderr)
sys.stdout.write("partial out")
sys.stderr.write("partial err")
if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
    if sys.argv[1] == "crash":
        sys.exit(3)
    os.kill(os.getpid(), getattr(signal, sys.argv[1]))
"""


@pytest.mark.parametrize("end", ["crash", "SIGKILL", "SIGTERM"])
async def test_log_files_are_complete_after_each_kind_of_stop_and_the_restart(tmp_path: Path, end: str) -> None:
    """Attempt 0 writes 2000 lines and an unterminated one to each stream and then ends by ``end``; attempt 1
    writes the same and succeeds. Unbuffered (``-u``, as torchrun runs scripts), every byte is in the pipe before
    the signal, and both attempts' files hold every byte."""
    script = tmp_path / "ends.py"
    script.write_text(ENDS_ATTEMPT_ZERO)
    logs = tmp_path / "logs"
    config = LaunchConfig(nproc_per_node=1, max_restarts=1, logs=LogOptions(logs, redirects=Std.ALL))
    with anyio.fail_after(DEADLINE):
        assert await aelastic.launch(config, sys.executable, "-u", str(script), end) == {0: None}
    (run_dir,) = logs.iterdir()
    for attempt in (0, 1):
        rank_dir = run_dir / f"attempt_{attempt}" / "0"
        stdout, stderr = (rank_dir / "stdout.log").read_text(), (rank_dir / "stderr.log").read_text()
        assert stdout == "".join(f"out {i}\n" for i in range(2000)) + "partial out"
        assert stderr == "".join(f"err {i}\n" for i in range(2000)) + "partial err"


LAUNCHER = """
import sys
import aelastic
import neighbour  # next to this script: found through the launcher's sys.path[0] only

if __name__ == "__main__":
    print(aelastic.run(aelastic.LaunchConfig(nproc_per_node=2), neighbour.shard_name, "part"))
"""

NEIGHBOUR = """
import os

def shard_name(prefix):
    return f"{prefix}-{os.environ['RANK']}"
"""


def test_function_of_a_module_next_to_the_launching_script_from_another_directory(tmp_path: Path) -> None:
    """torch's spawn gives workers the launcher's import path; so does aelastic's bootstrap."""
    project, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    project.mkdir()
    elsewhere.mkdir()
    (project / "launch.py").write_text(LAUNCHER)
    (project / "neighbour.py").write_text(NEIGHBOUR)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [sys.executable, str(project / "launch.py")],
        cwd=elsewhere,
        env=env,
        capture_output=True,
        text=True,
        timeout=DEADLINE,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == "{0: 'part-0', 1: 'part-1'}", proc.stdout
