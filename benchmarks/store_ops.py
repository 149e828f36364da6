"""Store throughput and WAIT wake-up latency: torch's TCPStore server (libuv) beside aelastic's, in one run.

    python -m benchmarks.store_ops [--quick] [--repeats N] [--json PATH] [--clients 8] [--seconds 2]

Each server runs in a process of its own: torch's ``TCPStore(is_master=True)``; ``aelastic store`` on asyncio's
own loop (``aelastic``, the default install) and on uvloop (``aelastic uvloop``, the ``fast`` extra; left out where
uvloop is not installed). The clients are torch's C++ ``TCPStore`` client in ``--clients`` long-lived processes,
so the only difference is the server. Per repetition, each server in turn (the order rotates between repetitions):

* **set / get / add ops/s**: every client process runs the op in a loop for ``--seconds``, all starting together
  (a barrier); each then makes one round trip (CHECK) so that replies-less SETs still in socket buffers are
  counted only once the server has handled them. The sum of the clients' rates is one sample. torch's ``get`` is
  two round trips (WAIT, then GET), as in real use.
* **WAIT wake-up**: one client WAITs for a key, another SETs it; the time from just before the SET to the return
  of the WAIT (CLOCK_MONOTONIC, shared by the processes), ``--wakeups`` times. The sample is the p50 (and, as a
  scenario of its own, the p99) of the repetition.

Two more systems, for set / get / add only: ``floor asyncio`` and ``floor uvloop``, ``benchmarks/store_floor.py``'s
server (parse, a fixed reply, write: the least that any store written in Python does per round trip). They show
how much of the gap to torch is the event loop's and not the store's (in GET and ADD; its SETs are slower than
aelastic's store, which parses a run of SETs without a request object each).

Targets (issue 24): aelastic >= 1.0x torch's ops/s with 8 client processes; WAIT wake-up p50 <= 1.0x torch's.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import multiprocessing as mp
import multiprocessing.connection
import multiprocessing.synchronize
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

SYSTEMS = ("torch", "aelastic", "aelastic uvloop")
FLOORS = ("floor asyncio", "floor uvloop")  # benchmarks/store_floor.py on each loop
OPS = ("set", "get", "add")
TORCH_SERVER = """
import sys
from datetime import timedelta
import torch.distributed as dist
s = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=300))
print(s.port, flush=True)
sys.stdin.read()
"""


@contextmanager
def serve(system: str) -> Iterator[int]:
    """Start ``system``'s server in a process of its own; yields its port."""
    if system == "torch":
        cmd = [sys.executable, "-c", TORCH_SERVER]
    elif system.startswith("floor"):
        cmd = [sys.executable, "-m", "benchmarks.store_floor"]
    else:
        cmd = [sys.executable, "-m", "aelastic", "store", "--host", "127.0.0.1", "--port", "0"]
    env = {**os.environ, "AELASTIC_UVLOOP": "1" if system.endswith("uvloop") else "0"}
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # torch: "PORT"; aelastic: "aelastic store listening on HOST:PORT"
        if not line:
            raise RuntimeError(f"{system} store server exited with {proc.wait()} before listening")
        yield int(line.split()[0] if system == "torch" or system.startswith("floor") else line.rsplit(":", 1)[1])
    finally:
        proc.terminate()
        proc.wait(30)


# --- client processes -------------------------------------------------------------------------------------------


def _client(index: int, commands: mp.connection.Connection, start: mp.synchronize.Barrier) -> None:
    """A long-lived process with torch's client: runs the commands the harness sends, replies with results."""
    from datetime import timedelta

    import torch.distributed as dist

    store: Any = None
    port = -1
    while True:
        command = commands.recv()
        if command is None:
            return
        kind, new_port, arg = command
        if new_port != port:
            store = None  # close the previous server's connection first
            store = dist.TCPStore("127.0.0.1", new_port, is_master=False, timeout=timedelta(seconds=300))
            port = new_port
        if kind == "rate":
            op, seconds = arg
            commands.send(_rate(store, index, op, seconds, start))
        else:
            commands.send(_wait_for_wakeups(store, arg))


def _rate(store: Any, index: int, op: str, seconds: float, start: mp.synchronize.Barrier) -> float:
    key = f"bench/{index}"
    store.set(key, b"0")
    fn: Callable[[], object] = {
        "set": lambda: store.set(key, b"x" * 32),
        "get": lambda: store.get(key),
        "add": lambda: store.add(key + "/n", 1),
    }[op]
    start.wait()
    done = 0
    began = time.perf_counter()
    deadline = began + seconds
    while time.perf_counter() < deadline:
        for _ in range(100):
            fn()
        done += 100
    store.check([key])  # a round trip: every SET sent before it has been handled
    return done / (time.perf_counter() - began)


def _wait_for_wakeups(store: Any, n: int) -> list[int]:
    woke = []
    for i in range(n):
        store.set(f"armed/{i}", b"1")
        store.wait([f"wake/{i}"])
        woke.append(time.perf_counter_ns())
    return woke


