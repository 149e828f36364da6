"""The fault suite's restartable worker: training that keeps its process across rounds (``aelastic.worker.
restartable``), with an in-memory checkpoint every step, and faults injected on a schedule.

argv: OUT. Environment (set on the agent, inherited): FAULTS_HOST names the host, FAULTS_STEP_PAUSE is the pause after
each step, FAULTS_STEPS the steps to train, FAULTS_SCHEDULE the path of a JSON list of faults ``[step, rank, kind]``
(kind: raise, kill, exit, sleep, hold, busy; the step ``"go"``: the step ``OUT/go`` holds, or, if it is empty, the
first step once it exists), each injected once in the whole job (a marker file, created exclusively, says it was),
during its step: after the gradients' all-reduce, before the optimizer's step, so the other ranks complete the step
and save it, and the job must restore the step before. A ``sleep`` is an hour's ``time.sleep`` (a signal ends it: the
agent's abort does); a ``hold`` the same with the abort's wake signal blocked (a C call that no signal ends). A
``busy`` rank computes for FAULTS_BUSY seconds (default 20) and goes on; a ``write`` rank writes 24 MiB to storage
that takes 1 MiB/s (a MiB, then the rest of the second asleep: its CPU nearly idle) and goes on. A ``stop``
(a step every rank knows: a number, or "go" with the step in ``OUT/go``) happens inside a collective: every rank
all-reduces 16 MiB at that step, and the faulting rank SIGSTOPs itself 10 ms into it. A fourth field, ``[step, rank,
kind, index]``, holds the fault back until fault ``index`` has happened (its record exists): two ranks' faults at the
same step, in that order whatever the machine's load.

Each call of the training function reports ``start-<pid>-<call>.json`` (its rank, world, the step it starts at, what
it loaded); each step replaces ``progress-<pid>.json``; a fault writes ``fault-<index>.json`` just before it
happens; rank 0 writes ``final.json`` (a digest of the parameters) at the end.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

import aelastic.checkpoint as ckpt
from aelastic.worker import restartable

OUT = Path(sys.argv[1])
HOST_DIR = OUT / os.environ["FAULTS_HOST"]
STEP_PAUSE = float(os.environ["FAULTS_STEP_PAUSE"])
STEPS = int(os.environ["FAULTS_STEPS"])
BUSY = float(os.environ.get("FAULTS_BUSY", "20"))  # the seconds of a "busy" fault
SCHEDULE = json.loads(Path(os.environ["FAULTS_SCHEDULE"]).read_text()) if os.environ.get("FAULTS_SCHEDULE") else []
calls = 0


def write(target: Path, event: str, **fields: object) -> None:
    """``target``, replaced atomically with a JSON record of ``event``."""
    record = {"event": event, "host": os.environ["FAULTS_HOST"], "pid": os.getpid(), "time": time.time(), **fields}
    tmp = target.with_name(f".{target.name}.tmp")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, target)


def fault(step: int, rank: int) -> None:
    for index, (at, who, kind, *after) in enumerate(SCHEDULE):
        due = at == step or (at == "go" and went(step))
        if kind == "stop" and due:
            stop_in_collective(index, step, rank, who)
        if not due or who != rank or kind == "stop" or not once(index):
            continue
        while after and not (OUT / f"fault-{after[0]}.json").exists():
            time.sleep(0.01)  # another process's file: a bounded poll (the test's deadline bounds it)
        write(OUT / f"fault-{index}.json", "fault", step=step, rank=rank, kind=kind)
        if kind == "raise":
            raise RuntimeError(f"fault {index} at step {step}")
        if kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if kind == "hold":
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGURG})  # an exception raised into it waits for it
        if kind in ("sleep", "hold"):
            time.sleep(3600)
        if kind == "busy":
            until = time.monotonic() + BUSY
            while time.monotonic() < until:  # a long step: CPU time moves, the others wait in the collective
                pass
            continue
        if kind == "write":
            with (HOST_DIR / f"checkpoint-{index}.bin").open("wb") as slow:
                for _ in range(24):  # a checkpoint to slow storage: bytes move, the CPU barely does
                    slow.write(bytes(1 << 20))
                    slow.flush()
                    time.sleep(1)
            continue
        os._exit(3)


def went(step: int) -> bool:
    """Whether the test said go for ``step``: ``OUT/go`` holds that step, or exists empty (any step from now)."""
    try:
        text = (OUT / "go").read_text().strip()
    except FileNotFoundError:
        return False
    return not text or int(text) == step


def once(index: int) -> bool:
    """Whether fault ``index`` is injected now: a marker file, created exclusively, says it was before."""
    try:
        os.close(os.open(OUT / f"fault-{index}.done", os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        return False
    return True


def stop_in_collective(index: int, step: int, rank: int, who: int) -> None:
    """Every rank all-reduces 16 MiB at the step of a ``stop``; rank ``who`` SIGSTOPs itself 10 ms into it (once)."""
    if rank == who and once(index):
        write(OUT / f"fault-{index}.json", "fault", step=step, rank=rank, kind="stop")
        threading.Timer(0.01, os.kill, (os.getpid(), signal.SIGSTOP)).start()
    dist.all_reduce(torch.zeros(1 << 22))


@restartable
def train() -> None:
    global calls
    calls += 1
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    state = {"model": model.state_dict(), "step": -1}
    restored = ckpt.load(into=state)
    if restored is not None:
        optimizer.load_state_dict(restored["optimizer"])
    loaded = ckpt.last_loaded()
    start = 0 if restored is None else restored["step"] + 1
    write(HOST_DIR / f"start-{os.getpid()}-{calls}.json", "start", call=calls, rank=rank, world=world, start=start,
          loaded=None if loaded is None else loaded._asdict())  # fmt: skip
    for step in range(start, STEPS):
        x = torch.randn(16, 32, generator=torch.Generator().manual_seed(step * 1000 + rank))
        loss = model(x).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        fault(step, rank)
        optimizer.step()
        ckpt.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}, step=step)
        write(HOST_DIR / f"progress-{os.getpid()}.json", "progress", rank=rank, world_size=world, step=step,
              call=calls)  # fmt: skip
        time.sleep(STEP_PAUSE)
    if rank == 0:
        digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
        write(OUT / "final.json", "final", digest=digest)
    dist.destroy_process_group()


if __name__ == "__main__":
    train()
