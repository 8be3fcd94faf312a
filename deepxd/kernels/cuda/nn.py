"""softmax, logsoftmax, layernorm, rmsnorm, crossentropy and mse on the device, computed in float32 (float64 for
float64 tensors) like the CPU kernels.

Rows of up to 16384 elements (8192 for float64) are held in registers, a warp per row up to 1024 elements and a block
per row beyond (`row_plan`), so each is read and written once, in 16-byte packs where the row length and pointers
allow. Longer rows, rows along a non-last dim and crossentropy use the online softmax (one pass keeps the running max
and sum of exponentials). The activations (relu, sigmoid, tanh, gelu, silu, erf) and gelugrad are elementwise kernels
(elementwise.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from deepx_core.cache import memoize
from deepx_core.errors import DeepxError
from deepx_core.ir.dtypes import FLOATS, to_numpy
from deepxd.kernels.cuda._src import HEADER, ctype

if TYPE_CHECKING:
    from deepxd.kernels.cuda import CudaExecutor, DeviceTensor

_SRC = r"""
typedef typename Acc<T>::type A;
__device__ __forceinline__ A finite_or_zero(A m) { return isfinite(m) ? m : (A)0; }

// elements per 16-byte load
constexpr int VW = 16 / sizeof(T);
typedef Pack<T, VW> VecT;

// ---- rows held in registers: E elements per thread, one warp (W) or one block (B) per row.
// Thread t of a group of G holds elements t + j*G (scalar), or the 16-byte packs t + j*G (VEC: the row length is a
// multiple of VW and the pointers are 16-byte aligned), so that every load and store is coalesced.
template <int E, bool VEC> __device__ __forceinline__ ll slot(int j, int t, int G) {
    return VEC ? ((ll)t + (ll)(j / VW) * G) * VW + (j % VW) : (ll)t + (ll)j * G;
}
template <int E, bool VEC> __device__ __forceinline__ void load_row(A (&x)[E], const T* p, ll n, int t, int G,
                                                                    A fill) {
    if (VEC) {
        #pragma unroll
        for (int j = 0; j < E / VW; ++j) {
            ll k = (ll)t + (ll)j * G;
            if (k * VW < n) {
                VecT v = ((const VecT*)p)[k];
                #pragma unroll
                for (int e = 0; e < VW; ++e) x[j * VW + e] = ld(v.v[e]);
            } else {
                #pragma unroll
                for (int e = 0; e < VW; ++e) x[j * VW + e] = fill;
            }
        }
    } else {
        #pragma unroll
        for (int j = 0; j < E; ++j) {
            ll i = (ll)t + (ll)j * G;
            x[j] = i < n ? ld(p[i]) : fill;
        }
    }
}
template <int E, bool VEC> __device__ __forceinline__ void store_row(const A (&y)[E], T* p, ll n, int t, int G) {
    if (VEC) {
        #pragma unroll
        for (int j = 0; j < E / VW; ++j) {
            ll k = (ll)t + (ll)j * G;
            if (k * VW < n) {
                VecT v;
                #pragma unroll
                for (int e = 0; e < VW; ++e) v.v[e] = st<T>(y[j * VW + e]);
                ((VecT*)p)[k] = v;
            }
        }
    } else {
        #pragma unroll
        for (int j = 0; j < E; ++j) {
            ll i = (ll)t + (ll)j * G;
            if (i < n) p[i] = st<T>(y[j]);
        }
    }
}
template <bool WARP> __device__ __forceinline__ A group_sum(A v) { return WARP ? warp_sum(v) : block_sum(v); }
template <bool WARP> __device__ __forceinline__ A group_max(A v) { return WARP ? warp_max(v) : block_max(v); }

// the rows of a group: a warp per row (several rows per block), or a block per row
#define FOR_ROWS(WARP, row, rows, t, G)                                                                      \
    const int t = WARP ? (threadIdx.x & 31) : threadIdx.x, G = WARP ? 32 : blockDim.x;                        \
    const ll row0 = WARP ? (ll)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5) : (ll)blockIdx.x;          \
    const ll rstep = WARP ? (ll)gridDim.x * (blockDim.x >> 5) : (ll)gridDim.x;                                \
    for (ll row = row0; row < rows; row += rstep)

