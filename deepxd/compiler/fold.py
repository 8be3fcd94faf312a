"""Transposes folded into products: a transpose over the last two dims whose result one matmul reads, and which then
ends inside the program, is not made; the matmul becomes a `matmultransposed` that reads the transpose's operand
with its last two dims swapped (BLAS reads it transposed where it lies, cuBLAS takes a transposition flag). A Linear's
`x @ W.t()` and its weight gradient `g.t() @ x` are the common cases.

Where: the transpose's result is neither fetched nor a heap tensor, is read by the matmul alone (as one of its
operands, not both) and then deleted or overwritten; its operand holds the same value until the transpose's value
ends (nothing but reads in between, or its deletion, which then moves to just after that end, unless it is a heap
tensor), so that the transposed value can be made again until then (the repair after a failure does); the matmul
writes neither name; the dtype is a float (matmultransposed's). Both operands of one matmul may be folded.
"""

from __future__ import annotations

from deepx_core.ir.dtypes import FLOATS
from deepx_core.ir.instr import Instr, Param
from deepx_core.ir.ops import Bound
from deepxd.compiler.analysis import (
    DELETE,
    READ,
    Edit,
    PassContext,
    Uses,
    apply_edits,
    deltensor,
    has_ends,
    known,
    swaps_last_two,
)


def fold_transpose(program: list[Instr], ctx: PassContext) -> list[Instr]:
    if not has_ends(program) or not any(i.name == "transpose" for i in program):
        return program
    bounds = ctx.bind(program)
    uses = ctx.uses(program)
    edits: dict[int, Edit] = {}
    after: dict[int, list[Instr]] = {}  # position -> the moved deletions that go right after it
    for j, mm in enumerate(bounds):
        meta = mm.outs[0] if mm.op.name == "matmul" and not mm.instr.meta else None
        if meta is None or not known(meta) or meta.dtype not in FLOATS:
            continue
        folds = [_fold(str(n), j, mm, bounds, uses, ctx, edits) for n in mm.names]
        if all(f is None for f in folds):
            continue
        dtype = meta.dtype
        operands = tuple(Param.tensor(f[0] if f is not None else str(n), dtype) for f, n in zip(folds, mm.names))
        flags = tuple(Param.var(f is not None) for f in folds)
        edits[j] = Instr("matmultransposed", (*operands, *flags), mm.instr.returns)
        for f in folds:
            if f is None:
                continue
            edits[f[1]] = None
            if f[2] is not None and f[2] not in edits:
                edits[f[2]] = None
                after.setdefault(f[3], []).append(deltensor(f[0], dtype))
            ctx.stats["fold_transpose"] += 1
    for p, moved in after.items():
        e = edits.get(p, program[p])
        edits[p] = (*(() if e is None else (e,) if isinstance(e, Instr) else e), *moved)
    return apply_edits(ctx, program, edits) if edits else program


def _fold(n: str, j: int, mm: Bound, bounds: list[Bound], uses: Uses, ctx: PassContext, edits: dict[int, Edit]
          ) -> tuple[str, int, int | None, int] | None:
    """Where operand n of the matmul at j can be read from a transpose's operand: (that operand, the transpose's
    position, the position of the operand's deletion that must move, if any, and where the transpose's value ends,
    after which the deletion goes); None otherwise."""
    out = str(mm.out_names[0])
    if mm.names.count(n) != 1 or ctx.pinned(n) or n in ctx.fetch:
        return None
    k = uses.writer(n, j)
    if k is None or k in edits or not swaps_last_two(bounds[k]):
        return None
    x = str(bounds[k].names[0])
    temp = uses.temporary(n, k)
    if x == n or out in (n, x) or temp is None or temp[0] != [j]:
        return None
    end = temp[1]
    deleted: int | None = None
    for p, kind in uses.after(x, k):
        if p > end:
            break
        if kind == READ and deleted is None:
            continue
        if kind != DELETE or deleted is not None or ctx.pinned(x) or p in edits:
            return None
        deleted = p
    return x, k, deleted, end
