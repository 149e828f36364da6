"""What one fault costs a job in the frameworks people train with: each framework's example under torchrun with the
framework's own disk checkpoint every 10 steps, beside aelastic with its integration's in-memory checkpoint every
step; same machine, same run, alternating. Not run in CI (``tests/test_examples.py`` runs each example with a fault).

    python -m benchmarks.frameworks [--repeats 3] [--frameworks lightning,fabric,...] [--mib 256] [--json PATH]

The job: two nodes of one worker each (two launchers on this machine, ``--rdzv-backend c10d`` on a port the first
one binds), each example (``examples/``) with ``--ballast-mib`` MiB of frozen weights per rank (a checkpoint of that
size plus the model's own state) and steps of ``--step-time`` (0.3 s); rank 1 raises during step F of the first
attempt (after the step's gradient exchange), F drawn at random from 12..27 for each repetition (the same F for both
systems).

* torch: ``torchrun`` (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: without it most restarts fail, see
  benchmarks/agent.py), ``--checkpoint-dir`` on local disk, ``--save-every 10``: the framework's own recipe
  (Lightning's ``ModelCheckpoint``, ``fabric.save``, the HF Trainer's ``save_steps``, ``accelerator.save_state``,
  DCP's ``FileSystemWriter``), resumed from the newest checkpoint.
* aelastic: ``aelastic run --prewarm --prewarm-modules <the framework>``, the integration's checkpoint into the
  agents' memory every step (``--save-every 1``), and in the 2-node jobs ``--checkpoint-dir`` too (the agents
  persist every 50 steps and after a worker failed, in the background, as a job that may be requeued would); every
  example runs under ``aelastic.worker.restartable``: the healthy rank keeps its process.

Scenarios, per framework:

* ``lost to a fault``: from rank 0's step log (the examples' ``--step-log``): from the end of the last step done
  before the fault to the end of the next step once the job is back (that step done again in a later attempt),
  less one ordinary step (the median of the nine before the fault): the restart, the restore and the steps done
  again, as the agents' incident records count them. (The jobs' wall times, with and without a fault, vary by a
  second or more from run to run on this machine: their difference measured the noise more than the fault.)
* ``checkpoint blocks a step``: in a job of one node of two workers and 100 steps of 0.15 s (no replica pushed to
  another node beside the training, whose traffic would share this machine's two cores; aelastic without
  ``--checkpoint-dir``, whose last persist at the job's end blocks no step): from rank 0's step log, the time from
  the end of step 10 to the end of step 95 with checkpoints, less the same in a job with none (medians),
  divided by the checkpoints taken in that window. The processes' start and teardown, which varied by a second
  from run to run, are outside it, and so are a system's one-time costs (aelastic's first save, which allocates the
  rank's memory: step 0); beside ``raw copy`` of the same bytes (``--mib``, half of it for FSDP2, whose ranks each
  hold a shard; one ``copy_`` into touched memory) by two processes at once, as the job's two ranks copy at once,
  sharing the memory's bandwidth (the bound's measure), and ``raw copy alone`` by one process. FSDP2's example
  saves with ``dcp.save(..., use_collectives=False)``; also as ``aelastic async_save`` (``dcp.async_save``: the step
  waits for the copy into the agent's memory, the rest runs in a thread) and ``aelastic collectives``
  (``dcp.save`` with DCP's default, its four exchanges of plans and results).

* ``one dcp.save call`` (FSDP2, :mod:`benchmarks.dcp_calls`): one save's call in the same two workers, beside the
  raw copy and ``DCP floor``, a storage writer that only copies: what DCP's own work costs any writer (``DCP floor
  collectives``: with DCP's collectives).

Targets (issue 46): ``lost to a fault`` at most 0.2x torchrun's for every framework; a checkpoint blocks a step at
most 1.5x the raw copy of its bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .agent import c10d_flags, environment, free_port
from .run import aelastic_install
from .steplog import lost_to_the_fault, read

ROOT = Path(__file__).resolve().parent.parent
# name -> (example, the modules a standby imports ahead, steps)
FRAMEWORKS = {
    "lightning": ("examples/lightning/train.py", "lightning", 40),
    "fabric": ("examples/lightning/fabric.py", "lightning", 40),
    # transformers imports its parts on first use: the standby imports the parts the script uses.
    "hf_trainer": ("examples/hf_trainer/train.py", "transformers.trainer,transformers.models.gpt2.modeling_gpt2", 40),
    "accelerate": ("examples/hf_accelerate/train.py", "accelerate,transformers.models.gpt2.modeling_gpt2", 40),
    "fsdp2": ("examples/fsdp2/train.py", "torch.distributed.fsdp", 40),
}
SYSTEMS = ("torch", "aelastic")
EVERY = 10  # the disk recipe's interval

BLOCKS_STEPS = 100
BLOCKS_STEP_TIME = 0.15
# The window: past the start and the first saves, and a few steps short of the end (the HF Trainer saves after a
# step's end is logged: its saves count in the next step's time).
BLOCKS_FROM, BLOCKS_TO = 10, BLOCKS_STEPS - 5

# The raw copy by each of `ranks` processes at once, as the job's ranks checkpoint at once (their steps are in
# lockstep): they share the machine's memory bandwidth. The slowest process's median.
FLOOR = """\
import json, multiprocessing, statistics, sys, time
import torch
def copier(n, barrier, out):
    source, target = torch.rand(n), torch.zeros(n)
    times = []
    for _ in range(9):
        barrier.wait()
        began = time.perf_counter()
        target.copy_(source)
        times.append(time.perf_counter() - began)
    out.put(statistics.median(times))
