"""The elastic agent end to end: ``aelastic run`` agent processes, real gloo workers, real signals.

Every agent is a separate ``python -m aelastic run`` process; multi-node jobs are several agents on loopback
(c10d). Workers are scripts written to ``tmp_path`` that report their pid and environment in JSON files
(:data:`REPORT`); tests synchronise on those files and on process exits, never on fixed sleeps. Teardown kills
every process whose command line mentions ``tmp_path`` (agents, workers, their children), so a failing test leaves
nothing behind; the no-orphan tests assert that there is nothing to kill.

The async tests run their agents on the same event loop as the test (``--async-backend``), so the anyio
parametrization covers the agent on asyncio and on trio.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import suppress
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import pytest
from helpers.procs import alive, free_port, wait_gone

from aelastic.rendezvous.api import RendezvousParameters
from aelastic.status import open_reader, state_or_none
from aelastic.store.server import open_store_server

pytestmark = [pytest.mark.anyio, pytest.mark.torch]

DEADLINE = 90.0  # generous: agents and torch workers on a small, shared machine
EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

# Prepended to every worker script: report(event) writes <out>/<event>-<pid>.json atomically.
REPORT = """\
import json, os, sys, time
OUT = sys.argv[1]
KEYS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE",
        "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
        "AELASTIC_MEMBERSHIP_RESTARTS", "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RUN_ID")

def report(event, **extra):
    record = {"event": event, "pid": os.getpid(), "ppid": os.getppid(), "time": time.time()}
    record.update({k: os.environ.get(k) for k in KEYS})
    record.update(extra)
    name = f"{event}-{os.getpid()}.json"
    with open(os.path.join(OUT, "." + name), "w") as f:
        json.dump(record, f)
    os.replace(os.path.join(OUT, "." + name), os.path.join(OUT, name))

def init_gloo():
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method="env://")
    return dist

def all_reduce_ones(dist):
    import torch
    t = torch.ones(1)
    dist.all_reduce(t)
    assert int(t.item()) == dist.get_world_size(), (t, dist.get_world_size())
"""


# --- processes ---------------------------------------------------------------------------------------------------


def processes_mentioning(marker: str) -> list[int]:
    """Live pids whose command line contains ``marker`` (this process excluded)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        if marker.encode() in cmdline and alive(int(entry)):
            pids.append(int(entry))
    return pids


def process_tree(root: int) -> str:
    """``root`` and its descendants, one line each (pid, state, where it waits in the kernel, command line), and
    where py-spy is installed their Python stacks: what a test that timed out was waiting for."""
    lines, pending = [], [root]
    while pending:
        pid = pending.pop(0)
        proc = Path(f"/proc/{pid}")
        try:
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
            wchan = (proc / "wchan").read_text()
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            pending += [int(c) for t in (proc / "task").iterdir() for c in (t / "children").read_text().split()]
        except OSError:
            continue
        lines.append(f"pid {pid} {state} {wchan or '-'}: {cmdline[:200]}")
    spy = shutil.which("py-spy")
    if spy is not None:
        for line in [line for line in lines if "python" in line]:
            pid = line.split()[1]
            dump = subprocess.run([spy, "dump", "--pid", pid], capture_output=True, text=True, timeout=30)
            lines.append(f"py-spy dump --pid {pid}:\n{dump.stdout[-3000:]}{dump.stderr[:200]}")
    return "\n".join(lines)


def kill_all_mentioning(marker: str) -> None:
    for pid in processes_mentioning(marker):
        with suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


class Agent:
    """One ``aelastic run`` process; stdout and stderr go to files."""

    def __init__(self, process: anyio.abc.Process, log: Path) -> None:
        self.process = process
        self.log = log

    @property
    def output(self) -> str:
        return self.log.read_text(errors="replace")

    async def wait(self, deadline: float = DEADLINE) -> int:
        """The agent's exit status; a TimeoutError after ``deadline`` seconds carries the end of its output (the
        test's temporary directory, with the log, does not outlive a few later runs)."""
        with anyio.move_on_after(deadline):
            return await self.process.wait()
        raise TimeoutError(
            f"the agent did not exit within {deadline:g} s; its processes:\n{process_tree(self.process.pid)}\n"
            f"the end of its output:\n{self.output[-8000:]}"
        )


