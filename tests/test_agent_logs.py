"""Worker output through the agent: prefixes, whole lines only, redirect / tee / filter file layout, the last line
without a newline, the stderr tail, and complete files after a stop. Real worker processes; the console is an
in-memory sink."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import anyio
import anyio.lowlevel
import pytest
from helpers.console import Sink

from aelastic.agent.logs import ConsoleSinks, LogSpec, Std, WorkerLog
from aelastic.agent.processes import GroupOutcome, run_workers
from aelastic.agent.spawn.parent import WorkerCommand
from aelastic.errors import ConfigurationError

DEADLINE = 30.0


def command(local_rank: int, code: str, global_rank: int | None = None) -> WorkerCommand:
    return WorkerCommand(
        local_rank=local_rank,
        global_rank=local_rank if global_rank is None else global_rank,
        args=(sys.executable, "-c", textwrap.dedent(code)),
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


async def run(commands: list[WorkerCommand], spec: LogSpec) -> GroupOutcome:
    with anyio.fail_after(DEADLINE):
        return await run_workers(commands, spec, grace=5, reaper=None)


# --- Std and LogSpec --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0", Std.NONE),
        ("1", Std.OUT),
        ("2", Std.ERR),
        ("3", Std.ALL),
        ("0:1", {0: Std.OUT}),
        ("0:1,1:3,2:0", {0: Std.OUT, 1: Std.ALL, 2: Std.NONE}),
    ],
)
def test_std_from_str(text: str, expected: object) -> None:
    assert Std.from_str(text) == expected


@pytest.mark.parametrize("text", ["4", "", "a", "0:4", "10:1", "0:1,", "0=1"])
def test_std_from_str_rejects(text: str) -> None:
    with pytest.raises(ConfigurationError, match=r"0\.\.3"):
        Std.from_str(text)


def test_files_need_a_log_dir() -> None:
    with pytest.raises(ConfigurationError, match="log_dir"):
        LogSpec(redirects=Std.OUT)
    with pytest.raises(ConfigurationError, match="log_dir"):
        LogSpec(tee={1: Std.ERR})


def test_paths_and_prefixes(tmp_path: Path) -> None:
    spec = LogSpec(role="trainer", log_dir=tmp_path, attempt=2, hostname="node7")
    assert spec.error_file_path(3) == tmp_path / "attempt_2" / "3" / "error.json"
    assert spec.stdout_path(0) == tmp_path / "attempt_2" / "0" / "stdout.log"
    assert spec.stderr_path(0) == tmp_path / "attempt_2" / "0" / "stderr.log"
    assert spec.prefix(1, 5) == "[trainer1]:"
    templated = LogSpec(role="trainer", line_prefix_template="${role_name}-${rank}-${local_rank}@${hostname}|${x}: ")
    assert templated.prefix(1, 5).startswith("trainer-5-1@")
    assert templated.prefix(1, 5).endswith("|${x}: ")  # unknown names are left alone (safe_substitute)
    assert LogSpec().error_file_path(0) is None


# --- through real workers ---------------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_default_and_template_prefixes() -> None:
    out, err = Sink(), Sink()
    code = "import sys; print('to out'); print('to err', file=sys.stderr)"
    await run([command(0, code), command(1, code)], LogSpec(console=ConsoleSinks(stdout=out, stderr=err)))
    assert sorted(out.text.splitlines()) == ["[default0]:to out", "[default1]:to out"]
    assert sorted(err.text.splitlines()) == ["[default0]:to err", "[default1]:to err"]

    out = Sink()
    spec = LogSpec(
        role="trainer",
        hostname="h1",
        line_prefix_template="[${role_name} r${rank} l${local_rank} ${hostname}] ",
        console=ConsoleSinks(stdout=out, stderr=out),
    )
    await run([command(0, "print('x')", global_rank=4)], spec)
    assert out.text == "[trainer r4 l0 h1] x\n"


@pytest.mark.anyio
async def test_chatty_workers_never_interleave_partial_lines() -> None:
    sink = Sink()
    chatty = """
        import os, sys
        rank = os.environ["R"]
        for i in range(300):
            for part in (f"w{rank}-{i}-", "x" * (i % 50), "-end\\n"):
                sys.stdout.write(part)
                sys.stdout.flush()  # three writes per line: the agent sees partial lines
    """
    commands = [
        WorkerCommand(r, r, (sys.executable, "-c", textwrap.dedent(chatty)), {**os.environ, "R": str(r)})
        for r in range(2)
    ]
    outcome = await run(commands, LogSpec(console=ConsoleSinks(stdout=sink, stderr=sink)))
    assert outcome.succeeded
    lines = sink.text.splitlines()
    assert len(lines) == 600
    pattern = re.compile(r"^\[default(\d)\]:w(\d)-(\d+)-(x*)-end$")
    seen: dict[int, list[int]] = {0: [], 1: []}
    for line in lines:
        m = pattern.match(line)
        assert m, line
        assert m.group(1) == m.group(2)
        assert len(m.group(4)) == int(m.group(3)) % 50
        seen[int(m.group(1))].append(int(m.group(3)))
    assert seen == {0: list(range(300)), 1: list(range(300))}


@pytest.mark.anyio
async def test_last_line_without_newline_is_flushed(tmp_path: Path) -> None:
    out, err = Sink(), Sink()
    code = "import sys; sys.stdout.write('no newline'); sys.stderr.write('half'); sys.exit(2)"
    spec = LogSpec(log_dir=tmp_path, tee=Std.ALL, console=ConsoleSinks(stdout=out, stderr=err))
    outcome = await run([command(0, code)], spec)
    assert out.text == "[default0]:no newline\n"
    assert err.text == "[default0]:half\n"
    assert (tmp_path / "attempt_0" / "0" / "stdout.log").read_text() == "no newline"
    assert (tmp_path / "attempt_0" / "0" / "stderr.log").read_text() == "half"
    assert outcome.exits[0].stderr_tail == ("half",)


@pytest.mark.anyio
async def test_redirect_tee_and_filter_layout(tmp_path: Path) -> None:
    out, err = Sink(), Sink()
    code = "import os, sys; r = os.environ['R']; print('out', r); print('err', r, file=sys.stderr)"
    commands = [
        WorkerCommand(r, r, (sys.executable, "-c", code), {**os.environ, "R": str(r), "PYTHONUNBUFFERED": "1"})
        for r in range(4)
    ]
    spec = LogSpec(
        log_dir=tmp_path,
        attempt=1,
        # rank 0: stdout to file only; rank 1: both to files only; rank 2: stderr teed; rank 3: nothing to files
        redirects={0: Std.OUT, 1: Std.ALL},
        tee={2: Std.ERR},
        local_ranks_filter=frozenset({0, 1, 3}),  # rank 2's console output is suppressed (its files are not)
        console=ConsoleSinks(stdout=out, stderr=err),
    )
    (tmp_path / "attempt_1" / "9").mkdir(parents=True)  # a stale attempt directory is replaced
    outcome = await run(commands, spec)
    assert outcome.succeeded
    attempt = tmp_path / "attempt_1"
    assert sorted(p.name for p in attempt.iterdir()) == ["0", "1", "2", "3"]
    assert sorted(p.name for p in (attempt / "0").iterdir()) == ["stdout.log"]
    assert sorted(p.name for p in (attempt / "1").iterdir()) == ["stderr.log", "stdout.log"]
    assert sorted(p.name for p in (attempt / "2").iterdir()) == ["stderr.log"]
    assert sorted(p.name for p in (attempt / "3").iterdir()) == []
    assert (attempt / "0" / "stdout.log").read_text() == "out 0\n"
    assert (attempt / "1" / "stdout.log").read_text() == "out 1\n"
    assert (attempt / "1" / "stderr.log").read_text() == "err 1\n"
    assert (attempt / "2" / "stderr.log").read_text() == "err 2\n"
    assert sorted(out.text.splitlines()) == ["[default3]:out 3"]
    assert sorted(err.text.splitlines()) == ["[default0]:err 0", "[default3]:err 3"]


@pytest.mark.anyio
async def test_stderr_tail_keeps_the_last_lines() -> None:
    sink = Sink()
    code = "import sys\nfor i in range(50): print('line', i, file=sys.stderr)\nsys.exit(1)"
    spec = LogSpec(console=ConsoleSinks(stdout=sink, stderr=sink), stderr_tail_lines=5)
    outcome = await run([command(0, code)], spec)
    assert outcome.exits[0].stderr_tail == tuple(f"line {i}" for i in range(45, 50))


@pytest.mark.anyio
async def test_files_are_complete_after_cancellation(tmp_path: Path) -> None:
    sink = Sink()
    code = """
        import sys, time
        for i in range(1000):
            print("line", i)
        sys.stdout.write("partial")
        sys.stdout.flush()
        print("ready", file=sys.stderr, flush=True)
        time.sleep(120)
    """
    spec = LogSpec(log_dir=tmp_path, tee=Std.OUT, console=ConsoleSinks(stdout=sink, stderr=sink))
    with anyio.fail_after(DEADLINE):
        async with anyio.create_task_group() as tg:

            async def cancel_when_ready() -> None:
                await sink.wait_for(r"^\[default0\]:ready$")
                tg.cancel_scope.cancel()

            tg.start_soon(cancel_when_ready)
            await run_workers([command(0, code)], spec, grace=5, reaper=None)
    expected = "".join(f"line {i}\n" for i in range(1000)) + "partial"
    assert (tmp_path / "attempt_0" / "0" / "stdout.log").read_text() == expected
    assert sink.text.count("[default0]:line ") == 1000
    assert "[default0]:partial\n" in sink.text


# --- terminal passthrough (pure: a terminal-like sink) ------------------------------------------------------------


class TerminalSink(Sink):
    """A console that says it is a terminal, with no size to ask (the agent assumes 80 columns)."""

    def isatty(self) -> bool:
        return True


def test_a_terminal_console_gets_output_as_it_arrives_prefixed_at_line_starts() -> None:
    tty = TerminalSink()
    spec = LogSpec(console=ConsoleSinks(stdout=tty, stderr=tty))
    bar, other = WorkerLog(spec, 0, 0), WorkerLog(spec, 1, 1)
    assert bar.terminal_size(Std.ERR) == (24, 80 - len("[default0]:"))
    bar.feed(Std.ERR, b"\r  0%|")
    assert tty.text == "\r[default0]:  0%|"  # a partial line, at once; a bare "\r" gets no prefix of its own
    bar.feed(Std.ERR, b"\r 50%|\xe2\x96")  # a character split across two reads
    bar.feed(Std.ERR, b"\x88")
    assert tty.text.endswith("\r[default0]: 50%|\u2588")
    other.feed(Std.OUT, b"epoch done\r\n")  # another worker ends the open line first; "\r\n" is one line end
    assert tty.text.endswith("\u2588\n[default1]:epoch done\r\n")
    bar.feed(Std.ERR, b"\r 90%|\nTraceback\n")
    assert tty.text.endswith("[default1]:epoch done\r\n\r[default0]: 90%|\n[default0]:Traceback\n")
    bar.feed(Std.ERR, b"ValueError: x")
    bar.finish(Std.ERR)  # the open last line is ended
    assert tty.text.endswith("[default0]:ValueError: x\n")
    assert bar.stderr_tail() == (" 90%|", "Traceback", "ValueError: x")  # what a terminal shows of each line


@pytest.mark.anyio
async def test_a_line_read_in_two_pieces_is_not_cut_by_another_workers_line() -> None:
    """A pseudo-terminal may hand one write(2) of a worker to the agent in two reads; another worker's output that
    arrives in between waits for the rest (as torchrun's workers' writes to one terminal never interleave)."""
    tty = TerminalSink()
    spec = LogSpec(console=ConsoleSinks(stdout=tty, stderr=tty))
    first, second = WorkerLog(spec, 0, 0), WorkerLog(spec, 1, 1)
    first.feed(Std.OUT, b"isatty")  # the first piece of "isatty 0 True\n"
    waited = anyio.Event()

    async def other() -> None:
        await second.turn(Std.OUT)
        second.feed(Std.OUT, b"isatty 1 True\n")
        waited.set()

    with anyio.fail_after(DEADLINE):
        async with anyio.create_task_group() as tg:
            tg.start_soon(other)
            while not spec.console.lines._ended:  # until it waits for its turn (the event it waits on exists)
                await anyio.lowlevel.checkpoint()
            assert tty.text == "[default0]:isatty"
            first.feed(Std.OUT, b" 0 True\n")  # the rest: the line ends, and the other worker's turn comes
            await waited.wait()
    assert tty.text == "[default0]:isatty 0 True\n[default1]:isatty 1 True\n"


def test_open_lines_belong_to_the_console_of_one_launch_not_to_the_process() -> None:
    """Each attempt's spec (``replace``) shares its launch's console and its open line; another launch's console,
    even on the same terminal, has its own (no process-global state)."""
    tty = TerminalSink()
    spec = LogSpec(console=ConsoleSinks(stdout=tty, stderr=tty))
    bar = WorkerLog(spec, 0, 0)
    bar.feed(Std.ERR, b"\r 10%|#")
    next_attempt = dataclasses.replace(spec, attempt=1)
    assert next_attempt.console.lines is spec.console.lines
    other_launch = LogSpec(console=ConsoleSinks(stdout=tty, stderr=tty))
    assert other_launch.console.lines is not spec.console.lines
    other = WorkerLog(other_launch, 1, 1)
    other.feed(Std.OUT, b"epoch done\n")  # does not end the bar's line: it is another launch's console
    bar.feed(Std.ERR, b"\r 20%|##")
    assert tty.text == "\r[default0]: 10%|#[default1]:epoch done\n\r[default0]: 20%|##"


@pytest.mark.anyio
async def test_a_line_that_stays_open_is_ended_for_another_workers_output() -> None:
    """A progress bar's line stays open for its whole run: another worker waits a tenth of a second at most."""
    tty = TerminalSink()
    spec = LogSpec(console=ConsoleSinks(stdout=tty, stderr=tty))
    bar, other = WorkerLog(spec, 0, 0), WorkerLog(spec, 1, 1)
    bar.feed(Std.ERR, b"\r 10%|#")
    with anyio.fail_after(DEADLINE):
        await other.turn(Std.OUT)  # the grace runs out: its turn comes although the bar's line is still open
    other.feed(Std.OUT, b"epoch done\n")
    assert tty.text == "\r[default0]: 10%|#\n[default1]:epoch done\n"
    await bar.turn(Std.ERR)  # no line is open now: no wait
    bar.feed(Std.ERR, b"\r 20%|##")
    assert tty.text.endswith("[default1]:epoch done\n\r[default0]: 20%|##")


