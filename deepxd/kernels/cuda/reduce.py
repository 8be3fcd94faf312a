"""Reductions on the device: sum, prod, reducemax, reducemin over any dims, argmax and argmin along one dim.

One thread block reduces one output (warp shuffles, then one word per warp in shared memory); when there are few
outputs and many elements each, the elements are split over several blocks whose partial results a second kernel
combines. The 16-bit floats accumulate in float32, integers in int64 (then wrap into the output), as on the CPU;
max/min propagate nan; argmax/argmin return the first index on ties (and of the first nan).
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING, Any

from deepx_sdk.ir.dtypes import NUMERIC
from deepxd.kernels.cuda._src import HEADER, MAXD, ctype, dims, dims_format
from deepxd.kernels.cuda.elementwise import collapse
from deepxd.kernels.cuda.shape import contiguous_strides

if TYPE_CHECKING:
    from deepxd.kernels.cuda import CudaExecutor, DeviceTensor

_SRC = r"""
typedef typename Acc<T>::type A;
template <class V> struct Lim;
template <> struct Lim<float> {
    static __device__ float lo() { return -INFINITY; }
    static __device__ float hi() { return INFINITY; }
};
template <> struct Lim<double> {
    static __device__ double lo() { return -INFINITY; }
    static __device__ double hi() { return INFINITY; }
};
template <> struct Lim<ll> {
    static __device__ ll lo() { return LLONG_MIN; }
    static __device__ ll hi() { return LLONG_MAX; }
};

#define REDUCE(NAME, INIT, COMBINE, BLOCK)                                                                   \
extern "C" __global__ void NAME(A* partial, T* out, const T* a, ll n_out, ll R, ll chunk, int split,          \
                                int nk, Dims ks, Dims kst, int nr, Dims rs, Dims rst) {                      \
    for (ll o = blockIdx.x; o < n_out; o += gridDim.x) {                                                     \
        ll base = offset_of(o, nk, ks, kst);                                                                 \
        ll r0 = (ll)blockIdx.y * chunk, r1 = r0 + chunk < R ? r0 + chunk : R;                                \
        A acc = INIT;                                                                                        \
        if (nr == 1 && rst.v[0] == 1) {  /* the reduced elements are contiguous: no index arithmetic */      \
            const T* p = a + base;                                                                           \
            _Pragma("unroll 4")                                                                              \
            for (ll r = r0 + threadIdx.x; r < r1; r += blockDim.x) acc = COMBINE(acc, ld(p[r]));             \
        } else {                                                                                             \
            for (ll r = r0 + threadIdx.x; r < r1; r += blockDim.x) {                                         \
                A v = ld(a[base + offset_of(r, nr, rs, rst)]);                                               \
                acc = COMBINE(acc, v);                                                                       \
            }                                                                                                \
        }                                                                                                    \
        acc = BLOCK(acc);                                                                                    \
        if (threadIdx.x == 0) {                                                                              \
            if (split == 1) out[o] = st<T>(acc); else partial[o * split + blockIdx.y] = acc;                 \
        }                                                                                                    \
    }                                                                                                        \
}                                                                                                            \
extern "C" __global__ void NAME##_finish(T* out, const A* partial, ll n_out, int split) {                    \
    for (ll o = blockIdx.x; o < n_out; o += gridDim.x) {                                                     \
        A acc = INIT;                                                                                        \
        for (int s = threadIdx.x; s < split; s += blockDim.x) acc = COMBINE(acc, partial[o * split + s]);    \
        acc = BLOCK(acc);                                                                                    \
        if (threadIdx.x == 0) out[o] = st<T>(acc);                                                           \
    }                                                                                                        \
}
#define ADD(x, y) ((x) + (y))
#define MUL(x, y) ((x) * (y))
REDUCE(sum, (A)0, ADD, block_sum)
REDUCE(prod, (A)1, MUL, block_prod)
REDUCE(reducemax, Lim<A>::lo(), mx, block_max)
REDUCE(reducemin, Lim<A>::hi(), mn, block_min)

