"""Parsing ``--rdzv-conf`` values, and the timing keys that every dynamic backend (c10d, etcd, memory) shares.

A backend reads the keys it uses into a frozen settings object with the ``conf_*`` functions here, so that one key
means one thing and is refused with one message wherever it is read; :class:`TimingSettings` is the one
definition of the timing keys' defaults and rules. A key is checked only by a backend that reads it: torchrun's
``timeout`` (it always passes one) is known to every backend, so it is never warned about, but only ``static``
reads, and so checks, it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Final

from ..errors import ConfigurationError
from .api import RendezvousParameters
from .state import RendezvousSettings

__all__ = ["TIMING_KEYS", "TORCHRUN_KEYS", "TimingSettings", "conf_bool", "conf_float", "conf_int"]

TIMING_KEYS: Final = frozenset(
    {
        "join_timeout",
        "last_call_timeout",
        "close_timeout",
        "heartbeat_timeout",
        "keep_alive_interval",
        "keep_alive_max_attempt",
        "fast_quorum",
    }
)
"""The keys of :class:`TimingSettings`: the protocol's timings, and ``fast_quorum`` (whether a round after a loss
completes once the survivors are back, see :func:`~aelastic.rendezvous.state.regrouped`; ``false``: torch's last
call)."""

TORCHRUN_KEYS: Final = frozenset({"timeout"})
"""Keys torchrun passes to every backend (``timeout``: 900 unless given); a backend that does not read one accepts
it unchecked, as torch's do."""


def _raw(params: RendezvousParameters, key: str) -> Any:
    return params.config.get(key)


def conf_float(params: RendezvousParameters, key: str, default: float, *, positive: bool = True) -> float:
    """``key`` as a finite number of seconds (> 0 when ``positive``), else ``default`` when it is not given."""
    raw = _raw(params, key)
    if raw is None:
        return default
    try:
        value = float(raw)
    except (TypeError, ValueError):
        raise ConfigurationError(f"--rdzv-conf {key}={raw!r}: must be a number of seconds") from None
    if not math.isfinite(value) or (positive and value <= 0):
        raise ConfigurationError(f"--rdzv-conf {key}={raw!r}: must be a finite number > 0")
    return value


def conf_int(params: RendezvousParameters, key: str, default: int, *, minimum: int = 1) -> int:
    """``key`` as an integer >= ``minimum``, else ``default`` when it is not given."""
    raw = _raw(params, key)
    if raw is None:
        return default
    try:
        value = int(raw)
    except (TypeError, ValueError):
        raise ConfigurationError(f"--rdzv-conf {key}={raw!r}: must be an integer") from None
    if value < minimum or (isinstance(raw, float) and raw != value):
        raise ConfigurationError(f"--rdzv-conf {key}={raw!r}: must be an integer >= {minimum}")
    return value


def conf_bool(params: RendezvousParameters, key: str, default: bool) -> bool:
    """``key`` as a boolean (true/false, 1/0, yes/no, on/off), else ``default`` when it is not given."""
    raw = _raw(params, key)
    if raw is None:
        return default
    if isinstance(raw, bool):
        return raw
    text = str(raw).strip().lower()
    if text in ("1", "true", "yes", "y", "on"):
        return True
    if text in ("0", "false", "no", "n", "off"):
        return False
    raise ConfigurationError(f"--rdzv-conf {key}={raw!r}: must be a boolean (true/false, 1/0)")


@dataclass(frozen=True, slots=True)
class TimingSettings:
    """The timing keys (:data:`TIMING_KEYS`) of a dynamic rendezvous, validated: the protocol's settings, which
    every node of a run derives alike, and how long one heartbeat may take."""

    rendezvous: RendezvousSettings
    heartbeat_timeout: float

    @classmethod
    def from_parameters(cls, params: RendezvousParameters) -> TimingSettings:
        """The timing keys of ``params`` (other keys are the caller's to check or warn about).

        Raises:
            ConfigurationError: a timing key with a bad value, naming it.
        """
        rendezvous = RendezvousSettings(
            run_id=params.run_id,
            min_nodes=params.min_nodes,
            max_nodes=params.max_nodes,
            join_timeout=conf_float(params, "join_timeout", 600.0),
            last_call_timeout=conf_float(params, "last_call_timeout", 30.0),
            close_timeout=conf_float(params, "close_timeout", 30.0),
            keep_alive_interval=conf_float(params, "keep_alive_interval", 5.0),
            keep_alive_max_attempt=conf_int(params, "keep_alive_max_attempt", 3),
            fast_quorum=conf_bool(params, "fast_quorum", True),
        )
        return cls(rendezvous, conf_float(params, "heartbeat_timeout", 5.0))
