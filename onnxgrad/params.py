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
import os
import re
from dataclasses import dataclass
from typing import Iterator, Mapping, Sequence

import numpy as np
import onnx
from onnx import numpy_helper

from . import model as M
from .errors import UnknownNameError

__all__ = ["Parameter", "ParameterReport", "parameters", "recorded_torch_names", "restore_ties"]

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
# BatchNormalization input positions that hold running statistics
_RUNNING_STATS = {"BatchNormalization": (3, 4)}
# folds that repeat elements are told by their values; above this size the check samples
_REPEAT_CHECK_LIMIT = 1 << 22
# named (non-generated) tensors larger than this are not read for the mask checks
_VALUE_CHECK_LIMIT = 1 << 24
NO_FOLDING_HINT = ("to train it, export with torch.onnx.export(..., dynamo=True, optimize=False) so that the "
                   "parameter stays one tensor, or name it in trainable=")


@dataclass(frozen=True)
class Parameter:
    """The decision for one float initializer: whether it trains, why, and its PyTorch name."""

    name: str
    trainable: bool
    reason: str
    torch_name: str | None = None
    tied_to: str | None = None        # a copy of this trained initializer, computed from it (see restore_ties)
    tie_op: str | None = None         # how: "Transpose" or "Reshape"

    def line(self) -> str:
        torch = f" (PyTorch '{self.torch_name}')" if self.torch_name and self.torch_name != self.name else ""
        return f"{self.name}{torch}: {self.reason}"


class ParameterReport:
    """Every float initializer of a model with its decision, in model order."""

    def __init__(self, entries: Sequence[Parameter], what: str):
        self.entries = list(entries)
        self.what = what
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

    def lines(self) -> list[str]:
        """A readable table: the trainable tensors, then those left out with their reasons."""
        out = [f"trainable parameters of {self.what}: {len(self.trainable)}"]
        out += ["  " + p.line() for p in self.entries if p.trainable]
        left = self.left_out
        if left:
            out.append(f"float initializers not trained: {len(left)}")
            out += ["  " + p.line() for p in left]
        return out

    def __repr__(self) -> str:
        return f"ParameterReport({len(self.trainable)} trainable, {len(self.left_out)} left out)"


def parameters(
    model: onnx.ModelProto | str | os.PathLike,
    loss: str | None = None,
    of: Sequence[str] | str | None = None,
    frozen: Sequence[str] = (),
    strict_tags: bool = False,
    _pass=None,
) -> ParameterReport:
    """Decide which float initializers of ``model`` are trainable (see the module's rules).

    ``loss`` / ``of`` name what is differentiated, as in :func:`onnxgrad.grad` (neither:
    the single scalar float output, else every float output). ``frozen``: initializers
    not to train. The result lists every float initializer with its reason;
    ``.trainable`` is the default ``wrt`` of ``grad`` and what training sessions train.
    """
    if _pass is None:          # the pass that differentiates the model knows what reaches its outputs
        from .autodiff import _Pass

        _pass = _Pass(M.load(model), [], [of] if isinstance(of, str) else of, loss, True, strict_tags)
    model, reach, what = _pass.model, _pass.reach, _pass._what()
    g = model.graph
    floats = [i for i in g.initializer if i.data_type in M.FLOAT_TYPES]
    names = {i.name for i in floats}
    unknown = [f for f in frozen if f not in names]
    if unknown:
        listed = ", ".join(sorted(names)[:20]) + (", ..." if len(names) > 20 else "")
        raise UnknownNameError(f"frozen name(s) {', '.join(map(repr, unknown))} are not float initializers "
                               f"of the model (initializers: {listed})")
    facts = _ModelFacts(model)
    decisions = [_decide(init, facts, set(frozen), reach, what) for init in floats]
    return ParameterReport(_break_ties(decisions, facts, {i.name: i for i in floats}), what)


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
        direct: dict[str, list[tuple[onnx.NodeProto, int]]] = {}
        for node in g.node:
            for k, x in enumerate(node.input):
                if x:
                    direct.setdefault(x, []).append((node, k))
        # the exporters route shared initializers through Identity nodes: a use of the copy is a use
        self.uses: dict[str, list[tuple[onnx.NodeProto, int]]] = {}
        for name in {i.name for i in g.initializer}:
            pending, seen = [name], set()
            while pending:
                t = pending.pop()
                for node, k in direct.get(t, []):
                    if node.op_type == "Identity" and node.domain in ("", "ai.onnx") and node.output[0] not in seen:
                        seen.add(node.output[0])
                        pending.append(node.output[0])
                    else:
                        self.uses.setdefault(name, []).append((node, k))

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
    if stats:
        reason = f"running statistic of {stats[0].op_type} node '{stats[0].name}' (a buffer)"
        if len(stats) < len(uses):
            reason += ("; the exporter also feeds it to other nodes as a weight (it merged tensors of equal "
                       "values): re-export with torch.onnx.export(..., dynamo=True, optimize=False) or "
                       "keep_initializers_as_inputs=True (TorchScript) to keep them apart")
        return Parameter(name, False, reason, torch_name)
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
    if len(sources) == 1:
        return Parameter(init.name, True, f"PyTorch parameter '{torch_name}' as the exporter folded it "
                         "(transposed or cast)", torch_name)
    if _repeats_elements(init):
        return Parameter(init.name, False, f"a folded copy that repeats elements of PyTorch parameter "
                         f"'{torch_name}' (a Gather or Expand of it): training the copy separately would break "
                         f"the tie between its elements; {NO_FOLDING_HINT}", torch_name)
    return Parameter(init.name, True, f"PyTorch parameter '{torch_name}' as the exporter folded it "
                     "(reshaped or sliced)", torch_name)


