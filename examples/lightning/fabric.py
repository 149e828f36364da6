"""A Lightning Fabric loop with in-memory checkpoints and survivors: every step saved into the agent's memory, and on
a fault only the failed worker's process replaced; the others call the loop again in their processes
(``aelastic.worker.restartable``; docs/howto/lightning.md).

    aelastic run --standalone --nproc-per-node 2 --max-restarts 1 examples/lightning/fabric.py --crash-at-step 25

A small regression model (fixed seeds, CPU, DDP over gloo). ``--crash-at-step N``: rank ``--crash-rank`` raises at
step N of the first attempt; every rank then prints ``rank R (pid P): restored step S from memory`` (the survivor
with the pid it had), and rank 0 prints a digest of the final parameters: a run with a fault and one without print
the same.

For the benchmark (benchmarks/frameworks.py): ``--ballast-mib`` (a larger checkpoint), ``--step-time`` (a longer
step), ``--save-every N`` (0: no checkpoint); under torchrun, ``--checkpoint-dir DIR`` is Fabric's own recipe
(``fabric.save`` every N steps, ``fabric.load`` on a restart).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import time

import lightning as L
import torch

import aelastic.checkpoint
from aelastic.integrations.lightning import load_state, save_state
from aelastic.worker import restartable

GLOBAL_BATCH = 32


def batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of the step's global batch: the same rows whatever the world's size."""
    generator = torch.Generator().manual_seed(step)
    x = torch.randn(GLOBAL_BATCH, 16, generator=generator)
    y = x.sum(dim=1, keepdim=True).sin() + 0.1 * torch.randn(GLOBAL_BATCH, 1, generator=generator)
    return x.tensor_split(world)[rank], y.tensor_split(world)[rank]


@restartable
def train(args: argparse.Namespace) -> None:
    """One round: called again, in this process, when another worker fails or the world changes."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    fabric = L.Fabric(accelerator="cpu", strategy="ddp", devices=local,
                      num_nodes=int(os.environ.get("WORLD_SIZE", "1")) // local)  # fmt: skip
    fabric.launch()  # the process group of this round (from RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    # Weights that do not train (as a frozen embedding): a larger checkpoint, the same arithmetic.
    model.register_parameter("ballast", torch.nn.Parameter(torch.zeros(args.ballast_mib * 2**18), requires_grad=False))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model, optimizer = fabric.setup(model, optimizer)
    state = {"model": model, "optimizer": optimizer, "step": -1}
    who = f"rank {fabric.global_rank} (pid {os.getpid()})"
    disk = None if args.checkpoint_dir is None else os.path.join(args.checkpoint_dir, "state.ckpt")
    if load_state(state):
        loaded = aelastic.checkpoint.last_loaded()
        print(f"{who}: restored step {state['step']} from {loaded and loaded.source}", flush=True)
    elif disk is not None and not aelastic.checkpoint.available() and os.path.exists(disk):
        fabric.load(disk, state)  # torchrun's recipe: Fabric's own file
        print(f"{who}: restored step {state['step']} from disk", flush=True)
    else:
        print(f"{who}: starts", flush=True)
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    for step in range(state["step"] + 1, args.steps):
        x, y = batch(step, fabric.global_rank, fabric.world_size)
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        fabric.backward(loss)
        # After the gradients' all-reduce: every rank has finished the step before, its save included.
        if first_attempt and step == args.crash_at_step and fabric.global_rank == args.crash_rank:
            raise RuntimeError(f"a fault at step {step}")
        optimizer.step()
        time.sleep(args.step_time)
        state["step"] = step
        if args.save_every and (step + 1) % args.save_every == 0:
            if aelastic.checkpoint.available():
                save_state(state, step=step)
            elif disk is not None:
                fabric.save(disk, state)
        if fabric.global_rank == 0 and args.step_log:  # the benchmark's, run from the repository
            from benchmarks.steplog import log_step

            log_step(args.step_log, step)
    if fabric.global_rank == 0:
        digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
        print(f"final parameters {digest[:16]} after step {args.steps - 1}", flush=True)
    torch.distributed.destroy_process_group()  # else gloo's threads may abort the interpreter's teardown


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--crash-at-step", type=int, default=None)
    parser.add_argument("--crash-rank", type=int, default=1)
    parser.add_argument("--ballast-mib", type=int, default=0, help="MiB of frozen weights (a larger checkpoint)")
    parser.add_argument("--step-time", type=float, default=0.0, help="seconds each step sleeps (a larger model)")
    parser.add_argument("--save-every", type=int, default=1, help="steps between checkpoints; 0: none")
    parser.add_argument("--checkpoint-dir", default=None, help="without an agent: Fabric's own file there")
    parser.add_argument("--step-log", default=None, help="rank 0 appends each step's end here (the benchmark's)")
    train(parser.parse_args())


if __name__ == "__main__":
    main()
