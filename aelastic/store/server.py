"""Async TCPStore server: torch's wire protocol and torch's libuv server semantics, served from an event loop.

Theory of operation
-------------------
Three parts, each in a module of its own:

* the state and the request handlers, sans-IO (:mod:`aelastic.store.table`): the table, the queues, the waiters,
  one plain (non-async) method per request kind that appends its reply to the connection's outbox, the
  handshake, the limits and the counters;
* two transports with the same handlers and the same outbox discipline: on asyncio (the fast path) the loop's own
  server and a protocol per connection, no task per request (:mod:`aelastic.store.asyncio_transport`);
  on any other anyio backend (trio) the connections in a nested epoll of the transport's own, handled
  synchronously per batch of ready sockets, no task per request (:mod:`aelastic.store.stream_transport`);
* this module: binding the listeners, choosing the transport, and the public API (:func:`open_store_server`,
  :func:`serve_store`, :class:`StoreServer`, its settings and statistics).

Either way a huge reply batch is flushed early so that a chunk full of GETs cannot build an unbounded reply, and
unsent bytes beyond ``max_buffered_bytes`` close the connection. The hot path per request is the table's
``process`` loop and its handlers; per received chunk, each transport's read callback or loop (their module
docstrings name it). Nothing of it is in this module.

A protocol violation (first request not VALIDATE, unknown query, a key/value/key-count over the limits, more than
``max_buffered_bytes`` of unparsed or unsent data, ADD on a non-numeric value) closes that one connection and is
logged; its wait registrations are dropped and nothing else is affected.

Hardening: a connection must finish its handshake (VALIDATE, and the auth token check when ``auth_token`` is set;
see :mod:`aelastic.store.auth`) within ``handshake_timeout`` or it is closed, so half-open connections that send
nothing, or half a frame, do not pile up. Beyond ``max_connections`` open connections a new one is accepted and
closed at once (a refused peer learns it immediately instead of hanging in the kernel's backlog).

Listening: only where asked. ``"::"`` (or ``""``) is one IPv6 socket with ``IPV6_V6ONLY=0`` (every interface,
dual stack, so ``127.0.0.1`` and ``::1`` both reach it), ``"0.0.0.0"`` every IPv4 interface; a hostname binds
every address it resolves to, on one port; a literal binds just itself.
``SO_REUSEADDR`` is set on listeners, ``TCP_NODELAY`` on accepted sockets.

Cancellation is the shutdown path: cancelling :func:`serve_store` (or leaving :func:`open_store_server`) closes
the listeners and every connection. Whoever starts a server holds it: its :meth:`StoreServer.statistics` (for the
agent's ``/metrics``) is read through the object, never through a process-wide registry.
"""

from __future__ import annotations

import asyncio
import errno
import ipaddress
import logging
import math
import resource
import socket
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Final

import anyio
import anyio.abc

from .._groups import single_error
from .._net import format_address
from ..errors import StoreBindError
from . import auth, wire
from .asyncio_transport import serve_protocols
from .stream_transport import serve_streams
from .table import StoreTable

__all__ = [
    "ServerSettings",
    "ServerStatistics",
    "StoreServer",
    "bind_listeners",
    "open_store_server",
    "serve_store",
]

logger = logging.getLogger(__name__)

_BACKLOG: Final = 16384  # torch's libuv DEFAULT_BACKLOG (the kernel caps it at somaxconn)
_RESERVED_FILES: Final = 1024  # descriptors the default connection cap leaves to the rest of the process
_BIND_ATTEMPTS: Final = 10  # port-0 binds of several addresses retry when the kernel's port is taken elsewhere


