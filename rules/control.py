"""If, Loop, Scan: gradients through control flow, as control flow of the same kind.

A body is differentiated by the pass itself: the body becomes a small model (its formal inputs and
the outer-scope tensors it reads are graph inputs, its outputs are graph outputs), ``grad`` gives
its vector-Jacobian product graph, and that graph is renamed into the outer model as the body of
the backward node. Outer-scope tensors a body reads are extra differentiable inputs of the node:
their gradients leave the backward node as extra outputs (``n.outer_grads``).

- **If**: ``If(cond)`` again; each branch holds its branch's VJP (the branch's forward recomputed
  inside it) and returns the gradients of every outer tensor either branch reads that needs one,
  zeros where this branch does not read it. An If whose condition is known at build time (integer and
  boolean values folded from constants: ``M.constant_values``) is differentiated as the branch it takes,
  inlined, with no If: the other branch never runs, and may not even be valid at the model's shapes.
- **Scan** / **Loop**: the forward node also emits, as extra scan outputs, the body inputs its VJP
  reads at each iteration (the loop-carried state, the iteration number); nothing else is stored,
  the rest of one step is recomputed from them in the backward step. The backward node runs the
  same number of iterations in reverse (a Scan over the stored sequences with reversed directions;
  a Loop of ``T`` trips that reads iteration ``T-1-k`` with Gather), carrying the state gradients
  and summing the gradients of the outer tensors the body reads.

The backward nodes are made of If/Loop/Scan and ops with rules, so ``grad(grad(m))`` works too.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from onnxgrad.ir import graph as G
from onnxgrad.ir import model as M
from onnxgrad.ir.builder import Builder, Var
from onnxgrad.ir.load import emitted_ir_version
from onnxgrad.ir.model import FLOAT_TYPES, NameScope, TensorInfo

from .registry import Node, register


# -- names -------------------------------------------------------------------------------
def _renamed_node(node: onnx.NodeProto, env: dict[str, str], names: NameScope, prefix: str) -> onnx.NodeProto:
    """A copy of ``node`` reading ``env``'s names, writing fresh ones (recorded in ``env``)."""
    new = onnx.NodeProto()
    new.CopyFrom(node)
    new.name = names.fresh(f"{prefix}/{node.op_type}")
    new.input[:] = [env.get(x, x) for x in node.input]
    for a in new.attribute:
        if a.type == onnx.AttributeProto.GRAPH:
            a.g.CopyFrom(_renamed_graph(a.g, env, names, prefix))
        elif a.type == onnx.AttributeProto.GRAPHS:
            for g in a.graphs:
                g.CopyFrom(_renamed_graph(g, env, names, prefix))
    outs = []
    for o in node.output:
        if o:
            env[o] = names.fresh(o)
        outs.append(env.get(o, "") if o else "")
    new.output[:] = outs
    return new


def _renamed_graph(g: onnx.GraphProto, env: dict[str, str], names: NameScope, prefix: str) -> onnx.GraphProto:
    """A copy of a subgraph whose every defined name is fresh (outer reads follow ``env``)."""
    env = dict(env)
    new = onnx.GraphProto(name=names.fresh(g.name or "body"))
    for vi in g.input:
        env[vi.name] = names.fresh(vi.name)
        new.input.add().CopyFrom(vi)
        new.input[-1].name = env[vi.name]
    for t in g.initializer:
        env[t.name] = names.fresh(t.name)
        new.initializer.add().CopyFrom(t)
        new.initializer[-1].name = env[t.name]
    new.node.extend(_renamed_node(node, env, names, prefix) for node in g.node)
    for vi in g.output:
        new.output.add().CopyFrom(vi)
        new.output[-1].name = env.get(vi.name, vi.name)
    for vi in g.value_info:
        if vi.name in env:
            new.value_info.add().CopyFrom(vi)
            new.value_info[-1].name = env[vi.name]
    return new


# -- types -------------------------------------------------------------------------------
def _value_info(name: str, info: TensorInfo | None) -> onnx.ValueInfoProto:
    dtype = info.dtype if info is not None and info.dtype is not None else TensorProto.UNDEFINED
    shape = list(info.shape) if info is not None and info.shape is not None else None
    return helper.make_tensor_value_info(name, dtype, shape)


