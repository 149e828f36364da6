"""The small protocol every dynamic-rendezvous backend driver implements.

Three things, and nothing about rendezvous semantics (those live in ``rendezvous/state.py``):

* **versioned state**: read the encoded state with its version; compare-and-set it against the version read;
  wait until the version moves past one already seen (event driven: a server-side WAIT, an etcd watch);
* **liveness**: a node proves it is alive with one small write per interval (``keep_alive``), and the backend
  judges who stopped (``find_dead``) without comparing clocks of different hosts: the store driver watches
  each node's heartbeat counter on the observer's own monotonic clock; etcd lets the server expire leases;
* **a store** shared by the members, from which each round's private store view is cut.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass

from ...store.api import Store

__all__ = ["RendezvousBackend", "Versioned"]


@dataclass(frozen=True, slots=True)
class Versioned:
    """The encoded state at one version; ``data is None`` while nothing was ever written (version 0)."""

    version: int
    data: bytes | None
    token: object = None  # what the backend needs to compare-and-set against this version

    def __repr__(self) -> str:
        return f"Versioned(version={self.version}, {0 if self.data is None else len(self.data)} bytes)"


class RendezvousBackend(abc.ABC):
    """An async driver for one run id's shared rendezvous state."""

    name: str
    store: Store

    @abc.abstractmethod
    async def get_state(self) -> Versioned:
        """The current state."""

    @abc.abstractmethod
    async def set_state(self, data: bytes, expected: Versioned) -> tuple[Versioned, bool]:
        """Write ``data`` as the next version if the state is still at ``expected``.

        Returns the state now current and whether this write is it.
        """

    @abc.abstractmethod
    async def wait_for_change(self, seen: Versioned) -> None:
        """Return once the state has moved past ``seen`` (at once if it already has)."""

    @abc.abstractmethod
    async def keep_alive(self, node_key: str) -> None:
        """One heartbeat of ``node_key``: a small write of its own, never the shared state."""

    @abc.abstractmethod
    async def find_dead(self, node_keys: Sequence[str], grace: float) -> frozenset[str]:
        """Which of ``node_keys`` have shown no heartbeat for ``grace`` seconds, as this backend judges it."""
