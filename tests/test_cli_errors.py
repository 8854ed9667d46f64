"""Bad input on the command line: one `error:` line, exit 2 and no file written; --check before writing."""
import subprocess
import sys

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from safetensors.numpy import load_file

import onnxgrad
from onnxgrad.ir.load import runtime_max_opset
from onnxgrad.tools import check as C
from onnxgrad.tools import cli as CLI

F = TensorProto.FLOAT


def cli(*args):
    return subprocess.run([sys.executable, "-m", "onnxgrad", *map(str, args)], capture_output=True, text=True,
                          timeout=120)


def save(tmp_path, name, nodes, inputs, outputs, inits=(), opset=17):
    m = helper.make_model(helper.make_graph(nodes, "g", inputs, outputs, list(inits)),
                          opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 10
    path = tmp_path / name
    onnx.save(m, path)
    return path


@pytest.fixture
def unknown_dims(tmp_path):
    """x [?, ?] @ W [5, 3]: random inputs with every unknown dim 3 do not fit the weight."""
    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((5, 3)).astype(np.float32), "W")
    return save(tmp_path, "unknown.onnx",
                [helper.make_node("MatMul", ["x", "W"], ["h"]), helper.make_node("Tanh", ["h"], ["y"])],
                [helper.make_tensor_value_info("x", F, [None, None])],
                [helper.make_tensor_value_info("y", F, [None, None])], [w])


def assert_user_error(r, *words):
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    for w in words:
        assert w in lines[0]


def test_check_with_every_dim_unknown_finds_sizes_that_fit(unknown_dims, tmp_path):
    out = tmp_path / "g.onnx"
    r = cli(unknown_dims, "-o", out, "--check")
    assert r.returncode == 0, r.stderr
    assert r.stderr == ""
    assert "W_grad: worst relative error" in r.stdout and out.exists()


def test_check_that_cannot_run_is_one_line(tmp_path):
    """A model no size for the unknown dims makes run (Reshape to a fixed 7 elements) is a user error."""
    shape = numpy_helper.from_array(np.array([7], np.int64), "shape")
    path = save(tmp_path, "bad.onnx", [helper.make_node("Reshape", ["x", "shape"], ["r"]),
                                       helper.make_node("Mul", ["r", "r"], ["y"])],
                [helper.make_tensor_value_info("x", F, [None, None])],
                [helper.make_tensor_value_info("y", F, [7])], [shape])
    out = tmp_path / "g.onnx"
    r = cli(path, "-o", out, "--check", "--wrt", "x")
    assert_user_error(r, "--check")
    assert not out.exists()


def test_unwritable_output_folder(unknown_dims, tmp_path):
    out = tmp_path / "unknown.onnx" / "g.onnx"        # under a file: no folder can be made there
    r = cli(unknown_dims, "-o", out)
    assert_user_error(r, "cannot write", "not a folder")
    r = cli(unknown_dims, "-o", tmp_path)               # a folder
    assert_user_error(r, "cannot write", "is a folder")


def test_failing_check_writes_nothing(unknown_dims, tmp_path, monkeypatch, capsys):
    def wrong(model, gm, **kw):
        return C.CheckResult({"W": 0.5}, {}, backend="onnxruntime", grad_backend="onnxruntime")

    monkeypatch.setattr(C, "check", wrong)
    out = tmp_path / "g.onnx"
    assert CLI.main([str(unknown_dims), "-o", str(out), "--check"]) == 1
    assert not out.exists()
    assert "numeric check failed" in capsys.readouterr().err


def test_opset_newer_than_the_runtime_is_refused(tmp_path):
    newest = runtime_max_opset()
    path = save(tmp_path, "new.onnx", [helper.make_node("Neg", ["x"], ["y"])],
                [helper.make_tensor_value_info("x", F, [2])], [helper.make_tensor_value_info("y", F, [2])],
                opset=newest + 2)
    out = tmp_path / "g.onnx"
    r = cli(path, "-o", out, "--wrt", "x")
    assert_user_error(r, f"opset {newest + 2}", f"opset {newest} the installed onnxruntime")
    assert not out.exists()
    with pytest.raises(onnxgrad.InvalidModelError):
        onnxgrad.grad(str(path), wrt=["x"])


