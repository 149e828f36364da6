"""Hang detection's verdicts, measured: precision and recall of ``--hang-timeout`` on injected true and false hangs,
beside ``stress-ng --cpu 2``; not run in CI (the fast part is ``tests/test_hang_verdicts.py``).

    python -m benchmarks.hang_verdicts [--runs 20] [--timeout 5] [--checkpoint-seconds 60] [--jobs 2] [--no-stress]
                                       [--json PATH]

Each run is one ``aelastic run --standalone --nproc-per-node 2 --hang-timeout T --max-restarts 0`` job of
``tests/hang_cases.py`` (its doc says what each case does):

* true hangs (``sleep``, ``stop``, ``deadlock``, ``io``): the job must be found hung and the odd rank named (both
  ranks for the deadlock) within T + 2 s of the fault (the workers' clock when the case begins; the agent's log
  line's time when the verdict is out: one machine, one clock);
* false ones (``checkpoint`` for ``--checkpoint-seconds``, ``evaluation``, ``loader``, ``device`` for 2.5 T): the job
  must end well with no verdict. ``device`` is the one case that needs the worker's marker
  (``aelastic.worker.busy``): a rank idle while its device works shows nothing outside its process.

Recall: true runs whose verdict named the right ranks within T + 2 s, over all true runs. Precision: right verdicts
over all verdicts (a verdict in a false case, or naming the wrong rank, is a false one).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from .agent import environment

CASES = Path(__file__).resolve().parent.parent / "tests" / "hang_cases.py"
TRUE = {"sleep": "rank 1", "stop": "rank 1", "deadlock": "ranks 0-1", "io": "rank 1"}
FALSE = ("checkpoint", "evaluation", "loader", "device")
VERDICT = re.compile(r"^\[([\d-]+ [\d:,]+)\] WARNING \S+: hang: no rank .*; (.+) named \(", re.MULTILINE)


def run_once(case: str, timeout: float, seconds: float) -> dict[str, Any]:
    """One job of ``case``: its exit code, what its verdict named (``None``: none) and how long after the fault."""
    work = Path(tempfile.mkdtemp(prefix=f"hang-{case}-"))
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "aelastic", "run", "--standalone", "--nproc-per-node", "2", "--monitor-interval",
             "0.1", "--hang-timeout", str(timeout), "--max-restarts", "0", str(CASES), case, str(seconds), str(work)],
            env=environment("aelastic"), capture_output=True, text=True, timeout=seconds + 300, check=False,
        )  # fmt: skip
        output = proc.stdout + proc.stderr
        faults = [json.loads(p.read_text())["time"] for p in work.glob("fault-*.json")]
        verdict = VERDICT.search(output)
        named = took = None
        if verdict is not None:
            named = verdict[2]
            at = datetime.datetime.strptime(verdict[1], "%Y-%m-%d %H:%M:%S,%f").timestamp()  # local time, as logged
            took = at - max(faults) if faults else None
        return {"case": case, "code": proc.returncode, "named": named, "took": took,
                "tail": "" if proc.returncode == 0 or verdict else output[-3000:]}  # fmt: skip
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20, help="runs of each case")
    parser.add_argument("--timeout", type=float, default=5.0, help="--hang-timeout")
    parser.add_argument("--checkpoint-seconds", type=float, default=60.0, help="the slow checkpoint's length")
    parser.add_argument("--jobs", type=int, default=2, help="jobs at once")
    parser.add_argument("--no-stress", action="store_true", help="without stress-ng beside it")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    t = args.timeout
    plan = [(case, t, 2.5 * t) for case in TRUE] + [
        (case, t, args.checkpoint_seconds if case == "checkpoint" else 2.5 * t) for case in FALSE
    ]
    stress = None if args.no_stress else subprocess.Popen(["stress-ng", "--cpu", "2", "--quiet"])
    try:
        with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
            futures = [pool.submit(run_once, *item) for item in plan for _ in range(args.runs)]
            results = [f.result() for f in futures]
    finally:
        if stress is not None:
            stress.terminate()
            stress.wait()
    bound = t + 2.0
    right = [r for r in results if r["case"] in TRUE and r["named"] == TRUE[r["case"]] and r["took"] is not None]
    found = [r for r in right if r["took"] <= bound]
    verdicts = [r for r in results if r["named"] is not None]
    true_runs = sum(r["case"] in TRUE for r in results)
    recall = len(found) / true_runs
    precision = len(right) / len(verdicts) if verdicts else 1.0
    load = "" if args.no_stress else ", beside stress-ng --cpu 2"
    print(f"hang verdicts, --hang-timeout {t:g}, {args.runs} runs per case{load}:")
    records = []
    for case in [*TRUE, *FALSE]:
        mine = [r for r in results if r["case"] == case]
        took = sorted(r["took"] for r in mine if r["took"] is not None)
        named = sorted({str(r["named"]) for r in mine})
        codes = sorted({r["code"] for r in mine})
        verdicts_here = sum(r["named"] is not None for r in mine)
        print(f"  {case:<11} {'true' if case in TRUE else 'false'}: verdicts {verdicts_here}/{len(mine)} naming "
              f"{named}, exit codes {codes}"
              + (f", detection {took[0]:.2f}-{took[-1]:.2f} s" if took else ""))  # fmt: skip
        for r in mine:
            if r["tail"]:
                print(f"    a run of {case} ended {r['code']} without a verdict:\n{r['tail']}")
        if case in TRUE and took:
            what = f"from the fault to the verdict naming {TRUE[case]}; bound {bound:g} s"
            records.append({"scenario": f"hang: time to a verdict, {case} (--hang-timeout {t:g}{load})",
                            "system": "aelastic", "param": 2, "unit": "s", "samples": took, "better": "lower",
                            "what": what})  # fmt: skip
        if case in FALSE:
            records.append({"scenario": f"hang: false verdicts, {case} ({len(mine)} runs{load})",
                            "system": "aelastic", "param": 2, "unit": "verdicts", "samples": [verdicts_here],
                            "better": "lower"})  # fmt: skip
    print(f"recall {100 * recall:.1f} % ({len(found)}/{true_runs} within {bound:g} s), precision "
          f"{100 * precision:.1f} % ({len(right)}/{len(verdicts)} verdicts right)")  # fmt: skip
    records += [
        {"scenario": f"hang: recall, true hangs found within --hang-timeout + 2 s{load}", "system": "aelastic",
         "param": 2, "unit": "%", "samples": [100 * recall], "better": "higher"},
        {"scenario": f"hang: precision, right verdicts of all verdicts{load}", "system": "aelastic", "param": 2,
         "unit": "%", "samples": [100 * precision], "better": "higher"},
    ]  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps({"benchmark": "hang_verdicts", "records": records}))
    if recall < 1 or precision < 1:
        sys.exit(1)


if __name__ == "__main__":
    main()
