"""A worker for hang detection's verdicts (``tests/test_hang_verdicts.py``, ``benchmarks/hang_verdicts.py``): two
gloo ranks train a few steps, then one case plays out, true hangs and false ones.

    python hang_cases.py CASE SECONDS OUT

True hangs (the job must be found hung, the odd rank named):

* ``sleep``: rank 1 sleeps outside any collective; rank 0 waits for it in an all-reduce.
* ``stop``: rank 1 stops itself (SIGSTOP) inside the step; rank 0 waits in the all-reduce.
* ``deadlock``: both ranks wait to receive from each other.
* ``io``: rank 1 blocks opening a FIFO nobody ever writes (I/O that never returns); rank 0 waits.

False ones (each lasts SECONDS, then the job ends well; no verdict may name anyone):

* ``checkpoint``: rank 0 writes a checkpoint to slow storage (about 2.5 MiB/s, its CPU nearly idle) while rank 1
  waits in a barrier.
* ``evaluation``: rank 0 evaluates (its CPU busy) while rank 1 waits in a barrier.
* ``loader``: both ranks wait for a batch from a DataLoader whose worker processes decode (their CPU moves, the
  ranks' own does not).
* ``device``: rank 0 sleeps while "the device works", inside ``aelastic.worker.busy("device")``: nothing outside
  its process can tell this from a hang, so the marker says it; rank 1 waits in a barrier.

Each rank writes ``<OUT>/fault-<rank>.json`` (its wall-clock time) when the case begins.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

CASE, SECONDS, OUT = sys.argv[1], float(sys.argv[2]), sys.argv[3]


class Slow(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """A dataset whose every item takes ``SECONDS`` of CPU to decode."""

    def __len__(self) -> int:
        return 2

    def __getitem__(self, index: int) -> torch.Tensor:
        end = time.monotonic() + SECONDS
        x = torch.ones(64, 64)
        while time.monotonic() < end:
            x = (x @ x).clamp(max=1.0)
        return x


def case(rank: int) -> None:
    t = torch.ones(4)
    if CASE == "sleep":
        if rank == 1:
            time.sleep(3600)
        dist.all_reduce(t)
    elif CASE == "stop":
        if rank == 1:
            os.kill(os.getpid(), signal.SIGSTOP)
        dist.all_reduce(t)
    elif CASE == "deadlock":
        dist.recv(t, src=1 - rank)
    elif CASE == "io":
        if rank == 1:
            fifo = os.path.join(OUT, "never-written")
            os.mkfifo(fifo)
            with open(fifo, "rb") as f:
                f.read()
        dist.all_reduce(t)
    elif CASE == "checkpoint":
        if rank == 0:
            with open(os.path.join(OUT, "checkpoint.bin"), "wb") as f:
                end = time.monotonic() + SECONDS
                while time.monotonic() < end:
                    f.write(os.urandom(256 << 10))
                    f.flush()
                    os.fsync(f.fileno())
                    time.sleep(0.1)
        dist.barrier()
    elif CASE == "evaluation":
        if rank == 0:
            end, x = time.monotonic() + SECONDS, torch.ones(128, 128)
            while time.monotonic() < end:
                x = (x @ x).clamp(max=1.0)
        dist.barrier()
    elif CASE == "loader":
        loader = torch.utils.data.DataLoader(Slow(), batch_size=1, num_workers=2)
        for _ in loader:
            break
        dist.barrier()
    elif CASE == "device":
        if rank == 0:
            import aelastic.worker

            with aelastic.worker.busy("device"):
                time.sleep(SECONDS)
        dist.barrier()
    else:
        raise SystemExit(f"no case {CASE!r}")


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    for _ in range(5):
        dist.all_reduce(torch.ones(4))
        time.sleep(0.05)
    with open(os.path.join(OUT, f".fault-{rank}.json"), "w") as f:
        json.dump({"rank": rank, "time": time.time(), "case": CASE}, f)
    os.replace(os.path.join(OUT, f".fault-{rank}.json"), os.path.join(OUT, f"fault-{rank}.json"))
    case(rank)
    dist.barrier()
    dist.destroy_process_group()


main()
