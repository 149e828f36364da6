"""The agent's side of in-process restarts (see :mod:`aelastic.agent.restart`; the protocol is in
:mod:`aelastic.worker._restart`).

A worker that registers (``restart.register``) gets a :class:`RestartChannel`: the events socket its agent aborts
it on, and the place where the report of its function's exception waits for the agent's verdict. The supervisor
(:mod:`aelastic.agent.processes`) decides, per report:

* the worker's agent asked for it (an abort), or the report arrives once the round is known to end (a local
  failure, a membership change): the worker is a *survivor*; its verdict is the next round's environment;
* the exception comes from a collective or the store (a peer went away) and nothing is known yet: the worker may
  be a victim of a failure elsewhere, whose news is on its way; it waits up to :data:`VICTIM_GRACE` for the round to
  end, and fails after that;
* any other exception is the worker's own failure: its verdict is to fail, and it is replaced.

A survivor that does not report within :data:`ABORT_GRACE` of its abort (blocked in a call that does not return) is
killed and replaced like a failed worker; within :data:`LOST_ABORT_GRACE` when members left the round: a survivor
blocked in a collective with a peer that vanished without closing its connections (a powered-off or partitioned
node) is released by nothing but its own death (gloo has no abort; NCCL's returns at once). Such a survivor says so
(``held``, :data:`aelastic.worker._restart.HELD_AFTER` after the abort) and is replaced at once, its grace unspent.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Mapping
from contextlib import suppress
from typing import Any, Final

import anyio

__all__ = ["ABORT_GRACE", "LOST_ABORT_GRACE", "VICTIM_GRACE", "RestartChannel"]

VICTIM_GRACE: Final = 10.0  # seconds a worker whose collective failed waits for the news of a failure elsewhere
ABORT_GRACE: Final = 10.0  # seconds an aborted survivor has to report before it is killed and replaced
LOST_ABORT_GRACE: Final = 2.0  # the same, when members left the round


class _Verdict:
    __slots__ = ("decided", "value")

    def __init__(self) -> None:
        self.decided = anyio.Event()
        self.value: dict[str, Any] = {}


class RestartChannel:
    """The agent's end of one restartable worker's events socket, and its report awaiting a verdict."""

    def __init__(self) -> None:
        agent_end, worker_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        agent_end.setblocking(False)
        self._socket = agent_end
        self.worker_fd = worker_end.detach()  # passed once, then closed by the caller
        self.report: Mapping[str, Any] | None = None
        self.reported = anyio.Event()
        self.aborted = False
        self.grace = ABORT_GRACE  # how long the last abort lets it take to report
        self.held = ""  # where the worker said its call is held, after an abort for lost members
        self.verdicts = 0  # given so far: an abort names the call it ends by it (see abort)
        self._pending = _Verdict()  # the verdict on the report pending (or the next one)

    def __repr__(self) -> str:
        return f"<RestartChannel aborted={self.aborted} report={self.report is not None}>"

    @property
    def victim(self) -> bool:
        """Whether the pending report is a collective's failure the agent did not ask for."""
        return self.report is not None and bool(self.report.get("distributed")) and not self.report.get("aborted")

    def abort(self, reason: str, *, lost: bool) -> None:
        """Ask the worker to end its function's call (it reports, then waits for the next round) within its grace
        (:data:`LOST_ABORT_GRACE` when members left the round: ``lost``, else :data:`ABORT_GRACE`)."""
        if self.aborted:
            return
        self.aborted, self.grace, self.held = True, LOST_ABORT_GRACE if lost else ABORT_GRACE, ""
        # The call it ends is the one after this many verdicts: a worker whose listener reads it only after it has
        # reported that call's end by itself and started the next (a busy node) must not end the next one with it.
        event = {"event": "abort", "reason": reason, "grace": self.grace, "verdicts": self.verdicts, "lost": lost}
        with suppress(OSError):  # a full socket or a dead worker: it reports anyway, or its end is seen
            self._socket.send(json.dumps(event).encode())

    async def wait_report(self) -> None:
        """Until the worker reported, said that its call is held in a collective (:attr:`held`), or its grace ran
        out."""
        with anyio.move_on_after(self.grace):
            async with anyio.create_task_group() as tg:

                async def reported() -> None:
                    await self.reported.wait()
                    tg.cancel_scope.cancel()

                tg.start_soon(reported)
                await self._wait_held()
                tg.cancel_scope.cancel()

    async def _wait_held(self) -> None:
        while True:
            await anyio.wait_readable(self._socket)
            try:
                data = self._socket.recv(1 << 12)
            except BlockingIOError:
                continue
            except OSError:
                data = b""
            if not data:  # the worker is gone: its end is seen where its exit is awaited
                await anyio.sleep_forever()
            message = json.loads(data)
            if message.get("event") == "held" and message.get("verdicts") == self.verdicts:  # not an earlier abort's
                self.held = str(message.get("where", "?"))
                return

    def take(self, report: Mapping[str, Any]) -> None:
        """The worker's report of its function's exception."""
        self.report = report
        self.reported.set()

    def decide(self, verdict: dict[str, Any]) -> None:
        """The agent's word on the pending report (``{"verdict": "restart", "env": ...}`` or ``"fail"``). The channel
        is ready for the next round's report at once: the round this verdict starts must not take the report as one
        of its own, though the worker's link may hand the verdict over only after that round has begun watching."""
        pending, self._pending = self._pending, _Verdict()
        self.report, self.reported, self.aborted = None, anyio.Event(), False
        self.verdicts += 1
        pending.value = verdict
        pending.decided.set()

    async def wait_verdict(self) -> dict[str, Any]:
        """The verdict on the report just taken."""
        pending = self._pending
        await pending.decided.wait()
        return pending.value

    def close(self) -> None:
        if self.worker_fd >= 0:
            fd, self.worker_fd = self.worker_fd, -1
            os.close(fd)
        with suppress(OSError):
            self._socket.close()
