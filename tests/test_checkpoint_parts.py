"""The pure and local parts of in-memory checkpoints, without an agent: a state as JSON and raw bytes
(``child/tree.py``), the bytes' layout, where a job restores from (``plan.py``) and the checkpoint directory
(``persist.py``). The agent and real workers are tests/test_checkpoint.py's."""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import anyio
import numpy
import pytest
import torch

from aelastic.agent.checkpoint import replicas
from aelastic.agent.checkpoint.persist import (
    CopyStopped,
    file_name,
    newest_complete,
    remove_older,
    scan,
    write_checkpoint,
)
from aelastic.agent.checkpoint.plan import (
    Held,
    Inventory,
    NodePlan,
    holders,
    node_plan,
    restore_point,
    saved_rank,
)
from aelastic.agent.checkpoint.slots import Slot
from aelastic.worker._checkpoint import premapped
from aelastic.worker._checkpoint.api import Mapping
from aelastic.worker._checkpoint.dcp import _Staged, _walk, decode_metadata, encode_metadata, merge_metadata
from aelastic.worker._checkpoint.layout import ALIGN, DATA_OFFSET, Header, LayoutError, place
from aelastic.worker._checkpoint.tree import StateError, flatten, unflatten

pytestmark = pytest.mark.torch


def round_trip(state: Any, **kwargs: Any) -> Any:
    """``state`` through flatten, a byte buffer laid out as a slot, and unflatten."""
    tree, blobs = flatten(state)
    offsets, size = place([b.nbytes for b in blobs])
    buffer = torch.zeros(DATA_OFFSET + size, dtype=torch.uint8)
    infos = []
    for blob, offset in zip(blobs, offsets, strict=True):
        if blob.nbytes:
            buffer[offset : offset + blob.nbytes].view(blob.tensor.dtype).view(blob.tensor.shape).copy_(blob.tensor)
        infos.append({**blob.info, "offset": offset, "nbytes": blob.nbytes})
    return unflatten(tree, infos, lambda i: buffer[infos[i]["offset"] : infos[i]["offset"] + infos[i]["nbytes"]],
                     **kwargs)  # fmt: skip


