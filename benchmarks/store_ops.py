"""Store throughput and WAIT wake-up latency: torch's TCPStore server (libuv) beside aelastic's, in one run.

Both servers run in a process of their own; the clients are torch's C++ ``TCPStore`` client in several processes,
so the only difference is the server. The servers alternate for several repetitions; medians are reported.

    python benchmarks/store_ops.py [--clients 8] [--seconds 2] [--repeats 3] [--wakeups 200]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

TORCH_SERVER = """
import sys, time
from datetime import timedelta
import torch.distributed as dist
s = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
print(s.port, flush=True)
sys.stdin.read()
"""


@dataclass(frozen=True)
class Server:
    name: str
    port: int


@contextmanager
def serve(name: str) -> Iterator[Server]:
    if name == "torch":
        cmd = [sys.executable, "-c", TORCH_SERVER]
    else:
        cmd = [sys.executable, "-m", "aelastic", "store", "--host", "127.0.0.1", "--port", "0"]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        port = int(line.split()[0] if name == "torch" else line.rsplit(":", 1)[1])
        yield Server(name, port)
    finally:
        proc.terminate()
        proc.wait(10)


def _client(port: int, op: str, seconds: float, worker: int, out: mp.Queue) -> None:  # type: ignore[type-arg]
    from datetime import timedelta

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    key = f"bench/{worker}"
    store.set(key, b"0")
    ops: dict[str, Callable[[], object]] = {
        "set": lambda: store.set(key, b"x" * 32),
        "get": lambda: store.get(key),
        "add": lambda: store.add(key + "n", 1),
    }
    fn = ops[op]
    done, deadline = 0, time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        for _ in range(100):
            fn()
        done += 100
    out.put(done / seconds)


def throughput(server: Server, op: str, clients: int, seconds: float) -> float:
    ctx = mp.get_context("spawn")
    out: mp.Queue = ctx.Queue()  # type: ignore[type-arg]
    procs = [ctx.Process(target=_client, args=(server.port, op, seconds, i, out)) for i in range(clients)]
    for p in procs:
        p.start()
    rates = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(30)
    return sum(rates)


def _waiter(port: int, n: int, out: mp.Queue) -> None:  # type: ignore[type-arg]
    from datetime import timedelta

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    woke = []
    for i in range(n):
        store.set(f"armed/{i}", b"1")
        store.wait([f"wake/{i}"])
        woke.append(time.perf_counter_ns())
    out.put(woke)


def wakeup_latency(server: Server, n: int) -> list[float]:
    """Milliseconds from a SET (issued by one torch client) to the return of another client's WAIT."""
    from datetime import timedelta

    import torch.distributed as dist

    ctx = mp.get_context("spawn")
    out: mp.Queue = ctx.Queue()  # type: ignore[type-arg]
    proc = ctx.Process(target=_waiter, args=(server.port, n, out))
    proc.start()
    store = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=60))
    sent = []
    for i in range(n):
        store.wait([f"armed/{i}"])
        time.sleep(0.002)  # let the WAIT reach the server and register
        sent.append(time.perf_counter_ns())
        store.set(f"wake/{i}", b"1")
    woke = out.get(timeout=120)
    proc.join(30)
    return [(w - s) / 1e6 for s, w in zip(sent, woke, strict=True)]


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--wakeups", type=int, default=200)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = parser.parse_args()

    rates: dict[tuple[str, str], list[float]] = {}
    wake: dict[str, list[float]] = {"torch": [], "aelastic": []}
    for _ in range(args.repeats):
        for name in ("torch", "aelastic"):
            with serve(name) as server:
                for op in ("set", "get", "add"):
                    rates.setdefault((name, op), []).append(throughput(server, op, args.clients, args.seconds))
                wake[name].extend(wakeup_latency(server, args.wakeups // args.repeats))

    result = {
        "machine": f"{os.cpu_count()} cores, python {sys.version.split()[0]}",
        "clients": args.clients,
        "ops_per_s": {f"{n}/{op}": statistics.median(v) for (n, op), v in rates.items()},
        "ratio": {
            op: statistics.median(rates["aelastic", op]) / statistics.median(rates["torch", op])
            for op in ("set", "get", "add")
        },
        "wakeup_ms": {n: {"p50": pct(v, 0.5), "p99": pct(v, 0.99)} for n, v in wake.items()},
    }
    if args.json:
        print(json.dumps(result))
        return
    print(f"store ops, {args.clients} torch client processes, {args.repeats} repeats (medians) - {result['machine']}")
    print(f"{'op':<6}{'torch ops/s':>14}{'aelastic ops/s':>16}{'ratio':>8}")
    for op in ("set", "get", "add"):
        t, a = result["ops_per_s"][f"torch/{op}"], result["ops_per_s"][f"aelastic/{op}"]
        print(f"{op:<6}{t:>14.0f}{a:>16.0f}{a / t:>8.2f}")
    for name, w in result["wakeup_ms"].items():
        print(f"WAIT wake-up {name:<9} p50 {w['p50']:.3f} ms  p99 {w['p99']:.3f} ms")


if __name__ == "__main__":
    main()
