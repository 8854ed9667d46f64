"""A small expression builder: symbolic tensors whose arithmetic emits ONNX nodes.

Rules are written against :class:`Var` so that they read like the formula::

    return dy * (1.0 - y * y)        # Tanh

Every node is appended to the :class:`Builder` that created the operands; the
builder owns all state (no globals), knows the opset it emits for, and names
its nodes after the forward node they belong to.

Every Var knows what is statically known of its shape (:class:`TensorInfo`), so rules share one
helper library here instead of private copies: sizes as :data:`Dim` (``b.rank``, ``b.dim``,
``b.dims``, ``b.vector``, ``b.prod``, ``b.arange``, ``b.zeros``, ``b.normalize_axis``),
:meth:`Builder.unbroadcast` reading the gradient's recorded shape, :meth:`Builder.decline` (the one
way a rule declines a configuration), :func:`total` and the constants :data:`INT64_MAX` / :data:`INT64_MIN`.
"""
from __future__ import annotations

from functools import lru_cache, partial
from typing import Any, Iterable, Sequence, Union

import numpy as np
import onnx
import onnx.defs
from onnx import TensorProto, helper, numpy_helper

from .model import NameScope, TensorInfo, rename_tensors

INT64_MAX = int(np.iinfo(np.int64).max)     # Slice's "to the end"
INT64_MIN = int(np.iinfo(np.int64).min)     # Slice's "to the start" (negative steps)

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


Dim = Union[int, Var]
"""A size: an ``int`` when known at build time, else a 1-element int64 tensor ``[size]`` read at run time."""


def total(*terms: Var | None) -> Var | None:
    """The sum of the terms that are there (None when none is): gradients that may be absent."""
    present = [t for t in terms if t is not None]
    if not present:
        return None
    out = present[0]
    for t in present[1:]:
        out = out + t
    return out


