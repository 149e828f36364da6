"""The store server's transport on any anyio backend (trio): non-blocking sockets and one task per connection.

Theory of operation
-------------------
A task per listener waits until it is readable and then accepts every connection queued in the backlog (a burst
of thousands is accepted in a few loop iterations, not one wait per connection). Each connection is served by one
task, the *reader*, in a cancel scope of its own whose deadline is the handshake timeout until the handshake is
done. The reader waits until its socket is readable (``anyio.wait_readable``), receives what arrived into the
server's one scratch buffer (as the asyncio transport does: no 64 KiB bytes object per read for glibc's heap to
fragment), feeds it to the :class:`~aelastic.store.table.StoreTable`, handles every whole request in it and sends
the outbox with one non-blocking ``send``. The hot path is ``_read_loop`` → ``table.process`` → ``flush``.

Sending never waits in the common case: a ``send`` on a non-blocking socket takes what the kernel accepts, and a
store's replies are small. Wake-ups caused by another connection (``notify``) are sent the same way, by the waker,
synchronously, so bytes leave in the order the events happened. Only when the kernel's buffer is full (a peer that
does not read its replies) is a *drain* task started for that connection: it waits until the socket is writable
and sends the rest; meanwhile the reader reads nothing more (backpressure) and everything queued joins the outbox
behind the unsent bytes. One task per connection instead of a reader, a writer and a task group each: the 4,096
simulated ranks of ``benchmarks/rank_scale.py`` took 2.3 times asyncio's time with those.

A protocol violation ends the reader, which closes the connection; a peer that goes away ends it quietly (logged at
debug level). Cancelling :func:`serve_streams` closes the listeners and every connection.
"""

from __future__ import annotations

import errno
import logging
import math
import socket
import sys
from collections.abc import Awaitable, Callable
from typing import Any, Final, cast

import anyio
import anyio.abc

from .._net import format_address
from ..errors import StoreProtocolError
from .table import Connection, Refused, StoreTable, log_handshake_timeout

__all__ = ["serve_streams"]

logger = logging.getLogger(__name__)

_RECEIVE_SIZE: Final = 65536
_ACCEPT_BACKOFF: Final = 0.1  # after EMFILE & co., before accepting again
# accept() errors that concern the one connection (it went away while queued), not the listener or the process.
_ACCEPT_TRANSIENT: Final = frozenset({errno.ECONNABORTED, errno.EPROTO, errno.EPERM})

# Peer-side failures that end one connection quietly (logged at debug level).
_CONNECTION_ERRORS: Final = (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError)


class _Serving:
    """What the connections of one server share: the table, the task group for drains and the scratch buffer."""

    __slots__ = ("handshake_timeout", "scratch", "table", "tg", "wait_readable")

    def __init__(self, table: StoreTable, handshake_timeout: float, tg: anyio.abc.TaskGroup) -> None:
        self.table = table
        self.handshake_timeout = handshake_timeout
        self.tg = tg
        self.scratch = memoryview(bytearray(_RECEIVE_SIZE))  # every reader receives into it (one at a time)
        self.wait_readable = _wait_readable_function()


def _wait_readable_function() -> Callable[[socket.socket], Awaitable[None]]:
    """trio's own ``wait_readable`` when running on trio: anyio's looks the running library up on every call, a
    third of the wait's cost, once per request."""
    trio = sys.modules.get("trio")
    if trio is not None:
        try:
            trio.lowlevel.current_trio_token()
        except RuntimeError:  # trio is imported but not running this thread
            pass
        else:
            return cast("Callable[[socket.socket], Awaitable[None]]", trio.lowlevel.wait_readable)
    return anyio.wait_readable


class _SocketConnection(Connection):
    """A connection served by one reader task over a non-blocking socket (and a drain task while backpressured)."""

    __slots__ = ("address", "closed", "drained", "draining", "scope", "serving", "sock")

    def __init__(self, sock: socket.socket, address: Any, serving: _Serving) -> None:
        super().__init__(serving.table.limits, None)
        self.sock = sock
        self.address = address
        self.serving = serving
        self.scope = anyio.CancelScope(deadline=anyio.current_time() + serving.handshake_timeout)
        self.closed = False
        self.draining = False  # a drain task owns the sending until the outbox is empty
        self.drained: anyio.Event | None = None

    def peer_name(self) -> str:
        address = self.address
        return format_address(str(address[0]), int(address[1])) if isinstance(address, tuple) else str(address)

    def establish(self) -> None:
        super().establish()
        self.scope.deadline = math.inf

    def flush(self) -> None:
        """Send what the kernel takes now; start a drain task for the rest. Never waits, never raises."""
        if self.draining or self.closed:
            return  # the drain task sends it, after the bytes already waiting
        outbox = self.outbox
        try:
            while outbox:
                sent = self.sock.send(outbox)
                del outbox[:sent]
        except BlockingIOError:
            self.draining = True
            self.drained = anyio.Event()
            self.serving.tg.start_soon(_drain, self)
        except OSError as exc:
            logger.debug("store connection from %s broke while sending: %r", self.peer, exc)
            self.abort()

    def notify(self) -> None:
        self.flush()

    def backlog(self) -> int:
        return len(self.outbox)

    def abort(self) -> None:
        self.outbox.clear()
        self.scope.cancel()


