"""The child-side rule (stated once, in :mod:`aelastic.agent`'s docstring), enforced.

Each feature package under ``aelastic/agent/`` keeps what runs in a worker or sidecar interpreter in its
``child.py`` module or its ``child/`` directory. That code is standard library only and imports nothing of aelastic
but its own feature's child side. Each child-side module is imported here in a bare interpreter (``python -I -S``:
no site-packages, no environment, nothing of aelastic but what the test puts on ``sys.path``) and every module the
import loaded is checked; the modules found by name, so a new child-side module is checked without being listed.
The exceptions are declared in :data:`EXCEPTIONS`, each with its reason, and must stay true.
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

AGENT_DIR = Path(aelastic.agent.__file__).parent
SOURCE_ROOT = AGENT_DIR.parent.parent  # the directory that holds the aelastic package

# The cross-process features; each must keep a child side (discovery below finds any other too).
FEATURES = {"callables", "checkpoint", "finish", "forward", "link", "nodecheck", "prewarm", "reaper", "restart",
            "spawn", "stacks", "timers"}  # fmt: skip

# (child-side module, module it may import besides the rule) -> why.
EXCEPTIONS = {
    ("aelastic.agent.callables.child", "cloudpickle"): "the payload's format (functions of __main__ by value)",
    ("aelastic.agent.callables.child", "aelastic.agent.errors"): "record(): the error file torch's agent reads",
    ("aelastic.agent.callables.child", "aelastic.agent.finish.child"): "callable workers finish together",
    ("aelastic.agent.timers.child", "aelastic.errors"): "TimerServerUnavailableError lives in the one error tree",
    ("aelastic.agent.prewarm.child", "aelastic.agent.link.child"): "a standby reports its worker's failure over the "
    "worker's link before the interpreter's teardown",
    ("aelastic.agent.prewarm.child", "aelastic.agent.checkpoint.child.heap"): "a standby warms its heap for the "
    "state its worker will allocate and checkpoint",
    ("aelastic.agent.prewarm.child", "aelastic.agent.checkpoint.child.premapped"): "a standby maps the slots its "
    "worker will restore from",
    ("aelastic.agent.checkpoint.child.api", "torch"): "the worker's own torch: a checkpoint is the state's tensors",
    ("aelastic.agent.checkpoint.child.api", "aelastic.errors"): "CheckpointError lives in the one error tree",
    ("aelastic.agent.checkpoint.child.api", "aelastic.agent.link.child"): "save and load ask the agent over the "
    "worker's link",
    ("aelastic.agent.checkpoint.child.tree", "torch"): "the worker's own torch: a state is tensors",
    ("aelastic.agent.checkpoint.child.dcp", "torch"): "torch.distributed.checkpoint's storage classes",
    ("aelastic.agent.checkpoint.child.dcp", "aelastic.errors"): "CheckpointError lives in the one error tree",
    ("aelastic.agent.restart.child", "aelastic.agent.link.child"): "a restartable worker registers, and reports its "
    "exception, over the worker's link",
    ("aelastic.agent.nodecheck.child", "torch"): "the check is torch's: a matmul on the node's device, gloo's "
    "all-reduces",
}

# What ``python -m aelastic.agent.<feature>.child`` imports on the way down before the module itself: the
# packages, and what aelastic/__init__.py and aelastic/agent/__init__.py import. Kept standard library only.
ANCESTORS = {"aelastic", "aelastic._lazy", "aelastic.errors", "aelastic.agent"}

# The child sides the agent runs by path (``python -I -S <file>``): nothing of aelastic is importable there at all.
BY_PATH = {"forward", "reaper", "spawn"}

PROBE = """
import importlib, json, sys
sys.path[:0] = json.loads(sys.argv[1])
before = set(sys.modules)
for name in json.loads(sys.argv[2]):
    importlib.import_module(name)
    loaded, before = sorted(set(sys.modules) - before), set(sys.modules)
