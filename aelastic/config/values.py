"""Text into values, and the rules a value must keep: every conversion and check of a value the user gives.

Each rule is written once, here, as a function that takes a *label* (what the user wrote: ``--nnodes '4:2'`` on
the command line, ``LaunchConfig min_nodes=4`` in Python) so that the one-line error names what the user typed.
The parsers raise :class:`~aelastic.errors.ConfigurationError`; the command line adapts them to argparse types.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import tempfile
from collections.abc import Mapping
from typing import Final

from .._devices import visible_devices
from ..errors import ConfigurationError
from .streams import Std

__all__ = [
    "DEFAULT_FORWARDED",
    "DEFAULT_NODE_CHECK_SLOWDOWN",
    "DEFAULT_SIGNALS",
    "LIST_LIMIT",
    "check_at_least",
    "check_module_names",
    "check_node_check",
    "check_node_range",
    "check_port",
    "check_slowdown",
    "check_writable_dir",
    "comma_list",
    "new_run_id",
    "parse_log_level",
    "parse_nnodes",
    "parse_nproc",
    "parse_port",
    "parse_positive",
    "parse_ranks_filter",
    "parse_rdzv_conf",
    "parse_signals",
    "parse_size",
    "parse_slowdown",
    "parse_std",
    "pet_default",
    "pet_flag",
    "resolve_forwarded",
]

# A SIGKILLed process normally ends within milliseconds; a large one's teardown (a GPU context, dirty pages) within
# seconds. One still there after this long is held by the kernel (uninterruptible sleep on a dead mount or device).
UNKILLABLE_TIMEOUT: Final = 30.0

DEFAULT_SIGNALS: Final = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"

DEFAULT_FORWARDED: Final = "SIGUSR1,SIGUSR2"
"""What ``--signals-to-forward`` forwards unless given: the schedulers' notices (Slurm's ``--signal``, Lightning's
USR1, submitit's USR2), less any signal ``--signals-to-handle`` names."""

_UNCATCHABLE: Final = frozenset({signal.SIGKILL, signal.SIGSTOP})

DEFAULT_NODE_CHECK_SLOWDOWN: Final = 2.0
"""``--node-check-slowdown``'s default (DLRover's straggler bound): a node twice as slow as the median holds every
synchronous step of the job back by as much, while a healthy node's noise on a busy machine stays well under it
(a matmul figure is the fastest of several runs, an all-reduce figure their median, and each the better of two
check rounds)."""

LIST_LIMIT: Final = 20
"""How many nodes of each list ``aelastic status`` prints unless asked for all (``--all``)."""


# --- rules ---------------------------------------------------------------------------------------------------------


def check_node_range(low: int, high: int, label: str) -> None:
    """``1 <= low <= high`` (``--nnodes MIN:MAX``, ``LaunchConfig min_nodes/max_nodes``)."""
    if low < 1:
        raise ConfigurationError(f"{label}: MIN must be >= 1")
    if low > high:
        raise ConfigurationError(f"{label}: MIN must be <= MAX")


def check_at_least(value: float, low: float, label: str) -> None:
    """``value >= low``."""
    if value < low:
        raise ConfigurationError(f"{label}: must be >= {low:g}")


def check_port(value: int, label: str) -> None:
    """A TCP port number; 0 asks the kernel for a free one."""
    if not 0 <= value <= 65535:
        raise ConfigurationError(f"{label}: must be a port (0..65535)")


def check_module_names(names: tuple[str, ...], label: str) -> None:
    """Dotted Python module names (``--prewarm-modules``)."""
    bad = [m for m in names if not all(part.isidentifier() for part in m.split("."))]
    if bad:
        raise ConfigurationError(f"{label}: {bad[0]!r} is not a module name")


def check_slowdown(value: float, label: str) -> None:
    """``--node-check-slowdown``: a factor over 1 (``inf``: slowness leaves no node out, failures still do)."""
    if not value > 1:  # NaN too
        raise ConfigurationError(f"{label}: must be a number > 1 (a node that many times slower than the median is "
                                 "left out)")  # fmt: skip


def check_node_check(backend: str | None, label: str) -> None:
    """``--node-check`` needs a rendezvous that can form a round without the node it leaves out."""
    if backend == "static":
        raise ConfigurationError(f"{label}: needs a dynamic rendezvous (c10d, etcd): the static backend's world is "
                                 "fixed, so no node can be left out of it")  # fmt: skip


# --- text into values ----------------------------------------------------------------------------------------------


