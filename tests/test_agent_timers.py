"""Expiration timers, the progress watchdog and stack dumps before kills, through ``aelastic run`` (real workers,
torch's unmodified FileTimerClient, real signals, py-spy, and faulthandler where py-spy is hidden)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import pytest

from aelastic.agent.stacks.fallback import fault_top_frames
from aelastic.agent.stacks.parent import find_py_spy, top_frames
from aelastic.agent.timers.parent import TimerRequest, TimerTable, parse_request

needs_py_spy = pytest.mark.skipif(
    find_py_spy() is None, reason="py-spy is not installed (pip install 'aelastic[stacks]')"
)

TIMER_SCRIPT = """\
import os, signal, time
from pathlib import Path
import torch.distributed.elastic.timer as timer

timer.configure(timer.FileTimerClient(os.environ["TORCHELASTIC_TIMER_FILE"]))
rank, attempt = int(os.environ["RANK"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
out = Path(os.environ["OUT"])

def hang_here():
    time.sleep(3600)  # the hanging line
while attempt == 0 and rank == 1 and not (out / "peer.pid").exists(): time.sleep(0.01)  # rank 0 is about to sleep
if attempt == 0 and rank == 0:
    (out / "peer.pid").write_text(str(os.getpid()))
    time.sleep(3600)  # no timer: only the agent's stop after rank 1's kill ends it
(out / f"start_{rank}_{attempt}").write_text(repr(time.time()))
with timer.expires(after=1, scope="train_step"):
    if attempt == 0:
        hang_here()
"""

IGNORES_TERM = """\
import os, signal, sys, time
from pathlib import Path
out = Path(os.environ["OUT"])

def ignore_term_and_sleep():
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    (out / "ready").write_text("")
    time.sleep(3600)

if os.environ["RANK"] == "0":
    ignore_term_and_sleep()
while not (out / "ready").exists():  # crash only once rank 0 ignores SIGTERM
    time.sleep(0.05)
sys.exit(3)
"""

WATCHDOG = """\
import os, signal
from aelastic import worker
worker.heartbeat()
if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0" and os.environ["RANK"] == "1":
    os.kill(os.getpid(), signal.SIGSTOP)  # no more heartbeats, and nothing the worker itself could do
worker.heartbeat()
"""


@pytest.fixture(params=["asyncio", "trio"])
def backend(request: pytest.FixtureRequest) -> str:
    """The agent's event loop (``AELASTIC_ASYNC_BACKEND``): the FIFO and the dumps are awaited on both."""
    return str(request.param)


# The agent as ``aelastic`` runs it, but blind to py-spy even where it is installed: the faulthandler fallback.
WITHOUT_PY_SPY = (
    "import sys; import aelastic.agent.stacks.parent as stacks; stacks.find_py_spy = lambda: None; "
    "from aelastic.cli import main; sys.exit(main())"
)


def _run(
    tmp_path: Path, script: str, *flags: str, env: dict[str, str], py_spy: bool = True
) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "worker.py"
    path.write_text(script)
    agent = ("-m", "aelastic") if py_spy else ("-c", WITHOUT_PY_SPY)
    return subprocess.run(
        [sys.executable, *agent, "run", "--nproc-per-node", "2", "--log-dir", str(tmp_path / "logs"),
         *flags, str(path)],
        env={**os.environ, "OUT": str(tmp_path), **env},
        capture_output=True, text=True, timeout=240, stdin=subprocess.DEVNULL,
    )  # fmt: skip


def _log_time(stderr: str, marker: str) -> float:
    match = re.search(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})\][^\n]*" + re.escape(marker), stderr, re.M)
    assert match, f"no log line with {marker!r}:\n{stderr}"
    return datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()


def _stacks(tmp_path: Path, attempt: int, local_rank: int) -> str:
    (path,) = (tmp_path / "logs").glob(f"*/attempt_{attempt}/{local_rank}/stacks.txt")
    return path.read_text()


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"  # a zombie of someone else's is dead too


@needs_py_spy
def test_file_timer_client_kills_only_the_hung_worker_and_the_group_restarts(tmp_path: Path, backend: str) -> None:
    fifo = tmp_path / "timer.fifo"
    env = {
        "TORCHELASTIC_ENABLE_FILE_TIMER": "1",
        "TORCHELASTIC_TIMER_FILE": str(fifo),
        "AELASTIC_ASYNC_BACKEND": backend,
    }
    result = _run(tmp_path, TIMER_SCRIPT, "--max-restarts", "1", "--shutdown-timeout", "5", env=env)
    assert result.returncode == 0, result.stderr
    # Killed within after + 1 s of entering the block (the failure is logged once its exit was seen).
    started = float((tmp_path / "start_1_0").read_text())
    assert _log_time(result.stderr, "restart 1 of 1") - started < 2.0, result.stderr
    report = result.stderr[result.stderr.index("restart 1 of 1") :]
    assert "expiration timer 'train_step' expired: killed with SIGKILL" in report
    assert re.search(r"hang_here \(worker\.py:10\)", report), report  # line 10: time.sleep(3600) in hang_here
    assert "hang_here (worker.py:10)" in _stacks(tmp_path, 0, 1)
    assert (tmp_path / "start_0_1").exists()  # attempt 1 ran, both ranks
    assert (tmp_path / "start_1_1").exists()
    assert _gone(int((tmp_path / "peer.pid").read_text()))  # the other worker was stopped, not orphaned
    assert not fifo.exists()


