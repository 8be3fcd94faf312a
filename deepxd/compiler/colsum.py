"""Column sums fused into their loop: a `fused` whose result the next instruction naming it sums over axis 0 becomes
one `fusedcolsum`, which returns the result and its sums from the same pass over memory (on the CPU the native C
loop adds each row into the sums as it writes it). A ReLU's gradient and the bias gradient after it are the common
case, in every layer of a training step's backward.

Where: the result is a float32 or float64 matrix of two columns or more, and the instruction that names it next is a
`sum` over axis 0 (keepdims either way) into another tensor; the sums are then written where the fused instruction
was, so their tensor is named by nothing in between, is not one of the fused inputs, and is not a heap tensor. No value
needs to end in the program (in the pipeline, like every pass, it runs on programs where one does).
"""

from __future__ import annotations

from deepx_core.ir.instr import Instr, Param
from deepxd.compiler.analysis import READ, Edit, PassContext, apply_edits, known

_DTYPES = frozenset({"float32", "float64"})  # fusedcolsum's, the native loop's


def fuse_colsum(program: list[Instr], ctx: PassContext) -> list[Instr]:
    if not any(i.name == "sum" for i in program):  # (checking the program costs more than this look)
        return program
    bounds = ctx.bind(program)
    uses = ctx.uses(program)
    edits: dict[int, Edit] = {}
    for i, b in enumerate(bounds):
        meta = b.outs[0] if b.op.name == "fused" and not b.instr.meta else None
        if (meta is None or not known(meta) or meta.dtype not in _DTYPES or len(meta.shape) != 2
                or meta.shape[1] < 2 or not isinstance(b.names[0], list)):
            continue
        out = str(b.out_names[0])
        after = next(uses.after(out, i), None)
        if after is None or after[1] != READ:
            continue
        j = after[0]
        sm = bounds[j]
        if (sm.op.name != "sum" or sm.instr.meta or sm.names[0] != out or not known(sm.outs[0])
                or tuple(int(d) % 2 for d in sm.args[1]) != (0,)):
            continue
        sums = str(sm.out_names[0])
        if (sums == out or sums in b.names[0] or ctx.pinned(sums) or j in edits
                or not uses.untouched(sums, i, j - 1, allowed=0)):
            continue
        edits[i] = Instr("fusedcolsum", (*b.instr.args, Param.var(bool(sm.args[2]))),
                         (b.instr.returns[0], sm.instr.returns[0]))
        edits[j] = None
        ctx.stats["fuse_colsum"] += 1
    return apply_edits(ctx, program, edits) if edits else program
