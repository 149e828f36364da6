"""The agent's side of the node check (``--node-check``); see :mod:`aelastic.agent.nodecheck`.

Theory of operation
-------------------
:func:`open_node_check` gives the agent a :class:`NodeCheck`, which starts the check process
(:mod:`aelastic.worker._nodecheck`) at once, so that its import of torch overlaps the first rendezvous. After each round
completes, and before it starts its workers, the agent asks :meth:`NodeCheck.admit`. Through the round's store (keys
under ``aelastic/node-check/``), every member:

1. says hello: whether it is new (it has not passed a check yet), the endpoint of the store its agent serves for
   this check (the groups it leads meet there), and why its check process cannot take part, if it cannot;
2. with no new member, that is all: a round of a job whose nodes all passed costs one exchange through the store;
3. else the trusted members start their check process too and say when it is ready; then, in each of the two check
   rounds, every member has its process run its group's test, writes its figures and reads everyone's. The groups
   of round 2 follow from round 1's figures (:mod:`.plan`), the same on every member;
4. :func:`.plan.judge` gives the same verdict on every member. A member left out logs why, leaves the rendezvous
   for good (the others then regroup without waiting out a last call: a lost member) and raises
   :class:`~aelastic.errors.NodeCheckError`; the others log why, with the figures, and form the next round
   without it. A member that passed is trusted from then on, and its check process ends.

Bounds: the check process has :data:`STARTUP_LIMIT` to import torch; :data:`ROUND_LIMIT` bounds its group's
forming and each all-reduce, so a peer that never comes fails the round rather than hangs it; the agent gives each
round :data:`ANSWER_LIMIT`, then kills the process (its figures say why). Every member's hello comes within
:data:`HELLO_LIMIT` unless a node runs without ``--node-check``, which the check then reports as an error. A
member that dies is the rendezvous's to find: the check watches the membership, and a change before everyone's
figures are in abandons the check (no one is judged) for the next round.
"""

from __future__ import annotations

import enum
import json
import logging
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Final, TypeVar

import anyio

from ..._net import format_address
from ...config.options import NodeCheckOptions
from ...errors import NodeCheckError
from ...rendezvous.api import RendezvousHandler, RendezvousInfo
from ...store.api import Store
from ...store.server import ServerSettings, open_store_server
from ..spawn.parent import spawn_process, wait_process
from . import plan
from .plan import Figures, Hello, Round, Verdict

