"""The session's memory layout: one buffer per parameter, optimizer state and running statistic, updated in
place, and training bit-identical to feeding the graph's outputs back (the double-buffered way)."""
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxgrad import TrainingSession, losses, optim
from onnxgrad.ir.files import is_held
from onnxgrad.training import artifacts
from test_training import batch, ce, mlp_model, poisoned, run_guarded

ROOT = Path(__file__).resolve().parents[1]
F = TensorProto.FLOAT


def bn_model():
    return onnx.load(ROOT / "models" / "cnn_bn_dynamo.onnx")


def bn_batch(step):
    rng = np.random.default_rng(10 + step)
    return {"x": rng.standard_normal((2, 3, 16, 16)).astype(np.float32), "label": rng.integers(0, 5, 2)}


def held_names(s):
    return list(s.spec.params) + list(s.spec.buffers) + [i for st in s.spec.state.values() for i, _ in st.values()]


def pointers(s):
    return {n: s._cur[n].data_ptr() for n in held_names(s)}


@pytest.mark.parametrize("kind", ["mlp", "bn"])
def test_one_buffer_per_held_tensor_written_in_place(kind):
    if kind == "mlp":
        s = TrainingSession(mlp_model(), loss=ce(), optimizer=optim.AdamW(lr=1e-2))
        feeds = batch
    else:
        s = TrainingSession(bn_model(), loss=losses.CrossEntropyLoss(output="y", target="label"),
                            optimizer=optim.Adam(lr=1e-2))
        feeds = bn_batch
        assert s.spec.buffers
    names = held_names(s)
    assert set(s._inplace) == set(names)
    assert all(s._sets[0][n] is s._sets[1][n] for n in names)
    assert len({id(s._sets[k][n]) for k in (0, 1) for n in names}) == len(names)
    start = pointers(s)
    before = {**s.parameters(), **s.buffers()}
    for step in range(3):
        s.step(feeds(step))
    assert pointers(s) == start                       # the same memory, rewritten
    after = {**s.parameters(), **s.buffers()}
    assert all(not np.array_equal(after[n], before[n]) for n in list(s.spec.params) + list(s.spec.buffers))


def test_session_keeps_no_numpy_or_proto_copy_of_the_trained_tensors():
    s = TrainingSession(mlp_model(), loss=ce(), optimizer=optim.AdamW(lr=1e-2))
    art = s.artifacts
    assert art.initial_params == {} and art.initial_state == {} and art.initial_buffers == {}
    for m in (art.loss_model, art.forward, art.train, art.eval):
        for init in m.graph.initializer:
            if init.name in s.spec.params:
                assert not init.raw_data and not init.float_data and list(init.dims)
    s.step(batch(0))
    exported = {i.name: numpy_helper.to_array(i) for i in s.exported_model().graph.initializer}
    for name, value in s.parameters().items():
        np.testing.assert_array_equal(exported[name], value)


def test_onnxruntime_is_handed_a_path_and_keeps_no_copy_of_the_graph(monkeypatch):
    """onnxruntime's Python session keeps the bytes it was built from for its life (EfficientNet-B0's training
    graph: 7.8 MB); built from a path it keeps none. The temporary file is gone once the session is built."""
    import onnxruntime as ort

    given = {}

    class Recording(ort.InferenceSession):
        def __init__(self, source, *args, **kwargs):
            super().__init__(source, *args, **kwargs)
            given[id(self)] = source

    monkeypatch.setattr(ort, "InferenceSession", Recording)
    s = TrainingSession(mlp_model(), loss=ce(), optimizer=optim.AdamW(lr=1e-2))
    s.step(batch(0))
    s.eval(batch(1))
    kept = [s._train, *(sess for sess, *_ in s._evals.values())]
    sources = [given[id(sess)] for sess in kept]
    assert len(sources) == 2 and all(isinstance(x, str) for x in sources), [type(x) for x in sources]
    assert not any(Path(x).exists() for x in sources)


@pytest.mark.parametrize("optimizer", [optim.AdamW(lr=1e-2), optim.SGD(lr=0.1, momentum=0.9, nesterov=True),
                                       optim.Adagrad(lr=0.1)], ids=["adamw", "sgd", "adagrad"])
