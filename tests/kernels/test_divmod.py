"""fmod, remainder and floordiv (and their scalar forms) on floats against torch on the CPU: negative operands,
broadcasting, zero and infinite divisors, whole quotients where a / b rounds up; float64 and float32 value for
value, the 16-bit floats as torch's float32 result rounded once."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kernel_ref import T, V, run_op

from deepx_core.ir.dtypes import to_numpy

TORCH = {"fmod": torch.fmod, "remainder": torch.remainder, "floordiv": torch.floor_divide}
DTYPES = ["float64", "float32", "float16", "bfloat16"]
SPECIAL = [0.0, -0.0, 1.0, -1.0, 0.1, -0.1, 3.0, -3.0, 7.5, -7.5, np.inf, -np.inf, np.nan, 1e-3, 2.0**14]


def _operands(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Every pair of specials (rows x columns, broadcast), and random values with whole and near-whole quotients."""
    s = np.array(SPECIAL)
    b = rng.uniform(-4, 4, 60)
    a = np.concatenate([b * np.round(rng.uniform(-20, 20, 60)), rng.uniform(-50, 50, 60)])  # exact multiples too
    return np.concatenate([np.repeat(s, len(s)), a]), np.concatenate([np.tile(s, len(s)), b, b])


def _want(op: str, a: np.ndarray, b: np.ndarray | float, dtype: str, scalar_first: bool = False) -> np.ndarray:
    ta = torch.from_numpy(a.astype(np.float64 if dtype == "float64" else np.float32))
    tb = b if isinstance(b, float) else torch.from_numpy(b.astype(np.float64 if dtype == "float64" else np.float32))
    if scalar_first:
        out = TORCH[op](torch.full_like(ta, tb), ta)
    else:
        out = TORCH[op](ta, tb)
    return out.numpy().astype(to_numpy(dtype))


def _check(got: np.ndarray, want: np.ndarray, what: str) -> None:
    np.testing.assert_array_equal(got.astype(np.float64), want.astype(np.float64), err_msg=what)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", ["fmod", "remainder", "floordiv"])
def test_tensor_forms_match_torch(op, dtype, rng):
    a, b = _operands(rng)
    a, b = a.astype(to_numpy(dtype)), b.astype(to_numpy(dtype))
    with np.errstate(all="ignore"):
        _check(run_op(op, {"a": a, "b": b}, [T("a", dtype), T("b", dtype)]), _want(op, a, b, dtype), op)
        # broadcasting: a column against a row
        col, row = a[:40].reshape(40, 1), b[-30:].reshape(1, 30)
        got = run_op(op, {"a": col, "b": row}, [T("a", dtype), T("b", dtype)])
        assert got.shape == (40, 30)
        _check(got, _want(op, col, row, dtype), f"{op} broadcast")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op,scalar_op,rscalar_op", [("fmod", "fmodscalar", "rfmodscalar"),
                                                     ("remainder", "remainderscalar", "rremainderscalar"),
                                                     ("floordiv", "floordivscalar", "rfloordivscalar")])
@pytest.mark.parametrize("s", [2.5, -2.5, 0.1, 3.0])
def test_scalar_forms_match_torch(op, scalar_op, rscalar_op, dtype, s, rng):
    a, _ = _operands(rng)
    a = a.astype(to_numpy(dtype))
    s = float(np.asarray(s).astype(to_numpy(dtype)))  # the scalar as the dtype holds it, as torch's would be
    with np.errstate(all="ignore"):
        _check(run_op(scalar_op, {"a": a}, [T("a", dtype), V(s)]), _want(op, a, s, dtype), scalar_op)
        _check(run_op(rscalar_op, {"a": a}, [V(s), T("a", dtype)]), _want(op, a, s, dtype, scalar_first=True),
               rscalar_op)
