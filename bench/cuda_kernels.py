"""The CUDA executor's kernels against torch on the same GPU, in one run; every figure is a ratio against torch.

1. float32 add at 256M elements (bandwidth), one instruction with benchmark.repeat, against torch.add(out=); sigmoid
   (its kernel rendered from the op table's expression) in float32 and float16, against torch.sigmoid(out=).
2. GEMM 8192^3 float32 (IEEE) and TF32 through cuBLAS, against torch.mm(out=) with the same TF32 setting.
3. A 6-op elementwise chain on 64M float32 elements as one `fused` instruction, against torch eager (6 kernels).
4. softmax over rows of 4096 (64K rows) and a sum over the last dim, against torch.
5. The same tensor summed over its first dim (columns), argmax over rows, layernorm; softmax over 1M rows of 256.
6. The small kernels of a transformer step (bench/gpu_kernels.py's map: batch 32, context 128, d_model 256, 4 heads):
   the head split (a strided copy), a bias broadcast add, a column sum (a bias's gradient), each timed by its GPU
   time (CUPTI, through torch's profiler: launches excluded), against torch's kernels for the same work.

Runs the executor directly (no daemon): `python bench/cuda_kernels.py [--quick]`.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from deepx_core.ir.instr import Instr, Param
from deepxd.kernels.cuda import CudaExecutor

T = Param.tensor


def ins(name, args, rets, repeat=1):
    meta = (("benchmark.repeat", str(repeat)),) if repeat > 1 else ()
    return Instr(name, tuple(args), tuple(rets), meta)


def timed(fn, sync, reps):
    fn()
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return (time.perf_counter() - t0) / reps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    n = (64 if args.quick else 256) << 20
    ex = CudaExecutor()
    ex.precompile()
    tsync = torch.cuda.synchronize
    rows = []

    # 1. add
    a = np.random.default_rng(0).random(n, dtype=np.float32)
    ex.put("a", a)
    ex.put("b", a)
    ex.put("c", a)
    reps = 20
    t_dx = timed(lambda: ex.run(ins("add", [T("a"), T("b")], [T("c")], reps)), ex.synchronize, reps)
    ta = torch.from_numpy(a).cuda()
    tb, tc = ta.clone(), ta.clone()

    def tadd():
        for _ in range(reps):
            torch.add(ta, tb, out=tc)

    t_t = timed(tadd, tsync, reps)
    rows.append(("add f32 256M: TB/s", 12 * n / t_dx / 1e12, 12 * n / t_t / 1e12))
    ex.tensors.clear()

    # 1b. sigmoid: the kernel rendered from the op table's stable-sigmoid expression, in float32 and float16
    for dt, tdt, size in (("float32", torch.float32, 4), ("float16", torch.float16, 2)):
        s = np.random.default_rng(2).uniform(-8, 8, n).astype(dt)
        ex.put("s", s)
        t_dx = timed(lambda: ex.run(ins("sigmoid", [T("s")], [T("o")], reps)), ex.synchronize, reps)
        ts = torch.from_numpy(s).cuda()
        to = torch.empty_like(ts, dtype=tdt)

        def tsig():
            for _ in range(reps):
                torch.sigmoid(ts, out=to)

        t_t = timed(tsig, tsync, reps)
        rows.append((f"sigmoid {dt} 256M: TB/s", 2 * size * n / t_dx / 1e12, 2 * size * n / t_t / 1e12))
        ex.tensors.clear()

    # 2. GEMM
    m = 4096 if args.quick else 8192
    g = np.random.default_rng(1).uniform(-1, 1, (m, m)).astype(np.float32)
    ex.put("x", g)
    ex.put("y", g)
    tx = torch.from_numpy(g).cuda()
    tz = torch.empty_like(tx)
    for tf32 in (False, True):
        ex.tf32 = tf32
        torch.backends.cuda.matmul.allow_tf32 = tf32
        reps = 5
        t_dx = timed(lambda: ex.run(ins("matmul", [T("x"), T("y")], [T("z")], reps)), ex.synchronize, reps)

        def tmm():
            for _ in range(reps):
                torch.mm(tx, tx, out=tz)

        t_t = timed(tmm, tsync, reps)
        rows.append((f"GEMM {m} {'tf32' if tf32 else 'f32'}: TFLOP/s", 2 * m**3 / t_dx / 1e12, 2 * m**3 / t_t / 1e12))
    ex.tensors.clear()

    # 3. fused chain
    k = 64 << 20
    x = np.random.default_rng(2).uniform(-1, 1, k).astype(np.float32)
    for name in ("p", "q", "r"):
        ex.put(name, x)
    expr = "abs(exp(in0 * in1 + in2) * 0.5 - in2)"
    reps = 10
    t_dx = timed(lambda: ex.run(ins("fused", [Param.listtensor(["p", "q", "r"]), Param.var(expr)], [T("o")], reps)),
                 ex.synchronize, reps)
    tp = torch.from_numpy(x).cuda()
    tq, tr = tp.clone(), tp.clone()

    def tchain():
        for _ in range(reps):
            torch.abs(torch.exp(tp * tq + tr) * 0.5 - tr)

    t_t = timed(tchain, tsync, reps)
    rows.append(("6-op chain 64M: ms (fused vs eager)", t_dx * 1e3, t_t * 1e3))
    ex.tensors.clear()

    # 4. softmax and sum over rows
    s = np.random.default_rng(3).standard_normal((1 << 16, 4096)).astype(np.float32)
    ex.put("s", s)
    ts = torch.from_numpy(s).cuda()
    reps = 10
    t_dx = timed(lambda: ex.run(ins("softmax", [T("s")], [T("o")], reps)), ex.synchronize, reps)

    def tsoft():
        for _ in range(reps):
            torch.softmax(ts, -1)

    rows.append(("softmax 64Kx4096: ms", t_dx * 1e3, timed(tsoft, tsync, reps) * 1e3))
    t_dx = timed(lambda: ex.run(ins("sum", [T("s"), Param.vector([1])], [T("o2")], reps)), ex.synchronize, reps)

    def tsum():
        for _ in range(reps):
            ts.sum(-1)

    rows.append(("sum rows 64Kx4096: ms", t_dx * 1e3, timed(tsum, tsync, reps) * 1e3))

    # 5. the other row-wise layouts: columns, argmax, layernorm, short rows (a warp per row)
    t_dx = timed(lambda: ex.run(ins("sum", [T("s"), Param.vector([0])], [T("o3")], reps)), ex.synchronize, reps)

    def tcol():
        for _ in range(reps):
            ts.sum(0)

    rows.append(("sum columns 64Kx4096 (dim 0): ms", t_dx * 1e3, timed(tcol, tsync, reps) * 1e3))
    t_dx = timed(lambda: ex.run(ins("argmax", [T("s"), Param.var(1)], [T("o4")], reps)), ex.synchronize, reps)

    def targ():
        for _ in range(reps):
            ts.argmax(-1)

    rows.append(("argmax rows 64Kx4096: ms", t_dx * 1e3, timed(targ, tsync, reps) * 1e3))
    w = np.random.default_rng(4).standard_normal(4096).astype(np.float32)
    ex.put("w", w)
    ex.put("bias", w)
    tw = torch.from_numpy(w).cuda()
    t_dx = timed(lambda: ex.run(ins("layernorm", [T("s"), T("w"), T("bias")], [T("o5")], reps)), ex.synchronize,
                 reps)

    def tln():
        for _ in range(reps):
            torch.nn.functional.layer_norm(ts, (4096,), tw, tw)

    rows.append(("layernorm 64Kx4096: ms", t_dx * 1e3, timed(tln, tsync, reps) * 1e3))
    ex.tensors.clear()
    short = np.random.default_rng(5).standard_normal((1 << 20, 256)).astype(np.float32)
    ex.put("h", short)
    th = torch.from_numpy(short).cuda()
    t_dx = timed(lambda: ex.run(ins("softmax", [T("h")], [T("o")], reps)), ex.synchronize, reps)

    def tshort():
        for _ in range(reps):
            torch.softmax(th, -1)

    rows.append(("softmax 1M rows of 256: ms", t_dx * 1e3, timed(tshort, tsync, reps) * 1e3))
    ex.tensors.clear()
    rows += small_kernels(ex)
    ex.close()

    print("| figure | deepx cuda | torch | ratio (deepx/torch; ms rows: torch/deepx) |")
    print("| --- | --- | --- | --- |")
    for name, d, t in rows:
        ratio = t / d if "ms" in name else d / t
        print(f"| {name} | {d:.3f} | {t:.3f} | {ratio:.2f}x |")


def gpu_ms(fn, reps: int) -> float:
    """Milliseconds of GPU time per call of fn: the kernels' durations as CUPTI records them (launch costs left
    out), summed over `reps` calls."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    us = sum(e.time_range.elapsed_us() for e in prof.events() if e.device_type.name == "CUDA")
    return us / reps / 1e3


