"""Elementwise fusion against unfused numpy, in one run.

1. The chain y = |exp(x * a + b) * 0.5 - d| (six ops) on 16M float32 elements:
     numpy       each op a separate numpy call, with its temporaries (what eager numpy or torch code does)
     deepx       the program as a client sends it (six instructions and the deltensors of five temporaries),
                 run by CpuExecutor on deepx's own kernels, without passes
     fused       the same program after the pipeline: one `fused` instruction, with the kernel's numpy backend
                 (the default: native C where the expression has no transcendental call, else the numpy
                 backend), with its numpy backend and with its numexpr backend; the chain again with relu in
                 exp's place, which the native backend compiles
     numexpr     numexpr.evaluate of the same expression, called directly (numexpr's own floor)
   The aim: fused at least 2x faster than numpy.
2. The chain at small sizes (1K .. 256K), fused against unfused, both through CpuExecutor: where fusion starts to
   pay for itself once dispatch is counted.
3. What the passes cost the scheduler: a 2,000-instruction program as a client sends it (fresh temporaries, each
   deleted when done) through an in-process Scheduler and CpuWorker, with the passes off, on for the first time
   (the pipeline runs), and on again (the plan cache hits).

Prints the times and ratios; writes bench/results/fusion.json.

`--crossover` measures instead where fusion starts to pay: a chain of k cheap elementwise ops (k = 2..8) on 1 .. 16M
elements, float32 and float64, run as the op worker runs a repeated program (each instruction prepared once,
`CpuExecutor.prepare`): k unfused instructions writing into pooled names that exist (as the SDK records them) against
the one fused instruction the pass makes of them. Prints unfused/fused per cell (> 1: fusion pays); writes
bench/results/fusion_crossover.json. docs/compiler.md's defaults come from this table.

`--sdk` measures what fusion does to bench/sdk.py's end-to-end loop of tiny ops: the programs the SDK records for it
(1K-element float32 tensors, results in pooled names, flushed every 4,096 instructions) run again and again through
an in-process Scheduler and CpuWorker with the default passes and with the same passes but `fuse`, per op sent; the
SDK's recording, the same either way, is timed too (the embedded daemon has no switch for the passes).

    python bench/fusion.py [--quick] [--crossover | --sdk]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numexpr
import numpy as np

from deepx_core.ir import Instr, Param
from deepx_core.ir.ops import TensorMeta
from deepxd.actors.messages import Put, Run, SchedulerStats
from deepxd.compiler import PassContext, run_passes
from deepxd.kernels.cpu import CpuExecutor, native
from deepxd.kernels.cpu import fused as fused_kernel

# a benchmark times the steady state: a native kernel is compiled before the run that made it HOT returns (here
# and in any deepxd it starts)
os.environ["DEEPX_NATIVE_BACKGROUND"] = "0"
native.set_background(False)

T = Param.tensor


def chain(out: str = "y", prefix: str = "t", x: str = "x", third: str = "exp") -> list[Instr]:
    """y = |exp(x * a + b) * 0.5 - d| as a client records it: each temporary deleted once the next op has read it.
    `third`: the op in exp's place (relu: a chain with no transcendental call, which the native backend compiles)."""
    f = "float32"
    t1, t2, t3, t4, t5 = (f"{prefix}{k}" for k in range(1, 6))
    ops = [
        Instr("mul", (T(x, f), T("a", f)), (T(t1, f),)),
        Instr("add", (T(t1, f), T("b", f)), (T(t2, f),)),
        Instr(third, (T(t2, f),), (T(t3, f),)),
        Instr("mulscalar", (T(t3, f), Param.var(0.5)), (T(t4, f),)),
        Instr("sub", (T(t4, f), T("d", f)), (T(t5, f),)),
        Instr("abs", (T(t5, f),), (T(out, f),)),
    ]
    prog = [ops[0]]
    for k, instr in enumerate(ops[1:]):
        prog += [instr, Instr("deltensor", (), (T((t1, t2, t3, t4, t5)[k], f),))]
    return prog


def numpy_chain(x: np.ndarray, a: np.ndarray, b: np.ndarray, d: np.ndarray, third: str = "exp") -> np.ndarray:
    t = x * a
    t = t + b
    t = np.exp(t) if third == "exp" else np.maximum(t, np.float32(0))
    t = t * np.float32(0.5)
    t = t - d
    return np.abs(t)


