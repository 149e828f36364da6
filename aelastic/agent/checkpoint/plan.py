"""Where a job restores from: a pure function of what every agent holds, decided once per rendezvous round.

Every agent describes the checkpoints it holds (:class:`Inventory`: its own ranks' and the replicas it keeps of
another node's) and group rank 0 gathers them with the rank exchange (:mod:`aelastic.agent.ranks`). The job restores
from the newest step that *every* rank of that step's world holds somewhere (:func:`restore_point`): ranks of a
data-parallel job cannot be more than one step apart (each step ends in a collective that all of them join, and a
rank saves before its next collective), and each agent keeps a rank's last two checkpoints, so that step exists
after any worker's failure. When a node was lost, its ranks are found in the replica another node kept.

When no step is whole in memory, or the checkpoint directory holds a newer complete one (group rank 0 looks), the
job restores from the directory. Each node is then told (:func:`node_plan`) the step, and for each saved rank its
new workers need that it does not hold, the endpoint of an agent that does. A worker whose world size changed
loads the rank it had, if that rank existed, else ``rank % saved world`` (right for replicated states; DCP
reshards sharded ones). Each node is also told where to push the replicas of its own ranks: the next node's agent.

Pure: no I/O, no clock; the agent encodes these as JSON in the round store.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

__all__ = [
    "HOLDERS_KEY",
    "Held",
    "Inventory",
    "NodePlan",
    "RestorePoint",
    "holders",
    "node_plan",
    "restore_point",
    "saved_rank",
]

# The round store's key of every saved rank's holder (:func:`holders`), for loads no node plan foresaw.
HOLDERS_KEY: Final = "aelastic/checkpoint/holders"


@dataclass(frozen=True, slots=True)
class Held:
    """One complete checkpoint an agent holds: saved by ``rank`` of a world of ``world``, ``size`` bytes."""

    rank: int
    step: int
    world: int
    size: int


@dataclass(frozen=True, slots=True)
class Inventory:
    """What one agent holds, where other agents can fetch from it (``None``: they cannot), and the job's secret
    for those transfers if it has one."""

    held: tuple[Held, ...] = ()
    endpoint: str | None = None
    secret: str | None = None

    def to_json(self) -> dict[str, Any]:
        held = [[h.rank, h.step, h.world, h.size] for h in self.held]
        return {"held": held, "endpoint": self.endpoint, "secret": self.secret}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Inventory:
        held = tuple(Held(int(r), int(s), int(w), int(n)) for r, s, w, n in data.get("held", ()))
        endpoint, secret = data.get("endpoint"), data.get("secret")
        return cls(held, None if endpoint is None else str(endpoint), None if secret is None else str(secret))


@dataclass(frozen=True, slots=True)
class RestorePoint:
    """The step the job restores from, its world size, and the nodes (indices into the inventories) holding each
    of its ranks; ``disk``: it is the checkpoint directory's (no node holds it)."""

    step: int
    world: int
    holders: Mapping[int, tuple[int, ...]]
    disk: bool = False


@dataclass(frozen=True, slots=True)
class NodePlan:
    """What one node is told: the step (``None``: there is no complete one), its world, where to fetch the saved
    ranks its workers need and it does not hold (saved rank -> endpoint), whether the step is the checkpoint
    directory's, the job's secret for transfers between agents, and where to push replicas of its own ranks (the
    next node's agent; ``None``: nowhere)."""

    step: int | None = None
    world: int = 0
    fetch: Mapping[int, str] = field(default_factory=dict)
    disk: bool = False
    secret: str | None = None
    replica_to: str | None = None

    def to_json(self) -> dict[str, Any]:
        fetch = {str(r): e for r, e in self.fetch.items()}
        return {"step": self.step, "world": self.world, "fetch": fetch, "disk": self.disk, "secret": self.secret,
                "replica_to": self.replica_to}  # fmt: skip

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> NodePlan:
        step, secret, replica_to = data.get("step"), data.get("secret"), data.get("replica_to")
        fetch = {int(r): str(e) for r, e in data.get("fetch", {}).items()}
        return cls(
            None if step is None else int(step), int(data.get("world", 0)), fetch, bool(data.get("disk")),
            None if secret is None else str(secret), None if replica_to is None else str(replica_to),
        )  # fmt: skip


def restore_point(inventories: Sequence[Inventory], disk: Sequence[Held] = ()) -> RestorePoint | None:
    """The newest step whose every rank some inventory holds, or the directory's complete step ``disk`` if it is
    newer; ``None`` if there is neither."""
    memory = _memory_point(inventories)
    if disk and (memory is None or disk[0].step > memory.step):
        return RestorePoint(disk[0].step, disk[0].world, {}, disk=True)
    return memory


def _memory_point(inventories: Sequence[Inventory]) -> RestorePoint | None:
    holders: dict[int, dict[int, list[int]]] = {}  # step -> rank -> nodes
    worlds: dict[int, set[int]] = {}
    for node, inventory in enumerate(inventories):
        for held in inventory.held:
            holders.setdefault(held.step, {}).setdefault(held.rank, []).append(node)
            worlds.setdefault(held.step, set()).add(held.world)
    for step in sorted(holders, reverse=True):
        if len(worlds[step]) != 1:
            continue  # two worlds saved the same step number (a job started over): neither is whole for sure
        (world,) = worlds[step]
        ranks = holders[step]
        if all(rank in ranks for rank in range(world)):
            return RestorePoint(step, world, {rank: tuple(ranks[rank]) for rank in range(world)})
    return None


def saved_rank(rank: int, saved_world: int) -> int:
    """The saved rank that global rank ``rank`` restores (see the module doc)."""
    return rank if rank < saved_world else rank % saved_world


def node_plan(
    point: RestorePoint | None, inventories: Sequence[Inventory], node: int, ranks: Iterable[int], secret: str
) -> NodePlan:
    """The plan of ``node`` (an index into ``inventories``), whose workers have the global ``ranks``; ``secret``:
    the job's secret for transfers between agents (the first inventory's that has one, else a new one)."""
    successor = inventories[(node + 1) % len(inventories)].endpoint if len(inventories) > 1 else None
    if point is None:
        return NodePlan(secret=secret, replica_to=successor)
    if point.disk:
        return NodePlan(point.step, point.world, disk=True, secret=secret, replica_to=successor)
    fetch: dict[int, str] = {}
    for rank in ranks:
        saved = saved_rank(rank, point.world)
        nodes = point.holders[saved]
        if node in nodes or saved in fetch:
            continue
        remote = [inventories[n].endpoint for n in nodes if inventories[n].endpoint is not None]
        if remote:
            fetch[saved] = str(remote[0])
    return NodePlan(point.step, point.world, fetch, secret=secret, replica_to=successor)


def holders(point: RestorePoint, inventories: Sequence[Inventory]) -> dict[str, str]:
    """An endpoint of an agent holding each saved rank of ``point`` (ranks without a reachable holder left out)."""
    found = {}
    for rank, nodes in point.holders.items():
        endpoint = next((inventories[n].endpoint for n in nodes if inventories[n].endpoint is not None), None)
        if endpoint is not None:
            found[str(rank)] = endpoint
    return found
