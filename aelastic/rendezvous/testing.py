"""The rendezvous conformance kit: the guarantees every backend keeps, as checks a backend's author runs.

A check is an async function of a :class:`BackendUnderTest` (an opener, ``opener(params, observer=...)``, and the
``--rdzv-conf`` keys its nodes need, ``backend`` and ``endpoint`` among them) that runs nodes as tasks of the
calling event loop (asyncio or trio) against that backend, with real timing, and raises :class:`AssertionError`
when a guarantee does not hold: barrier, join timeout, exclusivity, consistency, fault tolerance, closing,
reserve, leaving for good. :data:`CHECKS` lists them all. aelastic runs them against each of its backends
(``tests/test_rendezvous_conformance.py``); a third-party backend runs them the same way, e.g. with pytest and
anyio's plugin::

    from aelastic.rendezvous import testing

    @pytest.mark.anyio
    @pytest.mark.parametrize("check", testing.CHECKS, ids=lambda check: check.__name__)
    async def test_my_backend(check):
        await check(testing.BackendUnderTest("mine", open_rendezvous, {"backend": "mine", "endpoint": ...}))

Each check uses a run id of its own, so checks may share one backend. A node is killed as a process would be: its
cancel scope is cancelled, so its heartbeats stop and it writes nothing more. The liveness settings default to
fast ones (:data:`FAST`); a backend whose liveness is coarser (etcd's leases are whole seconds) gives its own in
``defaults``.
"""

from __future__ import annotations

import itertools
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Final

import anyio
import anyio.abc

from ..errors import (
    RendezvousClosedError,
    RendezvousError,
    RendezvousGracefulExitError,
    RendezvousTimeoutError,
    StoreConnectionError,
)
from ..store.client import StoreClient, open_store_client
from .api import JoinObserver, RendezvousHandler, RendezvousInfo, RendezvousParameters
from .registry import OpenHandler

__all__ = [  # noqa: RUF022  (plain sorted order: tests/test_public_surface.py pins it for every public module)
    "BackendUnderTest",
    "CHECKS",
    "Cluster",
    "FAST",
    "Node",
    "assert_consistent",
    "check_barrier_blocks_until_min",
    "check_close_reaches_members_and_later_joiners",
    "check_completes_after_last_call_below_max",
    "check_completes_at_once_at_max",
    "check_fast_quorum_false_keeps_the_last_call",
    "check_join_timeout_when_min_never_reached",
    "check_late_node_waits_and_joins_next_round",
    "check_member_death_after_completion_is_detected",
    "check_member_that_finished_may_leave",
    "check_member_that_leaves_for_good_is_regrouped_without",
    "check_node_dying_before_completion_is_dropped",
    "check_regroups_after_a_loss_without_the_last_call",
    "check_reserve_nodes_exit_gracefully_on_close",
    "check_survivors_keep_rank_order",
    "check_workers_store_is_served_by_rank_0_fresh_each_round",
    "open_cluster",
    "wait_done",
]

FAST: Final[Mapping[str, Any]] = {"keep_alive_interval": 0.1, "keep_alive_max_attempt": 3, "heartbeat_timeout": 5}
"""The liveness settings the checks run with unless the backend's ``defaults`` say otherwise."""

_RUN: Final = secrets.token_hex(3)  # run ids differ between processes that share a backend
_runs = itertools.count()


@dataclass(frozen=True)
class BackendUnderTest:
    """A backend as the checks open it: ``opener(params, observer=...)`` (:func:`open_rendezvous` for a registered
    backend) and ``defaults``, the ``--rdzv-conf`` keys of every node, with ``backend`` and ``endpoint``."""

    name: str
    opener: OpenHandler
    defaults: Mapping[str, Any] = field(default_factory=dict)


@dataclass
class Node:
    """One node of a :class:`Cluster`: a task that runs ``next_rendezvous`` each time it is asked to."""

    name: str
    scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)
    handler: RendezvousHandler | None = None
    info: RendezvousInfo | None = None
    error: RendezvousError | None = None
    done: anyio.Event = field(default_factory=anyio.Event)
    again: anyio.Event = field(default_factory=anyio.Event)
    rounds: list[RendezvousInfo] = field(default_factory=list)
    completed_at: float = 0.0

    def kill(self) -> None:
        """Stop the node as a killed process stops: no more heartbeats, no more writes."""
        self.scope.cancel()

    def rejoin(self) -> None:
        """Ask the node to run next_rendezvous again (as an agent does after a membership change)."""
        self.done = anyio.Event()
        self.again.set()

    @property
    def h(self) -> RendezvousHandler:
        if self.handler is None:
            raise AssertionError(f"node {self.name} has no handler (it was not started)")
        return self.handler


