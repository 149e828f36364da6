"""Point torch's launcher entry points at aelastic, so that PyTorch's own launcher tests exercise aelastic.

Two functions are replaced, nothing else of torch and nothing of aelastic:

* ``torch.distributed.launcher.api.launch_agent`` (which ``elastic_launch`` calls): torch's ``LaunchConfig`` is
  converted field by field to aelastic's and the job runs with ``aelastic.run(config, entrypoint, *args)``;
  ``aelastic.ChildFailedError`` becomes torch's ``ChildFailedError`` (same failures), other errors pass as they are.
* ``torch.distributed.run.main`` (torchrun's ``main``): the argv goes to ``aelastic.cli.main(["run", *argv])``.
  Exit code 0 returns ``None`` as torch's does; 2 (aelastic's refusal of bad input, one line on stderr) raises
  ``ValueError`` with that line, as torch raises ``ValueError`` for bad input; 1 after a worker failure raises
  torch's ``ChildFailedError``; any other code raises ``SystemExit`` with it (torch would raise the error that
  the CLI printed). argparse's own ``SystemExit(2)`` passes through in both.

To tell a worker failure from other exit-1 causes, ``main`` observes the ``ChildFailedError`` that
``aelastic.cli.launch`` raises (a wrapper that re-raises it unchanged, installed for the duration of the call).

In the pytest process, ``tests/torch_launcher/conftest.py`` sets the two functions for each test of that folder only;
the interpreters a test starts (``multiprocessing`` spawn children) get them from ``sitecustomize.py`` beside this
file, which the conftest puts on ``PYTHONPATH`` with ``TORCH_LAUNCHER_SHIM=1`` and which calls ``install()``.
A test module's own ``from torch.distributed.launcher.api import launch_agent`` keeps torch's function (only the
tests of kind (a) call it that way).
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import io
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

_TARGETS = ("torch.distributed.launcher.api", "torch.distributed.run")


def aelastic_config(config: Any) -> Any:
    """aelastic's ``LaunchConfig`` for torch's ``config``, field by field (values passed as torch has them)."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs

    import aelastic
    from aelastic.config.options import LogOptions
    from aelastic.config.streams import Std

    def std(spec: Any) -> Any:
        if isinstance(spec, dict):
            return {rank: Std(int(value)) for rank, value in spec.items()}
        return Std(int(spec))

    logs: dict[str, Any] = {}
    specs = config.logs_specs
    if type(specs) is DefaultLogsSpecs:  # torch's default layout: aelastic's own, from the same four settings
        ranks = None if specs._local_ranks_filter is None else frozenset(specs._local_ranks_filter)
        logs = {"logs": LogOptions(specs.root_log_dir, std(specs._redirects), std(specs._tee), ranks)}
    elif specs is not None:  # a custom LogsSpecs: aelastic follows its reify()
        logs = {"logs_specs": specs}
    return aelastic.LaunchConfig(
        min_nodes=config.min_nodes,
        max_nodes=config.max_nodes,
        nproc_per_node=config.nproc_per_node,
        run_id=config.run_id,
        role=config.role,
        rdzv_endpoint=config.rdzv_endpoint,
        rdzv_backend=config.rdzv_backend,
        rdzv_configs=dict(config.rdzv_configs),
        rdzv_timeout=config.rdzv_timeout,
        max_restarts=config.max_restarts,
        monitor_interval=config.monitor_interval,
        start_method=config.start_method,
        log_line_prefix_template=config.log_line_prefix_template,
        metrics_cfg=dict(config.metrics_cfg),
        local_addr=config.local_addr,
        event_log_handler=config.event_log_handler,
        signals_to_handle=config.signals_to_handle,
        virtual_local_rank=config.virtual_local_rank,
        duplicate_stdout_filters=config.duplicate_stdout_filters,  # torch's None defaults mean what they mean there
        duplicate_stderr_filters=config.duplicate_stderr_filters,
        shutdown_timeout=config.shutdown_timeout,
        numa_options=config.numa_options,
        **logs,
    )


def torch_child_failed(error: Any) -> BaseException:
    """torch's ``ChildFailedError`` with the failures of aelastic's ``error``."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    failures = {
        rank: ProcessFailure(local_rank=f.local_rank, pid=f.pid, exitcode=f.exitcode, error_file=f.error_file)
        for rank, f in error.failures.items()
    }
    return ChildFailedError(name=error.name, failures=failures)


def launch_agent(config: Any, entrypoint: Any, args: list[Any], health_check_server: Any = None) -> dict[int, Any]:
    """torch's ``launch_agent``, run by aelastic."""
    import aelastic

    try:
        return aelastic.run(aelastic_config(config), entrypoint, *args)
    except aelastic.ChildFailedError as exc:
        raise torch_child_failed(exc) from exc


@contextlib.contextmanager
def _observe_child_failures() -> Iterator[list[BaseException]]:
    """Record the ``ChildFailedError`` that the command line's ``launch`` raises; behaviour unchanged."""
    import aelastic.cli

    seen: list[BaseException] = []
    original = aelastic.cli.launch

    async def launch(*args: Any, **kwargs: Any) -> Any:
        try:
            return await original(*args, **kwargs)
        except aelastic.ChildFailedError as exc:
            seen.append(exc)
            raise

    aelastic.cli.launch = launch  # type: ignore[assignment]
    try:
        yield seen
    finally:
        aelastic.cli.launch = original  # type: ignore[assignment]


class _Tee(io.TextIOBase):
    def __init__(self, stream: Any) -> None:
        self.stream, self.text = stream, io.StringIO()

    def write(self, s: str) -> int:
        self.text.write(s)
        return int(self.stream.write(s))

    def flush(self) -> None:
        self.stream.flush()


def main(args: Sequence[str] | None = None) -> None:
    """torchrun's ``main``, run by ``aelastic run``."""
    from aelastic import cli

    argv = list(sys.argv[1:] if args is None else args)
    stderr = _Tee(sys.stderr)
    with _observe_child_failures() as failures, contextlib.redirect_stderr(stderr):
        code = cli.main(["run", *argv])
    if code == 0:
        return
    if code == 2:
        lines = stderr.text.getvalue().strip().splitlines()
        raise ValueError(lines[-1] if lines else "aelastic run exited 2")
    if code == 1 and failures:
        raise torch_child_failed(failures[-1]) from failures[-1]
    raise SystemExit(code)


_REPLACEMENTS: dict[str, dict[str, Callable[..., Any]]] = {
    "torch.distributed.launcher.api": {"launch_agent": launch_agent},
    "torch.distributed.run": {"main": main},
}


def _patch(module: Any) -> None:
    for name, function in _REPLACEMENTS[module.__name__].items():
        setattr(module, name, function)


class _Finder(importlib.abc.MetaPathFinder):
    """Patches the target modules right after they are executed, in interpreters that import them later."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname not in _TARGETS:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        execute = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            execute(module)
            _patch(module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def install() -> None:
    """Patch the targets now if imported, else when they are; idempotent."""
    for name in _TARGETS:
        if name in sys.modules:
            _patch(sys.modules[name])
    if not any(isinstance(finder, _Finder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
