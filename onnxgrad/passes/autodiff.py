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

from ..errors import NonFloatError, RuleError, UnknownNameError, UnsupportedOpError, UnusedError, arg
from ..ir import graph as G
from ..ir import model as M
from ..ir.builder import Builder, Var
from ..ir.load import emitted_ir_version, parse
from ..ir.model import NameScope, ParsedModel, TensorInfo, rename_tensors
from ..rules.registry import Node, Rule
from . import reach as R

__all__ = ["grad"]


def grad(
    model: onnx.ModelProto | str | os.PathLike,
    wrt: Sequence[str] | str | None = None,
    of: Sequence[str] | str | None = None,
    loss: str | None = None,
    allow_unused: bool = False,
    strict_tags: bool = False,
    group: bool = False,
    target: str | None = None,
    recompute: bool = False,
) -> onnx.ModelProto:
    """Append the backward graph to ``model``; return the new model.

    ``loss``: a scalar float output, seeded with 1. ``of``: float outputs, each
    seeded by a new graph input ``<name>_grad``. Neither: the single scalar
    float output is the loss, else every float output is seeded. ``wrt``:
    tensors to differentiate (default: the model's trainable parameters, as
    :func:`onnxgrad.parameters` decides them); each gets a graph output
    ``<name>_grad``, in order, after the original outputs. ``strict_tags``: follow
    the ONNX schemas' differentiability tags only, without the gradients PyTorch
    computes beyond them (LSTM initial states, Clip bounds, GridSample's grid, ...). ``group``: each
    forward node's backward as one call of a model-local function (one node per forward node in a
    graph viewer; runtimes inline them, the values are the same). ``target``: rewrite the backward for
    a runtime (``"cpu"``, ``"cuda"``: see :mod:`onnxgrad.passes.optimize`); None keeps the canonical adjoints
    (as does ``group``, a graph for reading). ``recompute``: the backward computes cheap forward
    activations again instead of keeping them from the forward, where that frees them early (see
    :mod:`onnxgrad.passes.recompute`; not with ``group``).
    """
    # The pass allocates many small objects and frees nothing until it ends: the cyclic garbage
    # collector's passes over them would only make large graphs slower than linear.
    enabled = gc.isenabled()
    gc.disable()
    try:
        parsed = parse(model)
        if target is not None and not group:
            from .optimize import lowered

            parsed = lowered(parsed, target)
        p = _Pass(parsed, _names(wrt), _names(of), loss, allow_unused, strict_tags, group)
        out = p.run()
        if target is not None and not group:
            from .optimize import optimize

            out, _ = optimize(out, target, first=len(p.nodes), copy=False)     # the pass's own model
        if recompute and not group:
            from .recompute import recompute_activations

            out = recompute_activations(out)
        return out
    finally:
        if enabled:
            gc.enable()


def _dim_names(tp: onnx.TypeProto | None) -> dict[int, str]:
    """The symbolic dims (dim_param) of a tensor type, by axis."""
    if tp is None or not tp.HasField("tensor_type") or not tp.tensor_type.HasField("shape"):
        return {}
    return {k: d.dim_param for k, d in enumerate(tp.tensor_type.shape.dim) if d.HasField("dim_param") and d.dim_param}


def _has_shape(tp: onnx.TypeProto) -> bool:
    """A shape every dim of which is known (a value or a symbol): dims left empty are not trusted."""
    return (tp.HasField("tensor_type") and tp.tensor_type.HasField("shape")
            and all(d.dim_param or d.dim_value > 0 for d in tp.tensor_type.shape.dim))


def _names(x: Sequence[str] | str | None) -> list[str] | None:
    if x is None:
        return None
    return [x] if isinstance(x, str) else list(x)


