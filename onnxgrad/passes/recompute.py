"""Recomputation (rematerialisation): cheap forward activations computed again in the backward.

onnxruntime frees a tensor after its last reader. A forward activation that the backward reads lives
from the forward until that reader, so at the turn from forward to backward every one of them is alive
at once, and many stay alive well into the backward. :func:`recompute_activations` takes cheap ones out
of that set. The
nodes that make one (a ReLU, a batch norm's normalisation, a GELU's arithmetic) are cloned into the
backward just before its first reader there, reading tensors the backward keeps anyway (a convolution's
output, the batch statistics, the parameters), and the backward reads the clone: the original has no
reader after the forward and is freed in it.

A tensor ``t`` the backward reads is recomputed, deciding in forward order, when:

- every node between ``t`` and the tensors its clones read is cheap and deterministic (:data:`ELEMENTWISE`,
  a BatchNormalization's normalisation from its batch statistics or running ones, a LayerNormalization's
  from its Mean and InvStdDev outputs), at most :data:`MAX_CLONES` of them; never a random op (Dropout,
  RandomNormal), a convolution, a matrix product, a pooling or a reduction;
- every tensor the clones read is held anyway where they run: an initializer, a graph input or a
  Constant, or a tensor the backward keeps (reads, and does not recompute) at or after that place, or
  one that it keeps until shortly before and that is no larger than ``t`` (its life grows by a stretch
  where ``t`` itself was alive, so the memory held there does not grow).

A tensor the backward compares with another tensor (``Equal``, or ``Less`` of two tensors; directly or
through data movement: the CPU rewrite of MaxPool's backward finds each window's maximum again as the
first tap of x not below y) is never recomputed: a clone agrees with the forward's tensor up to rounding,
not bit for bit (a batch norm recomputed from its statistics rounds differently from the training
kernel), and one differing bit sends a window's gradient to the wrong tap or loses it.

A tensor read through another recomputed one is computed again from the tensors that one reads (a
ResNet's block output reads the previous block's), so chains stay within :data:`MAX_CLONES` nodes.
Places are those of the gradient model's node order; onnxruntime orders the nodes itself (a depth-first
walk back from the outputs), which runs a clone when its first reader there needs it. Its
common-subexpression elimination would merge the clones back into the forward: see
:data:`ORT_DISABLED_OPTIMIZERS`.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import helper

from ..ir import model as M
from ..ir.builder import Builder, Var
from ..ir.model import NameScope, rename_tensors
from .optimize.rewriter import GraphView
from .record import backward_nodes

__all__ = ["ELEMENTWISE", "MAX_CLONES", "ORT_DISABLED_OPTIMIZERS", "recompute_activations"]

# Ops cloned as they are: elementwise, deterministic, about as cheap as reading their output once.
ELEMENTWISE = frozenset({
    "Relu", "LeakyRelu", "Elu", "Selu", "Sigmoid", "HardSigmoid", "HardSwish", "Tanh", "Gelu", "Erf",
    "Add", "Sub", "Mul", "Div", "Neg", "Where", "Cast", "Identity",
})

MAX_CLONES = 8      # nodes cloned to recompute one tensor

# onnxruntime's graph optimizers that undo recomputation: common-subexpression elimination merges a
# clone with the forward node it copies (and clones of one tensor with each other), so that the forward's
# tensor is kept again. Run a recomputing model with them off:
# ``InferenceSession(..., disabled_optimizers=ORT_DISABLED_OPTIMIZERS)`` (TrainingSession does).
ORT_DISABLED_OPTIMIZERS = ("CommonSubexpressionElimination",)

_STANDARD = ("", "ai.onnx")


@dataclass
class _Plan:
    """One recomputed tensor: the tensors cloned for it (producers first, ``tensor`` last), at ``at``."""

    tensor: str
    at: int                                          # index of its first backward reader
    chain: list[str]
    reads: set[str] = field(default_factory=set)     # tensors the clones read that are not cloned


def recompute_activations(grad_model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of the gradient model ``grad_model`` (:func:`onnxgrad.grad`'s) whose backward recomputes the
    cheap forward activations it reads, where that frees them in the forward (see the module's doc).
    The recomputed tensors are listed in the metadata ``onnxgrad.recomputed``."""
    out = onnx.ModelProto()
    out.CopyFrom(grad_model)
    first = len(out.graph.node) - len(backward_nodes(out))
    view = GraphView(out, first)
    planner = _Planner(view, first)
    plans = planner.plans()
    if plans:
        _apply(view, plans, planner.position)
    M.set_metadata(out, {"onnxgrad.recomputed": json.dumps([p.tensor for p in plans])})
    return out


