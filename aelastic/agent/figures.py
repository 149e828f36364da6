"""The agent's figures as state (:class:`AgentMetrics`): what ``/metrics``, ``/health`` and ``/ready``
(:mod:`aelastic.agent.control`) read when asked, updated by the agent as things happen, so nothing is computed
between scrapes. Each update also goes to torch's metrics API (:func:`aelastic.metrics.put_metric`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ..metrics import put_metric
from .incidents.ledger import Incident, goodput
from .workers import WorkerState

__all__ = ["RESTART_CAUSES", "AgentMetrics", "IncidentFigures"]

RESTART_CAUSES = ("failure", "membership")


@dataclass
class IncidentFigures:
    """The incidents that ended (:mod:`aelastic.agent.incidents`), in order, and the agent's start (the one the
    incident records measure the goodput from)."""

    ended: list[Incident] = field(default_factory=list)
    started_at: float = field(default_factory=time.monotonic)

    def goodput(self, now: float) -> float:
        """The share of the time since the agent started that no incident lost."""
        return goodput(self.ended, now - self.started_at)


@dataclass
class AgentMetrics:
    """One agent's figures, updated by the agent as things happen and read by the endpoint when scraped.

    Durations are seconds on the monotonic clock; ``*_last`` is the latest occurrence, ``*_sum``/``*_count`` add
    up all of them (a Prometheus summary without quantiles).
    """

    role: str
    max_restarts: int
    state: WorkerState = WorkerState.INIT
    restarts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(RESTART_CAUSES, 0))
    rendezvous_last: float | None = None
    rendezvous_sum: float = 0.0
    rendezvous_count: int = 0
    recovery_last: float | None = None
    recovery_sum: float = 0.0
    recovery_count: int = 0
    workers_alive: int = 0
    unhealthy: dict[int, str] = field(default_factory=dict)  # local rank → why (set by a progress watchdog)
    stopped_reason: str | None = None  # why the workers are stopped until they run again (a restart under way)
    stopped_since: float | None = None
    incidents: IncidentFigures = field(default_factory=IncidentFigures)

    def set_state(self, state: WorkerState) -> None:
        self.state = state
        put_metric(f"workers.{self.role}.remaining_restarts", self.max_restarts - self.restarts["failure"])
        put_metric(f"workers.{self.role}.{self.state.value.lower()}", 1)

    def restarted(self, cause: str, reason: str, now: float) -> None:
        """The workers were stopped for a restart: from ``now`` until :meth:`running` is a recovery."""
        self.restarts[cause] += 1
        self.stopped_reason = f"{reason}; restart {self.restarts[cause]} ({cause})"
        if self.stopped_since is None:
            self.stopped_since = now
        put_metric(f"workers.{self.role}.restarts.{cause}", self.restarts[cause])

    def rendezvous_done(self, seconds: float) -> None:
        self.rendezvous_last = seconds
        self.rendezvous_sum += seconds
        self.rendezvous_count += 1
        put_metric(f"workers.{self.role}.rendezvous.duration.ms", int(seconds * 1000))

    def running(self, alive: int, now: float) -> None:
        """The workers were started: the end of a recovery, if one was under way."""
        self.set_state(WorkerState.HEALTHY)
        self.set_alive(alive)
        if self.stopped_since is not None:
            self._recovered(now - self.stopped_since)
        self.stopped_reason = self.stopped_since = None

    def _recovered(self, seconds: float) -> None:
        self.recovery_last = seconds
        self.recovery_sum += seconds
        self.recovery_count += 1
        put_metric(f"workers.{self.role}.recovery.duration.ms", int(seconds * 1000))

    def incident(self, incident: Incident) -> None:
        self.incidents.ended.append(incident)
        put_metric(f"workers.{self.role}.incident.lost.ms", int(incident.lost * 1000))

    def set_alive(self, count: int) -> None:
        self.workers_alive = count
        put_metric(f"workers.{self.role}.alive", count)

    def run_finished(self, succeeded: bool) -> None:
        """torch's ``_record_metrics``: "retries" means some failure restart was spent."""
        retried = self.restarts["failure"] > 0
        put_metric(f"workers.{self.role}.run_total", 1)
        for outcome, with_retries in (("success", True), ("success", False), ("failed", True), ("failed", False)):
            hit = succeeded == (outcome == "success") and retried == with_retries
            put_metric(f"workers.{self.role}.run_{outcome}_{'with' if with_retries else 'no'}_retries", int(hit))
        remaining = self.max_restarts - self.restarts["failure"]
        flakiness = 100 if not succeeded else int(100 - 100 * (remaining + 1) / (self.max_restarts + 1))
        put_metric(f"workers.{self.role}.flakiness", flakiness)
