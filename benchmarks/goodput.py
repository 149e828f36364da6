"""What a fault costs a training job: torchrun with ``torch.save`` every 10 steps beside aelastic with an in-memory
checkpoint after every step; same machine, same run, alternating.

    python -m benchmarks.goodput [--quick] [--repeats N] [--sizes 64,256,1024] [--json PATH]

The job (issue 29): 2 gloo workers, a training state of S MiB per rank (four float32 tensors: parameters, two
optimizer moments, a master copy; every step all-reduces a gradient and updates every byte of the state, then
waits out the rest of a 0.2 s step), rank 1 failing with an uncaught error halfway through step 25 of the first
attempt, ``--max-restarts 1``.

* torch: ``torchrun --standalone`` (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: without it most restarts fail, see
  benchmarks/agent.py), ``torch.save`` of each rank's state to local disk after every 10th step (to a temporary
  file, then renamed, as jobs do), ``torch.load`` at the restart.
* aelastic: ``aelastic run --standalone --prewarm``, ``aelastic.checkpoint.save(state, step=...)`` after every
  step, ``aelastic.checkpoint.load(into=state)`` at the restart.
* aelastic survivors: the same, with the training function wrapped in ``aelastic.worker.restartable`` (issue 30):
  rank 0 keeps its process (and its state's memory), only rank 1 is replaced.

The state is allocated once per process, outside the training function, as a restartable function keeps it.

Scenarios, per S:

* ``lost to a fault``: from the fault (rank 1's clock, just before it raises) to both ranks done with step 25
  again (their clocks; one machine, one clock): the restart, the restore and the steps done again.
* ``checkpoint blocks a step``: the median time one checkpoint takes in the workers (``torch.save`` including the
  rename; ``aelastic.checkpoint.save`` until it returns).
* ``restore``: the restarted workers' load (``torch.load`` of the file; ``aelastic.checkpoint.load(into=...)``).
* the floor: ``raw copy in the job`` (the workers of the aelastic jobs copy their state into tensors of their own
  after each save of the first attempt: the same bytes at the same moment, the other rank copying beside it, as
  the saves do); and in a process of its own: ``raw copy`` (one ``copy_`` of S MiB between two tensors whose
  memory is already touched, as a slot is after the first save), ``raw copy to new memory`` (into a fresh
  allocation, as a restore into a fresh process's tensors pays), ``torch.save to disk`` and ``dcp.save to disk``
  (``FileSystemWriter``) of the same state.

Targets (issue 29): ``lost to a fault`` at most 0.1x torchrun's; a save, and a restore, at most 1.5x the raw copy
(in the job: two ranks on one machine's memory copy at once).
(issue 30): with survivors, a fault costs less than a full pre-warmed restart.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from string import Template
from typing import Any

from .agent import environment
from .run import aelastic_install

SYSTEMS = ("torch", "aelastic", "aelastic survivors")
STEP_TIME = 0.2
FAULT_STEP = 25
STEPS = 27  # two steps past the fault's: the restarted job's step 25 is timed, then it ends
EVERY = 10  # torch.save's interval

WORKER = Template("""\
import json, os, sys, time
import torch, torch.distributed as dist

out, system, size_mib, ckdir = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
STEP, FAULT, STEPS, EVERY = $step, $fault, $steps, $every
n = size_mib * 2**20 // 16
state = {name: torch.zeros(n) for name in ("params", "exp_avg", "exp_avg_sq", "master")}  # kept across calls
scratch = {}  # the floor's copies, kept too: freeing them is no part of a recovery