def _without_axis(info: TensorInfo, axis: int) -> TensorInfo:
    if info.shape is None:
        return TensorInfo(info.dtype, None)
    return TensorInfo(info.dtype, info.shape[:axis] + info.shape[axis + 1:])


def _with_axis(info: TensorInfo, axis: int, n: int | None) -> TensorInfo:
    if info.shape is None:
        return TensorInfo(info.dtype, None)
    return TensorInfo(info.dtype, info.shape[:axis] + (n,) + info.shape[axis:])


def _is_float(info: TensorInfo | None) -> bool:
    return info is not None and info.dtype in FLOAT_TYPES


# -- a body's vector-Jacobian product ----------------------------------------------------
@dataclass
class _VJP:
    graph: onnx.GraphProto          # the VJP model's graph: body inputs, outer reads and seeds in
    seeds: dict[str, str]           # body output -> its seed input
    grads: dict[str, str]           # body input or outer tensor -> its gradient output
    outer: set[str]                 # the outer-scope names the body reads
    changing: set[int]              # positions of the carried body inputs whose shape the body may change

    def reads(self, names: list[str]) -> set[str]:
        """Which of these inputs the gradients depend on."""
        return G.dependencies(self.nodes(), list(self.grads.values())) & set(names)

    def nodes(self) -> list[onnx.NodeProto]:
        return G.live_nodes(list(self.graph.node), list(self.grads.values()))

    def inline(self, sb: Builder, env: dict[str, str]) -> dict[str, str]:
        """Append the VJP's live nodes to ``sb`` with fresh names; ``env`` maps its inputs (body inputs,
        seeds) to the names they have there, outer reads keep theirs. Returns the gradients' names."""
        env = dict(env)
        live = self.nodes()
        used = G.dependencies(live, list(self.grads.values()))
        for t in self.graph.initializer:       # the pass's int64 constants; outer constants stay outer
            if t.name in used and t.name not in env and t.name not in self.outer:
                env[t.name] = sb.names.fresh(t.name)
                sb.nodes.append(helper.make_node("Constant", [], [env[t.name]], name=sb.names.fresh(
                    f"{sb.prefix}/Constant"), value=t))
        for node in live:
            sb.nodes.append(_renamed_node(node, env, sb.names, sb.prefix))
        return {x: env.get(g, g) for x, g in self.grads.items()}


def _body_vjp(n: Node, body: onnx.GraphProto, input_infos: list[TensorInfo], wrt: list[str],
              of: list[int], states: list[tuple[int, int]] = (), output_infos: list[TensorInfo] = ()) -> _VJP:
    """The VJP of ``body`` with respect to ``wrt`` (its inputs or outer tensors) seeded at its outputs at
    positions ``of``. ``input_infos`` types the body's inputs where the body does not, ``output_infos`` its
    outputs where neither the body nor inference does (an If's branch outputs: the If's outputs, whose
    ranks the outer model's readers may tell); ``states``: pairs (input, output) of loop-carried values,
    whose static shapes are trusted only if the body keeps them."""
    outer = sorted(M.subgraph_inputs(_holder(body)))
    taken = M.defined_names(body) | set(outer)
    n.b.names.taken |= taken          # no name made outside may shadow one of the body's
    local = NameScope(taken)
    infos = [_declared(vi, info) for vi, info in zip(body.input, input_infos)]
    changing = _changing_states(n, body, infos, outer, states, local)
    for i in changing:          # its dims are not static: the VJP reads them at run time
        infos[i] = TensorInfo(infos[i].dtype, (None,) * len(infos[i].shape))
    model, outs = _body_model(n, body, infos, outer, set(wrt), local)
    inferred = M.tensor_infos(M.infer(model))[0]
    for k, vi in enumerate(model.graph.output):
        if not vi.type.tensor_type.elem_type and vi.name in inferred:
            vi.CopyFrom(_value_info(vi.name, inferred[vi.name]))
        told = output_infos[k] if k < len(output_infos) else None
        if not vi.type.tensor_type.HasField("shape") and told is not None and told.shape is not None:
            vi.CopyFrom(_value_info(vi.name, TensorInfo(vi.type.tensor_type.elem_type or told.dtype, told.shape)))
    of_names = [outs[k] for k in of]
    for k, name in zip(of, of_names):
        if not _is_float(inferred.get(name)):
            n.decline(f"output {k} of the body of node '{n.name}' has no known float type")
    gm = n.differentiate(model, wrt=list(wrt), of=of_names, allow_unused=True)
    meta = {p.key: p.value for p in gm.metadata_props}
    seeds = json.loads(meta["onnxgrad.seeds"])
    grads = json.loads(meta["onnxgrad.gradients"])
    by_output = {body.output[k].name: seeds[outs[k]] for k in of}
    return _VJP(gm.graph, by_output, {x: grads[x] for x in wrt}, set(outer), changing)


