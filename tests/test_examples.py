"""Every example under ``examples/`` run as its docstring (and the README) says, asserting on what it prints.

The examples run as subprocesses (the notebook in a real Jupyter kernel), so these tests are synchronous: they
wait on each process's output file with a deadline and a short bounded poll, as a user watching a terminal would.
Every process a test starts is SIGKILLed at teardown, with any process whose command line mentions the test's
``tmp_path`` (workers of the training runs); the tests that cancel assert themselves that no worker survived.
"""

from __future__ import annotations

import math
import os
import random
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import suppress
from pathlib import Path

import pytest
from test_agent_e2e import alive, free_port, kill_all_mentioning

pytestmark = pytest.mark.torch

DEADLINE = 120.0  # generous: torch workers on a small, shared machine
ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
AELASTIC = str(Path(sys.executable).with_name("aelastic"))  # the console script, as the README runs it
PREFIX = r"^(?:\[\w+\]:)?"  # the agent's console prefix ([default0]:) on worker lines


def as_from_a_shell() -> None:
    """In the child, before exec: SIGINT at its default, as an interactive shell starts a command. A test run started
    in the background (``cmd &`` without job control, as CI may) has SIGINT ignored, every child inherits that, and
    Python then installs no KeyboardInterrupt handler: asyncio.run would ignore the Ctrl-C the tests send."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class Proc:
    """A command with stdout and stderr in one file, started from the repository root as a shell starts it."""

    def __init__(self, args: list[str | os.PathLike[str]], log: Path) -> None:
        self.log = log
        with log.open("wb") as f:
            self.popen = subprocess.Popen(
                [str(a) for a in args], cwd=ROOT, stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1"}, preexec_fn=as_from_a_shell,
            )  # fmt: skip

    @property
    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait(self) -> int:
        try:
            return self.popen.wait(DEADLINE)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{self.popen.args} still running after {DEADLINE} s:\n{self.output}") from None

    def wait_for(self, pattern: str, count: int = 1) -> list[re.Match[str]]:
        """Wait until the output holds ``count`` lines matching ``pattern``; fail early if the process exits."""
        deadline = time.monotonic() + DEADLINE
        while True:
            exited = self.popen.poll() is not None  # read the output after the exit check: nothing is missed
            found = list(re.finditer(pattern, self.output, re.M))
            if len(found) >= count:
                return found
            if exited or time.monotonic() > deadline:
                found_text = f"{len(found)} of {count} lines matching {pattern!r}"
                raise AssertionError(f"{found_text} (exit code {self.popen.poll()}):\n{self.output}")
            time.sleep(0.05)  # a line appearing in a file has no event to wait on: a bounded poll


Start = Callable[..., Proc]


@pytest.fixture
def start(tmp_path: Path) -> Iterator[Start]:
    procs: list[Proc] = []

    def start(*args: str | os.PathLike[str]) -> Proc:
        proc = Proc(list(args), tmp_path / f"proc{len(procs)}.log")
        procs.append(proc)
        return proc

    try:
        yield start
    finally:
        for proc in procs:
            with suppress(ProcessLookupError):
                proc.popen.kill()
            proc.popen.wait()
        kill_all_mentioning(str(tmp_path))


# --- allreduce.py -----------------------------------------------------------------------------------------------------


def test_allreduce(start: Start) -> None:
    proc = start(AELASTIC, "run", "--standalone", "--nproc-per-node", "2", "examples/allreduce.py")
    assert proc.wait() == 0, proc.output
    found = re.findall(PREFIX + r"rank (\d) world_size 2 tensor\(\[2\]\)$", proc.output, re.M)
    assert sorted(found) == ["0", "1"], proc.output


# --- store_demo.py ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_store_demo(start: Start, backend: str) -> None:
    proc = start(sys.executable, "examples/store_demo.py", backend)
    assert proc.wait() == 0, proc.output
    lines = proc.output.splitlines()
    assert re.fullmatch(r"store listening on localhost:\d+", lines[0]), lines
    assert lines[1:3] == ["get greeting -> hello", "add counter +5 -> 5"]
    assert re.fullmatch(r"waiter woke after \d+\.\d ms with b'arrived'", lines[3]), lines  # woken by the set
    assert re.fullmatch(r"server statistics: ServerStatistics\(.*keys=3, queued=0, waiters=0.*\)", lines[4]), lines


# --- elastic_ddp/ -----------------------------------------------------------------------------------------------------

TRAIN = EXAMPLES / "elastic_ddp" / "train.py"
LOSS_FORMAT = r"(\d+\.\d{6})"


def step_lines(output: str) -> list[tuple[int, str, int]]:
    """Rank 0's ``step S loss L world_size W`` lines, in order: (step, loss as printed, world size)."""
    lines = re.findall(PREFIX + rf"step (\d+) loss {LOSS_FORMAT} world_size (\d+)$", output, re.M)
    return [(int(step), loss, int(world)) for step, loss, world in lines]


