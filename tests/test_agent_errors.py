"""Error files and the failure report: torch's text exactly (checked against torch's own ChildFailedError), error
files written by our ``record`` and by torch's, read both ways, and the stderr tail where torch shows a link."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from datetime import datetime
from pathlib import Path

import anyio
import pytest
import torch.distributed.elastic.multiprocessing.errors as torch_errors
from helpers.console import Sink

from aelastic.agent.errors import ChildFailedError, ProcessFailure, record
from aelastic.agent.logs import ConsoleSinks, LogSpec
from aelastic.agent.processes import WorkerExit, run_workers
from aelastic.agent.spawn.parent import WorkerCommand
from aelastic.errors import AelasticError

DEADLINE = 30.0
T0 = 1_700_000_000


def when(ts: int) -> str:
    return datetime.fromtimestamp(ts).isoformat(sep="_")


def write_torch_style(path: Path, message: str, callstack: str, ts: int) -> None:
    path.write_text(
        json.dumps({"message": {"message": message, "extraInfo": {"py_callstack": callstack, "timestamp": str(ts)}}})
    )


# --- the report -------------------------------------------------------------------------------------------------


def test_report_matches_torch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same failures, formatted by torch and by us: identical text."""
    callstack = 'Traceback (most recent call last):\n  File "train.py", line 3, in <module>\nValueError: bad lr\n'
    write_torch_style(tmp_path / "e1.json", "ValueError: bad lr", callstack, T0 + 5)
    (tmp_path / "e3.json").write_text(json.dumps({"message": "plain string message", "timestamp": T0 + 9}))
    monkeypatch.setattr("time.time", lambda: float(T0 + 7))  # torch stamps file-less failures "now"

    exits = {
        0: (WorkerExit(0, 0, 101, -15, float(T0 + 7)), None),
        1: (WorkerExit(1, 1, 102, 1, float(T0 + 6)), tmp_path / "e1.json"),
        3: (WorkerExit(1, 3, 103, 1, float(T0 + 9)), tmp_path / "e3.json"),
        4: (WorkerExit(0, 4, 104, -9, float(T0 + 7)), tmp_path / "missing.json"),
    }
    ours = ChildFailedError(
        "train.py",
        {rank: ProcessFailure.from_exit(e, path) for rank, (e, path) in exits.items()},
        hostname=socket.getfqdn(),
    )
    theirs = torch_errors.ChildFailedError(
        "train.py",
        {
            rank: torch_errors.ProcessFailure(e.local_rank, e.pid, e.exitcode, str(path) if path else "")
            for rank, (e, path) in exits.items()
        },
    )
    assert str(ours) == str(theirs)
    assert ours.get_first_failure()[0] == theirs.get_first_failure()[0] == 1
    assert isinstance(ours, AelasticError)


def test_report_text_with_stderr_tail() -> None:
    """torchrun's example (local rank 1 does sys.exit(3), rank 0 stopped), with the stderr tail instead of a link."""
    failures = {
        0: ProcessFailure.from_exit(WorkerExit(0, 0, 101, -15, T0 + 2.5, stderr_tail=("ignored",)), None),
        1: ProcessFailure.from_exit(
            WorkerExit(
                1,
                1,
                102,
                3,
                T0 + 1.5,
                stderr_tail=("Traceback (most recent call last):", '  File "fail.py", line 1', "SystemExit: 3"),
            ),
            None,
        ),
    }
    report = ChildFailedError("fail.py", failures, hostname="host.example")
    expected = f"""
=====================================================
fail.py FAILED
-----------------------------------------------------
Failures:
[0]:
  time      : {when(T0 + 2)}
  host      : host.example
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 101)  (SIGTERM)
  error_file: <N/A>
  traceback : Signal 15 (SIGTERM) received by PID 101
-----------------------------------------------------
Root Cause (first observed failure):
[1]:
  time      : {when(T0 + 1)}
  host      : host.example
  rank      : 1 (local_rank: 1)
  exitcode  : 3 (pid: 102){" "}
  error_file: <N/A>
  traceback : Traceback (most recent call last):
    File "fail.py", line 1
  SystemExit: 3
====================================================="""  # torch's template leaves a space after "(pid: 102)"
    assert str(report) == expected
    assert report.format_report() == expected


def test_report_single_failure_and_explicit_root() -> None:
    a = ProcessFailure.from_exit(WorkerExit(0, 0, 1, 2, float(T0)), None)
    b = ProcessFailure.from_exit(WorkerExit(1, 1, 2, -9, float(T0 - 100)), None)
    only = ChildFailedError("job", {0: a}, hostname="h")
    assert "  <NO_OTHER_FAILURES>" in str(only)
    assert a.traceback == "To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html"
    assert ChildFailedError("job", {0: a, 1: b}, hostname="h").get_first_failure()[0] == 1  # earliest timestamp
    assert ChildFailedError("job", {0: a, 1: b}, root_rank=0, hostname="h").get_first_failure()[0] == 0
    with pytest.raises(ValueError, match="at least one failure"):
        ChildFailedError("job", {})


