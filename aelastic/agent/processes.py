"""Start and supervise one node's local workers; make sure none of them outlives the agent.

Theory of operation
-------------------
:func:`run_workers` spawns every worker first (outside any task group, so a spawn error surfaces as itself), each
as the leader of a process group of its own (``start_new_session=True``), with stdout and stderr piped to the
agent. Then one task group holds a waiter per worker (``await process.wait()``: no polling) and a pump per pipe
(:func:`aelastic.agent.logs.pump`). The waiters end when every worker has exited 0, or at the first non-zero exit,
or when the caller's scope is cancelled. In every case the same stop runs, shielded, the way trio's
``run_process`` stops a child: SIGTERM to every worker's process group (``killpg``: also the groups whose leader
already exited, so a worker's own children die too), wait up to ``grace`` for the leaders, SIGKILL to every group,
reap every leader. The pumps are shielded too, so what the workers wrote before dying reaches the logs; once the
groups are dead the pipes reach end of file (a descendant that left its group and still holds a pipe is cut off
after :data:`_DRAIN_LIMIT`). Then the outcome is returned, or the cancellation re-raised.

No orphans, even when the agent is SIGKILLed:

* *Parent-death signal.* Every worker is exec'd through util-linux ``setpriv --pdeathsig KILL --`` when it exists,
  else through :mod:`aelastic.agent._pdeathsig` (``prctl(PR_SET_PDEATHSIG, SIGKILL)`` via ctypes, then
  ``execvp``). Either way the worker keeps the pid the agent sees, and the kernel kills it when the agent dies.
  The kernel ties that signal to the *thread* that forked. trio's ``open_process`` forks from a cached worker
  thread that exits after 10 idle seconds, which would kill every worker; so workers are not started with
  ``anyio.open_process`` but with ``subprocess.Popen`` called from the event-loop thread (a fork/exec of a few
  milliseconds, as torch does), their exit awaited through a pidfd (``anyio.wait_readable``, then
  ``Popen.poll`` reaps) and their pipes read with ``anyio.wait_readable`` + ``os.read``: the same code on asyncio
  and trio, no threads, no polling. Run the event loop on a thread that lives as long as the workers (the main
  thread, or the blocking portal's thread for the whole launch).
* *Reaper sidecar.* The parent-death signal reaches the worker only, not its children. :func:`open_reaper` starts
  :mod:`aelastic.agent._reaper`, which reads a pipe whose only write end the agent holds; every worker group is
  registered with it right after spawning and unregistered once stopped and reaped. When the pipe reaches end of
  file (the agent exited or died by any signal), the reaper SIGKILLs every group still registered. Between a spawn
  and its registration (a pipe write) there is a window of microseconds in which only the parent-death signal
  covers the worker.

With ``--prewarm`` a worker may start as a standby interpreter (:mod:`aelastic.agent.standby`) instead: spawned the
same way (:func:`spawn_process`) and registered with the reaper before the attempt, then handed the attempt's
environment and fresh output streams. From then on it is a worker like the others.
"""

from __future__ import annotations

import errno
import fcntl
import functools
import logging
import os
import shutil
import signal
import struct
import subprocess
import sys
import termios
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping, Sequence
from contextlib import asynccontextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, NamedTuple

import anyio
import anyio.abc
import anyio.lowlevel

from ..errors import AelasticError, ConfigurationError
from ._finish import FINISH_FDS_ENV
from .logs import LogSpec, Std, WorkerLog, pump

if TYPE_CHECKING:
    from .standby import Standbys

__all__ = [
    "GroupOutcome",
    "Reaper",
    "ReaperError",
    "StopSignal",
    "WorkerCommand",
    "WorkerExit",
    "WorkerHook",
    "WorkerProcess",
    "open_reaper",
    "run_workers",
    "spawn_process",
    "stop_signal",
    "wait_process",
]

logger = logging.getLogger(__name__)

