"""A benchmark run against the figures published before it, ratio by ratio, so that a regression shows.

The published figures are a benchmark's own ``--json`` file (``bench_step.py``'s, ``bench_families.py``'s):
``{"models": {model: {name: value, ...}}, ...}``, of which only the named ratios are compared. Every ratio here
is ours over a reference measured in the same run (onnxgrad's step over PyTorch eager's, over our own forward,
our peak memory over eager's), so larger is worse: a ratio more than ``tolerance`` (relative) above its
published value is flagged ``REGRESSION``. Ratios, not milliseconds: on a shared virtual machine the
milliseconds of one day and the next differ by more than a regression (PyTorch's own CNN step moved from 17.5
to 12.5 ms between two published tables), while both sides of a ratio, interleaved in one run, slow down
together. Nothing here asserts: the script prints the comparison and exits 0.
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

DEFAULT_TOLERANCE = 0.15
FLAG = "REGRESSION"
SETUP_KEYS = ("machine", "cores", "threads")     # a difference here changes the ratios themselves


@dataclass(frozen=True)
class RatioChange:
    """One ratio of one model: its published value and this run's (None where one side lacks it)."""
    model: str
    name: str
    published: float | None
    measured: float | None

    @property
    def change(self) -> float | None:
        """measured / published - 1 (0.2: 20% worse), or None when the two cannot be compared."""
        if self.published is None or self.measured is None or self.published <= 0:
            return None
        return self.measured / self.published - 1

    def regressed(self, tolerance: float) -> bool:
        return self.change is not None and self.change > tolerance


@dataclass(frozen=True)
class ModelComparison:
    """A model's ratios against the published ones; ``new``: the published file does not have the model."""
    model: str
    new: bool
    changes: tuple[RatioChange, ...]


def load(path: str) -> dict[str, Any]:
    """A benchmark's JSON: ``{"models": {...}}`` and whatever describes the run (date, machine, commit)."""
    with open(path) as f:
        figures = json.load(f)
    if not isinstance(figures, dict) or not isinstance(figures.get("models"), dict):
        raise ValueError(f"{path}: not a benchmark's figures (a JSON object with 'models'); "
                         f"write them with the benchmark's --json")
    return figures


def compare(measured: Mapping[str, Mapping[str, Any]], published: Mapping[str, Mapping[str, Any]],
            names: Sequence[str]) -> list[ModelComparison]:
    """Each model of ``measured`` (model -> {ratio name: value}) against ``published``, by the ratios ``names``."""
    comparisons = []
    for model, ratios in measured.items():
        before = published.get(model)
        changes = tuple(RatioChange(model, name, None if before is None else before.get(name), ratios.get(name))
                        for name in names)
        comparisons.append(ModelComparison(model, before is None, changes))
    return comparisons


def regressions(comparisons: Sequence[ModelComparison], tolerance: float) -> list[RatioChange]:
    return [c for m in comparisons for c in m.changes if c.regressed(tolerance)]


def report(comparisons: Sequence[ModelComparison], tolerance: float, source: str) -> list[str]:
    """The lines to print: what was compared with what, one line per model (a regressed model's line starts
    with ``!!`` and each regressed ratio says ``REGRESSION``), and a last line counting the regressed ratios."""
    lines = [f"against {source}: a ratio more than {tolerance:.0%} above its published value is a {FLAG}"]
    width = max([len(m.model) for m in comparisons] + [5])
    for m in comparisons:
        if m.new:
            lines.append(f"   {m.model:<{width}}  new: not in the published figures, nothing to compare")
            continue
        cells = " | ".join(_cell(c, tolerance) for c in m.changes)
        mark = "!!" if any(c.regressed(tolerance) for c in m.changes) else "  "
        lines.append(f"{mark} {m.model:<{width}}  {cells}")
    lines.append(_summary(comparisons, tolerance))
    return lines


def _cell(c: RatioChange, tolerance: float) -> str:
    if c.published is None and c.measured is None:
        return f"{c.name} not measured"
    if c.change is None:
        return f"{c.name} {_value(c.published)} -> {_value(c.measured)} (not compared)"
    flag = f" {FLAG}" if c.regressed(tolerance) else ""
    return f"{c.name} {c.published:.2f} -> {c.measured:.2f} {c.change:+.0%}{flag}"


def _value(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def _summary(comparisons: Sequence[ModelComparison], tolerance: float) -> str:
    compared = sum(c.change is not None for m in comparisons for c in m.changes)
    worse = regressions(comparisons, tolerance)
    if not worse:
        return f"no {FLAG}: none of {compared} ratios compared is more than {tolerance:.0%} above the published one"
    which = ", ".join(f"{c.model} {c.name} {c.change:+.0%}" for c in worse)
    return f"{FLAG}: {len(worse)} of {compared} ratios more than {tolerance:.0%} above the published ones ({which})"


def describe(info: Mapping[str, Any]) -> str:
    """A run's description in a few words: date, machine, cores, threads, commit."""
    parts = [str(info[k]) for k in ("date", "machine") if info.get(k)]
    parts += [f"{info[k]} {k}" for k in ("cores", "threads") if info.get(k) is not None]
    if info.get("commit"):
        parts.append(f"commit {info['commit'][:10]}{'+changes' if info.get('dirty') else ''}")
    return ", ".join(parts) or "no description of the run"


def setup_differences(measured: Mapping[str, Any], published: Mapping[str, Any]) -> list[str]:
    """What differs between two runs' setups in a way that moves the ratios themselves (machine, cores, threads)."""
    return [f"{k} {published.get(k)} then, {measured.get(k)} now" for k in SETUP_KEYS
            if published.get(k) != measured.get(k)]


def run_info(**extra: Any) -> dict[str, Any]:
    """What describes this run beside its figures: date, machine (``/proc/cpuinfo``'s model name), cores,
    Python, the checkout's commit and whether it has uncommitted changes, and ``extra`` (threads, versions)."""
    commit = _git("rev-parse", "HEAD")
    changes = _git("status", "--porcelain", "--untracked-files=no")
    return {"date": datetime.datetime.now().isoformat(timespec="seconds"), "machine": _cpu_model(),
            "cores": os.cpu_count(), "python": platform.python_version(), "commit": commit,
            "dirty": None if changes is None else bool(changes), **extra}


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=os.path.dirname(os.path.abspath(__file__)), capture_output=True,
                             text=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()
