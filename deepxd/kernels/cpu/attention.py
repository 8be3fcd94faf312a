"""Scaled dot-product attention on the CPU, a block of query rows at a time: the scores held at once are (rows of
the block) x keys, never Tq x Tk, so memory stays O(T x block) however long the sequence. 16-bit floats compute in
float32 and round once into the output; float64 in float64.

q (..., Hq, Tq, D), k (..., Hk, Tk, D), v (..., Hk, Tk, Dv): the G = Hq / Hk query heads of a key/value head (1
unless the heads are grouped) are stacked as rows, so every product is one batched GEMM over batch x key heads.
causal: query i sees keys j <= i (torch's is_causal, aligned top-left), so a block of rows up to i1 reads the first
i1 keys only. The forward writes each row's logsumexp (lse), from which the gradient recomputes the probabilities
(FlashAttention-2's scheme): D = rowsum(dO O), P = exp(q k^T scale - lse), dV = P^T dO, dS = P (dO v^T - D),
dQ = dS k scale, dK = dS^T q scale.

maskedattention takes a mask broadcastable to (..., Hq, Tq, Tk) instead of `causal`: bool (True: the key takes part)
or float (added to the scores); a row whose every key is masked gives zeros and lse -inf (torch's safe softmax).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator

import numpy as np

from deepx_core.ir.ops import attention_heads
from deepxd.kernels.cpu._util import F64
from deepxd.kernels.cpu.matmul import matmul

#: score elements per block (8 MiB of float32): the rows of a block, and the batch items of one, are as many as fit
BLOCK = 1 << 21
#: rows per block where causal: the keys after a block's last row are neither multiplied nor exponentiated
CAUSAL_ROWS = 128


def _compute(a: np.ndarray) -> np.ndarray:
    """`a` in the compute dtype: float64 stays, the rest compute in float32."""
    return a if a.dtype == F64 else a.astype(np.float32, copy=False)


def _grouped(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """q as (B, G, Tq, D), k as (B, Tk, D), v as (B, Tk, Dv) in the compute dtype: B = batch x key/value heads, G
    query heads per key/value head."""
    g = attention_heads("attention", q.shape, k.shape, v.shape)
    tk = k.shape[-2]
    b = math.prod(k.shape[:-2])
    return (_compute(q).reshape(b, g, q.shape[-2], q.shape[-1]), _compute(k).reshape(b, tk, k.shape[-1]),
            _compute(v).reshape(b, tk, v.shape[-1]))


def _blocks(b: int, g: int, tq: int, tk: int, causal: bool) -> Iterator[tuple[slice, int, int]]:
    """(batch slice, first row, end row) of each block: as many rows of one batch item as keep its scores under
    BLOCK (at most CAUSAL_ROWS where causal, so that a block reads only the keys up to its last row), then as many
    batch items as still do."""
    per_row = g * max(tk, 1)
    rows = max(1, min(tq, BLOCK // per_row, CAUSAL_ROWS if causal else tq))
    items = max(1, min(b, BLOCK // (rows * per_row)))
    for b0 in range(0, b, items):
        for i0 in range(0, tq, rows):
            yield slice(b0, min(b, b0 + items)), i0, min(tq, i0 + rows)


def _mm(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    out = np.empty((*a.shape[:-1], b.shape[-1]), a.dtype)
    matmul(a, b, out)
    return out


def _keys(causal: bool, tk: int, i1: int) -> int:
    """How many keys a block of rows ending at i1 reads."""
    return min(tk, i1) if causal else tk


def _masked(s: np.ndarray, i0: int, i1: int) -> None:
    """-inf where key j > query i, in scores s (..., rows i0..i1, keys 0..n): only keys i0 + 1 .. n - 1 are after
    some row of the block, so only that corner is touched (an added triangle of -inf: a boolean index is 7x slower)."""
    n = s.shape[-1]
    if n > i0 + 1:
        corner = s[..., i0:]
        np.add(corner, _triangle(i1 - i0, n - i0, s.dtype), out=corner)


@functools.lru_cache(maxsize=64)
def _triangle(rows: int, cols: int, dtype: np.dtype) -> np.ndarray:
    """(rows, cols): -inf where col > row, else 0."""
    return np.where(np.arange(cols) > np.arange(rows)[:, None], -np.inf, 0).astype(dtype)


class _Mask:
    """A mask broadcast to the grouped scores (B, G, Tq, Tk), read a block at a time: a view where the batch and
    key-head dims merge without a copy (a mask shared by all of them, or a whole one), else one batch item at a time."""

    def __init__(self, mask: np.ndarray, q_shape: tuple[int, ...], tk: int, b: int, g: int) -> None:
        tq = q_shape[-2]
        self.rows: np.ndarray | None = None
        if mask.ndim <= 2:  # (Tq or 1, Tk or 1): numpy broadcasts it over a block as it is (broadcast_to costs 30 us)
            self.rows = mask.reshape((1,) * (2 - mask.ndim) + mask.shape)
            return
        lead = (*q_shape[:-3], q_shape[-3] // g) if len(q_shape) >= 3 else ()
        self.m = np.broadcast_to(mask, (*q_shape[:-1], tk)).reshape(*lead, g, tq, tk)
        self.lead = lead
        try:
            self.flat: np.ndarray | None = np.reshape(self.m, (b, g, tq, tk), copy=False)
        except ValueError:
            self.flat = None

    def block(self, bs: slice, i0: int, i1: int, n: int) -> np.ndarray:
        if self.rows is not None:
            r = self.rows
            return r[i0:i1 if r.shape[0] > 1 else 1, :n if r.shape[1] > 1 else 1]
        if self.flat is not None:
            return self.flat[bs, :, i0:i1, :n]
        return np.stack([self.m[np.unravel_index(j, self.lead)][:, i0:i1, :n] for j in range(bs.start, bs.stop)])

    def apply(self, s4: np.ndarray, bs: slice, i0: int, i1: int) -> None:
        """The mask on a block's scores s4 (items, G, rows, keys), in place."""
        mb = self.block(bs, i0, i1, s4.shape[-1])
        if mb.dtype == np.bool_:
            np.copyto(s4, -np.inf, where=np.logical_not(mb))
        else:
            s4 += mb


