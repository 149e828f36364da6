"""The report's arithmetic (benchmarks/run.py): pure logic, so unit tests. The full run is ``python -m benchmarks``;
CI's ``--quick`` run once died here when torch's server spent 0.00 s of user-mode CPU in a small rank_scale run."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.run import ratio, table


@pytest.mark.parametrize(
    ("ours", "theirs", "better", "expected"),
    [
        ([1.0, 2.0, 3.0], [4.0], "lower", "0.50× (better)"),
        ([8.0], [4.0], "lower", "2.00× (worse)"),
        ([8.0], [4.0], "higher", "2.00× (better)"),
        ([0.01], [1.0], "lower", "0.01× (better)"),
        ([0.1], [0.0, 0.0, 0.01], "lower", "– (torch's median is 0, worse)"),
        ([0.1], [0.0], "higher", "– (torch's median is 0, better)"),
        ([0.0], [0.0], "lower", "equal"),
        ([], [1.0], "lower", ""),
    ],
)
def test_ratio(ours: list[float], theirs: list[float], better: str, expected: str) -> None:
    assert ratio(ours, theirs, better) == expected


def test_table_with_a_zero_torch_median() -> None:
    def record(system: str, samples: list[float]) -> dict[str, object]:
        return {"benchmark": "rank_scale", "scenario": "server CPU, user", "param": 64, "system": system,
                "samples": samples, "unit": "s", "better": "lower"}  # fmt: skip

    lines = table([record("torch libuv", [0.0, 0.0, 0.0]), record("aelastic uvloop", [0.01, 0.0, 0.02])])
    assert lines[2] == "| rank_scale | server CPU, user | 64 | torch libuv | 0.000 s | 0.000 s – 0.000 s | 3 |  |"
    assert lines[3].endswith("| 3 | – (torch's median is 0, worse) |")