class Cluster:
    """Nodes of one run id, each a task of the cluster's task group (:func:`open_cluster`)."""

    def __init__(
        self,
        tg: anyio.abc.TaskGroup,
        opener: OpenHandler,
        run_id: str,
        observer: JoinObserver | None = None,
        **defaults: Any,
    ) -> None:
        self._tg = tg
        self._opener = opener
        self._run_id = run_id
        self._observer = observer
        self._defaults = {**FAST, **defaults}  # a backend may need slower liveness (etcd: whole-second leases)
        self.nodes: list[Node] = []

    def __repr__(self) -> str:
        return f"<Cluster run={self._run_id!r} nodes={len(self.nodes)}>"

    @property
    def keep_alive_interval(self) -> float:
        return float(self._defaults["keep_alive_interval"])

    @property
    def grace(self) -> float:
        """How long a silent node stays a member: keep_alive_interval × keep_alive_max_attempt."""
        return self.keep_alive_interval * int(self._defaults["keep_alive_max_attempt"])

    async def start(self, min_nodes: int, max_nodes: int, **conf: Any) -> Node:
        """Open a node's handler (``conf`` over the defaults) and start its first ``next_rendezvous``."""
        node = Node(f"n{len(self.nodes)}")
        self.nodes.append(node)
        conf = {**self._defaults, **conf}
        backend, endpoint = conf.pop("backend", "c10d"), conf.pop("endpoint", "")
        params = RendezvousParameters(backend, endpoint, self._run_id, min_nodes, max_nodes, **conf)
        await self._tg.start(self._run, node, params)
        return node

    async def _run(self, node: Node, params: RendezvousParameters, *, task_status: anyio.abc.TaskStatus[None]) -> None:
        with node.scope:
            async with self._opener(params, observer=self._observer) as handler:
                node.handler = handler
                task_status.started()
                while True:
                    try:
                        node.info = await handler.next_rendezvous()
                        node.rounds.append(node.info)
                        node.completed_at = anyio.current_time()
                    except RendezvousError as exc:
                        node.error = exc
                        node.done.set()
                        return
                    node.done.set()
                    await node.again.wait()
                    node.again = anyio.Event()


@asynccontextmanager
async def open_cluster(
    opener: OpenHandler, run_id: str, *, observer: JoinObserver | None = None, **defaults: Any
) -> AsyncIterator[Cluster]:
    """A cluster of nodes of ``run_id`` opened by ``opener`` with ``defaults`` (and ``observer``); leaving the
    context kills every node still running."""
    async with anyio.create_task_group() as tg:
        yield Cluster(tg, opener, run_id, observer, **defaults)
        tg.cancel_scope.cancel()


@asynccontextmanager
async def _cluster(backend: BackendUnderTest) -> AsyncIterator[Cluster]:
    async with open_cluster(backend.opener, f"conformance-{_RUN}-{next(_runs)}", **backend.defaults) as c:
        yield c


async def wait_done(*nodes: Node, within: float = 10.0) -> None:
    """Wait until each node's current ``next_rendezvous`` ended (``TimeoutError`` after ``within`` seconds)."""
    with anyio.fail_after(within):
        for node in nodes:
            await node.done.wait()


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)


def _info(node: Node) -> RendezvousInfo:
    if node.info is None:
        raise AssertionError(f"node {node.name} completed no round (error: {node.error!r})")
    return node.info


def assert_consistent(*nodes: Node) -> None:
    """The nodes completed the same round: ranks 0..n-1, one world size n, one bootstrap store."""
    infos = [_info(n) for n in nodes]
    ranks = sorted(i.rank for i in infos)
    _check(ranks == list(range(len(nodes))), f"ranks {ranks}: not 0..{len(nodes) - 1}")
    _check({i.world_size for i in infos} == {len(nodes)}, f"world sizes {[i.world_size for i in infos]}")
    _check(len({i.round for i in infos}) == 1, f"rounds {[i.round for i in infos]}: not one")
    _check(len({i.bootstrap_store_info for i in infos}) == 1, "the nodes were told different bootstrap stores")


async def check_barrier_blocks_until_min(backend: BackendUnderTest) -> None:
    """One node of min 2 waits; the second completes the round."""
    async with _cluster(backend) as c:
        a = await c.start(2, 3, last_call_timeout=0.2)
        with anyio.move_on_after(0.5):
            await a.done.wait()
        _check(not a.done.is_set(), "one node of min 2 must not complete")
        b = await c.start(2, 3, last_call_timeout=0.2)
        await wait_done(a, b)
        assert_consistent(a, b)


