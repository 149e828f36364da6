"""What an :class:`~aelastic.agent.agent.ElasticAgent` is given: how it runs (:class:`AgentOptions`: the config's
records and the launch's own values) and what the launch opened for it (:class:`Features`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..config.logs_specs import LogsSpecs
from ..config.options import RestartOptions, Timeouts
from .attempt import StopSignal
from .forward.parent import RunningWorkers
from .reaper.parent import Reaper
from .stacks.parent import DEFAULT_DUMP_TIMEOUT

if TYPE_CHECKING:
    from .checkpoint.parent import Keeper
    from .nodecheck.parent import NodeCheck  # imported by the launcher only with --node-check
    from .prewarm.parent import Standbys  # imported by the launcher only with --prewarm

__all__ = ["AgentOptions", "Features"]


@dataclass(frozen=True)
class AgentOptions:
    """How the agent runs: the config's deadlines and restart rules, with the launch's own values."""

    timeouts: Timeouts = field(default_factory=Timeouts)
    restarts: RestartOptions = field(default_factory=RestartOptions)
    shutdown: float = 30.0  # from SIGTERM to SIGKILL when the workers are stopped (LaunchConfig.shutdown_grace)
    stack_dump: float = DEFAULT_DUMP_TIMEOUT  # the most a stack dump of the workers may take
    identical_workers: bool = False  # torch's TORCH_ELASTIC_WORKER_IDENTICAL: ranks need no exchange
    logs_specs: LogsSpecs | None = None  # a custom torch LogsSpecs (--logs-specs): reify() routes each attempt's logs


@dataclass(frozen=True)
class Features:
    """What the launch opened for the agent, each ``None`` where it is off: the reaper sidecar, the standbys
    (``--prewarm``), the workers' in-memory checkpoints, the node check; and the launch control's stop signal (what
    a cancelled run stops the workers with; None: SIGTERM) and registry of running workers (for forwarded
    signals)."""

    reaper: Reaper | None = None
    standbys: Standbys | None = None
    checkpoints: Keeper | None = None
    node_check: NodeCheck | None = None
    stop_signal: StopSignal | None = None
    running: RunningWorkers | None = None
