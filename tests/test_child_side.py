"""The worker-side rule (stated once, in :mod:`aelastic.worker`'s docstring and ARCHITECTURE.md), enforced.

Everything of aelastic that runs in a worker's interpreter (the training process, a standby, the node check's
process) lives in ``aelastic/worker/``: standard library only, importing nothing of aelastic outside that package but
its ancestors (``aelastic``, its lazy re-exports, the error tree). Each worker module is imported here in a bare
interpreter (``python -I -S``: no site-packages, no environment, nothing of aelastic but what the test puts on
``sys.path``) and every module the import loaded is checked; the modules are found by name, so a new one is checked
without being listed. The third-party modules a worker module may import are declared in :data:`THIRD_PARTY`, each
with its reason, and must stay true.

The agent's helpers that run in a process of their own by path (the spawn shim, the reaper sidecar, the signal
witness) and the stack hook (a start-up file on the worker's ``PYTHONPATH``) need nothing of aelastic at all.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import aelastic.agent
import aelastic.worker

AGENT_DIR = Path(aelastic.agent.__file__).parent
WORKER_DIR = Path(aelastic.worker.__file__).parent
SOURCE_ROOT = AGENT_DIR.parent.parent  # the directory that holds the aelastic package

# (worker module, third-party module it imports) -> why.
THIRD_PARTY = {
    ("aelastic.worker._callables", "cloudpickle"): "the payload's format (functions of __main__ by value)",
    ("aelastic.worker._checkpoint.api", "torch"): "the worker's own torch: a checkpoint is the state's tensors",
    ("aelastic.worker._checkpoint.tree", "torch"): "the worker's own torch: a state is tensors",
    ("aelastic.worker._checkpoint.dcp", "torch"): "torch.distributed.checkpoint's storage classes",
    ("aelastic.worker._checkpoint.planner", "torch"): "torch.distributed.checkpoint's default save planner",
    ("aelastic.worker._nodecheck", "torch"): "the check is torch's: a matmul on the node's device, gloo's all-reduces",
}

# What importing ``aelastic.worker`` loads of aelastic: the packages, and what their __init__s import.
ANCESTORS = {"aelastic", "aelastic._lazy", "aelastic.errors", "aelastic.worker"}

# The agent's helpers run by path (``python -I -S <file>``): nothing of aelastic is importable there at all.
BY_PATH = ["forward", "reaper", "spawn"]

PROBE = """
import importlib, json, sys
sys.path[:0] = json.loads(sys.argv[1])
before = set(sys.modules)
for name in json.loads(sys.argv[2]):
    importlib.import_module(name)
    loaded, before = sorted(set(sys.modules) - before), set(sys.modules)
