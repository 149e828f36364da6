"""A hand-written loop's state in the agent's memory, as the frameworks' own ``save``/``load`` take it: modules,
optimizers and schedulers as themselves (whatever has ``state_dict``), beside plain values, and the random
generators' states. Lightning Fabric and Hugging Face Accelerate loops use it (``fabric.save`` and
``accelerator.save_state`` write on the main process only, which suits a file every rank reads, not the agents'
memory, where each rank's checkpoint is its own)::

    state = {"model": model, "optimizer": optimizer, "step": -1}
    load_state(state)                              # False on the first run; else the state is the restored step's
    for step in range(state["step"] + 1, steps):
        ...
        state["step"] = step
        save_state(state, step=step)               # every rank, into its agent's memory

Both do nothing without an agent (under torchrun), so the same loop runs there.
"""

from __future__ import annotations

import random
import sys
from typing import Any, Final

import torch

import aelastic.checkpoint

from ..errors import ConfigurationError

__all__ = ["every_n_steps", "load_state", "rng_states", "save_state", "set_rng_states"]

_RNG: Final = "aelastic.rng"  # the saved state's key of the random generators' states


def save_state(state: dict[str, Any], *, step: int, rng: bool = True) -> None:
    """Save ``state`` into the agent's memory as this rank's checkpoint of ``step``: an object with ``state_dict()``
    as its state, any other value as it is, and (``rng``) the random generators' states (Python's, NumPy's when it
    is imported, torch's, every CUDA device's), so that dropout and sampling go on as without a fault.

    Raises:
        CheckpointError: as :func:`aelastic.checkpoint.save`.
    """
    if not aelastic.checkpoint.available():
        return
    saved = {key: value.state_dict() if hasattr(value, "state_dict") else value for key, value in state.items()}
    if rng:
        saved[_RNG] = rng_states()
    aelastic.checkpoint.save(saved, step=step)


def load_state(state: dict[str, Any]) -> bool:
    """Restore ``state`` (as :func:`save_state` took it) from the step the job restores: modules' tensors are
    filled in place, other objects with ``load_state_dict`` load theirs, plain values are replaced, and the random
    generators are set as they were; whether there was a step (``False``: the first run, or no agent).

    Raises:
        CheckpointError: as :func:`aelastic.checkpoint.load`.
    """
    if not aelastic.checkpoint.available():
        return False
    modules = {key: value.state_dict() for key, value in state.items() if isinstance(value, torch.nn.Module)}
    restored = aelastic.checkpoint.load(into=modules)
    if restored is None:
        return False
    for key, value in restored.items():
        if key == _RNG:
            set_rng_states(value)
        elif key in modules:
            continue
        elif hasattr(state.get(key), "load_state_dict"):
            state[key].load_state_dict(value)
        else:
            state[key] = value
    return True


def rng_states() -> dict[str, Any]:
    """The random generators' states, as the Hugging Face Trainer saves them."""
    states: dict[str, Any] = {"python": random.getstate(), "cpu": torch.random.get_rng_state()}
    numpy = sys.modules.get("numpy")
    if numpy is not None:  # imported by the job: its generator may be in use
        states["numpy"] = numpy.random.get_state()
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.random.get_rng_state_all()
    return states


def set_rng_states(states: dict[str, Any]) -> None:
    """Set the random generators as :func:`rng_states` found them."""
    random.setstate(states["python"])
    torch.random.set_rng_state(states["cpu"])
    if "numpy" in states:
        import numpy  # saved by a process that had it: this one has it installed

        numpy.random.set_state(states["numpy"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.random.set_rng_state_all(states["cuda"])


def every_n_steps(value: object, what: str) -> int:
    """A framework callback's checkpoint interval, checked.

    Raises:
        ConfigurationError: ``value`` is not an int >= 1 (the message names ``what``).
    """
    if type(value) is not int or value < 1:
        raise ConfigurationError(f"{what}: every_n_steps={value!r}: must be an int >= 1")
    return value
