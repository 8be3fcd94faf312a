"""Fill existing tensors: constant, arange, random (seed 0: fresh entropy), dropout (in place, scaled)."""

from __future__ import annotations

import math

import numpy as np

from deepx_core.errors import DeepxError
from deepxd.kernels.cpu._util import F32, F64, LOW, fill


def _rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(None if seed == 0 else seed & (2**64 - 1))


def constant(value, out):
    fill(out, value)


def arange(start, step, out):
    n = out.size
    flat = out.reshape(-1)
    if out.dtype.kind in "iu" and isinstance(start, int) and isinstance(step, int):
        flat[...] = np.arange(n, dtype=np.int64) * step + start
    else:
        flat[...] = np.arange(n, dtype=F64) * step + start


def _fill_float(out: np.ndarray, sample) -> None:
    dt = F64 if out.dtype == F64 else F32
    out[...] = sample(dt)


def _largest(dt: np.dtype) -> float:
    """The largest finite value of a float dtype (ml_dtypes' finfo only for its own types, which numpy's lacks)."""
    if dt in (F32, F64, np.float16):
        return float(np.finfo(dt).max)
    import ml_dtypes

    return float(ml_dtypes.finfo(dt).max)


def uniform(low, high, seed, out):
    if not (math.isfinite(low) and math.isfinite(high)):
        raise DeepxError(f"uniform: low={low} and high={high} must be finite")
    top = _largest(out.dtype)
    if low < -top or high > top:
        raise DeepxError(f"uniform: [{low}, {high}) does not fit {out.dtype} (largest {top:g})")
    if high <= low:
        out[...] = low
        return
    rng = _rng(seed)
    out[...] = rng.random(out.shape, dtype=F64) * (high - low) + low
    # rounding into the storage dtype can land on high itself: draw those again (a few rounds), so U[low, high)
    bad = out >= high
    for _ in range(8):
        if not bad.any():
            return
        out[bad] = rng.random(int(bad.sum()), dtype=F64) * (high - low) + low
        bad = out >= high
    raise DeepxError(f"uniform: {out.dtype} has (almost) no values in [{low}, {high}); widen the range")


def normal(mean, std, seed, out):
    rng = _rng(seed)
    _fill_float(out, lambda dt: rng.standard_normal(out.shape, dtype=dt) * std + mean)


def dropout(p, seed, a):
    if p == 0 or a.size == 0:
        return
    if p >= 1:  # everything dropped: torch's input * 0 (a NaN stays NaN)
        a *= a.dtype.type(0)
        return
    keep = _rng(seed).random(a.shape, dtype=F32) >= p
    scale = 1.0 / (1.0 - p)
    if a.dtype in LOW:
        a[...] = a.astype(F32) * keep * scale
    else:
        a *= keep
        a *= a.dtype.type(scale)
