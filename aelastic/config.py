"""``LaunchConfig`` (torch's field names) and the parsing of user input shared by the CLI and the Python API."""

from __future__ import annotations

import os
import signal
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from .agent.logs import Std, StdSpec
from .errors import ConfigurationError

__all__ = ["LaunchConfig", "new_run_id", "parse_nnodes", "parse_rdzv_conf", "parse_signals"]

DEFAULT_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"

LIST_LIMIT: Final = 20
"""How many nodes of each list ``aelastic status`` prints unless asked for all (``--all``)."""


def new_run_id() -> str:
    """A random run id in the text form of a version-4 UUID, as torchrun's ``--standalone`` makes one.

    Made here rather than by :func:`uuid.uuid4`: the uuid module imports platform, ~3 ms of every launch.
    """
    raw = bytearray(os.urandom(16))
    raw[6] = raw[6] & 0x0F | 0x40  # version 4
    raw[8] = raw[8] & 0x3F | 0x80  # the RFC 4122 variant
    text = raw.hex()
    return f"{text[:8]}-{text[8:12]}-{text[12:16]}-{text[16:20]}-{text[20:]}"


def parse_nnodes(text: str) -> tuple[int, int]:
    """``N`` or ``MIN:MAX`` into ``(min, max)``; ``0 < min <= max``."""
    parts = str(text).split(":")
    try:
        if len(parts) == 1:
            low = high = int(parts[0])
        elif len(parts) == 2:
            low, high = int(parts[0]), int(parts[1])
        else:
            raise ValueError
    except ValueError:
        raise ConfigurationError(f"--nnodes {text!r}: must be N or MIN:MAX (positive integers)") from None
    if low < 1:
        raise ConfigurationError(f"--nnodes {text!r}: MIN must be >= 1")
    if low > high:
        raise ConfigurationError(f"--nnodes {text!r}: MIN must be <= MAX")
    return low, high


def parse_rdzv_conf(text: str) -> dict[str, str]:
    """``k=v,k=v`` into a dict; empty keys or values are refused, as torch refuses them."""
    conf: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip() or not value.strip():
            raise ConfigurationError(f"--rdzv-conf {text!r}: {item!r} is not KEY=VALUE")
        conf[key.strip()] = value.strip()
    return conf


def parse_signals(text: str) -> tuple[signal.Signals, ...]:
    """``SIGTERM,SIGINT,...`` into signals; unknown names are refused."""
    names = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [name for name in names if name not in signal.Signals.__members__]
    if unknown:
        raise ConfigurationError(f"--signals-to-handle {text!r}: {unknown[0]!r} is not a signal name")
    return tuple(signal.Signals[name] for name in names)


@dataclass(frozen=True)
class LaunchConfig:
    """What to launch and how; the fields and defaults of torch's ``LaunchConfig``, except that with no
    ``rdzv_backend`` the job runs standalone on the embedded store (one node, ``c10d`` on ``localhost:0``).

    ``event_log_handler`` names where events go (``aelastic.events``: null, console, file or a registered one);
    ``metrics_port`` opens the agent's ``/metrics`` and ``/health`` endpoint (``aelastic.agent.control``).

    ``monitor_interval`` is accepted for compatibility and has no effect: aelastic does not poll its workers, it
    awaits their exits. ``start_method`` likewise: callables always run in a fresh interpreter (spawn).
    """

    min_nodes: int = 1
    max_nodes: int = 1
    nproc_per_node: int = 1
    run_id: str = ""
    role: str = "default_role"
    rdzv_endpoint: str = ""
    rdzv_backend: str | None = None
    rdzv_configs: Mapping[str, Any] = field(default_factory=dict)
    rdzv_timeout: int = -1
    max_restarts: int = 3
    monitor_interval: float = 0.1
    start_method: str = "spawn"
    log_dir: str | Path | None = None
    redirects: StdSpec = Std.NONE
    tee: StdSpec = Std.NONE
    local_addr: str | None = None
    local_ranks_filter: frozenset[int] | None = None
    duplicate_stdout_filters: tuple[str, ...] = ()
    duplicate_stderr_filters: tuple[str, ...] = ()
    log_line_prefix_template: str | None = None
    exit_barrier_timeout: float = 300.0
    shutdown_timeout: float = 30.0
    signals_to_handle: str = DEFAULT_SIGNALS
    metrics_cfg: Mapping[str, str] = field(default_factory=dict)
    event_log_handler: str = "null"
    metrics_port: int | None = None
    virtual_local_rank: bool = False
    # aelastic's: kill a worker whose aelastic.worker.heartbeat() calls stop for this many seconds (None: off).
    watchdog_timeout: float | None = None
    # torch's: a custom LogsSpecs instance (aelastic.agent.logs_specs); None is the default layout under log_dir.
    logs_specs: Any = None
    # aelastic's: keep a pre-warmed standby interpreter per local rank (aelastic.agent.standby) that has imported
    # torch (where importable) and prewarm_modules, and start Python workers in it.
    prewarm: bool = False
    prewarm_modules: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not 1 <= self.min_nodes <= self.max_nodes:
            raise ConfigurationError(
                f"LaunchConfig nodes {self.min_nodes}:{self.max_nodes}: need 1 <= min_nodes <= max_nodes"
            )
        if self.nproc_per_node < 1:
            raise ConfigurationError(f"LaunchConfig nproc_per_node={self.nproc_per_node}: must be >= 1")
        if self.max_restarts < 0:
            raise ConfigurationError(f"LaunchConfig max_restarts={self.max_restarts}: must be >= 0")
        if self.start_method not in ("spawn", "fork", "forkserver"):
            raise ConfigurationError(
                f"LaunchConfig start_method={self.start_method!r}: must be spawn, fork or forkserver"
            )
        for name in ("exit_barrier_timeout", "shutdown_timeout"):
            if getattr(self, name) <= 0:
                raise ConfigurationError(f"LaunchConfig {name}={getattr(self, name)!r}: must be > 0")
        if self.watchdog_timeout is not None and self.watchdog_timeout <= 0:
            raise ConfigurationError(f"LaunchConfig watchdog_timeout={self.watchdog_timeout!r}: must be > 0")
        parse_signals(self.signals_to_handle)
        bad = [m for m in self.prewarm_modules if not all(part.isidentifier() for part in m.split("."))]
        if bad:
            raise ConfigurationError(f"LaunchConfig prewarm_modules: {bad[0]!r} is not a module name")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ConfigurationError(f"LaunchConfig metrics_port={self.metrics_port}: must be a port (0..65535)")

    @property
    def standalone(self) -> bool:
        return self.rdzv_backend is None
