"""Matmul through MKL and the native kernels split on its OpenMP threads (deepxd/kernels/cpu/blas.py, native.py).

Each check runs in a fresh interpreter: MKL is used only where it loads before any other OpenMP runtime, and this
test process has torch (libgomp) loaded already."""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import subprocess
import sys
import textwrap

import pytest

from deepx_core.errors import DeepxError


def _mkl_installed() -> bool:
    try:
        importlib.metadata.distribution("mkl")
        importlib.metadata.distribution("intel-openmp")
    except importlib.metadata.PackageNotFoundError:
        return False
    return platform.machine().lower() in ("x86_64", "amd64")


needs_mkl = pytest.mark.skipif(not _mkl_installed(), reason="MKL is not installed (pip install 'deepx[mkl]'; x86_64)")


def _script(body: str, **env: str) -> subprocess.CompletedProcess[str]:
    """`body` in a fresh interpreter, on MKL (DEEPX_BLAS=mkl) unless `env` says otherwise: auto would take numpy's
    BLAS on a machine where it measures faster (test_auto_takes_the_library_it_measures_faster)."""
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(body)], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "DEEPX_NATIVE_BACKGROUND": "0", "DEEPX_BLAS": "mkl", **env})
    assert r.returncode == 0, r.stdout + r.stderr
    return r


@needs_mkl
def test_gemm_agrees_with_a_float64_reference_on_every_layout():
    r = _script("""
        import numpy as np
        from deepxd.kernels.cpu import blas
        from deepxd.kernels.cpu.matmul import matmul
        assert blas.describe().startswith("mkl ("), blas.describe()
        rng = np.random.default_rng(0)
        cases = [((5, 7), (7, 3)), ((1, 9), (9, 1)), ((64, 1), (1, 33)), ((4, 5, 7), (4, 7, 3)),
                 ((2, 3, 5, 7), (7, 3)), ((5, 7), (2, 7, 3)), ((2, 1, 5, 7), (2, 1, 7, 3)), ((256, 784), (784, 512)),
                 # a few columns from enough rows and depth: made as the transpose (blas.NARROW), at each end of
                 # its ranges, and just outside them
                 ((256, 512), (512, 10)), ((64, 256), (256, 4)), ((300, 300), (300, 15)), ((63, 300), (300, 10)),
                 ((64, 255), (255, 10)), ((64, 256), (256, 3))]
        assert (blas.NARROW, blas.NARROW_ROWS, blas.NARROW_DEPTH) == ((4, 15), 64, 256)
        done = 0
        for dt, tol in ((np.float32, 1e-4), (np.float64, 1e-12)):
            for sa, sb in cases:
                for ta in (False, True):
                    for tb in (False, True):
                        a = rng.standard_normal(sa[:-2] + sa[-2:][::-1] if ta else sa).astype(dt)
                        b = rng.standard_normal(sb[:-2] + sb[-2:][::-1] if tb else sb).astype(dt)
                        a, b = (np.swapaxes(a, -1, -2) if ta else a), (np.swapaxes(b, -1, -2) if tb else b)
                        ref = np.matmul(a.astype(np.float64), b.astype(np.float64))
                        out = np.full(ref.shape, np.nan, dt)
                        assert blas.gemm(a, b, out), (sa, sb, ta, tb, dt)
                        scale = np.abs(a).astype(np.float64) @ np.abs(b).astype(np.float64)
                        assert np.all(np.abs(out - ref) <= tol * scale + tol), (sa, sb, ta, tb, dt)
                        done += 1
        # what MKL is not given: numpy's matmul answers, with the same values
        a = rng.standard_normal((6, 6)).astype(np.float32)
        b = rng.standard_normal((6, 6)).astype(np.float32)
        declined = {
            "int": (a.astype(np.int64), b.astype(np.int64), np.empty((6, 6), np.int64)),
            "mixed": (a, b.astype(np.float64), np.empty((6, 6), np.float32)),
            "overlap": (a, b, a),
            "strided out": (a, b, np.empty((6, 12), np.float32)[:, ::2]),
            "strided operand": (np.empty((6, 12), np.float32)[:, ::2], b, np.empty((6, 6), np.float32)),
            "empty k": (a[:, :0], b[:0], np.empty((6, 6), np.float32)),
            "batch broadcast": (np.ones((2, 1, 6, 6), np.float32), np.ones((1, 3, 6, 6), np.float32),
                                np.empty((2, 3, 6, 6), np.float32)),
        }
        for why, (x, y, out) in declined.items():
            assert not blas.gemm(x, y, out), why
        x, y, out = declined["batch broadcast"]
        matmul(x, y, out)
        assert np.array_equal(out, np.full((2, 3, 6, 6), 6, np.float32))
        c = a.copy()
        matmul(c, b, c)  # in place: numpy's matmul, which copies first
        assert np.allclose(c, a.astype(np.float64) @ b, atol=1e-4)
        print("checked", done)
    """)
    assert "checked 112" in r.stdout