def test_crash_signal_shows_the_stderr_tail_after_torchs_line() -> None:
    exit_ = WorkerExit(0, 0, 7, -11, float(T0), stderr_tail=("Fatal Python error: Segmentation fault", ""))
    failure = ProcessFailure.from_exit(exit_, None)
    assert failure.traceback == "Signal 11 (SIGSEGV) received by PID 7\n  Fatal Python error: Segmentation fault"


def test_unreadable_error_file_still_reports(tmp_path: Path) -> None:
    path = tmp_path / "error.json"
    path.write_text("{not json")
    failure = ProcessFailure.from_exit(WorkerExit(0, 0, 7, 1, float(T0), stderr_tail=("boom",)), path)
    assert failure.error_file == "<N/A>"
    assert failure.traceback.startswith("boom\n  (unreadable error file")


# --- error files from real workers ------------------------------------------------------------------------------

OUR_RECORD = """
    import sys
    from aelastic.agent.errors import record

    @record
    def main():
        if sys.argv[1] == "raise":
            raise ValueError("boom")
        sys.exit(int(sys.argv[1]))

    main()
"""


@pytest.mark.anyio
@pytest.mark.parametrize(("mode", "exitcode", "has_file"), [("raise", 1, True), ("0", 0, False), ("3", 3, False)])
async def test_our_record_writes_torchs_error_file(tmp_path: Path, mode: str, exitcode: int, has_file: bool) -> None:
    sink = Sink()
    spec = LogSpec(log_dir=tmp_path, console=ConsoleSinks(stdout=sink, stderr=sink))
    error_file = spec.error_file_path(0)
    assert error_file is not None
    env = {**os.environ, "TORCHELASTIC_ERROR_FILE": str(error_file)}
    cmd = WorkerCommand(0, 0, (sys.executable, "-c", textwrap.dedent(OUR_RECORD), mode), env)
    with anyio.fail_after(DEADLINE):
        outcome = await run_workers([cmd], spec, grace=5, reaper=None)
    (exit_,) = outcome.exits
    assert exit_.exitcode == exitcode
    assert error_file.exists() == has_file
    if not has_file:
        return
    failure = ProcessFailure.from_exit(exit_, error_file)
    assert failure.error_file == str(error_file)
    assert failure.message == "ValueError: boom"
    assert failure.traceback.startswith("Traceback (most recent call last):\n  ")
    assert "ValueError: boom" in failure.traceback
    # torch's agent reads our file the same way
    theirs = torch_errors.ProcessFailure(0, exit_.pid, exit_.exitcode, str(error_file))
    assert theirs.error_file_data["message"]["message"] == "ValueError: boom"
    assert int(theirs.timestamp) == int(failure.timestamp)


def test_torchs_record_is_read(tmp_path: Path) -> None:
    error_file = tmp_path / "error.json"
    code = textwrap.dedent(
        """
        from torch.distributed.elastic.multiprocessing.errors import record

        @record
        def main():
            raise KeyError("missing shard")

        main()
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "TORCHELASTIC_ERROR_FILE": str(error_file)},
        capture_output=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 1
    exit_ = WorkerExit(0, 2, 4242, proc.returncode, float(T0))
    failure = ProcessFailure.from_exit(exit_, error_file)
    assert failure.message == "KeyError: 'missing shard'"
    assert 'File "<string>", line 6, in main' in failure.traceback
    assert failure.error_file == str(error_file)
    report = str(ChildFailedError("job", {2: failure}, hostname="h"))
    assert "rank      : 2 (local_rank: 0)" in report
    assert "KeyError: 'missing shard'" in report


@pytest.mark.anyio
async def test_stderr_tail_replaces_the_link_when_no_error_file(tmp_path: Path) -> None:
    sink = Sink()
    spec = LogSpec(log_dir=tmp_path, console=ConsoleSinks(stdout=sink, stderr=sink))
    cmd = WorkerCommand(0, 0, (sys.executable, "-c", "print('working'); 1 / 0"), dict(os.environ))
    with anyio.fail_after(DEADLINE):
        outcome = await run_workers([cmd], spec, grace=5, reaper=None)
    (exit_,) = outcome.exits
    failure = ProcessFailure.from_exit(exit_, spec.error_file_path(0))
    report = str(ChildFailedError("-c", {0: failure}, hostname="h"))
    assert failure.error_file == "<N/A>"
    assert "traceback : Traceback (most recent call last):\n" in report
    assert "  ZeroDivisionError: division by zero\n" in report
    assert "To enable traceback" not in report


def test_record_propagates_a_nested_child_failure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    child_file = tmp_path / "child.json"
    write_torch_style(child_file, "RuntimeError: nested", "tb", T0)
    own_file = tmp_path / "own.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(own_file))
    failure = ProcessFailure.from_exit(WorkerExit(0, 0, 1, 7, float(T0)), child_file)

    @record
    def agent() -> None:
        raise ChildFailedError("inner", {0: failure}, hostname="h")

    with pytest.raises(ChildFailedError):
        agent()
    data = json.loads(own_file.read_text())
    assert data["message"]["message"] == "RuntimeError: nested"
    assert data["message"]["errorCode"] == 7


def test_record_without_error_file_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)

    @record
    def fails() -> int:
        raise OSError("disk")

    @record
    def clean_exit() -> int:
        raise SystemExit(0)

    with pytest.raises(OSError, match="disk"):
        fails()
    assert clean_exit() is None
