"""batchnorm, batchnormeval, groupnorm, their gradient ops and batchnormupdate on the device, with the arithmetic of
deepxd/kernels/cpu/norm.py (float32 for the 16-bit floats, float64 for float64; the statistics in that type).

A norm's statistics are reductions over "rows" made of segments: batch norm's row is a channel, its segments the
batch's samples (N segments of the spatial size, C * S apart); group norm's row is a sample's group, one contiguous
segment (or, for its backward's sums per group, one segment per channel). A row is cut into `split` chunks so that
few long rows still fill the GPU: each block reduces one chunk (Welford's mean and M2 for the statistics, plain sums
for the gradients) into scratch, and a small kernel merges a row's chunks. The elementwise kernels then read the
per-row results. batchnormupdate updates C values in float64, as the CPU does.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from deepx_core.cache import memoize
from deepx_core.ir.dtypes import FLOATS
from deepxd.kernels.cuda._src import HEADER, ctype

if TYPE_CHECKING:
    from deepxd.kernels.cuda import CudaExecutor, DeviceTensor

_SRC = r"""
typedef typename Acc<T>::type A;  // the compute type, and that of the statistics (ops.stats_dtype)

// ---- the elements of row r that block b reduces: segment k (of K, each L long) starts at r * rs + k * ks; the chunk
// [b * chunk, (b + 1) * chunk) of the row's K * L elements. Long segments: threads along a segment (coalesced);
// short ones: threads along the chunk (one division per element).
#define FOR_CHUNK(r, b, K, L, rs, ks, chunk, i, k, BODY)                                                        \
    {                                                                                                         \
        const ll j0_ = (ll)(b) * (chunk), j1_ = mn(j0_ + (chunk), (K) * (L));                                \
        if ((L) >= 128) {                                                                                     \
            for (ll k = j0_ / (L); k * (L) < j1_; ++k) {                                                      \
                const ll s0_ = mx(j0_ - k * (L), (ll)0), s1_ = mn(j1_ - k * (L), (L));                      \
                for (ll s_ = s0_ + threadIdx.x; s_ < s1_; s_ += blockDim.x) {                                 \
                    const ll i = (r) * (rs) + k * (ks) + s_;                                                  \
                    BODY                                                                                      \
                }                                                                                             \
            }                                                                                                 \
        } else {                                                                                              \
            for (ll j_ = j0_ + threadIdx.x; j_ < j1_; j_ += blockDim.x) {                                     \
                const ll k = j_ / (L);                                                                        \
                const ll i = (r) * (rs) + k * (ks) + (j_ - k * (L));                                          \
                BODY                                                                                          \
            }                                                                                                 \
        }                                                                                                     \
    }

// ---- Welford: count, mean and the sum of squared deviations, merged by Chan's formula
struct Wf { A n, m, q; };
__device__ __forceinline__ void wf_add(Wf& w, A x) {
    w.n += (A)1;
    const A d = x - w.m;
    w.m += d / w.n;
    w.q += d * (x - w.m);
}
__device__ __forceinline__ Wf wf_merge(Wf a, Wf b) {
    if (b.n == (A)0) return a;
    if (a.n == (A)0) return b;
    Wf r;
    r.n = a.n + b.n;
    const A d = b.m - a.m, f = b.n / r.n;
    r.m = a.m + d * f;
    r.q = a.q + b.q + d * d * a.n * f;
    return r;
}
__device__ __forceinline__ Wf wf_shfl(Wf w, int o) {
    Wf t;
    t.n = __shfl_xor_sync(0xffffffffu, w.n, o);
    t.m = __shfl_xor_sync(0xffffffffu, w.m, o);
    t.q = __shfl_xor_sync(0xffffffffu, w.q, o);
    return t;
}
// the block's merge, in thread 0
__device__ Wf wf_block(Wf w) {
    __shared__ A pn[32], pm[32], pq[32];
    for (int o = 16; o > 0; o >>= 1) w = wf_merge(w, wf_shfl(w, o));
    const int lane = threadIdx.x & 31, wp = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    __syncthreads();
    if (lane == 0) { pn[wp] = w.n; pm[wp] = w.m; pq[wp] = w.q; }
    __syncthreads();
    if (wp == 0) {
        Wf z = {(A)0, (A)0, (A)0};
        if (lane < nw) { z.n = pn[lane]; z.m = pm[lane]; z.q = pq[lane]; }
        for (int o = 16; o > 0; o >>= 1) z = wf_merge(z, wf_shfl(z, o));
        w = z;
    }
    return w;
}

