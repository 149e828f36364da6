"""The NVIDIA devices of this machine that a worker could see, found without importing torch."""

from __future__ import annotations

import os
from collections.abc import Mapping

__all__ = ["visible_devices"]


def visible_devices(env: Mapping[str, str]) -> list[str]:
    """The NVIDIA devices a worker could see, without importing torch: ``CUDA_VISIBLE_DEVICES`` if set (as CUDA
    reads it: up to the first invalid entry), else the ``/dev/nvidia<N>`` devices' indices."""
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        devices = []
        for item in (part.strip() for part in visible.split(",")):
            if not item or item.startswith("-"):
                break
            devices.append(item)
        return devices
    try:
        names = os.listdir("/dev")
    except OSError:
        return []
    indices = (name[len("nvidia") :] for name in names if name.startswith("nvidia"))
    return sorted((index for index in indices if index.isdigit()), key=int)
