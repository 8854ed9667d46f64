"""Runtime-specific rewrites of gradient graphs, chosen per execution provider.

The rules of :mod:`onnxgrad.rules` emit canonical adjoints (a Conv's input gradient is a
ConvTranspose, its weight gradient the swapped-role Conv, MaxPool's a scatter at its Indices).
What is fastest depends on the runtime's kernels, so the measured fast paths live here as rewrite
rules (pattern, check with a reason, replacement: see :mod:`onnxgrad.passes.optimize.rewriter`), grouped
per target. A rewrite may also anchor on the forward, where the backward then shares what the new
form computes (``conv_forward_patches``: the weight gradient reads the forward's patches). Targets:

- ``None``: the canonical graph;
- ``"cpu"``: onnxruntime's CPUExecutionProvider;
- ``"webgpu"``: onnxruntime-web's WebGPU providers (:mod:`onnxgrad.passes.optimize.webgpu`): no op they lack or
  compute wrongly, nothing on the CPU inside a step; the training graph's step scalars in a schedule model
  (:mod:`onnxgrad.passes.optimize.schedule`);
- ``"cuda"``: onnxruntime's CUDAExecutionProvider (cuDNN runs the canonical convolutions natively;
  no speed rewrite has been measured to pay there yet). Its rewrites make the graph runnable there:
  BatchNormalization in training mode, which the CUDA kernel refuses, as standard ops
  (:mod:`onnxgrad.passes.optimize.batch_norm`); :func:`cuda_refusals` lists what would still be refused. A
  training graph's update guard is its own rewrite (:mod:`onnxgrad.passes.optimize.guard`, applied by
  ``artifacts.build`` for this target, so by ``TrainingSession`` and ``--optimize-for cuda``): the guard is
  built after the gradient.

A lowering (:data:`LOWERINGS`) is a rewrite of the forward applied before it is differentiated, so that the
backward is the new form's own (``depthwise_conv_as_matmul``, cpu target: :func:`onnxgrad.grad` applies it).

``bench/bench_rewrites.py`` times every rewrite against the canonical form;
``tests/test_optimize.py`` proves each gives the canonical graph's outputs.
"""
from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, Iterator, Sequence

import onnx

from ...errors import OnnxGradError
from .batch_norm import BATCH_NORM_TRAINING_AS_OPS, BATCH_NORM_TRAINING_AS_OPS_BACKWARD
from .conv import (
    CONV_FORWARD_PATCHES,
    CONV_INPUT_GRAD_COL2IM,
    CONV_INPUT_GRAD_FLIPPED,
    CONV_TRANSPOSE_SYMMETRIC,
    CONV_WEIGHT_GRAD_PATCHES,
    DEPTHWISE_WEIGHT_GRAD_PATCHES,
    asymmetric,
)
from .depthwise import DEPTHWISE_CONV_AS_MATMUL
from .masks import WHERE_ZERO_AS_MUL
from .pool import MAX_POOL_TAPS, RELU_MAX_POOL_TAPS
from .rewriter import Report, Rewrite, apply
from .rewriter import apply as apply_rewrites
from .webgpu import WEBGPU_REWRITES

if TYPE_CHECKING:
    from ...ir.model import ParsedModel

__all__ = ["LOWERINGS", "REWRITES", "TARGETS", "apply_rewrites", "cuda_refusals", "lowered", "optimize",
           "provider_name", "rewrites_for", "target_for"]

REWRITES: dict[str, Rewrite] = {r.name: r for r in (
    CONV_FORWARD_PATCHES, CONV_WEIGHT_GRAD_PATCHES, DEPTHWISE_WEIGHT_GRAD_PATCHES, CONV_INPUT_GRAD_COL2IM,
    CONV_INPUT_GRAD_FLIPPED, RELU_MAX_POOL_TAPS, MAX_POOL_TAPS, WHERE_ZERO_AS_MUL, BATCH_NORM_TRAINING_AS_OPS,
    BATCH_NORM_TRAINING_AS_OPS_BACKWARD, CONV_TRANSPOSE_SYMMETRIC, DEPTHWISE_CONV_AS_MATMUL, *WEBGPU_REWRITES)}

TARGETS: dict[str, tuple[str, ...]] = {
    "cpu": ("conv_forward_patches", "conv_weight_grad_patches", "depthwise_weight_grad_patches",
            "conv_input_grad_col2im", "conv_input_grad_flipped", "relu_max_pool_taps", "max_pool_taps",
            "where_zero_as_mul"),
    # conv_transpose_symmetric_pads: the provider hands a ConvTranspose with asymmetric pads (a strided Conv's
    # input gradient) to the CPU provider: 29 ms against cuDNN's 0.6 ms, and the step's results went wrong
    # through the session's IOBinding (bench/gpu_bisect.py, H200, 2026-12-04)
    "cuda": ("batch_norm_training_as_ops", "batch_norm_training_as_ops_backward", "conv_transpose_symmetric_pads"),
    # every node on the GPU and right (onnxgrad.passes.optimize.webgpu): what the providers lack, as standard ops
    "webgpu": ("batch_norm_training_as_ops", "batch_norm_training_as_ops_backward",
               *(r.name for r in WEBGPU_REWRITES)),
}

