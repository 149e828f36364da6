"""DDP training that checkpoints in memory after every step and keeps its healthy workers: a crash costs the step it
interrupted, not the steps since the last checkpoint on disk, nor a reload from disk, nor the other workers'
processes.

    aelastic run --standalone --nproc-per-node 2 --max-restarts 1 --prewarm examples/checkpoint/train.py \\
        --crash-at-step 25

Each step ends with ``aelastic.checkpoint.save`` of the model, the optimizer and the step: a copy of their tensors
into memory that the worker's agent owns (about a memory copy's time; the agent keeps the last two steps per rank,
so the memory it takes is two copies of the state). A worker that starts after a failure loads the newest step that
every rank saved (``aelastic.checkpoint.load``, here into the model's own parameters) and goes on from there: the
losses are those of a run without the crash. With ``--checkpoint-dir DIR`` the agents also write the latest step
to ``DIR`` (every ``--checkpoint-persist-every`` steps, when a worker fails, at the end), and a job started again
(requeued, or on other nodes) resumes from it.

The training function is ``aelastic.worker.restartable``: when a worker fails, only it is replaced; the others keep
their processes (their imports, their memory, here their model's tensors) and call the function again in the new
round's world, which is why it loads its state at its top and builds its process group, model wrapper and optimizer
there. Run under torchrun or plain ``python``, the function runs once, as written, and ``aelastic.checkpoint``
says that it needs aelastic's agent.
"""

from __future__ import annotations

import argparse
import os
import signal
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import aelastic.checkpoint as ckpt
from aelastic.worker import restartable

FEATURES = 8


def make_batch(step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step``: a noisy linear target, the same on every rank and in every attempt."""
    weights = torch.linspace(-1.0, 1.0, FEATURES).unsqueeze(1)
    generator = torch.Generator().manual_seed(step)
    x = torch.randn(batch_size, FEATURES, generator=generator)
    return x, x @ weights + 0.1 * torch.randn(batch_size, 1, generator=generator)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--steps", type=int, default=40, help="train until this step (default: 40)")
    parser.add_argument("--batch-size", type=int, default=32, help="global batch, split across ranks (default: 32)")
    parser.add_argument("--step-time", type=float, default=0.0, help="simulated compute seconds per step")
    parser.add_argument("--crash-at-step", type=int, default=None,
                        help="in the first attempt, the last rank SIGKILLs itself at this step")  # fmt: skip
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: train on the GPU of the worker's local rank (default: cpu)")  # fmt: skip
    parser.add_argument("--backend", default="gloo", help="process group backend (default: gloo; nccl needs a GPU "
                        "per worker)")  # fmt: skip
    return parser.parse_args()


@restartable
def train(args: argparse.Namespace) -> None:
    """One round of training: called again, in this process, when another worker fails or the world changes."""
    device = torch.device("cpu")
    if args.device == "cuda":  # the GPU of the worker's local rank, made current (as NCCL needs)
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
        torch.cuda.set_device(device)
    dist.init_process_group(args.backend)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(FEATURES, 16), nn.Tanh(), nn.Linear(16, 1)).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    step = 0
    restored = ckpt.load(into={"model": model.state_dict()})  # the model's parameters, filled in place
    if restored is not None:
        optimizer.load_state_dict(restored["optimizer"])
        step = restored["step"]
        loaded = ckpt.last_loaded()
        print(f"rank {rank} of {world_size} (pid {os.getpid()}): restored step {step} from "
              f"{loaded and loaded.source} (restart {restart})", flush=True)  # fmt: skip
    else:
        print(f"rank {rank} of {world_size} (pid {os.getpid()}): starts", flush=True)
    ddp = DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)

    while step < args.steps:
        step += 1
        if step == args.crash_at_step and restart == "0" and rank == world_size - 1:
            print(f"rank {rank}: crashing at step {step} (SIGKILL)", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        x, y = make_batch(step, args.batch_size)
        x, y = x.tensor_split(world_size)[rank].to(device), y.tensor_split(world_size)[rank].to(device)
        squared_error = ((ddp(x) - y) ** 2).sum() / args.batch_size
        optimizer.zero_grad()
        (squared_error * world_size).backward()  # DDP averages gradients over the ranks
        optimizer.step()
        time.sleep(args.step_time)
        loss = squared_error.detach()
        dist.all_reduce(loss)
        ckpt.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}, step=step)
        if rank == 0:
            print(f"step {step} loss {loss.item():.6f} world_size {world_size}", flush=True)
    del ddp
    dist.destroy_process_group()


if __name__ == "__main__":
    train(parse_args())
