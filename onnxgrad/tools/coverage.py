"""Rule coverage of every ai.onnx operator: what ``python -m onnxgrad ops`` prints."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import onnx.defs

from ..errors import OnnxGradError
from ..ir.load import MIN_OPSET
from ..passes.function_body import has_function_body
from ..rules.registry import DIFFERENTIABLE, NON_DIFFERENTIABLE, all_rules
from ..runtime import onnxruntime

_TAG = {DIFFERENTIABLE: "D", NON_DIFFERENTIABLE: "N"}

# Ops with a float input and no rule: why none (printed by ``ops``). Control flow is being built separately.
NO_RULE_WHY = {
    "QuantizeLinear": "integer (or float8) result of a rounding: piecewise constant",
    "QLinearConv": "integer result of a rounding: piecewise constant in its float scales",
    "QLinearMatMul": "integer result of a rounding: piecewise constant in its float scales",
    "NonMaxSuppression": "integer indices of the kept boxes",
    "BitCast": "reinterprets the bits: no derivative",
    "Unique": "X tagged NonDifferentiable; the outputs' sizes change at ties (PyTorch's unique has no "
              "derivative either)",
    "TfIdfVectorizer": "counts of integer or string n-grams",
    "If": "control flow (a rule is being written separately)",
    "Loop": "control flow (a rule is being written separately)",
    "Scan": "control flow (a rule is being written separately)",
    "SequenceMap": "control flow: a body graph per element (as Loop)",
    "SequenceEmpty": "no inputs",
    "SequenceLength": "integer result",
    "OptionalHasElement": "boolean result",
    "Scatter": "deprecated: onnxgrad.ir.load.load upgrades it to ScatterElements, which has a rule",
    "Upsample": "deprecated: onnxgrad.ir.load.load upgrades it to Resize, which has a rule",
}
_BEYOND = "N+"   # tagged NonDifferentiable, differentiated as PyTorch does (the rule's beyond_tags)

# Ops that onnx.reference and onnxruntime compute differently somewhere: the reading the rule follows (PyTorch's,
# the reference for semantics), printed by ``ops``; the numeric checks' float64 truth follows it too
# (onnxgrad.tools.check.kernels corrects onnx.reference's kernel).
READINGS = {
    "MaxUnpool": "with output_shape, I indexes the output_shape tensor, as onnxruntime and PyTorch's max_unpool "
                 "(output_size) read it; onnx.reference reads I in the default shape and pastes that block at "
                 "the origin",
    "Resize": "align_corners with scales maps the corners of the floor(scale * in) outputs made, as onnxruntime "
              "and PyTorch's interpolate do; onnx.reference divides by the unrounded scale * in - 1",
}


@dataclass
class OpCoverage:
    op_type: str
    tags: str                    # e.g. "data:D shape:N"; "untagged" when the schema says nothing
    status: str                  # rule | function body | zero-derivative | not differentiable | missing | deprecated
    opsets: list[int]            # schema versions in effect from opset 13 on
    tagged_differentiable: bool
    flags: list[str] = field(default_factory=list)
    beyond_tags: list[str] = field(default_factory=list)   # inputs tagged N that the rule differentiates
    cases_passed: int = 0
    cases_checked: int = 0
    cases_declined: int = 0


def _versions(op_type: str) -> list[int]:
    latest = onnx.defs.onnx_opset_version()
    seen = []
    for v in range(MIN_OPSET, latest + 1):
        try:
            s = onnx.defs.get_schema(op_type, v, "")
        except onnx.defs.SchemaError:
            continue
        if s.since_version not in seen:
            seen.append(s.since_version)
    return seen


def _float_params(schema: onnx.defs.OpSchema, params) -> bool:
    """Whether some of these formal inputs/outputs can hold float tensors (also inside sequences, optionals)."""
    allowed = {c.type_param_str: c.allowed_type_strs for c in schema.type_constraints}
    for p in params:
        types = allowed.get(p.type_str, [p.type_str])
        if any(f"tensor({f}" in t for t in types for f in ("float)", "double)", "float16)")):
            return True
    return False


def coverage() -> list[OpCoverage]:
    """One row per ai.onnx op (newest schema), with our rule status and any disagreement with the tags."""
    rules = all_rules()
    schemas = {}
    for s in onnx.defs.get_all_schemas():
        if s.domain == "":
            schemas[s.name] = s
    rows = []
    for op in sorted(schemas):
        s = schemas[op]
        cats = [p.differentiation_category for p in s.inputs]
        untagged = all(c not in _TAG for c in cats)
        rule = rules.get(op)
        beyond = [] if rule is None or rule.stop else [
            i for i in rule.beyond_tags if i < len(cats) and cats[i] == NON_DIFFERENTIABLE]
        tags = "untagged" if untagged or not cats else " ".join(
            f"{p.name}:{_BEYOND if i in beyond else _TAG.get(p.differentiation_category, '?')}"
            for i, p in enumerate(s.inputs))
        diff = [i for i, c in enumerate(cats) if c == DIFFERENTIABLE]
        flags = []
        if rule is None and s.deprecated:
            status = "deprecated"
        elif rule is None and has_function_body(s):
            status = "function body"        # differentiated through its ONNX function body
        elif rule is None:
            if diff or (untagged and _float_params(s, s.inputs) and _float_params(s, s.outputs)):
                status = "missing"
            else:
                status = "not differentiable"
        elif rule.stop:
            status = "zero-derivative"
            if diff:
                flags.append(f"tagged Differentiable, stopped: {rule.doc}")
        else:
            status = "rule"
            if rule.inputs is not None and not untagged:
                extra = [i for i in rule.inputs if i < len(cats) and cats[i] == NON_DIFFERENTIABLE
                         and i not in beyond]
                if extra:
                    flags.append(f"rule differentiates NonDifferentiable inputs {extra}")
            stray = [i for i in rule.beyond_tags if i not in beyond]
            if stray:
                flags.append(f"beyond_tags {stray} are not inputs tagged NonDifferentiable")
            if rule.inputs is not None and not untagged:
                lacking = [i for i in diff if i not in rule.inputs]
                if lacking:
                    flags.append(f"rule leaves Differentiable inputs {lacking} without gradient")
        rows.append(OpCoverage(op, tags, status, _versions(op), bool(diff), flags,
                               [s.inputs[i].name for i in beyond]))
    return rows


def _quietly(run, cases):
    """run(case) for each case, with a progress bar on a terminal, and nothing else on stderr: the cases
    probe onnxruntime and numpy on purpose (errors, NaNs), and their logs and warnings are not news."""
    import sys
    import warnings

    import numpy as np

    ort = onnxruntime("the coverage report")

    progress = cases
    if sys.stderr.isatty():
        try:
            from tqdm import tqdm

            progress = tqdm(cases, desc="backend cases", unit="case", leave=False)
        except ImportError:
            pass
    ort.set_default_logger_severity(4)
    try:
        with warnings.catch_warnings(), np.errstate(all="ignore"):
            warnings.simplefilter("ignore")
            for case in progress:
                yield run(case)
    finally:
        ort.set_default_logger_severity(2)


# onnx's backend node cases run through the test harness's tests/backend_cases.py: test support, which the
# installed package does not ship; ``ops --cases`` finds it in a source checkout (an editable install).
BACKEND_CASES = Path(__file__).resolve().parents[2] / "tests" / "backend_cases.py"   # onnxgrad/tools/ -> the checkout


def backend_cases():
    """The test harness's backend-case module (``ops --cases``), or a clear error where it is not there."""
    import importlib.util
    import sys

    if "backend_cases" in sys.modules:          # under pytest, tests/ is on the path
        return sys.modules["backend_cases"]
    if not BACKEND_CASES.is_file():
        raise OnnxGradError(f"'ops --cases' runs onnx's backend node cases through the test harness "
                            f"({BACKEND_CASES.parent.name}/{BACKEND_CASES.name}), which the installed package does "
                            "not ship: run it from a source checkout (pip install -e .); 'ops' alone needs nothing")
    spec = importlib.util.spec_from_file_location("backend_cases", BACKEND_CASES)
    module = importlib.util.module_from_spec(spec)
    sys.modules["backend_cases"] = module
    spec.loader.exec_module(module)
    return module