# After the stop, how long the pumps may wait for end of file on the workers' pipes. Every process of the workers'
# groups is dead by then, so end of file is immediate unless a descendant moved to another group or session and
# still holds a pipe; its later output is dropped.
_DRAIN_LIMIT: Final = 5.0


class StopSignal:
    """The signal that stops the workers when their supervision is cancelled (see :data:`stop_signal`)."""

    __slots__ = ("signum",)

    def __init__(self, signum: signal.Signals = signal.SIGTERM) -> None:
        self.signum = signum


# Set by whoever turns a signal into cancellation (the CLI): the workers are stopped with the signal the agent
# received, as torchrun forwards it (SIGINT stays SIGINT: KeyboardInterrupt in the workers). Unset, or for a stop
# after a worker's failure, it is SIGTERM. The holder is mutable because the signal arrives after the agent's tasks
# have copied the context.
stop_signal: ContextVar[StopSignal | None] = ContextVar("aelastic_stop_signal", default=None)


class ReaperError(AelasticError):
    """The reaper sidecar is gone: worker groups can no longer be registered for cleanup after an agent crash."""


@dataclass(frozen=True, slots=True)
class WorkerCommand:
    """One local worker to start.

    Attributes:
        local_rank: rank on this node.
        global_rank: rank in the job.
        args: the command line (``args[0]`` looked up on ``PATH`` of ``env``).
        env: the worker's full environment (nothing is inherited).
        pass_fds: file descriptors the worker inherits (e.g. the pipe of :mod:`~aelastic.agent.faultstacks`).
    """

    local_rank: int
    global_rank: int
    args: tuple[str, ...]
    env: Mapping[str, str]
    pass_fds: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.args:
            raise ConfigurationError(f"worker local_rank {self.local_rank}: empty command line")
        if self.local_rank < 0 or self.global_rank < 0:
            raise ConfigurationError(
                f"worker local_rank {self.local_rank}, rank {self.global_rank}: ranks must be >= 0"
            )


class WorkerProcess(NamedTuple):
    """A started worker, as :func:`run_workers` shows it to its hooks: ``pid`` leads the worker's process group."""

    local_rank: int
    global_rank: int
    pid: int


# A hook of run_workers: called with the workers it concerns (see run_workers' ``watch`` and ``before_kill``).
WorkerHook = Callable[[Sequence[WorkerProcess]], Coroutine[Any, Any, None]]


class WorkerExit(NamedTuple):
    """How one worker ended.

    Attributes:
        exitcode: the exit status; negative is ``-signal`` (like ``Popen.returncode``), e.g. ``-15`` for a peer
            the agent stopped with SIGTERM.
        timestamp: wall-clock time (epoch seconds) when the agent observed the exit.
        stderr_tail: the last lines the worker wrote to stderr (``LogSpec.stderr_tail_lines``).
    """

    local_rank: int
    global_rank: int
    pid: int
    exitcode: int
    timestamp: float
    stderr_tail: tuple[str, ...] = ()

    @property
    def failed(self) -> bool:
        return self.exitcode != 0


class GroupOutcome(NamedTuple):
    """The exits of one worker group, in command order, and the first failure the agent observed."""

    exits: tuple[WorkerExit, ...]
    first_failure: WorkerExit | None

    @property
    def succeeded(self) -> bool:
        return self.first_failure is None and all(not e.failed for e in self.exits)

    @property
    def failures(self) -> tuple[WorkerExit, ...]:
        """Every worker that exited non-zero, peers stopped by the agent included (as torch reports them)."""
        return tuple(e for e in self.exits if e.failed)


