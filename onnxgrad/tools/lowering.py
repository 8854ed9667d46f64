"""Lower ``ai.onnx.preview.training`` ops (Gradient, Adagrad, Adam, Momentum) to standard ai.onnx ops.

Stock onnxruntime has no kernels for that domain. :func:`lower` replaces

- ``Gradient(xs, zs, y)`` by the backward graph onnxgrad builds for the
  subgraph that computes ``y`` from ``xs`` and ``zs`` (seeded with ones, as the
  operator's reference implementation does);
- ``Adagrad``, ``Adam`` and ``Momentum`` by their update formulas from the
  operator specifications (elementwise ops on each (X, G, state) group).

The result imports ai.onnx at a version onnxruntime loads (13..26: older
models are upgraded with onnx's version converter, a model with no ai.onnx
import gets :data:`DEFAULT_OPSET`), no longer imports the training domain, and
has an IR version the runtime reads.
"""
from __future__ import annotations

import os
from typing import Sequence

import numpy as np
import onnx
import onnx.version_converter
from onnx import TensorProto, helper

from ..errors import InvalidModelError, UnsupportedOpError
from ..ir import model as M
from ..ir.builder import Builder, Var
from ..ir.graph import live_nodes
from ..ir.load import MIN_OPSET, RUNTIME_MAX_OPSET, emitted_ir_version, load
from ..ir.model import NameScope, TensorInfo
from ..passes.autodiff import grad
from ..passes.record import gradient_spec

__all__ = ["lower", "TRAINING_DOMAIN", "DEFAULT_OPSET"]

TRAINING_DOMAIN = "ai.onnx.preview.training"
DEFAULT_OPSET = 18   # for models that import no ai.onnx opset (e.g. a lone Adam node)


def lower(model: onnx.ModelProto | str | os.PathLike) -> onnx.ModelProto:
    """A copy of ``model`` where every ai.onnx.preview.training node is replaced by standard ops."""
    m = load(model)             # read, checked, opsets below 13 upgraded
    m = _at_runtime_opset(m)
    return _Lowering(m).run()


# -- reading and versions -------------------------------------------------------------------------------
def _ai_onnx_version(m: onnx.ModelProto) -> int | None:
    for o in m.opset_import:
        if o.domain in ("", "ai.onnx"):
            return o.version
    return None


def _at_runtime_opset(m: onnx.ModelProto) -> onnx.ModelProto:
    """The model at an ai.onnx opset in [13, RUNTIME_MAX_OPSET] (the pass and onnxruntime both take it)."""
    version = _ai_onnx_version(m)
    if version is None:
        m.opset_import.add(domain="", version=DEFAULT_OPSET)
        return m
    target = min(max(version, MIN_OPSET), RUNTIME_MAX_OPSET)
    if target == version:
        return m
    try:
        return onnx.version_converter.convert_version(m, target)
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise InvalidModelError(f"the model uses ai.onnx opset {version}; onnx's version converter cannot bring "
                                f"it to {target}, which onnxruntime loads: {first}") from None


