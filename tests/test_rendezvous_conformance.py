"""One conformance suite for every rendezvous backend, on asyncio and trio, with real timing.

Each test states one of the seed's guarantees (barrier, join timeout, exclusivity, consistency, fault tolerance,
closing, reserve) and checks it against nodes running as tasks. The checks themselves are the conformance kit
(:mod:`aelastic.rendezvous.testing`), which a third-party backend runs the same way; the tests below the kit's
look inside the dynamic handler. ``test_rendezvous_processes.py`` repeats the fault cases with nodes as separate
OS processes.
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import anyio
import pytest

from aelastic.rendezvous import testing
from aelastic.rendezvous.api import JoinObserver, RendezvousHandler, RendezvousParameters
from aelastic.rendezvous.backends.memory import MemoryRendezvous, open_memory_rendezvous
from aelastic.rendezvous.codec import encode_join_request
from aelastic.rendezvous.dynamic import DynamicRendezvousHandler
from aelastic.rendezvous.joins import JoinRequest
from aelastic.rendezvous.registry import open_rendezvous
from aelastic.rendezvous.state import Action
from aelastic.rendezvous.testing import BackendUnderTest, Cluster, open_cluster, wait_done
from aelastic.rendezvous.values import NodeDesc, RendezvousState
from aelastic.store.client import open_store_client
from aelastic.store.server import open_store_server

pytestmark = pytest.mark.anyio

_run_ids = itertools.count()


@pytest.fixture(params=["memory", "c10d", "etcd"])
async def backend(request: pytest.FixtureRequest) -> AsyncIterator[BackendUnderTest]:
    if request.param == "etcd":
        # etcd judges liveness by leases of whole seconds, and the server expires them on its own clock: a 2 s
        # grace (0.5 s × 4), so that a busy machine that delays a renewal by a second does not evict a live node
        # (a 1 s lease, etcd's shortest, expired under four heavy jobs on two CPUs).
        etcd = request.getfixturevalue("etcd_endpoint")
        timing = {"keep_alive_interval": 0.5, "keep_alive_max_attempt": 4}
        yield BackendUnderTest("etcd", open_rendezvous, {"backend": "etcd", "endpoint": etcd, **timing})
        return
    async with AsyncExitStack() as stack:
        server = await stack.enter_async_context(open_store_server("127.0.0.1", 0))
        if request.param == "memory":
            shared = MemoryRendezvous()
            store = await stack.enter_async_context(open_store_client("127.0.0.1", server.port))

            @asynccontextmanager
            async def memory(
                params: RendezvousParameters, *, observer: JoinObserver | None = None
            ) -> AsyncIterator[RendezvousHandler]:
                async with open_memory_rendezvous(shared, params, store, observer=observer) as handler:
                    yield handler

            yield BackendUnderTest("memory", memory, {})
        else:
            yield BackendUnderTest(
                "c10d", open_rendezvous, {"backend": "c10d", "endpoint": f"127.0.0.1:{server.port}", "is_host": False}
            )


@asynccontextmanager
async def cluster(backend: BackendUnderTest, *, observer: JoinObserver | None = None) -> AsyncIterator[Cluster]:
    async with open_cluster(backend.opener, f"run{next(_run_ids)}", observer=observer, **backend.defaults) as c:
        yield c


def test_the_kit_lists_every_check_and_this_suite_runs_each() -> None:
    names = {check.__name__.removeprefix("check_") for check in testing.CHECKS}
    assert names == {n.removeprefix("check_") for n in testing.__all__ if n.startswith("check_")}
    assert {f"test_{n}" for n in names} <= set(globals())


async def test_barrier_blocks_until_min(backend: BackendUnderTest) -> None:
    await testing.check_barrier_blocks_until_min(backend)


async def test_completes_at_once_at_max(backend: BackendUnderTest) -> None:
    await testing.check_completes_at_once_at_max(backend)


async def test_completes_after_last_call_below_max(backend: BackendUnderTest) -> None:
    await testing.check_completes_after_last_call_below_max(backend)


async def test_join_timeout_when_min_never_reached(backend: BackendUnderTest) -> None:
    await testing.check_join_timeout_when_min_never_reached(backend)


async def test_late_node_waits_and_joins_next_round(backend: BackendUnderTest) -> None:
    await testing.check_late_node_waits_and_joins_next_round(backend)


async def test_workers_store_is_served_by_rank_0_fresh_each_round(backend: BackendUnderTest) -> None:
    await testing.check_workers_store_is_served_by_rank_0_fresh_each_round(backend)


async def test_survivors_keep_rank_order(backend: BackendUnderTest) -> None:
    await testing.check_survivors_keep_rank_order(backend)


async def test_node_dying_before_completion_is_dropped(backend: BackendUnderTest) -> None:
    await testing.check_node_dying_before_completion_is_dropped(backend)


async def test_regroups_after_a_loss_without_the_last_call(backend: BackendUnderTest) -> None:
    await testing.check_regroups_after_a_loss_without_the_last_call(backend)


async def test_member_that_leaves_for_good_is_regrouped_without(backend: BackendUnderTest) -> None:
    await testing.check_member_that_leaves_for_good_is_regrouped_without(backend)


async def test_fast_quorum_false_keeps_the_last_call(backend: BackendUnderTest) -> None:
    await testing.check_fast_quorum_false_keeps_the_last_call(backend)


async def test_a_beat_due_while_a_node_waits_for_its_round_lets_the_wait_end_first(
    backend: BackendUnderTest, monkeypatch: pytest.MonkeyPatch
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


async def test_member_death_after_completion_is_detected(backend: BackendUnderTest) -> None:
    await testing.check_member_death_after_completion_is_detected(backend)


async def test_member_that_finished_may_leave(backend: BackendUnderTest) -> None:
    await testing.check_member_that_finished_may_leave(backend)


async def test_close_reaches_members_and_later_joiners(backend: BackendUnderTest) -> None:
    await testing.check_close_reaches_members_and_later_joiners(backend)


async def test_reserve_nodes_exit_gracefully_on_close(backend: BackendUnderTest) -> None:
    await testing.check_reserve_nodes_exit_gracefully_on_close(backend)


async def test_a_completing_join_counts_even_if_its_node_hangs(backend: BackendUnderTest) -> None:
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

    async with cluster(backend, observer=observe) as c:
        a = await c.start(3, 3)
        b = await c.start(3, 3)
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
