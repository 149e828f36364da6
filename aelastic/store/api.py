"""The store interface every backend implements (torch's ``Store`` API, made async) and the prefixed view.

Keys are ``str``; values are ``bytes`` (``str`` values are encoded as UTF-8, like torch's Python binding).
``get``/``wait``/``barrier`` block until their condition holds; they carry no timeout of their own: bound them
with the caller's cancel scope (``with anyio.fail_after(...)``).
"""

from __future__ import annotations

import abc
from collections.abc import Sequence

__all__ = ["PrefixStore", "Store", "Value", "as_bytes"]

Value = bytes | str


def as_bytes(value: Value) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


class Store(abc.ABC):
    """An async key-value store with torch's ``Store`` semantics."""

    @abc.abstractmethod
    async def set(self, key: str, value: Value) -> None:
        """Store ``value`` under ``key`` and wake everyone waiting for it."""

    @abc.abstractmethod
    async def get(self, key: str) -> bytes:
        """The value of ``key``, waiting until it exists."""

    @abc.abstractmethod
    async def add(self, key: str, amount: int) -> int:
        """Add ``amount`` to the decimal counter at ``key`` (0 if missing) and return the new value."""

    @abc.abstractmethod
    async def compare_set(self, key: str, expected: Value, desired: Value) -> bytes:
        """Set ``key`` to ``desired`` if it holds ``expected`` (or is missing and ``expected`` is empty).

        Returns the value now stored, so the write won iff the result equals ``desired``. torch's quirk is kept:
        a missing key with a non-empty ``expected`` returns ``expected`` and writes nothing.
        """

    @abc.abstractmethod
    async def wait(self, keys: Sequence[str]) -> None:
        """Return once every key in ``keys`` exists."""

    @abc.abstractmethod
    async def check(self, keys: Sequence[str]) -> bool:
        """Whether every key in ``keys`` exists, without waiting."""

    @abc.abstractmethod
    async def delete_key(self, key: str) -> bool:
        """Delete ``key``; whether it existed."""

    @abc.abstractmethod
    async def num_keys(self) -> int:
        """How many keys the whole store holds (torch counts keys of every prefix)."""

    @abc.abstractmethod
    async def append(self, key: str, value: Value) -> None:
        """Append ``value`` to the value at ``key`` (creating it)."""

    @abc.abstractmethod
    async def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        """The values of ``keys``, waiting until all exist."""

    @abc.abstractmethod
    async def multi_set(self, keys: Sequence[str], values: Sequence[Value]) -> None:
        """Set several keys at once."""

    @abc.abstractmethod
    async def queue_push(self, key: str, value: Value) -> None:
        """Push ``value`` on the queue ``key``."""

    @abc.abstractmethod
    async def queue_pop(self, key: str, *, block: bool = True) -> bytes:
        """Pop the front of the queue ``key``; wait for one if ``block``, else raise ``QueueEmptyError``."""

    @abc.abstractmethod
    async def queue_len(self, key: str) -> int:
        """The length of the queue ``key``."""

    @abc.abstractmethod
    async def list_keys(self) -> list[str]:
        """Every key visible through this store."""

    @abc.abstractmethod
    async def barrier(self, key: str, world_size: int) -> None:
        """Count this caller in at ``key``; return once ``world_size`` callers have arrived."""

    def prefixed(self, prefix: str) -> PrefixStore:
        """A view that joins ``prefix`` and every key with ``/``, as torch's ``PrefixStore``."""
        return PrefixStore(prefix, self)


class PrefixStore(Store):
    """torch's ``PrefixStore``: every key becomes ``f"{prefix}/{key}"`` in the underlying store."""

    def __init__(self, prefix: str, store: Store) -> None:
        self.prefix = prefix
        self.store = store

    def __repr__(self) -> str:
        return f"PrefixStore({self.prefix!r}, {self.store!r})"

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}"

    def _keys(self, keys: Sequence[str]) -> list[str]:
        return [self._key(k) for k in keys]

    async def set(self, key: str, value: Value) -> None:
        await self.store.set(self._key(key), value)

    async def get(self, key: str) -> bytes:
        return await self.store.get(self._key(key))

    async def add(self, key: str, amount: int) -> int:
        return await self.store.add(self._key(key), amount)

    async def compare_set(self, key: str, expected: Value, desired: Value) -> bytes:
        return await self.store.compare_set(self._key(key), expected, desired)

    async def wait(self, keys: Sequence[str]) -> None:
        await self.store.wait(self._keys(keys))

    async def check(self, keys: Sequence[str]) -> bool:
        return await self.store.check(self._keys(keys))

    async def delete_key(self, key: str) -> bool:
        return await self.store.delete_key(self._key(key))

    async def num_keys(self) -> int:
        return await self.store.num_keys()

    async def append(self, key: str, value: Value) -> None:
        await self.store.append(self._key(key), value)

    async def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        return await self.store.multi_get(self._keys(keys))

    async def multi_set(self, keys: Sequence[str], values: Sequence[Value]) -> None:
        await self.store.multi_set(self._keys(keys), values)

    async def queue_push(self, key: str, value: Value) -> None:
        await self.store.queue_push(self._key(key), value)

    async def queue_pop(self, key: str, *, block: bool = True) -> bytes:
        return await self.store.queue_pop(self._key(key), block=block)

    async def queue_len(self, key: str) -> int:
        return await self.store.queue_len(self._key(key))

    async def list_keys(self) -> list[str]:
        head = f"{self.prefix}/"
        return [k[len(head) :] for k in await self.store.list_keys() if k.startswith(head)]

    async def barrier(self, key: str, world_size: int) -> None:
        await self.store.barrier(self._key(key), world_size)
