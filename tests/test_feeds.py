"""A batch that does not fit the model is refused before the run, with one FeedError naming each input, what the
model declares and what was given (onnxgrad.training.feeds); int32 labels are converted with one warning,
float64 images are refused."""
from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from mlp_batches import DATA, assert_unchanged, batch
from onnxgrad import FeedConversionWarning, FeedError, TrainingSession, losses, optim
from onnxgrad.training.feeds import lossless

MLP = Path(__file__).resolve().parents[1] / "models" / "training" / "mlp.onnx"
X, Y = DATA["x"][0][:4], DATA["y"][0][:4]          # x: [N, 8] float32, y: [N] int64


def mlp(batch_size: int | None = None, **kw) -> TrainingSession:
    """The MLP fixture, its batch symbolic (N) or fixed at ``batch_size``."""
    model = onnx.load(MLP)
    if batch_size is not None:
        model.graph.input[0].type.tensor_type.shape.dim[0].dim_value = batch_size
    return TrainingSession(model, loss=losses.CrossEntropyLoss(output="logits", target="y"),
                           optimizer=optim.Adam(lr=1e-2), providers=["CPUExecutionProvider"], **kw)


def refused(s: TrainingSession, feeds: dict, message: str) -> None:
    """``feeds`` are refused with exactly ``message`` after "step: the batch does not fit the model's inputs: ",
    and the session is unchanged."""
    before, state, count = s.parameters(), s.optimizer_state(), s.step_count
    with pytest.raises(FeedError) as e:
        s.step(feeds)
    assert str(e.value) == "step: the batch does not fit the model's inputs: " + message
    assert s.step_count == count
    assert_unchanged(s, before, state)


@pytest.mark.parametrize("accumulation_steps", [1, 2])
def test_inputs_that_disagree_on_the_batch_size_are_refused(accumulation_steps):
    """3 labels for 4 images: onnxruntime said "Shape mismatch attempting to re-use buffer. {3,10} != {4,10}"."""
    s = mlp(accumulation_steps=accumulation_steps)
    refused(s, {"x": X, "y": Y[:3]}, "'y' is int64 [3], the model takes int64 [N]: dimension 0 is N, which is 4 "
            "in 'x': give every input the same N (the batch size)")
    s.step({"x": X, "y": Y})               # the same session takes a batch that fits
    assert s.step_count == (1 if accumulation_steps == 1 else 0)


def test_a_static_size_is_checked():
    """A batch fixed in the model: onnxruntime said "Got invalid dimensions for input: y"."""
    s = mlp(batch_size=4)
    refused(s, {"x": X, "y": Y[:3]}, "'y' is int64 [3], the model takes int64 [4]: dimension 0 must be 4")
    refused(mlp(), {"x": X[:, :7], "y": Y}, "'x' is float32 [4, 7], the model takes float32 [N, 8]: dimension 1 "
            "must be 8")


def test_the_rank_is_checked():
    refused(mlp(), {"x": X[:, :, None], "y": Y}, "'x' is float32 [4, 8, 1], the model takes float32 [N, 8]: it has 3 "
            "dimension(s), the input 2: reshape it")


def test_every_input_that_does_not_fit_is_named_at_once():
    refused(mlp(), {"x": X[:, :7].astype(np.float64), "y": Y[:3].astype(np.float32)},
            "'x' is float64 [4, 7], the model takes float32 [N, 8]: cast it with .astype(np.float32) (a float64 "
            "batch is not rounded silently; PyTorch refuses one for a float32 module too), dimension 1 must be 8; "
            "'y' is float32 [3], the model takes int64 [N]: cast it with .astype(np.int64) if its values fit, "
            "dimension 0 is N, which is 4 in 'x': give every input the same N (the batch size)")


def test_float64_images_are_refused_not_rounded():
    refused(mlp(), {"x": X.astype(np.float64), "y": Y}, "'x' is float64 [4, 8], the model takes float32 [N, 8]: "
            "cast it with .astype(np.float32) (a float64 batch is not rounded silently; PyTorch refuses one for a "
            "float32 module too)")


def test_int32_labels_are_converted_with_one_warning():
    s, reference = mlp(), mlp()
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        losses_ = [s.step({"x": batch(k)["x"], "y": batch(k)["y"].astype(np.int32)}) for k in range(3)]
        s.eval({"x": X, "y": Y.astype(np.int32)})                # the same input: said already
    assert [(w.category, str(w.message)) for w in said] == [
        (FeedConversionWarning, "step: 'y' is int32 and the model takes int64: converted, no value changes; pass "
         "int64 to spare the copy (said once)")]
    assert losses_ == [reference.step(batch(k)) for k in range(3)]


@pytest.mark.parametrize("given, declared, converted", [
    (np.int32, np.int64, True), (np.uint8, np.float32, True), (np.float16, np.float32, True),
    (np.bool_, np.int64, True), (np.float64, np.float32, False), (np.int64, np.int32, False),
    (np.int64, np.float32, False), (np.float32, np.int64, False),
])
def test_only_conversions_that_change_no_value_are_made(given, declared, converted):
    assert lossless(np.dtype(given), np.dtype(declared)) == converted


def test_eval_checks_its_feeds():
    s = mlp()
    with pytest.raises(FeedError, match=r"^eval: the batch does not fit the model's inputs: 'x' is float32 \[4, 7\], "
                       r"the model takes float32 \[N, 8\]: dimension 1 must be 8$"):
        s.eval({"x": X[:, :7]})
    with pytest.raises(FeedError, match=r"^eval: .* 'y' is int64 \[3\], the model takes int64 \[N\]: dimension 0 "
                       r"is N, which is 4 in 'x'"):
        s.eval({"x": X, "y": Y[:3]})


def test_ortvalue_batches_are_checked_where_they_lie():
    s = mlp()
    feeds = {"x": ort.OrtValue.ortvalue_from_numpy(X[:3]), "y": ort.OrtValue.ortvalue_from_numpy(Y)}
    refused(s, feeds, "'y' is int64 [4] on cpu, the model takes int64 [N]: dimension 0 is N, which is 3 in 'x': "
            "give every input the same N (the batch size)")
    refused(s, {"x": ort.OrtValue.ortvalue_from_numpy(X[:, :, None]), "y": Y},
            "'x' is float32 [4, 8, 1] on cpu, the model takes float32 [N, 8]: it has 3 dimension(s), the input 2: "
            "reshape it")


def test_torch_batches_are_checked_where_they_lie():
    torch = pytest.importorskip("torch")
    refused(mlp(), {"x": torch.from_numpy(X.copy()), "y": torch.from_numpy(Y[:3].copy())},
            "'y' is int64 [3] on cpu, the model takes int64 [N]: dimension 0 is N, which is 4 in 'x': give every "
            "input the same N (the batch size)")
