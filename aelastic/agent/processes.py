"""Start and supervise one node's local workers; make sure none of them outlives the agent.

Theory of operation
-------------------
A :class:`Supervisor` (:func:`open_supervisor`) holds one node's worker processes for as long as the agent runs,
across attempts. :meth:`Supervisor.start` spawns a worker (outside any task group, so a spawn error surfaces as
itself) as the leader of a process group of its own (``start_new_session=True``), with stdout and stderr piped to
the agent and a link of its own (:mod:`aelastic.agent.link`), and registers it with the reaper. Then three things
run for it in the supervisor's task group: its *life* (``await`` its end: no polling), a pump per pipe
(:func:`aelastic.agent.logs.pump`) and its link's service. A worker ends in one of two ways: the kernel reaps it
(its pidfd), or it reports its exit status over its link before its interpreter's teardown (an uncaught exception:
the teardown of torch and its process groups takes about half a second). A reported worker *lingers*: the agent
moves on at once, and the worker's life lets the teardown run for up to ``grace`` before it kills the worker's group
and reaps it. :meth:`Supervisor.stop` stops the workers given (never a lingering one) the way trio's ``run_process``
stops a child: the stop signal to every worker's process group (``killpg``: also the groups whose leader already
exited, so a worker's own children die too), wait up to ``grace`` for the leaders, SIGKILL to every group, reap
every leader. A leader that dies of the stop signal on delivery (it neither catches, ignores nor blocks it:
``/proc``) has ended then, with that signal's status; it lingers too, while the kernel frees its memory (tens of
milliseconds for a training process), and the rest of its stop runs in the background. The pumps are shielded, so
what the workers wrote before dying reaches the logs; once the groups are dead the pipes reach end of file (a
descendant that left its group and still holds a pipe is cut off after :data:`DRAIN_LIMIT`). Closing the supervisor
stops every worker still running, under a shield, and waits for the lingering ones.

:meth:`Supervisor.run` is one attempt: start every worker, wait until all exited 0, or the first failed, or a
cancellation; stop the rest; return the outcome (or re-raise the cancellation). :func:`run_workers` is the same on
a supervisor of its own.

No orphans, even when the agent is SIGKILLed: every worker is exec'd with the parent-death signal, from the event
loop's thread, which the kernel ties it to (:mod:`aelastic.agent.spawn`: so workers are started with
``subprocess.Popen`` from that thread, their exits awaited through pidfds, no threads, no polling); every worker group
is registered with the reaper sidecar, which kills the groups still registered when the agent dies
(:mod:`aelastic.agent.reaper`); callable workers finish together (:mod:`aelastic.agent.finish`).

With ``--prewarm`` a worker may start as a standby interpreter (:mod:`aelastic.agent.prewarm`) instead: spawned
the same way (:func:`~aelastic.agent.spawn.parent.spawn_process`) and registered with the reaper before the
attempt, then handed the attempt's environment, fresh output streams and its link. From then on it is a worker like
the others.

This module is the supervision only: each of those features is a package of its own, a worker's phases are its
lifecycle's (:mod:`.lifecycle`), and the survivors of in-process restarts are :mod:`.survivors`'.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

import anyio
import anyio.abc
import anyio.lowlevel

from ..config.values import UNKILLABLE_TIMEOUT
from ..errors import ConfigurationError, ReaperError, UnkillableWorkerError
from .attempt import AttemptHooks, Interrupt, StopSignal
from .finish.parent import FinishLineServer
from .forward.parent import RunningWorkers
from .lifecycle import Event, Phase
from .link.parent import LinkService
from .logs import LogSpec, Std, WorkerLog, pump
from .procfs import dies_of, holds_device, process_state, wait_channel
from .reaper.parent import Reaper
from .shares import quietly
from .spawn.parent import (
    PipeReader,
    WorkerCommand,
    WorkerHook,
    signal_group,
)
from .started import DRAIN_LIMIT, Child, GroupOutcome, LogOf, Tracked, WorkerExit, failed_first
from .survivors import Survivors

if TYPE_CHECKING:
    from .prewarm.parent import Standbys  # imported by the launcher only with --prewarm

__all__ = [
    "GroupOutcome",
    "Supervisor",
    "WorkerExit",
    "open_supervisor",
    "run_workers",
]

logger = logging.getLogger(__name__)


def _unkillable(worker: Tracked, bound: float) -> str:
    state = process_state(worker.pid)
    where = wait_channel(worker.pid)
    return (
        f"worker local_rank {worker.local_rank} (rank {worker.command.global_rank}, pid {worker.pid}) outlived SIGKILL "
        f"for {bound:g} s (state {state or '?'}{', waiting in the kernel at ' + where if where else ''}): this node "
        f"cannot free it or what it holds; the agent leaves so that the node is replaced"
    )


class Supervisor:
    """One node's worker processes, across attempts; see the module doc. Open it with :func:`open_supervisor`."""

    def __init__(
        self,
        tg: anyio.abc.TaskGroup,
        *,
        grace: float,
        reaper: Reaper | None,
        standbys: Standbys | None,
        stop_signal: StopSignal | None,
        running: RunningWorkers | None,
        services: Mapping[str, LinkService],
        unkillable: float = UNKILLABLE_TIMEOUT,
    ) -> None:
        if grace < 0:
            raise ConfigurationError(f"grace {grace}: must be >= 0 seconds")
        self._tg = tg
        self.grace = grace
        self.unkillable = unkillable  # how long a SIGKILLed worker may live on before the node is given up
        self.reaper = reaper
        self.standbys = standbys
        self.stop_signal = stop_signal
        self.running = running
        self._workers: list[Tracked] = []  # every worker not closed yet
        self.survivors = Survivors(self._find, self.stop)  # in-process restarts: the supervisor's own link service
        self.services = {**services, self.survivors.name: self.survivors}

    def __repr__(self) -> str:
        return f"<Supervisor workers={self._workers} grace={self.grace:g}>"

    @property
    def requested(self) -> signal.Signals:
        """The signal a cancelled run stops the workers with."""
        return signal.SIGTERM if self.stop_signal is None else self.stop_signal.signum

    async def start(self, command: WorkerCommand, logs: LogSpec, finish: FinishLineServer | None = None) -> Tracked:
        """Start one worker and supervise it (see the module doc); a spawn error propagates."""
        log = WorkerLog(logs, command.local_rank, command.global_rank)
        try:
            await anyio.lowlevel.checkpoint()
            process = await Child.start(command, log, finish, self.standbys)
        except BaseException:
            log.close()
            raise
        worker = Tracked(command, process, log)
        self._workers.append(worker)
        if self.running is not None:
            self.running.add(process.pid, worker.running)
        for std, stream, scope in ((Std.OUT, process.stdout, worker.drains[0]), (Std.ERR, process.stderr,
                                                                                  worker.drains[1])):  # fmt: skip
            self._tg.start_soon(self._pump, worker, stream, std, scope)
        self._tg.start_soon(self._serve, worker)
        self._tg.start_soon(self._life, worker)
        if self.reaper is not None:
            try:
                await self.reaper.register(process.pid)
            except BaseException:
                await self.stop([worker], signal.SIGKILL)
                raise
        logger.debug("started worker local_rank %d (pid %d)", command.local_rank, process.pid)
        return worker

    async def _pump(self, worker: Tracked, stream: PipeReader, std: Std, scope: anyio.CancelScope) -> None:
        try:
            with scope:
                await pump(stream, LogOf(worker), std, stream.handled)
        finally:
            worker.pumping -= 1
            if not worker.pumping:
                worker.drained.set()

    async def _serve(self, worker: Tracked) -> None:
        link = worker.process.link
        try:
            with worker.serving:
                await link.serve(worker.handle, self.services)
        finally:
            link.close()

    async def _life(self, worker: Tracked) -> None:
        """Await the worker's end; a reported one lingers here (its teardown, then kill and reap), under a shield:
        every worker the supervisor started is reaped before it closes (or given up: :meth:`_abandon`)."""
        with worker.life:
            code, reported = await worker.process.wait_end()
            phase = worker.on(Event.REPORT if reported else Event.EXIT, code, reported=reported)
            if not reported:
                return
            if phase is not Phase.LINGERING:  # reported while a stop ends it: the stop kills, unregisters, closes it
                worker.on(Event.EXIT, await worker.process.wait())
                return
            if self.running is not None:
                self.running.discard(worker.pid)  # ended, as far as signals forwarded to workers go
            with anyio.move_on_after(self.grace) as waited:
                await quietly(worker.pid, worker.process.wait)
                await worker.process.wait()
            if waited.cancelled_caught:
                logger.warning(
                    "worker local_rank %d (pid %d) reported exit %d but its teardown did not end within %.1f s: "
                    "sending SIGKILL", worker.command.local_rank, worker.pid, code, self.grace,
                )  # fmt: skip
            signal_group(worker.pid, signal.SIGKILL)  # its group's leftovers too, as a stop does
            with anyio.move_on_after(self.unkillable) as killed:
                reaped = await worker.process.wait()
            if killed.cancelled_caught:
                self._abandon(worker)
                raise UnkillableWorkerError(_unkillable(worker, self.unkillable))
            worker.on(Event.EXIT, reaped)
            await self._unregister([worker])
            worker.expire_drains()
            await worker.drained.wait()
            self._close(worker)

    async def stop(
        self, workers: Sequence[Tracked], signum: signal.Signals, before_kill: WorkerHook | None = None
    ) -> None:
        """``signum`` to every group of ``workers`` (but lingering ones), wait up to ``grace`` for the leaders,
        ``before_kill`` the survivors, KILL every group, reap, wait for their output, close them; those whose
        leader dies of ``signum`` on delivery, in the background. Shielded."""
        targets = [w for w in workers if w.lifecycle.free]
        for worker in targets:
            worker.on(Event.STOP)
        if not targets:
            return
        with anyio.CancelScope(shield=True):
            # One that dies of the signal on delivery (it has no handler of its own: none of its code runs any more)
            # has ended: the kernel's teardown of its memory, tens of milliseconds for a training process, is
            # nobody's wait. The rest of its stop goes on in the background, as a lingering worker's does.
            doomed = [w for w in targets if w.running() and dies_of(w.pid, signum)]
            for worker in targets:
                signal_group(worker.pid, signum)
            for worker in doomed:
                worker.on(Event.DOOMED, -signum)
                self._tg.start_soon(self._end, [worker], signum, None, True)
            await self._end([w for w in targets if w not in doomed], signum, before_kill)

    async def _end(
        self, targets: Sequence[Tracked], signum: signal.Signals, before_kill: WorkerHook | None, quiet: bool = False
    ) -> None:
        """The rest of a stop, once ``targets`` are signalled (``quiet``: they linger); shielded."""
        if not targets:
            return
        with anyio.CancelScope(shield=True):
            with anyio.move_on_after(self.grace) as waited:
                for worker in targets:
                    if quiet:
                        await quietly(worker.pid, worker.reaped.wait)
                    await worker.reaped.wait()
            if waited.cancelled_caught:
                survivors = [w for w in targets if w.running()]
                logger.warning(
                    "workers %s did not exit within %.1f s of %s: sending SIGKILL",
                    [w.command.local_rank for w in survivors], self.grace, signum.name,
                )  # fmt: skip
                if before_kill is not None and survivors:
                    try:
                        await before_kill([w.handle() for w in survivors])
                    except Exception:  # the kill must happen whatever the hook did
                        logger.exception("before_kill hook failed; killing workers %s",
                                         [w.command.local_rank for w in survivors])  # fmt: skip
            for worker in targets:
                signal_group(worker.pid, signal.SIGKILL)
            with anyio.move_on_after(self.unkillable):
                for worker in targets:
                    await worker.reaped.wait()
            stuck = [w for w in targets if not w.reaped.is_set()]
            for worker in stuck:
                self._abandon(worker)
            targets = [w for w in targets if w not in stuck]
            await self._unregister(targets)
            for worker in targets:
                worker.expire_drains()
            for worker in targets:
                await worker.drained.wait()
                self._close(worker)
            if stuck:
                raise UnkillableWorkerError("; ".join(_unkillable(w, self.unkillable) for w in stuck))

    def kill(self, pid: int) -> None:
        """SIGKILL worker ``pid``'s group now (a hang's verdict); it then ends as a failed worker, or, if it outlives
        the kill by ``unkillable`` seconds, the supervisor fails with :class:`UnkillableWorkerError`."""
        worker = next((w for w in self._workers if w.pid == pid and w.running()), None)
        if worker is None:
            return
        signal_group(pid, signal.SIGKILL)
        self._tg.start_soon(self._outlives, worker)

    async def _outlives(self, worker: Tracked) -> None:
        with anyio.move_on_after(self.unkillable):
            await worker.ended.wait()
            return
        if not worker.ended.is_set():
            self._abandon(worker)
            raise UnkillableWorkerError(_unkillable(worker, self.unkillable))

    def _abandon(self, worker: Tracked) -> None:
        """Give up on a worker the kernel does not end (uninterruptible sleep): nothing waits for it any more, and
        it leaves the supervisor's books (the reaper still kills its group when the agent exits)."""
        worker.on(Event.ABANDON, -signal.SIGKILL)
        worker.life.cancel()
        worker.expire_drains()
        if self.running is not None:
            self.running.discard(worker.pid)
        self._close(worker)

    def _find(self, pid: int) -> Tracked | None:
        return next((w for w in self._workers if w.pid == pid), None)

    async def release(self) -> None:
        """Stop the survivors kept for an attempt that will not come (the job ends)."""
        await self.survivors.release()

    async def _wait_devices_released(self) -> None:
        """Wait for the lingering workers (reported, or dying of a stop's signal) that hold a GPU (their teardown
        frees its memory, which the next attempt's workers will want) to end; the others tear down beside the next
        attempt."""
        for worker in list(self._workers):
            if worker.ended.is_set() and worker.running() and holds_device(worker.pid):
                await worker.reaped.wait()  # at most the grace: then it is killed
        await anyio.lowlevel.checkpoint()

    async def _unregister(self, workers: Sequence[Tracked]) -> None:
        for worker in workers:
            if self.running is not None:
                self.running.discard(worker.pid)
            if self.reaper is not None:
                try:
                    await self.reaper.unregister(worker.pid)
                except ReaperError as exc:
                    logger.warning("%s", exc)

    def _close(self, worker: Tracked) -> None:
        """Close ``worker`` and take it off the books, once: a stop closes those it reaped, but one of them may have
        been abandoned (off the books already) while the stop waited."""
        if worker in self._workers:
            worker.close()
            self._workers.remove(worker)

    async def aclose(self) -> None:
        """Stop every worker still running (the requested signal) and wait for the lingering ones."""
        with anyio.CancelScope(shield=True):
            await self.stop(list(self._workers), self.requested)
            while self._workers:  # lingering: each closes itself within grace + the drain limit
                await self._workers[0].drained.wait()
                await anyio.lowlevel.checkpoint()

    async def run(
        self,
        commands: Sequence[WorkerCommand],
        logs: LogSpec,
        *,
        hooks: AttemptHooks | None = None,
        finish_together: bool = False,
        refill_after: float = 0.0,
        keep_on_failure: bool = False,
        interrupt: Interrupt | None = None,
    ) -> GroupOutcome:
        """One attempt: the parameters and the result of :func:`run_workers` (which see), with three more:

        Args:
            refill_after: the seconds the workers run before the next attempt's standbys start (a restart's
                workers start up, load their state and allocate their memory, the costliest moments of a
                recovery, without them).
            keep_on_failure: a worker's failure ends the attempt and another follows (a failure restart is left):
                the workers that registered for in-process restarts are aborted and kept for it instead of
                stopped (:mod:`aelastic.agent.restart`); the others are stopped.
            interrupt: once set (a membership change), the attempt ends: the restartable workers are aborted and
                kept for the next one, the others stopped (see :class:`Interrupt`).

        A local rank that has a survivor kept from the previous attempt is given this attempt in its process
        instead of a new worker. The outcome's exits are those of the workers that ended; survivors are not in it.
        """
        hooks = AttemptHooks() if hooks is None else hooks
        local_ranks = [c.local_rank for c in commands]
        if len(set(local_ranks)) != len(local_ranks):
            raise ConfigurationError(f"local ranks {local_ranks}: each local rank must appear once")
        await self._wait_devices_released()
        logs.prepare_attempt_dir(local_ranks)
        workers: list[Tracked] = []
        finish = FinishLineServer(local_ranks) if finish_together else None
        kept = self.survivors.take()
        try:
            try:
                await self._start_attempt(commands, logs, finish, kept, workers)
                if finish is not None:
                    finish.spawned()
                if hooks.started is not None:
                    hooks.started([w.handle() for w in workers])
            except BaseException:
                await self.stop([*workers, *kept.values()], self.requested, hooks.before_kill)
                raise
            await self.stop(list(kept.values()), signal.SIGTERM)  # survivors of local ranks this attempt lacks
            keep = keep_on_failure and finish is None
            first_failure = await self._until_end(workers, finish, hooks, refill_after, keep, interrupt)
            return await self._outcome(workers, first_failure)
        finally:
            if finish is not None:
                finish.close()

    async def _start_attempt(
        self,
        commands: Sequence[WorkerCommand],
        logs: LogSpec,
        finish: FinishLineServer | None,
        kept: dict[int, Tracked],
        workers: list[Tracked],
    ) -> None:
        """Start the attempt's workers into ``workers`` (the caller's, which stops them if this raises), in command
        order: a survivor in ``kept`` is given its local rank's command (taken out of ``kept``), else a worker
        starts."""
        # New workers first: a survivor lets go of its round when its thread next runs Python (a gloo collective
        # holds it until it returns), and a replacement's start-up (the script's imports, its state's memory) needs
        # no survivor.
        survive = set(kept) if finish is None else set()
        for command in [c for c in commands if c.local_rank not in survive]:
            survivor = kept.pop(command.local_rank, None)
            if survivor is not None:  # finishing together: no survivor runs on
                await self.stop([survivor], signal.SIGTERM)
            workers.append(await self.start(command, logs, finish))
        for command in [c for c in commands if c.local_rank in survive]:
            survivor = kept.pop(command.local_rank)
            if await self.survivors.reassign(survivor, command, logs):
                workers.append(survivor)
            else:
                workers.append(await self.start(command, logs, finish))
        order = [c.local_rank for c in commands]
        workers.sort(key=lambda w: order.index(w.command.local_rank))

    async def _outcome(self, workers: Sequence[Tracked], first_failure: Tracked | None) -> GroupOutcome:
        """The exits of the workers that ended (the others are kept for the next attempt), their output handled."""
        for worker in workers:
            # A reported worker's traceback, written before its report, belongs in its stderr tail.
            if worker.ended.is_set() and worker.exit.reported:
                with anyio.move_on_after(DRAIN_LIMIT):
                    await worker.process.wait_output_handled()
        ended = [w for w in workers if w.ended.is_set()]
        exits = tuple(w.to_exit() for w in ended)
        first = None if first_failure is None else exits[ended.index(first_failure)]
        return GroupOutcome(exits=exits, first_failure=first)

    async def _refill(
        self, commands: Sequence[WorkerCommand], delay: float, restored: Callable[[], Awaitable[None]] | None
    ) -> None:
        """The next attempt's standbys, ``delay`` seconds into this one; one sooner when none is idle (faults in a
        burst: an attempt shorter than the delay would otherwise leave the next replacement none, and it would
        start cold, on the recovery's path, at the CPU's full price): once ``restored`` returns, at once without it."""
        assert self.standbys is not None
        began = anyio.current_time()
        if delay and not self.standbys.statistics().idle:
            if restored is not None:  # quiet or not, a standby takes a CPU while the restorers wait on each other
                with anyio.move_on_after(delay):
                    await restored()
            await self.standbys.refill(commands[:1], quiet=True)  # quiet until the settle
        await anyio.sleep_until(began + delay)
        self.standbys.settled()
        await self.standbys.refill(commands)

    async def _until_end(
        self,
        workers: list[Tracked],
        finish: FinishLineServer | None,
        hooks: AttemptHooks,
        refill_after: float,
        keep_on_failure: bool,
        interrupt: Interrupt | None,
    ) -> Tracked | None:
        """Until every worker ended, one failed, ``interrupt`` is set or this is cancelled; then the workers are
        stopped, or kept (see :meth:`run`). Returns the first failure."""
        first_failure: list[Tracked] = []
        ending = anyio.Event()  # a failure or an interrupt ends the attempt: a victim's report is a survivor's

        async def wait_worker(worker: Tracked, waiters: anyio.CancelScope) -> None:
            await worker.ended.wait()
            if finish is not None:
                finish.finished(worker.command.local_rank)
            if worker.exit.code != 0 and not first_failure:
                first_failure.append(worker)
                ending.set()
                how = "reported exit" if worker.exit.reported else "exited with"
                logger.info("worker local_rank %d (pid %d) %s %d: ending the attempt", worker.local_rank, worker.pid,
                            how, worker.exit.code)  # fmt: skip
                waiters.cancel()

        async def wait_interrupt(event: anyio.Event, waiters: anyio.CancelScope) -> None:
            await event.wait()
            if not await failed_first(workers):  # else that worker's waiter ends the attempt, as a failure
                ending.set()
                waiters.cancel()

        try:
            async with anyio.create_task_group() as waiters:
                if hooks.watch is not None:
                    waiters.start_soon(hooks.watch, [w.handle() for w in workers])
                if finish is not None:
                    waiters.start_soon(finish.serve)
                if self.standbys is not None:  # the next attempt's, preloading while these run
                    waiters.start_soon(self._refill, [w.command for w in workers], refill_after, hooks.restored)
                if interrupt is not None:
                    waiters.start_soon(wait_interrupt, interrupt.event, waiters.cancel_scope)
                for worker in workers:
                    waiters.start_soon(self.survivors.judge, worker, ending)
                async with anyio.create_task_group() as exits:
                    for worker in workers:
                        exits.start_soon(wait_worker, worker, waiters.cancel_scope)
                waiters.cancel_scope.cancel()  # every worker exited: the watch ends too
        finally:
            interrupted = interrupt is not None and interrupt.event.is_set() and not first_failure
            if (first_failure and keep_on_failure) or interrupted:
                reason = "a membership change" if interrupted else f"local rank {first_failure[0].local_rank} failed"
                lost = interrupted and interrupt is not None and interrupt.peers_lost
                self.survivors.keep([w for w in workers if w.survives], reason, lost=lost)
            # A peer's failure stops the others with SIGTERM (torch does); a cancellation with what was asked.
            signum = signal.SIGTERM if first_failure or interrupted else self.requested
            await self.stop([w for w in workers if not self.survivors.holds(w)], signum, hooks.before_kill)
        return first_failure[0] if first_failure else None


