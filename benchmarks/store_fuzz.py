"""A long random-bytes campaign against aelastic's store server while torch's client works on it; not run in CI.

    python -m benchmarks.store_fuzz [--minutes 10] [--fuzzers 2] [--json PATH]

The server (``open_store_server`` with its default settings) runs in a process of its own. ``--fuzzers``
processes open connection after connection and send each one of: random bytes; VALIDATE then random bytes;
VALIDATE then a valid request with random bytes flipped, cut short, or with an absurd length prefix; or nothing at
all (a half-open connection the handshake timeout must end). They keep up to 64 connections open at a time and
close the oldest, some with a reset (SO_LINGER 0). Meanwhile one torch ``TCPStore`` client runs set/get/add round
trips and records each one's latency; any error of its counts.

The campaign passes when: the torch client saw no error (its round-trip latencies are reported); once the
fuzzers stop and the handshake timeout has passed, the server holds no connection and no wait registration; and
nothing leaked: the server's live Python allocations (``sys.getallocatedblocks()`` after a collection) exceed
those before the campaign by no more than the state the fuzzers stored (mutated requests are often valid: new
keys and queued values) accounts for, at most 4 blocks per key or value, plus 5000. Its RSS is reported, not
judged: it is the allocator's high-water mark of the flood (some 10,000 connections open at once).
``--minutes 0.5`` is a check run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import random
import socket
import statistics
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

SERVER = """
import gc, json, sys
import anyio, anyio.to_thread
from aelastic.store.server import open_store_server

def rss_mib():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024

async def main():
    async with open_store_server("127.0.0.1", 0) as server:
        print(server.port, flush=True)
        while await anyio.to_thread.run_sync(sys.stdin.readline):  # one line in: one statistics line out
            s = server.statistics()
            gc.collect()
            print(json.dumps({"connections": s.connections, "waiters": s.waiters, "keys": s.keys,
                              "queued": s.queued, "ops": s.ops_served, "blocks": sys.getallocatedblocks(),
                              "rss": rss_mib()}), flush=True)