def test_in_place_training_is_bit_identical_to_feeding_the_outputs_back(optimizer):
    s = TrainingSession(mlp_model(), loss=ce(), optimizer=optimizer, clip_grad_norm=1.0)
    art = artifacts.build(mlp_model(), ce(), optimizer, clip_grad_norm=1.0, target="cpu")
    feeds = [batch(i) for i in range(5)]
    results, carried = run_guarded(art.train, feeds, optimizer.lr, art.initial_values())
    losses_ = [s.step(f) for f in feeds]
    np.testing.assert_array_equal(losses_, [float(r["loss"]) for r in results])
    for name, value in s.parameters().items():
        np.testing.assert_array_equal(value, carried[name], err_msg=name)
    for p, st in s.optimizer_state().items():
        for k, v in st.items():       # PyTorch's values, from the state the graph holds (scaled for Adam)
            held = carried[s.spec.state[p][k][0]]
            factor = s.spec.state_scale.get(p, {}).get(k)
            np.testing.assert_array_equal(v, held if factor is None else held / held.dtype.type(factor),
                                          err_msg=f"{p}.{k}")


def test_in_place_running_statistics_are_bit_identical_and_kept_on_a_non_finite_step():
    loss = losses.CrossEntropyLoss(output="y", target="label")
    s = TrainingSession(bn_model(), loss=loss, optimizer=optim.SGD(lr=0.1), on_nonfinite="skip")
    art = artifacts.build(bn_model(), loss, optim.SGD(lr=0.1), target="cpu")
    feeds = [bn_batch(i) for i in range(4)]
    spec = art.spec
    # the reference carries the running statistics too
    initial = art.initial_values()
    carried = {k: v for k, v in initial.items() if k not in (spec.lr, spec.step)}
    import onnxruntime as ort
    ref = ort.InferenceSession(art.train.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in ref.get_outputs()]
    for step, f in enumerate(feeds, start=1):
        sess_out = dict(zip(names, ref.run(None, {**f, spec.lr: np.array(0.1, np.float32),
                                                  spec.step: np.array(step, np.int64), **carried})))
        carried.update({p: sess_out[o] for p, o in spec.params.items()})
        carried.update({r: sess_out[o] for r, (_, o) in spec.buffers.items()})
        s.step(f)
    for name, value in {**s.parameters(), **s.buffers()}.items():
        if name in carried:
            np.testing.assert_array_equal(value, carried[name], err_msg=name)
    held = {**s.parameters(), **s.buffers()}
    bad = bn_batch(9)
    bad["x"][0, 0, 0, 0] = np.nan
    with pytest.warns(UserWarning, match="skipped"):
        s.step(bad)
    for name, value in {**s.parameters(), **s.buffers()}.items():
        np.testing.assert_array_equal(value, held[name], err_msg=name)


def test_a_poisoned_accumulation_window_leaves_the_in_place_buffers_alone():
    s = TrainingSession(mlp_model(), loss=ce(), optimizer=optim.AdamW(lr=1e-2), accumulation_steps=2,
                        on_nonfinite="skip")
    s.step(batch(0))
    s.step(batch(1))
    params, state, ptrs = s.parameters(), s.optimizer_state(), pointers(s)
    with pytest.warns(UserWarning):
        s.step(poisoned())
        s.step(batch(2))      # finite itself: the window's update still must not be applied
    assert s.step_count == 1 and pointers(s) == ptrs
    for name, value in s.parameters().items():
        np.testing.assert_array_equal(value, params[name])
    for p, st in s.optimizer_state().items():
        for k, v in st.items():
            np.testing.assert_array_equal(v, state[p][k])


# -- artifacts.in_place: which outputs may share their input's buffer ---------------------------------------
def _graph(nodes, inputs, outputs):
    vi = helper.make_tensor_value_info
    g = helper.make_graph(nodes, "g", [vi(n, TensorProto.BOOL if n == "finite" else F, [4]) for n in inputs],
                          [vi(n, F, [4]) for n in outputs])
    return helper.make_model(g)


