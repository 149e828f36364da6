"""``python -m aelastic`` and the ``aelastic`` command (:func:`console`)."""

from __future__ import annotations

import gc
import sys
from typing import NoReturn


def console() -> NoReturn:
    """Run the command line in this process, which it owns until exit.

    The modules it imports live until the process exits, so they are frozen out of the cyclic garbage collector
    (:func:`gc.freeze`): no collection during the run, nor the interpreter's last one at exit, traverses them
    again. That was 25-50 ms of a 0.3-0.4 s no-op launch (collections of the ~27,000 objects the imports create).
    Only the command does this; :func:`aelastic.cli.main` called in a process of the caller's leaves the collector
    alone.
    """
    gc.disable()  # the imports create objects, not garbage: collecting while they run only costs time
    from .cli import main

    gc.freeze()
    gc.enable()
    sys.exit(main())


if __name__ == "__main__":
    console()
