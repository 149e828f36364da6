"""aelastic: an asyncio/trio-native elastic launcher for PyTorch distributed jobs.

The launcher's names (:func:`launch`, :func:`run`, :class:`LaunchConfig`, :class:`LaunchControl`, ...) are
imported on first use: a worker that only needs :func:`record` (or the callable bootstrap) must not pay for the
agent, anyio and the rendezvous.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._lazy import lazy_exports
from .errors import (
    AelasticError,
    ConfigurationError,
    NodeCheckError,
    QueueEmptyError,
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousError,
    RendezvousGracefulExitError,
    RendezvousStateError,
    RendezvousTimeoutError,
    StoreConnectionError,
    StoreError,
    StoreProtocolError,
    UnkillableWorkerError,
)

if TYPE_CHECKING:
    from .agent.errors import ChildFailedError, FailedElsewhereError, NoProgressError, ProcessFailure, record
    from .agent.workers import RunResult, WorkerSpec, WorkerState
    from .config import (
        CheckpointOptions,
        LaunchConfig,
        LogOptions,
        NodeCheckOptions,
        PrewarmOptions,
        RestartOptions,
        Timeouts,
    )
    from .launcher import LaunchControl, launch, run

__version__ = "0.1.0"

# public name -> the module that defines it, imported by __getattr__ on first access
_LAZY = {
    "ChildFailedError": ".agent.errors",
    "FailedElsewhereError": ".agent.errors",
    "LaunchConfig": ".config",
    "CheckpointOptions": ".config",
    "LogOptions": ".config",
    "NodeCheckOptions": ".config",
    "PrewarmOptions": ".config",
    "RestartOptions": ".config",
    "Timeouts": ".config",
    "NoProgressError": ".agent.errors",
    "LaunchControl": ".launcher",
    "ProcessFailure": ".agent.errors",
    "RunResult": ".agent.workers",
    "WorkerSpec": ".agent.workers",
    "WorkerState": ".agent.workers",
    "launch": ".launcher",
    "record": ".agent.errors",
    "run": ".launcher",
}

__all__ = [
    "AelasticError",
    "CheckpointOptions",
    "ChildFailedError",
    "ConfigurationError",
    "FailedElsewhereError",
    "LaunchConfig",
    "LaunchControl",
    "LogOptions",
    "NoProgressError",
    "NodeCheckError",
    "NodeCheckOptions",
    "PrewarmOptions",
    "ProcessFailure",
    "QueueEmptyError",
    "RendezvousClosedError",
    "RendezvousConnectionError",
    "RendezvousError",
    "RendezvousGracefulExitError",
    "RendezvousStateError",
    "RendezvousTimeoutError",
    "RestartOptions",
    "RunResult",
    "StoreConnectionError",
    "StoreError",
    "StoreProtocolError",
    "Timeouts",
    "UnkillableWorkerError",
    "WorkerSpec",
    "WorkerState",
    "__version__",
    "launch",
    "record",
    "run",
]


__getattr__, __dir__ = lazy_exports(__name__, globals(), _LAZY)
