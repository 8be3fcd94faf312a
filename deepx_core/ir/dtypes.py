"""deepxIR precisions and their numpy storage.

Every precision that deepxIR names is known here; those with a numpy storage map to a dtype (bfloat16 and the
float8 types through ml_dtypes). int4 and float4e2m1 are legal names with no storage yet: asking for their
numpy dtype raises a DeepxError.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from deepx_core.errors import DeepxError

# precision name -> numpy dtype (None: a legal precision that deepx cannot store yet)
_NUMPY: dict[str, np.dtype | None] = {
    "float64": np.dtype(np.float64),
    "float32": np.dtype(np.float32),
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float8e5m2": np.dtype(ml_dtypes.float8_e5m2),
    "float8e4m3": np.dtype(ml_dtypes.float8_e4m3fn),  # the e4m3 of CUDA's __nv_fp8_e4m3: no inf, one nan
    "float4e2m1": None,
    "int64": np.dtype(np.int64),
    "int32": np.dtype(np.int32),
    "int16": np.dtype(np.int16),
    "int8": np.dtype(np.int8),
    "int4": None,
    "bool": np.dtype(np.bool_),
}

#: every precision a tensor or scalar can carry, in deepxIR's order
PRECISIONS: tuple[str, ...] = (*_NUMPY, "string", "any")

#: group names a signature may use in place of a precision
GROUPS: dict[str, frozenset[str]] = {
    "float": frozenset({"float64", "float32", "float16", "bfloat16", "float8e5m2", "float8e4m3", "float4e2m1"}),
    "float8": frozenset({"float8e5m2", "float8e4m3"}),
    "int": frozenset({"int64", "int32", "int16", "int8", "int4"}),
    "any": frozenset(_NUMPY),
}

# dtype sets that op signatures claim (only precisions with storage)
FLOATS = frozenset({"float64", "float32", "float16", "bfloat16"})
INTS = frozenset({"int64", "int32", "int16", "int8"})
NUMERIC = FLOATS | INTS
ALL = NUMERIC | {"bool"}
FLOAT8 = frozenset({"float8e5m2", "float8e4m3"})
STORABLE = ALL | FLOAT8
INDEX = frozenset({"int64", "int32"})

#: precisions whose arithmetic runs in float32 and is rounded once into the output
LOW_PRECISION = frozenset({"float16", "bfloat16"}) | FLOAT8

_BY_NUMPY: dict[np.dtype, str] = {dt: name for name, dt in _NUMPY.items() if dt is not None}


def is_precision(name: str) -> bool:
    return name in _NUMPY or name in ("string", "any") or name in GROUPS


def to_numpy(precision: str) -> np.dtype:
    """The numpy dtype that stores `precision`; DeepxError for an unknown or not yet storable precision."""
    try:
        dt = _NUMPY[precision]
    except KeyError:
        raise DeepxError(f"unknown dtype {precision!r}; known: {', '.join(_NUMPY)}") from None
    if dt is None:
        raise DeepxError(f"dtype {precision!r} has no storage in deepx yet; use one of {', '.join(sorted(STORABLE))}")
    return dt


def from_numpy(dtype: np.dtype | type) -> str:
    """The deepxIR precision of a numpy dtype; DeepxError if deepx has no name for it."""
    dt = np.dtype(dtype)
    try:
        return _BY_NUMPY[dt]
    except KeyError:
        raise DeepxError(f"numpy dtype {dt} has no deepx precision; use one of {', '.join(sorted(STORABLE))}") from None


def itemsize(precision: str) -> int:
    return to_numpy(precision).itemsize


def compute_dtype(precision: str) -> np.dtype:
    """The numpy dtype that arithmetic on `precision` runs in."""
    return np.dtype(np.float32) if precision in LOW_PRECISION else to_numpy(precision)
