"""The same unmodified FileTimerClient script under torchrun and under ``aelastic run``, side by side.

``python -m benchmarks.timers``: rank 1 hangs inside ``expires(after=1, scope="train_step")`` on attempt 0, rank 0
sleeps with no timer (only its agent's stop can end it); ``--max-restarts 1``. For each launcher it prints the exit
status, the seconds to exit, whether the job completed on attempt 1, and whether rank 0 of attempt 0 outlived
its launcher (an orphan; it is killed afterwards).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SCRIPT = """\
import os, time
from pathlib import Path
import torch.distributed.elastic.timer as timer

timer.configure(timer.FileTimerClient(os.environ["TORCHELASTIC_TIMER_FILE"]))
rank, attempt = int(os.environ["RANK"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
out = Path(os.environ["OUT"])
if attempt == 0 and rank == 0:
    (out / "peer.pid").write_text(str(os.getpid()))
    time.sleep(120)
with timer.expires(after=1, scope="train_step"):
    if attempt == 0:
        time.sleep(3600)
(out / f"done_{rank}_{attempt}").write_text("")
"""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return state[state.rindex(")") + 2] != "Z"


def run_one(launcher: list[str]) -> dict[str, object]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        script = out / "timer_hang.py"
        script.write_text(SCRIPT)
        env = {**os.environ, "OUT": tmp, "TORCHELASTIC_ENABLE_FILE_TIMER": "1"}
        cmd = [*launcher, "--nproc-per-node", "2", "--max-restarts", "1", str(script)]
        start = time.monotonic()
        with (out / "launcher.log").open("wb") as log:  # a file, not a pipe: an orphan holding it cannot delay us
            returncode = subprocess.run(cmd, env=env, stdout=log, stderr=log, timeout=300, check=False).returncode
        elapsed = time.monotonic() - start
        peer = int((out / "peer.pid").read_text()) if (out / "peer.pid").exists() else None
        orphan = peer is not None and _alive(peer)
        if orphan:
            assert peer is not None
            os.kill(peer, signal.SIGKILL)
        return {
            "launcher": " ".join(Path(launcher[0]).name if i == 0 else a for i, a in enumerate(launcher)),
            "exit": returncode,
            "seconds": round(elapsed, 1),
            "completed_on_attempt_1": (out / "done_0_1").exists() and (out / "done_1_1").exists(),
            "rank0_orphaned": orphan,
        }


def main() -> int:
    bindir = Path(sys.executable).parent
    for launcher in ([str(bindir / "torchrun")], [sys.executable, "-m", "aelastic", "run"]):
        print(run_one(launcher), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
