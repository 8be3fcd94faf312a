"""deepxIR text parsing: a typical line, and the adversarial lines of tests/ir/test_text.py (built to make a
backtracking parser blow up), which the test suite checks for answers and this times.

Prints microseconds per typical line (aim: a few; 200 is the ceiling for a slow machine) and the slowest adversarial
line (aim: under 0.5 s each); writes bench/results/parse.json.

    python bench/parse.py
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from deepx_core.errors import DeepxParseError  # noqa: E402
from deepx_core.ir import parse_line  # noqa: E402
from tests.ir.test_text import ADVERSARIAL_LINES, DOC_EXAMPLES  # noqa: E402


def main() -> None:
    line = DOC_EXAMPLES[4][0]
    n = 20000
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            parse_line(line)
        best = min(best, (time.perf_counter() - t0) / n)
    worst = 0.0
    for bad in ADVERSARIAL_LINES:
        t0 = time.perf_counter()
        try:
            parse_line(bad)
        except DeepxParseError:
            pass
        worst = max(worst, time.perf_counter() - t0)
    result = {"typical_line_us": best * 1e6, "worst_adversarial_s": worst}
    print(f"typical line: {best * 1e6:.1f} us (aim < 200)   slowest adversarial line: {worst * 1e3:.1f} ms "
          "(aim < 500)")
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "parse.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
