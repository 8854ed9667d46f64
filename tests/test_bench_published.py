"""bench/published.py: a benchmark run's ratios against the published ones flag a regression past the tolerance
and nothing else. Figures are built here; nothing is timed."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import published  # noqa: E402

RATIOS = ("step/eager", "step/compile")
PUBLISHED = {"mlp": {"step/eager": 0.50, "step/compile": 0.50, "step_ms": 2.6},
             "cnn": {"step/eager": 0.90, "step/compile": 0.60, "step_ms": 11.4}}


def _flagged(measured: dict, tolerance: float = 0.15) -> set[tuple[str, str]]:
    comparisons = published.compare(measured, PUBLISHED, RATIOS)
    return {(c.model, c.name) for c in published.regressions(comparisons, tolerance)}


def test_a_ratio_20_percent_worse_is_flagged():
    measured = {"mlp": {"step/eager": 0.60, "step/compile": 0.50}, "cnn": {"step/eager": 0.90, "step/compile": 0.60}}
    assert _flagged(measured) == {("mlp", "step/eager")}


def test_a_ratio_10_percent_worse_or_better_is_not_flagged():
    measured = {"mlp": {"step/eager": 0.55, "step/compile": 0.40}, "cnn": {"step/eager": 0.50, "step/compile": 0.66}}
    assert _flagged(measured) == set()


def test_the_tolerance_is_the_threshold():
    measured = {"cnn": {"step/eager": 0.99, "step/compile": 0.60}}     # 10% worse
    assert _flagged(measured, tolerance=0.05) == {("cnn", "step/eager")}
    assert _flagged(measured, tolerance=0.15) == set()


def test_milliseconds_are_not_compared():
    """Only the named ratios count: a slower day with the same ratios is no regression."""
    measured = {"cnn": {"step/eager": 0.90, "step/compile": 0.60, "step_ms": 30.0}}
    assert _flagged(measured) == set()


def test_a_model_not_published_is_new():
    measured = {"resnet18": {"step/eager": 5.0, "step/compile": 5.0}, "mlp": {"step/eager": 0.5, "step/compile": 0.5}}
    comparisons = published.compare(measured, PUBLISHED, RATIOS)
    assert [(m.model, m.new) for m in comparisons] == [("resnet18", True), ("mlp", False)]
    assert published.regressions(comparisons, 0.15) == []
    lines = published.report(comparisons, 0.15, "published.json")
    assert "resnet18" in lines[1] and "new" in lines[1]


def test_a_ratio_one_side_lacks_is_not_compared():
    """A run without torch.compile (--no-compile) has no step/compile: shown, not compared, not flagged."""
    measured = {"cnn": {"step/eager": 0.90}}
    comparisons = published.compare(measured, PUBLISHED, RATIOS)
    assert published.regressions(comparisons, 0.15) == []
    assert "step/compile 0.60 -> - (not compared)" in published.report(comparisons, 0.15, "x")[1]


def test_the_report_flags_the_regressed_ratio_and_counts_it():
    measured = {"mlp": {"step/eager": 0.50, "step/compile": 0.50}, "cnn": {"step/eager": 1.30, "step/compile": 0.60}}
    lines = published.report(published.compare(measured, PUBLISHED, RATIOS), 0.15, "published.json")
    mlp, cnn = lines[1], lines[2]
    assert not mlp.startswith("!!") and "REGRESSION" not in mlp
    assert cnn.startswith("!!") and "step/eager 0.90 -> 1.30 +44% REGRESSION" in cnn
    assert "REGRESSION" not in cnn.split("|")[1]        # step/compile, unchanged
    assert lines[-1].startswith("REGRESSION: 1 of 4 ratios") and "cnn step/eager +44%" in lines[-1]


def test_the_report_of_no_regression_says_so():
    measured = {"mlp": {"step/eager": 0.45, "step/compile": 0.50}}
    lines = published.report(published.compare(measured, PUBLISHED, RATIOS), 0.15, "published.json")
    assert not any("!!" in line for line in lines)
    assert lines[-1].startswith("no REGRESSION: none of 2 ratios")


def test_depthwise_figures_compare_by_their_ratio_key(tmp_path):
    """bench_families.py's --json: {"threads", "rounds", "reps", "models": {model: {"ratio", ...}}}."""
    figures = {"threads": 2, "rounds": 2, "reps": 10,
               "models": {"mobilenet_v2": {"onnxgrad_ms": 13.9, "eager_ms": 17.7, "ratio": 0.78, "export_s": 9.0,
                                           "session_s": 2.0}}}
    path = tmp_path / "depthwise.json"
    path.write_text(json.dumps(figures))
    before = published.load(str(path))["models"]
    measured = {"mobilenet_v2": {"onnxgrad_ms": 21.3, "eager_ms": 13.3, "ratio": 1.61}}
    comparisons = published.compare(measured, before, ["ratio"])
    assert [(c.model, c.name) for c in published.regressions(comparisons, 0.15)] == [("mobilenet_v2", "ratio")]


def test_a_file_without_models_is_refused(tmp_path):
    path = tmp_path / "old.json"
    path.write_text(json.dumps([{"model": "mlp", "ms": {}}]))       # bench_step.py's --json before it had models
    with pytest.raises(ValueError, match="not a benchmark's figures"):
        published.load(str(path))


def test_a_different_setup_is_named():
    then = {"machine": "AMD EPYC", "cores": 2, "threads": 2}
    assert published.setup_differences(then, then) == []
    assert published.setup_differences({**then, "threads": 4}, then) == ["threads 2 then, 4 now"]
