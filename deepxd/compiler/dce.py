"""Dead-code elimination: drop an instruction whose every output is deleted or overwritten before anything reads it.

Only pure instructions qualify (`OpDef.effect.pure`: no I/O, no change to the set of tensors or variables); one
that writes in place (an output that is also an input), or writes a fetched or heap tensor, stays. The deltensor of
an output that no longer comes to exist goes with it. Scanning backwards removes whole dead chains in one pass: once
the last use of a value is gone, the instruction that made it is dead too.
"""

from __future__ import annotations

from deepx_core.ir.instr import Instr
from deepx_core.ir.ops import Bound
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
    events = _events_at(uses, len(bounds))
    # per name, the kind of its next event among the instructions kept (scanning backwards): one look each, where
    # walking past the removed ones was quadratic in a long program that overwrites its names
    next_kind: dict[str, int] = {}
    for i in range(len(bounds) - 1, -1, -1):
        if _dead(bounds[i], ctx, next_kind):
            removed.add(i)
        else:
            next_kind.update(events[i])
    if not removed:
        return program
    ctx.stats["dce"] += len(removed)
    return apply_edits(ctx, program, dict.fromkeys(removed))


def _dead(b: Bound, ctx: PassContext, next_kind: dict[str, int]) -> bool:
    """Whether every output of the instruction is deleted or overwritten next (next_kind: among the instructions
    kept after it) and nothing else makes it stay."""
    op = b.op
    if not op.effect.pure:
        return False
    outs = tensor_writes(b)
    if not outs:
        return False
    reads = tensor_reads(b)
    for o in outs:
        if ctx.pinned(o) or o in reads or next_kind.get(o) not in (DELETE, WRITE):
            return False
    return True


def _events_at(uses: Uses, n: int) -> list[dict[str, int]]:
    """Per position, {name: kind} of the events there."""
    events: list[dict[str, int]] = [{} for _ in range(n)]
    for name, positions in uses.pos.items():
        for p, kind in zip(positions, uses.kinds[name]):
            events[p][name] = kind
    return events
