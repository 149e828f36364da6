"""The agent's side of callable entry points: the payload a worker runs, its command line, its result; see
:mod:`aelastic.agent.callables` and the worker's side, :mod:`aelastic.worker._callables`."""

from __future__ import annotations

import os
import pickle
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import cloudpickle  # type: ignore[import-untyped]

from ...worker import _callables as child

__all__ = ["bootstrap_args", "read_result", "write_payload"]


def write_payload(
    path: str | os.PathLike[str],
    fn: Callable[..., object],
    args: Sequence[object] = (),
    kwargs: Mapping[str, object] | None = None,
) -> None:
    """Write the call ``fn(*args, **kwargs)`` for a worker to ``path`` (cloudpickle; ``__main__`` by value), with
    this process's ``sys.path``, which the worker takes before it unpickles the call."""
    call = cloudpickle.dumps((fn, tuple(args), dict(kwargs or {})))
    Path(path).write_bytes(pickle.dumps((list(sys.path), call)))


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
    return (python, "-m", child.__name__, os.fspath(payload_path), os.fspath(result_path))
