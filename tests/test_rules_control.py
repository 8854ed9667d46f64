"""Gradients through If, Loop and Scan: a table of control-flow models, first and second order.

Each model is checked as every rule is: the gradient graph in onnxruntime (float32) and in float64
against float64 central differences of the forward, at opset 13 and at the newest opset onnxruntime
runs; then grad(grad(model)) against central differences of the first gradient model.
"""
from __future__ import annotations

import numpy as np
import onnx
import onnx.parser
import pytest

import onnxgrad
from harness import rng
from onnxgrad.tools.check import Runner, check, gradient_spec, run_float64

OPSETS = (13, onnxgrad.ir.load.runtime_max_opset())


def _model(text: str, opset: int) -> onnx.ModelProto:
    m = onnx.parser.parse_model(f'<ir_version: 8, opset_import: ["" : {opset}]>\n' + text)
    m.ir_version = onnxgrad.ir.load.emitted_ir_version(m)
    onnx.checker.check_model(m, full_check=True)
    return m


def _f(*shape, low=-1.0, high=1.0):
    return rng().uniform(low, high, shape).astype(np.float32)


# name -> (model text, feeds, wrt); every float graph input is differentiated unless wrt says
IF_OUTER = ("""
m (bool c, float[3] x, float[3] w) => (float[3] y) {
    y = If (c) <then_branch = g1 () => (float[3] a) { t = Mul (x, w)  a = Tanh (t) },
                else_branch = g2 () => (float[3] b) { b = Mul (x, x) }>
}""")
IF_NESTED = ("""
m (bool c, bool d, float[2,3] x, float[3] w, float[3] v) => (float[2,3] y, float[2,3] z) {
    y, z = If (c) <
      then_branch = g1 () => (float[2,3] a, float[2,3] a2) {
        a = If (d) <then_branch = h1 () => (float[2,3] p) { q = Mul (x, w)  p = Sin (q) },
                    else_branch = h2 () => (float[2,3] r) { r = Add (x, v) }>
        a2 = Mul (a, x)
      },
      else_branch = g2 () => (float[2,3] b, float[2,3] b2) { b = Sub (x, w)  b2 = Identity (x) }>
}""")
SCAN_RNN = ("""
m (float[2,4] h0, float[2,4] s0, float[5,2,3] xs, float[3,4] W, float[4,4] U) => (float[2,4] h, float[2,4] s, float[5,2,4] ys) {
    h, s, ys = Scan (h0, s0, xs) <num_scan_inputs = 1, body = step (float[2,4] hp, float[2,4] sp, float[2,3] x) => (float[2,4] hn, float[2,4] sn, float[2,4] y) {
        a = MatMul (x, W)
        r = MatMul (hp, U)
        pre = Add (a, r)
        hn = Tanh (pre)
        sn = Add (sp, hn)
        y = Mul (hn, sp)
    }>
}""")
SCAN_AXES = ("""
m (float[3] s0, float[2,4,3] xa, float[4,3] xb, float[3] w) => (float[3] s, float[3,2,4] ya, float[4,3] yb) {
    s, ya, yb = Scan (s0, xa, xb) <num_scan_inputs = 2, scan_input_axes = [1, 0], scan_input_directions = [1, 0],
                                   scan_output_axes = [-1, 0], scan_output_directions = [0, 1],
      body = step (float[3] sp, float[2,3] a, float[3] b) => (float[3] sn, float[3,2] oa, float[3] ob) {
        ab = Mul (a, b)
        zero = Constant <value = int64[1] {0}> ()
        red = ReduceSum <keepdims = 0> (ab, zero)
        q = Mul (sp, w)
        sn = Add (q, red)
        at = Transpose (a)
        e = Sin (sp)
        one = Constant <value = int64[1] {1}> ()
        eu = Unsqueeze (e, one)
        oa = Mul (at, eu)
        ob = Mul (sn, b)
    }>
}""")
LOOP = """
m (int64 M, float[2,3] h0, float[3,3] W, float[3] b) => (float[2,3] h, float[{trips},2,3] hs) {{
    t = Constant <value = bool {{1}}> ()
    h, hs = Loop ({m}, t, h0) <body = step (int64 i, bool c, float[2,3] hp) => (bool co, float[2,3] hn, float[2,3] y) {{
        co = Identity (c)
        a = MatMul (hp, W)
        fi = Cast <to = 1> (i)
        sb = Mul (b, fi)
        pre = Add (a, sb)
        hn = Tanh (pre)
        y = Mul (hn, hp)
    }}>
}}"""
LOOP_STATIC = LOOP.format(trips=4, m="four").replace("    t = ", "    four = Constant <value = int64 {4}> ()\n    t = ").replace(
    "int64 M, ", "")
