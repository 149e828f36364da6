"""Scheduler signals on one machine: a real ``aelastic run`` whose workers count the SIGUSR1/SIGUSR2 they receive.

A notice reaches every worker exactly once whether the sender signalled the agent alone (a batch script's ``kill``:
the agent forwards it) or every process of the agent's tree, as Slurm's proctrack does (the agent's witness saw it
too: nothing is forwarded again); the job then exits 0. ``--signals-to-handle`` keeps torchrun's meaning, and bad
lists are one line and exit 2 with nothing started. The same on the real Slurm cluster: ``tests/slurm/test_signals.py``.

Each wait awaits an event: a file a worker writes, or the agent's log line that says what it did with a signal (it
is written after the ``killpg``, so a forwarded signal is pending in every worker by then).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import anyio
import pytest
from helpers.signals import WORKER

from aelastic import LaunchConfig, LaunchControl, launch
from aelastic.agent.forward.parent import DIRECT_WINDOW, open_witness
from aelastic.errors import ConfigurationError

DEADLINE = 60.0


def wait_for(what: str, check: Callable[[], object], timeout: float = DEADLINE) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {timeout:g} s")
        time.sleep(0.02)


def descendants(pid: int) -> list[int]:
    """Every process under ``pid``, as Slurm's proctrack/linuxproc finds a step's processes (from /proc)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rpartition(")")[2].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


class Job:
    """``aelastic run [flags] worker.py FOLDER`` with its stderr in a file."""

    def __init__(self, folder: Path, *flags: str, backend: str = "asyncio", nproc: int = 2) -> None:
        self.folder, self.nproc = folder, nproc
        (folder / "worker.py").write_text(WORKER)
        self.stderr = folder / "agent.err"
        with self.stderr.open("wb") as err:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "aelastic", "--async-backend", backend, "run", "--nproc-per-node", str(nproc),
                 *flags, str(folder / "worker.py"), str(folder)],
                stdout=subprocess.DEVNULL, stderr=err,
            )  # fmt: skip

    @property
    def pid(self) -> int:
        return self.process.pid

    def log(self) -> str:
        return self.stderr.read_text()

    def wait_ready(self) -> None:
        wait_for("ready workers", lambda: all((self.folder / f"ready.{r}").exists() for r in range(self.nproc)))

    def wait_log(self, text: str, count: int = 1) -> None:
        wait_for(f"{text!r} x{count} in the agent's log", lambda: self.log().count(text) >= count)

    def finish(self) -> dict[int, list[str]]:
        """Let the workers exit; the job must exit 0. What each rank got."""
        (self.folder / "done").touch()
        assert self.process.wait(DEADLINE) == 0, self.log()
        return {r: list(filter(None, (self.folder / f"got.{r}").read_text().split(","))) for r in range(self.nproc)}

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(DEADLINE)


@pytest.fixture
def job(tmp_path: Path) -> Iterator[Callable[..., Job]]:
    jobs: list[Job] = []

    def start(*flags: str, **kwargs: object) -> Job:
        jobs.append(Job(tmp_path, *flags, **kwargs))  # type: ignore[arg-type]
        return jobs[-1]

    yield start
    for j in jobs:
        j.kill()  # the parent-death signal and the reaper take the workers


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_a_signal_to_the_agent_alone_is_forwarded_to_every_worker_once(job: Callable[..., Job], backend: str) -> None:
    """A batch script's ``kill -USR1 $AGENT``: the agent forwards it, and supervises on; the job exits 0."""
    j = job(backend=backend)
    j.wait_ready()
    os.kill(j.pid, signal.SIGUSR1)
    j.wait_log("received SIGUSR1: forwarded to the workers' process groups")
    os.kill(j.pid, signal.SIGUSR2)
    j.wait_log("received SIGUSR2: forwarded to the workers' process groups")
    assert j.finish() == {0: ["SIGUSR1", "SIGUSR2"], 1: ["SIGUSR1", "SIGUSR2"]}


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_a_signal_to_every_process_of_the_tree_reaches_each_worker_once(job: Callable[..., Job], backend: str) -> None:
    """Slurm's step signal (proctrack signals every process of the step): the workers got it from the sender, the
    agent's witness too, so the agent forwards nothing; each worker sees it once."""
    j = job(backend=backend)
    j.wait_ready()
    for pid in [j.pid, *descendants(j.pid)]:
        os.kill(pid, signal.SIGUSR1)
    j.wait_log("received SIGUSR1 from pid")
    assert f"received SIGUSR1 from pid {os.getpid()} (" in j.log()
    assert "which signalled the workers directly too: not forwarded again" in j.log()
    assert "forwarded to the workers' process groups" not in j.log()
    assert j.finish() == {0: ["SIGUSR1"], 1: ["SIGUSR1"]}
    assert "reaper sidecar" not in j.log()  # spawned with the forwarded signals blocked: the notice spared it


