"""Native CPU kernels (deepxd/kernels/cpu/native.py): C loops compiled at run time give numpy's values bit for bit
(signed zeros, inf and NaN included), decline what they cannot take, and are never needed: without a compiler, or
with one that fails, every kernel runs on numpy."""

from __future__ import annotations

import itertools
import math
import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from deepx_core.ir.ops import parse_fused
from deepxd.kernels.cpu import fused, native, nn, optim, reduce

pytestmark = pytest.mark.skipif(native.compiler() is None, reason="no C compiler (cc, gcc, clang) on this machine: "
                                "the native kernels are off and numpy runs every kernel (the fallback test in "
                                "test_without_a_compiler_everything_runs_on_numpy covers that)")

SPECIAL = [-0.0, 0.0, np.nan, np.inf, -np.inf, 1e-45, -1e-45, 3.0, -3.0]
SIZES = [native.RELU_MIN, native.RELU_MIN + 37, 2 * native.THREAD_MIN + 5]  # the last splits across threads


def same(a: np.ndarray, b: np.ndarray) -> None:
    """Equal values, NaN where NaN, and the same sign bits (so -0.0 differs from 0.0)."""
    np.testing.assert_array_equal(a, b)
    assert np.array_equal(np.signbit(a), np.signbit(b))


def run_native(expr: str, ins: list[np.ndarray], out: np.ndarray) -> bool:
    return native.fused(fused.compile_expr(expr, len(ins)), ins, out)


def both_backends(expr: str, ins: list[np.ndarray], shape: tuple[int, ...], dtype=np.float32):
    """The numpy tape's result and the native loop's (run HOT times, so that it compiles; the last run is checked
    to have gone native)."""
    previous = fused.set_backend("numpy")
    try:
        want = np.empty(shape, dtype)
        fused.fused(ins, expr, want)
    finally:
        fused.set_backend(previous)
    for _ in range(native.HOT):
        got = np.empty(shape, dtype)
        fused.fused(ins, expr, got)
    assert run_native(expr, ins, got), f"the native kernel declined {expr!r}"
    return want, got


def _data(rng: np.random.Generator, n: int, dtype: str) -> np.ndarray:
    a = rng.standard_normal(n).astype(dtype)
    a[: len(SPECIAL)] = SPECIAL
    return a


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("n", SIZES)
def test_relu_matches_numpy(dtype, n):
    rng = np.random.default_rng(n)
    x = _data(rng, n, dtype)
    out = np.empty_like(x)
    assert native.relu(x, out)
    same(out, np.maximum(x, 0))
    nn.relu(x, x)  # in place: the kernel's way through nn.relu
    same(x, out)


def test_relu_declines_what_it_cannot_take():
    x = np.ones((native.RELU_MIN, 2), np.float32)
    assert not native.relu(x[:, 0], np.empty(native.RELU_MIN, np.float32))  # strided
    assert not native.relu(x.reshape(-1), np.empty(2 * native.RELU_MIN, np.float64))  # another dtype
    assert not native.relu(x.reshape(-1).astype(np.float16), np.empty(2 * native.RELU_MIN, np.float16))
    buf = np.zeros(native.RELU_MIN + 1, np.float32)
    assert not native.relu(buf[1:], buf[:-1])  # overlapping at another offset: each element would read a written one


def _sgd(native_on: bool, p, g, b, *args):
    p, b = p.copy(), b.copy()
    previous = native.set_enabled(native_on)
    try:
        optim.sgd(p, g, b, *args, p, b)
    finally:
        native.set_enabled(previous)
    return p, b


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("momentum,dampening,weight_decay,nesterov",
                         [(0.9, 0.0, 0.0, False), (0.9, 0.1, 0.0, False), (0.9, 0.0, 0.01, True),
                          (0.0, 0.0, 0.1, False), (0.5, 0.5, 0.02, False), (0.0, 0.0, 0.0, False)])
@pytest.mark.parametrize("step", [1, 4])
def test_sgd_matches_numpy(dtype, momentum, dampening, weight_decay, nesterov, step):
    rng = np.random.default_rng(7)
    n = native.UPDATE_MIN + 11
    p, g, b = (_data(rng, n, dtype) for _ in range(3))
    args = (0.01, momentum, dampening, weight_decay, nesterov, step)
    want = _sgd(False, p, g, b, *args)
    got = _sgd(True, p, g, b, *args)
    same(got[0], want[0])
    same(got[1], want[1])
    # the call went native: the numpy path is not what ran
    q, c = p.copy(), b.copy()
    assert native.sgd(q, g, c, 0.01, momentum, dampening, weight_decay, nesterov, step <= 1, q, c)
    same(q, want[0])


def test_sgd_into_other_outputs_and_across_threads():
    """Outputs apart from the inputs (not in place), and an update large enough to run on several threads."""
    rng = np.random.default_rng(8)
    n = 2 * native.THREAD_MIN + 3
    p, g, b = (rng.standard_normal(n).astype(np.float32) for _ in range(3))
    po, bo = np.empty_like(p), np.empty_like(b)
    assert native.sgd(p, g, b, 0.1, 0.9, 0.0, 0.0, False, False, po, bo)
    want_b = b * np.float32(0.9) + g
    same(bo, want_b)
    same(po, p - np.float32(0.1) * want_b)
    # one output buffer given twice is refused
    assert not native.sgd(p, g, b, 0.1, 0.9, 0.0, 0.0, False, False, po, po)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("weight_decay,decoupled", [(0.0, False), (0.01, False), (0.01, True)])
def test_adam_matches_numpy(dtype, weight_decay, decoupled):
    rng = np.random.default_rng(9)
    n = native.UPDATE_MIN + 5
    p, g, m = (_data(rng, n, dtype) for _ in range(3))
    v = np.abs(_data(rng, n, dtype))
    results = []
    for on in (False, True):
        state = [p.copy(), m.copy(), v.copy()]
        previous = native.set_enabled(on)
        try:
            optim._adam(state[0], g, state[1], state[2], 1e-3, 0.9, 0.999, 1e-8, weight_decay, 7, decoupled, *state)
        finally:
            native.set_enabled(previous)
        results.append(state)
    for a, b in zip(*results):
        same(b, a)


