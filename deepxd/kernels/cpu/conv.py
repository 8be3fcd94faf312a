"""Convolution on the CPU: direct C loops where they win (one group), else im2col in chunks of output rows, each
chunk one GEMM (batched over groups) on BLAS.

The direct loops (DIRECT in SOURCE) lay each image's padded input out as planes, one per channel and stride phase,
so that kernel tap (c, i, j) reads one plane from a fixed offset and output position q = y * wq + x (wq: a plane's
row) reads element off[c, i, j] + q: a correlation along q with no im2col, a block of output channels x positions
in registers over every tap; columns x >= ow are computed and dropped. conv2d takes them where enough of the
computed positions are kept (DIRECT_KEPT) or the product is small; conv2dgradinput at stride 1 as the convolution of
the gradient padded by the kernel's reach with the kernel flipped; conv2dgradweight (DIRECT_GW) from
GW_MIN_POSITIONS positions an image, on a finite input. docs/decisions/0040-fast-cpu-convolution.md has the figures.

A chunk is a run of output rows, either whole images or rows of one image, whose im2col matrix `col` (C * kh * kw
rows in (c, i, j) order, one column per output position of the chunk) fits about CHUNK_BYTES, so that BLAS reads
it from cache just after it was written; memory stays bounded whatever the batch. Row (c, i, j) of `col` holds the
input at (y * stride + i * dilation - padding, x * stride + j * dilation - padding) of channel c, zero outside.

- conv2d: C[:, chunk] = weight (O, C * kh * kw) @ col, per group;
- conv2dgradweight: dweight^T (C * kh * kw, O) += col @ G[:, chunk]^T, accumulated over the chunks;
- conv2dgradinput: dcol = weight^T @ G[:, chunk], scattered back into dA (col2im, the adjoint of im2col).

im2col and col2im are C loops (native.py's compiler and cache; `DEEPX_NATIVE_KERNELS=0` or no compiler: numpy
strided copies and adds, per chunk, with the same results). A chunk spans at least MIN_COLS columns: below that
BLAS loses its speed (O=32, C*kh*kw=800: 124 GFLOP/s at 256 columns, 250 at 1024). The 16-bit floats compute in
float32 and round once, as the other kernels do.

Pooling reads windows of an input already padded (the SDK pads max_pool2d's input with -inf, avg_pool2d's with 0):
C loops (`POOL` in SOURCE) over the planes (n, c), split across threads by plane from POOL_SPLIT_MIN elements, the
forward ops a row of outputs at a time, tap by tap; maxpool2dgrad adds each window's gradient at its first maximum
(its last NaN where it holds any), as torch does. Without native kernels, numpy over a strided view, `_taps(xp,
...)`: shape (N, C, kh, kw, Hout, Wout), element [n, c, i, j, y, x] the input at (y * stride + i * dilation,
x * stride + j * dilation).
"""

from __future__ import annotations

import ctypes
import functools
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
from numpy.lib.stride_tricks import as_strided

from deepxd.kernels.cpu import native
from deepxd.kernels.cpu._util import F32, F64
from deepxd.kernels.cpu._util import address as _address
from deepxd.kernels.cpu._util import work as _work
from deepxd.kernels.cpu.matmul import matmul as _matmul

#: the im2col matrix of a chunk is kept near this size (bytes): in cache when BLAS reads it
CHUNK_BYTES = 1 << 21
#: ...but spans at least this many output positions (columns), where BLAS runs near its speed
MIN_COLS = 1024
#: pooling splits its planes across threads from this many input elements: below, waking the threads costs more
#: than they save (examples/train_cnn.py's 32 x 16 x 8 x 8 max pooling: 0.07 ms split, 0.04 on one thread)
POOL_SPLIT_MIN = 1 << 17
#: the direct loops' blocks of output channels (DIRECT in SOURCE): 8 where there are as many, else 4; fewer than 4
#: output channels go to im2col (a block of 4 would be mostly empty)
DIRECT_BLOCKS = (8, 4)
#: the direct loops compute every column of a plane's rows, ow of wq kept: they run where at least this share of
#: the positions they compute is kept, or where the product is small (O * C * kh * kw up to DIRECT_SMALL), and BLAS
#: on im2col elsewhere (8 x 8 images of 256 channels: 0.85x im2col's speed, 64 of 96 positions kept)
DIRECT_KEPT = 0.7
DIRECT_SMALL = 1 << 16
#: the direct weight's gradient runs from this many positions an image (rows of wq columns): below, its sums over
#: few positions cost more than BLAS's product on im2col (16 x 16 images, stride 2: 0.7x)
GW_MIN_POSITIONS = 512
_DIRECT_POSITIONS = 32  # a block's positions in float32 (NV * L in DIRECT), 16 in float64
_GW_CHANNELS, _GW_TAPS = 4, 4  # GW_OB and GW_TB in SOURCE
_GW_CACHE = 1 << 22  # the weight's gradient sums over as many images at a time as have planes of this size:
# fewer sums of its blocks (32 x 16 x 32 x 32, one thread: 4.4 ms at 128 KiB, 3.5-3.8 from 2 MiB)
#: scratch arrays (the direct loops' planes, im2col's chunk) up to this many bytes are kept per thread for the next
#: call: fresh pages cost a fault each (a 32 x 16 x 32 x 32 step: 650 more a step, about 1 ms on this machine)
SCRATCH_MAX = 1 << 26
_scratch = threading.local()