class Job:
    """A test's processes and files: agents started with :meth:`agent`, worker reports read with :meth:`records`."""

    def __init__(self, tmp_path: Path, backend: str) -> None:
        self.tmp_path = tmp_path
        self.backend = backend
        self.out = tmp_path / "out"
        self.out.mkdir()
        self.agents: list[Agent] = []

    def script(self, name: str, body: str) -> Path:
        path = self.tmp_path / name
        path.write_text(REPORT + body)
        return path

    async def agent(
        self,
        *args: str | os.PathLike[str],
        cwd: Path | None = None,
        env: dict[str, str] | None = None,
        prefix: Sequence[str] = (),
    ) -> Agent:
        """``aelastic run args``, started by ``prefix`` (a command that runs the rest, e.g. ``setpriv ...``)."""
        log = self.tmp_path / f"agent{len(self.agents)}.log"
        with log.open("wb") as f:
            process = await anyio.open_process(
                [*prefix, sys.executable, "-m", "aelastic", "--async-backend", self.backend, "run", *map(str, args)],
                stdin=subprocess.DEVNULL,
                stdout=f,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
                cwd=cwd,
            )
        agent = Agent(process, log)
        self.agents.append(agent)
        return agent

    def records(self, event: str) -> list[dict[str, Any]]:
        return [json.loads(p.read_text()) for p in sorted(self.out.glob(f"{event}-*.json"))]

    async def wait_records(
        self, event: str, count: int, where: Callable[[dict[str, Any]], bool] = lambda r: True
    ) -> list[dict[str, Any]]:
        """Wait until ``count`` reports of ``event`` match ``where``; fail early if every agent has exited."""
        with anyio.fail_after(DEADLINE):
            while True:
                found = [r for r in self.records(event) if where(r)]
                if len(found) >= count:
                    return found
                if self.agents and all(a.process.returncode is not None for a in self.agents):
                    logs = "\n".join(a.output for a in self.agents)
                    raise AssertionError(f"agents exited before {count} {event!r} reports: {found}\n{logs}")
                await anyio.sleep(0.02)  # a file appearing has no event to await; this is a bounded poll


@pytest.fixture
async def job(tmp_path: Path, anyio_backend: str) -> AsyncIterator[Job]:
    job = Job(tmp_path, anyio_backend)
    try:
        yield job
    finally:
        kill_all_mentioning(str(tmp_path))
        with anyio.CancelScope(shield=True), anyio.move_on_after(30):
            for agent in job.agents:
                await agent.process.aclose()


@pytest.fixture
async def rendezvous_store() -> AsyncIterator[str]:
    """A rendezvous store no agent owns, so that any agent may die."""
    async with open_store_server("127.0.0.1", 0) as server:
        yield f"127.0.0.1:{server.port}"


def common(nproc: int, *extra: str) -> list[str]:
    return ["--nproc-per-node", str(nproc), "--monitor-interval", "0.1", *extra]


def c10d(endpoint: str, nnodes: str, *conf: str) -> list[str]:
    return ["--nnodes", nnodes, "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", "e2e",
            "--rdzv-conf", ",".join(("last_call_timeout=1", *conf))]  # fmt: skip


async def wait_participants(endpoint: str, count: int) -> None:
    """Wait until the rendezvous that :func:`c10d` names at ``endpoint`` has ``count`` participants, pending join
    requests included (what every node decides on)."""
    with anyio.fail_after(DEADLINE):
        async with open_reader(RendezvousParameters("c10d", endpoint, "e2e", 1, count)) as reader:
            while True:
                state = state_or_none(await reader.read())
                if state is not None and len(state.participants) >= count:
                    return
                await anyio.sleep(0.02)  # a join request wakes no watcher: a bounded poll


# --- all-reduce ----------------------------------------------------------------------------------------------------


async def test_allreduce_one_node_two_workers(job: Job) -> None:
    agent = await job.agent("--standalone", *common(2), EXAMPLES / "allreduce.py")
    assert await agent.wait() == 0, agent.output
    assert sorted(re.findall(r"^\[default(\d)\]:rank (\d) world_size 2 tensor\(\[2\]\)$", agent.output, re.M)) == [
        ("0", "0"),
        ("1", "1"),
    ], agent.output


