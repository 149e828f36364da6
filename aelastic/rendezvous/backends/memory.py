"""An in-process backend, for tests and for nodes simulated as tasks of one event loop.

Every handler opened with the same ``MemoryRendezvous`` shares its state. Liveness: a node is dead when it has
not beaten for ``grace`` seconds of this loop's clock. Round stores are cut from the store the caller passes
(tests pass a client of a real aelastic store server, so round stores behave as in production).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

import anyio

from ...store.api import Store
from ..api import JoinObserver, RendezvousHandler, RendezvousParameters
from ..codec import Digest
from ..dynamic import open_dynamic_rendezvous
from ..settings import DYNAMIC_KEYS, READ_TIMEOUT, HandlerOptions, TimingSettings, key_names
from ..values import NodeDesc
from .base import RendezvousBackend, Versioned

__all__ = ["MemoryBackend", "MemoryRendezvous", "open_memory_rendezvous"]


class MemoryRendezvous:
    """The shared state of one in-memory rendezvous (one per run id)."""

    def __init__(self) -> None:
        self.current = Versioned(0, None)
        self.changed = anyio.Event()
        self.beats: dict[str, float] = {}
        self.local_ids = itertools.count()

    def __repr__(self) -> str:
        return f"<MemoryRendezvous version={self.current.version} nodes_beating={len(self.beats)}>"


class MemoryBackend(RendezvousBackend):
    def __init__(self, shared: MemoryRendezvous, store: Store) -> None:
        self.name = "memory"
        self.location = "the in-memory rendezvous"
        self.store = store
        self._shared = shared

    def __repr__(self) -> str:
        return f"<MemoryBackend {self._shared!r}>"

    async def get_state(self) -> Versioned:
        await anyio.lowlevel.checkpoint()
        return self._shared.current

    async def set_state(self, data: bytes, expected: Versioned, digest: Digest) -> tuple[Versioned, bool]:
        await anyio.lowlevel.checkpoint()
        shared = self._shared
        # Requests are only ever appended between writes: the same version and count means the same requests.
        if (shared.current.version, len(shared.current.pending)) != (expected.version, len(expected.pending)):
            return shared.current, False
        shared.current = Versioned(expected.version + 1, data)
        shared.changed.set()
        shared.changed = anyio.Event()
        return shared.current, True

    async def request_join(self, request: bytes) -> None:
        await anyio.lowlevel.checkpoint()
        current = self._shared.current
        self._shared.current = current._replace(pending=(*current.pending, request))

    async def wait_for_change(self, seen: Versioned) -> None:
        while self._shared.current.version <= seen.version:
            await self._shared.changed.wait()

    async def keep_alive(self, node_key: str) -> None:
        await anyio.lowlevel.checkpoint()
        self._shared.beats[node_key] = anyio.current_time()

    async def find_dead(self, node_keys: Sequence[str], grace: float) -> frozenset[str]:
        await anyio.lowlevel.checkpoint()
        now = anyio.current_time()
        return frozenset(k for k in node_keys if now - self._shared.beats.get(k, now) > grace)


@asynccontextmanager
async def open_memory_rendezvous(
    shared: MemoryRendezvous, params: RendezvousParameters, store: Store, *, observer: JoinObserver | None = None
) -> AsyncIterator[RendezvousHandler]:
    """A dynamic-rendezvous handler over ``shared``; ``params.config`` takes the timing keys and ``read_timeout``."""
    params.warn_unknown(key_names(DYNAMIC_KEYS))
    timing = TimingSettings.from_parameters(params)
    node = NodeDesc(params.local_addr or "127.0.0.1", os.getpid(), next(shared.local_ids))
    options = HandlerOptions(
        "memory",
        node.addr,
        timing.heartbeat_timeout,
        READ_TIMEOUT.read(params),
        observer=observer,
        share_store=params.share_store,
    )
    async with open_dynamic_rendezvous(node, timing.rendezvous, MemoryBackend(shared, store), options) as handler:
        yield handler