SOURCE = r"""
#include <stdlib.h>
#include <string.h>
#define GW_OB 4
#define GW_TB 4
/* a vector kept in a register (the compiler otherwise reloads it for each product) */
#if defined(__AVX512F__) && (defined(__GNUC__) || defined(__clang__))
#define KEEP(v) __asm__("" : "+v"(v))
#else
#define KEEP(v) (void)0
#endif
/* Built with OpenMP where MKL's runtime is in use (native.load), the loops split across its threads when `split`.
   The columns of a chunk are the output rows r0 .. r1 - 1 of the batch (r = n * oh + y), ow positions each. A row
   of col is one (channel c, kernel tap i, j) of channels c0 .. c0 + cn - 1; the columns of output x where the tap
   falls inside the input are lo .. hi - 1, the rest are padding. */
#define CONV(T, S) \
static void span_##S(long w, long off, long sw, long ow, long *lo, long *hi) { \
    long a = off >= 0 ? 0 : (-off + sw - 1) / sw; \
    long b = w - off <= 0 ? 0 : (w - off + sw - 1) / sw; \
    if (b > ow) b = ow; \
    if (a > b) a = b; \
    *lo = a; *hi = b; \
} \
void im2col_##S(const T *restrict x, T *restrict col, long c, long h, long w, long c0, long cn, long kh, long kw, \
                long sh, long sw, long ph, long pw, long dh, long dw, long oh, long ow, long r0, long r1, \
                int split) { \
    long cols = (r1 - r0) * ow; \
    _Pragma("omp parallel for schedule(static) if(split)") \
    for (long row = 0; row < cn * kh * kw; row++) { \
        long ch = row / (kh * kw), i = row / kw % kh, j = row % kw; \
        T *restrict d = col + row * cols; \
        long off = j * dw - pw, lo, hi; \
        span_##S(w, off, sw, ow, &lo, &hi); \
        for (long r = r0; r < r1; r++, d += ow) { \
            long n = r / oh, iy = (r - n * oh) * sh - ph + i * dh; \
            if (iy < 0 || iy >= h) { memset(d, 0, ow * sizeof(T)); continue; } \
            const T *restrict s = x + ((n * c + c0 + ch) * h + iy) * w + off; \
            for (long q = 0; q < lo; q++) d[q] = 0; \
            if (sw == 1) memcpy(d + lo, s + lo, (hi - lo) * sizeof(T)); \
            else for (long q = lo; q < hi; q++) d[q] = s[q * sw]; \
            for (long q = hi; q < ow; q++) d[q] = 0; \
        } \
    } \
} \
void col2im_##S(const T *restrict col, T *restrict dx, long c, long h, long w, long c0, long cn, long kh, long kw, \
                long sh, long sw, long ph, long pw, long dh, long dw, long oh, long ow, long r0, long r1, \
                int split) { \
    long cols = (r1 - r0) * ow; \
    _Pragma("omp parallel for schedule(static) if(split)") /* a channel's taps on one thread: no two add at once */ \
    for (long ch = 0; ch < cn; ch++) for (long i = 0; i < kh; i++) for (long j = 0; j < kw; j++) { \
        const T *restrict s = col + ((ch * kh + i) * kw + j) * cols; \
        long off = j * dw - pw, lo, hi; \
        span_##S(w, off, sw, ow, &lo, &hi); \
        for (long r = r0; r < r1; r++, s += ow) { \
            long n = r / oh, iy = (r - n * oh) * sh - ph + i * dh; \
            if (iy < 0 || iy >= h) continue; \
            T *restrict d = dx + ((n * c + c0 + ch) * h + iy) * w + off; \
            if (sw == 1) { for (long q = lo; q < hi; q++) d[q] += s[q]; } \
            else for (long q = lo; q < hi; q++) d[q * sw] += s[q]; \
        } \
    } \
}
/* Pooling over an input padded already, planes (n, c) of h x w into planes of oh x ow, split across threads by
   plane (a plane's gradient is its thread's alone). Output row oy reads input rows oy * sh + i * dh; a window's taps
   in row-major order (i, j), the first of equal maxima kept and each NaN taking over (the last NaN): torch's. */
#define POOL_BLOCK 256
#define POOL(T, S) \
void maxpool_##S(const T *restrict x, T *restrict y, long planes, long h, long w, long kh, long kw, long sh, \
                 long sw, long dh, long dw, long oh, long ow, int split) { \
    _Pragma("omp parallel for schedule(static) if(split)") \
    for (long p = 0; p < planes; p++) { \
        const T *restrict xp = x + p * h * w; \
        for (long oy = 0; oy < oh; oy++) { \
            T *restrict d = y + (p * oh + oy) * ow; \
            for (long i = 0; i < kh; i++) for (long j = 0; j < kw; j++) { \
                const T *restrict s = xp + (oy * sh + i * dh) * w + j * dw; \
                if (i == 0 && j == 0) { for (long q = 0; q < ow; q++) d[q] = s[q * sw]; continue; } \
                for (long q = 0; q < ow; q++) { T v = s[q * sw], m = d[q]; d[q] = (v > m || v != v) ? v : m; } \
            } \
        } \
    } \
} \
void maxpoolgrad_##S(const T *restrict x, const T *restrict g, T *restrict dx, long planes, long h, long w, \
                     long kh, long kw, long sh, long sw, long dh, long dw, long oh, long ow, int split) { \
    _Pragma("omp parallel for schedule(static) if(split)") \
    for (long p = 0; p < planes; p++) { \
        const T *restrict xp = x + p * h * w; \
        T *restrict dp = dx + p * h * w; \
        memset(dp, 0, h * w * sizeof(T)); \
        for (long oy = 0; oy < oh; oy++) for (long q0 = 0; q0 < ow; q0 += POOL_BLOCK) { \
            long nq = ow - q0 < POOL_BLOCK ? ow - q0 : POOL_BLOCK; \
            T m[POOL_BLOCK]; long at[POOL_BLOCK]; /* a block of windows' maxima so far, and where */ \
            for (long i = 0; i < kh; i++) for (long j = 0; j < kw; j++) { \
                long base = (oy * sh + i * dh) * w + j * dw + q0 * sw; \
                const T *restrict s = xp + base; \
                if (i == 0 && j == 0) { \
                    for (long q = 0; q < nq; q++) { m[q] = s[q * sw]; at[q] = base + q * sw; } \
                    continue; \
                } \
                for (long q = 0; q < nq; q++) { /* selects, not branches: random data mispredicts them */ \
                    T v = s[q * sw], b = m[q]; \
                    int take = v > b || v != v; \
                    m[q] = take ? v : b; \
                    at[q] = take ? base + q * sw : at[q]; \
                } \
            } \
            const T *restrict gr = g + (p * oh + oy) * ow + q0; \
            for (long q = 0; q < nq; q++) dp[at[q]] += gr[q]; \
        } \
    } \
} \
void sumpool_##S(const T *restrict x, T *restrict y, long planes, long h, long w, long kh, long kw, long sh, \
                 long sw, long dh, long dw, long oh, long ow, int split) { \
    _Pragma("omp parallel for schedule(static) if(split)") \
    for (long p = 0; p < planes; p++) { \
        const T *restrict xp = x + p * h * w; \
        for (long oy = 0; oy < oh; oy++) { \
            T *restrict d = y + (p * oh + oy) * ow; \
            for (long q = 0; q < ow; q++) d[q] = 0; \
            for (long i = 0; i < kh; i++) for (long j = 0; j < kw; j++) { \
                const T *restrict s = xp + (oy * sh + i * dh) * w + j * dw; \
                for (long q = 0; q < ow; q++) d[q] += s[q * sw]; \
            } \
        } \
    } \
} \
void sumpoolgrad_##S(const T *restrict g, T *restrict dx, long planes, long h, long w, long kh, long kw, \
                     long sh, long sw, long dh, long dw, long oh, long ow, int split) { \
    _Pragma("omp parallel for schedule(static) if(split)") \
    for (long p = 0; p < planes; p++) { \
        T *restrict dp = dx + p * h * w; \
        memset(dp, 0, h * w * sizeof(T)); \
        for (long oy = 0; oy < oh; oy++) { \
            const T *restrict s = g + (p * oh + oy) * ow; \
            for (long i = 0; i < kh; i++) for (long j = 0; j < kw; j++) { \
                T *restrict d = dp + (oy * sh + i * dh) * w + j * dw; \
                for (long q = 0; q < ow; q++) d[q * sw] += s[q]; \
            } \
        } \
    } \
}
/* Direct convolution (one group): each image's input as planes (c, pi, pj) of hq x wq, plane (pi, pj) of channel c
   holding the padded input's rows pi, pi + sh, ... and columns pj, pj + sw, ... (one plane per channel at stride
   1). Kernel tap t = (c, i, j) then reads one plane from the offset off[t], and output position q = y * wq + x reads
   xs[off[t] + q]: a stride-1 correlation along q, without im2col. Columns x >= ow are computed and dropped. */
#define DIRECT_INPUT(T, S) \
void direct_input_##S(const T *restrict x, T *restrict xs, long planes, long h, long w, long sh, long sw, \
                      long ph, long pw, long hq, long wq, int split) { \
    _Pragma("omp parallel for schedule(static) if(split)") \
    for (long p = 0; p < planes; p++) for (long pi = 0; pi < sh; pi++) for (long pj = 0; pj < sw; pj++) { \
        T *restrict d = xs + ((p * sh + pi) * sw + pj) * hq * wq; \
        long lo, hi; \
        span_##S(w, pj - pw, sw, wq, &lo, &hi); \
        for (long yy = 0; yy < hq; yy++, d += wq) { \
            long iy = yy * sh + pi - ph; \
            if (iy < 0 || iy >= h) { memset(d, 0, wq * sizeof(T)); continue; } \
            const T *restrict s = x + (p * h + iy) * w + pj - pw; \
            for (long q = 0; q < lo; q++) d[q] = 0; \
            if (sw == 1) memcpy(d + lo, s + lo, (hi - lo) * sizeof(T)); \
            else for (long q = lo; q < hi; q++) d[q] = s[q * sw]; \
            for (long q = hi; q < wq; q++) d[q] = 0; \
        } \
    } \
}
/* A block of OB output channels x NV vectors of L positions stays in registers over all k taps; weights packed as
   (output channel blocks, k, OB). Fused multiply-adds here (the products' sums are BLAS's anyway). */
#define DIRECT(T, S, L, OB, NV) \
typedef T vec_##S##_##OB __attribute__((vector_size(L * sizeof(T)))); \
__attribute__((optimize("fp-contract=fast"))) \
void direct_##S##_##OB(const T *restrict xs, const long *restrict off, const T *restrict wp, T *restrict y, \
                       long n, long img, long k, long wq, long o, long oh, long ow, int split) { \
    typedef vec_##S##_##OB V; \
    long qall = oh * wq, blk = NV * L, nob = (o + OB - 1) / OB; \
    _Pragma("omp parallel for collapse(2) schedule(static) if(split)") \
    for (long b = 0; b < n; b++) for (long ob = 0; ob < nob; ob++) { \
        const T *restrict xb = xs + b * img; \
        const T *restrict wb = wp + ob * k * OB; \
        long on = o - ob * OB < OB ? o - ob * OB : OB; \
        T *restrict yb = y + (b * o + ob * OB) * oh * ow; \
        for (long q0 = 0; q0 < qall; q0 += blk) { \
            V acc[OB][NV]; \
            for (int u = 0; u < OB; u++) for (int v = 0; v < NV; v++) acc[u][v] = (V){0}; \
            for (long t = 0; t < k; t++) { \
                const T *restrict s = xb + off[t] + q0; \
                const T *restrict wt = wb + t * OB; \
                V a[NV]; \
                for (int v = 0; v < NV; v++) memcpy(&a[v], s + v * L, sizeof(V)); \
                for (int u = 0; u < OB; u++) { T c = wt[u]; for (int v = 0; v < NV; v++) acc[u][v] += a[v] * c; } \
            } \
            T tmp[OB][NV * L]; \
            memcpy(tmp, acc, sizeof(tmp)); \
            long qe = q0 + blk < qall ? q0 + blk : qall; \
            for (long q = q0; q < qe;) { /* the block's rows, their columns below ow */ \
                long yy = q / wq, xx = q - yy * wq, e = (yy + 1) * wq < qe ? (yy + 1) * wq : qe; \
                long m = xx < ow ? (e - q < ow - xx ? e - q : ow - xx) : 0; \
                for (int u = 0; u < on && m > 0; u++) \
                    memcpy(yb + u * oh * ow + yy * ow + xx, tmp[u] + (q - q0), m * sizeof(T)); \
                q = e; \
            } \
        } \
    } \
}
/* The weight's gradient from the same layout: dw[o, t] = sum over images b and positions q of g[b, o, q] *
   xs[b * img + off[t] + q], g laid out as (n, op, qp) rows of wq columns, zero past ow columns and oh rows. Images
   in `parts` fixed runs, each run's sums into its own (op, kp) slice of dw (added up by the caller: the same bits
   whatever the threads); OB output channels x TB taps of vectors kept in registers along q. */
#define DIRECT_GW(T, S, L, OB, TB) \
__attribute__((optimize("fp-contract=fast"))) \
void direct_gw_##S(const T *restrict xs, const long *restrict off, const T *restrict g, T *restrict dw, \
                   long n, long img, long kp, long qn, long qp, long o, long parts, long nb, int split) { \
    typedef vec_##S##_8 V; \
    long op = (o + OB - 1) / OB * OB; \
    T *zero = calloc(qn, sizeof(T)); /* the rows of the last block's channels past o */ \
    _Pragma("omp parallel for schedule(static) if(split)") \
    for (long p = 0; p < parts; p++) { \
        T *restrict part = dw + p * op * kp; \
        long end = n * (p + 1) / parts; \
        for (long b0 = n * p / parts; b0 < end; b0 += nb) /* nb images at a time: their planes stay in cache */ \
        for (long o0 = 0; o0 < op; o0 += OB) for (long t0 = 0; t0 < kp; t0 += TB) { \
            V acc[OB][TB]; \
            for (int u = 0; u < OB; u++) for (int t = 0; t < TB; t++) acc[u][t] = (V){0}; \
            for (long b = b0; b < b0 + nb && b < end; b++) { \
                const T *gr[OB], *xr[TB]; \
                for (int u = 0; u < OB; u++) gr[u] = o0 + u < o ? g + (b * o + o0 + u) * qp : zero; \
                for (int t = 0; t < TB; t++) xr[t] = xs + b * img + off[t0 + t]; \
                for (long q = 0; q < qn; q += L) { \
                    V gv[OB], xv[TB]; \
                    for (int t = 0; t < TB; t++) { memcpy(&xv[t], xr[t] + q, sizeof(V)); KEEP(xv[t]); } \
                    for (int u = 0; u < OB; u++) { \
                        memcpy(&gv[u], gr[u] + q, sizeof(V)); \
                        KEEP(gv[u]); \
                        for (int t = 0; t < TB; t++) acc[u][t] += gv[u] * xv[t]; \
                    } \
                } \
            } \
            for (int u = 0; u < OB; u++) for (int t = 0; t < TB; t++) { /* halves added: no serial chain */ \
                T tmp[L]; \
                memcpy(tmp, &acc[u][t], sizeof(V)); \
                for (int h = L / 2; h >= 1; h /= 2) for (int l = 0; l < h; l++) tmp[l] += tmp[l + h]; \
                part[(o0 + u) * kp + t0 + t] += tmp[0]; \
            } \
        } \
    } \
    free(zero); \
} \
int finite_##S(const T *restrict x, long n) { \
    int bad = 0; \
    for (long i = 0; i < n; i++) bad |= x[i] - x[i] != 0; \
    return !bad; \
}
CONV(float, f32) CONV(double, f64)
POOL(float, f32) POOL(double, f64)
DIRECT_INPUT(float, f32) DIRECT_INPUT(double, f64)
DIRECT(float, f32, 16, 8, 2) DIRECT(float, f32, 16, 4, 2)
DIRECT(double, f64, 8, 8, 2) DIRECT(double, f64, 8, 4, 2)
DIRECT_GW(float, f32, 16, GW_OB, GW_TB) DIRECT_GW(double, f64, 8, GW_OB, GW_TB)
"""

