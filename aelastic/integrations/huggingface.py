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

The model's weights skip that round trip: called after the Trainer was made (the callback has seen its model), the
restore copies them into the model's own tensors, and the directory holds a sharded checkpoint's index that places
every weight in a shard of no tensors, so the Trainer's load finds each key and copies none (a file of the weights
would cost a copy written, one read back and one copied in). A model the Trainer makes anew before training
(``model_init``) is given the restored weights when training begins.

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
    from safetensors.torch import save_file
    from transformers import TrainerCallback
    from transformers.trainer import OPTIMIZER_NAME, SCHEDULER_NAME, TRAINER_STATE_NAME
    from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, WEIGHTS_NAME
except ImportError:
    raise ImportError(
        "aelastic.integrations.huggingface needs Hugging Face transformers: pip install 'aelastic[huggingface]'"
    ) from None

__all__ = ["InMemoryCheckpoint", "load_state", "save_state"]

_MEMORY = "/dev/shm"  # the restored checkpoint's files live in memory too
_IN_PLACE = "aelastic-in-place.safetensors"  # the shard of no tensors that the index places every weight in


class InMemoryCheckpoint(TrainerCallback):
    """Saves the Trainer's checkpoint into the agent's memory every ``every_n_steps`` optimizer steps, and restores
    it through ``trainer.train(resume_from_checkpoint=callback.resume_path())``; see the module doc.

    Raises:
        ConfigurationError: ``every_n_steps`` is not an int >= 1.
    """

    def __init__(self, every_n_steps: int = 1) -> None:
        self.every_n_steps = checked_interval(every_n_steps, "InMemoryCheckpoint")
        self._directory: str | None = None  # the restored checkpoint's files, until training runs again
        self._model: torch.nn.Module | None = None  # the Trainer's, once it is made
        self._restored_into: torch.nn.Module | None = None  # the model that holds the restored weights

    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._model = kwargs.get("model")

    def resume_path(self) -> str | None:
        """A directory holding the step the job restores, in the Trainer's checkpoint format (from the agents'
        memory, their replicas, or ``--checkpoint-dir``); ``None`` on the first run, or without an agent. Called
        after the Trainer was made, it restores the weights into the Trainer's model (see the module doc)."""
        if not aelastic.checkpoint.available():
            return None  # not started by an aelastic agent: nothing to restore, as under torchrun
        model = self._model
        state = aelastic.checkpoint.load(into=None if model is None else {"model": model.state_dict()})
        if state is None:
            return None
        directory = tempfile.mkdtemp(prefix="aelastic-hf-", dir=_MEMORY if os.path.isdir(_MEMORY) else None)
        self._directory = directory
        atexit.register(self._remove)
        if model is None:
            torch.save(state["model"], os.path.join(directory, WEIGHTS_NAME))
        else:
            self._restored_into = model
            save_file({}, os.path.join(directory, _IN_PLACE))
            index = {"metadata": {}, "weight_map": dict.fromkeys(state["model"], _IN_PLACE)}
            with open(os.path.join(directory, SAFE_WEIGHTS_INDEX_NAME), "w", encoding="utf-8") as f:
                json.dump(index, f)
        torch.save(state["optimizer"], os.path.join(directory, OPTIMIZER_NAME))
        if state["scheduler"] is not None:
            torch.save(state["scheduler"], os.path.join(directory, SCHEDULER_NAME))
        world = int(os.environ.get("WORLD_SIZE", "1"))
        rng = "rng_state.pth" if world == 1 else f"rng_state_{os.environ.get('RANK', '0')}.pth"
        torch.save(state["rng"], os.path.join(directory, rng))
        with open(os.path.join(directory, TRAINER_STATE_NAME), "w", encoding="utf-8") as f:
            f.write(state["trainer_state"])
        return directory

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        restored, self._restored_into = self._restored_into, None
        model = kwargs.get("model")
        if restored is not None and model is not None and model is not restored:  # made anew: model_init
            model.load_state_dict(restored.state_dict())

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
