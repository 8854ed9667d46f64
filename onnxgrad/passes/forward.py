"""The forward-mode pass: Jacobian-vector products as ONNX graphs.

``jvp(model, wrt, of)`` adds a graph input ``<x>_tangent`` per ``wrt`` tensor (a
direction v, x's type and shape) and a graph output ``<y>_tangent`` per ``of``
output: J v, with J the Jacobian of the outputs with respect to all of ``wrt``.

1. Mark the tensors with a differentiable path to ``of`` (:func:`onnxgrad.passes.reach.gradient_reach`).
2. Walk the nodes in topological order: each node with a tangent reaching a
   differentiable input gets its outputs' tangents from its tangent rule
   (:mod:`onnxgrad.rules.tangents`), else from the transpose of its reverse rule
   (:mod:`onnxgrad.passes.tangent_fallback`). Zero-derivative ops give no tangent.
3. Expose ``<y>_tangent`` outputs (zeros of y's type and shape where no direction reaches y, as
   ``torch.func.jvp``), drop tangent nodes nothing reads, stamp metadata
   (``onnxgrad.tangent_inputs``, ``onnxgrad.tangents``), which :func:`onnxgrad.grad` keeps,
   so ``grad(jvp(m))`` and ``jvp(grad(m))`` compose.
"""
from __future__ import annotations

import gc
import json
import os
from typing import Sequence

import onnx
from onnx import helper

from ..errors import NonFloatError, RuleError, UnknownNameError, UnsupportedOpError, UnusedError
from ..ir import graph as G
from ..ir import model as M
from ..ir.builder import Builder, Var
from ..ir.load import emitted_ir_version, parse
from ..ir.model import NameScope, ParsedModel, TensorInfo, rename_tensors
from ..rules import tangents as T
from . import reach as R
from .tangent_fallback import transpose_of_vjp

__all__ = ["jvp", "tangent_spec"]


