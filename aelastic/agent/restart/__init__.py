"""In-process restarts: workers that keep their process when a peer fails or the job's membership changes (the
worker's side is :mod:`aelastic.worker._restart`, which users reach as ``aelastic.worker.restartable``)."""
