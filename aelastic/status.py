"""A rendezvous as a person wants to see it: who joined, who waits, and why the round has not completed yet.

Two halves. :func:`describe` is pure: (state, settings, and, inside a node, that node's timers and clock) to a
:class:`RendezvousView` that renders as text or JSON; its :attr:`~RendezvousView.reason` is the one line
``aelastic run`` shows live on a terminal while it waits. :func:`read_rendezvous` reads the state through the
backend without joining, writing or creating anything (``aelastic status``).

Time left: the shared state holds no clock (nothing compares clocks of different hosts), so the last-call and
join deadlines exist only as each node's own monotonic timers. Inside a node (``aelastic run``) they are shown;
from outside (``aelastic status``) the view says so and gives the configured windows instead.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Final

from ._net import format_address, parse_endpoint
from .errors import ConfigurationError, RendezvousConnectionError, StoreConnectionError
from .rendezvous.api import RendezvousParameters, check_parameters
from .rendezvous.backends import C10D_DEFAULT_PORT, C10dSettings
from .rendezvous.backends.base import Versioned
from .rendezvous.backends.store import StoreBackend
from .rendezvous.dynamic import state_of
from .rendezvous.state import NodeDesc, NodeTimers, RendezvousSettings, RendezvousState
from .store.client import open_store_client

__all__ = [
    "NodeView",
    "RendezvousView",
    "check_readable",
    "describe",
    "read_rendezvous",
    "rendezvous_settings",
    "waiting_reason",
]

_OUTSIDE_TIMING: Final = (
    "time left not shown: deadlines are each node's own monotonic timers and the shared state holds no clock "
    "(nothing compares clocks across hosts); `aelastic run` shows its countdown on a terminal"
)
_INSIDE_TIMING: Final = "this node's own deadlines, on its monotonic clock"


def _nodes(count: int, more: str = "") -> str:
    """``1 node``, ``2 nodes``; with ``more="more "``: ``1 more node``."""
    return f"{count} {more}node" if count == 1 else f"{count} {more}nodes"


def waiting_reason(
    state: RendezvousState | None,
    settings: RendezvousSettings | None,
    timers: NodeTimers | None = None,
    now: float | None = None,
) -> str:
    """One line: why the round has not completed (``waiting for 1 more node (have 1, min 2)``), or its outcome.

    ``state`` None: no node has opened the run yet. ``settings`` None: the node counts are unknown (the viewer
    did not give ``--nnodes``). ``timers``/``now``: a node's own, for the last-call countdown.
    """
    state = state or RendezvousState()
    have = len(state.participants)
    if state.closed:
        return f"closed after round {state.round}: the job is over or was stopped; a node that joins now fails"
    if state.complete:
        extra = "".join(
            f"; {_nodes(len(nodes))} {what}"
            for nodes, what in ((state.wait_list, "waiting for the next round"), (state.redundancy_list, "in reserve"))
            if nodes
        )
        return f"complete: round {state.round} runs with {_nodes(have)}{extra}"
    if settings is None:
        return f"not complete: {_nodes(have)} joined (give --nnodes MIN:MAX to see what it waits for)"
    low, high = settings.min_nodes, settings.max_nodes
    if have < low:
        return f"waiting for {_nodes(low - have, 'more ')} (have {have}, min {low})"
    if have >= high:
        return f"completing: max_nodes joined (have {have}, max {high})"
    left = _last_call_left(state, timers, now)
    counts = f"(have {have}, min {low}, max {high})"
    if left is None:
        window = f"last_call_timeout={settings.last_call_timeout:g}s"
        return f"last call: completes up to {window} after min_nodes joined {counts}"
    return f"last call: completes in {math.ceil(left)}s unless {_nodes(high - have, 'more ')} join first {counts}"


def _last_call_left(state: RendezvousState, timers: NodeTimers | None, now: float | None) -> float | None:
    if timers is None or now is None or timers.last_call_deadline is None or timers.last_call_round != state.round:
        return None
    return max(0.0, timers.last_call_deadline - now)


@dataclass(frozen=True, slots=True)
class NodeView:
    """One listed node: torch's ``addr_pid_localid`` id, its address and pid, and its rank once the round is
    complete (``None`` before: ranks are fixed at completion)."""

    id: str
    addr: str
    pid: int
    rank: int | None = None


@dataclass(frozen=True, slots=True)
class RendezvousView:
    """What ``aelastic status`` prints; :meth:`render` for people, :meth:`to_json` for machines."""

    run_id: str
    backend: str
    endpoint: str
    exists: bool
    round: int
    complete: bool
    closed: bool
    min_nodes: int | None
    max_nodes: int | None
    participants: tuple[NodeView, ...]
    waiting: tuple[NodeView, ...]
    reserve: tuple[NodeView, ...]
    last_call_seconds_left: float | None
    join_seconds_left: float | None
    timing: str
    reason: str

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def render(self) -> str:
        def listing(title: str, nodes: tuple[NodeView, ...]) -> list[str]:
            lines = [f"  {title} ({len(nodes)}):" + ("" if nodes else " none")]
            for n in nodes:
                rank = "" if n.rank is None else f"rank {n.rank:<4} "
                lines.append(f"    {rank}{n.addr:<24} pid {n.pid:<8} {n.id}")
            return lines

        counts = "unknown (give --nnodes)" if self.min_nodes is None else f"min {self.min_nodes}, max {self.max_nodes}"
        lines = [
            f"rendezvous {self.run_id!r} ({self.backend} at {self.endpoint})",
            f"  status: {self.reason}",
        ]
        if not self.exists:
            lines.append("  no node has opened this run id on this backend yet")
        lines += [
            f"  round {self.round}: {'complete' if self.complete else 'not complete'}, "
            f"{'closed' if self.closed else 'open'}; nodes {counts}",
            *listing(
                "participants" if self.complete else "participants (ranks fixed at completion)", self.participants
            ),
            *listing("waiting for the next round", self.waiting),
            *listing("reserve (beyond max_nodes)", self.reserve),
        ]
        if self.last_call_seconds_left is not None:
            lines.append(f"  last call: {self.last_call_seconds_left:.1f}s left")
        if self.join_seconds_left is not None:
            lines.append(f"  join timeout: {self.join_seconds_left:.1f}s left")
        lines.append(f"  time: {self.timing}")
        return "\n".join(lines)


def _windows(settings: RendezvousSettings | None) -> str:
    if settings is None:
        return ""
    return (
        f"; a node completes the round last_call_timeout={settings.last_call_timeout:g}s after it saw min_nodes "
        f"join, and gives up join_timeout={settings.join_timeout:g}s after it began to join"
    )


def describe(
    state: RendezvousState | None,
    settings: RendezvousSettings | None,
    *,
    run_id: str,
    backend: str,
    endpoint: str,
    timers: NodeTimers | None = None,
    now: float | None = None,
) -> RendezvousView:
    """The view of ``state`` (None: no node opened the run yet). ``timers`` and ``now`` are a node's own (its
    monotonic clock); without them no time left is shown, and ``timing`` says why."""
    exists = state is not None
    state = state or RendezvousState()

    def view(node: NodeDesc) -> NodeView:
        return NodeView(node.id, node.addr, node.pid, state.rank_of(node))

    inside = timers is not None and now is not None
    return RendezvousView(
        run_id=run_id,
        backend=backend,
        endpoint=endpoint,
        exists=exists,
        round=state.round,
        complete=state.complete,
        closed=state.closed,
        min_nodes=None if settings is None else settings.min_nodes,
        max_nodes=None if settings is None else settings.max_nodes,
        participants=tuple(view(n) for n in state.participants),
        waiting=tuple(view(n) for n in state.wait_list),
        reserve=tuple(view(n) for n in state.redundancy_list),
        last_call_seconds_left=_last_call_left(state, timers, now),
        join_seconds_left=(
            max(0.0, timers.join_deadline - now)
            if timers is not None and now is not None and not state.complete
            else None
        ),
        timing=(_INSIDE_TIMING if inside else _OUTSIDE_TIMING) + _windows(settings),
        reason=waiting_reason(state if exists else None, settings, timers, now),
    )


def check_readable(params: RendezvousParameters) -> None:
    """Refuse, without I/O, what :func:`read_rendezvous` cannot read: a backend without shared state, bad keys."""
    if params.backend not in ("c10d", "etcd", "etcd-v2"):
        raise ConfigurationError(
            f"--rdzv-backend {params.backend!r}: keeps no shared rendezvous state to show; "
            "aelastic status reads the c10d and etcd backends"
        )
    check_parameters(params)


def rendezvous_settings(params: RendezvousParameters) -> RendezvousSettings:
    """The protocol settings ``params`` give (node counts, windows), as the job's nodes derive them."""
    check_readable(params)
    if params.backend == "c10d":
        return C10dSettings.from_parameters(params).rendezvous
    from .rendezvous.backends.etcd import etcd_setup  # lazily, as _read_etcd: it pulls in httpx

    return etcd_setup(params)[0].rendezvous


