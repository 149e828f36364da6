"""The agent: torchrun beside ``aelastic run``, same machine, same run, alternating within each repetition.

    python -m benchmarks.agent [--quick] [--repeats N] [--json PATH] [--recovery-only [--first-step] | --launch-only]

Scenarios:

* ``launch``: ``--standalone --nproc-per-node 2`` of a no-op script; wall time of the whole launcher process, from
  exec to exit.
* ``recovery``: ``--standalone --nproc-per-node 2 --max-restarts 1``; both workers import torch and pass
  ``init_process_group("gloo")``, then local rank 1 of the first attempt crashes (``os._exit(1)``). Measured from
  the crash (the worker's ``time.time()`` just before exiting, once the harness says go: at once, or with
  ``--prewarm`` once the next attempt's standbys have finished preloading, as in a job that crashes minutes in)
  to the moment the last worker of the second attempt is past ``init_process_group`` again (its own
  ``time.time()``). torchrun runs with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: by default its restarted workers
  reuse the dead attempt's store and most restarts fail with "Connection refused" (3 of 8 recovered when
  measured), which would leave nothing to time.
* ``error recovery``: ``recovery`` with an uncaught error instead of ``os._exit(1)`` (the interpreter's teardown,
  with torch and a gloo group, follows the traceback; an aelastic worker reports its failure before it), measured
  to the last restarted worker past ``init_process_group`` and a barrier (issue 29).
* ``respawn``: the launcher's share of ``recovery``: from the crash to the last restarted worker running the first
  line of its script (before it imports torch). The rest of ``recovery`` is the worker's own start: importing torch
  and joining the gloo group, the same under either launcher.
* ``agent RSS``: the agent process's peak resident set (``VmHWM``) over the recovery run; for torchrun its agent
  process. ``aelastic+reaper`` adds aelastic's reaper sidecar, a second small process.
* ``first step``: a 2-node c10d job (one worker each) whose second node starts 2 s after the first; from the first
  node's start to both workers past ``init_process_group``.
* ``aelastic --prewarm`` (issue 13) runs ``first step``, ``recovery``, ``respawn`` and ``agent RSS`` beside the
  others: its workers start in standby interpreters that have imported torch. ``standby RSS``: the peak resident
  set of one idle standby (median over the standbys of the run that never became workers), the price of
  ``--prewarm`` per local rank.
* ``c10d launch`` (N = 2, 4): N agents on loopback, ``--nnodes N --rdzv-backend c10d``, one no-op worker each,
  all started at once; wall time until the last agent exits.
* ``scale-up``: one agent (``--nnodes 1:2``) runs a worker that waits in a world of 1; a second agent starts.
  Measured from the second agent's start to the last worker of the world of 2 past ``init_process_group``: the
  waiting node's detection, the restart of the running node's worker, the new round and the workers' start.
  Both launchers get ``last_call_timeout=1`` (torch's default 30 s would dominate the first round of one node).

Targets (issue 4): aelastic ≤ 0.3× torchrun for ``launch`` and ``recovery``; aelastic's agent under 60 MiB.
Target (issue 13): ``recovery`` with ``--prewarm`` ≤ 0.2× torchrun. Target (issue 29): ``error recovery`` with
``--prewarm`` ≤ 0.1× torchrun.

``--recovery-only`` runs the recovery scenarios alone (``--first-step`` adds the first-step scenario to them);
``--launch-only`` the standalone no-op launch alone (``3 * repeats`` launches of each launcher).
"""

from __future__ import annotations

import argparse
import compileall
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path

import aelastic

from .run import aelastic_install

SYSTEMS = ("torch", "aelastic")
PREWARM = "aelastic --prewarm"
RECOVERY_SYSTEMS = (*SYSTEMS, PREWARM)

NOOP = "pass\n"

