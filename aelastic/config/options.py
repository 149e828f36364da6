"""aelastic's own options, one frozen record per feature, each checked once, here, when it is made.

:class:`~aelastic.config.LaunchConfig` holds torch's fields as torch names them, and one field per record below;
the launcher hands each record to its feature whole, so an option added to a record reaches its feature without
passing through the layers between (``docs/development.md``: adding a flag).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigurationError
from .streams import Std, StdSpec
from .values import (
    DEFAULT_NODE_CHECK_SLOWDOWN,
    UNKILLABLE_TIMEOUT,
    check_at_least,
    check_module_names,
    check_slowdown,
    check_writable_dir,
)

__all__ = ["CheckpointOptions", "LogOptions", "NodeCheckOptions", "PrewarmOptions", "RestartOptions", "Timeouts"]


def _positive_seconds(record: object, name: str, value: float | None) -> None:
    if value is not None and not value > 0:
        raise ConfigurationError(f"{type(record).__name__} {name}={value!r}: must be > 0 seconds")


@dataclass(frozen=True)
class LogOptions:
    """Where the workers' output goes, as torchrun's ``--log-dir``, ``--redirects``, ``--tee`` and
    ``--local-ranks-filter`` say (torch's own ``LaunchConfig`` keeps them in its ``logs_specs``)."""

    dir: str | Path | None = None  # None: a new temporary directory
    redirects: StdSpec = Std.NONE  # the streams that go to files only
    tee: StdSpec = Std.NONE  # the streams that go to files and the console
    local_ranks_filter: frozenset[int] | None = None  # the local ranks the console shows (None: all)


@dataclass(frozen=True)
class Timeouts:
    """The agent's deadlines, in seconds; ``None`` turns a watch off."""

    exit_barrier: float = 300.0  # the most a node waits for the others at the end, and again when closing
    unkillable: float = UNKILLABLE_TIMEOUT  # a worker alive this long after SIGKILL ends the agent (exit status 4)
    watchdog: float | None = None  # kill a worker whose aelastic.worker.heartbeat() calls stop this long
    hang: float | None = None  # no CPU progress on any rank of the job this long is a hang (aelastic.agent.hang)

    def __post_init__(self) -> None:
        for name in ("exit_barrier", "unkillable", "watchdog", "hang"):
            _positive_seconds(self, name, getattr(self, name))


@dataclass(frozen=True)
class RestartOptions:
    """How restarts are counted: ``scope="job"`` makes ``max_restarts`` one budget for the job; the same failure
    ``max_repeated_failures`` attempts in a row stops the job early (``NoProgressError``, exit status 3; 0: never)."""

    scope: str = "node"
    max_repeated_failures: int = 0

    def __post_init__(self) -> None:
        if self.scope not in ("node", "job"):
            raise ConfigurationError(f"RestartOptions scope={self.scope!r}: must be node or job")
        check_at_least(
            self.max_repeated_failures, 0, f"RestartOptions max_repeated_failures={self.max_repeated_failures}"
        )


@dataclass(frozen=True)
class PrewarmOptions:
    """A pre-warmed standby interpreter per local rank (``aelastic.agent.prewarm``) that has imported torch (where
    importable) and ``modules``; Python workers start in it."""

    enabled: bool = False
    modules: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        check_module_names(self.modules, "PrewarmOptions modules")


@dataclass(frozen=True)
class CheckpointOptions:
    """In-memory checkpoints (``aelastic.checkpoint``): the shared memory one local rank's checkpoints may take, in
    bytes (None: a quarter of this host's memory, shared among the local ranks; 0: no checkpoint service); the
    directory the agents persist the latest complete one to (None: none), every how many saves; and whether each
    agent keeps a replica of another node's checkpoints."""

    memory: int | None = None
    dir: str | Path | None = None
    persist_every: int = 50
    replicas: bool = True

    def __post_init__(self) -> None:
        if self.memory is not None:
            check_at_least(self.memory, 0, f"CheckpointOptions memory={self.memory}")
        check_at_least(self.persist_every, 1, f"CheckpointOptions persist_every={self.persist_every}")
        if self.dir is not None:
            check_writable_dir(str(self.dir), "CheckpointOptions dir")

    def limit(self, nproc_per_node: int) -> int:
        """The bytes one local rank's checkpoints may take (0: no service)."""
        if self.memory is not None:
            return self.memory
        memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        return memory // 4 // nproc_per_node


@dataclass(frozen=True)
class NodeCheckOptions:
    """Each node tested (a matmul, gloo all-reduces with peers) before the round that admits it, and left out when
    it fails or is ``slowdown`` times slower than the median (``aelastic.agent.nodecheck``)."""

    enabled: bool = False
    slowdown: float = DEFAULT_NODE_CHECK_SLOWDOWN

    def __post_init__(self) -> None:
        check_slowdown(self.slowdown, f"NodeCheckOptions slowdown={self.slowdown!r}")
