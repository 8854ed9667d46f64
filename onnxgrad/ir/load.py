"""Reading a model, validating it and normalising it before any pass, and the versions runtimes load.

:func:`parse` reads a path (external data from beside it) or copies a proto, runs the ONNX checker, inlines
local functions, and normalises the model on its facts (:class:`onnxgrad.ir.model.ParsedModel`): the opset
brought into what onnxruntime runs (``MIN_OPSET`` and up, down to the installed runtime's newest), and more;
:func:`load` is its proto. :func:`emitted_ir_version` is the IR version the passes write.
"""
from __future__ import annotations

import os
import sys
from functools import lru_cache

import numpy as np
import onnx
import onnx.inliner
import onnx.version_converter
from onnx import helper, numpy_helper

from ..errors import InvalidModelError
from .files import skeleton
from .model import NameScope, ParsedModel, TensorInfo

MIN_OPSET = 13
# onnxruntime 1.31 loads IR versions up to 13 and ai.onnx opsets up to 26: the floor we rely on
# (runtime_max_opset() reads the installed onnxruntime's real maximum).
RUNTIME_MAX_IR = 13
RUNTIME_MAX_OPSET = 26


@lru_cache(maxsize=None)
def runtime_max_opset() -> int:
    """The newest ai.onnx opset the installed onnxruntime loads, probed once with a one-node model
    (onnxruntime exposes no such number); RUNTIME_MAX_OPSET without onnxruntime."""
    try:
        import onnxruntime as ort
    except ImportError:
        return RUNTIME_MAX_OPSET

    def loads(version: int) -> bool:
        x = helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])
        y = helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1])
        m = helper.make_model(helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "probe", [x], [y]),
                              opset_imports=[helper.make_opsetid("", version)])
        m.ir_version = RUNTIME_MAX_IR
        opts = ort.SessionOptions()
        opts.log_severity_level = 4
        try:
            ort.InferenceSession(m.SerializeToString(), opts, providers=["CPUExecutionProvider"])
            return True
        except Exception:
            return False

    lo, hi = RUNTIME_MAX_OPSET, max(onnx.defs.onnx_opset_version(), RUNTIME_MAX_OPSET) + 8
    if not loads(lo):
        return RUNTIME_MAX_OPSET
    while lo < hi:                  # the largest version that loads, in [lo, hi]
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if loads(mid) else (lo, mid - 1)
    return lo


def parse(model: ParsedModel | onnx.ModelProto | str | os.PathLike) -> ParsedModel:
    """``model`` parsed once for every pass: a parsed model as it is; a path (external data from beside it) or
    a proto (copied) read, checked by the ONNX checker, its local functions inlined, then normalised on its
    facts: Pad's ``axes`` folded, the opset brought into what onnxruntime runs (``MIN_OPSET`` and up, down to
    the installed runtime's newest), an IR-3 model's weights taken off its inputs."""
    if isinstance(model, ParsedModel):
        return model
    proto = _checked(model)
    parsed = _pads_on_every_axis(ParsedModel(proto))
    parsed = _in_runtime_opsets(parsed)
    return _initializers_not_inputs(parsed) if parsed.proto.ir_version < 4 else parsed


def load(model: onnx.ModelProto | str | os.PathLike) -> onnx.ModelProto:
    """The model as a proto, read, validated and normalised as :func:`parse` does."""
    return parse(model).proto


def _checked(model: onnx.ModelProto | str | os.PathLike) -> onnx.ModelProto:
    """The model read (a path, its external data from beside it) or copied (a proto), checked by the ONNX
    checker, its local functions inlined."""
    path = None
    if isinstance(model, (str, os.PathLike)):
        path = os.fspath(model)
        if not os.path.isfile(path):
            raise InvalidModelError(f"cannot read model '{path}': no such file")
        try:
            model = onnx.load(path, load_external_data=False)
            external = any(t.data_location == onnx.TensorProto.EXTERNAL for t in model.graph.initializer)
            if external:
                onnx.load_external_data_for_model(model, os.path.dirname(os.path.abspath(path)))
        except Exception as e:  # protobuf raises a zoo of types for a file that is not a model
            raise InvalidModelError(f"cannot read model '{path}': {type(e).__name__}: {e}") from None
        if not external:
            path = None         # checked as a proto below, as any other
    elif not isinstance(model, onnx.ModelProto):
        raise InvalidModelError(f"expected an onnx.ModelProto or a path, got {type(model).__name__}")
    else:
        copy = onnx.ModelProto()
        copy.CopyFrom(model)
        model = copy
    if not model.graph.node and not model.graph.output:
        raise InvalidModelError("the model has an empty graph (is this an ONNX model file?)")
    try:
        # a model with external data is checked by path (its data files, any size); a proto over
        # protobuf's 2 GB limit cannot be serialised for the checker: its skeleton is checked
        onnx.checker.check_model(path if path is not None else skeleton(model))
    except Exception as e:
        message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        # onnx 1.23's checker refuses ops deprecated after the model's opset (GroupNormalization-18,
        # which exporters still write); runtimes run them, and so do we
        if "is deprecated" not in message:
            raise InvalidModelError(f"the model fails the ONNX checker: {message}") from None
    return onnx.inliner.inline_local_functions(model) if model.functions else model


