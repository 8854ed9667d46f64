"""What is a trainable parameter: one policy for ``grad()``'s default ``wrt``, the training
sessions, the training artifacts and the command line.

A float initializer is trained when it has a differentiable path to the loss (or the
differentiated outputs) and it is what PyTorch would train. In this order:

1. ``frozen`` names are not trained, nor PyTorch parameters with ``requires_grad=False``
   (:func:`onnxgrad.from_torch` records them: ``onnxgrad.requires_grad`` in the initializer's metadata).
2. No differentiable path (it reaches the loss only through shapes, indices, comparisons,
   integer casts or stop-gradient ops, or not at all): not trained, as PyTorch leaves a
   parameter whose ``.grad`` is None alone (no update, no weight decay).
3. BatchNormalization's mean and variance inputs are running statistics (buffers).
4. Exporter metadata, where the model has it (PyTorch's dynamo exporter): the graph
   signature's kind of each initializer (``PARAMETER`` trains; ``BUFFER`` and
   ``CONSTANT_TENSOR`` do not), and for tensors the exporter's optimizer folded
   (``folded_from``), the parameter they were folded from: a copy one-to-one with a single
   parameter (transposed, reshaped, sliced) trains as that parameter. A second copy of a
   parameter another initializer holds (tied embeddings) is computed from that one when it
   is exactly its transpose or reshape (:func:`restore_ties`: the tie holds, as in
   PyTorch); a copy that repeats a parameter's elements (a folded Gather or Expand: a
   token-type row, a class token, relative-position biases) or any other second copy is
   not trained, with the reason, since training it separately would break the tie.
5. Without metadata (the TorchScript exporter, other producers): tensors holding
   non-finite values or only 0s and 1s (masks), scalars and constant fills under
   exporter-generated names (``val_12``, ``onnx::Mul_5``, ``/Constant_output_0``: GELU's
   0.5, an attention scale, a zero initial state) and tensors named like PyTorch buffers
   (``running_mean``, ``inv_freq``, ...) are not trained; every other float initializer
   is, named scalars such as a learnable temperature included.
"""
from __future__ import annotations

import ast
import hashlib
import json
import math
import os
import re
from dataclasses import dataclass
from functools import cached_property
from typing import Iterator, Mapping, Sequence

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..errors import UnknownNameError, arg, in_python, on_command_line, some
from ..ir import model as M
from ..ir.load import parse
from ..ir.model import ParsedModel
from .reach import Objective

__all__ = ["Finding", "Parameter", "ParameterReport", "parameters", "parameters_of", "recorded_torch_names",
           "restore_ties"]

KIND_KEY = "pkg.torch.export.graph_signature.InputSpec.kind"
FOLDED_KEY = "pkg.onnxscript.optimizer.folded_from"
ORIGINAL_KEY = "pkg.torch.onnx.original_node_name"
SIGNATURE_KEY = "pkg.torch.export.ExportedProgram.graph_signature"
# on an initializer: "false" for a parameter PyTorch does not train (onnxgrad.from_torch records it)
REQUIRES_GRAD_KEY = "onnxgrad.requires_grad"

# names exporters give the tensors they create (not PyTorch module paths)
_GENERATED = re.compile(r"^(_?val_\d+|onnx::.*|/.*|.*Constant.*|const(ant)?_?\d*|_v_\d+|ortshared_.*|.*_output_\d+)$")
# buffers PyTorch modules register under these names
_BUFFER_NAMES = re.compile(r"(^|\.)(running_mean|running_var|num_batches_tracked|inv_freq|position_ids|"
                           r"cos_cached|sin_cached|_float_tensor|masked_bias)$")
# BatchNormalization input positions that hold running statistics, and the names PyTorch gives them
_RUNNING_STATS = {"BatchNormalization": (3, 4)}
_BN_STATISTICS = (".running_mean", ".running_var")
# folds that repeat elements are told by their values; above this size the check samples
_REPEAT_CHECK_LIMIT = 1 << 22
# named (non-generated) tensors larger than this are not read for the mask checks
_VALUE_CHECK_LIMIT = 1 << 24
NO_FOLDING_HINT = ("to train it, export with onnxgrad.from_torch(module, args) (or torch.onnx.export(..., "
                   "dynamo=True, optimize=False)) so that the parameter stays one tensor, or name it in "
                   + arg("trainable"))
REEXPORT_HINT = ("export with onnxgrad.from_torch(module, args), or torch.onnx.export(..., dynamo=True, "
                 "optimize=False) with the module as it trains")
NODE_SCOPES_KEY = "pkg.torch.onnx.name_scopes"
REWRITE_RULE_KEY = "pkg.onnxscript.rewriter.rule_name"
FROM_TORCH_KEY = "onnxgrad.from_torch"           # model metadata: the torch version that exported it
# model metadata (JSON list): the module's parameters from_torch found not in the graph that get no gradient in
# PyTorch either (requires_grad=False, or unused by the forward): leaving them out is what PyTorch does
NO_GRADIENT_KEY = "onnxgrad.torch_no_gradient"
# the dynamo exporter names a folded tensor after the aten op that made it (exp, mul_3): one of these is a
# function of the parameter (its values changed, not rearranged), which cannot train as the parameter
_FUNCTION_OF = re.compile(r"^(exp|exp2|expm1|log|log1p|log2|log10|mul|div|add|sub|rsub|pow|sqrt|rsqrt|reciprocal|"
                          r"neg|abs|sign|sigmoid|tanh|softplus|softmax|log_softmax|relu|gelu|silu|elu|clamp|clamp_min|"
                          r"clamp_max|sin|cos|square|sum|mean|norm|linalg_vector_norm|matmul|mm|bmm|addmm|where|"
                          r"maximum|minimum|cumsum|erf)(_\d+)?$")
# the TorchScript exporter's name for a Conv weight or bias it computed by constant folding (BatchNorm folded in)
_TORCHSCRIPT_FOLDED_CONV = re.compile(r"^onnx::Conv(Transpose)?_\d+$")


