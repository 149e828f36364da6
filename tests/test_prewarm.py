"""``--prewarm``: workers that start in standby interpreters behave as ``python -u script.py`` workers do.

The compatibility matrix of issue 13, each case on an asyncio and a trio agent (``aelastic run`` processes, as in
:mod:`test_agent_e2e`, whose fixtures and helpers these tests use). Every worker reports whether it runs in a
standby (its ``/proc/self/cmdline`` is the standby's), so a silent cold start cannot pass for a warm one. Tests
synchronise on report files and process exits; every process is killed at teardown.
"""

from __future__ import annotations

import datetime
import os
import re
import shutil
import signal
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest
import test_agent_e2e
from test_agent_e2e import DEADLINE, Job, alive, common, processes_mentioning, wait_gone

from aelastic import LaunchConfig, LogOptions, PrewarmOptions, launch
from aelastic.agent.prewarm.parent import PER_ATTEMPT, python_target
from aelastic.worker._standby import CAP_SYS_ADMIN, capable

pytestmark = [pytest.mark.anyio, pytest.mark.torch]

job = test_agent_e2e.job

# Appended to test_agent_e2e.REPORT: what a worker knows about how it was started.
ORIGIN = """
import glob
STANDBY = b"aelastic.worker._standby" in open("/proc/self/cmdline", "rb").read()
ATTEMPT = int(os.environ["TORCHELASTIC_RESTART_COUNT"])

def ready_to_crash():
    # A crash that must restart warm waits until every worker of this attempt has reported and the agent has
    # started the next attempt's standbys, which it does in the background once the workers run (a crash before
    # that restarts cold, as it should). Files and /proc entries have no event to await: a bounded poll.
    agent = os.getppid()
    while True:
        records = [json.load(open(path)) for path in glob.glob(os.path.join(OUT, "ran-*.json"))]
        workers = {r["pid"] for r in records if r["attempt"] == ATTEMPT}
        children = {int(pid) for task in os.listdir(f"/proc/{agent}/task")
                    for pid in open(f"/proc/{agent}/task/{task}/children").read().split()}
        standbys = [pid for pid in children - workers if b"aelastic.worker._standby" in cmdline(pid)]
        if len(workers) == int(os.environ["WORLD_SIZE"]) and len(standbys) >= int(os.environ["LOCAL_WORLD_SIZE"]):
            return
        time.sleep(0.01)

def cmdline(pid):
    try:
        return open(f"/proc/{pid}/cmdline", "rb").read()
    except OSError:
        return b""  # exited meanwhile
"""


def standby_pids(agent_pid: int) -> list[int]:
    """The agent's children that are standbys still waiting for an attempt (workers report their own pids)."""
    children = [
        int(child)
        for task in os.listdir(f"/proc/{agent_pid}/task")
        for child in Path(f"/proc/{agent_pid}/task/{task}/children").read_text().split()
    ]
    return [pid for pid in children if b"aelastic.worker._standby" in cmdline(pid)]


def cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""  # exited meanwhile


async def wait_standbys(agent_pid: int, count: int, exclude: set[int]) -> list[int]:
    with anyio.fail_after(DEADLINE):
        while True:
            found = [pid for pid in standby_pids(agent_pid) if pid not in exclude]
            if len(found) >= count:
                return found
            await anyio.sleep(0.02)  # a process appearing has no event to await; a bounded poll


# --- script, gloo, exit codes --------------------------------------------------------------------------------------

SCRIPT = (
    ORIGIN
    + """
import sibling  # a module next to the script: sys.path[0] is the script's directory

def main():
    dist = init_gloo()
    all_reduce_ones(dist)
    report("ran", standby=STANDBY, attempt=ATTEMPT, argv=sys.argv, file=__file__, spec=repr(__spec__),
           path0=sys.path[0], sibling=sibling.VALUE, write_through=sys.stdout.write_through,
           torch_preloaded="torch" in sys.modules)
    print(f"attempt {ATTEMPT} rank {dist.get_rank()} out")  # no flush: -u makes it reach the agent anyway
    if ATTEMPT == 0 and dist.get_rank() == 1:
        dist.barrier()
        ready_to_crash()
        sys.exit(3)
    dist.barrier()
    dist.destroy_process_group()

if __name__ == "__main__":
    main()
"""
)


