"""Sequences and optionals: SequenceConstruct, SequenceAt, SequenceInsert, SequenceErase, SplitToSequence,
ConcatFromSequence, Optional, OptionalGetElement.

The gradient of a sequence of tensors is the sequence of their gradients. A sequence's gradient is
gathered as a :class:`SequenceGrad`: whole gradient sequences (``full``, from ConcatFromSequence, a
seed, ...) plus updates "add v at position i" (``updates``, one per SequenceAt). The producer's rule
decides how to read it: SequenceConstruct takes its elements' gradients straight from updates at
constant positions, SequenceErase shifts the positions, the others build one sequence (zeros of the
producer's making, each update added with SequenceAt + Add + SequenceErase + SequenceInsert). Only where
no rule can make the zeros (a sequence's several whole gradients, an unknown producer) does a ``Loop``
over the sequence add or zero its elements. Everything is standard ai.onnx (opset 13+ for Loop over
sequences). SequenceEmpty, SequenceLength and OptionalHasElement give no float tensor: no rule.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from onnxgrad.ir.builder import Builder, Var
from onnxgrad.ir.model import ContainerInfo, container_kind

from .registry import register

__all__ = ["Update", "SequenceGrad", "accumulate"]


@dataclass
class Update:
    """Add ``value`` to the gradient of element ``index`` (an int known at build time, or an int Var)."""
    index: int | Var
    value: Var


@dataclass
class SequenceGrad:
    """The gradient of the sequence ``like``: the sum of the sequences ``full`` and of the ``updates``."""
    like: Var
    full: list[Var] = field(default_factory=list)
    updates: list[Update] = field(default_factory=list)

    def bound_to(self, b: Builder) -> "SequenceGrad":
        """This gradient as the rule that reads it sees it: its tensors bound to that rule's builder."""
        return SequenceGrad(b.var(self.like.name), [b.var(f.name) for f in self.full],
                            [Update(u.index if isinstance(u.index, int) else b.var(u.index.name), b.var(u.value.name))
                             for u in self.updates])

    def static(self) -> bool:
        """Every update at a position known at build time, and no whole sequence."""
        return not self.full and all(isinstance(u.index, int) for u in self.updates)

    def element(self, b: Builder, k: int, length: int) -> Var | None:
        """The gradient of element k of a sequence of ``length`` elements, from static updates alone."""
        parts = [u.value for u in self.updates if u.index in (k, k - length)]
        return None if not parts else parts[0] if len(parts) == 1 else b.op.Sum(*parts)

    def materialize(self, b: Builder, zeros: Var | None = None) -> Var:
        """One gradient sequence: ``zeros`` (a zero sequence like ``like``: the caller's, else a Loop's) or
        the first whole sequence, plus the other whole sequences (a Loop each) and every update."""
        if self.full:
            out, rest = self.full[0], self.full[1:]
        else:
            out, rest = (zeros if zeros is not None else _loop_zeros(b, self.like)), []
        for other in rest:
            out = _loop_add(b, out, other, self.like)
        for u in self.updates:
            out = _add_at(b, out, u.index, u.value)
        return out


def accumulate(b: Builder, name: str, kind: str, parts: list) -> SequenceGrad | Var:
    """The total gradient of a sequence or optional ``name`` from its contributions (the pass's Sum)."""
    if kind == "sequence":
        total = SequenceGrad(b.var(name))
        for p in parts:
            if isinstance(p, SequenceGrad):
                total.full += p.full
                total.updates += p.updates
            elif isinstance(p, Update):
                total.updates.append(p)
            else:
                total.full.append(p)
        return total
    if kind == "optional":
        if len(parts) == 1:
            return parts[0]
        return b.op.Optional(b.op.Sum(*[b.op.OptionalGetElement(p) for p in parts]))
    b._decline(f"'{name}' is a {kind}: gradients are carried for sequences and optionals of tensors only")


