"""The small protocol every dynamic-rendezvous backend driver implements.

Three things, and nothing about rendezvous semantics (those live in ``rendezvous/state.py``):

* **versioned state**: read the encoded state with its version; compare-and-set it against the version read;
  wait until the version moves past one already seen (event driven: a server-side WAIT, an etcd watch);
* **join requests**: append a small request beside the state (``request_join``). A read returns the requests
  pending since the last write, in order; a compare-and-set succeeds only if no request was appended since the
  read it was decided on, and then consumes them (the handler folds them into the state it writes). Appending
  does not count as a change for ``wait_for_change``: N joins cost O(N) small writes, not O(N) wake-ups of
  every waiter (``rendezvous/state.py`` says why, ``fold_joins`` how);
* **liveness**: a node proves it is alive with one small write per interval (``keep_alive``), and the backend
  judges who stopped (``find_dead``) without comparing clocks of different hosts: the store driver watches
  each node's heartbeat counter on the observer's own monotonic clock; etcd lets the server expire leases;
* **a store** shared by the members, from which each round's private store view is cut.

A backend is also a :class:`StateReader`: ``aelastic status`` reads the state through it (``read_state``, which
must create nothing) and waits for its changes, without joining. A third-party backend registers an opener
(:func:`~aelastic.rendezvous.registry.register_backend`) that builds a handler over its driver with
:func:`~aelastic.rendezvous.dynamic.open_dynamic_rendezvous`, and checks its driver with the conformance kit
(:mod:`aelastic.rendezvous.testing`).
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import NamedTuple

import anyio

from ...store.api import Store
from ..codec import Digest

__all__ = ["DigestRead", "RendezvousBackend", "StateReader", "Versioned"]


class DigestRead(NamedTuple):
    """One node's read of the newest digest (``state.make_digest``): ``summary`` is ``None`` at version 0 (nothing
    written yet), ``shard`` the position shard that holds the node (``None``: no node is listed)."""

    version: int
    joined: int
    summary: bytes | None
    shard: bytes | None


class Versioned(NamedTuple):
    """The encoded state at one version; ``data is None`` while nothing was ever written (version 0)."""

    version: int
    data: bytes | None
    token: object = None  # what the backend needs to compare-and-set against this version
    pending: tuple[bytes, ...] = ()  # join requests appended since this version was written, oldest first
    joined: int = 0  # join requests consumed by the writes up to this version (backends with digests count them)

    def __repr__(self) -> str:
        size = 0 if self.data is None else len(self.data)
        return f"Versioned(version={self.version}, {size} bytes, {len(self.pending)} pending join request(s))"


class StateReader(abc.ABC):
    """A read-only view of one run id's shared rendezvous state, for ``aelastic status``: it joins nothing, writes
    nothing and creates no key."""

    @abc.abstractmethod
    async def read_state(self) -> Versioned:
        """The state now: version 0 (``data`` None, nothing pending) while no node has opened the run; never
        creates what a node would, never blocks on what is missing."""

    @abc.abstractmethod
    async def wait_for_change(self, seen: Versioned) -> Versioned | None:
        """Return once the state has moved past ``seen``'s version (at once if it already has); join requests
        appended meanwhile do not count.

        A backend whose notification carries the new state (an etcd watch event holds the written value) may
        return it: a read of that version that spares the caller one (a write that wins consumes every pending
        request, so it has none; a later request makes the next compare-and-set fail). ``None``: read it."""

    async def read_key(self, key: str) -> bytes | None:
        """A key of the run's store that the nodes wrote (a round's failures), or None: it neither waits nor
        creates. A backend without a store has none."""
        return None


class RendezvousBackend(StateReader):
    """An async driver for one run id's shared rendezvous state."""

    name: str
    store: Store
    location: str  # where the shared state lives, for messages: "the rendezvous store at 10.0.0.1:29400"
    digests: bool = False  # whether it keeps digests (read_digest) and tickets (request_join) for cheap reads
    departures: bool = False  # whether it reports hosts whose connections closed (wait_for_departures)

    @abc.abstractmethod
    async def get_state(self) -> Versioned:
        """The current state."""

    async def read_state(self) -> Versioned:
        """The current state for an observer; a backend whose ``get_state`` may create or block overrides it."""
        return await self.get_state()

    async def read_key(self, key: str) -> bytes | None:
        return await self.store.get(key) if await self.store.check([key]) else None

    @abc.abstractmethod
    async def set_state(self, data: bytes, expected: Versioned, digest: Digest) -> tuple[Versioned, bool]:
        """Write ``data`` as the next version if the state is still at ``expected`` and no join request was
        appended since it was read; the write consumes ``expected.pending``. A backend with digests publishes
        ``digest`` (of ``data``) before the change wakes anyone; others ignore it.

        Returns the state now current and whether this write is it.
        """

    @abc.abstractmethod
    async def request_join(self, request: bytes) -> int | None:
        """Append a join request (one line: no ``\n``); the next read returns it among ``pending``.

        A backend with digests returns the request's ticket: how many requests were appended by the time this
        one was counted, this one included (at least that many are in any read that follows); others ``None``.
        """

    async def read_after_join(self) -> Versioned:
        """The state, read by the node whose :meth:`request_join` just returned, to count its request in. A backend
        whose request read the state back in the same transaction returns that read (the state as of the request:
        it holds the request; a later write makes a decision on it lose its compare-and-set, which reads again);
        others read now (the default)."""
        return await self.get_state()

    async def read_digest(self, node_key: str, known: int) -> DigestRead | None:
        """The newest digest, with the shard of ``node_key``; ``known``: a version known to exist (-1: none).
        ``None`` when this backend keeps no digests, or when the shard was overwritten by a newer version while
        it was read: then read the state."""
        return None

    @abc.abstractmethod
    async def keep_alive(self, node_key: str) -> None:
        """One heartbeat of ``node_key``: a small write of its own, never the shared state."""

    @abc.abstractmethod
    async def find_dead(self, node_keys: Sequence[str], grace: float) -> frozenset[str]:
        """Which of ``node_keys`` have shown no heartbeat for ``grace`` seconds, as this backend judges it."""

    async def wait_for_departures(self) -> frozenset[str]:
        """Wait until the network reports nodes gone: the addresses from which every connection to the backend
        closed and stayed closed for a short grace (the c10d host, which serves the store, can tell). A backend
        with ``departures = False`` never returns; its nodes are found dead by ``find_dead`` alone."""
        await anyio.sleep_forever()
        raise AssertionError("unreachable: sleep_forever returned")
