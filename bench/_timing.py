"""The timing helper the benchmarks share (a benchmark runs as a script of this folder, which puts the folder on
sys.path)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def median_ms(step: Callable[[], object], steps: int) -> float:
    """The median time of `steps` calls of `step`, in ms, after one untimed call (kernels, plans, known programs)."""
    step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3
