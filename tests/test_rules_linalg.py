"""Gradient checks for MatMul, Gemm, Einsum and Det, plus the shape of the graphs they emit."""
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import onnxgrad
from harness import Case, case_model, check_gradients, make_model, randn, rng, run_case, run_declared, run_second_order
from onnxgrad.tools.check import check, gradient_spec, run_float64

MATMUL = [
    Case("MatMul", [randn(3, 4), randn(4, 5)], id="2d"),
    Case("MatMul", [randn(2, 3, 4), randn(4, 5)], id="batch-weight"),
    Case("MatMul", [randn(2, 2, 3, 4), randn(4, 2)], id="batch2-weight"),
    Case("MatMul", [randn(3, 4), randn(2, 4, 5)], id="2d-at-batch"),
    Case("MatMul", [randn(2, 3, 4), randn(2, 4, 5)], id="batch-batch"),
    Case("MatMul", [randn(2, 1, 3, 4), randn(3, 4, 2)], id="bcast-both"),
    Case("MatMul", [randn(2, 3, 4), randn(1, 4, 5)], id="weight-unit-batch"),
    Case("MatMul", [randn(1, 3, 4), randn(2, 4, 5)], id="unit-batch-left"),
    Case("MatMul", [randn(4), randn(4)], id="vec-vec"),
    Case("MatMul", [randn(4), randn(4, 3)], id="vec-mat"),
    Case("MatMul", [randn(4), randn(2, 4, 3)], id="vec-batch"),
    Case("MatMul", [randn(3, 4), randn(4)], id="mat-vec"),
    Case("MatMul", [randn(2, 3, 4), randn(4)], id="batch-vec"),
    Case("MatMul", [randn(3, 4), randn(4, 5)], unknown_shapes=True, id="2d-dyn"),
    Case("MatMul", [randn(2, 3, 4), randn(4, 5)], unknown_shapes=True, id="batch-weight-dyn"),
    Case("MatMul", [randn(2, 1, 3, 4), randn(3, 4, 2)], unknown_shapes=True, id="bcast-dyn"),
    Case("MatMul", [randn(2, 3, 4), randn(4)], unknown_shapes=True, id="batch-vec-dyn"),
    Case("MatMul", [randn(4), randn(2, 4, 3)], unknown_shapes=True, id="vec-batch-dyn"),
    Case("MatMul", [randn(2, 3, 4), randn(1, 4, 5)], unknown_shapes=True, id="unit-batch-dyn"),
    Case("MatMul", [randn(3, 4), randn(4, 5)], wrt=[1], id="2d-wrt-b"),
    Case("MatMul", [randn(2, 3, 4), randn(4, 5)], wrt=[0], id="batch-wrt-a"),
]

GEMM = [
    Case("Gemm", [randn(3, 4), randn(4, 5)], id="plain"),
    Case("Gemm", [randn(3, 4), randn(4, 5), randn(5)], id="bias-n"),
    Case("Gemm", [randn(4, 3), randn(4, 5), randn(3, 1)], attrs=dict(transA=1), id="transA-bias-m1"),
    Case("Gemm", [randn(3, 4), randn(5, 4), randn(3, 5)], attrs=dict(transB=1), id="transB-bias-mn"),
    Case("Gemm", [randn(4, 3), randn(5, 4), randn(1)],
         attrs=dict(transA=1, transB=1, alpha=0.5, beta=2.0), id="transAB-alpha-beta-scalar"),
    Case("Gemm", [randn(3, 4), randn(4, 5), np.float32(0.7) * np.ones((), np.float32)],
         attrs=dict(alpha=-1.5, beta=0.25), id="scalar-c"),
    Case("Gemm", [randn(3, 4), randn(5, 4), randn(5)], attrs=dict(transB=1), unknown_shapes=True, id="dyn"),
    Case("Gemm", [randn(4, 3), randn(4, 5), randn(3, 5)], attrs=dict(transA=1, beta=0.0), id="beta0"),
]

