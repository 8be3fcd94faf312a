"""Comparisons into bool tensors, and switch (select by case)."""

from __future__ import annotations

import numpy as np

from deepx_core.errors import DeepxError
from deepxd.kernels.cpu._util import F64, up


def less(a, b, out):
    np.less(up(a), up(b), out=out)


def greater(a, b, out):
    np.greater(up(a), up(b), out=out)


def _wide(a):
    return a.astype(np.int64) if a.dtype.kind in "iu" else up(a)


def lessscalar(a, s, out):
    np.less(_wide(a) if type(s) is int else up(a), s, out=out)


def greaterscalar(a, s, out):
    np.greater(_wide(a) if type(s) is int else up(a), s, out=out)


def _close(a, b, eps, out):
    if not eps:
        np.equal(up(a), b if np.isscalar(b) else up(b), out=out)
    else:
        np.less_equal(np.abs(a.astype(F64) - (np.asarray(b, dtype=F64))), eps, out=out)


def equal(a, b, eps, out):
    _close(a, b, eps, out)


def notequal(a, b, eps, out):
    _close(a, b, eps, out)
    np.logical_not(out, out=out)


def equalscalar(a, s, eps, out):
    _close(a, s, eps, out)


def notequalscalar(a, s, eps, out):
    _close(a, s, eps, out)
    np.logical_not(out, out=out)


def switch(tensors, cases, out):
    n = len(tensors)
    idx = cases.astype(np.intp) if cases.dtype == np.bool_ else cases
    if idx.size and (idx.min() < 0 or idx.max() >= n):
        bad = idx[(idx < 0) | (idx >= n)].flat[0]
        raise DeepxError(f"switch: case {bad} out of range for a list of {n} tensors")
    if n <= 32:
        np.choose(idx, tensors, out=out)
    else:
        stacked = np.stack(np.broadcast_arrays(*tensors, idx)[:-1])
        out[...] = np.take_along_axis(stacked, np.broadcast_to(idx, stacked.shape[1:])[None], 0)[0]