def attention(q, k, v, scale, causal, out, lse):
    _forward(q, k, v, scale, causal, None, out, lse)


def maskedattention(q, k, v, mask, scale, out, lse):
    _forward(q, k, v, scale, False, mask, out, lse)


def attentiongrad(q, k, v, c, lse, g_out, scale, causal, dq, dk, dv):
    _backward(q, k, v, None, c, lse, g_out, scale, causal, dq, dk, dv)


def maskedattentiongrad(q, k, v, mask, c, lse, g_out, scale, dq, dk, dv):
    _backward(q, k, v, mask, c, lse, g_out, scale, False, dq, dk, dv)


def _forward(q, k, v, scale, causal, mask, out, lse):
    qq, kk, vv = _grouped(q, k, v)
    b, g, tq, d = qq.shape
    tk, dv = kk.shape[1], vv.shape[2]
    o = out.reshape(b, g, tq, dv)
    ls = lse.reshape(b, g, tq)
    if tk == 0:  # no key: nothing to attend to (torch's empty softmax gives zeros)
        o[...] = 0
        ls[...] = -np.inf
        return
    masks = None if mask is None else _Mask(mask, q.shape, tk, b, g)
    for bs, i0, i1 in _blocks(b, g, tq, tk, causal):
        n, r = _keys(causal, tk, i1), i1 - i0
        qb = qq[bs, :, i0:i1].reshape(-1, g * r, d)
        s = _mm(qb, kk[bs, :n].swapaxes(-1, -2))
        s *= scale
        s4 = s.reshape(-1, g, r, n)
        if causal:
            _masked(s4, i0, i1)
        if masks is not None:
            masks.apply(s4, bs, i0, i1)
        m = s4.max(-1, keepdims=True)
        if masks is not None:  # a row with every key masked: exp(-inf - 0) = 0, a sum of 0, lse -inf
            np.copyto(m, 0, where=m == -np.inf)
        s4 -= m
        np.exp(s4, out=s4)
        den = s4.sum(-1, keepdims=True)
        ls[bs, :, i0:i1] = (m + np.log(den))[..., 0]
        if masks is not None:
            np.copyto(den, 1, where=den == 0)  # and zeros for its result
        ob = _mm(s, vv[bs, :n]).reshape(-1, g, r, dv)
        ob /= den
        o[bs, :, i0:i1] = ob


def _backward(q, k, v, mask, c, lse, g_out, scale, causal, dq, dk, dv):
    qq, kk, vv = _grouped(q, k, v)
    b, g, tq, d = qq.shape
    tk, nv = kk.shape[1], vv.shape[2]
    grad_q = dq.reshape(b, g, tq, d)
    if tk == 0:
        grad_q[...] = 0
        return
    ct = qq.dtype
    go = _compute(g_out).reshape(b, g, tq, nv)
    ls = lse.reshape(b, g, tq).astype(ct, copy=False)
    masks = None if mask is None else _Mask(mask, q.shape, tk, b, g)
    if masks is not None:  # rows that saw no key (lse -inf): exp(s - inf) = 0, a zero gradient
        ls = np.where(ls == -np.inf, np.inf, ls)
    dd = np.einsum("bgtd,bgtd->bgt", go, _compute(c).reshape(b, g, tq, nv))  # D = rowsum(dO O)
    acc_k = np.zeros((b, tk, d), ct)
    acc_v = np.zeros((b, tk, nv), ct)
    for bs, i0, i1 in _blocks(b, g, tq, tk, causal):
        n, r = _keys(causal, tk, i1), i1 - i0
        qb = qq[bs, :, i0:i1].reshape(-1, g * r, d)
        gb = go[bs, :, i0:i1].reshape(-1, g * r, nv)
        p = _mm(qb, kk[bs, :n].swapaxes(-1, -2))
        p *= scale
        p4 = p.reshape(-1, g, r, n)
        if causal:
            _masked(p4, i0, i1)
        if masks is not None:
            masks.apply(p4, bs, i0, i1)
        p4 -= ls[bs, :, i0:i1, None]
        np.exp(p4, out=p4)
        acc_v[bs, :n] += _mm(p.swapaxes(-1, -2), gb)
        ds = _mm(gb, vv[bs, :n].swapaxes(-1, -2))
        ds4 = ds.reshape(-1, g, r, n)
        ds4 -= dd[bs, :, i0:i1, None]
        ds *= p
        ds *= scale
        grad_q[bs, :, i0:i1] = _mm(ds, kk[bs, :n]).reshape(-1, g, r, d)
        acc_k[bs, :n] += _mm(ds.swapaxes(-1, -2), qb)
    dk[...] = acc_k.reshape(dk.shape)
    dv[...] = acc_v.reshape(dv.shape)