EINSUM = [
    Case("Einsum", [randn(3, 4), randn(4, 5)], attrs=dict(equation="ij,jk->ik"), id="matmul"),
    Case("Einsum", [randn(3, 4), randn(4, 5)], attrs=dict(equation="ij,jk"), id="implicit"),
    Case("Einsum", [randn(2, 3, 4), randn(2, 4, 5)], attrs=dict(equation="bij,bjk->bik"), id="batched"),
    Case("Einsum", [randn(3, 4)], attrs=dict(equation="ij->ji"), id="transpose"),
    Case("Einsum", [randn(3, 4)], attrs=dict(equation="ij->"), id="sum-all"),
    Case("Einsum", [randn(3, 3)], attrs=dict(equation="ii->i"), id="diag"),
    Case("Einsum", [randn(3, 3)], attrs=dict(equation="ii"), id="trace-implicit"),
    Case("Einsum", [randn(2, 3, 2)], attrs=dict(equation="iji->j"), id="diag-split"),
    Case("Einsum", [randn(2, 2, 2)], attrs=dict(equation="iii->i"), id="diag-3"),
    Case("Einsum", [randn(4), randn(4)], attrs=dict(equation="i,i->"), id="dot"),
    Case("Einsum", [randn(3), randn(4)], attrs=dict(equation="i,j->ij"), id="outer"),
    Case("Einsum", [randn(2, 3), randn(3, 4)], attrs=dict(equation="ij,jk->k"), id="summed-only-in-one"),
    Case("Einsum", [randn(2, 2, 3), randn(3), randn(4)], attrs=dict(equation="iij,j,k->ik"), id="3-operands-diag"),
    Case("Einsum", [randn(3, 3), randn(2)], attrs=dict(equation="ii,j->j"), id="diag-only-in-one"),
    Case("Einsum", [randn(2, 3), randn(2, 3), randn(2, 3)], attrs=dict(equation="ij,ij,ij->ij"), id="hadamard3"),
    Case("Einsum", [randn(2, 3, 4), randn(4, 5)], attrs=dict(equation="...ij,jk->...ik"), id="ellipsis"),
    Case("Einsum", [randn(1, 3, 4), randn(2, 4, 5)], attrs=dict(equation="...ij,...jk->...ik"),
         id="ellipsis-bcast"),
    Case("Einsum", [randn(2, 3, 4), randn(4)], attrs=dict(equation="...i,i"), id="ellipsis-implicit"),
    Case("Einsum", [randn(2, 3, 4)], attrs=dict(equation="i...->...i"), id="ellipsis-move"),
    Case("Einsum", [randn(2, 3, 4), randn(4, 5)], attrs=dict(equation="bij,jk->bik"),
         unknown_shapes=True, id="dyn"),
    Case("Einsum", [randn(3, 3), randn(2)], attrs=dict(equation="ii,j->ij"), unknown_shapes=True, id="diag-dyn"),
    Case("Einsum", [randn(2, 3), randn(3, 4)], attrs=dict(equation="ij,jk->k"), unknown_shapes=True,
         id="summed-dyn"),
    Case("Einsum", [randn(1, 3, 4), randn(2, 4, 5)], attrs=dict(equation="...ij,...jk->...ik"),
         unknown_shapes=True, id="ellipsis-bcast-dyn"),
    Case("Einsum", [randn(3, 4), randn(4, 5)], attrs=dict(equation="i j , j k -> i k"), id="spaces"),
]


def _well_conditioned(*shape: int) -> np.ndarray:
    m = shape[-1]
    return (randn(*shape) + 2.0 * np.eye(m, dtype=np.float32)).astype(np.float32)


