"""In-process restarts on one node (``aelastic.worker.restartable``): real agents on asyncio and trio, real gloo
workers (the fault suite's ``restartable_trainer.py``), faults injected on a schedule; and the wrapper outside an
agent. Across hosts: tests/faults/test_survivors.py; under Slurm: tests/slurm/test_node_loss.py."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import test_agent_e2e
from test_agent_e2e import DEADLINE, Job, common

from aelastic.worker._restart import is_distributed_error

pytestmark = [pytest.mark.anyio, pytest.mark.torch]

job = test_agent_e2e.job
TRAINER = Path(__file__).resolve().parent / "faults" / "restartable_trainer.py"


def starts(job: Job) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted((job.out / "h0").glob("start-*.json"))]


async def train(
    job: Job,
    schedule: list[list[Any]],
    steps: int,
    *flags: str,
    pause: float = 0.02,
    deadline: float = DEADLINE,
    env: dict[str, str] | None = None,
) -> Any:
    (job.out / "h0").mkdir(exist_ok=True)
    path = job.out / "schedule.json"
    path.write_text(json.dumps(schedule))
    env = {"FAULTS_HOST": "h0", "FAULTS_STEP_PAUSE": str(pause), "FAULTS_STEPS": str(steps),
           "FAULTS_SCHEDULE": str(path), **(env or {})}  # fmt: skip
    restarts = str(len(schedule) + 1)
    agent = await job.agent("--standalone", *common(4, "--max-restarts", restarts), *flags, TRAINER, job.out, env=env)
    assert await agent.wait(deadline) == 0, agent.output[-5000:]
    return json.loads((job.out / "final.json").read_text())["digest"]


async def test_a_raising_worker_is_replaced_and_its_peers_keep_their_processes(job: Job) -> None:
    await train(job, [[30, 1, "raise"], [40, 2, "raise"]], 60, "--prewarm")
    records = starts(job)
    first = {r["rank"]: r["pid"] for r in records if r["call"] == 1 and r["start"] == 0}
    second = {r["rank"]: (r["pid"], r["call"], r["start"], r["loaded"]["source"]) for r in records if r["start"] == 30}
    assert second[1][0] != first[1]  # replaced, and its replacement's first call
    assert second[1][1:] == (1, 30, "memory")
    for rank in (0, 2, 3):  # the others went on in their processes, in a second call, from the same step
        assert second[rank] == (first[rank], 2, 30, "memory"), (first, second)
    # Rank 2 then raised in its second call: its traceback reads as a first call's would (torch's excepthook, which
    # init_process_group installs on every call, prefixes each line once).
    output = job.agents[0].output
    assert "[rank2]: RuntimeError: fault 1 at step 40" in output
    assert "[rank2]: [rank2]:" not in output


# On asyncio only: a hundred restarts take minutes, and what they test is the supervision's, the same on either
# loop (the restarts above, the survivor's grace below and test_checkpoint's ten faults run on both).
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.slow
async def test_faults_at_a_hundred_random_steps_change_nothing_of_the_final_model(job: Job) -> None:
    """99 kills, uncaught errors and exits, and one SIGSTOP inside an all-reduce (found by --hang-timeout), at random
    steps of a 4-worker job: it finishes, and its model is bitwise the fault-free run's."""
    rng = random.Random(30)
    steps = 400
    at = sorted(rng.sample(range(1, steps), 100))
    schedule = [[s, rng.randrange(4), rng.choice(["raise", "kill", "exit"])] for s in at]
    schedule[50][2] = "stop"
    faulty = await train(job, schedule, steps, "--prewarm", "--hang-timeout", "3", deadline=900)
    assert len(list(job.out.glob("fault-*.json"))) == 100
    for path in (*job.out.glob("fault-*"), job.out / "final.json"):
        path.unlink()
    clean = await train(job, [], steps)
    assert faulty == clean


@pytest.mark.parametrize(
    ("error", "distributed"),
    [
        (RuntimeError("[../gloo/transport/tcp/pair.cc:553] Connection closed by peer [10.0.0.2]:1234"), True),
        (ConnectionResetError("Connection reset by peer"), True),
        (ValueError("a bug of the training code"), False),
        (KeyError("step"), False),
    ],
)
def test_a_collectives_failure_is_told_from_the_training_codes(error: BaseException, distributed: bool) -> None:
    assert is_distributed_error(error) is distributed
    chained = ValueError("while handling it")
    chained.__cause__ = error
    assert is_distributed_error(chained) is distributed  # what caused it counts