async def test_script_runs_in_a_standby_as_python_would_and_restarts_warm(job: Job) -> None:
    (job.tmp_path / "sibling.py").write_text("VALUE = 42\n")
    script = job.script("train.py", SCRIPT)
    agent = await job.agent("--standalone", "--prewarm", *common(2, "--max-restarts", "1"), script, job.out, "x")
    assert await agent.wait() == 0, agent.output
    ran = job.records("ran")
    assert sorted((r["attempt"], r["RANK"]) for r in ran) == [(0, "0"), (0, "1"), (1, "0"), (1, "1")], agent.output
    for r in ran:
        assert r["standby"], r
        assert r["argv"] == [str(script), str(job.out), "x"]
        assert (r["file"], r["spec"], r["path0"], r["sibling"]) == (str(script), "None", str(job.tmp_path), 42)
        assert r["write_through"], r
        assert r["torch_preloaded"], r
    assert "exitcode  : 3" in agent.output, agent.output
    for attempt in (0, 1):
        for rank in (0, 1):
            assert f"[default{rank}]:attempt {attempt} rank {rank} out" in agent.output, agent.output


# --- -m, relative imports, uncaught exception ------------------------------------------------------------------------

MODULE = (
    ORIGIN
    + """
from . import sibling

report("ran", standby=STANDBY, attempt=ATTEMPT, name=__name__, spec=__spec__.name, argv0=sys.argv[0],
       path0=sys.path[0], sibling=sibling.VALUE)
if ATTEMPT == 0 and os.environ["RANK"] == "1":
    ready_to_crash()
    raise RuntimeError("boom in attempt 0")
"""
)


async def test_module_with_relative_imports_and_an_uncaught_exception(job: Job) -> None:
    package = job.tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "sibling.py").write_text("VALUE = 'sib'\n")
    (package / "main.py").write_text(test_agent_e2e.REPORT + MODULE)
    agent = await job.agent(
        "--standalone", "--prewarm", *common(2, "--max-restarts", "1"), "-m", "pkg.main", job.out, cwd=job.tmp_path
    )
    assert await agent.wait() == 0, agent.output
    ran = job.records("ran")
    assert len(ran) == 4, agent.output
    for r in ran:
        assert r["standby"], r
        assert (r["name"], r["spec"], r["argv0"]) == ("__main__", "pkg.main", str(package / "main.py"))
        assert (r["path0"], r["sibling"]) == (str(job.tmp_path), "sib")
    # The traceback is the interpreter's, from runpy down, with none of the standby's own frames.
    assert "RuntimeError: boom in attempt 0" in agent.output, agent.output
    assert 'File "<frozen runpy>"' in agent.output, agent.output
    assert "worker/_standby.py" not in agent.output, agent.output


# --- a failed worker's teardown yields the CPUs ----------------------------------------------------------------------

TEARDOWN = (
    ORIGIN
    + """
import atexit, threading

def session_nice():  # the CPU share of the worker's session, where the kernel groups sessions (autogroups)
    try:
        return int(open("/proc/self/autogroup").read().split()[-1])
    except OSError:
        return None

def cap_sys_admin():  # the agent's, which may change a session's share at any moment
    status = open("/proc/self/status").read()
    return bool(int(status.split("CapEff:")[1].split()[0], 16) >> 21 & 1)

def at_exit():
    shares = [session_nice()]
    if ATTEMPT == 0 and shares[0] is not None and cap_sys_admin():
        # The agent lowers the share when it has the report (it may not have it yet) and gives it back a second
        # later: every value it takes, until it is back. /proc has no event to await: a bounded poll.
        deadline = time.time() + 20
        while time.time() < deadline and not (19 in shares and shares[-1] == 0):
            share = session_nice()
            if share != shares[-1]:
                shares.append(share)
            time.sleep(0.005)
    threads = [int(t) for t in os.listdir("/proc/self/task")]
    report("teardown", attempt=ATTEMPT, policies=[os.sched_getscheduler(t) for t in threads], shares=shares,
           leader=os.getsid(0) == os.getpid())

atexit.register(at_exit)
threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()  # a thread of the worker's own
report("ran", attempt=ATTEMPT, standby=STANDBY, policy=os.sched_getscheduler(0))
if ATTEMPT == 0:
    raise RuntimeError("the failure whose teardown runs at idle priority")
"""
)


