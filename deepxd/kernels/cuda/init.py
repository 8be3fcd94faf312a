"""Fill existing tensors on the device: constant, arange, uniform, normal, dropout.

constant stores the bit pattern the CPU kernel would store (computed on the host for one element), so every dtype
fills alike. The random ops draw from Philox4x32-10 keyed by the seed and counted by element index: a seed gives the
same values on every run and every GPU, but not the values numpy's generator gives on the CPU (seed 0 draws a fresh
seed from the OS, as on the CPU).
"""

from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING, Any

import ml_dtypes
import numpy as np

from deepx_core.cache import memoize
from deepx_core.errors import DeepxError
from deepx_core.ir.dtypes import FLOATS, NUMERIC, STORABLE, to_numpy
from deepxd.kernels.cpu._util import fill
from deepxd.kernels.cuda._src import FLOAT_TYPES, HEADER, ctype

if TYPE_CHECKING:
    from deepxd.kernels.cuda import CudaExecutor, DeviceTensor

_SRC = r"""
extern "C" __global__ void fill8(ull* p, ull v, ll n) { GRID_STRIDE(i, n) p[i] = v; }
extern "C" __global__ void arange_i(T* c, ll n, ll start, ll step) { GRID_STRIDE(i, n) c[i] = (T)(start + i * step); }
extern "C" __global__ void arange_f(T* c, ll n, double start, double step) {
    GRID_STRIDE(i, n) c[i] = st<T>((double)i * step + start);
}
"""

_RANDOM = r"""
extern "C" __global__ void uniform(T* c, ll n, double low, double high, ull seed, int* err) {
    GRID_STRIDE(i, n) {
        T v = st<T>(low);
        bool ok = false;
        for (int k = 0; k < 8 && !ok; ++k) {
            U4 r = philox((ull)i * 8 + k, seed);
            v = st<T>(low + u01(r.x, r.y) * (high - low));
            ok = (double)ld(v) < high;
        }
        if (!ok) atomicExch(err, 1);
        c[i] = v;
    }
}
extern "C" __global__ void normal(T* c, ll n, double mean, double std, ull seed) {
    GRID_STRIDE(i, n) {
        U4 r = philox((ull)i, seed);
        double u1 = 1.0 - u01(r.x, r.y), u2 = u01(r.z, r.w);
        double z = sqrt(-2.0 * log(u1)) * cospi(2.0 * u2);
        c[i] = st<T>(z * std + mean);
    }
}
extern "C" __global__ void dropout(T* a, ll n, float p, double scale, ull seed) {
    typedef typename Acc<T>::type A;
    GRID_STRIDE(i, n) {
        U4 r = philox((ull)i, seed);
        float u = (float)((r.x >> 8) * (1.0 / 16777216.0));
        A x = ld(a[i]);
        a[i] = st<T>(u >= p ? x * (A)scale : x * (A)0);
    }
}
"""

SUPPORT = {"constant": frozenset(STORABLE), "arange": frozenset(NUMERIC), "uniform": frozenset(FLOATS),
           "normal": frozenset(FLOATS), "dropout": frozenset(FLOATS)}


@memoize("kernels.cuda.init.source", 64)
def source(dtype: str) -> str:
    text = HEADER + f"typedef {ctype(dtype)} T;\n" + _SRC
    if dtype in FLOAT_TYPES:
        text += _RANDOM
    return text


def sources() -> list[tuple[str, str]]:
    return [(source(d), f"init ({d})") for d in sorted(NUMERIC)]


def _fn(ex: CudaExecutor, dtype: str, name: str, fmt: str, op: str) -> Any:
    return ex.function(f"init:{dtype}", source(dtype), name, fmt, op)


def fill_bytes(ex: CudaExecutor, op: str, t: DeviceTensor, value: Any) -> None:
    """Fill `t` with `value` as the CPU kernel stores it in t's dtype."""
    if t.size == 0:
        return
    one = np.zeros(1, t.dtype)
    fill(one, value)
    size = t.dtype.itemsize
    bits = int.from_bytes(one.tobytes(), "little")
    cuda = ex.cuda
    if size == 1:
        cuda.memset_d8_async(t.ptr, bits, t.size, ex.stream)
    elif size == 2:
        cuda.memset_d16_async(t.ptr, bits, t.size, ex.stream)
    elif size == 4:
        cuda.memset_d32_async(t.ptr, bits, t.size, ex.stream)
    else:
        f = _fn(ex, "int64", "fill8", "PQq", op)
        ex.launch(op, f, ex.grid(t.size), (256, 1, 1), t.ptr, bits, t.size)


def constant(ex: CudaExecutor, value: Any, out: DeviceTensor) -> bool:
    fill_bytes(ex, "constant", out, value)
    return True


def arange(ex: CudaExecutor, start: Any, step: Any, out: DeviceTensor) -> bool:
    n = out.size
    if n == 0:
        return True
    dt = out.dname
    if dt not in FLOAT_TYPES and type(start) is int and type(step) is int:
        if not (-(2**63) <= start < 2**63 and -(2**63) <= step < 2**63):
            return False
        f = _fn(ex, dt, "arange_i", "Pqqq", "arange")
        ex.launch("arange", f, ex.grid(n), (256, 1, 1), out.ptr, n, start, step)
    else:
        f = _fn(ex, dt, "arange_f", "Pqdd", "arange")
        ex.launch("arange", f, ex.grid(n), (256, 1, 1), out.ptr, n, float(start), float(step))
    return True


def _seed(seed: int) -> int:
    return int.from_bytes(os.urandom(8), "little") if seed == 0 else seed & (2**64 - 1)


def uniform(ex: CudaExecutor, low: Any, high: Any, seed: int, out: DeviceTensor) -> bool:
    if not (math.isfinite(low) and math.isfinite(high)):
        raise DeepxError(f"uniform: low={low} and high={high} must be finite")
    top = float(ml_dtypes.finfo(out.dtype).max)
    if low < -top or high > top:
        raise DeepxError(f"uniform: [{low}, {high}) does not fit {out.dtype} (largest {top:g})")
    if high <= low:
        fill_bytes(ex, "uniform", out, low)
        return True
    if out.size == 0:
        return True
    f = _fn(ex, out.dname, "uniform", "PqddQP", "uniform")
    ex.clear_flag()
    ex.launch("uniform", f, ex.grid(out.size), (256, 1, 1), out.ptr, out.size, float(low), float(high), _seed(seed),
              ex.flag_ptr)
    ex.raise_flag("uniform", f"{out.dtype} has (almost) no values in [{low}, {high}); widen the range")
    return True


def normal(ex: CudaExecutor, mean: Any, std: Any, seed: int, out: DeviceTensor) -> bool:
    if out.size:
        f = _fn(ex, out.dname, "normal", "PqddQ", "normal")
        ex.launch("normal", f, ex.grid(out.size), (256, 1, 1), out.ptr, out.size, float(mean), float(std),
                  _seed(seed))
    return True


def dropout(ex: CudaExecutor, p: Any, seed: int, a: DeviceTensor) -> bool:
    if p == 0 or a.size == 0:
        return True
    scale = 1.0 / (1.0 - p) if p < 1 else 0.0  # p = 1: the kernel keeps nothing (u < 1), x * 0 everywhere
    if a.dname not in ("float16", "bfloat16"):
        scale = float(to_numpy(a.dname).type(scale))
    f = _fn(ex, a.dname, "dropout", "PqfdQ", "dropout")
    ex.launch("dropout", f, ex.grid(a.size), (256, 1, 1), a.ptr, a.size, float(p), scale, _seed(seed))
    return True