EXPRESSIONS = ["in0 * (in1 > 0)", "maximum(in0 + in1, 0)", "minimum(in0, in1) - -in0",
               "in0 * 2.5 - abs(in1) / sqrt(in0 * in0 + 1)", "(in0 != in1) + in0 / 3", "maximum(in1, in0) * 1e300"]


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("expr", EXPRESSIONS)
@pytest.mark.parametrize("layout", ["full", "row", "scalar", "leading-one", "column"])
def test_fused_matches_the_numpy_tape(dtype, expr, layout):
    rng = np.random.default_rng(10)
    a = rng.standard_normal((96, 512)).astype(dtype)
    b = rng.standard_normal((96, 512)).astype(dtype)
    a[0, : len(SPECIAL)] = SPECIAL
    b[0, : len(SPECIAL)] = SPECIAL[::-1]
    b = {"full": b, "row": b[0].copy(), "scalar": b[0, :1].copy(), "leading-one": b[:1].copy(),
         "column": b[:, :1].copy()}[layout]
    want, got = both_backends(expr, [a, b], a.shape, dtype)
    lay = {"full": native.FULL, "row": native.ROW, "scalar": native.SCALAR, "leading-one": native.ROW,
           "column": native.COLUMN}[layout]
    text = fused.compile_expr(expr, 2).text
    assert native._fused_fns.get((text, 2, native.CTYPE[np.dtype(dtype)], (native.FULL, lay), False)), \
        "the expression was not compiled"
    same(got, want)


@pytest.mark.parametrize("shape,shapes", [
    ((256, 10), [(256, 10), (256, 10), (256, 1), ()]),  # cross-entropy's gradient: a column and a scalar
    ((4, 8, 16), [(4, 8, 16), (16,), (4, 8, 1)]),  # a row and a column in three dimensions
    ((4, 8, 16), [(4, 8, 16), (1, 1, 16), (1, 4, 8, 1)]),  # leading ones on either side
    ((2, 1, 300), [(2, 1, 300), (2, 1, 1)]),  # a column where a middle dimension is one
    ((3000, 200), [(3000, 1), (200,), (3000, 200)]),  # large enough to split its rows across threads
])
def test_fused_broadcast_layouts(shape, shapes):
    """Small tensors with a row or column input go native too (numpy's broadcasting iterator is slow on them)."""
    rng = np.random.default_rng(12)
    ins = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    expr = " * ".join(f"(in{k} - {k}.5)" for k in range(len(ins))) + " + maximum(in0, 0)"
    want, got = both_backends(expr, ins, shape)
    same(got, want)


def test_column_and_row_must_agree_on_the_row_length():
    """A row spanning two dimensions and a column (one value per last-dimension row) cannot share one loop."""
    out = np.empty((4, 8, 16), np.float32)
    ins = [np.ones((8, 16), np.float32), np.ones((4, 8, 1), np.float32)]
    assert native._layout(ins[0], out.shape) == (native.ROW, 128)
    assert native._layout(ins[1], out.shape) == (native.COLUMN, 16)
    for _ in range(native.HOT + 1):
        assert not run_native("in0 + in1", ins, out)
    assert native._layout(np.ones((4, 1, 16), np.float32), out.shape) is None  # a middle dimension broadcast


def test_fused_in_place_and_threads():
    """The output is one of the inputs (read at the same index), and a large tensor splits its rows across threads."""
    rng = np.random.default_rng(11)
    a = rng.standard_normal((2048, 300)).astype(np.float32)
    bias = rng.standard_normal(300).astype(np.float32)
    want = np.maximum(a + bias, np.float32(0))
    for _ in range(native.HOT):
        x = a.copy()
        fused.fused([x, bias], "maximum(in0 + in1, 0)", x)
    same(x, want)


def test_fused_declines_what_numpy_does_better_or_cannot_be_read():
    assert native.fused_source(parse_fused("exp(in0) + 1", 1), "float", (native.FULL,)) is None
    assert native.fused_source(parse_fused("in0 ** 2", 1), "float", (native.FULL,)) is None
    a = np.ones((128, 512), np.float32)
    for _ in range(native.HOT + 1):
        cube = np.ones((4, 32, 512), np.float32)
        assert not run_native("in0 + in1", [cube, cube[:, :1].copy()], np.empty_like(cube))  # a middle dimension
        assert not run_native("in0 + in1", [a, a.astype(np.float64)], np.empty_like(a))  # two dtypes
        assert not run_native("in0 + in1", [a.T, a.T], np.empty((512, 128), np.float32))  # strided
    buf = np.zeros(a.size + 1, np.float32)
    for _ in range(native.HOT + 1):
        assert not run_native("in0 + 1", [buf[1:]], buf[:-1])  # overlaps at another offset


def _script(body: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(body)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **env})


CHECK = """
    import logging
    import numpy as np
    from deepxd.kernels.cpu import fused, native, nn, optim
    logging.basicConfig(level=logging.INFO)
    n = native.RELU_MIN * 2
    x = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    out = np.empty_like(x)
    nn.relu(x, out)
    assert np.array_equal(out, np.maximum(x, 0))
    p, g, b = x.copy(), x * 2, x * 3
    optim.sgd(p, g, b, 0.1, 0.9, 0.0, 0.0, False, 3, p, b)
    assert np.array_equal(b, x * 3 * np.float32(0.9) + x * 2)
    for _ in range(native.HOT + 1):
        fused.fused([x, x], "maximum(in0 * in1, 1)", out)
    assert np.array_equal(out, np.maximum(x * x, 1))
    print("available", native.available(), "compiled", sum(1 for f in native._fused_fns.values() if f))
"""


