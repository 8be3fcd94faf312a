"""Dead-code elimination: drop an instruction whose every output is deleted or overwritten before anything reads it.

Only instructions without effects qualify (`OpDef.effects` False: no I/O, no change to the set of tensors or
variables); one that writes in place (an output that is also an input), or writes a fetched or heap tensor, stays.
The deltensor of an output that no longer comes to exist goes with it. Scanning backwards removes whole dead chains
in one pass: once the last use of a value is gone, the instruction that made it is dead too.
"""

from __future__ import annotations

from deepx_sdk.ir.instr import Instr
from deepxd.compiler.analysis import (
    DELETE,
    WRITE,
    PassContext,
    Uses,
    apply_edits,
    has_ends,
    tensor_reads,
    tensor_writes,
)


def eliminate_dead_code(program: list[Instr], ctx: PassContext) -> list[Instr]:
    if not has_ends(program):
        return program
    bounds = ctx.bind(program)
    uses = ctx.uses(program)
    removed: set[int] = set()
    for i in range(len(bounds) - 1, -1, -1):
        b = bounds[i]
        op = b.op
        if op.effects or (op.family in ("life", "io") and op.name != "copytensor"):
            continue
        outs = tensor_writes(b)
        if not outs:
            continue
        reads = tensor_reads(b)
        for o in outs:
            if ctx.pinned(o) or o in reads or not _ends_next(uses, o, i, removed):
                break
        else:
            removed.add(i)
    if not removed:
        return program
    ctx.stats["dce"] += len(removed)
    return apply_edits(ctx, program, dict.fromkeys(removed))


def _ends_next(uses: Uses, name: str, position: int, removed: set[int]) -> bool:
    """Whether the next thing to happen to `name` (among the instructions kept) is its deletion or an overwrite."""
    for p, kind in uses.after(name, position):
        if p not in removed:
            return kind == DELETE or kind == WRITE
    return False
