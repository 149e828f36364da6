"""Times the scenario tests measure, kept for ``benchmarks/RESULTS.md``: each suite appends its samples to
``benchmarks/out/<suite>.json`` in the benchmark format, and ``python -m benchmarks`` cites them (its ``RECORDED``)."""

from __future__ import annotations

import json
from contextlib import suppress
from pathlib import Path
from typing import Any

OUT = Path(__file__).resolve().parents[2] / "benchmarks" / "out"


def report_time(
    suite: str, scenario: str, seconds: float | None, what: str, *, system: str = "aelastic", outcome: str | None = None
) -> None:
    """Print a scenario's measured time and append it to ``benchmarks/out/<suite>.json``.

    ``seconds`` None: nothing recovered to time; ``outcome`` says what happened instead (kept, latest first).
    """
    print(f"[{suite}] {system}: {scenario}: {what} in {seconds:.2f} s" if seconds is not None else
          f"[{suite}] {system}: {scenario}: {outcome}")  # fmt: skip
    path = OUT / f"{suite}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    data: dict[str, Any] = {"benchmark": suite, "records": []}
    with suppress(FileNotFoundError, ValueError):
        data = json.loads(path.read_text())
    record = next((r for r in data["records"] if (r["scenario"], r["system"]) == (scenario, system)), None)
    if record is None:
        record = {"scenario": scenario, "system": system, "param": None, "unit": "s", "samples": [],
                  "better": "lower", "what": what}  # fmt: skip
        data["records"].append(record)
    if seconds is not None:
        record["samples"].append(round(seconds, 3))
    if outcome is not None:
        record["outcome"] = outcome
    path.write_text(json.dumps(data, indent=1))
