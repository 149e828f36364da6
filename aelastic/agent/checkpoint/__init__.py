"""In-memory checkpoints: the agent owns the memory of its workers' training state (users reach it as
:mod:`aelastic.checkpoint`).

The agent side is :mod:`.parent` (the :class:`~.parent.Keeper`: slots, the link service, the round's plan),
over :mod:`.slots` (memory files), :mod:`.plan` (where a job restores from: pure), :mod:`.replicas` (agent to
agent) and :mod:`.persist` (``--checkpoint-dir``). The worker side is :mod:`aelastic.worker._checkpoint`: ``api``
(``save``, ``load``), ``tree`` (a state as JSON and raw bytes), ``dcp`` (DCP's storage classes) and ``layout``
(the bytes of a checkpoint, read by both sides).
"""
