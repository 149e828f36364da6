"""torch's metrics API (``torch.distributed.elastic.metrics``) and the agent's own figures behind ``/metrics``.

The API is torch's: :class:`MetricHandler` with ``emit(MetricData)``, :func:`configure` (a default handler, or one
per group), :func:`put_metric` (group ``torchelastic``) and :func:`get_stream`. The default handler drops
everything, so an agent nobody observes pays one dictionary lookup per figure. The agent emits torch's names
(``workers.<role>.remaining_restarts``, ``workers.<role>.<state>``, ``workers.<role>.run_total``,
``workers.<role>.run_{success,failed}_{with,no}_retries``, ``workers.<role>.flakiness``) plus what torch lacks:
``workers.<role>.restarts.{failure,membership}``, ``workers.<role>.rendezvous.duration.ms``,
``workers.<role>.recovery.duration.ms`` and ``workers.<role>.alive``.

The agent keeps the same figures as state (:class:`aelastic.agent.figures.AgentMetrics`), for its Prometheus endpoint
to read when scraped.
"""

from __future__ import annotations

import abc
import time
from typing import NamedTuple

__all__ = [
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
