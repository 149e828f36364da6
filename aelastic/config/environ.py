"""The process environment: the variables of torch's that configure a launch, read here, and the one place that
writes ``os.environ`` (what torchrun sets in its own environment once a command line is accepted; the workers
inherit it).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping, MutableMapping

from ..errors import ConfigurationError

__all__ = [
    "export_run_environment",
    "health_check_port",
    "log_level",
    "log_line_prefix_template",
    "python_executable",
    "share_rendezvous_store",
    "shutdown_timeout",
    "workers_identical",
]

logger = logging.getLogger(__name__)

_OMP_WARNING = (
    "\n*****************************************\n"
    "Setting OMP_NUM_THREADS environment variable for each process to be 1 in default, to avoid your "
    "system being overloaded, please further tune the variable for optimal performance in your "
    "application as needed. \n"
    "*****************************************"
)


def shutdown_timeout(environ: Mapping[str, str] = os.environ) -> float:
    """``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``, else 30: torch's ``shutdown_timeout`` where none is given."""
    text = environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "30")
    try:
        return float(text)
    except ValueError:
        raise ConfigurationError(f"TORCH_ELASTIC_SHUTDOWN_TIMEOUT={text!r}: must be a number of seconds") from None


def log_line_prefix_template(environ: Mapping[str, str] = os.environ) -> str | None:
    """``TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE``: torchrun's template where ``--log-line-prefix-template`` is not
    given."""
    return environ.get("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE")


def python_executable(environ: Mapping[str, str] = os.environ) -> str:
    """``PYTHON_EXEC``, else this interpreter: the python torchrun starts a script with."""
    return environ.get("PYTHON_EXEC", sys.executable)


def health_check_port(environ: Mapping[str, str] = os.environ) -> int | None:
    """torch's ``TORCHELASTIC_HEALTH_CHECK_PORT``; a non-integer value is logged and skipped, as torch does."""
    text = environ.get("TORCHELASTIC_HEALTH_CHECK_PORT")
    if text is None:
        return None
    try:
        return int(text)
    except ValueError:
        logger.warning("TORCHELASTIC_HEALTH_CHECK_PORT=%r is not a port number: no health check server", text)
        return None


def log_level(environ: Mapping[str, str] = os.environ) -> str:
    """torch's ``LOGLEVEL``, else ``WARNING``: the agent's log level where ``--log-level`` is not given."""
    return environ.get("LOGLEVEL", "WARNING")


def share_rendezvous_store(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether rank 0's agent serves the workers' store (torch's default): ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``
    has rank 0's worker serve it instead, as torch's c10d handler reads it."""
    return environ.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "0") != "1"


def workers_identical(environ: Mapping[str, str] = os.environ) -> bool:
    """torch's ``TORCH_ELASTIC_WORKER_IDENTICAL=1``: every node runs the same workers, so ranks follow from the
    group rank without the rank exchange."""
    return environ.get("TORCH_ELASTIC_WORKER_IDENTICAL") == "1"


def export_run_environment(
    nproc_per_node: int, signals_to_handle: str, environ: MutableMapping[str, str] = os.environ
) -> None:
    """What torchrun sets in its own environment once its command line is accepted: ``OMP_NUM_THREADS=1`` for
    several workers per node (with torchrun's warning) unless set, and ``TORCHELASTIC_SIGNALS_TO_HANDLE``."""
    if nproc_per_node > 1 and "OMP_NUM_THREADS" not in environ:
        logger.warning(_OMP_WARNING)
        environ["OMP_NUM_THREADS"] = "1"
    environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = signals_to_handle
