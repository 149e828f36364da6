"""Slurm hostlists (``n[001-003,7]``, ``rack[1-2]-n[01-02]``) expanded as ``scontrol show hostnames`` does.

Our own parser: PyPI's ``python-hostlist`` is GPL-2.0+. The reference is Slurm 22.05's ``hostlist.c``, checked
against the real ``scontrol`` (``tests/slurm/hostlists.json``):

* names are separated by commas or whitespace outside brackets; empty names are skipped; duplicates are kept;
* a bracket holds a comma list of ``N`` or ``LO-HI`` (``LO <= HI``, at most 65536 numbers); each number is
  zero-padded to the width of the text of its ``LO`` (``[08-11]``: 08..11, ``[1-02]``: 1, 2);
* a name's last bracket must end it (``n[1-3]x`` is refused, as Slurm refuses it); with several brackets, the
  last varies fastest, then the others from the first to the one before the last (Slurm's recursion:
  ``c[1-2]-r[1-2]-n[1-2]`` is c1-r1-n1, c1-r1-n2, c2-r1-n1, ...);
* unbalanced brackets, which ``scontrol`` takes literally (``n[1-2`` prints ``n]``), are refused.
"""

from __future__ import annotations

import re
from typing import Final

from ..errors import ConfigurationError

__all__ = ["MAX_HOSTS", "expand_hostlist"]

MAX_HOSTS: Final = 1 << 20
"""More names than this in one hostlist is refused (Slurm's own limit per range is 65536)."""

_MAX_RANGE: Final = 65536
_NUMBER: Final = re.compile(r"\d+")


def _split_names(text: str) -> list[str]:
    """Top-level names: split on commas and whitespace outside brackets."""
    names: list[str] = []
    current: list[str] = []
    depth = 0
    for char in text:
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
        if depth == 0 and (char == "," or char.isspace()):
            names.append("".join(current))
            current = []
        else:
            current.append(char)
    names.append("".join(current))
    return [name for name in names if name]


def _numbers(group: str) -> list[str]:
    """``1-3,7`` into ``['1', '2', '3', '7']``, each zero-padded to the width of its range's LO text."""
    numbers: list[str] = []
    for item in group.split(","):
        low, dash, high = item.partition("-")
        if not _NUMBER.fullmatch(low) or (dash and not _NUMBER.fullmatch(high)):
            raise ValueError(f"[{group}] is not a list of N or LO-HI")
        lo, hi = int(low), int(high) if dash else int(low)
        if lo > hi:
            raise ValueError(f"[{group}]: {item!r} has LO > HI")
        if hi - lo + 1 > _MAX_RANGE:
            raise ValueError(f"[{group}]: {item!r} has more than {_MAX_RANGE} numbers")
        numbers += [str(n).zfill(len(low)) for n in range(lo, hi + 1)]
    return numbers


def _expand_name(name: str) -> list[str]:
    """One name into hosts: literal parts and bracket groups, Slurm's order (see the module doc)."""
    parts = re.split(r"(\[[^\[\]]*\])", name)  # literal, [group], literal, [group], ..., literal
    literals, groups = parts[0::2], [p[1:-1] for p in parts[1::2]]
    if any("[" in lit or "]" in lit for lit in literals):
        raise ValueError("unbalanced brackets")
    if not groups:
        return [name]
    if literals[-1]:
        raise ValueError(f"{literals[-1]!r} follows the last bracket (a bracket must end the name)")
    choices = [_numbers(group) for group in groups]
    # The last group varies fastest; then groups[0], groups[1], ... groups[-2], the slowest.
    order = [*range(len(groups) - 2, -1, -1), len(groups) - 1]  # slowest first
    combos: list[dict[int, str]] = [{}]
    for index in order:
        combos = [{**combo, index: number} for combo in combos for number in choices[index]]
        if len(combos) > MAX_HOSTS:
            raise ValueError(f"expands to more than {MAX_HOSTS} names")
    return ["".join(lit + (combo[i] if i < len(groups) else "") for i, lit in enumerate(literals)) for combo in combos]


def expand_hostlist(text: str, label: str = "hostlist") -> list[str]:
    """A Slurm hostlist into its host names, in ``scontrol show hostnames`` order.

    Raises:
        ConfigurationError: a malformed hostlist; the message names ``label`` (e.g. ``SLURM_STEP_NODELIST``), the
            text and the rule.
    """
    hosts: list[str] = []
    for name in _split_names(text):
        try:
            hosts += _expand_name(name)
        except ValueError as exc:
            raise ConfigurationError(f"{label}={text!r}: {name!r} is not a Slurm hostlist name: {exc}") from None
        if len(hosts) > MAX_HOSTS:
            raise ConfigurationError(f"{label}={text!r}: expands to more than {MAX_HOSTS} names")
    if not hosts:
        raise ConfigurationError(f"{label}={text!r}: names no host")
    return hosts
