"""Soak of the job's own etcd at its defaults: 4 real agents train for ``--minutes`` beside ``stress-ng --cpu 2``, and
no healthy node may be evicted; not run in CI.

    python -m benchmarks.job_etcd_soak [--minutes 10] [--no-stress] [--json PATH]

The agents run on four loopback addresses of this machine (``--local-addr``), with ``--rdzv-backend etcd
--rdzv-endpoint embedded:<the four>`` and no ``--rdzv-conf`` but the port: the job's etcd finds a lost node in
seconds by default (keep-alive 1 s x 3), and this measures what that costs on a loaded machine. Each worker
all-reduces once a second until a stop file appears. Nobody dies, so every round after the first is a false
eviction (each agent logs a line per completed round); the workers' restart counts say the same from their side.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HOSTS = ("127.0.0.1", "127.0.0.2", "127.0.0.3", "127.0.0.4")
ROUND = re.compile(r"round (\d+) complete")
WORKER = """
import os, pathlib, sys, time
import torch, torch.distributed as dist
dist.init_process_group("gloo")
stop, step = pathlib.Path(sys.argv[1]), 0
while not stop.exists():
    t = torch.ones(1)
    dist.all_reduce(t)
    step += 1
    print(f"step {step} world {int(t.item())} restart {os.environ['TORCHELASTIC_RESTART_COUNT']}", flush=True)
    time.sleep(1)
dist.destroy_process_group()
"""


def free_port_pair() -> int:
    """A client port whose next port is free too (the peers'), on every host."""
    import socket

    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        try:
            for host in HOSTS:
                for p in (port, port + 1):
                    with socket.socket() as probe:
                        probe.bind((host, p))
        except OSError:
            continue
        return port


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--no-stress", action="store_true", help="without stress-ng beside it")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="job-etcd-soak-"))
    script, stop = work / "train.py", work / "stop"
    script.write_text(WORKER)
    endpoint, port = "embedded:" + ",".join(HOSTS), free_port_pair()
    stress = None if args.no_stress else subprocess.Popen(["stress-ng", "--cpu", "2", "--quiet"])
    agents, logs = [], []
    try:
        for host in HOSTS:
            log = (work / f"{host}.log").open("w")
            logs.append(work / f"{host}.log")
            agents.append(subprocess.Popen(
                [sys.executable, "-m", "aelastic", "run", "--nnodes", "4", "--nproc-per-node", "1", "--max-restarts",
                 "100", "--rdzv-backend", "etcd", "--rdzv-endpoint", endpoint, "--rdzv-id", "soak", "--local-addr",
                 host, "--rdzv-conf", f"etcd_port={port}", str(script), str(stop)],
                stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "LOGLEVEL": "INFO"},  # its rounds logged
            ))  # fmt: skip
        began = time.monotonic()
        time.sleep(args.minutes * 60)
        stop.touch()
        codes = [agent.wait(timeout=300) for agent in agents]
        took = time.monotonic() - began
    finally:
        for agent in agents:
            agent.kill()
        if stress is not None:
            stress.terminate()
            stress.wait()
    text = [log.read_text() for log in logs]
    rounds = [max((int(m) for m in ROUND.findall(t)), default=-1) for t in text]
    restarts = [max((int(m) for m in re.findall(r"restart (\d+)", t)), default=-1) for t in text]
    steps = [len(re.findall(r"step \d+ world 4 ", t)) for t in text]
    if min(rounds) < 0:
        raise RuntimeError(f"a node logged no completed round: see {work}")
    evictions = max(rounds)  # rounds after the first (round 0): each is a membership change, here a false one
    print(f"job etcd soak, {took / 60:.1f} min{'' if args.no_stress else ' beside stress-ng --cpu 2'}: exit codes "
          f"{codes}, last round per node {rounds}, worker restarts {restarts}, steps in a world of 4 {steps}; "
          f"false evictions: {evictions}")  # fmt: skip
    if args.json:
        what = f"4 agents for {args.minutes:g} min, defaults{'' if args.no_stress else ', beside stress-ng --cpu 2'}"
        records = [{"scenario": f"job etcd: false evictions ({what})", "system": "aelastic", "param": 4,
                    "unit": "evictions", "samples": [evictions], "better": "lower"}]  # fmt: skip
        args.json.write_text(json.dumps({"benchmark": "job_etcd_soak", "records": records}))
    if evictions or any(codes):
        print(f"logs kept in {work}")
        sys.exit(1)
    shutil.rmtree(work)


if __name__ == "__main__":
    main()
