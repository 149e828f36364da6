"""``aelastic.checkpoint.save`` and ``load``: the worker side of in-memory checkpoints (see :mod:`aelastic.checkpoint`).

A save asks the agent for a slot big enough (``checkpoint.reserve``): the agent answers with a memory file it owns
(a ``memfd``, passed over the worker's link the first time), which this process maps once and keeps mapped, so that
every later save into it is one memory copy per tensor. The metadata follows the data and the header comes last
(:mod:`.layout`); then ``checkpoint.commit`` makes the slot this rank's latest checkpoint, and only then does
``save`` return. A worker that dies during a save leaves the agent's previous checkpoint of its rank as it was.

A load asks the agent for the checkpoint the job restores from (``checkpoint.load``: the newest step that every
rank holds; the agent decides it with the other agents at each rendezvous round) and copies it out of the memory
file, or out of a file of ``--checkpoint-dir`` when no agent's memory has one.

CUDA tensors are copied into the slot as into pinned memory: the mapping is registered with CUDA once
(``cudaHostRegister``), the copies are asynchronous, and the save waits for them before it commits. A restore copies
from the mapping as from pageable memory (the driver stages it): registering it would cost more than the copy.
"""

from __future__ import annotations

import _thread
import contextlib
import ctypes
import json
import logging
import mmap
import os
import threading
import warnings
from collections.abc import Sequence
from typing import Any, Final, NamedTuple

import torch

from ...errors import CheckpointError
from .._link import AgentLink, LinkRefused, agent_link, install_exit_report
from . import heap, premapped
from .layout import DATA_OFFSET, HEADER_SIZE, Header, LayoutError, place
from .tree import StateError, flatten, unflatten

__all__ = ["LoadInfo", "available", "last_loaded", "load", "save", "step_to_restore"]

logger = logging.getLogger(__name__)

_CUDA_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable
_MADV_POPULATE_WRITE: Final = 23
_libc = ctypes.CDLL(None, use_errno=True)  # its calls let go of the GIL


class LoadInfo(NamedTuple):
    """What the last :func:`load` of this process restored.

    Attributes:
        step: the checkpoint's step.
        rank: the rank that saved it (this worker's own, unless the world's size changed since; 0 after a DCP
            load, which reads every saved rank it needs).
        world: the world size when it was saved.
        source: where it came from: ``"memory"`` (this node's agent), ``"replica from HOST"`` (the replica this
            node's agent kept, pushed by HOST), ``"replica from HOST:PORT"`` (fetched from another node's agent), or
            ``"disk PATH"`` (``--checkpoint-dir``); after a DCP load, each distinct source, in the order of the saved
            ranks, joined by ``", "``.
    """

    step: int
    rank: int
    world: int
    source: str