extern "C" __global__ void stats_partial(A* part, const T* x, ll R, ll K, ll L, ll rs, ll ks, ll chunk) {
    for (ll r = blockIdx.x; r < R; r += gridDim.x) {
        Wf w = {(A)0, (A)0, (A)0};
        FOR_CHUNK(r, blockIdx.y, K, L, rs, ks, chunk, i, k, wf_add(w, ld(x[i]));)
        w = wf_block(w);
        if (threadIdx.x == 0) {
            A* q = part + (r * gridDim.y + blockIdx.y) * 3;
            q[0] = w.n; q[1] = w.m; q[2] = w.q;
        }
    }
}

// a row's chunks merged: its mean, biased variance and 1 / sqrt(var + eps); no values: nan, as the CPU's 0 / 0
extern "C" __global__ void stats_finish(A* mean, A* var, A* inv, const A* part, ll R, int split, double eps) {
    GRID_STRIDE(r, R) {
        Wf w = {(A)0, (A)0, (A)0};
        for (int b = 0; b < split; ++b) {
            const A* q = part + (r * split + b) * 3;
            Wf t = {q[0], q[1], q[2]};
            w = wf_merge(w, t);
        }
        const A none = w.n;  // 0 where the row is empty: none / none is nan
        const A m = w.n > (A)0 ? w.m : none / none;
        const A v = w.q / w.n;
        mean[r] = m;
        var[r] = v;
        inv[r] = (A)1 / sqrt(v + (A)eps);
    }
}

// y = (x - mean) * (inv * w) + b per channel (batch norm, G = 0), or (x - mean) * inv * w + b with the statistics
// of the sample's group (group norm, G groups)
template <class I> __device__ __forceinline__ void norm_apply_t(T* y, const T* x, const A* mean, const A* inv,
                                                               const T* w, const T* b, I total, I C, I S, I G) {
    const I cg = G ? C / G : 1;
    for (I i = (I)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (I)gridDim.x * blockDim.x) {
        const I ns = i / S, c = ns % C;
        const I r = G ? (ns / C) * G + c / cg : c;
        const A xc = ld(x[i]) - mean[r];
        const A v = G ? xc * inv[r] * ld(w[c]) + ld(b[c]) : xc * (inv[r] * ld(w[c])) + ld(b[c]);
        y[i] = st<T>(v);
    }
}
extern "C" __global__ void norm_apply(T* y, const T* x, const A* mean, const A* inv, const T* w, const T* b,
                                      ll total, ll C, ll S, ll G) {
    norm_apply_t<ll>(y, x, mean, inv, w, b, total, C, S, G);
}
extern "C" __global__ void norm_apply32(T* y, const T* x, const A* mean, const A* inv, const T* w, const T* b,
                                        ll total, ll C, ll S, ll G) {
    norm_apply_t<unsigned int>(y, x, mean, inv, w, b, (unsigned int)total, (unsigned int)C, (unsigned int)S,
                               (unsigned int)G);
}

