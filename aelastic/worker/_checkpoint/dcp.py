"""``torch.distributed.checkpoint`` over aelastic's in-memory checkpoints: a storage writer and a storage reader.

::

    dcp.save(state, storage_writer=aelastic.checkpoint.StorageWriter(step=step))   # or dcp.async_save
    dcp.load(state, storage_reader=aelastic.checkpoint.StorageReader())            # the step the job restores
    dcp.load(state, storage_reader=aelastic.checkpoint.StorageReader("/ckpt"))     # --checkpoint-dir's newest

A DCP save writes each rank's share of the state (DCP's planner decides it: a replicated tensor is written by one
rank only) into that rank's slot in its agent's memory, as ``save`` does (kind ``"dcp"`` in the header). The
coordinator's slot also holds the checkpoint's global metadata (DCP's ``Metadata``), encoded as JSON, never
pickled (:func:`encode_metadata`), and is committed only in ``finish``, once every rank has written: a step is
complete when every rank, the coordinator included, has committed it. A load reads the global metadata from the
coordinator's checkpoint and each item from the rank that wrote it, wherever that rank's checkpoint is (this node's
agent, another node's, or the checkpoint directory), so a checkpoint saved in one world size loads into another
through DCP's own resharding (``StorageReader.sources`` says where each saved rank came from). Non-tensor values
are DCP's own business (it hands them over as ``torch.save`` bytes, kept as they are).

``dcp.save(..., use_collectives=False)`` saves with no collective but a barrier at the end: each rank plans alone,
writes every item it holds (a replicated one on every rank) and the metadata of its own items; a load merges the
saved ranks' metadata into the global one (:func:`merge_metadata`), each replicated item read from the loading
rank's own saved rank. Four exchanges of pickled objects fewer per save; and in the world that saved, a load reads
its own rank's checkpoint only.

A load reads another saved rank's metadata without its data (the agent that holds it sends its agent the metadata
alone): a rank's data crosses the network only when an item of the load lies in it.

The step of a save is ``step=``, or the number at the end of ``checkpoint_id`` (``"step-120"``, ``".../120"``).

``dcp.async_save`` stages the state through the writer (it is DCP's ``AsyncStager``): the tensors are copied into
the rank's slot before the call returns, and the save in DCP's thread finds them there, so a step waits for one
memory copy, and nothing is copied twice.
"""

from __future__ import annotations

import io
import json
import os
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader as _StorageReader
from torch.distributed.checkpoint.storage import StorageWriter as _StorageWriter
from torch.distributed.checkpoint.storage import WriteResult
from torch.distributed.tensor import DTensor
from torch.futures import Future

from ...errors import CheckpointError
from .api import LoadInfo, Mapping, client, copy_into, open_checkpoint, write_tail
from .layout import DATA_OFFSET, Header, place
from .tree import StateError, dtype_from_name, dtype_name, flatten, unflatten

__all__ = ["StorageReader", "StorageWriter", "decode_metadata", "encode_metadata", "merge_metadata"]

_DCP_VERSION = "1.0.0"  # the layout version DCP's own FileSystemWriter writes (filesystem.CURRENT_DCP_VERSION)
_STEP = re.compile(r"(\d+)\D*$")


def _step_of(checkpoint_id: str | os.PathLike[str] | None, what: str) -> int | None:
    if checkpoint_id is None:
        return None
    text = os.fspath(checkpoint_id)
    match = _STEP.search(os.path.basename(text.rstrip("/")) or text)
    if match is None:
        raise CheckpointError(f"aelastic.checkpoint.{what}: checkpoint_id {text!r} names no step: pass step=N, or an "
                              "id that ends with the step's number")  # fmt: skip
    return int(match[1])


def _index(index: MetadataIndex) -> list[Any]:
    return [index.fqn, None if index.offset is None else list(index.offset), index.index]


def _from_index(data: list[Any]) -> MetadataIndex:
    fqn, offset, hint = data
    return MetadataIndex(fqn, offset, hint)


