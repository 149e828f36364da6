"""Hang detection's costs: torch's Flight Recorder, which ``--hang-timeout`` turns on for the workers, and a healthy
job watched for ``--minutes`` (no hang may be reported); not run in CI.

    python -m benchmarks.hang [--minutes 10] [--repeats 5] [--json PATH]

* ``all-reduce``: the time of one gloo all-reduce (microseconds) between 2 workers (``aelastic run
  --standalone``), 4 KiB and 4 MiB, Flight Recorder off (aelastic without ``--hang-timeout``) and on (with
  ``--hang-timeout 600``, which sets ``TORCH_FR_BUFFER_SIZE=2000``), alternating, the median of ``--repeats`` jobs
  each timing 2000 (4 KiB) or 50 (4 MiB) operations.
* ``hangs reported in a healthy job``: 4 workers of ``tests/faults/restartable_trainer.py`` training for
  ``--minutes`` under ``--hang-timeout 10``, steps of 0.05 s; the count of hangs the agent reported (must be 0),
  and the steps trained.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from .agent import environment
from .run import aelastic_install

ROOT = Path(__file__).resolve().parent.parent
TRAINER = ROOT / "tests" / "faults" / "restartable_trainer.py"
SIZES = {"4 KiB": (1024, 2000), "4 MiB": (1 << 20, 50)}  # floats, operations timed

ALL_REDUCE = """\
import json, sys, time
import torch, torch.distributed as dist
dist.init_process_group("gloo")
results = {}
for name, (n, ops) in json.loads(sys.argv[1]).items():
    t = torch.ones(n)
    for _ in range(10):
        dist.all_reduce(t)
    began = time.perf_counter()
    for _ in range(ops):
        dist.all_reduce(t)
    results[name] = (time.perf_counter() - began) / ops * 1e6
if dist.get_rank() == 0:
    print("RESULT " + json.dumps(results), flush=True)
dist.destroy_process_group()
"""


def all_reduce_once(recorder: bool) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="aelastic_hang_") as tmp:
        script = Path(tmp, "all_reduce.py")
        script.write_text(ALL_REDUCE)
        flags = ["--hang-timeout", "600"] if recorder else []
        proc = subprocess.run(
            [sys.executable, "-m", "aelastic", "run", "--standalone", "--nproc-per-node", "2", *flags, str(script),
             json.dumps(SIZES)],
            env=environment("aelastic"), capture_output=True, text=True, timeout=600, check=False,
        )  # fmt: skip
    line = next((line for line in proc.stdout.splitlines() if "RESULT " in line), None)
    if proc.returncode != 0 or line is None:
        raise RuntimeError(f"the all-reduce job failed ({proc.returncode}): {proc.stderr[-3000:]}")
    results: dict[str, float] = json.loads(line.split("RESULT ", 1)[1])
    return results


def healthy(minutes: float) -> tuple[int, int]:
    """Hangs reported, and steps trained, by a healthy 4-worker job under ``--hang-timeout 10``."""
    with tempfile.TemporaryDirectory(prefix="aelastic_hang_soak_") as tmp:
        out = Path(tmp)
        (out / "h0").mkdir()
        env = {**environment("aelastic"), "FAULTS_HOST": "h0", "FAULTS_STEP_PAUSE": "0.05",
               "FAULTS_STEPS": "100000000"}  # fmt: skip
        with (out / "agent.log").open("w") as log:
            agent = subprocess.Popen(
                [sys.executable, "-m", "aelastic", "run", "--standalone", "--nproc-per-node", "4", "--hang-timeout",
                 "10", str(TRAINER), str(out)],
                env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
            time.sleep(minutes * 60)
            agent.terminate()
            agent.wait(timeout=120)
        text = (out / "agent.log").read_text(errors="replace")
        steps = [json.loads(p.read_text())["step"] for p in (out / "h0").glob("progress-*.json")]
        return text.count("hang: no rank of the job made progress"), min(steps, default=0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.hang", description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0, help="the healthy job's length (default 10)")
    parser.add_argument("--repeats", type=int, default=5, help="all-reduce jobs per setting (default 5)")
    parser.add_argument("--json", type=Path, default=None, help="write the records here")
    args = parser.parse_args(argv)
    samples: dict[tuple[str, str], list[float]] = {}
    for rep in range(args.repeats):
        for recorder in (False, True) if rep % 2 == 0 else (True, False):
            system = "aelastic --hang-timeout (Flight Recorder on)" if recorder else "aelastic (Flight Recorder off)"
            for size, seconds in all_reduce_once(recorder).items():
                samples.setdefault((f"gloo all-reduce of {size}, 2 workers", system), []).append(seconds)
    hangs, steps = healthy(args.minutes)
    records: list[dict[str, Any]] = [
        {"scenario": scenario, "system": system, "param": None, "unit": "us", "samples": values, "better": "lower"}
        for (scenario, system), values in samples.items()
    ]
    records.append({"scenario": f"hangs reported in a healthy {args.minutes:g}-minute job (--hang-timeout 10)",
                    "system": "aelastic", "param": None, "unit": "count", "samples": [hangs], "better": "lower",
                    "what": f"4 workers, steps of 0.05 s: {steps} steps each"})  # fmt: skip
    print(f"hang detection ({aelastic_install()}), load {os.getloadavg()[0]:.2f}")
    for r in records:
        values = r["samples"]
        cells = f"{statistics.median(values):9.1f} {r['unit']}" if r["unit"] == "us" else f"{values[0]:>9}"
        print(f"{r['scenario']:<62} {r['system']:<46} {cells}")
    if args.json is not None:
        args.json.write_text(json.dumps({"benchmark": "hang", "records": records}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
