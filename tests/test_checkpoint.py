"""In-memory checkpoints end to end: ``aelastic run`` agents, real gloo workers that train, save every step and fail.

Workers train a small model (Adam, torch's RNG for the data) and save ``model``, ``optim``, ``rng`` and ``step``
after every step with ``aelastic.checkpoint.save``; a fault schedule (attempt -> step, rank, kind) makes one rank
fail during a step of each attempt, after its gradients were all-reduced (so the other ranks complete that step and
save it: the job must restore the step before, which every rank holds). Rank 0 reports a digest of the final
parameters, compared bitwise with a fault-free run's. Every test runs its agents on asyncio and on trio.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest
import test_agent_e2e
import test_prewarm
from test_agent_e2e import Agent, Job, c10d, common, wait_gone

pytestmark = [pytest.mark.anyio, pytest.mark.torch]

job = test_agent_e2e.job
rendezvous_store = test_agent_e2e.rendezvous_store

TRAIN = """
import hashlib, signal
import torch
import aelastic.checkpoint as ckpt

def main():
    steps, faults, pause = int(sys.argv[2]), json.loads(sys.argv[3]), float(sys.argv[4])
    dist = init_gloo()
    rank, world = dist.get_rank(), dist.get_world_size()
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"]) + int(os.environ["AELASTIC_MEMBERSHIP_RESTARTS"])
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    state = {"model": model.state_dict(), "optim": opt.state_dict(), "rng": torch.get_rng_state(), "step": -1}
    restored = ckpt.load(into=state)
    info = ckpt.last_loaded()
    if restored is not None:
        opt.load_state_dict(restored["optim"])
        torch.set_rng_state(restored["rng"])
    start = 0 if restored is None else restored["step"] + 1
    report("start", attempt=attempt, start=start, loaded=None if info is None else info._asdict())
    fault = faults.get(str(attempt))
    for step in range(start, steps):
        loss = model(torch.randn(8, 16)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        if fault and fault[0] == step and fault[1] == rank:
            if fault[2] == "raise":
                raise RuntimeError(f"fault at step {step}")
            if fault[2] == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            os._exit(3)
        opt.step()
        ckpt.save({"model": model.state_dict(), "optim": opt.state_dict(), "rng": torch.get_rng_state(),
                   "step": step}, step=step)
        if pause:
            report("step", step=step)
            time.sleep(pause)
    if rank == 0:
        digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
        report("final", digest=digest)
    dist.destroy_process_group()

main()
"""

STEPS = 40


def schedule(seed: int, count: int, world: int) -> dict[str, list[Any]]:
    """``count`` faults at random steps (one per attempt, in order), random ranks, random kinds."""
    rng = random.Random(seed)
    steps = sorted(rng.sample(range(1, STEPS), count))
    return {str(i): [step, rng.randrange(world), rng.choice(["raise", "kill", "exit"])] for i, step in enumerate(steps)}


async def train(job: Job, faults: dict[str, list[Any]], *flags: str, pause: float = 0.0) -> list[dict[str, Any]]:
    script = job.script("train.py", TRAIN)
    restarts = str(len(faults))
    agent = await job.agent("--standalone", *common(2, "--max-restarts", restarts), *flags, script, job.out,
                            str(STEPS), json.dumps(faults), str(pause))  # fmt: skip
    # Each fault's restart starts the workers again (from standbys that warm meanwhile): seconds each on a busy machine.
    assert await agent.wait(test_agent_e2e.DEADLINE + 15 * len(faults)) == 0, agent.output
    return job.records("start")


async def test_a_fault_restores_the_step_every_rank_holds_from_memory(job: Job) -> None:
    starts = await train(job, {"0": [25, 1, "raise"]}, "--prewarm")
    restarted = sorted((r["RANK"], r["start"], r["loaded"]["step"], r["loaded"]["source"]) for r in starts
                       if r["attempt"] == 1)  # fmt: skip
    # Rank 0 completed and saved step 25; rank 1 failed during it: both restore 24 and do 25 again.
    assert restarted == [("0", 25, 24, "memory"), ("1", 25, 24, "memory")], starts
    assert all(r["loaded"] is None for r in starts if r["attempt"] == 0)


# One loop each for the jobs that take a minute: what they test is the checkpoints' and the supervision's, the same
# on either loop (this file's other jobs, and tests/test_restart.py's hundred faults on asyncio, cover the loops).
@pytest.mark.parametrize("anyio_backend", ["trio"])
@pytest.mark.slow
async def test_faults_at_ten_random_steps_change_nothing_of_the_final_model(job: Job) -> None:
    faults = schedule(seed=29, count=10, world=2)
    await train(job, faults, "--prewarm")
    faulty = job.records("final")
    for path in job.out.glob("*.json"):
        path.unlink()
    await train(job, {})
    clean = job.records("final")
    assert len(faulty) == len(clean) == 1
    assert faulty[0]["digest"] == clean[0]["digest"], faults
    starts = job.records("start")
    assert len(starts) == 2  # the fault-free run (the faulty run's reports were removed)


WARM = """
import resource
import torch
import aelastic.checkpoint as ckpt

MIB = int(sys.argv[2])
ATTEMPT = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
PAGES = MIB * 2**20 // os.sysconf("SC_PAGE_SIZE")

def anonymous_memory(pid="self"):
    status = open(f"/proc/{pid}/status").read()
    return next(int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("RssAnon:"))

def faults(allocate):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    tensor = allocate()
    return tensor, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

report("started", attempt=ATTEMPT, anonymous=anonymous_memory(),  # what a standby holds before any warming
       api="aelastic.worker._checkpoint.api" in sys.modules)
state, faulted = faults(lambda: {"params": torch.zeros(MIB * 2**20 // 4)})  # before any checkpoint call, as jobs do
dist = init_gloo()
restored, load_faulted = faults(lambda: ckpt.load(into=state))
value = None if restored is None else state["params"][0].item()
_, faulted_after = faults(lambda: torch.zeros(MIB * 2**20 // 4))  # load settled malloc: large blocks are mappings
report("alloc", attempt=ATTEMPT, faulted=faulted, faulted_after=faulted_after, pages=PAGES, load_faulted=load_faulted,
       standby=b"aelastic.worker._standby" in open("/proc/self/cmdline", "rb").read())
state["params"].add_(1)
ckpt.save(state, step=ATTEMPT)
report("saved", attempt=ATTEMPT)
if ATTEMPT == 0:
    while not os.path.exists(os.path.join(OUT, "go")):  # the test says when the next attempt's standbys are warm
        time.sleep(0.01)
    if dist.get_rank() == 1:
        raise RuntimeError("the fault")
    dist.barrier()  # fails: rank 1 is gone
dist.barrier()
assert value == 1.0, value  # attempt 0's save
dist.destroy_process_group()
"""


def resident(pid: int, kind: str) -> int:
    """``pid``'s resident memory of ``kind`` (``Anon``: its own; ``Shmem``: shared memory it mapped) in bytes (0
    once it is gone)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    return next(int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith(f"Rss{kind}:"))


async def test_a_replacement_allocates_its_state_in_the_heap_its_standby_warmed_and_restores_from_slots_it_mapped(
    job: Job,
) -> None:
    mib = 64
    script = job.script("warm.py", WARM)
    agent = await job.agent("--standalone", "--prewarm", *common(2, "--max-restarts", "1"), script, job.out, str(mib),
                            env={"LOGLEVEL": "DEBUG"})  # fmt: skip
    await job.wait_records("saved", 2)
    workers = {r["pid"] for r in job.records("alloc")}
    preloaded = max(r["anonymous"] for r in job.records("started"))  # a standby's memory as its script starts
    # The next attempt's standbys, told the checkpointed state's size at the first commit, touch that much heap,
    # and map their rank's slot (the one checkpoint) with its page tables filled.
    with anyio.fail_after(test_agent_e2e.DEADLINE):
        while True:
            standbys = [pid for pid in test_prewarm.standby_pids(agent.process.pid) if pid not in workers]
            if len(standbys) == 2 and all(
                resident(pid, "Anon") > preloaded + mib * 2**20 // 2 and resident(pid, "Shmem") >= mib * 2**20
                for pid in standbys
            ):
                break
            await anyio.sleep(0.05)  # memory growing has no event to await; a bounded poll
    (job.out / "go").touch()
    assert await agent.wait(test_agent_e2e.DEADLINE) == 0, agent.output
    allocs = {(r["attempt"], r["RANK"]): r for r in job.records("alloc")}
    assert sorted(allocs) == [(0, "0"), (0, "1"), (1, "0"), (1, "1")], agent.output
    assert all(r["standby"] for r in allocs.values()), allocs
    counts = {key: (r["faulted"], r["faulted_after"], r["load_faulted"], r["pages"]) for key, r in allocs.items()}
    for (attempt, _), (faulted, faulted_after, load_faulted, pages) in counts.items():
        # The first attempt's standbys were warmed for nothing yet: every page of the state faults in. The
        # replacements find the pages resident. After the load, large blocks are fresh mappings again.
        assert faulted > pages // 2 if attempt == 0 else faulted < pages // 8, counts
        assert faulted_after > pages // 2, counts
        # A replacement's load copies from the slot its standby mapped: no page of it faults (mapped at the load,
        # the slot would fault once for every 16 pages or so: the kernel maps the pages around a faulting read).
        assert attempt == 0 or load_faulted < pages // 64, counts
    # The standby of a job that checkpoints also imported the checkpoint API: a replacement's load does not.
    assert sorted((r["attempt"], r["api"]) for r in job.records("started")) == [(0, False), (0, False), (1, True),
                                                                                (1, True)]  # fmt: skip
    warmed = re.findall(r"standbys: warming (\d+) bytes of heap", agent.output)
    assert len(warmed) == 1, agent.output
    assert mib * 2**20 <= int(warmed[0]) < (mib + 1) * 2**20, warmed  # the state's tensor bytes


async def test_a_requeued_job_restores_from_the_checkpoint_directory(job: Job) -> None:
    directory = job.tmp_path / "checkpoints"
    await train(job, {}, "--checkpoint-dir", str(directory), "--checkpoint-persist-every", "10")
    names = sorted(p.name for p in directory.iterdir())
    assert names == ["step-000000000039.rank-000000.ckpt", "step-000000000039.rank-000001.ckpt"]  # the end's
    for path in job.out.glob("*.json"):
        path.unlink()
    starts = await train(job, {}, "--checkpoint-dir", str(directory))  # a new job: no agent memory
    sources = sorted((r["RANK"], r["start"], r["loaded"]["source"]) for r in starts)
    assert sources == [("0", 40, f"disk {directory / names[0]}"), ("1", 40, f"disk {directory / names[1]}")]


AFTER_A_FAILURE = """
import glob
import torch
import aelastic.checkpoint as ckpt

directory = sys.argv[2]
dist = init_gloo()
rank = dist.get_rank()
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
restored = ckpt.load()
start = 0 if restored is None else restored["step"] + 1
for step in range(start, 6):
    dist.barrier()
    if attempt == 0 and step == 5 and rank == 1:
        raise RuntimeError("fault at step 5")
    ckpt.save({"w": torch.full((4,), float(step)), "step": step}, step=step)
    if attempt == 1:  # the restart saved again: the failure's write comes now, of this step
        deadline, written = time.monotonic() + 30, []
        while len(written) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)  # a file appearing has no event to await here; a bounded poll
            written = glob.glob(os.path.join(directory, "step-000000000005.*"))
        report("persisted", step=step, names=sorted(os.path.basename(name) for name in written))
        dist.barrier()
dist.destroy_process_group()
"""


async def test_after_a_failure_the_latest_step_is_written_once_the_restart_saved_again(job: Job) -> None:
    """The write after a failure (hundreds of megabytes, in a real job) waits for the restart: each rank's step is
    written once the rank saved in the next attempt: the restart's first step is in the directory while the job runs
    (written at the failure, the step before it would be, and the restart's only at the end)."""
    directory = job.tmp_path / "checkpoints"
    script = job.script("after_a_failure.py", AFTER_A_FAILURE)
    agent = await job.agent("--standalone", *common(2, "--max-restarts", "1"), "--checkpoint-dir", str(directory),
                            "--checkpoint-persist-every", "1000", script, job.out, str(directory))  # fmt: skip
    assert await agent.wait(test_agent_e2e.DEADLINE + 15) == 0, agent.output
    persisted = {r["RANK"]: (r["step"], r["names"]) for r in job.records("persisted")}
    names = ["step-000000000005.rank-000000.ckpt", "step-000000000005.rank-000001.ckpt"]
    assert persisted == {"0": (5, names), "1": (5, names)}, (persisted, agent.output)


# --- bad input: one clear error each, the previous checkpoint intact --------------------------------------------------

BAD = """
import torch
import aelastic.checkpoint as ckpt

dist = init_gloo()
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
if attempt == 0:
    ckpt.save({"w": torch.ones(4), "step": 0}, step=0)
    errors = []
    for bad in ({"w": torch.ones(4), "hook": lambda: 0}, {"w": torch.ones(1 << 20)}):  # a function; 4 MiB > 1 MiB
        try:
            ckpt.save(bad, step=1)
        except ckpt.CheckpointError as exc:
            errors.append(str(exc))
    report("errors", errors=errors)
    raise SystemExit(1)
report("restored", state={k: v.tolist() if hasattr(v, "tolist") else v for k, v in ckpt.load().items()},
       loaded=ckpt.last_loaded()._asdict())
"""


async def test_a_refused_save_names_the_value_or_the_bound_and_the_previous_checkpoint_stays(job: Job) -> None:
    script = job.script("bad.py", BAD)
    agent = await job.agent("--standalone", *common(1, "--max-restarts", "1"), "--checkpoint-memory", "2M", script,
                            job.out)  # fmt: skip
    assert await agent.wait() == 0, agent.output
    (errors,) = job.records("errors")
    function, bound = errors["errors"]
    assert function.startswith("aelastic.checkpoint.save: state['hook']: a builtins.function is not a value"), function
    assert "4.0 MiB: more than 1.0 MiB, half of the 2.0 MiB a rank may hold" in bound, bound
    assert "--checkpoint-memory" in bound
    (restored,) = job.records("restored")
    assert restored["state"] == {"w": [1.0, 1.0, 1.0, 1.0], "step": 0}
    assert restored["loaded"]["step"] == 0


def test_outside_an_agent_save_and_load_say_so(tmp_path: Path) -> None:
    code = (
        "import torch, aelastic.checkpoint as c\n"
        "for call in (lambda: c.save({'w': torch.ones(1)}, step=0), c.load):\n"
        "    try:\n        call()\n    except c.CheckpointError as exc:\n        print(exc)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    lines = out.stdout.splitlines()
    assert len(lines) == 2, out
    assert lines[0].startswith("aelastic.checkpoint.save: this process was not started by an aelastic agent")
    assert lines[1].startswith("aelastic.checkpoint.load: this process was not started by an aelastic agent")


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("{file}/sub", "is not a directory"),
        ("/proc/aelastic-checkpoints", "is not writable"),
    ],
)
def test_a_checkpoint_directory_that_cannot_be_written_is_one_line_and_exit_2(
    tmp_path: Path, value: str, message: str
) -> None:
    (tmp_path / "file").write_text("")
    script = tmp_path / "noop.py"
    script.write_text("")
    flag = ["--checkpoint-dir", value.format(file=tmp_path / "file")]
    command = [sys.executable, "-m", "aelastic", "run", "--standalone", *flag, str(script)]
    out = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert message in out.stderr, out.stderr


def test_a_directory_filling_up_keeps_its_previous_checkpoint(tmp_path: Path) -> None:
    """A tiny tmpfs (a private mount namespace: root) takes the first checkpoint and not the next, larger one."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (CI runs as root)")
    directory = tmp_path / "small"
    directory.mkdir()
    worker = tmp_path / "grow.py"
    worker.write_text(
        "import torch, aelastic.checkpoint as c\n"
        "c.save({'w': torch.ones(1000)}, step=10)\n"  # 8 KiB: fits
        "c.save({'w': torch.ones(100000)}, step=20)\n"  # 400 KiB: does not
    )
    command = (
        f"mount -t tmpfs -o size=64k tmpfs {directory} && {sys.executable} -m aelastic run --standalone "
        f"--checkpoint-dir {directory} --checkpoint-persist-every 10 {worker}"
    )
    isolated = [
        "unshare",
        "--mount",
        "--propagation",
        "private",
        "sh",
        "-c",
        f"{command} ; ls {directory} > {tmp_path}/ls",
    ]
    out = subprocess.run(isolated, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr
    assert "rank 0's step 20 could not be written" in out.stderr, out.stderr
    assert "No space left on device" in out.stderr, out.stderr
    assert (tmp_path / "ls").read_text().split() == ["step-000000000010.rank-000000.ckpt"]


# --- nothing left behind ----------------------------------------------------------------------------------------------


def checkpoint_memory_holders() -> list[str]:
    """The processes that hold one of aelastic's checkpoint memory files."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if "aelastic-checkpoint" in os.readlink(f"/proc/{pid}/fd/{fd}"):
                    found.append(pid)
                    break
            except OSError:
                continue
    return found


LONG = """
import torch
import aelastic.checkpoint as ckpt

dist = init_gloo()
ckpt.save({"w": torch.ones(1 << 16)}, step=int(os.environ["TORCHELASTIC_RESTART_COUNT"]))
report("saved")
dist.barrier()  # every rank has saved and reported before any ends
if sys.argv[2] == "fail":
    raise RuntimeError("no restarts left")
if sys.argv[2] == "hang":
    time.sleep(600)
dist.destroy_process_group()
"""


def shm_files() -> set[str]:
    """The files in /dev/shm but POSIX named semaphores (``sem.*``): multiprocessing's locks, which other tests
    running beside this one create and remove; neither the agent nor this job's workers make any."""
    return {name for name in os.listdir("/dev/shm") if not name.startswith("sem.")}


@pytest.mark.parametrize("ending", ["success", "failure", "ctrl-c", "agent-sigkill"])
async def test_no_memory_file_and_no_temporary_file_is_left_behind(job: Job, ending: str) -> None:
    shm_before = shm_files()
    directory = job.tmp_path / "checkpoints"
    script = job.script("long.py", LONG)
    mode = {"success": "ok", "failure": "fail"}.get(ending, "hang")
    agent = await job.agent("--standalone", *common(2), "--checkpoint-dir", str(directory), script, job.out, mode)
    saved = await job.wait_records("saved", 2)
    assert checkpoint_memory_holders(), "the agent holds the slots while the job runs"
    if ending == "ctrl-c":
        agent.process.send_signal(signal.SIGINT)
    elif ending == "agent-sigkill":
        agent.process.kill()
    code = await agent.wait()
    assert code == {"success": 0, "failure": 1, "ctrl-c": 130, "agent-sigkill": -9}[ending], agent.output
    await wait_gone([r["pid"] for r in saved])
    with anyio.fail_after(30):  # the reaper's kills, after the agent's death, take a moment
        while True:
            if not checkpoint_memory_holders():
                break
            await anyio.sleep(0.05)  # the last holder's exit is not ours to await: a bounded poll
    assert shm_files() - shm_before == set()
    leftovers = [p.name for p in directory.iterdir() if not p.name.endswith(".ckpt")] if directory.exists() else []
    assert leftovers == []


# --- DCP --------------------------------------------------------------------------------------------------------------

DCP = """
import hashlib
import torch
import torch.distributed.checkpoint as dcp
import aelastic.checkpoint as ckpt

def digest(model):
    return hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()

dist = init_gloo()
rank, world = dist.get_rank(), dist.get_world_size()
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"]) + int(os.environ["AELASTIC_MEMBERSHIP_RESTARTS"])
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
mode = sys.argv[2].removesuffix("-alone")  # "...-alone": dcp.save(..., use_collectives=False)
if mode == "load-dir":
    state = {"model": model.state_dict()}
    dcp.load(state, storage_reader=ckpt.StorageReader(sys.argv[3]))
    report("loaded", digest=digest(model), world=world)
    dist.destroy_process_group()
    raise SystemExit(0)
start = 0
if attempt:
    state = {"model": model.state_dict(), "step": torch.tensor(0)}
    dcp.load(state, storage_reader=ckpt.StorageReader())
    start = int(state["step"]) + 1
    report("restored", step=start - 1, source=ckpt.last_loaded().source)
for step in range(start, 12):
    loss = model(torch.randn(8, 16, generator=torch.Generator().manual_seed(step))).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= world
    if mode == "fault" and attempt == 0 and rank == 1 and step == 7:
        raise RuntimeError("fault")
    opt.step()
    dcp.save({"model": model.state_dict(), "step": torch.tensor(step)}, storage_writer=ckpt.StorageWriter(step=step),
             use_collectives=mode == sys.argv[2])
report("final", digest=digest(model), world=world)
dist.destroy_process_group()  # else gloo's threads may abort the interpreter's teardown (under torchrun too)
"""


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # one loop: see the ten faults' test
@pytest.mark.slow
async def test_dcp_restores_the_same_state_and_reshards_a_directory_from_4_to_2(job: Job) -> None:
    script = job.script("dcp_train.py", DCP)
    directory = job.tmp_path / "checkpoints"
    runs = [
        ("fault", 2, ["--max-restarts", "1"]),
        ("clean", 2, []),
        ("clean", 4, ["--checkpoint-dir", str(directory)]),
        ("load-dir", 2, []),
    ]
    for mode, nproc, flags in runs:
        agent = await job.agent("--standalone", *common(nproc, *flags), script, job.out, mode, str(directory))
        assert await agent.wait() == 0, agent.output
    restored = {r["step"] for r in job.records("restored")}
    assert restored == {6}  # rank 1 failed during step 7: the coordinator never finished it
    finals = {(r["world"], r["digest"]) for r in job.records("final")}
    digests = {digest for _, digest in finals} | {r["digest"] for r in job.records("loaded")}
    assert len(digests) == 1, (finals, job.records("loaded"))
    assert {r["world"] for r in job.records("loaded")} == {2}
    assert len(job.records("loaded")) == 2


async def test_dcp_ranks_that_saved_alone_restore_from_their_own_checkpoint_and_fetch_only_the_others_metadata(
    job: Job, rendezvous_store: str
) -> None:
    """Three nodes of one rank, ``dcp.save(..., use_collectives=False)`` every step, rank 1 fails: each rank
    restores from its own saved rank's checkpoint in its agent's memory, and its agent fetches the saved rank it
    holds neither as its own nor as a replica for its metadata only; the final model is the fault-free run's."""
    script = job.script("dcp_train.py", DCP)
    agents = [await job.agent(*common(1, "--max-restarts", "1"), *c10d(rendezvous_store, "3"), script, job.out,
                              "fault-alone", env={"LOGLEVEL": "INFO"}) for _ in range(3)]  # fmt: skip
    for agent in agents:
        assert await agent.wait() == 0, agent.output
    restored = job.records("restored")
    assert [(r["step"], r["source"]) for r in restored] == [(6, "memory")] * 3, restored
    for agent in agents:  # each holds its own rank (and a replica of another, unless a newer push replaced it)
        assert re.search(r"fetched rank \d's metadata of step 6 \(.*, without its data\)", agent.output), agent.output
        assert not re.search(r"fetched rank \d's step", agent.output), agent.output
    faulty = {r["digest"] for r in job.records("final")}
    clean = await job.agent("--standalone", *common(3), script, job.out, "clean-alone")
    assert await clean.wait() == 0, clean.output
    assert len(faulty) == 1
    assert {r["digest"] for r in job.records("final")} == faulty


# --- a lost node's ranks restore from a replica -----------------------------------------------------------------------


async def wait_for_replica(agents: list[Agent], *, rank: int, step: int) -> None:
    """Wait until one of ``agents`` logs (at DEBUG) that it holds a replica of ``rank``'s ``step`` or a later one."""
    held = re.compile(rf"holding rank {rank}'s step (\d+), a replica")
    with anyio.fail_after(test_agent_e2e.DEADLINE):
        while True:
            if any(int(m[1]) >= step for agent in agents for m in held.finditer(agent.output)):
                return
            await anyio.sleep(0.05)  # a line appearing in another process's log has no event to await


async def test_a_lost_nodes_rank_restores_from_the_replica_another_agent_kept(job: Job, rendezvous_store: str) -> None:
    script = job.script("train.py", TRAIN)
    flags = c10d(rendezvous_store, "2:3", "keep_alive_interval=0.5", "keep_alive_max_attempt=2")
    # A survivor whose collective fails before its agent hears of the loss fails too: a restart each.
    args = ["--max-restarts", "3", *flags, script, job.out, str(STEPS), "{}", "0.25"]
    agents = [await job.agent(*common(1), *args, env={"LOGLEVEL": "DEBUG"}) for _ in range(3)]
    steps = await job.wait_records("step", 3, lambda r: r["step"] >= 2)  # one file per worker, rewritten
    # The replicas are pushed after the commit, in the background: the loss must come once rank 1's step 2 is held.
    await wait_for_replica(agents, rank=1, step=2)
    victim = next(r for r in steps if r["GROUP_RANK"] == "1")
    lost = next(a for a in agents if a.process.pid == victim["ppid"])
    lost.process.kill()  # the node's loss: its agent SIGKILLed, its worker with it (parent-death signal)
    restarted = await job.wait_records("start", 2, lambda r: r["attempt"] == 1)
    for agent in agents:
        if agent is not lost:
            assert await agent.wait() == 0, agent.output
    sources = {r["RANK"]: r["loaded"] for r in restarted}
    assert sources["0"]["source"] == "memory", sources
    assert sources["1"]["rank"] == 1, sources
    assert sources["1"]["source"].startswith("replica from "), sources
    assert sources["0"]["step"] == sources["1"]["step"] >= 2, sources
    assert sources["0"]["world"] == 3, sources
    print("restored after the loss of group rank 1:", json.dumps(sources))
