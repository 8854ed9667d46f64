"""The numeric check of forward mode: a jvp model's tangents against central differences of the float64
forward along random directions (the reverse mode's check is :func:`onnxgrad.tools.check.check`)."""
from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper

from ...ir.load import load
from ...passes.forward import tangent_spec
from . import ABS_FLOOR, Runner, _as_inputs, _with_outputs, as_float64, random_inputs, to_float64

__all__ = ["check_jvp"]


def check_jvp(model: onnx.ModelProto, jvp_model: onnx.ModelProto, inputs: Mapping[str, np.ndarray] | None = None,
              *, rng: np.random.Generator | int = 0, eps: float = 1e-6,
              run=None, reference: str = "") -> tuple[dict[str, float], dict[str, np.ndarray]]:
    """Worst relative error of each tangent output against the central difference of the float64 forward
    model along random directions v: (f(x + h v) - f(x - h v)) / 2h (at an intermediate tensor, h v is
    added to the value flowing in, as jvp adds its direction to the tangent). ``run(jvp_model, feeds)``
    evaluates the tangent graph (default: onnxruntime as it is; ``check.run_float64``: in float64).
    ``reference``: the declared reason every run here uses onnx.reference (``check.check``'s). Returns the
    errors and the directions used."""
    rng = np.random.default_rng(rng)
    model = load(model)
    spec = tangent_spec(jvp_model)
    wrt, of = list(spec["tangent_inputs"]), list(spec["tangents"])
    feeds = dict(inputs) if inputs is not None else random_inputs(model, rng)
    declared = {"runtime": "reference", "reason": reference} if reference else {}
    model64 = to_float64(model)
    feeds64 = as_float64(feeds)
    inits = {i.name: onnx.numpy_helper.to_array(i) for i in model64.graph.initializer}
    inner = [w for w in wrt if w not in feeds64 and w not in inits]
    base = Runner(_with_outputs(model64, inner + of), **declared)(feeds64, inner + of)
    start = {w: feeds64[w] if w in feeds64 else inits[w] if w in inits else base[w] for w in wrt}
    dtypes = {i.name: i.type.tensor_type.elem_type for i in jvp_model.graph.input}
    directions = {}
    for w in wrt:
        np_type = helper.tensor_dtype_to_np_dtype(dtypes.get(spec["tangent_inputs"][w]) or TensorProto.FLOAT)
        directions[w] = rng.standard_normal(np.shape(start[w])).astype(np_type)
    tfeeds = dict(feeds)
    tfeeds.update({spec["tangent_inputs"][w]: v for w, v in directions.items()})
    names = [spec["tangents"][y] for y in of]
    values = Runner(jvp_model, **declared)(tfeeds, names) if run is None else run(jvp_model, tfeeds)
    leaves = [w for w in wrt if w not in inner]
    perturbable = Runner(_with_offsets(_as_inputs(model64, leaves), inner), **declared)
    h = eps * max([1.0] + [float(np.max(np.abs(s), initial=0.0)) for s in start.values()])

    def at(sign: float) -> dict:
        point = dict(feeds64)
        point.update({w: np.asarray(start[w], np.float64) + sign * h * directions[w].astype(np.float64)
                      for w in leaves})
        point.update({w + _OFFSET: sign * h * directions[w].astype(np.float64) for w in inner})
        return perturbable(point, of)

    plus, minus = at(1.0), at(-1.0)
    errors = {}
    for y, name in zip(of, names):
        num = (plus[y] - minus[y]) / (2 * h)
        got = np.asarray(values[name], np.float64)
        if got.shape != num.shape:
            errors[y] = float("inf")
            continue
        scale = max(np.max(np.abs(num), initial=0.0), np.max(np.abs(got), initial=0.0), ABS_FLOOR)
        errors[y] = float(np.max(np.abs(got - num), initial=0.0) / scale)
    return errors, directions


_OFFSET = "__onnxgrad_offset"


def _with_offsets(model: onnx.ModelProto, names: Sequence[str]) -> onnx.ModelProto:
    """``model`` with an input ``<t>__onnxgrad_offset`` added to each intermediate tensor t where it is made:
    its readers (outputs included) see t + offset, and whatever t depends on still moves it."""
    if not names:
        return model
    m = onnx.ModelProto()
    m.CopyFrom(model)
    g = m.graph
    nodes = []
    for node in g.node:
        nodes.append(node)
        for k, y in enumerate(node.output):
            if y in names:
                node.output[k] = y + "__onnxgrad_before_offset"
                nodes.append(helper.make_node("Add", [node.output[k], y + _OFFSET], [y], name=y + _OFFSET))
                g.input.append(helper.make_tensor_value_info(y + _OFFSET, TensorProto.DOUBLE, None))
    del g.node[:]
    g.node.extend(nodes)
    return m