@dataclass(frozen=True)
class Parameter:
    """The decision for one float initializer: whether it trains, why, and its PyTorch name."""

    name: str
    trainable: bool
    reason: str
    torch_name: str | None = None
    tied_to: str | None = None        # a copy of this trained initializer, computed from it (see restore_ties)
    tie_op: str | None = None         # how: "Transpose" or "Reshape"
    merged_into: str | None = None    # a parameter the exporter merged into this initializer (equal values)
    merged_uses: tuple[tuple[str, int], ...] = ()   # the (node, input) that read it; restore_ties splits it off
    zeros: tuple[int, ...] | None = None    # a zero bias the exporter dropped: restored as zeros of this shape
    rows_of: str | None = None        # the rows a folded Expand/Gather repeated: restore_ties expands them

    def line(self, command_line: bool | None = False) -> str:
        """``name (PyTorch 'torch.name'): reason``, its advice in the API's words or the command line's (None:
        both kept, for a message that embeds it: onnxgrad.errors.spelt)."""
        torch = f" (PyTorch '{self.torch_name}')" if self.torch_name and self.torch_name != self.name else ""
        return _spelling(command_line)(f"{self.name}{torch}: {self.reason}")


@dataclass(frozen=True)
class Finding:
    """Something the exporter did to the model that training cannot take back as PyTorch would train it.

    ``refused_in_train_mode``: training in train mode (``model.train()``) would be wrong, so it is refused;
    otherwise (and with ``train_mode=False``) the finding is a warning before the first step.
    """

    kind: str                   # "batchnorm_folded", "merged", "not_one_to_one"
    tensors: tuple[str, ...]    # the initializers or PyTorch names concerned
    message: str                # what happened, what it changes, and the way out
    refused_in_train_mode: bool = False

    def line(self, command_line: bool | None = False) -> str:
        return _spelling(command_line)(self.message)


def _spelling(command_line: bool | None):
    """How a report's line names the arguments to pass: as the API's keywords, the command line's flags, or
    both kept (None)."""
    return (lambda text: text) if command_line is None else on_command_line if command_line else in_python


class ParameterReport:
    """Every float initializer of a model with its decision, in model order, and what the exporter did
    that training cannot undo (:class:`Finding`)."""

    def __init__(self, entries: Sequence[Parameter], what: str, findings: Sequence[Finding] = (),
                 untouched: Sequence[str] = ()):
        self.entries = list(entries)
        self.what = what
        self.findings = list(findings)
        # PyTorch parameters not in the graph that PyTorch does not train either (from_torch records them)
        self.untouched = list(untouched)
        self._by_name = {p.name: p for p in self.entries}

    @property
    def trainable(self) -> list[str]:
        return [p.name for p in self.entries if p.trainable]

    @property
    def left_out(self) -> list[Parameter]:
        return [p for p in self.entries if not p.trainable]

    def __getitem__(self, name: str) -> Parameter:
        return self._by_name[name]

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def __iter__(self) -> Iterator[Parameter]:
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def lines(self, command_line: bool = False) -> list[str]:
        """A readable table: the trainable tensors, then those left out with their reasons (the advice in the
        command line's flags with ``command_line``)."""
        out = [f"trainable parameters of {self.what}: {len(self.trainable)}"]
        out += ["  " + p.line(command_line) for p in self.entries if p.trainable]
        left = self.left_out
        if left:
            out.append(f"float initializers not trained: {len(left)}")
            out += ["  " + p.line(command_line) for p in left]
        if self.untouched:
            out.append(f"PyTorch parameters not in the graph, which get no gradient in PyTorch either (unused by "
                       f"the forward, or requires_grad=False): {len(self.untouched)}")
            out.append("  " + some(self.untouched, shown=10))
        if self.findings:
            out.append(f"what the exporter did that training cannot undo: {len(self.findings)}")
            out += ["  " + f.line(command_line) for f in self.findings]
        return out

    def __repr__(self) -> str:
        return f"ParameterReport({len(self.trainable)} trainable, {len(self.left_out)} left out)"


def parameters(
    model: ParsedModel | onnx.ModelProto | str | os.PathLike,
    loss: str | None = None,
    of: Sequence[str] | str | None = None,
    frozen: Sequence[str] = (),
    strict_tags: bool = False,
) -> ParameterReport:
    """Decide which float initializers of ``model`` are trainable (see the module's rules).

    ``loss`` / ``of`` name what is differentiated, as in :func:`onnxgrad.grad` (neither:
    the single scalar float output, else every float output). ``frozen``: initializers
    not to train. The result lists every float initializer with its reason;
    ``.trainable`` is the default ``wrt`` of ``grad`` and what training sessions train.
    """
    objective = Objective(parse(model), [of] if isinstance(of, str) else of, loss, strict_tags)
    return parameters_of(objective, frozen)


def parameters_of(objective: Objective, frozen: Sequence[str] = ()) -> ParameterReport:
    """:func:`parameters` for what a pass already decided is differentiated, and in which model (the training
    build's objective, the reverse pass's when no ``wrt`` is given)."""
    model, reach, what = objective.parsed.proto, objective.reach, objective.what
    g = model.graph
    floats = [i for i in g.initializer if i.data_type in M.FLOAT_TYPES]
    facts = _ModelFacts(model)
    merges = _merged_parameters(model, facts)
    names = {i.name for i in floats} | {t for t, _, _, _ in merges}
    unknown = [f for f in frozen if f not in names]
    if unknown:
        listed = ", ".join(sorted(names)[:20]) + (", ..." if len(names) > 20 else "")
        raise UnknownNameError(f"frozen name(s) {', '.join(map(repr, unknown))} are not float initializers "
                               f"of the model (initializers: {listed})")
    decisions = [_decide(init, facts, set(frozen), reach, what) for init in floats]
    decisions = _break_ties(decisions, facts, {i.name: i for i in floats})
    by_name = {p.name: p for p in decisions}
    split = [_split_off(target, by_name.get(holder), uses, what, set(frozen)) for target, holder, uses, what in merges
             if what != "tie"]
    rows = [Parameter(p.tied_to, p.tied_to not in set(frozen), "frozen" if p.tied_to in set(frozen) else
                      f"the rows of PyTorch parameter '{p.torch_name}' that the exporter's folded '{p.name}' repeats "
                      "(restored as an Expand of them)", p.torch_name, rows_of=p.name)
            for p in decisions if p.tie_op == "Expand"]
    decisions += split + rows
    untouched = _no_torch_gradient(model)
    return ParameterReport(decisions, what, _findings(model, facts, merges, decisions, set(untouched)),
                           [t for t in untouched if facts.kind(t) == "PARAMETER" and t not in facts.held])


