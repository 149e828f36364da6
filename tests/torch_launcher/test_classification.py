"""The classification table of conftest.py names only tests that upstream/ has (a renamed test must not leave a
stale entry behind)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from helpers import classification

_conftest = classification.load_module(Path(__file__).with_name("conftest.py"), "torch_launcher_conftest")
CLASSIFIED, UPSTREAM = _conftest.CLASSIFIED, _conftest.UPSTREAM

pytestmark = pytest.mark.skipif(not _conftest.FETCHED, reason=_conftest.MISSING)


def upstream_test_ids() -> set[str]:
    ids = set()
    for name in ("api_test.py", "test_run.py"):
        tree = ast.parse((UPSTREAM / name).read_text())
        for node in tree.body:
            if isinstance(node, ast.ClassDef):
                ids |= {
                    f"{name}::{node.name}::{f.name}"
                    for f in node.body
                    if isinstance(f, ast.FunctionDef) and f.name.startswith("test")
                }
    return ids


def test_classified_tests_exist() -> None:
    assert set(CLASSIFIED) <= upstream_test_ids(), sorted(set(CLASSIFIED) - upstream_test_ids())


def test_kinds() -> None:
    classification.check_kinds(CLASSIFIED)
