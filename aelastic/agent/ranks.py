"""Assigning global and role ranks to the workers of every node (torch's ``_assign_worker_ranks``).

The arithmetic is pure (:func:`assign`); :func:`exchange_ranks` runs torch's O(n) store protocol around it: each
agent publishes its role and local world size under ``torchelastic/role_info/<group_rank>``, group rank 0 reads
them all, assigns in group-rank order and publishes ``torchelastic/assigned_ranks/<i>``; each agent reads its own.
With ``TORCH_ELASTIC_WORKER_IDENTICAL=1`` (every node runs the same role with the same number of workers) there
is no store traffic at all, unless the agents hold checkpoints for their workers.

The same two steps carry the in-memory checkpoints' round (:mod:`aelastic.agent.checkpoint.plan`): each agent's
inventory rides with its role, and group rank 0 decides the step the job restores from and tells each node its
part with its ranks; no extra round trip.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable, Sequence
from typing import NamedTuple

from ..store.api import Store
from .checkpoint.plan import HOLDERS_KEY, Held, Inventory, NodePlan, holders, node_plan, restore_point

__all__ = ["RankAssignment", "RoleInfo", "assign", "exchange_ranks"]


class RoleInfo(NamedTuple):
    role: str
    rank: int  # the node's group rank
    local_world_size: int


class RankAssignment(NamedTuple):
    """Where one node's workers sit: worker ``i`` is global rank ``base_global_rank + i``; ``restore``: this
    node's part of the round's checkpoint plan (``None`` when the agents hold no checkpoints)."""

    base_global_rank: int
    global_world_size: int
    base_role_rank: int
    role_world_size: int
    restore: NodePlan | None = None


def assign(infos: list[RoleInfo]) -> list[RankAssignment]:
    """Assignments for ``infos`` (one per node), in group-rank order."""
    ordered = sorted(infos, key=lambda i: i.rank)
    world = sum(i.local_world_size for i in ordered)
    role_sizes: dict[str, int] = {}
    for info in ordered:
        role_sizes[info.role] = role_sizes.get(info.role, 0) + info.local_world_size
    role_next: dict[str, int] = {}
    base = 0
    out = []
    for info in ordered:
        role_base = role_next.get(info.role, 0)
        out.append(RankAssignment(base, world, role_base, role_sizes[info.role]))
        role_next[info.role] = role_base + info.local_world_size
        base += info.local_world_size
    return out


async def exchange_ranks(
    store: Store,
    me: RoleInfo,
    group_world_size: int,
    inventory: Inventory | None = None,
    disk: Callable[[], Sequence[Held]] | None = None,
    *,
    identical: bool = False,
) -> RankAssignment:
    """Run the rank exchange for node ``me`` through the round's ``store``; ``inventory``: the checkpoints this
    node's agent holds (``None``: it holds none for its workers, and neither does any other node's); ``disk``: the
    checkpoint directory's newest complete step, looked at by group rank 0 only; ``identical``: torch's
    ``TORCH_ELASTIC_WORKER_IDENTICAL`` (every node the same workers: no exchange, unless checkpoints need one)."""
    if identical and inventory is None:
        world = group_world_size * me.local_world_size
        base = me.rank * me.local_world_size
        return RankAssignment(base, world, base, world)
    info: dict[str, object] = {"role": me.role, "rank": me.rank, "local_world_size": me.local_world_size}
    if inventory is not None:
        info["checkpoint"] = inventory.to_json()
    await store.set(f"torchelastic/role_info/{me.rank}", json.dumps(info))
    if me.rank == 0:
        raw = [
            json.loads(r)
            for r in await store.multi_get([f"torchelastic/role_info/{i}" for i in range(group_world_size)])
        ]
        infos = [RoleInfo(r["role"], r["rank"], r["local_world_size"]) for r in raw]
        assignments = assign(infos)
        restores: list[object] = [None] * group_world_size
        point = None
        if inventory is not None:
            inventories = [Inventory.from_json(r.get("checkpoint", {})) for r in raw]
            point = restore_point(inventories, () if disk is None else disk())
            secret = next((i.secret for i in inventories if i.secret), None) or secrets.token_hex(16)
            restores = [
                node_plan(point, inventories, i, range(a.base_global_rank, a.base_global_rank + n), secret).to_json()
                for i, (a, n) in enumerate(zip(assignments, (info.local_world_size for info in infos), strict=True))
            ]
        keys = [f"torchelastic/assigned_ranks/{i}" for i in range(group_world_size)]
        values = [json.dumps([a.base_global_rank, a.global_world_size, a.base_role_rank, a.role_world_size, restore])
                  for a, restore in zip(assignments, restores, strict=True)]  # fmt: skip
        if inventory is not None and point is not None and not point.disk:
            keys.append(HOLDERS_KEY)  # for a load of a rank a node neither holds nor was told to fetch (DCP's)
            values.append(json.dumps(holders(point, inventories)))
        await store.multi_set(keys, values)
    base, world, role_base, role_world, restore = json.loads(await store.get(f"torchelastic/assigned_ranks/{me.rank}"))
    return RankAssignment(base, world, role_base, role_world, None if restore is None else NodePlan.from_json(restore))