def resumed_lines(output: str, world_size: int) -> list[tuple[int, int, str, int]]:
    """Every rank's ``resumed`` line: (rank, step, loss, restart count)."""
    pattern = PREFIX + rf"rank (\d) of {world_size}: resumed from step (\d+), loss {LOSS_FORMAT} \(restart (\d+)\)$"
    return sorted((int(r), int(s), loss, int(n)) for r, s, loss, n in re.findall(pattern, output, re.M))


WARM = r"^.* local_rank \d started in its standby \(pid \d+\)$"  # the agent's debug line at each warm start


def crash_resume(start: Start, checkpoint: Path, *flags: str) -> str:
    """The README's crash-resume command (with ``flags``), its checkpoint at ``checkpoint``: its output, exit 0."""
    proc = start(AELASTIC, "--log-level", "DEBUG", "run", "--standalone", "--nproc-per-node", "2",
                 "--max-restarts", "1", *flags,
                 "examples/elastic_ddp/train.py", "--crash-at-step", "12", "--checkpoint", checkpoint)  # fmt: skip
    assert proc.wait() == 0, proc.output
    return proc.output


def test_elastic_ddp_resumes_from_its_checkpoint_after_a_worker_crash(start: Start, tmp_path: Path) -> None:
    """The README command, with the checkpoint in tmp_path: rank 1 SIGKILLs itself at step 12 of the first attempt;
    the agent restarts both workers, which resume from the step-10 checkpoint and repeat step 11 exactly."""
    checkpoint = tmp_path / "ckpt.pt"
    output = crash_resume(start, checkpoint)
    assert not re.search(WARM, output, re.M), output
    assert re.search(PREFIX + r"rank 1: crashing at step 12 \(SIGKILL\)$", output, re.M), output
    steps = step_lines(output)
    assert [step for step, _, _ in steps] == [*range(1, 12), *range(11, 41)], output  # 1..11, crash, 11..40
    assert {world for _, _, world in steps} == {2}
    first, second = {s: loss for s, loss, _ in steps[:11]}, {s: loss for s, loss, _ in steps[11:]}
    assert resumed_lines(output, 2) == [(0, 10, first[10], 1), (1, 10, first[10], 1)], output
    assert second[11] == first[11]  # the restored model and optimizer repeat the lost step to the last digit
    assert float(second[40]) < float(first[1]) / 5  # and training went on from there
    assert re.search(PREFIX + rf"finished at step 40; checkpoint {re.escape(str(checkpoint))}$", output, re.M)


def test_elastic_ddp_crash_resume_with_prewarm_has_the_same_losses(start: Start, tmp_path: Path) -> None:
    """The same crash and resume cold and with --prewarm: every worker of both attempts started in a standby, and
    the two runs print the same steps with the same losses, to the last digit."""
    cold = crash_resume(start, tmp_path / "cold.pt")
    warm = crash_resume(start, tmp_path / "warm.pt", "--prewarm")
    assert len(re.findall(WARM, warm, re.M)) == 4, warm  # 2 workers x 2 attempts
    assert step_lines(warm) == step_lines(cold), (cold, warm)
    assert [line[:3] for line in resumed_lines(warm, 2)] == [line[:3] for line in resumed_lines(cold, 2)]


# Runs train.py with every worker of a two-worker world held at step 8, so that the first node cannot finish before
# the second one joins; the agent's membership restart is what releases them.
HOLD_SMALL_WORLD = """
import os, sys, time
sys.path.insert(0, sys.argv.pop(1))
import train

make_batch = train.make_batch

def make_batch_or_hold(step, batch_size):
    if step == 8 and os.environ["WORLD_SIZE"] == "2":
        print(f"rank {os.environ['RANK']}: holding at step 8 until the world grows", flush=True)
        time.sleep(600)
    return make_batch(step, batch_size)

train.make_batch = make_batch_or_hold
train.main()
"""


