"""Activations, softmax, losses and norms: numerically stable, computed in float32 (float64 for float64 inputs).
erf, gelu and gelu's gradient run on native vectorised kernels where they are built (native.special: float32
evaluates in float32, to a few units in the last place; docs/compiler.md, "erf and gelu"), else on the numpy code
below, which evaluates in float64 for every dtype and rounds once into the output."""

from __future__ import annotations

import math

import numpy as np

from deepx_core.cache import Cache
from deepx_core.errors import DeepxError
from deepxd.kernels.cpu import fused, native
from deepxd.kernels.cpu._util import F32, F64, LOW
from deepxd.kernels.cpu._util import work as _work


def relu(a, out):
    if out.dtype in LOW:
        out[...] = np.maximum(_work(a), 0)
    elif out.size < native.RELU_MIN or not native.relu(a, out):  # numpy's float maximum checks for NaN, slowly
        np.maximum(a, 0, out=out)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    """1/(1+exp(-x)) with full relative precision in both tails: exp of -|x| never overflows."""
    e = np.exp(-np.abs(x))
    r = 1.0 / (1.0 + e)
    return np.where(x >= 0, r, e * r)


def sigmoid(a, out):
    out[...] = _sigmoid(_work(a))


def tanh(a, out):
    out[...] = np.tanh(_work(a))


# erf and exact gelu: W. J. Cody's rational approximations (Math. Comp. 23 (1969) 631-637; netlib specfun CALERF),
# evaluated in float64 whatever the input (float32 evaluation was 4 ulp off and hardly faster): max relative error
# about 5e-16 against math.erf, and erfc = exp(-y*y) * R(y) keeps its relative precision far into the tail, which
# gelu uses for x < 0 (no cancellation in 1 + erf). Cache-sized blocks; each block's elements are gathered by region.
_ERF_A = (3.16112374387056560e00, 1.13864154151050156e02, 3.77485237685302021e02, 3.20937758913846947e03,
          1.85777706184603153e-1)
_ERF_B = (2.36012909523441209e01, 2.44024637934444173e02, 1.28261652607737228e03, 2.84423683343917062e03)
_ERF_C = (5.64188496988670089e-1, 8.88314979438837594e00, 6.61191906371416295e01, 2.98635138197400131e02,
          8.81952221241769090e02, 1.71204761263407058e03, 2.05107837782607147e03, 1.23033935479799725e03,
          2.15311535474403846e-8)
_ERF_D = (1.57449261107098347e01, 1.17693950891312499e02, 5.37181101862009858e02, 1.62138957456669019e03,
          3.29079923573345963e03, 4.36261909014324716e03, 3.43936767414372164e03, 1.23033935480374942e03)
_ERF_P = (3.05326634961232344e-1, 3.60344899949804439e-1, 1.25781726111229246e-1, 1.60837851487422766e-2,
          6.58749161529837803e-4, 1.63153871373020978e-2)
_ERF_Q = (2.56852019228982242e00, 1.87295284992346725e00, 5.27905102951428412e-1, 6.05183413124413191e-2,
          2.33520497626869185e-3)
_ERF_SMALL = 0.46875  # |x| below: erf = x P(x^2) / Q(x^2); above: erfc = exp(-x^2) R(|x|)
_ERF_MID = 4.0  # |x| above: erfc = exp(-x^2) / |x| (1/sqrt(pi) + S(1/x^2) / x^2)
_ERF_BLOCK = 1 << 15


def _rational(t: np.ndarray, num: tuple[float, ...], den: tuple[float, ...]) -> np.ndarray:
    """Cody's ratio in t: num[k] t^k + num[0] t^(k-1) + ... + num[k-1] over t^k + den[0] t^(k-1) + ... + den[k-1]
    (k = len(den)), by Horner in place."""
    k = len(den)
    n = t * num[k]
    d = t.copy()
    for a, b in zip(num[:k - 1], den[:k - 1]):
        n += a
        n *= t
        d += b
        d *= t
    n += num[k - 1]
    d += den[k - 1]
    n /= d
    return n


def _erf_small(y: np.ndarray) -> np.ndarray:
    """erf(y) for |y| < 0.46875 (sign kept)."""
    n = _rational(y * y, _ERF_A, _ERF_B)
    n *= y
    return n


