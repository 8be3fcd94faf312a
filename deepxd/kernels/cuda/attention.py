"""Scaled dot-product attention on the device, FlashAttention-2 style: the (Tq, Tk) scores never reach memory.

Forward (`attention_fwd`): a block of 4 warps takes BR query rows of one head (each warp RW of them) and walks the
keys BC at a time (each lane KPL of them): the key and value tiles are staged in shared memory, each warp computes
its rows' scores (lanes over keys, the query row read as a broadcast), keeps the online softmax's running max and
sum per row, and adds p v into its rows of the result (lanes over the head dim). Causal blocks stop at their last
row's key, and a warp skips the tiles wholly above its rows. It writes the result and each row's logsumexp.

Backward, by recomputation from the logsumexp: `attention_rowdot` gives D = rowsum(dO O) per row; `attention_dkdv`
takes BK keys of one key/value head and walks the query rows of every query head that reads it (grouped-query
heads summed in the block, no atomics), accumulating dV += P^T dO and dK += dS^T q; `attention_dq` takes BR query
rows and walks the keys as the forward does, accumulating dQ += dS k. dS = P (dO v^T - D), P = exp(s - lse). Two
passes over the scores instead of atomics: the results are deterministic and match the CPU kernel's closely.

maskedattention runs the same kernels with a mask added to each score (`mask_at`: a bool mask's 0 or -inf, an
additive one's value), read in place through strides (0 where broadcast); a mask whose batch dims do not flatten to
one stride runs the CPU kernel. Rows that see no key give zeros and lse -inf, and no gradient.

Tiles are in the compute type (float for 16-bit storage, double for float64) in dynamic shared memory (up to about
170 KB for head size 256: the H100 allows 227 KB a block); one module per (dtype, padded head size): head sizes
(and value sizes) up to 32, 64, 128 or 256, zero-padded; larger ones, or a device with less shared memory, run the
CPU kernel. The sums run on CUDA cores in the compute type (no tensor cores: float32 is IEEE float32, as the CPU's).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from deepx_core.cache import memoize
from deepx_core.ir.dtypes import FLOATS
from deepx_core.ir.ops import attention_heads
from deepxd.kernels.cuda._src import HEADER, ctype

if TYPE_CHECKING:
    from deepxd.kernels.cuda import CudaExecutor, DeviceTensor

#: padded head sizes with a module of their own (a head of 80 runs the 128 kernels on zero-padded tiles)
HEAD_SIZES = (32, 64, 128, 256)
WARPS = 4
#: most blocks along grid y per launch (the driver's limit); longer sequences launch again with an offset
_GRID_Y = 65535

_SRC = r"""
typedef typename Acc<T>::type A;
constexpr int NT = NW * 32;      // threads per block
constexpr int DJ = DP / 32;      // head-dim elements per lane
constexpr int SP = DP + 1;       // row stride of the tiles whose rows the lanes read (no bank conflicts)
constexpr int BR = NW * RW;      // query rows per block (forward, dq)
constexpr int BC = 32 * KPL;     // keys per tile (forward, dq)
constexpr int BK = NW * RK;      // keys per block (dkdv)
constexpr int BQ = 32 * QPL;     // query rows per tile (dkdv)

// rows [r0, r0 + n) of a row-major (rows x width) matrix into a tile of row stride `stride`, times `mul`; zeros
// past the rows and the width (so that the padded head dim adds nothing)
__device__ __forceinline__ void load_tile(A* tile, int stride, const T* src, ll rows, ll r0, int n, int width,
                                          A mul) {
    for (int e = threadIdx.x; e < n * DP; e += NT) {
        const int r = e / DP, c = e - r * DP;
        const ll gr = r0 + r;
        tile[r * stride + c] = (gr < rows && c < width) ? ld(src[gr * width + c]) * mul : (A)0;
    }
}

// the key/value head that query head `bh` (of batch x hq) reads: group query heads share one
__device__ __forceinline__ ll kv_head(ll bh, int hq, int group) {
    return (bh / hq) * (hq / group) + (bh % hq) / group;
}

