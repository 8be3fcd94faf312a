"""torch functions that plain models use, written with the tensor ops deepx has (no op of their own): flip, roll,
repeat_interleave, outer, logsumexp, norm, sign, lerp, addmm, baddbmm, diff, isclose/allclose, einsum, randperm,
the logical and/or/xor of masks (`m1 & m2`, `m1 | m2`), and sinh, cosh, log2, log10, exp2, logit, hypot, logaddexp,
reciprocal, movedim, dot, clamp_min/clamp_max.

Each is recorded as the ops it is made of, so it differentiates through their rules and the daemon's passes fuse what
they can. The Tensor methods among them are set on Tensor by deepx_sdk.tensor (METHODS below); the functions are
also deepx_sdk's (dx.flip, dx.einsum, ...).
"""

from __future__ import annotations

import builtins
import math
import string
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from deepx_core.errors import DeepxError
from deepx_core.ir.shapes import norm_dim

if TYPE_CHECKING:
    from deepx_sdk.tensor import Tensor

__all__ = ["addmm", "allclose", "baddbmm", "clamp_max", "clamp_min", "cosh", "diff", "dot", "einsum", "exp2", "flip",
           "hypot", "isclose", "lerp", "log2", "log10", "logaddexp", "logical_and", "logical_or", "logical_xor",
           "logit", "logsumexp", "movedim", "norm", "outer", "randperm", "reciprocal", "repeat_interleave", "roll",
           "rsqrt", "sign", "sinh"]


def _dims(what: str, dims: Any, ndim: int) -> list[int]:
    items = list(dims) if isinstance(dims, (list, tuple)) else [dims]
    out = [norm_dim(what, int(d), ndim) for d in items]
    if len(set(out)) != len(out):
        raise DeepxError(f"{what}: dim {out} appears more than once")
    return out


def _index(values: Any) -> Tensor:
    from deepx_sdk.tensor import tensor

    return tensor(np.ascontiguousarray(values, dtype=np.int64))


def _take(x: Tensor, dim: int, index: Tensor) -> Tensor:
    return x[(slice(None),) * dim + (index,)]


def flip(x: Tensor, *args: Any, dims: Any = None) -> Tensor:
    """x with the order of `dims` reversed (one gather per dim): flip(x, dims), x.flip(0, 1) or x.flip([0, 1])."""
    if dims is None:
        dims = tuple(args[0]) if len(args) == 1 and isinstance(args[0], (list, tuple)) else args
    for d in _dims("flip", dims, x.ndim):
        n = x.shape[d]
        if n > 1:
            x = _take(x, d, _index(np.arange(n - 1, -1, -1)))
    return x


def roll(x: Tensor, shifts: Any, dims: Any = None) -> Tensor:
    """x shifted along dims, what falls off one end coming back at the other (torch.roll)."""
    from deepx_sdk.tensor import cat

    if dims is None:
        if isinstance(shifts, (list, tuple)) and len(shifts) != 1:
            raise DeepxError("roll: without dims, shifts must be one number")
        s = int(shifts[0] if isinstance(shifts, (list, tuple)) else shifts)
        return roll(x.reshape(-1), s, 0).reshape(x.shape)
    shift_list = list(shifts) if isinstance(shifts, (list, tuple)) else [shifts]
    dim_list = _dims("roll", dims, x.ndim)
    if len(shift_list) != len(dim_list):
        raise DeepxError(f"roll: {len(shift_list)} shifts for {len(dim_list)} dims")
    for s, d in zip(shift_list, dim_list):
        n = x.shape[d]
        s = int(s) % n if n else 0
        if s:
            head = (slice(None),) * d
            x = cat([x[(*head, slice(n - s, n))], x[(*head, slice(0, n - s))]], d)
    return x