async def test_allreduce_two_nodes_two_workers_each(job: Job) -> None:
    """Two agents on loopback; whichever binds the endpoint first serves the rendezvous store."""
    endpoint = f"127.0.0.1:{free_port()}"
    agents = [await job.agent(*c10d(endpoint, "2"), *common(2), EXAMPLES / "allreduce.py") for _ in range(2)]
    codes = [await a.wait() for a in agents]
    outputs = "\n".join(a.output for a in agents)
    assert codes == [0, 0], outputs
    found = re.findall(r"^\[default\d\]:rank (\d) world_size 4 tensor\(\[4\]\)$", outputs, re.M)
    assert sorted(found) == ["0", "1", "2", "3"], outputs
    # The node serving the rendezvous store waits for the others to close the rendezvous before it exits.
    assert "shutdown failed" not in outputs


# --- failures ------------------------------------------------------------------------------------------------------

CRASH_ONCE = """
dist = init_gloo()
report("initialized")
if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
    dist.barrier()  # every worker is past init_process_group (and has reported) before the crash
    if dist.get_rank() == 1:
        os._exit(7)  # the gloo addresses of this attempt are in its store
all_reduce_ones(dist)
dist.barrier()
report("done")
dist.destroy_process_group()
"""


NEVER_DESTROYED = """
import torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(4) * (dist.get_rank() + 1)
dist.all_reduce(t)
print("sum", int(t[0]), flush=True)
"""  # no destroy_process_group(): gloo's threads meet interpreter shutdown, as in torch's own launcher tests


@pytest.mark.slow
def test_run_path_gloo_job_without_destroy_succeeds_twenty_runs_of_twenty(tmp_path: Path) -> None:
    """torch's multiprocessing lets no worker exit before every local worker returned; exiting one by one made a
    peer abort in gloo's teardown ("terminate called without an active exception") in about 1 run in 5."""
    script = tmp_path / "never_destroyed.py"
    script.write_text(NEVER_DESTROYED)
    argv = [sys.executable, "-m", "aelastic", "run", "--standalone", "--nproc-per-node", "2", "--run-path", script]
    for run in range(20):
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=DEADLINE, check=False)
        assert proc.returncode == 0, f"run {run}:\n{proc.stdout}\n{proc.stderr}"
        assert sorted(re.findall(r"^\[default(\d)\]:sum 3$", proc.stdout, re.M)) == ["0", "1"], proc.stdout


@pytest.mark.slow
def test_crash_after_init_is_restarted_ten_times_out_of_ten(tmp_path: Path) -> None:
    """torch 2.13's agent recovers here in about 3 runs of 8 (its restarted workers read the dead attempt's gloo
    addresses); each aelastic attempt gets a fresh store, so every run must succeed. Agents alternate backends."""
    script = tmp_path / "crash_once.py"
    script.write_text(REPORT + CRASH_ONCE)
    try:
        for run in range(10):
            out = tmp_path / f"run{run}"
            out.mkdir()
            backend = ("asyncio", "trio")[run % 2]
            proc = subprocess.run(
                [sys.executable, "-m", "aelastic", "--async-backend", backend, "run", "--standalone",
                 *common(2, "--max-restarts", "1"), script, out],
                capture_output=True, text=True, timeout=DEADLINE, check=False,
            )  # fmt: skip
            assert proc.returncode == 0, f"run {run} ({backend}): {proc.stdout}{proc.stderr}"
            done = [json.loads(p.read_text()) for p in out.glob("done-*.json")]
            assert sorted(r["RANK"] for r in done) == ["0", "1"], f"run {run}"
            assert {r["TORCHELASTIC_RESTART_COUNT"] for r in done} == {"1"}, f"run {run}"
            assert {r["AELASTIC_MEMBERSHIP_RESTARTS"] for r in done} == {"0"}, f"run {run}"
            crashed = [json.loads(p.read_text()) for p in out.glob("initialized-*.json")]
            assert len(crashed) == 4, f"run {run}: two attempts of two workers each"
    finally:
        kill_all_mentioning(str(tmp_path))


ALWAYS_FAILS = """
dist = init_gloo()
report("initialized")
dist.barrier()  # both have reported before rank 1 fails: on a busy machine rank 0 may lag behind
if dist.get_rank() == 1:
    sys.stderr.write("worker 1 is about to fail\\n")
    raise ValueError(f"bad shard in attempt {os.environ['TORCHELASTIC_RESTART_COUNT']}")
time.sleep(600)  # rank 0 waits; the agent stops it when rank 1 fails
"""


