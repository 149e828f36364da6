"""Soak: 1024 simulated nodes heartbeating against one c10d store for ``--minutes``; not run in CI.

    python -m benchmarks.soak [--minutes 10] [--nodes 1024] [--procs 4] [--json PATH]

The store is aelastic's store server in a process of its own, admitting twice as many connections as nodes (a
heartbeat cancelled by its timeout breaks its connection, and the node reconnects before the store has seen the
old one close; ``aelastic store``'s default, half the open-file limit, is exactly 10,000 here); it logs its
connection and waiter counts once a minute. The nodes are real rendezvous handlers (the ``c10d`` backend, each
with its own store client), run as tasks spread over ``--procs`` processes. They all join one run (``--nnodes
N:N``), then each waits for a membership change while its liveness task beats and checks its neighbour at torch's
defaults (every 5 s; dead after 3 missed beats). Nobody dies, so any membership change is a
false eviction. The RSS of the store and of every node process is sampled once a minute after the round
completes; memory is flat when the last sample is within 10 % (and 8 MiB) of the first.

Prints a table; with ``--json`` writes the benchmark format (scenarios: time for all nodes to join, false
evictions, RSS growth of the store and of the node processes). ``--minutes 1`` is a check run.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

KEEP_ALIVE = {"keep_alive_interval": "5", "keep_alive_max_attempt": "3"}  # torch's defaults
FLAT_RATIO, FLAT_MIB = 0.10, 8.0
SAMPLE_MARGIN = 60.0  # seconds the node processes keep beating after the driver's last scheduled sample
OPENING = 64  # handlers a node process opens at a time: thousands at once would miss the store's handshake timeout


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


# --- a process of simulated nodes ------------------------------------------------------------------------------


async def nodes_main(endpoint: str, run_id: str, total: int, count: int, seconds: float) -> None:
    """``count`` handlers of a ``total``-node run; one JSON line when all joined, one at the end."""
    import anyio

    from aelastic.rendezvous.api import RendezvousParameters
    from aelastic.rendezvous.registry import open_rendezvous

    opened = joined = 0
    evictions: list[str] = []
    all_opened, all_joined = anyio.Event(), anyio.Event()
    opening = anyio.Semaphore(OPENING)

    async def node() -> None:
        nonlocal opened, joined
        params = RendezvousParameters(
            "c10d", endpoint, run_id, total, total, is_host="false", join_timeout="1800", **KEEP_ALIVE
        )
        async with AsyncExitStack() as stack:
            async with opening:
                handler = await stack.enter_async_context(open_rendezvous(params))
            opened += 1
            if opened == count:
                all_opened.set()
            # Join once this process's handlers are all open: nodes that joined (and beat) while thousands of
            # others still open in the same process would starve the openings, an artifact of simulating
            # thousands of agents in one process (an agent opens one handler).
            await all_opened.wait()
            await handler.next_rendezvous()
            joined += 1
            if joined == count:
                all_joined.set()
            with anyio.move_on_after(seconds):
                evictions.append(await handler.wait_for_membership_change())

    async with anyio.create_task_group() as tg:
        for _ in range(count):
            tg.start_soon(node)
        await all_joined.wait()
        print(json.dumps({"joined": joined}), flush=True)
    print(json.dumps({"evictions": len(evictions), "reasons": sorted(set(evictions))[:5]}), flush=True)


# --- the store process ------------------------------------------------------------------------------------------


async def store_main(max_connections: int) -> None:
    """Serve until killed; print the address, then the server's counts once a minute (stderr)."""
    import anyio

    from aelastic.store.server import ServerSettings, open_store_server

    async with open_store_server("127.0.0.1", 0, ServerSettings(max_connections=max_connections)) as server:
        print(f"listening on 127.0.0.1:{server.port}", flush=True)
        while True:
            await anyio.sleep(60)
            s = server.statistics()
            print(f"  store: {s.connections} connections, {s.waiters} waiters, {s.keys} keys, {s.ops_served} requests "
                  f"served", file=sys.stderr, flush=True)  # fmt: skip


# --- the driver --------------------------------------------------------------------------------------------------


