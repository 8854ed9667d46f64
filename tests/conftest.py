"""Test selection: the slow suites carry the ``slow`` marker, so the inner loop (the rule tables and the
API) runs alone with ``python -m pytest -q -n 2 -m "not slow"``; CI runs everything."""
import pytest

# whole modules: onnx's backend node cases, exported models and training trajectories against PyTorch,
# big models with external data, random graphs, Netron and command-line subprocesses, shared case tables
# run through forward mode, parameter policy on every exported model, data-parallel worker processes
SLOW_MODULES = {
    "test_backend_cases",
    "test_big_models",
    "test_cli",
    "test_cli_errors",
    "test_distributed",
    "test_forward_shared_cases",
    "test_models",
    "test_netron",
    "test_parameters",
    "test_property",
    "test_training",
}

# tests, by name, inside the fast modules: second order (grad of grad), comparisons with PyTorch, the
# recurrent ops' extra configurations (their float64 truth runs in onnx.reference), the grouped view
SLOW_TESTS = ("second_order", "gradient_of_gradient", "matches_torch", "runtime_shapes", "initial_state_gradient",
              "model_without_Y", "some_outputs", "grouped_view")


def pytest_ignore_collect(collection_path, config):
    """Under ``-m "not slow"`` the slow modules are not even imported (onnx's backend cases load at import)."""
    if config.getoption("markexpr", "").replace(" ", "") == "notslow" and collection_path.stem in SLOW_MODULES:
        return True
    return None


# the heaviest rule tables: in the inner loop, each test runs the first case of each op (every rule keeps a
# case there); the op's other cases (attributes, opsets, dynamic shapes) run with the slow suites
HEAVY_TABLES = {"test_rules_sampling", "test_rules_nn", "test_rules_recurrent", "test_rules_shape",
                "test_rules_reduce", "test_rules_attention"}


def _later_case_of_its_op(item, seen: set) -> bool:
    case = getattr(getattr(item, "callspec", None), "params", {}).get("case")
    if item.module.__name__ not in HEAVY_TABLES or not hasattr(case, "op"):
        return False
    key = (item.module.__name__, item.originalname, case.op)
    if key in seen:
        return True
    seen.add(key)
    return False


def pytest_collection_modifyitems(config, items):
    seen: set = set()
    for item in items:
        if (item.module.__name__ in SLOW_MODULES or any(s in item.originalname for s in SLOW_TESTS)
                or _later_case_of_its_op(item, seen)):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(autouse=True)
def _per_test_data(request):
    """Data drawn inside a test comes from a generator seeded from the test's id (harness.rng); the runtimes
    that ran the harness's gradient graphs go with the test's report (and through xdist) to the summary."""
    import harness

    start = len(harness.RUNS)
    with harness.seeded(f"{request.node.module.__name__}::{request.node.name}"):
        yield
    for run in harness.RUNS[start:]:
        request.node.user_properties.append(("gradient_runtime", run))


def pytest_terminal_summary(terminalreporter):
    """Which runtime evaluated the harness's gradient graphs: onnxruntime, or onnx.reference with the reason
    declared (a case's ``reference``, or the element type's kernels)."""
    runs = [value for reports in terminalreporter.stats.values() for r in reports
            if getattr(r, "when", None) == "teardown"
            for key, value in getattr(r, "user_properties", ()) if key == "gradient_runtime"]
    if not runs:
        return
    write = terminalreporter.write_line
    in_ort = sum(r[1] == "onnxruntime" for r in runs)
    write(f"harness gradient graphs: {len(runs)} checked; float32 run in onnxruntime: {in_ort}; "
          f"float64 run in onnxruntime: {sum(r[2] == 'onnxruntime' for r in runs)}")
    by_reason: dict[str, list[str]] = {}
    for name, g32, g64, reason in runs:
        if "reference" in (g32, g64):
            by_reason.setdefault(f"{'float32+float64' if g32 == 'reference' else 'float64'}: {reason}",
                                 []).append(name)
    for reason, names in sorted(by_reason.items(), key=lambda kv: -len(kv[1])):
        shown = ", ".join(sorted(set(names))[:6]) + (", ..." if len(set(names)) > 6 else "")
        write(f"  in onnx.reference, {len(names)} x {reason} ({shown})")
