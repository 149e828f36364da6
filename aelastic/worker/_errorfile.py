"""A worker's error file: :func:`record` writes its uncaught exception to ``TORCHELASTIC_ERROR_FILE`` in torch's
format, which the agent (ours or torch's) reads::

    {"message": {"message": "<Type>: <msg>", "extraInfo": {"py_callstack": "<traceback>", "timestamp": "<epoch s>"}}}

Standard library only: it runs in workers (the callable bootstrap, a user's ``main``) and in the launcher's own
process, whose error file a scheduler or an outer agent reads.
"""

from __future__ import annotations

import faulthandler
import functools
import json
import logging
import os
import time
import traceback
from collections.abc import Callable, Mapping
from typing import Any, Final, ParamSpec, TypeVar

__all__ = ["ERROR_FILE_ENV", "record", "write"]

ERROR_FILE_ENV: Final = "TORCHELASTIC_ERROR_FILE"

logger = logging.getLogger(__name__)

_P = ParamSpec("_P")
_R = TypeVar("_R")


def write(data: Mapping[str, Any]) -> None:
    """Write ``data`` to this process's error file, if it has one."""
    path = os.environ.get(ERROR_FILE_ENV)
    if not path:
        return
    try:
        with open(path, "w", encoding="utf-8") as fp:
            json.dump(data, fp)
    except OSError as exc:
        logger.warning("could not write the error file %s: %s", path, exc)


def _exception_data(exc: BaseException) -> Mapping[str, Any] | None:
    # An exception that carries a report of its own (the launcher's ChildFailedError: its root cause's error file,
    # as torch's record on torchrun's main writes it) says what to write; None writes nothing.
    own = getattr(exc, "error_file_data", None)
    if callable(own):
        data: Mapping[str, Any] | None = own()
        return data
    return {
        "message": {
            "message": f"{type(exc).__name__}: {exc}",
            "extraInfo": {"py_callstack": "".join(traceback.format_exception(exc)), "timestamp": str(int(time.time()))},
        }
    }


def record(fn: Callable[_P, _R]) -> Callable[_P, _R | None]:
    """Decorate a worker's entry point so an uncaught exception is written to ``TORCHELASTIC_ERROR_FILE``.

    The file has torch's format, so torch's agent reads it too. The exception is re-raised (the worker still exits
    non-zero with its traceback on stderr). ``SystemExit(0)`` returns ``None`` (a script's clean ``sys.exit()``);
    other ``SystemExit`` codes and ``KeyboardInterrupt`` pass through without a file. Without the variable,
    nothing is written. Like torch, it enables :mod:`faulthandler`, so a crash signal dumps the stacks to stderr.
    """

    @functools.wraps(fn)
    def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _R | None:
        try:
            faulthandler.enable(all_threads=True)
        except (RuntimeError, ValueError, OSError) as exc:  # no usable stderr (e.g. closed)
            logger.debug("faulthandler not enabled: %s", exc)
        try:
            return fn(*args, **kwargs)
        except SystemExit as exc:
            if exc.code == 0:
                return None
            raise
        except Exception as exc:
            data = _exception_data(exc)
            if data is not None:
                write(data)
            raise

    return wrapper
