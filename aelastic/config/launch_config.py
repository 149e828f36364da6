"""``LaunchConfig``: what to launch and how, with the field names, defaults and meanings of torch's.

Code ported from ``torch.distributed.launcher.api`` passes torch's values unchanged: every field torch's
``LaunchConfig`` has takes torch's default with torch's meaning (``None`` filters, ``shutdown_timeout=None`` read
from ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``, ``rdzv_timeout`` into ``rdzv_configs['timeout']``), with one difference on
purpose: no ``rdzv_backend`` runs standalone (torch's default, ``etcd``, needs an etcd server at an endpoint).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ConfigurationError
from ..rendezvous.api import RendezvousParameters
from . import environ
from .streams import Std, StdSpec
from .values import (
    DEFAULT_NODE_CHECK_SLOWDOWN,
    DEFAULT_SIGNALS,
    UNKILLABLE_TIMEOUT,
    check_at_least,
    check_module_names,
    check_node_check,
    check_node_range,
    check_port,
    check_slowdown,
    check_writable_dir,
    parse_signals,
    resolve_forwarded,
)

__all__ = ["LaunchConfig"]

_FORWARD_LABELS = ("LaunchConfig signals_to_forward", "LaunchConfig signals_to_handle")


@dataclass(frozen=True)
class LaunchConfig:
    """What to launch and how; the fields and defaults of torch's ``LaunchConfig`` (see the module doc), except
    that with no ``rdzv_backend`` the job runs standalone on the embedded store (one node, ``c10d`` on
    ``localhost:0``).

    ``event_log_handler`` names where events go (``aelastic.events``: null, console, file or a registered one);
    ``metrics_port`` opens the agent's ``/metrics`` and ``/health`` endpoint (``aelastic.agent.control``).

    ``monitor_interval`` is accepted for compatibility and has no effect: aelastic does not poll its workers, it
    awaits their exits. ``start_method`` likewise: callables always run in a fresh interpreter (spawn); and
    ``numa_options``: aelastic binds workers to no CPUs. ``shutdown_grace`` is computed: the seconds between the
    stop signal and SIGKILL (``shutdown_timeout``, else ``$TORCH_ELASTIC_SHUTDOWN_TIMEOUT``, else 30, read when
    the config is made, as torch's).
    """

    min_nodes: int = 1
    max_nodes: int = 1
    nproc_per_node: int = 1
    run_id: str = ""
    role: str = "default_role"
    rdzv_endpoint: str = ""
    rdzv_backend: str | None = None
    rdzv_configs: Mapping[str, Any] = field(default_factory=dict)
    rdzv_timeout: int = -1  # torch's legacy: when not -1, rdzv_configs['timeout']
    max_restarts: int = 3
    monitor_interval: float = 0.1
    start_method: str = "spawn"
    log_dir: str | Path | None = None
    redirects: StdSpec = Std.NONE
    tee: StdSpec = Std.NONE
    local_addr: str | None = None
    local_ranks_filter: frozenset[int] | None = None
    duplicate_stdout_filters: Sequence[str] | None = None  # None or empty: no filtered_stdout.log
    duplicate_stderr_filters: Sequence[str] | None = None
    log_line_prefix_template: str | None = None
    exit_barrier_timeout: float = 300.0
    shutdown_timeout: float | None = None  # None: $TORCH_ELASTIC_SHUTDOWN_TIMEOUT, else 30 (shutdown_grace)
    signals_to_handle: str = DEFAULT_SIGNALS
    # aelastic's: signals forwarded to the workers while they run on (None: SIGUSR1,SIGUSR2 less signals_to_handle);
    # read by whoever catches signals (the command line), as signals_to_handle is.
    signals_to_forward: str | None = None
    metrics_cfg: Mapping[str, str] = field(default_factory=dict)
    event_log_handler: str = "null"
    numa_options: Any = None  # torch's NumaOptions: accepted, no effect
    metrics_port: int | None = None
    virtual_local_rank: bool = False
    # aelastic's: kill a worker whose aelastic.worker.heartbeat() calls stop for this many seconds (None: off).
    watchdog_timeout: float | None = None
    # torch's: a custom LogsSpecs instance (aelastic.agent.logs_specs); None is the default layout under log_dir.
    logs_specs: Any = None
    # aelastic's: keep a pre-warmed standby interpreter per local rank (aelastic.agent.prewarm) that has imported
    # torch (where importable) and prewarm_modules, and start Python workers in it.
    prewarm: bool = False
    prewarm_modules: tuple[str, ...] = ()
    # aelastic's: in-memory checkpoints (aelastic.checkpoint). The shared memory one local rank's checkpoints may
    # take, in bytes (None: a quarter of this host's memory, shared among the local ranks; 0: no checkpoint
    # service); the directory the agents persist the latest complete one to (None: none), every how many saves;
    # and whether each agent keeps a replica of another node's checkpoints.
    checkpoint_memory: int | None = None
    checkpoint_dir: str | Path | None = None
    checkpoint_persist_every: int = 50
    checkpoint_replicas: bool = True
    # aelastic's: the seconds without CPU progress on every rank of the job that make a hang (None: not watched;
    # aelastic.agent.hang).
    hang_timeout: float | None = None
    # aelastic's: a worker alive this long after SIGKILL ends the agent (UnkillableWorkerError, exit status 4).
    unkillable_timeout: float = UNKILLABLE_TIMEOUT
    # aelastic's: "job" makes max_restarts one budget for the job; the same failure this many attempts in a row
    # stops the job early (NoProgressError, exit status 3; 0: never).
    max_restarts_scope: str = "node"
    max_repeated_failures: int = 0
    # aelastic's: test each node (a matmul, gloo all-reduces with peers) before the round that admits it, and leave
    # out one that fails or is node_check_slowdown times slower than the median (aelastic.agent.nodecheck).
    node_check: bool = False
    node_check_slowdown: float = DEFAULT_NODE_CHECK_SLOWDOWN
    shutdown_grace: float = field(init=False)

    def __post_init__(self) -> None:
        check_node_range(self.min_nodes, self.max_nodes, f"LaunchConfig nodes {self.min_nodes}:{self.max_nodes}")
        check_at_least(self.nproc_per_node, 1, f"LaunchConfig nproc_per_node={self.nproc_per_node}")
        check_at_least(self.max_restarts, 0, f"LaunchConfig max_restarts={self.max_restarts}")
        if self.start_method not in ("spawn", "fork", "forkserver"):
            raise ConfigurationError(
                f"LaunchConfig start_method={self.start_method!r}: must be spawn, fork or forkserver"
            )
        if self.exit_barrier_timeout <= 0:
            raise ConfigurationError(f"LaunchConfig exit_barrier_timeout={self.exit_barrier_timeout!r}: must be > 0")
        grace = environ.shutdown_timeout() if self.shutdown_timeout is None else self.shutdown_timeout
        check_at_least(grace, 0, f"LaunchConfig shutdown_timeout={grace!r}")  # torch's rule: 0 kills at once
        object.__setattr__(self, "shutdown_grace", float(grace))
        if self.max_restarts_scope not in ("node", "job"):
            raise ConfigurationError(
                f"LaunchConfig max_restarts_scope={self.max_restarts_scope!r}: must be node or job"
            )
        check_at_least(
            self.max_repeated_failures, 0, f"LaunchConfig max_repeated_failures={self.max_repeated_failures}"
        )
        for name in ("watchdog_timeout", "hang_timeout", "unkillable_timeout"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ConfigurationError(f"LaunchConfig {name}={value!r}: must be > 0 seconds")
        parse_signals(self.signals_to_handle, "LaunchConfig signals_to_handle")
        resolve_forwarded(self.signals_to_forward, self.signals_to_handle, _FORWARD_LABELS)
        check_module_names(self.prewarm_modules, "LaunchConfig prewarm_modules")
        if self.metrics_port is not None:
            check_port(self.metrics_port, f"LaunchConfig metrics_port={self.metrics_port}")
        if self.checkpoint_memory is not None:
            check_at_least(self.checkpoint_memory, 0, f"LaunchConfig checkpoint_memory={self.checkpoint_memory}")
        check_at_least(self.checkpoint_persist_every, 1, f"LaunchConfig checkpoint_persist_every="
                       f"{self.checkpoint_persist_every}")  # fmt: skip
        if self.checkpoint_dir is not None:
            check_writable_dir(str(self.checkpoint_dir), "LaunchConfig checkpoint_dir")
        check_slowdown(self.node_check_slowdown, f"LaunchConfig node_check_slowdown={self.node_check_slowdown!r}")
        if self.node_check:
            check_node_check(self.rdzv_backend, f"LaunchConfig node_check=True, rdzv_backend={self.rdzv_backend!r}")

    @property
    def standalone(self) -> bool:
        return self.rdzv_backend is None

    @property
    def signals(self) -> tuple[signal.Signals, ...]:
        """``signals_to_handle`` as signals: those that stop the workers and then the agent."""
        return parse_signals(self.signals_to_handle, "LaunchConfig signals_to_handle")

    @property
    def forwarded_signals(self) -> tuple[signal.Signals, ...]:
        """``signals_to_forward`` as signals: those forwarded to every worker's process group while the workers and
        the agent run on (the schedulers' notices)."""
        return resolve_forwarded(self.signals_to_forward, self.signals_to_handle, _FORWARD_LABELS)

    @property
    def duplicate_filters(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The stdout and stderr filters, each a tuple (empty where torch's ``None``)."""
        return tuple(self.duplicate_stdout_filters or ()), tuple(self.duplicate_stderr_filters or ())

    @property
    def checkpoint_limit(self) -> int:
        """``checkpoint_memory`` resolved: the bytes one local rank's checkpoints may take (0: no service)."""
        if self.checkpoint_memory is not None:
            return self.checkpoint_memory
        memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        return memory // 4 // self.nproc_per_node

    def rendezvous_parameters(self, run_id: str) -> RendezvousParameters:
        """The rendezvous this launch joins as ``run_id``: standalone is ``c10d`` on ``localhost:0``; torch's
        legacy ``rdzv_timeout`` (when not -1) is ``rdzv_configs['timeout']``, as torch's ``LaunchConfig`` sets it."""
        if self.standalone:
            backend, endpoint = "c10d", "localhost:0"
        else:
            backend, endpoint = str(self.rdzv_backend), self.rdzv_endpoint
        configs = dict(self.rdzv_configs)
        if self.rdzv_timeout != -1:
            configs["timeout"] = self.rdzv_timeout
        return RendezvousParameters(
            backend, endpoint, run_id, self.min_nodes, self.max_nodes, self.local_addr,
            share_store=environ.share_rendezvous_store(), **configs,
        )  # fmt: skip
