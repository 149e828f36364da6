"""An optional feature's dependency, refused in one line before anything starts when it is missing (the extra that
installs it named), and imported only where the feature is on."""

from __future__ import annotations

import importlib
from typing import Final

from ..errors import ConfigurationError

__all__ = ["METRICS_MISSING", "check_metrics_available"]

METRICS_MISSING: Final = (
    "--metrics-port: the Prometheus endpoint needs prometheus-client: pip install 'aelastic[metrics]'"
)


def check_metrics_available() -> None:
    """Refuse ``--metrics-port`` when prometheus-client is missing."""
    try:
        importlib.import_module("prometheus_client")
    except ImportError:
        raise ConfigurationError(METRICS_MISSING) from None
