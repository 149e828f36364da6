"""Stack dumps of a worker the agent is about to kill (an expired timer or watchdog, a worker that outlived the
stop's grace), without the worker's cooperation.

* :mod:`.parent` (the agent's side): :class:`~.parent.StackDumper` runs ``py-spy dump`` on the worker within a
  bounded time, writes ``stacks.txt`` and notes the top frames for the failure report.
* :mod:`.fallback` (the agent's side, without py-spy): :class:`~.fallback.FaultStacks` arms :mod:`faulthandler` in
  each worker at start-up and reads the dump it writes when signalled.
* ``child/sitecustomize.py`` (the worker's side of the fallback): the start-up hook. Its directory goes first on
  the worker's ``PYTHONPATH``; it is a directory, not a package, because the interpreter imports the hook as the
  top-level module ``sitecustomize``.
"""
