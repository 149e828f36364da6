"""In-process restarts: workers that keep their process when a peer fails or the job's membership changes (users
reach the child side as ``aelastic.worker.restartable``)."""
