"""The store server's sans-IO core: the table, the queues, the waiters and one handler per request kind.

Theory of operation
-------------------
State is one in-memory table (``bytes -> bytes``), a map of queues (``bytes -> deque``) and the waiters: for each
key, the connections waiting for it (in the order they registered, each with how many of its registrations are
for that key), and per connection how many keys it still awaits. Registering and unregistering are O(1) however
many connections wait for the key: at 10,000 nodes every node waits for the same key, and each heartbeat cancels
one wait (a list scanned per cancel made the server's work per heartbeat interval grow as N²).

A transport (:mod:`.asyncio_transport`, :mod:`.stream_transport`) owns the sockets. For each connection it hands
this core a :class:`Connection` (the request parser, the *outbox* of encoded replies, the handshake and wait
state, and three methods only the transport can implement: ``notify``, ``abort``, ``backlog``), then per chunk
received::

    table.receive(conn, data)      # count the bytes, buffer them in the connection's parser
    while table.process(conn):     # handle every whole request; True: the outbox passed _FLUSH_AT, flush it first
        flush(conn.outbox)
    flush(conn.outbox)
    table.check_buffered(conn)     # too much of a request buffered: StoreProtocolError

Every request is handled by a plain (non-async) method that mutates the state and appends the encoded reply to
the connection's outbox; nothing awaits between the start and the end of a request, so requests are atomic with
respect to each other and no lock guards the table. A request that wakes *another* connection (SET of a key it
waits for, QUEUE_PUSH, the last BARRIER arrival) appends ``STOP_WAITING`` to that connection's outbox and calls
its ``notify``; the transport decides how those bytes leave (:meth:`StoreTable.deliver`).

The hot path, per request: :meth:`StoreTable.process` (parse, count, dispatch through ``_dispatch`` by the
request's type), then the handler (``_set``, ``_get``, ``_add``, ... below), which packs its reply straight into
``conn.outbox``. What a transport does around it (copies of the received chunk, one write per chunk) is in the
transport's module.

A protocol violation (first request not VALIDATE, a key/value/key-count over the limits, ADD on a non-numeric
value, more than ``max_buffered_bytes`` unparsed or unsent) raises :class:`~aelastic.errors.StoreProtocolError`
out of :meth:`StoreTable.process` (or closes the woken connection, for unsent wake-ups); the transport logs it and
closes that one connection, then :meth:`StoreTable.drop` forgets its wait registrations. Nothing else is affected.

Nothing here imports anyio or asyncio, reads a clock or touches a socket.
"""

from __future__ import annotations

import abc
import logging
import struct
from collections import Counter, deque
from collections.abc import Callable
from typing import Any, Final, cast

from ..errors import StoreProtocolError
from . import auth, wire

__all__ = ["Connection", "Refused", "StoreTable", "log_handshake_timeout"]

logger = logging.getLogger(__name__)

_FLUSH_AT: Final = 256 * 1024  # flush replies mid-chunk once this many bytes are queued

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_I64 = struct.Struct("<q")
_I64_MIN: Final = -(2**63)
_I64_MAX: Final = 2**63 - 1

_STOP_WAITING: Final = bytes((wire.WaitResponse.STOP_WAITING,))
_WAIT_CANCELED: Final = bytes((wire.WaitResponse.WAIT_CANCELED,))
_READY: Final = bytes((wire.CheckResponse.READY,))
_NOT_READY: Final = bytes((wire.CheckResponse.NOT_READY,))


class Refused(StoreProtocolError):
    """The handshake failed: the replies so far (the auth CHECK's NOT_READY) are sent, then the connection closes."""