def _index(b: Builder, n_node, i: int) -> int | Var | None:
    """Input i of a sequence op as a position: an int when constant, an int64 scalar Var otherwise."""
    x = n_node.input(i)
    if x is None:
        return None
    value = n_node.const_ints(i)
    if value is not None:
        return value[0]
    return x if x.dtype == TensorProto.INT64 else b.op.Cast(x, to=TensorProto.INT64)


def _position(b: Builder, index: int | Var, seq: Var) -> Var:
    """``index`` as a position in [0, len(seq)) (negative positions count from the back)."""
    if isinstance(index, int) and index >= 0:
        return b.const(np.array(index, np.int64))
    length = b.op.SequenceLength(seq)
    return b.op.Mod(b.lift(np.array(index, np.int64)) + length if isinstance(index, int) else index + length,
                    length)


def _add_at(b: Builder, seq: Var, index: int | Var, value: Var) -> Var:
    """seq with ``value`` added to element ``index``: SequenceAt + Add, SequenceErase, SequenceInsert."""
    k = _position(b, index, seq)
    total = b.op.SequenceAt(seq, k) + value
    return b.op.SequenceInsert(b.op.SequenceErase(seq, k), total, k)


def _loop(b: Builder, seq: Var, like: Var, body_of, hint: str) -> Var:
    """A Loop over the elements of ``seq`` whose body, ``body_of(i) -> (nodes, value)``, makes one value per
    position i; the values are appended to a sequence carried through the loop (SequenceEmpty at first)."""
    fresh = b.names.fresh
    i, cond, acc = (fresh(f"{b.prefix}/{hint}/{s}") for s in ("i", "cond", "acc"))
    cond_out, acc_out = fresh(f"{b.prefix}/{hint}/cond_out"), fresh(f"{b.prefix}/{hint}/acc_out")
    nodes, value = body_of(i)
    nodes += [helper.make_node("SequenceInsert", [acc, value], [acc_out], name=fresh(f"{b.prefix}/{hint}/Insert")),
              helper.make_node("Identity", [cond], [cond_out], name=fresh(f"{b.prefix}/{hint}/Identity"))]
    dtype = like.info.dtype if like.info.dtype is not None else TensorProto.FLOAT
    seq_type = helper.make_sequence_type_proto(helper.make_tensor_type_proto(dtype, None))
    body = helper.make_graph(
        nodes, fresh(f"{b.prefix}/{hint}/body"),
        [helper.make_tensor_value_info(i, TensorProto.INT64, []),
         helper.make_tensor_value_info(cond, TensorProto.BOOL, []), helper.make_value_info(acc, seq_type)],
        [helper.make_tensor_value_info(cond_out, TensorProto.BOOL, []), helper.make_value_info(acc_out, seq_type)])
    out = b.op.Loop(b.op.SequenceLength(seq), None, b.op.SequenceEmpty(dtype=dtype), body=body)
    b.infos[out.name] = ContainerInfo("sequence", dtype)
    return out


def _loop_zeros(b: Builder, seq: Var) -> Var:
    """Zeros shaped like each element of ``seq``, as a sequence (a Loop over it)."""
    dtype = seq.info.dtype if seq.info.dtype is not None else TensorProto.FLOAT
    fresh = b.names.fresh

    def body(i):
        e, s, z = fresh(f"{b.prefix}/zeros/e"), fresh(f"{b.prefix}/zeros/shape"), fresh(f"{b.prefix}/zeros/z")
        zero = numpy_helper.from_array(np.zeros(1, helper.tensor_dtype_to_np_dtype(dtype)))
        return [helper.make_node("SequenceAt", [seq.name, i], [e], name=fresh(f"{b.prefix}/zeros/At")),
                helper.make_node("Shape", [e], [s], name=fresh(f"{b.prefix}/zeros/Shape")),
                helper.make_node("ConstantOfShape", [s], [z], value=zero, name=fresh(f"{b.prefix}/zeros/Fill"))], z

    return _loop(b, seq, seq, body, "zeros")