# -- the lowering -------------------------------------------------------------------------------------------
class _Lowering:
    def __init__(self, m: onnx.ModelProto):
        self.m = m
        self.g = m.graph
        self.opset = _ai_onnx_version(m)
        g = self.g
        self.names = NameScope({i.name for i in g.input} | {i.name for i in g.initializer}
                               | {o.name for o in g.output} | {o for n in g.node for o in n.output}
                               | {n.name for n in g.node} | {x for n in g.node for x in n.input})
        self.done: list[onnx.NodeProto] = []

    def run(self) -> onnx.ModelProto:
        for i, node in enumerate(self.g.node):
            if _nested_training_op(node):
                raise UnsupportedOpError({node.op_type: node.name or f"#{i}"},
                                         {node.op_type: f"a subgraph of it uses {TRAINING_DOMAIN} ops; "
                                                        "only top-level nodes are lowered"})
            if node.domain != TRAINING_DOMAIN:
                self.done.append(node)
                continue
            lower_one = {"Gradient": self._gradient, "Adagrad": self._adagrad, "Adam": self._adam,
                         "Momentum": self._momentum}.get(node.op_type)
            if lower_one is None:
                raise UnsupportedOpError({node.op_type: node.name or f"#{i}"},
                                         {node.op_type: f"no lowering for {TRAINING_DOMAIN}.{node.op_type}"})
            lower_one(node, i)
        del self.g.node[:]
        self.g.node.extend(self.done)
        kept = [o for o in self.m.opset_import if o.domain != TRAINING_DOMAIN]
        del self.m.opset_import[:]
        self.m.opset_import.extend(kept)
        self.m.ir_version = emitted_ir_version(self.m)
        return self.m

    # -- shared --------------------------------------------------------------------------------------------
    def _infos(self, names: Sequence[str]) -> tuple[dict[str, TensorInfo], dict[str, onnx.TypeProto]]:
        """Types of ``names`` in the graph lowered so far (shape inference over a temporary model)."""
        tmp = onnx.ModelProto()
        tmp.CopyFrom(self.m)
        del tmp.graph.node[:]
        tmp.graph.node.extend(self.done)
        del tmp.graph.output[:]     # every tensor then gets a value_info from inference
        kept = [o for o in tmp.opset_import if o.domain != TRAINING_DOMAIN]
        del tmp.opset_import[:]
        tmp.opset_import.extend(kept)
        return M.tensor_infos(M.infer(tmp))

    def _builder(self, node: onnx.NodeProto, index: int, infos: dict[str, TensorInfo]) -> Builder:
        label = node.name or f"{node.op_type}_{index}"
        return Builder(self.opset, self.names, infos, prefix=f"{label}/lowered",
                       doc=f"{TRAINING_DOMAIN}.{node.op_type} '{label}' in standard ops")

    def _emit(self, b: Builder, results: dict[str, Var]) -> None:
        """Append b's nodes, making each result available under its output name."""
        for name, value in results.items():
            if name:
                b.name_as(value, name)
        self.done.extend(b.nodes)

    @staticmethod
    def _groups(node: onnx.NodeProto, per: int) -> tuple[str, str, list[list[str]]]:
        """R, T and the per-tensor input groups (X, G, state...) of an optimizer node."""
        rest = list(node.input[2:])
        if len(rest) % per:
            raise InvalidModelError(f"{node.op_type} node '{node.name}' has {len(node.input)} inputs; expected "
                                    f"2 + {per} x (number of optimized tensors)")
        n = len(rest) // per
        return node.input[0], node.input[1], [[rest[k * n + i] for k in range(per)] for i in range(n)]

    @staticmethod
    def _attrs(node: onnx.NodeProto, defaults: dict) -> dict:
        """Attribute values; absent ones take the schema's default (a float32, as a present one would be)."""
        attrs = dict(defaults)
        schema = onnx.defs.get_schema(node.op_type, 1, TRAINING_DOMAIN)
        for name in attrs:
            default = schema.attributes[name].default_value if name in schema.attributes else None
            if default is not None and default.name:
                attrs[name] = helper.get_attribute_value(default)
        for a in node.attribute:
            v = helper.get_attribute_value(a)
            attrs[a.name] = v.decode() if isinstance(v, bytes) else v
        missing = [k for k, v in attrs.items() if v is None]
        if missing:
            raise InvalidModelError(f"{node.op_type} node '{node.name}' lacks attribute(s) {', '.join(missing)}")
        return attrs

    @staticmethod
    def _like(b: Builder, v: Var, like: Var) -> Var:
        """v in like's element type."""
        if v.dtype is not None and v.dtype == like.dtype:
            return v
        if like.dtype is not None:
            return b.op.Cast(v, to=like.dtype)
        return b.op.CastLike(v, like)

    # -- optimizers (formulas from the ai.onnx.preview.training specifications) --------------------------------
    def _adagrad(self, node: onnx.NodeProto, index: int) -> None:
        """r = R / (1 + T decay); g = norm X + G; H' = H + g^2; X' = X - r g / (sqrt(H') + epsilon)"""
        a = self._attrs(node, {"decay_factor": 0.0, "epsilon": 1e-6, "norm_coefficient": 0.0})
        R, T, groups = self._groups(node, 3)
        infos, _ = self._infos([R] + [x for grp in groups for x in grp])
        b = self._builder(node, index, infos)
        r = b.var(R)
        rate = r / (1.0 + b.op.Cast(b.var(T), to=r.dtype or TensorProto.FLOAT) * a["decay_factor"])
        outs: dict[str, Var] = {}
        n = len(groups)
        for i, (X, G, H) in enumerate(groups):
            x, g, h = b.var(X), b.var(G), b.var(H)
            g = _regularized(x, g, a["norm_coefficient"])
            h_new = h + g * g
            x_new = x - (self._like(b, rate, x) * g) / (b.op.Sqrt(h_new) + a["epsilon"])
            outs[_out(node, i)] = x_new
            outs[_out(node, n + i)] = h_new
        self._emit(b, outs)

    def _momentum(self, node: onnx.NodeProto, index: int) -> None:
        """g = norm X + G; V' = alpha V + beta' g (beta' = 1 at T = 0);
        X' = X - R V' (standard) or X - R (g + alpha V') (nesterov)"""
        a = self._attrs(node, {"alpha": None, "beta": None, "mode": None, "norm_coefficient": None})
        if a["mode"] not in ("standard", "nesterov"):
            raise InvalidModelError(f"Momentum node '{node.name}': mode must be 'standard' or 'nesterov', "
                                    f"got '{a['mode']}'")
        R, T, groups = self._groups(node, 3)
        infos, _ = self._infos([R] + [x for grp in groups for x in grp])
        b = self._builder(node, index, infos)
        started = b.op.Greater(b.var(T), b.const(np.array(0, np.int64)))
        outs: dict[str, Var] = {}
        n = len(groups)
        for i, (X, G, V) in enumerate(groups):
            x, g, v = b.var(X), b.var(G), b.var(V)
            beta = b.op.Where(started, b.scalar(a["beta"], x), b.scalar(1.0, x))
            g = _regularized(x, g, a["norm_coefficient"])
            v_new = a["alpha"] * v + beta * g
            r = self._like(b, b.var(R), x)
            step = v_new if a["mode"] == "standard" else g + a["alpha"] * v_new
            outs[_out(node, i)] = x - r * step
            outs[_out(node, n + i)] = v_new
        self._emit(b, outs)

    def _adam(self, node: onnx.NodeProto, index: int) -> None:
        """g = norm X + G; V' = alpha V + (1 - alpha) g; H' = beta H + (1 - beta) g^2;
        R' = R sqrt(1 - beta^T) / (1 - alpha^T) (R at T = 0); X' = (1 - norm_post) (X - R' V' / (sqrt(H') + epsilon))"""
        a = self._attrs(node, {"alpha": 0.9, "beta": 0.999, "epsilon": 1e-6, "norm_coefficient": 0.0,
                               "norm_coefficient_post": 0.0})
        R, T, groups = self._groups(node, 4)
        infos, _ = self._infos([R] + [x for grp in groups for x in grp])
        b = self._builder(node, index, infos)
        r = b.var(R)
        t = b.op.Cast(b.var(T), to=r.dtype or TensorProto.FLOAT)
        corrected = r * b.op.Sqrt(1.0 - b.op.Pow(b.scalar(a["beta"], r), t)) / (
            1.0 - b.op.Pow(b.scalar(a["alpha"], r), t))
        started = b.op.Greater(b.var(T), b.const(np.array(0, np.int64)))
        rate = b.op.Where(started, corrected, r)
        outs: dict[str, Var] = {}
        n = len(groups)
        for i, (X, G, V, H) in enumerate(groups):
            x, g, v, h = b.var(X), b.var(G), b.var(V), b.var(H)
            g = _regularized(x, g, a["norm_coefficient"])
            v_new = a["alpha"] * v + (1.0 - a["alpha"]) * g
            h_new = a["beta"] * h + (1.0 - a["beta"]) * (g * g)
            x_new = x - self._like(b, rate, x) * (v_new / (b.op.Sqrt(h_new) + a["epsilon"]))
            if a["norm_coefficient_post"]:
                x_new = (1.0 - a["norm_coefficient_post"]) * x_new
            outs[_out(node, i)] = x_new
            outs[_out(node, n + i)] = v_new
            outs[_out(node, 2 * n + i)] = h_new
        self._emit(b, outs)

    # -- Gradient -----------------------------------------------------------------------------------------------
    def _gradient(self, node: onnx.NodeProto, index: int) -> None:
        """Differentiate the subgraph computing y from xs (and zs) with onnxgrad.grad; seed y with ones."""
        label = node.name or f"Gradient_{index}"
        a = self._attrs(node, {"xs": None, "y": None, "zs": []})
        xs = [s.decode() if isinstance(s, bytes) else s for s in a["xs"]]
        zs = [s.decode() if isinstance(s, bytes) else s for s in a["zs"]]
        y = a["y"]
        leaves = xs + zs
        if len(node.input) != len(leaves):
            raise InvalidModelError(f"Gradient node '{label}' has {len(node.input)} inputs for "
                                    f"{len(leaves)} names in xs and zs")
        if len(node.output) > len(xs):
            raise InvalidModelError(f"Gradient node '{label}' has {len(node.output)} outputs for {len(xs)} xs")
        cone = live_nodes(self.done, [y], cut=leaves)
        free = _free_names(cone, set(leaves))
        infos, types = self._infos(leaves + free + [y])
        wanted = [x for k, x in enumerate(xs) if k < len(node.output) and node.output[k]]

        # the sub-model: leaves and free tensors as inputs (initializers stay constants), y as output
        inits = {i.name: i for i in self.g.initializer}
        sub_inputs, sub_inits = [], []
        for name in dict.fromkeys(leaves + free):
            if name in inits and name not in leaves:
                sub_inits.append(inits[name])
                continue
            tp = types.get(name)
            if tp is None or not tp.HasField("tensor_type"):
                raise InvalidModelError(f"Gradient node '{label}': the type of '{name}' is unknown")
            vi = onnx.ValueInfoProto(name=name)
            vi.type.CopyFrom(tp)
            sub_inputs.append(vi)
        y_vi = onnx.ValueInfoProto(name=y)
        if y in types:
            y_vi.type.CopyFrom(types[y])
        sub = helper.make_model(
            helper.make_graph([_copy(n) for n in cone], f"{label}_subgraph", sub_inputs, [y_vi], sub_inits),
            opset_imports=[helper.make_opsetid("", self.opset)])
        sub.ir_version = emitted_ir_version(sub)
        gm = grad(sub, wrt=wanted, of=[y], allow_unused=True)
        spec = gradient_spec(gm)

        # rename everything the pass made; leaves read the Gradient node's inputs
        sub_names = ({i.name for i in sub.graph.input} | {i.name for i in sub.graph.initializer}
                     | {o for n in cone for o in n.output if o})
        recompute = any(node.input[k] != leaves[k] for k in range(len(leaves)))
        mapping: dict[str, str] = {}
        if recompute:   # evaluate the subgraph again at the given input values
            mapping.update({leaf: node.input[k] for k, leaf in enumerate(leaves)})
            mapping.update({o: self.names.fresh(f"{label}/{o}") for n in cone for o in n.output if o})
        grad_outputs = {spec["gradients"][x]: node.output[xs.index(x)] for x in wanted}
        b = self._builder(node, index, infos)
        seed_name = spec["seeds"][y]
        y_var = b.var(mapping.get(y, y))
        ones = b.fill_like(y_var, 1.0)
        mapping[seed_name] = ones.name

        def rename(name: str) -> str:
            if not name:
                return name
            if name not in mapping:
                if name in grad_outputs:
                    mapping[name] = grad_outputs[name]
                elif name in sub_names:
                    mapping[name] = name
                else:
                    mapping[name] = self.names.fresh(f"{label}/{name}")
            return mapping[name]

        forward, backward = gm.graph.node[:len(cone)], gm.graph.node[len(cone):]
        for original, fnode in zip(cone, forward):
            added = len(fnode.output) > len(original.output) or list(fnode.output) != list(original.output)
            if recompute:
                copy = _copy(fnode, rename)
                copy.name = self.names.fresh(f"{label}/{fnode.name or fnode.op_type}")
                b.nodes.append(copy)
            elif added:   # a rule exposed an extra output of a forward node (e.g. a mask): keep it
                original.CopyFrom(_copy(fnode, rename, name=original.name))
        for bnode in backward:
            copy = _copy(bnode, rename)
            copy.name = self.names.fresh(f"{label}/{bnode.name}")
            b.nodes.append(copy)
        for init in gm.graph.initializer:
            if init.name not in sub_names:
                t = onnx.TensorProto()
                t.CopyFrom(init)
                t.name = rename(init.name)
                self.g.initializer.append(t)
        self.done.extend(b.nodes)


