"""Reductions on the device: sum, prod, reducemax, reducemin over any dims, argmax and argmin along one dim, and
cumsum (running sums) along one dim.

The layout follows the shape. Reduced elements that are each output's contiguous tail (the last dims): a warp per
row for short rows or many rows, else a block per row, split over several blocks plus a combining kernel when there
are few rows; 16-byte loads from the first 16-byte boundary, scalar head and tail. One reduced dim at a stride
(columns): 32 neighbouring outputs per block, so loads are coalesced, with 8 rows of threads and more blocks
splitting the column. Anything else goes through the strided indexer, a block per output. Combining is warp shuffles,
then one word per warp in shared memory. The 16-bit floats accumulate in float32, integers in int64 (then wrap into
the output), as on the CPU; max/min propagate nan; argmax/argmin return the first index on ties (and of the first
nan). cumsum adds in double (floats) or int64 and rounds each running sum into the output: a contiguous dim by a
block per row (tiles of 2048 staged through shared memory, thread sums then a block scan of them), a strided one, or
a short contiguous one, by a thread per column walking it.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from deepx_core.cache import memoize
from deepx_core.ir.dtypes import FLOATS, NUMERIC
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

// elements per 16-byte load
#define VW ((int)(16 / sizeof(T)))
typedef Pack<T, 16 / sizeof(T)> VecT;

// f(i, value) for every element i of p[0, n) that thread t of a group of G threads owns: scalar loads up to the
// first 16-byte boundary, then 16-byte packs (coalesced across the group), then a scalar tail
template <class F> __device__ __forceinline__ void scan(const T* p, ll n, int t, int G, F f) {
    ll head = (ll)(((16 - ((ull)p & 15)) & 15) / sizeof(T));
    if (head > n) head = n;
    for (ll i = t; i < head; i += G) f(i, p[i]);
    const VecT* q = (const VecT*)(p + head);
    ll nb = (n - head) / VW;
    #pragma unroll 4
    for (ll k = t; k < nb; k += G) {
        VecT v = q[k];
        #pragma unroll
        for (int e = 0; e < VW; ++e) f(head + k * VW + e, v.v[e]);
    }
    for (ll i = head + nb * VW + t; i < n; i += G) f(i, p[i]);
}

// Three layouts of a reduction, each with its own kernel per op:
//   NAME_wrows: the reduced elements are the contiguous tail of each output's row; one warp per row
//   NAME_brows: the same, one block per row (or per chunk of a row: blockIdx.y, partial results then NAME_finish)
//   NAME_cols:  one reduced dim at a stride (a column); 32 outputs per block read side by side (coalesced), 8 rows of
//               threads split the column, blockIdx.y splits it further
//   NAME:       anything else, through the strided indexer
#define REDUCE(NAME, INIT, COMBINE, BLOCK, WARP)                                                             \
extern "C" __global__ void NAME(A* partial, T* out, const T* a, ll n_out, ll R, ll chunk, int split,          \
                                int nk, Dims ks, Dims kst, int nr, Dims rs, Dims rst) {                      \
    for (ll o = blockIdx.x; o < n_out; o += gridDim.x) {                                                     \
        ll base = offset_of(o, nk, ks, kst);                                                                 \
        ll r0 = (ll)blockIdx.y * chunk, r1 = r0 + chunk < R ? r0 + chunk : R;                                \
        A acc = INIT;                                                                                        \
        for (ll r = r0 + threadIdx.x; r < r1; r += blockDim.x) {                                             \
            A v = ld(a[base + offset_of(r, nr, rs, rst)]);                                                   \
            acc = COMBINE(acc, v);                                                                           \
        }                                                                                                    \
        acc = BLOCK(acc);                                                                                    \
        if (threadIdx.x == 0) {                                                                              \
            if (split == 1) out[o] = st<T>(acc); else partial[o * split + blockIdx.y] = acc;                 \
        }                                                                                                    \
    }                                                                                                        \
}                                                                                                            \
extern "C" __global__ void NAME##_wrows(T* out, const T* a, ll n_out, ll R) {                               \
    int lane = threadIdx.x & 31, wpb = blockDim.x >> 5;                                                      \
    for (ll o = (ll)blockIdx.x * wpb + (threadIdx.x >> 5); o < n_out; o += (ll)gridDim.x * wpb) {            \
        A acc = INIT;                                                                                        \
        scan(a + o * R, R, lane, 32, [&](ll, T v) { acc = COMBINE(acc, ld(v)); });                           \
        acc = WARP(acc);                                                                                     \
        if (lane == 0) out[o] = st<T>(acc);                                                                  \
    }                                                                                                        \
}                                                                                                            \
extern "C" __global__ void NAME##_brows(A* partial, T* out, const T* a, ll n_out, ll R, ll chunk, int split) { \
    for (ll o = blockIdx.x; o < n_out; o += gridDim.x) {                                                     \
        ll r0 = (ll)blockIdx.y * chunk, r1 = r0 + chunk < R ? r0 + chunk : R;                                \
        A acc = INIT;                                                                                        \
        if (r1 > r0) scan(a + o * R + r0, r1 - r0, threadIdx.x, blockDim.x,                                 \
                          [&](ll, T v) { acc = COMBINE(acc, ld(v)); });                                      \
        acc = BLOCK(acc);                                                                                    \
        if (threadIdx.x == 0) {                                                                              \
            if (split == 1) out[o] = st<T>(acc); else partial[o * split + blockIdx.y] = acc;                 \
        }                                                                                                    \
    }                                                                                                        \
}                                                                                                            \
extern "C" __global__ void NAME##_cols(A* partial, T* out, const T* a, ll n_out, ll R, ll rstride, ll chunk,  \
                                       int split, int nk, Dims ks, Dims kst) {                               \
    __shared__ A part[8][33];                                                                                \
    ll r0 = (ll)blockIdx.y * chunk, r1 = r0 + chunk < R ? r0 + chunk : R;                                    \
    for (ll ob = (ll)blockIdx.x * 32; ob < n_out; ob += (ll)gridDim.x * 32) {                                \
        ll o = ob + threadIdx.x;                                                                             \
        A acc = INIT;                                                                                        \
        if (o < n_out) {                                                                                     \
            const T* p = a + offset_of(o, nk, ks, kst);                                                      \
            _Pragma("unroll 4")                                                                              \
            for (ll r = r0 + threadIdx.y; r < r1; r += 8) acc = COMBINE(acc, ld(p[r * rstride]));            \
        }                                                                                                    \
        part[threadIdx.y][threadIdx.x] = acc;                                                                \
        __syncthreads();                                                                                     \
        if (threadIdx.y == 0 && o < n_out) {                                                                 \
            _Pragma("unroll")                                                                                \
            for (int y = 1; y < 8; ++y) acc = COMBINE(acc, part[y][threadIdx.x]);                            \
            if (split == 1) out[o] = st<T>(acc); else partial[o * split + blockIdx.y] = acc;                 \
        }                                                                                                    \
        __syncthreads();                                                                                     \
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
REDUCE(sum, (A)0, ADD, block_sum, warp_sum)
REDUCE(prod, (A)1, MUL, block_prod, warp_prod)
REDUCE(reducemax, Lim<A>::lo(), mx, block_max, warp_max)
REDUCE(reducemin, Lim<A>::hi(), mn, block_min, warp_min)

// argmax/argmin: (value, index) pairs, index -1 for none; ties and nan go to the first index
template <bool MAX> __device__ __forceinline__ bool better(A v, ll i, A b, ll j) {
    if (j < 0) return i >= 0;
    if (i < 0) return false;
    bool vn = v != v, bn = b != b;
    if (vn || bn) return vn && (!bn || i < j);
    return (MAX ? v > b : v < b) || (v == b && i < j);
}
template <bool MAX> __device__ __forceinline__ void warp_best(A& best, ll& bi) {
    for (int s = 16; s > 0; s >>= 1) {
        A ov = __shfl_xor_sync(0xffffffffu, best, s);
        ll oi = __shfl_xor_sync(0xffffffffu, bi, s);
        if (better<MAX>(ov, oi, best, bi)) { best = ov; bi = oi; }
    }
}
// one block per output along a strided dim (few, long rows)
template <bool MAX> __device__ void arg(ll* out, const T* a, ll n_out, ll dim, ll inner) {
    __shared__ A sv[32];
    __shared__ ll si[32];
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    for (ll o = blockIdx.x; o < n_out; o += gridDim.x) {
        ll base = (o / inner) * dim * inner + (o % inner);
        A best = (A)0;
        ll bi = -1;
        if (inner == 1) {
            scan(a + base, dim, threadIdx.x, blockDim.x, [&](ll r, T x) {
                A v = ld(x);
                if (better<MAX>(v, r, best, bi)) { best = v; bi = r; }
            });
        } else {
            for (ll r = threadIdx.x; r < dim; r += blockDim.x) {
                A v = ld(a[base + r * inner]);
                if (better<MAX>(v, r, best, bi)) { best = v; bi = r; }
            }
        }
        warp_best<MAX>(best, bi);
        __syncthreads();
        if (lane == 0) { sv[w] = best; si[w] = bi; }
        __syncthreads();
        if (w == 0) {
            best = lane < nw ? sv[lane] : (A)0;
            bi = lane < nw ? si[lane] : -1;
            warp_best<MAX>(best, bi);
            if (lane == 0) out[o] = bi;
        }
    }
}
// one warp per contiguous row
template <bool MAX> __device__ void arg_warp(ll* out, const T* a, ll n_out, ll dim) {
    int lane = threadIdx.x & 31, wpb = blockDim.x >> 5;
    for (ll o = (ll)blockIdx.x * wpb + (threadIdx.x >> 5); o < n_out; o += (ll)gridDim.x * wpb) {
        A best = (A)0;
        ll bi = -1;
        scan(a + o * dim, dim, lane, 32, [&](ll r, T x) {
            A v = ld(x);
            if (better<MAX>(v, r, best, bi)) { best = v; bi = r; }
        });
        warp_best<MAX>(best, bi);
        if (lane == 0) out[o] = bi;
    }
}
// one thread per output walking its strided column (neighbouring threads read neighbouring elements)
template <bool MAX> __device__ void arg_col(ll* out, const T* a, ll n_out, ll dim, ll inner) {
    GRID_STRIDE(o, n_out) {
        const T* p = a + (o / inner) * dim * inner + (o % inner);
        A best = (A)0;
        ll bi = -1;
        for (ll r = 0; r < dim; ++r) {
            A v = ld(p[r * inner]);
            if (better<MAX>(v, r, best, bi)) { best = v; bi = r; }
        }
        out[o] = bi;
    }
}
extern "C" __global__ void argmax(ll* out, const T* a, ll n_out, ll dim, ll inner) {
    arg<true>(out, a, n_out, dim, inner);
}
extern "C" __global__ void argmin(ll* out, const T* a, ll n_out, ll dim, ll inner) {
    arg<false>(out, a, n_out, dim, inner);
}
extern "C" __global__ void argmax_wrows(ll* out, const T* a, ll n_out, ll dim, ll inner) {
    arg_warp<true>(out, a, n_out, dim);
}
extern "C" __global__ void argmin_wrows(ll* out, const T* a, ll n_out, ll dim, ll inner) {
    arg_warp<false>(out, a, n_out, dim);
}
extern "C" __global__ void argmax_cols(ll* out, const T* a, ll n_out, ll dim, ll inner) {
    arg_col<true>(out, a, n_out, dim, inner);
}
extern "C" __global__ void argmin_cols(ll* out, const T* a, ll n_out, ll dim, ll inner) {
    arg_col<false>(out, a, n_out, dim, inner);
}

// cumsum: running sums in W (double for floats, long long for integers), each rounded into the output
typedef typename Wide<T>::type W;
#define SCAN_K 8
// the exclusive scan of v over the block (blockDim.x a multiple of 32); *total gets the block's sum
__device__ W block_exclusive_scan(W v, W* total) {
    __shared__ W warp_tot[32];
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    W inc = v;
    for (int o = 1; o < 32; o <<= 1) {
        W u = __shfl_up_sync(0xffffffffu, inc, o);
        if (lane >= o) inc += u;
    }
    if (lane == 31) warp_tot[w] = inc;
    __syncthreads();
    if (w == 0) {
        W t = lane < nw ? warp_tot[lane] : (W)0;
        for (int o = 1; o < 32; o <<= 1) {
            W u = __shfl_up_sync(0xffffffffu, t, o);
            if (lane >= o) t += u;
        }
        if (lane < nw) warp_tot[lane] = t;
    }
    __syncthreads();
    W before = w ? warp_tot[w - 1] : (W)0;
    W excl = __shfl_up_sync(0xffffffffu, inc, 1);
    *total = warp_tot[nw - 1];
    __syncthreads();
    return lane ? before + excl : before;
}
// one block (256 threads) per contiguous row: tiles of 256 * SCAN_K elements, loaded coalesced into shared memory,
// each thread's SCAN_K neighbours summed in order, the block's scan of those sums, the tiles before carried along
extern "C" __global__ void cumsum_rows(T* out, const T* a, ll rows, ll n, int reverse) {
    __shared__ W tile[256 * SCAN_K];
    const int B = 256;
    for (ll row = blockIdx.x; row < rows; row += gridDim.x) {
        const T* p = a + row * n;
        T* q = out + row * n;
        W carry = (W)0;
        for (ll base = 0; base < n; base += (ll)B * SCAN_K) {
            #pragma unroll
            for (int k = 0; k < SCAN_K; ++k) {
                ll j = base + (ll)k * B + threadIdx.x;
                tile[k * B + threadIdx.x] = j < n ? (W)ld(p[reverse ? n - 1 - j : j]) : (W)0;
            }
            __syncthreads();
            W run[SCAN_K];
            W s = (W)0;
            #pragma unroll
            for (int k = 0; k < SCAN_K; ++k) {
                s += tile[threadIdx.x * SCAN_K + k];
                run[k] = s;
            }
            W total;
            W before = carry + block_exclusive_scan(s, &total);
            #pragma unroll
            for (int k = 0; k < SCAN_K; ++k) tile[threadIdx.x * SCAN_K + k] = before + run[k];
            __syncthreads();
            #pragma unroll
            for (int k = 0; k < SCAN_K; ++k) {
                ll j = base + (ll)k * B + threadIdx.x;
                if (j < n) q[reverse ? n - 1 - j : j] = st<T>(tile[k * B + threadIdx.x]);
            }
            carry += total;
            __syncthreads();
        }
    }
}
// one thread per column (neighbouring threads read neighbouring elements where inner > 1)
extern "C" __global__ void cumsum_cols(T* out, const T* a, ll outer, ll n, ll inner, int reverse) {
    GRID_STRIDE(c, outer * inner) {
        ll o = c / inner, i = c - o * inner;
        const T* p = a + o * n * inner + i;
        T* q = out + o * n * inner + i;
        W s = (W)0;
        for (ll r = 0; r < n; ++r) {
            ll j = reverse ? n - 1 - r : r;
            s += (W)ld(p[j * inner]);
            q[j * inner] = st<T>(s);
        }
    }
}

// cumprod: one thread per column, the running products in W, each rounded into the output
extern "C" __global__ void cumprod_cols(T* out, const T* a, ll outer, ll n, ll inner) {
    GRID_STRIDE(c, outer * inner) {
        ll o = c / inner, i = c - o * inner;
        const T* p = a + o * n * inner + i;
        T* q = out + o * n * inner + i;
        W s = (W)1;
        for (ll j = 0; j < n; ++j) {
            s *= (W)ld(p[j * inner]);
            q[j * inner] = st<T>(s);
        }
    }
}
// cumprod's gradient, one thread per column, as the CPU kernel computes it: the running products P (kept in `prods`),
// then from the end tail += g P and dA = tail / A before the first zero z, 0 after it, and at z P[z - 1] times the sum
// over j >= z of g[j] times the running products of the values after z
extern "C" __global__ void cumprodgrad_cols(T* out, const T* a, const T* g, W* prods, ll outer, ll n, ll inner) {
    GRID_STRIDE(c, outer * inner) {
        ll o = c / inner, i = c - o * inner;
        const ll base = o * n * inner + i;
        ll z = n;
        W p = (W)1;
        for (ll j = 0; j < n; ++j) {
            const W x = (W)ld(a[base + j * inner]);
            if (x == (W)0 && z == n) z = j;
            p *= x;
            prods[base + j * inner] = p;
        }
        W tail = (W)0;
        for (ll j = n - 1; j >= 0; --j) {
            const ll at = base + j * inner;
            tail += (W)ld(g[at]) * prods[at];
            out[at] = st<T>(j < z ? tail / (W)ld(a[at]) : (W)0);
        }
        if (z < n) {
            W q = (W)1, s = (W)ld(g[base + z * inner]);
            for (ll j = z + 1; j < n; ++j) {
                q *= (W)ld(a[base + j * inner]);
                s += (W)ld(g[base + j * inner]) * q;
            }
            const W lead = z > 0 ? prods[base + (z - 1) * inner] : (W)1;
            out[base + z * inner] = st<T>(s * lead);
        }
    }
}
"""

