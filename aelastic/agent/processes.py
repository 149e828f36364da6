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

* *Parent-death signal* (:mod:`aelastic.agent.spawn`). Every worker is exec'd through util-linux
  ``setpriv --pdeathsig KILL --`` when it exists, else through :mod:`aelastic.agent.spawn.child`
  (``prctl(PR_SET_PDEATHSIG, SIGKILL)`` via ctypes, then ``execvp``). Either way the worker keeps the pid the agent
  sees, and the kernel kills it when the agent dies. The kernel ties that signal to the *thread* that forked.
  trio's ``open_process`` forks from a cached worker thread that exits after 10 idle seconds, which would kill
  every worker; so workers are not started with ``anyio.open_process`` but with ``subprocess.Popen`` called from
  the event-loop thread (a fork/exec of a few milliseconds, as torch does), their exit awaited through a pidfd
  (``anyio.wait_readable``, then ``Popen.poll`` reaps) and their pipes read with ``anyio.wait_readable`` +
  ``os.read``: the same code on asyncio and trio, no threads, no polling. Run the event loop on a thread that
  lives as long as the workers (the main thread, or the blocking portal's thread for the whole launch).
* *Reaper sidecar* (:mod:`aelastic.agent.reaper`). The parent-death signal reaches the worker only, not its
  children. :func:`~aelastic.agent.reaper.parent.open_reaper` starts :mod:`aelastic.agent.reaper.child`, which
  reads a pipe whose only write end the agent holds; every worker group is registered with it right after spawning
  and unregistered once stopped and reaped. When the pipe reaches end of file (the agent exited or died by any
  signal), the reaper SIGKILLs every group still registered. Between a spawn and its registration (a pipe write)
  there is a window of microseconds in which only the parent-death signal covers the worker.
* *Finishing together* (:mod:`aelastic.agent.finish`), for callable workers: none exits before every local
  worker's function has returned.

With ``--prewarm`` a worker may start as a standby interpreter (:mod:`aelastic.agent.prewarm`) instead: spawned
the same way (:func:`~aelastic.agent.spawn.parent.spawn_process`) and registered with the reaper before the
attempt, then handed the attempt's environment and fresh output streams. From then on it is a worker like the
others.

This module is the supervision only; each of those features is a package of its own, its agent side and its child
side together (see :mod:`aelastic.agent`).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Final, NamedTuple

import anyio
import anyio.abc
import anyio.lowlevel

from ..errors import ConfigurationError, ReaperError
from .finish.parent import FinishLineServer
from .forward.parent import RunningWorkers
from .logs import LogSpec, Std, WorkerLog, pump
from .reaper.parent import Reaper
from .spawn.parent import (
    PipeReader,
    WorkerCommand,
    WorkerHook,
    WorkerProcess,
    output_fds,
    signal_group,
    spawn_process,
    wait_process,
)

if TYPE_CHECKING:
    from .prewarm.parent import Standbys  # imported by the launcher only with --prewarm

__all__ = ["GroupOutcome", "StopSignal", "WorkerExit", "run_workers"]

logger = logging.getLogger(__name__)

# After the stop, how long the pumps may wait for end of file on the workers' pipes. Every process of the workers'
# groups is dead by then, so end of file is immediate unless a descendant moved to another group or session and
# still holds a pipe; its later output is dropped.
_DRAIN_LIMIT: Final = 5.0


class StopSignal:
    """The signal that stops the workers when their supervision is cancelled (``run_workers(stop_signal=...)``).

    Whoever turns a signal into cancellation (the CLI) sets :attr:`signum` to the signal the agent received, so the
    workers are stopped with it, as torchrun forwards it (SIGINT stays SIGINT: KeyboardInterrupt in the workers).
    The holder is mutable because the signal arrives after supervision has started. A stop after a worker's
    failure is always SIGTERM.
    """

    __slots__ = ("signum",)

    def __init__(self, signum: signal.Signals = signal.SIGTERM) -> None:
        self.signum = signum

    def __repr__(self) -> str:
        return f"<StopSignal {self.signum.name}>"


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


class _Child:
    """A started worker (spawned, or a standby given the attempt); its exit is awaited through a pidfd."""

    __slots__ = ("_pidfd", "popen", "stderr", "stdout")

    def __init__(self, popen: subprocess.Popen[bytes], stdout: int, stderr: int) -> None:
        self.popen = popen
        self.stdout = PipeReader(stdout)
        self.stderr = PipeReader(stderr)
        self._pidfd = os.pidfd_open(popen.pid)  # not reaped yet, so it cannot fail with ESRCH

    @classmethod
    async def start(
        cls,
        command: WorkerCommand,
        log: WorkerLog,
        finish: FinishLineServer | None,
        standbys: Standbys | None,
    ) -> _Child:
        """Start ``command`` with fresh output streams: by its standby where one fits, else spawned."""
        env = command.env if finish is None else finish.worker_env(command.env)
        pass_fds = command.pass_fds if finish is None else (*command.pass_fds, *finish.worker_fds)
        out_read, out_write = output_fds(log.terminal_size(Std.OUT))
        try:
            err_read, err_write = output_fds(log.terminal_size(Std.ERR))
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

    def running(self) -> bool:
        """Whether the leader is not reaped yet (its group id is still this worker's)."""
        return self.exitcode is None

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
    stop_signal: StopSignal | None = None,
    running: RunningWorkers | None = None,
) -> GroupOutcome:
    """Run one node's workers until all exit 0, or the first fails; then stop the rest.

    Args:
        commands: the workers, one per local rank.
        logs: where their output goes (see :class:`~aelastic.agent.logs.LogSpec`); the attempt directory is
            created afresh before any worker starts.
        grace: seconds between SIGTERM and SIGKILL when stopping workers.
        reaper: the agent's reaper sidecar (:func:`~aelastic.agent.reaper.parent.open_reaper`); ``None`` relies
            on the parent-death signal alone, which leaves a worker's own children alive if the agent is SIGKILLed.
        finish_together: the workers run the callable bootstrap, which waits after the call returned until every
            local worker's has (:mod:`aelastic.agent.finish`), as torch's multiprocessing does.
        watch: run beside the waiters once every worker has started, with all of them (e.g. the expiration timer
            server, which may kill a worker: that worker's exit is then a failure like any other); cancelled when
            the waiters end. Its exceptions propagate after the stop.
        before_kill: awaited, shielded, with the workers still alive when ``grace`` has run out, right before
            SIGKILL (e.g. a stack dump); it must bound its own time, and its exceptions are logged, not raised.
        started: called once every worker has been spawned, with all of them (their pids), before any is awaited.
        standbys: pre-warmed interpreters (:mod:`aelastic.agent.prewarm`): each worker that has a fitting one is
            handed to it instead of spawned, and beside the running workers the next attempt's are started.
        stop_signal: what stops the workers when this call is cancelled; ``None`` is SIGTERM.
        running: where the workers' process groups are tracked while they run, for signals forwarded to them
            (:mod:`aelastic.agent.forward`): each is added once spawned, discarded once reaped.

    Returns:
        Every worker's exit, in command order. Workers stopped by the agent after the first failure are reported
        with their signal exit codes (``-15``, or ``-9`` when SIGKILL was needed), as torch does.

    On cancellation every worker is stopped the same way (the signal in ``stop_signal``, SIGTERM by default;
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
    finish = FinishLineServer(local_ranks) if finish_together else None
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
                workers.append(worker := _Worker(command, process, log))
                if running is not None:
                    running.add(process.pid, worker.running)
                if reaper is not None:
                    await reaper.register(process.pid)
                logger.debug("started worker local_rank %d (pid %d)", command.local_rank, process.pid)
            if finish is not None:
                finish.spawned()
            if started is not None:
                started([w.handle() for w in workers])
        except BaseException:
            with anyio.CancelScope(shield=True):
                await _stop(workers, grace, reaper, _requested(stop_signal), before_kill)
            raise
        first_failure = await _supervise(workers, grace, reaper, finish, watch, before_kill, standbys, stop_signal)
        exits = tuple(w.to_exit() for w in workers)
        first = None if first_failure is None else exits[workers.index(first_failure)]
        return GroupOutcome(exits=exits, first_failure=first)
    finally:
        if finish is not None:
            finish.close()
        for worker in workers:
            if running is not None:
                running.discard(worker.pid)
            worker.log.close()
            worker.process.close()


def _requested(stop_signal: StopSignal | None) -> signal.Signals:
    return signal.SIGTERM if stop_signal is None else stop_signal.signum


async def _supervise(
    workers: list[_Worker],
    grace: float,
    reaper: Reaper | None,
    finish: FinishLineServer | None,
    watch: WorkerHook | None,
    before_kill: WorkerHook | None,
    standbys: Standbys | None,
    stop_signal: StopSignal | None,
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
            signum = signal.SIGTERM if first_failure else _requested(stop_signal)
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
        signal_group(worker.pid, signum)
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
        signal_group(worker.pid, signal.SIGKILL)
    for worker in workers:
        if worker.exitcode is None:
            worker.observe(await worker.process.wait())
        if reaper is not None:
            try:
                await reaper.unregister(worker.pid)
            except ReaperError as exc:
                logger.warning("%s", exc)
