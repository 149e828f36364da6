"""What needs a CUDA device, skipped without one: in-memory checkpoints of CUDA tensors (pinned copies, restores
onto the GPU), a worker killed mid-run in an NCCL job, and the abort of NCCL's communicators that a survivor's
wrapper does before its next round. Run on a GPU machine: ``pytest tests/test_gpu.py``.

NCCL refuses two ranks on one GPU ("Duplicate GPU detected"), so the NCCL jobs run one worker per GPU; on a machine
with one GPU the survivors' path (a peer aborted out of a collective) is checked in one process, and the two-worker
jobs with CUDA tensors run over gloo.
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from test_examples import PREFIX, Start, crash_at_25_restores_24, resumed_lines, start, step_lines

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.torch, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

__all__ = ["start"]  # the fixture, imported for the tests below

AELASTIC = [sys.executable, "-m", "aelastic"]
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


def test_cuda_state_in_memory_checkpoints_loses_only_the_interrupted_step(start: Start) -> None:
    """examples/checkpoint on the GPU, two workers over gloo: rank 1 SIGKILLs itself at step 25; both restore step
    24 from their agent's memory onto the GPU (rank 0 in its own process), and the losses are a clean run's."""
    crash_at_25_restores_24(start, [*AELASTIC, "run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
                                    "--prewarm", "examples/checkpoint/train.py", "--device", "cuda"])  # fmt: skip


def test_an_nccl_job_resumes_after_a_worker_is_killed_mid_run(start: Start, tmp_path: Path) -> None:
    """examples/elastic_ddp over NCCL, one worker per GPU: the last rank SIGKILLs itself at step 12; the agent
    restarts the workers, which resume from the step-10 checkpoint on disk and repeat step 11 to the last digit."""
    checkpoint = tmp_path / "ckpt.pt"
    proc = start(*AELASTIC, "run", "--standalone", "--nproc-per-node", str(GPUS), "--max-restarts", "1", "--prewarm",
                 "examples/elastic_ddp/train.py", "--device", "cuda", "--backend", "nccl", "--crash-at-step", "12",
                 "--checkpoint", checkpoint)  # fmt: skip
    assert proc.wait() == 0, proc.output
    assert re.search(PREFIX + rf"rank {GPUS - 1}: crashing at step 12 \(SIGKILL\)$", proc.output, re.M), proc.output
    steps = step_lines(proc.output)
    assert [step for step, _, _ in steps] == [*range(1, 12), *range(11, 41)], proc.output
    first, second = {s: loss for s, loss, _ in steps[:11]}, {s: loss for s, loss, _ in steps[11:]}
    assert resumed_lines(proc.output, GPUS) == [(rank, 10, first[10], 1) for rank in range(GPUS)], proc.output
    assert second[11] == first[11]


def test_an_nccl_job_restores_its_cuda_state_from_memory(start: Start) -> None:
    """examples/checkpoint over NCCL, one worker per GPU, the last rank killed at step 25: every rank restores step 24
    from memory; with two GPUs or more the other ranks keep their processes (their communicators aborted)."""
    command = [*AELASTIC, "run", "--standalone", "--nproc-per-node", str(GPUS), "--max-restarts", "1", "--prewarm",
               "examples/checkpoint/train.py", "--device", "cuda", "--backend", "nccl"]  # fmt: skip
    crashed = start(*command, "--crash-at-step", "25")
    assert crashed.wait() == 0, crashed.output
    clean = start(*command)
    assert clean.wait() == 0, clean.output
    restored = re.findall(
        PREFIX + rf"rank (\d) of {GPUS} \(pid (\d+)\): restored step (\d+) from (\w+) \(restart 1\)$",
        crashed.output, re.M,
    )  # fmt: skip
    assert sorted((int(rank), step, source) for rank, _, step, source in restored) == [
        (rank, "24", "memory") for rank in range(GPUS)], crashed.output  # fmt: skip
    started = dict(re.findall(PREFIX + rf"rank (\d) of {GPUS} \(pid (\d+)\): starts$", crashed.output, re.M))
    kept = {rank for rank, pid, _, _ in restored if started[rank] == pid}
    assert kept == {str(rank) for rank in range(GPUS - 1)}, crashed.output
    assert step_lines(crashed.output) == step_lines(clean.output)


ABORT_AND_AGAIN = textwrap.dedent("""
    import sys, torch, torch.distributed as dist
    from aelastic.worker._restart import _teardown

    torch.cuda.set_device(0)
    for round in range(3):
        store = dist.FileStore(f"{sys.argv[1]}.{round}", 1)
        dist.init_process_group("nccl", store=store, rank=0, world_size=1)
        value = torch.ones(4, device="cuda")
        dist.all_reduce(value)
        torch.cuda.synchronize()
        assert value.tolist() == [1.0] * 4, value
        _teardown()  # what a survivor's wrapper does after an abort: NCCL's communicators aborted, the group gone
        assert not dist.is_initialized()
        print(f"round {round}: all_reduce, abort, destroy", flush=True)
""")


def test_a_survivor_aborts_its_nccl_communicators_and_builds_new_ones_in_the_same_process(tmp_path: Path) -> None:
    """The survivor's path on NCCL, in one process of a world of 1: all-reduce, the wrapper's teardown (abort, then
    destroy), and a new process group, three times."""
    script = tmp_path / "abort_and_again.py"
    script.write_text(ABORT_AND_AGAIN)
    done = subprocess.run([sys.executable, script, tmp_path / "store"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert re.findall(r"^round (\d): all_reduce, abort, destroy$", done.stdout, re.M) == ["0", "1", "2"], done.stdout
