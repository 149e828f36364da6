"""Rendezvous of N nodes on loopback: torch's DynamicRendezvousHandler (c10d over torch's TCPStore) beside aelastic's
(c10d over aelastic's store, and etcd), in one run.

    python -m benchmarks.rendezvous [--quick] [--repeats N] [--json PATH]

Nodes run spread over a few worker processes (torch's handlers, which are blocking, as threads; aelastic's as tasks
of one event loop per process), all with ``min_nodes = max_nodes = N`` so a round completes when the N-th node
joins. Each worker opens its handlers first; timing starts when the harness says "go" and every node calls
``next_rendezvous``. Two scenarios per N:

* **release**: N-1 nodes join and wait (the harness watches the shared state until all N-1 are listed); then the
  last node joins. Measured: from the last node's ``next_rendezvous`` call to the moment the last node of all
  returns from its own (what torch's one-second polling floors at about 1 s).
* **total**: all N nodes join at once. Measured: from "go" to the last node released.

On etcd, a third system is the floor under the etcd rendezvous on this machine, **etcd-floor**: each node opens an
etcd client as a handler does and, on "go", makes only the requests that a node's join makes on the etcd backend
(a lease, its key, the digest read it decides on, the join request's txn that counts it, the read of its position
shard), one after the other,
with no rendezvous logic. etcd and the simulated nodes share the machine's cores, so the round cannot finish
faster than its requests can be served and sent; the ratio ``etcd / c10d`` is reported beside it.

Times are ``time.monotonic()`` (CLOCK_MONOTONIC, one clock for every process of the machine). Systems alternate
within each repetition. A third scenario, **heartbeat**, counts the requests and the bytes per second that N
completed nodes send to the store while they only keep alive (torch's and aelastic's nodes both against aelastic's
store server, which counts both; torch's keep-alive rewrites the whole state, O(N) bytes per beat, aelastic's adds
to a counter of its own).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.abc

TORCH_SERVER = """
import sys
from datetime import timedelta
import torch.distributed as dist
s = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=300))
print(s.port, flush=True)
sys.stdin.read()
"""
PROCESSES = 4  # worker processes per measurement (fewer when N is smaller)
SETTLE_POLL = 0.005  # how often the harness reads the shared state while N-1 nodes settle
KEEP_ALIVE = 5  # torch's default keep-alive interval (s): a loaded machine must not make live nodes look dead
HEARTBEAT_INTERVAL = 1  # the keep-alive interval in the heartbeat scenario, so a short window sees many beats
JOIN_TIMEOUT = 300.0
OPENING = 64  # handlers each worker process opens at a time (before the round: not measured)
# Once its nodes are open, a worker process freezes its heap (gc.freeze): it holds a thousand nodes' objects where
# an agent holds one node's, and each collection during the round would walk them all.


# --- worker processes ---------------------------------------------------------------------------------------------


def _report(starts: list[float], ends: list[float], errors: list[str], counters: dict[str, int] | None = None) -> None:
    print(json.dumps({"starts": starts, "ends": ends, "errors": errors, "counters": counters or {}}), flush=True)


def _conf(spec: dict[str, Any]) -> dict[str, Any]:
    conf: dict[str, Any] = {
        "join_timeout": JOIN_TIMEOUT, "last_call_timeout": 30, "keep_alive_interval": spec["keep_alive"]
    }  # fmt: skip
    if "etcd" in spec["system"]:  # aelastic-etcd here; the job's own etcd and an external one (benchmarks.job_etcd)
        conf["key_prefix"] = "/bench"
    else:
        conf["is_host"] = False
    return conf


def torch_worker(spec: dict[str, Any]) -> None:
    """``spec["count"]`` torch handlers as threads; each calls next_rendezvous on "go"."""
    from datetime import timedelta

    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler, RendezvousTimeout

    handlers = []
    for _ in range(spec["count"]):
        params = RendezvousParameters("c10d", spec["endpoint"], spec["run_id"], spec["n"], spec["n"], **_conf(spec))
        backend, store = create_backend(params)
        handlers.append(
            DynamicRendezvousHandler.from_backend(
                spec["run_id"],
                store,
                backend,
                spec["n"],
                spec["n"],
                "127.0.0.1",
                RendezvousTimeout(join=timedelta(seconds=JOIN_TIMEOUT), last_call=timedelta(seconds=30)),
                keep_alive_interval=spec["keep_alive"],
            )
        )
    gc.freeze()  # as the aelastic workers (OPENING)
    print("ready", flush=True)
    sys.stdin.readline()
    starts, ends, errors = [0.0] * len(handlers), [0.0] * len(handlers), []

    def node(i: int) -> None:
        starts[i] = time.monotonic()
        try:
            handlers[i].next_rendezvous()
        except Exception as exc:  # reported to the harness, which fails the measurement
            errors.append(repr(exc))
        ends[i] = time.monotonic()

    threads = [threading.Thread(target=node, args=(i,), daemon=True) for i in range(len(handlers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    _report(starts, ends, errors)
    sys.stdin.readline()  # stay alive (keeping alive) until the harness is done with this round
    os._exit(0)


# The handlers' statistics, by the names this benchmark has always reported them under.
COUNTERS = {
    "state_reads": "state reads",
    "state_bytes_read": "state bytes read",
    "digest_reads": "digest reads",
    "digest_bytes_read": "digest bytes read",
    "writes_won": "writes won",
    "writes_lost": "writes lost (CAS retry)",
    "wake_ups": "wake-ups",
    "join_requests": "join requests",
    "folds": "folds",
    "requests_folded": "requests folded",
}


def _counters(handlers: list[Any]) -> dict[str, int]:
    """The counters of ``handlers``' statistics (RendezvousStatistics), summed."""
    totals = dict.fromkeys(COUNTERS.values(), 0)
    for handler in handlers:
        stats = handler.statistics()
        for field, name in COUNTERS.items():
            totals[name] += getattr(stats, field)
    return totals


