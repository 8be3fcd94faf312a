"""Kernel compilation on the GPU machine: NVRTC in the process (the default), nvcc where asked, the background warm-up,
one compilation per source however many threads ask, and the same results from either compiler."""

from __future__ import annotations

import shutil
import threading

import numpy as np
import pytest

from tests.gpu.conftest import gpu_reason
from tests.kernels.kernel_ref import VEC, T, V, instr

pytestmark = pytest.mark.skipif(gpu_reason() is not None, reason=gpu_reason() or "")

def _exp_and_sum(ex, a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    ex.put("a", a)
    ex.run(instr("exp", [T("a")], [T("b")]))
    ex.run(instr("sum", [T("b"), VEC([0]), V(False)], [T("c")]))
    return ex.get("b"), ex.get("c")


def test_nvrtc_is_the_default_and_every_module_compiles(tmp_path, gx):
    from deepxd.kernels.cuda import CudaExecutor, all_sources

    ex = CudaExecutor(cache_dir=tmp_path)
    try:
        assert ex.modules.compiler.kind == "nvrtc"
        assert ex.precompile() == len(all_sources())
        assert ex.modules.compiler.compiled == len(all_sources())
        assert ex.precompile() == 0  # all on disk now
    finally:
        ex.close()


def test_nvrtc_and_nvcc_kernels_agree(tmp_path, gx, rng):
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc is not on PATH here: nothing to compare NVRTC's kernels with")
    from deepxd.kernels.cuda import CudaExecutor

    a = rng.uniform(-3, 3, (37, 129)).astype(np.float32)
    results = {}
    for kind in ("nvrtc", "nvcc"):
        ex = CudaExecutor(cache_dir=tmp_path / kind, compiler=kind)
        try:
            assert ex.modules.compiler.kind == kind
            results[kind] = _exp_and_sum(ex, a)
            assert ex.modules.compiler.compiled >= 2
        finally:
            ex.close()
    np.testing.assert_array_equal(results["nvrtc"][0], results["nvcc"][0])
    np.testing.assert_array_equal(results["nvrtc"][1], results["nvcc"][1])
    np.testing.assert_allclose(results["nvrtc"][1], np.exp(a.astype(np.float64)).sum(0), rtol=1e-5)


def test_warm_compiles_in_the_background_and_the_executor_reuses_it(tmp_path, gx, rng):
    from deepxd.kernels.cuda import WARM_ORDER, CudaExecutor, _warm_rank, all_sources

    ex = CudaExecutor(cache_dir=tmp_path)
    try:
        thread = ex.warm()
        a = rng.uniform(-1, 1, (64,)).astype(np.float32)
        b, c = _exp_and_sum(ex, a)  # while the warm threads work: waits for or compiles what it needs, once each
        np.testing.assert_allclose(b, np.exp(a), rtol=1e-6)
        np.testing.assert_allclose(c, np.exp(a.astype(np.float64)).sum(), rtol=1e-5)
        thread.join()
        comp = ex.modules.compiler
        warmed = [s for s in all_sources() if _warm_rank(s) < len(WARM_ORDER)]
        assert all(comp.cached(s) for s, _ in warmed)
        assert comp.compiled == len(warmed)  # nothing compiled twice (the exp and sum modules were among them)
    finally:
        ex.close()
    again = CudaExecutor(cache_dir=tmp_path)
    try:
        again.warm().join()
        assert again.modules.compiler.compiled == 0
        np.testing.assert_allclose(_exp_and_sum(again, a)[1], np.exp(a.astype(np.float64)).sum(), rtol=1e-5)
    finally:
        again.close()


def test_one_source_asked_by_many_threads_compiles_once(tmp_path):
    import pycuda.driver as drv

    from deepxd.kernels.cuda._build import Compiler
    from deepxd.kernels.cuda.elementwise import source

    drv.init()
    major, minor = drv.Device(0).compute_capability()
    comp = Compiler(f"sm_{major}{minor}", tmp_path)
    out: list[bytes] = []
    threads = [threading.Thread(target=lambda: out.append(comp.cubin(source("float32"), "elementwise (float32)")))
               for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(out) == 6 and len(set(out)) == 1 and out[0]
    assert comp.compiled == 1


def test_a_compile_error_names_the_module_and_the_line(tmp_path):
    from deepx_core.errors import DeepxError
    from deepxd.kernels.cuda._build import Compiler

    comp = Compiler("sm_90", tmp_path, compiler="nvrtc")
    with pytest.raises(DeepxError, match=r"compiling the kernels of broken module failed.*undefined"):
        comp.cubin('extern "C" __global__ void k(float* x) { x[0] = not_declared_here; }', "broken module")


def test_a_short_script_exits_cleanly_while_the_warm_up_compiles(tmp_path):
    """An embedded op-cuda daemon on an empty kernel cache: the script's one op done, it ends while the background
    warm-up is compiling; closing the executor waits for the modules in flight, so the exit is clean."""
    import os
    import subprocess
    import sys

    script = ("import numpy as np, deepx_sdk as dx\n"
              "dx.connect(roles=['heapmem', 'op-cuda'])\n"
              "print(float((dx.tensor(np.ones(4, np.float32)) * 2).sum().item()))\n")
    env = {**os.environ, "DEEPX_CUDA_CACHE": str(tmp_path / "cache"), "DEEPX_CUDA_WARM": "1"}
    r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "8.0"