class Reaper:
    """The agent's handle on its reaper sidecar (see :func:`open_reaper`)."""

    def __init__(self, process: subprocess.Popen[bytes], fd: int) -> None:
        self._process = process
        self._fd = fd
        self._registered: set[int] = set()

    def __repr__(self) -> str:
        return f"<Reaper pid={self._process.pid} registered={sorted(self._registered)} closed={self._fd < 0}>"

    @property
    def pid(self) -> int:
        return self._process.pid

    def statistics(self) -> frozenset[int]:
        """The process groups registered now."""
        return frozenset(self._registered)

    async def register(self, pgid: int) -> None:
        """Have the reaper SIGKILL process group ``pgid`` if the agent goes away before :meth:`unregister`.

        Raises:
            ReaperError: the reaper is gone or was closed.
        """
        await self._send(f"+{pgid}\n".encode())
        self._registered.add(pgid)

    async def unregister(self, pgid: int) -> None:
        """Forget process group ``pgid`` (it has been stopped and reaped).

        Raises:
            ReaperError: the reaper is gone or was closed.
        """
        await self._send(f"-{pgid}\n".encode())
        self._registered.discard(pgid)

    async def _send(self, line: bytes) -> None:
        await anyio.lowlevel.checkpoint()
        while True:
            if self._fd < 0:
                raise ReaperError("the reaper sidecar was closed; open a new one with open_reaper()")
            try:
                os.write(self._fd, line)  # under PIPE_BUF: all of it or EAGAIN
            except BlockingIOError:
                await anyio.wait_writable(self._fd)
            except BrokenPipeError as exc:
                raise ReaperError(
                    f"the reaper sidecar (pid {self._process.pid}) exited with {self._process.poll()}; "
                    "worker groups can no longer be protected against an agent crash"
                ) from exc
            else:
                return

    def _close(self) -> None:
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            os.close(fd)


def _sibling(module: str) -> Path:
    """The file of a script module next to this one; found by path, not imported (_pdeathsig loads ctypes)."""
    return Path(__file__).with_name(f"{module}.py")


@asynccontextmanager
async def open_reaper() -> AsyncIterator[Reaper]:
    """Start the reaper sidecar for this agent; yields the :class:`Reaper` to pass to :func:`run_workers`.

    On exit the pipe is closed; the sidecar kills the groups still registered (none, after a clean run) and exits;
    it is reaped under a shield. If the agent dies instead, the kernel closes the pipe and the sidecar does the
    same.
    """
    read_fd, write_fd = os.pipe()  # both non-inheritable: workers never hold the write end
    try:
        # Popen, reaped through a pidfd as the workers are: anyio.open_process would set up asyncio's subprocess
        # transport and child-watcher thread, a few milliseconds of every launch for a process nobody reads from.
        process = subprocess.Popen(  # noqa: ASYNC220 (see above and the module docstring)
            [sys.executable, "-I", "-S", str(_sibling("_reaper"))],
            stdin=read_fd,
            stdout=subprocess.DEVNULL,
            start_new_session=True,
        )
    except BaseException:
        os.close(write_fd)
        raise
    finally:
        os.close(read_fd)
    os.set_blocking(write_fd, False)
    reaper = Reaper(process, write_fd)
    logger.debug("reaper sidecar started, pid %d", process.pid)
    try:
        yield reaper
    finally:
        reaper._close()
        with anyio.CancelScope(shield=True):
            await wait_process(process)


@functools.cache
def _pdeathsig_prefix() -> tuple[str, ...]:
    setpriv = shutil.which("setpriv")
    if setpriv is not None:
        return (setpriv, "--pdeathsig", "KILL", "--")
    return (sys.executable, "-I", "-S", str(_sibling("_pdeathsig")), str(os.getpid()))


def _signal_group(pgid: int, signum: signal.Signals) -> None:
    try:
        os.killpg(pgid, signum)
    except ProcessLookupError:
        pass  # the group is empty: leader reaped, no descendant left
    except PermissionError:
        # The leader is reaped and its id now names somebody else's group: nothing of ours is in it.
        logger.debug("not signalling process group %d: not ours any more", pgid)


