"""A scalar operand at the other operand's rank, where that operand's shape ends in an axis of 1 (cpu and webgpu
targets).

onnxruntime's CPU provider (1.32) broadcasts a rank-0 scalar against a tensor whose last axis is 1 one element
at a time: ``Mul([1280, 320, 1, 1], scalar)`` takes 1.2-2.0 ms where ``Mul([409600], scalar)`` takes 20-23 us, and
``Mul([1280, 320, 1, 1], ones([1, 1, 1, 1]))`` 22 us (2 threads, AMD EPYC; ``[1]`` is as slow as ``[]``;
``python bench/bench_kernels.py broadcast``). A
1x1 convolution's weight is such a tensor, and those weights hold most of MobileNet's and EfficientNet's
parameters: every multiply of the optimizer's update by a learning rate or a beta paid it (EfficientNet-B0's
AdamW update took 85 ms of a 180 ms profiled step; its step went from 124 to 65 ms with this rewrite,
``bench/bench_families.py``). The value is the same: a ``[1, ..., 1]`` operand broadcasts exactly as a scalar
does. onnxruntime-web's wasm build has the same path (1 thread, in Node: 7.4 ms against 0.29 ms flat and 0.85 ms
with the scalar at rank 4), and runs the webgpu target's files where WebGPU is missing. Built for the training
graph's update, whose tensors' shapes the builder knows (:mod:`onnxgrad.training.artifacts`).
"""
from __future__ import annotations

import onnx

from ...ir.builder import Builder

__all__ = ["scalars_at_rank"]

# elementwise ops whose operands broadcast (numpy rules), as the optimizer updates emit them
_BROADCASTING = frozenset({"Add", "Sub", "Mul", "Div", "Pow", "Max", "Min", "Where"})


def _slow_broadcast(shape: tuple | None) -> bool:
    """Whether a scalar broadcast against ``shape`` takes onnxruntime's slow path: rank 2 or more, last axis 1."""
    return shape is not None and len(shape) > 1 and shape[-1] == 1


def scalars_at_rank(b: Builder, first: int) -> int:
    """Reshape each rank-0 operand of ``b``'s broadcasting nodes from index ``first`` on to ``[1] * rank``
    where another operand's static shape (``b.infos``) takes the slow path; one Reshape per scalar and rank,
    placed before its first reader. Returns how many operands it reshaped."""
    nodes = b.nodes[first:]
    del b.nodes[first:]
    made: dict[tuple[str, int], str] = {}
    out: list[onnx.NodeProto] = []
    count = 0
    for node in nodes:
        if node.op_type in _BROADCASTING and node.domain in ("", "ai.onnx"):
            shapes = [b.infos[x].shape if x in b.infos else None for x in node.input]
            ranks = [len(s) for s in shapes if _slow_broadcast(s)]
            if ranks:
                rank = max(ranks)
                for k, (x, s) in enumerate(zip(node.input, shapes)):
                    if s != ():
                        continue
                    if (x, rank) not in made:
                        start = len(b.nodes)
                        made[(x, rank)] = b.op.Reshape(b.var(x), b.ints([1] * rank)).name
                        out.extend(b.nodes[start:])        # the Reshape (and a Constant for its shape)
                        del b.nodes[start:]
                    node.input[k] = made[(x, rank)]
                    count += 1
        out.append(node)
    b.nodes.extend(out)
    return count
