"""The dynamic rendezvous handler: runs the pure state machine (``state.py``) against a backend driver.

Theory of operation
-------------------
``next_rendezvous`` runs two operations, as torch does: *exit* (leave the round this node was in) and *join*.
Each operation is a loop: read the state, ask the state machine what to do, and either write (compare-and-set;
on a lost race the backend hands back the newer state and the loop decides again), finish, fail, or wait. A wait
lasts until the backend reports a change or the nearest local deadline (join timeout, last call, keep-alive)
passes; nothing polls.

Joins are not compare-and-sets: a node adds itself by appending a join request, and the state every node decides
on is the written state with the pending requests folded in (``state.fold_joins``), so a thousand nodes joining at
once make a thousand small appends, not a million failed compare-and-sets of a growing value. Appends wake no one;
when the requests change what others wait for (the round completed, reached ``min_nodes``, or gained a waiting
node), one node writes the folded state, and that write wakes them. With ``n = max`` that is one write per round.
Which node: on a backend with digests (c10d), the one whose request's ticket brings the participants to
``min_nodes`` or ``max_nodes`` (or any request into a complete round); on others (etcd), the node whose request is
the newest in its read.

Reads: a node decides on the whole state only before it writes. Where the backend keeps digests, a node that
waits reads its *view* (``state.StateView``: the summary of the newest version and its own position, O(1) bytes)
and, after its join request, counts the request in until a write folds it, so a round of N nodes costs O(N)
requests and bytes in all; without digests every read is of the whole state (O(N) bytes each).

Liveness runs as one task per node from its first join until the handler closes: each interval it beats once
(a small write of its own) and checks one neighbour: the node just before it in the state's node order (the
first checks the last), so N nodes cost O(N) small reads and writes per interval. A neighbour the backend judges
dead is removed from the state by a compare-and-set; every member learns of it through the change. The beats
also watch the backend itself: when none has reached it for ``read_timeout`` (its host died, or the network
dropped it without a reset, so that reads would hang for TCP's retransmission timeout), the handler fails with
:class:`~aelastic.errors.RendezvousConnectionError` naming where the backend lives, which cancels whatever runs
inside the handler (the agent stops its workers). A backend that hears of deaths from the network
(``departures``: the c10d host, whose store server sees a dead agent's connections close) reports them too, and
the handler evicts those nodes at once, without waiting for the keep-alive.

Clocks: every deadline is this process's monotonic clock (``anyio.current_time``); nothing compares times
written by different hosts.

Bootstrap store: every node binds a listener before it asks to join and sends its endpoint in the join request;
the state keeps the endpoints, and the state (or digest) that completes a round names rank 0's. Rank 0 then
serves a fresh, empty store on that listener in the handler's task group (stopping the one of its previous
round); workers of every node use it (``MASTER_ADDR``/``MASTER_PORT``), and no member waits for rank 0 after the
round. A fresh server per round means a restarted attempt never reads the dead attempt's keys.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from typing import Final

import anyio
import anyio.abc

from ..errors import (
    RendezvousClosedError,
    RendezvousGracefulExitError,
    RendezvousTimeoutError,
)
from ..events import record_rendezvous
from .api import (
    Finished,
    MembershipChange,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousStatistics,
    View,
)
from .backends.base import RendezvousBackend, Versioned
from .bootstrap import BootstrapStores
from .codec import (
    Digest,
    decode_view,
    encode_join_request,
    encode_state,
    make_digest,
)
from .joins import JOIN_REQUESTS, JoinRequest
from .known import Known, OwnRequest, changes_what_others_wait_for, departed
from .liveness import Liveness
from .settings import HandlerOptions
from .state import Action, apply, decide_close, decide_exit, decide_join, update_timers
from .values import NodeDesc, NodeTimers, RendezvousSettings, RendezvousState, StateView

__all__ = ["DynamicRendezvousHandler", "HandlerOptions", "open_dynamic_rendezvous", "round_prefix"]

logger = logging.getLogger(__name__)

Decide = Callable[[View, NodeTimers, float], Action]


_NO_DIGEST = Digest(b"", ())  # what a backend without digests is handed


def round_prefix(run_id: str, round: int) -> str:
    """The prefix of round ``round``'s keys in the run's store (torch's name for it)."""
    return f"torch.rendezvous.{run_id}.{round}"


def job_prefix(run_id: str) -> str:
    """The prefix of the keys the run's nodes share across rounds (:attr:`RendezvousInfo.job_store`)."""
    return f"aelastic.job.{run_id}"


class DynamicRendezvousHandler(Liveness, RendezvousHandler):
    """torch's ``DynamicRendezvousHandler`` semantics, event driven. Open it with :func:`open_dynamic_rendezvous`.

    The pure core (:mod:`.state`) decides each step; what the handler does for each of its actions is the table
    :data:`_STEPS` (and :data:`_FAILURES` for the actions that end an operation with an error).
    """

    def __init__(
        self,
        node: NodeDesc,
        settings: RendezvousSettings,
        backend: RendezvousBackend,
        task_group: anyio.abc.TaskGroup,
        options: HandlerOptions,
    ) -> None:
        self.node = node
        self.settings = settings
        self.backend = backend
        self._task_group = task_group
        self._options = options
        self._known = Known()
        self._own = OwnRequest()
        self._liveness_started = False
        self._joining: anyio.Event | None = None  # set when this node's wait for its round to complete ends
        self._bootstrap = BootstrapStores(task_group, options.bootstrap_host)
        self._round: int | None = None
        self._world = 0  # the world size of the round this node finished
        self._counted = RendezvousStatistics()  # what this handler did (stores and folds: see statistics())

    def __repr__(self) -> str:
        s = self._known.state
        return (
            f"<DynamicRendezvousHandler {self.node.id} run={self.settings.run_id!r} round={s.round} "
            f"complete={s.complete} closed={s.closed} participants={len(s.participants)} "
            f"waiting={len(s.wait_list)} reserve={len(s.redundancy_list)} version={self._known.seen.version}>"
        )

    def get_backend(self) -> str:
        return self._options.backend_name

    def get_run_id(self) -> str:
        return self.settings.run_id

    @property
    def use_agent_store(self) -> bool:
        return self._options.share_store

    @property
    def local_addr(self) -> str:
        return self._bootstrap.host

    def statistics(self) -> RendezvousStatistics:
        served = self._bootstrap.server
        servers = self._options.servers if served is None else (*self._options.servers, served)
        return dataclasses.replace(
            self._counted,
            stores=tuple(server.statistics() for server in servers),
            folds=self._known.folds.folds,
            requests_folded=self._known.folds.requests_folded,
        )

    def _count(self, **added: int) -> None:
        """Add to this handler's counters (fields of RendezvousStatistics)."""
        counted = self._counted
        self._counted = dataclasses.replace(counted, **{k: getattr(counted, k) + v for k, v in added.items()})

    @property
    def state(self) -> View:
        """The state as this node last read it: whole, or as its view from the state's digest."""
        return self._known.state

    # --- reading and writing --------------------------------------------------------------------------------

    async def _look(self, known: int = -1) -> None:
        """Read what this node decides on: its view from the newest digest (O(1) bytes) where the backend keeps
        digests, else the whole state. ``known``: a version known to exist (-1: none; the backend then starts
        from the latest version announced, which also steps over a version whose writer died before announcing
        it)."""
        read = await self.backend.read_digest(self.node.key, known) if self.backend.digests else None
        if read is None:
            await self._refresh()
            return
        self._count(digest_reads=1, digest_bytes_read=len(read.summary or b"") + len(read.shard or b""))
        # A whole read of the same version holds the pending requests too: keep it.
        have = self._known
        if read.version < have.version or (read.version == have.version and isinstance(have.state, RendezvousState)):
            return
        if read.summary is None:
            view = StateView(self.node, 0, False, False, (0, 0, 0), 0)
        else:
            view = decode_view(self.node, read.summary, read.shard)[0]
        counted = self._with_own_request(view, read.joined)
        if counted is None:
            await self._refresh()  # where a late request lands (wait list or reserve) only the fold can tell
            return
        have.version, have.joined, have.state = read.version, read.joined, counted

    def _with_own_request(self, view: StateView, joined: int) -> StateView | None:
        """``view`` (whose version consumed ``joined`` requests) with this node's pending request counted in: it
        and the requests before it are counted as participants, as fold_joins will admit them (unless one is
        dropped), so the node does not ask again and its timers run. The count does not depend on the version
        read, as long as it precedes the request: each request a later version consumed is one more participant
        and one more consumed. ``None`` when the round is complete or closed: only the fold can tell."""
        if self._own.ticket is None or joined >= self._own.ticket:
            return view
        if view.complete or view.closed:
            return None
        counted = len(view.participants) + self._own.ticket - joined
        # Whether the requests counted regroup the round (fast quorum) only the fold can tell: _triggers judges.
        return view._replace(sizes=(counted, *view.sizes[1:]), where="participants", regrouped=False)

    async def _whole(self) -> RendezvousState:
        """The whole state, for what a view cannot tell (which members left, and their ranks)."""
        if isinstance(self._known.state, StateView):
            await self._refresh()
        assert isinstance(self._known.state, RendezvousState)  # a whole read always replaces a view
        return self._known.state

    def _triggers(self, counted: StateView) -> bool:
        """Whether this node's join request is the one whose fold others wait for, judged from the view that
        counts it (``_with_own_request``): in a gathering round, the request that brings the participants to
        ``min_nodes`` (the others start their last call) or to ``max_nodes`` (the round completes). (In a
        complete round every request may land on the wait list, which members restart for: the node reads the
        whole state and ``_must_publish`` judges.) After a loss, also any request that brings the participants to
        the number of survivors or beyond: it may be the last survivor's, which regroups the round (fast quorum);
        newcomers among them only make a few more nodes read the whole state. A miscount (a request dropped) only
        delays the publication until a node's deadline or the liveness grace."""
        n = len(counted.participants)
        if self.settings.fast_quorum and counted.survivors and n >= counted.survivors:
            return True
        return n in (self.settings.min_nodes, self.settings.max_nodes)

    def _fold_to_publish(self) -> RendezvousState | None:
        """The folded state this node is to write, if its view folds join requests in and publishing it is this
        node's job: on a backend with digests, the node whose request triggers it (``_own.publish``); on others,
        the node whose own request is the newest in its read (the last node to append always is). Whether the fold
        changes what others wait for is :func:`changes_what_others_wait_for`'s answer. A query: it writes nothing.

        One node does it, not every node that sees it (a thousand nodes reading one burst of requests would
        otherwise each encode and compare-and-set the whole state). Publishing only wakes the others sooner: the
        folded view is already the state (every later write is decided on a read that includes those requests), so
        if that node dies first, the others see the same view when their wait ends (it never outlasts the liveness
        grace).
        """
        view, known = self._known.state, self._known
        if not isinstance(view, RendezvousState) or view is known.committed:
            return None
        ours = self._own.publish if self.backend.digests else known.seen.pending[-1:] == (self._own.request,)
        return view if ours else None

    async def _refresh(self, *, after_join: bool = False) -> None:
        seen = await (self.backend.read_after_join() if after_join else self.backend.get_state())
        self._count(state_reads=1, state_bytes_read=len(seen.data or b"") + sum(len(r) + 1 for r in seen.pending))
        self._known.adopt(seen)

    async def _write(self, state: RendezvousState) -> bool:
        digest = make_digest(state) if self.backend.digests else _NO_DIGEST
        seen, won = await self.backend.set_state(encode_state(state), self._known.seen, digest)
        if won:
            self._count(writes_won=1)
        else:
            self._count(writes_lost=1)
        self._known.adopt(seen)
        return won

    async def _wait_for_change(self, until: float) -> None:
        """Wait for the next state change, at most until ``until`` (monotonic); then read the state."""
        # A writer that dies between its CAS and its notification must not stall waiters forever: never wait
        # longer than the liveness grace without re-reading (a safety net; changes normally arrive pushed).
        grace = self.settings.keep_alive_interval * self.settings.keep_alive_max_attempt
        limit = min(until, anyio.current_time() + grace)
        known = self._known
        seen = known.seen if known.seen.version == known.version else Versioned(known.version, None)
        woke, pushed = False, None
        with anyio.move_on_after(max(0.0, limit - anyio.current_time())):
            pushed = await self.backend.wait_for_change(seen)
            woke = True
        self._count(wake_ups=1)
        if not woke and self._own.ticket is not None and self._known.joined < self._own.ticket:
            # No news while this node's request waits to be folded: the node that was to publish it may hang.
            # Read the whole state, which holds the request, and publish it if others wait for what it changes.
            self._own.publish = True
            await self._refresh()
        elif pushed is not None:
            self._known.adopt(pushed)  # the change brought the state with it: no read (a round's release wakes N nodes)
        else:
            await self._look(seen.version + 1 if woke else -1)

    async def _run(
        self, decide: Decide, timers: NodeTimers, node: NodeDesc | None, *, fresh: bool = False
    ) -> NodeTimers:
        """Drive one operation until the state machine says FINISH; returns the timers as they ended.

        ``node`` is the node whose join deadline the state may move (see ``update_timers``); None for close.
        ``fresh``: the state was just read (by the operation before), so start from it.
        """
        if not fresh:
            await self._look()
        observe = self._options.observer if node is not None else None
        while True:
            fold = self._fold_to_publish()
            if fold is not None:
                # The job stays this node's only while its folds change what others wait for.
                self._own.publish = changes_what_others_wait_for(self._known.committed, fold, self.settings)
                if self._own.publish:
                    await self._write(fold)
                    continue
            now = anyio.current_time()
            timers = update_timers(timers, self._known.state, self.settings, now, node=node)
            action = decide(self._known.state, timers, now)
            if observe is not None:
                observe(self.node, self._known.state, self.settings, timers, now, action)
            if action is Action.FINISH:
                return timers
            failure = _FAILURES.get(action)
            if failure is not None:
                raise failure(self)
            await _STEPS.get(action, DynamicRendezvousHandler._apply_step)(self, action, timers)

    async def _wait_step(self, action: Action, timers: NodeTimers) -> None:
        """WAIT: until the next change, or the nearest of this node's deadlines."""
        deadlines = [timers.join_deadline]
        if timers.last_call_deadline is not None:
            deadlines.append(timers.last_call_deadline)
        self._joining = joining = anyio.Event()
        try:
            await self._wait_for_change(min(deadlines))
        finally:
            self._joining = None
            joining.set()

    async def _join_step(self, action: Action, timers: NodeTimers) -> None:
        """A join request (:data:`~aelastic.rendezvous.joins.JOIN_REQUESTS`): append it, then count it in."""
        endpoint = await self._bootstrap.reserve()
        own = self._own
        own.request = encode_join_request(JoinRequest(self.node, self.settings.max_nodes, endpoint))
        own.ticket = await self.backend.request_join(own.request)
        self._count(join_requests=1)
        counted = None
        if own.ticket is not None and isinstance(self._known.state, StateView):
            # No read: the view this request was decided on counts it as well as a newer one would.
            counted = self._with_own_request(self._known.state, self._known.joined)
        if counted is None:
            own.publish = own.ticket is not None
            await self._refresh(after_join=True)
        elif self._triggers(counted):
            own.publish = True
            await self._refresh(after_join=True)
        else:
            self._known.state = counted

    async def _apply_step(self, action: Action, timers: NodeTimers) -> None:
        """Any other write action: apply it to the whole state and compare-and-set the result."""
        if isinstance(self._known.state, StateView):
            await self._refresh()  # a write is decided again on the whole state it replaces
        else:
            await self._write(apply(self._known.state, action, self.node, self.settings))

    # --- the handler API --------------------------------------------------------------------------------------

    async def next_rendezvous(self) -> RendezvousInfo:
        began = anyio.current_time()
        timers = NodeTimers(join_deadline=began + self.settings.join_timeout)
        await self._start_liveness()
        node, settings = self.node, self.settings
        record_rendezvous("join", settings.run_id, node.id, backend=self._options.backend_name, round=self._round)
        timers = await self._run(lambda s, t, now: decide_exit(s, node, settings, t, now), timers, node)
        await self._run(lambda s, t, now: decide_join(s, node, settings, t, now), timers, node, fresh=True)
        state = self._known.state
        rank = state.rank_of(node)
        if rank is None:  # the state machine finishes a join only as a member of a complete round
            raise RendezvousClosedError(f"rendezvous {settings.run_id!r}: join finished without a rank")
        round_store = self.backend.store.prefixed(round_prefix(settings.run_id, state.round))
        bootstrap = await self._bootstrap.start_round(rank, state.master, serve=self._options.share_store)
        self._round, self._world = state.round, state.world_size
        record_rendezvous(
            "round_complete", settings.run_id, node.id, backend=self._options.backend_name, round=state.round,
            rank=rank, world_size=state.world_size, duration_ms=(anyio.current_time() - began) * 1000,
            master_endpoint=f"{bootstrap.master_addr}:{bootstrap.master_port}",
        )  # fmt: skip
        logger.info(
            "rendezvous %s round %d complete: %s is rank %d of %d",
            settings.run_id, state.round, node.id, rank, state.world_size,
        )  # fmt: skip
        job_store = self.backend.store.prefixed(job_prefix(settings.run_id))
        return RendezvousInfo(round_store, rank, state.world_size, bootstrap, state.round, job_store)

    async def num_nodes_waiting(self) -> int:
        await self._look()
        return self._known.state.num_waiting

    async def wait_for_membership_change(self, finished: Finished | None = None) -> str:
        excused: set[int] = set()
        while True:
            reason = await self._restart_reason(finished, excused)
            if reason is not None:
                return reason
            await self._wait_for_change(math.inf)

    async def wait_for_member_ranks(self, known: frozenset[int]) -> frozenset[int]:
        while (ranks := await self._member_ranks()) == known:
            await self._wait_for_change(math.inf)
        return ranks

    async def _member_ranks(self) -> frozenset[int]:
        s = self._known.state
        if self._round is None or s.round != self._round or not s.complete:
            return frozenset()
        if len(s.participants) == self._world:  # no member left (members are never added): all ranks
            return frozenset(range(self._world))
        s = await self._whole()
        if s.round != self._round or not s.complete:
            return frozenset()
        return frozenset(range(len(s.rank_order))) - departed(s)

    async def _restart_reason(self, finished: Finished | None, excused: set[int]) -> str | None:
        """Why the round must be redone, if it must. Ranks in ``excused`` left after ``finished`` said they had."""
        s = self._known.state
        if s.closed:
            return "the rendezvous was closed"
        if self._round is None:
            return None
        if s.round != self._round:
            return MembershipChange(f"round {self._round} is over (now round {s.round})", lost=True)
        if len(s.participants) < self._world:  # who left is in the whole state only
            whole = await self._whole()
            if whole.round != self._round or not whole.complete:
                return await self._restart_reason(finished, excused)
            gone = departed(whole) - excused
            if gone and finished is not None and await finished(frozenset(gone)):
                excused |= gone
                return await self._restart_reason(finished, excused)  # the state may have moved meanwhile
            if gone:
                names = ", ".join(sorted(whole.rank_order[rank].id for rank in gone))
                return MembershipChange(f"round {self._round} lost {len(gone)} member(s): {names}", lost=True)
        if len(s.wait_list):
            return f"{len(s.wait_list)} node(s) waiting to join"
        return None

    async def is_closed(self) -> bool:
        await self._look()
        return self._known.state.closed

    async def set_closed(self) -> None:
        timers = NodeTimers(join_deadline=anyio.current_time() + self.settings.close_timeout)
        settings = self.settings
        await self._run(lambda s, t, now: decide_close(s, settings, t, now), timers, None)
        backend = self._options.backend_name
        record_rendezvous("closed", settings.run_id, self.node.id, backend=backend, round=self._round)

    async def leave(self) -> None:
        # As a node found dead: recorded as lost, so the survivors' next round completes as soon as they are all
        # back (fast quorum) instead of waiting out the last call for this node.
        logger.info("rendezvous %s: %s leaves for good", self.settings.run_id, self.node.id)
        await self._evict(frozenset({self.node}), left=True)

    async def shutdown(self) -> bool:
        try:
            await self.set_closed()
        except Exception as exc:  # shutdown reports failure instead of raising, as torch's does
            logger.warning("rendezvous %s: shutdown failed: %r", self.settings.run_id, exc)
            return False
        return True


Step = Callable[[DynamicRendezvousHandler, Action, NodeTimers], Awaitable[None]]

_STEPS: Final[Mapping[Action, Step]] = {
    Action.WAIT: DynamicRendezvousHandler._wait_step,
    **dict.fromkeys(JOIN_REQUESTS, DynamicRendezvousHandler._join_step),
}
"""What the handler does for each action of the core; every other write action is ``_apply_step``'s (FINISH ends
the operation, and the actions of :data:`_FAILURES` end it with an error)."""


def _timed_out(handler: DynamicRendezvousHandler) -> Exception:
    state, settings = handler.state, handler.settings
    # The node has already taken itself off the lists: count the others, and itself.
    joined = 1 + len(state.participants) - (handler.node in state.participants)
    return RendezvousTimeoutError(
        f"rendezvous {settings.run_id!r} did not complete within join_timeout={settings.join_timeout:g}s: "
        f"{joined} node(s) joined, min_nodes={settings.min_nodes}"
    )


_FAILURES: Final[Mapping[Action, Callable[[DynamicRendezvousHandler], Exception]]] = {
    Action.ERROR_CLOSED: lambda h: RendezvousClosedError(f"rendezvous {h.settings.run_id!r} is closed"),
    Action.GRACEFUL_EXIT: lambda h: RendezvousGracefulExitError(
        f"rendezvous {h.settings.run_id!r} closed while {h.node.id} waited in reserve"
    ),
    Action.ERROR_TIMEOUT: _timed_out,
}
"""The error each failing action of the core raises from the operation."""


@asynccontextmanager
async def open_dynamic_rendezvous(
    node: NodeDesc,
    settings: RendezvousSettings,
    backend: RendezvousBackend,
    options: HandlerOptions,
) -> AsyncIterator[DynamicRendezvousHandler]:
    """A handler of ``node`` over ``backend``, whose background tasks (liveness, bootstrap store) live in a task
    group of its own: how a backend's opener makes its handler (``options``: see :class:`HandlerOptions`).

    If no heartbeat reaches the backend for ``options.read_timeout`` seconds, the handler's task group fails with
    :class:`~aelastic.errors.RendezvousConnectionError`, cancelling the body of this context manager.
    """
    async with anyio.create_task_group() as tg:
        handler = DynamicRendezvousHandler(node, settings, backend, tg, options)
        try:
            await handler._bootstrap.reserve()  # the first join's endpoint, bound before any round starts
            yield handler
        finally:
            tg.cancel_scope.cancel()
            handler._bootstrap.close()
