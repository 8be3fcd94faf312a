"""Sorting along a dim on the device: argsort and argtopk (the first k of argsort), with the CPU's order: stable, nan
the largest, -0.0 equal to 0.0.

Each element becomes a 64-bit key whose unsigned order is the wanted one (floats through double, -0.0 as 0.0 and every
nan as one nan above +inf; integers with the sign bit flipped; descending: the key's complement) paired with its
position along the dim, and (key, position) pairs are sorted: as the positions differ, that order is the stable one.
A block sorts each run of up to 2048 pairs in shared memory (bitonic), then passes merge runs two by two in global
memory, each element finding its place by a binary search in the other run, until one run holds the line; the first
k positions of each line are the result.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from deepx_core.cache import memoize
from deepx_core.ir.dtypes import NUMERIC
from deepxd.kernels.cuda._src import HEADER, ctype

if TYPE_CHECKING:
    from deepxd.kernels.cuda import CudaExecutor, DeviceTensor

#: pairs a block sorts in shared memory (16 bytes each)
RUN = 2048

_SRC = r"""
// the order key: unsigned order = the wanted order
__device__ __forceinline__ ull okey(double x) {
    if (x != x) return 0xFFF8000000000000ull;  // every nan: one key, above +inf's
    if (x == 0.0) x = 0.0;  // -0.0 ties with 0.0
    ull b = (ull)__double_as_longlong(x);
    return (b >> 63) ? ~b : (b | 0x8000000000000000ull);
}
__device__ __forceinline__ ull okey(float x) { return okey((double)x); }
__device__ __forceinline__ ull okey(ll x) { return (ull)x ^ 0x8000000000000000ull; }

__device__ __forceinline__ bool before(ull ka, ll ia, ull kb, ll ib) { return ka < kb || (ka == kb && ia < ib); }

// the pairs of `lines` lines of n elements along a dim of stride `inner` (line r: outer r / inner, inner r % inner)
extern "C" __global__ void sort_keys(ull* keys, ll* pos, const T* a, ll lines, ll n, ll inner, int descending) {
    GRID_STRIDE(g, lines * n) {
        ll r = g / n, j = g - r * n;
        ll o = r / inner, i = r - o * inner;
        ull k = okey(ld(a[(o * n + j) * inner + i]));
        keys[g] = descending ? ~k : k;
        pos[g] = j;
    }
}

// each run of `run` pairs (a power of two, at most 2048) of each line, sorted in shared memory
extern "C" __global__ void sort_runs(ull* keys, ll* pos, ll lines, ll n, int run) {
    __shared__ ull sk[2048];
    __shared__ ll sp[2048];
    ll runs = (n + run - 1) / run;
    for (ll b = blockIdx.x; b < lines * runs; b += gridDim.x) {
        ll r = b / runs, start = (b - r * runs) * run;
        ll len = n - start < run ? n - start : run;
        ull* kp = keys + r * n + start;
        ll* pp = pos + r * n + start;
        for (int t = threadIdx.x; t < run; t += blockDim.x) {
            sk[t] = t < len ? kp[t] : ~0ull;
            sp[t] = t < len ? pp[t] : LLONG_MAX;  // padding sorts after every element
        }
        for (int size = 2; size <= run; size <<= 1) {
            for (int stride = size >> 1; stride > 0; stride >>= 1) {
                __syncthreads();
                for (int t = threadIdx.x; t < run / 2; t += blockDim.x) {
                    int x = 2 * t - (t & (stride - 1)), y = x + stride;
                    bool up = (x & size) == 0;
                    if (before(sk[y], sp[y], sk[x], sp[x]) == up) {
                        ull k = sk[x]; sk[x] = sk[y]; sk[y] = k;
                        ll p = sp[x]; sp[x] = sp[y]; sp[y] = p;
                    }
                }
            }
        }
        __syncthreads();
        for (int t = threadIdx.x; t < len; t += blockDim.x) {
            kp[t] = sk[t];
            pp[t] = sp[t];
        }
        __syncthreads();
    }
}

