"""What the job says its faults cost, against what its workers' step logs show: incident records and goodput; not run
in CI (``tests/test_incidents.py`` checks one incident on two nodes).

    python -m benchmarks.incidents [--minutes 10] [--faults 5] [--nodes 2] [--mib 64] [--json PATH]

A job of ``--nodes`` agents of one worker each on loopback (``--rdzv-backend c10d``; ``--nodes 1``: one agent of
two workers, ``--standalone``), ``--prewarm --max-restarts F``, trains for ``--minutes``: steps of 0.2 s (an
all-reduce, an update of every byte of ``--mib`` MiB of state per rank, the rest of the step waited out),
``aelastic.checkpoint.save`` after every step; ``--faults`` times, at random steps, a random rank is SIGKILLed
halfway through a step. Each rank logs the time it completes each step (``time.monotonic()``: one machine, one
clock), in its agent's file.

* From each node's step log: a step is done when the node's ranks logged it; a fault cost the node from the last
  step done before it to the next step done after it, less an ordinary step (the work it holds was due anyway: the
  median of the last 8 steps before the fault, as the incident records define it);
  the goodput is 1 - (their sum) / (the job's time, from the agents' start to their exit).
* From each node: its incident lines (their phases add up to their loss), and its summary line at the end.

Targets (issue 47): each incident within 10 % (or 50 ms) of the step logs' loss; each goodput within 1 % of the
step logs'.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from .agent import c10d_flags, environment, free_port

STEP = 0.2
WORKER = """
import json, os, signal, sys, time
import torch, torch.distributed as dist
import aelastic.checkpoint as ckpt

out, steps, mib, faults = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4])
dist.init_process_group("gloo")
rank = dist.get_rank()
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"]) + int(os.environ["AELASTIC_MEMBERSHIP_RESTARTS"])
state = {"w": torch.zeros(mib << 18), "step": -1}
restored = ckpt.load(into=state)
start = 0 if restored is None else restored["step"] + 1
fault = faults.get(str(attempt))
log = open(os.path.join(out, f"steps-{os.getppid()}.log"), "a")  # one per agent: its ranks' lines
for step in range(start, steps):
    began = time.monotonic()
    g = torch.ones(1024)
    dist.all_reduce(g)
    state["w"].add_(1.0)
    if fault is not None and fault == [step, rank]:
        time.sleep(STEP / 2)
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(max(STEP - (time.monotonic() - began), 0))
    ckpt.save({"w": state["w"], "step": step}, step=step)
    print(json.dumps({"step": step, "at": time.monotonic(), "attempt": attempt, "rank": rank}), file=log, flush=True)