def test_in_place_needs_a_guarded_elementwise_last_reader():
    n = helper.make_node
    guarded = _graph([n("Mul", ["p", "g"], ["u"]), n("Where", ["finite", "u", "p"], ["p.next"])],
                     ["p", "g", "finite"], ["p.next"])
    assert artifacts.in_place(guarded, {"p": "p.next"}, "finite") == {"p"}
    assert artifacts.in_place(guarded, {"p": "p.next"}, "") == set()          # no guard, no in-place
    unguarded = _graph([n("Mul", ["p", "g"], ["p.next"])], ["p", "g"], ["p.next"])
    assert artifacts.in_place(unguarded, {"p": "p.next"}, "finite") == set()
    # another reader of p that the producer does not wait for: it could read the new value
    late = _graph([n("Mul", ["p", "g"], ["u"]), n("Where", ["finite", "u", "p"], ["p.next"]),
                   n("Add", ["p", "g"], ["other"])], ["p", "g", "finite"], ["p.next", "other"])
    assert artifacts.in_place(late, {"p": "p.next"}, "finite") == set()
    # a reader of the shape alone does not count
    sized = _graph([n("Shape", ["p"], ["s"]), n("Mul", ["p", "g"], ["u"]),
                    n("Where", ["finite", "u", "p"], ["p.next"])], ["p", "g", "finite"], ["p.next"])
    assert artifacts.in_place(sized, {"p": "p.next"}, "finite") == {"p"}
    # a producer that reads p and is not elementwise: it could read an element it has already written
    shuffled = _graph([n("Where", ["finite", "g", "g"], ["u"]), n("MatMul", ["p", "u"], ["p.next"])],
                      ["p", "g", "finite"], ["p.next"])
    assert artifacts.in_place(shuffled, {"p": "p.next"}, "finite") == set()
    # one that does not read p (parameters updated together, split back): every reader of p ran before it
    split_back = _graph([n("Where", ["finite", "g", "p"], ["u"]), n("Transpose", ["u"], ["p.next"], perm=[0])],
                        ["p", "g", "finite"], ["p.next"])
    assert artifacts.in_place(split_back, {"p": "p.next"}, "finite") == {"p"}


def _if_guarded(then_nodes, else_nodes, outer=()):
    """p.next = If(finite, then: then_nodes -> 'new', else: else_nodes -> 'old'), then ``outer`` nodes."""
    n, vi = helper.make_node, helper.make_tensor_value_info
    then = helper.make_graph(then_nodes, "then", [], [vi("new", F, [4])])
    other = helper.make_graph(else_nodes, "else", [], [vi("old", F, [4])])
    return _graph([n("If", ["finite"], ["p.next"], then_branch=then, else_branch=other), *outer],
                  ["p", "g", "finite"], ["p.next"] + [o for x in outer for o in x.output])


def test_in_place_under_the_update_guard_if():
    n = helper.make_node
    keep = [n("Identity", ["p"], ["old"])]
    update = [n("Mul", ["p", "g"], ["u"]), n("Sub", ["p", "u"], ["new"])]
    assert artifacts.in_place(_if_guarded(update, keep), {"p": "p.next"}, "finite") == {"p"}
    # the else branch must give the old value back
    assert artifacts.in_place(_if_guarded(update, [n("Neg", ["p"], ["old"])]), {"p": "p.next"}, "finite") == set()
    # a reader of p in the branch that the last writer does not wait for
    late = [n("Sub", ["g", "g"], ["u"]), n("Sub", ["p", "u"], ["new"]), n("Add", ["p", "g"], ["spare"])]
    assert artifacts.in_place(_if_guarded(late, keep), {"p": "p.next"}, "finite") == set()
    # a last writer that is not elementwise
    moved = [n("Transpose", ["p"], ["new"], perm=[0])]
    assert artifacts.in_place(_if_guarded(moved, keep), {"p": "p.next"}, "finite") == set()
    # a reader of p outside, after the If
    after = [n("Add", ["p", "g"], ["other"])]
    assert artifacts.in_place(_if_guarded(update, keep, after), {"p": "p.next"}, "finite") == set()


# -- guarded updates: every update inside one If on the step's finiteness ------------------------------------
GUARDED = [optim.AdamW(lr=1e-2, weight_decay=0.1), optim.Adam(lr=1e-2, weight_decay=0.1),
           optim.Adam(lr=1e-2, betas=(0.3, 0.99)), optim.Adam(lr=1e-2, eps=0.0), optim.SGD(lr=0.1, momentum=0.9)]


