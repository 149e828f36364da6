"""``python -m aelastic`` and the ``aelastic`` command (:func:`console`)."""

from __future__ import annotations

import atexit
import gc
import os
import sys
import threading
from typing import NoReturn


def console() -> NoReturn:
    """Run the command line in this process, which it owns until exit.

    The modules it imports live until the process exits, so they are frozen out of the cyclic garbage collector
    (:func:`gc.freeze`): no collection during the run, nor the interpreter's last one at exit, traverses them
    again. That was 25-50 ms of a 0.3-0.4 s no-op launch (collections of the ~27,000 objects the imports create).
    Only the command does this; :func:`aelastic.cli.main` called in a process of the caller's leaves the collector
    alone.

    For the same reason the command skips the interpreter's teardown, which deallocates every object of every
    module (~10 ms of a 0.25 s no-op launch), when nothing is left for it to do: no thread but this one (an exiting
    interpreter would wait for the others), the atexit hooks (logging's flush) run here, the standard streams
    flushed here. Everything else of the run (tasks, children, servers, files) ended inside :func:`main`.
    """
    gc.disable()  # the imports create objects, not garbage: collecting while they run only costs time
    from .cli import main

    gc.freeze()
    gc.enable()
    code = main()
    if threading.active_count() == 1:
        atexit._run_exitfuncs()  # what the exit would run first (atexit has no public call for it)
        try:
            for stream in (sys.stdout, sys.stderr):
                if stream is not None:  # None: started with the descriptor closed
                    stream.flush()
        except OSError:
            pass  # e.g. a reader that went away: the interpreter's own exit reports it, as for any command
        else:
            os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    console()
