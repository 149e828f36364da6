"""``--rdzv-conf`` keys: how each is declared (:class:`ConfKey`) and read, and the keys every dynamic backend
(c10d, etcd, memory) shares.

A key is declared once, by the backend that reads it, as a :class:`ConfKey` (name, kind, default, meaning); the
backend reads it into a frozen settings object with :meth:`ConfKey.read`, so that one key means one thing and is
refused with one message wherever it is read, and the reference page is generated from the declarations. The
timing keys' defaults are the pure core's (:class:`~aelastic.rendezvous.state.RendezvousSettings`), not repeated
here. A key is checked only by a backend that reads it: torchrun's ``timeout`` (it always passes one) is known to
every backend, so it is never warned about, but only ``static`` reads, and so checks, it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal, cast

from ..errors import ConfigurationError
from ..store.server import StoreServer
from .api import JoinObserver, RendezvousParameters
from .values import RendezvousSettings

__all__ = [
    "AUTH_TOKEN",
    "DYNAMIC_KEYS",
    "HEARTBEAT_TIMEOUT",
    "READ_TIMEOUT",
    "TIMING_KEYS",
    "TORCHRUN_TIMEOUT",
    "ConfKey",
    "HandlerOptions",
    "TimingSettings",
    "conf_bool",
    "conf_float",
    "conf_int",
    "key_names",
]

Kind = Literal["seconds", "integer", "boolean", "text"]


@dataclass(frozen=True, slots=True)
class ConfKey:
    """One ``--rdzv-conf`` key as a backend reads it: the one definition of its name, default and meaning.

    Each backend lists the keys it reads (``C10D_KEYS``, ...; :attr:`~aelastic.rendezvous.registry.BackendEntry.keys`
    names them per backend), warns about any other (:meth:`~aelastic.rendezvous.api.RendezvousParameters.warn_unknown`)
    and reads each with :meth:`read`; the reference (``docs/reference/rdzv-conf.md``) is generated from these.

    Attributes:
        name: the key.
        kind: how its value is read: ``seconds`` (a finite number, > 0 unless ``minimum`` is 0), ``integer``
            (>= ``minimum``), ``boolean`` (true/false, 1/0, yes/no, on/off), ``text``.
        default: its value when it is not given (``None``: none, or decided otherwise, as the doc says).
        doc: what it does, for the reference.
        minimum: the least value of an ``integer``, or 0 for ``seconds`` that may be 0.
        aliases: other names of the same key (torch's spellings).
        read_by: False for a key that is accepted and not read (torchrun passes it to every backend).
    """

    name: str
    kind: Kind
    default: float | int | bool | str | None
    doc: str
    minimum: int = 1
    aliases: tuple[str, ...] = ()
    read_by: bool = True

    def read(self, params: RendezvousParameters) -> Any:
        """This key's value in ``params`` (its default when not given).

        Raises:
            ConfigurationError: a value the key's kind refuses, naming the key and the rule.
        """
        if self.kind == "seconds":
            return conf_float(params, self.name, cast(float, self.default), positive=self.minimum > 0)
        if self.kind == "integer":
            return conf_int(params, self.name, cast(int, self.default), minimum=self.minimum)
        if self.kind == "boolean":
            return conf_bool(params, self.name, cast(bool, self.default))
        raw = _raw(params, self.name)
        return self.default if raw is None else str(raw)


def key_names(keys: Iterable[ConfKey]) -> set[str]:
    """Every name ``keys`` answer to, aliases included: what a backend does not warn about."""
    return {name for key in keys for name in (key.name, *key.aliases)}


def _core_default(name: str) -> Any:
    """A protocol setting's default, as the pure core defines it (:class:`RendezvousSettings`)."""
    return next(f.default for f in dataclasses.fields(RendezvousSettings) if f.name == name)


TIMING_KEYS: Final[tuple[ConfKey, ...]] = (
    ConfKey(
        "join_timeout",
        "seconds",
        _core_default("join_timeout"),
        "how long a node may wait for a round to reach min_nodes (and to complete) before it fails with "
        "RendezvousTimeoutError; a node waiting for the next round of a running job is held off",
    ),
    ConfKey(
        "last_call_timeout",
        "seconds",
        _core_default("last_call_timeout"),
        "once a round has min_nodes, how long it waits for more (up to max_nodes) before it completes",
    ),
    ConfKey(
        "close_timeout",
        "seconds",
        _core_default("close_timeout"),
        "how long closing the rendezvous (at the end of the job) may take",
    ),
    ConfKey(
        "keep_alive_interval",
        "seconds",
        _core_default("keep_alive_interval"),
        "how often each node beats and checks its neighbour's beats",
    ),
    ConfKey(
        "keep_alive_max_attempt",
        "integer",
        _core_default("keep_alive_max_attempt"),
        "beats a node may miss before its neighbour declares it dead (15-20 s with the defaults)",
    ),
    HEARTBEAT_TIMEOUT := ConfKey("heartbeat_timeout", "seconds", 5.0, "how long one beat (a small write) may take"),
    ConfKey(
        "fast_quorum",
        "boolean",
        _core_default("fast_quorum"),
        "after a member was lost, the next round completes as soon as every survivor (and every node already "
        "waiting) is back, without the last call; false: torch's rule (the last call always runs)",
    ),
)
"""The keys of :class:`TimingSettings`, which every dynamic backend (c10d, etcd, memory) reads: the protocol's
timings, and ``fast_quorum`` (see :func:`~aelastic.rendezvous.state.regrouped`)."""

AUTH_TOKEN: Final = ConfKey(
    "auth_token", "text", None,
    "a token that the rendezvous requires of every node (default: $AELASTIC_AUTH_TOKEN, else none): c10d's hosting "
    "node's store refuses a client without it; the job's own etcd (--rdzv-endpoint embedded) turns on etcd's "
    "authentication with it. It crosses the network in the clear: it keeps strangers and other jobs off the "
    "rendezvous, not someone who reads the traffic; the workers' store takes none (torch's client cannot send one)",
)  # fmt: skip
READ_TIMEOUT: Final = ConfKey(
    "read_timeout", "seconds", 60.0,
    "how long the rendezvous backend may stay unreachable (no beat reaches it; for etcd, the first connection too) "
    "before the node fails with RendezvousConnectionError",
)  # fmt: skip

TORCHRUN_TIMEOUT: Final = ConfKey(
    "timeout", "seconds", None,
    "torchrun passes it to every backend (900 unless given); the dynamic backends accept it unread, as torch's do",
    read_by=False,
)  # fmt: skip

DYNAMIC_KEYS: Final[tuple[ConfKey, ...]] = (*TIMING_KEYS, READ_TIMEOUT, TORCHRUN_TIMEOUT)
"""What every dynamic backend reads (or accepts, for ``timeout``); each adds its own keys."""


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
    def from_parameters(cls, params: RendezvousParameters, defaults: Mapping[str, Any] | None = None) -> TimingSettings:
        """The timing keys of ``params`` (other keys are the caller's to check or warn about); ``defaults``: a
        backend's own defaults for some of them, where it differs from torch's.

        Raises:
            ConfigurationError: a timing key with a bad value, naming it.
        """
        own = defaults or {}
        values = {
            key.name: (dataclasses.replace(key, default=own[key.name]) if key.name in own else key).read(params)
            for key in TIMING_KEYS
        }
        heartbeat_timeout = values.pop(HEARTBEAT_TIMEOUT.name)
        rendezvous = RendezvousSettings(
            run_id=params.run_id, min_nodes=params.min_nodes, max_nodes=params.max_nodes, **values
        )
        return cls(rendezvous, heartbeat_timeout)


@dataclasses.dataclass(frozen=True, slots=True)
class HandlerOptions:
    """What a backend's opener tells its dynamic handler besides the node, the settings and the driver.

    Attributes:
        backend_name: the name events and ``get_backend()`` report.
        bootstrap_host: the address this node serves the workers' store of a round on (when rank 0).
        heartbeat_timeout: the deadline of one keep-alive write.
        read_timeout: how long the backend may stay unreachable before the handler fails.
        observer: called at every step of the node's exit and join (:data:`~aelastic.rendezvous.api.JoinObserver`).
        servers: the store servers the opener runs for this handler (they show in its ``statistics()``).
        share_store: whether rank 0's agent serves the round's workers' store
            (:attr:`~aelastic.rendezvous.api.RendezvousParameters.share_store`; ``use_agent_store``).
    """

    backend_name: str
    bootstrap_host: str
    heartbeat_timeout: float = cast(float, HEARTBEAT_TIMEOUT.default)
    read_timeout: float = cast(float, READ_TIMEOUT.default)
    observer: JoinObserver | None = None
    servers: tuple[StoreServer, ...] = ()
    share_store: bool = True