def _exp_neg_sq(v: np.ndarray, c: float | None) -> np.ndarray:
    """exp(-c v^2) without the error of rounding v^2: v = h + l with h a multiple of 1/16, so c h^2 is exact;
    exp(-c h^2) exp(-c (v-h)(v+h)). v <= 60 (exp(-1800) is 0 already)."""
    if c is None:  # erf: 1 - erfc needs erfc only to an absolute 1e-17, so plain exp(-v^2)
        h = v * v
        np.negative(h, out=h)
        return np.exp(h, out=h)
    h = np.trunc(v * 16.0)
    h *= 1 / 16
    e = v - h
    e *= v + h
    e *= -c
    np.exp(e, out=e)
    h *= h
    h *= -c
    np.exp(h, out=h)
    e *= h
    return e


def _erfc_mid(y: np.ndarray, v: np.ndarray, c: float | None) -> np.ndarray:
    """erfc(y) for 0.46875 <= y <= 4, given v with c v^2 = y^2 (v = y, c = None: erf; or for gelu v = |x|, c = 1/2)."""
    n = _rational(y, _ERF_C, _ERF_D)
    n *= _exp_neg_sq(v, c)
    return n


def _erfc_tail(y: np.ndarray, v: np.ndarray, c: float | None) -> np.ndarray:
    """erfc(y) for y > 4, inf (0) and nan; v and c as for _erfc_mid."""
    t = 1.0 / (y * y)
    n = _rational(t, _ERF_P, _ERF_Q)
    n *= t
    np.subtract(1 / math.sqrt(math.pi), n, out=n)
    n /= y
    n *= _exp_neg_sq(np.minimum(v, 60.0), c)  # exp(-1800) is 0: no inf * 0 for y = inf
    return n


def _erfc_big(y: np.ndarray, v: np.ndarray, c: float | None) -> np.ndarray:
    """erfc(y) for y >= 0.46875, inf and nan: the mid form up to 4, the tail form above (rare: only when present)."""
    tail = y > _ERF_MID  # nan is not: the mid form keeps it
    if not tail.any():
        return _erfc_mid(y, v, c)
    r = np.empty_like(y)
    for idx, fn in ((np.flatnonzero(~tail), _erfc_mid), (np.flatnonzero(tail), _erfc_tail)):
        if idx.size:
            r[idx] = fn(y[idx], v[idx], c)
    return r


def _erf_into(x: np.ndarray, out: np.ndarray, gelu: bool) -> None:
    """out = erf(x), or gelu(x) = x/2 (1 + erf(x/sqrt 2)); x and out flat and contiguous (they may be one array).

    Per block: the elements of each region are gathered (np.flatnonzero and take, much faster than masked ufuncs),
    evaluated densely, and put back; a block wholly in one region skips the gather.
    """
    n = x.size
    c = 0.5 if gelu else None
    with np.errstate(all="ignore"):
        for s in range(0, n, _ERF_BLOCK):
            xb = x[s:s + _ERF_BLOCK].astype(F64)
            z = xb * (1 / math.sqrt(2)) if gelu else xb
            y = np.abs(z)
            small = y < _ERF_SMALL
            i_s = np.flatnonzero(small)
            if i_s.size == y.size:
                r = _erf_small(z)
                if gelu:
                    r += 1.0
            else:
                whole = i_s.size == 0
                i_b = None if whole else np.flatnonzero(~small)
                zb, yb = (z, y) if whole else (z[i_b], y[i_b])
                vb = (np.abs(xb) if whole else np.abs(xb[i_b])) if gelu else yb
                e = _erfc_big(yb, vb, c)
                if gelu:  # 1 + erf(z) = erfc(|z|) for z < 0 (no cancellation), 2 - erfc(|z|) for z > 0
                    e = np.where(zb > 0, 2.0 - e, e)
                else:
                    np.subtract(1.0, e, out=e)
                    np.copysign(e, zb, out=e)
                if whole:
                    r = e
                else:
                    r = np.empty_like(y)
                    r[i_b] = e
                    es = _erf_small(z[i_s])
                    if gelu:
                        es += 1.0
                    r[i_s] = es
            if gelu:
                r *= xb
                r *= 0.5
            out[s:s + _ERF_BLOCK] = r


