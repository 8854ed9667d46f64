"""The errors a user can cause. Every one is an :class:`OnnxGradError`.

A message that tells the user what to pass names it in the caller's words: the Python keyword (``of=['y']``)
from the API, the flag (``--of y``) from the command line. Messages write such a phrase with :func:`arg` (or
:func:`spelt`); ``str(error)`` reads as Python, ``error.on_command_line()`` as flags.
"""
from __future__ import annotations

import re
from typing import Iterable, Sequence

# the keyword arguments messages tell a user to pass and the command line's flag for each (for a bool, the
# flag that sets the value the message asks for): the one table both spellings come from
FLAGS = {
    "loss": "--loss", "of": "--of", "wrt": "--wrt", "allow_unused": "--allow-unused",
    "trainable": "--train", "frozen": "--freeze", "train_mode": "--eval-mode", "strict_tags": "--strict-tags",
    "target": "--target", "output": "--predictions",
}
_SPELT = re.compile("\ue000([^\ue001]*)\ue001([^\ue002]*)\ue002")


def spelt(python: str, command_line: str) -> str:
    """A phrase of a message with its two spellings: ``python`` for the API, ``command_line`` for the CLI."""
    return f"\ue000{python}\ue001{command_line}\ue002"


def arg(name: str, value: str | bool | Sequence[str] | None = None) -> str:
    """Keyword argument ``name`` as a message tells the user to pass it: ``of=['y']`` / ``--of y`` (a list of
    names), ``wrt=...`` / ``--wrt ...`` (a placeholder), ``train_mode=False`` / ``--eval-mode`` (a bool),
    ``loss=`` / ``--loss`` (None: the argument alone)."""
    flag = FLAGS[name]
    if value is None:
        return spelt(f"{name}=", flag)
    if isinstance(value, bool):
        return spelt(f"{name}={value}", flag)
    if isinstance(value, str):
        return spelt(f"{name}={value}", f"{flag} {value}")
    return spelt(f"{name}={list(value)!r}", f"{flag} {' '.join(value)}")


def in_python(message: str) -> str:
    return _SPELT.sub(r"\1", message)


def on_command_line(message: str) -> str:
    return _SPELT.sub(r"\2", message)


def some(names: Iterable[str], shown: int = 5, quoted: bool = True) -> str:
    """``'a', 'b', 'c', 'd', 'e' and 15 more``: the first ``shown`` names (``quoted``) and a count of the rest, so
    a message stays a line however large the model."""
    names = list(names)
    head = ", ".join(map(repr, names[:shown]) if quoted else names[:shown])
    return head + (f" and {len(names) - shown} more" if len(names) > shown else "")


class _Spelt:
    """An exception or warning whose message may hold :func:`spelt` phrases: ``str()`` gives the Python
    spelling, :meth:`on_command_line` the flags'."""

    def __str__(self) -> str:
        return in_python(super().__str__())

    def on_command_line(self) -> str:
        return on_command_line(super().__str__())


class OnnxGradError(_Spelt, Exception):
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
            + f"; differentiate with respect to tensors after these nodes ({arg('wrt', '...')}), "
            "or write a rule with onnxgrad.register_rule"
        )

    @classmethod
    def rule_declines(cls, op_type: str, node: str, reason: str) -> "UnsupportedOpError":
        """A rule declines node ``node`` (of ``op_type``): ``reason`` says which configuration and why."""
        return cls({op_type: node}, {op_type: reason}, declined=True)


class ExportFoldedError(OnnxGradError):
    """The exporter folded what training needs (BatchNorm into the convolutions): the model cannot train as
    PyTorch's ``model.train()`` would. The message names the tensors and the way out."""


class ExportWarning(_Spelt, UserWarning):
    """The exporter did something that makes training differ from PyTorch's (a parameter folded into a
    function of it, parameters merged beyond telling apart); the message names the tensors and the way out."""


class FeedError(OnnxGradError):
    """A batch does not fit the model's data inputs (rank, a size, the batch size the inputs share, the element
    type): checked before the run; the message names each input, what the model declares and what was given."""


class FeedConversionWarning(_Spelt, UserWarning):
    """A batch of another element type was converted to the input's where no value changes (int32 labels to
    int64); said once per input and session."""


class RuleError(Exception):
    """A gradient rule broke its contract (a bug in onnxgrad or in a user's rule, not in the model)."""
