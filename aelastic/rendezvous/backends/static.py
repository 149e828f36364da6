"""The ``static`` backend: torch's fixed-world rendezvous (``static_tcp_rendezvous``).

``rank`` is given (torchrun passes ``--node-rank``), the world is ``max_nodes`` nodes, rank 0 serves the store at
the endpoint; each round is a barrier in the store. Keys: :data:`STATIC_KEYS`. It keeps no shared rendezvous state, so
``aelastic status`` has nothing to show for it, and it never calls a join observer (there are no join steps).
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Final

import anyio

from ..._net import parse_endpoint
from ...errors import ConfigurationError
from ...store.client import StoreClient
from ...store.server import StoreServer
from ..api import Finished, JoinObserver, RendezvousHandler, RendezvousInfo, RendezvousParameters, RendezvousStatistics
from ..bootstrap import BootstrapStores
from ..settings import READ_TIMEOUT, ConfKey, key_names
from .hosting import local_address, serve_or_connect

__all__ = ["StaticRendezvousHandler", "open_static_rendezvous", "static_setup"]

RANK: Final = ConfKey("rank", "integer", None, "this node's rank, < the number of nodes (torchrun passes --node-rank)",
                      minimum=0)  # fmt: skip
TIMEOUT: Final = ConfKey("timeout", "seconds", 900.0, "how long to reach rank 0's store (torch's static backend's)")
STATIC_KEYS: Final = (RANK, TIMEOUT, dataclasses.replace(READ_TIMEOUT, doc="accepted, not read", read_by=False))


class StaticRendezvousHandler(RendezvousHandler):
    """torch's static rendezvous: a fixed world, each node's rank given; every round is a store barrier."""

    def __init__(
        self,
        params: RendezvousParameters,
        rank: int,
        client: StoreClient,
        bootstrap: BootstrapStores,
        server: StoreServer | None = None,
    ) -> None:
        self._params = params
        self._rank = rank
        self._client = client
        self._bootstrap = bootstrap
        self._server = server  # the store rank 0 serves at the endpoint
        self._round = 0

    def __repr__(self) -> str:
        return f"<StaticRendezvousHandler run={self._params.run_id!r} rank={self._rank} round={self._round}>"

    def get_backend(self) -> str:
        return "static"

    def get_run_id(self) -> str:
        return self._params.run_id

    @property
    def use_agent_store(self) -> bool:
        return True

    @property
    def local_addr(self) -> str:
        return self._bootstrap.host

    def statistics(self) -> RendezvousStatistics:
        servers = [s for s in (self._server, self._bootstrap.server) if s is not None]
        return RendezvousStatistics(stores=tuple(server.statistics() for server in servers))

    async def next_rendezvous(self) -> RendezvousInfo:
        world = self._params.max_nodes
        store = self._client.prefixed(f"{self._params.run_id}/{self._round}")
        await store.barrier("static/joined", world)
        info = await self._bootstrap.publish(store, self._rank)
        self._round += 1
        job_store = self._client.prefixed(f"{self._params.run_id}/job")
        return RendezvousInfo(store, self._rank, world, info, self._round - 1, job_store)

    async def num_nodes_waiting(self) -> int:
        return 0

    async def wait_for_membership_change(self, finished: Finished | None = None) -> str:
        await anyio.sleep_forever()
        raise AssertionError("unreachable")

    async def wait_for_member_ranks(self, known: frozenset[int]) -> frozenset[int]:
        everyone = frozenset(range(self._params.max_nodes))  # a static world never changes
        if known == everyone:
            await anyio.sleep_forever()
        return everyone

    async def is_closed(self) -> bool:
        return False

    async def set_closed(self) -> None:
        pass

    async def shutdown(self) -> bool:
        return True


def static_setup(params: RendezvousParameters) -> tuple[int, str, int, float]:
    """The static backend's rank, store address and read timeout, validated without I/O."""
    params.warn_unknown(key_names(STATIC_KEYS))
    if RANK.name not in params.config:
        raise ConfigurationError("static rendezvous needs --rdzv-conf rank=N (torchrun passes --node-rank)")
    rank: int = RANK.read(params)
    if rank >= params.max_nodes:
        raise ConfigurationError(f"static rendezvous rank={rank}: must be < the number of nodes {params.max_nodes}")
    if params.min_nodes != params.max_nodes:
        raise ConfigurationError(
            f"static rendezvous nodes '{params.min_nodes}:{params.max_nodes}': a static world has min == max"
        )
    host, port = parse_endpoint(params.endpoint, None)
    return rank, host, port, TIMEOUT.read(params)


@asynccontextmanager
async def open_static_rendezvous(
    params: RendezvousParameters, *, observer: JoinObserver | None = None
) -> AsyncIterator[RendezvousHandler]:
    """The static rendezvous of ``params``; ``observer`` is never called (a static node takes no join steps)."""
    rank, host, port, read_timeout = static_setup(params)
    # The stack (store server, client) closes before the task group that runs the bootstrap stores.
    async with anyio.create_task_group() as tg, AsyncExitStack() as stack:
        client, server = await serve_or_connect(stack, host, port, rank == 0, read_timeout)
        addr = await local_address(client, params.local_addr)
        bootstrap = BootstrapStores(tg, addr)
        try:
            yield StaticRendezvousHandler(params, rank, client, bootstrap, server)
        finally:
            bootstrap.close()
        tg.cancel_scope.cancel()