async def read_rendezvous(params: RendezvousParameters) -> RendezvousState | None:
    """The rendezvous state of ``params`` as its backend holds it now, or None if no node opened the run yet.

    Reads only: it joins nothing, writes nothing, creates no key. Bound it with ``anyio.fail_after``; on
    cancellation the connection is closed.

    Raises:
        ConfigurationError: bad parameters, or a backend that keeps no shared state (static).
        RendezvousConnectionError: the backend refused the connection or broke it.
    """
    check_readable(params)
    try:
        return await (_read_store(params) if params.backend == "c10d" else _read_etcd(params))
    except StoreConnectionError as exc:
        raise RendezvousConnectionError(
            f"could not read rendezvous {params.run_id!r} from the {params.backend} backend at "
            f"{params.endpoint!r}: {exc}"
        ) from exc


def _state(seen: Versioned) -> RendezvousState | None:
    """What every node decides on (the written state with the pending join requests folded in); None while no
    node has opened the run."""
    return None if seen.data is None and not seen.pending else state_of(seen)


async def _read_store(params: RendezvousParameters) -> RendezvousState | None:
    host, port = parse_endpoint(params.endpoint, C10D_DEFAULT_PORT)
    if port == 0:
        raise ConfigurationError(
            f"--rdzv-endpoint {format_address(host, port)!r}: port 0 is chosen by the hosting node; give the real port"
        )
    async with open_store_client(host, port) as client:
        seen = await StoreBackend(client, params.run_id).read_state()
    return _state(seen)


async def _read_etcd(params: RendezvousParameters) -> RendezvousState | None:
    # Imported here: the etcd driver pulls in httpx, which only an etcd rendezvous needs.
    from .etcd.client import open_etcd_client
    from .rendezvous.backends.etcd import EtcdBackend, etcd_setup

    _, settings = etcd_setup(params)
    async with open_etcd_client(settings.etcd) as client:
        # lease_ttl is never used: this reader grants no lease and writes nothing.
        seen = await EtcdBackend(client, settings.key_prefix, params.run_id, lease_ttl=1).get_state()
    return _state(seen)
