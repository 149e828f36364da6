"""Worker output: prefixes, redirects to per-rank files, tee, rank filter, and a tail of each worker's stderr.

Theory of operation
-------------------
Every worker's stdout and stderr are pipes to the agent. A pump task per pipe (:func:`pump`) reads chunks as they
arrive and hands them to the worker's :class:`WorkerLog`, which routes them, synchronously and without awaiting:

* to ``<log_dir>/attempt_<n>/<local_rank>/stdout.log|stderr.log`` when the stream is redirected or teed (raw
  bytes, exactly as the worker wrote them, through an unbuffered file, so the file is complete the moment the
  chunk is handled: there is nothing to flush after any kind of stop);
* to the agent's console (its own stdout/stderr, or injected sinks) when the stream is not redirected, or is teed,
  and the rank passes ``local_ranks_filter``. Console output is cut into whole lines, each written with its prefix
  (``[default0]:`` or the ``log_line_prefix_template``) in one ``write`` call. All pumps run in one event-loop
  thread and never await between receiving a chunk and writing its lines, so two chatty workers can never
  interleave partial lines. A last line without a newline is written, with one, at end of stream.
* *Terminal passthrough.* When the console stream is a terminal and the worker's stream goes nowhere else (no
  redirect, no tee), the worker writes to a pseudo-terminal instead of a pipe (:meth:`WorkerLog.terminal_size`),
  as under torchrun, where workers inherit the terminal: ``isatty()`` is true, and a progress bar's ``\r`` redraws
  must show live. Such a stream is forwarded as it arrives, partial lines included; the prefix goes at the start
  of each line (not before a bare ``\r``), and the pseudo-terminal is narrower than the agent's by the prefix, so
  a bar sized to the terminal does not wrap. When another worker writes while a line is still open on the same
  console, its output waits up to 0.1 s for that line to end (the agent may read one write of a worker in two
  pieces), then the open line is ended first, so each line stays attributable to one worker.

The mapping follows torch's ``DefaultLogsSpecs``/``TailLog`` (``Std``, ``redirects``, ``tee``,
``local_ranks_filter``), but is event-driven (no 0.1 s polling of files) and every console line goes through the
agent. The last lines of each worker's stderr are kept whatever the routing: the failure report shows them when a
worker wrote no error file.

Writes to regular files and to the console are plain blocking writes from the event loop, as with any logging
handler: they hit the page cache or the terminal and do not wait on the workers.
"""

from __future__ import annotations

import codecs
import logging
import os
import shutil
import socket
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from string import Template
from typing import BinaryIO, Final, Protocol

import anyio
import anyio.abc

from ..config.streams import Std, StdSpec
from ..errors import ConfigurationError
from .console import LINE_GRACE, TERMINAL_PIECES, ConsoleRef, ConsoleSinks, OpenLines, TextSink, console_key

__all__ = ["ConsoleSinks", "CustomLogs", "LogSink", "LogSpec", "Std", "TextSink", "WorkerLog", "pump"]

logger = logging.getLogger(__name__)

_MAX_LINE: Final = 1 << 16  # a console "line" longer than this is cut, so one runaway line cannot eat memory


def _default_hostname() -> str:
    return socket.gethostname()  # torch uses the short name for ${hostname}


@dataclass(frozen=True, slots=True)
class CustomLogs:
    """Where one attempt's output goes by a custom torch ``LogsSpecs`` (``--logs-specs``): its ``LogsDest``.

    torch's meaning, per local rank: ``stdouts[r]`` is the file stdout goes to (``""``: the console), and ``r`` in
    ``tee_stdouts`` shows it on the console too; the same for stderr. ``error_files[r]`` is the worker's error file;
    ``filtered_*`` the attempt's duplicate-filter files (``""``: none). See :mod:`aelastic.agent.logs_specs`.
    """

    stdouts: Mapping[int, str] = field(default_factory=dict)
    stderrs: Mapping[int, str] = field(default_factory=dict)
    tee_stdouts: Mapping[int, str] = field(default_factory=dict)
    tee_stderrs: Mapping[int, str] = field(default_factory=dict)
    error_files: Mapping[int, str] = field(default_factory=dict)
    filtered_stdout: str = ""
    filtered_stderr: str = ""

    def path(self, std: Std, local_rank: int) -> Path | None:
        path = (self.stdouts if std == Std.OUT else self.stderrs).get(local_rank, "")
        return Path(path) if path else None

    def teed(self, std: Std, local_rank: int) -> bool:
        return local_rank in (self.tee_stdouts if std == Std.OUT else self.tee_stderrs)


