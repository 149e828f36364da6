"""The worker's side of the agent's expiration timers and progress watchdog: the client of
:mod:`aelastic.agent.timers.parent`, which users reach as :mod:`aelastic.worker` (its docstring says how to use it).

Both :func:`expires` and :func:`heartbeat` speak torch's ``FileTimerClient`` protocol: one JSON line per request,
at most ``PIPE_BUF`` bytes so that it is written whole, to the FIFO named by ``TORCHELASTIC_TIMER_FILE``, opened
without blocking (tried 10 times 0.1 s apart while it has no reader, as torch's client does). Outside an agent that
serves timers (no ``TORCHELASTIC_TIMER_FILE``; ``AELASTIC_WATCHDOG_TIMEOUT`` for :func:`heartbeat`) both do nothing.
Standard library only (and :mod:`aelastic.errors`): it runs in workers, which need neither torch nor anyio.
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

from ..errors import TimerServerUnavailableError

__all__ = ["FILE_ENV", "HEARTBEAT_SCOPE", "VERSION", "WATCHDOG_ENV", "expires", "heartbeat"]

WATCHDOG_ENV: Final = "AELASTIC_WATCHDOG_TIMEOUT"
HEARTBEAT_SCOPE: Final = "aelastic.heartbeat"
FILE_ENV: Final = "TORCHELASTIC_TIMER_FILE"  # torch's: the FIFO the agent serves
VERSION: Final = 1  # of torch's FileTimerRequest
_OPEN_TRIES: Final = 10  # torch's client: 10 tries, 0.1 s apart, while the FIFO has no reader
_PIPE_BUF: Final = 4096

_last_heartbeat = 0.0


def _send(scope: str, expiration_time: float, signum: int) -> None:
    path = os.environ.get(FILE_ENV)
    if not path:
        return
    line = (
        json.dumps(
            {
                "version": VERSION,
                "pid": os.getpid(),
                "scope_id": scope,
                "expiration_time": expiration_time,
                "signal": signum,
            }
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
                raise TimerServerUnavailableError(f"timer FIFO {path}: {exc.strerror}") from exc
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
        TimerServerUnavailableError: the agent serving the timers is gone.
    """
    _send(scope, time.time() + after, int(signal))
    try:
        yield
    finally:
        _send(scope, -1.0, 0)


def heartbeat() -> None:
    """Report progress to the agent's watchdog (module docstring); nothing without ``--watchdog-timeout``.

    Raises:
        TimerServerUnavailableError: the agent serving the timers is gone.
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
