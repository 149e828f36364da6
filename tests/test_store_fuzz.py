"""Hostile input against aelastic's TCPStore server: garbage, truncated frames, absurd length prefixes and
over-limit traffic on some connections, while torch's own client keeps working on another. A bad connection is
closed on its own; nothing else notices, and the server's memory stays bounded by its settings."""

from __future__ import annotations

import contextlib
import struct
import tracemalloc
from collections.abc import AsyncIterator, Iterator

import anyio
import anyio.abc
import pytest
from helpers.store import closed_by_server, wait_for_connections
from helpers.torch_store_peer import TorchPeer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aelastic.store import wire
from aelastic.store.server import ServerSettings, StoreServer, open_store_server

pytestmark = pytest.mark.anyio

_U64 = struct.Struct("<Q")
VALIDATE = wire.encode_request(wire.Validate())


@pytest.fixture(scope="module")
def peer() -> Iterator[TorchPeer]:
    peer = TorchPeer()
    try:
        yield peer
    finally:
        peer.close()


@pytest.fixture
async def server() -> AsyncIterator[StoreServer]:
    async with open_store_server("127.0.0.1", 0) as server:
        yield server


async def connect(server: StoreServer) -> anyio.abc.SocketStream:
    return await anyio.connect_tcp("127.0.0.1", server.port)


async def assert_healthy(server: StoreServer) -> None:
    """A fresh, well-behaved connection is served."""
    client = wire.ClientProtocol()
    async with await connect(server) as stream:
        await stream.send(client.send(wire.Validate()) + client.send(wire.Add(b"health", 1)))
        with anyio.fail_after(10):
            while (reply := client.next_reply()) is wire.NEED_DATA:
                client.receive_data(await stream.receive())
    assert isinstance(reply, wire.IntReply)


def _string(data: bytes) -> bytes:
    return _U64.pack(len(data)) + data


BAD_STREAMS = {
    "unknown query byte": VALIDATE + b"\xff",
    "not validated": b"\x01" + _string(b"/k") + _string(b"v"),
    "absurd key length": VALIDATE + b"\x03" + _U64.pack(2**63),
    "absurd value length": VALIDATE + b"\x01" + _string(b"/k") + _U64.pack(2**64 - 1),
    "absurd key count": VALIDATE + b"\x06" + _U64.pack(2**40),
    "negative multi_set count": VALIDATE + b"\x0b" + struct.pack("<q", -1),
    "key over the limit": VALIDATE + b"\x03" + _U64.pack(8 * 1024 + 1) + b"k" * (8 * 1024 + 1),
}


@pytest.mark.torch
@pytest.mark.parametrize("name", sorted(BAD_STREAMS))
async def test_bad_stream_closes_only_its_connection(name: str, server: StoreServer, peer: TorchPeer) -> None:
    await peer.connect("127.0.0.1", server.port)
    await peer.call("set", "before", b"1")
    async with await connect(server) as bad:
        await bad.send(BAD_STREAMS[name])
        assert await closed_by_server(bad), name  # at once: no more bytes are needed to refuse it
    assert await peer.call("get", "before") == b"1"
    await peer.call("set", "after", b"2")
    assert await peer.call("multi_get", ["before", "after"]) == [b"1", b"2"]
    await wait_for_connections(server, 1)  # only the torch client is left


@pytest.mark.torch
async def test_truncated_frames_are_dropped_when_the_peer_leaves(server: StoreServer, peer: TorchPeer) -> None:
    await peer.connect("127.0.0.1", server.port)
    set_frame = VALIDATE + wire.encode_request(wire.Set(b"/cut", b"x" * 1000))
    streams = []
    for cut in (1, 3, 6, 20, len(set_frame) - 1):
        stream = await connect(server)
        await stream.send(set_frame[:cut])
        streams.append(stream)
    stream = await connect(server)  # a whole SET, then a WAIT cut short
    await stream.send(set_frame.replace(b"/cut", b"/one") + wire.encode_request(wire.Wait((b"/w",)))[:-1])
    streams.append(stream)
    await peer.call("wait", ["one"], 10.0)
    await wait_for_connections(server, len(streams) + 1)
    assert server.statistics().waiters == 0  # the cut WAIT never registered
    for stream in streams:
        await stream.aclose()
    await wait_for_connections(server, 1)
    assert await peer.call("check", ["cut"]) is False  # no cut SET happened
    assert await peer.call("num_keys") == 1