@needs_mkl
def test_skinny_products_on_the_native_loops_agree_with_a_float64_reference():
    r = _script("""
        import ctypes
        import numpy as np
        from deepxd.kernels.cpu import blas, native
        assert blas.describe().startswith("mkl ("), blas.describe()
        assert native._core() is not None and "smallk_f32" in native._core()
        used = []
        small_product = native.small_product
        def spy(*args):
            done = small_product(*args)
            used.append(done)
            return done
        native.small_product = spy
        omp = ctypes.CDLL(None)  # libiomp5, loaded globally by blas
        threads = omp.omp_get_max_threads()
        rng = np.random.default_rng(3)
        # (m, k, n): small k, small n, small m (the MLP's classifier layer and its gradients first), at the ends of
        # native.SKINNY's ranges, with tails of k, n and m that are not whole vectors, and just outside the ranges
        skinny_cases = [(256, 10, 512), (256, 512, 10), (10, 256, 512), (64, 2, 64), (100, 12, 77), (3, 7, 2000),
                        (64, 64, 2), (1000, 300, 12), (333, 17, 5), (12, 100, 1024), (5, 33, 64), (33, 17, 5),
                        (4, 1024, 32), (1, 40, 12)]
        other_cases = [(2, 1024, 33), (64, 13, 64), (64, 1, 4096), (1, 64, 4096), (13, 64, 64), (64, 64, 13),
                       (8, 1025, 64), (4096, 4, 1), (2048, 4, 20), (12, 1024, 40), (2, 1024, 4096)]
        assert native.SKINNY == (2, 12) and native.SKINNY_DEPTH == 1024 and native.SKINNY_M == 4
        work, native.SKINNY_WORK = native.SKINNY_WORK, 0  # small cases too: the loops' tails and thread shares
        checked = 0
        for dt, tol in ((np.float32, 1e-5), (np.float64, 1e-13)):
            for m, k, n in skinny_cases + other_cases:
                for ta in (False, True):
                    for tb in (False, True):
                        for pad in (0, 3):  # rows (or columns) of a larger array, NaN beyond them: read, it shows
                            a = np.full((k, m + pad) if ta else (m, k + pad), np.nan, dt)
                            b = np.full((n, k + pad) if tb else (k, n + pad), np.nan, dt)
                            a = a[:, :m].T if ta else a[:, :k]
                            b = b[:, :k].T if tb else b[:, :n]
                            a[...] = rng.standard_normal(a.shape)
                            b[...] = rng.standard_normal(b.shape)
                            ref = a.astype(np.float64) @ b.astype(np.float64)
                            out = np.full((m, n), np.nan, dt)
                            del used[:]
                            assert blas.gemm(a, b, out), (m, k, n, ta, tb, dt)
                            scale = np.abs(a).astype(np.float64) @ np.abs(b).astype(np.float64)
                            assert np.all(np.abs(out - ref) <= tol * scale + tol), (m, k, n, ta, tb, pad, dt)
                            checked += 1
                            skinny = bool(used and used[0])
                            if (m, k, n) in other_cases:
                                assert not skinny, ("skinny", m, k, n, ta, tb, dt)
                            if skinny:
                                # one thread, or more threads than rows or blocks of columns: the same bits
                                for t in (1, 7):
                                    omp.omp_set_num_threads(t)
                                    again = np.full((m, n), np.nan, dt)
                                    assert blas.gemm(a, b, again)
                                    assert again.tobytes() == out.tobytes(), (t, m, k, n, ta, tb, pad, dt)
                                omp.omp_set_num_threads(threads)
        native.SKINNY_WORK = work
        # a tiny product (a tiny MLP's) stays on MKL: opening the OpenMP team would cost more than it
        del used[:]
        assert blas.gemm(np.ones((16, 8), np.float32), np.ones((8, 8), np.float32), np.empty((16, 8), np.float32))
        assert used == [False]
        # the classifier layer's three products are skinny in every layout its forward and backward use
        for m, k, n, ta, tb in ((256, 512, 10, False, True), (256, 10, 512, False, False), (10, 256, 512, True, False)):
            a = np.ones((k, m) if ta else (m, k), np.float32)
            b = np.ones((n, k) if tb else (k, n), np.float32)
            del used[:]
            out = np.empty((m, n), np.float32)
            assert blas.gemm(a.T if ta else a, b.T if tb else b, out) and used == [True], (m, k, n)
            assert np.all(out == k)
        # native kernels switched off: MKL makes them
        native.set_enabled(False)
        del used[:]
        ones = np.ones((256, 512), np.float32)
        assert blas.gemm(ones, ones[:10].T, np.empty((256, 10), np.float32))
        assert used == [False]
        native.set_enabled(True)
        print("checked", checked)
    """)
    assert "checked 400" in r.stdout, r.stdout


