"""torch's metrics API (``torch.distributed.elastic.metrics``) and the agent's own figures behind ``/metrics``.

The API is torch's: :class:`MetricHandler` with ``emit(MetricData)``, :func:`configure` (a default handler, or one
per group), :func:`put_metric` (group ``torchelastic``) and :func:`get_stream`. The default handler drops
everything, so an agent nobody observes pays one dictionary lookup per figure. The agent emits torch's names
(``workers.<role>.remaining_restarts``, ``workers.<role>.<state>``, ``workers.<role>.run_total``,
``workers.<role>.run_{success,failed}_{with,no}_retries``, ``workers.<role>.flakiness``) plus what torch lacks:
``workers.<role>.restarts.{failure,membership}``, ``workers.<role>.rendezvous.duration.ms``,
``workers.<role>.recovery.duration.ms`` and ``workers.<role>.alive``.

:class:`AgentMetrics` keeps the same figures as state, for the Prometheus endpoint (``aelastic.agent.control``)
to read when scraped: nothing is computed for it between scrapes.
"""

from __future__ import annotations

import abc
import time
from dataclasses import dataclass, field
from typing import NamedTuple

from .agent.workers import WorkerState

__all__ = [
    "AgentMetrics",
    "ConsoleMetricHandler",
    "MetricData",
    "MetricHandler",
    "NullMetricHandler",
    "configure",
    "get_stream",
    "put_metric",
]


class MetricData(NamedTuple):
    timestamp: float
    group_name: str
    name: str
    value: int


class MetricHandler(abc.ABC):
    @abc.abstractmethod
    def emit(self, metric_data: MetricData) -> None: ...


class ConsoleMetricHandler(MetricHandler):
    """torch's console handler: ``[timestamp][group]: name=value`` on stdout."""

    def emit(self, metric_data: MetricData) -> None:
        print(  # noqa: T201 (this handler's purpose is to print)
            f"[{metric_data.timestamp}][{metric_data.group_name}]: {metric_data.name}={metric_data.value}"
        )


class NullMetricHandler(MetricHandler):
    def emit(self, metric_data: MetricData) -> None:
        pass


_default: MetricHandler = NullMetricHandler()
_groups: dict[str, MetricHandler] = {}


def configure(handler: MetricHandler, group: str | None = None) -> None:
    """Send group ``group``'s metrics to ``handler``; ``group=None`` replaces the default handler."""
    global _default
    if group is None:
        _default = handler
    else:
        _groups[group] = handler


def get_stream(group: str = "torchelastic") -> MetricHandler:
    return _groups.get(group, _default)


def put_metric(metric_name: str, metric_value: int, metric_group: str = "torchelastic") -> None:
    handler = get_stream(metric_group)
    if not isinstance(handler, NullMetricHandler):
        handler.emit(MetricData(time.time(), metric_group, metric_name, metric_value))


RESTART_CAUSES = ("failure", "membership")


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
