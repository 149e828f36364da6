"""Which hosts' connections to the rendezvous store all closed: the c10d host's event for a node that died.

When a node's agent dies (killed, crashed, its node's processes killed), its kernel closes its sockets: the store
server sees each of its connections close at once (FIN or RST), long before the keep-alive would miss its beats
(``keep_alive_interval`` x ``keep_alive_max_attempt``, 15 s by default). The store server reports every connection
opening and closing (``ServerSettings.on_connection``); :class:`DisconnectWatch` counts the open connections per
peer host, and once a host has had none for ``grace`` seconds (a node whose connection broke reconnects within
it), :meth:`DisconnectWatch.wait_gone` returns it. The handler then evicts the nodes listed under that address
(``NodeDesc.addr`` is the address a node reaches the store from, unless the user gave ``--local-addr``).

What it cannot see, and so leaves to the keep-alive: a silent loss (power, a partition: nothing closes), a node
whose address in the state is not the one it connects from, and a host with two agents of which one died (the
other's connections stay open). What it needs: the store served by the rendezvous host's agent (the host's own
death takes the store with it, and every other node then fails with ``RendezvousConnectionError``).
"""

from __future__ import annotations

import math

import anyio

__all__ = ["DisconnectWatch", "peer_host"]


def peer_host(peer: str) -> str:
    """The host of a ``"host:port"`` peer as the store server formats it (an IPv6 host in brackets); an IPv4 peer of
    a dual-stack listener (``::ffff:10.0.0.2``) is its IPv4 address, as a node's address is."""
    host = peer.rpartition(":")[0] or peer
    return host.removeprefix("[").removesuffix("]").removeprefix("::ffff:")


class DisconnectWatch:
    """Counts each host's open connections to one store server (its ``on_connection`` hook) and says which hosts
    have had none for ``grace`` seconds. Runs in the server's event loop; the hook never blocks."""

    def __init__(self, grace: float) -> None:
        if not 0 < grace < math.inf:
            raise ValueError(f"DisconnectWatch grace={grace!r}: must be a number of seconds > 0")
        self.grace = grace
        self._open: dict[str, int] = {}
        self._closed: set[str] = set()  # hosts whose last connection closed, not yet timed
        self._emptied: dict[str, float] = {}  # host -> when its last connection closed (monotonic)
        self._changed = anyio.Event()

    def __repr__(self) -> str:
        return f"<DisconnectWatch grace={self.grace:g}s hosts={len(self._open)} emptied={sorted(self._emptied)}>"

    def on_connection(self, peer: str, opened: bool) -> None:
        """The store server's hook (``ServerSettings.on_connection``)."""
        host = peer_host(peer)
        count = self._open.get(host, 0) + (1 if opened else -1)
        if count > 0:
            self._open[host] = count
            self._closed.discard(host)
            self._emptied.pop(host, None)
            return
        self._open.pop(host, None)
        if not opened:
            # Timed by wait_gone, not here: asyncio calls this from a protocol callback, where anyio's clock is
            # out of reach when the application's loop was started without anyio (asyncio.run).
            self._closed.add(host)
            self._changed.set()

    async def wait_gone(self) -> frozenset[str]:
        """Wait until a host has had no open connection for ``grace`` seconds; those hosts (each reported once)."""
        while True:
            now = anyio.current_time()
            for host in self._closed:
                self._emptied.setdefault(host, now)
            self._closed.clear()
            gone = frozenset(h for h, t in self._emptied.items() if now - t >= self.grace)
            if gone:
                for host in gone:
                    del self._emptied[host]
                return gone
            self._changed = anyio.Event()
            wake = min(self._emptied.values(), default=math.inf) + self.grace
            with anyio.move_on_after(max(0.0, wake - now)):
                await self._changed.wait()
