"""The elastic agent: one node's worker group, its processes, logs and error reports.

Exports the names of torch's ``torch.distributed.elastic.agent.server`` and ``...multiprocessing(.errors)`` that
aelastic has, imported on first use: ``import aelastic.agent`` pays for neither anyio nor the agent.

Features
--------
Each feature that crosses a process boundary is a package here, its agent side; its worker side is in
:mod:`aelastic.worker`, and its options are a record of :mod:`aelastic.config.options`. Which feature lives where is
ARCHITECTURE.md's table, the one list of them. :mod:`.processes` supervises the workers and uses the features; a
feature's agent side never imports supervision.
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
