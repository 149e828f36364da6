"""Async TCPStore server: torch's wire protocol and torch's libuv server semantics, served from an event loop.

Theory of operation
-------------------
State is one in-memory table (``bytes -> bytes``), a map of queues (``bytes -> deque``) and the waiters: for each
key, the connections waiting for it (in the order they registered, each with how many of its registrations are
for that key), and per connection how many keys it still awaits. Registering and unregistering are O(1) however
many connections wait for the key: at 10,000 nodes every node waits for the same key, and each heartbeat cancels
one wait (a list scanned per cancel made the server's work per heartbeat interval grow as N²). Every request is handled
by a plain (non-async) method that mutates that state and appends the encoded reply to the connection's
*outbox*; nothing awaits between the start and the end of a request, so requests are atomic with respect to each
other and no lock guards the table.

Connections are served one of two ways, with the same handlers and the same outbox discipline:

* **asyncio** (the fast path): the loop's own server with a :class:`asyncio.BufferedProtocol` per connection.
  ``buffer_updated`` parses and handles every whole request in the chunk and writes all replies with one
  ``transport.write``; no task and no checkpoint per request, which is what keeps the server within reach of
  torch's libuv server. When the transport's buffer passes its high-water mark (a peer that does not read its
  replies), reading pauses and buffered requests wait until it drains (backpressure). A wake-up caused by another
  connection is written straight to the woken connection's transport (asyncio buffers it; it never blocks the
  waker); if the woken connection is itself mid-chunk it joins the outbox so replies stay in order.
* **any other anyio backend** (trio): two tasks per connection in a cancel scope of their own. The *reader*
  receives a chunk, handles every whole request in it and flushes the outbox with one ``send``; a slow peer
  stalls only its own reader. The *writer* delivers wake-ups that other connections caused: the waker appends
  ``STOP_WAITING`` to the outbox and sets an event, never sending on a foreign stream. Both send only while
  holding the connection's lock (trio refuses concurrent sends on one stream) and drain the same outbox, so bytes
  leave in the order the events happened.

Either way a huge reply batch is flushed early (``_FLUSH_AT``) so that a chunk full of GETs cannot build an
unbounded reply, and unsent bytes beyond ``max_buffered_bytes`` close the connection.

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
the listeners and every connection.
"""

from __future__ import annotations

import abc
import asyncio
import errno
import ipaddress
import logging
import math
import resource
import socket
import struct
from collections import Counter, deque
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Final, cast

import anyio
import anyio.abc
import anyio.lowlevel
from anyio.abc import SocketAttribute

from .._groups import single_error
from .._net import format_address
from ..errors import StoreBindError, StoreProtocolError
from . import auth, wire

__all__ = [
    "ServerSettings",
    "ServerStatistics",
    "StoreServer",
    "bind_listeners",
    "open_store_server",
    "serve_store",
    "serving",
]

logger = logging.getLogger(__name__)

_RECEIVE_SIZE: Final = 65536
_SCRATCH_SIZE: Final = 256 * 1024  # the most an asyncio connection reads at once (asyncio's own read size)
_FLUSH_AT: Final = 256 * 1024  # flush replies mid-chunk once this many bytes are queued
_BACKLOG: Final = 16384  # torch's libuv DEFAULT_BACKLOG (the kernel caps it at somaxconn)
_BIND_ATTEMPTS: Final = 10  # port-0 binds of several addresses retry when the kernel's port is taken elsewhere
_ACCEPT_BACKOFF: Final = 0.1  # after EMFILE & co., before accepting again

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_I64 = struct.Struct("<q")
_I64_MIN: Final = -(2**63)
_I64_MAX: Final = 2**63 - 1

_STOP_WAITING: Final = bytes((wire.WaitResponse.STOP_WAITING,))
_WAIT_CANCELED: Final = bytes((wire.WaitResponse.WAIT_CANCELED,))
_READY: Final = bytes((wire.CheckResponse.READY,))
_NOT_READY: Final = bytes((wire.CheckResponse.NOT_READY,))

# Peer-side failures that end one connection quietly (logged at debug level).
_CONNECTION_ERRORS: Final = (anyio.BrokenResourceError, anyio.ClosedResourceError, anyio.EndOfStream, OSError)


