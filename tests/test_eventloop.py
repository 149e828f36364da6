"""Which event loop a launch runs on: uvloop under asyncio when the ``fast`` extra installed it, unless turned off.

The rest of the suite runs with ``AELASTIC_UVLOOP=0`` (conftest.py), as an install without the extra would; these
tests turn it back on.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from aelastic._eventloop import run_options

pytest.importorskip("uvloop")

ALLREDUCE = Path(__file__).resolve().parent.parent / "examples" / "allreduce.py"

# The launcher in-process, then whether anyio loaded uvloop for it (nothing else in the process imports it).
LAUNCH = """
import sys
from aelastic.cli import main
code = main(["run", "--standalone", "--nproc-per-node", "2", sys.argv[1]])
print("uvloop loaded:", "uvloop" in sys.modules, flush=True)
sys.exit(code)
"""


def test_asyncio_gets_uvloop_when_installed_and_not_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AELASTIC_UVLOOP", "1")
    assert run_options("asyncio") == {"use_uvloop": True}
    assert run_options("trio") == {}
    monkeypatch.setenv("AELASTIC_UVLOOP", "0")
    assert run_options("asyncio") == {}


@pytest.mark.torch
@pytest.mark.parametrize("setting", ["1", "0"])
def test_a_gloo_job_launches_on_the_loop_the_setting_picks(setting: str) -> None:
    env = {**os.environ, "AELASTIC_UVLOOP": setting}
    result = subprocess.run(
        [sys.executable, "-c", LAUNCH, str(ALLREDUCE)], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"uvloop loaded: {setting == '1'}" in result.stdout
    assert result.stdout.count("world_size 2 tensor([2])") == 2, result.stdout  # both all-reduced via the store
