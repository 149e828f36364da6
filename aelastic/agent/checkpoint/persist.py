"""``--checkpoint-dir``: the agents' in-memory checkpoints written to a directory, for what memory does not survive
(a requeued job, every node lost).

The directory is flat: ``step-<step>.rank-<rank>.ckpt`` holds rank ``rank``'s checkpoint of ``step``, the bytes of
its slot as they are (:mod:`aelastic.worker._checkpoint.layout`: a header naming the world size, the data, the
metadata). A step is *complete* when every rank of its world has its file; :func:`newest_complete` is the one a job
restores from when no agent's memory holds a step.

Writes are atomic: a file is written unnamed (``O_TMPFILE``), synced, and only then linked under its name, so a
reader never sees a partial one, and a writer that dies midway (the agent SIGKILLed) leaves nothing behind; where
the file system has no ``O_TMPFILE``, a named temporary file is renamed into place instead. Copies run in a
thread, from the memory file to the file in the kernel (``copy_file_range``, else ``sendfile``), in chunks, so that
a copy asked to stop (its slot is wanted for a newer save) stops within a chunk. Once a newer step is complete,
the files of older steps are removed.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import threading
from pathlib import Path
from typing import Final

from ...worker._checkpoint.layout import HEADER_SIZE, Header, LayoutError
from .plan import Held

__all__ = ["CopyStopped", "file_name", "newest_complete", "remove_older", "scan", "write_checkpoint"]

logger = logging.getLogger(__name__)

_NAME: Final = re.compile(r"step-(\d+)\.rank-(\d+)\.ckpt")
_CHUNK: Final = 64 << 20


class CopyStopped(Exception):
    """A copy was asked to stop before it was complete (nothing was written under the checkpoint's name)."""


def file_name(step: int, rank: int) -> str:
    return f"step-{step:012d}.rank-{rank:06d}.ckpt"


def scan(directory: Path) -> dict[int, dict[int, Path]]:
    """The checkpoint files in ``directory``: step -> rank -> path (an absent directory has none)."""
    found: dict[int, dict[int, Path]] = {}
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return found
    for name in names:
        match = _NAME.fullmatch(name)
        if match:
            found.setdefault(int(match[1]), {})[int(match[2])] = directory / name
    return found


def _header(path: Path) -> Header | None:
    try:
        with open(path, "rb") as file:
            return Header.decode(file.read(HEADER_SIZE))
    except (OSError, LayoutError) as exc:
        logger.warning("checkpoint file %s: %s", path, exc)
        return None


def newest_complete(directory: Path) -> list[Held]:
    """Every file of the newest complete step in ``directory`` (empty when there is none)."""
    files = scan(directory)
    for step in sorted(files, reverse=True):
        header = _header(next(iter(files[step].values())))
        if header is not None and set(range(header.world)) <= set(files[step]):
            return [Held(rank, step, header.world, 0) for rank in range(header.world)]
    return []


def remove_older(directory: Path, step: int) -> None:
    """Remove the files of steps older than ``step`` if ``step`` is complete (another agent may do it too)."""
    files = scan(directory)
    header = _header(next(iter(files[step].values()))) if step in files else None
    if header is None or not set(range(header.world)) <= set(files[step]):
        return
    for older in (s for s in files if s < step):
        for path in files[older].values():
            path.unlink(missing_ok=True)  # another agent may have removed it first


def _copy(source: int, target: int, size: int, stop: threading.Event) -> None:
    offset = 0
    while offset < size:
        if stop.is_set():
            raise CopyStopped
        count = min(_CHUNK, size - offset)
        try:
            copied = os.copy_file_range(source, target, count, offset, offset)
        except OSError as exc:
            if exc.errno not in (errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
                raise
            os.lseek(target, offset, os.SEEK_SET)
            copied = os.sendfile(target, source, offset, count)
        if copied == 0:
            raise OSError(errno.EIO, f"the memory file ended at {offset} of {size} bytes")
        offset += copied


def write_checkpoint(directory: Path, source: int, header: Header, stop: threading.Event) -> Path:
    """Write the checkpoint ``header`` describes, read from the file ``source``, into ``directory`` atomically;
    blocking (run it in a thread). Returns its path; an existing file of the same step and rank is kept.

    Raises:
        CopyStopped: ``stop`` was set before the copy was complete.
        OSError: the directory cannot be written.
    """
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / file_name(header.step, header.rank)
    try:
        fd = os.open(directory, os.O_TMPFILE | os.O_WRONLY, 0o644)
        temporary = None
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
            raise
        temporary = directory / f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp"
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        _copy(source, fd, header.total, stop)
        os.fsync(fd)
        if temporary is None:
            try:
                _link_unnamed(fd, directory, path.name)
            except FileExistsError:
                return path  # written before (by this agent, for another reason): the same bytes
        else:
            os.replace(temporary, path)
            temporary = None
    finally:
        os.close(fd)
        if temporary is not None:
            temporary.unlink(missing_ok=True)
    _sync_directory(directory)
    return path


def _link_unnamed(fd: int, directory: Path, name: str) -> None:
    """Give the ``O_TMPFILE`` file ``fd`` its name: ``linkat`` with ``AT_SYMLINK_FOLLOW`` through ``/proc``. (Python
    calls ``link(2)``, which follows no link, unless a directory fd is given.)"""
    directory_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.link(f"/proc/self/fd/{fd}", name, dst_dir_fd=directory_fd, follow_symlinks=True)
    finally:
        os.close(directory_fd)


def _sync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
