"""Long run of the property test: python bench/property_run.py [COUNT] [FIRST_SEED].

Random small graphs (tests/test_property.py), static and symbolic dims, each gradient checked
against float64 central differences and run in onnxruntime with default optimizations. Prints
every graph that is not 'ok' (refusals with their reason) and the tally.
"""
from __future__ import annotations

import os
import sys
import time
from collections import Counter

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from test_property import run_one  # noqa: E402


def main() -> int:
    count = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
    first = int(sys.argv[2]) if len(sys.argv) > 2 else 0
    tally, reasons = Counter(), Counter()
    t0 = time.perf_counter()
    for seed in range(first, first + count):
        for symbolic in (False, True):
            try:
                kind, detail = run_one(seed, symbolic)
            except Exception as e:          # a crash of the generator or the pass: reported, not hidden
                kind, detail = "crash", f"seed {seed} {symbolic}: {type(e).__name__}: {e}"
            tally[kind] += 1
            if kind != "ok":
                print(f"{kind}: {detail}", flush=True)
                if kind == "refused":
                    reasons[detail.split("(", 2)[-1].split(")")[0] if "(" in detail else detail] += 1
    print(f"{sum(tally.values())} graphs in {time.perf_counter() - t0:.0f} s: " +
          ", ".join(f"{k} {v}" for k, v in sorted(tally.items())))
    for reason, k in reasons.most_common():
        print(f"  refused x{k}: {reason}")
    return 0 if tally["wrong"] == tally["invalid"] == tally["crash"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
