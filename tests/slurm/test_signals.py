"""Scheduler signals on the real Slurm cluster (22.05, proctrack/linuxproc): each worker sees a notice exactly once,
whichever way Slurm sends it, and the job goes on; the checkpoint-and-requeue recipe of the README; torchrun beside.

What Slurm does with a signal, as measured here (the agents' log lines name the sender, slurmstepd):

* ``scancel --signal=USR1 JOB`` (a step signal; srun does the same with a signal it receives): slurmstepd signals
  every process of the step, each worker included, whatever its session. The agents' witness got it too, so they
  forward nothing.
* ``--signal=B:USR1`` / ``scancel --batch``: the batch shell alone. A shell that passes it to srun (the README's
  recipe, ``examples/slurm/requeue.sbatch``) makes it a step signal; a shell that ``exec``\\ s the agent hands it to
  the agent alone, which forwards it.
* ``scancel --full`` on a batch step: the batch shell's process group (the agent, not the workers, which lead groups
  of their own): the agent forwards it, although the sender is slurmstepd as for a step signal.

Every wait awaits an event: a file a worker writes, a line in a job's output, a job's state.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import suppress
from pathlib import Path

import pytest
from helpers.signals import WORKER

from .cluster import SlurmCluster

pytestmark = pytest.mark.slurm

SLURM_NODES = 2

DEADLINE = 120.0
REQUEUE_DEADLINE = 400.0  # a requeued job waits out a BeginTime hold (about 2 min) unless released sooner
ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent  # the venv's aelastic and torchrun
PATH_ENV = {"PATH": f"{BIN}:{os.environ.get('PATH', '/usr/bin:/bin')}"}


# The batch shell of the README's recipe: srun in the background, USR1 passed on to it (srun signals the step).
RELAYING_BATCH = """#!/bin/bash
srun {command} &
step=$!
trap 'kill -USR1 $step' USR1
wait $step
rc=$?
while kill -0 $step 2>/dev/null; do wait $step; rc=$?; done
exit $rc
"""


def wait_for(what: str, check: Callable[[], object], timeout: float = DEADLINE) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {timeout:g} s")
        time.sleep(0.05)


def read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except FileNotFoundError:
        return ""


def received(folder: Path, ranks: int) -> dict[int, list[str]]:
    return {r: list(filter(None, read(folder / f"got.{r}").split(","))) for r in range(ranks)}


def aelastic_run(folder: Path, *flags: str) -> list[str]:
    (folder / "worker.py").write_text(WORKER)
    return [sys.executable, "-m", "aelastic", "run", *flags, str(folder / "worker.py"), str(folder)]


def two_node_flags(folder: Path, port: int) -> list[str]:
    return ["--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
            f"node1:{port}", "--rdzv-id", folder.name]  # fmt: skip


@pytest.fixture
def background(slurm_cluster: SlurmCluster) -> Iterator[Callable[..., subprocess.Popen[bytes]]]:
    """Start a client command (srun) from the hub in the background, its output to a file; killed at the end."""
    started: list[subprocess.Popen[bytes]] = []

    def start(argv: list[str], output: Path) -> subprocess.Popen[bytes]:
        with output.open("wb") as out:
            started.append(subprocess.Popen(
                slurm_cluster.command(argv), env={**os.environ, **slurm_cluster.env, **PATH_ENV},
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            ))  # fmt: skip
        return started[-1]

    yield start
    for process in started:
        if process.poll() is None:
            process.kill()
            process.wait(DEADLINE)


def job_named(cluster: SlurmCluster, name: str) -> str:
    found: list[str] = []

    def check() -> bool:
        found[:] = cluster.run("squeue", "-h", "-n", name, "-o", "%i").stdout.split()
        return bool(found)

    wait_for(f"job {name}", check)
    return found[0]


def kill_leftovers(folder: Path) -> list[int]:
    """SIGKILL every process whose command line mentions ``folder``; their pids."""
    killed = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        with suppress(OSError):
            if str(folder).encode() in cmdline.read_bytes():
                pid = int(cmdline.parent.name)
                with suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                killed.append(pid)
    return killed


def test_usr1_to_the_step_reaches_every_worker_once_and_the_job_exits_0(
    slurm_cluster: SlurmCluster, background: Callable[..., subprocess.Popen[bytes]], tmp_path: Path
) -> None:
    """``srun -N2 aelastic run`` (2 workers per node); ``scancel --signal=USR1 JOB`` signals every process of the
    step: each of the 4 workers sees it once, both agents say they forwarded nothing, the job exits 0."""
    name = f"sig-step-{tmp_path.name}"
    out = tmp_path / "srun.out"
    command = aelastic_run(tmp_path, *two_node_flags(tmp_path, 29401))
    step = background(["srun", "-N2", "--ntasks-per-node=1", f"--job-name={name}", *command], out)
    wait_for("4 ready workers", lambda: all((tmp_path / f"ready.{r}").exists() for r in range(4)))
    job = job_named(slurm_cluster, name)
    slurm_cluster.scancel("--signal=USR1", job)
    wait_for("both agents' word", lambda: read(out).count("not forwarded again") == 2)
    (tmp_path / "done").touch()
    assert step.wait(DEADLINE) == 0, read(out)
    assert received(tmp_path, 4) == {r: ["SIGUSR1"] for r in range(4)}
    said = r"received SIGUSR1 from pid \d+ \(slurmstepd\), which signalled the workers directly too"
    assert re.search(said, read(out)), read(out)
    assert "forwarded to the workers' process groups" not in read(out)
    assert "reaper sidecar" not in read(out)  # the step signal reached the agents' sidecars too: it spared them
    print(f"[slurm] step signal: {[line for line in read(out).splitlines() if 'SIGUSR1' in line]}")


def test_usr1_to_the_batch_shell_relayed_through_srun_reaches_every_worker_once(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    """``--signal=B:USR1`` (here ``scancel --batch``, at once): the batch shell passes it to srun as the README's
    recipe does; srun signals the step; each worker once, the job completes."""
    out = tmp_path / "job.out"
    command = " ".join(aelastic_run(tmp_path, *two_node_flags(tmp_path, 29402)))
    job = slurm_cluster.sbatch(RELAYING_BATCH.format(command=command), "-N2", "--ntasks-per-node=1",
                               f"--output={out}", env=PATH_ENV)  # fmt: skip
    wait_for("4 ready workers", lambda: all((tmp_path / f"ready.{r}").exists() for r in range(4)))
    slurm_cluster.scancel("--batch", "--signal=USR1", job)
    wait_for("both agents' word", lambda: read(out).count("not forwarded again") == 2)
    (tmp_path / "done").touch()
    record = slurm_cluster.wait_job(job)
    assert record["JobState"] == "COMPLETED", read(out)
    assert received(tmp_path, 4) == {r: ["SIGUSR1"] for r in range(4)}


def test_usr1_to_an_agent_that_is_the_batch_shell_is_forwarded_once(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    """The batch shell ``exec``\\ s the agent: ``scancel --batch --signal=USR1`` reaches the agent alone, which forwards
    it; ``scancel --full --signal=USR2`` reaches the batch step's process group (the agent, not the workers): also
    forwarded. Each worker sees each once; the job completes."""
    out = tmp_path / "job.out"
    command = " ".join(aelastic_run(tmp_path, "--nproc-per-node", "2"))
    job = slurm_cluster.sbatch(f"#!/bin/sh\nexec {command}\n", "-N1", f"--output={out}", env=PATH_ENV)
    wait_for("2 ready workers", lambda: all((tmp_path / f"ready.{r}").exists() for r in range(2)))
    slurm_cluster.scancel("--batch", "--signal=USR1", job)
    wait_for("the agent's word", lambda: "received SIGUSR1: forwarded to the workers' process groups" in read(out))
    slurm_cluster.scancel("--full", "--signal=USR2", job)
    wait_for("the agent's word", lambda: "received SIGUSR2: forwarded to the workers' process groups" in read(out))
    (tmp_path / "done").touch()
    record = slurm_cluster.wait_job(job)
    assert record["JobState"] == "COMPLETED", read(out)
    assert received(tmp_path, 2) == {r: ["SIGUSR1", "SIGUSR2"] for r in range(2)}
    assert "not forwarded again" not in read(out)


def test_the_requeue_recipe_resumes_from_its_checkpoint(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    """``examples/slurm/requeue.sbatch`` with ``examples/slurm/requeue_train.py`` (gloo, 2 nodes x 2 workers): the
    notice (``scancel --batch --signal=USR1``, as ``--signal=B:USR1@90`` would send it) makes rank 0 save a
    checkpoint and requeue the job; the second run has SLURM_RESTART_COUNT=1, the same job and rendezvous id, and
    resumes from the checkpoint's step to the end (the job COMPLETED)."""
    out = tmp_path / "job.out"
    checkpoint = tmp_path / "ckpt.pt"
    env = {**PATH_ENV, "NPROC": "2"}
    job = slurm_cluster.run(
        "sbatch", "--parsable", f"--chdir={ROOT}", f"--output={out}", str(ROOT / "examples/slurm/requeue.sbatch"),
        "--checkpoint", str(checkpoint), "--steps", "400", env=env,
    ).stdout.strip()  # fmt: skip
    wait_for("step 20 of the first run", lambda: "rank 0: step 20" in read(out), DEADLINE)
    slurm_cluster.scancel("--batch", "--signal=USR1", job)
    wait_for("the checkpoint", lambda: "checkpoint saved at step" in read(out))
    saved = int(re.findall(r"checkpoint saved at step (\d+)", read(out))[0])

    # Requeued: PENDING (after REQUEUED, while the first run's processes are stopped) with a BeginTime about 2
    # minutes ahead; ask for it now (the generous deadline covers the hold should the update not take).
    def requeued() -> bool:
        record = slurm_cluster.job(job)
        return record.get("Restarts") == "1" and record.get("JobState") in ("PENDING", "RUNNING")

    start = time.monotonic()
    wait_for("the requeue", requeued)
    # The second run derives the same rendezvous endpoint (job id): release it only once every step of the first
    # run is gone, as Slurm's own hold of about 2 minutes would, or its node1 agent meets the old one's store.
    wait_for("the first run's steps to end",
             lambda: slurm_cluster.run("squeue", "-h", "-s", "-j", job, check=False).stdout.strip() == "")  # fmt: skip
    held = slurm_cluster.job(job)
    if held.get("JobState") == "PENDING":
        # Not "now": slurmd compares the new run's credential with the revocation of the first run's in whole
        # seconds, and refuses a launch in the same second ("Killing non-startable batch JobId=4: Job credential
        # revoked", then FAILED: seen beside stress-ng). Two seconds on, the new credential is younger.
        slurm_cluster.scontrol("update", f"JobId={job}", "StartTime=now+2", check=False)
    record = slurm_cluster.wait_job(job, timeout=REQUEUE_DEADLINE)
    elapsed = time.monotonic() - start
    assert record["JobState"] == "COMPLETED", read(out)
    text = read(out)
    starts = re.findall(r"rank (\d): job (\d+) run (\d) rendezvous (\S+): starting at step (\d+)", text)
    first = [s for s in starts if s[2] == "0"]
    second = [s for s in starts if s[2] == "1"]
    assert sorted(s[0] for s in first) == sorted(s[0] for s in second) == ["0", "1", "2", "3"], text
    assert {(s[1], s[3], s[4]) for s in first} == {(job, job, "0")}, text
    assert {(s[1], s[3], s[4]) for s in second} == {(job, job, str(saved))}, text
    assert text.count("finished at step 400") == 4, text
    assert f"job {job} run 1 on node[1-2]" in text
    # the notice came through srun as a step signal: each agent saw its workers got it, and forwarded nothing
    assert text.count("not forwarded again") == 2, text
    assert "reaper sidecar" not in text
    print(f"[slurm] requeue: checkpoint at step {saved}; BeginTime hold {held.get('StartTime')!r} "
          f"(state {held.get('JobState')}); requeued run completed {elapsed:.1f} s after the requeue")  # fmt: skip