LOOP_DYNAMIC = LOOP.format(trips="T", m="M")
LOOP_EARLY = ("""
m (float[3] h0, float[3] w, float limit) => (float[3] h, float[N,3] hs) {
    t = Constant <value = bool {1}> ()
    none = Constant <value = int64 {100}> ()
    h, hs = Loop (none, t, h0) <body = step (int64 i, bool c, float[3] hp) => (bool co, float[3] hn, float[3] y) {
        q = Mul (hp, w)
        hn = Add (q, w)
        y = Sin (hn)
        tot = ReduceSum <keepdims = 0> (hn)
        co = Less (tot, limit)
    }>
}""")
LOOP_NESTED_IF = ("""
m (float[3] h0, float[3] w, float[3] v) => (float[3] h) {
    three = Constant <value = int64 {3}> ()
    two = Constant <value = int64 {2}> ()
    t = Constant <value = bool {1}> ()
    h = Loop (three, t, h0) <body = outer (int64 i, bool c, float[3] hp) => (bool co, float[3] hn) {
        co = Identity (c)
        g = Loop (two, c, hp) <body = inner (int64 j, bool c2, float[3] gp) => (bool co2, float[3] gn) {
            co2 = Identity (c2)
            m1 = Mul (gp, w)
            gn = Sin (m1)
        }>
        one = Constant <value = int64 {1}> ()
        odd = Mod (i, two)
        isodd = Equal (odd, one)
        hn = If (isodd) <then_branch = a () => (float[3] p) { p = Add (g, v) },
                         else_branch = b () => (float[3] r) { r = Mul (g, v) }>
    }>
}""")
# A state that grows each trip ([k, 3] -> [k + 1, 3]: a row made from the state and W appended): the
# forward stores it flat (a scan output keeps one shape), the backward's Concat splits at run-time sizes.
LOOP_GROWING = """
m ({m_in}float[{rows},3] s0, float[3,3] W, float[3] v) => (float[K,3] s, float[3] h, float[T,3] ys) {{
    {trips}
    t = Constant <value = bool {{1}}> ()
    s, h, ys = Loop ({m}, t, s0, v) <body = step (int64 i, bool c, float[N,3] sp, float[3] hp) => (bool co, float[M,3] sn, float[3] hn, float[3] y) {{
        co = Identity (c)
        zero = Constant <value = int64[1] {{0}}> ()
        axes = Constant <value = int64[1] {{0}}> ()
        tot = ReduceSum <keepdims = 0> (sp, axes)
        a = MatMul (tot, W)
        hn = Mul (hp, a)
        r = Tanh (a)
        ru = Unsqueeze (r, zero)
        sn = Concat <axis = 0> (sp, ru)
        y = Sin (hn)
    }}>
}}"""
LOOP_GROWING_STATIC = LOOP_GROWING.format(m_in="", rows=2, m="three",
                                          trips="three = Constant <value = int64 {3}> ()")
LOOP_GROWING_DYNAMIC = LOOP_GROWING.format(m_in="int64 M, ", rows="R", m="M", trips="")

# An If whose condition is known at build time (AffineGrid's function body: If(Size(size) == 4)), here
# decided through a first If: its branches return tensors of different ranks, so onnx's inference leaves
# t (and the MatMul after it) unranked, and the then-branch's Squeeze without axes needs the dims the
# folded shape gives. The If is differentiated as the branch it takes; the other is never run.
IF_CONSTANT = """
m (float[2,3] x, float[3,4] w, float[3] v) => (float[{y}] y) {{
    size = Constant <value = int64[{n}] {{{size}}}> ()
    n = Size (size)
    two = Constant <value = int64 {{2}}> ()
    is2d = Equal (n, two)
    one_1d = Constant <value = int64[1] {{1}}> ()
    shape = Concat <axis = 0> (one_1d, size)
    k = If (is2d) <then_branch = h1 () => (k1) {{ k1 = Constant <value = int64 {{1}}> () }},
                   else_branch = h2 () => (k2) {{ k2 = Constant <value = int64 {{2}}> () }}>
    one = Constant <value = int64 {{1}}> ()
    first = Equal (k, one)
    t = If (first) <
      then_branch = g1 () => (a) {{ e = Expand (x, shape)  s = Sin (e)  a = Squeeze (s) }},
      else_branch = g2 () => (b) {{ zero = Constant <value = int64[1] {{0}}> ()  p = Mul (x, v)  b = Unsqueeze (p, zero) }}>
    y = MatMul (t, w)
}}"""
IF_CONSTANT_2D = IF_CONSTANT.format(y="A,B", n=2, size="2, 3")        # then: t is [2,3]
IF_CONSTANT_3D = IF_CONSTANT.format(y="A,B,C", n=3, size="1, 2, 3")   # else: t is [1,2,3]