class Mapping:
    """A checkpoint's bytes mapped into this process (a slot's memory file, or a file of the directory), with a
    flat uint8 tensor over them."""

    def __init__(self, mapped: mmap.mmap) -> None:
        self.size = len(mapped)
        self.mmap = mapped
        with warnings.catch_warnings():  # "the given buffer is not writable": read-only ones are only copied from
            warnings.simplefilter("ignore", UserWarning)
            self.bytes: torch.Tensor | None = torch.frombuffer(self.mmap, dtype=torch.uint8)
        self.kept = False  # one of this process's slots (see _Client): it stays mapped after a read
        self._pinned: bool | None = None  # registered with CUDA (None: not tried yet; False: it failed)

    @classmethod
    def open(cls, fd: int, size: int, *, shared: bool, writable: bool = False, populate: bool = False) -> Mapping:
        # A save's slot is mapped once and then written whole by every save: its page tables are filled up front. A
        # checkpoint to load is read through read faults: the kernel maps the pages around a faulting read with it,
        # where populating takes them one by one (a 256 MiB restore here: 0.05 s against 0.07 s).
        flags = mmap.MAP_SHARED if shared else mmap.MAP_PRIVATE
        mapping = cls(mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)))
        if populate:
            mapping.populate()
        return mapping

    def populate(self) -> None:
        """Fill the page tables for writing (``MADV_POPULATE_WRITE``, Linux 5.14; older kernels map each page at its
        first touch instead) in a call that lets go of the GIL: Python's ``mmap`` (``MAP_POPULATE``) and
        ``madvise`` hold it throughout, which stopped every other thread of the process as long (a slot filled in
        the background held a restarted Trainer's main thread 0.4 s)."""
        _libc.madvise(ctypes.c_void_p(self.tensor.data_ptr()), ctypes.c_size_t(self.size), _MADV_POPULATE_WRITE)

    def __repr__(self) -> str:
        return f"<checkpoint mapping of {self.size} bytes pinned={self._pinned}>"

    @property
    def tensor(self) -> torch.Tensor:
        assert self.bytes is not None, "used after close"
        return self.bytes

    def pin(self) -> bool:
        """Register the mapping with CUDA once, so that copies from devices into it are asynchronous DMA; whether it
        is. A slot's first save pays it (0.24 s per 256 MiB on an H100 host, ``benchmarks/cuda_checkpoint.py``)."""
        if self._pinned is None:
            # Portable: pinned for every device's context, for a state spread over several GPUs.
            error = torch.cuda.cudart().cudaHostRegister(  # type: ignore[no-untyped-call]
                self.tensor.data_ptr(), self.size, _CUDA_HOST_REGISTER_PORTABLE
            )
            self._pinned = error == torch.cuda.cudart().cudaError.success  # type: ignore[no-untyped-call]
            if not self._pinned:  # the copies stay synchronous: slower, as correct
                logger.warning("aelastic.checkpoint: registering a slot with CUDA failed (%s)", error)
        return self._pinned

    def view(self, offset: int, like: torch.Tensor) -> torch.Tensor:
        """The mapping's bytes at ``offset`` as a tensor of ``like``'s dtype and shape (on the CPU)."""
        size = like.numel() * like.element_size()
        return self.tensor[offset : offset + size].view(like.dtype).view(like.shape)

    def layout(self, where: str) -> tuple[Header, dict[str, Any]]:
        """The checkpoint's header and metadata (its tensors' names, types and places). On a bad layout the mapping
        is closed and :class:`CheckpointError` raised, starting with ``where``."""
        try:
            header = Header.decode(self.mmap[:HEADER_SIZE])
            meta: dict[str, Any] = json.loads(
                bytes(self.mmap[header.meta_offset : header.meta_offset + header.meta_size])
            )
        except (LayoutError, ValueError) as exc:
            self.release()
            raise CheckpointError(f"{where}: {exc}") from None
        return header, meta

    def release(self) -> None:
        """Done reading: closed, unless it is one of this process's slots."""
        if not self.kept:
            self.close()

    def close(self) -> None:
        if self._pinned:
            torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())  # type: ignore[no-untyped-call]
            self._pinned = False
        self.bytes = None  # the tensor holds an export of the mmap's buffer: it goes first
        # Tensors over it may live on (a state dcp.async_save staged here): then it is unmapped with the last one.
        with contextlib.suppress(BufferError):
            self.mmap.close()


