"""Error files read, per-worker failures and the worker group's failure report (torch's ``ChildFailedError``
text).

A worker decorated with :func:`record` (written in :mod:`aelastic.worker._errorfile`, re-exported here at torch's
place; ours or torch's: same file format) writes its uncaught exception to ``TORCHELASTIC_ERROR_FILE``. The agent
turns each failed :class:`~aelastic.agent.started.WorkerExit` plus that file into a :class:`ProcessFailure`, and the
group's failures into a :class:`ChildFailedError` whose text is torch's report, byte for byte, except where a worker
wrote no error file and did not die by a signal: torch then prints a link to its documentation; here the traceback
field shows the last lines the worker wrote to stderr (often a traceback).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from string import Template
from typing import Any, Final, Protocol

from ..errors import AelasticError, RendezvousClosedError
from ..worker import _errorfile as errorfile
from ..worker._errorfile import record

__all__ = [
    "ChildFailedError",
    "FailedElsewhereError",
    "NoProgressError",
    "ProcessFailure",
    "propagate_root_cause",
    "record",
]

logger = logging.getLogger(__name__)

NOT_AVAILABLE: Final = "<N/A>"
_TORCH_NO_TRACEBACK: Final = "To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html"

_FAILURE_FORMAT_TEMPLATE: Final = """[${idx}]:
  time      : ${time}
  host      : ${hostname}
  rank      : ${rank} (local_rank: ${local_rank})
  exitcode  : ${exitcode} (pid: ${pid}) ${signal_name}
  error_file: ${error_file}
  traceback : ${message}"""

# The blank first line is torch's: the report starts on its own line after "ChildFailedError:".
_MSG_FORMAT_TEMPLATE: Final = """
${boarder}
${title}
${section}
Failures:
${other_failures}
${section}
Root Cause (first observed failure):
${root_failure}
${boarder}"""


def _signal_name(exitcode: int) -> str:
    if exitcode >= 0:
        return NOT_AVAILABLE
    try:
        return signal.Signals(-exitcode).name
    except ValueError:
        return NOT_AVAILABLE


class Exited(Protocol):
    """What a failure is built from: :class:`aelastic.agent.started.WorkerExit`'s fields, named here and not
    imported, because workers import this module (and the supervision's modules import it back)."""

    @property
    def local_rank(self) -> int: ...
    @property
    def global_rank(self) -> int: ...
    @property
    def pid(self) -> int: ...
    @property
    def exitcode(self) -> int: ...
    @property
    def timestamp(self) -> float: ...
    @property
    def stderr_tail(self) -> tuple[str, ...]: ...


@dataclass(frozen=True, slots=True)
class ProcessFailure:
    """One failed worker, as the report shows it.

    Attributes:
        error_file: the error file's path when the worker wrote one, else ``"<N/A>"`` (torch's marker).
        timestamp: epoch seconds: the error file's timestamp if there is one (torch), else when the agent observed
            the exit.
        message: one line: ``"<Type>: <msg>"`` from the error file, torch's signal line, or the exit code.
        traceback: the report's ``traceback`` field, already indented for it.
        error_data: the error file's JSON (``{}`` without one).
        host: the host it ran on, where not the reporting agent's own (the job's root cause on another node).
    """

    local_rank: int
    global_rank: int
    pid: int
    exitcode: int
    error_file: str
    timestamp: float
    message: str
    traceback: str
    error_data: Mapping[str, Any]
    host: str = ""

    @classmethod
    def from_exit(
        cls, worker: Exited, error_file: str | os.PathLike[str] | None, notes: Sequence[str] = ()
    ) -> ProcessFailure:
        """Build the failure of ``worker`` from its exit and, if it exists, its error file.

        A file that exists but is not torch's JSON is reported as such in the message (the report must still be
        written); a missing file is the ordinary case of a worker without ``@record``. ``notes`` (what the agent
        knows of a worker it killed: an expired timer's scope, the top frames of its stack) end the traceback
        field.
        """
        failure = cls._from_exit(worker, error_file)
        if not notes:
            return failure
        return replace(failure, traceback="\n  ".join([failure.traceback, *notes]))

    @classmethod
    def _from_exit(cls, worker: Exited, error_file: str | os.PathLike[str] | None) -> ProcessFailure:
        data: dict[str, Any] = {}
        path = None if error_file is None else Path(error_file)
        if path is not None and path.is_file():
            try:
                loaded = json.loads(path.read_text(encoding="utf-8"))
                if not isinstance(loaded, dict) or "message" not in loaded:
                    raise ValueError("no 'message' field")
                data = loaded
            except (OSError, ValueError) as exc:
                logger.warning("unreadable error file %s of pid %d: %s", path, worker.pid, exc)
                return cls._without_file(worker, note=f"(unreadable error file {path}: {exc})")
            return cls._with_file(worker, str(path), data)
        return cls._without_file(worker, note=None)

    @classmethod
    def _with_file(cls, worker: Exited, path: str, data: dict[str, Any]) -> ProcessFailure:
        raw = data["message"]
        if isinstance(raw, str):  # torch's "new" plain-string form; shown as is
            message = traceback = raw
            timestamp = float(int(data.get("timestamp", 0) or 0)) or worker.timestamp
        else:
            raw = dict(raw) if isinstance(raw, Mapping) else {"message": str(raw)}
            message = str(raw.get("message", NOT_AVAILABLE))
            extra = raw.get("extraInfo", {})
            extra = extra if isinstance(extra, Mapping) else {}
            traceback = str(extra.get("py_callstack", message)).replace("\n", "\n  ")
            try:
                timestamp = float(int(extra.get("timestamp", 0))) or worker.timestamp
            except (TypeError, ValueError):
                timestamp = worker.timestamp
        return cls(
            local_rank=worker.local_rank,
            global_rank=worker.global_rank,
            pid=worker.pid,
            exitcode=worker.exitcode,
            error_file=path,
            timestamp=timestamp,
            message=message,
            traceback=traceback,
            error_data=data,
        )

    @classmethod
    def _without_file(cls, worker: Exited, note: str | None) -> ProcessFailure:
        tail = [line for line in worker.stderr_tail if line.strip()] if worker.stderr_tail else []
        if worker.exitcode < 0:
            message = f"Signal {-worker.exitcode} ({_signal_name(worker.exitcode)}) received by PID {worker.pid}"
            lines = [message]
            # A crash signal (SIGSEGV, SIGABRT, ...) often leaves a faulthandler dump on stderr: show it. A peer the
            # agent stopped gets torch's line alone.
            if -worker.exitcode not in (signal.SIGTERM, signal.SIGKILL):
                lines += tail
        else:
            message = f"exited with code {worker.exitcode}"
            lines = tail or [_TORCH_NO_TRACEBACK]
        if note is not None:
            lines.append(note)
        return cls(
            local_rank=worker.local_rank,
            global_rank=worker.global_rank,
            pid=worker.pid,
            exitcode=worker.exitcode,
            error_file=NOT_AVAILABLE,
            timestamp=worker.timestamp,
            message=message,
            traceback="\n  ".join(lines),
            error_data={},
        )

    def signal_name(self) -> str:
        """The name of the signal that killed the worker, or ``"<N/A>"``."""
        return _signal_name(self.exitcode)

    def timestamp_isoformat(self) -> str:
        """``YYYY-MM-DD_HH:MM:SS`` in local time, like torch."""
        from datetime import datetime  # only a failure report needs it: kept off every launch's import

        return datetime.fromtimestamp(int(self.timestamp)).isoformat(sep="_")


class ChildFailedError(AelasticError):
    """Workers of a group failed; ``str()`` is torch's report.

    Args:
        name: what failed (torch uses the entrypoint: the script path, or the function's name).
        failures: the failures by global rank, in the order the report lists them.
        root_rank: the root cause; by default the failure with the earliest timestamp (torch's rule). An agent
            that knows the first exit it observed passes that rank.
        hostname: the ``host`` field; by default ``socket.getfqdn()`` (torch's), looked up once.
    """

    def __init__(
        self,
        name: str,
        failures: Mapping[int, ProcessFailure],
        *,
        root_rank: int | None = None,
        hostname: str | None = None,
    ) -> None:
        if not failures:
            raise ValueError(f"ChildFailedError({name!r}): needs at least one failure")
        if root_rank is not None and root_rank not in failures:
            raise ValueError(f"root_rank {root_rank}: not among the failed ranks {sorted(failures)}")
        self.name = name
        self.failures: dict[int, ProcessFailure] = dict(failures)
        self.root_rank = root_rank
        self.hostname = socket.getfqdn() if hostname is None else hostname
        super().__init__(self.format_report())

    def get_first_failure(self) -> tuple[int, ProcessFailure]:
        """The root cause: ``(global_rank, failure)``."""
        if self.root_rank is not None:
            return self.root_rank, self.failures[self.root_rank]
        rank = min(self.failures, key=lambda r: self.failures[r].timestamp)
        return rank, self.failures[rank]

    def error_file_data(self) -> dict[str, Any] | None:
        """What :func:`record` writes for this report: the root cause's error file, with its exit code (``None``
        where the root cause wrote none)."""
        _, root = self.get_first_failure()
        if root.error_file == NOT_AVAILABLE:
            return None
        data: dict[str, Any] = json.loads(json.dumps(root.error_data))
        if isinstance(data.get("message"), dict) and root.exitcode:
            data["message"]["errorCode"] = root.exitcode
        return data

    def format_report(self, boarder_delim: str = "=", section_delim: str = "-") -> str:
        """torch's ``ChildFailedError.format_msg`` text."""
        title = f"{self.name} FAILED"
        root_rank, _ = self.get_first_failure()
        root_failure_fmt = ""
        other_failures_fmt: list[str] = []
        width = len(title)
        for idx, (rank, failure) in enumerate(self.failures.items()):
            fmt, w = self._format_failure(idx, rank, failure)
            width = max(width, w)
            if rank == root_rank:
                root_failure_fmt = fmt
            else:
                other_failures_fmt.append(fmt)
        width = min(width, 60)
        return Template(_MSG_FORMAT_TEMPLATE).substitute(
            boarder=boarder_delim * width,
            title=title,
            section=section_delim * width,
            root_failure=root_failure_fmt,
            other_failures="\n".join(other_failures_fmt or ["  <NO_OTHER_FAILURES>"]),
        )

    def _format_failure(self, idx: int, rank: int, failure: ProcessFailure) -> tuple[str, int]:
        signal_name = failure.signal_name()
        fmt = Template(_FAILURE_FORMAT_TEMPLATE).substitute(
            idx=idx,
            time=failure.timestamp_isoformat(),
            hostname=failure.host or self.hostname,
            rank=rank,
            local_rank=failure.local_rank,
            exitcode=failure.exitcode,
            pid=failure.pid,
            signal_name=f" ({signal_name})" if signal_name != NOT_AVAILABLE else "",
            error_file=failure.error_file,
            message=failure.traceback,
        )
        return fmt, max(len(line) for line in fmt.split("\n"))


class NoProgressError(ChildFailedError):
    """The job stopped early: its last attempts failed the same way (``--max-repeated-failures``), so requeueing it
    would fail again; ``aelastic run`` exits with status 3. The report says so above torch's."""

    exit_code = 3

    def __init__(self, name: str, failures: Mapping[int, ProcessFailure], *, reason: str, **kwargs: Any) -> None:
        self.reason = reason
        super().__init__(name, failures, **kwargs)

    def format_report(self, boarder_delim: str = "=", section_delim: str = "-") -> str:
        return f"no progress: {self.reason}\n" + super().format_report(boarder_delim, section_delim)


class FailedElsewhereError(ChildFailedError, RendezvousClosedError):
    """The job failed on another node, which closed the rendezvous (no restart left there): this node's workers were
    stopped. The report names the job's root cause on its node, and this node's workers as stopped."""


def propagate_root_cause(exc: ChildFailedError) -> None:
    """Write the root cause of ``exc`` to this process's own ``TORCHELASTIC_ERROR_FILE``, if it has one, with the
    worker's exit code, as torch's ``record`` (on torchrun's ``main``) does: a scheduler or an outer agent reads
    it. The root cause may be another node's (its error file's JSON travelled with its record)."""
    data = exc.error_file_data()
    if data is not None:
        errorfile.write(data)