def _loop_add(b: Builder, a: Var, c: Var, like: Var) -> Var:
    """The elementwise sum of two sequences of equal length (a Loop over them)."""
    fresh = b.names.fresh

    def body(i):
        ea, ec, total = fresh(f"{b.prefix}/add/a"), fresh(f"{b.prefix}/add/b"), fresh(f"{b.prefix}/add/sum")
        return [helper.make_node("SequenceAt", [a.name, i], [ea], name=fresh(f"{b.prefix}/add/At")),
                helper.make_node("SequenceAt", [c.name, i], [ec], name=fresh(f"{b.prefix}/add/At")),
                helper.make_node("Add", [ea, ec], [total], name=fresh(f"{b.prefix}/add/Add"))], total

    return _loop(b, a, like, body, "add")


def _sequence_grad(n, i: int = 0) -> SequenceGrad:
    d = n.dys[i]
    if isinstance(d, SequenceGrad):
        return d
    return SequenceGrad(n.outputs[i], [d])        # a whole sequence (e.g. a rule's own seed)


# -- rules ------------------------------------------------------------------------------------------
@register("SequenceConstruct", inputs=range(4096))
def sequence_construct(n):
    """S = [x_0, ..., x_k]:  dx_j = dS[j]"""
    d, k = _sequence_grad(n), len(n.inputs)
    if d.static():
        return [d.element(n.b, j, k) if n.needs(j) else None for j in range(k)]
    zeros = n.op.SequenceConstruct(*[n.b.zeros_like(x) for x in n.inputs])
    full = d.materialize(n.b, zeros)
    return [n.op.SequenceAt(full, n.b.const(np.array(j, np.int64))) if n.needs(j) else None for j in range(k)]


@register("SequenceAt", inputs=(0,))
def sequence_at(n):
    """y = S[i]:  dS[i] += dy"""
    return (Update(_index(n.b, n, 1), n.dy), None)


@register("SequenceErase", inputs=(0,))
def sequence_erase(n):
    """S' = S without element p:  dS = dS' with a zero element put back at p (positions after p shift by one)"""
    b, d, seq = n.b, _sequence_grad(n), n.inputs[0]
    p = _index(b, n, 1)
    full = []
    if d.full:
        gone = n.op.SequenceAt(seq, p if isinstance(p, Var) else b.const(np.array(-1 if p is None else p, np.int64)))
        zero = b.zeros_like(gone)
        for f in d.full:
            full.append(n.op.SequenceInsert(f, zero) if p is None else
                        n.op.SequenceInsert(f, zero, _position(b, p, seq)))
    updates = []
    for u in d.updates:
        if p is None and isinstance(u.index, int):              # the last element was erased
            updates.append(Update(u.index - 1 if u.index < 0 else u.index, u.value))
        elif isinstance(p, int) and p >= 0 and isinstance(u.index, int) and u.index >= 0:
            updates.append(Update(u.index + (u.index >= p), u.value))
        else:                                                   # k' = k + (k >= p), both made non-negative
            k = _position(b, u.index, n.outputs[0])
            q = _position(b, -1 if p is None else p, seq)
            updates.append(Update(k + n.op.Cast(n.op.GreaterOrEqual(k, q), to=TensorProto.INT64), u.value))
    return (SequenceGrad(seq, full, updates), None)


@register("SequenceInsert", inputs=(0, 1))
def sequence_insert(n):
    """S' = S[:p] + [t] + S[p:]:  dt = dS'[p],  dS = dS' without element p"""
    b, d = n.b, _sequence_grad(n)
    p = _index(b, n, 2)
    if d.static() and (p is None and all(u.index < 0 for u in d.updates)
                       or isinstance(p, int) and p >= 0 and all(u.index >= 0 for u in d.updates)):
        at = -1 if p is None else p
        dt = SequenceGrad(d.like, [], [u for u in d.updates if u.index == at]).element(b, at, 0)
        rest = [Update(u.index + 1 if p is None else u.index - (u.index > at), u.value)
                for u in d.updates if u.index != at]
        return (SequenceGrad(n.inputs[0], [], rest), dt, None)
    full = d.materialize(b)
    at = b.const(np.array(-1, np.int64)) if p is None else _position(b, p, n.outputs[0])
    ds = n.op.SequenceErase(full, at) if n.needs(0) else None
    return (ds, n.op.SequenceAt(full, at) if n.needs(1) else None, None)


