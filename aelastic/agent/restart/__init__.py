"""In-process restarts: workers that keep their process when a peer fails or the job's membership changes (the
worker's side is :mod:`aelastic.worker._restart`, which users reach as ``aelastic.worker.restartable``). The
supervisor's side of the survivors (verdicts, keeping, reassigning) is :mod:`aelastic.agent.survivors`, beside the
supervision it drives: a worker's tracking (:mod:`aelastic.agent.started`) holds this package's channel, so the
survivors' rules inside it would make an arrow run back up."""