// ---- gradients: per row, the sums of d and d * xh, xh = (x - mean) * inv. mode 0: rows are channels, statistics
// per channel (batch norm); 1: rows are channels, statistics per segment (sample) and group (group norm's dweight,
// dbias); 2: rows are (sample, group), a segment per channel, d = g * w (group norm's dA)
extern "C" __global__ void grad_partial(A* part, const T* x, const T* g, const T* w, const A* mean, const A* inv,
                                        ll R, ll K, ll L, ll rs, ll ks, ll chunk, ll G, ll cg, int mode) {
    for (ll r = blockIdx.x; r < R; r += gridDim.x) {
        A s1 = (A)0, s2 = (A)0;
        FOR_CHUNK(r, blockIdx.y, K, L, rs, ks, chunk, i, k, {
            const ll si = mode == 1 ? k * G + r / cg : r;
            const A xh = (ld(x[i]) - mean[si]) * inv[si];
            A d = ld(g[i]);
            if (mode == 2) d *= ld(w[(r % G) * cg + k]);
            s1 += d;
            s2 += d * xh;
        })
        s1 = block_sum(s1);
        s2 = block_sum(s2);
        if (threadIdx.x == 0) {
            A* q = part + (r * gridDim.y + blockIdx.y) * 2;
            q[0] = s1; q[1] = s2;
        }
    }
}

// a row's chunks added: the sums (and, where given, dbias = the sum of g and dweight = that of g * xh)
extern "C" __global__ void grad_finish(A* s1, A* s2, T* db, T* dw, const A* part, ll R, int split) {
    GRID_STRIDE(r, R) {
        A a = (A)0, b = (A)0;
        for (int k = 0; k < split; ++k) {
            a += part[(r * split + k) * 2];
            b += part[(r * split + k) * 2 + 1];
        }
        s1[r] = a;
        s2[r] = b;
        if (db) db[r] = st<T>(a);
        if (dw) dw[r] = st<T>(b);
    }
}

// batch norm (G = 0): dx = (g - xh * dw / n - db / n) * (w * inv), or g * (w * inv) for given statistics (batch 0);
// group norm: dx = (g w - s1 / n - xh * s2 / n) * inv with the sums of its group
template <class I> __device__ __forceinline__ void grad_apply_t(T* dx, const T* x, const T* g, const T* w,
                                                               const A* mean, const A* inv, const A* s1, const A* s2,
                                                               I total, I C, I S, I G, A n, int batch) {
    const I cg = G ? C / G : 1;
    for (I i = (I)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (I)gridDim.x * blockDim.x) {
        const I ns = i / S, c = ns % C;
        const I r = G ? (ns / C) * G + c / cg : c;
        const A xh = (ld(x[i]) - mean[r]) * inv[r];
        A v;
        if (G) v = (ld(g[i]) * ld(w[c]) - s1[r] / n - xh * (s2[r] / n)) * inv[r];
        else if (batch) v = (ld(g[i]) - xh * (s2[r] / n) - s1[r] / n) * (ld(w[c]) * inv[r]);
        else v = ld(g[i]) * (ld(w[c]) * inv[r]);
        dx[i] = st<T>(v);
    }
}
extern "C" __global__ void grad_apply(T* dx, const T* x, const T* g, const T* w, const A* mean, const A* inv,
                                      const A* s1, const A* s2, ll total, ll C, ll S, ll G, double n, int batch) {
    grad_apply_t<ll>(dx, x, g, w, mean, inv, s1, s2, total, C, S, G, (A)n, batch);
}
extern "C" __global__ void grad_apply32(T* dx, const T* x, const T* g, const T* w, const A* mean, const A* inv,
                                        const A* s1, const A* s2, ll total, ll C, ll S, ll G, double n, int batch) {
    grad_apply_t<unsigned int>(dx, x, g, w, mean, inv, s1, s2, (unsigned int)total, (unsigned int)C,
                               (unsigned int)S, (unsigned int)G, (A)n, batch);
}

// the inverse standard deviation of given statistics (the backward's), as stats_finish makes it
template <class M> __device__ __forceinline__ void inv_of_t(A* inv, const M* var, ll R, double eps) {
    GRID_STRIDE(r, R) inv[r] = (A)1 / sqrt((A)var[r] + (A)eps);
}
extern "C" __global__ void inv_of(A* inv, const A* var, ll R, double eps) { inv_of_t<A>(inv, var, R, eps); }

