"""The elastic agent: rendezvous, start the local workers, watch them, restart on failure or membership change.

Theory of operation
-------------------
One attempt is one task group holding two things: the workers (:func:`~aelastic.agent.processes.run_workers`,
which returns at the first failure or when all succeeded) and a watcher blocked in the rendezvous handler's
``wait_for_membership_change`` (a node waiting to join, a member found dead, the rendezvous closed). Whichever
finishes first decides, and the other is cancelled; cancelling the workers stops them (TERM, grace, KILL) before
the group exits. Nothing polls.

What follows an attempt is the policy's (:func:`~aelastic.agent.policy.decide`, a pure function of the attempt's
outcome and the restart budget): all workers succeeded, then an exit barrier through the round store; a worker
failed, then a failure restart while ``max_restarts`` allows (the node leaves the round, so every other node sees a
member leave and restarts too, without spending its own failure budget); a membership change, then a membership
restart, which never spends the failure budget; the rendezvous closed by another node (its job ended), then the
workers stop and :class:`~aelastic.errors.RendezvousClosedError` says so. Either restart re-rendezvouses, and the
new round gets a fresh workers' store. ``TORCHELASTIC_RESTART_COUNT`` counts failure restarts, as torch defines
it; ``AELASTIC_MEMBERSHIP_RESTARTS`` counts the others. Every state change (the group's state, the metrics,
torch's status events, the log line that says what the agent does) is recorded in one place,
:class:`~aelastic.agent.recorder.Recorder`.

:meth:`ElasticAgent.shutdown` closes the rendezvous when the run is over; after a success the nodes then meet at
one more barrier, so the node serving the rendezvous store does not exit while another still needs it to close.
Both barriers wait for the round's *live* members: each node marks its rank's key and waits for the keys of the
ranks still members; a node found dead meanwhile (liveness keeps running) is no longer waited for, so the others
do not sit out ``exit_barrier_timeout`` for a node that will never come. (torch's store barrier counts to the
world size and waits out its timeout.) A node found dead *after* it arrived in the exit barrier is no membership
change for the nodes whose workers still run: its work was done, so they finish and meet the others there.
"""

from __future__ import annotations

import functools
import logging
import os
import signal
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path
from string import Template
from typing import TYPE_CHECKING, Any, NoReturn

import anyio

from .._devices import visible_devices
from ..errors import RendezvousClosedError, StoreConnectionError
from ..rendezvous.api import RendezvousHandler, RendezvousInfo
from ..worker._timers import FILE_ENV, WATCHDOG_ENV
from .attempt import AttemptHooks, Interrupt
from .barrier import members_barrier
from .errors import ChildFailedError, FailedElsewhereError, ProcessFailure
from .figures import AgentMetrics
from .hang.parent import HangWatch, flight_recorder_env
from .link.parent import LinkService
from .logs import LogSpec
from .logs_specs import reify
from .options import AgentOptions, Features
from .policy import Action, Budget, Decision, FailureMark, Outcome, decide
from .processes import GroupOutcome, Supervisor, open_supervisor
from .ranks import RankAssignment, RoleInfo, exchange_ranks
from .recorder import Recorder
from .rootcause import FailureRecord, JobFailures, as_reported, error_line, first_cause, kind_of, with_cause
from .spawn.parent import WorkerCommand, WorkerProcess
from .stacks.parent import StackDumper
from .timers.parent import ENABLE_ENV, Expiry, FileTimerServer, signal_name
from .workers import RunResult, Worker, WorkerGroup, WorkerSpec, WorkerState

if TYPE_CHECKING:
    from .prewarm.parent import Standbys  # imported by the launcher only with --prewarm

__all__ = ["ElasticAgent"]

logger = logging.getLogger(__name__)

_TERMINAL = "torchelastic/agent/terminal_state"  # the exit barrier's keys in the round store, as torch names them
# After a restart, the next attempt's standbys start this many seconds after the workers, which have the CPUs to
# themselves for their start-up and restore: standbys importing torch slow a restore even at idle priority, which
# weighs only within a session where the kernel groups sessions (so one started at once, for a burst of faults, has
# its session's share lowered).
_RESTART_SETTLE = 3.0
_CAUSE_WAIT = 5.0  # seconds a node ending the job waits for the others' failures, to name the same root cause
_STOPPED = (signal.SIGTERM, signal.SIGKILL)  # the signals that stop a worker that did not fail itself
_FINAL = (Action.STOP_FAILED, Action.STOP_CLOSED, Action.STOP_NO_PROGRESS)  # the decisions that end the run


