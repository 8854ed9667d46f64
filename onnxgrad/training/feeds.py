"""A batch checked against the model's data inputs before a run: rank, sizes, the batch size shared by the inputs,
and the element type, so that a batch that does not fit gets one :class:`~onnxgrad.errors.FeedError` naming
each input, what the model declares and what was given, instead of onnxruntime's
``Shape mismatch attempting to re-use buffer. {3,10} != {4,10}`` from a node deep in the graph.

The type policy, as PyTorch's: a batch of another element type is converted only where no value can change
(``np.can_cast(given, declared, "safe")``: int32 labels to int64, uint8 or float16 images to float32), with one
:class:`~onnxgrad.errors.FeedConversionWarning` per input and session; anything else is refused. A float64 batch
for a float32 input is refused, not rounded (PyTorch: "mat1 and mat2 must have the same dtype"): cast it with
``.astype(np.float32)``. Values on a device (OrtValues, DLPack tensors) are never converted, nor copied to the
host to be checked: their shape and type are read from the tensor itself.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np
import onnx
from onnx import helper

from ..errors import FeedError

__all__ = ["Declared", "declared_inputs", "check", "lossless"]

@dataclass(frozen=True)
class Declared:
    """A data input as the model declares it: its element type and dims (None: not declared)."""

    dtype: np.dtype | None
    dims: tuple[int | str | None, ...] | None     # a size, a symbol shared between inputs ("N", "batch"), or None

    @classmethod
    def of(cls, vi: onnx.ValueInfoProto | None) -> "Declared":
        if vi is None or not vi.type.HasField("tensor_type"):
            return cls(None, None)
        tt = vi.type.tensor_type
        dims = None
        if tt.HasField("shape"):
            dims = tuple(d.dim_value if d.HasField("dim_value") else d.dim_param or None for d in tt.shape.dim)
        dtype = np.dtype(helper.tensor_dtype_to_np_dtype(tt.elem_type)) if tt.elem_type else None
        return cls(dtype, dims)


def declared_inputs(model: onnx.ModelProto, names: Sequence[str]) -> dict[str, Declared]:
    """``names`` (data inputs of ``model``) as its graph declares them, in that order."""
    by_name = {vi.name: vi for vi in model.graph.input}
    return {n: Declared.of(by_name.get(n)) for n in names}


def lossless(given: np.dtype, declared: np.dtype) -> bool:
    """Whether every value of ``given`` is exactly a value of ``declared`` (int32 -> int64: yes; float64 ->
    float32: no)."""
    return given.kind in "biuf" and np.can_cast(given, declared, casting="safe")


def check(feeds: Mapping[str, Any], declared: Mapping[str, Declared], what: str) -> dict[str, np.dtype]:
    """Check every feed against its declared input; raise one :class:`FeedError` naming every input that does
    not fit. Returns the host arrays to convert (losslessly) before the run: ``{name: declared type}``.

    ``feeds`` hold host arrays and OrtValues. A symbol (``N``, ``batch``) takes its size from the first input
    in ``declared``'s order that has it, and every later one must agree: the first input (the images, usually)
    sets the batch size. A row per rule:

    ==========  ==========================================================
    type        the declared one, or one losslessly converted (host only)
    rank        as many dimensions as declared
    size        each fixed dimension its declared size
    symbol      each symbolic dimension the size its symbol took first
    ==========  ==========================================================
    """
    sizes: dict[str, tuple[int, str]] = {}            # symbol -> (its size, the input it was taken from)
    problems: list[str] = []
    convert: dict[str, np.dtype] = {}
    for name, want in declared.items():
        if name not in feeds:
            continue
        shape, dtype, where = _facts(feeds[name])
        wrong = []
        if want.dtype is not None and dtype != want.dtype:
            if where is None and lossless(dtype, want.dtype):
                convert[name] = want.dtype
            else:
                wrong.append(_type_problem(dtype, want.dtype, where))
        if want.dims is not None:
            wrong += _shape_problems(name, shape, want.dims, sizes)
        if wrong:
            given = f"{_name_of(dtype)} {list(shape)}" + (f" on {where}" if where else "")
            problems.append(f"'{name}' is {given}, the model takes {_name_of(want.dtype)} {_shown(want.dims)}: "
                            + ", ".join(wrong))
    if problems:
        raise FeedError(f"{what}: the batch does not fit the model's inputs: " + "; ".join(problems))
    return convert


def _shape_problems(name: str, shape: tuple[int, ...], dims: tuple, sizes: dict[str, tuple[int, str]]) -> list[str]:
    if len(shape) != len(dims):
        return [f"it has {len(shape)} dimension(s), the input {len(dims)}: reshape it"]
    wrong = []
    for axis, (got, want) in enumerate(zip(shape, dims)):
        if isinstance(want, int) and got != want:
            wrong.append(f"dimension {axis} must be {want}")
        elif isinstance(want, str):
            size, source = sizes.setdefault(want, (got, name))
            if got != size:
                wrong.append(f"dimension {axis} is {want}, which is {size} in '{source}': give every input the "
                             f"same {want}" + (" (the batch size)" if axis == 0 else ""))
    return wrong


def _type_problem(given: np.dtype | str, declared: np.dtype, where: str | None) -> str:
    if where is not None:
        return (f"convert it to {_name_of(declared)} where it lies (torch: .to(torch.{_name_of(declared)})); "
                "OrtValues and DLPack tensors are taken as they are, never converted nor copied through the host")
    if isinstance(given, np.dtype) and given.kind == "f" and declared.kind == "f":
        return (f"cast it with .astype(np.{declared.name}) (a {given.name} batch is not rounded silently; "
                f"PyTorch refuses one for a {declared.name} module too)")
    return f"cast it with .astype(np.{declared.name}) if its values fit"


def _facts(value: Any) -> tuple[tuple[int, ...], np.dtype | str, str | None]:
    """(shape, element type, the device it lies on or None for a host array) of a host array or an OrtValue,
    read from the value itself (an OrtValue's data stays where it is)."""
    if isinstance(value, np.ndarray):
        return value.shape, value.dtype, None
    ort_type = value.data_type()
    dtype = _NP_OF_ORT.get(ort_type, ort_type)
    return tuple(value.shape()), np.dtype(dtype) if not isinstance(dtype, str) else dtype, \
        value.device_name().lower()


def _name_of(dtype: np.dtype | str) -> str:
    return dtype.name if isinstance(dtype, np.dtype) else dtype


def _shown(dims: tuple | None) -> str:
    """``[N, 8]``: sizes, symbols by name, ``?`` for a dimension of any size."""
    if dims is None:
        return "(any shape)"
    return "[" + ", ".join("?" if d is None else str(d) for d in dims) + "]"


_NP_OF_ORT = {
    "tensor(float)": np.float32, "tensor(double)": np.float64, "tensor(float16)": np.float16,
    "tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(int16)": np.int16, "tensor(int8)": np.int8,
    "tensor(uint8)": np.uint8, "tensor(uint16)": np.uint16, "tensor(uint32)": np.uint32,
    "tensor(uint64)": np.uint64, "tensor(bool)": np.bool_,
}
