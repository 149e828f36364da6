"""A training script for the Slurm launch tests: every rank joins the gloo group, checks its world size against the
launcher's WORLD_SIZE (and argv[1], the expected size, when given), all-reduces its rank, prints one line and writes
it as JSON to <argv[2]>/rank-<host>-<local rank>.json."""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
assert world == int(os.environ["WORLD_SIZE"]), (world, os.environ["WORLD_SIZE"])
if len(sys.argv) > 1 and sys.argv[1] != "-":
    assert world == int(sys.argv[1]), f"world size {world}, expected {sys.argv[1]}"
total = torch.tensor([float(rank)])
dist.all_reduce(total)
assert total.item() == world * (world - 1) / 2, (total.item(), world)
host = socket.gethostname()
line = {"host": host, "rank": rank, "local_rank": int(os.environ["LOCAL_RANK"]), "world": world,
        "sum": total.item(), "run_id": os.environ.get("TORCHELASTIC_RUN_ID")}  # fmt: skip
print(f"rank {rank}/{world} on {host}: all_reduce(rank) = {total.item():g}", flush=True)
if len(sys.argv) > 2:
    Path(sys.argv[2], f"rank-{host}-{line['local_rank']}.json").write_text(json.dumps(line))
dist.destroy_process_group()
