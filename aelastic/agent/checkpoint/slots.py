"""The memory of in-memory checkpoints: memory files (``memfd``) that the agent creates, and the slots of one rank.

A :class:`Slot` is one memory file and the complete checkpoint it holds, if any. A :class:`RankSlots` is a rank's
slots on this agent (its own, or a replica of another node's): the latest complete one, and the others, which the
next checkpoint may be written into. Reading a slot (for a replica, a fetch, the directory) *pins* it: the slot is
not given to a writer while a read is under way; a writer that needs it asks the reads to stop
(:meth:`Slot.stop_reads`) and waits for them, and a stopped read is done again with the newer checkpoint.

A memory file is released when its last descriptor closes: the agent's, when the slot is closed or replaced by a
larger one, or when the agent dies, however it dies.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from typing import Final

import anyio

from ...worker._checkpoint.layout import HEADER_SIZE, Header

__all__ = ["GRANULE", "RankSlots", "Read", "Slot", "format_size"]

GRANULE: Final = 1 << 20  # slots grow in whole MiB: a state a little larger reuses no memory


def format_size(size: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{size} B"


class Read:
    """One read of a slot under way; ``stop`` asks it to stop (it is checked between chunks, also in threads)."""

    __slots__ = ("stop",)

    def __init__(self) -> None:
        self.stop = threading.Event()


class Slot:
    """One memory file: its size, its generation (bumped when a larger file replaces it), the complete checkpoint
    it holds (``header``), the worker writing it (``writer``, a pid), and the reads of it under way."""

    __slots__ = ("_released", "capacity", "fd", "generation", "header", "id", "reads", "writer")

    def __init__(self, slot_id: int) -> None:
        self.id = slot_id
        self.fd = -1
        self.capacity = 0
        self.generation = 0
        self.header: Header | None = None
        self.writer: int | None = None
        self.reads: set[Read] = set()
        self._released: anyio.Event | None = None

    def __repr__(self) -> str:
        step = None if self.header is None else self.header.step
        return f"<slot {self.id} step={step} capacity={self.capacity} writer={self.writer} reads={len(self.reads)}>"

    async def ensure(self, size: int) -> None:
        """Make the slot's memory file at least ``size`` bytes: a new one, its pages allocated (and zeroed) now,
        in a thread, so that copies into it cost what every later one does instead of a page fault per 4 KiB."""
        if self.capacity >= size:
            return
        fd = self._file(size)
        try:
            await anyio.to_thread.run_sync(os.posix_fallocate, fd, 0, self.capacity)
        except BaseException:
            self.close()
            raise

    def ahead(self, size: int) -> None:
        """Make the slot's memory file ``size`` bytes, its pages allocated by the first process that maps them
        (a worker, in a thread of its own, between two saves: see ``aelastic.worker._checkpoint.api``)."""
        self._file(size)

    def _file(self, size: int) -> int:
        capacity = -(-size // GRANULE) * GRANULE
        fd = os.memfd_create(f"aelastic-checkpoint-{self.id}", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, capacity)
        except BaseException:
            os.close(fd)
            raise
        self.close()
        self.fd, self.capacity, self.generation = fd, capacity, self.generation + 1
        return fd

    def read_header(self) -> Header:
        """The header the writer wrote last (raises :class:`~aelastic.worker._checkpoint.layout.LayoutError` if it is
        not complete)."""
        return Header.decode(os.pread(self.fd, HEADER_SIZE, 0))

    @contextlib.contextmanager
    def reading(self) -> Iterator[Read]:
        """Pin the slot for one read (see the module doc)."""
        if not self.reads:
            self._released = anyio.Event()
        read = Read()
        self.reads.add(read)
        try:
            yield read
        finally:
            self.reads.discard(read)
            if not self.reads and self._released is not None:
                self._released.set()

    async def stop_reads(self) -> None:
        """Ask every read of the slot to stop, and wait until none is left."""
        for read in self.reads:
            read.stop.set()
        if self.reads and self._released is not None:
            await self._released.wait()

    def close(self) -> None:
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            os.close(fd)
        self.capacity = 0


class RankSlots:
    """The slots of one rank on this agent (see the module doc); ``source`` says where its latest came from:
    ``"memory"`` (this node's worker saved it) or ``"replica from HOST:PORT"``."""

    __slots__ = ("latest", "rank", "slots", "source")

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.slots: list[Slot] = []
        self.latest: Slot | None = None
        self.source = "memory"

    def __repr__(self) -> str:
        return f"<rank {self.rank} slots={self.slots} latest={self.latest and self.latest.id}>"

    def complete(self) -> list[Slot]:
        return [slot for slot in self.slots if slot.header is not None]

    def at(self, step: int) -> Slot | None:
        """The complete slot of ``step``, if held."""
        return next((s for s in self.slots if s.header is not None and s.header.step == step), None)

    def commit(self, slot: Slot, header: Header, source: str) -> None:
        slot.header, slot.writer = header, None
        self.latest, self.source = slot, source

    def forget_newer(self, step: int | None) -> None:
        """Drop the checkpoints newer than ``step`` (``None``: all): they will never be restored from."""
        for slot in self.slots:
            if slot.header is not None and (step is None or slot.header.step > step):
                slot.header = None
        complete = self.complete()
        self.latest = max(complete, key=lambda s: s.header.step if s.header else -1) if complete else None

    def memory(self) -> int:
        return sum(slot.capacity for slot in self.slots)

    def close(self) -> None:
        for slot in self.slots:
            slot.close()
        self.slots.clear()
        self.latest = None
