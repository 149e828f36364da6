"""The framework examples' ``--step-log`` (``benchmarks/frameworks.py`` runs them with the repository on
``PYTHONPATH``): rank 0 appends when each step ended, and in which round, from which the benchmark measures a fault's
cost in both systems alike, as the agent's incident records count it (:func:`lost_to_the_fault`, which
tests/test_incidents.py checks those records against). Standard library only."""

from __future__ import annotations

import itertools
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any


def log_step(path: str, step: int) -> None:
    """Append step ``step``'s end to ``path``."""
    # A round: a new process (torchrun), or a survivor's next call (aelastic: the restart counters change).
    counts = (os.environ.get(name, "0") for name in ("TORCHELASTIC_RESTART_COUNT", "AELASTIC_MEMBERSHIP_RESTARTS"))
    record = {"step": step, "round": f"{os.getpid()}/{'/'.join(counts)}", "at": time.monotonic()}
    with open(path, "a", encoding="utf-8") as log:
        log.write(json.dumps(record) + "\n")


def read(path: str | Path) -> list[dict[str, Any]]:
    """A step log's records (``{"step", "round", "at"}``), in the order written."""
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def lost_to_the_fault(lines: list[dict[str, Any]]) -> float:
    """The training time one fault cost, from the step log of a job with one: from the end of the last step done in
    the first round to the end of the next step, done in a later round, less one ordinary step (the median of the
    nine before the fault): the restart, the restore and the steps done again."""
    first = lines[0]["round"]
    before = list(itertools.takewhile(lambda line: line["round"] == first, lines))
    ordinary = statistics.median(b["at"] - a["at"] for a, b in itertools.pairwise(before[-10:]))
    last = before[-1]
    back = next(line for line in lines[len(before) :] if line["step"] == last["step"] + 1)
    return float(back["at"] - last["at"] - ordinary)