// one merge pass: sorted runs of `width` pairs, merged two by two from (ki, pi) into (ko, po)
extern "C" __global__ void merge_runs(ull* ko, ll* po, const ull* ki, const ll* pi, ll lines, ll n, ll width) {
    GRID_STRIDE(g, lines * n) {
        ll r = g / n, j = g - r * n;
        ll s = (j / (2 * width)) * 2 * width;
        ll mid = s + width < n ? s + width : n, end = s + 2 * width < n ? s + 2 * width : n;
        const ull* k = ki + r * n;
        const ll* p = pi + r * n;
        ull kj = k[j];
        ll pj = p[j];
        // how many of the other run come before this element: the first of it that does not
        ll lo, hi;
        bool first = j < mid;
        if (first) { lo = mid; hi = end; } else { lo = s; hi = mid; }
        ll base = lo;
        while (lo < hi) {
            ll m = (lo + hi) >> 1;
            if (before(k[m], p[m], kj, pj)) lo = m + 1; else hi = m;
        }
        ll dest = s + (first ? j - s : j - mid) + (lo - base);
        ko[r * n + dest] = kj;
        po[r * n + dest] = pj;
    }
}

// the first k positions of each line into the output (k along the dim, stride inner)
extern "C" __global__ void sort_take(ll* out, const ll* pos, ll lines, ll n, ll k, ll inner) {
    GRID_STRIDE(g, lines * k) {
        ll r = g / k, j = g - r * k;
        ll o = r / inner, i = r - o * inner;
        out[(o * k + j) * inner + i] = pos[r * n + j];
    }
}
"""


@memoize("kernels.cuda.sort.source", 64)
def source(dtype: str) -> str:
    return HEADER + f"typedef {ctype(dtype)} T;\n" + _SRC


def sources() -> list[tuple[str, str]]:
    return [(source(d), f"sort ({d})") for d in sorted(NUMERIC)]


SUPPORT = {"argsort": frozenset(NUMERIC), "argtopk": frozenset(NUMERIC)}


def _sort(ex: CudaExecutor, op: str, a: DeviceTensor, k: int, dim: int, descending: bool, out: DeviceTensor) -> bool:
    if a.ndim == 0:
        if out.size:
            ex.cuda.memset_d32_async(out.ptr, 0, 2, ex.stream)
        return True
    dim %= a.ndim
    n = a.shape[dim]
    inner = math.prod(a.shape[dim + 1:])
    lines = math.prod(a.shape) // n if n else 0
    if out.size == 0:
        return True
    total = lines * n
    src = source(a.dname)
    keys = ex.alloc(total * 8, op, "(sort keys)")
    pos = ex.alloc(total * 8, op, "(sort positions)")
    f = ex.function(f"sort:{a.dname}", src, "sort_keys", "PPPqqqi", op)
    ex.launch(op, f, ex.grid(total), (256, 1, 1), int(keys), int(pos), a.ptr, lines, n, inner, int(descending))
    run = min(RUN, 1 << max(1, (n - 1).bit_length()))
    f = ex.function(f"sort:{a.dname}", src, "sort_runs", "PPqqi", op)
    ex.launch(op, f, (min(lines * -(-n // run), 1 << 20), 1, 1), (min(1024, max(32, run // 2)), 1, 1), int(keys),
              int(pos), lines, n, run)
    if n > run:
        keys2 = ex.alloc(total * 8, op, "(sort keys)")
        pos2 = ex.alloc(total * 8, op, "(sort positions)")
        f = ex.function(f"sort:{a.dname}", src, "merge_runs", "PPPPqqq", op)
        width = run
        while width < n:
            ex.launch(op, f, ex.grid(total), (256, 1, 1), int(keys2), int(pos2), int(keys), int(pos), lines, n, width)
            keys, pos, keys2, pos2 = keys2, pos2, keys, pos
            width *= 2
    f = ex.function(f"sort:{a.dname}", src, "sort_take", "PPqqqq", op)
    ex.launch(op, f, ex.grid(lines * k), (256, 1, 1), out.ptr, int(pos), lines, n, k, inner)
    return True


def argsort(ex: CudaExecutor, a: DeviceTensor, dim: int, descending: bool, out: DeviceTensor) -> bool:
    return _sort(ex, "argsort", a, a.shape[dim % a.ndim] if a.ndim else 1, dim, descending, out)


def argtopk(ex: CudaExecutor, a: DeviceTensor, k: int, dim: int, largest: bool, out: DeviceTensor) -> bool:
    return _sort(ex, "argtopk", a, k, dim, largest, out)
