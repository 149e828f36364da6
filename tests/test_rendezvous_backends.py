"""The backend protocol's join requests, on every backend (memory, the c10d store driver, etcd), asyncio and trio.

A request is returned by every later read, in order; a compare-and-set decided on a read that missed a request
fails and hands the request back; one that saw it consumes it. Appending wakes no waiter of the state.
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack

import anyio
import pytest

from aelastic.etcd import EtcdConfig, open_etcd_client, parse_endpoints
from aelastic.rendezvous.backends.base import DigestRead, RendezvousBackend
from aelastic.rendezvous.backends.etcd import EtcdBackend
from aelastic.rendezvous.backends.memory import MemoryBackend, MemoryRendezvous
from aelastic.rendezvous.backends.store import StoreBackend
from aelastic.rendezvous.codec import decode_view, make_digest
from aelastic.rendezvous.values import NodeDesc, RendezvousState
from aelastic.store.client import open_store_client
from aelastic.store.server import open_store_server

pytestmark = pytest.mark.anyio

_runs = itertools.count()
DIGEST = make_digest(RendezvousState())  # what the bytes below would publish; only the store driver keeps it


@pytest.fixture(params=["memory", "c10d", "etcd"])
async def pair(request: pytest.FixtureRequest) -> AsyncIterator[tuple[RendezvousBackend, RendezvousBackend]]:
    """Two backends of one fresh run id, each on its own connection."""
    run_id = f"protocol{next(_runs)}"
    async with AsyncExitStack() as stack:
        if request.param == "etcd":
            config = EtcdConfig(parse_endpoints(request.getfixturevalue("etcd_endpoint")))
            a, b = [
                EtcdBackend(await stack.enter_async_context(open_etcd_client(config)), "/protocol", run_id, lease_ttl=5)
                for _ in range(2)
            ]
            yield a, b
            return
        server = await stack.enter_async_context(open_store_server("127.0.0.1", 0))
        clients = [await stack.enter_async_context(open_store_client("127.0.0.1", server.port)) for _ in range(2)]
        if request.param == "memory":
            shared = MemoryRendezvous()
            yield MemoryBackend(shared, clients[0]), MemoryBackend(shared, clients[1])
            return
        stores = [StoreBackend(client, run_id) for client in clients]
        for s in stores:
            await s.initialize()
        yield stores[0], stores[1]


async def test_join_requests_are_read_in_order_and_consumed_by_a_write(
    pair: tuple[RendezvousBackend, RendezvousBackend],
) -> None:
    a, b = pair
    start = await a.get_state()
    assert start.pending == ()
    await a.request_join(b"first")
    await b.request_join(b"second")
    seen = await b.get_state()
    assert seen.pending == (b"first", b"second")
    assert seen.version == start.version  # a request is not a new version

    # A write decided on the read that missed both requests fails, and hands them back.
    stale, won = await a.set_state(b"stale", start, DIGEST)
    assert not won
    assert (stale.version, stale.pending) == (start.version, (b"first", b"second"))

    # A request appended after a read makes the write decided on that read fail too.
    await a.request_join(b"third")
    late, won = await b.set_state(b"missed the third", seen, DIGEST)
    assert not won
    assert late.pending == (b"first", b"second", b"third")

    # A write that saw every request consumes them.
    written, won = await b.set_state(b"folded", late, DIGEST)
    assert won
    assert (written.version, written.data, written.pending) == (start.version + 1, b"folded", ())
    current = await a.get_state()
    assert (current.version, current.data, current.pending) == (start.version + 1, b"folded", ())


async def test_a_join_request_wakes_no_waiter_but_a_write_does(
    pair: tuple[RendezvousBackend, RendezvousBackend],
) -> None:
    a, b = pair
    seen = await a.get_state()
    with anyio.move_on_after(0.5) as idle:
        async with anyio.create_task_group() as tg:
            tg.start_soon(a.wait_for_change, seen)
            await b.request_join(b"quiet")
    assert idle.cancelled_caught, "a join request must not wake waiters"
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(a.wait_for_change, seen)
            await b.set_state(b"loud", await b.get_state(), DIGEST)


async def test_store_digests_tickets_and_slots() -> None:
    """The store driver's digests: a join request's ticket counts the requests appended so far, a write's joined
    counts the requests it consumed, a node reads a digest with its own shard (of the version it was woken for,
    else of the latest announced), and a slot overwritten by a newer version is reported (None: read the state
    instead)."""
    me, other = NodeDesc("10.0.0.1", 1, 0), NodeDesc("10.0.0.2", 2, 0)
    async with open_store_server("127.0.0.1", 0) as server, open_store_client("127.0.0.1", server.port) as client:
        a = StoreBackend(client, "digests")
        await a.initialize()
        assert await a.read_digest(me.key, -1) == DigestRead(0, 0, None, None)
        assert [await a.request_join(b"x"), await a.request_join(b"y")] == [1, 2]
        states = [RendezvousState(participants=(me,)), RendezvousState(participants=(me, other))]
        seen = await a.get_state()
        for state in states:
            seen, won = await a.set_state(b"s", seen, make_digest(state))
            assert won
        assert seen.joined == 2  # the first write consumed both requests, the second none
        for known, version in ((1, 1), (-1, 2)):  # version 1 (known, from a wake-up); the latest, 2
            read = await a.read_digest(me.key, known)
            assert read is not None
            assert (read.version, read.joined) == (version, 2)
            assert read.summary is not None
            view, _ = decode_view(me, read.summary, read.shard)
            assert (len(view.participants), me in view.participants) == (version, True)  # states[version - 1]
        assert view.neighbour == other
        for _ in range(3):  # three more versions: version 2's slot is overwritten by version 5
            seen, _ = await a.set_state(b"s", seen, make_digest(states[0]))
        read = await a.read_digest(me.key, -1)
        assert read is not None
        assert read.version == 5
        # A reader woken for version 2 that finds its slot taken reads the state instead.
        assert await a.read_digest(me.key, 2) is None


async def test_store_liveness_judges_counters_without_blocking() -> None:
    """The store driver's ``find_dead``: a node that beats between two checks is alive, one whose counter stood still
    for the grace is dead, and one that never beat (its counter was never written) is judged the same way, on the
    checker's clock, instead of blocking the checker's liveness on a missing key."""
    grace = 0.2
    async with open_store_server("127.0.0.1", 0) as server, open_store_client("127.0.0.1", server.port) as client:
        checker, beating = StoreBackend(client, "alive"), StoreBackend(client, "alive")
        await beating.keep_alive("beats")
        await beating.keep_alive("stops")
        with anyio.fail_after(10):
            assert await checker.find_dead(["beats", "stops", "never"], grace) == frozenset()
            await anyio.sleep(2 * grace)
            await beating.keep_alive("beats")
            assert await checker.find_dead(["beats", "stops", "never"], grace) == {"stops", "never"}


async def _round_traffic(n: int) -> tuple[int, int, int]:
    """One all-at-once round of ``n`` c10d nodes (tasks of this process): the store's requests, reply bytes and
    compare-and-sets from the first join to the last release (opening the handlers is not counted)."""
    from aelastic.rendezvous.api import RendezvousParameters
    from aelastic.rendezvous.registry import open_rendezvous

    async with open_store_server("127.0.0.1", 0) as server:
        opened, go, released = anyio.Event(), anyio.Event(), anyio.Event()
        counts = [0, 0]

        async def node() -> None:
            params = RendezvousParameters(
                "c10d", f"127.0.0.1:{server.port}", f"traffic{n}", n, n, "127.0.0.1", is_host=False,
                join_timeout=120, keep_alive_interval=60,
            )  # fmt: skip
            async with open_rendezvous(params) as handler:
                counts[0] += 1
                if counts[0] == n:
                    opened.set()
                await go.wait()
                await handler.next_rendezvous()
                counts[1] += 1
                if counts[1] == n:
                    released.set()
                await released.wait()

        async with anyio.create_task_group() as tg:
            for _ in range(n):
                tg.start_soon(node)
            with anyio.fail_after(120):
                await opened.wait()
                before = server.statistics()
                go.set()
                await released.wait()
            after = server.statistics()
    cas = after.ops_by_kind.get("CompareSet", 0) - before.ops_by_kind.get("CompareSet", 0)
    return after.ops_served - before.ops_served, after.bytes_sent - before.bytes_sent, cas


async def test_a_c10d_round_costs_linear_requests_and_bytes() -> None:
    """Digests: a node that waits reads its own position, not every node's, so a round's store traffic grows
    linearly with N (with every node re-reading the whole state it grew as N², 16× for 4× the nodes)."""
    small, large = await _round_traffic(50), await _round_traffic(200)
    assert large[0] / small[0] < 4.5, (small, large)  # requests
    assert large[1] / small[1] < 5.5, (small, large)  # reply bytes
    assert large[1] / 200 < 8_000, large  # bytes per node: about 1 KB per digest read, 3 reads
    # One node publishes the round (its position reads use compare-and-sets that never match: 2 per digest).
    assert large[2] <= 1 + 2 * 3 * 200, large
