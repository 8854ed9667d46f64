"""Gradient checks for the Fourier transforms (rules/spectral.py).

DFT's input and STFT's signal and window are tagged NonDifferentiable, but
torch.fft and torch.stft differentiate them: checked against central
differences, and against torch autograd where torch is installed.
"""
from __future__ import annotations

import numpy as np
import pytest

import harness
import onnxgrad
from harness import Case, randn, run_case
from onnxgrad.tools.check import Runner


def i64(v):
    return np.array(v, np.int64)


DFT = [
    # opset 17: axis attribute
    Case("DFT", [randn(2, 5, 1)], {"axis": 1}, opset=17, id="real"),
    Case("DFT", [randn(2, 5, 2)], {"axis": 1}, opset=17, id="complex"),
    Case("DFT", [randn(2, 5, 2)], {"axis": 1, "inverse": 1}, opset=17, id="inverse"),
    Case("DFT", [randn(2, 6, 1)], {"axis": 1, "onesided": 1}, opset=17, id="onesided-even"),
    Case("DFT", [randn(2, 5, 1)], {"axis": 1, "onesided": 1}, opset=17, id="onesided-odd"),
    Case("DFT", [randn(2, 3, 4, 2)], {"axis": 2, "inverse": 1}, opset=17, id="inner-axis-inverse"),
    # opset 20: dft_length and axis inputs
    Case("DFT", [randn(3, 4, 2), i64(6)], {}, opset=20, id="zero-padded"),
    Case("DFT", [randn(3, 4, 2), i64(3), i64(0)], {}, opset=20, id="cut-axis0"),
    Case("DFT", [randn(3, 4, 1), i64(7), i64(1)], {"onesided": 1}, opset=20, id="onesided-zero-padded"),
    Case("DFT", [randn(3, 6, 1), i64(4), i64(-2)], {"onesided": 1}, opset=20, id="onesided-cut"),
    Case("DFT", [randn(2, 3, 4, 2), None, i64(-3)], {"inverse": 1}, opset=20, id="negative-axis-inverse"),
    Case("DFT", [randn(2, 3, 4, 1)], {}, opset=20, id="default-axis"),
    # the inverse one-sided DFT (IRFFT): a one-sided spectrum in, a real signal of length N out
    Case("DFT", [randn(2, 4, 2)], {"axis": 1, "inverse": 1, "onesided": 1}, opset=17, id="irfft-default-length"),
    Case("DFT", [randn(2, 4, 2), i64(7)], {"axis": 1, "inverse": 1, "onesided": 1}, opset=17, id="irfft-odd"),
    Case("DFT", [randn(3, 5, 2), i64(6), i64(-2)], {"inverse": 1, "onesided": 1}, opset=20, id="irfft-cut"),
    # (no IRFFT case with a dft_length that zero-pads the spectrum, or cuts it to an odd length: onnxruntime
    # 1.32's forward then differs from numpy.fft.irfft, torch.fft.irfft and onnx.reference by 0.06-0.2)
    Case("DFT", [randn(4, 3, 2), i64(6), i64(0)], {"inverse": 1, "onesided": 1}, opset=20, id="irfft-axis0"),
]

# onnx's shape inference takes STFT's onesided default as 0: the cases give it
STFT = [
    Case("STFT", [randn(2, 16, 1), i64(4), randn(8), None], {"onesided": 1}, id="window-onesided"),
    Case("STFT", [randn(2, 15, 1), i64(3), None, i64(6)], {"onesided": 0}, id="rectangular-twosided"),
    Case("STFT", [randn(1, 13, 1), i64(2), randn(5), i64(5)], {"onesided": 1}, id="odd-window-overlapping"),
    Case("STFT", [randn(1, 12, 2), i64(4), randn(5), None], {"onesided": 0}, id="complex"),
    Case("STFT", [randn(2, 10, 1), i64(5), randn(4), None], {"onesided": 1}, wrt=[2], id="window-only"),
]


@pytest.mark.parametrize("case", DFT + STFT, ids=str)
def test_rule(case):
    run_case(case)


def _agree_with_torch(case, forward, torch):
    """The forward and the gradients of the case's float inputs, onnxruntime against torch autograd."""
    model, feeds, wrt = harness.case_model(case)
    gm = onnxgrad.grad(model, wrt=wrt, of=["y0"])
    y = Runner(model)(feeds)["y0"]
    seed = randn(*y.shape)
    got = Runner(gm)({**feeds, "y0_grad": seed})
    tensors = [torch.tensor(feeds[name], dtype=torch.float64, requires_grad=True) for name in wrt]
    out = forward(*tensors)
    np.testing.assert_allclose(y, out.detach().numpy(), rtol=1e-4, atol=1e-4)
    want = torch.autograd.grad(out, tensors, torch.tensor(seed, dtype=torch.float64))
    for name, w in zip(wrt, want):
        np.testing.assert_allclose(got[f"{name}_grad"], w.numpy(), rtol=1e-4, atol=1e-4, err_msg=name)


@pytest.mark.parametrize("attrs, n", [({}, None), ({"inverse": 1}, None), ({"onesided": 1}, None),
                                      ({"onesided": 1}, 8), ({}, 3), ({"inverse": 1, "onesided": 1}, None),
                                      ({"inverse": 1, "onesided": 1}, 8)],
                         ids=["fft", "ifft", "rfft", "rfft-n8", "fft-n3", "irfft", "irfft-n8"])
def test_dft_matches_torch_fft(attrs, n):
    torch = pytest.importorskip("torch")
    irfft = attrs.get("inverse") and attrs.get("onesided")
    complex_input = not attrs.get("onesided") or irfft
    x = randn(3, 6, 2 if complex_input else 1)
    case = Case("DFT", [x, None if n is None else i64(n), i64(1)], attrs, opset=20)

    def forward(t):
        signal = torch.view_as_complex(t) if complex_input else t[..., 0]
        if irfft:
            return torch.fft.irfft(signal, n=n, dim=1)[..., None]
        fft = torch.fft.rfft if attrs.get("onesided") else torch.fft.ifft if attrs.get("inverse") else torch.fft.fft
        return torch.view_as_real(fft(signal, n=n, dim=1))

    _agree_with_torch(case, forward, torch)


@pytest.mark.parametrize("onesided", [1, 0])
def test_stft_matches_torch_stft(onesided):
    torch = pytest.importorskip("torch")
    case = Case("STFT", [randn(2, 20, 1), i64(3), randn(8), None], {"onesided": onesided}, opset=17)

    def forward(signal, window):
        spec = torch.stft(signal[..., 0], n_fft=8, hop_length=3, window=window, center=False,
                          onesided=bool(onesided), return_complex=True)
        return torch.view_as_real(spec).transpose(1, 2)          # (batch, frames, bins, 2)

    _agree_with_torch(case, forward, torch)
