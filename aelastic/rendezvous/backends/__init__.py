"""The built-in rendezvous backends, registered by name: ``c10d``, ``static`` and ``etcd`` (imported on first use).

``c10d``: the dynamic rendezvous over aelastic's store. The node whose address matches the endpoint (or that has
``is_host=true``) serves the store in its own loop, bound to the endpoint's host only (every interface only for
``::`` or ``0.0.0.0``); if the port is taken (another agent on this machine already serves it) it connects as a
client instead, as torch does. ``localhost:0`` serves on a kernel-chosen port (``--standalone``). ``auth_token``
(or ``$AELASTIC_AUTH_TOKEN``) makes that store refuse clients without the token (:mod:`aelastic.store.auth`).

``static``: torch's fixed-world rendezvous: ``rank`` is given, the world is ``max_nodes`` nodes, rank 0 serves the
store at the endpoint; each round is a barrier.
"""

from __future__ import annotations

import errno
import os
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from typing import Final

import anyio
import anyio.abc

from ..._net import format_address, is_local_host, parse_endpoint
from ...errors import (
    ConfigurationError,
    RendezvousConnectionError,
    StoreAuthError,
    StoreBindError,
    StoreConnectionError,
)
from ...store.auth import resolve_auth_token
from ...store.client import StoreClient, open_store_client
from ...store.server import ServerSettings, open_store_server
from ..api import (
    Finished,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    conf_bool,
    conf_float,
    conf_int,
    register_backend,
)
from ..bootstrap import BootstrapStores
from ..dynamic import open_dynamic_rendezvous
from ..state import NodeDesc, RendezvousSettings
from .store import StoreBackend

__all__ = ["C10dSettings", "open_c10d_rendezvous", "open_static_rendezvous"]

C10D_DEFAULT_PORT: Final = 29400
_C10D_KEYS: Final = frozenset(
    {
        "join_timeout",
        "last_call_timeout",
        "close_timeout",
        "heartbeat_timeout",
        "keep_alive_interval",
        "keep_alive_max_attempt",
        "is_host",
        "read_timeout",
        "timeout",  # torchrun always passes it (900); only static uses it
        "auth_token",
    }
)
_STATIC_KEYS: Final = frozenset({"rank", "timeout", "read_timeout"})

_local_ids = iter(range(1 << 62))  # distinguishes handlers of one process, like torch's _NodeDescGenerator


@dataclass(frozen=True, slots=True)
class C10dSettings:
    """The ``--rdzv-conf`` keys of the c10d backend, validated."""

    rendezvous: RendezvousSettings
    is_host: bool | None
    read_timeout: float
    heartbeat_timeout: float
    auth_token: str | None = field(default=None, repr=False)

    @classmethod
    def from_parameters(cls, params: RendezvousParameters) -> C10dSettings:
        params.warn_unknown(set(_C10D_KEYS))
        rendezvous = RendezvousSettings(
            run_id=params.run_id,
            min_nodes=params.min_nodes,
            max_nodes=params.max_nodes,
            join_timeout=conf_float(params, "join_timeout", 600.0),
            last_call_timeout=conf_float(params, "last_call_timeout", 30.0),
            close_timeout=conf_float(params, "close_timeout", 30.0),
            keep_alive_interval=conf_float(params, "keep_alive_interval", 5.0),
            keep_alive_max_attempt=conf_int(params, "keep_alive_max_attempt", 3),
        )
        is_host = conf_bool(params, "is_host", False) if "is_host" in params.config else None
        conf_int(params, "timeout", 900)  # validated for torchrun compatibility; the join timeout governs here
        return cls(
            rendezvous=rendezvous,
            is_host=is_host,
            read_timeout=conf_float(params, "read_timeout", 60.0),
            heartbeat_timeout=conf_float(params, "heartbeat_timeout", 5.0),
            auth_token=resolve_auth_token(None if (raw := params.config.get("auth_token")) is None else str(raw)),
        )


async def _serve_or_connect(
    stack: AsyncExitStack, host: str, port: int, is_host: bool, read_timeout: float, auth_token: str | None = None
) -> StoreClient:
    if is_host:
        try:
            settings = ServerSettings(auth_token=auth_token, name="rendezvous")
            server = await stack.enter_async_context(open_store_server(host, port, settings))
        except StoreBindError as exc:
            if port == 0 or exc.errno != errno.EADDRINUSE:
                raise RendezvousConnectionError(f"rendezvous endpoint: {exc}") from exc
            # Another process on this machine already serves this endpoint: be its client, as torch is.
        else:
            port = server.port
    try:
        with anyio.fail_after(read_timeout):
            return await stack.enter_async_context(open_store_client(host, port, auth_token=auth_token))
    except StoreAuthError as exc:
        raise RendezvousConnectionError(str(exc)) from exc
    except (StoreConnectionError, TimeoutError) as exc:
        raise RendezvousConnectionError(
            f"could not reach the rendezvous store at {format_address(host, port)} within "
            f"read_timeout={read_timeout:g}s: {exc or 'no answer'}"
        ) from exc


