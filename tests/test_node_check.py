"""``--node-check`` with real agents on loopback (``aelastic run`` processes, c10d on a store that no agent serves, real
check processes and gloo workers), and its flags. The pure core is tests/test_node_check_plan.py's; a slow link
across hosts is tests/faults/test_node_check.py's.

Agents run on asyncio and on trio side by side (``--async-backend``). A node is made faulty the way a real one is:
its interpreter finds a ``torch`` that fails to import. Tests wait on the files the workers write and on process
exits (bounded polls: a file appearing has no event to await).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.procs import poll_until

from aelastic import LaunchConfig, NodeCheckOptions
from aelastic.cli import main
from aelastic.errors import ConfigurationError

DEADLINE = 120.0  # generous: three agents, their check processes and torch workers on a small, shared machine

# argv: OUT TARGET. A world smaller than TARGET waits for the membership restart; the full world all-reduces.
WORKER = """\
import os, sys, time
out, target, world, rank = sys.argv[1], int(sys.argv[2]), int(os.environ["WORLD_SIZE"]), os.environ["RANK"]
open(os.path.join(out, f"started-{world}-{rank}-{os.getpid()}"), "w").close()
if world < target:
    time.sleep(600)
import torch, torch.distributed as dist
dist.init_process_group("gloo")
ones = torch.ones(1)
dist.all_reduce(ones)
assert int(ones.item()) == world
open(os.path.join(out, f"done-{world}-{rank}"), "w").close()
dist.destroy_process_group()
"""


class Job:
    """The rendezvous store (``aelastic store``) and the agents of one test; each process's output goes to a file."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.out = tmp_path / "out"
        self.out.mkdir()
        self.script = tmp_path / "worker.py"
        self.script.write_text(WORKER)
        self.procs: list[tuple[subprocess.Popen[bytes], Path]] = []
        store = self._spawn([sys.executable, "-m", "aelastic", "store", "--host", "127.0.0.1", "--port", "0"], "store")
        line = poll_until("the store's port", lambda: re.search(r"listening on (\S+)", self.read(store)), DEADLINE,
                          0.02, self.logs)  # fmt: skip
        self.endpoint = line[1]

    def _spawn(self, argv: list[str], name: str, env: dict[str, str] | None = None) -> Path:
        log = self.tmp_path / f"{name}.log"
        with log.open("wb") as f:
            popen = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})  # fmt: skip
        self.procs.append((popen, log))
        return log

    def agent(self, backend: str, nnodes: str, target: int, env: dict[str, str] | None = None) -> Path:
        """``aelastic run --node-check`` of the worker, one per node, on ``backend``; returns its log."""
        conf = "is_host=false,last_call_timeout=1,keep_alive_interval=0.5,keep_alive_max_attempt=3"
        argv = [sys.executable, "-m", "aelastic", "--async-backend", backend, "--log-level", "INFO", "run",
                "--nnodes", nnodes, "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                self.endpoint, "--rdzv-id", "checked", "--rdzv-conf", conf, "--node-check", self.script, self.out,
                str(target)]  # fmt: skip
        return self._spawn(argv, f"agent{len(self.procs)}", {"OMP_NUM_THREADS": "1", **(env or {})})

    def read(self, log: Path) -> str:
        return log.read_text(errors="replace")

    def wait(self, log: Path) -> int:
        popen = next(p for p, path in self.procs if path == log)
        try:
            return popen.wait(DEADLINE)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{log.name} still running after {DEADLINE:g} s\n{self.logs()}") from None

    def files(self, prefix: str) -> list[str]:
        return sorted(p.name for p in self.out.glob(f"{prefix}-*"))

    def wait_files(self, prefix: str, count: int) -> list[str]:
        return poll_until(f"{count} {prefix} files", lambda: len(self.files(prefix)) >= count and self.files(prefix),
                          DEADLINE, 0.02, self.logs)  # fmt: skip

    def logs(self) -> str:
        return "\n".join(f"--- {log.name}:\n{self.read(log)[-4000:]}" for _, log in self.procs)

    def close(self) -> None:
        for popen, _ in self.procs:
            if popen.poll() is None:
                popen.kill()  # the agents' check processes and workers die with them (the parent-death signal)
            popen.wait(30)


@pytest.fixture
def job(tmp_path: Path) -> Iterator[Job]:
    pytest.importorskip("torch")
    job = Job(tmp_path)
    try:
        yield job
    finally:
        job.close()


@pytest.fixture
def broken_torch(tmp_path: Path) -> dict[str, str]:
    """The environment of a node whose torch cannot be imported."""
    package = tmp_path / "broken" / "torch"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("raise ImportError('this node has a broken torch install')\n")
    return {"PYTHONPATH": str(package.parent)}


def checks(log: str) -> list[str]:
    """The node check's verdict lines of an agent's log."""
    return re.findall(r"node check of round \d+ (?:passed in|took) .*", log)


@pytest.mark.torch
def test_a_node_whose_check_fails_is_left_out_and_the_others_train(job: Job, broken_torch: dict[str, str]) -> None:
    healthy = [job.agent("asyncio", "2:3", 2), job.agent("trio", "2:3", 2)]
    broken = job.agent("asyncio", "2:3", 2, env=broken_torch)
    assert job.wait(broken) == 1, job.logs()
    said = job.read(broken)
    why = r"its check failed: the check process exited with 1"
    assert re.search(rf"this node 127\.0\.0\.1 \(rank \d\) is left out: {why}", said), said
    error = rf"aelastic run: error: node check: this node \(rank \d of round 0\) is left out of the job: {why}"
    assert re.search(error, said), said
    assert "ImportError: this node has a broken torch install" in said  # the check process's stderr is the agent's
    for log in healthy:
        assert job.wait(log) == 0, job.logs()
        text = job.read(log)
        assert re.search(rf"node 127\.0\.0\.1 \(rank \d\) is left out: {why}", text), text
        assert len(checks(text)) == 1, text  # the next round's members are all trusted: no second check
        assert "forming the next round without the node(s) left out" in text
    assert job.files("done") == ["done-2-0", "done-2-1"]
    assert not [name for name in job.files("started") if name.startswith("started-3")]


