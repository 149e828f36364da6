"""The agent's console: where the workers' console lines go (the agent's stdout and stderr, or injected sinks), and
which worker's line is open on each terminal of it, so that no line of one worker cuts another's (see
:mod:`aelastic.agent.logs` for how each worker's output is routed here).
"""

from __future__ import annotations

import os
import re
import sys
from typing import Final, Protocol

import anyio

from ..config.streams import Std

__all__ = [
    "LINE_GRACE",
    "TERMINAL_PIECES",
    "ConsoleRef",
    "ConsoleSinks",
    "LineHolder",
    "OpenLines",
    "TextSink",
    "console_key",
]


class TextSink(Protocol):
    """Where console lines go: anything with ``write`` and ``flush`` (a text file, ``io.StringIO``)."""

    def write(self, s: str, /) -> object: ...

    def flush(self) -> object: ...


class ConsoleSinks:
    """The agent's console: where console lines go, and which worker's line is open on it.

    ``None`` means the agent's ``sys.stdout`` / ``sys.stderr``, looked up at each write. The open lines
    (:class:`OpenLines`) belong to the console, not to the process: a :class:`LogSpec` makes one console by default,
    which every attempt's spec derived from it (``dataclasses.replace``) shares, so there is one per launch.
    """

    __slots__ = ("lines", "stderr", "stdout")

    def __init__(self, stdout: TextSink | None = None, stderr: TextSink | None = None) -> None:
        self.stdout = stdout
        self.stderr = stderr
        self.lines = OpenLines()

    def __repr__(self) -> str:
        return f"<ConsoleSinks stdout={self.stdout!r} stderr={self.stderr!r} lines={self.lines!r}>"


# A line ends at "\n", or at a "\r" that is not the first half of "\r\n" (a progress bar's redraw).
TERMINAL_PIECES: Final = re.compile(r"(?<=\n)|(?<=\r)(?!\n)")


LINE_GRACE: Final = 0.1  # an open line that stays open longer (a progress bar) is ended after it, as before


class LineHolder(Protocol):
    """A worker's stream as the console sees it: whether its next output starts a new line."""

    at_line_start: bool


class OpenLines:
    """The stream that left an open (unterminated) line on each terminal of a console (see :func:`console_key`),
    and an event set when that line ends: another worker's output waits for it up to :data:`LINE_GRACE`
    (:meth:`WorkerLog.turn`), so that a line the agent read in two pieces (a pseudo-terminal may hand over one
    write(2) in parts) is not cut by a line of another worker. Owned by :class:`ConsoleSinks`."""

    __slots__ = ("_ended", "_open")

    def __init__(self) -> None:
        self._open: dict[object, LineHolder] = {}
        self._ended: dict[object, anyio.Event] = {}

    def __repr__(self) -> str:
        return f"<OpenLines open={len(self._open)} awaited={len(self._ended)}>"

    def holder(self, key: object) -> LineHolder | None:
        """The stream whose line is open on console ``key``, if any."""
        return self._open.get(key)

    def opened(self, key: object, stream: LineHolder) -> None:
        self._open[key] = stream

    def ended(self, key: object) -> None:
        """The open line on console ``key`` has ended: wake the streams waiting for their turn on it."""
        if self._open.pop(key, None) is None:
            return
        event = self._ended.pop(key, None)
        if event is not None:
            event.set()

    async def wait_ended(self, key: object) -> None:
        """Wait until the line open on console ``key`` ends (the caller bounds the wait)."""
        await self._ended.setdefault(key, anyio.Event()).wait()


def console_key(sink: TextSink) -> object:
    """What identifies a console: its file (the agent's stdout and stderr are often one terminal), else the sink."""
    try:
        stat = os.fstat(sink.fileno())  # type: ignore[attr-defined]
    except (AttributeError, OSError, ValueError):
        return id(sink)
    return (stat.st_dev, stat.st_ino)


class ConsoleRef:
    """Resolves the agent's console at write time, so ``sys.stdout`` swapped later (pytest, a notebook) is used."""

    __slots__ = ("_sinks", "_std")

    def __init__(self, sinks: ConsoleSinks, std: Std) -> None:
        self._sinks = sinks
        self._std = std

    def target(self) -> TextSink:
        if self._std == Std.OUT:
            return self._sinks.stdout if self._sinks.stdout is not None else sys.stdout
        return self._sinks.stderr if self._sinks.stderr is not None else sys.stderr

    def terminal_size(self) -> tuple[int, int] | None:
        """``(rows, columns)`` of the console if it is a terminal, else ``None``."""
        target = self.target()
        try:
            if not target.isatty():  # type: ignore[attr-defined]
                return None
        except (AttributeError, ValueError):  # a sink without isatty, or a closed file
            return None
        try:
            size = os.get_terminal_size(target.fileno())  # type: ignore[attr-defined]
        except (AttributeError, OSError, ValueError):
            return (24, 80)  # a terminal-like sink with no size to ask: the classic default
        if size.columns <= 0 or size.lines <= 0:
            return (24, 80)  # a terminal whose size nobody set (a fresh pseudo-terminal)
        return (size.lines, size.columns)

    def write(self, s: str, /) -> object:
        return self.target().write(s)

    def flush(self) -> object:
        return self.target().flush()
