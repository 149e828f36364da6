"""torch's ``Store`` API over etcd v3 keys: every read-modify-write is a txn, every wait is a watch.

Key layout under ``prefix`` (a ``str``; keys are its UTF-8 bytes):

``<prefix>/kv/<key>``
    the value of ``key``, raw bytes (``add`` keeps a decimal number, as torch does).
``<prefix>/queue/<key>\\0<id>``
    one element of the queue ``key``; ``id`` is random, the order is etcd's create revision. ``\\0`` ends the
    queue name, so queue ``a`` never sees the elements of queue ``a/b``.

Read-modify-writes (``add``, ``append``, ``compare_set``) are compare-and-set loops: read, compute, then a txn that
writes only if the key's ``mod_revision`` (or, for a missing key, its ``version`` 0) is still what was read; the
txn's failure branch reads the key again, so a lost race costs one round trip.

Waits (``get``, ``wait``, ``multi_get``, blocking ``queue_pop``, ``barrier``) read once and, if the condition does
not hold, watch from the revision right after that read: nothing can slip between the read and the watch, and
nothing polls. None of them has a timeout: bound them with ``anyio.fail_after``; cancellation closes the watch.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Sequence

from ..errors import QueueEmptyError, StoreError
from ..store.api import Store, Value, as_bytes
from .client import EtcdClient
from .messages import (
    Compare,
    DeleteOp,
    EventType,
    KeyValue,
    Op,
    PutOp,
    RangeOp,
    SortOrder,
    SortTarget,
    prefix_range_end,
)

__all__ = ["EtcdStore"]

_QUEUE_END = b"\0"

# A read-modify-write step: the current value (None: missing) → (the value to write or None, the result).
Update = Callable[[bytes | None], tuple[bytes | None, bytes]]


class EtcdStore(Store):
    """The torch ``Store`` API over ``client``'s etcd, under ``prefix``; see the module docstring."""

    def __init__(self, client: EtcdClient, prefix: str) -> None:
        self.client = client
        self.prefix = prefix.rstrip("/")
        root = self.prefix.encode()
        self._kv = root + b"/kv/"
        self._queue = root + b"/queue/"

    def __repr__(self) -> str:
        return f"EtcdStore({self.prefix!r}, {self.client!r})"

    def _key(self, key: str) -> bytes:
        return self._kv + key.encode()

    def _queue_prefix(self, key: str) -> bytes:
        return self._queue + key.encode() + _QUEUE_END

    # --- building blocks ----------------------------------------------------------------------------------------

    async def _update(self, key: str, update: Update) -> bytes:
        """Apply ``update`` to ``key`` atomically (a CAS loop); the result of the step that took effect."""
        ekey = self._key(key)
        kv, _ = await self.client.get(ekey)
        while True:
            current = kv.value if kv is not None else None
            desired, result = update(current)
            if desired is None:
                return result
            guard = Compare.mod_revision(ekey, kv.mod_revision) if kv else Compare.version(ekey, 0)
            response = await self.client.txn([guard], [PutOp(ekey, desired)], [RangeOp(ekey)])
            if response.succeeded:
                return result
            kvs = response.range(0).kvs
            kv = kvs[0] if kvs else None

    async def _wait_value(self, ekey: bytes) -> KeyValue:
        """The key once it exists: one read, then a watch from the revision after it."""
        kv, revision = await self.client.get(ekey)
        if kv is not None:
            return kv
        async with self.client.watch(ekey, start_revision=revision + 1) as events:
            async for event in events:
                if event.type is EventType.PUT:
                    return event.kv
        raise StoreError(f"etcd watch of {ekey!r} ended")  # a watch stream only ends by raising

    async def _read_all(self, ekeys: Sequence[bytes], *, count_only: bool = False) -> list[KeyValue | None]:
        """Several keys read at one revision: a txn of counts, or :meth:`EtcdClient.read` of values."""
        ops = [RangeOp(k, count_only=count_only) for k in ekeys]
        if count_only:
            response = await self.client.txn([], ops)
            return [KeyValue(ekey, b"", 0, 0, 1) if response.range(i).count else None for i, ekey in enumerate(ekeys)]
        return [r.kvs[0] if r.kvs else None for r in await self.client.read(ops)]

    # --- the Store API ------------------------------------------------------------------------------------------

    async def set(self, key: str, value: Value) -> None:
        await self.client.put(self._key(key), as_bytes(value))

    async def get(self, key: str) -> bytes:
        """The value of ``key``, waiting (a watch) until it exists. Cancellation closes the watch."""
        return (await self._wait_value(self._key(key))).value

    async def add(self, key: str, amount: int) -> int:
        def step(current: bytes | None) -> tuple[bytes | None, bytes]:
            raw = current if current is not None else b"0"
            try:
                total = int(raw) + amount
            except ValueError:
                raise StoreError(f"add({key!r}): the key holds {raw[:40]!r}, not a decimal integer") from None
            encoded = str(total).encode()
            return encoded, encoded

        return int(await self._update(key, step))

    async def compare_set(self, key: str, expected: Value, desired: Value) -> bytes:
        expected_b, desired_b = as_bytes(expected), as_bytes(desired)

        def step(current: bytes | None) -> tuple[bytes | None, bytes]:
            if current is None:
                # torch: a missing key is set only when nothing was expected; otherwise the answer is `expected`.
                return (desired_b, desired_b) if not expected_b else (None, expected_b)
            if current == expected_b:
                return desired_b, desired_b
            return None, current

        return await self._update(key, step)

    async def wait(self, keys: Sequence[str]) -> None:
        """Return once every key exists (each missing one is waited for by a watch)."""
        ekeys = [self._key(k) for k in keys]
        present = await self._read_all(ekeys, count_only=True)
        for ekey, kv in zip(ekeys, present, strict=True):
            if kv is None:
                await self._wait_value(ekey)

    async def check(self, keys: Sequence[str]) -> bool:
        present = await self._read_all([self._key(k) for k in keys], count_only=True)
        return all(kv is not None for kv in present)

    async def delete_key(self, key: str) -> bool:
        return (await self.client.delete_range(DeleteOp(self._key(key)))).deleted > 0

    async def num_keys(self) -> int:
        return len(await self.list_keys())

    async def append(self, key: str, value: Value) -> None:
        suffix = as_bytes(value)
        await self._update(key, lambda current: ((current or b"") + suffix, b""))

    async def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        ekeys = [self._key(k) for k in keys]
        while True:
            await self.wait(keys)
            kvs = await self._read_all(ekeys)
            if all(kv is not None for kv in kvs):
                return [kv.value for kv in kvs if kv is not None]
            # A key was deleted between the wait and the read: wait again.

    async def multi_set(self, keys: Sequence[str], values: Sequence[Value]) -> None:
        if len(keys) != len(values):
            raise StoreError(f"multi_set: {len(keys)} keys but {len(values)} values")
        ops: list[Op] = [PutOp(self._key(k), as_bytes(v)) for k, v in zip(keys, values, strict=True)]
        if ops:
            await self.client.txn([], ops)

    async def queue_push(self, key: str, value: Value) -> None:
        await self.client.put(self._queue_prefix(key) + secrets.token_hex(8).encode(), as_bytes(value))

    async def queue_pop(self, key: str, *, block: bool = True) -> bytes:
        """Pop the oldest element (a txn delete that only one popper wins); wait by watch if ``block``."""
        head = self._queue_prefix(key)
        end = prefix_range_end(head)
        oldest = RangeOp(head, end, limit=1, sort_target=SortTarget.CREATE, sort_order=SortOrder.ASCEND)
        while True:
            response = await self.client.range(oldest)
            if not response.kvs:
                if not block:
                    raise QueueEmptyError(f"queue {key!r} is empty")
                async with self.client.watch(head, end, start_revision=response.revision + 1) as events:
                    async for event in events:
                        if event.type is EventType.PUT:
                            break
                continue
            kv = response.kvs[0]
            taken = await self.client.txn([Compare.mod_revision(kv.key, kv.mod_revision)], [DeleteOp(kv.key)])
            if taken.succeeded:
                return kv.value
            # Another popper took it: try the next one.

    async def queue_len(self, key: str) -> int:
        head = self._queue_prefix(key)
        return (await self.client.range(RangeOp(head, prefix_range_end(head), count_only=True))).count

    async def list_keys(self) -> list[str]:
        kv = await self.client.range(RangeOp(self._kv, prefix_range_end(self._kv), keys_only=True))
        keys = [item.key[len(self._kv) :].decode(errors="replace") for item in kv.kvs]
        queued = await self.client.range(RangeOp(self._queue, prefix_range_end(self._queue), keys_only=True))
        queues = {item.key[len(self._queue) :].rpartition(_QUEUE_END)[0] for item in queued.kvs}
        keys.extend(sorted(q.decode(errors="replace") for q in queues))
        return keys

    async def barrier(self, key: str, world_size: int) -> None:
        """Count in at ``key``; return once ``world_size`` callers of this generation arrived (reusable)."""
        if world_size < 1:
            raise StoreError(f"barrier({key!r}, world_size={world_size}): world_size must be >= 1")
        arrived = await self.add(key, 1)
        target = -(-arrived // world_size) * world_size  # the end of this caller's generation
        ekey = self._key(key)
        kv, revision = await self.client.get(ekey)
        if kv is not None and int(kv.value) >= target:
            return
        async with self.client.watch(ekey, start_revision=revision + 1) as events:
            async for event in events:
                if event.type is EventType.PUT and int(event.kv.value) >= target:
                    return
