"""ARCHITECTURE.md's rules, checked on the code: the import map, no import circle, module size, the sans-IO cores,
torch's variables read only in config/, no side channels, the error tree. Each reads the source (and, where a name
must be resolved, imports the module); none runs aelastic.

The import map, the list of sans-IO cores and the codemap (where things live, where each feature lives) are read from
ARCHITECTURE.md itself, so that the document and the code cannot drift apart: a new import between packages, or a
new module, fails here until the document says it, and an arrow or a module the code no longer has fails too.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import json
import re
import subprocess
import sys
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "aelastic"
ARCHITECTURE = (ROOT / "ARCHITECTURE.md").read_text()
MAX_LINES = 600  # a module of more holds more than one idea


def _name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES: dict[str, Path] = {_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
TREES: dict[str, ast.Module] = {m: ast.parse(p.read_text(), str(p)) for m, p in MODULES.items()}


def _imports(module: str) -> Iterator[str]:
    """The aelastic modules ``module`` imports, type-only imports and imports inside functions included (a circle
    of names is a circle of ideas)."""
    is_package = MODULES[module].name == "__init__.py"
    for node in ast.walk(TREES[module]):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                prefix = ".".join([*base, *([node.module] if node.module else [])])
            else:
                prefix = node.module or ""
            targets = [f"{prefix}.{a.name}" if f"{prefix}.{a.name}" in MODULES else prefix for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in MODULES:
                target = target.rpartition(".")[0]
            if target.startswith("aelastic") and target != module:
                yield target


EDGES: dict[str, set[str]] = {m: set(_imports(m)) for m in MODULES}


def _strongly_connected(edges: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's components of more than one node, iteratively (no recursion limit)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in edges:
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_import_circle() -> None:
    # A module importing its own package's __init__ is not a circle of ideas (the package re-exports it).
    edges = {m: {t for t in ts if not m.startswith(t + ".")} for m, ts in EDGES.items()}
    assert _strongly_connected(edges) == []


def test_circles_are_found() -> None:
    """The check above can fail: a made-up circle is one."""
    assert _strongly_connected({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_module_over_the_size_limit() -> None:
    sizes = {m: len(p.read_text().splitlines()) for m, p in MODULES.items()}
    assert {m: n for m, n in sizes.items() if n > MAX_LINES} == {}


# --- sizes of functions and classes ---------------------------------------------------------------------------------

MAX_FUNCTION_LINES = 60
MAX_ATTRIBUTES = 15
# The configuration's one wide record: torch's LaunchConfig fields, and aelastic's own grouped into at most this many.
AELASTIC_FIELDS = 8
# The constructors and calls a feature's options pass through: records, not keywords.
MAX_PARAMETERS = {"aelastic.agent.agent.ElasticAgent.__init__": 8, "aelastic.agent.processes.Supervisor.run": 8}


def _functions() -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    for module in MODULES:
        for node in ast.walk(TREES[module]):
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        yield f"{module}.{node.name}.{item.name}", item
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node in TREES[module].body:
                yield f"{module}.{node.name}", node


def _attributes(node: ast.ClassDef) -> set[str]:
    """The instance attributes a class holds: assigned on ``self``, annotated in its body, or in its slots."""
    names = {
        sub.attr
        for sub in ast.walk(node)
        if isinstance(sub, ast.Attribute)
        and isinstance(sub.value, ast.Name)
        and sub.value.id == "self"
        and isinstance(sub.ctx, ast.Store)
    }
    for stmt in node.body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            names.add(stmt.target.id)
        if isinstance(stmt, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__slots__" for t in stmt.targets):
            names |= {e.value for e in getattr(stmt.value, "elts", ()) if isinstance(e, ast.Constant)}
    return names


def test_no_function_over_the_size_limit() -> None:
    long = {name: f.end_lineno - f.lineno + 1 for name, f in _functions() if (f.end_lineno or 0) - f.lineno >= 60}
    assert long == {}


def test_no_class_over_the_attribute_limit() -> None:
    """LaunchConfig, torch's fields and aelastic's records, is bounded on its own (below)."""
    counts = {
        f"{module}.{node.name}": len(_attributes(node))
        for module in MODULES
        for node in ast.walk(TREES[module])
        if isinstance(node, ast.ClassDef)
    }
    wide = {name: n for name, n in counts.items() if n > MAX_ATTRIBUTES and not name.endswith(".LaunchConfig")}
    assert wide == {}


def test_launch_config_is_torchs_and_one_record_per_feature() -> None:
    from aelastic.config import LaunchConfig

    ours = [f.name for f in dataclasses.fields(LaunchConfig)]
    torch = pytest.importorskip("torch.distributed.launcher.api")
    theirs = [f.name for f in dataclasses.fields(torch.LaunchConfig)]
    assert set(theirs) <= set(ours)
    assert len(set(ours) - set(theirs)) <= AELASTIC_FIELDS, sorted(set(ours) - set(theirs))


@pytest.mark.parametrize(("name", "bound"), sorted(MAX_PARAMETERS.items()))
def test_the_agents_wiring_takes_records(name: str, bound: int) -> None:
    function = dict(_functions())[name]
    arguments = function.args
    count = len(arguments.posonlyargs) + len(arguments.args) + len(arguments.kwonlyargs) - 1  # less self
    assert count <= bound


# --- the import map ---------------------------------------------------------------------------------------------


def _unit(module: str) -> str:
    """A unit of the map: a subpackage or top-level module of aelastic (``aelastic`` itself for its __init__)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "aelastic"