def _changing_states(n: Node, body: onnx.GraphProto, infos: list[TensorInfo], outer: list[str],
                     states: list[tuple[int, int]], local: NameScope) -> set[int]:
    """The carried body inputs (of the pairs (input, output) ``states``) whose shape the body may change:
    those whose output shape inference does not prove the same, every unknown dim a symbol of its own
    (Concat(s, row) grows s: [2, 3] -> [3, 3], [N, 3] -> [?, 3]). Only the body's ops decide: its declared
    output and inner types are left out, a declaration may hold the first iteration's dims."""
    if not states:
        return set()
    typed = list(infos)
    for i, _ in states:
        if infos[i].shape is not None:
            typed[i] = TensorInfo(infos[i].dtype, tuple(f"onnxgrad_{i}_{k}" if d is None else d
                                                        for k, d in enumerate(infos[i].shape)))
    model, outs = _body_model(n, body, typed, outer, set(), NameScope(local.taken))
    for vi in model.graph.output:
        vi.CopyFrom(helper.make_empty_tensor_value_info(vi.name))
    del model.graph.value_info[:]
    types = M.tensor_infos(M.infer(model))[1]
    changing = set()
    for i, o in states:
        had = typed[i].shape
        got = types.get(outs[o])
        got = got.tensor_type.shape if got is not None and got.tensor_type.HasField("shape") else None
        if had is None:
            continue
        if got is not None and len(got.dim) != len(had):
            n.decline(f"the body of node '{n.name}' changes the rank of its carried value '{body.input[i].name}' "
                      f"({len(had)} -> {len(got.dim)}): its gradient cannot store it per iteration")
        dims = [None] * len(had) if got is None else [
            d.dim_value if d.HasField("dim_value") else d.dim_param or None for d in got.dim]
        if any(d is None or d != h for d, h in zip(dims, had)):
            changing.add(i)
    return changing


def _holder(body: onnx.GraphProto) -> onnx.NodeProto:
    """A node holding ``body``, to ask M.subgraph_inputs what it reads from the outer scope."""
    return helper.make_node("If", [], [], then_branch=body)


def _declared(vi: onnx.ValueInfoProto, info: TensorInfo) -> TensorInfo:
    """The body input's own declared type where it has one, else the one the node gives it."""
    tt = vi.type.tensor_type
    if tt.elem_type and tt.HasField("shape"):
        return TensorInfo(tt.elem_type, tuple(d.dim_value if d.HasField("dim_value") else None
                                              for d in tt.shape.dim))
    return info