CRASH_ONCE = """\
import os, sys, time
started = time.time()
attempt, rank = os.environ["TORCHELASTIC_RESTART_COUNT"], os.environ["LOCAL_RANK"]
open(os.path.join(sys.argv[1], f"pid-{os.getpid()}"), "w").close()  # workers are not standbys (standby RSS)
import torch.distributed as dist
dist.init_process_group("gloo", init_method="env://")
past_init = time.time()
if attempt == "0":
    dist.barrier()  # every worker of the first attempt is past init before the crash
    if rank == "1":
        open(os.path.join(sys.argv[1], "ready"), "w").close()
        while not os.path.exists(os.path.join(sys.argv[1], "go")):  # the harness says when (see recovery_once)
            time.sleep(0.005)
        with open(os.path.join(sys.argv[1], "crash"), "w") as f:
            f.write(repr(time.time()))
        if sys.argv[2] == "raise":  # an uncaught error: the interpreter's teardown follows (gloo, torch loaded)
            raise RuntimeError("the crash the benchmark measures")
        os._exit(1)
    time.sleep(600)  # the agent stops this survivor when its peer crashes
dist.barrier()
past_barrier = time.time()
with open(os.path.join(sys.argv[1], f"init-{attempt}-{rank}"), "w") as f:
    f.write(f"{started!r} {past_init!r} {past_barrier!r}")
dist.barrier()
dist.destroy_process_group()
"""

# A world of 1 waits (its agent stops it when the second node arrives); a world of 2 reports and ends the job.
SCALE_UP = """\
import os, sys, time
import torch.distributed as dist
dist.init_process_group("gloo", init_method="env://")
past_init = time.time()
world = dist.get_world_size()
if world == 1:
    open(os.path.join(sys.argv[1], "running-1"), "w").close()
    time.sleep(600)
with open(os.path.join(sys.argv[1], f"init-{world}-{os.environ['RANK']}"), "w") as f:
    f.write(repr(past_init))
dist.barrier()
dist.destroy_process_group()
"""


FIRST_STEP = """\
import os, sys, time
import torch.distributed as dist
dist.init_process_group("gloo", init_method="env://")
with open(os.path.join(sys.argv[1], f"init-{os.environ['RANK']}"), "w") as f:
    f.write(repr(time.time()))
dist.barrier()
dist.destroy_process_group()
"""

LATE_JOIN = 2.0  # seconds between the first node's start and the second's, in the first-step scenario


def launcher(system: str, *args: str | os.PathLike[str]) -> list[str]:
    if system == "torch":
        return [sys.executable, "-m", "torch.distributed.run", *map(str, args)]
    flags = ["--prewarm"] if system == PREWARM else []
    return [sys.executable, "-m", "aelastic", "run", *flags, *map(str, args)]


def environment(system: str) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.setdefault("AELASTIC_UVLOOP", "0")  # the default install's loop, also where the fast extra is installed
    if system == "torch":
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    return env


def launch_once(system: str, script: Path) -> float:
    started = time.perf_counter()
    proc = subprocess.run(
        launcher(system, "--standalone", "--nproc-per-node", "2", script),
        env=environment(system), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, check=False, timeout=120,
    )  # fmt: skip
    took = time.perf_counter() - started
    if proc.returncode != 0:
        raise RuntimeError(f"{system} no-op launch failed ({proc.returncode}): {proc.stderr.decode()[-2000:]}")
    return took


def peak_rss_mib(pid: int) -> float | None:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    kib = next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM:")), None)
    return None if kib is None else kib / 1024


def children_running(pid: int, marker: bytes) -> list[int]:
    """The children of ``pid`` whose command line contains ``marker``."""
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return []
    found = []
    for child in map(int, children):
        with suppress(OSError):
            if marker in Path(f"/proc/{child}/cmdline").read_bytes():
                found.append(child)
    return found


def reaper_of(pid: int) -> int | None:
    """aelastic's reaper sidecar: the agent's child running ``reaper/child.py``."""
    return next(iter(children_running(pid, b"reaper/child.py")), None)