def test_outside_an_agent_the_function_runs_once(tmp_path: Path) -> None:
    script = tmp_path / "once.py"
    script.write_text(
        "from aelastic.worker import restartable\n"
        "calls = []\n"
        "@restartable\n"
        "def f(x):\n"
        "    calls.append(x)\n"
        "    if len(calls) == 2:\n"
        "        raise ValueError('the second call fails')\n"
        "    return x * 2\n"
        "assert f(21) == 42\n"
        "try:\n    f(1)\nexcept ValueError:\n    print('raised once', calls)\n"
    )
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "raised once [21, 1]"
    torchrun = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
                               str(script)], capture_output=True, text=True, timeout=300)  # fmt: skip
    assert torchrun.returncode == 0, torchrun.stderr
    assert "raised once [21, 1]" in torchrun.stdout


CUT_SHORT = textwrap.dedent("""
    import sys, torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d
    from aelastic.worker._restart import RestartRequested, _teardown

    def init(n):
        dist.init_process_group("gloo", init_method=f"file://{sys.argv[1]}/store-{n}", rank=0, world_size=1)

    def cut_short(where):
        helper, make_default = c10d._new_process_group_helper, c10d._update_default_pg
        def named(*args, **kwargs):
            if where == "named":
                raise RestartRequested
            made = helper(*args, **kwargs)
            if where == "built":
                raise RestartRequested
            return made
        def made_default(pg):
            make_default(pg)
            raise RestartRequested
        c10d._new_process_group_helper = named
        if where == "default":
            c10d._update_default_pg = made_default
        try:
            init(where)
        except RestartRequested:
            pass
        finally:
            c10d._new_process_group_helper, c10d._update_default_pg = helper, make_default

    for where in ("named", "built", "default"):
        cut_short(where)
        _teardown()
        init(where + "-again")
        print(where, dist.group.WORLD.group_name, len(c10d._world.pg_map), flush=True)
        dist.destroy_process_group()
""")


def test_an_abort_that_cuts_init_process_group_short_leaves_no_half_made_group(tmp_path: Path) -> None:
    """The abort surfaces at any bytecode of the worker's main thread, also inside ``init_process_group``: after it
    named the default group, after it built it, after it made it the default. The teardown leaves torch as a fresh
    process has it, so that the next round's group has the name its fresh peers give theirs ("0"), under which they
    find each other's keys."""
    script = tmp_path / "cut_short.py"
    script.write_text(CUT_SHORT)
    out = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:3] == ["named 0 1", "built 0 1", "default 0 1"], out.stdout + out.stderr


async def test_a_survivor_asleep_is_woken_by_the_abort_and_keeps_its_process(job: Job) -> None:
    """Rank 0 is in an hour's ``time.sleep`` (a step waiting on its data, on a device) when rank 1 fails at the same
    step: the abort's signal ends the sleep, and rank 0 goes on in its process from the step before, as ranks 2 and 3
    do; only rank 1 is replaced."""
    await train(job, [[20, 0, "sleep"], [20, 1, "raise", 0]], 30, "--prewarm")  # rank 1 raises once rank 0 sleeps
    records = starts(job)
    first = {r["rank"]: r["pid"] for r in records if r["start"] == 0}
    second = {r["rank"]: (r["pid"], r["call"], r["loaded"]["source"]) for r in records if r["start"] == 20}
    assert second[1][0] != first[1]
    for rank in (0, 2, 3):
        assert second[rank] == (first[rank], 2, "memory"), (first, second)


async def test_a_survivor_that_does_not_let_go_is_killed_and_replaced(job: Job) -> None:
    """Rank 0 is in a C call that no signal ends (a long sleep with the abort's wake signal blocked: the abort's
    exception waits for it to return) when rank 1 fails at the same step: rank 0 is killed once the abort's grace is
    over, and replaced; ranks 2 and 3 keep their processes. Rank 1's replacement is started at once, not after rank
    0's grace: it needs no survivor."""
    schedule = [[20, 0, "hold"], [20, 1, "raise", 0]]  # rank 1 raises once rank 0 is held
    await train(job, schedule, 30, env={"LOGLEVEL": "DEBUG"})
    agent_log = job.agents[0].output
    let_go = agent_log.index("did not let go of its round within 10 s of the abort: killing it and starting another")
    records = starts(job)
    first = {r["rank"]: r["pid"] for r in records if r["start"] == 0}
    second = {r["rank"]: r["pid"] for r in records if r["start"] == 20}
    assert second[0] != first[0], agent_log[-8000:]
    assert second[1] != first[1], agent_log[-8000:]
    assert (second[2], second[3]) == (first[2], first[3]), agent_log[-8000:]
    assert agent_log.index(f"started worker local_rank 1 (pid {second[1]})") < let_go, agent_log[-5000:]


