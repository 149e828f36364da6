"""A worker that SIGKILL does not end never wedges the agent (issue 31): a real uninterruptible sleep.

The worker writes to an ext4 file system that the test froze (``fsfreeze``): the kernel holds the write in
``percpu_rwsem_wait``, state D, and SIGKILL stays pending until the file system thaws. The agent gives up on it
after ``--unkillable-timeout``, says why and exits with status 4 (replace the node); the test thaws the file system
afterwards, and the worker ends.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from aelastic.agent.procfs import process_state

DEADLINE = 90.0
WORKER = """\
import pathlib, sys, time
out, frozen = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
(out / "ready").write_text("")
while not (out / "go").exists():
    time.sleep(0.05)
(frozen / "blocked").write_text("never")  # the frozen file system holds this write: uninterruptible sleep
"""


def _run(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True, timeout=60)


@pytest.fixture
def frozen(tmp_path: Path) -> Iterator[tuple[Path, list[Path]]]:
    """A mounted ext4 file system (on a loop device) and the list the test adds it to once frozen; thawed,
    unmounted and removed at the end, whatever happened."""
    if os.geteuid() != 0 or not all(shutil.which(t) for t in ("mkfs.ext4", "fsfreeze", "mount", "umount")):
        pytest.skip("needs root, mkfs.ext4, fsfreeze and mount: an uninterruptible sleep is made by freezing ext4")
    image, mount = tmp_path / "fs.img", tmp_path / "mnt"
    mount.mkdir()
    with image.open("wb") as file:
        file.truncate(16 << 20)
    _run("mkfs.ext4", "-q", str(image))
    made = subprocess.run(["mount", "-o", "loop", str(image), str(mount)], capture_output=True, text=True, timeout=60)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a loop device here: {made.stderr.strip()}")
    thaw: list[Path] = []
    try:
        yield mount, thaw
    finally:
        for path in thaw:
            subprocess.run(["fsfreeze", "-u", str(path)], capture_output=True, timeout=60, check=False)
        deadline = time.monotonic() + DEADLINE
        while subprocess.run(["umount", str(mount)], capture_output=True, timeout=60).returncode != 0:
            assert time.monotonic() < deadline, "the test file system stayed busy"
            time.sleep(0.2)


def start_blocked(tmp_path: Path, mount: Path, thaw: list[Path], *flags: str) -> tuple[subprocess.Popen[str], int]:
    """An agent whose one worker is in uninterruptible sleep; the agent and the worker's pid."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    out = tmp_path / "out"
    out.mkdir()
    agent = subprocess.Popen(
        [sys.executable, "-m", "aelastic", "run", "--standalone", "--nproc-per-node", "1", "--max-restarts", "0",
         "--shutdown-timeout", "1", "--unkillable-timeout", "2", *flags, str(script), str(out), str(mount)],
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + DEADLINE
    while not (out / "ready").exists():
        assert agent.poll() is None, "the agent ended before its worker started"
        assert time.monotonic() < deadline, "the worker never started"
        time.sleep(0.05)
    children = Path(f"/proc/{agent.pid}/task/{agent.pid}/children").read_text().split()
    worker = next(int(pid) for pid in children if b"worker.py" in Path(f"/proc/{pid}/cmdline").read_bytes())
    _run("fsfreeze", "-f", str(mount))
    thaw.append(mount)
    (out / "go").touch()
    while process_state(worker) != "D":
        assert time.monotonic() < deadline, f"the worker never blocked: state {process_state(worker)!r}"
        time.sleep(0.05)
    return agent, worker


def finish(agent: subprocess.Popen[str], worker: int, mount: Path, thaw: list[Path]) -> str:
    """Wait for the agent's exit; then thaw, and the worker ends. The agent's stderr."""
    try:
        _, err = agent.communicate(timeout=DEADLINE)
    finally:
        agent.kill()
    assert process_state(worker) == "D", "the worker ended before the file system thawed"
    _run("fsfreeze", "-u", str(mount))
    thaw.remove(mount)
    deadline = time.monotonic() + DEADLINE
    while process_state(worker) not in ("", "Z"):  # its pending SIGKILL (the agent's and the reaper's) ends it
        assert time.monotonic() < deadline, "the worker outlived the thaw"
        time.sleep(0.05)
    return err


def test_a_hung_worker_in_uninterruptible_sleep_ends_the_agent_with_status_4(
    tmp_path: Path, frozen: tuple[Path, list[Path]]
) -> None:
    mount, thaw = frozen
    agent, worker = start_blocked(tmp_path, mount, thaw, "--hang-timeout", "1")
    err = finish(agent, worker, mount, thaw)
    assert agent.returncode == 4, err
    assert "rank 0 named (its process state)" in err
    assert "in uninterruptible sleep (D state)" in err
    last = err.strip().splitlines()[-1]
    assert last == (
        f"aelastic run: error: worker local_rank 0 (rank 0, pid {worker}) outlived SIGKILL for 2 s (state D, waiting "
        "in the kernel at percpu_rwsem_wait): this node cannot free it or what it holds; the agent leaves so that the "
        "node is replaced"
    ), err


def test_a_stop_that_cannot_end_a_worker_ends_the_agent_with_status_4(
    tmp_path: Path, frozen: tuple[Path, list[Path]]
) -> None:
    mount, thaw = frozen
    agent, worker = start_blocked(tmp_path, mount, thaw)
    agent.send_signal(signal.SIGTERM)  # TERM stays pending, then KILL does too
    err = finish(agent, worker, mount, thaw)
    assert agent.returncode == 4, err
    assert "did not exit within 1.0 s of SIGTERM: sending SIGKILL" in err
    assert f"(rank 0, pid {worker}) outlived SIGKILL for 2 s (state D" in err.strip().splitlines()[-1], err