class _PipeReader(anyio.abc.ByteReceiveStream):
    """The agent's end of a worker's stdout or stderr pipe (non-blocking fd, awaited with ``wait_readable``)."""

    def __init__(self, fd: int) -> None:
        os.set_blocking(fd, False)
        self._fd = fd

    async def receive(self, max_bytes: int = 65536) -> bytes:
        await anyio.lowlevel.checkpoint_if_cancelled()
        while True:
            if self._fd < 0:
                raise anyio.ClosedResourceError
            try:
                data = os.read(self._fd, max_bytes)
            except BlockingIOError:
                await anyio.wait_readable(self._fd)
                continue
            except OSError as exc:
                if exc.errno != errno.EIO:
                    raise
                data = b""  # a pseudo-terminal whose every writer has closed: its end of file
            if not data:
                raise anyio.EndOfStream
            return data

    def close(self) -> None:
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            os.close(fd)

    async def aclose(self) -> None:
        self.close()
        await anyio.lowlevel.checkpoint()


def _output_fds(terminal_size: tuple[int, int] | None) -> tuple[int, int]:
    """The (agent's, worker's) ends of one worker stream: a pipe, or a pseudo-terminal of ``(rows, columns)``.

    The pseudo-terminal's output processing is off, so the worker's bytes arrive as written ("\n" is not made
    "\r\n"). It is not the worker's controlling terminal (the worker starts a new session and never opens it).
    """
    if terminal_size is None:
        return os.pipe()
    agent_end, worker_end = os.openpty()
    try:
        attributes = termios.tcgetattr(worker_end)
        attributes[1] &= ~termios.OPOST  # oflag
        termios.tcsetattr(worker_end, termios.TCSANOW, attributes)
        rows, columns = terminal_size
        fcntl.ioctl(worker_end, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))
    except BaseException:
        os.close(agent_end)
        os.close(worker_end)
        raise
    return agent_end, worker_end


def spawn_process(
    args: Sequence[str], env: Mapping[str, str], stdout: int, stderr: int, pass_fds: Sequence[int] = ()
) -> subprocess.Popen[bytes]:
    """Start ``args`` as a worker starts, from the calling (event-loop) thread: under the parent-death signal, the
    leader of a session of its own, with ``env`` only, ``stdout`` and ``stderr``, and ``pass_fds`` beside them."""
    return subprocess.Popen(
        [*_pdeathsig_prefix(), *args],
        stdout=stdout,
        stderr=stderr,
        env=env,
        start_new_session=True,
        close_fds=True,
        pass_fds=tuple(pass_fds),
    )


async def wait_process(popen: subprocess.Popen[bytes], pidfd: int | None = None) -> int:
    """Wait for a child's exit through a pidfd (``pidfd``, else one opened here) and reap it with ``Popen.poll``,
    so ``subprocess`` never reaps a reused pid later."""
    await anyio.lowlevel.checkpoint_if_cancelled()
    if (code := popen.poll()) is not None:
        return code
    own = pidfd is None
    fd = os.pidfd_open(popen.pid) if pidfd is None else pidfd  # not reaped yet: no ESRCH
    try:
        while (code := popen.poll()) is None:
            await anyio.wait_readable(fd)
    finally:
        if own:
            os.close(fd)
    return code