async def test_failure_beyond_max_restarts_fails_with_the_root_cause(job: Job) -> None:
    script = job.script("always_fails.py", ALWAYS_FAILS)
    agent = await job.agent("--standalone", *common(2, "--max-restarts", "1"), script, job.out)
    assert await agent.wait() == 1, agent.output
    report = agent.output[agent.output.index("=" * 20) :]
    assert f"{script} FAILED" in report
    root = report[report.index("Root Cause (first observed failure):") :]
    assert "rank      : 1 (local_rank: 1)" in root
    assert re.search(r"exitcode  : 1 \(pid: \d+\)", root)
    assert "error_file: <N/A>" in root  # not @record-decorated: the stderr tail stands in for the traceback
    assert "worker 1 is about to fail" in root
    assert "Traceback (most recent call last)" in root
    assert "ValueError: bad shard in attempt 1" in root  # the second attempt failed too: the budget is spent
    others = report[report.index("Failures:") : report.index("Root Cause")]
    assert "rank      : 0 (local_rank: 0)" in others
    assert "(SIGTERM)" in others  # the peer the agent stopped, reported as torch reports it
    initialized = job.records("initialized")
    assert sorted(r["TORCHELASTIC_RESTART_COUNT"] for r in initialized) == ["0", "0", "1", "1"]
    assert not [pid for pid in (r["pid"] for r in initialized) if alive(pid)]


FAILS_ON_NODE_1 = """
report("started")
if os.environ["GROUP_RANK"] == "1":
    sys.exit(4)
time.sleep(600)
"""


async def test_a_node_out_of_restarts_ends_the_job_on_every_node(job: Job, rendezvous_store: str) -> None:
    script = job.script("fails_on_node_1.py", FAILS_ON_NODE_1)
    args = [*c10d(rendezvous_store, "2", "is_host=false"), *common(1, "--max-restarts", "0"), script, job.out]
    agents = [await job.agent(*args) for _ in range(2)]
    codes = [await a.wait() for a in agents]
    assert codes == [1, 1], [a.output for a in agents]
    failed = next(a.output for a in agents if "was closed by another node" not in a.output)
    other = next(a.output for a in agents if "was closed by another node" in a.output)
    for output in (failed, other):  # both reports name node 1's worker as the job's root cause
        root = output[output.index("Root Cause (first observed failure):") :]
        assert "rank      : 1 (local_rank: 0)" in root, output
        assert "exitcode  : 4" in root, output
    assert re.search(r"host      : .* \(node 1\)", other), other  # the other node's report says where it was
    assert "aelastic: stopped by its agent after the job's root cause, rank 1 on node 1" in other
    assert "restarting workers" not in other
    assert not [pid for pid in (r["pid"] for r in job.records("started")) if alive(pid)]


# --- membership -----------------------------------------------------------------------------------------------------

# Workers of a world smaller than argv[2] report and wait for the membership restart; the full world all-reduces.
GROWS = """
target = int(sys.argv[2])
report("started")
if int(os.environ["WORLD_SIZE"]) < target:
    time.sleep(600)
dist = init_gloo()
all_reduce_ones(dist)
dist.barrier()
report("done")
dist.destroy_process_group()
"""


async def test_third_node_mid_run_restarts_once_without_spending_the_failure_budget(job: Job) -> None:
    script = job.script("grows.py", GROWS)
    endpoint = f"127.0.0.1:{free_port()}"
    # The second round must have all three nodes, however late one of them comes back from stopping its workers:
    # a last call of 5 s (the first round, of two nodes, waits it out; the second completes when the third joins).
    args = [*c10d(endpoint, "2:3", "last_call_timeout=5"), *common(1, "--max-restarts", "0"), script, job.out, "3"]
    first = [await job.agent(*args) for _ in range(2)]
    small = await job.wait_records("started", 2)
    assert {r["WORLD_SIZE"] for r in small} == {"2"}
    third = await job.agent(*args)
    for agent in [*first, third]:
        assert await agent.wait() == 0, agent.output
    done = job.records("done")
    assert sorted(r["RANK"] for r in done) == ["0", "1", "2"]
    assert {r["WORLD_SIZE"] for r in done} == {"3"}
    assert {r["TORCHELASTIC_RESTART_COUNT"] for r in done} == {"0"}  # max_restarts 0, yet the job went on
    by_pid_start = {r["pid"]: r for r in job.records("started")}
    assert len(by_pid_start) == 5  # two in the first round, three in the second: one restart
    # The two original nodes restarted once for membership; the newcomer never restarted.
    assert sorted(r["AELASTIC_MEMBERSHIP_RESTARTS"] for r in done) == ["0", "1", "1"]
    assert not [pid for pid in by_pid_start if alive(pid)]


