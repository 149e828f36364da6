"""The job's own etcd (issue 33) beside c10d and an external etcd: same machine, same run, systems alternating.

    python -m benchmarks.job_etcd [--quick] [--repeats N] [--json PATH]

Systems:

* ``c10d``: aelastic's store, served by one agent (the node whose loss ends the job);
* ``job etcd``: ``--rdzv-endpoint embedded:...``: three members started beside the agents of the first three nodes
  (:mod:`aelastic.etcd.embedded`), their data in ``/dev/shm`` with no fsync, the short per-member timeouts;
* ``external etcd``: a three-member cluster run beside the job as an operator runs it (started before the job,
  not timed): etcd's defaults, data on disk, fsync on every write.

Scenarios:

* ``start-up`` (N = 4): four agents on loopback addresses (127.0.0.1-4, ``--local-addr``), ``--nnodes 4``, one no-op
  worker each, all started at once; wall time until the last agent exits. For the job's own etcd this includes
  starting its members, their election, and stopping them again (nothing is left behind).
* ``release`` (N = 8, 64, 256): :mod:`benchmarks.rendezvous`'s release scenario: N-1 nodes wait, the last joins;
  from its ``next_rendezvous`` to the last node released. The job's etcd's members are started by three
  :func:`~aelastic.etcd.embedded.open_job_etcd` nodes of this process; the nodes under test are its clients.

The time from a host's death to the survivors training is measured by the fault suite and the Slurm tests
(``tests/faults/test_job_etcd.py``, ``tests/slurm/test_job_etcd.py``), which report to RESULTS.md's sections.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import anyio

from benchmarks.rendezvous import System, aelastic_system, measure_release, report

HOSTS = ("127.0.0.1", "127.0.0.2", "127.0.0.3", "127.0.0.4")
NOOP = "pass\n"
C10D, JOB, EXTERNAL = "c10d", "job etcd", "external etcd"
SYSTEMS = (C10D, JOB, EXTERNAL)


def free_pair() -> int:
    """A port P (the kernel's pick) such that P and P + 1 are free on every host."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port < 65534 and all(_free(h, p) for h in HOSTS for p in (port, port + 1)):
            return port


def _free(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


# --- start-up -----------------------------------------------------------------------------------------------------


def rendezvous_flags(system: str, port: int, external: str) -> list[str]:
    if system == C10D:
        return ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}"]
    if system == JOB:
        endpoint = "embedded:" + ",".join(HOSTS)
        return ["--rdzv-backend", "etcd", "--rdzv-endpoint", endpoint, "--rdzv-conf", f"etcd_port={port}"]
    return ["--rdzv-backend", "etcd", "--rdzv-endpoint", external, "--rdzv-conf", "key_prefix=/bench-start"]


def start_up_once(system: str, script: Path, external: str) -> float:
    port, run_id = free_pair(), f"start{time.monotonic_ns()}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.setdefault("AELASTIC_UVLOOP", "0")
    started = time.perf_counter()
    argv = [sys.executable, "-m", "aelastic", "run", "--nnodes", "4", "--nproc-per-node", "1", "--rdzv-id", run_id]
    flags = rendezvous_flags(system, port, external)
    procs = [
        subprocess.Popen(
            [*argv, "--local-addr", host, *flags, script], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        for host in HOSTS
    ]
    errors = []
    for proc in procs:
        try:
            _, stderr = proc.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            _, stderr = proc.communicate()
        if proc.returncode != 0:
            errors.append(f"exit {proc.returncode}: {stderr.decode(errors='replace')[-1500:]}")
    took = time.perf_counter() - started
    if errors:
        raise RuntimeError(f"{system} start-up of 4 agents failed: " + "\n".join(errors))
    return took


# --- systems for the release scenario --------------------------------------------------------------------------------


@asynccontextmanager
async def _etcd_system(name: str, endpoints: tuple[str, ...]) -> AsyncIterator[System]:
    from aelastic.etcd import EtcdConfig, open_etcd_client
    from aelastic.rendezvous.backends.etcd import EtcdBackend
    from aelastic.rendezvous.known import state_of

    async with open_etcd_client(EtcdConfig(endpoints)) as client:

        async def count_listed(run_id: str) -> int:
            backend = EtcdBackend(client, "/bench", run_id, lease_ttl=1)
            return len(state_of(await backend.get_state()).participants)

        yield System(name, ",".join(endpoints), count_listed)


@asynccontextmanager
async def job_etcd_system() -> AsyncIterator[System]:
    """The job's own etcd, its members started by three nodes of this process (127.0.0.1-3)."""
    from aelastic.etcd.embedded import JobEtcdSettings, open_job_etcd
    from aelastic.etcd.layout import Layout

    layout = Layout(HOSTS[:3], free_pair(), token="bench")
    started = [anyio.Event() for _ in layout.hosts]
    async with anyio.create_task_group() as tg:

        async def node(i: int, host: str) -> None:
            settings = JobEtcdSettings(layout, lease_ttl=15, local_addr=host)
            async with open_job_etcd(settings, "bench"):
                started[i].set()
                await anyio.sleep_forever()

        for i, host in enumerate(layout.hosts):
            tg.start_soon(node, i, host)
        for event in started:
            await event.wait()
        async with _etcd_system(JOB, tuple(map(layout.client_url, layout.hosts))) as system:
            yield system
        tg.cancel_scope.cancel()


@asynccontextmanager
async def external_etcd_system() -> AsyncIterator[System]:
    """Three members as an operator runs them: etcd's default timing, data on disk, fsync on."""
    from aelastic.etcd import open_local_etcd_cluster

    async with (
        open_local_etcd_cluster(3, fsync=True) as etcd,
        _etcd_system(EXTERNAL, etcd.endpoints) as system,
    ):
        yield system


# --- main ---------------------------------------------------------------------------------------------------------


async def run(quick: bool, repeats: int) -> list[dict[str, Any]]:
    samples: dict[tuple[str, str, int], list[float]] = {}
    sizes = [8, 64] if quick else [8, 64, 256]
    with tempfile.TemporaryDirectory(prefix="bench-job-etcd-") as tmp:
        script = Path(tmp) / "noop.py"
        script.write_text(NOOP)
        async with AsyncExitStack() as stack:
            systems = {
                C10D: await stack.enter_async_context(aelastic_system()),
                JOB: await stack.enter_async_context(job_etcd_system()),
                EXTERNAL: await stack.enter_async_context(external_etcd_system()),
            }
            for rep in range(repeats):
                order = SYSTEMS[rep % 3 :] + SYSTEMS[: rep % 3]  # each system in each position in turn
                for name in order:
                    took = await anyio.to_thread.run_sync(start_up_once, name, script, systems[EXTERNAL].endpoint)
                    samples.setdefault(("start-up", name, 4), []).append(took)
                    print(f"  {name:<14} start-up N=4   {took:8.3f} s", flush=True)
                    for n in sizes:
                        value = await measure_release(systems[name], n)
                        samples.setdefault(("release", name, n), []).append(value * 1000)
                        print(f"  {name:<14} release  N={n:<4} {value * 1000:8.1f} ms", flush=True)
    records = []
    for (scenario, system, n), values in samples.items():
        if scenario == "start-up":
            records.append(_record("start-up: 4 agents, no-op worker, until the last exits", system, n, "s", values))
        else:
            records.append(_record("release: last join to last node released", system, n, "ms", values))
    return records


def _record(scenario: str, system: str, n: int, unit: str, values: list[float]) -> dict[str, Any]:
    return {"scenario": scenario, "system": system, "param": n, "unit": unit, "samples": values, "better": "lower"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="N up to 64, one repetition")
    parser.add_argument("--repeats", type=int, default=None, help="repetitions (default 5; --quick: 1)")
    parser.add_argument("--json", default=None, help="write the records here")
    args = parser.parse_args()
    repeats = args.repeats or (1 if args.quick else 5)
    records = anyio.run(run, args.quick, repeats)
    report("job_etcd", f"job etcd, {os.cpu_count()} CPUs, {repeats} repetition(s)", records, args.json, digits=3)


if __name__ == "__main__":
    main()
