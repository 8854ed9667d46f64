"""The numeric check: gradients from the gradient graph against central differences in float64.

The forward model is copied to float64 (every float tensor, constant and cast)
and evaluated at ``x ± h`` by onnxruntime where it has float64 kernels and by
``onnx.reference`` where it has not (:mod:`onnxgrad.tools.check.runtime` decides, and
says why; nothing switches runtime silently). The objective is the loss, or
``sum(seed * output)`` for seeded outputs, so one scalar checks a full
vector-Jacobian product. Small tensors are checked element by element, large
ones along random directions.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping

import numpy as np
import onnx
import onnx.defs
from onnx import TensorProto, helper, numpy_helper

from ...ir.model import FLOAT_TYPES
from ...passes.record import gradient_spec  # noqa: F401  (re-exported: tests and users read it here)
from .runtime import (  # noqa: F401
    _FLOAT_TYPE_STRS,
    FLOAT64_IN_REFERENCE,
    ReferenceKernelError,
    Runner,
    RuntimeRefusedError,
    _corrected_kernels,  # noqa: F401  (test_forward_shared_cases extends them)
)

_TO_DOUBLE = {t: TensorProto.DOUBLE for t in FLOAT_TYPES}
# Gradients smaller than this are compared in absolute terms: a gradient that is zero
# up to rounding (1e-8 against 1e-9) is not a relative error of 1000%.
ABS_FLOOR = 1e-4


# -- float64 copy ---------------------------------------------------------------------
def to_float64(model: onnx.ModelProto) -> onnx.ModelProto:
    """The same model computing in float64: inputs, outputs, initializers, constants and casts."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    g = m.graph
    del g.value_info[:]
    keep = _float32_only(m)         # Resize's scales: float32 whatever the data's type
    opsets = {o.domain or "": o.version for o in m.opset_import}
    for vi in list(g.input) + list(g.output):
        if vi.name not in keep:
            _type_to_double(vi.type)
    for i, init in enumerate(g.initializer):
        if init.data_type in _TO_DOUBLE and init.name not in keep:
            g.initializer[i].CopyFrom(_double_tensor(init))
    for node in g.node:
        if not (node.op_type == "Constant" and node.output[0] in keep):
            _node_to_double(node, opsets)
    return m


# Attributes naming an element type: Cast's to, the Random ops' dtype, the precision
# LayerNormalization and Attention compute their statistics and softmax in.
_TYPE_ATTRIBUTES = frozenset({"to", "dtype", "stash_type", "softmax_precision"})
_STASHING = frozenset({"LayerNormalization", "GroupNormalization", "RMSNormalization"})


def _float32_only(model: onnx.ModelProto) -> set[str]:
    """Names of float inputs and initializers read only where the op's schema fixes their type to float32
    (Resize's scales), whatever the data's: a float64 copy keeps them as they are."""
    opsets = {o.domain or "": o.version for o in model.opset_import}
    fixed, flexible = set(), set()
    for node in model.graph.node:
        try:
            schema = onnx.defs.get_schema(node.op_type, opsets.get(node.domain or "", 1), node.domain or "")
        except onnx.defs.SchemaError:
            flexible.update(node.input)
            continue
        allowed = {c.type_param_str: set(c.allowed_type_strs) for c in schema.type_constraints}
        for i, name in enumerate(node.input):
            if not schema.inputs or not name:
                continue
            param = schema.inputs[min(i, len(schema.inputs) - 1)]
            # a concrete type (Resize's scales: tensor(float)), not a type variable the data sets
            concrete = param.type_str not in allowed and param.type_str in _FLOAT_TYPE_STRS
            (fixed if concrete and param.type_str != "tensor(double)" else flexible).add(name)
    return fixed - flexible


def _type_to_double(tp: onnx.TypeProto) -> None:
    """A float tensor type, or a sequence or optional of them, made float64 (in place)."""
    kind = tp.WhichOneof("value")
    if kind == "tensor_type" and tp.tensor_type.elem_type in _TO_DOUBLE:
        tp.tensor_type.elem_type = TensorProto.DOUBLE
    elif kind == "sequence_type":
        _type_to_double(tp.sequence_type.elem_type)
    elif kind == "optional_type":
        _type_to_double(tp.optional_type.elem_type)


def _double_tensor(t: onnx.TensorProto) -> onnx.TensorProto:
    arr = numpy_helper.to_array(t).astype(np.float64)
    return numpy_helper.from_array(arr, t.name)


