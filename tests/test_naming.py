"""What a person reading a gradient model sees: names, shapes, scoped constants, module metadata,
and the grouped view (one function call per forward node) computing the same values."""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import onnx
import pytest

import onnxgrad
from onnxgrad.ir.load import load, parse
from onnxgrad.passes.autodiff import _Pass
from onnxgrad.passes.record import backward_nodes

# the exported models (each has its .npz of references); not the <stem>.grad.onnx README's first command
# writes beside one, which is a gradient model with a naming of its own (seeds '<x>_grad_seed')
MODELS = sorted(p.with_suffix(".onnx") for p in (Path(__file__).resolve().parent.parent / "models").glob("*.npz"))
IDS = [p.stem for p in MODELS]


def _build(path, **kw):
    p = _Pass(parse(str(path)), None, None, None, False, **kw)
    return p, p.run()


def _backward(p, gm):
    backward = backward_nodes(gm)
    assert len(gm.graph.node) - len(backward) == len(p.nodes)       # the forward the pass copied
    return backward


def _owner(node: onnx.NodeProto, forward_names: set[str]) -> str:
    """The forward node a backward node belongs to, from its name '<forward node>/grad/...'."""
    head = node.name
    while "/grad" in head:
        head = head[:head.rindex("/grad")]
        if head in forward_names:
            return head
    return node.name.split("/")[0]


@pytest.fixture(scope="module", params=MODELS, ids=IDS)
def built(request):
    return _build(request.param)


def test_every_emitted_tensor_has_a_shape(built):
    p, gm = built
    shaped = {vi.name: vi for vi in gm.graph.value_info}
    shaped.update({o.name: o for o in gm.graph.output})
    # a tensor may go without a shape only downstream of a forward tensor onnx's inference left unshaped
    unshaped = {x for x, tp in p.types.items() if not tp.tensor_type.HasField("shape")}
    unshaped |= {x for n in p.nodes for x in n.output if x not in p.types}
    missing = []
    for node in _backward(p, gm):
        for o in node.output:
            vi = shaped.get(o)
            assert vi is not None and vi.type.tensor_type.elem_type, (node.op_type, o)
            if any(x in unshaped for x in node.input):
                unshaped.add(o)                 # computed from it (a Shape of it, ...): may be unshaped too
            elif not vi.type.tensor_type.HasField("shape"):
                missing.append((node.op_type, o))
    assert not missing, missing[:10]


def test_no_constant_is_shared_by_two_forward_nodes_gradients(built):
    p, gm = built
    forward = {n.name for n in p.nodes}
    backward = _backward(p, gm)
    made_by = {n.output[0]: n for n in backward if n.op_type == "Constant"}
    readers: dict[str, set[str]] = {}
    for node in backward:
        for x in node.input:
            if x in made_by:
                readers.setdefault(x, set()).add(_owner(node, forward))
    shared = {x: r for x, r in readers.items() if len(r) > 1}
    assert not shared, shared
    # and shared integer constants are initializers of ints only: never a float one (parameters are floats)
    original = {i.name for i in onnx.load(str(Path("models") / "mlp_dynamo.onnx")).graph.initializer}
    added = [i for i in gm.graph.initializer if i.name.startswith("onnxgrad/")]
    assert all(i.data_type == onnx.TensorProto.INT64 for i in added)
    assert not original & {i.name for i in added}


def test_total_gradients_are_named_after_their_tensor(built):
    p, gm = built
    made = {o for n in gm.graph.node for o in n.output} | {i.name for i in gm.graph.input}
    claimed = {}
    for x, g in p.grad_of.items():
        assert g in made, (x, g)
        claimed.setdefault(g, []).append(x)
    for g, xs in claimed.items():
        # one tensor is the gradient of several only when a rule passed it through unchanged (Add, Identity,
        # a same-shape Reshape): it carries the name of the first (most downstream) of them
        assert any(re.fullmatch(re.escape(x) + r"_grad(_\d+)?", g) for x in xs), (g, xs)
    named = sum(len(xs) == 1 for xs in claimed.values())
    assert named >= len(claimed) * 0.5
    meta = {e.key: e.value for e in gm.metadata_props}
    assert json.loads(meta["onnxgrad.gradients"]) == {w: f"{w}_grad" for w in p.wrt if f"{w}_grad" in made} \
        or all(v.startswith(f"{k}_grad") for k, v in json.loads(meta["onnxgrad.gradients"]).items())


def test_gradient_outputs_and_seeds_are_documented():
    gm = onnxgrad.grad("models/mlp_dynamo.onnx", of=["y"])
    seeds = [i for i in gm.graph.input if i.name == "y_grad"]
    assert seeds and seeds[0].doc_string.startswith("seed dL/dy")
    outs = {o.name: o for o in gm.graph.output}
    assert outs["fc1.weight_grad"].doc_string.startswith("dL/dfc1.weight")
    relu_grad = [n for n in gm.graph.node if "relu_grad" in n.output]   # dL/drelu: made by fc2's backward
    assert relu_grad and relu_grad[0].name.startswith("node_linear_1/grad/")
    assert not [n for n in gm.graph.node if n.op_type == "Identity" and n.output[0] == "relu_grad"]


