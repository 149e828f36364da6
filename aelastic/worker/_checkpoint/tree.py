"""A training state as JSON metadata and raw tensor bytes, and back: what ``aelastic.checkpoint.save`` writes and
``load`` reads (the worker side; it imports torch, which only workers have).

A state is what ``model.state_dict()``, ``optimizer.state_dict()``, RNG states and a loop's counters are made of:
dicts (and OrderedDicts) with keys of plain values, lists, tuples, tensors, numpy arrays and scalars, ``None``,
booleans, numbers, strings, bytes, and torch's dtypes, devices and sizes. :func:`flatten` turns one into a
JSON-able tree, in which every tensor is a reference into a list of tensors, and that list; :func:`unflatten`
builds the state again from the tree and the bytes. Nothing is pickled: a value of any other type is refused, by
its key path, before a byte is written. Tags keep what JSON cannot (dict keys that are not strings, tuples apart
from lists):

    {"D": [[key, value], ...]}  dict          {"O": [...]}  OrderedDict     {"L": [...]}  list
    {"U": [...]}  tuple                       {"T": i}      tensor i        {"N": i}      numpy array i
    {"B": base64}  bytes                      {"dtype": "float32"}  {"device": "cuda:0"}  {"size": [2, 3]}

The same tensor reached twice (tied weights: ``state_dict()`` gives two views of one parameter) is stored once and
comes back as one tensor under both keys.
"""

from __future__ import annotations

import base64
import collections
from collections.abc import Callable, Mapping
from typing import Any

import torch

__all__ = ["Blob", "StateError", "dtype_from_name", "dtype_name", "flatten", "unflatten"]

_PLAIN = (type(None), bool, int, float, str)


class StateError(ValueError):
    """A state that cannot be checkpointed (or restored as asked); the message names the key path and the rule."""


class Blob:
    """One tensor (or numpy array, as a tensor over its bytes) of a flattened state, and how to rebuild it."""

    __slots__ = ("info", "tensor")

    def __init__(self, tensor: torch.Tensor, info: dict[str, Any]) -> None:
        self.tensor = tensor
        self.info = info  # dtype, shape, device (tensors) or numpy dtype, shape (arrays); offset, once placed

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise StateError(f"dtype {name!r}: not a dtype of this torch ({torch.__version__})")
    return dtype


def _path(path: str) -> str:
    return f"state{path}"


def flatten(state: Any) -> tuple[Any, list[Blob]]:
    """``state`` as (tree, blobs); see the module doc.

    Raises:
        StateError: a value of a type a checkpoint may not hold, or a tensor it cannot copy (sparse, quantized,
            meta, nested, a tensor subclass that holds no plain data), named by its key path.
    """
    flattener = _Flattener()
    return flattener.walk(state, ""), flattener.blobs


class _Flattener:
    """One :func:`flatten`: the blobs found so far, and the tensors already seen (a tensor shared by two keys, or a
    parameter and its optimizer's reference to it, is one blob)."""

    def __init__(self) -> None:
        self.blobs: list[Blob] = []
        self.seen: dict[tuple[Any, ...], int] = {}

    def tensor_ref(self, tensor: torch.Tensor, path: str) -> dict[str, int]:
        if type(tensor) not in (torch.Tensor, torch.nn.Parameter):
            raise StateError(
                f"{_path(path)}: a {type(tensor).__name__} (a tensor subclass: DTensor, ShardedTensor, ...) cannot be "
                "saved by aelastic.checkpoint.save; save it through torch.distributed.checkpoint with "
                "aelastic.checkpoint.StorageWriter"
            )
        if tensor.layout is not torch.strided or tensor.is_quantized or tensor.is_meta or tensor.is_nested:
            raise StateError(
                f"{_path(path)}: a {tensor.layout} {'quantized ' if tensor.is_quantized else ''}"
                f"{'meta ' if tensor.is_meta else ''}tensor holds no plain data to copy; a checkpoint holds dense "
                "tensors (use .to_dense() or .dequantize())"
            )
        key = (tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tensor.stride(), str(tensor.device))
        index = self.seen.get(key) if tensor.numel() else None
        if index is None:
            index = len(self.blobs)
            info: dict[str, Any] = {
                "dtype": dtype_name(tensor.dtype),
                "shape": list(tensor.shape),
                "device": str(tensor.device),
            }
            if tensor.requires_grad:
                info["grad"] = True
            self.blobs.append(Blob(tensor.detach(), info))
            if tensor.numel():
                self.seen[key] = index
        return {"T": index}

    def array_ref(self, array: Any, path: str, *, scalar: bool = False) -> dict[str, int]:
        import numpy

        if array.dtype.hasobject:
            raise StateError(f"{_path(path)}: a numpy array of Python objects cannot be saved without pickling")
        contiguous = array if array.flags.c_contiguous else numpy.ascontiguousarray(array)  # (it makes 0-d 1-d)
        data = torch.from_numpy(contiguous.reshape(-1).view(numpy.uint8))
        info: dict[str, Any] = {"numpy": contiguous.dtype.str, "shape": list(contiguous.shape)}
        if scalar:
            info["scalar"] = True
        self.blobs.append(Blob(data, info))
        return {"N": len(self.blobs) - 1}

    def walk(self, value: Any, path: str) -> Any:
        kind = type(value)
        if kind in _PLAIN:
            return value
        if isinstance(value, torch.Tensor):
            return self.tensor_ref(value, path)
        if kind is dict or kind is collections.OrderedDict:
            items = [[self.walk_key(k, path), self.walk(v, f"{path}[{k!r}]")] for k, v in value.items()]
            return {"O" if kind is collections.OrderedDict else "D": items}
        if kind is list:
            return {"L": [self.walk(v, f"{path}[{i}]") for i, v in enumerate(value)]}
        if kind is tuple:
            return {"U": [self.walk(v, f"{path}[{i}]") for i, v in enumerate(value)]}
        if kind is bytes:
            return {"B": base64.b64encode(value).decode()}
        if kind is torch.dtype:
            return {"dtype": dtype_name(value)}
        if kind is torch.device:
            return {"device": str(value)}
        if kind is torch.Size:
            return {"size": list(value)}
        if kind.__module__ == "numpy" and kind.__name__ == "ndarray":
            return self.array_ref(value, path)
        if kind.__module__ == "numpy" and hasattr(value, "dtype"):  # a numpy scalar: a 0-d array's element
            import numpy

            return self.array_ref(numpy.asarray(value), path, scalar=True)
        raise StateError(
            f"{_path(path)}: a {kind.__module__}.{kind.__qualname__} is not a value a checkpoint holds (tensors, "
            "numpy arrays, None, bools, numbers, strings, bytes, dtypes, devices, and dicts, lists and tuples of "
            "them; nothing is pickled)"
        )

    def walk_key(self, key: Any, path: str) -> Any:
        if type(key) in _PLAIN or type(key) is tuple:
            return self.walk(key, f"{path} (a key)")
        raise StateError(f"{_path(path)}: the key {key!r} is a {type(key).__name__}: keys are None, bools, "
                         "numbers, strings or tuples of them")  # fmt: skip


