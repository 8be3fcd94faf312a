"""Elementwise arithmetic: C = f(A[, B]) into a preallocated C (which may be A or B).

Binary forms broadcast; integer division truncates toward zero (C semantics) and refuses a zero divisor; low-precision
floats compute in float32.
"""

from __future__ import annotations

import numpy as np

from deepx_core.errors import DeepxError
from deepxd.kernels.cpu._util import F64, LOW, is_int, up


def _binary(f: np.ufunc, a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
    if out.dtype in LOW:
        out[...] = f(up(a), up(b))
    else:
        f(a, b, out=out)


def _scalar(f: np.ufunc, a: np.ndarray, s: float, out: np.ndarray) -> None:
    if out.dtype in LOW:
        out[...] = f(up(a), s)
    elif type(s) is int and out.dtype.kind in "iu" and not _fits(s, out.dtype):
        np.copyto(out, f(a.astype(np.int64), s), casting="unsafe")
    else:
        f(a, s, out=out, casting="unsafe")


def _fits(s: int, dt: np.dtype) -> bool:
    info = np.iinfo(dt)
    return info.min <= s <= info.max


def _rscalar(f: np.ufunc, s: float, a: np.ndarray, out: np.ndarray) -> None:
    if out.dtype in LOW:
        out[...] = f(s, up(a))
    elif type(s) is int and out.dtype.kind in "iu" and not _fits(s, out.dtype):
        np.copyto(out, f(s, a.astype(np.int64)), casting="unsafe")
    else:
        f(s, a, out=out, casting="unsafe")


def _unary(f: np.ufunc, a: np.ndarray, out: np.ndarray) -> None:
    if out.dtype in LOW:
        out[...] = f(up(a))
    else:
        f(a, out=out)


def _int_div(op: str, a: np.ndarray | int, b: np.ndarray | int, out: np.ndarray) -> None:
    if np.any(np.asarray(b) == 0):
        raise DeepxError(f"{op}: integer division by zero")
    q = np.floor_divide(a, b)
    q += (np.remainder(a, b) != 0) & ((np.asarray(a) < 0) != (np.asarray(b) < 0))
    out[...] = q


def add(a, b, out):
    _binary(np.add, a, b, out)


def sub(a, b, out):
    _binary(np.subtract, a, b, out)


def mul(a, b, out):
    _binary(np.multiply, a, b, out)


def div(a, b, out):
    if is_int(out):
        _int_div("div", a, b, out)
    else:
        _binary(np.divide, a, b, out)


def max(a, b, out):
    _binary(np.maximum, a, b, out)


# numpy's float fmod, remainder and floor_divide are C's fmod and Python's % and // (numpy's npy_divmod), as torch's
def fmod(a, b, out):
    _binary(np.fmod, a, b, out)


def remainder(a, b, out):
    _binary(np.remainder, a, b, out)


def floordiv(a, b, out):
    _binary(np.floor_divide, a, b, out)


def fmodscalar(a, s, out):
    _scalar(np.fmod, a, s, out)


def remainderscalar(a, s, out):
    _scalar(np.remainder, a, s, out)


def floordivscalar(a, s, out):
    _scalar(np.floor_divide, a, s, out)


def rfmodscalar(s, a, out):
    _rscalar(np.fmod, s, a, out)


def rremainderscalar(s, a, out):
    _rscalar(np.remainder, s, a, out)


def rfloordivscalar(s, a, out):
    _rscalar(np.floor_divide, s, a, out)


def min(a, b, out):
    _binary(np.minimum, a, b, out)


def pow(a, b, out):
    if is_int(out) and np.any(b < 0):
        out[...] = np.power(a.astype(F64), b.astype(F64))
    else:
        _binary(np.power, a, b, out)


def addscalar(a, s, out):
    _scalar(np.add, a, s, out)


def subscalar(a, s, out):
    _scalar(np.subtract, a, s, out)


def mulscalar(a, s, out):
    _scalar(np.multiply, a, s, out)


def divscalar(a, s, out):
    if is_int(out) and s == 0:
        raise DeepxError("divscalar: integer division by zero")
    if is_int(out) and isinstance(s, int):
        _int_div("divscalar", a, s, out)
    else:
        _scalar(np.divide, a, s, out)


def powscalar(a, s, out):
    if is_int(out) and (isinstance(s, float) or s < 0):
        out[...] = np.power(a.astype(F64), float(s))
    else:
        _scalar(np.power, a, s, out)


def maxscalar(a, s, out):
    _scalar(np.maximum, a, s, out)


def minscalar(a, s, out):
    _scalar(np.minimum, a, s, out)


def rsubscalar(s, a, out):
    _rscalar(np.subtract, s, a, out)


def rdivscalar(s, a, out):
    if is_int(out) and isinstance(s, int):
        _int_div("rdivscalar", s, a, out)
    elif is_int(out):
        if np.any(a == 0):
            raise DeepxError("rdivscalar: integer division by zero")
        _rscalar(np.divide, s, a, out)
    else:
        _rscalar(np.divide, s, a, out)


def rpowscalar(s, a, out):
    if is_int(out) and (isinstance(s, float) or np.any(a < 0)):
        out[...] = np.power(float(s), a.astype(F64))
    else:
        _rscalar(np.power, s, a, out)


def sqrt(a, out):
    _unary(np.sqrt, a, out)


def exp(a, out):
    _unary(np.exp, a, out)


def log(a, out):
    _unary(np.log, a, out)


def sin(a, out):
    _unary(np.sin, a, out)


def cos(a, out):
    _unary(np.cos, a, out)


def tan(a, out):
    _unary(np.tan, a, out)


def neg(a, out):
    _unary(np.negative, a, out)


def abs(a, out):
    _unary(np.absolute, a, out)


def floor(a, out):
    _unary(np.floor, a, out)


def ceil(a, out):
    _unary(np.ceil, a, out)


def round(a, out):
    _unary(np.rint, a, out)  # halves to even, as torch.round


def trunc(a, out):
    _unary(np.trunc, a, out)


def log1p(a, out):
    _unary(np.log1p, a, out)


def expm1(a, out):
    _unary(np.expm1, a, out)


def invert(a, out):
    np.invert(a, out=out)


def todtype(a, out):
    if a.dtype in LOW or out.dtype in LOW:
        out[...] = up(a)
    else:
        np.copyto(out, a, casting="unsafe")