async def test_a_failed_workers_teardown_runs_whole_at_idle_priority_its_session_at_the_lowest_share_for_a_while(
    job: Job,
) -> None:
    script = job.script("fail.py", TEARDOWN)
    agent = await job.agent("--standalone", "--prewarm", *common(1, "--max-restarts", "1"), script, job.out)
    assert await agent.wait() == 0, agent.output
    ran = sorted((r["attempt"], r["standby"], r["policy"]) for r in job.records("ran"))
    assert ran == [(0, True, os.SCHED_OTHER), (1, True, os.SCHED_OTHER)], agent.output
    # The failure's atexit handler still ran, after the report, with every thread under SCHED_IDLE; a success's not.
    teardowns = {r["attempt"]: r for r in job.records("teardown")}
    assert sorted(teardowns) == [0, 1], agent.output
    failed, succeeded = teardowns[0], teardowns[1]
    assert len(failed["policies"]) >= 2, failed
    assert set(failed["policies"]) == {os.SCHED_IDLE}, failed
    assert set(succeeded["policies"]) == {os.SCHED_OTHER}, succeeded
    # Its session (each worker leads one) had the lowest CPU share while the next attempt started, and then had its
    # share back before the process was gone: until then its sockets stay open, and survivors blocked in a
    # collective with it wait for them to close. Only with CAP_SYS_ADMIN (the test's root), where sessions are
    # grouped: the kernel takes one change per 0.1 s from others.
    assert (failed["leader"], succeeded["leader"]) == (True, True), teardowns
    if failed["shares"][0] is not None and capable(CAP_SYS_ADMIN):
        assert failed["shares"] in ([0, 19, 0], [19, 0]), failed
    else:
        assert set(failed["shares"]) <= {0, None}, failed
    assert succeeded["shares"] in ([0], [None]), succeeded
    assert "RuntimeError: the failure whose teardown runs at idle priority" in agent.output, agent.output


QUIET = (
    ORIGIN
    + """
report("ran", attempt=ATTEMPT, standby=STANDBY)
if ATTEMPT == 0:
    ready_to_crash()
    raise RuntimeError("the fault")
while not os.path.exists(os.path.join(OUT, "go")):  # the test says when
    time.sleep(0.01)
"""
)


async def logged(agent: test_agent_e2e.Agent, pattern: str) -> re.Match[str]:
    """The first match of ``pattern`` in ``agent``'s log, once it is there."""
    with anyio.fail_after(DEADLINE):
        while True:
            found = re.search(pattern, agent.output)
            if found is not None:
                return found
            await anyio.sleep(0.02)  # a log line has no event to await; a bounded poll


def session_nice(pid: int) -> int:
    return int(Path(f"/proc/{pid}/autogroup").read_text().split()[-1])


@pytest.mark.skipif(not Path("/proc/self/autogroup").exists(), reason="the kernel groups no sessions (autogroups)")
async def test_a_standby_started_at_once_after_a_restart_preloads_at_its_sessions_lowest_share_until_the_settle(
    job: Job,
) -> None:
    script = job.script("quiet.py", QUIET)
    agent = await job.agent("--standalone", "--prewarm", *common(1, "--max-restarts", "1"), script, job.out,
                            env={"LOGLEVEL": "DEBUG"})  # fmt: skip
    await job.wait_records("ran", 2)
    # The only standby was handed the restart: the agent started the next one at once, for a burst of faults,
    # with its session at the lowest CPU share while the restarted worker starts (and restores its state).
    pid = int((await logged(agent, r"started \(pid (\d+), its session at the lowest CPU share\)"))[1])
    settled = f"standby pid {pid}: its session back to a worker's CPU share"
    share = session_nice(pid)
    assert share == 19 or (share == 0 and settled in agent.output), (share, agent.output)
    await logged(agent, re.escape(settled))  # the settle's end: 3 s into the attempt
    assert session_nice(pid) == 0
    (job.out / "go").touch()
    assert await agent.wait() == 0, agent.output


