"""The elastic agent: one node's worker group, its processes, logs and error reports.

Exports the names of torch's ``torch.distributed.elastic.agent.server`` and ``...multiprocessing(.errors)`` that
aelastic has, imported on first use: every callable worker imports this package for its bootstrap, and must not
pay for anyio and the agent.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_exports

if TYPE_CHECKING:
    from .agent import ElasticAgent
    from .errors import ChildFailedError, ProcessFailure, record
    from .logs import Std
    from .workers import RunResult, Worker, WorkerGroup, WorkerSpec, WorkerState

_LAZY = {
    "ElasticAgent": ".agent",
    "RunResult": ".workers",
    "Worker": ".workers",
    "WorkerGroup": ".workers",
    "WorkerSpec": ".workers",
    "WorkerState": ".workers",
    "ChildFailedError": ".errors",
    "ProcessFailure": ".errors",
    "record": ".errors",
    "Std": ".logs",
}

__all__ = [
    "ChildFailedError",
    "ElasticAgent",
    "ProcessFailure",
    "RunResult",
    "Std",
    "Worker",
    "WorkerGroup",
    "WorkerSpec",
    "WorkerState",
    "record",
]

__getattr__, __dir__ = lazy_exports(__name__, globals(), _LAZY)