def new_run_id() -> str:
    """A random run id in the text form of a version-4 UUID, as torchrun's ``--standalone`` makes one.

    Made here rather than by :func:`uuid.uuid4`: the uuid module imports platform, ~3 ms of every launch.
    """
    raw = bytearray(os.urandom(16))
    raw[6] = raw[6] & 0x0F | 0x40  # version 4
    raw[8] = raw[8] & 0x3F | 0x80  # the RFC 4122 variant
    text = raw.hex()
    return f"{text[:8]}-{text[8:12]}-{text[12:16]}-{text[16:20]}-{text[20:]}"


def parse_nnodes(text: str) -> tuple[int, int]:
    """``N`` or ``MIN:MAX`` into ``(min, max)``; ``0 < min <= max``."""
    parts = str(text).split(":")
    try:
        if len(parts) == 1:
            low = high = int(parts[0])
        elif len(parts) == 2:
            low, high = int(parts[0]), int(parts[1])
        else:
            raise ValueError
    except ValueError:
        raise ConfigurationError(f"--nnodes {text!r}: must be N or MIN:MAX (positive integers)") from None
    check_node_range(low, high, f"--nnodes {text!r}")
    return low, high


def parse_rdzv_conf(text: str) -> dict[str, str]:
    """``k=v,k=v`` into a dict; empty keys or values are refused, as torch refuses them."""
    conf: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip() or not value.strip():
            raise ConfigurationError(f"--rdzv-conf {text!r}: {item!r} is not KEY=VALUE")
        conf[key.strip()] = value.strip()
    return conf


def parse_signals(text: str, label: str = "--signals-to-handle") -> tuple[signal.Signals, ...]:
    """``SIGTERM,SIGINT,...`` into signals; unknown names, and signals no process can catch (SIGKILL, SIGSTOP), are
    refused."""
    names = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [name for name in names if name not in signal.Signals.__members__]
    if unknown:
        raise ConfigurationError(f"{label} {text!r}: {unknown[0]!r} is not a signal name")
    signals = tuple(dict.fromkeys(signal.Signals[name] for name in names))
    uncatchable = [s for s in signals if s in _UNCATCHABLE]
    if uncatchable:
        raise ConfigurationError(f"{label} {text!r}: {uncatchable[0].name} cannot be caught, so it cannot be handled "
                                 "or forwarded")  # fmt: skip
    return signals


def resolve_forwarded(
    forward: str | None, handle: str, labels: tuple[str, str] = ("--signals-to-forward", "--signals-to-handle")
) -> tuple[signal.Signals, ...]:
    """The signals forwarded to the workers: ``forward`` (``None``: :data:`DEFAULT_FORWARDED` less the signals
    ``handle`` names, so that torchrun's ``--signals-to-handle ...,SIGUSR1`` keeps its meaning). A signal given in
    both lists is refused: it either stops the workers or is forwarded to them."""
    handled = parse_signals(handle, labels[1])
    if forward is None:
        return tuple(s for s in parse_signals(DEFAULT_FORWARDED, labels[0]) if s not in handled)
    forwarded = parse_signals(forward, labels[0])
    both = [s for s in forwarded if s in handled]
    if both:
        raise ConfigurationError(
            f"{labels[0]} {forward!r}: {both[0].name} is also in {labels[1]} {handle!r}; a signal either stops the "
            "workers or is forwarded to them: remove it from one list"
        )
    return forwarded


def _gpu_count(environ: Mapping[str, str]) -> int:
    return len(visible_devices(environ))