def _tree(value: Any, what: str) -> Any:
    tree, blobs = flatten(value)
    if blobs:
        raise StateError(f"{what} holds tensors: DCP keeps those in the state, not in its metadata")
    return tree


def encode_metadata(metadata: Metadata) -> dict[str, Any]:
    """DCP's ``Metadata`` as JSON (what its FileSystemWriter pickles into ``.metadata``).

    Raises:
        StateError: a planner's or a storage's data that holds a value JSON cannot (a custom planner's objects).
    """
    entries: dict[str, Any] = {}
    for fqn, entry in metadata.state_dict_metadata.items():
        if isinstance(entry, BytesStorageMetadata):
            entries[fqn] = {"bytes": True}
            continue
        p = entry.properties
        entries[fqn] = {
            "dtype": dtype_name(p.dtype), "size": list(entry.size), "requires_grad": p.requires_grad,
            "chunks": [[list(c.offsets), list(c.sizes)] for c in entry.chunks],
        }  # fmt: skip
    storage = [[_index(index), info] for index, info in (metadata.storage_data or {}).items()]
    meta = metadata.storage_meta
    return {
        "state_dict_metadata": entries,
        "planner_data": _tree(metadata.planner_data, "the planner's data"),
        "storage_data": storage,
        "storage_meta": None if meta is None else {
            "checkpoint_id": None if meta.checkpoint_id is None else os.fspath(meta.checkpoint_id),
            "save_id": meta.save_id, "load_id": meta.load_id, "modules": list(meta.modules),
        },
        "version": metadata.version,
    }  # fmt: skip


def decode_metadata(data: dict[str, Any]) -> Metadata:
    """The ``Metadata`` :func:`encode_metadata` encoded."""
    entries: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
    for fqn, entry in data["state_dict_metadata"].items():
        if entry.get("bytes"):
            entries[fqn] = BytesStorageMetadata()
            continue
        properties = TensorProperties(dtype=dtype_from_name(entry["dtype"]), requires_grad=entry["requires_grad"])
        chunks = [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in entry["chunks"]]
        entries[fqn] = TensorStorageMetadata(properties, torch.Size(entry["size"]), chunks)
    meta = data.get("storage_meta")
    return Metadata(
        state_dict_metadata=entries,
        planner_data=unflatten(data["planner_data"], [], lambda i: torch.empty(0, dtype=torch.uint8)),
        storage_data={_from_index(index): info for index, info in data["storage_data"]},
        storage_meta=None if meta is None else StorageMeta(**meta),
        version=data.get("version"),
    )


def merge_metadata(parts: Sequence[Metadata]) -> Metadata:
    """The global metadata of a checkpoint whose ranks each saved the metadata of their own items (``dcp.save``'s
    ``use_collectives=False``): each tensor's chunks, and each item's place, from the first rank that holds it."""
    entries: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
    chunks: dict[str, dict[tuple[tuple[int, ...], tuple[int, ...]], ChunkStorageMetadata]] = {}
    storage: dict[MetadataIndex, Any] = {}
    planner_data: dict[str, Any] = {}
    for part in parts:
        for fqn, entry in part.state_dict_metadata.items():
            entries.setdefault(fqn, entry)
            if isinstance(entry, TensorStorageMetadata):
                for chunk in entry.chunks:
                    chunks.setdefault(fqn, {}).setdefault((tuple(chunk.offsets), tuple(chunk.sizes)), chunk)
        for index, info in (part.storage_data or {}).items():
            storage.setdefault(index, info)
        if isinstance(part.planner_data, dict):
            planner_data = {**part.planner_data, **planner_data}
    for fqn, entry in entries.items():
        if isinstance(entry, TensorStorageMetadata):
            entries[fqn] = TensorStorageMetadata(entry.properties, entry.size, list(chunks.get(fqn, {}).values()))
    first = parts[0]
    return Metadata(state_dict_metadata=entries, planner_data=planner_data or first.planner_data,
                    storage_data=storage, storage_meta=first.storage_meta, version=first.version)  # fmt: skip