// maskedattention's term for score (bh, i, j): a bool mask's 0 or -inf (mkind 1), an additive mask's value (2);
// (mb, mh, mr, mc): the mask's strides over batch (bh / hq), head (bh % hq), row and key, 0 where broadcast
__device__ __forceinline__ A mask_at(const void* mask, int mkind, ll bh, int hq, ll i, ll j, ll mb, ll mh, ll mr,
                                     ll mc) {
    const ll at = (bh / hq) * mb + (bh % hq) * mh + i * mr + j * mc;
    if (mkind == 1) return ((const unsigned char*)mask)[at] ? (A)0 : (A)-INFINITY;
    return ld(((const T*)mask)[at]);
}

// out (bh, tq, dv) = softmax(q k^T * scale + mask) v, lse (bh, tq) = each row's logsumexp. grid (bh, row blocks)
extern "C" __global__ void __launch_bounds__(NT) attention_fwd(
        T* out, A* lse, const T* q, const T* k, const T* v, ll tq, ll tk, int d, int dv, int hq, int group,
        double scale, int causal, const void* mask, int mkind, ll mb, ll mh, ll mr, ll mc, ll rbase) {
    extern __shared__ __align__(16) unsigned char smem[];
    A* Qs = (A*)smem;                // BR x DP, scaled
    A* Ks = Qs + BR * DP;            // BC x SP
    A* Vs = Ks + BC * SP;            // BC x SP
    A* Ps = Vs + BC * SP;            // BR x BC: each warp's rows of probabilities
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    const ll bh = blockIdx.x, kvh = kv_head(bh, hq, group);
    const ll r0 = (rbase + blockIdx.y) * (ll)BR, wr0 = r0 + w * RW;
    const T* kp = k + kvh * tk * d;
    const T* vp = v + kvh * tk * dv;
    load_tile(Qs, DP, q + bh * tq * d, tq, r0, BR, d, (A)scale);
    A m[RW], l[RW], o[RW][DJ];
    #pragma unroll
    for (int r = 0; r < RW; ++r) {
        m[r] = -INFINITY;
        l[r] = 0;
        #pragma unroll
        for (int j = 0; j < DJ; ++j) o[r][j] = 0;
    }
    const ll kend = causal ? (r0 + BR < tk ? r0 + BR : tk) : tk;
    for (ll j0 = 0; j0 < kend; j0 += BC) {
        __syncthreads();  // the last tile's readers are done (and Qs is written, the first time)
        load_tile(Ks, SP, kp, tk, j0, BC, d, (A)1);
        load_tile(Vs, SP, vp, tk, j0, BC, dv, (A)1);
        __syncthreads();
        if (causal && j0 > wr0 + RW - 1) continue;  // every key of the tile is after every row of this warp
        A s[RW][KPL];
        #pragma unroll
        for (int r = 0; r < RW; ++r)
            #pragma unroll
            for (int c = 0; c < KPL; ++c) s[r][c] = 0;
        #pragma unroll 4
        for (int e = 0; e < DP; ++e) {
            A kv[KPL];
            #pragma unroll
            for (int c = 0; c < KPL; ++c) kv[c] = Ks[(c * 32 + lane) * SP + e];
            #pragma unroll
            for (int r = 0; r < RW; ++r) {
                const A qv = Qs[(w * RW + r) * DP + e];
                #pragma unroll
                for (int c = 0; c < KPL; ++c) s[r][c] += qv * kv[c];
            }
        }
        #pragma unroll
        for (int r = 0; r < RW; ++r) {
            const ll i = wr0 + r;
            A mt = -INFINITY;
            #pragma unroll
            for (int c = 0; c < KPL; ++c) {
                const ll j = j0 + c * 32 + lane;
                if (j >= tk || (causal && j > i)) s[r][c] = -INFINITY;
                else if (mkind && i < tq) s[r][c] += mask_at(mask, mkind, bh, hq, i, j, mb, mh, mr, mc);
                mt = mx(mt, s[r][c]);
            }
            mt = warp_max(mt);
            const A mn = mx(m[r], mt);
            const A ref = mn == -INFINITY ? (A)0 : mn;  // a row with no key yet: nothing to rescale
            const A alpha = exp(m[r] - ref);
            m[r] = mn;
            l[r] *= alpha;
            #pragma unroll
            for (int j = 0; j < DJ; ++j) o[r][j] *= alpha;
            #pragma unroll
            for (int c = 0; c < KPL; ++c) {
                const A p = exp(s[r][c] - ref);
                l[r] += p;  // each lane's part of the row's sum, added up at the end
                Ps[(w * RW + r) * BC + c * 32 + lane] = p;
            }
        }
        __syncwarp();
        for (int c = 0; c < BC; ++c) {
            A vv[DJ];
            #pragma unroll
            for (int j = 0; j < DJ; ++j) vv[j] = Vs[c * SP + j * 32 + lane];
            #pragma unroll
            for (int r = 0; r < RW; ++r) {
                const A p = Ps[(w * RW + r) * BC + c];
                #pragma unroll
                for (int j = 0; j < DJ; ++j) o[r][j] += p * vv[j];
            }
        }
    }
    #pragma unroll
    for (int r = 0; r < RW; ++r) {
        const A total = warp_sum(l[r]);
        const ll i = wr0 + r;
        if (i >= tq) continue;
        const A inv = total > (A)0 ? (A)1 / total : (A)0;  // no key at all: zeros, and lse -inf
        #pragma unroll
        for (int j = 0; j < DJ; ++j) {
            const int c = j * 32 + lane;
            if (c < dv) out[(bh * tq + i) * dv + c] = st<T>(o[r][j] * inv);
        }
        if (lane == 0) lse[bh * tq + i] = total > (A)0 ? m[r] + log(total) : (A)-INFINITY;
    }
}

