"""The learning-rate sweep that ``asyncio_orchestrator.py`` and ``trio_orchestrator.py`` run, minus their I/O.

:func:`train` is what every worker runs: a small regression with DistributedDataParallel over gloo that streams one
JSON line per step to the orchestrator's progress endpoint. :class:`Progress` is the orchestrator's bookkeeping of
those lines. The orchestrators ship :func:`train` to the workers by value (``cloudpickle.register_pickle_by_value``),
so the workers need not find this file on their ``sys.path``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import time
from typing import Any

LEARNING_RATES = (0.01, 0.1)  # one job per learning rate, launched at the same time
NPROC = 2  # workers per job


def parse_args(description: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--steps", type=int, default=50, help="training steps per job (default: 50)")
    parser.add_argument("--step-time", type=float, default=0.05, help="simulated compute seconds per step")
    parser.add_argument("--cancel-after", type=float, default=None, metavar="SECONDS",
                        help="a time budget: cancel the sweep SECONDS after it starts")  # fmt: skip
    return parser.parse_args()


def train(lr: float, steps: int, step_time: float, progress_port: int) -> float:
    """One worker of one job; returns its last loss. Imports torch here: the orchestrator itself never does."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    generator = torch.Generator().manual_seed(rank)  # each rank its own shard of the data
    x = torch.randn(64, 4, generator=generator)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    with socket.create_connection(("127.0.0.1", progress_port)) as progress:
        for step in range(1, steps + 1):
            loss = torch.nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            time.sleep(step_time)
            line = {"lr": lr, "rank": rank, "pid": os.getpid(), "step": step, "steps": steps, "loss": loss.item()}
            progress.sendall(json.dumps(line).encode() + b"\n")
    # DDP's reference cycles would keep the process group, and gloo's threads, alive into interpreter shutdown,
    # where they can abort the worker (see elastic_ddp/train.py): free it before destroying the group.
    del model
    gc.collect()
    dist.destroy_process_group()
    return loss.item()


class Progress:
    """What the workers reported, by job and rank; prints rank 0's progress and when every worker has started."""

    def __init__(self) -> None:
        self.pids: dict[tuple[float, int], int] = {}  # (lr, rank) -> pid

    def handle(self, line: bytes) -> None:
        report: dict[str, Any] = json.loads(line)
        worker = report["lr"], report["rank"]
        new = worker not in self.pids
        self.pids[worker] = report["pid"]
        if report["rank"] == 0 and report["step"] % 10 == 0:
            print(f"lr={report['lr']} step {report['step']}/{report['steps']} loss {report['loss']:.4f}", flush=True)
        if new and len(self.pids) == len(LEARNING_RATES) * NPROC:
            pids = " ".join(map(str, self.pids.values()))
            print(f"all {len(self.pids)} workers have started (pids {pids})", flush=True)

    def print_cancelled(self, why: str) -> None:
        # launch() returns from its cancellation only after stopping and reaping its workers: none may exist now.
        alive = [pid for pid in self.pids.values() if os.path.exists(f"/proc/{pid}")]
        print(f"cancelled ({why}): {len(self.pids)} workers had reported, {len(alive)} still exist", flush=True)


def print_results(results: dict[float, dict[int, float]]) -> None:
    for lr, losses in sorted(results.items()):
        print(f"lr={lr}: final loss {losses[0]:.4f} (ranks {sorted(losses)})", flush=True)
    best = min(results, key=lambda lr: results[lr][0])
    print(f"best learning rate: {best}", flush=True)
