"""aelastic's TCPStore server: torch's own client against it (every op, every address family), gloo workers
bootstrapping through it, and the server's semantics over the raw codec where torch's client cannot reach
(cancel races, wake-one, pipelining, protocol violations)."""

from __future__ import annotations

import logging
import os
import socket
import sys
from collections.abc import AsyncIterator, Callable, Iterator

import anyio
import anyio.abc
import pytest
from helpers.store import (
    GLOO_WORKER,
    anyio_backend,  # noqa: F401 (the fixture: these tests run on uvloop too)
    wait_for_connections,
)
from helpers.torch_store_peer import PeerError, TorchPeer

from aelastic.store import wire
from aelastic.store.server import (
    ServerSettings,
    ServerStatistics,
    StoreServer,
    open_store_server,
    serve_store,
)
from aelastic.store.table import Connection, StoreTable

pytestmark = pytest.mark.anyio

torch_peer = pytest.mark.torch


# --- fixtures and helpers -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def peers() -> Iterator[tuple[TorchPeer, TorchPeer]]:
    """Two processes running torch's TCPStore client, shared by the module (each test connects them anew)."""
    first, second = TorchPeer(), TorchPeer()
    try:
        yield first, second
    finally:
        first.close()
        second.close()


@pytest.fixture
async def server() -> AsyncIterator[StoreServer]:
    # No deadline around the yield: it would cancel the test running inside it (binding cannot hang).
    async with open_store_server("::", 0) as server:
        yield server


async def wait_until(predicate: Callable[[], bool], what: str) -> None:
    """Poll a server-side condition that has no event of its own (tests only); ``what`` names it on failure."""
    with anyio.fail_after(10):
        while not predicate():  # noqa: ASYNC110 - server state has no event to wait on
            await anyio.sleep(0.005)


class RawClient:
    """Our codec over a plain socket: exact control over what is sent and when."""

    def __init__(self, stream: anyio.abc.SocketStream) -> None:
        self.stream = stream
        self.protocol = wire.ClientProtocol()

    @classmethod
    async def connect(cls, port: int, *, validate: bool = True) -> RawClient:
        client = cls(await anyio.connect_tcp("127.0.0.1", port))
        if validate:
            await client.send(wire.Validate())
        return client

    async def send(self, *requests: wire.Request) -> None:
        await self.stream.send(b"".join(self.protocol.send(r) for r in requests))

    async def reply(self) -> wire.Reply:
        with anyio.fail_after(10):
            while (reply := self.protocol.next_reply()) is wire.NEED_DATA:
                self.protocol.receive_data(await self.stream.receive())
        return reply

    async def ask(self, request: wire.Request) -> wire.Reply:
        await self.send(request)
        return await self.reply()

    async def assert_closed_by_server(self) -> None:
        with anyio.fail_after(10):
            try:
                while await self.stream.receive():
                    pass
            except (anyio.EndOfStream, anyio.BrokenResourceError):
                return

    async def aclose(self) -> None:
        await self.stream.aclose()


STOP = wire.WaitReply(wire.WaitResponse.STOP_WAITING)
CANCELED = wire.WaitReply(wire.WaitResponse.WAIT_CANCELED)


# --- torch's client, every op ---------------------------------------------------------------------------------