def _repeats_elements(init: onnx.TensorProto) -> bool:
    """Whether the tensor repeats slices of its values, as a folded Gather or Expand of a weight does.

    Along some axis, at least a quarter of the fibres (the vectors along that axis) equal an earlier
    one; or, for a gather of single values (a one-head bias table), at least half the elements
    repeat (for bf16/fp16 values, which repeat by chance, a quarter of at most 256 elements).
    Constant fills (a fresh zero bias re-packed) are not copies.
    """
    values = numpy_helper.to_array(init)
    flat = values.reshape(-1)[:_REPEAT_CHECK_LIMIT]
    if flat.size < 2 or bool((flat == flat[0]).all()):
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
    if np.prod(init.dims) > _VALUE_CHECK_LIMIT and not _GENERATED.match(name):
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
    candidates = [k for k, p in enumerate(out) if p.trainable and np.prod(values[p.name].dims) >= 2]
    size = {k: int(np.prod(values[out[k].name].dims)) for k in candidates}
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


def restore_ties(model: onnx.ModelProto, report: ParameterReport) -> onnx.ModelProto:
    """A copy of ``model`` in which every initializer the report found tied to a trained one is
    computed from it (a Transpose or Reshape node), so that training updates both as one
    parameter and its gradient sums both uses, as in PyTorch."""
    ties = [p for p in report if p.tied_to]
    if not ties:
        return model
    m = onnx.ModelProto()
    m.CopyFrom(model)
    g = m.graph
    dims = {i.name: list(i.dims) for i in g.initializer}
    tied = {p.name for p in ties}
    M.keep_only(g.initializer, lambda t: t.name not in tied)
    nodes = []
    for p in ties:
        scope = f"{p.name}/tie"
        if p.tie_op == "Transpose":
            nodes.append(onnx.helper.make_node("Transpose", [p.tied_to], [p.name], name=scope, perm=[1, 0]))
        else:
            shape = f"{scope}/shape"
            g.initializer.add().CopyFrom(numpy_helper.from_array(np.array(dims[p.name], np.int64), shape))
            nodes.append(onnx.helper.make_node("Reshape", [p.tied_to, shape], [p.name], name=scope))
    rest = list(g.node)
    del g.node[:]
    g.node.extend(nodes + rest)
    return m
