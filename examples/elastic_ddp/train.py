"""Elastic DDP training that resumes from its checkpoint after a crash and grows when a node joins.

A tiny regression model on synthetic data, trained with DistributedDataParallel over gloo. Rank 0 checkpoints
every ``--checkpoint-every`` steps; every worker the agent (re)starts resumes from the latest checkpoint. The
global batch of a step depends on the step alone and is split across the ranks, so the loss curve does not depend
on the world size, and a resumed run repeats the steps it lost with the same losses.

One node; the last worker crashes (SIGKILL) at step 12 and the job resumes from its step-10 checkpoint:

    aelastic run --standalone --nproc-per-node 2 --max-restarts 1 examples/elastic_ddp/train.py --crash-at-step 12

Scale-up, in two terminals: start a node, then a second one while the first trains (``--step-time`` slows the
training down enough to watch); the first node's workers restart and both nodes resume in a world of four:

    aelastic run --nnodes 1:2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:29400 \\
        --rdzv-id ddp-demo --rdzv-conf last_call_timeout=1 examples/elastic_ddp/train.py --step-time 0.5

The checkpoint lives in ``--checkpoint`` (default: one file per run id in the temporary directory; a path every
node can read when the nodes are separate machines). A run that finds a finished checkpoint resumes at its end.
"""

from __future__ import annotations

import argparse
import gc
import os
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

FEATURES = 8


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--steps", type=int, default=40, help="train until this step (default: 40)")
    parser.add_argument("--batch-size", type=int, default=32, help="global batch, split across ranks (default: 32)")
    parser.add_argument("--lr", type=float, default=0.05, help="SGD learning rate (default: 0.05)")
    parser.add_argument("--checkpoint-every", type=int, default=5, help="checkpoint period in steps (default: 5)")
    parser.add_argument("--checkpoint", type=Path, default=None, help="checkpoint file (default: per run id)")
    parser.add_argument("--step-time", type=float, default=0.0, help="simulated compute seconds per step")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: train on the GPU of the worker's local rank (default: cpu)")  # fmt: skip
    parser.add_argument("--backend", default="gloo", help="process group backend (default: gloo; nccl needs a GPU "
                        "per worker)")  # fmt: skip
    parser.add_argument("--crash-at-step", type=int, default=None,
                        help="in the first attempt, the last rank SIGKILLs itself at this step")  # fmt: skip
    args = parser.parse_args()
    if args.checkpoint is None:
        run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
        args.checkpoint = Path(tempfile.gettempdir()) / f"aelastic_ddp_{run_id}.pt"
    return args


def make_batch(step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step``: a noisy linear target, the same on every rank and in every attempt."""
    weights = torch.linspace(-1.0, 1.0, FEATURES).unsqueeze(1)
    generator = torch.Generator().manual_seed(step)
    x = torch.randn(batch_size, FEATURES, generator=generator)
    y = x @ weights + 0.1 * torch.randn(batch_size, 1, generator=generator)
    return x, y


def save_checkpoint(path: Path, state: dict[str, Any]) -> None:
    """Write to a temporary file, then rename it over the checkpoint: a crash mid-write leaves the old one whole."""
    tmp = path.with_name(path.name + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def main() -> None:
    args = parse_args()
    device = torch.device("cpu")
    if args.device == "cuda":  # the GPU of the worker's local rank, made current (as NCCL needs)
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
        torch.cuda.set_device(device)
    dist.init_process_group(args.backend)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(FEATURES, 16), nn.Tanh(), nn.Linear(16, 1)).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    step = 0
    if args.checkpoint.exists():
        # Every rank reads it before its first all-reduce, so rank 0 cannot overwrite it under a reader.
        state = torch.load(args.checkpoint, map_location=device, weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        step = state["step"]
        print(f"rank {rank} of {world_size}: resumed from step {step}, loss {state['loss']:.6f} "
              f"(restart {restart})", flush=True)  # fmt: skip
    else:
        print(f"rank {rank} of {world_size}: no checkpoint at {args.checkpoint}, starting at step 0", flush=True)
    ddp = DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)

    while step < args.steps:
        step += 1
        if step == args.crash_at_step and restart == "0":
            dist.barrier()  # every rank has logged (and checkpointed) the step before: the crash cuts no output short
            if rank == world_size - 1:
                print(f"rank {rank}: crashing at step {step} (SIGKILL)", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
        x, y = make_batch(step, args.batch_size)
        x, y = x.tensor_split(world_size)[rank].to(device), y.tensor_split(world_size)[rank].to(device)
        # This rank's share of the global mean: DDP averages gradients over ranks, so scale by the world size.
        squared_error = ((ddp(x) - y) ** 2).sum() / args.batch_size
        optimizer.zero_grad()
        (squared_error * world_size).backward()
        optimizer.step()
        time.sleep(args.step_time)

        loss = squared_error.detach()
        dist.all_reduce(loss)  # the global batch's mean squared error, for the log and the checkpoint
        if rank == 0:
            print(f"step {step} loss {loss.item():.6f} world_size {world_size}", flush=True)
            if step % args.checkpoint_every == 0 or step == args.steps:
                state = {"step": step, "loss": loss.item(), "model": model.state_dict()}
                save_checkpoint(args.checkpoint, {**state, "optimizer": optimizer.state_dict()})

    if rank == 0:
        print(f"finished at step {step}; checkpoint {args.checkpoint}", flush=True)
    # DDP holds the process group in reference cycles, which only the interpreter's final collection would free;
    # gloo's threads would then drop their last work's tensors while Python finalizes and abort the process
    # ("terminate called without an active exception", 1 run in 4 here, under torchrun too). Free it now, so that
    # destroying the group joins those threads while Python is alive.
    del ddp
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