def same(a: Any, b: Any) -> bool:
    """Equal in type and value, tensors bitwise (dtype, shape, bytes), NaN equal to NaN."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and a.cpu().view(-1).view(torch.uint8).equal(
            b.cpu().reshape(-1).view(torch.uint8))  # fmt: skip
    if isinstance(a, numpy.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) and math.isnan(a):
        return math.isnan(b)
    return bool(a == b)


def training_state() -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 8)).sum().backward()
    optimizer.step()
    return {"model": model.state_dict(), "optim": optimizer.state_dict(), "rng": torch.get_rng_state(), "step": 7}


def test_a_training_state_comes_back_bitwise_with_its_types() -> None:
    state = training_state()
    state["extra"] = {
        3: (1, 2.5, None, True, "s", b"\x00\xff"), (1, "a"): [float("nan"), float("inf"), -0.0, 2**70],
        "dtypes": [torch.bfloat16, torch.device("cpu"), torch.Size([2, 3])],
        "ordered": collections.OrderedDict([("b", 1), ("a", 2)]),
        "tensors": [torch.tensor(3.5), torch.empty(0, 5), torch.tensor([True, False]), torch.randn(3, 2).t(),
                    torch.randn(2, 2, dtype=torch.complex64), torch.arange(6, dtype=torch.bfloat16)],
        "numpy": [numpy.arange(5, dtype=numpy.int16), numpy.float32(1.5), numpy.random.RandomState(0).get_state()],
    }  # fmt: skip
    restored = round_trip(state)
    assert same(restored, state)
    assert restored["optim"]["state"][0]["step"].dtype == state["optim"]["state"][0]["step"].dtype
    assert isinstance(restored["extra"]["ordered"], collections.OrderedDict)


def test_the_same_tensor_twice_is_stored_once_and_comes_back_as_one() -> None:
    weight = torch.randn(4, 4)
    state = {"embed": weight, "head": weight.detach(), "other": weight.clone()}
    _, blobs = flatten(state)
    assert len(blobs) == 2
    restored = round_trip(state)
    assert restored["embed"] is restored["head"]
    assert restored["other"] is not restored["embed"]
    assert same(restored, state)


class Opaque:
    pass


@pytest.mark.parametrize(
    ("state", "path", "what"),
    [
        ({"model": {"w": torch.ones(1)}, "hook": lambda: 0}, "['hook']", "function"),
        ({"a": [1, {2, 3}]}, "['a'][1]", "builtins.set"),
        ({"a": {"b": Opaque()}}, "['a']['b']", "Opaque"),
        ({"a": collections.namedtuple("P", "x")(1)}, "['a']", "P"),
        ({"s": torch.ones(2, 2).to_sparse()}, "['s']", "sparse"),
        ({"m": torch.empty(2, device="meta")}, "['m']", "meta"),
        ({"a": numpy.array([object()])}, "['a']", "Python objects"),
        ({"k": {torch.ones(1): 1}}, "['k']", "key"),
    ],
)
def test_a_value_a_checkpoint_may_not_hold_is_named_by_its_key_path(state: Any, path: str, what: str) -> None:
    with pytest.raises(StateError) as raised:
        flatten(state)
    assert path in str(raised.value), raised.value
    assert what in str(raised.value), raised.value


def test_load_into_fills_the_given_tensors_in_place_and_refuses_another_shape() -> None:
    state = training_state()
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    target = {"model": model.state_dict()}
    restored = round_trip(state, into=target)
    assert restored["model"]["0.weight"] is target["model"]["0.weight"]
    assert model[0].weight.equal(state["model"]["0.weight"])  # the module's own parameter, filled
    wrong = {"model": {**model.state_dict(), "2.bias": torch.zeros(3)}}
    with pytest.raises(StateError, match=r"\['model'\]\['2.bias'\].*shape \[2\].*shape \[3\]"):
        round_trip(state, into=wrong)


def test_a_cuda_state_needs_cuda_or_a_map_location() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the refusal is for machines without it")
    tree, blobs = flatten({"w": torch.ones(2)})
    infos = [{**blobs[0].info, "device": "cuda:0", "offset": DATA_OFFSET, "nbytes": 8}]
    data = torch.ones(2).view(torch.uint8)
    with pytest.raises(StateError, match="no CUDA device: load with map_location='cpu'"):
        unflatten(tree, infos, lambda i: data)
    assert unflatten(tree, infos, lambda i: data, map_location="cpu")["w"].equal(torch.ones(2))


# --- layout -----------------------------------------------------------------------------------------------------------


def test_header_round_trip_and_the_bytes_that_are_not_one() -> None:
    header = Header("dcp", 12, 3, 8, 1000, DATA_OFFSET + 1024, 77)
    assert Header.decode(header.encode()) == header
    assert header.total == DATA_OFFSET + 1024 + 77
    with pytest.raises(LayoutError, match="no checkpoint header"):
        Header.decode(bytes(4096))
    with pytest.raises(LayoutError, match="shorter"):
        Header.decode(header.encode()[:10])
    newer = bytearray(header.encode())
    newer[8] = 9
    with pytest.raises(LayoutError, match="version 9"):
        Header.decode(bytes(newer))


def test_blobs_are_placed_aligned_after_the_header() -> None:
    offsets, size = place([1, 0, 100, 64])
    assert offsets[0] == DATA_OFFSET
    assert all(o % ALIGN == 0 for o in offsets)
    assert offsets == [DATA_OFFSET, DATA_OFFSET + 64, DATA_OFFSET + 64, DATA_OFFSET + 192]
    assert size == 256


# --- the plan ---------------------------------------------------------------------------------------------------------


def inventory(*held: tuple[int, int], world: int = 2, endpoint: str | None = None) -> Inventory:
    return Inventory(tuple(Held(rank, step, world, 100) for rank, step in held), endpoint)


def test_a_worker_fault_restores_the_newest_step_every_rank_holds() -> None:
    # Rank 0 completed step 25 before rank 1 failed during it: the job restores 24, which both hold.
    point = restore_point([inventory((0, 25), (0, 24), (1, 24), (1, 23))])
    assert point is not None
    assert (point.step, point.world) == (24, 2)


def test_a_lost_node_restores_from_the_replica_its_successor_kept() -> None:
    node0 = inventory((0, 9), (0, 8), (2, 9), world=3, endpoint="a:1")  # its own rank 0, and rank 2's replica
    node2 = inventory((2, 9), (2, 8), (1, 9), world=3, endpoint="c:1")  # its own rank 2, and lost rank 1's replica
    point = restore_point([node0, node2])
    assert point is not None
    assert (point.step, point.world) == (9, 3)
    assert point.holders == {0: (0,), 1: (1,), 2: (0, 1)}
    # The world of 2 that survives: node 1 (old node 2) runs rank 1, restores saved rank 1 from its own replica;
    # node 0 needs nothing from anyone.
    assert node_plan(point, [node0, node2], 0, [0], "s").fetch == {}
    assert node_plan(point, [node0, node2], 1, [1], "s").fetch == {}
    assert node_plan(point, [node0, node2], 0, [0, 1], "s").fetch == {1: "c:1"}
    assert holders(point, [node0, node2]) == {"0": "a:1", "1": "c:1", "2": "a:1"}


def test_no_step_is_restored_that_a_rank_lacks_or_two_worlds_saved() -> None:
    assert restore_point([inventory((0, 5)), inventory((2, 5), world=3)]) is None  # two worlds: neither whole
    assert restore_point([inventory((0, 5), (0, 4))]) is None  # rank 1 of world 2 holds nothing
    assert restore_point([]) is None


def test_the_directory_wins_when_it_is_newer_than_memory() -> None:
    disk = [Held(0, 30, 2, 0), Held(1, 30, 2, 0)]
    point = restore_point([inventory((0, 9), (1, 9))], disk)
    assert point is not None
    assert point.disk
    assert point.step == 30
    assert node_plan(point, [inventory()], 0, [0, 1], "s") == NodePlan(30, 2, {}, True, "s", None)
    memory = restore_point([inventory((0, 31), (1, 31))], disk)
    assert memory is not None
    assert not memory.disk
    assert memory.step == 31


def test_plans_round_trip_as_json_and_name_the_successor() -> None:
    inventories = [inventory(endpoint="a:1"), inventory(endpoint="b:2"), inventory(endpoint=None)]
    assert node_plan(None, inventories, 0, [0], "s").replica_to == "b:2"
    assert node_plan(None, inventories, 1, [1], "s").replica_to is None  # node 2 keeps no replicas
    assert node_plan(None, inventories[:1], 0, [0], "s").replica_to is None  # one node: no one to send to
    plan = NodePlan(4, 3, {1: "x:9"}, False, "secret", "b:2")
    assert NodePlan.from_json(plan.to_json()) == plan
    assert Inventory.from_json(inventory((0, 1), endpoint="a:1").to_json()) == inventory((0, 1), endpoint="a:1")


@pytest.mark.parametrize(("rank", "saved_world", "expected"), [(1, 4, 1), (3, 2, 1), (5, 3, 2), (0, 1, 0)])
def test_a_rank_of_another_world_restores_its_own_or_rank_modulo(rank: int, saved_world: int, expected: int) -> None:
    assert saved_rank(rank, saved_world) == expected


# --- the directory ----------------------------------------------------------------------------------------------------


def memory_file(step: int, rank: int, world: int, payload: bytes) -> tuple[int, Header]:
    header = Header("state", step, rank, world, len(payload), DATA_OFFSET + len(payload), 0)
    fd = os.memfd_create("test-checkpoint")
    os.pwrite(fd, header.encode(), 0)
    os.pwrite(fd, payload, DATA_OFFSET)
    return fd, header


def write(directory: Path, step: int, rank: int, world: int = 2, payload: bytes = b"x" * 100) -> Path:
    fd, header = memory_file(step, rank, world, payload)
    try:
        return write_checkpoint(directory, fd, header, threading.Event())
    finally:
        os.close(fd)


def test_files_are_whole_and_older_steps_go_once_a_newer_is_complete(tmp_path: Path) -> None:
    write(tmp_path, 10, 0)
    write(tmp_path, 10, 1)
    path = write(tmp_path, 20, 0, payload=b"y" * 5000)
    assert path.name == file_name(20, 0)
    assert path.read_bytes()[DATA_OFFSET:] == b"y" * 5000
    assert [h.step for h in newest_complete(tmp_path)] == [10, 10]  # 20 lacks rank 1
    remove_older(tmp_path, 20)  # 20 is not complete: nothing goes
    assert sorted(scan(tmp_path)) == [10, 20]
    write(tmp_path, 20, 1)
    assert [(h.rank, h.step) for h in newest_complete(tmp_path)] == [(0, 20), (1, 20)]
    remove_older(tmp_path, 20)
    assert sorted(p.name for p in tmp_path.iterdir()) == [file_name(20, 0), file_name(20, 1)]  # no temporary file


def test_a_stopped_copy_leaves_no_file(tmp_path: Path) -> None:
    fd, header = memory_file(5, 0, 1, b"z" * 1000)
    stop = threading.Event()
    stop.set()
    try:
        with pytest.raises(CopyStopped):
            write_checkpoint(tmp_path, fd, header, stop)
    finally:
        os.close(fd)
    assert list(tmp_path.iterdir()) == []
    assert newest_complete(tmp_path / "absent") == []


WARMING = """
import itertools, json, resource
import torch
from aelastic.worker._checkpoint import heap

