"""Hang detection's parts: progress from CPU time, the verdict on a hung job, /proc, the Flight Recorder's variables.

The end-to-end behaviour (two hosts, real hangs) is in ``tests/faults/test_hang.py``.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from aelastic.agent.hang.parent import flight_recorder_env, sample_period
from aelastic.agent.hang.verdict import Progress, RankReport, judge, span
from aelastic.agent.procfs import process_state, tree_times

IN_ALL_REDUCE = ("all_reduce (torch/distributed/distributed_c10d.py:2950)", "wrapper (torch/distributed/"
                 "c10d_logger.py:81)", "train (train.py:40)")  # fmt: skip
IN_BARRIER = ("barrier (torch/distributed/distributed_c10d.py:4700)", "train (train.py:52)")
SLEEPING = ("load_batch (train.py:12)", "train (train.py:38)")


def report(rank: int, state: str = "S", frames: tuple[str, ...] = IN_ALL_REDUCE) -> RankReport:
    return RankReport(rank, rank // 2, f"host{rank // 2}", 1000 + rank, state, frames)


def test_progress_is_cpu_time_beyond_what_idle_threads_use() -> None:
    progress = Progress()
    progress.observe(1, 5.0, now=100.0)
    progress.observe(1, 5.01, now=110.0)  # 10 ms in 10 s: a thread waking now and then
    assert progress.idle_for([1], now=110.0) == 10.0
    progress.observe(1, 5.5, now=111.0)  # half a CPU-second: work
    assert progress.idle_for([1], now=111.0) == 0.0
    for second in range(112, 130):  # idle again, long enough that its average since 111 s is low ...
        progress.observe(1, 5.5, now=second)
    progress.observe(1, 5.53, now=130.3)  # ... then a light step (30 ms in 0.3 s): progress, judged per interval
    assert progress.idle_for([1], now=130.3) == 0.0
    progress.observe(2, 1.0, now=125.3)
    assert progress.idle_for([1, 2], now=135.3) == 5.0  # the least idle worker decides
    assert progress.idle_for([3], now=135.3) == 0.0  # never sampled: no claim of idleness
    progress.observe(4, 2.0, now=100.0, io=0)
    progress.observe(4, 2.0, now=110.0, io=2_000)  # a hung rank's stray log lines: bytes, not kilobytes a second
    assert progress.idle_for([4], now=110.0) == 10.0
    progress.observe(4, 2.001, now=111.0, io=2_000 + (1 << 20))  # a MiB written in a second, its CPU idle: progress
    assert progress.idle_for([4], now=111.0) == 0.0
    progress.forget([1, 2])
    assert progress.idle_for([1], now=140.0) == 0.0


def test_a_rank_outside_the_collective_the_others_wait_in_is_named() -> None:
    verdict = judge([report(0), report(1), report(2), report(3, frames=SLEEPING)], 4)
    assert verdict.culprits == {3}
    assert not verdict.everyone
    assert verdict.summary.splitlines()[0] == "rank 3 named (the others wait for it in a collective):"
    assert "rank 3 (node 1, host1, pid 1003): sleeping, outside any collective, at load_batch (train.py:12)" in (
        verdict.summary
    )
    assert verdict.summary.endswith("the others: ranks 0-2 in all_reduce")


def test_a_stopped_or_uninterruptible_rank_is_named_whatever_its_stack() -> None:
    verdict = judge([report(0), report(1, "T"), report(2), report(3, "D")], 4)
    assert verdict.culprits == {1, 3}
    assert "stopped (SIGSTOP)" in verdict.summary
    assert "in uninterruptible sleep (D state)" in verdict.summary


def test_ranks_in_another_collective_than_most_are_named() -> None:
    verdict = judge([report(0), report(1), report(2, frames=IN_BARRIER), report(3)], 4)
    assert verdict.culprits == {2}
    assert "the others wait in all_reduce" in verdict.summary


def test_ranks_that_hang_alike_are_all_named_and_all_stopped() -> None:
    verdict = judge([report(rank) for rank in range(4)], 4)
    assert verdict.culprits == {0, 1, 2, 3}
    assert verdict.everyone
    assert "no rank differs from the others" in verdict.summary
    split = judge([report(0), report(1, frames=IN_BARRIER)], 2)  # one each: nothing says which is odd
    assert split.culprits == {0, 1}


def test_ranks_without_a_report_are_named_when_the_others_wait() -> None:
    verdict = judge([report(0), report(1), report(2)], 4)
    assert verdict.culprits == {3}
    assert verdict.everyone  # no agent answered for rank 3: only stopping every worker frees the others
    assert "rank 3: no report (their agents did not answer)" in verdict.summary


def test_reports_cross_the_store_as_json() -> None:
    original = report(5, "T", SLEEPING)
    assert RankReport.from_json(original.to_json()) == original
    faulthandler_style = RankReport(0, 0, "h", 1, "S", ("all_reduce (/x/torch/distributed/distributed_c10d.py:9)",))
    assert faulthandler_style.collective == "all_reduce"


@pytest.mark.parametrize(
    ("ranks", "text"), [([3], "rank 3"), ([2, 0, 1], "ranks 0-2"), ([0, 1, 2, 5, 7, 8], "ranks 0-2, 5, 7-8")]
)
def test_ranks_in_short(ranks: list[int], text: str) -> None:
    assert span(ranks) == text


def test_the_sample_period_is_a_tenth_of_the_timeout_within_bounds() -> None:
    assert sample_period(10) == 1.0
    assert sample_period(0.5) == 0.1
    assert sample_period(600) == 5.0


def test_proc_tells_a_busy_tree_from_a_sleeping_one() -> None:
    busy = "import subprocess, sys, time\nsubprocess.Popen([sys.executable, '-c', 'while True: pass'])\ntime.sleep(60)"
    with (
        subprocess.Popen([sys.executable, "-c", busy]) as parent,  # idle itself: its child burns the CPU
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) as sleeper,
    ):
        try:
            first = {p.pid: tree_times(p.pid).cpu for p in (parent, sleeper)}
            deadline = time.monotonic() + 60
            while tree_times(parent.pid).cpu - first[parent.pid] < 0.5:  # the child's CPU counts as its parent's
                assert time.monotonic() < deadline, "the busy child's CPU time never showed in its parent's tree"
                time.sleep(0.1)
            assert tree_times(sleeper.pid).cpu - first[sleeper.pid] < 0.1
            assert process_state(sleeper.pid) == "S"
        finally:
            children = Path(f"/proc/{parent.pid}/task/{parent.pid}/children").read_text().split()
            for process in (parent, sleeper):
                process.kill()
            for child in children:
                subprocess.run(["kill", "-9", child], check=False)
    assert tree_times(parent.pid) == ("", 0.0, 0)  # gone


def test_the_flight_recorder_is_turned_on_unless_the_user_said_anything_of_it(tmp_path: Path) -> None:
    env = flight_recorder_env({}, tmp_path / "pipe_", tmp_path / "fr_")
    assert env == {
        "TORCH_FR_BUFFER_SIZE": "2000",
        "TORCH_NCCL_DEBUG_INFO_PIPE_FILE": str(tmp_path / "pipe_"),
        "TORCH_FR_DUMP_TEMP_FILE": str(tmp_path / "fr_"),
    }
    assert "TORCH_FR_DUMP_TEMP_FILE" not in flight_recorder_env({}, tmp_path / "pipe_", None)
    assert flight_recorder_env({"TORCH_NCCL_TRACE_BUFFER_SIZE": "0"}, tmp_path / "pipe_", None) == {}