@dataclass(frozen=True, slots=True)
class ServerSettings:
    """Limits of the server, applied per connection.

    Attributes:
        limits: key length, value length and keys per request (torch's libuv defaults).
        max_buffered_bytes: the most bytes one connection may hold in the server, received but not yet a whole
            request, or replies and wake-ups not yet sent. A connection over it is closed. The default, 64 MiB,
            holds several maximal (8 MiB) values; a MULTI_SET larger than this is refused.
        max_connections: open connections beyond which a new one is closed at once. torch's server has no such
            cap. The default (None) is half the process's open-file limit at the server's start, at most 65536:
            a flood of connections is refused before it exhausts the process's file descriptors, which the
            agent also needs for its workers' pipes and log files. A job of N nodes needs about 5 N connections
            on its rendezvous store; raise the open-file limit (``ulimit -n``) for large jobs.
        handshake_timeout: seconds a new connection has to send VALIDATE (and the auth token, if one is set)
            before it is closed. torch's client sends both at once; the default, 10 s, only ends connections
            that never will.
        auth_token: if set, clients must present this token right after VALIDATE (:mod:`aelastic.store.auth`);
            torch's own client cannot, so leave it unset on a store that torch workers use.
        name: what the store is for (``"rendezvous"``, ``"workers"``): its ``store`` label in the agent's
            ``/metrics``.
    """

    limits: wire.Limits = field(default_factory=wire.Limits)
    max_buffered_bytes: int = 64 * 1024 * 1024
    max_connections: int | None = None
    handshake_timeout: float = 10.0
    auth_token: str | None = field(default=None, repr=False)
    name: str = "store"

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


class _Refused(StoreProtocolError):
    """The handshake failed: the replies so far (the auth CHECK's NOT_READY) are sent, then the connection closes."""


class _Connection(abc.ABC):
    """What the request handlers see of a connection: parser, outbox, handshake and wait state."""

    __slots__ = ("awaited", "established", "outbox", "parser", "peer", "validated", "wait_keys")

    def __init__(self, limits: wire.Limits, peer: str) -> None:
        self.peer = peer
        self.parser = wire.RequestParser(limits)
        self.outbox = bytearray()
        self.validated = False  # VALIDATE received
        self.established = False  # the whole handshake is done: requests are served
        self.awaited = 0  # keys this connection still waits for (torch's keysAwaited_)
        self.wait_keys: list[bytes] = []  # keys it is registered under, for unregistering

    def __repr__(self) -> str:
        return f"<store connection {self.peer} awaited={self.awaited} outbox={len(self.outbox)}>"

    def backlog(self) -> int:
        """Bytes queued for the peer and not yet handed to the kernel."""
        return len(self.outbox)

    def establish(self) -> None:
        """The handshake is done: serve requests from now on, with no deadline."""
        self.established = True

    @abc.abstractmethod
    def notify(self) -> None:
        """Bytes were queued in the outbox from outside this connection's own request handling."""

    @abc.abstractmethod
    def abort(self) -> None:
        """Close the connection now (from any task)."""


class _StreamConnection(_Connection):
    """A connection served by two anyio tasks (reader and writer) over a socket stream."""

    __slots__ = ("lock", "scope", "stream", "wake")

    def __init__(self, stream: anyio.abc.SocketStream, settings: ServerSettings, peer: str) -> None:
        super().__init__(settings.limits, peer)
        self.stream = stream
        self.lock = anyio.Lock(fast_acquire=True)
        self.wake = anyio.Event()
        self.scope = anyio.CancelScope(deadline=anyio.current_time() + settings.handshake_timeout)

    def establish(self) -> None:
        super().establish()
        self.scope.deadline = math.inf

    def notify(self) -> None:
        self.wake.set()

    def abort(self) -> None:
        self.outbox.clear()
        self.scope.cancel()