// ---- the running statistics, in float64 without fused multiply-adds (the CPU's numpy arithmetic): momentum * x +
// (1 - momentum) * running, x the mean or the unbiased variance var * count / (count - 1)
template <class M> __device__ __forceinline__ void bn_update_t(T* om, T* ov, const T* rm, const T* rv, const M* mean,
                                                               const M* var, ll C, double momentum, double count) {
    const double keep = 1.0 - momentum;
    GRID_STRIDE(c, C) {
        const double unbiased = __ddiv_rn(__dmul_rn((double)var[c], count), count - 1.0);
        om[c] = st<T>(__dadd_rn(__dmul_rn(momentum, (double)mean[c]), __dmul_rn(keep, (double)ld(rm[c]))));
        ov[c] = st<T>(__dadd_rn(__dmul_rn(momentum, unbiased), __dmul_rn(keep, (double)ld(rv[c]))));
    }
}
extern "C" __global__ void bn_update_float32(T* om, T* ov, const T* rm, const T* rv, const float* mean,
                                             const float* var, ll C, double momentum, double count) {
    bn_update_t<float>(om, ov, rm, rv, mean, var, C, momentum, count);
}
extern "C" __global__ void bn_update_float64(T* om, T* ov, const T* rm, const T* rv, const double* mean,
                                             const double* var, ll C, double momentum, double count) {
    bn_update_t<double>(om, ov, rm, rv, mean, var, C, momentum, count);
}
"""


@memoize("kernels.cuda.norm.source", 16)
def source(dtype: str) -> str:
    return HEADER + f"typedef {ctype(dtype)} T;\n" + _SRC


def sources() -> list[tuple[str, str]]:
    return [(source(d), f"norm ({d})") for d in sorted(FLOATS)]


SUPPORT = {op: frozenset(FLOATS) for op in ("batchnorm", "batchnormeval", "batchnormgrad", "batchnormupdate",
                                            "groupnorm", "groupnormgrad")}

_BLOCK = 256


def _fn(ex: CudaExecutor, dtype: str, name: str, fmt: str, op: str) -> Any:
    return ex.function(f"norm:{dtype}", source(dtype), name, fmt, op)


def _acc(dtype: str) -> int:
    return 8 if dtype == "float64" else 4


class _Rows:
    """R rows of K segments of L elements, segment k of row r at r * rs + k * ks: how a reduction is cut into
    chunks (split per row, chunk elements each) so that the blocks fill the GPU."""

    def __init__(self, ex: CudaExecutor, rows: int, k: int, length: int, rs: int, ks: int) -> None:
        self.rows, self.k, self.length, self.rs, self.ks = rows, k, length, rs, ks
        total = k * length
        want = -(-4 * ex.sm_count // max(rows, 1))
        self.split = max(1, min(want, -(-total // 4096), 65535))
        self.chunk = max(1, -(-total // self.split))
        self.grid = (min(rows, 1 << 20), self.split, 1)

    def args(self) -> tuple[int, ...]:
        return self.rows, self.k, self.length, self.rs, self.ks, self.chunk


def _elementwise(ex: CudaExecutor, dtype: str, name: str, fmt: str, op: str, total: int, *args: Any) -> None:
    small = total < (1 << 31)  # 32-bit indices (their grid stride cannot wrap)
    f = _fn(ex, dtype, name + ("32" if small else ""), fmt, op)
    ex.launch(op, f, ex.grid(total), (_BLOCK, 1, 1), *args)


def _stats(ex: CudaExecutor, op: str, a: DeviceTensor, rows: _Rows, mean: Any, var: Any, eps: float) -> Any:
    """The statistics of each row into mean and var (device addresses); returns the scratch holding 1 / sqrt(var +
    eps)."""
    dt = a.dname
    size = _acc(dt)
    part = ex.alloc(rows.rows * rows.split * 3 * size, op, "(partial statistics)")
    inv = ex.alloc(rows.rows * size, op, "(inverse standard deviations)")
    if rows.rows:
        f = _fn(ex, dt, "stats_partial", "PPqqqqqq", op)
        ex.launch(op, f, rows.grid, (_BLOCK, 1, 1), int(part), a.ptr, *rows.args())
        fin = _fn(ex, dt, "stats_finish", "PPPPqid", op)
        ex.launch(op, fin, ex.grid(rows.rows), (_BLOCK, 1, 1), int(mean), int(var), int(inv), int(part), rows.rows,
                  rows.split, float(eps))
    return inv


def _forward(ex: CudaExecutor, op: str, a: DeviceTensor, w: DeviceTensor, b: DeviceTensor, groups: int, eps: float,
             out: DeviceTensor, mean: DeviceTensor, var: DeviceTensor) -> bool:
    n, c = a.shape[:2]
    s = math.prod(a.shape[2:])
    if groups:
        rows = _Rows(ex, n * groups, 1, c // groups * s, c // groups * s, 0)
    else:
        rows = _Rows(ex, c, n, s, s, c * s)
    inv = _stats(ex, op, a, rows, mean.ptr, var.ptr, eps)
    if a.size:
        _elementwise(ex, a.dname, "norm_apply", "PPPPPPqqqq", op, a.size, out.ptr, a.ptr, mean.ptr, int(inv), w.ptr,
                     b.ptr, a.size, c, s, groups)
    return True


def batchnorm(ex: CudaExecutor, a: DeviceTensor, weight: DeviceTensor, bias: DeviceTensor, eps: Any,
              out: DeviceTensor, mean: DeviceTensor, var: DeviceTensor) -> bool:
    return _forward(ex, "batchnorm", a, weight, bias, 0, float(eps), out, mean, var)


def groupnorm(ex: CudaExecutor, a: DeviceTensor, weight: DeviceTensor, bias: DeviceTensor, groups: int, eps: Any,
              out: DeviceTensor, mean: DeviceTensor, var: DeviceTensor) -> bool:
    return _forward(ex, "groupnorm", a, weight, bias, int(groups), float(eps), out, mean, var)


def _inv_of(ex: CudaExecutor, op: str, var: DeviceTensor, eps: float, dtype: str) -> Any:
    """1 / sqrt(var + eps) of given statistics, into scratch."""
    inv = ex.alloc(var.size * _acc(dtype), op, "(inverse standard deviations)")
    if var.size:
        f = _fn(ex, dtype, "inv_of", "PPqd", op)
        ex.launch(op, f, ex.grid(var.size), (_BLOCK, 1, 1), int(inv), var.ptr, var.size, float(eps))
    return inv


def batchnormeval(ex: CudaExecutor, a: DeviceTensor, weight: DeviceTensor, bias: DeviceTensor, mean: DeviceTensor,
                  var: DeviceTensor, eps: Any, out: DeviceTensor) -> bool:
    c = a.shape[1]
    inv = _inv_of(ex, "batchnormeval", var, float(eps), a.dname)
    if a.size:
        _elementwise(ex, a.dname, "norm_apply", "PPPPPPqqqq", "batchnormeval", a.size, out.ptr, a.ptr, mean.ptr,
                     int(inv), weight.ptr, bias.ptr, a.size, c, math.prod(a.shape[2:]), 0)
    return True


def _sums(ex: CudaExecutor, op: str, a: DeviceTensor, g: DeviceTensor, w: DeviceTensor, mean: DeviceTensor,
          inv: Any, rows: _Rows, groups: int, mode: int, db: int, dw: int) -> tuple[Any, Any]:
    """Per row, the sums of d and d * xh (grad_partial's mode), into scratch; dbias and dweight where given."""
    dt = a.dname
    size = _acc(dt)
    part = ex.alloc(rows.rows * rows.split * 2 * size, op, "(partial sums)")
    s1 = ex.alloc(rows.rows * size, op, "(sums)")
    s2 = ex.alloc(rows.rows * size, op, "(sums)")
    c = a.shape[1]
    if rows.rows:
        f = _fn(ex, dt, "grad_partial", "PPPPPPqqqqqqqqi", op)
        ex.launch(op, f, rows.grid, (_BLOCK, 1, 1), int(part), a.ptr, g.ptr, w.ptr, mean.ptr, int(inv),
                  *rows.args(), groups, c // groups if groups else 1, mode)
        fin = _fn(ex, dt, "grad_finish", "PPPPPqi", op)
        ex.launch(op, fin, ex.grid(rows.rows), (_BLOCK, 1, 1), int(s1), int(s2), db, dw, int(part), rows.rows,
                  rows.split)
    return s1, s2


def _backward(ex: CudaExecutor, op: str, a: DeviceTensor, g: DeviceTensor, w: DeviceTensor, mean: DeviceTensor,
              var: DeviceTensor, groups: int, eps: float, da: DeviceTensor, dweight: DeviceTensor,
              dbias: DeviceTensor, batch: bool = True) -> bool:
    n, c = a.shape[:2]
    s = math.prod(a.shape[2:])
    dt = a.dname
    inv = _inv_of(ex, op, var, eps, dt)
    channels = _Rows(ex, c, n, s, s, c * s)
    s1, s2 = _sums(ex, op, a, g, w, mean, inv, channels, groups, 1 if groups else 0, dbias.ptr, dweight.ptr)
    count = n * s
    if groups:
        cg = c // groups
        s1, s2 = _sums(ex, op, a, g, w, mean, inv, _Rows(ex, n * groups, cg, s, cg * s, s), groups, 2, 0, 0)
        count = cg * s
    if a.size:
        _elementwise(ex, dt, "grad_apply", "PPPPPPPPqqqqdi", op, a.size, da.ptr, a.ptr, g.ptr, w.ptr, mean.ptr,
                     int(inv), int(s1), int(s2), a.size, c, s, groups, float(count), int(batch))
    return True


def batchnormgrad(ex: CudaExecutor, a: DeviceTensor, g: DeviceTensor, weight: DeviceTensor, mean: DeviceTensor,
                  var: DeviceTensor, eps: Any, batch: Any, da: DeviceTensor, dweight: DeviceTensor,
                  dbias: DeviceTensor) -> bool:
    return _backward(ex, "batchnormgrad", a, g, weight, mean, var, 0, float(eps), da, dweight, dbias, bool(batch))


def groupnormgrad(ex: CudaExecutor, a: DeviceTensor, g: DeviceTensor, weight: DeviceTensor, mean: DeviceTensor,
                  var: DeviceTensor, groups: int, eps: Any, da: DeviceTensor, dweight: DeviceTensor,
                  dbias: DeviceTensor) -> bool:
    return _backward(ex, "groupnormgrad", a, g, weight, mean, var, int(groups), float(eps), da, dweight, dbias)


def batchnormupdate(ex: CudaExecutor, running_mean: DeviceTensor, running_var: DeviceTensor, mean: DeviceTensor,
                    var: DeviceTensor, momentum: Any, count: int, out_mean: DeviceTensor,
                    out_var: DeviceTensor) -> bool:
    c = running_mean.size
    if c:
        f = _fn(ex, running_mean.dname, f"bn_update_{mean.dname}", "PPPPPPqdd", "batchnormupdate")
        ex.launch("batchnormupdate", f, ex.grid(c), (_BLOCK, 1, 1), out_mean.ptr, out_var.ptr, running_mean.ptr,
                  running_var.ptr, mean.ptr, var.ptr, c, float(momentum), float(count))
    return True