def _map() -> tuple[dict[str, set[str]], set[str]]:
    """The arrows and the leaves of ARCHITECTURE.md's import map (its first code block after "Import direction");
    parenthesised words are comments."""
    section = ARCHITECTURE.split("## Import direction", 1)[1]
    block = section.split("```", 2)[1]
    arrows: dict[str, set[str]] = defaultdict(set)
    leaves: set[str] = set()
    for line in block.splitlines():
        line = re.sub(r"\([^)]*\)", "", line).strip()
        if not line:
            continue
        if line.startswith("leaves:"):
            leaves |= {w.strip() for w in line.removeprefix("leaves:").split(",")}
            continue
        left, right = line.split("→")
        for source in left.split(","):
            arrows[source.strip()] |= {w.strip() for w in right.split(",")}
    return arrows, leaves


def _unit_edges() -> dict[str, set[str]]:
    units: dict[str, set[str]] = defaultdict(set)
    for module, targets in EDGES.items():
        units[_unit(module)] |= {_unit(t) for t in targets} - {_unit(module)}
    return units


def test_architecture_map_is_the_code() -> None:
    arrows, leaves = _map()
    code = _unit_edges()
    missing = {
        u: sorted(ts - leaves - arrows.get(u, set())) for u, ts in code.items() if ts - leaves - arrows.get(u, set())
    }
    stale = {u: sorted(ts - code.get(u, set())) for u, ts in arrows.items() if ts - code.get(u, set())}
    assert missing == {}, "imports between packages that ARCHITECTURE.md's map lacks"
    assert stale == {}, "arrows of ARCHITECTURE.md's map that no import makes"


def test_leaves_import_nothing_but_errors() -> None:
    _, leaves = _map()
    code = _unit_edges()
    assert {leaf: sorted(code[leaf] - {"errors"}) for leaf in leaves if code[leaf] - {"errors"}} == {}


def test_units_import_one_way() -> None:
    """No circle between packages either (the map is a direction, not a web)."""
    _, leaves = _map()
    code = {u: ts - leaves for u, ts in _unit_edges().items() if u not in leaves}
    assert _strongly_connected(code) == []


# --- the sans-IO cores --------------------------------------------------------------------------------------------


def _cores() -> list[str]:
    """The modules ARCHITECTURE.md names as sans-IO cores (its sentence that begins "The sans-IO cores")."""
    sentence = ARCHITECTURE.split("The sans-IO cores", 1)[1].split("\n\n", 1)[0]
    names = re.findall(r"`([\w/]+\.py)`", sentence)
    return ["aelastic." + n.removesuffix(".py").replace("/", ".") for n in names if not n.startswith("tests/")]


IO_MODULES = frozenset({"anyio", "asyncio", "trio", "sniffio", "ssl", "httpx", "h11", "uvloop"})
# Not imported by a core itself: what opens sockets, starts threads or processes, or reads a clock.
DIRECT_IO = IO_MODULES | {"socket", "select", "threading", "subprocess", "os", "time", "datetime"}


def test_the_cores_are_named() -> None:
    cores = _cores()
    assert len(cores) >= 7
    assert [c for c in cores if c not in MODULES] == []