def test_without_a_compiler_everything_runs_on_numpy(tmp_path):
    r = _script(CHECK, {"CC": "", "PATH": str(tmp_path), "DEEPX_KERNEL_CACHE": str(tmp_path / "cache")})
    assert r.returncode == 0, r.stderr
    assert "available False compiled 0" in r.stdout
    assert "no C compiler" in r.stderr
    assert not list((tmp_path / "cache").glob("*.so")) if (tmp_path / "cache").exists() else True


def test_a_failing_compiler_is_logged_once_and_numpy_runs(tmp_path):
    broken = tmp_path / "brokencc"  # its message is not UTF-8 either
    broken.write_text("#!/bin/sh\necho 'this compiler is broken' >&2\nprintf 'caf\\351\\n' >&2\nexit 1\n")
    broken.chmod(0o755)
    # numpy's BLAS: with MKL each library is tried twice (with OpenMP, then without), test_blas.py counts those
    r = _script(CHECK, {"CC": str(broken), "DEEPX_KERNEL_CACHE": str(tmp_path / "cache"), "DEEPX_BLAS": "numpy"})
    assert r.returncode == 0, r.stderr
    assert "compiled 0" in r.stdout
    assert "this compiler is broken" in r.stderr
    assert r.stderr.count("compiling a kernel failed") == 2  # the core library and the one expression, once each


def test_compiled_once_then_loaded_from_the_cache(tmp_path):
    # BLAS fixed: blas=auto measures at a fresh cache's first starts, and two that choose differently build different
    # libraries (what this test checks is the cache, not the choice)
    env = {"DEEPX_KERNEL_CACHE": str(tmp_path), "DEEPX_BLAS": "numpy"}
    first = _script(CHECK, env)
    assert first.returncode == 0, first.stderr
    assert "available True compiled 1" in first.stdout
    made = sorted(p.name for p in tmp_path.glob("*.so"))
    assert len(made) == 2  # the core library and the expression
    stamps = {p.name: p.stat().st_mtime_ns for p in tmp_path.glob("*.so")}
    second = _script(CHECK, env)
    assert second.returncode == 0, second.stderr
    assert {p.name: p.stat().st_mtime_ns for p in tmp_path.glob("*.so")} == stamps  # nothing rebuilt


def test_a_damaged_library_in_the_cache_is_built_again(tmp_path):
    env = {"DEEPX_KERNEL_CACHE": str(tmp_path), "DEEPX_BLAS": "numpy"}  # fixed, as in the test above
    assert _script(CHECK, env).returncode == 0
    for lib in tmp_path.glob("*.so"):
        lib.write_bytes(b"not a library")
    r = _script(CHECK, env)
    assert r.returncode == 0, r.stderr
    assert "available True compiled 1" in r.stdout
    assert r.stderr.count("does not load") == 2
    assert all(lib.read_bytes()[:4] == b"\x7fELF" for lib in tmp_path.glob("*.so"))