@pytest.mark.torch
def test_a_node_that_joins_later_is_checked_with_the_trusted_ones_as_its_peers(job: Job) -> None:
    first = [job.agent("asyncio", "2:3", 3), job.agent("trio", "2:3", 3)]
    job.wait_files("started-2", 2)
    late = job.agent("asyncio", "2:3", 3)
    for log in [*first, late]:
        assert job.wait(log) == 0, job.logs()
    assert job.files("done") == ["done-3-0", "done-3-1", "done-3-2"]
    for log in first:  # checked when they came, then again as peers of the newcomer (not judged: trusted)
        assert re.findall(r"node check of round (\d+) passed", job.read(log)) == ["0", "1"], job.read(log)
    assert re.findall(r"node check of round (\d+) passed", job.read(late)) == ["1"], job.read(late)


@pytest.mark.torch
def test_the_node_serving_the_rendezvous_store_stays_whatever_its_verdict(
    tmp_path: Path, broken_torch: dict[str, str]
) -> None:
    """Alone (``--standalone``: it serves the c10d store), a node whose check fails is only reported: without its
    store no job could go on. Its worker, which does not need torch, runs."""
    noop = tmp_path / "noop.py"
    noop.write_text("pass\n")
    argv = [sys.executable, "-m", "aelastic", "--log-level", "INFO", "run", "--standalone", "--node-check", noop]
    env = {**os.environ, **broken_torch, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=DEADLINE, check=False)
    assert done.returncode == 0, done.stderr
    stays = (r"node check of round 0: this node \S+ \(rank 0\) serves the rendezvous store, without which the job "
             r"cannot go on, so it stays although its check failed: the check process exited with 1")  # fmt: skip
    assert re.search(stays, done.stderr), done.stderr


# --- the flags --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        (["--node-check-slowdown", "1"], {}, "--node-check-slowdown '1': must be a number > 1"),
        (["--node-check-slowdown", "nan"], {}, "--node-check-slowdown 'nan': must be a number > 1"),
        (["--node-check-slowdown", "twice"], {}, "--node-check-slowdown 'twice': must be a number > 1"),
        ([], {"PET_NODE_CHECK_SLOWDOWN": "0.5"}, "--node-check-slowdown '0.5': must be a number > 1"),
        (["--node-check", "--nnodes", "2", "--rdzv-backend", "static"], {},
         "--node-check with --rdzv-backend static: needs a dynamic rendezvous (c10d, etcd)"),
        (["--nnodes", "2", "--rdzv-backend", "static"], {"PET_NODE_CHECK": "1"},
         "--node-check with --rdzv-backend static: needs a dynamic rendezvous"),
        (["--nnodes", "2", "--rdzv-backend", "c10d"], {"PET_NODE_CHECK": "yes"},
         "PET_NODE_CHECK='yes': must be 0 or 1"),
    ],
)  # fmt: skip
def test_bad_node_check_flags_are_one_line_and_exit_2(
    argv: list[str], env: dict[str, str], message: str, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str], tmp_path: Path,
) -> None:  # fmt: skip
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    script = tmp_path / "train.py"
    script.touch()
    code = run_main(["run", *argv, "--dry-run", str(script)])
    err = capsys.readouterr().err
    assert code == 2, err
    assert message in err
    assert len(err.strip().splitlines()) == 1, err


def run_main(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as exc:  # argparse's own errors
        return int(exc.code or 0)


def test_the_flags_reach_the_launch_config(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.touch()
    assert main(["run", "--standalone", "--node-check", "--node-check-slowdown", "3.5", "--dry-run", str(script)]) == 0
    table = capsys.readouterr().out
    assert re.search(r"node_check.enabled\s+True\s+<- flag --node-check\n", table), table
    assert re.search(r"node_check.slowdown\s+3\.5\s+<- flag --node-check-slowdown\n", table), table


def test_the_launch_config_checks_its_fields() -> None:
    assert LaunchConfig().node_check == NodeCheckOptions(enabled=False, slowdown=2.0)  # torch's behaviour unless asked
    on = NodeCheckOptions(enabled=True)
    assert LaunchConfig(node_check=on).standalone  # standalone is c10d: a check of one node's device
    with pytest.raises(ConfigurationError, match=r"NodeCheckOptions slowdown=1: must be a number > 1"):
        NodeCheckOptions(slowdown=1)
    with pytest.raises(ConfigurationError, match=r"rdzv_backend='static': needs a dynamic rendezvous"):
        LaunchConfig(node_check=on, rdzv_backend="static", min_nodes=2, max_nodes=2)


def test_off_by_default_it_costs_the_agent_nothing() -> None:
    """Without --node-check the launcher imports none of the check's code (nor torch, ever)."""
    code = (
        "import sys, aelastic.launcher, aelastic.cli\n"
        "print(sorted(m for m in sys.modules if m.startswith('aelastic.agent.nodecheck') or m == 'torch'))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]", out.stdout
