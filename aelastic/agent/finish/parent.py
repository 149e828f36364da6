"""The agent's side of workers that finish together; see :mod:`aelastic.agent.finish` and
:mod:`aelastic.worker._finish`, which defines the protocol (``FINISH_FDS_ENV``)."""

from __future__ import annotations

import os
from collections.abc import Sequence

import anyio

from ...worker._finish import FINISH_FDS_ENV
from ..spawn.parent import FdVar, PipeReader

__all__ = ["FinishLineServer"]


class FinishLineServer:
    """Reads who returned from the done pipe, and closes the release pipe once every worker has returned or
    exited."""

    def __init__(self, local_ranks: Sequence[int]) -> None:
        self._pending = set(local_ranks)
        done_read, self._done_write = os.pipe()  # non-inheritable; pass_fds gives the workers their copies
        self._release_read, self._release_write = os.pipe()
        self._done = PipeReader(done_read)
        self._scope = anyio.CancelScope()

    def __repr__(self) -> str:
        return f"<FinishLineServer pending={sorted(self._pending)} released={self._release_write < 0}>"

    def fd_var(self) -> FdVar:
        """The workers' ends, and the variable that names them."""
        return FdVar(FINISH_FDS_ENV, "{},{}", (self._done_write, self._release_read))

    def spawned(self) -> None:
        """Every worker holds its ends now: drop the agent's copies, so the pipes end with the workers."""
        for fd in (self._done_write, self._release_read):
            if fd >= 0:
                os.close(fd)
        self._done_write = self._release_read = -1

    def finished(self, local_rank: int) -> None:
        """``local_rank`` returned, or exited; release every worker once none is pending."""
        self._pending.discard(local_rank)
        if not self._pending and self._release_write >= 0:
            os.close(self._release_write)
            self._release_write = -1
            self._scope.cancel()

    async def serve(self) -> None:
        """Read the done pipe until everyone finished (or every holder of its write end is gone)."""
        with self._scope:
            received = b""
            async for chunk in self._done:
                received += chunk
                *lines, received = received.split(b"\n")
                for line in lines:
                    self.finished(int(line))

    def close(self) -> None:
        self.spawned()
        self._done.close()
        if self._release_write >= 0:
            os.close(self._release_write)
            self._release_write = -1