def test_a_cache_others_may_write_is_not_used(tmp_path):
    """A library found in the cache is loaded and run: a directory that others may write is passed over."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    (tmp_path / "tmp").mkdir()
    r = _script(CHECK, {"DEEPX_KERNEL_CACHE": str(shared), "TMPDIR": str(tmp_path / "tmp")})
    assert r.returncode == 0, r.stderr
    assert "not using" in r.stderr and "available True compiled 1" in r.stdout
    assert not list(shared.glob("*.so"))
    assert len(list((tmp_path / "tmp").glob("deepx-kernels-*/*.so"))) == 2  # the user's own directory instead


def test_switched_off_by_the_environment(tmp_path):
    r = _script(CHECK, {"DEEPX_NATIVE_KERNELS": "0", "DEEPX_KERNEL_CACHE": str(tmp_path)})
    assert r.returncode == 0, r.stderr
    assert "available False compiled 0" in r.stdout
    assert not list(tmp_path.glob("*.so"))


def test_nan_signs_and_quieting_follow_numpy():
    """The compiler folds nothing numpy computes: -(x*c) stays a product then a sign flip, a - -b a subtraction,
    0/0 a division at run time (x86's default NaN is negative), x*1 a multiplication (which quiets a signalling NaN)."""
    n = native.FUSED_MIN
    nan = np.full(n, np.nan, np.float32)
    snan = np.full(n, 0x7F800001, np.uint32).view(np.float32)
    one = np.ones(n, np.float32)
    cases = [("-(in0 * 0.5)", [nan]), ("in0 - -in1", [one, -nan]), ("in0 + 0/0", [one]), ("in0 * 1", [snan]),
             ("in0 - 0", [snan]), ("in0 / 1", [snan]), ("sqrt(in0 - 2)", [one]), ("-in0", [nan])]
    for expr, ins in cases:
        want, got = both_backends(expr, ins, (n,))
        assert got.view(np.uint32)[0] == want.view(np.uint32)[0], (expr, hex(got.view(np.uint32)[0]),
                                                                    hex(want.view(np.uint32)[0]))


def test_one_loop_serves_every_constant():
    """The numbers are passed in: `in0 * 2.5` and `in0 * 3.0` share one compiled loop, each with its own value."""
    x = np.arange(native.FUSED_MIN, dtype=np.float64)
    before = len(native._fused_fns)
    for c in (2.5, 3.0, 0.1):
        out = np.empty_like(x)
        for _ in range(native.HOT):
            fused.fused([x], f"in0 * {c} + 1", out)
        assert run_native(f"in0 * {c} + 1", [x], out)
        same(out, x * c + 1)
    assert len(native._fused_fns) <= before + 1


def test_read_only_outputs_are_refused():
    n = native.RELU_MIN
    frozen = np.frombuffer(np.ones(n, np.float32).tobytes(), np.float32)
    assert not frozen.flags.writeable
    assert not native.relu(-np.ones(n, np.float32), frozen)
    assert native.fits((np.ones(n, np.float32),), (frozen,), frozen.dtype, n) is None
    for _ in range(native.HOT + 1):
        assert not run_native("in0 + 1", [np.ones(n, np.float32)], frozen)
    assert (frozen == 1).all()


def test_an_update_in_place_whose_other_input_overlaps_is_refused():
    """param written in place while grad is the same memory one element on: each block would read what the one
    before wrote. The check refuses it and numpy runs."""
    n = native.UPDATE_MIN
    base = np.random.default_rng(0).standard_normal(n + 1).astype(np.float32)
    results = []
    for on in (False, True):
        previous = native.set_enabled(on)
        try:
            buf = base.copy()
            p, g, mom = buf[1:], buf[:-1], np.zeros(n, np.float32)
            assert native.fits((p, g), (p,), p.dtype, n) is None
            optim.sgd(p, g, mom, 0.1, 0.0, 0.0, 0.0, False, 1, p, mom)
            results.append(buf)
        finally:
            native.set_enabled(previous)
    same(results[1], results[0])


def test_fits_checks_every_array():
    a = np.zeros(64, np.float32)
    b = np.zeros(64, np.float32)
    assert native.fits((a,), (a,), a.dtype, 64) is not None  # in place
    assert native.fits((a,), (b,), a.dtype, 64) is not None  # apart
    assert native.fits((a, b), (a, a), a.dtype, 64) is None  # one buffer written twice
    assert native.fits((a,), (b,), a.dtype, 65) is None  # a size it was not told
    assert native.fits((a,), (b.astype(np.float64),), a.dtype, 64) is None
    assert native.fits((a[::2],), (b[:32],), a.dtype, 32) is None
    for x, y in itertools.permutations([a[:32], a[16:48]]):
        assert native.fits((x,), (y,), a.dtype, 32) is None


def _logits(rng: np.random.Generator, trial: int, dtype: str) -> np.ndarray:
    """A batch of logits: rows of lengths around numpy's pairwise-sum block (128), some inf, -inf or NaN."""
    n = int(rng.integers(1, 40))
    c = int(rng.choice([1, 2, 7, 8, 9, 10, 17, 64, 128, 129, 300]))
    x = (rng.standard_normal((n, c)) * rng.uniform(0.1, 30)).astype(dtype)
    if trial % 5 == 0:
        x[0, 0] = np.inf
    if trial % 7 == 0:
        x[-1] = -np.inf
    if trial % 11 == 0:
        x[0, -1] = np.nan
    return x


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_crossentropygrad_matches_numpy(dtype):
    """crossentropygrad's two C loops (numpy's exp between them) give the numpy steps' bits: rows of any length
    (numpy's pairwise sum recurses past 128), infinite and NaN logits, int32 labels, an ignore_index that is a class,
    every reduction; an all-ignored mean gives zeros."""
    rng = np.random.default_rng(11)
    modes = {"mean": 0, "sum": 1, "none": 2}
    for trial in range(120):
        x = _logits(rng, trial, dtype)
        n, c = x.shape
        ignore = int(rng.choice([-100, 0, c - 1]))
        labels = rng.integers(0, c, n)
        labels[: n // 3] = ignore if trial % 17 else labels[: n // 3]
        labels = labels.astype(np.int32 if trial % 2 else np.int64)
        reduction = ["mean", "sum", "none"][trial % 3]
        g = rng.uniform(0.5, 2, n if reduction == "none" else ()).astype(dtype)
        want = np.empty_like(x)
        native.set_enabled(False)
        try:
            nn.crossentropygrad(x, labels, np.asarray(g), ignore, reduction, want)
        finally:
            native.set_enabled(True)
        got = np.empty_like(x)
        assert native.crossentropygrad(x, labels, np.asarray(g), ignore, modes[reduction], got)
        assert got.tobytes() == want.tobytes(), (trial, n, c, reduction)
    x = rng.standard_normal((3, 4)).astype(dtype)
    got = np.full_like(x, np.nan)
    assert native.crossentropygrad(x, np.full(3, -100), np.ones((), dtype), -100, 0, got)
    assert got.tobytes() == np.zeros_like(x).tobytes()
    # declined: another dtype, a strided output, an upstream gradient of the wrong size
    labels = np.zeros(3, np.int64)
    assert native.crossentropygrad(x, labels, np.ones((), dtype), -100, 0, np.empty_like(x))
    assert not native.crossentropygrad(x.astype(np.float16), labels, np.ones((), np.float16), -100, 0,
                                       np.empty((3, 4), np.float16))
    assert not native.crossentropygrad(x, labels, np.ones((), dtype), -100, 0, np.empty((4, 3), dtype).T)
    assert not native.crossentropygrad(x, labels, np.ones(2, dtype), -100, 2, np.empty_like(x))
    assert not native.crossentropygrad(x, labels.astype(np.float32), np.ones((), dtype), -100, 0, np.empty_like(x))


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_crossentropy_rows_match_numpy(dtype):
    """crossentropy's usual batch (every label in range) sums and picks its rows in C between numpy's exp and log:
    the loss has the numpy steps' bits, for every reduction, rows past 128 and infinite or NaN logits."""
    rng = np.random.default_rng(12)
    for trial in range(90):
        x = _logits(rng, trial, dtype)
        n, c = x.shape
        labels = rng.integers(0, c, n).astype(np.int32 if trial % 2 else np.int64)
        reduction = ["mean", "sum", "none"][trial % 3]
        want = np.empty((n,) if reduction == "none" else (), dtype)
        got = want.copy()
        native.set_enabled(False)
        try:
            nn.crossentropy(x, labels, -100, reduction, want)
        finally:
            native.set_enabled(True)
        nn.crossentropy(x, labels, -100, reduction, got)
        assert got.tobytes() == want.tobytes(), (trial, n, c, reduction)
        if reduction != "none":  # the mean and the sum went through crossentropy_reduced's C loops
            again = np.empty((), dtype)
            assert native.crossentropy_reduced(x, labels, -100, 0 if reduction == "mean" else 1, again)
            assert again.tobytes() == want.tobytes()
    assert native.crossentropy_rows(np.ones((2, 3), np.float16), np.zeros(2, np.int64)) is None
    assert native.crossentropy_rows(np.ones((3, 2), np.float32).T, np.zeros(2, np.int64)) is None
    # an unusual batch is left to numpy, its output untouched: a label out of range, an ignored class among them
    x = rng.standard_normal((4, 3)).astype(dtype)
    out = np.full((), 7, dtype)
    assert not native.crossentropy_reduced(x, np.array([0, 1, 3, 2]), -100, 0, out)
    assert not native.crossentropy_reduced(x, np.array([0, -1, 2, 2]), -100, 0, out)
    assert not native.crossentropy_reduced(x, np.array([0, 1, 2, 2]), 1, 0, out)
    assert out == 7
    assert native.crossentropy_reduced(x, np.array([0, 1, 2, 2]), 3, 1, out)  # 3 is no label here


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_column_sums_match_numpy(dtype):
    """sum over leading axes (a bias's gradient) by colsum: numpy's bits, from row after row; declined where numpy
    sums pairwise (one value per row), for other dtypes, strided input and an output over the input."""
    rng = np.random.default_rng(13)
    for shape, axes in [((256, 512), (0,)), ((256, 10), (0,)), ((3, 5, 7), (0, 1)), ((2, 3, 4, 5), (0,)),
                        ((1, 9), (0,)), ((1000, 3), (0,))]:
        a = _data(rng, int(np.prod(shape)), dtype).reshape(shape)
        k = len(axes)
        got = np.empty(shape[k:], dtype)
        assert native.colsum(a, k, got)
        with np.errstate(all="ignore"):
            same(got, np.sum(a, axis=axes))
        kept = np.empty((1,) * k + shape[k:], dtype)
        reduce.sum(a, axes, True, kept)
        with np.errstate(all="ignore"):
            same(kept, np.sum(a, axis=axes, keepdims=True))
    a = rng.standard_normal((9, 1)).astype(dtype)
    assert not native.colsum(a, 1, np.empty(1, dtype))
    assert not native.colsum(a.astype(np.float16), 1, np.empty(1, np.float16))
    b = rng.standard_normal((6, 4)).astype(dtype)
    assert not native.colsum(b.T, 1, np.empty(6, dtype))
    assert not native.colsum(b, 1, b[0])


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_updates_written_over_other_inputs(dtype):
    """Each loop reads element i of every input before it writes element i of an output, so an output may be any
    one of the inputs: here the new parameter goes into the gradient's memory and the new buffer into the
    parameter's (sgd), and adam's three outputs rotate through its inputs."""
    rng = np.random.default_rng(12)
    n = native.UPDATE_MIN + 7
    p, g, b = (_data(rng, n, dtype) for _ in range(3))
    dt = np.dtype(dtype).type
    with np.errstate(all="ignore"):  # _data holds infinities and NaNs
        want_b = b * dt(0.9) + g
        want_p = p - dt(0.01) * want_b
    p2, g2, b2 = p.copy(), g.copy(), b.copy()
    assert native.sgd(p2, g2, b2, 0.01, 0.9, 0.0, 0.0, False, False, g2, p2)
    same(g2, want_p)
    same(p2, want_b)
    m, v = _data(rng, n, dtype), np.abs(_data(rng, n, dtype))
    outs = []
    for rotate in (False, True):
        q, h, mm, vv = p.copy(), g.copy(), m.copy(), v.copy()
        targets = (h, q, mm) if rotate else (q, mm, vv)  # p -> g's memory, m -> p's, v -> m's
        assert native.adam(q, h, mm, vv, 1e-3, 0.9, 0.999, 1e-8, 0.0, 3, False, *targets)
        outs.append([t.copy() for t in targets])
    for a, b_ in zip(*outs):
        same(a, b_)


def test_a_hot_expression_compiles_in_the_background_while_numpy_runs_it(tmp_path, monkeypatch):
    """By default (outside the tests) the call that makes an expression HOT starts its compile on a thread of its
    own and returns False: numpy runs it, with the same values, until the kernel is loaded; no call waits for the
    compiler."""
    monkeypatch.setenv("DEEPX_KERNEL_CACHE", str(tmp_path / "kernels"))  # a cold cache: a real compile
    previous = native.set_background(True)
    try:
        plan = fused.compile_expr("in0 * 1.25 - in1 * in1 + in0", 2)
        rng = np.random.default_rng(14)
        a, b = (rng.standard_normal(native.FUSED_MIN + 3).astype(np.float32) for _ in range(2))
        want = np.empty_like(a)
        fused.evaluate_numpy(plan, [a, b], want, np.dtype(np.float32))
        answers = []
        for _ in range(native.HOT):
            out = np.empty_like(a)
            answers.append(native.fused(plan, [a, b], out))
        assert answers == [False] * native.HOT  # the HOT-th call started the compile and did not wait for it
        assert native.wait_builds(timeout=120)
        out = np.empty_like(a)
        assert native.fused(plan, [a, b], out)
        same(out, want)
    finally:
        native.set_background(previous)


def _assert_child_exits_cleanly(pid: int, hung: str) -> None:
    """Wait for a forked child (at most 120 s: one stuck on something its parent held would never exit, so the test
    fails with `hung` instead of hanging) and assert that it exited with 0."""
    deadline = time.monotonic() + 120
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail(hung)
        time.sleep(0.05)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork() on this platform")
def test_a_forked_child_compiles_though_a_build_ran_in_the_parent(tmp_path, monkeypatch):
    """A build thread may hold the compile lock when the process forks; the child has no such thread, so it starts
    with fresh locks and compiles what it needs itself."""
    monkeypatch.setenv("DEEPX_KERNEL_CACHE", str(tmp_path / "kernels"))
    with native._lock:  # as a parent's build thread would hold it at the fork
        pid = os.fork()
        if pid == 0:  # the child: compile and run a new expression on the spot, then report through the exit code
            ok = False
            try:
                native.set_background(False)
                plan = fused.compile_expr("in0 * 0.75 + in1 - in0 * in1", 2)
                a = np.arange(native.FUSED_MIN + 1, dtype=np.float32)
                for _ in range(native.HOT):
                    native.fused(plan, [a, a], np.empty_like(a))
                ok = native.fused(plan, [a, a], np.empty_like(a))
            finally:
                os._exit(0 if ok else 1)
    _assert_child_exits_cleanly(pid, "the forked child waited for the compile lock its parent held")


def test_a_build_thread_that_cannot_start_leaves_the_expression_on_numpy(monkeypatch, tmp_path):
    """Where no thread can be had (a limit on threads; an interpreter shutting down refuses new ones), the HOT call
    still returns False and numpy runs the expression; nothing is left waiting, and a later HOT call builds it
    (found in review: the RuntimeError came out of the kernel)."""
    import threading

    monkeypatch.setenv("DEEPX_KERNEL_CACHE", str(tmp_path / "kernels"))
    previous = native.set_background(True)
    real_start = threading.Thread.start

    def refuse(self):
        if self.name == "deepx-native-build":
            raise RuntimeError("can't start new thread")
        real_start(self)

    try:
        plan = fused.compile_expr("in0 * 0.5 + in1 * 0.25 - in0", 2)
        a = np.arange(native.FUSED_MIN + 5, dtype=np.float32)
        monkeypatch.setattr(threading.Thread, "start", refuse)
        for _ in range(native.HOT + 1):
            assert not native.fused(plan, [a, a], np.empty_like(a))
        assert not native._building and native.wait_builds(timeout=1)
        monkeypatch.setattr(threading.Thread, "start", real_start)
        native.fused(plan, [a, a], np.empty_like(a))  # the next call starts the build
        assert native.wait_builds(timeout=120)
        out = np.empty_like(a)
        assert native.fused(plan, [a, a], out)
        same(out, a * np.float32(0.5) + a * np.float32(0.25) - a)
    finally:
        native.set_background(previous)


def test_a_kernel_built_while_native_kernels_are_off_is_tried_again(tmp_path, monkeypatch):
    """A build that finds native kernels turned off does not mark its expression as having no kernel: once they are
    on again, it is compiled (found in review)."""
    monkeypatch.setenv("DEEPX_KERNEL_CACHE", str(tmp_path / "kernels"))
    plan = fused.compile_expr("in0 * 0.125 + in1 - in1 * in0", 2)
    key = (plan.text, 2, "float", (native.FULL, native.FULL), False)
    previous = native.set_enabled(False)
    try:
        assert native._build_fused(key) is False
        assert key not in native._fused_fns
    finally:
        native.set_enabled(previous)
    assert native._build_fused(key)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork() on this platform")
def test_a_forked_child_runs_a_kernel_on_several_threads(tmp_path, monkeypatch):
    """The kernels' thread pool does not survive a fork: the child makes its own, so a kernel split across threads
    runs there too instead of waiting for threads that are not there (found in review)."""
    monkeypatch.setenv("DEEPX_KERNEL_CACHE", str(tmp_path / "kernels"))
    plan = fused.compile_expr("in0 * 0.375 - in1", 2)
    a = np.arange(2 * native.THREAD_MIN * native.MAX_THREADS, dtype=np.float32)
    for _ in range(native.HOT + 1):  # compiled, and the pool made, in the parent
        native.fused(plan, [a, a], np.empty_like(a))
    fused._threads()
    pid = os.fork()
    if pid == 0:
        ok = False
        try:
            out = np.empty_like(a)
            ok = native.fused(plan, [a, a], out) and bool(np.array_equal(out, a * np.float32(0.375) - a))
        finally:
            os._exit(0 if ok else 1)
    _assert_child_exits_cleanly(pid, "the forked child waited for its parent's pool threads")


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shapes", [[(256, 512), (256, 512)], [(256, 512), (512,)], [(256, 512), (256, 1)],
                                    [(300, 129), (1,)], [(40000,), (40000,)],
                                    # below FUSED_MIN: the plain loop declines, the one with column sums does not
                                    [(64, 128), (64, 128)], [(64, 10), (64, 10)]])