@dataclass(frozen=True, slots=True)
class ServerSettings:
    """Limits of the server, applied per connection.

    Attributes:
        limits: key length, value length and keys per request (torch's libuv defaults).
        max_buffered_bytes: the most bytes one connection may hold in the server, received but not yet a whole
            request, or replies and wake-ups not yet sent. A connection over it is closed. The default, 64 MiB,
            holds several maximal (8 MiB) values; a MULTI_SET larger than this is refused.
        max_connections: open connections beyond which a new one is closed at once. torch's server has no such
            cap. The default (None) is the process's open-file limit at the server's start less a reserve of
            1,024 descriptors (at least half the limit; at most 65536 connections): a flood of connections is
            refused before it exhausts the process's file descriptors, which the agent also needs for its
            workers' pipes and log files, while a raised limit (16,384 ranks need about 16,500) serves as many
            connections as it allows. A job of N nodes needs about 5 N connections on its rendezvous store; raise
            the open-file limit (``ulimit -n``) for large jobs.
        handshake_timeout: seconds a new connection has to send VALIDATE (and the auth token, if one is set)
            before it is closed. torch's client sends both at once; the default, 10 s, only ends connections
            that never will.
        auth_token: if set, clients must present this token right after VALIDATE (:mod:`aelastic.store.auth`);
            torch's own client cannot, so leave it unset on a store that torch workers use.
        name: what the store is for (``"rendezvous"``, ``"workers"``): its ``store`` label in the agent's
            ``/metrics``.
        on_connection: called as ``on_connection(peer, True)`` when a client connection is admitted and
            ``on_connection(peer, False)`` when an admitted one closes (``peer``: ``"host:port"``, an IPv6 host in
            brackets), in the server's loop; it must not block or raise. The c10d rendezvous host learns from it
            that a node's agent died (its kernel closed the connections) without waiting for missed heartbeats.
    """

    limits: wire.Limits = field(default_factory=wire.Limits)
    max_buffered_bytes: int = 64 * 1024 * 1024
    max_connections: int | None = None
    handshake_timeout: float = 10.0
    auth_token: str | None = field(default=None, repr=False)
    name: str = "store"
    on_connection: Callable[[str, bool], None] | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.max_connections is not None and self.max_connections < 1:
            raise ValueError(f"ServerSettings.max_connections={self.max_connections}: must be >= 1")
        if not 0 < self.handshake_timeout < math.inf:
            raise ValueError(f"ServerSettings.handshake_timeout={self.handshake_timeout}: must be a positive number")
        if self.auth_token is not None:
            auth.check_token(self.auth_token, what="ServerSettings.auth_token")
        smallest = 1 + 8 + self.limits.max_key_length + 8 + self.limits.max_value_length
        if self.max_buffered_bytes < smallest:
            raise ValueError(
                f"ServerSettings.max_buffered_bytes={self.max_buffered_bytes}: must be >= {smallest}, the size "
                "of one SET of the longest key and value the limits allow; raise it or lower the limits"
            )


@dataclass(frozen=True, slots=True)
class ServerStatistics:
    """A snapshot of a running server.

    Attributes:
        name: what the store is for (``ServerSettings.name``: ``"rendezvous"``, ``"workers"``).
        port: the port it listens on.
        connections: open client connections.
        keys: keys in the table (queues are not counted, as in torch's GETNUMKEYS).
        queued: values in queues (QUEUE_PUSH), all queues together.
        waiters: connections registered as waiting for a key (an outstanding WAIT, BARRIER or blocking pop).
        ops_served: requests handled since the server started.
        bytes_received: bytes received from clients since the server started.
        bytes_sent: bytes of replies queued to clients since the server started (wake-ups included).
        ops_by_kind: requests handled per request kind (``"Get"``, ``"CompareSet"``, ...), for measurements.
        sent_by_kind: reply bytes per request kind; a WAIT's wake-up counts under ``"Wait"``.
    """

    name: str
    port: int
    connections: int
    keys: int
    queued: int
    waiters: int
    ops_served: int
    bytes_received: int
    bytes_sent: int = 0
    ops_by_kind: Mapping[str, int] = field(default_factory=dict)
    sent_by_kind: Mapping[str, int] = field(default_factory=dict)


