"""Shape changes: copies into the preallocated output (the executor makes in-place reshape a view)."""

from __future__ import annotations

import builtins

import numpy as np

from deepx_core.errors import DeepxError
from deepxd.kernels.cpu._util import F32, LOW, fill, up


def reshape(a, shape, out):
    out[...] = a.reshape(out.shape)


def transpose(a, perm, out):
    np.copyto(out, a.transpose(perm))


def concat(tensors, dim, out):
    np.concatenate(tensors, axis=dim % out.ndim, out=out)


def broadcastTo(a, shape, out):
    np.copyto(out, a)


def _check_index(op: str, index: np.ndarray, size: int, axis: int, what: str = "axis") -> None:
    if index.size and (index.min() < 0 or index.max() >= size):
        bad = index[(index < 0) | (index >= size)].flat[0]
        raise DeepxError(f"{op}: index {bad} out of range for {what} {axis} of size {size}")


def indexselect(a, index, axis, out):
    axis %= a.ndim
    _check_index("indexselect", index, a.shape[axis], axis)
    if out is a:  # np.take does not buffer in wrap mode
        a = a.copy()
    np.take(a, index, axis=axis, out=out, mode="wrap")


def indexadd(a, index, src, axis, out):
    axis %= a.ndim
    _check_index("indexadd", index, a.shape[axis], axis)
    if src is out:
        src = src.copy()
    low = out.dtype in LOW
    acc = a.astype(F32) if low else out
    if not low and out is not a:
        out[...] = a
    flat = index.reshape(-1)
    src = src.reshape(*a.shape[:axis], flat.size, *a.shape[axis + 1:])
    if axis == 0 and a.ndim == 2 and flat.size:
        # sum rows that share an index with one sort, then one fancy-indexed add: far faster than np.add.at
        order = np.argsort(flat, kind="stable")
        keys, starts = np.unique(flat[order], return_index=True)
        acc[keys] += np.add.reduceat(up(src)[order], starts, axis=0).astype(acc.dtype, copy=False)
    else:
        np.add.at(acc, (builtins.slice(None),) * axis + (flat,), up(src))
    if low:
        out[...] = acc


def indexcopy(a, index, src, axis, out):
    axis %= a.ndim
    _check_index("indexcopy", index, a.shape[axis], axis)
    index, src = _apart(out, index, src)
    if out is not a:
        out[...] = a
    flat = index.reshape(-1)
    out[(builtins.slice(None),) * axis + (flat,)] = src.reshape(*a.shape[:axis], flat.size, *a.shape[axis + 1:])


def _along(op: str, a: np.ndarray, index: np.ndarray, dim: int) -> tuple[np.ndarray, ...]:
    """The index tuple that picks, for every element of `index`, A's element at it along dim and at the element's own
    position in the other dims (A's 0-d: the one element). Refuses an index outside [0, size)."""
    if a.ndim == 0:
        _check_index(op, index, 1, 0, "dim")
        return ()
    dim %= a.ndim
    _check_index(op, index, a.shape[dim], dim, "dim")
    return tuple(index if d == dim else
                 np.arange(n).reshape((1,) * d + (n,) + (1,) * (index.ndim - d - 1))
                 for d, n in enumerate(index.shape))


def _apart(out: np.ndarray, *xs: np.ndarray) -> list[np.ndarray]:
    """The inputs, each copied where it shares memory with the output (which is written first)."""
    return [x.copy() if np.may_share_memory(x, out) else x for x in xs]


def gather(a, index, dim, out):
    at = _along("gather", a, index, dim)
    out[...] = a[at] if at else a


def scatter(a, index, src, dim, out):
    index, src = _apart(out, index, src)
    at = _along("scatter", a, index, dim)
    if out is not a:
        out[...] = a
    if index.size:
        out[at] = src


def scatteradd(a, index, src, dim, out):
    index, src = _apart(out, index, src)
    at = _along("scatteradd", a, index, dim)
    low = out.dtype in LOW
    acc = a.astype(F32) if low else out
    if not low and out is not a:
        out[...] = a
    if index.size:
        np.add.at(acc, at, up(src))
    if low:
        out[...] = acc


def repeat(a, reps, out):
    out[...] = np.tile(a, reps)


def _slices(starts, ends, steps):
    return tuple(builtins.slice(b, e, s) for b, e, s in zip(starts, ends, steps))


def slice(a, starts, ends, steps, out):
    out[...] = a[_slices(starts, ends, steps)]


def sliceassign(a, starts, ends, steps, v, out):
    if v is out:
        v = v.copy()
    if out is not a:
        out[...] = a
    out[_slices(starts, ends, steps)] = v


def pad(a, pads, value, out):
    if out is a:
        a = a.copy()
    fill(out, value)
    out[tuple(builtins.slice(pads[2 * i], pads[2 * i] + d) for i, d in enumerate(a.shape))] = a

