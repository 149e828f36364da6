"""What protects aelastic's store server from the network: it binds only where asked, ends connections that never
finish their handshake, caps open connections, and refuses bad settings with a message naming them."""

from __future__ import annotations

import logging
import socket
import sys
from collections.abc import AsyncIterator

import anyio
import anyio.abc
import pytest
from helpers.store import (
    anyio_backend,  # noqa: F401 (the fixture: these tests run on uvloop too)
    closed_by_server,
    wait_for_connections,
)
from helpers.torch_store_peer import TorchPeer

from aelastic.rendezvous.api import RendezvousParameters
from aelastic.rendezvous.registry import open_rendezvous
from aelastic.store import wire
from aelastic.store.api import PrefixStore
from aelastic.store.client import StoreClient
from aelastic.store.server import ServerSettings, StoreServer, open_store_server

pytestmark = pytest.mark.anyio

VALIDATE = wire.encode_request(wire.Validate())


def can_connect(address: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.settimeout(5)
        return probe.connect_ex((address, port)) == 0


async def ping(stream: anyio.abc.SocketStream, nonce: int) -> wire.Reply:
    protocol = wire.ClientProtocol()
    await stream.send(protocol.send(wire.Ping(nonce)))
    with anyio.fail_after(10):
        while (reply := protocol.next_reply()) is wire.NEED_DATA:
            protocol.receive_data(await stream.receive())
    return reply


@pytest.fixture(autouse=True)
def _warnings_are_captured(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="aelastic.store")


# --- binding ------------------------------------------------------------------------------------------------------
# On Linux every 127.0.0.0/8 address reaches loopback, so a server bound to all interfaces answers on 127.0.0.2
# and one bound to 127.0.0.1 alone does not.


async def test_literal_binds_only_that_address() -> None:
    async with open_store_server("127.0.0.1", 0) as server:
        assert can_connect("127.0.0.1", server.port)
        assert not can_connect("127.0.0.2", server.port)
        assert not can_connect("::1", server.port)


@pytest.mark.parametrize(("host", "other"), [("0.0.0.0", "127.0.0.2"), ("::", "127.0.0.2"), ("::", "::1")])
async def test_all_interfaces_only_when_asked(host: str, other: str) -> None:
    async with open_store_server(host, 0) as server:
        assert can_connect(other, server.port)


async def test_c10d_serves_its_stores_on_the_endpoint_address_only() -> None:
    """The c10d backend's rendezvous store binds the endpoint's host, and the workers' store this node's address."""
    params = RendezvousParameters("c10d", "127.0.0.1:0", "bind-test", 1, 1, join_timeout=30, last_call_timeout=0.1)
    with anyio.fail_after(60):
        async with open_rendezvous(params) as handler:
            info = await handler.next_rendezvous()
            assert isinstance(info.store, PrefixStore)
            assert isinstance(info.store.store, StoreClient)
            rendezvous_port = info.store.store.port
            bootstrap = info.bootstrap_store_info
            assert bootstrap.master_addr == "127.0.0.1"
            for port in (rendezvous_port, bootstrap.master_port):
                assert can_connect("127.0.0.1", port)
                assert not can_connect("127.0.0.2", port)
                assert not can_connect("::1", port)
            await handler.shutdown()


# --- half-open connections ----------------------------------------------------------------------------------------


@pytest.fixture
async def quick_server() -> AsyncIterator[StoreServer]:
    async with open_store_server("127.0.0.1", 0, ServerSettings(handshake_timeout=0.5)) as server:
        yield server


@pytest.mark.parametrize(
    "sent",
    [b"", VALIDATE[:3], VALIDATE + wire.encode_request(wire.Set(b"/k", b"v"))[:-1]],
    ids=["nothing", "half a VALIDATE", "VALIDATE then half a SET"],
)
async def test_half_open_connection_times_out(
    sent: bytes, quick_server: StoreServer, caplog: pytest.LogCaptureFixture
) -> None:
    async with await anyio.connect_tcp("127.0.0.1", quick_server.port) as idle:
        # A validated connection that then says nothing is an idle client, not a half-open one: it stays.
        await idle.send(VALIDATE)
        async with await anyio.connect_tcp("127.0.0.1", quick_server.port) as half:
            await half.send(sent)
            validated = sent.startswith(VALIDATE)
            started = anyio.current_time()
            closed = await closed_by_server(half, within=1.5 if validated else 10)
            waited = anyio.current_time() - started
        assert closed is not validated
        if not validated:
            assert waited >= 0.4  # not before the timeout (its clock started at accept, before `started`)
            assert "no VALIDATE within 0.5s (ServerSettings.handshake_timeout)" in caplog.text
        assert await ping(idle, 42) == wire.PingReply(42)
    await wait_for_connections(quick_server, 0)


@pytest.mark.torch
async def test_torch_client_outlives_the_handshake_timeout(quick_server: StoreServer) -> None:
    peer = TorchPeer()
    try:
        await peer.connect("127.0.0.1", quick_server.port)
        await peer.call("set", "k", b"v")
        await anyio.sleep(1.0)  # twice the handshake timeout: an established connection has no deadline
        assert await peer.call("get", "k") == b"v"
    finally:
        peer.close()


# --- connection cap ---------------------------------------------------------------------------------------------


async def test_connections_beyond_the_cap_are_closed_at_once(caplog: pytest.LogCaptureFixture) -> None:
    async with open_store_server("127.0.0.1", 0, ServerSettings(max_connections=3)) as server:
        held = [await anyio.connect_tcp("127.0.0.1", server.port) for _ in range(3)]
        for stream in held:
            await stream.send(VALIDATE)
        await wait_for_connections(server, 3)
        for _ in range(2):
            async with await anyio.connect_tcp("127.0.0.1", server.port) as extra:
                assert await closed_by_server(extra, within=5)
        assert server.statistics().connections == 3
        assert caplog.text.count("ServerSettings.max_connections") == 1  # once per episode, not per refusal
        assert all([await ping(stream, i) == wire.PingReply(i) for i, stream in enumerate(held)])
        await held.pop().aclose()
        await wait_for_connections(server, 2)
        async with await anyio.connect_tcp("127.0.0.1", server.port) as again:
            await again.send(VALIDATE)
            assert await ping(again, 7) == wire.PingReply(7)
        for stream in held:
            await stream.aclose()
        await wait_for_connections(server, 0)


# Soft and hard limit both: `aelastic store` raises its soft limit to the hard one at start (tests/test_open_files.py).
LIMITED_STORE = """
import resource, sys
resource.setrlimit(resource.RLIMIT_NOFILE, (128, 128))
from aelastic.cli import main
sys.exit(main(["store", "--host", "127.0.0.1", "--port", "0"]))
"""


async def test_default_cap_is_half_the_open_file_limit() -> None:
    """A store whose process may open 128 files admits 64 connections and refuses the rest at once, instead of
    running out of file descriptors (which an agent also needs for its workers)."""
    async with await anyio.open_process([sys.executable, "-c", LIMITED_STORE]) as store:
        assert store.stdout is not None
        with anyio.fail_after(30):
            line = (await store.stdout.receive()).decode()
        port = int(line.strip().rsplit(":", 1)[1])  # "aelastic store listening on 127.0.0.1:PORT"
        streams = [await anyio.connect_tcp("127.0.0.1", port) for _ in range(80)]
        try:
            for stream in streams:  # in order: the first 64 are admitted, the rest closed as they arrive
                await stream.send(VALIDATE)
            admitted = [stream for stream in streams[:64] if await ping(stream, 1) == wire.PingReply(1)]
            assert len(admitted) == 64
            assert all([await closed_by_server(stream, within=5) for stream in streams[64:]])
        finally:
            for stream in streams:
                await stream.aclose()
            store.terminate()
        assert await store.wait() == 0


# --- settings -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_connections": 0}, r"max_connections=0: must be >= 1"),
        ({"handshake_timeout": 0}, r"handshake_timeout=0: must be a positive number"),
        ({"handshake_timeout": float("inf")}, r"handshake_timeout=inf: must be a positive number"),
        ({"auth_token": ""}, r"ServerSettings.auth_token: a token of 0 bytes; it must be 1..1024 bytes"),
        ({"auth_token": "x" * 1025}, r"a token of 1025 bytes"),
    ],
)
def test_bad_settings_are_refused(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ServerSettings(**kwargs)  # type: ignore[arg-type]


def test_token_is_not_in_the_settings_repr() -> None:
    assert "s3cret" not in repr(ServerSettings(auth_token="s3cret"))
