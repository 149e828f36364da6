"""The worker side of :mod:`aelastic.agent.checkpoint` (what ``aelastic.checkpoint`` re-exports)."""