__all__ = [
    "ANSWER_LIMIT",
    "HELLO_LIMIT",
    "ROUND_LIMIT",
    "STARTUP_LIMIT",
    "NodeCheck",
    "NodeCheckStatistics",
    "open_node_check",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")

STARTUP_LIMIT: Final = 120.0  # the check process's start: an interpreter, torch, CUDA's first touch on a busy node
ROUND_LIMIT: Final = 10.0  # a group's forming, and each all-reduce: the wait for a peer that never comes
ANSWER_LIMIT: Final = 3 * ROUND_LIMIT  # one round in the check process: forming, compute, the timed all-reduces
HELLO_LIMIT: Final = STARTUP_LIMIT + ROUND_LIMIT  # a new member says hello once its check process is ready
ROUNDS: Final = 2
_PREFIX: Final = "aelastic/node-check"
_CHILD: Final = "aelastic.worker._nodecheck"


@dataclass(frozen=True, slots=True)
class _Checked:
    """A check's verdict, its rounds, the members' hellos, and when every check process was ready (seconds after
    the round's completion)."""

    verdict: Verdict
    rounds: list[Round]
    hellos: dict[int, Hello]
    ready_after: float

    def name(self, rank: int, mine: int) -> str:
        """``node ADDR (rank R)``, or ``this node ...`` where ``rank`` is ``mine``."""
        node = self.hellos[rank].store.rpartition(":")[0]
        return f"{'this node' if rank == mine else 'node'} {node} (rank {rank})"


class _Skip(enum.Enum):
    """Why a check gave no verdict."""

    UNNEEDED = "no member is new"
    ABANDONED = "the membership changed before everyone's figures were in"


@dataclass(frozen=True, slots=True)
class NodeCheckStatistics:
    """What :meth:`NodeCheck.statistics` reports.

    Attributes:
        trusted: this node passed a check.
        checks: the checks this node took part in (a round with a new member), abandoned ones included.
        seconds: how long the last one took, from the round's completion to the verdict.
        left_out: the ranks the last one left out, by rank: why.
    """

    trusted: bool
    checks: int
    seconds: float | None
    left_out: Mapping[int, str]


class _Gone(Exception):
    """The check process exited (the message says with what)."""


class _CheckProcess:
    """One check process and the agent's end of its socket (one JSON message a packet; see
    :mod:`aelastic.worker._nodecheck`)."""

    def __init__(self, env: Mapping[str, str]) -> None:
        agent_end, child_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)  # neither inheritable
        try:
            fd = child_end.fileno()
            self._popen = spawn_process([sys.executable, "-m", _CHILD, str(fd)], env, subprocess.DEVNULL, 2, (fd,))
        except BaseException:
            agent_end.close()
            raise
        finally:
            child_end.close()
        agent_end.setblocking(False)
        self._socket = agent_end
        self.error: str | None = None  # why it cannot take part (it failed)
        self._ready = False

    def __repr__(self) -> str:
        return f"<_CheckProcess pid={self._popen.pid} ready={self._ready} error={self.error!r}>"

    async def _receive(self) -> dict[str, Any]:
        while True:
            try:
                data = self._socket.recv(1 << 16)
            except BlockingIOError:
                await anyio.wait_readable(self._socket)
                continue
            if data:
                message: dict[str, Any] = json.loads(data)
                return message
            with anyio.move_on_after(ROUND_LIMIT):  # its end closed: it exits, or has
                await wait_process(self._popen)
            code = self._popen.poll()
            raise _Gone(f"the check process {'closed its socket' if code is None else f'exited with {code}'} "
                        "(its stderr is the agent's)")  # fmt: skip

    async def _ask(self, limit: float, what: str, request: Callable[[], Coroutine[Any, Any, T]]) -> T | None:
        """``request()``, or ``None`` with :attr:`error` set when the process failed or ``limit`` passed (it is
        then killed: it takes part in nothing more)."""
        if self.error is None:
            with anyio.move_on_after(limit):
                try:
                    return await request()
                except _Gone as exc:
                    self.error = str(exc)
                    return None
            self.error = f"the check process did not {what} within {limit:g} s"
            self._popen.kill()
        return None

    async def ready(self) -> str | None:
        """Wait until the process has imported torch; ``None``, or why it cannot take part."""
        if not self._ready:
            self._ready = await self._ask(STARTUP_LIMIT, "start", self._receive) is not None
        return self.error

    async def run(self, command: Mapping[str, Any]) -> Figures:
        """One check round (the command of :mod:`aelastic.worker._nodecheck`): the process's figures, or failed ones
        saying why."""

        async def request() -> dict[str, Any]:
            self._socket.send(json.dumps(command).encode())  # a small packet: the buffer takes it whole
            return await self._receive()

        answer = await self._ask(ANSWER_LIMIT, "answer", request)
        if answer is None:
            return Figures.failed(self.error or "the check process failed")
        return Figures(**{name: answer[name] for name in Figures.__slots__})

    async def close(self) -> None:
        """Kill the process and reap it: it holds nothing worth a clean exit, and an interpreter's teardown with torch
        and gloo loaded takes seconds that the workers' start would wait for."""
        self._socket.close()
        self._popen.kill()
        with anyio.CancelScope(shield=True):
            await wait_process(self._popen)