class _Client:
    """This process's side of the checkpoint service: its link and the slots it has mapped."""

    def __init__(self, link: AgentLink, rank: int) -> None:
        self.link = link
        self.slots: dict[int, tuple[int, Mapping]] = {}  # slot id -> (generation, mapping)
        for slot, (generation, mapped) in premapped.take(rank).items():  # the standby's (see .premapped)
            mapping = Mapping(mapped)
            mapping.kept = True
            self.slots[slot] = (generation, mapping)
        self.pending: dict[int, _Background] = {}  # slots mapped in the background
        self.last: LoadInfo | None = None

    def request(self, what: str, op: str, **fields: Any) -> tuple[dict[str, Any], list[int]]:
        try:
            return self.link.request(f"checkpoint.{op}", **fields)
        except LinkRefused as exc:
            raise CheckpointError(f"aelastic.checkpoint.{what}: {exc}") from None
        except OSError as exc:
            raise CheckpointError(f"aelastic.checkpoint.{what}: lost the link to the agent: {exc}") from exc

    def reserve(self, what: str, size: int, **fields: Any) -> tuple[dict[str, Any], Mapping]:
        """A slot of at least ``size`` bytes, mapped; the reply says its id, generation, rank and world."""
        self._settle()
        mapped = {str(slot): generation for slot, (generation, _) in self.slots.items()}
        reply, fds = self.request(what, "reserve", size=size, mapped=mapped, **fields)
        try:
            return reply, self._slot(reply, fds, populate=True)
        finally:
            for fd in fds:
                os.close(fd)

    def commit(self, what: str, **fields: Any) -> None:
        """Make the reserved slot this rank's latest checkpoint. After the rank's first, the agent answers with the
        slot of its second, which a thread maps from now on (the copy is over), so that the second save costs a
        copy, as every later one does, and not the allocation of its pages."""
        reply, fds = self.request(what, "commit", **fields)
        try:
            if "ahead" in reply:
                slot, generation, capacity = (int(value) for value in reply["ahead"])
                self._map_later(slot, generation, capacity, fds[0])
                self.pending[slot].start()
        finally:
            for fd in fds:
                os.close(fd)

    def _slot(self, reply: dict[str, Any], fds: list[int], *, populate: bool) -> Mapping:
        """This process's mapping of the slot ``reply`` names, mapped now if it has none of that generation (``fds``
        then holds its memory file)."""
        slot, generation = int(reply["slot"]), int(reply["generation"])
        held = self.slots.get(slot)
        if held is None or held[0] != generation:
            if held is not None:
                held[1].close()
            mapping = Mapping.open(fds[0], int(reply["capacity"]), shared=True, writable=True, populate=populate)
            mapping.kept = True
            self.slots[slot] = (generation, mapping)
        return self.slots[slot][1]

    def to_read(self, reply: dict[str, Any], fds: list[int]) -> Mapping:
        """The agent's memory to load from: one of this rank's own slots is this process's mapping of it (a survivor
        has it from its saves: no page to map; a replacement keeps it for the saves to come, and maps the rank's
        other slots in the background, so that its first save costs what every later one does), another a
        read-only mapping."""
        if "slot" not in reply:
            return Mapping.open(fds[0], int(reply["size"]), shared=True)
        self._settle()
        for (slot, generation, capacity), fd in zip(reply["others"], fds[1:], strict=True):
            held = self.slots.get(slot)
            if (held is None or held[0] != generation) and slot not in self.pending:
                self._map_later(slot, generation, capacity, fd)
        return self._slot(reply, fds, populate=False)

    def _map_later(self, slot: int, generation: int, capacity: int, fd: int) -> None:
        """Map ``slot`` in a thread once :meth:`read_done` says the load's copies are over (not beside them: they
        would share the memory's bandwidth)."""
        self.pending[slot] = _Background(generation, capacity, os.dup(fd))

    def read_done(self) -> None:
        """A load's copies are over: the slots it left to map in the background are mapped now."""
        for background in self.pending.values():
            background.start()

    def _settle(self) -> None:
        """The slots mapped in the background, once mapped (a save given one waits for it)."""
        self.read_done()
        for slot, background in list(self.pending.items()):
            mapping = background.result()
            del self.pending[slot]
            if mapping is not None:
                mapping.kept = True
                old = self.slots.pop(slot, None)
                if old is not None:
                    old[1].close()
                self.slots[slot] = (background.generation, mapping)


