"""The CPU share of a session the agent started (each worker and standby leads one, as torchrun's do).

Where the kernel groups each session's processes for the scheduler (``sched_autogroup_enabled``, the default of most
distributions), a nice value or ``SCHED_IDLE`` weighs only against the same session's processes: against the other
workers only the session's share counts (a standby preloading under ``SCHED_IDLE``, or a failed worker's teardown at
nice 19, still takes CPU from a restore beside it). The agent lowers a session's share for a while, and gives it back,
in two places: the standby it starts at once after a restart (:meth:`~aelastic.agent.prewarm.parent.Standbys.refill`)
and a failed worker's teardown (:func:`quietly`, for the :class:`~aelastic.agent.processes.Supervisor`). Only where the
agent has ``CAP_SYS_ADMIN``: without it the kernel takes one change per 0.1 s on the whole host, and a share lowered
could not be given back when it must be.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Awaitable, Callable
from contextlib import suppress
from typing import Final

import anyio

__all__ = ["LINGERING_NICE", "QUIET_TEARDOWN", "quietly", "set_session_nice", "shares_at_once"]

LINGERING_NICE: Final = 19  # a lingering worker at the lowest priority
# ... and its session at the lowest CPU share for this long: the next attempt's workers start and restore their state
# meanwhile (here, at 1 GiB a rank: within about 0.5 s of the report). Then it is back: until the process is gone its
# sockets stay open, and survivors blocked in a collective with it wait for them to close.
QUIET_TEARDOWN: Final = 1.0


def set_session_nice(nice: int, pid: int) -> bool:
    """Give the session that ``pid`` leads the CPU share of a task at ``nice``; whether it did.

    Only a session's leader sets it (the session is then its own and its children's). Not done: no autogroups, not
    the leader, the process gone, or a change within 0.1 s of another, which the kernel refuses without
    ``CAP_SYS_ADMIN``."""
    try:
        if os.getsid(pid) != pid:
            return False
        with open(f"/proc/{pid}/autogroup", "r+") as autogroup:  # "/autogroup-<id> nice <n>"
            if autogroup.read().split()[-1] != str(nice):  # unchanged: no write to count against the 0.1 s
                autogroup.write(str(nice))
    except (OSError, IndexError):
        return False
    return True


@functools.cache
def shares_at_once() -> bool:
    """Whether the agent may change a session's CPU share at any moment (``CAP_SYS_ADMIN``)."""
    from ..worker._standby import CAP_SYS_ADMIN, capable  # the standby's side reads capabilities too; standard library

    return capable(CAP_SYS_ADMIN)


async def quietly(pid: int, ended: Callable[[], Awaitable[object]]) -> None:
    """The teardown of a lingering worker (``pid``: reported, or dying of a stop's signal) is nobody's wait any more:
    the next attempt's workers, starting now, go first. Its session's share is lowered for :data:`QUIET_TEARDOWN` at
    most (``ended`` returns when it has ended), since survivors blocked in a collective with it are released only when
    its sockets close."""
    with suppress(OSError):
        os.setpriority(os.PRIO_PGRP, pid, LINGERING_NICE)
    if shares_at_once() and set_session_nice(LINGERING_NICE, pid):
        with anyio.move_on_after(QUIET_TEARDOWN):
            await ended()
        set_session_nice(0, pid)