def test_a_prepared_fused_call_gives_fused_bits(dtype, shapes):
    """native.fused_call, the prepared form of native.fused that a program running again and again uses: the same
    values (compiled after HOT runs of the general path), with and without the column sums."""
    rng = np.random.default_rng(7)
    out_shape = shapes[0]
    ins = [rng.standard_normal(s).astype(dtype) for s in shapes]
    ins[0].reshape(-1)[::13] = np.nan
    ins[0].reshape(-1)[::17] = -0.0
    for expr in ("in0 * (in1 > 0)", "maximum(in0 + in1, 0)", "-in0 / (in1 + 3)"):
        plan = fused.compile_expr(expr, 2)
        want = np.empty(out_shape, dtype)
        fused.evaluate_numpy(plan, ins, want, np.dtype(dtype))
        call = native.fused_call(plan, shapes, np.dtype(dtype), out_shape)
        for _ in range(native.HOT + 1):
            out = np.empty(out_shape, dtype)
            done = call(ins, out)
        assert done == (math.prod(out_shape) >= native.FUSED_MIN or out_shape != shapes[1])
        if done:
            same(out, want)
        if len(out_shape) == 2:
            summed = native.fused_call(plan, shapes, np.dtype(dtype), out_shape, with_sums=True)
            for _ in range(native.HOT + 1):
                out, sums = np.empty(out_shape, dtype), np.empty(out_shape[1], dtype)
                done = summed(ins, out, sums)
            assert done
            same(out, want)
            same(sums, want.sum(axis=0))