print(json.dumps(loaded))
"""


def worker_modules() -> list[str]:
    """Every module of ``aelastic/worker/``, packages included."""
    names = []
    for path in sorted(WORKER_DIR.rglob("*.py")):
        parts = path.relative_to(SOURCE_ROOT).with_suffix("").parts
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def probe(path: list[str], imports: list[str], env: dict[str, str] | None = None, **kwargs: object) -> list[str]:
    """The modules that importing the last of ``imports`` loaded, in a bare interpreter with ``path`` first."""
    out = subprocess.run(
        [sys.executable, "-I", "-S", "-c", PROBE, json.dumps(path), json.dumps(imports)],
        capture_output=True, text=True, timeout=60, env=env or {}, check=False, **kwargs,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    loaded: list[str] = json.loads(out.stdout)
    return loaded


def is_stdlib(module: str) -> bool:
    return module.partition(".")[0] in sys.stdlib_module_names


def location(module: str) -> str:
    """The sys.path entry a third-party module is imported from here."""
    spec = importlib.util.find_spec(module)
    assert spec is not None, module
    assert spec.origin is not None, module
    return str(Path(spec.origin).parent.parent)


def imported_by(module: str) -> set[str]:
    """The top-level names of the modules that ``module``'s import statements name outside aelastic."""
    spec = importlib.util.find_spec(module)
    assert spec is not None, module
    assert spec.origin is not None, module
    names = set()
    for node in ast.walk(ast.parse(Path(spec.origin).read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name.partition(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names.add(node.module.partition(".")[0])
    return names


def test_the_worker_modules_are_found() -> None:
    modules = worker_modules()
    assert {"aelastic.worker", "aelastic.worker._link", "aelastic.worker._checkpoint.api"} <= set(modules)
    assert {m for m, _ in THIRD_PARTY} <= set(modules), "a declaration names a module that is gone"


@pytest.mark.parametrize("module", worker_modules())
def test_a_worker_module_imports_only_the_standard_library_and_the_worker_package(module: str) -> None:
    declared = {imported for (worker, imported) in THIRD_PARTY if worker == module}
    # What the worker modules it imports may import, this one loads through them.
    loaded = probe([str(SOURCE_ROOT), *sorted({location(m) for (_, m) in THIRD_PARTY})], ["aelastic.worker", module])
    reached = {m for m in loaded if m.startswith("aelastic.")} | {module}
    permitted = {imported for (worker, imported) in THIRD_PARTY if worker in reached}

    def allowed(name: str) -> bool:
        if name.partition(".")[0] == "aelastic":
            return name in ANCESTORS or name.startswith("aelastic.worker.")
        if is_stdlib(name):
            return True
        # A declared package, and (for torch) what it imports in turn.
        return bool(permitted) and ("torch" in permitted or name.partition(".")[0] in permitted)

    assert [m for m in loaded if not allowed(m)] == []
    assert declared <= imported_by(module), f"stale declarations: {declared - imported_by(module)}"


def test_the_worker_package_imports_nothing_on_its_own() -> None:
    """``import aelastic.worker`` (and ``python -m`` of a worker module, which imports it first) loads only the
    ancestors: each worker module pays for what it imports itself."""
    loaded = probe([str(SOURCE_ROOT)], ["aelastic.worker"])
    assert {m for m in loaded if m.partition(".")[0] == "aelastic"} == ANCESTORS
    assert all(is_stdlib(m) for m in loaded if m.partition(".")[0] != "aelastic")


@pytest.mark.parametrize("feature", BY_PATH)
def test_a_helper_run_by_path_needs_nothing_of_aelastic(feature: str) -> None:
    """Loaded by path (not run: ``__name__`` is not ``"__main__"``) with nothing of aelastic importable."""
    code = (
        "import json, runpy, sys; before = set(sys.modules); "
        f"runpy.run_path({str(AGENT_DIR / feature / 'child.py')!r}, run_name='probe'); "
        "print(json.dumps(sorted(set(sys.modules) - before)))"
    )
    out = subprocess.run([sys.executable, "-I", "-S", "-c", code], capture_output=True, text=True, timeout=60, env={})
    assert out.returncode == 0, out.stderr
    assert [m for m in json.loads(out.stdout) if not is_stdlib(m)] == []


def test_the_stack_hook_imports_only_the_standard_library() -> None:
    """Imported as the top-level module ``sitecustomize`` from its directory, armed (as in a worker), so the imports
    it makes then are checked too."""
    path = AGENT_DIR / "stacks" / "child" / "sitecustomize.py"
    read_end, write_end = os.pipe()
    try:
        env = {"AELASTIC_STACKS": f"{os.getpid()}:{write_end}:{int(signal.SIGRTMIN) + 5}"}
        loaded = probe([str(path.parent)], [path.stem], env=env, pass_fds=(write_end,))
        os.close(write_end)
        write_end = -1
        with os.fdopen(read_end, "rb") as pipe:
            read_end = -1
            armed = pipe.read()
    finally:
        for fd in (read_end, write_end):
            if fd >= 0:
                os.close(fd)
    assert [m for m in loaded if m != path.stem and not is_stdlib(m)] == []
    assert armed == b"armed\n"
