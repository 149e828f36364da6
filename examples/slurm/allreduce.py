"""Every rank joins the gloo group, checks its world size against the launcher's WORLD_SIZE (and argv[1], the
expected size, when given), all-reduces its rank and prints one line (and writes it as JSON to
<argv[2]>/rank-<host>-<local rank>.json, which tests/slurm/test_launch.py reads). In a Slurm allocation of two nodes:

    srun -N2 aelastic run --nproc-per-node 2 examples/slurm/allreduce.py

prints ``rank 3/4 on node2: all_reduce(rank) = 6`` and the three other ranks' lines (docs/howto/slurm.md).
"""

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