class _ProtocolConnection(_Connection, asyncio.BufferedProtocol):
    """A connection served by asyncio's protocol callbacks: no task, no checkpoint per request.

    On asyncio this is the fast path (about three times fewer loop iterations per request than a stream task).
    ``buffer_updated`` handles the requests and writes the replies at once; when the transport's buffer passes
    its high-water mark, reading pauses (and buffered requests wait) until it drains, so a peer that does not
    read its replies is backpressured exactly as on the stream path.

    A buffered protocol because of glibc's heap: a plain protocol gets each read as a new 256 KiB bytes object
    shrunk to what arrived, and once glibc's adaptive mmap threshold has risen past that size those come from the
    heap and fragment it. The 10,000-node soak's store grew from 60 to 280 MiB in 5 minutes that way, with its
    Python objects and allocations flat (tracemalloc) and flat RSS with ``MALLOC_MMAP_THRESHOLD_`` fixed. Every
    connection reads into the server's one scratch buffer (reads are handled one at a time, each in full before
    the next) and keeps a bytes object of exactly what arrived.
    """

    __slots__ = ("busy", "handshake_timer", "server", "transport", "writing_paused")

    def __init__(self, server: StoreServer) -> None:
        super().__init__(server._settings.limits, "<connecting>")
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.handshake_timer: asyncio.TimerHandle | None = None
        self.busy = False  # inside buffer_updated: wake-ups join the outbox in order
        self.writing_paused = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # create_server gives stream transports
        remote = transport.get_extra_info("peername")
        self.peer = format_address(str(remote[0]), int(remote[1])) if isinstance(remote, tuple) else str(remote)
        if not self.server._admit(self):
            self.transport.abort()
            return
        raw = transport.get_extra_info("socket")
        if raw is not None:
            raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        timeout = self.server._settings.handshake_timeout
        self.handshake_timer = asyncio.get_running_loop().call_later(timeout, self._handshake_expired)

    def _handshake_expired(self) -> None:
        _log_handshake_timeout(self, self.server._settings.handshake_timeout)
        self.abort()

    def establish(self) -> None:
        super().establish()
        if self.handshake_timer is not None:
            self.handshake_timer.cancel()

    def connection_lost(self, exc: Exception | None) -> None:
        if exc is not None:
            logger.debug("store connection from %s broke: %r", self.peer, exc)
        if self.handshake_timer is not None:
            self.handshake_timer.cancel()
        self.server._unregister(self)
        self.server._connections.discard(self)

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.server._scratch

    def buffer_updated(self, nbytes: int) -> None:
        self.server._receive(self, bytes(self.server._scratch[:nbytes]))
        self._run()

    def _run(self) -> None:
        server = self.server
        self.busy = True
        try:
            while server._process(self):
                self._write()
                if self.writing_paused:
                    return  # the rest waits in the parser for resume_writing
            self._write()
            server._check_buffered(self)
        except _Refused as exc:
            logger.warning("refusing store connection from %s: %s", self.peer, exc)
            self._write()
            if self.transport is not None:
                self.transport.close()  # after the queued replies are sent
        except StoreProtocolError as exc:
            logger.warning("closing store connection from %s: %s", self.peer, exc)
            self.abort()
        finally:
            self.busy = False

    def _write(self) -> None:
        if self.outbox and self.transport is not None:
            self.transport.write(bytes(self.outbox))
            self.outbox.clear()

    def pause_writing(self) -> None:
        self.writing_paused = True
        if self.transport is not None:
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        self.writing_paused = False
        if self.transport is not None and not self.transport.is_closing():
            self.transport.resume_reading()
            self._run()

    def eof_received(self) -> bool:
        logger.debug("store connection from %s closed by the peer", self.peer)
        return False

    def backlog(self) -> int:
        buffered = self.transport.get_write_buffer_size() if self.transport is not None else 0
        return len(self.outbox) + buffered

    def notify(self) -> None:
        if not self.busy:
            self._write()

    def abort(self) -> None:
        self.outbox.clear()
        if self.transport is not None:
            self.transport.abort()