def test_a_prepared_fused_call_declines_arrays_unlike_its_shapes():
    rng = np.random.default_rng(8)
    a, b = rng.standard_normal((256, 512)).astype(np.float32), rng.standard_normal(512).astype(np.float32)
    plan = fused.compile_expr("in0 + in1", 2)
    call = native.fused_call(plan, [(256, 512), (512,)], np.dtype(np.float32), (256, 512))
    out = np.empty((256, 512), np.float32)
    for _ in range(native.HOT):  # the general path until the loop is compiled
        call([a, b], out)
    assert call([a, b], out)
    same(out, a + b)
    assert not call([a, b[:256]], out)  # another shape
    assert not call([a.astype(np.float64), b], out)  # another dtype
    assert not call([np.asfortranarray(a), b], out)  # not C-contiguous
    assert not call([a, b], np.empty((256, 512), np.float64))
    assert not call([a, b], out.T.copy().T)  # a strided output
    assert not call([a, out[0]], out)  # the row is part of the output
    assert call([out, b], out)  # the output in place of its own full input
    same(out, a + b + b)
    ro = a.copy()
    ro.flags.writeable = False
    assert call([ro, b], out)  # read-only inputs are read
    never = native.fused_call(plan, [(3, 4), (4,)], np.dtype(np.float32), (3, 4))  # too small: numpy's
    assert not never([np.ones((3, 4), np.float32), np.ones(4, np.float32)], np.empty((3, 4), np.float32))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("momentum, dampening, weight_decay, nesterov, step", [
    (0.9, 0.0, 0.0, False, 2), (0.9, 0.1, 0.01, True, 5), (0.9, 0.0, 0.0, False, 1), (0.0, 0.0, 0.1, False, 3)])
