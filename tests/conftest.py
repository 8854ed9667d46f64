"""Test selection: the slow suites carry the ``slow`` marker, so the inner loop (the rule tables and the
API) runs alone with ``python -m pytest -q -n 2 -m "not slow"``; CI runs everything."""
import pytest

# whole modules: onnx's backend node cases, exported models and training trajectories against PyTorch,
# big models with external data, random graphs, Netron and command-line subprocesses, shared case tables
# run through forward mode, parameter policy on every exported model
SLOW_MODULES = {
    "test_backend_cases",
    "test_big_models",
    "test_cli",
    "test_cli_errors",
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


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.module.__name__ in SLOW_MODULES or any(s in item.originalname for s in SLOW_TESTS):
            item.add_marker(pytest.mark.slow)