DET = [
    Case("Det", [randn(1, 1)], id="1x1"),
    Case("Det", [_well_conditioned(2, 2)], id="2x2"),
    Case("Det", [_well_conditioned(3, 3)], id="3x3"),
    Case("Det", [_well_conditioned(4, 4)], id="4x4"),
    Case("Det", [_well_conditioned(2, 3, 3)], id="batch"),
    Case("Det", [_well_conditioned(2, 2, 2, 2)], id="batch2-2x2"),
    Case("Det", [_well_conditioned(2, 3, 3)], opset=22, id="opset22"),
    Case("Det", [np.array([[1.0, 2.0, 3.0], [2.0, 4.0, 6.0], [0.5, -1.0, 2.0]], np.float32)], id="singular"),
    # M unknown when the gradient is built: the minors' indices made at run time
    Case("Det", [randn(1, 1)], unknown_shapes=True, id="dyn-1x1"),
    Case("Det", [_well_conditioned(2, 2)], unknown_shapes=True, id="dyn-2x2"),
    Case("Det", [_well_conditioned(3, 3)], unknown_shapes=True, id="dyn-3x3"),
    Case("Det", [_well_conditioned(2, 4, 4)], unknown_shapes=True, id="dyn-batch-4x4"),
    Case("Det", [_well_conditioned(2, 2, 3, 3)], unknown_shapes=True, opset=22, id="dyn-batch2-opset22"),
    Case("Det", [np.array([[1.0, 2.0, 3.0], [2.0, 4.0, 6.0], [0.5, -1.0, 2.0]], np.float32)], unknown_shapes=True,
         id="dyn-singular"),
]

# Cases whose forward model needs a hand-declared output or input shape (see _run_declared).
DECLARED = [
    # (Einsum ellipses of different ranks, "...ij,...jk" with [3,4] and [2,4,5], run in onnxruntime
    # but onnx's full check rejects them, so they are not tested; the rule right-aligns them as numpy.)
    # unknown batch dims, M known
    (Case("Det", [_well_conditioned(2, 3, 3)], unknown_shapes=True, id="dyn-batch"), {"x0": [None, 3, 3]}),
]


@pytest.mark.parametrize("case", MATMUL + GEMM + EINSUM + DET, ids=str)
def test_rule(case):
    run_case(case)


def _grad_model(case: Case) -> onnx.ModelProto:
    model, _, wrt = case_model(case)
    return onnxgrad.grad(model, wrt=wrt, of=["y0"])


def _backward_ops(gm: onnx.ModelProto) -> list[str]:
    return [node.op_type for node in gm.graph.node if node.name.startswith(("MatMul_node/grad", "Det_node/grad",
                                                                             "Einsum_node/grad", "Gemm_node/grad"))]


def test_matmul_weight_is_one_gemm():
    """[batch, m, k] @ [k, n]: dB is one Gemm(transA=1) over flattened rows, no batched MatMul + ReduceSum."""
    ops = _backward_ops(_grad_model(Case("MatMul", [randn(2, 3, 4), randn(4, 5)], wrt=[1])))
    assert ops.count("Gemm") == 1 and "ReduceSum" not in ops and "Transpose" not in ops and "MatMul" not in ops


def test_matmul_2d_uses_gemm_transposes():
    ops = _backward_ops(_grad_model(Case("MatMul", [randn(3, 4), randn(4, 5)])))
    assert sorted(ops) == ["Gemm", "Gemm"]


def test_gemm_gradients_are_gemms():
    ops = _backward_ops(_grad_model(Case("Gemm", [randn(4, 3), randn(5, 4)], attrs=dict(transA=1, transB=1))))
    assert sorted(ops) == ["Gemm", "Gemm"]


@pytest.mark.parametrize("case,shapes", DECLARED, ids=[str(c) for c, _ in DECLARED])
def test_declared_shapes(case, shapes):
    run_declared(case, shapes=shapes)


SECOND_ORDER = [
    Case("MatMul", [randn(2, 3, 4), randn(4, 5)], id="batch-weight"),
    Case("MatMul", [randn(2, 1, 3, 4), randn(3, 4, 2)], id="bcast"),
    Case("MatMul", [randn(4), randn(2, 4, 3)], id="vec-batch"),
    Case("Gemm", [randn(4, 3), randn(5, 4), randn(5)], attrs=dict(transA=1, transB=1, alpha=0.5, beta=2.0),
         id="gemm"),
    Case("Einsum", [randn(2, 2, 3), randn(3), randn(4)], attrs=dict(equation="iij,j,k->ik"), id="einsum-diag"),
    Case("Einsum", [randn(1, 3, 4), randn(2, 4, 5)], attrs=dict(equation="...ij,...jk->...ik"),
         id="einsum-bcast"),
    Case("Det", [_well_conditioned(3, 3)], id="det"),
    Case("Det", [_well_conditioned(2, 3, 3)], unknown_shapes=True, id="det-dynamic"),
]