def test_torchrun_beside(
    slurm_cluster: SlurmCluster, background: Callable[..., subprocess.Popen[bytes]], tmp_path: Path
) -> None:
    """What torchrun (2.13) does with the same step signal: it dies of SIGUSR1 ("task N: User defined signal 1");
    its workers, signalled by slurmstepd too, count it and run on without a supervisor. Recorded for RESULTS.md."""
    name = f"sig-torchrun-{tmp_path.name}"
    out = tmp_path / "srun.out"
    (tmp_path / "worker.py").write_text(WORKER)
    command = [str(BIN / "torchrun"), *two_node_flags(tmp_path, 29405), str(tmp_path / "worker.py"), str(tmp_path)]
    step = background(["srun", "-N2", "--ntasks-per-node=1", f"--job-name={name}", *command], out)
    try:
        wait_for("4 ready workers", lambda: all((tmp_path / f"ready.{r}").exists() for r in range(4)))
        job = job_named(slurm_cluster, name)
        slurm_cluster.scancel("--signal=USR1", job)
        code = step.wait(DEADLINE)
        time.sleep(2.0)  # what is left running once the step is over (nothing to await: it is an absence)
        alive = [pid for r in range(4) if (pid := int(read(tmp_path / f"ready.{r}"))) and Path(f"/proc/{pid}").exists()]
        (tmp_path / "done").touch()
        wait_for("the orphans' reports", lambda: all((tmp_path / f"got.{r}").exists() for r in range(4)) or not alive)
        got = received(tmp_path, 4)
        said = [line for line in read(out).splitlines() if "task" in line or "signal" in line]
        summary = {"srun_exit": code, "workers_alive_after_the_step": len(alive), "workers_got": got, "srun": said}
        print(f"[slurm] torchrun with a USR1 step signal: {json.dumps(summary)}")
        assert "User defined signal 1" in read(out), read(out)
        assert code != 0
    finally:
        kill_leftovers(tmp_path)


