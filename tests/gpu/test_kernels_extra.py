"""The CUDA executor beyond one op at a time: cuBLAS GEMM (shapes, transposes, batches, TF32), fused kernels against
the unfused ops and their structure cache, backward programs from autograd against the CPU executor, errors that
leave the executor serving (out of memory, a bad launch, integer division by zero, bad indices), the CPU fallback,
the disk cache of compiled kernels and the one-thread rule."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from deepx_core.errors import DeepxError
from deepx_core.ir.dtypes import to_numpy
from deepxd.kernels.cpu import CpuExecutor
from tests.kernels.kernel_ref import VEC, L, T, V, instr

pytest.importorskip("pycuda.driver", reason="PyCUDA is not installed: the CUDA kernel tests need an NVIDIA GPU "
                    "(pip install -e '.[cuda]' there: docs/cuda.md)")


def _gemm(gx, dtype, m, n, k, *, ta=False, tb=False, batch=1, tf32=False, seed=0):
    rng = np.random.default_rng(seed)
    dt = to_numpy(dtype)
    a = rng.uniform(-1, 1, (batch, k, m) if ta else (batch, m, k)).astype(dt)
    b = rng.uniform(-1, 1, (batch, n, k) if tb else (batch, k, n)).astype(dt)
    da, db = gx.to_device(a), gx.to_device(b)
    dc = gx.empty((batch, m, n), dtype)
    blas = gx.blas()
    blas.tf32 = tf32
    try:
        blas.gemm(dtype, m, n, k, da.ptr, db.ptr, dc.ptr, trans_a=ta, trans_b=tb, batch=batch, stride_a=m * k,
                  stride_b=k * n, stride_c=m * n)
    finally:
        blas.tf32 = gx.tf32
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    if ta:
        a64 = a64.transpose(0, 2, 1)
    if tb:
        b64 = b64.transpose(0, 2, 1)
    return gx.to_host(dc).astype(np.float64), a64 @ b64


@pytest.mark.parametrize("dtype", ["float64", "float32", "float16", "bfloat16"])
@pytest.mark.parametrize(("ta", "tb"), [(False, False), (True, False), (False, True), (True, True)])
def test_gemm_transposes_and_batches(gx, dtype, ta, tb):
    tol = {"float64": 1e-12, "float32": 1e-5, "float16": 2e-3, "bfloat16": 1.6e-2}[dtype]
    for m, n, k, batch in [(33, 17, 45, 1), (64, 128, 96, 3), (1, 5, 1, 2)]:
        got, want = _gemm(gx, dtype, m, n, k, ta=ta, tb=tb, batch=batch)
        scale = np.abs(want).max()
        assert np.abs(got - want).max() <= tol * max(scale, 1.0) * 4, (dtype, m, n, k, batch)


def test_gemm_tf32_is_opt_in(gx):
    got32, want = _gemm(gx, "float32", 256, 256, 4096, seed=1)
    got_tf, _ = _gemm(gx, "float32", 256, 256, 4096, tf32=True, seed=1)
    scale = np.abs(want).max()
    err32, err_tf = np.abs(got32 - want).max() / scale, np.abs(got_tf - want).max() / scale
    assert err32 < 2e-5, err32  # IEEE float32 by default
    assert err_tf < 2e-2 and err_tf > 3 * err32, (err_tf, err32)  # TF32: 10-bit mantissa products


def test_matmul_tf32_switch_on_the_executor(gx):
    rng = np.random.default_rng(2)
    a, b = rng.uniform(-1, 1, (128, 2048)).astype(np.float32), rng.uniform(-1, 1, (2048, 64)).astype(np.float32)
    gx.put("a", a)
    gx.put("b", b)
    gx.run(instr("matmul", [T("a"), T("b")], [T("c")]))
    plain = gx.get("c").astype(np.float64)
    gx.tf32 = True
    gx.run(instr("matmul", [T("a"), T("b")], [T("c")]))
    fast = gx.get("c").astype(np.float64)
    want = a.astype(np.float64) @ b.astype(np.float64)
    assert np.abs(plain - want).max() < np.abs(fast - want).max()


def test_matmul_large_against_numpy(gx):
    rng = np.random.default_rng(4)
    for dtype, tol in [("float32", 1e-5), ("float16", 3e-3), ("bfloat16", 2e-2)]:
        a = rng.uniform(-1, 1, (4, 256, 512)).astype(to_numpy(dtype))
        b = rng.uniform(-1, 1, (512, 384)).astype(to_numpy(dtype))
        gx.put("a", a)
        gx.put("b", b)
        gx.run(instr("matmul", [T("a"), T("b")], [T(f"c_{dtype}")]))
        want = a.astype(np.float64) @ b.astype(np.float64)
        got = gx.get(f"c_{dtype}").astype(np.float64)
        assert np.abs(got - want).max() <= tol * np.abs(want).max() * 4, dtype


# ---------------------------------------------------------------- fused


@pytest.mark.parametrize("dtype", ["float64", "float32", "float16", "bfloat16"])
def test_fused_matches_unfused(gx, dtype):
    rng = np.random.default_rng(5)
    dt = to_numpy(dtype)
    ins = {"a": rng.uniform(-2, 2, (64, 33)).astype(dt), "b": rng.uniform(-2, 2, (64, 33)).astype(dt),
           "c": rng.uniform(-2, 2, (33,)).astype(dt)}
    for n, x in ins.items():
        gx.put(n, x)
    gx.run_all([
        instr("mulscalar", [T("a"), V(2.5)], [T("t1")]),
        instr("exp", [T("b")], [T("t2")]),
        instr("add", [T("t1"), T("t2")], [T("t3")]),
        instr("max", [T("a"), T("c")], [T("t4")]),
        instr("mul", [T("t4"), T("t4")], [T("t5")]),
        instr("sub", [T("t3"), T("t5")], [T("y")]),
    ])
    unfused = gx.get("y").astype(np.float64)
    gx.run(instr("fused", [L(["a", "b", "c"]), V("in0 * 2.5 + exp(in1) - maximum(in0, in2) * maximum(in0, in2)")],
                 [T("z")]))
    fused = gx.get("z").astype(np.float64)
    # unfused rounds every intermediate to the dtype; fused rounds once
    rtol = {"float64": 1e-12, "float32": 1e-5, "float16": 8e-3, "bfloat16": 6e-2}[dtype]
    assert np.allclose(fused, unfused, rtol=rtol, atol=rtol * 10)
    assert not gx.fallbacks


def test_fused_kernels_are_cached_by_structure(gx):
    gx.put("a", np.arange(12, dtype=np.float32).reshape(3, 4))
    gx.put("b", np.ones((4,), np.float32))
    gx.run(instr("fused", [L(["a", "b"]), V("in0 * 2.5 + in1")], [T("c")]))
    before = len(gx.modules.modules)
    gx.run(instr("fused", [L(["a", "b"]), V("in0 * 7.0 + in1")], [T("d")]))
    assert len(gx.modules.modules) == before  # the same structure: no new module
    np.testing.assert_allclose(gx.get("d"), np.arange(12, dtype=np.float32).reshape(3, 4) * 7 + 1)
    gx.run(instr("fused", [L(["a", "b"]), V("in0 * 7.0 - in1")], [T("e")]))
    assert len(gx.modules.modules) == before + 1


# ---------------------------------------------------------------- autograd's backward programs


@pytest.mark.parametrize("op", ["matmul", "softmax", "logsoftmax", "layernorm", "rmsnorm", "crossentropy", "gelu",
                                "sum", "mse", "indexselect", "concat", "transpose", "broadcastTo", "silu",
                                "reducemax", "slice", "pad"])
def test_backward_program_matches_cpu(gx, op):
    torch = pytest.importorskip("torch", reason="the gradient cases of tests/compiler use torch")
    assert torch is not None
    from deepxd.compiler.autograd import grad_program
    from tests.compiler.helpers import program
    from tests.compiler.test_grad_rules import CASES, Fixed

    rng = np.random.default_rng(6)
    dtype = "float32"
    for case in CASES[op]:
        if dtype not in case.dtypes:
            continue
        gx.tensors.clear()
        inputs = {}
        for name, spec in case.inputs.items():
            if isinstance(spec, Fixed):
                inputs[name] = spec.value.astype(np.float32) if spec.value.dtype.kind == "f" else spec.value
            else:
                inputs[name] = rng.uniform(spec.lo, spec.hi, spec.shape).astype(np.float32)
        fwd = program(case.text.replace("<T>", f"<{dtype}>"))
        cpu = CpuExecutor()
        for n, a in inputs.items():
            cpu.put(n, a)
            gx.put(n, a)
        cpu.run_all(fwd)
        gx.run_all(fwd)
        up = rng.uniform(-1, 1, cpu.get("y").shape).astype(np.float32)
        cpu.put("up", up)
        gx.put("up", up)
        back, names = grad_program(fwd, "y", case.wrt, cpu, grad_loss="up")
        cpu.run_all(back)
        gx.run_all(back)
        for w, g in names.items():
            want, got = cpu.get(g).astype(np.float64), gx.get(g).astype(np.float64)
            scale = max(1.0, np.abs(want).max(initial=0.0))
            assert np.allclose(got, want, rtol=1e-4, atol=1e-5 * scale), (op, case.text, w)
    assert not gx.fallbacks, dict(gx.fallbacks)


# ---------------------------------------------------------------- errors that leave the executor serving


def _still_serving(gx):
    gx.put("ok_a", np.arange(6, dtype=np.float32))
    gx.run(instr("addscalar", [T("ok_a"), V(1.0)], [T("ok_b")]))
    np.testing.assert_array_equal(gx.get("ok_b"), np.arange(6, dtype=np.float32) + 1)


def test_out_of_memory_names_the_op_tensor_and_bytes(gx):
    with pytest.raises(DeepxError) as e:
        gx.run(instr("newtensor", [VEC((1_000_000, 1_000_000))], [T("huge", "float32")]))
    msg = str(e.value)
    assert "newtensor" in msg and "'huge'" in msg and "4000000000000 bytes" in msg, msg
    assert "huge" not in gx.tensors
    gx.put("x", np.ones((1000, 1000), np.float32))
    with pytest.raises(DeepxError) as e:
        gx.run(instr("broadcastTo", [T("x"), VEC((1_000_000, 1000, 1000))], [T("big")]))
    assert "broadcastTo" in str(e.value) and "'big'" in str(e.value)
    _still_serving(gx)


def test_bad_launch_names_the_op(gx):
    from deepxd.kernels.cuda import elementwise

    a = gx.to_device(np.ones(8, np.float32))
    f = gx.function("ew:float32", elementwise.source("float32"), "add_c", elementwise.CONTIG_FMT, "add")
    with pytest.raises(DeepxError) as e:
        gx.launch("add", f, (1, 1, 1), (4096, 1, 1), a.ptr, a.ptr, a.ptr, 8, 0.0, 0.0, 0, gx.flag_ptr, 0)
    assert str(e.value).startswith("add: kernel launch failed"), str(e.value)
    _still_serving(gx)


def test_integer_division_by_zero_and_bad_indices_raise(gx):
    gx.put("a", np.array([4, 5, 6], np.int32))
    gx.put("z", np.array([1, 0, 2], np.int32))
    with pytest.raises(DeepxError, match="div: integer division by zero"):
        gx.run(instr("div", [T("a"), T("z")], [T("c")]))
    with pytest.raises(DeepxError, match="divscalar: integer division by zero"):
        gx.run(instr("divscalar", [T("a"), V(0)], [T("c")]))
    with pytest.raises(DeepxError, match="rdivscalar: integer division by zero"):
        gx.run(instr("rdivscalar", [V(3), T("z")], [T("c")]))
    gx.put("x", np.ones((3, 4), np.float32))
    gx.put("i", np.array([0, 3], np.int64))
    with pytest.raises(DeepxError, match="indexselect: an index is out of range"):
        gx.run(instr("indexselect", [T("x"), T("i"), V(0)], [T("c")]))
    gx.put("l", np.array([1, 9, 0], np.int64))
    with pytest.raises(DeepxError, match="crossentropy: a label is out of range"):
        gx.run(instr("crossentropy", [T("x"), T("l")], [T("loss")]))
    gx.put("k", np.array([0, 2, 1, 5], np.int32))
    with pytest.raises(DeepxError, match="switch: a case is out of range"):
        gx.run(instr("switch", [L(["x", "x"]), T("k")], [T("c")]))
    gx.put("g", np.array([[0, 4]], np.int64))
    gx.put("s", np.ones((1, 2), np.float32))
    for op, args in [("gather", [T("x"), T("g"), V(1)]), ("scatter", [T("x"), T("g"), T("s"), V(-1)]),
                     ("scatteradd", [T("x"), T("g"), T("s"), V(1)])]:
        with pytest.raises(DeepxError, match=rf"{op}: an index is out of range for dim 1 of size 4 \({op}\('x', 'g'"):
            gx.run(instr(op, args, [T("c")]))
    assert "c" not in gx.tensors
    _still_serving(gx)


def test_op_without_a_kernel_for_the_case_falls_back_to_the_cpu(gx):
    # 10 broadcast dims that cannot merge: more than the indexer's 8, so the CPU kernel runs on host copies
    rng = np.random.default_rng(7)
    a = rng.uniform(-1, 1, (2, 1) * 5).astype(np.float32)
    b = rng.uniform(-1, 1, (1, 2) * 5).astype(np.float32)
    gx.put("a", a)
    gx.put("b", b)
    gx.run(instr("add", [T("a"), T("b")], [T("c")]))
    np.testing.assert_array_equal(gx.get("c"), a + b)
    assert gx.fallbacks["add"] == 1


def test_compiled_kernels_come_from_the_disk_cache(gx, tmp_path):
    from deepxd.kernels.cuda import CudaExecutor

    first = CudaExecutor(cache_dir=tmp_path)
    try:
        first.put("a", np.ones(4, np.float32))
        first.run(instr("exp", [T("a")], [T("b")]))
        first.get("b")
        assert first.modules.compiler.compiled == 1
    finally:
        first.close()
    second = CudaExecutor(cache_dir=tmp_path)
    try:
        second.put("a", np.ones(4, np.float32))
        second.run(instr("exp", [T("a")], [T("b")]))
        np.testing.assert_allclose(second.get("b"), np.exp(np.ones(4, np.float32)), rtol=1e-6)
        assert second.modules.compiler.compiled == 0 and second.modules.compiler.loaded_from_disk == 1
    finally:
        second.close()
    _still_serving(gx)


def test_other_threads_are_refused(gx):
    gx.put("a", np.ones(3, np.float32))
    errors = []

    def other():
        try:
            gx.get("a")
        except DeepxError as e:
            errors.append(str(e))

    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert errors and "thread" in errors[0]


def test_in_place_reshape_shares_memory_and_copies_are_independent(gx):
    gx.put("a", np.arange(6, dtype=np.float32))
    gx.run(instr("reshape", [T("a"), VEC((2, 3))], [T("a")]))
    assert gx.tensors["a"].shape == (2, 3)
    gx.run(instr("copytensor", [T("a")], [T("b")]))
    gx.run(instr("addscalar", [T("a"), V(1.0)], [T("a")]))
    np.testing.assert_array_equal(gx.get("b"), np.arange(6, dtype=np.float32).reshape(2, 3))
    np.testing.assert_array_equal(gx.get("a"), np.arange(6, dtype=np.float32).reshape(2, 3) + 1)


def test_benchmark_repeat_meta_runs_the_kernel_again(gx):
    gx.put("a", np.zeros(4, np.float32))
    i = instr("addscalar", [T("a"), V(1.0)], [T("a")])
    gx.run(i._replace(meta=(("benchmark.repeat", "5"),)))
    np.testing.assert_array_equal(gx.get("a"), np.full(4, 5, np.float32))
    for bad, why in (("100000000", "at most"), ("-1", "negative"), ("abc", "whole number")):
        with pytest.raises(DeepxError, match=why):  # bounded as op-cpu's: one line never holds the worker for long
            gx.run(i._replace(meta=(("benchmark.repeat", bad),)))
    np.testing.assert_array_equal(gx.get("a"), np.full(4, 5, np.float32))


# ---------------------------------------------------------------- row and column kernels across their size regimes
# The reductions and row-wise nn kernels pick a layout by size: a warp per row (rows up to 1024 elements, in
# registers), a block per row (up to 16384), rows streamed twice (longer), a thread per column (non-last dims), 16-byte
# packs where the row length and the pointers allow. Each regime against the CPU executor.

ROW_LENGTHS = [(1, 3000), (31, 2000), (32, 2000), (33, 1500), (1023, 64), (4096, 40), (4096, 1), (65537, 2)]


def _against_cpu(gx, inputs, program, outputs, dtype, what, by_max=()):
    """Run `program` on the GPU and the CPU executor; compare `outputs` (those in `by_max` relative to the largest
    value, like sums)."""
    from tests.gpu.test_kernels import compare

    cpu = CpuExecutor()
    for n, a in inputs.items():
        cpu.put(n, a)
        if n not in gx.tensors:
            gx.put(n, a)
    cpu.run_all(program)
    gx.run_all(program)
    for n in outputs:
        compare(gx.get(n), cpu.get(n), dtype, "max" if n in by_max else "elem", f"{what} '{n}'")
    assert not gx.fallbacks, f"{what}: ran on the CPU fallback: {dict(gx.fallbacks)}"


def _row_program(n):
    return [instr("softmax", [T("x"), V(-1)], [T("sm")]),
            instr("logsoftmax", [T("x"), V(-1)], [T("lsm")]),
            instr("layernorm", [T("x"), T("w"), T("b")], [T("ln")]),
            instr("rmsnorm", [T("x"), T("w")], [T("rms")]),
            instr("crossentropy", [T("x"), T("lab"), V(-100), V("none")], [T("ce")])]


@pytest.mark.parametrize("dtype", ["float64", "float32", "float16", "bfloat16"])
@pytest.mark.parametrize(("n", "rows"), ROW_LENGTHS)
def test_row_kernels_every_size_regime(gx, dtype, n, rows):
    from tests.kernels.kernel_ref import rand

    rng = np.random.default_rng(n * 7 + rows)
    x = rand(rng, dtype, (rows, n), -6, 6)
    lab = rng.integers(0, n, (rows,)).astype(np.int64)
    lab[0] = -100
    inputs = {"x": x, "w": rand(rng, dtype, (n,), -2, 2), "b": rand(rng, dtype, (n,), -2, 2), "lab": lab}
    what = f"rows of {n} x {rows} [{dtype}]"
    _against_cpu(gx, inputs, _row_program(n), ["sm", "lsm", "ln", "rms", "ce"], dtype, what,
                 by_max=("ln", "rms", "ce"))


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("shift", [1, 3])
def test_row_kernels_on_unaligned_tensors(gx, dtype, shift):
    """Tensors that start off a 16-byte boundary (views into other memory) take the scalar loads, and the reductions
    their scalar head before the packs."""
    from deepxd.kernels.cuda import DeviceTensor
    from tests.kernels.kernel_ref import rand

    rng = np.random.default_rng(shift)
    for n, rows in [(4096, 8), (1024, 33), (20000, 2)]:
        gx.tensors.clear()
        inputs = {"x": rand(rng, dtype, (rows, n), -6, 6), "w": rand(rng, dtype, (n,), -2, 2),
                  "b": rand(rng, dtype, (n,), -2, 2), "lab": rng.integers(0, n, (rows,)).astype(np.int32)}
        for name, a in inputs.items():
            buf = gx.alloc(a.nbytes + 64, "test", name)
            t = DeviceTensor(buf, int(buf) + shift * a.dtype.itemsize, a.shape, a.dtype)
            assert t.ptr % 16
            gx.write(t, a)
            gx.tensors[name] = t
        program = [*_row_program(n), instr("sum", [T("x"), VEC((1,))], [T("s")]),
                   instr("reducemax", [T("x"), VEC((1,))], [T("mx")]), instr("argmax", [T("x"), V(1)], [T("am")])]
        what = f"unaligned by {shift} elements, rows of {n} [{dtype}]"
        _against_cpu(gx, inputs, program, ["sm", "lsm", "ln", "rms", "ce", "s", "mx", "am"], dtype, what,
                     by_max=("ln", "rms", "ce", "s"))


@pytest.mark.parametrize("dtype", ["float64", "float32", "bfloat16", "int64", "int32", "int8"])
def test_reductions_every_layout(gx, dtype):
    from tests.kernels.kernel_ref import rand

    rng = np.random.default_rng(11)
    lo, hi = (-50, 50) if dtype.startswith("int") else (-4, 4)
    cases = [((3000, 1), (1,)), ((2000, 31), (1,)), ((2000, 33), (1,)), ((64, 1023), (1,)), ((3000, 4096), (1,)),
             ((2, 65537), (1,)), ((1, 65537), (1,)), ((70001,), (0,)),    # rows: warp, block, split over blocks
             ((5000, 37), (0,)), ((3, 70000), (0,)), ((40000, 2), (0,)),  # columns
             ((17, 300, 9), (1,)), ((6, 40, 50), (0, 1)), ((4, 5, 6, 7), (0, 2))]  # columns, the general indexer
    for shape, dims_ in cases:
        gx.tensors.clear()
        a = rand(rng, dtype, shape, lo, hi)
        ops = ["sum", "reducemax", "reducemin"] + (["argmax", "argmin"] if len(dims_) == 1 else [])
        program = [instr(op, [T("a"), VEC(dims_) if op[0] != "a" else V(dims_[0])], [T(op)]) for op in ops]
        _against_cpu(gx, {"a": a}, program, ops, dtype, f"{shape} over {dims_} [{dtype}]", by_max=("sum",))


def test_softmax_along_a_non_last_dim_and_special_values(gx):
    rng = np.random.default_rng(5)
    for shape, dim in [((50, 5000), 0), ((3000, 7), 0), ((2, 64, 300), 1), ((7, 3, 5), 0)]:
        gx.tensors.clear()
        a = rng.uniform(-8, 8, shape).astype(np.float32)
        program = [instr(op, [T("a"), V(dim)], [T(op)]) for op in ("softmax", "logsoftmax")]
        _against_cpu(gx, {"a": a}, program, ["softmax", "logsoftmax"], "float32", f"{shape} dim {dim}")
    for n in (33, 4096, 65537):  # warp, block, streamed: rows of -inf, a nan, a +inf, and -inf beside finite values
        gx.tensors.clear()
        a = rng.uniform(-8, 8, (5, n)).astype(np.float32)
        a[0] = -np.inf
        a[1, n // 2] = np.nan
        a[2, n - 1] = np.inf
        a[3, ::2] = -np.inf
        a[4, 0] = -np.inf
        program = [instr(op, [T("a"), V(-1)], [T(op)]) for op in ("softmax", "logsoftmax")]
        program += [instr(op, [T("a"), V(1)], [T(op)]) for op in ("argmax", "argmin")]
        _against_cpu(gx, {"a": a}, program, ["softmax", "logsoftmax", "argmax", "argmin"], "float32",
                     f"special values, rows of {n}")


def test_argmax_ties_go_to_the_first_index(gx):
    a = np.zeros((300, 5000), np.float32)
    a[:, 7] = 1
    a[:, 4000] = 1
    a[5, 100] = np.nan
    a[5, 200] = np.nan
    for dim, shape in ((1, a.shape), (0, a.T.shape)):
        gx.tensors.clear()
        arr = a if dim == 1 else np.ascontiguousarray(a.T)
        gx.put("a", arr)
        gx.run(instr("argmax", [T("a"), V(dim)], [T("i")]))
        got = gx.get("i")
        want = np.full(300, 7)
        want[5] = 100
        np.testing.assert_array_equal(got, want, err_msg=f"argmax over dim {dim} of {shape}")