@torch_peer
@pytest.mark.parametrize("host", ["localhost", "127.0.0.1", "::1"])
async def test_torch_client_every_op(host: str, server: StoreServer, peers: tuple[TorchPeer, TorchPeer]) -> None:
    peer, _ = peers
    await peer.connect(host, server.port)
    await peer.call("set", "alpha", b"1")
    assert await peer.call("get", "alpha") == b"1"
    await peer.call("set", "bin", b"\x00\xff")
    assert await peer.call("get", "bin") == b"\x00\xff"

    assert await peer.call("add", "counter", 5) == 5
    assert await peer.call("add", "counter", -7) == -2
    assert await peer.call("get", "counter") == b"-2"

    assert await peer.call("compare_set", "cas", "", "first") == b"first"  # missing + empty expected: written
    assert await peer.call("compare_set", "cas", "wrong", "second") == b"first"  # mismatch: current value
    assert await peer.call("compare_set", "cas", "first", "second") == b"second"
    assert await peer.call("compare_set", "nowhere", "x", "y") == b"x"  # torch's lie: nothing written
    assert await peer.call("check", ["nowhere"]) is False
    assert await peer.call("check", ["alpha", "cas"]) is True

    await peer.call("append", "log", b"a")
    await peer.call("append", "log", b"b")
    assert await peer.call("get", "log") == b"ab"

    await peer.call("multi_set", ["m1", "m2"], ["v1", "v2"])
    assert await peer.call("multi_get", ["m2", "m1"]) == [b"v2", b"v1"]

    assert await peer.call("delete_key", "alpha") is True
    assert await peer.call("delete_key", "alpha") is False
    assert await peer.call("check", ["alpha"]) is False

    keys = ["bin", "counter", "cas", "log", "m1", "m2"]
    assert sorted(await peer.call("list_keys")) == sorted(keys)
    assert await peer.call("num_keys") == len(keys)  # torch's client counts the raw table

    await peer.call("queue_push", "q", b"one")
    await peer.call("queue_push", "q", b"two")
    assert await peer.call("queue_len", "q") == 2
    assert await peer.call("queue_pop", "q") == b"one"
    assert await peer.call("queue_pop", "q", False) == b"two"
    assert await peer.call("queue_len", "q") == 0
    with pytest.raises(PeerError, match="empty"):
        await peer.call("queue_pop", "q", False)

    await peer.call("barrier", "solo", 1)
    await peer.call("wait", ["bin", "log"], 5.0)
    stats = server.statistics()
    assert stats.connections >= 1
    assert stats.waiters == 0
    assert stats.ops_served > 30


@torch_peer
async def test_torch_wait_timeout_leaves_connection_usable(
    server: StoreServer, peers: tuple[TorchPeer, TorchPeer]
) -> None:
    peer, _ = peers
    await peer.connect("127.0.0.1", server.port)
    with pytest.raises(PeerError, match=r"(?i)timeout") as info:
        await peer.call("wait", ["never"], 0.2)
    assert info.value.type_name in ("DistStoreError", "RuntimeError")
    assert server.statistics().waiters == 0  # CANCEL_WAIT dropped the registration
    await peer.call("set", "after", b"ok")
    assert await peer.call("get", "after") == b"ok"
    with pytest.raises(PeerError, match=r"(?i)timeout"):
        await peer.call("barrier", "lonely", 2, 0.2)
    assert await peer.call("add", "after-barrier", 1) == 1


@torch_peer
async def test_torch_deferred_wait_woken_by_another_client(
    server: StoreServer, peers: tuple[TorchPeer, TorchPeer]
) -> None:
    waiter, writer = peers
    await waiter.connect("::1", server.port)
    await writer.connect("127.0.0.1", server.port)
    async with anyio.create_task_group() as tg:
        tg.start_soon(waiter.call, "wait", ["late1", "late2"], 10.0)
        await wait_until(lambda: server.statistics().waiters == 1, "the WAIT to register")
        await writer.call("set", "late1", b"x")
        assert server.statistics().waiters == 1  # one of two keys: still waiting
        await writer.call("set", "late2", b"y")
    assert server.statistics().waiters == 0
    assert await waiter.call("get", "late2") == b"y"


@torch_peer
async def test_torch_get_blocks_until_set(server: StoreServer, peers: tuple[TorchPeer, TorchPeer]) -> None:
    reader, writer = peers
    await reader.connect("localhost", server.port)
    await writer.connect("localhost", server.port)
    results: list[bytes] = []

    async def read() -> None:
        results.append(await reader.call("get", "slow"))

    async with anyio.create_task_group() as tg:
        tg.start_soon(read)
        await wait_until(lambda: server.statistics().waiters == 1, "GET's WAIT to register")
        await writer.call("set", "slow", b"value")
    assert results == [b"value"]


