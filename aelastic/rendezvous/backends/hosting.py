"""Reaching, or hosting, the TCPStore a backend keeps its rendezvous in (``c10d`` and ``static``).

The hosting node serves the store in its own loop; if the port is taken (another agent on this machine already
serves it) it becomes a client instead, as torch does. Every node reaches the store within ``read_timeout``.
"""

from __future__ import annotations

import errno
from collections.abc import Callable
from contextlib import AsyncExitStack

import anyio

from ..._net import format_address
from ...errors import RendezvousConnectionError, StoreAuthError, StoreBindError, StoreConnectionError
from ...store.client import StoreClient, open_store_client
from ...store.server import ServerSettings, StoreServer, open_store_server

__all__ = ["local_address", "serve_or_connect"]


async def serve_or_connect(
    stack: AsyncExitStack,
    host: str,
    port: int,
    is_host: bool,
    read_timeout: float,
    auth_token: str | None = None,
    on_connection: Callable[[str, bool], None] | None = None,
) -> tuple[StoreClient, StoreServer | None]:
    """A client of the store at ``host:port``, and the server when this node hosts it; both close with ``stack``.
    ``on_connection``: the server's connection events (``ServerSettings.on_connection``), when it serves.

    Raises:
        RendezvousConnectionError: the port could not be bound (other than taken), or the store did not answer
            within ``read_timeout``, or refused the token.
    """
    server: StoreServer | None = None
    if is_host:
        try:
            settings = ServerSettings(auth_token=auth_token, name="rendezvous", on_connection=on_connection)
            server = await stack.enter_async_context(open_store_server(host, port, settings))
        except StoreBindError as exc:
            if port == 0 or exc.errno != errno.EADDRINUSE:
                raise RendezvousConnectionError(f"rendezvous endpoint: {exc}") from exc
            # Another process on this machine already serves this endpoint: be its client, as torch is.
        else:
            port = server.port
    try:
        with anyio.fail_after(read_timeout):
            client = await stack.enter_async_context(open_store_client(host, port, auth_token=auth_token))
    except StoreAuthError as exc:
        raise RendezvousConnectionError(str(exc)) from exc
    except (StoreConnectionError, TimeoutError) as exc:
        raise RendezvousConnectionError(
            f"could not reach the rendezvous store at {format_address(host, port)} within "
            f"read_timeout={read_timeout:g}s: {exc or 'no answer'}"
        ) from exc
    return client, server


async def local_address(client: StoreClient, local_addr: str | None) -> str:
    """The address other nodes reach this one at: what the user gave, else the address this node used to reach
    the store (routable by construction; never a reverse lookup)."""
    if local_addr:
        return local_addr
    return await client.local_address()