def repeat_interleave(x: Tensor, repeats: Any, dim: int | None = None, *, output_size: int | None = None) -> Tensor:
    """Each element repeated `repeats` times along dim (a number, or one count per element: those are read back to
    know the result's shape); without dim, over the flattened tensor."""
    from deepx_sdk.tensor import Tensor as _Tensor

    if dim is None:
        x, dim = x.reshape(-1), 0
    d = norm_dim("repeat_interleave", dim, x.ndim)
    n = x.shape[d]
    if isinstance(repeats, _Tensor):
        counts = repeats.numpy().astype(np.int64).reshape(-1)
    else:
        counts = np.asarray(repeats, dtype=np.int64).reshape(-1)
    if (counts < 0).any():
        raise DeepxError("repeat_interleave: repeats must be non-negative")
    if counts.size == 1:
        r = int(counts[0])
        shape = list(x.shape)
        y = x.unsqueeze(d + 1).expand(*shape[:d + 1], r, *shape[d + 1:])
        return y.reshape(*shape[:d], n * r, *shape[d + 1:])
    if counts.size != n:
        raise DeepxError(f"repeat_interleave: {counts.size} repeats for a dim of size {n}")
    return _take(x, d, _index(np.repeat(np.arange(n), counts)))


def outer(a: Tensor, b: Tensor) -> Tensor:
    if a.ndim != 1 or b.ndim != 1:
        raise DeepxError(f"outer: both operands must be 1-D, got shapes {a.shape} and {b.shape}")
    return a.unsqueeze(1) * b.unsqueeze(0)


def logsumexp(x: Tensor, dim: Any, keepdim: bool = False) -> Tensor:
    """log(sum(exp(x))) over dim, computed from the max (no overflow); -inf where every term is -inf, as torch."""
    from deepx_sdk.tensor import where

    dims = _dims("logsumexp", dim, x.ndim)
    x = x if x.dtype.startswith(("float", "bfloat")) else x.float()
    m = x.amax(dims, keepdim=True).detach()
    m = where(m.isinf(), 0.0, m)
    out = (x - m).exp().sum(dims, keepdim=True).log() + m
    if not keepdim:
        for d in sorted(dims, reverse=True):
            out = out.squeeze(d)
    return out


def norm(x: Tensor, p: Any = "fro", dim: Any = None, keepdim: bool = False, dtype: Any = None) -> Tensor:
    """The vector norm of order p over dim (all of x by default): 'fro' and 2 the Euclidean, 1, inf, -inf, 0 (the
    count of non-zeros) and any other p as sum(|x|^p)^(1/p)."""
    if dtype is not None:
        x = x.to(dtype)
    x = x if x.dtype.startswith(("float", "bfloat")) else x.float()
    dims = list(range(x.ndim)) if dim is None else _dims("norm", dim, x.ndim)
    if p == "fro" or p == 2:
        return (x * x).sum(dims, keepdim=keepdim).sqrt()
    if p == "nuc":
        raise DeepxError("norm: the nuclear norm needs singular values, which deepx does not compute")
    order = float(p)
    a = x.abs()
    if math.isinf(order):
        return a.amax(dims, keepdim=keepdim) if order > 0 else a.amin(dims, keepdim=keepdim)
    if order == 0:
        return (a != 0).to(x.dtype).sum(dims, keepdim=keepdim)
    if order == 1:
        return a.sum(dims, keepdim=keepdim)
    return (a ** order).sum(dims, keepdim=keepdim) ** (1.0 / order)


def sign(x: Tensor) -> Tensor:
    """-1, 0 or 1 by the sign of each element (0 for nan, where torch gives nan... and for -0.0)."""
    dt = x.dtype if x.dtype != "bool" else "bool"
    if dt == "bool":
        return x
    return (x > 0).to(dt) - (x < 0).to(dt)


def lerp(start: Tensor, end: Any, weight: Any) -> Tensor:
    return start + weight * (end - start)


def addmm(input: Tensor, mat1: Tensor, mat2: Tensor, *, beta: Any = 1, alpha: Any = 1) -> Tensor:
    from deepx_sdk.amp import lower, state

    if state.dtype is not None:  # one op of autocast's lower list in torch: the input added in the lower dtype too
        input, mat1, mat2 = lower(input, mat1, mat2)
    prod = mat1 @ mat2
    prod = prod if alpha == 1 else prod * alpha
    return prod if beta == 0 else (input if beta == 1 else input * beta) + prod


