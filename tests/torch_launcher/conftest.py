"""PyTorch's own launcher tests (``upstream/``, unmodified) run against aelastic.

``shim/aelastic_torch_shim.py`` points ``torch.distributed.launcher.api.launch_agent`` (behind ``elastic_launch``)
and ``torch.distributed.run.main`` (torchrun) at aelastic. Every test that does not pass is in ``CLASSIFIED``
below, the one place that says why:

* ``a``: the test mocks or calls torch internals that aelastic does not have, or runs torch's code only; it
  says nothing about aelastic's behaviour. Skipped, or, where the test first checks a behaviour and then asserts
  on a mock of torch's, an expected failure that must fail on that mock's assertion.
* ``b``: a deliberate difference, named by its row of README's "From torchrun" table.
* ``c``: an aelastic defect, with its reproduction and the function at fault.

Entries of kind b and c carry a regex that the failure must match: such a failure is reported as XFAIL with the
reason; a failure that does not match fails, and so does a pass (XPASS(strict): the entry is stale, e.g. the
defect was fixed). A failure not listed here fails the run. No test is of kind b or c today.

The files of ``upstream/`` are PyTorch's and are not committed: ``upstream/README.md`` says which to copy there.
Without them this folder's tests are skipped with that reason.

``pytest tests/torch_launcher`` takes about 2 min on a busy 2-CPU machine; the same files against torch take
about 4 min. ``TORCH_LAUNCHER_TARGET=torch`` runs them against torch itself (no shim, no
classification): the baseline, where all pass but the two-GPU test.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
from helpers import classification

HERE = Path(__file__).parent
UPSTREAM = HERE / "upstream"
SHIM = HERE / "shim"
TARGET = os.environ.get("TORCH_LAUNCHER_TARGET", "aelastic")
CLASSIFY = TARGET == "aelastic"
TIMEOUT_S = 240  # per test; these tests start launchers and workers (a few seconds each when well)

collect_ignore_glob = ["upstream/bin/*"]
FETCHED = (UPSTREAM / "api_test.py").is_file() and (UPSTREAM / "test_run.py").is_file()
MISSING = "PyTorch's launcher tests are not in tests/torch_launcher/upstream/: see its README.md to fetch them"
if not FETCHED:
    collect_ignore_glob.append("upstream/*")

TORCH_ONLY = "calls torch's own code only ({}); no launcher runs, so it says nothing about aelastic"
MOCKED_AGENT = "mocks torch's {} and asserts on the mock; aelastic's agent and rendezvous are its own: never called"
RECORD_MOCK = (
    "runs the launch through aelastic, which raises {} as expected (the behaviour), then asserts that torch's "
    "events.record was called (a mock of torch's event API; aelastic records its own events, aelastic.events)"
)
RECORD_MOCK_MATCH = r"AssertionError: Expected 'record' to have been called once\. Called 0 times\."

# test id under upstream/ -> (kind, reason, regex the failure must match; None: skipped, kind a only)
CLASSIFIED: dict[str, tuple[str, str, str | None]] = {
    # --- api_test.py
    "api_test.py::ElasticLaunchTest::test_launch_elastic_worker_raise_exception": (
        "a",
        RECORD_MOCK.format("torch's ChildFailedError"),
        RECORD_MOCK_MATCH,
    ),
    "api_test.py::ElasticLaunchTest::test_launch_elastic_agent_raise_exception": (
        "a",
        MOCKED_AGENT.format("LocalElasticAgent.run (side effect MockException)"),
        None,
    ),
    "api_test.py::ElasticLaunchTest::test_launch_shutdown": (
        "a",
        MOCKED_AGENT.format("LocalElasticAgent and rendezvous registry (shutdown() of a mock handler)"),
        None,
    ),
    "api_test.py::ElasticLaunchTest::test_rdzv_handler_shutdown_on_agent_error": (
        "a",
        MOCKED_AGENT.format("LocalElasticAgent.run and rendezvous registry"),
        None,
    ),
    "api_test.py::ElasticLaunchTest::test_rdzv_handler_shutdown_on_agent_signal": (
        "a",
        MOCKED_AGENT.format("LocalElasticAgent.run (SignalException) and rendezvous registry"),
        None,
    ),
    "api_test.py::ElasticLaunchTest::test_get_entrypoint_name": (
        "a",
        TORCH_ONLY.format("torch.distributed.launcher.api._get_entrypoint_name"),
        None,
    ),
    # --- test_run.py
    "test_run.py::ElasticLaunchTest::test_launch_elastic_worker_raise_exception": (
        "a",
        RECORD_MOCK.format("torch's ChildFailedError (exit 1 with the failure report)"),
        RECORD_MOCK_MATCH,
    ),
    "test_run.py::ElasticLaunchTest::test_launch_elastic_agent_raise_exception": (
        "a",
        MOCKED_AGENT.format("LocalElasticAgent.run (side effect MockException)"),
        None,
    ),
    "test_run.py::ElasticLaunchTest::test_launch_shutdown": (
        "a",
        MOCKED_AGENT.format("LocalElasticAgent and rendezvous registry (shutdown() of a mock handler)"),
        None,
    ),
    "test_run.py::ElasticLaunchTest::test_nproc_gpu_launch_configurations": (
        "a",
        "patches torch.cuda/torch.accelerator to pretend 3 GPUs; aelastic counts GPUs without torch (/dev/nvidia<N>, "
        "CUDA_VISIBLE_DEVICES), so the mock is not seen and 'auto' gives the CPU count",
        None,
    ),
    "test_run.py::ElasticLaunchTest::test_nproc_xpu_launch_configurations": (
        "a",
        "patches torch.xpu/torch.accelerator to pretend 3 XPUs (the mock is not seen, as for the GPU test); note "
        "that aelastic has no 'xpu' spelling of --nproc-per-node at all (exit 2), where torch counts torch.xpu",
        None,
    ),
    "test_run.py::ElasticLaunchTest::test_min_max_nodes_parse": (
        "a",
        TORCH_ONLY.format("torch.distributed.run.parse_min_max_nnodes"),
        None,
    ),
    "test_run.py::ElasticLaunchTest::test_is_not_torchelastic_launched": (
        "a",
        TORCH_ONLY.format("the bin/ script run with runpy, without a launcher"),
        None,
    ),
}


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "multigpu: upstream's marker for tests that need two GPUs")
    if TARGET not in ("aelastic", "torch"):
        raise pytest.UsageError(f"TORCH_LAUNCHER_TARGET={TARGET!r}: must be aelastic or torch")


def _shim() -> ModuleType:
    return classification.load_module(SHIM / "aelastic_torch_shim.py", "aelastic_torch_shim")


@pytest.fixture(autouse=True)
def _aelastic_behind_torch(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """For each test here only (the rest of the suite, e.g. tests/test_cli_parity.py's real torchrun, must keep
    torch's own launcher): torch's entry points run aelastic, in this process and (sitecustomize.py on PYTHONPATH)
    in the interpreters the test starts; and what upstream's tests leave behind (PET_* variables, the CLI's root
    logging handler) is undone afterwards."""
    environ, handlers, level = dict(os.environ), logging.root.handlers[:], logging.root.level
    if TARGET == "aelastic":
        import torch.distributed.launcher.api
        import torch.distributed.run

        shim = _shim()
        monkeypatch.setattr(torch.distributed.launcher.api, "launch_agent", shim.launch_agent)
        monkeypatch.setattr(torch.distributed.run, "main", shim.main)
        monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(SHIM), os.environ.get("PYTHONPATH")])))
        monkeypatch.setenv("TORCH_LAUNCHER_SHIM", "1")
    yield
    os.environ.clear()
    os.environ.update(environ)
    logging.root.handlers[:] = handlers
    logging.root.setLevel(level)


pytest_collection_modifyitems, pytest_runtest_makereport = classification.hooks(
    "torch_launcher", UPSTREAM, TIMEOUT_S, CLASSIFIED if CLASSIFY else None
)