@asynccontextmanager
async def open_supervisor(
    *,
    grace: float,
    reaper: Reaper | None,
    standbys: Standbys | None = None,
    stop_signal: StopSignal | None = None,
    running: RunningWorkers | None = None,
    services: Mapping[str, LinkService] | None = None,
    unkillable: float = UNKILLABLE_TIMEOUT,
) -> AsyncIterator[Supervisor]:
    """A :class:`Supervisor` for the body's length; on exit every worker still running is stopped (with
    ``stop_signal``, SIGTERM by default) and every lingering one waited for, under a shield.

    Args: as :func:`run_workers`'s; ``services``: what the workers may ask over their links, by service name;
    ``unkillable``: the seconds a worker may outlive SIGKILL before :class:`UnkillableWorkerError` ends supervision.
    """
    async with anyio.create_task_group() as tg:
        supervisor = Supervisor(tg, grace=grace, reaper=reaper, standbys=standbys, stop_signal=stop_signal,
                                running=running, services=services or {}, unkillable=unkillable)  # fmt: skip
        try:
            yield supervisor
        finally:
            await supervisor.aclose()


async def run_workers(
    commands: Sequence[WorkerCommand],
    logs: LogSpec,
    *,
    grace: float,
    reaper: Reaper | None,
    finish_together: bool = False,
    hooks: AttemptHooks | None = None,
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
        hooks: what the agent's features ask of the attempt (:class:`AttemptHooks`).
        standbys: pre-warmed interpreters (:mod:`aelastic.agent.prewarm`): each worker that has a fitting one is
            handed to it instead of spawned, and beside the running workers the next attempt's are started.
        stop_signal: what stops the workers when this call is cancelled; ``None`` is SIGTERM.
        running: where the workers' process groups are tracked while they run, for signals forwarded to them
            (:mod:`aelastic.agent.forward`): each is added once spawned, discarded once reaped.

    Returns:
        Every worker's exit, in command order. Workers stopped by the agent after the first failure are reported
        with their signal exit codes (``-15``, or ``-9`` when SIGKILL was needed), as torch does. A worker that
        reported its failure before its teardown has the status it reported; this call returns once its teardown
        is over (a :class:`Supervisor` that outlives the attempt returns at once).

    On cancellation every worker is stopped the same way (the signal in ``stop_signal``, SIGTERM by default;
    ``grace``; KILL; reap), under a shield, its output drained into the logs, and then the cancellation
    propagates. A worker that cannot be executed is a worker that exits 127; an error spawning the wrapper itself
    (out of processes, file descriptors) stops the workers already started and propagates.
    """
    async with open_supervisor(
        grace=grace, reaper=reaper, standbys=standbys, stop_signal=stop_signal, running=running
    ) as supervisor:
        return await supervisor.run(commands, logs, hooks=hooks, finish_together=finish_together)