@pytest.mark.parametrize("core", _cores())
def test_core_imports_no_io(core: str) -> None:
    assert sorted(_third_party(core) & DIRECT_IO) == []
    clocks = {
        node.attr
        for node in ast.walk(TREES[core])
        if isinstance(node, ast.Attribute) and node.attr in {"current_time", "monotonic", "perf_counter", "time_ns"}
    }
    assert clocks == set()
    # Nor through the aelastic modules it imports, and those they import in turn.
    reached, todo = set(), [core]
    while todo:
        for target in EDGES[todo.pop()] - reached:
            reached.add(target)
            todo.append(target)
    assert {m: sorted(_third_party(m) & IO_MODULES) for m in reached if _third_party(m) & IO_MODULES} == {}


def _third_party(module: str) -> set[str]:
    """The top-level names of what ``module`` imports outside aelastic."""
    tree = TREES[module]
    return {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names} | {
        n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and not n.level and n.module
    }


# --- torch's variables ----------------------------------------------------------------------------------------------

TORCH_VARIABLE = re.compile(
    r"^(PET_\w+|TORCHELASTIC_\w+|TORCH_\w+|NCCL_\w+|GLOO_\w+|LOGLEVEL|PYTHON_EXEC|MASTER_ADDR|MASTER_PORT|RANK|"
    r"LOCAL_RANK|WORLD_SIZE|GROUP_RANK|GROUP_WORLD_SIZE|LOCAL_WORLD_SIZE|ROLE_\w+|OMP_NUM_THREADS)$"
)

# Code that runs in a worker, not in the agent: it reads what the agent exported for it.
WORKER_SIDE = {"aelastic.agent.errors": "record() runs in the worker and reads its TORCHELASTIC_ERROR_FILE"}


def _child_side(module: str) -> bool:
    """Code that runs in a worker's (or a helper's) interpreter: the worker package, the frameworks' integrations,
    the agent's helpers run by path, the stack hook."""
    parts = module.split(".")
    worker_side = parts[:2] in (["aelastic", "worker"], ["aelastic", "integrations"])
    return worker_side or "child" in parts or parts[-1] == "sitecustomize"


def _environment_reads(module: str) -> Iterator[tuple[int, ast.expr]]:
    """``(line, key expression)`` of each read of the process environment: ``os.environ.get(K)`` (``pop``,
    ``setdefault``), ``os.getenv(K)``, ``os.environ[K]``, ``K in os.environ``."""

    def is_environ(node: ast.expr) -> bool:
        return isinstance(node, ast.Attribute) and node.attr == "environ" and ast.unparse(node.value) == "os"

    for node in ast.walk(TREES[module]):
        if isinstance(node, ast.Call) and node.args:
            func = node.func
            if (
                isinstance(func, ast.Attribute) and func.attr in {"get", "pop", "setdefault"} and is_environ(func.value)
            ) or ast.unparse(func) == "os.getenv":
                yield node.lineno, node.args[0]
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and is_environ(node.value):
            yield node.lineno, node.slice
        elif isinstance(node, ast.Compare) and any(is_environ(c) for c in node.comparators):
            yield node.lineno, node.left


def test_torch_variables_are_read_in_config_only() -> None:
    found = []
    for module in MODULES:
        if module.startswith("aelastic.config") or _child_side(module) or module in WORKER_SIDE:
            continue
        for line, key in _environment_reads(module):
            try:
                name = eval(compile(ast.Expression(key), module, "eval"), vars(importlib.import_module(module)))
            except Exception:
                name = None
            if not isinstance(name, str):
                found.append(f"{module}:{line}: reads the variable {ast.unparse(key)!r}, which cannot be resolved")
            elif TORCH_VARIABLE.match(name):
                found.append(f"{module}:{line}: reads torch's {name}")
    assert found == []


def test_environment_reads_are_found() -> None:
    """The scan above can fail: each form of a read is found."""
    tree = ast.parse("import os\nos.environ.get('A')\nos.getenv('B')\nos.environ['C']\n'D' in os.environ\n")
    TREES["aelastic.__probe__"] = tree
    try:
        assert [ast.literal_eval(k) for _, k in _environment_reads("aelastic.__probe__")] == ["A", "B", "C", "D"]
    finally:
        del TREES["aelastic.__probe__"]


# --- no side channels ---------------------------------------------------------------------------------------------