def small_kernels(ex) -> list[tuple[str, float, float]]:
    """Section 6: the transformer step's small kernels, by GPU time."""
    rng = np.random.default_rng(6)
    b, t, h, d = 32, 128, 4, 64
    x = rng.standard_normal((b, t, h, d)).astype(np.float32)
    ex.put("x", x)
    tx = torch.from_numpy(x).cuda()
    out = []
    split = ins("transpose", [T("x"), Param.vector([0, 2, 1, 3])], [T("xt")])
    out.append(("head split (32,128,4,64) -> (32,4,128,64): ms", gpu_ms(lambda: ex.run(split), 20),
                gpu_ms(lambda: tx.transpose(1, 2).contiguous(), 20)))
    y = rng.standard_normal((b * t, h * d)).astype(np.float32)
    bias = rng.standard_normal(h * d).astype(np.float32)
    ex.put("y", y)
    ex.put("bias", bias)
    ty, tbias = torch.from_numpy(y).cuda(), torch.from_numpy(bias).cuda()
    add = ins("add", [T("y"), T("bias")], [T("yb")])
    out.append(("bias add (4096,256) + (256): ms", gpu_ms(lambda: ex.run(add), 20), gpu_ms(lambda: ty + tbias, 20)))
    col = ins("sum", [T("y"), Param.vector([0])], [T("ys")])
    out.append(("column sum (4096,256) -> (256): ms", gpu_ms(lambda: ex.run(col), 20),
                gpu_ms(lambda: ty.sum(0), 20)))
    wide = rng.standard_normal((b * t, 4 * h * d)).astype(np.float32)
    ex.put("w", wide)
    tw = torch.from_numpy(wide).cuda()
    colw = ins("sum", [T("w"), Param.vector([0])], [T("ws")])
    out.append(("column sum (4096,1024) -> (1024): ms", gpu_ms(lambda: ex.run(colw), 20),
                gpu_ms(lambda: tw.sum(0), 20)))
    ex.tensors.clear()
    return out


if __name__ == "__main__":
    main()