def _cpu_count() -> int:
    """The CPUs this process may run on, as torch counts them (``torch._utils.cpu_count``): the affinity mask
    (taskset, cgroups' cpusets, a Slurm step's binding), not the machine's count."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def parse_nproc(text: str, environ: Mapping[str, str]) -> int:
    """``--nproc-per-node``: a positive integer, ``cpu`` (the CPUs of this process's affinity mask), ``gpu`` (the
    visible NVIDIA GPUs) or ``auto``."""
    if text == "cpu":
        return _cpu_count()
    if text == "auto":
        return _gpu_count(environ) or _cpu_count()
    if text == "gpu":
        count = _gpu_count(environ)
        if count == 0:
            raise ConfigurationError(
                "--nproc-per-node 'gpu': no visible GPU on this machine (no /dev/nvidia<N>, or CUDA_VISIBLE_DEVICES "
                "empty); give a number"
            )
        return count
    try:
        value = int(text)
    except ValueError:
        raise ConfigurationError(f"--nproc-per-node {text!r}: must be a positive integer, cpu, gpu or auto") from None
    if value < 1:
        raise ConfigurationError(f"--nproc-per-node {text!r}: must be a positive integer (>= 1)")
    return value


def parse_std(flag: str, text: str) -> Std | dict[int, Std]:
    """``--redirects`` / ``--tee``: ``0..3`` or ``LOCAL_RANK:0..3,...``."""
    try:
        return Std.from_str(text)
    except ValueError:
        raise ConfigurationError(f"{flag} {text!r}: must be 0..3 or LOCAL_RANK:0..3,...") from None


def parse_ranks_filter(text: str) -> frozenset[int] | None:
    """``--local-ranks-filter``: a comma list of local ranks; empty is every rank (``None``)."""
    if not text.strip():
        return None
    try:
        return frozenset(int(part) for part in text.split(","))
    except ValueError:
        raise ConfigurationError(f"--local-ranks-filter {text!r}: must be a comma list of local ranks") from None


def comma_list(text: str) -> list[str]:
    """torch's ``comma_separated_list``: items split on ``,``; ``,,`` is a literal comma."""
    return [item.replace("\0", ",") for item in text.replace(",,", "\0").split(",")]


def parse_port(text: str) -> int:
    """A port number, ``0..65535``."""
    if not text.isdigit() or not 0 <= int(text) <= 65535:
        raise ConfigurationError(f"{text!r} is not a port number (an integer 0..65535)")
    return int(text)


def parse_positive(text: str) -> int:
    """A positive integer."""
    if not text.isdigit() or int(text) < 1:
        raise ConfigurationError(f"{text!r} is not a positive integer")
    return int(text)


def parse_seconds(text: str) -> float:
    """A duration in seconds, more than 0 (a decimal fraction or not)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise ConfigurationError(f"{text!r} is not a number of seconds more than 0")
    return value


def parse_slowdown(text: str) -> float:
    """``--node-check-slowdown``: a number > 1."""
    label = f"--node-check-slowdown {text!r}"
    try:
        value = float(text)
    except ValueError:
        raise ConfigurationError(f"{label}: must be a number > 1") from None
    check_slowdown(value, label)
    return value


_SIZE_UNITS: Final = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str) -> int:
    """A size in bytes: an integer, with ``K``, ``M``, ``G`` or ``T`` (powers of 1024; ``KiB``... and ``KB``...
    alike) after it or not."""
    number = text.strip().upper().removesuffix("IB").removesuffix("B")
    unit = number[-1:] if number[-1:] in _SIZE_UNITS else ""
    digits = number[: len(number) - len(unit)].strip()
    if not digits.isdigit():
        raise ConfigurationError(
            f"{text!r} is not a size in bytes (an integer, with K, M, G or T, powers of 1024, or not)"
        )
    return int(digits) * _SIZE_UNITS[unit]


def check_writable_dir(path: str, label: str) -> None:
    """A directory this process can write into, or can create: a file is made (and removed at once, unnamed) in
    it, or in its nearest existing ancestor, so that read-only mounts and permissions answer, not just mode bits."""
    target = os.path.abspath(path)
    existing = target
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise ConfigurationError(f"{label} {path!r}: {existing!r} is not a directory")
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as exc:
        what = "the directory" if existing == target else f"{existing!r}, where it would be created,"
        raise ConfigurationError(f"{label} {path!r}: {what} is not writable ({exc.strerror})") from None


def parse_log_level(text: str) -> str:
    """``--log-level``: a level name of :mod:`logging`, upper-cased."""
    level = text.upper()
    if not isinstance(logging.getLevelName(level), int):
        raise ConfigurationError(f"--log-level {text!r}: must be DEBUG, INFO, WARNING or ERROR")
    return level


# --- torch's PET_<FLAG> variables ----------------------------------------------------------------------------------


def pet_default(dest: str, default: object, environ: Mapping[str, str]) -> object:
    """torch's ``env`` action: a flag's default is ``PET_<DEST>`` when set, else the coded default."""
    return environ.get(f"PET_{dest.upper()}", default)


def pet_flag(dest: str, environ: Mapping[str, str]) -> bool:
    """torch's ``check_env`` action: a switch defaults to ``bool(int(PET_<DEST>))``."""
    raw = environ.get(f"PET_{dest.upper()}", "0")
    try:
        return bool(int(raw))
    except ValueError:
        raise ConfigurationError(f"PET_{dest.upper()}={raw!r}: must be 0 or 1") from None
