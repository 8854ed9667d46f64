"""PyTorch's ``model.train()`` for an exported (eval-mode) graph.

Exports are made in eval mode. Training them as PyTorch would needs:

- BatchNormalization on batch statistics, with its running statistics updated as
  ``torch.nn.BatchNorm`` does: ``running = momentum * running + (1 - momentum) * batch``
  (ONNX's momentum is 1 - PyTorch's), where the batch variance of the running update
  is the *unbiased* one (n / (n - 1) times the variance that normalises the batch;
  ONNX's own running-variance output uses the biased one, so it is corrected here);
- Dropout active, with a seed per node (onnxruntime advances its generator every run,
  so the masks differ from step to step and repeat from session to session).

:func:`to_train_mode` rewrites a copy of the model and says which initializers are
running statistics and which tensors hold their next values. Inference (``eval()``,
``export()``) keeps the model as exported.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..errors import OnnxGradError, arg
from ..ir import model as M
from ..ir.model import NameScope, ParsedModel

__all__ = ["TrainMode", "to_train_mode", "to_eval_mode"]


@dataclass
class TrainMode:
    """The train-mode model and what it updates besides the parameters."""

    model: onnx.ModelProto
    running: dict[str, str] = field(default_factory=dict)   # running-statistic initializer -> its next value
    dropout_nodes: list[str] = field(default_factory=list)


def to_train_mode(model: ParsedModel | onnx.ModelProto, seed: int = 0) -> TrainMode:
    """A copy of ``model`` with BatchNormalization in training mode (running statistics updated
    as PyTorch updates them) and Dropout active."""
    m, opset = _copy(model)
    g = m.graph
    inits = {i.name for i in g.initializer}
    graph_inputs = {i.name for i in g.input}
    stored = {i.name: i.data_type for i in g.initializer if i.name not in graph_inputs}
    taken = (inits | graph_inputs | {o.name for o in g.output} | {o for n in g.node for o in n.output}
             | {n.name for n in g.node})
    names = NameScope(taken)
    out = TrainMode(m)
    nodes: list[onnx.NodeProto] = []
    true_name = None
    for k, node in enumerate(g.node):
        nodes.append(node)
        if node.domain not in ("", "ai.onnx"):
            continue
        if node.op_type == "BatchNormalization" and not _bn_training(node, opset):
            before, after = _batch_norm_train(node, opset, names, stored, out)
            nodes[-1:] = before + [node] + after
        elif node.op_type == "Dropout" and opset >= 12 and not _dropout_active(node, g):
            if true_name is None:
                true_name = names.fresh("onnxgrad.training_mode")
                g.initializer.add().CopyFrom(numpy_helper.from_array(np.array(True), true_name))
            while len(node.input) < 3:
                node.input.append("")
            node.input[2] = true_name
            M.set_attribute(node, "seed", int(seed + k))
            out.dropout_nodes.append(node.name)
    del g.node[:]
    g.node.extend(nodes)
    return out


def to_eval_mode(model: ParsedModel) -> ParsedModel:
    """A copy of ``model`` in inference mode: every Dropout inactive (an export made in train mode keeps them)
    and every BatchNormalization on its running statistics (the TorchScript exporter's
    ``training=TrainingMode.TRAINING`` exports them in training mode, with the updated statistics as extra
    outputs that nothing reads): :func:`to_train_mode` then trains them as PyTorch does."""
    m, opset = _copy(model)
    g = m.graph
    read = {x for n in g.node for x in n.input} | {o.name for o in g.output}
    for node in g.node:
        if node.op_type == "BatchNormalization" and node.domain in ("", "ai.onnx") and _bn_training(node, opset):
            used = [o for o in node.output[1:] if o and o in read]
            if used:
                raise OnnxGradError(f"BatchNormalization node '{node.name}' runs in training mode and the graph reads "
                                    f"its updated running statistics ({', '.join(used)}): onnxgrad trains "
                                    "BatchNormalization itself; export the model in eval mode (onnxgrad.from_torch, or "
                                    "torch.onnx.export with training=torch.onnx.TrainingMode.PRESERVE)")
            del node.output[1:]
            if opset >= 14:
                M.set_attribute(node, "training_mode", 0)
    false_name = None
    for node in g.node:
        if node.op_type == "Dropout" and node.domain in ("", "ai.onnx") and len(node.input) > 2 and node.input[2]:
            if false_name is None:
                false_name = NameScope({i.name for i in g.initializer} | {o for n in g.node for o in n.output}
                                       ).fresh("onnxgrad.eval_mode")
                g.initializer.add().CopyFrom(numpy_helper.from_array(np.array(False), false_name))
            node.input[2] = false_name
    return model.edited(m)


def _copy(model: ParsedModel | onnx.ModelProto) -> tuple[onnx.ModelProto, int]:
    """A copy of the model's proto to rewrite, and its opset."""
    m = onnx.ModelProto()
    if isinstance(model, ParsedModel):
        m.CopyFrom(model.proto)
        return m, model.opset
    m.CopyFrom(model)
    return m, M.opset_of(m)


def _bn_training(node: onnx.NodeProto, opset: int) -> bool:
    if opset >= 14:
        return any(a.name == "training_mode" and a.i for a in node.attribute)
    return len([o for o in node.output[1:] if o]) > 0


