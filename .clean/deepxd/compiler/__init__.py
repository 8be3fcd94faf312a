"""The middle end: IR-to-IR passes over a program before it runs.

    from deepxd.compiler import PassContext, run_passes, explain

    ctx = PassContext(metas={"x": TensorMeta((4096,), "float32")}, fetch={"y"})
    rewritten = run_passes(program, ctx, ["simplify", "cse", "dce", "fuse"])
    before, after = explain(program, metas=..., fetch=...)

Each pass is `(program: list[Instr], ctx: PassContext) -> list[Instr]`, usable alone: `simplify`,
`eliminate_common_subexpressions` (cse), `eliminate_dead_code` (dce), `fuse_elementwise` (fuse). docs/compiler.md
describes them and the switches that turn them on and off.
"""

from deepxd.compiler.analysis import PassContext
from deepxd.compiler.cse import eliminate_common_subexpressions
from deepxd.compiler.dce import eliminate_dead_code
from deepxd.compiler.fuse import fuse_elementwise
from deepxd.compiler.pipeline import DEFAULT_PASSES, PASSES, Pass, check_passes, explain, run_passes
from deepxd.compiler.simplify import simplify

__all__ = [
    "DEFAULT_PASSES",
    "PASSES",
    "Pass",
    "PassContext",
    "check_passes",
    "eliminate_common_subexpressions",
    "eliminate_dead_code",
    "explain",
    "fuse_elementwise",
    "run_passes",
    "simplify",
]