def _no_torch_gradient(model: onnx.ModelProto) -> list[str]:
    """The parameters :func:`onnxgrad.from_torch` recorded as missing from the graph without a gradient in
    PyTorch (``NO_GRADIENT_KEY``)."""
    text = next((p.value for p in model.metadata_props if p.key == NO_GRADIENT_KEY), "")
    try:
        names = json.loads(text) if text else []
    except ValueError:
        return []
    return [str(n) for n in names] if isinstance(names, list) else []


def recorded_torch_names(model: onnx.ModelProto) -> dict[str, str]:
    """PyTorch's name of each float initializer the exporter recorded one for (a folded tensor: the
    parameters it was folded from), from the metadata alone: no tensor's values are read, so the
    names of parameters whose data is held aside are known too."""
    facts = _ModelFacts(model)
    names = {}
    for init in model.graph.initializer:
        if init.data_type not in M.FLOAT_TYPES:
            continue
        if facts.kind(init.name):
            names[init.name] = facts.torch_name(init.name)
        elif facts.folded_from(init.name) is not None and facts.parameter_sources(init.name):
            names[init.name] = ", ".join(facts.parameter_sources(init.name))
    return names


class _ModelFacts:
    """What the exporter recorded, and which node positions read each initializer."""

    def __init__(self, model: onnx.ModelProto):
        g = model.graph
        self.model = model
        self.meta: dict[str, dict[str, str]] = {}
        for vi in list(g.value_info) + list(g.input):
            if vi.metadata_props:
                self.meta.setdefault(vi.name, {}).update({p.key: p.value for p in vi.metadata_props})
        for init in g.initializer:
            if init.metadata_props:
                self.meta.setdefault(init.name, {}).update({p.key: p.value for p in init.metadata_props})
        graph_meta = {p.key: p.value for p in g.metadata_props}
        graph_meta.update({p.key: p.value for p in model.metadata_props if p.key == SIGNATURE_KEY})
        self.kinds, self.targets = _parse_signature(graph_meta.get(SIGNATURE_KEY, ""))

    @cached_property
    def uses(self) -> dict[str, list[tuple[onnx.NodeProto, int]]]:
        """The node inputs reading each initializer; the exporters route shared initializers through
        Identity nodes: a use of the copy is a use (found on first use: the names alone need none)."""
        g = self.model.graph
        direct: dict[str, list[tuple[onnx.NodeProto, int]]] = {}
        for node in g.node:
            for k, x in enumerate(node.input):
                if x:
                    direct.setdefault(x, []).append((node, k))
        uses: dict[str, list[tuple[onnx.NodeProto, int]]] = {}
        for name in {i.name for i in g.initializer}:
            pending, seen = [name], set()
            while pending:
                t = pending.pop()
                for node, k in direct.get(t, []):
                    if node.op_type == "Identity" and node.domain in ("", "ai.onnx") and node.output[0] not in seen:
                        seen.add(node.output[0])
                        pending.append(node.output[0])
                    else:
                        uses.setdefault(name, []).append((node, k))
        return uses

    @staticmethod
    def scope(node: onnx.NodeProto) -> str | None:
        """The PyTorch module a node was exported from: the dynamo exporter's name scopes, or the TorchScript
        exporter's node name (``/l1/norm1/LayerNormalization`` -> ``l1.norm1``)."""
        for p in node.metadata_props:
            if p.key == NODE_SCOPES_KEY:
                try:
                    scopes = ast.literal_eval(p.value)
                except (ValueError, SyntaxError):
                    return None
                return str(scopes[-2]) if isinstance(scopes, (list, tuple)) and len(scopes) >= 2 else None
        if node.name.startswith("/") and node.name.count("/") >= 2:
            return ".".join(node.name.split("/")[1:-1])
        return None

    @cached_property
    def held(self) -> set[str]:
        """The PyTorch parameters and buffers the graph holds: as initializers, or folded into one."""
        held = set()
        for init in self.model.graph.initializer:
            if self.kind(init.name):
                held.add(self.torch_name(init.name))
            held.update(self.parameter_sources(init.name))
        return held

    @cached_property
    def folded_batch_norms(self) -> list[str]:
        """The BatchNorm modules whose running statistics the graph signature lists but the graph does not
        hold: the exporter folded them into the preceding convolutions (the dynamo exporter's default
        optimize=True does, from a module in train mode too)."""
        return sorted({t[: -len(suffix)] for t, kind in self.kinds.items() if kind == "BUFFER"
                       for suffix in _BN_STATISTICS if t.endswith(suffix) and t not in self.held})

    def kind(self, name: str) -> str | None:
        """PARAMETER / BUFFER / CONSTANT_TENSOR as the exporter recorded it for this tensor or PyTorch name."""
        meta = self.meta.get(name, {})
        if KIND_KEY in meta:
            return meta[KIND_KEY]
        return self.kinds.get(name)

    def torch_name(self, name: str) -> str:
        original = self.meta.get(name, {}).get(ORIGINAL_KEY)
        return self.targets.get(original, name) if original else name

    def folded_from(self, name: str) -> list[str] | None:
        text = self.meta.get(name, {}).get(FOLDED_KEY)
        if not text:
            return None
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            return None
        return [str(v) for v in value] if isinstance(value, (list, tuple)) else None

    def parameter_sources(self, name: str, seen: frozenset = frozenset()) -> list[str]:
        """The PyTorch parameters a folded tensor was computed from (through earlier folds too)."""
        found: list[str] = []
        for src in self.folded_from(name) or []:
            if src in seen:
                continue
            if self.kind(src) == "PARAMETER":
                found.append(self.torch_name(src))
            elif self.folded_from(src):
                found += self.parameter_sources(src, seen | {name})
        return list(dict.fromkeys(found))


def _parse_signature(text: str) -> tuple[dict[str, str], dict[str, str]]:
    """``p_fc_weight: PARAMETER target='fc.weight'`` lines -> ({target: kind}, {placeholder: target})."""
    kinds, targets = {}, {}
    for m in re.finditer(r"^\s*(\S+): (PARAMETER|BUFFER|CONSTANT_TENSOR|CUSTOM_OBJ|TOKEN) target='([^']*)'",
                         text, re.MULTILINE):
        placeholder, kind, target = m.groups()
        kinds[target] = kind
        targets[placeholder] = target
    return kinds, targets