// dd[row] = sum over the value dim of o * g: one warp per row
extern "C" __global__ void attention_rowdot(A* dd, const T* o, const T* g, ll rows, int dv) {
    const int lane = threadIdx.x & 31;
    const ll warps = (ll)gridDim.x * (blockDim.x >> 5);
    for (ll row = (ll)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); row < rows; row += warps) {
        A s = 0;
        for (int c = lane; c < dv; c += 32) s += ld(o[row * dv + c]) * ld(g[row * dv + c]);
        s = warp_sum(s);
        if (lane == 0) dd[row] = s;
    }
}

// dq (bh, tq, d) = sum over keys of dS k * scale, dS = P (g v^T - dd), P = exp(q k^T * scale - lse). grid as the
// forward's
extern "C" __global__ void __launch_bounds__(NT) attention_dq(
        T* dq, const T* q, const T* k, const T* v, const T* g, const A* lse, const A* dd, ll tq, ll tk, int d, int dv,
        int hq, int group, double scale, int causal, const void* mask, int mkind, ll mb, ll mh, ll mr, ll mc,
        ll rbase) {
    extern __shared__ __align__(16) unsigned char smem[];
    A* Qs = (A*)smem;                // BR x DP, scaled
    A* Gs = Qs + BR * DP;            // BR x DP
    A* Ks = Gs + BR * DP;            // BC x SP
    A* Vs = Ks + BC * SP;            // BC x SP
    A* Ss = Vs + BC * SP;            // BR x BC: each warp's rows of dS
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    const ll bh = blockIdx.x, kvh = kv_head(bh, hq, group);
    const ll r0 = (rbase + blockIdx.y) * (ll)BR, wr0 = r0 + w * RW;
    const T* kp = k + kvh * tk * d;
    const T* vp = v + kvh * tk * dv;
    load_tile(Qs, DP, q + bh * tq * d, tq, r0, BR, d, (A)scale);
    load_tile(Gs, DP, g + bh * tq * dv, tq, r0, BR, dv, (A)1);
    A L[RW], Dr[RW], acc[RW][DJ];
    #pragma unroll
    for (int r = 0; r < RW; ++r) {
        const ll i = wr0 + r;
        L[r] = i < tq ? lse[bh * tq + i] : (A)0;
        Dr[r] = i < tq ? dd[bh * tq + i] : (A)0;
        #pragma unroll
        for (int j = 0; j < DJ; ++j) acc[r][j] = 0;
    }
    const ll kend = causal ? (r0 + BR < tk ? r0 + BR : tk) : tk;
    for (ll j0 = 0; j0 < kend; j0 += BC) {
        __syncthreads();
        load_tile(Ks, SP, kp, tk, j0, BC, d, (A)1);
        load_tile(Vs, SP, vp, tk, j0, BC, dv, (A)1);
        __syncthreads();
        if (causal && j0 > wr0 + RW - 1) continue;
        A s[RW][KPL], t[RW][KPL];
        #pragma unroll
        for (int r = 0; r < RW; ++r)
            #pragma unroll
            for (int c = 0; c < KPL; ++c) { s[r][c] = 0; t[r][c] = 0; }
        #pragma unroll 2
        for (int e = 0; e < DP; ++e) {
            A kv[KPL], vv[KPL];
            #pragma unroll
            for (int c = 0; c < KPL; ++c) {
                kv[c] = Ks[(c * 32 + lane) * SP + e];
                vv[c] = Vs[(c * 32 + lane) * SP + e];
            }
            #pragma unroll
            for (int r = 0; r < RW; ++r) {
                const A qv = Qs[(w * RW + r) * DP + e], gv = Gs[(w * RW + r) * DP + e];
                #pragma unroll
                for (int c = 0; c < KPL; ++c) {
                    s[r][c] += qv * kv[c];
                    t[r][c] += gv * vv[c];
                }
            }
        }
        #pragma unroll
        for (int r = 0; r < RW; ++r) {
            const ll i = wr0 + r;
            #pragma unroll
            for (int c = 0; c < KPL; ++c) {
                const ll j = j0 + c * 32 + lane;
                const bool seen = i < tq && j < tk && !(causal && j > i);
                const A sm = seen && mkind ? s[r][c] + mask_at(mask, mkind, bh, hq, i, j, mb, mh, mr, mc) : s[r][c];
                const A p = seen && sm != -INFINITY ? exp(sm - L[r]) : (A)0;  // (a row that sees no key: lse -inf)
                Ss[(w * RW + r) * BC + c * 32 + lane] = p * (t[r][c] - Dr[r]);
            }
        }
        __syncwarp();
        for (int c = 0; c < BC; ++c) {
            A kv[DJ];
            #pragma unroll
            for (int j = 0; j < DJ; ++j) kv[j] = Ks[c * SP + j * 32 + lane];
            #pragma unroll
            for (int r = 0; r < RW; ++r) {
                const A ds = Ss[(w * RW + r) * BC + c];
                #pragma unroll
                for (int j = 0; j < DJ; ++j) acc[r][j] += ds * kv[j];
            }
        }
    }
    #pragma unroll
    for (int r = 0; r < RW; ++r) {
        const ll i = wr0 + r;
        if (i >= tq) continue;
        #pragma unroll
        for (int j = 0; j < DJ; ++j) {
            const int c = j * 32 + lane;
            if (c < d) dq[(bh * tq + i) * d + c] = st<T>(acc[r][j] * (A)scale);
        }
    }
}

