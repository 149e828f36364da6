"""Python stacks of a worker the agent is about to kill, captured with py-spy within a bounded time (the agent's
side of :mod:`aelastic.agent.stacks`).

Whenever the agent kills a worker that did not exit by itself (an expired timer or progress watchdog, a worker
that outlived the stop's grace), :class:`StackDumper` first runs ``py-spy dump --pid <pid>`` on it: py-spy reads
the interpreter's memory from outside (ptrace), so the worker needs no cooperation and may be stuck anywhere,
in C code included. Every thread's stack is appended to ``<log_dir>/attempt_<n>/<local_rank>/stacks.txt`` under
a header saying why, and the top frames of the worker's first thread (its main thread) become notes that the
failure report shows under that worker (:meth:`StackDumper.notes`).

The dumps of several workers run concurrently and all of them are cut off at ``timeout``: the kill that follows
is never delayed by more. py-spy is optional (the ``stacks`` extra). It is found on ``PATH`` or beside the agent's
interpreter (a virtual environment that is not activated). Without it the agent says once how to get it and falls
back to :mod:`aelastic.agent.stacks.fallback` (faulthandler in Python workers, armed at start-up through
:meth:`StackDumper.command`), under the same deadline. A worker is armed only when py-spy is missing at the
attempt's start, so with py-spy the workers' environment is untouched; a py-spy that fails (no ptrace permission)
leaves its error as the note.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Final

import anyio

from ..logs import LogSpec
from ..procfs import process_state
from ..spawn.parent import WorkerCommand, WorkerProcess, wait_process
from .fallback import FaultStacks, fault_top_frames

__all__ = ["DEFAULT_DUMP_TIMEOUT", "StackDumper", "find_py_spy", "top_frames"]

logger = logging.getLogger(__name__)

# Long enough for py-spy on a busy machine, short against any kill it precedes.
DEFAULT_DUMP_TIMEOUT: Final = 2.0
_TOP_FRAMES: Final = 5  # in the failure report
_ALL: Final = 200  # frames of a stack taken whole (a deeper one is cut there)
_MISSING: Final = "py-spy is not installed (pip install 'aelastic[stacks]')"


def find_py_spy() -> str | None:
    """The py-spy executable: on ``PATH``, else beside ``sys.executable``; ``None`` if not installed."""
    return shutil.which("py-spy") or shutil.which("py-spy", path=os.path.dirname(sys.executable))


def top_frames(dump: str, count: int = _TOP_FRAMES) -> list[str]:
    """The innermost ``count`` frames of the first thread of a ``py-spy dump`` (its main thread)."""
    frames: list[str] = []
    in_thread = False
    for line in dump.splitlines():
        if line.startswith("Thread "):
            if in_thread:
                break
            in_thread = True
        elif in_thread and line.startswith("    ") and line.strip():
            frames.append(line.strip())
            if len(frames) == count:
                break
    return frames


class StackDumper:
    """Dumps the stacks of one attempt's workers before they are killed; see the module docstring.

    Args:
        logs: the attempt's log spec (``stacks.txt`` goes to its rank directories; none without a log dir).
        timeout: the most seconds one :meth:`dump` may take.
    """

    _warned_missing = False  # say once per agent process, not per kill

    def __init__(self, logs: LogSpec, timeout: float = DEFAULT_DUMP_TIMEOUT) -> None:
        self.logs = logs
        self.timeout = timeout
        self._py_spy = find_py_spy()
        self._fallback = FaultStacks() if self._py_spy is None else None
        self._notes: defaultdict[int, list[str]] = defaultdict(list)

    def __repr__(self) -> str:
        return f"<StackDumper py_spy={self._py_spy!r} fallback={self._fallback!r} timeout={self.timeout:g}>"

    def command(self, command: WorkerCommand) -> WorkerCommand:
        """``command`` as it must start to be dumped: unchanged with py-spy, armed for faulthandler without."""
        return command if self._fallback is None else self._fallback.command(command)

    def close(self) -> None:
        """Release what the fallback holds for the workers (call once they are gone; notes stay readable)."""
        if self._fallback is not None:
            self._fallback.close()

    def notes(self, pid: int) -> list[str]:
        """What the failure report adds under worker ``pid``: why it was killed and its top frames."""
        return list(self._notes.get(pid, ()))

    def note(self, pid: int, text: str) -> None:
        """Add a line to worker ``pid``'s part of the failure report."""
        self._notes[pid].append(text)

    async def dump(
        self, workers: Sequence[WorkerProcess], reason: str, *, report: Collection[int] | None = None
    ) -> dict[int, list[str]]:
        """Capture the stacks of ``workers`` (concurrently, within ``timeout``) and write them to the log dir.

        Args:
            reason: the header line in ``stacks.txt`` (why the agent is about to kill).
            report: the pids whose top frames go into the failure report; ``None``: every worker's.

        Returns:
            Each worker's main-thread frames, innermost first (``function (file:line)``; none without a dump).
        """
        if self._py_spy is None and not StackDumper._warned_missing:
            StackDumper._warned_missing = True
            logger.warning("%s: worker stacks come from faulthandler instead (Python workers only)", _MISSING)
        tool = "py-spy" if self._py_spy is not None else "faulthandler"
        dumps: dict[int, str] = {}
        with anyio.move_on_after(self.timeout) as scope:
            async with anyio.create_task_group() as tg:
                for worker in workers:
                    tg.start_soon(self._dump_one, worker, dumps)
        stacks: dict[int, list[str]] = {}
        for worker in workers:
            text = dumps.get(worker.pid)
            if text is None:
                text = f"no stack dump: {tool} did not finish within {self.timeout:g} s" if scope.cancel_called else ""
            self._write(worker, reason, text)
            frames = top_frames(text, _ALL) if self._py_spy is not None else fault_top_frames(text, _ALL)
            stacks[worker.pid] = frames
            if report is None or worker.pid in report:
                if frames:
                    self.note(worker.pid, f"top frames (innermost first, {tool}):")
                    self._notes[worker.pid].extend(f"  {frame}" for frame in frames[:_TOP_FRAMES])
                else:
                    self.note(worker.pid, text.strip().splitlines()[0] if text.strip() else "no stack dump")
        return stacks

    async def _dump_one(self, worker: WorkerProcess, dumps: dict[int, str]) -> None:
        if self._py_spy is None:
            if self._fallback is not None:
                await self._fallback.dump(worker, dumps)
            return
        args = [self._py_spy, "dump", "--pid", str(worker.pid)]
        if _stopped(worker.pid):
            args.append("--nonblocking")  # py-spy cannot suspend a stopped process; it can still read its memory
        code, out, err = await _run(args)
        dumps[worker.pid] = out if code == 0 else f"no stack dump: py-spy exited with {code}: {err}"

    def _write(self, worker: WorkerProcess, reason: str, text: str) -> None:
        rank_dir = self.logs.rank_dir(worker.local_rank)
        if rank_dir is None:
            return
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        path = Path(rank_dir) / "stacks.txt"
        try:
            with path.open("a", encoding="utf-8") as file:
                file.write(f"=== {stamp} pid {worker.pid} rank {worker.global_rank}: {reason}\n{text.rstrip()}\n\n")
        except OSError as exc:
            logger.warning("cannot write the stacks of pid %d to %s: %s", worker.pid, path, exc)