class StorageWriter(_StorageWriter):
    """DCP's storage writer into the agent's memory (see the module doc).

    Args:
        step: the step of the checkpoint; else the number that ends ``dcp.save``'s ``checkpoint_id``.
    """

    _synchronize_after_execute = False  # DCP's AsyncStager: the staging copy is done when stage() returns

    def __init__(self, step: int | None = None) -> None:
        self._given = step
        self._step = step
        self._coordinator = False
        self._alone = False  # use_collectives=False: every rank saves the metadata of its own items
        self._items = 0
        self._pending: tuple[dict[str, Any], Mapping, int] | None = None
        self._staged: _Staged | None = None

    def __repr__(self) -> str:
        return f"<aelastic.checkpoint.StorageWriter step={self._step}>"

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        step = _step_of(checkpoint_id, "StorageWriter")
        self._step = step if step is not None else self._given
        self._pending = None

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._alone = not kwargs.get("use_collectives", True)
        self._coordinator = is_coordinator or self._alone

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        self._items = sum(len(plan.items) for plan in plans)  # what the global metadata will describe
        return plans

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=None if self._step is None else f"aelastic:{self._step}")

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return _STEP.search(os.fspath(checkpoint_id)) is not None

    @property
    def should_synchronize_after_execute(self) -> bool:
        return self._synchronize_after_execute

    def synchronize_staging(self) -> None:
        """Nothing to wait for: :meth:`stage` returns with its copy done."""

    def close(self) -> None:
        """Nothing to release: the slot is the agent's."""

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """``dcp.async_save``'s staging: this rank's tensors copied into its slot in the agent's memory now (the step
        waits for this copy alone), and the state handed back over that memory, so that the save in DCP's thread
        writes each tensor where it already lies: no staging buffer, no second copy."""
        tensors: list[torch.Tensor] = []

        def collect(tensor: torch.Tensor) -> torch.Tensor:
            tensors.append(tensor)
            return tensor

        leaves = _walk(state_dict, collect)[0]
        offsets, data_size = place([_size(t) for t in tensors])
        world = int(os.environ.get("WORLD_SIZE", "1"))
        # Room for what write_data and finish add after the tensors (see there): DCP's bytes items and the items'
        # places on every rank; the global metadata on the coordinator (global rank 0, as a group's rank 0 mostly
        # is), its own items' on every rank of a save without collectives. Short of it, the save copies everything
        # into a larger slot.
        room = 65536 + 5120 * leaves + (1024 * leaves * world if os.environ.get("RANK", "0") == "0" else 0)
        _, mapping = client("StorageWriter").reserve("StorageWriter", DATA_OFFSET + data_size + room)
        copy_into(mapping, list(zip(tensors, offsets, strict=True)))
        self._staged = _Staged(mapping, DATA_OFFSET + data_size)
        views = iter(offsets)
        staged: dict[str, Any] = _walk(state_dict, lambda tensor: mapping.view(next(views), tensor))[1]
        return staged

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        step = self._step
        if step is None or step < 0:
            raise CheckpointError("aelastic.checkpoint.StorageWriter: no step: StorageWriter(step=N), or a "
                                  "checkpoint_id that ends with the step's number")  # fmt: skip
        own = client("StorageWriter")
        data = [(item, planner.resolve_data(item)) for item in plan.items]
        sizes = [_size(value) for _, value in data]
        staged, self._staged = self._staged, None
        lying = [None if staged is None else staged.offset_of(value) for _, value in data]  # staged: found in place
        fresh, data_size = place([0 if at is not None else size for at, size in zip(lying, sizes, strict=True)],
                                 DATA_OFFSET if staged is None else staged.end)  # fmt: skip
        offsets = [fresh_at if at is None else at for at, fresh_at in zip(lying, fresh, strict=True)]
        placed = zip(data, offsets, sizes, strict=True)
        items = [_item_info(item, value, offset, size) for (item, value), offset, size in placed]
        # The coordinator writes the global metadata (which places every item) in finish: room for it now (a few
        # hundred bytes an item); another rank's checkpoint lists the places of its own items.
        meta = b"" if self._coordinator else json.dumps({"items": items}).encode()
        room = 65536 + 1024 * max(self._items, len(plan.items)) if self._coordinator else 0
        size = DATA_OFFSET + data_size + len(meta) + room
        reply, mapping = own.reserve("StorageWriter", size, step=step)
        in_place = staged is not None and mapping is staged.mapping  # else the slot grew: nothing lies in it yet
        tensors = [(value.detach(), offset) for (_, value), offset, at in zip(data, offsets, lying, strict=True)
                   if isinstance(value, torch.Tensor) and not (in_place and at is not None)]  # fmt: skip
        copy_into(mapping, tensors)
        for (_, value), offset in zip(data, offsets, strict=True):
            if not isinstance(value, torch.Tensor):
                raw = value.getbuffer()
                mapping.mmap[offset : offset + len(raw)] = raw
        rank = int(reply["rank"])
        results = [WriteResult(index=item.index, size_in_bytes=size_, storage_data={**info, "rank": rank})
                   for (item, _), size_, info in zip(data, sizes, items, strict=True)]  # fmt: skip
        if self._coordinator:
            self._pending = (reply, mapping, data_size)
        else:
            header = Header("dcp", step, rank, int(reply["world"]), data_size, DATA_OFFSET + data_size, len(meta))
            write_tail(mapping, header, meta)
            own.commit("StorageWriter", slot=int(reply["slot"]), step=step, size=header.total)
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        if self._pending is None or self._step is None:
            raise CheckpointError("aelastic.checkpoint.StorageWriter: finish() without write_data()")
        reply, mapping, data_size = self._pending
        self._pending = None
        metadata.version = _DCP_VERSION
        metadata.storage_data = {result.index: result.storage_data for ranks in results for result in ranks}
        metadata.storage_meta = self.storage_meta()
        try:
            encoded = encode_metadata(metadata)
        except StateError as exc:
            raise CheckpointError(f"aelastic.checkpoint.StorageWriter: {exc}") from None
        meta = json.dumps({"metadata": encoded, "alone": self._alone}).encode()
        header = Header("dcp", self._step, int(reply["rank"]), int(reply["world"]), data_size,
                        DATA_OFFSET + data_size, len(meta))  # fmt: skip
        own = client("StorageWriter")
        slot = int(reply["slot"])
        if header.total > mapping.size:  # more metadata than the room kept for it: a larger slot, the data copied
            kept = bytes(mapping.mmap[DATA_OFFSET : DATA_OFFSET + data_size])  # the reserve may replace the mapping
            larger, mapping = own.reserve("StorageWriter", header.total, step=self._step)
            mapping.mmap[DATA_OFFSET : DATA_OFFSET + data_size] = kept
            slot = int(larger["slot"])
        write_tail(mapping, header, meta)
        own.commit("StorageWriter", slot=slot, step=self._step, size=header.total)