async def _local_address(client: StoreClient, local_addr: str | None) -> str:
    """The address other nodes reach this one at: what the user gave, else the address this node used to reach
    the store (routable by construction; never a reverse lookup)."""
    if local_addr:
        return local_addr
    return await client.local_address()


def _c10d_setup(params: RendezvousParameters) -> tuple[C10dSettings, str, int]:
    """The c10d backend's settings and store address, validated without I/O."""
    settings = C10dSettings.from_parameters(params)
    return (settings, *parse_endpoint(params.endpoint or "localhost:0", C10D_DEFAULT_PORT))


@asynccontextmanager
async def open_c10d_rendezvous(params: RendezvousParameters) -> AsyncIterator[RendezvousHandler]:
    settings, host, port = _c10d_setup(params)
    is_host = settings.is_host if settings.is_host is not None else is_local_host(host)
    if port == 0 and not is_host:
        raise ConfigurationError(f"--rdzv-endpoint {params.endpoint!r}: port 0 only works on the hosting node")
    async with AsyncExitStack() as stack:
        client = await _serve_or_connect(stack, host, port, is_host, settings.read_timeout, settings.auth_token)
        addr = await _local_address(client, params.local_addr)
        backend = StoreBackend(client, params.run_id, location=f"the rendezvous store at {client.address}")
        await backend.initialize()
        node = NodeDesc(addr, os.getpid(), next(_local_ids))
        async with open_dynamic_rendezvous(
            node, settings.rendezvous, backend, backend_name="c10d", bootstrap_host=addr,
            heartbeat_timeout=settings.heartbeat_timeout, read_timeout=settings.read_timeout,
        ) as handler:  # fmt: skip
            yield handler


class StaticRendezvousHandler(RendezvousHandler):
    """torch's static rendezvous: a fixed world, each node's rank given; every round is a store barrier."""

    def __init__(self, params: RendezvousParameters, rank: int, client: StoreClient, bootstrap: BootstrapStores):
        self._params = params
        self._rank = rank
        self._client = client
        self._bootstrap = bootstrap
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

    async def next_rendezvous(self) -> RendezvousInfo:
        world = self._params.max_nodes
        store = self._client.prefixed(f"{self._params.run_id}/{self._round}")
        await store.barrier("static/joined", world)
        info = await self._bootstrap.publish(store, self._rank)
        self._round += 1
        return RendezvousInfo(store, self._rank, world, info, self._round - 1)

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


def _static_setup(params: RendezvousParameters) -> tuple[int, str, int, float]:
    """The static backend's rank, store address and read timeout, validated without I/O."""
    params.warn_unknown(set(_STATIC_KEYS))
    if "rank" not in params.config:
        raise ConfigurationError("static rendezvous needs --rdzv-conf rank=N (torchrun passes --node-rank)")
    rank = conf_int(params, "rank", 0, minimum=0)
    if rank >= params.max_nodes:
        raise ConfigurationError(f"static rendezvous rank={rank}: must be < the number of nodes {params.max_nodes}")
    if params.min_nodes != params.max_nodes:
        raise ConfigurationError(
            f"static rendezvous nodes '{params.min_nodes}:{params.max_nodes}': a static world has min == max"
        )
    host, port = parse_endpoint(params.endpoint, None)
    return rank, host, port, conf_float(params, "timeout", 900.0)


@asynccontextmanager
async def open_static_rendezvous(params: RendezvousParameters) -> AsyncIterator[RendezvousHandler]:
    rank, host, port, read_timeout = _static_setup(params)
    # The stack (store server, client) closes before the task group that runs the bootstrap stores.
    async with anyio.create_task_group() as tg, AsyncExitStack() as stack:
        client = await _serve_or_connect(stack, host, port, rank == 0, read_timeout)
        addr = await _local_address(client, params.local_addr)
        bootstrap = BootstrapStores(tg, addr)
        try:
            yield StaticRendezvousHandler(params, rank, client, bootstrap)
        finally:
            bootstrap.close()
        tg.cancel_scope.cancel()


# The etcd backend is imported on first use: its driver pulls in httpx, which a c10d or static node never needs.


def _etcd_setup(params: RendezvousParameters) -> object:
    from .etcd import etcd_setup

    return etcd_setup(params)


@asynccontextmanager
async def _open_etcd(params: RendezvousParameters) -> AsyncIterator[RendezvousHandler]:
    from .etcd import open_etcd_rendezvous

    async with open_etcd_rendezvous(params) as handler:
        yield handler


@asynccontextmanager
async def _open_etcd_v2(params: RendezvousParameters) -> AsyncIterator[RendezvousHandler]:
    from .etcd import open_etcd_v2_rendezvous

    async with open_etcd_v2_rendezvous(params) as handler:
        yield handler


register_backend("c10d", open_c10d_rendezvous, check=_c10d_setup)
register_backend("static", open_static_rendezvous, check=_static_setup)
register_backend("etcd", _open_etcd, check=_etcd_setup)
register_backend("etcd-v2", _open_etcd_v2, check=_etcd_setup)
