"""The rendezvous driver over a TCPStore-protocol store (the ``c10d`` backend's engine).

Keys, under ``aelastic.rendezvous/<run_id>/``:

``state``
    ``b"<version> <joined>\\n<encoded state>"`` (``joined``: the join requests the writes up to this version
    consumed); created empty (version 0) when the driver opens, so reading never blocks.
    Join requests are APPENDed to it, each as ``b"\\n<request>"``: one read returns the state and its pending
    requests together. Writes are COMPARE_SET against the exact bytes read, so a request appended since makes the
    write fail (and the failed write returns it); the version inside makes every value unique, so a CAS cannot
    succeed against a look-alike older value (no ABA).
``tickets``
    a counter each join request ADDs to right after its APPEND: the result is the request's ticket (at least that
    many requests are in any later read of ``state``), from which a node tells, without reading the state, whether
    its request is the one that completes the round or brings it to ``min_nodes`` (and so must be published).
``pos/<version % 3>/<i>``
    the digest's position shards (``state.make_digest``), each headed by ``<version>\\n``; written by the winner
    of a CAS before it announces the version. Three slots, overwritten in turn, bound their memory: a reader that
    finds a newer version in its slot reads the state instead.
``latest``
    the version last announced, in the same MULTI_SET as its ``changed/<version>`` (which the server applies as
    one request): where a node that knows no version reads the newest digest.
``changed/<version>``
    ``b"<joined> <shards>\\n<summary>"``, set by the writer right after its CAS wins and its shards are written.
    Waiting for a change is a server-side WAIT on the next version's key, so one write wakes every waiter at once.
    A writer that dies between its CAS and this SET delays waiters until their next timer (the handler never waits
    longer than the liveness grace).
``alive/<node>``
    each node's heartbeat counter (ADD 1 per interval): O(1) bytes per beat, never a rewrite of the state.
    ``find_dead`` reads counters and remembers, on the observer's monotonic clock, when each last moved.

On the node that serves the store, the driver also hears of the store server's connections closing
(:class:`~.disconnects.DisconnectWatch`): ``wait_for_departures`` returns the addresses whose connections all
closed and stayed closed for the grace, so a node whose agent died is evicted in seconds, not after the keep-alive.
"""

from __future__ import annotations

from collections.abc import Sequence

import anyio

from ...errors import RendezvousStateError
from ...store.api import Store
from ..codec import Digest, shard_of
from .base import DigestRead, RendezvousBackend, Versioned
from .disconnects import DisconnectWatch

_SLOTS = 3  # position-shard slots, used in turn by successive versions
_NO_VALUE = b"\0aelastic: no value\0"  # no rendezvous value starts with NUL

__all__ = ["StoreBackend"]