class _Background:
    """A slot mapped (page tables filled) by a thread of its own at nice 19, so that it takes only the CPU the
    training leaves (a nice value is per thread on Linux). Started without waiting for the thread to run, as
    ``threading.Thread.start`` would: on a busy node that wait alone cost a restore 0.04-0.09 s."""

    def __init__(self, generation: int, capacity: int, fd: int) -> None:
        self.generation, self._capacity, self._fd = generation, capacity, fd
        self._started = False
        self._done = threading.Event()
        self._mapping: Mapping | None = None

    def start(self) -> None:
        if not self._started:
            self._started = True
            _thread.start_new_thread(self._run, ())

    def _run(self) -> None:
        try:
            with contextlib.suppress(OSError):
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
            self._mapping = Mapping.open(self._fd, self._capacity, shared=True, writable=True, populate=True)
        except OSError:  # mapped again when a save is given the slot (its descriptor comes then)
            pass
        finally:
            os.close(self._fd)
            self._done.set()

    def result(self) -> Mapping | None:
        """The mapping, once the thread is done (``None``: it could not map)."""
        self._done.wait()
        return self._mapping


_client_lock = threading.Lock()
_clients: dict[int, _Client] = {}  # by pid: a forked child has no link of its own


def client(what: str) -> _Client:
    """This worker's checkpoint client.

    Raises:
        CheckpointError: this process was not started by an aelastic agent.
    """
    with _client_lock:
        found = _clients.get(os.getpid())
        if found is None:
            link = agent_link()
            if link is None:
                raise CheckpointError(
                    f"aelastic.checkpoint.{what}: this process was not started by an aelastic agent (aelastic run, "
                    "aelastic.launch or aelastic.run), so no agent holds its checkpoints; run it under aelastic, or "
                    "save with torch.save"
                )
            install_exit_report()
            heap.settle()  # the state exists now: what a standby warmed for it is used (see .heap)
            found = _clients[os.getpid()] = _Client(link, int(os.environ.get("RANK", "-1")))
        return found


def copy_into(mapping: Mapping, tensors: Sequence[tuple[torch.Tensor, int]]) -> None:
    """Copy each ``(tensor, offset)`` into ``mapping``'s bytes: CPU tensors by one memory copy each, device tensors
    asynchronously into the pinned mapping, all finished before this returns."""
    devices = {t.device for t, _ in tensors if t.device.type == "cuda"}
    pinned = bool(devices) and mapping.pin()
    with torch.no_grad():
        for tensor, offset in tensors:
            if tensor.numel():
                mapping.view(offset, tensor).copy_(tensor, non_blocking=pinned and tensor.device.type == "cuda")
    for device in devices:
        torch.cuda.synchronize(device)


def write_tail(mapping: Mapping, header: Header, meta: bytes) -> None:
    """The metadata, then the header: the last bytes a checkpoint gets (see :mod:`.layout`)."""
    mapping.mmap[header.meta_offset : header.meta_offset + len(meta)] = meta
    encoded = header.encode()
    mapping.mmap[: len(encoded)] = encoded


def save(state: Any, *, step: int) -> None:
    """Copy ``state`` into the agent's memory as this rank's checkpoint of ``step``; see :mod:`aelastic.checkpoint`.

    Raises:
        CheckpointError: a value the state may not hold (named by its key path), a state larger than the agent
            allows a rank (``--checkpoint-memory``), no agent to hold it, or the agent gone. The previous
            checkpoint stays as it was.
    """
    if type(step) is not int or step < 0:
        raise CheckpointError(f"aelastic.checkpoint.save: step={step!r}: must be an int >= 0")
    own = client("save")
    try:
        tree, blobs = flatten(state)
    except StateError as exc:
        raise CheckpointError(f"aelastic.checkpoint.save: {exc}") from None
    offsets, data_size = place([blob.nbytes for blob in blobs])
    for blob, offset in zip(blobs, offsets, strict=True):
        blob.info["offset"], blob.info["nbytes"] = offset, blob.nbytes
    meta = json.dumps({"tree": tree, "blobs": [blob.info for blob in blobs]}, separators=(",", ":")).encode()
    size = DATA_OFFSET + data_size + len(meta)
    reply, mapping = own.reserve("save", size, step=step)
    copy_into(mapping, [(blob.tensor, offset) for blob, offset in zip(blobs, offsets, strict=True)])
    header = Header("state", step, int(reply["rank"]), int(reply["world"]), data_size, DATA_OFFSET + data_size,
                    len(meta))  # fmt: skip
    write_tail(mapping, header, meta)
    host = sum(blob.nbytes for blob in blobs if blob.tensor.device.type == "cpu")  # what a replacement allocates
    own.commit("save", slot=int(reply["slot"]), step=step, size=size, host=host)