def _body_model(n: Node, body: onnx.GraphProto, infos: list[TensorInfo], outer: list[str], wrt: set[str],
                local: NameScope) -> tuple[onnx.ModelProto, list[str]]:
    """The body as a model: typed inputs, the outer tensors it reads as inputs (their constant values as
    initializers, so that the body's rules see them), outputs of distinct names."""
    b = n.b
    inputs = [_value_info(vi.name, info) for vi, info in zip(body.input, infos)]
    inits = []
    for name in outer:
        value = b.constants.get(name)
        if value is not None and name not in wrt:
            inits.append(numpy_helper.from_array(np.asarray(value), name))
            continue
        info = b.infos.get(name)
        if info is None or info.dtype is None:
            n.decline(f"the body reads '{name}' from the outer scope, whose type is unknown "
                          "(not a tensor, or not inferred): declare it in value_info")
        inputs.append(_value_info(name, info))
    for vi in inputs:
        if not vi.type.tensor_type.HasField("shape"):
            n.decline(f"the body reads '{vi.name}', whose rank shape inference cannot tell (a Reshape to a "
                          "shape computed from an If's outputs?): its gradient model needs it; declare the "
                          "tensor's shape in value_info")
    nodes = list(body.node)
    outs, seen = [], set()
    graph_inputs = {vi.name for vi in inputs} | {t.name for t in inits}
    for vi in body.output:
        name = vi.name
        if name in seen or name in graph_inputs:     # give each output a tensor of its own
            fresh = local.fresh(f"{name}_out")
            nodes.append(helper.make_node("Identity", [name], [fresh], name=local.fresh(f"{fresh}/Identity")))
            name = fresh
        seen.add(name)
        outs.append(name)
    outputs = [helper.make_empty_tensor_value_info(o) for o in outs]
    for vi, o in zip(body.output, outputs):
        if vi.type.tensor_type.elem_type:
            o.type.CopyFrom(vi.type)
    g = helper.make_graph(nodes, f"{n.name}_body", inputs, outputs, inits, value_info=list(body.value_info))
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", n.opset)])
    model.ir_version = emitted_ir_version(model)
    return model, outs


def _formal(b: Builder, base: str, info: TensorInfo) -> Var:
    name = b.names.fresh(base)
    b.infos[name] = info
    return b.var(name)


def _emit(b: Builder, op: str, inputs: list, n_out: int, infos: list[TensorInfo], **attrs) -> list[Var]:
    """A control-flow node with ``n_out`` outputs typed ``infos`` (the builder cannot tell their types)."""
    outs = b.emit(op, inputs, outputs=n_out, **attrs)
    if n_out == 1:
        outs = (outs,)
    for v, info in zip(outs, infos):
        b.infos[v.name] = info
    return list(outs)


def _store(n: Node, body: onnx.GraphProto, attr: str, names: list[str], infos: list[TensorInfo],
           stacked: list[TensorInfo]) -> list[Var]:
    """Emit the body inputs ``names`` at each iteration as extra scan outputs of the forward node
    (stacked on axis 0, in iteration order); returns the new outputs of the forward node."""
    p, b = n.proto, n.b
    if not names:
        return []
    new = onnx.GraphProto()
    new.CopyFrom(body)
    outs = []
    for name, info, full in zip(names, infos, stacked):
        kept = b.names.fresh(f"{name}_stored")
        new.node.append(helper.make_node("Identity", [name], [kept], name=b.names.fresh(f"{kept}/Identity")))
        new.output.append(_value_info(kept, info))
        out = b.names.fresh(f"{p.name}/{name}_per_iteration")
        p.output.append(out)
        b.infos[out] = full
        outs.append(b.var(out))
    for a in p.attribute:
        if a.name == attr:
            a.g.CopyFrom(new)
        elif a.name in ("scan_output_directions", "scan_output_axes"):
            a.ints.extend([0] * len(names))
    n.outputs = [b.var(y) if y else None for y in p.output]
    return outs


# -- If ----------------------------------------------------------------------------------
@register("If", inputs=(), subgraphs=True)
def if_(n: Node):
    """d(If(c, then, else)) = If(c, VJP(then), VJP(else)): each branch returns the gradients of the outer
    tensors either branch reads (zeros for the ones it does not read). A condition known at build time
    picks the branch: d(If(c, then, else)) = VJP(then) if c else VJP(else), no If (:func:`_taken_branch`)."""
    b = n.b
    wanted = sorted(n.outer_needed)
    seeded = [k for k, d in enumerate(n.dys) if d is not None and _is_float(n.outputs[k].info)]
    if not wanted or not seeded:
        return None
    cond = n.const_value(0)
    if cond is not None and np.size(cond) == 1:
        return _taken_branch(n, "then_branch" if np.asarray(cond).item() else "else_branch", wanted, seeded)
    branches = {}
    for attr in ("then_branch", "else_branch"):
        body = n.attr(attr)
        sb = b.subgraph(attr)
        reads = M.subgraph_inputs(_holder(body))
        mine = [x for x in wanted if x in reads]
        grads = {}
        if mine:
            vjp = _body_vjp(n, body, [], mine, seeded, output_infos=[o.info if o else None for o in n.outputs])
            env = {vjp.seeds[body.output[k].name]: n.dys[k].name for k in seeded}
            grads = vjp.inline(sb, env)
        outs = _distinct(sb, [sb.var(grads[x]) if x in grads else sb.zeros_like(sb.var(x)) for x in wanted])
        branches[attr] = helper.make_graph(sb.nodes, b.names.fresh(f"{n.name}_grad_{attr}"), [],
                                           [_value_info(v.name, b.infos.get(x)) for v, x in zip(outs, wanted)])
    results = _emit(b, "If", [n.inputs[0]], len(wanted), [b.infos.get(x) for x in wanted], **branches)
    n.outer_grads.update(zip(wanted, results))
    return None


