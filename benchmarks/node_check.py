"""The node check (``--node-check``, issue 31): what it costs a job's start, beside torchrun (which checks nothing).

    python -m benchmarks.node_check [--quick] [--repeats N] [--json PATH]

Scenarios, N agents on loopback (``--nnodes N``, c10d, one no-op worker each), all started at once:

* ``c10d launch``: wall time until the last agent exits, for torchrun, ``aelastic run`` and ``aelastic run
  --node-check`` (every node new: the check runs once, in the first round).
* ``node check``: the check's time as the agents log it, from the round's completion to the verdict (the slowest
  agent's): the check processes' start (an interpreter and ``import torch`` each, N of them at once on this
  machine's cores, overlapping the agents' start and rendezvous where they can) and the two check rounds.
* ``node check rounds``: the same, from every check process ready to the verdict: the two rounds of matmuls and
  all-reduces and the exchanges through the round's store, what the check itself takes.

A slow node left out across network namespaces is timed by the fault suite (tests/faults/test_node_check.py).
"""

from __future__ import annotations

import argparse
import compileall
import json
import re
import statistics
import sys
from pathlib import Path

import aelastic

from .agent import NOOP, Samples, c10d_launch, scratch

CHECKED = "aelastic --node-check"
SYSTEMS = ("torch", "aelastic", CHECKED)
VERDICT = re.compile(r"node check of round 0 passed in ([\d.]+) s \(every check process ready after ([\d.]+) s\)")


def check_times(outputs: list[str]) -> tuple[float, float]:
    """The slowest agent's check (round complete to verdict), and its rounds (every process ready to verdict)."""
    found = [VERDICT.search(output) for output in outputs]
    if not all(found):
        raise RuntimeError("an agent logged no node check verdict:\n" + "\n".join(o[-1500:] for o in outputs))
    times = [(float(m[1]), float(m[1]) - float(m[2])) for m in found if m is not None]
    return max(t for t, _ in times), max(r for _, r in times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.node_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: one repetition of 2 nodes")
    parser.add_argument("--repeats", type=int, default=None, help="repetitions per scenario (default: 3)")
    parser.add_argument("--json", type=Path, default=None, help="write the records here")
    args = parser.parse_args(argv)
    repeats = args.repeats or (1 if args.quick else 3)
    nodes = (2,) if args.quick else (2, 4)

    compileall.compile_dir(Path(aelastic.__file__).parent, quiet=1)  # as pip installs it (see benchmarks.agent)
    samples = Samples()
    with scratch() as tmp:
        noop = tmp / "noop.py"
        noop.write_text(NOOP)
        for rep in range(repeats):
            for n in nodes:
                for system in SYSTEMS if rep % 2 == 0 else SYSTEMS[::-1]:
                    if system == CHECKED:
                        took, outputs = c10d_launch("aelastic", noop, n, "--node-check", env={"LOGLEVEL": "INFO"})
                        check, rounds = check_times(outputs)
                        samples.add_param("node check", system, n, check)
                        samples.add_param("node check rounds", system, n, rounds)
                    else:
                        took, _ = c10d_launch(system, noop, n)
                    samples.add_param("c10d launch", system, n, took)

    records = [
        {"scenario": scenario, "system": system, "param": param, "unit": "s", "samples": values, "better": "lower"}
        for (scenario, system, param), values in samples.values.items()
    ]
    print(f"node check benchmark: {repeats} repetitions per scenario (medians, min-max)")
    for r in records:
        values = r["samples"]
        print(f"{r['scenario']:<18} {r['param']:>2} {r['system']:<22} {statistics.median(values):>8.3f} s "
              f"{min(values):>8.3f} s {max(values):>8.3f} s")  # fmt: skip
    if args.json is not None:
        args.json.write_text(json.dumps({"benchmark": "node_check", "records": records}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
