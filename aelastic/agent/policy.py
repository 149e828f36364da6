"""What follows an attempt: the agent's restart policy as one pure function of the attempt's outcome and the budget.

Theory of operation
-------------------
An attempt (one rendezvous round's workers on this node) ends in one of four ways, the :class:`Outcome`: every
local worker succeeded; a worker failed; the rendezvous's membership changed while the workers ran (a node joined,
or a member was found dead); or the rendezvous was closed by another node, whose job ended. The agent
(:mod:`aelastic.agent.agent`) gathers that fact, asks :func:`decide` what follows, records the decision (state,
metrics, events, log) and performs it. :func:`decide` reads no clock, performs no I/O and keeps no state: the
restarts spent so far travel in the :class:`Budget` it is given and the one it hands back.

``RULES`` below is the whole policy, one row per outcome and whether a failure restart is left:

* a success is a success, whatever the budget;
* a failure restarts the workers while ``max_restarts`` allows (torch's ``remaining_restarts``) and fails the run
  after that; the node leaving the round is, for every other node, a membership change;
* a membership change restarts the workers and never spends the failure budget (torch's agent spends none either;
  ``TORCHELASTIC_RESTART_COUNT`` counts failure restarts only, ``AELASTIC_MEMBERSHIP_RESTARTS`` the others);
* a closed rendezvous stops this node: its job is over elsewhere, and restarting could only wait for a round that
  never comes.

One rule goes before the table, and only when asked for (``max_repeated``): a failure that repeats the one before
it (:meth:`FailureMark.same_as`: the same rank and error, at the same step, or as long after its attempt's start)
for the ``max_repeated``-th time in a row stops the run, restarts left or not: the job makes no progress, and
requeueing it would fail again.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Final, NamedTuple

from ..errors import AelasticError

__all__ = ["RULES", "Action", "Budget", "Decision", "FailureMark", "Outcome", "decide"]


class Outcome(enum.Enum):
    """How one attempt ended, as the agent observed it."""

    SUCCEEDED = "succeeded"  # every local worker exited 0
    FAILED = "failed"  # a local worker exited non-zero (or was killed)
    MEMBERSHIP_CHANGED = "membership changed"  # a node joined or a member left before the workers ended
    CLOSED = "closed"  # the rendezvous was closed by another node before the workers ended


class Action(enum.Enum):
    """What the agent does next."""

    SUCCEED = "succeed"  # meet the other nodes at the exit barrier; the run succeeded
    RESTART_FAILURE = "restart after a failure"  # re-rendezvous, spending one of max_restarts
    RESTART_MEMBERSHIP = "restart after a membership change"  # re-rendezvous, spending nothing
    STOP_FAILED = "stop: the run failed"  # no failure restart left: the run's result is FAILED
    STOP_CLOSED = "stop: the rendezvous was closed"  # another node ended the job: RendezvousClosedError
    STOP_NO_PROGRESS = "stop: no progress"  # the same failure max_repeated times in a row: NoProgressError


# (outcome, a failure restart left) -> action: every pair has its row (a test checks it, and that every action
# is reachable).
RULES: Final[Mapping[tuple[Outcome, bool], Action]] = {
    (Outcome.SUCCEEDED, True): Action.SUCCEED,
    (Outcome.SUCCEEDED, False): Action.SUCCEED,
    (Outcome.FAILED, True): Action.RESTART_FAILURE,
    (Outcome.FAILED, False): Action.STOP_FAILED,
    (Outcome.MEMBERSHIP_CHANGED, True): Action.RESTART_MEMBERSHIP,
    (Outcome.MEMBERSHIP_CHANGED, False): Action.RESTART_MEMBERSHIP,
    (Outcome.CLOSED, True): Action.STOP_CLOSED,
    (Outcome.CLOSED, False): Action.STOP_CLOSED,
}


@dataclass(frozen=True, slots=True)
class Budget:
    """The restarts spent so far, and the limit on failure restarts (membership restarts are not limited).

    A negative ``max_restarts``, which only the Python API lets through (the command line and ``LaunchConfig``
    refuse it), allows no failure restart, as ``0`` does.
    """

    max_restarts: int
    failure_restarts: int = 0
    membership_restarts: int = 0
    max_repeated: int = 0  # the same failure this many times in a row stops the run (0: never)
    repeated: int = 0  # how many times in a row the last failure happened the same way
    last_failure: FailureMark | None = None

    def __post_init__(self) -> None:
        for name in ("failure_restarts", "membership_restarts", "max_repeated", "repeated"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise AelasticError(f"Budget {name}={value!r}: must be an integer >= 0")
        if self.failure_restarts > max(self.max_restarts, 0):
            raise AelasticError(
                f"Budget failure_restarts={self.failure_restarts}: more than max_restarts={self.max_restarts}"
            )

    @property
    def failure_restart_left(self) -> bool:
        return self.failure_restarts < self.max_restarts


class FailureMark(NamedTuple):
    """How an attempt failed, to tell a failure that repeats the last one: the rank that failed first, its error,
    the last step it checkpointed (``None``: none), the seconds from the attempt's start."""

    rank: int
    error: str
    step: int | None
    seconds: float

    def same_as(self, other: FailureMark) -> bool:
        """The same rank and error, at the same step (or, without steps, within 10 % or 2 s of the same time)."""
        if (self.rank, self.error) != (other.rank, other.error):
            return False
        if self.step is not None or other.step is not None:
            return self.step == other.step
        return abs(self.seconds - other.seconds) <= max(2.0, 0.1 * max(self.seconds, other.seconds))


@dataclass(frozen=True, slots=True)
class Decision:
    """What follows an attempt, and the budget after it (a restart is already counted there)."""

    action: Action
    budget: Budget


def decide(outcome: Outcome, budget: Budget, failure: FailureMark | None = None) -> Decision:
    """What follows an attempt that ended with ``outcome``, given the restarts spent so far (see ``RULES`` and the
    module doc); ``failure``: how a failed attempt failed."""
    if outcome is Outcome.FAILED and failure is not None:
        last = budget.last_failure
        repeated = budget.repeated + 1 if last is not None and failure.same_as(last) else 1
        budget = replace(budget, repeated=repeated, last_failure=failure)
        if budget.max_repeated and repeated >= budget.max_repeated:
            return Decision(Action.STOP_NO_PROGRESS, budget)
    action = RULES[outcome, budget.failure_restart_left]
    if action is Action.RESTART_FAILURE:
        budget = replace(budget, failure_restarts=budget.failure_restarts + 1)
    elif action is Action.RESTART_MEMBERSHIP:
        budget = replace(budget, membership_restarts=budget.membership_restarts + 1)
    return Decision(action, budget)
