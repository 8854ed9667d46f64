"""Which runtime runs a model for the numeric check, and why: onnxruntime, or onnx.reference for a declared reason.

Nothing switches runtime silently. onnx.reference runs a model where the caller declares why
(``Runner(model, runtime="reference", reason=...)``), or where the reason is the element type, declared
automatically: a model computing in float64 (float16, bfloat16) with an op onnxruntime has no CPU kernel for
in that type (its kernel registry says so), whose ONNX schema excludes the type, or whose function body
onnxruntime runs with float32 constants; an op of :data:`FLOAT64_IN_REFERENCE`; bfloat16 inputs. Any other
refusal raises :class:`RuntimeRefusedError`.
"""
from __future__ import annotations

import re
from functools import lru_cache
from typing import Mapping

import numpy as np
import onnx
import onnx.defs
from onnx import TensorProto

from ...ir.files import runnable
from ...runtime import onnxruntime

# Ops whose onnxruntime float64 kernels load but cannot be trusted: RNN, GRU and LSTM accept a float64 session,
# then fail at run time; Attention departs from the spec in float64 (NaN for a fully masked row, a top-left
# causal frontier with nonpad_kv_seqlen). A float64 model with one of them runs in onnx.reference, saying so.
FLOAT64_IN_REFERENCE = {
    "RNN": "onnxruntime's float64 RNN kernel fails at run time",
    "GRU": "onnxruntime's float64 GRU kernel fails at run time",
    "LSTM": "onnxruntime's float64 LSTM kernel fails at run time",
    "Attention": "onnxruntime's float64 Attention departs from the spec (fully masked rows, causal frontier)",
}
_NON_FLOAT32 = {TensorProto.DOUBLE: "double", TensorProto.FLOAT16: "float16", TensorProto.BFLOAT16: "bfloat16"}


class RuntimeRefusedError(RuntimeError):
    """onnxruntime cannot load or run a model that nothing declared for onnx.reference.

    ``detail``: onnxruntime's own message, its first line.
    """

    def __init__(self, stage: str, model: onnx.ModelProto, error: Exception):
        text = str(error).strip()
        self.detail = text.splitlines()[0] if text else type(error).__name__
        super().__init__(f"onnxruntime cannot {stage} the model '{model.graph.name}': {self.detail} (no silent "
                         "switch to onnx.reference: declare it with Runner(model, runtime='reference', reason=...) "
                         "or check(..., reference=reason))")


class ReferenceKernelError(RuntimeError):
    """onnx.reference failed on one node: the check cannot evaluate that op on these values.

    ``node``: the node (at the model's top level: an If or Loop stands for its bodies); ``detail``: the
    kernel's own message, its first line.
    """

    def __init__(self, model: onnx.ModelProto, node: onnx.NodeProto, error: Exception):
        text = str(error).strip()
        self.node, self.detail = node, text.splitlines()[0] if text else type(error).__name__
        name = f"'{node.name}'" if node.name else f"making '{node.output[0]}'" if node.output else "(unnamed)"
        super().__init__(f"onnx.reference cannot evaluate node {name} ({node.op_type}) of the model "
                         f"'{model.graph.name}': {self.detail}")


