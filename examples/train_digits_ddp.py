"""examples/train_digits.py, data parallel: every worker trains on its shard of each batch.

    torchrun --standalone --nproc-per-node 2 examples/train_digits_ddp.py [--epochs 30]
    mpiexec -n 2 python examples/train_digits_ddp.py                  # pip install ".[mpi]"

Every worker draws the same shuffled order (same seed), takes its part of each global batch of
``--batch`` samples (the last, short batch is split unevenly: the gradient is still the mean over its
samples), and ``TrainingSession(..., data_parallel=True)`` averages the gradients over the workers
before the one update they all apply. Rank 0 alone shows progress, evaluates, exports and prints
``test accuracy: <value>`` (as the single-process example: the same global batches, the same updates
up to rounding). Several machines: run torchrun on each with ``--nnodes``, ``--node-rank`` and a
``--rdzv-endpoint`` that all reach (see docs/data-parallel.md).
"""
from __future__ import annotations

import argparse
import math
import time

import numpy as np
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from tqdm import tqdm
from train_digits import mlp

from onnxgrad import TrainingSession, losses, optim
from onnxgrad.training.distributed import DataParallelError


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--batch", type=int, default=64, help="global batch: the sum of the workers' shards")
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--export", metavar="PATH", help="write the trained inference model here (rank 0)")
    p.add_argument("--checkpoint", metavar="PATH", help="save a checkpoint here after every epoch (rank 0)")
    args = p.parse_args()

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int64)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.25, random_state=0, stratify=y)

    try:
        session = TrainingSession(mlp([64, 64, 10]), loss=losses.CrossEntropyLoss(output="logits", target="y"),
                                  optimizer=optim.AdamW(lr=args.lr, weight_decay=1e-4), data_parallel=True)
    except DataParallelError as e:        # started without torchrun or mpiexec
        raise SystemExit(f"error: {e}") from None
    rank, world = session.rank, session.world_size
    rng = np.random.default_rng(0)                     # the same order on every worker
    steps_per_epoch = math.ceil(len(x_train) / args.batch)
    total = args.epochs * steps_per_epoch
    step_time = 0.0
    with tqdm(total=total, unit="step", desc=f"training on {world} workers", disable=rank != 0) as bar:
        for epoch in range(args.epochs):
            order = rng.permutation(len(x_train))
            for k in range(steps_per_epoch):
                idx = np.array_split(order[k * args.batch:(k + 1) * args.batch], world)[rank]
                session.lr = args.lr * 0.5 * (1 + math.cos(math.pi * session.step_count / total))
                t0 = time.perf_counter()
                loss = session.step({"x": x_train[idx], "y": y_train[idx]})     # the global batch's mean loss
                step_time += time.perf_counter() - t0
                bar.update(1)
            bar.set_postfix(epoch=epoch + 1, loss=f"{loss:.4f}")
            if args.checkpoint:
                session.save(args.checkpoint)             # rank 0 writes; the others return at once

    if rank == 0:
        logits = session.eval({"x": x_test})["logits"]
        accuracy = float(np.mean(np.argmax(logits, axis=1) == y_test))
        print(f"{world} workers; time per training step: {step_time / total * 1e3:.3f} ms")
        if args.export:
            session.export(args.export)
            print(f"wrote {args.export}")
        print(f"test accuracy: {accuracy:.4f}")


if __name__ == "__main__":
    main()