@pytest.mark.parametrize("case", SECOND_ORDER, ids=str)
def test_second_order(case):
    run_second_order(case)


# -- MatMul of operands whose rank is unknown when the gradient is built ----------------------------------
def _matmul_of_unknown_ranks(opset: int) -> onnx.ModelProto:
    """L = sum(sin(A @ B)) with A and B flat inputs reshaped to shapes fed at run time: no rank is known
    for A, B or A @ B (the scalar L implies none), so one gradient graph serves every rank."""
    f, i64 = TensorProto.FLOAT, TensorProto.INT64
    nodes = [helper.make_node("Reshape", ["a_flat", "a_shape"], ["a"]),
             helper.make_node("Reshape", ["b_flat", "b_shape"], ["b"]),
             helper.make_node("MatMul", ["a", "b"], ["y"]), helper.make_node("Sin", ["y"], ["s"]),
             helper.make_node("ReduceSum", ["s"], ["L"], keepdims=0)]
    inputs = [helper.make_tensor_value_info("a_flat", f, ["P"]), helper.make_tensor_value_info("b_flat", f, ["Q"]),
              helper.make_tensor_value_info("a_shape", i64, ["RA"]),
              helper.make_tensor_value_info("b_shape", i64, ["RB"])]
    return make_model(nodes, inputs, [helper.make_tensor_value_info("L", f, [])], opset=opset, name="matmul_any_rank")


def _unknown_rank_feeds(sa: tuple[int, ...], sb: tuple[int, ...]) -> dict[str, np.ndarray]:
    return {"a_flat": randn(int(np.prod(sa))), "b_flat": randn(int(np.prod(sb))),
            "a_shape": np.array(sa, np.int64), "b_shape": np.array(sb, np.int64)}


UNKNOWN_RANK_SHAPES = [((3, 4), (4, 5)), ((2, 3, 4), (4, 5)), ((4,), (4, 3)), ((4,), (2, 4, 3)), ((4,), (4,)),
                       ((3, 4), (4,)), ((2, 3, 4), (4,)), ((3, 4), (2, 4, 5)), ((2, 1, 3, 4), (3, 4, 2))]


@pytest.mark.parametrize("opset", [13, 17])
@pytest.mark.parametrize("sa,sb", UNKNOWN_RANK_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_matmul_of_unknown_ranks(sa, sb, opset):
    """The ranks are found at run time: 1-D operands promoted as numpy does, batch dims summed back
    (float32 in onnxruntime and float64, against central differences)."""
    model = _matmul_of_unknown_ranks(opset)
    infos = onnxgrad.ir.model.tensor_infos(onnxgrad.ir.model.infer(model))[0]
    assert all(x not in infos or infos[x].shape is None for x in ("a", "b", "y"))     # no rank to build from
    r = check_gradients(model, _unknown_rank_feeds(sa, sb), ["a_flat", "b_flat"], ["L"], tol64=1e-6)
    assert all(np.abs(g).max() > 1e-3 for g in r.analytic.values())


def test_matmul_of_unknown_ranks_second_order():
    """grad(grad(m)) of the same model: the run-time promotion differentiates too."""
    model = _matmul_of_unknown_ranks(17)
    gm = onnxgrad.grad(model, wrt=["a_flat", "b_flat"], of=["L"])
    spec = gradient_spec(gm)
    seed = spec["seeds"]["L"]
    ggm = onnxgrad.grad(gm, wrt=["a_flat", "b_flat", seed], of=list(spec["gradients"].values()), allow_unused=True)
    onnx.checker.check_model(ggm, full_check=True)
    for sa, sb in [((2, 3, 4), (4, 5)), ((4,), (2, 4, 3)), ((3, 4), (4,))]:
        feeds = {**_unknown_rank_feeds(sa, sb), seed: np.float32(rng().uniform(0.5, 1.5)) * np.ones((), np.float32)}
        r = check(gm, ggm, feeds, analytic_run=run_float64)
        assert r.ok(1e-5), f"{sa} @ {sb}: second-order errors {r.errors}"