# Process-global state, each with why it is allowed (ARCHITECTURE.md, "No side channels").
GLOBAL_STATE = {
    ("aelastic.metrics", "_default"): "torch's metrics API: configure() sets the process's handler",
    ("aelastic.metrics", "_groups"): "torch's metrics API: configure(handler, group)",
    ("aelastic.events", "_factories"): "a registry by name: register_event_handler()",
    ("aelastic.rendezvous.registry", "_entries"): "a registry by name: register_backend()",
    ("aelastic.rendezvous.api", "_warned_keys"): "a warning once per process and key",
    ("aelastic.worker._link", "_link"): "a worker's one link to its agent",
    ("aelastic.worker._link", "_before_yield"): "a worker's work its exit report waits for: the process ends",
    ("aelastic.worker._restart", "_session"): "a worker's one restart session with its agent",
    ("aelastic.worker._timers", "_last_heartbeat"): "a worker's watchdog: when it last beat",
    ("aelastic.worker._checkpoint.api", "_clients"): "a worker's one checkpoint client per agent",
    ("aelastic.worker._checkpoint.heap", "_warmed"): "a worker's heap, warmed by the standby it started in",
    ("aelastic.worker._checkpoint.heap", "_kept"): "a restartable worker's heap, kept for its next rounds",
    ("aelastic.worker._checkpoint.premapped", "_mapped"): "a worker's slots, mapped by the standby it started in",
}
_MUTATORS = frozenset(
    {"add", "append", "clear", "discard", "extend", "insert", "pop", "popitem", "remove", "setdefault", "update"}
)


def _global_state(module: str) -> set[str]:
    """The module-level names that functions of ``module`` rebind (``global``) or mutate in place."""
    tree = TREES[module]
    top = {
        t.id
        for node in tree.body
        for t in (
            node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        )
        if isinstance(t, ast.Name)
    }
    found: set[str] = set()
    for function in ast.walk(tree):
        if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(function):
            if isinstance(node, ast.Global):
                found |= set(node.names)
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _MUTATORS:
                if isinstance(node.func.value, ast.Name) and node.func.value.id in top:
                    found.add(node.func.value.id)
            elif isinstance(node, (ast.Assign, ast.AugAssign, ast.Delete)):
                targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
                found |= {
                    t.value.id
                    for t in targets
                    if isinstance(t, ast.Subscript) and isinstance(t.value, ast.Name) and t.value.id in top
                }
    return found


def test_no_process_global_state_but_the_declared() -> None:
    found = {(m, name) for m in MODULES for name in _global_state(m)}
    assert sorted(found - set(GLOBAL_STATE)) == []
    assert sorted(set(GLOBAL_STATE) - found) == [], "declared global state that is gone: remove its entry"


def test_context_variables_only_for_the_event_log() -> None:
    users = sorted(m for m, p in MODULES.items() if "ContextVar" in p.read_text())
    assert users == ["aelastic.events"]


# --- the error tree -----------------------------------------------------------------------------------------------

# Exceptions defined outside errors.py that a caller can meet, each with why it lives where it does.
PUBLIC_ELSEWHERE = {
    ("aelastic.agent.errors", "ChildFailedError"): "the failure report itself, with the failure records it formats",
    ("aelastic.agent.errors", "NoProgressError"): "a failure report (ChildFailedError's kind), beside it",
    ("aelastic.agent.errors", "FailedElsewhereError"): "a failure report (ChildFailedError's kind), beside it",
}


def _exception_classes() -> Iterator[tuple[str, str]]:
    for module in MODULES:
        if _child_side(module):
            continue  # a worker's code, some of it not importable here (a start-up hook); exempt below anyway
        for name, value in vars(importlib.import_module(module)).items():
            if isinstance(value, type) and issubclass(value, BaseException) and value.__module__ == module:
                yield module, name


def _public(module: str) -> bool:
    """A module users import names from: a package, or a module at aelastic's top level (not a private one)."""
    parts = module.split(".")
    return not any(p.startswith("_") for p in parts) and (MODULES[module].name == "__init__.py" or len(parts) == 2)


def _exported() -> set[str]:
    """The names the public modules export (their ``__all__``)."""
    names: set[str] = set()
    for module in MODULES:
        if _public(module) and not _child_side(module):
            names |= set(getattr(importlib.import_module(module), "__all__", ()))
    return names


def test_exceptions_live_in_errors_py() -> None:
    """Every exception a caller can meet is defined in errors.py, except those declared above; the others never
    leave aelastic (no public module exports them), or are a child side's (a worker's: they import nothing of
    aelastic, so they derive from builtins)."""
    exported = _exported()
    stray = [
        f"{module}.{name}"
        for module, name in _exception_classes()
        if module != "aelastic.errors"
        and (module, name) not in PUBLIC_ELSEWHERE
        and not _child_side(module)
        and name in exported
    ]
    assert stray == []
    assert all(name in exported for _, name in PUBLIC_ELSEWHERE)


