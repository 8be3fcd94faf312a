"""Batch norm and group norm with their statistics, on the CPU (numpy): both normalise a (N, C, ...) tensor viewed as
(N, G, K), batch norm with its statistics over N and K per channel (G = C, K the spatial size), group norm over K per
sample and group (K = C / groups times the spatial size). The 16-bit floats compute in float32 (the statistics stay
float32) and round once into their results; the running statistics update in float64.
"""

from __future__ import annotations

import math

import numpy as np

from deepxd.kernels.cpu._util import F32, F64
from deepxd.kernels.cpu._util import work as _work


def _compute(a: np.ndarray) -> np.dtype:
    """The dtype a norm of `a` computes in, that of its statistics (deepx_core.ir.ops.stats_dtype)."""
    return F64 if a.dtype == F64 else F32


def _view(a: np.ndarray, g: int) -> np.ndarray:
    """(N, C, ...) as (N, g, the rest) in the compute dtype (reshape's -1 cannot size an empty batch)."""
    return _work(a).reshape(a.shape[0], g, math.prod(a.shape[1:]) // g).astype(_compute(a), copy=False)


def _stats(x: np.ndarray, axes: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The mean and biased variance of x over axes (two passes: the variance of the centred values), and x centred."""
    count = x.dtype.type(np.prod([x.shape[d] for d in axes]))  # none: the mean and variance are nan
    mean = np.add.reduce(x, axis=axes, keepdims=True) / count
    xc = x - mean
    var = np.einsum("ijk,ijk->j" if axes == (0, 2) else "ijk,ijk->ij", xc, xc) / count
    return mean, var, xc


def _normalise(x: np.ndarray, xc: np.ndarray, var: np.ndarray, eps: float, weight: np.ndarray, bias: np.ndarray,
               n: int, c: int, out: np.ndarray, per_channel: bool) -> None:
    """out = xc / sqrt(var + eps) * weight + bias, with the scale folded per channel where it can be (batch norm)."""
    dt = x.dtype
    invstd = 1.0 / np.sqrt(var + dt.type(eps))
    w, b = _work(weight).astype(dt, copy=False), _work(bias).astype(dt, copy=False)
    if per_channel:
        y = xc
        y *= (invstd * w)[None, :, None]
        y += b[None, :, None]
    else:
        y = xc
        y *= invstd[:, :, None]
        y = y.reshape(n, c, math.prod(out.shape[2:]))
        y *= w[None, :, None]
        y += b[None, :, None]
    out[...] = y.reshape(out.shape)


def batchnorm(a, weight, bias, eps, out, mean, var):
    n, c = a.shape[:2]
    x = _view(a, c)
    m, v, xc = _stats(x, (0, 2))
    mean[...] = m.reshape(c)
    var[...] = v
    _normalise(x, xc, v, eps, weight, bias, n, c, out, True)


def groupnorm(a, weight, bias, groups, eps, out, mean, var):
    n, c = a.shape[:2]
    x = _view(a, groups)
    m, v, xc = _stats(x, (2,))
    mean[...] = m.reshape(n, groups)
    var[...] = v
    _normalise(x, xc, v, eps, weight, bias, n, c, out, False)


def _grads(x: np.ndarray, g: np.ndarray, mean: np.ndarray, var: np.ndarray, eps: float, weight: np.ndarray,
           groups: int | None, da: np.ndarray, dweight: np.ndarray, dbias: np.ndarray) -> None:
    """batchnormgrad (groups None) and groupnormgrad: x and g (N, C, K) in the compute dtype."""
    n, c, k = x.shape
    dt = x.dtype
    w = _work(weight).astype(dt, copy=False)
    if groups is None:
        invstd = (1.0 / np.sqrt(var.astype(dt) + dt.type(eps)))[None, :, None]
        xh = x - mean.astype(dt)[None, :, None]
        xh *= invstd
        db = np.add.reduce(g, axis=(0, 2))
        dw = np.einsum("ijk,ijk->j", g, xh)
        count = dt.type(n * k)
        # dA = w invstd (g - db / n - xh dw / n)
        xh *= (dw / count)[None, :, None]
        d = g - xh
        d -= (db / count)[None, :, None]
        d *= (w * invstd[0, :, 0])[None, :, None]
    else:
        cg = c // groups
        invstd = (1.0 / np.sqrt(var.astype(dt) + dt.type(eps)))[:, :, None]
        xg = x.reshape(n, groups, cg * k)
        xh = (xg - mean.astype(dt)[:, :, None]) * invstd
        xh4 = xh.reshape(n, c, k)
        db = np.add.reduce(g, axis=(0, 2))
        dw = np.einsum("ijk,ijk->j", g, xh4)
        gw = (g * w[None, :, None]).reshape(n, groups, cg * k)
        count = dt.type(cg * k)
        mean_d = np.add.reduce(gw, axis=2, keepdims=True) / count
        mean_dx = np.einsum("ijk,ijk->ij", gw, xh)[:, :, None] / count
        xh *= mean_dx
        d = gw - mean_d
        d -= xh
        d *= invstd
    da[...] = d.reshape(da.shape)
    dweight[...] = dw
    dbias[...] = db


def batchnormgrad(a, g, weight, mean, var, eps, da, dweight, dbias):
    c = a.shape[1]
    _grads(_view(a, c), _view(g, c), mean, var, eps, weight, None, da, dweight, dbias)


def groupnormgrad(a, g, weight, mean, var, groups, eps, da, dweight, dbias):
    c = a.shape[1]
    _grads(_view(a, c), _view(g, c), mean, var, eps, weight, groups, da, dweight, dbias)


def batchnormupdate(running_mean, running_var, mean, var, momentum, count, out_mean, out_var):
    m = float(momentum)
    unbiased = var.astype(F64) * count / (count - 1)
    out_mean[...] = m * mean.astype(F64) + (1 - m) * running_mean.astype(F64)
    out_var[...] = m * unbiased + (1 - m) * running_var.astype(F64)

