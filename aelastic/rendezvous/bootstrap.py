"""The workers' store of each round: fresh, empty, served by the round's rank-0 node in its own loop.

torch's workers in agent-store mode (``TORCHELASTIC_USE_AGENT_STORE=True``) connect to ``MASTER_ADDR:MASTER_PORT``
and write gloo/NCCL addresses under fixed keys, with no per-attempt prefix. A restarted attempt that reuses the
previous attempt's store reads dead peers' addresses. So every round gets a new server (a new kernel-chosen
port); the previous round's server is stopped when the next round completes.

The dynamic rendezvous learns rank 0's address from the state itself: every node binds a listener before it asks
to join (:meth:`BootstrapStores.reserve`) and sends its endpoint in the join request, so the state that completes
the round names rank 0's, and no member waits for rank 0 to publish it after the round (torch's rank 0 sets
``MASTER_ADDR``/``MASTER_PORT`` in the round's store and every other node reads them: two more round trips per
node, and every node waits for rank 0's). A listener is served at most once: a fresh server per round still.
The static rendezvous, whose ranks are given, publishes in the round's store as torch does.

With ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` torch's dynamic handler serves no workers' store: rank 0's worker
binds ``MASTER_PORT`` itself (``TORCHELASTIC_USE_AGENT_STORE=False``), on a port torch's rank 0 found free. aelastic
does the same with ``serve=False``: rank 0 closes its reserved listeners instead of serving them and names their
port, free again (a listener that never accepted leaves no TIME_WAIT), with the same small window as torch's
``get_free_port`` for another process to take it first.
"""

from __future__ import annotations

import socket
from typing import Final

import anyio
import anyio.abc

from .._net import format_address, parse_endpoint
from ..errors import RendezvousStateError
from ..store.api import Store
from ..store.server import ServerSettings, StoreServer, bind_listeners, open_store_server
from .api import RendezvousStoreInfo

__all__ = ["BootstrapStores"]

_MASTER_ADDR: Final = "MASTER_ADDR"
_MASTER_PORT: Final = "MASTER_PORT"


class BootstrapStores:
    """Reserves (every node), serves (rank 0) and names the workers' store of each round."""

    def __init__(self, task_group: anyio.abc.TaskGroup, host: str) -> None:
        self.host = host
        self._task_group = task_group
        self._scope: anyio.CancelScope | None = None  # the server of the last round this node was rank 0 of
        self._reserved: list[socket.socket] = []  # listeners for the next round this node may be rank 0 of
        self._server: StoreServer | None = None  # the server that scope runs

    def __repr__(self) -> str:
        return f"<BootstrapStores host={self.host!r} serving={self._scope is not None}>"

    async def reserve(self) -> str:
        """This node's bootstrap endpoint (``host:port``) for the rounds it joins until it serves one: listeners
        bound now, so connections made once the round completes queue until rank 0 serves them."""
        if not self._reserved:
            self._reserved = await bind_listeners(self.host, 0)
        return self._endpoint(self._reserved)

    @property
    def server(self) -> StoreServer | None:
        """The workers' store this node serves now (it is rank 0 of its last round), if any."""
        return self._server

    def _endpoint(self, sockets: list[socket.socket]) -> str:
        return format_address(self.host, sockets[0].getsockname()[1])

    async def start_round(self, rank: int, master: str | None, *, serve: bool = True) -> RendezvousStoreInfo:
        """Stop the last round's server; on rank 0, serve this round's on the reserved listeners, whose endpoint
        the state names as ``master`` (or, without ``serve``, release them for rank 0's worker to bind). Returns
        where the workers find it."""
        self.stop()
        if master is None:
            raise RendezvousStateError("the rendezvous state completed a round without rank 0's bootstrap endpoint")
        if rank == 0:
            mine = self._endpoint(self._reserved) if self._reserved else None
            if master != mine:
                raise RendezvousStateError(
                    f"the rendezvous state names {master} as this node's bootstrap endpoint (rank 0), "
                    f"but it listens on {mine or 'none'}"
                )
            sockets, self._reserved = self._reserved, []
            if serve:
                self._scope = await self._task_group.start(self._serve, sockets)
            else:
                for sock in sockets:
                    sock.close()
        host, port = parse_endpoint(master, None, what="rank 0's bootstrap endpoint")
        return RendezvousStoreInfo(host, port)

    async def publish(self, round_store: Store, rank: int) -> RendezvousStoreInfo:
        """For ranks known in advance (static): rank 0 serves this round's store and sets its address in
        ``round_store``; every rank reads it from there."""
        if rank == 0:
            info = await self.start_round(0, await self.reserve())
            await round_store.multi_set([_MASTER_ADDR, _MASTER_PORT], [info.master_addr, str(info.master_port)])
            return info
        self.stop()
        addr, port_text = await round_store.multi_get([_MASTER_ADDR, _MASTER_PORT])
        return RendezvousStoreInfo(addr.decode(), int(port_text))

    def stop(self) -> None:
        if self._scope is not None:
            self._scope.cancel()
            self._scope = None

    def close(self) -> None:
        """Stop serving and release the reserved listeners."""
        self.stop()
        for sock in self._reserved:
            sock.close()
        self._reserved = []

    async def _serve(
        self,
        sockets: list[socket.socket],
        *,
        task_status: anyio.abc.TaskStatus[anyio.CancelScope] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        with anyio.CancelScope() as scope:
            async with open_store_server(self.host, settings=ServerSettings(name="workers"), sockets=sockets) as server:
                self._server = server
                try:
                    task_status.started(scope)
                    await anyio.sleep_forever()
                finally:
                    if self._server is server:
                        self._server = None
