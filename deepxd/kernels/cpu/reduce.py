"""Reductions over dims (empty dims: all) and running sums along one. Low-precision floats and small integers
accumulate wider, then round."""

from __future__ import annotations

import numpy as np

from deepxd.kernels.cpu import native
from deepxd.kernels.cpu._util import F32, LOW

_F64, _F32 = np.dtype(np.float64), np.dtype(np.float32)


def _acc(a: np.ndarray):
    dt = a.dtype
    if dt is _F32 or dt is _F64:
        return None
    if dt in LOW:
        return F32
    if dt.kind in "iu":
        return np.int64
    return None


def _dims(a, dims):
    if not dims:
        return None
    for d in dims:
        if d < 0:
            return tuple(x % a.ndim for x in dims)
    return dims


def _leading(a: np.ndarray, dims) -> int:
    """k when dims are a's first k axes (not all of them), else 0."""
    if not dims or len(dims) >= a.ndim:
        return 0
    k = len(dims)
    return k if sorted(d % a.ndim for d in dims) == list(range(k)) else 0


def sum(a, dims, keepdims, out):
    acc = _acc(a)
    if acc is None:
        # a bias's gradient, every training step: summed over the leading axes by a C loop, in numpy's order
        k = _leading(a, dims)
        if k and a.size >= native.COLSUM_MIN and native.colsum(a, k, out):
            return
        np.sum(a, axis=_dims(a, dims), keepdims=keepdims, out=out)
    else:
        np.copyto(out, np.sum(a, axis=_dims(a, dims), keepdims=keepdims, dtype=acc), casting="unsafe")


def prod(a, dims, keepdims, out):
    acc = _acc(a)
    if acc is None:
        np.multiply.reduce(a, axis=_dims(a, dims), keepdims=keepdims, out=out)
    else:
        np.copyto(out, np.prod(a, axis=_dims(a, dims), keepdims=keepdims, dtype=acc), casting="unsafe")


def reducemax(a, dims, keepdims, out):
    out[...] = np.max(a if a.dtype not in LOW else a.astype(F32), axis=_dims(a, dims), keepdims=keepdims)


def reducemin(a, dims, keepdims, out):
    out[...] = np.min(a if a.dtype not in LOW else a.astype(F32), axis=_dims(a, dims), keepdims=keepdims)


def argmax(a, dim, keepdims, out):
    if a.ndim == 0:
        out[...] = 0
    else:
        out[...] = np.argmax(a if a.dtype not in LOW else a.astype(F32), axis=dim % a.ndim, keepdims=keepdims)


def argmin(a, dim, keepdims, out):
    if a.ndim == 0:
        out[...] = 0
    else:
        out[...] = np.argmin(a if a.dtype not in LOW else a.astype(F32), axis=dim % a.ndim, keepdims=keepdims)


def _scan_acc(a: np.ndarray):
    """What cumsum adds in: float32 in float64 (torch's CPU kernel does), low precision in float32, ints in int64."""
    if a.dtype in LOW:
        return F32
    if a.dtype.kind in "iu":
        return np.int64
    return _F64


def cumsum(a, dim, reverse, out):
    if a.ndim == 0:
        out[...] = a
        return
    dim %= a.ndim
    x = np.flip(a, dim) if reverse else a
    sums = np.cumsum(x, axis=dim, dtype=_scan_acc(a))
    np.copyto(out, np.flip(sums, dim) if reverse else sums, casting="unsafe")


def cumprod(a, dim, out):
    if a.ndim == 0:
        out[...] = a
        return
    np.copyto(out, np.cumprod(a, axis=dim % a.ndim, dtype=_scan_acc(a)), casting="unsafe")


def cumprodgrad(a, g, dim, out):
    """torch's formula: with P the running products, dA[i] = (the sum over j >= i of g[j] P[j]) / A[i] before the
    first zero z of a slice; at z, P[z - 1] times the sum over j >= z of g[j] Q[j], Q the running products of the
    values after z; 0 after z."""
    if a.ndim == 0 or a.size == 0:
        out[...] = g
        return
    dim %= a.ndim
    acc = _scan_acc(a)
    x, gw = a.astype(acc), g.astype(acc)
    n = x.shape[dim]
    at = np.arange(n).reshape([n if d == dim else 1 for d in range(x.ndim)])
    zero = x == 0
    z = np.where(zero.any(axis=dim, keepdims=True), np.argmax(zero, axis=dim, keepdims=True), n)
    p = np.cumprod(x, axis=dim)
    tail = np.flip(np.cumsum(np.flip(gw * p, dim), axis=dim), dim)
    before = at < z
    grad = np.where(before, tail / np.where(before, x, 1), 0)
    if zero.any():
        q = np.cumprod(np.where(at <= z, 1, x), axis=dim)
        first = np.sum(np.where(at >= z, gw * q, 0), axis=dim, keepdims=True)
        lead = np.take_along_axis(p, np.maximum(z - 1, 0), axis=dim)
        lead = np.where(z > 0, lead, 1)
        grad = np.where(at == z, first * lead, grad)
    np.copyto(out, grad, casting="unsafe")
