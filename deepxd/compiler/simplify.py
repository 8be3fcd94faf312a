"""Algebraic simplification: instructions whose result is one of their inputs, unchanged.

- multiply, divide or raise to the power by one (`mulscalar`, `divscalar`, `powscalar` with 1), add -0.0 or subtract
  +0.0 (`addscalar`, `subscalar`; on integers any zero): x + 0.0 turns -0.0 into +0.0, which 1 / x then tells apart,
  so it stays;
- a reshape, a broadcastTo or a todtype to the input's own shape or dtype, a transpose by the identity;
- a transpose that undoes the transpose that made its input, a reshape back to the shape before a reshape.

Only where the shapes and dtypes are known (checked against the tensors that exist) and the result has exactly the
input's shape and dtype. When the result's value ends inside the program (deleted or overwritten), its reads go to
the input and the instruction disappears (when the input stays unchanged until those reads); an identity in place
disappears; otherwise the instruction becomes a copytensor.
"""

from __future__ import annotations

import math

from deepx_core.ir.dtypes import FLOATS
from deepx_core.ir.instr import Instr, Param
from deepx_core.ir.ops import Bound
from deepx_core.ir.shapes import check_perm
from deepxd.compiler.analysis import READ, PassContext, Rewrite, has_ends, known, refs, tensor_writes

_ONE = frozenset({"mulscalar", "divscalar", "powscalar"})
_ZERO = frozenset({"addscalar", "subscalar"})
_UNDOABLE = frozenset({"transpose", "reshape"})
_CANDIDATES = _ONE | _ZERO | _UNDOABLE | {"broadcastTo", "todtype"}
_OWN = -1  # the source is the instruction's own input: no earlier position to check


def simplify(program: list[Instr], ctx: PassContext) -> list[Instr]:
    if not has_ends(program):
        return program
    rw = Rewrite(ctx, program)
    producer: dict[str, tuple[int, Bound, str]] = {}  # tensor -> (position, instruction, its input) of its last write
    for i, b in enumerate(rw.bounds):
        rw.at(i)
        if b.op.name in _CANDIDATES and len(b.outs) == 1 and known(b.outs[0]) and known(b.args[0]):
            found = _identity(b, rw, producer)
            if found is not None:
                _replace(rw, ctx, i, b, *found)
        for name, kind in refs(b):  # a later write, delete or rename makes the recorded producer stale
            if kind != READ:
                producer.pop(name, None)
        if b.op.name in _UNDOABLE:
            for out in tensor_writes(b):
                if out != b.names[0] and out != rw.name(b.names[0]):  # in place, the value it undoes is gone
                    producer[out] = (i, b, rw.name(b.names[0]))
    return rw.result()


def _identity(b: Bound, rw: Rewrite, producer: dict[str, tuple[int, Bound, str]]) -> tuple[str, int] | None:
    """(the tensor whose value the result equals, the position from which it must stay unchanged)."""
    op = b.op.name
    a, out = b.args[0], b.outs[0]
    assert out is not None
    src = rw.name(b.names[0])
    if op in _UNDOABLE and src in producer:
        j, first, origin = producer[src]
        if first.op.name == op and first.args[0] == out:
            if op == "reshape":
                return origin, j  # a reshape back to the shape before the previous reshape
            p = check_perm("transpose", first.args[1], len(out.shape))
            q = check_perm("transpose", b.args[1], len(out.shape))
            if all(p[q[k]] == k for k in range(len(q))):
                return origin, j  # the transpose that undoes the one before
    if a != out:
        return None
    if op in _ONE:
        s = b.args[1]
        return (src, _OWN) if type(s) in (int, float) and s == 1 else None
    if op in _ZERO:  # x + 0.0 is +0.0 where x is -0.0 (1 / x then flips sign): only what keeps every bit
        s = b.args[1]
        if type(s) not in (int, float) or s != 0:
            return None
        if out.dtype in FLOATS and (math.copysign(1.0, s) > 0) == (op == "addscalar"):
            return None  # x + (+0.0) and x - (-0.0) turn -0.0 into +0.0; x + (-0.0) and x - (+0.0) do not
        return src, _OWN
    if op == "transpose":
        return (src, _OWN) if check_perm("transpose", b.args[1], len(a.shape)) == tuple(range(len(a.shape))) else None
    return src, _OWN  # reshape, broadcastTo, todtype to what it already is


def _replace(rw: Rewrite, ctx: PassContext, i: int, b: Bound, src: str, since: int) -> None:
    out = str(b.out_names[0])
    uses = rw.uses
    if type(rw.edits.get(i)) is tuple:  # a deltensor an earlier rewrite moved here goes with this instruction
        return
    # `uses` is the program as sent: where src's deltensor was moved (Rewrite.reuse), it no longer shows when src goes
    if since >= 0 and (rw.moved(src) or not uses.untouched(src, since, i)):
        return
    if out == src:  # an identity in place
        rw.remove(i)
        ctx.stats["simplify"] += 1
        return
    meta = b.outs[0]
    assert meta is not None
    temp = None if ctx.pinned(out) or rw.moved(src) else uses.temporary(out, i)
    if temp is not None and rw.reuse(out, src, i, *temp, meta.dtype):
        rw.remove(i)
        ctx.stats["simplify"] += 1
        return
    before = ctx.metas_before(rw.program, i)[0]
    if before is not None and before != meta:
        return  # copytensor does not change a tensor's shape or dtype
    rw.edits[i] = Instr("copytensor", (Param.tensor(src, meta.dtype),), (b.instr.returns[0],), b.instr.meta)
    ctx.stats["simplify"] += 1
