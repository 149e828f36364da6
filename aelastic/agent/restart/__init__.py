"""In-process restarts: workers that keep their process when a peer fails or the job's membership changes (the
worker's side is :mod:`aelastic.worker._restart`, which users reach as ``aelastic.worker.restartable``).

* :mod:`.parent`: one restartable worker's channel (its events socket, its report awaiting a verdict) and the rules
  a report is judged by.
* :mod:`.survivors`: the supervisor's ``restart`` link service, the verdicts while an attempt runs, the survivors
  kept when it ends and each one given the next attempt in its process."""