class Runner:
    """Runs a model in onnxruntime (CPU), or in onnx.reference where that is declared with a reason.

    Nothing switches runtime silently: a model onnxruntime cannot load or run raises
    :class:`RuntimeRefusedError`, unless ``runtime="reference"`` comes with a ``reason``, or the reason is
    the element type, which is declared automatically: a model computing in float64, float16 or bfloat16
    with an op whose onnxruntime CPU kernel lacks that type (its kernel registry says so), an op listed in
    :data:`FLOAT64_IN_REFERENCE`, or bfloat16 inputs (onnxruntime's Python API takes no bfloat16 arrays).
    ``runtime="onnxruntime"`` forbids even that. ``backend`` says what runs the model, ``reason`` why it
    is not onnxruntime. onnx.reference runs with the corrected kernels of :mod:`onnxgrad.tools.check.kernels`.
    """

    def __init__(self, model: onnx.ModelProto, runtime: str | None = None, reason: str = ""):
        if runtime not in (None, "onnxruntime", "reference"):
            raise ValueError(f"runtime must be 'onnxruntime' or 'reference', not {runtime!r}")
        if runtime == "reference" and not reason:
            raise ValueError("running a model in onnx.reference needs a reason (reason=...)")
        self.model = model
        self.outputs = [o.name for o in model.graph.output]
        self._inputs = {i.name for i in model.graph.input}
        self.backend, self.reason = "onnxruntime", ""
        self._auto = runtime is None
        if runtime == "reference":
            self._use_reference(reason)
            return
        why = _type_reason(model) if self._auto else ""
        if why:
            self._use_reference(why)
            return
        ort = onnxruntime("checking against onnxruntime (runtime='reference' checks without it)")
        opts = ort.SessionOptions()
        opts.log_severity_level = 3
        try:
            with runnable(model) as source:     # a model over 2 GB: by path, its data beside it
                self._sess = ort.InferenceSession(source, opts, providers=["CPUExecutionProvider"])
        except Exception as e:
            why = _kernel_gap(model, e) if self._auto else ""
            if not why:
                raise RuntimeRefusedError("load", model, e) from e
            self._use_reference(why)

    def _use_reference(self, reason: str) -> None:
        from onnx.reference import ReferenceEvaluator

        self._sess = ReferenceEvaluator(self.model, new_ops=_corrected_kernels())
        for kernel in self._sess.rt_nodes_:       # a failing kernel names its node
            kernel.run = _naming_failures(kernel.run, self.model, kernel.onnx_node)
        self.backend, self.reason = "reference", reason

    def __call__(self, feeds: Mapping[str, np.ndarray], outputs: list[str] | None = None) -> dict[str, np.ndarray]:
        names = outputs or self.outputs
        feeds = {k: np.asarray(v) for k, v in feeds.items() if k in self._inputs}   # numpy scalars as arrays
        if self.backend == "reference":
            return dict(zip(names, self._sess.run(names, feeds)))
        try:
            values = self._sess.run(names, feeds, _quiet_run_options())
        except Exception as e:
            why = _kernel_gap(self.model, e) if self._auto else ""
            if not why:
                raise RuntimeRefusedError("run", self.model, e) from e
            self._use_reference(why)          # a kernel for the element type missing at run time
            values = self._sess.run(names, feeds)
        return dict(zip(names, values))


def _naming_failures(run, model: onnx.ModelProto, node: onnx.NodeProto):
    """``run`` (an onnx.reference kernel's), raising :class:`ReferenceKernelError` for ``node`` when it fails."""

    def named(*args, **kwargs):
        try:
            return run(*args, **kwargs)
        except ReferenceKernelError:
            raise
        except Exception as e:
            raise ReferenceKernelError(model, node, e) from e

    return named


def _quiet_run_options():
    """Run options that keep onnxruntime's error log of a failed run (we report it) off stderr."""
    import onnxruntime as ort

    opts = ort.RunOptions()
    opts.log_severity_level = 4
    return opts


def _element_types(model: onnx.ModelProto) -> set[int]:
    """The non-float32 float types the model computes in (its inputs, initializers and outputs)."""
    g = model.graph
    types = {vi.type.tensor_type.elem_type for vi in list(g.input) + list(g.output)}
    types |= {t.data_type for t in g.initializer}
    return types & set(_NON_FLOAT32)


def _type_reason(model: onnx.ModelProto) -> str:
    """The declared reason a model computing in this element type runs in onnx.reference, before trying."""
    types = _element_types(model)
    if TensorProto.BFLOAT16 in {vi.type.tensor_type.elem_type for vi in model.graph.input}:
        return "onnxruntime's Python API takes no bfloat16 arrays"
    if TensorProto.DOUBLE in types:
        listed = sorted({n.op_type for n in model.graph.node if n.op_type in FLOAT64_IN_REFERENCE})
        if listed:
            return "; ".join(FLOAT64_IN_REFERENCE[op] for op in listed)
    return ""


@lru_cache(maxsize=1)
def _cpu_kernels() -> dict[tuple[str, str], list[tuple[int, int, tuple[frozenset, ...]]]]:
    """onnxruntime's CPU kernel registry: (domain, op) -> [(first opset, last opset, each constraint's types)]."""
    from onnxruntime.capi import _pybind_state

    table: dict[tuple[str, str], list] = {}
    for k in _pybind_state.get_all_opkernel_def():
        if k.provider == "CPUExecutionProvider":
            constraints = tuple(frozenset(ts) for ts in k.type_constraints.values())
            table.setdefault((k.domain, k.op_name), []).append((*k.version_range, constraints))
    return table


