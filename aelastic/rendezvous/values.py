"""The rendezvous's values, pure: a node (:class:`NodeDesc`), a run's settings (:class:`RendezvousSettings`), the
shared state (:class:`RendezvousState`), a node's own deadlines (:class:`NodeTimers`) and a node's view of a state
from its digest (:class:`StateView`). :mod:`.state` decides on them."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple
from urllib.parse import quote, unquote

from .._net import parse_endpoint
from ..errors import ConfigurationError, RendezvousStateError

__all__ = [
    "NodeDesc",
    "NodeTimers",
    "RendezvousSettings",
    "RendezvousState",
    "StateView",
    "check_endpoint",
    "is_int",
]


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_endpoint(value: object, what: str, error: type[Exception]) -> str:
    """``value`` if it is a ``host:port`` endpoint (an IPv6 host in brackets), else ``error`` naming ``what``."""
    try:
        if isinstance(value, str):
            parse_endpoint(value, None, what=what)
            return value
    except ConfigurationError as exc:
        raise error(str(exc)) from None
    raise error(f"{what}={value!r}: must be a 'host:port' string")


@dataclass(frozen=True, slots=True, order=True)
class NodeDesc:
    """One rendezvous participant: an agent process (torch's ``_NodeDesc``). Ordered by (addr, pid, local_id).

    ``local_id`` tells apart handlers of one process. :attr:`id` is torch's ``addr_pid_localid`` for display;
    :attr:`key` is the same, safe as a key component (no ``/``, ``:``, spaces). Both parse unambiguously from the
    right, since pid and local_id are integers; the encoded state stores the triple, never the string.
    """

    addr: str
    pid: int
    local_id: int

    def __post_init__(self) -> None:
        if not isinstance(self.addr, str) or not self.addr:
            raise ConfigurationError(f"NodeDesc.addr={self.addr!r}: must be a non-empty string")
        for name in ("pid", "local_id"):
            value = getattr(self, name)
            if not is_int(value) or value < 0:
                raise ConfigurationError(f"NodeDesc.{name}={value!r}: must be an integer >= 0")

    @property
    def id(self) -> str:
        """``addr_pid_localid``, as torch prints a node (an IPv6 address in brackets)."""
        addr = f"[{self.addr}]" if ":" in self.addr else self.addr
        return f"{addr}_{self.pid}_{self.local_id}"

    @property
    def key(self) -> str:
        """A key-safe id: the address percent-encoded (only ``A-Za-z0-9_.~%-`` remain), then ``_pid_localid``."""
        return f"{quote(self.addr, safe='')}_{self.pid}_{self.local_id}"

    @classmethod
    def from_key(cls, key: str) -> NodeDesc:
        """The node whose :attr:`key` is ``key``."""
        try:
            addr, pid, local_id = key.rsplit("_", 2)
            return cls(unquote(addr), int(pid), int(local_id))
        except (ValueError, ConfigurationError) as exc:
            raise ConfigurationError(f"node key {key!r}: not '<addr>_<pid>_<local_id>'") from exc

    def __str__(self) -> str:
        return self.id


@dataclass(frozen=True, slots=True)
class RendezvousSettings:
    """The protocol's settings, shared by every node of a run. Durations are seconds."""

    run_id: str
    min_nodes: int
    max_nodes: int
    join_timeout: float = 600.0
    last_call_timeout: float = 30.0
    close_timeout: float = 30.0
    keep_alive_interval: float = 5.0
    keep_alive_max_attempt: int = 3
    fast_quorum: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.fast_quorum, bool):
            raise ConfigurationError(f"fast_quorum={self.fast_quorum!r}: must be True or False")
        if not isinstance(self.run_id, str) or not self.run_id:
            raise ConfigurationError(f"run_id={self.run_id!r}: must be a non-empty string")
        for name in ("min_nodes", "max_nodes", "keep_alive_max_attempt"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise ConfigurationError(f"{name}={value!r}: must be an integer >= 1")
        if self.min_nodes > self.max_nodes:
            raise ConfigurationError(
                f"min_nodes={self.min_nodes}, max_nodes={self.max_nodes}: min_nodes must be <= max_nodes"
            )
        for name in ("join_timeout", "last_call_timeout", "close_timeout", "keep_alive_interval"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise ConfigurationError(f"{name}={value!r}: must be a number of seconds > 0")


def _render(nodes: tuple[NodeDesc, ...], limit: int = 8) -> str:
    shown = ", ".join(n.id for n in nodes[:limit])
    more = f", ... (+{len(nodes) - limit})" if len(nodes) > limit else ""
    return f"[{shown}{more}]"


@dataclass(frozen=True, slots=True)
class RendezvousState:
    """The shared state of one run's rendezvous (what the backend holds, encoded by :func:`~.codec.encode_state`).

    Attributes:
        round: The round number; a round ends when the last participant of a completed round leaves.
        complete: Whether this round's group is formed (no one joins it any more).
        closed: Whether the run is over; no round completes after this.
        participants: The nodes of this round. In a complete round, in rank order (a subsequence of
            ``rank_order``: members may be removed, never added); before completion, in order of joining.
        wait_list: Late nodes (the round was complete) waiting for the next round; torch's ``num_nodes_waiting``.
        redundancy_list: Late nodes beyond ``max_nodes``, in reserve until a slot frees.
        rank_order: The nodes of the latest completed round at its completion; index = rank. While the round is
            complete it is this round's; after, it is kept so the next round keeps the survivors' relative order.
        endpoints: The bootstrap endpoint (``host:port``) of each listed or ranked node that sent one with its join
            request; :attr:`master` is rank 0's.
        lost: The members of ``rank_order`` found dead (``REMOVE_DEAD``) since it was fixed, in order of removal;
            emptied when a round completes. What the fast quorum (:func:`~.state.regrouped`) waits without.
    """

    round: int = 0
    complete: bool = False
    closed: bool = False
    participants: tuple[NodeDesc, ...] = ()
    wait_list: tuple[NodeDesc, ...] = ()
    redundancy_list: tuple[NodeDesc, ...] = ()
    rank_order: tuple[NodeDesc, ...] = ()
    # Compared, not hashed (a dict is not hashable): the state stays a hashable value, as its other fields allow.
    endpoints: Mapping[NodeDesc, str] = dataclasses.field(default_factory=dict, hash=False)
    lost: tuple[NodeDesc, ...] = ()

    def __post_init__(self) -> None:
        if not is_int(self.round) or self.round < 0:
            raise RendezvousStateError(f"rendezvous state round={self.round!r}: must be an integer >= 0")
        seen: set[NodeDesc] = set()
        for name in ("participants", "wait_list", "redundancy_list"):
            nodes = getattr(self, name)
            if not isinstance(nodes, tuple):
                raise RendezvousStateError(f"rendezvous state {name}={nodes!r}: must be a tuple of NodeDesc")
            for node in nodes:
                if node in seen:
                    raise RendezvousStateError(
                        f"rendezvous state lists {node.id} twice ({name}): a node is on one list at most once"
                    )
                seen.add(node)
        if len(set(self.rank_order)) != len(self.rank_order):
            raise RendezvousStateError(f"rendezvous state rank_order={_render(self.rank_order)}: has duplicates")
        if self.complete:
            if not self.participants:
                raise RendezvousStateError(
                    f"rendezvous state round {self.round} is complete with no participants: "
                    "the round should have moved on"
                )
            if not _is_subsequence(self.participants, self.rank_order):
                raise RendezvousStateError(
                    f"rendezvous state round {self.round} is complete but participants={_render(self.participants)} "
                    f"are not in rank_order={_render(self.rank_order)}"
                )
        if not isinstance(self.lost, tuple) or len(set(self.lost)) != len(self.lost):
            raise RendezvousStateError(f"rendezvous state lost={self.lost!r}: must be a tuple of distinct NodeDesc")
        if not set(self.lost) <= set(self.rank_order):
            raise RendezvousStateError(
                f"rendezvous state lost={_render(self.lost)}: not all in rank_order={_render(self.rank_order)}"
            )
        stray = set(self.endpoints) - seen - set(self.rank_order)
        if stray:
            raise RendezvousStateError(f"rendezvous state has endpoints of {_render(tuple(sorted(stray)))}: not listed")

    def __repr__(self) -> str:
        return (
            f"RendezvousState(round={self.round}, complete={self.complete}, closed={self.closed}, "
            f"participants={_render(self.participants)}, wait_list={_render(self.wait_list)}, "
            f"redundancy_list={_render(self.redundancy_list)}, rank_order={_render(self.rank_order)}"
            + (f", lost={_render(self.lost)})" if self.lost else ")")
        )

    def rank_of(self, node: NodeDesc) -> int | None:
        """The node's rank in the completed round; ``None`` if the round is not complete or the node not in it."""
        if not self.complete or node not in self.participants:
            return None
        return self.rank_order.index(node)

    @property
    def world_size(self) -> int:
        """The completed group's size (ranks are ``0..world_size-1``); before completion, the participants so far."""
        return len(self.rank_order) if self.complete else len(self.participants)

    @property
    def num_waiting(self) -> int:
        """Late nodes waiting for the next round (torch counts the wait list only, not the redundancy list)."""
        return len(self.wait_list)

    def all_nodes(self) -> tuple[NodeDesc, ...]:
        """Every node the state lists: participants, then the wait list, then the redundancy list."""
        return self.participants + self.wait_list + self.redundancy_list

    @property
    def master(self) -> str | None:
        """The bootstrap endpoint (``host:port``) of the complete round's rank 0: where its workers' store is served.
        ``None`` before completion, or when rank 0 joined without one (a state built by hand)."""
        return self.endpoints.get(self.rank_order[0]) if self.complete else None


def _is_subsequence(items: tuple[NodeDesc, ...], of: tuple[NodeDesc, ...]) -> bool:
    it = iter(of)
    return all(item in it for item in items)  # `in` advances the iterator: order is checked too


@dataclass(frozen=True, slots=True)
class NodeTimers:
    """One node's local deadlines, on its own monotonic clock (never written to the shared state).

    Attributes:
        join_deadline: When the current operation gives up (join: ``join_timeout``; close: ``close_timeout``).
        last_call_deadline: When this node may mark the round complete with ``min_nodes <= participants <
            max_nodes``; set and cleared by :func:`update_timers`.
        last_call_round: The round the last-call deadline belongs to.
    """

    join_deadline: float
    last_call_deadline: float | None = None
    last_call_round: int | None = None

    def __post_init__(self) -> None:
        if math.isnan(self.join_deadline):
            raise ConfigurationError("NodeTimers.join_deadline=nan: must be a time")
        if (self.last_call_deadline is None) != (self.last_call_round is None):
            raise ConfigurationError(
                f"NodeTimers last_call_deadline={self.last_call_deadline!r}, last_call_round="
                f"{self.last_call_round!r}: set both or neither"
            )


class _Listed:
    """One list of a :class:`StateView`: its length, and whether the viewing node is on it."""

    __slots__ = ("_length", "_node")

    def __init__(self, length: int, node: NodeDesc | None) -> None:
        self._length, self._node = length, node

    def __len__(self) -> int:
        return self._length

    def __contains__(self, item: object) -> bool:
        return self._node is not None and item == self._node


class StateView(NamedTuple):
    """One node's view of a state, from its digest: what :func:`~.state.decide_join`, :func:`~.state.decide_exit`,
    :func:`~.state.decide_close` and :func:`~.state.update_timers` look at, without the other nodes' names.

    Attributes:
        node: The viewing node; ``where`` is the list it is on (``None``: on none), ``rank`` its rank in a
            complete round, ``neighbour`` the node its liveness watches.
        summary: The decoded summary (round, flags, list sizes, world size, shard count).
        master: Rank 0's bootstrap endpoint in a complete round (:attr:`RendezvousState.master`).
        regrouped: :func:`~.state.regrouped` of the state; ``survivors``: :func:`~.state.survivors` of the state.
    """

    node: NodeDesc
    round: int
    complete: bool
    closed: bool
    sizes: tuple[int, int, int]
    world_size: int
    where: str | None = None
    rank: int | None = None
    neighbour: NodeDesc | None = None
    master: str | None = None
    regrouped: bool = False
    survivors: int = 0

    def _list(self, index: int, name: str) -> _Listed:
        return _Listed(self.sizes[index], self.node if self.where == name else None)

    @property
    def participants(self) -> _Listed:
        return self._list(0, "participants")

    @property
    def wait_list(self) -> _Listed:
        return self._list(1, "wait_list")

    @property
    def redundancy_list(self) -> _Listed:
        return self._list(2, "redundancy_list")

    @property
    def num_waiting(self) -> int:
        return self.sizes[1]

    def all_nodes(self) -> tuple[NodeDesc, ...]:
        """The nodes this view knows are listed: the viewing node, if it is."""
        return (self.node,) if self.where is not None else ()

    def rank_of(self, node: NodeDesc) -> int | None:
        return self.rank if node == self.node and self.complete and self.where == "participants" else None