def main():
    global state
    dist.init_process_group("gloo")
    rank, attempt = dist.get_rank(), int(os.environ["TORCHELASTIC_RESTART_COUNT"])

    def record(event, **values):  # renamed into place: a worker stopped while it writes leaves no empty record
        path = os.path.join(out, f"{event}-{attempt}-{rank}.json")
        with open(path + ".tmp", "w") as f:
            json.dump(values, f)
        os.replace(path + ".tmp", path)

    state["step"] = -1
    if attempt == 0:  # the floor beside each save: the same bytes, the same moment (the other rank saving too)
        scratch.update((name, torch.zeros(n)) for name in ("params", "exp_avg", "exp_avg_sq", "master"))
    path = os.path.join(ckdir, f"rank{rank}.pt")
    began = time.time()
    if system.startswith("aelastic"):
        restored = ckpt.load(into=state)
        if restored is not None:
            state["step"] = restored["step"]
    elif os.path.exists(path):
        state = torch.load(path)
    if attempt == 1:
        record("restore", seconds=time.time() - began)
    for step in range(state["step"] + 1, STEPS):
        started = time.time()
        grad = torch.ones(1024)
        dist.all_reduce(grad)
        for name in ("params", "exp_avg", "exp_avg_sq", "master"):
            state[name].add_(1e-3)  # the optimizer touches every byte of the state
        if attempt == 0 and rank == 1 and step == FAULT:
            time.sleep(max(0.0, started + STEP / 2 - time.time()))
            record("fault", time=time.time())
            raise RuntimeError("the fault the benchmark measures")
        time.sleep(max(0.0, started + STEP - time.time()))
        state["step"] = step
        saved = time.time()
        if system.startswith("aelastic"):
            ckpt.save(state, step=step)
            record(f"save{step}", seconds=time.time() - saved)
        elif (step + 1) % EVERY == 0:
            torch.save(state, path + ".tmp")
            os.replace(path + ".tmp", path)
            record(f"save{step}", seconds=time.time() - saved)
        if attempt == 0 and step < FAULT:
            copied = time.time()
            for name, tensor in scratch.items():
                tensor.copy_(state[name])
            record(f"raw{step}", seconds=time.time() - copied)
        if attempt == 1 and step == FAULT:
            record("done", time=time.time())
    dist.barrier()
    dist.destroy_process_group()

if system.startswith("aelastic"):
    import aelastic.checkpoint as ckpt
if system == "aelastic survivors":
    from aelastic.worker import restartable
    main = restartable(main)
main()
""").substitute(step=STEP_TIME, fault=FAULT_STEP, steps=STEPS, every=EVERY)

FLOOR = """\
import json, os, sys, tempfile, time
import torch
import torch.distributed.checkpoint as dcp

size_mib, directory = int(sys.argv[1]), sys.argv[2]
n = size_mib * 2**20 // 16
state = {name: torch.rand(n) for name in ("params", "exp_avg", "exp_avg_sq", "master")}
targets = {name: torch.zeros(n) for name in state}
results = {}
began = time.perf_counter()
for name, tensor in state.items():
    targets[name].copy_(tensor)
