"""The internal ops that passes make, on the GPU: matmultransposed (cuBLAS with its transposition flags) and
fusedcolsum (the fused kernel, then the sum over axis 0), against a float64 reference and against the CPU executor;
and a training step's program through the default passes, on the device with no CPU fallback."""

from __future__ import annotations

import numpy as np
import pytest

from deepx_core.ir.dtypes import to_numpy
from deepxd.compiler import DEFAULT_PASSES, run_passes
from deepxd.kernels.cpu import CpuExecutor
from tests.compiler.helpers import context, program

pytest.importorskip("pycuda.driver", reason="PyCUDA is not installed: the CUDA kernel tests need an NVIDIA GPU "
                    "(pip install -e '.[cuda]' there: docs/cuda.md)")

TOL = {"float64": 1e-12, "float32": 1e-5, "float16": 2e-3, "bfloat16": 1.6e-2}


def _stored(shape: tuple[int, ...], transposed: bool) -> tuple[int, ...]:
    return (*shape[:-2], shape[-1], shape[-2]) if transposed else shape


@pytest.mark.parametrize("dtype", ["float64", "float32", "float16", "bfloat16"])
@pytest.mark.parametrize(("ta", "tb"), [(False, False), (True, False), (False, True), (True, True)])
@pytest.mark.parametrize(("sa", "sb"), [((33, 45), (45, 17)), ((3, 64, 96), (3, 96, 128)), ((3, 5, 7), (7, 2))])
def test_matmultransposed_against_float64(gx, dtype, ta, tb, sa, sb):
    rng = np.random.default_rng(1)
    a = rng.uniform(-1, 1, _stored(sa, ta)).astype(to_numpy(dtype))
    b = rng.uniform(-1, 1, _stored(sb, tb)).astype(to_numpy(dtype))
    gx.put("a", a)
    gx.put("b", b)
    gx.run_all(program(f"matmultransposed (tensor<{dtype}>:a, tensor<{dtype}>:b, var<bool>:{str(ta).lower()}, "
                       f"var<bool>:{str(tb).lower()}) -> (tensor<{dtype}>:c)"))
    assert not gx.fallbacks, dict(gx.fallbacks)
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    want = (np.swapaxes(a64, -1, -2) if ta else a64) @ (np.swapaxes(b64, -1, -2) if tb else b64)
    got = gx.get("c").astype(np.float64)
    assert got.shape == want.shape
    assert np.abs(got - want).max() <= TOL[dtype] * max(np.abs(want).max(), 1.0) * 4


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("keepdims", [False, True])
def test_fusedcolsum_against_the_cpu(gx, dtype, keepdims):
    rng = np.random.default_rng(2)
    inputs = {"g": rng.uniform(-1, 1, (300, 256)), "y": rng.uniform(-1, 1, (300, 256)), "r": rng.uniform(-1, 1, 256)}
    text = (f"fusedcolsum (listtensor<{dtype}>:[g y r], var<string>:in0 * (in1 > 0.0) + in2, "
            f"var<bool>:{str(keepdims).lower()}) -> (tensor<{dtype}>:c, tensor<{dtype}>:s)")
    cpu = CpuExecutor()
    for n, a in inputs.items():
        cpu.put(n, a.astype(to_numpy(dtype)))
        gx.put(n, a.astype(to_numpy(dtype)))
    cpu.run_all(program(text))
    gx.run_all(program(text))
    assert not gx.fallbacks, dict(gx.fallbacks)
    np.testing.assert_allclose(gx.get("c"), cpu.get("c"), rtol=TOL[dtype], atol=TOL[dtype])
    want = cpu.get("s").astype(np.float64)
    assert gx.get("s").shape == want.shape == ((1, 256) if keepdims else (256,))
    np.testing.assert_allclose(gx.get("s").astype(np.float64), want, rtol=TOL[dtype], atol=TOL[dtype] * 300)


STEP = """
    transpose (tensor<float32>:w, vector<int32>:[1 0]) -> (tensor<float32>:wt)
    matmul (tensor<float32>:x, tensor<float32>:wt) -> (tensor<float32>:h)
    deltensor () -> (tensor<float32>:wt)
    fused (listtensor<float32>:[up h], var<string>:in0 * (in1 > 0.0)) -> (tensor<float32>:gh)
    sum (tensor<float32>:gh, vector<int32>:[0], var<bool>:false) -> (tensor<float32>:db)
    transpose (tensor<float32>:gh, vector<int32>:[1 0]) -> (tensor<float32>:ght)
    matmul (tensor<float32>:ght, tensor<float32>:x) -> (tensor<float32>:dw)
    deltensor () -> (tensor<float32>:ght)
    deltensor () -> (tensor<float32>:gh)
    deltensor () -> (tensor<float32>:h)
"""


def test_a_training_step_after_the_passes_runs_on_the_device(gx):
    rng = np.random.default_rng(3)
    inputs = {"x": rng.uniform(-1, 1, (256, 784)).astype(np.float32),
              "w": rng.uniform(-1, 1, (512, 784)).astype(np.float32),
              "up": rng.uniform(-1, 1, (256, 512)).astype(np.float32)}
    before = program(STEP)
    after = run_passes(before, context(inputs), DEFAULT_PASSES)
    assert [i.name for i in after] == ["matmultransposed", "fusedcolsum", "matmultransposed", "deltensor", "deltensor"]
    cpu = CpuExecutor()
    for n, a in inputs.items():
        cpu.put(n, a)
        gx.put(n, a)
    cpu.run_all(before)
    gx.run_all(after)
    assert not gx.fallbacks, dict(gx.fallbacks)
    assert set(gx.tensors) == set(cpu.tensors)
    for n in ("db", "dw"):
        want = cpu.get(n).astype(np.float64)
        np.testing.assert_allclose(gx.get(n).astype(np.float64), want, rtol=1e-4,
                                   atol=1e-5 * max(1.0, np.abs(want).max()))
