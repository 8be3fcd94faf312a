"""deepxIR precisions and their numpy storage.

Every precision that deepxIR names is known here; those with a numpy storage map to a dtype (bfloat16 and the
float8 types through ml_dtypes, imported on first use: it takes most of a second to import, and most programs never
need it). int4 and float4e2m1 are legal names with no storage yet: asking for their numpy dtype raises a DeepxError.
"""

from __future__ import annotations

import sys
import threading

import numpy as np

from deepx_core.errors import DeepxError

# precision name -> numpy dtype (None: a legal precision that deepx cannot store yet, or one of _ML not loaded yet)
_NUMPY: dict[str, np.dtype | None] = {
    "float64": np.dtype(np.float64),
    "float32": np.dtype(np.float32),
    "float16": np.dtype(np.float16),
    "bfloat16": None,
    "float8e5m2": None,
    "float8e4m3": None,
    "float4e2m1": None,
    "int64": np.dtype(np.int64),
    "int32": np.dtype(np.int32),
    "int16": np.dtype(np.int16),
    "int8": np.dtype(np.int8),
    "int4": None,
    "bool": np.dtype(np.bool_),
}
# precisions stored as ml_dtypes' types; the e4m3 is that of CUDA's __nv_fp8_e4m3: no inf, one nan
_ML = {"bfloat16": "bfloat16", "float8e5m2": "float8_e5m2", "float8e4m3": "float8_e4m3fn"}
_ITEMSIZE = {"bfloat16": 2, "float8e5m2": 1, "float8e4m3": 1}

#: numpy dtypes whose arithmetic runs in float32 (numpy has no fast loops for them): ml_dtypes' join once loaded
LOW_NUMPY: set[np.dtype] = {np.dtype(np.float16)}

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


_ml_lock = threading.Lock()
_ml_loaded = False


def _load_ml() -> None:
    """Import ml_dtypes and store bfloat16 and the float8 types with it (once)."""
    global _ml_loaded
    with _ml_lock:
        if _ml_loaded:
            return
        import ml_dtypes

        for name, attr in _ML.items():
            dt = np.dtype(getattr(ml_dtypes, attr))
            _NUMPY[name] = dt
            _BY_NUMPY[dt] = name
            LOW_NUMPY.add(dt)
        _ml_loaded = True


def is_precision(name: str) -> bool:
    return name in _NUMPY or name in ("string", "any") or name in GROUPS


def to_numpy(precision: str) -> np.dtype:
    """The numpy dtype that stores `precision`; DeepxError for an unknown or not yet storable precision."""
    try:
        dt = _NUMPY[precision]
    except KeyError:
        raise DeepxError(f"unknown dtype {precision!r}; known: {', '.join(_NUMPY)}") from None
    if dt is None:
        if precision in _ML and not _ml_loaded:
            _load_ml()
            return to_numpy(precision)
        raise DeepxError(f"dtype {precision!r} has no storage in deepx yet; use one of {', '.join(sorted(STORABLE))}")
    return dt


def from_numpy(dtype: np.dtype | type) -> str:
    """The deepxIR precision of a numpy dtype; DeepxError if deepx has no name for it."""
    dt = np.dtype(dtype)
    try:
        return _BY_NUMPY[dt]
    except KeyError:
        # an ml_dtypes array can only come from a process that imported ml_dtypes
        if not _ml_loaded and "ml_dtypes" in sys.modules:
            _load_ml()
            return from_numpy(dt)
        raise DeepxError(f"numpy dtype {dt} has no deepx precision; use one of {', '.join(sorted(STORABLE))}") from None


def itemsize(precision: str) -> int:
    return _ITEMSIZE.get(precision) or to_numpy(precision).itemsize


def compute_dtype(precision: str) -> np.dtype:
    """The numpy dtype that arithmetic on `precision` runs in."""
    return np.dtype(np.float32) if precision in LOW_PRECISION else to_numpy(precision)


if "ml_dtypes" in sys.modules:  # imported already: nothing to save
    _load_ml()