@register("SplitToSequence", inputs=(0,))
def split_to_sequence(n):
    """S = split(x, axis):  dx = concat(dS, axis), elements with no gradient as zeros"""
    b, x = n.b, n.inputs[0]
    axis, keepdims = n.attr("axis", 0), n.attr("keepdims", 1)
    split = n.input(1)
    zeros = n.op.SplitToSequence(b.zeros_like(x), *([split] if split is not None else []), axis=axis,
                                 keepdims=keepdims)
    full = _sequence_grad(n).materialize(b, zeros)
    new_axis = int(split is None and not keepdims)
    return (n.op.ConcatFromSequence(full, axis=axis, new_axis=new_axis), None)


@register("ConcatFromSequence", inputs=(0,))
def concat_from_sequence(n):
    """y = concat(S, axis):  dS = split(dy, axis) at the elements' sizes along axis"""
    b, seq = n.b, n.inputs[0]
    axis, new_axis = n.attr("axis"), n.attr("new_axis", 0)
    if new_axis:
        return (n.op.SplitToSequence(n.dy, axis=axis, keepdims=0),)
    elem = seq.info.elem_shape if isinstance(seq.info, ContainerInfo) else None
    size = elem[axis] if elem is not None and -len(elem) <= axis < len(elem) else None
    if size:                        # every element has this size along axis (the sequence's type says so)
        return (n.op.SplitToSequence(n.dy, b.const(np.array(size, np.int64)), axis=axis),)
    return (n.op.SplitToSequence(n.dy, _loop_sizes(b, seq, axis), axis=axis),)


def _loop_sizes(b: Builder, seq: Var, axis: int) -> Var:
    """[len(S)] int64: each element's size along ``axis`` (a Loop over the sequence, sizes as scan outputs)."""
    fresh = b.names.fresh
    i, cond, cond_out = fresh(f"{b.prefix}/sizes/i"), fresh(f"{b.prefix}/sizes/cond"), fresh(f"{b.prefix}/sizes/c")
    e, size = fresh(f"{b.prefix}/sizes/e"), fresh(f"{b.prefix}/sizes/size")
    end = {"end": axis + 1} if axis != -1 else {}
    nodes = [helper.make_node("SequenceAt", [seq.name, i], [e], name=fresh(f"{b.prefix}/sizes/At")),
             helper.make_node("Shape", [e], [size], start=axis, **end, name=fresh(f"{b.prefix}/sizes/Shape")),
             helper.make_node("Identity", [cond], [cond_out], name=fresh(f"{b.prefix}/sizes/Identity"))]
    body = helper.make_graph(
        nodes, fresh(f"{b.prefix}/sizes/body"),
        [helper.make_tensor_value_info(i, TensorProto.INT64, []),
         helper.make_tensor_value_info(cond, TensorProto.BOOL, [])],
        [helper.make_tensor_value_info(cond_out, TensorProto.BOOL, []),
         helper.make_tensor_value_info(size, TensorProto.INT64, [1])])
    if b.opset < 15:
        b._decline("ConcatFromSequence's gradient reads each element's size with Shape(start, end): opset 15")
    sizes = b.op.Loop(b.op.SequenceLength(seq), None, body=body)
    return b.op.Reshape(sizes, b.ints([-1]))


@register("Optional", inputs=(0,))
def optional(n):
    """o = Optional(x):  dx = the element of do"""
    return (n.op.OptionalGetElement(n.dy),)


@register("OptionalGetElement", inputs=(0,))
def optional_get_element(n):
    """y = the element of o:  do = Optional(dy)  (y = x when the input is a plain tensor: dx = dy)"""
    if container_kind(n.inputs[0].info) == "optional":
        return (n.op.Optional(n.dy),)
    return (n.dy,)
