"""The agent's handle on its reaper sidecar (:mod:`aelastic.agent.reaper.child`); see :mod:`aelastic.agent.reaper`.

Protocol: the agent writes ASCII lines ``+<pgid>\\n`` (register) and ``-<pgid>\\n`` (unregister) to the sidecar's
stdin, a pipe whose only write end the agent holds; each line is well under ``PIPE_BUF``, so every write is atomic.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import anyio
import anyio.lowlevel

from ...errors import ReaperError
from ..spawn.parent import wait_process

__all__ = ["Reaper", "ReaperStatistics", "open_reaper"]

logger = logging.getLogger(__name__)

# The sidecar, found by path and run with ``python -I -S``: nothing of aelastic or site-packages is imported.
_SIDECAR = Path(__file__).with_name("child.py")


@dataclass(frozen=True, slots=True)
class ReaperStatistics:
    """What :meth:`Reaper.statistics` reports.

    Attributes:
        pid: the sidecar's pid.
        registered: the process groups registered now.
        closed: whether the agent closed its end of the pipe.
    """

    pid: int
    registered: frozenset[int]
    closed: bool


class Reaper:
    """The agent's handle on its reaper sidecar (see :func:`open_reaper`)."""

    def __init__(self, process: subprocess.Popen[bytes], fd: int) -> None:
        self._process = process
        self._fd = fd
        self._registered: set[int] = set()

    def __repr__(self) -> str:
        return f"<Reaper pid={self._process.pid} registered={sorted(self._registered)} closed={self._fd < 0}>"

    @property
    def pid(self) -> int:
        return self._process.pid

    def statistics(self) -> ReaperStatistics:
        """The sidecar's pid and the process groups registered now."""
        return ReaperStatistics(pid=self._process.pid, registered=frozenset(self._registered), closed=self._fd < 0)

    async def register(self, pgid: int) -> None:
        """Have the reaper SIGKILL process group ``pgid`` if the agent goes away before :meth:`unregister`.

        Raises:
            ReaperError: the reaper is gone or was closed.
        """
        await self._send(f"+{pgid}\n".encode())
        self._registered.add(pgid)

    async def unregister(self, pgid: int) -> None:
        """Forget process group ``pgid`` (it has been stopped and reaped).

        Raises:
            ReaperError: the reaper is gone or was closed.
        """
        await self._send(f"-{pgid}\n".encode())
        self._registered.discard(pgid)

    async def _send(self, line: bytes) -> None:
        await anyio.lowlevel.checkpoint()
        while True:
            if self._fd < 0:
                raise ReaperError("the reaper sidecar was closed; open a new one with open_reaper()")
            try:
                os.write(self._fd, line)  # under PIPE_BUF: all of it or EAGAIN
            except BlockingIOError:
                await anyio.wait_writable(self._fd)
            except BrokenPipeError as exc:
                raise ReaperError(
                    f"the reaper sidecar (pid {self._process.pid}) exited with {self._process.poll()}; "
                    "worker groups can no longer be protected against an agent crash"
                ) from exc
            else:
                return

    def _close(self) -> None:
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            os.close(fd)


@asynccontextmanager
async def open_reaper() -> AsyncIterator[Reaper]:
    """Start the reaper sidecar for this agent; yields the :class:`Reaper` to pass to
    :func:`~aelastic.agent.processes.run_workers`.

    On exit the pipe is closed; the sidecar kills the groups still registered (none, after a clean run) and exits;
    it is reaped under a shield. If the agent dies instead, the kernel closes the pipe and the sidecar does the
    same.
    """
    read_fd, write_fd = os.pipe()  # both non-inheritable: workers never hold the write end
    try:
        # Popen, reaped through a pidfd as the workers are: anyio.open_process would set up asyncio's subprocess
        # transport and child-watcher thread, a few milliseconds of every launch for a process nobody reads from.
        process = subprocess.Popen(  # noqa: ASYNC220 (see above and aelastic.agent.spawn)
            [sys.executable, "-I", "-S", str(_SIDECAR)],
            stdin=read_fd,
            stdout=subprocess.DEVNULL,
            start_new_session=True,
        )
    except BaseException:
        os.close(write_fd)
        raise
    finally:
        os.close(read_fd)
    os.set_blocking(write_fd, False)
    reaper = Reaper(process, write_fd)
    logger.debug("reaper sidecar started, pid %d", process.pid)
    try:
        yield reaper
    finally:
        reaper._close()
        with anyio.CancelScope(shield=True):
            await wait_process(process)
