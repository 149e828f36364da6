"""Which event loop ``anyio.run`` gets: uvloop under asyncio when it is installed (the ``fast`` extra).

uvloop (libuv underneath, as torch's TCPStore server) serves the workers' store at rank scale in about half the
CPU of asyncio's own loop (``benchmarks/rank_scale.py``). It is optional: without it, or with
``AELASTIC_UVLOOP=0``, asyncio runs on its own loop; trio is unaffected.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

__all__ = ["run_options"]


def run_options(backend: str) -> dict[str, Any]:
    """``backend_options`` for ``anyio.run(..., backend=backend)``."""
    if backend != "asyncio" or os.environ.get("AELASTIC_UVLOOP", "1") == "0":
        return {}
    if importlib.util.find_spec("uvloop") is None:
        return {}
    return {"use_uvloop": True}
