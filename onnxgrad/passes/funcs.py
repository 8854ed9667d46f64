"""The torch.func family as ONNX graphs: ``hvp``, ``jacrev``, ``jacfwd``, ``jacobian``, ``hessian``.

- ``hvp(m, wrt, loss)``: forward over reverse, ``jvp(grad(m))``: inputs ``<x>_tangent`` (v),
  outputs ``<x>_hvp`` = H v, one reverse and one forward sweep (no second reverse pass).
- ``jacrev``/``jacfwd``: the full Jacobian ``d<y>_d<x>`` of shape ``y.shape + x.shape``
  (torch.func's layout), from the VJP graph run on every one-hot seed of y (rev) or the
  JVP graph on every one-hot direction of x (fwd). ``hessian`` = ``jacfwd(grad)``, as torch.func.

Batching the seeds: ONNX has no vmap, and tiling the inputs along a new batch axis works
only for graphs that are batch-polymorphic (exported Reshapes to fixed shapes are not).
So the seeds run through one ``Loop`` per seed tensor, whose body holds only the nodes that
depend on the seed (the forward pass, and whatever of the backward pass the seed does not
reach, is computed once, outside); the Loop's scan outputs stack the rows. One graph, any
model, exact; the body runs once per basis vector.
"""
from __future__ import annotations

import json
from typing import Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..errors import OnnxGradError, UnknownNameError
from ..ir import graph as G
from ..ir import model as M
from ..ir.load import emitted_ir_version
from ..ir.model import NameScope
from .autodiff import grad
from .forward import jvp, tangent_spec

__all__ = ["hvp", "jacrev", "jacfwd", "jacobian", "hessian", "jacobian_spec"]

ModelLike = "onnx.ModelProto | str | os.PathLike"


def _names(x: Sequence[str] | str) -> list[str]:
    return [x] if isinstance(x, str) else list(x)


def _meta(m: onnx.ModelProto, key: str) -> dict:
    return json.loads({p.key: p.value for p in m.metadata_props}[key])


def _set_meta(m: onnx.ModelProto, key: str, value) -> None:
    kept = [p for p in m.metadata_props if p.key != key]
    del m.metadata_props[:]
    m.metadata_props.extend(kept)
    m.metadata_props.add(key=key, value=json.dumps(value))


def _rename_outputs(m: onnx.ModelProto, renames: dict[str, str]) -> None:
    """Rename graph outputs where they are made and read (names must be free)."""
    from ..ir.model import rename_tensors

    rename_tensors(list(m.graph.node), renames)
    for o in m.graph.output:
        if o.name in renames:
            o.name = renames[o.name]


# -- Hessian-vector products ---------------------------------------------------------------
def hvp(model: ModelLike, wrt: Sequence[str] | str, loss: str | None = None,
        allow_unused: bool = True) -> onnx.ModelProto:
    """H v by forward over reverse: ``jvp(grad(model, wrt, loss), wrt, of=gradients)``.

    Inputs ``<x>_tangent`` (v, one per wrt tensor); outputs ``<x>_hvp`` = sum_j d^2 L / dx dx_j v_j,
    after the model's outputs and the gradients ``<x>_grad``. Metadata ``onnxgrad.hvp``: {x: output}.
    A wrt tensor the loss does not depend on has zero gradient and zero H v, as in torch.func;
    ``allow_unused=False``: an :class:`UnusedError` for it instead.
    """
    wrt = _names(wrt)
    gm = grad(model, wrt=wrt, loss=loss, allow_unused=allow_unused)
    grads = _meta(gm, "onnxgrad.gradients")
    jm = jvp(gm, wrt=wrt, of=[grads[w] for w in wrt], allow_unused=True)
    tangents = tangent_spec(jm)["tangents"]
    taken = {o.name for o in jm.graph.output} | {i.name for i in jm.graph.input}
    names = NameScope(taken | {y for n in jm.graph.node for y in n.output})
    renames = {tangents[grads[w]]: names.fresh(f"{w}_hvp") for w in wrt}
    _rename_outputs(jm, renames)
    _set_meta(jm, "onnxgrad.hvp", {w: renames[tangents[grads[w]]] for w in wrt})
    _set_meta(jm, "onnxgrad.tangents", {y: renames.get(t, t) for y, t in tangents.items()})
    return jm