class Connection(abc.ABC):
    """What the request handlers see of a connection: parser, outbox, handshake and wait state.

    A transport subclasses it and implements how queued bytes leave (``notify``), how the connection closes, at
    once (``abort``) or once the replies queued so far are sent (``linger``), and how many bytes wait to be sent
    (``backlog``). Which of them ends a connection whose handling raised is decided here, once (:meth:`end`).
    """

    __slots__ = ("_peer", "awaited", "established", "outbox", "parser", "validated", "wait_keys")

    def __init__(self, limits: wire.Limits, peer: str | None) -> None:
        self._peer = peer  # None: looked up (peer_name) the first time a message names it
        self.parser = wire.RequestParser(limits)
        self.outbox = bytearray()
        self.validated = False  # VALIDATE received
        self.established = False  # the whole handshake is done: requests are served
        self.awaited = 0  # keys this connection still waits for (torch's keysAwaited_)
        self.wait_keys: list[bytes] = []  # keys it is registered under, for unregistering

    def __repr__(self) -> str:
        return f"<store connection {self.peer} awaited={self.awaited} outbox={len(self.outbox)}>"

    @property
    def peer(self) -> str:
        """The peer's address, for messages."""
        if self._peer is None:
            self._peer = self.peer_name()
        return self._peer

    def peer_name(self) -> str:
        """The peer's address, where the transport did not give it up front (a system call saved per connection)."""
        return "<unknown peer>"

    def backlog(self) -> int:
        """Bytes queued for the peer and not yet handed to the kernel."""
        return len(self.outbox)

    def establish(self) -> None:
        """The handshake is done: serve requests from now on, with no deadline."""
        self.established = True

    def end(self, exc: Exception) -> None:
        """Close the connection whose request handling ``exc`` ended (call it in the transport's ``except
        Exception`` block): refused (:class:`Refused`), once the replies queued so far are sent, so that an aelastic
        client reads the auth CHECK's NOT_READY and can say why; a protocol violation, at once; anything else is a
        bug (:meth:`fail`)."""
        if isinstance(exc, Refused):
            logger.warning("refusing store connection from %s: %s", self.peer, exc)
            self.linger()
        elif isinstance(exc, StoreProtocolError):
            logger.warning("closing store connection from %s: %s", self.peer, exc)
            self.abort()
        else:
            self.fail()

    def fail(self) -> None:
        """A bug met while handling this connection's requests (call it in an ``except Exception`` block): log it
        with its traceback and close this connection only. The store serves the others on, on every transport, as
        asyncio's own loop treats an exception from a protocol callback."""
        logger.exception("internal error handling a request from %s; closing that connection", self.peer)
        self.abort()

    @abc.abstractmethod
    def notify(self) -> None:
        """Bytes were queued in the outbox from outside this connection's own request handling."""

    @abc.abstractmethod
    def abort(self) -> None:
        """Close the connection now (from any task)."""

    @abc.abstractmethod
    def linger(self) -> None:
        """Send the replies queued so far, then close the connection; read nothing more from it."""


def log_handshake_timeout(conn: Connection, timeout: float) -> None:
    """Say which step of the handshake ``conn`` did not finish within ``timeout`` seconds (the transport's timer)."""
    step = "the auth token" if conn.validated else "VALIDATE"
    logger.warning(
        "closing store connection from %s: no %s within %gs (ServerSettings.handshake_timeout)",
        conn.peer,
        step,
        timeout,
    )


class _Admission:
    """Who a store lets in: at most ``limit`` open connections, refusals logged once per episode (a flood must not
    flood the log too), and who is told of each connection that opens or closes (``ServerSettings.on_connection``)."""

    __slots__ = ("_at_capacity", "limit", "on_connection", "port")

    def __init__(self, limit: int, port: int, on_connection: Callable[[str, bool], None] | None) -> None:
        self.limit = limit
        self.port = port
        self.on_connection = on_connection
        self._at_capacity = False

    def admits(self, open_now: int, peer: str) -> bool:
        if open_now >= self.limit:
            if not self._at_capacity:
                logger.warning(
                    "store server on port %d refuses connections (%s the first): %d are open, the limit "
                    "(ServerSettings.max_connections; by default the open-file limit less 1,024, ulimit -n)",
                    self.port,
                    peer,
                    self.limit,
                )
            self._at_capacity = True
            return False
        self._at_capacity = False
        return True

    def told(self, peer: str, opened: bool) -> None:
        if self.on_connection is not None:
            self.on_connection(peer, opened)


