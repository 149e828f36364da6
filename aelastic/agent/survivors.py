"""In-process restarts, the supervisor's side (:mod:`aelastic.agent.restart`): the ``restart`` link service a
restartable worker registers with and reports its exception to, the verdict on a report while its attempt runs
(:meth:`Survivors.judge`), the survivors aborted and kept when an attempt ends (:meth:`Survivors.keep`), and each one
given the next attempt in its process (:meth:`Survivors.reassign`), or stopped when it does not let go in time.
Each move of a worker is its lifecycle's (:mod:`aelastic.agent.lifecycle`)."""

from __future__ import annotations

import logging
import signal
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Final

import anyio

from .lifecycle import Event
from .link.parent import LinkRefusal
from .logs import LogSpec, Std, WorkerLog
from .restart.parent import VICTIM_GRACE, RestartChannel
from .spawn.parent import ATTEMPT_VARIABLES, WorkerCommand, WorkerProcess
from .started import Tracked

__all__ = ["Survivors"]

logger = logging.getLogger("aelastic.agent.processes")  # the supervisor's log lines

Stop = Callable[[Sequence[Tracked], signal.Signals], Awaitable[None]]


class Survivors:
    """The survivors of one supervisor, and its ``restart`` link service; ``find`` is a worker by pid, ``stop`` the
    supervisor's stop."""

    name: Final = "restart"

    def __init__(self, find: Callable[[int], Tracked | None], stop: Stop) -> None:
        self._find = find
        self._stop = stop
        self._kept: dict[int, Tracked] = {}  # aborted, awaiting the next attempt, by local rank

    def __repr__(self) -> str:
        return f"<Survivors kept={sorted(self._kept)}>"

    async def handle(
        self, identity: WorkerProcess, op: str, message: Mapping[str, Any]
    ) -> tuple[dict[str, Any], Sequence[int]]:
        worker = self._find(identity.pid)
        if worker is None or not worker.lifecycle.free:
            raise LinkRefusal("this worker is being stopped")
        if op == "register":
            if worker.restart is None:
                worker.restart = RestartChannel()
                worker.registered.set()
            return {}, [worker.restart.worker_fd]
        if op == "raised" and worker.restart is not None:
            logger.info("worker local_rank %d (pid %d) raised %s", worker.command.local_rank, worker.pid,
                        message.get("error", "?"))  # fmt: skip
            worker.restart.take(message)
            return await worker.restart.wait_verdict(), ()
        raise LinkRefusal(f"no restart operation {op!r} for this worker")

    def take(self) -> dict[int, Tracked]:
        """The survivors kept for the next attempt, by local rank, handed over to it."""
        kept, self._kept = self._kept, {}
        return kept

    def holds(self, worker: Tracked) -> bool:
        """Whether ``worker`` is kept for the next attempt."""
        return self._kept.get(worker.local_rank) is worker

    async def release(self) -> None:
        """Stop the survivors kept for an attempt that will not come (the job ends)."""
        await self._stop(list(self.take().values()), signal.SIGTERM)

    async def reassign(self, worker: Tracked, command: WorkerCommand, logs: LogSpec) -> bool:
        """Give survivor ``worker`` this attempt (``command``'s environment, new log files) as the verdict on its
        report; ``False`` (it was stopped) if it did not report within the abort's grace."""
        channel = worker.restart
        assert channel is not None
        if channel.report is None:
            await channel.wait_report()
        if channel.report is None or not worker.survives:
            if worker.running() and channel.held:
                logger.warning("worker local_rank %d (pid %d) is held in a collective with a lost peer (%s): "
                               "killing it and starting another", worker.command.local_rank, worker.pid,
                               channel.held)  # fmt: skip
            elif worker.running():
                logger.warning("worker local_rank %d (pid %d) did not let go of its round within %g s of the "
                               "abort: killing it and starting another", worker.command.local_rank, worker.pid,
                               channel.grace)  # fmt: skip
            await self._stop([worker], signal.SIGKILL)
            return False
        old, worker.log = worker.log, WorkerLog(logs, command.local_rank, command.global_rank)
        for std in (Std.OUT, Std.ERR):
            old.finish(std)
        old.close()
        worker.command = command
        worker.on(Event.REASSIGN)
        env = {k: v for k, v in command.env.items() if k in ATTEMPT_VARIABLES}
        channel.decide({"verdict": "restart", "env": env})
        logger.debug("local_rank %d (pid %d) goes on in its process as rank %d", command.local_rank, worker.pid,
                     command.global_rank)  # fmt: skip
        return True

    async def judge(self, worker: Tracked, ending: anyio.Event) -> None:
        """The verdict on a restartable worker's report while its attempt runs (see :mod:`aelastic.agent.restart`);
        a survivor's comes with the next attempt."""
        await worker.registered.wait()
        channel = worker.restart
        assert channel is not None
        await channel.reported.wait()
        if channel.aborted or ending.is_set():
            return
        if channel.victim:
            with anyio.move_on_after(VICTIM_GRACE):
                await ending.wait()
            if ending.is_set():
                return
        worker.on(Event.FAIL)
        channel.decide({"verdict": "fail"})

    def keep(self, survivors: Sequence[Tracked], reason: str, *, lost: bool) -> None:
        """Abort ``survivors`` for the next attempt (they report within their grace, then wait for it); ``lost``:
        members left the round."""
        for worker in survivors:
            assert worker.restart is not None
            worker.restart.abort(reason, lost=lost)
            worker.on(Event.KEEP)
            self._kept[worker.local_rank] = worker
        if survivors:
            logger.info("keeping local ranks %s in their processes for the next round (%s)",
                        sorted(w.local_rank for w in survivors), reason)  # fmt: skip
