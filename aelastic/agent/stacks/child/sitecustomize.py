"""aelastic's worker start-up hook for stack dumps without py-spy (see :mod:`aelastic.agent.stacks.fallback`).

The agent puts this directory first on a worker's ``PYTHONPATH`` only when py-spy is not installed, with
``AELASTIC_STACKS=<agent pid>:<fd>:<signal>``. In the worker itself (its parent is the agent; its own children
inherit the variable and do nothing), it registers :func:`faulthandler.register` for that signal, writing every
thread's traceback to the inherited pipe ``fd`` from the C signal handler, so a worker blocked anywhere, in C code
included, answers without running Python code and keeps running. The line ``armed`` tells the agent that it is safe
to send the signal. Then it steps aside: its directory leaves ``sys.path`` and the next ``sitecustomize`` (the
distribution's, the user's) is imported as if this one had not been there. Standard library only: the worker's
interpreter may not have aelastic installed.
"""

import os
import sys


def _arm() -> None:
    spec = os.environ.get("AELASTIC_STACKS", "")
    parent, _, rest = spec.partition(":")
    fd, _, signum = rest.partition(":")
    if not (parent.isdigit() and fd.isdigit() and signum.isdigit()) or os.getppid() != int(parent):
        return
    import faulthandler

    try:
        faulthandler.register(int(signum), file=int(fd), all_threads=True, chain=False)
        os.write(int(fd), b"armed\n")
    except (OSError, ValueError, RuntimeError):
        return  # no dump then; the agent's deadline covers a worker that never answers


_here = os.path.dirname(os.path.abspath(__file__))
try:
    _arm()
finally:
    sys.path[:] = [entry for entry in sys.path if os.path.abspath(entry or ".") != _here]
    _self = sys.modules.pop("sitecustomize")
    try:
        import sitecustomize  # type: ignore[import-not-found]  # noqa: F401
    except ImportError as exc:
        if exc.name != "sitecustomize":
            raise
        sys.modules["sitecustomize"] = _self  # the import machinery expects a module under this name
