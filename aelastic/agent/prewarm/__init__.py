"""Pre-warmed standby worker interpreters (``--prewarm``): an attempt's workers start with ``torch`` imported.

* :mod:`.parent` (the agent's side): the :class:`~.parent.Standbys` pool, at most one idle interpreter per local
  rank, started the way workers start (:mod:`aelastic.agent.spawn`, registered with :mod:`aelastic.agent.reaper`),
  handed an attempt instead of spawning its worker, and refilled beside the running workers.
* :mod:`aelastic.worker._standby` (the standby interpreter, ``python [-u] -m aelastic.worker._standby ...``): preloads,
  waits for its assignment on a control socket, then runs the worker's script or module as ``python`` would.
"""