@dataclass
class Recovery:
    seconds: float  # crash to every restarted worker past init_process_group
    respawn: float  # crash to every restarted worker running its first line (before it imports torch)
    barrier: float  # crash to every restarted worker past init_process_group and a barrier
    agent_mib: float
    reaper_mib: float = 0.0
    standby_mib: float | None = None  # median peak RSS of the standbys that stayed idle (--prewarm)


@contextmanager
def scratch() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="aelastic_bench_") as tmp:
        yield Path(tmp)


def recovery_once(system: str, script: Path, crash: str = "exit") -> Recovery:
    with scratch() as out:
        proc = subprocess.Popen(
            launcher(system, "--standalone", "--nproc-per-node", "2", "--max-restarts", "1", script, out, crash),
            env=environment(system), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )  # fmt: skip
        agent_mib = reaper_mib = 0.0
        reaper: int | None = None
        standbys: dict[int, float] = {}
        deadline = time.monotonic() + 180
        # VmHWM is a high-water mark: the last reading before the exit is the peak. Sampling costs the harness
        # (not the launcher) a /proc read every 20 ms.
        while proc.poll() is None:
            agent_mib = max(agent_mib, peak_rss_mib(proc.pid) or 0.0)
            if system != "torch":
                reaper = reaper or reaper_of(proc.pid)
                if reaper is not None:
                    reaper_mib = max(reaper_mib, peak_rss_mib(reaper) or 0.0)
            for pid in children_running(proc.pid, b"aelastic.worker._standby") if system == PREWARM else ():
                standbys[pid] = max(standbys.get(pid, 0.0), peak_rss_mib(pid) or 0.0)
            if (out / "ready").exists() and not (out / "go").exists() and steady(system, proc.pid, out):
                (out / "go").touch()
            if time.monotonic() > deadline:
                proc.kill()
            time.sleep(0.02)
        assert proc.stderr is not None
        stderr = proc.stderr.read().decode(errors="replace")
        proc.stderr.close()
        inits = sorted(out.glob("init-1-*"))
        if proc.returncode != 0 or len(inits) != 2 or not (out / "crash").exists():
            raise RuntimeError(f"{system} recovery run failed ({proc.returncode}): {stderr[-3000:]}")
        crashed = float((out / "crash").read_text())
        started, past_init, past_barrier = zip(*(map(float, p.read_text().split()) for p in inits), strict=True)
        workers = {int(p.name.split("-")[1]) for p in out.glob("pid-*")}
        idle = [mib for pid, mib in standbys.items() if pid not in workers and mib > 0]
        standby_mib = statistics.median(idle) if idle else None
        return Recovery(max(past_init) - crashed, max(started) - crashed, max(past_barrier) - crashed, agent_mib,
                        reaper_mib, standby_mib)  # fmt: skip


# recvmsg(2): where an idle standby sleeps once its preload is done.
RECVMSG = {"x86_64": 47, "aarch64": 212}.get(platform.machine())


def steady(system: str, agent: int, out: Path) -> bool:
    """Whether the job is in its steady state, where a crash is measured: for ``--prewarm``, the next attempt's
    standbys have finished their preload (a real job crashes minutes in, not while they import torch)."""
    if system != PREWARM:
        return True
    workers = {int(p.name.split("-")[1]) for p in out.glob("pid-*")}
    idle = [pid for pid in children_running(agent, b"aelastic.worker._standby") if pid not in workers]
    try:
        return len(idle) == 2 and all(
            Path(f"/proc/{pid}/syscall").read_text().split()[0] == str(RECVMSG) for pid in idle
        )
    except OSError:
        return False


