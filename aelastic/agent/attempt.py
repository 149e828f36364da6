"""What the agent hands the supervisor for its attempts: the signal a cancelled run stops the workers with
(:class:`StopSignal`), the membership change that ends an attempt (:class:`Interrupt`), and what the agent's
features ask of an attempt (:class:`AttemptHooks`)."""

from __future__ import annotations

import signal
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import anyio

from .spawn.parent import WorkerHook, WorkerProcess

__all__ = ["AttemptHooks", "Interrupt", "StopSignal"]


class StopSignal:
    """The signal that stops the workers when their supervision is cancelled (``run_workers(stop_signal=...)``).

    Whoever turns a signal into cancellation (the CLI) sets :attr:`signum` to the signal the agent received, so the
    workers are stopped with it, as torchrun forwards it (SIGINT stays SIGINT: KeyboardInterrupt in the workers).
    The holder is mutable because the signal arrives after supervision has started. A stop after a worker's
    failure is always SIGTERM.
    """

    __slots__ = ("signum",)

    def __init__(self, signum: signal.Signals = signal.SIGTERM) -> None:
        self.signum = signum

    def __repr__(self) -> str:
        return f"<StopSignal {self.signum.name}>"


class Interrupt:
    """What ends an attempt from outside (a membership change): see :meth:`Supervisor.run`. ``peers_lost``:
    members left the round, so survivors blocked in a collective with one of them may never let go by themselves
    (they are given :data:`~aelastic.agent.restart.parent.LOST_ABORT_GRACE` to report)."""

    __slots__ = ("event", "peers_lost")

    def __init__(self) -> None:
        self.event = anyio.Event()
        self.peers_lost = False

    def __repr__(self) -> str:
        return f"<Interrupt set={self.event.is_set()} peers_lost={self.peers_lost}>"

    def set(self, *, peers_lost: bool) -> None:
        self.peers_lost = peers_lost
        self.event.set()


@dataclass(frozen=True)
class AttemptHooks:
    """What the agent's features ask of an attempt, each ``None`` where none does."""

    # Called once every worker has been spawned, with all of them (their pids), before any is awaited.
    started: Callable[[Sequence[WorkerProcess]], None] | None = None
    # Run beside the waiters once every worker has started, with all of them (e.g. the expiration timer server,
    # which may kill a worker: that worker's exit is then a failure like any other); cancelled when the waiters end.
    # Its exceptions propagate after the stop.
    watch: WorkerHook | None = None
    # Awaited, shielded, with the workers still alive when the grace has run out, right before SIGKILL (e.g. a stack
    # dump); it must bound its own time, and its exceptions are logged, not raised.
    before_kill: WorkerHook | None = None
    # Returns once the workers have restored their state: where no standby is idle, one starts then, before the
    # refill delay (for a burst of faults); at once where it is None.
    restored: Callable[[], Awaitable[None]] | None = None