def _node_to_double(node: onnx.NodeProto, opsets: dict[str, int] | None = None) -> None:
    for a in node.attribute:
        if a.type == onnx.AttributeProto.TENSOR and a.t.data_type in _TO_DOUBLE:
            a.t.CopyFrom(_double_tensor(a.t))
        elif a.name in _TYPE_ATTRIBUTES and a.type == onnx.AttributeProto.INT and a.i in _TO_DOUBLE:
            a.i = TensorProto.DOUBLE
        elif a.type == onnx.AttributeProto.GRAPH:
            _subgraph_to_double(a.g)
        elif a.type == onnx.AttributeProto.GRAPHS:
            for sg in a.graphs:
                _subgraph_to_double(sg)
    if node.op_type == "ConstantOfShape" and not node.attribute:     # float32 zeros by default
        node.attribute.append(helper.make_attribute("value", numpy_helper.from_array(np.zeros(1, np.float64))))
    if node.op_type in _STASHING and not any(a.name == "stash_type" for a in node.attribute) and _has_attribute(
            node, "stash_type", opsets):
        node.attribute.append(helper.make_attribute("stash_type", TensorProto.DOUBLE))  # default: float32
    if node.op_type == "Constant" and node.attribute[0].name in ("value_float", "value_floats"):
        a = node.attribute[0]
        value = np.array(a.f if a.name == "value_float" else list(a.floats), np.float64)
        del node.attribute[:]
        node.attribute.append(helper.make_attribute("value", numpy_helper.from_array(value)))


def _has_attribute(node: onnx.NodeProto, name: str, opsets: dict[str, int] | None) -> bool:
    """Whether the node's schema, at the model's opset, has this attribute (GroupNormalization-18 has no
    stash_type; 21 has). Without the opsets (a subgraph), assume so."""
    if opsets is None:
        return True
    try:
        schema = onnx.defs.get_schema(node.op_type, opsets.get(node.domain or "", 1), node.domain or "")
    except onnx.defs.SchemaError:
        return False
    return name in schema.attributes


def _subgraph_to_double(g: onnx.GraphProto) -> None:
    """An If/Loop/Scan body in float64: its declared types, initializers and nodes."""
    for vi in list(g.input) + list(g.output) + list(g.value_info):
        _type_to_double(vi.type)
    for i, init in enumerate(g.initializer):
        if init.data_type in _TO_DOUBLE:
            g.initializer[i].CopyFrom(_double_tensor(init))
    for n in g.node:
        _node_to_double(n)


def _as_inputs(model: onnx.ModelProto, names: list[str]) -> onnx.ModelProto:
    """Make ``names`` (initializers or intermediate tensors) graph inputs that can be perturbed."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    g = m.graph
    inputs = {i.name for i in g.input}
    inits = {i.name: i for i in g.initializer}
    for name in names:
        if name in inputs:
            continue
        if name in inits:
            t = inits[name]
            g.input.append(helper.make_tensor_value_info(name, t.data_type, list(t.dims)))
            g.initializer.remove(t)
            continue
        for node in g.node:
            for k, o in enumerate(node.output):
                if o == name:
                    node.output[k] = name + "__onnxgrad_detached"
        g.input.append(helper.make_tensor_value_info(name, TensorProto.DOUBLE, None))
    return m


def _with_outputs(model: onnx.ModelProto, names: list[str]) -> onnx.ModelProto:
    m = onnx.ModelProto()
    m.CopyFrom(model)
    have = {o.name for o in m.graph.output}
    for name in names:
        if name not in have:
            m.graph.output.append(helper.make_empty_tensor_value_info(name))
    return m


def is_float_array(v: np.ndarray) -> bool:
    """float16/32/64, and bfloat16 (an ml_dtypes type numpy does not count as kind 'f')."""
    return np.asarray(v).dtype.kind == "f" or np.asarray(v).dtype.name == "bfloat16"


def as_float64(feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Float arrays (bfloat16 included) as float64; integer and bool arrays as they are."""
    return {k: np.asarray(v, np.float64) if is_float_array(v) else v for k, v in feeds.items()}