class NodeCheck:
    """One agent's node check: its check process, whether this node is trusted yet, and the check of a round."""

    def __init__(self, options: NodeCheckOptions, env: Mapping[str, str]) -> None:
        self.options = options
        self._env = dict(env)
        self._process: _CheckProcess | None = None
        self._trusted = False
        self._checks = 0
        self._seconds: float | None = None
        self._left_out: Mapping[int, str] = {}

    def __repr__(self) -> str:
        slowdown = self.options.slowdown
        return f"<NodeCheck slowdown={slowdown:g} trusted={self._trusted} checks={self._checks} {self._process!r}>"

    def statistics(self) -> NodeCheckStatistics:
        return NodeCheckStatistics(self._trusted, self._checks, self._seconds, dict(self._left_out))

    def start(self) -> None:
        """Start the check process, unless it runs."""
        if self._process is None:
            self._process = _CheckProcess(self._env)

    async def stop(self) -> None:
        """End the check process, if it runs."""
        process, self._process = self._process, None
        if process is not None:
            await process.close()

    async def _ready(self) -> str | None:
        self.start()
        assert self._process is not None
        return await self._process.ready()

    async def admit(self, info: RendezvousInfo, handler: RendezvousHandler) -> bool:
        """Check the members of the round ``info`` if any is new (see the module doc); whether its workers may start.

        ``False``: another member was left out, or the membership changed during the check: the agent forms the
        next round. Cancellation kills the check process (it may be in the middle of a round) and leaves the round's
        store as it is.

        Raises:
            NodeCheckError: this node is left out, with why and the figures (it has left the rendezvous); or a
                member never said hello (a node without ``--node-check``).
            RendezvousStateError: a member's message is unreadable (another version of aelastic).
        """
        began = anyio.current_time()
        changed = anyio.Event()
        reason = ""
        try:
            async with anyio.create_task_group() as tg:

                async def watch() -> None:
                    nonlocal reason
                    reason = await handler.wait_for_membership_change()
                    changed.set()

                tg.start_soon(watch)
                host = handler.local_addr or socket.gethostname()
                exchange = _Exchange(info.store.prefixed(_PREFIX), info.rank, info.world_size, changed)
                # The rendezvous store this node may serve (c10d's host): the job cannot go on without it.
                serves = any(store.name == "rendezvous" for store in handler.statistics().stores)
                outcome = await self._check(exchange, host, serves, began)
                tg.cancel_scope.cancel()
        except BaseException:
            await self.stop()  # shielded; re-raised below
            raise
        if outcome is _Skip.UNNEEDED:
            return True
        self._checks += 1
        if outcome is _Skip.ABANDONED:
            logger.warning("node check of round %d abandoned (%s): the next round checks again", info.round, reason)
            await self.stop()  # it may be stuck with a peer that is gone
            return False
        return await self._conclude(info, handler, outcome, anyio.current_time() - began)

    async def _check(self, exchange: _Exchange, host: str, serves_rendezvous: bool, began: float) -> _Checked | _Skip:
        rank = exchange.rank
        async with open_store_server(host, 0, ServerSettings(name="node-check")) as server:
            error = None if self._trusted else await self._ready()
            hello = Hello(not self._trusted, format_address(host, server.port), error, serves_rendezvous)
            await exchange.store.set(f"hello/{rank}", plan.encode_hello(hello))
            with anyio.move_on_after(HELLO_LIMIT) as waited:
                said = await exchange.gather("hello", range(exchange.size))
            if waited.cancelled_caught:
                raise NodeCheckError(
                    f"node check: not every member of the round said hello within {HELLO_LIMIT:g} s: every node must "
                    "run with --node-check (one without it starts its workers at once)"
                )
            if said is None:
                return _Skip.ABANDONED
            hellos = {r: plan.decode_hello(value, r) for r, value in said.items()}
            new = frozenset(r for r, h in hellos.items() if h.new)
            if not new:
                return _Skip.UNNEEDED
            unable = {r: h.error for r, h in hellos.items() if h.error is not None}
            trusted = [r for r in range(exchange.size) if r not in new]
            if rank in trusted:
                await exchange.store.set(f"ready/{rank}", await self._ready() or "")
            ready = await exchange.gather("ready", trusted)
            if ready is None:
                return _Skip.ABANDONED
            unable |= {r: value.decode() for r, value in ready.items() if value}
            ready_after = anyio.current_time() - began
            rounds: list[Round] = []
            groups = plan.first_groups(r for r in range(exchange.size) if r not in unable)
            for number in range(1, ROUNDS + 1):
                figures = await self._figures(exchange, number, groups, hellos, unable, rounds)
                if figures is None:
                    return _Skip.ABANDONED
                rounds.append(Round(groups, figures))
                groups = plan.second_groups(rounds[-1])
            kept = [r for r, h in hellos.items() if h.serves_rendezvous]
            return _Checked(plan.judge(rounds, new, self.options.slowdown, kept), rounds, hellos, ready_after)

    async def _figures(
        self,
        exchange: _Exchange,
        number: int,
        groups: plan.Groups,
        hellos: Mapping[int, Hello],
        unable: Mapping[int, str],
        rounds: Sequence[Round],
    ) -> dict[int, Figures] | None:
        """Round ``number``: this member's test, its figures written, and everyone's read (``None``: abandoned)."""
        rank, group = exchange.rank, plan.group_of(groups, exchange.rank)
        if rank in unable:
            mine = Figures.failed(unable[rank])
        elif group is None:  # out after a failure of its own: it stands by its figures
            mine = rounds[-1].figures[rank]
        else:
            command = {"store": hellos[group[0]].store, "prefix": f"round{number}", "rank": group.index(rank),
                       "size": len(group), "timeout": ROUND_LIMIT}  # fmt: skip
            assert self._process is not None  # _ready() started it
            measured = await exchange.unless_changed(self._process.run, command)
            if measured is None:
                return None
            mine = measured
        await exchange.store.set(f"{number}/{rank}", plan.encode_figures(mine))
        said = await exchange.gather(str(number), range(exchange.size))
        if said is None:
            return None
        return {r: plan.decode_figures(value, r) for r, value in said.items()}

    async def _conclude(
        self, info: RendezvousInfo, handler: RendezvousHandler, checked: _Checked, seconds: float
    ) -> bool:
        verdict = checked.verdict
        self._seconds, self._left_out = seconds, verdict.left_out
        figures = plan.describe(verdict, checked.rounds)
        rank = info.rank
        for other, why in sorted(verdict.left_out.items()):
            logger.warning("node check of round %d: %s is left out: %s", info.round, checked.name(other, rank), why)
        for other, why in sorted(verdict.kept.items()):
            logger.warning("node check of round %d: %s serves the rendezvous store, without which the job cannot go "
                           "on, so it stays although %s (a store that no training node serves, 'aelastic store' or "
                           "etcd, lets the check leave such a node out)", info.round, checked.name(other, rank),
                           why)  # fmt: skip
        level, outcome = (logging.WARNING, "took") if verdict.left_out else (logging.INFO, "passed in")
        logger.log(level, "node check of round %d %s %.2f s (every check process ready after %.2f s): %s",
                   info.round, outcome, seconds, checked.ready_after, figures)  # fmt: skip
        await self.stop()
        if rank in verdict.left_out:
            await handler.leave()
            raise NodeCheckError(
                f"node check: this node (rank {rank} of round {info.round}) is left out of the job: "
                f"{verdict.left_out[rank]} (the check took {seconds:.2f} s; {figures})"
            )
        self._trusted = True
        if verdict.left_out:
            logger.warning("node check: forming the next round without the node(s) left out")
        return not verdict.left_out


