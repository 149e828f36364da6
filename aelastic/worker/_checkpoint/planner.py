"""A ``torch.distributed.checkpoint`` save planner that plans a state's layout once.

DCP's default planner plans every save from scratch: for each tensor of the state, the item it writes, and for a
DTensor the shape and place of this rank's shard (``compute_local_shape_and_global_offset``); then, once it has the
ranks' plans, the global plan and metadata. A training job saves the same layout every time: the same keys, the same
shapes, shardings and dtypes, new values. :class:`SavePlanner` keeps the last save's plans and reuses them while
the layout is the same, which it checks key by key (a DTensor's spec, a tensor's shape, dtype and flags, a
non-tensor value's key): the planning of a large model's save, which grows with its number of tensors, then costs
that check. A non-tensor value (an optimizer's learning rate, a step count) is written as ``torch.save`` bytes: the
bytes of a plain value (numbers, strings, ``None``, lists and tuples of them) are kept and written again while the
value stays equal. Everything else is DCP's default planner's: each tensor is resolved at every save.

::

    planner = aelastic.checkpoint.SavePlanner()          # once; then at every save:
    dcp.save(state, storage_writer=aelastic.checkpoint.StorageWriter(step=step), planner=planner)

The global plan is kept for a save without collectives (``use_collectives=False``), which plans it from this rank's
plan alone; with DCP's collectives each save's global plan is the coordinator's, made from the plans it gathers.
"""

from __future__ import annotations

import io
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor

__all__ = ["SavePlanner"]


def _layout(state: dict[str, Any]) -> tuple[Any, ...] | None:
    """What the plan of ``state`` (DCP's flattened state dict) depends on, key by key; ``None``: a value whose plan
    this cannot vouch for (a tensor subclass other than DTensor and Parameter, or an object with a write-items hook of
    its own)."""
    entries: list[Any] = []
    for key, value in state.items():
        if isinstance(value, DTensor):
            local = value._local_tensor
            entries.append((key, value._spec, local.requires_grad, local.layout, local.is_pinned()))
        elif type(value) in (torch.Tensor, torch.nn.Parameter):
            entries.append((key, value.shape, value.dtype, value.requires_grad, value.layout, value.is_pinned()))
        elif isinstance(value, torch.Tensor) or hasattr(value, "__create_write_items__"):
            return None
        else:
            entries.append(key)  # written as bytes, whatever it holds
    return tuple(entries)


def _plain(value: Any) -> Any:
    """``value`` with the type of each of its parts, where it is plain (see the module doc); else ``None``."""
    if type(value) in (int, float, bool, str, type(None)):
        return type(value), value
    if type(value) in (list, tuple):
        parts = [_plain(part) for part in value]
        return None if None in parts else (type(value), tuple(parts))
    return None


class SavePlanner(DefaultSavePlanner):
    """DCP's default save planner, its plans kept while the state's layout stays the same (see the module doc).
    Create it once and pass it to every ``dcp.save``/``dcp.async_save``; it takes DCP's default planner's
    arguments."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._layout: tuple[Any, ...] | None = None
        self._local: SavePlan | None = None
        self._global: tuple[list[SavePlan], Metadata] | None = None
        self._bytes: dict[str, tuple[Any, bytes]] = {}  # a plain value's key: the value, its bytes

    def set_up_planner(
        self, state_dict: dict[str, Any], storage_meta: StorageMeta | None = None, is_coordinator: bool = False
    ) -> None:
        super().set_up_planner(state_dict, storage_meta, is_coordinator)
        layout = _layout(self.state_dict)
        if layout is None or (layout, self.mappings, is_coordinator) != self._layout:
            self._local = self._global = None
        self._layout = None if layout is None else (layout, self.mappings, is_coordinator)

    def create_local_plan(self) -> SavePlan:
        if self._local is None:  # the layout changed, or it is one set_up_planner could not vouch for
            self._local = super().create_local_plan()
        self.plan = self._local
        return self._local

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        if len(all_plans) != 1 or all_plans[0] is not self._local:  # the coordinator's, from the plans gathered
            return super().create_global_plan(all_plans)
        if self._global is None:  # a save without collectives: planned from this rank's plan alone
            self._global = super().create_global_plan(all_plans)
        self.global_plan, self.metadata = self._global
        return self._global

    def transform_object(self, write_item: WriteItem, object: Any) -> Any:
        plain = _plain(object) if write_item.type == WriteItemType.BYTE_IO else None
        if plain is None:
            return super().transform_object(write_item, object)
        key = write_item.index.fqn
        kept = self._bytes.get(key)
        if kept is None or kept[0] != plain:
            kept = self._bytes[key] = plain, super().transform_object(write_item, object).getvalue()
        return io.BytesIO(kept[1])
