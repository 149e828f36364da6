"""What the store server's transports do around the table, on both backends: a peer that does not read its replies
while another wakes it, a connection closed from another connection's request or from its own, handshake deadlines
expiring in order, and a burst of ready connections larger than one poll takes.

They run on each loop the store's tests meet (asyncio's own, uvloop, trio); on trio also with the stream transport's
fallback, a task per connection (what it uses where there is no ``select.epoll``).
"""

from __future__ import annotations

import logging
import re
import socket
import struct
from collections.abc import AsyncIterator

import anyio
import anyio.abc
import pytest
from helpers.store import closed_by_server, wait_for_connections

from aelastic.store import stream_transport, wire
from aelastic.store.server import ServerSettings, StoreServer, open_store_server

# The loops and, on trio, both ways the stream transport serves: the pairs that exist (asyncio's loops have a
# transport of their own).
LOOPS_AND_TRANSPORTS = [
    pytest.param("asyncio", "protocols", id="asyncio"),
    pytest.param(("asyncio", {"use_uvloop": True}), "protocols", id="uvloop"),
    pytest.param("trio", "nested epoll", id="trio-nested-epoll"),
    pytest.param("trio", "task per connection", id="trio-task-per-connection"),
]
pytestmark = [pytest.mark.anyio, pytest.mark.parametrize(("anyio_backend", "transport"), LOOPS_AND_TRANSPORTS)]

VALIDATE = wire.encode_request(wire.Validate())
STOP = bytes((wire.WaitResponse.STOP_WAITING,))


@pytest.fixture(autouse=True)
def _stream_transport_without_epoll(transport: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if transport == "task per connection":
        monkeypatch.setattr(stream_transport, "_epoll", None)


@pytest.fixture(autouse=True)
def _warnings_are_captured(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="aelastic.store")


@pytest.fixture
async def server(transport: str) -> AsyncIterator[StoreServer]:
    async with open_store_server("127.0.0.1", 0) as server:
        yield server


async def connect_raw(port: int, *, receive_buffer: int | None = None) -> socket.socket:
    """A plain non-blocking socket connected to the server."""
    sock = socket.socket()
    try:
        if receive_buffer is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)  # before connecting: the window
        sock.setblocking(False)
        sock.connect_ex(("127.0.0.1", port))
        await anyio.wait_writable(sock)
    except BaseException:
        sock.close()
        raise
    return sock


async def connect_small_window(port: int) -> anyio.abc.SocketStream:
    """A client whose receive buffer is tiny, so that replies it does not read back up into the server at once."""
    return await anyio.abc.SocketStream.from_socket(await connect_raw(port, receive_buffer=4096))


class Replies:
    """The bytes a stream received, taken apart by the test (our client codec expects no interleaved wake-ups)."""

    def __init__(self, stream: anyio.abc.SocketStream) -> None:
        self.stream = stream
        self.buffer = bytearray()

    async def take(self, size: int) -> bytes:
        with anyio.fail_after(30):
            while len(self.buffer) < size:
                self.buffer += await self.stream.receive(65536)
        taken = bytes(self.buffer[:size])
        del self.buffer[:size]
        return taken

    async def value(self) -> bytes:
        (size,) = struct.unpack("<Q", await self.take(8))
        return await self.take(size)


async def ask(stream: anyio.abc.SocketStream, request: wire.Request) -> wire.Reply:
    protocol = wire.ClientProtocol()
    await stream.send(protocol.send(request))
    with anyio.fail_after(10):
        while (reply := protocol.next_reply()) is wire.NEED_DATA:
            protocol.receive_data(await stream.receive())
    return reply


async def test_wake_ups_of_a_backpressured_connection_follow_its_replies(server: StoreServer) -> None:
    big = bytes(range(256)) * (16 * 1024)  # 4 MiB: far more than the kernel's buffers take for a tiny window
    async with await anyio.connect_tcp("127.0.0.1", server.port) as waker:
        await waker.send(VALIDATE + wire.encode_request(wire.Set(b"big", big)))
        assert await ask(waker, wire.Ping(0)) == wire.PingReply(0)  # the SET is handled
        async with await connect_small_window(server.port) as hog:
            replies = Replies(hog)
            await hog.send(VALIDATE)
            for cycle in range(4):
                key = f"go/{cycle}".encode()
                # The WAIT registers, then the GET's reply fills the kernel's buffers and the hog is not read...
                await hog.send(wire.encode_request(wire.Wait((key,))) + wire.encode_request(wire.Get(b"big")))
                await wait_for_waiters(server, 1)
                # ... while the waker wakes it: the wake-up waits behind the reply's unsent bytes.
                await waker.send(wire.encode_request(wire.Set(key, b"1")))
                assert await ask(waker, wire.Ping(cycle)) == wire.PingReply(cycle)  # the SET is handled
                assert await replies.value() == big
                assert await replies.take(1) == STOP
            await hog.send(wire.encode_request(wire.Ping(7)))
            assert await replies.take(4) == struct.pack("<I", 7)
    await wait_for_connections(server, 0)


async def wait_for_waiters(server: StoreServer, count: int) -> None:
    with anyio.fail_after(10):
        while server.statistics().waiters != count:  # noqa: ASYNC110 - server state has no event to wait on
            await anyio.sleep(0.002)