def _taken_branch(n: Node, attr: str, wanted: list[str], seeded: list[int]) -> None:
    """The gradient of an If whose condition is known at build time: the VJP of the branch it always takes,
    inlined in the backward graph (that branch's forward recomputed there). The other branch is never run,
    so it is not differentiated: it may not even be valid at the model's shapes (AffineGrid's function body
    holds a 2-D branch and a 3-D one), and the tensors only it reads get no gradient from this node."""
    b = n.b
    body = n.attr(attr)
    mine = [x for x in wanted if x in M.subgraph_inputs(_holder(body))]
    if not mine:
        return None
    vjp = _body_vjp(n, body, [], mine, seeded, output_infos=[o.info if o else None for o in n.outputs])
    grads = vjp.inline(b, {vjp.seeds[body.output[k].name]: n.dys[k].name for k in seeded})
    for x in mine:
        if grads[x] not in b.infos and x in b.infos:        # the gradient of x has x's type and shape
            b.infos[grads[x]] = b.infos[x]
        n.outer_grads[x] = b.var(grads[x])
    return None


def _made(sb: Builder) -> set[str]:
    return {o for node in sb.nodes for o in node.output}


# -- Scan --------------------------------------------------------------------------------
@register("Scan", inputs_from=0, subgraphs=True)
def scan(n: Node):
    """Reverse Scan over the stored states s_t, x_t and seeds dy_t: (ds_t, dx_t, dW_t) = VJP(body)(s_t,
    x_t; ds_t+1, dy_t); the state gradients are carried, the outer reads' gradients summed."""
    b, p = n.b, n.proto
    body = n.attr("body")
    m = n.attr("num_scan_inputs")
    N = len(p.input) - m
    K = len(body.output) - N
    in_dirs = list(n.attr("scan_input_directions") or [0] * m)
    out_dirs = list(n.attr("scan_output_directions") or [0] * K)
    in_info = [n.inputs[i].info for i in range(len(p.input))]
    out_info = [n.outputs[k].info for k in range(N + K)]
    in_axes = [a % (len(in_info[N + j].shape) if in_info[N + j].shape is not None else max(a + 1, 1))
               for j, a in enumerate(n.attr("scan_input_axes") or [0] * m)]
    if any(a < 0 for a in (n.attr("scan_input_axes") or [])) and any(i.shape is None for i in in_info[N:]):
        n.decline("negative scan_input_axes on a scan input of unknown rank")
    out_axes = []
    for k, a in enumerate(n.attr("scan_output_axes") or [0] * K):
        if a < 0:
            shape = out_info[N + k].shape
            if shape is None:
                n.decline("negative scan_output_axes on a scan output of unknown rank")
            a %= len(shape)
        out_axes.append(a)
    length = None
    if in_info[N].shape is not None:
        length = in_info[N].shape[in_axes[0]]
    body_infos = in_info[:N] + [_without_axis(in_info[N + j], in_axes[j]) for j in range(m)]

    states = [i for i in range(N) if _is_float(in_info[i])]
    xs = [j for j in range(m) if n.needs(N + j) and _is_float(in_info[N + j])]
    seeded = [k for k in range(K) if n.dys[N + k] is not None and _is_float(out_info[N + k])]
    outer = sorted(n.outer_needed)
    names = [vi.name for vi in body.input]
    wrt = [names[i] for i in states] + [names[N + j] for j in xs] + outer
    of = states + [N + k for k in seeded]
    if not of:
        return None
    vjp = _body_vjp(n, body, body_infos, wrt, of, [(i, i) for i in range(N)])
    read = vjp.reads(names)
    kept_states = [i for i in range(N) if names[i] in read]
    kept_xs = [j for j in range(m) if names[N + j] in read] or [0]      # a Scan needs a scan input
    stored = _store(n, body, "body", [names[i] for i in kept_states], [in_info[i] for i in kept_states],
                    [_with_axis(in_info[i], 0, length) for i in kept_states])

    sb = b.subgraph("body")
    ds_in = [_formal(sb, f"{names[i]}_grad_next", in_info[i]) for i in states]
    dw_in = [_formal(sb, f"{w}_grad_sum", b.infos[w]) for w in outer]
    s_t = [_formal(sb, f"{names[i]}_t", in_info[i]) for i in kept_states]
    x_t = [_formal(sb, f"{names[N + j]}_t", body_infos[N + j]) for j in kept_xs]
    dy_t = [_formal(sb, f"{body.output[N + k].name}_grad_t", _without_axis(out_info[N + k], out_axes[k]))
            for k in seeded]
    env = {names[i]: v.name for i, v in zip(kept_states, s_t)}
    env.update({names[N + j]: v.name for j, v in zip(kept_xs, x_t)})
    env.update({vjp.seeds[body.output[i].name]: v.name for i, v in zip(states, ds_in)})
    env.update({vjp.seeds[body.output[N + k].name]: v.name for k, v in zip(seeded, dy_t)})
    g = vjp.inline(sb, env)
    outs = [sb.var(g[names[i]]) for i in states]
    outs += [sb.op.Add(acc, sb.var(g[w])) for acc, w in zip(dw_in, outer)]
    outs += [sb.var(g[names[N + j]]) for j in xs]
    outs = _distinct(sb, outs)
    out_infos = [in_info[i] for i in states] + [b.infos[w] for w in outer] + [body_infos[N + j] for j in xs]
    bwd_body = helper.make_graph(
        sb.nodes, b.names.fresh(f"{n.name}_grad_body"),
        [_value_info(v.name, v.info) for v in ds_in + dw_in + s_t + x_t + dy_t],
        [_value_info(v.name, info) for v, info in zip(outs, out_infos)])

    init = [n.dys[i] if n.dys[i] is not None else b.zeros_like(n.outputs[i]) for i in states]
    init += [b.zeros_like(b.var(w)) for w in outer]
    seqs = stored + [n.inputs[N + j] for j in kept_xs] + [n.dys[N + k] for k in seeded]
    directions = [1] * len(stored) + [1 - in_dirs[j] for j in kept_xs] + [1 - out_dirs[k] for k in seeded]
    axes = [0] * len(stored) + [in_axes[j] for j in kept_xs] + [out_axes[k] for k in seeded]
    results = _emit(b, "Scan", init + seqs, len(out_infos),
                    [in_info[i] for i in states] + [b.infos[w] for w in outer] + [in_info[N + j] for j in xs],
                    body=bwd_body, num_scan_inputs=len(seqs), scan_input_directions=directions,
                    scan_input_axes=axes, scan_output_directions=[1 - in_dirs[j] for j in xs] or None,
                    scan_output_axes=[in_axes[j] for j in xs] or None)
    ds, rest = results[:len(states)], results[len(states):]
    dw, dx = rest[:len(outer)], rest[len(outer):]
    n.outer_grads.update(zip(outer, dw))
    grads: list[Var | None] = [None] * len(p.input)
    for i, d in zip(states, ds):
        grads[i] = d if n.needs(i) else None
    for j, d in zip(xs, dx):
        grads[N + j] = d
    return grads


