"""In-memory checkpoints: a worker's training state held in its agent's memory, saved every step, restored in the
time of a memory copy.

::

    import aelastic.checkpoint as ckpt

    state = {"model": model.state_dict(), "optim": optimizer.state_dict(), "step": 0}
    restored = ckpt.load(into=state)                 # None on the first run; else the job's last complete step
    start = 0 if restored is None else restored["step"] + 1
    for step in range(start, steps):
        train_step(...)
        ckpt.save({"model": model.state_dict(), "optim": optimizer.state_dict(), "step": step}, step=step)

:func:`save` copies the state's tensors, byte for byte (nothing is pickled), into shared memory that the worker's
agent owns, and returns when the copy is complete; a fault during a save leaves the previous checkpoint whole. The
memory outlives the worker: after a failure, the restarted workers :func:`load` the newest step that every rank of
the job saved, from their agents' memory, or from the replica another node's agent keeps of a lost node's ranks,
or from ``--checkpoint-dir``. ``load(into=state)`` copies into the tensors of ``state`` in place (a model's
``state_dict()`` shares the model's parameters), as ``dcp.load`` does; without it the tensors are new.
:func:`last_loaded` says what the last load restored and from where; :func:`step_to_restore`, before a load, which
step the job restores (``None``: nothing to restore); :func:`available`, whether there is an agent at all (a
script that also runs under torchrun checkpoints its own way there).

:class:`StorageWriter` and :class:`StorageReader` are the same storage for ``torch.distributed.checkpoint``
(``dcp.save(state, storage_writer=StorageWriter())``, ``dcp.async_save``, ``dcp.load``), for jobs that checkpoint
through DCP (FSDP, torchtitan); a checkpoint persisted from one world size loads into another through DCP's
resharding. :class:`SavePlanner` is DCP's default save planner that plans a state's layout once, not at every save
(``dcp.save(..., planner=planner)``, one planner for every save).

The first use of :func:`save` or :func:`load` imports torch (``import aelastic.checkpoint`` does not). Outside a
worker started by an aelastic agent
every call raises :class:`~aelastic.errors.CheckpointError`, as it does for a value a state may not hold (named by
its key path) or a state over the agent's memory bound (``--checkpoint-memory``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._lazy import lazy_exports
from .errors import CheckpointError

if TYPE_CHECKING:
    from .worker._checkpoint.api import LoadInfo, available, last_loaded, load, save, step_to_restore
    from .worker._checkpoint.dcp import StorageReader, StorageWriter
    from .worker._checkpoint.planner import SavePlanner

_LAZY = {
    "LoadInfo": "aelastic.worker._checkpoint.api",
    "SavePlanner": "aelastic.worker._checkpoint.planner",
    "StorageReader": "aelastic.worker._checkpoint.dcp",
    "StorageWriter": "aelastic.worker._checkpoint.dcp",
    "available": "aelastic.worker._checkpoint.api",
    "last_loaded": "aelastic.worker._checkpoint.api",
    "load": "aelastic.worker._checkpoint.api",
    "save": "aelastic.worker._checkpoint.api",
    "step_to_restore": "aelastic.worker._checkpoint.api",
}

__all__ = [
    "CheckpointError",
    "LoadInfo",
    "SavePlanner",
    "StorageReader",
    "StorageWriter",
    "available",
    "last_loaded",
    "load",
    "save",
    "step_to_restore",
]

__getattr__, __dir__ = lazy_exports(__name__, globals(), _LAZY)