# --- the agent never imports torch ----------------------------------------------------------------------------------

HEAVY = frozenset({"torch", "numpy"})


def _module_level_imports(module: str) -> Iterator[ast.Import | ast.ImportFrom]:
    """The import statements that run when ``module`` is imported: at its top level and in the blocks there (a
    class body, ``try``, ``if``), not in functions, nor under ``if TYPE_CHECKING``."""
    todo: list[ast.stmt] = list(TREES[module].body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If) and ast.unparse(node.test) in {"TYPE_CHECKING", "typing.TYPE_CHECKING"}:
            todo += node.orelse
        elif not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            todo += [child for child in ast.iter_child_nodes(node) if isinstance(child, ast.stmt)]
            if isinstance(node, ast.Try):
                todo += [stmt for handler in node.handlers for stmt in handler.body]


def _loaded_at_import(module: str) -> tuple[set[str], set[str]]:
    """(aelastic modules, other top-level modules) that importing ``module`` loads: its module-level imports, those
    of the aelastic modules they load in turn, and each one's packages (``import a.b`` runs ``a/__init__.py``)."""
    ours: set[str] = set()
    others: set[str] = set()
    todo = [module]
    while todo:
        current = todo.pop()
        if current in ours:
            continue
        ours.add(current)
        parent = current.rpartition(".")[0]
        todo += [parent] if parent in MODULES else []  # a namespace package runs nothing
        is_package = MODULES[current].name == "__init__.py"
        for node in _module_level_imports(current):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif node.level:
                base = current.split(".") if is_package else current.split(".")[:-1]
                prefix = ".".join([*base[: len(base) - (node.level - 1)], *([node.module] if node.module else [])])
                names = [f"{prefix}.{a.name}" if f"{prefix}.{a.name}" in MODULES else prefix for a in node.names]
            else:
                names = [node.module or ""]
            for name in names:
                if name.partition(".")[0] != "aelastic":
                    others.add(name.partition(".")[0])
                    continue
                while name not in MODULES:
                    name = name.rpartition(".")[0]
                todo.append(name)
    return ours, others


AGENT_SIDE = sorted(m for m in MODULES if not _child_side(m))


@pytest.mark.parametrize("module", AGENT_SIDE)
def test_the_agent_side_never_imports_torch(module: str) -> None:
    """No module outside ``aelastic/worker/`` (and the helpers run by path) imports torch or numpy when it is
    imported, itself or through the aelastic modules and packages it imports at module level."""
    ours, others = _loaded_at_import(module)
    heavy = {m: sorted(_loaded_at_import(m)[1] & HEAVY) for m in ours if _loaded_at_import(m)[1] & HEAVY}
    assert others & HEAVY == set(), f"{module} loads {sorted(others & HEAVY)} through {heavy}"


def test_torch_imports_are_found() -> None:
    """The scan above can fail: a module-level import is found, through a package too; one in a function or under
    TYPE_CHECKING is not."""
    TREES["aelastic.__probe__"] = ast.parse(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import numpy\ntry:\n    import torch\n"
        "except ImportError:\n    pass\ndef f():\n    import scipy\n"
    )
    MODULES["aelastic.__probe__"] = PACKAGE / "__probe__.py"
    try:
        assert _loaded_at_import("aelastic.__probe__")[1] & {"numpy", "torch", "scipy"} == {"torch"}
    finally:
        del TREES["aelastic.__probe__"], MODULES["aelastic.__probe__"]
    assert "torch" in _loaded_at_import("aelastic.worker._checkpoint.dcp")[1]