class _Exchange:
    """The check's exchanges through the round's store, abandoned when the membership changes first."""

    def __init__(self, store: Store, rank: int, size: int, changed: anyio.Event) -> None:
        self.store = store
        self.rank = rank
        self.size = size
        self.changed = changed

    async def unless_changed(self, work: Callable[..., Coroutine[Any, Any, T]], *args: Any) -> T | None:
        """``await work(*args)``, or ``None`` if the membership changes first (``work`` is then cancelled)."""
        done: list[T] = []
        async with anyio.create_task_group() as tg:

            async def run() -> None:
                done.append(await work(*args))
                tg.cancel_scope.cancel()

            tg.start_soon(run)
            await self.changed.wait()
            tg.cancel_scope.cancel()
        return done[0] if done else None

    async def gather(self, name: str, ranks: Sequence[int]) -> dict[int, bytes] | None:
        """The values the ``ranks`` set at ``name/<rank>``, once all are there; ``None`` if the membership changed
        before they were (a member that left after writing its own, having read everyone's, abandons nothing)."""
        keys = [f"{name}/{r}" for r in ranks]
        if not keys:
            return {}

        async def wait() -> bool:
            await self.store.wait(keys)
            return True

        if await self.unless_changed(wait) is None and not await self.store.check(keys):
            return None
        return dict(zip(ranks, await self.store.multi_get(keys), strict=True))


@asynccontextmanager
async def open_node_check(options: NodeCheckOptions, env: Mapping[str, str]) -> AsyncIterator[NodeCheck]:
    """A :class:`NodeCheck` whose check process starts now (it imports torch while the rendezvous runs), with
    ``env`` (the workers' base environment); it ends with the context, under a shield."""
    check = NodeCheck(options, env)
    check.start()
    try:
        yield check
    finally:
        await check.stop()