def test_a_burst_of_notices_each_reaches_every_worker_once(job: Callable[..., Job]) -> None:
    """Three notices, alternately to the agent alone and to the whole tree: three receipts per worker."""
    j = job()
    j.wait_ready()
    os.kill(j.pid, signal.SIGUSR1)
    j.wait_log("forwarded to the workers' process groups", 1)
    for pid in [j.pid, *descendants(j.pid)]:
        os.kill(pid, signal.SIGUSR1)
    j.wait_log("not forwarded again", 1)
    os.kill(j.pid, signal.SIGUSR1)
    j.wait_log("forwarded to the workers' process groups", 2)
    assert j.finish() == {0: ["SIGUSR1"] * 3, 1: ["SIGUSR1"] * 3}


def test_signals_to_handle_still_stop_the_workers_and_then_the_agent(job: Callable[..., Job]) -> None:
    """torchrun's meaning: SIGTERM stops the workers (with SIGTERM) and the agent exits 128+15."""
    j = job()
    j.wait_ready()
    os.kill(j.pid, signal.SIGTERM)
    assert j.process.wait(DEADLINE) == 128 + signal.SIGTERM
    assert "received SIGTERM: forwarding it to the workers" in j.log()
    assert not list(j.folder.glob("got.*"))  # stopped, not finished


@pytest.mark.slow
def test_a_handled_notice_is_no_longer_forwarded_by_default(job: Callable[..., Job]) -> None:
    """``--signals-to-handle ...,SIGUSR1`` (a torchrun command line that stops the job on USR1) keeps its meaning:
    SIGUSR1 leaves the default forwarded list, stops the workers with SIGUSR1 and the agent exits 128+10; SIGUSR2
    is still forwarded."""
    j = job("--signals-to-handle", "SIGTERM,SIGINT,SIGUSR1")
    j.wait_ready()
    os.kill(j.pid, signal.SIGUSR2)
    j.wait_log("received SIGUSR2: forwarded")
    os.kill(j.pid, signal.SIGUSR1)
    assert j.process.wait(DEADLINE) == 128 + signal.SIGUSR1
    assert "received SIGUSR1: forwarding it to the workers" in j.log()


def test_an_empty_forward_list_leaves_the_signal_to_its_default_action(job: Callable[..., Job]) -> None:
    """``--signals-to-forward ''``: torchrun's behaviour, the agent dies of SIGUSR1 (the workers die with it)."""
    j = job("--signals-to-forward", "")
    j.wait_ready()
    os.kill(j.pid, signal.SIGUSR1)
    assert j.process.wait(DEADLINE) == -signal.SIGUSR1


