"""A small expression builder: symbolic tensors whose arithmetic emits ONNX nodes.

Rules are written against :class:`Var` so that they read like the formula::

    return dy * (1.0 - y * y)        # Tanh

Every node is appended to the :class:`Builder` that created the operands; the
builder owns all state (no globals), knows the opset it emits for, and names
its nodes after the forward node they belong to.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Any, Iterable, Sequence

import numpy as np
import onnx
import onnx.defs
from onnx import TensorProto, helper, numpy_helper

FLOAT_TYPES = frozenset(
    {TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.FLOAT16, TensorProto.BFLOAT16}
)

# Element type of outputs of ops whose output type does not follow their first input.
_SHARED_CONSTANT_SIZE = 64     # elements; larger constants are not worth comparing
_INT64_OPS = frozenset({"Shape", "Size", "NonZero", "ArgMax", "ArgMin"})
_BOOL_OPS = frozenset(
    {"Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual", "Not", "And", "Or", "Xor", "IsNaN", "IsInf"}
)


@lru_cache(maxsize=None)
def _same_type_inputs(op_type: str, opset: int, n_inputs: int) -> tuple[int, ...]:
    """Input positions whose type the first output shares, from the schema's type constraints
    (Squeeze's output follows its data, never its int64 axes)."""
    try:
        schema = onnx.defs.get_schema(op_type, opset, "")
    except onnx.defs.SchemaError:
        return tuple(range(n_inputs))
    if not schema.outputs:
        return ()
    out_type = schema.outputs[0].type_str
    params = schema.inputs
    return tuple(i for i in range(n_inputs) if params and params[min(i, len(params) - 1)].type_str == out_type)


class TensorInfo:
    """What is statically known about a tensor: element type and shape (dims may be None)."""

    __slots__ = ("dtype", "shape")

    def __init__(self, dtype: int | None = None, shape: tuple[int | None, ...] | None = None):
        self.dtype = dtype
        self.shape = shape

    @property
    def static(self) -> bool:
        return self.shape is not None and all(d is not None for d in self.shape)


class Var:
    """A tensor in the graph being built. Arithmetic on it emits ONNX nodes."""

    __slots__ = ("name", "builder")

    def __init__(self, builder: "Builder", name: str):
        self.name = name
        self.builder = builder

    # -- what is known statically -------------------------------------------------
    @property
    def info(self) -> TensorInfo:
        return self.builder.info(self)

    @property
    def dtype(self) -> int | None:
        return self.info.dtype

    @property
    def shape(self) -> tuple[int | None, ...] | None:
        return self.info.shape

    @property
    def rank(self) -> int | None:
        s = self.shape
        return None if s is None else len(s)

    # -- arithmetic ---------------------------------------------------------------
    def _bin(self, op: str, other: Any, reverse: bool = False) -> "Var":
        b = self.builder
        other = b.lift(other, like=self)
        return b.emit(op, [other, self] if reverse else [self, other])

    def __add__(self, o): return self._bin("Add", o)
    def __radd__(self, o): return self._bin("Add", o, True)
    def __sub__(self, o): return self._bin("Sub", o)
    def __rsub__(self, o): return self._bin("Sub", o, True)
    def __mul__(self, o): return self._bin("Mul", o)
    def __rmul__(self, o): return self._bin("Mul", o, True)
    def __truediv__(self, o): return self._bin("Div", o)
    def __rtruediv__(self, o): return self._bin("Div", o, True)
    def __pow__(self, o): return self._bin("Pow", o)
    def __neg__(self): return self.builder.emit("Neg", [self])
    def __matmul__(self, o): return self._bin("MatMul", o)

    def __repr__(self) -> str:
        return f"Var({self.name!r})"


class _Ops:
    """``b.op.Conv(x, w, strides=[1, 1])``: any ai.onnx op by name.

    ``outputs=k`` asks for k outputs and returns a tuple; ``None`` inputs are
    left empty (optional inputs).
    """

    __slots__ = ("_b",)

    def __init__(self, builder: "Builder"):
        self._b = builder

    def __getattr__(self, op_type: str):
        def make(*inputs, outputs: int = 1, **attrs):
            return self._b.emit(op_type, list(inputs), outputs=outputs, **attrs)

        make.__name__ = op_type
        return make


class Builder:
    """Appends nodes to ``self.nodes``; the graph's names and types are shared through ``names``/``infos``.

    ``prefix`` names every node (e.g. ``"MatMul_3/grad"``), ``doc`` goes into every
    node's doc_string, ``opset`` is the ai.onnx version the nodes must be valid at.
    """

    def __init__(
        self,
        opset: int,
        names: "NameScope",
        infos: dict[str, TensorInfo],
        prefix: str = "onnxgrad",
        doc: str = "",
        constants: dict[str, np.ndarray] | None = None,
        op_type: str = "",
    ):
        self.opset = opset
        self.op_type = op_type
        self.constants = constants if constants is not None else {}
        self.names = names
        self.infos = infos
        self.prefix = prefix
        self.doc = doc
        self.nodes: list[onnx.NodeProto] = []
        self.shared_constants: dict[tuple, str] = {}
        self.op = _Ops(self)

    def scoped(self, prefix: str, doc: str, op_type: str = "") -> "Builder":
        """A builder writing into the same node list under another name prefix (for a node of ``op_type``)."""
        b = object.__new__(Builder)          # the pass makes one per node: skip __init__'s defaults
        b.__dict__.update(self.__dict__)
        b.prefix, b.doc, b.op_type = prefix, doc, op_type
        b.op = _Ops(b)
        return b

    # -- names and types ----------------------------------------------------------
    def var(self, name: str) -> Var:
        return Var(self, name)

    def info(self, v: Var) -> TensorInfo:
        return self.infos.get(v.name) or TensorInfo()

    # -- emitting -----------------------------------------------------------------
    def emit(self, op_type: str, inputs: Sequence[Any], outputs: int = 1, **attrs) -> Any:
        names = ["" if x is None else x.name if type(x) is Var else self.lift(x).name for x in inputs]
        node_name = self.names.fresh(f"{self.prefix}/{op_type}")
        outs = [self.names.fresh(f"{node_name}_out{i}" if outputs > 1 else f"{node_name}_out")
                for i in range(outputs)]
        attrs = {k: v for k, v in attrs.items() if v is not None}
        node = onnx.NodeProto(op_type=op_type, input=names, output=outs, name=node_name, doc_string=self.doc)
        if attrs:
            node.attribute.extend(helper.make_attribute(k, v) for k, v in sorted(attrs.items()))
        self.nodes.append(node)
        dtype = self._out_dtype(op_type, inputs, attrs)
        for o in outs:
            self.infos[o] = TensorInfo(dtype, None)
        vs = tuple(Var(self, o) for o in outs)
        return vs[0] if outputs == 1 else vs

    def _out_dtype(self, op_type: str, inputs: Sequence[Any], attrs: dict) -> int | None:
        if op_type in _INT64_OPS:
            return TensorProto.INT64
        if op_type in _BOOL_OPS:
            return TensorProto.BOOL
        if op_type == "Cast":
            return attrs["to"]
        if op_type == "CastLike":
            return self.lift(inputs[1]).dtype
        if op_type in ("Constant", "ConstantOfShape"):
            t = attrs.get("value")
            return t.data_type if t is not None else TensorProto.FLOAT
        for i in _same_type_inputs(op_type, self.opset, len(inputs)):
            x = inputs[i]
            if isinstance(x, Var) and x.dtype is not None:
                return x.dtype
        return None

    # -- constants ----------------------------------------------------------------
    def const(self, value: Any, dtype: int | None = None) -> Var:
        """A Constant node holding ``value`` (numpy-convertible) as ``dtype``.

        Small constants are made once per graph and shared (a backward graph would otherwise
        carry thousands of copies of 1.0 and of the same axes); the node is named after the
        first forward node that needed it.
        """
        arr = np.asarray(value)
        if dtype is not None:
            arr = arr.astype(helper.tensor_dtype_to_np_dtype(dtype))
        elif arr.dtype == np.float64:
            arr = arr.astype(np.float32)
        key = (arr.dtype.str, arr.shape, arr.tobytes()) if arr.size <= _SHARED_CONSTANT_SIZE else None
        if key is not None and key in self.shared_constants:
            return Var(self, self.shared_constants[key])
        tensor = numpy_helper.from_array(arr)
        v = self.emit("Constant", [], value=tensor)
        self.infos[v.name] = TensorInfo(tensor.data_type, tuple(arr.shape))   # rules may read them back
        self.constants[v.name] = arr
        if key is not None:
            self.shared_constants[key] = v.name
        return v

    def ints(self, values: Iterable[int]) -> Var:
        """A 1-D int64 constant (axes, shapes, pads given as inputs)."""
        return self.const(np.array(list(values), dtype=np.int64))

    def scalar(self, value: float, like: Var) -> Var:
        """A scalar of ``like``'s float type."""
        return self.const_like(np.array(value), like)

    def const_like(self, value: Any, like: Var) -> Var:
        """A constant in ``like``'s element type (CastLike at run time when that type is unknown)."""
        if like.dtype is not None:
            return self.const(value, like.dtype)
        return self.cast_like(self.const(np.asarray(value, np.float32)), like)

    def cast_like(self, v: Var, like: Var) -> Var:
        """``v`` in ``like``'s element type: v itself when the types agree, Cast when known, else CastLike."""
        if v.dtype is not None and v.dtype == like.dtype:
            return v
        if like.dtype is not None:
            return self.emit("Cast", [v], to=like.dtype)
        if self.opset < 15:
            self._decline(f"the element type of '{like.name}' is unknown and CastLike needs opset 15; "
                          "declare the model's types")
        return self.emit("CastLike", [v, like])

    def _decline(self, reason: str):
        """The forward node this builder serves cannot be differentiated here: an UnsupportedOpError."""
        from .errors import UnsupportedOpError

        op, node = self.op_type or "onnxgrad", self.prefix.split("/")[0]
        raise UnsupportedOpError({op: node}, {op: reason})

    def lift(self, x: Any, like: Var | None = None) -> Var:
        """Turn Python numbers into constants (of ``like``'s type); pass Vars through."""
        if isinstance(x, Var):
            return x
        if isinstance(x, (int, float)) and like is not None:
            return self.scalar(float(x), like)
        return self.const(x)

    # -- opset-aware helpers ------------------------------------------------------
    def reduce(self, op_type: str, x: Var, axes: Sequence[int] | Var | None, keepdims: bool = True) -> Var:
        """Reduce* over ``axes`` (all axes when None), as an input from opset 18 (ReduceSum: 13)."""
        axes_as_input = self.opset >= (13 if op_type == "ReduceSum" else 18)
        if axes is None:
            return self.emit(op_type, [x], keepdims=int(keepdims))
        if isinstance(axes, Var):
            if not axes_as_input:
                self._decline(f"{op_type} over axes known only at run time needs opset 18")
            return self.emit(op_type, [x, axes], keepdims=int(keepdims))
        axes = list(axes)
        if axes_as_input:
            return self.emit(op_type, [x, self.ints(axes)], keepdims=int(keepdims))
        return self.emit(op_type, [x], axes=axes, keepdims=int(keepdims))

    def sum(self, x: Var, axes: Sequence[int] | Var | None = None, keepdims: bool = True) -> Var:
        return self.reduce("ReduceSum", x, axes, keepdims)

    def squeeze(self, x: Var, axes: Sequence[int]) -> Var:
        return self.emit("Squeeze", [x, self.ints(axes)])

    def unsqueeze(self, x: Var, axes: Sequence[int]) -> Var:
        return self.emit("Unsqueeze", [x, self.ints(axes)])

    def shape_of(self, x: Var, start: int | None = None, end: int | None = None) -> Var:
        """Shape(x)[start:end], with Shape's own start/end from opset 15."""
        if start is None and end is None:
            return self.emit("Shape", [x])
        if self.opset >= 15:
            return self.emit("Shape", [x], start=start, end=end)
        s = self.emit("Shape", [x])
        ends = [end if end is not None else np.iinfo(np.int64).max]
        return self.emit("Slice", [s, self.ints([start or 0]), self.ints(ends)])

    def zeros_like(self, x: Var) -> Var:
        """Zeros of x's shape and type (used only where a formula needs an explicit zero)."""
        return self.fill_like(x, 0.0)

    def fill_like(self, x: Var, value: float) -> Var:
        """A tensor of x's shape and type filled with ``value`` (ConstantOfShape, no big constants)."""
        shape = self.ints(x.shape) if x.info.static else self.shape_of(x)
        np_type = helper.tensor_dtype_to_np_dtype(x.dtype) if x.dtype is not None else np.float32
        filled = self.emit("ConstantOfShape", [shape], value=numpy_helper.from_array(np.full(1, value, np_type)))
        return self.cast_like(filled, x)

    def name_as(self, value: Var, name: str) -> Var:
        """Make ``value`` available as the tensor ``name``: rename it on the node of this builder that made
        it (and on its readers here), so no copy is made; an Identity when no node here made it."""
        if value.name in self.shared_constants.values() or not any(value.name in n.output for n in self.nodes):
            self.nodes.append(helper.make_node("Identity", [value.name], [name],
                                               name=self.names.fresh(f"{name}/Identity"), doc_string=self.doc))
        else:
            rename_tensors(self.nodes, {value.name: name})
        self.infos[name] = self.infos.get(value.name, TensorInfo())
        value.name = name
        return value

    def reshape_like(self, x: Var, like: Var) -> Var:
        """Reshape x to like's shape: a constant shape when static (zeros when like is empty), else
        Shape(like) with allowzero (opset 14+) so that a 0 in it means 0, not 'copy this dim'."""
        if like.info.static:
            if x.info.static and tuple(x.shape) == tuple(like.shape):
                return x
            if 0 in like.shape:
                return self.zeros_like(like)
            return self.emit("Reshape", [x, self.ints(like.shape)])
        return self.emit("Reshape", [x, self.shape_of(like)], allowzero=1 if self.opset >= 14 else None)

    def unbroadcast(self, grad: Var, target: Var, source: "Var | Sequence[int | None] | None" = None) -> Var:
        """Sum ``grad`` (shaped like ``source``: the broadcast result, or its shape) back to ``target``'s shape.

        Static shapes: ReduceSum over the broadcast axes, computed here, and a
        Reshape; nothing at all when the shapes already match. Unknown dims:
        the same axes computed in the graph (Shape, Equal, NonZero) and
        ReduceSum with noop_with_empty_axes.
        """
        ts = target.shape
        gs = source.shape if isinstance(source, Var) else source
        gs = grad.shape if gs is None else tuple(gs)
        if ts is not None and gs is not None and len(gs) >= len(ts):
            lead = len(gs) - len(ts)
            axes = list(range(lead))
            decidable = True
            for i, (d, g) in enumerate(zip(ts, gs[lead:])):
                if d == 1 and g != 1:
                    axes.append(lead + i)   # summing a size-1 axis is right even if g is 1 at run time
                elif d is None and g != 1:
                    decidable = False       # d may be 1 (broadcast) or g: only the run time knows
            if decidable:
                if not axes:
                    return grad
                if lead == 0:
                    return self.sum(grad, axes, keepdims=True)
                if len(axes) == lead:
                    return self.sum(grad, axes, keepdims=False)
                summed = self.sum(grad, axes, keepdims=True)
                return self.reshape_like(summed, target)
        return self._unbroadcast_dynamic(grad, target)

    def _unbroadcast_dynamic(self, grad: Var, target: Var) -> Var:
        gshape = self.shape_of(grad)
        tshape = self.shape_of(target)
        missing = self.emit("Sub", [self.emit("Shape", [gshape]), self.emit("Shape", [tshape])])
        ones = self.emit("ConstantOfShape", [missing], value=numpy_helper.from_array(np.ones(1, np.int64)))
        padded = self.emit("Concat", [ones, tshape], axis=0)
        one = self.ints([1])
        axes = self.emit("Reshape", [self.emit("NonZero", [self.emit("Equal", [padded, one])]), self.ints([-1])])
        summed = self.emit("ReduceSum", [grad, axes], keepdims=1, noop_with_empty_axes=1)
        return self.emit("Reshape", [summed, tshape])


def rename_tensors(nodes: list[onnx.NodeProto], renames: dict[str, str]) -> None:
    """Rename tensors where they are made and where they are read (one sweep)."""
    if not renames:
        return
    for node in nodes:
        for k, x in enumerate(node.input):
            if x in renames:
                node.input[k] = renames[x]
        for k, y in enumerate(node.output):
            if y in renames:
                node.output[k] = renames[y]


class NameScope:
    """Hands out names unique in the model: ``fresh('x_grad')`` gives ``x_grad`` or ``x_grad_1``, ..."""

    def __init__(self, taken: Iterable[str] = ()):
        self.taken = set(taken)
        self._next: dict[str, int] = {}

    def fresh(self, base: str) -> str:
        if base not in self.taken:
            self.taken.add(base)
            return base
        i = self._next.get(base, 1)
        while f"{base}_{i}" in self.taken:
            i += 1
        self._next[base] = i + 1
        name = f"{base}_{i}"
        self.taken.add(name)
        return name
