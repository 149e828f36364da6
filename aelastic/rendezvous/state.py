"""The rendezvous as a pure state machine: torch's ``DynamicRendezvousHandler`` semantics, with no I/O and no clocks.

Theory of operation
-------------------
Every node of a run shares one :class:`RendezvousState`, held by a backend that can compare-and-set it. A node
runs an *operation* (join, exit, close) as a loop that the driver (``dynamic.py``) performs: read the state, call
``decide_<op>(state, node, settings, timers, now)`` with the node's own timers and its own monotonic ``now``, and
get an :class:`Action`. A write action becomes the next state through :func:`apply` and is written with a
compare-and-set against the state it was decided on; a lost race hands back the newer state and the loop decides
again, so every write is decided on exactly the state it replaces. ``WAIT`` means there is nothing to write: wait
for the next change or the next local deadline. ``FINISH`` ends the operation; ``ERROR_CLOSED``,
``ERROR_TIMEOUT`` and ``GRACEFUL_EXIT`` end it with the matching error.

Decisions are ordered rules over named facts (:class:`Fact`) in the tables just below; the first rule whose facts
hold gives the action. :func:`apply` checks the action's precondition, stated over the same facts, and raises an
error naming the action, the node and the state when it does not hold.

Where this differs from torch, and why:

* The shared state holds no wall-clock time and no heartbeats, so nothing compares clocks of different hosts and
  a heartbeat never rewrites the state. Liveness is the driver's: it passes the nodes its backend found dead, and
  any node may evict them (``REMOVE_DEAD``), with the same epilogue as torch's ``_remove_participant_epilogue``.
* Deadlines are local and monotonic (:class:`NodeTimers`). The last-call window starts when *this node* first sees
  the round at ``min_nodes`` (:func:`update_timers`); the first participant whose window closes marks the round
  complete and the others read the completion, so windows differ only by how fast changes propagate.
* Ranks are fixed at completion (``rank_order``: rank = index) and stay put while the round lasts, even when a
  member is removed, so every node that finishes a round agrees on its rank and world size. Members of the
  previous completed round keep their relative order (a surviving rank 0 stays rank 0); newcomers follow in
  :class:`NodeDesc` order, which is torch's order for a first round.
* The join timeout is the fail-safe for a round that never reaches ``min_nodes``: a participant of a round at
  ``min_nodes`` stays until the last call ends (:func:`update_timers` holds its deadline), and a round ready to
  complete is completed before anyone's deadline is looked at. A node past its join deadline first takes itself
  out of the state, then reports the timeout (torch tries for 5 s and may leave a stale entry behind). Torch
  checks the deadline first, which lets staggered deadlines break up a quorum again and again.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import zlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final, NamedTuple
from urllib.parse import quote, unquote

from .._net import parse_endpoint
from ..errors import ConfigurationError, RendezvousStateError

__all__ = [
    "FORMAT_VERSION",
    "JOIN_REQUESTS",
    "WRITE_ACTIONS",
    "Action",
    "Digest",
    "JoinRequest",
    "NodeDesc",
    "NodeTimers",
    "RendezvousSettings",
    "RendezvousState",
    "StateView",
    "apply",
    "decide_close",
    "decide_exit",
    "decide_join",
    "decode_join_request",
    "decode_state",
    "decode_view",
    "encode_join_request",
    "encode_state",
    "fold_joins",
    "make_digest",
    "shard_of",
    "update_timers",
]

FORMAT_VERSION: Final = 3
"""The ``"v"`` field of the encoded state, of its digest and of join requests; a reader rejects any other value.
v2 added the digest (:func:`make_digest`): a reader of v1 state would not publish one, so the two must not share a
run. v3 added each node's bootstrap endpoint (``endpoints``, the ``"master"`` of the summary): a v2 node would
wait for a rank 0 that no longer publishes its address in the round's store."""


class Action(enum.Enum):
    """What a node does next. The write actions (:data:`WRITE_ACTIONS`) are turned into a new state by :func:`apply`."""

    ADD_TO_PARTICIPANTS = "add to participants"
    ADD_TO_WAIT_LIST = "add to wait list"
    ADD_TO_REDUNDANCY_LIST = "add to redundancy list"
    REMOVE_FROM_PARTICIPANTS = "remove from participants"
    REMOVE_FROM_WAIT_LIST = "remove from wait list"
    REMOVE_FROM_REDUNDANCY_LIST = "remove from redundancy list"
    MARK_COMPLETE = "mark the round complete"
    MARK_CLOSED = "mark the rendezvous closed"
    REMOVE_DEAD = "remove dead nodes"
    WAIT = "wait for the next change or the next local deadline"
    FINISH = "finish the operation"
    ERROR_CLOSED = "fail: the rendezvous is closed"
    ERROR_TIMEOUT = "fail: the deadline passed"
    GRACEFUL_EXIT = "exit: the rendezvous closed while this node was in reserve"

    @property
    def is_write(self) -> bool:
        """Whether the action changes the shared state (the driver applies it and compare-and-sets the result)."""
        return self in WRITE_ACTIONS


