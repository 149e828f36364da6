"""FSDP2 (``fully_shard``) with ``torch.distributed.checkpoint`` into the agents' memory: every step saved by
``dcp.save`` through aelastic's storage writer, restored by ``dcp.load`` through its reader, resharded by DCP's
planner when the world's size changed (docs/howto/fsdp2.md).

    aelastic run --standalone --nproc-per-node 2 --max-restarts 1 examples/fsdp2/train.py --crash-at-step 12

A small regression model, each linear layer sharded across the ranks (CPU, gloo; NCCL on GPUs). Every step trains
on the same global batch of 24 rows whatever the world's size (each rank takes its share), so the loss curve of a
world that shrank or grew goes on as the first world's would have. ``--crash-at-step N``: rank ``--crash-rank``
raises during step N of the first attempt. A restarted worker prints ``restored step S from memory`` (or ``...
from replica from HOST:PORT`` when a lost node's shards came from the replica another agent kept, ``... from disk
DIR``); rank 0 prints each step's loss and a digest of the final parameters. ``--async-save`` saves with
``dcp.async_save`` (the copy into memory happens in the background; the next save waits for it).

Each save is ``dcp.save(..., use_collectives=False)``: each rank plans alone and the ranks meet in one barrier,
instead of DCP's four exchanges of plans and results (see docs/howto/fsdp2.md); ``--save-collectives`` saves with
DCP's default instead. The planner is ``aelastic.checkpoint.SavePlanner``, which plans the state's layout once.

``--save-every N``: a checkpoint every N steps (1; 0: none); ``--ballast-mib`` and ``--step-time`` make the
checkpoint and the step larger (benchmarks/frameworks.py). Under torchrun (no agent), ``--checkpoint-dir DIR`` is
DCP's own recipe: ``FileSystemWriter`` every N steps, read back on a restart; under aelastic the agents persist
their memory there instead.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard

import aelastic.checkpoint

GLOBAL_BATCH = 24  # divisible by every world size from 1 to 4: the same rows per step in each


def batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of the step's global batch."""
    x = torch.randn(GLOBAL_BATCH, 16, generator=torch.Generator().manual_seed(step))
    y = torch.sin(x.sum(dim=1, keepdim=True))
    share = GLOBAL_BATCH // world
    return x[rank * share : (rank + 1) * share], y[rank * share : (rank + 1) * share]


class Net(torch.nn.Module):
    """The regression network, beside weights that do not train (as an embedding's rows no batch looks up; FSDP2
    gathers a module's weights only when it runs): a larger checkpoint, the same arithmetic and communication. The
    weights are a matrix of 1 MiB rows, as an embedding's are: DCP's planner takes time in the length of a sharded
    dimension (an arange of it)."""

    def __init__(self, ballast_mib: int) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)
        )
        self.frozen = torch.nn.Module()
        self.frozen.register_parameter(
            "ballast", torch.nn.Parameter(torch.zeros(ballast_mib * 256, 1024), requires_grad=False)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def build(ballast_mib: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = Net(ballast_mib)
    for layer in model.net:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    if ballast_mib:
        fully_shard(model.frozen)
    fully_shard(model)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def state_of(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> dict[str, Any]:
    model_state, optimizer_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optim": optimizer_state, "step": torch.tensor(step)}


def restore(model: torch.nn.Module, optimizer: torch.optim.Optimizer, directory: str | None) -> int:
    """The step to train next: after the restored one, or 0."""
    if aelastic.checkpoint.available():  # under aelastic: the agents' memory (or their replicas, or --checkpoint-dir)
        if aelastic.checkpoint.step_to_restore() is None:
            return 0
        reader: Any = aelastic.checkpoint.StorageReader()
    elif directory is not None and os.path.exists(os.path.join(directory, ".metadata")):
        reader = dcp.FileSystemReader(directory)  # torchrun: DCP's own files
    else:
        return 0
    state = state_of(model, optimizer, -1)
    dcp.load(state, storage_reader=reader)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    step = int(state["step"])
    loaded = aelastic.checkpoint.last_loaded() if aelastic.checkpoint.available() else None
    source = loaded.source if loaded is not None else f"disk {directory}"
    print(f"rank {dist.get_rank()} of {dist.get_world_size()}: restored step {step} from {source}", flush=True)
    return step + 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--crash-at-step", type=int, default=None)
    parser.add_argument("--crash-rank", type=int, default=1)
    parser.add_argument("--async-save", action="store_true")
    parser.add_argument("--save-collectives", action="store_true", help="dcp.save with DCP's collectives")
    parser.add_argument("--step-time", type=float, default=0.0, help="seconds each step sleeps (a longer job)")
    parser.add_argument("--ballast-mib", type=int, default=0, help="MiB of frozen weights (a larger checkpoint)")
    parser.add_argument("--save-every", type=int, default=1, help="steps between checkpoints; 0: none")
    parser.add_argument("--checkpoint-dir", default=None, help="without an agent: DCP's files (torchrun's recipe)")
    parser.add_argument("--step-log", default=None, help="rank 0 appends each step's end here (the benchmark's)")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    model, optimizer = build(args.ballast_mib)
    start = restore(model, optimizer, args.checkpoint_dir)
    pending: Future[Any] | None = None
    # An async save runs DCP's collectives in a thread: on a group of their own, not beside the training's.
    saving = dist.new_group(backend="gloo") if args.async_save else None
    # DCP plans each save from scratch; aelastic's planner plans the state's layout once (the same at every step).
    planner = aelastic.checkpoint.SavePlanner() if aelastic.checkpoint.available() else None
    state: dict[str, Any] = {}
    for step in range(start, args.steps):
        x, y = batch(step, rank, world)
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        # After the gradients' reduce-scatter: every rank has finished the step before, its save included.
        if first_attempt and step == args.crash_at_step and rank == args.crash_rank:
            raise RuntimeError(f"a fault at step {step}")
        optimizer.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        if rank == 0:
            print(f"step {step} loss {float(mean) / world:.9f}", flush=True)
        time.sleep(args.step_time)
        if pending is not None:
            pending.result()  # one save in flight at a time
        if args.save_every and (step + 1) % args.save_every == 0:
            state = state_of(model, optimizer, step)
            if aelastic.checkpoint.available():
                writer = aelastic.checkpoint.StorageWriter(step=step)
                together = args.save_collectives
                if args.async_save:
                    pending = dcp.async_save(
                        state, storage_writer=writer, planner=planner, process_group=saving, use_collectives=together
                    )
                else:
                    dcp.save(state, storage_writer=writer, planner=planner, use_collectives=together)
            elif args.checkpoint_dir is not None:
                dcp.save(state, checkpoint_id=args.checkpoint_dir)
        if rank == 0 and args.step_log:  # the benchmark's, run from the repository
            from benchmarks.steplog import log_step

            log_step(args.step_log, step)
    if pending is not None:
        pending.result()
    full, _ = get_state_dict(model, optimizer)
    digest = hashlib.sha256()
    for name in sorted(full):
        digest.update(full[name].full_tensor().detach().numpy().tobytes())
    if rank == 0:
        print(f"final parameters {digest.hexdigest()[:16]} after step {args.steps - 1}", flush=True)
    dist.destroy_process_group()
    # fully_shard's modules, once they ran, outlive every reference here (torch 2.13: a cycle through tensors that
    # torch's C++ side holds, which the garbage collector cannot see), and with them the process group and gloo's
    # threads. One that lets go of a collective's tensors while the interpreter tears down aborts the process
    # ("terminate called without an active exception", under torchrun too). Nothing else is left to end: exit here.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