class Clients:
    """``count`` client processes, started once for the whole run (torch's import is slow)."""

    def __init__(self, count: int) -> None:
        ctx = mp.get_context("spawn")
        self.start = ctx.Barrier(count)
        self.pipes: list[mp.connection.Connection] = []
        self.procs = []
        for i in range(count):
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(target=_client, args=(i, theirs, self.start), daemon=True)
            proc.start()
            self.pipes.append(ours)
            self.procs.append(proc)

    def close(self) -> None:
        for pipe in self.pipes:
            pipe.send(None)
        for proc in self.procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()

    def rate(self, port: int, op: str, seconds: float) -> float:
        for pipe in self.pipes:
            pipe.send(("rate", port, (op, seconds)))
        return sum(pipe.recv() for pipe in self.pipes)

    def wakeups(self, port: int, n: int) -> list[float]:
        """Milliseconds from a SET (issued here) to the return of client 0's WAIT for it."""
        from datetime import timedelta

        import torch.distributed as dist

        self.pipes[0].send(("wait", port, n))
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=300))
        sent = []
        for i in range(n):
            store.wait([f"armed/{i}"])
            time.sleep(0.002)  # let the WAIT reach the server and register: this measures the wake-up only
            sent.append(time.perf_counter_ns())
            store.set(f"wake/{i}", b"1")
        woke: list[int] = self.pipes[0].recv()
        return [(w - s) / 1e6 for s, w in zip(sent, woke, strict=True)]


# --- the run ----------------------------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def measure(clients: int, seconds: float, repeats: int, wakeups: int) -> list[dict[str, Any]]:
    samples: dict[tuple[str, str], list[float]] = {}
    systems = SYSTEMS + FLOORS
    if importlib.util.find_spec("uvloop") is None:
        print("store_ops: uvloop is not installed (the fast extra): the uvloop systems left out", file=sys.stderr)
        systems = tuple(s for s in systems if not s.endswith("uvloop"))
    pool = Clients(clients)
    try:
        for repeat in range(repeats):
            for system in systems[repeat % len(systems) :] + systems[: repeat % len(systems)]:
                with serve(system) as port:
                    for op in OPS:
                        samples.setdefault((f"{op} ops/s", system), []).append(pool.rate(port, op, seconds))
                    latencies = [] if system in FLOORS else pool.wakeups(port, wakeups)  # a floor has no waits
                if latencies:
                    samples.setdefault(("WAIT wake-up p50", system), []).append(percentile(latencies, 0.5))
                    samples.setdefault(("WAIT wake-up p99", system), []).append(percentile(latencies, 0.99))
                print(f"  repeat {repeat + 1}/{repeats} {system}: done", file=sys.stderr, flush=True)
    finally:
        pool.close()
    return [
        {
            "scenario": scenario,
            "system": system,
            "param": clients,
            "unit": "ops/s" if scenario.endswith("ops/s") else "ms",
            "samples": values,
            "better": "higher" if scenario.endswith("ops/s") else "lower",
        }
        for (scenario, system), values in samples.items()
    ]


def print_table(records: list[dict[str, Any]], clients: int, repeats: int) -> None:
    median = {(r["scenario"], r["system"]): statistics.median(r["samples"]) for r in records}
    ours = [system for system in SYSTEMS[1:] + FLOORS if (f"{OPS[0]} ops/s", system) in median]
    print(f"store ops, {clients} torch client processes, {repeats} repeats (medians), {os.cpu_count()} CPUs")
    print(f"{'op':<6}{'torch ops/s':>14}" + "".join(f"{s + ' ops/s':>24}{'ratio':>8}" for s in ours))
    for op in OPS:
        t = median[f"{op} ops/s", "torch"]
        print(
            f"{op:<6}{t:>14.0f}"
            + "".join(f"{median[f'{op} ops/s', s]:>24.0f}{median[f'{op} ops/s', s] / t:>8.2f}" for s in ours)
        )
    for system in SYSTEMS:
        if ("WAIT wake-up p50", system) in median:
            p50, p99 = median["WAIT wake-up p50", system], median["WAIT wake-up p99", system]
            print(f"WAIT wake-up {system:<16} p50 {p50:.3f} ms  p99 {p99:.3f} ms")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.store_ops", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run of a few seconds per server")
    parser.add_argument("--repeats", type=int, default=None, help="repetitions (default 5, quick 1)")
    parser.add_argument("--json", type=Path, default=None, help="write the records here")
    parser.add_argument("--clients", type=int, default=8, help="torch client processes (default 8)")
    parser.add_argument("--seconds", type=float, default=None, help="seconds per op and server (default 2)")
    parser.add_argument("--wakeups", type=int, default=None, help="WAIT wake-ups per server (default 200)")
    args = parser.parse_args(argv)
    repeats = args.repeats or (1 if args.quick else 5)
    seconds = args.seconds or (0.5 if args.quick else 2.0)
    wakeups = args.wakeups or (50 if args.quick else 200)
    for name, value in (("--repeats", repeats), ("--clients", args.clients), ("--wakeups", wakeups)):
        if value < 1:
            parser.error(f"{name} {value}: must be >= 1")

    records = measure(args.clients, seconds, repeats, wakeups)
    print_table(records, args.clients, repeats)
    if args.json is not None:
        args.json.write_text(json.dumps({"benchmark": "store_ops", "records": records}, indent=1) + "\n")


if __name__ == "__main__":
    main()