async def test_a_connection_closed_by_another_connections_request(
    transport: str, caplog: pytest.LogCaptureFixture
) -> None:
    limits = wire.Limits(max_key_length=64, max_value_length=4096)
    settings = ServerSettings(limits=limits, max_buffered_bytes=1024 * 1024)
    async with open_store_server("127.0.0.1", 0, settings) as server:
        async with await anyio.connect_tcp("127.0.0.1", server.port) as waker:
            await waker.send(VALIDATE + wire.encode_request(wire.Set(b"v", b"x" * 4096)))
            assert await ask(waker, wire.Ping(0)) == wire.PingReply(0)
            async with await connect_small_window(server.port) as hog:
                # 8 MiB of replies at once: most of them stay in the server, the hog reading nothing ...
                many = wire.encode_request(wire.MultiGet((b"v",) * 2048))
                await hog.send(VALIDATE + wire.encode_request(wire.Wait((b"go",))) + many)
                await wait_for_waiters(server, 1)
                with anyio.fail_after(10):
                    while server.statistics().sent_by_kind.get("MultiGet", 0) < 2048 * 4096:  # noqa: ASYNC110
                        await anyio.sleep(0.002)
                # ... so the wake-up that the waker's SET queues for it is over the limit: the SET closes the hog.
                await waker.send(wire.encode_request(wire.Set(b"go", b"1")))
                assert await closed_by_server(hog)
            assert await ask(waker, wire.Get(b"go")) == wire.ValueReply(b"1")
            assert "bytes of replies unsent" in caplog.text
            assert server.statistics().waiters == 0
        await wait_for_connections(server, 0)


async def test_a_connection_closed_by_its_own_request(transport: str, caplog: pytest.LogCaptureFixture) -> None:
    limits = wire.Limits(max_key_length=64, max_value_length=4096)
    settings = ServerSettings(limits=limits, max_buffered_bytes=1 + 8 + 64 + 8 + 4096)  # the least allowed
    async with (
        open_store_server("127.0.0.1", 0, settings) as server,
        await anyio.connect_tcp("127.0.0.1", server.port) as other,
    ):
        await other.send(VALIDATE + wire.encode_request(wire.Set(b"v", b"x" * 4096)))
        assert await ask(other, wire.Ping(0)) == wire.PingReply(0)
        async with await anyio.connect_tcp("127.0.0.1", server.port) as closing:
            # Two replies over the limit, then its own SET wakes its own WAIT: the wake-up is one byte too many, and
            # the connection is closed while its requests are being handled (the WAIT after it registers nothing).
            requests: list[wire.Request] = [
                wire.Wait((b"self",)),
                wire.Get(b"v"),
                wire.Get(b"v"),
                wire.Set(b"self", b"1"),
            ]
            await closing.send(VALIDATE + b"".join(map(wire.encode_request, [*requests, wire.Wait((b"x",))])))
            assert await closed_by_server(closing)
        assert "bytes of replies unsent" in caplog.text
        assert await ask(other, wire.Get(b"self")) == wire.ValueReply(b"1")
        await wait_for_connections(server, 1)
        assert server.statistics().waiters == 0


async def test_handshake_deadlines_expire_in_order(transport: str, caplog: pytest.LogCaptureFixture) -> None:
    timeout = 0.5
    async with open_store_server("127.0.0.1", 0, ServerSettings(handshake_timeout=timeout)) as server:
        closed_at: dict[str, list[float]] = {"first": [], "second": []}

        async def watch(stream: anyio.abc.SocketStream, batch: str) -> None:
            assert await closed_by_server(stream)
            closed_at[batch].append(anyio.current_time())

        streams: list[anyio.abc.SocketStream] = []
        watched: list[tuple[anyio.abc.SocketStream, str]] = []
        try:
            async with anyio.create_task_group() as tg:
                started = {}
                for batch in closed_at:
                    started[batch] = anyio.current_time()
                    for _ in range(20):
                        streams.append(stream := await anyio.connect_tcp("127.0.0.1", server.port))
                        watched.append((stream, batch))
                        tg.start_soon(watch, stream, batch)
                    await anyio.sleep(timeout / 2)
                streams.append(established := await anyio.connect_tcp("127.0.0.1", server.port))
                await established.send(VALIDATE)
            for batch, times in closed_at.items():
                assert len(times) == 20
                assert min(times) - started[batch] >= timeout - 0.1  # not before its deadline
            # In deadline order: by the server's own log, which a stalled machine cannot reorder (a late timer
            # closes both batches in one go, and the clients may then see the closes in any order).
            batch_of = {stream.extra(anyio.abc.SocketAttribute.local_port): batch for stream, batch in watched}
            logged = [re.search(r":(\d+): no VALIDATE within 0.5s", r.getMessage()) for r in caplog.records]
            order = [batch_of[int(m[1])] for m in logged if m is not None]
            assert order == ["first"] * 20 + ["second"] * 20
            assert await ask(established, wire.Ping(3)) == wire.PingReply(3)
        finally:
            for stream in streams:
                await stream.aclose()
        await wait_for_connections(server, 0)


async def test_a_burst_of_ready_connections_larger_than_a_poll_is_served(server: StoreServer) -> None:
    count = 3 * stream_transport._MAX_EVENTS + 7
    socks = [await connect_raw(server.port) for _ in range(count)]
    try:
        # Every request sent before the server runs again: it finds them all ready at once.
        for nonce, sock in enumerate(socks):
            sock.send(VALIDATE + wire.encode_request(wire.Ping(nonce)))
        with anyio.fail_after(30):
            for nonce, sock in enumerate(socks):
                await anyio.wait_readable(sock)
                assert sock.recv(8) == struct.pack("<I", nonce)
    finally:
        for sock in socks:
            sock.close()
    await wait_for_connections(server, 0)
