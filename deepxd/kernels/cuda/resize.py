"""interpnearest, interpbilinear and their gradients on the device, with the source positions of
deepxd/kernels/cpu/resize.py to the bit: float32 arithmetic for every dtype but float64 (nearest: always float32),
torch's multiply-add rounded once in float32 (fmaf), the float64 form without one. One thread per output element
forward; backward one thread per input element, which finds the outputs that read it by binary search (the source
indices never decrease along a dim) and adds their gradients: no atomics, the same sums every run.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from deepx_core.cache import memoize
from deepx_core.ir.dtypes import FLOATS
from deepxd.kernels.cuda._src import HEADER, ctype

if TYPE_CHECKING:
    from deepxd.kernels.cuda import CudaExecutor, DeviceTensor

_SRC = r"""
typedef typename Acc<T>::type A;
template <class X> struct PosOf { typedef float type; };
template <> struct PosOf<double> { typedef double type; };
typedef typename PosOf<T>::type P;  // the positions' type

// ---- nearest: torch's nearest_idx (a size that stays or doubles is copied or halved whatever the scale factor)
__device__ __forceinline__ int nearest_src(int dst, int n_in, int n_out, double factor) {
    if (n_out == n_in) return dst;
    if (n_out == 2 * n_in) return dst >> 1;
    const float s = factor > 0 ? (float)(1.0 / factor) : (float)n_in / (float)n_out;
    return mn((int)floorf(__fmul_rn((float)dst, s)), n_in - 1);
}
// the first output whose source is at least `target`
__device__ __forceinline__ int nearest_first(int target, int n_in, int n_out, double factor) {
    int lo = 0, hi = n_out;
    while (lo < hi) {
        const int mid = (lo + hi) >> 1;
        if (nearest_src(mid, n_in, n_out, factor) >= target) hi = mid; else lo = mid + 1;
    }
    return lo;
}

// ---- linear: torch's area_pixel_compute_source_index and guard_index_and_lambda
struct Lin { int lo, hi; P wlo, whi; };
__device__ __forceinline__ float lin_pos(float s, int dst) { return fmaf(s, __fadd_rn((float)dst, 0.5f), -0.5f); }
__device__ __forceinline__ double lin_pos(double s, int dst) {
    return __dadd_rn(__dmul_rn(s, __dadd_rn((double)dst, 0.5)), -0.5);
}
__device__ __forceinline__ Lin linear_src(int dst, int n_in, int n_out, int align, double factor) {
    Lin l;
    if (n_in == n_out) { l.lo = l.hi = dst; l.wlo = (P)1; l.whi = (P)0; return l; }
    P pos;
    if (align) {
        const P s = n_out > 1 ? (P)(n_in - 1) / (P)(n_out - 1) : (P)0;
        pos = s * (P)dst;
    } else {
        const P s = factor > 0 ? (P)(1.0 / factor) : (P)n_in / (P)n_out;
        pos = lin_pos(s, dst);
        if (pos < (P)0) pos = (P)0;
    }
    l.lo = mn((int)floor(pos), n_in - 1);
    P frac = pos - (P)l.lo;
    frac = frac < (P)0 ? (P)0 : frac > (P)1 ? (P)1 : frac;
    l.hi = l.lo < n_in - 1 ? l.lo + 1 : l.lo;
    l.wlo = (P)1 - frac;
    l.whi = frac;
    return l;
}
// the first output whose lo (or hi) source is at least `target`
__device__ __forceinline__ int linear_first(int target, int hi_side, int n_in, int n_out, int align, double factor) {
    int lo = 0, hi = n_out;
    while (lo < hi) {
        const int mid = (lo + hi) >> 1;
        const Lin l = linear_src(mid, n_in, n_out, align, factor);
        if ((hi_side ? l.hi : l.lo) >= target) hi = mid; else lo = mid + 1;
    }
    return lo;
}

extern "C" __global__ void nearest_forward(T* y, const T* x, ll planes, int H, int W, int OH, int OW, double fh,
                                           double fw) {
    GRID_STRIDE(i, planes * OH * OW) {
        const int ox = (int)(i % OW);
        const ll r = i / OW;
        const int oy = (int)(r % OH);
        const ll plane = r / OH;
        y[i] = x[(plane * H + nearest_src(oy, H, OH, fh)) * W + nearest_src(ox, W, OW, fw)];
    }
}

// dx[y, x]: the sum of g over the outputs whose source is (y, x), row by row
extern "C" __global__ void nearest_backward(T* dx, const T* g, ll planes, int H, int W, int OH, int OW, double fh,
                                            double fw) {
    GRID_STRIDE(i, planes * H * W) {
        const int xx = (int)(i % W);
        const ll r = i / W;
        const int yy = (int)(r % H);
        const T* gp = g + (r / H) * OH * OW;
        const int y0 = nearest_first(yy, H, OH, fh), y1 = nearest_first(yy + 1, H, OH, fh);
        const int x0 = nearest_first(xx, W, OW, fw), x1 = nearest_first(xx + 1, W, OW, fw);
        A acc = (A)0;
        for (int oy = y0; oy < y1; ++oy)
            for (int ox = x0; ox < x1; ++ox) acc += ld(gp[(ll)oy * OW + ox]);
        dx[i] = st<T>(acc);
    }
}

