"""Process limits the launcher's services need: the open-file limit.

Many hosts and Slurm jobs start with a soft ``RLIMIT_NOFILE`` of 1024 under a much higher hard limit. A store
serves one connection per rank (its cap is the soft limit less 1,024, at least half of it, ``aelastic.store.server``),
so the agent and ``aelastic store`` raise the soft limit to the hard limit at start, as servers commonly do. The
workers inherit the raised limit (limits pass to children), unlike under torchrun, which leaves the soft limit as
it found it.
"""

from __future__ import annotations

import logging
import resource
from typing import NamedTuple

__all__ = ["Raised", "raise_open_file_limit"]

logger = logging.getLogger(__name__)


class Raised(NamedTuple):
    """The soft open-file limit before and after (``resource.RLIM_INFINITY`` is -1)."""

    before: int
    after: int


def _nr_open() -> int:
    try:
        with open("/proc/sys/fs/nr_open") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 1 << 20


def raise_open_file_limit(who: str) -> Raised | None:
    """Raise the soft ``RLIMIT_NOFILE`` to the hard limit; one log line (naming ``who``) when it changes.

    Returns what changed, or None when the soft limit is already the hard limit or the kernel refuses (logged, never
    fatal: the process runs on with its limit).
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return None
    if hard == resource.RLIM_INFINITY:  # Linux refuses more than fs.nr_open descriptors
        hard = _nr_open()
    if soft >= hard:
        return None
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    except (ValueError, OSError) as exc:  # e.g. a hard limit of infinity above the kernel's nr_open
        logger.warning("%s: open-file limit (ulimit -n) %d could not be raised to %d: %s", who, soft, hard, exc)
        return None
    logger.info("%s: raised the open-file limit (ulimit -n) from %d to the hard limit %d", who, soft, hard)
    return Raised(soft, hard)