def _in_runtime_opsets(parsed: ParsedModel) -> ParsedModel:
    """The model at an ai.onnx opset the installed onnxruntime runs: converted down from a newer one, upgraded
    to ``MIN_OPSET`` from an older one (onnx's version converter)."""
    model, version, newest = parsed.proto, parsed.opset, runtime_max_opset()
    if version > newest:
        try:
            import onnxruntime
            runtime = f"onnxruntime {onnxruntime.__version__}"
        except ImportError:
            runtime = "onnxruntime"
        try:
            model = onnx.version_converter.convert_version(model, newest)
            onnx.checker.check_model(model)
        except Exception:
            raise InvalidModelError(
                f"the model uses ai.onnx opset {version}, newer than the opset {newest} the installed {runtime} "
                f"runs, and onnx's version converter cannot convert it down; re-export it at opset {newest} "
                "or older") from None
        print(f"onnxgrad: converted the model from ai.onnx opset {version} down to {newest}, the newest the "
              f"installed {runtime} runs", file=sys.stderr)
        return ParsedModel(model)
    if version < MIN_OPSET:
        print(f"onnxgrad: upgrading the model from ai.onnx opset {version} to {MIN_OPSET}", file=sys.stderr)
        try:
            upgraded = ParsedModel(onnx.version_converter.convert_version(model, MIN_OPSET))
        except Exception as e:
            raise InvalidModelError(
                f"the model uses ai.onnx opset {version}, and onnx's version converter cannot upgrade it to "
                f"{MIN_OPSET}: {str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}; "
                f"re-export it at opset {MIN_OPSET} or newer"
            ) from None
        return _scan8_batch_kept(parsed, upgraded)
    return parsed


def _initializers_not_inputs(parsed: ParsedModel) -> ParsedModel:
    """An IR-3 model made a model of its opset's IR. IR 3 (the onnx model zoo's opset 7 and 8 models) lists
    every initializer as a graph input too; they are its weights, not inputs (onnxruntime takes no feed for
    them below IR 4). They leave the input list, as a model written today holds them: the check perturbs
    them as initializers, training updates them, and no feed is asked for."""
    model = parsed.proto            # the parse's own copy: edited in place
    g = model.graph
    weights = {t.name for t in g.initializer}
    kept = [i for i in g.input if i.name not in weights]
    if len(kept) < len(g.input):
        del g.input[:]
        g.input.extend(kept)
    # the converter keeps the IR version; an upgraded opset needs a newer one
    model.ir_version = max(model.ir_version, helper.find_min_ir_version_for(list(model.opset_import),
                                                                          ignore_unknown=True))
    return parsed.edited(model)


def _pads_on_every_axis(parsed: ParsedModel) -> ParsedModel:
    """Pad-18's ``axes`` input folded into pads for every axis (same values, no axes), where pads, axes
    and the rank are known. onnxruntime 1.32's transpose optimizer ignores ``axes`` when it moves a
    Transpose through a Pad: ``Transpose(perm=[1, 0, 2]) -> Pad(mode='edge', pads=[1, 1], axes=[2]) -> Sin``
    with its gradient appended fails at run time ("indices element out of data bounds") under the
    default optimizations."""
    g = parsed.graph
    pads_with_axes = [n for n in g.node if n.op_type == "Pad" and n.domain in ("", "ai.onnx")
                      and len(n.input) > 3 and n.input[3]]
    if not pads_with_axes:
        return parsed
    values, infos = parsed.constants, parsed.infos
    taken = set(parsed.known)
    replaced: set[str] = set()
    for node in pads_with_axes:
        pads, axes = values.get(node.input[1]), values.get(node.input[3])
        shape = infos.get(node.input[0], TensorInfo()).shape
        if pads is None or axes is None or shape is None:
            continue
        r, k = len(shape), len(axes)
        full = np.zeros(2 * r, np.int64)
        for a, b, e in zip(axes.tolist(), pads.tolist()[:k], pads.tolist()[k:]):
            full[a % r], full[a % r + r] = b, e
        replaced.update(node.input[1::2])
        name, i = f"{node.input[1]}_every_axis", 0
        while name in taken:
            i += 1
            name = f"{node.input[1]}_every_axis_{i}"
        taken.add(name)
        g.initializer.append(numpy_helper.from_array(full, name))
        node.input[1] = name
        del node.input[3:]
    read = {i for n in g.node for i in n.input} | {o.name for o in g.output} | {i.name for i in g.input}
    unused = [t for t in g.initializer if t.name in replaced and t.name not in read]
    for t in unused:
        g.initializer.remove(t)
    return parsed.edited(parsed.proto)       # the parse's own copy, edited in place: its facts found again


