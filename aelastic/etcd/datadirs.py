"""Where the job's etcd members keep their data: the temporary directory, one directory per member, and none left
behind by an agent that is gone, however it ended.

Not ``/dev/shm``: etcd preallocates its write-ahead log in 64 MB segments, two at a time, and on a memory file system
those 128 MB are memory for the member's life (on a disk they are blocks allocated, never written). The members run
without fsync (their state is the job's rendezvous, rebuilt if lost), so a write waits for no disk either way.

The guard (:mod:`.guard`) removes a member's directory when the member ends, but a step SIGKILLed whole (Slurm's kill
after ``KillWait``, ``scancel -s KILL``, the OOM killer of the step's cgroup) kills the guard with the rest, and each
directory holds a member's preallocated write-ahead log. So every directory has a lock file beside it
(``<directory>.lock``), held (``flock``) by the agent that made it while the member may run: the kernel lets go of it
when that agent dies, however it dies. An agent that starts a member first removes every directory whose lock nobody
holds (:func:`sweep`)."""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from contextlib import suppress
from pathlib import Path
from typing import Final

__all__ = ["DataDir", "data_root", "sweep"]

_PREFIX: Final = "aelastic-etcd-"


def data_root() -> str:
    """The temporary directory (``TMPDIR``, else ``/tmp``)."""
    return tempfile.gettempdir()


class DataDir:
    """One member's data directory under ``root`` (its name begins with ``name``), its lock held until
    :meth:`release`."""

    __slots__ = ("lock", "path")

    def __init__(self, root: str, name: str) -> None:
        self.path = tempfile.mkdtemp(prefix=f"{_PREFIX}{name}-", dir=root)
        fresh = f"{self.path}.lock.new"
        self.lock = os.open(fresh, os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600)
        fcntl.flock(self.lock, fcntl.LOCK_EX)
        os.rename(fresh, f"{self.path}.lock")  # under its name a lock is always held: no sweep takes it half made

    def __repr__(self) -> str:
        return f"<DataDir {self.path}>"

    def release(self) -> None:
        """Remove the directory (the guard may have done it already) and let go of its lock."""
        shutil.rmtree(self.path, ignore_errors=True)
        with suppress(OSError):
            os.unlink(f"{self.path}.lock")
        os.close(self.lock)


def sweep(root: str) -> list[str]:
    """Remove the member directories under ``root`` whose lock nobody holds (their agent is gone); the ones removed."""
    removed = []
    for lock in sorted(Path(root).glob(f"{_PREFIX}*.lock")):
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CLOEXEC)
        except OSError:
            continue  # removed meanwhile by another sweep
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # held: its agent lives
            directory = str(lock).removesuffix(".lock")
            shutil.rmtree(directory, ignore_errors=True)
            with suppress(OSError):
                os.unlink(lock)
            removed.append(directory)
        finally:
            os.close(fd)
    return removed