def _merged_parameters(model: onnx.ModelProto, facts: _ModelFacts) -> list[tuple[str, str, tuple, str]]:
    """Tensors the exporter merged into another initializer because their values were equal, as
    ``(name, holder, ((node, input), ...), what)``, each to get its own tensor again (:func:`restore_ties`):

    - ``"parameter"``: a PyTorch parameter the graph signature lists (the dynamo exporter's default
      optimize=True merges zero biases, LayerNorm weights of 1, ...) of which the graph holds no tensor, while
      the nodes exported from its module (or, where none, from a module above it) read the holder. Taken only
      where exactly one holder fits (the same attribute name first) and no other parameter claims the same
      reads, so that nothing is split off wrongly;
    - ``"statistic"``: a BatchNormalization running statistic that shares its initializer with a weight (the
      TorchScript exporter merges a fresh running_var with a scale of ones);
    - ``"tie"``: a parameter read through another's initializer that was not merged by value (a tied LM head),
      which stays one tensor, as in PyTorch;
    - ``"zeros:<shape>"``: a zero bias the exporter's optimizer dropped (:func:`_dropped_biases`).
    """
    g = model.graph
    inits = {i.name for i in g.initializer if i.data_type in M.FLOAT_TYPES}
    taken = set(inits) | {o for n in g.node for o in n.output}
    merges = []
    for name in sorted(inits):
        uses = facts.uses.get(name, [])
        stats = [(node, k) for node, k in uses if k in _RUNNING_STATS.get(node.op_type, ())]
        if stats and len(stats) < len(uses):
            for node, k in stats:
                base = f"{facts.scope(node) or node.name}.{'running_mean' if k == 3 else 'running_var'}"
                target = base if base not in taken else f"{node.name}/{base.rpartition('.')[2]}"
                taken.add(target)
                merges.append((target, name, ((node.name, k),), "statistic"))
    missing = [t for t, kind in facts.kinds.items() if kind == "PARAMETER" and t not in facts.held
               and t not in inits]
    folded = set(facts.folded_batch_norms)
    # what each initializer holds: a parameter as it is, or one folded one-to-one (a transposed weight)
    holds = {}
    for name in inits:
        if facts.kind(name) == "PARAMETER":
            holds[name] = facts.torch_name(name)
        elif facts.folded_from(name) and not _FUNCTION_OF.match(name) and len(facts.parameter_sources(name)) == 1:
            holds[name] = facts.parameter_sources(name)[0]
    claims: dict[str, tuple[str, tuple]] = {}
    for target in missing:
        module, _, attr = target.rpartition(".")
        if module in folded:
            continue
        # the nodes of its own module first, else of the modules above it (attention reads its projections)
        for scopes in ({module}, {module.rsplit(".", j)[0] for j in range(1, module.count(".") + 1)}):
            found: dict[str, list[tuple[str, int]]] = {}
            for holder, parameter in holds.items():
                own, _, holder_attr = parameter.rpartition(".")
                if holder_attr != attr:      # merged tensors are equal, so of one kind: a bias for a bias
                    continue
                for node, k in facts.uses.get(holder, []):
                    scope = facts.scope(node)
                    if scope in scopes and scope != own and not (own.startswith(f"{scope}.") and scope != module):
                        found.setdefault(holder, []).append((node.name, k))
            if len(found) == 1:
                holder, uses = next(iter(found.items()))
                claims[target] = (holder, tuple(uses))
                break
    counted: dict[tuple, int] = {}
    for _, uses in claims.values():
        for use in uses:
            counted[use] = counted.get(use, 0) + 1
    # a tie (an LM head that is the token embedding) looks the same in the graph: one tensor for two names.
    # Merged by value only where the exporter's optimizer ran and the values say so: one value repeated
    # (zero biases, LayerNorm weights of 1) or a layer cloned from another (layers.1.x holding layers.0.x)
    optimized = _optimized_by_exporter(model, facts)
    values = {i.name: i for i in g.initializer}
    for target, (holder, uses) in claims.items():
        if all(counted[u] == 1 for u in uses):
            by_value = optimized and (_constant_fill(values[holder]) or _clone_path(target) == _clone_path(
                holds[holder]))
            merges.append((target, holder, uses, "parameter" if by_value else "tie"))
    if optimized:
        merges += _dropped_biases([t for t in missing if t not in claims and t.rpartition(".")[0] not in folded],
                                  model, facts, claims)
    return merges


def _optimized_by_exporter(model: onnx.ModelProto, facts: _ModelFacts) -> bool:
    """Whether the dynamo exporter's optimizer ran (optimize=True, its default): it leaves folded_from or
    rewrite-rule metadata. Without it (onnxgrad.from_torch, optimize=False) no tensors are merged by value."""
    if any(p.key == FROM_TORCH_KEY for p in model.metadata_props):
        return False
    return (any(facts.folded_from(i.name) is not None for i in model.graph.initializer)
            or any(p.key == REWRITE_RULE_KEY for n in model.graph.node for p in n.metadata_props))


def _clone_path(name: str) -> str:
    """A parameter's path with its layer indices taken out: layers.1.norm1.weight -> layers.#.norm1.weight."""
    return re.sub(r"(^|\.)\d+(?=\.)", r"\1#", name)


