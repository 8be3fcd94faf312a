"""Sorting along a dim: the indices that sort (argsort) and the first k of them (argtopk). Stable, with nan the
largest and -0.0 equal to 0.0, as torch's stable sort; low-precision floats are sorted as float32 (exactly)."""

from __future__ import annotations

import numpy as np

from deepxd.kernels.cpu._util import up


def _order(a: np.ndarray, dim: int, descending: bool) -> np.ndarray:
    x = up(a)
    if not descending:
        return np.argsort(x, axis=dim, kind="stable")
    # descending and stable, nan first: ascending over the reversed line, read back to front (ties then keep their
    # order; negating would wrap the most negative integer and keep nan last)
    n = x.shape[dim]
    return n - 1 - np.flip(np.argsort(np.flip(x, dim), axis=dim, kind="stable"), dim)


def argsort(a, dim, descending, out):
    if a.ndim == 0:
        out[...] = 0
        return
    np.copyto(out, _order(a, dim % a.ndim, descending))


def argtopk(a, k, dim, largest, out):
    if a.ndim == 0:
        out[...] = 0
        return
    dim %= a.ndim
    np.copyto(out, np.take(_order(a, dim, largest), np.arange(k), axis=dim))
