"""One conformance suite for every rendezvous backend, on asyncio and trio, with real timing.

Each test states one of the seed's guarantees (barrier, join timeout, exclusivity, consistency, fault tolerance,
closing, reserve) and checks it against nodes running as tasks; ``test_rendezvous_processes.py`` repeats the
fault cases with nodes as separate OS processes.
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from typing import Any

import anyio
import pytest
from rendezvous_cluster import Cluster, Node, Opener, open_cluster

from aelastic.errors import (
    RendezvousClosedError,
    RendezvousGracefulExitError,
    RendezvousTimeoutError,
    StoreConnectionError,
)
from aelastic.rendezvous.api import RendezvousHandler, RendezvousInfo, RendezvousParameters, open_rendezvous
from aelastic.rendezvous.backends.memory import MemoryRendezvous, open_memory_rendezvous
from aelastic.rendezvous.dynamic import DynamicRendezvousHandler, join_observer
from aelastic.rendezvous.state import Action, JoinRequest, NodeDesc, RendezvousState, encode_join_request
from aelastic.store.client import StoreClient, open_store_client
from aelastic.store.server import open_store_server

pytestmark = pytest.mark.anyio

_run_ids = itertools.count()


@dataclass
class Backend:
    name: str
    opener: Opener
    defaults: dict[str, Any]


@pytest.fixture(params=["memory", "c10d", "etcd"])
async def backend(request: pytest.FixtureRequest) -> AsyncIterator[Backend]:
    if request.param == "etcd":
        # etcd judges liveness by leases of whole seconds, and the server expires them on its own clock: a 2 s
        # grace (0.5 s × 4), so that a busy machine that delays a renewal by a second does not evict a live node
        # (a 1 s lease, etcd's shortest, expired under four heavy jobs on two CPUs).
        etcd = request.getfixturevalue("etcd_endpoint")
        timing = {"keep_alive_interval": 0.5, "keep_alive_max_attempt": 4}
        yield Backend("etcd", open_rendezvous, {"backend": "etcd", "endpoint": etcd, **timing})
        return
    async with AsyncExitStack() as stack:
        server = await stack.enter_async_context(open_store_server("127.0.0.1", 0))
        if request.param == "memory":
            shared = MemoryRendezvous()
            store = await stack.enter_async_context(open_store_client("127.0.0.1", server.port))

            @asynccontextmanager
            async def memory(params: RendezvousParameters) -> AsyncIterator[RendezvousHandler]:
                async with open_memory_rendezvous(shared, params, store) as handler:
                    yield handler

            yield Backend("memory", memory, {})
        else:
            yield Backend(
                "c10d", open_rendezvous, {"backend": "c10d", "endpoint": f"127.0.0.1:{server.port}", "is_host": False}
            )


@asynccontextmanager
async def cluster(backend: Backend) -> AsyncIterator[Cluster]:
    async with open_cluster(backend.opener, f"run{next(_run_ids)}", **backend.defaults) as c:
        yield c


async def wait_done(*nodes: Node, within: float = 10.0) -> None:
    with anyio.fail_after(within):
        for node in nodes:
            await node.done.wait()


def assert_consistent(*nodes: Node) -> None:
    infos = [n.info for n in nodes]
    assert all(i is not None for i in infos)
    ranks = sorted(i.rank for i in infos if i is not None)
    assert ranks == list(range(len(nodes)))
    assert {i.world_size for i in infos if i is not None} == {len(nodes)}
    assert len({i.round for i in infos if i is not None}) == 1
    assert len({i.bootstrap_store_info for i in infos if i is not None}) == 1


async def test_barrier_blocks_until_min(backend: Backend) -> None:
    async with cluster(backend) as c:
        a = await c.start(2, 3, last_call_timeout=0.2)
        with anyio.move_on_after(0.5):
            await a.done.wait()
        assert not a.done.is_set(), "one node of min 2 must not complete"
        b = await c.start(2, 3, last_call_timeout=0.2)
        await wait_done(a, b)
        assert_consistent(a, b)


async def test_completes_at_once_at_max(backend: Backend) -> None:
    async with cluster(backend) as c:
        nodes = [await c.start(2, 3, last_call_timeout=60) for _ in range(3)]
        await wait_done(*nodes, within=10)  # far below the 60 s last call
        assert_consistent(*nodes)


async def test_completes_after_last_call_below_max(backend: Backend) -> None:
    async with cluster(backend) as c:
        started = anyio.current_time()
        a = await c.start(2, 4, last_call_timeout=0.6)
        b = await c.start(2, 4, last_call_timeout=0.6)
        await wait_done(a, b)
        assert_consistent(a, b)
        assert min(a.completed_at, b.completed_at) - started >= 0.5


async def test_join_timeout_when_min_never_reached(backend: Backend) -> None:
    async with cluster(backend) as c:
        a = await c.start(2, 2, join_timeout=0.5)
        await wait_done(a)
        assert isinstance(a.error, RendezvousTimeoutError)
        assert "join_timeout=0.5s" in str(a.error)
        assert "1 node(s) joined, min_nodes=2" in str(a.error)


async def test_late_node_waits_and_joins_next_round(backend: Backend) -> None:
    async with cluster(backend) as c:
        a = await c.start(2, 3, last_call_timeout=0.2)
        b = await c.start(2, 3, last_call_timeout=0.2)
        await wait_done(a, b)
        first_round = a.info.round if a.info else -1
        late = await c.start(2, 3, last_call_timeout=0.2)
        # Every member sees the waiting node within one heartbeat (push, not poll).
        with anyio.fail_after(c.keep_alive_interval * 10):
            for member in (a, b):
                assert "waiting" in await member.h.wait_for_membership_change()
                assert await member.h.num_nodes_waiting() == 1
        with anyio.move_on_after(0.3):
            await late.done.wait()
        assert not late.done.is_set(), "a late node must not form a second group"
        a.rejoin()
        b.rejoin()
        await wait_done(a, b, late)
        assert_consistent(a, b, late)
        assert late.info is not None
        assert late.info.round > first_round


def _workers_store(info: RendezvousInfo | None) -> AbstractAsyncContextManager[StoreClient]:
    assert info is not None
    bootstrap = info.bootstrap_store_info
    return open_store_client(bootstrap.master_addr, bootstrap.master_port)


async def test_workers_store_is_served_by_rank_0_fresh_each_round(backend: Backend) -> None:
    """Every member is told rank 0's endpoint by the round's state; rank 0 serves an empty store there, and the
    next round's store is another one (the last round's no longer answers), also when rank 0 stays rank 0."""
    async with cluster(backend) as c:
        a, b = [await c.start(2, 2) for _ in range(2)]
        await wait_done(a, b)
        assert_consistent(a, b)
        first = a.info
        assert first is not None
        # Told by the state that completed the round: no member waited for rank 0 to publish an address.
        assert not await first.store.check(["MASTER_ADDR"])
        with anyio.fail_after(10):
            async with _workers_store(first) as store:
                assert await store.num_keys() == 0
                await store.set("gloo/addr", b"left by round 1")
        a.rejoin()
        b.rejoin()
        await wait_done(a, b)
        assert_consistent(a, b)
        assert a.info is not None
        assert a.info.round > first.round
        assert a.info.bootstrap_store_info != first.bootstrap_store_info
        with anyio.fail_after(10):
            async with _workers_store(a.info) as store:
                assert await store.num_keys() == 0
        with anyio.fail_after(10), pytest.raises(StoreConnectionError):
            async with _workers_store(first):
                pass


async def test_survivors_keep_rank_order(backend: Backend) -> None:
    async with cluster(backend) as c:
        nodes = [await c.start(3, 3) for _ in range(3)]
        await wait_done(*nodes)
        by_rank = sorted(nodes, key=lambda n: n.info.rank if n.info else -1)
        by_rank[1].kill()
        survivors = [by_rank[0], by_rank[2]]
        newcomer = await c.start(3, 3)
        for node in survivors:
            node.rejoin()
        await wait_done(*survivors, newcomer, within=15)
        assert [n.info.rank for n in survivors if n.info] == [0, 1]
        assert newcomer.info is not None
        assert newcomer.info.rank == 2


async def test_node_dying_before_completion_is_dropped(backend: Backend) -> None:
    async with cluster(backend) as c:
        last_call = c.grace + 2.0  # the dead node is found (after the grace) before the last call ends
        a = await c.start(2, 4, last_call_timeout=last_call)
        b = await c.start(2, 4, last_call_timeout=last_call)
        doomed = await c.start(2, 4, last_call_timeout=last_call)
        doomed.kill()
        await wait_done(a, b)
        assert_consistent(a, b)


async def test_a_beat_due_while_a_node_waits_for_its_round_lets_the_wait_end_first(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A beat would preempt the wait (on c10d: CANCEL_WAIT, the beat, WAIT again); at 10,000 nodes the beats that
    fall due as the round completes starve the write that completes it. Such a beat lets the wait end first, for
    at most half an interval (here 1.5 s: the second node may join up to 1.3 s late on a busy machine). Fails
    without that: the beat goes out at once, into the wait."""
    conf = {**backend.defaults, "keep_alive_interval": 3.0, "keep_alive_max_attempt": 20}  # a beat may wait 1.5 s
    name, endpoint = conf.pop("backend", "c10d"), conf.pop("endpoint", "")
    params = RendezvousParameters(name, endpoint, f"run{next(_run_ids)}", 2, 2, **conf)
    beats: list[tuple[float, bool]] = []  # when node a beat, and whether its wait for the round was in flight
    waiting = False
    joined_and_waiting, beat_again = anyio.Event(), anyio.Event()
    with anyio.fail_after(30):
        async with backend.opener(params) as a, anyio.create_task_group() as tg:
            assert isinstance(a, DynamicRendezvousHandler)
            keep_alive, wait_for_change = a.backend.keep_alive, a.backend.wait_for_change

            async def beat(node_key: str) -> None:
                beats.append((anyio.current_time(), waiting))
                if len(beats) == 2:
                    beat_again.set()
                await keep_alive(node_key)

            async def wait(seen: Any) -> None:
                nonlocal waiting
                waiting = True
                if beats:
                    joined_and_waiting.set()
                try:
                    await wait_for_change(seen)
                finally:
                    waiting = False

            monkeypatch.setattr(a.backend, "keep_alive", beat)
            monkeypatch.setattr(a.backend, "wait_for_change", wait)
            tg.start_soon(a.next_rendezvous)
            await joined_and_waiting.wait()  # a beat as it joined, and now a wait for a second node
            await anyio.sleep_until(beats[0][0] + 3.2)  # a's next beat fell due 0.2 s ago, inside its wait
            async with backend.opener(params) as b:
                await b.next_rendezvous()
                await beat_again.wait()
    assert not beats[1][1], beats
    assert beats[1][0] - beats[0][0] >= 3.2, beats  # it fell due inside the wait (else the test did not test)