@pytest.mark.parametrize("optimizer", GUARDED, ids=[repr(o) for o in GUARDED])
def test_a_non_finite_step_leaves_every_in_place_tensor_unchanged(optimizer):
    s = TrainingSession(mlp_model(), loss=ce(), optimizer=optimizer, on_nonfinite="skip")
    for step in range(2):
        s.step(batch(step))
    params, state = s.parameters(), s.optimizer_state()
    with pytest.warns(UserWarning, match="skipped"):
        s.step(poisoned())
    for name, value in s.parameters().items():
        np.testing.assert_array_equal(value, params[name], err_msg=name)
    for p, st in s.optimizer_state().items():
        for k, v in st.items():
            np.testing.assert_array_equal(v, state[p][k], err_msg=f"{p}.{k}")
    s.step(batch(2))
    assert s.step_count == 3 and all(np.isfinite(v).all() for v in s.parameters().values())


@pytest.mark.parametrize("optimizer, ops", [
    (optim.AdamW(), "Mul Mul Add Mul Mul Add Sqrt Add Div Mul Sub"),
    (optim.Adam(eps=0.0), "Mul Add Mul Mul Add Sqrt Div Mul Sub"),
    (optim.SGD(lr=0.1, momentum=0.9), "Mul Add Mul Sub"),
], ids=["adamw", "adam-eps0", "sgd"])
def test_guarded_update_ops_per_parameter(optimizer, ops):
    """The guard adds no full-size op: the updates are the then branch of one If(finite), whose else
    branch returns the old values."""
    art = artifacts.build(mlp_model(), ce(), optimizer, guard=True)
    guards = [n for n in art.train.graph.node if n.op_type == "If"]
    assert len(guards) == 1 and list(guards[0].input) == [art.spec.finite]
    branches = {a.name: a.g for a in guards[0].attribute}
    assert {n.op_type for n in branches["else_branch"].node} == {"Identity"}
    assert not [n for n in art.train.graph.node if n.name.startswith("train/optimizer/")
                and n.op_type not in ("Constant", "If")]
    then = branches["then_branch"].node
    alone = [p for p in art.spec.params if any(n.name.startswith(f"train/optimizer/{p}/") for n in then)]
    for p in alone:
        got = [n.op_type for n in then if n.name.startswith(f"train/optimizer/{p}/") and n.op_type != "Constant"]
        assert got == ops.split(), p
    together = [n.op_type for n in then if n.name.startswith("train/optimizer/foreach/")
                and n.op_type not in ("Constant", "Concat", "Reshape", "Split")]
    assert together == ops.split() and len(alone) < len(art.spec.params)


@pytest.mark.parametrize("defaults", [False, True])
@pytest.mark.parametrize("split", [False, True])
def test_parameters_held_aside_while_building_never_reach_an_artifact(defaults, split):
    """build() differentiates the loss model with its parameters' data held aside (placeholders); every
    model it returns has the values or the inputs, never a placeholder, and the defaults are the model's."""
    model = mlp_model()
    art = artifacts.build(model, ce(), optim.AdamW(lr=1e-2), defaults=defaults, split=split,
                          accumulation_steps=2)
    models = [art.train, art.eval, art.accumulate, art.loss_model, art.forward, art.eval_with_loss(defaults)]
    if split:
        models += [art.split.backward, art.split.update]
    for m in models:
        assert not [t.name for t in m.graph.initializer if is_held(t)]
        onnx.checker.check_model(m, full_check=True)
    values = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    train_inits = {t.name: numpy_helper.to_array(t) for t in art.train.graph.initializer}
    for p in art.spec.params:
        np.testing.assert_array_equal(art.initial_params[p], values[p])
        assert (p in train_inits) == defaults
        if defaults:
            np.testing.assert_array_equal(train_inits[p], values[p])


