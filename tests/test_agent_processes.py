"""Worker supervision with real processes and real signals: stop on first failure, TERM → grace → KILL, cancellation,
process groups, and no orphans when the agent itself is SIGKILLed (parent-death signal + reaper sidecar).

Synchronisation is on events: workers announce themselves on stdout (read through an in-memory console sink), a
failing worker waits on a TCP "gate" the test opens, and deaths of processes that are not the test's children are
awaited through pidfds.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from pathlib import Path
from typing import cast

import anyio
import anyio.abc
import pytest
from helpers.console import Sink
from helpers.procs import alive, wait_gone

from aelastic.agent.attempt import Interrupt, StopSignal
from aelastic.agent.callables.parent import bootstrap_args, read_result, write_payload
from aelastic.agent.errors import ProcessFailure
from aelastic.agent.logs import ConsoleSinks, LogSpec
from aelastic.agent.processes import GroupOutcome, open_supervisor, run_workers
from aelastic.agent.procfs import dies_of, exiting, process_state
from aelastic.agent.reaper.parent import open_reaper
from aelastic.agent.restart.parent import RestartChannel
from aelastic.agent.spawn.parent import WorkerCommand
from aelastic.worker._link import AgentLink
from aelastic.worker._restart import RestartRequested, _Session

pytestmark = pytest.mark.anyio

DEADLINE = 30.0  # generous: the machine is small and shared


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1"}


def py(code: str) -> tuple[str, ...]:
    return (sys.executable, "-c", textwrap.dedent(code))


def command(local_rank: int, code: str) -> WorkerCommand:
    return WorkerCommand(local_rank=local_rank, global_rank=local_rank + 10, args=py(code), env=env())


def spec(sink: Sink) -> LogSpec:
    return LogSpec(console=ConsoleSinks(stdout=sink, stderr=sink))


def exitcodes(outcome: GroupOutcome) -> dict[int, int]:
    return {e.local_rank: e.exitcode for e in outcome.exits}


class Gate:
    """A TCP gate: worker code from :meth:`code` blocks until :meth:`open` is called, then exits with ``code``."""

    def __init__(self, listener: anyio.abc.SocketListener) -> None:
        self.listener = listener
        self.port = listener.extra(anyio.abc.SocketAttribute.local_port)

    def code(self, exitcode: int) -> str:
        return (
            f"import socket, sys; s = socket.create_connection(('127.0.0.1', {self.port})); s.recv(1); "
            f"sys.exit({exitcode})"
        )

    async def open(self) -> None:
        conn = await self.listener.accept()
        async with conn:
            await conn.send(b"x")


@asynccontextmanager
async def open_gate() -> AsyncIterator[Gate]:
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    async with listener:
        yield Gate(cast(anyio.abc.SocketListener, listener.listeners[0]))


async def fail_once_ready(sink: Sink, code: str, *, grace: float) -> GroupOutcome:
    """Run local rank 0 (``code``, which prints ``ready``) and local rank 1, which exits 3 once rank 0 is ready."""
    async with open_gate() as gate, anyio.create_task_group() as tg:

        async def release() -> None:
            await sink.wait_for(r"^\[default0\]:ready$")
            await gate.open()

        tg.start_soon(release)
        with anyio.fail_after(DEADLINE):
            outcome = await run_workers([command(0, code), command(1, gate.code(3))], spec(sink), grace=grace,
                                        reaper=None)  # fmt: skip
    return outcome


# --- the group --------------------------------------------------------------------------------------------------


async def test_success_all_exit_zero() -> None:
    sink = Sink()
    with anyio.fail_after(DEADLINE):
        outcome = await run_workers(
            [command(0, "print('hello from 0')"), command(1, "print('hello from 1')")],
            spec(sink),
            grace=5,
            reaper=None,
        )
    assert outcome.succeeded
    assert outcome.first_failure is None
    assert exitcodes(outcome) == {0: 0, 1: 0}
    assert [e.global_rank for e in outcome.exits] == [10, 11]
    assert "[default0]:hello from 0\n" in sink.text
    assert "[default1]:hello from 1\n" in sink.text
    assert all(not alive(e.pid) for e in outcome.exits)


async def test_no_workers() -> None:
    outcome = await run_workers([], LogSpec(), grace=1, reaper=None)
    assert outcome.succeeded
    assert outcome.exits == ()


async def test_first_failure_stops_the_rest_with_sigterm() -> None:
    sink = Sink()
    with anyio.fail_after(DEADLINE):
        outcome = await run_workers(
            [command(0, "import time; time.sleep(120)"), command(1, "import sys; sys.exit(3)")],
            spec(sink),
            grace=DEADLINE,
            reaper=None,
        )
    assert not outcome.succeeded
    assert outcome.first_failure is not None
    assert outcome.first_failure.local_rank == 1
    assert outcome.first_failure.exitcode == 3
    assert exitcodes(outcome) == {0: -signal.SIGTERM, 1: 3}
    assert [e.local_rank for e in outcome.failures] == [0, 1]


async def test_worker_ignoring_sigterm_is_killed_after_grace() -> None:
    sink = Sink()
    grace = 0.5
    stubborn = """
        import signal, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print("ready", flush=True)
        time.sleep(120)
    """
    started = anyio.current_time()
    outcome = await fail_once_ready(sink, stubborn, grace=grace)
    elapsed = anyio.current_time() - started
    assert exitcodes(outcome) == {0: -signal.SIGKILL, 1: 3}
    assert outcome.first_failure is not None
    assert outcome.first_failure.local_rank == 1
    assert elapsed >= grace


async def test_a_worker_that_reports_its_exit_while_it_is_stopped_is_reaped_once() -> None:
    """A peer's failure stops the worker, which reports its own exit over its link meanwhile (an uncaught exception
    in a worker that installed the exit report, as a rank whose collective failed does) and lingers in its teardown:
    the stop, not the report's linger path, kills, reaps and closes it (the supervisor closed it twice before: a
    ``ValueError`` that ended a ten-fault job)."""
    sink = Sink()
    reporting = """
        import atexit, signal, time
        from aelastic.worker._link import install_exit_report
        install_exit_report()
        def stopped(*_):
            raise RuntimeError("stopped")
        signal.signal(signal.SIGTERM, stopped)
        atexit.register(time.sleep, 1.0)  # a teardown that lasts past the report
        print("ready", flush=True)
        time.sleep(120)
    """
    outcome = await fail_once_ready(sink, reporting, grace=DEADLINE)
    assert outcome.first_failure is not None
    assert outcome.first_failure.local_rank == 1
    assert exitcodes(outcome) == {0: 1, 1: 3}  # rank 0's is its report's
    assert "RuntimeError: stopped" in sink.text
    assert all(not alive(e.pid) for e in outcome.exits)


async def test_stopped_worker_is_killed_after_grace() -> None:
    sink = Sink()
    sleeper = "import os, time; print('pid', os.getpid(), flush=True); time.sleep(120)"
    async with open_gate() as gate, anyio.create_task_group() as tg:

        async def stop_then_release() -> None:
            (match,) = await sink.wait_for(r"^\[default0\]:pid (\d+)$")
            pid = int(match.group(1))
            os.kill(pid, signal.SIGSTOP)
            # Stopped once the kernel delivered it: until then a SIGTERM sent meanwhile comes first (the lower number)
            # and ends the worker. No event says so: a bounded poll.
            with anyio.fail_after(DEADLINE):
                while True:
                    if process_state(pid) == "T":
                        break
                    await anyio.sleep(0.01)
            await gate.open()

        tg.start_soon(stop_then_release)
        with anyio.fail_after(DEADLINE):
            outcome = await run_workers(
                [command(0, sleeper), command(1, gate.code(4))], spec(sink), grace=0.3, reaper=None
            )
    assert exitcodes(outcome) == {0: -signal.SIGKILL, 1: 4}


async def test_a_worker_ended_before_a_membership_change_is_heard_ends_the_attempt_as_its_failure() -> None:
    """Both news in one wakeup: a peer's rendezvous says a member left (the news of this very death: its peers'
    collectives failed), and the kernel has ended the worker, not yet reaped. The death is the attempt's end."""
    sink = Sink()
    interrupt = Interrupt()
    sleeper = "import os, time; print('pid', os.getpid(), flush=True); time.sleep(120)"
    async with anyio.create_task_group() as tg:

        async def kill_then_interrupt() -> None:
            (match,) = await sink.wait_for(r"^\[default1\]:pid (\d+)$")
            pid = int(match.group(1))
            os.kill(pid, signal.SIGKILL)
            # Blocks (a moment) until it has ended: on purpose, so that no task of the supervisor runs meanwhile.
            os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)  # noqa: ASYNC222
            interrupt.set(peers_lost=True)

        tg.start_soon(kill_then_interrupt)
        with anyio.fail_after(DEADLINE):
            async with open_supervisor(grace=DEADLINE, reaper=None) as supervisor:
                outcome = await supervisor.run([command(0, sleeper), command(1, sleeper)], spec(sink),
                                               interrupt=interrupt)  # fmt: skip
    assert outcome.first_failure is not None, outcome
    assert (outcome.first_failure.local_rank, outcome.first_failure.exitcode) == (1, -signal.SIGKILL)
    assert exitcodes(outcome) == {0: -signal.SIGTERM, 1: -signal.SIGKILL}


