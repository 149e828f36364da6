"""The classification of an upstream suite run against aelastic (``tests/torch_launcher``, ``tests/torch_store``).

Each folder's conftest keeps one table, test id → ``(kind, reason, match)``: kind (a) tests what aelastic does not
imitate (torch's internals, mocks of them), (b) a deliberate difference, (c) a limitation; ``match`` is the
pattern the failure must show, or None to skip the test. A classified test that fails as its entry says is an
expected failure; one that fails otherwise fails; one that passes fails too (a stale entry).
"""

from __future__ import annotations

import importlib.util
import re
import sys
from collections.abc import Callable, Generator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

Entry = tuple[str, str, "str | None"]

_ENTRY = pytest.StashKey[tuple[str, str, str]]()


def apply(items: list[pytest.Item], classified: dict[str, Entry]) -> None:
    """At collection: skip the entries without a pattern, remember the others for :func:`judge`."""
    ids = {item.nodeid.split("upstream/", 1)[1]: item for item in items}
    for test_id, (kind, reason, match) in classified.items():
        item = ids.get(test_id)
        if item is None:
            continue
        if match is None:
            item.add_marker(pytest.mark.skip(reason=f"({kind}) {reason}"))
        else:
            item.stash[_ENTRY] = (kind, reason, match)


def judge(item: pytest.Item, report: pytest.TestReport, suite: str) -> pytest.TestReport:
    """At report time (a ``pytest_runtest_makereport`` wrapper): the outcome the item's entry says."""
    entry = item.stash.get(_ENTRY, None)
    if entry is None or report.when != "call":
        return report
    kind, reason, match = entry
    if report.failed and re.search(match, report.longreprtext):
        report.outcome = "skipped"
        report.wasxfail = f"({kind}) {reason}"
    elif report.failed:
        report.sections.append(
            (
                f"{suite} classification",
                f"classified ({kind}) failing with /{match}/, but it failed otherwise: {reason}",
            )
        )
    elif report.passed:
        report.outcome = "failed"
        report.longrepr = f"[XPASS(strict)] classified ({kind}) but passed: remove its CLASSIFIED entry: {reason}"
    return report


def check_kinds(classified: dict[str, Entry]) -> None:
    """(b) and (c) name the failure they expect; (a) is skipped unless it names the failure it expects."""
    for test_id, (kind, reason, match) in classified.items():
        assert kind in ("a", "b", "c"), test_id
        assert reason, test_id
        assert match is not None or kind == "a", test_id


def hooks(
    suite: str, upstream: Path, timeout_s: float, classified: dict[str, Entry] | None
) -> tuple[Callable[..., Any], ...]:
    """A suite conftest's ``pytest_collection_modifyitems`` and ``pytest_runtest_makereport``: the upstream tests
    get ``timeout_s`` each and, unless ``classified`` is None (a run against torch itself), the table."""

    def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
        ours = [item for item in items if upstream in item.path.parents]
        for item in ours:
            item.add_marker(pytest.mark.timeout(timeout_s))
        if classified is not None:
            apply(ours, classified)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(
        item: pytest.Item, call: pytest.CallInfo[None]
    ) -> Generator[None, pytest.TestReport, pytest.TestReport]:
        return judge(item, (yield), suite)

    return pytest_collection_modifyitems, pytest_runtest_makereport


def load_module(path: Path, name: str) -> ModuleType:
    """The module ``name`` from ``path``, loaded once (``sys.modules``): a suite's shim, or its conftest for a test
    of its table (pytest imports conftests under names of its own)."""
    module = sys.modules.get(name)
    if module is None:
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None
        assert spec.loader is not None
        module = sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return module