def print_table(run_cases: bool = False) -> int:
    rows = coverage()
    if run_cases:
        cases_module = backend_cases()
        by_op = {r.op_type: r for r in rows}
        cases = [c for c in cases_module.all_cases()
                 if by_op.get(c.op_type) is not None and by_op[c.op_type].status == "rule"]
        for case, outcome in zip(cases, _quietly(cases_module.run_case, cases)):
            row = by_op[case.op_type]
            if outcome.status == "skip":
                continue
            if outcome.status == "declined":
                row.cases_declined += 1
                continue
            row.cases_checked += 1
            row.cases_passed += outcome.status == "pass"
    width = max(len(r.op_type) for r in rows)
    print(f"{'op':<{width}}  {'status':<18}  {'opsets':<14}  {'cases':>7}  tags")
    print(f"{'':<{width}}  {'':<18}  {'':<14}  {'':>7}  (D Differentiable, N NonDifferentiable, "
          f"{_BEYOND} NonDifferentiable but given PyTorch's gradient)")
    for r in rows:
        cases = f"{r.cases_passed}/{r.cases_checked}" if run_cases and r.status == "rule" else "-"
        if r.cases_declined:
            cases += f" ({r.cases_declined} declined)"
        opsets = ",".join(map(str, r.opsets)) or "-"
        line = f"{r.op_type:<{width}}  {r.status:<18}  {opsets:<14}  {cases:>7}  {r.tags}"
        for f in r.flags:
            line += f"  [!] {f}"
        if r.status == "rule" and r.op_type in READINGS:
            line += f"  (reads: {READINGS[r.op_type]})"
        if r.status in ("missing", "not differentiable", "deprecated") and r.op_type in NO_RULE_WHY:
            line += f"  ({NO_RULE_WHY[r.op_type]})"
        print(line)
    counts = Counter(r.status for r in rows)
    tagged = [r for r in rows if r.tagged_differentiable]
    covered = sum(r.status == "rule" for r in tagged)
    print()
    print(f"ai.onnx ops: {len(rows)}; " + ", ".join(f"{k}: {v}" for k, v in sorted(counts.items())))
    print(f"ops with a Differentiable input: {len(tagged)}, with a rule: {covered}, "
          f"zero-derivative: {sum(r.status == 'zero-derivative' for r in tagged)}, "
          f"missing: {sum(r.status == 'missing' for r in tagged)}")
    via_body = [r.op_type for r in rows if r.status == "function body"]
    print(f"ops without a rule covered through their ONNX function body: {len(via_body)} ({', '.join(via_body)})")
    untagged_rules = [r.op_type for r in rows if r.tags == "untagged" and r.status == "rule"]
    print(f"untagged ops with a rule: {len(untagged_rules)} ({', '.join(untagged_rules)})")
    beyond = [r for r in rows if r.beyond_tags]
    print(f"inputs tagged NonDifferentiable that get PyTorch's gradient ({_BEYOND}; strict tag-following "
          f"drops them): {sum(len(r.beyond_tags) for r in beyond)} in {len(beyond)} ops ("
          + "; ".join(f"{r.op_type}: {', '.join(r.beyond_tags)}" for r in beyond) + ")")
    if run_cases:
        checked = sum(r.cases_checked for r in rows)
        passed = sum(r.cases_passed for r in rows)
        declined = sum(r.cases_declined for r in rows)
        print(f"backend cases checked: {checked}, passed: {passed}; declined by a rule (with its reason): {declined}")
    flagged = [r for r in rows if r.flags]
    print(f"rules disagreeing with the schema tags: {len(flagged)}")
    return 0
