"""Convolution on the CPU: im2col as a strided view of the padded input (no copy until BLAS packs it), then one
GEMM per group (`np.tensordot`). The 16-bit floats compute in float32 and round once, as the other kernels do.

The view `_taps(xp, ...)` has shape (N, C, kh, kw, Hout, Wout): element [n, c, i, j, y, x] is the padded input at
(y * stride + i * dilation, x * stride + j * dilation). Forward contracts it with the weight over (c, i, j); the
weight's gradient contracts it with G over (n, y, x); the input's gradient scatters weight x G back, one kernel tap
at a time (kh * kw strided adds).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import as_strided

from deepxd.kernels.cpu._util import work as _work


def _padded(a: np.ndarray, ph: int, pw: int) -> np.ndarray:
    if not ph and not pw:
        return a
    return np.pad(a, ((0, 0), (0, 0), (ph, ph), (pw, pw)))


def _taps(xp: np.ndarray, kh: int, kw: int, stride: Sequence[int], dilation: Sequence[int], oh: int,
          ow: int) -> np.ndarray:
    n, c = xp.shape[:2]
    s0, s1, s2, s3 = xp.strides
    return as_strided(xp, (n, c, kh, kw, oh, ow),
                      (s0, s1, s2 * dilation[0], s3 * dilation[1], s2 * stride[0], s3 * stride[1]), writeable=False)


def conv2d(a, weight, stride, padding, dilation, groups, out):
    x, w = _work(a), _work(weight)
    o, cg, kh, kw = w.shape
    oh, ow = out.shape[2:]
    cols = _taps(_padded(x, padding[0], padding[1]), kh, kw, stride, dilation, oh, ow)
    og = o // groups
    for g in range(groups):  # (O_g, C_g, kh, kw) . (N, C_g, kh, kw, oh, ow) -> (O_g, N, oh, ow)
        part = np.tensordot(w[g * og:(g + 1) * og], cols[:, g * cg:(g + 1) * cg], axes=([1, 2, 3], [1, 2, 3]))
        out[:, g * og:(g + 1) * og] = part.transpose(1, 0, 2, 3)


def conv2dgradweight(a, g, weight_shape, stride, padding, dilation, groups, out):
    x, gy = _work(a), _work(g)
    o, cg, kh, kw = (int(d) for d in weight_shape)
    oh, ow = gy.shape[2:]
    cols = _taps(_padded(x, padding[0], padding[1]), kh, kw, stride, dilation, oh, ow)
    og = o // groups
    for k in range(groups):  # (N, O_g, oh, ow) . (N, C_g, kh, kw, oh, ow) -> (O_g, C_g, kh, kw)
        out[k * og:(k + 1) * og] = np.tensordot(gy[:, k * og:(k + 1) * og], cols[:, k * cg:(k + 1) * cg],
                                                axes=([0, 2, 3], [0, 4, 5]))


def conv2dgradinput(g, weight, input_shape, stride, padding, dilation, groups, out):
    gy, w = _work(g), _work(weight)
    n, c, h, wd = (int(d) for d in input_shape)
    o, cg, kh, kw = w.shape
    oh, ow = gy.shape[2:]
    ph, pw = int(padding[0]), int(padding[1])
    sh, sw = int(stride[0]), int(stride[1])
    dh, dw = int(dilation[0]), int(dilation[1])
    og = o // groups
    grad = np.zeros((n, c, h + 2 * ph, wd + 2 * pw), dtype=gy.dtype)
    for k in range(groups):  # (O_g, C_g, kh, kw) . (N, O_g, oh, ow) -> (C_g, kh, kw, N, oh, ow)
        cols = np.tensordot(w[k * og:(k + 1) * og], gy[:, k * og:(k + 1) * og], axes=([0], [1]))
        cols = cols.transpose(3, 0, 1, 2, 4, 5)  # (N, C_g, kh, kw, oh, ow)
        chans = grad[:, k * cg:(k + 1) * cg]
        for i in range(kh):
            for j in range(kw):
                h0, w0 = i * dh, j * dw
                chans[:, :, h0:h0 + sh * (oh - 1) + 1:sh, w0:w0 + sw * (ow - 1) + 1:sw] += cols[:, :, i, j]
    out[...] = grad[:, :, ph:ph + h, pw:pw + wd]


# -- pooling: windows over an input already padded (the SDK pads max_pool2d's input with -inf, avg_pool2d's with 0)

def _windows(a: np.ndarray, kernel: Sequence[int], stride: Sequence[int], dilation: Sequence[int],
             oh: int, ow: int) -> np.ndarray:
    return _taps(a, int(kernel[0]), int(kernel[1]), [int(s) for s in stride], [int(d) for d in dilation], oh, ow)


def maxpool2d(a, kernel, stride, dilation, out):
    x = _work(a)
    oh, ow = out.shape[2:]
    out[...] = _windows(x, kernel, stride, dilation, oh, ow).max(axis=(2, 3))  # NaN propagates, as torch's


def maxpool2dgrad(a, g, kernel, stride, dilation, out):
    """Each window's gradient to its first maximum (row by row; a NaN counts as the maximum), added where windows
    overlap, one kernel tap at a time (no two windows of one tap share a position)."""
    x, gy = _work(a), _work(g)
    kh, kw = int(kernel[0]), int(kernel[1])
    sh, sw = int(stride[0]), int(stride[1])
    dh, dw = int(dilation[0]), int(dilation[1])
    oh, ow = gy.shape[2:]
    win = _windows(x, kernel, stride, dilation, oh, ow)
    n, c = x.shape[:2]
    first = np.argmax(win.transpose(0, 1, 4, 5, 2, 3).reshape(n, c, oh, ow, kh * kw), axis=-1)
    grad = np.zeros(x.shape, dtype=gy.dtype)
    for t in range(kh * kw):
        i, j = divmod(t, kw)
        h0, w0 = i * dh, j * dw
        grad[:, :, h0:h0 + sh * (oh - 1) + 1:sh, w0:w0 + sw * (ow - 1) + 1:sw] += np.where(first == t, gy, 0)
    out[...] = grad


def sumpool2d(a, kernel, stride, dilation, out):
    x = _work(a)
    oh, ow = out.shape[2:]
    out[...] = _windows(x, kernel, stride, dilation, oh, ow).sum(axis=(2, 3))


def sumpool2dgrad(g, input_shape, kernel, stride, dilation, out):
    gy = _work(g)
    kh, kw = int(kernel[0]), int(kernel[1])
    sh, sw = int(stride[0]), int(stride[1])
    dh, dw = int(dilation[0]), int(dilation[1])
    oh, ow = gy.shape[2:]
    grad = np.zeros(tuple(int(d) for d in input_shape), dtype=gy.dtype)
    for i in range(kh):
        for j in range(kw):
            h0, w0 = i * dh, j * dw
            grad[:, :, h0:h0 + sh * (oh - 1) + 1:sh, w0:w0 + sw * (ow - 1) + 1:sw] += gy
    out[...] = grad