@needs_mkl
def test_a_skinny_product_has_its_bits_from_the_first_call():
    """The native loops give other bits than MKL: the library is had on the spot, not after a background build."""
    r = _script("""
        import numpy as np
        from deepxd.kernels.cpu import blas, native
        assert native._background and native._core_fns is None
        rng = np.random.default_rng(0)
        a = rng.standard_normal((256, 512)).astype(np.float32)
        w = rng.standard_normal((10, 512)).astype(np.float32)
        first = np.empty((256, 10), np.float32)
        assert blas.gemm(a, w.T, first)
        assert native.wait_builds(60)
        later = np.empty((256, 10), np.float32)
        assert blas.gemm(a, w.T, later)
        assert first.tobytes() == later.tobytes()
        print("same")
    """, DEEPX_NATIVE_BACKGROUND="1")
    assert "same" in r.stdout


@needs_mkl
def test_a_model_trains_through_the_daemon_on_mkl_as_on_numpy():
    """A Linear layer's forward and backward through the embedded daemon, against float64 numpy, and the step's
    first loss the same (within float32) with MKL and with numpy's BLAS."""
    body = """
        import logging, numpy as np
        logging.basicConfig(level=logging.INFO)
        import deepx_sdk as dx, deepx_sdk.nn as nn, deepx_sdk.nn.functional as F
        from deepxd.kernels.cpu import blas
        rng = np.random.default_rng(1)
        x = rng.standard_normal((300, 200)).astype(np.float32)
        w = rng.standard_normal((200, 150)).astype(np.float32)
        t, tw = dx.tensor(x), dx.tensor(w, requires_grad=True)
        y = t @ tw
        (y * y).sum().backward()
        ref = x.astype(np.float64) @ w
        assert np.allclose(y.numpy(), ref, rtol=1e-4, atol=1e-3)
        assert np.allclose(tw.grad.numpy(), x.T.astype(np.float64) @ (2 * ref), rtol=1e-4, atol=1e-2)
        model = nn.Sequential(nn.Linear(200, 64), nn.ReLU(), nn.Linear(64, 10))
        for p, v in zip(model.parameters(), [np.full(s, 0.01 * (k + 1), np.float32) for k, s in
                                             enumerate([(64, 200), (64,), (10, 64), (10,)])]):
            p.copy_(dx.tensor(v))
        loss = F.cross_entropy(model(t), dx.tensor(rng.integers(0, 10, 300)))
        print("blas", blas.describe().split(" ")[0], "loss %.6f" % loss.item())
    """
    on = _script(body)
    off = _script(body, DEEPX_BLAS="numpy")
    assert "op-cpu: matmul on mkl" in on.stderr and "blas mkl" in on.stdout
    assert "op-cpu: matmul on numpy (blas = numpy)" in off.stderr and "blas numpy" in off.stdout
    lose = [float(r.stdout.split("loss ")[1]) for r in (on, off)]
    assert abs(lose[0] - lose[1]) <= 1e-5 * abs(lose[1])