class _Ops:
    """``b.op.Conv(x, w, strides=[1, 1])``: any ai.onnx op by name.

    ``outputs=k`` asks for k outputs and returns a tuple; ``None`` inputs are
    left empty (optional inputs).
    """

    __slots__ = ("_b",)

    def __init__(self, builder: "Builder"):
        self._b = builder

    def __getattr__(self, op_type: str):
        return partial(self._b.emit_op, op_type)


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
        self.shared_constants: dict[tuple, str] = {}   # this scope's small constants, by value
        self.constant_names: set[str] = set()          # every Constant made here, all scopes
        self.made: set[str] = set()                    # every tensor a node made here made, all scopes
        self.attributes: dict[tuple, onnx.AttributeProto] = {}   # made once per (name, value), all scopes
        self.metadata: Sequence[onnx.StringStringEntryProto] = ()
        # set by a caller that adds them to its graph: small int64 constants (axes, shapes) as initializers
        # shared by the whole graph (a viewer draws them inside their readers; never float: no parameters)
        self.int_initializers: dict[tuple, onnx.TensorProto] | None = None
        self.int_vectors: dict[tuple[int, ...], str] = {}   # ints(values) made as initializers, by values
        self.op = _Ops(self)

    def scoped(self, prefix: str, doc: str, op_type: str = "",
               metadata: Sequence[onnx.StringStringEntryProto] = ()) -> "Builder":
        """A builder writing into the same node list under another name prefix (for a node of ``op_type``).

        The scope has its own small constants (a Constant read by the nodes of two scopes would be a
        hub in a graph viewer, named after one of them); ``metadata`` is stamped on every node it makes
        (the forward node's exporter metadata: its PyTorch module).
        """
        b = object.__new__(Builder)          # the pass makes one per node: skip __init__'s defaults
        b.__dict__.update(self.__dict__)
        b.prefix, b.doc, b.op_type, b.metadata = prefix, doc, op_type, metadata
        b.shared_constants = {}
        b.op = _Ops(b)
        return b

    def subgraph(self, what: str) -> "Builder":
        """A builder for a subgraph's nodes (an If's branch, a loop's body): this one's names and types,
        its own node list, named ``<prefix>/<what>/...``."""
        return Builder(self.opset, self.names, self.infos, f"{self.prefix}/{what}", self.doc, self.constants,
                       self.op_type)

    # -- names and types ----------------------------------------------------------
    def var(self, name: str) -> Var:
        return Var(self, name)

    def info(self, v: Var) -> TensorInfo:
        return self.infos.get(v.name) or TensorInfo()

    # -- emitting -----------------------------------------------------------------
    def emit(self, op_type: str, inputs: Sequence[Any], outputs: int = 1, **attrs) -> Any:
        names = [x.name if type(x) is Var else "" if x is None else self.lift(x).name for x in inputs]
        fresh = self.names.fresh
        node_name = fresh(f"{self.prefix}/{op_type}")
        if outputs == 1:
            outs = [fresh(f"{node_name}_out")]
        else:
            outs = [fresh(f"{node_name}_out{i}") for i in range(outputs)]
        node = onnx.NodeProto(op_type=op_type, input=names, output=outs, name=node_name, doc_string=self.doc)
        if attrs:
            attrs = {k: v for k, v in attrs.items() if v is not None}
            node.attribute.extend(self._attribute(k, v) for k, v in sorted(attrs.items()))
        if self.metadata:
            node.metadata_props.extend(self.metadata)
        self.nodes.append(node)
        dtype = self._out_dtype(op_type, names, attrs)
        if outputs == 1:
            out = outs[0]
            self.made.add(out)
            self.infos[out] = TensorInfo(dtype, self._out_shape(op_type, names, attrs) if op_type in _SHAPED else None)
            return Var(self, out)
        self.made.update(outs)
        for o in outs:
            self.infos[o] = TensorInfo(dtype, None)
        return tuple(Var(self, o) for o in outs)

    def emit_op(self, op_type: str, *inputs: Any, outputs: int = 1, **attrs) -> Any:
        """:meth:`emit` with the inputs as arguments (what ``b.op.<OpType>(...)`` calls)."""
        return self.emit(op_type, inputs, outputs, **attrs)

    def _out_shape(self, op_type: str, names: Sequence[str], attrs: dict) -> tuple[int, ...] | None:
        """The output's static shape when every input's is static and the op is one :func:`shape_of_op`
        knows (None otherwise: a dim we are not sure of is never recorded)."""
        shapes = []
        infos = self.infos
        for x in names:
            if x:                                   # else an optional input left out
                info = infos.get(x)
                s = None if info is None else info.shape
                if s is None or None in s:
                    return None
                shapes.append(s)
        if not shapes:
            return None
        if op_type in _SAME_SHAPE:
            return shapes[0]
        try:
            return shape_of_op(op_type, shapes, names, attrs, self.constants)
        except (ValueError, KeyError, IndexError, TypeError, ZeroDivisionError):
            return None

    def _attribute(self, name: str, value: Any) -> onnx.AttributeProto:
        """helper.make_attribute, made once per (name, value) for the hashable values (ints, floats,
        strings); an AttributeProto is used as it is (a Constant's ``value``, see :meth:`const`)."""
        if isinstance(value, onnx.AttributeProto):
            return value
        key = (name, type(value), value) if isinstance(value, (int, float, str)) else None
        if key is None:
            return helper.make_attribute(name, value)
        attr = self.attributes.get(key)
        if attr is None:
            attr = self.attributes[key] = helper.make_attribute(name, value)
        return attr

    def _out_dtype(self, op_type: str, names: Sequence[str], attrs: dict) -> int | None:
        if op_type in _INT64_OPS:
            return TensorProto.INT64
        if op_type in _BOOL_OPS:
            return TensorProto.BOOL
        if op_type == "Cast":
            return attrs["to"]
        if op_type in ("Constant", "ConstantOfShape"):
            t = attrs.get("value")
            t = t.t if isinstance(t, onnx.AttributeProto) else t
            return t.data_type if t is not None else TensorProto.FLOAT
        infos = self.infos
        for i in (1,) if op_type == "CastLike" else _same_type_inputs(op_type, self.opset, len(names)):
            info = infos.get(names[i])
            if info is not None and info.dtype is not None:
                return info.dtype
        return None

    # -- constants ----------------------------------------------------------------
    def const(self, value: Any, dtype: int | None = None) -> Var:
        """A Constant node holding ``value`` (numpy-convertible) as ``dtype``.

        Small constants are made once per scope (one forward node's gradient) and shared there;
        never across scopes, so that every Constant belongs to the one forward node named in it.
        """
        arr = np.asarray(value)
        if dtype is not None:
            arr = arr.astype(helper.tensor_dtype_to_np_dtype(dtype))
        elif arr.dtype == np.float64:
            arr = arr.astype(np.float32)
        key = (arr.dtype.str, arr.shape, arr.tobytes()) if arr.size <= _SHARED_CONSTANT_SIZE else None
        if key is not None and key in self.shared_constants:
            return Var(self, self.shared_constants[key])
        if key is not None and self.int_initializers is not None and arr.dtype == np.int64:
            init = self.int_initializers.get(key)
            if init is None:
                text = ",".join(map(str, arr.reshape(-1).tolist()))
                name = self.names.fresh(f"onnxgrad/int64[{text}]" if arr.ndim else f"onnxgrad/int64({text})")
                init = self.int_initializers[key] = numpy_helper.from_array(arr, name)
                self.infos[name] = TensorInfo(init.data_type, tuple(arr.shape))
                self.constants[name] = arr
            return Var(self, init.name)
        attr = self.attributes.get(("value", key)) if key is not None else None
        if attr is None:             # one AttributeProto per value; each scope still has its own node
            attr = helper.make_attribute("value", numpy_helper.from_array(arr))
            if key is not None:
                self.attributes[("value", key)] = attr
        return self._constant(arr, attr, key)

    def _constant(self, arr: np.ndarray, attr: onnx.AttributeProto, key: tuple | None) -> Var:
        """This scope's Constant node holding ``arr`` (``attr``: its value attribute), shared by ``key``."""
        v = self.emit("Constant", [], value=attr)
        self.infos[v.name] = TensorInfo(attr.t.data_type, tuple(arr.shape))   # rules may read them back
        self.constants[v.name] = arr
        self.constant_names.add(v.name)
        if key is not None:
            self.shared_constants[key] = v.name
        return v

    def ints(self, values: Iterable[int]) -> Var:
        """A 1-D int64 constant (axes, shapes, pads given as inputs)."""
        key = tuple(int(v) for v in values)
        name = self.int_vectors.get(key)              # asked of most nodes a rule emits: no numpy on a hit
        if name is not None:
            return Var(self, name)
        v = self.const(np.array(key, dtype=np.int64))
        if v.name not in self.constant_names:         # a graph-wide initializer, not one scope's Constant
            self.int_vectors[key] = v.name
        return v

    def scalar(self, value: float, like: Var) -> Var:
        """A scalar of ``like``'s float type (asked of most rules: its value attribute is made once per
        value and type, and a scope's Constant once per value)."""
        dtype = like.dtype
        if dtype is None:
            return self.const_like(np.array(value), like)
        key = ("scalar", float(value), dtype)
        name = self.shared_constants.get(key)
        if name is not None:
            return Var(self, name)
        made = self.attributes.get(key)
        if made is None:
            arr = np.array(value, helper.tensor_dtype_to_np_dtype(dtype))
            made = self.attributes[key] = (arr, helper.make_attribute("value", numpy_helper.from_array(arr)))
        return self._constant(*made, key)

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
            self.decline(f"the element type of '{like.name}' is unknown and CastLike needs opset 15; "
                          "declare the model's types")
        return self.emit("CastLike", [v, like])

    def decline(self, reason: str):
        """The forward node this builder serves cannot be differentiated in this configuration: raise
        an :class:`~onnxgrad.errors.UnsupportedOpError` saying why (the one decline path of rules)."""
        from ..errors import UnsupportedOpError

        node = self.prefix.rsplit("/", 1)[0] if "/" in self.prefix else self.prefix
        raise UnsupportedOpError.rule_declines(self.op_type or "onnxgrad", node, reason)

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
                self.decline(f"{op_type} over axes known only at run time needs opset 18")
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
        ends = [end if end is not None else INT64_MAX]
        return self.emit("Slice", [s, self.ints([start or 0]), self.ints(ends)])

    def zeros_like(self, x: Var) -> Var:
        """Zeros of x's shape and type (used only where a formula needs an explicit zero)."""
        return self.fill_like(x, 0.0)

    def fill_like(self, x: Var, value: float) -> Var:
        """A tensor of x's shape and type filled with ``value`` (ConstantOfShape, no big constants)."""
        return self.fill(self.ints(x.shape) if x.info.static else self.shape_of(x), value, x)

    def fill(self, shape: Var | Sequence[Dim], value: float, like: Var) -> Var:
        """A tensor of ``shape`` (a 1-D int64 tensor, or sizes) filled with ``value`` in ``like``'s type."""
        if not isinstance(shape, Var):
            shape = self.vector(shape)
        np_type = helper.tensor_dtype_to_np_dtype(like.dtype) if like.dtype is not None else np.float32
        filled = self.emit("ConstantOfShape", [shape], value=numpy_helper.from_array(np.full(1, value, np_type)))
        return self.cast_like(filled, like)

    def zeros(self, shape: Var | Sequence[Dim], like: Var) -> Var:
        """Zeros of ``shape`` (a 1-D int64 tensor, or sizes) in ``like``'s element type."""
        return self.fill(shape, 0.0, like)

    # -- the helper library: ranks, sizes, axes -------------------------------------
    # Sizes are :data:`Dim`: an int when known at build time, else a 1-element int64 tensor, so that a
    # rule reads the same whether shapes are static or not, and folds to constants where they are.
    def rank(self, x: Var) -> int:
        """x's rank; declines when it is unknown when the gradient is built."""
        r = x.rank
        if r is None:
            self.decline(f"the rank of '{x.name}' is unknown when the gradient is built (run shape inference)")
        return r

    def normalize_axis(self, axis: int, rank: int) -> int:
        """``axis`` in [0, rank) (ONNX counts negative axes from the end); declines when out of range."""
        if not -rank <= axis < rank:
            self.decline(f"axis {axis} is out of range for rank {rank}")
        return axis % rank

    def dim(self, x: Var, i: int) -> Dim:
        """x.shape[i]: the int when known, else Shape(x)[i] as a 1-element tensor (i < 0 counts from
        the end, also when the rank is unknown)."""
        s = x.shape
        if s is not None:
            if -len(s) <= i < len(s) and s[i] is not None:
                return s[i]
            if i < 0:
                i += len(s)
        return self.shape_of(x, i, i + 1 or None)

    def dims(self, x: Var) -> list[Dim]:
        """Every size of x (declines when its rank is unknown)."""
        return [self.dim(x, i) for i in range(self.rank(x))]

    @staticmethod
    def static_dim(x: Var | None, i: int) -> int | None:
        """x.shape[i] when it is known at build time, else None (also for an absent x)."""
        s = None if x is None else x.shape
        return None if s is None else s[i]

    def vector(self, parts: Sequence[Dim]) -> Var:
        """The 1-D int64 tensor of sizes ``parts``: one constant when all are static, else one Concat."""
        groups: list[Var] = []
        ints: list[int] = []
        for p in parts:
            if isinstance(p, Var):
                if ints:
                    groups.append(self.ints(ints))
                    ints = []
                groups.append(p)
            else:
                ints.append(int(p))
        if ints or not groups:
            groups.append(self.ints(ints))
        return groups[0] if len(groups) == 1 else self.emit("Concat", groups, axis=0)

    def prod(self, parts: Sequence[Dim]) -> Dim:
        """The product of sizes, folded where static (an int when all are)."""
        static = 1
        dynamic = []
        for p in parts:
            if isinstance(p, Var):
                dynamic.append(p)
            else:
                static *= int(p)
        if not dynamic:
            return static
        out = dynamic[0]
        for p in dynamic[1:]:
            out = self.emit("Mul", [out, p])
        return out if static == 1 else self.emit("Mul", [out, self.ints([static])])

    def int_scalar(self, d: Dim) -> Var:
        """A size as a 0-D int64 tensor (Range's operands, a bound that must not broadcast to [1])."""
        if isinstance(d, Var):
            return self.squeeze(d, [0])
        return self.const(np.array(d, np.int64))

    def arange(self, stop: Dim) -> Var:
        """[0, 1, ..., stop - 1] as int64 (Range)."""
        return self.emit("Range", [self.int_scalar(0), self.int_scalar(stop), self.int_scalar(1)])

    def name_as(self, value: Var, name: str) -> Var:
        """Make ``value`` available as the tensor ``name``: rename it on the node of this builder that made
        it (and on its readers here), so no copy is made; an Identity when no node here made it."""
        self.name_all([(value, name)])
        return value

    def name_all(self, pairs: Sequence[tuple[Var, str]]) -> None:
        """:meth:`name_as` for each (value, name) pair, renaming in one sweep over the nodes (a training graph
        names hundreds of outputs); a value named twice is renamed once and copied by an Identity after."""
        renames: dict[str, str] = {}
        for value, name in pairs:
            old = value.name
            source = renames.get(old)
            if source is None and old not in self.constant_names and old in self.made:
                renames[old] = name
            else:
                self.nodes.append(helper.make_node("Identity", [source or old], [name],
                                                   name=self.names.fresh(f"{name}/Identity"), doc_string=self.doc))
            self.made.add(name)
            self.infos[name] = self.infos.get(old, TensorInfo())
        rename_tensors(self.nodes, renames)
        for value, name in pairs:
            value.name = name

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

    def with_shape(self, v: Var, shape: "Var | Sequence[int | None] | None") -> Var:
        """Record that ``v`` has ``shape`` (another Var's, or dims with None where unknown): what a rule
        knows that the builder could not derive. Dims already recorded stay; returns ``v``."""
        info = self.infos.get(v.name)
        have = None if info is None else info.shape
        if have is not None and None not in have:
            return v                                # the common case: already static
        known = shape.shape if type(shape) is Var else shape
        if known is None:
            return v
        if have is None:
            merged = tuple(known)
        elif len(have) != len(known):
            return v
        else:
            merged = tuple(k if h is None else h for h, k in zip(have, known))
        self.infos[v.name] = TensorInfo(None if info is None else info.dtype, merged)
        return v

    def unbroadcast(self, grad: Var, target: Var, kept: Iterable[int] = ()) -> Var:
        """Sum ``grad`` (shaped like the broadcast result: its recorded shape) back to ``target``'s shape;
        ``kept``: axes of ``grad`` known not to be broadcast for ``target`` (the result's dim there is
        ``target``'s: a matrix product's rows and columns, a symbolic dim both share).

        Static shapes: ReduceSum over the broadcast axes, computed here, and a
        Reshape; nothing at all when the shapes already match. An unknown dim of
        ``target`` (an export's symbolic batch axis) outside ``kept`` leaves the
        axes to the run time: computed in the graph (Shape, Equal, NonZero) and
        ReduceSum with noop_with_empty_axes.
        """
        kept = set(kept)
        ts = target.shape
        gs = grad.shape
        if ts is not None and ts == gs and None not in ts:
            return grad                         # the common case: nothing was broadcast
        if ts is not None and gs is not None and len(gs) >= len(ts):
            lead = len(gs) - len(ts)
            axes = list(range(lead))
            decidable = True
            for i, (d, g) in enumerate(zip(ts, gs[lead:])):
                if lead + i in kept:
                    continue
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