def free_port() -> int:
    """A port for the c10d store that N agents share (the first to bind it serves it; the others connect)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def c10d_flags(nnodes: str, run_id: str, port: int, *conf: str) -> list[str]:
    flags = ["--nnodes", nnodes, "--nproc-per-node", "1", "--rdzv-backend", "c10d"]
    flags += ["--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_id]
    return flags + (["--rdzv-conf", ",".join(conf)] if conf else [])


def finish(system: str, procs: list[subprocess.Popen[bytes]], what: str) -> list[str]:
    """Wait for every agent (killing them all if one takes too long) and fail on any non-zero exit; returns each
    agent's stderr."""
    deadline = time.monotonic() + 180
    errors, outputs = [], []
    for proc in procs:
        try:
            _, stderr = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            _, stderr = proc.communicate()
        outputs.append(stderr.decode(errors="replace"))
        if proc.returncode != 0:
            errors.append(f"exit {proc.returncode}: {outputs[-1][-1500:]}")
    if errors:
        raise RuntimeError(f"{system} {what} failed: " + "\n".join(errors))
    return outputs


def c10d_launch(system: str, script: Path, nodes: int, *flags: str, env: dict[str, str] | None = None
                ) -> tuple[float, list[str]]:  # fmt: skip
    """``nodes`` agents of ``system`` (``flags`` before the script, ``env`` added to theirs) started at once: the
    wall time until the last exits, and each agent's stderr."""
    port, run_id = free_port(), f"bench{time.monotonic_ns()}"
    argv = launcher(system, *c10d_flags(str(nodes), run_id, port), *flags, script)
    env = {**environment(system), **(env or {})}
    started = time.perf_counter()
    procs = [subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) for _ in range(nodes)]
    outputs = finish(system, procs, f"c10d launch of {nodes} agents")
    return time.perf_counter() - started, outputs


def c10d_launch_once(system: str, script: Path, nodes: int) -> float:
    return c10d_launch(system, script, nodes)[0]