def _erf_kernel(a: np.ndarray, out: np.ndarray, gelu: bool) -> None:
    """erf or gelu of `a` into `out`; large arrays are split between the fused kernels' threads (numpy releases the
    GIL inside its loops)."""
    x = np.ascontiguousarray(a).reshape(-1)
    o = out.reshape(-1) if out.flags.c_contiguous else np.empty(out.size, out.dtype)
    if np.may_share_memory(x, o) and x.__array_interface__["data"][0] != o.__array_interface__["data"][0]:
        x = x.copy()  # a partial overlap: one block could read what another wrote
    ranges = fused._split(x.size)
    if len(ranges) == 1:
        _erf_into(x, o, gelu)
    else:
        for f in [fused._threads().submit(_erf_into, x[lo:hi], o[lo:hi], gelu) for lo, hi in ranges]:
            f.result()
    if not out.flags.c_contiguous:
        out[...] = o.reshape(out.shape)


def _erf(x: np.ndarray) -> np.ndarray:
    """erf(x) in x's dtype (float64 evaluation, rounded once)."""
    out = np.empty(x.shape, x.dtype)
    _erf_kernel(x, out, False)
    return out


def _special(name: str, ins: tuple[np.ndarray, ...], out: np.ndarray) -> bool:
    """native.special's kernel `name` of `ins` into `out`: float32 and float64 as they are, the 16-bit floats through
    float32 (rounded once into `out`); False where it does not run (numpy must)."""
    if not native.enabled():
        return False
    dt = F64 if out.dtype == F64 else F32
    if out.dtype != dt and out.dtype not in LOW:
        return False
    xs = tuple(np.ascontiguousarray(a, dtype=dt).reshape(-1) for a in ins)
    o = out if out.dtype == dt and out.flags.c_contiguous else np.empty(out.shape, dt)
    if not native.special(name, xs, o.reshape(-1)):
        return False
    if o is not out:
        out[...] = o
    return True


def _approximation(op: str, approximate: str) -> bool:
    """Whether gelu's `approximate` is its tanh form ('tanh') or exact ('none'); DeepxError for anything else."""
    if approximate not in ("none", "tanh"):
        raise DeepxError(f"{op}: approximate must be 'none' or 'tanh', got {approximate!r}")
    return approximate == "tanh"


def gelu(a, approximate, out):
    tanh_form = _approximation("gelu", approximate)
    if _special("gelutanh" if tanh_form else "gelu", (a,), out):
        return
    if tanh_form:  # x (1 + tanh(u))/2 as x / (1 + exp(-2u)): no cancellation below 0
        x = _work(a)
        with np.errstate(over="ignore"):
            out[...] = x / (1.0 + np.exp(-2 * math.sqrt(2 / math.pi) * (x + 0.044715 * x * x * x)))
    else:
        _erf_kernel(a, out, True)


def gelugrad(a, g, approximate, out):
    """dA = g (Phi(A) + A phi(A)) for gelu's A and the gradient g of its output (the tanh form's derivative for
    'tanh'). On numpy: Phi(A) as gelu(A)/A (gelu's erfc form keeps the negative tail's precision), in float64 for
    every dtype, rounded once."""
    tanh_form = _approximation("gelugrad", approximate)
    if _special("gelutanhgrad" if tanh_form else "gelugrad", (a, g), out):
        return
    x = np.asarray(a, dtype=F64)
    with np.errstate(all="ignore"):
        if tanh_form:  # s + 2 x u' s (1 - s), s = (1 + tanh(u))/2 = 1/(1 + E), E = exp(-2u), 1 - s = E s
            k = math.sqrt(2 / math.pi)
            e = np.exp(-2 * k * (x + 0.044715 * x ** 3))
            s = 1.0 / (1.0 + e)
            c = np.where(e < 1, e * s, 1.0 - s)
            d = s + np.where(c == 0, 0.0 * x, 2 * x * k * (1.0 + 3 * 0.044715 * x * x) * s * c)
        else:
            y = np.empty_like(x)
            _erf_kernel(x, y, True)
            cdf = np.where(x == 0, 0.5, y / np.where(x == 0, 1.0, x))
            d = cdf + x * np.exp(-0.5 * x * x) * (1 / math.sqrt(2 * math.pi))
        out[...] = np.asarray(g, dtype=F64) * d


def erf(a, out):
    if not _special("erf", (a,), out):
        _erf_kernel(a, out, False)


def silu(a, out):
    x = _work(a)
    out[...] = x * _sigmoid(x)


def _shifted(x: np.ndarray, dim: int) -> np.ndarray:
    m = np.max(x, axis=dim, keepdims=True) if x.size else np.zeros_like(x)
    finite = np.isfinite(m)
    if not finite.all():  # a row of infs (or NaN) is not shifted by them
        m[~finite] = 0
    return x - m