def test_runtime_max_opset_is_what_onnxruntime_loads():
    import onnxruntime as ort

    newest = runtime_max_opset()
    assert newest >= onnxgrad.ir.load.RUNTIME_MAX_OPSET
    m = helper.make_model(helper.make_graph([helper.make_node("Neg", ["x"], ["y"])], "g",
                                            [helper.make_tensor_value_info("x", F, [2])],
                                            [helper.make_tensor_value_info("y", F, [2])]),
                          opset_imports=[helper.make_opsetid("", newest)])
    m.ir_version = 10
    ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])


def test_version():
    r = cli("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"onnxgrad {onnxgrad.__version__}"


def test_check_samples_big_models(tmp_path):
    """Many parameters: a sample checked one by one, every gradient together along directions."""
    rng = np.random.default_rng(0)
    nodes, inits, h = [], [], "x"
    for i in range(12):
        inits.append(numpy_helper.from_array(rng.standard_normal((4, 4)).astype(np.float32) * 0.5, f"W{i}"))
        nodes += [helper.make_node("MatMul", [h, f"W{i}"], [f"m{i}"]), helper.make_node("Tanh", [f"m{i}"], [f"h{i}"])]
        h = f"h{i}"
    nodes.append(helper.make_node("ReduceSum", [h], ["loss"], keepdims=0))
    path = save(tmp_path, "deep.onnx", nodes, [helper.make_tensor_value_info("x", F, [2, 4])],
                [helper.make_tensor_value_info("loss", F, [])], inits)
    gm = onnxgrad.grad(str(path))
    done = []
    r = C.check(str(path), gm, sample=3, progress=lambda k, n: done.append((k, n)))
    assert len(r.errors) == 3 and r.joint is not None and r.ok(1e-3)
    assert done[-1][0] == done[-1][1]
    out = cli(path, "-o", tmp_path / "g.onnx", "--check", "--check-sample", "2")
    assert out.returncode == 0 and "checked together" in out.stdout and out.stderr == ""


def test_loss_errors_name_the_command_line_flags(tmp_path, capsys):
    from pathlib import Path

    """The shipped models' output is 'y': a --target y collides, and the hint names --target, not target=."""
    model = tmp_path / "m.onnx"
    model.write_bytes((Path(__file__).resolve().parents[1] / "models" / "mlp_dynamo.onnx").read_bytes())
    assert CLI.main([str(model), "--loss-fn", "mse", "--target", "y"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "choose another with --target" in err and "target=" not in err
    assert not (tmp_path / "m.grad.onnx").exists()


def test_no_trainable_parameter_says_why_and_what_to_do(tmp_path, capsys):
    """Weights computed in the graph (as in onnx's zoo CNNs: ConstantOfShape) are no parameters: the
    command says so and how to name tensors with --wrt, instead of writing 'backward nodes: 0'."""
    nodes = [helper.make_node("ConstantOfShape", ["shape"], ["w"],
                              value=numpy_helper.from_array(np.array([0.5], np.float32))),
             helper.make_node("Mul", ["x", "w"], ["y"])]
    g = helper.make_graph(nodes, "computed", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])],
                          [numpy_helper.from_array(np.array([2, 3], np.int64), "shape")])
    path = tmp_path / "m.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), path)
    assert CLI.main([str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: no trainable parameter found") and "--wrt" in err and err.count("\n") == 1
    assert not (tmp_path / "m.grad.onnx").exists()
    assert CLI.main([str(path), "--wrt", "w"]) == 0


def test_optimize_for_and_recompute_reach_the_gradient_and_the_training_models(tmp_path, capsys):
    """--optimize-for cpu and --recompute give grad()'s and artifacts.build()'s target and recompute: the
    written models carry the rewrites and the recomputation, and the command says so; --group refuses both."""
    import json
    from pathlib import Path

    from onnxgrad.training.artifacts import TrainingSpec

    model = tmp_path / "cnn.onnx"
    model.write_bytes((Path(__file__).resolve().parents[1] / "models" / "cnn_bn_dynamo.onnx").read_bytes())
    assert CLI.main([str(model), "--optimize-for", "cpu", "--recompute"]) == 0
    out = capsys.readouterr().out
    rewritten = next(line for line in out.splitlines() if line.startswith("rewritten for onnxruntime cpu: "))
    assert "conv_forward_patches x1" in rewritten and "max_pool_taps x1" in rewritten
    assert "recomputed in the backward" in out
    meta = {p.key: p.value for p in onnx.load(tmp_path / "cnn.grad.onnx").metadata_props}
    assert json.loads(meta["onnxgrad.target"]) == "cpu" and json.loads(meta["onnxgrad.recomputed"])
    assert CLI.main([str(model), "--loss-fn", "cross_entropy", "--target", "label", "--optimizer", "adamw",
                     "--optimize-for", "cpu", "--recompute"]) == 0
    assert "rewritten for onnxruntime cpu" in capsys.readouterr().out
    train = onnx.load(tmp_path / "cnn.train.onnx")
    assert TrainingSpec.of(train).recompute and any("/conv_weight_grad_patches/" in n.name for n in train.graph.node)
    # three steps of each, driven by hand from their state files as a user would: the same losses and weights
    # (SGD: Adam turns the rounding noise of a gradient that is exactly zero, the conv bias before a batch
    # norm, into steps of the learning rate's size, in PyTorch too)
    for out, flags in (("cnn.train.onnx", ["--optimize-for", "cpu", "--recompute"]), ("canonical.train.onnx", [])):
        assert CLI.main([str(model), "--loss-fn", "cross_entropy", "--target", "label", "--optimizer", "sgd",
                         "--momentum", "0.9", "-o", str(tmp_path / out), *flags]) == 0
    capsys.readouterr()
    from onnxgrad.passes.recompute import ORT_DISABLED_OPTIMIZERS
    rng = np.random.default_rng(0)
    batches = [{"x": rng.standard_normal((2, 3, 16, 16)).astype(np.float32),
                "label": rng.integers(0, 5, 2).astype(np.int64)} for _ in range(3)]
    results = []
    for stem in ("cnn.train", "canonical.train"):
        model_proto = onnx.load(tmp_path / f"{stem}.onnx")
        spec = TrainingSpec.of(model_proto)
        sess = ort.InferenceSession(model_proto.SerializeToString(), providers=["CPUExecutionProvider"],
                                    disabled_optimizers=list(ORT_DISABLED_OPTIMIZERS))
        names = [o.name for o in sess.get_outputs()]
        held = load_file(tmp_path / f"{stem.split('.')[0]}.state.safetensors")
        held = {k: v for k, v in held.items() if k not in (spec.lr, spec.step)}
        pairs = {**spec.params, **{r: o for r, (_, o) in spec.buffers.items()},
                 **{i: o for st in spec.state.values() for i, o in st.values()}}
        losses = []
        for step, batch in enumerate(batches, start=1):
            out = dict(zip(names, sess.run(None, {**batch, **held, spec.lr: np.array(0.1, np.float32),
                                                    spec.step: np.array(step, np.int64)})))
            held = {i: out[o] for i, o in pairs.items()}
            losses.append(float(out[spec.loss]))
        results.append((losses, {p: held[p] for p in spec.params}))
    np.testing.assert_allclose(results[0][0], results[1][0], rtol=1e-5)
    for p, value in results[1][1].items():
        np.testing.assert_allclose(results[0][1][p], value, rtol=1e-4, atol=1e-5, err_msg=p)
    for args in (["--group", "--optimize-for", "cpu"], ["--group", "--recompute"],
                 ["--loss-fn", "mse", "--target", "t", "--optimizer", "sgd", "--group"]):
        assert CLI.main([str(model), "-o", str(tmp_path / "other.onnx"), *args]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "--group" in err
    assert not (tmp_path / "other.onnx").exists()