class _Pass:
    def __init__(self, parsed: ParsedModel, wrt, of, loss, allow_unused: bool,
                 strict_tags: bool = False, group: bool = False):
        self.parsed = parsed            # the caller's working copy (grad's parse copied a proto)
        self.parsed.name_nodes()
        self.strict = strict_tags
        self.group = group
        self.report = None              # onnxgrad.parameters' report, when it was made
        self.inferred = self.parsed.inferred
        self.opset = self.parsed.opset
        self.infos, self.types = dict(self.parsed.infos), dict(self.parsed.types)   # the pass adds its own
        self.allow_unused = allow_unused
        self.objective = R.Objective(self.parsed, of, loss, self.strict)
        self.wrt = self._wrt(wrt)
        self.constants = self.parsed.constants_without(self.wrt)

    # The model differentiated (tied parameters restored, when the policy chose wrt) and what is differentiated
    # in it: read from the parsed model and the objective, which _wrt replaces and retargets together.
    @property
    def model(self) -> onnx.ModelProto:
        return self.parsed.proto

    @property
    def nodes(self) -> list[onnx.NodeProto]:
        return self.parsed.nodes

    @property
    def producer(self) -> dict[str, onnx.NodeProto]:
        return self.parsed.producer

    @property
    def known(self) -> set[str]:
        return self.parsed.known

    @property
    def loss(self) -> str | None:
        return self.objective.loss

    @property
    def of(self) -> list[str]:
        return self.objective.of

    @property
    def targets(self) -> set[str]:
        return self.objective.targets

    @property
    def reach(self) -> set[str]:
        return self.objective.reach

    # -- 1. what to differentiate ------------------------------------------------------
    def _wrt(self, wrt) -> list[str]:
        if wrt is None:
            from .params import parameters_of, restore_ties

            report = parameters_of(self.objective)
            if any(p.tied_to or p.merged_into for p in report):   # tied copies computed, merged ones split
                self.parsed = self.parsed.edited(restore_ties(self.model, report))
                self.objective.on(self.parsed)
            self.report = report
            return report.trainable
        for name in wrt:
            if name not in self.known:
                raise UnknownNameError(
                    f"wrt '{name}' is not a graph input, initializer or node output of the model")
            kind = M.container_kind(self.infos.get(name))
            if kind is not None:
                raise NonFloatError(f"wrt '{name}' is a {kind}, not a tensor; differentiate with respect to the "
                                    "tensors it is made of")
            if not M.is_float(self.infos.get(name)):
                dtype = helper.tensor_dtype_to_string(self.infos[name].dtype)
                raise NonFloatError(f"wrt '{name}' is a {dtype} tensor; only float tensors have gradients")
        return list(dict.fromkeys(wrt))

    # -- 2. the path ---------------------------------------------------------------
    def _path(self) -> list[tuple[onnx.NodeProto, Rule, set[int]]]:
        """Nodes between wrt and the outputs, with the input positions each must differentiate."""
        requires = set(self.wrt)
        path, unsupported, reasons = [], {}, {}
        self._outer_needed: dict[int, frozenset[str]] = {}     # If/Loop/Scan: outer reads needing gradients
        self._allowed: dict[int, tuple[int, ...]] = {}         # differentiable positions, by id(node)
        facts = self.objective.facts
        for node in self.nodes:
            fact = facts[id(node)]
            rule, positions, outer_reads = fact.rule, fact.positions, fact.outer_reads
            no_rule_reason = fact.no_rule_reason
            self._allowed[id(node)] = positions
            needed = {i for i in positions if node.input[i] in requires}
            inner = outer_reads & requires
            if not needed and not inner:
                continue
            if rule is not None and rule.stop:
                continue
            outs = [o for o in node.output if o in self.reach and M.is_float(self.infos.get(o))]
            if not outs:            # nothing downstream of this node is differentiated
                continue
            requires.update(outs)
            if inner:
                self._outer_needed[id(node)] = frozenset(
                    x for x in inner if M.is_float(self.infos.get(x)))
            if rule is None:
                unsupported.setdefault(node.op_type, node.name)
                if no_rule_reason is not None:
                    reasons[node.op_type] = no_rule_reason
                continue
            path.append((node, rule, needed))
        self.requires = requires
        if unsupported:
            raise UnsupportedOpError(unsupported, reasons)
        return path

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
                raise UnusedError(f"wrt '{name}' {why}: it has no gradient with respect to {self.objective.what}; "
                                  f"pass {arg('allow_unused', True)} to get zeros for it")
        g = self.model.graph
        taken = set(self.known) | {o.name for o in g.output} | {n.name for n in self.nodes}
        self.names = NameScope(taken)
        root = Builder(self.opset, self.names, self.infos, "onnxgrad", "", self.constants)
        root.int_initializers = {}
        self.root = root
        self.contributions: dict[str, list[Var]] = {}
        self.total: dict[str, Var | None] = {}
        self.renames: dict[str, str] = {}       # tensor made here -> '<forward tensor>_grad'
        self.grad_of: dict[str, str] = {}       # forward tensor -> the name of its total gradient
        seed_inputs = self._seed(root)
        self.out_names = {name: self.names.fresh(self._gradient_base(name)) for name in self.wrt}
        groups: list[tuple[onnx.NodeProto, int, int]] = []     # forward node, its backward nodes' range

        for node, rule, needed in reversed(path):
            first = len(root.nodes)
            dys = [self._gradient(o) if o in self.requires else None for o in node.output]
            if all(d is None for d in dys):
                continue
            b = root.scoped(f"{node.name}/grad", f"gradient of node '{node.name}' ({node.op_type})", node.op_type,
                            node.metadata_props)
            n = Node(node, b, dys, needed, self._outer_needed.get(id(node), frozenset()), differentiate=grad)
            grads = rule.fn(n)
            self._collect(node, rule, b, grads, needed)
            for name, g in n.outer_grads.items():      # outer-scope tensors a subgraph reads
                self.contributions.setdefault(name, []).append(g)
            groups.append((node, first, len(root.nodes)))

        grad_outputs = []
        for name in self.wrt:
            out_name = self.out_names[name]
            total = self._gradient(name)
            if total is None:
                b = root.scoped(f"{name}_grad", f"gradient of '{name}'")
                total = b.zeros_like(b.var(name))
                self._claim(name, total)
            if self.renames.get(total.name) != out_name:    # a seed, a forward tensor, another's gradient
                root.nodes.append(helper.make_node(
                    "Identity", [total.name], [out_name], name=self.names.fresh(f"{name}_grad/Identity"),
                    doc_string=f"gradient of '{name}'"))
            self.grad_of[name] = out_name
            grad_outputs.append(self._value_info(out_name, name))
        rename_tensors(root.nodes, self.renames)
        read, live = G.live(root.nodes, {o.name for o in grad_outputs})
        return self._assemble(live, read, seed_inputs, grad_outputs, groups)

    def _earlier(self) -> dict[str, str]:
        """The gradient outputs the model already has, when it is itself a gradient model."""
        for p in self.model.metadata_props:
            if p.key == "onnxgrad.gradients":
                return json.loads(p.value)
        return {}

    def _gradient_base(self, name: str) -> str:
        """``<name>_grad``; in a gradient model that has ``<name>_grad`` (or ``_grad2``, ...) already, the
        next order: ``<name>_grad2``, ``<name>_grad3`` (a Hessian-vector product of ``name``). The seed of
        a gradient output ``<name>_grad`` is ``<name>_grad_seed`` (the vector v)."""
        earlier = self._earlier().get(name)
        if earlier is None:
            return f"{name}_grad"
        order = earlier[len(f"{name}_grad"):]
        return f"{name}_grad{int(order) + 1 if order.isdigit() else 2}"

    def _seed(self, b: Builder) -> list[onnx.ValueInfoProto]:
        if self.loss is not None:
            sb = b.scoped(f"{self.loss}/seed", f"dL/dL = 1 for loss '{self.loss}'")
            loss = sb.var(self.loss)
            if loss.info.static and loss.dtype is not None:     # its own Constant: it becomes '<loss>_grad'
                ones = sb.emit("Constant", [], value=onnx.numpy_helper.from_array(
                    np.ones(loss.shape, helper.tensor_dtype_to_np_dtype(loss.dtype))))
            else:
                ones = sb.zeros_like(loss) + 1.0
            self.contributions[self.loss] = [ones]
            return []
        inputs = []
        for name in self.of:
            seed = self.names.fresh(f"{name}_seed" if name in self._earlier().values() else f"{name}_grad")
            self.grad_of[name] = seed
            inputs.append(self._value_info(seed, name, f"seed dL/d{name}: the gradient of the loss with respect "
                                                       f"to output '{name}' (grad_outputs)"))
            self.infos[seed] = self.infos.get(name, TensorInfo())
            if name in self.types:
                self.types[seed] = self.types[name]
            self.contributions.setdefault(name, []).append(b.var(seed))
        return inputs

    def _gradient(self, name: str) -> Var | None:
        """The total gradient of a tensor: its single contribution, or one Sum of all of them."""
        if name in self.total:
            return self.total[name]
        parts = self.contributions.pop(name, [])
        kind = M.container_kind(self.infos.get(name))
        if kind is not None and parts:      # a sequence or optional: not a tensor, never named '<x>_grad'
            return self._container_gradient(name, kind, parts)
        if not parts:
            total = None
        elif len(parts) == 1:
            total = parts[0]
        else:
            owner = self.producer[name].name if name in self.producer else name
            node = self.producer.get(name)
            b = self.root.scoped(f"{owner}/grad", f"sum of the gradients reaching '{name}'", "Sum",
                                 node.metadata_props if node is not None else ())
            total = b.op.Sum(*parts)
        self.total[name] = total
        if total is not None:
            self._claim(name, total)
        return total

    def _container_gradient(self, name: str, kind: str, parts: list):
        """The gradient of a sequence (a :class:`~onnxgrad.rules.sequence.SequenceGrad`, read by its producer's
        rule) or of an optional (one optional; several are summed element by element)."""
        from ..rules.sequence import accumulate

        owner = self.producer[name].name if name in self.producer else name
        b = self.root.scoped(f"{owner}/grad", f"sum of the gradients reaching '{name}'", "Sum")
        self.total[name] = total = accumulate(b, name, kind, parts)
        return total

    def _claim(self, name: str, total: Var) -> None:
        """Name the total gradient of ``name`` '<name>_grad' on the node that computes it, unless that
        tensor is not made here (a seed, a forward tensor), is a Constant, or already is the gradient
        of another tensor (a gradient passed through unchanged: Add, Identity, a same-shape Reshape)."""
        made = total.name
        renames = self.renames
        if made in renames:
            self.grad_of.setdefault(name, renames[made])
            return
        if made not in self.root.made or made in self.root.constant_names:
            return
        new = self.out_names.get(name) or self.names.fresh(f"{name}_grad")
        renames[made] = new
        self.grad_of[name] = new
        infos = self.infos
        info = infos.get(made)
        if info is None or info.shape is None or None in info.shape:
            forward = infos.get(name)
            if forward is not None and forward.shape is not None and None not in forward.shape:
                info = infos[made] = TensorInfo(forward.dtype, forward.shape)    # dL/dx has x's shape
        infos[new] = info

    def _collect(self, node: onnx.NodeProto, rule: Rule, b: Builder, grads, needed: set[int]) -> None:
        if grads is None or isinstance(grads, Var):
            grads = [grads]
        grads = list(grads)
        allowed = self._allowed[id(node)]
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
                from ..rules.sequence import SequenceGrad, Update

                if not isinstance(g, (SequenceGrad, Update)) or M.container_kind(self.infos.get(node.input[i])) is None:
                    raise RuleError(f"rule for {node.op_type} returned {type(g).__name__} for input {i}")
            elif rule.broadcast:        # a broadcasting rule's gradient has the output's shape
                g = b.unbroadcast(b.with_shape(g, b.var(node.output[0])), b.var(node.input[i]),
                                  self._not_broadcast(node, i))
            self.contributions.setdefault(node.input[i], []).append(g)

    def _not_broadcast(self, node: onnx.NodeProto, i: int) -> set[int]:
        """Axes of ``node``'s output along which its input ``i`` is not broadcast, where that input's dim is
        unknown (an export's symbolic batch axis): the output's dim there is the same symbol, or every other
        input lacks the axis or has 1 there."""
        out, mine = self.infos.get(node.output[0]), self.infos.get(node.input[i])
        if out is None or mine is None or out.shape is None or mine.shape is None or None not in mine.shape:
            return set()        # (a static input: unbroadcast decides from the dims themselves)
        rank, lead = len(out.shape), len(out.shape) - len(mine.shape)
        names = _dim_names(self.types.get(node.output[0])), _dim_names(self.types.get(node.input[i]))
        others = [self.infos.get(x) for j, x in enumerate(node.input) if j != i and x]

        def lacks_or_one(other: TensorInfo | None, axis: int) -> bool:
            if other is None or other.shape is None:
                return False
            own = axis - (rank - len(other.shape))          # the axis in the other operand, negative: it lacks it
            return own < 0 or other.shape[own] == 1

        kept = set()
        for axis in range(max(lead, 0), rank):
            if mine.shape[axis - lead] is not None:
                continue
            named = names[0].get(axis) is not None and names[0].get(axis) == names[1].get(axis - lead)
            if named or all(lacks_or_one(o, axis) for o in others):
                kept.add(axis)
        return kept

    # -- 4. the result -----------------------------------------------------------------
    def _value_info(self, name: str, like: str, doc: str = "") -> onnx.ValueInfoProto:
        """A graph input or output typed as ``like`` (its rank may still be missing: see _declare_ranks)."""
        return M.value_info_like(name, like, self.types, self.infos, doc)

    def _with_shapes(self, out: onnx.ModelProto, backward: list[onnx.NodeProto],
                     outputs: set[str]) -> onnx.ModelProto:
        """``out`` with the type and shape of every tensor in value_info. The builder recorded each
        static shape as the rules emitted (:func:`onnxgrad.ir.builder.shape_of_op`; '<x>_grad' has x's);
        '<x>_grad' keeps x's symbolic dims; where neither tells (unknown dims, ops the builder does not
        shape), onnx's shape inference runs once over the result, and a tensor it leaves unshaped keeps
        its element type alone."""
        g = out.graph
        del g.value_info[:]
        g.value_info.extend(self.inferred.graph.value_info)     # the forward's (its tensors' names are not new)
        infos = self.infos
        grad_of = {gname: x for x, gname in self.grad_of.items() if x in self.types}
        unknown, typed = [], []
        types: dict[tuple, onnx.TypeProto] = {}          # one TypeProto per (type, shape)
        no_info = TensorInfo()
        added = [o for node in self.nodes for o in node.output       # forward outputs a rule added, typed (Loop)
                 if o and o not in self.types and o in infos and infos[o].dtype and infos[o].shape is not None]
        for name in added + [o for node in backward for o in node.output]:
            if not name or name in outputs:
                continue
            info = infos.get(name, no_info)
            shape, dtype = info.shape, info.dtype
            if shape is None or dtype is None or None in shape:     # partial: x's symbolic dims
                x = grad_of.get(name)
                if x is not None and _has_shape(self.types[x]):
                    typed.append((name, self.types[x]))              # symbolic dims kept
                else:
                    unknown.append(name)
                continue
            tp = types.get((dtype, shape))
            if tp is None:
                tp = types[(dtype, shape)] = helper.make_tensor_type_proto(dtype, shape)
            typed.append((name, tp))
        M.add_value_infos(g, typed)
        if not unknown:
            return out
        out.ir_version = emitted_ir_version(out)    # below IR 4, inference reads no initializer's value
        inferred = M.infer(out)     # onnx's shape inference, ranks its readers imply where it finds none
        del g.value_info[:]         # (inferred on a skeleton: its types, not its initializers)
        g.value_info.extend(inferred.graph.value_info)
        for mine, theirs in zip(g.output, inferred.graph.output):
            mine.type.CopyFrom(theirs.type)
        ranked = set(added)         # a rule's own forward outputs keep the rank it gave them (a Loop's stored state)
        for vi in g.value_info:
            info = infos.get(vi.name)
            if vi.name in ranked and not _has_shape(vi.type) and info is not None and info.shape is not None:
                vi.CopyFrom(helper.make_tensor_value_info(vi.name, vi.type.tensor_type.elem_type, info.shape))
        found = {vi.name for vi in g.value_info}
        out.graph.value_info.extend(
            helper.make_tensor_value_info(name, (infos.get(name) or TensorInfo()).dtype or TensorProto.UNDEFINED,
                                          (infos.get(name) or TensorInfo()).shape if name in ranked else None)
            for name in unknown if name not in found)
        return out

    def _torch_names(self) -> dict[str, str]:
        """PyTorch's names of the wrt initializers, where the exporter recorded them (folded ones too): from
        the policy's report when the pass made one, else from the metadata alone (the values of parameters
        held aside by a training build are not there to read)."""
        from .params import recorded_torch_names

        names = ({p.name: p.torch_name for p in self.report if p.torch_name} if self.report is not None
                 else recorded_torch_names(self.model))
        return {k: v for k, v in names.items() if v != k}

    def _assemble(self, backward, read, seed_inputs, grad_outputs, groups) -> onnx.ModelProto:
        from ..version import __version__

        out = onnx.ModelProto()
        out.CopyFrom(self.model)
        g = out.graph
        torch_names = self._torch_names()
        what = self.objective.what
        for name, vi in zip(self.wrt, grad_outputs):
            torch = f" (PyTorch '{torch_names[name]}')" if name in torch_names else ""
            vi.doc_string = f"dL/d{name}{torch}: the gradient of {what} with respect to '{name}'"
            vi.metadata_props.add(key="onnxgrad.gradient_of", value=name)
            if torch:
                vi.metadata_props.add(key="onnxgrad.torch_name", value=torch_names[name])
        out_names = {o.name for o in grad_outputs}
        g.node.extend(backward)             # after the forward's nodes (self.nodes are self.model's, copied)
        g.input.extend(seed_inputs)
        g.output.extend(grad_outputs)
        g.initializer.extend(t for t in self.root.int_initializers.values() if t.name in read)
        out = self._with_shapes(out, backward, out_names)
        g = out.graph
        _declare_ranks(out, seed_inputs, grad_outputs)
        if self.group:
            from ..ir.grouping import group_backward

            first = len(self.nodes)
            members = {id(n): fwd for fwd, start, end in groups for n in self.root.nodes[start:end]}
            owners = [members.get(id(n)) for n in backward]      # the nodes of g.node[first:], in order
            nodes, functions, shapes = group_backward(list(g.node[first:]), owners, out_names,
                                                      list(g.value_info), self.opset)
            del g.node[first:]
            g.node.extend(nodes)
            del g.value_info[:]
            g.value_info.extend(shapes)
            out.functions.extend(functions)
            out.opset_import.add(domain=functions[0].domain if functions else "onnxgrad.grad", version=1)
        meta = {
            "onnxgrad.version": __version__,
            "onnxgrad.wrt": json.dumps(self.wrt),
            "onnxgrad.of": json.dumps(self.of),
            "onnxgrad.loss": json.dumps(self.loss),
            "onnxgrad.gradients": json.dumps({w: o.name for w, o in zip(self.wrt, grad_outputs)}),
            "onnxgrad.seeds": json.dumps({o: s.name for o, s in zip(self.of, seed_inputs)}),
            "onnxgrad.forward_nodes": str(len(self.nodes)),
        }
        M.set_metadata(out, meta)
        if not any(o.domain in ("", "ai.onnx") for o in out.opset_import):
            out.opset_import.add(domain="", version=self.opset)
        out.ir_version = emitted_ir_version(out)
        if self.group:
            out.ir_version = max(out.ir_version, 10)        # function overloads
        return out


def _declare_ranks(model: onnx.ModelProto, seeds, gradients) -> None:
    """Seed inputs and gradient outputs need a rank (onnx's checker refuses graph inputs and outputs
    without one). One the forward model could not give (a tensor after a custom op) is taken from the
    shapes found for the backward; a tensor whose rank nothing tells is refused, naming it."""
    g = model.graph
    new = {vi.name for vi in list(seeds) + list(gradients)}
    missing = [vi for vi in list(g.input) + list(g.output)
               if vi.name in new and not vi.type.tensor_type.HasField("shape")]
    if not missing:
        return
    inferred = M.infer(model).graph         # the backward's readers may tell what the forward could not
    found = {vi.name: vi.type for vi in list(g.value_info) + list(inferred.value_info) + list(inferred.output)
             if vi.type.tensor_type.HasField("shape")}
    for vi in missing:
        if vi.name in found:
            vi.type.tensor_type.shape.CopyFrom(found[vi.name].tensor_type.shape)
            continue
        raise UnknownNameError(
            f"the rank of '{vi.name}' cannot be found (shape inference cannot tell the rank of the tensor it "
            "belongs to), so it cannot be declared as a graph input or output; declare that tensor's shape "
            "in the model's value_info, or choose a tensor of known rank")