def jvp(
    model: onnx.ModelProto | str | os.PathLike,
    wrt: Sequence[str] | str,
    of: Sequence[str] | str | None = None,
    allow_unused: bool = True,
    strict_tags: bool = False,
) -> onnx.ModelProto:
    """Append the tangent graph to ``model``: inputs ``<x>_tangent`` (v), outputs ``<y>_tangent`` (J v).

    ``wrt``: graph inputs, initializers or float intermediate tensors (a direction at an
    intermediate tensor is added to the tangent flowing into it, as ``grad`` gives the total
    gradient there). ``of``: float outputs (default: every float output). As ``torch.func.jvp``,
    an output no ``wrt`` tensor reaches through a differentiable path has a zero tangent (of its
    type and shape, the shape read at run time where it is symbolic), and a direction that reaches
    no output is ignored; ``allow_unused=False`` is the strict check: an :class:`UnusedError` for either.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        return _ForwardPass(parse(model), _names(wrt), _names(of), allow_unused, strict_tags).run()
    finally:
        if enabled:
            gc.enable()


def tangent_spec(jvp_model: onnx.ModelProto) -> dict:
    """``{"tangent_inputs": {x: input}, "tangents": {y: output}}`` as :func:`jvp` recorded them."""
    meta = {p.key: p.value for p in jvp_model.metadata_props}
    return {k: json.loads(meta[f"onnxgrad.{k}"]) for k in ("tangent_inputs", "tangents")}


def _names(x: Sequence[str] | str | None) -> list[str] | None:
    if x is None:
        return None
    return [x] if isinstance(x, str) else list(x)


class _ForwardPass:
    def __init__(self, parsed: ParsedModel, wrt: list[str] | None, of: list[str] | None,
                 allow_unused: bool, strict: bool):
        if not wrt:
            raise UnknownNameError("jvp needs wrt: the tensors the tangent directions perturb")
        parsed.name_nodes()
        self.model = parsed.proto
        self.strict = strict
        self.allow_unused = allow_unused
        self.opset = parsed.opset
        self.infos, self.types = dict(parsed.infos), dict(parsed.types)   # the pass adds its own tensors'
        self.nodes = parsed.nodes
        self.known = parsed.known
        self.of = self._of(of)
        self.wrt = self._wrt(wrt)
        self.facts = R.node_facts(parsed, strict)
        self.reach = R.gradient_reach(parsed, self.facts, self.of)
        self.constants = parsed.constants_without(self.wrt)

    def _of(self, of: list[str] | None) -> list[str]:
        outputs = [o.name for o in self.model.graph.output]
        if of is None:
            floats = [o for o in outputs if M.is_float(self.infos.get(o))]
            if not floats:
                raise UnknownNameError("the model has no floating-point output to differentiate")
            return floats
        for name in of:
            if name not in outputs:
                raise UnknownNameError(f"of '{name}' is not an output of the model (outputs: {', '.join(outputs)})")
            if not M.is_float(self.infos.get(name)):
                raise NonFloatError(f"of '{name}' is not a floating-point tensor; only float outputs have tangents")
        return list(dict.fromkeys(of))

    def _wrt(self, wrt: list[str]) -> list[str]:
        for name in wrt:
            if name not in self.known:
                raise UnknownNameError(f"wrt '{name}' is not a graph input, initializer or node output of the model")
            if not M.is_float(self.infos.get(name)):
                dtype = helper.tensor_dtype_to_string(self.infos[name].dtype)
                raise NonFloatError(f"wrt '{name}' is a {dtype} tensor; only float tensors have tangents")
        return list(dict.fromkeys(wrt))

    def run(self) -> onnx.ModelProto:
        for name in self.wrt:
            if name not in self.reach and not self.allow_unused:
                raise UnusedError(f"wrt '{name}' does not influence the outputs {', '.join(self.of)} through a "
                                  "differentiable path; leave allow_unused at its default (True) to ignore its "
                                  "direction")
        g = self.model.graph
        taken = self.known | {o.name for o in g.output} | {n.name for n in self.nodes}
        self.names = NameScope(taken)
        root = Builder(self.opset, self.names, self.infos, "onnxgrad", "", self.constants)
        tangent_inputs = []
        self.seeds: dict[str, Var] = {}
        for name in self.wrt:
            t = self.names.fresh(f"{name}_tangent")
            tangent_inputs.append(self._value_info(t, name))
            self.infos[t] = self.infos.get(name) or TensorInfo()
            self.seeds[name] = root.var(t)
        self.tangent: dict[str, Var] = {x: v for x, v in self.seeds.items()}
        self._walk(root)
        outputs, renames = [], {}
        made_here = {o for node in root.nodes for o in node.output} - set(root.shared_constants.values())
        for y in self.of:
            out_name = self.names.fresh(f"{y}_tangent")
            t = self.tangent.get(y)
            if t is None:
                if not self.allow_unused:
                    raise UnusedError(f"output '{y}' does not depend on {', '.join(self.wrt)} through a differentiable "
                                      "path: its tangent is zero; leave allow_unused at its default (True) to get "
                                      "zeros")
                t = root.scoped(f"{y}_tangent", f"tangent of '{y}'").zeros_like(root.var(y))
                made_here.add(t.name)
            if t.name in made_here and t.name not in renames:
                renames[t.name] = out_name
            else:
                root.nodes.append(helper.make_node("Identity", [t.name], [out_name],
                                                   name=self.names.fresh(f"{y}_tangent/Identity")))
            outputs.append(self._value_info(out_name, y))
        rename_tensors(root.nodes, renames)
        tangent_nodes = G.live_nodes(root.nodes, {o.name for o in outputs})
        return self._assemble(tangent_nodes, tangent_inputs, outputs)

    def _walk(self, root: Builder) -> None:
        unsupported, reasons = {}, {}
        for node in self.nodes:
            outs = [o for o in node.output if o in self.reach and M.is_float(self.infos.get(o))]
            if not outs:
                continue
            fact = self.facts[id(node)]
            rule, positions, outer_reads = fact.rule, fact.positions, fact.outer_reads
            no_rule_reason = fact.no_rule_reason
            dxs = [self.tangent.get(x) if i in positions and x else None for i, x in enumerate(node.input)]
            inner = outer_reads & set(self.tangent)
            if all(d is None for d in dxs) and not inner:
                continue
            if rule is not None and rule.stop:
                continue                        # zero (or no) derivative: no tangent flows on
            native = T.get_tangent_rule(node.op_type) if node.domain in ("", "ai.onnx") and not inner else None
            if native is None and rule is None:
                unsupported.setdefault(node.op_type, node.name)
                if no_rule_reason is not None:
                    reasons[node.op_type] = no_rule_reason
                continue
            if unsupported:
                continue                        # keep looking for every unsupported op, build nothing more
            b = root.scoped(f"{node.name}/jvp", f"tangent of node '{node.name}' ({node.op_type})", node.op_type)
            result = NotImplemented
            if native is not None:
                result = native.fn(T.TNode(node, b, dxs, positions))
            if result is NotImplemented:
                result = transpose_of_vjp(node, b, dxs, self.types, self.opset, self.strict)
            self._collect(node, result, root)
        if unsupported:
            raise UnsupportedOpError(unsupported, reasons)

    def _collect(self, node: onnx.NodeProto, result, root: Builder) -> None:
        if result is None or isinstance(result, Var):
            result = [result]
        result = list(result)
        while len(result) > len(node.output) and result[-1] is None:
            result.pop()                        # trailing Nones for optional outputs the node leaves out
        if len(result) > len(node.output):
            raise RuleError(f"tangent rule for {node.op_type} returned {len(result)} tangents for "
                            f"{len(node.output)} outputs (node '{node.name}')")
        for y, t in zip(node.output, result):
            if t is None or not y or not M.is_float(self.infos.get(y)):
                continue
            if not isinstance(t, Var):
                raise RuleError(f"tangent rule for {node.op_type} returned {type(t).__name__} (node '{node.name}')")
            if y in self.seeds:                 # a direction given at an intermediate tensor adds to its tangent
                t = root.scoped(f"{y}_tangent", f"tangent of '{y}'").op.Add(t, self.seeds[y])
            self.tangent[y] = root.var(t.name)

    def _value_info(self, name: str, like: str) -> onnx.ValueInfoProto:
        return M.value_info_like(name, like, self.types, self.infos)

    def _assemble(self, tangent_nodes, tangent_inputs, outputs) -> onnx.ModelProto:
        from ..version import __version__

        out = onnx.ModelProto()
        out.CopyFrom(self.model)
        g = out.graph
        del g.node[:]
        g.node.extend(self.nodes)
        g.node.extend(tangent_nodes)
        g.input.extend(tangent_inputs)
        g.output.extend(outputs)
        meta = {
            "onnxgrad.version": __version__,
            "onnxgrad.tangent_inputs": json.dumps({w: v.name for w, v in zip(self.wrt, tangent_inputs)}),
            "onnxgrad.tangents": json.dumps({y: o.name for y, o in zip(self.of, outputs)}),
        }
        M.set_metadata(out, meta)
        out.ir_version = emitted_ir_version(out)
        return out


# -- the numeric check --------------------------------------------------------------------