_fns: dict[str, Any] | None = None
_LONG = ctypes.c_long


def _native() -> dict[str, Any] | None:
    """im2col, col2im and the pooling loops for float32 and float64, compiled on first use (once per machine:
    native.py's cache), or None where native kernels are off or cannot be built."""
    global _fns
    if _fns is None:
        lib = native.load(SOURCE, openmp=True) or native.load(SOURCE)
        if lib is None:
            return None
        fns = {}
        for s in ("f32", "f64"):
            for name in ("im2col", "col2im"):
                f = getattr(lib, f"{name}_{s}")
                f.argtypes, f.restype = [ctypes.c_void_p, ctypes.c_void_p, *[_LONG] * 17, ctypes.c_int], None
                fns[f"{name}_{s}"] = f
            for name, arrays in (("maxpool", 2), ("maxpoolgrad", 3), ("sumpool", 2), ("sumpoolgrad", 2)):
                f = getattr(lib, f"{name}_{s}")
                f.argtypes, f.restype = [*[ctypes.c_void_p] * arrays, *[_LONG] * 11, ctypes.c_int], None
                fns[f"{name}_{s}"] = f
            f = lib[f"direct_input_{s}"]
            f.argtypes, f.restype = [ctypes.c_void_p] * 2 + [_LONG] * 9 + [ctypes.c_int], None
            fns[f"direct_input_{s}"] = f
            f = lib[f"direct_gw_{s}"]
            f.argtypes, f.restype = [ctypes.c_void_p] * 4 + [_LONG] * 8 + [ctypes.c_int], None
            fns[f"direct_gw_{s}"] = f
            f = lib[f"finite_{s}"]
            f.argtypes, f.restype = [ctypes.c_void_p, _LONG], ctypes.c_int
            fns[f"finite_{s}"] = f
            for ob in DIRECT_BLOCKS:
                f = lib[f"direct_{s}_{ob}"]
                f.argtypes, f.restype = [ctypes.c_void_p] * 4 + [_LONG] * 7 + [ctypes.c_int], None
                fns[f"direct_{s}_{ob}"] = f
        _fns = fns
    return _fns if native.enabled() else None


