"""The store client's TCP byte stream: on asyncio, a lean stream over an ``asyncio.Protocol``; on trio, anyio's.

Why a stream of our own on asyncio: a store request is a few dozen bytes out and a few back, and a node makes thousands
of them in a large rendezvous, so what each costs the event loop sets how many nodes one store serves. anyio's asyncio
socket stream re-registers the socket with epoll on every receive (``resume_reading``, then ``pause_reading``: two
``epoll_ctl`` calls) and adds a loop turn to every send. This protocol keeps reading while data arrives (into a buffer
capped by ``_HIGH_WATER``, past which reading pauses), wakes the one receiver with a future, and writes without an extra
loop turn (the store rows of ``benchmarks/RESULTS.md`` measure both). It behaves as an ``anyio.abc.ByteStream``: the
same exceptions (``ClosedResourceError``, ``BrokenResourceError``, ``EndOfStream``), cancellation by anyio's cancel
scopes (an awaited future is cancelled like any other await), and ``SocketAttribute.local_address`` (what the client
asks of its socket). The store server has the same split (``server.py``).
"""

from __future__ import annotations

import asyncio
import socket
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any, Final, cast

import anyio
import anyio.abc
import anyio.lowlevel

__all__ = ["connect"]

_HIGH_WATER: Final = 1 << 20  # bytes buffered unread before the protocol stops reading


async def connect(host: str, port: int) -> anyio.abc.ByteStream:
    """A TCP connection to ``host:port`` with Nagle's algorithm off (requests are small and wait for replies)."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:  # not asyncio (trio)
        stream = await anyio.connect_tcp(host, port)
        stream.extra(anyio.abc.SocketAttribute.raw_socket).setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return stream
    transport, protocol = await loop.create_connection(_Protocol, host, port)  # asyncio sets TCP_NODELAY itself
    if protocol.transport is None:  # not yet told (a loop may call connection_made soon after)
        protocol.transport = transport
    return _ProtocolStream(protocol)


class _Protocol(asyncio.Protocol):
    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.chunks: deque[bytes] = deque()
        self.buffered = 0
        self.eof = False
        self.error: BaseException | None = None  # why the connection was lost
        self.paused = False  # the transport's write buffer is over its high-water mark
        self.readable: asyncio.Future[None] | None = None  # the receiver's, while it waits for data
        self.writable: asyncio.Future[None] | None = None  # the sender's, while it waits for the buffer to drain

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream transport; uvloop's is not an asyncio.Transport subclass, so no isinstance check.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.chunks.append(data)
        self.buffered += len(data)
        if self.buffered > _HIGH_WATER and self.transport is not None:
            self.transport.pause_reading()
        _wake(self.readable)

    def eof_received(self) -> bool:
        self.eof = True
        _wake(self.readable)
        return False  # close the transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.eof = True
        self.error = exc
        _wake(self.readable)
        _wake(self.writable)

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        _wake(self.writable)


def _wake(future: asyncio.Future[None] | None) -> None:
    if future is not None and not future.done():
        future.set_result(None)


class _ProtocolStream(anyio.abc.ByteStream):
    def __init__(self, protocol: _Protocol) -> None:
        assert protocol.transport is not None
        self._protocol = protocol
        self._transport = protocol.transport
        self._closed = False

    async def receive(self, max_bytes: int = 65536) -> bytes:
        p = self._protocol
        while not p.chunks:
            if self._closed:
                raise anyio.ClosedResourceError
            if p.error is not None:
                raise anyio.BrokenResourceError from p.error
            if p.eof:
                raise anyio.EndOfStream
            p.readable = asyncio.get_running_loop().create_future()
            try:
                await p.readable
            finally:
                p.readable = None
        chunk = p.chunks.popleft()
        if len(chunk) > max_bytes:
            chunk, rest = chunk[:max_bytes], chunk[max_bytes:]
            p.chunks.appendleft(rest)
        p.buffered -= len(chunk)
        if p.buffered <= _HIGH_WATER and not p.eof:
            self._transport.resume_reading()  # a no-op unless data_received paused it
        return chunk

    async def send(self, item: bytes) -> None:
        p = self._protocol
        if self._closed:
            raise anyio.ClosedResourceError
        if p.error is not None or self._transport.is_closing():
            raise anyio.BrokenResourceError from p.error
        self._transport.write(item)
        if p.paused:  # wait for the transport's buffer to drain
            p.writable = asyncio.get_running_loop().create_future()
            try:
                await p.writable
            finally:
                p.writable = None
            if p.error is not None:
                raise anyio.BrokenResourceError from p.error

    async def send_eof(self) -> None:
        self._transport.write_eof()

    async def aclose(self) -> None:
        # As anyio's stream does: close (which flushes what the transport still buffers), one loop turn for it,
        # then abort whatever is left, also when the closing task is cancelled (``anyio.aclose_forcefully``).
        if not self._closed:
            self._closed = True
            self._transport.close()
            _wake(self._protocol.readable)
        try:
            await anyio.lowlevel.checkpoint()
        finally:
            self._transport.abort()

    @property
    def extra_attributes(self) -> Mapping[Any, Callable[[], Any]]:
        sock: socket.socket = self._transport.get_extra_info("socket")
        return {anyio.abc.SocketAttribute.local_address: sock.getsockname}