PAYLOAD = st.one_of(
    st.binary(max_size=256),
    st.binary(max_size=256).map(lambda b: VALIDATE + b),  # garbage after a good handshake
)


@pytest.mark.torch
# Each example is several rounds: one hypothesis example costs an event-loop round trip on trio (~0.1 s).
@settings(
    max_examples=10,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(rounds=st.lists(st.lists(PAYLOAD, min_size=1, max_size=4), min_size=1, max_size=10))
async def test_random_bytes_never_hurt_the_server(
    rounds: list[list[bytes]], server: StoreServer, peer: TorchPeer
) -> None:
    await peer.connect("127.0.0.1", server.port)
    baseline = server.statistics().connections
    for payloads in rounds:
        streams = [await connect(server) for _ in payloads]
        async with anyio.create_task_group() as tg:
            for stream, payload in zip(streams, payloads, strict=True):
                tg.start_soon(_send_ignoring_close, stream, payload)
            assert await peer.call("add", "fuzz-rounds", 1) >= 1  # torch's client works meanwhile
        for stream in streams:
            await stream.aclose()
        await wait_for_connections(server, baseline)
        assert server.statistics().waiters == 0  # waits registered by random bytes die with their connection
    await assert_healthy(server)


async def _send_ignoring_close(stream: anyio.abc.SocketStream, payload: bytes) -> None:
    with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
        await stream.send(payload)  # the server may have refused an earlier part of it already


@pytest.mark.torch
async def test_buffered_bytes_limit_closes_only_that_connection(peer: TorchPeer) -> None:
    limits = wire.Limits(max_key_length=64, max_value_length=64 * 1024, max_keys_per_request=1024)
    small = ServerSettings(limits, max_buffered_bytes=256 * 1024)
    async with open_store_server("127.0.0.1", 0, small) as server:
        await peer.connect("127.0.0.1", server.port)
        # A MULTI_SET of 1000 items of 64 KiB (every item within the limits) that can never fit the 256 KiB buffer.
        header = VALIDATE + b"\x0b" + struct.pack("<q", 1000)
        item = _string(b"/k") + _string(b"v" * (64 * 1024))
        bad = await connect(server)
        tracemalloc.start()
        try:
            base, _ = tracemalloc.get_traced_memory()
            refused = False
            try:
                await bad.send(header)
                for n in range(200):  # 13 MiB offered; the server must give up long before
                    await bad.send(item)
                    if n == 1:
                        await peer.call("set", "bystander", b"ok")
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                refused = True
            refused = refused or await closed_by_server(bad)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
            await bad.aclose()
        assert refused
        assert peak - base < 4 * 1024 * 1024  # bounded by the setting, not by what was offered
        assert await peer.call("get", "bystander") == b"ok"
        await wait_for_connections(server, 1)


async def test_peer_that_never_reads_is_backpressured_not_buffered(server: StoreServer) -> None:
    """A peer that asks for 120 MB of replies and reads none: the server stops reading it instead of buffering."""
    setter = wire.ClientProtocol()
    async with await connect(server) as writer:
        await writer.send(setter.send(wire.Validate()) + setter.send(wire.Set(b"big", b"x" * 60000)))
        hog = await connect(server)
        tracemalloc.start()
        try:
            base, _ = tracemalloc.get_traced_memory()
            with anyio.move_on_after(5):
                await hog.send(VALIDATE + wire.encode_request(wire.Get(b"big")) * 2000)
            await writer.send(setter.send(wire.Ping(3)))  # the server still answers everyone else
            with anyio.fail_after(10):
                while (reply := setter.next_reply()) is wire.NEED_DATA:
                    setter.receive_data(await writer.receive())
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert reply == wire.PingReply(3)
        assert peak - base < 4 * 1024 * 1024
        await hog.aclose()
    await wait_for_connections(server, 0)
