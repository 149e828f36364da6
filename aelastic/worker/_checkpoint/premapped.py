"""A rank's checkpoint slots, mapped by a standby ahead of the worker that will load from them.

A worker that replaces a failed one maps the slot it restores from, and every page of it then faults on the copy out, on
the path from the fault to the next step, where the rest of the restart competes for the CPUs. So the agent hands an
idle standby (:mod:`aelastic.agent.prewarm`) the memory files of the slots of the rank its local rank held
(:meth:`aelastic.agent.prewarm.parent.Standbys.map_slots`, again whenever a slot is replaced by a larger one), and the
standby maps them and fills their page tables, a chunk at a time at its own priority, stopping at once when its
assignment arrives. The worker it becomes takes these mappings as its own (:func:`take`) if it has that rank: its
restore is then a memory copy, and so is its first save. Mapped for another rank, they are closed.

Standard library only: a standby imports it (a standby's modules must be its worker's).
"""

from __future__ import annotations

import contextlib
import mmap
from collections.abc import Callable, Iterator, Sequence
from typing import Final, NamedTuple

__all__ = ["fill", "map_slots", "take"]

_MADV_POPULATE_WRITE: Final = 23  # Linux 5.14; older kernels map the pages at the worker's first touch instead
_CHUNK: Final = 16 << 20  # filled between two looks at the control socket: a few milliseconds


class _Mapped(NamedTuple):
    rank: int
    slots: dict[int, tuple[int, mmap.mmap]]  # slot id -> (generation, mapping)
    chunks: Iterator[None]  # fills the page tables, a chunk per step


_mapped: _Mapped | None = None


def map_slots(rank: int, slots: Sequence[tuple[int, int, int]], fds: Sequence[int]) -> None:
    """Map ``slots`` (``(slot, generation, capacity)``, each with its memory file in ``fds``) of ``rank``'s
    checkpoints in place of any mapped before; :func:`fill` fills their page tables."""
    global _mapped
    if _mapped is not None:
        _close(_mapped)
    mappings: dict[int, tuple[int, mmap.mmap]] = {}
    for (slot, generation, capacity), fd in zip(slots, fds, strict=True):
        with contextlib.suppress(OSError):  # out of address space or map count: the worker maps it at its load
            mappings[slot] = generation, mmap.mmap(fd, capacity, flags=mmap.MAP_SHARED,
                                                   prot=mmap.PROT_READ | mmap.PROT_WRITE)  # fmt: skip
    _mapped = _Mapped(rank, mappings, _chunks([mapping for _, mapping in mappings.values()]))


def _chunks(mappings: list[mmap.mmap]) -> Iterator[None]:
    for mapping in mappings:
        with contextlib.suppress(OSError):  # no MADV_POPULATE_WRITE: mapped at the first touch
            for start in range(0, len(mapping), _CHUNK):
                mapping.madvise(_MADV_POPULATE_WRITE, start, min(_CHUNK, len(mapping) - start))
                yield


def fill(interrupted: Callable[[], bool]) -> bool:
    """Fill the mapped slots' page tables, from where the last call stopped, until ``interrupted()``; whether
    they are all filled."""
    if _mapped is None:
        return True
    while not interrupted():
        if next(_mapped.chunks, StopIteration) is StopIteration:
            return True
    return False


def take(rank: int) -> dict[int, tuple[int, mmap.mmap]]:
    """The slots mapped ahead, by slot id (``(generation, mapping)``), if mapped for ``rank``; else none (those
    mapped for another rank are closed)."""
    global _mapped
    mapped, _mapped = _mapped, None
    if mapped is None:
        return {}
    if mapped.rank != rank:
        _close(mapped)
        return {}
    return mapped.slots


def _close(mapped: _Mapped) -> None:
    for _, mapping in mapped.slots.values():
        mapping.close()