SESSION_MEMORY = r"""
import ctypes, gc, sys
import numpy as np
import onnx
import onnxruntime  # its library's pages count before the baseline
from onnx import TensorProto, helper, numpy_helper
from onnxgrad import TrainingSession, losses, optim

def mb(field):
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(field)) / 1024

n = 4096                                    # one 64 MB weight
w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((n, n)).astype(np.float32), "w")
model = helper.make_model(helper.make_graph(
    [helper.make_node("MatMul", ["x", "w"], ["y"])], "big",
    [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, n])],
    [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, n])], [w]))
del w
gc.collect(); ctypes.CDLL(None).malloc_trim(0)
base = mb("VmRSS")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")                            # the peak from here on
s = TrainingSession(model, loss=losses.MSELoss(output="y", target="t"), optimizer=optim.AdamW(lr=0.1))
build_peak = mb("VmHWM") - base
gc.collect(); ctypes.CDLL(None).malloc_trim(0)
built = mb("VmRSS") - base
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")                            # the peak from here on
x = np.ones((2, n), np.float32)
for _ in range(3):
    s.step({"x": x, "t": x})
print(build_peak, built, mb("VmHWM") - base)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the process's RSS from /proc (Linux)")
def test_a_session_holds_its_weights_once_and_few_update_temporaries():
    """Building, the weights are copied into the loss and forward models and the session's buffers, but not
    into what is differentiated (their data held aside: the build peaked at 402 MB, now about 338). Built,
    the session's buffers hold the weights (AdamW's zero moments take no memory before the first step writes
    them); the loss and forward models it keeps for export hold none, in their protobuf arenas either
    (clearing a field in place left its bytes there: the process grew by about 210 MB, now by about 83: the
    weights and the session). Training, the peak is the weight, its gradient, the two moments and at most
    two weight-sized temporaries of the update, besides the session (412 MB; 476 while the step size
    multiplied the first moment before the division, a third temporary alive across the update of v)."""
    out = subprocess.run([sys.executable, "-c", SESSION_MEMORY], capture_output=True, text=True, timeout=300,
                         check=True)
    build_peak, built, peak = map(float, out.stdout.strip().splitlines()[-1].split())
    assert build_peak < 64 * 6, f"building the session peaked {build_peak:.0f} MB above the start for 64 MB of weights"
    assert 64 <= built < 64 * 1.5, f"building the session grew the process by {built:.0f} MB for 64 MB of weights"
    assert peak < 64 * 7, f"three AdamW steps peaked {peak:.0f} MB above the start for 64 MB of weights"


def test_a_placeholder_of_a_held_value_is_never_saved(tmp_path):
    from onnxgrad.ir.files import HELD, save_model, stripped

    model = stripped(mlp_model(), lambda t: HELD if t.name == "0.weight" else None)
    with pytest.raises(ValueError, match="0.weight"):
        save_model(model, str(tmp_path / "m.onnx"))
    assert not (tmp_path / "m.onnx").exists()


def _embedding_model(rows=4096, width=128):
    """y = table[ids]: its gradient is scattered into zeros of the table's shape (2 MiB here)."""
    table = numpy_helper.from_array(np.random.default_rng(0).standard_normal((rows, width)).astype(np.float32),
                                    "table")
    return helper.make_model(helper.make_graph(
        [helper.make_node("Gather", ["table", "ids"], ["y"])], "embedding",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, [8])],
        [helper.make_tensor_value_info("y", F, [8, width])], [table]),
        opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("limit", [None, "0"], ids=["session's", "caller's: none"])
def test_onnxruntime_folds_no_table_sized_constant_into_the_session(tmp_path, limit):
    """onnxruntime folds the embedding gradient's ConstantOfShape into an initializer, a second copy of the table
    for the session's life, unless its folding limit keeps it out; the session sets that limit (and keeps the
    caller's: with no limit, the copy is there)."""
    import onnxruntime as ort

    from onnxgrad.training.session import FOLDED_CONSTANT_LIMIT

    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    if limit is not None:
        options.add_session_config_entry(FOLDED_CONSTANT_LIMIT[0], limit)
    s = TrainingSession(_embedding_model(), loss=losses.MSELoss(output="y", target="t"),
                        optimizer=optim.Adam(lr=0.1), session_options=options)
    ids = np.array([0, 5, 5, 9, 4095, 17, 0, 3], np.int64)
    before = s.parameters()["table"]
    s.step({"ids": ids, "t": np.zeros((8, 128), np.float32)})
    changed = np.flatnonzero(np.any(s.parameters()["table"] != before, axis=1))
    np.testing.assert_array_equal(changed, np.unique(ids))       # the rows looked up, and only those
    optimized = onnx.load(str(tmp_path / "optimized.onnx"))
    table_sized = [i.name for i in optimized.graph.initializer if list(i.dims) == [4096, 128]]
    if limit is None:
        assert table_sized == []
    else:
        assert table_sized, "with no folding limit onnxruntime was expected to hold the folded zeros"