dist.destroy_process_group()
""".replace("STEP", repr(STEP))
INCIDENT = re.compile(r"incident (\d+) \((.+)\): (\d+\.\d+) s lost(?:, until the job ended)?: (.*)")
SUMMARY = re.compile(r"(\d+) incidents? \((.+)\) cost (\d+\.\d+) s of ([\d,]+) s \(goodput (\d+\.\d+) %\)")


def step_log_losses(path: Path, ranks: int) -> tuple[list[float], float]:
    """Each fault's loss as one node's step log shows it (``ranks``: the node's workers), and the median of the
    ordinary steps the losses were measured against."""
    logged: dict[tuple[int, int], list[float]] = {}  # (attempt, step) -> when each rank logged it
    for line in path.read_text().splitlines():
        entry = json.loads(line)
        logged.setdefault((entry["attempt"], entry["step"]), []).append(entry["at"])
    done = {key: max(times) for key, times in logged.items() if len(times) == ranks}  # every rank of the node
    attempts = sorted({a for a, _ in done})
    losses, ordinaries = [], []
    for attempt in attempts[:-1]:
        mine = sorted((s, at) for (a, s), at in done.items() if a == attempt)
        # An ordinary step, as the incident records define it: the median of the last 8 before the fault.
        recent = [b[1] - a[1] for a, b in itertools.pairwise(mine[-9:]) if b[0] == a[0] + 1]
        ordinary = statistics.median(recent)
        last_step, last = mine[-1]
        back = min(at for (a, s), at in done.items() if a > attempt and s == last_step + 1)
        losses.append(back - last - ordinary)
        ordinaries.append(ordinary)
    return losses, statistics.median(ordinaries)


def run_job(out: Path, nodes: int, steps: int, mib: int, faults: dict[str, list[int]]) -> tuple[list[str], float]:
    """The job: one agent of two workers (``--standalone``), or ``nodes`` agents of one worker each on loopback
    (c10d: the first to bind the port serves the store); each agent's output, and the job's time."""
    if nodes == 1:
        flags = [["--standalone", "--nproc-per-node", "2"]]
    else:
        port = free_port()
        flags = [c10d_flags(str(nodes), "incidents", port, "last_call_timeout=1")] * nodes
    began, logs, agents = time.monotonic(), [], []
    for i, node in enumerate(flags):
        logs.append((out / f"agent{i}.log").open("w"))
        agents.append(subprocess.Popen(
            [sys.executable, "-m", "aelastic", "run", *node, "--prewarm", "--max-restarts", str(len(faults)),
             str(out / "train.py"), str(out), str(steps), str(mib), json.dumps(faults)],
            env=environment("aelastic"), stdout=logs[-1], stderr=subprocess.STDOUT,
        ))  # fmt: skip
    codes = [agent.wait() for agent in agents]
    total = time.monotonic() - began
    for log in logs:
        log.close()
    outputs = [(out / f"agent{i}.log").read_text() for i in range(len(agents))]
    if any(codes):
        raise SystemExit(f"the job failed ({codes}):\n" + "\n".join(o[-4000:] for o in outputs))
    return [f"{agent.pid}\n{output}" for agent, output in zip(agents, outputs, strict=True)], total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--faults", type=int, default=5)
    parser.add_argument("--nodes", type=int, default=2, help="agents of one worker each (1: one agent of two)")
    parser.add_argument("--mib", type=int, default=64, help="state per rank")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    steps = int(args.minutes * 60 / STEP)
    rng = random.Random(args.seed)
    at = sorted(rng.sample(range(20, steps - 20), args.faults))
    faults = {str(i): [step, rng.randrange(2)] for i, step in enumerate(at)}
    ranks = 2 if args.nodes == 1 else 1  # per node
    with tempfile.TemporaryDirectory(prefix="aelastic-incidents-") as tmp:
        out = Path(tmp)
        (out / "train.py").write_text(WORKER)
        outputs, total = run_job(out, args.nodes, steps, args.mib, faults)
        per_node = []
        for text in outputs:
            pid, output = text.split("\n", 1)
            per_node.append((output, *step_log_losses(out / f"steps-{pid}.log", ranks)))
    where = "one node of 2 workers" if args.nodes == 1 else f"{args.nodes} nodes of 1 worker"
    print(f"{args.faults} faults in {total:.0f} s, {where}, {args.mib} MiB per rank; faults {faults}")
    job_losses, log_losses, goodputs, worst, missed = [], [], [], 0.0, False
    for node, (output, losses, ordinary) in enumerate(per_node):
        incidents = [(int(m[1]), m[2], float(m[3]), m[4]) for m in INCIDENT.finditer(output)]
        summary = SUMMARY.search(output)
        if summary is None or len(incidents) != len(losses):
            raise SystemExit(
                f"node {node}: {len(incidents)} incident lines for {len(losses)} faults:\n{output[-5000:]}"
            )
        goodput_logs = 100 * (1 - sum(losses) / total)
        print(f" node {node} (steps of {ordinary:.3f} s):")
        for (number, cause, lost, phases), outside in zip(incidents, losses, strict=True):
            worst = max(worst, abs(lost - outside) / max(outside, 0.5))
            missed |= abs(lost - outside) > max(0.1 * outside, 0.05)
            print(f"  incident {number} ({cause}): the job says {lost:.3f} s, the step logs {outside:.3f} s: {phases}")
        print(f"  {summary[0]}; the step logs: goodput {goodput_logs:.2f} %")
        missed |= abs(float(summary[5]) - goodput_logs) > 1.0
        job_losses += [i[2] for i in incidents]
        log_losses += losses
        goodputs.append((float(summary[5]), goodput_logs))
    what = f"{args.mib} MiB per rank, {where}, --prewarm"
    records: list[dict[str, Any]] = [
        {"scenario": f"incidents: a fault's loss, the job's figure ({what})", "system": "aelastic",
         "param": args.nodes, "unit": "s", "samples": job_losses, "better": "lower",
         "what": "each node's line for each incident"},
        {"scenario": f"incidents: a fault's loss, the workers' step logs ({what})", "system": "aelastic",
         "param": args.nodes, "unit": "s", "samples": log_losses, "better": "lower",
         "what": "from the last step the node's workers did before the fault to the next one after it, less one step"},
        {"scenario": f"incidents: goodput over {args.minutes:g} min with {args.faults} faults, each node's line",
         "system": "aelastic", "param": args.nodes, "unit": "%", "samples": [g[0] for g in goodputs],
         "better": "higher"},
        {"scenario": f"incidents: goodput over {args.minutes:g} min with {args.faults} faults, the step logs",
         "system": "aelastic", "param": args.nodes, "unit": "%", "samples": [g[1] for g in goodputs],
         "better": "higher"},
    ]  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps({"benchmark": "incidents", "records": records}))
    if missed:
        print(f"missed: an incident off by more than 10 % (or 50 ms; worst {100 * worst:.1f} %), or a goodput by 1 %")
        sys.exit(1)


if __name__ == "__main__":
    main()
