"""python -m onnxgrad: output file, summary, --check, and one-line errors with exit code 2."""
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxgrad.errors import OnnxGradError

F = TensorProto.FLOAT


def cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "onnxgrad", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, timeout=120)


@pytest.fixture
def model_path(tmp_path):
    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((3, 2)).astype(np.float32), "W")
    g = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["h"], name="mm"), helper.make_node("Tanh", ["h"], ["y"], name="t")],
        "g", [helper.make_tensor_value_info("x", F, [4, 3])], [helper.make_tensor_value_info("y", F, [4, 2])], [w])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    path = tmp_path / "tiny.onnx"
    onnx.save(m, path)
    return path


def test_writes_gradient_model_and_summary(model_path):
    r = cli(model_path, "--check")
    assert r.returncode == 0, r.stderr
    out_path = model_path.with_name("tiny.grad.onnx")
    gm = onnx.load(out_path)
    onnx.checker.check_model(gm, full_check=True)
    assert "forward nodes: 2" in r.stdout and "backward nodes:" in r.stdout
    assert "seed input y_grad [4, 2]" in r.stdout and "gradient W_grad [3, 2]" in r.stdout
    line = next(ln for ln in r.stdout.splitlines() if ln.strip().startswith("W_grad:"))
    assert float(line.split()[-1]) < 1e-3


def test_output_path_and_wrt(model_path, tmp_path):
    out = tmp_path / "sub" / "g.onnx"
    r = cli(model_path, "-o", out, "--wrt", "x", "W", "--of", "y")
    assert r.returncode == 0, r.stderr
    assert [o.name for o in onnx.load(out).graph.output] == ["y", "x_grad", "W_grad"]


@pytest.mark.parametrize("args, message", [
    (["--wrt", "nope"], "wrt 'nope'"),
    (["--loss", "y"], "not a scalar"),
    (["--of", "h"], "not an output"),
])
def test_user_errors_are_one_line_and_exit_2(model_path, args, message):
    r = cli(model_path, *args)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], r.stderr


def test_unreadable_and_missing_models(tmp_path):
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"not a model at all")
    for path in (bad, tmp_path / "missing.onnx"):
        r = cli(path)
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and r.stderr.startswith("error: ")


def test_refuses_to_overwrite_the_input(model_path):
    before = model_path.read_bytes()
    r = cli(model_path, "-o", model_path)
    assert r.returncode == 2 and "input model" in r.stderr
    assert model_path.read_bytes() == before


def test_help():
    r = cli("--help")
    assert r.returncode == 0 and "--wrt" in r.stdout and "--check" in r.stdout


def test_ops_command_lists_every_op():
    r = cli("ops")
    assert r.returncode == 0
    assert "ops with a Differentiable input: 121" in r.stdout
    rows = [ln.split()[0] for ln in r.stdout.splitlines()[1:] if ln and not ln.startswith(("ai.onnx", "ops ", "untagged", "rules", "backend"))]
    assert {"MatMul", "Conv", "Softmax", "Shape"} <= set(rows)


def test_large_models_are_saved_with_external_data(model_path, tmp_path, monkeypatch):
    from onnxgrad.ir import files

    monkeypatch.setattr(files, "PROTOBUF_LIMIT", 10)          # stand-in for protobuf's 2 GB
    model = onnx.load(model_path)
    out = tmp_path / "big" / "m.onnx"
    files.save_model(model, str(out))
    assert (tmp_path / "big" / "m.onnx.data").exists()
    loaded = onnx.load(str(out))                              # reads the tensors from beside it
    np.testing.assert_array_equal(numpy_helper.to_array(loaded.graph.initializer[0]),
                                  numpy_helper.to_array(model.graph.initializer[0]))
    assert [p.name for p in tmp_path.joinpath("big").iterdir() if p.name.startswith(".")] == []


def test_ops_cases_keep_stderr_clean(capfd, monkeypatch):
    """`ops --cases` probes onnxruntime and numpy on purpose (failing runs, NaNs): their logs and warnings
    stay off stderr. Stand-in cases make the noise a real case can make: a numpy RuntimeWarning and an
    onnxruntime warning log (an initializer that is also a graph input)."""
    import backend_cases
    import onnxruntime as ort

    from onnxgrad.tools import coverage

    noisy = helper.make_model(helper.make_graph(
        [helper.make_node("Neg", ["w"], ["y"])], "g", [helper.make_tensor_value_info("w", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])],
        [numpy_helper.from_array(np.ones(1, np.float32), "w")]), opset_imports=[helper.make_opsetid("", 17)])
    noisy.ir_version = 8

    def run_case(case):
        np.log(np.array([-1.0]))
        ort.InferenceSession(noisy.SerializeToString(), providers=["CPUExecutionProvider"])
        return backend_cases.Outcome(case.name, case.op_type, "pass", "")

    chosen = [c for c in backend_cases.all_cases() if c.name in ("test_log", "test_sqrt", "test_pow")]
    monkeypatch.setattr(backend_cases, "all_cases", lambda: chosen)
    monkeypatch.setattr(backend_cases, "run_case", run_case)
    run_case(chosen[0])                                       # unquieted, the stand-in is noisy
    assert capfd.readouterr().err != ""
    assert coverage.print_table(run_cases=True) == 0
    out, err = capfd.readouterr()
    assert err == ""
    rows = {ln.split()[0]: ln.split() for ln in out.splitlines() if ln.split()}
    assert rows["Log"][3] == "1/1" and rows["Sqrt"][3] == "1/1"