REPORTS_ITS_STOP = """
    import signal, sys, time
    def stopped(signum, frame):
        print("stopped by", signal.Signals(signum).name, flush=True)
        sys.exit(0)
    signal.signal(signal.SIGINT, stopped)
    signal.signal(signal.SIGTERM, stopped)
    print("ready", flush=True)
    time.sleep(120)
"""


@pytest.mark.parametrize("stop", [None, StopSignal(), StopSignal(signal.SIGINT)], ids=["default", "term", "int"])
async def test_a_cancelled_run_stops_the_workers_with_the_stop_signal_it_was_given(stop: StopSignal | None) -> None:
    """The holder is read when the stop comes (the CLI sets it when the signal arrives, after the start)."""
    sink = Sink()
    holder = None if stop is None else StopSignal()
    with anyio.fail_after(DEADLINE):
        async with anyio.create_task_group() as tg:

            async def cancel_when_ready() -> None:
                await sink.wait_for(r"^\[default\d\]:ready$", count=2)
                if holder is not None and stop is not None:
                    holder.signum = stop.signum
                tg.cancel_scope.cancel()

            tg.start_soon(cancel_when_ready)
            commands = [command(0, REPORTS_ITS_STOP), command(1, REPORTS_ITS_STOP)]
            await run_workers(commands, spec(sink), grace=5, reaper=None, stop_signal=holder)
            pytest.fail("run_workers returned although cancelled")
    expected = "SIGTERM" if stop is None else stop.signum.name
    assert sorted(re.findall(r"stopped by (\w+)", sink.text)) == [expected, expected], sink.text


