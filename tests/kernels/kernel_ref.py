"""Helpers for the kernel reference tests: building instructions, random inputs per dtype, tolerant comparison.

The reference of an op is computed in float64 (numpy or torch) from the *same* inputs the kernel got (already
rounded to the op's dtype), then rounded to the op's dtype and compared with a per-dtype tolerance; integers and
bools compare exactly.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from deepx_core.ir.dtypes import FLOAT8, FLOATS, INTS, to_numpy
from deepx_core.ir.instr import Instr, Param
from deepxd.kernels.cpu import CpuExecutor

F64 = np.dtype(np.float64)

#: deterministic order for parametrization (sets have none)
ORDER = ("float64", "float32", "float16", "bfloat16", "float8e5m2", "float8e4m3", "int64", "int32", "int16", "int8",
         "bool")


def ordered(dtypes: Iterable[str]) -> list[str]:
    ds = set(dtypes)
    return [d for d in ORDER if d in ds]


def dtypes_of(op: str) -> list[str]:
    """The dtypes the catalogue claims for `op`, in a stable order."""
    from deepx_core.ir.ops import OPS

    return ordered(OPS[op].dtypes)


# (rtol, atol) per float dtype: ~1-2 ulp of the dtype for the low-precision ones
TOL: dict[str, tuple[float, float]] = {
    "float64": (1e-12, 1e-12),
    "float32": (1e-5, 1e-6),
    "float16": (2e-3, 1e-4),
    "bfloat16": (1.6e-2, 1e-3),
    "float8e5m2": (0.25, 1e-2),
    "float8e4m3": (0.125, 1e-2),
}


def is_float(dtype: str) -> bool:
    return dtype in FLOATS or dtype in FLOAT8


def is_int(dtype: str) -> bool:
    return dtype in INTS


# ---------------------------------------------------------------- instructions


def T(name: str, dtype: str | None = None) -> Param:
    return Param.tensor(name, dtype)


def V(value: Any, dtype: str | None = None) -> Param:
    return Param.var(value, dtype)


def VEC(values: Sequence[int] | str) -> Param:
    return Param.vector(values)


def L(names: Sequence[str], dtype: str | None = None) -> Param:
    return Param.listtensor(names, dtype)


def instr(name: str, args: Sequence[Param] = (), returns: Sequence[Param] = (), author: str | None = None) -> Instr:
    meta = (("author", author),) if author is not None else ()
    return Instr(name, tuple(args), tuple(returns), meta)


def run(ex: CpuExecutor, name: str, args: Sequence[Param] = (), returns: Sequence[Param] = (),
        author: str | None = None) -> CpuExecutor:
    ex.run(instr(name, args, returns, author))
    return ex


def executor(**tensors: np.ndarray) -> CpuExecutor:
    ex = CpuExecutor()
    for n, a in tensors.items():
        put(ex, n, a)
    return ex


def put(ex: CpuExecutor, name: str, a: np.ndarray) -> None:
    """ex.put, keeping a 0-d array 0-d (ex.put's np.ascontiguousarray turns it into shape (1,): a known bug, checked
    by test_init_io_life.py::test_put_keeps_0d), so that the kernels' 0-d paths are still tested."""
    ex.put(name, a)
    if ex.tensors[name].shape != np.shape(a):
        ex.tensors[name] = ex.tensors[name].reshape(np.shape(a))


def run_op(name: str, inputs: dict[str, np.ndarray], args: Sequence[Param], out: str = "C",
           out_dtype: str | None = None, author: str | None = None) -> np.ndarray:
    """Put `inputs`, run `name(args) -> (tensor:out)` on a fresh executor and return the output array."""
    ex = executor(**inputs)
    run(ex, name, args, [T(out, out_dtype)], author)
    return ex.get(out)


# ---------------------------------------------------------------- inputs


def rand(rng: np.random.Generator, dtype: str, shape: Sequence[int], lo: float = -4.0, hi: float = 4.0, *,
         away: float = 0.0) -> np.ndarray:
    """Random values of `dtype`: floats uniform in [lo, hi), ints in [lo, hi], bools fair.

    away > 0 keeps |x| >= away (random sign when lo < 0), for divisors.
    """
    shape = tuple(shape)
    if dtype == "bool":
        return np.asarray(rng.random(shape) < 0.5)
    if is_int(dtype):
        x = rng.integers(int(lo), int(hi) + 1, size=shape)
        if away:
            x = np.where(np.abs(x) < away, np.where(x < 0, -int(np.ceil(away)), int(np.ceil(away))), x)
        return np.asarray(x).astype(to_numpy(dtype))
    x = rng.uniform(lo, hi, size=shape)
    if away:
        x = np.where(np.abs(x) < away, np.copysign(away, x) + x, x)
    return np.asarray(x).astype(to_numpy(dtype))


