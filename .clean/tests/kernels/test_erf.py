"""erf and exact gelu (Cody's rational approximations, deepxd/kernels/cpu/nn.py) against math.erf / math.erfc.

float64: relative error ~1e-15 over the whole line (dense grids and random points in each region, the tails,
the special values); float32, float16, bfloat16: within one unit in the last place of the correctly rounded value.
"""

from __future__ import annotations

import itertools
import math

import ml_dtypes
import numpy as np
import pytest
from kernel_ref import T, run_op

from deepxd.kernels.cpu import nn

#: region edges of the approximation and of the tails: erf is 1 in float64 beyond 6, erfc underflows near 27
EDGES = (0.0, 0.46875, 0.5, 4.0, 6.0, 27.0, 40.0)
SPECIAL = [0.0, -0.0, math.inf, -math.inf, math.nan, 5e-324, -5e-324, 2.2250738585072014e-308, -1e-310, 1e-300,
           1e-20, -1e-8, 0.46875, -0.46875, np.nextafter(0.46875, 1), np.nextafter(4.0, 0), 4.0, np.nextafter(4.0, 5),
           5.9, 6.0, 26.5, 27.3, 1e300, -1.7976931348623157e308]


def _points(rng: np.random.Generator) -> np.ndarray:
    parts = [np.array(SPECIAL)]
    for lo, hi in itertools.pairwise(EDGES):
        grid = np.linspace(lo, hi, 4001)
        parts += [grid, -grid, rng.uniform(lo, hi, 2000), -rng.uniform(lo, hi, 2000)]
    parts.append(np.exp(rng.uniform(math.log(1e-300), 0, 2000)) * rng.choice([-1, 1], 2000))  # tiny |x|
    return np.concatenate(parts)


def _within_one_ulp(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    """Elementwise: `got` (a float array) within one unit in its dtype's last place of `want` (float64), nan for nan."""
    with np.errstate(all="ignore"):
        ulp = np.abs(np.spacing(want.astype(got.dtype)).astype(np.float64))
        g = got.astype(np.float64)
        return (np.abs(g - want) <= ulp) | (np.isnan(g) & np.isnan(want))


def _erf_ref(x: np.ndarray) -> np.ndarray:
    return np.array([math.erf(v) for v in x.tolist()])


def _rel(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    with np.errstate(invalid="ignore", divide="ignore"):
        err = np.abs(got - want) / np.abs(want)
    err[(got == want) | (np.isnan(got) & np.isnan(want))] = 0.0
    return err


def test_erf_float64_accuracy(rng):
    x = _points(rng)
    got = np.empty_like(x)
    nn.erf(x, got)
    want = _erf_ref(x)
    normal = np.abs(want) >= np.finfo(np.float64).tiny
    err = _rel(got, want)
    worst = int(np.argmax(np.where(normal, err, 0)))
    assert err[normal].max() <= 1e-15, f"erf({x[worst]!r}) = {got[worst]!r}, math.erf {want[worst]!r}"
    # subnormal results: the same up to the last subnormal place
    assert np.all(np.abs(got - want)[~normal & ~np.isnan(want)] <= 5e-324)
    assert np.array_equal(np.isnan(got), np.isnan(x))
    assert np.array_equal(np.signbit(got), np.signbit(x))  # -0.0 stays -0.0; erf is odd
    assert got[x == math.inf].tolist() == [1.0] and got[x == -math.inf].tolist() == [-1.0]
    assert not np.any(np.abs(got) > 1.0)


def test_erf_matches_scipy_when_installed(rng):
    special = pytest.importorskip("scipy.special")
    x = _points(rng)
    got = np.empty_like(x)
    nn.erf(x, got)
    normal = np.abs(x) >= 1e-300
    assert _rel(got, special.erf(x))[normal].max() <= 1e-15


@pytest.mark.parametrize("dtype", [np.float32, np.float16, ml_dtypes.bfloat16])
def test_erf_low_precision_within_one_ulp(dtype, rng):
    with np.errstate(over="ignore"):
        x = _points(rng).astype(dtype)
    got = np.empty_like(x)
    nn.erf(x, got)
    want = _erf_ref(x.astype(np.float64))
    ok = _within_one_ulp(got, want)
    assert ok.all(), f"{int((~ok).sum())} off by more than one ulp, first at {x[~ok][:3]}"
    same = (got == want.astype(dtype)) | np.isnan(want)
    assert same.mean() > 0.999  # nearly always the correctly rounded value
    assert np.array_equal(np.signbit(got), np.signbit(x))


def test_gelu_float64_accuracy(rng):
    x = _points(rng)
    x = x[np.abs(x) < 1e300] * math.sqrt(2)
    got = np.empty_like(x)
    nn.gelu(x, "none", got)
    # x/2 erfc(-x/sqrt 2): the reference rounds x/sqrt 2, an error of about x^2 ulp in erfc that the kernel avoids
    want = np.array([0.5 * v * math.erfc(-v / math.sqrt(2)) for v in x.tolist()])
    normal = np.abs(want) >= 1e-290
    err = _rel(got, want)[normal]
    bound = 2e-15 + 4e-16 * x[normal] ** 2
    worst = int(np.argmax(err / bound))
    assert np.all(err <= bound), f"gelu({x[normal][worst]!r}) = {got[normal][worst]!r}, want {want[normal][worst]!r}"
    assert np.all(np.abs(got - want)[~normal] <= 1e-290)


def test_gelu_negative_tail_has_no_cancellation():
    x = np.array([-5.0, -10.0, -20.0, -37.0])
    got = np.empty_like(x)
    nn.gelu(x, "none", got)
    # x/2 erfc(|x|/sqrt 2): 1 + erf(x/sqrt 2) in float64 would be 0 from x = -8.3 on
    want = np.array([-1.4332578593959695e-06, -7.619853024160526e-23, -5.507248237212468e-88, -2.1184613523340935e-298])
    assert np.all(_rel(got, want) <= 2e-15)  # (values from mpmath at 50 digits)


def test_gelu_special_values():
    x = np.array([0.0, -0.0, math.inf, -math.inf, math.nan, -60.0, 60.0, 5e-324])
    got = np.empty_like(x)
    nn.gelu(x, "none", got)
    assert got[:2].tolist() == [0.0, 0.0] and np.signbit(got[1])
    assert got[2] == math.inf and np.isnan(got[3]) and np.isnan(got[4])  # -inf * 0 as in torch
    assert got[5] == 0.0 and got[6] == 60.0 and got[7] == 0.0


@pytest.mark.parametrize("dtype", ["float64", "float32", "float16", "bfloat16"])
def test_erf_op_strided_and_large(dtype, rng):
    """The executor path: several blocks (one region per block and mixed), a non-contiguous input."""
    npdt = {"float64": np.float64, "float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}[dtype]
    a = np.concatenate([rng.uniform(-0.4, 0.4, 70000), rng.uniform(1, 3, 70000), rng.uniform(-8, 8, 70000)])
    a = a.astype(npdt).reshape(-1, 2)[:, ::-1]
    got = run_op("erf", {"a": a}, [T("a", dtype)])
    want = _erf_ref(np.ascontiguousarray(a).astype(np.float64).reshape(-1)).reshape(a.shape)
    if dtype == "float64":
        assert _rel(got, want).max() <= 1e-15
    else:
        assert _within_one_ulp(got, want).all()