def softmax(a, dim, out):
    if a.ndim == 0:
        out[...] = 1
        return
    x = _work(a)
    if x is a and out.dtype == a.dtype and out.flags.c_contiguous:  # straight into the output: the same values
        np.exp(_shifted(x, dim), out=out)
        out /= np.sum(out, axis=dim, keepdims=True)
        return
    e = np.exp(_shifted(x, dim))
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


_ROWS: Cache[int, np.ndarray] = Cache("kernels.cpu.nn.rows", 64, counted=False)


def crossentropy(logits, labels, ignore_index, reduction, out):
    n, c = logits.shape
    if n and reduction != "none" and native.crossentropy_reduced(logits, labels, ignore_index,
                                                                 0 if reduction == "mean" else 1, out):
        return  # the usual batch: the values of the steps below, in fewer calls
    if n:
        lo, hi = labels.min(), labels.max()
        if lo >= 0 and hi < c and not lo <= ignore_index <= hi:
            # the usual batch, every label in range and none ignored: the same values as below, in fewer steps
            picked = native.crossentropy_rows(logits, labels)
            if picked is None:
                s = _shifted(_work(logits), 1)
                rows = _ROWS.get(n)
                if rows is None:
                    rows = _ROWS.put(n, np.arange(n))
                picked = np.log(np.sum(np.exp(s), axis=1)) - s[rows, labels]
            out[...] = _reduce("crossentropy", picked, np.intp(n) if reduction == "mean" else 1, reduction)
            return
    keep = labels != ignore_index
    bad = keep & ((labels < 0) | (labels >= c))
    if bad.any():
        raise DeepxError(f"crossentropy: label {labels[bad][0]} out of range for {c} classes")
    lsm = _logsoftmax(_work(logits), 1) if n else _work(logits)
    safe = np.where(keep, labels, 0)
    picked = -np.take_along_axis(lsm, safe[:, None].astype(np.intp), 1)[:, 0] * keep
    out[...] = _reduce("crossentropy", picked, keep.sum() if reduction == "mean" else 1, reduction)


_CE_MODES = {"mean": 0, "sum": 1, "none": 2}


def crossentropygrad(logits, labels, g, ignore_index, reduction, out):
    """The values autograd's chain for crossentropy gives (softmax, a one-hot from labels == arange, the kept rows'
    mask, their count), in a few steps: ((softmax - onehot) * keep) * scale, each in the output's dtype. Natively
    (deepxd/kernels/cpu/native.py) in two C loops around numpy's exp, with the same bits."""
    n, c = logits.shape
    if native.crossentropygrad(logits, labels, g, ignore_index, _CE_MODES[reduction], out):
        return
    x = _work(logits)
    p = np.exp(_shifted(x, 1)) if n else x.copy()
    if n:
        p /= np.sum(p, axis=1, keepdims=True)
    hit = (labels >= 0) & (labels < c)  # equal() against arange(c): a label outside it matches no column
    rows = np.flatnonzero(hit)
    p[rows, labels[rows]] -= 1
    keep = (labels != ignore_index).astype(p.dtype)
    p *= keep[:, None]
    gw = _work(g)
    if reduction == "mean":
        count = np.sum(keep)
        if not count:  # every label ignored: the loss is nan, its gradient zeros (as torch's)
            out[...] = 0
            return
        p *= np.divide(gw, count, dtype=p.dtype)
    elif reduction == "sum":
        p *= gw
    else:
        p *= gw[:, None]
    out[...] = p


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


def layernormgrad(a, weight, g, eps, da, xhat):
    x = _work(a)
    axes = _axes(a, weight)
    xc = x - np.mean(x, axis=axes, keepdims=True)
    rstd = 1.0 / np.sqrt(np.mean(xc * xc, axis=axes, keepdims=True) + eps)
    xh = xc * rstd
    d = _work(g) * _work(weight)
    dx = d - np.mean(d, axis=axes, keepdims=True) - xh * np.mean(d * xh, axis=axes, keepdims=True)
    dx *= rstd
    da[...] = dx
    xhat[...] = xh


def rmsnormgrad(a, weight, g, eps, da, xr):
    x = _work(a)
    axes = _axes(a, weight)
    r = 1.0 / np.sqrt(np.mean(x * x, axis=axes, keepdims=True) + eps)
    xn = x * r
    d = _work(g) * _work(weight)
    dx = d - xn * np.mean(d * xn, axis=axes, keepdims=True)
    dx *= r
    da[...] = dx
    xr[...] = xn