def _default_max_connections() -> int:
    """The open-file limit less a reserve, at least half of it, at most 65536 (``ServerSettings.max_connections``)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 65536
    return max(1, min(65536, max(soft // 2, soft - _RESERVED_FILES)))


class StoreServer:
    """A running TCPStore server; obtain one from :func:`open_store_server` or :func:`serve_store`.

    Attributes:
        host: the host it was asked to listen on.
        port: the bound port (the kernel's choice when 0 was asked for).
        addresses: every bound socket address, ``(address, port)``.
    """

    def __init__(self, host: str, addresses: tuple[tuple[str, int], ...], settings: ServerSettings) -> None:
        self.host = host
        self.port = addresses[0][1]
        self.addresses = addresses
        self._settings = settings
        self._table = StoreTable(
            settings.limits,
            max_buffered_bytes=settings.max_buffered_bytes,
            max_connections=settings.max_connections or _default_max_connections(),
            auth_token=settings.auth_token,
            port=self.port,
            on_connection=settings.on_connection,
        )

    @property
    def name(self) -> str:
        return self._settings.name

    def __repr__(self) -> str:
        s = self.statistics()
        return (
            f"<StoreServer {self.name} {format_address(self.host, self.port)} connections={s.connections} "
            f"keys={s.keys} waiters={s.waiters} ops_served={s.ops_served}>"
        )

    def statistics(self) -> ServerStatistics:
        table = self._table
        return ServerStatistics(
            name=self.name,
            port=self.port,
            connections=len(table.connections),
            keys=table.key_count(),
            queued=table.queued_count(),
            waiters=table.waiter_count(),
            ops_served=table.ops,
            bytes_received=table.bytes_received,
            bytes_sent=sum(table.sent_by_kind.values()),
            ops_by_kind=dict(table.ops_by_kind),
            sent_by_kind=dict(table.sent_by_kind),
        )

    async def _serve(self, sockets: list[socket.socket], *, task_status: anyio.abc.TaskStatus[StoreServer]) -> None:
        """Serve on the bound ``sockets`` with the transport of the running event loop until cancelled."""
        settings = self._settings
        if _running_asyncio():
            serve = partial(
                serve_protocols, self._table, sockets, handshake_timeout=settings.handshake_timeout, backlog=_BACKLOG
            )
        else:
            serve = partial(serve_streams, self._table, sockets, handshake_timeout=settings.handshake_timeout)
        async with anyio.create_task_group() as tg:
            await tg.start(serve)
            logger.info("store server listening on %s", ", ".join(format_address(a, p) for a, p in self.addresses))
            task_status.started(self)


def _running_asyncio() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


# --- listening ------------------------------------------------------------------------------------------------


def _listen_socket(family: socket.AddressFamily, sockaddr: tuple[Any, ...], *, v6only: bool) -> socket.socket:
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setblocking(False)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            # Must precede bind; asyncio and anyio set V6ONLY=1 for an explicit "::".
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, int(v6only))
        sock.bind(sockaddr)
        sock.listen(_BACKLOG)
    except BaseException:
        sock.close()
        raise
    return sock


async def bind_listeners(host: str, port: int) -> list[socket.socket]:
    """Bound, listening sockets for ``host``: one dual-stack socket for ``::``, else one per resolved address (one
    port for all). Connections queue in the backlog until a server serves them (``open_store_server(sockets=...)``).

    Raises:
        StoreBindError: naming the address, with the socket error's ``errno``.
    """
    try:
        return await _bind_sockets(host, port)
    except OSError as exc:  # socket.gaierror included: a host name that does not resolve
        error = StoreBindError(f"the store server cannot listen on {format_address(host, port)}: {exc.strerror or exc}")
        error.errno = exc.errno
        raise error from exc


async def _bind_sockets(host: str, port: int) -> list[socket.socket]:
    if host in ("", "::"):
        if socket.has_dualstack_ipv6():
            return [_listen_socket(socket.AF_INET6, ("::", port), v6only=False)]
        host = "0.0.0.0"
    infos: Sequence[tuple[socket.AddressFamily, Any, Any, Any, tuple[Any, ...]]]
    try:
        ipaddress.ip_address(host)
    except ValueError:
        infos = await anyio.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    else:  # an address literal: nothing to look up, so no worker thread to wait for
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE | socket.AI_NUMERICHOST)
    targets: list[tuple[socket.AddressFamily, tuple[Any, ...]]] = []
    for family, _, _, _, sockaddr in infos:
        if family in (socket.AF_INET, socket.AF_INET6) and (family, sockaddr) not in targets:
            targets.append((family, sockaddr))
    if not targets:
        raise OSError(errno.EADDRNOTAVAIL, f"{host!r} resolves to no IPv4 or IPv6 address")
    for _ in range(_BIND_ATTEMPTS):
        sockets: list[socket.socket] = []
        skipped: list[OSError] = []
        chosen = port
        try:
            for family, sockaddr in targets:
                address = (sockaddr[0], chosen, *sockaddr[2:])
                try:
                    sock = _listen_socket(family, address, v6only=True)
                except OSError as exc:
                    if exc.errno == errno.EADDRINUSE:
                        raise
                    # An address the name resolves to but this host cannot use (IPv6 disabled, no ::1) is
                    # skipped, as long as another address of the name can be bound.
                    logger.debug("store server: not listening on %s: %s", format_address(str(address[0]), chosen), exc)
                    skipped.append(exc)
                    continue
                sockets.append(sock)
                chosen = sock.getsockname()[1]
        except OSError:
            for sock in sockets:
                sock.close()
            if port == 0 and sockets:
                continue  # the kernel's port for the first address is taken on another address: pick again
            raise
        if not sockets:
            raise skipped[0]
        return sockets
    raise OSError(errno.EADDRINUSE, f"no free port on every address of {host!r} after {_BIND_ATTEMPTS} attempts")


async def serve_store(
    host: str = "::",
    port: int = 0,
    settings: ServerSettings | None = None,
    *,
    task_status: anyio.abc.TaskStatus[StoreServer] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Serve a TCPStore on ``host``:``port`` until cancelled.

    Once every listener is bound and accepting, ``task_status.started(server)`` reports the :class:`StoreServer`
    (for ``server = await tg.start(serve_store, host, 0)``). A binding error is raised before that, as
    :class:`~aelastic.errors.StoreBindError` naming the address.

    Cancellation closes the listeners and every client connection; the store's contents are gone with it.
    """
    await _serve_sockets(host, await bind_listeners(host, port), settings or ServerSettings(), task_status=task_status)


async def _serve_sockets(
    host: str,
    sockets: list[socket.socket],
    settings: ServerSettings,
    *,
    task_status: anyio.abc.TaskStatus[StoreServer],
) -> None:
    addresses = tuple((str(sock.getsockname()[0]), int(sock.getsockname()[1])) for sock in sockets)
    await StoreServer(host, addresses, settings)._serve(sockets, task_status=task_status)


@asynccontextmanager
async def open_store_server(
    host: str = "::",
    port: int = 0,
    settings: ServerSettings | None = None,
    *,
    sockets: list[socket.socket] | None = None,
) -> AsyncIterator[StoreServer]:
    """Run a TCPStore server for the duration of the ``async with`` block.

    Yields the running :class:`StoreServer` (``server.port`` is the bound port); a binding error is raised
    before the block runs, as :class:`~aelastic.errors.StoreBindError` naming the address. ``sockets``: listeners
    bound earlier for ``host`` (:func:`bind_listeners`), served instead of binding ``port``. One error ending the
    server or the block is raised as itself, never in an ExceptionGroup. Leaving the block, normally or by
    cancellation, stops the server: the listeners and every connection are closed.
    """
    if sockets is None:
        sockets = await bind_listeners(host, port)
    with single_error():
        async with anyio.create_task_group() as tg:
            server: StoreServer = await tg.start(_serve_sockets, host, sockets, settings or ServerSettings())
            try:
                yield server
            finally:
                tg.cancel_scope.cancel()