@needs_mkl
def test_split_kernels_give_the_serial_kernels_bits():
    r = _script("""
        import numpy as np
        from deepxd.kernels.cpu import native
        from deepxd.kernels.cpu.fused import compile_expr
        assert native._core() is not None and "psgd_f32" in native._core()
        rng = np.random.default_rng(2)
        def both(run):
            native.OMP_MIN = 1 << 15
            split = run()
            native.OMP_MIN = 1 << 62
            serial = run()
            for s, t in zip(split, serial):
                assert s.tobytes() == t.tobytes()
        for dt in (np.float32, np.float64):
            for n in (1 << 15, 100_003, 1 << 18):
                x = rng.standard_normal(n).astype(dt)
                x[::97] = np.nan
                x[::89] = -0.0
                def relu():
                    out = np.empty_like(x)
                    assert native.relu(x, out)
                    return [out]
                def sgd():
                    p, b = x.copy(), x[::-1].copy()
                    assert native.sgd(p, x * 2, b, 0.1, 0.9, 0.1, 0.01, True, False, p, b)
                    return [p, b]
                def adam():
                    p, m, v = x.copy(), x * 0.5, np.abs(x)
                    assert native.adam(p, x * 2, m, v, 1e-3, 0.9, 0.999, 1e-8, 0.01, 3, True, p, m, v)
                    return [p, m, v]
                for run in (relu, sgd, adam):
                    both(run)
            for shape in ((256, 512), (1000, 40), (7, 5000)):
                a, h = rng.standard_normal(shape).astype(dt), rng.standard_normal(shape).astype(dt)
                row, col = rng.standard_normal(shape[1]).astype(dt), rng.standard_normal((shape[0], 1)).astype(dt)
                for expr, ins in (("in0 * (in1 > 0)", (a, h)), ("maximum(in0 + in1, 0)", (a, row)),
                                  ("in0 * in1 - in2", (a, col, h)), ("-in0 / (in1 + 3)", (a, h.reshape(-1)[0:1]))):
                    plan = compile_expr(expr, len(ins))
                    for sums in (False, True):
                        def fused():
                            out = np.empty(shape, dt)
                            s = np.empty(shape[1], dt) if sums else None
                            for _ in range(native.HOT + 1):
                                done = native.fused(plan, ins, out, s)
                            assert done, (expr, shape, sums)
                            return [out] + ([s] if sums else [])
                        both(fused)
                        if sums:
                            assert np.array_equal(fused()[1], fused()[0].sum(axis=0))
        assert native._fused_split, "no kernel was built with OpenMP"
        print("ok")
    """)
    assert "ok" in r.stdout


@needs_mkl
def test_a_forked_child_multiplies_and_splits_loops():
    """MKL runs on Intel's OpenMP runtime, which a fork leaves usable (gcc's libgomp hangs the child)."""
    r = _script("""
        import os, numpy as np
        from deepxd.kernels.cpu import blas, native
        def work():
            a = np.ones((300, 400), np.float32)
            out = np.empty((300, 300), np.float32)
            assert blas.gemm(a, a.T, out) and np.all(out == 400)
            x = np.arange(1 << 17, dtype=np.float32) - 1000
            r = np.empty_like(x)
            assert native.relu(x, r) and np.array_equal(r, np.maximum(x, 0))
        work()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                work()
                code = 0
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        work()
        print("ok")
    """)
    assert "ok" in r.stdout


@needs_mkl
def test_an_openmp_runtime_loaded_first_keeps_numpys_blas():
    """torch brings gcc's libgomp; MKL loaded after it would take omp_get_thread_num from it and give wrong
    products, so deepx stays on numpy's BLAS, says why, and its matmul is right."""
    r = _script("""
        import logging, numpy as np
        logging.basicConfig(level=logging.INFO)
        import torch
        from deepx_core.errors import DeepxError
        from deepxd.kernels.cpu import blas
        from deepxd.kernels.cpu.matmul import matmul
        a = np.ones((256, 784), np.float32)
        b = np.ones((784, 512), np.float32)
        out = np.empty((256, 512), np.float32)
        matmul(a, b, out)
        assert np.all(out == 784)
        assert blas.describe().startswith("numpy (another OpenMP runtime"), blas.describe()
        try:
            blas.set_mode("mkl")
        except DeepxError as e:
            print("refused:", e)
    """)
    assert "libgomp" in r.stderr and "MKL not used" in r.stderr
    assert "refused: blas = mkl, but MKL cannot be loaded" in r.stdout