template <int E, bool VEC, bool WARP> __device__ __forceinline__ void softmax_reg(T* out, const T* a, ll rows, ll n,
                                                                                   int lg) {
    FOR_ROWS(WARP, row, rows, t, G) {
        A x[E];
        load_row<E, VEC>(x, a + row * n, n, t, G, (A)-INFINITY);  // padding: -inf adds nothing to max or sum
        A m = -INFINITY;
        #pragma unroll
        for (int j = 0; j < E; ++j) m = mx(m, x[j]);
        m = finite_or_zero(group_max<WARP>(m));
        A s = 0;
        if (lg) {
            #pragma unroll
            for (int j = 0; j < E; ++j) s += exp(x[j] - m);
            A ls = log(group_sum<WARP>(s));
            #pragma unroll
            for (int j = 0; j < E; ++j) x[j] = (x[j] - m) - ls;
        } else {
            #pragma unroll
            for (int j = 0; j < E; ++j) { x[j] = exp(x[j] - m); s += x[j]; }
            s = group_sum<WARP>(s);
            #pragma unroll
            for (int j = 0; j < E; ++j) x[j] = x[j] / s;
        }
        store_row<E, VEC>(x, out + row * n, n, t, G);
    }
}
template <int E, bool VEC, bool WARP> __device__ __forceinline__ void layernorm_reg(
        T* out, const T* a, const T* w, const T* b, ll rows, ll n, double eps) {
    FOR_ROWS(WARP, row, rows, t, G) {
        A x[E], y[E];
        load_row<E, VEC>(x, a + row * n, n, t, G, (A)0);
        A s = 0;
        #pragma unroll
        for (int j = 0; j < E; ++j) s += x[j];
        A mean = group_sum<WARP>(s) / (A)n;
        A v = 0;
        #pragma unroll
        for (int j = 0; j < E; ++j) {
            A d = x[j] - mean;
            if (slot<E, VEC>(j, t, G) < n) v += d * d;
        }
        A var = group_sum<WARP>(v) / (A)n;
        A rstd = (A)1 / sqrt(var + (A)eps);
        load_row<E, VEC>(y, w, n, t, G, (A)0);
        #pragma unroll
        for (int j = 0; j < E; ++j) x[j] = (x[j] - mean) * rstd * y[j];
        load_row<E, VEC>(y, b, n, t, G, (A)0);
        #pragma unroll
        for (int j = 0; j < E; ++j) x[j] = x[j] + y[j];
        store_row<E, VEC>(x, out + row * n, n, t, G);
    }
}
template <int E, bool VEC, bool WARP> __device__ __forceinline__ void rmsnorm_reg(
        T* out, const T* a, const T* w, ll rows, ll n, double eps) {
    FOR_ROWS(WARP, row, rows, t, G) {
        A x[E], y[E];
        load_row<E, VEC>(x, a + row * n, n, t, G, (A)0);
        A s = 0;
        #pragma unroll
        for (int j = 0; j < E; ++j) s += x[j] * x[j];
        A ms = group_sum<WARP>(s) / (A)n;
        A r = (A)1 / sqrt(ms + (A)eps);
        load_row<E, VEC>(y, w, n, t, G, (A)0);
        #pragma unroll
        for (int j = 0; j < E; ++j) x[j] = x[j] * r * y[j];
        store_row<E, VEC>(x, out + row * n, n, t, G);
    }
}
// extern "C" instances: softmax_w8v = 8 elements per thread, a warp per row, 16-byte packs; _b: a block per row
#define ROW_KERNELS(SUF, E, VEC, WARP, BOUND)                                                                \
extern "C" __global__ void __launch_bounds__(BOUND) softmax_##SUF(T* out, const T* a, ll rows, ll n, int lg) { \
    softmax_reg<E, VEC, WARP>(out, a, rows, n, lg);                                                          \
}                                                                                                            \
extern "C" __global__ void __launch_bounds__(BOUND) layernorm_##SUF(T* out, const T* a, const T* w, const T* b, \
                                                                    ll rows, ll n, double eps) {             \
    layernorm_reg<E, VEC, WARP>(out, a, w, b, rows, n, eps);                                                 \
}                                                                                                            \
extern "C" __global__ void __launch_bounds__(BOUND) rmsnorm_##SUF(T* out, const T* a, const T* w, ll rows, ll n, \
                                                                  double eps) {                              \
    rmsnorm_reg<E, VEC, WARP>(out, a, w, rows, n, eps);                                                      \
}
@@INSTANCES@@