def _simulated_nodes(
    count: int,
    open_node: Callable[[int], AbstractAsyncContextManager[Any]],
    join: Callable[[Any, int], Awaitable[object]],
    counters: Callable[[list[Any]], dict[str, int]] | None = None,
) -> None:
    """``count`` nodes as tasks of one event loop: each opens ``open_node(i)`` (a few at a time), then on "go" the
    round is ``join(node, i)``, timed; reported to the harness with the work ``counters`` counts for the round."""

    async def main() -> None:
        opened, go, done = anyio.Event(), anyio.Event(), anyio.Event()
        starts, ends, errors = [0.0] * count, [0.0] * count, []
        nodes: list[Any] = []
        ready = finished = 0
        # Thousands of nodes opening at once would miss a server's handshake timeout: open a few at a time.
        opening = anyio.Semaphore(OPENING)

        async def node(i: int) -> None:
            # Each node opens in a task of its own: nodes opened one inside the other (an exit stack) would nest a
            # thousand cancel scopes, which anyio walks at every checkpoint.
            nonlocal ready, finished
            async with AsyncExitStack() as stack:
                async with opening:
                    opened_node = await stack.enter_async_context(open_node(i))
                nodes.append(opened_node)
                ready += 1
                if ready == count:
                    opened.set()
                await go.wait()
                starts[i] = time.monotonic()
                try:
                    await join(opened_node, i)
                except Exception as exc:  # reported to the harness, which fails the measurement
                    errors.append(repr(exc))
                ends[i] = time.monotonic()
                finished += 1
                if finished == count:
                    done.set()
                await anyio.sleep_forever()  # keep alive until the harness is done with this round

        async with anyio.create_task_group() as tg:
            for i in range(count):
                tg.start_soon(node, i)
            await opened.wait()
            gc.freeze()  # see OPENING's note on the heap
            print("ready", flush=True)
            await anyio.to_thread.run_sync(sys.stdin.readline)
            opening_work = counters(nodes) if counters else {}  # one round's work is reported, not the opening
            go.set()
            await done.wait()
            work = {k: v - opening_work[k] for k, v in counters(nodes).items()} if counters else {}
            _report(starts, ends, errors, {k: v for k, v in work.items() if v})
            await anyio.to_thread.run_sync(sys.stdin.readline)
            os._exit(0)  # 1000 nodes need not say goodbye one by one

    anyio.run(main)


