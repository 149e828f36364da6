"""The pure part of incident records (see :mod:`aelastic.agent.incidents`): what each fault cost one node, phase by
phase, from the times the agent passes in. No I/O and no clock.

An incident's time runs from the last step the node completed before the fault to the moment the job is back where
it would have been without it: the step after that one completed again, less one ordinary step (the work it holds
would have been done anyway). That span is cut at the times the agent saw, so the phases add up to it exactly:

* ``redone``: the work thrown away: the step under way when the fault struck, and once the workers restored, the
  steps they do again (from the restored step to the one the fault interrupted);
* ``detection``: from the fault to the agent's notice (a worker's exit is noticed at once; a hang after its
  timeout);
* ``stop``: from the notice to the workers stopped (the failed one gone, the others stopped or kept as survivors);
* ``rendezvous``: to the next round's ranks;
* ``start``: to the workers' restore request (or their first step, where nothing is restored): a cold start's
  interpreter, imports and ``init_process_group``, a standby's hand-over, a survivor's re-entry;
* ``restore``: the checkpoint's copy, from the first local rank's request to the last one's end.

Steps are the workers' marks (``aelastic.checkpoint.save(step=)``, ``aelastic.worker.step(n)``); a step is
complete on the node when every local rank marked it. Without marks the incident ends when its workers start.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Final

__all__ = ["PHASES", "Incident", "Ledger", "goodput", "summary"]

PHASES: Final = ("detection", "stop", "rendezvous", "start", "restore", "redone")
_RECENT: Final = 8  # the step intervals whose median is the ordinary step's time
_PENDING: Final = 64  # steps some local ranks marked and others not yet: the oldest go beyond this


@dataclass(frozen=True, slots=True)
class Incident:
    """One fault's cost on this node; ``phases`` in :data:`PHASES` order, seconds."""

    number: int
    cause: str  # "worker rank 3 failed (exitcode -9)", "membership change: node 1 left", ...
    kind: str  # the counters' label: "failure", "membership", "hang"
    phases: Mapping[str, float]
    start: str  # how the workers started again: "cold", "pre-warmed", "kept" (survivors), or "1 kept, 1 cold"
    restored: str | None  # "step 41 from memory"; None when nothing was restored
    redone_steps: int | None  # None without step marks
    complete: bool  # False: the job ended (or failed again) before it was back where it was

    @property
    def lost(self) -> float:
        return sum(self.phases.values())

    def describe(self) -> str:
        """One line: what it cost and where the time went."""
        parts = [f"{name} {self.phases[name]:.3f} s" for name in PHASES]
        parts[PHASES.index("start")] += f" ({self.start})"
        if self.restored is not None:
            parts[PHASES.index("restore")] += f" ({self.restored})"
        if self.redone_steps is not None:
            parts[PHASES.index("redone")] += f" ({self.redone_steps} step{'' if self.redone_steps == 1 else 's'})"
        until = "" if self.complete else ", until the job ended"
        return f"incident {self.number} ({self.cause}): {self.lost:.3f} s lost{until}: {', '.join(parts)}"

    def to_json(self) -> dict[str, str | int | float | bool | None]:
        fields: dict[str, str | int | float | bool | None] = {
            "incident": self.number, "cause": self.cause, "kind": self.kind, "lost_s": round(self.lost, 6),
            "start": self.start, "restored": self.restored, "redone_steps": self.redone_steps,
            "complete": self.complete,
        }  # fmt: skip
        fields.update({f"{name}_s": round(seconds, 6) for name, seconds in self.phases.items()})
        return fields


@dataclass
class _Open:
    """An incident under way: its boundaries as they become known."""

    number: int
    cause: str
    kind: str
    last_step: int | None  # the last step complete before the fault
    ordinary: float  # an ordinary step's seconds, before the fault
    times: dict[str, float] = field(default_factory=dict)  # boundary -> time: begin, fault, notice, stopped, ...
    start: str = "cold"
    restored_step: int | None = None
    restored_from: str | None = None
    first_step: int | None = None  # the first step marked after the restart


