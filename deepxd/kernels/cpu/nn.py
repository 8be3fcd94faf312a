"""Activations, softmax, losses and norms: numerically stable, computed in float32 (float64 for float64 inputs)."""

from __future__ import annotations

import itertools
import math

import numpy as np
from numpy.polynomial import Chebyshev

from deepx_sdk.errors import DeepxError
from deepxd.kernels.cpu._util import F32, F64, LOW


def _work(a: np.ndarray) -> np.ndarray:
    return a.astype(F32) if a.dtype in LOW else a


def relu(a, out):
    np.maximum(a, 0, out=out) if out.dtype not in LOW else out.__setitem__(..., np.maximum(_work(a), 0))


def _sigmoid(x: np.ndarray) -> np.ndarray:
    """1/(1+exp(-x)) with full relative precision in both tails: exp of -|x| never overflows."""
    e = np.exp(-np.abs(x))
    r = 1.0 / (1.0 + e)
    return np.where(x >= 0, r, e * r)


def sigmoid(a, out):
    out[...] = _sigmoid(_work(a))


def tanh(a, out):
    out[...] = np.tanh(_work(a))


# erf on [0, 6] as four Chebyshev pieces fitted to math.erf at import (max error 5e-15); erf(x) = 1 beyond 6
_ERF_EDGES = (0.0, 1.5, 3.0, 4.5, 6.0)
_ERF_PIECES = [
    Chebyshev.interpolate(np.vectorize(math.erf), 24, domain=[lo, hi])
    for lo, hi in itertools.pairwise(_ERF_EDGES)
]


def _erf(x: np.ndarray) -> np.ndarray:
    ax = np.abs(x)
    y = np.ones_like(ax)
    piece = np.minimum((ax * (1 / 1.5)).astype(np.int8), 4)
    for k, p in enumerate(_ERF_PIECES):
        sel = piece == k
        if sel.any():
            y[sel] = p(ax[sel])
    return np.copysign(y, x)


def gelu(a, approximate, out):
    x = _work(a)
    if approximate == "tanh":
        out[...] = 0.5 * x * (1.0 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x * x * x)))
    elif approximate == "none":
        out[...] = 0.5 * x * (1.0 + _erf(x * (1 / math.sqrt(2))))
    else:
        raise DeepxError(f"gelu: approximate must be 'none' or 'tanh', got {approximate!r}")


def erf(a, out):
    out[...] = _erf(_work(a))


def silu(a, out):
    x = _work(a)
    out[...] = x * _sigmoid(x)


def _shifted(x: np.ndarray, dim: int) -> np.ndarray:
    m = np.max(x, axis=dim, keepdims=True) if x.size else np.zeros_like(x)
    m[~np.isfinite(m)] = 0
    return x - m


def softmax(a, dim, out):
    if a.ndim == 0:
        out[...] = 1
        return
    e = np.exp(_shifted(_work(a), dim))
    e /= np.sum(e, axis=dim, keepdims=True)
    out[...] = e


def _logsoftmax(x: np.ndarray, dim: int) -> np.ndarray:
    s = _shifted(x, dim)
    return s - np.log(np.sum(np.exp(s), axis=dim, keepdims=True))


def logsoftmax(a, dim, out):
    if a.ndim == 0:
        out[...] = 0
        return
    out[...] = _logsoftmax(_work(a), dim)


def _reduce(op: str, values: np.ndarray, count: int | float, reduction: str) -> np.ndarray | float:
    if reduction == "none":
        return values
    total = values.sum(dtype=F64 if values.dtype == F64 else F32)
    return total / count if reduction == "mean" else total


def crossentropy(logits, labels, ignore_index, reduction, out):
    n, c = logits.shape
    keep = labels != ignore_index
    bad = keep & ((labels < 0) | (labels >= c))
    if bad.any():
        raise DeepxError(f"crossentropy: label {labels[bad][0]} out of range for {c} classes")
    lsm = _logsoftmax(_work(logits), 1) if n else _work(logits)
    safe = np.where(keep, labels, 0)
    picked = -np.take_along_axis(lsm, safe[:, None].astype(np.intp), 1)[:, 0] * keep
    out[...] = _reduce("crossentropy", picked, keep.sum() if reduction == "mean" else 1, reduction)


def mse(a, b, reduction, out):
    d = _work(a) - _work(b)
    sq = d * d
    out[...] = _reduce("mse", sq.reshape(-1) if reduction != "none" else sq, sq.size, reduction)


def _axes(a: np.ndarray, w: np.ndarray) -> tuple[int, ...]:
    return tuple(range(a.ndim - w.ndim, a.ndim))


def layernorm(a, weight, bias, eps, out):
    x = _work(a)
    axes = _axes(a, weight)
    mean = np.mean(x, axis=axes, keepdims=True)
    xc = x - mean
    var = np.mean(xc * xc, axis=axes, keepdims=True)
    xc *= 1.0 / np.sqrt(var + eps)
    xc *= _work(weight)
    xc += _work(bias)
    out[...] = xc


def rmsnorm(a, weight, eps, out):
    x = _work(a)
    axes = _axes(a, weight)
    ms = np.mean(x * x, axis=axes, keepdims=True)
    out[...] = x * (1.0 / np.sqrt(ms + eps)) * _work(weight)