class _Staged(NamedTuple):
    """The slot :meth:`StorageWriter.stage` copied the state's tensors into, and where they end in it."""

    mapping: Mapping
    end: int

    def offset_of(self, value: torch.Tensor | io.BytesIO) -> int | None:
        """Where ``value``'s bytes lie in the staged slot, whole and in order; ``None``: not there."""
        if not isinstance(value, torch.Tensor) or value.device.type != "cpu" or not value.is_contiguous():
            return None
        start = value.data_ptr() - self.mapping.tensor.data_ptr()
        return start if start >= DATA_OFFSET and start + _size(value) <= self.end else None


def _walk(value: Any, tensor: Callable[[torch.Tensor], torch.Tensor]) -> tuple[int, Any]:
    """``value`` (a state dict) with each tensor (a DTensor's local one) replaced by ``tensor(it)``, in order, and
    how many leaves it has."""
    if isinstance(value, DTensor):  # its spec kept, its local tensor replaced, as DCP's own stager does
        return 1, DTensor(tensor(value._local_tensor), value._spec, requires_grad=False)  # type: ignore[no-untyped-call]
    if isinstance(value, torch.Tensor):
        return 1, tensor(value.detach())
    if isinstance(value, dict):
        entries = {key: _walk(item, tensor) for key, item in value.items()}
        return sum(n for n, _ in entries.values()), {key: item for key, (_, item) in entries.items()}
    if isinstance(value, (list, tuple)):
        items = [_walk(item, tensor) for item in value]
        walked = [item for _, item in items]
        return sum(n for n, _ in items), tuple(walked) if isinstance(value, tuple) else walked
    return 1, value