def _scan8_batch_kept(original: ParsedModel, upgraded: ParsedModel) -> ParsedModel:
    """Scan-8 runs its body once per element of a leading batch axis of every input and output; onnx's
    converter makes it a Scan-9, which has none, and strips that axis from the declared shapes: the upgraded
    model would take other inputs than the model (test_scan_sum: initial [1, 2] became [2]). Each such Scan
    becomes a Loop over the batch, its body the Scan-9 on one element (Gather), its outputs the Loop's scan
    outputs (stacked on axis 0 again); the declared types are the model's own. Returns ``upgraded`` (the
    converter's copy of ``original``), edited in place."""
    g = upgraded.graph
    scans = [n for n in g.node if n.op_type == "Scan" and n.domain in ("", "ai.onnx")]
    if original.opset >= 9 or not scans:
        return upgraded
    fresh = NameScope(upgraded.defined).fresh
    nodes = []
    for node in g.node:
        if node not in scans:
            nodes.append(node)
            continue
        first = node.input[0]
        zero = fresh(f"{first}_batch_axis")
        shape, trips = fresh(f"{first}_shape"), fresh(f"{node.name or 'Scan'}_batch")
        nodes += [helper.make_node("Constant", [], [zero], value=numpy_helper.from_array(np.array(0, np.int64))),
                  helper.make_node("Shape", [first], [shape]),
                  helper.make_node("Gather", [shape, zero], [trips], axis=0)]
        i, cond, cond_out = fresh("batch_index"), fresh("batch_cond"), fresh("batch_cond_out")
        body = [helper.make_node("Identity", [cond], [cond_out])]
        one = []
        for x in node.input:
            one.append(fresh(f"{x}_one"))
            body.append(helper.make_node("Gather", [x, i], [one[-1]], axis=0))
        outs = [fresh(f"{y}_one") for y in node.output]
        scan = helper.make_node("Scan", one, outs, name=node.name)
        scan.attribute.extend(node.attribute)
        body.append(scan)
        graph = helper.make_graph(
            body, fresh(f"{node.name or 'Scan'}_per_batch_element"),
            [helper.make_tensor_value_info(i, onnx.TensorProto.INT64, []),
             helper.make_tensor_value_info(cond, onnx.TensorProto.BOOL, [])],
            [helper.make_tensor_value_info(cond_out, onnx.TensorProto.BOOL, [])]
            + [helper.make_empty_tensor_value_info(y) for y in outs])
        nodes.append(helper.make_node("Loop", [trips, ""], list(node.output),
                                      name=fresh(f"{node.name or 'Scan'}_over_batch"), body=graph))
    del g.node[:]
    g.node.extend(nodes)
    types = {vi.name: vi.type for vi in list(original.graph.input) + list(original.graph.output)
             + list(original.graph.value_info)}
    kept = [vi for vi in g.value_info if vi.name in types]        # the converter's own, unbatched, go
    del g.value_info[:]
    g.value_info.extend(kept)
    for vi in list(g.input) + list(g.output) + list(g.value_info):
        if vi.name in types:
            vi.type.CopyFrom(types[vi.name])
    return upgraded.edited(upgraded.proto)


def emitted_ir_version(model: onnx.ModelProto) -> int:
    """An IR version the installed runtime loads: no newer than it reads, no older than the opsets need."""
    need = helper.find_min_ir_version_for(list(model.opset_import), ignore_unknown=True)
    return max(min(model.ir_version, RUNTIME_MAX_IR), need)
