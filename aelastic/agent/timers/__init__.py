"""Expiration timers and the progress watchdog: torch's ``FileTimerServer``/``FileTimerClient`` protocol.

* :mod:`.parent` (the agent's side): :class:`~.parent.FileTimerServer` serves the FIFO for one attempt from the
  event loop and kills a worker whose timer expired (after its stack dump); :class:`~.parent.TimerTable` is its
  sans-IO core.
* :mod:`aelastic.worker._timers` (the worker's side): the client behind :mod:`aelastic.worker` (``expires``,
  ``heartbeat``); it defines the protocol's constants, which the agent's side imports. torch's own ``FileTimerClient``
  talks to the same FIFO unmodified.
"""