# AffineGrid's function body with its size a graph input (int64[4], values fed at run time): the If is decided
# by Size(size), which the declared shape gives at build time; its branches' ranks differ (the else branch
# never runs), so only the taken branch tells t's rank; the then-branch expands to the run-time size.
IF_SIZE_INPUT = """
m (int64[2] size, float[2,3] x, float[3,4] w, float[3] v) => (float[A,B] y) {
    n = Size (size)
    two = Constant <value = int64 {2}> ()
    is2d = Equal (n, two)
    t = If (is2d) <
      then_branch = g1 () => (a) { s = Sin (x)  sv = Mul (s, v)  a = Expand (sv, size) },
      else_branch = g2 () => (b) { zero = Constant <value = int64[1] {0}> ()  p = Mul (x, v)  b = Unsqueeze (p, zero) }>
    y = MatMul (t, w)
}"""

# The same decided by the rank of an input of any batch: Size(Shape(x)) is 2, which inference tells (an
# exporter's AffineGrid size is Shape of the image, whose batch is dynamic).
IF_RANK_OF_INPUT = """
m (float[N,3] x, float[3,4] w, float[3] v) => (float[N,4] y) {
    s = Shape (x)
    n = Size (s)
    two = Constant <value = int64 {2}> ()
    is2d = Equal (n, two)
    t = If (is2d) <
      then_branch = g1 () => (a) { e = Sin (x)  a = Mul (e, v) },
      else_branch = g2 () => (b) { zero = Constant <value = int64[1] {0}> ()  p = Mul (x, v)  b = Unsqueeze (p, zero) }>
    y = MatMul (t, w)
}"""


def _constant_if_feeds():
    return {"x": _f(2, 3), "w": _f(3, 4), "v": _f(3)}


CASES = {
    "if_then": (IF_OUTER, lambda: {"c": np.array(True), "x": _f(3), "w": _f(3)}),
    "if_else": (IF_OUTER, lambda: {"c": np.array(False), "x": _f(3), "w": _f(3)}),
    "if_nested": (IF_NESTED, lambda: {"c": np.array(True), "d": np.array(True), "x": _f(2, 3), "w": _f(3),
                                      "v": _f(3)}),
    "if_nested_else": (IF_NESTED, lambda: {"c": np.array(True), "d": np.array(False), "x": _f(2, 3),
                                           "w": _f(3), "v": _f(3)}),
    "scan_rnn": (SCAN_RNN, lambda: {"h0": _f(2, 4), "s0": _f(2, 4), "xs": _f(5, 2, 3), "W": _f(3, 4),
                                    "U": _f(4, 4)}),
    "scan_axes_directions": (SCAN_AXES, lambda: {"s0": _f(3), "xa": _f(2, 4, 3), "xb": _f(4, 3),
                                                 "w": _f(3, low=0.5, high=0.9)}),
    "loop_static": (LOOP_STATIC, lambda: {"h0": _f(2, 3), "W": _f(3, 3), "b": _f(3)}),
    "loop_dynamic": (LOOP_DYNAMIC, lambda: {"M": np.array(3, np.int64), "h0": _f(2, 3), "W": _f(3, 3),
                                            "b": _f(3)}),
    # w > 0 grows the sum each trip: the loop ends after 4 trips, well inside the limit's margins
    "loop_early_exit": (LOOP_EARLY, lambda: {"h0": np.array([0.1, 0.2, 0.3], np.float32),
                                             "w": np.array([0.5, 0.6, 0.7], np.float32),
                                             "limit": np.array(7.0, np.float32)}),
    "loop_growing_state": (LOOP_GROWING_STATIC, lambda: {"s0": _f(2, 3), "W": _f(3, 3, low=-0.5, high=0.5),
                                                          "v": _f(3)}),
    "loop_growing_dynamic": (LOOP_GROWING_DYNAMIC, lambda: {"M": np.array(4, np.int64), "s0": _f(1, 3),
                                                            "W": _f(3, 3, low=-0.5, high=0.5), "v": _f(3)}),
    "loop_nested_if": (LOOP_NESTED_IF, lambda: {"h0": _f(3), "w": _f(3), "v": _f(3)}),
    "if_constant_then": (IF_CONSTANT_2D, _constant_if_feeds),
    "if_constant_else": (IF_CONSTANT_3D, _constant_if_feeds),
    "if_decided_by_input_size": (IF_SIZE_INPUT, lambda: {"size": np.array([2, 3], np.int64),
                                                         **_constant_if_feeds()}),
    "if_decided_by_input_rank": (IF_RANK_OF_INPUT, _constant_if_feeds),
}


