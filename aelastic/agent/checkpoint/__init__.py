"""In-memory checkpoints: the agent owns the memory of its workers' training state (users reach it as
:mod:`aelastic.checkpoint`).

The agent side is :mod:`.parent` (the :class:`~.parent.Keeper`: slots, the link service, the round's plan),
over :mod:`.slots` (memory files), :mod:`.plan` (where a job restores from: pure), :mod:`.replicas` (agent to
agent) and :mod:`.persist` (``--checkpoint-dir``). The worker side is the :mod:`.child` package: :mod:`.child.api`
(``save``, ``load``), :mod:`.child.tree` (a state as JSON and raw bytes), :mod:`.child.dcp` (DCP's storage
classes) and :mod:`.child.layout` (the bytes of a checkpoint, read by both sides).
"""
