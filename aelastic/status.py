"""A rendezvous as a person wants to see it: who joined, who waits, and why the round has not completed yet.

Three parts. :func:`describe` is pure: (state, settings, and either a node's own timers or a :class:`Watch`, with
a clock) to a :class:`RendezvousView` that renders as text or JSON; its :attr:`~RendezvousView.reason` is the one
line ``aelastic run`` shows live on a terminal while it waits. :func:`open_reader` reads the state through the
backend, and waits for its changes, without joining, writing or creating anything. :func:`command` is
``aelastic status`` itself (the CLI imports this module for that command only).

Time left: the shared state holds no clock (nothing compares clocks of different hosts), so the last-call and
join deadlines exist only as each node's own monotonic timers. Inside a node (``aelastic run``) they are shown.
From outside, one read cannot know them (when did the last call open?), so a single ``aelastic status`` gives
the configured windows; ``aelastic status --watch`` follows the changes and times what it sees begin, on its own
clock, with the nodes' own rules (:class:`Watch`).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AsyncExitStack, asynccontextmanager, contextmanager
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Any, Final

import anyio

from .agent.incidents import INCIDENT_KEY
from .agent.rootcause import CAUSE_KEY, FailureRecord
from .config import LIST_LIMIT, parse_nnodes, parse_rdzv_conf
from .errors import ConfigurationError, RendezvousConnectionError, StoreConnectionError
from .rendezvous.api import RendezvousParameters
from .rendezvous.backends.base import StateReader, Versioned
from .rendezvous.dynamic import job_prefix, round_prefix
from .rendezvous.known import state_of
from .rendezvous.registry import check_parameters, lookup, readable_backends
from .rendezvous.state import update_timers
from .rendezvous.values import NodeDesc, NodeTimers, RendezvousSettings, RendezvousState, StateView

__all__ = [
    "History",
    "NodeView",
    "RendezvousReader",
    "RendezvousView",
    "TimeLeft",
    "Watch",
    "check_readable",
    "command",
    "describe",
    "open_reader",
    "read_rendezvous",
    "rendezvous_settings",
    "state_or_none",
    "waiting_reason",
]

_OUTSIDE_TIMING: Final = (
    "time left not shown: deadlines are each node's own monotonic timers and the shared state holds no clock "
    "(nothing compares clocks across hosts); --watch times what it sees begin"
)
_INSIDE_TIMING: Final = "this node's own deadlines, on its monotonic clock"
_WATCH_TIMING: Final = (
    "watching: time left is measured on this viewer's clock from the changes it saw, so it is at most the time "
    "that actually remains (late by the time a change took to arrive); a last call or a join that began before "
    "the watch is not timed"
)
_WATCH_NO_COUNTS: Final = "watching: give --nnodes MIN:MAX to time the last call and the joins"


def _nodes(count: int, more: str = "") -> str:
    """``1 node``, ``2 nodes``; with ``more="more "``: ``1 more node``."""
    return f"{count} {more}node" if count == 1 else f"{count} {more}nodes"


def waiting_reason(
    state: RendezvousState | StateView | None,
    settings: RendezvousSettings | None,
    timers: NodeTimers | None = None,
    now: float | None = None,
) -> str:
    """One line: why the round has not completed (``waiting for 1 more node (have 1, min 2)``), or its outcome.

    ``state`` None: no node has opened the run yet. ``settings`` None: the node counts are unknown (the viewer
    did not give ``--nnodes``). ``timers``/``now``: a node's own, for the last-call countdown.
    """
    state = state or RendezvousState()
    have = len(state.participants)
    if state.closed:
        return f"closed after round {state.round}: the job is over or was stopped; a node that joins now fails"
    if state.complete:
        extra = "".join(
            f"; {_nodes(len(nodes))} {what}"
            for nodes, what in ((state.wait_list, "waiting for the next round"), (state.redundancy_list, "in reserve"))
            if nodes
        )
        return f"complete: round {state.round} runs with {_nodes(have)}{extra}"
    if settings is None:
        return f"not complete: {_nodes(have)} joined (give --nnodes MIN:MAX to see what it waits for)"
    low, high = settings.min_nodes, settings.max_nodes
    if have < low:
        return f"waiting for {_nodes(low - have, 'more ')} (have {have}, min {low})"
    if have >= high:
        return f"completing: max_nodes joined (have {have}, max {high})"
    left = _last_call_left(state, timers, now)
    counts = f"(have {have}, min {low}, max {high})"
    if left is None:
        window = f"last_call_timeout={settings.last_call_timeout:g}s"
        return f"last call: completes up to {window} after min_nodes joined {counts}"
    more = high - have
    join = "joins" if more == 1 else "join"
    return f"last call: completes in {math.ceil(left)}s unless {_nodes(more, 'more ')} {join} first {counts}"


def _left(deadline: float, now: float) -> float:
    """Seconds from ``now`` to ``deadline``, to the millisecond: a deadline set ``timeout`` after ``now`` reads
    ``timeout``, not the float sum's 120.00000000000011 (a time left must not exceed the timeout it counts)."""
    return round(max(0.0, deadline - now), 3)