def _dropped_biases(missing: list[str], model: onnx.ModelProto, facts: _ModelFacts,
                    claims: dict[str, tuple[str, tuple]]) -> list[tuple]:
    """Zero biases the exporter dropped (a Linear's bias of zeros folded away: its Gemm or Conv has no bias
    input left), as ``(bias, "", ((node, 2), ...), "zeros:<shape>")``: restored as zeros, PyTorch's value.
    The weight is found as it is, folded, or split off a merge (``claims``)."""
    inits = {i.name: i for i in model.graph.initializer}
    nodes = {n.name: n for n in model.graph.node}
    out = []
    for target in missing:
        module, _, attr = target.rpartition(".")
        if attr != "bias":
            continue
        weight = f"{module}.weight"
        if weight in claims:
            holder, claimed = claims[weight]
            reads = [(holder, nodes[n], k) for n, k in claimed]
        else:
            reads = [(name, node, k) for name in inits if facts.torch_name(name) == weight
                     or facts.parameter_sources(name) == [weight] for node, k in facts.uses.get(name, [])]
        uses, shape = [], None
        for w, node, k in reads:
            if k != 1 or node.op_type not in ("Gemm", "Conv") or (len(node.input) > 2 and node.input[2]):
                continue
            dims = list(inits[w].dims)
            trans_b = any(a.name == "transB" and a.i for a in node.attribute)
            n = dims[0] if node.op_type == "Conv" or trans_b else dims[-1]
            if shape not in (None, (n,)):
                uses = []
                break
            shape = (n,)
            uses.append((node.name, 2))
        if uses:
            out.append((target, "", tuple(uses), "zeros:" + ",".join(map(str, shape))))
    return out


def _split_off(target: str, holder: Parameter | None, uses: tuple, what: str, frozen: set[str]) -> Parameter:
    """The report's entry for a tensor split off the initializer the exporter merged it into, or for a zero
    bias it dropped."""
    if what.startswith("zeros:"):
        shape = tuple(int(d) for d in what[len("zeros:"):].split(","))
        trains = target not in frozen
        reason = ("frozen" if not trains else "PyTorch parameter the exporter dropped because it was zero (its "
                  f"{'node has' if len(uses) == 1 else 'nodes have'} no bias input left): restored as zeros, as "
                  "PyTorch trains it")
        return Parameter(target, trains, reason, target, merged_uses=uses, zeros=shape)
    if what == "statistic":
        return Parameter(target, False, f"running statistic of BatchNormalization node '{uses[0][0]}' (a buffer), "
                         f"which the exporter merged into '{holder.name}' because their values were equal: it gets "
                         "its own tensor again", None, merged_into=holder.name, merged_uses=uses)
    if target in frozen:
        return Parameter(target, False, "frozen", target, merged_into=holder.name, merged_uses=uses)
    reason = (f"PyTorch parameter, which the exporter merged into '{holder.name}' because their values were "
              f"equal: it gets its own tensor again (a copy of those values), as PyTorch trains it")
    if not holder.trainable:
        reason = f"not trained, as '{holder.name}' which the exporter merged it into: {holder.reason}"
    return Parameter(target, holder.trainable, reason, target, merged_into=holder.name, merged_uses=uses)


def _findings(model: onnx.ModelProto, facts: _ModelFacts, merges: list[tuple[str, str, tuple, str]],
              decisions: list[Parameter], untouched: set[str] = frozenset()) -> list[Finding]:
    """What the exporter did that training cannot take back, each the way out first, then what happened with a
    few of the tensors and a count (a ResNet's list would make a line of 1,400 characters)."""
    g = model.graph
    out = []
    frozen_stats = (f"or pass {arg('train_mode', False)} to train the folded weights with the statistics frozen "
                    "(not PyTorch's parameters: a different update)")
    copies = [p for p in decisions if not p.trainable and p.torch_name and not p.tied_to and not p.merged_into
              and ("repeats elements" in p.reason or "second copy" in p.reason)]
    if copies:
        out.append(Finding("copy_left_out", tuple(p.name for p in copies), (
            f"{REEXPORT_HINT}: the exporter folded {len(copies)} copies of PyTorch parameters that onnxgrad cannot "
            "train as the parameter (" + some((f"'{p.name}' of '{p.torch_name}'" for p in copies), quoted=False)
            + "): PyTorch trains the parameter through them, onnxgrad leaves them as exported")))
    folded = facts.folded_batch_norms
    if folded:
        # the fused convolution's weight keeps the parameter's name but lost its own metadata
        fused = any(i.name in facts.kinds and KIND_KEY not in facts.meta.get(i.name, {}) for i in g.initializer)
        out.append(Finding("batchnorm_folded", tuple(folded), (
            f"{REEXPORT_HINT}, {frozen_stats}; the exporter folded {len(folded)} BatchNorm(s) into the preceding "
            f"convolutions ({some(folded)})" + (", whose weights hold W*gamma/sigma" if fused else "")
            + ": the graph has no batch statistics to train on nor running statistics to update, so it cannot "
            "train as model.train() does"), refused_in_train_mode=True))
    if not facts.kinds:       # no signature (TorchScript): a folded Conv weight has a generated name
        convs = [n for n in g.node if n.op_type in ("Conv", "ConvTranspose") and len(n.input) > 1
                 and _TORCHSCRIPT_FOLDED_CONV.match(n.input[1])]
        if convs and not any(n.op_type == "BatchNormalization" for n in g.node):
            out.append(Finding("batchnorm_folded", tuple(n.input[1] for n in convs), (
                f"{REEXPORT_HINT} (TorchScript: training=torch.onnx.TrainingMode.PRESERVE keeps "
                f"BatchNormalization), {frozen_stats}; the exporter computed the weights of {len(convs)} "
                f"convolution(s) by constant folding ({some(n.name for n in convs)}), as torch.onnx.export does "
                "when it folds BatchNorm into them (an eval-mode export): training them has no batch statistics "
                "and trains W*gamma/sigma, not PyTorch's parameters"), refused_in_train_mode=True))
    split = {t for t, _, _, _ in merges}
    unresolved = [t for t, kind in facts.kinds.items() if kind == "PARAMETER" and t not in facts.held
                  and t not in split and t.rpartition(".")[0] not in folded and t not in untouched]
    if unresolved:
        out.append(Finding("merged", tuple(unresolved), (
            f"{REEXPORT_HINT}: {len(unresolved)} PyTorch parameter(s) of the module are not in the graph ("
            f"{some(unresolved)}): the exporter merged them into tensors of equal values or folded them into "
            "constants" + ("" if FROM_TORCH_KEY in {p.key for p in model.metadata_props} else
                           " (or the forward does not use them: onnxgrad.from_torch tells which)")
            + ", and which tensor holds each cannot be told, so they are not trained as PyTorch trains them")))
    for name in (i.name for i in g.initializer if facts.folded_from(i.name)):
        sources = facts.parameter_sources(name)
        if sources and _FUNCTION_OF.match(name):
            out.append(Finding("not_one_to_one", (name, *sources), (
                f"{REEXPORT_HINT}: the exporter folded a function of PyTorch parameter {some(sources)} into the "
                f"constant '{name}': PyTorch trains the parameter, onnxgrad cannot (training '{name}' instead "
                "would be a different update), so it stays as exported")))
    if not facts.kinds:       # TorchScript: equal-valued parameters of different modules share one initializer
        shared = []
        for init in g.initializer:
            if init.data_type not in M.FLOAT_TYPES or _GENERATED.match(init.name) or "." not in init.name:
                continue
            own = init.name.rpartition(".")[0]
            scopes = {facts.scope(n) for n, _ in facts.uses.get(init.name, [])} - {None}
            others = sorted(s for s in scopes if s != own and not own.startswith(f"{s}."))
            if others and own in scopes:
                shared.append(f"'{init.name}' (also read by {', '.join(map(repr, others[:2]))})")
        if shared:
            out.append(Finding("merged", tuple(shared), (
                f"{REEXPORT_HINT}: {len(shared)} initializer(s) are read by other modules besides their own ("
                + some(shared, quoted=False) + "): the TorchScript exporter merges parameters of equal values "
                "(zero biases, LayerNorm weights of 1, layers cloned from one another) into one initializer, so "
                "PyTorch's separate parameters would train as one; TorchScript records no signature to tell them from "
                "parameters tied on purpose")))
    return out