# rewrites of the forward applied before it is differentiated: the backward is then the new form's own
LOWERINGS: dict[str, tuple[str, ...]] = {
    "cpu": ("depthwise_conv_as_matmul",),
}

_PROVIDERS = {"CPUExecutionProvider": "cpu", "CUDAExecutionProvider": "cuda"}


def target_for(providers: Sequence[Any] | None) -> str | None:
    """The target of onnxruntime execution providers: their first one's (names or (name, options));
    None (canonical) for a provider without a rewrite table."""
    if not providers:
        return None
    return _PROVIDERS.get(provider_name(providers[0]))


def provider_name(provider: Any) -> str:
    """An execution provider's name, given as a name or (name, options)."""
    return provider[0] if isinstance(provider, (tuple, list)) else provider


def cuda_refusals(model: onnx.ModelProto) -> list[str]:
    """The nodes of ``model`` (subgraphs included) that onnxruntime's CUDA provider refuses to run or hands to
    the CPU provider, each as "node (op): why"; empty when it runs them all on the GPU. Known:
    BatchNormalization with ``training_mode=1`` from opset 14 on (the kernel fails the session's build), and
    ConvTranspose with asymmetric pads (run on the CPU: a host round trip inside the step, 29 ms against
    cuDNN's 0.6 ms, and the training session's results went wrong with it on an H200)."""
    from ...ir import model as M

    opset = M.opset_of(model)
    found = []
    for node in _nodes(model.graph):
        if node.domain not in ("", "ai.onnx"):
            continue
        attrs = {a.name: a for a in node.attribute}
        if node.op_type == "BatchNormalization" and opset >= 14 and "training_mode" in attrs and \
                attrs["training_mode"].i:
            found.append(f"{node.name} (BatchNormalization): training_mode=1 at opset {opset}")
        if node.op_type == "ConvTranspose" and "pads" in attrs and asymmetric(attrs["pads"].ints):
            found.append(f"{node.name} (ConvTranspose): asymmetric pads {list(attrs['pads'].ints)} run on the "
                         "CPU provider")
    return found


def _nodes(g: onnx.GraphProto) -> Iterator[onnx.NodeProto]:
    from ...ir import model as M

    for node in g.node:
        yield node
        for sub in M.subgraphs(node):
            yield from _nodes(sub)


def rewrites_for(target: str | None) -> list[Rewrite]:
    if target is None:
        return []
    if target not in TARGETS:
        raise OnnxGradError(f"unknown optimization target {target!r}: use one of "
                            f"{', '.join(map(repr, TARGETS))} or None for the canonical graph")
    return [REWRITES[name] for name in TARGETS[target]]


def lowered(parsed: "ParsedModel", target: str | None) -> "ParsedModel":
    """``parsed`` with ``target``'s lowerings (:data:`LOWERINGS`) applied to its forward, before the gradient
    pass; ``parsed`` itself where none applies (nothing copied when no node has the ops they anchor on)."""
    chosen = [REWRITES[name] for name in LOWERINGS.get(target or "", ())]
    anchors = {r.op_type for r in chosen}
    if not any(n.op_type in anchors for n in parsed.nodes):
        return parsed
    out, report = apply(parsed.inferred, chosen, first=len(parsed.nodes))
    if not report.applied:
        return parsed
    from ...ir.model import set_metadata

    set_metadata(out, {"onnxgrad.lowered": json.dumps(report.counts())})
    return parsed.edited(out)


def optimize(model: onnx.ModelProto, target: str | None, first: int = 0,
             rewrites: Sequence[str] | None = None, copy: bool = True) -> tuple[onnx.ModelProto, Report]:
    """``model`` with ``target``'s rewrites (or the named ``rewrites``) applied to its nodes from index
    ``first`` on (the backward of a gradient model), and the report of what applied and what declined.
    The applied rewrites are recorded in the model's metadata (``onnxgrad.rewrites``). ``copy=False``
    rewrites ``model`` itself instead of a copy (:func:`onnxgrad.grad`'s own result: no weights copied)."""
    chosen = [REWRITES[name] for name in rewrites] if rewrites is not None else rewrites_for(target)
    out, report = apply(model, chosen, first, copy)
    if report.applied:
        from ...ir.model import set_metadata

        set_metadata(out, {"onnxgrad.target": json.dumps(target), "onnxgrad.rewrites": json.dumps(report.counts())})
    return out, report