@dataclass(frozen=True, slots=True)
class LogSpec:
    """How one attempt of a node's workers is logged.

    Attributes:
        role: the worker role; the default prefix is ``[<role><local_rank>]:``.
        log_dir: the run's log directory; files go to ``<log_dir>/attempt_<attempt>/<local_rank>/``. ``None``
            writes no files at all (no redirects, no tee, no error files): a launcher that wants torch's default
            creates a temporary directory and passes it here.
        redirects: streams that go to the per-rank file *instead of* the console (a ``Std`` for every rank, or a
            map by local rank; ranks missing from a map get ``Std.NONE``).
        tee: streams that go to the per-rank file *and* the console.
        local_ranks_filter: local ranks whose console output is shown; ``None`` shows every rank. Files are
            written whatever the filter.
        line_prefix_template: ``string.Template`` with ``${role_name} ${rank} ${local_rank} ${hostname}``,
            replacing the default prefix.
        hostname: the value of ``${hostname}``.
        attempt: the restart count; names the attempt directory.
        console: the agent's console destinations.
        stderr_tail_lines: how many last stderr lines of each worker are kept for the failure report.
        duplicate_stdout_filters: torch's ``--duplicate-stdout-filters``: every stdout line of any worker that
            contains one of these strings is also written, prefixed, to ``attempt_<n>/filtered_stdout.log``.
        duplicate_stderr_filters: the same for stderr lines and ``filtered_stderr.log``.
        custom: this attempt's destinations from a custom torch ``LogsSpecs``; when set they replace the layout
            under ``log_dir`` and the redirects, tee and rank filter (the custom spec applied those itself).
    """

    role: str = "default"
    log_dir: Path | None = None
    redirects: StdSpec = Std.NONE
    tee: StdSpec = Std.NONE
    local_ranks_filter: frozenset[int] | None = None
    line_prefix_template: str | None = None
    hostname: str = field(default_factory=_default_hostname)
    attempt: int = 0
    console: ConsoleSinks = field(default_factory=ConsoleSinks)
    stderr_tail_lines: int = 20
    duplicate_stdout_filters: tuple[str, ...] = ()
    duplicate_stderr_filters: tuple[str, ...] = ()
    custom: CustomLogs | None = None

    def __post_init__(self) -> None:
        if self.attempt < 0:
            raise ConfigurationError(f"attempt {self.attempt}: must be >= 0")
        if self.stderr_tail_lines < 0:
            raise ConfigurationError(f"stderr_tail_lines {self.stderr_tail_lines}: must be >= 0")
        if "" in (*self.duplicate_stdout_filters, *self.duplicate_stderr_filters):
            raise ConfigurationError("duplicate filters: an empty string would match every line")
        if self.log_dir is None and (_any_std(self.redirects) or _any_std(self.tee)):
            raise ConfigurationError(
                f"redirects={self.redirects!r}, tee={self.tee!r}: writing worker output to files needs a log_dir"
            )

    def redirects_for(self, local_rank: int) -> Std:
        """The streams of ``local_rank`` that go to its files only."""
        if (custom := self.custom) is not None:
            return _streams(lambda std: custom.path(std, local_rank) is not None)
        return _std_for(self.redirects, local_rank)

    def tee_for(self, local_rank: int) -> Std:
        """The streams of ``local_rank`` that go to its files and the console."""
        if (custom := self.custom) is not None:
            return _streams(lambda std: custom.teed(std, local_rank))
        return _std_for(self.tee, local_rank)

    def shows_on_console(self, local_rank: int) -> bool:
        """Whether ``local_rank`` passes ``local_ranks_filter``."""
        return self.custom is not None or self.local_ranks_filter is None or local_rank in self.local_ranks_filter

    def attempt_dir(self) -> Path | None:
        """``<log_dir>/attempt_<attempt>``, or ``None`` without a log_dir (or with custom destinations)."""
        if self.log_dir is None or self.custom is not None:
            return None
        return self.log_dir / f"attempt_{self.attempt}"

    def rank_dir(self, local_rank: int) -> Path | None:
        """``<log_dir>/attempt_<attempt>/<local_rank>``, or ``None`` without a log_dir; with custom destinations,
        the directory of the rank's error file (where ``stacks.txt`` goes)."""
        if self.custom is not None:
            error_file = self.error_file_path(local_rank)
            return None if error_file is None else error_file.parent
        attempt_dir = self.attempt_dir()
        return None if attempt_dir is None else attempt_dir / str(local_rank)

    def stdout_path(self, local_rank: int) -> Path | None:
        if self.custom is not None:
            return self.custom.path(Std.OUT, local_rank)
        rank_dir = self.rank_dir(local_rank)
        return None if rank_dir is None else rank_dir / "stdout.log"

    def stderr_path(self, local_rank: int) -> Path | None:
        if self.custom is not None:
            return self.custom.path(Std.ERR, local_rank)
        rank_dir = self.rank_dir(local_rank)
        return None if rank_dir is None else rank_dir / "stderr.log"

    def filtered_path(self, std: Std) -> Path | None:
        """``<log_dir>/attempt_<n>/filtered_stdout.log`` (or ``_stderr``), shared by the attempt's workers."""
        if self.custom is not None:
            path = self.custom.filtered_stdout if std == Std.OUT else self.custom.filtered_stderr
            return Path(path) if path else None
        attempt_dir = self.attempt_dir()
        name = "filtered_stdout.log" if std == Std.OUT else "filtered_stderr.log"
        return None if attempt_dir is None else attempt_dir / name

    def duplicate_filters_for(self, std: Std) -> tuple[str, ...]:
        return self.duplicate_stdout_filters if std == Std.OUT else self.duplicate_stderr_filters

    def error_file_path(self, local_rank: int) -> Path | None:
        """The worker's ``TORCHELASTIC_ERROR_FILE``: ``<log_dir>/attempt_<n>/<local_rank>/error.json``."""
        if self.custom is not None:
            path = self.custom.error_files.get(local_rank, "")
            return Path(path) if path and path != os.devnull else None
        rank_dir = self.rank_dir(local_rank)
        return None if rank_dir is None else rank_dir / "error.json"

    def prefix(self, local_rank: int, global_rank: int) -> str:
        """The console prefix of a worker's lines."""
        if self.line_prefix_template is None:
            return f"[{self.role}{local_rank}]:"
        return Template(self.line_prefix_template).safe_substitute(
            role_name=self.role, rank=global_rank, local_rank=local_rank, hostname=self.hostname
        )

    def prepare_attempt_dir(self, local_ranks: list[int]) -> None:
        """Create an empty attempt directory with one directory per local rank (torch removes an old one too).

        A sync call: a few ``mkdir`` on the local disk before any worker starts.
        """
        attempt_dir = self.attempt_dir()
        if attempt_dir is None:
            return
        if attempt_dir.exists():
            shutil.rmtree(attempt_dir)
        for local_rank in local_ranks:
            (attempt_dir / str(local_rank)).mkdir(parents=True, exist_ok=True)