def _constant_fill(init: onnx.TensorProto) -> bool:
    """Every element equal (a fresh zero bias, a LayerNorm weight of ones): what equal values look like."""
    if np.prod(init.dims) > _VALUE_CHECK_LIMIT or init.data_location == onnx.TensorProto.EXTERNAL:
        return False
    values = numpy_helper.to_array(init).reshape(-1)
    return values.size > 1 and bool((values == values[0]).all())


def _decide(init: onnx.TensorProto, facts: _ModelFacts, frozen: set[str], reach: set[str],
            what: str) -> Parameter:
    name = init.name
    torch_name = facts.torch_name(name) if facts.kind(name) else None
    if name in frozen:
        return Parameter(name, False, "frozen", torch_name)
    if facts.meta.get(name, {}).get(REQUIRES_GRAD_KEY) == "false":
        return Parameter(name, False, "PyTorch parameter with requires_grad=False (recorded by from_torch)",
                         torch_name)
    if name not in reach:
        if facts.uses.get(name):
            reason = (f"no differentiable path to {what} (it reaches it only through inputs that carry no "
                      "gradient: a shape, an index, a comparison, an integer cast, a stop-gradient op)")
        else:
            reason = "read by no node"
        return Parameter(name, False, reason, torch_name)
    uses = facts.uses.get(name, [])
    stats = [node for node, k in uses if k in _RUNNING_STATS.get(node.op_type, ()) and node.domain in ("", "ai.onnx")]
    if stats and len(stats) == len(uses):
        return Parameter(name, False, f"running statistic of {stats[0].op_type} node '{stats[0].name}' (a buffer)",
                         torch_name)
    # also read as a running statistic where the exporter merged equal values: that use gets its own tensor
    kind = facts.kind(name)
    if kind == "PARAMETER":
        return Parameter(name, True, "PyTorch parameter (exporter metadata)", torch_name)
    if kind == "BUFFER":
        return Parameter(name, False, "PyTorch buffer (exporter metadata): PyTorch does not train it", torch_name)
    if kind is not None:
        return Parameter(name, False, f"{kind} in the exporter's graph signature: PyTorch does not train it",
                         torch_name)
    sources = facts.folded_from(name)
    if sources is not None:
        return _decide_folded(init, facts, sources)
    return _decide_by_value(init)


def _decide_folded(init: onnx.TensorProto, facts: _ModelFacts, sources: list[str]) -> Parameter:
    params = facts.parameter_sources(init.name)
    if not params:
        return Parameter(init.name, False, f"folded by the exporter from constants or buffers ({', '.join(sources)})")
    torch_name = ", ".join(params)
    if _FUNCTION_OF.match(init.name):
        return Parameter(init.name, False, f"the exporter folded a function of PyTorch parameter '{torch_name}' "
                         f"into this constant ('{init.name}'): training it would not update '{torch_name}' as "
                         f"PyTorch does, so it is not trained; {NO_FOLDING_HINT}", torch_name)
    if _repeats_elements(init):
        if _broadcast_axes(init):
            return Parameter(init.name, False, f"a folded copy that repeats rows of PyTorch parameter "
                             f"'{torch_name}' (a Gather or Expand of it): computed from those rows "
                             f"('{init.name}.rows'), trained once, so that their gradient sums every use, as "
                             "PyTorch's", torch_name,
                             tied_to=f"{init.name}.rows", tie_op="Expand")
        return Parameter(init.name, False, f"a folded copy that repeats elements of PyTorch parameter "
                         f"'{torch_name}' (a Gather or Expand of it): training the copy separately would break "
                         f"the tie between its elements; {NO_FOLDING_HINT}", torch_name)
    how = "transposed or cast" if len(sources) == 1 else "reshaped or sliced"
    return Parameter(init.name, True, f"PyTorch parameter '{torch_name}' as the exporter folded it ({how})",
                     torch_name)


def _broadcast_axes(init: onnx.TensorProto) -> tuple[int, ...]:
    """The axes along which every slice equals the first (a folded Expand, or a Gather of one row): the
    tensor is its first slice along them, broadcast. Empty when it is not."""
    values = numpy_helper.to_array(init)
    axes = tuple(a for a in range(values.ndim) if values.shape[a] > 1
                 and bool((values == values.take([0], axis=a)).all()))
    return axes if axes and values.size > 1 else ()


def _rows(init: onnx.TensorProto) -> np.ndarray:
    """The first slice along every broadcast axis of a folded Expand (kept as size-1 axes)."""
    values = numpy_helper.to_array(init)
    for a in _broadcast_axes(init):
        values = values.take([0], axis=a)
    return np.ascontiguousarray(values)