def test_folded_weights_carry_their_pytorch_name():
    gm = onnxgrad.grad("models/gpt_dynamo.onnx")
    docs = {o.name: o.doc_string for o in gm.graph.output}
    report = onnxgrad.parameters(onnx.load("models/gpt_dynamo.onnx"))
    renamed = [p for p in report if p.trainable and p.torch_name and p.torch_name != p.name]
    for p in renamed:
        assert f"PyTorch '{p.torch_name}'" in docs[f"{p.name}_grad"]


def test_backward_nodes_carry_the_forward_module():
    gm = onnxgrad.grad("models/mlp_dynamo.onnx")
    fwd = {n.name: {e.key: e.value for e in n.metadata_props} for n in gm.graph.node if "/grad/" not in n.name}
    back = [n for n in gm.graph.node if n.name.startswith("node_linear_1/grad/")]
    assert back
    for n in back:
        meta = {e.key: e.value for e in n.metadata_props}
        assert meta.get("pkg.torch.onnx.name_scopes") == fwd["node_linear_1"]["pkg.torch.onnx.name_scopes"]


@pytest.mark.parametrize("name", ["mlp_dynamo", "cnn_dynamo", "gpt_dynamo", "lstm_legacy", "gpt_sdpa_legacy"])
def test_grouped_view_computes_the_same(name):
    ort = pytest.importorskip("onnxruntime")
    flat = onnxgrad.grad(f"models/{name}.onnx")
    grouped = onnxgrad.grad(f"models/{name}.onnx", group=True)
    onnx.checker.check_model(grouped)
    forward = len(onnx.load(f"models/{name}.onnx").graph.node)
    calls = [n for n in grouped.graph.node if n.domain == "onnxgrad.grad"]
    assert calls and len(grouped.functions) == len(calls)
    assert len(grouped.graph.node) < len(flat.graph.node)
    assert all(n.op_type.endswith("Grad") and n.name.endswith("/grad") for n in calls)
    assert [o.name for o in grouped.graph.output] == [o.name for o in flat.graph.output]
    rng = np.random.default_rng(0)
    s1 = ort.InferenceSession(flat.SerializeToString(), providers=["CPUExecutionProvider"])
    s2 = ort.InferenceSession(grouped.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = {}
    for i in s1.get_inputs():
        shape = [d if isinstance(d, int) else 2 for d in i.shape]
        feeds[i.name] = (rng.integers(0, 4, shape).astype(np.int64) if "int" in i.type
                         else rng.standard_normal(shape).astype(np.float32))
    for a, b in zip(s1.run(None, feeds), s2.run(None, feeds)):
        np.testing.assert_array_equal(a, b)
    # a grouped model loads as its flat self (onnxgrad inlines local functions), for second derivatives
    assert not load(grouped).functions and len(load(grouped).graph.node) >= forward


def _runtime_shapes(gm: onnx.ModelProto, dim: int) -> dict[str, tuple[int, ...]]:
    """The shape onnxruntime computes for every value_info tensor (the model loaded without its value_info,
    symbolic dims fed as ``dim``)."""
    ort = pytest.importorskip("onnxruntime")
    m = onnx.ModelProto()
    m.CopyFrom(gm)
    names = [vi.name for vi in m.graph.value_info]
    del m.graph.value_info[:]
    outputs = {o.name for o in m.graph.output}
    m.graph.output.extend(onnx.ValueInfoProto(name=n) for n in names if n not in outputs)
    s = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    feeds = {}
    for i in s.get_inputs():
        shape = [d if isinstance(d, int) else dim for d in i.shape]
        feeds[i.name] = (rng.integers(0, 3, shape).astype(np.int64) if "int" in i.type
                         else rng.standard_normal(shape).astype(np.float32))
    wanted = [o.name for o in s.get_outputs()]
    return {n: v.shape for n, v in zip(wanted, s.run(wanted, feeds))}


@pytest.mark.parametrize("name", ["mlp_dynamo", "cnn_bn_dynamo", "gpt_dynamo", "lstm_legacy", "light_bvlc_alexnet"])
def test_value_info_shapes_are_the_runtime_shapes(name):
    """No value_info dim contradicts the shape onnxruntime computes (a wrong dim is worse than none: the
    runtime refuses the model). light_bvlc_alexnet: an IR-3 model, whose int64 constants became initializers."""
    if name.startswith("light_"):
        path = Path(onnx.__file__).parent / "backend" / "test" / "data" / "light" / f"{name}.onnx"
        model = onnx.load(str(path))
        out = model.graph.output[0].name
        gm = onnxgrad.grad(model, wrt=[model.graph.input[0].name], of=[out])
    else:
        gm = onnxgrad.grad(f"models/{name}.onnx")
    for dim in (2, 3):
        real = _runtime_shapes(gm, dim)
        wrong = []
        for vi in gm.graph.value_info:
            dims = vi.type.tensor_type.shape.dim
            if vi.name not in real or not vi.type.tensor_type.HasField("shape"):
                continue
            if len(dims) != len(real[vi.name]) or any(
                    d.HasField("dim_value") and d.dim_value != r for d, r in zip(dims, real[vi.name])):
                wrong.append((vi.name, [d.dim_value or d.dim_param for d in dims], real[vi.name]))
        assert not wrong, wrong[:5]
