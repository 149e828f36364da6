"""The pure rendezvous state machine: decision tables, mutations, the codec, and a simulated cluster (hypothesis).

The simulation runs N nodes against one compare-and-set register, each node on its own monotonic clock (an offset
from world time) and acting on its own, possibly stale, view; it checks the rendezvous guarantees after every write
(one group per round, dense ranks, at most max_nodes, nothing completes after close, survivors keep their order)
and that rounds complete once enough live nodes keep trying.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from aelastic._net import format_address
from aelastic.errors import ConfigurationError, RendezvousStateError
from aelastic.rendezvous import state as sm
from aelastic.rendezvous.codec import (
    SHARD_SIZE,
    decode_join_request,
    decode_state,
    decode_view,
    encode_join_request,
    encode_state,
    make_digest,
    shard_of,
)
from aelastic.rendezvous.joins import JOIN_REQUESTS, JoinRequest, fold_joins
from aelastic.rendezvous.state import (
    WRITE_ACTIONS,
    Action,
    apply,
    decide_close,
    decide_exit,
    decide_join,
    update_timers,
)
from aelastic.rendezvous.values import NodeDesc, NodeTimers, RendezvousSettings, RendezvousState

A, B, C, D, E = (NodeDesc("10.0.0.1", pid, 0) for pid in (100, 200, 300, 400, 500))
ME = NodeDesc("10.0.0.9", 900, 0)
CFG = RendezvousSettings("run", min_nodes=2, max_nodes=3, join_timeout=100.0, last_call_timeout=10.0)
NOW = 50.0
T = NodeTimers(join_deadline=100.0)  # not expired at NOW
EXPIRED = NodeTimers(join_deadline=NOW)  # expired at NOW (the deadline is inclusive)
CALL_OPEN = NodeTimers(join_deadline=100.0, last_call_deadline=NOW + 1, last_call_round=0)
CALL_OVER = NodeTimers(join_deadline=100.0, last_call_deadline=NOW, last_call_round=0)
CALL_OVER_OLD_ROUND = NodeTimers(join_deadline=100.0, last_call_deadline=NOW - 5, last_call_round=7)


def S(**kw: object) -> RendezvousState:  # a constructor, in the tables
    return RendezvousState(**kw)  # type: ignore[arg-type]


def done(*group: NodeDesc, **kw: object) -> RendezvousState:
    """A complete round whose group (rank order) is ``group``."""
    return RendezvousState(complete=True, participants=group, rank_order=group, **kw)  # type: ignore[arg-type]


# --- decisions --------------------------------------------------------------------------------------------------

# (why, state, timers, dead, expected) for ME
JOIN_CASES: list[tuple[str, RendezvousState, NodeTimers, frozenset[NodeDesc], Action]] = [
    ("closed, in reserve", done(A, B, C, closed=True, redundancy_list=(ME,)), T, frozenset(), Action.GRACEFUL_EXIT),
    ("closed", S(closed=True), T, frozenset(), Action.ERROR_CLOSED),
    ("closed, even as a member", done(A, ME, closed=True), T, frozenset(), Action.ERROR_CLOSED),
    ("closed wins over dead nodes", S(closed=True, participants=(A,)), T, frozenset({A}), Action.ERROR_CLOSED),
    ("a dead participant is listed", S(participants=(A, ME)), T, frozenset({A}), Action.REMOVE_DEAD),
    ("a dead waiter is listed", done(B, C, wait_list=(A,)), T, frozenset({A}), Action.REMOVE_DEAD),
    ("dead but not listed: ignored", S(), T, frozenset({A}), Action.ADD_TO_PARTICIPANTS),
    ("reserve, round complete and full", done(A, B, C, redundancy_list=(ME,)), EXPIRED, frozenset(), Action.WAIT),
    ("reserve, a slot freed", done(A, B, redundancy_list=(ME,)), T, frozenset(), Action.REMOVE_FROM_REDUNDANCY_LIST),
    ("reserve, round over", S(round=1, redundancy_list=(ME,)), T, frozenset(), Action.REMOVE_FROM_REDUNDANCY_LIST),
    ("member of the complete round", done(A, ME), T, frozenset(), Action.FINISH),
    ("member, even past the deadline", done(A, ME), EXPIRED, frozenset(), Action.FINISH),
    ("past deadline, participant", S(participants=(ME,)), EXPIRED, frozenset(), Action.REMOVE_FROM_PARTICIPANTS),
    ("past deadline, waiting", done(A, B, wait_list=(ME,)), EXPIRED, frozenset(), Action.REMOVE_FROM_WAIT_LIST),
    ("past deadline, not listed", S(participants=(A,)), EXPIRED, frozenset(), Action.ERROR_TIMEOUT),
    ("late, room in the next round", done(A, B), T, frozenset(), Action.ADD_TO_WAIT_LIST),
    ("late, round full", done(A, B, C), T, frozenset(), Action.ADD_TO_REDUNDANCY_LIST),
    ("late, already waiting", done(A, B, wait_list=(ME,)), T, frozenset(), Action.WAIT),
    ("participant, round full", S(participants=(A, B, ME)), T, frozenset(), Action.MARK_COMPLETE),
    ("participant, last call over", S(participants=(A, ME)), CALL_OVER, frozenset(), Action.MARK_COMPLETE),
    (
        "participant past its deadline, last call over",
        S(participants=(A, ME)),
        dataclasses.replace(CALL_OVER, join_deadline=NOW),
        frozenset(),
        Action.MARK_COMPLETE,
    ),
    (
        "participant past its deadline, round full",
        S(participants=(A, B, ME)),
        EXPIRED,
        frozenset(),
        Action.MARK_COMPLETE,
    ),
    ("participant, last call open", S(participants=(A, ME)), CALL_OPEN, frozenset(), Action.WAIT),
    # Fast quorum: A, ME, C were the last round; C was lost; A and ME are back: no need to wait out the last call.
    (
        "after a loss, every survivor back",
        S(round=1, participants=(A, ME), rank_order=(A, ME, C), lost=(C,)),
        CALL_OPEN,
        frozenset(),
        Action.MARK_COMPLETE,
    ),
    (
        "after a loss, a survivor not back yet",
        S(round=1, participants=(A, ME), rank_order=(A, ME, B, C), lost=(C,)),
        CALL_OPEN,
        frozenset(),
        Action.WAIT,
    ),
    (
        "after a loss, survivors back but a node waits to join",
        S(round=1, participants=(A, ME), wait_list=(D,), rank_order=(A, ME, C), lost=(C,)),
        CALL_OPEN,
        frozenset(),
        Action.WAIT,
    ),
    (
        "after a loss, survivors and a newcomer back",
        S(round=1, participants=(D, A, ME), rank_order=(A, ME, B, C), lost=(B, C)),
        CALL_OPEN,
        frozenset(),
        Action.MARK_COMPLETE,
    ),
    (
        "after a loss, survivors back but below min_nodes",
        S(round=1, participants=(ME,), rank_order=(ME, C), lost=(C,)),
        T,
        frozenset(),
        Action.WAIT,
    ),
    (
        "no loss: the last call as torch",
        S(round=1, participants=(A, ME), rank_order=(A, ME)),
        CALL_OPEN,
        frozenset(),
        Action.WAIT,
    ),
    (
        "every member lost: newcomers wait for the last call",
        S(round=1, participants=(A, ME), rank_order=(B, C), lost=(B, C)),
        CALL_OPEN,
        frozenset(),
        Action.WAIT,
    ),
    ("participant, an old round's last call", S(participants=(A, ME)), CALL_OVER_OLD_ROUND, frozenset(), Action.WAIT),
    ("participant, below min_nodes", S(participants=(ME,)), CALL_OVER, frozenset(), Action.WAIT),
    ("participant, no last call yet", S(participants=(A, ME)), T, frozenset(), Action.WAIT),
    ("a peer's larger max filled the round", S(participants=(A, B, C, D)), T, frozenset(), Action.WAIT),
    ("newcomer", S(), T, frozenset(), Action.ADD_TO_PARTICIPANTS),
    ("newcomer, round gathering", S(participants=(A, B)), T, frozenset(), Action.ADD_TO_PARTICIPANTS),
    ("waiting, the round moved on", S(round=1, wait_list=(ME,)), T, frozenset(), Action.ADD_TO_PARTICIPANTS),
]

EXIT_CASES: list[tuple[str, RendezvousState, Action]] = [
    ("participant of a complete round", done(A, ME), Action.REMOVE_FROM_PARTICIPANTS),
    ("participant of a gathering round", S(participants=(ME,)), Action.REMOVE_FROM_PARTICIPANTS),
    ("participant of a closed rendezvous", done(ME, closed=True), Action.REMOVE_FROM_PARTICIPANTS),
    ("waiting", done(A, wait_list=(ME,)), Action.REMOVE_FROM_WAIT_LIST),
    ("in reserve", done(A, B, C, redundancy_list=(ME,)), Action.REMOVE_FROM_REDUNDANCY_LIST),
    ("not listed", done(A, B), Action.FINISH),
    ("nothing yet", S(), Action.FINISH),
]

CLOSE_CASES: list[tuple[str, RendezvousState, NodeTimers, Action]] = [
    ("already closed", S(closed=True), EXPIRED, Action.FINISH),
    ("open, past the close deadline", done(A), EXPIRED, Action.ERROR_TIMEOUT),
    ("open", done(A), T, Action.MARK_CLOSED),
    ("open, nothing yet", S(), T, Action.MARK_CLOSED),
]


@pytest.mark.parametrize(("why", "state", "timers", "dead", "expected"), JOIN_CASES, ids=[c[0] for c in JOIN_CASES])
def test_decide_join(
    why: str, state: RendezvousState, timers: NodeTimers, dead: frozenset[NodeDesc], expected: Action
) -> None:
    assert decide_join(state, ME, CFG, timers, NOW, dead) is expected, why


@pytest.mark.parametrize(("why", "state", "expected"), EXIT_CASES, ids=[c[0] for c in EXIT_CASES])
@pytest.mark.parametrize("timers", [T, EXPIRED], ids=["in time", "expired"])
def test_decide_exit(why: str, state: RendezvousState, expected: Action, timers: NodeTimers) -> None:
    # Leaving never times out: a node must not stay listed behind itself.
    assert decide_exit(state, ME, CFG, timers, NOW) is expected, why


@pytest.mark.parametrize(("why", "state", "timers", "expected"), CLOSE_CASES, ids=[c[0] for c in CLOSE_CASES])
def test_decide_close(why: str, state: RendezvousState, timers: NodeTimers, expected: Action) -> None:
    assert decide_close(state, CFG, timers, NOW) is expected, why


def _matched_rule(rules: tuple[sm._Rule, ...], facts: frozenset[sm.Fact]) -> int:
    return next(i for i, r in enumerate(rules) if r.matches(facts))


def test_every_rule_and_every_action_is_reachable() -> None:
    join_hits = {
        _matched_rule(sm.JOIN_RULES, sm._facts(s, ME, CFG, dead, timers, NOW)) for _, s, timers, dead, _ in JOIN_CASES
    }
    exit_hits = {_matched_rule(sm.EXIT_RULES, sm._facts(s, ME, CFG, frozenset(), T, NOW)) for _, s, _ in EXIT_CASES}
    close_hits = {
        _matched_rule(sm.CLOSE_RULES, sm._facts(s, None, CFG, frozenset(), t, NOW)) for _, s, t, _ in CLOSE_CASES
    }
    assert join_hits == set(range(len(sm.JOIN_RULES)))
    assert exit_hits == set(range(len(sm.EXIT_RULES)))
    assert close_hits == set(range(len(sm.CLOSE_RULES)))
    reached = {c[-1] for c in JOIN_CASES} | {c[-1] for c in EXIT_CASES} | {c[-1] for c in CLOSE_CASES}
    assert reached == set(Action)
    assert set(sm.MUTATIONS) == WRITE_ACTIONS == {a for a in Action if a.is_write}


def test_rule_tables_name_real_facts() -> None:
    with pytest.raises(KeyError):
        sm._rule("complete !wating", Action.WAIT)


# --- mutations --------------------------------------------------------------------------------------------------

CFG14 = RendezvousSettings("run", min_nodes=1, max_nodes=4)

# (why, state, action, actor, dead, expected)
APPLY_CASES: list[tuple[str, RendezvousState, Action, NodeDesc, frozenset[NodeDesc], RendezvousState]] = [
    (
        "join a gathering round",
        S(participants=(B,)),
        Action.ADD_TO_PARTICIPANTS,
        A,
        frozenset(),
        S(participants=(B, A)),
    ),
    (
        "a waiter joins the next round",
        S(round=1, participants=(B,), wait_list=(C, A)),
        Action.ADD_TO_PARTICIPANTS,
        A,
        frozenset(),
        S(round=1, participants=(B, A), wait_list=(C,)),
    ),
    (
        "the max-th node completes the round in the same write",
        S(participants=(D, B, C)),
        Action.ADD_TO_PARTICIPANTS,
        A,
        frozenset(),
        done(A, B, C, D),
    ),
    ("late: wait", done(A), Action.ADD_TO_WAIT_LIST, E, frozenset(), done(A, wait_list=(E,))),
    (
        "late, full: reserve",
        done(A, B, C, D, wait_list=(E,)),
        Action.ADD_TO_REDUNDANCY_LIST,
        ME,
        frozenset(),
        done(A, B, C, D, wait_list=(E,), redundancy_list=(ME,)),
    ),
    (
        "leave a gathering round",
        S(participants=(A, B)),
        Action.REMOVE_FROM_PARTICIPANTS,
        A,
        frozenset(),
        S(participants=(B,)),
    ),
    (
        "leave a complete round: ranks stay put",
        done(A, B, C),
        Action.REMOVE_FROM_PARTICIPANTS,
        A,
        frozenset(),
        RendezvousState(complete=True, participants=(B, C), rank_order=(A, B, C)),
    ),
    (
        "the last member leaves: the next round begins",
        RendezvousState(round=4, complete=True, participants=(B,), wait_list=(D,), rank_order=(A, B, C)),
        Action.REMOVE_FROM_PARTICIPANTS,
        B,
        frozenset(),
        RendezvousState(round=5, participants=(), wait_list=(D,), rank_order=(A, B, C)),
    ),
    ("stop waiting", done(A, wait_list=(B, C)), Action.REMOVE_FROM_WAIT_LIST, B, frozenset(), done(A, wait_list=(C,))),
    (
        "leave the reserve",
        done(A, redundancy_list=(B, C)),
        Action.REMOVE_FROM_REDUNDANCY_LIST,
        C,
        frozenset(),
        done(A, redundancy_list=(B,)),
    ),
    (
        "complete: first round in node order",
        S(participants=(C, A, B)),
        Action.MARK_COMPLETE,
        C,
        frozenset(),
        done(A, B, C),
    ),
    (
        "complete: survivors keep their order, newcomers follow in node order",
        S(round=2, participants=(E, A, D, C), rank_order=(D, B, A)),
        Action.MARK_COMPLETE,
        E,
        frozenset(),
        RendezvousState(round=2, complete=True, participants=(D, A, C, E), rank_order=(D, A, C, E)),
    ),
    ("close", done(A), Action.MARK_CLOSED, B, frozenset(), done(A, closed=True)),
    (
        "evict the dead from every list",
        done(A, B, wait_list=(C,), redundancy_list=(D,)),
        Action.REMOVE_DEAD,
        A,
        frozenset({B, C, D, E}),
        RendezvousState(complete=True, participants=(A,), rank_order=(A, B), lost=(B,)),  # B was a member
    ),
    (
        "evicting the last members ends the round",
        done(A, B, wait_list=(C,)),
        Action.REMOVE_DEAD,
        C,
        frozenset({A, B}),
        RendezvousState(round=1, wait_list=(C,), rank_order=(A, B), lost=(A, B)),
    ),
    (
        "evict from a gathering round",
        S(participants=(A, B)),
        Action.REMOVE_DEAD,
        B,
        frozenset({A}),
        S(participants=(B,)),
    ),
]


@pytest.mark.parametrize(
    ("why", "state", "action", "actor", "dead", "expected"), APPLY_CASES, ids=[c[0] for c in APPLY_CASES]
)
def test_apply(
    why: str,
    state: RendezvousState,
    action: Action,
    actor: NodeDesc,
    dead: frozenset[NodeDesc],
    expected: RendezvousState,
) -> None:
    assert apply(state, action, actor, CFG14, dead) == expected, why


def test_apply_covers_every_write_action() -> None:
    assert {c[2] for c in APPLY_CASES} == WRITE_ACTIONS


def test_rank_of_and_world_size() -> None:
    s = RendezvousState(complete=True, participants=(B, C), rank_order=(A, B, C))
    assert [s.rank_of(n) for n in (A, B, C, D)] == [None, 1, 2, None]  # A left; B and C keep their ranks
    assert s.world_size == 3
    gathering = S(participants=(A, B), wait_list=(C,), redundancy_list=(D,), rank_order=(A,))
    assert gathering.rank_of(A) is None
    assert gathering.world_size == 2
    assert gathering.num_waiting == 1
    assert gathering.all_nodes() == (A, B, C, D)


# (why, state, action, actor, dead, words the error must name)
ILLEGAL: list[tuple[str, RendezvousState, Action, NodeDesc, frozenset[NodeDesc], str]] = [
    ("join a complete round", done(A), Action.ADD_TO_PARTICIPANTS, B, frozenset(), "the round is not complete"),
    ("join twice", S(participants=(B,)), Action.ADD_TO_PARTICIPANTS, B, frozenset(), "not a participant"),
    ("join a full round", S(participants=(A, B, C, D)), Action.ADD_TO_PARTICIPANTS, E, frozenset(), "fewer than max"),
    ("join from the reserve", S(redundancy_list=(B,)), Action.ADD_TO_PARTICIPANTS, B, frozenset(), "redundancy"),
    ("join a closed rendezvous", S(closed=True), Action.ADD_TO_PARTICIPANTS, B, frozenset(), "is open"),
    ("wait for a gathering round", S(participants=(A,)), Action.ADD_TO_WAIT_LIST, B, frozenset(), "is complete"),
    ("wait twice", done(A, wait_list=(B,)), Action.ADD_TO_WAIT_LIST, B, frozenset(), "not on the wait list"),
    ("wait as a member", done(A, B), Action.ADD_TO_WAIT_LIST, B, frozenset(), "not a participant"),
    ("reserve with room", done(A), Action.ADD_TO_REDUNDANCY_LIST, B, frozenset(), "has max_nodes"),
    ("reserve twice", done(A, B, C, D, redundancy_list=(E,)), Action.ADD_TO_REDUNDANCY_LIST, E, frozenset(), "not on"),
    ("leave unlisted", done(A), Action.REMOVE_FROM_PARTICIPANTS, B, frozenset(), "is a participant"),
    ("unwait unlisted", done(A), Action.REMOVE_FROM_WAIT_LIST, B, frozenset(), "is on the wait list"),
    ("unreserve unlisted", done(A), Action.REMOVE_FROM_REDUNDANCY_LIST, B, frozenset(), "is on the redundancy list"),
    ("complete twice", done(A), Action.MARK_COMPLETE, A, frozenset(), "the round is not complete"),
    ("complete as an outsider", S(participants=(A,)), Action.MARK_COMPLETE, B, frozenset(), "is a participant"),
    ("complete below min", S(participants=(A,)), Action.MARK_COMPLETE, A, frozenset(), "min_nodes"),
    ("complete when closed", S(participants=(A, B), closed=True), Action.MARK_COMPLETE, A, frozenset(), "is open"),
    ("close twice", S(closed=True), Action.MARK_CLOSED, A, frozenset(), "is open"),
    ("evict nobody", done(A), Action.REMOVE_DEAD, A, frozenset({B}), "found dead is listed"),
]


@pytest.mark.parametrize(("why", "state", "action", "actor", "dead", "words"), ILLEGAL, ids=[c[0] for c in ILLEGAL])
def test_apply_rejects_illegal_pairs(
    why: str, state: RendezvousState, action: Action, actor: NodeDesc, dead: frozenset[NodeDesc], words: str
) -> None:
    cfg = RendezvousSettings("run", min_nodes=2, max_nodes=4)
    with pytest.raises(RendezvousStateError) as info:
        apply(state, action, actor, cfg, dead)
    message = str(info.value)
    assert action.name in message, why
    assert f"round={state.round}" in message
    assert actor.id in message
    assert words in message


@pytest.mark.parametrize("action", [a for a in Action if not a.is_write])
def test_apply_rejects_non_write_actions(action: Action) -> None:
    with pytest.raises(RendezvousStateError, match=rf"{action.name} by .*RendezvousState\(round=0.*not a write"):
        apply(S(), action, A, CFG)


# --- timers -----------------------------------------------------------------------------------------------------


def test_last_call_opens_when_this_node_first_sees_min_nodes() -> None:
    t = NodeTimers(join_deadline=100.0)
    t = update_timers(t, S(participants=(A,)), CFG, 1.0)
    assert t == NodeTimers(100.0)
    t = update_timers(t, S(participants=(A, B)), CFG, 2.0)
    assert t == NodeTimers(100.0, 12.0, 0)
    same = update_timers(t, S(participants=(B, A, C)), CFG, 5.0)
    assert same is t  # kept while the round stays at or above min_nodes: not extended by later joiners
    assert update_timers(t, S(participants=(A,)), CFG, 6.0) == NodeTimers(100.0)  # dropped below min
    assert update_timers(t, done(A, B), CFG, 6.0) == NodeTimers(100.0)  # completed
    assert update_timers(t, S(participants=(A, B), closed=True), CFG, 6.0) == NodeTimers(100.0)
    assert update_timers(t, S(round=1, participants=(A, B)), CFG, 6.0) == NodeTimers(100.0, 16.0, 1)  # new round


def test_join_deadline_is_held_off_in_reserve() -> None:
    t = NodeTimers(join_deadline=100.0)
    reserve = done(A, B, C, redundancy_list=(ME,))
    assert update_timers(t, reserve, CFG, 500.0, node=ME) == NodeTimers(600.0)
    assert update_timers(t, reserve, CFG, 50.0, node=ME) == NodeTimers(150.0)
    assert update_timers(t, reserve, CFG, 500.0) is t  # the node must be named
    assert update_timers(t, done(A, B, C), CFG, 500.0, node=ME) is t  # not in reserve


def test_a_quorum_holds_the_join_deadline_until_the_last_call_ends() -> None:
    t = NodeTimers(join_deadline=8.0)
    quorum = S(participants=(A, ME))
    held = update_timers(t, quorum, CFG, 5.0, node=ME)
    assert held == NodeTimers(15.0, 15.0, 0)
    assert decide_join(quorum, ME, CFG, held, 9.0) is Action.WAIT  # past the original deadline: still in
    assert decide_join(quorum, ME, CFG, held, 15.0) is Action.MARK_COMPLETE
    below = update_timers(held, S(participants=(ME,)), CFG, 16.0, node=ME)
    assert below == NodeTimers(15.0)  # quorum lost: the (extended) deadline applies again
    assert decide_join(S(participants=(ME,)), ME, CFG, below, 16.0) is Action.REMOVE_FROM_PARTICIPANTS
    assert update_timers(t, S(participants=(A, B)), CFG, 5.0, node=ME) == NodeTimers(8.0, 15.0, 0)  # not in it


def test_timers_validate() -> None:
    with pytest.raises(ConfigurationError, match="set both or neither"):
        NodeTimers(1.0, last_call_deadline=2.0)
    with pytest.raises(ConfigurationError, match="join_deadline=nan"):
        NodeTimers(float("nan"))


# --- values -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"run_id": ""}, "run_id='': must be a non-empty string"),
        ({"min_nodes": 0}, "min_nodes=0: must be an integer >= 1"),
        ({"max_nodes": True}, "max_nodes=True: must be an integer >= 1"),
        ({"min_nodes": 3, "max_nodes": 2}, "min_nodes=3, max_nodes=2: min_nodes must be <= max_nodes"),
        ({"join_timeout": 0}, "join_timeout=0: must be a number of seconds > 0"),
        ({"last_call_timeout": -1.0}, "last_call_timeout=-1.0: must be"),
        ({"close_timeout": float("nan")}, "close_timeout=nan: must be"),
        ({"keep_alive_interval": "5"}, "keep_alive_interval='5': must be"),
        ({"keep_alive_max_attempt": 0}, "keep_alive_max_attempt=0: must be an integer >= 1"),
    ],
)
def test_settings_validate(kwargs: dict[str, object], words: str) -> None:
    base: dict[str, object] = {"run_id": "r", "min_nodes": 1, "max_nodes": 2}
    with pytest.raises(ConfigurationError) as info:
        RendezvousSettings(**(base | kwargs))  # type: ignore[arg-type]
    assert words in str(info.value)


def test_settings_defaults_are_torchs() -> None:
    s = RendezvousSettings("r", 1, 1)
    assert (s.join_timeout, s.last_call_timeout, s.close_timeout) == (600, 30, 30)
    assert (s.keep_alive_interval, s.keep_alive_max_attempt) == (5, 3)


def test_node_desc() -> None:
    assert NodeDesc("host", 12, 3).id == str(NodeDesc("host", 12, 3)) == "host_12_3"
    assert NodeDesc("fe80::1%eth0", 12, 3).id == "[fe80::1%eth0]_12_3"
    assert NodeDesc("fe80::1%eth0", 12, 3).key == "fe80%3A%3A1%25eth0_12_3"
    assert sorted([NodeDesc("b", 1, 0), NodeDesc("a", 2, 0), NodeDesc("a", 1, 1), NodeDesc("a", 1, 0)]) == [
        NodeDesc("a", 1, 0),
        NodeDesc("a", 1, 1),
        NodeDesc("a", 2, 0),
        NodeDesc("b", 1, 0),
    ]
    with pytest.raises(ConfigurationError, match="addr=''"):
        NodeDesc("", 1, 0)
    with pytest.raises(ConfigurationError, match="pid=-1"):
        NodeDesc("h", -1, 0)
    with pytest.raises(ConfigurationError, match="local_id=True"):
        NodeDesc("h", 1, True)
    with pytest.raises(ConfigurationError, match="node key 'nope'"):
        NodeDesc.from_key("nope")


@given(st.text(min_size=1), st.integers(0, 2**31), st.integers(0, 2**62))
def test_node_key_is_safe_and_parses_back(addr: str, pid: int, local_id: int) -> None:
    node = NodeDesc(addr, pid, local_id)
    assert set(node.key) <= set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.~%-")
    assert NodeDesc.from_key(node.key) == node


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"round": -1}, "round=-1"),
        ({"participants": (A,), "wait_list": (A,)}, "lists 10.0.0.1_100_0 twice (wait_list)"),
        ({"participants": [A]}, "participants=[NodeDesc"),
        ({"complete": True}, "complete with no participants"),
        ({"complete": True, "participants": (A, B), "rank_order": (B, A)}, "are not in rank_order"),
        ({"complete": True, "participants": (A, C), "rank_order": (A, B)}, "are not in rank_order"),
        ({"rank_order": (A, A)}, "has duplicates"),
        ({"participants": (B,), "endpoints": {A: "h:1"}}, "has endpoints of [10.0.0.1_100_0]: not listed"),
    ],
)
def test_state_invariants(kwargs: dict[str, object], words: str) -> None:
    with pytest.raises(RendezvousStateError) as info:
        RendezvousState(**kwargs)  # type: ignore[arg-type]
    assert words in str(info.value)


# --- codec ------------------------------------------------------------------------------------------------------

ENCODED = (
    b'{"v":4,"round":3,"complete":true,"closed":false,"nodes":[["10.0.0.1",100,0],["10.0.0.1",200,0],'
    b'["10.0.0.1",300,0],["::1",7,1]],"endpoints":[null,"10.0.0.1:40001","10.0.0.1:40002","[::1]:40003"],'
    b'"participants":[1,0],"wait_list":[3],"redundancy_list":[],"rank_order":[2,1,0],"lost":[2]}'
)
DECODED = RendezvousState(
    round=3,
    complete=True,
    participants=(B, A),
    wait_list=(NodeDesc("::1", 7, 1),),
    rank_order=(C, B, A),
    endpoints={B: "10.0.0.1:40001", C: "10.0.0.1:40002", NodeDesc("::1", 7, 1): "[::1]:40003"},
    lost=(C,),
)


def test_codec_format_is_pinned() -> None:
    assert DECODED.master == "10.0.0.1:40002"  # rank 0's (C: it left the round, its endpoint stays with its rank)
    assert hash(DECODED) == hash(decode_state(ENCODED))  # a hashable value, endpoints and all
    assert encode_state(DECODED) == ENCODED
    assert decode_state(ENCODED) == DECODED
    assert decode_state(json.dumps(json.loads(ENCODED), indent=2).encode()) == DECODED  # any JSON layout reads


def _doc(**changes: object) -> bytes:
    doc = json.loads(ENCODED)
    for key, value in changes.items():
        if value is ...:
            del doc[key]
        else:
            doc[key] = value
    return json.dumps(doc).encode()


BAD_PAYLOADS: list[tuple[str, bytes, str]] = [
    ("empty", b"", "not JSON"),
    ("garbage", b"\x80\x04\x95pickle", "not UTF-8 JSON"),
    ("not JSON", b"{round: 3}", "not JSON"),
    ("trailing bytes", ENCODED + b"x", "not JSON"),
    ("an array", b"[1, 2]", "a JSON list, not an object"),
    ("no version", _doc(v=...), "format v=None is not v=4"),
    ("the previous version", _doc(v=3), "format v=3 is not v=4, the one this aelastic reads (are all nodes"),
    ("a later version", _doc(v=5), "format v=5 is not v=4"),
    ("a boolean version", _doc(v=True), "format v=True is not v=4"),
    ("a string version", _doc(v="4"), "format v='4' is not v=4"),
    ("lost not in rank_order", _doc(lost=[3]), "lost=[[::1]_7_1]: not all in rank_order"),
    ("a missing field", _doc(closed=...), "missing ['closed'], unknown []"),
    ("an unknown field", _doc(deadline=1.5), "missing [], unknown ['deadline']"),
    ("a string round", _doc(round="3"), "round='3': must be an integer >= 0"),
    ("a negative round", _doc(round=-3), "round=-3"),
    ("a boolean round", _doc(round=False), "round=False"),
    ("a numeric flag", _doc(complete=1), "complete=1: must be true or false"),
    ("nodes not a list", _doc(nodes={}), "nodes={}: must be a list"),
    ("a node of two fields", _doc(nodes=[["h", 1]]), "nodes[0]=['h', 1]: must be [addr, pid, local_id]"),
    ("a string pid", _doc(nodes=[["h", "1", 0]]), "nodes[0]=['h', '1', 0]"),
    ("a boolean local id", _doc(nodes=[["h", 1, True]]), "nodes[0]=['h', 1, True]"),
    ("an empty address", _doc(nodes=[["", 1, 0], ["h", 2, 0], ["h", 3, 0], ["h", 4, 0]]), "nodes[0]=['', 1, 0]"),
    ("a negative pid", _doc(nodes=[["h", -1, 0], ["h", 2, 0], ["h", 3, 0], ["h", 4, 0]]), "pid=-1"),
    ("a node twice", _doc(nodes=[["h", 1, 0], ["h", 1, 0], ["h", 3, 0], ["h", 4, 0]]), "a node is listed twice"),
    ("an index out of range", _doc(wait_list=[4]), "wait_list=[4]: must be a list of indices into the 4 nodes"),
    ("a string index", _doc(participants=["0"]), "participants=['0']"),
    ("a list not a list", _doc(redundancy_list=0), "redundancy_list=0"),
    ("an index twice", _doc(rank_order=[2, 1, 0, 0]), "rank_order=[2, 1, 0, 0]: lists a node twice"),
    ("a node on no list", _doc(wait_list=[]), "nodes [3] are on no list"),
    ("a node on two lists", _doc(wait_list=[3, 0]), "lists 10.0.0.1_100_0 twice"),
    ("a broken invariant", _doc(participants=[0, 1]), "are not in rank_order"),
    ("a key twice", ENCODED[:-1] + b',"v":4}', "key 'v' twice"),
    ("endpoints not a list", _doc(endpoints={}), "endpoints: must be a list as long as nodes (4)"),
    ("an endpoint short", _doc(endpoints=[None]), "endpoints: must be a list as long as nodes (4)"),
    ("an endpoint number", _doc(endpoints=[None, 1, None, None]), "endpoints[1]=1: must be a 'host:port' string"),
    ("an endpoint without port", _doc(endpoints=[None, "h", None, None]), "endpoints[1] 'h': needs a port"),
    ("an endpoint of no node", _doc(endpoints=[None, None, None, "h:1"], wait_list=[]), "nodes [3] are on no"),
    ("NaN", _doc(round=float("nan")), "holds NaN"),
]


@pytest.mark.parametrize(("why", "data", "words"), BAD_PAYLOADS, ids=[c[0] for c in BAD_PAYLOADS])
def test_decode_rejects_bad_payloads(why: str, data: bytes, words: str) -> None:
    with pytest.raises(RendezvousStateError) as info:
        decode_state(data)
    assert words in str(info.value), why


def test_decode_rejects_text() -> None:
    with pytest.raises(RendezvousStateError, match="is a str, not bytes"):
        decode_state(ENCODED.decode())  # type: ignore[arg-type]


def test_every_truncation_is_rejected() -> None:
    for end in range(len(ENCODED)):
        with pytest.raises(RendezvousStateError):
            decode_state(ENCODED[:end])


nodes_st = st.builds(
    NodeDesc, st.sampled_from(["10.0.0.1", "10.0.0.2", "::1", "host_a", "é"]), st.integers(0, 5), st.integers(0, 2)
)


@st.composite
def states(draw: st.DrawFn) -> RendezvousState:
    pool = draw(st.lists(nodes_st, unique=True, max_size=12))
    lists: list[list[NodeDesc]] = [[], [], []]
    for node in pool:
        lists[draw(st.integers(0, 2))].append(node)
    participants, wait_list, redundancy_list = (tuple(x) for x in lists)
    extra = draw(st.lists(nodes_st, unique=True, max_size=3))
    rank_order = tuple(dict.fromkeys(draw(st.permutations([*participants, *extra]))))
    complete = bool(participants) and draw(st.booleans())
    if complete:  # participants must be a subsequence of rank_order
        participants = tuple(n for n in rank_order if n in set(participants))
    known = dict.fromkeys([*pool, *rank_order])
    endpoints = {n: format_address(n.addr, port) for n in known if (port := draw(st.integers(0, 2))) > 0}
    lost = tuple(n for n in rank_order if draw(st.booleans()))
    return RendezvousState(
        lost=lost,
        round=draw(st.integers(0, 2**40)),
        complete=complete,
        closed=draw(st.booleans()),
        participants=participants,
        wait_list=wait_list,
        redundancy_list=redundancy_list,
        rank_order=rank_order,
        endpoints=endpoints,
    )


@given(states())
def test_codec_round_trips(state: RendezvousState) -> None:
    data = encode_state(state)
    assert decode_state(data) == state
    assert encode_state(decode_state(data)) == data  # canonical


@settings(max_examples=200)
@given(st.binary(max_size=64))
def test_decode_fails_only_with_state_errors(data: bytes) -> None:
    with pytest.raises(RendezvousStateError):
        decode_state(data)


# --- join requests: folding them equals each requester writing its own join ---------------------------------------

endpoints_st = st.one_of(st.none(), st.sampled_from(["10.0.0.9:1", "[::1]:2", "host_a:3"]))
requests_st = st.lists(st.builds(JoinRequest, nodes_st, st.integers(1, 6), endpoints_st), max_size=10)


def joined_one_by_one(state: RendezvousState, requests: list[JoinRequest]) -> RendezvousState:
    """The reference: each requester decides on the state as it is and, if it would add itself, does."""
    for request in requests:
        settings = RendezvousSettings("run", 1, request.max_nodes)
        action = decide_join(state, request.node, settings, NodeTimers(join_deadline=math.inf), 0.0)
        if action in JOIN_REQUESTS:
            state = apply(state, action, request.node, settings)
            if request.endpoint is not None:  # the listed node's endpoint is its newest request's
                state = dataclasses.replace(state, endpoints={**state.endpoints, request.node: request.endpoint})
    return state


@settings(max_examples=500)
@given(states(), requests_st)
def test_folding_join_requests_equals_joining_one_by_one(state: RendezvousState, requests: list[JoinRequest]) -> None:
    assert fold_joins(state, requests) == joined_one_by_one(state, requests)


def test_folding_the_max_th_request_completes_the_round() -> None:
    requests = [JoinRequest(A, 3, "a:1"), JoinRequest(C, 3, "c:1"), JoinRequest(D, 3)]
    folded = fold_joins(S(participants=(B,), endpoints={B: "b:1"}), requests)
    assert folded.complete
    assert folded.participants == folded.rank_order == (A, B, C)  # NodeDesc order on a first round
    assert folded.master == "a:1"  # rank 0's endpoint, from the request that listed it
    assert folded.redundancy_list == (D,)  # the round was complete and full when D's request came
    late = fold_joins(done(A, B), [JoinRequest(D, 3), JoinRequest(D, 3)])
    assert late.wait_list == (D,)  # complete with room: waits for the next round, once
    assert fold_joins(S(closed=True), [JoinRequest(A, 3)]) == S(closed=True)


@given(requests_st)
def test_join_request_codec_round_trips(requests: list[JoinRequest]) -> None:
    for request in requests:
        data = encode_join_request(request)
        assert b"\n" not in data  # one line: backends append requests as lines
        assert decode_join_request(data) == request


@pytest.mark.parametrize(
    ("data", "words"),
    [
        (b"", "not JSON"),
        (b"\xff", "not JSON"),
        (b"{}", "not [4, addr, pid, local_id, max_nodes, endpoint]"),
        (b'["a",1,2,3]', "format v=None is not v=4, the one this aelastic reads (are all nodes"),  # v2's
        (b'[3,"a",1,2,3,null]', "format v=3 is not v=4"),
        (b'[4,"a",1,2,3]', "not [4, addr"),
        (b'[4,"a",1,2,0,null]', "max_nodes=0"),
        (b'[4,"",1,2,3,null]', "addr=''"),
        (b'[4,"a",1,2,true,null]', "not [4, addr"),
        (b'[4,"a",1,2,3,5]', "not [4, addr"),
        (b'[4,"a",1,2,3,"h"]', "'h': needs a port"),
    ],
)
def test_join_request_decode_rejects_bad_payloads(data: bytes, words: str) -> None:
    with pytest.raises(RendezvousStateError, match="join request") as info:
        decode_join_request(data)
    assert words in str(info.value)


# --- a simulated cluster ----------------------------------------------------------------------------------------


@dataclass
class SimNode:
    desc: NodeDesc
    offset: float  # its monotonic clock = world time + offset: no two nodes share a clock
    version: int = 0
    view: RendezvousState = field(default_factory=RendezvousState)
    op: str | None = None  # "exit" (then "join"), "join", "leave", "close"
    timers: NodeTimers = field(default_factory=lambda: NodeTimers(0.0))
    alive: bool = True
    gone: bool = False  # left for good, or stopped by a closed rendezvous
    member_of: int | None = None  # the round its last join finished in


ADDRS = ["10.0.0.2", "10.0.0.1", "::1"]


class RendezvousCluster(RuleBasedStateMachine):
    """N nodes, one compare-and-set register, local clocks, stale views, deaths, evictions, closes."""

    def __init__(self) -> None:
        super().__init__()
        self.cfg = RendezvousSettings("sim", 1, 1)
        self.nodes: list[SimNode] = []
        self.version = 0
        self.state = RendezvousState()
        self.world = 0.0
        self.dead: set[NodeDesc] = set()
        self.groups: dict[int, tuple[NodeDesc, ...]] = {}  # round -> the group at its completion
        self.finished: dict[int, dict[NodeDesc, tuple[int, int]]] = {}  # round -> node -> (rank, world size)
        self.pids = iter(range(1000, 10**6))

    # --- the register ---------------------------------------------------------------------------------------

    def cas(self, node: SimNode, new: RendezvousState) -> None:
        if node.version == self.version:
            self.check_write(self.state, new)
            self.version += 1
            self.state = new
        node.version, node.view = self.version, self.state

    def check_write(self, old: RendezvousState, new: RendezvousState) -> None:
        cfg = self.cfg
        assert decode_state(encode_state(new)) == new
        assert len(new.participants) <= cfg.max_nodes
        assert old.closed <= new.closed, "a rendezvous never reopens"
        assert new.round in (old.round, old.round + 1)
        if new.round == old.round + 1:
            assert old.complete, "a round ends only once complete"
            assert not new.complete
            assert not new.participants, "a round ends when its last member left"
        if new.complete and not (old.complete and old.round == new.round):
            # A completion: the only group of this round, dense ranks, between min and max, never after close.
            assert not old.closed, "a closed rendezvous never completes again"
            assert new.round not in self.groups, f"two groups in round {new.round}"
            assert cfg.min_nodes <= len(new.participants) <= cfg.max_nodes
            assert new.rank_order == new.participants
            assert [new.rank_of(n) for n in new.participants] == list(range(len(new.participants)))
            earlier = [r for r in self.groups if r < new.round]
            if earlier:  # survivors of the previous group keep their relative order, and come first
                prev = self.groups[max(earlier)]
                survivors = [n for n in new.rank_order if n in prev]
                assert survivors == [n for n in prev if n in new.rank_order]
                assert list(new.rank_order[: len(survivors)]) == survivors
                assert list(new.rank_order[len(survivors) :]) == sorted(new.rank_order[len(survivors) :])
            self.groups[new.round] = new.rank_order
        elif new.complete:  # the same completed round: members only ever leave
            assert new.rank_order == old.rank_order
            assert set(new.participants) <= set(old.participants)

    # --- node behaviour -------------------------------------------------------------------------------------

    def local_now(self, node: SimNode) -> float:
        return self.world + node.offset

    def start(self, node: SimNode, op: str) -> None:
        timeout = self.cfg.close_timeout if op == "close" else self.cfg.join_timeout
        node.op, node.timers, node.member_of = op, NodeTimers(self.local_now(node) + timeout), None

    def act(self, node: SimNode, pass_dead: bool) -> Action | None:
        if node.op is None or not node.alive:
            return None
        now, cfg, me = self.local_now(node), self.cfg, node.desc
        dead = frozenset(self.dead) if pass_dead else frozenset()
        node.timers = update_timers(node.timers, node.view, cfg, now, node=me)
        if node.op in ("exit", "leave"):
            action = decide_exit(node.view, me, cfg, node.timers, now)
        elif node.op == "join":
            action = decide_join(node.view, me, cfg, node.timers, now, dead)
        else:
            action = decide_close(node.view, cfg, node.timers, now)
        if action.is_write:
            self.cas(node, apply(node.view, action, me, cfg, dead))
        elif action is Action.WAIT:
            assert node.op == "join"
            t = node.timers
            wake = min(t.join_deadline, t.last_call_deadline if t.last_call_deadline is not None else t.join_deadline)
            assert wake > now, f"{me.id} would wait for a deadline that passed: {t} at {now}"
        elif action is Action.FINISH:
            if node.op == "exit":
                node.op = "join"
            elif node.op == "join":
                self.record_finish(node)
            elif node.op == "leave":
                node.op, node.gone = None, True
            else:
                node.op = None
        elif action in (Action.ERROR_CLOSED, Action.GRACEFUL_EXIT):
            assert node.view.closed
            assert (action is Action.GRACEFUL_EXIT) == (me in node.view.redundancy_list)
            node.op, node.gone = None, True
        else:
            assert action is Action.ERROR_TIMEOUT
            if node.op == "join":
                assert me not in self.state.all_nodes(), "a join times out only once the node is off every list"
            node.op = None
        return action

    def record_finish(self, node: SimNode) -> None:
        view, me = node.view, node.desc
        rank = view.rank_of(me)
        assert view.complete
        assert rank is not None
        assert view.rank_order == self.groups[view.round]
        assert 0 <= rank < view.world_size == len(self.groups[view.round])
        finished = self.finished.setdefault(view.round, {})
        finished[me] = (rank, view.world_size)
        assert len({r for r, _ in finished.values()}) == len(finished), "ranks are unique"
        assert len({w for _, w in finished.values()}) == 1, "every member sees one world size"
        node.op, node.member_of = None, view.round

    def restart_reason(self, node: SimNode) -> bool:
        """What the agent's membership watch reacts to (dynamic.py's _restart_reason)."""
        s = self.state
        if node.member_of is None:
            return True
        return (
            s.round != node.member_of
            or node.desc not in s.participants
            or bool(s.wait_list)
            or (len(s.participants) < len(self.groups[node.member_of]))
        )

    def pick(self, i: int, where: Callable[[SimNode], bool] = lambda n: True) -> SimNode | None:
        live = [n for n in self.nodes if n.alive and not n.gone and where(n)]
        return live[i % len(live)] if live else None

    # --- rules ----------------------------------------------------------------------------------------------

    @initialize(
        min_nodes=st.integers(1, 3),
        extra=st.integers(0, 2),
        join_timeout=st.sampled_from([4.0, 30.0]),
        addrs=st.lists(st.sampled_from(ADDRS), min_size=1, max_size=5),
        fast_quorum=st.booleans(),
    )
    def setup(self, min_nodes: int, extra: int, join_timeout: float, addrs: list[str], fast_quorum: bool) -> None:
        self.cfg = RendezvousSettings(
            "sim", min_nodes, min_nodes + extra, join_timeout=join_timeout, last_call_timeout=1.0, close_timeout=5.0,
            fast_quorum=fast_quorum,
        )  # fmt: skip
        for addr in addrs:
            self.spawn(addr)

    @rule(addr=st.sampled_from(ADDRS))
    def spawn(self, addr: str) -> None:
        if len(self.nodes) >= 8:
            return
        pid = next(self.pids)
        self.nodes.append(SimNode(NodeDesc(addr, pid, 0), offset=(pid % 7) * 1000.0 - 3000.0))

    @rule(i=st.integers(0, 7))
    def rendezvous(self, i: int) -> None:
        """An agent (re)starts next_rendezvous: a new node, a restart after a failure, or a cancelled call."""
        node = self.pick(i)
        if node is not None and node.op != "close":
            self.start(node, "exit")

    @rule(i=st.integers(0, 7), fresh=st.booleans(), pass_dead=st.booleans())
    def step(self, i: int, fresh: bool, pass_dead: bool) -> None:
        """One turn of a node's operation loop, on a fresh view (after a wait) or on the one it has."""
        node = self.pick(i, lambda n: n.op is not None)
        if node is not None:
            if fresh:
                node.version, node.view = self.version, self.state
            self.act(node, pass_dead)

    @rule(pass_dead=st.booleans())
    def step_all(self, pass_dead: bool) -> None:
        """Every node with an operation takes a turn, each on the state as it was when its turn came."""
        for node in self.nodes:
            if node.alive and not node.gone and node.op is not None:
                node.version, node.view = self.version, self.state
                self.act(node, pass_dead)

    @rule(i=st.integers(0, 7))
    def watch(self, i: int) -> None:
        """The agent's membership watch: a member whose round ended, shrank or has waiters re-rendezvouses."""
        node = self.pick(i, lambda n: n.op is None and n.member_of is not None)
        if node is not None and not self.state.closed and self.restart_reason(node):
            self.start(node, "exit")

    @rule(i=st.integers(0, 7))
    def refresh(self, i: int) -> None:
        node = self.pick(i)
        if node is not None:
            node.version, node.view = self.version, self.state

    @rule(dt=st.sampled_from([0.1, 0.5, 1.5, 5.0]))
    def tick(self, dt: float) -> None:
        self.world += dt

    @rule(i=st.integers(0, 7))
    def die(self, i: int) -> None:
        node = self.pick(i)
        if node is not None:
            node.alive = False
            self.dead.add(node.desc)  # the environment's liveness finding (heartbeats stopped)

    @rule(i=st.integers(0, 7))
    def evict(self, i: int) -> None:
        """The driver's liveness task: remove dead nodes from the state it last read."""
        node = self.pick(i)
        if node is not None and not self.dead.isdisjoint(node.view.all_nodes()):
            self.cas(node, apply(node.view, Action.REMOVE_DEAD, node.desc, self.cfg, frozenset(self.dead)))

    @rule(i=st.integers(0, 7))
    def leave(self, i: int) -> None:
        node = self.pick(i)
        if node is not None and node.op != "close":
            self.start(node, "leave")

    @rule(i=st.integers(0, 7), chance=st.integers(0, 3))
    def close(self, i: int, chance: int) -> None:
        node = self.pick(i, lambda n: n.op is None)
        if node is not None and chance == 0:  # rarely: a close ends the interesting part of a run
            self.start(node, "close")

    @rule()
    def settle(self) -> None:
        """Liveness: with the dead evicted and the survivors trying, a round completes and takes them all in."""
        cfg = self.cfg
        for _ in range(200):
            trying = [n for n in self.nodes if n.alive and not n.gone]
            evictor = next(iter(trying), None)
            if evictor is not None and not self.dead.isdisjoint(self.state.all_nodes()):
                evictor.version, evictor.view = self.version, self.state
                self.cas(evictor, apply(self.state, Action.REMOVE_DEAD, evictor.desc, cfg, frozenset(self.dead)))
            if self.converged(trying):
                return
            for node in trying:
                node.version, node.view = self.version, self.state
                if node.op is None and not self.state.closed and self.restart_reason(node):
                    self.start(node, "exit")
                self.act(node, pass_dead=True)
            self.world += cfg.last_call_timeout / 2
        raise AssertionError(f"no steady round after 200 steps: {self.state!r}")

    def converged(self, trying: list[SimNode]) -> bool:
        s = self.state
        if s.closed:  # every op ends: members stay members, the rest stop
            return all(n.op is None for n in trying)
        if len(trying) < self.cfg.min_nodes:
            return all(n.op in (None, "join") for n in trying)  # nothing to prove: they wait or time out
        members = [n for n in trying if n.op is None and n.member_of == s.round and s.rank_of(n.desc) is not None]
        reserve = [n for n in trying if n.op == "join" and n.desc in s.redundancy_list]
        return (
            s.complete
            and not s.wait_list
            and len(members) == min(len(trying), self.cfg.max_nodes) == len(s.participants)
            and len(members) + len(reserve) == len(trying)
        )

    def teardown(self) -> None:
        self.settle()

    @invariant()
    def views_are_states_once_written(self) -> None:
        for node in self.nodes:
            assert node.version <= self.version