def floor_worker(spec: dict[str, Any]) -> None:
    """``spec["count"]`` nodes that each open an etcd client and, on "go", make a join's requests (see the module
    docstring) and nothing else."""
    from aelastic.etcd import EtcdConfig, PutOp, RangeOp, open_etcd_client, parse_endpoints, prefix_range_end

    root = f"/floor/{spec['run_id']}".encode()
    joins = root + b"/joins/"
    counted = [RangeOp(root + b"/digest"), RangeOp(joins, prefix_range_end(joins), count_only=True)]

    async def join(client: Any, i: int) -> None:
        lease = await client.lease_grant(spec["keep_alive"] * 3)
        await client.put(root + b"/alive/%d" % i, b"", lease=lease.id)
        await client.range(counted[0])
        await client.txn([], [PutOp(joins + b"%d-%d" % (os.getpid(), i), b"x" * 120), *counted])
        await client.range(RangeOp(root + b"/pos/000000"))

    config = EtcdConfig(parse_endpoints(spec["endpoint"]))
    _simulated_nodes(spec["count"], lambda i: open_etcd_client(config), join)


def aelastic_worker(spec: dict[str, Any]) -> None:
    """``spec["count"]`` aelastic handlers as tasks of one event loop; each calls next_rendezvous on "go"."""
    from aelastic.rendezvous.api import RendezvousParameters
    from aelastic.rendezvous.registry import open_rendezvous

    backend = "etcd" if "etcd" in spec["system"] else "c10d"
    params = RendezvousParameters(
        backend, spec["endpoint"], spec["run_id"], spec["n"], spec["n"], "127.0.0.1", **_conf(spec)
    )
    _simulated_nodes(spec["count"], lambda i: open_rendezvous(params), lambda h, i: h.next_rendezvous(), _counters)


# --- the harness --------------------------------------------------------------------------------------------------


@dataclass
class Worker:
    process: anyio.abc.Process
    buffer: bytes = b""

    async def line(self) -> str:
        assert self.process.stdout is not None
        while b"\n" not in self.buffer:
            chunk = await self.process.stdout.receive()
            self.buffer += chunk
        line, _, self.buffer = self.buffer.partition(b"\n")
        return line.decode()

    async def send(self, text: str) -> None:
        assert self.process.stdin is not None
        await self.process.stdin.send(text.encode())


@dataclass
class System:
    name: str  # torch | aelastic | aelastic-etcd | etcd-floor
    endpoint: str
    count_listed: Callable[[str], Any]  # run_id -> awaitable participant count
    runs: int = 0
    ops: Callable[[], tuple[int, int]] | None = None  # the store's (requests, bytes received) so far
    stats: Callable[[], Any] | None = None  # the store server's ServerStatistics now


@asynccontextmanager
async def spawn_workers(
    system: str, endpoint: str, run_id: str, n: int, counts: list[int], keep_alive: int = KEEP_ALIVE
) -> AsyncIterator[list[Worker]]:
    workers: list[Worker] = []
    try:
        for count in counts:
            spec = {"system": system, "endpoint": endpoint, "run_id": run_id, "n": n, "count": count,
                    "keep_alive": keep_alive}  # fmt: skip
            cmd = [sys.executable, "-m", "benchmarks.rendezvous", "--worker", json.dumps(spec)]
            process = await anyio.open_process(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=None)
            workers.append(Worker(process))
        for w in workers:
            ready = await w.line()
            if ready != "ready":
                raise RuntimeError(f"{system} worker: {ready!r}")
        yield workers
    finally:
        with anyio.CancelScope(shield=True):
            for w in workers:
                if w.process.returncode is None:
                    w.process.kill()
                await w.process.wait()