class Ledger:
    """One node's incidents, fed the times of what the agent sees (the methods, in the order things happen)."""

    def __init__(self, local_ranks: int) -> None:
        self.local_ranks = local_ranks
        self.incidents: list[Incident] = []
        self._marks: dict[int, tuple[set[int], float]] = {}  # step -> (local ranks that marked it, latest time)
        self._completed: deque[tuple[int, float]] = deque(maxlen=_RECENT + 1)  # (step, time), the last ones
        self._open: _Open | None = None
        self._closed_at: float | None = None  # the end of the last incident: the next one cannot begin before

    def __repr__(self) -> str:
        return f"<Ledger incidents={len(self.incidents)} open={self._open is not None}>"

    def last_step_time(self, default: float) -> float:
        """When the node last completed a step (``default``: none since the last fault)."""
        return self._completed[-1][1] if self._completed else default

    def fault(self, cause: str, kind: str, fault: float, notice: float) -> Incident | None:
        """A fault struck at ``fault`` and the agent learned of it at ``notice``. Returns the incident it cut short,
        if one was still open."""
        previous = self._open
        cut = None if previous is None else self._close(fault, complete=False)
        last = self._completed[-1] if self._completed else None
        begin = fault if last is None else last[1]
        if self._closed_at is not None:
            begin = max(begin, self._closed_at)
        last_step, ordinary = (None, 0.0) if last is None else (last[0], self._ordinary())
        if previous is not None:  # cut short: the job is not back yet where the earlier fault found it
            steps = [s for s in (last_step, previous.last_step) if s is not None]
            last_step, ordinary = (max(steps) if steps else None), previous.ordinary
        self._open = _Open(len(self.incidents) + 1, cause, kind, last_step, ordinary)
        self._open.times.update(begin=min(begin, fault), fault=fault, notice=max(notice, fault))
        self._marks.clear()  # the steps of the attempt that failed: the next attempt marks its own
        self._completed.clear()  # the redone steps' times say nothing of an ordinary step's
        return cut

    def stopped(self, at: float) -> None:
        self._boundary("stopped", at)

    def rendezvous_done(self, at: float) -> None:
        """A round completed (the last one before the workers start counts: a node check may ask for another)."""
        if self._open is not None and "started" not in self._open.times:
            self._open.times["rendezvous"] = at

    def started(self, at: float, how: str) -> Incident | None:
        """The workers started (spawned, handed over, re-entered); without step marks the incident ends here."""
        if self._open is None:
            return None
        self._open.start = how
        self._boundary("started", at)
        return self._close(at) if self._open.last_step is None else None

    def restore_began(self, at: float) -> None:
        self._boundary("restore", at)

    def restored(self, at: float, step: int, source: str) -> None:
        """A local rank finished restoring ``step`` from ``source`` (the last one ends the phase)."""
        if self._open is not None and "restore" in self._open.times:
            self._open.times["restored"] = max(at, self._open.times.get("restored", at))
            self._open.restored_step, self._open.restored_from = step, source

    def step(self, local_rank: int, step: int, at: float) -> Incident | None:
        """``local_rank`` completed ``step`` at ``at``; returns the incident this ends (the job is back)."""
        if self._open is not None and "started" not in self._open.times:
            return None  # a rank of the attempt that failed, finishing a step before it is stopped: thrown away
        ranks, latest = self._marks.get(step, (set(), at))
        ranks.add(local_rank)
        self._marks[step] = (ranks, max(latest, at))
        if len(ranks) < self.local_ranks:
            if len(self._marks) > _PENDING:  # a rank that never marks (the marks are every rank's to make)
                del self._marks[min(self._marks)]
            return None
        del self._marks[step]
        for old in [s for s in self._marks if s < step]:  # marks a rank will not complete: it moved on
            del self._marks[old]
        done = max(latest, at)
        self._completed.append((step, done))
        incident = self._open
        if incident is None:
            return None
        if incident.first_step is None:
            incident.first_step = step
            self._boundary("restore", done)  # nothing restored: the start ends with the first step
            self._boundary("restored", done)  # a DCP load says nothing of its end: its first step does
        if incident.last_step is not None and step > incident.last_step:
            return self._close(max(done - incident.ordinary, incident.times["begin"]))
        return None

    def close(self, at: float) -> Incident | None:
        """The run ended: an incident still open ends here."""
        return None if self._open is None else self._close(at, complete=False)

    def _boundary(self, name: str, at: float) -> None:
        if self._open is not None:
            self._open.times.setdefault(name, at)

    def _ordinary(self) -> float:
        done = list(self._completed)
        intervals = [(b[1] - a[1]) / max(b[0] - a[0], 1) for a, b in itertools.pairwise(done)]
        intervals.sort()  # their median (the statistics module costs the agent's start 2 ms of imports)
        return (intervals[(len(intervals) - 1) // 2] + intervals[len(intervals) // 2]) / 2 if intervals else 0.0

    def _close(self, end: float, *, complete: bool = True) -> Incident:
        inc = self._open
        assert inc is not None
        self._open, self._closed_at = None, end
        t = inc.times
        # The boundaries in order; one never reached takes the next one's time (the phase it begins is 0), and
        # none is past the end.
        order = ["begin", "fault", "notice", "stopped", "rendezvous", "started", "restore", "restored"]
        at, seen = {}, end
        for name in reversed(order):
            seen = min(t.get(name, seen), seen)
            at[name] = seen
        for earlier, later in itertools.pairwise(order):
            at[later] = max(at[later], at[earlier])
        phases = {
            "detection": at["notice"] - at["fault"],
            "stop": at["stopped"] - at["notice"],
            "rendezvous": at["rendezvous"] - at["stopped"],
            "start": at["restore"] - at["rendezvous"],
            "restore": at["restored"] - at["restore"],
            "redone": (at["fault"] - at["begin"]) + (end - at["restored"]),
        }
        redone = None
        if inc.last_step is not None and inc.first_step is not None:
            first = inc.restored_step + 1 if inc.restored_step is not None else inc.first_step
            redone = max(inc.last_step - first + 1, 0)
        restored = None if inc.restored_step is None else f"step {inc.restored_step} from {inc.restored_from}"
        incident = Incident(inc.number, inc.cause, inc.kind, phases, inc.start, restored, redone, complete)
        self.incidents.append(incident)
        return incident


def goodput(incidents: Iterable[Incident], total: float) -> float:
    """The share of ``total`` seconds that ``incidents`` did not lose."""
    return 1.0 - sum(i.lost for i in incidents) / total if total > 0 else 1.0


def summary(incidents: Iterable[Incident], total: float) -> str | None:
    """The job's line at its end: what its incidents cost of ``total`` seconds, and where the time went; ``None``
    when there was none."""
    incidents = list(incidents)
    if not incidents:
        return None
    lost = sum(i.lost for i in incidents)
    phases = ", ".join(f"{name} {sum(i.phases[name] for i in incidents):.3f} s" for name in PHASES)
    kinds: dict[str, int] = {}
    for incident in incidents:
        kinds[incident.kind] = kinds.get(incident.kind, 0) + 1
    causes = ", ".join(f"{count} {kind}" for kind, count in kinds.items())
    n = len(incidents)
    return (f"{n} incident{'' if n == 1 else 's'} ({causes}) cost {lost:.3f} s of {total:,.0f} s "
            f"(goodput {100 * goodput(incidents, total):.2f} %): {phases}")  # fmt: skip
