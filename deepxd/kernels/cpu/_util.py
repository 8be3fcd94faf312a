"""Helpers shared by the numpy kernels: low-precision dtypes compute in float32 and round once into the output."""

from __future__ import annotations

import ctypes

import numpy as np

from deepx_core.ir.dtypes import LOW_NUMPY

F32 = np.dtype(np.float32)
F64 = np.dtype(np.float64)
#: dtypes whose arithmetic runs in float32 (numpy has no fast loops for them); bfloat16 and float8 join when
#: ml_dtypes is first needed
LOW = LOW_NUMPY


def work(a: np.ndarray) -> np.ndarray:
    """`a` in the dtype a kernel computes in: float32 for the low-precision floats, else itself."""
    return a.astype(F32) if a.dtype in LOW else a


_CHAR = ctypes.c_char
_addressof = ctypes.addressof


def address(a: np.ndarray) -> int:
    """Where a's data starts, for a C loop or BLAS: through ctypes for a writable array whose rows or columns are
    contiguous (a fourth of __array_interface__'s cost, a fifth of `a.ctypes.data`'s), else from its array
    interface (read-only, empty, or neither way contiguous)."""
    try:
        return _addressof(_CHAR.from_buffer(a if a.flags.c_contiguous else a.T))  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return int(a.__array_interface__["data"][0])


def is_int(a: np.ndarray) -> bool:
    return a.dtype.kind in "iu"


def up(a: np.ndarray) -> np.ndarray:
    """`a` in its compute dtype (float32 for the low-precision floats)."""
    return a.astype(F32) if a.dtype in LOW else a


def scalar_for(out: np.ndarray, s):
    """A Python scalar as `out`'s dtype would hold it: integers out of range wrap (as C casts do)."""
    if out.dtype.kind in "iub" and isinstance(s, int) and not isinstance(s, bool):
        info = np.iinfo(out.dtype) if out.dtype.kind != "b" else None
        if info is not None and not info.min <= s <= info.max:
            return np.array(s, dtype=np.int64).astype(out.dtype)
    return s


def fill(out: np.ndarray, value) -> None:
    if out.dtype in LOW:
        out[...] = np.float32(value)
    else:
        out.fill(scalar_for(out, value))