def baddbmm(input: Tensor, batch1: Tensor, batch2: Tensor, *, beta: Any = 1, alpha: Any = 1) -> Tensor:
    if batch1.ndim != 3 or batch2.ndim != 3:
        raise DeepxError(f"baddbmm: batch1 and batch2 must be 3-D, got {batch1.shape} and {batch2.shape}")
    return addmm(input, batch1, batch2, beta=beta, alpha=alpha)


def diff(x: Tensor, n: int = 1, dim: int = -1) -> Tensor:
    d = norm_dim("diff", dim, x.ndim)
    head = (slice(None),) * d
    for _ in range(n):
        x = x[(*head, slice(1, None))] - x[(*head, slice(0, -1))]
    return x


def isclose(a: Tensor, b: Any, rtol: float = 1e-5, atol: float = 1e-8, equal_nan: bool = False) -> Tensor:
    """|a - b| <= atol + rtol * |b| elementwise (inf equal to inf of the same sign; nan equal to nan with
    equal_nan), as torch.isclose."""
    from deepx_sdk.tensor import Tensor as _Tensor
    from deepx_sdk.tensor import tensor

    b = b if isinstance(b, _Tensor) else tensor(np.asarray(b, dtype=np.float64)).to(a.dtype)
    if a.dtype != b.dtype:
        raise DeepxError(f"isclose: a ({a.dtype}) and b ({b.dtype}) must have the same dtype, as in torch")
    if a.dtype in ("bool",) or not a.dtype.startswith(("float", "bfloat")):
        return a == b
    close = logical_or((a - b).abs() <= (b.abs() * rtol + atol), a == b)
    if equal_nan:
        close = logical_or(close, logical_and(a.isnan(), b.isnan()))
    return close


def allclose(a: Tensor, b: Any, rtol: float = 1e-5, atol: float = 1e-8, equal_nan: bool = False) -> bool:
    """Whether isclose holds everywhere (read back: one value)."""
    return builtins.bool(isclose(a, b, rtol, atol, equal_nan).all())


def _bools(what: str, a: Any, b: Any) -> tuple[Tensor, Tensor]:
    from deepx_sdk.tensor import Tensor as _Tensor
    from deepx_sdk.tensor import tensor

    a = a if isinstance(a, _Tensor) else tensor(np.asarray(a, dtype=bool))
    b = b if isinstance(b, _Tensor) else tensor(np.asarray(b, dtype=bool))
    if a.dtype != "bool" or b.dtype != "bool":
        raise DeepxError(f"{what}: deepx computes it on bool tensors (masks), got {a.dtype} and {b.dtype}; compare "
                         "first (x > 0), or use arithmetic for integers")
    return a.to("int8"), b.to("int8")


def logical_and(a: Any, b: Any) -> Tensor:
    x, y = _bools("logical_and", a, b)
    return (x * y) != 0


def logical_or(a: Any, b: Any) -> Tensor:
    x, y = _bools("logical_or", a, b)
    return (x + y) != 0


def logical_xor(a: Any, b: Any) -> Tensor:
    x, y = _bools("logical_xor", a, b)
    return x != y


def rsqrt(x: Tensor) -> Tensor:
    return x.rsqrt()


def randperm(n: int, *, generator: Any = None, dtype: Any = None, device: Any = None,
             requires_grad: bool = False) -> Tensor:
    """A random permutation of 0..n-1, from dx.manual_seed's seed where set (or `generator`), made on the host."""
    from deepx_sdk.tensor import _hint, tensor
    from deepx_sdk.utils.data import _rng

    _hint(device)
    if not isinstance(n, int) or n < 0:
        raise DeepxError(f"randperm: n must be a non-negative integer, got {n!r}")
    out = tensor(np.asarray(_rng(generator).permutation(n), dtype=np.int64))
    return out if dtype is None else out.to(dtype)


# ---------------------------------------------------------------- einsum