results["raw copy"] = time.perf_counter() - began
began = time.perf_counter()
fresh = {name: torch.empty_like(tensor).copy_(tensor) for name, tensor in state.items()}
results["raw copy to new memory"] = time.perf_counter() - began
began = time.perf_counter()
torch.save(state, os.path.join(directory, "state.pt"))
results["torch.save to disk"] = time.perf_counter() - began
began = time.perf_counter()
dcp.save(state, storage_writer=dcp.FileSystemWriter(os.path.join(directory, "dcp")), no_dist=True)
results["dcp.save to disk"] = time.perf_counter() - began
print(json.dumps(results))
"""


def launcher(system: str, *args: str) -> list[str]:
    if system == "torch":
        return [sys.executable, "-m", "torch.distributed.run", *args]
    return [sys.executable, "-m", "aelastic", "run", "--prewarm", *args]


def job_once(system: str, size_mib: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="aelastic_goodput_") as tmp:
        out, ckdir, script = Path(tmp, "out"), Path(tmp, "ckpt"), Path(tmp, "worker.py")
        out.mkdir()
        ckdir.mkdir()
        script.write_text(WORKER)
        args = ["--standalone", "--nproc-per-node", "2", "--max-restarts", "1", str(script), str(out), system,
                str(size_mib), str(ckdir)]  # fmt: skip
        proc = subprocess.run(launcher(system, *args), env=environment(system), capture_output=True, timeout=900)
        if proc.returncode != 0 or not list(out.glob("done-1-*")):
            raise RuntimeError(f"{system} goodput run failed ({proc.returncode}): {proc.stderr.decode()[-3000:]}")

        def read(pattern: str) -> list[dict[str, Any]]:
            return [json.loads(p.read_text()) for p in sorted(out.glob(pattern))]

        fault = read("fault-0-1.json")[0]["time"]
        done = max(r["time"] for r in read("done-1-*.json"))
        saves = [r["seconds"] for r in read("save*.json")]
        raw = [r["seconds"] for r in read("raw*.json")]
        restore = max(r["seconds"] for r in read("restore-1-*.json"))
        raw_copy = statistics.median(raw)
        return {"lost": done - fault, "save": statistics.median(saves), "restore": restore, "raw": raw_copy}


def floor_once(size_mib: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="aelastic_goodput_floor_") as tmp:
        proc = subprocess.run([sys.executable, "-c", FLOOR, str(size_mib), tmp], env=environment("torch"),
                              capture_output=True, timeout=900, check=True)  # fmt: skip
        results: dict[str, float] = json.loads(proc.stdout)
        return results


UNITS = {"lost to a fault": "s", "checkpoint blocks a step": "s", "restore": "s"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.goodput", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: 64 MiB, one repetition")
    parser.add_argument("--repeats", type=int, default=None, help="repetitions of each job (default 3)")
    parser.add_argument("--sizes", default=None, help="state sizes in MiB per rank (default 64,256,1024)")
    parser.add_argument("--json", type=Path, default=None, help="write the records here")
    args = parser.parse_args(argv)
    repeats = args.repeats or (1 if args.quick else 3)
    sizes = [int(s) for s in (args.sizes or ("64" if args.quick else "64,256,1024")).split(",")]
    samples: dict[tuple[str, str, int], list[float]] = {}

    def add(scenario: str, system: str, size: int, value: float) -> None:
        samples.setdefault((scenario, system, size), []).append(value)

    for size in sizes:
        for rep in range(repeats):
            for system in SYSTEMS if rep % 2 == 0 else SYSTEMS[::-1]:
                result = job_once(system, size)
                add("lost to a fault", system, size, result["lost"])
                add("checkpoint blocks a step", system, size, result["save"])
                add("restore", system, size, result["restore"])
                if system != "torch":  # the floor of the saves it is compared with
                    for scenario in ("checkpoint blocks a step", "restore"):
                        add(scenario, "raw copy in the job", size, result["raw"])
            for name, seconds in floor_once(size).items():
                for scenario in ("checkpoint blocks a step", "restore"):
                    add(scenario, name, size, seconds)
    records = [
        {"scenario": scenario, "system": system, "param": size, "unit": UNITS[scenario], "samples": values,
         "better": "lower"}
        for (scenario, system, size), values in samples.items()
    ]  # fmt: skip
    print(f"goodput benchmark ({aelastic_install()}): {repeats} job(s) per system and size (medians, min-max)")
    print(f"{'scenario':<26} {'MiB':>5} {'system':<24} {'median':>9} {'min':>9} {'max':>9}  aelastic/torch")
    for r in records:
        values = r["samples"]
        torch = samples.get((r["scenario"], "torch", r["param"]))
        median = statistics.median(values)
        ratio = "" if r["system"] == "torch" or not torch else f"{median / statistics.median(torch):.3f}x"
        cells = " ".join(f"{v:>7.3f} s" for v in (median, min(values), max(values)))
        print(f"{r['scenario']:<26} {r['param']:>5} {r['system']:<24} {cells}  {ratio}")
    if args.json is not None:
        args.json.write_text(json.dumps({"benchmark": "goodput", "records": records}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
