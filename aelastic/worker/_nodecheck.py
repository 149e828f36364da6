"""The node check's process (``python -m aelastic.worker._nodecheck FD``): a matmul on this node's device and
gloo all-reduces with the peers its agent names. Standard library and torch only, nothing of aelastic.

Protocol: one JSON object per packet on the socket ``FD`` (a ``SOCK_SEQPACKET`` pair with the agent). Once torch is
imported the process sends ``{"ready": true}``. Then each packet from its agent is one check round::

    {"store": "HOST:PORT", "prefix": "round1", "rank": 0, "size": 2, "timeout": 10.0}

and it answers with one packet of figures: ``compute`` (seconds per matmul: the fastest of :data:`MATMUL_RUNS`, on
the slowest device where CUDA shows several), ``comm`` (seconds per all-reduce of :data:`ALL_REDUCE_BYTES` with
the ``size`` members of the group: the median of at most :data:`ALL_REDUCE_RUNS`), ``compute_error`` and
``comm_error`` (what went wrong, or null), ``device`` and ``size`` (the bytes of each all-reduce). ``size`` 1 is a
round without peers: compute only. The group meets through the store at ``store`` (served by an agent), under
``prefix``; ``timeout`` bounds the group's forming and each all-reduce, so a peer that never comes fails the round
instead of hanging it. The process ends when its agent closes its end.
"""

from __future__ import annotations

import datetime
import json
import socket
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

MATMUL_SIZE = {"cpu": 512, "cuda": 4096}  # milliseconds on a CPU core or a GPU: long enough to time, short to repeat
MATMUL_RUNS = 10
ALL_REDUCE_BYTES = 4 << 20  # a few ms over a healthy link, long enough for its bandwidth to show
ALL_REDUCE_RUNS = 10
ALL_REDUCE_BUDGET = 0.5  # seconds of timed all-reduces (about): a slow link shows in two runs, and is bounded


def _devices() -> list[torch.device]:
    if torch.cuda.is_available():
        return [torch.device("cuda", index) for index in range(torch.cuda.device_count())]
    return [torch.device("cpu")]


def _matmul(device: torch.device) -> float:
    """The seconds of the fastest of several matmuls on ``device``: the device at its best (a moment of contention is
    not a slow device; a throttled or failing one is slow in every run). On a CPU, one thread's CPU time: the
    core's speed while it runs; the time it waits for a core is the scheduler's (on a host shared by several
    agents, as in tests, it would single out whichever the scheduler happened to delay)."""
    size = MATMUL_SIZE[device.type]
    a = torch.randn(size, size, device=device)
    b = torch.randn(size, size, device=device)
    clock = time.process_time if device.type == "cpu" else time.perf_counter
    torch.matmul(a, b)  # warm-up: the kernels chosen and loaded
    runs = []
    for _ in range(MATMUL_RUNS):
        began = clock()
        torch.matmul(a, b)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        runs.append(clock() - began)
    return min(runs)


def _all_reduce(command: dict[str, Any]) -> float:
    """The median seconds of one all-reduce in the group ``command`` names."""
    host, _, port = str(command["store"]).rpartition(":")
    timeout = datetime.timedelta(seconds=float(command["timeout"]))
    store = dist.TCPStore(host.strip("[]"), int(port), is_master=False, timeout=timeout)  # type: ignore[attr-defined]
    prefixed = dist.PrefixStore(str(command["prefix"]), store)  # type: ignore[attr-defined]
    dist.init_process_group("gloo", store=prefixed, rank=command["rank"], world_size=command["size"], timeout=timeout)
    try:
        dist.all_reduce(torch.zeros(1))  # the connections made, the members in step (a slow link's time is for later)
        data = torch.zeros(ALL_REDUCE_BYTES // 4)
        runs: list[float] = []
        began = time.perf_counter()
        while len(runs) < ALL_REDUCE_RUNS:
            # The last element says "this run ends my budget" (if it takes as long as the last): summed, every member
            # stops after the same run.
            ends = time.perf_counter() - began + (runs[-1] if runs else 0.0)
            data[-1] = float(ends >= ALL_REDUCE_BUDGET)
            start = time.perf_counter()
            dist.all_reduce(data)
            runs.append(time.perf_counter() - start)
            if data[-1].item() > 0:
                break
        return statistics.median(runs)
    finally:
        dist.destroy_process_group()


def _error(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}".rstrip(": ")


def check_round(command: dict[str, Any]) -> dict[str, Any]:
    """One round's figures (see the module doc)."""
    figures: dict[str, Any] = {"compute": None, "comm": None, "compute_error": None, "comm_error": None}
    slowest: tuple[float, torch.device] | None = None
    try:
        for device in _devices():
            seconds = _matmul(device)
            if slowest is None or seconds > slowest[0]:
                slowest = (seconds, device)
    except Exception as exc:  # a device fault is the finding, not a crash of the check
        figures["compute_error"] = _error(exc)
    if slowest is not None and figures["compute_error"] is None:
        figures["compute"] = slowest[0]
    figures["device"] = str(slowest[1]) if slowest is not None else ""
    figures["size"] = ALL_REDUCE_BYTES if command["size"] > 1 else 0
    if command["size"] > 1:  # the group's peers wait for this member even when its compute failed
        try:
            figures["comm"] = _all_reduce(command)
        except Exception as exc:  # a link or a peer failing is the finding
            figures["comm_error"] = _error(exc)
    return figures


def main() -> None:
    torch.set_num_threads(1)  # a CPU's matmul on one core: its CPU time is its time (see _matmul)
    channel = socket.socket(fileno=int(sys.argv[1]))
    channel.send(json.dumps({"ready": True}).encode())
    while command := channel.recv(1 << 16):
        channel.send(json.dumps(check_round(json.loads(command))).encode())


if __name__ == "__main__":
    main()
