"""The workers' store at rank scale: N simulated ranks doing what ``init_process_group`` asks of the store, against
aelastic's store (asyncio and trio) and torch's libuv TCPStore server, in one run.

    python -m benchmarks.rank_scale [--quick] [--repeats N] [--ranks 1024,4096,16384] [--clients raw,torch]
                                    [--processes 4] [--json PATH]

Each rank does, on a connection of its own (torch's ``TCPStore`` client constructor, ``ProcessGroupNCCL``'s id
broadcast and ``_store_based_barrier``, in order): connect, VALIDATE, PING, ``ADD init/ 1``; rank 0 SETs a 128-byte
"NCCL id", every other rank WAITs for it and GETs it; then the store-based barrier: ``ADD key 1``, ``ADD key 0``,
the rank that sees N SETs ``key:last_worker``, and every rank WAITs for ``key:last_worker``. A rank is *released*
when that WAIT returns. The ranks are spread over ``--processes`` client processes, all told "go" at once; the
time is from "go" (``time.monotonic``, one clock for every process of the machine) to the last rank released.

Two kinds of client, the same for every server:

* **raw**: this module's own client over asyncio streams (uvloop in the client processes when installed), one
  coroutine per rank, requests encoded by :mod:`aelastic.store.wire`; a refused connect is retried after 10 ms;
* **torch**: torch's own C++ ``TCPStore`` client, one thread per rank (the client releases the GIL while it waits).

The servers, each in a process of its own, alternate within a repetition (the order rotates between repetitions):
``torch libuv`` (``TCPStore(is_master=True)``, torch's default libuv server), ``aelastic asyncio`` (``aelastic
store`` on asyncio's own loop, the default install), ``aelastic uvloop`` (the same on uvloop, the ``fast`` extra;
left out where uvloop is not installed) and ``aelastic trio`` (``AELASTIC_ASYNC_BACKEND=trio aelastic store``).
Per run: the time, the server's requests per second (client requests / time), its CPU seconds over the run and
the user-mode part of them (``/proc/PID/stat``), the client processes' CPU seconds (the machine's CPU is shared:
with the cores saturated, what the server spends the clients lack), its peak RSS (``VmHWM``, which for torch
includes ``import torch``) and its memory per connection (RSS with every rank connected and released, minus RSS
before "go", over N).

What it needs, and how torch is treated fairly on this machine kind (``shared/reference/hard-parts.md``):

* **open files**: every process here raises its soft ``RLIMIT_NOFILE`` to the hard limit (servers included, by
  ``preexec_fn``); N ranks need N + ~100 descriptors in the server and N / processes in each client process. A
  size that does not fit is skipped with a message. aelastic's store accepts connections up to its open-file
  limit less a reserve (``ServerSettings.max_connections``); torch's has no cap.
* **listen backlog**: torch's server calls ``listen(fd, -1)``, which this kernel takes as a backlog of 1 (Linux
  proper clamps it to ``somaxconn``). Every server process here runs with a tiny ``LD_PRELOAD`` shim (compiled
  with ``cc`` at start) that maps a negative backlog to ``somaxconn``, as Linux proper does; aelastic asks for
  16384, which the kernel caps at ``somaxconn`` anyway. ``--no-backlog-shim`` measures torch as it is here.
* **peer names**: torch's server resolves every peer's address in its loop thread (its dual-stack listener sees
  ``::ffff:127.0.0.1``); where that name is not in ``/etc/hosts`` the lookup goes to a DNS server that does not
  answer here, and a burst of 64 connections stalls the server 5 s (1,024 ranks took 100 s instead of 0.4 s).
  The benchmark checks that ``127.0.0.1`` and ``::ffff:127.0.0.1`` resolve locally and refuses to run (exit 2)
  otherwise: add e.g. ``::ffff:127.0.0.1 ip4-mapped-loopback`` and ``::1 ip6-loopback`` to ``/etc/hosts``
  (not ``localhost``: that would change what ``localhost`` resolves to).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

SYSTEMS = ("torch libuv", "aelastic asyncio", "aelastic uvloop", "aelastic trio")
CLIENTS = ("raw", "torch")
HOST = "127.0.0.1"
NCCL_ID = b"\x01" * 128  # ncclUniqueId is 128 bytes
BARRIER_KEY = "store_based_barrier_key:1"
RUN_TIMEOUT = float(os.environ.get("RANK_SCALE_TIMEOUT", 300))  # seconds one run may take before it counts as failed
CONNECT_RETRY = 0.01

TORCH_SERVER = """
import sys
from datetime import timedelta
import torch.distributed as dist
s = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=600))
print(s.port, flush=True)
sys.stdin.read()
"""

SHIM_SOURCE = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <sys/socket.h>
/* listen(fd, -1) as Linux proper does it: a negative backlog means somaxconn (this kernel makes it 1). */
int listen(int fd, int backlog) {
    static int (*real)(int, int);
    if (!real) real = (int (*)(int, int))dlsym(RTLD_NEXT, "listen");
    if (backlog < 0) {
        backlog = 4096;
        FILE *f = fopen("/proc/sys/net/core/somaxconn", "r");
        if (f) { if (fscanf(f, "%d", &backlog) != 1) backlog = 4096; fclose(f); }
    }
    return real(fd, backlog);
}
"""


