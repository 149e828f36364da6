"""The agent's side of in-memory checkpoints: it owns the memory (see :mod:`aelastic.checkpoint` for the user's
view, :mod:`aelastic.worker._checkpoint.api` for the worker's).

Theory of operation
-------------------
The :class:`Keeper` (:func:`open_keeper`) lives as long as the agent and answers the workers' ``checkpoint.*``
requests over their links (:mod:`aelastic.agent.link`). For each rank that saves it keeps slots (:mod:`.slots`,
held within ``--checkpoint-memory`` by :mod:`.holdings`): memory files the agent creates and passes to the rank's
worker, which outlive every worker and are released when the agent ends, however it ends. ``reserve`` gives the
worker the slot that is not the rank's latest complete checkpoint (a third one only while the other is being read
and ``--checkpoint-memory`` has room; else that read is stopped); ``commit`` reads the header the worker wrote last
(:mod:`aelastic.worker._checkpoint.layout`) and makes the slot the latest. A worker that dies midway never commits,
so the latest stays whole.

Each rendezvous round the agents agree on the step the job restores from (:mod:`.plan`, in the rank exchange);
:meth:`Keeper.adopt` takes this node's part: checkpoints of newer steps are dropped (a rank that completed a step
its peers did not), and the saved ranks this node's workers need from another agent are fetched (:mod:`.replicas`)
while the workers start. ``load`` answers with the slot of the restore step, or the file of the directory.

In the background, never in a worker's way:

* *replicas*: after a commit, the rank's latest is pushed to the next node's agent (group rank + 1), which keeps it
  among its replicas, so that a lost node's ranks restore from memory; a push under way when the next commit
  arrives is followed by one of the newest, never queued behind older ones.
* *persistence* (``--checkpoint-dir``, :mod:`.persist`): every ``persist_every``-th step, after a worker failed (once
  each rank saved again in the restart: the write waits for the restart), on a forwarded scheduler signal and at the
  end, each rank's latest is written to the directory.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import AsyncIterator, Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Protocol

import anyio
import anyio.abc

from ...config.options import CheckpointOptions
from ...errors import StoreError
from ...store.api import Store
from ...worker._checkpoint.layout import Header, LayoutError
from ..link.parent import LinkRefusal
from ..spawn.parent import WorkerProcess
from .holdings import Holdings, TooLarge
from .persist import CopyStopped, file_name, newest_complete, remove_older, write_checkpoint
from .plan import HOLDERS_KEY, Held, Inventory, NodePlan, saved_rank
from .replicas import ReplicaError, fetch, fetch_metadata, open_listener, push, serve
from .slots import RankSlots, Slot, format_size

__all__ = ["Keeper", "KeeperStatistics", "open_keeper"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class KeeperStatistics:
    """What :meth:`Keeper.statistics` reports.

    Attributes:
        own: the steps held for each rank this node's workers saved; ``replicas``: for the ranks kept for another
            node.
        memory: bytes of memory files held.
        saves: commits accepted; ``loads``: loads answered; ``pushed``: replicas sent; ``persisted``: files
            written to the checkpoint directory.
        restore_step: the step this round restores from (``None``: no checkpoint).
        endpoint: where other agents reach this one's replicas (``None``: not served).
    """

    own: Mapping[int, tuple[int, ...]]
    replicas: Mapping[int, tuple[int, ...]]
    memory: int
    saves: int
    loads: int
    pushed: int
    persisted: int
    restore_step: int | None
    endpoint: str | None


class _Queue:
    """Ranks waiting for a background job (persisting, pushing), each with the reason it was asked; the job takes
    a rank's latest checkpoint when it gets to it, so asking again while it waits costs nothing. A rank may also be
    asked for once it saves again (:meth:`defer`, :meth:`saved`)."""

    def __init__(self) -> None:
        self.waiting: dict[int, str] = {}
        self.deferred: dict[int, str] = {}
        self.busy = False
        self._wake = anyio.Event()
        self._settled = anyio.Event()
        self._settled.set()

    def defer(self, rank: int, reason: str) -> None:
        self.deferred[rank] = reason

    def saved(self, rank: int) -> bool:
        """``rank`` saved: asked for now if it was deferred (then ``True``)."""
        reason = self.deferred.pop(rank, None)
        if reason is not None:
            self.ask(rank, reason)
        return reason is not None

    def ask(self, rank: int, reason: str) -> None:
        self.deferred.pop(rank, None)
        self.waiting.setdefault(rank, reason)
        self._settled = anyio.Event() if self._settled.is_set() else self._settled
        self._wake.set()

    async def next(self) -> tuple[int, str]:
        while not self.waiting:
            self.busy = False
            self._settled.set()
            await self._wake.wait()
            self._wake = anyio.Event()
        self.busy = True
        return self.waiting.popitem()

    async def wait_settled(self) -> None:
        if self.waiting or self.busy:
            await self._settled.wait()


class _Metadata:
    """A saved rank's metadata fetched from another agent (:func:`.replicas.fetch_metadata`): done once ``done`` is
    set, with its memory file and header, or the error."""

    __slots__ = ("done", "error", "fd", "header")

    def __init__(self) -> None:
        self.done = anyio.Event()
        self.fd = -1
        self.header: Header | None = None
        self.error: str | None = None


class _Round:
    """What one rendezvous round holds of the checkpoints: its plan, world size and store, the fetches of other
    agents' ranks (saved rank: done, errors), the metadata fetched of others (by saved rank), every saved rank's
    holder (read from the store when first needed), and the ranks that committed a checkpoint in it."""

    __slots__ = ("committed", "fetches", "holders", "metadata", "plan", "store", "world")

    def __init__(self, plan: NodePlan, world: int = 0, store: Store | None = None) -> None:
        self.plan, self.world, self.store = plan, world, store
        self.fetches: dict[int, tuple[anyio.Event, list[str]]] = {}
        self.metadata: dict[int, _Metadata] = {}
        self.holders: dict[str, str] | None = None
        self.committed: set[int] = set()

    def close(self) -> None:
        for fetched in self.metadata.values():
            if fetched.fd >= 0:
                os.close(fetched.fd)
        self.metadata.clear()


class _Standbys:
    """What the node's standbys (``--prewarm``) are told of the saves: each new largest state in host memory a
    worker saved (``on_state_size``: they warm that much heap), and a rank's slots at its first commit into each new
    memory file (``on_slots``: local rank, rank, (slot, generation, capacity, memory file) each: they map them ahead
    of a replacement's restore)."""

    __slots__ = ("announced", "largest", "on_slots", "on_state_size")

    def __init__(self) -> None:
        self.largest = 0
        self.announced: dict[int, tuple[tuple[int, int], ...]] = {}  # by rank: the slots on_slots was told
        self.on_state_size: Callable[[int], None] | None = None
        self.on_slots: Callable[[int, int, Sequence[tuple[int, int, int, int]]], None] | None = None

    def committed(self, worker: WorkerProcess, rank: RankSlots, host: int) -> None:
        if host > self.largest:
            self.largest = host
            if self.on_state_size is not None:
                self.on_state_size(host)
        slots = [(s.id, s.generation, s.capacity, s.fd) for s in rank.slots if s.fd >= 0]
        if self.on_slots is not None and self.announced.get(rank.rank) != (announced := tuple(s[:2] for s in slots)):
            self.announced[rank.rank] = announced
            self.on_slots(worker.local_rank, rank.rank, slots)


class Progress(Protocol):
    """What the keeper tells of the workers' saves and restores (:class:`aelastic.agent.incidents.parent.Incidents`)."""

    def marked(self, local_rank: int, step: int) -> None: ...
    def restore_began(self) -> None: ...
    def restored(self, step: int, source: str) -> None: ...
    async def publish(self) -> None: ...


class Keeper:
    """The agent's in-memory checkpoints (see the module doc): a link service named ``checkpoint``. Open it with
    :func:`open_keeper`."""

    name: Final = "checkpoint"

    def __init__(
        self,
        tg: anyio.abc.TaskGroup,
        *,
        limit: int,
        directory: Path | None,
        persist_every: int,
        replicas: bool,
    ) -> None:
        self._tg = tg
        self.directory = directory
        self.persist_every = persist_every
        self.replicas_on = replicas
        self._held = Holdings(limit)
        self._round = _Round(NodePlan())
        self._secret: str | None = None
        self._endpoint: str | None = None
        self._persisting = _Queue()
        self._pushing = _Queue()
        self._counts = {"saves": 0, "loads": 0, "pushed": 0, "persisted": 0}
        self._standbys = _Standbys()
        self._commits = anyio.Event()  # set at the next commit
        self.progress: Progress | None = None  # told of saves and restores (the node's incident records)

    def __repr__(self) -> str:
        return f"<Keeper own={self._held.steps()} restore_step={self._round.plan.step} {self._held!r}>"

    @property
    def limit(self) -> int:
        """The bytes a rank may hold."""
        return self._held.limit

    def statistics(self) -> KeeperStatistics:
        c = self._counts
        return KeeperStatistics(self._held.steps(), self._held.steps(replicas=True), self._held.memory(), c["saves"],
                                c["loads"], c["pushed"], c["persisted"], self._round.plan.step,
                                self._endpoint)  # fmt: skip

    @property
    def secret(self) -> str | None:
        return self._secret

    def tell(
        self,
        state_size: Callable[[int], None],
        slots: Callable[[int, int, Sequence[tuple[int, int, int, int]]], None],
    ) -> None:
        """Tell the node's standbys of the saves from now on (see :class:`_Standbys`)."""
        self._standbys.on_state_size, self._standbys.on_slots = state_size, slots

    # --- the round ---------------------------------------------------------------------------------------------

    async def serve_replicas(self, host: str | None) -> None:
        """Listen for other agents' pushes and fetches on ``host`` (this node's address), once; nothing where
        replicas are off or the address is unknown."""
        if not self.replicas_on or host is None or self._endpoint is not None:
            return
        listener, self._endpoint = open_listener(host)
        self._tg.start_soon(serve, listener, self)
        logger.info("checkpoint replicas served at %s", self._endpoint)

    def inventory(self) -> Inventory:
        """Every complete checkpoint held (own and replicas), for this round's plan."""
        return Inventory(tuple(self._held.inventory()), self._endpoint, self._secret)

    def disk_inventory(self) -> list[Held]:
        """The checkpoint directory's newest complete step (empty without a directory)."""
        return [] if self.directory is None else newest_complete(self.directory)

    def adopt(self, plan: NodePlan, world: int, store: Store) -> None:
        """This node's part of the round's plan; ``world``: the round's world size (what saves are made in);
        ``store``: the round's store (the holders of every rank, for a load no plan foresaw)."""
        self._round.close()
        self._round = _Round(plan, world, store)
        self._secret = plan.secret or self._secret
        self._held.keep_up_to(None if plan.disk else plan.step)
        for saved, endpoint in plan.fetch.items():
            self._round.fetches[saved] = (anyio.Event(), [])
            self._tg.start_soon(self._fetch, saved, endpoint, plan.step)
        if plan.step is not None:
            where = "the checkpoint directory" if plan.disk else "memory"
            logger.info("checkpoints: this round restores step %d (world %d) from %s%s", plan.step, plan.world,
                        where, f"; fetching ranks {sorted(plan.fetch)}" if plan.fetch else "")  # fmt: skip

    async def restored(self, ranks: Collection[int]) -> None:
        """Return once each of ``ranks`` has committed a checkpoint in this round, so has restored its state and
        trained on (at once where the round restores nothing)."""
        while self._round.plan.step is not None and not self._round.committed.issuperset(ranks):
            await self._commits.wait()

    async def _fetch(self, saved: int, endpoint: str, step: int | None) -> None:
        done, errors = self._round.fetches[saved]
        try:
            assert step is not None

            async def slot_for(size: int) -> Slot:
                return await self._held.receiving(self._held.own, saved, size)

            slot, header = await fetch(endpoint, self._secret or "", saved, step, slot_for)
            self._held.own[saved].commit(slot, header, f"replica from {endpoint}")
            logger.info("checkpoints: fetched rank %d's step %d (%s) from %s", saved, step,
                        format_size(header.total), endpoint)  # fmt: skip
        except (ReplicaError, LinkRefusal, TooLarge) as exc:
            errors.append(str(exc))
            logger.warning("checkpoints: %s", exc)
        finally:
            done.set()

    # --- the link service ----------------------------------------------------------------------------------------

    async def handle(
        self, worker: WorkerProcess, op: str, message: Mapping[str, Any]
    ) -> tuple[dict[str, Any], Sequence[int]]:
        if op == "reserve":
            return await self._reserve(worker, int(message["size"]), message.get("mapped", {}))
        if op == "commit":
            reply = self._commit(worker, int(message["slot"]), int(message["step"]), int(message["size"]),
                                 int(message.get("host", 0)))  # fmt: skip
            if self.progress is not None:
                await self.progress.publish()  # an incident this step ended
            return reply
        if op == "loaded":  # a load's copies are over
            if self.progress is not None:
                self.progress.restored(int(message["step"]), str(message["source"]))
            return {}, ()
        if op == "point":  # the step this round restores, asked before a load that must know (dcp.load)
            return {"step": self._round.plan.step}, ()
        if op == "load":
            if self.progress is not None:
                self.progress.restore_began()
            rank = message.get("rank")
            return await self._load(worker.global_rank if rank is None else int(rank), worker.global_rank,
                                    metadata=bool(message.get("metadata")))  # fmt: skip
        raise LinkRefusal(f"no checkpoint operation {op!r}")

    async def _reserve(
        self, worker: WorkerProcess, size: int, mapped: Mapping[str, int]
    ) -> tuple[dict[str, Any], Sequence[int]]:
        try:
            self._held.check_size(size)
        except TooLarge as exc:
            raise LinkRefusal(str(exc)) from None
        rank = self._held.own.setdefault(worker.global_rank, RankSlots(worker.global_rank))
        slot = await self._held.free_slot(rank, size)
        await slot.ensure(size)
        slot.header, slot.writer = None, worker.pid
        reply = {"slot": slot.id, "generation": slot.generation, "capacity": slot.capacity,
                 "rank": worker.global_rank, "world": self._round.world}  # fmt: skip
        fresh = mapped.get(str(slot.id)) != slot.generation
        return reply, [slot.fd] if fresh else []

    def _commit(
        self, worker: WorkerProcess, slot_id: int, step: int, size: int, host: int
    ) -> tuple[dict[str, Any], Sequence[int]]:
        """Make ``slot_id`` the worker's rank's latest checkpoint; ``host``: the bytes of its tensors that live in
        host memory (a save's CPU tensors; 0 from DCP), which a replacement allocates again before it loads."""
        rank = self._held.own.get(worker.global_rank)
        slot = None if rank is None else next((s for s in rank.slots if s.id == slot_id), None)
        if rank is None or slot is None or slot.writer != worker.pid:
            raise LinkRefusal(f"slot {slot_id} was not reserved by this worker")
        try:
            header = slot.read_header()
        except LayoutError as exc:
            raise LinkRefusal(f"the checkpoint of step {step} is not complete: {exc}") from None
        if header.step != step or header.total != size or header.total > slot.capacity:
            raise LinkRefusal(f"the checkpoint's header (step {header.step}, {header.total} bytes) is not the one "
                              f"committed (step {step}, {size} bytes)")  # fmt: skip
        rank.commit(slot, header, "memory")
        self._counts["saves"] += 1
        self._round.committed.add(rank.rank)
        if self.progress is not None:
            self.progress.marked(worker.local_rank, step)
        self._commits.set()
        self._commits = anyio.Event()
        ahead = self._held.ahead(rank, slot.capacity)
        self._standbys.committed(worker, rank, host)
        if self._round.plan.replica_to is not None:
            self._pushing.ask(rank.rank, "replica")
        if not self._persisting.saved(rank.rank) and self.directory is not None and step % self.persist_every == 0:
            self._persisting.ask(rank.rank, f"step {step}")
        if ahead is None:
            return {}, ()
        return {"ahead": [ahead.id, ahead.generation, ahead.capacity]}, [ahead.fd]

    async def _load(self, rank: int, loader: int, *, metadata: bool) -> tuple[dict[str, Any], Sequence[int]]:
        """The checkpoint of the restore step that ``rank`` restores, for worker ``loader``; ``metadata``: what is
        only read for its metadata (a DCP load's other saved ranks), which another agent then sends without the
        data."""
        plan, fetches = self._round.plan, self._round.fetches
        if plan.step is None:
            return {"found": False}, ()
        saved = saved_rank(rank, plan.world)
        if plan.disk:
            assert self.directory is not None
            path = self.directory / file_name(plan.step, saved)
            self._counts["loads"] += 1
            return {"found": True, "path": str(path), "source": f"disk {path}"}, ()
        if saved not in fetches and self._held.holding(saved, plan.step) is None:
            if metadata:
                return await self._metadata(saved, plan.step)
            await self._fetch_unforeseen(saved, plan.step)
        fetching = fetches.get(saved)
        if fetching is not None:
            await fetching[0].wait()
            if fetching[1]:
                raise LinkRefusal(f"rank {saved}'s checkpoint of step {plan.step}: {fetching[1][0]}")
        held = self._held.holding(saved, plan.step)
        slot = None if held is None else held.at(plan.step)
        if held is None or slot is None or slot.header is None:
            raise LinkRefusal(f"rank {saved}'s checkpoint of step {plan.step} is not held by this agent")
        self._counts["loads"] += 1
        reply: dict[str, Any] = {"found": True, "size": slot.header.total, "source": held.source}
        if saved != loader or held is not self._held.own.get(saved):
            return reply, [slot.fd]
        # Slots its saves will write: it keeps them mapped (see the worker side).
        others = [s for s in held.slots if s is not slot and s.fd >= 0]
        reply.update(slot=slot.id, generation=slot.generation, capacity=slot.capacity,
                     others=[[s.id, s.generation, s.capacity] for s in others])  # fmt: skip
        return reply, [slot.fd, *(s.fd for s in others)]

    async def _holder(self, saved: int) -> str | None:
        """Another agent that holds ``saved``'s checkpoint of the restore step, as group rank 0 named it in the round
        store (a DCP load reads ranks that no node plan foresaw)."""
        now = self._round
        if now.store is None:
            return None
        if now.holders is None:
            try:
                now.holders = json.loads(await now.store.get(HOLDERS_KEY)) if await now.store.check(
                    [HOLDERS_KEY]) else {}  # fmt: skip
            except (StoreError, ValueError) as exc:
                logger.warning("checkpoints: the holders of this round's checkpoints could not be read: %s", exc)
                now.holders = {}
        endpoint = now.holders.get(str(saved))
        return None if endpoint == self._endpoint else endpoint

    async def _fetch_unforeseen(self, saved: int, step: int) -> None:
        endpoint = await self._holder(saved)
        if endpoint is not None and saved not in self._round.fetches:
            self._round.fetches[saved] = (anyio.Event(), [])
            await self._fetch(saved, endpoint, step)

    async def _metadata(self, saved: int, step: int) -> tuple[dict[str, Any], Sequence[int]]:
        """``saved``'s checkpoint of ``step`` without its data, from the agent that holds it (once a round)."""
        now = self._round
        endpoint = await self._holder(saved)
        if endpoint is None:
            raise LinkRefusal(f"rank {saved}'s checkpoint of step {step} is not held by this agent")
        fetched = now.metadata.get(saved)
        if fetched is None:
            fetched = now.metadata[saved] = _Metadata()
            try:
                fd, header = await fetch_metadata(endpoint, self._secret or "", saved, step)
                if now is not self._round:  # a new round began meanwhile: its plan, not this one, is restored
                    os.close(fd)
                    raise ReplicaError("a new rendezvous round began")
                fetched.fd, fetched.header = fd, header
                logger.info("checkpoints: fetched rank %d's metadata of step %d (%s, without its data) from %s", saved,
                            step, format_size(header.meta_size), endpoint)  # fmt: skip
            except ReplicaError as exc:
                fetched.error = str(exc)
                logger.warning("checkpoints: %s", exc)
            finally:
                fetched.done.set()
        await fetched.done.wait()
        if fetched.header is None:
            raise LinkRefusal(f"rank {saved}'s checkpoint of step {step}: {fetched.error}")
        self._counts["loads"] += 1
        return {"found": True, "size": fetched.header.total, "source": f"metadata from {endpoint}"}, [fetched.fd]

    # --- replicas (the server's side: replicas.ReplicaHolder) ------------------------------------------------------

    async def slot_to_receive(self, rank: int, size: int) -> Slot:
        try:
            return await self._held.receiving(self._held.replicas, rank, size)
        except TooLarge as exc:
            raise ReplicaError(str(exc)) from None

    def received(self, slot: Slot, header: Header, sender: str) -> None:
        replica = self._held.replicas[header.rank]
        replica.commit(slot, header, f"replica from {sender}")
        logger.debug("checkpoints: holding rank %d's step %d, a replica from %s", header.rank, header.step, sender)

    def slot_to_send(self, rank: int, step: int) -> Slot | None:
        return self._held.at(rank, step)

    async def _push_loop(self) -> None:
        while True:
            rank_id, _ = await self._pushing.next()
            successor, slot = self._round.plan.replica_to, self._held.latest(rank_id)
            if successor is None or slot is None or slot.header is None:
                continue
            header = slot.header
            with slot.reading() as read:
                try:
                    await push(successor, self._secret or "", slot, header, read)
                except ReplicaError as exc:
                    logger.warning("checkpoints: rank %d's step %d not replicated: %s", rank_id, header.step, exc)
                    continue
            self._counts["pushed"] += 1

    # --- persistence -------------------------------------------------------------------------------------------

    def persist(self, reason: str, *, after_next_save: bool = False) -> None:
        """Write every rank's latest checkpoint to the directory in the background (no directory: nothing);
        ``after_next_save``: each rank's once it saves again (after a failure: once the restart's workers restored
        and trained a step, so that the write, hundreds of megabytes, takes no CPU the restart's path needs)."""
        if self.directory is None:
            return
        for rank in self._held.own:
            if after_next_save:
                self._persisting.defer(rank, reason)
            else:
                self._persisting.ask(rank, reason)

    async def flush(self, reason: str) -> None:
        """:meth:`persist`, and wait until every write asked for is done (at the end of a run)."""
        self.persist(reason)
        await self._persisting.wait_settled()

    async def _persist_loop(self) -> None:
        while True:
            rank_id, reason = await self._persisting.next()
            directory, slot = self.directory, self._held.latest(rank_id)
            if directory is None or slot is None or slot.header is None:
                continue
            header = slot.header
            with slot.reading() as read:
                try:
                    path = await anyio.to_thread.run_sync(write_checkpoint, directory, slot.fd, header, read.stop)
                    await anyio.to_thread.run_sync(remove_older, directory, header.step)
                except CopyStopped:
                    continue  # a newer checkpoint wanted the slot: that one is written next time
                except OSError as exc:
                    logger.error("checkpoints: rank %d's step %d could not be written to %s (%s): %s; the "
                                 "directory's previous checkpoint is left as it was", rank_id, header.step,
                                 directory, reason, exc)  # fmt: skip
                    continue
            self._counts["persisted"] += 1
            logger.debug("checkpoints: rank %d's step %d written to %s (%s)", rank_id, header.step, path, reason)

    def close(self) -> None:
        """Release every memory file."""
        self._held.close()
        self._round.close()


@contextlib.asynccontextmanager
async def open_keeper(options: CheckpointOptions, *, nproc_per_node: int, multi_node: bool) -> AsyncIterator[Keeper]:
    """A :class:`Keeper` of ``options`` for ``nproc_per_node`` local ranks, for the body's length; its background
    jobs stop and its memory is released on exit. Replicas are pushed only in a job that may have other nodes
    (``multi_node``)."""
    directory = None if options.dir is None else Path(options.dir)
    async with anyio.create_task_group() as tg:
        keeper = Keeper(tg, limit=options.limit(nproc_per_node), directory=directory,
                        persist_every=options.persist_every, replicas=options.replicas and multi_node)  # fmt: skip
        tg.start_soon(keeper._persist_loop)
        tg.start_soon(keeper._push_loop)
        try:
            yield keeper
        finally:
            tg.cancel_scope.cancel()
            keeper.close()