def _parse_einsum(equation: str, shapes: Sequence[tuple[int, ...]]) -> tuple[list[str], str]:
    eq = equation.replace(" ", "")
    lhs, arrow, rhs = eq.partition("->")
    terms = lhs.split(",")
    if len(terms) != len(shapes):
        raise DeepxError(f"einsum: {equation!r} names {len(terms)} operands, {len(shapes)} given")
    used = set(eq) - set(",->.")
    spare = [c for c in string.ascii_letters if c not in used]
    ell_rank = 0
    out_terms = []
    for t, shape in zip(terms, shapes):
        if not all(c.isalpha() or c == "." for c in t):
            raise DeepxError(f"einsum: {equation!r}: subscripts must be letters (and ...)")
        if "..." in t:
            k = len(shape) - (len(t) - 3)
            ell_rank = builtins.max(ell_rank, k)
            t = t.replace("...", "".join(spare[ell_rank - k:ell_rank]) if k else "")
        elif "." in t:
            raise DeepxError(f"einsum: {equation!r}: an ellipsis is three dots")
        if len(t) != len(shape):
            raise DeepxError(f"einsum: subscripts {t!r} for an operand of rank {len(shape)}")
        if len(set(t)) != len(t):
            raise DeepxError(f"einsum: {equation!r}: a subscript repeated within one operand (a diagonal) is not "
                             "supported by deepx")
        out_terms.append(t)
    ell = "".join(spare[:ell_rank])
    if arrow:
        out = rhs.replace("...", ell)
        if not all(c.isalpha() for c in out) or len(set(out)) != len(out):
            raise DeepxError(f"einsum: {equation!r}: bad output subscripts")
    else:  # implicit: the ellipsis dims, then the letters seen once, in alphabetical order
        counts: dict[str, int] = {}
        for t in out_terms:
            for c in t:
                counts[c] = counts.get(c, 0) + 1
        out = ell + "".join(sorted(c for c, k in counts.items() if k == 1 and c not in ell))
    known = set("".join(out_terms))
    if any(c not in known for c in out):
        raise DeepxError(f"einsum: {equation!r}: an output subscript appears in no operand")
    return out_terms, out


def _sum_out(x: Tensor, sub: str, keep: str) -> tuple[Tensor, str]:
    gone = [i for i, c in enumerate(sub) if c not in keep]
    if gone:
        x = x.sum(gone)
        sub = "".join(c for c in sub if c in keep)
    return x, sub


def _contract(a: Tensor, sa: str, b: Tensor, sb: str, keep: str) -> tuple[Tensor, str]:
    """a (subscripts sa) times b (sb), summed over the letters they share that `keep` does not hold: one batched
    matmul after permutes and reshapes."""
    a, sa = _sum_out(a, sa, keep + sb)
    b, sb = _sum_out(b, sb, keep + sa)
    batch = [c for c in sa if c in sb and c in keep]
    summed = [c for c in sa if c in sb and c not in keep]
    free_a = [c for c in sa if c not in sb]
    free_b = [c for c in sb if c not in sa]
    size = {c: n for s, t in ((sa, a), (sb, b)) for c, n in zip(s, t.shape)}
    for c in batch + summed:
        na, nb = a.shape[sa.index(c)], b.shape[sb.index(c)]
        if na != nb and 1 not in (na, nb):
            raise DeepxError(f"einsum: subscript {c!r} has size {na} in one operand and {nb} in the other")
        size[c] = builtins.max(na, nb)
    if any(a.shape[sa.index(c)] != size[c] for c in batch + summed):
        a = a.expand(*[size[c] if c in batch + summed else n for c, n in zip(sa, a.shape)])
    if any(b.shape[sb.index(c)] != size[c] for c in batch + summed):
        b = b.expand(*[size[c] if c in batch + summed else n for c, n in zip(sb, b.shape)])

    def prod(cs: list[str]) -> int:
        return int(np.prod([size[c] for c in cs])) if cs else 1

    pa = a.permute(*[sa.index(c) for c in batch + free_a + summed]).reshape(prod(batch), prod(free_a), prod(summed))
    pb = b.permute(*[sb.index(c) for c in batch + summed + free_b]).reshape(prod(batch), prod(summed), prod(free_b))
    out = (pa @ pb).reshape(*[size[c] for c in batch + free_a + free_b])
    return out, "".join(batch + free_a + free_b)


