"""PyTorch Lightning's Trainer with in-memory checkpoints (:mod:`aelastic.checkpoint`): saved every N steps into the
agent's memory, restored from it when the job restarts.

::

    import lightning as L
    from aelastic.integrations.lightning import InMemoryCheckpoint

    memory = InMemoryCheckpoint(every_n_steps=1)
    trainer = L.Trainer(..., callbacks=[memory])
    trainer.fit(model, datamodule, ckpt_path=memory.resume_path())   # None on the first run

:class:`InMemoryCheckpoint` is a callback: after every ``every_n_steps``-th optimizer step it takes the Trainer's
own checkpoint (what ``trainer.save_checkpoint`` writes: the model, the optimizers and schedulers, the loops'
progress, the callbacks' state; not the hyper-parameters, which the script passes again) on every rank and saves it
with ``aelastic.checkpoint.save(step=global_step)``,
which copies its tensors into the agent's memory (nothing is pickled, nothing goes to disk; with
``--checkpoint-dir`` the agent persists it in the background). :meth:`InMemoryCheckpoint.resume_path` asks the
agent for the step the job restores and returns a path for ``ckpt_path`` that the callback's checkpoint I/O (it
wraps the strategy's in ``setup``, so ``ModelCheckpoint``'s files still go where they went) reads from memory; Lightning
then restores everything as from a file, and training goes on from the step after the saved one.

Outside an aelastic agent, :meth:`~InMemoryCheckpoint.resume_path` returns ``None`` and the callback saves nothing,
so the same script runs under torchrun.

A Fabric loop saves and loads its state, as it would pass it to ``fabric.save`` and ``fabric.load`` (modules and
optimizers as themselves, beside plain values), with :mod:`aelastic.integrations.stateful`'s ``save_state`` and
``load_state``::

    state = {"model": model, "optimizer": optimizer, "step": 0}
    load_state(state)                        # False on the first run; else the state is the restored step's
    for step in range(state["step"] + 1, steps):
        ...
        state["step"] = step
        save_state(state, step=step)

``fabric.save`` writes on global rank 0 only, which suits a file every rank can read, not the agents' memory,
where each rank's checkpoint is its own: :func:`~aelastic.integrations.stateful.save_state` saves on every rank.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final

import aelastic.checkpoint

from ..errors import CheckpointError
from .stateful import every_n_steps as checked_interval
from .stateful import load_state, save_state

try:
    import lightning.pytorch as pl
    from lightning.fabric.plugins import CheckpointIO
except ImportError:
    raise ImportError(
        "aelastic.integrations.lightning needs PyTorch Lightning: pip install 'aelastic[lightning]'"
    ) from None

if TYPE_CHECKING:
    from lightning.fabric.utilities.types import _PATH

__all__ = ["MEMORY_PATH", "InMemoryCheckpoint", "load_state", "save_state"]

MEMORY_PATH: Final = "aelastic://memory"  # the ckpt_path that means: the checkpoint the agent restores
# Left out of the checkpoint in memory: the hyper-parameters (``save_hyperparameters``) may hold any object, which
# only pickling keeps, and a restart does not need them: the script builds its model and data with them again.
_NOT_KEPT: Final = ("hyper_parameters", "datamodule_hyper_parameters")


class InMemoryCheckpoint(pl.Callback):
    """Saves the Trainer's checkpoint into the agent's memory every ``every_n_steps`` optimizer steps, and restores
    it through ``trainer.fit(..., ckpt_path=callback.resume_path())``; see the module doc.

    Raises:
        ConfigurationError: ``every_n_steps`` is not an int >= 1.
    """

    def __init__(self, every_n_steps: int = 1) -> None:
        self.every_n_steps = checked_interval(every_n_steps, "InMemoryCheckpoint")
        self._module: pl.LightningModule | None = None  # the module being fitted, whose tensors a restore fills

    def resume_path(self) -> str | None:
        """:data:`MEMORY_PATH` when the job restores a step from the agents' memory (or their replicas, or
        ``--checkpoint-dir``), else ``None`` (the first run, or no agent): the ``ckpt_path`` of ``trainer.fit``."""
        if not aelastic.checkpoint.available():
            return None  # not started by an aelastic agent: nothing to restore, as under torchrun
        return None if aelastic.checkpoint.step_to_restore() is None else MEMORY_PATH

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._module = pl_module
        strategy = trainer.strategy
        if not isinstance(strategy.checkpoint_io, _MemoryIO):
            strategy.checkpoint_io = _MemoryIO(strategy.checkpoint_io, self)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if step % self.every_n_steps or not aelastic.checkpoint.available():  # under torchrun: nothing to save to
            return
        checkpoint = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        for key in _NOT_KEPT:
            checkpoint.pop(key, None)
        aelastic.checkpoint.save(checkpoint, step=step)

    def restore(self) -> dict[str, Any]:
        """The checkpoint of the step the job restores, its model's tensors copied into the module's own (Lightning
        then loads the module's state into itself: no copy), so that a restore allocates no second model."""
        into = None if self._module is None else {"state_dict": self._module.state_dict()}
        restored: dict[str, Any] | None = aelastic.checkpoint.load(into=into)
        if restored is None:
            raise CheckpointError(f"{MEMORY_PATH}: no checkpoint to restore: ckpt_path must be resume_path()'s")
        return restored


class _MemoryIO(CheckpointIO):
    """The strategy's checkpoint I/O, but :data:`MEMORY_PATH` reads what :meth:`InMemoryCheckpoint.resume_path`
    loaded; every other path goes to the strategy's own."""

    def __init__(self, inner: CheckpointIO, owner: InMemoryCheckpoint) -> None:
        self.inner, self.owner = inner, owner

    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None) -> None:
        self.inner.save_checkpoint(checkpoint, path, storage_options)

    def load_checkpoint(self, path: _PATH, map_location: Any | None = None, weights_only: bool | None = None) -> Any:
        if str(path) == MEMORY_PATH:
            return self.owner.restore()
        return self.inner.load_checkpoint(path, map_location=map_location, weights_only=weights_only)

    def remove_checkpoint(self, path: _PATH) -> None:
        self.inner.remove_checkpoint(path)

    def teardown(self) -> None:
        self.inner.teardown()