def _bytes(view: GraphView, name: str) -> int | None:
    """The size of a tensor of static shape and known type, in bytes."""
    shape, dtype = view.shape(name), view.info(name).dtype
    if shape is None or not dtype:
        return None
    return int(np.prod(shape, dtype=np.int64)) * np.dtype(helper.tensor_dtype_to_np_dtype(dtype)).itemsize


# -- how a forward node's output is computed again ------------------------------------------------
def _recomputable(view: GraphView, node: onnx.NodeProto, tensor: str) -> list[str] | None:
    """The tensors a clone computing ``tensor`` (an output of ``node``) reads; None when it is not cheap
    to compute again (or not deterministic)."""
    if node.domain not in _STANDARD or tensor != node.output[0]:
        return None
    op = node.op_type
    if op in ELEMENTWISE and len(node.output) == 1:
        return [x for x in node.input if x]
    if op == "BatchNormalization":
        statistics = _batch_statistics(view, node)
        return None if statistics is None else list(node.input[:3]) + statistics
    if op == "LayerNormalization" and _layer_statistics(view, node) is not None:
        return [x for x in node.input if x] + list(node.output[1:3])
    return None


def _batch_statistics(view: GraphView, node: onnx.NodeProto) -> list[str] | None:
    """The mean and variance a BatchNormalization normalised with: its inputs in inference mode; in
    training mode its running outputs when its momentum is 0 (then they are the batch's statistics:
    :mod:`onnxgrad.training.train_mode` makes them so); None otherwise (the statistics would be reductions)."""
    outputs = [o for o in node.output[1:3] if o]
    training = bool(view.attr(node, "training_mode", 0)) or bool(outputs)
    if not training:
        return list(node.input[3:5])
    if len(outputs) == 2 and view.attr(node, "momentum", 0.9) == 0.0:
        return outputs
    return None


def _layer_statistics(view: GraphView, node: onnx.NodeProto) -> list[str] | None:
    """A LayerNormalization's Mean and InvStdDev outputs, when it has them and computes in x's type."""
    if len(node.output) < 3 or not all(node.output[1:3]):
        return None
    if view.info(node.input[0]).dtype != view.attr(node, "stash_type", 1):
        return None
    return list(node.output[1:3])


def _emit_clone(b: Builder, view: GraphView, node: onnx.NodeProto, reads: list[Var]) -> Var:
    """The clone of ``node``'s first output from ``reads`` (:func:`_recomputable`'s tensors, renamed)."""
    op = node.op_type
    if op == "BatchNormalization":        # y = scale * (x - mean) / sqrt(var + eps) + B, the statistics given
        return b.op.BatchNormalization(*reads, epsilon=view.attr(node, "epsilon", 1e-5))
    if op == "LayerNormalization":        # y = (x - Mean) * InvStdDev * scale + B
        x, scale, *rest = reads
        mean, inv_std = rest[-2:]
        y = (x - mean) * inv_std * scale
        return y + rest[0] if len(rest) == 3 else y
    return b.emit(op, reads, **{a.name: helper.get_attribute_value(a) for a in node.attribute})


# -- what is recomputed ---------------------------------------------------------------------------
_MOVES = frozenset({"Slice", "Reshape", "Transpose", "Squeeze", "Unsqueeze", "Flatten", "Identity", "Expand",
                    "Gather", "Concat", "Split"})     # ops that pass values through unchanged


def _compares_two_tensors(view: GraphView, node: onnx.NodeProto) -> bool:
    """An ``Equal``, or a ``Less`` of two non-constant tensors (one against a constant bound, as Clip's and
    HardSwish's gradients compare, only moves a mask where the value sits on the bound)."""
    if node.op_type == "Equal":
        return True
    return node.op_type == "Less" and all(view.value(i) is None for i in node.input)


def _compared(view: GraphView, tensor: str, first: int, position: dict[int, int]) -> bool:
    """Whether a backward comparison of two tensors reads ``tensor``'s values, directly or through
    :data:`_MOVES`."""
    seen, todo = set(), [tensor]
    while todo:
        x = todo.pop()
        for reader in view.readers.get(x, []):
            if position[id(reader)] < first or reader.domain not in _STANDARD:
                continue
            if _compares_two_tensors(view, reader):
                return True
            if reader.op_type in _MOVES:
                todo.extend(o for o in reader.output if o and o not in seen)
                seen.update(reader.output)
    return False


