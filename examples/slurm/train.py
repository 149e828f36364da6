"""A training loop that survives a lost node: a gloo all-reduce per step until the stop file appears.

Run by ``node_loss.sbatch`` (one ``aelastic run`` per node). Each step appends one JSON line to
``$TRAIN_LOG/<host>.<pid>.jsonl`` (the wall time, the rank, the world size, the restart count), which is what
``tests/slurm/test_node_loss.py`` reads; a real job would load its checkpoint at the top and save one every few
steps, since a new world restarts the workers.
"""

import json
import os
import socket
import time
from pathlib import Path

started = time.time()
log_dir = Path(os.environ.get("TRAIN_LOG", "."))
stop = Path(os.environ.get("TRAIN_STOP", "stop"))
log = log_dir / f"{socket.gethostname()}.{os.getpid()}.jsonl"


def record(**fields: object) -> None:
    with log.open("a") as out:
        out.write(json.dumps({"time": time.time(), "host": socket.gethostname(), **fields}) + "\n")


record(event="started", at=started, restart=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))

import torch  # noqa: E402  (after the start is recorded: how long the import takes is part of a restart)
import torch.distributed as dist  # noqa: E402

dist.init_process_group(backend="gloo")
rank, world = dist.get_rank(), dist.get_world_size()
step = 0
while not stop.exists():
    value = torch.ones(1)
    dist.all_reduce(value)
    assert value.item() == world, f"all_reduce gave {value.item()}, expected {world}"
    record(event="step", rank=rank, world=world, step=step)
    step += 1
    time.sleep(0.2)
dist.destroy_process_group()
record(event="done", rank=rank, world=world, step=step)