# -- helpers ------------------------------------------------------------------------------------------------------
def _regularized(x: Var, g: Var, norm: float) -> Var:
    """norm * X + G (just G when norm is 0)."""
    return g if not norm else norm * x + g


def _out(node: onnx.NodeProto, i: int) -> str:
    return node.output[i] if i < len(node.output) else ""


def _copy(node: onnx.NodeProto, rename=None, name: str | None = None) -> onnx.NodeProto:
    c = onnx.NodeProto()
    c.CopyFrom(node)
    if rename is not None:
        for k, x in enumerate(c.input):
            c.input[k] = rename(x)
        for k, y in enumerate(c.output):
            c.output[k] = rename(y)
    if name is not None:
        c.name = name
    return c


def _free_names(cone: Sequence[onnx.NodeProto], leaves: set[str]) -> list[str]:
    """Tensors the cone reads that it neither computes nor takes as leaves (graph inputs, initializers...)."""
    made = {o for n in cone for o in n.output if o}
    free = []
    for n in cone:
        for x in list(n.input) + sorted(M.subgraph_inputs(n)):
            if x and x not in made and x not in leaves and x not in free:
                free.append(x)
    return free


def _nested_training_op(node: onnx.NodeProto) -> bool:
    for a in node.attribute:
        graphs = [a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)
        for sg in graphs:
            for n in sg.node:
                if n.domain == TRAINING_DOMAIN or _nested_training_op(n):
                    return True
    return False