def open_checkpoint(
    what: str, rank: int | None, *, metadata: bool = False
) -> tuple[Mapping, Header, dict[str, Any], LoadInfo] | None:
    """The checkpoint the job restores ``rank`` (default: this worker's) from, mapped; ``None`` if there is none.
    ``metadata``: only its header and metadata will be read (another node's agent sends no more)."""
    own = client(what)
    reply, fds = own.request(what, "load", rank=rank, metadata=metadata)
    if not reply.get("found"):
        return None
    try:
        if "path" in reply:
            fd = os.open(reply["path"], os.O_RDONLY)
            try:
                mapping = Mapping.open(fd, os.fstat(fd).st_size, shared=False)
            finally:
                os.close(fd)
        else:
            mapping = own.to_read(reply, fds)
    except OSError as exc:
        raise CheckpointError(f"aelastic.checkpoint.{what}: could not map {reply.get('path', 'the checkpoint')}: "
                              f"{exc}") from exc  # fmt: skip
    finally:
        for fd in fds:
            os.close(fd)
    header, meta = mapping.layout(f"aelastic.checkpoint.{what}: {reply.get('path', 'the checkpoint')}")
    return mapping, header, meta, LoadInfo(header.step, header.rank, header.world, str(reply["source"]))


def load(*, into: Any = None, map_location: str | torch.device | None = None, rank: int | None = None) -> Any | None:
    """This rank's state from the checkpoint the job restores from, or ``None`` when there is none; see
    :mod:`aelastic.checkpoint`.

    Raises:
        CheckpointError: no agent, the agent gone, a checkpoint saved through DCP (load it with ``dcp.load``), a
            tensor of ``into`` of another shape or dtype (named by its key path).
    """
    opened = open_checkpoint("load", rank)
    own = client("load")
    if opened is None:
        own.last = None
        return None
    mapping, header, meta, info = opened
    try:
        if header.kind != "state":
            raise CheckpointError(
                f"aelastic.checkpoint.load: step {header.step} was saved through torch.distributed.checkpoint: load "
                "it with dcp.load(state, storage_reader=aelastic.checkpoint.StorageReader())"
            )
        blobs = meta["blobs"]
        base = mapping.tensor

        def view(index: int) -> torch.Tensor:
            offset = blobs[index]["offset"]
            return base[offset : offset + blobs[index]["nbytes"]]

        try:
            state = unflatten(meta["tree"], blobs, view, into=into, map_location=map_location)
        except StateError as exc:
            raise CheckpointError(f"aelastic.checkpoint.load: {exc}") from None
    finally:
        mapping.release()
        own.read_done()
    own.last = info
    own.request("load", "loaded", step=info.step, source=info.source)  # the restore's end, for the incident records
    return state


def available() -> bool:
    """Whether this process was started by an aelastic agent, which holds its checkpoints (else every other call
    raises :class:`CheckpointError`): a script that also runs under torchrun checkpoints its own way there."""
    return agent_link() is not None


def step_to_restore() -> int | None:
    """The step the job restores from in this round (``None``: there is none: the job's first round, or no step that
    every rank saved), for a script that must know before it loads (``dcp.load`` has nothing to say "none" with).

    Raises:
        CheckpointError: no agent, or the agent gone.
    """
    reply, _ = client("step_to_restore").request("step_to_restore", "point")
    step = reply.get("step")
    return None if step is None else int(step)


def last_loaded() -> LoadInfo | None:
    """What this process's last :func:`load` (or ``dcp.load`` through :class:`StorageReader`) restored (``None``:
    nothing yet, or there was no checkpoint)."""
    found = _clients.get(os.getpid())
    return None if found is None else found.last