// ---- rows too long for registers, and rows along a non-last dim: one pass keeps a running (max, sum of exp)
// pair (the online softmax), a second pass writes. A row whose max is not finite (inf, nan, or all -inf) is summed
// again against 0, as the two-pass form does.
__device__ __forceinline__ void online(A& m, A& s, A v) {
    if (v != v || v > m) {
        if (v == v) s = s * exp(m - v) + (A)1;
        m = v;
    } else if (m != -INFINITY) {
        s += exp(v - m);
    }
}
__device__ __forceinline__ void online_merge(A& m, A& s, A m2, A s2) {
    A M = mx(m, m2);
    if (isfinite(M)) s = (m == -INFINITY ? (A)0 : s * exp(m - M)) + (m2 == -INFINITY ? (A)0 : s2 * exp(m2 - M));
    m = M;
}
__device__ __forceinline__ void warp_online(A& m, A& s) {
    for (int o = 16; o > 0; o >>= 1) {
        A m2 = __shfl_xor_sync(0xffffffffu, m, o), s2 = __shfl_xor_sync(0xffffffffu, s, o);
        online_merge(m, s, m2, s2);
    }
}
__device__ void block_online(A& m, A& s) {
    __shared__ A pm[32], ps[32];
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    warp_online(m, s);
    __syncthreads();
    if (lane == 0) { pm[w] = m; ps[w] = s; }
    __syncthreads();
    m = lane < nw ? pm[lane] : (A)-INFINITY;
    s = lane < nw ? ps[lane] : (A)0;
    warp_online(m, s);
}

// f(i, value) for every element i of p[0, n) that thread t of a group of G threads owns: scalar loads up to the
// first 16-byte boundary, then 16-byte packs, then a scalar tail
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

// one block per row of `size` elements at stride `inner` (rows: outer x inner)
extern "C" __global__ void __launch_bounds__(1024) softmax_long(T* out, const T* a, ll rows, ll size, ll inner,
                                                                 int lg) {
    for (ll row = blockIdx.x; row < rows; row += gridDim.x) {
        ll base = (row / inner) * size * inner + (row % inner);
        A m = -INFINITY, s = 0;
        if (inner == 1) {
            scan(a + base, size, threadIdx.x, blockDim.x, [&](ll, T v) { online(m, s, ld(v)); });
        } else {
            for (ll r = threadIdx.x; r < size; r += blockDim.x) online(m, s, ld(a[base + r * inner]));
        }
        block_online(m, s);
        if (!isfinite(m)) {
            m = 0;
            s = 0;
            for (ll r = threadIdx.x; r < size; r += blockDim.x) s += exp(ld(a[base + r * inner]));
            s = block_sum(s);
        }
        A ls = log(s);
        if (inner == 1) {
            T* o = out + base;
            scan(a + base, size, threadIdx.x, blockDim.x, [&](ll i, T v) {
                A x = ld(v);
                o[i] = lg ? st<T>((x - m) - ls) : st<T>(exp(x - m) / s);
            });
        } else {
            for (ll r = threadIdx.x; r < size; r += blockDim.x) {
                A x = ld(a[base + r * inner]);
                out[base + r * inner] = lg ? st<T>((x - m) - ls) : st<T>(exp(x - m) / s);
            }
        }
    }
}
// one thread per row along a non-last dim: neighbouring threads read neighbouring elements
extern "C" __global__ void softmax_cols(T* out, const T* a, ll rows, ll size, ll inner, int lg) {
    GRID_STRIDE(row, rows) {
        const T* p = a + (row / inner) * size * inner + (row % inner);
        T* o = out + (p - a);
        A m = -INFINITY, s = 0;
        for (ll r = 0; r < size; ++r) online(m, s, ld(p[r * inner]));
        if (!isfinite(m)) {
            m = 0;
            s = 0;
            for (ll r = 0; r < size; ++r) s += exp(ld(p[r * inner]));
        }
        A ls = log(s);
        for (ll r = 0; r < size; ++r) {
            A x = ld(p[r * inner]);
            o[r * inner] = lg ? st<T>((x - m) - ls) : st<T>(exp(x - m) / s);
        }
    }
}

// layernorm and rmsnorm over rows too long for registers: one block per row
extern "C" __global__ void __launch_bounds__(1024) layernorm_long(T* out, const T* a, const T* w, const T* b,
                                                                   ll rows, ll n, double eps) {
    for (ll row = blockIdx.x; row < rows; row += gridDim.x) {
        const T* x = a + row * n;
        A s = 0;
        scan(x, n, threadIdx.x, blockDim.x, [&](ll, T v) { s += ld(v); });
        A mean = block_sum(s) / (A)n;
        A v = 0;
        scan(x, n, threadIdx.x, blockDim.x, [&](ll, T e) { A d = ld(e) - mean; v += d * d; });
        A var = block_sum(v) / (A)n;
        A rstd = (A)1 / sqrt(var + (A)eps);
        T* o = out + row * n;
        scan(x, n, threadIdx.x, blockDim.x,
             [&](ll i, T e) { o[i] = st<T>((ld(e) - mean) * rstd * ld(w[i]) + ld(b[i])); });
    }
}
extern "C" __global__ void __launch_bounds__(1024) rmsnorm_long(T* out, const T* a, const T* w, ll rows, ll n,
                                                                 double eps) {
    for (ll row = blockIdx.x; row < rows; row += gridDim.x) {
        const T* x = a + row * n;
        A s = 0;
        scan(x, n, threadIdx.x, blockDim.x, [&](ll, T v) { A e = ld(v); s += e * e; });
        A ms = block_sum(s) / (A)n;
        A r = (A)1 / sqrt(ms + (A)eps);
        T* o = out + row * n;
        scan(x, n, threadIdx.x, blockDim.x, [&](ll i, T e) { o[i] = st<T>(ld(e) * r * ld(w[i])); });
    }
}

