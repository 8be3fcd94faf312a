"""conv2d and its gradient ops on the device: direct convolution, one thread per result element (grid-stride), the
sums in float32 (float64 for float64), as the CPU kernels (deepxd/kernels/cpu/conv.py) compute them.

These are plain and correct, not fast: each output element reads its window straight from global memory, and the
weight's gradient sums over the batch and the image in one thread per weight element. An implicit-GEMM kernel (or
cuDNN) is the fast form; the CPU kernels are the reference either must match (tests/gpu/test_kernels.py).
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

#define GEOMETRY int N, int C, int H, int W, int O, int KH, int KW, int OH, int OW, \
                 int sh, int sw, int ph, int pw, int dh, int dw, int G

// out[n, o, oy, ox] = sum over c of o's group, i, j of x[n, c, oy*sh - ph + i*dh, ox*sw - pw + j*dw] w[o, c, i, j]
extern "C" __global__ void conv2d_forward(T* out, const T* x, const T* w, ll total, GEOMETRY) {
    const int cg = C / G, og = O / G;
    for (ll idx = blockIdx.x * (ll)blockDim.x + threadIdx.x; idx < total; idx += (ll)gridDim.x * blockDim.x) {
        const int ox = (int)(idx % OW);
        ll r = idx / OW;
        const int oy = (int)(r % OH);
        r /= OH;
        const int o = (int)(r % O);
        const int n = (int)(r / O);
        const int g = o / og;
        A acc = (A)0;
        for (int c = 0; c < cg; ++c) {
            const T* xp = x + ((ll)n * C + (ll)g * cg + c) * H * W;
            const T* wp = w + ((ll)o * cg + c) * KH * KW;
            for (int i = 0; i < KH; ++i) {
                const int iy = oy * sh - ph + i * dh;
                if (iy < 0 || iy >= H) continue;
                for (int j = 0; j < KW; ++j) {
                    const int ix = ox * sw - pw + j * dw;
                    if (ix < 0 || ix >= W) continue;
                    acc += ld(xp[(ll)iy * W + ix]) * ld(wp[i * KW + j]);
                }
            }
        }
        out[idx] = st<T>(acc);
    }
}

// dx[n, c, y, x]: the sum of g[n, o, oy, ox] w[o, c, i, j] over the windows (o, i, j) that read it
extern "C" __global__ void conv2d_grad_input(T* dx, const T* gy, const T* w, ll total, GEOMETRY) {
    const int cg = C / G, og = O / G;
    for (ll idx = blockIdx.x * (ll)blockDim.x + threadIdx.x; idx < total; idx += (ll)gridDim.x * blockDim.x) {
        const int xx = (int)(idx % W);
        ll r = idx / W;
        const int y = (int)(r % H);
        r /= H;
        const int c = (int)(r % C);
        const int n = (int)(r / C);
        const int g = c / cg, cc = c % cg;
        A acc = (A)0;
        for (int k = 0; k < og; ++k) {
            const int o = g * og + k;
            const T* gp = gy + ((ll)n * O + o) * OH * OW;
            const T* wp = w + ((ll)o * cg + cc) * KH * KW;
            for (int i = 0; i < KH; ++i) {
                const int ty = y + ph - i * dh;
                if (ty < 0 || ty % sh) continue;
                const int oy = ty / sh;
                if (oy >= OH) continue;
                for (int j = 0; j < KW; ++j) {
                    const int tx = xx + pw - j * dw;
                    if (tx < 0 || tx % sw) continue;
                    const int ox = tx / sw;
                    if (ox >= OW) continue;
                    acc += ld(gp[(ll)oy * OW + ox]) * ld(wp[i * KW + j]);
                }
            }
        }
        dx[idx] = st<T>(acc);
    }
}

// dw[o, cc, i, j]: the sum over n, oy, ox of g[n, o, oy, ox] x[n, c, oy*sh - ph + i*dh, ox*sw - pw + j*dw]
extern "C" __global__ void conv2d_grad_weight(T* dw_, const T* x, const T* gy, ll total, GEOMETRY) {
    const int cg = C / G, og = O / G;
    for (ll idx = blockIdx.x * (ll)blockDim.x + threadIdx.x; idx < total; idx += (ll)gridDim.x * blockDim.x) {
        const int j = (int)(idx % KW);
        ll r = idx / KW;
        const int i = (int)(r % KH);
        r /= KH;
        const int cc = (int)(r % cg);
        const int o = (int)(r / cg);
        const int c = (o / og) * cg + cc;
        A acc = (A)0;
        for (int n = 0; n < N; ++n) {
            const T* xp = x + ((ll)n * C + c) * H * W;
            const T* gp = gy + ((ll)n * O + o) * OH * OW;
            for (int oy = 0; oy < OH; ++oy) {
                const int iy = oy * sh - ph + i * dh;
                if (iy < 0 || iy >= H) continue;
                for (int ox = 0; ox < OW; ++ox) {
                    const int ix = ox * sw - pw + j * dw;
                    if (ix < 0 || ix >= W) continue;
                    acc += ld(xp[(ll)iy * W + ix]) * ld(gp[(ll)oy * OW + ox]);
                }
            }
        }
        dw_[idx] = st<T>(acc);
    }
}

#define PGEOM int C, int H, int W, int OH, int OW, int KH, int KW, int sh, int sw, int dh, int dw

// the first position (tap i * KW + j, row by row) of window (oy, ox) holding its maximum, or its last NaN where it
// holds any: torch's choice
__device__ __forceinline__ int pool_argmax(const T* xp, int W, int oy, int ox, int KH, int KW, int sh, int sw,
                                           int dh, int dw, A* value) {
    int best = 0;
    A m = ld(xp[(ll)(oy * sh) * W + ox * sw]);
    for (int i = 0; i < KH; ++i)
        for (int j = 0; j < KW; ++j) {
            const A v = ld(xp[(ll)(oy * sh + i * dh) * W + ox * sw + j * dw]);
            if (v > m || v != v) { m = v; best = i * KW + j; }
        }
    *value = m;
    return best;
}

extern "C" __global__ void maxpool2d_forward(T* out, const T* x, const T* unused, ll total, PGEOM) {
    for (ll idx = blockIdx.x * (ll)blockDim.x + threadIdx.x; idx < total; idx += (ll)gridDim.x * blockDim.x) {
        const int ox = (int)(idx % OW);
        const ll r = idx / OW;
        const int oy = (int)(r % OH);
        const ll plane = r / OH;  // n * C + c
        A m;
        pool_argmax(x + plane * H * W, W, oy, ox, KH, KW, sh, sw, dh, dw, &m);
        out[idx] = st<T>(m);
    }
}

// dx[n, c, y, x]: the sum of g over the windows whose first maximum is at (y, x)
extern "C" __global__ void maxpool2d_grad(T* dx, const T* x, const T* gy, ll total, PGEOM) {
    for (ll idx = blockIdx.x * (ll)blockDim.x + threadIdx.x; idx < total; idx += (ll)gridDim.x * blockDim.x) {
        const int xx = (int)(idx % W);
        const ll r = idx / W;
        const int y = (int)(r % H);
        const ll plane = r / H;
        const T* xp = x + plane * H * W;
        const T* gp = gy + plane * OH * OW;
        A acc = (A)0, m;
        for (int i = 0; i < KH; ++i) {
            const int ty = y - i * dh;
            if (ty < 0 || ty % sh) continue;
            const int oy = ty / sh;
            if (oy >= OH) continue;
            for (int j = 0; j < KW; ++j) {
                const int tx = xx - j * dw;
                if (tx < 0 || tx % sw) continue;
                const int ox = tx / sw;
                if (ox >= OW) continue;
                if (pool_argmax(xp, W, oy, ox, KH, KW, sh, sw, dh, dw, &m) == i * KW + j)
                    acc += ld(gp[(ll)oy * OW + ox]);
            }
        }
        dx[idx] = st<T>(acc);
    }
}

extern "C" __global__ void sumpool2d_forward(T* out, const T* x, const T* unused, ll total, PGEOM) {
    for (ll idx = blockIdx.x * (ll)blockDim.x + threadIdx.x; idx < total; idx += (ll)gridDim.x * blockDim.x) {
        const int ox = (int)(idx % OW);
        const ll r = idx / OW;
        const int oy = (int)(r % OH);
        const T* xp = x + (r / OH) * H * W;
        A acc = (A)0;
        for (int i = 0; i < KH; ++i)
            for (int j = 0; j < KW; ++j)
                acc += ld(xp[(ll)(oy * sh + i * dh) * W + ox * sw + j * dw]);
        out[idx] = st<T>(acc);
    }
}

// dx[n, c, y, x]: the sum of g over the windows that read (y, x)
extern "C" __global__ void sumpool2d_grad(T* dx, const T* unused, const T* gy, ll total, PGEOM) {
    for (ll idx = blockIdx.x * (ll)blockDim.x + threadIdx.x; idx < total; idx += (ll)gridDim.x * blockDim.x) {
        const int xx = (int)(idx % W);
        const ll r = idx / W;
        const int y = (int)(r % H);
        const T* gp = gy + (r / H) * OH * OW;
        A acc = (A)0;
        for (int i = 0; i < KH; ++i) {
            const int ty = y - i * dh;
            if (ty < 0 || ty % sh) continue;
            const int oy = ty / sh;
            if (oy >= OH) continue;
            for (int j = 0; j < KW; ++j) {
                const int tx = xx - j * dw;
                if (tx < 0 || tx % sw) continue;
                const int ox = tx / sw;
                if (ox >= OW) continue;
                acc += ld(gp[(ll)oy * OW + ox]);
            }
        }
        dx[idx] = st<T>(acc);
    }
}
"""