_FLOAT_TYPE_STRS = frozenset({"tensor(float)", "tensor(double)", "tensor(float16)", "tensor(bfloat16)"})
# onnxruntime's refusals that name an op and are about element types: a kernel missing for the type, an
# input type the op's schema does not take, an output typed float32 by the op's function body
_MISSING_KERNEL = re.compile(r"(?:implementation|kernel) for (\w+)\((\d+)\)")
_INPUT_TYPE = re.compile(r"Type 'tensor\((\w+)\)' of input parameter \([^)]*\) of operator \((\w+)\) in node")
_BODY_TYPES = re.compile(r"Type parameter \(\w+\) of Optype \(\w+\) bound to different types \(tensor\((\w+)\) and "
                         r"tensor\(float\)\)? in node \(\)")       # a function body's float32 constant, inlined
_OUTPUT_TYPE = re.compile(r"Type \(tensor\((\w+)\)\) of output arg \([^)]*\) of node \(([^)]*)\) does not match "
                          r"expected type \(tensor\(float\)\)")


def _computes_in(constraints: tuple[frozenset, ...], type_str: str) -> bool:
    """Whether a kernel takes ``type_str`` in every float type constraint it has (LayerNormalization's
    double kernel keeps its statistics U in float: not a double kernel for stash_type=double)."""
    floats = [c for c in constraints if c & _FLOAT_TYPE_STRS]
    return bool(floats) and all(type_str in c for c in floats)


def _schema_takes(op: str, version: int, type_str: str) -> bool:
    """Whether every float type constraint of the op's schema at this opset takes ``type_str``."""
    try:
        schema = onnx.defs.get_schema(op, version, "")
    except onnx.defs.SchemaError:
        return True
    floats = [set(c.allowed_type_strs) for c in schema.type_constraints if set(c.allowed_type_strs) & _FLOAT_TYPE_STRS]
    return all(type_str in c for c in floats)


def _kernel_gap(model: onnx.ModelProto, e: Exception) -> str:
    """The reason, if onnxruntime refused a model computing in float64, float16 or bfloat16 because an op
    takes no such element type there (no CPU kernel for it, a schema that excludes it, a function body
    computing in float32); else "" (the refusal is not about element types, and is not to be hidden)."""
    types = {f"tensor({_NON_FLOAT32[t]})" for t in _element_types(model)}
    text = str(e)
    if not types:
        return ""
    version = {o.domain or "": o.version for o in model.opset_import}.get("", 1)
    if found := _MISSING_KERNEL.search(text):
        op, version = found.group(1), int(found.group(2))
    elif found := _INPUT_TYPE.search(text):
        op = found.group(2)
        types &= {f"tensor({found.group(1)})"}
    elif found := _BODY_TYPES.search(text):
        return _body_gap(model, types & {f"tensor({found.group(1)})"})
    elif found := _OUTPUT_TYPE.search(text):
        node = next((n for n in model.graph.node if n.name == found.group(2) and not n.domain), None)
        if node is None:
            return ""
        op = node.op_type
    else:
        return ""
    kernels = [c for lo, hi, c in _cpu_kernels().get(("", op), []) if lo <= version <= hi]
    if _MISSING_KERNEL.search(text) and not kernels:
        return ""               # no kernel at this opset for any type: not a matter of element types
    lacking = sorted(t for t in types if not any(_computes_in(k, t) for k in kernels))
    if not lacking:
        return ""
    import onnxruntime as ort

    names = "/".join(t[7:-1] for t in lacking)
    if not all(_schema_takes(op, version, t) for t in lacking):
        return f"the ONNX schema of {op}-{version} takes no {names}"
    how = "CPU kernel" if kernels else "CPU kernel (it runs the op's function body, in float32)"
    return f"onnxruntime {ort.__version__} has no {names} {how} for {op}-{version}"


def _body_gap(model: onnx.ModelProto, types: set[str]) -> str:
    """The reason for a type clash inside an inlined function body: the ops of the model that onnxruntime
    runs through their (float32-constant) bodies, having no kernel computing in the model's type."""
    from ...passes.function_body import has_function_body

    version = {o.domain or "": o.version for o in model.opset_import}.get("", 1)

    def schema(op: str):
        try:
            return onnx.defs.get_schema(op, version, "")
        except onnx.defs.SchemaError:
            return None

    ops = sorted({n.op_type for n in model.graph.node if not n.domain and has_function_body(schema(n.op_type))
                  and not any(_computes_in(c, t) for lo, hi, c in _cpu_kernels().get(("", n.op_type), [])
                              if lo <= version <= hi for t in types)})
    if not types or not ops:
        return ""
    import onnxruntime as ort

    names = "/".join(t[7:-1] for t in sorted(types))
    return (f"onnxruntime {ort.__version__} has no {names} CPU kernel for {', '.join(ops)} (it runs the function "
            "body, whose constants are float32)")


def _corrected_kernels() -> list:
    from .kernels import KERNELS

    return KERNELS