def _distinct(sb: Builder, outs: list[Var]) -> list[Var]:
    """A subgraph's outputs, each a tensor of its own made inside it (Identity where one repeats or comes
    from outside)."""
    made = _made(sb)
    seen: set[str] = set()
    res = []
    for v in outs:
        if v.name in seen or v.name not in made:
            v = sb.op.Identity(v)
        seen.add(v.name)
        res.append(v)
    return res


# -- Loop --------------------------------------------------------------------------------
@register("Loop", inputs_from=2, subgraphs=True)
def loop(n: Node):
    """A Loop of the forward's T trips, iteration k reading the stored values of iteration t = T-1-k:
    (dv_t, dW_t) = VJP(body)(i_t, v_t; dv_t+1, dy_t); the carried gradients flow back to v_initial.
    A carried value whose shape the body changes (a state that grows) is stored flat (:func:`_store_grown`)
    and its gradient's dims are read at run time."""
    b, p = n.b, n.proto
    body = n.attr("body")
    N = len(p.input) - 2
    K = len(body.output) - 1 - N
    in_info = [n.inputs[2 + i].info for i in range(N)]
    out_info = [n.outputs[k].info for k in range(N + K)]
    names = [vi.name for vi in body.input]
    results_of = [vi.name for vi in body.output]      # the body's outputs, before storing adds some
    scalar_i, scalar_b = TensorInfo(TensorProto.INT64, ()), TensorInfo(TensorProto.BOOL, ())
    body_infos = [scalar_i, scalar_b] + in_info

    carried = [i for i in range(N) if _is_float(in_info[i])]
    seeded = [k for k in range(K) if n.dys[N + k] is not None and _is_float(out_info[N + k])]
    outer = sorted(n.outer_needed)
    wrt = [names[2 + i] for i in carried] + outer
    of = [1 + i for i in carried] + [1 + N + k for k in seeded]
    if not of:
        return None
    vjp = _body_vjp(n, body, body_infos, wrt, of, [(2 + i, 1 + i) for i in range(N)])
    for j in vjp.changing:          # a value of another shape at each iteration
        body_infos[j] = TensorInfo(body_infos[j].dtype, (None,) * len(body_infos[j].shape))
    state_info = body_infos[2:]
    read = vjp.reads(names)
    kept = [0] + [i for i in range(1, N + 2) if names[i] in read and i not in vjp.changing]   # i always: T
    grown = [i for i in range(2, N + 2) if names[i] in read and i in vjp.changing]
    stored = _store(n, body, "body", [names[i] for i in kept], [body_infos[i] for i in kept],
                    [_with_axis(body_infos[i], 0, None) for i in kept])
    flat = _store_grown(n, body, grown, body_infos)
    trips = b.op.Squeeze(b.shape_of(stored[0]), b.ints([0]))
    last = trips - b.const(np.array(1, np.int64))

    sb = b.subgraph("body")
    k_in = _formal(sb, "k", scalar_i)
    cond_in = _formal(sb, "cond", scalar_b)
    dv_in = [_formal(sb, f"{names[2 + i]}_grad_next", state_info[i]) for i in carried]
    dw_in = [_formal(sb, f"{w}_grad_sum", b.infos[w]) for w in outer]
    t = sb.op.Sub(last, k_in)
    env = {}
    for i, seq in zip(kept, stored):
        if names[i] in read:
            env[names[i]] = _at(sb, seq, t, body_infos[i]).name
    for i, (store, offsets, shapes) in zip(grown, flat):
        env[names[i]] = _grown_at(sb, store, offsets, shapes, t, body_infos[i]).name
    env.update({vjp.seeds[results_of[1 + i]]: v.name for i, v in zip(carried, dv_in)})
    for k in seeded:
        env[vjp.seeds[results_of[1 + N + k]]] = _at(sb, n.dys[N + k], t,
                                                           _without_axis(out_info[N + k], 0)).name
    g = vjp.inline(sb, env)
    outs = [sb.op.Identity(cond_in)] + [sb.var(g[names[2 + i]]) for i in carried]
    outs += [sb.op.Add(acc, sb.var(g[w])) for acc, w in zip(dw_in, outer)]
    outs = _distinct(sb, outs)
    out_infos = [scalar_b] + [state_info[i] for i in carried] + [b.infos[w] for w in outer]
    bwd_body = helper.make_graph(
        sb.nodes, b.names.fresh(f"{n.name}_grad_body"),
        [_value_info(v.name, v.info) for v in [k_in, cond_in] + dv_in + dw_in],
        [_value_info(v.name, info) for v, info in zip(outs, out_infos)])
    init = [n.dys[i] if n.dys[i] is not None else b.zeros_like(n.outputs[i]) for i in carried]
    init += [b.zeros_like(b.var(w)) for w in outer]
    results = _emit(b, "Loop", [trips, None] + init, len(init), out_infos[1:], body=bwd_body)
    dv, dw = results[:len(carried)], results[len(carried):]
    n.outer_grads.update(zip(outer, dw))
    grads: list[Var | None] = [None] * len(p.input)
    for i, d in zip(carried, dv):
        grads[2 + i] = d if n.needs(2 + i) else None
    return grads


