"""The store server's transport on asyncio (the fast path): the loop's own server, a protocol per connection.

Theory of operation
-------------------
No task and no checkpoint per request, which is what keeps the server within reach of torch's libuv server (about
three times fewer loop iterations per request than a stream task). Per chunk the kernel hands over, the loop calls
the connection's protocol (``buffer_updated`` of :class:`_BufferedConnection` on asyncio's own loop,
``data_received`` of :class:`_PlainConnection` on uvloop), which feeds the chunk to the
:class:`~aelastic.store.table.StoreTable` and writes every reply of the chunk with one ``transport.write``. The
hot path is ``_received`` → ``table.process`` → ``_write``.

* **Backpressure**: when the transport's buffer passes its high-water mark (a peer that does not read its
  replies), asyncio calls ``pause_writing``; reading pauses and buffered requests wait in the parser until
  ``resume_writing``, exactly as on the stream path.
* **Wake-ups** caused by another connection are written straight to the woken connection's transport (asyncio
  buffers them; that never blocks the waker); if the woken connection is itself mid-chunk (``busy``) they join
  its outbox, so replies stay in order.
* **Handshake deadline**: one queue of deadlines and one loop timer for the earliest (:class:`_Serving`).

Cancelling :func:`serve_protocols` closes the listeners and aborts every connection.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import Final, cast

import anyio
import anyio.abc
import anyio.lowlevel

from .._net import format_address
from ._handshake import HandshakeDeadlines
from .table import Connection, StoreTable

__all__ = ["serve_protocols"]

logger = logging.getLogger(__name__)

_SCRATCH_SIZE: Final = 256 * 1024  # the most an asyncio connection reads at once (asyncio's own read size)


class _Serving:
    """What the connections of one server share: the table, the scratch buffer and the handshake deadlines (one
    queue, :class:`~aelastic.store._handshake.HandshakeDeadlines`, and one loop timer for the earliest)."""

    __slots__ = ("deadlines", "loop", "scratch", "table", "timer")

    def __init__(self, table: StoreTable, handshake_timeout: float, loop: asyncio.AbstractEventLoop) -> None:
        self.table = table
        self.loop = loop
        self.scratch = memoryview(bytearray(_SCRATCH_SIZE))  # every connection reads into it (one at a time)
        self.deadlines = HandshakeDeadlines(table, handshake_timeout)
        self.timer: asyncio.TimerHandle | None = None

    def expect_handshake(self, conn: _ProtocolConnection) -> None:
        if (deadline := self.deadlines.add(conn, self.loop.time())) is not None:
            self.timer = self.loop.call_at(deadline, self._expire)

    def _expire(self) -> None:
        deadline = self.deadlines.expire(self.loop.time())
        self.timer = None if deadline is None else self.loop.call_at(deadline, self._expire)

    def close(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self.deadlines.clear()


class _ProtocolConnection(Connection):
    """A connection served by asyncio's protocol callbacks: no task, no checkpoint per request.

    How a read arrives depends on the loop (the two subclasses below); what is done with it is :meth:`_received`.
    ``TCP_NODELAY``: both asyncio's own loop and uvloop set it on every TCP transport they create.
    """

    __slots__ = ("busy", "serving", "table", "transport", "writing_paused")

    def __init__(self, serving: _Serving) -> None:
        super().__init__(serving.table.limits, None)
        self.serving = serving
        self.table = serving.table
        self.transport: asyncio.Transport | None = None  # None again once the connection is lost
        self.busy = False  # handling a read: wake-ups join the outbox in order
        self.writing_paused = False

    def peer_name(self) -> str:
        remote = None if self.transport is None else self.transport.get_extra_info("peername")
        return format_address(str(remote[0]), int(remote[1])) if isinstance(remote, tuple) else str(remote)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # create_server gives stream transports
        if not self.table.admit(self):
            self.transport.abort()
            return
        self.serving.expect_handshake(self)

    def connection_lost(self, exc: Exception | None) -> None:
        if exc is not None and logger.isEnabledFor(logging.DEBUG):  # the peer's name costs a call: only if logged
            logger.debug("store connection from %s broke: %r", self.peer, exc)
        self.table.drop(self)
        self.transport = None

    def _received(self, data: bytes) -> None:
        table = self.table
        table.receive(self, data)
        self.busy = True
        try:
            # The common case inline (every request of the chunk handled, one write): a call less per chunk.
            if not table.process(self):
                self._write()
                if self.parser.buffered:
                    table.check_buffered(self)
                return
        except Exception as exc:
            self.end(exc)
            return
        finally:
            self.busy = False
        self._write()
        if not self.writing_paused:
            self._run()

    def _run(self) -> None:
        table = self.table
        self.busy = True
        try:
            while table.process(self):
                self._write()
                if self.writing_paused:
                    return  # the rest waits in the parser for resume_writing
            self._write()
            table.check_buffered(self)
        except Exception as exc:
            self.end(exc)
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
        if logger.isEnabledFor(logging.DEBUG):
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

    def linger(self) -> None:
        self._write()
        if self.transport is not None:
            self.transport.close()  # asyncio closes it once its write buffer is sent


class _BufferedConnection(_ProtocolConnection, asyncio.BufferedProtocol):
    """On asyncio's own loop: reads into the server's one scratch buffer, keeping a bytes object of what arrived.

    A buffered protocol because of glibc's heap: asyncio's loop hands a plain protocol each read as a new 256 KiB
    bytes object shrunk to what arrived, and once glibc's adaptive mmap threshold has risen past that size those
    come from the heap and fragment it. The 10,000-node soak's store grew from 60 to 280 MiB in 5 minutes that way,
    with its Python objects and allocations flat (tracemalloc) and flat RSS with ``MALLOC_MMAP_THRESHOLD_`` fixed.
    Reads are handled one at a time, each in full before the next, so one scratch buffer serves every connection.
    """

    __slots__ = ()

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.serving.scratch

    def buffer_updated(self, nbytes: int) -> None:
        self._received(self.serving.scratch[:nbytes].tobytes())


class _PlainConnection(_ProtocolConnection, asyncio.Protocol):
    """On uvloop: a plain protocol. uvloop reads into its own buffer and hands over a bytes object of exactly what
    arrived (no oversized allocation to fragment the heap), in one call per read instead of a buffered protocol's
    two and a copy out of a memoryview."""

    __slots__ = ()

    data_received = _ProtocolConnection._received


async def serve_protocols(
    table: StoreTable,
    sockets: list[socket.socket],
    *,
    handshake_timeout: float,
    backlog: int,
    task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``table`` on the listening ``sockets`` with asyncio's server until cancelled.

    Reports ``task_status.started()`` once every socket accepts. Must run on asyncio. Cancellation closes the
    listeners (and the sockets not yet handed to asyncio) and aborts every connection.
    """
    loop = asyncio.get_running_loop()
    serving = _Serving(table, handshake_timeout, loop)
    connection = _PlainConnection if type(loop).__module__.startswith("uvloop") else _BufferedConnection
    servers: list[asyncio.Server] = []
    try:
        servers.extend(
            [await loop.create_server(lambda: connection(serving), sock=sock, backlog=backlog) for sock in sockets]
        )
        task_status.started()
        await anyio.sleep_forever()
    finally:
        with anyio.CancelScope(shield=True):
            serving.close()
            for listening in servers:
                listening.close()
            for sock in sockets[len(servers) :]:
                sock.close()
            for conn in list(table.connections):
                conn.abort()
            await anyio.lowlevel.checkpoint()  # let the aborted transports report connection_lost
