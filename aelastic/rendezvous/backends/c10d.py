"""The ``c10d`` backend: the dynamic rendezvous over aelastic's store (the state driver is ``store.py``).

The node whose address matches the endpoint (or that has ``is_host=true``) serves the store in its own loop,
bound to the endpoint's host only (every interface only for ``::`` or ``0.0.0.0``); if the port is taken (another
agent on this machine already serves it) it connects as a client instead, as torch does. ``localhost:0`` serves on
a kernel-chosen port (``--standalone``). ``auth_token`` (or ``$AELASTIC_AUTH_TOKEN``) makes that store refuse
clients without the token (:mod:`aelastic.store.auth`).

Keys (:data:`C10D_KEYS`): the dynamic backends' (:mod:`..settings`), ``is_host``, ``auth_token`` and
``disconnect_grace``.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from typing import Final, cast

import anyio

from ..._groups import single_error
from ..._net import format_address, is_local_host, parse_endpoint
from ...errors import ConfigurationError, RendezvousConnectionError, StoreConnectionError
from ...store.auth import resolve_auth_token
from ...store.client import open_store_client
from ..api import JoinObserver, RendezvousHandler, RendezvousParameters
from ..dynamic import open_dynamic_rendezvous
from ..settings import AUTH_TOKEN, DYNAMIC_KEYS, READ_TIMEOUT, ConfKey, HandlerOptions, TimingSettings, key_names
from ..values import NodeDesc, RendezvousSettings
from .base import StateReader
from .disconnects import DisconnectWatch
from .hosting import local_address, serve_or_connect
from .store import StoreBackend

__all__ = [
    "C10D_DEFAULT_PORT",
    "C10dSettings",
    "c10d_settings",
    "c10d_setup",
    "open_c10d_reader",
    "open_c10d_rendezvous",
]

C10D_DEFAULT_PORT: Final = 29400
IS_HOST: Final = ConfKey(
    "is_host", "boolean", None,
    "whether this node serves the rendezvous store; by default, the node whose own address is the endpoint's host",
)  # fmt: skip
DISCONNECT_GRACE: Final = ConfKey(
    "disconnect_grace", "seconds", 2.0,
    "the hosting node evicts a node once every connection from its address has stayed closed this long (its agent "
    "died, the network up); 0: never, the keep-alive alone finds dead nodes, as torch",
    minimum=0,
)  # fmt: skip
C10D_KEYS: Final = (*DYNAMIC_KEYS, IS_HOST, AUTH_TOKEN, DISCONNECT_GRACE)

_local_ids = iter(range(1 << 62))  # distinguishes handlers of one process, like torch's _NodeDescGenerator


@dataclass(frozen=True, slots=True)
class C10dSettings:
    """The ``--rdzv-conf`` keys of the c10d backend, validated."""

    rendezvous: RendezvousSettings
    is_host: bool | None
    read_timeout: float
    heartbeat_timeout: float
    auth_token: str | None = field(default=None, repr=False)
    disconnect_grace: float = cast(float, DISCONNECT_GRACE.default)

    def __post_init__(self) -> None:
        if self.disconnect_grace < 0:
            raise ConfigurationError(
                f"--rdzv-conf disconnect_grace={self.disconnect_grace!r}: must be >= 0 seconds (0: off)"
            )

    @classmethod
    def from_parameters(cls, params: RendezvousParameters) -> C10dSettings:
        params.warn_unknown(key_names(C10D_KEYS))
        timing = TimingSettings.from_parameters(params)
        return cls(
            rendezvous=timing.rendezvous,
            is_host=IS_HOST.read(params),
            read_timeout=READ_TIMEOUT.read(params),
            heartbeat_timeout=timing.heartbeat_timeout,
            auth_token=resolve_auth_token(AUTH_TOKEN.read(params)),
            disconnect_grace=DISCONNECT_GRACE.read(params),
        )


def c10d_setup(params: RendezvousParameters) -> tuple[C10dSettings, str, int]:
    """The c10d backend's settings and store address, validated without I/O."""
    settings = C10dSettings.from_parameters(params)
    return (settings, *parse_endpoint(params.endpoint or "localhost:0", C10D_DEFAULT_PORT))