class _Planner:
    """Decides, in forward order, which tensors the backward reads are recomputed, and from what."""

    def __init__(self, view: GraphView, first: int):
        self.view = view
        self.first = first
        g = view.model.graph
        forward = view.nodes[:first]
        self.free = ({i.name for i in g.initializer} | {i.name for i in g.input}
                     | {n.output[0] for n in forward if n.op_type == "Constant" and n.domain in _STANDARD})
        self.position = position = {id(n): i for i, n in enumerate(view.nodes)}
        self.first_read: dict[str, int] = {}        # forward tensor -> its first and last backward readers
        self.last_read: dict[str, int] = {}
        made = {o for n in forward for o in n.output if o}
        for name, readers in view.readers.items():
            at = [position[id(r)] for r in readers if position[id(r)] >= first]
            if at and name in made:
                self.first_read[name], self.last_read[name] = min(at), max(at)
        self.recomputed: set[str] = set()

    def plans(self) -> list[_Plan]:
        plans = []
        for node in self.view.nodes[:self.first]:
            t = node.output[0] if node.output else ""
            if t not in self.first_read or t in self.free or t in self.view.outputs:
                continue
            if _compared(self.view, t, self.first, self.position):
                continue
            plan = self._plan(t)
            if plan is None:
                continue
            self.recomputed.add(t)
            for x in plan.reads:
                if x in self.last_read:
                    self.last_read[x] = max(self.last_read[x], plan.at)
            plans.append(plan)
        return plans

    def _kept(self, name: str) -> bool:
        return name in self.first_read and name not in self.recomputed

    def _plan(self, t: str) -> _Plan | None:
        """How ``t`` is recomputed before its first backward reader, or None when it cannot be (or it
        would not shorten its life without lengthening another's more)."""
        view = self.view
        plan = _Plan(t, self.first_read[t], [])
        budget = _bytes(view, t)                # bytes whose life may grow to the clones' place

        def visit(x: str) -> bool:
            nonlocal budget
            if x in plan.chain or x in plan.reads or x in self.free:
                if x in self.free:
                    plan.reads.add(x)
                return True
            if x != t and self._kept(x):        # held until its last backward reader
                if self.last_read[x] < plan.at:
                    size = _bytes(view, x)
                    if size is None or budget is None or size > budget:
                        return False
                    budget -= size
                plan.reads.add(x)
                return True
            node = view.producer.get(x)
            inputs = None if node is None else _recomputable(view, node, x)
            if inputs is None or not all(visit(i) for i in inputs):
                return False
            plan.chain.append(x)
            return len(plan.chain) <= MAX_CLONES

        return plan if visit(t) else None


# -- the rewrite ----------------------------------------------------------------------------------
def _apply(view: GraphView, plans: list[_Plan], position: dict[int, int]) -> None:
    """Insert each plan's clones before its first backward reader and point the backward's readers at them."""
    g = view.model.graph
    _, types = M.tensor_infos(view.model)
    names = NameScope(set(view.producer) | {i.name for i in g.input} | {i.name for i in g.initializer}
                      | {n.name for n in view.nodes})
    inserted: dict[int, list[onnx.NodeProto]] = {}
    clones: dict[tuple[str, int], str] = {}       # (forward tensor, place) -> its clone there
    typed = []
    for plan in plans:
        for x in plan.chain:
            if (x, plan.at) in clones:
                continue
            node = view.producer[x]
            b = Builder(view.opset, names, view.infos, f"{node.name}/recompute",
                        f"recomputes '{x}' ({node.op_type} of the forward) for the backward", view.constants)
            reads = [b.var(clones.get((i, plan.at), i)) for i in _recomputable(view, node, x)]
            clone = _emit_clone(b, view, node, reads)
            clones[(x, plan.at)] = clone.name
            inserted.setdefault(plan.at, []).extend(b.nodes)
            if x in types:
                typed.append((clone.name, types[x]))
        clone = clones[(plan.tensor, plan.at)]
        for reader in view.readers[plan.tensor]:
            if position[id(reader)] >= view.first:
                rename_tensors([reader], {plan.tensor: clone})
    nodes = []
    for i, node in enumerate(view.nodes):
        nodes.extend(inserted.get(i, ()))
        nodes.append(node)
    del g.node[:]
    g.node.extend(nodes)
    M.add_value_infos(g, typed)
