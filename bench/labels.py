"""What the labels deepxctl shows cost the SDK (OWNER, PARAMETER, CALL SITE: deepx_sdk/labels.py), in one run.

1. A call site, taken by default for each parameter and each tensor made from data: one walk up the stack to the
   user's frame, and its line worked out (Recorder.made_here), per tensor made.
2. A training step (a small MLP, SGD, through the embedded daemon): label requests sent per step after the first
   (the aim: none), and the step's time with labels as they are.
3. DEEPX_CALLSITES=1, every tensor's call site: a loop of tiny ops end to end through the embedded daemon, per op,
   with the mode off and on; and its bookkeeping alone (Labels.made), per result, where every name changed line
   since the last flush (a loop's temporaries do, step to step).

    python bench/labels.py [--quick]

Writes bench/results/labels.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

import deepx_sdk as dx
from deepx_sdk import nn
from deepxd.kernels.cpu import native as _native

os.environ["DEEPX_NATIVE_BACKGROUND"] = "0"
_native.set_background(False)


def best(fn: Callable[[], object], repeat: int) -> float:
    out = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        out = min(out, time.perf_counter() - t0)
    return out


def user_code_makes(s: dx.Session, names: list[str]) -> None:
    """A frame of user code, a few SDK frames below it as where a layer makes its weights."""

    def layer_init(name: str) -> None:
        s.recorder.made_here(name)

    for name in names:
        layer_init(name)


def site_cost(repeat: int) -> float:
    """Seconds per call site taken (a new tensor each time: nothing remembered)."""
    s = dx.connect()
    n = 2_000
    t = min(best(lambda k=k: user_code_makes(s, [f"bench{k}_{i}" for i in range(n)]), 1) for k in range(repeat))
    s.labels.take()
    dx.disconnect()
    return t / n


def training_step(steps: int, repeat: int) -> tuple[float, list[int]]:
    """Seconds per step of a small MLP after warm-up, and the label requests counted after each step."""
    s = dx.connect()
    rng = np.random.default_rng(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))
    opt = dx.optim.SGD(model.parameters(), lr=0.01)
    x = dx.tensor(rng.standard_normal((32, 64), dtype=np.float32))
    target = dx.tensor(rng.integers(0, 10, 32))
    requests = []

    def step() -> None:
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), target)
        loss.backward()
        opt.step()
        loss.item()
        requests.append(s.labels.requests)

    for _ in range(5):
        step()
    t = best(lambda: [step() for _ in range(steps)], repeat) / steps
    dx.disconnect()
    return t, requests


def chain(n: int, a: dx.Tensor, b: dx.Tensor) -> dx.Tensor:
    c = a
    for i in range(n // 4):
        c = c + b
        c = c * 0.5
        c = c - a
        c = c.relu() if i % 2 else c * b
    return c


def tiny_ops(callsites: bool, n: int, repeat: int) -> float:
    """Seconds per tiny op, recorded and run through the embedded daemon, with DEEPX_CALLSITES on or off."""
    os.environ["DEEPX_CALLSITES"] = "1" if callsites else "0"
    s = dx.connect()
    assert s.labels.all_sites is callsites
    a, b = dx.randn(1024), dx.randn(1024)
    chain(400, a, b)
    dx.sync()

    def run() -> None:
        c = chain(n, a, b)
        dx.sync()
        del c

    t = best(run, repeat) / n
    dx.disconnect()
    os.environ.pop("DEEPX_CALLSITES")
    return t


def bookkeeping(repeat: int) -> float:
    """Seconds per result of Labels.made where each of 1,000 names changed line since the last flush."""
    from deepx_sdk.labels import Labels

    sites = {1: "a.py:1", 2: "a.py:2"}
    labels = Labels(sites.get, all_sites=True)
    taken = {f"x_{i}": i for i in range(1000)}
    lines = [[1 + (i + k) % 2 for i in range(1000)] for k in range(2)]
    t = float("inf")
    for r in range(repeat * 10):
        t0 = time.perf_counter()
        labels.made(taken, lines[r % 2])
        t = min(t, time.perf_counter() - t0)
        labels.take()
    return t / 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer ops and repeats")
    opts = ap.parse_args()
    n = 2_000 if opts.quick else 10_000
    repeat = 3 if opts.quick else 7

    site_s = site_cost(repeat)
    step_s, requests = training_step(20, repeat)
    after_first = requests[-1] - requests[0]
    tiny_ops(False, n, 1)  # warm: the kernels' first compiles
    off = on = float("inf")
    for _ in range(3):  # alternated: a busy machine slows both alike
        off, on = min(off, tiny_ops(False, n, repeat)), min(on, tiny_ops(True, n, repeat))
    per_result = bookkeeping(repeat)

    print(f"labels, best of {repeat}")
    print(f"  a call site (parameter, data): {site_s * 1e6:6.2f} us per tensor made")
    print(f"  MLP training step: {step_s * 1e3:6.3f} ms; label requests after the first step: {after_first} "
          f"-> {'met' if after_first == 0 else 'NOT met'} (aim: none)")
    print(f"  tiny ops end to end ({n} per run): DEEPX_CALLSITES=0 {off * 1e6:6.2f} us/op, "
          f"=1 {on * 1e6:6.2f} us/op ({(on / off - 1) * 100:+.0f}%); its bookkeeping alone "
          f"{per_result * 1e9:.0f} ns per result")

    out = Path(__file__).parent / "results" / "labels.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({
        "meta": {"python": platform.python_version(), "cpus": os.cpu_count(), "n_ops": n, "repeat": repeat},
        "call_site_s": site_s, "mlp_step_s": step_s, "label_requests_after_first_step": after_first,
        "tiny_op_s": {"callsites_off": off, "callsites_on": on}, "callsites_bookkeeping_s_per_result": per_result,
    }, indent=2))


if __name__ == "__main__":
    main()