# -- full Jacobians -------------------------------------------------------------------------
def jacrev(model: ModelLike, wrt: Sequence[str] | str, of: Sequence[str] | str | None = None,
           allow_unused: bool = True) -> onnx.ModelProto:
    """Jacobians ``d<y>_d<x>`` [y.shape + x.shape] from the VJP graph on every one-hot seed of y."""
    return jacobian(model, wrt, of, mode="rev", allow_unused=allow_unused)


def jacfwd(model: ModelLike, wrt: Sequence[str] | str, of: Sequence[str] | str | None = None,
           allow_unused: bool = True) -> onnx.ModelProto:
    """Jacobians ``d<y>_d<x>`` [y.shape + x.shape] from the JVP graph on every one-hot direction of x."""
    return jacobian(model, wrt, of, mode="fwd", allow_unused=allow_unused)


def jacobian(model: ModelLike, wrt: Sequence[str] | str, of: Sequence[str] | str | None = None,
             mode: str = "rev", allow_unused: bool = True) -> onnx.ModelProto:
    """``J[y][x] = dy/dx`` for every ``of`` output y and ``wrt`` tensor x, as outputs ``d<y>_d<x>``.

    ``mode="rev"``: one Loop over the rows (one-hot seeds of y) per output, cheap when outputs are
    small; ``"fwd"``: one Loop over the columns (one-hot directions of x) per wrt tensor, cheap
    when inputs are small. Shapes of x and y must be known. Metadata ``onnxgrad.jacobian``: {y: {x: name}}.
    A block dy/dx where y does not depend on x is zeros, as in torch.func; ``allow_unused=False``: an
    :class:`UnusedError` for a wrt tensor no output depends on (and, in mode "fwd", an output that
    depends on no wrt tensor) instead.
    """
    if mode not in ("rev", "fwd"):
        raise OnnxGradError(f"mode must be 'rev' or 'fwd', not {mode!r}")
    wrt = _names(wrt)
    of = _names(of) if of is not None else None
    if mode == "rev":
        dm = grad(model, wrt=wrt, of=of, allow_unused=allow_unused)
        of = _meta(dm, "onnxgrad.of")
        seeds, results = _meta(dm, "onnxgrad.seeds"), _meta(dm, "onnxgrad.gradients")
        loops = [(seeds[y], y, [(results[x], x) for x in wrt]) for y in of]
    else:
        dm = jvp(model, wrt=wrt, of=of, allow_unused=allow_unused)
        spec = tangent_spec(dm)
        of = list(spec["tangents"])
        loops = [(spec["tangent_inputs"][x], x, [(spec["tangents"][y], y) for y in of]) for x in wrt]
    return _Batched(dm, mode, [s for s, _, _ in loops]).build(loops, of, wrt)


def hessian(model: ModelLike, wrt: Sequence[str] | str, loss: str | None = None,
            allow_unused: bool = True) -> onnx.ModelProto:
    """d^2 L / dx_i dx_j as outputs ``d2<L>_d<x_i>_d<x_j>`` [x_i.shape + x_j.shape]: ``jacfwd(grad)``,
    as torch.func.hessian (zero blocks for a wrt tensor L does not depend on; ``allow_unused=False``:
    an :class:`UnusedError` for it instead)."""
    wrt = _names(wrt)
    gm = grad(model, wrt=wrt, loss=loss, allow_unused=allow_unused)
    loss_name = _meta(gm, "onnxgrad.loss")
    grads = _meta(gm, "onnxgrad.gradients")
    hm = jacobian(gm, wrt, of=[grads[x] for x in wrt], mode="fwd")
    jac = jacobian_spec(hm)
    taken = {y for n in hm.graph.node for y in n.output} | {i.name for i in hm.graph.input}
    names = NameScope(taken)
    renames = {jac[grads[xi]][xj]: names.fresh(f"d2{loss_name}_d{xi}_d{xj}") for xi in wrt for xj in wrt}
    _rename_outputs(hm, renames)
    _set_meta(hm, "onnxgrad.hessian", {xi: {xj: renames[jac[grads[xi]][xj]] for xj in wrt} for xi in wrt})
    return hm


