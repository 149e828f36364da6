"""The rendezvous driver over a TCPStore-protocol store (the ``c10d`` backend's engine).

Keys, under ``aelastic.rendezvous/<run_id>/``:

``state``
    ``b"<version>\\n<encoded state>"``; created empty (version 0) when the driver opens, so reading never blocks.
    Join requests are APPENDed to it, each as ``b"\\n<request>"``: one read returns the state and its pending
    requests together. Writes are COMPARE_SET against the exact bytes read, so a request appended since makes the
    write fail (and the failed write returns it); the version inside makes every value unique, so a CAS cannot
    succeed against a look-alike older value (no ABA).
``changed/<version>``
    set by the writer right after its CAS wins. Waiting for a change is a server-side WAIT on the next version's
    key, so one write wakes every waiter at once. A writer that dies between its CAS and this SET delays waiters
    until their next timer (the handler never waits longer than a keep-alive interval).
``alive/<node>``
    each node's heartbeat counter (ADD 1 per interval): O(1) bytes per beat, never a rewrite of the state.
    ``find_dead`` reads counters and remembers, on the observer's monotonic clock, when each last moved.
"""

from __future__ import annotations

from collections.abc import Sequence

import anyio

from ...errors import RendezvousStateError
from ...store.api import Store
from .base import RendezvousBackend, Versioned

__all__ = ["StoreBackend"]


class StoreBackend(RendezvousBackend):
    def __init__(self, store: Store, run_id: str, name: str = "c10d", *, location: str | None = None) -> None:
        self.name = name
        self.store = store
        self.location = location or f"the rendezvous store {store!r}"
        self._keys = store.prefixed(f"aelastic.rendezvous/{run_id}")
        self._heartbeats: dict[str, tuple[bytes, float]] = {}

    def __repr__(self) -> str:
        return f"<StoreBackend {self.name} {self._keys!r}>"

    async def initialize(self) -> None:
        await self._keys.compare_set("state", b"", b"0\n")

    @staticmethod
    def _parse(raw: bytes) -> Versioned:
        head, sep, rest = raw.partition(b"\n")
        if not sep or not head.isdigit():
            raise RendezvousStateError(f"rendezvous state key holds {raw[:40]!r}: not '<version>\\n<state>'")
        version = int(head)
        body, *pending = rest.split(b"\n")
        return Versioned(version, body if version else None, raw, tuple(pending))

    async def get_state(self) -> Versioned:
        return self._parse(await self._keys.get("state"))

    async def read_state(self) -> Versioned:
        """The current state for an observer (``aelastic status``): never creates the key, never blocks on it;
        version 0 while no node has opened this run."""
        if not await self._keys.check(["state"]):
            return Versioned(0, None)
        return await self.get_state()

    async def set_state(self, data: bytes, expected: Versioned) -> tuple[Versioned, bool]:
        if not isinstance(expected.token, bytes):
            raise RendezvousStateError(f"{expected!r} was not read from this backend")
        version = expected.version + 1
        desired = b"%d\n%b" % (version, data)
        current = await self._keys.compare_set("state", expected.token, desired)
        if current != desired:
            return self._parse(current), False
        await self._keys.set(f"changed/{version}", b"")
        return Versioned(version, data, desired), True

    async def request_join(self, request: bytes) -> None:
        await self._keys.append("state", b"\n" + request)

    async def wait_for_change(self, seen: Versioned) -> None:
        await self._keys.wait([f"changed/{seen.version + 1}"])

    async def keep_alive(self, node_key: str) -> None:
        await self._keys.add(f"alive/{node_key}", 1)

    async def find_dead(self, node_keys: Sequence[str], grace: float) -> frozenset[str]:
        if not node_keys:
            return frozenset()
        counters = await self._keys.multi_get([f"alive/{key}" for key in node_keys])
        now = anyio.current_time()
        dead = set()
        for key, counter in zip(node_keys, counters, strict=True):
            last = self._heartbeats.get(key)
            if last is None or last[0] != counter:
                self._heartbeats[key] = (counter, now)
            elif now - last[1] > grace:
                dead.add(key)
        return frozenset(dead)
