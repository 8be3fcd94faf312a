"""erf, gelu and gelu's gradient against math.erf / math.erfc, on both ways they run: the native vectorised kernels
(native.special) and the numpy code (Cody's rational approximations in float64, deepxd/kernels/cpu/nn.py).

float64 (either way: Cody's approximations): relative error ~1e-15 over the whole line (dense grids and random points
in each region, the tails, the special values). float32: on numpy within one unit in the last place of the correctly
rounded value; natively, evaluated in float32, within a few (erf 3e-7 relative, gelu 6e-7, down to the last normal
result). float16, bfloat16: within one unit in the last place either way (natively through float32).
"""

from __future__ import annotations

import itertools
import math

import ml_dtypes
import numpy as np
import pytest
from kernel_ref import T, V, run_op

from deepx_core.errors import DeepxError
from deepxd.kernels.cpu import native, nn


@pytest.fixture(params=["native", "numpy"])
def kernels(request: pytest.FixtureRequest):
    """The test runs on the native kernels, then on the numpy code (native kernels off)."""
    if request.param == "native" and native.compiler() is None:
        pytest.skip("no C compiler: the native kernels are off")
    previous = native.set_enabled(request.param == "native")
    yield request.param
    native.set_enabled(previous)

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


def test_erf_float64_accuracy(rng, kernels):
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


def test_erf_matches_scipy_when_installed(rng, kernels):
    special = pytest.importorskip("scipy.special")
    x = _points(rng)
    got = np.empty_like(x)
    nn.erf(x, got)
    normal = np.abs(x) >= 1e-300
    assert _rel(got, special.erf(x))[normal].max() <= 1e-15


@pytest.mark.parametrize("dtype", [np.float32, np.float16, ml_dtypes.bfloat16])
def test_erf_low_precision_within_one_ulp(dtype, rng, kernels):
    with np.errstate(over="ignore"):
        x = _points(rng).astype(dtype)
    got = np.empty_like(x)
    nn.erf(x, got)
    want = _erf_ref(x.astype(np.float64))
    assert np.array_equal(np.signbit(got), np.signbit(x))
    if dtype == np.float32 and kernels == "native":  # evaluated in float32
        err = _rel(got.astype(np.float64), want)
        normal = np.abs(want) >= np.finfo(np.float32).tiny
        assert err[normal].max() <= 3e-7, f"erf({x[normal][np.argmax(err[normal])]!r})"
        assert np.all(np.abs(got.astype(np.float64) - want)[~normal & ~np.isnan(want)] <= 2e-45)
        return
    ok = _within_one_ulp(got, want)
    assert ok.all(), f"{int((~ok).sum())} off by more than one ulp, first at {x[~ok][:3]}"
    same = (got == want.astype(dtype)) | np.isnan(want)
    assert same.mean() > 0.999  # nearly always the correctly rounded value


def test_gelu_float64_accuracy(rng, kernels):
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


def test_gelu_negative_tail_has_no_cancellation(kernels):
    x = np.array([-5.0, -10.0, -20.0, -37.0])
    got = np.empty_like(x)
    nn.gelu(x, "none", got)
    # x/2 erfc(|x|/sqrt 2): 1 + erf(x/sqrt 2) in float64 would be 0 from x = -8.3 on
    want = np.array([-1.4332578593959695e-06, -7.619853024160526e-23, -5.507248237212468e-88, -2.1184613523340935e-298])
    assert np.all(_rel(got, want) <= 2e-15)  # (values from mpmath at 50 digits)


def test_gelu_special_values(kernels):
    x = np.array([0.0, -0.0, math.inf, -math.inf, math.nan, -60.0, 60.0, 5e-324])
    got = np.empty_like(x)
    nn.gelu(x, "none", got)
    assert got[:2].tolist() == [0.0, 0.0] and np.signbit(got[1])
    assert got[2] == math.inf and np.isnan(got[3]) and np.isnan(got[4])  # -inf * 0 as in torch
    assert got[5] == 0.0 and got[6] == 60.0 and got[7] == 0.0