class Fact(enum.Enum):
    """What a decision looks at. Each value reads (when true, when false), for error messages."""

    CLOSED = ("the rendezvous is closed", "the rendezvous is open")
    COMPLETE = ("the round is complete", "the round is not complete")
    PARTICIPANT = ("the node is a participant", "the node is not a participant")
    WAITING = ("the node is on the wait list", "the node is not on the wait list")
    RESERVE = ("the node is on the redundancy list", "the node is not on the redundancy list")
    FULL = ("the round has max_nodes participants", "the round has fewer than max_nodes participants")
    QUORUM = ("the round has min_nodes participants", "the round has fewer than min_nodes participants")
    DEAD_LISTED = ("a node found dead is listed", "no node found dead is listed")
    EXPIRED = ("the operation's deadline passed", "the operation's deadline has not passed")
    LAST_CALL_OVER = ("the last-call window closed", "the last-call window is open")


class _Rule(NamedTuple):
    holds: frozenset[Fact]
    fails: frozenset[Fact]
    action: Action

    def matches(self, facts: frozenset[Fact]) -> bool:
        return self.holds <= facts and not (self.fails & facts)

    def unmet(self, facts: frozenset[Fact]) -> list[str]:
        return [f.value[0] for f in self.holds - facts] + [f.value[1] for f in self.fails & facts]


def _rule(condition: str, action: Action) -> _Rule:
    """``"complete !waiting"``: the named facts hold, those with ``!`` do not (a typo fails at import)."""
    words = condition.split()
    return _Rule(
        frozenset(Fact[w.upper()] for w in words if not w.startswith("!")),
        frozenset(Fact[w[1:].upper()] for w in words if w.startswith("!")),
        action,
    )


# --- the transition tables ----------------------------------------------------------------------------------------
# Decisions: the first rule whose condition holds gives the action. Join follows torch's _RendezvousJoinOp order,
# except that a round ready to complete is completed before this node's own deadline is looked at.

JOIN_RULES: Final[tuple[_Rule, ...]] = (
    _rule("closed reserve", Action.GRACEFUL_EXIT),
    _rule("closed", Action.ERROR_CLOSED),
    _rule("dead_listed", Action.REMOVE_DEAD),  # any node evicts on behalf of its driver's liveness finding
    _rule("reserve complete full", Action.WAIT),  # no deadline while in reserve (update_timers holds it off)
    _rule("reserve", Action.REMOVE_FROM_REDUNDANCY_LIST),  # a slot is free: come back as a late joiner
    _rule("complete participant", Action.FINISH),
    # A round that may complete does, even at this node's deadline (torch times out first): the join timeout is
    # the fail-safe for a round that cannot form, not a reason to break up one that has.
    _rule("participant full", Action.MARK_COMPLETE),
    _rule("participant quorum last_call_over", Action.MARK_COMPLETE),
    _rule("expired participant", Action.REMOVE_FROM_PARTICIPANTS),  # clean up first ...
    _rule("expired waiting", Action.REMOVE_FROM_WAIT_LIST),
    _rule("expired", Action.ERROR_TIMEOUT),  # ... then fail, no longer listed
    _rule("complete !waiting !full", Action.ADD_TO_WAIT_LIST),  # late: wait for the next round
    _rule("complete !waiting full", Action.ADD_TO_REDUNDANCY_LIST),  # late and no room: reserve
    _rule("complete", Action.WAIT),  # already waiting for the round to end
    _rule("participant", Action.WAIT),  # gathering: wait for more nodes or the end of the last call
    _rule("full", Action.WAIT),  # only with a peer whose max_nodes is larger: let the participants complete
    _rule("", Action.ADD_TO_PARTICIPANTS),
)

EXIT_RULES: Final[tuple[_Rule, ...]] = (
    _rule("participant", Action.REMOVE_FROM_PARTICIPANTS),
    _rule("waiting", Action.REMOVE_FROM_WAIT_LIST),
    _rule("reserve", Action.REMOVE_FROM_REDUNDANCY_LIST),
    _rule("", Action.FINISH),
)

CLOSE_RULES: Final[tuple[_Rule, ...]] = (
    _rule("closed", Action.FINISH),
    _rule("expired", Action.ERROR_TIMEOUT),
    _rule("", Action.MARK_CLOSED),
)

# Preconditions of the write actions; apply() raises when one does not hold. Every node is on at most one list.
REQUIRES: Final[Mapping[Action, _Rule]] = {
    Action.ADD_TO_PARTICIPANTS: _rule("!closed !complete !participant !reserve !full", Action.ADD_TO_PARTICIPANTS),
    Action.ADD_TO_WAIT_LIST: _rule("!closed complete !participant !waiting !reserve !full", Action.ADD_TO_WAIT_LIST),
    Action.ADD_TO_REDUNDANCY_LIST: _rule(
        "!closed complete !participant !waiting !reserve full", Action.ADD_TO_REDUNDANCY_LIST
    ),
    Action.REMOVE_FROM_PARTICIPANTS: _rule("participant", Action.REMOVE_FROM_PARTICIPANTS),
    Action.REMOVE_FROM_WAIT_LIST: _rule("waiting", Action.REMOVE_FROM_WAIT_LIST),
    Action.REMOVE_FROM_REDUNDANCY_LIST: _rule("reserve", Action.REMOVE_FROM_REDUNDANCY_LIST),
    Action.MARK_COMPLETE: _rule("!closed !complete participant quorum", Action.MARK_COMPLETE),
    Action.MARK_CLOSED: _rule("!closed", Action.MARK_CLOSED),
    Action.REMOVE_DEAD: _rule("dead_listed", Action.REMOVE_DEAD),
}

