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

from . import model as M
from .builder import NameScope
from .errors import OnnxGradError

__all__ = ["TrainMode", "to_train_mode", "to_eval_mode"]


@dataclass
class TrainMode:
    """The train-mode model and what it updates besides the parameters."""

    model: onnx.ModelProto
    running: dict[str, str] = field(default_factory=dict)   # running-statistic initializer -> its next value
    dropout_nodes: list[str] = field(default_factory=list)


def to_train_mode(model: onnx.ModelProto, seed: int = 0) -> TrainMode:
    """A copy of ``model`` with BatchNormalization in training mode (running statistics updated
    as PyTorch updates them) and Dropout active."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    g = m.graph
    opset = M.opset_of(m)
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
            nodes += _batch_norm_train(node, opset, names, stored, out)
        elif node.op_type == "Dropout" and opset >= 12 and not _dropout_active(node, g):
            if true_name is None:
                true_name = names.fresh("onnxgrad.training_mode")
                g.initializer.append(numpy_helper.from_array(np.array(True), true_name))
            while len(node.input) < 3:
                node.input.append("")
            node.input[2] = true_name
            _set_attr(node, "seed", float(seed + k))
            out.dropout_nodes.append(node.name)
    del g.node[:]
    g.node.extend(nodes)
    return out


def to_eval_mode(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``model`` with every Dropout inactive (an export made in train mode keeps them)."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    g = m.graph
    false_name = None
    for node in g.node:
        if node.op_type == "Dropout" and node.domain in ("", "ai.onnx") and len(node.input) > 2 and node.input[2]:
            if false_name is None:
                false_name = NameScope({i.name for i in g.initializer} | {o for n in g.node for o in n.output}
                                       ).fresh("onnxgrad.eval_mode")
                g.initializer.append(numpy_helper.from_array(np.array(False), false_name))
            node.input[2] = false_name
    return m


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


def _set_attr(node: onnx.NodeProto, name: str, value) -> None:
    kept = [a for a in node.attribute if a.name != name]
    del node.attribute[:]
    node.attribute.extend(kept)
    node.attribute.append(helper.make_attribute(name, value))


def _batch_norm_train(node: onnx.NodeProto, opset: int, names: NameScope, initializers: dict[str, int],
                      out: TrainMode) -> list[onnx.NodeProto]:
    """Switch one BatchNormalization to batch statistics; return the nodes computing the running
    statistics PyTorch would hold after this batch."""
    x, mean, var = node.input[0], node.input[3], node.input[4]
    if mean not in initializers or var not in initializers:
        raise OnnxGradError(f"BatchNormalization node '{node.name}': its running statistics ('{mean}', '{var}') "
                            "are computed in the graph, not stored as initializers, so training cannot update "
                            "them; pass train_mode=False to keep the exported (eval-mode) normalisation")
    momentum = next((a.f for a in node.attribute if a.name == "momentum"), 0.9)
    dtype = initializers[var]
    np_dtype = helper.tensor_dtype_to_np_dtype(dtype)
    if opset >= 14:
        _set_attr(node, "training_mode", 1)
    scope = f"{node.name}/train_mode"
    new_mean, biased = names.fresh(f"{mean}.next"), names.fresh(f"{scope}/running_var_biased")
    outputs = list(node.output) + [""] * (3 - len(node.output))
    outputs[1], outputs[2] = new_mean, biased
    del node.output[:]
    node.output.extend(outputs)

    # running_var (PyTorch) = m * var + n / (n - 1) * (running_var (ONNX) - m * var),
    # n = elements per channel = Size(x) / Shape(x)[1]
    def t(hint: str) -> str:
        return names.fresh(f"{scope}/{hint}")

    def const(hint: str, value) -> tuple[str, onnx.NodeProto]:
        name = t(hint)
        return name, helper.make_node("Constant", [], [name], name=name, value=numpy_helper.from_array(value))

    one_i, c1 = const("one", np.array([1], np.int64))
    momentum_c, c2 = const("momentum", np.array(momentum, np_dtype))
    size, shape, channels = t("size"), t("shape"), t("channels")
    n, n_f, n_minus_1, ratio = t("n"), t("n_float"), t("n_minus_1"), t("n_over_n_minus_1")
    old_part, fresh, scaled = t("momentum_var"), t("batch_part"), t("batch_part_unbiased")
    new_var = names.fresh(f"{var}.next")
    one_f, c3 = const("one_float", np.array(1.0, np_dtype))
    nodes = [
        c1, c2, c3,
        helper.make_node("Size", [x], [size], name=size),
        helper.make_node("Shape", [x], [shape], name=shape),
        helper.make_node("Gather", [shape, one_i], [channels], name=channels, axis=0),
        helper.make_node("Div", [size, channels], [n], name=n),
        helper.make_node("Cast", [n], [n_f], name=n_f, to=dtype),
        helper.make_node("Sub", [n_f, one_f], [n_minus_1], name=n_minus_1),
        helper.make_node("Div", [n_f, n_minus_1], [ratio], name=ratio),
        helper.make_node("Mul", [var, momentum_c], [old_part], name=old_part),
        helper.make_node("Sub", [biased, old_part], [fresh], name=fresh),
        helper.make_node("Mul", [fresh, ratio], [scaled], name=scaled),
        helper.make_node("Add", [old_part, scaled], [new_var], name=new_var),
    ]
    out.running[mean] = new_mean
    out.running[var] = new_var
    return nodes