// a row's max m and sum s of exp(x - m), by its group (every thread of it calls this): one pass of the online
// softmax; a row whose max is not finite is summed again against 0
template <bool WARP> __device__ __forceinline__ void row_max_sum(const T* x, ll c, int t, int G, A& m, A& s) {
    m = -INFINITY;
    s = 0;
    scan(x, c, t, G, [&](ll, T v) { online(m, s, ld(v)); });
    if (WARP) warp_online(m, s); else block_online(m, s);
    if (!isfinite(m)) {
        m = 0;
        s = 0;
        for (ll i = t; i < c; i += G) s += exp(ld(x[i]));
        s = group_sum<WARP>(s);
    }
}

// layernorm's (rms = 0) and rmsnorm's (rms = 1) gradient for A, a warp or a block per row, in three passes over it:
// the row's statistics, the sums of d = G w and d xhat, then dA = rstd (d - mean(d) - xhat mean(d xhat)) (rmsnorm:
// no mean(d), xhat = A r) and xhat itself, for weight's gradient
template <bool WARP> __device__ __forceinline__ void normgrad_rows(T* da, T* xn, const T* a, const T* w, const T* g,
                                                                   ll rows, ll n, double eps, int rms) {
    FOR_ROWS(WARP, row, rows, t, G) {
        const T* x = a + row * n;
        const T* gr = g + row * n;
        A mean = 0;
        if (!rms) {
            A s = 0;
            for (ll i = t; i < n; i += G) s += ld(x[i]);
            mean = group_sum<WARP>(s) / (A)n;
        }
        A v = 0;
        for (ll i = t; i < n; i += G) { A d = ld(x[i]) - mean; v += d * d; }
        A rstd = (A)1 / sqrt(group_sum<WARP>(v) / (A)n + (A)eps);
        A s1 = 0, s2 = 0;
        for (ll i = t; i < n; i += G) {
            A d = ld(gr[i]) * ld(w[i]);
            s1 += d;
            s2 += d * ((ld(x[i]) - mean) * rstd);
        }
        s1 = rms ? (A)0 : group_sum<WARP>(s1) / (A)n;
        s2 = group_sum<WARP>(s2) / (A)n;
        T* o = da + row * n;
        T* h = xn + row * n;
        for (ll i = t; i < n; i += G) {
            A xh = (ld(x[i]) - mean) * rstd;
            o[i] = st<T>(rstd * (ld(gr[i]) * ld(w[i]) - s1 - xh * s2));
            h[i] = st<T>(xh);
        }
    }
}
extern "C" __global__ void normgrad_w(T* da, T* xn, const T* a, const T* w, const T* g, ll rows, ll n, double eps,
                                      int rms) {
    normgrad_rows<true>(da, xn, a, w, g, rows, n, eps, rms);
}
extern "C" __global__ void __launch_bounds__(1024) normgrad_b(T* da, T* xn, const T* a, const T* w, const T* g,
                                                               ll rows, ll n, double eps, int rms) {
    normgrad_rows<false>(da, xn, a, w, g, rows, n, eps, rms);
}

// crossentropy, per row: -log_softmax(logits)[label] (0 where ignored) into loss[row]; keep[row] = 1 if counted.
// One pass of the online softmax per row, by a warp (short rows) or a block.
template <bool WARP, class TL> __device__ void ce_rows(A* loss, A* keep, const T* logits, const TL* labels, ll n,
                                                       ll c, ll ignore, int* err) {
    FOR_ROWS(WARP, row, n, t, G) {
        const T* x = logits + row * c;
        ll label = (ll)labels[row];
        bool kept = label != ignore;
        if (kept && (label < 0 || label >= c)) { if (t == 0) atomicExch(err, 1); kept = false; }
        A m, s;
        row_max_sum<WARP>(x, c, t, G, m, s);
        if (t == 0) {
            loss[row] = kept ? -((ld(x[label]) - m) - log(s)) : (A)0;
            keep[row] = kept ? (A)1 : (A)0;
        }
    }
}
#define CE(SUF, WARP, TL)                                                                                     \
extern "C" __global__ void __launch_bounds__(1024) ce_rows_##SUF(A* loss, A* keep, const T* logits,           \
                                                           const TL* labels, ll n, ll c, ll ignore, int* err) { \
    ce_rows<WARP>(loss, keep, logits, labels, n, c, ignore, err);                                             \
}
CE(int32, false, int)
CE(int64, false, ll)
CE(w_int32, true, int)
CE(w_int64, true, ll)

