"""The agent's side of hang detection (``--hang-timeout``; see :mod:`aelastic.agent.hang`).

:class:`HangWatch` runs beside one attempt's workers. It samples each local worker's CPU time (its process tree, from
``/proc``: nothing is asked of the worker) every :func:`sample_period` seconds; when no local worker has made
progress for the timeout, the node says so in the round's store (``aelastic/hang/idle/<node>``) and waits until
every node of the round says the same, taking its word back as soon as a worker moves again. When every node is
idle at once, the first to see it declares the hang (``aelastic/hang/declared``), and every node then, together:

1. asks torch's Flight Recorder of its workers for a dump (NCCL: a write to each rank's
   ``TORCH_NCCL_DEBUG_INFO_PIPE_FILE`` pipe; the dumps go to ``TORCH_NCCL_DEBUG_INFO_TEMP_FILE<rank>``),
2. dumps every local worker's stack (:class:`~aelastic.agent.stacks.parent.StackDumper`: ``stacks.txt`` in each
   rank's log directory),
3. publishes what it saw of each rank (its process state, its main thread's frames: ``aelastic/hang/report/<node>``)
   and reads every other node's, waiting at most :data:`REPORT_WAIT`,
4. names the odd ones out, all nodes alike (:func:`~aelastic.agent.hang.verdict.judge`), logs the verdict, and
   kills the named ranks it runs (every local worker when the verdict says so) after noting why in their part of
   the failure report. The attempt then fails as any attempt does: a restart, or in-process restarts where the
   workers allow them (the named rank's peers are released when its connections close).

A node whose workers all succeeded stays idle for good (:meth:`HangWatch.finished`), so the nodes still running
can find a hang among themselves.
"""

from __future__ import annotations

import json
import logging
import os
import socket
from collections.abc import Callable, Mapping, Sequence
from contextlib import suppress
from pathlib import Path
from typing import Final, Protocol

import anyio

from ...errors import StoreError
from ...store.api import Store
from ..procfs import process_state, tree_times
from ..spawn.parent import WorkerProcess
from ..stacks.parent import StackDumper
from .verdict import Progress, RankReport, judge

__all__ = ["HangWatch", "flight_recorder_env", "sample_period"]

logger = logging.getLogger(__name__)

_PREFIX: Final = "aelastic/hang"
REPORT_WAIT: Final = 10.0  # seconds a node waits for the other nodes' reports once a hang is declared
FLIGHT_RECORDER_ENTRIES: Final = "2000"  # torch's own tests and examples use 1000-2000


def sample_period(timeout: float) -> float:
    """How often the workers' CPU time is read: a tenth of the timeout, between 0.1 and 5 seconds."""
    return min(max(timeout / 10, 0.1), 5.0)