def raise_nofile() -> int:
    """Soft RLIMIT_NOFILE up to the hard limit; returns the new soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        hard = 1 << 20
    if soft == resource.RLIM_INFINITY or soft >= hard:
        return soft if soft != resource.RLIM_INFINITY else hard
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard


# --- client processes -------------------------------------------------------------------------------------------


def _requests(rank: int, world: int) -> int:
    """Requests one rank sends (the raw client; the SET of ``last_worker`` is counted where it happens)."""
    return 3 + (1 if rank == 0 else 2) + 3  # VALIDATE PING ADD | SET or WAIT GET | ADD ADD WAIT


def _enter(out: dict[str, Any], rank: int, stage: str) -> None:
    """``rank`` starts ``stage``; the last rank to start each stage is when that stage began for all."""
    out["stage"][rank] = stage
    out["phases"][stage] = time.monotonic()


async def _raw_rank(rank: int, world: int, port: int, out: dict[str, Any]) -> None:
    from aelastic.store import wire

    enc = wire.encode_request
    barrier = BARRIER_KEY.encode()
    last = barrier + b":last_worker"
    while True:
        try:
            reader, writer = await asyncio.open_connection(HOST, port)
            break
        except OSError:
            out["retries"] += 1
            await asyncio.sleep(CONNECT_RETRY)
    _enter(out, rank, "validate")
    writer.write(enc(wire.Validate()) + enc(wire.Ping(rank)))
    if int.from_bytes(await reader.readexactly(4), "little") != rank:
        raise RuntimeError("PING answered with the wrong nonce")
    _enter(out, rank, "init")
    writer.write(enc(wire.Add(b"init/", 1)))
    await reader.readexactly(8)
    _enter(out, rank, "id")
    if rank == 0:
        writer.write(enc(wire.Set(b"nccl_id", NCCL_ID)))
    else:
        # As torch's client: the GET only once the WAIT returned (a server handles a pipelined GET at once).
        writer.write(enc(wire.Wait((b"nccl_id",))))
        await reader.readexactly(1)
        writer.write(enc(wire.Get(b"nccl_id")))
        n = int.from_bytes(await reader.readexactly(8), "little")
        if await reader.readexactly(n) != NCCL_ID:
            raise RuntimeError("GET returned the wrong id")
    _enter(out, rank, "barrier")
    writer.write(enc(wire.Add(barrier, 1)))
    await reader.readexactly(8)
    writer.write(enc(wire.Add(barrier, 0)))
    count = int.from_bytes(await reader.readexactly(8), "little", signed=True)
    if count == world:
        writer.write(enc(wire.Set(last, b"1")))
        out["requests"] += 1
    _enter(out, rank, "last_worker")
    writer.write(enc(wire.Wait((last,))))
    await reader.readexactly(1)
    _enter(out, rank, "released")
    out["released"] = max(out["released"], time.monotonic())
    out["requests"] += _requests(rank, world)
    out["writers"].append(writer)


def _torch_rank(store_cls: Any, rank: int, world: int, port: int, out: dict[str, Any], go: threading.Event) -> None:
    from datetime import timedelta

    go.wait()
    try:
        # VALIDATE, PING and (world_size given, wait_for_workers) ADD init/ 1, as init_process_group's store.
        store = store_cls(HOST, port, world, False, timedelta(seconds=RUN_TIMEOUT), True)
        if rank == 0:
            store.set("nccl_id", NCCL_ID)
        elif store.get("nccl_id") != NCCL_ID:  # WAIT, then GET
            raise RuntimeError("GET returned the wrong id")
        store.add(BARRIER_KEY, 1)
        extra = 0
        if store.add(BARRIER_KEY, 0) == world:
            store.set(BARRIER_KEY + ":last_worker", "1")
            extra = 1
        store.wait([BARRIER_KEY + ":last_worker"])
        now = time.monotonic()
        with out["lock"]:
            out["released"] = max(out["released"], now)
            out["requests"] += _requests(rank, world) + extra
            out["stores"].append(store)
    except Exception as exc:
        with out["lock"]:
            out["errors"].append(repr(exc))


def client_main() -> None:
    """A client process: ``KIND PORT WORLD FIRST COUNT`` in argv; "ready" out, "go" in, a JSON result out, "close"
    in."""
    kind, port, world, first, count = sys.argv[1], *map(int, sys.argv[2:6])
    raise_nofile()
    out: dict[str, Any] = {
        "released": 0.0,
        "requests": 0,
        "retries": 0,
        "errors": [],
        "writers": [],
        "stores": [],
        "stage": {},
        "phases": {},
    }
    ranks = range(first, first + count)
    if kind == "torch":
        import torch.distributed as dist

        threading.stack_size(256 * 1024)
        out["lock"] = threading.Lock()
        go = threading.Event()
        threads = [
            threading.Thread(target=_torch_rank, args=(dist.TCPStore, r, world, port, out, go), daemon=True)
            for r in ranks
        ]
        for t in threads:
            t.start()
        print("ready", flush=True)
        sys.stdin.readline()
        go.set()
        for t in threads:
            t.join()
    else:
        try:
            import uvloop

            loop_factory: Any = uvloop.new_event_loop
        except ImportError:
            loop_factory = asyncio.new_event_loop
        print("ready", flush=True)
        sys.stdin.readline()

        async def all_ranks() -> None:
            tasks = [asyncio.ensure_future(_raw_rank(r, world, port, out)) for r in ranks]
            done, pending = await asyncio.wait(tasks, timeout=RUN_TIMEOUT)
            for task in pending:
                task.cancel()
            if pending:
                stages = Counter(out["stage"].get(r, "connect") for r in ranks)
                out["errors"].append(f"{len(pending)} ranks not released after {RUN_TIMEOUT} s: {dict(stages)}")
            out["errors"] += [repr(t.exception()) for t in done if t.exception() is not None]

        with asyncio.Runner(loop_factory=loop_factory) as runner:
            runner.run(all_ranks())
            result = {k: out[k] for k in ("released", "requests", "retries", "phases")}
            result["errors"] = out["errors"][:3]
            print(json.dumps(result), flush=True)
            sys.stdin.readline()  # "close": the connections stay open until the harness has read the server's RSS
            for writer in out["writers"]:
                writer.close()
        return
    result = {k: out[k] for k in ("released", "requests", "retries", "phases")} | {"errors": out["errors"][:3]}
    print(json.dumps(result), flush=True)
    sys.stdin.readline()
    out["stores"].clear()


# --- servers ----------------------------------------------------------------------------------------------------


def build_shim(directory: Path) -> Path | None:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    source = directory / "listen_backlog.c"
    source.write_text(SHIM_SOURCE)
    library = directory / "listen_backlog.so"
    subprocess.run([cc, "-shared", "-fPIC", "-O2", "-o", str(library), str(source), "-ldl"], check=True)
    return library


@contextmanager
def serve(system: str, shim: Path | None) -> Iterator[tuple[int, int]]:
    """Start ``system``'s server in a process of its own; yields (port, pid)."""
    env = dict(os.environ)
    if shim is not None:
        env["LD_PRELOAD"] = f"{shim} {env['LD_PRELOAD']}" if env.get("LD_PRELOAD") else str(shim)
    if system == "torch libuv":
        cmd = [sys.executable, "-c", TORCH_SERVER]
    else:
        cmd = [sys.executable, "-m", "aelastic", "store", "--host", HOST, "--port", "0"]
        profile = os.environ.get("RANK_SCALE_PROFILE")  # a directory: aelastic's servers run under cProfile
        if profile:
            out = Path(profile) / f"{system.replace(' ', '-')}-{time.monotonic_ns()}.prof"
            code = (
                "import cProfile, sys\nfrom aelastic.cli import main\np = cProfile.Profile()\np.enable()\n"
                f"try:\n    main(sys.argv[1:])\nfinally:\n    p.disable()\n    p.dump_stats({str(out)!r})\n"
            )
            cmd[1:3] = ["-c", code]
        env["AELASTIC_ASYNC_BACKEND"] = "trio" if system == "aelastic trio" else "asyncio"
        env["AELASTIC_UVLOOP"] = "1" if system == "aelastic uvloop" else "0"  # asyncio's own loop, or uvloop
    proc = subprocess.Popen(
        cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, preexec_fn=raise_nofile
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # torch: "PORT"; aelastic: "aelastic store listening on HOST:PORT"
        if not line:
            raise RuntimeError(f"{system} store server exited with {proc.wait()} before listening")
        yield (int(line.split()[0]) if system.startswith("torch") else int(line.rsplit(":", 1)[1])), proc.pid
    finally:
        proc.terminate()
        proc.wait(30)


def cpu_seconds(pid: int) -> tuple[float, float]:
    """User and system CPU seconds of process ``pid`` so far (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def memory_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/{pid}/status")


def run_once(system: str, client: str, ranks: int, processes: int, shim: Path | None) -> dict[str, float]:
    """One run of ``ranks`` ranks against a fresh server; the figures of that run."""
    share, extra = divmod(ranks, processes)
    with serve(system, shim) as (port, pid):
        procs = []
        first = 0
        try:
            for i in range(processes):
                count = share + (1 if i < extra else 0)
                args = [client, str(port), str(ranks), str(first), str(count)]
                code = "from benchmarks.rank_scale import client_main; client_main()"
                procs.append(
                    subprocess.Popen(
                        [sys.executable, "-c", code, *args],
                        stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE,
                        text=True,
                        cwd=Path(__file__).resolve().parent.parent,
                    )
                )
                first += count
            for p in procs:
                assert p.stdout is not None
                if p.stdout.readline().strip() != "ready":
                    raise RuntimeError(f"a {client} client process exited with {p.wait()} before it was ready")
            time.sleep(0.2)  # let the server settle after the clients' start-up
            rss_before = memory_kib(pid, "VmRSS")
            cpu_before = cpu_seconds(pid)
            clients_before = sum(sum(cpu_seconds(p.pid)) for p in procs)
            go = time.monotonic()
            for p in procs:
                assert p.stdin is not None
                p.stdin.write("go\n")
                p.stdin.flush()
            results = []
            for p in procs:
                assert p.stdout is not None
                line = p.stdout.readline()
                if not line:
                    raise RuntimeError(f"a {client} client process exited with {p.wait()} during the run")
                results.append(json.loads(line))
            user, system_cpu = (after - before for after, before in zip(cpu_seconds(pid), cpu_before, strict=True))
            clients_cpu = sum(sum(cpu_seconds(p.pid)) for p in procs) - clients_before
            rss_connected = memory_kib(pid, "VmRSS")
            peak = memory_kib(pid, "VmHWM")
            for p in procs:
                assert p.stdin is not None
                p.stdin.write("close\n")
                p.stdin.flush()
            for p in procs:
                p.wait(RUN_TIMEOUT)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
    errors = [e for r in results for e in r["errors"]]
    if errors:
        raise RuntimeError(f"{system}, {client} client, {ranks} ranks: {errors[:3]}")
    took = max(r["released"] for r in results) - go
    phases: dict[str, float] = {}
    for r in results:
        for stage, at in r.get("phases", {}).items():
            phases[stage] = max(phases.get(stage, 0.0), at - go)
    if os.environ.get("RANK_SCALE_PHASES"):
        print(f"    phases (the last rank to enter each): {phases}", file=sys.stderr)
    requests = sum(r["requests"] for r in results)
    return {
        "time": took,
        "requests/s": requests / took,
        "server CPU": user + system_cpu,
        "server CPU, user": user,
        "clients' CPU": clients_cpu,
        "peak RSS": peak / 1024,
        "memory per connection": max(0, rss_connected - rss_before) * 1024 / ranks,
        "connect retries": sum(r["retries"] for r in results),
    }


UNITS = {
    "time": ("s", "lower"),
    "requests/s": ("req/s", "higher"),
    "server CPU": ("s", "lower"),
    "server CPU, user": ("s", "lower"),
    "clients' CPU": ("s", "lower"),
    "peak RSS": ("MiB", "lower"),
    "memory per connection": ("B", "lower"),
}


def check_peer_lookup() -> str | None:
    """torch's server resolves each peer's address to a name in its loop thread; on this machine kind a name that
    is not in ``/etc/hosts`` goes to a DNS server that does not answer, and the server stalls 5 s."""
    for address in ("127.0.0.1", "::ffff:127.0.0.1"):
        sockaddr = (address, 0) if "." in address and ":" not in address else (address, 0, 0, 0)
        began = time.monotonic()
        try:
            socket.getnameinfo(sockaddr, socket.NI_NAMEREQD)
        except OSError:
            return (
                f"{address} does not resolve to a name locally: torch's server would stall on each connection; "
                f"add e.g. '{address} ip4-mapped-loopback' to /etc/hosts (any name but 'localhost', which would "
                "change what localhost resolves to)"
            )
        took = time.monotonic() - began
        if took > 0.5:
            return f"looking up {address} took {took:.1f} s: torch's server would stall that long per connection"
    return None


def measure(
    sizes: list[int],
    clients: list[str],
    systems: tuple[str, ...],
    repeats: int,
    processes: int,
    shim: Path | None,
    torch_max: int,
) -> list[dict[str, Any]]:
    limit = raise_nofile()
    samples: dict[tuple[str, str, int], list[float]] = {}
    for ranks in sizes:
        if ranks + 256 > limit or ranks // processes + 64 > limit:
            print(f"  {ranks} ranks: skipped, the open-file limit is {limit} (ulimit -Hn)", file=sys.stderr)
            continue
        for client in clients:
            if client == "torch" and ranks > torch_max:
                continue
            for repeat in range(repeats):
                order = systems[repeat % len(systems) :] + systems[: repeat % len(systems)]
                for system in order:
                    try:
                        figures = run_once(system, client, ranks, processes, shim)
                    except Exception as exc:
                        print(f"  {system}, {client} client, {ranks} ranks: FAILED: {exc}", file=sys.stderr)
                        continue
                    for name, value in figures.items():
                        samples.setdefault((f"{client} client: {name}", system, ranks), []).append(value)
                    print(
                        f"  {ranks} ranks, {client} client, {system}: {figures['time']:.3f} s, "
                        f"{figures['requests/s']:,.0f} req/s, CPU {figures['server CPU']:.2f} s, "
                        f"peak {figures['peak RSS']:.0f} MiB, {figures['memory per connection']:,.0f} B/conn, "
                        f"{figures['connect retries']} connect retries (load {os.getloadavg()[0]:.2f})",
                        file=sys.stderr,
                        flush=True,
                    )
    records = []
    for (scenario, system, ranks), values in samples.items():
        name = scenario.split(": ", 1)[1]
        if name not in UNITS:
            continue
        unit, better = UNITS[name]
        records.append(
            {"scenario": scenario, "system": system, "param": ranks, "unit": unit, "samples": values, "better": better}
        )
    return records


def print_table(records: list[dict[str, Any]]) -> None:
    med = {(r["scenario"], r["system"], r["param"]): statistics.median(r["samples"]) for r in records}
    print(f"rank scale, medians; load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    for (scenario, system, ranks), value in sorted(med.items(), key=lambda kv: (kv[0][0], kv[0][2], kv[0][1])):
        torch = med.get((scenario, "torch libuv", ranks))
        ratio = f"  {value / torch:.2f}x torch" if torch and system != "torch libuv" else ""
        print(f"{scenario:<36}{ranks:>7}  {system:<18}{value:>14,.3f}{ratio}")


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: must be a comma list of integers") from None
    if not values or min(values) < 2:
        raise argparse.ArgumentTypeError(f"{text!r}: every size must be >= 2")
    return values


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.rank_scale", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: 1,024 ranks, raw client, 1 repetition")
    parser.add_argument("--repeats", type=int, default=None, help="repetitions per server (default 3, quick 1)")
    parser.add_argument("--ranks", type=_int_list, default=None, help="sizes (default 1024,4096,16384)")
    parser.add_argument("--clients", default=None, help="client kinds, comma list of raw,torch (default both)")
    parser.add_argument("--torch-client-max", type=int, default=4096,
                        help="largest size run with torch's client, a thread per rank (default 4096)")  # fmt: skip
    parser.add_argument("--systems", default=",".join(SYSTEMS), help=f"servers (default {','.join(SYSTEMS)})")
    parser.add_argument("--processes", type=int, default=4, help="client processes (default 4)")
    parser.add_argument("--no-backlog-shim", action="store_true", help="torch's listen(fd, -1) as this kernel has it")
    parser.add_argument("--json", type=Path, default=None, help="write the records here")
    args = parser.parse_args(argv)
    repeats = args.repeats or (1 if args.quick else 3)
    sizes = args.ranks or ([1024] if args.quick else [1024, 4096, 16384])
    clients = (args.clients or ("raw" if args.quick else "raw,torch")).split(",")
    if set(clients) - set(CLIENTS):
        parser.error(f"--clients {args.clients!r}: choose from {', '.join(CLIENTS)}")
    systems = tuple(args.systems.split(","))
    if set(systems) - set(SYSTEMS):
        parser.error(f"--systems {args.systems!r}: choose from {', '.join(SYSTEMS)}")
    if repeats < 1 or args.processes < 1:
        parser.error(f"--repeats {repeats} / --processes {args.processes}: must be >= 1")
    if "aelastic uvloop" in systems and importlib.util.find_spec("uvloop") is None:
        print("rank_scale: uvloop is not installed (pip install 'aelastic[fast]'): 'aelastic uvloop' left out",
              file=sys.stderr)  # fmt: skip
        systems = tuple(s for s in systems if s != "aelastic uvloop")
    problem = check_peer_lookup() if "torch libuv" in systems else None
    if problem and not args.quick:
        print(f"rank_scale: {problem}", file=sys.stderr)
        return 2
    if problem:  # the CI smoke run measures aelastic's servers alone rather than fail
        print(f"rank_scale: {problem}; --quick: torch's server is left out", file=sys.stderr)
        systems = tuple(s for s in systems if s != "torch libuv")
    with tempfile.TemporaryDirectory(prefix="rank_scale-") as tmp:
        shim = None if args.no_backlog_shim else build_shim(Path(tmp))
        if shim is None and not args.no_backlog_shim:
            print("rank_scale: no C compiler: torch's server runs with this kernel's backlog of 1", file=sys.stderr)
        records = measure(sizes, clients, systems, repeats, args.processes, shim, args.torch_client_max)
    print_table(records)
    if args.json is not None:
        meta = {"load_average": os.getloadavg(), "backlog_shim": shim is not None, "processes": args.processes}
        args.json.write_text(json.dumps({"benchmark": "rank_scale", "meta": meta, "records": records}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