def faults(size):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    tensor = torch.zeros(size // 4)
    return tensor, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

looks = itertools.count()
touched = heap.warm(64 << 20, lambda: next(looks) >= 2)  # the assignment arrives after two chunks
state, warm = faults(16 << 20)
heap.settle()
heap.settle()  # once only
_, settled = faults(64 << 20)
print(json.dumps({"touched": touched, "warm": warm, "settled": settled}))
"""


def test_a_warming_stops_when_a_message_arrives_and_the_worker_settles_malloc_once() -> None:
    out = subprocess.run([sys.executable, "-c", WARMING], capture_output=True, text=True, timeout=120, check=True)
    result = json.loads(out.stdout)
    pages = (16 << 20) // os.sysconf("SC_PAGE_SIZE")
    assert result["touched"] == 16 << 20, result  # two chunks of 8 MiB
    assert result["warm"] < pages // 8, result  # a state that fits what was touched faults almost nothing
    assert result["settled"] > 4 * pages // 2, result  # large blocks are fresh mappings again


def test_slots_mapped_ahead_go_to_a_worker_of_their_rank_only_and_fill_in_resumable_chunks() -> None:
    size = 40 << 20  # three chunks
    fds = []
    for byte in (1, 2):
        fd = os.memfd_create("slot")
        os.ftruncate(fd, size)
        os.pwrite(fd, bytes([byte]) * 4096, 0)
        fds.append(fd)
    looks = iter([False, True])  # a message arrives after the first chunk
    try:
        premapped.map_slots(3, [(7, 1, size), (8, 2, size)], fds)
        assert not premapped.fill(lambda: next(looks, False))
        assert premapped.fill(lambda: False)  # resumed where it stopped, to the end
        assert premapped.take(4) == {}  # another rank's: closed
        assert premapped.take(3) == {}  # and gone
        premapped.map_slots(3, [(7, 1, size), (8, 2, size)], fds)
        taken = premapped.take(3)
    finally:
        for fd in fds:
            os.close(fd)
    assert {slot: (generation, mapping[0]) for slot, (generation, mapping) in taken.items()} == {7: (1, 1), 8: (2, 2)}
    assert premapped.take(3) == {}  # taken once
    for _, mapping in taken.values():
        mapping.close()


def test_a_staged_state_keeps_its_shape_and_the_save_finds_each_tensor_where_it_lies() -> None:
    """``dcp.async_save`` through aelastic's writer (``dcp._walk``, ``_Staged``): the state comes back with the same
    structure, each tensor replaced in order; a tensor counts as lying in the staged slot only whole, contiguous and
    inside the staged bytes."""
    state = {"model": {"w": torch.ones(2, 3), "b": torch.zeros(3)}, "optim": [torch.full((4,), 2.0), (1, "x")]}
    seen: list[torch.Tensor] = []

    def twice(tensor: torch.Tensor) -> torch.Tensor:
        seen.append(tensor)
        return tensor * 2

    leaves, walked = _walk(state, twice)
    assert leaves == 5
    assert [t.tolist() for t in seen] == [[[1.0] * 3] * 2, [0.0] * 3, [2.0] * 4]
    assert walked["model"]["w"].tolist() == [[2.0] * 3] * 2
    assert walked["optim"][0].tolist() == [4.0] * 4
    assert walked["optim"][1] == (1, "x")
    assert isinstance(walked["optim"][1], tuple)

    fd = os.memfd_create("staged")
    try:
        os.ftruncate(fd, 1 << 20)
        mapping = Mapping.open(fd, 1 << 20, shared=True, writable=True, populate=True)
    finally:
        os.close(fd)
    matrix = mapping.view(DATA_OFFSET, torch.empty(64, 64))
    staged = _Staged(mapping, DATA_OFFSET + matrix.numel() * 4)
    assert staged.offset_of(matrix) == DATA_OFFSET
    assert staged.offset_of(matrix[8:16]) == DATA_OFFSET + 8 * 64 * 4  # a chunk of rows: contiguous, in place
    assert staged.offset_of(matrix[:, :8]) is None  # columns: not contiguous
    assert staged.offset_of(torch.empty(64, 64)) is None  # elsewhere in memory
    assert staged.offset_of(mapping.view(staged.end, torch.empty(4))) is None  # past the staged bytes
    del matrix
    mapping.close()


def test_ranks_that_saved_alone_merge_into_the_metadata_a_collective_save_makes() -> None:
    """``dcp.save(..., use_collectives=False)``: each rank's metadata describes its own items (its shard of ``w``, and
    the replicated ``b`` and ``step`` it wrote too); merged (:func:`dcp.merge_metadata`), through the JSON the slots
    keep, they are the metadata DCP's planner makes from every rank's plan, which its own validation accepts, and
    each item is read from the first rank that wrote it."""
    from torch.distributed.checkpoint.default_planner import (
        _validate_global_plan,
        create_default_global_save_plan,
        dedup_save_plans,
    )
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

    def rows(fqn: str, start: int, stop: int, of: int, kind: WriteItemType = WriteItemType.SHARD) -> WriteItem:
        chunk = ChunkStorageMetadata(offsets=torch.Size([start, 0]), sizes=torch.Size([stop - start, 2]))
        data = TensorWriteData(chunk=chunk, properties=TensorProperties(dtype=torch.float32), size=torch.Size([of, 2]))
        return WriteItem(index=MetadataIndex(fqn, chunk.offsets), type=kind, tensor_data=data)

    step = WriteItem(index=MetadataIndex("step"), type=WriteItemType.BYTE_IO)
    plans = [SavePlan([rows("w", 0, 3, 5), rows("b", 0, 4, 4, WriteItemType.TENSOR), step]),
             SavePlan([rows("w", 3, 5, 5), rows("b", 0, 4, 4, WriteItemType.TENSOR), step])]  # fmt: skip
    alone = []
    for rank, plan in enumerate(plans):
        metadata = create_default_global_save_plan([plan])[1]
        metadata.storage_data = {item.index: {"rank": rank} for item in plan.items}
        alone.append(decode_metadata(json.loads(json.dumps(encode_metadata(metadata)))))
    together = create_default_global_save_plan(dedup_save_plans(plans))[1]
    merged = merge_metadata(alone)
    assert merged.state_dict_metadata == together.state_dict_metadata
    assert _validate_global_plan(plans, merged) == []
    places = {MetadataIndex("w", [0, 0]): 0, MetadataIndex("w", [3, 0]): 1, MetadataIndex("b", [0, 0]): 0,
              MetadataIndex("step"): 0}  # fmt: skip
    assert merged.storage_data == {index: {"rank": rank} for index, rank in places.items()}
    assert [len(m.state_dict_metadata["w"].chunks) for m in alone] == [1, 1]  # the parts are left as they were
    # Rank 1's load puts its own first: the replicated items are read from its own checkpoint, the shards where
    # they lie; the same global metadata otherwise.
    merged = merge_metadata(alone[::-1])
    assert merged.state_dict_metadata["w"].chunks == together.state_dict_metadata["w"].chunks[::-1]
    assert _validate_global_plan(plans, merged) == []
    places.update({MetadataIndex("b", [0, 0]): 1, MetadataIndex("step"): 1})
    assert merged.storage_data == {index: {"rank": rank} for index, rank in places.items()}


@pytest.mark.anyio
async def test_a_replica_push_cancelled_midway_lets_go_of_the_slot_s_mapping() -> None:
    """The agent ends (the job is over) while a peer's checkpoint arrives: the receive is cancelled, and the slot's
    mapping closes (it raised ``BufferError`` before, a slice of it held by the traceback, and ended the agent)."""
    slot = Slot(0)
    slot.ahead(1 << 20)
    ours, peer = socket.socketpair()
    try:
        ours.setblocking(False)
        peer.send(b"x" * 1000)  # a part of the 4096 bytes announced
        with anyio.move_on_after(0.2) as waited:
            await replicas._receive_checkpoint(ours, slot, 4096)
        assert waited.cancelled_caught
        assert os.pread(slot.fd, 1000, 0) == b"x" * 1000
    finally:
        ours.close()
        peer.close()
        slot.close()


class _OneSlot:
    """A replica holder (the server's side of :mod:`aelastic.agent.checkpoint.replicas`) holding one checkpoint."""

    secret = "s3cret"

    def __init__(self, slot: Slot) -> None:
        self.slot = slot

    def slot_to_send(self, rank: int, step: int) -> Slot | None:
        header = self.slot.header
        return self.slot if header is not None and (header.rank, header.step) == (rank, step) else None


@pytest.mark.anyio
async def test_a_metadata_fetch_brings_the_header_and_metadata_at_their_places_and_no_data() -> None:
    data_size = 8 << 20
    meta = json.dumps({"items": [{"offset": DATA_OFFSET, "nbytes": data_size}], "pad": "x" * 70000}).encode()
    header = Header("dcp", 12, 3, 4, data_size, DATA_OFFSET + data_size, len(meta))
    slot = Slot(0)
    slot.ahead(header.total)
    os.pwrite(slot.fd, b"\x07" * data_size, DATA_OFFSET)
    os.pwrite(slot.fd, meta, header.meta_offset)
    os.pwrite(slot.fd, header.encode(), 0)
    slot.header = slot.read_header()
    listener, endpoint = replicas.open_listener("127.0.0.1")
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(replicas.serve, listener, _OneSlot(slot))
            fd, got = await replicas.fetch_metadata(endpoint, "s3cret", 3, 12)
            try:
                assert got == header
                mapping = Mapping.open(fd, os.fstat(fd).st_size, shared=True)
                assert mapping.layout("test") == (header, json.loads(meta))
                assert bytes(mapping.mmap[DATA_OFFSET : DATA_OFFSET + 4096]) == bytes(4096)  # a hole: no data
                mapping.release()
                assert os.fstat(fd).st_blocks * 512 < data_size // 8  # the hole takes no memory
            finally:
                os.close(fd)
            with pytest.raises(replicas.ReplicaError, match="holds no checkpoint of rank 3's step 11"):
                await replicas.fetch_metadata(endpoint, "s3cret", 3, 11)
            tg.cancel_scope.cancel()
    finally:
        slot.close()


# One process on purpose (no_dist=True): DCP warns at each call all the same.
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_a_planner_plans_a_layout_once_and_again_when_it_changes(tmp_path: Path) -> None:
    """``SavePlanner`` through DCP's own writer and reader (one process): a save of the same layout reuses the last
    plans and each save's values come back; a new key, shape or dtype is planned again; a plain value's bytes
    are written again only once it changed."""
    import torch.distributed.checkpoint as dcp

    from aelastic.worker._checkpoint.planner import SavePlanner, _layout

    planner = SavePlanner()
    model = torch.nn.Linear(4, 3)

    def save(name: str, state: dict[str, Any]) -> dict[str, Any]:
        dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp_path / name), planner=planner, no_dist=True)
        kept = planner._local, planner._global
        loaded = {key: torch.zeros_like(v) if isinstance(v, torch.Tensor) else v for key, v in state.items()}
        dcp.load(loaded, storage_reader=dcp.FileSystemReader(tmp_path / name), no_dist=True)
        assert {k: v.tolist() if isinstance(v, torch.Tensor) else v for k, v in loaded.items()} == {
            k: v.tolist() if isinstance(v, torch.Tensor) else v for k, v in state.items()
        }
        return {"local": kept[0], "global": kept[1]}

    first = save("0", {**model.state_dict(), "lr": 0.1, "betas": (0.9, 0.99)})
    with torch.no_grad():
        model.weight.add_(1.0)
    again = save("1", {**model.state_dict(), "lr": 0.1, "betas": (0.9, 0.99)})
    assert again["local"] is first["local"]
    bytes_of_lr = planner._bytes["lr"][1]
    changed = save("2", {**model.state_dict(), "lr": 0.05, "betas": (0.9, 0.99)})  # the same layout, a new value
    assert changed["local"] is first["local"]
    assert planner._bytes["lr"][1] != bytes_of_lr
    assert planner._bytes["betas"][0] == (tuple, ((float, 0.9), (float, 0.99)))
    grown = save("3", {**model.state_dict(), "lr": 0.05, "extra": torch.ones(2)})  # a new key
    assert grown["local"] is not first["local"]
    reshaped = save("4", {**model.state_dict(), "lr": 0.05, "extra": torch.ones(3)})  # a new shape
    assert reshaped["local"] is not grown["local"]
    retyped = save("5", {**model.state_dict(), "lr": 0.05, "extra": torch.ones(3, dtype=torch.float64)})  # a dtype
    assert retyped["local"] is not reshaped["local"]

    class Tagged(torch.Tensor):
        pass

    assert _layout({"opaque": torch.ones(2).as_subclass(Tagged)}) is None  # a subclass: planned every time
    # The global plan: kept when planned from this rank's plan alone (a save without collectives, through a writer
    # that hands DCP's plan back, as aelastic's does); the coordinator's, from plans gathered, made every time.
    planner = SavePlanner()
    plans = []
    for value in (1.0, 2.0):
        planner.set_up_planner({"w": torch.full((2, 2), value), "lr": 0.1}, None, True)
        local = planner.create_local_plan()
        plans.append((local, planner.create_global_plan([local])))
    assert plans[1][0] is plans[0][0]
    assert plans[1][1] is plans[0][1]
    gathered = [dataclasses.replace(plans[1][0]), dataclasses.replace(plans[1][0])]
    assert planner.create_global_plan(gathered) is not plans[0][1]
