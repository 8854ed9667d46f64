"""Long run of the property test: python bench/property_run.py [COUNT] [FIRST_SEED] [--forward [--no-allow-unused]].

Random small graphs (tests/test_property.py), static and symbolic dims, each gradient checked
against float64 central differences and run in onnxruntime with default optimizations. Prints
every graph that is not 'ok' (refusals with their reason) and the tally. ``--forward``: jvp on the
forward-mode graphs instead (outputs no direction reaches, directions that reach no output);
``--no-allow-unused`` counts the graphs jvp's strict check refuses ('unused').
"""
from __future__ import annotations

import os
import sys
import time
from collections import Counter

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from test_property import run_one, run_one_forward  # noqa: E402


def main() -> int:
    flags = {a for a in sys.argv[1:] if a.startswith("--")}
    numbers = [int(a) for a in sys.argv[1:] if not a.startswith("--")]
    count = numbers[0] if numbers else 2000
    first = numbers[1] if len(numbers) > 1 else 0
    forward, allow_unused = "--forward" in flags, "--no-allow-unused" not in flags
    tally, reasons = Counter(), Counter()
    t0 = time.perf_counter()
    for seed in range(first, first + count):
        for symbolic in (False, True):
            try:
                kind, detail = (run_one_forward(seed, symbolic, allow_unused) if forward
                                else run_one(seed, symbolic))
            except Exception as e:          # a crash of the generator or the pass: reported, not hidden
                kind, detail = "crash", f"seed {seed} {symbolic}: {type(e).__name__}: {e}"
            tally[(kind, "symbolic" if symbolic else "static")] += 1
            if kind != "ok":
                print(f"{kind}: {detail}", flush=True)
                if kind == "refused":
                    reasons[detail.split("(", 2)[-1].split(")")[0] if "(" in detail else detail] += 1
    kinds = Counter()
    for (kind, _), k in tally.items():
        kinds[kind] += k
    print(f"{sum(tally.values())} {'jvp' if forward else 'gradient'} graphs in {time.perf_counter() - t0:.0f} s: "
          + ", ".join(f"{k} {v}" for k, v in sorted(kinds.items())))
    for dims in ("static", "symbolic"):
        print(f"  {dims}: " + ", ".join(f"{k} {v}" for (k, d), v in sorted(tally.items()) if d == dims))
    for reason, k in reasons.most_common():
        print(f"  refused x{k}: {reason}")
    return 0 if kinds["wrong"] == kinds["invalid"] == kinds["crash"] == kinds["unused"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