def _repeats_elements(init: onnx.TensorProto) -> bool:
    """Whether the tensor repeats slices of its values, as a folded Gather or Expand of a weight does.

    Along some axis, at least a quarter of the fibres (the vectors along that axis) equal an earlier
    one; or, for a gather of single values (a one-head bias table), at least half the elements
    repeat (for bf16/fp16 values, which repeat by chance, a quarter of at most 256 elements).
    Constant fills (a fresh zero bias re-packed) are not copies.

    A weight whose values are more than three quarters distinct repeats neither way, and hashing tells
    that without sorting it (:func:`_mostly_distinct`; ResNet-18's 40 folded convolutions spent 11 s in
    ``np.unique`` before): r equal fibres of n elements beyond their first leave at most ``size - r n``
    distinct values, so a quarter of the fibres repeated on any axis leaves at most three quarters.
    """
    values = numpy_helper.to_array(init)
    flat = values.reshape(-1)[:_REPEAT_CHECK_LIMIT]
    if flat.size < 2 or bool((flat == flat[0]).all()):
        return False
    if _mostly_distinct(flat):
        return False
    if values.size <= _REPEAT_CHECK_LIMIT:
        for axis, n in enumerate(values.shape):
            if n < 2:
                continue
            fibres = np.moveaxis(values, axis, -1).reshape(-1, n)
            if len(fibres) >= 2 and len(np.unique(fibres, axis=0)) <= 0.75 * len(fibres):
                return True
    unique = np.unique(flat).size
    if not _low_precision(flat):
        return unique <= flat.size / 2
    # bf16/fp16 weights repeat by chance: 256 random bf16 values hold ~87% distinct ones (1024: ~68%)
    return flat.size <= 256 and unique <= 0.75 * flat.size


_HASH_MIN_ELEMENTS = 1 << 10     # fewer are sorted at once
_FIBONACCI = {4: np.uint32(0x9E3779B9), 8: np.uint64(0x9E3779B97F4A7C15)}    # 2^bits / golden ratio


def _mostly_distinct(flat: np.ndarray) -> bool:
    """Whether more than three quarters of the values are distinct, shown by a lower bound on their number:
    the hash buckets their bits fill (equal values fill one, ``-0.0`` made ``+0.0`` as ``np.unique`` counts
    them). With at least 4 buckets per value, distinct values collide little (4M of them fill 3.5M of 16M
    buckets), so a random or trained weight answers True at once; False means only "not shown" (few,
    repeating or non-finite values, or an element type other than a 2, 4 or 8 byte float)."""
    itemsize = flat.dtype.itemsize
    if flat.size < _HASH_MIN_ELEMENTS or flat.dtype.kind != "f" or itemsize not in (2, 4, 8):
        return False
    if not np.isfinite(flat).all():
        return False
    word = max(itemsize, 4)
    keys = (flat + flat.dtype.type(0)).view(f"u{itemsize}").astype(f"u{word}", copy=False)   # -0.0 + 0 = +0.0
    log2_buckets = min(24, int(flat.size * 4 - 1).bit_length())
    with np.errstate(over="ignore"):
        np.multiply(keys, _FIBONACCI[word], out=keys)
    np.right_shift(keys, keys.dtype.type(8 * word - log2_buckets), out=keys)
    seen = np.zeros(1 << log2_buckets, np.bool_)
    seen[keys] = True
    return int(np.count_nonzero(seen)) > 0.75 * flat.size


def _low_precision(values: np.ndarray) -> bool:
    """Every value is exactly a bfloat16 or a float16."""
    as32 = values.astype(np.float32)
    bf16 = not (as32.view(np.uint32) & 0xFFFF).any()
    with np.errstate(over="ignore"):
        fp16 = bool((as32.astype(np.float16).astype(np.float32) == as32).all())
    return bf16 or fp16


def _decide_by_value(init: onnx.TensorProto) -> Parameter:
    """No exporter metadata: masks, exporter constants and buffer-named tensors are not trained."""
    name = init.name
    if _BUFFER_NAMES.search(name):
        return Parameter(name, False, "named like a PyTorch buffer")
    if math.prod(init.dims) > _VALUE_CHECK_LIMIT and not _GENERATED.match(name):
        # reading a weight this large copies it; masks and exporter constants are not this large under a
        # module path's name
        return Parameter(name, True, "float initializer with a differentiable path (no exporter metadata)")
    values = numpy_helper.to_array(init).reshape(-1)
    lo, hi = (values.min(), values.max()) if values.size else (0.0, 0.0)     # NaN and inf show here
    if not (np.isfinite(lo) and np.isfinite(hi)):
        return Parameter(name, False, "holds non-finite values (a mask)")
    if lo == 0 and hi == 1 and values.size > 1 and bool(((values == 0) | (values == 1)).all()):
        return Parameter(name, False, "holds only 0s and 1s (a mask)")
    generated = _GENERATED.match(name) is not None
    if generated and lo == hi:
        shape = "a scalar" if values.size <= 1 else "a constant fill"
        return Parameter(name, False, f"an exporter constant ({shape} under a generated name)")
    if generated and _repeats_elements(init):
        return Parameter(name, False, "repeats slices of its values under a generated name: a folded Gather or "
                         "Expand of a weight (e.g. a relative-position bias table), which training separately would "
                         f"untie; {NO_FOLDING_HINT}")
    return Parameter(name, True, "float initializer with a differentiable path (no exporter metadata)")


def _break_ties(decisions: list[Parameter], facts: _ModelFacts, values: Mapping[str, onnx.TensorProto]
                ) -> list[Parameter]:
    """A PyTorch parameter held by several trainable initializers trains once: the first holder
    (an unfolded one if there is one). A copy that is exactly its transpose or a reshape of it is
    computed from it (:func:`restore_ties`), so the tie holds as in PyTorch; other copies are left
    out with the reason."""
    holders: dict[str, list[int]] = {}
    for k, p in enumerate(decisions):
        if p.trainable and p.torch_name:
            for t in p.torch_name.split(", "):
                holders.setdefault(t, []).append(k)
    out = list(decisions)
    _tie_by_value(out, values)
    for torch_name, ks in holders.items():
        if len(ks) < 2:
            continue
        direct = [k for k in ks if facts.folded_from(decisions[k].name) is None]
        keep = direct[0] if direct else ks[0]
        for k in ks:
            if k != keep and out[k].trainable:
                p, holder = out[k], decisions[keep].name
                op = _tie_op(values[p.name], values[holder])
                if op is not None:
                    out[k] = Parameter(p.name, False, f"a copy of PyTorch parameter '{torch_name}' ({op} of "
                                       f"'{holder}'): computed from it, so the tie holds", p.torch_name, holder, op)
                else:
                    out[k] = Parameter(p.name, False, f"a second copy of PyTorch parameter '{torch_name}', which "
                                       f"'{holder}' holds and trains: training both would break their tie; "
                                       f"{NO_FOLDING_HINT}", p.torch_name)
    return out


