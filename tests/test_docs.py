"""The documentation against the code: every flag of every parser has its entry in the generated command-line
reference, every ``--rdzv-conf`` key its row, every environment variable the code reads or sets its line, and the
README's test command is the one ``.ci/run`` runs. (The site's own build, ``python -m sphinx -W``, checks its links
and references; ``.ci/run`` runs it.)"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
sys.path.insert(0, str(DOCS / "_ext"))

import reference  # noqa: E402  (docs/_ext, put on the path above)


def _all_actions() -> list[tuple[tuple[str, ...], argparse.Action]]:
    """Every action of every parser of ``aelastic``, found by walking the parsers (not through the generator)."""
    from aelastic.cli import build_parser

    found: list[tuple[tuple[str, ...], argparse.Action]] = []

    def walk(words: tuple[str, ...], parser: argparse.ArgumentParser) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk((*words, name), sub)
            elif not isinstance(action, argparse._HelpAction):
                found.append((words, action))

    walk(("aelastic",), build_parser())
    return found


CLI_PAGE = reference.cli_markdown()


@pytest.mark.parametrize(
    ("words", "action"),
    [
        pytest.param(w, a, id=" ".join([*w[1:], a.option_strings[-1] if a.option_strings else a.dest]))
        for w, a in _all_actions()
    ],
)
def test_every_flag_has_a_reference_entry(words: tuple[str, ...], action: argparse.Action) -> None:
    label = reference.anchor(words, action)
    assert f"({label})=" in CLI_PAGE, f"{' '.join(words)} {action.option_strings or action.dest}: no entry"
    entry = CLI_PAGE.split(f"({label})=", 1)[1].split("\n(", 1)[0]
    for option in action.option_strings:
        assert f"`{option}`" in entry, option
    assert action.help, "a flag without help has an empty entry: give it a help text"
    assert action.help.strip(), "a flag without help has an empty entry: give it a help text"


def test_every_command_has_a_section() -> None:
    from aelastic.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for name in sub.choices:
        assert f"(cli-{name})=" in CLI_PAGE, name


def test_the_pet_variables_are_those_the_parser_reads() -> None:
    """The reference names PET_NNODES for --nnodes, and none for --dry-run (torchrun reads none for it)."""
    pets = reference.pet_variables()
    assert pets["nnodes"] == "PET_NNODES"
    assert pets["checkpoint_dir"] == "PET_CHECKPOINT_DIR"
    assert "dry_run" not in pets
    assert "watchdog_timeout" not in pets


def test_every_rdzv_conf_key_has_a_row() -> None:
    from aelastic.rendezvous.registry import lookup

    page = reference.rdzv_conf_markdown()
    for backend in ("c10d", "etcd", "static"):
        section = page.split(f"## `{backend}`", 1)[1].split("\n## ", 1)[0]
        keys = lookup(backend).keys
        assert keys, f"{backend} declares no keys"
        for key in keys:
            assert f"| `{key.name}`" in section, (backend, key.name)
            assert key.doc.strip(), (backend, key.name)
    for key in ("fast_quorum", "disconnect_grace", "auth_token"):  # the keys the README's old list lacked
        assert f"`{key}`" in page, key


# --- environment variables ----------------------------------------------------------------------------------------

VARIABLE = re.compile(r"^(AELASTIC|TORCHELASTIC|TORCH|SLURM)_[A-Z0-9_]+$")
NOT_VARIABLES = {"TORCHRUN_TIMEOUT"}  # a constant's name in an __all__, not a variable


def _variables_in_code() -> set[str]:
    """The names of the variable families above that aelastic's code spells out (reads or sets)."""
    names: set[str] = set()
    for path in (ROOT / "aelastic").rglob("*.py"):
        tree = ast.parse(path.read_text())
        exported = {
            id(e)
            for node in ast.walk(tree)
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets)
            for e in ast.walk(node.value)
        }
        names |= {
            node.value
            for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in exported
            and VARIABLE.match(node.value)
        }  # fmt: skip
    return names - NOT_VARIABLES


def test_every_variable_the_code_uses_is_documented() -> None:
    page = (DOCS / "reference" / "environment.md").read_text()
    found = _variables_in_code()
    assert len(found) > 20
    assert sorted(v for v in found if f"`{v}`" not in page) == []


# --- the README -----------------------------------------------------------------------------------------------------


def _readme() -> str:
    return (ROOT / "README.md").read_text()


def test_the_readme_is_a_first_page() -> None:
    assert len(_readme().splitlines()) <= 150


def test_ci_runs_the_readmes_test_command() -> None:
    command = next(line.strip() for line in _readme().splitlines() if line.strip().endswith("&& pytest"))
    install_and_test = command.split("&& ", 1)[1] if command.startswith("python3 -m venv") else command
    install_and_test = install_and_test.split(". .venv/bin/activate && ", 1)[-1]
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert install_and_test in ci, f"{install_and_test!r}: not a line of .ci/run"