class StoreTable:
    """The state of one store server and its request handlers (see the module docstring).

    Attributes:
        connections: the open (admitted) connections.
        ops: requests handled so far; ``ops_by_kind`` per request kind (``"Get"``, ...).
        bytes_received: bytes received from clients so far.
        sent_by_kind: reply bytes queued per request kind; a WAIT's wake-up counts under ``"Wait"``.
    """

    def __init__(
        self,
        limits: wire.Limits,
        *,
        max_buffered_bytes: int,
        max_connections: int,
        auth_token: str | None,
        port: int,
        on_connection: Callable[[str, bool], None] | None = None,
    ) -> None:
        self.limits = limits
        self._admission = _Admission(max_connections, port, on_connection)
        self._max_buffered = max_buffered_bytes
        self._auth_token = None if auth_token is None else auth_token.encode()
        self._table: dict[bytes, bytes] = {}
        self._queues: dict[bytes, deque[bytes]] = {}
        self._waiters: dict[bytes, dict[Connection, int]] = {}
        self.connections: set[Connection] = set()
        self.bytes_received = 0
        handlers: dict[type[Any], Callable[[Connection, Any], None]] = {
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
        # Per request kind: its handler and its slot in two lists of counters. Counting into a list by index is
        # what the hot path can afford; the names (``ops_by_kind``) are made when statistics are read.
        self._kinds = tuple(kind.__name__ for kind in handlers)
        self._dispatch = {kind: (handler, index) for index, (kind, handler) in enumerate(handlers.items())}
        self._op_counts = [0] * len(handlers)
        self._sent_counts = [0] * len(handlers)
        self._wait_index = self._kinds.index("Wait")
        self._set_index = self._kinds.index("Set")

    def __repr__(self) -> str:
        return f"<StoreTable keys={len(self._table)} connections={len(self.connections)} ops={self.ops}>"

    # --- what statistics read -------------------------------------------------------------------------------

    @property
    def ops(self) -> int:
        """Requests handled so far."""
        return sum(self._op_counts)

    @property
    def ops_by_kind(self) -> Counter[str]:
        """Requests handled per request kind (``"Get"``, ...), the kinds seen so far."""
        return Counter({kind: n for kind, n in zip(self._kinds, self._op_counts, strict=True) if n})

    @property
    def sent_by_kind(self) -> Counter[str]:
        """Reply bytes queued per request kind (the kinds seen so far); a WAIT's wake-up counts under ``"Wait"``."""
        return Counter(
            {
                kind: sent
                for kind, n, sent in zip(self._kinds, self._op_counts, self._sent_counts, strict=True)
                if n or sent
            }
        )

    def key_count(self) -> int:
        return len(self._table)

    def queued_count(self) -> int:
        return sum(map(len, self._queues.values()))

    def waiter_count(self) -> int:
        """Connections registered as waiting, counted from the registrations themselves, so that a registration
        left behind by a closed connection (a leak) would show."""
        return len({id(conn) for registered in self._waiters.values() for conn in registered})

    # --- connections ----------------------------------------------------------------------------------------

    @property
    def port(self) -> int:
        """The server's port (for log messages)."""
        return self._admission.port

    def admit(self, conn: Connection) -> bool:
        """Count ``conn`` in, or refuse it (False) when ``max_connections`` are open."""
        if not self._admission.admits(len(self.connections), conn.peer):
            return False
        self.connections.add(conn)
        self._admission.told(conn.peer, True)
        return True

    def drop(self, conn: Connection) -> None:
        """``conn`` is closed: forget it and its wait registrations."""
        self._unregister(conn)
        if conn in self.connections:
            self.connections.discard(conn)
            self._admission.told(conn.peer, False)

    def receive(self, conn: Connection, data: bytes) -> None:
        self.bytes_received += len(data)
        conn.parser.receive_data(data)

    def check_buffered(self, conn: Connection) -> None:
        if conn.parser.buffered > self._max_buffered:
            raise StoreProtocolError(
                f"{conn.parser.buffered} bytes buffered without a whole request; "
                f"the limit is {self._max_buffered} (ServerSettings.max_buffered_bytes)"
            )

    def process(self, conn: Connection) -> bool:
        """Handle every whole buffered request; True if it stopped early so that the replies can be flushed.

        Raises:
            StoreProtocolError: the connection broke the protocol (:class:`Refused`: the handshake failed, and
                the outbox holds the replies to send before closing).
        """
        next_request = conn.parser.next_request
        dispatch = self._dispatch
        op_counts = self._op_counts
        sent_counts = self._sent_counts
        outbox = conn.outbox
        need_data = wire.NEED_DATA
        set_type, set_index, table = wire.Set, self._set_index, self._table
        while (request := next_request()) is not need_data:
            kind = type(request)
            if kind is set_type and conn.established:  # the hottest request, inline: no reply, no handler call
                key, value = cast(wire.Set, request)
                table[key] = value
                if self._waiters:
                    op_counts[set_index] += 1
                    self._wake_all(key)
                else:  # nobody to wake: the SETs right behind it go straight into the table
                    op_counts[set_index] += 1 + conn.parser.store_sets(table)
                continue
            handler, index = dispatch[kind]
            op_counts[index] += 1
            queued = len(outbox)
            if conn.established:
                handler(conn, request)
            else:
                self._handshake(conn, request)
            sent = len(outbox) - queued
            if sent:
                sent_counts[index] += sent
                if len(outbox) >= _FLUSH_AT:
                    return True
        return False

    def _handshake(self, conn: Connection, request: wire.Request) -> None:
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
            raise Refused(
                f"{type(request).__name__} where the auth token was due: this store requires one "
                "(ServerSettings.auth_token), and torch's own client cannot send it"
            )
        if not auth.token_matches(cast(wire.Check, request), self._auth_token or b""):
            conn.outbox += _NOT_READY
            raise Refused("wrong or missing auth token (ServerSettings.auth_token)")
        conn.outbox += _READY
        conn.establish()

    def deliver(self, conn: Connection, data: bytes) -> None:
        """Queue a reply caused by another request (possibly another connection's) and notify the transport."""
        conn.outbox += data
        self._sent_counts[self._wait_index] += len(data)
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

    def _register(self, conn: Connection, key: bytes) -> None:
        waiting = self._waiters.get(key)
        if waiting is None:
            self._waiters[key] = {conn: 1}
        else:
            waiting[conn] = waiting.get(conn, 0) + 1  # a key named twice is awaited twice, as in torch
        conn.wait_keys.append(key)

    def _unregister(self, conn: Connection) -> None:
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

    def _count_down(self, conn: Connection) -> None:
        conn.awaited -= 1
        if conn.awaited == 0:
            # Fully woken: forget the (already popped) registrations so a long-lived connection does not grow.
            self._unregister(conn)
            self.deliver(conn, _STOP_WAITING)

    # --- requests -------------------------------------------------------------------------------------------

    def _validate(self, conn: Connection, request: wire.Validate) -> None:
        if request.magic != wire.VALIDATION_MAGIC:
            raise StoreProtocolError(f"VALIDATE with magic {request.magic:#x}, expected {wire.VALIDATION_MAGIC:#x}")

    def _ping(self, conn: Connection, request: wire.Ping) -> None:
        conn.outbox += _U32.pack(request.nonce)

    def _set(self, conn: Connection, request: wire.Set) -> None:
        self._table[request.key] = request.value
        if self._waiters:  # the common case has none: skip the call (SET is the hottest request)
            self._wake_all(request.key)

    def _multi_set(self, conn: Connection, request: wire.MultiSet) -> None:
        for key, value in request.items:
            self._table[key] = value
            self._wake_all(key)

    def _append(self, conn: Connection, request: wire.Append) -> None:
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

    def _add(self, conn: Connection, request: wire.Add) -> None:
        value = self._increment(request.key, request.delta)
        conn.outbox += _I64.pack(value)
        self._wake_all(request.key)

    def _compare_set(self, conn: Connection, request: wire.CompareSet) -> None:
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

    def _get(self, conn: Connection, request: wire.Get) -> None:
        value = self._table.get(request.key, b"")
        conn.outbox += _U64.pack(len(value))
        conn.outbox += value

    def _multi_get(self, conn: Connection, request: wire.MultiGet) -> None:
        table = self._table
        outbox = conn.outbox
        for key in request.keys:
            value = table.get(key, b"")
            outbox += _U64.pack(len(value))
            outbox += value

    def _check(self, conn: Connection, request: wire.Check) -> None:
        conn.outbox += _READY if all(self._present(key) for key in request.keys) else _NOT_READY

    def _wait(self, conn: Connection, request: wire.Wait) -> None:
        missing = [key for key in request.keys if not self._present(key)]
        if not missing:
            conn.outbox += _STOP_WAITING
            return
        for key in missing:
            self._register(conn, key)
        conn.awaited = len(missing)  # as torch: a second outstanding WAIT overwrites the first's count

    def _cancel_wait(self, conn: Connection, request: wire.CancelWait) -> None:
        self._unregister(conn)
        conn.outbox += _WAIT_CANCELED

    def _get_num_keys(self, conn: Connection, request: wire.GetNumKeys) -> None:
        conn.outbox += _I64.pack(len(self._table))

    def _delete_key(self, conn: Connection, request: wire.DeleteKey) -> None:
        conn.outbox += _I64.pack(0 if self._table.pop(request.key, None) is None else 1)

    def _list_keys(self, conn: Connection, request: wire.ListKeys) -> None:
        conn.outbox += wire.encode_reply(wire.KeysReply(tuple(self._table)))

    def _barrier(self, conn: Connection, request: wire.Barrier) -> None:
        count = self._increment(request.key, 1)
        if count >= request.world_size:
            conn.outbox += _STOP_WAITING
            self._wake_all(request.key)
        else:
            self._register(conn, request.key)
            conn.awaited = 1

    def _queue_push(self, conn: Connection, request: wire.QueuePush) -> None:
        queue = self._queues.get(request.key)
        if queue is None:
            queue = self._queues[request.key] = deque()
        queue.append(request.value)
        self._wake_one(request.key)

    def _queue_pop(self, conn: Connection, request: wire.QueuePop) -> None:
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

    def _queue_len(self, conn: Connection, request: wire.QueueLen) -> None:
        queue = self._queues.get(request.key)
        conn.outbox += _I64.pack(len(queue) if queue else 0)
