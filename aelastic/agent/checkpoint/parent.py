"""The agent's side of in-memory checkpoints: it owns the memory (see :mod:`aelastic.checkpoint` for the user's
view, :mod:`.child.api` for the worker's).

Theory of operation
-------------------
The :class:`Keeper` lives as long as the agent. For each rank that saves, it keeps *slots*: memory files
(``memfd_create``) that it creates, sizes and pre-faults (``posix_fallocate``, in a thread, the first time), and
passes to the rank's worker over its link. A memory file belongs to the agent: it outlives every worker, is handed
to each attempt's, and is released when the agent's last descriptor of it closes: when the job ends, however it ends
(a SIGKILLed agent's descriptors close with it), so nothing is left in ``/dev/shm`` or anywhere else.

A rank has two slots: its latest complete checkpoint and the one being written (the older complete one until
then). ``reserve`` gives the worker the slot that is not the latest; ``commit`` reads the header the worker wrote
last (:mod:`.child.layout`) and makes that slot the latest. A worker that dies midway never commits, so the latest
stays whole. A third slot is made only while the other one is read for a replica or the checkpoint directory and
``--checkpoint-memory`` has room for three; else that read is cancelled and done again with the newer one.

Each rendezvous round, the agents agree on the step the job restores from (:mod:`.plan`); :meth:`Keeper.adopt`
takes this node's part of it: slots of newer steps (a rank that completed a step its peers did not) are dropped, and
the saved ranks this node's workers need from elsewhere are fetched. ``load`` then answers with the slot of the
restore step.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import anyio

from ..link.parent import LinkRefusal
from ..spawn.parent import WorkerProcess
from .child.layout import HEADER_SIZE, Header, LayoutError
from .plan import Held, Inventory, NodePlan, saved_rank

__all__ = ["Keeper", "KeeperStatistics", "format_size"]

logger = logging.getLogger(__name__)

_GRANULE: Final = 1 << 20  # slots grow in whole MiB, so that a state a little larger reuses no memory


def format_size(size: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{size} B"


class _Slot:
    """One memory file of a rank: its size, generation (bumped when it is replaced by a larger one), the complete
    checkpoint it holds (``header``), the worker writing it, and the reads of it under way."""

    __slots__ = ("capacity", "fd", "generation", "header", "id", "readers", "released", "writer")

    def __init__(self, slot_id: int) -> None:
        self.id = slot_id
        self.fd = -1
        self.capacity = 0
        self.generation = 0
        self.header: Header | None = None
        self.writer: int | None = None  # pid
        self.readers: set[anyio.CancelScope] = set()
        self.released = anyio.Event()

    def __repr__(self) -> str:
        step = None if self.header is None else self.header.step
        return f"<slot {self.id} step={step} capacity={self.capacity} writer={self.writer} readers={len(self.readers)}>"

    def close(self) -> None:
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            os.close(fd)


class _Rank:
    """The slots of one saved rank on this agent."""

    __slots__ = ("latest", "rank", "slots", "source")

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.slots: list[_Slot] = []
        self.latest: _Slot | None = None
        self.source = "memory"  # where its latest came from: "memory", or "replica from HOST:PORT"

    def complete(self) -> list[_Slot]:
        return [slot for slot in self.slots if slot.header is not None]


@dataclass(frozen=True, slots=True)
class KeeperStatistics:
    """What :meth:`Keeper.statistics` reports.

    Attributes:
        ranks: the saved ranks held, and the steps held for each.
        memory: bytes of memory files held.
        saves: commits accepted; ``loads``: loads answered.
        restore_step: the step this round restores from (``None``: no checkpoint).
    """

    ranks: Mapping[int, tuple[int, ...]]
    memory: int
    saves: int
    loads: int
    restore_step: int | None


class Keeper:
    """The agent's checkpoints (see the module doc): a link service named ``checkpoint``.

    Args:
        limit: bytes of memory files one rank may hold (``--checkpoint-memory``): two slots of at most half of it.
    """

    name: Final = "checkpoint"

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._ranks: dict[int, _Rank] = {}
        self._next_slot = 0
        self._world = 0  # the world size of the round running now
        self._plan = NodePlan()
        self._saves = 0
        self._loads = 0

    def __repr__(self) -> str:
        held = {r: [s.header.step for s in h.complete() if s.header] for r, h in sorted(self._ranks.items())}
        return f"<Keeper held={held} restore_step={self._plan.step} limit={format_size(self.limit)}>"

    def statistics(self) -> KeeperStatistics:
        ranks = {r: tuple(sorted(s.header.step for s in h.complete() if s.header)) for r, h in self._ranks.items()}
        memory = sum(slot.capacity for held in self._ranks.values() for slot in held.slots)
        return KeeperStatistics(ranks, memory, self._saves, self._loads, self._plan.step)

    # --- the round -------------------------------------------------------------------------------------------

    def inventory(self) -> Inventory:
        """Every complete checkpoint held, for this round's plan."""
        held = []
        for rank in self._ranks.values():
            for slot in rank.complete():
                assert slot.header is not None
                held.append(Held(rank.rank, slot.header.step, slot.header.world, slot.header.total))
        return Inventory(tuple(held))

    def adopt(self, plan: NodePlan, world: int) -> None:
        """This node's part of the round's plan; ``world``: the round's world size (what saves are made in)."""
        self._plan, self._world = plan, world
        for rank in self._ranks.values():
            for slot in rank.complete():
                assert slot.header is not None
                if plan.step is None or slot.header.step > plan.step:
                    slot.header = None  # never restored from: the next save may take it
            newest = max(rank.complete(), key=lambda s: s.header.step if s.header else -1, default=None)
            rank.latest = newest
        if plan.step is not None:
            logger.info("checkpoints: this round restores step %d (world %d)", plan.step, plan.world)

    # --- the link service --------------------------------------------------------------------------------------

    async def handle(
        self, worker: WorkerProcess, op: str, message: Mapping[str, Any], fds: list[int]
    ) -> tuple[dict[str, Any], Sequence[int]]:
        for fd in fds:  # no operation takes any
            os.close(fd)
        if op == "reserve":
            return await self._reserve(worker, int(message["size"]), message.get("mapped", {}))
        if op == "commit":
            return self._commit(worker, int(message["slot"]), int(message["step"]), int(message["size"]))
        if op == "load":
            rank = message.get("rank")
            return self._load(worker, worker.global_rank if rank is None else int(rank))
        raise LinkRefusal(f"no checkpoint operation {op!r}")

    async def _reserve(
        self, worker: WorkerProcess, size: int, mapped: Mapping[str, int]
    ) -> tuple[dict[str, Any], Sequence[int]]:
        if size > self.limit // 2:
            raise LinkRefusal(
                f"the state takes {format_size(size)}: more than {format_size(self.limit // 2)}, half of the "
                f"{format_size(self.limit)} a rank may hold (two copies of its state; --checkpoint-memory)"
            )
        rank = self._ranks.setdefault(worker.global_rank, _Rank(worker.global_rank))
        slot = await self._free_slot(rank, size)
        if slot.capacity < size:
            await self._grow(slot, size)
        slot.header = None
        slot.writer = worker.pid
        reply = {"slot": slot.id, "generation": slot.generation, "capacity": slot.capacity,
                 "rank": worker.global_rank, "world": self._world}  # fmt: skip
        fresh = mapped.get(str(slot.id)) != slot.generation
        return reply, [slot.fd] if fresh else []

    async def _free_slot(self, rank: _Rank, size: int) -> _Slot:
        """The slot the next save of ``rank`` goes into: not its latest, not read now (see the module doc)."""
        for slot in rank.slots:
            if slot is not rank.latest and not slot.readers:
                return slot
        if len(rank.slots) < 2 or (len(rank.slots) < 3 and 3 * size <= self.limit):
            slot = _Slot(self._next_slot)
            self._next_slot += 1
            rank.slots.append(slot)
            return slot
        busy = next(slot for slot in rank.slots if slot is not rank.latest)
        for scope in busy.readers:
            scope.cancel()  # a replica or a persisting of an older step: done again with the newer one
        await busy.released.wait()
        return busy

    async def _grow(self, slot: _Slot, size: int) -> None:
        capacity = -(-size // _GRANULE) * _GRANULE
        fd = os.memfd_create(f"aelastic-checkpoint-{slot.id}", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, capacity)
            # Allocate (and zero) the pages now, off the event loop: the worker's first copy into them then costs
            # what every later one does, instead of a page fault per 4 KiB.
            await anyio.to_thread.run_sync(os.posix_fallocate, fd, 0, capacity)
        except BaseException:
            os.close(fd)
            raise
        slot.close()
        slot.fd, slot.capacity, slot.generation = fd, capacity, slot.generation + 1

    def _commit(
        self, worker: WorkerProcess, slot_id: int, step: int, size: int
    ) -> tuple[dict[str, Any], Sequence[int]]:
        rank = self._ranks.get(worker.global_rank)
        slot = None if rank is None else next((s for s in rank.slots if s.id == slot_id), None)
        if rank is None or slot is None or slot.writer != worker.pid:
            raise LinkRefusal(f"slot {slot_id} was not reserved by this worker")
        try:
            header = Header.decode(os.pread(slot.fd, HEADER_SIZE, 0))
        except LayoutError as exc:
            raise LinkRefusal(f"the checkpoint of step {step} is not complete: {exc}") from None
        if header.step != step or header.total != size or header.total > slot.capacity:
            raise LinkRefusal(f"the checkpoint's header (step {header.step}, {header.total} bytes) is not the one "
                              f"committed (step {step}, {size} bytes)")  # fmt: skip
        slot.header, slot.writer = header, None
        rank.latest, rank.source = slot, "memory"
        self._saves += 1
        return {}, ()

    def _load(self, worker: WorkerProcess, rank: int) -> tuple[dict[str, Any], Sequence[int]]:
        plan = self._plan
        if plan.step is None:
            return {"found": False}, ()
        saved = saved_rank(rank, plan.world)
        held = self._ranks.get(saved)
        slot = None if held is None else next((s for s in held.complete() if s.header and s.header.step == plan.step),
                                              None)  # fmt: skip
        if held is None or slot is None or slot.header is None:
            raise LinkRefusal(f"rank {saved}'s checkpoint of step {plan.step} is not held by this agent")
        self._loads += 1
        reply = {"found": True, "size": slot.header.total, "source": held.source}
        return reply, [slot.fd]

    def close(self) -> None:
        """Release every memory file."""
        for rank in self._ranks.values():
            for slot in rank.slots:
                slot.close()
        self._ranks.clear()
