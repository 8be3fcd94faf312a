"""Batch norm and group norm with their statistics, on the CPU (numpy): both normalise a (N, C, ...) tensor viewed as
(N, G, K), batch norm with its statistics over N and K per channel (G = C, K the spatial size), group norm over K per
sample and group (K = C / groups times the spatial size). The 16-bit floats compute in float32 (the statistics stay
float32) and round once into their results; the running statistics update in float64.

The kernels work in their output's buffer where they can (`_target`): an activation-sized temporary is fresh memory
every step, and its page faults cost more than the arithmetic.
"""

from __future__ import annotations

import math

import numpy as np

from deepxd.kernels.cpu._util import F32, F64
from deepxd.kernels.cpu._util import work as _work
from deepxd.kernels.cpu.fused import fused


def _compute(a: np.ndarray) -> np.dtype:
    """The dtype a norm of `a` computes in, that of its statistics (deepx_core.ir.ops.stats_dtype)."""
    return F64 if a.dtype == F64 else F32


def _view(a: np.ndarray, g: int) -> np.ndarray:
    """(N, C, ...) as (N, g, the rest) in the compute dtype (reshape's -1 cannot size an empty batch)."""
    return _work(a).reshape(a.shape[0], g, math.prod(a.shape[1:]) // g).astype(_compute(a), copy=False)


def _target(out: np.ndarray, like: np.ndarray, *avoid: np.ndarray) -> np.ndarray:
    """`out` viewed as `like` where the kernel can compute in it (its dtype, contiguous, sharing no memory with the
    arrays still to be read after it is first written), else a new array."""
    if out.dtype == like.dtype and out.flags.c_contiguous and not any(np.may_share_memory(out, a) for a in avoid):
        return out.reshape(like.shape)
    return np.empty(like.shape, like.dtype)


def _finish(y: np.ndarray, out: np.ndarray) -> None:
    if not np.may_share_memory(y, out):
        out[...] = y.reshape(out.shape)


def _param(p: np.ndarray, dt: np.dtype) -> np.ndarray:
    """A weight or bias in the compute dtype, copied (C values): a statistic written first may be its buffer."""
    return _work(p).astype(dt, copy=True)


def _forward(a: np.ndarray, weight: np.ndarray, bias: np.ndarray, groups: int | None, eps: float, out: np.ndarray,
             mean: np.ndarray, var: np.ndarray) -> None:
    """batchnorm (groups None) and groupnorm: y = (x - mean) / sqrt(var + eps) * weight + bias, the statistics by
    two passes (the variance of the centred values), the centred values written into y."""
    n, c = a.shape[:2]
    x = _view(a, groups or c)
    axes = (0, 2) if groups is None else (2,)
    dt = x.dtype
    w, b = _param(weight, dt), _param(bias, dt)
    count = dt.type(math.prod(x.shape[d] for d in axes))  # none: the mean and variance are nan
    m = np.add.reduce(x, axis=axes) / count
    y = _target(out, x)  # out may be a: it is read only by the subtraction that writes it
    np.subtract(x, m[None, :, None] if groups is None else m[:, :, None], out=y)
    v = np.einsum("ijk,ijk->j" if groups is None else "ijk,ijk->ij", y, y) / count
    mean[...] = m
    var[...] = v
    invstd = 1.0 / np.sqrt(v + dt.type(eps))
    if groups is None:
        y *= (invstd * w)[None, :, None]
    else:
        y *= invstd[:, :, None]
        y = y.reshape(n, c, math.prod(out.shape[2:]))
        y *= w[None, :, None]
    y += b[None, :, None]
    _finish(y, out)


def batchnorm(a, weight, bias, eps, out, mean, var):
    _forward(a, weight, bias, None, eps, out, mean, var)


def groupnorm(a, weight, bias, groups, eps, out, mean, var):
    _forward(a, weight, bias, groups, eps, out, mean, var)


def batchnormeval(a, weight, bias, mean, var, eps, out):
    """y = x * alpha + beta per channel, alpha = weight / sqrt(var + eps) and beta = bias - mean * alpha (torch's CPU
    arithmetic), in one fused pass."""
    c = a.shape[1]
    x = _view(a, c)
    dt = x.dtype
    alpha = _param(weight, dt) / np.sqrt(var.astype(dt) + dt.type(eps))
    beta = _param(bias, dt) - mean.astype(dt) * alpha
    fused([x, alpha[None, :, None], beta[None, :, None]], "in0 * in1 + in2", out.reshape(x.shape))


def _backward(a: np.ndarray, g: np.ndarray, weight: np.ndarray, mean: np.ndarray, var: np.ndarray, eps: float,
              groups: int | None, da: np.ndarray, dweight: np.ndarray, dbias: np.ndarray, batch: bool = True) -> None:
    """batchnormgrad (groups None), with xh = (x - mean) / sqrt(var + eps) written into dA's buffer (where it shares
    none with G, read after), and groupnormgrad, whose dA is one fused pass over G and A."""
    n, c = a.shape[:2]
    x, g3 = _view(a, c), _view(g, c)
    k = x.shape[2]
    dt = x.dtype
    w = _param(weight, dt)
    inv = 1.0 / np.sqrt(var.astype(dt) + dt.type(eps))
    if groups is None:
        xh = _target(da, x, g)
        np.subtract(x, mean.astype(dt)[None, :, None], out=xh)
        xh *= inv[None, :, None]
        db = np.add.reduce(g3, axis=(0, 2))
        dw = np.einsum("ijk,ijk->j", g3, xh)
        count = dt.type(n * k)
        if batch:  # dA = (g - xh dw / n - db / n) w invstd
            xh *= (dw / count)[None, :, None]
            np.subtract(g3, xh, out=xh)
            xh -= (db / count)[None, :, None]
            xh *= (w * inv)[None, :, None]
        else:  # given statistics: dA = g w invstd
            np.multiply(g3, (w * inv)[None, :, None], out=xh)
        _finish(xh, da)
    else:  # torch's way: per-(sample, channel) sums of g and g x, then dA = g A + x B + C in one fused pass
        cg = c // groups
        m_nc, inv_nc = (np.repeat(t.astype(dt), cg, axis=1) for t in (mean, inv))  # (N, C): of each one's group
        per_g = np.add.reduce(g3, axis=2)
        per_gx = inv_nc * (np.einsum("ijk,ijk->ij", g3, x) - m_nc * per_g)  # the sums of g xh
        db, dw = np.add.reduce(per_g, axis=0), np.add.reduce(per_gx, axis=0)
        count = dt.type(cg * k)
        # with d = g w: dA = (d - mean(d) - xh mean(d xh)) invstd, the means over each sample's group
        mean_d = np.repeat((per_g * w).reshape(n, groups, cg).sum(axis=2) / count, cg, axis=1)
        mean_dx = np.repeat((per_gx * w).reshape(n, groups, cg).sum(axis=2) / count, cg, axis=1)
        coeff = [(inv_nc * w)[:, :, None], (-inv_nc * inv_nc * mean_dx)[:, :, None],
                 (inv_nc * (inv_nc * mean_dx * m_nc - mean_d))[:, :, None]]
        fused([g3, coeff[0], x, coeff[1], coeff[2]], "in0 * in1 + in2 * in3 + in4", da.reshape(x.shape))
    dweight[...] = dw
    dbias[...] = db


def batchnormgrad(a, g, weight, mean, var, eps, batch, da, dweight, dbias):
    _backward(a, g, weight, mean, var, eps, None, da, dweight, dbias, bool(batch))


def groupnormgrad(a, g, weight, mean, var, groups, eps, da, dweight, dbias):
    _backward(a, g, weight, mean, var, eps, groups, da, dweight, dbias)


def batchnormupdate(running_mean, running_var, mean, var, momentum, count, out_mean, out_var):
    m = float(momentum)
    unbiased = var.astype(F64) * count / (count - 1)
    out_mean[...] = m * mean.astype(F64) + (1 - m) * running_mean.astype(F64)
    out_var[...] = m * unbiased + (1 - m) * running_var.astype(F64)
