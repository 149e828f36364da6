"""The store server's transport on any anyio backend (trio): sockets in a nested epoll, no task per request.

Theory of operation
-------------------
A task per listener waits until it is readable and then accepts every connection queued in the backlog (a burst
of thousands is accepted in a few loop iterations, not one wait per connection).

On Linux the server owns an epoll object of its own, *nested* in the event loop's: an epoll descriptor is itself
pollable, readable while any socket registered in it is. Every admitted connection is registered in it once
(level-triggered ``EPOLLIN``). One task, the *poller*, waits until the epoll descriptor is readable (trio's own
``wait_readable`` on trio: anyio's looks the running library up on every call), takes the ready connections with a
non-blocking ``poll`` and handles each one synchronously, as the asyncio transport's protocol callbacks do: it
receives what arrived into the server's one scratch buffer (no 64 KiB bytes object per read for glibc's heap to
fragment), feeds it to the :class:`~aelastic.store.table.StoreTable`, handles every whole request and sends the
replies with one non-blocking ``send``. The hot path is ``_poll_loop`` → ``_Serving.receive`` → ``table.process``
→ ``flush``. So the event loop does one wait per batch of ready connections instead of one per request of each
connection: a task per connection, each waiting on its own socket, made the 4,096 simulated ranks of
``benchmarks/rank_scale.py`` do 65,000 waits (each an ``epoll_ctl``, a reschedule and a task step on trio) and
take up to 1.8 times asyncio's time. A poll returns at most ``_MAX_EVENTS`` connections; when it returns that many
(a burst), the poller lets the loop's other tasks run before the next poll.

Where ``select.epoll`` is missing (macOS, the BSDs, Windows) each connection gets a task of its own that waits until
its socket is readable and then does exactly the same synchronous handling; everything below applies to both.

Sending never waits in the common case: a ``send`` on a non-blocking socket takes what the kernel accepts, and a
store's replies are small. Wake-ups caused by another connection (``notify``) are sent the same way, by the waker,
synchronously, so bytes leave in the order the events happened (a connection woken while it is itself being handled
sends them with its own replies). Only when the kernel's buffer is full (a peer that does not read its replies) is
a *drain* task started for that connection: meanwhile the connection is not read (it leaves the epoll set:
backpressure) and everything queued joins the outbox behind the unsent bytes; the drain task waits until the socket
is writable and sends the rest, then handles the requests that waited in the parser and reads the connection again.

Handshake deadline: one queue of deadlines (:class:`~aelastic.store._handshake.HandshakeDeadlines`) and one task
whose cancel scope's deadline is the earliest, instead of a cancel scope per connection.

How a connection whose handling raised is closed (refused, a protocol violation, a bug) is the table's rule,
:meth:`~aelastic.store.table.Connection.end`; a peer that goes away closes it quietly (logged at debug level).
``abort`` closes a connection at once, except the one being handled: that one is closed when its handling returns,
so the handlers never see a connection disappear under them. Cancelling :func:`serve_streams` closes the
listeners, every connection and the epoll object.
"""

from __future__ import annotations

import errno
import logging
import math
import select
import socket
import sys
from collections.abc import Awaitable, Callable
from typing import Any, Final, cast

import anyio
import anyio.abc
import anyio.lowlevel

from .._net import format_address
from ._handshake import HandshakeDeadlines
from .table import Connection, StoreTable

__all__ = ["serve_streams"]

logger = logging.getLogger(__name__)

_RECEIVE_SIZE: Final = 65536
_MAX_EVENTS: Final = 256  # connections handled per poll before the loop's other tasks get a turn
_ACCEPT_BACKOFF: Final = 0.1  # after EMFILE & co., before accepting again
# accept() errors that concern the one connection (it went away while queued), not the listener or the process.
_ACCEPT_TRANSIENT: Final = frozenset({errno.ECONNABORTED, errno.EPROTO, errno.EPERM})

# The nested poller where the platform has one (Linux); tests set it to None to exercise the task per connection.
_epoll: Callable[[], select.epoll] | None = getattr(select, "epoll", None)