_SAME_SHAPE = frozenset({
    "Identity", "Neg", "Abs", "Relu", "Tanh", "Sigmoid", "Exp", "Log", "Sqrt", "Reciprocal", "Sign", "Erf",
    "Sin", "Cos", "Floor", "Ceil", "Round", "Not", "IsNaN", "IsInf", "Cast", "CastLike", "Softmax",
    "LogSoftmax", "Softplus", "Softsign", "Elu", "Selu", "LeakyRelu", "HardSigmoid", "Celu", "Gelu"})
_BROADCASTING = frozenset({
    "Add", "Sub", "Mul", "Div", "Pow", "Max", "Min", "Sum", "Mean", "Where", "Equal", "Less", "LessOrEqual",
    "Greater", "GreaterOrEqual", "And", "Or", "Xor", "Mod"})
_REDUCE = frozenset({"ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL2",
                     "ReduceSumSquare", "ReduceLogSumExp"})
_SHAPED = _SAME_SHAPE | _BROADCASTING | _REDUCE | {
    "MatMul", "Transpose", "Reshape", "Squeeze", "Unsqueeze", "Gemm", "ConstantOfShape", "Expand",
    "Concat", "Shape"}


def _broadcast(shapes: Sequence[tuple[int, ...]]) -> tuple[int, ...]:
    """numpy's broadcast of static shapes (ValueError when they do not broadcast)."""
    out = tuple(shapes[0])
    for s in shapes[1:]:
        if s == out or not s:           # the common cases: equal shapes, a scalar
            continue
        if not out:
            out = tuple(s)
            continue
        rank = max(len(out), len(s))
        a, b = (1,) * (rank - len(out)) + out, (1,) * (rank - len(s)) + tuple(s)
        if any(x != y and x != 1 and y != 1 for x, y in zip(a, b)):
            raise ValueError(f"shapes {shapes} do not broadcast")
        out = tuple(y if x == 1 else x for x, y in zip(a, b))
    return out


