"""The elastic agent: one node's worker group, its processes, logs and error reports.

Exports the names of torch's ``torch.distributed.elastic.agent.server`` and ``...multiprocessing(.errors)`` that
aelastic has, imported on first use: every callable worker imports this package for its bootstrap, and must not
pay for anyio and the agent.

Cross-process features
----------------------
What runs on both sides of a process boundary is one package per feature, its agent side and its child side
together: :mod:`.spawn` (the parent-death signal), :mod:`.reaper` (the sidecar that kills orphaned process
groups), :mod:`.finish` (callable workers finish together), :mod:`.prewarm` (standby interpreters),
:mod:`.stacks` (stack dumps before a kill), :mod:`.timers` (expiration timers and the watchdog; users reach the
child side as :mod:`aelastic.worker`), :mod:`.callables` (the callable entry point), :mod:`.link` (each worker's
socket pair to its agent: requests, and the exit report before the teardown), :mod:`.checkpoint` (in-memory
checkpoints; users reach the child side as :mod:`aelastic.checkpoint`) and :mod:`.nodecheck` (a node tested
before the round that admits it). :mod:`.processes` supervises the workers
and uses them; a feature's agent side never imports supervision.

**The child-side rule.** A feature's child side is its ``child.py`` module, or the files of its ``child/``
directory (a start-up hook imported as a top-level module). It runs in a worker or sidecar interpreter, so it is
standard library only and imports nothing of aelastic but its own feature's child side; a feature's
``__init__.py`` imports nothing at all (``python -m`` imports it first). The agent side may import its child side
(the protocol's constants live there), never the reverse. ``tests/test_child_side.py`` imports each child side in a
bare interpreter and enforces the rule; the few declared exceptions, with their reasons, are listed there.
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
