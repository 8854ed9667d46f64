"""The reverse-mode pass: forward model in, forward + backward model out.

1. Decide what is differentiated (``loss`` or ``of``) and with respect to what (``wrt``).
2. Mark the tensors that depend on ``wrt`` through differentiable inputs, and
   the tensors the differentiated outputs depend on; the nodes in both are the path.
3. Walk the path in reverse topological order. Each node's rule turns the
   gradients of its outputs into gradients of its inputs; a tensor with several
   contributions gets one variadic ``Sum``.
4. Expose ``<wrt>_grad`` outputs, drop backward nodes nothing reads, stamp metadata.
"""
from __future__ import annotations

import gc
import json
import os
from typing import Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper

from . import graph as G
from . import model as M
from .builder import Builder, NameScope, TensorInfo, Var, rename_tensors
from .errors import NonFloatError, RuleError, UnknownNameError, UnsupportedOpError, UnusedError
from .registry import Node, Rule

__all__ = ["grad"]


def grad(
    model: onnx.ModelProto | str | os.PathLike,
    wrt: Sequence[str] | str | None = None,
    of: Sequence[str] | str | None = None,
    loss: str | None = None,
    allow_unused: bool = False,
    strict_tags: bool = False,
) -> onnx.ModelProto:
    """Append the backward graph to ``model``; return the new model.

    ``loss``: a scalar float output, seeded with 1. ``of``: float outputs, each
    seeded by a new graph input ``<name>_grad``. Neither: the single scalar
    float output is the loss, else every float output is seeded. ``wrt``:
    tensors to differentiate (default: the model's trainable parameters, as
    :func:`onnxgrad.parameters` decides them); each gets a graph output
    ``<name>_grad``, in order, after the original outputs. ``strict_tags``: follow
    the ONNX schemas' differentiability tags only, without the gradients PyTorch
    computes beyond them (LSTM initial states, Clip bounds, GridSample's grid, ...).
    """
    # The pass allocates many small objects and frees nothing until it ends: the cyclic garbage
    # collector's passes over them would only make large graphs slower than linear.
    enabled = gc.isenabled()
    gc.disable()
    try:
        return _Pass(M.load(model), _names(wrt), _names(of), loss, allow_unused, strict_tags).run()
    finally:
        if enabled:
            gc.enable()


def _names(x: Sequence[str] | str | None) -> list[str] | None:
    if x is None:
        return None
    return [x] if isinstance(x, str) else list(x)


