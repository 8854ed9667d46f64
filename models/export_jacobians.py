"""Write models/jacobians/mlp.npz: torch.func's Jacobians and Hessian of the MLPs in models/ (needs torch).

The PyTorch functions are rebuilt from the ONNX models' own weights (Gemm with transB, Relu,
Tanh; cross-entropy for mlp_ce), so the references are of exactly the graphs onnxgrad reads:

- ``jacrev/y/x``, ``jacfwd/y/x``: torch.func.jacrev / jacfwd of mlp_dynamo's y [8, 4] with
  respect to x [8, 16], shape [8, 4, 8, 16];
- ``hessian/<a>/<b>``: torch.func.hessian of mlp_ce_dynamo's loss with respect to
  (mlp.fc2.bias, mlp.fc3.bias), each block [a.shape + b.shape];
- ``input/<name>``: the inputs (the models' own .npz inputs).

Computed in float64, stored as float32. Run: ``python models/export_jacobians.py``.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import torch
import torch.nn.functional as F
from onnx import numpy_helper

HERE = Path(__file__).resolve().parent
HESSIAN_WRT = ("mlp.fc2.bias", "mlp.fc3.bias")


def _weights(stem: str) -> dict[str, torch.Tensor]:
    m = onnx.load(str(HERE / f"{stem}.onnx"))
    return {i.name: torch.tensor(numpy_helper.to_array(i), dtype=torch.float64) for i in m.graph.initializer}


def _inputs(stem: str) -> dict[str, np.ndarray]:
    with np.load(HERE / f"{stem}.npz") as z:
        return {k[len("input/"):]: z[k] for k in z.files if k.startswith("input/")}


def _mlp(w: dict[str, torch.Tensor], x: torch.Tensor, prefix: str = "") -> torch.Tensor:
    h = torch.relu(x @ w[prefix + "fc1.weight"].T + w[prefix + "fc1.bias"])
    h = torch.tanh(h @ w[prefix + "fc2.weight"].T + w[prefix + "fc2.bias"])
    return h @ w[prefix + "fc3.weight"].T + w[prefix + "fc3.bias"]


def main() -> None:
    out: dict[str, np.ndarray] = {}
    w = _weights("mlp_dynamo")
    feeds = _inputs("mlp_dynamo")
    x = torch.tensor(feeds["x"], dtype=torch.float64)
    f = lambda x: _mlp(w, x)  # noqa: E731
    out["jacrev/y/x"] = torch.func.jacrev(f)(x).numpy().astype(np.float32)
    out["jacfwd/y/x"] = torch.func.jacfwd(f)(x).numpy().astype(np.float32)
    out["input/x"] = feeds["x"]

    w = _weights("mlp_ce_dynamo")
    ce = _inputs("mlp_ce_dynamo")
    xc = torch.tensor(ce["x"], dtype=torch.float64)
    target = torch.tensor(ce["target"], dtype=torch.int64)

    def loss(b2: torch.Tensor, b3: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(_mlp({**w, HESSIAN_WRT[0]: b2, HESSIAN_WRT[1]: b3}, xc, "mlp."), target)

    blocks = torch.func.hessian(loss, argnums=(0, 1))(w[HESSIAN_WRT[0]], w[HESSIAN_WRT[1]])
    for i, a in enumerate(HESSIAN_WRT):
        for j, b in enumerate(HESSIAN_WRT):
            out[f"hessian/{a}/{b}"] = blocks[i][j].numpy().astype(np.float32)
    out["ce_input/x"], out["ce_input/target"] = ce["x"], ce["target"]
    (HERE / "jacobians").mkdir(exist_ok=True)
    np.savez_compressed(HERE / "jacobians" / "mlp.npz", **out)
    print(f"wrote {HERE / 'jacobians' / 'mlp.npz'}: " + ", ".join(f"{k} {v.shape}" for k, v in out.items()))


if __name__ == "__main__":
    main()