def test_no_terminal_for_a_teed_stream_or_a_pipe_console(tmp_path: Path) -> None:
    tty = TerminalSink()
    teed = WorkerLog(LogSpec(log_dir=tmp_path, tee=Std.OUT, console=ConsoleSinks(stdout=tty, stderr=tty)), 0, 0)
    try:
        assert teed.terminal_size(Std.OUT) is None  # the file must get exactly what the worker wrote
        assert teed.terminal_size(Std.ERR) == (24, 69)
    finally:
        teed.close()
    assert WorkerLog(LogSpec(console=ConsoleSinks(stdout=Sink(), stderr=Sink())), 0, 0).terminal_size(Std.OUT) is None
    unprefixed = WorkerLog(LogSpec(line_prefix_template="", console=ConsoleSinks(stdout=tty, stderr=tty)), 0, 0)
    assert unprefixed.terminal_size(Std.OUT) == (24, 80)


def test_duplicate_filters_append_matching_lines_of_every_worker_to_one_file(tmp_path: Path) -> None:
    spec = LogSpec(log_dir=tmp_path, duplicate_stdout_filters=("loss", "nan"), console=ConsoleSinks(Sink(), Sink()))
    spec.prepare_attempt_dir([0, 1])
    logs = [WorkerLog(spec, rank, rank) for rank in (0, 1)]
    try:
        logs[0].feed(Std.OUT, b"step 1 loss 0.5\nstep 1 acc")
        logs[1].feed(Std.OUT, b"grad nan\n")
        logs[0].feed(Std.OUT, b" 0.9\n")
        logs[0].feed(Std.ERR, b"loss on stderr is not filtered\n")
    finally:
        for log in logs:
            log.close()
    path = spec.filtered_path(Std.OUT)
    assert path is not None
    assert path.read_text() == "[default0]:step 1 loss 0.5\n[default1]:grad nan\n"
    assert spec.filtered_path(Std.ERR) is not None
    assert not spec.filtered_path(Std.ERR).exists()  # type: ignore[union-attr]
    with pytest.raises(ConfigurationError, match="empty string"):
        LogSpec(duplicate_stderr_filters=("",))