def _dropout_active(node: onnx.NodeProto, g: onnx.GraphProto) -> bool:
    if len(node.input) < 3 or not node.input[2]:
        return False
    for init in g.initializer:
        if init.name == node.input[2]:
            return bool(numpy_helper.to_array(init).reshape(-1)[0])
    return True          # computed at run time: the graph decides


def _batch_norm_train(node: onnx.NodeProto, opset: int, names: NameScope, initializers: dict[str, int],
                      out: TrainMode) -> tuple[list[onnx.NodeProto], list[onnx.NodeProto]]:
    """Switch one BatchNormalization to batch statistics; return the nodes to run before it and the
    nodes after it that compute the running statistics PyTorch would hold after this batch.

    The node gets private zero/one tensors as its mean/var inputs, not the running statistics:
    onnxruntime (1.32, CPU) writes its running outputs into the buffers of the mean/var *inputs* (in
    place, graph inputs included), so any other reader of the inputs could see the new values. Its
    momentum is set to 0, so that those outputs are the batch's mean and biased variance (running =
    input * momentum + batch * (1 - momentum)); the running statistics are formed from them with the
    node's own momentum and PyTorch's unbiased variance, and the gradient rule reads them instead of
    computing the statistics again.
    """
    x, mean, var = node.input[0], node.input[3], node.input[4]
    if mean not in initializers or var not in initializers:
        raise OnnxGradError(f"BatchNormalization node '{node.name}': its running statistics ('{mean}', '{var}') "
                            "are computed in the graph, not stored as initializers, so training cannot update "
                            "them (an exporter that merges tensors of equal values routes them through Identity "
                            "nodes: re-export with torch.onnx.export(..., dynamo=True, optimize=False), or "
                            "keep_initializers_as_inputs=True with TorchScript); or pass "
                            f"{arg('train_mode', False)} to keep "
                            "the exported (eval-mode) normalisation")
    momentum = next((a.f for a in node.attribute if a.name == "momentum"), 0.9)
    dtype = initializers[var]
    np_dtype = helper.tensor_dtype_to_np_dtype(dtype)
    scope = f"{node.name}/train_mode"

    def t(hint: str) -> str:
        return names.fresh(f"{scope}/{hint}")

    nodes: list[onnx.NodeProto] = []

    def emit(op: str, inputs: list[str], hint: str, **attrs) -> str:
        name = t(hint)
        nodes.append(helper.make_node(op, inputs, [name], name=name, **attrs))
        return name

    def const(hint: str, value: np.ndarray) -> str:
        return emit("Constant", [], hint, value=numpy_helper.from_array(value))

    # private running inputs for the node; with momentum 0 its running outputs are the batch's mean and
    # (biased) variance, which the running statistics below and the node's gradient rule read
    stat_shape = emit("Shape", [var], "stat_shape")
    dummy_mean = emit("ConstantOfShape", [stat_shape], "unused_mean",
                      value=numpy_helper.from_array(np.zeros(1, np_dtype)))
    dummy_var = emit("ConstantOfShape", [stat_shape], "unused_var",
                     value=numpy_helper.from_array(np.ones(1, np_dtype)))
    inputs = list(node.input)
    inputs[3], inputs[4] = dummy_mean, dummy_var
    del node.input[:]
    node.input.extend(inputs)
    mean_flat, biased = t("batch_mean"), t("batch_var")
    outputs = [node.output[0], mean_flat, biased]
    if opset < 14:          # opsets 9-13 say training mode by the outputs: onnxruntime wants all five
        outputs += [t("saved_mean"), t("saved_inv_std")]
    # the batch statistics' type, which the gradient rule reads (shape inference leaves opsets 9-13's unknown)
    out.model.graph.value_info.extend(helper.make_tensor_value_info(o, dtype, None) for o in (mean_flat, biased))
    del node.output[:]
    node.output.extend(outputs)
    if opset >= 14:
        M.set_attribute(node, "training_mode", 1)
    M.set_attribute(node, "momentum", 0.0)
    before, nodes = nodes, []          # emit() appends to the list now named nodes: what runs after the node

    # n = elements per channel = Size(x) / Shape(x)[1]; PyTorch's running variance is unbiased
    channels = emit("Gather", [emit("Shape", [x], "x_shape"), const("one", np.array([1], np.int64))], "channels",
                    axis=0)
    n = emit("Cast", [emit("Div", [emit("Size", [x], "size"), channels], "n")], "n_float", to=dtype)
    bessel = emit("Div", [n, emit("Sub", [n, const("one_float", np.array(1, np_dtype))], "n_minus_1")], "bessel")
    unbiased = emit("Mul", [biased, bessel], "batch_var_unbiased")
    m = const("momentum", np.array(momentum, np_dtype))
    m1 = const("one_minus_momentum", np.array(1 - momentum, np_dtype))
    new_mean, new_var = t("new_running_mean"), t("new_running_var")   # the training graph outputs '<name>.next'
    for old, batch, new in ((mean, mean_flat, new_mean), (var, unbiased, new_var)):
        kept = emit("Mul", [old, m], "momentum_part")
        fresh = emit("Mul", [batch, m1], "batch_part")
        nodes.append(helper.make_node("Add", [kept, fresh], [new], name=new))
    out.running[mean] = new_mean
    out.running[var] = new_var
    return before, nodes