def _last_call_left(state: RendezvousState | StateView, timers: NodeTimers | None, now: float | None) -> float | None:
    if timers is None or now is None or timers.last_call_deadline is None or timers.last_call_round != state.round:
        return None
    return _left(timers.last_call_deadline, now)


@dataclass(frozen=True, slots=True)
class NodeView:
    """One listed node: torch's ``addr_pid_localid`` id, its address and pid, and its rank once the round is
    complete (``None`` before: ranks are fixed at completion)."""

    id: str
    addr: str
    pid: int
    rank: int | None = None
    join_seconds_left: float | None = None  # --watch: for a join it saw begin


@dataclass(frozen=True, slots=True)
class TimeLeft:
    """What a round has left before its last call and a node's join end, and whose clock says it."""

    last_call_seconds_left: float | None
    join_seconds_left: float | None  # inside a node: its own join; --watch gives each node's in its NodeView
    clock: str | None  # whose clock timed the seconds left: "node" (its own), "viewer" (--watch), None
    timing: str


@dataclass(frozen=True, slots=True)
class History:
    """What the run's agents left of its past: the root cause of its last failed round, as they named it, and the
    last incident that ended on a node, with that node's summary (its fields are the view's own in JSON)."""

    last_failure: dict[str, Any] | None = None
    last_incident: dict[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class RendezvousView:
    """What ``aelastic status`` prints; :meth:`render` for people, :meth:`to_json` for machines."""

    run_id: str
    backend: str
    endpoint: str
    exists: bool
    round: int
    complete: bool
    closed: bool
    min_nodes: int | None
    max_nodes: int | None
    participants: tuple[NodeView, ...]
    waiting: tuple[NodeView, ...]
    reserve: tuple[NodeView, ...]
    time: TimeLeft
    reason: str
    history: History = field(default_factory=lambda: History())

    def to_json(self) -> dict[str, Any]:
        """The view as JSON's objects, the time left's fields among the view's own."""
        out: dict[str, Any] = {}
        for key, value in asdict(self).items():
            out.update(value if key in ("time", "history") else {key: value})
        return out

    def render(self, limit: int | None = LIST_LIMIT) -> str:
        """The view for people; each list shows at most ``limit`` nodes (``None``: all) and then how many more on
        how many hosts, so that ten thousand nodes make a screenful, not ten thousand lines."""

        def listing(title: str, nodes: tuple[NodeView, ...]) -> list[str]:
            lines = [f"  {title} ({len(nodes)}):" + ("" if nodes else " none")]
            shown = nodes if limit is None else nodes[:limit]
            for n in shown:
                rank = "" if n.rank is None else f"rank {n.rank:<4} "
                join = "" if n.join_seconds_left is None else f"  join: at most {n.join_seconds_left:.0f}s left"
                lines.append(f"    {rank}{n.addr:<24} pid {n.pid:<8} {n.id}{join}")
            if len(shown) < len(nodes):
                rest = nodes[len(shown) :]
                hosts = len({n.addr for n in rest})
                lines.append(f"    ... and {len(rest)} more on {hosts} host(s) (--all lists every node)")
            return lines

        counts = "unknown (give --nnodes)" if self.min_nodes is None else f"min {self.min_nodes}, max {self.max_nodes}"
        lines = [
            f"rendezvous {self.run_id!r} ({self.backend} at {self.endpoint})",
            f"  status: {self.reason}",
        ]
        if not self.exists:
            lines.append("  no node has opened this run id on this backend yet")
        lines += [
            f"  round {self.round}: {'complete' if self.complete else 'not complete'}, "
            f"{'closed' if self.closed else 'open'}; nodes {counts}",
            *listing(
                "participants" if self.complete else "participants (ranks fixed at completion)", self.participants
            ),
            *listing("waiting for the next round", self.waiting),
            *listing("reserve (beyond max_nodes)", self.reserve),
        ]
        time = self.time
        if time.last_call_seconds_left is not None:
            at_most = "at most " if time.clock == "viewer" else ""
            lines.append(f"  last call: {at_most}{time.last_call_seconds_left:.1f}s left")
        if time.join_seconds_left is not None:
            lines.append(f"  join timeout: {time.join_seconds_left:.1f}s left")
        lines.append(f"  time: {time.timing}")
        if self.history.last_failure is not None:
            f = self.history.last_failure
            lines.append(f"  last failure (round {f['round']}): rank {f['rank']} on node {f['node']} ({f['host']}): "
                         f"exitcode {f['exitcode']}: {f['message']}")  # fmt: skip
        if self.history.last_incident is not None:
            i = self.history.last_incident
            lines.append(f"  last incident ({i['node']}): {i['incident']}")
            if i.get("summary"):
                lines.append(f"    that node so far: {i['summary']}")
        return "\n".join(lines)


def _windows(settings: RendezvousSettings | None) -> str:
    if settings is None:
        return ""
    return (
        f"; a node completes the round last_call_timeout={settings.last_call_timeout:g}s after it saw min_nodes "
        f"join, and gives up join_timeout={settings.join_timeout:g}s after it began to join"
    )


class Watch:
    """Time left as a viewer outside the nodes can know it: measured on the viewer's own monotonic clock from the
    changes it saw, with the nodes' own timer rules (:func:`~aelastic.rendezvous.state.update_timers`).

    A node opens its last call when it sees the round reach ``min_nodes``, and starts its join timer when it
    begins to join; the viewer sees either only after it happened, so each time it gives is at most the time
    left (late by the time the change took to reach it; a join request shows at the viewer's next read). What
    began before the first observation (a last call already open, a node already listed) has an unknown start
    and is not timed; a node's next join, after its round completed or it left, is.
    """

    def __init__(self, settings: RendezvousSettings | None) -> None:
        self.settings = settings  # None: the node counts are unknown, so nothing can be timed
        self._round: NodeTimers | None = None  # the last call, kept as update_timers keeps it (no node)
        self._round_seen_open = False  # the current last call opened before the first observation
        self._joins: dict[NodeDesc, NodeTimers] = {}
        self._untimed: set[NodeDesc] | None = None  # listed, joining since before they could be seen

    def observe(self, state: RendezvousState | None, now: float) -> None:
        """Fold one read of the state (None: no node opened the run) taken at ``now`` (the viewer's clock)."""
        settings = self.settings
        if settings is None:
            return
        state = state or RendezvousState()
        first = self._untimed is None
        self._round = update_timers(self._round or NodeTimers(math.inf), state, settings, now)
        if self._round.last_call_deadline is None:
            self._round_seen_open = False
        elif first:
            self._round_seen_open = True
        finished = set(state.participants) if state.complete else set()
        joining = set(state.all_nodes()) - finished
        if self._untimed is None:
            self._untimed = joining
        self._untimed &= joining  # a node that finished or left is timed from its next join on
        for node in list(self._joins):
            if node not in joining:
                del self._joins[node]
        for node in joining - self._untimed:
            timers = self._joins.get(node) or NodeTimers(now + settings.join_timeout)
            self._joins[node] = update_timers(timers, state, settings, now, node=node)

    @property
    def round_timers(self) -> NodeTimers | None:
        """The last call as the viewer timed it; None when it opened before the watch (or nothing was read)."""
        return None if self._round_seen_open else self._round

    def join_seconds_left(self, node: NodeDesc, now: float) -> float | None:
        timers = self._joins.get(node)
        return None if timers is None else _left(timers.join_deadline, now)


def describe(
    state: RendezvousState | None,
    settings: RendezvousSettings | None,
    *,
    run_id: str,
    backend: str,
    endpoint: str,
    timers: NodeTimers | None = None,
    watch: Watch | None = None,
    now: float | None = None,
    last_failure: dict[str, Any] | None = None,
    last_incident: dict[str, Any] | None = None,
) -> RendezvousView:
    """The view of ``state`` (None: no node opened the run yet) at ``now``, with time left from ``timers`` (a
    node's own, on its monotonic clock) or from ``watch`` (a viewer's, on its clock); with neither, or without
    ``now``, no time left is shown, and ``timing`` says why."""
    exists = state is not None
    state = state or RendezvousState()
    if now is None:
        timers = watch = None
    if watch is not None:
        timers = watch.round_timers
        clock = "viewer" if watch.settings is not None else None
        timing = _WATCH_TIMING if watch.settings is not None else _WATCH_NO_COUNTS
    else:
        clock = "node" if timers is not None else None
        timing = _INSIDE_TIMING if timers is not None else _OUTSIDE_TIMING

    def view(node: NodeDesc) -> NodeView:
        join = None if watch is None or now is None else watch.join_seconds_left(node, now)
        return NodeView(node.id, node.addr, node.pid, state.rank_of(node), join)

    own = timers if watch is None and not state.complete else None  # a node's own join, while it lasts
    return RendezvousView(
        run_id=run_id,
        backend=backend,
        endpoint=endpoint,
        exists=exists,
        round=state.round,
        complete=state.complete,
        closed=state.closed,
        min_nodes=None if settings is None else settings.min_nodes,
        max_nodes=None if settings is None else settings.max_nodes,
        participants=tuple(view(n) for n in state.participants),
        waiting=tuple(view(n) for n in state.wait_list),
        reserve=tuple(view(n) for n in state.redundancy_list),
        time=TimeLeft(
            last_call_seconds_left=_last_call_left(state, timers, now),
            join_seconds_left=None if own is None or now is None else _left(own.join_deadline, now),
            clock=clock,
            timing=timing + _windows(settings),
        ),
        reason=waiting_reason(state if exists else None, settings, timers, now),
        history=History(last_failure, last_incident),
    )


def check_readable(params: RendezvousParameters) -> None:
    """Refuse, without I/O, what :func:`open_reader` cannot read: a backend whose registry entry opens no reader
    (it keeps no shared state: static), bad keys."""
    if lookup(params.backend).open_reader is None:
        raise ConfigurationError(
            f"--rdzv-backend {params.backend!r}: keeps no shared rendezvous state to show; "
            f"aelastic status reads the {', '.join(readable_backends())} backends"
        )
    check_parameters(params)


def rendezvous_settings(params: RendezvousParameters) -> RendezvousSettings:
    """The protocol settings ``params`` give (node counts, windows), as the job's nodes derive them."""
    check_readable(params)
    return lookup(params.backend).rendezvous_settings(params)


@dataclass(frozen=True, slots=True)
class RendezvousReader:
    """Reads one run's rendezvous state through its backend's reader, and waits for it to change; never writes."""

    backend: StateReader

    async def read(self) -> Versioned:
        """The state now; version 0 while no node has opened the run (a reader never blocks on, or creates, a
        key no node made)."""
        return await self.backend.read_state()

    async def wait_for_change(self, seen: Versioned) -> None:
        """Return once the state moved past ``seen`` (a server-side wait or a watch). Join requests appended
        meanwhile wake no one: only a later read shows them."""
        await self.backend.wait_for_change(seen)

    async def last_failure(self, run_id: str, state: RendezvousState | None) -> dict[str, Any] | None:
        """The root cause the agents named for the run's last failed round (this round or the one before), as
        :mod:`aelastic.agent.rootcause` keeps it; None if there is none."""
        if state is None:
            return None
        for round in (state.round, state.round - 1):
            data = await self.backend.read_key(f"{round_prefix(run_id, round)}/{CAUSE_KEY}") if round >= 0 else None
            if data is not None:
                record = FailureRecord.from_json(json.loads(data))
                failure = record.failure
                return {"round": round, "rank": failure.global_rank, "node": record.node, "host": record.host,
                        "kind": record.kind, "exitcode": failure.exitcode, "message": failure.message}  # fmt: skip
        return None

    async def last_incident(self, run_id: str) -> dict[str, Any] | None:
        """The last incident that ended on any node of the run, as :mod:`aelastic.agent.incidents` publishes it
        (its node, its line, that node's summary so far); None if there was none."""
        data = await self.backend.read_key(f"{job_prefix(run_id)}/{INCIDENT_KEY}")
        return None if data is None else dict(json.loads(data))


@asynccontextmanager
async def open_reader(params: RendezvousParameters) -> AsyncIterator[RendezvousReader]:
    """A reader of the rendezvous of ``params``: it joins nothing, writes nothing, creates no key. Bound its
    calls with ``anyio.fail_after``; the connection closes on exit.

    Raises:
        ConfigurationError: bad parameters, or a backend that keeps no shared state (static).
        RendezvousConnectionError: the backend refused the connection or broke it (on opening or in use).
    """
    check_readable(params)
    try:
        async with _open_backend(params) as backend:
            yield RendezvousReader(backend)
    except StoreConnectionError as exc:
        raise RendezvousConnectionError(
            f"could not read rendezvous {params.run_id!r} from the {params.backend} backend at "
            f"{params.endpoint!r}: {exc}"
        ) from exc


async def read_rendezvous(params: RendezvousParameters) -> RendezvousState | None:
    """The rendezvous state of ``params`` as its backend holds it now, or None if no node opened the run yet
    (one read through :func:`open_reader`, which says what it raises)."""
    async with open_reader(params) as reader:
        return state_or_none(await reader.read())


def state_or_none(seen: Versioned) -> RendezvousState | None:
    """What every node decides on (the written state with the pending join requests folded in); None while no
    node has opened the run."""
    return None if seen.data is None and not seen.pending else state_of(seen)


@asynccontextmanager
async def _open_backend(params: RendezvousParameters) -> AsyncIterator[StateReader]:
    open_reader = lookup(params.backend).open_reader
    if open_reader is None:  # check_readable refused it already
        raise ConfigurationError(f"--rdzv-backend {params.backend!r}: keeps no shared rendezvous state to show")
    async with open_reader(params) as reader:
        yield reader


# --- the aelastic status command -----------------------------------------------------------------------------------


@contextmanager
def _answer_within(params: RendezvousParameters, seconds: float) -> Iterator[None]:
    try:
        with anyio.fail_after(seconds):
            yield
    except TimeoutError:
        raise RendezvousConnectionError(
            f"rendezvous {params.run_id!r}: the {params.backend} backend at {params.endpoint!r} did not answer "
            f"within --timeout {seconds:g}s"
        ) from None


async def _show(
    params: RendezvousParameters,
    settings: RendezvousSettings | None,
    as_json: bool,
    read_seconds: float,
    show_all: bool,
    follow: bool,
) -> int:
    """Print the rendezvous once; with ``follow``, until it closes: woken by each change, and each second (a join
    request wakes no one, and a countdown moves) to read it again. A terminal is redrawn at every read; other
    output gets the view at each change."""
    limit = None if show_all else LIST_LIMIT
    if not follow:
        with _answer_within(params, read_seconds):
            async with open_reader(params) as reader:
                state = state_or_none(await reader.read())
                failure = await reader.last_failure(params.run_id, state)
                incident = await reader.last_incident(params.run_id)
        view = describe(state, settings, run_id=params.run_id, backend=params.backend, endpoint=params.endpoint,
                        last_failure=failure, last_incident=incident)  # fmt: skip
        print(json.dumps(view.to_json(), indent=2) if as_json else view.render(limit), flush=True)
        return 0
    watch = Watch(settings)
    terminal = sys.stdout.isatty()
    shown: object = ()  # the state last printed; () matches no state, so the first read prints
    async with AsyncExitStack() as stack:
        with _answer_within(params, read_seconds):
            reader = await stack.enter_async_context(open_reader(params))
        while True:
            with _answer_within(params, read_seconds):
                seen = await reader.read()
            state, now = state_or_none(seen), anyio.current_time()
            watch.observe(state, now)
            if terminal or state != shown:
                with _answer_within(params, read_seconds):
                    failure = await reader.last_failure(params.run_id, state)
                    incident = await reader.last_incident(params.run_id)
                view = describe(state, settings, run_id=params.run_id, backend=params.backend, endpoint=params.endpoint,
                                watch=watch, now=now, last_failure=failure, last_incident=incident)  # fmt: skip
                if as_json:
                    text = json.dumps(view.to_json())
                else:
                    rendered = view.render(limit)
                    text = ("\x1b[H\x1b[2J" if terminal else "") + rendered + ("" if terminal else "\n")
                print(text, flush=True)
                shown = state
            if state is not None and state.closed:
                return 0
            with anyio.move_on_after(1.0):
                await reader.wait_for_change(seen)


def command(args: argparse.Namespace) -> Callable[[], Any]:
    """``aelastic status`` with the parsed ``args``: the coroutine function that shows (or follows) the run."""
    low, high = parse_nnodes(args.nnodes) if args.nnodes is not None else (1, 1)
    if not args.rdzv_endpoint:
        raise ConfigurationError("--rdzv-endpoint '': give the job's rendezvous endpoint HOST:PORT")
    if not args.timeout > 0:
        raise ConfigurationError(f"--timeout {args.timeout!r}: must be a number of seconds > 0")
    conf: dict[str, Any] = parse_rdzv_conf(args.rdzv_conf)
    params = RendezvousParameters(args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id, low, high, **conf)
    check_readable(params)
    settings = rendezvous_settings(params) if args.nnodes is not None else None
    return partial(_show, params, settings, args.json, args.timeout, args.show_all, args.watch)
