"""A worker for the root-cause test: gloo all-reduce steps; rank FAULTS_RAISE_RANK raises at step FAULTS_RAISE_STEP.

argv: OUT. torch's ``record`` writes the exception to the worker's error file, as a torchrun script's would. Every
rank reports ``OUT/<host>/step-<rank>.json`` after each step, so the test knows the job trains.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

OUT = Path(sys.argv[1])


@record
def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    raise_rank, raise_step = int(os.environ["FAULTS_RAISE_RANK"]), int(os.environ["FAULTS_RAISE_STEP"])
    host = OUT / os.environ["FAULTS_HOST"]
    host.mkdir(parents=True, exist_ok=True)
    for step in range(1000):
        if rank == raise_rank and step == raise_step:
            raise RuntimeError(f"rank {rank} fails at step {step}")
        dist.all_reduce(torch.ones(4))
        (host / f"step-{rank}.json").write_text(json.dumps({"rank": rank, "step": step}))
        time.sleep(0.05)


if __name__ == "__main__":
    main()