def test_blas_numpy_leaves_matmul_to_numpy():
    r = _script("""
        import numpy as np
        from deepxd.kernels.cpu import blas, native
        a = np.ones((64, 64), np.float32)
        assert not blas.gemm(a, a, np.empty((64, 64), np.float32))
        assert blas.omp_dir() is None
        print(blas.describe())
    """, DEEPX_BLAS="numpy")
    assert "numpy (blas = numpy)" in r.stdout


def test_the_config_checks_blas():
    from deepxd.config import Config
    from deepxd.kernels.cpu import blas

    with pytest.raises(DeepxError, match="blas: 'openblas' must be auto, mkl or numpy"):
        Config(blas="openblas").resolved()
    with pytest.raises(DeepxError, match="must be one of auto, numpy, mkl"):
        blas.set_mode("fast")


@needs_mkl
def test_idle_mkl_threads_sleep_after_a_millisecond_unless_told_otherwise():
    body = """
        import os
        from deepxd.kernels.cpu import blas
        assert blas.mkl() is not None
        print("blocktime", os.environ["KMP_BLOCKTIME"])
    """
    env = {**{k: v for k, v in os.environ.items() if k != "KMP_BLOCKTIME"}, "DEEPX_BLAS": "mkl"}
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(body)], capture_output=True, text=True, timeout=120,
                       env=env)
    assert "blocktime 1" in r.stdout, r.stderr
    assert "blocktime 50" in _script(body, KMP_BLOCKTIME="50").stdout


@needs_mkl
def test_strides_beyond_32_bits_are_left_to_numpy():
    """Found in review: a leading dimension or a batch step past 2**31 elements wrapped in MKL's 32-bit interface
    (the product left unwritten, or every matrix of the stack taken as the first). numpy's matmul takes them."""
    r = _script("""
        import numpy as np
        from deepxd.kernels.cpu import blas
        from deepxd.kernels.cpu.matmul import matmul
        big = np.zeros((2, 46341, 46341), np.float32)  # pages never touched: no memory used
        big[0, :2, :2] = 1
        big[1, :2, :2] = 2
        a = big[:, :2, :2]  # a batch step of 46341**2 > 2**31 elements
        out = np.empty((2, 2, 2), np.float32)
        assert not blas.gemm(a, np.ones((2, 2, 2), np.float32), out)
        matmul(a, np.ones((2, 2, 2), np.float32), out)
        assert np.array_equal(out, [[[2, 2], [2, 2]], [[4, 4], [4, 4]]])
        x = np.zeros(2**31 + 8, np.float32)
        x[:3] = [1, 2, 3]
        row = x.reshape(1, -1)[:, :3]  # one row: its stride (2**31 + 8 elements) is never stepped over
        out = np.full((1, 2), -7, np.float32)
        matmul(row, np.ones((3, 2), np.float32), out)
        assert np.array_equal(out, [[6, 6]])
        # two rows 2**31 + 4 elements apart (a view made to be declined: nothing reads its second row)
        wide = np.lib.stride_tricks.as_strided(x, shape=(2, 3), strides=((2**31 + 4) * 4, 4))
        assert not blas.gemm(wide, np.ones((3, 2), np.float32), np.empty((2, 2), np.float32))
        assert not blas.gemm(np.ones((2, 3), np.float32), np.ones((3, 2), np.float32), np.empty((1, 2, 2), np.float32))
        print("ok")
    """)
    assert "ok" in r.stdout


@needs_mkl
def test_blas_numpy_set_later_runs_the_split_kernels_serially():
    r = _script("""
        import numpy as np
        from deepxd.kernels.cpu import blas, native
        from deepxd.kernels.cpu.fused import compile_expr
        x = np.random.default_rng(3).standard_normal(1 << 17).astype(np.float32)
        out = np.empty_like(x)
        assert native.relu(x, out) and "prelu_f32" in native._core()
        calls = []
        split = native._core()["prelu_f32"]
        native._core()["prelu_f32"] = lambda *a: calls.append(a) or split(*a)
        native.relu(x, out)
        assert len(calls) == 1
        blas.set_mode("numpy")
        assert blas.mkl() is None and blas.omp_dir() is None
        native.relu(x, out)
        assert len(calls) == 1 and np.array_equal(out, np.maximum(x, 0))
        a = np.ones((4, 4), np.float32)
        assert not blas.gemm(a, a, np.empty((4, 4), np.float32))
        print("ok")
    """)
    assert "ok" in r.stdout


