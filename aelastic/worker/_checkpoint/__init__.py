"""The worker side of in-memory checkpoints (:mod:`aelastic.checkpoint` re-exports its API; the agent side is
:mod:`aelastic.agent.checkpoint`)."""
