"""The worker side of the agent's expiration timers and progress watchdog; needs neither torch nor anyio.

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

Outside an agent that serves timers (no ``TORCHELASTIC_TIMER_FILE``; ``AELASTIC_WATCHDOG_TIMEOUT`` for
:func:`heartbeat`) both do nothing, so the same script runs anywhere.
"""

from __future__ import annotations

import errno
import json
import os
import signal as signal_module
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Final

from .errors import AelasticError

__all__ = ["HEARTBEAT_SCOPE", "WATCHDOG_ENV", "TimerServerUnavailable", "expires", "heartbeat"]

WATCHDOG_ENV: Final = "AELASTIC_WATCHDOG_TIMEOUT"
HEARTBEAT_SCOPE: Final = "aelastic.heartbeat"
_FILE_ENV: Final = "TORCHELASTIC_TIMER_FILE"
_OPEN_TRIES: Final = 10  # torch's client: 10 tries, 0.1 s apart, while the FIFO has no reader
_PIPE_BUF: Final = 4096

_last_heartbeat = 0.0


class TimerServerUnavailable(AelasticError):
    """The timer FIFO has no reader: the agent that served it is gone."""


def _send(scope: str, expiration_time: float, signum: int) -> None:
    path = os.environ.get(_FILE_ENV)
    if not path:
        return
    line = (
        json.dumps(
            {"version": 1, "pid": os.getpid(), "scope_id": scope, "expiration_time": expiration_time, "signal": signum}
        ).encode()
        + b"\n"
    )
    if len(line) > _PIPE_BUF:
        raise ValueError(f"timer scope {scope[:80]!r}...: the request exceeds {_PIPE_BUF} bytes")
    for attempt in range(_OPEN_TRIES):
        try:
            fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
        except OSError as exc:
            if exc.errno != errno.ENXIO or attempt == _OPEN_TRIES - 1:
                raise TimerServerUnavailable(f"timer FIFO {path}: {exc.strerror}") from exc
            time.sleep(0.1)
            continue
        try:
            os.write(fd, line)  # at most PIPE_BUF bytes: written whole
        finally:
            os.close(fd)
        return


@contextmanager
def expires(after: float, scope: str, signal: int = signal_module.SIGKILL) -> Iterator[None]:
    """The block must end within ``after`` seconds, or the agent kills this worker with ``signal``.

    Raises:
        TimerServerUnavailable: the agent serving the timers is gone.
    """
    _send(scope, time.time() + after, int(signal))
    try:
        yield
    finally:
        _send(scope, -1.0, 0)


def heartbeat() -> None:
    """Report progress to the agent's watchdog (module docstring); nothing without ``--watchdog-timeout``.

    Raises:
        TimerServerUnavailable: the agent serving the timers is gone.
    """
    global _last_heartbeat
    timeout = os.environ.get(WATCHDOG_ENV)
    if not timeout:
        return
    seconds = float(timeout)
    now = time.monotonic()
    if _last_heartbeat and now - _last_heartbeat < seconds / 10:
        return
    _send(HEARTBEAT_SCOPE, time.time() + seconds, int(signal_module.SIGKILL))
    _last_heartbeat = now