async def test_member_death_after_completion_is_detected(backend: Backend) -> None:
    async with cluster(backend) as c:
        a = await c.start(2, 2)
        b = await c.start(2, 2)
        await wait_done(a, b)
        b.kill()
        killed_at = anyio.current_time()
        bound = c.grace + 1.0
        with anyio.fail_after(bound + c.keep_alive_interval):
            reason = await a.h.wait_for_membership_change()
        assert "round" in reason
        assert anyio.current_time() - killed_at <= bound + c.keep_alive_interval


async def test_member_that_finished_may_leave(backend: Backend) -> None:
    """A member found dead after it finished (the agent's exit barrier says so) is no reason to redo the round;
    a node waiting to join still is."""
    async with cluster(backend) as c:
        a = await c.start(2, 2)
        b = await c.start(2, 2)
        await wait_done(a, b)
        assert b.info is not None
        gone_rank = b.info.rank
        asked: list[frozenset[int]] = []
        was_asked = anyio.Event()

        async def finished(ranks: frozenset[int]) -> bool:
            asked.append(ranks)
            was_asked.set()
            return ranks == {gone_rank}

        reason = ""
        with anyio.fail_after(c.grace + 15):
            async with anyio.create_task_group() as tg:

                async def watch() -> None:
                    nonlocal reason
                    reason = await a.h.wait_for_membership_change(finished)

                tg.start_soon(watch)
                b.kill()
                await was_asked.wait()
                await c.start(2, 2)  # late: it waits for the next round
        assert "waiting" in reason, reason  # not "lost": b's leaving was excused
        assert asked == [frozenset({gone_rank})]


