"""The fault suite's worker: gloo all-reduce steps in a loop, progress reported in files the tests wait on.

argv: OUT. Environment (set on the agent, inherited): FAULTS_HOST names the host, FAULTS_STEP_PAUSE is the pause
after each step (it keeps a 2-core machine responsive: the loop is about liveness, not throughput).

Each step all-reduces ``[1, stop]``: the first element checks that every rank of the world took part, the second
ends the loop on every rank at the same step once ``OUT/stop`` exists anywhere. After each step the worker
replaces ``OUT/<host>/progress-<pid>.json`` (round = failure restarts and membership restarts so far, world
size, rank, step). After the loop: ``done-<pid>.json``; with FAULTS_LINGER set it then waits for ``OUT/release``
before exiting, which holds its agent out of the exit barrier.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

OUT = Path(sys.argv[1])
HOST_DIR = OUT / os.environ["FAULTS_HOST"]
STEP_PAUSE = float(os.environ["FAULTS_STEP_PAUSE"])


def report(event: str, **fields: object) -> None:
    membership = int(os.environ.get("AELASTIC_MEMBERSHIP_RESTARTS", "0"))  # torchrun (comparison runs) has none
    record = {
        "event": event,
        "host": os.environ["FAULTS_HOST"],
        "pid": os.getpid(),
        "round": [int(os.environ["TORCHELASTIC_RESTART_COUNT"]), membership],
        "time": time.time(),
        **fields,
    }
    tmp = HOST_DIR / f".{event}-{os.getpid()}.json"
    tmp.write_text(json.dumps(record))
    os.replace(tmp, HOST_DIR / f"{event}-{os.getpid()}.json")


def main() -> None:
    dist.init_process_group("gloo", init_method="env://")
    world, rank = dist.get_world_size(), dist.get_rank()
    step = 0
    while True:
        flags = torch.tensor([1.0, float((OUT / "stop").exists())])
        dist.all_reduce(flags)
        if int(flags[0].item()) != world:
            raise RuntimeError(f"all-reduce of ones gave {flags[0].item()}, expected the world size {world}")
        step += 1
        report("progress", world_size=world, rank=rank, step=step)
        if flags[1].item() > 0:
            break
        time.sleep(STEP_PAUSE)
    dist.barrier()
    report("done", world_size=world, rank=rank, step=step)
    if os.environ.get("FAULTS_LINGER"):
        while not (OUT / "release").exists():
            time.sleep(0.05)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
