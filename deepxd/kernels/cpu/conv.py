"""Convolution on the CPU: im2col in chunks of output rows, each chunk one GEMM (batched over groups) on BLAS.

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

SOURCE = r"""
#include <string.h>
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
CONV(float, f32) CONV(double, f64)
POOL(float, f32) POOL(double, f64)
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
        self.col = np.empty(max(r1 - r0 for r0, r1 in g.chunks(dt.itemsize)) * g.ow * g.k, dt)
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
