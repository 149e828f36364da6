"""Stack dumps without py-spy: :mod:`faulthandler` in the worker, armed at start-up, triggered by a signal.

The agent's side of the fallback; used by :class:`~aelastic.agent.stacks.parent.StackDumper` only when py-spy is
not installed. Python alone cannot read another process's stacks, so the worker has to write them, without any
cooperation from user code. The options:

* ``PYTHONFAULTHANDLER=1`` and SIGABRT: the dump is a crash. It core-dumps (a multi-gigabyte CUDA process through
  systemd-coredump), kills the other local workers dumped beside a hung one, and turns every worker's segfault into
  a traceback on stderr (torch's ``@record`` does that only for the workers that use it). Rejected.
* ``sys.remote_exec`` (Python 3.14) runs code only at the next bytecode boundary: not while blocked in C.
* :func:`faulthandler.register` on a signal, with ``chain=False``: the C signal handler writes every thread's
  traceback to a file descriptor and the worker goes on; it answers while blocked in C code (a sleep, a
  collective), needs no Python code to run, and costs nothing until the signal comes. Chosen. It has to be
  registered inside the worker: aelastic's start-up hook (``stacks/child/sitecustomize.py``, the child side of
  :mod:`aelastic.agent.stacks`: a ``sitecustomize`` that steps aside for the next one) goes first on the worker's
  ``PYTHONPATH``, and a pipe's write end is inherited by the worker (``AELASTIC_STACKS=<agent pid>:<fd>:<signal>``).

The hook writes ``armed`` when registered; the agent signals a worker only after reading it, so a worker that is
not a Python process (a shell wrapper, ``python -I``) is never sent a signal whose default action would kill it.
Then the dump is read from the pipe as it arrives, until the pipe has been quiet for :data:`_QUIET` seconds: the
handler writes the whole dump at once, so a pause means the end. Everything is bounded by the caller's deadline.
A stopped worker (SIGSTOP) would not run its handler until resumed: it is not signalled, and gets a note at once.
A worker started in a pre-warmed standby (``--prewarm``) is not armed: its interpreter started before the attempt,
without the hook (its start-up environment must equal the standby's); py-spy, which needs nothing from the worker,
dumps it.

The signal is a real-time one, which no common library handles (SIGUSR1 and SIGUSR2 are taken by SLURM and
Lightning's requeue handlers); if the user's code replaces its handler, that is the code that runs instead.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Final

import anyio

from ..procfs import process_state
from ..spawn.parent import WorkerCommand, WorkerProcess

__all__ = ["STACKS_ENV", "STACKS_SIGNAL", "FaultStacks", "fault_top_frames"]

STACKS_ENV: Final = "AELASTIC_STACKS"
STACKS_SIGNAL: Final = int(signal.SIGRTMIN) + 5
_HOOK_DIR: Final = str(Path(__file__).with_name("child"))  # goes first on the worker's PYTHONPATH
_ARMED: Final = b"armed\n"
_QUIET: Final = 0.2


def fault_top_frames(dump: str, count: int) -> list[str]:
    """The innermost ``count`` frames of the thread that handled the signal (the main thread: ``kill`` delivers to
    it first), as ``function (file:line)`` like py-spy's, from a :mod:`faulthandler` dump."""
    blocks = [block for block in dump.split("\n\n") if "(most recent call first):" in block]
    current = [block for block in blocks if block.lstrip().startswith("Current thread")]
    chosen = (current or blocks[-1:] or [""])[0]
    frames = []
    for line in chosen.splitlines()[1:]:
        # '  File "/path/worker.py", line 10 in hang_here'
        path, _, rest = line.strip().removeprefix('File "').partition('", line ')
        lineno, _, function = rest.partition(" in ")
        if function:
            frames.append(f"{function} ({os.path.basename(path)}:{lineno})")
    return frames[:count]


class FaultStacks:
    """The agent's side of the faulthandler dumps of one attempt's workers: a pipe per worker."""

    def __init__(self) -> None:
        self._pipes: dict[int, tuple[int, int]] = {}  # local rank -> (read end, write end)
        self._armed: set[int] = set()

    def __repr__(self) -> str:
        return f"<FaultStacks workers={sorted(self._pipes)} armed={sorted(self._armed)}>"

    def command(self, command: WorkerCommand) -> WorkerCommand:
        """``command`` with the start-up hook on its ``PYTHONPATH`` and a pipe's write end to inherit."""
        read_end, write_end = os.pipe()
        os.set_blocking(read_end, False)
        self._pipes[command.local_rank] = (read_end, write_end)
        env = dict(command.env)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_HOOK_DIR, env.get("PYTHONPATH")) if p)
        env[STACKS_ENV] = f"{os.getpid()}:{write_end}:{STACKS_SIGNAL}"
        return WorkerCommand(command.local_rank, command.global_rank, command.args, env, (*command.pass_fds, write_end))

    async def dump(self, worker: WorkerProcess, dumps: dict[int, str]) -> None:
        """Signal ``worker`` and put what it writes in ``dumps[worker.pid]`` as it arrives (the caller bounds it)."""
        pipe = self._pipes.get(worker.local_rank)
        if pipe is None:
            dumps[worker.pid] = (
                "no stack dump: py-spy is not installed and the worker was started without aelastic's faulthandler "
                "hook (a pre-warmed worker: --prewarm)"
            )
            return
        read_end = pipe[0]
        if worker.local_rank not in self._armed:
            if not _read_available(read_end).startswith(_ARMED):
                dumps[worker.pid] = (
                    "no stack dump: py-spy is not installed and the worker did not arm faulthandler "
                    "(not a Python process started by aelastic, or python -I / -S)"
                )
                return
            self._armed.add(worker.local_rank)
        _read_available(read_end)  # nothing is expected; a dump that came late for a previous request is stale
        state = process_state(worker.pid)
        if state in ("T", "t"):
            dumps[worker.pid] = "no stack dump: the worker is stopped (SIGSTOP, a debugger) and cannot run its handler"
            return
        if state in ("Z", ""):
            dumps[worker.pid] = "no stack dump: the worker had already exited"
            return
        try:
            os.kill(worker.pid, STACKS_SIGNAL)
        except ProcessLookupError:
            dumps[worker.pid] = "no stack dump: the worker had already exited"
            return
        dumps[worker.pid] = "no stack dump: the worker did not answer (its handler was replaced, or it was stopped)"
        await anyio.wait_readable(read_end)
        text = b""
        while True:
            text += _read_available(read_end)
            dumps[worker.pid] = text.decode(errors="replace")
            with anyio.move_on_after(_QUIET) as quiet:
                await anyio.wait_readable(read_end)
            if quiet.cancelled_caught:
                return

    def close(self) -> None:
        """Close every pipe (the workers are gone)."""
        for read_end, write_end in self._pipes.values():
            os.close(read_end)
            os.close(write_end)
        self._pipes.clear()


def _read_available(fd: int) -> bytes:
    chunks = []
    while True:
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks)