def _size(value: torch.Tensor | io.BytesIO) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    return len(value.getbuffer())


def _item_info(item: WriteItem, value: torch.Tensor | io.BytesIO, offset: int, size: int) -> dict[str, Any]:
    info: dict[str, Any] = {"offset": offset, "nbytes": size}
    if item.type is not WriteItemType.BYTE_IO and isinstance(value, torch.Tensor):
        info.update(dtype=dtype_name(value.dtype), shape=list(value.shape))
    return info


class StorageReader(_StorageReader):
    """DCP's storage reader of aelastic's checkpoints (see the module doc).

    Args:
        directory: read the checkpoint directory's newest complete step (or ``step``'s) instead of the step the job
            restores from; ``dcp.load``'s ``checkpoint_id`` may name it too.
        step: with a directory, the step to read.
    """

    def __init__(self, directory: str | os.PathLike[str] | None = None, step: int | None = None) -> None:
        self._directory = None if directory is None else Path(directory)
        self._step = step
        self._mappings: dict[int, Mapping] = {}
        self._metas: dict[int, dict[str, Any]] = {}
        self._storage: dict[MetadataIndex, dict[str, Any]] = {}
        self._world = 0
        self.sources: dict[int, str] = {}  # the last load's saved ranks, each with where it came from

    def __repr__(self) -> str:
        return f"<aelastic.checkpoint.StorageReader directory={self._directory} step={self._step}>"

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self._close()
        self.sources = {}
        if checkpoint_id is not None and os.path.isdir(checkpoint_id):
            self._directory = Path(checkpoint_id)
        elif checkpoint_id is not None:
            self._step = _step_of(checkpoint_id, "StorageReader")

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return os.path.isdir(checkpoint_id)

    def _map(self, rank: int, *, metadata: bool) -> tuple[Mapping, dict[str, Any], str]:
        """Saved rank ``rank``'s checkpoint, mapped, and where it came from; ``metadata``: only its metadata will
        be read."""
        if self._directory is not None:
            mapping, header, meta = _open_file(self._directory, rank, self._step)
            source = f"disk {self._directory}"
        else:
            found = open_checkpoint("StorageReader", rank, metadata=metadata)
            if found is None:
                raise CheckpointError("aelastic.checkpoint.StorageReader: no checkpoint to load (no agent holds "
                                      "one, and --checkpoint-dir has none)")  # fmt: skip
            mapping, header, meta, info = found
            source = info.source
        if header.kind != "dcp":
            mapping.release()
            raise CheckpointError(f"aelastic.checkpoint.StorageReader: step {header.step} was saved with "
                                  "aelastic.checkpoint.save: load it with aelastic.checkpoint.load")  # fmt: skip
        self._step, self._world = header.step, header.world
        return mapping, meta, source

    def _open(self, rank: int) -> tuple[Mapping, dict[str, Any]]:
        """Saved rank ``rank``'s checkpoint, mapped once per load."""
        if rank not in self._mappings:
            self._mappings[rank], self._metas[rank], self.sources[rank] = self._map(rank, metadata=False)
        return self._mappings[rank], self._metas[rank]

    def _metadata(self, rank: int) -> dict[str, Any]:
        """Saved rank ``rank``'s metadata: a rank whose data no item of this load needs is never fetched whole."""
        if rank not in self._metas:
            mapping, self._metas[rank], _ = self._map(rank, metadata=True)
            mapping.release()
        return self._metas[rank]

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        meta = self._metadata(0)
        if "metadata" not in meta:
            raise CheckpointError("aelastic.checkpoint.StorageReader: rank 0's checkpoint holds no DCP metadata")
        if meta.get("alone"):  # saved without collectives: each rank's checkpoint describes its own items
            # An item every rank wrote (a replicated one) is read where this rank's own saved rank put it: in the
            # world that saved, a load reads one checkpoint only.
            own = int(os.environ.get("RANK", "0")) % self._world
            ranks = [own, *(r for r in range(self._world) if r != own)]
            metadata = merge_metadata([decode_metadata(self._metadata(r)["metadata"]) for r in ranks])
        else:
            metadata = decode_metadata(meta["metadata"])
        self._storage = metadata.storage_data
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._storage = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        try:
            for item in plan.items:
                info = self._storage[item.storage_index]
                mapping, _ = self._open(int(info["rank"]))
                raw = mapping.tensor[info["offset"] : info["offset"] + info["nbytes"]]
                if item.type == LoadItemType.BYTE_IO:
                    planner.load_bytes(item, io.BytesIO(raw.numpy().tobytes()))
                    continue
                tensor = raw.view(dtype_from_name(info["dtype"])).view(info["shape"])
                for dim, (offset, length) in enumerate(zip(item.storage_offsets, item.lengths, strict=True)):
                    tensor = tensor.narrow(dim, offset, length)
                target = planner.resolve_tensor(item).detach()
                if target.size() != tensor.size():
                    sizes = f"the checkpoint's {list(tensor.size())} against {list(target.size())}"
                    raise CheckpointError(f"aelastic.checkpoint.StorageReader: {item.storage_index.fqn}: {sizes}")
                target.copy_(tensor)
                planner.commit_tensor(item, target)
            self._report()
        finally:
            self._close()
        future: Future[None] = Future()
        future.set_result(None)
        return future

    def _report(self) -> None:
        """Tell :func:`~aelastic.checkpoint.last_loaded` (and the agent's incident records) what this load restored:
        its step, the saved world, and each distinct source, in the order of the saved ranks read."""
        if self._directory is not None or not self._mappings or self._step is None:
            return  # a directory read needs no agent; a rank that read nothing has nothing to say
        sources = ", ".join(dict.fromkeys(self.sources[rank] for rank in sorted(self.sources)))
        own = client("StorageReader")
        own.last = LoadInfo(self._step, 0, self._world, sources)
        own.request("StorageReader", "loaded", step=self._step, source=sources)

    def _close(self) -> None:
        for mapping in self._mappings.values():
            mapping.release()
        if self._metas and self._directory is None:
            client("StorageReader").read_done()
        self._mappings.clear()
        self._metas.clear()


