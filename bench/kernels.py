"""Kernel-layer cost against numpy called directly, in one run.

For float32 add, mul, exp, sum at 1K and 16M elements and matmul at 1024 and 2048, three timings per case:
  numpy    numpy called directly on preallocated arrays (np.add(a, b, out=c)): the floor
  kernel   the deepx CPU kernel (deepxd.kernels.cpu.<family>.<op>) on the same arrays
  run      CpuExecutor.run(instr): check the instruction against the catalogue, resolve names, then the kernel
Prints ratios (time / numpy time) and, at 1K, the microseconds above numpy; writes bench/results/kernels.json.
Then, where MKL runs matmul, skinny products (one dimension of a few: native.SKINNY's loops, or blas.NARROW's
transpose) against MKL on the product as it is and torch; and erf, gelu (exact and tanh) and gelu's gradient
(float32 and float64, 262K and 16M elements) against torch.special.erf, torch.nn.functional.gelu and
torch.ops.aten.gelu_backward, when torch is installed: kernel time / torch time.

    python bench/kernels.py [--quick] [--gelu]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import numpy as np

from deepx_core.ir import Instr, Param
from deepxd.kernels.cpu import KERNELS, CpuExecutor
from deepxd.kernels.cpu import native as _native

# a benchmark times the steady state: a native kernel is compiled before the run that made it HOT returns (here
# and in any deepxd it starts)
os.environ["DEEPX_NATIVE_BACKGROUND"] = "0"
_native.set_background(False)


def best_time(fn, number: int, repeat: int) -> float:
    """Seconds per call, the best mean over `repeat` batches of `number` calls."""
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(number):
            fn()
        best = min(best, (time.perf_counter() - t0) / number)
    return best


def cases(quick: bool):
    big = 1 << 22 if quick else 1 << 24
    for n, label in ((1024, "1K"), (big, "4M" if quick else "16M")):
        yield f"add {label}", "add", [(n,), (n,)], lambda a, b, c: np.add(a, b, out=c), ()
        yield f"mul {label}", "mul", [(n,), (n,)], lambda a, b, c: np.multiply(a, b, out=c), ()
        yield f"exp {label}", "exp", [(n,)], lambda a, c: np.exp(a, out=c), ()
        yield f"sum {label}", "sum", [(n,)], lambda a, c: np.sum(a, axis=(0,), out=c), ((0,), False)
    for n in (512, 1024) if quick else (1024, 2048):
        yield f"matmul {n}", "matmul", [(n, n), (n, n)], lambda a, b, c: np.matmul(a, b, out=c), ()


def erf_gelu_vs_torch(quick: bool) -> list[dict]:
    """erf, exact gelu, its tanh form and gelu's gradient (both forms) against torch's (its own threads) on the same
    arrays, float32 and float64."""
    _native._core()  # built (with MKL's OpenMP where MKL runs) before torch brings its own OpenMP runtime
    try:
        import torch
    except ImportError:
        print("erf/gelu against torch: torch is not installed")
        return []
    rng = np.random.default_rng(0)
    rows = []
    for dtype in (np.float32, np.float64):
        for n, label in ((1 << 18, "262K"), (1 << 22 if quick else 1 << 24, "4M" if quick else "16M")):
            a = (rng.standard_normal(n) * 2).astype(dtype)
            g = rng.standard_normal(n).astype(dtype)
            out = np.empty_like(a)
            ta, tg = torch.from_numpy(a), torch.from_numpy(g)
            number, repeat = (1, 2) if quick else ((20, 5) if n < 1 << 20 else (2, 3))
            for name, kernel, ref in (
                ("erf", lambda: KERNELS["erf"](a, out), lambda: torch.special.erf(ta)),
                ("gelu", lambda: KERNELS["gelu"](a, "none", out), lambda: torch.nn.functional.gelu(ta)),
                ("gelu tanh", lambda: KERNELS["gelu"](a, "tanh", out),
                 lambda: torch.nn.functional.gelu(ta, approximate="tanh")),
                ("gelu grad", lambda: KERNELS["gelugrad"](a, g, "none", out),
                 lambda: torch.ops.aten.gelu_backward(tg, ta)),
                ("gelu tanh grad", lambda: KERNELS["gelugrad"](a, g, "tanh", out),
                 lambda: torch.ops.aten.gelu_backward(tg, ta, approximate="tanh")),
            ):
                t_k = best_time(kernel, number, repeat)
                t_t = best_time(ref, number, repeat)
                # torch computes 1 + erf(x/sqrt 2) (and 1 + tanh) in float32: its negative tail is 1e-3 off, ours not
                np.testing.assert_allclose(out, ref().numpy(), rtol=1e-5, atol=1e-5)
                rows.append({"case": f"{name} {np.dtype(dtype).name} {label}", "kernel_us": t_k * 1e6,
                             "torch_us": t_t * 1e6, "ratio": t_k / t_t})
    print(f"{'case':<28}{'kernel us':>12}{'torch us':>12}{'kernel/torch':>14}"
          f"   (torch threads: {torch.get_num_threads()})")
    for r in rows:
        print(f"{r['case']:<28}{r['kernel_us']:>12.1f}{r['torch_us']:>12.1f}{r['ratio']:>14.2f}")
    worst = max(rows, key=lambda r: r["ratio"])
    print(f"aim: every case at most 1.5x torch's time -> {'met' if worst['ratio'] <= 1.5 else 'NOT met'} "
          f"(worst: {worst['case']}, {worst['ratio']:.2f}x)")
    return rows


def skinny_matmul(quick: bool) -> list[dict]:
    """Products with one dimension of a few (a classifier's logits, x @ W.T with W 10 x k, and their two gradients):
    blas.gemm hands them to the native skinny loops (native.SKINNY) or makes them as their transpose
    (blas.NARROW) where MKL runs matmul; against MKL called on the product as it is, and torch's matmul."""
    from deepxd.kernels.cpu import blas, native

    if blas.mkl() is None:
        print(f"skinny matmul: matmul runs on {blas.describe()}, which takes it as it is")
        return []
    native._core()  # built before the timing
    rng = np.random.default_rng(0)
    rows = []
    number, repeat = (20, 3) if quick else (200, 5)
    # (m, k, n, transposed a, transposed b): the MLP's 256 x 512 -> 10 layer forward, its input's gradient and its
    # weight's gradient; then wider, deeper and narrower ones
    for m, k, n, ta, tb in ((256, 512, 10, False, True), (256, 10, 512, False, False), (10, 256, 512, True, False),
                            (1024, 512, 10, False, True), (256, 2048, 5, False, True), (4096, 256, 12, False, True),
                            (4096, 4, 1024, False, False), (8, 1024, 2048, True, False)):
        a = rng.standard_normal((k, m) if ta else (m, k), dtype=np.float32)
        b = rng.standard_normal((n, k) if tb else (k, n), dtype=np.float32)
        a, b = (a.T if ta else a), (b.T if tb else b)
        out = np.empty((m, n), np.float32)
        as_is = np.empty((m, n), np.float32)
        t_t = best_time(lambda: blas.gemm(a, b, out), number, repeat)
        narrow, blas.NARROW = blas.NARROW, (0, -1)  # off: the product as it is, on MKL
        skinny, native.SKINNY = native.SKINNY, (0, -1)
        try:
            t_d = best_time(lambda: blas.gemm(a, b, as_is), number, repeat)
        finally:
            blas.NARROW, native.SKINNY = narrow, skinny
        np.testing.assert_allclose(out, as_is, rtol=1e-4, atol=1e-4)
        row = {"case": f"{m}x{k}{'.T' if ta else ''} @ {k}x{n}{'.T' if tb else ''}", "deepx_us": t_t * 1e6,
               "as_is_us": t_d * 1e6, "ratio": t_t / t_d}
        try:
            import torch

            tx, tw = torch.from_numpy(a), torch.from_numpy(b)
            t_torch = best_time(lambda: torch.matmul(tx, tw), number, repeat)
            row.update(torch_us=t_torch * 1e6, torch_ratio=t_t / t_torch)
        except ImportError:
            pass
        rows.append(row)
    print(f"{'skinny matmul':<24}{'deepx us':>10}{'MKL as is':>11}{'deepx/as is':>13}{'torch us':>10}"
          f"{'deepx/torch':>13}")
    for r in rows:
        print(f"{r['case']:<24}{r['deepx_us']:>10.1f}{r['as_is_us']:>11.1f}{r['ratio']:>13.2f}"
              f"{r.get('torch_us', float('nan')):>10.1f}{r.get('torch_ratio', float('nan')):>13.2f}")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller sizes, fewer repeats (a smoke run)")
    ap.add_argument("--gelu", action="store_true", help="only erf, gelu and gelu's gradient against torch")
    opts = ap.parse_args()
    rng = np.random.default_rng(0)
    rows = []
    for label, name, shapes, direct, extra in () if opts.gelu else cases(opts.quick):
        ex = CpuExecutor()
        inputs = [rng.standard_normal(s, dtype=np.float32) for s in shapes]
        names = [f"x{i}" for i in range(len(inputs))]
        for n, a in zip(names, inputs):
            ex.put(n, a)
        args = [Param.tensor(n, "float32") for n in names]
        if name == "sum":
            args += [Param.vector(extra[0]), Param.var(extra[1])]
        instr = Instr(name, tuple(args), (Param.tensor("out", "float32"),))
        ex.run(instr)  # creates the output
        out = ex.get("out")
        kernel = KERNELS[name]
        elems = inputs[0].size
        if name == "matmul":
            number, repeat = (3, 3) if shapes[0][0] >= 2048 else (10, 3)
        elif elems > 100_000:
            number, repeat = 5, 5
        else:
            number, repeat = 20_000, 5
        if opts.quick:
            number = max(1, number // 10)
        t_np = best_time(lambda: direct(*inputs, out), number, repeat)
        t_k = best_time(lambda: kernel(*inputs, *extra, out), number, repeat)
        t_run = best_time(lambda: ex.run(instr), number, repeat)
        np.testing.assert_allclose(ex.get("out"), out, rtol=1e-4)
        rows.append({"case": label, "numpy_us": t_np * 1e6, "kernel_us": t_k * 1e6, "run_us": t_run * 1e6,
                     "kernel_ratio": t_k / t_np, "run_ratio": t_run / t_np,
                     "kernel_over_us": (t_k - t_np) * 1e6, "run_over_us": (t_run - t_np) * 1e6})
    if rows:
        print(f"{'case':<12}{'numpy us':>12}{'kernel us':>12}{'run us':>12}{'kernel/np':>11}{'run/np':>9}"
              f"{'kernel +us':>12}{'run +us':>10}")
    for r in rows:
        print(f"{r['case']:<12}{r['numpy_us']:>12.2f}{r['kernel_us']:>12.2f}{r['run_us']:>12.2f}"
              f"{r['kernel_ratio']:>11.3f}{r['run_ratio']:>9.3f}{r['kernel_over_us']:>12.2f}{r['run_over_us']:>10.2f}")
    skinny = [] if opts.gelu else skinny_matmul(opts.quick)
    vs_torch = erf_gelu_vs_torch(opts.quick)
    path = Path(__file__).parent / "results" / "kernels.json"
    path.parent.mkdir(exist_ok=True)
    meta = {"python": platform.python_version(), "numpy": np.__version__, "cpus": os.cpu_count(),
            "quick": opts.quick}
    path.write_text(json.dumps({"meta": meta, "rows": rows, "skinny_matmul": skinny, "erf_gelu_vs_torch": vs_torch},
                              indent=2))
    print(f"written {path}")


if __name__ == "__main__":
    main()