def _any_std(spec: StdSpec) -> bool:
    if isinstance(spec, Std):
        return spec != Std.NONE
    return any(value != Std.NONE for value in spec.values())


def _streams(selected: Callable[[Std], bool]) -> Std:
    return Std(sum(std for std in (Std.OUT, Std.ERR) if selected(std)))


def _std_for(spec: StdSpec, local_rank: int) -> Std:
    if isinstance(spec, Std):
        return spec
    return Std(spec.get(local_rank, Std.NONE))


class _Stream:
    """One of a worker's two streams: its file, its console, its partial line."""

    __slots__ = (
        "at_line_start", "console", "decoder", "duplicate", "file", "lines", "pending", "prefix", "tail", "terminal",
    )  # fmt: skip

    def __init__(
        self,
        file: BinaryIO | None,
        console: TextSink | None,
        prefix: str,
        tail: deque[str] | None,
        *,
        lines: OpenLines,
        terminal: bool = False,
        duplicate: tuple[BinaryIO, tuple[str, ...]] | None = None,
    ) -> None:
        self.file = file
        self.lines = lines  # the open lines of the console, shared with every stream that goes there
        self.duplicate = duplicate  # the attempt's filtered_*.log and the strings a line must contain to go there
        self.console = console  # None: not shown (redirected, or filtered out)
        self.prefix = prefix
        self.tail = tail
        self.terminal = terminal  # forwarded as it arrives (module doc)
        self.pending = bytearray()
        self.decoder = codecs.getincrementaldecoder("utf-8")("replace")  # a character may straddle two chunks
        self.at_line_start = True

    @property
    def needs_lines(self) -> bool:
        return (self.console is not None and not self.terminal) or self.tail is not None or self.duplicate is not None

    def feed(self, data: bytes) -> None:
        if self.file is not None:
            try:
                self.file.write(data)
            except OSError as exc:  # disk full, ...: keep the workers running, say so once
                logger.warning("cannot write worker output to %s (%s): no more output goes there", self.file.name, exc)
                self.file = None
        if self.terminal and self.console is not None:
            self._forward(self.decoder.decode(data))
        if not self.needs_lines:
            return
        self.pending += data
        start = 0
        lines: list[str] = []
        while True:
            end = self.pending.find(b"\n", start)
            if end < 0:
                break
            lines.append(self.pending[start : end + 1].decode("utf-8", "replace"))
            start = end + 1
        del self.pending[:start]
        if len(self.pending) > _MAX_LINE:
            lines.append(self.pending.decode("utf-8", "replace") + "\n")
            self.pending.clear()
        if lines:
            self._emit(lines)

    def finish(self) -> None:
        if self.terminal and self.console is not None:
            self._forward(self.decoder.decode(b"", final=True))
            if not self.at_line_start:
                self._forward("\n")
        if self.pending:
            line = self.pending.decode("utf-8", "replace") + "\n"
            self.pending.clear()
            self._emit([line])

    def _emit(self, lines: list[str]) -> None:
        if self.tail is not None:
            # What a terminal would show of each line: the text after its last carriage return.
            self.tail.extend(line.rstrip("\r\n").rsplit("\r", 1)[-1] for line in lines)
        if self.console is not None and not self.terminal:
            # One write per batch of whole lines: nothing else can write to the sink in between.
            self._write("".join(self.prefix + line for line in lines))
        if self.duplicate is not None:
            self._duplicate(lines, *self.duplicate)

    def _duplicate(self, lines: list[str], file: BinaryIO, needles: tuple[str, ...]) -> None:
        matching = "".join(self.prefix + line for line in lines if any(needle in line for needle in needles))
        if not matching:
            return
        try:
            file.write(matching.encode())  # one append: the attempt's workers share the file (O_APPEND)
        except OSError as exc:
            logger.warning("cannot write filtered lines to %s (%s): no more go there", file.name, exc)
            self.duplicate = None

    def console_key(self) -> object | None:
        """The key of the console this stream is forwarded to as it arrives, or ``None`` if it is not."""
        if not self.terminal or self.console is None:
            return None
        return console_key(self.console.target() if isinstance(self.console, ConsoleRef) else self.console)

    async def turn(self) -> None:
        """Wait (up to :data:`LINE_GRACE`) until no other stream has an open line on this stream's console."""
        key = self.console_key()
        other = None if key is None else self.lines.holder(key)
        if other is None or other is self:
            return
        with anyio.move_on_after(LINE_GRACE):
            await self.lines.wait_ended(key)

    def _forward(self, text: str) -> None:
        key = self.console_key()
        if not text or key is None:
            return
        other = self.lines.holder(key)
        parts = []
        if other is not None and other is not self:
            other.at_line_start = True  # its line is ended here; its next output starts a new one
            parts.append("\n")
            self.lines.ended(key)
        for piece in TERMINAL_PIECES.split(text):
            if not piece:
                continue
            if self.at_line_start and piece != "\r":
                parts.append(self.prefix)
            parts.append(piece)
            self.at_line_start = piece[-1] in "\r\n"
        if self.at_line_start:
            self.lines.ended(key)
        else:
            self.lines.opened(key, self)
        self._write("".join(parts))

    def _write(self, text: str) -> None:
        if self.console is None:
            return
        try:
            self.console.write(text)
            self.console.flush()
        except (OSError, ValueError) as exc:  # the agent's console went away (a closed pipe, a closed file)
            logger.warning("cannot write worker output to the console (%s): it is dropped from now on", exc)
            self.console = None


