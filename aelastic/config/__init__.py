"""Configuration: the one place where a value the user gives is converted and checked.

* :mod:`.values`: text into values, and each rule a value keeps (raising ``ConfigurationError`` with the value
  named as the user wrote it);
* :mod:`.launch_config`: :class:`LaunchConfig`, torch's fields with torch's defaults and meanings, and one field
  per :mod:`.options` record (aelastic's own options, one record per feature, each checked when it is made);
* :mod:`.flags`: ``aelastic run``'s flags as data, each naming the field it sets;
* :mod:`.command`: ``aelastic run``'s arguments into a LaunchConfig and the workers' command (torch's legacy URL,
  the standalone defaults, the plugins a flag names);
* :mod:`.environ`: the variables of torch's that configure a launch, and the one place that writes the process
  environment;
* :mod:`.slurm` (with :mod:`.hostlist`, our own Slurm hostlist parser): what a Slurm step gives where no flag or
  ``PET_*`` variable did (nodes, the c10d endpoint and port, the run id, GPUs per node), and the loopback rule;
* :mod:`.sources`: each value's source (flag, ``PET_*``, Slurm variable, default), the Slurm source applied, and
  ``--dry-run``'s table;
* :mod:`.limits`: the open-file limit raised to the hard limit at agent and ``aelastic store`` start.

Imports go one way: ``cli -> config.command -> config.sources -> config.slurm -> config.hostlist``,
``config.command -> config.launch_config -> config.values``; ``launcher -> config``.
"""

from __future__ import annotations

from .launch_config import LaunchConfig
from .options import CheckpointOptions, LogOptions, NodeCheckOptions, PrewarmOptions, RestartOptions, Timeouts
from .values import (
    DEFAULT_FORWARDED,
    DEFAULT_NODE_CHECK_SLOWDOWN,
    DEFAULT_SIGNALS,
    LIST_LIMIT,
    new_run_id,
    parse_nnodes,
    parse_rdzv_conf,
    parse_signals,
)

__all__ = [
    "DEFAULT_FORWARDED",
    "DEFAULT_NODE_CHECK_SLOWDOWN",
    "DEFAULT_SIGNALS",
    "LIST_LIMIT",
    "CheckpointOptions",
    "LaunchConfig",
    "LogOptions",
    "NodeCheckOptions",
    "PrewarmOptions",
    "RestartOptions",
    "Timeouts",
    "new_run_id",
    "parse_nnodes",
    "parse_rdzv_conf",
    "parse_signals",
]