@torch_peer
async def test_torch_barrier_and_blocking_queue_pop(server: StoreServer, peers: tuple[TorchPeer, TorchPeer]) -> None:
    first, second = peers
    await first.connect("127.0.0.1", server.port)
    await second.connect("::1", server.port)
    async with anyio.create_task_group() as tg:
        tg.start_soon(first.call, "barrier", "meet", 2)
        await wait_until(lambda: server.statistics().waiters == 1, "the first barrier arrival")
        await second.call("barrier", "meet", 2)
    popped: list[bytes] = []

    async def pop() -> None:
        popped.append(await first.call("queue_pop", "jobs"))

    async with anyio.create_task_group() as tg:
        tg.start_soon(pop)
        await wait_until(lambda: server.statistics().waiters == 1, "the blocking pop's WAIT")
        await second.call("queue_push", "jobs", b"job-1")
    assert popped == [b"job-1"]
    assert await second.call("queue_len", "jobs") == 0


@torch_peer
async def test_gloo_all_reduce_through_agent_store(server: StoreServer) -> None:
    world = 3
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MASTER_", "RANK", "WORLD_", "TORCHELASTIC"))}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(server.port), WORLD_SIZE=str(world))
    env.update(TORCHELASTIC_USE_AGENT_STORE="True", GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    outputs: dict[int, bytes] = {}

    async def worker(rank: int) -> None:
        result = await anyio.run_process(
            [sys.executable, "-c", GLOO_WORKER], env={**env, "RANK": str(rank)}, check=False
        )
        assert result.returncode == 0, result.stderr.decode(errors="replace")[-2000:]
        outputs[rank] = result.stdout

    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            for rank in range(world):
                tg.start_soon(worker, rank)
    expected = world * (world + 1) // 2
    assert {rank: out.decode().strip() for rank, out in outputs.items()} == {
        rank: f"rank={rank} sum={expected}" for rank in range(world)
    }
    assert server.statistics().keys > 0  # the workers' store traffic went through our table


# --- listening --------------------------------------------------------------------------------------------------


def _can_connect(family: socket.AddressFamily, address: str, port: int) -> bool:
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.settimeout(2)
        return probe.connect_ex((address, port)) == 0


async def test_dual_stack_on_any_address(server: StoreServer) -> None:
    assert server.host == "::"
    assert len(server.addresses) == 1
    assert server.addresses[0][1] == server.port != 0
    assert _can_connect(socket.AF_INET, "127.0.0.1", server.port)
    assert _can_connect(socket.AF_INET6, "::1", server.port)


async def test_ipv4_literal_binds_only_itself() -> None:
    async with open_store_server("127.0.0.1", 0) as server:
        assert server.addresses == (("127.0.0.1", server.port),)
        assert _can_connect(socket.AF_INET, "127.0.0.1", server.port)
        assert not _can_connect(socket.AF_INET6, "::1", server.port)


async def test_hostname_binds_every_resolved_address() -> None:
    resolved = {info[4][0] for info in socket.getaddrinfo("localhost", 0, type=socket.SOCK_STREAM)}
    async with open_store_server("localhost", 0) as server:
        assert {address for address, _ in server.addresses} == resolved
        assert {port for _, port in server.addresses} == {server.port}
        for address in resolved:
            family = socket.AF_INET6 if ":" in address else socket.AF_INET
            assert _can_connect(family, address, server.port)


async def test_serve_store_reports_server_and_stops_on_cancel() -> None:
    async with anyio.create_task_group() as tg:
        server: StoreServer = await tg.start(serve_store, "127.0.0.1", 0)
        client = await RawClient.connect(server.port)
        assert await client.ask(wire.Ping(7)) == wire.PingReply(7)
        assert "connections=1" in repr(server)
        tg.cancel_scope.cancel()
    await client.assert_closed_by_server()
    await client.aclose()
    assert not _can_connect(socket.AF_INET, "127.0.0.1", server.port)


async def test_bind_conflict_raises_before_started() -> None:
    async with open_store_server("127.0.0.1", 0) as first:
        with pytest.raises(OSError, match="in use"):
            async with open_store_server("127.0.0.1", first.port):
                pass


def test_settings_validate() -> None:
    with pytest.raises(ValueError, match="max_buffered_bytes"):
        ServerSettings(max_buffered_bytes=1024)
    small = ServerSettings(wire.Limits(max_key_length=8, max_value_length=8), max_buffered_bytes=64)
    assert small.max_buffered_bytes == 64


# --- semantics over the raw codec -------------------------------------------------------------------------------


async def test_statistics_and_repr(server: StoreServer) -> None:
    assert server.statistics() == ServerStatistics(
        name="store", port=server.port, connections=0, keys=0, queued=0, waiters=0, ops_served=0, bytes_received=0
    )
    client = await RawClient.connect(server.port)
    requests = (wire.Set(b"a", b"1"), wire.Set(b"b", b"2"), wire.QueuePush(b"q", b"x"), wire.Wait((b"c",)))
    await client.send(*requests)
    await wait_until(lambda: server.statistics().waiters == 1, "the WAIT")
    sent = len(wire.encode_request(wire.Validate())) + sum(len(wire.encode_request(r)) for r in requests)
    kinds = {"Validate": 1, "Set": 2, "QueuePush": 1, "Wait": 1}
    assert server.statistics() == ServerStatistics(
        name="store", port=server.port, connections=1, keys=2, queued=1, waiters=1, ops_served=5, bytes_received=sent,
        ops_by_kind=kinds, sent_by_kind=dict.fromkeys(kinds, 0),
    )  # fmt: skip
    assert repr(server) == (f"<StoreServer store [::]:{server.port} connections=1 keys=2 waiters=1 ops_served=5>")
    await client.aclose()
    await wait_until(lambda: server.statistics().connections == 0, "the close")
    assert server.statistics().waiters == 0


async def test_pipelined_requests_answered_in_order(server: StoreServer) -> None:
    client = await RawClient.connect(server.port)
    requests: list[wire.Request] = [wire.Set(b"k%d" % i, b"%d" % i) for i in range(200)]
    requests += [wire.Get(b"k7"), wire.Add(b"k8", 2), wire.GetNumKeys(), wire.Ping(99), wire.Get(b"nothing")]
    await client.send(*requests)
    assert [await client.reply() for _ in range(5)] == [
        wire.ValueReply(b"7"),
        wire.IntReply(10),
        wire.IntReply(200),
        wire.PingReply(99),
        wire.ValueReply(b""),
    ]
    await client.aclose()


async def test_wait_then_cancel_without_set(server: StoreServer) -> None:
    client = await RawClient.connect(server.port)
    await client.send(wire.Wait((b"k",)))
    await wait_until(lambda: server.statistics().waiters == 1, "the WAIT")
    await client.send(wire.CancelWait())
    with anyio.fail_after(5):
        raw = await client.stream.receive()
    assert raw == b"\x01"  # only the cancel's reply: the wait itself is never answered
    assert server.statistics().waiters == 0
    await client.stream.send(wire.encode_request(wire.Set(b"k", b"v")))  # no stale wake-up follows
    await client.stream.send(wire.encode_request(wire.Get(b"k")))
    with anyio.fail_after(5):
        assert await client.stream.receive() == b"\x01\x00\x00\x00\x00\x00\x00\x00v"
    await client.aclose()


async def test_wait_woken_before_cancel(server: StoreServer) -> None:
    waiter = await RawClient.connect(server.port)
    writer = await RawClient.connect(server.port)
    await waiter.send(wire.Wait((b"k",)))
    await wait_until(lambda: server.statistics().waiters == 1, "the WAIT")
    await writer.send(wire.Set(b"k", b"v"))
    assert await writer.ask(wire.Ping(1)) == wire.PingReply(1)  # the SET was handled: STOP_WAITING is on its way
    await waiter.send(wire.CancelWait())  # the client gave up at the same moment: torch's race
    with anyio.fail_after(5):
        raw = b""
        while len(raw) < 2:
            raw += await waiter.stream.receive()
    assert raw == b"\x00\x01"  # the wait's STOP_WAITING, then the cancel's WAIT_CANCELED
    for client in (waiter, writer):
        await client.aclose()


async def test_wait_counts_each_missing_key_and_queues(server: StoreServer) -> None:
    client = await RawClient.connect(server.port)
    writer = await RawClient.connect(server.port)
    await writer.send(wire.Set(b"have", b"1"), wire.QueuePush(b"queue", b"x"))
    assert await writer.ask(wire.Check((b"have", b"queue"))) == wire.CheckReply(wire.CheckResponse.READY)
    assert await client.ask(wire.Wait((b"have", b"queue"))) == STOP  # a non-empty queue counts as present
    assert await writer.ask(wire.Check((b"have", b"a"))) == wire.CheckReply(wire.CheckResponse.NOT_READY)
    await client.send(wire.Wait((b"have", b"a", b"b")))
    await wait_until(lambda: server.statistics().waiters == 1, "the WAIT")
    await writer.send(wire.Append(b"a", b"1"))
    await writer.ask(wire.Ping(0))
    assert server.statistics().waiters == 1
    assert await writer.ask(wire.Add(b"b", 1)) == wire.IntReply(1)
    assert await client.reply() == STOP
    for c in (client, writer):
        await c.aclose()


async def test_compare_set_wakes_waiters_on_every_path(server: StoreServer) -> None:
    waiter = await RawClient.connect(server.port)
    writer = await RawClient.connect(server.port)
    await waiter.send(wire.Wait((b"k",)))
    await wait_until(lambda: server.statistics().waiters == 1, "the WAIT")
    # Missing key, non-empty expected: nothing is written, yet libuv wakes the key's waiters.
    assert await writer.ask(wire.CompareSet(b"k", b"x", b"y")) == wire.ValueReply(b"x")
    assert await waiter.reply() == STOP
    assert await waiter.ask(wire.Check((b"k",))) == wire.CheckReply(wire.CheckResponse.NOT_READY)
    for c in (waiter, writer):
        await c.aclose()


async def test_queue_push_wakes_one_waiter(server: StoreServer) -> None:
    first = await RawClient.connect(server.port)
    second = await RawClient.connect(server.port)
    pusher = await RawClient.connect(server.port)
    await first.send(wire.Wait((b"q",)))
    await wait_until(lambda: server.statistics().waiters == 1, "the first WAIT")
    await second.send(wire.Wait((b"q",)))
    await wait_until(lambda: server.statistics().waiters == 2, "the second WAIT")
    await pusher.send(wire.QueuePush(b"q", b"job"))
    assert await first.reply() == STOP  # the longest waiter wins
    assert server.statistics().waiters == 1
    assert await first.ask(wire.QueuePop(b"q")) == wire.QueuePopReply(1, b"job")
    assert await first.ask(wire.QueuePop(b"q")) == wire.QueuePopReply(0, None)
    await pusher.send(wire.QueuePush(b"q", b"job2"))
    assert await second.reply() == STOP
    assert await second.ask(wire.QueueLen(b"q")) == wire.IntReply(1)
    for c in (first, second, pusher):
        await c.aclose()


async def test_a_cancelled_waiter_leaves_the_others_of_its_key_waiting_in_order(server: StoreServer) -> None:
    """The waiters of a key are kept in registration order with a count each (so that a cancel is O(1) at 10,000
    waiters of one key): a cancel in the middle leaves the others, still first-come first-woken; a key named twice
    in one WAIT is awaited twice, and one SET wakes it once (torch's libuv server: two registrations, one
    STOP_WAITING)."""
    waiters = [await RawClient.connect(server.port) for _ in range(3)]
    writer = await RawClient.connect(server.port)
    for i, w in enumerate(waiters):
        await w.send(wire.Wait((b"q",)))
        await wait_until(lambda n=i + 1: server.statistics().waiters == n, "the WAITs")
    await waiters[1].send(wire.CancelWait())
    with anyio.fail_after(5):
        assert await waiters[1].stream.receive() == b"\x01"  # WAIT_CANCELED alone
    assert server.statistics().waiters == 2
    await writer.send(wire.QueuePush(b"q", b"1"))
    assert await waiters[0].reply() == STOP
    await writer.send(wire.QueuePush(b"q", b"2"))
    assert await waiters[2].reply() == STOP
    assert server.statistics().waiters == 0

    twice = await RawClient.connect(server.port)
    await twice.send(wire.Wait((b"k", b"k")))
    await wait_until(lambda: server.statistics().waiters == 1, "the WAIT")
    await writer.send(wire.Set(b"k", b"v"))
    assert await twice.reply() == STOP
    assert await twice.ask(wire.Ping(7)) == wire.PingReply(7)  # one STOP_WAITING, nothing after it
    assert server.statistics().waiters == 0
    for c in (*waiters, twice, writer):
        await c.aclose()


async def test_barrier_releases_everyone_at_world_size(server: StoreServer) -> None:
    clients = [await RawClient.connect(server.port) for _ in range(3)]
    await clients[0].send(wire.Barrier(b"bar", 3))
    await wait_until(lambda: server.statistics().waiters == 1, "the first arrival")
    await clients[1].send(wire.Barrier(b"bar", 3))
    await wait_until(lambda: server.statistics().waiters == 2, "the second arrival")
    assert await clients[2].ask(wire.Barrier(b"bar", 3)) == STOP
    assert [await c.reply() for c in clients[:2]] == [STOP, STOP]
    assert await clients[0].ask(wire.Get(b"bar")) == wire.ValueReply(b"3")
    for c in clients:
        await c.aclose()


async def test_closed_waiter_is_forgotten(server: StoreServer) -> None:
    waiter = await RawClient.connect(server.port)
    await waiter.send(wire.Wait((b"k1", b"k2")))
    await wait_until(lambda: server.statistics().waiters == 1, "the WAIT")
    await waiter.aclose()
    await wait_until(lambda: server.statistics().connections == 0, "the close")
    writer = await RawClient.connect(server.port)
    await writer.send(wire.Set(b"k1", b"v"))
    assert await writer.ask(wire.Get(b"k1")) == wire.ValueReply(b"v")
    assert server.statistics().waiters == 0
    await writer.aclose()


async def test_own_set_wakes_own_pipelined_wait(server: StoreServer) -> None:
    client = await RawClient.connect(server.port)
    await client.send(wire.Wait((b"self",)), wire.Set(b"self", b"1"), wire.Get(b"self"))
    assert await client.reply() == STOP
    assert await client.reply() == wire.ValueReply(b"1")
    await client.aclose()


@pytest.mark.parametrize(
    ("first", "why"),
    [
        (wire.encode_request(wire.Ping(1)), "not VALIDATE"),
        (wire.encode_request(wire.Validate(0x12345678)), "wrong magic"),
    ],
)
async def test_connection_must_validate_first(server: StoreServer, first: bytes, why: str) -> None:
    bad = await RawClient.connect(server.port, validate=False)
    await bad.stream.send(first)
    await bad.assert_closed_by_server()
    await bad.aclose()
    good = await RawClient.connect(server.port)
    assert await good.ask(wire.Ping(5)) == wire.PingReply(5), why
    await good.aclose()


async def test_add_on_non_numeric_value_closes_only_that_connection(server: StoreServer) -> None:
    bystander = await RawClient.connect(server.port)
    await bystander.send(wire.Wait((b"other",)))
    bad = await RawClient.connect(server.port)
    await bad.send(wire.Set(b"word", b"hello"), wire.Add(b"word", 1))
    await bad.assert_closed_by_server()
    await bad.aclose()
    writer = await RawClient.connect(server.port)
    await writer.send(wire.Set(b"other", b"1"))
    assert await bystander.reply() == STOP
    assert await writer.ask(wire.Get(b"word")) == wire.ValueReply(b"hello")
    for c in (bystander, writer):
        await c.aclose()


async def test_an_internal_error_closes_only_its_connection(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A bug met while handling one connection's request (here an injected one) closes that connection with the
    traceback logged, on every loop, and the store serves the others on."""
    get = StoreTable._get

    def buggy_get(table: StoreTable, conn: Connection, request: wire.Get) -> None:
        if request.key == b"bug":
            raise RuntimeError("an injected bug")
        get(table, conn, request)

    monkeypatch.setattr(StoreTable, "_get", buggy_get)
    caplog.set_level(logging.ERROR, logger="aelastic.store")
    async with open_store_server("127.0.0.1", 0) as server:
        bystander = await RawClient.connect(server.port)
        await bystander.send(wire.Wait((b"later",)))
        victim = await RawClient.connect(server.port)
        await victim.send(wire.Set(b"before", b"1"), wire.Get(b"bug"))
        await victim.assert_closed_by_server()
        await victim.aclose()
        await bystander.send(wire.Set(b"later", b"2"))
        assert await bystander.reply() == STOP
        assert await bystander.ask(wire.Get(b"before")) == wire.ValueReply(b"1")
        await wait_for_connections(server, 1)
        await bystander.aclose()
    [record] = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert "internal error handling a request from 127.0.0.1:" in record.getMessage()
    assert record.exc_info is not None
    assert "an injected bug" in str(record.exc_info[1])


async def test_slow_reader_stalls_only_itself(server: StoreServer) -> None:
    big = b"x" * (4 * 1024 * 1024)
    setter = await RawClient.connect(server.port)
    await setter.send(wire.Set(b"big", big))
    # This peer asks for far more than the socket buffers hold and never reads: its reader blocks in send.
    hog = await anyio.connect_tcp("127.0.0.1", server.port)
    await hog.send(wire.encode_request(wire.Validate()) + wire.encode_request(wire.Get(b"big")) * 16)
    waiter = await RawClient.connect(server.port)
    await waiter.send(wire.Wait((b"go",)))
    await wait_until(lambda: server.statistics().waiters == 1, "the WAIT")
    await setter.send(wire.Set(b"go", b"1"))
    assert await waiter.reply() == STOP
    assert await setter.ask(wire.Add(b"n", 1)) == wire.IntReply(1)
    await hog.aclose()
    for c in (setter, waiter):
        await c.aclose()
    await wait_until(lambda: server.statistics().connections == 0, "every close")


async def test_leaving_open_store_server_closes_connections() -> None:
    async with open_store_server("127.0.0.1", 0) as server:
        idle = await RawClient.connect(server.port)
        waiting = await RawClient.connect(server.port)
        await waiting.send(wire.Wait((b"never",)))
        await wait_until(lambda: server.statistics().waiters == 1, "the WAIT")
    for client in (idle, waiting):
        await client.assert_closed_by_server()
        await client.aclose()


async def test_values_are_opaque_bytes(server: StoreServer) -> None:
    client = await RawClient.connect(server.port)
    key, value = bytes(range(256)), bytes(range(255, -1, -1)) * 3
    await client.send(wire.MultiSet(((key, value), (b"", b"empty-key"))))
    assert await client.ask(wire.MultiGet((key, b"", b"missing"))) == wire.ValuesReply((value, b"empty-key", b""))
    reply = await client.ask(wire.ListKeys())
    assert isinstance(reply, wire.KeysReply)
    assert sorted(reply.keys) == sorted([key, b""])
    assert await client.ask(wire.DeleteKey(b"")) == wire.IntReply(1)
    assert await client.ask(wire.Add(b"neg", -(2**63))) == wire.IntReply(-(2**63))
    await client.aclose()
