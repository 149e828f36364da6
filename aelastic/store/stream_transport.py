"""The store server's transport on any anyio backend (trio): anyio listeners and two tasks per connection.

Theory of operation
-------------------
A task per listener accepts; each connection is served by two tasks in a cancel scope of its own, whose deadline
is the handshake timeout until the handshake is done:

* The *reader* receives a chunk (up to ``_RECEIVE_SIZE`` bytes), feeds it to the
  :class:`~aelastic.store.table.StoreTable`, handles every whole request in it and flushes the outbox with one
  ``send``; a slow peer stalls only its own reader. The hot path is ``_read_loop`` → ``table.process`` →
  ``_flush``.
* The *writer* delivers wake-ups that other connections caused: the waker appends ``STOP_WAITING`` to the outbox
  and sets an event (``notify``), never sending on a foreign stream.

Both send only while holding the connection's lock (trio refuses concurrent sends on one stream) and drain the same
outbox, so bytes leave in the order the events happened. A protocol violation ends the reader, which closes the
connection; a peer that goes away ends it quietly (logged at debug level).

Cancelling :func:`serve_streams` closes the listeners and every connection.
"""

from __future__ import annotations

import logging
import math
import socket
from typing import Final

import anyio
import anyio.abc
from anyio.abc import SocketAttribute

from .._net import format_address
from ..errors import StoreProtocolError
from .table import Connection, Refused, StoreTable, log_handshake_timeout

__all__ = ["serve_streams"]

logger = logging.getLogger(__name__)

_RECEIVE_SIZE: Final = 65536
_ACCEPT_BACKOFF: Final = 0.1  # after EMFILE & co., before accepting again

# Peer-side failures that end one connection quietly (logged at debug level).
_CONNECTION_ERRORS: Final = (anyio.BrokenResourceError, anyio.ClosedResourceError, anyio.EndOfStream, OSError)


class _StreamConnection(Connection):
    """A connection served by two anyio tasks (reader and writer) over a socket stream."""

    __slots__ = ("lock", "scope", "stream", "wake")

    def __init__(self, stream: anyio.abc.SocketStream, table: StoreTable, handshake_timeout: float) -> None:
        super().__init__(table.limits, _peer_of(stream))
        self.stream = stream
        self.lock = anyio.Lock(fast_acquire=True)
        self.wake = anyio.Event()
        self.scope = anyio.CancelScope(deadline=anyio.current_time() + handshake_timeout)

    def establish(self) -> None:
        super().establish()
        self.scope.deadline = math.inf

    def notify(self) -> None:
        self.wake.set()

    def abort(self) -> None:
        self.outbox.clear()
        self.scope.cancel()


def _peer_of(stream: anyio.abc.SocketStream) -> str:
    try:
        remote = stream.extra(SocketAttribute.remote_address)
    except (OSError, anyio.TypedAttributeLookupError):
        return "<unknown peer>"
    return format_address(str(remote[0]), int(remote[1])) if isinstance(remote, tuple) else str(remote)


async def serve_streams(
    table: StoreTable,
    sockets: list[socket.socket],
    *,
    handshake_timeout: float,
    task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``table`` on the listening ``sockets`` with anyio listeners until cancelled.

    Reports ``task_status.started()`` once every socket accepts. Cancellation closes the listeners (and the
    sockets not yet handed to anyio) and every connection.
    """
    listeners: list[anyio.abc.SocketListener] = []
    try:
        listeners.extend([await anyio.abc.SocketListener.from_socket(sock) for sock in sockets])
        async with anyio.create_task_group() as tg:
            for listener in listeners:
                tg.start_soon(_accept_loop, table, handshake_timeout, listener, tg)
            task_status.started()
    finally:
        with anyio.CancelScope(shield=True):
            for listener in listeners:
                await listener.aclose()
            for sock in sockets[len(listeners) :]:
                sock.close()


async def _accept_loop(
    table: StoreTable, handshake_timeout: float, listener: anyio.abc.SocketListener, tg: anyio.abc.TaskGroup
) -> None:
    while True:
        try:
            stream = await listener.accept()
        except OSError as exc:  # EMFILE, ENFILE, ENOBUFS: the listener is fine, the process is not
            logger.warning(
                "store server on port %d cannot accept a connection: %s (if the open-file limit is reached, "
                "raise it: ulimit -n)",
                table.port,
                exc,
            )
            await anyio.sleep(_ACCEPT_BACKOFF)
            continue
        conn = _StreamConnection(stream, table, handshake_timeout)
        if table.admit(conn):
            tg.start_soon(_serve_connection, table, conn, handshake_timeout)
        else:
            await anyio.aclose_forcefully(stream)


async def _serve_connection(table: StoreTable, conn: _StreamConnection, handshake_timeout: float) -> None:
    raw = conn.stream.extra(SocketAttribute.raw_socket, None)
    if raw is not None and raw.family in (socket.AF_INET, socket.AF_INET6):
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # anyio sets it too; it is load-bearing
    try:
        with conn.scope:
            async with anyio.create_task_group() as tg:
                tg.start_soon(_write_loop, conn)
                await _read_loop(table, conn)
                tg.cancel_scope.cancel()
        if conn.scope.cancelled_caught and not conn.established:
            log_handshake_timeout(conn, handshake_timeout)
    finally:
        table.drop(conn)
        with anyio.CancelScope(shield=True):
            await conn.stream.aclose()


async def _read_loop(table: StoreTable, conn: _StreamConnection) -> None:
    try:
        while True:
            table.receive(conn, await conn.stream.receive(_RECEIVE_SIZE))
            while table.process(conn):
                await _flush(conn)
            if conn.outbox:
                await _flush(conn)
            table.check_buffered(conn)
    except Refused as exc:
        logger.warning("refusing store connection from %s: %s", conn.peer, exc)
        await _flush(conn)  # the auth CHECK's NOT_READY, so that an aelastic client can say why
    except StoreProtocolError as exc:
        logger.warning("closing store connection from %s: %s", conn.peer, exc)
    except anyio.EndOfStream:
        logger.debug("store connection from %s closed by the peer", conn.peer)
    except _CONNECTION_ERRORS as exc:
        logger.debug("store connection from %s broke: %r", conn.peer, exc)


async def _write_loop(conn: _StreamConnection) -> None:
    try:
        while True:
            await conn.wake.wait()
            conn.wake = anyio.Event()
            await _flush(conn)
    except _CONNECTION_ERRORS as exc:
        logger.debug("store connection from %s broke while sending: %r", conn.peer, exc)
        conn.scope.cancel()


async def _flush(conn: _StreamConnection) -> None:
    async with conn.lock:
        while conn.outbox:
            data = bytes(conn.outbox)
            conn.outbox.clear()
            await conn.stream.send(data)
