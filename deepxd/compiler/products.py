"""Transposed products: transpose(A @ B) over the last two dims becomes B^T @ A^T, with transpose(transpose(X)) read
as X.

A Linear (y = x @ W^T) gets, by autograd's rules alone, dW = transpose(transpose(x) @ g): a transpose of the whole
weight gradient, which outlives the program (a strided copy). Rewritten it is transpose(g) @ x: the matmul writes the
gradient row-major, and the transpose left is of a temporary (fold_transpose folds it into the product; the CPU
executor would make it a view).

Where it applies: the product's value is read by the transpose alone and then ends inside the program; at least one
operand was made by a transpose over the last two dims of a tensor that still holds that value at the product (that
transpose goes when the product was its only reader); an operand that was not is transposed into the product's own
name, which is free from there on. The new instructions take the product's place, so the result is written there:
nothing may touch it in between, and it is not a heap tensor.
"""

from __future__ import annotations

from deepx_core.ir.instr import Instr, Param
from deepx_core.ir.ops import Bound
from deepxd.compiler.analysis import (
    READ,
    Edit,
    PassContext,
    Uses,
    apply_edits,
    has_ends,
    known,
    settle,
    swap_last,
    swaps_last_two,
)

_ROUNDS = 4  # a chain of layers: each round rewrites the products whose instructions no other rewrite touched


def transpose_products(program: list[Instr], ctx: PassContext) -> list[Instr]:
    if not has_ends(program) or not any(i.name == "transpose" for i in program):
        return program
    return settle(program, ctx, _round, _ROUNDS)


def _round(program: list[Instr], ctx: PassContext) -> list[Instr]:
    bounds = ctx.bind(program)
    uses = ctx.uses(program)
    edits: dict[int, Edit] = {}
    touched: set[str] = set()  # names a rewrite of this round moved a write of: the next round sees them as they are
    for i, b in enumerate(bounds):
        if swaps_last_two(b) and i not in edits:
            found = _rewrite(i, b, bounds, uses, ctx)
            if found is not None and not edits.keys() & found[0].keys() and not touched & found[1]:
                edits.update(found[0])
                touched.update(found[1])
                ctx.stats["transpose_products"] += 1
    return apply_edits(ctx, program, edits) if edits else program


def _rewrite(i: int, t: Bound, bounds: list[Bound], uses: Uses, ctx: PassContext
             ) -> tuple[dict[int, Edit], set[str]] | None:
    """The edits that rewrite the transpose at i of a product, and the names they involve; None where it does not
    apply."""
    product, out = str(t.names[0]), str(t.out_names[0])
    if product == out or ctx.pinned(product) or ctx.pinned(out):
        return None
    j = uses.writer(product, i)
    if j is None:
        return None
    mm = bounds[j]
    rank = len(t.args[0].shape)
    temp = uses.temporary(product, j)
    if (mm.op.name != "matmul" or mm.instr.meta or any(not known(m) or len(m.shape) != rank for m in mm.args)
            or temp is None or temp[0] != [i]):
        return None
    if not uses.untouched(out, j, i - 1, allowed=0):  # written at j instead of i
        return None
    a, b = (str(n) for n in mm.names)
    sources = {n: _source(n, j, rank, bounds, uses, ctx) for n in (a, b)}
    if all(s is None for s in sources.values()):
        return None  # two new transposes for one saved: left as it is
    dtype = mm.outs[0].dtype  # type: ignore[union-attr]
    new: list[Instr] = []

    def transposed(n: str) -> str:
        found = sources[n]
        if found is not None:
            return found[0]
        new.append(Instr("transpose", (Param.tensor(n, dtype), Param.vector(swap_last(rank))),
                         (Param.tensor(product, dtype),)))
        return product

    bt, at = transposed(b), transposed(a)
    if out in (bt, at):
        return None
    new.append(Instr("matmul", (Param.tensor(bt, dtype), Param.tensor(at, dtype)), t.instr.returns))
    edits: dict[int, Edit] = {j: tuple(new) if len(new) > 1 else new[0], i: None}
    names = {product, out, a, b}
    for found in sources.values():
        if found is not None:
            names.add(found[0])
            if found[2]:
                edits[found[1]] = None
    return edits, names


def _source(n: str, j: int, rank: int, bounds: list[Bound], uses: Uses, ctx: PassContext
            ) -> tuple[str, int, bool] | None:
    """n^T without a new transpose: (the tensor a transpose over the last two dims made n from, which holds that
    value at j; the transpose's position; whether it goes, j being its result's only reader)."""
    k = uses.writer(n, j)
    if k is None or not swaps_last_two(bounds[k]):
        return None
    x = str(bounds[k].names[0])
    if x == n or len(bounds[k].args[0].shape) != rank or not uses.untouched(x, k, j, allowed=READ):
        return None
    temp = uses.temporary(n, k)
    return x, k, temp is not None and temp[0] == [j] and not ctx.pinned(n)
