"""In-memory checkpoints of a state on the GPU, beside the raw copies of the same bytes (needs a CUDA device).

    python -m benchmarks.cuda_checkpoint [--sizes 256,1024] [--repeats 8] [--json PATH]

Per size S, one job of one worker under ``aelastic run --standalone --max-restarts 1``: a state of S MiB on the GPU
(four float32 tensors, as benchmarks/goodput.py's). The first attempt saves it ``--repeats`` times, 0.2 s apart (a
step's time, in which a slot's registration with CUDA goes on in the background), and then fails; the second
attempt, a fresh process, restores it into fresh GPU tensors ``--repeats`` times. Medians:

* ``save``: ``aelastic.checkpoint.save(state, step=...)`` until it returns; ``first save`` apart (a fresh slot,
  before its registration is done). Its floor, ``raw copy to pinned``: ``copy_`` of the same tensors into pinned
  host tensors of their own (``non_blocking``, then a synchronize).
* ``restore``: ``aelastic.checkpoint.load(into=state)``; ``first restore`` apart (the slot mapped). Its floor,
  ``raw copy from pinned``: the pinned tensors copied back the same way.
* ``torch.save to disk``: the state, to a file in the temporary directory (once).

Target (issue 29): a save, and a restore, at most 1.5x their raw copy.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from .agent import environment

WORKER = """\
import json, os, statistics, sys, time
import torch
import aelastic.checkpoint as ckpt

out, repeats, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
device = torch.device("cuda", 0)
NAMES = ("params", "exp_avg", "exp_avg_sq", "master")
n = size * 2**20 // 16

def timed(work):
    torch.cuda.synchronize(device)
    began = time.perf_counter()
    work()
    torch.cuda.synchronize(device)
    return time.perf_counter() - began

def copy(targets, sources):
    for name in NAMES:
        targets[name].copy_(sources[name], non_blocking=True)

torch.manual_seed(size)
saved = {name: torch.rand(n, device=device) for name in NAMES}
pinned = {name: torch.empty(n, pin_memory=True) for name in NAMES}
results = {"device": torch.cuda.get_device_name(device)}
if attempt == 0:
    saves = []
    for step in range(repeats):
        saves.append(timed(lambda: ckpt.save(saved, step=step)))
        time.sleep(0.2)
    results["saves"] = saves
    results["raw copy to pinned"] = statistics.median(timed(lambda: copy(pinned, saved)) for _ in range(repeats))
    path = os.path.join(os.path.dirname(out), "state.pt")
    results["torch.save to disk"] = timed(lambda: torch.save(saved, path))
else:
    state = {name: torch.zeros(n, device=device) for name in NAMES}  # fresh memory, as a restarted worker has
    results["restores"] = [timed(lambda: ckpt.load(into=state)) for _ in range(repeats)]
    assert all(torch.equal(state[name], saved[name]) for name in NAMES), "the restore is not the saved state"
    copy(pinned, saved)
    results["raw copy from pinned"] = statistics.median(timed(lambda: copy(state, pinned)) for _ in range(repeats))
with open(f"{out}.{attempt}", "w") as f:
    json.dump(results, f)
sys.exit(1 if attempt == 0 else 0)  # the first attempt fails: the second restores
"""


def job(size: int, repeats: int) -> dict[str, Any]:
    memory = 2 * size + 64  # two slots of the state, and room for its metadata
    with tempfile.TemporaryDirectory(prefix="aelastic_cuda_checkpoint_") as tmp:
        out, script = Path(tmp, "out.json"), Path(tmp, "worker.py")
        script.write_text(WORKER)
        command = [sys.executable, "-m", "aelastic", "run", "--standalone", "--nproc-per-node", "1",
                   "--max-restarts", "1", "--checkpoint-memory", f"{memory}MiB",
                   script, out, str(repeats), str(size)]  # fmt: skip
        proc = subprocess.run(command, env=environment("aelastic"), capture_output=True, timeout=600)
        if proc.returncode != 0:
            raise RuntimeError(f"the CUDA checkpoint run failed ({proc.returncode}): {proc.stderr.decode()[-3000:]}")
        first, second = (json.loads(Path(f"{out}.{attempt}").read_text()) for attempt in (0, 1))
    return {**first, **second}


WHAT = {
    "save": "aelastic.checkpoint.save of a GPU state until it returns (each slot's first save apart), beside a "
    "copy_ of the same tensors into pinned host tensors, and torch.save of them to local disk (torch)",
    "restore": "aelastic.checkpoint.load(into=...) onto fresh GPU tensors in the restarted process (its first load "
    "apart), beside a copy_ back from pinned host tensors",
    "first save of a slot": "the two saves that register the agent's two slots with CUDA (cudaHostRegister)",
}


def records(results: dict[int, dict[str, Any]]) -> list[dict[str, Any]]:
    """The run as benchmarks/RESULTS.md's records (its section "GPU checkpoints")."""
    rows = [
        ("save", "aelastic", lambda r: r["saves"][2:]),
        ("save", "raw copy to pinned", lambda r: [r["raw copy to pinned"]]),
        ("save", "torch", lambda r: [r["torch.save to disk"]]),
        ("first save of a slot", "aelastic", lambda r: r["saves"][:2]),
        ("restore", "aelastic", lambda r: r["restores"][1:]),
        ("restore", "raw copy from pinned", lambda r: [r["raw copy from pinned"]]),
        ("first restore", "aelastic", lambda r: r["restores"][:1]),
    ]
    return [
        {"scenario": scenario, "system": system, "param": size, "unit": "ms", "better": "lower",
         "samples": [seconds * 1000 for seconds in samples(r)],
         "what": WHAT.get(scenario, "") if (system == "aelastic" and size == min(results)) else ""}
        for scenario, system, samples in rows
        for size, r in results.items()
    ]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.cuda_checkpoint", description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="256,1024", help="state sizes in MiB (default 256,1024)")
    parser.add_argument("--repeats", type=int, default=8, help="saves and restores per size (default 8)")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    args = parser.parse_args(argv)
    results = {int(size): job(int(size), args.repeats) for size in args.sizes.split(",")}
    print(f"in-memory checkpoints of a GPU state ({next(iter(results.values()))['device']}), seconds, medians of "
          f"{args.repeats}")  # fmt: skip
    print(f"{'MiB':>5} {'save':>7} {'raw':>7} {'ratio':>6} {'restore':>7} {'raw':>7} {'ratio':>6} {'1st save':>8} "
          f"{'1st rest':>8} {'to disk':>7}")  # fmt: skip
    for size, r in results.items():
        save, restore = statistics.median(r["saves"][2:]), statistics.median(r["restores"][1:])
        print(f"{size:>5} {save:>7.4f} {r['raw copy to pinned']:>7.4f} {save / r['raw copy to pinned']:>5.2f}x "
              f"{restore:>7.4f} {r['raw copy from pinned']:>7.4f} {restore / r['raw copy from pinned']:>5.2f}x "
              f"{r['saves'][0]:>8.4f} {r['restores'][0]:>8.4f} {r['torch.save to disk']:>7.4f}")  # fmt: skip
    if args.json is not None:
        device = next(iter(results.values()))["device"]
        args.json.write_text(json.dumps({"benchmark": "cuda_checkpoint", "device": device,
                                         "records": records(results)}, indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