RESTORING = (
    ORIGIN
    + """
import torch
def asleep(pid):  # in recvmsg(2) (x86_64): a standby waiting for its attempt, its preload done
    try:
        return open(f"/proc/{pid}/syscall").read().split()[0] == "47"
    except OSError:
        return False

import aelastic.checkpoint as ckpt

state = {"weights": torch.zeros(1024)}
report("ran", attempt=ATTEMPT, standby=STANDBY)
if ATTEMPT == 0:
    ckpt.save(state, step=0)
    ready_to_crash()
    while not [pid for pid in map(int, open(f"/proc/{os.getppid()}/task/{os.getppid()}/children").read().split())
               if pid != os.getpid() and b"aelastic.worker._standby" in cmdline(pid) and asleep(pid)]:
        time.sleep(0.01)  # until the next attempt's standby has preloaded: the restarted worker starts at once
    raise RuntimeError("the fault")
ckpt.load(into=state)
time.sleep(1.0)  # the restore's moments, drawn out: a standby started at once would start in them
report("saving", attempt=ATTEMPT)
ckpt.save(state, step=1)
while not os.path.exists(os.path.join(OUT, "go")):  # the test says when
    time.sleep(0.01)
"""
)


def logged_at(found: re.Match[str]) -> float:
    """The time of the agent's log line whose ``[date time,ms]`` prefix ``found`` took as its groups 1 and 2."""
    return datetime.datetime.strptime(found[1], "%Y-%m-%d %H:%M:%S").timestamp() + int(found[2]) / 1000


async def test_a_standby_for_a_burst_of_faults_starts_once_the_restarted_workers_have_restored(job: Job) -> None:
    # The restart restores from memory: the standby the agent starts for a burst of faults waits until the
    # restarted worker has committed its first checkpoint of the attempt (it has restored and trained on), not to
    # take a CPU from the restore while its worker waits on a peer; at the latest it starts at the settle.
    script = job.script("restoring.py", RESTORING)
    agent = await job.agent("--standalone", "--prewarm", *common(1, "--max-restarts", "1"), script, job.out,
                            env={"LOGLEVEL": "DEBUG"})  # fmt: skip
    saving = (await job.wait_records("saving", 1))[0]["time"]
    stamp = r"\[([-\d]+ [:\d]+),(\d+)\][^\n]*"
    restores = logged_at(await logged(agent, stamp + "this round restores step 0"))
    started = await logged(agent, stamp + r"started \(pid (\d+), its session at the lowest CPU share\)")
    # Before the worker's commit only where that came after the settle, 3 s into the attempt (a busy machine); at
    # once, it would have started before both. The log's clock keeps milliseconds.
    assert logged_at(started) >= min(saving, restores + 3.0) - 0.001, (saving, agent.output)
    await logged(agent, re.escape(f"standby pid {started[3]}: its session back to a worker's CPU share"))
    (job.out / "go").touch()
    assert await agent.wait() == 0, agent.output


@pytest.mark.skipif(shutil.which("setpriv") is None, reason="no setpriv (util-linux) to drop CAP_SYS_ADMIN")
async def test_without_cap_sys_admin_no_standby_has_its_sessions_share_lowered(job: Job) -> None:
    # The kernel takes one change of a session's share per 0.1 s on the whole host from such an agent: a quiet
    # standby handed an attempt might keep the lowest share, so none is made quiet.
    script = job.script("quiet.py", QUIET)
    drop = ["setpriv", "--bounding-set=-sys_admin", "--inh-caps=-sys_admin", "--"]
    agent = await job.agent("--standalone", "--prewarm", *common(1, "--max-restarts", "1"), script, job.out,
                            env={"LOGLEVEL": "DEBUG"}, prefix=drop)  # fmt: skip
    await job.wait_records("ran", 2)
    # The third standby: the first ran attempt 0, the second attempt 1, the third was started after the restart.
    started = await logged(agent, r"(?s)(?:started \(pid \d+[^)]*\).*?){2}started \(pid (\d+)([^)]*)\)")
    assert started[2] == "", started[0]  # not ", its session at the lowest CPU share"
    assert session_nice(int(started[1])) == 0
    (job.out / "go").touch()
    assert await agent.wait() == 0, agent.output


# --- @record and the error file --------------------------------------------------------------------------------------

RECORDED = (
    ORIGIN
    + """
from torch.distributed.elastic.multiprocessing.errors import record

@record
def main():
    report("ran", standby=STANDBY)
    raise ValueError("bad value in the recorded main")

if __name__ == "__main__":
    main()
"""
)


