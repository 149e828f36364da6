"""A dynamic handler's liveness (:class:`Liveness`, a part of
:class:`~aelastic.rendezvous.dynamic.DynamicRendezvousHandler`): this node's heartbeats, its check of its
neighbour's, and the eviction of the dead it finds or the backend reports.

Each node beats once per ``keep_alive_interval`` and checks one neighbour (the node before it in the state's order),
so a round of N nodes costs O(N) small writes per interval and no node compares its clock with another's: the
backend judges a neighbour by when the observer saw its counter move (:meth:`RendezvousBackend.find_dead`).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import anyio
import anyio.abc

from ..errors import RendezvousConnectionError, StoreConnectionError
from ..events import record_rendezvous
from .backends.base import RendezvousBackend
from .known import Known
from .settings import HandlerOptions
from .state import Action, apply
from .values import NodeDesc, RendezvousSettings, RendezvousState, StateView

__all__ = ["Liveness"]

logger = logging.getLogger("aelastic.rendezvous.dynamic")  # the handler's log lines


class Liveness:
    """The liveness part of the dynamic handler: it reads and writes the state through the handler's own
    ``_whole`` (the whole state) and ``_write`` (a compare-and-set), declared here as what it needs of its host."""

    node: NodeDesc
    settings: RendezvousSettings
    backend: RendezvousBackend
    _task_group: anyio.abc.TaskGroup
    _options: HandlerOptions
    _known: Known
    _joining: anyio.Event | None
    _round: int | None
    _liveness_started: bool
    _whole: Callable[[], Awaitable[RendezvousState]]
    _write: Callable[[RendezvousState], Awaitable[bool]]

    async def _start_liveness(self) -> None:
        if not self._liveness_started:
            await self._task_group.start(self._liveness)
            if self.backend.departures:
                self._task_group.start_soon(self._departures)
            self._liveness_started = True

    async def _departures(self) -> None:
        """Evict the nodes whose connections the network reported closed (the c10d host's store server): a dead
        agent is found within the backend's short grace instead of the keep-alive's. Nodes at this node's own
        address are left to the keep-alive (this node is alive, and it cannot tell which of them died)."""
        while True:
            hosts = await self.backend.wait_for_departures()
            if self.node.addr in hosts:
                hosts = hosts - {self.node.addr}
            if not hosts:
                continue
            state = await self._whole()
            gone = frozenset(n for n in state.all_nodes() if n.addr in hosts)
            if not gone:
                continue
            logger.warning(
                "rendezvous %s: every connection from %s closed: %s died",
                self.settings.run_id, ", ".join(sorted(hosts)), ", ".join(sorted(n.id for n in gone)),
            )  # fmt: skip
            try:
                with anyio.fail_after(self._options.read_timeout):
                    await self._evict(gone)
            except TimeoutError as exc:
                raise RendezvousConnectionError(
                    f"rendezvous {self.settings.run_id!r}: lost {self.backend.location}: evicting the dead "
                    f"node(s) {sorted(n.id for n in gone)} got no answer within "
                    f"read_timeout={self._options.read_timeout:g}s"
                ) from exc

    async def _liveness(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        await self.backend.keep_alive(self.node.key)
        task_status.started()
        interval = self.settings.keep_alive_interval
        grace = interval * self.settings.keep_alive_max_attempt
        # A checker sees a beat up to one interval after it happened (it checks once per interval), and judges a
        # neighbour by when it saw its counter move. Counting from half an interval earlier makes the verdict fall
        # on the check that finds keep_alive_max_attempt beats missed (15-20 s after the last beat with torch's
        # defaults, as torch's wall-clock expiry), not one check later (20-25 s); never before the grace has
        # passed since the last beat, and a live node's beats (at most 1.5 intervals apart) stay well inside it.
        still = grace - interval / 2 if self.settings.keep_alive_max_attempt >= 3 else grace
        # A beat due while the node waits for its round to complete would preempt the wait (on a c10d store:
        # CANCEL_WAIT, the beat, WAIT again). Those waits end together when the round completes, and at 10,000
        # nodes the beats that preempt them at that moment starve the one write that completes it (RESULTS.md).
        # So such a beat first lets the wait end, for at most a quarter of the grace's slack over one interval
        # (half an interval at most): the beats stay that far inside the grace.
        defer = min(interval / 2, (grace - interval) / 4)
        reached = anyio.current_time()  # when a beat last reached the backend
        while True:
            await anyio.sleep(interval)
            if self._joining is not None and defer > 0:
                with anyio.move_on_after(defer):
                    await self._joining.wait()
            dead: NodeDesc | None = None
            try:
                # The neighbour's check is bounded with the beat: a store that goes silent while it is in flight
                # must not hang the liveness, which is what notices a lost store.
                with anyio.fail_after(self._options.heartbeat_timeout):
                    await self.backend.keep_alive(self.node.key)
                    reached = anyio.current_time()
                    neighbour = self._neighbour()
                    if neighbour is not None and await self.backend.find_dead([neighbour.key], still):
                        dead = neighbour
            except (TimeoutError, StoreConnectionError) as exc:
                # A missed beat is what liveness is for: the others judge this node. Only a backend that no beat
                # has reached for read_timeout is given up on: other operations may hang on it meanwhile.
                lost = anyio.current_time() - reached
                error = str(exc) or f"no answer within heartbeat_timeout={self._options.heartbeat_timeout:g}s"
                if lost >= self._options.read_timeout:
                    raise RendezvousConnectionError(
                        f"rendezvous {self.settings.run_id!r}: lost {self.backend.location}: no heartbeat of "
                        f"{self.node.id} reached it for {lost:.0f}s (read_timeout={self._options.read_timeout:g}s); "
                        f"last error: {error}"
                    ) from exc
                logger.warning("rendezvous %s: heartbeat of %s failed: %s", self.settings.run_id, self.node.id, error)
                continue
            if dead is not None:
                try:
                    with anyio.fail_after(self._options.read_timeout):  # nor may the eviction hang the liveness
                        await self._evict(frozenset({dead}))
                except TimeoutError as exc:
                    raise RendezvousConnectionError(
                        f"rendezvous {self.settings.run_id!r}: lost {self.backend.location}: evicting the dead "
                        f"node {dead.id} got no answer within read_timeout={self._options.read_timeout:g}s"
                    ) from exc

    def _neighbour(self) -> NodeDesc | None:
        if isinstance(self._known.state, StateView):
            return self._known.state.neighbour
        nodes = sorted(self._known.state.all_nodes())
        if self.node not in nodes or len(nodes) < 2:
            return None
        return nodes[nodes.index(self.node) - 1]

    async def _evict(self, dead: frozenset[NodeDesc], *, left: bool = False) -> None:
        """Take ``dead`` off the state, recorded as lost; ``left``: this node itself, leaving for good."""
        while True:
            state = await self._whole()
            present = dead & set(state.all_nodes())
            if not present:
                return
            names = sorted(n.id for n in present)
            if not left:
                logger.warning("rendezvous %s: removing dead node(s) %s", self.settings.run_id, names)
            if await self._write(apply(state, Action.REMOVE_DEAD, self.node, self.settings, present)):
                record_rendezvous(
                    "member_left" if left else "member_dead", self.settings.run_id, self.node.id,
                    backend=self._options.backend_name, round=self._round, dead=names,
                )  # fmt: skip
                return
