"""The worker's API: expiration timers, the progress watchdog and in-process restarts; needs neither torch nor anyio.

::

    from aelastic import worker

    for batch in loader:
        worker.heartbeat()                                   # progress: armed by `aelastic run --watchdog-timeout S`
        with worker.expires(after=60, scope="allreduce"):    # this block must end within 60 s
            step(batch)

Both speak torch's ``FileTimerClient`` protocol to the FIFO the agent serves (:mod:`aelastic.agent.timers`), so
the agent handles them exactly like torch's timers: when one expires it dumps the worker's stack, kills it with the
requested signal (SIGKILL by default) and the group takes the ordinary failure path (restart while
``--max-restarts`` remain; the failure report names the scope).

* :func:`expires` arms a timer for the block and releases it at the end, whatever the block did.
* :func:`heartbeat` re-arms the scope ``"aelastic.heartbeat"`` to expire ``--watchdog-timeout`` seconds later:
  a worker that stops calling it (hung, deadlocked, stopped) is killed that long after its last call. The
  watchdog is armed by the first call; a worker that never calls it is not watched. To keep the cost of a call
  per step negligible, a call within a tenth of the timeout of the last one sent sends nothing, so a silent worker
  is killed between 0.9 and 1 times the timeout after its last call.
* :func:`step` marks a training step complete, for the agent's incident records (what a fault cost, the steps
  redone); :func:`busy` marks a block that only looks hung from outside, for ``--hang-timeout``
  (``docs/howto/incidents.md``).
* :func:`restartable` wraps the training function so that a worker keeps its process when another fails: the
  function is called again for the next round (``docs/howto/survivors.md``).

Outside an agent that serves timers (no ``TORCHELASTIC_TIMER_FILE``; ``AELASTIC_WATCHDOG_TIMEOUT`` for
:func:`heartbeat`) both do nothing, so the same script runs anywhere. Both raise
:class:`~aelastic.errors.TimerServerUnavailableError` when the agent that served the timers is gone.

This package holds everything of aelastic that runs in a worker's interpreter (the training process, a standby
that becomes one, the node check's process); the agent never does. Its private modules are the worker's sides of
the agent's features, standard library only but for torch where a checkpoint or the node check needs it; this
``__init__`` imports them on first use, so that a worker pays only for what it calls.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_exports
from ..errors import TimerServerUnavailableError

if TYPE_CHECKING:
    from ._progress import busy, step
    from ._restart import RestartRequested, restartable
    from ._timers import HEARTBEAT_SCOPE, WATCHDOG_ENV, expires, heartbeat

_LAZY = {
    "HEARTBEAT_SCOPE": "._timers",
    "WATCHDOG_ENV": "._timers",
    "expires": "._timers",
    "heartbeat": "._timers",
    "busy": "._progress",
    "step": "._progress",
    "RestartRequested": "._restart",
    "restartable": "._restart",
}

__all__ = [
    "HEARTBEAT_SCOPE",
    "WATCHDOG_ENV",
    "RestartRequested",
    "TimerServerUnavailableError",
    "busy",
    "expires",
    "heartbeat",
    "restartable",
    "step",
]

__getattr__, __dir__ = lazy_exports(__name__, globals(), _LAZY)