def jacobian_spec(m: onnx.ModelProto) -> dict:
    """{y: {x: output}} as :func:`jacobian` recorded it."""
    return _meta(m, "onnxgrad.jacobian")


class _Batched:
    """Turns a model with seed inputs into one that runs its seed-dependent part on every one-hot seed."""

    def __init__(self, dm: onnx.ModelProto, mode: str, seeds: list[str]):
        self.m = dm
        self.mode = mode
        self.seeds = seeds
        g = dm.graph
        self.infos, _ = M.tensor_infos(M.infer(dm))
        self.names = NameScope({y for n in g.node for y in n.output} | {i.name for i in g.input}
                               | {i.name for i in g.initializer} | {n.name for n in g.node})
        depends = set(seeds)
        self.inside, self.outside = [], []
        for n in g.node:
            if any(x in depends for x in n.input) or (M.has_subgraph(n) and M.subgraph_inputs(n) & depends):
                depends.update(y for y in n.output if y)
                self.inside.append(n)
            else:
                self.outside.append(n)
        self.new_nodes: list[onnx.NodeProto] = []

    def _shape(self, name: str) -> tuple[int, ...]:
        info = self.infos.get(name)
        if info is None or not info.static:
            raise UnknownNameError(f"the shape of '{name}' is not known statically; jacobian needs static shapes "
                                   "(declare the model's input shapes)")
        return tuple(int(d) for d in info.shape)

    def _const(self, value: np.ndarray, hint: str) -> str:
        name = self.names.fresh(hint)
        self.new_nodes.append(helper.make_node("Constant", [], [name], name=name,
                                               value=numpy_helper.from_array(value)))
        return name

    def build(self, loops, of: list[str], wrt: list[str]) -> onnx.ModelProto:
        g = self.m.graph
        dtype = {i.name: i.type.tensor_type.elem_type for i in g.input}
        for s in self.seeds:                  # a seed is zero while another one's basis runs
            if len(self.seeds) > 1:
                zeros = np.zeros(self._shape(s), helper.tensor_dtype_to_np_dtype(dtype[s]))
                self.new_nodes.append(helper.make_node("Constant", [], [s], name=self.names.fresh(f"{s}/zeros"),
                                                       value=numpy_helper.from_array(zeros)))
        outputs, spec = [], {}
        for k, (seed, seed_of, results) in enumerate(loops):
            stacked = self._loop(k, seed, [r for r, _ in results], dtype[seed])
            for (r, other), rows in zip(results, stacked):
                y, x = (seed_of, other) if self.mode == "rev" else (other, seed_of)
                out = self._arrange(rows, self._shape(y), self._shape(x), f"d{y}_d{x}")
                spec.setdefault(y, {})[x] = out
                elem = self.infos[r].dtype or TensorProto.FLOAT
                outputs.append(helper.make_tensor_value_info(out, elem, list(self._shape(y) + self._shape(x))))
        out = onnx.ModelProto()
        out.CopyFrom(self.m)
        og = out.graph
        seeds = set(self.seeds)
        kept_inputs = [i for i in og.input if i.name not in seeds]
        del og.input[:]
        og.input.extend(kept_inputs)
        added = _added_outputs(self.m)
        originals = [o for o in og.output if o.name not in added]
        del og.output[:]
        og.output.extend(originals + outputs)
        nodes = self.outside + self.new_nodes
        del og.node[:]
        og.node.extend(G.live_nodes(nodes, {o.name for o in og.output}))
        _set_meta(out, "onnxgrad.jacobian", spec)
        out.ir_version = emitted_ir_version(out)
        return out

    def _loop(self, k: int, seed: str, results: list[str], seed_dtype: int) -> list[str]:
        """One Loop over the numel(seed) one-hot values of ``seed``; returns the stacked results [n, ...]."""
        shape = self._shape(seed)
        n = int(np.prod(shape))
        tag = f"__basis{k}"
        positions = self._const(np.arange(n, dtype=np.int64), f"{seed}/positions")
        trips = self._const(np.array(n, dtype=np.int64), f"{seed}/count")
        i, cond = f"i{tag}", f"cond{tag}"
        hot, basis = f"{seed}/hot{tag}", f"{seed}{tag}"
        body = [
            helper.make_node("Equal", [positions, i], [hot], name=hot),
            helper.make_node("Cast", [hot], [hot + "_float"], name=hot + "/Cast", to=seed_dtype),
            helper.make_node("Reshape", [hot + "_float", self._const(np.array(shape, np.int64), f"{seed}/shape")],
                             [basis], name=basis),
            helper.make_node("Identity", [cond], [cond + "_out"], name=cond + "/Identity"),
        ]
        inside_needed = G.live_nodes(self.inside, results)
        renames = {seed: basis}
        for node in inside_needed:
            for y in node.output:
                if y:
                    renames[y] = y + tag
        for node in inside_needed:
            copy = onnx.NodeProto()
            copy.CopyFrom(node)
            copy.name = node.name + tag
            copy.input[:] = [renames.get(x, x) for x in copy.input]
            copy.output[:] = [renames.get(y, y) for y in copy.output]
            body.append(copy)
        scan = []
        for r in results:
            o = f"{r}/row{tag}"
            body.append(helper.make_node("Identity", [renames.get(r, r)], [o], name=o))
            scan.append(helper.make_tensor_value_info(o, self.infos[r].dtype or TensorProto.FLOAT,
                                                      list(self._shape(r))))
        graph = helper.make_graph(
            body, f"{seed}_basis",
            [helper.make_tensor_value_info(i, TensorProto.INT64, []),
             helper.make_tensor_value_info(cond, TensorProto.BOOL, [])],
            [helper.make_tensor_value_info(cond + "_out", TensorProto.BOOL, [])] + scan)
        stacked = [self.names.fresh(f"{r}/rows") for r in results]
        self.new_nodes.append(helper.make_node("Loop", [trips, ""], stacked, name=self.names.fresh(f"{seed}/Loop"),
                                               body=graph))
        return stacked

    def _arrange(self, rows: str, y_shape: tuple, x_shape: tuple, hint: str) -> str:
        """rows [n, ...] to y.shape + x.shape: rev rows are y's entries (a reshape), fwd rows x's (a transpose)."""
        out = self.names.fresh(hint)
        full = self._const(np.array(y_shape + x_shape, np.int64), f"{hint}/shape")
        if self.mode == "rev":
            self.new_nodes.append(helper.make_node("Reshape", [rows, full], [out], name=out))
            return out
        ny, nx = int(np.prod(y_shape)), int(np.prod(x_shape))
        flat = self.names.fresh(f"{hint}/columns")
        turned = self.names.fresh(f"{hint}/rows")
        self.new_nodes += [
            helper.make_node("Reshape", [rows, self._const(np.array([nx, ny], np.int64), f"{hint}/flat")], [flat],
                             name=flat),
            helper.make_node("Transpose", [flat], [turned], name=turned, perm=[1, 0]),
            helper.make_node("Reshape", [turned, full], [out], name=out),
        ]
        return out


def _added_outputs(m: onnx.ModelProto) -> set[str]:
    """The outputs onnxgrad added (gradients, tangents): the batched model replaces them."""
    meta = {p.key: p.value for p in m.metadata_props}
    added: set[str] = set()
    for key in ("onnxgrad.gradients", "onnxgrad.tangents"):
        if key in meta:
            added |= set(json.loads(meta[key]).values())
    return added
