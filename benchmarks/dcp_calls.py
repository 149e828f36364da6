"""One ``dcp.save`` call of the FSDP2 example's state (``examples/fsdp2``: two ranks, 128 MiB of shards each), timed in
the same two worker processes, the variants taken in turn each step: what part of a save is DCP's own work, what
part aelastic's writer adds, beside the raw copy of the same bytes. Run by ``benchmarks/frameworks.py`` (``--part
blocks``); as a worker of ``aelastic run --standalone --nproc-per-node 2``, it prints one JSON line (rank 0): each
variant's median, in seconds, the slower rank's.

* ``raw copy``: one ``copy_`` of the rank's bytes into touched memory, both ranks at once;
* ``DCP floor``: ``dcp.save(..., use_collectives=False)`` into :class:`CopyOnlyWriter`, a storage writer that copies
  each item into memory it keeps and does nothing else: what any DCP storage writer pays (the state dict's
  collection, DCP's planning, its ``resolve_data`` and ``torch.save`` of each non-tensor value, its barrier);
* ``aelastic``: ``dcp.save(..., use_collectives=False)`` through ``aelastic.checkpoint.StorageWriter`` with
  ``aelastic.checkpoint.SavePlanner`` (the example's way); ``aelastic, DCP's planner``: with DCP's default planner;
  ``aelastic collectives``: with DCP's collectives, beside ``DCP floor collectives``, the copy-only writer with them.

Each variant's time includes ``get_state_dict`` (the example's ``state_of``), as a training step's does.
"""

from __future__ import annotations

import io
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples" / "fsdp2"))
from train import batch, build, state_of

import aelastic.checkpoint

_KEPT: dict[Any, torch.Tensor] = {}  # the copy-only writer's memory, by item: allocated and touched once


class CopyOnlyWriter(StorageWriter):
    """A DCP storage writer that copies each tensor into memory of its own and keeps each non-tensor value."""

    def reset(self, checkpoint_id: Any = None) -> None:
        pass

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        pass

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        results = []
        for item in plan.items:
            value = planner.resolve_data(item)
            if isinstance(value, torch.Tensor):
                kept = _KEPT.get(item.index)
                if kept is None:
                    kept = _KEPT[item.index] = torch.zeros_like(value, device="cpu")
                kept.copy_(value)
                size = value.numel() * value.element_size()
            else:
                assert isinstance(value, io.BytesIO)
                _KEPT[item.index] = torch.frombuffer(bytearray(value.getbuffer()), dtype=torch.uint8)
                size = len(value.getbuffer())
            results.append(WriteResult(index=item.index, size_in_bytes=size, storage_data=None))
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        pass

    def storage_meta(self) -> StorageMeta | None:
        return None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return True


def worker(saves: int) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model, optimizer = build(256)  # 128 MiB of shards a rank, as the benchmark's FSDP2 jobs
    source = torch.rand(128 << 18)
    target = torch.zeros_like(source)

    def raw(step: int) -> None:
        target.copy_(source)

    def floor(step: int, together: bool = False) -> None:
        dcp.save(state_of(model, optimizer, step), storage_writer=CopyOnlyWriter(), use_collectives=together)

    planner = aelastic.checkpoint.SavePlanner()

    def ours(step: int, together: bool = False, planned: bool = True) -> None:
        writer = aelastic.checkpoint.StorageWriter(step=step)
        dcp.save(state_of(model, optimizer, step), storage_writer=writer, use_collectives=together,
                 planner=planner if planned else None)  # fmt: skip

    variants = {"raw copy": raw, "DCP floor": floor, "aelastic": ours,
                "aelastic, DCP's planner": lambda step: ours(step, planned=False),
                "DCP floor collectives": lambda step: floor(step, together=True),
                "aelastic collectives": lambda step: ours(step, together=True)}  # fmt: skip
    times: dict[str, list[float]] = {name: [] for name in variants}
    for step in range(saves + 3):  # three rounds to warm up: the memory allocated, DCP's first-call costs
        x, y = batch(step, rank, world)
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        for name, call in variants.items():
            dist.barrier()
            began = time.perf_counter()
            call(step)
            if step >= 3:
                times[name].append(time.perf_counter() - began)
    medians = torch.tensor([statistics.median(times[name]) for name in variants], dtype=torch.float64)
    dist.all_reduce(medians, op=dist.ReduceOp.MAX)
    if rank == 0:
        print(json.dumps(dict(zip(variants, medians.tolist(), strict=True))), flush=True)
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # see examples/fsdp2/train.py's end: fully_shard's modules outlive every reference


if __name__ == "__main__":
    worker(int(sys.argv[1]) if len(sys.argv) > 1 else 15)