class _Child:
    """A started worker (spawned, or a standby given the attempt); its exit is awaited through a pidfd."""

    __slots__ = ("_pidfd", "popen", "stderr", "stdout")

    def __init__(self, popen: subprocess.Popen[bytes], stdout: int, stderr: int) -> None:
        self.popen = popen
        self.stdout = _PipeReader(stdout)
        self.stderr = _PipeReader(stderr)
        self._pidfd = os.pidfd_open(popen.pid)  # not reaped yet, so it cannot fail with ESRCH

    @classmethod
    async def start(
        cls,
        command: WorkerCommand,
        log: WorkerLog,
        finish: _FinishLine | None,
        standbys: Standbys | None,
    ) -> _Child:
        """Start ``command`` with fresh output streams: by its standby where one fits, else spawned."""
        env = command.env if finish is None else finish.worker_env(command.env)
        pass_fds = command.pass_fds if finish is None else (*command.pass_fds, *finish.worker_fds)
        out_read, out_write = _output_fds(log.terminal_size(Std.OUT))
        try:
            err_read, err_write = _output_fds(log.terminal_size(Std.ERR))
        except BaseException:
            os.close(out_read)
            os.close(out_write)
            raise
        try:
            popen = None
            if standbys is not None:
                popen = await standbys.start(command, env, (out_write, err_write), pass_fds)
            if popen is None:
                popen = spawn_process(command.args, env, out_write, err_write, pass_fds)
        except BaseException:
            os.close(out_read)
            os.close(err_read)
            raise
        finally:
            os.close(out_write)
            os.close(err_write)
        return cls(popen, out_read, err_read)

    @property
    def pid(self) -> int:
        return self.popen.pid

    async def wait(self) -> int:
        """Wait for the exit and reap."""
        return await wait_process(self.popen, self._pidfd)

    def close(self) -> None:
        """Close the pipes and the pidfd (after the process is reaped)."""
        self.stdout.close()
        self.stderr.close()
        if self._pidfd >= 0:
            fd, self._pidfd = self._pidfd, -1
            os.close(fd)


class _Worker:
    __slots__ = ("command", "exitcode", "log", "process", "timestamp")

    def __init__(self, command: WorkerCommand, process: _Child, log: WorkerLog) -> None:
        self.command = command
        self.process = process
        self.log = log
        self.exitcode: int | None = None
        self.timestamp = 0.0

    @property
    def pid(self) -> int:
        return self.process.pid

    def handle(self) -> WorkerProcess:
        return WorkerProcess(self.command.local_rank, self.command.global_rank, self.pid)

    def observe(self, exitcode: int) -> None:
        if self.exitcode is None:
            self.exitcode = exitcode
            self.timestamp = time.time()

    def to_exit(self) -> WorkerExit:
        if self.exitcode is None:  # pragma: no cover - every worker is reaped before outcomes are built
            raise RuntimeError(f"worker pid {self.pid} was not reaped")
        return WorkerExit(
            local_rank=self.command.local_rank,
            global_rank=self.command.global_rank,
            pid=self.pid,
            exitcode=self.exitcode,
            timestamp=self.timestamp,
            stderr_tail=self.log.stderr_tail(),
        )


class _FinishLine:
    """The agent's side of workers that finish together (:mod:`aelastic.agent._finish`): reads who returned from
    the done pipe, and closes the release pipe once every worker has returned or exited."""

    def __init__(self, local_ranks: Sequence[int]) -> None:
        self._pending = set(local_ranks)
        done_read, self._done_write = os.pipe()  # non-inheritable; pass_fds gives the workers their copies
        self._release_read, self._release_write = os.pipe()
        self._done = _PipeReader(done_read)
        self._scope = anyio.CancelScope()

    @property
    def worker_fds(self) -> tuple[int, int]:
        return (self._done_write, self._release_read)

    def worker_env(self, env: Mapping[str, str]) -> dict[str, str]:
        return {**env, FINISH_FDS_ENV: f"{self._done_write},{self._release_read}"}

    def spawned(self) -> None:
        """Every worker holds its ends now: drop the agent's copies, so the pipes end with the workers."""
        for fd in (self._done_write, self._release_read):
            if fd >= 0:
                os.close(fd)
        self._done_write = self._release_read = -1

    def finished(self, local_rank: int) -> None:
        """``local_rank`` returned, or exited; release every worker once none is pending."""
        self._pending.discard(local_rank)
        if not self._pending and self._release_write >= 0:
            os.close(self._release_write)
            self._release_write = -1
            self._scope.cancel()

    async def serve(self) -> None:
        """Read the done pipe until everyone finished (or every holder of its write end is gone)."""
        with self._scope:
            received = b""
            async for chunk in self._done:
                received += chunk
                *lines, received = received.split(b"\n")
                for line in lines:
                    self.finished(int(line))

    def close(self) -> None:
        self.spawned()
        self._done.close()
        if self._release_write >= 0:
            os.close(self._release_write)
            self._release_write = -1


