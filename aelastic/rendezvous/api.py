"""The rendezvous types: torch's names, made async. The backends by name are :mod:`.registry`'s.

``RendezvousParameters`` carries what the user gave (backend, endpoint, run id, node counts and the
``--rdzv-conf`` keys as strings or numbers); each backend validates the keys it reads into a frozen settings
object (:mod:`.settings` parses the values): a bad value raises :class:`~aelastic.errors.ConfigurationError`
naming it, and a key the backend does not know is a one-line warning naming it and the known keys (torchrun
ignores such keys; scripts written for it pass them). A key is checked only by a backend that reads it.

A :class:`RendezvousHandler` owns its background tasks (keep-alive, the store servers it may host) in its own task
group; leaving the context that opened it stops them. :meth:`RendezvousHandler.statistics` reports what it did.
"""

from __future__ import annotations

import abc
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, urlsplit

import anyio.lowlevel

from ..errors import ConfigurationError
from ..store import ServerStatistics
from ..store.api import Store
from .state import Action
from .values import NodeDesc, NodeTimers, RendezvousSettings, RendezvousState, StateView

__all__ = [
    "Finished",
    "JoinObserver",
    "MembershipChange",
    "RendezvousHandler",
    "RendezvousInfo",
    "RendezvousParameters",
    "RendezvousStatistics",
    "RendezvousStoreInfo",
    "View",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RendezvousStoreInfo:
    """Where workers find their store (``MASTER_ADDR``/``MASTER_PORT``)."""

    master_addr: str
    master_port: int


@dataclass(frozen=True, slots=True)
class RendezvousInfo:
    """The outcome of one completed rendezvous round, as seen by one node."""

    store: Store
    rank: int
    world_size: int
    bootstrap_store_info: RendezvousStoreInfo
    round: int = 0
    job_store: Store | None = None  # aelastic's: keys the run's nodes share across rounds (the job's restarts)


@dataclass(frozen=True)
class RendezvousParameters:
    """What the user asked for; ``config`` holds the ``--rdzv-conf`` keys, validated by the backend.

    ``share_store`` (aelastic's, keyword-only): whether rank 0's agent serves the round's workers' store
    (``use_agent_store``); torch's ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` turns it off, which
    :meth:`aelastic.LaunchConfig.rendezvous_parameters` reads.
    """

    backend: str
    endpoint: str
    run_id: str
    min_nodes: int
    max_nodes: int
    local_addr: str | None = None
    config: Mapping[str, Any] = field(default_factory=dict)
    share_store: bool = True

    def __init__(
        self,
        backend: str,
        endpoint: str,
        run_id: str,
        min_nodes: int,
        max_nodes: int,
        local_addr: str | None = None,
        *,
        share_store: bool = True,
        **kwargs: Any,
    ) -> None:
        object.__setattr__(self, "backend", backend)
        object.__setattr__(self, "endpoint", endpoint)
        object.__setattr__(self, "run_id", run_id)
        object.__setattr__(self, "min_nodes", min_nodes)
        object.__setattr__(self, "max_nodes", max_nodes)
        object.__setattr__(self, "local_addr", local_addr)
        object.__setattr__(self, "config", dict(kwargs))
        object.__setattr__(self, "share_store", share_store)
        if not backend:
            raise ConfigurationError("rendezvous backend '': must name a backend (c10d, etcd, static, ...)")
        if not 1 <= min_nodes <= max_nodes:
            raise ConfigurationError(f"nodes '{min_nodes}:{max_nodes}': need 1 <= min_nodes <= max_nodes")

    @classmethod
    def from_url(cls, url: str, *, local_addr: str | None = None) -> RendezvousParameters:
        """torch's legacy etcd rendezvous URL on the v3 ``etcd`` backend:
        ``etcd://HOST[:PORT]/JOB_ID?min_workers=N&max_workers=M&timeout=S&last_call_timeout=S&etcd_prefix=/P``.

        ``JOB_ID`` is the run id, ``min_workers``/``max_workers`` the node counts (``max_workers`` defaults to
        ``min_workers``), ``timeout`` the join timeout, ``etcd_prefix`` the key prefix; the port defaults to 2379.
        Any other query key (``protocol``, ``cacert``, ``cert``, ``key``, or an ``--rdzv-conf`` key) is passed on
        as is.

        Raises:
            ConfigurationError: naming the URL and the rule it breaks.
        """
        parts = urlsplit(url)
        if parts.scheme != "etcd":
            raise ConfigurationError(f"rendezvous URL {url!r}: must start with etcd://")
        try:
            host, port = parts.hostname, parts.port or 2379
        except ValueError:
            raise ConfigurationError(f"rendezvous URL {url!r}: the port must be an integer 0..65535") from None
        run_id = parts.path.strip("/")
        if not host or not run_id:
            raise ConfigurationError(f"rendezvous URL {url!r}: must be etcd://HOST[:PORT]/JOB_ID?min_workers=N...")
        query = parse_qsl(parts.query, keep_blank_values=True)
        conf: dict[str, Any] = dict(query)
        if len(conf) != len(query) or not all(conf.values()):
            raise ConfigurationError(f"rendezvous URL {url!r}: each query key once, each with a value")

        def workers(key: str, default: str | None) -> int:
            raw = conf.pop(key, default)
            if raw is None or not raw.isdigit() or int(raw) < 1:
                raise ConfigurationError(f"rendezvous URL {url!r}: {key} must be an integer >= 1")
            return int(raw)

        low = workers("min_workers", None)
        high = workers("max_workers", str(low))
        for legacy, key in _LEGACY_URL_KEYS.items():
            if legacy in conf:
                conf[key] = conf.pop(legacy)
        endpoint = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        return cls("etcd", endpoint, run_id, low, high, local_addr, **conf)

    def warn_unknown(self, known: set[str]) -> None:
        """Log one warning per ``config`` key outside ``known`` (once per process and key), naming the known keys.

        torchrun passes keys its backend does not read (torch's own launcher tests do), so an unknown key does
        not stop the run; a known key with a bad value does (the backend's settings refuse it).
        """
        for key in sorted(set(self.config) - known):
            if (self.backend, key) not in _warned_keys:
                _warned_keys.add((self.backend, key))
                logger.warning(
                    "--rdzv-conf key %r is not used by the %r backend and is ignored; known keys: %s",
                    key, self.backend, ", ".join(sorted(known)),
                )  # fmt: skip


# torch's legacy etcd URL keys -> the etcd backend's --rdzv-conf keys (min/max_workers are the node counts).
_LEGACY_URL_KEYS = {"timeout": "join_timeout", "etcd_prefix": "key_prefix"}

# (backend, key) pairs already warned about: the command line checks its parameters before it opens them.
_warned_keys: set[tuple[str, str]] = set()


Finished = Callable[[frozenset[int]], Awaitable[bool]]
"""Whether the nodes of these ranks had finished the round's work before they left (see RendezvousHandler)."""

View = RendezvousState | StateView
"""What a node decides on: the whole state, or its view from the state's digest."""

JoinObserver = Callable[[NodeDesc, View, RendezvousSettings, NodeTimers, float, Action], None]
"""Called (synchronously; it must not block) at every step of a node's exit and join, with what the step decided
on: the node, the state, the settings, the node's timers, its monotonic ``now`` and the action. ``aelastic run``
draws its live "waiting for ..." line from it. Passed to :func:`~aelastic.rendezvous.open_rendezvous`; a backend
without such steps (static) never calls it."""


@dataclass(frozen=True, slots=True)
class RendezvousStatistics:
    """What one handler did since it opened, for measurements (``benchmarks/rendezvous.py``) and ``/metrics``.

    Attributes:
        stores: The store servers this handler runs now: the rendezvous store (c10d, on the hosting node) and
            the workers' store of the round (on its rank 0).
        state_reads: Whole reads of the shared state; ``state_bytes_read`` their bytes (pending requests too).
        digest_reads: Reads of a digest (a summary and one position shard); ``digest_bytes_read`` their bytes.
        writes_won: Compare-and-sets that wrote; ``writes_lost``: those that lost a race (and were retried).
        wake_ups: Waits for a change that ended (by a change or a deadline).
        join_requests: Join requests appended.
        folds: Folds of pending join requests into a read state; ``requests_folded``: the requests they folded.
    """

    stores: tuple[ServerStatistics, ...] = ()
    state_reads: int = 0
    state_bytes_read: int = 0
    digest_reads: int = 0
    digest_bytes_read: int = 0
    writes_won: int = 0
    writes_lost: int = 0
    wake_ups: int = 0
    join_requests: int = 0
    folds: int = 0
    requests_folded: int = 0


class MembershipChange(str):
    """Why a round must be redone, as :meth:`RendezvousHandler.wait_for_membership_change` says it (the text is for
    people); ``lost``: members left the round (found dead, or gone to restart), rather than nodes waiting to join
    or the rendezvous closed; ``noticed``: when this node learned of it (``time.monotonic()``)."""

    lost: bool
    noticed: float

    def __new__(cls, text: str, *, lost: bool = False) -> MembershipChange:
        change = super().__new__(cls, text)
        change.lost, change.noticed = lost, time.monotonic()
        return change


class RendezvousHandler(abc.ABC):
    """One node's view of a rendezvous (torch's ``RendezvousHandler``, async)."""

    @abc.abstractmethod
    def get_backend(self) -> str: ...

    @abc.abstractmethod
    def get_run_id(self) -> str: ...

    @property
    @abc.abstractmethod
    def use_agent_store(self) -> bool:
        """Whether workers use the store the agent serves (``TORCHELASTIC_USE_AGENT_STORE``)."""

    @abc.abstractmethod
    async def next_rendezvous(self) -> RendezvousInfo:
        """Leave the previous round (if any), join the next and wait until it completes.

        Raises ``RendezvousClosedError`` if the rendezvous is closed, ``RendezvousTimeoutError`` when the join
        timeout passes before ``min_nodes`` joined, ``RendezvousGracefulExitError`` for a node in reserve when
        the rendezvous closes. Cancellation leaves the shared state as the last completed write left it; the
        node is then dropped by liveness.
        """

    @abc.abstractmethod
    async def num_nodes_waiting(self) -> int:
        """Nodes waiting to join a later round (torch counts only the wait list, not the reserve)."""

    @abc.abstractmethod
    async def wait_for_membership_change(self, finished: Finished | None = None) -> str:
        """Return (with a reason) once this node's round must be redone: a node is waiting to join, a member
        died, or the rendezvous closed. Event driven; it never returns while the round is stable.

        When members left, ``finished`` (if given) is asked about their ranks: if it says they had finished
        (the agent's exit barrier), their leaving is no reason, since nothing of the round needs them any more."""

    @abc.abstractmethod
    async def wait_for_member_ranks(self, known: frozenset[int]) -> frozenset[int]:
        """The ranks of this node's last completed round whose nodes are still members, once they differ from
        ``known`` (at once if they already do). Members only leave a completed round (found dead, or leaving to
        rejoin); when the round is over, none are left. Event driven, like ``wait_for_membership_change``."""

    @abc.abstractmethod
    async def is_closed(self) -> bool: ...

    @abc.abstractmethod
    async def set_closed(self) -> None: ...

    @abc.abstractmethod
    async def shutdown(self) -> bool:
        """Close the rendezvous and leave; ``False`` if that failed (the error is logged)."""

    async def leave(self) -> None:
        """Leave the rendezvous for good, leaving it open for the others: this node is taken off every list, as a
        node found dead is (the others regroup without waiting for it). A backend without such a write (the
        default) does nothing: its liveness finds the node gone once it exits."""
        await anyio.lowlevel.checkpoint()

    def statistics(self) -> RendezvousStatistics:
        """What this handler did since it opened, and the store servers it runs now; a handler that counts
        nothing (the default) reports zeros and no store."""
        return RendezvousStatistics()

    @property
    def local_addr(self) -> str | None:
        """The address other nodes reach this node at (where it serves the workers' store when rank 0); ``None``
        where the backend does not know it (the default)."""
        return None
