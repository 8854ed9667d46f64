"""The errors a user can cause. Every one is an :class:`OnnxGradError`."""
from __future__ import annotations


class OnnxGradError(Exception):
    """Base of every error caused by the model or the arguments given to onnxgrad."""


class InvalidModelError(OnnxGradError):
    """The model cannot be read, fails the ONNX checker, or uses an opset we cannot handle."""


class UnknownNameError(OnnxGradError):
    """A name given in ``wrt``, ``of`` or ``loss`` is not a tensor of the model, or is not usable there."""


class NonFloatError(UnknownNameError):
    """A name given in ``wrt``, ``of`` or ``loss`` is not a floating-point tensor."""


class UnusedError(OnnxGradError):
    """A ``wrt`` tensor does not influence the differentiated outputs (pass ``allow_unused=True``)."""


class UnsupportedOpError(OnnxGradError):
    """Some nodes on the path from ``wrt`` to the outputs have no gradient rule, or a rule declines
    the node's configuration (:meth:`rule_declines`).

    ``ops`` maps every unsupported op type to the name of one node that uses it; ``reasons`` says why
    where it is known; ``declined`` is true when a rule exists and declined.
    """

    def __init__(self, ops: dict[str, str], reason: dict[str, str] | None = None, declined: bool = False):
        self.ops = dict(ops)
        self.reasons = dict(reason or {})
        self.declined = declined
        reason = self.reasons
        parts = []
        for op, node in sorted(self.ops.items()):
            why = f" ({reason[op]})" if op in reason else ""
            parts.append(f"{op} (e.g. node '{node}'){why}")
        if declined:
            head = f"the {', '.join(sorted(self.ops))} rule declines this configuration: "
        else:
            head = f"no gradient rule for {len(parts)} op type(s) on the path to the outputs: "
        super().__init__(
            head + ", ".join(parts)
            + "; differentiate with respect to tensors after these nodes (wrt=...), "
            "or write a rule with onnxgrad.register_rule"
        )

    @classmethod
    def rule_declines(cls, op_type: str, node: str, reason: str) -> "UnsupportedOpError":
        """A rule declines node ``node`` (of ``op_type``): ``reason`` says which configuration and why."""
        return cls({op_type: node}, {op_type: reason}, declined=True)


class ExportFoldedError(OnnxGradError):
    """The exporter folded what training needs (BatchNorm into the convolutions): the model cannot train as
    PyTorch's ``model.train()`` would. The message names the tensors and the way out."""


class ExportWarning(UserWarning):
    """The exporter did something that makes training differ from PyTorch's (a parameter folded into a
    function of it, parameters merged beyond telling apart); the message names the tensors and the way out."""


class FeedError(OnnxGradError):
    """A batch does not fit the model's data inputs (rank, a size, the batch size the inputs share, the element
    type): checked before the run; the message names each input, what the model declares and what was given."""


class FeedConversionWarning(UserWarning):
    """A batch of another element type was converted to the input's where no value changes (int32 labels to
    int64); said once per input and session."""


class RuleError(Exception):
    """A gradient rule broke its contract (a bug in onnxgrad or in a user's rule, not in the model)."""