def _floats(model, feeds):
    return [vi.name for vi in model.graph.input if feeds[vi.name].dtype == np.float32]


@pytest.mark.parametrize("opset", OPSETS)
@pytest.mark.parametrize("name", list(CASES))
def test_first_order(name, opset):
    text, make = CASES[name]
    model, feeds = _model(text, opset), make()
    wrt = _floats(model, feeds)
    gm = onnxgrad.grad(model, wrt=wrt, of=[o.name for o in model.graph.output])
    onnx.checker.check_model(gm, full_check=True)
    assert Runner(gm, runtime="onnxruntime").backend == "onnxruntime"        # stock onnxruntime runs it
    r32 = check(model, gm, feeds, max_elements=48)
    assert r32.grad_backend == "onnxruntime" and r32.ok(2e-3), f"{name}: float32 errors {r32.errors}"
    r64 = check(model, gm, feeds, max_elements=48, analytic_run=run_float64)
    assert r64.ok(1e-6), f"{name}: float64 errors {r64.errors}"
    assert any(a.any() for a in r64.analytic.values())            # a gradient of zeros proves nothing


@pytest.mark.parametrize("name", list(CASES))
def test_second_order(name):
    """grad(grad(m)): the first gradient model's gradients (of its inputs and of its seeds), checked."""
    text, make = CASES[name]
    model, feeds = _model(text, OPSETS[-1]), make()
    wrt = _floats(model, feeds)
    of = [o.name for o in model.graph.output]
    gm = onnxgrad.grad(model, wrt=wrt, of=of)
    spec = gradient_spec(gm)
    forward = Runner(model)(feeds)
    rng = np.random.default_rng(7)
    feeds = {**feeds, **{spec["seeds"][o]: rng.standard_normal(forward[o].shape).astype(np.float32) for o in of}}
    ggm = onnxgrad.grad(gm, wrt=wrt + list(spec["seeds"].values()), of=list(spec["gradients"].values()),
                        allow_unused=True)
    onnx.checker.check_model(ggm, full_check=True)
    r = check(gm, ggm, feeds, max_elements=24, analytic_run=run_float64)
    assert r.ok(1e-5), f"{name}: second-order errors {r.errors}"


# Scan-8 (opset 8) scans every input and output along a leading batch axis; Scan-9 has none. (xi and hs are
# tensors inside the graph: the converter declares them unbatched in value_info.)
SCAN8_BATCH = """
m (float[2,3] h0, float[2,4,3] xs, float[3,3] W) => (float[2,3] h, float[2,4,3] ys) {
    xi = Identity (xs)
    hs, ys = Scan ("", h0, xi) <num_scan_inputs = 1, directions = [1],
      body = step (float[3] hp, float[3] x) => (float[3] hn, float[3] y) {
        r = MatMul (hp, W)
        a = Add (r, x)
        hn = Tanh (a)
        y = Mul (hn, x)
    }>
    h = Identity (hs)
}"""


def test_scan8_keeps_its_batch_axis():
    """An opset-8 Scan keeps its interface through the upgrade (onnx's converter strips the batch axis from the
    declared shapes: test_scan_sum's gradient model took a seed of another rank than the model's output): the
    forward is onnxruntime's Scan-8, and the gradients hold in float32 and float64."""
    import onnxruntime as ort

    model = _model(SCAN8_BATCH, 8)
    feeds = {"h0": _f(2, 3), "xs": _f(2, 4, 3), "W": _f(3, 3)}
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    expected = dict(zip(["h", "ys"], session.run(None, feeds)))
    loaded = onnxgrad.ir.load.load(model)
    assert [d.dim_value for d in loaded.graph.input[0].type.tensor_type.shape.dim] == [2, 3]
    got = Runner(loaded)(feeds)
    for name, value in expected.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-6, atol=1e-6)
    gm = onnxgrad.grad(model, wrt=["h0", "xs", "W"], of=["h", "ys"])
    onnx.checker.check_model(gm, full_check=True)
    seeds = {s: np.ones_like(expected[o]) for o, s in gradient_spec(gm)["seeds"].items()}
    Runner(gm, runtime="onnxruntime")({**feeds, **seeds})         # the seeds have the outputs' shapes
    assert check(model, gm, feeds, max_elements=48).ok(2e-3)
    r64 = check(model, gm, feeds, max_elements=48, analytic_run=run_float64)
    assert r64.ok(1e-6), r64.errors


