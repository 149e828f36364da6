"""Expiration timers: torch's ``FileTimerServer`` protocol, served from the agent's event loop (the agent's side
of :mod:`aelastic.agent.timers`).

Workers ask for timers by writing one JSON line per request to a FIFO (torch's ``FileTimerClient``, unmodified,
or :mod:`aelastic.worker`, whose client is :mod:`aelastic.worker._timers`)::

    {"version": 1, "pid": <worker pid>, "scope_id": "<scope>", "expiration_time": <epoch s>, "signal": <signum>}

A request *acquires* (or re-arms) the timer keyed ``(pid, scope_id)``; a negative ``expiration_time`` releases it.
When a timer expires (``expiration_time <= time.time()``, the wall clock the client used), the worker's expired
timers are taken in expiration order up to the first with a signal ``> 0``, and that signal goes to the worker's
pid; timers without a signal never kill, and every expired timer of that pid is cleared either way (torch's
rules).

Unlike torch's server (a thread polling every 0.1 s, which then kills *its own agent* with the same signal), the
FIFO is read with ``anyio.wait_readable`` on a non-blocking descriptor and the next expiry is one timer of the
event loop; the agent kills only the worker (after its ``on_expired`` callback, which dumps stacks and notes the
scope for the failure report), and the group then takes the ordinary failure path. Only pids of the attempt's
worker process groups are signalled; a request from any other pid is logged and dropped.

The FIFO is opened read-write: the agent then always holds a writer, so a read never sees end of file between
clients (no wake-ups while nobody writes), and a client's ``open(O_WRONLY | O_NONBLOCK)`` always finds a reader.

:class:`TimerTable` is the sans-IO core; :class:`FileTimerServer` the I/O around it.
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import stat
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Final, NamedTuple

import anyio

from ...errors import ConfigurationError
from ...worker._timers import FILE_ENV, VERSION
from ..spawn.parent import WorkerProcess

__all__ = [
    "ENABLE_ENV",
    "Expiry",
    "FileTimerServer",
    "TimerRequest",
    "TimerTable",
    "parse_request",
]

logger = logging.getLogger(__name__)

ENABLE_ENV: Final = "TORCHELASTIC_ENABLE_FILE_TIMER"
_MAX_LINE: Final = 1 << 16  # torch's client refuses lines over PIPE_BUF; a longer run without newline is garbage


class TimerRequest(NamedTuple):
    """One line of the FIFO (torch's ``FileTimerRequest``)."""

    pid: int
    scope_id: str
    expiration_time: float
    signal: int

    @property
    def is_release(self) -> bool:
        return self.expiration_time < 0


class Expiry(NamedTuple):
    """A worker to kill: ``pid`` gets ``signal`` because timer ``scope_id`` expired at ``expiration_time``."""

    pid: int
    scope_id: str
    expiration_time: float
    signal: int


def parse_request(line: bytes) -> TimerRequest:
    """Parse one FIFO line.

    Raises:
        ValueError: not torch's version-1 request.
    """
    data = json.loads(line)
    if not isinstance(data, dict) or data.get("version") != VERSION:
        raise ValueError(f"not a version {VERSION} timer request")
    pid, scope, expiration, signum = data["pid"], data["scope_id"], data["expiration_time"], data.get("signal", 0)
    if not (isinstance(pid, int) and isinstance(scope, str) and isinstance(signum, int)):
        raise ValueError("pid and signal must be integers, scope_id a string")
    if not isinstance(expiration, int | float) or math.isnan(expiration):
        raise ValueError("expiration_time must be a number")
    return TimerRequest(pid, scope, float(expiration), signum)


class TimerTable:
    """The timers, keyed ``(pid, scope_id)``, with torch's acquire/release/expiry rules (module docstring)."""

    def __init__(self) -> None:
        self._timers: dict[tuple[int, str], TimerRequest] = {}

    def __len__(self) -> int:
        return len(self._timers)

    def apply(self, request: TimerRequest) -> None:
        key = (request.pid, request.scope_id)
        if request.is_release:
            self._timers.pop(key, None)
        else:
            self._timers[key] = request

    def next_expiration(self) -> float | None:
        """The earliest expiration time (epoch s), or ``None`` without timers."""
        return min((t.expiration_time for t in self._timers.values()), default=None)

    def pop_expired(self, now: float) -> list[Expiry]:
        """Clear every timer expired at ``now``; the kills they call for, one per pid at most."""
        expired: dict[int, list[TimerRequest]] = {}
        for key, timer in list(self._timers.items()):
            if timer.expiration_time <= now:
                expired.setdefault(timer.pid, []).append(timer)
                del self._timers[key]
        kills = []
        for pid, timers in expired.items():
            timers.sort(key=lambda t: t.expiration_time)
            chosen = next((t for t in timers if t.signal > 0), None)
            if chosen is None:
                scopes = [t.scope_id for t in timers]
                logger.info("timers %s of pid %d expired without a signal: not killing", scopes, pid)
            else:
                kills.append(Expiry(pid, chosen.scope_id, chosen.expiration_time, chosen.signal))
        return kills


ExpiryCallback = Callable[[Expiry, WorkerProcess, Sequence[WorkerProcess]], Awaitable[None]]


class FileTimerServer:
    """The FIFO at ``path`` and the timers it carries, for one attempt; an async context manager.

    Entering creates the FIFO (replacing whatever was at ``path``, as torch does) and opens it; leaving closes
    and removes it. :meth:`serve` reads requests and kills on expiry until cancelled.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.table = TimerTable()
        self._fd = -1
        self._changed = anyio.Event()

    def __repr__(self) -> str:
        return f"<FileTimerServer {self.path} timers={len(self.table)} open={self._fd >= 0}>"

    async def __aenter__(self) -> FileTimerServer:
        try:
            if self.path.is_fifo() or self.path.exists():
                self.path.unlink()
            os.mkfifo(self.path, 0o600)
            self._fd = os.open(self.path, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as exc:
            raise ConfigurationError(f"{FILE_ENV}={self.path}: cannot create the timer FIFO: {exc}") from exc
        logger.debug("serving expiration timers on %s", self.path)
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            os.close(fd)
        try:
            if stat.S_ISFIFO(self.path.lstat().st_mode):
                self.path.unlink()
        except FileNotFoundError:
            pass

    async def serve(self, workers: Sequence[WorkerProcess], on_expired: ExpiryCallback) -> None:
        """Serve requests from ``workers`` until cancelled: on each expiry, ``await on_expired(expiry, worker,
        workers)``, then send the signal to the pid (it is a worker or a process of a worker's group)."""
        groups = {w.pid: w for w in workers}
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._read)
            while True:
                expiration = self.table.next_expiration()
                delay = math.inf if expiration is None else max(0.0, expiration - time.time())
                with anyio.move_on_after(delay):
                    await self._changed.wait()
                self._changed = anyio.Event()
                for expiry in self.table.pop_expired(time.time()):
                    worker = _owner(expiry.pid, groups)
                    if worker is None:
                        logger.warning("timer %r expired for pid %d, not one of this node's workers: ignored",
                                       expiry.scope_id, expiry.pid)  # fmt: skip
                        continue
                    await on_expired(expiry, worker, workers)
                    try:
                        os.kill(expiry.pid, expiry.signal)
                    except ProcessLookupError:
                        pass  # it exited meanwhile: its waiter reports the exit
                    except (OSError, ValueError) as exc:
                        logger.warning("cannot send signal %d to pid %d: %s", expiry.signal, expiry.pid, exc)

    async def _read(self) -> None:
        pending = b""
        while True:
            await anyio.wait_readable(self._fd)
            try:
                data = os.read(self._fd, 65536)
            except BlockingIOError:
                continue  # another reader of the same wake-up took it (none here), or a spurious wake-up
            lines = (pending + data).split(b"\n")
            pending = lines.pop()
            if len(pending) > _MAX_LINE:
                logger.warning("timer FIFO %s: dropping %d bytes without a newline", self.path, len(pending))
                pending = b""
            for line in lines:
                if not line.strip():
                    continue
                try:
                    request = parse_request(line)
                except (ValueError, KeyError) as exc:
                    logger.warning("timer FIFO %s: ignoring %r: %s", self.path, line[:200], exc)
                    continue
                self.table.apply(request)
            self._changed.set()


def _owner(pid: int, groups: dict[int, WorkerProcess]) -> WorkerProcess | None:
    """The worker whose process group holds ``pid`` (workers lead their groups), or ``None`` (also when ``pid``
    is gone: a worker that exited with a timer armed, torch's "drop dead pids")."""
    try:
        return groups.get(os.getpgid(pid))
    except ProcessLookupError:
        return None


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return str(signum)