def _store_grown(n: Node, body: onnx.GraphProto, grown: list[int], body_infos: list[TensorInfo]
                 ) -> list[tuple[Var, Var, Var]]:
    """Store the carried body inputs at positions ``grown``, whose shape changes from one iteration to the
    next (a scan output must keep one shape), as extra carried values of the forward Loop: each one's values
    at every iteration, flattened and concatenated along the last axis, with, as scan outputs, where each
    iteration's values start (Size of what is stored before them) and their shape. A stored value starts
    as the carried value's initial one (the only tensor of its type the Loop has before it runs; it keeps
    the rank, so the stored value is one of rank r that grows along its last axis). Returns (the stored
    values, their offsets [T], their shapes [T, r]) per input."""
    p, b = n.proto, n.b
    if not grown:
        return []
    N = len(p.input) - 2
    new = onnx.GraphProto()
    new.CopyFrom(body)
    found = []
    for k, j in enumerate(grown):
        name, info = body.input[j].name, body_infos[j]
        r = len(info.shape)
        flat_shape = [1] * (r - 1) + [-1]

        def node(op, inputs, base, **attrs):
            out = b.names.fresh(base)
            new.node.append(helper.make_node(op, inputs, [out], name=b.names.fresh(f"{out}/{op}"), **attrs))
            return out

        before = b.names.fresh(f"{name}_stored_before")
        as_row = node("Constant", [], f"{name}_flat_shape", value=numpy_helper.from_array(
            np.array(flat_shape, np.int64)))
        rows = [node("Reshape", [before, as_row], f"{before}_flat"), node("Reshape", [name, as_row], f"{name}_flat")]
        after = node("Concat", rows, f"{name}_stored_after", axis=-1)
        offset = node("Size", [before], f"{name}_offset")
        shape = node("Shape", [name], f"{name}_shape")
        new.input.insert(2 + N + k, _value_info(before, TensorInfo(info.dtype, (None,) * r)))
        new.output.insert(1 + N + k, _value_info(after, TensorInfo(info.dtype, (None,) * r)))
        new.output.append(_value_info(offset, TensorInfo(TensorProto.INT64, ())))
        new.output.append(_value_info(shape, TensorInfo(TensorProto.INT64, (r,))))
        p.input.append(p.input[j])
        outs = [b.names.fresh(f"{p.name}/{name}_stored"), b.names.fresh(f"{p.name}/{name}_offsets"),
                b.names.fresh(f"{p.name}/{name}_shapes")]
        p.output.insert(N + k, outs[0])
        p.output.extend(outs[1:])
        b.infos[outs[0]] = TensorInfo(info.dtype, (None,) * r)
        b.infos[outs[1]] = TensorInfo(TensorProto.INT64, (None,))
        b.infos[outs[2]] = TensorInfo(TensorProto.INT64, (None, r))
        found.append(tuple(b.var(o) for o in outs))
    for a in p.attribute:
        if a.name == "body":
            a.g.CopyFrom(new)
    n.outputs = [b.var(y) if y else None for y in p.output]
    return found


def _grown_at(sb: Builder, store: Var, offsets: Var, shapes: Var, t: Var, info: TensorInfo) -> Var:
    """The value :func:`_store_grown` stored at iteration t: store[..., off_t : off_t + prod(shape_t)]
    reshaped to shape_t."""
    start = sb.unsqueeze(sb.op.Gather(offsets, t, axis=0), [0])
    shape = sb.op.Gather(shapes, t, axis=0)
    end = start + sb.reduce("ReduceProd", shape, [0])
    v = sb.op.Reshape(sb.op.Slice(store, start, end, sb.ints([-1])), shape)
    sb.infos[v.name] = info
    return v


def _at(sb: Builder, seq: Var, t: Var, info: TensorInfo) -> Var:
    """seq[t] along axis 0."""
    v = sb.op.Gather(seq, t, axis=0)
    sb.infos[v.name] = info
    return v