class WorkerLog:
    """Routes one worker's output according to a :class:`LogSpec`; a sync object fed by :func:`pump`.

    Open it before the worker starts (it opens the worker's files) and :meth:`close` it after both streams have
    ended. The files are written unbuffered: everything handled is on disk whatever way the run stops.
    """

    def __init__(self, spec: LogSpec, local_rank: int, global_rank: int) -> None:
        self.spec = spec
        self.local_rank = local_rank
        self.global_rank = global_rank
        self._tail: deque[str] = deque(maxlen=spec.stderr_tail_lines)
        self._files: list[BinaryIO] = []
        self._closed = False
        prefix = spec.prefix(local_rank, global_rank)
        shown = spec.shows_on_console(local_rank)
        redirects = spec.redirects_for(local_rank)
        tee = spec.tee_for(local_rank)
        self._streams: dict[Std, _Stream] = {}
        self._terminal_sizes: dict[Std, tuple[int, int]] = {}
        try:
            for std, path in ((Std.OUT, spec.stdout_path(local_rank)), (Std.ERR, spec.stderr_path(local_rank))):
                file: BinaryIO | None = None
                if (redirects | tee) & std and path is not None:
                    path.parent.mkdir(parents=True, exist_ok=True)
                    file = open(path, "wb", buffering=0)  # noqa: SIM115 - closed by close()
                    self._files.append(file)
                on_console = shown and (not (redirects & std) or bool(tee & std))
                console = ConsoleRef(spec.console, std) if on_console else None
                size = console.terminal_size() if console is not None and file is None else None
                if size is not None:
                    rows, columns = size
                    self._terminal_sizes[std] = (rows, max(columns - len(prefix), 20))
                tail = self._tail if std == Std.ERR else None
                duplicate = None
                needles, filtered = spec.duplicate_filters_for(std), spec.filtered_path(std)
                if needles and filtered is not None:
                    shared = open(filtered, "ab", buffering=0)  # noqa: SIM115 - closed by close()
                    self._files.append(shared)
                    duplicate = (shared, needles)
                self._streams[std] = _Stream(
                    file,
                    console,
                    prefix,
                    tail,
                    lines=spec.console.lines,
                    terminal=size is not None,
                    duplicate=duplicate,
                )
        except BaseException:
            self.close()
            raise

    def __repr__(self) -> str:
        return (
            f"<WorkerLog local_rank={self.local_rank} rank={self.global_rank} "
            f"files={[f.name for f in self._files]} closed={self.closed}>"
        )

    @property
    def closed(self) -> bool:
        return self._closed

    def terminal_size(self, std: Std) -> tuple[int, int] | None:
        """``(rows, columns)`` of the pseudo-terminal the worker should write ``std`` to, or ``None`` for a pipe.

        A terminal when the agent's own console stream is one and the worker's stream goes only there (module doc);
        the columns are the console's less the prefix.
        """
        return self._terminal_sizes.get(std)

    async def turn(self, std: Std) -> None:
        """Before :meth:`feed`: for a stream forwarded as it arrives, wait a moment (at most a tenth of a second)
        while another worker's line is open on the same console, so that the rest of that line comes first."""
        await self._streams[std].turn()

    def feed(self, std: Std, data: bytes) -> None:
        """Handle a chunk the worker wrote to ``std`` (``Std.OUT`` or ``Std.ERR``)."""
        self._streams[std].feed(data)

    def finish(self, std: Std) -> None:
        """End of ``std``: write out a last line that had no newline."""
        self._streams[std].finish()

    def stderr_tail(self) -> tuple[str, ...]:
        """The last ``stderr_tail_lines`` lines the worker wrote to stderr (a partial last line once finished)."""
        return tuple(self._tail)

    def close(self) -> None:
        """Close the worker's files (idempotent)."""
        self._closed = True
        for file in self._files:
            file.close()


class LogSink(Protocol):
    """Where :func:`pump` feeds a stream: a :class:`WorkerLog`, or something that stands for one."""

    async def turn(self, std: Std) -> None: ...

    def feed(self, std: Std, data: bytes) -> None: ...

    def finish(self, std: Std) -> None: ...


async def pump(
    stream: anyio.abc.ByteReceiveStream, log: LogSink, std: Std, fed: Callable[[int], None] | None = None
) -> None:
    """Feed everything read from ``stream`` into ``log`` as ``std`` until end of stream; ``fed`` is told the size
    of each chunk once it is handled.

    On cancellation the partial last line read so far is still written out, then the cancellation propagates.
    """
    try:
        async for chunk in stream:
            await log.turn(std)
            log.feed(std, chunk)
            if fed is not None:
                fed(len(chunk))
    except (anyio.BrokenResourceError, anyio.ClosedResourceError):
        pass  # the pipe went away: what was read is handled, and there is nothing more to read
    finally:
        log.finish(std)