def unflatten(
    tree: Any,
    infos: list[dict[str, Any]],
    view: Callable[[int], torch.Tensor],
    *,
    into: Any = None,
    map_location: str | torch.device | None = None,
) -> Any:
    """The state that :func:`flatten` took apart, with fresh tensors copied from ``view(i)`` (blob ``i``'s bytes,
    as a flat uint8 tensor), or copied into the tensors of ``into`` where it has one at the same key path.

    Raises:
        StateError: a tensor of ``into`` whose shape or dtype differs from the checkpoint's (by key path); a saved
            device that is not there (CUDA on a machine without it) and no ``map_location``.
    """
    return _Unflattener(infos, view, map_location).walk(tree, into, "")


class _Unflattener:
    """One :func:`unflatten`: the blobs built so far (a blob two keys share is built once)."""

    def __init__(
        self, infos: list[dict[str, Any]], view: Callable[[int], torch.Tensor], map_location: str | torch.device | None
    ) -> None:
        self.infos = infos
        self.view = view
        self.map_location = map_location
        self.built: dict[int, Any] = {}

    def blob(self, index: int, target: Any, path: str) -> Any:
        if index in self.built:
            return self.built[index]
        info, data = self.infos[index], self.view(index)
        if "numpy" in info:
            import numpy

            array = numpy.empty(info["shape"], dtype=numpy.dtype(info["numpy"]))
            torch.from_numpy(array.reshape(-1).view(numpy.uint8)).copy_(data)
            self.built[index] = array[()] if info.get("scalar") else array
            return self.built[index]
        dtype, shape = dtype_from_name(info["dtype"]), info["shape"]
        source = data.view(dtype).view(shape) if data.numel() else torch.empty(shape, dtype=dtype)
        if isinstance(target, torch.Tensor):
            if list(target.shape) != shape or target.dtype != dtype:
                raise StateError(
                    f"{_path(path)}: the checkpoint holds a {info['dtype']} tensor of shape {shape}, the state to "
                    f"load into a {dtype_name(target.dtype)} one of shape {list(target.shape)}"
                )
            with torch.no_grad():
                target.copy_(source)
            self.built[index] = target
            return target
        device = torch.device(self.map_location if self.map_location is not None else info["device"])
        if device.type == "cuda" and not torch.cuda.is_available():
            raise StateError(
                f"{_path(path)}: saved from {info['device']}, and this process has no CUDA device: load with "
                "map_location='cpu'"
            )
        tensor = torch.empty(shape, dtype=dtype, device=device)
        tensor.copy_(source)
        if info.get("grad"):
            tensor.requires_grad_(True)
        self.built[index] = tensor
        return tensor

    def walk(self, node: Any, target: Any, path: str) -> Any:
        if not isinstance(node, dict):
            return node
        ((tag, value),) = node.items()
        if tag == "T" or tag == "N":
            return self.blob(value, target, path)
        if tag in ("D", "O"):
            keys = [self.walk(k, None, path) for k, _ in value]
            mapping = target if isinstance(target, Mapping) else {}
            pairs = ((k, self.walk(v, mapping.get(k), f"{path}[{k!r}]")) for k, (_, v) in zip(keys, value, strict=True))
            return dict(pairs) if tag == "D" else collections.OrderedDict(pairs)
        if tag in ("L", "U"):
            targets = target if isinstance(target, (list, tuple)) and len(target) == len(value) else [None] * len(value)
            items = [self.walk(v, t, f"{path}[{i}]") for i, (v, t) in enumerate(zip(value, targets, strict=True))]
            return items if tag == "L" else tuple(items)
        if tag == "B":
            return base64.b64decode(value)
        if tag == "dtype":
            return dtype_from_name(value)
        if tag == "device":
            return torch.device(value)
        if tag == "size":
            return torch.Size(value)
        raise StateError(f"{_path(path)}: unknown tag {tag!r} in the checkpoint's metadata")
