"""The reaper sidecar: no worker's process group outlives the agent, even when the agent is SIGKILLed.

The parent-death signal (:mod:`aelastic.agent.spawn`) reaches a worker only, not its children. The reaper covers
them:

* :mod:`.parent` (the agent's side): :func:`~.parent.open_reaper` starts the sidecar and yields a
  :class:`~.parent.Reaper`, with which every worker group is registered right after spawning and unregistered once
  stopped and reaped.
* :mod:`.child` (the sidecar, run by path with ``python -I -S``): reads the registrations from a pipe whose only
  write end the agent holds; at end of file (the agent exited or died by any signal) it SIGKILLs every group still
  registered.

Between a spawn and its registration (a pipe write) there is a window of microseconds in which only the
parent-death signal covers the worker.
"""