def test_iterations_stored_not_intermediates():
    """The forward Scan stores the state at each step (its extra scan outputs), nothing more."""
    model = _model(SCAN_RNN, OPSETS[-1])
    gm = onnxgrad.grad(model, wrt=["W", "U"], of=["ys"])
    scans = [n for n in gm.graph.node if n.op_type == "Scan"]
    assert len(scans) == 2 and len(scans[0].output) == 3 + 2      # h, s, ys + hp, sp per iteration
    assert [a.i for a in scans[1].attribute if a.name == "num_scan_inputs"] == [4]   # hp, sp, x, dys


def test_unknown_rank_is_declined():
    """A branch reading a tensor whose rank nothing tells (a Reshape to a run-time shape) is refused, naming
    the node and what to declare, never differentiated wrongly."""
    model = _model("""
m (bool c, float[6] x, int64[K] s) => (float[6] y) {
    r = Reshape (x, s)
    y = If (c) <then_branch = g1 () => (float[6] a) { t = Sin (r)  f = Constant <value = int64[1] {-1}> ()  a = Reshape (t, f) },
                else_branch = g2 () => (float[6] b) { b = Identity (x) }>
}""", 13)
    with pytest.raises(onnxgrad.UnsupportedOpError, match=r"If_1.*rank"):
        onnxgrad.grad(model, wrt=["x"], of=["y"])


def test_ops_lists_control_flow():
    from onnxgrad.tools.coverage import coverage

    status = {row.op_type: row.status for row in coverage()}
    assert status["If"] == status["Loop"] == status["Scan"] == "rule"


def _same_nodes(a, b) -> bool:
    """The same nodes, in order (their subgraphs' nodes too), but for the names the pass gives unnamed nodes."""
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if (x.op_type, list(x.input), list(x.output)) != (y.op_type, list(y.input), list(y.output)):
            return False
        for ax, ay in zip(x.attribute, y.attribute):
            if ax.type == onnx.AttributeProto.GRAPH:
                if not _same_nodes(ax.g.node, ay.g.node):
                    return False
            elif ax != ay:
                return False
    return True


@pytest.mark.parametrize("text, rank, zero", [(IF_CONSTANT_2D, 2, "v"), (IF_CONSTANT_3D, 3, None)],
                         ids=["then", "else"])
def test_constant_if_is_its_taken_branch(text, rank, zero):
    """An If decided at build time: the forward is kept as given, the backward is the taken branch's VJP (no
    If), the If's outputs get the taken branch's rank, and a tensor only the other branch reads gets zeros."""
    model = _model(text, OPSETS[-1])
    infos = onnxgrad.ir.model.tensor_infos(onnxgrad.ir.model.infer(model))[0]
    assert len(infos["t"].shape) == rank and len(infos["y"].shape) == rank
    gm = onnxgrad.grad(model, wrt=["x", "w", "v"], of=["y"])
    forward = len(model.graph.node)
    assert _same_nodes(gm.graph.node[:forward], model.graph.node)
    assert not [n for n in gm.graph.node[forward:] if n.op_type == "If"]
    if zero is not None:
        feeds = _constant_if_feeds()
        seeds = {gradient_spec(gm)["seeds"]["y"]: np.ones((2, 4), np.float32)}
        got = Runner(gm)({**feeds, **seeds})[gradient_spec(gm)["gradients"][zero]]
        assert got.shape == feeds[zero].shape and not got.any()


def test_constant_if_condition_values():
    """The condition is folded from constants (through the first If's taken branch); a graph input, even one
    with an initializer (a default the caller may override), is never taken as a constant: only its declared
    shape is (its Size, when every dim is a number)."""
    model = _model(IF_CONSTANT_2D, 13)
    values = onnxgrad.ir.model.ParsedModel(model).constants
    assert values["k"] == 1 and values["first"] and list(values["shape"]) == [1, 2, 3]
    size = next(n for n in model.graph.node if n.output[0] == "size")
    model.graph.node.remove(size)
    model.graph.initializer.append(onnx.numpy_helper.from_array(np.array([2, 3], np.int64), "size"))
    for dims, folded in (([2], {"n", "is2d", "k", "first"}), (["K"], set())):
        del model.graph.input[:]
        model.graph.input.extend(_model(IF_CONSTANT_2D, 13).graph.input)
        model.graph.input.append(onnx.helper.make_tensor_value_info("size", onnx.TensorProto.INT64, dims))
        values = onnxgrad.ir.model.ParsedModel(model).constants
        assert {"n", "is2d", "k", "first", "shape"} & set(values) == folded, dims