@pytest.mark.parametrize("n", [3 * native.UPDATE_MIN + 5, 256, 512])  # the small ones: a layer's bias (SGD_CALL_MIN)
def test_a_prepared_sgd_call_gives_sgd_bits(dtype, momentum, dampening, weight_decay, nesterov, step, n):
    rng = np.random.default_rng(9)
    p, g, b = (rng.standard_normal(n).astype(dtype) for _ in range(3))
    p[::11] = -0.0
    call = native.sgd_call(np.dtype(dtype), n, 0.01, momentum, dampening, weight_decay, nesterov, step <= 1)
    assert call is not None
    p2, b2 = p.copy(), b.copy()
    assert call(p, g, b, p, b)
    native.set_enabled(False)
    try:
        optim.sgd(p2, g, b2, 0.01, momentum, dampening, weight_decay, nesterov, step, p2, b2)  # numpy's
    finally:
        native.set_enabled(True)
    same(p, p2)
    if momentum:
        same(b, b2)


def test_a_prepared_sgd_call_declines_what_sgd_must_decide():
    n = native.UPDATE_MIN
    p, g, b = (np.ones(n, np.float32) for _ in range(3))
    call = native.sgd_call(np.dtype(np.float32), n, 0.1, 0.9, 0.0, 0.0, False, False)
    assert call is not None
    assert not call(p, g, b, p.copy(), b)  # not in place
    assert not call(p, p, b, p, b)  # the gradient is the parameter
    assert not call(p, g, p, p, p)  # the buffer is the parameter
    assert not call(p, g.astype(np.float64), b, p, b)
    assert not call(p, g[: n // 2], b, p, b)
    assert np.all(p == 1) and np.all(b == 1)
    assert native.SGD_CALL_MIN == 256  # a layer's bias of 256 or more, in a program run again and again: the loop
    assert native.sgd_call(np.dtype(np.float32), 255, 0.1, 0.9, 0.0, 0.0, False, False) is None  # numpy's size
    assert native.sgd_call(np.dtype(np.float16), n, 0.1, 0.9, 0.0, 0.0, False, False) is None


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("weight_decay, step, decoupled", [(0.0, 1, False), (0.01, 7, False), (0.01, 3, True)])
@pytest.mark.parametrize("n", [native.ADAM_CALL_MIN, 10, 128, 3 * native.UPDATE_MIN + 5])
def test_a_prepared_adam_call_gives_adams_bits(dtype, weight_decay, step, decoupled, n):
    rng = np.random.default_rng(5)
    p, g, m = (rng.standard_normal(n).astype(dtype) for _ in range(3))
    v = np.abs(rng.standard_normal(n)).astype(dtype)
    p[::7] = -0.0
    call = native.adam_call(np.dtype(dtype), n, 1e-3, 0.9, 0.999, 1e-8, weight_decay, step, decoupled)
    assert call is not None
    p2, m2, v2 = p.copy(), m.copy(), v.copy()
    assert call(p, g, m, v)
    native.set_enabled(False)
    try:  # numpy's
        optim._adam(p2, g, m2, v2, 1e-3, 0.9, 0.999, 1e-8, weight_decay, step, decoupled, p2, m2, v2)
    finally:
        native.set_enabled(True)
    same(p, p2)
    same(m, m2)
    same(v, v2)


def test_adams_numbers_kept_from_the_last_update_are_those_it_would_make():
    """_adam_numbers keeps its last set (a step's updates share their numbers); a number of another type or a zero
    of another sign is another set."""
    f32, f64 = np.dtype(np.float32), np.dtype(np.float64)
    sets = [(f32, 1e-3, 0.9, 0.999, 1e-8, 0.0, 3, False), (f32, 1e-3, 0.9, 0.999, 1e-8, 0.0, 3, False),
            (f32, 1e-3, 0.9, 0.999, 1e-8, -0.0, 3, False), (f32, 1e-3, 0.9, 0.999, 0.0, -0.0, 3, False),
            (f32, 1e-3, 0.9, 0.999, -0.0, -0.0, 3, False), (f64, 1e-3, 0.9, 0.999, -0.0, -0.0, 3, False),
            (f64, 1e-3, 0.9, 0.999, -0.0, -0.0, 4, False), (f64, 1e-3, 0.9, 0.999, -0.0, -0.0, 4, True),
            (f64, 1e-3, 0.9, 0.999, -0.0, -0.0, 4, 1), (f64, 1e-3, 0.9, 0.999, -0.0, -0.0, 4.0, 1)]
    for numbers in sets:
        got, want = native._adam_numbers(*numbers), native._adam_numbers_of(*numbers)
        assert [(type(a), a.tobytes() if hasattr(a, "tobytes") else a) for a in got] == [
            (type(a), a.tobytes() if hasattr(a, "tobytes") else a) for a in want], numbers


def test_a_prepared_adam_call_declines_what_adam_must_decide():
    n = 64
    p, g, m, v = (np.ones(n, np.float32) for _ in range(4))
    call = native.adam_call(np.dtype(np.float32), n, 0.1, 0.9, 0.999, 1e-8, 0.0, 2, False)
    assert call is not None
    assert not call(p, p, m, v)  # the gradient is the parameter
    assert not call(p, g, m, m)  # one buffer for both moments
    assert not call(p, g.astype(np.float64), m, v)
    assert not call(p, g[: n // 2], m, v)
    assert not call(p, np.ones((n, 2), np.float32)[:, 0], m, v)  # a strided gradient
    assert np.all(p == 1) and np.all(m == 1) and np.all(v == 1)
    assert native.adam_call(np.dtype(np.float32), native.ADAM_CALL_MIN - 1, 0.1, 0.9, 0.999, 1e-8, 0.0, 2,
                            False) is None  # numpy's size
    assert native.adam_call(np.dtype(np.float16), n, 0.1, 0.9, 0.999, 1e-8, 0.0, 2, False) is None


def test_the_fixed_library_compiles_in_the_background_while_numpy_runs(tmp_path):
    """Its first build on a machine takes about a second: by default the first kernel call starts it on a thread
    and numpy answers, with the same values, until it is loaded (a compiler made slow here, so that the build is
    surely still running when the first calls come)."""
    slow = tmp_path / "slowcc"
    slow.write_text("#!/bin/sh\nsleep 2\nexec gcc \"$@\"\n")
    slow.chmod(0o755)
    r = _script("""
        import numpy as np
        from deepxd.kernels.cpu import native, nn, optim
        x = np.random.default_rng(3).standard_normal(native.RELU_MIN * 2).astype(np.float32)
        out = np.empty_like(x)
        first = [native.relu(x, out) for _ in range(3)]
        nn.relu(x, out)  # the kernel the op worker calls: numpy's answer meanwhile
        assert np.array_equal(out, np.maximum(x, 0))
        assert native.wait_builds(timeout=240)
        print("first", first, "then", native.relu(x, out), np.array_equal(out, np.maximum(x, 0)))
    """, {"CC": str(slow), "DEEPX_KERNEL_CACHE": str(tmp_path / "cache"), "DEEPX_NATIVE_BACKGROUND": "1",
          "DEEPX_BLAS": "numpy"})
    assert r.returncode == 0, r.stderr
    assert "first [False, False, False] then True True" in r.stdout


def test_a_prepared_fused_call_keeps_its_constants_when_the_cache_of_them_is_cleared():
    """Found in review: the prepared call kept only the address of its constants, whose array the module's cache
    dropped once 4096 other constant sets had come (a schedule's changing numbers): the loop then read freed
    memory."""
    rng = np.random.default_rng(11)
    a = rng.standard_normal((300, 200)).astype(np.float32)
    plan = fused.compile_expr("in0 * 1.75 + 0.5", 1)
    call = native.fused_call(plan, [a.shape], np.dtype(np.float32), a.shape)
    out = np.empty_like(a)
    for _ in range(native.HOT + 1):
        call([a], out)
    assert call([a], out)
    for k in range(4200):  # other numbers fill the cache past its bound; it is cleared and refilled
        native._consts_of(fused.compile_expr(f"in0 * {k + 0.25} + 1", 1), np.dtype(np.float32))
    junk = [np.full(3, 1e30, np.float32) for _ in range(2000)]  # memory the freed arrays had, written over
    out = np.empty_like(a)
    assert call([a], out)
    want = np.empty_like(a)
    fused.evaluate_numpy(plan, [a], want, np.dtype(np.float32))
    same(out, want)
    del junk


def test_a_prepared_sgd_call_made_while_the_fixed_library_builds_runs_it_once_built(tmp_path):
    """Found in review: prepared while the fixed library was still compiling in the background, the update stayed
    on numpy for the whole run (the program is prepared at its second run, before the build is done)."""
    slow = tmp_path / "slowcc"
    slow.write_text("#!/bin/sh\nsleep 2\nexec gcc \"$@\"\n")
    slow.chmod(0o755)
    r = _script("""
        import numpy as np
        from deepxd.kernels.cpu import native
        n = native.UPDATE_MIN * 2
        p, g, b = (np.ones(n, np.float32) for _ in range(3))
        call = native.sgd_call(np.dtype(np.float32), n, 0.5, 0.9, 0.0, 0.0, False, False)
        before = call(p, g, b, p, b)  # the build has started, and takes 2 s: numpy's part
        assert native.wait_builds(timeout=240)
        after = call(p, g, b, p, b)
        print("before", before, "after", after, float(p[0]), float(b[0]))
    """, {"CC": str(slow), "DEEPX_KERNEL_CACHE": str(tmp_path / "cache"), "DEEPX_NATIVE_BACKGROUND": "1",
          "DEEPX_BLAS": "numpy"})
    assert r.returncode == 0, r.stderr
    assert "before False after True 0.0500" in r.stdout  # b = 0.9 + 1 = 1.9; p = 1 - 0.5 * 1.9