@pytest.mark.parametrize("prewarm", [False, True], ids=["cold", "prewarm"])
def test_elastic_ddp_scales_up_when_a_second_node_joins(start: Start, tmp_path: Path, prewarm: bool) -> None:
    """One agent (--nnodes 1:2) trains in a world of 2; a second agent joins mid-training; the two re-rendezvous
    into a world of 2 nodes x 2 workers, resume from the step-5 checkpoint with the same losses, and finish.
    With --prewarm, every worker of the world of 4 starts in a standby."""
    hold = tmp_path / "hold_small_world.py"
    hold.write_text(HOLD_SMALL_WORLD)
    checkpoint = tmp_path / "ckpt.pt"
    agent = [AELASTIC, "--log-level", "DEBUG", "run", "--nnodes", "1:2", "--nproc-per-node", "2",
             "--max-restarts", "0", *(["--prewarm"] if prewarm else []),
             "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", "scale-up",
             "--rdzv-conf", "last_call_timeout=1",
             hold, TRAIN.parent, "--checkpoint", checkpoint]  # fmt: skip
    first = start(*agent)
    first.wait_for(PREFIX + r"rank \d: holding at step 8 until the world grows$", count=2)
    second = start(*agent)
    assert first.wait() == 0, first.output
    assert second.wait() == 0, second.output
    both = first.output + second.output

    small = {step: loss for step, loss, world in step_lines(first.output) if world == 2}
    assert sorted(small) == list(range(1, 8)), first.output
    big = [(step, loss) for step, loss, world in step_lines(both) if world == 4]
    assert [step for step, _ in big] == list(range(6, 41)), both  # resumed after the step-5 checkpoint
    # Both nodes run workers of the new world (max_restarts 0: a membership restart spends no failure budget).
    assert resumed_lines(both, 4) == [(rank, 5, small[5], 0) for rank in range(4)], both
    assert resumed_lines(first.output, 4)
    assert resumed_lines(second.output, 4)
    # The loss curve does not depend on the world size: steps 6 and 7 repeat in the world of 4 (up to rounding).
    for step, loss in big[:2]:
        assert math.isclose(float(loss), float(small[step]), rel_tol=1e-4), (step, loss, small[step])
    assert re.search(PREFIX + r"finished at step 40; ", both, re.M)
    # Warm: the first node's two attempts and the second node's one; cold: none.
    assert len(re.findall(WARM, both, re.M)) == (6 if prewarm else 0), both


# --- checkpoint/ ------------------------------------------------------------------------------------------------------


def test_in_memory_checkpoints_lose_only_the_step_a_crash_interrupted(start: Start) -> None:
    """The README command: rank 1 SIGKILLs itself at step 25; both workers restore step 24 from their agent's memory
    (rank 0 in its own process: the function is restartable, only rank 1 is replaced) and the run prints the same
    steps, with the same losses, as a run without the crash."""
    crash_at_25_restores_24(start, [AELASTIC, "run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
                                    "--prewarm", "examples/checkpoint/train.py"])  # fmt: skip


def crash_at_25_restores_24(start: Start, command: list[str]) -> None:
    """``command`` (examples/checkpoint on two workers) with and without ``--crash-at-step 25``: both ranks restore
    step 24 from memory, rank 0 in its own process, and the two runs print the same steps with the same losses."""
    crashed = start(*command, "--crash-at-step", "25")
    assert crashed.wait() == 0, crashed.output
    clean = start(*command)
    assert clean.wait() == 0, clean.output
    started = dict(re.findall(PREFIX + r"rank (\d) of 2 \(pid (\d+)\): starts$", crashed.output, re.M))
    restored = re.findall(
        PREFIX + r"rank (\d) of 2 \(pid (\d+)\): restored step (\d+) from (\w+) \(restart 1\)$", crashed.output, re.M
    )
    assert sorted((rank, step, source) for rank, _, step, source in restored) == [
        ("0", "24", "memory"), ("1", "24", "memory")], crashed.output  # fmt: skip
    pids = {rank: pid for rank, pid, _, _ in restored}
    assert pids["0"] == started["0"], crashed.output  # the survivor kept its process
    assert pids["1"] != started["1"], crashed.output  # the crashed worker was replaced
    steps = step_lines(crashed.output)
    assert [step for step, _, _ in steps] == [*range(1, 25), *range(25, 41)], crashed.output  # nothing done twice
    assert steps == step_lines(clean.output)


