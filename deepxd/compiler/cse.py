"""Common-subexpression elimination: an instruction that repeats an earlier one (same op, same inputs unchanged
since, same scalar values of the same types, same result shape and dtype) is dropped when its output's value ends
inside the program (deleted, or overwritten), and the reads of that value go to the earlier result.

The earlier result must hold its value until the last of those reads. When the program deletes it sooner, its
deltensor moves to where the temporary's was. Random fills (the init family), effects and in-place instructions are
never merged.
"""

from __future__ import annotations

from typing import Any

from deepx_core.ir.instr import Instr
from deepx_core.ir.ops import UNKNOWN, Bound
from deepxd.compiler.analysis import READ, PassContext, Rewrite, has_ends, refs, settle, tensor_reads

_NEVER = frozenset({"life", "io", "init"})
_ROUNDS = 4  # each round reuses a result at most once; a few rounds settle every chain seen in practice


def eliminate_common_subexpressions(program: list[Instr], ctx: PassContext) -> list[Instr]:
    if not has_ends(program):
        return program
    return settle(program, ctx, _round, _ROUNDS)


def _value_key(v: Any) -> Any:
    if isinstance(v, tuple):
        return tuple(_value_key(x) for x in v)
    return (type(v).__name__, repr(v))  # 1, 1.0 and True differ; so do 0.0 and -0.0


def _candidate(b: Bound) -> bool:
    op = b.op
    if not op.effect.pure or op.family in _NEVER or len(b.outs) != 1 or len(b.out_names) != 1:
        return False
    out = b.outs[0]
    return out is not None and out is not UNKNOWN and b.out_names[0] not in tensor_reads(b)


def _round(program: list[Instr], ctx: PassContext) -> list[Instr]:
    rw = Rewrite(ctx, program)
    version: dict[str, int] = {}
    seen: dict[Any, tuple[int, str]] = {}
    touched: set[str] = set()
    for i, b in enumerate(rw.bounds):
        rw.at(i)
        if _candidate(b):
            key = _key(b, rw, version)
            first = seen.get(key)
            out = str(b.out_names[0])
            if first is not None and _reuse(rw, ctx, first, i, out, touched):
                touched.update((first[1], out))
                ctx.stats["cse"] += 1
            else:
                seen[key] = (i, out)
        for name, kind in refs(b):
            if kind != READ:
                version[name] = version.get(name, 0) + 1
    return rw.result()


def _key(b: Bound, rw: Rewrite, version: dict[str, int]) -> Any:
    parts: list[Any] = [b.op.name]
    for a, n, v in zip(b.op.args, b.names, b.args):
        if a.kind == "tensor":
            m = rw.name(n)
            parts.append((m, version.get(m, 0)))
        elif a.kind == "listtensor":
            parts.append(tuple((rw.name(x), version.get(rw.name(x), 0)) for x in n))
        else:
            parts.append(_value_key(v))
    parts.append(b.outs[0])
    return tuple(parts)


def _reuse(rw: Rewrite, ctx: PassContext, first: tuple[int, str], i: int, dup: str, touched: set[str]) -> bool:
    """Drop the instruction at i (writing `dup`) in favour of the one at first[0] (writing first[1])."""
    f, kept = first
    if kept == dup or kept in touched or dup in touched or ctx.pinned(dup) or rw.moved(kept):
        return False
    temp = rw.uses.temporary(dup, i)
    if temp is None:
        return False
    meta = rw.bounds[f].outs[0]
    if not rw.reuse(dup, kept, f, *temp, meta.dtype if meta is not None else None):
        return False
    rw.remove(i)
    return True
