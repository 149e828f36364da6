"""A started worker as the supervisor (:mod:`aelastic.agent.processes`) holds it: its process, pipes, link and pidfd
(:class:`Child`), what is known of it (:class:`Tracked`: how it ended, whether it is being stopped, its restart
channel), and how it ended (:class:`WorkerExit`, and an attempt's :class:`GroupOutcome`)."""

from __future__ import annotations

import os
import select
import subprocess
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Final, NamedTuple

import anyio

from .finish.parent import FinishLineServer
from .lifecycle import Event, Exit, Lifecycle, Phase
from .link.parent import WorkerLink
from .logs import Std, WorkerLog
from .procfs import exiting
from .restart.parent import RestartChannel
from .spawn.parent import PipeReader, WorkerCommand, WorkerProcess, output_fds, spawn_process, wait_process

if TYPE_CHECKING:
    from .prewarm.parent import Standbys

__all__ = ["DRAIN_LIMIT", "Child", "GroupOutcome", "LogOf", "Tracked", "WorkerExit", "failed_first"]

# After the stop, how long the pumps may wait for end of file on the workers' pipes. Every process of the workers'
# groups is dead by then, so end of file is immediate unless a descendant moved to another group or session and
# still holds a pipe; its later output is dropped.
DRAIN_LIMIT: Final = 5.0


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


class Child:
    """A started worker's process (spawned, or a standby given the attempt), its pipes, its link and its pidfd."""

    __slots__ = ("_pidfd", "link", "popen", "stderr", "stdout")

    def __init__(self, popen: subprocess.Popen[bytes], stdout: int, stderr: int, link: WorkerLink) -> None:
        self.popen = popen
        self.stdout = PipeReader(stdout)
        self.stderr = PipeReader(stderr)
        self.link = link
        self._pidfd = os.pidfd_open(popen.pid)  # not reaped yet, so it cannot fail with ESRCH

    @classmethod
    async def start(
        cls,
        command: WorkerCommand,
        log: WorkerLog,
        finish: FinishLineServer | None,
        standbys: Standbys | None,
    ) -> Child:
        """Start ``command`` with fresh output streams and a link: by its standby where one fits, else spawned."""
        link = WorkerLink()
        try:
            fd_vars = [link.fd_var()] if finish is None else [finish.fd_var(), link.fd_var()]
            env = {**command.env, **{var.name: var.value(var.fds) for var in fd_vars}}
            pass_fds = (*command.pass_fds, *(fd for var in fd_vars for fd in var.fds))
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
                    popen = await standbys.start(command, env, (out_write, err_write), fd_vars)
                if popen is None:
                    popen = spawn_process(command.args, env, out_write, err_write, pass_fds)
            except BaseException:
                os.close(out_read)
                os.close(err_read)
                raise
            finally:
                os.close(out_write)
                os.close(err_write)
        except BaseException:
            link.close()
            raise
        link.handed_over()
        return cls(popen, out_read, err_read, link)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def exited(self) -> bool:
        """Whether the process has ended (its pidfd is readable) or has begun to (:func:`~.procfs.exiting`), before
        or without the reaping."""
        if self._pidfd < 0 or self.popen.returncode is not None:
            return True
        poller = select.poll()
        poller.register(self._pidfd, select.POLLIN)
        return bool(poller.poll(0)) or exiting(self.pid)

    async def wait(self) -> int:
        """Wait for the exit and reap."""
        return await wait_process(self.popen, self._pidfd)

    async def wait_end(self) -> tuple[int, bool]:
        """The exit status, and whether the worker reported it over its link before its teardown (the process may
        still run then) rather than the kernel reaping it."""
        reaped: int | None = None
        async with anyio.create_task_group() as tg:

            async def wait_reaped() -> None:
                nonlocal reaped
                reaped = await self.wait()
                tg.cancel_scope.cancel()

            async def wait_reported() -> None:
                await self.link.exited.wait()
                tg.cancel_scope.cancel()

            tg.start_soon(wait_reaped)
            tg.start_soon(wait_reported)
        if reaped is not None:
            return reaped, False
        assert self.link.exit_code is not None  # set before the event
        return self.link.exit_code, True

    async def wait_output_handled(self) -> None:
        """Wait until what the worker wrote so far has been handled by its pumps."""
        for stream in (self.stdout, self.stderr):
            await stream.wait_handled(stream.handled_so_far + stream.pending())

    def close(self) -> None:
        """Close the pipes and the pidfd (after the process is reaped and its pumps are done)."""
        self.stdout.close()
        self.stderr.close()
        if self._pidfd >= 0:
            fd, self._pidfd = self._pidfd, -1
            os.close(fd)


