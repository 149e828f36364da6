"""Names a package re-exports, imported on first use: ``import aelastic`` (and ``aelastic.agent``, which every
callable worker imports for its bootstrap) must not pay for anyio, the agent or the rendezvous until one is used."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(
    package: str, namespace: dict[str, Any], modules: Mapping[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """A module ``__getattr__`` and ``__dir__`` for ``package``: ``modules`` maps each lazy name to the (relative)
    module defining it; the first access imports it and stores it in ``namespace`` (the package's globals)."""

    def __getattr__(name: str) -> Any:
        module = modules.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module, package), name)
        namespace[name] = value  # later look-ups skip this function
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace.get("__all__", ()), *modules})

    return __getattr__, __dir__