print(json.dumps(loaded))
"""


def features() -> list[str]:
    return sorted(d.name for d in AGENT_DIR.iterdir() if (d / "__init__.py").is_file())


def child_modules() -> list[tuple[str, str]]:
    """(feature, module name) of every ``child.py``, and of every module of a ``child/`` package."""
    modules = [(f, f"aelastic.agent.{f}.child") for f in features() if (AGENT_DIR / f / "child.py").is_file()]
    for f in features():
        package = AGENT_DIR / f / "child"
        if (package / "__init__.py").is_file():
            modules += [(f, f"aelastic.agent.{f}.child.{p.stem}") for p in sorted(package.glob("*.py"))
                        if p.stem != "__init__"]  # fmt: skip
    return modules


def child_files() -> list[tuple[str, Path]]:
    """(feature, file) of every file under a ``child/`` directory that is not a package: each is imported as a
    top-level module from its directory (as the stack hook is, from the worker's ``PYTHONPATH``)."""
    return [(f, path) for f in features() if not (AGENT_DIR / f / "child" / "__init__.py").is_file()
            for path in sorted((AGENT_DIR / f / "child").glob("*.py"))]  # fmt: skip


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
    """The modules that ``module``'s import statements name (relative ones resolved), from its source."""
    path = SOURCE_ROOT.joinpath(*module.split(".")).with_suffix(".py")
    package = module.rpartition(".")[0]
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = importlib.util.resolve_name("." * node.level + (node.module or ""), package) if node.level else ""
            names.add(base or node.module or "")
    return names


def test_every_feature_keeps_its_child_side() -> None:
    with_child = {f for f, _ in child_modules()} | {f for f, _ in child_files()}
    assert with_child >= FEATURES, FEATURES - with_child


@pytest.mark.parametrize("feature", features())
def test_a_feature_package_is_standard_library_only(feature: str) -> None:
    """``python -m`` of a child side imports its package first: nothing of aelastic but the ancestors."""
    loaded = probe([str(SOURCE_ROOT)], [f"aelastic.agent.{feature}"])
    aelastic = {m for m in loaded if m.partition(".")[0] == "aelastic"}
    assert aelastic <= ANCESTORS | {f"aelastic.agent.{feature}"}, aelastic
    assert all(is_stdlib(m) for m in set(loaded) - aelastic), sorted(set(loaded) - aelastic)


@pytest.mark.parametrize(("feature", "module"), child_modules())
def test_a_child_module_imports_only_the_standard_library_and_its_own_child_side(feature: str, module: str) -> None:
    declared = {imported: why for (child, imported), why in EXCEPTIONS.items() if child == module}
    # What the feature's other child modules may import, this one may import through them.
    permitted = {imported for (child, imported) in EXCEPTIONS if child.startswith(f"aelastic.agent.{feature}.child")}
    third_party = sorted({location(m) for m in permitted if m.partition(".")[0] != "aelastic"})
    loaded = probe([str(SOURCE_ROOT), *third_party], [f"aelastic.agent.{feature}", module])

    def allowed(name: str) -> bool:
        if name == module or name.startswith(f"aelastic.agent.{feature}.child"):
            return True
        if "torch" in permitted and name.partition(".")[0] != "aelastic":
            return True  # the worker's torch, and what torch imports
        if any(name == d or name.startswith(f"{d}.") or d.startswith(f"{name}.") for d in permitted):
            return True  # a declared module, one of its submodules or its package
        return name.partition(".")[0] != "aelastic" and is_stdlib(name)

    assert [m for m in loaded if not allowed(m)] == []
    assert set(declared) <= imported_by(module), f"stale exceptions: {set(declared) - imported_by(module)}"


@pytest.mark.parametrize("feature", sorted(BY_PATH))
def test_a_child_run_by_path_needs_nothing_of_aelastic(feature: str) -> None:
    """Loaded by path (not run: ``__name__`` is not ``"__main__"``) with nothing of aelastic importable."""
    code = (
        "import json, runpy, sys; before = set(sys.modules); "
        f"runpy.run_path({str(AGENT_DIR / feature / 'child.py')!r}, run_name='probe'); "
        "print(json.dumps(sorted(set(sys.modules) - before)))"
    )
    out = subprocess.run([sys.executable, "-I", "-S", "-c", code], capture_output=True, text=True, timeout=60, env={})
    assert out.returncode == 0, out.stderr
    assert [m for m in json.loads(out.stdout) if not is_stdlib(m)] == []


@pytest.mark.parametrize(("feature", "path"), child_files())
def test_a_child_hook_imports_only_the_standard_library(feature: str, path: Path) -> None:
    """Imported as a top-level module from its directory; the stack hook armed (as in a worker), so the imports it
    makes then are checked too."""
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
    if path.name == "sitecustomize.py":
        assert armed == b"armed\n"