KEEP_ALIVE, ATTEMPTS = 0.5, 3  # a dead node is one whose heartbeat did not move for 1.5 s


async def test_sigkilled_node_makes_the_survivors_re_rendezvous(job: Job, rendezvous_store: str) -> None:
    script = job.script("grows.py", GROWS)
    conf = ("is_host=false", f"keep_alive_interval={KEEP_ALIVE}", f"keep_alive_max_attempt={ATTEMPTS}")
    tail = [*common(1, "--max-restarts", "0"), script, job.out, "99"]
    # The first round must have all three nodes: the first two join one after the other and wait in a last call
    # long enough for the third to join. The third one's 1 s last call then ends the survivors' round after the kill.
    agents = []
    for joined, last_call in enumerate(("last_call_timeout=60", "last_call_timeout=60", "last_call_timeout=1")):
        agents.append(await job.agent(*c10d(rendezvous_store, "2:3", *conf, last_call), *tail))
        await wait_participants(rendezvous_store, joined + 1)
    started = await job.wait_records("started", 3)
    assert {r["WORLD_SIZE"] for r in started} == {"3"}
    victim = agents[1]
    victim_worker = next(r["pid"] for r in started if r["ppid"] == victim.process.pid)
    victim.process.kill()
    killed_at = anyio.current_time()
    # Detection takes at most the liveness grace plus one interval; then the last call window; then a spawn.
    with anyio.fail_after(KEEP_ALIVE * (ATTEMPTS + 1) + 1.0 + 15.0):
        restarted = await job.wait_records("started", 2, lambda r: r["WORLD_SIZE"] == "2")
    took = anyio.current_time() - killed_at
    assert {r["TORCHELASTIC_RESTART_COUNT"] for r in restarted} == {"0"}
    assert {r["AELASTIC_MEMBERSHIP_RESTARTS"] for r in restarted} == {"1"}
    assert not alive(victim_worker)
    print(f"survivors restarted in world size 2, {took:.2f} s after the SIGKILL")


# --- signals and orphans ---------------------------------------------------------------------------------------------

# Each worker starts a child of its own (argv[2] = 1: the child ignores SIGTERM) and reports both pids.
WITH_CHILD = """
import signal, subprocess
child = subprocess.Popen([sys.executable, "-c",
    "import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN) if sys.argv[1] == '1' else None; "
    "time.sleep(600)", sys.argv[2], OUT])
def on_term(signum, frame):
    report("terminated")
    sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
report("started", child=child.pid)
if sys.argv[3] == "fail" and os.environ["LOCAL_RANK"] == "1":
    # Fail only once both workers have reported: on a busy machine rank 0 may not have started yet.
    while len([n for n in os.listdir(OUT) if n.startswith("started-")]) < 2:
        time.sleep(0.01)
    sys.exit(5)
time.sleep(600)
"""

ON_SIGNAL = """
report("started")
try:
    time.sleep(600)
except KeyboardInterrupt:  # what Lightning and others catch: SIGINT's default handler raises it
    report("interrupted")
    sys.exit(0)
"""


def pids_of(records: list[dict[str, Any]]) -> list[int]:
    return [pid for r in records for pid in (r["pid"], r.get("child")) if pid is not None]


async def test_sigterm_stops_the_workers_and_exits_143(job: Job) -> None:
    script = job.script("with_child.py", WITH_CHILD)
    agent = await job.agent("--standalone", *common(2, "--shutdown-timeout", "2"), script, job.out, "1", "stay")
    started = await job.wait_records("started", 2)
    agent.process.send_signal(signal.SIGTERM)
    assert await agent.wait() == 143, agent.output
    assert len(job.records("terminated")) == 2  # the workers got SIGTERM first, and had time to handle it
    with anyio.move_on_after(5):  # the agent awaits its workers only: their children may still be dying of SIGKILL
        await wait_gone(pids_of(started))
    assert not [pid for pid in pids_of(started) if alive(pid)]  # the SIGTERM-deaf children were killed too
    assert processes_mentioning(str(job.tmp_path)) == []