class _Serving:
    """What the connections of one server share: the table, the nested epoll, the scratch buffer, the task group
    for drains and the handshake deadlines; and the synchronous handling of a connection's reads."""

    __slots__ = ("by_fd", "deadlines", "poller", "scratch", "table", "tg", "timer", "wait_readable")

    def __init__(self, table: StoreTable, handshake_timeout: float, tg: anyio.abc.TaskGroup) -> None:
        self.table = table
        self.tg = tg
        self.scratch = memoryview(bytearray(_RECEIVE_SIZE))  # every read lands in it (one at a time)
        self.wait_readable = _wait_readable_function()
        self.poller = None if _epoll is None else _epoll()
        self.by_fd: dict[int, _SocketConnection] = {}  # the open connections
        self.deadlines = HandshakeDeadlines(table, handshake_timeout)
        self.timer = anyio.CancelScope()  # its deadline is the earliest handshake deadline

    def open(self, conn: _SocketConnection) -> None:
        """Serve the admitted ``conn``."""
        self.by_fd[conn.fd] = conn
        if (deadline := self.deadlines.add(conn, anyio.current_time())) is not None:
            self.timer.deadline = deadline
        self.start_reading(conn)
        if self.poller is None:
            self.tg.start_soon(_read_each, self, conn)

    def receive(self, conn: _SocketConnection) -> None:
        """``conn`` is readable: receive, and handle every whole request (never waits, never raises)."""
        try:
            received = conn.sock.recv_into(self.scratch)
        except BlockingIOError:
            return
        except OSError as exc:
            logger.debug("store connection from %s broke: %r", conn.peer, exc)
            conn.abort()
            return
        if not received:
            if logger.isEnabledFor(logging.DEBUG):  # the peer's name costs a call: only if logged
                logger.debug("store connection from %s closed by the peer", conn.peer)
            conn.abort()
            return
        self.table.receive(conn, self.scratch[:received].tobytes())
        self.run(conn)

    def run(self, conn: _SocketConnection) -> None:
        """Handle the requests buffered in ``conn``'s parser and send the replies, until a drain must wait."""
        table = self.table
        conn.busy = True
        try:
            while table.process(conn):
                conn.flush()
                if conn.draining or conn.closed:
                    return  # the drain task handles the rest once the replies so far are sent
            conn.flush()
            table.check_buffered(conn)
        except Exception as exc:
            conn.end(exc)
        finally:
            conn.busy = False
            if conn.closed:
                self.close(conn)

    def pause(self, conn: _SocketConnection) -> None:
        """Send what ``conn``'s outbox holds in a drain task, and read nothing from it meanwhile."""
        conn.draining = True
        self.stop_reading(conn)
        self.tg.start_soon(_drain, self, conn)

    def resume(self, conn: _SocketConnection) -> None:
        """The drain sent everything: handle the requests that waited, then read ``conn`` again."""
        conn.draining = False
        if conn.lingering:
            conn.abort()
            return
        self.run(conn)
        if not (conn.closed or conn.draining):
            self.start_reading(conn)

    def start_reading(self, conn: _SocketConnection) -> None:
        conn.reading = True
        if self.poller is not None:
            self.poller.register(conn.fd, select.EPOLLIN)
        elif conn.resumed is not None:
            conn.resumed.set()
            conn.resumed = None

    def stop_reading(self, conn: _SocketConnection) -> None:
        # Out of the epoll set, not registered for no events: a peer's reset (EPOLLHUP, EPOLLERR) is reported
        # whatever events are asked for, and would wake the poller again and again until the drain task saw it.
        conn.reading = False
        if self.poller is not None:
            self.poller.unregister(conn.fd)
        else:
            conn.resumed = anyio.Event()

    def close(self, conn: _SocketConnection) -> None:
        """Forget ``conn`` and close its socket (once; ``conn.closed`` is already set)."""
        if self.by_fd.get(conn.fd) is not conn:  # closed before (and its descriptor's number may be reused)
            return
        del self.by_fd[conn.fd]
        self.table.drop(conn)
        if conn.reading and self.poller is not None:
            self.poller.unregister(conn.fd)  # before closing: a forked child may hold the socket a moment longer
        if conn.draining or self.poller is None:
            anyio.notify_closing(conn.sock)  # the task waiting on it gives up
        if conn.resumed is not None:
            conn.resumed.set()
        conn.sock.close()

    def close_all(self) -> None:
        self.deadlines.clear()
        for conn in list(self.by_fd.values()):
            conn.abort()
        if self.poller is not None:
            self.poller.close()


def _wait_readable_function() -> Callable[[Any], Awaitable[None]]:
    """trio's own ``wait_readable`` when running on trio: anyio's looks the running library up on every call."""
    trio = sys.modules.get("trio")
    if trio is not None:
        try:
            trio.lowlevel.current_trio_token()
        except RuntimeError:  # trio is imported but not running this thread
            pass
        else:
            return cast("Callable[[Any], Awaitable[None]]", trio.lowlevel.wait_readable)
    return anyio.wait_readable