class Tracked:
    """One started worker as the supervisor tracks it: its process and files, and its life (:mod:`.lifecycle`), with
    the events the supervisor's tasks await, set as the life moves."""

    __slots__ = ("command", "drained", "drains", "ended", "life", "lifecycle", "log", "process", "pumping", "reaped",
                 "registered", "restart", "serving")  # fmt: skip

    def __init__(self, command: WorkerCommand, process: Child, log: WorkerLog) -> None:
        self.command = command  # this attempt's (a survivor of an in-process restart gets the next one's)
        self.process = process
        self.log = log  # this attempt's files (a survivor moves to the next attempt's)
        self.lifecycle = Lifecycle()
        self.restart: RestartChannel | None = None  # registered for in-process restarts
        self.registered = anyio.Event()
        self.ended = anyio.Event()  # the exit status is known
        self.reaped = anyio.Event()  # the leader is reaped (or given up): its group id is no longer its own
        self.drained = anyio.Event()  # both pumps are done
        self.drains = (anyio.CancelScope(shield=True), anyio.CancelScope(shield=True))
        self.pumping = len(self.drains)
        self.serving = anyio.CancelScope()  # its link's service
        # Its life's wait for its end: shielded, cancelled only when the kernel will not end it (unkillable).
        self.life = anyio.CancelScope(shield=True)

    def __repr__(self) -> str:
        return f"<worker local_rank={self.command.local_rank} pid={self.pid} {self.lifecycle!r}>"

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def local_rank(self) -> int:
        return self.command.local_rank

    @property
    def phase(self) -> Phase:
        return self.lifecycle.phase

    def on(self, event: Event, code: int | None = None, *, reported: bool = False) -> Phase:
        """Move its life by ``event`` (``code``: the exit an ending event says), and set the events that follow."""
        exit = None if code is None else Exit(code, reported, time.time())
        phase = self.lifecycle.on(event, exit)
        if self.lifecycle.ended:
            self.ended.set()
        if not self.lifecycle.alive:
            self.reaped.set()
        return phase

    @property
    def exit(self) -> Exit:
        exit = self.lifecycle.exit
        if exit is None:  # pragma: no cover - every worker has ended before outcomes are built
            raise RuntimeError(f"worker pid {self.pid} has not ended")
        return exit

    def running(self) -> bool:
        """Whether the leader is not reaped yet (its group id is still this worker's)."""
        return self.lifecycle.alive

    def handle(self) -> WorkerProcess:
        return WorkerProcess(self.command.local_rank, self.command.global_rank, self.pid)

    def to_exit(self) -> WorkerExit:
        exit = self.exit
        return WorkerExit(
            local_rank=self.command.local_rank,
            global_rank=self.command.global_rank,
            pid=self.pid,
            exitcode=exit.code,
            timestamp=exit.timestamp,
            stderr_tail=self.log.stderr_tail(),
        )

    def expire_drains(self) -> None:
        """The worker's groups are dead: its pumps may wait for end of file only :data:`DRAIN_LIMIT` more."""
        deadline = anyio.current_time() + DRAIN_LIMIT
        for scope in self.drains:
            scope.deadline = min(scope.deadline, deadline)

    def close(self) -> None:
        self.on(Event.CLOSE)
        self.serving.cancel()  # the link's service closes the link as it ends
        self.log.close()
        self.process.close()
        if self.restart is not None:
            self.restart.close()

    @property
    def survives(self) -> bool:
        """Whether it can go on into the next round in its process: registered, alive, free and not failing."""
        return self.restart is not None and self.lifecycle.survivable


async def failed_first(workers: Sequence[Tracked]) -> bool:
    """Whether one of ``workers`` had ended, with a failure, when a membership change came: that exit, not the peers'
    news (often the news of that very death: their collectives failed), is the attempt's end."""
    for worker in workers:
        if worker.process.exited():
            await worker.ended.wait()
            if worker.exit.code != 0:
                return True
    return False


class LogOf:
    """A worker's current log, for its pumps: a survivor's moves to each new attempt's files."""

    __slots__ = ("worker",)

    def __init__(self, worker: Tracked) -> None:
        self.worker = worker

    async def turn(self, std: Std) -> None:
        await self.worker.log.turn(std)

    def feed(self, std: Std, data: bytes) -> None:
        self.worker.log.feed(std, data)

    def finish(self, std: Std) -> None:
        self.worker.log.finish(std)