async def check_completes_at_once_at_max(backend: BackendUnderTest) -> None:
    """``max_nodes`` nodes complete the round without waiting for the last call."""
    async with _cluster(backend) as c:
        nodes = [await c.start(2, 3, last_call_timeout=60) for _ in range(3)]
        await wait_done(*nodes, within=10)  # far below the 60 s last call
        assert_consistent(*nodes)


async def check_completes_after_last_call_below_max(backend: BackendUnderTest) -> None:
    """``min_nodes <= n < max_nodes`` nodes complete the round when the last call ends, not before."""
    async with _cluster(backend) as c:
        started = anyio.current_time()
        a = await c.start(2, 4, last_call_timeout=0.6)
        b = await c.start(2, 4, last_call_timeout=0.6)
        await wait_done(a, b)
        assert_consistent(a, b)
        _check(min(a.completed_at, b.completed_at) - started >= 0.5, "completed before the last call ended")


async def check_join_timeout_when_min_never_reached(backend: BackendUnderTest) -> None:
    """A round that never reaches ``min_nodes`` fails with RendezvousTimeoutError naming the timeout and count."""
    async with _cluster(backend) as c:
        a = await c.start(2, 2, join_timeout=0.5)
        await wait_done(a)
        _check(isinstance(a.error, RendezvousTimeoutError), f"expected RendezvousTimeoutError, got {a.error!r}")
        _check("join_timeout=0.5s" in str(a.error), str(a.error))
        _check("1 node(s) joined, min_nodes=2" in str(a.error), str(a.error))


async def check_late_node_waits_and_joins_next_round(backend: BackendUnderTest) -> None:
    """A node late for a complete round waits (the members hear of it at once) and joins the next round."""
    async with _cluster(backend) as c:
        a = await c.start(2, 3, last_call_timeout=0.2)
        b = await c.start(2, 3, last_call_timeout=0.2)
        await wait_done(a, b)
        first_round = _info(a).round
        late = await c.start(2, 3, last_call_timeout=0.2)
        # Every member sees the waiting node within one heartbeat (push, not poll).
        with anyio.fail_after(c.keep_alive_interval * 10):
            for member in (a, b):
                reason = await member.h.wait_for_membership_change()
                _check("waiting" in reason, reason)
                _check(await member.h.num_nodes_waiting() == 1, "num_nodes_waiting is not 1")
        with anyio.move_on_after(0.3):
            await late.done.wait()
        _check(not late.done.is_set(), "a late node must not form a second group")
        a.rejoin()
        b.rejoin()
        await wait_done(a, b, late)
        assert_consistent(a, b, late)
        _check(_info(late).round > first_round, "the late node did not join a later round")


async def check_workers_store_is_served_by_rank_0_fresh_each_round(backend: BackendUnderTest) -> None:
    """Every member is told rank 0's endpoint by the round's state; rank 0 serves an empty store there, and the
    next round's store is another one (the last round's no longer answers), also when rank 0 stays rank 0."""
    async with _cluster(backend) as c:
        a, b = [await c.start(2, 2) for _ in range(2)]
        await wait_done(a, b)
        assert_consistent(a, b)
        first = _info(a)
        # Told by the state that completed the round: no member waited for rank 0 to publish an address.
        _check(not await first.store.check(["MASTER_ADDR"]), "rank 0 published MASTER_ADDR in the round's store")
        with anyio.fail_after(10):
            async with _workers_store(first) as store:
                _check(await store.num_keys() == 0, "the workers' store of a new round is not empty")
                await store.set("gloo/addr", b"left by round 1")
        a.rejoin()
        b.rejoin()
        await wait_done(a, b)
        assert_consistent(a, b)
        second = _info(a)
        _check(second.round > first.round, "the second round has no higher number")
        _check(second.bootstrap_store_info != first.bootstrap_store_info, "the workers' store was reused")
        with anyio.fail_after(10):
            async with _workers_store(second) as store:
                _check(await store.num_keys() == 0, "the workers' store of the next round is not empty")
        with anyio.fail_after(10):
            try:
                async with _workers_store(first):
                    pass
            except StoreConnectionError:
                pass
            else:
                raise AssertionError("the last round's workers' store still answers")


def _workers_store(info: RendezvousInfo) -> AbstractAsyncContextManager[StoreClient]:
    bootstrap = info.bootstrap_store_info
    return open_store_client(bootstrap.master_addr, bootstrap.master_port)


