"""The worker's marks of its own progress (the child side of :mod:`aelastic.agent.incidents`).

* :func:`step` says a training step is complete: the agent's incident records measure from the last step before a
  fault to the same step done again, and count the steps redone. ``aelastic.checkpoint.save(step=)`` marks its
  step too, so a job that saves every step needs no call.
* :func:`busy` marks a block in which the rank works where nothing outside its process shows it (a sleep while a
  device or a remote service works, a wait on a lock held elsewhere): the agent's hang detection
  (``--hang-timeout``) counts the block as progress.

Each call is one message to the agent over the worker's link and its answer (tens of microseconds). Outside an
aelastic agent both do nothing, so the same script runs under torchrun; an agent gone is no error either: the
marks only inform the agent's records.

Standard library only: this runs in the worker's interpreter.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

from ..errors import ConfigurationError
from ._link import LinkRefused, agent_link

__all__ = ["busy", "step"]


def _tell(op: str, **fields: Any) -> None:
    link = agent_link()
    if link is not None:
        with contextlib.suppress(OSError, LinkRefused):
            link.request(f"progress.{op}", **fields)


def step(n: int) -> None:
    """Step ``n`` is complete on this rank (``n``: the job's step count, the same on every rank). Call it on every
    rank: a step is complete on a node when each of its workers said so.

    Raises:
        ConfigurationError: ``n`` is not an int >= 0.
    """
    if type(n) is not int or n < 0:
        raise ConfigurationError(f"aelastic.worker.step: n={n!r}: must be an int >= 0")
    _tell("step", step=n, at=time.monotonic())


@contextlib.contextmanager
def busy(what: str) -> Iterator[None]:
    """While the block runs, this rank is busy with ``what`` (a few words: ``"checkpoint"``, ``"evaluation"``):
    hang detection does not call it hung, however idle its process looks. Blocks do not nest.

    Raises:
        ConfigurationError: ``what`` is not a non-empty string.
    """
    if not isinstance(what, str) or not what.strip():
        raise ConfigurationError(f"aelastic.worker.busy: what={what!r}: must be a non-empty string")
    _tell("busy", what=what)
    try:
        yield
    finally:
        _tell("busy", what=None)