class _SocketConnection(Connection):
    """A connection over a non-blocking socket, handled synchronously when readable (see the module docstring)."""

    __slots__ = ("address", "busy", "closed", "draining", "fd", "lingering", "reading", "resumed", "serving", "sock")

    def __init__(self, sock: socket.socket, address: Any, serving: _Serving) -> None:
        super().__init__(serving.table.limits, None)
        self.sock = sock
        self.fd = sock.fileno()  # the key of the open connections (a closed socket's fileno() is -1)
        self.address = address
        self.serving = serving
        self.busy = False  # being handled: wake-ups join the outbox in order, and closing waits for the end
        self.closed = False  # aborted: nothing more is read or sent
        self.draining = False  # a drain task owns the sending until the outbox is empty; nothing is read
        self.lingering = False  # refused: closed once the replies queued so far are sent
        self.reading = False  # in the epoll set (or, without epoll, its task may read)
        self.resumed: anyio.Event | None = None  # without epoll: set when reading may go on after a drain

    def peer_name(self) -> str:
        address = self.address
        return format_address(str(address[0]), int(address[1])) if isinstance(address, tuple) else str(address)

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
            self.serving.pause(self)
        except OSError as exc:
            logger.debug("store connection from %s broke while sending: %r", self.peer, exc)
            self.abort()

    def notify(self) -> None:
        if not self.busy:  # else its own handling flushes it, after the replies before it
            self.flush()

    def abort(self) -> None:
        self.outbox.clear()
        if not self.closed:
            self.closed = True
            if not self.busy:  # else run() closes it once the handling returns
                self.serving.close(self)

    def linger(self) -> None:
        self.lingering = True  # a drain that empties the outbox closes it
        self.flush()
        if not self.draining:
            self.abort()


async def serve_streams(
    table: StoreTable,
    sockets: list[socket.socket],
    *,
    handshake_timeout: float,
    task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``table`` on the listening ``sockets`` until cancelled.

    Reports ``task_status.started()`` once every socket accepts. Cancellation closes the listeners, every
    connection and the epoll object.
    """
    serving: _Serving | None = None
    try:
        async with anyio.create_task_group() as tg:
            serving = _Serving(table, handshake_timeout, tg)
            tg.start_soon(_expire_handshakes, serving)
            if serving.poller is not None:
                tg.start_soon(_poll_loop, serving, serving.poller)
            for sock in sockets:
                sock.setblocking(False)
                tg.start_soon(_accept_loop, serving, sock)
            task_status.started()
    finally:
        for sock in sockets:
            sock.close()
        if serving is not None:
            serving.close_all()


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
                serving.open(conn)
            else:
                sock.close()


async def _poll_loop(serving: _Serving, poller: select.epoll) -> None:
    """Handle the ready connections, a batch per wait of the event loop (see the module docstring)."""
    wait_readable = serving.wait_readable
    poll = poller.poll
    by_fd = serving.by_fd
    receive = serving.receive
    while True:
        await wait_readable(poller.fileno())
        while True:
            events = poll(0, _MAX_EVENTS)
            for fd, _ in events:
                conn = by_fd.get(fd)
                if conn is not None and conn.reading:  # closed or paused by an earlier one of the batch
                    receive(conn)
            if len(events) < _MAX_EVENTS:
                break
            await anyio.lowlevel.checkpoint()  # a burst: let the loop's other tasks run before the rest


async def _read_each(serving: _Serving, conn: _SocketConnection) -> None:
    """Without epoll: wait until ``conn``'s socket is readable, handle it, and again, until it is closed."""
    try:
        while not conn.closed:
            if conn.resumed is not None:  # backpressure: no reads while replies wait
                await conn.resumed.wait()
                continue
            await anyio.wait_readable(conn.sock)
            if conn.reading and not conn.closed:
                serving.receive(conn)
    except anyio.ClosedResourceError:
        pass  # closed by another task while waiting


async def _drain(serving: _Serving, conn: _SocketConnection) -> None:
    """Send the outbox as the peer makes room; ``conn`` is not read meanwhile (see the module docstring)."""
    outbox = conn.outbox
    try:
        while outbox and not conn.closed:
            await anyio.wait_writable(conn.sock)
            try:
                while outbox:
                    sent = conn.sock.send(outbox)
                    del outbox[:sent]
            except BlockingIOError:
                continue
    except anyio.ClosedResourceError:
        return  # closed by another task while waiting
    except OSError as exc:
        logger.debug("store connection from %s broke while sending: %r", conn.peer, exc)
        conn.abort()
        return
    if not conn.closed:
        serving.resume(conn)


async def _expire_handshakes(serving: _Serving) -> None:
    """Close the connections that did not finish their handshake in time: one timer for the earliest deadline."""
    while True:
        with serving.timer:
            await anyio.sleep_forever()
        next_deadline = serving.deadlines.expire(anyio.current_time())
        serving.timer = anyio.CancelScope(deadline=math.inf if next_deadline is None else next_deadline)
