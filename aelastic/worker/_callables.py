"""Worker entry point for callables: ``python -m aelastic.worker._callables <payload_path> <result_path>``.

The agent writes ``(fn, args, kwargs)`` with cloudpickle (:func:`~aelastic.agent.callables.parent.write_payload`),
which pickles functions of ``__main__`` (a ``python -c`` program, a notebook cell) by value, so the worker needs
nothing it cannot import. The worker loads it, calls ``fn`` under :func:`~aelastic.worker._errorfile.record` (an
exception lands in ``TORCHELASTIC_ERROR_FILE`` and the worker exits 1 with its traceback on stderr), and writes the
return value to ``result_path`` (:func:`~aelastic.agent.callables.parent.read_result`), atomically: a result file
exists only when the call returned.

As torch's spawn does, the worker imports with the launching process's ``sys.path`` (recorded in the payload and
set before the function is unpickled), so a function of a module that the launcher found through its own path (a
module next to the launching script, a notebook's directory) imports in the worker too. The worker's own entries
follow the launcher's. Then the workers finish together (:mod:`aelastic.agent.finish`).

Besides the standard library it imports cloudpickle (the payload's format): no anyio, no torch.
"""

from __future__ import annotations

import os
import pickle
import sys
from collections.abc import Sequence
from pathlib import Path

import cloudpickle  # type: ignore[import-untyped]

from ._errorfile import record
from ._finish import FinishLine

__all__ = ["main"]


def _run(payload_path: str, result_path: str) -> None:
    launcher_path, call = pickle.loads(Path(payload_path).read_bytes())
    sys.path[:] = [*launcher_path, *(entry for entry in sys.path if entry not in launcher_path)]
    fn, args, kwargs = cloudpickle.loads(call)
    result = fn(*args, **kwargs)
    data = cloudpickle.dumps(result)
    tmp = Path(f"{result_path}.tmp{os.getpid()}")
    tmp.write_bytes(data)
    tmp.replace(result_path)


def main(argv: Sequence[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m aelastic.worker._callables <payload_path> <result_path>", file=sys.stderr)  # noqa: T201
        return 2
    finish = FinishLine.from_environment()
    record(_run)(argv[0], argv[1])
    if finish is not None:
        finish.arrive_and_wait(int(os.environ.get("LOCAL_RANK", "0")))
    _destroy_gloo_group()
    return 0


def _destroy_gloo_group() -> None:
    """Destroy a gloo default process group that the function left behind, while Python is still alive.

    A gloo worker thread may still hold the last collective's tensors when the function returns; if it drops them
    while the interpreter finalizes, it needs the GIL, Python ends the thread with a forced unwind and C++ aborts the
    worker ("terminate called without an active exception", SIGABRT). Destroying the group joins those threads
    first. Only a plain gloo group is touched (nothing else can run in this process any more, every local worker
    has returned); NCCL groups are left to the user, as torch leaves them.
    """
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return
    if dist.get_backend() == "gloo":
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