anyio.run(main)
"""

HANDSHAKE_TIMEOUT = 10.0  # ServerSettings' default: how long a half-open connection may stay
BLOCKS_PER_ITEM, BLOCKS_SLACK = 4, 5000  # what a stored key (key, value, table slot) or queued value may hold
MAX_OPEN = 64


def _requests() -> list[bytes]:
    """A valid encoding of every request kind, to mutate."""
    from aelastic.store import wire

    k, v = b"/fuzz", b"value"
    return [
        wire.encode_request(r)
        for r in (
            wire.Set(k, v), wire.CompareSet(k, v, b"x"), wire.Get(k), wire.Add(k, 3), wire.Check((k,)),
            wire.Wait((k, b"/other")), wire.GetNumKeys(), wire.DeleteKey(k), wire.Append(k, v), wire.MultiGet((k,)),
            wire.MultiSet(((k, v),)), wire.CancelWait(), wire.Ping(7), wire.QueuePush(k, v), wire.QueuePop(k),
            wire.QueueLen(k), wire.ListKeys(), wire.Barrier(k, 2),
        )
    ]  # fmt: skip


def _payload(rng: random.Random, validate: bytes, requests: list[bytes]) -> bytes:
    kind = rng.randrange(6)
    if kind == 0:
        return rng.randbytes(rng.randrange(1, 4096))
    if kind == 1:
        return validate + rng.randbytes(rng.randrange(1, 4096))
    frame = bytearray(rng.choice(requests))
    if kind == 2:  # flipped bytes
        for _ in range(rng.randrange(1, 4)):
            frame[rng.randrange(len(frame))] = rng.randrange(256)
    elif kind == 3:  # cut short
        frame = frame[: rng.randrange(len(frame))]
    elif kind == 4 and len(frame) >= 9:  # an absurd length prefix where the first string starts
        frame[1:9] = struct.pack("<Q", rng.choice([2**63 - 1, 2**40, 8 * 2**20 + 1]))
    else:
        return b""  # half-open: connect and say nothing
    return validate + bytes(frame)


def fuzzer(port: int, seconds: float, seed: int, out: Any) -> None:
    from aelastic.store import wire

    rng = random.Random(seed)
    validate, requests = wire.encode_request(wire.Validate()), _requests()
    open_socks: list[socket.socket] = []
    connections = sent = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        sock = socket.create_connection(("127.0.0.1", port))
        payload = _payload(rng, validate, requests)
        with contextlib.suppress(OSError):  # the server refused an earlier part of it already
            sock.sendall(payload)
        connections += 1
        sent += len(payload)
        open_socks.append(sock)
        if len(open_socks) > MAX_OPEN:
            old = open_socks.pop(0)
            if rng.random() < 0.3:  # a reset rather than a FIN
                old.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            old.close()
    for sock in open_socks:
        sock.close()
    out.send({"connections": connections, "bytes": sent})


def torch_client(port: int, seconds: float, out: Any) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
    latencies, errors = [], []
    deadline = time.monotonic() + seconds
    i = 0
    while time.monotonic() < deadline:
        started = time.perf_counter()
        try:
            store.set(f"t{i % 100}", str(i))
            if store.get(f"t{i % 100}") != str(i).encode():
                errors.append(f"get of t{i % 100} did not return {i}")
            store.add("count", 1)
        except Exception as exc:  # any failure of torch's client is what this campaign looks for
            errors.append(repr(exc))
        latencies.append(time.perf_counter() - started)
        i += 1
    out.send({"ops": 3 * i, "latencies": latencies, "errors": errors[:5], "error_count": len(errors)})


class Server:
    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1
        )
        assert self.proc.stdout is not None
        self.port = int(self.proc.stdout.readline())

    def stats(self) -> dict[str, Any]:
        assert self.proc.stdin is not None
        assert self.proc.stdout is not None
        self.proc.stdin.write("\n")
        stats: dict[str, Any] = json.loads(self.proc.stdout.readline())
        return stats

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(30)


def campaign(minutes: float, fuzzers: int) -> dict[str, Any]:
    seconds = minutes * 60
    server = Server()
    ctx = mp.get_context("spawn")
    try:
        before = server.stats()
        pipes, procs = [], []
        for i in range(fuzzers + 1):
            receive, send = ctx.Pipe(duplex=False)
            if i < fuzzers:
                proc = ctx.Process(target=fuzzer, args=(server.port, seconds, i, send))
            else:
                proc = ctx.Process(target=torch_client, args=(server.port, seconds, send))
            proc.start()
            pipes.append(receive)
            procs.append(proc)
        time.sleep(min(60.0, seconds / 2))
        early = server.stats()
        results = [pipe.recv() for pipe in pipes]
        for proc in procs:
            proc.join(30)
        # The torch client's connection has closed with its process; half-open fuzz connections end by the
        # handshake timeout. Then nothing may be left.
        deadline = time.monotonic() + HANDSHAKE_TIMEOUT + 10
        while (end := server.stats())["connections"] and time.monotonic() < deadline:
            time.sleep(0.5)
    finally:
        server.close()
    fuzz, torch = results[:fuzzers], results[fuzzers]
    latencies = sorted(torch["latencies"])
    stored = end["keys"] + end["queued"] - before["keys"] - before["queued"]
    leaked = end["blocks"] - before["blocks"] - BLOCKS_PER_ITEM * stored
    return {
        "minutes": minutes,
        "fuzz_connections": sum(r["connections"] for r in fuzz),
        "fuzz_bytes": sum(r["bytes"] for r in fuzz),
        "torch_ops": torch["ops"],
        "torch_errors": torch["error_count"],
        "torch_first_errors": torch["errors"],
        "torch_p50_ms": 1000 * statistics.median(latencies),
        "torch_p99_ms": 1000 * latencies[int(0.99 * (len(latencies) - 1))],
        "torch_max_ms": 1000 * latencies[-1],
        "connections_left": end["connections"],
        "waiters_left": end["waiters"],
        "stored_items": stored,
        "blocks_unaccounted": leaked,
        "leak_free": leaked <= BLOCKS_SLACK,
        "rss_before_mib": before["rss"],
        "rss_flood_mib": early["rss"],
        "rss_end_mib": end["rss"],
        "before": before,
        "during": early,
        "end": end,
    }


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.store_fuzz", description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--fuzzers", type=int, default=2)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    r = campaign(args.minutes, args.fuzzers)
    print(json.dumps(r, indent=1))
    passed = r["torch_errors"] == 0 and r["connections_left"] == 0 and r["waiters_left"] == 0 and r["leak_free"]
    print("PASS" if passed else "FAIL")
    if args.json is not None:

        def record(scenario: str, value: float, unit: str, what: str) -> dict[str, Any]:
            return {"scenario": scenario, "system": "aelastic", "param": None, "unit": unit, "samples": [value],
                    "better": "lower", "what": what}  # fmt: skip

        args.json.parent.mkdir(parents=True, exist_ok=True)
        records = [
            record(f"{args.minutes:g} min: hostile connections", r["fuzz_connections"], "",
                   f"random/mutated/truncated/half-open, {r['fuzz_bytes'] / 2**20:.0f} MiB sent by {args.fuzzers} "
                   "processes"),
            record("torch client errors meanwhile", r["torch_errors"], "", f"of {r['torch_ops']} ops"),
            record("torch client round trip p99", r["torch_p99_ms"], "ms",
                   f"set+get+add; p50 {r['torch_p50_ms']:.2f} ms, max {r['torch_max_ms']:.1f} ms"),
            record("connections and waiters left", r["connections_left"] + r["waiters_left"], "",
                   "after the fuzzers stopped and the handshake timeout passed"),
            record("live allocations not accounted for by stored state", r["blocks_unaccounted"], "blocks",
                   f"{r['end']['blocks']} blocks after, {r['before']['blocks']} before, {r['stored_items']} keys and "
                   f"queued values stored; RSS {r['rss_before_mib']:.0f} MiB before, {r['rss_flood_mib']:.0f} MiB "
                   f"mid-flood, {r['rss_end_mib']:.0f} MiB after"),
        ]  # fmt: skip
        args.json.write_text(json.dumps({"benchmark": "store_fuzz", "records": records}, indent=1))
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