async def test_record_writes_the_error_file_from_a_standby(job: Job) -> None:
    script = job.script("recorded.py", RECORDED)
    log_dir = job.tmp_path / "logs"
    agent = await job.agent("--standalone", "--prewarm", "--log-dir", log_dir, *common(1), script, job.out)
    assert await agent.wait() == 1, agent.output
    assert [r["standby"] for r in job.records("ran")] == [True]
    error_files = list(log_dir.glob("*/attempt_0/0/error.json"))
    assert len(error_files) == 1, agent.output
    assert "bad value in the recorded main" in error_files[0].read_text()
    assert "ValueError: bad value in the recorded main" in agent.output, agent.output
    assert f"error_file: {error_files[0]}" in agent.output, agent.output


# --- signals ---------------------------------------------------------------------------------------------------------

SIGNALLED = (
    ORIGIN
    + """
import signal
report("ran", standby=STANDBY, attempt=ATTEMPT)
if os.environ["RANK"] == "1" and ATTEMPT < 2:
    ready_to_crash()
    os.kill(os.getpid(), (signal.SIGSEGV, signal.SIGKILL)[ATTEMPT])
"""
)


async def test_sigsegv_and_sigkill_of_a_warm_worker_are_restarted_warm(job: Job) -> None:
    script = job.script("signalled.py", SIGNALLED)
    agent = await job.agent("--standalone", "--prewarm", *common(2, "--max-restarts", "2"), script, job.out)
    assert await agent.wait() == 0, agent.output
    ran = job.records("ran")
    assert sorted((r["attempt"], r["RANK"]) for r in ran) == [(a, r) for a in range(3) for r in "01"], agent.output
    assert all(r["standby"] for r in ran), ran
    assert "exitcode  : -11" in agent.output, agent.output
    assert "exitcode  : -9" in agent.output, agent.output


# --- DataLoader and multiprocessing ----------------------------------------------------------------------------------

MULTIPROCESSING = (
    ORIGIN
    + """
import multiprocessing as mp
import torch
from torch.utils.data import DataLoader, Dataset

class Squares(Dataset):
    def __len__(self):
        return 8
    def __getitem__(self, i):
        return torch.tensor(i * i)

def child(queue):
    queue.put(os.environ["RANK"])

if __name__ == "__main__":
    sums = {}
    for method in ("fork", "spawn"):
        loader = DataLoader(Squares(), batch_size=2, num_workers=2, multiprocessing_context=method)
        sums[method] = int(sum(batch.sum() for batch in loader))
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    process = ctx.Process(target=child, args=(queue,))
    process.start()
    from_child = queue.get(timeout=60)
    process.join(60)
    report("ran", standby=STANDBY, sums=sums, from_child=from_child, child_exit=process.exitcode)
"""
)


async def test_dataloader_fork_and_spawn_and_multiprocessing_spawn(job: Job) -> None:
    script = job.script("loader.py", MULTIPROCESSING)
    agent = await job.agent("--standalone", "--prewarm", *common(1), script, job.out)
    assert await agent.wait() == 0, agent.output
    [ran] = job.records("ran")
    assert ran["standby"], ran
    assert ran["sums"] == {"fork": 140, "spawn": 140}
    assert (ran["from_child"], ran["child_exit"]) == ("0", 0)


# --- --no-python, callables ------------------------------------------------------------------------------------------


async def test_no_python_starts_cold_silently(job: Job) -> None:
    agent = await job.agent(
        "--standalone", "--prewarm", "--no-python", *common(2), "sh", "-c",
        f'tr "\\0" " " < /proc/$$$$/cmdline > {job.out}/cmdline-$RANK',  # "$$": "$" to torch's macros
    )  # fmt: skip
    assert await agent.wait() == 0, agent.output
    cmdlines = sorted(p.read_text() for p in job.out.glob("cmdline-*"))
    assert len(cmdlines) == 2, cmdlines
    assert not any("prewarm.child" in c for c in cmdlines), cmdlines
    assert "standby" not in agent.output.lower(), agent.output


def rank_and_origin() -> tuple[int, bool]:
    return int(os.environ["RANK"]), b"aelastic.worker._standby" in Path("/proc/self/cmdline").read_bytes()


