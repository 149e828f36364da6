"""A training loop that checkpoints and requeues on Slurm's notice, and resumes where it stopped.

Run by ``examples/slurm/requeue.sbatch`` (``TRAIN=`` there points to your own script); by hand:
``aelastic run --nproc-per-node 2 examples/slurm/requeue_train.py --checkpoint ckpt.pt``.

SIGUSR1 (forwarded by aelastic, or sent by Slurm to every process of the step) only sets a flag: the loop checks it
at the next step, and the ranks agree on it with an all-reduce (each saw the notice at a slightly different step).
Then rank 0 saves the checkpoint and runs ``scontrol requeue``; Slurm stops the job and starts it again later, with
``SLURM_RESTART_COUNT`` one higher, and this script resumes from the checkpoint. Outside Slurm it saves and exits.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import time
from pathlib import Path

import torch
import torch.distributed as dist

notice = False


def on_notice(signum: int, frame: object) -> None:
    global notice
    notice = True


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--checkpoint", type=Path, default=Path("checkpoint.pt"))
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--step-seconds", type=float, default=0.05, help="a stand-in for the real work")
    args = parser.parse_args()
    signal.signal(signal.SIGUSR1, on_notice)  # before anything slow: a notice must never find the default action

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    start = 0
    if args.checkpoint.exists():
        state = torch.load(args.checkpoint)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = state["step"]
    print(f"rank {rank}: job {os.environ.get('SLURM_JOB_ID')} run {os.environ.get('SLURM_RESTART_COUNT', '0')} "
          f"rendezvous {os.environ['TORCHELASTIC_RUN_ID']}: starting at step {start}", flush=True)  # fmt: skip

    for step in range(start, args.steps):
        flag = torch.tensor([1.0 if notice else 0.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item():
            if rank == 0:
                tmp = args.checkpoint.with_suffix(".tmp")
                torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}, tmp)
                os.replace(tmp, args.checkpoint)
                print(f"rank 0: notice received: checkpoint saved at step {step}", flush=True)
            dist.barrier()  # the checkpoint is complete before anyone goes
            if "SLURM_JOB_ID" not in os.environ:
                return
            if rank == 0:
                subprocess.run(["scontrol", "requeue", os.environ["SLURM_JOB_ID"]], check=True)
            time.sleep(3600)  # Slurm stops the job (SIGTERM) and queues it again
        x = torch.randn(16, 8)
        loss = model(x).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        for p in model.parameters():  # what DDP does, by hand
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()
        optimizer.step()
        if step % 10 == 0 and rank == 0:
            print(f"rank 0: step {step}", flush=True)
        time.sleep(args.step_seconds)
    print(f"rank {rank}: finished at step {args.steps}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