template <bool MAX> __device__ __forceinline__ bool better(A v, ll i, A b, ll j) {
    if (j < 0) return i >= 0;
    if (i < 0) return false;
    bool vn = v != v, bn = b != b;
    if (vn || bn) return vn && (!bn || i < j);
    return (MAX ? v > b : v < b) || (v == b && i < j);
}
template <bool MAX> __device__ void arg(ll* out, const T* a, ll n_out, ll dim, ll inner) {
    __shared__ A sv[32];
    __shared__ ll si[32];
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    for (ll o = blockIdx.x; o < n_out; o += gridDim.x) {
        ll base = (o / inner) * dim * inner + (o % inner);
        A best = (A)0;
        ll bi = -1;
        for (ll r = threadIdx.x; r < dim; r += blockDim.x) {
            A v = ld(a[base + r * inner]);
            if (better<MAX>(v, r, best, bi)) { best = v; bi = r; }
        }
        for (int s = 16; s > 0; s >>= 1) {
            A ov = __shfl_xor_sync(0xffffffffu, best, s);
            ll oi = __shfl_xor_sync(0xffffffffu, bi, s);
            if (better<MAX>(ov, oi, best, bi)) { best = ov; bi = oi; }
        }
        __syncthreads();
        if (lane == 0) { sv[w] = best; si[w] = bi; }
        __syncthreads();
        if (w == 0) {
            best = lane < nw ? sv[lane] : (A)0;
            bi = lane < nw ? si[lane] : -1;
            for (int s = 16; s > 0; s >>= 1) {
                A ov = __shfl_xor_sync(0xffffffffu, best, s);
                ll oi = __shfl_xor_sync(0xffffffffu, bi, s);
                if (better<MAX>(ov, oi, best, bi)) { best = ov; bi = oi; }
            }
            if (lane == 0) out[o] = bi;
        }
    }
}
extern "C" __global__ void argmax(ll* out, const T* a, ll n_out, ll dim, ll inner) {
    arg<true>(out, a, n_out, dim, inner);
}
extern "C" __global__ void argmin(ll* out, const T* a, ll n_out, ll dim, ll inner) {
    arg<false>(out, a, n_out, dim, inner);
}
"""

SUPPORT = {op: frozenset(NUMERIC) for op in ("sum", "prod", "reducemax", "reducemin", "argmax", "argmin")}

_FMT = "PPPqqqii" + dims_format(2) + "i" + dims_format(2)


@functools.cache
def source(dtype: str) -> str:
    return HEADER + "#include <climits>\n" + f"typedef {ctype(dtype)} T;\n" + _SRC


def sources() -> list[tuple[str, str]]:
    return [(source(d), f"reduce ({d})") for d in sorted(NUMERIC)]


def _acc_itemsize(dtype: str) -> int:
    return 4 if dtype in ("float32", "float16", "bfloat16") else 8


def _reduce(op: str, ex: CudaExecutor, a: DeviceTensor, dims_: Any, out: DeviceTensor) -> bool:
    nd = a.ndim
    red = sorted({d % nd for d in dims_}) if dims_ and nd else list(range(nd))
    keep = [d for d in range(nd) if d not in red]
    st = contiguous_strides(a.shape)
    ks, (kst,) = collapse(tuple(a.shape[d] for d in keep), [st[d] for d in keep])
    rs, (rst,) = collapse(tuple(a.shape[d] for d in red), [st[d] for d in red])
    if len(ks) > MAXD or len(rs) > MAXD:
        return False
    n_out = out.size
    if n_out == 0:
        return True
    total = math.prod(a.shape[d] for d in red)
    block = 256 if total > 128 else 64
    split = 1
    if n_out < 2 * ex.sm_count and total >= 16384:
        split = min(1024, -(-total // 8192), max(1, (4 * ex.sm_count) // n_out))
    chunk = -(-total // split) if total else 0
    dt = a.dname
    f = ex.function(f"reduce:{dt}", source(dt), op, _FMT, op)
    partial = None
    if split > 1:
        partial = ex.alloc(n_out * split * _acc_itemsize(dt), op, "(partial results)")
    grid = (min(n_out, 1 << 20), split, 1)
    ex.launch(op, f, grid, (block, 1, 1), int(partial) if partial is not None else 0, out.ptr, a.ptr, n_out, total,
              chunk, split, len(ks), *dims(ks), *dims(kst), len(rs), *dims(rs), *dims(rst))
    if partial is not None:
        fin = ex.function(f"reduce:{dt}", source(dt), op + "_finish", "PPqi", op)
        ex.launch(op, fin, (min(n_out, 1 << 20), 1, 1), (256, 1, 1), out.ptr, int(partial), n_out, split)
    return True


def sum(ex: CudaExecutor, a: DeviceTensor, dims_: Any, keepdims: bool, out: DeviceTensor) -> bool:
    return _reduce("sum", ex, a, dims_, out)


def prod(ex: CudaExecutor, a: DeviceTensor, dims_: Any, keepdims: bool, out: DeviceTensor) -> bool:
    return _reduce("prod", ex, a, dims_, out)


def reducemax(ex: CudaExecutor, a: DeviceTensor, dims_: Any, keepdims: bool, out: DeviceTensor) -> bool:
    return _reduce("reducemax", ex, a, dims_, out)


def reducemin(ex: CudaExecutor, a: DeviceTensor, dims_: Any, keepdims: bool, out: DeviceTensor) -> bool:
    return _reduce("reducemin", ex, a, dims_, out)


def _arg(op: str, ex: CudaExecutor, a: DeviceTensor, dim: int, out: DeviceTensor) -> bool:
    if a.ndim == 0:
        ex.cuda.memset_d32_async(out.ptr, 0, 2, ex.stream)
        return True
    dim %= a.ndim
    n_out = out.size
    if n_out == 0:
        return True
    size = a.shape[dim]
    inner = math.prod(a.shape[dim + 1:])
    f = ex.function(f"reduce:{a.dname}", source(a.dname), op, "PPqqq", op)
    ex.launch(op, f, (min(n_out, 1 << 20), 1, 1), (256 if size > 128 else 64, 1, 1), out.ptr, a.ptr, n_out, size,
              inner)
    return True


def argmax(ex: CudaExecutor, a: DeviceTensor, dim: int, keepdims: bool, out: DeviceTensor) -> bool:
    return _arg("argmax", ex, a, dim, out)


def argmin(ex: CudaExecutor, a: DeviceTensor, dim: int, keepdims: bool, out: DeviceTensor) -> bool:
    return _arg("argmin", ex, a, dim, out)