class ElasticAgent:
    """Runs one node's share of the job; see the module docstring."""

    def __init__(
        self,
        spec: WorkerSpec,
        handler: RendezvousHandler,
        logs: LogSpec,
        *,
        run_dir: Path,
        options: AgentOptions | None = None,
        features: Features | None = None,
        base_env: Mapping[str, str] | None = None,
    ) -> None:
        self.spec = spec
        self.handler = handler
        self.logs = logs
        self.run_dir = run_dir
        self.options = options = AgentOptions() if options is None else options
        self.features = features = Features() if features is None else features
        self.base_env = dict(os.environ if base_env is None else base_env)
        checkpoints, standbys = features.checkpoints, features.standbys
        if checkpoints is not None and standbys is not None:  # a replacement's state lands in warm memory
            checkpoints.tell(standbys.warm, standbys.map_slots)
        # torch's rule: the timer server runs when its variable is exactly "1"; aelastic's watchdog needs it too.
        self.timer_file: Path | None = None
        if self.base_env.get(ENABLE_ENV) == "1" or options.timeouts.watchdog is not None:
            self.timer_file = Path(self.base_env.get(FILE_ENV) or run_dir / "watchdog_timer")
        self.group = WorkerGroup(spec)
        metrics = AgentMetrics(spec.role, spec.max_restarts)
        self.recorder = Recorder(spec, handler, self.group, metrics, options.restarts.max_repeated_failures,
                                 handed_off=None if standbys is None else lambda: standbys.handed_off)  # fmt: skip
        incidents = self.recorder.incidents
        # What the workers may ask over their links (aelastic.agent.link).
        self.services: dict[str, LinkService] = {incidents.name: incidents}
        if checkpoints is not None:
            self.services[checkpoints.name], checkpoints.progress = checkpoints, incidents
        self._attempt = 0
        self._finished: RendezvousInfo | None = None  # the round in which every node's workers succeeded
        self._dumper: StackDumper | None = None  # the last attempt's: its notes go into the failure report
        self._stopped: GroupOutcome | None = None  # the last attempt's workers, when a membership change ended it

    def __repr__(self) -> str:
        g, budget = self.group, self.budget
        return (
            f"<ElasticAgent role={self.spec.role!r} state={g.state.value} round={g.round} "
            f"group_rank={g.group_rank}/{g.group_world_size} failure_restarts={budget.failure_restarts} "
            f"membership_restarts={budget.membership_restarts}>"
        )

    @property
    def metrics(self) -> AgentMetrics:
        """The figures behind ``/metrics`` and ``/health`` (:mod:`aelastic.metrics`)."""
        return self.recorder.metrics

    @property
    def budget(self) -> Budget:
        """The restarts spent so far (:mod:`~aelastic.agent.policy`)."""
        return self.recorder.budget

    async def run(self) -> RunResult:
        """Run until the workers succeed everywhere, or fail with no restarts left.

        Cancellation stops the workers (TERM, grace, KILL) before it propagates. A worker that reported its failure
        before its teardown (:mod:`aelastic.agent.link`) is waited for, at most ``shutdown_timeout``, before this
        returns; the next attempt does not wait for it.
        """
        async with open_supervisor(
            grace=self.options.shutdown,
            reaper=self.features.reaper,
            standbys=self.features.standbys,
            stop_signal=self.features.stop_signal,
            running=self.features.running,
            services=self.services,
            unkillable=self.options.timeouts.unkillable,
        ) as supervisor:
            if self.features.standbys is not None:
                await self._prewarm(self.features.standbys)
            while True:
                self.recorder.init()
                began = anyio.current_time()
                info = await self.handler.next_rendezvous()
                self.recorder.rendezvous_done(anyio.current_time() - began, info)
                await self.recorder.incidents.publish()  # one that ended with the last attempt's start
                check = self.features.node_check
                if check is not None and not await check.admit(info, self.handler):
                    continue  # a member was left out, or the membership changed: the next round, no attempt
                assignment = await self._assign(info)
                workers, reason = await self._attempt_once(supervisor, info, assignment)
                self.recorder.attempt_ended(workers)
                outcome = await self._outcome(workers)
                if outcome is Outcome.FAILED and self.options.restarts.scope == "job":
                    await self._job_budget(info)  # another node's failure may have spent it
                decision = decide(outcome, self.budget, self._failure_mark(workers))
                job: list[FailureRecord] = []
                if decision.action in _FINAL:  # every node names the same cause
                    job = await self._job_failures(info, workers or self._stopped)
                if decision.action is Action.RESTART_FAILURE and self.options.restarts.scope == "job":
                    await self._count_job_restart(info)
                self.recorder.decided(decision, workers, reason, functools.partial(self._attempt_report, workers))
                if decision.action not in (Action.RESTART_FAILURE, Action.RESTART_MEMBERSHIP):
                    await supervisor.release()  # survivors kept for a round that will not come
                if decision.action is Action.SUCCEED:
                    await self._exit_barrier(info)
                    await self._persist_checkpoints("the end")
                    self._finished = info
                    return self._finish(WorkerState.SUCCEEDED, workers)
                if decision.action in (Action.STOP_FAILED, Action.STOP_NO_PROGRESS):
                    await self._persist_checkpoints("the end")
                    return self._finish(WorkerState.FAILED, workers, first_cause(job), self._no_progress(decision))
                if decision.action is Action.RESTART_FAILURE and self.features.checkpoints is not None:
                    self.features.checkpoints.persist("a worker failed", after_next_save=True)  # after the restart
                if decision.action is Action.STOP_CLOSED:
                    self._closed(first_cause(job))
                self._attempt += 1

    async def _persist_checkpoints(self, reason: str) -> None:
        """Write the latest in-memory checkpoints to ``--checkpoint-dir`` and wait, at most ``exit_barrier_timeout``."""
        if self.features.checkpoints is not None and self.features.checkpoints.directory is not None:
            with anyio.move_on_after(self.options.timeouts.exit_barrier) as scope:
                await self.features.checkpoints.flush(reason)
            if scope.cancelled_caught:
                logger.warning("[%s] checkpoints: not every one was written to %s within %g s", self.spec.role,
                               self.features.checkpoints.directory, self.options.timeouts.exit_barrier)  # fmt: skip

    def _failure_mark(self, outcome: GroupOutcome | None) -> FailureMark | None:
        """How a failed attempt failed (for ``--max-repeated-failures``): its first failure's rank and error line,
        the last step this node's workers checkpointed, and the seconds since the attempt started."""
        first = None if outcome is None else outcome.first_failure
        if outcome is None or first is None:
            return None
        failure = self._failures(outcome)[first.global_rank]
        own = {} if self.features.checkpoints is None else self.features.checkpoints.statistics().own
        step = max((step for steps in own.values() for step in steps), default=None)
        seconds = anyio.current_time() - self.recorder.attempt_started  # the attempt's length, to its end's news
        return FailureMark(first.global_rank, error_line(failure), step, seconds)

    def _no_progress(self, decision: Decision) -> str | None:
        """Why the run stopped for lack of progress (``None``: it did not)."""
        mark = decision.budget.last_failure
        if decision.action is not Action.STOP_NO_PROGRESS or mark is None:
            return None
        when = f"at step {mark.step}" if mark.step is not None else f"{mark.seconds:.0f} s into each attempt"
        return (
            f"the last {decision.budget.repeated} attempts failed the same way (rank {mark.rank}: {mark.error}, "
            f"{when}); stopped with restarts left (--max-repeated-failures {decision.budget.max_repeated}): "
            "requeueing the job would fail again"
        )

    async def _job_budget(self, info: RendezvousInfo) -> None:
        """The job's failure restarts so far become this node's (``--max-restarts-scope job``: one budget for the
        job)."""
        if info.job_store is None:
            return
        spent = min(await info.job_store.add("restarts", 0), self.spec.max_restarts)
        self.recorder.budget = replace(self.budget, failure_restarts=max(spent, 0))

    async def _count_job_restart(self, info: RendezvousInfo) -> None:
        """Count this round's failure restart of the job, once whichever nodes failed in it."""
        if info.job_store is None:
            return
        mine = str(info.rank).encode()
        if await info.job_store.compare_set(f"restart/{info.round}", b"", mine) == mine:
            await info.job_store.add("restarts", 1)

    async def _job_failures(self, info: RendezvousInfo, outcome: GroupOutcome | None) -> list[FailureRecord]:
        """Publish this node's failures of the attempt to the job, and read every node's (:mod:`.rootcause`)."""
        job = JobFailures(info.store, info.rank, info.world_size)
        local = []
        if outcome is not None:
            first = outcome.first_failure
            for exit, failure in zip(outcome.failures, self._failures(outcome).values(), strict=True):
                local.append((failure, kind_of(failure, stopped=exit != first and -exit.exitcode in _STOPPED)))
        await job.publish(local)
        return await job.collect(_CAUSE_WAIT)

    def _closed(self, cause: FailureRecord | None) -> NoReturn:
        """The rendezvous was closed by another node: the job's failure there, as a report, if it is known."""
        message = (
            f"rendezvous {self.handler.get_run_id()!r} was closed by another node while this node's workers ran (its "
            "job ended: a worker failed with no restarts left, or it was stopped); this node's workers were stopped"
        )
        if cause is None:
            raise RendezvousClosedError(message)
        logger.error("[%s] %s; the job's root cause: %s", self.spec.role, message, cause.describe())
        stopped = {} if self._stopped is None else self._failures(self._stopped)
        failures = {cause.failure.global_rank: as_reported(cause)}
        failures |= {rank: with_cause(f, "stopped", cause) for rank, f in stopped.items()}
        raise FailedElsewhereError(self.spec.get_entrypoint_name(), failures, root_rank=cause.failure.global_rank)

    async def _outcome(self, workers: GroupOutcome | None) -> Outcome:
        """The policy's name for how an attempt ended; ``workers`` is ``None`` when the watcher ended it."""
        if workers is None:
            return Outcome.CLOSED if await self.handler.is_closed() else Outcome.MEMBERSHIP_CHANGED
        return Outcome.SUCCEEDED if workers.succeeded else Outcome.FAILED

    def _finish(
        self,
        state: WorkerState,
        workers: GroupOutcome | None,
        cause: FailureRecord | None = None,
        no_progress: str | None = None,
    ) -> RunResult:
        """The run's result, recorded as torch's SUCCEEDED or FAILED agent event; ``cause``: the job's root cause,
        which the result's failure report names (on this node or another); ``no_progress``: why it stopped early."""
        result = replace(self._result(state, workers, cause), no_progress=no_progress)
        self.recorder.finished(state, cause)
        return result

    async def _prewarm(self, standbys: Standbys) -> None:
        """Start the first attempt's standbys before its rendezvous, so they preload while it runs."""
        logs = replace(self.logs, attempt=self._attempt)
        size = self.spec.local_world_size
        # Ranks and sizes are per-attempt variables (standby.PER_ATTEMPT): any value will do here.
        workers = [Worker(i, i, i, size, size) for i in range(size)]
        commands = [self._command(worker, self._environment(worker, logs)) for worker in workers]
        await standbys.refill(commands, beside_workers=False)

    async def _assign(self, info: RendezvousInfo) -> RankAssignment:
        me = RoleInfo(self.spec.role, info.rank, self.spec.local_world_size)
        keeper = self.features.checkpoints
        if keeper is None:
            assignment = await exchange_ranks(info.store, me, info.world_size, identical=self.options.identical_workers)
        else:
            await keeper.serve_replicas(self.handler.local_addr if info.world_size > 1 else None)
            assignment = await exchange_ranks(
                info.store, me, info.world_size, keeper.inventory(), keeper.disk_inventory
            )
            if assignment.restore is not None:
                keeper.adopt(assignment.restore, assignment.global_world_size, info.store)
        g = self.group
        g.group_rank, g.group_world_size, g.round = info.rank, info.world_size, info.round
        g.master_addr = self.spec.master_addr or info.bootstrap_store_info.master_addr
        g.master_port = self.spec.master_port or info.bootstrap_store_info.master_port
        g.workers = [
            Worker(
                local_rank=i,
                global_rank=assignment.base_global_rank + i,
                role_rank=assignment.base_role_rank + i,
                world_size=assignment.global_world_size,
                role_world_size=assignment.role_world_size,
            )
            for i in range(self.spec.local_world_size)
        ]
        return assignment

    async def _attempt_once(
        self, supervisor: Supervisor, info: RendezvousInfo, assignment: RankAssignment
    ) -> tuple[GroupOutcome | None, str | None]:
        logs = replace(self.logs, attempt=self._attempt)
        self._stopped = None
        self.recorder.attempt_started = anyio.current_time()
        envs = {worker.local_rank: self._environment(worker, logs) for worker in self.group.workers}
        if self.options.logs_specs is not None:
            for env in envs.values():
                del env["TORCHELASTIC_ERROR_FILE"]  # as torch's: the spec's reify() sets it, if it wants one
            logs = replace(logs, custom=reify(self.options.logs_specs, envs))
        dumper = self._dumper = StackDumper(logs, self.options.stack_dump)
        try:
            commands = [self._command(w, envs[w.local_rank]) for w in self.group.workers]
            if (
                self.features.standbys is None
            ):  # a standby's interpreter started long ago, without the faulthandler hook
                commands = [dumper.command(command) for command in commands]
            return await self._run_attempt(supervisor, info, commands, logs, dumper)
        finally:
            dumper.close()

    async def _run_attempt(
        self,
        supervisor: Supervisor,
        info: RendezvousInfo,
        commands: Sequence[WorkerCommand],
        logs: LogSpec,
        dumper: StackDumper,
    ) -> tuple[GroupOutcome | None, str | None]:
        reason: str | None = None
        keeper, ranks = self.features.checkpoints, [command.global_rank for command in commands]
        hang = self._hang_watch(supervisor, info, commands, dumper)
        async with self._timer_server() as timers, anyio.create_task_group() as tg:

            async def finished(ranks: frozenset[int]) -> bool:
                # A node that left after arriving in the exit barrier is done: restarting this node's workers,
                # still finishing, would throw their work away and let the nodes waiting in the barrier go.
                return await info.store.check([f"{_TERMINAL}/{rank}" for rank in sorted(ranks)])

            changed = Interrupt()

            async def watch() -> None:
                nonlocal reason
                reason = await self.handler.wait_for_membership_change(finished)
                # The attempt ends: restartable workers are kept for the next, the others stopped.
                changed.set(peers_lost=getattr(reason, "lost", True))

            async def watch_workers(workers: Sequence[WorkerProcess]) -> None:
                async with anyio.create_task_group() as watches:
                    if timers is not None:
                        watches.start_soon(timers.serve, workers, functools.partial(self._on_expired, dumper))
                    if hang is not None:
                        watches.start_soon(hang.run, workers)

            tg.start_soon(watch)
            self.recorder.running(len(commands), anyio.current_time())
            hooks = AttemptHooks(
                started=self.recorder.spawned,
                watch=None if timers is None and hang is None else watch_workers,
                before_kill=functools.partial(self._before_kill, dumper),
                restored=None if keeper is None else functools.partial(keeper.restored, ranks),
            )
            outcome = await supervisor.run(
                commands,
                logs,
                hooks=hooks,
                finish_together=callable(self.spec.entrypoint),  # as torch's multiprocessing runs functions
                refill_after=_RESTART_SETTLE if self._attempt else 0.0,
                keep_on_failure=self.budget.failure_restart_left,
                interrupt=changed,
            )
            tg.cancel_scope.cancel()
        if hang is not None and outcome.succeeded and reason is None:
            await hang.finished()
        if outcome.first_failure is not None or reason is None:
            return outcome, None
        self._stopped = outcome
        return None, reason

    def _hang_watch(
        self, supervisor: Supervisor, info: RendezvousInfo, commands: Sequence[WorkerCommand], dumper: StackDumper
    ) -> HangWatch | None:
        """The attempt's hang watch (``--hang-timeout``), or ``None`` when it is off."""
        if self.options.timeouts.hang is None:
            return None
        pipe = commands[0].env.get("TORCH_NCCL_DEBUG_INFO_PIPE_FILE")  # ours, or the user's own
        world = self.group.workers[0].world_size
        return HangWatch(self.options.timeouts.hang, info.store, info.rank, info.world_size, world, dumper, pipe,
                         supervisor.kill, self.recorder.incidents)  # fmt: skip

    async def _before_kill(self, dumper: StackDumper, survivors: Sequence[WorkerProcess]) -> None:
        """The workers still alive when a stop's grace ran out: their stacks, before SIGKILL."""
        for worker in survivors:
            dumper.note(worker.pid, f"did not exit within {self.options.shutdown:g} s of the stop: SIGKILLed")
        await dumper.dump(survivors, f"still running {self.options.shutdown:g} s after the stop; SIGKILL next")

    @asynccontextmanager
    async def _timer_server(self) -> AsyncIterator[FileTimerServer | None]:
        """The attempt's expiration-timer FIFO (:mod:`~aelastic.agent.timers`), or ``None`` when it is off."""
        if self.timer_file is None:
            yield None
            return
        async with FileTimerServer(self.timer_file) as server:
            yield server

    async def _on_expired(
        self, dumper: StackDumper, expiry: Expiry, worker: WorkerProcess, workers: Sequence[WorkerProcess]
    ) -> None:
        """Before the timer server kills ``worker``: say why, and dump the stacks of every local worker."""
        what = f"expiration timer {expiry.scope_id!r} expired: killed with {signal_name(expiry.signal)}"
        logger.warning("[%s] worker rank %d (pid %d): %s", self.spec.role, worker.global_rank, expiry.pid, what)
        dumper.note(worker.pid, what)
        await dumper.dump(workers, f"rank {worker.global_rank}: {what}", report=(worker.pid,))

    def _command(self, worker: Worker, env: dict[str, str]) -> WorkerCommand:
        if callable(self.spec.entrypoint):
            from .callables.parent import bootstrap_args, write_payload  # cloudpickle: only callables need it

            payload = self.run_dir / f"payload_{self._attempt}.pkl"
            if not payload.exists():
                write_payload(payload, self.spec.entrypoint, self.spec.args)
            args = bootstrap_args(payload, self._result_path(worker.local_rank))
        else:
            # torch's macros.substitute: "${local_rank}" in an argument becomes the worker's local rank.
            local_rank = str(worker.local_rank)
            substituted = (Template(str(a)).safe_substitute(local_rank=local_rank) for a in self.spec.args)
            args = (self.spec.entrypoint, *substituted)
        return WorkerCommand(worker.local_rank, worker.global_rank, args, env)

    def _result_path(self, local_rank: int) -> Path:
        return self.run_dir / f"result_{self._attempt}_{local_rank}.pkl"

    def _environment(self, worker: Worker, logs: LogSpec) -> dict[str, str]:
        g = self.group
        error_file = logs.error_file_path(worker.local_rank)
        env = dict(self.base_env)
        env.update(
            LOCAL_RANK=str(worker.local_rank),
            RANK=str(worker.global_rank),
            GROUP_RANK=str(g.group_rank),
            ROLE_RANK=str(worker.role_rank),
            ROLE_NAME=self.spec.role,
            LOCAL_WORLD_SIZE=str(self.spec.local_world_size),
            WORLD_SIZE=str(worker.world_size),
            GROUP_WORLD_SIZE=str(g.group_world_size),
            ROLE_WORLD_SIZE=str(worker.role_world_size),
            MASTER_ADDR=str(g.master_addr),
            MASTER_PORT=str(g.master_port),
            TORCHELASTIC_RESTART_COUNT=str(self.budget.failure_restarts),
            TORCHELASTIC_MAX_RESTARTS=str(self.spec.max_restarts),
            TORCHELASTIC_RUN_ID=self.handler.get_run_id(),
            TORCHELASTIC_USE_AGENT_STORE=str(self.handler.use_agent_store),
            TORCH_NCCL_ASYNC_ERROR_HANDLING=self.base_env.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
            TORCHELASTIC_ERROR_FILE="" if error_file is None else str(error_file),
            AELASTIC_MEMBERSHIP_RESTARTS=str(self.budget.membership_restarts),
        )
        if self.spec.virtual_local_rank:
            env["LOCAL_RANK"] = "0"
            devices = visible_devices(self.base_env)
            if devices:  # as torch: each worker sees only its own device, as device 0
                env["CUDA_VISIBLE_DEVICES"] = devices[worker.local_rank % len(devices)]
        if self.timer_file is not None:
            env[FILE_ENV] = str(self.timer_file)
        if self.options.timeouts.watchdog is not None:
            env[WATCHDOG_ENV] = repr(self.options.timeouts.watchdog)
        if self.options.timeouts.hang is not None:
            dumps = None if logs.log_dir is None else Path(logs.log_dir) / "flight_recorder_rank_"
            env.update(flight_recorder_env(self.base_env, self._flight_recorder_pipe, dumps))
        return env

    @property
    def _flight_recorder_pipe(self) -> Path:
        """The prefix of the workers' Flight Recorder pipes (NCCL's: ``<prefix><rank>.pipe``)."""
        return self.run_dir / "flight_recorder_pipe_rank_"

    async def _exit_barrier(self, info: RendezvousInfo) -> None:
        """Wait until every node's workers are done, so no node tears down a store others still use."""
        with anyio.move_on_after(self.options.timeouts.exit_barrier) as scope:
            await members_barrier(info, _TERMINAL, self.handler, self.spec.role)
        if scope.cancelled_caught:
            logger.warning(
                "[%s] exit barrier: not every node finished within %gs",
                self.spec.role,
                self.options.timeouts.exit_barrier,
            )

    async def shutdown(self) -> bool:
        """Close the rendezvous (torch's ``rdzv_handler.shutdown()``); ``False`` if that failed (it is logged).

        After a success every node closes, and then they wait for each other (at most ``exit_barrier_timeout``),
        so the node that serves the rendezvous store does not take it away from a node still closing.
        """
        closed = await self.handler.shutdown()
        if self._finished is not None:
            info = self._finished
            with anyio.move_on_after(self.options.timeouts.exit_barrier):
                try:
                    await members_barrier(info, "aelastic/agent/closed", self.handler, self.spec.role)
                except StoreConnectionError as exc:  # the job is done; a peer that left early changes nothing
                    logger.debug("[%s] closing barrier: %s", self.spec.role, exc)
        return closed

    def _result(
        self, state: WorkerState, outcome: GroupOutcome | None, cause: FailureRecord | None = None
    ) -> RunResult:
        values: dict[int, Any] = {}
        if state is WorkerState.SUCCEEDED and callable(self.spec.entrypoint):
            from .callables.parent import read_result

            values = {w.global_rank: read_result(self._result_path(w.local_rank)) for w in self.group.workers}
        elif state is WorkerState.SUCCEEDED:
            values = {w.global_rank: None for w in self.group.workers}
        failures = {} if outcome is None else self._failures(outcome)
        first = None if outcome is None else outcome.first_failure
        root = None if first is None else first.global_rank
        if cause is not None and failures:  # the job's root cause, wherever it was, and what the others are
            failures = {
                rank: with_cause(f, kind_of(f, stopped=rank != root and -f.exitcode in _STOPPED), cause)
                for rank, f in failures.items()
            }
            failures.setdefault(cause.failure.global_rank, as_reported(cause))
            root = cause.failure.global_rank
        budget = self.budget
        return RunResult(state, values, failures, budget.failure_restarts, budget.membership_restarts, root)

    def _failures(self, outcome: GroupOutcome) -> dict[int, ProcessFailure]:
        dumper = self._dumper
        return {
            e.global_rank: ProcessFailure.from_exit(
                e, self.logs_error_file(e.local_rank), () if dumper is None else dumper.notes(e.pid)
            )
            for e in outcome.failures
        }

    def _attempt_report(self, outcome: GroupOutcome | None) -> str:
        """The failure report of an attempt that is restarted (the run's final report is the caller's)."""
        failures = {} if outcome is None else self._failures(outcome)
        if not failures:
            return " no worker failed"
        first = None if outcome is None else outcome.first_failure
        root = None if first is None or first.global_rank not in failures else first.global_rank
        return ChildFailedError(self.spec.get_entrypoint_name(), failures, root_rank=root).format_report()

    def logs_error_file(self, local_rank: int) -> Path | None:
        """The error file of ``local_rank`` in the current (or last) attempt."""
        logs = self._dumper.logs if self._dumper is not None else replace(self.logs, attempt=self._attempt)
        return logs.error_file_path(local_rank)