_FMT = "PPPq" + "i" * 16


@memoize("kernels.cuda.conv.source", 16)
def source(dtype: str) -> str:
    return HEADER + f"typedef {ctype(dtype)} T;\n" + _SRC


def sources() -> list[tuple[str, str]]:
    return [(source(d), f"conv ({d})") for d in sorted(FLOATS)]


SUPPORT = {op: frozenset(FLOATS) for op in ("conv2d", "conv2dgradinput", "conv2dgradweight", "maxpool2d",
                                            "maxpool2dgrad", "sumpool2d", "sumpool2dgrad")}


def _run(ex: CudaExecutor, op: str, kernel: str, out: DeviceTensor, first: DeviceTensor, second: DeviceTensor,
         xs: tuple[int, ...], ws: tuple[int, ...], gs: tuple[int, ...], stride: Any, padding: Any, dilation: Any,
         groups: int) -> bool:
    n = out.size
    if n:
        f = ex.function(f"conv_{out.dname}", source(out.dname), kernel, _FMT, op)
        ex.launch(op, f, ex.grid(n), (256, 1, 1), out.ptr, first.ptr, second.ptr, n, *xs, ws[0], ws[2], ws[3],
                  gs[2], gs[3], int(stride[0]), int(stride[1]), int(padding[0]), int(padding[1]), int(dilation[0]),
                  int(dilation[1]), int(groups))
    return True