def test_torchrun_beside_as_the_batch_shell(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    """torchrun as the batch shell (``exec torchrun``) and ``--signal=B:USR1`` (``scancel --batch``): it dies of
    SIGUSR1; its workers never hear of the notice. Recorded for RESULTS.md."""
    out = tmp_path / "job.out"
    (tmp_path / "worker.py").write_text(WORKER)
    command = f"{BIN / 'torchrun'} --nproc-per-node 2 {tmp_path / 'worker.py'} {tmp_path}"
    try:
        job = slurm_cluster.sbatch(f"#!/bin/sh\nexec {command}\n", "-N1", f"--output={out}", env=PATH_ENV)
        wait_for("2 ready workers", lambda: all((tmp_path / f"ready.{r}").exists() for r in range(2)))
        slurm_cluster.scancel("--batch", "--signal=USR1", job)
        record = slurm_cluster.wait_job(job)
        time.sleep(2.0)  # what is left running once the job is over (an absence: nothing to await)
        alive = [pid for r in range(2) if (pid := int(read(tmp_path / f"ready.{r}"))) and Path(f"/proc/{pid}").exists()]
        (tmp_path / "done").touch()
        wait_for("the orphans' reports", lambda: all((tmp_path / f"got.{r}").exists() for r in range(2)) or not alive)
        summary = {"job": record["JobState"], "exit": record.get("ExitCode"), "workers_alive_after_the_job": len(alive),
                   "workers_got": received(tmp_path, 2) if alive else "-"}  # fmt: skip
        print(f"[slurm] torchrun as the batch shell, B:USR1: {json.dumps(summary)}")
        assert record["JobState"] in ("FAILED", "CANCELLED"), record
    finally:
        kill_leftovers(tmp_path)