@pytest.mark.parametrize(
    ("flags", "env", "message"),
    [
        (["--signals-to-forward", "SIGKILL"], {}, "--signals-to-forward 'SIGKILL': SIGKILL cannot be caught"),
        (["--signals-to-forward", "SIGUSR1,SIGSTOP"], {}, "SIGSTOP cannot be caught"),
        ([], {"PET_SIGNALS_TO_FORWARD": "SIGSTOP"}, "--signals-to-forward 'SIGSTOP': SIGSTOP cannot be caught"),
        (["--signals-to-handle", "SIGTERM,SIGKILL"], {}, "--signals-to-handle 'SIGTERM,SIGKILL': SIGKILL cannot"),
        (["--signals-to-forward", "USR1"], {}, "--signals-to-forward 'USR1': 'USR1' is not a signal name"),
        (
            ["--signals-to-forward", "SIGUSR1,SIGTERM"],
            {},
            "--signals-to-forward 'SIGUSR1,SIGTERM': SIGTERM is also in --signals-to-handle "
            "'SIGTERM,SIGINT,SIGHUP,SIGQUIT'; a signal either stops the workers or is forwarded to them",
        ),
        (
            ["--signals-to-handle", "SIGUSR2", "--signals-to-forward", "SIGUSR1,SIGUSR2"],
            {},
            "SIGUSR2 is also in --signals-to-handle 'SIGUSR2'",
        ),
    ],
)
def test_bad_signal_lists_are_one_line_exit_2_and_nothing_starts(
    tmp_path: Path, flags: list[str], env: dict[str, str], message: str
) -> None:
    script = tmp_path / "train.py"
    script.write_text(f"open({str(tmp_path / 'started')!r}, 'w')\n")
    done = subprocess.run(
        [sys.executable, "-m", "aelastic", "run", *flags, str(script)],
        capture_output=True, text=True, timeout=DEADLINE, env={**os.environ, **env}, check=False,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith("aelastic run: error: "), done.stderr
    assert message in done.stderr
    assert not (tmp_path / "started").exists()


def test_dry_run_shows_what_is_forwarded(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("")
    done = subprocess.run(
        [sys.executable, "-m", "aelastic", "run", "--dry-run", "--signals-to-handle", "SIGTERM,SIGUSR1", str(script)],
        capture_output=True, text=True, timeout=DEADLINE, check=True,
    )  # fmt: skip
    assert re.search(r"signals_to_forward +'SIGUSR2' +<- default", done.stdout), done.stdout


def test_launch_config_forwarded_signals() -> None:
    usr1, usr2 = signal.SIGUSR1, signal.SIGUSR2
    assert LaunchConfig().forwarded_signals == (usr1, usr2)
    assert LaunchConfig(signals_to_handle="SIGTERM,SIGUSR1").forwarded_signals == (usr2,)
    assert LaunchConfig(signals_to_forward="").forwarded_signals == ()
    assert LaunchConfig(signals_to_forward="SIGWINCH,SIGUSR1").forwarded_signals == (signal.SIGWINCH, usr1)
    with pytest.raises(ConfigurationError, match=r"LaunchConfig signals_to_forward 'SIGINT': SIGINT is also in "):
        LaunchConfig(signals_to_forward="SIGINT")
    with pytest.raises(ConfigurationError, match="LaunchConfig signals_to_forward 'SIGKILL': SIGKILL cannot be"):
        LaunchConfig(signals_to_forward="SIGKILL")


# --- the embedding API -------------------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_an_application_forwards_a_signal_to_a_running_launch(tmp_path: Path) -> None:
    """``LaunchControl.forward``: an application that embeds the launch passes a signal on; the workers run on."""
    (tmp_path / "worker.py").write_text(WORKER)
    control = LaunchControl()
    config = LaunchConfig(nproc_per_node=2, max_restarts=0)
    result: dict[int, object] = {}

    async def run() -> None:
        result.update(await launch(config, sys.executable, "-u", str(tmp_path / "worker.py"), str(tmp_path),
                                   control=control))  # fmt: skip

    async with anyio.create_task_group() as tg:
        tg.start_soon(run)
        ready = [tmp_path / f"ready.{r}" for r in range(2)]
        await anyio.to_thread.run_sync(wait_for, "ready workers", lambda: all(p.exists() for p in ready))
        assert control.forward(signal.SIGUSR2) == 2
        (tmp_path / "done").touch()
    assert result == {0: None, 1: None}
    assert [(tmp_path / f"got.{r}").read_text() for r in range(2)] == ["SIGUSR2", "SIGUSR2"]
    assert control.forward(signal.SIGUSR2) == 0  # nothing runs any more


@pytest.mark.anyio
async def test_the_witness_reports_what_reached_it_and_nothing_else() -> None:
    """The witness sees a signal sent to it (with the sender's pid), not one sent elsewhere, and a dead witness
    answers at once."""
    async with open_witness([signal.SIGUSR1, signal.SIGUSR2]) as witness:
        os.kill(witness.pid, signal.SIGUSR2)
        receipt = await witness.wait_direct(signal.SIGUSR2)
        assert receipt is not None
        assert (receipt.signum, receipt.sender) == (signal.SIGUSR2, os.getpid())
        started = anyio.current_time()
        assert await witness.wait_direct(signal.SIGUSR2) is None  # consumed: nothing more came
        assert anyio.current_time() - started >= DIRECT_WINDOW * 0.9
        os.kill(witness.pid, signal.SIGUSR1)
        assert await witness.wait_direct(signal.SIGUSR2) is None  # another signal
        assert await witness.wait_direct(signal.SIGUSR1) is not None
        os.kill(witness.pid, signal.SIGKILL)
        await anyio.to_thread.run_sync(wait_for, "the witness's exit", lambda: not witness.alive)
        started = anyio.current_time()
        assert await witness.wait_direct(signal.SIGUSR1) is None
        assert anyio.current_time() - started < DIRECT_WINDOW / 2