// dk, dv (kvh, tk, ·): BK keys of one key/value head per block, summed over the query rows of each of its `group`
// query heads: dv += P^T g, dk += dS^T q * scale. grid (batch x key heads, key blocks)
extern "C" __global__ void __launch_bounds__(NT) attention_dkdv(
        T* dk, T* dvo, const T* q, const T* k, const T* v, const T* g, const A* lse, const A* dd, ll tq, ll tk, int d,
        int dv, int hq, int group, double scale, int causal, const void* mask, int mkind, ll mb, ll mh, ll mr, ll mc,
        ll kbase) {
    extern __shared__ __align__(16) unsigned char smem[];
    A* Ks = (A*)smem;                // BK x DP
    A* Vs = Ks + BK * DP;            // BK x DP
    A* Qs = Vs + BK * DP;            // BQ x SP, scaled
    A* Gs = Qs + BQ * SP;            // BQ x SP
    A* Ls = Gs + BQ * SP;            // BQ
    A* Ds = Ls + BQ;                 // BQ
    A* Ps = Ds + BQ;                 // BK x BQ: each warp's keys of P
    A* Ss = Ps + BK * BQ;            // BK x BQ: and of dS
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    const ll kvh = blockIdx.x;
    const int hk = hq / group;
    const ll j0 = (kbase + blockIdx.y) * (ll)BK, wj0 = j0 + w * RK;
    load_tile(Ks, DP, k + kvh * tk * d, tk, j0, BK, d, (A)1);
    load_tile(Vs, DP, v + kvh * tk * dv, tk, j0, BK, dv, (A)1);
    A ak[RK][DJ], av[RK][DJ];
    #pragma unroll
    for (int r = 0; r < RK; ++r)
        #pragma unroll
        for (int j = 0; j < DJ; ++j) { ak[r][j] = 0; av[r][j] = 0; }
    const ll first = causal ? (j0 / BQ) * BQ : 0;  // query rows before j0 see none of these keys
    for (int h = 0; h < group; ++h) {
        const ll bh = (kvh / hk) * hq + (kvh % hk) * group + h;
        for (ll i0 = first; i0 < tq; i0 += BQ) {
            __syncthreads();  // the last tile's readers are done (and Ks, Vs are written, the first time)
            load_tile(Qs, SP, q + bh * tq * d, tq, i0, BQ, d, (A)scale);
            load_tile(Gs, SP, g + bh * tq * dv, tq, i0, BQ, dv, (A)1);
            for (int e = threadIdx.x; e < BQ; e += NT) {
                const ll i = i0 + e;
                Ls[e] = i < tq ? lse[bh * tq + i] : (A)0;
                Ds[e] = i < tq ? dd[bh * tq + i] : (A)0;
            }
            __syncthreads();
            if (causal && i0 + BQ - 1 < wj0) continue;  // every row of the tile is before every key of this warp
            A s[RK][QPL], t[RK][QPL];
            #pragma unroll
            for (int r = 0; r < RK; ++r)
                #pragma unroll
                for (int c = 0; c < QPL; ++c) { s[r][c] = 0; t[r][c] = 0; }
            #pragma unroll 2
            for (int e = 0; e < DP; ++e) {
                A qv[QPL], gv[QPL];
                #pragma unroll
                for (int c = 0; c < QPL; ++c) {
                    qv[c] = Qs[(c * 32 + lane) * SP + e];
                    gv[c] = Gs[(c * 32 + lane) * SP + e];
                }
                #pragma unroll
                for (int r = 0; r < RK; ++r) {
                    const A kv = Ks[(w * RK + r) * DP + e], vv = Vs[(w * RK + r) * DP + e];
                    #pragma unroll
                    for (int c = 0; c < QPL; ++c) {
                        s[r][c] += kv * qv[c];
                        t[r][c] += vv * gv[c];
                    }
                }
            }
            #pragma unroll
            for (int r = 0; r < RK; ++r) {
                const ll j = wj0 + r;
                #pragma unroll
                for (int c = 0; c < QPL; ++c) {
                    const int e = c * 32 + lane;
                    const ll i = i0 + e;
                    const bool seen = i < tq && j < tk && !(causal && j > i);
                    const A sm = seen && mkind ? s[r][c] + mask_at(mask, mkind, bh, hq, i, j, mb, mh, mr, mc)
                                               : s[r][c];
                    const A p = seen && sm != -INFINITY ? exp(sm - Ls[e]) : (A)0;
                    Ps[(w * RK + r) * BQ + e] = p;
                    Ss[(w * RK + r) * BQ + e] = p * (t[r][c] - Ds[e]);
                }
            }
            __syncwarp();
            for (int e = 0; e < BQ; ++e) {
                A gq[DJ], qq[DJ];
                #pragma unroll
                for (int j = 0; j < DJ; ++j) {
                    gq[j] = Gs[e * SP + j * 32 + lane];
                    qq[j] = Qs[e * SP + j * 32 + lane];
                }
                #pragma unroll
                for (int r = 0; r < RK; ++r) {
                    const A p = Ps[(w * RK + r) * BQ + e], ds = Ss[(w * RK + r) * BQ + e];
                    #pragma unroll
                    for (int j = 0; j < DJ; ++j) {
                        av[r][j] += p * gq[j];
                        ak[r][j] += ds * qq[j];
                    }
                }
            }
        }
    }
    #pragma unroll
    for (int r = 0; r < RK; ++r) {
        const ll j = wj0 + r;
        if (j >= tk) continue;
        #pragma unroll
        for (int x = 0; x < DJ; ++x) {
            const int c = x * 32 + lane;
            if (c < d) dk[(kvh * tk + j) * d + c] = st<T>(ak[r][x]);
            if (c < dv) dvo[(kvh * tk + j) * dv + c] = st<T>(av[r][x]);
        }
    }
}
"""


def tiles(dtype: str, dp: int) -> dict[str, int]:
    """The tile shape of the kernels for `dtype` at padded head size `dp`: rows per warp (RW) and keys per lane (KPL)
    of the forward and dq kernels, keys per warp (RK) and query rows per lane (QPL) of dkdv; fewer rows for double
    and for the widest heads, whose per-row registers (the result's or gradients' DJ values) are twice as many."""
    double = dtype == "float64"
    rows = (4 if double else 8) // (2 if dp > 128 else 1)
    return {"NW": WARPS, "DP": dp, "RW": rows, "KPL": 1 if double else 2, "RK": rows, "QPL": 1 if double else 2}


def shared_bytes(dtype: str, dp: int) -> dict[str, int]:
    """Dynamic shared memory of each kernel, in bytes."""
    p = tiles(dtype, dp)
    size = 8 if dtype == "float64" else 4
    br, bc, bk, bq, sp = p["NW"] * p["RW"], 32 * p["KPL"], p["NW"] * p["RK"], 32 * p["QPL"], dp + 1
    return {"attention_fwd": size * (br * dp + 2 * bc * sp + br * bc),
            "attention_dq": size * (2 * br * dp + 2 * bc * sp + br * bc),
            "attention_dkdv": size * (2 * bk * dp + 2 * bq * sp + 2 * bq + 2 * bk * bq)}


@memoize("kernels.cuda.attention.source", 32)
def source(dtype: str, dp: int) -> str:
    params = "".join(f"constexpr int {k} = {v};\n" for k, v in tiles(dtype, dp).items())
    return HEADER + f"typedef {ctype(dtype)} T;\n" + params + _SRC


def sources() -> list[tuple[str, str]]:
    return [(source(d, dp), f"attention {dp} ({d})") for d in sorted(FLOATS) for dp in HEAD_SIZES]


SUPPORT = {"attention": frozenset(FLOATS), "attentiongrad": frozenset(FLOATS), "maskedattention": frozenset(FLOATS),
           "maskedattentiongrad": frozenset(FLOATS)}


def _head_size(d: int, dv: int) -> int | None:
    return next((dp for dp in HEAD_SIZES if max(d, dv) <= dp), None)


#: shared memory a block may have, by architecture (sm_90: 227 KB)
_SMEM_LIMIT: dict[str, int] = {}


def _function(ex: CudaExecutor, dtype: str, dp: int, name: str, fmt: str, op: str) -> tuple[Any, int] | None:
    """The kernel, with its dynamic shared memory allowed (once per function); None where the device has less
    shared memory a block than it needs."""
    nbytes = shared_bytes(dtype, dp)[name]
    limit = _SMEM_LIMIT.get(ex.arch)
    if limit is None:
        limit = _SMEM_LIMIT[ex.arch] = ex.device.get_attribute(
            ex.cuda.device_attribute.MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
    if nbytes > limit:
        return None
    f = ex.function(f"attention:{dtype}:{dp}", source(dtype, dp), name, fmt, op)
    if getattr(f, "_deepx_smem", 0) < nbytes:
        f.set_attribute(ex.cuda.function_attribute.MAX_DYNAMIC_SHARED_SIZE_BYTES, nbytes)
        f._deepx_smem = nbytes
    return f, nbytes


def _geometry(q: DeviceTensor, k: DeviceTensor, v: DeviceTensor) -> tuple[int, int, int, int, int, int, int]:
    """(query heads in all, Tq, Tk, head size, value size, query heads per batch item, query heads per key head)."""
    group = attention_heads("attention", q.shape, k.shape, v.shape)
    bh = math.prod(q.shape[:-2])
    hq = q.shape[-3] if q.ndim >= 3 else 1
    return bh, q.shape[-2], k.shape[-2], q.shape[-1], v.shape[-1], hq, group


def _launch_rows(ex: CudaExecutor, op: str, f: Any, nbytes: int, x: int, blocks: int, *args: Any) -> None:
    """Launch over grid (x, blocks), `blocks` cut into launches of at most _GRID_Y (the last argument: the offset)."""
    for base in range(0, blocks, _GRID_Y):
        ex.launch(op, f, (x, min(_GRID_Y, blocks - base), 1), (32 * WARPS, 1, 1), *args, base, shared=nbytes)


_NO_MASK = (0, 0, 0, 0, 0, 0)


def _mask_args(mask: DeviceTensor, q_shape: tuple[int, ...], tk: int) -> tuple[int, ...] | None:
    """The kernels' (pointer, kind, batch, head, row and key strides) of a contiguous mask broadcast to the scores
    (..., Hq, Tq, Tk); None where its batch dims do not flatten to one stride (the CPU kernel runs it)."""
    scores = (*q_shape[:-1], tk)
    shape = (1,) * (len(scores) - len(mask.shape)) + tuple(mask.shape)
    strides, step = [0] * len(shape), 1
    for i in range(len(shape) - 1, -1, -1):
        strides[i] = 0 if shape[i] == 1 else step
        step *= shape[i]
    kind = 1 if mask.dname == "bool" else 2
    if len(scores) == 2:
        return (mask.ptr, kind, 0, 0, *strides)
    sb: int | None = None
    span = 1
    for size, st in zip(reversed(scores[:-3]), reversed(strides[:-3])):
        if size > 1:
            if sb is None:
                sb = st // span
            elif st != sb * span:
                return None
        span *= size
    return (mask.ptr, kind, sb or 0, *strides[-3:])


def attention(ex: CudaExecutor, q: DeviceTensor, k: DeviceTensor, v: DeviceTensor, scale: float, causal: bool,
              out: DeviceTensor, lse: DeviceTensor) -> bool:
    return _forward(ex, q, k, v, scale, causal, _NO_MASK, out, lse)


def maskedattention(ex: CudaExecutor, q: DeviceTensor, k: DeviceTensor, v: DeviceTensor, mask: DeviceTensor,
                    scale: float, out: DeviceTensor, lse: DeviceTensor) -> bool:
    margs = _mask_args(mask, q.shape, k.shape[-2])
    return margs is not None and _forward(ex, q, k, v, scale, False, margs, out, lse, "maskedattention")


def _forward(ex: CudaExecutor, q: DeviceTensor, k: DeviceTensor, v: DeviceTensor, scale: float, causal: bool,
             margs: tuple[int, ...], out: DeviceTensor, lse: DeviceTensor, op: str = "attention") -> bool:
    bh, tq, tk, d, dv, hq, group = _geometry(q, k, v)
    dp = _head_size(d, dv)
    if dp is None:
        return False
    got = _function(ex, q.dname, dp, "attention_fwd", "PPPPPqqiiiidiPiqqqqq", op)
    if got is None:
        return False
    if not bh or not tq:
        return True
    f, nbytes = got
    br = WARPS * tiles(q.dname, dp)["RW"]
    _launch_rows(ex, op, f, nbytes, bh, -(-tq // br), out.ptr, lse.ptr, q.ptr, k.ptr, v.ptr, tq, tk, d,
                 dv, hq, group, float(scale), int(bool(causal)), *margs)
    return True


def attentiongrad(ex: CudaExecutor, q: DeviceTensor, k: DeviceTensor, v: DeviceTensor, c: DeviceTensor,
                  lse: DeviceTensor, g: DeviceTensor, scale: float, causal: bool, dq: DeviceTensor, dk: DeviceTensor,
                  dv_out: DeviceTensor) -> bool:
    return _backward(ex, q, k, v, _NO_MASK, c, lse, g, scale, causal, dq, dk, dv_out)


def maskedattentiongrad(ex: CudaExecutor, q: DeviceTensor, k: DeviceTensor, v: DeviceTensor, mask: DeviceTensor,
                        c: DeviceTensor, lse: DeviceTensor, g: DeviceTensor, scale: float, dq: DeviceTensor,
                        dk: DeviceTensor, dv_out: DeviceTensor) -> bool:
    margs = _mask_args(mask, q.shape, k.shape[-2])
    return margs is not None and _backward(ex, q, k, v, margs, c, lse, g, scale, False, dq, dk, dv_out,
                                           "maskedattentiongrad")


def _backward(ex: CudaExecutor, q: DeviceTensor, k: DeviceTensor, v: DeviceTensor, margs: tuple[int, ...],
              c: DeviceTensor, lse: DeviceTensor, g: DeviceTensor, scale: float, causal: bool, dq: DeviceTensor,
              dk: DeviceTensor, dv_out: DeviceTensor, op: str = "attentiongrad") -> bool:
    bh, tq, tk, d, dv, hq, group = _geometry(q, k, v)
    dp = _head_size(d, dv)
    if dp is None:
        return False
    dt = q.dname
    got_q = _function(ex, dt, dp, "attention_dq", "PPPPPPPqqiiiidiPiqqqqq", op)
    got_kv = _function(ex, dt, dp, "attention_dkdv", "PPPPPPPPqqiiiidiPiqqqqq", op)
    if got_q is None or got_kv is None:
        return False
    if not bh:
        return True
    p = tiles(dt, dp)
    rows = bh * tq
    dd = ex.alloc(max(rows, 1) * (8 if dt == "float64" else 4), op, "(row dots)")
    if rows:
        f = ex.function(f"attention:{dt}:{dp}", source(dt, dp), "attention_rowdot", "PPPqi", op)
        ex.launch(op, f, (max(1, min(ex.max_blocks, -(-rows // 8))), 1, 1), (256, 1, 1), int(dd), c.ptr,
                  g.ptr, rows, dv)
    causal_flag = int(bool(causal))
    if tq:
        f, nbytes = got_q
        _launch_rows(ex, op, f, nbytes, bh, -(-tq // (WARPS * p["RW"])), dq.ptr, q.ptr, k.ptr, v.ptr,
                     g.ptr, lse.ptr, int(dd), tq, tk, d, dv, hq, group, float(scale), causal_flag, *margs)
    if tk:
        f, nbytes = got_kv
        _launch_rows(ex, op, f, nbytes, bh // group, -(-tk // (WARPS * p["RK"])), dk.ptr, dv_out.ptr,
                     q.ptr, k.ptr, v.ptr, g.ptr, lse.ptr, int(dd), tq, tk, d, dv, hq, group, float(scale),
                     causal_flag, *margs)
    return True