# --- --logs-specs: a custom torch LogsSpecs found through its entry point --------------------------------------

FLAT_LOGS_SPECS = '''
import dataclasses
import json
import os
import subprocess
from torch.distributed.elastic.multiprocessing.api import LogsDest, LogsSpecs


class FlatLogsSpecs(LogsSpecs):
    """Every rank's files side by side in <log_dir>/flat_<attempt>/; only rank 0's stdout teed to the console."""

    @property
    def root_log_dir(self):
        return str(self._root_log_dir)

    def reify(self, envs):
        where = os.path.join(self._root_log_dir, "flat_" + envs[0]["TORCHELASTIC_RESTART_COUNT"])
        os.makedirs(where, exist_ok=True)
        path = {r: os.path.join(where, "rank" + env["RANK"]) for r, env in envs.items()}
        for r, env in envs.items():
            env["TORCHELASTIC_ERROR_FILE"] = path[r] + ".json"
        return LogsDest(
            stdouts={r: p + ".out" for r, p in path.items()},
            stderrs={r: p + ".err" for r, p in path.items()},
            tee_stdouts={0: path[0] + ".out"},
            error_files={r: p + ".json" for r, p in path.items()},
        )
'''

FLAT_WORKER = """
import os, sys, time
from torch.distributed.elastic.multiprocessing.errors import record

@record
def main():
    rank = os.environ["RANK"]
    print(f"out of rank {rank}", flush=True)
    print(f"err of rank {rank}", file=sys.stderr, flush=True)
    printed = os.path.join(os.path.dirname(__file__), "rank0-printed")
    if rank == "0":
        open(printed, "w").close()
    else:
        while not os.path.exists(printed):  # rank 0's lines are out before the crash stops it
            time.sleep(0.01)
        raise RuntimeError("boom in rank 1")

main()
"""