@needs_mkl
def test_a_compiler_without_openmp_builds_every_kernel_serially(tmp_path):
    """A failed OpenMP build is logged once and not tried again; the kernels are built without it."""
    cc = tmp_path / "cc"
    cc.write_text('#!/bin/sh\nfor a in "$@"; do [ "$a" = -fopenmp ] && { echo "no openmp here" >&2; exit 1; }; done\n'
                  'exec gcc "$@"\n')
    cc.chmod(0o755)
    r = _script("""
        import logging, numpy as np
        logging.basicConfig(level=logging.INFO)
        from deepxd.kernels.cpu import native
        from deepxd.kernels.cpu.fused import compile_expr
        x = np.random.default_rng(4).standard_normal(1 << 17).astype(np.float32)
        out = np.empty_like(x)
        assert native.relu(x, out) and np.array_equal(out, np.maximum(x, 0))
        assert "prelu_f32" not in native._core()
        for expr in ("in0 * 2 + 1", "in0 - 3"):
            plan = compile_expr(expr, 1)
            for _ in range(native.HOT + 1):
                done = native.fused(plan, [x], out)
            assert done
        assert not native._fused_split
        print("ok")
    """, CC=str(cc), DEEPX_KERNEL_CACHE=str(tmp_path / "cache"))
    assert "ok" in r.stdout
    assert r.stderr.count("building with MKL's OpenMP runtime failed") == 1, r.stderr
    assert "it runs on numpy" not in r.stderr


def test_a_blas_setting_of_another_case_or_name():
    from deepxd.config import Config

    assert Config(blas=" NumPy ").resolved().blas == "numpy"
    r = _script("""
        from deepxd.kernels.cpu import blas
        print("mode", blas._mode)
    """, DEEPX_BLAS="openblas")
    assert "mode auto" in r.stdout and "DEEPX_BLAS='openblas' is none of auto, numpy, mkl; auto" in r.stderr