def split(n: int, parts: int) -> list[int]:
    parts = max(1, min(parts, n))
    return [n // parts + (i < n % parts) for i in range(parts)]


async def results(workers: list[Worker], counters: dict[str, int] | None = None) -> tuple[list[float], list[float]]:
    """Every node's start and end times; ``counters`` (if given) gets the handlers' counters added in."""
    starts, ends = [], []
    for w in workers:
        doc = json.loads(await w.line())
        if doc["errors"]:
            raise RuntimeError(f"rendezvous failed: {doc['errors'][:3]}")
        starts += doc["starts"]
        ends += doc["ends"]
        if counters is not None:
            for name, value in doc["counters"].items():
                counters[name] = counters.get(name, 0) + value
    return starts, ends


async def measure_total(system: System, n: int) -> float:
    system.runs += 1
    run_id = f"total-{n}-{system.runs}"
    async with spawn_workers(system.name, system.endpoint, run_id, n, split(n, PROCESSES)) as workers:
        go = time.monotonic()
        for w in workers:
            await w.send("go\n")
        _, ends = await results(workers)
        return max(ends) - go


async def measure_release(system: System, n: int) -> float:
    system.runs += 1
    run_id = f"release-{n}-{system.runs}"
    async with (
        spawn_workers(system.name, system.endpoint, run_id, n, split(n - 1, PROCESSES)) as early,
        spawn_workers(system.name, system.endpoint, run_id, n, [1]) as (last,),
    ):
        for w in early:
            await w.send("go\n")
        # The harness samples the state (torch's offers no notification); the nodes under test never poll.
        while await system.count_listed(run_id) < n - 1:  # noqa: ASYNC110
            await anyio.sleep(SETTLE_POLL)
        await last.send("go\n")
        starts, ends = await results([last])
        _, early_ends = await results(early)
        return max(ends + early_ends) - starts[0]


async def measure_round(system: System, n: int) -> dict[str, Any]:
    """One all-at-once round of n nodes, instrumented: the total time, and what the store served for it (requests
    and reply bytes by kind, bytes received) beside what the handlers did (reads, writes, wake-ups, folds)."""
    assert system.stats is not None
    system.runs += 1
    run_id, handlers = f"round-{n}-{system.runs}", {}
    async with spawn_workers(system.name, system.endpoint, run_id, n, split(n, PROCESSES)) as workers:
        before, go = system.stats(), time.monotonic()
        for w in workers:
            await w.send("go\n")
        _, ends = await results(workers, handlers)
        total = max(ends) - go
        after = system.stats()
    requests = {k: v - before.ops_by_kind.get(k, 0) for k, v in after.ops_by_kind.items()}
    sent = {k: v - before.sent_by_kind.get(k, 0) for k, v in after.sent_by_kind.items()}
    return {
        "n": n,
        "total_s": total,
        "requests": sum(requests.values()),
        "bytes": (after.bytes_received - before.bytes_received) + (after.bytes_sent - before.bytes_sent),
        "requests_by_kind": {k: v for k, v in requests.items() if v},
        "bytes_sent_by_kind": {k: v for k, v in sent.items() if v},
        "bytes_received": after.bytes_received - before.bytes_received,
        "handlers": handlers,
    }


async def measure_heartbeat(system: System, n: int, window: float) -> tuple[float, float]:
    """Requests and bytes per second the store receives while n completed nodes only keep alive."""
    assert system.ops is not None
    system.runs += 1
    run_id, counts = f"beat-{n}-{system.runs}", split(n, PROCESSES)
    async with spawn_workers(system.name, system.endpoint, run_id, n, counts, HEARTBEAT_INTERVAL) as ws:
        for w in ws:
            await w.send("go\n")
        await results(ws)
        await anyio.sleep(HEARTBEAT_INTERVAL)  # let the joins' writes drain
        (ops, received), t0 = system.ops(), time.monotonic()
        await anyio.sleep(window)
        (ops_after, received_after), took = system.ops(), time.monotonic() - t0
        return (ops_after - ops) / took, (received_after - received) / took


# --- systems ------------------------------------------------------------------------------------------------------


@asynccontextmanager
async def torch_system() -> AsyncIterator[System]:
    from datetime import timedelta

    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend

    server = await anyio.open_process(
        [sys.executable, "-c", TORCH_SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    try:
        port = int((await Worker(server).line()).strip())
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))

        async def count_listed(run_id: str) -> int:
            import pickle

            got = C10dRendezvousBackend(store, run_id).get_state()
            return 0 if got is None else len(pickle.loads(got[0]).participants)

        yield System("torch", f"127.0.0.1:{port}", count_listed)
    finally:
        server.kill()
        await server.wait()


@asynccontextmanager
async def aelastic_system(max_connections: int | None = None) -> AsyncIterator[System]:
    from aelastic.rendezvous.backends.store import StoreBackend
    from aelastic.rendezvous.known import state_of
    from aelastic.store.client import open_store_client
    from aelastic.store.server import ServerSettings, open_store_server

    # The store serves in the harness's loop (the harness only waits), so its request counter can be read.
    settings = ServerSettings(max_connections=max_connections)
    async with (
        open_store_server("127.0.0.1", 0, settings) as server,
        open_store_client("127.0.0.1", server.port) as client,
    ):

        async def count_listed(run_id: str) -> int:
            return len(state_of(await StoreBackend(client, run_id).get_state()).participants)

        def ops() -> tuple[int, int]:
            stats = server.statistics()
            return stats.ops_served, stats.bytes_received

        yield System("aelastic", f"127.0.0.1:{server.port}", count_listed, ops=ops, stats=server.statistics)


@asynccontextmanager
async def etcd_system() -> AsyncIterator[System]:
    from aelastic.etcd import EtcdConfig, open_etcd_client, open_local_etcd, parse_endpoints
    from aelastic.rendezvous.backends.etcd import EtcdBackend
    from aelastic.rendezvous.known import state_of

    async with open_local_etcd() as etcd, open_etcd_client(EtcdConfig(parse_endpoints(etcd.endpoint))) as client:

        async def count_listed(run_id: str) -> int:
            backend = EtcdBackend(client, "/bench", run_id, lease_ttl=1)
            return len(state_of(await backend.get_state()).participants)

        yield System("aelastic-etcd", etcd.endpoint, count_listed)


# --- main ---------------------------------------------------------------------------------------------------------


async def run(quick: bool, repeats: int) -> list[dict[str, Any]]:
    plan = {
        "torch": [2, 8] if quick else [2, 8, 32],
        "aelastic": [2, 8, 256] if quick else [2, 8, 32, 256, 1024],
        "aelastic-etcd": [8] if quick else [8, 64, 256],
        "etcd-floor": [],
    }
    # The large rounds, all at once only: etcd beside c10d and beside its floor (the release latency is N-sized
    # already at 1,024 and says nothing more at 4,096).
    large = {"aelastic": [4096], "aelastic-etcd": [1024, 4096], "etcd-floor": [1024, 4096]} if not quick else {}
    heartbeat = {"torch": [8] if quick else [8, 32], "aelastic": [8] if quick else [8, 32, 256]}
    window = 2.0 if quick else 5.0
    samples: dict[tuple[str, str, int], list[float]] = {}
    async with torch_system() as torch, aelastic_system() as ours, etcd_system() as etcd:
        systems = [torch, ours, etcd, System("etcd-floor", etcd.endpoint, etcd.count_listed)]
        for rep in range(repeats):
            for system in systems if rep % 2 == 0 else systems[::-1]:
                for n in plan[system.name] + large.get(system.name, []):
                    scenarios = [("release", measure_release)] if n in plan[system.name] else []
                    for scenario, measure in (*scenarios, ("total", measure_total)):
                        value = await measure(system, n)
                        samples.setdefault((scenario, system.name, n), []).append(value)
                        print(f"  {system.name:<14} {scenario:<8} N={n:<5} {value * 1000:9.1f} ms", flush=True)
        # Heartbeats: torch's nodes against aelastic's counting server (the protocol is torch's TCPStore's).
        counted = System("torch", ours.endpoint, ours.count_listed, ops=ours.ops)
        for rep in range(repeats):
            for system in (counted, ours) if rep % 2 == 0 else (ours, counted):
                for n in heartbeat[system.name]:
                    requests, received = await measure_heartbeat(system, n, window)
                    samples.setdefault(("heartbeat", system.name, n), []).append(requests)
                    samples.setdefault(("heartbeat bytes", system.name, n), []).append(received)
                    line = f"  {system.name:<14} heartbeat N={n:<5} {requests:9.1f} req/s {received:11.0f} B/s"
                    print(line, flush=True)
    records = []
    for n in large.get("aelastic-etcd", []):  # per repetition: the systems ran side by side
        etcd_times, c10d_times = samples[("total", "aelastic-etcd", n)], samples[("total", "aelastic", n)]
        for name, times in (("aelastic-etcd", etcd_times), ("etcd-floor", samples[("total", "etcd-floor", n)])):
            records.append(_record("all N at once on etcd, over c10d's time (1.0: as fast)", name, n, "x",
                                   [e / c for e, c in zip(times, c10d_times, strict=True)], "lower"))  # fmt: skip
    for (scenario, system_name, n), values in samples.items():
        if scenario == "heartbeat":
            records.append(_record("heartbeat store requests per second (keep-alive only)", system_name, n, "ops/s",
                                   values, "lower"))  # fmt: skip
        elif scenario == "heartbeat bytes":
            records.append(_record("heartbeat bytes per second to the store (keep-alive only)", system_name, n,
                                   "B/s", values, "lower"))  # fmt: skip
        elif scenario == "release":
            records.append(_record("release: last join to last node released", system_name, n, "ms",
                                   [v * 1000 for v in values], "lower"))  # fmt: skip
        else:
            records.append(_record("total: all N join at once, until the last is released", system_name, n, "s",
                                   values, "lower"))  # fmt: skip
    return records


async def scale(
    sizes: list[int], release: bool, torch_sizes: list[int], max_connections: int | None
) -> list[dict[str, Any]]:
    """``--scale``: one instrumented all-at-once round per N (and the release latency) of aelastic (c10d), and of
    torch's handler at ``torch_sizes``, its nodes against the same counting store server (torch's protocol)."""
    import resource

    rounds = []
    async with aelastic_system(max_connections) as ours:
        counted = System("torch", ours.endpoint, ours.count_listed, stats=ours.stats)
        for system, ns in ((counted, torch_sizes), (ours, sizes)):
            for n in ns:
                doc = await measure_round(system, n)
                doc["system"] = system.name
                if release and system is ours:
                    doc["release_s"] = await measure_release(ours, n)
                # The store serves in this process: its peak RSS bounds the store's (the harness adds little).
                doc["store_peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
                rounds.append(doc)
                print(_describe(doc), flush=True)
    return rounds


def plot_scale(rounds: list[dict[str, Any]], path: str) -> None:
    """Bytes through the store per round against N, log axes, one line per system (``--plot``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for system in sorted({r["system"] for r in rounds}):
        points = sorted((r["n"], r["bytes"]) for r in rounds if r["system"] == system)
        ax.plot([n for n, _ in points], [b for _, b in points], marker="o", label=system)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("nodes (N)")
    ax.set_ylabel("bytes through the store per round")
    ax.set_title("rendezvous: store bytes per all-at-once round")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def _describe(doc: dict[str, Any]) -> str:
    n, handlers = doc["n"], doc["handlers"]
    lines = [
        f"{doc['system']} N={n}: total {doc['total_s']:.2f} s"
        + (f", release {doc['release_s'] * 1000:.0f} ms" if "release_s" in doc else "")
        + f", {doc['requests']} requests ({doc['requests'] / n:.1f}/node), {doc['bytes'] / 1e6:.2f} MB"
        f" ({doc['bytes'] / n:.0f} B/node), store peak RSS {doc['store_peak_rss_mb']:.0f} MB",
        "  store requests by kind: " + ", ".join(f"{k} {v}" for k, v in sorted(doc["requests_by_kind"].items())),
        "  store reply bytes by kind: "
        + ", ".join(f"{k} {v / 1e6:.2f} MB" for k, v in sorted(doc["bytes_sent_by_kind"].items())),
        f"  bytes received {doc['bytes_received'] / 1e6:.2f} MB",
        "  handlers: " + ", ".join(f"{k} {v} ({v / n:.2f}/node)" for k, v in sorted(handlers.items())),
    ]
    return "\n".join(lines)


def _record(scenario: str, system: str, n: int, unit: str, values: list[float], better: str) -> dict[str, Any]:
    return {"scenario": scenario, "system": system, "param": n, "unit": unit, "samples": values, "better": better}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small N, one repetition (about 30 s)")
    parser.add_argument("--repeats", type=int, default=None, help="repetitions (default 3; --quick: 1)")
    parser.add_argument("--json", default=None, help="write the records here")
    parser.add_argument(
        "--scale",
        type=int,
        nargs="+",
        default=None,
        metavar="N",
        help="instrument one all-at-once round of aelastic (c10d) at each N and say where it goes",
    )
    parser.add_argument("--no-release", action="store_true", help="--scale: skip the release-latency run")
    parser.add_argument(
        "--scale-torch",
        type=int,
        nargs="*",
        default=[],
        metavar="N",
        help="--scale: torch's handler at these N too, against the same counting store",
    )
    parser.add_argument("--plot", default=None, help="--scale: write the bytes-per-round plot (PNG) here")
    parser.add_argument(
        "--max-connections",
        type=int,
        default=None,
        help="--scale: the store's connection cap (default: the server's, half the open-file limit); a node holds "
        "more than one connection, so 10,000 nodes need more than a 20,000-file limit's default",
    )
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        spec = json.loads(args.worker)
        workers = {"torch": torch_worker, "etcd-floor": floor_worker}
        workers.get(spec["system"], aelastic_worker)(spec)
        return
    if args.scale:
        rounds = anyio.run(scale, args.scale, not args.no_release, args.scale_torch, args.max_connections)
        if args.plot:
            plot_scale(rounds, args.plot)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"benchmark": "rendezvous-scale", "rounds": rounds}, f)
        return
    repeats = args.repeats or (1 if args.quick else 3)
    records = anyio.run(run, args.quick, repeats)
    report("rendezvous", f"rendezvous, min = max = N, {os.cpu_count()} CPUs, {repeats} repetition(s)", records,
           args.json, digits=1)  # fmt: skip


def report(benchmark: str, title: str, records: list[dict[str, Any]], path: str | None, *, digits: int) -> None:
    """Print ``records``' medians (p50) and maxima under ``title``; write them to ``path`` (``--json``) if given."""
    print(f"\n{title}; medians (p50) and max")
    print(f"{'scenario':<58}{'system':<15}{'N':>6}{'p50':>12}{'max':>12}")
    for r in records:
        s = r["samples"]
        print(f"{r['scenario']:<58}{r['system']:<15}{r['param']:>6}{statistics.median(s):>10.{digits}f} "
              f"{r['unit']:<4}{max(s):>8.{digits}f} {r['unit']}")  # fmt: skip
    if path:
        with open(path, "w") as f:
            json.dump({"benchmark": benchmark, "records": records}, f)


if __name__ == "__main__":
    main()