async def _run(args: Sequence[str]) -> tuple[int, str, str]:
    """``args`` run to its end: its exit status, stdout and stderr (in memory files). Spawned and reaped as workers
    are (``subprocess.Popen`` from the event loop's thread, a pidfd), not through asyncio's child watcher: a worker's
    spawn meanwhile (``subprocess.Popen`` reaps the children it finds finished) could take the child from it, and
    asyncio then reports 255 for it."""
    out, err = (os.memfd_create(f"aelastic-py-spy-{name}", os.MFD_CLOEXEC) for name in ("stdout", "stderr"))
    try:
        popen = _spawn(args, out, err)
        try:
            code = await wait_process(popen)
        finally:
            if popen.returncode is None:  # cancelled: the kill that follows must not wait for py-spy
                popen.kill()
                with anyio.CancelScope(shield=True):
                    await wait_process(popen)
        return code, _text(out), _text(err)
    finally:
        os.close(out)
        os.close(err)


def _spawn(args: Sequence[str], out: int, err: int) -> subprocess.Popen[bytes]:
    return subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=out, stderr=err)  # a fork/exec: milliseconds


def _text(fd: int) -> str:
    os.lseek(fd, 0, os.SEEK_SET)
    with os.fdopen(os.dup(fd), "rb") as file:
        return file.read().decode(errors="replace")


def _stopped(pid: int) -> bool:
    """Whether ``pid`` is stopped (SIGSTOP, a debugger): state ``T`` or ``t``."""
    return process_state(pid) in ("T", "t")
