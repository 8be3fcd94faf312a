"""A training step whose batches are distinct tensors held up front (a list of batches, or a prefetching loader's
heap tensors) against the same step with a fresh `dx.tensor` per step: the MLP of issue 25 item 7 (64-128-64-10,
Adam, batch 64) on the embedded daemon's op-cpu. Each step's program differs from the last only in its inputs'
names; it prints ms/step for both loops, their ratio, and the scheduler's plan and backward counts per step.

    python bench/held_batches.py [--steps 100] [--rounds 3] [--roles heapmem,op-cpu]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import numpy as np


def _loop(dx: Any, s: Any, held: bool, steps: int, batches: int, seed: int = 0) -> tuple[float, dict[str, float]]:
    import deepx_sdk.nn as nn
    import deepx_sdk.nn.functional as F
    from deepx_sdk.optim import Adam

    rng = np.random.default_rng(seed)
    data = [(rng.standard_normal((64, 64)).astype(np.float32), rng.integers(0, 10, 64)) for _ in range(batches)]
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 10))
    opt = Adam(model.parameters(), lr=1e-3)
    kept = [(dx.tensor(x), dx.tensor(y)) for x, y in data] if held else None

    def step(k: int) -> float:
        x, y = kept[k % batches] if kept is not None else (dx.tensor(data[k % batches][0]),
                                                            dx.tensor(data[k % batches][1]))
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return float(loss.item())

    for k in range(20):
        step(k)
    sched = s.transport.node.ref("scheduler")._actor
    before = dict(sched.on_stats())
    t0 = time.perf_counter()
    for k in range(20, 20 + steps):
        step(k)
    ms = 1e3 * (time.perf_counter() - t0) / steps
    after = sched.on_stats()
    per = {k: (after[k] - before.get(k, 0)) / steps for k in ("plan_hits", "plan_misses", "backward_hits",
                                                               "backward_misses", "renamed") if k in after}
    return ms, per


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batches", type=int, default=200)
    ap.add_argument("--roles", default="heapmem,op-cpu", help="the embedded daemon's roles")
    opts = ap.parse_args()
    import deepx_sdk as dx

    s = dx.connect(roles=opts.roles.split(","))
    times: dict[bool, list[float]] = {True: [], False: []}
    counts: dict[bool, dict[str, float]] = {}
    for _ in range(opts.rounds):
        for held in (False, True):
            ms, counts[held] = _loop(dx, s, held, opts.steps, opts.batches)
            times[held].append(ms)
    for held in (False, True):
        print(f"{'held' if held else 'fresh'}: {statistics.median(times[held]):.2f} ms/step "
              f"(rounds {', '.join(f'{t:.2f}' for t in times[held])}); per step {counts[held]}")
    print(f"held/fresh {statistics.median(times[True]) / statistics.median(times[False]):.2f}x")


if __name__ == "__main__":
    main()