extern "C" __global__ void bilinear_forward(T* y, const T* x, ll planes, int H, int W, int OH, int OW, int align,
                                            double fh, double fw) {
    GRID_STRIDE(i, planes * OH * OW) {
        const int ox = (int)(i % OW);
        const ll r = i / OW;
        const int oy = (int)(r % OH);
        const T* p = x + (r / OH) * H * W;
        const Lin ly = linear_src(oy, H, OH, align, fh), lx = linear_src(ox, W, OW, align, fw);
        const A t0 = ld(p[(ll)ly.lo * W + lx.lo]) * (A)lx.wlo + ld(p[(ll)ly.lo * W + lx.hi]) * (A)lx.whi;
        const A t1 = ld(p[(ll)ly.hi * W + lx.lo]) * (A)lx.wlo + ld(p[(ll)ly.hi * W + lx.hi]) * (A)lx.whi;
        y[i] = st<T>(t0 * (A)ly.wlo + t1 * (A)ly.whi);
    }
}

// the weighted sum of row oy of g over the outputs ox whose lo source is xx (weight wlo) or whose hi source is
__device__ __forceinline__ A bilinear_row(const T* gr, int xx, int W, int OW, int align, double fw) {
    A acc = (A)0;
    for (int side = 0; side < 2; ++side) {
        const int a = linear_first(xx, side, W, OW, align, fw), b = linear_first(xx + 1, side, W, OW, align, fw);
        for (int ox = a; ox < b; ++ox) {
            const Lin l = linear_src(ox, W, OW, align, fw);
            acc += ld(gr[ox]) * (A)(side ? l.whi : l.wlo);
        }
    }
    return acc;
}

// dx[y, x]: each output's g, times its weights, from the outputs that read (y, x)
extern "C" __global__ void bilinear_backward(T* dx, const T* g, ll planes, int H, int W, int OH, int OW, int align,
                                             double fh, double fw) {
    GRID_STRIDE(i, planes * H * W) {
        const int xx = (int)(i % W);
        const ll r = i / W;
        const int yy = (int)(r % H);
        const T* gp = g + (r / H) * OH * OW;
        A acc = (A)0;
        for (int side = 0; side < 2; ++side) {
            const int a = linear_first(yy, side, H, OH, align, fh), b = linear_first(yy + 1, side, H, OH, align, fh);
            for (int oy = a; oy < b; ++oy) {
                const Lin l = linear_src(oy, H, OH, align, fh);
                acc += bilinear_row(gp + (ll)oy * OW, xx, W, OW, align, fw) * (A)(side ? l.whi : l.wlo);
            }
        }
        dx[i] = st<T>(acc);
    }
}
"""

_FMT = "PPqiiiidd"
_BFMT = "PPqiiiiidd"


@memoize("kernels.cuda.resize.source", 16)
def source(dtype: str) -> str:
    return HEADER + f"typedef {ctype(dtype)} T;\n" + _SRC


def sources() -> list[tuple[str, str]]:
    return [(source(d), f"resize ({d})") for d in sorted(FLOATS)]


SUPPORT = {op: frozenset(FLOATS) for op in ("interpnearest", "interpnearestgrad", "interpbilinear",
                                            "interpbilineargrad")}


def _launch(ex: CudaExecutor, op: str, kernel: str, out: DeviceTensor, src: DeviceTensor, small: tuple[int, ...],
            big: tuple[int, ...], *rest: Any) -> bool:
    """One thread per element of `out`; (small) and (big) are the (H, W) of the input and of the output."""
    n = out.size
    if n:
        fmt = _BFMT if "bilinear" in kernel else _FMT
        f = ex.function(f"resize:{out.dname}", source(out.dname), kernel, fmt, op)
        planes = out.shape[0] * out.shape[1]
        ex.launch(op, f, ex.grid(n), (256, 1, 1), out.ptr, src.ptr, planes, small[0], small[1], big[0], big[1],
                  *rest)
    return True


def interpnearest(ex: CudaExecutor, a: DeviceTensor, size: Any, scale_h: Any, scale_w: Any,
                  out: DeviceTensor) -> bool:
    return _launch(ex, "interpnearest", "nearest_forward", out, a, a.shape[2:], out.shape[2:], float(scale_h),
                   float(scale_w))


def interpnearestgrad(ex: CudaExecutor, g: DeviceTensor, input_shape: Any, scale_h: Any, scale_w: Any,
                      out: DeviceTensor) -> bool:
    return _launch(ex, "interpnearestgrad", "nearest_backward", out, g, out.shape[2:], g.shape[2:], float(scale_h),
                   float(scale_w))


def interpbilinear(ex: CudaExecutor, a: DeviceTensor, size: Any, align_corners: Any, scale_h: Any, scale_w: Any,
                   out: DeviceTensor) -> bool:
    return _launch(ex, "interpbilinear", "bilinear_forward", out, a, a.shape[2:], out.shape[2:],
                   int(bool(align_corners)), float(scale_h), float(scale_w))


def interpbilineargrad(ex: CudaExecutor, g: DeviceTensor, input_shape: Any, align_corners: Any, scale_h: Any,
                       scale_w: Any, out: DeviceTensor) -> bool:
    return _launch(ex, "interpbilineargrad", "bilinear_backward", out, g, out.shape[2:], g.shape[2:],
                   int(bool(align_corners)), float(scale_h), float(scale_w))