// crossentropy's gradient, per row: (softmax(logits) - onehot(label)) * keep * scale, where scale is g / kept (mode 0,
// mean: zeros when no row is kept, as the CPU kernel and torch), g (1, sum) or g[row] (2, none); a label outside
// [0, c) matches no column. One pass of the online softmax per row, a second writes.
template <bool WARP, class TL> __device__ void ce_grad_rows(T* out, const T* logits, const TL* labels, const T* g,
                                                           const A* kept, ll n, ll c, ll ignore, int mode) {
    FOR_ROWS(WARP, row, n, t, G) {
        const T* x = logits + row * c;
        T* o = out + row * c;
        if (mode == 0 && kept[0] == (A)0) {
            for (ll i = t; i < c; i += G) o[i] = st<T>((A)0);
            continue;
        }
        ll label = (ll)labels[row];
        A keep = label != ignore ? (A)1 : (A)0;
        A scale = mode == 2 ? ld(g[row]) : (mode == 0 ? ld(g[0]) / kept[0] : ld(g[0]));
        A m, s;
        row_max_sum<WARP>(x, c, t, G, m, s);
        for (ll i = t; i < c; i += G) o[i] = st<T>((exp(ld(x[i]) - m) / s - (i == label ? (A)1 : (A)0)) * keep * scale);
    }
}
// one block: the rows whose label is kept
template <class TL> __device__ void ce_kept(A* kept, const TL* labels, ll n, ll ignore) {
    A k = 0;
    for (ll i = threadIdx.x; i < n; i += blockDim.x) k += (ll)labels[i] != ignore ? (A)1 : (A)0;
    k = block_sum(k);
    if (threadIdx.x == 0) kept[0] = k;
}
#define CEG(SUF, WARP, TL)                                                                                    \
extern "C" __global__ void __launch_bounds__(1024) ce_grad_##SUF(T* out, const T* logits, const TL* labels,     \
                                                           const T* g, const A* kept, ll n, ll c, ll ignore,     \
                                                           int mode) {                                          \
    ce_grad_rows<WARP>(out, logits, labels, g, kept, n, c, ignore, mode);                                       \
}
CEG(int32, false, int)
CEG(int64, false, ll)
CEG(w_int32, true, int)
CEG(w_int64, true, ll)
extern "C" __global__ void ce_kept_int32(A* kept, const int* labels, ll n, ll ignore) {
    ce_kept(kept, labels, n, ignore);
}
extern "C" __global__ void ce_kept_int64(A* kept, const ll* labels, ll n, ll ignore) {
    ce_kept(kept, labels, n, ignore);
}

// one block: out = sum(loss) / sum(keep) (mean) or sum(loss) (sum)
extern "C" __global__ void ce_total(T* out, const A* loss, const A* keep, ll n, int mean) {
    A s = 0, k = 0;
    for (ll i = threadIdx.x; i < n; i += blockDim.x) { s += loss[i]; k += keep[i]; }
    s = block_sum(s);
    k = block_sum(k);
    if (threadIdx.x == 0) out[0] = mean ? st<T>((double)s / (double)k) : st<T>(s);
}
extern "C" __global__ void store(T* out, const A* v, ll n) { GRID_STRIDE(i, n) out[i] = st<T>(v[i]); }

