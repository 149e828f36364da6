"""Finishing together: no callable worker exits before every local worker's function has returned (torch's
multiprocessing contract, which keeps a worker from tearing down gloo connections a peer still uses).

* :mod:`.parent` (the agent's side): :class:`~.parent.FinishLineServer` makes the two pipes, reads who returned
  from the *done* pipe and closes the *release* pipe once every local worker has returned or exited.
* :mod:`aelastic.worker._finish` (the worker's side, used by the callable bootstrap): its ``FinishLine`` takes the
  worker's pipe ends before the user's code runs, then says it returned and blocks until release.
"""