def test_ops_cases_without_the_test_harness_is_one_clear_error(tmp_path, monkeypatch, capsys):
    """An installed package has no tests/backend_cases.py: `ops --cases` says so, `ops` alone still works."""
    import sys

    from onnxgrad.tools import cli, coverage

    monkeypatch.delitem(sys.modules, "backend_cases", raising=False)
    monkeypatch.setattr(coverage, "BACKEND_CASES", tmp_path / "tests" / "backend_cases.py")
    with pytest.raises(OnnxGradError, match=r"test harness \(tests/backend_cases.py\).*source checkout"):
        cli.run_ops(["--cases"])
    assert cli.run_ops([]) == 0 and "ai.onnx ops:" in capsys.readouterr().out


def _bert_embeddings(buffer: int) -> onnx.ModelProto:
    """BERT's embeddings as the exporters write them: its ``token_type_ids`` buffer (1, ``buffer``) read by
    GatherElements at the 32 ``position_ids``, then the type embedding; an Erf (GELU's), which onnxruntime
    has no float64 kernel for, puts the float64 check in onnx.reference."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((50, 8)).astype(np.float32), "word_embeddings.weight"),
             numpy_helper.from_array(rng.standard_normal((2, 8)).astype(np.float32), "token_type_embeddings.weight"),
             numpy_helper.from_array(np.zeros((1, buffer), np.int64), "token_type_ids"),
             numpy_helper.from_array(np.arange(32, dtype=np.int64)[None], "position_ids")]
    nodes = [helper.make_node("Gather", ["word_embeddings.weight", "input_ids"], ["words"], name="words"),
             helper.make_node("GatherElements", ["token_type_ids", "position_ids"], ["types"], axis=1,
                              name="buffered_token_type_ids"),
             helper.make_node("Gather", ["token_type_embeddings.weight", "types"], ["type_emb"], name="types"),
             helper.make_node("Add", ["words", "type_emb"], ["h"], name="add"),
             helper.make_node("Erf", ["h"], ["e"], name="erf"),
             helper.make_node("ReduceSumSquare", ["e"], ["loss"], keepdims=0, name="loss")]
    g = helper.make_graph(nodes, "bert_embeddings", [helper.make_tensor_value_info("input_ids", TensorProto.INT64,
                                                                                   [1, 32])],
                          [helper.make_tensor_value_info("loss", F, [])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    onnx.checker.check_model(m, full_check=True)
    return m


def test_check_runs_bert_embeddings_in_onnx_reference(tmp_path):
    """onnx.reference's GatherElements failed on BERT: "cannot reshape array of size 1 into shape (1,32)"."""
    path = tmp_path / "bert.onnx"
    onnx.save(_bert_embeddings(512), path)
    r = cli(path, "--loss", "loss", "--check")
    assert r.returncode == 0, r.stderr
    assert "numeric check (reference float64" in r.stdout
    for name in ("word_embeddings.weight_grad", "token_type_embeddings.weight_grad"):
        error = float(r.stdout.split(f"{name}: worst relative error ")[1].split()[0])
        assert error < 1e-4, r.stdout


def test_check_names_the_node_onnx_reference_cannot_evaluate(tmp_path):
    """A buffer too short for the positions: onnxruntime refuses the model too, but the check says where."""
    path = tmp_path / "bert.onnx"
    onnx.save(_bert_embeddings(16), path)
    r = cli(path, "--loss", "loss", "--check")
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    assert r.stderr.startswith("error: --check could not run the model on random inputs: onnx.reference cannot "
                               "evaluate node 'buffered_token_type_ids' (GatherElements)"), r.stderr
    assert not (tmp_path / "bert.grad.onnx").exists()


def test_ops_cases_finds_the_harness_in_a_checkout():
    """Outside pytest (``python -m onnxgrad ops --cases`` from a checkout) the backend cases load from tests/."""
    from onnxgrad.tools import coverage

    assert coverage.BACKEND_CASES == Path(__file__).resolve().parent / "backend_cases.py"