WRITE_ACTIONS: Final[frozenset[Action]] = frozenset(REQUIRES)


# --- values -------------------------------------------------------------------------------------------------------


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_endpoint(value: object, what: str, error: type[Exception]) -> str:
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
            if not _is_int(value) or value < 0:
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

    def __post_init__(self) -> None:
        if not isinstance(self.run_id, str) or not self.run_id:
            raise ConfigurationError(f"run_id={self.run_id!r}: must be a non-empty string")
        for name in ("min_nodes", "max_nodes", "keep_alive_max_attempt"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
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
    """The shared state of one run's rendezvous (what the backend holds, encoded by :func:`encode_state`).

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

    def __post_init__(self) -> None:
        if not _is_int(self.round) or self.round < 0:
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
        stray = set(self.endpoints) - seen - set(self.rank_order)
        if stray:
            raise RendezvousStateError(f"rendezvous state has endpoints of {_render(tuple(sorted(stray)))}: not listed")

    def __repr__(self) -> str:
        return (
            f"RendezvousState(round={self.round}, complete={self.complete}, closed={self.closed}, "
            f"participants={_render(self.participants)}, wait_list={_render(self.wait_list)}, "
            f"redundancy_list={_render(self.redundancy_list)}, rank_order={_render(self.rank_order)})"
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


# --- decisions ----------------------------------------------------------------------------------------------------


def _facts(
    state: RendezvousState | StateView,
    node: NodeDesc | None,
    settings: RendezvousSettings,
    dead: frozenset[NodeDesc] = frozenset(),
    timers: NodeTimers | None = None,
    now: float | None = None,
) -> frozenset[Fact]:
    n = len(state.participants)
    facts = {
        Fact.CLOSED: state.closed,
        Fact.COMPLETE: state.complete,
        Fact.PARTICIPANT: node in state.participants,
        Fact.WAITING: node in state.wait_list,
        Fact.RESERVE: node in state.redundancy_list,
        Fact.FULL: n >= settings.max_nodes,
        Fact.QUORUM: n >= settings.min_nodes,
        Fact.DEAD_LISTED: bool(dead) and not dead.isdisjoint(state.all_nodes()),
    }
    if timers is not None and now is not None:
        facts[Fact.EXPIRED] = now >= timers.join_deadline
        facts[Fact.LAST_CALL_OVER] = (
            timers.last_call_deadline is not None
            and timers.last_call_round == state.round
            and now >= timers.last_call_deadline
        )
    return frozenset(f for f, true in facts.items() if true)


def _first(rules: Iterable[_Rule], facts: frozenset[Fact]) -> Action:
    for rule in rules:
        if rule.matches(facts):
            return rule.action
    raise RendezvousStateError(f"no rule matches {sorted(f.name for f in facts)}")  # each table ends with a catch-all


def decide_join(
    state: RendezvousState | StateView,
    node: NodeDesc,
    settings: RendezvousSettings,
    timers: NodeTimers,
    now: float,
    dead: frozenset[NodeDesc] = frozenset(),
) -> Action:
    """The next step of ``node`` joining the next round (torch's ``_RendezvousJoinOp``, see ``JOIN_RULES``).

    ``now`` is the caller's monotonic clock, the one its ``timers`` are on; ``dead`` the nodes its driver found
    dead (if any is listed, the answer is ``REMOVE_DEAD``). ``FINISH`` means ``node`` is a member of the complete
    round: its rank is ``state.rank_of(node)``. ``timers`` must come from ``update_timers(..., node=node)`` on this
    same state; then a ``WAIT`` always has a wake-up time ahead (the earlier of the two deadlines).
    """
    return _first(JOIN_RULES, _facts(state, node, settings, dead, timers, now))


def decide_exit(
    state: RendezvousState | StateView,
    node: NodeDesc,
    settings: RendezvousSettings,
    timers: NodeTimers,
    now: float,
) -> Action:
    """The next step of ``node`` leaving: remove it from wherever it is listed, then ``FINISH``.

    ``timers`` and ``now`` keep the shape of the other ``decide_*``; leaving never times out, since it must not
    leave the node listed behind (each write either wins or shows a newer state, so it ends).
    """
    return _first(EXIT_RULES, _facts(state, node, settings, timers=timers, now=now))


def decide_close(
    state: RendezvousState | StateView, settings: RendezvousSettings, timers: NodeTimers, now: float
) -> Action:
    """The next step of closing the rendezvous: ``MARK_CLOSED`` until it is closed, then ``FINISH``.

    ``timers.join_deadline`` is the close deadline (``now + close_timeout`` when the operation began); past it,
    ``ERROR_TIMEOUT``.
    """
    return _first(CLOSE_RULES, _facts(state, None, settings, timers=timers, now=now))


# --- mutations ----------------------------------------------------------------------------------------------------


def _without(nodes: tuple[NodeDesc, ...], gone: frozenset[NodeDesc]) -> tuple[NodeDesc, ...]:
    return tuple(n for n in nodes if n not in gone)


def _kept_endpoints(endpoints: Mapping[NodeDesc, str], *lists: tuple[NodeDesc, ...]) -> dict[NodeDesc, str]:
    """The endpoints of the nodes on ``lists``: the lists and the rank order of the state about to be made."""
    kept = set().union(*lists)
    return {n: e for n, e in endpoints.items() if n in kept}


def _completed(state: RendezvousState) -> RendezvousState:
    """Mark the round complete and fix the ranks: the previous group's survivors first, in their old order."""
    previous = {n: i for i, n in enumerate(state.rank_order)}
    order = tuple(
        sorted(state.participants, key=lambda n: (0, previous[n], n) if n in previous else (1, 0, n)),
    )
    endpoints = _kept_endpoints(state.endpoints, order, state.wait_list, state.redundancy_list)
    return dataclasses.replace(state, complete=True, participants=order, rank_order=order, endpoints=endpoints)


def _removed(state: RendezvousState, gone: frozenset[NodeDesc]) -> RendezvousState:
    """Take ``gone`` off every list; torch's ``_remove_participant_epilogue`` after a participant leaves."""
    participants = _without(state.participants, gone)
    round_over = state.complete and not participants  # the last member of a completed round left
    wait_list, reserve = _without(state.wait_list, gone), _without(state.redundancy_list, gone)
    return dataclasses.replace(
        state,
        round=state.round + 1 if round_over else state.round,
        complete=state.complete and not round_over,
        participants=participants,
        wait_list=wait_list,
        redundancy_list=reserve,
        endpoints=_kept_endpoints(state.endpoints, participants, wait_list, reserve, state.rank_order),
    )


def _add_to_participants(state: RendezvousState, node: NodeDesc, settings: RendezvousSettings) -> RendezvousState:
    new = dataclasses.replace(
        state, participants=(*state.participants, node), wait_list=_without(state.wait_list, frozenset({node}))
    )
    # The max-th node completes the round in the same write, as torch does: no last call when the round is full.
    return _completed(new) if len(new.participants) >= settings.max_nodes else new


Mutation = Callable[[RendezvousState, NodeDesc, RendezvousSettings, frozenset[NodeDesc]], RendezvousState]

MUTATIONS: Final[Mapping[Action, Mutation]] = {
    Action.ADD_TO_PARTICIPANTS: lambda s, node, settings, dead: _add_to_participants(s, node, settings),
    Action.ADD_TO_WAIT_LIST: lambda s, node, settings, dead: dataclasses.replace(s, wait_list=(*s.wait_list, node)),
    Action.ADD_TO_REDUNDANCY_LIST: lambda s, node, settings, dead: dataclasses.replace(
        s, redundancy_list=(*s.redundancy_list, node)
    ),
    Action.REMOVE_FROM_PARTICIPANTS: lambda s, node, settings, dead: _removed(s, frozenset({node})),
    Action.REMOVE_FROM_WAIT_LIST: lambda s, node, settings, dead: _removed(s, frozenset({node})),
    Action.REMOVE_FROM_REDUNDANCY_LIST: lambda s, node, settings, dead: _removed(s, frozenset({node})),
    Action.MARK_COMPLETE: lambda s, node, settings, dead: _completed(s),
    Action.MARK_CLOSED: lambda s, node, settings, dead: dataclasses.replace(s, closed=True),
    Action.REMOVE_DEAD: lambda s, node, settings, dead: _removed(s, dead),
}


def apply(
    state: RendezvousState,
    action: Action,
    node: NodeDesc,
    settings: RendezvousSettings,
    dead: frozenset[NodeDesc] = frozenset(),
) -> RendezvousState:
    """The state after ``node`` performs the write ``action`` on ``state`` (``dead``: the nodes REMOVE_DEAD removes).

    Raises:
        RendezvousStateError: ``action`` is not a write action, or its precondition (``REQUIRES``) does not hold
            in ``state``; the message names the action, the node, the state and what is missing.
    """
    requires = REQUIRES.get(action)
    if requires is None:
        raise RendezvousStateError(
            f"{action.name} by {node.id} on {state!r}: not a write action, there is nothing to apply"
        )
    unmet = requires.unmet(_facts(state, node, settings, dead))
    if unmet:
        raise RendezvousStateError(
            f"{action.name} by {node.id} is illegal in {state!r}: requires {', and '.join(unmet)}"
        )
    return MUTATIONS[action](state, node, settings, dead)


# --- join requests ------------------------------------------------------------------------------------------------
# Joining is the one write every node makes, all at once when a job starts; N nodes compare-and-setting one state
# would cost O(N^2) attempts of an O(N) value. So a node that decides to add itself (ADD_TO_PARTICIPANTS, _WAIT_LIST,
# _REDUNDANCY_LIST) appends a small join request instead (the backend keeps requests in order beside the state),
# and every reader applies the requests pending on the state it read: the state a node decides on is
# ``fold_joins(committed state, pending requests)``. Any write (a compare-and-set) is decided on that folded state
# and consumes the requests it saw; a request appended after the read makes the write fail, so none is lost or
# applied twice. Each request is admitted with exactly the join decision (``JOIN_RULES``) a node not yet listed
# would take for itself, with the requester's own max_nodes, so every reader folds the same requests the same way.

JOIN_REQUESTS: Final[frozenset[Action]] = frozenset(
    {Action.ADD_TO_PARTICIPANTS, Action.ADD_TO_WAIT_LIST, Action.ADD_TO_REDUNDANCY_LIST}
)
"""The write actions a node performs by appending a join request rather than by a compare-and-set."""


@dataclass(frozen=True, slots=True)
class JoinRequest:
    """A node's request to be added to the state, with the ``max_nodes`` it was configured with and its bootstrap
    endpoint (``host:port``, already listening): where its workers' store is served if it becomes rank 0, so
    every member learns the address from the state that completes the round, with no lookup after it."""

    node: NodeDesc
    max_nodes: int
    endpoint: str | None = None

    def __post_init__(self) -> None:
        if not _is_int(self.max_nodes) or self.max_nodes < 1:
            raise ConfigurationError(f"JoinRequest.max_nodes={self.max_nodes!r}: must be an integer >= 1")
        if self.endpoint is not None:
            _check_endpoint(self.endpoint, "JoinRequest.endpoint", ConfigurationError)


def fold_joins(state: RendezvousState, requests: Iterable[JoinRequest]) -> RendezvousState:
    """``state`` with ``requests`` applied in order, as if each requester had written its own join.

    A request is admitted as :func:`decide_join` admits a node that has time left and is listed nowhere, or on the
    wait list of a round that is over: to the participants of a gathering round (the ``max_nodes``-th completes
    it, as :func:`apply` does), to the wait list of a complete round with room, to the redundancy list of a full
    one. It is dropped when the node is otherwise listed, when the rendezvous is closed, or while a gathering
    round is full; the node then decides again on what it reads. An admitted request's endpoint becomes its node's.
    Linear in the size of the state and the number of requests (moving a node off the wait list is linear in the
    wait list).
    """
    if state.closed:
        return state
    listed = set(state.all_nodes())
    participants, wait_list, reserve = list(state.participants), list(state.wait_list), list(state.redundancy_list)
    complete, rank_order, endpoints = state.complete, state.rank_order, dict(state.endpoints)
    changed = False
    for request in requests:
        node = request.node
        # Listed nodes are skipped, except one on the wait list once its round is over: it joins the next.
        if node in listed and (complete or node not in wait_list):
            continue
        full = len(participants) >= request.max_nodes
        if full and not complete:
            continue
        if request.endpoint is not None:
            endpoints[node] = request.endpoint
        if complete:
            (reserve if full else wait_list).append(node)
        else:
            if node in listed:
                wait_list.remove(node)
            participants.append(node)
            if len(participants) >= request.max_nodes:
                done = _completed(
                    dataclasses.replace(
                        state, participants=tuple(participants), wait_list=tuple(wait_list), endpoints=endpoints
                    )
                )
                participants, complete, rank_order = list(done.participants), True, done.rank_order
                endpoints = dict(done.endpoints)
        listed.add(node)
        changed = True
    if not changed:
        return state
    return dataclasses.replace(
        state,
        complete=complete,
        participants=tuple(participants),
        wait_list=tuple(wait_list),
        redundancy_list=tuple(reserve),
        rank_order=rank_order,
        endpoints=endpoints,
    )


# --- local timers -------------------------------------------------------------------------------------------------


def update_timers(
    timers: NodeTimers,
    state: RendezvousState | StateView,
    settings: RendezvousSettings,
    now: float,
    *,
    node: NodeDesc | None = None,
) -> NodeTimers:
    """This node's timers after it read ``state`` at ``now`` (its monotonic clock); call it after every read.

    The last call opens when this node first sees the round with ``min_nodes`` participants (and not complete):
    ``last_call_deadline = now + last_call_timeout``. It is kept while the same round stays at or above
    ``min_nodes`` and cleared when the round completes, closes, changes, or drops below ``min_nodes``.

    Pass ``node``; two things then move its join deadline (the driver must use the returned timers):

    * while it waits on the redundancy list, the deadline is held at ``now + join_timeout`` (torch waits in
      reserve without a deadline and restarts the join clock when a slot frees);
    * while it is a participant of a round at ``min_nodes``, the deadline is at least the end of the last call:
      the join timeout is the fail-safe for a round that never reaches ``min_nodes`` (torch's documented
      guarantee), so a node does not walk out of a quorum, and break it, while the last call runs.

    Every ``WAIT`` from :func:`decide_join` then has a wake-up time in the future: the earlier of
    ``join_deadline`` and ``last_call_deadline``.
    """
    join_deadline = timers.join_deadline
    if node is not None and not state.closed and node in state.redundancy_list:
        join_deadline = max(join_deadline, now + settings.join_timeout)
    gathering = not (state.complete or state.closed) and len(state.participants) >= settings.min_nodes
    if not gathering:
        last_call, last_round = None, None
    elif timers.last_call_deadline is not None and timers.last_call_round == state.round:
        last_call, last_round = timers.last_call_deadline, timers.last_call_round
    else:
        last_call, last_round = now + settings.last_call_timeout, state.round
    if last_call is not None and node is not None and node in state.participants:
        join_deadline = max(join_deadline, last_call)  # min_nodes was reached: the join lasts until the last call
    if (join_deadline, last_call, last_round) == (
        timers.join_deadline,
        timers.last_call_deadline,
        timers.last_call_round,
    ):
        return timers
    return NodeTimers(join_deadline, last_call, last_round)


# --- encoding -----------------------------------------------------------------------------------------------------
# {"v":3,"round":3,"complete":true,"closed":false,"nodes":[["10.0.0.1",4242,0],...],
#  "endpoints":["10.0.0.1:40123",null,...],"participants":[0,1],"wait_list":[2],"redundancy_list":[],
#  "rank_order":[0,1,3]}
# Each node appears once in "nodes" (sorted); "endpoints" pairs with it; the lists hold indices into it.

_LISTS: Final = ("participants", "wait_list", "redundancy_list", "rank_order")
_KEYS: Final = frozenset({"v", "round", "complete", "closed", "nodes", "endpoints", *_LISTS})


def encode_state(state: RendezvousState) -> bytes:
    """The state as compact, canonical JSON (UTF-8); see the format above."""
    table = sorted(set(state.all_nodes()) | set(state.rank_order))
    index = {n: i for i, n in enumerate(table)}
    doc: dict[str, object] = {
        "v": FORMAT_VERSION,
        "round": state.round,
        "complete": state.complete,
        "closed": state.closed,
        "nodes": [[n.addr, n.pid, n.local_id] for n in table],
        "endpoints": [state.endpoints.get(n) for n in table],
    }
    for name in _LISTS:
        doc[name] = [index[n] for n in getattr(state, name)]
    return json.dumps(doc, separators=(",", ":")).encode()


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    doc = dict(pairs)
    if len(doc) != len(pairs):
        keys = [k for k, _ in pairs]
        raise RendezvousStateError(f"rendezvous state has key {next(k for k in keys if keys.count(k) > 1)!r} twice")
    return doc


def _no_constant(name: str) -> object:
    raise RendezvousStateError(f"rendezvous state holds {name}: not a JSON value")


def decode_state(data: bytes) -> RendezvousState:
    """The state that :func:`encode_state` encoded as ``data``.

    Raises:
        RendezvousStateError: ``data`` is not the v3 JSON format (not UTF-8 JSON, another version, a missing,
            unknown or ill-typed field, an index out of range) or breaks a state invariant; the message says which.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise RendezvousStateError(f"rendezvous state is a {type(data).__name__}, not bytes")
    try:
        text = bytes(data).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RendezvousStateError(f"rendezvous state is not UTF-8 JSON ({exc.reason}): {bytes(data)[:40]!r}") from exc
    try:
        doc = json.loads(text, object_pairs_hook=_no_duplicate_keys, parse_constant=_no_constant)
    except json.JSONDecodeError as exc:
        raise RendezvousStateError(f"rendezvous state is not JSON ({exc}): {text[:40]!r}") from exc
    if not isinstance(doc, dict):
        raise RendezvousStateError(f"rendezvous state is a JSON {type(doc).__name__}, not an object: {text[:40]!r}")
    version = doc.get("v")
    if version != FORMAT_VERSION or not _is_int(version):
        raise RendezvousStateError(
            f"rendezvous state format v={version!r} is not v={FORMAT_VERSION}, the one this aelastic reads "
            "(are all nodes running the same aelastic version?)"
        )
    if doc.keys() != _KEYS:
        missing, unknown = sorted(_KEYS - doc.keys()), sorted(doc.keys() - _KEYS)
        raise RendezvousStateError(f"rendezvous state v{FORMAT_VERSION} fields: missing {missing}, unknown {unknown}")
    rnd = doc["round"]
    if not _is_int(rnd) or rnd < 0:
        raise RendezvousStateError(f"rendezvous state round={rnd!r}: must be an integer >= 0")
    for name in ("complete", "closed"):
        if not isinstance(doc[name], bool):
            raise RendezvousStateError(f"rendezvous state {name}={doc[name]!r}: must be true or false")
    table = _decode_nodes(doc["nodes"])
    endpoints = doc["endpoints"]
    if not isinstance(endpoints, list) or len(endpoints) != len(table):
        raise RendezvousStateError(f"rendezvous state endpoints: must be a list as long as nodes ({len(table)})")
    lists: dict[str, tuple[NodeDesc, ...]] = {}
    used: set[int] = set()
    for name in _LISTS:
        indices = doc[name]
        if not isinstance(indices, list) or not all(_is_int(i) and 0 <= i < len(table) for i in indices):
            raise RendezvousStateError(
                f"rendezvous state {name}={indices!r}: must be a list of indices into the {len(table)} nodes"
            )
        if len(set(indices)) != len(indices):
            raise RendezvousStateError(f"rendezvous state {name}={indices!r}: lists a node twice")
        used.update(indices)
        lists[name] = tuple(table[i] for i in indices)
    if len(used) != len(table):
        raise RendezvousStateError(f"rendezvous state nodes {sorted(set(range(len(table))) - used)} are on no list")
    known = {
        node: _check_endpoint(endpoint, f"rendezvous state endpoints[{i}]", RendezvousStateError)
        for i, (node, endpoint) in enumerate(zip(table, endpoints, strict=True))
        if endpoint is not None
    }
    return RendezvousState(round=rnd, complete=doc["complete"], closed=doc["closed"], endpoints=known, **lists)


def _decode_nodes(raw: object) -> list[NodeDesc]:
    if not isinstance(raw, list):
        raise RendezvousStateError(f"rendezvous state nodes={raw!r}: must be a list of [addr, pid, local_id]")
    table: list[NodeDesc] = []
    for i, entry in enumerate(raw):
        if not (
            isinstance(entry, list)
            and len(entry) == 3
            and isinstance(entry[0], str)
            and _is_int(entry[1])
            and _is_int(entry[2])
        ):
            raise RendezvousStateError(f"rendezvous state nodes[{i}]={entry!r}: must be [addr, pid, local_id]")
        try:
            table.append(NodeDesc(entry[0], entry[1], entry[2]))
        except ConfigurationError as exc:
            raise RendezvousStateError(f"rendezvous state nodes[{i}]={entry!r}: {exc}") from exc
    if len(set(table)) != len(table):
        raise RendezvousStateError("rendezvous state nodes: a node is listed twice")
    return table


def encode_join_request(request: JoinRequest) -> bytes:
    """A join request as compact JSON: ``[3,"addr",pid,local_id,max_nodes,"host:port" or null]`` (no newline)."""
    node = request.node
    doc = [FORMAT_VERSION, node.addr, node.pid, node.local_id, request.max_nodes, request.endpoint]
    return json.dumps(doc, separators=(",", ":")).encode()


def decode_join_request(data: bytes) -> JoinRequest:
    """The request :func:`encode_join_request` encoded as ``data``.

    Raises:
        RendezvousStateError: ``data`` is not a v3 request; the message shows it.
    """
    try:
        doc = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RendezvousStateError(f"rendezvous join request is not JSON: {bytes(data)[:60]!r}") from exc
    version = doc[0] if isinstance(doc, list) and doc and _is_int(doc[0]) else None
    if isinstance(doc, list) and version != FORMAT_VERSION:
        raise RendezvousStateError(
            f"rendezvous join request {bytes(data)[:60]!r}: format v={version!r} is not v={FORMAT_VERSION}, the one "
            "this aelastic reads (are all nodes running the same aelastic version?)"
        )
    if not (
        isinstance(doc, list)
        and len(doc) == 6
        and isinstance(doc[1], str)
        and all(map(_is_int, doc[2:5]))
        and (doc[5] is None or isinstance(doc[5], str))
    ):
        raise RendezvousStateError(
            f"rendezvous join request {bytes(data)[:60]!r}: not [{FORMAT_VERSION}, addr, pid, local_id, max_nodes, "
            "endpoint]"
        )
    try:
        return JoinRequest(NodeDesc(doc[1], doc[2], doc[3]), doc[4], doc[5])
    except ConfigurationError as exc:
        raise RendezvousStateError(f"rendezvous join request {bytes(data)[:60]!r}: {exc}") from exc


# --- digests: what a node reads instead of the whole state -----------------------------------------------------------
# Every node re-reading a state that lists every node costs O(N) bytes per node per change, O(N^2) per round. So
# each write also publishes a digest of the state it wrote: a summary of O(1) bytes (the round, its flags and the
# size of each list) and each node's position (its list, its rank, its liveness neighbour) in shards of at most
# SHARD_SIZE nodes, the node's shard chosen by a hash of its key. A node that only waits reads the summary and its
# shard, O(1) bytes, and decides on a StateView; a node about to write reads the whole state and decides again on it.
# "summary": {"v":3,"round":3,"complete":true,"closed":false,"participants":2,"wait_list":1,"redundancy_list":0,
#             "world_size":3,"shards":1,"master":"10.0.0.1:40123"}   (master: rank 0's endpoint, or null)
# a shard:   one line per node: "<key> <p|w|r> <rank or -> <neighbour key or ->"

SHARD_SIZE: Final = 64
_WHERE: Final = {"p": "participants", "w": "wait_list", "r": "redundancy_list"}
_SUMMARY_KEYS: Final = frozenset({
    "v", "round", "complete", "closed", "participants", "wait_list", "redundancy_list", "world_size", "shards",
    "master",
})  # fmt: skip


def shard_of(key: str, shards: int) -> int:
    """The shard that holds the position of the node whose :attr:`NodeDesc.key` is ``key``."""
    return zlib.crc32(key.encode()) % shards


class Digest(NamedTuple):
    """What a write publishes beside the state: the summary and the position shards (see above)."""

    summary: bytes
    shards: tuple[bytes, ...]


def make_digest(state: RendezvousState) -> Digest:
    """The digest of ``state``: O(1) bytes of summary and O(N) bytes of positions in ``ceil(N / SHARD_SIZE)`` shards.

    A node's liveness neighbour is the node before it in :class:`NodeDesc` order (the first watches the last), as
    the handler's liveness has it; ``-`` when the node is alone.
    """
    listed = state.all_nodes()
    count = max(1, -(-len(listed) // SHARD_SIZE))
    order = sorted(listed)
    before = {n: order[i - 1] for i, n in enumerate(order)} if len(order) > 1 else {}
    rank = {n: i for i, n in enumerate(state.rank_order)} if state.complete else {}
    lines: list[list[str]] = [[] for _ in range(count)]
    for code, name in _WHERE.items():
        for node in getattr(state, name):
            r = rank.get(node) if code == "p" else None
            n = before.get(node)
            lines[shard_of(node.key, count)].append(
                f"{node.key} {code} {'-' if r is None else r} {'-' if n is None else n.key}"
            )
    doc = {
        "v": FORMAT_VERSION,
        "round": state.round,
        "complete": state.complete,
        "closed": state.closed,
        "participants": len(state.participants),
        "wait_list": len(state.wait_list),
        "redundancy_list": len(state.redundancy_list),
        "world_size": state.world_size,
        "shards": count,
        "master": state.master,
    }
    summary = json.dumps(doc, separators=(",", ":")).encode()
    return Digest(summary, tuple("\n".join(ls).encode() for ls in lines))


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
    """One node's view of a state, from its digest: what :func:`decide_join`, :func:`decide_exit`,
    :func:`decide_close` and :func:`update_timers` look at, without the other nodes' names.

    Attributes:
        node: The viewing node; ``where`` is the list it is on (``None``: on none), ``rank`` its rank in a
            complete round, ``neighbour`` the node its liveness watches.
        summary: The decoded summary (round, flags, list sizes, world size, shard count).
        master: Rank 0's bootstrap endpoint in a complete round (:attr:`RendezvousState.master`).
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


def decode_view(node: NodeDesc, summary: bytes, shard: bytes | None) -> tuple[StateView, int]:
    """``node``'s view of a state from the digest's summary and the shard that holds ``node`` (``None`` when the
    state lists no node); also the number of shards, to find the shard of a later version.

    Raises:
        RendezvousStateError: the summary or the shard is not the v3 format; the message says which.
    """
    try:
        doc = json.loads(summary)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RendezvousStateError(f"rendezvous digest is not JSON: {bytes(summary)[:60]!r}") from exc
    version = doc.get("v") if isinstance(doc, dict) else None
    if version != FORMAT_VERSION or not _is_int(version):
        raise RendezvousStateError(
            f"rendezvous digest format v={version!r} is not v={FORMAT_VERSION}, the one this aelastic reads "
            "(are all nodes running the same aelastic version?)"
        )
    ints = ("round", "participants", "wait_list", "redundancy_list", "world_size", "shards")
    if doc.keys() != _SUMMARY_KEYS or not all(_is_int(doc[k]) and doc[k] >= 0 for k in ints):
        raise RendezvousStateError(f"rendezvous digest {bytes(summary)[:120]!r}: not the v{FORMAT_VERSION} summary")
    master = doc["master"]
    if master is not None:
        _check_endpoint(master, "rendezvous digest master", RendezvousStateError)
    where = rank = neighbour = None
    key = node.key
    for line in (shard or b"").decode(errors="replace").split("\n"):
        if line.startswith(key + " "):
            fields = line.split(" ")
            if len(fields) != 4 or fields[1] not in _WHERE:
                raise RendezvousStateError(f"rendezvous digest shard line {line[:120]!r}: not '<key> <p|w|r> ...'")
            where = _WHERE[fields[1]]
            rank = None if fields[2] == "-" else int(fields[2])
            neighbour = None if fields[3] == "-" else NodeDesc.from_key(fields[3])
            break
    view = StateView(
        node,
        doc["round"],
        bool(doc["complete"]),
        bool(doc["closed"]),
        (doc["participants"], doc["wait_list"], doc["redundancy_list"]),
        doc["world_size"],
        where,
        rank,
        neighbour,
        master,
    )
    return view, doc["shards"]