@needs_py_spy
def test_worker_ignoring_sigterm_has_its_stack_dumped_before_sigkill(tmp_path: Path, backend: str) -> None:
    result = _run(
        tmp_path,
        IGNORES_TERM,
        "--max-restarts",
        "0",
        "--shutdown-timeout",
        "1",
        env={"AELASTIC_ASYNC_BACKEND": backend},
    )
    assert result.returncode == 1, result.stderr
    stacks = _stacks(tmp_path, 0, 0)
    assert "still running 1 s after the stop; SIGKILL next" in stacks
    assert "ignore_term_and_sleep (worker.py:8)" in stacks
    assert "did not exit within 1 s of the stop: SIGKILLed" in result.stderr
    assert "ignore_term_and_sleep (worker.py:8)" in result.stderr  # the report's top frames


@needs_py_spy
def test_watchdog_kills_a_stopped_worker_and_the_group_restarts(tmp_path: Path, backend: str) -> None:
    result = _run(
        tmp_path, WATCHDOG, "--max-restarts", "1", "--watchdog-timeout", "1", env={"AELASTIC_ASYNC_BACKEND": backend}
    )
    assert result.returncode == 0, result.stderr
    assert "expiration timer 'aelastic.heartbeat' expired: killed with SIGKILL" in result.stderr
    assert "restart 1 of 1" in result.stderr
    stacks = _stacks(tmp_path, 0, 1)  # the stopped worker's stack, read without resuming it
    assert stacks.startswith("=== ")
    assert "rank 1: expiration timer 'aelastic.heartbeat' expired" in stacks
    assert "<module> (worker.py:5)" in stacks


def test_without_py_spy_faulthandler_dumps_the_hung_worker_before_the_timer_kills_it(
    tmp_path: Path, backend: str
) -> None:
    env = {"TORCHELASTIC_ENABLE_FILE_TIMER": "1", "AELASTIC_ASYNC_BACKEND": backend}
    result = _run(tmp_path, TIMER_SCRIPT, "--max-restarts", "1", "--shutdown-timeout", "5", env=env, py_spy=False)
    assert result.returncode == 0, result.stderr
    assert "py-spy is not installed (pip install 'aelastic[stacks]'): worker stacks come from faulthandler" in (
        result.stderr
    )
    report = result.stderr[result.stderr.index("restart 1 of 1") :]
    assert "expiration timer 'train_step' expired: killed with SIGKILL" in report
    assert "top frames (innermost first, faulthandler):" in report
    assert re.search(r"hang_here \(worker\.py:10\)\n\s+<module> \(worker\.py:18\)", report), report
    hung = _stacks(tmp_path, 0, 1)
    assert re.search(r'Current thread 0x[0-9a-f]+ \(most recent call first\):\n  File ".*worker.py", line 10 in '
                     r"hang_here", hung), hung  # fmt: skip
    peer = _stacks(tmp_path, 0, 0)  # every local worker is dumped for a hang; the peer kept running until the stop
    assert 'worker.py", line 14 in <module>' in peer
    assert (tmp_path / "start_0_1").exists()
    assert (tmp_path / "start_1_1").exists()


def test_without_py_spy_faulthandler_dumps_a_worker_ignoring_sigterm(tmp_path: Path, backend: str) -> None:
    flags = ("--max-restarts", "0", "--shutdown-timeout", "1")
    result = _run(tmp_path, IGNORES_TERM, *flags, env={"AELASTIC_ASYNC_BACKEND": backend}, py_spy=False)
    assert result.returncode == 1, result.stderr
    stacks = _stacks(tmp_path, 0, 0)
    assert "still running 1 s after the stop; SIGKILL next" in stacks
    assert 'worker.py", line 8 in ignore_term_and_sleep' in stacks
    assert "ignore_term_and_sleep (worker.py:8)" in result.stderr  # the report's top frames