async def serve_streams(
    table: StoreTable,
    sockets: list[socket.socket],
    *,
    handshake_timeout: float,
    task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``table`` on the listening ``sockets`` until cancelled.

    Reports ``task_status.started()`` once every socket accepts. Cancellation closes the listeners and every
    connection.
    """
    try:
        async with anyio.create_task_group() as tg:
            serving = _Serving(table, handshake_timeout, tg)
            for sock in sockets:
                sock.setblocking(False)
                tg.start_soon(_accept_loop, serving, sock)
            task_status.started()
    finally:
        for sock in sockets:
            sock.close()


async def _accept_loop(serving: _Serving, listener: socket.socket) -> None:
    table = serving.table
    while True:
        await anyio.wait_readable(listener)
        while True:  # every connection the backlog holds, then wait again
            try:
                sock, address = listener.accept()
            except BlockingIOError:
                break
            except OSError as exc:
                if exc.errno in _ACCEPT_TRANSIENT:
                    continue
                # EMFILE, ENFILE, ENOBUFS: the listener is fine, the process is not
                logger.warning(
                    "store server on port %d cannot accept a connection: %s (if the open-file limit is reached, "
                    "raise it: ulimit -n)",
                    table.port,
                    exc,
                )
                await anyio.sleep(_ACCEPT_BACKOFF)
                break
            sock.setblocking(False)
            if sock.family in (socket.AF_INET, socket.AF_INET6):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # load-bearing: one reply per request
            conn = _SocketConnection(sock, address, serving)
            if table.admit(conn):
                serving.tg.start_soon(_serve_connection, conn)
            else:
                sock.close()


async def _serve_connection(conn: _SocketConnection) -> None:
    table = conn.serving.table
    try:
        with conn.scope:
            await _read_loop(table, conn)
        if conn.scope.cancelled_caught and not conn.established:
            log_handshake_timeout(conn, conn.serving.handshake_timeout)
    finally:
        table.drop(conn)
        conn.closed = True
        if conn.draining:
            anyio.notify_closing(conn.sock)  # the drain task, waiting until the socket is writable, gives up
        conn.sock.close()


async def _read_loop(table: StoreTable, conn: _SocketConnection) -> None:
    sock = conn.sock
    scratch = conn.serving.scratch
    wait_readable = conn.serving.wait_readable
    try:
        while True:
            if conn.draining and conn.drained is not None:  # backpressure: no reads while replies wait
                await conn.drained.wait()
            await wait_readable(sock)
            try:
                received = sock.recv_into(scratch)
            except BlockingIOError:
                continue
            if not received:
                logger.debug("store connection from %s closed by the peer", conn.peer)
                return
            table.receive(conn, scratch[:received].tobytes())
            while table.process(conn):
                conn.flush()
                if conn.draining and conn.drained is not None:
                    await conn.drained.wait()
            conn.flush()
            table.check_buffered(conn)
    except Refused as exc:
        logger.warning("refusing store connection from %s: %s", conn.peer, exc)
        await _send_rest(conn)  # the auth CHECK's NOT_READY, so that an aelastic client can say why
    except StoreProtocolError as exc:
        logger.warning("closing store connection from %s: %s", conn.peer, exc)
    except _CONNECTION_ERRORS as exc:
        logger.debug("store connection from %s broke: %r", conn.peer, exc)


async def _send_rest(conn: _SocketConnection) -> None:
    conn.flush()
    if conn.draining and conn.drained is not None:
        await conn.drained.wait()


async def _drain(conn: _SocketConnection) -> None:
    """Send the outbox as the peer makes room; the reader waits meanwhile (see the module docstring)."""
    try:
        outbox = conn.outbox
        while outbox and not conn.closed:
            await anyio.wait_writable(conn.sock)
            try:
                while outbox:
                    sent = conn.sock.send(outbox)
                    del outbox[:sent]
            except BlockingIOError:
                continue
    except _CONNECTION_ERRORS as exc:
        if not conn.closed:
            logger.debug("store connection from %s broke while sending: %r", conn.peer, exc)
            conn.abort()
    finally:
        conn.draining = False
        if conn.drained is not None:
            conn.drained.set()