def test_the_agent_process_loads_no_torch() -> None:
    """The same, as the interpreter sees it: every agent-side module imported in one process, torch not loaded."""
    code = (
        "import importlib, json, sys\n"
        f"for name in {[m for m in AGENT_SIDE if m != 'aelastic.__main__']!r}:\n"
        "    importlib.import_module(name)\n"
        "print(json.dumps(sorted(m for m in ('torch', 'numpy') if m in sys.modules)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == []


def test_config_imports_nothing_of_the_agent() -> None:
    """config/ checks values and hands them down; the agent imports its records, never the reverse."""
    found = {m: sorted(t for t in EDGES[m] if _unit(t) == "agent") for m in MODULES if _unit(m) == "config"}
    assert {m: ts for m, ts in found.items() if ts} == {}


# --- a worker's state -----------------------------------------------------------------------------------------------

LIFECYCLE = "aelastic.agent.lifecycle"
# The attributes a worker's state lived in before its lifecycle table, and the table's own.
WORKER_STATE = frozenset({"_phase", "phase", "stopping", "failing", "exitcode"})


def _state_assignments(module: str) -> Iterator[str]:
    """``line: target`` of each assignment of a worker's state in ``module``: to an attribute named in
    :data:`WORKER_STATE`, or of a ``Phase`` member."""
    for node in ast.walk(TREES[module]):
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets, value = [node.target], node.value
        else:
            continue
        for target in targets:
            if isinstance(target, ast.Attribute) and target.attr in WORKER_STATE:
                yield f"{node.lineno}: {ast.unparse(target)}"
        if value is not None and "Phase." in ast.unparse(value):
            yield f"{node.lineno}: {ast.unparse(value)}"


def test_a_workers_state_changes_only_in_its_lifecycle_table() -> None:
    found = {m: list(_state_assignments(m)) for m in MODULES if m != LIFECYCLE and list(_state_assignments(m))}
    assert found == {}
    from aelastic.agent.started import Tracked

    assert set(Tracked.__slots__) & {"stopping", "failing", "reported", "exitcode", "timestamp"} == set()


def test_state_assignments_are_found() -> None:
    """The scan above can fail: a flag set on a worker, and a phase assigned, are found."""
    TREES["aelastic.__probe__"] = ast.parse("worker.stopping = True\nphase = Phase.REAPED\nw.exitcode += 1\n")
    try:
        assert list(_state_assignments("aelastic.__probe__")) == [
            "1: worker.stopping", "2: Phase.REAPED", "3: w.exitcode"
        ]  # fmt: skip
    finally:
        del TREES["aelastic.__probe__"]


# --- the codemap -------------------------------------------------------------------------------------------------


def _table(heading: str) -> list[list[str]]:
    """The rows (cells) of the table under ARCHITECTURE.md's ``## heading``, its header left out."""
    section = ARCHITECTURE.split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]
    rows = [line.strip().strip("|").split("|") for line in section.splitlines() if line.startswith("| ")]
    return [[cell.strip() for cell in row] for row in rows[1:]]


def _paths(cell: str) -> set[str]:
    """The modules (``x.py``) and packages (``x/``) a cell names."""
    return {name for name in re.findall(r"`([^`]+)`", cell) if name.endswith((".py", "/"))}


def _contents(package: Path) -> set[str]:
    """A package's modules and subpackages, as the codemap names them."""
    return {p.name for p in package.glob("*.py") if p.stem not in ("__init__", "__main__")} | {
        f"{p.name}/" for p in package.iterdir() if (p / "__init__.py").exists()
    }


CODEMAP = {PACKAGE / row[0].strip("`").removeprefix("aelastic/"): _paths(row[1]) for row in _table("Where things live")}
FEATURES = _table("Where each feature lives")


def test_the_codemap_names_what_exists_and_all_of_it() -> None:
    """Each package's row of "Where things live" names only its modules and packages that exist, and all of them but
    the agent's feature packages, which "Where each feature lives" names (with the worker's side of each)."""
    agent_side = set().union(*(_paths(row[2]) for row in FEATURES))
    worker_side = set().union(*(_paths(row[3]) for row in FEATURES))
    named = {package: set(names) for package, names in CODEMAP.items()}
    named[PACKAGE] |= {f"{p.name}/" for p in CODEMAP if p != PACKAGE}  # rows of their own
    named[PACKAGE / "agent"] |= agent_side
    named[PACKAGE / "worker"] |= worker_side
    assert {p.name: sorted(n - _contents(p)) for p, n in named.items() if n - _contents(p)} == {}, "named, not there"
    assert {p.name: sorted(_contents(p) - n) for p, n in named.items() if _contents(p) - n} == {}, "there, not named"
    assert sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists() and p not in CODEMAP) == []


def test_each_features_options_exist() -> None:
    """The options column names a record of config/options.py (or one of its fields) or a field of LaunchConfig."""
    from aelastic.config import options
    from aelastic.config.launch_config import LaunchConfig

    fields = {f.name for f in dataclasses.fields(LaunchConfig)}
    for row in FEATURES:
        for name in re.findall(r"`([^`]+)`", row[1]):
            record, _, field = name.partition(".")
            assert hasattr(options, record) or record in fields, name
            assert not field or field in {f.name for f in dataclasses.fields(getattr(options, record))}, name