@needs_mkl
def test_processes_started_together_measure_in_turn_and_agree(tmp_path):
    """auto's measurement is one process's at a time: processes started together on an empty cache (a test suite's
    workers, daemons started by one script) each measured under the others' load, could choose differently, and
    the last to write won. Now they measure in turn, the first CHOICE_TIMES of them, each keeping the best figures
    so far, and the rest read the choice."""
    from deepxd.kernels.cpu.blas import CHOICE_TIMES

    body = """
        import logging
        logging.basicConfig(level=logging.INFO)
        from deepxd.kernels.cpu import blas
        print("describe", blas.describe())
    """
    env = {**os.environ, "DEEPX_NATIVE_BACKGROUND": "0", "DEEPX_BLAS": "auto",
           "DEEPX_KERNEL_CACHE": str(tmp_path / "cache")}
    procs = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(body)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for _ in range(CHOICE_TIMES + 2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    measured = [err for _, err in outs if "blas: auto measured" in err]
    assert len(measured) == CHOICE_TIMES, [err for _, err in outs]
    for k in range(1, CHOICE_TIMES + 1):  # one each: the first, the second, ...
        assert sum(f"(the best of {k} starts' measurements)" in err for err in measured) == 1, measured
    (record,) = json.loads((tmp_path / "cache" / "blas-choice.json").read_text()).values()
    assert record["times"] == CHOICE_TIMES
    lines = [out.split("describe ")[1].splitlines()[0] for out, err in outs if "blas: auto measured" not in err]
    assert len(set(lines)) == 1 and lines[0].startswith(record["blas"]), (lines, record)


@needs_mkl
def test_a_lock_held_too_long_or_a_damaged_record_does_not_stop_the_start(tmp_path):
    """A lock file held by a process that does not let go (one stopped with Ctrl-Z while measuring) is waited for
    CHOICE_LOCK_S, then done without; a record damaged or edited by hand is measured again (it stopped the start
    with a KeyError)."""

    cache = tmp_path / "cache"
    cache.mkdir()
    body = """
        import logging
        logging.basicConfig(level=logging.INFO)
        from deepxd.kernels.cpu import blas
        blas.CHOICE_LOCK_S = 0.5
        print("describe", blas.describe())
    """
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import fcntl, sys, time
        f = open({str(cache / "blas-choice.json.lock")!r}, "a")
        fcntl.lockf(f, fcntl.LOCK_EX)
        print("held", flush=True)
        time.sleep(60)
    """)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        r = _script(body, DEEPX_BLAS="auto", DEEPX_KERNEL_CACHE=str(cache))
    finally:
        holder.kill()
        holder.wait()
    assert "stayed locked for 0 s; measuring without it" in r.stderr and "blas: auto measured" in r.stderr
    for damaged in ({"blas": "mkl"}, {"blas": "numpy", "mkl_us": None, "numpy_us": 1.0, "times": 3},
                    {"blas": "mkl", "mkl_us": 1.0, "numpy_us": 2.0, "times": "three"}):
        (key,) = json.loads((cache / "blas-choice.json").read_text())
        (cache / "blas-choice.json").write_text(json.dumps({key: damaged}))
        r = _script(body, DEEPX_BLAS="auto", DEEPX_KERNEL_CACHE=str(cache))
        assert "(the best of 1 starts' measurements)" in r.stderr, (damaged, r.stderr)
        (record,) = json.loads((cache / "blas-choice.json").read_text()).values()
        assert record["times"] == 1 and record["mkl_us"] > 1.0, record


@needs_mkl
def test_auto_takes_the_library_it_measures_faster_and_keeps_the_choice(tmp_path):
    """auto times the MLP step's largest products on MKL and on numpy's BLAS at the first start on a machine, keeps
    the choice in the kernel cache, and every later process reads it there (the same library, the same bits)."""
    body = """
        import json, logging
        logging.basicConfig(level=logging.INFO)
        import numpy as np
        from deepxd.kernels.cpu import blas, native
        from deepxd.kernels.cpu.matmul import matmul
        a = np.ones((64, 32), np.float32)
        out = np.empty((64, 64), np.float32)
        matmul(a, a.T.copy(), out)
        assert np.all(out == 32)
        print("describe", blas.describe())
        print("omp", blas.omp_dir() is not None)
    """
    cache = tmp_path / "cache"
    first = _script(body, DEEPX_BLAS="auto", DEEPX_KERNEL_CACHE=str(cache))
    record = json.loads((cache / "blas-choice.json").read_text())
    (choice,) = record.values()
    assert choice["blas"] == ("numpy" if choice["numpy_us"] < 0.95 * choice["mkl_us"] else "mkl"), choice
    assert "blas: auto measured MKL" in first.stderr
    said = first.stdout.split("describe ")[1].splitlines()[0]
    assert said.startswith("numpy (auto: numpy's BLAS is faster here" if choice["blas"] == "numpy" else "mkl (")
    assert ("omp True" in first.stdout) == (choice["blas"] == "mkl")
    # the next starts measure too, until CHOICE_TIMES have, each choosing on the best figures of all so far
    from deepxd.kernels.cpu.blas import CHOICE_TIMES

    for k in range(2, CHOICE_TIMES + 1):
        (before,) = record.values()
        later = _script(body, DEEPX_BLAS="auto", DEEPX_KERNEL_CACHE=str(cache))
        assert f"(the best of {k} starts' measurements)" in later.stderr, later.stderr
        record = json.loads((cache / "blas-choice.json").read_text())
        (choice,) = record.values()
        assert choice["times"] == k
        assert choice["mkl_us"] <= before["mkl_us"] and choice["numpy_us"] <= before["numpy_us"]
        assert choice["blas"] == ("numpy" if choice["numpy_us"] < 0.95 * choice["mkl_us"] else "mkl"), choice
    said = later.stdout.split("describe ")[1].splitlines()[0]
    again = _script(body, DEEPX_BLAS="auto", DEEPX_KERNEL_CACHE=str(cache))
    assert "blas: auto measured" not in again.stderr and f"describe {said}" in again.stdout
    # a choice kept for this machine is taken as it is: numpy's here, where MKL was faster, and the other way round
    key = next(iter(record))
    flipped = {"blas": "mkl" if choice["blas"] == "numpy" else "numpy", "mkl_us": 1.0, "numpy_us": 1.0,
               "times": CHOICE_TIMES}
    (cache / "blas-choice.json").write_text(json.dumps({key: flipped}))
    third = _script(body, DEEPX_BLAS="auto", DEEPX_KERNEL_CACHE=str(cache))
    assert ("describe mkl (" in third.stdout) == (flipped["blas"] == "mkl"), third.stdout
    # DEEPX_BLAS=mkl or numpy is never measured
    forced = _script(body, DEEPX_KERNEL_CACHE=str(tmp_path / "other"))
    assert "describe mkl (" in forced.stdout and not (tmp_path / "other" / "blas-choice.json").exists()


@needs_mkl
def test_small_products_run_on_one_thread_and_the_smallest_where_auto_measured_faster(tmp_path):
    """Where auto chooses MKL, a 2-D product of SMALL_WORK multiply-adds or fewer runs on one of its threads, and one
    of NUMPY_WORK or fewer goes to numpy's BLAS if auto measured it faster on such products (blas.SMALL_SHAPES,
    timed apart); larger ones and stacks as before. A record from before small products were timed keeps its choice
    and has them measured."""
    body = """
        import ctypes, logging
        logging.basicConfig(level=logging.INFO)
        import numpy as np
        from deepxd.kernels.cpu import blas
        from deepxd.kernels.cpu.matmul import matmul
        rng = np.random.default_rng(0)
        done = []
        # small: the smallest (skinny, and one read transposed), two on one thread; a larger one, a stack
        for sa, sb, tb in (((64, 64), (64, 10), False), ((10, 64), (64, 64), True), ((64, 64), (64, 128), False),
                           ((128, 64), (64, 64), True), ((64, 128), (128, 65), False), ((2, 64, 64), (64, 128), False)):
            a = rng.standard_normal(sa).astype(np.float32)
            b = rng.standard_normal(sb[::-1] if tb else sb).astype(np.float32)
            b = b.T if tb else b
            out = np.empty(sa[:-1] + sb[-1:], np.float32)
            done.append(blas.gemm(a, b, out))
            out[...] = np.nan
            matmul(a, b, out)
            assert np.allclose(out, a.astype(np.float64) @ b, rtol=1e-5, atol=1e-4)
        lib = blas.mkl()  # (None where auto's first measurement chose numpy's BLAS)
        assert lib is None or lib.MKL_Set_Num_Threads_Local(0) == 0  # the thread's setting given back each time
        print("describe", blas.describe().split(" ")[0], "small", blas._small, blas._small_numpy, "gemm", done)
    """
    import json

    from deepxd.kernels.cpu.blas import CHOICE_TIMES, NUMPY_WORK, SMALL_WORK

    assert 64 * 64 * 10 <= NUMPY_WORK < 64 * 64 * 128 <= SMALL_WORK < 64 * 128 * 65
    cache = tmp_path / "cache"
    first = _script(body, DEEPX_BLAS="auto", DEEPX_KERNEL_CACHE=str(cache))
    assert "for small products (1 starts)" in first.stderr, first.stderr
    (key, record), = json.loads((cache / "blas-choice.json").read_text()).items()
    assert record["small_times"] == 1 and record["small_blas"] in ("mkl", "numpy")
    for small in ("numpy", "mkl"):
        kept = {"blas": "mkl", "mkl_us": 1.0, "numpy_us": 1.0, "times": CHOICE_TIMES, "small_blas": small,
                "small_mkl_us": 1.0, "small_numpy_us": 1.0, "small_times": CHOICE_TIMES}
        (cache / "blas-choice.json").write_text(json.dumps({key: kept}))
        r = _script(body, DEEPX_BLAS="auto", DEEPX_KERNEL_CACHE=str(cache))
        assert "auto measured" not in r.stderr
        mkl = small == "mkl"
        assert f"describe mkl small True {not mkl} gemm [{mkl}, {mkl}, True, True, True, True]" in r.stdout, r.stdout
    # a record without small products' figures: its choice stands, the small products are measured
    old = {"blas": "mkl", "mkl_us": 1.0, "numpy_us": 1.0, "times": CHOICE_TIMES}
    (cache / "blas-choice.json").write_text(json.dumps({key: old}))
    r = _script(body, DEEPX_BLAS="auto", DEEPX_KERNEL_CACHE=str(cache))
    assert "for the MLP step's largest products" not in r.stderr and "for small products (1 starts)" in r.stderr
    (record,) = json.loads((cache / "blas-choice.json").read_text()).values()
    assert record["blas"] == "mkl" and record["mkl_us"] == 1.0 and record["times"] == CHOICE_TIMES
    assert record["small_times"] == 1 and "describe mkl small True" in r.stdout
    # forced to MKL, every product is MKL's as it always was
    forced = _script(body, DEEPX_KERNEL_CACHE=str(cache))
    assert "small False False gemm [True, True, True, True, True, True]" in forced.stdout, forced.stdout
