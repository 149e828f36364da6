"""The memory one agent holds for in-memory checkpoints: the slots of its own ranks and the replicas of another
node's ranks (:mod:`.slots`), within the bound a rank may hold (``--checkpoint-memory``), and which slot a rank's
next checkpoint goes into."""

from __future__ import annotations

from .plan import Held
from .slots import RankSlots, Slot, format_size

__all__ = ["Holdings", "TooLarge"]


class TooLarge(ValueError):
    """A state larger than half of what a rank may hold (two copies of it must fit)."""


class Holdings:
    """Own ranks' and replicas' slots, by rank; ``limit``: the bytes a rank may hold."""

    __slots__ = ("_next_slot", "limit", "own", "replicas")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.own: dict[int, RankSlots] = {}
        self.replicas: dict[int, RankSlots] = {}
        self._next_slot = 0

    def __repr__(self) -> str:
        return f"<Holdings own={sorted(self.own)} replicas={sorted(self.replicas)} limit={format_size(self.limit)}>"

    def check_size(self, size: int) -> None:
        """Raises :class:`TooLarge` for a state of ``size`` bytes that does not fit twice."""
        if size > self.limit // 2:
            raise TooLarge(
                f"the state takes {format_size(size)}: more than {format_size(self.limit // 2)}, half of the "
                f"{format_size(self.limit)} a rank may hold (two copies of its state; --checkpoint-memory)"
            )

    async def free_slot(self, rank: RankSlots, size: int) -> Slot:
        """The slot the next checkpoint of ``rank`` goes into: not its latest, not read now (a third one only while
        the other is read and the bound has room; else that read is stopped)."""
        for slot in rank.slots:
            if slot is not rank.latest and not slot.reads:
                return slot
        if len(rank.slots) < 2 or (len(rank.slots) < 3 and 3 * size <= self.limit):
            slot = Slot(self._next_slot)
            self._next_slot += 1
            rank.slots.append(slot)
            return slot
        busy = next(slot for slot in rank.slots if slot is not rank.latest)
        await busy.stop_reads()  # a replica or a persisting of an older step: done again with the newer one
        return busy

    def ahead(self, rank: RankSlots, size: int) -> Slot | None:
        """After ``rank``'s first checkpoint, the slot its second goes into, made now (its pages left for the worker
        to allocate between the two saves, so that the second costs a copy as every later one does); ``None`` when
        the rank has it already."""
        if len(rank.slots) != 1:
            return None
        slot = Slot(self._next_slot)
        self._next_slot += 1
        slot.ahead(size)
        rank.slots.append(slot)
        return slot

    async def receiving(self, ranks: dict[int, RankSlots], rank: int, size: int) -> Slot:
        """A slot of ``rank`` in ``ranks`` (own or replicas), ready for ``size`` bytes from another agent."""
        self.check_size(size)
        slot = await self.free_slot(ranks.setdefault(rank, RankSlots(rank)), size)
        await slot.ensure(size)
        slot.header = None
        return slot

    def holding(self, rank: int, step: int) -> RankSlots | None:
        """The slots of ``rank`` that hold its complete checkpoint of ``step``: its own where this node saved it,
        else the replica."""
        for ranks in (self.own, self.replicas):
            held = ranks.get(rank)
            if held is not None and held.at(step) is not None:
                return held
        return None

    def at(self, rank: int, step: int) -> Slot | None:
        """``rank``'s complete checkpoint of ``step``, own or replica."""
        held = self.holding(rank, step)
        return None if held is None else held.at(step)

    def latest(self, rank: int) -> Slot | None:
        """The latest checkpoint of this node's own ``rank``, if it has one."""
        held = self.own.get(rank)
        return None if held is None else held.latest

    def inventory(self) -> list[Held]:
        """Every complete checkpoint held."""
        return [Held(rank.rank, slot.header.step, slot.header.world, slot.header.total)
                for ranks in (self.own, self.replicas) for rank in ranks.values()
                for slot in rank.complete() if slot.header is not None]  # fmt: skip

    def steps(self, replicas: bool = False) -> dict[int, tuple[int, ...]]:
        """The complete steps held for each own rank (``replicas``: each replica's)."""
        ranks = self.replicas if replicas else self.own
        return {r: tuple(sorted(s.header.step for s in h.complete() if s.header)) for r, h in sorted(ranks.items())}

    def memory(self) -> int:
        """The bytes of memory files held."""
        return sum(h.memory() for h in (*self.own.values(), *self.replicas.values()))

    def keep_up_to(self, step: int | None) -> None:
        """Drop what is newer than the round's restore ``step`` (``None``: it restores nothing from memory), and
        the replicas older than it, which are never restored from again."""
        for rank in self.own.values():
            rank.forget_newer(step)
        for replica in self.replicas.values():
            replica.forget_newer(step)
            for slot in replica.complete():
                if slot.header is not None and slot.header.step != step:
                    slot.header = None
            replica.latest = replica.at(step) if step is not None else None

    def close(self) -> None:
        """Release every memory file."""
        for ranks in (self.own, self.replicas):
            for rank in ranks.values():
                rank.close()
            ranks.clear()
