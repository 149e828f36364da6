"""torch's worker-group value types (``torch.distributed.elastic.agent.server.api``): what a node runs, its workers'
ranks, the group's state and how a run ended.

Values only: the agent (:mod:`aelastic.agent.agent`) changes a group's state and its status events
(:mod:`aelastic.agent.status_events`) report it; both import these, neither the other.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import AelasticError
from .errors import ProcessFailure

__all__ = ["RunResult", "Worker", "WorkerGroup", "WorkerSpec", "WorkerState"]


class WorkerState(str, enum.Enum):
    """torch's worker-group states."""

    UNKNOWN = "UNKNOWN"
    INIT = "INIT"
    HEALTHY = "HEALTHY"
    UNHEALTHY = "UNHEALTHY"
    STOPPED = "STOPPED"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"

    @staticmethod
    def is_running(state: WorkerState) -> bool:
        return state in (WorkerState.HEALTHY, WorkerState.UNHEALTHY)


@dataclass(frozen=True)
class WorkerSpec:
    """What every node runs: ``local_world_size`` copies of ``entrypoint`` (an executable with ``args``, or a
    callable called with ``args``), restarted at most ``max_restarts`` times after failures."""

    role: str
    local_world_size: int
    entrypoint: str | Callable[..., Any]
    args: tuple[Any, ...] = ()
    max_restarts: int = 3
    monitor_interval: float = 0.1
    master_addr: str | None = None
    master_port: int | None = None
    local_addr: str | None = None
    virtual_local_rank: bool = False  # torch's --virtual-local-rank: LOCAL_RANK 0, one visible device per worker

    def __post_init__(self) -> None:
        if self.local_world_size < 1:
            raise AelasticError(f"WorkerSpec local_world_size={self.local_world_size}: must be >= 1")

    def get_entrypoint_name(self) -> str:
        """torch's name for the failure report: the script (first non-option argument) or the function."""
        if callable(self.entrypoint):
            return str(getattr(self.entrypoint, "__qualname__", repr(self.entrypoint)))
        if os.path.basename(self.entrypoint).startswith("python"):
            return next((str(a) for a in self.args if not str(a).startswith("-")), self.entrypoint)
        return self.entrypoint


@dataclass(frozen=True, slots=True)
class Worker:
    """One worker of the group: its ranks in this round (torch's ``Worker``: ``-1`` until assigned) and its pid."""

    local_rank: int
    global_rank: int = -1
    role_rank: int = -1
    world_size: int = -1
    role_world_size: int = -1
    id: int | None = None  # the pid, once started


@dataclass
class WorkerGroup:
    spec: WorkerSpec
    workers: list[Worker] = field(default_factory=list)
    group_rank: int | None = None
    group_world_size: int | None = None
    state: WorkerState = WorkerState.INIT
    master_addr: str | None = None
    master_port: int | None = None
    round: int | None = None


@dataclass(frozen=True)
class RunResult:
    """How the agent's run ended; ``return_values`` and ``failures`` are keyed by global rank."""

    state: WorkerState
    return_values: Mapping[int, Any] = field(default_factory=dict)
    failures: Mapping[int, ProcessFailure] = field(default_factory=dict)
    failure_restarts: int = 0
    membership_restarts: int = 0
    first_failure_rank: int | None = None
    no_progress: str | None = None  # aelastic's: why the run stopped early, its failures repeating (NoProgressError)

    def is_failed(self) -> bool:
        return self.state is WorkerState.FAILED