def einsum(equation: str, *operands: Any) -> Tensor:
    """torch.einsum for one or more operands (contracted left to right, each pair as one batched matmul), with
    "..." and the implicit output form; a subscript repeated within one operand (a diagonal) is refused."""
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = tuple(operands[0])
    if not operands:
        raise DeepxError("einsum: give at least one operand")
    terms, out = _parse_einsum(equation, [t.shape for t in operands])
    x, sx = operands[0], terms[0]
    for k in range(1, len(operands)):
        later = out + "".join(terms[k + 1:])
        x, sx = _contract(x, sx, operands[k], terms[k], later)
    x, sx = _sum_out(x, sx, out)
    if sx != out:
        x = x.permute(*[sx.index(c) for c in out])
    return x


#: the Tensor methods among these (set on Tensor by deepx_sdk.tensor), by torch's names
def _float(x: Tensor) -> Tensor:
    return x if x.is_floating_point() else x.float()


def reciprocal(x: Tensor) -> Tensor:
    return 1.0 / _float(x)


def sinh(x: Tensor) -> Tensor:
    x = _float(x)
    return (x.exp() - (-x).exp()) * 0.5


def cosh(x: Tensor) -> Tensor:
    x = _float(x)
    return (x.exp() + (-x).exp()) * 0.5


def log2(x: Tensor) -> Tensor:
    return _float(x).log() * (1.0 / math.log(2.0))


def log10(x: Tensor) -> Tensor:
    return _float(x).log() * (1.0 / math.log(10.0))


def exp2(x: Tensor) -> Tensor:
    return (_float(x) * math.log(2.0)).exp()


def logit(x: Tensor, eps: float | None = None) -> Tensor:
    """log(x / (1 - x)); with eps, x clamped to [eps, 1 - eps] first (torch's)."""
    x = _float(x)
    if eps is not None:
        x = x.clamp(eps, 1.0 - eps)
    return (x / (1.0 - x)).log()


def hypot(x: Tensor, other: Tensor) -> Tensor:
    return (x * x + other * other).sqrt()


def logaddexp(x: Tensor, other: Tensor) -> Tensor:
    """log(exp(x) + exp(other)) without overflow: max + log1p(exp(-|x - other|))."""
    return x.maximum(other) + (-(x - other).abs()).exp().log1p()


def movedim(x: Tensor, source: Any, destination: Any) -> Tensor:
    """The dims `source` moved to `destination`, the others in their order (torch's movedim/moveaxis)."""
    src, dst = _dims("movedim", source, x.ndim), _dims("movedim", destination, x.ndim)
    if len(src) != len(dst):
        raise DeepxError(f"movedim: source {source} and destination {destination} name different numbers of dims")
    order = [d for d in range(x.ndim) if d not in src]
    for d, s in sorted(zip(dst, src, strict=True)):
        order.insert(d, s)
    return x.permute(*order)


def dot(x: Tensor, other: Tensor) -> Tensor:
    if x.ndim != 1 or other.ndim != 1:
        raise DeepxError(f"dot: 1-D tensors only, got shapes {tuple(x.shape)} and {tuple(other.shape)} (torch's)")
    return (x * other).sum()


def clamp_min(x: Tensor, min: Any) -> Tensor:  # torch's name
    return x.clamp(min=min)


def clamp_max(x: Tensor, max: Any) -> Tensor:  # torch's name
    return x.clamp(max=max)


METHODS = {"flip": flip, "roll": roll, "repeat_interleave": repeat_interleave, "outer": outer, "ger": outer,
           "logsumexp": logsumexp, "norm": norm, "sign": sign, "lerp": lerp, "addmm": addmm, "baddbmm": baddbmm,
           "diff": diff, "isclose": isclose, "allclose": allclose, "logical_and": logical_and,
           "logical_or": logical_or, "logical_xor": logical_xor, "__and__": logical_and, "__or__": logical_or,
           "__xor__": logical_xor, "__rand__": logical_and, "__ror__": logical_or, "__rxor__": logical_xor,
           "reciprocal": reciprocal, "sinh": sinh, "cosh": cosh, "log2": log2, "log10": log10, "exp2": exp2,
           "logit": logit, "hypot": hypot, "logaddexp": logaddexp, "movedim": movedim, "moveaxis": movedim,
           "dot": dot, "clamp_min": clamp_min, "clamp_max": clamp_max, "sgn": sign}
