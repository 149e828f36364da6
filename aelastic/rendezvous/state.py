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

This module holds the rule tables and the decisions over the values of ``values.py`` (:class:`NodeDesc`,
:class:`RendezvousState`, :class:`NodeTimers`, a node's :class:`StateView`); ``joins.py`` folds join requests into
a state, and ``codec.py`` turns states, join requests and digests into bytes and back.

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
* Fast quorum (torchft's name): a round that follows the loss of a member (a member of the last completed round
  found dead, recorded in ``lost``) completes as soon as every surviving member of that round is back and no node
  waits or stands in reserve (:func:`regrouped`), instead of waiting out the last call for nodes that cannot come.
  Nodes that waited for the next round are expected as usual; a first round, and a re-rendezvous without a loss,
  keep torch's last call. ``RendezvousSettings.fast_quorum=False`` (``--rdzv-conf fast_quorum=false``) restores
  torch's rule.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Iterable, Mapping
from typing import Final, NamedTuple

from ..errors import RendezvousStateError
from .values import NodeDesc, NodeTimers, RendezvousSettings, RendezvousState, StateView

__all__ = [
    "WRITE_ACTIONS",
    "Action",
    "Fact",
    "apply",
    "completed",
    "decide_close",
    "decide_exit",
    "decide_join",
    "regrouped",
    "survivors",
    "update_timers",
]


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
    REGROUPED = (
        "every surviving member of the last round is back after a loss (fast quorum)",
        "no fast quorum: no member lost, a survivor not back yet, a node waiting, or fast_quorum=false",
    )


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
    # Fast quorum: after a loss, the survivors (and the nodes that waited for this round) are all back: no one
    # else is coming whom the last call would wait for.
    _rule("participant quorum regrouped", Action.MARK_COMPLETE),
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


# --- fast quorum ----------------------------------------------------------------------------------------------------


def survivors(state: RendezvousState) -> int:
    """How many members of the last completed round survive a loss that this gathering round follows (0: no such
    loss, so no fast quorum; or the round is complete or closed)."""
    if state.complete or state.closed or not state.lost:
        return 0
    return len(state.rank_order) - len(state.lost)


def regrouped(state: RendezvousState | StateView) -> bool:
    """Whether the round may complete by fast quorum: it follows the loss of a member of the last completed round,
    every surviving member of that round is a participant again, and no node waits for the round or stands in
    reserve (they join as usual, and are expected). The fast quorum rule also needs ``min_nodes`` participants."""
    if isinstance(state, StateView):
        return state.regrouped
    if not survivors(state) or state.wait_list or state.redundancy_list:
        return False
    back, gone = set(state.participants), set(state.lost)
    return all(n in back for n in state.rank_order if n not in gone)


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
        Fact.REGROUPED: settings.fast_quorum and regrouped(state),
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


def completed(state: RendezvousState) -> RendezvousState:
    """Mark the round complete and fix the ranks: the previous group's survivors first, in their old order."""
    previous = {n: i for i, n in enumerate(state.rank_order)}
    order = tuple(
        sorted(state.participants, key=lambda n: (0, previous[n], n) if n in previous else (1, 0, n)),
    )
    endpoints = _kept_endpoints(state.endpoints, order, state.wait_list, state.redundancy_list)
    return dataclasses.replace(state, complete=True, participants=order, rank_order=order, endpoints=endpoints, lost=())


def _removed(state: RendezvousState, gone: frozenset[NodeDesc], *, dead: bool = False) -> RendezvousState:
    """Take ``gone`` off every list; torch's ``_remove_participant_epilogue`` after a participant leaves.
    ``dead``: they were found dead; those of them that are members of ``rank_order`` are recorded as ``lost``."""
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
        lost=state.lost + tuple(n for n in state.rank_order if dead and n in gone and n not in state.lost),
    )


def _add_to_participants(state: RendezvousState, node: NodeDesc, settings: RendezvousSettings) -> RendezvousState:
    new = dataclasses.replace(
        state, participants=(*state.participants, node), wait_list=_without(state.wait_list, frozenset({node}))
    )
    # The max-th node completes the round in the same write, as torch does: no last call when the round is full.
    return completed(new) if len(new.participants) >= settings.max_nodes else new


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
    Action.MARK_COMPLETE: lambda s, node, settings, dead: completed(s),
    Action.MARK_CLOSED: lambda s, node, settings, dead: dataclasses.replace(s, closed=True),
    Action.REMOVE_DEAD: lambda s, node, settings, dead: _removed(s, dead, dead=True),
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
