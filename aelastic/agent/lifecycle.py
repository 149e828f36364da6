"""A started worker's life as a table: its phases, the events that move it, and what it is known to have exited with.
Pure: no event loop, no process, no clock. The supervisor (:mod:`.processes`) is its driver: it turns what it
observes (a report over the link, the kernel's reap, a stop it begins, a verdict) into :class:`Event`\\ s, and reads
the phase to decide what to await next. Nothing else changes a worker's phase (``tests/test_architecture.py``).

::

    RUNNING ──FAIL──▶ FAILING            a restartable worker told its exception is its own failure
    RUNNING ──KEEP──▶ KEPT ──REASSIGN──▶ RUNNING    a survivor aborted for the next attempt, then given it
    RUNNING, FAILING, KEPT ──REPORT──▶ LINGERING     its exit came over its link; its teardown runs on
    RUNNING, FAILING, KEPT ──EXIT──▶ EXITED          the kernel reaped it
    RUNNING, FAILING, KEPT ──STOP──▶ STOPPING        a stop signalled it
    EXITED ──STOP──▶ REAPED                          a stop kills what is left of its group
    STOPPING ──REPORT or DOOMED──▶ STOPPING          its exit is known now (it reported; it dies of the signal)
    STOPPING, LINGERING ──EXIT──▶ REAPED
    any but CLOSED ──ABANDON──▶ ABANDONED            the kernel does not end it: given up
    REAPED, ABANDONED ──CLOSE──▶ CLOSED              its pipes, link and files closed; off the books

A worker is *free* until a stop or its own lingering takes it over (the stop's targets are the free ones), and
*survives* into the next attempt only while free and alive. Its exit (code, whether it was reported) is the first
one known, whatever comes after.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Final, NamedTuple

__all__ = ["TRANSITIONS", "Event", "Exit", "Lifecycle", "Phase"]


class Phase(enum.Enum):
    RUNNING = "running"
    FAILING = "failing"  # running; told its exception is its own failure: it ends by itself
    KEPT = "kept"  # running; aborted and kept for the next attempt (a survivor)
    STOPPING = "stopping"  # a stop signalled it; the stop reaps it
    LINGERING = "lingering"  # it reported its exit; its teardown runs, then its life kills and reaps it
    EXITED = "exited"  # reaped by the kernel while free; a stop still kills its group's leftovers
    REAPED = "reaped"  # reaped under a stop or its lingering
    ABANDONED = "abandoned"  # alive after SIGKILL beyond the bound: given up
    CLOSED = "closed"


class Event(enum.Enum):
    FAIL = "fail"  # the verdict on its report: its exception is its own failure
    KEEP = "keep"  # aborted for the next attempt
    REASSIGN = "reassign"  # given the next attempt in its process
    REPORT = "report"  # its exit status came over its link
    EXIT = "exit"  # the kernel reaped it
    STOP = "stop"  # a stop took it over and signalled it
    DOOMED = "doomed"  # it dies of the stop's signal on delivery
    ABANDON = "abandon"
    CLOSE = "close"


_FREE_ALIVE: Final = (Phase.RUNNING, Phase.FAILING, Phase.KEPT)
_TAKEN: Final = (Phase.STOPPING, Phase.LINGERING, Phase.REAPED, Phase.ABANDONED, Phase.CLOSED)

TRANSITIONS: Final[Mapping[tuple[Phase, Event], Phase]] = {
    (Phase.RUNNING, Event.FAIL): Phase.FAILING,
    (Phase.RUNNING, Event.KEEP): Phase.KEPT,
    (Phase.KEPT, Event.REASSIGN): Phase.RUNNING,
    **{(phase, Event.REPORT): Phase.LINGERING for phase in _FREE_ALIVE},
    **{(phase, Event.EXIT): Phase.EXITED for phase in _FREE_ALIVE},
    **{(phase, Event.STOP): Phase.STOPPING for phase in _FREE_ALIVE},
    (Phase.EXITED, Event.STOP): Phase.REAPED,
    (Phase.STOPPING, Event.REPORT): Phase.STOPPING,
    (Phase.STOPPING, Event.DOOMED): Phase.STOPPING,
    (Phase.STOPPING, Event.EXIT): Phase.REAPED,
    (Phase.LINGERING, Event.EXIT): Phase.REAPED,
    **{(phase, Event.ABANDON): Phase.ABANDONED for phase in Phase if phase is not Phase.CLOSED},
    (Phase.REAPED, Event.CLOSE): Phase.CLOSED,
    (Phase.ABANDONED, Event.CLOSE): Phase.CLOSED,
    # A verdict that comes when the worker no longer runs free changes nothing; nor does news of a worker given up.
    **{(phase, Event.FAIL): phase for phase in Phase if phase is not Phase.RUNNING},
    **{(phase, event): phase for phase in (Phase.ABANDONED, Phase.CLOSED) for event in (Event.REPORT, Event.EXIT)},
}
"""Every legal move; any other is a bug, and :meth:`Lifecycle.on` raises."""

# The events that make the exit known (the first one known is kept).
_ENDING: Final = frozenset({Event.REPORT, Event.EXIT, Event.DOOMED, Event.ABANDON})


class Exit(NamedTuple):
    code: int  # negative: the signal (as Popen.returncode)
    reported: bool  # it came over the link, before the interpreter's teardown
    timestamp: float  # when the agent learned it (epoch seconds, the driver's clock)


class Lifecycle:
    """One worker's phase and exit, changed only through :meth:`on`."""

    __slots__ = ("_phase", "exit")

    def __init__(self) -> None:
        self._phase = Phase.RUNNING
        self.exit: Exit | None = None

    def __repr__(self) -> str:
        return f"<Lifecycle {self._phase.value} exit={self.exit}>"

    @property
    def phase(self) -> Phase:
        return self._phase

    def on(self, event: Event, exit: Exit | None = None) -> Phase:
        """Move by ``event``; ``exit`` is what an ending event (report, exit, doomed, abandon) says it exited with.

        Raises:
            ValueError: the table has no such move (a bug of the driver), or an ending event without its exit.
        """
        new = TRANSITIONS.get((self._phase, event))
        if new is None:
            raise ValueError(f"worker lifecycle: no move from {self._phase.value} on {event.value}")
        if event in _ENDING:
            if exit is None:
                raise ValueError(f"worker lifecycle: {event.value} needs the exit")
            if self.exit is None:
                self.exit = exit
        self._phase = new
        return new

    @property
    def ended(self) -> bool:
        """Whether its exit status is known."""
        return self.exit is not None

    @property
    def alive(self) -> bool:
        """Whether its leader is not reaped yet (its group id is still its own)."""
        return self._phase in (*_FREE_ALIVE, Phase.STOPPING, Phase.LINGERING)

    @property
    def free(self) -> bool:
        """Whether no stop (nor its own lingering) has taken it over: a stop's target."""
        return self._phase not in _TAKEN

    @property
    def survivable(self) -> bool:
        """Whether it may go on into the next attempt in its process (if it registered for in-process restarts)."""
        return self._phase in (Phase.RUNNING, Phase.KEPT)
