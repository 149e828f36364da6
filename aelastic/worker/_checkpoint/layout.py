"""The bytes of one checkpoint of one rank: the same in the agent's shared memory, in a replica and on disk.

::

    [0, 4096)                 the header (below), then zeros
    [4096, 4096 + data)       the raw bytes of every tensor (and numpy array), each at a multiple of 64
    [meta offset, + meta)     the metadata: UTF-8 JSON, what to make of the data (:mod:`.tree`, :mod:`.dcp`)

The header is written last, so a checkpoint whose writer died midway is never taken for a complete one; the agent
reads it back at the commit and trusts nothing the worker did not finish. Everything is little-endian. A change of
layout changes :data:`VERSION`; a reader refuses other versions by name.

Standard library only: the agent (which never imports torch) reads and writes these bytes too.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Final

__all__ = ["ALIGN", "DATA_OFFSET", "HEADER_SIZE", "KINDS", "VERSION", "Header", "LayoutError", "place"]

MAGIC: Final = b"AELCKPT\0"
VERSION: Final = 1
HEADER_SIZE: Final = 4096
DATA_OFFSET: Final = HEADER_SIZE
ALIGN: Final = 64  # every tensor starts here: any dtype's alignment, and a cache line
KINDS: Final = ("state", "dcp")  # aelastic.checkpoint.save's, and a torch.distributed.checkpoint rank's

_STRUCT: Final = struct.Struct("<8sIIqIIQQQQ")


class LayoutError(ValueError):
    """Bytes that are not a complete checkpoint of this layout; the message says what is wrong."""


@dataclass(frozen=True, slots=True)
class Header:
    """What the first bytes of a checkpoint say.

    Attributes:
        kind: one of :data:`KINDS`.
        step: the training step the checkpoint is of (the caller's number).
        rank: the global rank that saved it; ``world``: the world size then.
        data_size: bytes of tensor data after :data:`DATA_OFFSET`.
        meta_offset, meta_size: where the JSON metadata lies.
    """

    kind: str
    step: int
    rank: int
    world: int
    data_size: int
    meta_offset: int
    meta_size: int

    @property
    def total(self) -> int:
        """The checkpoint's size in bytes, header included."""
        return self.meta_offset + self.meta_size

    def encode(self) -> bytes:
        return _STRUCT.pack(
            MAGIC, VERSION, KINDS.index(self.kind), self.step, self.rank, self.world, DATA_OFFSET,
            self.data_size, self.meta_offset, self.meta_size,
        )  # fmt: skip

    @classmethod
    def decode(cls, data: bytes | memoryview) -> Header:
        """The header at the start of ``data``.

        Raises:
            LayoutError: not a checkpoint header, another version, or sizes that do not add up.
        """
        if len(data) < _STRUCT.size:
            raise LayoutError(f"{len(data)} bytes: shorter than a checkpoint header ({_STRUCT.size})")
        magic, version, kind, step, rank, world, data_offset, data_size, meta_offset, meta_size = _STRUCT.unpack_from(
            data
        )
        if magic != MAGIC:
            raise LayoutError("no checkpoint header (a write that never completed, or not aelastic's)")
        if version != VERSION:
            raise LayoutError(f"checkpoint layout version {version}: this aelastic reads version {VERSION}")
        if kind >= len(KINDS) or data_offset != DATA_OFFSET or meta_offset < DATA_OFFSET + data_size:
            raise LayoutError(f"a checkpoint header whose fields do not add up (kind {kind}, meta at {meta_offset})")
        return cls(KINDS[kind], step, rank, world, data_size, meta_offset, meta_size)


def place(sizes: list[int], start: int = DATA_OFFSET) -> tuple[list[int], int]:
    """The offsets of blobs of ``sizes`` bytes in the data area, from ``start`` on, and the data area's size."""
    offsets = []
    end = start
    for size in sizes:
        offsets.append(end)
        end += -(-size // ALIGN) * ALIGN
    return offsets, end - DATA_OFFSET
