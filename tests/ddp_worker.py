"""One worker of tests/test_distributed.py: runs every data-parallel scenario and saves what it saw.

    python tests/ddp_worker.py OUT ENGINE          # ENGINE: torch (env as torchrun sets it) or mpi (under mpiexec)

Each scenario is a function of ``make`` (builds a TrainingSession), ``rank``, ``world`` and ``dp`` (data
parallel or not); the test runs the same function in one process on the full batch (``world=1``,
``dp=False``) for the reference. Each worker writes ``OUT/rank<r>.npz``: ``<scenario>/<name>`` arrays.
"""
from __future__ import annotations

import sys
import warnings
from pathlib import Path

import numpy as np
import onnx

from onnxgrad.training.distributed import Engine

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "models" / "training"


def model() -> onnx.ModelProto:
    return onnx.load(FIXTURES / "mlp.onnx")       # 8 -> 16 -> ReLU -> 3, dynamo export


def batches() -> tuple[np.ndarray, np.ndarray]:
    data = np.load(FIXTURES / "trajectories.npz")
    return data["x"], data["y"]                   # 5 global batches of 16 samples


def shard(x: np.ndarray, rank: int, world: int, sizes: list[int] | None = None) -> np.ndarray:
    """This worker's rows of a global batch: equal parts, or ``sizes`` (one per worker)."""
    if world == 1:
        return x
    sizes = sizes or [len(x) // world] * world
    start = sum(sizes[:rank])
    return x[start:start + sizes[rank]]


def loss():
    from onnxgrad import losses
    return losses.CrossEntropyLoss(output="logits", target="y")


def _params(s) -> dict[str, np.ndarray]:
    return {f"param/{k}": v for k, v in s.parameters().items()}


# -- the scenarios ------------------------------------------------------------------------------------
def grad(make, rank, world, dp):
    """One step: the averaged gradient the update used, and the loss the step reports."""
    from onnxgrad import optim
    s = make(optimizer=optim.SGD(lr=0.1), keep_grads=True)
    x, y = batches()
    out = {"loss": np.array(s.step({"x": shard(x[0], rank, world), "y": shard(y[0], rank, world)}))}
    out.update({f"grad/{k}": v for k, v in s.grads().items()})
    return out


def sgd5(make, rank, world, dp):
    """Five SGD-with-momentum steps: losses and the parameters after each."""
    from onnxgrad import optim
    s = make(optimizer=optim.SGD(lr=0.1, momentum=0.9))
    x, y = batches()
    out = {}
    for t in range(5):
        out[f"loss{t}"] = np.array(s.step({"x": shard(x[t], rank, world), "y": shard(y[t], rank, world)}))
        out.update({f"{k}@{t}": v for k, v in _params(s).items()})
    return out


def uneven(make, rank, world, dp):
    """Shards of 5 and 11 samples: the update follows the mean over the 16."""
    from onnxgrad import optim
    s = make(optimizer=optim.SGD(lr=0.1, momentum=0.9), keep_grads=True)
    x, y = batches()
    out = {}
    for t in range(2):
        out[f"loss{t}"] = np.array(s.step({"x": shard(x[t], rank, world, [5, 11]),
                                           "y": shard(y[t], rank, world, [5, 11])}))
    out.update({f"grad/{k}": v for k, v in s.grads().items()})
    out.update(_params(s))
    return out


def clip_adamw(make, rank, world, dp):
    """AdamW with an active global-norm clip: every worker clips the reduced gradient alike."""
    from onnxgrad import optim
    s = make(optimizer=optim.AdamW(lr=1e-2), clip_grad_norm=0.05)
    x, y = batches()
    out = {}
    for t in range(3):
        s.step({"x": shard(x[t], rank, world), "y": shard(y[t], rank, world)})
        out[f"grad_norm{t}"] = np.array(s.last_grad_norm)
    out.update(_params(s))
    return out


def nonfinite(make, rank, world, dp):
    """Step 2 has NaN inputs in the second half of the batch (rank 1's shard): every worker skips it."""
    from onnxgrad import optim
    s = make(optimizer=optim.SGD(lr=0.1, momentum=0.9), on_nonfinite="skip")
    x, y = batches()
    out = {}
    for t in range(3):
        xt = x[t].copy()
        if t == 1:
            xt[12:] = np.nan
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            s.step({"x": shard(xt, rank, world), "y": shard(y[t], rank, world)})
        out[f"warned{t}"] = np.array(len(caught))
        out.update({f"{k}@{t}": v for k, v in _params(s).items()})
    out["skipped"] = np.array(s.skipped_steps)
    out["steps"] = np.array(s.step_count)
    return out


def accumulate(make, rank, world, dp, out_dir="."):
    """Two micro-batches per worker per update (data parallel) against one process on the whole batch."""
    from onnxgrad import optim
    from onnxgrad.training.session import CheckpointError
    k = 2 if dp else 1
    s = make(optimizer=optim.SGD(lr=0.1, momentum=0.9), accumulation_steps=k)
    x, y = batches()
    out = {}
    for t in range(3):
        xs, ys = shard(x[t], rank, world), shard(y[t], rank, world)
        for j, (xm, ym) in enumerate(zip(np.array_split(xs, k), np.array_split(ys, k))):
            last = s.step({"x": xm, "y": ym})
            if dp and t == 0 and j == 0:      # mid-update, each worker's partial sum is its own
                try:
                    s.save(Path(out_dir) / "mid-update.onnxgrad")
                    out["mid_update_save_refused"] = np.array(False)
                except CheckpointError:
                    out["mid_update_save_refused"] = np.array(True)
        out[f"loss{t}"] = np.array(last)
    out["steps"] = np.array(s.step_count)
    out.update(_params(s))
    return out


def resume(make, rank, world, dp, out_dir=None, load=None):
    """Adam: 2 steps, rank 0 saves, every worker loads that file and takes 2 more; and 4 steps unbroken."""
    from onnxgrad import optim
    x, y = batches()

    def feed(t):
        return {"x": shard(x[t], rank, world), "y": shard(y[t], rank, world)}
    s = make(optimizer=optim.Adam(lr=1e-2))
    for t in range(4):
        s.step(feed(t))
    out = {f"unbroken/{k}": v for k, v in _params(s).items()}
    if out_dir is None:
        return out
    s = make(optimizer=optim.Adam(lr=1e-2))
    for t in range(2):
        s.step(feed(t))
    s.save(out_dir / f"ckpt{rank}.onnxgrad")        # rank 0 alone writes
    s.barrier()
    out["wrote"] = np.array((out_dir / f"ckpt{rank}.onnxgrad").exists())
    r = load(out_dir / "ckpt0.onnxgrad")
    out["resumed_at"] = np.array(r.step_count)
    for t in range(2, 4):
        r.step(feed(t))
    out.update({f"resumed/{k}": v for k, v in _params(r).items()})
    return out


def batchnorm(make, rank, world, dp):
    """A CNN with BatchNormalization in train mode (static batch of 2 per worker): each worker's running
    statistics come from its shard, and after the update every worker holds their mean."""
    from onnxgrad import losses, optim
    s = make(model=onnx.load(ROOT / "models" / "cnn_bn_dynamo.onnx"),
             loss=losses.CrossEntropyLoss(output="y", target="label"), optimizer=optim.SGD(lr=0.1))
    rng = np.random.default_rng(3)
    x = rng.standard_normal((4, 3, 16, 16)).astype(np.float32)
    label = rng.integers(0, 5, 4)
    s.step({"x": shard(x, rank, 2), "label": shard(label, rank, 2)})
    out = {f"buffer/{k}": v for k, v in s.buffers().items()}
    out.update(_params(s))
    return out


SCENARIOS = {"grad": grad, "sgd5": sgd5, "uneven": uneven, "clip_adamw": clip_adamw, "nonfinite": nonfinite,
             "accumulate": accumulate, "batchnorm": batchnorm}


class SumNotMean(Engine):
    """A broken engine: it sums the buckets but leaves each worker its own weight (the divisor of the
    mean), so the update applies the sum of the workers' gradients instead of their mean."""

    name = "broken"

    def __init__(self, inner: Engine):
        self.inner = inner
        self.rank, self.world_size = inner.rank, inner.world_size
        self.local_rank, self.local_world_size = inner.local_rank, inner.local_world_size

    def all_reduce(self, values, average=False):
        own = np.array(values[0].numpy()[-1])
        self.inner.all_reduce(values, average)
        if not average:
            values[0].numpy()[-1] = own            # the float32 bucket ends with [w * loss, w]

    def broadcast(self, values, src=0):
        self.inner.broadcast(values, src)

    def barrier(self):
        self.inner.barrier()


def main(out_dir: str, engine: str) -> None:
    from onnxgrad import TrainingSession
    from onnxgrad.training import distributed as D

    out_dir = Path(out_dir)
    eng = D.engine(engine)
    rank, world = eng.rank, eng.world_size

    def make(**kw):
        return TrainingSession(kw.pop("model", None) or model(), loss=kw.pop("loss", None) or loss(),
                               data_parallel=eng, **kw)
    results: dict[str, np.ndarray] = {}
    for name, fn in SCENARIOS.items():
        kw = {"out_dir": out_dir} if name == "accumulate" else {}
        results.update({f"{name}/{k}": v for k, v in fn(make, rank, world, True, **kw).items()})
    results.update({f"resume/{k}": v for k, v in resume(
        make, rank, world, True, out_dir,
        lambda path: TrainingSession.load(path, data_parallel=eng)).items()})
    # every worker starts from rank 0's weights: rank 1 builds its session from other ones
    m = model()
    if rank:
        for init in m.graph.initializer:
            init.CopyFrom(onnx.numpy_helper.from_array(onnx.numpy_helper.to_array(init) + 1.0, init.name))
    results.update({f"broadcast/{k}": v for k, v in _params(
        TrainingSession(m, loss=loss(), data_parallel=eng)).items()})
    broken = SumNotMean(eng)
    results.update({f"sum_not_mean/{k}": v for k, v in grad(
        lambda **kw: TrainingSession(model(), loss=loss(), data_parallel=broken, **kw), rank, world, True).items()})
    results["world"] = np.array(world)
    results["engine"] = np.array(type(eng).__name__)
    np.savez(out_dir / f"rank{rank}.npz", **results)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