async def check_survivors_keep_rank_order(backend: BackendUnderTest) -> None:
    """After a member dies, the survivors keep their relative order (rank 0 stays 0); a newcomer follows."""
    async with _cluster(backend) as c:
        nodes = [await c.start(3, 3) for _ in range(3)]
        await wait_done(*nodes)
        by_rank = sorted(nodes, key=lambda n: _info(n).rank)
        by_rank[1].kill()
        survivors = [by_rank[0], by_rank[2]]
        newcomer = await c.start(3, 3)
        for node in survivors:
            node.rejoin()
        await wait_done(*survivors, newcomer, within=15)
        _check([_info(n).rank for n in survivors] == [0, 1], "the survivors did not keep their order")
        _check(_info(newcomer).rank == 2, "the newcomer is not last")


async def check_node_dying_before_completion_is_dropped(backend: BackendUnderTest) -> None:
    """A node that dies while the round gathers is dropped; the others complete without it."""
    async with _cluster(backend) as c:
        last_call = c.grace + 2.0  # the dead node is found (after the grace) before the last call ends
        a = await c.start(2, 4, last_call_timeout=last_call)
        b = await c.start(2, 4, last_call_timeout=last_call)
        doomed = await c.start(2, 4, last_call_timeout=last_call)
        doomed.kill()
        await wait_done(a, b)
        assert_consistent(a, b)


async def check_member_death_after_completion_is_detected(backend: BackendUnderTest) -> None:
    """A member that dies after completion is reported within the liveness grace (and one interval)."""
    async with _cluster(backend) as c:
        a = await c.start(2, 2)
        b = await c.start(2, 2)
        await wait_done(a, b)
        b.kill()
        killed_at = anyio.current_time()
        bound = c.grace + 1.0
        with anyio.fail_after(bound + c.keep_alive_interval):
            reason = await a.h.wait_for_membership_change()
        _check("round" in reason, reason)
        _check(anyio.current_time() - killed_at <= bound + c.keep_alive_interval, "detected too late")


async def check_member_that_finished_may_leave(backend: BackendUnderTest) -> None:
    """A member found dead after it finished (the agent's exit barrier says so) is no reason to redo the round;
    a node waiting to join still is."""
    async with _cluster(backend) as c:
        a = await c.start(2, 2)
        b = await c.start(2, 2)
        await wait_done(a, b)
        gone_rank = _info(b).rank
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
        _check("waiting" in reason, reason)  # not "lost": b's leaving was excused
        _check(asked == [frozenset({gone_rank})], f"asked about {asked}")


async def check_close_reaches_members_and_later_joiners(backend: BackendUnderTest) -> None:
    """Closing reaches every member, and a node that joins later fails with RendezvousClosedError."""
    async with _cluster(backend) as c:
        a = await c.start(2, 2)
        b = await c.start(2, 2)
        await wait_done(a, b)
        await a.h.set_closed()
        with anyio.fail_after(5):
            reason = await b.h.wait_for_membership_change()
            _check("closed" in reason, reason)
        _check(await b.h.is_closed(), "a member does not see the rendezvous closed")
        late = await c.start(2, 2)
        await wait_done(late)
        _check(isinstance(late.error, RendezvousClosedError), f"expected RendezvousClosedError, got {late.error!r}")


async def check_reserve_nodes_exit_gracefully_on_close(backend: BackendUnderTest) -> None:
    """A node in reserve (beyond max_nodes) waits uncounted, and exits with RendezvousGracefulExitError on close."""
    async with _cluster(backend) as c:
        a = await c.start(1, 2)
        b = await c.start(1, 2)
        await wait_done(a, b)
        spare = await c.start(1, 2)
        with anyio.move_on_after(0.3):
            await spare.done.wait()
        _check(not spare.done.is_set(), "a node in reserve completed")
        # torch counts the wait list only, not the reserve
        _check(await a.h.num_nodes_waiting() == 0, "num_nodes_waiting counts the reserve")
        await a.h.set_closed()
        await wait_done(spare)
        _check(
            isinstance(spare.error, RendezvousGracefulExitError),
            f"expected RendezvousGracefulExitError, got {spare.error!r}",
        )


async def _lost_one(c: Cluster, member: Node) -> None:
    """Wait until ``member`` hears that its round lost a member (the liveness found the dead one)."""
    world = _info(member).world_size
    with anyio.fail_after(c.grace * 4 + 10):
        ranks = await member.h.wait_for_member_ranks(frozenset(range(world)))
    _check(len(ranks) < world, f"member ranks {sorted(ranks)} of {world}: none lost")