def soak(nodes: int, procs: int, minutes: float) -> dict[str, Any]:
    store = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.soak", "--store-process", str(2 * nodes)], stdout=subprocess.PIPE, text=True
    )
    workers: list[subprocess.Popen[str]] = []
    try:
        assert store.stdout is not None
        endpoint = store.stdout.readline().split()[-1]  # "listening on HOST:PORT"
        shares = [nodes // procs + (i < nodes % procs) for i in range(procs)]
        seconds = minutes * 60
        started = time.monotonic()
        command = [sys.executable, "-m", "benchmarks.soak", "--nodes-process", endpoint, "soak", str(nodes)]
        workers = [
            # The nodes outlive the last RSS sample by SAMPLE_MARGIN (an exited process has no RSS to read).
            subprocess.Popen([*command, str(share), str(seconds + SAMPLE_MARGIN)], stdout=subprocess.PIPE, text=True)
            for share in shares
        ]
        for w in workers:
            assert w.stdout is not None
            line = json.loads(w.stdout.readline())
            if "joined" not in line:
                raise RuntimeError(f"node process failed before joining: {line}")
        join_s = time.monotonic() - started
        print(f"{nodes} nodes joined in {join_s:.1f} s")
        samples: list[dict[str, float]] = []
        for minute in range(int(minutes) + 1):
            sample = {"minute": minute, "store": rss_mib(store.pid), "nodes": sum(rss_mib(w.pid) for w in workers)}
            samples.append(sample)
            print(f"  minute {minute}: store RSS {sample['store']:.1f} MiB, node processes {sample['nodes']:.1f} MiB")
            if minute < int(minutes):
                time.sleep(60)  # a sampling period, not a synchronization
        evictions = 0
        for w in workers:
            assert w.stdout is not None
            end = json.loads(w.stdout.readline())
            evictions += end["evictions"]
            if end["evictions"]:
                print(f"  false evictions in a node process: {end}")
            w.wait(60)
        return {"join_s": join_s, "evictions": evictions, "samples": samples}
    finally:
        for p in [*workers, store]:
            p.kill()
            p.wait()


def flat(first: float, last: float) -> bool:
    return last - first <= max(FLAT_RATIO * first, FLAT_MIB)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--store-process":
        import anyio

        anyio.run(store_main, int(sys.argv[2]))
        return
    if len(sys.argv) > 1 and sys.argv[1] == "--nodes-process":
        import anyio

        endpoint, run_id, total, count, seconds = sys.argv[2:7]
        anyio.run(nodes_main, endpoint, run_id, int(total), int(count), float(seconds))
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--nodes", type=int, default=1024)
    parser.add_argument("--procs", type=int, default=4)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    result = soak(args.nodes, args.procs, args.minutes)
    first, last = result["samples"][0], result["samples"][-1]
    store_flat, nodes_flat = flat(first["store"], last["store"]), flat(first["nodes"], last["nodes"])
    print(
        f"{args.nodes} nodes, {args.minutes:g} min: false evictions {result['evictions']}; store RSS "
        f"{first['store']:.1f} -> {last['store']:.1f} MiB ({'flat' if store_flat else 'GROWING'}); node processes "
        f"{first['nodes']:.1f} -> {last['nodes']:.1f} MiB ({'flat' if nodes_flat else 'GROWING'})"
    )
    if args.json is not None:

        def record(scenario: str, unit: str, samples: list[float]) -> dict[str, Any]:
            return {"scenario": scenario, "system": "aelastic", "param": args.nodes, "unit": unit,
                    "samples": samples, "better": "lower"}  # fmt: skip

        records = [
            record("all nodes joined", "s", [result["join_s"]]),
            record(f"false evictions in {args.minutes:g} min", "count", [float(result["evictions"])]),
            record("store RSS per minute", "MiB", [s["store"] for s in result["samples"]]),
            record("node processes RSS per minute", "MiB", [s["nodes"] for s in result["samples"]]),
        ]
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"benchmark": "soak", "records": records}, indent=1))
    if result["evictions"] or not (store_flat and nodes_flat):
        sys.exit(1)


if __name__ == "__main__":
    main()
