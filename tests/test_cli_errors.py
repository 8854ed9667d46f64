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


# -- the command line's words: flags, not Python arguments --------------------------------------------------
@pytest.fixture
def tiny(tmp_path):
    """x [4, 3] @ W [3, 2] -> Tanh -> y [4, 2]: one output, not a scalar."""
    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((3, 2)).astype(np.float32), "W")
    return save(tmp_path, "tiny.onnx", [helper.make_node("MatMul", ["x", "W"], ["h"]),
                                        helper.make_node("Tanh", ["h"], ["y"])],
                [helper.make_tensor_value_info("x", F, [4, 3])], [helper.make_tensor_value_info("y", F, [4, 2])],
                [w])


@pytest.mark.parametrize("args, flags, python", [
    (["--loss", "y"], "loss 'y' has shape [4, 2], not a scalar; use --of y to seed it",
     "loss 'y' has shape [4, 2], not a scalar; use of=['y'] to seed it"),
    (["--loss", "nope"], "loss 'nope' is not an output of the model (outputs: y); name the loss output with --loss, "
     "or append a loss with --loss-fn", "loss 'nope' is not an output of the model (outputs: y); name the loss "
     "output with loss=, or append a loss from onnxgrad.losses"),
])
def test_errors_name_the_flags_on_the_command_line_and_the_keywords_in_python(tiny, capsys, args, flags, python):
    """One error, two spellings: the command line says --of y where the API says of=['y']."""
    assert CLI.main([str(tiny), *args]) == 2
    assert capsys.readouterr().err == f"error: {flags}\n"
    with pytest.raises(onnxgrad.OnnxGradError) as e:
        onnxgrad.grad(str(tiny), loss=args[1])
    assert str(e.value) == python and e.value.on_command_line() == flags


def test_help_lists_every_command_and_says_where_lr_lives():
    text = " ".join(CLI._grad_parser().format_help().split())
    for command in CLI.COMMANDS:
        assert f"python -m onnxgrad {command}" in text, command
    assert "--lr LR initial learning rate: the value of the required lr input in <stem>.state.safetensors" in text
    assert "stored as" not in text


def test_a_folded_export_is_refused_with_the_way_out_first_and_a_few_names(tmp_path, capsys):
    """8 convolutions whose weights TorchScript computed by folding BatchNorm into them (an eval-mode export):
    the refusal leads with what to do, names 5 of them and counts the rest, in the command line's words."""
    rng = np.random.default_rng(0)
    nodes, weights, x = [], [], "x"
    for k in range(8):
        weights.append(numpy_helper.from_array(rng.standard_normal((2, 2, 1, 1)).astype(np.float32),
                                               f"onnx::Conv_{100 + k}"))
        nodes.append(helper.make_node("Conv", [x, f"onnx::Conv_{100 + k}"], [f"h{k}"], name=f"conv{k}"))
        x = f"h{k}"
    nodes.append(helper.make_node("Identity", [x], ["y"]))
    path = save(tmp_path, "folded.onnx", nodes, [helper.make_tensor_value_info("x", F, [1, 2, 4, 4])],
                [helper.make_tensor_value_info("y", F, [1, 2, 4, 4])], weights)
    assert CLI.main([str(path), "--loss-fn", "mse", "--target", "t", "--optimizer", "sgd"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and len(err) < 700, err
    assert err.startswith("error: cannot train as PyTorch would: export with onnxgrad.from_torch(module, args)")
    assert "or pass --eval-mode to train the folded weights" in err and "train_mode" not in err
    assert "the weights of 8 convolution(s) by constant folding ('conv0', 'conv1', 'conv2', 'conv3', 'conv4' and " \
           "3 more)" in err
    with pytest.raises(onnxgrad.ExportFoldedError, match="or pass train_mode=False to train the folded weights"):
        onnxgrad.TrainingSession(onnxgrad.losses.mse_loss(onnx.load(path), target="t"), loss="loss")


def test_training_artifacts_print_a_summary_and_every_tensor_with_v(tmp_path, capsys):
    from pathlib import Path

    model = tmp_path / "mlp.onnx"
    model.write_bytes((Path(__file__).resolve().parents[1] / "models" / "training" / "mlp.onnx").read_bytes())
    args = [str(model), "--loss-fn", "cross_entropy", "--target", "y", "--optimizer", "adamw"]
    assert CLI.main(args) == 0
    short = capsys.readouterr().out.splitlines()
    assert short[-3:] == [
        "training inputs: data x float32 [N, 8], y int64 [N]; from mlp.state.safetensors: 4 parameter(s), "
        "8 optimizer-state tensor(s), lr, step",
        "training outputs: loss, finite, grad_norm; and 13 <name>.next to feed back as <name> for the next step",
        "(-v lists every parameter, input and output)"]
    assert "trainable parameters of loss 'loss': 4" in short and not any("exp_avg" in line for line in short)
    assert CLI.main([*args, "-v"]) == 0
    full = capsys.readouterr().out.splitlines()
    assert "  0.weight: PyTorch parameter (exporter metadata)" in full
    assert any(line.startswith("  0.weight.exp_avg: float32 [16, 8]") for line in full)
    assert any(line.startswith("  step.next: int64 []") for line in full)
    assert len(full) > len(short) + 30