SUPPORT = {op: frozenset(NUMERIC) for op in ("sum", "prod", "reducemax", "reducemin", "argmax", "argmin", "cumsum",
                                             "cumprod")}
SUPPORT["cumprodgrad"] = frozenset(FLOATS)

_FMT = "PPPqqqii" + dims_format(2) + "i" + dims_format(2)


@memoize("kernels.cuda.reduce.source", 64)
def source(dtype: str) -> str:
    return HEADER + f"typedef {ctype(dtype)} T;\n" + _SRC


def sources() -> list[tuple[str, str]]:
    return [(source(d), f"reduce ({d})") for d in sorted(NUMERIC)]


def _acc_itemsize(dtype: str) -> int:
    return 4 if dtype in ("float32", "float16", "bfloat16") else 8


def _split(ex: CudaExecutor, blocks: int, total: int, per_block: int) -> int:
    """How many pieces to cut each reduction into so that a launch of `blocks` blocks fills the GPU."""
    if blocks >= 2 * ex.sm_count or total < 2 * per_block:
        return 1
    return max(1, min(1024, -(-total // per_block), (4 * ex.sm_count) // blocks))


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
    dt = a.dname
    src = source(dt)
    grid_cap = 1 << 20
    if len(rs) == 1 and rst[0] == 1:  # rows: the reduced elements are each output's contiguous tail
        if total <= 1024 or (total <= 16384 and n_out >= 16 * ex.sm_count):
            f = ex.function(f"reduce:{dt}", src, op + "_wrows", "PPqq", op)
            ex.launch(op, f, (min(-(-n_out // 8), grid_cap), 1, 1), (256, 1, 1), out.ptr, a.ptr, n_out, total)
            return True
        block = 512 if total >= 16384 else 256
        split = _split(ex, n_out, total, 8192)
        chunk = -(-total // split)
        chunk = -(-chunk // 16) * 16  # pieces start on 16-element boundaries, so their packs stay aligned
        split = -(-total // chunk)
        partial = ex.alloc(n_out * split * _acc_itemsize(dt), op, "(partial results)") if split > 1 else None
        f = ex.function(f"reduce:{dt}", src, op + "_brows", "PPPqqqi", op)
        ex.launch(op, f, (min(n_out, grid_cap), split, 1), (block, 1, 1),
                  int(partial) if partial is not None else 0, out.ptr, a.ptr, n_out, total, chunk, split)
    elif len(rs) == 1 and ks and kst[-1] == 1:  # columns: neighbouring outputs are neighbours in memory
        blocks = -(-n_out // 32)
        split = _split(ex, blocks, total, 64)  # 8 rows a thread: a short chain of loads each, the GPU filled
        chunk = -(-total // split)
        partial = ex.alloc(n_out * split * _acc_itemsize(dt), op, "(partial results)") if split > 1 else None
        f = ex.function(f"reduce:{dt}", src, op + "_cols", "PPPqqqqii" + dims_format(2), op)
        ex.launch(op, f, (min(blocks, grid_cap), split, 1), (32, 8, 1),
                  int(partial) if partial is not None else 0, out.ptr, a.ptr, n_out, total, rst[0], chunk, split,
                  len(ks), *dims(ks), *dims(kst))
    else:
        block = 256 if total > 128 else 64
        split = _split(ex, n_out, total, 8192)
        chunk = -(-total // split) if total else 0
        partial = ex.alloc(n_out * split * _acc_itemsize(dt), op, "(partial results)") if split > 1 else None
        f = ex.function(f"reduce:{dt}", src, op, _FMT, op)
        ex.launch(op, f, (min(n_out, grid_cap), split, 1), (block, 1, 1),
                  int(partial) if partial is not None else 0, out.ptr, a.ptr, n_out, total, chunk, split, len(ks),
                  *dims(ks), *dims(kst), len(rs), *dims(rs), *dims(rst))
    if partial is not None:
        fin = ex.function(f"reduce:{dt}", src, op + "_finish", "PPqi", op)
        ex.launch(op, fin, (min(n_out, grid_cap), 1, 1), (256, 1, 1), out.ptr, int(partial), n_out, split)
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
    src = source(a.dname)
    if inner == 1 and (size <= 1024 or (size <= 16384 and n_out >= 16 * ex.sm_count)):
        f = ex.function(f"reduce:{a.dname}", src, op + "_wrows", "PPqqq", op)
        ex.launch(op, f, (min(-(-n_out // 8), 1 << 20), 1, 1), (256, 1, 1), out.ptr, a.ptr, n_out, size, inner)
    elif inner > 1 and (n_out >= 32 * ex.sm_count or size <= 64):
        f = ex.function(f"reduce:{a.dname}", src, op + "_cols", "PPqqq", op)
        ex.launch(op, f, ex.grid(n_out), (256, 1, 1), out.ptr, a.ptr, n_out, size, inner)
    else:
        f = ex.function(f"reduce:{a.dname}", src, op, "PPqqq", op)
        ex.launch(op, f, (min(n_out, 1 << 20), 1, 1), (256 if size > 128 else 64, 1, 1), out.ptr, a.ptr, n_out,
                  size, inner)
    return True


def argmax(ex: CudaExecutor, a: DeviceTensor, dim: int, keepdims: bool, out: DeviceTensor) -> bool:
    return _arg("argmax", ex, a, dim, out)


def argmin(ex: CudaExecutor, a: DeviceTensor, dim: int, keepdims: bool, out: DeviceTensor) -> bool:
    return _arg("argmin", ex, a, dim, out)


def cumsum(ex: CudaExecutor, a: DeviceTensor, dim: int, reverse: bool, out: DeviceTensor) -> bool:
    if a.size == 0:
        return True
    if a.ndim == 0:
        ex.copy(out, a)
        return True
    dim %= a.ndim
    n = a.shape[dim]
    outer, inner = math.prod(a.shape[:dim]), math.prod(a.shape[dim + 1:])
    src = source(a.dname)
    if inner == 1 and n > 32:
        f = ex.function(f"reduce:{a.dname}", src, "cumsum_rows", "PPqqi", "cumsum")
        ex.launch("cumsum", f, (min(outer, 1 << 20), 1, 1), (256, 1, 1), out.ptr, a.ptr, outer, n, int(reverse))
    else:
        f = ex.function(f"reduce:{a.dname}", src, "cumsum_cols", "PPqqqi", "cumsum")
        ex.launch("cumsum", f, ex.grid(outer * inner), (256, 1, 1), out.ptr, a.ptr, outer, n, inner, int(reverse))
    return True


def _columns(a: DeviceTensor, dim: int) -> tuple[int, int, int]:
    dim %= a.ndim
    return math.prod(a.shape[:dim]), a.shape[dim], math.prod(a.shape[dim + 1:])


def cumprod(ex: CudaExecutor, a: DeviceTensor, dim: int, out: DeviceTensor) -> bool:
    if a.size == 0:
        return True
    if a.ndim == 0:
        ex.copy(out, a)
        return True
    outer, n, inner = _columns(a, dim)
    f = ex.function(f"reduce:{a.dname}", source(a.dname), "cumprod_cols", "PPqqq", "cumprod")
    ex.launch("cumprod", f, ex.grid(outer * inner), (256, 1, 1), out.ptr, a.ptr, outer, n, inner)
    return True


def cumprodgrad(ex: CudaExecutor, a: DeviceTensor, g: DeviceTensor, dim: int, out: DeviceTensor) -> bool:
    if a.size == 0:
        return True
    if a.ndim == 0:
        ex.copy(out, g)
        return True
    outer, n, inner = _columns(a, dim)
    prods = ex.alloc(a.size * 8, "cumprodgrad", "(running products)")
    f = ex.function(f"reduce:{a.dname}", source(a.dname), "cumprodgrad_cols", "PPPPqqq", "cumprodgrad")
    ex.launch("cumprodgrad", f, ex.grid(outer * inner), (256, 1, 1), out.ptr, a.ptr, g.ptr, int(prods), outer, n,
              inner)
    return True
