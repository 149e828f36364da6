"""A standby's heap, touched ahead for its worker's training state (glibc's ``malloc``).

A worker that replaces a failed one allocates its state again (the model, the optimizer's moments) before it loads the
checkpoint into it. Large allocations are fresh ``mmap``\\ s, so every page of them faults and the kernel zeroes it, on
the path from the fault to the next step. Memory that the process touched before costs only the state's own
initialisation (a ``memset``).

So an idle standby (:mod:`aelastic.agent.prewarm`), once told the size of the largest state in host memory that a
worker of the node saved (:meth:`aelastic.agent.prewarm.parent.Standbys.warm`), has ``malloc`` serve large blocks
from its heap (``M_MMAP_MAX`` 0) and keep what is freed (``M_TRIM_THRESHOLD``), then allocates that many bytes,
touches them and frees them: the worker it becomes finds them resident at the top of its heap. The touching runs at
the standby's priority (idle beside running workers) and stops at once when the assignment arrives, so a restart
never waits for it.

A restartable worker (``aelastic.worker.restartable``) :func:`keep`\\ s large blocks in its heap for its life: a
survivor's next round allocates again the state its last one freed, and finds that memory resident instead of
faulting in fresh mappings page by page, on the restart's critical path. The price: the process's resident memory
stays at its peak.

The worker's first ``aelastic.checkpoint`` call (its state exists by then) :func:`settle`\\ s ``malloc`` again:
large blocks are mappings again, above a fixed 32 MiB threshold that ``free`` keeps up to 64 MiB of. That is where
glibc's own adaptive threshold ends once the process has freed a block of 32 MiB, as a training process does in its
first steps; setting any of these parameters stops the adaptation. Where the C library is not glibc (or a
``LD_PRELOAD``\\ ed allocator answers ``mallopt`` with an error) nothing is warmed.

Standard library only: a standby imports it (a standby's modules must be its worker's).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Final

__all__ = ["keep", "settle", "warm"]

_M_TRIM_THRESHOLD: Final = -1
_M_MMAP_THRESHOLD: Final = -3
_M_MMAP_MAX: Final = -4
_MMAP_MAX_DEFAULT: Final = 65536
_SETTLED_THRESHOLD: Final = 32 << 20  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit systems
_CHUNK: Final = 8 << 20  # touched between two looks at the control socket: a few milliseconds

_warmed = False
_kept = False


def _glibc() -> ctypes.CDLL | None:
    libc = ctypes.CDLL(None)
    if not hasattr(libc, "gnu_get_libc_version"):
        return None
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return libc


def warm(size: int, interrupted: Callable[[], bool]) -> int:
    """Leave ``size`` bytes touched at the top of this process's heap, stopping early when ``interrupted()``;
    the bytes touched (0 where ``malloc`` is not glibc's)."""
    global _warmed
    libc = _glibc()
    if libc is None or not (libc.mallopt(_M_MMAP_MAX, 0) and libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1)):
        return 0
    _warmed = True
    block = libc.malloc(size)
    if not block:
        return 0
    touched = 0
    try:
        while touched < size and not interrupted():
            length = min(_CHUNK, size - touched)
            ctypes.memset(block + touched, 0, length)
            touched += length
    finally:
        libc.free(block)
    return touched


def keep() -> None:
    """Serve large blocks from the heap and keep what is freed, for the process's life (see the module doc); nothing
    where ``malloc`` is not glibc's."""
    global _kept
    libc = _glibc()
    _kept = libc is not None and bool(libc.mallopt(_M_MMAP_MAX, 0) and libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))


def settle() -> None:
    """Back to mapping large blocks (see the module doc); nothing if this process warmed nothing, or keeps its
    blocks."""
    global _warmed
    if not _warmed:
        return
    _warmed = False
    if _kept:
        return
    libc = _glibc()
    assert libc is not None, "warmed without glibc"
    libc.mallopt(_M_MMAP_THRESHOLD, _SETTLED_THRESHOLD)
    libc.mallopt(_M_TRIM_THRESHOLD, 2 * _SETTLED_THRESHOLD)
    libc.mallopt(_M_MMAP_MAX, _MMAP_MAX_DEFAULT)
