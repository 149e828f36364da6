"""The classification table of conftest.py names only tests that upstream/ has (a renamed test must not leave a
stale entry behind), and each entry is well-formed."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from helpers import classification

_conftest = classification.load_module(Path(__file__).with_name("conftest.py"), "torch_store_conftest")
CLASSIFIED, UPSTREAM_FILE = _conftest.CLASSIFIED, _conftest.UPSTREAM_FILE


def upstream_test_ids() -> set[str]:
    """``test_store.py::Class::test`` of every test method, inherited ones included (``LibUvTCPStoreTest`` runs
    ``TCPStoreTest``'s), as pytest names them."""
    classes = {n.name: n for n in ast.parse(UPSTREAM_FILE.read_text()).body if isinstance(n, ast.ClassDef)}

    def methods(name: str) -> set[str]:
        node = classes.get(name)
        if node is None:
            return set()
        own = {f.name for f in node.body if isinstance(f, ast.FunctionDef) and f.name.startswith("test")}
        return own.union(*(methods(base.id) for base in node.bases if isinstance(base, ast.Name)))

    return {f"test_store.py::{name}::{method}" for name in classes for method in methods(name)}


@pytest.mark.skipif(not _conftest.FETCHED, reason=_conftest.MISSING)
def test_classified_tests_exist() -> None:
    assert set(CLASSIFIED) <= upstream_test_ids(), sorted(set(CLASSIFIED) - upstream_test_ids())


def test_kinds() -> None:
    classification.check_kinds(CLASSIFIED)