def _default_max_connections() -> int:
    """Half the process's open-file limit, at most 65536 (see ``ServerSettings.max_connections``)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 65536
    return max(1, min(65536, soft // 2))


def _log_handshake_timeout(conn: _Connection, timeout: float) -> None:
    step = "the auth token" if conn.validated else "VALIDATE"
    logger.warning(
        "closing store connection from %s: no %s within %gs (ServerSettings.handshake_timeout)",
        conn.peer,
        step,
        timeout,
    )


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
        self._max_buffered = settings.max_buffered_bytes
        self._table: dict[bytes, bytes] = {}
        self._queues: dict[bytes, deque[bytes]] = {}
        self._waiters: dict[bytes, dict[_Connection, int]] = {}
        self._scratch = memoryview(bytearray(_SCRATCH_SIZE))  # asyncio connections read into it (one at a time)
        self._connections: set[_Connection] = set()
        self._at_capacity = False
        self._max_connections = settings.max_connections or _default_max_connections()
        self._auth_token = None if settings.auth_token is None else settings.auth_token.encode()
        self._ops = 0
        self._bytes_received = 0
        self._ops_by_kind: Counter[str] = Counter()
        self._sent_by_kind: Counter[str] = Counter()
        self._handlers: dict[type[Any], Callable[[_Connection, Any], None]] = {
            wire.Validate: self._validate,
            wire.Set: self._set,
            wire.CompareSet: self._compare_set,
            wire.Get: self._get,
            wire.Add: self._add,
            wire.Check: self._check,
            wire.Wait: self._wait,
            wire.GetNumKeys: self._get_num_keys,
            wire.DeleteKey: self._delete_key,
            wire.Append: self._append,
            wire.MultiGet: self._multi_get,
            wire.MultiSet: self._multi_set,
            wire.CancelWait: self._cancel_wait,
            wire.Ping: self._ping,
            wire.QueuePush: self._queue_push,
            wire.QueuePop: self._queue_pop,
            wire.QueueLen: self._queue_len,
            wire.ListKeys: self._list_keys,
            wire.Barrier: self._barrier,
        }

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
        # Waiters are counted from the registrations themselves, so that a registration left behind by a closed
        # connection (a leak) would show.
        waiting = {id(conn) for registered in self._waiters.values() for conn in registered}
        return ServerStatistics(
            name=self.name,
            port=self.port,
            connections=len(self._connections),
            keys=len(self._table),
            queued=sum(map(len, self._queues.values())),
            waiters=len(waiting),
            ops_served=self._ops,
            bytes_received=self._bytes_received,
            bytes_sent=sum(self._sent_by_kind.values()),
            ops_by_kind=dict(self._ops_by_kind),
            sent_by_kind=dict(self._sent_by_kind),
        )

    # --- connections ----------------------------------------------------------------------------------------

    def _admit(self, conn: _Connection) -> bool:
        """Count ``conn`` in, or refuse it (False) when ``max_connections`` are open."""
        limit = self._max_connections
        if len(self._connections) >= limit:
            if not self._at_capacity:  # once per episode: a flood must not flood the log too
                logger.warning(
                    "store server on port %d refuses connections (%s the first): %d are open, the limit "
                    "(ServerSettings.max_connections; by default half the open-file limit, ulimit -n)",
                    self.port,
                    conn.peer,
                    limit,
                )
            self._at_capacity = True
            return False
        self._at_capacity = False
        self._connections.add(conn)
        return True

    async def _accept_loop(self, listener: anyio.abc.SocketListener, tg: anyio.abc.TaskGroup) -> None:
        while True:
            try:
                stream = await listener.accept()
            except OSError as exc:  # EMFILE, ENFILE, ENOBUFS: the listener is fine, the process is not
                logger.warning(
                    "store server on port %d cannot accept a connection: %s (if the open-file limit is reached, "
                    "raise it: ulimit -n)",
                    self.port,
                    exc,
                )
                await anyio.sleep(_ACCEPT_BACKOFF)
                continue
            conn = _StreamConnection(stream, self._settings, _peer_of(stream))
            if self._admit(conn):
                tg.start_soon(self._serve_connection, conn)
            else:
                await anyio.aclose_forcefully(stream)

    async def _serve_connection(self, conn: _StreamConnection) -> None:
        raw = conn.stream.extra(SocketAttribute.raw_socket, None)
        if raw is not None and raw.family in (socket.AF_INET, socket.AF_INET6):
            raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # anyio sets it too; it is load-bearing
        try:
            with conn.scope:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(self._write_loop, conn)
                    await self._read_loop(conn)
                    tg.cancel_scope.cancel()
            if conn.scope.cancelled_caught and not conn.established:
                _log_handshake_timeout(conn, self._settings.handshake_timeout)
        finally:
            self._unregister(conn)
            self._connections.discard(conn)
            with anyio.CancelScope(shield=True):
                await conn.stream.aclose()

    async def _read_loop(self, conn: _StreamConnection) -> None:
        try:
            while True:
                self._receive(conn, await conn.stream.receive(_RECEIVE_SIZE))
                while self._process(conn):
                    await self._flush(conn)
                if conn.outbox:
                    await self._flush(conn)
                self._check_buffered(conn)
        except _Refused as exc:
            logger.warning("refusing store connection from %s: %s", conn.peer, exc)
            await self._flush(conn)  # the auth CHECK's NOT_READY, so that an aelastic client can say why
        except StoreProtocolError as exc:
            logger.warning("closing store connection from %s: %s", conn.peer, exc)
        except anyio.EndOfStream:
            logger.debug("store connection from %s closed by the peer", conn.peer)
        except _CONNECTION_ERRORS as exc:
            logger.debug("store connection from %s broke: %r", conn.peer, exc)

    async def _write_loop(self, conn: _StreamConnection) -> None:
        try:
            while True:
                await conn.wake.wait()
                conn.wake = anyio.Event()
                await self._flush(conn)
        except _CONNECTION_ERRORS as exc:
            logger.debug("store connection from %s broke while sending: %r", conn.peer, exc)
            conn.scope.cancel()

    async def _flush(self, conn: _StreamConnection) -> None:
        async with conn.lock:
            while conn.outbox:
                data = bytes(conn.outbox)
                conn.outbox.clear()
                await conn.stream.send(data)

    def _check_buffered(self, conn: _Connection) -> None:
        if conn.parser.buffered > self._max_buffered:
            raise StoreProtocolError(
                f"{conn.parser.buffered} bytes buffered without a whole request; "
                f"the limit is {self._max_buffered} (ServerSettings.max_buffered_bytes)"
            )

    def _receive(self, conn: _Connection, data: bytes) -> None:
        self._bytes_received += len(data)
        conn.parser.receive_data(data)

    def _process(self, conn: _Connection) -> bool:
        """Handle every whole buffered request; True if it stopped early so that the replies can be flushed."""
        parser = conn.parser
        handlers = self._handlers
        outbox = conn.outbox
        while (request := parser.next_request()) is not wire.NEED_DATA:
            self._ops += 1
            kind = type(request).__name__
            self._ops_by_kind[kind] += 1
            queued = len(outbox)
            if conn.established:
                handlers[type(request)](conn, request)
            else:
                self._handshake(conn, request)
            self._sent_by_kind[kind] += len(outbox) - queued
            if len(outbox) >= _FLUSH_AT:
                return True
        return False

    def _handshake(self, conn: _Connection, request: wire.Request) -> None:
        """VALIDATE, then (when a token is set) the token CHECK of :mod:`aelastic.store.auth`."""
        if not conn.validated:
            if not isinstance(request, wire.Validate):
                raise StoreProtocolError(f"first request is {type(request).__name__}, not VALIDATE")
            self._validate(conn, request)
            conn.validated = True
            if self._auth_token is None:
                conn.establish()
            return
        if not auth.is_token_request(request):
            raise _Refused(
                f"{type(request).__name__} where the auth token was due: this store requires one "
                "(ServerSettings.auth_token), and torch's own client cannot send it"
            )
        if not auth.token_matches(cast(wire.Check, request), self._auth_token or b""):
            conn.outbox += _NOT_READY
            raise _Refused("wrong or missing auth token (ServerSettings.auth_token)")
        conn.outbox += _READY
        conn.establish()

    def _deliver(self, conn: _Connection, data: bytes) -> None:
        """Queue a reply caused by another request (possibly another connection's) and wake the writer."""
        conn.outbox += data
        self._sent_by_kind["Wait"] += len(data)
        if (backlog := conn.backlog()) > self._max_buffered:
            logger.warning(
                "closing store connection from %s: %d bytes of replies unsent; the limit is %d "
                "(ServerSettings.max_buffered_bytes)",
                conn.peer,
                backlog,
                self._max_buffered,
            )
            conn.abort()
            return
        conn.notify()

    # --- waiters --------------------------------------------------------------------------------------------

    def _present(self, key: bytes) -> bool:
        return key in self._table or bool(self._queues.get(key))

    def _register(self, conn: _Connection, key: bytes) -> None:
        waiting = self._waiters.get(key)
        if waiting is None:
            self._waiters[key] = {conn: 1}
        else:
            waiting[conn] = waiting.get(conn, 0) + 1  # a key named twice is awaited twice, as in torch
        conn.wait_keys.append(key)

    def _unregister(self, conn: _Connection) -> None:
        """Drop every wait registration of ``conn`` (torch's clearSocketWaitState)."""
        for key in conn.wait_keys:
            waiting = self._waiters.get(key)
            if waiting is not None and waiting.pop(conn, 0) and not waiting:
                del self._waiters[key]
        conn.wait_keys.clear()
        conn.awaited = 0

    def _wake_all(self, key: bytes) -> None:
        """Every waiter of ``key`` counts it as arrived; those with nothing left to await get STOP_WAITING."""
        waiting = self._waiters.pop(key, None)
        if waiting is None:
            return
        for conn, registrations in waiting.items():
            for _ in range(registrations):  # one by one, as torch: a second WAIT may have lowered the count
                self._count_down(conn)

    def _wake_one(self, key: bytes) -> None:
        waiting = self._waiters.get(key)
        if not waiting:
            return
        conn = next(iter(waiting))  # the first to register
        if waiting[conn] > 1:
            waiting[conn] -= 1
        else:
            del waiting[conn]
            if not waiting:
                del self._waiters[key]
        self._count_down(conn)

    def _count_down(self, conn: _Connection) -> None:
        conn.awaited -= 1
        if conn.awaited == 0:
            # Fully woken: forget the (already popped) registrations so a long-lived connection does not grow.
            self._unregister(conn)
            self._deliver(conn, _STOP_WAITING)

    # --- requests -------------------------------------------------------------------------------------------

    def _validate(self, conn: _Connection, request: wire.Validate) -> None:
        if request.magic != wire.VALIDATION_MAGIC:
            raise StoreProtocolError(f"VALIDATE with magic {request.magic:#x}, expected {wire.VALIDATION_MAGIC:#x}")

    def _ping(self, conn: _Connection, request: wire.Ping) -> None:
        conn.outbox += _U32.pack(request.nonce)

    def _set(self, conn: _Connection, request: wire.Set) -> None:
        self._table[request.key] = request.value
        if self._waiters:  # the common case has none: skip the call (SET is the hottest request)
            self._wake_all(request.key)

    def _multi_set(self, conn: _Connection, request: wire.MultiSet) -> None:
        for key, value in request.items:
            self._table[key] = value
            self._wake_all(key)

    def _append(self, conn: _Connection, request: wire.Append) -> None:
        key = request.key
        self._table[key] = self._table.get(key, b"") + request.value
        self._wake_all(key)

    def _increment(self, key: bytes, delta: int) -> int:
        current = self._table.get(key)
        if current is None:
            value = delta
        else:
            try:
                value = int(current) + delta
            except ValueError:
                raise StoreProtocolError(f"ADD on key {key!r} whose value {current[:64]!r} is not an integer") from None
        if not _I64_MIN <= value <= _I64_MAX:
            raise StoreProtocolError(f"ADD on key {key!r} gives {value}, outside the range of a 64-bit integer")
        self._table[key] = str(value).encode()
        return value

    def _add(self, conn: _Connection, request: wire.Add) -> None:
        value = self._increment(request.key, request.delta)
        conn.outbox += _I64.pack(value)
        self._wake_all(request.key)

    def _compare_set(self, conn: _Connection, request: wire.CompareSet) -> None:
        key = request.key
        current = self._table.get(key)
        if current is None:
            if request.expected:
                current = request.expected  # torch's documented "lie": nothing is written
            else:
                current = self._table[key] = request.desired
        elif current == request.expected:
            current = self._table[key] = request.desired
        conn.outbox += _U64.pack(len(current)) + current
        self._wake_all(key)  # libuv wakes on every path, even when nothing was written

    def _get(self, conn: _Connection, request: wire.Get) -> None:
        value = self._table.get(request.key, b"")
        conn.outbox += _U64.pack(len(value))
        conn.outbox += value

    def _multi_get(self, conn: _Connection, request: wire.MultiGet) -> None:
        table = self._table
        outbox = conn.outbox
        for key in request.keys:
            value = table.get(key, b"")
            outbox += _U64.pack(len(value))
            outbox += value

    def _check(self, conn: _Connection, request: wire.Check) -> None:
        conn.outbox += _READY if all(self._present(key) for key in request.keys) else _NOT_READY

    def _wait(self, conn: _Connection, request: wire.Wait) -> None:
        missing = [key for key in request.keys if not self._present(key)]
        if not missing:
            conn.outbox += _STOP_WAITING
            return
        for key in missing:
            self._register(conn, key)
        conn.awaited = len(missing)  # as torch: a second outstanding WAIT overwrites the first's count

    def _cancel_wait(self, conn: _Connection, request: wire.CancelWait) -> None:
        self._unregister(conn)
        conn.outbox += _WAIT_CANCELED

    def _get_num_keys(self, conn: _Connection, request: wire.GetNumKeys) -> None:
        conn.outbox += _I64.pack(len(self._table))

    def _delete_key(self, conn: _Connection, request: wire.DeleteKey) -> None:
        conn.outbox += _I64.pack(0 if self._table.pop(request.key, None) is None else 1)

    def _list_keys(self, conn: _Connection, request: wire.ListKeys) -> None:
        conn.outbox += wire.encode_reply(wire.KeysReply(tuple(self._table)))

    def _barrier(self, conn: _Connection, request: wire.Barrier) -> None:
        count = self._increment(request.key, 1)
        if count >= request.world_size:
            conn.outbox += _STOP_WAITING
            self._wake_all(request.key)
        else:
            self._register(conn, request.key)
            conn.awaited = 1

    def _queue_push(self, conn: _Connection, request: wire.QueuePush) -> None:
        queue = self._queues.get(request.key)
        if queue is None:
            queue = self._queues[request.key] = deque()
        queue.append(request.value)
        self._wake_one(request.key)

    def _queue_pop(self, conn: _Connection, request: wire.QueuePop) -> None:
        queue = self._queues.get(request.key)
        if not queue:
            conn.outbox += _I64.pack(0)
            return
        conn.outbox += _I64.pack(len(queue))
        value = queue.popleft()
        conn.outbox += _U64.pack(len(value))
        conn.outbox += value
        if not queue:
            del self._queues[request.key]

    def _queue_len(self, conn: _Connection, request: wire.QueueLen) -> None:
        queue = self._queues.get(request.key)
        conn.outbox += _I64.pack(len(queue) if queue else 0)


def _peer_of(stream: anyio.abc.SocketStream) -> str:
    try:
        remote = stream.extra(SocketAttribute.remote_address)
    except (OSError, anyio.TypedAttributeLookupError):
        return "<unknown peer>"
    return format_address(str(remote[0]), int(remote[1])) if isinstance(remote, tuple) else str(remote)


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
    server = StoreServer(host, addresses, settings)
    _serving.add(server)
    try:
        if _running_asyncio():
            await _serve_asyncio(server, sockets, task_status=task_status)
        else:
            await _serve_anyio(server, sockets, task_status=task_status)
    finally:
        _serving.discard(server)


# The servers this process runs now: the agent's /metrics (aelastic.agent.control) reads their statistics when
# scraped, whoever started them (the c10d rendezvous's host, the workers' store of the round, `aelastic store`).
_serving: set[StoreServer] = set()


def serving() -> list[StoreServer]:
    """The store servers running in this process, by port."""
    return sorted(_serving, key=lambda server: server.port)


def _running_asyncio() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


async def _serve_anyio(
    server: StoreServer, sockets: list[socket.socket], *, task_status: anyio.abc.TaskStatus[StoreServer]
) -> None:
    """Any anyio backend (trio): a task per listener, two per connection."""
    listeners: list[anyio.abc.SocketListener] = []
    try:
        listeners.extend([await anyio.abc.SocketListener.from_socket(sock) for sock in sockets])
        async with anyio.create_task_group() as tg:
            for listener in listeners:
                tg.start_soon(server._accept_loop, listener, tg)
            _log_listening(server)
            task_status.started(server)
    finally:
        with anyio.CancelScope(shield=True):
            for listener in listeners:
                await listener.aclose()
            for sock in sockets[len(listeners) :]:
                sock.close()


async def _serve_asyncio(
    server: StoreServer, sockets: list[socket.socket], *, task_status: anyio.abc.TaskStatus[StoreServer]
) -> None:
    """asyncio: the loop's own server and protocol callbacks (see :class:`_ProtocolConnection`)."""
    loop = asyncio.get_running_loop()
    servers: list[asyncio.Server] = []
    try:
        servers.extend(
            [
                await loop.create_server(lambda: _ProtocolConnection(server), sock=sock, backlog=_BACKLOG)
                for sock in sockets
            ]
        )
        _log_listening(server)
        task_status.started(server)
        await anyio.sleep_forever()
    finally:
        with anyio.CancelScope(shield=True):
            for listening in servers:
                listening.close()
            for sock in sockets[len(servers) :]:
                sock.close()
            for conn in list(server._connections):
                conn.abort()
            await anyio.lowlevel.checkpoint()  # let the aborted transports report connection_lost


def _log_listening(server: StoreServer) -> None:
    logger.info("store server listening on %s", ", ".join(format_address(a, p) for a, p in server.addresses))


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