PARENT_OF_SLEEPER = """
    import os, subprocess, sys
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    print("pids", os.getpid(), child.pid, flush=True)
    {rest}
"""


async def test_cancellation_stops_workers_and_their_children() -> None:
    sink = Sink()
    code = PARENT_OF_SLEEPER.format(rest="import time; time.sleep(120)")
    pids: list[int] = []
    fds: list[int] = []
    with anyio.fail_after(DEADLINE):
        async with anyio.create_task_group() as tg:

            async def cancel_when_ready() -> None:
                matches = await sink.wait_for(r"^\[default\d\]:pids (\d+) (\d+)$", count=2)
                for m in matches:
                    pids.extend((int(m.group(1)), int(m.group(2))))
                fds.extend(os.pidfd_open(pid) for pid in pids)  # pinned before the stop: no pid reuse
                tg.cancel_scope.cancel()

            tg.start_soon(cancel_when_ready)
            async with open_reaper() as reaper:
                await run_workers([command(0, code), command(1, code)], spec(sink), grace=5, reaper=reaper)
                pytest.fail("run_workers returned although cancelled")
        assert tg.cancel_scope.cancelled_caught
        try:
            for fd in fds:
                await anyio.wait_readable(fd)  # each worker and grandchild has exited
        finally:
            for fd in fds:
                os.close(fd)
    assert len(pids) == 4
    assert not any(alive(pid) for pid in pids)


async def test_grandchild_of_a_successful_worker_does_not_survive() -> None:
    sink = Sink()
    async with open_gate() as gate, anyio.create_task_group() as tg:
        child_fd: list[int] = []

        async def pin_then_release() -> None:
            (match,) = await sink.wait_for(r"^\[default0\]:pids (\d+) (\d+)$")
            child_fd.append(os.pidfd_open(int(match.group(2))))
            await gate.open()

        tg.start_soon(pin_then_release)
        with anyio.fail_after(DEADLINE):
            # the worker exits 0 while its child (same process group, holding the same stdout pipe) sleeps on
            outcome = await run_workers(
                [command(0, PARENT_OF_SLEEPER.format(rest=gate.code(0)))],
                spec(sink),
                grace=5,
                reaper=None,
            )
            try:
                await anyio.wait_readable(child_fd[0])
            finally:
                os.close(child_fd[0])
    assert outcome.succeeded


REPORT_PDEATHSIG = """
    import ctypes, os, signal
    sig = ctypes.c_int(-1)
    ctypes.CDLL(None).prctl(2, ctypes.byref(sig), 0, 0, 0)  # PR_GET_PDEATHSIG
    print("pid", os.getpid(), "ppid", os.getppid(), "pdeathsig", sig.value)
"""


