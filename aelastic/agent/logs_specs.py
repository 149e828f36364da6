"""Custom log destinations as torchrun's ``--logs-specs NAME``: a ``LogsSpecs`` class registered under the
``torchrun.logs_specs`` entry-point group, with torch's effect.

torch resolves the name through ``importlib.metadata`` (``torch.distributed.run._get_logs_specs_class``),
instantiates the class with ``log_dir``, ``redirects``, ``tee`` and ``local_ranks_filter`` (torch's ``Std``), and
before each start of the workers calls ``reify(envs)`` with every local rank's environment; the ``LogsDest`` it
returns says where each rank's stdout and stderr go, which are teed to the console, and each error file, and
``reify`` may set variables in ``envs`` (torch's default sets ``TORCHELASTIC_ERROR_FILE`` there). aelastic does the
same and routes the output through its own pumps (:class:`~aelastic.agent.logs.CustomLogs`).

Such a class subclasses torch's ``LogsSpecs``, so loading it imports torch: only when a name other than
``default`` is given. ``default`` is aelastic's own layout, which is torch's ``DefaultLogsSpecs``' without torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final, Protocol

from ..errors import ConfigurationError
from .logs import CustomLogs, Std, StdSpec

__all__ = ["GROUP", "LogsSpecs", "load_logs_specs", "reify"]

GROUP: Final = "torchrun.logs_specs"


class LogsSpecs(Protocol):
    """What aelastic needs of torch's ``LogsSpecs``."""

    def reify(self, envs: dict[int, dict[str, str]]) -> Any: ...


def load_logs_specs(
    name: str,
    *,
    log_dir: str | Path | None,
    redirects: StdSpec,
    tee: StdSpec,
    local_ranks_filter: frozenset[int] | None,
) -> LogsSpecs:
    """The instance torchrun would build for ``--logs-specs name``.

    Raises:
        ConfigurationError: no entry point of that name, or its class could not be loaded or built.
    """
    from importlib.metadata import entry_points  # scans the installed packages: only when the flag is given

    found = list(entry_points(group=GROUP, name=name))
    if not found:
        known = sorted({ep.name for ep in entry_points(group=GROUP)} | {"default"})
        raise ConfigurationError(
            f"--logs-specs {name!r}: no entry point of that name in the group {GROUP!r} (installed: {', '.join(known)})"
        )
    try:
        cls = found[0].load()
        from torch.distributed.elastic.multiprocessing.api import Std as TorchStd

        def torch_std(spec: StdSpec) -> Any:
            if isinstance(spec, Std):
                return TorchStd(int(spec))
            return {rank: TorchStd(int(std)) for rank, std in spec.items()}

        specs: LogsSpecs = cls(
            log_dir=None if log_dir is None else str(log_dir),
            redirects=torch_std(redirects),
            tee=torch_std(tee),
            local_ranks_filter=None if local_ranks_filter is None else set(local_ranks_filter),
        )
    except Exception as exc:  # the user's code: whatever it raises is a configuration problem to report in one line
        raise ConfigurationError(f"--logs-specs {name!r} ({found[0].value}): {type(exc).__name__}: {exc}") from exc
    return specs


def reify(specs: LogsSpecs, envs: dict[int, dict[str, str]]) -> CustomLogs:
    """``specs.reify(envs)`` (which may change ``envs``, as torch lets it) as aelastic's destinations."""
    dest = specs.reify(envs)

    def paths(name: str) -> Mapping[int, str]:
        return {int(rank): str(path) for rank, path in dict(getattr(dest, name, {}) or {}).items()}

    return CustomLogs(
        stdouts=paths("stdouts"),
        stderrs=paths("stderrs"),
        tee_stdouts=paths("tee_stdouts"),
        tee_stderrs=paths("tee_stderrs"),
        error_files=paths("error_files"),
        filtered_stdout=str(getattr(dest, "filtered_stdout", "") or ""),
        filtered_stderr=str(getattr(dest, "filtered_stderr", "") or ""),
    )
