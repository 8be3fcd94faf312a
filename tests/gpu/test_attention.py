"""The flash-attention kernels (deepxd/kernels/cuda/attention.py) on the device: attention and attentiongrad against
torch's scaled_dot_product_attention and its autograd in float64 on the CPU, for head sizes 32, 64, 128, 256 and odd
ones, long sequences (many tiles, causal blocks skipped), Tq != Tk, grouped-query heads, every float dtype; none of
it falls back to the CPU kernel, and a head too large for the kernels does, with the same values; a captured CUDA
graph of both replays them bit for bit; a transformer trained on op-cuda matches op-cpu."""

from __future__ import annotations

import math

import numpy as np
import pytest

from deepx_core.ir import parse_text
from deepx_core.ir.ops import check_program
from tests.gpu.conftest import gpu_reason
from tests.kernels.kernel_ref import T, V, instr

pytestmark = pytest.mark.skipif(gpu_reason() is not None, reason=gpu_reason() or "")

torch = pytest.importorskip("torch")

# (rtol of the largest value) per dtype: the sums run in another order than torch's, in float32 for 16-bit storage
TOL = {"float64": 1e-10, "float32": 2e-5, "float16": 4e-3, "bfloat16": 3e-2}

SHAPES = [  # q, k, value size, causal
    ((2, 4, 256, 64), (2, 4, 256, 64), 64, True),
    ((1, 2, 129, 128), (1, 2, 300, 128), 128, False),
    ((3, 2, 77, 32), (3, 2, 77, 32), 32, True),
    ((1, 8, 200, 64), (1, 2, 200, 64), 64, True),  # grouped-query heads
    ((2, 1, 513, 80), (2, 1, 41, 80), 96, True),  # Tq > Tk, a head of 80 on the 128 kernels
    ((1, 1, 70, 256), (1, 1, 70, 256), 256, True),
    ((4, 33, 17), (4, 95, 17), 5, False),
]


def _reference(q, k, v, g, scale, causal):  # type: ignore[no-untyped-def]
    tq, tk, tv = (torch.tensor(a.astype(np.float64), requires_grad=True) for a in (q, k, v))
    y = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=causal, scale=scale,
                                                         enable_gqa=q.shape[:-2] != k.shape[:-2])
    y.backward(torch.tensor(g.astype(np.float64)))
    return [y.detach().numpy(), tq.grad.numpy(), tk.grad.numpy(), tv.grad.numpy()]


def _run(gx, dtype, q, k, v, g, scale, causal):  # type: ignore[no-untyped-def]
    for name, a in (("q", q), ("k", k), ("v", v), ("g", g)):
        gx.put(name, a)
    lse = "float64" if dtype == "float64" else "float32"
    attend = [T("q"), T("k"), T("v"), V(scale), V(causal)]
    gx.run(instr("attention", attend, [T("y", dtype), T("lse", lse)]))
    gx.run(instr("attentiongrad", [*attend[:3], T("y"), T("lse"), T("g"), *attend[3:]],
                 [T("dq"), T("dk"), T("dv")]))
    return [gx.get(n) for n in ("y", "dq", "dk", "dv")]


def _close(got, want, rtol, what):  # type: ignore[no-untyped-def]
    top = max(1.0, float(np.abs(want).max(initial=0.0)))
    err = np.abs(got.astype(np.float64) - want)
    assert got.shape == want.shape, what
    assert float(err.max(initial=0.0)) <= rtol * top, f"{what}: off by {err.max():.3g} (largest value {top:.3g})"


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "bfloat16"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_the_kernels_match_torch(gx, rng, dtype, shape):
    from deepx_core.ir.dtypes import to_numpy

    qs, ks, dv, causal = shape
    npdt = to_numpy(dtype)
    q, k = rng.uniform(-2, 2, qs).astype(npdt), rng.uniform(-2, 2, ks).astype(npdt)
    v, g = rng.uniform(-2, 2, (*ks[:-1], dv)).astype(npdt), rng.uniform(-1, 1, (*qs[:-1], dv)).astype(npdt)
    scale = 1 / math.sqrt(qs[-1])
    got = _run(gx, dtype, q, k, v, g, scale, causal)
    for name, a, w in zip(("y", "dq", "dk", "dv"), got, _reference(q, k, v, g, scale, causal), strict=True):
        _close(a, w, TOL[dtype], f"{name} {dtype} {shape}")
    assert not gx.fallbacks, dict(gx.fallbacks)


def test_a_head_too_large_for_the_kernels_runs_the_cpu_kernel(gx, rng):
    q, k, v = (rng.standard_normal((1, 2, 9, 300)).astype(np.float32) for _ in range(3))
    g = rng.standard_normal((1, 2, 9, 300)).astype(np.float32)
    got = _run(gx, "float32", q, k, v, g, 0.05, True)
    for name, a, w in zip(("y", "dq", "dk", "dv"), got, _reference(q, k, v, g, 0.05, True), strict=True):
        _close(a, w, 2e-5, name)
    assert gx.fallbacks["attention"] == 1 and gx.fallbacks["attentiongrad"] == 1


def test_a_captured_graph_replays_the_kernels_bit_for_bit(tmp_path):
    from deepxd.kernels.cuda import CudaExecutor

    rng = np.random.default_rng(1)
    program = parse_text("""
attention (tensor<float32>:q, tensor<float32>:k, tensor<float32>:v, var<float64>:0.125, var<bool>:true) -> (tensor<float32>:y, tensor<float32>:lse)
attentiongrad (tensor<float32>:q, tensor<float32>:k, tensor<float32>:v, tensor<float32>:y, tensor<float32>:lse, tensor<float32>:g, var<float64>:0.125, var<bool>:true) -> (tensor<float32>:dq, tensor<float32>:dk, tensor<float32>:dv)
""")  # noqa: E501
    with CudaExecutor(cache_dir=tmp_path) as ex:
        for n in ("q", "k", "v", "g"):
            ex.put(n, rng.standard_normal((2, 4, 100, 64)).astype(np.float32))
        for b in check_program(program, ex, ex.plans):
            ex.execute(b)
        want = {n: ex.get(n) for n in ("y", "lse", "dq", "dk", "dv")}
        bounds = check_program(program, ex, ex.plans)
        assert ex.capturable(bounds) is None
        captured = ex.capture(bounds)
        assert captured is not None
        assert ex.replay(captured)
        for n, w in want.items():
            np.testing.assert_array_equal(ex.get(n), w, err_msg=n)
        captured.destroy()


def test_a_transformer_trained_on_op_cuda_matches_op_cpu(monkeypatch):
    import deepx_sdk as dx
    from tests.sdk.test_attention import _transformer

    monkeypatch.delenv("DEEPX_ADDRESS", raising=False)
    monkeypatch.delenv("DEEPX_ROLES", raising=False)
    results = []
    for roles in (["heapmem", "op-cuda"], None):
        dx.connect(roles=roles)
        try:
            results.append(_transformer(5, True))
        finally:
            dx.disconnect()
    (gpu_losses, gpu_weights), (cpu_losses, cpu_weights) = results
    np.testing.assert_allclose(gpu_losses, cpu_losses, rtol=1e-4)
    for name, w in cpu_weights.items():
        np.testing.assert_allclose(gpu_weights[name], w, rtol=1e-3, atol=1e-5, err_msg=name)