def run_float64(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Run ``model`` computing in float64 (its float64 copy, float feeds converted): the tight check
    of a gradient graph's math, as ``check(..., analytic_run=run_float64)``."""
    return Runner(to_float64(model))(as_float64(feeds))


def _declared(reference: str) -> dict:
    """Runner arguments: onnx.reference for a declared reason, else onnxruntime (element types aside)."""
    return {"runtime": "reference", "reason": reference} if reference else {}


# -- inputs ---------------------------------------------------------------------------
def random_inputs(model: onnx.ModelProto, rng: np.random.Generator | int = 0,
                  dim: int = 3) -> dict[str, np.ndarray]:
    """Random values for every graph input without an initializer: floats ~ N(0, 1), integers 0 or 1, bools False.

    Unknown dims take ``dim``; a named dim takes the same value everywhere.
    """
    rng = np.random.default_rng(rng)
    inits = {i.name for i in model.graph.initializer}
    sizes = fitting_dims(model, dim)
    feeds = {}
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        tt = vi.type.tensor_type
        shape = [d.dim_value if d.HasField("dim_value") else sizes.get(_dim_key(vi.name, k, d), dim)
                 for k, d in enumerate(tt.shape.dim)]
        np_type = helper.tensor_dtype_to_np_dtype(tt.elem_type)
        if tt.elem_type in FLOAT_TYPES:
            feeds[vi.name] = rng.standard_normal(shape).astype(np_type)
        elif tt.elem_type == TensorProto.BOOL:
            feeds[vi.name] = np.zeros(shape, np_type)
        else:   # indices and labels: 0 or 1, valid for any embedding or class count of 2 or more
            feeds[vi.name] = rng.integers(0, 2, shape).astype(np_type)
    return feeds


def _dim_key(name: str, axis: int, d) -> str:
    return d.dim_param if d.dim_param else f"{name}[{axis}]"


def fitting_dims(model: onnx.ModelProto, dim: int = 3) -> dict[str, int]:
    """Sizes for the inputs' unknown dims that the model's shape inference accepts: ``dim`` where it
    fits, else the first of 2, 4, 1 and the initializers' dims that does (a MatMul against a [4, 3]
    weight needs 4). Named dims take one size everywhere; unnamed ones are keyed 'input[axis]'."""
    from onnx import shape_inference

    inits = {i.name for i in model.graph.initializer}
    keys: list[str] = []
    for vi in model.graph.input:
        if vi.name not in inits:
            for k, d in enumerate(vi.type.tensor_type.shape.dim):
                if not d.HasField("dim_value") and _dim_key(vi.name, k, d) not in keys:
                    keys.append(_dim_key(vi.name, k, d))
    if not keys:
        return {}
    candidates = list(dict.fromkeys([dim, 2, 4, 1] + sorted({int(x) for t in model.graph.initializer
                                                              for x in t.dims if 1 < x <= 4096})))

    def fits(sizes: dict[str, int]) -> bool:
        m = onnx.ModelProto()
        m.CopyFrom(model)
        del m.graph.value_info[:]
        for vi in m.graph.input:
            for k, d in enumerate(vi.type.tensor_type.shape.dim):
                key = _dim_key(vi.name, k, d)
                if vi.name not in inits and not d.HasField("dim_value") and key in sizes:
                    d.dim_value = sizes[key]
        try:
            shape_inference.infer_shapes(m, check_type=True, strict_mode=True, data_prop=True)
            return True
        except Exception:
            return False

    sizes: dict[str, int] = {}
    if fits({k: dim for k in keys}):
        return {k: dim for k in keys}
    for key in keys:
        for c in candidates:
            if fits({**sizes, key: c}):
                sizes[key] = c
                break
        else:
            sizes[key] = dim
    return sizes


# -- the check ------------------------------------------------------------------------
@dataclass
class CheckResult:
    """``errors[w]``: worst relative error of w's gradient; ``analytic``/``numeric`` the values compared."""

    errors: dict[str, float]
    analytic: dict[str, np.ndarray]
    numeric: dict[str, np.ndarray] = field(default_factory=dict)
    backend: str = ""               # what ran the float64 forward model
    grad_backend: str = ""          # what ran the gradient model: "onnxruntime", "reference" or "analytic_run"
    joint: float | None = None      # worst error along directions over every wrt tensor at once (sample=)
    reason: str = ""                # why the forward ran in onnx.reference ("" when onnxruntime ran it)
    grad_reason: str = ""           # why the gradient model did

    @property
    def worst(self) -> float:
        return max(list(self.errors.values()) + ([self.joint] if self.joint is not None else []), default=0.0)

    def ok(self, tol: float) -> bool:
        errors = list(self.errors.values()) + ([self.joint] if self.joint is not None else [])
        return all(np.isfinite(e) and e <= tol for e in errors)


def check(
    model: onnx.ModelProto,
    grad_model: onnx.ModelProto,
    inputs: Mapping[str, np.ndarray] | None = None,
    *,
    rng: np.random.Generator | int = 0,
    eps: float = 1e-6,
    max_elements: int = 64,
    directions: int = 3,
    analytic_run: Callable[[onnx.ModelProto, dict], dict] | None = None,
    sample: int | None = None,
    progress: Callable[[int, int], None] | None = None,
    reference: str = "",
) -> CheckResult:
    """Compare ``grad_model``'s gradients (run in onnxruntime) with central differences of ``model``.

    ``analytic_run(grad_model, feeds) -> {output: value}`` replaces onnxruntime
    (``run_float64`` evaluates the same gradient graph in float64: the tight check).
    ``sample``: check at most that many wrt tensors one by one (a random choice), and every one of
    them together along ``directions`` random directions (``CheckResult.joint``): a bounded number
    of forward runs for models with hundreds of parameters. ``progress(done, total)`` is called
    after each forward run pair. Every model runs in onnxruntime, except where onnx.reference is
    declared: by ``reference`` (the reason, for every run of this check) or, automatically, by the element
    type (see :class:`Runner`); the result records which runtime ran what, and why.
    """
    from ...ir.load import load

    rng = np.random.default_rng(rng)
    model = load(model)          # what grad() differentiates: opsets below 13 upgraded, functions inlined
    spec = gradient_spec(grad_model)
    wrt, of, loss = spec["wrt"], spec["of"], spec["loss"]
    feeds = dict(inputs) if inputs is not None else random_inputs(model, rng)

    model64 = to_float64(model)
    feeds64 = as_float64(feeds)
    targets = [loss] if loss else list(of)
    inits = {i.name: numpy_helper.to_array(i) for i in model64.graph.initializer}
    intermediates = [w for w in wrt if w not in feeds64 and w not in inits]
    declared = _declared(reference)
    base = Runner(_with_outputs(model64, intermediates + targets), **declared)(feeds64, intermediates + targets)
    start = {w: feeds64[w] if w in feeds64 else inits[w] if w in inits else base[w] for w in wrt}
    gfeeds = dict(feeds)
    out_dtype = {o.name: o.type.tensor_type.elem_type for o in grad_model.graph.output}
    seeds64 = {}
    for o in of:
        np_type = helper.tensor_dtype_to_np_dtype(out_dtype.get(o, TensorProto.FLOAT))
        seed = rng.standard_normal(np.shape(base[o])).astype(np_type)   # in the output's precision,
        gfeeds[spec["seeds"][o]] = seed
        seeds64[o] = seed.astype(np.float64)                            # and the same values for the truth
    grad_names = [spec["gradients"][w] for w in wrt]
    grad_backend, grad_reason = "analytic_run", ""
    if analytic_run is None or analytic_run is run_float64:      # a run whose runtime is recorded
        in64 = analytic_run is run_float64
        grad_runner = Runner(to_float64(grad_model) if in64 else grad_model, **declared)
        values = grad_runner(as_float64(gfeeds) if in64 else gfeeds, grad_names)
        grad_backend, grad_reason = grad_runner.backend, grad_runner.reason
    else:
        values = analytic_run(grad_model, gfeeds)
    analytic = {w: np.asarray(values[g], np.float64) for w, g in zip(wrt, grad_names)}

    # inputs and initializers are perturbed in one model; an intermediate tensor in a model of its own
    # where it alone is cut from its producer (the other wrt tensors still follow what they depend on)
    leaves = [w for w in wrt if w not in intermediates]
    runners = {None: Runner(_as_inputs(model64, leaves), **declared)}
    for w in intermediates:
        runners[w] = Runner(_as_inputs(model64, leaves + [w]), **declared)
    point = dict(feeds64)
    point.update({w: np.asarray(start[w], np.float64) for w in leaves})
    errors, numeric = {}, {}
    checked = list(wrt)
    if sample is not None and len(wrt) > sample:
        chosen = set(rng.choice(len(wrt), size=sample, replace=False).tolist())
        checked = [w for i, w in enumerate(wrt) if i in chosen]
    total = sum(np.size(start[w]) if np.size(start[w]) <= max_elements else directions for w in checked)
    total += directions if len(checked) < len(wrt) else 0
    done = 0

    def tick() -> None:
        nonlocal done
        done += 1
        if progress is not None:
            progress(done, total)

    padding = _padding_rows(model)
    for w in checked:
        run = runners.get(w, runners[None])

        def objective(values: dict, run=run) -> float:
            out = run(values, targets)
            if loss:
                return float(np.sum(out[loss]))
            return float(sum(np.sum(seeds64[o] * out[o]) for o in of))

        if w in intermediates:
            point[w] = np.asarray(start[w], np.float64)
        x = point[w]
        a = analytic[w]
        comparable = _comparable(x, padding.get(w, ()))
        if a.shape != x.shape:
            errors[w] = float("inf")
        elif x.size <= max_elements:
            num = a.copy()          # elements that cannot be perturbed (inf, nan) are not compared
            for j in range(x.size):
                if comparable.flat[j]:
                    h = eps * max(1.0, abs(x.flat[j]))
                    num.flat[j] = _central(objective, point, w, j, h)
                tick()
            numeric[w] = num
            scale = max(np.max(np.abs(num), initial=0.0), np.max(np.abs(a), initial=0.0))
            errors[w] = float(np.max(np.abs(a - num), initial=0.0) / max(scale, ABS_FLOOR))
        else:
            worst = 0.0
            finite = comparable
            h = eps * max(1.0, float(np.max(np.abs(x[np.isfinite(x)]), initial=0.0)))
            for _ in range(directions):
                u = np.where(finite, rng.standard_normal(x.shape), 0.0)
                u /= np.linalg.norm(u)
                num = _central(objective, point, w, u, h)
                an = float(np.sum(np.where(finite, a, 0.0) * u))
                worst = max(worst, abs(an - num) / max(abs(an), abs(num), ABS_FLOOR))
                tick()
            errors[w] = worst
        if w in intermediates:
            del point[w]
    joint = None
    if len(checked) < len(wrt):
        joint = _joint_error(runners[None], point, [w for w in leaves if analytic[w].shape == point[w].shape],
                             analytic, objective_of=lambda out: float(np.sum(out[loss])) if loss else float(
                                 sum(np.sum(seeds64[o] * out[o]) for o in of)),
                             targets=targets, rng=rng, eps=eps, directions=directions, tick=tick,
                             padding=padding)
    return CheckResult(errors, analytic, numeric, runners[None].backend, grad_backend, joint, runners[None].reason,
                       grad_reason)


def _comparable(x: np.ndarray, rows: "tuple[int, ...] | list[int]") -> np.ndarray:
    """The elements of ``x`` whose derivative is compared: finite ones, outside an embedding's padding rows
    (PyTorch gives ``padding_idx`` no gradient, which the Gather rule follows; the graph's math gives it one)."""
    mask = np.isfinite(x)
    if len(rows) and x.ndim == 2:
        mask[list(rows)] = False
    return mask


def _padding_rows(model: onnx.ModelProto) -> dict[str, list[int]]:
    """The embedding tables PyTorch's exporter recorded a ``padding_idx`` for: {table: [row]}."""
    from ...ir.model import torch_padding_idx

    rows: dict[str, list[int]] = {}
    for node in model.graph.node:
        if node.op_type == "Gather" and node.domain in ("", "ai.onnx"):
            p = torch_padding_idx(node)
            if p is not None:
                rows.setdefault(node.input[0], []).append(p)
    return rows


def _joint_error(run: "Runner", point: dict, names: list[str], analytic: dict, objective_of, targets: list[str],
                 rng: np.random.Generator, eps: float, directions: int, tick, padding: dict | None = None
                 ) -> float | None:
    """Worst relative error of the directional derivative along random directions over all ``names``."""
    if not names:
        return None
    worst = 0.0
    padding = padding or {}
    for _ in range(directions):
        u = {w: np.where(_comparable(point[w], padding.get(w, ())), rng.standard_normal(point[w].shape), 0.0)
             for w in names}
        norm = np.sqrt(sum(float(np.sum(v * v)) for v in u.values())) or 1.0
        h = eps * max([1.0] + [float(np.max(np.abs(point[w][np.isfinite(point[w])]), initial=0.0)) for w in names])
        an = sum(float(np.sum(np.where(np.isfinite(point[w]), analytic[w], 0.0) * u[w])) for w in names) / norm
        f = [objective_of(run({**point, **{w: point[w] + sign * h * u[w] / norm for w in names}}, targets))
             for sign in (1.0, -1.0)]
        num = (f[0] - f[1]) / (2 * h)
        worst = max(worst, abs(an - num) / max(abs(an), abs(num), ABS_FLOOR))
        tick()
    return worst


def _central(objective, point: dict, name: str, where, h: float) -> float:
    """(f(x + h e) - f(x - h e)) / 2h along element ``where`` (an index) or direction (an array)."""
    x = point[name]
    plus, minus = x.copy(), x.copy()
    if isinstance(where, np.ndarray):
        plus += h * where
        minus -= h * where
    else:
        plus.flat[where] += h
        minus.flat[where] -= h
    f_plus = objective({**point, name: plus})
    f_minus = objective({**point, name: minus})
    return (f_plus - f_minus) / (2 * h)