async def test_callables_run_in_standbys(tmp_path: Path) -> None:
    config = LaunchConfig(
        nproc_per_node=2, prewarm=PrewarmOptions(enabled=True), logs=LogOptions(tmp_path), monitor_interval=0.1
    )
    with anyio.fail_after(DEADLINE):
        assert await launch(config, rank_and_origin) == {0: (0, True), 1: (1, True)}


# --- no orphans, a standby's death -----------------------------------------------------------------------------------

SLEEPER = (
    ORIGIN
    + """
report("started", standby=STANDBY, attempt=ATTEMPT)
if ATTEMPT == 0 and os.environ["RANK"] == "1" and len(sys.argv) > 2:
    while not os.path.exists(os.path.join(OUT, "crash")):
        time.sleep(0.01)
    os._exit(1)
if ATTEMPT == 0 or len(sys.argv) == 2:
    time.sleep(600)
"""
)


async def test_sigkilled_agent_leaves_no_worker_and_no_standby_alive(job: Job) -> None:
    script = job.script("sleeper.py", SLEEPER)
    agent = await job.agent("--standalone", "--prewarm", *common(2), script, job.out)
    started = await job.wait_records("started", 2)
    workers = {r["pid"] for r in started}
    standbys = await wait_standbys(agent.process.pid, 2, workers)
    agent.process.kill()
    with anyio.fail_after(1.0 + 1.0):  # the parent-death signal and the reaper act at once; margin for load
        await wait_gone([*workers, *standbys])
    assert not [pid for pid in (*workers, *standbys) if alive(pid)]
    assert processes_mentioning(str(job.tmp_path)) == []


async def test_a_standby_dying_idle_is_replaced_once_then_its_rank_starts_cold(job: Job) -> None:
    script = job.script("sleeper.py", SLEEPER)
    agent = await job.agent("--standalone", "--prewarm", *common(2, "--max-restarts", "1"), script, job.out, "crash")
    started = await job.wait_records("started", 2)
    workers = {r["pid"] for r in started}
    first = await wait_standbys(agent.process.pid, 2, workers)
    os.kill(first[0], signal.SIGKILL)
    [replacement] = await wait_standbys(agent.process.pid, 1, workers | set(first))
    os.kill(replacement, signal.SIGKILL)
    await wait_gone([replacement])
    (job.out / "crash").touch()
    assert await agent.wait() == 0, agent.output
    restarted = [r for r in job.records("started") if r["attempt"] == 1]
    assert sorted(r["standby"] for r in restarted) == [False, True], restarted
    assert "exited with -9 while idle: replacing it" in agent.output, agent.output
    assert "exited with -9 while idle: its worker will start cold" in agent.output, agent.output


# --- which command lines a standby runs ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (("python", "-u", "SCRIPT", "a"), ("SCRIPT", None, ("a",), ("-u",))),
        (("/usr/bin/python3", "-u", "-m", "pkg.mod", "-x"), (None, "pkg.mod", ("-x",), ("-u",))),
        (
            (sys.executable, "-m", "aelastic.worker._callables", "p", "r"),
            (None, "aelastic.worker._callables", ("p", "r"), ()),
        ),
        (("python", "-c", "pass"), None),
        (("python", "-O", "SCRIPT"), None),
        (("sh", "SCRIPT"), None),
        (("python", "-u", "missing.py"), None),
        (("python", "-u", "DIR"), None),
    ],
)
def test_python_target(tmp_path: Path, args: tuple[str, ...], expected: Any) -> None:
    script = tmp_path / "train.py"
    script.write_text("")
    args = tuple(str(script) if a == "SCRIPT" else str(tmp_path) if a == "DIR" else a for a in args)
    target = python_target(args)
    if expected is None:
        assert target is None
        return
    assert target is not None
    script_expected, module, rest, options = expected
    assert (target.script, target.module, target.args, target.options) == (
        None if script_expected is None else str(script),
        module,
        rest,
        options,
    )
    assert target.path0 == (str(tmp_path) if module is None else os.getcwd())


def test_per_attempt_variables_are_the_ones_the_agent_sets_per_attempt() -> None:
    assert {"RANK", "WORLD_SIZE", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_ERROR_FILE"} <= PER_ATTEMPT
    assert not {"OMP_NUM_THREADS", "PYTHONPATH", "PYTHONHASHSEED", "CUDA_VISIBLE_DEVICES"} & PER_ATTEMPT
