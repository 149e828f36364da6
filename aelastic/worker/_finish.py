"""The worker's side of finishing together (``run_workers(..., finish_together=True)``); see
:mod:`aelastic.agent.finish`.

torch's multiprocessing runs a function entrypoint so that no worker exits before every local worker's function
has returned: each returns, then waits for the agent's word, and then all exit at once. Exiting one by one lets a
worker tear down its gloo connections while a peer's gloo threads still use them, and that peer can then abort in
its own teardown ("terminate called without an active exception"). aelastic keeps torch's contract with two pipes
made by the agent: a worker that returned writes its local rank to the *done* pipe and blocks reading the *release*
pipe, whose only write end the agent closes once every local worker has returned or exited. The worker's ends are
named by :data:`FINISH_FDS_ENV`; this module is imported by the callable bootstrap
(:mod:`aelastic.worker._callables`), so it imports nothing heavy.
"""

from __future__ import annotations

import os
from typing import Final

__all__ = ["FINISH_FDS_ENV", "FinishLine"]

FINISH_FDS_ENV: Final = "AELASTIC_FINISH_FDS"  # "<done write fd>,<release read fd>"


class FinishLine:
    """A worker's two pipe ends; :meth:`from_environment` takes them over before the user's code runs."""

    def __init__(self, done_fd: int, release_fd: int) -> None:
        self._done_fd = done_fd
        self._release_fd = release_fd

    @classmethod
    def from_environment(cls) -> FinishLine | None:
        """Take the ends named in the environment, if any, and keep them from the user's own subprocesses."""
        value = os.environ.pop(FINISH_FDS_ENV, None)
        if value is None:
            return None
        done_fd, release_fd = (int(part) for part in value.split(","))
        os.set_inheritable(done_fd, False)
        os.set_inheritable(release_fd, False)
        return cls(done_fd, release_fd)

    def arrive_and_wait(self, local_rank: int) -> None:
        """Say this worker returned, then block until every local worker has (end of file on the release pipe)."""
        os.write(self._done_fd, f"{local_rank}\n".encode())
        os.close(self._done_fd)
        while os.read(self._release_fd, 64):
            pass
        os.close(self._release_fd)