def test_without_py_spy_a_worker_that_replaced_the_handler_is_killed_after_the_deadline(tmp_path: Path) -> None:
    # Rank 0 ignores SIGTERM and the dump's signal: nothing answers, the 2 s deadline passes, SIGKILL ends it.
    script = IGNORES_TERM.replace(
        "    signal.signal(signal.SIGTERM, signal.SIG_IGN)\n",
        "    signal.signal(signal.SIGTERM, signal.SIG_IGN)\n    signal.signal(signal.SIGRTMIN + 5, signal.SIG_IGN)\n",
    )
    result = _run(tmp_path, script, "--max-restarts", "0", "--shutdown-timeout", "1", env={}, py_spy=False)
    assert result.returncode == 1, result.stderr
    assert "no stack dump: the worker did not answer (its handler was replaced" in _stacks(tmp_path, 0, 0)
    assert re.search(r"rank\s+: 0 .*\n\s+exitcode\s+: -9", result.stderr), result.stderr  # SIGKILL, not the signal


def test_without_py_spy_a_stopped_worker_does_not_delay_its_kill(tmp_path: Path, backend: str) -> None:
    flags = ("--max-restarts", "1", "--watchdog-timeout", "1")
    result = _run(tmp_path, WATCHDOG, *flags, env={"AELASTIC_ASYNC_BACKEND": backend}, py_spy=False)
    assert result.returncode == 0, result.stderr
    # A SIGSTOPped worker cannot run its handler: it is not signalled, and the kill and the restart follow.
    stopped = "no stack dump: the worker is stopped (SIGSTOP, a debugger) and cannot run its handler"
    assert stopped in _stacks(tmp_path, 0, 1)
    assert stopped in result.stderr  # the report's note
    assert _log_time(result.stderr, "restart 1 of 1") - _log_time(result.stderr, "expired: killed with") < 4.0


def test_without_py_spy_a_non_python_worker_is_not_signalled(tmp_path: Path) -> None:
    # Rank 1 is a sleep(1) that ignores SIGTERM: it never armed faulthandler, so the dump's signal (whose default
    # action would kill it) is not sent, and the SIGKILL after the grace is what ends it.
    script = (
        'if [ "$RANK" = 1 ]; then trap "" TERM; touch "$OUT/ready"; exec sleep 3600; fi; '
        'while [ ! -e "$OUT/ready" ]; do sleep 0.05; done; exit 3'
    )
    result = subprocess.run(
        [sys.executable, "-c", WITHOUT_PY_SPY, "run", "--nproc-per-node", "2", "--log-dir", str(tmp_path / "logs"),
         "--max-restarts", "0", "--shutdown-timeout", "1", "--no-python", "bash", "-c", script],
        env={**os.environ, "OUT": str(tmp_path)}, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert result.returncode == 1, result.stderr
    assert "did not arm faulthandler" in _stacks(tmp_path, 0, 1)
    assert "Signal 9 (SIGKILL) received by PID" in result.stderr, result.stderr


def test_fault_top_frames_takes_the_thread_that_handled_the_signal() -> None:
    dump = (
        'Thread 0x00007f0000000002 (most recent call first):\n  File "/a/t.py", line 9 in loop\n\n'
        'Current thread 0x00007f0000000001 (most recent call first):\n  File "/a/x.py", line 3 in f\n'
        '  File "/a/x.py", line 5 in <module>\n'
    )
    assert fault_top_frames(dump, 5) == ["f (x.py:3)", "<module> (x.py:5)"]
    assert fault_top_frames(dump, 1) == ["f (x.py:3)"]
    assert fault_top_frames("no stack dump: the worker had already exited", 5) == []


def test_timer_table_follows_torch_rules() -> None:
    table = TimerTable()
    line = b'{"version": 1, "pid": 7, "scope_id": "a", "expiration_time": 10.0, "signal": 9}'
    table.apply(parse_request(line))
    table.apply(TimerRequest(7, "b", 5.0, 0))  # earlier, but no signal: never kills, is cleared
    table.apply(TimerRequest(8, "a", 20.0, 15))
    table.apply(TimerRequest(8, "a", 30.0, 15))  # acquire overwrites
    assert table.next_expiration() == 5.0
    assert table.pop_expired(9.0) == []  # "b" expired without a signal: cleared, no kill
    assert table.next_expiration() == 10.0
    (kill,) = table.pop_expired(25.0)
    assert (kill.pid, kill.scope_id, kill.signal) == (7, "a", 9)
    table.apply(TimerRequest(8, "a", -1, 0))  # release
    assert len(table) == 0
    assert table.pop_expired(1e12) == []
    with pytest.raises(ValueError, match="not a version 1"):
        parse_request(b'{"version": 2, "pid": 1, "scope_id": "x", "expiration_time": 1, "signal": 9}')


def test_top_frames_takes_the_first_thread() -> None:
    dump = 'Process 1: python x.py\n\nThread 1 (idle): "MainThread"\n    f (x.py:3)\n    <module> (x.py:5)\n' \
           'Thread 2 (idle)\n    g (x.py:9)\n'  # fmt: skip
    assert top_frames(dump) == ["f (x.py:3)", "<module> (x.py:5)"]