@pytest.mark.parametrize("use_shim", [False, True], ids=["setpriv", "shim"])
async def test_workers_get_a_parent_death_signal(monkeypatch: pytest.MonkeyPatch, use_shim: bool) -> None:
    if use_shim:
        monkeypatch.setattr(shutil, "which", lambda name: None)  # what processes looks up
    elif shutil.which("setpriv") is None:
        pytest.skip("util-linux setpriv is not installed")
    sink = Sink()
    with anyio.fail_after(DEADLINE):
        outcome = await run_workers([command(0, REPORT_PDEATHSIG)], spec(sink), grace=5, reaper=None)
    assert outcome.succeeded
    # The wrapper exec'd the worker: same pid, the agent is its parent, SIGKILL armed for the parent's death.
    (worker,) = outcome.exits
    assert f"[default0]:pid {worker.pid} ppid {os.getpid()} pdeathsig {int(signal.SIGKILL)}\n" in sink.text


async def test_unexecutable_command_is_a_worker_exiting_127() -> None:
    sink = Sink()
    missing = WorkerCommand(local_rank=0, global_rank=0, args=("/nonexistent/aelastic-worker",), env=env())
    with anyio.fail_after(DEADLINE):
        outcome = await run_workers([missing], spec(sink), grace=5, reaper=None)
    assert exitcodes(outcome) == {0: 127}
    assert "/nonexistent/aelastic-worker" in sink.text


