"""Worker entry point for callables: ``python -m aelastic.agent._bootstrap <payload_path> <result_path>``.

The agent writes ``(fn, args, kwargs)`` with cloudpickle (:func:`write_payload`), which pickles functions of
``__main__`` (a ``python -c`` program, a notebook cell) by value, so the worker needs nothing it cannot import.
The worker loads it, calls ``fn`` under :func:`~aelastic.agent.errors.record` (an exception lands in
``TORCHELASTIC_ERROR_FILE`` and the worker exits 1 with its traceback on stderr), and writes the return value to
``result_path`` (:func:`read_result`), atomically: a result file exists only when the call returned.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import cloudpickle  # type: ignore[import-untyped]

from .errors import record

__all__ = ["bootstrap_args", "read_result", "write_payload"]


def write_payload(
    path: str | os.PathLike[str],
    fn: Callable[..., object],
    args: Sequence[object] = (),
    kwargs: Mapping[str, object] | None = None,
) -> None:
    """Write the call ``fn(*args, **kwargs)`` for a worker to ``path`` (cloudpickle; ``__main__`` by value)."""
    data = cloudpickle.dumps((fn, tuple(args), dict(kwargs or {})))
    Path(path).write_bytes(data)


def read_result(path: str | os.PathLike[str]) -> Any:
    """The value the worker's call returned.

    Raises:
        FileNotFoundError: the call did not return (the worker failed or was stopped).
    """
    return cloudpickle.loads(Path(path).read_bytes())


def bootstrap_args(
    payload_path: str | os.PathLike[str], result_path: str | os.PathLike[str], python: str = sys.executable
) -> tuple[str, ...]:
    """The worker command line that runs a payload written by :func:`write_payload`."""
    return (python, "-m", "aelastic.agent._bootstrap", os.fspath(payload_path), os.fspath(result_path))


def _run(payload_path: str, result_path: str) -> None:
    fn, args, kwargs = cloudpickle.loads(Path(payload_path).read_bytes())
    result = fn(*args, **kwargs)
    data = cloudpickle.dumps(result)
    tmp = Path(f"{result_path}.tmp{os.getpid()}")
    tmp.write_bytes(data)
    tmp.replace(result_path)


def main(argv: Sequence[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m aelastic.agent._bootstrap <payload_path> <result_path>", file=sys.stderr)  # noqa: T201
        return 2
    record(_run)(argv[0], argv[1])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