async def run_workers(
    commands: Sequence[WorkerCommand],
    logs: LogSpec,
    *,
    grace: float,
    reaper: Reaper | None,
    finish_together: bool = False,
    watch: WorkerHook | None = None,
    before_kill: WorkerHook | None = None,
    started: Callable[[Sequence[WorkerProcess]], None] | None = None,
    standbys: Standbys | None = None,
) -> GroupOutcome:
    """Run one node's workers until all exit 0, or the first fails; then stop the rest.

    Args:
        commands: the workers, one per local rank.
        logs: where their output goes (see :class:`~aelastic.agent.logs.LogSpec`); the attempt directory is
            created afresh before any worker starts.
        grace: seconds between SIGTERM and SIGKILL when stopping workers.
        reaper: the agent's reaper sidecar (:func:`open_reaper`); ``None`` relies on the parent-death signal
            alone, which leaves a worker's own children alive if the agent is SIGKILLed.
        finish_together: the workers run the callable bootstrap, which waits after the call returned until every
            local worker's has (:mod:`aelastic.agent._finish`), as torch's multiprocessing does.
        watch: run beside the waiters once every worker has started, with all of them (e.g. the expiration timer
            server, which may kill a worker: that worker's exit is then a failure like any other); cancelled when
            the waiters end. Its exceptions propagate after the stop.
        before_kill: awaited, shielded, with the workers still alive when ``grace`` has run out, right before
            SIGKILL (e.g. a stack dump); it must bound its own time, and its exceptions are logged, not raised.
        started: called once every worker has been spawned, with all of them (their pids), before any is awaited.
        standbys: pre-warmed interpreters (:mod:`aelastic.agent.standby`): each worker that has a fitting one is
            handed to it instead of spawned, and beside the running workers the next attempt's are started.

    Returns:
        Every worker's exit, in command order. Workers stopped by the agent after the first failure are reported
        with their signal exit codes (``-15``, or ``-9`` when SIGKILL was needed), as torch does.

    On cancellation every worker is stopped the same way (the signal in :data:`stop_signal`, SIGTERM by default;
    ``grace``; KILL; reap), under a shield, its output drained into the logs, and then the cancellation
    propagates. A worker that cannot be executed is a worker that exits 127; an error spawning the wrapper itself
    (out of processes, file descriptors) stops the workers already started and propagates.
    """
    if grace < 0:
        raise ConfigurationError(f"grace {grace}: must be >= 0 seconds")
    local_ranks = [c.local_rank for c in commands]
    if len(set(local_ranks)) != len(local_ranks):
        raise ConfigurationError(f"local ranks {local_ranks}: each local rank must appear once")
    await anyio.lowlevel.checkpoint()
    logs.prepare_attempt_dir(local_ranks)
    workers: list[_Worker] = []
    finish = _FinishLine(local_ranks) if finish_together else None
    try:
        try:
            for command in commands:
                log = WorkerLog(logs, command.local_rank, command.global_rank)
                try:
                    await anyio.lowlevel.checkpoint()
                    process = await _Child.start(command, log, finish, standbys)
                except BaseException:
                    log.close()
                    raise
                workers.append(_Worker(command, process, log))
                if reaper is not None:
                    await reaper.register(process.pid)
                logger.debug("started worker local_rank %d (pid %d)", command.local_rank, process.pid)
            if finish is not None:
                finish.spawned()
            if started is not None:
                started([w.handle() for w in workers])
        except BaseException:
            with anyio.CancelScope(shield=True):
                await _stop(workers, grace, reaper, _requested_stop_signal(), before_kill)
            raise
        first_failure = await _supervise(workers, grace, reaper, finish, watch, before_kill, standbys)
        exits = tuple(w.to_exit() for w in workers)
        first = None if first_failure is None else exits[workers.index(first_failure)]
        return GroupOutcome(exits=exits, first_failure=first)
    finally:
        if finish is not None:
            finish.close()
        for worker in workers:
            worker.log.close()
            worker.process.close()