async def test_reaper_kills_registered_groups_when_closed() -> None:
    # A clean close after registering a live group: the reaper treats end of file alike, whatever the cause.
    with anyio.fail_after(DEADLINE):
        proc = await anyio.open_process(
            [sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True, stdout=None, stderr=None
        )
        async with proc:
            async with open_reaper() as reaper:
                await reaper.register(proc.pid)
                assert reaper.statistics().registered == {proc.pid}
                reaper_pid = reaper.pid
            assert await proc.wait() == -signal.SIGKILL
            await wait_gone([reaper_pid])


# --- the agent is SIGKILLed -------------------------------------------------------------------------------------

AGENT = """
import os, shutil, sys
import anyio
from aelastic.agent.callables.parent import bootstrap_args, read_result, write_payload
from aelastic.agent.errors import ProcessFailure
from aelastic.agent.logs import LogSpec
from aelastic.agent.processes import run_workers
from aelastic.agent.reaper.parent import open_reaper
from aelastic.agent.spawn.parent import WorkerCommand

backend, use_reaper, use_shim = sys.argv[1], sys.argv[2] == "1", sys.argv[3] == "1"
if use_shim:
    shutil.which = lambda name: None
worker = '''
import os, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"]) if {grandchild} else None
print("pids", os.getpid(), child.pid if child else os.getpid(), flush=True)
time.sleep(120)
'''.format(grandchild=use_reaper)
worker_env = dict(os.environ, PYTHONUNBUFFERED="1")
commands = [WorkerCommand(i, i, (sys.executable, "-c", worker), worker_env) for i in range(2)]

async def main():
    if use_reaper:
        async with open_reaper() as reaper:
            print("reaper", reaper.pid, flush=True)
            await run_workers(commands, LogSpec(), grace=5, reaper=reaper)
    else:
        await run_workers(commands, LogSpec(), grace=5, reaper=None)

anyio.run(main, backend=backend)
"""


@pytest.mark.parametrize(("use_reaper", "use_shim"), [(True, False), (True, True), (False, False), (False, True)])
async def test_sigkilled_agent_leaves_no_worker_or_grandchild(
    anyio_backend: str, use_reaper: bool, use_shim: bool
) -> None:
    """With the reaper, workers and their children die; without it, the parent-death signal alone kills workers."""
    pids: list[int] = []
    fds: list[int] = []
    agent = await anyio.open_process(
        [sys.executable, "-c", AGENT, anyio_backend, str(int(use_reaper)), str(int(use_shim))],
        stdout=subprocess.PIPE,
        stderr=None,
    )
    try:
        assert agent.stdout is not None
        pattern = re.compile(r"^(?:\[default\d\]:pids|reaper) (\d+)(?: (\d+))?$", re.MULTILINE)
        expected_lines = 3 if use_reaper else 2
        buffer = ""
        with anyio.fail_after(DEADLINE):
            while len(pattern.findall(buffer)) < expected_lines:
                buffer += (await agent.stdout.receive()).decode()
        for m in pattern.finditer(buffer):
            pids.extend(int(g) for g in m.groups() if g is not None)
        fds.extend(os.pidfd_open(pid) for pid in set(pids))
        agent.send_signal(signal.SIGKILL)
        with anyio.fail_after(1.0):
            for fd in fds:
                await anyio.wait_readable(fd)
    finally:
        for fd in fds:  # a failed test must not leave sleepers behind; a pidfd cannot hit a reused pid
            with suppress(ProcessLookupError):
                signal.pidfd_send_signal(fd, signal.SIGKILL)
            os.close(fd)
        if agent.returncode is None:
            agent.kill()
        with anyio.CancelScope(shield=True):
            await agent.aclose()
    assert len(set(pids)) == (5 if use_reaper else 2)
    assert not any(alive(pid) for pid in pids)


# --- callable workers -------------------------------------------------------------------------------------------


def scaled_sum(a: int, b: int, *, scale: int) -> dict[str, object]:
    return {"sum": (a + b) * scale, "pid": os.getpid(), "rank": os.environ.get("RANK")}


async def test_callable_worker_round_trip(tmp_path: Path) -> None:
    sink = Sink()
    commands = []
    for rank in range(2):
        payload, result = tmp_path / f"payload{rank}", tmp_path / f"result{rank}"
        write_payload(payload, scaled_sum, (rank, 2), {"scale": 10})
        # by reference: the worker imports this test module, so give it the tests directory
        worker_env = {**env(), "RANK": str(rank), "PYTHONPATH": str(Path(__file__).parent)}
        commands.append(WorkerCommand(rank, rank, bootstrap_args(payload, result), worker_env))
    with anyio.fail_after(DEADLINE):
        outcome = await run_workers(commands, spec(sink), grace=5, reaper=None)
    assert outcome.succeeded, sink.text
    for rank, exit_ in enumerate(outcome.exits):
        assert read_result(tmp_path / f"result{rank}") == {"sum": (rank + 2) * 10, "pid": exit_.pid, "rank": str(rank)}


def return_after_gate(port: int | None) -> int:
    """Rank 0 (no port) returns at once; rank 1 returns once the test opens its gate."""
    if port is None:
        print("returning", os.getpid(), flush=True)
    else:
        import socket

        with socket.create_connection(("127.0.0.1", port)) as conn:
            conn.recv(1)
    return os.getpid()


async def test_callable_workers_finish_together(tmp_path: Path) -> None:
    """As torch's multiprocessing: no worker exits before every local worker's function has returned."""
    sink = Sink()
    outcomes: list[GroupOutcome] = []
    async with open_gate() as gate, anyio.create_task_group() as tg:
        commands = []
        for rank in range(2):
            write_payload(tmp_path / f"payload{rank}", return_after_gate, (gate.port if rank else None,))
            args = bootstrap_args(tmp_path / f"payload{rank}", tmp_path / f"result{rank}")
            commands.append(WorkerCommand(rank, rank, args, {**env(), "LOCAL_RANK": str(rank)}))

        async def run() -> None:
            outcomes.append(await run_workers(commands, spec(sink), grace=5, reaper=None, finish_together=True))

        tg.start_soon(run)
        with anyio.fail_after(DEADLINE):
            (returned,) = await sink.wait_for(r"^\[default0\]:returning (\d+)$")
        pidfd = os.pidfd_open(int(returned.group(1)))
        try:
            with anyio.move_on_after(1.0) as waited:  # an early exit would come at once
                await anyio.wait_readable(pidfd)
        finally:
            os.close(pidfd)
        assert waited.cancelled_caught, "rank 0 exited while rank 1's function had not returned"
        await gate.open()
    (outcome,) = outcomes
    assert exitcodes(outcome) == {0: 0, 1: 0}, sink.text
    assert [read_result(tmp_path / f"result{rank}") for rank in range(2)] == [e.pid for e in outcome.exits]


async def test_failing_callable_writes_an_error_file_and_no_result(tmp_path: Path) -> None:
    sink = Sink()
    logs = LogSpec(log_dir=tmp_path / "logs", console=ConsoleSinks(stdout=sink, stderr=sink))
    error_file = logs.error_file_path(0)
    assert error_file is not None
    write_payload(tmp_path / "payload", lambda shard: {}[shard], ("shard-7",))  # a lambda: pickled by value
    cmd = WorkerCommand(
        0,
        0,
        bootstrap_args(tmp_path / "payload", tmp_path / "result"),
        {**env(), "TORCHELASTIC_ERROR_FILE": str(error_file)},
    )
    with anyio.fail_after(DEADLINE):
        outcome = await run_workers([cmd], logs, grace=5, reaper=None)
    assert exitcodes(outcome) == {0: 1}
    assert not (tmp_path / "result").exists()
    with pytest.raises(FileNotFoundError):
        read_result(tmp_path / "result")
    failure = ProcessFailure.from_exit(outcome.exits[0], error_file)
    assert failure.message == "KeyError: 'shard-7'"
    assert "[default0]:KeyError: 'shard-7'\n" in sink.text


MAIN_PARENT = """
import subprocess, sys
from aelastic.agent.callables.parent import bootstrap_args, read_result, write_payload

def square_all(xs, offset=0):  # lives in __main__ of `python -c`: no worker could import it
    return [x * x + offset for x in xs]

payload, result = sys.argv[1] + "/payload", sys.argv[1] + "/result"
write_payload(payload, square_all, ([1, 2, 3],), {"offset": 1})
subprocess.run(bootstrap_args(payload, result), check=True)
print(read_result(result))
"""


def test_callable_from_dunder_main_of_python_c(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", MAIN_PARENT, str(tmp_path)], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "[2, 5, 10]\n"


async def test_workers_survive_the_exit_of_idle_threads(anyio_backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The parent-death signal fires when the *thread* that forked exits. trio's open_process forks from a cached
    thread that exits when idle; workers are forked from the event-loop thread instead, so they must survive."""
    if anyio_backend == "trio":
        import trio._core._thread_cache as thread_cache

        monkeypatch.setattr(thread_cache, "IDLE_TIMEOUT", 0.01)
    sink = Sink()
    async with open_gate() as gate, anyio.create_task_group() as tg:

        async def release_later() -> None:
            await sink.wait_for(r"^\[default0\]:ready$")
            await anyio.to_thread.run_sync(lambda: None)
            await anyio.sleep(0.3)  # let idle worker threads exit: time must pass for this probe
            await gate.open()

        tg.start_soon(release_later)
        code = "print('ready', flush=True); " + gate.code(0)
        with anyio.fail_after(DEADLINE):
            outcome = await run_workers([command(0, code)], spec(sink), grace=5, reaper=None)
    assert exitcodes(outcome) == {0: 0}


async def test_a_verdict_leaves_the_restart_channel_to_the_next_round_before_the_worker_reads_it() -> None:
    """A survivor's verdict starts the next round, whose judge watches the channel at once, before the worker's link
    has handed the verdict over: the judged report must not look like the new round's (it was judged again, "fail",
    and the survivor failed at its next abort: the hundred-fault job ran out of restarts)."""
    channel = RestartChannel()
    verdicts: list[dict[str, object]] = []

    async def link() -> None:  # the link's "restart.raised" service, as the supervisor's handle runs it
        channel.take({"error": "aelastic.worker._restart.RestartRequested: ", "aborted": True})
        verdicts.append(await channel.wait_verdict())

    try:
        channel.abort("a peer failed", lost=False)
        async with anyio.create_task_group() as tg:
            tg.start_soon(link)
            await channel.reported.wait()
            channel.decide({"verdict": "restart", "env": {"RANK": "1"}})
            assert (channel.report, channel.reported.is_set(), channel.aborted) == (None, False, False)
        assert verdicts == [{"verdict": "restart", "env": {"RANK": "1"}}]
    finally:
        channel.close()


class _VerdictLink:
    """The worker's link as the restart session uses it: every report of a call's end is answered "restart"."""

    def request(self, op: str, **fields: object) -> tuple[dict[str, object], list[int]]:
        assert op == "restart.raised", op
        return {"verdict": "restart", "env": {}}, []


class _Call(threading.Thread):
    """One call of a restartable function in a thread of its own: it runs Python until told to end, and records the
    abort raised into it; each ``tick`` it acknowledges shows that it ran Python since (a pending abort is raised
    there)."""

    def __init__(self, session: _Session) -> None:
        super().__init__(daemon=True)
        self.session = session
        self.entered, self.tick, self.ticked, self.end = (threading.Event() for _ in range(4))
        self.raised: list[BaseException] = []
        self.start()
        assert self.entered.wait(DEADLINE)

    def run(self) -> None:
        self.session.enter()
        self.entered.set()
        try:
            while not self.end.is_set():
                if self.tick.wait(0.001):
                    self.tick.clear()
                    self.ticked.set()
        except RestartRequested as exc:
            self.raised.append(exc)
        finally:
            self.session.leave()
            self.ticked.set()

    def ran_python(self) -> bool:
        self.ticked.clear()
        self.tick.set()
        return self.ticked.wait(DEADLINE)


def test_an_abort_the_worker_reads_after_its_call_reported_its_end_does_not_end_the_next_call() -> None:
    """The agent aborts a survivor's call; the call ends by itself (its collective failed), is reported, and the
    verdict starts the next call before the worker's listener reads the abort (a busy node). That abort must not end
    the next call: its report ("aborted") would be one the agent never asked for, judged "fail" (the hundred-fault
    job ran out of restarts beside stress-ng). An abort of the call that runs still ends it."""
    channel = RestartChannel()
    worker_end = socket.socket(fileno=channel.worker_fd)  # the worker's end, read here: the listener is held back
    channel.worker_fd = -1
    agent_side, listened = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    session = _Session(cast("AgentLink", _VerdictLink()), listened)

    def abort(reason: str) -> tuple[str, float, int, bool]:
        channel.abort(reason, lost=True)
        event = json.loads(worker_end.recv(1 << 16))
        return event["reason"], event["grace"], event["verdicts"], event["lost"]

    try:
        first = _Call(session)
        stale = abort("local rank 1 failed")
        first.end.set()
        first.join(DEADLINE)
        assert first.raised == []
        assert session.ask(RuntimeError("Connection closed by peer")) == {}
        channel.take({"error": "RuntimeError: Connection closed by peer", "distributed": True, "aborted": False})
        channel.decide({"verdict": "restart", "env": {}})

        second = _Call(session)
        session._abort(*stale)  # what the listener does with the abort it reads now
        assert second.ran_python()
        assert second.raised == []
        session._abort(*abort("local rank 2 failed"))
        second.join(DEADLINE)
        assert [type(exc) for exc in second.raised] == [RestartRequested]
        session.ask(second.raised[0])  # reported: the abort's timer finds it let go
    finally:
        channel.close()
        worker_end.close()
        agent_side.close()
        listened.close()


@pytest.mark.torch
def test_a_call_held_in_torch_distributed_after_an_abort_for_lost_members_says_so() -> None:
    """An abort for lost members finds the call blocked in a C call under torch.distributed (here torch elastic's
    store barrier, waiting for a member that never comes, as a collective waits for a powered-off peer): the worker
    tells its agent where it is held, for the abort's verdict count, instead of letting the grace run out."""
    from torch.distributed import TCPStore
    from torch.distributed.elastic.utils.store import barrier

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    other = TCPStore("127.0.0.1", store.port, is_master=False)  # a client is one thread's: the member that never came
    agent_side, listened = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    session = _Session(cast("AgentLink", _VerdictLink()), listened)
    raised: list[BaseException] = []

    def call() -> None:
        session.enter()
        try:
            barrier(store, 2, "held", barrier_timeout=DEADLINE)
            for _ in range(10**9):  # Python again: the abort surfaces here
                pass
        except RestartRequested as exc:
            raised.append(exc)
        finally:
            session.leave()

    def blocked_in_barrier(thread: threading.Thread) -> bool:
        """Whether the call waits in the store inside the barrier: its frame there, its thread asleep in the kernel."""
        frame = sys._current_frames().get(thread.ident or 0)
        if frame is None or frame.f_code.co_name != "barrier" or other.add("held/num_members", 0) < 1:
            return False
        status = Path(f"/proc/self/task/{thread.native_id}/status").read_text()
        return re.search(r"^State:\s+S ", status, re.M) is not None

    thread = threading.Thread(target=call, daemon=True)
    try:
        thread.start()
        deadline, seen = time.monotonic() + DEADLINE, 0
        while seen < 3:  # three looks in a row: not a moment's wait for the GIL on its way there
            assert time.monotonic() < deadline, "the call never blocked in the barrier"
            seen = seen + 1 if blocked_in_barrier(thread) else 0
            time.sleep(0.02)
        session._abort("members left the round", 2.0, 0, True)
        agent_side.settimeout(DEADLINE)
        held = json.loads(agent_side.recv(1 << 16))
        assert held["event"] == "held", held
        assert held["verdicts"] == 0, held
        assert re.fullmatch(r"barrier \(.*/torch/distributed/elastic/utils/store\.py:\d+\)", held["where"]), held
        barrier(other, 2, "held")  # the member that never came: the call returns, and the abort ends it
        thread.join(DEADLINE)
        assert [type(exc) for exc in raised] == [RestartRequested]
    finally:
        with suppress(Exception):
            other.set("held/last_member", "")
        thread.join(DEADLINE)
        agent_side.close()
        listened.close()


async def test_the_agent_stops_waiting_for_a_report_when_the_worker_says_it_is_held() -> None:
    """After an abort for lost members, a survivor's "held" message ends the agent's wait for its report at once (it
    is replaced); one left over from an earlier abort (another verdict count) does not."""
    channel = RestartChannel()
    worker_end = socket.socket(fileno=channel.worker_fd)
    channel.worker_fd = -1
    try:
        channel.abort("members left the round", lost=True)
        assert json.loads(worker_end.recv(1 << 16))["lost"] is True
        worker_end.send(json.dumps({"event": "held", "where": "stale", "verdicts": channel.verdicts - 1}).encode())
        worker_end.send(json.dumps({"event": "held", "where": "all_reduce", "verdicts": channel.verdicts}).encode())
        with anyio.fail_after(channel.grace / 2):  # long before the grace ends
            await channel.wait_report()
        assert channel.held == "all_reduce"
        assert channel.report is None
    finally:
        channel.close()
        worker_end.close()


_PTRACE_SEIZE = 0x4206  # attaches without stopping the tracee: a debugger's, whose tracer sees signals first


def test_proc_tells_which_signal_ends_a_process_on_delivery() -> None:
    """A stop does not wait for a worker that a signal ends on delivery (its memory's teardown is the kernel's); one
    that catches, ignores or blocks the signal, is stopped or traced, or has exited already is waited for."""
    setups = {
        "plain": "pass",
        "catches": "signal.signal(signal.SIGTERM, lambda *a: None)",
        "ignores": "signal.signal(signal.SIGTERM, signal.SIG_IGN)",
        "blocks": "signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})",
        "stopped": "pass",
        "traced": "pass",
        "exited": "pass",
    }
    processes = {}
    try:
        for name, setup in setups.items():
            code = f"import signal, sys, time\n{setup}\nprint('ready', flush=True)\n"
            code += "sys.exit(3)" if name == "exited" else "time.sleep(120)"
            processes[name] = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
        for process in processes.values():
            assert process.stdout is not None
            assert process.stdout.readline() == b"ready\n"
        libc = ctypes.CDLL(None, use_errno=True)
        libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
        assert libc.ptrace(_PTRACE_SEIZE, processes["traced"].pid, None, None) == 0, os.strerror(ctypes.get_errno())
        os.kill(processes["stopped"].pid, signal.SIGSTOP)
        os.waitid(os.P_PID, processes["stopped"].pid, os.WSTOPPED | os.WNOWAIT)
        os.waitid(os.P_PID, processes["exited"].pid, os.WEXITED | os.WNOWAIT)  # a zombie, not reaped yet
        assert process_state(processes["exited"].pid) == "Z"
        ends = {name: dies_of(process.pid, signal.SIGTERM) for name, process in processes.items()}
        assert ends == {"plain": True, "catches": False, "ignores": False, "blocks": False, "stopped": False,
                        "traced": False, "exited": False}  # fmt: skip
        assert dies_of(processes["catches"].pid, signal.SIGKILL)
        assert not dies_of(processes["plain"].pid, signal.SIGINT)  # Python's own handler (KeyboardInterrupt)
        assert not dies_of(processes["plain"].pid, signal.SIGCHLD)  # ignored by default
    finally:
        for process in processes.values():
            process.kill()
            process.wait()
    assert not dies_of(processes["plain"].pid, signal.SIGKILL)  # gone


def test_a_process_reads_as_exiting_once_its_exit_began_until_it_is_reaped() -> None:
    """``procfs.exiting``: the kernel's mark on a process whose exit began (set before it closes its files, so a worker
    whose peers saw its connections close counts as ended, not only once its pidfd is readable) stays on its zombie;
    a live process and a reaped one are not exiting."""
    live = subprocess.Popen([sys.executable, "-c", "import time; print('ready', flush=True); time.sleep(120)"],
                            stdout=subprocess.PIPE)  # fmt: skip
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        assert live.stdout is not None
        assert live.stdout.readline() == b"ready\n"
        os.waitid(os.P_PID, ended.pid, os.WEXITED | os.WNOWAIT)  # a zombie, not reaped yet
        assert (exiting(live.pid), exiting(ended.pid)) == (False, True)
    finally:
        live.kill()
        live.wait()
        ended.wait()
    assert not exiting(ended.pid)  # reaped: gone