def flight_recorder_env(base: Mapping[str, str], pipe_prefix: Path, dump_prefix: Path | None) -> dict[str, str]:
    """The variables that turn torch's Flight Recorder on for the workers, unless ``base`` already says anything
    of it: its ring buffer (NCCL and gloo), the pipe a dump is asked on (NCCL), where dumps go."""
    if any(name in base for name in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")):
        return {}
    # torch 2.13's names (TORCH_NCCL_TRACE_BUFFER_SIZE, the older name of the buffer's, prints a deprecation).
    env = {"TORCH_FR_BUFFER_SIZE": FLIGHT_RECORDER_ENTRIES, "TORCH_NCCL_DEBUG_INFO_PIPE_FILE": str(pipe_prefix)}
    if dump_prefix is not None:
        env["TORCH_FR_DUMP_TEMP_FILE"] = str(dump_prefix)
    return env


class Marks(Protocol):
    """What the workers said of themselves (:class:`aelastic.agent.incidents.parent.Incidents`)."""

    def busy(self, pid: int) -> str | None: ...
    def hung(self, idle: float) -> None: ...


class HangWatch:
    """One attempt's hang detection on one node; see the module doc.

    Args:
        timeout: the seconds without progress on every rank of the job that make a hang.
        store: the round's store (every node of the round sees the same keys).
        node: this node's rank in the round; ``nodes``: the round's size; ``world_size``: the job's ranks.
        dumper: the attempt's stack dumper (the failure report's notes go through it).
        pipe_prefix: the workers' ``TORCH_NCCL_DEBUG_INFO_PIPE_FILE`` (``None``: none).
        kill: SIGKILLs a worker by pid (the supervisor's: it bounds how long the worker may outlive it).
        marks: what the workers said of themselves (``aelastic.worker.busy``: a rank idle while a device or a
            remote service works for it counts as progress), told when a hang is declared (the incident records).
    """

    def __init__(
        self,
        timeout: float,
        store: Store,
        node: int,
        nodes: int,
        world_size: int,
        dumper: StackDumper,
        pipe_prefix: str | None,
        kill: Callable[[int], None],
        marks: Marks | None = None,
    ) -> None:
        self.timeout = timeout
        self.marks = marks
        self._idle_since = 0.0  # when this node's workers last made progress, once idle (anyio's clock)
        self.store = store.prefixed(_PREFIX)
        self.node, self.nodes, self.world_size = node, nodes, world_size
        self.dumper = dumper
        self.pipe_prefix = pipe_prefix
        self.kill = kill
        self.host = socket.gethostname()

    def __repr__(self) -> str:
        return f"<HangWatch timeout={self.timeout:g} node={self.node}/{self.nodes}>"

    async def run(self, workers: Sequence[WorkerProcess]) -> None:
        """Watch ``workers`` until a hang is declared and dealt with (then return), or until cancelled."""
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._sample, workers)
            await self.store.wait(["declared"])
            tg.cancel_scope.cancel()
        await self._diagnose(workers)

    async def finished(self) -> None:
        """This node's workers all succeeded: it is idle for the rest of the round."""
        with suppress(StoreError):
            await self.store.set(f"idle/{self.node}", b"finished")

    async def _sample(self, workers: Sequence[WorkerProcess]) -> None:
        progress = Progress()
        period = sample_period(self.timeout)
        agreeing: anyio.CancelScope | None = None
        async with anyio.create_task_group() as tg:
            while True:
                now = anyio.current_time()
                live = []
                for worker in workers:
                    times = tree_times(worker.pid)
                    if times.state not in ("", "Z"):
                        busy = self.marks is not None and self.marks.busy(worker.pid) is not None
                        progress.observe(worker.pid, times.cpu, now, times.io, busy=busy)
                        live.append(worker.pid)
                idle_for = progress.idle_for(live, now)
                idle = idle_for >= self.timeout
                if idle and agreeing is None:
                    self._idle_since = now - idle_for
                    await self.store.set(f"idle/{self.node}", b"idle")
                    agreeing = anyio.CancelScope()
                    tg.start_soon(self._agree, agreeing)
                elif not idle and agreeing is not None:
                    agreeing.cancel()
                    agreeing = None
                    await self.store.delete_key(f"idle/{self.node}")
                await anyio.sleep(period)

    async def _agree(self, scope: anyio.CancelScope) -> None:
        """Declare the hang once every node is idle (unless this node moves first: ``scope`` is cancelled)."""
        with scope:
            await self.store.wait([f"idle/{node}" for node in range(self.nodes)])
            await self.store.compare_set("declared", b"", str(self.node).encode())

    async def _diagnose(self, workers: Sequence[WorkerProcess]) -> None:
        reason = f"no rank of the job made progress (CPU time, bytes read or written) for {self.timeout:g} s"
        if self.marks is not None:
            self.marks.hung(anyio.current_time() - self._idle_since)
        logger.warning("hang: %s: dumping every rank's stack", reason)
        self._ask_flight_recorder(workers)
        stacks = await self.dumper.dump(workers, f"hang: {reason}", report=())
        mine = [
            RankReport(w.global_rank, self.node, self.host, w.pid, process_state(w.pid), tuple(stacks.get(w.pid, ())))
            for w in workers
        ]
        await self.store.set(f"report/{self.node}", json.dumps([r.to_json() for r in mine]).encode())
        reports = [*mine, *await self._others()]
        verdict = judge(reports, self.world_size)
        logger.warning("hang: %s; %s", reason, verdict.summary)
        targets = [w for w in workers if verdict.everyone or w.global_rank in verdict.culprits]
        for worker in targets:
            self.dumper.note(worker.pid, f"hung: {reason}; named by the agents: {verdict.summary.splitlines()[0]}")
            frames = stacks.get(worker.pid, ())
            if frames:
                self.dumper.note(worker.pid, "top frames (innermost first):")
                for frame in frames[:5]:
                    self.dumper.note(worker.pid, f"  {frame}")
            self.dumper.note(worker.pid, "SIGKILLed by its agent")
            self.kill(worker.pid)
        if targets:
            logger.warning("hang: killing local ranks %s (SIGKILL): the attempt fails",
                           sorted(w.local_rank for w in targets))  # fmt: skip

    async def _others(self) -> list[RankReport]:
        """The other nodes' reports that arrive within :data:`REPORT_WAIT`."""
        keys = [f"report/{node}" for node in range(self.nodes) if node != self.node]
        with anyio.move_on_after(REPORT_WAIT):
            await self.store.wait(keys)
        reports: list[RankReport] = []
        for key in keys:
            if await self.store.check([key]):
                reports.extend(RankReport.from_json(item) for item in json.loads(await self.store.get(key)))
        return reports

    def _ask_flight_recorder(self, workers: Sequence[WorkerProcess]) -> None:
        """A dump from each worker's Flight Recorder where it listens on its pipe (NCCL's, once a group exists)."""
        if self.pipe_prefix is None:
            return
        for worker in workers:
            pipe = f"{self.pipe_prefix}{worker.global_rank}.pipe"
            try:
                fd = os.open(pipe, os.O_WRONLY | os.O_NONBLOCK)
            except OSError:
                continue  # no pipe (gloo; no NCCL group yet), or nobody reading it
            try:
                os.write(fd, b"1\n")
            except OSError as exc:
                logger.debug("flight recorder pipe %s: %s", pipe, exc)
            finally:
                os.close(fd)