async def test_sigint_is_forwarded_to_the_workers_as_sigint(job: Job) -> None:
    """torchrun forwards the signal it received: Ctrl-C reaches the workers as SIGINT (KeyboardInterrupt)."""
    script = job.script("on_signal.py", ON_SIGNAL)
    agent = await job.agent("--standalone", *common(2, "--shutdown-timeout", "30"), script, job.out)
    await job.wait_records("started", 2)
    agent.process.send_signal(signal.SIGINT)
    assert await agent.wait() == 128 + signal.SIGINT, agent.output
    assert len(job.records("interrupted")) == 2, agent.output
    assert "received SIGINT: forwarding it to the workers" in agent.output


async def test_sigkilled_agent_leaves_no_worker_alive(job: Job) -> None:
    script = job.script("with_child.py", WITH_CHILD)
    agent = await job.agent("--standalone", *common(2), script, job.out, "1", "stay")
    started = await job.wait_records("started", 2)
    pids = pids_of(started)
    assert len(set(pids)) == 4
    agent.process.kill()
    with anyio.fail_after(1.0 + 1.0):  # the kernel's parent-death signal and the reaper act at once; margin for load
        await wait_gone(pids)
    assert processes_mentioning(str(job.tmp_path)) == []


async def test_worker_children_do_not_survive_a_failed_job(job: Job) -> None:
    script = job.script("with_child.py", WITH_CHILD)
    agent = await job.agent("--standalone", *common(2, "--max-restarts", "0"), script, job.out, "0", "fail")
    assert await agent.wait() == 1, agent.output
    started = job.records("started")
    assert len(started) == 2
    assert "exitcode  : 5" in agent.output
    with anyio.move_on_after(5):  # the agent awaits its workers only: their children may still be dying
        await wait_gone(pids_of(started))
    assert not [pid for pid in pids_of(started) if alive(pid)]
    assert processes_mentioning(str(job.tmp_path)) == []


# --- the agent in process ----------------------------------------------------------------------------------------

# Fails on the first attempt; on the next, reports the signal that stops it, once it is ready for one.
STOPPED_WITH = """
import signal
if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
    sys.exit(3)
def stopped(signum, frame):
    report("stopped", signal=signal.Signals(signum).name)
    sys.exit(0)
signal.signal(signal.SIGINT, stopped)
signal.signal(signal.SIGTERM, stopped)
report("ready")
while True:
    time.sleep(0.05)
"""


async def test_an_agent_restarts_a_failure_and_stops_its_workers_with_its_stop_signal(job: Job) -> None:
    from aelastic.agent.agent import ElasticAgent
    from aelastic.agent.attempt import StopSignal
    from aelastic.agent.logs import LogSpec
    from aelastic.agent.options import Features
    from aelastic.agent.workers import WorkerSpec, WorkerState
    from aelastic.rendezvous import open_rendezvous

    script = job.script("worker.py", STOPPED_WITH)
    spec = WorkerSpec("trainer", 1, sys.executable, ("-u", str(script), str(job.out)), max_restarts=1)
    params = RendezvousParameters("static", f"127.0.0.1:{free_port()}", "job", 1, 1, rank=0)
    run_dir = job.tmp_path / "run"
    run_dir.mkdir()
    with anyio.fail_after(DEADLINE):
        async with open_rendezvous(params) as handler, anyio.create_task_group() as tg:
            features = Features(stop_signal=StopSignal(signal.SIGINT))
            agent = ElasticAgent(spec, handler, LogSpec(), run_dir=run_dir, features=features)
            tg.start_soon(agent.run)
            await job.wait_records("ready", 1)
            assert (agent.group.state, agent.budget.failure_restarts, agent.budget.membership_restarts) == (
                WorkerState.HEALTHY, 1, 0
            )  # fmt: skip
            tg.cancel_scope.cancel()
    (stopped,) = job.records("stopped")
    assert (stopped["signal"], stopped["TORCHELASTIC_RESTART_COUNT"]) == ("SIGINT", "1")
