"""Elementwise arithmetic, unary math, invert, todtype, comparisons and switch against float64 numpy references."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kernel_ref import (
    TOL,
    L,
    T,
    V,
    assert_close,
    assert_exact,
    dtypes_of,
    executor,
    f64,
    is_int,
    ordered,
    rand,
    random_broadcast_pair,
    random_shape,
    run,
    run_op,
)

from deepx_core.errors import DeepxError
from deepx_core.ir.dtypes import INTS, STORABLE, to_numpy


def op_dtype(ops) -> list:
    return [pytest.param(o, d, id=f"{o}-{d}") for o in ops for d in dtypes_of(o)]


SHAPES = [(), (0,), (1,), (3, 4), (2, 1, 5), (0, 3)]


# ---------------------------------------------------------------- binary, broadcasting


def _trunc_div(a: np.ndarray, b: np.ndarray, dtype: str) -> np.ndarray:
    return np.trunc(a / b) if is_int(dtype) else a / b


BINARY = {
    "add": np.add,
    "sub": np.subtract,
    "mul": np.multiply,
    "div": None,  # _trunc_div, dtype-dependent
    "max": np.maximum,
    "min": np.minimum,
    "pow": np.power,
}

def binary_inputs(rng, op: str, dtype: str, sa, sb) -> tuple[np.ndarray, np.ndarray]:
    if op == "pow":
        if is_int(dtype):
            return rand(rng, dtype, sa, -3, 3), rand(rng, dtype, sb, 0, 3)
        return rand(rng, dtype, sa, 0.5, 2.0), rand(rng, dtype, sb, -2, 2)
    if op == "div":
        return rand(rng, dtype, sa, -20, 20), rand(rng, dtype, sb, -5, 5, away=1 if is_int(dtype) else 0.5)
    if is_int(dtype):
        return rand(rng, dtype, sa, -9, 9), rand(rng, dtype, sb, -9, 9)
    return rand(rng, dtype, sa), rand(rng, dtype, sb)


def binary_ref(op: str, a: np.ndarray, b: np.ndarray, dtype: str) -> np.ndarray:
    if op == "div":
        return _trunc_div(f64(a), f64(b), dtype)
    return BINARY[op](f64(a), f64(b))


SHAPE_PAIRS = [
    ((), ()),
    ((0,), (0,)),
    ((1,), (1,)),
    ((3, 4), (3, 4)),
    ((2, 0, 3), (2, 0, 3)),
    ((3, 1), (1, 4)),
    ((2, 3, 4), (4,)),
    ((), (2, 3)),
    ((0, 3), (1, 3)),
    ((5, 1, 3), (4, 1)),
    ((1,), (0,)),
]


@pytest.mark.parametrize("op,dtype", op_dtype(BINARY))
def test_binary(op, dtype, rng):
    for sa, sb in SHAPE_PAIRS + [random_broadcast_pair(rng) for _ in range(6)]:
        a, b = binary_inputs(rng, op, dtype, sa, sb)
        got = run_op(op, {"a": a, "b": b}, [T("a", dtype), T("b", dtype)])
        assert_close(got, binary_ref(op, a, b, dtype), dtype, what=f"{op} {sa} {sb}")


@pytest.mark.parametrize("where", ["C=A", "C=B", "C=A grows", "A=B=C"])
@pytest.mark.parametrize("op,dtype", op_dtype(BINARY))
def test_binary_in_place(op, dtype, where, rng):
    sa, sb = {"C=A": ((3, 4), (4,)), "C=B": ((1, 4), (2, 3, 4)), "C=A grows": ((3, 1), (1, 4)),
              "A=B=C": ((3, 4), (3, 4))}[where]
    a, b = binary_inputs(rng, op, dtype, sa, sb)
    if where == "A=B=C":  # one tensor is both operands: a divisor for div, a non-negative exponent for pow
        a = b = (b if op == "div" else np.abs(a) if op == "pow" else a)
    ref = binary_ref(op, a, b, dtype)
    ex = executor(a=a.copy(), b=b.copy())
    bname = "a" if where == "A=B=C" else "b"
    out = "b" if where == "C=B" else "a"
    before = ex.get(out)
    run(ex, op, [T("a", dtype), T(bname, dtype)], [T(out, dtype)])
    assert_close(ex.get(out), ref, dtype, what=f"{op} in place {where}")
    if ex.get(out).shape == before.shape:
        assert ex.get(out) is before, "an in-place result of the same shape should reuse the buffer"


@pytest.mark.parametrize("dtype", ordered(INTS))
def test_int_div_truncates_and_refuses_zero(dtype):
    a = np.array([7, -7, 7, -7, 6, -1, 0], dtype=to_numpy(dtype))
    b = np.array([2, 2, -2, -2, 3, 2, 5], dtype=to_numpy(dtype))
    got = run_op("div", {"a": a, "b": b}, [T("a"), T("b")])
    assert got.tolist() == [3, -3, -3, 3, 2, 0, 0]
    b[2] = 0
    with pytest.raises(DeepxError, match="zero"):
        run_op("div", {"a": a, "b": b}, [T("a"), T("b")])


@pytest.mark.parametrize("s", [0, 0.0], ids=["int0", "float0"])
@pytest.mark.parametrize("dtype", ordered(INTS))
def test_int_divscalar_by_zero_raises(dtype, s):
    a = np.array([3, -4, 5], dtype=to_numpy(dtype))
    with pytest.raises(DeepxError):
        got = run_op("divscalar", {"a": a}, [T("a"), V(s)])
        print("divscalar by", repr(s), "gave", got)


@pytest.mark.parametrize("s", [7, 7.0], ids=["int7", "float7"])
@pytest.mark.parametrize("dtype", ordered(INTS))
def test_int_rdivscalar_by_zero_raises(dtype, s):
    a = np.array([3, 0, 5], dtype=to_numpy(dtype))
    with pytest.raises(DeepxError):
        got = run_op("rdivscalar", {"a": a}, [V(s), T("a")])
        print("rdivscalar", repr(s), "/ [3 0 5] gave", got)


# ---------------------------------------------------------------- scalar forms


def _sref(op: str, a: np.ndarray, s: float, dtype: str) -> np.ndarray:
    x = f64(a)
    return {
        "addscalar": lambda: x + s,
        "subscalar": lambda: x - s,
        "mulscalar": lambda: x * s,
        "divscalar": lambda: _trunc_div(x, np.float64(s), dtype),
        "powscalar": lambda: x**s,
        "maxscalar": lambda: np.maximum(x, s),
        "minscalar": lambda: np.minimum(x, s),
        "rsubscalar": lambda: s - x,
        "rdivscalar": lambda: _trunc_div(np.float64(s), x, dtype),
        "rpowscalar": lambda: np.float64(s) ** x,
    }[op]()


SCALAR_OPS = ["addscalar", "subscalar", "mulscalar", "divscalar", "powscalar", "maxscalar", "minscalar",
              "rsubscalar", "rdivscalar", "rpowscalar"]
REVERSED = {"rsubscalar", "rdivscalar", "rpowscalar"}


def scalar_case(op: str, dtype: str) -> tuple[list[float], float, float, float]:
    """(scalars, lo, hi, away) for the tensor operand."""
    if is_int(dtype):
        return {
            "divscalar": ([2, 2.0, -3, -3.0], -20, 20, 0),
            "powscalar": ([2, 2.0, 3, 3.0], -3, 3, 0),
            "rdivscalar": ([7, 7.0, -7, -7.0], -5, 5, 1),
            "rpowscalar": ([2, 2.0, -3, -3.0], 0, 3, 0),
        }.get(op, ([2, 2.0, -3, -3.0, 0], -9, 9, 0))
    return {
        "divscalar": ([2, 2.0, 0.75, -1.5], -4, 4, 0),
        "powscalar": ([2, 2.0, 0.5, -1.5], 0.5, 2, 0),
        "rdivscalar": ([7, 7.0, -0.5], -4, 4, 0.5),
        "rpowscalar": ([2, 2.0, 0.5], -3, 3, 0),
    }.get(op, ([2, 2.0, 0.75, -1.5, 0], -4, 4, 0))


def _scalar_args(op: str, s: float, dtype: str, a: str = "a") -> list:
    return [V(s), T(a, dtype)] if op in REVERSED else [T(a, dtype), V(s)]


@pytest.mark.parametrize("op,dtype", op_dtype(SCALAR_OPS))
def test_scalar(op, dtype, rng):
    scalars, lo, hi, away = scalar_case(op, dtype)
    for s in scalars:
        for shape in [*SHAPES, random_shape(rng)]:
            a = rand(rng, dtype, shape, lo, hi, away=away)
            got = run_op(op, {"a": a}, _scalar_args(op, s, dtype))
            assert_close(got, _sref(op, a, s, dtype), dtype, what=f"{op} s={s!r} {shape}")


@pytest.mark.parametrize("op,dtype", op_dtype(SCALAR_OPS))
def test_scalar_int_and_float_agree(op, dtype, rng):
    """deepxIR Rule: an int or a float scalar is accepted wherever a scalar is expected, with the same result."""
    _, lo, hi, away = scalar_case(op, dtype)
    a = rand(rng, dtype, (4, 5), lo, hi, away=away)
    by_int = run_op(op, {"a": a}, _scalar_args(op, 2, dtype))
    by_float = run_op(op, {"a": a}, _scalar_args(op, 2.0, dtype))
    assert_exact(by_int, by_float, f"{op} var<int32>:2 vs var<float32>:2.0")


@pytest.mark.parametrize("op,dtype", op_dtype(SCALAR_OPS))
def test_scalar_in_place(op, dtype, rng):
    scalars, lo, hi, away = scalar_case(op, dtype)
    a = rand(rng, dtype, (3, 4), lo, hi, away=away)
    ex = executor(a=a.copy())
    buf = ex.get("a")
    run(ex, op, _scalar_args(op, scalars[0], dtype), [T("a", dtype)])
    assert ex.get("a") is buf
    assert_close(ex.get("a"), _sref(op, a, scalars[0], dtype), dtype, what=f"{op} in place")


# ---------------------------------------------------------------- unary

UNARY = {
    "sqrt": (np.sqrt, 0.1, 4),
    "exp": (np.exp, -4, 4),
    "log": (np.log, 0.1, 4),
    "sin": (np.sin, -4, 4),
    "cos": (np.cos, -4, 4),
    "tan": (np.tan, -1.3, 1.3),
    "neg": (np.negative, -9, 9),
    "abs": (np.abs, -9, 9),
    "floor": (np.floor, -9, 9),
    "ceil": (np.ceil, -9, 9),
    "round": (np.rint, -9, 9),
    "trunc": (np.trunc, -9, 9),
    "log1p": (np.log1p, -0.9, 4),
    "expm1": (np.expm1, -4, 4),
}

@pytest.mark.parametrize("op,dtype", op_dtype(UNARY))
def test_unary(op, dtype, rng):
    f, lo, hi = UNARY[op]
    for shape in SHAPES + [random_shape(rng, 4) for _ in range(3)]:
        a = rand(rng, dtype, shape, lo, hi)
        got = run_op(op, {"a": a}, [T("a", dtype)])
        assert_close(got, f(f64(a)), dtype, what=f"{op} {shape}")


@pytest.mark.parametrize("op,dtype", op_dtype([*UNARY, "invert"]))
def test_unary_in_place(op, dtype, rng):
    f, lo, hi = UNARY.get(op, (None, -9, 9))
    a = rand(rng, dtype, (4, 3), lo, hi)
    ref = _invert_ref(a) if op == "invert" else f(f64(a))
    ex = executor(a=a.copy())
    buf = ex.get("a")
    run(ex, op, [T("a", dtype)], [T("a", dtype)])
    assert ex.get("a") is buf
    assert_close(ex.get("a"), ref, dtype, what=f"{op} in place")


_TORCH_UNARY = {"floor": torch.floor, "ceil": torch.ceil, "round": torch.round, "trunc": torch.trunc,
                "log1p": torch.log1p, "expm1": torch.expm1}


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("op", list(_TORCH_UNARY))
def test_rounding_log1p_expm1_as_torch(op, dtype, rng):
    """Halves (round's ties go to even), signed zeros, infinities, nan, whole numbers past 2^24, and tiny values
    where log1p and expm1 must not lose their digits: torch's values, bit for bit in float64 and float32 (signed
    zeros included), within a few ulp for log1p and expm1."""
    special = [0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 0.49999997, -0.0, 0.0, np.inf, -np.inf, np.nan, 2.0**25 + 1, -7.0,
               1e-10, -1e-10, 3e-30, -0.999]
    a = np.concatenate([np.array(special), rng.uniform(-6, 6, 200), np.round(rng.uniform(-9, 9, 50)) / 2])
    a = a.astype(to_numpy(dtype))
    got = run_op(op, {"a": a}, [T("a", dtype)])
    want = _TORCH_UNARY[op](torch.from_numpy(a)).numpy()
    if op in ("log1p", "expm1"):
        np.testing.assert_allclose(got, want, rtol=1e-15 if dtype == "float64" else 2e-7, atol=0, equal_nan=True)
    else:
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(np.signbit(got), np.signbit(want), err_msg=f"{op}: signed zeros")


def _invert_ref(a: np.ndarray) -> np.ndarray:
    if a.dtype == np.bool_:
        return np.array([not x for x in a.ravel()], dtype=bool).reshape(a.shape)
    return (-a.astype(np.int64) - 1).astype(a.dtype)



@pytest.mark.parametrize("dtype", dtypes_of("invert"))
def test_invert(dtype, rng):
    for shape in SHAPES:
        a = rand(rng, dtype, shape, -100, 100)
        got = run_op("invert", {"a": a}, [T("a", dtype)])
        assert_close(got, _invert_ref(a), dtype, what=f"invert {shape}")
    if is_int(dtype):
        info = np.iinfo(to_numpy(dtype))
        a = np.array([0, -1, info.min, info.max], dtype=to_numpy(dtype))
        got = run_op("invert", {"a": a}, [T("a")])
        assert got.tolist() == [-1, 0, info.max, info.min]


# ---------------------------------------------------------------- todtype


def _cast_source(rng, src: str, shape) -> np.ndarray:
    if src == "bool":
        return rand(rng, "bool", shape)
    if is_int(src):
        return rand(rng, src, shape, -100, 100)
    fixed = np.array([-2.75, -0.5, 0.0, 0.5, 2.75, 100.0, -100.0, 1.0])
    x = np.concatenate([fixed, rng.uniform(-100, 100, 40)]) if shape == (48,) else rng.uniform(-100, 100, shape)
    return x.astype(to_numpy(src))


@pytest.mark.parametrize("dst", ordered(STORABLE))
@pytest.mark.parametrize("src", ordered(STORABLE))
def test_todtype(src, dst, rng):
    """Cast into the output's dtype as numpy's astype does (float -> int truncates toward zero)."""
    for shape in [(48,), (), (0, 2), (2, 3)]:
        a = _cast_source(rng, src, shape)
        want = f64(a).astype(to_numpy(dst)) if src != "bool" else a.astype(to_numpy(dst))
        got = run_op("todtype", {"a": a}, [T("a", src)], out_dtype=dst)
        assert_exact(got, want, f"todtype {src}->{dst} {shape}")


def test_todtype_truncates_toward_zero():
    a = np.array([-2.75, -0.5, 0.5, 2.75, -1.0], dtype=np.float32)
    assert run_op("todtype", {"a": a}, [T("a")], out_dtype="int32").tolist() == [-2, 0, 0, 2, -1]


def test_todtype_into_existing_output():
    ex = executor(a=np.array([1.5, -2.5]), c=np.zeros(2, np.int16))
    run(ex, "todtype", [T("a")], [T("c")])
    assert ex.get("c").dtype == np.int16 and ex.get("c").tolist() == [1, -2]


# ---------------------------------------------------------------- comparisons

COMPARE = ["less", "greater", "lessscalar", "greaterscalar", "equal", "notequal", "equalscalar", "notequalscalar"]

def _ties(rng, dtype: str, shape) -> np.ndarray:
    """Small values with many ties: half-integers for floats (exact in every float dtype), ints, bools."""
    if dtype == "bool":
        return rand(rng, "bool", shape)
    x = rng.integers(-3, 4, size=shape)
    return (x * 0.5).astype(to_numpy(dtype)) if not is_int(dtype) else x.astype(to_numpy(dtype))


def _eps_list(dtype: str) -> list[float]:
    return [0] if dtype == "bool" else ([0, 1] if is_int(dtype) else [0, 0.5, 1.2])


def _compare_ref(base: str, x: np.ndarray, other: np.ndarray, eps: float | None) -> np.ndarray:
    if base == "less":
        return x < other
    if base == "greater":
        return x > other
    close = np.abs(x - other) <= eps
    return close if base == "equal" else ~close


@pytest.mark.parametrize("op,dtype", op_dtype(COMPARE))
def test_compare(op, dtype, rng):
    binary = not op.endswith("scalar")
    base = op.removesuffix("scalar")
    for sa, sb in SHAPE_PAIRS + [random_broadcast_pair(rng) for _ in range(3)]:
        a = _ties(rng, dtype, sa)
        b = _ties(rng, dtype, sb)
        scalars = [1, 1.0, 0.5] if dtype != "bool" else [1, 0]
        for s in [None] if binary else scalars:
            other = f64(b) if binary else np.float64(s)
            second = T("b", dtype) if binary else V(s)
            for eps in _eps_list(dtype) if base in ("equal", "notequal") else [None]:
                ref = _compare_ref(base, f64(a), other, eps)
                args = [T("a", dtype), second] + ([V(eps)] if eps is not None else [])
                got = run_op(op, {"a": a, "b": b}, args)
                assert_close(got, ref, "bool", what=f"{op}[{dtype}] {sa} {sb} s={s} eps={eps}")


def test_equal_eps_boundary_is_inclusive():
    a = np.array([1.0, 1.0, 1.0], dtype=np.float32)
    b = np.array([1.5, 0.5, 1.75], dtype=np.float32)
    assert run_op("equal", {"a": a, "b": b}, [T("a"), T("b"), V(0.5)]).tolist() == [True, True, False]
    assert run_op("notequal", {"a": a, "b": b}, [T("a"), T("b"), V(0.5)]).tolist() == [False, False, True]
    assert run_op("equalscalar", {"a": b}, [T("a"), V(1), V(0.5)]).tolist() == [True, True, False]
    assert run_op("notequal", {"a": a, "b": b}, [T("a"), T("b")]).tolist() == [True, True, True]


# ---------------------------------------------------------------- switch


@pytest.mark.parametrize("cases_dtype", ["bool", "int32", "int8", "int64"])
@pytest.mark.parametrize("dtype", dtypes_of("switch"))
def test_switch(dtype, cases_dtype, rng):
    n = 2 if cases_dtype == "bool" else 3
    for cshape, tshapes in [((3, 4), [(3, 4)] * n), ((3, 4), [(4,), (3, 1), (1, 1)][:n]), ((0, 4), [(4,)] * n),
                            ((), [()] * n), ((2, 1), [(1, 5)] * n)]:
        tensors = [rand(rng, dtype, s, -50, 50) for s in tshapes]
        cases = (rng.random(cshape) < 0.5) if cases_dtype == "bool" else rng.integers(0, n, cshape)
        cases = cases.astype(to_numpy(cases_dtype))
        names = [f"t{i}" for i in range(n)]
        inputs = dict(zip(names, tensors)) | {"c": cases}
        got = run_op("switch", inputs, [L(names, dtype), T("c", cases_dtype)])
        ref = np.choose(cases.astype(np.intp), np.broadcast_arrays(*tensors, cases)[:-1])
        assert_exact(got, ref, f"switch[{dtype}] cases {cases_dtype}{cshape}")


@pytest.mark.parametrize("dtype", ["float32", "int32", "bfloat16"])
def test_switch_is_where(dtype, rng):
    """where(c, x, y) arrives as switch([y x], c)."""
    x, y = rand(rng, dtype, (5, 6)), rand(rng, dtype, (6,))
    c = rng.random((5, 6)) < 0.5
    got = run_op("switch", {"x": x, "y": y, "c": c}, [L(["y", "x"]), T("c", "bool")])
    assert_exact(got, np.where(c, x, y), "where")


def test_switch_many_tensors(rng):
    n = 40
    tensors = [rng.standard_normal((3, 5)).astype(np.float32) for _ in range(n)]
    cases = rng.integers(0, n, (3, 5)).astype(np.int32)
    names = [f"t{i}" for i in range(n)]
    got = run_op("switch", dict(zip(names, tensors)) | {"c": cases}, [L(names), T("c")])
    ref = np.stack(tensors)[cases, np.arange(3)[:, None], np.arange(5)]
    assert_exact(got, ref, "switch over 40 tensors")


@pytest.mark.parametrize("bad", [2, -1])
def test_switch_case_out_of_range(bad):
    t = np.zeros(3, np.float32)
    cases = np.array([0, bad, 1], np.int32)
    with pytest.raises(DeepxError, match="out of range"):
        run_op("switch", {"x": t, "y": t, "c": cases}, [L(["x", "y"]), T("c")])


def test_tolerances_cover_float_dtypes():
    assert set(TOL) >= {d for d in STORABLE if d.startswith(("float", "bfloat"))}
