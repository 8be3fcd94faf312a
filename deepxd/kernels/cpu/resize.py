"""Resizing as torch's interpolate on the CPU: nearest and bilinear over the last two dims of (N, C, H, W), one dim at
a time (both are separable). The source positions and weights are torch's, in its arithmetic: float32 for every dtype
but float64 (nearest: always float32), `index_weights`. The gradients add each output's gradient back to its sources:
the source indices never decrease along a dim, so the outputs that share one are neighbours, gathered a run's k-th
at a time (`_add_back`).
"""

from __future__ import annotations

import numpy as np

from deepxd.kernels.cpu._util import F32, F64
from deepxd.kernels.cpu._util import work as _work


def _scale(n_in: int, n_out: int, factor: float, dt: np.dtype) -> np.floating:
    """torch's compute_scales_value: 1 / the scale factor given, else the sizes' ratio, in dt."""
    return dt.type(1.0 / factor) if factor > 0 else dt.type(n_in) / dt.type(n_out)


def nearest_index(n_in: int, n_out: int, factor: float) -> np.ndarray:
    """The source index of each output along one dim, as torch's mode='nearest' finds it for a 4-D input (nearest_idx:
    a size that stays, or doubles, is copied or halved whatever the scale factor)."""
    dst = np.arange(n_out)
    if n_out == n_in:
        return dst
    if n_out == 2 * n_in:
        return dst >> 1
    pos = dst.astype(F32) * _scale(n_in, n_out, factor, F32)
    return np.minimum(np.floor(pos).astype(np.int64), n_in - 1)