def scale_up_once(system: str, script: Path) -> float:
    port, run_id = free_port(), f"bench{time.monotonic_ns()}"
    argv = launcher(system, *c10d_flags("1:2", run_id, port, "last_call_timeout=1"), script)
    with scratch() as out:
        env = environment(system)
        first = subprocess.Popen([*argv, out], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 120
        while not (out / "running-1").exists():  # the world of 1 is past init_process_group (a file, no event)
            if first.poll() is not None or time.monotonic() > deadline:
                first.kill()
                finish(system, [first], "scale-up (first node)")
                raise RuntimeError(f"{system} scale-up: the first node's worker never started")
            time.sleep(0.02)
        joined = time.time()
        second = subprocess.Popen([*argv, out], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        finish(system, [first, second], "scale-up")
        return last_init(system, out, "init-2-*", "scale-up (the world of 2)") - joined


def first_step_once(system: str, script: Path) -> float:
    """First node's start to both nodes' workers past ``init_process_group``; the second node starts
    :data:`LATE_JOIN` seconds after the first."""
    port, run_id = free_port(), f"bench{time.monotonic_ns()}"
    argv = launcher(system, *c10d_flags("2", run_id, port), script)
    with scratch() as out:
        env = environment(system)
        started = time.time()
        first = subprocess.Popen([*argv, out], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        time.sleep(LATE_JOIN)  # the scenario: a node that joins late
        second = subprocess.Popen([*argv, out], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        finish(system, [first, second], "first step")
        return last_init(system, out, "init-*", "first step") - started


def last_init(system: str, out: Path, pattern: str, what: str) -> float:
    """When the later of the two workers whose reports match ``pattern`` passed ``init_process_group`` (epoch s)."""
    inits = sorted(out.glob(pattern))
    if len(inits) != 2:
        raise RuntimeError(f"{system} {what}: {len(inits)} workers reported, expected 2")
    return max(float(p.read_text()) for p in inits)


@dataclass
class Samples:
    values: dict[tuple[str, str, int | None], list[float]] = field(default_factory=dict)

    def add(self, scenario: str, system: str, value: float) -> None:
        self.add_param(scenario, system, None, value)

    def add_param(self, scenario: str, system: str, param: int | None, value: float) -> None:
        self.values.setdefault((scenario, system, param), []).append(value)


UNITS = {"launch": "s", "recovery": "s", "error recovery": "s", "first step": "s", "respawn": "s", "agent RSS": "MiB",
         "standby RSS": "MiB", "c10d launch": "s", "scale-up": "s"}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.agent", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: few repetitions (under ~30 s)")
    parser.add_argument("--repeats", type=int, default=None, help="repetitions of the recovery scenario")
    parser.add_argument("--json", type=Path, default=None, help="write the records here")
    parser.add_argument("--recovery-only", action="store_true", help="only the recovery scenarios")
    parser.add_argument("--first-step", action="store_true", help="with --recovery-only: the first-step one too")
    parser.add_argument("--launch-only", action="store_true", help="only the standalone no-op launch")
    args = parser.parse_args(argv)
    recoveries = args.repeats or (2 if args.quick else 5)
    launches = 3 * recoveries if not args.quick else 3

    # As installed by pip, which compiles a package's modules: an editable checkout run with
    # PYTHONDONTWRITEBYTECODE=1 would otherwise recompile every edited module at every launch (torch's are compiled).
    compileall.compile_dir(Path(aelastic.__file__).parent, quiet=1)
    samples = Samples()
    agents = (2,) if args.quick else (2, 4)
    with scratch() as tmp:
        noop, crash_once, scale_up = tmp / "noop.py", tmp / "crash_once.py", tmp / "scale_up.py"
        first_step = tmp / "first_step.py"
        first_step.write_text(FIRST_STEP)
        noop.write_text(NOOP)
        crash_once.write_text(CRASH_ONCE)
        scale_up.write_text(SCALE_UP)
        for rep in range(0 if args.recovery_only else launches):
            for system in SYSTEMS if rep % 2 == 0 else SYSTEMS[::-1]:
                samples.add("launch", system, launch_once(system, noop))
        others = 0 if args.launch_only else recoveries
        for rep in range(0 if args.recovery_only else others):
            for system in SYSTEMS if rep % 2 == 0 else SYSTEMS[::-1]:
                for nodes in agents:
                    samples.add_param("c10d launch", system, nodes, c10d_launch_once(system, noop, nodes))
                samples.add("scale-up", system, scale_up_once(system, scale_up))
        for rep in range(others):
            shift = rep % len(RECOVERY_SYSTEMS)  # each system in each position in turn
            for system in RECOVERY_SYSTEMS[shift:] + RECOVERY_SYSTEMS[:shift]:
                if args.first_step or not args.recovery_only:
                    samples.add("first step", system, first_step_once(system, first_step))
                result = recovery_once(system, crash_once)
                samples.add("recovery", system, result.seconds)
                samples.add("error recovery", system, recovery_once(system, crash_once, "raise").barrier)
                samples.add("respawn", system, result.respawn)
                samples.add("agent RSS", system, result.agent_mib)
                if system != "torch":
                    samples.add("agent RSS", f"{system}+reaper", result.agent_mib + result.reaper_mib)
                if result.standby_mib is not None:
                    samples.add("standby RSS", system, result.standby_mib)

    records = [
        {"scenario": scenario, "system": system, "param": param, "unit": UNITS[scenario], "samples": values,
         "better": "lower"}
        for (scenario, system, param), values in samples.values.items()
    ]  # fmt: skip
    print(
        f"agent benchmark ({aelastic_install()}): {launches} launches, {recoveries} of each other scenario per system "
        "(medians, min-max)"
    )
    print(f"{'scenario':<14} {'N':>2} {'system':<26} {'median':>12} {'min':>12} {'max':>12}  aelastic/torch")
    for r in records:
        values = r["samples"]
        torch = samples.values.get((str(r["scenario"]), "torch", r["param"]))
        ratio = (
            ""
            if r["system"] == "torch" or not torch
            else f"{statistics.median(values) / statistics.median(torch):.2f}x"
        )
        cells = " ".join(f"{v:>8.3f} {r['unit']:<3}" for v in (statistics.median(values), min(values), max(values)))
        print(f"{r['scenario']:<14} {r['param'] or '':>2} {r['system']:<26} {cells}  {ratio}")
    if args.json is not None:
        args.json.write_text(json.dumps({"benchmark": "agent", "records": records}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