def conv2d(ex: CudaExecutor, a: DeviceTensor, weight: DeviceTensor, stride: Any, padding: Any, dilation: Any,
           groups: int, out: DeviceTensor) -> bool:
    return _run(ex, "conv2d", "conv2d_forward", out, a, weight, a.shape, weight.shape, out.shape, stride, padding,
                dilation, groups)


def conv2dgradinput(ex: CudaExecutor, g: DeviceTensor, weight: DeviceTensor, input_shape: Any, stride: Any,
                    padding: Any, dilation: Any, groups: int, out: DeviceTensor) -> bool:
    return _run(ex, "conv2dgradinput", "conv2d_grad_input", out, g, weight, out.shape, weight.shape, g.shape,
                stride, padding, dilation, groups)


def conv2dgradweight(ex: CudaExecutor, a: DeviceTensor, g: DeviceTensor, weight_shape: Any, stride: Any,
                     padding: Any, dilation: Any, groups: int, out: DeviceTensor) -> bool:
    return _run(ex, "conv2dgradweight", "conv2d_grad_weight", out, a, g, a.shape, out.shape, g.shape, stride,
                padding, dilation, groups)


_PFMT = "PPPq" + "i" * 11


def _pool(ex: CudaExecutor, op: str, kernel: str, out: DeviceTensor, x: DeviceTensor | None, g: DeviceTensor | None,
          xs: tuple[int, ...], gs: tuple[int, ...], window: Any, stride: Any, dilation: Any) -> bool:
    n = out.size
    if n:
        f = ex.function(f"conv_{out.dname}", source(out.dname), kernel, _PFMT, op)
        x_ptr = x.ptr if x is not None else 0
        g_ptr = g.ptr if g is not None else 0
        ex.launch(op, f, ex.grid(n), (256, 1, 1), out.ptr, x_ptr, g_ptr, n, xs[1], xs[2], xs[3], gs[2], gs[3],
                  int(window[0]), int(window[1]), int(stride[0]), int(stride[1]), int(dilation[0]), int(dilation[1]))
    return True


def maxpool2d(ex: CudaExecutor, a: DeviceTensor, kernel: Any, stride: Any, dilation: Any, out: DeviceTensor) -> bool:
    return _pool(ex, "maxpool2d", "maxpool2d_forward", out, a, None, a.shape, out.shape, kernel, stride, dilation)


def maxpool2dgrad(ex: CudaExecutor, a: DeviceTensor, g: DeviceTensor, kernel: Any, stride: Any, dilation: Any,
                  out: DeviceTensor) -> bool:
    return _pool(ex, "maxpool2dgrad", "maxpool2d_grad", out, a, g, a.shape, g.shape, kernel, stride, dilation)


def sumpool2d(ex: CudaExecutor, a: DeviceTensor, kernel: Any, stride: Any, dilation: Any, out: DeviceTensor) -> bool:
    return _pool(ex, "sumpool2d", "sumpool2d_forward", out, a, None, a.shape, out.shape, kernel, stride, dilation)


def sumpool2dgrad(ex: CudaExecutor, g: DeviceTensor, input_shape: Any, kernel: Any, stride: Any, dilation: Any,
                  out: DeviceTensor) -> bool:
    return _pool(ex, "sumpool2dgrad", "sumpool2d_grad", out, None, g, out.shape, g.shape, kernel, stride, dilation)
