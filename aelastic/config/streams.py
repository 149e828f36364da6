"""Which of a worker's standard streams a setting applies to: torch's ``Std`` and its spelling on the command line
(``--redirects``, ``--tee``)."""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping
from typing import Final

from ..errors import ConfigurationError

__all__ = ["Std", "StdSpec"]

_STD_MAP_RE: Final = re.compile(r"^(\d:[0123],)*(\d:[0123])$")  # torch's pattern: single-digit local ranks


class Std(enum.IntFlag):
    """Which of a worker's standard streams a setting applies to (torch's ``Std``)."""

    NONE = 0
    OUT = 1
    ERR = 2
    ALL = OUT | ERR

    @classmethod
    def from_str(cls, vm: str) -> Std | dict[int, Std]:
        """Parse torch's spelling: ``"0"``..``"3"`` for every rank, or ``"i:v,j:v"`` per local rank.

        Raises:
            ConfigurationError: ``vm`` is neither form.
        """
        if re.fullmatch(r"[0123]", vm):
            return cls(int(vm))
        if _STD_MAP_RE.match(vm):
            parsed: dict[int, Std] = {}
            for item in vm.split(","):
                rank, value = item.split(":")
                parsed[int(rank)] = cls(int(value))
            return parsed
        raise ConfigurationError(
            f"{vm!r}: expected a value in 0..3 (0 none, 1 stdout, 2 stderr, 3 both) "
            "or a per-local-rank map like '0:1,1:3'"
        )


StdSpec = Std | Mapping[int, Std]
