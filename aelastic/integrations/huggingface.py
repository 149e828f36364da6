"""Hugging Face's ``Trainer`` with in-memory checkpoints (:mod:`aelastic.checkpoint`): saved every N steps into the
agent's memory, restored from it when the job restarts.

::

    from transformers import Trainer
    from aelastic.integrations.huggingface import InMemoryCheckpoint

    memory = InMemoryCheckpoint(every_n_steps=1)
    trainer = Trainer(..., callbacks=[memory])
    trainer.train(resume_from_checkpoint=memory.resume_path())   # None on the first run

:class:`InMemoryCheckpoint` is a ``TrainerCallback``: at the end of every ``every_n_steps``-th optimizer step it
saves what the Trainer's own checkpoint holds (the model's weights, the optimizer's and the scheduler's states, the
random generators' states, the ``TrainerState``) on every rank with ``aelastic.checkpoint.save(step=global_step)``:
tensors are copied into the agent's memory byte for byte, nothing goes to disk (with ``--checkpoint-dir`` the agent
persists it in the background). :meth:`InMemoryCheckpoint.resume_path` asks the agent for the step the job
restores, lays it out in the Trainer's checkpoint format in a private directory of ``/dev/shm`` (memory, removed
once training runs again) and returns it for ``resume_from_checkpoint``: the Trainer then restores everything, skips
the batches already trained in the epoch, and goes on from the next step, exactly as from its own checkpoint.

Outside an aelastic agent, :meth:`~InMemoryCheckpoint.resume_path` returns ``None`` and the callback saves nothing,
so the same script runs under torchrun.

An Accelerate loop saves and loads its state (the prepared model, optimizer and scheduler as themselves, beside
plain values, and the random generators) with ``save_state`` and ``load_state``
(:mod:`aelastic.integrations.stateful`; ``accelerator.save_state`` writes the model on the main process only), and
resumes its data with ``accelerator.skip_first_batches``.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import os
import shutil
import tempfile
from typing import Any

import aelastic.checkpoint

from .stateful import every_n_steps as checked_interval
from .stateful import load_state, rng_states, save_state

try:
    import torch
    from transformers import TrainerCallback
    from transformers.trainer import OPTIMIZER_NAME, SCHEDULER_NAME, TRAINER_STATE_NAME
    from transformers.utils import WEIGHTS_NAME
except ImportError:
    raise ImportError(
        "aelastic.integrations.huggingface needs Hugging Face transformers: pip install 'aelastic[huggingface]'"
    ) from None

__all__ = ["InMemoryCheckpoint", "load_state", "save_state"]

_MEMORY = "/dev/shm"  # the restored checkpoint's files live in memory too


class InMemoryCheckpoint(TrainerCallback):
    """Saves the Trainer's checkpoint into the agent's memory every ``every_n_steps`` optimizer steps, and restores
    it through ``trainer.train(resume_from_checkpoint=callback.resume_path())``; see the module doc.

    Raises:
        ConfigurationError: ``every_n_steps`` is not an int >= 1.
    """

    def __init__(self, every_n_steps: int = 1) -> None:
        self.every_n_steps = checked_interval(every_n_steps, "InMemoryCheckpoint")
        self._directory: str | None = None  # the restored checkpoint's files, until training runs again

    def resume_path(self) -> str | None:
        """A directory holding the step the job restores, in the Trainer's checkpoint format (from the agents'
        memory, their replicas, or ``--checkpoint-dir``); ``None`` on the first run, or without an agent."""
        if not aelastic.checkpoint.available():
            return None  # not started by an aelastic agent: nothing to restore, as under torchrun
        state = aelastic.checkpoint.load()
        if state is None:
            return None
        directory = tempfile.mkdtemp(prefix="aelastic-hf-", dir=_MEMORY if os.path.isdir(_MEMORY) else None)
        self._directory = directory
        atexit.register(self._remove)
        torch.save(state["model"], os.path.join(directory, WEIGHTS_NAME))
        torch.save(state["optimizer"], os.path.join(directory, OPTIMIZER_NAME))
        if state["scheduler"] is not None:
            torch.save(state["scheduler"], os.path.join(directory, SCHEDULER_NAME))
        world = int(os.environ.get("WORLD_SIZE", "1"))
        rng = "rng_state.pth" if world == 1 else f"rng_state_{os.environ.get('RANK', '0')}.pth"
        torch.save(state["rng"], os.path.join(directory, rng))
        with open(os.path.join(directory, TRAINER_STATE_NAME), "w", encoding="utf-8") as f:
            f.write(state["trainer_state"])
        return directory

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._remove()  # the Trainer has read the restored files by its first step's end
        if state.global_step % self.every_n_steps or not aelastic.checkpoint.available():
            return
        scheduler = kwargs.get("lr_scheduler")
        checkpoint = {
            "model": kwargs["model"].state_dict(),
            "optimizer": kwargs["optimizer"].state_dict(),
            "scheduler": None if scheduler is None else scheduler.state_dict(),
            "rng": rng_states(),
            "trainer_state": json.dumps(dataclasses.asdict(state), indent=2, sort_keys=True),  # as its save_to_json
        }
        aelastic.checkpoint.save(checkpoint, step=state.global_step)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._remove()

    def _remove(self) -> None:
        if self._directory is not None:
            shutil.rmtree(self._directory, ignore_errors=True)
            self._directory = None