class StoreBackend(RendezvousBackend):
    digests = True

    def __init__(
        self,
        store: Store,
        run_id: str,
        name: str = "c10d",
        *,
        location: str | None = None,
        disconnects: DisconnectWatch | None = None,
    ) -> None:
        self.name = name
        self.store = store
        self._disconnects = disconnects  # the store server's connection events, on the host that serves it
        self.departures = disconnects is not None
        self.location = location or f"the rendezvous store {store!r}"
        self._keys = store.prefixed(f"aelastic.rendezvous/{run_id}")
        self._heartbeats: dict[str, tuple[bytes | None, float]] = {}

    def __repr__(self) -> str:
        return f"<StoreBackend {self.name} {self._keys!r}>"

    async def initialize(self) -> None:
        await self._keys.compare_set("state", b"", b"0 0\n")
        await self._keys.compare_set("latest", b"", b"0")

    @staticmethod
    def _parse(raw: bytes) -> Versioned:
        head, sep, rest = raw.partition(b"\n")
        version, _, joined = head.partition(b" ")
        if not sep or not version.isdigit() or not joined.isdigit():
            raise RendezvousStateError(
                f"rendezvous state key holds {raw[:40]!r}: not '<version> <joined>\\n<state>' "
                "(are all nodes running the same aelastic version?)"
            )
        body, *pending = rest.split(b"\n")
        return Versioned(int(version), body if int(version) else None, raw, tuple(pending), int(joined))

    async def get_state(self) -> Versioned:
        return self._parse(await self._keys.get("state"))

    async def read_state(self) -> Versioned:
        """The current state for an observer (``aelastic status``): never creates the key, never blocks on it;
        version 0 while no node has opened this run."""
        if not await self._keys.check(["state"]):
            return Versioned(0, None)
        return await self.get_state()

    async def set_state(self, data: bytes, expected: Versioned, digest: Digest) -> tuple[Versioned, bool]:
        if not isinstance(expected.token, bytes):
            raise RendezvousStateError(f"{expected!r} was not read from this backend")
        version, joined = expected.version + 1, expected.joined + len(expected.pending)
        desired = b"%d %d\n%b" % (version, joined, data)
        current = await self._keys.compare_set("state", expected.token, desired)
        if current != desired:
            return self._parse(current), False
        # One MULTI_SET, applied in order by the server: the shards are in place before the change wakes anyone.
        slot = version % _SLOTS
        shards = len(digest.shards)
        await self._keys.multi_set(
            [*(f"pos/{slot}/{i}" for i in range(shards)), f"changed/{version}", "latest"],
            [
                *(b"%d\n%b" % (version, shard) for shard in digest.shards),
                b"%d %d\n%b" % (joined, shards, digest.summary),
                b"%d" % version,
            ],
        )
        return Versioned(version, data, desired, (), joined), True

    async def _peek(self, key: str) -> bytes | None:
        """The value of a key (``None``: missing) in one round trip, never blocking: a GET is a WAIT and then a
        GET (a missing key would block it), while a compare-and-set whose expected value no key holds only
        returns the value."""
        value = await self._keys.compare_set(key, _NO_VALUE, _NO_VALUE)
        return None if value == _NO_VALUE else value

    async def _present(self, key: str) -> bytes:
        """The value of a key known to exist."""
        value = await self._peek(key)
        if value is None:  # the key is missing after all (it never is: it was written before announced)
            raise RendezvousStateError(f"rendezvous key {key!r} is missing from {self.location}")
        return value

    async def request_join(self, request: bytes) -> int:
        await self._keys.append("state", b"\n" + request)
        return await self._keys.add("tickets", 1)

    async def read_digest(self, node_key: str, known: int) -> DigestRead | None:
        # No look further ahead: a version announced after this read wakes the node's next wait at once.
        version = known if known >= 0 else int(await self._present("latest"))
        if version == 0:
            return DigestRead(0, 0, None, None)
        head, _, summary = (await self._present(f"changed/{version}")).partition(b"\n")
        joined, _, shards = head.partition(b" ")
        raw = await self._present(f"pos/{version % _SLOTS}/{shard_of(node_key, int(shards))}")
        written, _, shard = raw.partition(b"\n")
        if int(written) != version:
            return None
        return DigestRead(version, int(joined), summary, shard)

    async def wait_for_change(self, seen: Versioned) -> None:
        await self._keys.wait([f"changed/{seen.version + 1}"])

    async def wait_for_departures(self) -> frozenset[str]:
        if self._disconnects is None:
            return await super().wait_for_departures()
        return await self._disconnects.wait_gone()

    async def keep_alive(self, node_key: str) -> None:
        await self._keys.add(f"alive/{node_key}", 1)

    async def find_dead(self, node_keys: Sequence[str], grace: float) -> frozenset[str]:
        # One non-blocking read per node (a node checks one neighbour): a counter that was never written (its
        # node died before its first beat) must count as still, not block the checker's liveness.
        counters = [await self._peek(f"alive/{key}") for key in node_keys]
        now = anyio.current_time()
        dead = set()
        for key, counter in zip(node_keys, counters, strict=True):
            last = self._heartbeats.get(key)
            if last is None or last[0] != counter:
                self._heartbeats[key] = (counter, now)
            elif now - last[1] > grace:
                dead.add(key)
        return frozenset(dead)
