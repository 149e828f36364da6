"""The agent's restart policy (``aelastic.agent.policy``) by itself: its table, and properties of runs (hypothesis)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from aelastic.agent.policy import RULES, Action, Budget, Decision, FailureMark, Outcome, decide
from aelastic.errors import AelasticError


@pytest.mark.parametrize(
    ("outcome", "budget", "action", "after"),
    [
        (Outcome.SUCCEEDED, Budget(3), Action.SUCCEED, Budget(3)),
        (Outcome.SUCCEEDED, Budget(3, 3, 5), Action.SUCCEED, Budget(3, 3, 5)),
        (Outcome.FAILED, Budget(3), Action.RESTART_FAILURE, Budget(3, 1)),
        (Outcome.FAILED, Budget(3, 2, 4), Action.RESTART_FAILURE, Budget(3, 3, 4)),
        (Outcome.FAILED, Budget(3, 3), Action.STOP_FAILED, Budget(3, 3)),
        (Outcome.FAILED, Budget(0), Action.STOP_FAILED, Budget(0)),
        (Outcome.FAILED, Budget(-1), Action.STOP_FAILED, Budget(-1)),  # only the Python API lets -1 through: no restart
        (Outcome.MEMBERSHIP_CHANGED, Budget(3), Action.RESTART_MEMBERSHIP, Budget(3, 0, 1)),
        (
            Outcome.MEMBERSHIP_CHANGED,
            Budget(0, 0, 7),
            Action.RESTART_MEMBERSHIP,
            Budget(0, 0, 8),
        ),  # never the failure budget
        (Outcome.MEMBERSHIP_CHANGED, Budget(2, 2), Action.RESTART_MEMBERSHIP, Budget(2, 2, 1)),
        (Outcome.CLOSED, Budget(3), Action.STOP_CLOSED, Budget(3)),
        (Outcome.CLOSED, Budget(1, 1, 1), Action.STOP_CLOSED, Budget(1, 1, 1)),
    ],
)
def test_decisions(outcome: Outcome, budget: Budget, action: Action, after: Budget) -> None:
    assert decide(outcome, budget) == Decision(action, after)


def test_the_table_has_a_row_for_every_pair_and_reaches_every_action() -> None:
    assert set(RULES) == set(itertools.product(Outcome, (True, False)))
    assert set(RULES.values()) == set(Action) - {Action.STOP_NO_PROGRESS}  # the repeat rule's, before the table


AT_STEP_4 = FailureMark(2, "RuntimeError: the batch is corrupt", 4, 30.0)


def test_the_same_failure_three_times_in_a_row_stops_with_restarts_left() -> None:
    budget = Budget(10, max_repeated=3)
    actions = []
    for _ in range(3):
        decision = decide(Outcome.FAILED, budget, AT_STEP_4)
        actions.append(decision.action)
        budget = decision.budget
    assert actions == [Action.RESTART_FAILURE, Action.RESTART_FAILURE, Action.STOP_NO_PROGRESS]
    assert (budget.failure_restarts, budget.repeated, budget.last_failure) == (2, 3, AT_STEP_4)


def test_a_failure_that_differs_starts_the_count_again_and_off_never_stops() -> None:
    budget = decide(Outcome.FAILED, Budget(10, max_repeated=2), AT_STEP_4).budget
    later = AT_STEP_4._replace(step=9)  # it got further: progress
    assert decide(Outcome.FAILED, budget, later).action is Action.RESTART_FAILURE
    assert decide(Outcome.FAILED, budget, later).budget.repeated == 1
    membership = decide(Outcome.MEMBERSHIP_CHANGED, budget).budget  # a node joining between them changes nothing
    assert decide(Outcome.FAILED, membership, AT_STEP_4).action is Action.STOP_NO_PROGRESS
    off = Budget(10)
    for _ in range(5):
        off = decide(Outcome.FAILED, off, AT_STEP_4).budget
    assert off.failure_restarts == 5


@pytest.mark.parametrize(
    ("other", "same"),
    [
        (AT_STEP_4, True),
        (AT_STEP_4._replace(seconds=500.0), True),  # a step says it: the time does not matter
        (AT_STEP_4._replace(step=5), False),
        (AT_STEP_4._replace(rank=3), False),
        (AT_STEP_4._replace(error="KeyError: 'x'"), False),
        (AT_STEP_4._replace(step=None), False),
    ],
)
def test_a_failure_is_the_same_at_the_same_step(other: FailureMark, same: bool) -> None:
    assert AT_STEP_4.same_as(other) is same


@pytest.mark.parametrize(
    ("first", "then", "same"), [(100.0, 31.0, False), (100.0, 95.0, True), (100.0, 110.0, True), (100.0, 115.0, False),
                                (3.0, 4.5, True), (3.0, 5.5, False)],  # within 10 %, or 2 s for short attempts
)  # fmt: skip
def test_without_steps_a_failure_is_the_same_as_long_after_the_start(first: float, then: float, same: bool) -> None:
    at = FailureMark(0, "RuntimeError: x", None, first)
    assert at.same_as(at._replace(seconds=then)) is same


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"failure_restarts": -1}, "Budget failure_restarts=-1: must be an integer >= 0"),
        ({"membership_restarts": -2}, "Budget membership_restarts=-2: must be an integer >= 0"),
        ({"failure_restarts": 4}, "Budget failure_restarts=4: more than max_restarts=3"),
    ],
)
def test_an_impossible_budget_is_refused_naming_the_field(fields: dict[str, int], message: str) -> None:
    with pytest.raises(AelasticError) as caught:
        Budget(3, **fields)
    assert str(caught.value) == message


budgets = st.integers(-2, 6).flatmap(
    lambda most: st.builds(Budget, st.just(most), st.integers(0, max(most, 0)), st.integers(0, 1_000))
)


@given(outcome=st.sampled_from(Outcome), budget=budgets)
def test_a_decision_spends_at_most_one_restart_of_its_own_kind(outcome: Outcome, budget: Budget) -> None:
    decision = decide(outcome, budget)
    spent = (
        decision.budget.failure_restarts - budget.failure_restarts,
        decision.budget.membership_restarts - budget.membership_restarts,
    )
    assert decision.budget.max_restarts == budget.max_restarts
    assert spent == {Action.RESTART_FAILURE: (1, 0), Action.RESTART_MEMBERSHIP: (0, 1)}.get(decision.action, (0, 0))
    assert (decision.action is Action.SUCCEED) == (outcome is Outcome.SUCCEEDED)  # nothing but a success succeeds


@given(max_restarts=st.integers(-1, 8), outcomes=st.lists(st.sampled_from(Outcome), max_size=40))
def test_a_run_restarts_each_failure_until_the_budget_is_spent_then_stops(
    max_restarts: int, outcomes: list[Outcome]
) -> None:
    """Attempts' outcomes in sequence, as the agent meets them: the run ends at the first success, the first close,
    or the first failure with no restart left, and membership changes never bring that failure nearer."""
    budget = Budget(max_restarts)
    actions: list[Action] = []
    for outcome in outcomes:
        decision = decide(outcome, budget)
        budget = decision.budget
        actions.append(decision.action)
        if decision.action in (Action.SUCCEED, Action.STOP_FAILED, Action.STOP_CLOSED):
            break
    failures = outcomes[: len(actions)].count(Outcome.FAILED)
    assert budget.failure_restarts == actions.count(Action.RESTART_FAILURE) == min(failures, max(max_restarts, 0))
    assert budget.membership_restarts == actions.count(Action.RESTART_MEMBERSHIP)
    assert actions.count(Action.RESTART_MEMBERSHIP) == outcomes[: len(actions)].count(Outcome.MEMBERSHIP_CHANGED)
    if Action.STOP_FAILED in actions:
        assert actions[-1] is Action.STOP_FAILED
        assert failures == max(max_restarts, 0) + 1  # the failure past the last restart, and no earlier one
