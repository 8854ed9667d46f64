"""Property test: random small graphs over the op set, static and symbolic dims.

Each graph's gradient must pass the checker, load and run in onnxruntime with its default
optimizations, and match float64 central differences (onnxgrad.tools.check); likewise each forward-mode
graph's jvp (outputs that depend on no direction, directions that reach no output). A refusal
(UnsupportedOpError) is allowed but recorded with its reason; ``bench/property_run.py`` runs
thousands and prints the tally. The CI count is bounded by ONNXGRAD_PROPERTY_COUNT (default 40).
"""
from __future__ import annotations

import os
from collections import Counter

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxgrad
from onnxgrad.tools.check import check, run_float64
from onnxgrad.tools.check.jvp import check_jvp

F = TensorProto.FLOAT


class _Graph:
    """A random graph under construction: tensors with concrete shapes, nodes, initializers."""

    def __init__(self, rng: np.random.Generator, opset: int, symbolic: bool = False):
        self.rng, self.opset, self.symbolic = rng, opset, symbolic
        self.nodes, self.inits, self.shapes, self.k = [], [], {}, 0
        self.rank_unknown: set[str] = set()

    def name(self, base: str) -> str:
        self.k += 1
        return f"{base}{self.k}"

    def const(self, value: np.ndarray) -> str:
        name = self.name("c")
        self.inits.append(numpy_helper.from_array(value, name))
        return name

    def add(self, op: str, inputs: list[str], shape: tuple, **attrs) -> str:
        out = self.name(op.lower())
        self.nodes.append(helper.make_node(op, inputs, [out], name=self.name(op), **attrs))
        self.shapes[out] = tuple(shape)
        return out

    def hide_rank(self, x: str) -> str:
        """x reshaped to Shape(x)[0:Size(Shape(x))]: the same tensor, its rank unknown to onnx's inference."""
        shape, rank, sliced = self.name("shape"), self.name("rank"), self.name("sliced")
        self.nodes += [helper.make_node("Shape", [x], [shape], name=self.name("Shape")),
                       helper.make_node("Shape", [shape], [rank], name=self.name("Shape")),
                       helper.make_node("Slice", [shape, self.const(np.array([0], np.int64)), rank], [sliced],
                                        name=self.name("Slice"))]
        hidden = self.add("Reshape", [x, sliced], self.shapes[x])
        self.rank_unknown.add(hidden)
        return hidden

    def restore_rank(self, y: str) -> str:
        """Reshape(y, [0] * rank): the rank known again, the dims as they are."""
        return self.add("Reshape", [y, self.const(np.zeros(len(self.shapes[y]), np.int64))], self.shapes[y])


OPS = ["Tanh", "Sigmoid", "Sin", "Mul", "Add", "MatMul", "Transpose", "Reshape", "Concat", "Slice", "Gather", "Pad",
       "ReduceSum", "ReduceMean", "Unsqueeze", "Softmax", "LayerNormalization", "Expand", "Tile", "Split",
       "GatherElements", "Where", "GatherND", "AveragePool"]
# the forward-mode graphs draw from these too (the ops of issue 26's inexact tangent)
FORWARD_OPS = ["Div", "Cosh", "LeakyRelu"]


