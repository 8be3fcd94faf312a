"""What the benchmarks of deepx's ops against torch share (a benchmark runs as a script of this folder, which puts
the folder on sys.path)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any


def median_ms(step: Callable[[], object], steps: int, clock: Callable[[], float] = time.perf_counter) -> float:
    """The median time of `steps` calls of `step`, in ms, after one untimed call (kernels, plans, known programs).
    clock: wall time, or time.process_time for the process's CPU time (steadier on a shared machine)."""
    step()
    times = []
    for _ in range(steps):
        t0 = clock()
        step()
        times.append(clock() - t0)
    return statistics.median(times) * 1e3


def deepx_then_torch(cuda: bool) -> tuple[Any, Any, str]:
    """deepx's embedded daemon (with op-cuda where `cuda`), then torch: torch's OpenMP runtime must not come first
    (MKL). Returns deepx_sdk, torch and torch's device."""
    import deepx_sdk as dx

    if cuda:
        dx.connect(roles=["heapmem", "op-cuda"])
    dx.session()
    import torch

    return dx, torch, "cuda" if cuda else "cpu"
