"""Shape rules shared by the op catalogue: broadcasting, dims, permutations. Pure functions on tuples."""

from __future__ import annotations

from collections.abc import Sequence

from deepx_core.errors import DeepxError

Shape = tuple[int, ...]


def numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def broadcast(op: str, *shapes: Shape, names: Sequence[str] = ()) -> Shape:
    """numpy broadcasting of `shapes`; a DeepxError naming the op and operands when they do not broadcast."""
    if len(shapes) == 2 and shapes[0] == shapes[1]:
        return shapes[0]
    ndim = max(len(s) for s in shapes)
    out = []
    for i in range(ndim):
        d = 1
        for s in shapes:
            k = i - ndim + len(s)
            if k < 0:
                continue
            e = s[k]
            if e != 1:
                if d != 1 and d != e:
                    listed = " and ".join(
                        f"{s}" + (f" ('{n}')" if n else "") for s, n in zip(shapes, [*names, *[""] * len(shapes)])
                    )
                    raise DeepxError(f"{op}: shapes {listed} do not broadcast")
                d = e
        out.append(d)
    return tuple(out)


def norm_dim(op: str, dim: int, ndim: int, what: str = "dim", scalar_ok: bool = False) -> int:
    """A dim in [-ndim, ndim) made non-negative. A rank-0 tensor has no dims, unless `scalar_ok` (softmax, argmax
    treat it as one element along dim 0 or -1, as torch does)."""
    if ndim == 0:
        if scalar_ok and dim in (0, -1):
            return 0
        raise DeepxError(f"{op}: {what} {dim} out of range for a tensor of rank 0 (it has no dims)")
    if not -ndim <= dim < ndim:
        raise DeepxError(f"{op}: {what} {dim} out of range for a tensor of rank {ndim} (expected {-ndim}..{ndim - 1})")
    return dim % ndim


def norm_dims(op: str, dims: Sequence[int], ndim: int) -> tuple[int, ...]:
    """Reduction dims made non-negative and sorted; empty means every dim."""
    if len(dims) == 0:
        return tuple(range(ndim))
    out = sorted(norm_dim(op, int(d), ndim) for d in dims)
    if len(set(out)) != len(out):
        raise DeepxError(f"{op}: repeated dim in {list(dims)}")
    return tuple(out)


def reduced(shape: Shape, dims: Sequence[int], keepdims: bool) -> Shape:
    if keepdims:
        return tuple(1 if i in dims else d for i, d in enumerate(shape))
    return tuple(d for i, d in enumerate(shape) if i not in dims)


def check_perm(op: str, perm: Sequence[int], ndim: int) -> tuple[int, ...]:
    p = tuple(int(x) for x in perm)
    if sorted(d % ndim if ndim and -ndim <= d < ndim else d for d in p) != list(range(ndim)):
        raise DeepxError(f"{op}: {list(p)} is not a permutation of the {ndim} dims {list(range(ndim))}")
    return tuple(d % ndim for d in p)