@pytest.mark.parametrize("dtype", ["float64", "float32", "float16", "bfloat16"])
def test_erf_op_strided_and_large(dtype, rng, kernels):
    """The executor path: several blocks (one region per block and mixed), a non-contiguous input."""
    npdt = {"float64": np.float64, "float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}[dtype]
    a = np.concatenate([rng.uniform(-0.4, 0.4, 70000), rng.uniform(1, 3, 70000), rng.uniform(-8, 8, 70000)])
    a = a.astype(npdt).reshape(-1, 2)[:, ::-1]
    got = run_op("erf", {"a": a}, [T("a", dtype)])
    want = _erf_ref(np.ascontiguousarray(a).astype(np.float64).reshape(-1)).reshape(a.shape)
    if dtype == "float64":
        assert _rel(got, want).max() <= 1e-15
    elif dtype == "float32" and kernels == "native":
        assert _rel(got.astype(np.float64), want).max() <= 3e-7
    else:
        assert _within_one_ulp(got, want).all()


# -- gelu in float32 and gelu's gradient


def _gelu_ref(x: np.ndarray) -> np.ndarray:
    """x/2 erfc(-x/sqrt 2) in float64; exact for the float32 inputs here (the rounding of x/sqrt 2 in float64 is far
    below float32's precision)."""
    return np.array([0.5 * v * math.erfc(-v / math.sqrt(2)) if math.isfinite(v) else math.nan for v in x.tolist()])


def _gelu_inputs(rng: np.random.Generator) -> np.ndarray:
    grid = np.linspace(-16, 16, 200001)
    return np.concatenate([grid, rng.standard_normal(50000) * 3, -np.exp(rng.uniform(-30, math.log(14), 20000)),
                           np.array([0.0, -0.0, 1e-30, -1e-30, 5.0, -5.0, 13.1, -13.1, 13.5, -13.5])])


def test_gelu_float32_accuracy(rng, kernels):
    """Down to the last normal result of the negative tail (x about -13.2), relatively; beyond, to 1e-37."""
    x = _gelu_inputs(rng).astype(np.float32)
    got = np.empty_like(x)
    nn.gelu(x, "none", got)
    want = _gelu_ref(x.astype(np.float64))
    g = got.astype(np.float64)
    normal = np.abs(want) >= 1e-37
    err = _rel(g, want)
    worst = int(np.argmax(np.where(normal, err, 0)))
    bound = 6e-7 if kernels == "native" else 6e-8
    assert err[normal].max() <= bound, f"gelu({x[worst]!r}) = {got[worst]!r}, want {want[worst]!r}"
    assert np.all(np.abs(g - want)[~normal] <= 1e-37)
    assert np.array_equal(np.signbit(got[x == 0]), np.signbit(x[x == 0]))


def _gelugrad_ref(x: np.ndarray, tanh_form: bool) -> tuple[np.ndarray, np.ndarray]:
    """gelu's derivative at x in float64, and the scale to measure an error against (the size of its two terms:
    the derivative crosses zero near -0.75, where its own size means nothing)."""
    out, scale = [], []
    for v in x.tolist():
        if tanh_form:
            k = math.sqrt(2 / math.pi)
            e = math.exp(min(-2 * k * (v + 0.044715 * v ** 3), 700.0))
            s = 1 / (1 + e)  # (1 + tanh(u))/2, and 1 - s = e s without cancellation
            first, second = s, 2 * v * k * (1 + 3 * 0.044715 * v * v) * s * (e * s)
        else:
            first, second = 0.5 * math.erfc(-v / math.sqrt(2)), v * math.exp(-v * v / 2) / math.sqrt(2 * math.pi)
        out.append(first + second)
        scale.append(abs(first) + abs(second))
    return np.array(out), np.array(scale)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("dtype", ["float64", "float32", "float16", "bfloat16"])
def test_gelugrad_accuracy(dtype, approximate, rng, kernels):
    npdt = {"float64": np.float64, "float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}[dtype]
    x = np.concatenate([np.linspace(-12, 12, 20001), rng.standard_normal(20000) * 3]).astype(npdt)
    g = rng.uniform(0.5, 2, x.size).astype(npdt)
    got = np.empty_like(x)
    nn.gelugrad(x, g, approximate, got)
    d, scale = _gelugrad_ref(x.astype(np.float64), approximate == "tanh")
    want = g.astype(np.float64) * d
    # (below the dtype's normal range: to its smallest normal)
    err = np.abs(got.astype(np.float64) - want) / np.maximum(g.astype(np.float64) * scale,
                                                            float(ml_dtypes.finfo(npdt).tiny) / 1e-7)
    bound = np.full(x.size, {"float64": 1e-13, "float32": 6e-7, "float16": 1.5e-3, "bfloat16": 1.2e-2}[dtype])
    if dtype == "float32" and approximate == "tanh":  # the tail moves by exp(-2u)'s condition number, 2|u|, times
        xd = x.astype(np.float64)                     # the rounding of u in float32
        bound *= 1 + 2 * np.abs(math.sqrt(2 / math.pi) * (xd + 0.044715 * xd ** 3))
    worst = int(np.argmax(err / bound))
    assert np.all(err <= bound), f"gelugrad({x[worst]!r}) = {got[worst]!r}, want {want[worst]!r}"


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_special_values_and_in_place_natively(dtype, rng):
    if native.compiler() is None:
        pytest.skip("no C compiler: the native kernels are off")
    x = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, -60.0, 60.0, 1e-30], dtype)
    for approximate in ("none", "tanh"):
        got = np.empty_like(x)
        nn.gelu(x, approximate, got)
        assert got[:2].tolist() == [0.0, 0.0] and np.signbit(got[1]) and got[2] == np.inf
        assert np.isnan(got[4]) and got[5] == 0.0 and got[6] == 60.0
        grad = np.empty_like(x)
        nn.gelugrad(x, np.ones_like(x), approximate, grad)
        assert abs(grad[0] - 0.5) <= 1e-7 and grad[1] == grad[0] and np.isnan(grad[4])
        assert grad[5] == 0.0 and grad[6] == 1.0
    e = np.empty_like(x)
    nn.erf(x, e)
    assert e[:4].tolist() == [0.0, 0.0, 1.0, -1.0] and np.signbit(e[1]) and np.isnan(e[4])
    # in place and across the kernels' threads: the same values as into another array
    big = rng.standard_normal(3 << 18).astype(dtype)
    want = np.empty_like(big)
    nn.gelu(big, "none", want)
    nn.gelu(big, "none", big)
    np.testing.assert_array_equal(big, want)


def test_gelugrad_against_torch(rng):
    torch = pytest.importorskip("torch")
    for dtype in (np.float32, np.float64):
        x = (rng.standard_normal(10000) * 3).astype(dtype)
        g = rng.standard_normal(10000).astype(dtype)
        for approximate in ("none", "tanh"):
            got = np.empty_like(x)
            nn.gelugrad(x, g, approximate, got)
            want = torch.ops.aten.gelu_backward(torch.from_numpy(g), torch.from_numpy(x), approximate=approximate)
            tol = 1e-5 if dtype == np.float32 else 1e-12
            np.testing.assert_allclose(got, want.numpy(), rtol=tol, atol=tol)


def test_gelugrad_op_checks_its_gradient():
    a = np.zeros((2, 3), np.float32)
    with pytest.raises(DeepxError, match=r"gelugrad: the upstream gradient 'g' is float32\[3, 2\]"):
        run_op("gelugrad", {"a": a, "g": np.zeros((3, 2), np.float32)}, [T("a"), T("g")])
    with pytest.raises(DeepxError, match="gelugrad: approximate must be 'none' or 'tanh'"):
        run_op("gelugrad", {"a": a, "g": a}, [T("a"), T("g"), V("fast")])