# --- lightning/, hf_trainer/, hf_accelerate/: the frameworks' integrations ----------------------------------------


def with_a_fault_and_without(start: Start, example: str, crash: int) -> tuple[Proc, Proc]:
    """``example`` on one node of two workers, rank 1 raising at step ``crash`` of the first attempt, then without a
    fault; both ended with 0."""
    command = [AELASTIC, "run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "1", example]
    crashed = start(*command, "--crash-at-step", str(crash))
    assert crashed.wait() == 0, crashed.output
    clean = start(*command)
    assert clean.wait() == 0, clean.output
    assert f"RuntimeError: a fault at step {crash}" in crashed.output, crashed.output
    return crashed, clean


def assert_same_final_parameters(crashed: Proc, clean: Proc, last: int) -> None:
    final = PREFIX + rf"final parameters (\w+) after step {last}$"
    assert re.findall(final, crashed.output, re.M) == re.findall(final, clean.output, re.M) != [], crashed.output


FRAMEWORKS = [  # (example, the framework it needs, the fault's step, the step restored, the last step)
    # The Trainers count a step once its optimizer step is done: the one before the fault's is saved as the fault's.
    pytest.param("examples/lightning/train.py", "lightning", 30, 30, 60, id="lightning"),
    pytest.param("examples/lightning/fabric.py", "lightning", 25, 24, 59, id="fabric"),
    pytest.param("examples/hf_trainer/train.py", "transformers", 20, 20, 40, id="hf_trainer"),
    pytest.param("examples/hf_accelerate/train.py", "accelerate", 20, 19, 39, id="accelerate"),
]


@pytest.mark.parametrize(("example", "framework", "crash", "restored_step", "last"), FRAMEWORKS)
def test_a_framework_keeps_its_survivor_restores_from_memory_and_ends_with_the_fault_free_model(
    start: Start, example: str, framework: str, crash: int, restored_step: int, last: int
) -> None:
    """A Lightning or Hugging Face Trainer with the integration's callback, or a Fabric or Accelerate loop
    (``save_state``/``load_state``), each under ``restartable``: rank 1 raises at step ``crash`` of the first
    attempt; rank 0 keeps its process (a new Trainer, or the framework's launch, starts the next round's process
    group in it), the replacement starts cold, both restore the last step saved from memory (through the Trainer's
    own resume: the batches already trained skipped, the random generators restored, the HF examples' dropout on),
    and the final parameters are bitwise a fault-free run's."""
    pytest.importorskip(framework)
    crashed, clean = with_a_fault_and_without(start, example, crash)
    started = dict(re.findall(PREFIX + r"rank (\d) \(pid (\d+)\): starts$", crashed.output, re.M))
    restored = re.findall(PREFIX + r"rank (\d) \(pid (\d+)\): restored step (\d+) from (.+)$", crashed.output, re.M)
    assert sorted(rank for rank, *_ in restored) == ["0", "1"], crashed.output
    assert {(step, source) for _, _, step, source in restored} == {(str(restored_step), "memory")}, crashed.output
    assert not re.search(PREFIX + ".*restored", clean.output, re.M), clean.output
    pids = {rank: pid for rank, pid, *_ in restored}
    assert pids["0"] == started["0"], crashed.output  # the survivor kept its process
    assert pids["1"] != started["1"], crashed.output  # the failed one was replaced
    incident = rf"incident 1 .*start \S+ s \(1 kept, 1 cold\), restore \S+ s \(step {restored_step} from memory\)"
    assert re.search(incident, crashed.output), crashed.output
    assert_same_final_parameters(crashed, clean, last)
    assert not list(Path("/dev/shm").glob("aelastic-hf-*")), "a restored checkpoint's files were left behind"
    assert "There were missing keys" not in crashed.output, crashed.output  # the HF Trainer's, of a partial load


def test_a_model_the_hf_trainer_makes_anew_gets_the_weights_restored_into_the_one_before() -> None:
    """A Trainer with ``model_init`` makes its model again as training starts, after the restore copied the weights
    into the model the callback saw: the callback hands them on when training begins."""
    pytest.importorskip("transformers")
    import torch

    from aelastic.integrations.huggingface import InMemoryCheckpoint

    memory = InMemoryCheckpoint()
    restored, anew = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    memory.on_init_end(None, None, None, model=restored)
    memory._restored_into = restored  # what resume_path did, without an agent to restore from
    memory.on_train_begin(None, None, None, model=anew)
    assert all(
        torch.equal(a, b) for a, b in zip(anew.state_dict().values(), restored.state_dict().values(), strict=True)
    )
    with torch.no_grad():
        anew.weight.zero_()
    memory.on_train_begin(None, None, None, model=anew)  # once only: a later training's model is its own
    assert not anew.weight.any()


def test_the_lightning_integration_without_lightning_says_which_extra_to_install() -> None:
    blocked = "import sys; sys.modules['lightning'] = None; import aelastic.integrations.lightning"
    result = subprocess.run([sys.executable, "-c", blocked], capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == (
        "ImportError: aelastic.integrations.lightning needs PyTorch Lightning: pip install 'aelastic[lightning]'"
    ), result.stderr


def test_the_hugging_face_integration_without_transformers_says_which_extra_to_install() -> None:
    blocked = "import sys; sys.modules['transformers'] = None; import aelastic.integrations.huggingface"
    result = subprocess.run([sys.executable, "-c", blocked], capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == (
        "ImportError: aelastic.integrations.huggingface needs Hugging Face transformers: "
        "pip install 'aelastic[huggingface]'"
    ), result.stderr


# --- fsdp2/train.py ---------------------------------------------------------------------------------------------------

FSDP2 = ["examples/fsdp2/train.py"]
FSDP2_FINAL = PREFIX + r"final parameters (\w+) after step (\d+)$"
FSDP2_RESTORED = PREFIX + r"rank (\d) of (\d): restored step (\d+) from (.+)$"


LOSS_LINE = PREFIX + r"step (\d+) loss (\d+\.\d+)$"


def losses(output: str) -> dict[int, float]:
    """Rank 0's loss of each step."""
    return {int(step): float(loss) for step, loss in re.findall(LOSS_LINE, output, re.M)}


def test_fsdp2_restores_its_shards_from_memory_and_ends_with_the_fault_free_model(start: Start) -> None:
    """examples/fsdp2: rank 1 raises at a random step of the first attempt; both ranks restore the last step every
    rank saved through ``dcp.save(..., use_collectives=False)`` (or ``dcp.async_save``, one save in flight; or
    ``dcp.save`` with DCP's collectives) from their agent's memory, and the final parameters are bitwise a fault-free
    run's."""
    crash = random.Random().randrange(3, 25)
    print("the fault's step:", crash)
    command = [AELASTIC, "run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "1", *FSDP2, "--steps", "30"]
    runs = {"sync": start(*command, "--crash-at-step", str(crash)),
            "async": start(*command, "--crash-at-step", str(crash), "--async-save"),
            "collectives": start(*command, "--crash-at-step", str(crash), "--save-collectives")}  # fmt: skip
    for run in runs.values():
        assert run.wait() == 0, run.output
    clean = start(*command)
    assert clean.wait() == 0, clean.output
    for mode, run in runs.items():
        restored = {(rank, world, int(step), source) for rank, world, step, source in
                    re.findall(FSDP2_RESTORED, run.output, re.M)}  # fmt: skip
        # async: the save of the step before the fault may still have been in flight
        steps = {crash - 2, crash - 1} if mode == "async" else {crash - 1}
        assert {(rank, world) for rank, world, *_ in restored} == {("0", "2"), ("1", "2")}, run.output
        assert {step for _, _, step, _ in restored} <= steps, run.output
        assert len({step for _, _, step, _ in restored}) == 1, run.output
        assert {source for *_, source in restored} == {"memory"}, run.output
        assert re.findall(FSDP2_FINAL, run.output, re.M) == re.findall(FSDP2_FINAL, clean.output, re.M) != []
    assert not re.search(FSDP2_RESTORED, clean.output, re.M), clean.output


def test_fsdp2_a_lost_node_s_shards_restore_from_the_replica_resharded_and_the_loss_curve_goes_on(
    start: Start, tmp_path: Path
) -> None:
    """examples/fsdp2 on two nodes of two ranks (``--nnodes 1:2``): node 1's agent is killed for good once node 0
    holds the replica of its ranks; node 0's two ranks restore the four ranks' shards (their own from memory, the
    lost ones from the replica), resharded by DCP to a world of 2, and no file of ``--checkpoint-dir`` is read. A
    new node then joins: its ranks fetch the world of 2's shards from node 0, resharded to 4. Every step's loss is the
    fault-free 4-rank run's (the same global batch each step, whatever the world)."""
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, multi_tenant=True, wait_for_workers=False)
    flags = ["--nnodes", "1:2", "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
             f"127.0.0.1:{store.port}", "--rdzv-id", "fsdp2", "--rdzv-conf",
             "last_call_timeout=1,keep_alive_interval=0.5,keep_alive_max_attempt=2", "--max-restarts", "3",
             "--checkpoint-dir", str(tmp_path / "checkpoints")]  # fmt: skip
    train = [*FSDP2, "--steps", "300", "--step-time", "0.1"]
    debug = ["env", "LOGLEVEL=DEBUG", AELASTIC]  # node 0 logs the replicas it holds
    node0 = start(*debug, "run", *flags, *train)
    node0.wait_for(r"rendezvous fsdp2 round 0 complete: \S+ is rank 0 of 1$")  # node 0 is group rank 0
    node1 = start(AELASTIC, "run", *flags, *train)
    node0.wait_for(r"holding rank 3's step ([5-9]|\d\d+), a replica")  # from step 5 on: node 1's ranks trained
    node1.popen.kill()  # the node's loss: its agent SIGKILLed, its workers with it (parent-death signal)
    shrunk = node0.wait_for(FSDP2_RESTORED, 2)
    assert sorted((m[1], m[2]) for m in shrunk) == [("0", "2"), ("1", "2")], node0.output
    # Rank 0's new shards are the lost world's ranks 0 and 1, node 0's own; rank 1's, ranks 2 and 3, in the replica
    # (its replicated items from its own saved rank 1: saved without collectives, each rank wrote them).
    assert {(m[1], m[4]) for m in shrunk} == {("0", "memory"), ("1", "memory, replica from 127.0.0.1")}, node0.output
    node2 = start(AELASTIC, "run", *flags, *train)
    grown = node2.wait_for(FSDP2_RESTORED, 2)
    assert {m[2] for m in grown} == {"4"}, node2.output
    assert len({m[1] for m in grown}) == 2, node2.output
    assert len({m[4] for m in grown}) == 1, node2.output  # the world of 2's shards, fetched from node 0
    assert re.fullmatch(r"replica from 127\.0\.0\.1:\d+", grown[0][4]), node2.output
    assert node0.wait() == 0, node0.output
    assert node2.wait() == 0, node2.output
    for world in (4, 2):
        restores = rf"this round restores step \d+ \(world {world}\) from memory"
        assert re.search(restores, node0.output), node0.output
    assert "from the checkpoint directory" not in node0.output + node2.output
    assert "from disk" not in node0.output + node2.output
    reference = start(AELASTIC, "run", "--standalone", "--nproc-per-node", "4", *FSDP2, "--steps", "300")
    assert reference.wait() == 0, reference.output
    expected = losses(reference.output)
    printed = [(int(step), float(loss)) for output in (node0.output, node2.output)
               for step, loss in re.findall(LOSS_LINE, output, re.M)]  # fmt: skip
    assert {step for step, _ in printed} == set(range(300)), node0.output
    wrong = [(step, loss, expected[step]) for step, loss in printed if loss != pytest.approx(expected[step], rel=1e-5)]
    assert not wrong, wrong[:5]


# --- asyncio_orchestrator.py, trio_orchestrator.py --------------------------------------------------------------------

ORCHESTRATORS = ["asyncio_orchestrator.py", "trio_orchestrator.py"]
STARTED = r"^all 4 workers have started \(pids ([\d ]+)\)$"


def exists(pid: int) -> bool:
    """Whether ``pid`` exists at all (a zombie counts: nobody reaped it)."""
    return os.path.exists(f"/proc/{pid}")


@pytest.mark.parametrize("script", ORCHESTRATORS)
def test_orchestrator_runs_a_sweep_of_two_jobs(start: Start, script: str) -> None:
    proc = start(sys.executable, f"examples/{script}", "--steps", "20")
    assert proc.wait() == 0, proc.output
    output = proc.output
    assert re.search(r"^progress endpoint on 127\.0\.0\.1:\d+$", output, re.M), output
    for lr in ("0.01", "0.1"):  # the workers' progress, streamed to the orchestrator's endpoint while it waits
        assert re.findall(rf"^lr={lr} step (\d+)/20 loss \d+\.\d+$", output, re.M) == ["10", "20"], output
    final = dict(re.findall(r"^lr=([\d.]+): final loss (\d+\.\d+) \(ranks \[0, 1\]\)$", output, re.M))
    assert sorted(final) == ["0.01", "0.1"], output
    assert float(final["0.1"]) < float(final["0.01"])
    assert re.search(r"^best learning rate: 0\.1$", output, re.M)


@pytest.mark.parametrize("script", ORCHESTRATORS)
def test_orchestrator_ctrl_c_cancels_both_jobs_and_leaves_no_worker(start: Start, script: str) -> None:
    proc = start(sys.executable, f"examples/{script}", "--steps", "1000000")
    [started] = proc.wait_for(STARTED)
    pids = [int(pid) for pid in started[1].split()]
    assert len(set(pids)) == 4
    assert all(alive(pid) for pid in pids)  # a million steps: both jobs are training now
    proc.popen.send_signal(signal.SIGINT)
    assert proc.wait() == 130, proc.output
    assert re.search(r"^cancelled \(interrupted\): 4 workers had reported, 0 still exist$", proc.output, re.M)
    assert not [pid for pid in pids if exists(pid)]
    assert "final loss" not in proc.output


@pytest.mark.parametrize("script", ORCHESTRATORS)
def test_orchestrator_time_budget_cancels_the_sweep(start: Start, script: str) -> None:
    proc = start(sys.executable, f"examples/{script}", "--steps", "1000000", "--cancel-after", "1.5")
    assert proc.wait() == 0, proc.output
    output = proc.output
    # How many workers reported within the budget depends on the machine's load; that none survives does not.
    budget_spent = r"^cancelled \(time budget of 1\.5 s spent\): \d workers had reported, 0 still exist$"
    assert re.search(budget_spent, output, re.M), output
    started = re.search(STARTED, output, re.M)
    assert started is None or not [pid for pid in map(int, started[1].split()) if exists(pid)]
    assert "final loss" not in output


# --- notebook.ipynb ---------------------------------------------------------------------------------------------------


def test_notebook_runs_a_cell_function_on_two_workers() -> None:
    """The notebook in a real Jupyter kernel (the venv's "python3"), where an event loop already runs."""
    import nbformat  # here: the other tests of this module run where Jupyter is not installed (tests/test_gpu.py)
    from nbclient import NotebookClient

    notebook = nbformat.read(EXAMPLES / "notebook.ipynb", as_version=4)
    client = NotebookClient(notebook, kernel_name="python3", timeout=int(DEADLINE),
                            resources={"metadata": {"path": str(EXAMPLES)}})  # fmt: skip
    client.execute()
    cells = {tag: cell for cell in notebook.cells for tag in cell.metadata.get("tags", [])}

    def stream(tag: str, name: str) -> str:
        return "".join(out.text for out in cells[tag].outputs if out.output_type == "stream" and out.name == name)

    assert stream("results", "stdout") == (
        "0 {'rank': 0, 'world_size': 2, 'total': 30.0}\n1 {'rank': 1, 'world_size': 2, 'total': 30.0}\n"
    )
    [restarted] = [out for out in cells["restart"].outputs if out.output_type == "execute_result"]
    assert restarted.data["text/plain"] == (
        "{0: {'rank': 0, 'attempt': 1, 'value': 42},\n 1: {'rank': 1, 'attempt': 1, 'value': 42}}"
    )
    assert "RuntimeError: worker 1 fails in the first attempt" in stream("restart", "stderr")  # the first attempt's
    assert stream("failure", "stdout") == "rank 1 failed: RuntimeError: worker 1 fails in the first attempt\n"