def c10d_settings(params: RendezvousParameters) -> RendezvousSettings:
    """The protocol settings the nodes of ``params`` derive (node counts, windows)."""
    return C10dSettings.from_parameters(params).rendezvous


@asynccontextmanager
async def open_c10d_rendezvous(
    params: RendezvousParameters, *, observer: JoinObserver | None = None
) -> AsyncIterator[RendezvousHandler]:
    settings, host, port = c10d_setup(params)
    is_host = settings.is_host if settings.is_host is not None else is_local_host(host)
    if port == 0 and not is_host:
        raise ConfigurationError(f"--rdzv-endpoint {params.endpoint!r}: port 0 only works on the hosting node")
    # The hosting node hears of dead agents from its store server's closed connections (see backends/disconnects).
    watch = DisconnectWatch(settings.disconnect_grace) if is_host and settings.disconnect_grace > 0 else None
    async with AsyncExitStack() as stack:
        client, server = await serve_or_connect(
            stack, host, port, is_host, settings.read_timeout, settings.auth_token,
            on_connection=None if watch is None else watch.on_connection,
        )  # fmt: skip
        addr = await local_address(client, params.local_addr)
        backend = StoreBackend(
            client, params.run_id, location=f"the rendezvous store at {client.address}",
            disconnects=watch if server is not None else None,  # another process serves it: no events here
        )  # fmt: skip
        await backend.initialize()
        node = NodeDesc(addr, os.getpid(), next(_local_ids))
        options = HandlerOptions(
            "c10d", addr, settings.heartbeat_timeout, settings.read_timeout, observer=observer,
            servers=() if server is None else (server,), share_store=params.share_store,
        )  # fmt: skip
        try:
            with single_error():
                async with open_dynamic_rendezvous(node, settings.rendezvous, backend, options) as handler:
                    yield handler
        except (StoreConnectionError, RendezvousConnectionError) as exc:
            if server is not None:
                raise  # this node serves the store: nothing remote was lost
            raise RendezvousConnectionError(_store_lost(params.run_id, client.address, host, exc)) from exc


def _store_lost(run_id: str, address: str, host: str, exc: Exception) -> str:
    """What a node that lost the c10d store says: what was lost, why, and what would have survived it."""
    if isinstance(exc, RendezvousConnectionError):  # the liveness gave up: its words say how long
        detail = str(exc).partition(f"{address}: ")[2] or str(exc)
    elif isinstance(exc.__cause__, anyio.EndOfStream | anyio.BrokenResourceError | ConnectionError):
        detail = "its connection closed"
    else:
        detail = str(exc)
    return (
        f"rendezvous {run_id!r}: lost the rendezvous store at {address} ({detail}): the agent on {host} that served "
        "it is gone, or its node, and with it every node's rendezvous (c10d keeps the rendezvous on that one node). "
        "The job's own etcd (--rdzv-backend etcd --rdzv-endpoint embedded:HOST,...) survives the loss of any one "
        "node: see docs/embedded-etcd.md"
    )


@asynccontextmanager
async def open_c10d_reader(params: RendezvousParameters) -> AsyncIterator[StateReader]:
    """A reader of the run's state in the rendezvous store at ``params.endpoint``: a client that creates no key
    (``aelastic status``)."""
    _, host, port = c10d_setup(params)
    if port == 0:
        raise ConfigurationError(
            f"--rdzv-endpoint {format_address(host, port)!r}: port 0 is chosen by the hosting node; give the real port"
        )
    async with open_store_client(host, port) as client:
        yield StoreBackend(client, params.run_id)