def _requested_stop_signal() -> signal.Signals:
    holder = stop_signal.get()
    return signal.SIGTERM if holder is None else holder.signum


async def _supervise(
    workers: list[_Worker],
    grace: float,
    reaper: Reaper | None,
    finish: _FinishLine | None,
    watch: WorkerHook | None,
    before_kill: WorkerHook | None,
    standbys: Standbys | None,
) -> _Worker | None:
    first_failure: list[_Worker] = []

    async def wait_worker(worker: _Worker, waiters: anyio.CancelScope) -> None:
        worker.observe(await worker.process.wait())
        if finish is not None:
            finish.finished(worker.command.local_rank)
        if worker.exitcode != 0 and not first_failure:
            first_failure.append(worker)
            logger.info(
                "worker local_rank %d (pid %d) exited with %d: stopping the others",
                worker.command.local_rank,
                worker.pid,
                worker.exitcode,
            )
            waiters.cancel()

    async def shielded_pump(
        scope: anyio.CancelScope, stream: anyio.abc.ByteReceiveStream, log: WorkerLog, std: Std
    ) -> None:
        with scope:
            await pump(stream, log, std)

    async with anyio.create_task_group() as pumps:
        drains: list[anyio.CancelScope] = []
        for worker in workers:
            for std, stream in ((Std.OUT, worker.process.stdout), (Std.ERR, worker.process.stderr)):
                scope = anyio.CancelScope(shield=True)
                drains.append(scope)
                pumps.start_soon(shielded_pump, scope, stream, worker.log, std)
        try:
            async with anyio.create_task_group() as waiters:
                if watch is not None:
                    waiters.start_soon(watch, [w.handle() for w in workers])
                if finish is not None:
                    waiters.start_soon(finish.serve)
                if standbys is not None:  # the next attempt's, preloading while these run
                    waiters.start_soon(standbys.refill, [w.command for w in workers])
                async with anyio.create_task_group() as exits:
                    for worker in workers:
                        exits.start_soon(wait_worker, worker, waiters.cancel_scope)
                waiters.cancel_scope.cancel()  # every worker exited: the watch ends too
        finally:
            # A peer's failure stops the others with SIGTERM (torch does); a cancellation with what was asked.
            signum = signal.SIGTERM if first_failure else _requested_stop_signal()
            with anyio.CancelScope(shield=True):
                await _stop(workers, grace, reaper, signum, before_kill)
            deadline = anyio.current_time() + _DRAIN_LIMIT
            for scope in drains:
                scope.deadline = deadline
    return first_failure[0] if first_failure else None


async def _stop(
    workers: list[_Worker],
    grace: float,
    reaper: Reaper | None,
    signum: signal.Signals,
    before_kill: WorkerHook | None = None,
) -> None:
    """``signum`` to every group, wait up to ``grace`` for the leaders, ``before_kill`` the survivors, KILL every
    group, reap. Call it shielded."""
    for worker in workers:
        _signal_group(worker.pid, signum)
    with anyio.move_on_after(grace) as waited:
        for worker in workers:
            if worker.exitcode is None:
                worker.observe(await worker.process.wait())
    if waited.cancelled_caught:
        logger.warning(
            "workers %s did not exit within %.1f s of %s: sending SIGKILL",
            [w.command.local_rank for w in workers if w.exitcode is None],
            grace,
            signum.name,
        )
        survivors = [w.handle() for w in workers if w.exitcode is None]
        if before_kill is not None and survivors:
            try:
                await before_kill(survivors)
            except Exception:  # the kill must happen whatever the hook did
                logger.exception("before_kill hook failed; killing workers %s", [w.local_rank for w in survivors])
    for worker in workers:
        _signal_group(worker.pid, signal.SIGKILL)
    for worker in workers:
        if worker.exitcode is None:
            worker.observe(await worker.process.wait())
        if reaper is not None:
            try:
                await reaper.unregister(worker.pid)
            except ReaperError as exc:
                logger.warning("%s", exc)
