"""The agent's side of forwarded signals: the running workers' process groups, and the witness.

Theory of operation
-------------------
A scheduler's notice (Slurm's ``--signal``) reaches the agent in one of two ways, and the workers must see it
exactly once either way:

* the sender signals every process of the job step (``scancel --signal=USR1 JOB``, a step signal, ``srun``
  forwarding what it received: slurmstepd's proctrack walks the step's process tree): the workers got it already;
* the sender signals the agent alone (``--signal=B:USR1`` reaches the batch shell, which passes it on with
  ``kill``; ``scancel --full`` on a batch step signals the shell's process group only): the agent forwards it.

The sender's pid cannot tell these apart (slurmstepd sends both kinds) and the workers cannot be asked. So the agent
starts a *witness* (:mod:`.child`): a process started as a worker is (a child of the agent, in a session of its own,
under the parent-death signal) that blocks the forwarded signals and reports each one it receives. Whatever reaches
every worker reaches the witness too, within microseconds of the agent (one loop of the sender's). When the agent
receives a signal it looks for the witness's receipt of it: one from the last :data:`STALE_AFTER` seconds, or one
arriving within :data:`DIRECT_WINDOW` seconds. Found: the workers were signalled directly, nothing is forwarded.
Not found: the signal goes to every running worker's process group (``killpg``). Only the second path waits, and
only :data:`DIRECT_WINDOW` seconds: nothing against a notice that comes tens of seconds before the deadline.

A witness that died (a signal it does not block, a kill) is logged once; every signal is then forwarded.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Final, NamedTuple

import anyio
import anyio.abc

from ..spawn.parent import PipeReader, signal_group, spawn_process, wait_process

__all__ = ["DIRECT_WINDOW", "STALE_AFTER", "Receipt", "RunningWorkers", "Witness", "open_witness"]

logger = logging.getLogger(__name__)

DIRECT_WINDOW: Final = 1.0
"""Seconds the agent waits, after receiving a signal, for the witness to report it (the sender's loop over the
step's processes may reach the witness after the agent)."""

STALE_AFTER: Final = 2.0
"""A witness's receipt older than this when the agent receives the signal belongs to another sending."""

_CHILD: Final = Path(__file__).with_name("child.py")


class RunningWorkers:
    """The process groups of the workers running now: what a forwarded signal reaches.

    :func:`~aelastic.agent.processes.run_workers` adds each worker once it is spawned and discards it once reaped;
    a worker whose leader has exited is skipped (its group id may be reused once it is reaped).
    """

    __slots__ = ("_groups",)

    def __init__(self) -> None:
        self._groups: dict[int, Callable[[], bool]] = {}

    def __repr__(self) -> str:
        return f"<RunningWorkers groups={sorted(self._groups)}>"

    def add(self, pgid: int, running: Callable[[], bool]) -> None:
        """Track the worker that leads ``pgid``; ``running()`` says whether its leader is still unreaped."""
        self._groups[pgid] = running

    def discard(self, pgid: int) -> None:
        self._groups.pop(pgid, None)

    def signal(self, signum: signal.Signals) -> list[int]:
        """Send ``signum`` to every running worker's process group now; the groups signalled."""
        sent = []
        for pgid, running in list(self._groups.items()):
            if running():
                signal_group(pgid, signum)
                sent.append(pgid)
        return sent


class Receipt(NamedTuple):
    """A signal the witness received: its number, the sender's pid (``si_pid``) and when the agent learnt of it."""

    signum: signal.Signals
    sender: int
    at: float


def sender_name(pid: int) -> str:
    """The sender's command name (``/proc/PID/comm``), ``?`` once it is gone: for the log line only."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip() or "?"
    except OSError:
        return "?"


class Witness:
    """The agent's handle on its witness process (see the module docstring); made by :func:`open_witness`."""

    def __init__(self, pid: int, signums: frozenset[signal.Signals]) -> None:
        self.pid = pid
        self.signums = signums
        self.alive = True
        self._receipts: list[Receipt] = []
        self._arrived = anyio.Event()

    def __repr__(self) -> str:
        return f"<Witness pid={self.pid} alive={self.alive} receipts={len(self._receipts)}>"

    async def serve(self, reader: PipeReader) -> None:
        """Read the witness's lines until it exits; then every signal is forwarded (logged once)."""
        buffer = b""
        try:
            while True:
                try:
                    buffer += await reader.receive()
                except anyio.EndOfStream:
                    break
                *lines, buffer = buffer.split(b"\n")
                now = anyio.current_time()
                for line in lines:
                    signo, sender = (int(field) for field in line.split())
                    self._receipts.append(Receipt(signal.Signals(signo), sender, now))
                self._arrived.set()
                self._arrived = anyio.Event()
        finally:
            self.alive = False
            self._arrived.set()
        logger.warning("the signal witness (pid %d) exited: every signal received is now forwarded", self.pid)

    async def wait_direct(self, signum: signal.Signals) -> Receipt | None:
        """The witness's receipt of ``signum`` if the sender signalled it too (consumed), else ``None`` after
        :data:`DIRECT_WINDOW` seconds; call it when the agent received ``signum``."""
        now = anyio.current_time()
        self._receipts = [r for r in self._receipts if r.at >= now - STALE_AFTER]
        with anyio.move_on_after(DIRECT_WINDOW):
            while True:
                for receipt in self._receipts:
                    if receipt.signum == signum:
                        self._receipts.remove(receipt)
                        return receipt
                if not self.alive:
                    return None
                await self._arrived.wait()
        return None


@asynccontextmanager
async def open_witness(signums: Iterable[signal.Signals]) -> AsyncIterator[Witness]:
    """Start the witness for ``signums``; it is killed and reaped on exit (also on cancellation, shielded).

    The witness is spawned with ``signums`` blocked in the spawning thread (the mask is inherited through exec),
    so none of them is fatal to it or lost while its interpreter starts.
    """
    wanted = frozenset(signums)
    read_end, write_end = os.pipe()
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, wanted)
    try:
        argv = [sys.executable, "-I", "-S", str(_CHILD), *(str(int(s)) for s in sorted(wanted))]
        popen = spawn_process(argv, {}, write_end, 2)  # its stderr is the agent's
    except BaseException:
        os.close(read_end)
        raise
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        os.close(write_end)
    reader = PipeReader(read_end)
    witness = Witness(popen.pid, wanted)
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(witness.serve, reader)
            try:
                yield witness
            finally:
                tg.cancel_scope.cancel()
    finally:
        with anyio.CancelScope(shield=True):
            if popen.poll() is None:
                signal_group(popen.pid, signal.SIGKILL)
            await wait_process(popen)
            reader.close()