def _tie_by_value(out: list[Parameter], values: Mapping[str, onnx.TensorProto]) -> None:
    """Without metadata, a trainable initializer that holds exactly another's values (or their transpose)
    is that one's copy (the TorchScript exporter folds a tied LM head as the embedding's transpose under a
    generated name): it is computed from the other, named one, so the tie holds. Only generated-name
    tensors and the tensors of their sizes are read."""
    size = {k: math.prod(values[p.name].dims) for k, p in enumerate(out) if p.trainable}
    candidates = [k for k in size if size[k] >= 2]
    # the copies an exporter makes have generated names; a named tensor is read only as the holder of one
    copy_sizes = {size[k] for k in candidates if out[k].torch_name is None and _GENERATED.match(out[k].name)}
    candidates = [k for k in candidates if size[k] in copy_sizes]
    if len(candidates) < 2:
        return
    candidates.sort(key=lambda k: (bool(_GENERATED.match(out[k].name)), k))     # named holders first
    shapes = {tuple(values[out[k].name].dims) for k in candidates}
    seen: dict[tuple, int] = {}
    for k in candidates:
        p = out[k]
        a = np.ascontiguousarray(numpy_helper.to_array(values[p.name]))
        if (a == a.reshape(-1)[0]).all():
            continue                    # constant fills coincide without being copies
        keys = [(a.dtype.str, hashlib.blake2b(a.data).digest())]
        if a.ndim == 2 and a.shape[::-1] in shapes:
            keys.append((a.dtype.str, hashlib.blake2b(np.ascontiguousarray(a.T).data).digest()))
        holder = next((seen[key] for key in keys if key in seen), None)
        if holder is None or p.torch_name is not None:
            seen.setdefault(keys[0], k)
            continue
        op = _tie_op(values[p.name], values[out[holder].name])
        if op is not None:
            h = out[holder]
            out[k] = Parameter(p.name, False, f"a copy of '{h.name}' ({op} of it, as an exporter folds tied "
                               "weights): computed from it, so the tie holds", h.torch_name or h.name, h.name, op)


def _tie_op(copy: onnx.TensorProto, holder: onnx.TensorProto) -> str | None:
    """"Transpose" or "Reshape" when ``copy`` is exactly that of ``holder``, else None."""
    if copy.data_type != holder.data_type or np.prod(copy.dims) != np.prod(holder.dims):
        return None
    a, b = numpy_helper.to_array(copy), numpy_helper.to_array(holder)
    if a.ndim == 2 and b.ndim == 2 and a.shape == b.shape[::-1] and np.array_equal(a, b.T):
        return "Transpose"
    if np.array_equal(a.reshape(-1), b.reshape(-1)):
        return "Reshape"
    return None


def restore_ties(model: onnx.ModelProto, report: ParameterReport, ties: bool = True) -> onnx.ModelProto:
    """A copy of ``model`` in which every initializer the report found tied to a trained one is
    computed from it (a Transpose or Reshape node; ``ties=False`` leaves them), so that training updates
    both as one parameter and its gradient sums both uses, as in PyTorch; and every tensor the exporter
    merged into another initializer by value has its own tensor again, read by its own nodes."""
    rows = [p for p in report if p.rows_of] if ties else []
    ties = [p for p in report if p.tied_to] if ties else []
    merged = [p for p in report if p.merged_into or p.zeros is not None]
    if not ties and not merged:
        return model
    m = onnx.ModelProto()
    m.CopyFrom(model)
    g = m.graph
    dims = {i.name: list(i.dims) for i in g.initializer}
    tied = {p.name for p in ties}
    holders = {i.name: i for i in g.initializer}
    for p in merged:
        copy = g.initializer.add()
        if p.zeros is not None:
            weight = holders.get(next(n.input[1] for n in g.node if n.name == p.merged_uses[0][0]))
            dtype = weight.data_type if weight is not None else onnx.TensorProto.FLOAT
            copy.CopyFrom(numpy_helper.from_array(np.zeros(p.zeros, helper.tensor_dtype_to_np_dtype(dtype)), p.name))
        else:
            copy.CopyFrom(holders[p.merged_into])
        copy.name = p.name
        del copy.metadata_props[:]
        vi = g.value_info.add()
        vi.CopyFrom(helper.make_tensor_value_info(p.name, copy.data_type, list(copy.dims)))
        vi.metadata_props.add(key=KIND_KEY, value="PARAMETER")
        nodes = {n.name: n for n in g.node}
        for node, k in p.merged_uses:
            while len(nodes[node].input) <= k:
                nodes[node].input.append("")
            nodes[node].input[k] = p.name
    for p in rows:
        g.initializer.add().CopyFrom(numpy_helper.from_array(_rows(holders[p.rows_of]), p.name))
    M.keep_only(g.initializer, lambda t: t.name not in tied)
    nodes = []
    for p in ties:
        scope = f"{p.name}/tie"
        if p.tie_op == "Expand":
            shape = f"{scope}/shape"
            g.initializer.add().CopyFrom(numpy_helper.from_array(np.array(dims[p.name], np.int64), shape))
            nodes.append(onnx.helper.make_node("Expand", [p.tied_to, shape], [p.name], name=scope))
        elif p.tie_op == "Transpose":
            nodes.append(onnx.helper.make_node("Transpose", [p.tied_to], [p.name], name=scope, perm=[1, 0]))
        else:
            shape = f"{scope}/shape"
            g.initializer.add().CopyFrom(numpy_helper.from_array(np.array(dims[p.name], np.int64), shape))
            nodes.append(onnx.helper.make_node("Reshape", [p.tied_to, shape], [p.name], name=scope))
    rest = list(g.node)
    del g.node[:]
    g.node.extend(nodes + rest)
    return m
