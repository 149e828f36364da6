"""The store client's byte stream (``aelastic.store._stream``) keeps anyio's stream contract on both backends: the
lean asyncio protocol stream and anyio's own (trio) must be indistinguishable to the client, against a real peer."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager, suppress

import anyio
import anyio.abc
import pytest

from aelastic.store import _stream

pytestmark = pytest.mark.anyio

Handler = Callable[[anyio.abc.SocketStream], Awaitable[None]]


@asynccontextmanager
async def peer(handler: Handler) -> AsyncIterator[anyio.abc.ByteStream]:
    """A client stream connected to a local listener whose one connection ``handler`` serves."""
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
    port = listener.listeners[0].extra(anyio.abc.SocketAttribute.local_port)
    async with listener, anyio.create_task_group() as tg:

        async def serve(conn: anyio.abc.SocketStream) -> None:
            async with conn:
                with suppress(anyio.EndOfStream, anyio.BrokenResourceError):  # the client left first: its test's end
                    await handler(conn)

        tg.start_soon(listener.serve, serve)
        stream = await _stream.connect("127.0.0.1", port)
        try:
            with anyio.fail_after(30):
                yield stream
        finally:
            await anyio.aclose_forcefully(stream)
            tg.cancel_scope.cancel()


async def receive_exactly(stream: anyio.abc.ByteStream, size: int) -> bytes:
    data = b""
    while len(data) < size:
        data += await stream.receive()
    return data


async def test_bytes_both_ways_and_the_local_address() -> None:
    async def echo(conn: anyio.abc.SocketStream) -> None:
        async for chunk in conn:
            await conn.send(chunk)

    async with peer(echo) as stream:
        await stream.send(b"ping")
        assert await receive_exactly(stream, 4) == b"ping"
        host, port = stream.extra(anyio.abc.SocketAttribute.local_address)
        assert host == "127.0.0.1"
        assert port > 0


async def test_the_peer_closing_ends_the_stream_after_what_it_sent() -> None:
    async def say_and_close(conn: anyio.abc.SocketStream) -> None:
        await conn.send(b"last words")

    async with peer(say_and_close) as stream:
        assert await receive_exactly(stream, 10) == b"last words"
        with pytest.raises(anyio.EndOfStream):
            await stream.receive()


async def test_a_cancelled_receive_loses_nothing() -> None:
    sent = anyio.Event()

    async def later(conn: anyio.abc.SocketStream) -> None:
        await conn.receive()  # sent after the client's receive was cancelled
        await conn.send(b"late")
        sent.set()
        await conn.receive()

    async with peer(later) as stream:
        with anyio.move_on_after(0.1) as scope:
            await stream.receive()
        assert scope.cancelled_caught
        await stream.send(b"go")
        await sent.wait()
        assert await receive_exactly(stream, 4) == b"late"


async def test_a_closed_stream_refuses_use() -> None:
    async def idle(conn: anyio.abc.SocketStream) -> None:
        await conn.receive()

    async with peer(idle) as stream:
        await stream.aclose()
        with pytest.raises(anyio.ClosedResourceError):
            await stream.send(b"x")
        with pytest.raises(anyio.ClosedResourceError):
            await stream.receive()


async def test_a_slow_reader_backpressures_a_large_send_without_losing_bytes() -> None:
    payload = bytes(range(256)) * 32768  # 8 MiB: past every buffer, so the sender must wait for the reader
    received = bytearray()

    async def slow(conn: anyio.abc.SocketStream) -> None:
        while len(received) < len(payload):
            received.extend(await conn.receive())
            await anyio.sleep(0.001)
        await conn.send(b"done")

    async with peer(slow) as stream:
        await stream.send(payload)
        assert await receive_exactly(stream, 4) == b"done"
    assert received == payload