def shape_of_op(op: str, shapes: list, inputs: Sequence[str], attrs: dict[str, Any],
                constants: dict[str, np.ndarray]) -> tuple[int, ...] | None:
    """The static output shape of ``op`` from its inputs' static shapes (every input has one), its
    attributes and the values of its constant inputs (axes, shapes), or None. The common ops only."""
    def ints(i: int) -> list[int] | None:
        v = constants.get(inputs[i]) if i < len(inputs) and inputs[i] else None
        return None if v is None else [int(k) for k in np.asarray(v).reshape(-1)]

    a = shapes[0]
    if op in _SAME_SHAPE:
        return a
    if op in _BROADCASTING:
        return _broadcast(shapes)
    if op == "MatMul":
        c = shapes[1]
        if not a or not c:
            return None
        a2, c2 = (a if len(a) > 1 else (1,) + a), (c if len(c) > 1 else c + (1,))
        if a2[-1] != c2[-2]:
            return None
        out = _broadcast([a2[:-2], c2[:-2]]) + (a2[-2], c2[-1])
        if len(a) == 1:
            out = out[:-2] + out[-1:]
        if len(c) == 1:
            out = out[:-1]
        return out
    if op == "Transpose":
        perm = attrs.get("perm") or list(range(len(a)))[::-1]
        return tuple(a[p] for p in perm)
    if op in _REDUCE:
        if len(inputs) > 1 and inputs[1]:
            axes = ints(1)
            if axes is None:
                return None                       # axes known only at run time
        else:
            axes = attrs.get("axes")
        if not axes:
            if attrs.get("noop_with_empty_axes", 0):
                return a
            axes = range(len(a))
        drop = {x % len(a) for x in axes}
        if attrs.get("keepdims", 1):
            return tuple(1 if i in drop else d for i, d in enumerate(a))
        return tuple(d for i, d in enumerate(a) if i not in drop)
    if op == "Reshape":
        target = ints(1)
        if target is None:
            return None
        allowzero = attrs.get("allowzero", 0)
        out = [a[i] if t == 0 and not allowzero else t for i, t in enumerate(target)]
        if -1 in out:
            rest = int(np.prod([d for d in out if d != -1]))
            if rest == 0:
                return None
            out[out.index(-1)] = int(np.prod(a)) // rest
        return tuple(out) if int(np.prod(out)) == int(np.prod(a)) else None
    if op in ("Squeeze", "Unsqueeze"):
        axes = ints(1) if len(inputs) > 1 and inputs[1] else attrs.get("axes")
        if axes is None:
            return None
        if op == "Squeeze":
            drop = {x % len(a) for x in axes}
            return tuple(d for i, d in enumerate(a) if i not in drop)
        rank = len(a) + len(axes)
        add = {x % rank for x in axes}
        it = iter(a)
        return tuple(1 if i in add else next(it) for i in range(rank))
    if op == "Gemm":
        c = shapes[1]
        m = a[1] if attrs.get("transA", 0) else a[0]
        n = c[0] if attrs.get("transB", 0) else c[1]
        return (m, n)
    if op == "ConstantOfShape":
        dims = ints(0)
        return None if dims is None else tuple(dims)
    if op == "Expand":
        target = ints(1)
        return None if target is None else _broadcast([a, tuple(target)])
    if op == "Concat":
        axis = attrs.get("axis") % len(a)
        return a[:axis] + (sum(s[axis] for s in shapes),) + a[axis + 1:]
    if op == "Shape":
        return (len(range(len(a))[slice(attrs.get("start"), attrs.get("end"))]),)
    return None