# Rank 1 fails in its first attempt with an error of its own, its groups' release held until its replacement has
# started (at most 120 s); rank 0 waits in a sleep, which the abort ends. Both then meet in a barrier.
OWN_FAILURE = textwrap.dedent("""
    import os, pathlib, sys, time
    import torch.distributed as dist
    import aelastic.worker._restart as restart
    from aelastic.worker import restartable

    out, rank, attempt = pathlib.Path(sys.argv[1]), os.environ["RANK"], os.environ["TORCHELASTIC_RESTART_COUNT"]
    (out / f"started-{rank}-{attempt}").touch()
    release = restart._teardown

    def held_release():
        for _ in range(1200):
            if (out / "started-1-1").exists():
                break
            time.sleep(0.1)
        (out / "released").write_text(str((out / "started-1-1").exists()))
        release()

    @restartable
    def main():
        dist.init_process_group("gloo")
        if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
            if dist.get_rank() == 1:
                restart._teardown = held_release
                raise ValueError("its own failure")
            time.sleep(3600)
        dist.barrier()
        dist.destroy_process_group()

    main()
""")


async def test_a_workers_own_failure_is_reported_before_its_groups_are_released(job: Job) -> None:
    """An error of the worker's own reaches the agent at once, and the replacement starts while the failed worker
    releases its process groups (which its exit report, made where the worker is pre-warmed, then waits for): the
    release is held here until the replacement has started, and would wait 120 s and say so had the report waited
    for the release."""
    script = job.tmp_path / "own_failure.py"
    script.write_text(OWN_FAILURE)
    agent = await job.agent("--standalone", *common(2, "--max-restarts", "1"), "--prewarm", script, job.out)
    assert await agent.wait(DEADLINE) == 0, agent.output[-5000:]
    assert (job.out / "released").read_text() == "True"
    assert "[rank1]: ValueError: its own failure" in agent.output


# Rank 2 leaves at once; rank 0's receive from it fails, and the abort's exception is raised as that failure unwinds
# (its context holds the collective's frames); rank 0 releases its groups and waits, its exception alive, as a
# survivor waits for its verdict. Rank 1 waits for a message from rank 0 that never comes: only the close of rank
# 0's connections ends that wait.
RELEASED = textwrap.dedent("""
    import torch
    from aelastic.worker import _restart as restart

    dist = init_gloo()
    rank = dist.get_rank()
    dist.barrier()  # every pair of ranks connected
    t = torch.zeros(1)
    if rank == 2:
        os._exit(0)
    if rank == 1:
        try:
            dist.recv(t, src=0)
        except RuntimeError as error:
            report("freed", at=time.monotonic(), error=str(error))
        os._exit(0)

    def collective():
        dist.recv(t, src=2)

    try:
        try:
            collective()
        except RuntimeError:
            raise restart.RestartRequested from None
    except restart.RestartRequested as exc:
        restart._release(exc)
        report("released", at=time.monotonic())
        time.sleep(60)
    os._exit(0)
""")


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # the worker's side: the agent's loop plays no part
async def test_a_survivor_s_release_closes_its_connections_though_its_abort_came_as_a_collective_failed(
    job: Job,
) -> None:
    """A survivor's groups close when it releases them, though the collective's frames are held by the context of
    its abort's exception (``raise ... from None`` hides the context from the traceback, not from the collector): a
    peer blocked in a receive from it is released at once, not when the survivor's process ends."""
    script = job.script("released.py", RELEASED)
    agent = await job.agent("--standalone", *common(3), script, job.out)
    freed = await job.wait_records("freed", 1)
    released = await job.wait_records("released", 1)  # its report may come after rank 1's
    assert "Connection closed by peer" in freed[0]["error"], freed
    assert freed[0]["at"] - released[0]["at"] < 10, (released, freed)  # else it was freed by rank 0's exit
    agent.process.kill()
    await agent.wait()
