"""torchrun's ``--logs-specs NAME``: the ``LogsSpecs`` class registered under the ``torchrun.logs_specs`` entry-point
group, found and built as torch does (``torch.distributed.run._get_logs_specs_class``): with ``log_dir``,
``redirects``, ``tee`` and ``local_ranks_filter`` (torch's ``Std``). The agent calls its ``reify`` before each start
of the workers (:mod:`aelastic.agent.logs_specs`).

Such a class subclasses torch's ``LogsSpecs``, so loading it imports torch: only when a name other than
``default`` is given. ``default`` is aelastic's own layout, which is torch's ``DefaultLogsSpecs``' without torch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Final, Protocol

from ..errors import ConfigurationError
from .streams import Std, StdSpec

__all__ = ["GROUP", "LogsSpecs", "load_logs_specs"]

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