async def check_regroups_after_a_loss_without_the_last_call(backend: BackendUnderTest) -> None:
    """Fast quorum: after members die, the next round completes as soon as every survivor, and every node that
    waited for the next round, is back, with all of them, without waiting out the last call (60 s here)."""
    async with _cluster(backend) as c:
        nodes = [await c.start(2, 4, last_call_timeout=60) for _ in range(4)]
        await wait_done(*nodes)  # full: no last call
        by_rank = sorted(nodes, key=lambda n: _info(n).rank)
        survivors, doomed = by_rank[:2], by_rank[2:]
        for node in doomed:
            node.kill()
        await _lost_one(c, survivors[0])
        late = await c.start(2, 4, last_call_timeout=60)  # waits for the next round (the round is not full)
        # No event says "another node is on the wait list" while a loss is the member's reason to restart: look.
        with anyio.fail_after(c.grace * 4 + 10):
            while await survivors[0].h.num_nodes_waiting() < 1:  # noqa: ASYNC110
                await anyio.sleep(c.keep_alive_interval)
        rejoined = anyio.current_time()
        for node in survivors:
            node.rejoin()
        await wait_done(*survivors, late, within=c.grace * 4 + 20)  # the dead are found; the last call is 60 s
        assert_consistent(*survivors, late)
        _check([_info(n).rank for n in survivors] == [0, 1], "the survivors did not keep their order")
        took = max(n.completed_at for n in (*survivors, late)) - rejoined
        _check(took < 30, f"the round after the loss took {took:.1f}s: it waited for the last call")


async def check_member_that_leaves_for_good_is_regrouped_without(backend: BackendUnderTest) -> None:
    """A member that leaves for good (``leave()``, as a node the node check left out does) is off the state while it
    lives on: the others see it gone, and their next round completes without it as soon as they are back, without
    waiting out the last call (60 s here)."""
    async with _cluster(backend) as c:
        nodes = [await c.start(2, 3, last_call_timeout=60) for _ in range(3)]
        await wait_done(*nodes)  # full: no last call
        by_rank = sorted(nodes, key=lambda n: _info(n).rank)
        survivors, leaving = by_rank[:2], by_rank[2]
        await leaving.h.leave()
        with anyio.fail_after(c.grace * 4 + 10):
            ranks = await survivors[0].h.wait_for_member_ranks(frozenset(range(3)))
        _check(ranks == {0, 1}, f"member ranks {sorted(ranks)} after rank 2 left: not 0 and 1")
        rejoined = anyio.current_time()
        for node in survivors:
            node.rejoin()
        await wait_done(*survivors, within=c.grace * 4 + 20)
        assert_consistent(*survivors)
        took = max(n.completed_at for n in survivors) - rejoined
        _check(took < 30, f"the round without the node that left took {took:.1f}s: it waited for the last call")


async def check_fast_quorum_false_keeps_the_last_call(backend: BackendUnderTest) -> None:
    """``fast_quorum=false`` is torch's rule: after a loss, the survivors wait out the last call."""
    last_call = 1.5
    async with _cluster(backend) as c:
        nodes = [await c.start(2, 3, last_call_timeout=last_call, fast_quorum=False) for _ in range(3)]
        await wait_done(*nodes)
        by_rank = sorted(nodes, key=lambda n: _info(n).rank)
        survivors = by_rank[:2]
        by_rank[2].kill()
        await _lost_one(c, survivors[0])
        rejoined = anyio.current_time()
        for node in survivors:
            node.rejoin()
        await wait_done(*survivors, within=c.grace * 4 + 20)
        assert_consistent(*survivors)
        took = min(n.completed_at for n in survivors) - rejoined
        _check(took >= last_call * 0.95, f"completed {took:.2f}s after the rejoin: before the last call ended")


CHECKS: Final[tuple[Callable[[BackendUnderTest], Awaitable[None]], ...]] = (
    check_barrier_blocks_until_min,
    check_completes_at_once_at_max,
    check_completes_after_last_call_below_max,
    check_join_timeout_when_min_never_reached,
    check_late_node_waits_and_joins_next_round,
    check_workers_store_is_served_by_rank_0_fresh_each_round,
    check_survivors_keep_rank_order,
    check_node_dying_before_completion_is_dropped,
    check_regroups_after_a_loss_without_the_last_call,
    check_member_that_leaves_for_good_is_regrouped_without,
    check_fast_quorum_false_keeps_the_last_call,
    check_member_death_after_completion_is_detected,
    check_member_that_finished_may_leave,
    check_close_reaches_members_and_later_joiners,
    check_reserve_nodes_exit_gracefully_on_close,
)
"""Every check, in a stable order."""