class _Pass:
    def __init__(self, model: onnx.ModelProto, wrt, of, loss, allow_unused: bool, strict_tags: bool = False):
        self.model = model
        self.strict = strict_tags
        self.inferred = M.infer(model)
        self.opset = M.opset_of(model)
        self.infos, self.types = M.tensor_infos(self.inferred)
        self.allow_unused = allow_unused
        self._positions: dict[tuple, tuple[int, ...]] = {}
        g = model.graph
        self.nodes = list(g.node)
        for i, node in enumerate(self.nodes):
            if not node.name:
                node.name = f"{node.op_type}_{i}"
        self.producer = {o: node for node in self.nodes for o in node.output if o}
        self.known = ({i.name for i in g.input} | {i.name for i in g.initializer}
                      | set(self.producer))
        self.loss, self.of = self._outputs(of, loss)
        self.targets = {self.loss} if self.loss else set(self.of)
        self.reach = G.gradient_reach(self.nodes, self.targets, self.opset, self.infos, self.strict,
                                      self._positions)
        self.wrt = self._wrt(wrt)
        self.constants = M.constant_values(model, exclude=self.wrt)

    # -- 1. what to differentiate ------------------------------------------------------
    def _outputs(self, of, loss) -> tuple[str | None, list[str]]:
        outputs = [o.name for o in self.model.graph.output]
        if loss is not None and of:
            raise UnknownNameError("give either loss= or of=, not both")
        if loss is not None:
            self._check_output(loss, "loss")
            shape = self.infos[loss].shape if loss in self.infos else None
            if shape is not None and any(d != 1 for d in shape):
                raise UnknownNameError(
                    f"loss '{loss}' has shape {list(shape)}, not a scalar; use of=['{loss}'] to seed it")
            return loss, []
        if of:
            for name in of:
                self._check_output(name, "of")
            return None, list(dict.fromkeys(of))
        floats = [o for o in outputs if M.is_float(self.infos.get(o))]
        if not floats:
            raise UnknownNameError("the model has no floating-point output to differentiate")
        if len(floats) == 1:
            shape = self.infos.get(floats[0], TensorInfo()).shape
            if shape is not None and all(d == 1 for d in shape):
                return floats[0], []
        return None, floats

    def _check_output(self, name: str, what: str) -> None:
        outputs = [o.name for o in self.model.graph.output]
        if name not in outputs:
            raise UnknownNameError(
                f"{what} '{name}' is not an output of the model (outputs: {', '.join(outputs)})")
        if not M.is_float(self.infos.get(name)):
            raise NonFloatError(f"{what} '{name}' is not a floating-point tensor; only float outputs have gradients")

    def _wrt(self, wrt) -> list[str]:
        if wrt is None:
            from .params import parameters, restore_ties

            report = parameters(self.model, loss=self.loss, of=self.of or None, strict_tags=self.strict, _pass=self)
            if any(p.tied_to for p in report):       # tied copies are computed from their parameter
                self.model = restore_ties(self.model, report)
                self.nodes = list(self.model.graph.node)
                self.producer = {o: node for node in self.nodes for o in node.output if o}
                self.reach = G.gradient_reach(self.nodes, self.targets, self.opset, self.infos, self.strict,
                                              self._positions)
            return report.trainable
        for name in wrt:
            if name not in self.known:
                raise UnknownNameError(
                    f"wrt '{name}' is not a graph input, initializer or node output of the model")
            if not M.is_float(self.infos.get(name)):
                dtype = helper.tensor_dtype_to_string(self.infos[name].dtype)
                raise NonFloatError(f"wrt '{name}' is a {dtype} tensor; only float tensors have gradients")
        return list(dict.fromkeys(wrt))

    # -- 2. the path ---------------------------------------------------------------
    def _path(self) -> list[tuple[onnx.NodeProto, Rule, set[int]]]:
        """Nodes between wrt and the outputs, with the input positions each must differentiate."""
        requires = set(self.wrt)
        path, unsupported, reasons = [], {}, {}
        for node in self.nodes:
            rule = G.rule_of(node)
            positions = self._positions_of(node)
            needed = {i for i in positions if node.input[i] in requires}
            inner = M.subgraph_inputs(node) & requires if M.has_subgraph(node) else set()
            if not needed and not inner:
                continue
            if rule is not None and rule.stop:
                continue
            outs = [o for o in node.output if o in self.reach and M.is_float(self.infos.get(o))]
            if not outs:            # nothing downstream of this node is differentiated
                continue
            requires.update(outs)
            if rule is None:
                unsupported.setdefault(node.op_type, node.name)
                if node.domain not in ("", "ai.onnx"):
                    reasons[node.op_type] = f"custom domain '{node.domain}'"
                elif M.has_subgraph(node):
                    reasons[node.op_type] = "control flow with subgraphs"
                continue
            path.append((node, rule, needed))
        self.requires = requires
        if unsupported:
            raise UnsupportedOpError(unsupported, reasons)
        return path

    def _positions_of(self, node: onnx.NodeProto) -> tuple[int, ...]:
        return G.differentiable_positions(node, self.opset, self.strict, self._positions)

    # -- 3. the backward walk -------------------------------------------------------
    def run(self) -> onnx.ModelProto:
        path = self._path()
        for name in self.wrt:
            if name not in self.reach and not self.allow_unused:
                if name in G.dependencies(self.nodes, self.targets):
                    why = ("reaches it only through inputs that carry no gradient (a shape, an index, a "
                           "comparison, an integer cast, a stop-gradient op)")
                else:
                    why = "does not influence it"
                raise UnusedError(f"wrt '{name}' {why}: it has no gradient with respect to {self._what()}; "
                                  "pass allow_unused=True to get zeros for it")
        g = self.model.graph
        taken = set(self.known) | {o.name for o in g.output} | {n.name for n in self.nodes}
        self.names = NameScope(taken)
        root = Builder(self.opset, self.names, self.infos, "onnxgrad", "", self.constants)
        self.root = root
        self.contributions: dict[str, list[Var]] = {}
        self.total: dict[str, Var | None] = {}
        seed_inputs = self._seed(root)

        for node, rule, needed in reversed(path):
            dys = [self._gradient(o) if o in self.requires else None for o in node.output]
            if all(d is None for d in dys):
                continue
            b = root.scoped(f"{node.name}/grad", f"gradient of node '{node.name}' ({node.op_type})", node.op_type)
            grads = rule.fn(Node(node, b, dys, needed))
            self._collect(node, rule, b, grads, needed)

        grad_outputs = []
        made_here = {o for node in root.nodes for o in node.output} - set(root.shared_constants.values())
        renames: dict[str, str] = {}
        for name in self.wrt:
            out_name = self.names.fresh(f"{name}_grad")
            total = self._gradient(name)
            b = root.scoped(f"{name}_grad", f"gradient of '{name}'")
            if total is None:
                total = b.zeros_like(b.var(name))
            if total.name in made_here and total.name not in renames:
                renames[total.name] = out_name       # the node that computes it names it: no copy
            else:                                    # a seed, a forward tensor, a shared constant: copy
                root.nodes.append(helper.make_node(
                    "Identity", [total.name], [out_name], name=self.names.fresh(f"{name}_grad/Identity"),
                    doc_string=f"gradient of '{name}'"))
            grad_outputs.append(self._value_info(out_name, name))
        rename_tensors(root.nodes, renames)
        backward = G.live_nodes(root.nodes, {o.name for o in grad_outputs})
        return self._assemble(backward, seed_inputs, grad_outputs)

    def _what(self) -> str:
        return f"loss '{self.loss}'" if self.loss else "outputs " + ", ".join(f"'{o}'" for o in self.of)

    def _seed(self, b: Builder) -> list[onnx.ValueInfoProto]:
        if self.loss is not None:
            sb = b.scoped(f"{self.loss}/seed", f"dL/dL = 1 for loss '{self.loss}'")
            loss = sb.var(self.loss)
            if loss.info.static and loss.dtype is not None:
                ones = sb.const(np.ones(loss.shape), loss.dtype)
            else:
                ones = sb.zeros_like(loss) + 1.0
            self.contributions[self.loss] = [ones]
            return []
        inputs = []
        for name in self.of:
            seed = self.names.fresh(f"{name}_grad")
            inputs.append(self._value_info(seed, name))
            self.infos[seed] = self.infos.get(name, TensorInfo())
            self.contributions.setdefault(name, []).append(b.var(seed))
        return inputs

    def _gradient(self, name: str) -> Var | None:
        """The total gradient of a tensor: its single contribution, or one Sum of all of them."""
        if name in self.total:
            return self.total[name]
        parts = self.contributions.pop(name, [])
        if not parts:
            total = None
        elif len(parts) == 1:
            total = parts[0]
        else:
            owner = self.producer[name].name if name in self.producer else name
            b = self.root.scoped(f"{owner}/grad", f"sum of the gradients reaching '{name}'")
            total = b.op.Sum(*parts)
        self.total[name] = total
        return total

    def _collect(self, node: onnx.NodeProto, rule: Rule, b: Builder, grads, needed: set[int]) -> None:
        if grads is None or isinstance(grads, Var):
            grads = [grads]
        grads = list(grads)
        allowed = self._positions_of(node)
        while len(grads) > len(node.input) and grads[-1] is None:
            grads.pop()                     # trailing Nones for optional inputs the node leaves out
        if len(grads) > len(node.input):
            raise RuleError(f"rule for {node.op_type} returned {len(grads)} gradients for "
                            f"{len(node.input)} inputs (node '{node.name}')")
        for i, g in enumerate(grads):
            if g is None:
                continue
            if i not in allowed:
                raise RuleError(f"rule for {node.op_type} returned a gradient for input {i}, which its "
                                f"schema or registration marks non-differentiable (node '{node.name}')")
            if i not in needed:
                continue
            if not isinstance(g, Var):
                raise RuleError(f"rule for {node.op_type} returned {type(g).__name__} for input {i}")
            if rule.broadcast:
                g = b.unbroadcast(g, b.var(node.input[i]), source=b.var(node.output[0]))
            self.contributions.setdefault(node.input[i], []).append(g)

    # -- 4. the result -----------------------------------------------------------------
    def _value_info(self, name: str, like: str) -> onnx.ValueInfoProto:
        tp = self.types.get(like)
        if tp is not None and tp.HasField("tensor_type"):
            vi = onnx.ValueInfoProto(name=name)
            vi.type.CopyFrom(tp)
            return vi
        dtype = (self.infos.get(like) or TensorInfo()).dtype or TensorProto.FLOAT
        return helper.make_tensor_value_info(name, dtype, None)

    def _assemble(self, backward, seed_inputs, grad_outputs) -> onnx.ModelProto:
        from . import __version__

        out = onnx.ModelProto()
        out.CopyFrom(self.model)
        g = out.graph
        del g.node[:]
        g.node.extend(self.nodes)
        g.node.extend(backward)
        g.input.extend(seed_inputs)
        g.output.extend(grad_outputs)
        meta = {
            "onnxgrad.version": __version__,
            "onnxgrad.wrt": json.dumps(self.wrt),
            "onnxgrad.of": json.dumps(self.of),
            "onnxgrad.loss": json.dumps(self.loss),
            "onnxgrad.gradients": json.dumps({w: o.name for w, o in zip(self.wrt, grad_outputs)}),
            "onnxgrad.seeds": json.dumps({o: s.name for o, s in zip(self.of, seed_inputs)}),
        }
        kept = [p for p in out.metadata_props if p.key not in meta]
        del out.metadata_props[:]
        out.metadata_props.extend(kept)
        for k, v in meta.items():
            out.metadata_props.add(key=k, value=v)
        if not any(o.domain in ("", "ai.onnx") for o in out.opset_import):
            out.opset_import.add(domain="", version=self.opset)
        out.ir_version = M.emitted_ir_version(out)
        return out

