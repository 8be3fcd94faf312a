"""The SDK's cost per op, against torch eager on the same tiny tensors, in one run.

1. Recording: `c = a + b` on 1K-element float32 tensors (and a few other ops): what one op costs in Python when the
   SDK only records it (shape and dtype inference, naming, the instruction, the deltensor of the handle it replaces).
   The pending program is flushed outside the timing.
2. End to end: a loop of tiny ops (the same 1K-element tensors), recorded and run through the embedded daemon
   (sent as the pending program fills, then dx.sync()), per op; against the same loop in torch eager.

Prints the costs, ratios and aims (recording < torch's eager op; end-to-end rate >= half torch's); writes
bench/results/sdk.json. Best of N runs everywhere (recording and torch's eager op: the best chunk of 500 ops).

    python bench/sdk.py [--quick]
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
from deepxd.kernels.cpu import native as _native

# a benchmark times the steady state: a native kernel is compiled before the run that made it HOT returns (here
# and in any deepxd it starts)
os.environ["DEEPX_NATIVE_BACKGROUND"] = "0"
_native.set_background(False)

N_ELEM = 1024


def best(fn: Callable[[], object], repeat: int) -> float:
    out = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        out = min(out, time.perf_counter() - t0)
    return out


def chain(n: int, a, b) -> object:
    """n tiny ops, each making a new tensor from the last (the same code runs on deepx and torch tensors)."""
    c = a
    for i in range(n // 4):
        c = c + b
        c = c * 0.5
        c = c - a
        c = c.relu() if i % 2 else c * b
    return c


# per-op costs are timed in chunks of this many ops, best chunk of all (this box is shared: a chunk of a millisecond
# or two is often untouched by other work, a run of 10,000 ops seldom is); both sides are timed the same way
CHUNK = 500


def record_cost(n: int, repeat: int, make: Callable[[object, object], object]) -> float:
    """Seconds per op to record `make(a, b)` n times, the program sent outside the timing."""
    s = dx.connect(max_pending=4 * n + 64)  # room for ops that record several instructions
    a, b = dx.randn(N_ELEM), dx.randn(N_ELEM)
    dx.sync()
    t = float("inf")
    chunks = range(max(1, n // CHUNK))
    for _ in range(repeat):
        c = make(a, b)  # the handle the first timed op replaces exists, as in a loop
        for _ in chunks:
            t0 = time.perf_counter()
            for _ in range(CHUNK):
                c = make(a, b)
            t = min(t, time.perf_counter() - t0)
        del c
        dx.sync()
    assert len(s.pending) == 0
    dx.disconnect()
    return t / CHUNK


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer ops and repeats")
    opts = ap.parse_args()
    n = 2_000 if opts.quick else 10_000
    repeat = 3 if opts.quick else 7

    import torch

    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    a_np, b_np = (rng.standard_normal(N_ELEM, dtype=np.float32) for _ in range(2))
    ta, tb = torch.from_numpy(a_np), torch.from_numpy(b_np)

    # -- recording, against torch's eager op on the same tensors
    ops: dict[str, Callable[[object, object], object]] = {
        "add": lambda a, b: a + b,
        "mulscalar": lambda a, b: a * 0.5,
        "relu": lambda a, b: a.relu(),
        "sum(dim)": lambda a, b: a.reshape(32, 32).sum(0),
    }
    record_cost(n // 4, 1, ops["add"])  # warm, as torch is below: the first session's one-time work
    record = {name: record_cost(n, repeat, f) for name, f in ops.items()}

    def torch_loop(f: Callable[[object, object], object]) -> Callable[[], None]:
        def run() -> None:
            for _ in range(CHUNK):
                f(ta, tb)

        return run

    for f in ops.values():
        torch_loop(f)()  # warm
    eager = {name: best(torch_loop(f), repeat * max(1, n // CHUNK)) / CHUNK for name, f in ops.items()}

    # -- end to end through the embedded daemon, against the same loop in torch eager
    dx.disconnect()
    dx.connect()
    a, b = dx.tensor(a_np), dx.tensor(b_np)
    chain(400, a, b)
    dx.sync()  # warm: plans cached

    def deepx_chain() -> None:
        c = chain(n, a, b)
        dx.sync()
        del c

    t_e2e = best(deepx_chain, repeat) / n
    got = chain(64, a, b).numpy()
    want = chain(64, ta, tb).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    chain(400, ta, tb)
    t_torch_chain = best(lambda: chain(n, ta, tb), repeat) / n
    dx.disconnect()

    # -- report
    print(f"SDK, {N_ELEM}-element float32 tensors, {n} ops per run, best of {repeat}")
    print("recording one op (the program sent outside the timing), against torch eager on the same tensors")
    for name in ops:
        print(f"  {name:10s}: record {record[name] * 1e6:6.2f} us   torch eager {eager[name] * 1e6:6.2f} us   "
              f"record/torch {record[name] / eager[name]:5.2f}x")
    print(f"end to end, a loop of {n} tiny ops through the embedded daemon (record + run, then dx.sync())")
    print(f"  deepx       : {t_e2e * 1e6:7.2f} us/op  {1 / t_e2e:10,.0f} ops/s")
    print(f"  torch eager : {t_torch_chain * 1e6:7.2f} us/op  {1 / t_torch_chain:10,.0f} ops/s   "
          f"deepx rate / torch rate {t_torch_chain / t_e2e:5.2f}")
    rec_ok = record["add"] < eager["add"]
    e2e_ok = t_e2e <= 2 * t_torch_chain
    print(f"aims: recording c = a + b < torch's eager op ({record['add'] * 1e6:.2f} vs {eager['add'] * 1e6:.2f} us) "
          f"-> {'met' if rec_ok else 'NOT met'}; end-to-end rate >= half torch's "
          f"({t_torch_chain / t_e2e:.2f} of torch's) -> {'met' if e2e_ok else 'NOT met'}")

    out = Path(__file__).parent / "results" / "sdk.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({
        "meta": {"python": platform.python_version(), "cpus": os.cpu_count(), "n_ops": n, "repeat": repeat,
                 "elements": N_ELEM, "torch": torch.__version__},
        "record_s": record,
        "torch_eager_s": eager,
        "e2e_deepx_s_per_op": t_e2e,
        "e2e_torch_s_per_op": t_torch_chain,
        "aims": {"record_lt_torch": rec_ok, "e2e_rate_ge_half_torch": e2e_ok},
    }, indent=2))


if __name__ == "__main__":
    main()