// mse: squared differences (reduction none), or per-block partial sums then one block's total
extern "C" __global__ void sqdiff(T* out, const T* a, const T* b, ll n) {
    GRID_STRIDE(i, n) { A d = ld(a[i]) - ld(b[i]); out[i] = st<T>(d * d); }
}
extern "C" __global__ void sqdiff_partial(A* partial, const T* a, const T* b, ll n) {
    A s = 0;
    GRID_STRIDE(i, n) { A d = ld(a[i]) - ld(b[i]); s += d * d; }
    s = block_sum(s);
    if (threadIdx.x == 0) partial[blockIdx.x] = s;
}
extern "C" __global__ void partial_total(T* out, const A* partial, int parts, ll count, int mean) {
    A s = 0;
    for (int i = threadIdx.x; i < parts; i += blockDim.x) s += partial[i];
    s = block_sum(s);
    if (threadIdx.x == 0) out[0] = st<T>(mean ? s / (A)count : s);
}
"""

_NN = ("softmax", "logsoftmax", "layernorm", "rmsnorm", "layernormgrad", "rmsnormgrad", "crossentropy",
       "crossentropygrad", "mse")
SUPPORT = {op: frozenset(FLOATS) for op in _NN}


#: elements per thread of the register-row kernels: a warp per row up to 32 x 32 elements, a block of up to
#: `_MAX_BLOCK` threads beyond that
_WARP_E = (1, 2, 4, 8, 16, 32)
_BLOCK_E = (4, 8, 16, 32)
_MAX_BLOCK = 512
#: rows per block of the warp-per-row kernels
_WARPS = 8


def _vec_width(dtype: str) -> int:
    return 16 // to_numpy(dtype).itemsize


def _block_es(dtype: str) -> tuple[int, ...]:
    # 32 doubles a thread spill out of the 128 registers a 512-thread block leaves each thread
    return _BLOCK_E[:-1] if dtype == "float64" else _BLOCK_E


def _instances(dtype: str) -> str:
    vw = _vec_width(dtype)
    lines = []
    for mode, es, bound in (("w", _WARP_E, 32 * _WARPS), ("b", _block_es(dtype), _MAX_BLOCK)):
        warp = "true" if mode == "w" else "false"
        for e in es:
            lines.append(f"ROW_KERNELS({mode}{e}, {e}, false, {warp}, {bound})")
            if e >= vw:
                lines.append(f"ROW_KERNELS({mode}{e}v, {e}, true, {warp}, {bound})")
    return "\n".join(lines)


@memoize("kernels.cuda.nn.source", 64)
def source(dtype: str) -> str:
    return HEADER + f"typedef {ctype(dtype)} T;\n" + _SRC.replace("@@INSTANCES@@", _instances(dtype))


def sources() -> list[tuple[str, str]]:
    return [(source(d), f"nn ({d})") for d in sorted(FLOATS)]


def _fn(ex: CudaExecutor, dtype: str, name: str, fmt: str, op: str) -> Any:
    return ex.function(f"nn:{dtype}", source(dtype), name, fmt, op)


def _acc_size(dtype: str) -> int:
    return 8 if dtype == "float64" else 4


def row_plan(n: int, dtype: str, ptrs: tuple[int, ...]) -> tuple[str, int, int] | None:
    """How a row of `n` contiguous elements is held in registers: (kernel suffix, threads per block, rows per block),
    or None when it is too long (the `_long` kernels stream it twice instead)."""
    vw = _vec_width(dtype)
    aligned = n % vw == 0 and all(p % 16 == 0 for p in ptrs)
    for e in _WARP_E:
        if 32 * e >= n:
            return f"w{e}{'v' if aligned and e >= vw else ''}", 32 * _WARPS, _WARPS
    for e in _block_es(dtype):
        if aligned and e < vw:
            continue
        threads = -(-n // (32 * e)) * 32
        if threads <= _MAX_BLOCK:
            return f"b{e}{'v' if aligned and e >= vw else ''}", threads, 1
    return None


def _launch_rows(ex: CudaExecutor, op: str, f: Any, rows: int, plan: tuple[str, int, int], *args: Any) -> None:
    _, threads, per_block = plan
    ex.launch(op, f, (min(-(-rows // per_block), 1 << 20), 1, 1), (threads, 1, 1), *args)


def _softmax(op: str, ex: CudaExecutor, a: DeviceTensor, dim: int, out: DeviceTensor, log: bool) -> bool:
    if a.ndim == 0:
        from deepxd.kernels.cuda.init import fill_bytes

        fill_bytes(ex, op, out, 0 if log else 1)
        return True
    dim %= a.ndim
    size = a.shape[dim]
    inner = 1
    for d in a.shape[dim + 1:]:
        inner *= d
    rows = a.size // size if size else 0
    if rows == 0 or size == 0:
        return True
    lg = 1 if log else 0
    plan = row_plan(size, a.dname, (a.ptr, out.ptr)) if inner == 1 else None
    if plan is not None:
        f = _fn(ex, a.dname, f"softmax_{plan[0]}", "PPqqi", op)
        _launch_rows(ex, op, f, rows, plan, out.ptr, a.ptr, rows, size, lg)
    elif inner > 1 and (rows >= 32 * ex.sm_count or size <= 64):
        f = _fn(ex, a.dname, "softmax_cols", "PPqqqi", op)
        ex.launch(op, f, ex.grid(rows), (256, 1, 1), out.ptr, a.ptr, rows, size, inner, lg)
    else:
        f = _fn(ex, a.dname, "softmax_long", "PPqqqi", op)
        ex.launch(op, f, (min(rows, 1 << 20), 1, 1), (1024 if size >= 16384 else 256, 1, 1), out.ptr, a.ptr, rows,
                  size, inner, lg)
    return True


def softmax(ex: CudaExecutor, a: DeviceTensor, dim: int, out: DeviceTensor) -> bool:
    return _softmax("softmax", ex, a, dim, out, False)


def logsoftmax(ex: CudaExecutor, a: DeviceTensor, dim: int, out: DeviceTensor) -> bool:
    return _softmax("logsoftmax", ex, a, dim, out, True)


def layernorm(ex: CudaExecutor, a: DeviceTensor, w: DeviceTensor, b: DeviceTensor, eps: Any,
              out: DeviceTensor) -> bool:
    n = w.size
    if n == 0:
        return False
    rows = a.size // n
    if rows:
        plan = row_plan(n, a.dname, (a.ptr, w.ptr, b.ptr, out.ptr))
        if plan is not None:
            f = _fn(ex, a.dname, f"layernorm_{plan[0]}", "PPPPqqd", "layernorm")
            _launch_rows(ex, "layernorm", f, rows, plan, out.ptr, a.ptr, w.ptr, b.ptr, rows, n, float(eps))
        else:
            f = _fn(ex, a.dname, "layernorm_long", "PPPPqqd", "layernorm")
            ex.launch("layernorm", f, (min(rows, 1 << 20), 1, 1), (1024, 1, 1), out.ptr, a.ptr, w.ptr, b.ptr, rows,
                      n, float(eps))
    return True


def rmsnorm(ex: CudaExecutor, a: DeviceTensor, w: DeviceTensor, eps: Any, out: DeviceTensor) -> bool:
    n = w.size
    if n == 0:
        return False
    rows = a.size // n
    if rows:
        plan = row_plan(n, a.dname, (a.ptr, w.ptr, out.ptr))
        if plan is not None:
            f = _fn(ex, a.dname, f"rmsnorm_{plan[0]}", "PPPqqd", "rmsnorm")
            _launch_rows(ex, "rmsnorm", f, rows, plan, out.ptr, a.ptr, w.ptr, rows, n, float(eps))
        else:
            f = _fn(ex, a.dname, "rmsnorm_long", "PPPqqd", "rmsnorm")
            ex.launch("rmsnorm", f, (min(rows, 1 << 20), 1, 1), (1024, 1, 1), out.ptr, a.ptr, w.ptr, rows, n,
                      float(eps))
    return True


def _normgrad(op: str, ex: CudaExecutor, a: DeviceTensor, w: DeviceTensor, g: DeviceTensor, eps: Any,
              da: DeviceTensor, xn: DeviceTensor) -> bool:
    n = w.size
    if n == 0:
        return False
    rows = a.size // n
    if rows:
        args = (da.ptr, xn.ptr, a.ptr, w.ptr, g.ptr, rows, n, float(eps), int(op == "rmsnormgrad"))
        if n <= 1024:  # a warp per row, _WARPS rows per block
            f = _fn(ex, a.dname, "normgrad_w", "PPPPPqqdi", op)
            ex.launch(op, f, (min(-(-rows // _WARPS), 1 << 20), 1, 1), (32 * _WARPS, 1, 1), *args)
        else:
            f = _fn(ex, a.dname, "normgrad_b", "PPPPPqqdi", op)
            threads = min(1024, -(-n // 128) * 32)
            ex.launch(op, f, (min(rows, 1 << 20), 1, 1), (threads, 1, 1), *args)
    return True


def layernormgrad(ex: CudaExecutor, a: DeviceTensor, w: DeviceTensor, g: DeviceTensor, eps: Any, da: DeviceTensor,
                  xn: DeviceTensor) -> bool:
    return _normgrad("layernormgrad", ex, a, w, g, eps, da, xn)


def rmsnormgrad(ex: CudaExecutor, a: DeviceTensor, w: DeviceTensor, g: DeviceTensor, eps: Any, da: DeviceTensor,
                xn: DeviceTensor) -> bool:
    return _normgrad("rmsnormgrad", ex, a, w, g, eps, da, xn)


def _ce_rows_launch(ex: CudaExecutor, dt: str, kernel: str, ldt: str, fmt: str, op: str, n: int, c: int
                    ) -> tuple[Any, tuple[int, int, int], tuple[int, int, int]]:
    """The per-row crossentropy kernel (`kernel`, of labels `ldt`) and its launch shape: a warp per row up to 2048
    classes, a block per row beyond."""
    if c <= 2048:
        return (_fn(ex, dt, f"{kernel}_w_{ldt}", fmt, op), (min(-(-n // _WARPS), 1 << 20), 1, 1),
                (32 * _WARPS, 1, 1))
    return _fn(ex, dt, f"{kernel}_{ldt}", fmt, op), (min(n, 1 << 20), 1, 1), (1024 if c >= 16384 else 256, 1, 1)


def crossentropy(ex: CudaExecutor, logits: DeviceTensor, labels: DeviceTensor, ignore_index: int, reduction: str,
                 out: DeviceTensor) -> bool:
    if reduction not in ("mean", "sum", "none"):
        raise DeepxError(f"crossentropy: reduction must be mean, sum or none, got {reduction!r}")
    n, c = logits.shape
    dt = logits.dname
    if not -(2**63) <= ignore_index < 2**63:
        return False
    size = _acc_size(dt)
    loss = ex.alloc(max(n, 1) * size, "crossentropy", "(row losses)")
    keep = ex.alloc(max(n, 1) * size, "crossentropy", "(row counts)")
    if n:
        ex.clear_flag()
        f, grid, block = _ce_rows_launch(ex, dt, "ce_rows", labels.dname, "PPPPqqqP", "crossentropy", n, c)
        ex.launch("crossentropy", f, grid, block, int(loss), int(keep), logits.ptr, labels.ptr, n, c, ignore_index,
                  ex.flag_ptr)
        ex.raise_flag("crossentropy", f"a label is out of range for {c} classes")
    if reduction == "none":
        if n:
            f = _fn(ex, dt, "store", "PPq", "crossentropy")
            ex.launch("crossentropy", f, ex.grid(n), (256, 1, 1), out.ptr, int(loss), n)
        return True
    f = _fn(ex, dt, "ce_total", "PPPqi", "crossentropy")
    ex.launch("crossentropy", f, (1, 1, 1), (1024, 1, 1), out.ptr, int(loss), int(keep), n,
              1 if reduction == "mean" else 0)
    return True


def crossentropygrad(ex: CudaExecutor, logits: DeviceTensor, labels: DeviceTensor, g: DeviceTensor, ignore_index: int,
                     reduction: str, out: DeviceTensor) -> bool:
    modes = {"mean": 0, "sum": 1, "none": 2}
    if reduction not in modes:
        raise DeepxError(f"crossentropygrad: reduction must be mean, sum or none, got {reduction!r}")
    n, c = logits.shape
    dt = logits.dname
    if not -(2**63) <= ignore_index < 2**63:
        return False
    if not n or not c:
        return True
    kept = ex.alloc(_acc_size(dt), "crossentropygrad", "(kept rows)")
    mode = modes[reduction]
    if mode == 0:
        f = _fn(ex, dt, f"ce_kept_{labels.dname}", "PPqq", "crossentropygrad")
        ex.launch("crossentropygrad", f, (1, 1, 1), (1024, 1, 1), int(kept), labels.ptr, n, ignore_index)
    f, grid, block = _ce_rows_launch(ex, dt, "ce_grad", labels.dname, "PPPPPqqqi", "crossentropygrad", n, c)
    ex.launch("crossentropygrad", f, grid, block, out.ptr, logits.ptr, labels.ptr, g.ptr, int(kept), n, c,
              ignore_index, mode)
    return True


def mse(ex: CudaExecutor, a: DeviceTensor, b: DeviceTensor, reduction: str, out: DeviceTensor) -> bool:
    if reduction not in ("mean", "sum", "none"):
        raise DeepxError(f"mse: reduction must be mean, sum or none, got {reduction!r}")
    n = a.size
    dt = a.dname
    if reduction == "none":
        if n:
            f = _fn(ex, dt, "sqdiff", "PPPq", "mse")
            ex.launch("mse", f, ex.grid(n), (256, 1, 1), out.ptr, a.ptr, b.ptr, n)
        return True
    parts = max(1, min(ex.sm_count * 4, -(-n // 2048)))
    partial = ex.alloc(parts * _acc_size(dt), "mse", "(partial sums)")
    f = _fn(ex, dt, "sqdiff_partial", "PPPq", "mse")
    ex.launch("mse", f, (parts, 1, 1), (256, 1, 1), int(partial), a.ptr, b.ptr, n)
    fin = _fn(ex, dt, "partial_total", "PPiqi", "mse")
    ex.launch("mse", fin, (1, 1, 1), (1024, 1, 1), out.ptr, int(partial), parts, n, 1 if reduction == "mean" else 0)
    return True
