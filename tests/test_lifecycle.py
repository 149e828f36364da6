"""A worker's lifecycle table (aelastic.agent.lifecycle), on its own: every move of the table, the moves the
supervisor makes in order for each way a worker ends, and a hypothesis state machine that applies any event in any
phase and checks what must always hold (the exit is the first one known; a reaped worker never runs again; a
worker taken over is never free again; a closed one never moves)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from aelastic.agent.lifecycle import TRANSITIONS, Event, Exit, Lifecycle, Phase

ENDING = {Event.REPORT, Event.EXIT, Event.DOOMED, Event.ABANDON}


def exit_(code: int, reported: bool = False) -> Exit:
    return Exit(code, reported, 0.0)


def moved(*steps: tuple[Event, int | None]) -> Lifecycle:
    life = Lifecycle()
    for event, code in steps:
        life.on(event, None if code is None else exit_(code, event is Event.REPORT))
    return life


def test_a_worker_that_exits_then_is_stopped_with_its_group() -> None:
    life = moved((Event.EXIT, 0))
    assert (life.phase, life.ended, life.alive, life.free) == (Phase.EXITED, True, False, True)
    assert life.on(Event.STOP) is Phase.REAPED  # the end of the attempt kills its group's leftovers
    assert life.on(Event.CLOSE) is Phase.CLOSED
    assert life.exit == exit_(0)


def test_a_reported_worker_lingers_and_keeps_its_reported_exit() -> None:
    life = moved((Event.REPORT, 1))
    assert (life.phase, life.alive, life.free, life.survivable) == (Phase.LINGERING, True, False, False)
    assert life.on(Event.EXIT, exit_(-9)) is Phase.REAPED  # killed after its teardown: the report stands
    assert life.exit == exit_(1, True)


def test_a_stopped_worker_that_dies_on_delivery_is_ended_before_it_is_reaped() -> None:
    life = moved((Event.STOP, None), (Event.DOOMED, -15))
    assert (life.phase, life.ended, life.alive) == (Phase.STOPPING, True, True)
    life.on(Event.EXIT, exit_(-15))
    assert (life.phase, life.exit) == (Phase.REAPED, exit_(-15))


def test_a_survivor_is_kept_and_given_the_next_attempt() -> None:
    life = moved((Event.KEEP, None))
    assert (life.phase, life.survivable) == (Phase.KEPT, True)
    assert life.on(Event.REASSIGN) is Phase.RUNNING
    assert life.on(Event.FAIL) is Phase.FAILING
    assert not life.survivable  # its exception is its own failure: it ends by itself


def test_a_late_verdict_or_late_news_changes_nothing() -> None:
    life = moved((Event.STOP, None))
    assert life.on(Event.FAIL) is Phase.STOPPING
    life.on(Event.ABANDON, exit_(-9))
    assert life.on(Event.EXIT, exit_(0)) is Phase.ABANDONED
    assert life.exit == exit_(-9)


@pytest.mark.parametrize(("phase", "event"), list(itertools.product(Phase, Event)))
def test_every_move_is_the_tables_and_any_other_raises(phase: Phase, event: Event) -> None:
    life = Lifecycle()
    life._phase = phase  # the phase under test, set directly
    target = TRANSITIONS.get((phase, event))
    if target is None:
        with pytest.raises(ValueError, match=f"no move from {phase.value} on {event.value}"):
            life.on(event, exit_(0))
        assert life.phase is phase
    else:
        assert life.on(event, exit_(0)) is target


@pytest.mark.parametrize("event", sorted(ENDING, key=lambda e: e.value))
def test_an_ending_event_needs_its_exit(event: Event) -> None:
    life = moved((Event.STOP, None)) if event is Event.DOOMED else Lifecycle()
    with pytest.raises(ValueError, match="needs the exit"):
        life.on(event)


def test_closed_is_final() -> None:
    assert {
        event for (phase, event), target in TRANSITIONS.items() if phase is Phase.CLOSED and target is not phase
    } == set()


class LifeMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.life = Lifecycle()
        self.first_exit: Exit | None = None
        self.was_reaped = False
        self.was_taken = False

    @rule(event=st.sampled_from(list(Event)), code=st.integers(-15, 3), reported=st.booleans())
    def apply(self, event: Event, code: int, reported: bool) -> None:
        before = (self.life.phase, self.life.exit)
        try:
            self.life.on(event, Exit(code, reported, 0.0))
        except ValueError:
            assert (self.life.phase, self.life.exit) == before
            return
        if event in ENDING and self.first_exit is None:
            self.first_exit = Exit(code, reported, 0.0)

    @invariant()
    def the_exit_is_the_first_known(self) -> None:
        assert self.life.exit == self.first_exit

    @invariant()
    def a_reaped_worker_never_runs_again(self) -> None:
        self.was_reaped |= not self.life.alive
        assert not (self.was_reaped and self.life.alive)

    @invariant()
    def a_worker_taken_over_is_never_free_again(self) -> None:
        self.was_taken |= not self.life.free
        assert not (self.was_taken and self.life.free)

    @invariant()
    def a_survivor_runs_free_with_its_end_unknown(self) -> None:
        if self.life.survivable:
            assert self.life.free
            assert self.life.alive
            assert not self.life.ended

    @invariant()
    def an_ended_phase_knows_its_exit(self) -> None:
        if self.life.phase in (Phase.LINGERING, Phase.EXITED, Phase.ABANDONED):
            assert self.life.ended


TestLifeMachine = LifeMachine.TestCase