@pytest.mark.torch
def test_a_registered_logs_specs_decides_where_worker_logs_go(tmp_path: Path) -> None:
    plugin = tmp_path / "plugin"
    (plugin / "flatlogs-1.0.dist-info").mkdir(parents=True)
    (plugin / "flatlogs-1.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: flatlogs\nVersion: 1.0\n")
    (plugin / "flatlogs-1.0.dist-info" / "entry_points.txt").write_text(
        "[torchrun.logs_specs]\nflat = flatlogs:FlatLogsSpecs\n"
    )
    (plugin / "flatlogs.py").write_text(FLAT_LOGS_SPECS)
    (tmp_path / "worker.py").write_text(FLAT_WORKER)
    logs = tmp_path / "logs"
    done = subprocess.run(
        [sys.executable, "-m", "aelastic", "run", "--nproc-per-node", "2", "--max-restarts", "0",
         "--log-dir", str(logs), "--logs-specs", "flat", str(tmp_path / "worker.py")],
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(plugin), os.environ.get("PYTHONPATH", "")])},
        capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    flat = logs / "flat_0"
    assert (flat / "rank0.out").read_text() == "out of rank 0\n"
    assert (flat / "rank1.out").read_text() == "out of rank 1\n"
    assert "err of rank 1" in (flat / "rank1.err").read_text()
    assert "RuntimeError: boom in rank 1" in (flat / "rank1.err").read_text()
    assert "[default0]:out of rank 0" in done.stdout  # teed
    assert "out of rank 1" not in done.stdout  # redirected only
    assert "err of rank" not in done.stderr
    # The worker's error file is where the spec put it, and the failure report read it from there.
    assert json.loads((flat / "rank1.json").read_text())["message"]["message"] == "RuntimeError: boom in rank 1"
    assert "error_file: " + str(flat / "rank1.json") in done.stderr, done.stderr
    assert not list(logs.glob("*/attempt_0"))  # nothing in aelastic's own layout


def test_an_unknown_logs_specs_name_is_refused_before_anything_starts() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "aelastic", "run", "--logs-specs", "nosuch", "-m", "json.tool"],
        capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert done.returncode == 2
    assert "--logs-specs 'nosuch': no entry point of that name in the group 'torchrun.logs_specs'" in done.stderr