async def test_close_reaches_members_and_later_joiners(backend: Backend) -> None:
    async with cluster(backend) as c:
        a = await c.start(2, 2)
        b = await c.start(2, 2)
        await wait_done(a, b)
        await a.h.set_closed()
        with anyio.fail_after(5):
            assert "closed" in await b.h.wait_for_membership_change()
        assert await b.h.is_closed()
        late = await c.start(2, 2)
        await wait_done(late)
        assert isinstance(late.error, RendezvousClosedError)


async def test_reserve_nodes_exit_gracefully_on_close(backend: Backend) -> None:
    async with cluster(backend) as c:
        a = await c.start(1, 2)
        b = await c.start(1, 2)
        await wait_done(a, b)
        spare = await c.start(1, 2)
        with anyio.move_on_after(0.3):
            await spare.done.wait()
        assert not spare.done.is_set()
        assert await a.h.num_nodes_waiting() == 0  # torch counts the wait list only, not the reserve
        await a.h.set_closed()
        await wait_done(spare)
        assert isinstance(spare.error, RendezvousGracefulExitError)


async def test_a_completing_join_counts_even_if_its_node_hangs(backend: Backend) -> None:
    """The node whose join request completes the round writes it, which wakes everyone. One that hangs first (a
    'ghost' that appends a request and then only keeps alive, so liveness does not remove it) delays the others
    only until their wait ends with no news (the liveness grace): the request they then read completes the round."""
    waiting: set[NodeDesc] = set()
    both_wait = anyio.Event()
    waits_began: dict[NodeDesc, list[float]] = {}  # when each node decided to wait (its wait begins right after)

    def observe(node: NodeDesc, state: RendezvousState, *rest: object) -> None:
        if rest[-1] is Action.WAIT and node in state.participants:  # rest: settings, timers, now, action
            now = rest[-2]
            assert isinstance(now, float)
            waits_began.setdefault(node, []).append(now)
            waiting.add(node)
            if len(waiting) == 2:
                both_wait.set()

    async with cluster(backend) as c:
        token = join_observer.set(observe)  # the nodes' tasks inherit it
        try:
            a = await c.start(3, 3)
            b = await c.start(3, 3)
        finally:
            join_observer.reset(token)
        with anyio.fail_after(10):
            await both_wait.wait()
        handler = a.h
        assert isinstance(handler, DynamicRendezvousHandler)
        ghost = NodeDesc("ghost", 1, 0)

        async def keep_ghost_alive() -> None:
            while True:
                await handler.backend.keep_alive(ghost.key)
                await anyio.sleep(c.keep_alive_interval)

        async with anyio.create_task_group() as tg:
            tg.start_soon(keep_ghost_alive)
            appended_at = anyio.current_time()
            await handler.backend.request_join(encode_join_request(JoinRequest(ghost, 3)))
            await wait_done(a, b, within=c.grace + 10)
            tg.cancel_scope.cancel()
        infos = [n.info for n in (a, b)]
        assert {i.world_size for i in infos if i is not None} == {3}
        assert len({i.rank for i in infos if i is not None}) == 2
        # Each completed after a whole wait without news: measured from when the wait that the request found began
    # (on a busy machine it may have begun well before the request was appended), not from the append.
    for node in (a, b):
        assert isinstance(node.h, DynamicRendezvousHandler)
        began = max(t for t in waits_began[node.h.node] if t <= appended_at)
        assert node.completed_at - began >= c.grace * 0.9, (node.completed_at, began, appended_at)
