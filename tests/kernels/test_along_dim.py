"""The ops that work along one dim (cumsum) against torch on the CPU, for every dtype each claims: random shapes,
every dim (negative ones too), in place and not."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kernel_ref import T, V, assert_close, dtypes_of, executor, f64, is_int, rand, run, run_op

SHAPES = [(7,), (3, 5), (2, 3, 4), (4, 1, 6), (0, 3), (3, 0), (2, 65, 3)]


def _torch(a: np.ndarray) -> torch.Tensor:
    """`a` as torch holds it for a reference: floats in float64, integers in int64 (the kernels' accumulators)."""
    return torch.from_numpy(a.astype(np.int64) if is_int(str(a.dtype)) else f64(a))


# ---------------------------------------------------------------- cumsum


def _cumsum_ref(a: np.ndarray, dim: int, reverse: bool) -> np.ndarray:
    t = _torch(a)
    if a.ndim == 0:
        return t.numpy()
    return (t.flip(dim).cumsum(dim).flip(dim) if reverse else t.cumsum(dim)).numpy()


@pytest.mark.parametrize("dtype", dtypes_of("cumsum"))
def test_cumsum(dtype, rng):
    for shape in [*SHAPES, ()]:
        for dim in range(-max(len(shape), 1), max(len(shape), 1)):
            for reverse in (False, True):
                a = rand(rng, dtype, shape, -9, 9)
                got = run_op("cumsum", {"a": a}, [T("a", dtype), V(dim), V(reverse)])
                ref = _cumsum_ref(a, dim, reverse)
                scale = _cumsum_ref(np.abs(f64(a)), dim, reverse) if not is_int(dtype) else None
                assert_close(got, ref, dtype, scale=scale, what=f"cumsum {shape} dim={dim} reverse={reverse}")


@pytest.mark.parametrize("dtype", dtypes_of("cumsum"))
def test_cumsum_in_place_and_wrapping(dtype, rng):
    """C = A: the sums replace A; integers wrap as C casts do (an int8 running past 127)."""
    a = rand(rng, dtype, (4, 50), 0, 100)
    ref = _cumsum_ref(a, 1, False)
    ex = executor(a=a.copy())
    run(ex, "cumsum", [T("a", dtype), V(1)], [T("a", dtype)])
    want = ref.astype(a.dtype) if is_int(dtype) else ref  # wraps
    assert_close(ex.get("a"), want, dtype, scale=ref, what="cumsum in place")


def test_cumsum_of_float32_adds_in_float64_as_torch():
    """1 + 1e-8 + ... : float32 running sums that add in float32 would never move; torch's CPU kernel adds in
    float64 and rounds each sum, as deepx's does."""
    a = np.full(10001, 1e-8, dtype=np.float32)
    a[0] = 1.0
    got = run_op("cumsum", {"a": a}, [T("a"), V(0)])
    np.testing.assert_array_equal(got, torch.from_numpy(a).cumsum(0).numpy())
    assert got[-1] > 1.00009
