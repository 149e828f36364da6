"""Workers see a terminal when the agent's console is one, as under torchrun: ``aelastic run`` runs on a real
pseudo-terminal (the test holds the master side), a tqdm bar on rank 0 is redrawn live, and the failure report
still carries the failing worker's last stderr lines.

The bar's worker takes one step per byte it reads from a FIFO, and the test writes a byte only once it has seen the
previous frame on the terminal: a bar that reached the terminal only at the end (workers writing to a pipe that is
forwarded in whole lines) stalls the test at the first frame instead of passing.
"""

from __future__ import annotations

import fcntl
import os
import pty
import re
import signal
import struct
import subprocess
import sys
import termios
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import anyio.abc
import pytest

pytestmark = pytest.mark.anyio

DEADLINE = 90.0  # generous: a small, shared machine
STEPS = 8

BAR = f"""
import os, sys
from tqdm import tqdm
print("isatty", os.environ["LOCAL_RANK"], sys.stdout.isatty(), sys.stderr.isatty(), flush=True)
if os.environ["LOCAL_RANK"] == "0":
    with open(sys.argv[1], "rb", buffering=0) as steps:
        for _ in tqdm(range({STEPS}), mininterval=0, miniters=1, ascii=True):
            steps.read(1)  # one step per byte the test writes
"""

FAIL = """
import os
if os.environ["LOCAL_RANK"] == "1":
    raise ValueError("boom from rank one")
"""


class Terminal:
    """The master side of the pseudo-terminal that an ``aelastic run`` process writes to."""

    def __init__(self, master: int, process: anyio.abc.Process) -> None:
        self.master = master
        self.process = process
        self.seen = b""

    async def read(self) -> bytes:
        """The next chunk the agent wrote; ``b""`` once every writer has closed the terminal."""
        await anyio.wait_readable(self.master)
        try:
            chunk = os.read(self.master, 65536)
        except OSError:  # EIO: the agent and its workers are gone
            chunk = b""
        self.seen += chunk
        return chunk

    async def read_all(self) -> bytes:
        with anyio.fail_after(DEADLINE):
            while await self.read():
                pass
        return self.seen


@pytest.fixture
async def terminal_agent(tmp_path: Path, anyio_backend: str) -> AsyncIterator[object]:
    started: list[Terminal] = []

    async def start(*args: str) -> Terminal:
        master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
        try:
            process = await anyio.open_process(
                [sys.executable, "-m", "aelastic", "--async-backend", anyio_backend, "run", *args],
                stdin=subprocess.DEVNULL,
                stdout=slave,
                stderr=slave,
                env={k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")},
                cwd=tmp_path,
            )
        finally:
            os.close(slave)
        terminal = Terminal(master, process)
        started.append(terminal)
        return terminal

    try:
        yield start
    finally:
        for terminal in started:
            if terminal.process.returncode is None:
                terminal.process.send_signal(signal.SIGKILL)  # the parent-death signal takes its workers
            with anyio.CancelScope(shield=True):
                await terminal.process.aclose()
            os.close(terminal.master)


async def test_a_rank0_tqdm_bar_redraws_live_on_the_terminal(tmp_path: Path, terminal_agent: object) -> None:
    script = tmp_path / "bar.py"
    script.write_text(BAR)
    fifo = tmp_path / "steps"
    os.mkfifo(fifo)
    writer = os.open(fifo, os.O_RDWR)  # read-write: the worker's open for reading never waits for a writer
    try:
        start = terminal_agent
        assert callable(start)
        terminal: Terminal = await start("--standalone", "--nproc-per-node", "2", str(script), str(fifo))
        frame = re.compile(rb"\r\[default0\]: *\d+%\|[#0-9 ]*\| (\d+)/" + str(STEPS).encode())
        redraws = 0
        with anyio.fail_after(DEADLINE):
            for step in range(STEPS):
                while len(frame.findall(terminal.seen)) <= step:  # the frame of the steps taken so far
                    assert await terminal.read(), terminal.seen.decode(errors="replace")
                redraws += 1
                os.write(writer, b".")  # the next step, only now that this frame is on the terminal
        output = (await terminal.read_all()).decode(errors="replace")
    finally:
        os.close(writer)
    assert await terminal.process.wait() == 0, output
    assert redraws == STEPS >= 5
    assert sorted(re.findall(r"^\[default(\d)\]:isatty \d True True\r?$", output, re.M)) == ["0", "1"], output
    # The bar is narrower than the terminal by the prefix, so each redraw stays on one terminal line.
    frames = [line for line in output.replace("\r\n", "\n").replace("\r", "\n").split("\n") if "%|" in line]
    assert frames, output
    assert all(len(line) <= 80 for line in frames), frames


async def test_failure_report_keeps_the_stderr_tail_on_a_terminal(tmp_path: Path, terminal_agent: object) -> None:
    script = tmp_path / "fail.py"
    script.write_text(FAIL)
    start = terminal_agent
    assert callable(start)
    terminal: Terminal = await start("--standalone", "--nproc-per-node", "2", str(script))
    output = (await terminal.read_all()).decode(errors="replace")
    assert await terminal.process.wait() == 1, output
    report = output[output.index("Root Cause") :]
    assert "ValueError: boom from rank one" in report, output
    assert "[default1]:ValueError: boom from rank one" in output  # shown live too, prefixed


async def test_an_empty_prefix_template_gives_torchruns_unprefixed_output(
    tmp_path: Path, terminal_agent: object
) -> None:
    script = tmp_path / "hello.py"
    script.write_text("import os, sys\nprint('hello', os.environ['LOCAL_RANK'], sys.stdout.isatty())\n")
    start = terminal_agent
    assert callable(start)
    terminal: Terminal = await start("--standalone", "--nproc-per-node", "2", "--log-line-prefix-template", "",
                                     str(script))  # fmt: skip
    output = (await terminal.read_all()).decode(errors="replace")
    assert await terminal.process.wait() == 0, output
    assert sorted(re.findall(r"^hello (\d) True\r?$", output, re.M)) == ["0", "1"], output