TestRendezvousCluster = RendezvousCluster.TestCase
TestRendezvousCluster.settings = settings(
    max_examples=1000, stateful_step_count=60, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


def test_a_dead_member_makes_the_survivors_rerendezvous_in_order() -> None:
    """Round 0: A, B, C (ranks 0, 1, 2). B dies; C and A re-rendezvous with newcomer D; A stays rank 0."""
    cfg = RendezvousSettings("run", min_nodes=2, max_nodes=3, last_call_timeout=10.0)
    s = done(A, B, C)
    s = apply(s, decide_join(s, C, cfg, T, NOW, frozenset({B})), C, cfg, frozenset({B}))
    assert s == RendezvousState(complete=True, participants=(A, C), rank_order=(A, B, C), lost=(B,))
    for n in (C, A):
        s = apply(s, decide_exit(s, n, cfg, T, NOW), n, cfg)
    assert (s.round, s.complete, s.participants) == (1, False, ())
    for n in (D, C, A):
        s = apply(s, decide_join(s, n, cfg, T, NOW), n, cfg)
    assert s.complete
    assert [s.rank_of(n) for n in (A, C, D)] == [0, 1, 2]


def test_fast_quorum_false_keeps_torchs_last_call() -> None:
    regrouped_state = S(round=1, participants=(A, ME), rank_order=(A, ME, C), lost=(C,))
    torch_like = dataclasses.replace(CFG, fast_quorum=False)
    assert decide_join(regrouped_state, ME, CFG, CALL_OPEN, NOW) is Action.MARK_COMPLETE
    assert decide_join(regrouped_state, ME, torch_like, CALL_OPEN, NOW) is Action.WAIT
    call_over = dataclasses.replace(CALL_OVER, last_call_round=1)
    assert decide_join(regrouped_state, ME, torch_like, call_over, NOW) is Action.MARK_COMPLETE


def test_a_completed_round_forgets_its_losses() -> None:
    s = apply(done(A, B, C), Action.REMOVE_DEAD, A, CFG, frozenset({C}))
    assert s.lost == (C,)
    assert sm.completed(dataclasses.replace(s, complete=False, round=1)).lost == ()
    # a newcomer dying is no loss of the last round: nothing to wait without
    s = apply(S(round=1, participants=(A, D), rank_order=(A, B)), Action.REMOVE_DEAD, A, CFG, frozenset({D}))
    assert s.lost == ()


@settings(max_examples=300, deadline=None)
@given(
    size=st.integers(2, 6),
    data=st.data(),
    fast=st.booleans(),
)
def test_a_round_after_a_loss_completes_exactly_when_the_survivors_are_back(
    size: int, data: st.DataObject, fast: bool
) -> None:
    """A group of ``size`` loses some members (found dead); the survivors, waiters and newcomers join again in any
    order, nobody's last call ever ends. With fast quorum the round completes at the first moment every survivor
    and every waiting node is back (and min_nodes is reached), with all of them; without it, only a full round
    completes (torch: below max_nodes, the last call)."""
    group = tuple(NodeDesc("10.0.1.1", 100 + i, 0) for i in range(size))
    cfg = RendezvousSettings("run", min_nodes=data.draw(st.integers(1, size)), max_nodes=size + 2, fast_quorum=fast)
    dead = frozenset(data.draw(st.sets(st.sampled_from(group), min_size=1, max_size=size)))
    waiters = tuple(NodeDesc("10.0.2.1", 200 + i, 0) for i in range(data.draw(st.integers(0, 1))))
    s = done(*group, wait_list=waiters)
    s = apply(s, Action.REMOVE_DEAD, group[0], cfg, dead)
    assert set(s.lost) == dead
    for member in [n for n in group if n not in dead]:  # the survivors leave the round to join the next
        s = apply(s, Action.REMOVE_FROM_PARTICIPANTS, member, cfg)
    survivors = [n for n in group if n not in dead]
    newcomers = [NodeDesc("10.0.3.1", 300 + i, 0) for i in range(data.draw(st.integers(0, 2)))]
    joiners = data.draw(st.permutations([*survivors, *waiters, *newcomers]))
    expected_back = {*survivors, *waiters}
    timers = NodeTimers(join_deadline=math.inf)  # no last call ends: only a fast quorum or a full round completes
    for node in joiners:
        if s.complete:
            break
        action = decide_join(s, node, cfg, timers, NOW)
        if action in JOIN_REQUESTS:
            s = apply(s, action, node, cfg)
        if s.complete:
            break
        for member in s.participants:  # every participant decides on the state as it now is
            timers_m = update_timers(timers, s, cfg, NOW, node=member)
            if decide_join(s, member, cfg, timers_m, NOW) is Action.MARK_COMPLETE:
                s = apply(s, Action.MARK_COMPLETE, member, cfg)
                break
        if not s.complete:
            back = set(s.participants)
            may = fast and survivors and expected_back <= back and len(back) >= cfg.min_nodes
            assert not may, f"regrouped but not complete: {s!r}"
    if s.complete:
        assert s.lost == ()
        if len(s.participants) < cfg.max_nodes:
            assert fast, "torch's rule completed below max_nodes before the last call"
            assert expected_back <= set(s.participants), "a fast quorum left a survivor or a waiting node out"
            assert len(s.participants) >= cfg.min_nodes
        assert s.rank_order[: len(survivors)] == tuple(survivors), "survivors keep their order, first"
    else:
        assert not fast or not survivors or len(set(s.participants)) < cfg.min_nodes


# --- digests ----------------------------------------------------------------------------------------------------


def _view_of(state: RendezvousState, node: NodeDesc) -> sm.StateView:
    digest = make_digest(state)
    _, shards = decode_view(node, digest.summary, None)
    assert shards == len(digest.shards)
    return decode_view(node, digest.summary, digest.shards[shard_of(node.key, shards)])[0]


TIMERS_TO_TRY = (T, EXPIRED, CALL_OPEN, CALL_OVER, CALL_OVER_OLD_ROUND)


@given(states(), nodes_st)
def test_a_nodes_view_decides_as_the_whole_state(state: RendezvousState, outsider: NodeDesc) -> None:
    """Every decision, timer and rank a node takes from its digest's view is the one it takes from the whole
    state: a node that only waits never needs to read the other nodes' names."""
    order = sorted(state.all_nodes())
    for node in {*state.all_nodes(), outsider}:
        view = _view_of(state, node)
        for cfg in (CFG, CFG14):
            for timers in TIMERS_TO_TRY:
                assert decide_join(view, node, cfg, timers, NOW) == decide_join(state, node, cfg, timers, NOW)
                assert decide_exit(view, node, cfg, timers, NOW) == decide_exit(state, node, cfg, timers, NOW)
                assert decide_close(view, cfg, timers, NOW) == decide_close(state, cfg, timers, NOW)
                assert update_timers(timers, view, cfg, NOW, node=node) == update_timers(
                    timers, state, cfg, NOW, node=node
                )
        assert view.rank_of(node) == state.rank_of(node)
        assert view.master == state.master
        assert (view.round, view.world_size, view.num_waiting) == (state.round, state.world_size, state.num_waiting)
        expected = order[order.index(node) - 1] if node in order and len(order) > 1 else None
        assert view.neighbour == expected


def test_digest_shards_are_bounded_and_cover_every_node() -> None:
    nodes = [NodeDesc(f"10.0.{i // 250}.{i % 250}", 7, 0) for i in range(1000)]
    state = sm.completed(RendezvousState(participants=tuple(nodes[:900]), wait_list=tuple(nodes[900:])))
    digest = make_digest(state)
    assert len(digest.shards) == 1000 // SHARD_SIZE + 1
    assert len(digest.summary) < 200  # O(1): the summary names no node
    assert sum(len(shard.split(b"\n")) for shard in digest.shards) == 1000
    for i in (0, 899, 900, 999):
        assert _view_of(state, nodes[i]).rank_of(nodes[i]) == state.rank_of(nodes[i])


@pytest.mark.parametrize(
    ("summary", "words"),
    [
        (b'{"v":3,"round":0}', "digest format v=3 is not v=4, the one this aelastic reads (are all nodes"),
        (b"not json", "digest is not JSON"),
        (b'{"v":4,"round":0}', "not the v4 summary"),
        (
            b'{"v":4,"round":0,"complete":false,"closed":false,"participants":0,"wait_list":0,"redundancy_list":0,'
            b'"world_size":0,"shards":1,"master":"h","regrouped":false,"survivors":0}',
            "digest master 'h': needs a port",
        ),
        (
            b'{"v":4,"round":0,"complete":false,"closed":false,"participants":0,"wait_list":0,"redundancy_list":0,'
            b'"world_size":0,"shards":1,"master":null,"regrouped":1,"survivors":0}',
            "not the v4 summary",
        ),
    ],
)
def test_digest_rejects_other_formats(summary: bytes, words: str) -> None:
    with pytest.raises(RendezvousStateError, match=words.replace("(", r"\(")):
        decode_view(A, summary, None)
