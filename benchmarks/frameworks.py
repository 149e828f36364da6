"""What one fault costs a job in the frameworks people train with: each framework's example under torchrun with the
framework's own disk checkpoint every 10 steps, beside aelastic with its integration's in-memory checkpoint every
step; same machine, same run, alternating. Not run in CI (``tests/test_examples.py`` runs each example with a fault).

    python -m benchmarks.frameworks [--repeats 3] [--frameworks lightning,fabric,...] [--mib 256] [--json PATH]

The job: two nodes of one worker each (two launchers on this machine, ``--rdzv-backend c10d`` on a port the first
one binds), each example (``examples/``) with ``--ballast-mib`` MiB of frozen weights per rank (a checkpoint of that
size plus the model's own state) and steps of ``--step-time`` (0.3 s); rank 1 raises when step F begins in the
first attempt, F drawn at random from 12..27 for each repetition (the same F for both systems).

* torch: ``torchrun`` (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: without it most restarts fail, see
  benchmarks/agent.py), ``--checkpoint-dir`` on local disk, ``--save-every 10``: the framework's own recipe
  (Lightning's ``ModelCheckpoint``, ``fabric.save``, the HF Trainer's ``save_steps``, ``accelerator.save_state``,
  DCP's ``FileSystemWriter``), resumed from the newest checkpoint.
* aelastic: ``aelastic run --prewarm --prewarm-modules <the framework>``, the integration's checkpoint into the
  agents' memory every step (``--save-every 1``), and in the 2-node jobs ``--checkpoint-dir`` too (the agents
  persist every 50 steps and when a worker fails, in the background, as a job that may be requeued would); Fabric
  and Accelerate loops keep their survivors.

Scenarios, per framework:

* ``lost to a fault``: the job's wall time with the fault, less the median of its wall time without one (the same
  system and flags): the restart, the restore and the steps done again, as the job's end sees them.
* ``checkpoint blocks a step``: in a job of one node of two workers (no replica pushed to another node beside the
  training, whose traffic would share this machine's two cores; aelastic without ``--checkpoint-dir``, whose last
  persist at the job's end blocks no step), (the job's wall time with its checkpoints, less with none: medians) /
  the checkpoints taken;
  beside ``raw copy`` of the same bytes (``--mib``, half of it for FSDP2, whose ranks each hold a shard; one
  ``copy_`` into touched memory, in a process of its own).

Targets (issue 46): ``lost to a fault`` at most 0.2x torchrun's for every framework; a checkpoint blocks a step at
most 1.5x the raw copy of its bytes.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from .agent import c10d_flags, environment, free_port
from .run import aelastic_install

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

FLOOR = """\
import json, sys, time
import torch
n = int(sys.argv[1]) << 18
source, target = torch.rand(n), torch.zeros(n)
best = float("inf")
for _ in range(5):
    began = time.perf_counter()
    target.copy_(source)
    best = min(best, time.perf_counter() - began)
print(json.dumps(best))
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
) -> float:
    """The wall time of one job, from the launchers' start to every one exiting: ``nodes`` launchers of one worker
    each on c10d, or (``nodes=1``) one launcher of two workers, ``--standalone``; ``persist``: aelastic gets
    ``--checkpoint-dir`` too (its agents then persist the memory there, in the background)."""
    example, _, steps = FRAMEWORKS[framework]
    with tempfile.TemporaryDirectory(prefix="aelastic_frameworks_") as tmp:
        flags = c10d_flags(str(nodes), f"frameworks-{random.getrandbits(32):x}", free_port())
        if nodes == 1:
            flags = ["--standalone", "--nproc-per-node", "2"]
        args = [*flags, "--max-restarts", "3", example, "--steps", str(steps), "--ballast-mib", str(mib),
                "--step-time", str(step_time), "--save-every", str(every)]  # fmt: skip
        if persist or system == "torch":
            args += ["--checkpoint-dir", str(Path(tmp, "ck"))]
        if fault is not None:
            args += ["--crash-at-step", str(fault), "--crash-rank", "1"]
        began = time.perf_counter()
        procs = [subprocess.Popen([*launcher(system, framework), *args], cwd=ROOT, env=environment(system),
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
        took = time.perf_counter() - began
        if errors:
            raise RuntimeError(f"{system} {framework} (fault {fault}, every {every}) failed:\n{errors[0]}")
        return took


def floor(mib: int) -> float:
    proc = subprocess.run([sys.executable, "-c", FLOOR, str(mib)], env=environment("torch"), capture_output=True,
                          timeout=300, check=True)  # fmt: skip
    return float(json.loads(proc.stdout))


Add = Callable[[str, str, str, float], None]


def measure_lost(framework: str, args: argparse.Namespace, rng: random.Random, add: Add) -> None:
    """``lost to a fault``: 2-node jobs with a fault and without, alternating the systems."""
    walls: dict[tuple[str, str], list[float]] = {}
    for rep in range(args.repeats):
        fault = rng.randrange(12, 28)
        for system in SYSTEMS if rep % 2 == 0 else SYSTEMS[::-1]:
            every = EVERY if system == "torch" else 1
            for kind, at in (("fault", fault), ("clean", None)):
                wall = job_once(system, framework, fault=at, every=every, mib=args.mib, step_time=args.step_time)
                walls.setdefault((system, kind), []).append(wall)
                print(f"{framework:<11} {system:<9} {kind:<6} fault={at} {wall:7.2f} s", flush=True)
    for system in SYSTEMS:
        clean = statistics.median(walls[(system, "clean")])
        for wall in walls[(system, "fault")]:
            add("lost to a fault", system, framework, wall - clean)


def measure_blocks(framework: str, args: argparse.Namespace, add: Add) -> None:
    """``checkpoint blocks a step``: 1-node jobs (no replica pushed beside the training) with checkpoints and
    without, beside the raw copy of the bytes."""
    steps = FRAMEWORKS[framework][2]
    for system in SYSTEMS:
        every = EVERY if system == "torch" else 1
        runs: dict[int, list[float]] = {}
        for rep in range(args.repeats):
            for interval in (every, 0) if rep % 2 == 0 else (0, every):
                wall = job_once(system, framework, fault=None, every=interval, mib=args.mib,
                                step_time=args.step_time, nodes=1, persist=False)  # fmt: skip
                runs.setdefault(interval, []).append(wall)
                print(f"{framework:<11} {system:<9} every={interval} {wall:7.2f} s", flush=True)
        extra = statistics.median(runs[every]) - statistics.median(runs[0])
        add("checkpoint blocks a step", system, framework, max(0.0, extra) / (steps // every))
    copy = floor(args.mib // 2 if framework == "fsdp2" else args.mib)  # FSDP2 shards it over the 2 ranks
    add("checkpoint blocks a step", "raw copy", framework, copy)


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