def _open_file(directory: Path, rank: int, step: int | None) -> tuple[Mapping, Header, dict[str, Any]]:
    """Saved rank ``rank``'s file in ``directory`` of ``step`` (``None``: the newest step it has)."""
    if step is None:
        steps = sorted(int(m[1]) for m in (re.fullmatch(r"step-(\d+)\.rank-0*(\d+)\.ckpt", n) for n in
                                           _names(directory)) if m and int(m[2]) == rank)  # fmt: skip
        if not steps:
            raise CheckpointError(f"aelastic.checkpoint.StorageReader: {directory}: no checkpoint of rank {rank}")
        step = steps[-1]
    path = directory / f"step-{step:012d}.rank-{rank:06d}.ckpt"
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as exc:
        raise CheckpointError(f"aelastic.checkpoint.StorageReader: {path}: {exc.strerror}") from None
    try:
        mapping = Mapping.open(fd, os.fstat(fd).st_size, shared=False)
    finally:
        os.close(fd)
    header, meta = mapping.layout(f"aelastic.checkpoint.StorageReader: {path}")
    return mapping, header, meta


def _names(directory: Path) -> Sequence[str]:
    try:
        return os.listdir(directory)
    except OSError as exc:
        raise CheckpointError(f"aelastic.checkpoint.StorageReader: {directory}: {exc.strerror}") from None