def best(fn: Callable[[], object], repeat: int) -> float:
    out = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        out = min(out, time.perf_counter() - t0)
    return out


def inputs(n: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {k: rng.uniform(-1, 1, n).astype(np.float32) for k in ("x", "a", "b", "d")}


def executor(arrays: dict[str, np.ndarray]) -> CpuExecutor:
    ex = CpuExecutor()
    for k, v in arrays.items():
        ex.tensors[k] = v
    return ex


def fused_program(arrays: dict[str, np.ndarray], third: str = "exp") -> list[Instr]:
    metas = {k: TensorMeta(v.shape, "float32") for k, v in arrays.items()}
    out = run_passes(chain(third=third), PassContext(metas=metas))
    assert [i.name for i in out] == ["fused"], out
    return out


def big_chain(n: int, repeat: int, third: str = "exp") -> dict[str, float]:
    arrays = inputs(n)
    x, a, b, d = arrays["x"], arrays["a"], arrays["b"], arrays["d"]
    want = numpy_chain(x, a, b, d, third)
    r: dict[str, float] = {"numpy_s": best(lambda: numpy_chain(x, a, b, d, third), repeat)}
    ex = executor(arrays)
    plain, fused = chain(third=third), fused_program(arrays, third)
    r["deepx_unfused_s"] = best(lambda: ex.run_all(plain), repeat)
    for backend in fused_kernel.BACKENDS:
        previous = fused_kernel.set_backend(backend)
        try:
            ex.run_all(fused)
            for _ in range(native.HOT):  # the native backend compiles an expression on its HOT-th run
                ex.run_all(fused)
            np.testing.assert_allclose(ex.tensors["y"], want, rtol=1e-4 if backend == "numexpr" else 2e-6, atol=1e-6)
            r[f"fused_{backend}_s"] = best(lambda: ex.run_all(fused), repeat)
        finally:
            fused_kernel.set_backend(previous)
    out = np.empty_like(x)
    env = {"x": x, "a": a, "b": b, "d": d, "c": np.float32(0.5)}
    text = "abs(exp(x * a + b) * c - d)" if third == "exp" else "abs(where(x * a + b > 0, x * a + b, 0) * c - d)"
    r["numexpr_direct_s"] = best(lambda: numexpr.evaluate(text, local_dict=env, out=out), repeat)
    return r


def small_chains(sizes: list[int], repeat: int) -> dict[str, dict[str, float]]:
    rows: dict[str, dict[str, float]] = {}
    for n in sizes:
        arrays = inputs(n)
        ex = executor(arrays)
        plain, fused = chain(), fused_program(arrays)
        number = max(1, 20_000 // max(1, n // 256))
        t_plain = best(lambda: [ex.run_all(plain) for _ in range(number)], repeat) / number
        t_fused = best(lambda: [ex.run_all(fused) for _ in range(number)], repeat) / number
        rows[str(n)] = {"unfused_us": t_plain * 1e6, "fused_us": t_fused * 1e6}
    return rows


def client_program(n_instr: int, step: int) -> list[Instr]:
    """Chains of the shape above, each on `acc` and into it (through tanh), with fresh names each step, until
    n_instr instructions."""
    prog: list[Instr] = []
    k = 0
    while len(prog) < n_instr:
        y = f"s{step}y{k}"
        prog += chain(out=y, prefix=f"s{step}c{k}t", x="acc")
        prog += [Instr("tanh", (T(y, "float32"),), (T("acc", "float32"),)),
                 Instr("deltensor", (), (T(y, "float32"),))]
        k += 1
    return prog


async def scheduler_cost(n_instr: int, elements: int, repeat: int) -> dict[str, float]:
    from deepxd.actors.opcpu import CpuWorker
    from deepxd.actors.scheduler import Scheduler
    from deepxd.compiler import DEFAULT_PASSES
    from deepxd.config import Config

    out: dict[str, float] = {}
    for label, passes in (("off", ["off"]), ("on", list(DEFAULT_PASSES))):
        worker = CpuWorker(output_log=False, inline_elements=1 << 30)
        worker.start()
        sched = Scheduler({"op-cpu": worker.ref}, config=Config(passes=passes))
        sched.start()
        for name, a in {**inputs(elements), "acc": np.zeros(elements, np.float32)}.items():
            await worker.ref.ask(Put(name=name, dtype="float32", shape=list(a.shape), data=a.tobytes()))
        times = []
        for step in range(repeat + 1):
            prog = client_program(n_instr, step)
            t0 = time.perf_counter()
            result = await sched.ref.ask(Run(program=prog, fetch=[]))
            times.append(time.perf_counter() - t0)
            assert not result.error and result.done == len(prog), result.error
        if label == "on":
            out["on_first_us_per_instr"] = times[0] / len(prog) * 1e6
            out["on_cached_us_per_instr"] = min(times[1:]) / len(prog) * 1e6
            stats = await sched.ref.ask(SchedulerStats())
            assert stats["rewrite_hits"] == repeat, stats  # fresh names: the rewrite by structure
        else:
            out["off_us_per_instr"] = min(times) / len(prog) * 1e6
        await sched.stop()
        await worker.stop()
    return out


#: the crossover chain's ops, in order (cheap ones, as a training step's elementwise work mostly is): (op, operand)
CROSS_OPS: list[tuple[str, str | float | None]] = [
    ("mul", "a"), ("addscalar", 0.5), ("sub", "x"), ("relu", None), ("mulscalar", 0.5), ("add", "a"), ("max", "x"),
    ("neg", None)]


def _cross_instr(k: int, src: str, dst: str, dtype: str) -> Instr:
    op, operand = CROSS_OPS[k]
    if operand is None:
        args: tuple[Param, ...] = (T(src, dtype),)
    elif isinstance(operand, str):
        args = (T(src, dtype), T(operand, dtype))
    else:
        args = (T(src, dtype), Param.var(operand))
    return Instr(op, args, (T(dst, dtype),))


def crossover_programs(k: int, dtype: str) -> tuple[list[Instr], list[Instr]]:
    """The chain of k ops from x: pooled (into p0/p1, the last into y, every name existing: what the worker runs
    unfused) and with fresh temporaries deleted after use (what the pass fuses into one instruction)."""
    pooled = [_cross_instr(j, "x" if j == 0 else f"p{(j - 1) % 2}", "y" if j == k - 1 else f"p{j % 2}", dtype)
              for j in range(k)]
    temps: list[Instr] = []
    for j in range(k):
        temps.append(_cross_instr(j, "x" if j == 0 else f"t{j - 1}", "y" if j == k - 1 else f"t{j}", dtype))
        if j:
            temps.append(Instr("deltensor", (), (T(f"t{j - 1}", dtype),)))
    return pooled, temps


def crossover(sizes: list[int], groups: list[int], dtypes: list[str], budget_s: float) -> dict[str, dict[str, Any]]:
    rows: dict[str, dict[str, Any]] = {}
    for dtype in dtypes:
        for n in sizes:
            rng = np.random.default_rng(0)
            arrays = {k: rng.uniform(-1, 1, n).astype(dtype) for k in ("x", "a", "p0", "p1", "y")}
            metas = {k: TensorMeta(v.shape, dtype) for k, v in arrays.items()}
            row: dict[str, Any] = {}
            for k in groups:
                pooled, temps = crossover_programs(k, dtype)
                fused = run_passes(temps, PassContext(metas=metas, fuse_min_ops=2), ["fuse"])  # pairs too
                assert [i.name for i in fused] == ["fused"], fused
                times = []
                for prog in (pooled, fused):
                    ex = executor(arrays)
                    ex.run_all(prog)  # outputs made, plans compiled
                    steps = [ex.prepare(ex.plans.bind(i, ex)) for i in prog]

                    def run(steps: list[Callable[[], None]] = steps) -> None:
                        for step in steps:
                            step()

                    t0 = time.perf_counter()
                    run()
                    once = time.perf_counter() - t0
                    number = max(1, min(20_000, int(budget_s / 5 / max(once, 1e-7))))
                    times.append(best(lambda: [run() for _ in range(number)], 5 if n < 1 << 20 else 3) / number)
                    if prog is fused:
                        want = executor(arrays)
                        want.run_all(pooled)
                        np.testing.assert_allclose(ex.tensors["y"], want.tensors["y"], rtol=1e-5, atol=1e-6)
                row[str(k)] = {"unfused_us": times[0] * 1e6, "fused_us": times[1] * 1e6,
                               "ratio": times[0] / times[1]}
            rows[f"{dtype}/{n}"] = row
            print(f"  {dtype:7s} {n:>10,} : " + "  ".join(f"{row[str(k)]['ratio']:5.2f}" for k in groups)
                  + f"   ({row[str(groups[0])]['unfused_us']:.1f} us unfused, {groups[0]} ops)", flush=True)
    return rows


def sdk_chain(n: int, a: Any, b: Any) -> Any:
    """bench/sdk.py's loop of tiny ops (the same code runs on deepx and torch tensors)."""
    c = a
    for i in range(n // 4):
        c = c + b
        c = c * 0.5
        c = c - a
        c = c.relu() if i % 2 else c * b
    return c


def sdk_programs(n: int) -> tuple[list[list[Instr]], dict[str, np.ndarray], float]:
    """The programs the SDK sends for sdk_chain(n) after a warm-up (as max_pending cuts them), the tensors they need,
    and the seconds per op the recording took (best of 3)."""
    import deepx_sdk as dx

    s = dx.connect(max_pending=1 << 30)
    rng = np.random.default_rng(0)
    a, b = (dx.tensor(rng.standard_normal(1024, dtype=np.float32)) for _ in range(2))
    c = sdk_chain(400, a, b)
    dx.sync()
    record = float("inf")
    for _ in range(3):
        s.pending.clear()
        t0 = time.perf_counter()
        c = sdk_chain(n, a, b)
        record = min(record, (time.perf_counter() - t0) / n)
        prog = list(s.pending)
    s.pending.clear()
    del c
    names = {str(p.value) for i in prog for p in (*i.args, *i.returns) if p.category == "tensor"}
    arrays = {k: rng.standard_normal(1024, dtype=np.float32) for k in sorted(names)}
    dx.disconnect()
    return [prog[k:k + 4096] for k in range(0, len(prog), 4096)], arrays, record


async def sdk_loop(programs: list[list[Instr]], arrays: dict[str, np.ndarray], repeat: int) -> dict[str, float]:
    from deepxd.actors.opcpu import CpuWorker
    from deepxd.actors.scheduler import Scheduler
    from deepxd.compiler import DEFAULT_PASSES
    from deepxd.config import Config

    out: dict[str, float] = {}
    n_ops = sum(len(p) for p in programs)
    setups = {"fuse": list(DEFAULT_PASSES), "no_fuse": [p for p in DEFAULT_PASSES if p != "fuse"]}
    pairs = []
    for label, passes in setups.items():
        worker = CpuWorker(output_log=False, inline_elements=1 << 30)
        worker.start()
        sched = Scheduler({"op-cpu": worker.ref}, config=Config(passes=passes))
        sched.start()
        for name, a in arrays.items():
            await worker.ref.ask(Put(name=name, dtype="float32", shape=list(a.shape), data=a.tobytes()))
        pairs.append((label, worker, sched))
        out[label] = float("inf")
    for _ in range(repeat + 1):  # interleaved, so that the load on this box falls on both alike
        for label, _, sched in pairs:
            t0 = time.perf_counter()
            for prog in programs:
                result = await sched.ref.ask(Run(program=prog, fetch=[]))
                assert not result.error and result.done == len(prog), result.error
            out[label] = min(out[label], (time.perf_counter() - t0) / n_ops)
    last = str(programs[-1][-1].returns[0].value)  # the loop's result: the same with and without fusion
    values = []
    for _, worker, sched in pairs:
        for k, prog in enumerate(programs):
            result = await sched.ref.ask(Run(program=prog, fetch=[last] if k == len(programs) - 1 else []))
        values.append(result.tensors[last])
        await sched.stop()
        await worker.stop()
    np.testing.assert_allclose(values[0], values[1], rtol=1e-5, atol=1e-6)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--crossover", action="store_true", help="fused against unfused by group size and element count")
    ap.add_argument("--sdk", action="store_true", help="bench/sdk.py's loop of tiny ops with and without fuse")
    opts = ap.parse_args()
    if opts.sdk:
        n_ops = 2_000 if opts.quick else 10_000
        programs, arrays, record = sdk_programs(n_ops)
        loop = asyncio.run(sdk_loop(programs, arrays, 3 if opts.quick else 7))
        print(f"bench/sdk.py's loop of {n_ops:,} tiny ops, 1K-element float32, per op sent (best of runs):")
        print(f"  recording (SDK)                         : {record * 1e6:6.2f} us")
        for label in ("no_fuse", "fuse"):
            print(f"  scheduler + worker, passes {'with' if label == 'fuse' else 'but':4s} fuse    : "
                  f"{loop[label] * 1e6:6.2f} us   end to end {(record + loop[label]) * 1e6:6.2f} us")
        print(f"  no fuse / fuse: daemon side {loop['no_fuse'] / loop['fuse']:5.2f}x, end to end "
              f"{(record + loop['no_fuse']) / (record + loop['fuse']):5.2f}x")
        return
    if opts.crossover:
        sizes = [1, 64, 1 << 10, 1 << 14, 1 << 18, 1 << 24]
        groups = list(range(2, 9))
        print(f"unfused/fused, prepared calls (as the op worker runs a repeated program); > 1: fusion pays; "
              f"columns: ops in the group {groups[0]}..{groups[-1]}")
        table = crossover(sizes if not opts.quick else sizes[:-1], groups, ["float32", "float64"],
                          0.05 if opts.quick else 0.2)
        path = Path(__file__).parent / "results" / "fusion_crossover.json"
        path.parent.mkdir(exist_ok=True)
        path.write_text(json.dumps({"cpus": os.cpu_count(), "numpy": np.__version__, "cells": table}, indent=2))
        return
    n = 1 << 22 if opts.quick else 1 << 24
    repeat = 3 if opts.quick else 5
    n_instr = 1_000 if opts.quick else 2_000
    cost = asyncio.run(scheduler_cost(n_instr, 1024, repeat))

    label = f"{n >> 20}M"
    chains = {}
    for third in ("relu", "exp"):
        big = chains[third] = big_chain(n, repeat, third)
        t_np = big["numpy_s"]
        print(f"y = |{third}(x * a + b) * 0.5 - d| (6 ops) on {label} float32 elements, best of {repeat}")
        print(f"  numpy, op by op (temporaries)  : {t_np * 1e3:8.1f} ms")
        print(f"  deepx unfused (CpuExecutor)    : {big['deepx_unfused_s'] * 1e3:8.1f} ms   "
              f"numpy/this {t_np / big['deepx_unfused_s']:5.2f}x")
        for backend in fused_kernel.BACKENDS:
            t = big[f"fused_{backend}_s"]
            print(f"  fused, {backend:8s} backend        : {t * 1e3:8.1f} ms   numpy/this {t_np / t:5.2f}x")
        print(f"  numexpr.evaluate directly      : {big['numexpr_direct_s'] * 1e3:8.1f} ms   "
              f"numpy/this {t_np / big['numexpr_direct_s']:5.2f}x")
    speedup = t_np / big[f"fused_{fused_kernel.backend()}_s"]
    print(f"aim: fused (default backend: {fused_kernel.backend()}) >= 2x faster than numpy -> "
          f"{'met' if speedup >= 2 else 'NOT met'} ({speedup:.2f}x)")

    sizes = [1 << 10, 1 << 14, 1 << 16, 1 << 18]
    small = small_chains(sizes, repeat)
    print("the same chain through CpuExecutor, per run: unfused (11 instructions) vs fused (1)")
    for k, row in small.items():
        print(f"  {int(k):>8,} elements : {row['unfused_us']:9.1f} us  vs {row['fused_us']:9.1f} us   "
              f"{row['unfused_us'] / row['fused_us']:5.2f}x")

    print(f"scheduler + worker, a {n_instr:,}-instruction client program on 1K-element tensors, per instruction sent:")
    print(f"  passes off                    : {cost['off_us_per_instr']:6.1f} us")
    print(f"  passes on, first time         : {cost['on_first_us_per_instr']:6.1f} us")
    print(f"  passes on, plan cache hit     : {cost['on_cached_us_per_instr']:6.1f} us")

    result = {
        "machine": platform.machine(), "python": platform.python_version(), "cpus": os.cpu_count(),
        "numpy": np.__version__, "numexpr": numexpr.__version__, "numexpr_vml": bool(numexpr.use_vml),
        "numexpr_threads": numexpr.get_num_threads(), "fused_threads": fused_kernel.MAX_THREADS,
        "elements": n, "repeat": repeat, "default_backend": fused_kernel.backend(), "speedup_vs_numpy": speedup,
        **big, "relu_chain": chains["relu"], "small": small, "scheduler": {"program_instructions": n_instr, **cost},
    }
    path = Path(__file__).parent / "results" / "fusion.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