def _step(g: _Graph, x: str, pool: list[str], ops: list[str] = OPS) -> tuple[str, str]:
    """One random op of ``ops`` applied to x; returns (output, op description)."""
    rng, s = g.rng, g.shapes[x]
    r = len(s)
    op = rng.choice(ops)
    if r == 0 or min(s) == 0:
        return g.add("Tanh", [x], s), "Tanh"
    ax = int(rng.integers(-r, r))
    a = ax % r
    if op in ("Tanh", "Sigmoid", "Sin", "Cosh"):
        return g.add(op, [x], s), op
    if op == "LeakyRelu":
        attrs = {"alpha": 0.1} if rng.random() < 0.5 else {}        # else the default, 0.01
        return g.add("LeakyRelu", [x], s, **attrs), "LeakyRelu"
    if op == "Div":         # by a weight away from 0, or by 1 + p^2 for another tensor p of x's shape
        others = [p for p in pool if g.shapes[p] == s and p != x]
        if others and rng.random() < 0.5:
            p = str(rng.choice(others))
            one = g.const(np.ones((), np.float32))
            return g.add("Div", [x, g.add("Add", [g.add("Mul", [p, p], s), one], s)], s), "Div(1 + p^2)"
        k = int(rng.integers(0, r + 1))
        w = rng.uniform(0.5, 1.5, s[r - k:]) * rng.choice([-1.0, 1.0], s[r - k:])
        return g.add("Div", [x, g.const(w.astype(np.float32))], s), "Div"
    if op in ("Mul", "Add"):
        others = [p for p in pool if g.shapes[p] == s and p != x]
        if others and rng.random() < 0.5:
            y = str(rng.choice(others))
        else:       # a broadcast weight over a suffix of x's dims, some of them 1
            k = int(rng.integers(0, r + 1))
            wshape = tuple(d if rng.random() < 0.6 else 1 for d in s[r - k:])
            y = g.const(rng.standard_normal(wshape).astype(np.float32))
        return g.add(op, [x, y], s), f"{op}"
    if op == "MatMul":
        n = int(rng.integers(1, 4))
        w = g.const(rng.standard_normal((s[-1], n)).astype(np.float32) * 0.5)
        return g.add("MatMul", [x, w], s[:-1] + (n,)), "MatMul"
    if op == "Transpose":
        perm = [int(p) for p in rng.permutation(r)]
        return g.add("Transpose", [x], tuple(s[p] for p in perm), perm=perm), "Transpose"
    if op == "Reshape" and r >= 2:   # merge the last two dims, with 0 (copy) and -1
        shape = [0] * (r - 2) + [-1]
        return g.add("Reshape", [x, g.const(np.array(shape, np.int64))], s[:-2] + (s[-2] * s[-1],)), "Reshape"
    if op == "Concat":
        others = [p for p in pool if len(g.shapes[p]) == r and all(g.shapes[p][i] == s[i] for i in range(r) if i != a)]
        y = str(rng.choice(others))
        shape = tuple(s[i] + (g.shapes[y][i] if i == a else 0) for i in range(r))
        return g.add("Concat", [x, y, x], tuple(d + (s[a] if i == a else 0) for i, d in enumerate(shape)), axis=ax), \
            "Concat"
    if op == "Slice" and s[a] >= 2:
        step = int(rng.choice([1, 2, -1]))
        start, end = (0, s[a]) if step > 0 else (-1, -s[a] - 1)
        if rng.random() < 0.5:
            start = 1 if step > 0 else -2
        out = len(range(*slice(start, end, step).indices(s[a])))
        shape = tuple(out if i == a else d for i, d in enumerate(s))
        return g.add("Slice", [x, g.const(np.array([start], np.int64)), g.const(np.array([end], np.int64)),
                               g.const(np.array([ax], np.int64)), g.const(np.array([step], np.int64))], shape), \
            f"Slice(step={step})"
    if op == "Gather":
        if rng.random() < 0.5:
            idx = np.array(int(rng.integers(-s[a], s[a])), np.int64)
        else:
            idx = rng.integers(-s[a], s[a], size=int(rng.integers(1, 4))).astype(np.int64)
        shape = s[:a] + idx.shape + s[a + 1:]
        return g.add("Gather", [x, g.const(idx)], shape, axis=ax), f"Gather(idx{idx.ndim}d)"
    if op == "Pad":
        mode = str(rng.choice(["constant", "edge", "reflect"]))
        b, e = int(rng.integers(0, 3)), int(rng.integers(0, 3))
        if mode == "reflect":
            b, e = min(b, s[a] - 1), min(e, s[a] - 1)
        shape = tuple(d + (b + e if i == a else 0) for i, d in enumerate(s))
        if g.opset >= 18 and rng.random() < 0.3:    # Pad-18's axes input, negative axes included
            return g.add("Pad", [x, g.const(np.array([b, e], np.int64)), "", g.const(np.array([ax], np.int64))],
                         shape, mode=mode), f"Pad({mode}, axes)"
        pads = [0] * (2 * r)
        pads[a], pads[a + r] = b, e
        return g.add("Pad", [x, g.const(np.array(pads, np.int64))], shape, mode=mode), f"Pad({mode})"
    if op in ("ReduceSum", "ReduceMean") and r >= 2:
        keep = int(rng.integers(0, 2))
        shape = tuple(1 if i == a else d for i, d in enumerate(s)) if keep else s[:a] + s[a + 1:]
        if op == "ReduceSum" or g.opset >= 18:
            return g.add(op, [x, g.const(np.array([ax], np.int64))], shape, keepdims=keep), op
        return g.add(op, [x], shape, axes=[ax], keepdims=keep), op
    if op == "Unsqueeze" and r < 4:
        return g.add("Unsqueeze", [x, g.const(np.array([a], np.int64))], s[:a] + (1,) + s[a:]), "Unsqueeze"
    if op == "Softmax":
        return g.add("Softmax", [x], s, axis=ax), "Softmax"
    if op == "LayerNormalization" and g.opset >= 17:
        scale = g.const((1 + 0.3 * rng.standard_normal(s[-1])).astype(np.float32))
        return g.add("LayerNormalization", [x, scale], s, axis=-1), "LayerNormalization"
    if op == "Expand" and r < 4:
        shape = (2,) + s
        return g.add("Expand", [x, g.const(np.array(shape, np.int64))], shape), "Expand"
    if op == "Split" and s[a] >= 2:
        first = int(rng.integers(1, s[a]))
        outs = [g.name("split"), g.name("split")]
        g.nodes.append(helper.make_node("Split", [x, g.const(np.array([first, s[a] - first], np.int64))], outs,
                                        axis=ax, name=g.name("Split")))
        g.shapes[outs[0]] = tuple(first if i == a else d for i, d in enumerate(s))
        g.shapes[outs[1]] = tuple(s[a] - first if i == a else d for i, d in enumerate(s))
        pool.append(outs[0])
        return outs[1], "Split"
    if op == "Where":
        cond = g.const(rng.random(s) < 0.5)
        return g.add("Where", [cond, x, g.const(np.float32(0.5))], s), "Where"
    hide = g.symbolic and op in ("Tile", "GatherElements", "GatherND") and rng.random() < 0.4
    if hide:      # the op on an operand of unknown rank, the rank restored after it
        y, what = _step_on(g, g.hide_rank(x), op, s, a, ax)
        g.rank_unknown.add(y)
        return g.restore_rank(y), f"{what}(rank unknown)"
    if op in ("Tile", "GatherElements", "GatherND"):
        return _step_on(g, x, op, s, a, ax)
    if op == "AveragePool" and r == 3:      # 1-D pooling of [N, C, L], partial windows included
        k, st = int(rng.integers(1, 4)), int(rng.integers(1, 3))
        attrs = dict(kernel_shape=[k], strides=[st], count_include_pad=int(rng.integers(0, 2)))
        kind = rng.choice(["pads", "ceil", "same"])
        if kind == "same":      # (k >= stride: onnxruntime's AveragePool refuses the negative pads otherwise)
            attrs["kernel_shape"] = [max(k, st)]
            attrs["auto_pad"] = str(rng.choice(["SAME_UPPER", "SAME_LOWER"]))
            out = -(-s[2] // st)
        else:
            pb, pe = min(int(rng.integers(0, 2)), k - 1), min(int(rng.integers(0, 2)), k - 1)
            attrs["pads"] = [pb, pe]
            num = s[2] + pb + pe - k
            out = num // st + 1
            # ceil_mode where its last window starts inside x (past it, onnx's shape inference keeps
            # the window that onnxruntime drops)
            if kind == "ceil" and (-(-num // st)) * st < s[2] + pb:
                attrs["ceil_mode"] = 1
                out = -(-num // st) + 1
        if out < 1 or s[2] + sum(attrs.get("pads", [0, 0])) < k:
            return g.add("Tanh", [x], s), "Tanh"
        return g.add("AveragePool", [x], (s[0], s[1], out), **attrs), f"AveragePool({kind})"
    return g.add("Tanh", [x], s), "Tanh"


def _step_on(g: _Graph, x: str, op: str, s: tuple, a: int, ax: int) -> tuple[str, str]:
    """Tile, GatherElements or GatherND of x (shaped s; a = ax mod rank)."""
    rng, r = g.rng, len(s)
    if op == "Tile":
        reps = [int(rng.integers(1, 3)) for _ in s]
        return g.add("Tile", [x, g.const(np.array(reps, np.int64))], tuple(d * t for d, t in zip(s, reps))), "Tile"
    if op == "GatherElements":
        idx = rng.integers(-s[a], s[a], size=s).astype(np.int64)
        return g.add("GatherElements", [x, g.const(idx)], s, axis=ax), "GatherElements"
    bd = int(rng.integers(0, min(2, r)))           # GatherND: batch dims, then k indexed dims
    k = int(rng.integers(1, r - bd + 1))
    rows = int(rng.integers(1, 4))
    idx = np.stack([rng.integers(-d, d, size=s[:bd] + (rows,)) for d in s[bd:bd + k]], axis=-1).astype(np.int64)
    return g.add("GatherND", [x, g.const(idx)], s[:bd] + (rows,) + s[bd + k:], batch_dims=bd), f"GatherND(bd={bd})"


def random_case(seed: int, symbolic: bool) -> tuple[onnx.ModelProto, dict, list[str], list[str]]:
    """A random model, its feeds, the tensors to differentiate and the op sequence."""
    rng = np.random.default_rng(seed)
    opset = int(rng.choice([13, 17, 18]))
    g = _Graph(rng, opset, symbolic)
    r = int(rng.integers(1, 4))
    shape = tuple(int(d) for d in rng.integers(2, 5, size=r))
    g.shapes["x"] = shape
    pool, ops, h = ["x"], [], "x"
    for _ in range(int(rng.integers(2, 6))):
        h, what = _step(g, h, pool)
        pool.append(h)
        ops.append(what)
    names: dict[int, str] = {}
    dims = [f"d{i}" if rng.random() < 0.7 else None for i in range(r)] if symbolic else list(shape)
    x = helper.make_tensor_value_info("x", F, dims)
    y = helper.make_tensor_value_info(h, F, [f"y{i}" for i in range(len(g.shapes[h]))] if symbolic
                                      else list(g.shapes[h]))
    m = helper.make_model(helper.make_graph(g.nodes, f"case{seed}", [x], [y], g.inits),
                          opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 8
    del names
    wrt = ["x"] + [t.name for t in g.inits if t.data_type == F and rng.random() < 0.5]
    if len(g.nodes) > 2 and rng.random() < 0.3:      # an intermediate tensor too (the first float one)
        # (not one of unknown rank: its gradient output would have no shape, which the checker rejects)
        wrt.append(next(o for node in g.nodes for o in node.output if o in g.shapes and o not in g.rank_unknown))
    feeds = {"x": rng.standard_normal(shape).astype(np.float32)}
    return m, feeds, list(dict.fromkeys(wrt)), ops


def run_one(seed: int, symbolic: bool) -> tuple[str, str]:
    """('ok' | 'refused' | 'invalid' | 'wrong', detail)."""
    m, feeds, wrt, ops = random_case(seed, symbolic)
    label = f"seed {seed} {'symbolic' if symbolic else 'static'} {' -> '.join(ops)}"
    try:    # allow_unused: a random graph may make a weight irrelevant (Where, a Gather of other rows)
        gm = onnxgrad.grad(m, wrt=wrt, of=[m.graph.output[0].name], allow_unused=True)
    except onnxgrad.UnsupportedOpError as e:
        return "refused", f"{label}: {e}"
    try:
        onnx.checker.check_model(gm, full_check=True)
        ort.InferenceSession(gm.SerializeToString(), providers=["CPUExecutionProvider"])  # default optimizations
        r = check(m, gm, feeds, max_elements=40)
    except Exception as e:
        return "invalid", f"{label}: {type(e).__name__}: {str(e).strip().splitlines()[0][:300]}"
    if r.grad_backend != "onnxruntime":
        return "invalid", f"{label}: onnxruntime did not run the gradient graph"
    if not r.ok(5e-3):
        # float32 rounding in an ill-conditioned graph (LayerNormalization of a nearly constant row),
        # or a wrong formula: the same gradient graph in float64 tells them apart
        r64 = check(m, gm, feeds, max_elements=40, analytic_run=run_float64)
        if not r64.ok(1e-4):
            return "wrong", f"{label}: {r64.errors}"
    return "ok", label


def random_forward_case(seed: int, symbolic: bool) -> tuple[onnx.ModelProto, dict, list[str], list[str]]:
    """A random model for forward mode: inputs x0 and x1 (one shape), a branch of ops from each (reading the
    other's tensors, or not), a branch of weights alone, and several outputs; directions at a random subset of
    the inputs, weights and an intermediate tensor. So some outputs depend on no direction (torch.func.jvp: zero
    tangents) and some directions reach no output. Returns the model, its feeds, wrt and the op sequence."""
    rng = np.random.default_rng(seed)
    opset = int(rng.choice([13, 17, 18]))
    g = _Graph(rng, opset, symbolic)
    r = int(rng.integers(1, 4))
    shape = tuple(int(d) for d in rng.integers(2, 5, size=r))
    mixed = rng.random() < 0.5
    every = ["x0", "x1"]
    pools = {"x0": every if mixed else ["x0"], "x1": every if mixed else ["x1"]}
    ops, heads = [], []
    g.shapes.update({"x0": shape, "x1": shape})
    for x in ("x0", "x1"):
        h = x
        for _ in range(int(rng.integers(1, 4))):
            h, what = _step(g, h, pools[x], OPS + FORWARD_OPS)
            pools[x].append(h)
            ops.append(f"{x}:{what}")
        heads.append(h)
    if rng.random() < 0.5:      # an output of the weights alone
        heads.append(g.add("Sigmoid", [g.const(rng.standard_normal(shape).astype(np.float32))], shape))
        ops.append("Sigmoid(weight)")
    inner = [o for node in g.nodes for o in node.output if o in g.shapes and o not in g.rank_unknown]
    if rng.random() < 0.3:      # an intermediate tensor as an output too
        heads.append(str(rng.choice(inner)))
    dims = [f"d{i}" if rng.random() < 0.7 else None for i in range(r)] if symbolic else list(shape)
    outputs = [helper.make_tensor_value_info(y, F, [f"{y}_{i}" for i in range(len(g.shapes[y]))] if symbolic
                                             else list(g.shapes[y])) for y in dict.fromkeys(heads)]
    m = helper.make_model(helper.make_graph(g.nodes, f"forward{seed}",
                                            [helper.make_tensor_value_info(x, F, dims) for x in ("x0", "x1")],
                                            outputs, g.inits), opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 8
    wrt = [x for x in ("x0", "x1") if rng.random() < 0.6] or [str(rng.choice(["x0", "x1"]))]
    wrt += [t.name for t in g.inits if t.data_type == F and rng.random() < 0.3]
    if rng.random() < 0.3:
        wrt.append(str(rng.choice(inner)))
    feeds = {x: rng.standard_normal(shape).astype(np.float32) for x in ("x0", "x1")}
    return m, feeds, list(dict.fromkeys(wrt)), ops


def run_one_forward(seed: int, symbolic: bool, allow_unused: bool = True) -> tuple[str, str]:
    """('ok' | 'refused' | 'unused' | 'invalid' | 'wrong', detail) for jvp on a random forward-mode graph.
    'unused': the UnusedError of allow_unused=False (jvp's default before issue 26)."""
    m, feeds, wrt, ops = random_forward_case(seed, symbolic)
    label = f"seed {seed} {'symbolic' if symbolic else 'static'} wrt {wrt}: {' -> '.join(ops)}"
    try:
        jm = onnxgrad.jvp(m, wrt=wrt, allow_unused=allow_unused)
    except onnxgrad.UnsupportedOpError as e:
        return "refused", f"{label}: {e}"
    except onnxgrad.UnusedError as e:
        return "unused", f"{label}: {e}"
    try:
        onnx.checker.check_model(jm, full_check=True)
        ort.InferenceSession(jm.SerializeToString(), providers=["CPUExecutionProvider"])  # default optimizations
        errors, _ = check_jvp(m, jm, feeds)
    except Exception as e:
        return "invalid", f"{label}: {type(e).__name__}: {str(e).strip().splitlines()[0][:300]}"
    if not all(np.isfinite(e) and e <= 5e-3 for e in errors.values()):
        errors, _ = check_jvp(m, jm, feeds, run=run_float64)   # float32 rounding, or a wrong formula
        if not all(np.isfinite(e) and e <= 1e-4 for e in errors.values()):
            return "wrong", f"{label}: {errors}"
    return "ok", label


COUNT = int(os.environ.get("ONNXGRAD_PROPERTY_COUNT", "40"))


def _run_many(run, symbolic: bool, failures: tuple[str, ...]) -> None:
    """COUNT // 2 seeded graphs through ``run``: none of the ``failures`` kinds, and at least half of them ok."""
    tally, bad = Counter(), []
    for seed in range(COUNT // 2):
        kind, detail = run(seed, symbolic)
        tally[kind] += 1
        if kind in failures:
            bad.append(detail)
    assert not bad, "\n".join(bad)
    assert tally["ok"] >= COUNT // 4, tally


@pytest.mark.parametrize("symbolic", [False, True], ids=["static", "symbolic"])
def test_random_graphs(symbolic):
    _run_many(run_one, symbolic, ("wrong", "invalid"))


@pytest.mark.parametrize("symbolic", [False, True], ids=["static", "symbolic"])
def test_random_graphs_forward_mode(symbolic):
    """jvp on random graphs where outputs may depend on no direction and directions may reach no output."""
    _run_many(run_one_forward, symbolic, ("wrong", "invalid", "unused"))
