"""The one recorder of the agent's state changes (see :class:`Recorder`)."""

from __future__ import annotations

import json
import logging
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import replace

import anyio

from .. import events
from ..rendezvous.api import RendezvousHandler, RendezvousInfo
from .figures import AgentMetrics
from .incidents.ledger import Incident
from .incidents.parent import Incidents
from .policy import Action, Budget, Decision
from .processes import GroupOutcome
from .rootcause import FailureRecord
from .spawn.parent import WorkerProcess
from .status_events import AgentSnapshot, record_agent, record_incident, record_started, record_workers
from .workers import WorkerGroup, WorkerSpec, WorkerState

__all__ = ["Recorder"]

logger = logging.getLogger("aelastic.agent.agent")  # the agent's own log lines


class Recorder:
    """The one place that records the agent's state changes: the worker group's state, the restart budget, the
    metrics (``/metrics``, ``/health`` and torch's ``put_metric``), torch's status events, and the log line that
    says what the agent does next. The agent calls one method per change, in the order the changes happen."""

    def __init__(
        self,
        spec: WorkerSpec,
        handler: RendezvousHandler,
        group: WorkerGroup,
        metrics: AgentMetrics,
        max_repeated_failures: int = 0,
        *,
        handed_off: Callable[[], int] | None = None,
    ) -> None:
        self.spec = spec
        self.handler = handler
        self.group = group
        self.metrics = metrics
        self.budget = Budget(spec.max_restarts, max_repeated=max_repeated_failures)
        self.attempt_started = 0.0  # the current attempt's start, on the event loop's clock
        self.started_at = time.monotonic()  # the start of torch's total_run_time
        self.incidents = Incidents(spec.local_world_size, self._incident, metrics.incidents.started_at)
        self._handed_off = handed_off  # the workers started from standbys so far (--prewarm)
        self._handed = 0
        self._pids: set[int] = set()  # the last attempt's workers: those still there are survivors
        self._ended_at = 0.0  # when the last attempt's workers were stopped (time.monotonic())

    def __repr__(self) -> str:
        return f"<Recorder state={self.group.state.value} {self.budget!r}>"

    def snapshot(self) -> AgentSnapshot:
        """The figures torch's status events report, as they are now."""
        g = self.group
        return AgentSnapshot(
            run_id=self.handler.get_run_id(),
            rdzv_backend=self.handler.get_backend(),
            role=self.spec.role,
            entry_point=self.spec.get_entrypoint_name(),
            group_rank=g.group_rank,
            group_world_size=g.group_world_size,
            workers=tuple(g.workers),
            agent_restarts=self.budget.failure_restarts,
            total_run_time=int(time.monotonic() - self.started_at),
        )

    def init(self) -> None:
        """An attempt begins: its rendezvous is next."""
        self.group.state = WorkerState.INIT
        self.metrics.set_state(WorkerState.INIT)

    def rendezvous_done(self, seconds: float, info: RendezvousInfo) -> None:
        self.metrics.rendezvous_done(seconds)
        self.incidents.rendezvous_done()
        self.incidents.joined(info.job_store, f"node {info.rank} ({socket.gethostname()})")
        if events.active() is not None:
            record_agent(self.snapshot(), "RENDEZVOUS", duration_ms=seconds * 1000)

    def running(self, workers: int, now: float) -> None:
        """The attempt's workers are being started."""
        self.group.state = WorkerState.HEALTHY
        self.metrics.running(workers, now)

    def spawned(self, processes: Sequence[WorkerProcess]) -> None:
        """The workers were spawned: their pids are torch's worker ids, and its START events carry them."""
        pids = {process.local_rank: process.pid for process in processes}
        self.group.workers = [replace(w, id=pids.get(w.local_rank)) for w in self.group.workers]
        kept = len(self._pids & set(pids.values()))
        handed = self._handed if self._handed_off is None else self._handed_off()
        warm, self._handed = handed - self._handed, handed
        counts = {"kept": kept, "pre-warmed": warm, "cold": len(pids) - kept - warm}  # kept: survivors
        how = [name if count == len(pids) else f"{count} {name}" for name, count in counts.items() if count]
        self.incidents.started(", ".join(how))
        self._pids = set(pids.values())
        if events.active() is not None:
            record_started(self.snapshot())

    def attempt_ended(self, workers: GroupOutcome | None) -> None:
        """The attempt's workers are gone: ``workers`` is how they exited, ``None`` when the watcher stopped them."""
        self.metrics.set_alive(0)
        self._ended_at = time.monotonic()
        if workers is not None and events.active() is not None:
            record_workers(self.snapshot(), workers)

    def decided(
        self, decision: Decision, workers: GroupOutcome | None, reason: str | None, report: Callable[[], str]
    ) -> None:
        """The policy decided what follows the attempt; ``reason`` is the watcher's, ``report()`` the failure
        report of a restarted attempt."""
        self.budget = decision.budget
        action, role, now = decision.action, self.spec.role, anyio.current_time()
        if action is Action.RESTART_MEMBERSHIP:
            self.metrics.restarted("membership", f"membership change: {reason}", now)
            self.incidents.fault(f"membership change: {reason}", "membership",
                                 notice=getattr(reason, "noticed", self._ended_at), seen=False)  # fmt: skip
            self.incidents.stopped(self._ended_at)
            logger.info("[%s] membership change (%s): restarting workers", role, reason)
        elif action is Action.RESTART_FAILURE:
            self.group.state = WorkerState.FAILED
            failed = None if workers is None else workers.first_failure
            rank, exitcode = failed and failed.global_rank, failed and failed.exitcode
            self.metrics.restarted("failure", f"worker rank {rank} failed (exitcode {exitcode})", now)
            # The exit's time, from the wall clock the agent noted it by to the monotonic one.
            noticed = self._ended_at if failed is None else time.monotonic() - max(time.time() - failed.timestamp, 0)
            self.incidents.fault(f"worker rank {rank} failed (exitcode {exitcode})", "failure",
                                 notice=min(noticed, self._ended_at), seen=True)  # fmt: skip
            self.incidents.stopped(self._ended_at)
            logger.warning(
                "[%s] worker rank %s failed (exitcode %s); restart %d of %d:%s",
                role, rank, exitcode, self.budget.failure_restarts, self.spec.max_restarts, report(),
            )  # fmt: skip
        elif action in (Action.SUCCEED, Action.STOP_FAILED, Action.STOP_NO_PROGRESS):
            if action is Action.STOP_NO_PROGRESS:
                logger.error("[%s] no progress: the same failure %d times in a row; stopping with restarts left:%s",
                             role, self.budget.repeated, report())  # fmt: skip
            state = WorkerState.SUCCEEDED if action is Action.SUCCEED else WorkerState.FAILED
            self.group.state = state
            self.metrics.set_state(state)
            self.metrics.run_finished(succeeded=action is Action.SUCCEED)
        # STOP_CLOSED changes nothing here: the agent raises RendezvousClosedError.

    def finished(self, state: WorkerState, cause: FailureRecord | None = None) -> None:
        """The run is over (after the exit barrier, when it succeeded): torch's agent-level event; a failed job's
        carries its root cause (``raw_error``: rank, node, host, exit code, message). Every node logs what its
        incidents cost."""
        line = self.incidents.close()
        if line is not None:
            logger.warning("[%s] %s", self.spec.role, line)
        if events.active() is not None:
            raw = None if cause is None else json.dumps({"root_cause": {
                "rank": cause.failure.global_rank, "node": cause.node, "host": cause.host,
                "exitcode": cause.failure.exitcode, "message": cause.failure.message}})  # fmt: skip
            record_agent(self.snapshot(), state.value, raw_error=raw)

    def _incident(self, incident: Incident) -> None:
        """An incident ended (:mod:`aelastic.agent.incidents`): its line, its figures and its event."""
        logger.warning("[%s] %s", self.spec.role, incident.describe())
        self.metrics.incident(incident)
        if events.active() is not None:
            record_incident(self.snapshot(), incident)
