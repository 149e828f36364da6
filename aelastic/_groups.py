"""One error out of a task group: how every public call raises the error that ended it, not an ExceptionGroup.

anyio's task groups (and trio's nurseries) always wrap what ends them in an :class:`ExceptionGroup`, even when a
single task failed, and the groups nest as the context managers do (a rendezvous inside the launch, each with its
own task group). A caller would have to write ``except* RendezvousTimeoutError`` to catch what the docstring
promises as ``RendezvousTimeoutError``. :func:`single_error` undoes that at the public boundary: a group, however
nested, whose only leaf is an :class:`Exception` becomes that exception, raised as itself with its own traceback,
``__cause__`` and ``__context__``.

A group is kept as it is when several errors really happened (two tasks failed independently: dropping one would
hide it), and when its only leaf is not an :class:`Exception`: the cancellation class (asyncio's
``CancelledError``, trio's ``Cancelled``), ``KeyboardInterrupt`` and ``SystemExit`` pass untouched, so cancel scopes
and interrupts behave exactly as they would without this module.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

if sys.version_info < (3, 11):
    from exceptiongroup import BaseExceptionGroup  # anyio's dependency before 3.11

__all__ = ["leaves", "single_error"]


def leaves(exc: BaseException) -> list[BaseException]:
    """The exceptions inside (nested) exception groups, in order; ``[exc]`` for an exception that is no group."""
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for inner in exc.exceptions for leaf in leaves(inner)]
    return [exc]


@contextmanager
def single_error() -> Iterator[None]:
    """Re-raise a (nested) exception group holding exactly one :class:`Exception` as that exception; see the module
    docstring. Everything else, groups of several errors and the cancellation class included, passes unchanged."""
    try:
        yield
    except BaseExceptionGroup as group:
        found = leaves(group)
        if len(found) != 1 or not isinstance(found[0], Exception):
            raise
        error = found[0]
        context = error.__context__  # `raise` below would set it to the group
        try:
            raise error
        finally:
            error.__context__ = context
            del error, group, found