def linear_weights(n_in: int, n_out: int, align_corners: bool, factor: float, dt: np.dtype
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(lo, hi, w_lo, w_hi) along one dim, as torch's linear modes find them: output i reads lo[i] and hi[i] (lo + 1,
    or lo at the last row) with weights w_lo = 1 - w_hi and w_hi, in dt (float64 or float32). A dim whose size stays
    is copied, whatever the scale factor (as torch's)."""
    dst = np.arange(n_out).astype(dt)
    if n_in == n_out:
        same = np.arange(n_out)
        return same, same, np.ones(n_out, dt), np.zeros(n_out, dt)
    if align_corners:
        scale = dt.type(n_in - 1) / dt.type(n_out - 1) if n_out > 1 else dt.type(0)
        pos = scale * dst
    else:
        scale = _scale(n_in, n_out, factor, dt)
        if dt == F32:  # torch's compiled code fuses the multiply-add (one rounding): exact in float64, then rounded
            pos = (np.float64(scale) * (dst.astype(F64) + 0.5) - 0.5).astype(F32)
        else:
            pos = scale * (dst + 0.5) - 0.5
        pos = np.maximum(pos, dt.type(0))
    lo = np.minimum(np.floor(pos).astype(np.int64), n_in - 1)
    frac = np.clip(pos - lo.astype(dt), dt.type(0), dt.type(1))
    hi = np.where(lo < n_in - 1, lo + 1, lo)
    return lo, hi, dt.type(1) - frac, frac


def _shape(w: np.ndarray, axis: int) -> np.ndarray:
    """Weights along `axis` of a 4-D array, broadcast over the others."""
    return w.reshape((-1, 1) if axis == 2 else (-1,))


def _add_back(g: np.ndarray, reads: list[tuple[np.ndarray, np.ndarray | None]], axis: int, n_in: int,
              out: np.ndarray | None = None) -> np.ndarray:
    """For each source index along `axis`, the sum of g (times its weight) over the outputs that read it, for each
    (index, weight) read (bilinear's lo and hi), into `out` (or a new array). The outputs of one source are a run of
    neighbours (the indices never decrease): the k-th of every run is gathered at once (np.take), for k up to the
    longest run, and added in the outputs' order; a source with fewer reads the zero slot past g's end. Three
    buffers in all: an activation-sized temporary is fresh memory every step, whose page faults cost the most."""
    n_out = g.shape[axis]
    padded = list(g.shape)
    padded[axis] = n_out + 1
    ext = np.empty(padded, g.dtype)
    cut = [slice(None)] * 4
    cut[axis] = slice(0, n_out)
    body = ext[tuple(cut)]
    cut[axis] = slice(n_out, n_out + 1)
    ext[tuple(cut)] = 0
    full = list(g.shape)
    full[axis] = n_in
    sources = np.arange(n_in)
    tmp: np.ndarray | None = None
    started = False
    for index, weight in reads:
        if weight is None:
            body[...] = g
        else:
            np.multiply(g, _shape(weight, axis), out=body)
        starts = np.searchsorted(index, sources, "left")
        counts = np.searchsorted(index, sources, "right") - starts
        for k in range(int(counts.max(initial=0))):
            at = np.where(counts > k, starts + k, n_out)
            if not started:
                out = np.empty(full, g.dtype) if out is None else out
                np.take(ext, at, axis=axis, out=out)
                started = True
            else:
                tmp = np.empty(full, g.dtype) if tmp is None else tmp
                np.take(ext, at, axis=axis, out=tmp)
                out += tmp  # type: ignore[operator]
    if out is None:
        return np.zeros(full, g.dtype)
    if not started:
        out[...] = 0
    return out


def interpnearest(a, size, scale_h, scale_w, out):
    h, w = a.shape[2:]
    rows = np.take(a, nearest_index(w, int(size[1]), scale_w), axis=3)
    np.take(rows, nearest_index(h, int(size[0]), scale_h), axis=2, out=out)


def interpnearestgrad(g, input_shape, scale_h, scale_w, out):
    h, w = (int(d) for d in input_shape[2:])
    oh, ow = g.shape[2:]
    dt = _compute(g.dtype)
    gw = _work(g).astype(dt, copy=False)
    part = _add_back(gw, [(nearest_index(w, ow, scale_w), None)], 3, w)
    grad = _add_back(part, [(nearest_index(h, oh, scale_h), None)], 2, h, out if out.dtype == dt else None)
    if grad is not out:
        out[...] = grad


def _compute(dtype: np.dtype) -> np.dtype:
    return F64 if dtype == F64 else F32


def interpbilinear(a, size, align_corners, scale_h, scale_w, out):
    h, w = a.shape[2:]
    dt = _compute(a.dtype)
    x = _work(a).astype(dt, copy=False)
    lo, hi, wlo, whi = linear_weights(w, int(size[1]), bool(align_corners), scale_w, dt)
    t = np.take(x, lo, axis=3)
    t *= wlo
    far = np.take(x, hi, axis=3)
    far *= whi
    t += far
    lo, hi, wlo, whi = linear_weights(h, int(size[0]), bool(align_corners), scale_h, dt)
    y = out if out.dtype == dt else np.empty(out.shape, dt)
    np.take(t, lo, axis=2, out=y)
    y *= wlo[:, None]
    far = np.take(t, hi, axis=2)
    far *= whi[:, None]
    y += far
    if y is not out:
        out[...] = y


def interpbilineargrad(g, input_shape, align_corners, scale_h, scale_w, out):
    h, w = (int(d) for d in input_shape[2:])
    oh, ow = g.shape[2:]
    dt = _compute(g.dtype)
    gw = _work(g).astype(dt, copy=False)
    lo, hi, wlo, whi = linear_weights(h, oh, bool(align_corners), scale_h, dt)
    part = _add_back(gw, [(lo, wlo), (hi, whi)], 2, h)
    lo, hi, wlo, whi = linear_weights(w, ow, bool(align_corners), scale_w, dt)
    grad = _add_back(part, [(lo, wlo), (hi, whi)], 3, w, out if out.dtype == dt else None)
    if grad is not out:
        out[...] = grad