class _Geometry:
    """One convolution's sizes, and its chunks of output rows."""

    def __init__(self, x_shape: Sequence[int], w_shape: Sequence[int], stride: Sequence[int],
                 padding: Sequence[int], dilation: Sequence[int], groups: int, oh: int, ow: int) -> None:
        self.n, self.c, self.h, self.w = (int(d) for d in x_shape)
        self.o, self.cg, self.kh, self.kw = (int(d) for d in w_shape)
        self.sh, self.sw = int(stride[0]), int(stride[1])
        self.ph, self.pw = int(padding[0]), int(padding[1])
        self.dh, self.dw = int(dilation[0]), int(dilation[1])
        self.groups, self.oh, self.ow = int(groups), int(oh), int(ow)
        self.k = self.c * self.kh * self.kw  # rows of col, every group's

    def chunks(self, itemsize: int) -> Iterator[tuple[int, int]]:
        """(r0, r1): runs of output rows r = n * oh + y, whole images or rows of one image."""
        cols = max(MIN_COLS, CHUNK_BYTES // (self.k * itemsize))
        rows = max(1, cols // self.ow)
        total = self.n * self.oh
        if rows >= self.oh:  # whole images: one each where an image fills MIN_COLS (its result and gradient in place)
            step = (1 if self.oh * self.ow >= MIN_COLS else rows // self.oh) * self.oh
            for r0 in range(0, total, step):
                yield r0, min(r0 + step, total)
            return
        parts = -(-self.oh // rows)  # rows of one image, in parts of about equal size
        for img in range(self.n):
            for p in range(parts):
                yield img * self.oh + p * self.oh // parts, img * self.oh + (p + 1) * self.oh // parts

    def args(self, r0: int, r1: int) -> tuple[int, ...]:
        return (self.c, self.h, self.w, 0, self.c, self.kh, self.kw, self.sh, self.sw, self.ph, self.pw, self.dh,
                self.dw, self.oh, self.ow, r0, r1, native.split())


def _layout(fns: dict[str, Any], x: np.ndarray, kh: int, kw: int, stride: Sequence[int], padding: Sequence[int],
            dilation: Sequence[int], oh: int) -> tuple[np.ndarray, np.ndarray, int, int]:
    """x (N, C, H, W) laid out for the direct loops (DIRECT_INPUT in SOURCE): (xs, off, wq, img): the planes, the
    offset of each kernel tap (c, i, j), a plane's row length and an image's size."""
    n, c, h, w = (int(d) for d in x.shape)
    (sh, sw), (ph, pw), (dh, dw) = ((int(a), int(b)) for a, b in (stride, padding, dilation))
    hq, wq = -(-(h + 2 * ph) // sh), -(-(w + 2 * pw) // sw)
    img = c * sh * sw * hq * wq
    off = _offsets(c, kh, kw, sh, sw, dh, dw, hq, wq)
    blk = _DIRECT_POSITIONS * 4 // x.dtype.itemsize
    # the loops read whole blocks of positions: room past the last image for the last block's reads
    size = max(n * img, (n - 1) * img + int(off[-1]) + -(-oh * wq // blk) * blk)
    xs = _buffer("planes", size, x.dtype)
    xs[n * img:] = 0
    fns[f"direct_input_{_suffix(x.dtype)}"](_address(x), _address(xs), n * c, h, w, sh, sw, ph, pw, hq, wq,
                                            int(n * c * h * w >= POOL_SPLIT_MIN and native.split()))
    return xs, off, wq, img


def _buffer(name: str, size: int, dt: np.dtype) -> np.ndarray:
    """An uninitialised array of `size` elements, the thread's scratch `name` where it fits SCRATCH_MAX; aligned to
    64 bytes (BLAS writing a product into it at 16 bytes off a cache line: 8 x 256 x 8 x 8 conv2dgradinput 1.4x
    slower)."""
    nbytes = size * dt.itemsize
    bufs = _scratch.__dict__.setdefault("bufs", {})
    b = bufs.get(name)
    if b is None or b.size < nbytes + 64:
        b = np.empty(nbytes + 64, np.uint8)
        if nbytes <= SCRATCH_MAX:
            bufs[name] = b
    start = -_address(b) % 64
    return b[start:start + nbytes].view(dt)


@functools.lru_cache(maxsize=256)
def _offsets(c: int, kh: int, kw: int, sh: int, sw: int, dh: int, dw: int, hq: int, wq: int) -> np.ndarray:
    """Where each kernel tap (c, i, j) starts reading an image's planes (DIRECT_INPUT's layout)."""
    i, j = np.arange(kh)[:, None] * dh, np.arange(kw)[None, :] * dw
    tap = ((i % sh) * sw + j % sw) * hq * wq + (i // sh) * wq + j // sw  # (kh, kw): the offset within a channel
    off = (np.arange(c)[:, None, None] * (sh * sw * hq * wq) + tap).reshape(-1).astype(np.int64)
    off.flags.writeable = False
    return off


def _suffix(dt: np.dtype) -> str:
    return "f32" if dt == F32 else "f64"


def _direct_fits(o: int, k: int, oh: int, ow: int, wq: int) -> bool:
    """Whether the direct loops beat im2col and BLAS on o output channels, k taps, an oh x ow output whose planes'
    rows are wq long (DIRECT_KEPT, DIRECT_SMALL)."""
    blk = _DIRECT_POSITIONS
    kept = oh * ow / (-(-oh * wq // blk) * blk)
    return o >= DIRECT_BLOCKS[-1] and (kept >= DIRECT_KEPT or o * k <= DIRECT_SMALL)


def _direct(x: np.ndarray, w: np.ndarray, stride: Sequence[int], padding: Sequence[int],
            dilation: Sequence[int], out: np.ndarray) -> bool:
    """out = the convolution of x (N, C, H, W) with w (O, C, kh, kw), one group, by the direct loops (DIRECT in
    SOURCE); False where native kernels are off or the dtype is neither float32 nor float64. x, w: contiguous; out:
    C-contiguous, of x's dtype."""
    dt = x.dtype
    fns = _native() if dt in (F32, F64) else None
    n, c, _, wd = (int(d) for d in x.shape)
    o, _, kh, kw = (int(d) for d in w.shape)
    oh, ow = (int(d) for d in out.shape[2:])
    if fns is None or not _direct_fits(o, c * kh * kw, oh, ow, -(-(wd + 2 * int(padding[1])) // int(stride[1]))):
        return False
    xs, off, wq, img = _layout(fns, x, kh, kw, stride, padding, dilation, oh)
    ob = next(b for b in DIRECT_BLOCKS if o >= b)
    nob = -(-o // ob)
    k = c * kh * kw
    packed = np.zeros((nob * ob, k), dt)
    packed[:o] = w.reshape(o, k)
    packed = np.ascontiguousarray(packed.reshape(nob, ob, k).transpose(0, 2, 1))
    fns[f"direct_{_suffix(dt)}_{ob}"](_address(xs), _address(off), _address(packed), _address(out), n, img, k, wq, o,
                                      oh, ow, native.split())
    return True


def _direct_gw(x: np.ndarray, gy: np.ndarray, kh: int, kw: int, stride: Sequence[int], padding: Sequence[int],
               dilation: Sequence[int]) -> np.ndarray | None:
    """The weight's gradient (O, C * kh * kw) by the direct loops (DIRECT_GW in SOURCE), or None where they do not
    run: native kernels off, another dtype, or x not finite (positions past ow multiply zeros of gy by inputs that
    no output reads: an infinity there would make a NaN that torch does not)."""
    dt = x.dtype
    fns = _native() if dt in (F32, F64) else None
    s = _suffix(dt)
    n, c, _, wd = (int(d) for d in x.shape)
    o, oh, ow = (int(d) for d in gy.shape[1:])
    if (fns is None or oh * -(-(wd + 2 * int(padding[1])) // int(stride[1])) < GW_MIN_POSITIONS
            or not fns[f"finite_{s}"](_address(x), x.size)):
        return None
    xs, off, wq, img = _layout(fns, x, kh, kw, stride, padding, dilation, oh)
    lanes = 64 // dt.itemsize
    k = c * kh * kw
    kp, op = -(-k // _GW_TAPS) * _GW_TAPS, -(-o // _GW_CHANNELS) * _GW_CHANNELS
    qn = -(-oh * wq // lanes) * lanes  # the positions the loops read: whole vectors
    hg = -(-qn // wq)
    g = _buffer("rows", n * o * hg * wq, dt)  # gy's rows as wq columns, zero past ow columns and oh rows
    fns[f"direct_input_{s}"](_address(gy), _address(g), n * o, oh, ow, 1, 1, 0, 0, hg, wq, 0)
    offs = np.zeros(kp, np.int64)
    offs[:k] = off
    parts = min(n, native.MAX_THREADS)  # split or not: the same sums
    dw = np.zeros((parts, op, kp), dt)
    nb = max(1, _GW_CACHE // ((img + o * hg * wq) * dt.itemsize))
    fns[f"direct_gw_{s}"](_address(xs), _address(offs), _address(g), _address(dw), n, img, kp, qn, hg * wq, o, parts,
                          nb, native.split())
    return dw.sum(axis=0)[:o, :k] if parts > 1 else dw[0, :o, :k]


def _taps(xp: np.ndarray, kh: int, kw: int, stride: Sequence[int], dilation: Sequence[int], oh: int,
          ow: int) -> np.ndarray:
    n, c = xp.shape[:2]
    s0, s1, s2, s3 = xp.strides
    return as_strided(xp, (n, c, kh, kw, oh, ow),
                      (s0, s1, s2 * dilation[0], s3 * dilation[1], s2 * stride[0], s3 * stride[1]), writeable=False)


def _padded(a: np.ndarray, ph: int, pw: int) -> np.ndarray:
    if not ph and not pw:
        return a
    return np.pad(a, ((0, 0), (0, 0), (ph, ph), (pw, pw)))


def _rows(g: _Geometry, a: np.ndarray, r0: int, r1: int) -> np.ndarray:
    """The (n, y) block of a (N, X, oh, ow) array that output rows r0 .. r1 - 1 cover, as (X, positions): a view
    within one image, a copy across images."""
    n0, y0 = divmod(r0, g.oh)
    if r1 - r0 <= g.oh - y0:
        return a[n0].reshape(a.shape[1], -1)[:, y0 * g.ow:(y0 + r1 - r0) * g.ow]
    return a[n0:r1 // g.oh].transpose(1, 0, 2, 3).reshape(a.shape[1], -1)


class _Cols:
    """im2col and col2im of a chunk: native loops, or numpy over a strided view of the padded input."""

    def __init__(self, g: _Geometry, dt: np.dtype) -> None:
        self.g = g
        fns = _native()
        self.fns = fns if dt in (F32, F64) else None
        self.suffix = "f32" if dt == F32 else "f64"
        self.col = _buffer("col", max(r1 - r0 for r0, r1 in g.chunks(dt.itemsize)) * g.ow * g.k, dt)
        self.taps: np.ndarray | None = None

    def buffer(self, r0: int, r1: int) -> np.ndarray:
        return self.col[:(r1 - r0) * self.g.ow * self.g.k].reshape(self.g.k, -1)

    def view(self, x: np.ndarray, r0: int, r1: int) -> np.ndarray:
        """The (N, C, kh, kw, oh, ow) windows of the padded input, restricted to the chunk, as numpy's fallback."""
        g = self.g
        if self.taps is None:
            self.taps = _taps(_padded(x, g.ph, g.pw), g.kh, g.kw, (g.sh, g.sw), (g.dh, g.dw), g.oh, g.ow)
        taps = self.taps
        n0, y0 = divmod(r0, g.oh)
        if r1 - r0 <= g.oh - y0:
            return taps[n0:n0 + 1, :, :, :, y0:y0 + r1 - r0]
        return taps[n0:r1 // g.oh]

    def im2col(self, x: np.ndarray, r0: int, r1: int) -> np.ndarray:
        g, col = self.g, self.buffer(r0, r1)
        if self.fns is not None:
            self.fns[f"im2col_{self.suffix}"](_address(x), _address(col), *g.args(r0, r1))
        else:
            win = self.view(x, r0, r1)
            col.reshape(g.c, g.kh, g.kw, win.shape[0], win.shape[4], g.ow)[...] = win.transpose(1, 2, 3, 0, 4, 5)
        return col

    def col2im(self, col: np.ndarray, grad: np.ndarray, r0: int, r1: int) -> None:
        """grad += the adjoint of im2col of col; grad is (N, C, H, W), or padded by (ph, pw) on numpy's path."""
        g = self.g
        if self.fns is not None:
            self.fns[f"col2im_{self.suffix}"](_address(col), _address(grad), *g.args(r0, r1))
            return
        n0, y0 = divmod(r0, g.oh)
        nb = max(1, (r1 - r0) // g.oh) if r1 - r0 > g.oh - y0 else 1
        rows = (r1 - r0) // nb
        part = col.reshape(g.c, g.kh, g.kw, nb, rows, g.ow).transpose(3, 0, 1, 2, 4, 5)
        target = grad[n0:n0 + nb]
        for i in range(g.kh):
            for j in range(g.kw):
                top = (y0 * g.sh if nb == 1 else 0) + i * g.dh
                left = j * g.dw
                target[:, :, top:top + g.sh * (rows - 1) + 1:g.sh, left:left + g.sw * (g.ow - 1) + 1:g.sw] += \
                    part[:, :, i, j]


def _grouped(g: _Geometry, w: np.ndarray) -> np.ndarray:
    """weight as (groups, O / groups, C / groups * kh * kw)."""
    return w.reshape(g.groups, g.o // g.groups, g.cg * g.kh * g.kw)


def _product(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
    """out = a @ b through the matmul kernel (MKL where in use: numpy's BLAS would wake its own threads), one
    product, or one per group, when out is 3-D."""
    if out.ndim == 3 and out.shape[0] == 1:
        a, b, out = a[0], b[0], out[0]
    _matmul(a, b, out)


def conv2d(a, weight, stride, padding, dilation, groups, out):
    x, w = np.ascontiguousarray(_work(a)), np.ascontiguousarray(_work(weight))
    dt = x.dtype
    g = _Geometry(x.shape, w.shape, stride, padding, dilation, groups, *out.shape[2:])
    y = out if out.dtype == dt and out.flags.c_contiguous else np.empty(out.shape, dt)
    if g.groups == 1 and _direct(x, w, stride, padding, dilation, y):
        if y is not out:
            out[...] = y
        return
    cols = _Cols(g, dt)
    wg = _grouped(g, w)
    prod = np.empty((g.groups, g.o // g.groups, cols.col.size // g.k), dt)
    for r0, r1 in g.chunks(dt.itemsize):
        col = cols.im2col(x, r0, r1)
        part = prod[:, :, :col.shape[1]]  # (groups, O / groups, positions)
        n0, y0 = divmod(r0, g.oh)
        if r1 - r0 == g.oh and g.groups == 1:  # one whole image: straight into the result
            _matmul(wg[0], col, y[n0].reshape(g.o, -1))
            continue
        _product(wg, col.reshape(g.groups, -1, col.shape[1]), part)
        if r1 - r0 <= g.oh - y0:  # rows of one image
            y[n0].reshape(g.o, -1)[:, y0 * g.ow:(y0 + r1 - r0) * g.ow] = part.reshape(g.o, -1)
        else:  # whole images: each image's part of the product (O, images * positions) into place
            y[n0:r1 // g.oh] = part.reshape(g.o, -1, g.oh, g.ow).transpose(1, 0, 2, 3)
    if y is not out:
        out[...] = y


def conv2dgradweight(a, g, weight_shape, stride, padding, dilation, groups, out):
    x, gy = np.ascontiguousarray(_work(a)), np.ascontiguousarray(_work(g))
    dt = x.dtype
    geo = _Geometry(x.shape, [int(d) for d in weight_shape], stride, padding, dilation, groups, *gy.shape[2:])
    if geo.groups == 1 and gy.dtype == dt:
        dw = _direct_gw(x, gy, geo.kh, geo.kw, stride, padding, dilation)
        if dw is not None:
            out[...] = dw.reshape(out.shape)
            return
    cols = _Cols(geo, dt)
    og, kg = geo.o // geo.groups, geo.cg * geo.kh * geo.kw
    acc = np.zeros((geo.groups, kg, og), dt)  # dweight^T per group, summed over the chunks
    part = np.empty_like(acc)
    for r0, r1 in geo.chunks(dt.itemsize):
        col = cols.im2col(x, r0, r1)
        gc = _rows(geo, gy, r0, r1)  # (O, positions)
        _product(col.reshape(geo.groups, kg, -1), gc.reshape(geo.groups, og, -1).transpose(0, 2, 1), part)
        acc += part
    out[...] = acc.transpose(0, 2, 1).reshape(out.shape)


def conv2dgradinput(g, weight, input_shape, stride, padding, dilation, groups, out):
    gy, w = np.ascontiguousarray(_work(g)), np.ascontiguousarray(_work(weight))
    dt = gy.dtype
    geo = _Geometry([int(d) for d in input_shape], w.shape, stride, padding, dilation, groups, *gy.shape[2:])
    eh, ew = geo.dh * (geo.kh - 1) - geo.ph, geo.dw * (geo.kw - 1) - geo.pw
    if geo.groups == 1 and (geo.sh, geo.sw) == (1, 1) and eh >= 0 and ew >= 0:
        # at stride 1, the gradient is a convolution of gy padded by the kernel's reach less the padding, with the
        # kernel flipped and its channels swapped
        grad = out if out.dtype == dt and out.flags.c_contiguous else np.empty(out.shape, dt)
        flipped = np.ascontiguousarray(w.transpose(1, 0, 2, 3)[:, :, ::-1, ::-1])
        if _direct(gy, flipped, (1, 1), (eh, ew), (geo.dh, geo.dw), grad):
            if grad is not out:
                out[...] = grad
            return
    cols = _Cols(geo, dt)
    if cols.fns is not None:
        grad = out if out.dtype == dt and out.flags.c_contiguous else np.empty(out.shape, dt)
        grad.fill(0)
    else:  # numpy's col2im adds into the padded input
        grad = np.zeros((geo.n, geo.c, geo.h + 2 * geo.ph, geo.w + 2 * geo.pw), dt)
    wt = _grouped(geo, w).transpose(0, 2, 1)  # (groups, C / groups * kh * kw, O / groups)
    og = geo.o // geo.groups
    for r0, r1 in geo.chunks(dt.itemsize):
        gc = _rows(geo, gy, r0, r1)
        col = cols.buffer(r0, r1)
        _product(wt, gc.reshape(geo.groups, og, -1), col.reshape(geo.groups, -1, col.shape[1]))
        cols.col2im(col, grad, r0, r1)
    if cols.fns is None:
        out[...] = grad[:, :, geo.ph:geo.ph + geo.h, geo.pw:geo.pw + geo.w]
    elif grad is not out:
        out[...] = grad


# -- pooling: windows over an input already padded (the SDK pads max_pool2d's input with -inf, avg_pool2d's with 0)

def _windows(a: np.ndarray, kernel: Sequence[int], stride: Sequence[int], dilation: Sequence[int],
             oh: int, ow: int) -> np.ndarray:
    return _taps(a, int(kernel[0]), int(kernel[1]), [int(s) for s in stride], [int(d) for d in dilation], oh, ow)


def _pool_native(name: str, ins: Sequence[np.ndarray], out: np.ndarray, kernel: Sequence[int],
                 stride: Sequence[int], dilation: Sequence[int], hw: Sequence[int], ohw: Sequence[int]) -> bool:
    """Run the C loop `name` (maxpool, maxpoolgrad, sumpool, sumpoolgrad) of ins' dtype into out; False where native
    kernels are off or the dtype is not float32 or float64 (numpy's path then). hw: the (padded) input's plane,
    ohw: the output's."""
    dt = ins[0].dtype
    fns = _native() if dt in (F32, F64) else None
    if fns is None:
        return False
    res = out if out.dtype == dt and out.flags.c_contiguous else np.empty(out.shape, dt)
    arrays = [np.ascontiguousarray(a) for a in ins]
    planes = int(out.shape[0]) * int(out.shape[1])
    big = planes * int(hw[0]) * int(hw[1]) >= POOL_SPLIT_MIN
    fns[f"{name}_{'f32' if dt == F32 else 'f64'}"](
        *[_address(a) for a in arrays], _address(res), planes, int(hw[0]), int(hw[1]), int(kernel[0]),
        int(kernel[1]), int(stride[0]), int(stride[1]), int(dilation[0]), int(dilation[1]), int(ohw[0]),
        int(ohw[1]), int(big and native.split()))
    if res is not out:
        out[...] = res
    return True


def maxpool2d(a, kernel, stride, dilation, out):
    x = _work(a)
    oh, ow = out.shape[2:]
    if _pool_native("maxpool", [x], out, kernel, stride, dilation, x.shape[2:], (oh, ow)):
        return
    out[...] = _windows(x, kernel, stride, dilation, oh, ow).max(axis=(2, 3))  # NaN propagates, as torch's


def maxpool2dgrad(a, g, kernel, stride, dilation, out):
    """Each window's gradient to its first maximum (row by row), or to its last NaN where it holds one, as torch's;
    added where windows overlap; on numpy one kernel tap at a time (no two windows of one tap share a position)."""
    x, gy = _work(a), _work(g)
    oh, ow = gy.shape[2:]
    if x.dtype == gy.dtype and _pool_native("maxpoolgrad", [x, gy], out, kernel, stride, dilation, x.shape[2:],
                                            (oh, ow)):
        return
    kh, kw = int(kernel[0]), int(kernel[1])
    sh, sw = int(stride[0]), int(stride[1])
    dh, dw = int(dilation[0]), int(dilation[1])
    win = _windows(x, kernel, stride, dilation, oh, ow)
    n, c = x.shape[:2]
    taps = win.transpose(0, 1, 4, 5, 2, 3).reshape(n, c, oh, ow, kh * kw)
    first = np.argmax(taps, axis=-1)  # the first maximum, or the first NaN
    nan = np.isnan(taps)
    if nan.any():
        first = np.where(nan.any(axis=-1), kh * kw - 1 - np.argmax(nan[..., ::-1], axis=-1), first)
    grad = np.zeros(x.shape, dtype=gy.dtype)
    for t in range(kh * kw):
        i, j = divmod(t, kw)
        h0, w0 = i * dh, j * dw
        grad[:, :, h0:h0 + sh * (oh - 1) + 1:sh, w0:w0 + sw * (ow - 1) + 1:sw] += np.where(first == t, gy, 0)
    out[...] = grad


def sumpool2d(a, kernel, stride, dilation, out):
    x = _work(a)
    oh, ow = out.shape[2:]
    if _pool_native("sumpool", [x], out, kernel, stride, dilation, x.shape[2:], (oh, ow)):
        return
    out[...] = _windows(x, kernel, stride, dilation, oh, ow).sum(axis=(2, 3))


def sumpool2dgrad(g, input_shape, kernel, stride, dilation, out):
    gy = _work(g)
    shape = tuple(int(d) for d in input_shape)
    oh, ow = gy.shape[2:]
    if _pool_native("sumpoolgrad", [gy], out, kernel, stride, dilation, shape[2:], (oh, ow)):
        return
    kh, kw = int(kernel[0]), int(kernel[1])
    sh, sw = int(stride[0]), int(stride[1])
    dh, dw = int(dilation[0]), int(dilation[1])
    grad = np.zeros(shape, dtype=gy.dtype)
    for i in range(kh):
        for j in range(kw):
            h0, w0 = i * dh, j * dw
            grad[:, :, h0:h0 + sh * (oh - 1) + 1:sh, w0:w0 + sw * (ow - 1) + 1:sw] += gy
    out[...] = grad