n, ranks = int(sys.argv[1]) << 18, int(sys.argv[2])
context = multiprocessing.get_context("fork")
barrier, out = context.Barrier(ranks), context.Queue()
procs = [context.Process(target=copier, args=(n, barrier, out)) for _ in range(ranks)]
for proc in procs:
    proc.start()
medians = [out.get() for _ in procs]
for proc in procs:
    proc.join()
print(json.dumps(max(medians)))
"""


def launcher(system: str, framework: str) -> list[str]:
    if system == "torch":
        return [sys.executable, "-m", "torch.distributed.run"]
    return [sys.executable, "-m", "aelastic", "run", "--prewarm", "--prewarm-modules", FRAMEWORKS[framework][1]]


def job_once(
    system: str,
    framework: str,
    *,
    fault: int | None,
    every: int,
    mib: int,
    step_time: float,
    nodes: int = 2,
    persist: bool = True,
    steps: int | None = None,
    extra: tuple[str, ...] | list[str] = (),
) -> list[dict[str, Any]]:
    """Rank 0's step log of one job (``{"step", "round", "at"}`` per step done): ``nodes`` launchers of one worker
    each on c10d, or (``nodes=1``) one launcher of two workers, ``--standalone``; ``persist``: aelastic gets
    ``--checkpoint-dir`` too (its agents then persist the memory there, in the background)."""
    example, _, default_steps = FRAMEWORKS[framework]
    steps = default_steps if steps is None else steps
    with tempfile.TemporaryDirectory(prefix="aelastic_frameworks_") as tmp:
        flags = c10d_flags(str(nodes), f"frameworks-{random.getrandbits(32):x}", free_port())
        if nodes == 1:
            flags = ["--standalone", "--nproc-per-node", "2"]
        log = Path(tmp, "steps.log")
        args = [*flags, "--max-restarts", "3", example, "--steps", str(steps), "--ballast-mib", str(mib),
                "--step-time", str(step_time), "--save-every", str(every), "--step-log", str(log), *extra]  # fmt: skip
        if persist or system == "torch":
            args += ["--checkpoint-dir", str(Path(tmp, "ck"))]
        if fault is not None:
            args += ["--crash-at-step", str(fault), "--crash-rank", "1"]
        env = environment(system)  # the repository on the path: the examples' step log (benchmarks/steplog.py)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(ROOT), env.get("PYTHONPATH"))))
        procs = [subprocess.Popen([*launcher(system, framework), *args], cwd=ROOT, env=env,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) for _ in range(nodes)]  # fmt: skip
        errors = []
        for proc in procs:
            try:
                _, stderr = proc.communicate(timeout=600)
            except subprocess.TimeoutExpired:
                for other in procs:
                    other.kill()
                raise RuntimeError(f"{system} {framework}: a launcher still ran after 600 s") from None
            if proc.returncode != 0:
                errors.append(stderr.decode(errors="replace")[-3000:])
        if errors:
            raise RuntimeError(f"{system} {framework} (fault {fault}, every {every}) failed:\n{errors[0]}")
        return read(log)


def steady_window(lines: list[dict[str, Any]]) -> float:
    """From the end of step :data:`BLOCKS_FROM` to the end of step :data:`BLOCKS_TO`, in a job without a fault."""
    ends = {line["step"]: line["at"] for line in lines}
    return float(ends[BLOCKS_TO] - ends[BLOCKS_FROM])


Add = Callable[[str, str, str, float], None]


def floor(mib: int, ranks: int) -> float:
    proc = subprocess.run([sys.executable, "-c", FLOOR, str(mib), str(ranks)], env=environment("torch"),
                          capture_output=True, timeout=300, check=True)  # fmt: skip
    return float(json.loads(proc.stdout))


def dcp_calls(add: Add) -> None:
    """``one dcp.save call`` (FSDP2): the variants of :mod:`benchmarks.dcp_calls`, in the same two workers."""
    command = [sys.executable, "-m", "aelastic", "run", "--standalone", "--nproc-per-node", "2",
               str(ROOT / "benchmarks" / "dcp_calls.py")]  # fmt: skip
    proc = subprocess.run(command, cwd=ROOT, env=environment("aelastic"), capture_output=True, text=True,
                          timeout=600, check=True)  # fmt: skip
    line = next(line for line in proc.stdout.splitlines() if "{" in line)
    for system, value in json.loads(line[line.index("{") :]).items():
        add("one dcp.save call", system, "fsdp2", value)


def measure_lost(framework: str, args: argparse.Namespace, rng: random.Random, add: Add) -> None:
    """``lost to a fault``: 2-node jobs with a fault, alternating the systems."""
    for rep in range(args.repeats):
        fault = rng.randrange(12, 28)
        for system in SYSTEMS if rep % 2 == 0 else SYSTEMS[::-1]:
            every = EVERY if system == "torch" else 1
            log = job_once(system, framework, fault=fault, every=every, mib=args.mib, step_time=args.step_time)
            lost = lost_to_the_fault(log)
            add("lost to a fault", system, framework, lost)
            print(f"{framework:<11} {system:<9} fault={fault} lost {lost:7.2f} s", flush=True)


def measure_blocks(framework: str, args: argparse.Namespace, add: Add) -> None:
    """``checkpoint blocks a step``: 1-node jobs (no replica pushed beside the training) with checkpoints and
    without, beside the raw copy of the bytes."""
    steps = BLOCKS_STEPS
    variants = [(system, system, []) for system in SYSTEMS]  # (the row's name, the launcher, the example's flags)
    if framework == "fsdp2":
        variants += [
            ("aelastic async_save", "aelastic", ["--async-save"]),
            ("aelastic collectives", "aelastic", ["--save-collectives"]),
        ]
    for name, system, flags in variants:
        every = EVERY if system == "torch" else 1
        runs: dict[int, list[float]] = {}
        for rep in range(args.repeats):
            if name == SYSTEMS[0]:  # the floor too varies with the machine's moment: measured beside the jobs
                mib = args.mib // 2 if framework == "fsdp2" else args.mib  # FSDP2 shards it over the 2 ranks
                add("checkpoint blocks a step", "raw copy", framework, floor(mib, ranks=2))
                add("checkpoint blocks a step", "raw copy alone", framework, floor(mib, ranks=1))
                if framework == "fsdp2":
                    dcp_calls(add)
            for interval in (every, 0) if rep % 2 == 0 else (0, every):
                log = job_once(system, framework, fault=None, every=interval, mib=args.mib,
                               step_time=BLOCKS_STEP_TIME, nodes=1, persist=False, steps=steps,
                               extra=flags)  # fmt: skip
                window = steady_window(log)
                runs.setdefault(interval, []).append(window)
                print(f"{framework:<11} {name:<9} every={interval} steps {BLOCKS_FROM}-{BLOCKS_TO}: {window:7.2f} s",
                      flush=True)  # fmt: skip
        # The saves that end steps BLOCKS_FROM + 1 .. BLOCKS_TO (a save ends step s when (s + 1) % every == 0).
        saves = sum(1 for s in range(BLOCKS_FROM + 1, BLOCKS_TO + 1) if (s + 1) % every == 0)
        extra = statistics.median(runs[every]) - statistics.median(runs[0])
        add("checkpoint blocks a step", name, framework, max(0.0, extra) / saves)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.frameworks", description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="jobs with a fault per system and framework")
    parser.add_argument("--frameworks", default=",".join(FRAMEWORKS), help="which (default: all)")
    parser.add_argument("--mib", type=int, default=256, help="MiB of frozen weights per rank (default 256)")
    parser.add_argument("--step-time", type=float, default=0.3, help="seconds per step (default 0.3)")
    parser.add_argument(
        "--part",
        choices=("all", "lost", "blocks"),
        default="all",
        help="measure only one scenario; --json then keeps the file's records of the other",
    )
    parser.add_argument("--json", type=Path, default=None, help="write the records here")
    args = parser.parse_args(argv)
    names = args.frameworks.split(",")
    unknown = sorted(set(names) - set(FRAMEWORKS))
    if unknown:
        parser.error(f"--frameworks: {', '.join(unknown)}: not one of {', '.join(FRAMEWORKS)}")
    rng = random.Random()
    samples: dict[tuple[str, str, str], list[float]] = {}

    def add(scenario: str, system: str, framework: str, value: float) -> None:
        samples.setdefault((scenario, system, framework), []).append(value)

    for framework in names:
        if args.part in ("all", "lost"):
            measure_lost(framework, args, rng, add)
        if args.part in ("all", "blocks"):
            measure_blocks(framework, args, add)
    records = [
        {"scenario": scenario, "system": system, "param": framework, "unit": "s", "samples": values,
         "better": "lower"}
        for (scenario, system, framework), values in samples.items()
    ]  # fmt: skip
    print(f"frameworks benchmark ({aelastic_install()}): {args.repeats} fault(s) per system and framework, "
          f"{args.mib} MiB per rank, {args.step_time} s steps")  # fmt: skip
    print(f"{'scenario':<26} {'framework':<11} {'system':<9} {'median':>9}  aelastic/torch")
    for r in records:
        theirs = samples.get((r["scenario"], "torch", r["param"]))
        median = statistics.median(r["samples"])
        ratio = "" if r["system"] == "torch" or not theirs else f"{median / statistics.median(theirs):.3f}x"
        print(f"{r['scenario']:<26} {r['param']:<11} {r['system']:<9} {median:>7.3f} s  {ratio}")
    if args.json is not None:
        kept = []
        if args.part != "all" and args.json.exists():  # the other scenario's records, or other frameworks'
            measured = {(r["scenario"], r["param"]) for r in records}
            kept = [r for r in json.loads(args.json.read_text())["records"]
                    if (r["scenario"], r["param"]) not in measured]  # fmt: skip
        args.json.write_text(json.dumps({"benchmark": "frameworks", "records": kept + records}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
