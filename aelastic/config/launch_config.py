"""``LaunchConfig``: what to launch and how, with the field names, defaults and meanings of torch's.

Code ported from ``torch.distributed.launcher.api`` passes torch's values unchanged: every field torch's
``LaunchConfig`` has takes torch's default with torch's meaning (``None`` filters, ``shutdown_timeout=None`` read
from ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``, ``rdzv_timeout`` into ``rdzv_configs['timeout']``), with one difference on
purpose: no ``rdzv_backend`` runs standalone (torch's default, ``etcd``, needs an etcd server at an endpoint).
"""

from __future__ import annotations

import dataclasses
import signal
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigurationError
from ..rendezvous.api import RendezvousParameters
from . import environ
from .options import CheckpointOptions, LogOptions, NodeCheckOptions, PrewarmOptions, RestartOptions, Timeouts
from .values import (
    DEFAULT_SIGNALS,
    check_at_least,
    check_node_check,
    check_node_range,
    check_port,
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
    aelastic's own options are one record per feature (:mod:`aelastic.config.options`): ``logs``, ``timeouts``,
    ``restarts``, ``prewarm``, ``checkpoint``, ``node_check``.

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
    local_addr: str | None = None
    duplicate_stdout_filters: Sequence[str] | None = None  # None or empty: no filtered_stdout.log
    duplicate_stderr_filters: Sequence[str] | None = None
    log_line_prefix_template: str | None = None
    shutdown_timeout: float | None = None  # None: $TORCH_ELASTIC_SHUTDOWN_TIMEOUT, else 30 (shutdown_grace)
    signals_to_handle: str = DEFAULT_SIGNALS
    metrics_cfg: Mapping[str, str] = field(default_factory=dict)
    event_log_handler: str = "null"
    numa_options: Any = None  # torch's NumaOptions: accepted, no effect
    virtual_local_rank: bool = False
    # torch's: a custom LogsSpecs instance (aelastic.config.logs_specs); None is the default layout under logs.dir.
    logs_specs: Any = None
    # aelastic's own, one record per feature (aelastic.config.options):
    logs: LogOptions = field(default_factory=LogOptions)
    timeouts: Timeouts = field(default_factory=Timeouts)
    restarts: RestartOptions = field(default_factory=RestartOptions)
    prewarm: PrewarmOptions = field(default_factory=PrewarmOptions)
    checkpoint: CheckpointOptions = field(default_factory=CheckpointOptions)
    node_check: NodeCheckOptions = field(default_factory=NodeCheckOptions)
    # signals forwarded to the workers while they run on (None: SIGUSR1,SIGUSR2 less signals_to_handle); read by
    # whoever catches signals (the command line), as signals_to_handle is.
    signals_to_forward: str | None = None
    metrics_port: int | None = None  # the agent's /metrics and /health endpoint (aelastic.agent.control)

    def __post_init__(self) -> None:
        check_node_range(self.min_nodes, self.max_nodes, f"LaunchConfig nodes {self.min_nodes}:{self.max_nodes}")
        check_at_least(self.nproc_per_node, 1, f"LaunchConfig nproc_per_node={self.nproc_per_node}")
        check_at_least(self.max_restarts, 0, f"LaunchConfig max_restarts={self.max_restarts}")
        if self.start_method not in ("spawn", "fork", "forkserver"):
            raise ConfigurationError(
                f"LaunchConfig start_method={self.start_method!r}: must be spawn, fork or forkserver"
            )
        grace = environ.shutdown_timeout() if self.shutdown_timeout is None else self.shutdown_timeout
        check_at_least(grace, 0, f"LaunchConfig shutdown_timeout={grace!r}")  # torch's rule: 0 kills at once
        object.__setattr__(self, "_shutdown_grace", float(grace))  # read when the config is made, as torch's
        parse_signals(self.signals_to_handle, "LaunchConfig signals_to_handle")
        resolve_forwarded(self.signals_to_forward, self.signals_to_handle, _FORWARD_LABELS)
        if self.metrics_port is not None:
            check_port(self.metrics_port, f"LaunchConfig metrics_port={self.metrics_port}")
        if self.node_check.enabled:
            check_node_check(self.rdzv_backend, f"LaunchConfig node_check, rdzv_backend={self.rdzv_backend!r}")

    @property
    def shutdown_grace(self) -> float:
        """The seconds between the stop signal and SIGKILL: ``shutdown_timeout``, else
        ``$TORCH_ELASTIC_SHUTDOWN_TIMEOUT``, else 30."""
        grace: float = self.__dict__["_shutdown_grace"]
        return grace

    @classmethod
    def from_fields(cls, values: Mapping[str, Any]) -> LaunchConfig:
        """A config from field values by name, a record's fields dotted (``{"checkpoint.memory": 0}``); a record
        not named keeps its defaults."""
        top = {name: value for name, value in values.items() if "." not in name}
        records: dict[str, dict[str, Any]] = {}
        for name, value in values.items():
            if "." in name:
                record, _, option = name.partition(".")
                records.setdefault(record, {})[option] = value
        # A record field's default factory is its record class.
        kinds: dict[str, Callable[..., Any]] = {f.name: f.default_factory for f in dataclasses.fields(cls)}  # type: ignore[misc]
        return cls(**top, **{name: kinds[name](**options) for name, options in records.items()})

    def flat(self) -> dict[str, Any]:
        """Every field by name, a record's fields dotted, and ``shutdown_grace``: what ``--dry-run`` shows."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if dataclasses.is_dataclass(value):
                out.update({f"{f.name}.{o.name}": getattr(value, o.name) for o in dataclasses.fields(value)})
            else:
                out[f.name] = value
        return {**out, "shutdown_grace": self.shutdown_grace}

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