def random_shape(rng: np.random.Generator, max_rank: int = 3) -> tuple[int, ...]:
    """A small random shape: rank 0..max_rank, dims 1..5, and now and then a 0."""
    rank = int(rng.integers(0, max_rank + 1))
    return tuple(int(d) if rng.random() > 0.08 else 0 for d in rng.integers(1, 6, rank))


def random_broadcast_pair(rng: np.random.Generator) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Two shapes that broadcast (numpy rules): drop leading dims and set some dims to 1 in each."""
    out = random_shape(rng)

    def operand() -> tuple[int, ...]:
        s = out[int(rng.integers(0, len(out) + 1)):]
        return tuple(1 if rng.random() < 0.3 else d for d in s)

    return operand(), operand()


def f64(a: np.ndarray) -> np.ndarray:
    return np.asarray(a).astype(F64)


# ---------------------------------------------------------------- comparison


def assert_close(got: np.ndarray, ref: np.ndarray | float, dtype: str, *, scale: np.ndarray | None = None,
                 rtol: float | None = None, atol: float | None = None, what: str = "") -> None:
    """`got` (the kernel's output, of `dtype`) against a float64 (or exact) reference.

    Floats: the reference is rounded to `dtype` first, then |got - ref| <= rtol * (|ref| or scale) + atol, with
    nan matching nan and infinities matching exactly. Ints and bool: exact, after casting the reference.
    `scale` is the magnitude to measure the error against when cancellation makes |ref| meaningless (sums, matmul).
    """
    got = np.asarray(got)
    npdt = to_numpy(dtype)
    ref = np.asarray(ref)
    label = f"{what} [{dtype}]"
    assert got.dtype == npdt, f"{label}: output dtype {got.dtype}, expected {npdt}"
    assert got.shape == ref.shape, f"{label}: output shape {got.shape}, expected {ref.shape}"
    if not is_float(dtype):
        want = ref.astype(npdt) if ref.dtype != npdt else ref
        if not np.array_equal(got, want):
            bad = np.argwhere(got != want)[:5]
            raise AssertionError(
                f"{label}: {int((got != want).sum())} of {got.size} elements differ; first at {bad.tolist()}: "
                f"got {[got[tuple(i)] for i in bad]}, expected {[want[tuple(i)] for i in bad]}"
            )
        return
    rt, at = TOL[dtype]
    rt = rt if rtol is None else rtol
    at = at if atol is None else atol
    r = ref.astype(F64).astype(npdt).astype(F64)
    g = got.astype(F64)
    mag = np.abs(r) if scale is None else np.maximum(np.abs(r), np.asarray(scale, dtype=F64))
    with np.errstate(invalid="ignore"):
        both_nan = np.isnan(g) & np.isnan(r)
        same_inf = np.isinf(g) & np.isinf(r) & (np.sign(g) == np.sign(r))
        err = np.abs(g - r)
        ok = both_nan | same_inf | (err <= rt * mag + at)
    if not ok.all():
        bad = np.argwhere(~ok)[:5]
        raise AssertionError(
            f"{label}: {int((~ok).sum())} of {got.size} elements off (rtol={rt}, atol={at}); first at "
            f"{bad.tolist()}: got {[g[tuple(i)] for i in bad]}, expected {[r[tuple(i)] for i in bad]}"
        )


def assert_exact(got: np.ndarray, want: np.ndarray, what: str = "") -> None:
    """Equal values (nan == nan; floats compared in float64), same dtype and shape."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype}, expected {want.dtype}"
    assert got.shape == want.shape, f"{what}: shape {got.shape}, expected {want.shape}"
    if is_float_np(got.dtype):
        g, w = f64(got), f64(want)
        eq = (g == w) | (np.isnan(g) & np.isnan(w))
    else:
        eq = got == want
    assert eq.all(), f"{what}: got {got[~eq][:5]}, expected {want[~eq][:5]} ({int((~eq).sum())} differ)"


def is_float_np(dt: np.dtype) -> bool:
    return dt.kind == "f" or dt in _LOW_NP


_LOW_NP = frozenset(to_numpy(d) for d in ("bfloat16", "float8e5m2", "float8e4m3"))
