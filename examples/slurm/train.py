"""A training loop that survives a lost node without restarting the survivors: a gloo all-reduce per step until the
stop file appears, an in-memory checkpoint after every step (``aelastic.checkpoint``), and the training function
wrapped in ``aelastic.worker.restartable``, so that when the job's membership changes (a node lost, a spare joining)
the workers of the other nodes keep their processes and go on in the new world from the last step.

Run by ``node_loss.sbatch`` (one ``aelastic run`` per node). Each step appends one JSON line to
``$TRAIN_LOG/<host>.<pid>.jsonl`` (the wall time, the pid, the rank, the world size); each call of the training
function says what it restored and from where (this agent's memory, another agent's replica, the checkpoint
directory): ``tests/slurm/test_node_loss.py`` reads them.
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
        out.write(json.dumps({"time": time.time(), "host": socket.gethostname(), "pid": os.getpid(), **fields}) + "\n")


record(event="started", at=started, restart=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))

import torch  # noqa: E402  (after the start is recorded: how long the import takes is part of a restart)
import torch.distributed as dist  # noqa: E402

import aelastic.checkpoint as ckpt  # noqa: E402
from aelastic.worker import restartable  # noqa: E402


@restartable
def train() -> None:
    dist.init_process_group(backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    state = {"weights": torch.zeros(1024), "step": -1}
    restored = ckpt.load(into=state)
    loaded = ckpt.last_loaded()
    record(event="restored", rank=rank, world=world, loaded=None if loaded is None else loaded._asdict())
    step = 0 if restored is None else restored["step"] + 1
    while not stop.exists():
        value = torch.ones(1)
        dist.all_reduce(value)
        assert value.item() == world, f"all_reduce gave {value.item()}, expected {world}"
        state["weights"] += value  # the same on every rank: the job's progress, carried across worlds
        state["step"] = step
        ckpt.save(state, step=step)
        record(event="step", rank=rank, world=world, step=step)
        step += 1
        time.sleep(0.2)
    dist.destroy_process_group()
    record(event="done", rank=rank, world=world, step=step)


train()
