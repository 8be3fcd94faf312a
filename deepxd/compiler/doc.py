"""Render the op catalogue as the Markdown tables of docs/ir.md, so the docs never drift from the code.

    python -m deepxd.compiler.doc            # print the tables
    python -m deepxd.compiler.doc --write    # rewrite the generated part of docs/ir.md
"""

from __future__ import annotations

import sys
from pathlib import Path

from deepx_core.ir.dtypes import ALL, FLOATS, INTS, NUMERIC, STORABLE
from deepx_core.ir.effects import CREATES, DELETES, FILLS, LOADS, READS, RENAMES, SETS, WRITES
from deepx_core.ir.ops import OPS, OpDef, _fmt

BEGIN = "<!-- BEGIN GENERATED: python -m deepxd.compiler.doc --write -->"
END = "<!-- END GENERATED -->"

_FAMILY_TITLES = {
    "life": "Tensor life and variables",
    "init": "Init",
    "io": "IO",
    "elementwise": "Elementwise",
    "compare": "Comparison and selection",
    "matmul": "Matmul",
    "shape": "Change shape",
    "reduce": "Reduce",
    "sort": "Sort",
    "nn": "Neural-network ops",
    "conv": "Convolution",
    "attention": "Attention",
    "norm": "Batch and group norm",
    "resize": "Resizing (interpolate)",
    "optim": "Optimizer updates",
    "collective": "Collectives (process groups: docs/distributed.md)",
    "fused": "Fused elementwise (made by the compiler)",
}


_SETS = {STORABLE: "all", ALL: "float, int, bool", NUMERIC: "float, int", FLOATS: "float",
         INTS | {"bool"}: "int, bool"}


def _dtypes(op: OpDef) -> str:
    return _SETS.get(op.dtypes) or _fmt(op.dtypes)


def _gradients() -> dict[str, str]:
    """op name -> its gradient rule's formula: a rule in the op table, run on symbols, or the docstring of the op's
    rule in deepxd/compiler/autograd.py (GRAD_RULES)."""
    from deepxd.compiler.autograd import rule_formula

    return {name: rule_formula(name) for name, op in OPS.items() if op.differentiable}


def render() -> str:
    grads = _gradients()
    lines = []
    for family, title in _FAMILY_TITLES.items():
        ops = [op for op in OPS.values() if op.family == family]
        if not ops:
            continue
        lines += [f"### {title} (`deepxd/kernels/cpu/{family}.py`)", "",
                  "| op | signature | dtypes | what it does | gradient |", "| --- | --- | --- | --- | --- |"]
        for op in ops:
            name = f"`{op.name}`" + ("" if op.deepxir else " *")
            sig = op.signature().split("(", 1)[1].replace("|", "\\|")
            grad = grads.get(op.name, "(no rule)") if op.differentiable else ""
            lines.append(f"| {name} | `({sig}` | {_dtypes(op)} | {op.doc.replace('|', chr(92) + '|')} | "
                         f"{grad.replace('|', chr(92) + '|')} |")
        lines.append("")
    n_ir = sum(op.deepxir for op in OPS.values())
    lines.append(f"{len(OPS)} ops: the {n_ir} of deepxIR and {len(OPS) - n_ir} more, marked *. Dtypes: float = "
                 "float64 float32 float16 bfloat16; int = int64 int32 int16 int8; all = those, bool, float8e5m2 and "
                 "float8e4m3.")
    lines.append("")
    lines.append("gradient: the formula of the op's rule (in its catalogue entry, or in `deepxd/compiler/autograd.py`),"
                 " with g the gradient of the result y; dX is the gradient of input X, summed over the dims it was "
                 "broadcast along. Gradients flow through float tensors only (float64 float32 float16 bfloat16).")
    lines.append("")
    lines.append(_effects())
    return "\n".join(lines)


_EFFECT_WORDS = {FILLS: "writes its returns in place, which exist and keep their shape and dtype",
                 CREATES: "makes its return, keeping one of that shape and dtype", DELETES: "its return",
                 RENAMES: "its return", LOADS: "makes a tensor from a file", READS: "only",
                 SETS: "a variable or a vector"}


def _effects() -> str:
    """Each op's effect on the set of tensors (its entry's `effect`, which `apply_effect` follows)."""
    by_kind: dict[str, list[str]] = {}
    for op in OPS.values():
        by_kind.setdefault(op.effect.kind, []).append(f"`{op.name}`")
    parts = [f"{k} ({words}): {', '.join(by_kind[k])}" for k, words in _EFFECT_WORDS.items() if k in by_kind]
    reading = [f"`{op.name}`" for op in OPS.values() if op.effect.kind == WRITES and op.effect.reads_returns]
    return ("effect on the set of tensors (an entry's `effect`, which `apply_effect` in `deepx_core/ir/effects.py` "
            "follows for every layer): an op reads its tensor args and writes its returns (made where absent, else "
            f"written over), unless its entry says otherwise: {'; '.join(parts)}. The result of "
            f"{', '.join(reading)} also depends on its return as it was (its dtype).")


def rewrite(path: Path) -> bool:
    """Replace the generated section of `path`; True when it changed."""
    text = path.read_text()
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    new = f"{head}{BEGIN}\n{render()}\n{END}{tail}"
    if new != text:
        path.write_text(new)
    return new != text


if __name__ == "__main__":
    if "--write" in sys.argv:
        target = Path(__file__).resolve().parents[2] / "docs" / "ir.md"
        rewrite(target)
    else:
        sys.stdout.write(render() + "\n")
