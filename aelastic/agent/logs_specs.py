"""Custom log destinations as torchrun's ``--logs-specs NAME`` (the class is loaded and built in
:mod:`aelastic.config.logs_specs`), with torch's effect: before each start of the workers the agent calls
``reify(envs)`` with every local rank's environment; the ``LogsDest`` it returns says where each rank's stdout and
stderr go, which are teed to the console, and each error file, and ``reify`` may set variables in ``envs`` (torch's
default sets ``TORCHELASTIC_ERROR_FILE`` there). aelastic does the same and routes the output through its own pumps
(:class:`~aelastic.agent.logs.CustomLogs`).
"""

from __future__ import annotations

from collections.abc import Mapping

from ..config.logs_specs import LogsSpecs
from .logs import CustomLogs

__all__ = ["reify"]


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
