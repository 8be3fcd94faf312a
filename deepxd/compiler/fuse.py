"""Elementwise fusion: a chain or tree of elementwise ops on float tensors becomes one `fused` instruction.

An instruction joins the group of the instruction that reads its output when that value is read by nothing else and
then ends (deleted, or overwritten: a client that reuses the names of dropped results writes them again), has the
reader's result shape (a computed value is never expanded by broadcasting, which would repeat its work) and dtype,
and when the group's inputs do not change between where they were read and the group's last instruction, where the
fused instruction takes its place. A write that the fusion itself removes does not count as a change: a pooled name
read as an input and then written by the group's root (`t2 = t1 * d; t1 = t2 + c; t2 = t1 * e`) keeps its old value
in the fused program, so such chains fuse whole (MAX_OPS ops at a time). Groups of fewer than ctx.fuse_min_ops ops
(3: on numpy's tape a fused pair costs more than its two ops, docs/compiler.md) stay unfused, except a pair whose
result has ctx.fuse_pair_min_elements elements or more (32K where this process has native kernels, which run it as
one C loop: one pass over memory instead of two). The expression is numexpr's syntax over the inputs in0, in1, ...
(see `parse_fused` in deepx_core/ir/ops.py and deepxd/kernels/cpu/fused.py).
"""

from __future__ import annotations

import ast
import math
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from deepx_core.ir.instr import Instr, Param
from deepx_core.ir.ops import UNKNOWN, OpDef, PerOp, expr_template
from deepx_core.ir.shapes import numel
from deepxd.compiler.analysis import DELETE, READ, PassContext, Rewrite, deltensor, has_ends

#: the dtypes a fused kernel computes (float16 and bfloat16 in float32)
FUSE_DTYPES = frozenset({"float64", "float32", "float16", "bfloat16"})
MAX_INPUTS = 16
MAX_OPS = 32
MAX_CHARS = 4000  # silu repeats its operand: bound the expression's text, not only its op count

# precedence of an expression's top operator (Python's, which numexpr shares); an operand of lower precedence than
# its place needs parentheses
ATOM, POW, UNARY, MUL, ADD = 100, 80, 70, 60, 50


class Form(NamedTuple):
    """How an op reads as an expression: {0} {1} are its tensor operands in arg order, {s} its scalar."""

    text: str
    precedence: int
    needs: tuple[int, ...]  # per operand, the least precedence it may have without parentheses


CMP = 40  # comparisons bind below arithmetic
_BIN_PREC = {ast.Add: ADD, ast.Sub: ADD, ast.Mult: MUL, ast.Div: MUL}


def _precedence(node: ast.expr) -> int:
    if isinstance(node, ast.BinOp):
        return POW if isinstance(node.op, ast.Pow) else _BIN_PREC[type(node.op)]
    if isinstance(node, ast.UnaryOp):
        return UNARY
    if isinstance(node, ast.Compare):
        return CMP
    return ATOM


def _form(op: OpDef) -> Form | None:
    """How an op with an expression (OpDef.expr) reads inside a fused one: its text over {0}, {1}, {s}, its top
    operator's precedence, and the least precedence each operand may have there without parentheses."""
    if not op.expr:
        return None
    tensors = [a.name for a in op.args if a.kind == "tensor"]
    needs = [0] * len(tensors)

    def visit(node: ast.AST, need: int) -> None:
        if isinstance(node, ast.Name) and node.id in tensors:
            k = tensors.index(node.id)
            needs[k] = max(needs[k], need)
            return
        if isinstance(node, ast.BinOp):
            p = _precedence(node)
            if p == POW:  # right-associative, and -x ** y is -(x ** y)
                visit(node.left, ATOM)
                visit(node.right, UNARY)
            else:
                visit(node.left, p)
                visit(node.right, p + 1)
        elif isinstance(node, ast.UnaryOp):
            visit(node.operand, UNARY)
        elif isinstance(node, ast.Compare):
            for n in (node.left, *node.comparators):
                visit(n, CMP + 1)
        elif isinstance(node, ast.Call):
            for n in node.args:
                visit(n, 0)

    tree = ast.parse(op.expr, mode="eval").body
    visit(tree, 0)
    return Form(expr_template(op), _precedence(tree), tuple(needs))


#: how each op with an expression reads inside a fused one (None for the others)
TEMPLATES: PerOp = PerOp(_form)


@dataclass
class _Group:
    root: int  # position of the last instruction, where the fused instruction goes
    members: list[int]
    tree: Any  # ("leaf", name) | ("op", Form, scalar text, children)
    leaves: dict[str, int] = field(default_factory=dict)  # input -> the first position that reads it
    ops: int = 1
    chars: int = 0  # about how long its expression's text is
    moves: dict[str, int] = field(default_factory=dict)  # inputs whose deltensor moves after the root


def _scalar(value: Any) -> str | None:
    if type(value) is int:
        return str(value) if value >= 0 else f"({value})"
    if type(value) is float and math.isfinite(value):
        text = repr(value)
        return text if value >= 0 and not text.startswith("-") else f"({text})"
    return None  # bools, non-finite values: left unfused


def fuse_elementwise(program: list[Instr], ctx: PassContext) -> list[Instr]:
    if not has_ends(program):
        return program
    rw = Rewrite(ctx, program)
    pending: dict[str, _Group] = {}  # a group's output -> the group, while a later instruction may absorb it
    groups: dict[int, _Group] = {}  # root position -> group not (yet) absorbed
    min_elements = ctx.fuse_min_elements
    for i, b in enumerate(rw.bounds):
        if pending:
            for n in b.out_names:  # written or deleted again: no longer the group's result
                pending.pop(n, None)
        form = TEMPLATES.get(b.op.name)
        if form is None or len(b.outs) != 1:
            continue
        out = b.outs[0]
        if out is None or out is UNKNOWN or out.dtype not in FUSE_DTYPES or (
                min_elements and numel(out.shape) < min_elements):
            continue
        scalar = ""
        children: list[Any] = []
        sizes: list[int] = []
        absorbed: dict[str, _Group] = {}
        moves: dict[str, int] = {}
        ok = True
        for a, n, v in zip(b.op.args, b.names, b.args):
            if a.kind == "tensor":
                g = absorbed.get(n)
                if g is None and n in pending:
                    moved = _absorbable(pending[n], n, i, rw, ctx, absorbed)
                    if moved is not None:
                        g = pending[n]
                        moves.update(moved)
                if g is not None:
                    absorbed[n] = g
                    children.append(g.tree)
                    sizes.append(g.chars + 2)
                else:
                    children.append(("leaf", n))
                    sizes.append(4)
            else:
                text = _scalar(v)
                if text is None:
                    ok = False
                    break
                scalar = text
        if not ok:
            continue
        chars = len(form.text) + len(scalar) + sum(form.text.count(f"{{{k}}}") * c for k, c in enumerate(sizes))
        if chars > MAX_CHARS:
            continue
        group = _Group(i, [i], ("op", form, scalar, children), chars=chars, moves=moves)
        for n in b.names:
            if isinstance(n, str) and n not in absorbed:
                group.leaves.setdefault(n, i)
        for g in absorbed.values():
            group.members[:0] = g.members
            group.ops += g.ops
            for n, p in g.leaves.items():
                group.leaves[n] = min(p, group.leaves.get(n, p))
            groups.pop(g.root, None)
        groups[i] = group
        pending[str(b.out_names[0])] = group
    last_root: dict[int, int] = {}  # a moved deltensor's position -> the latest fused instruction that needs it
    pairs = ctx.fuse_pair_min_elements
    emitted = [g for g in groups.values() if g.ops >= max(2, ctx.fuse_min_ops) or (
        g.ops == 2 and pairs and _elements(rw, g) >= pairs)]
    for g in emitted:
        for q in g.moves.values():
            last_root[q] = max(last_root.get(q, -1), g.root)
    for g in emitted:
        _emit(rw, g, [n for n, q in g.moves.items() if last_root[q] == g.root])
        for q in g.moves.values():
            rw.remove(q)
        ctx.stats["fuse"] += len(g.members)
    return rw.result()


def _elements(rw: Rewrite, g: _Group) -> int:
    out = rw.bounds[g.root].outs[0]
    return numel(out.shape) if out is not None and out is not UNKNOWN else 0


def _absorbable(g: _Group, name: str, i: int, rw: Rewrite, ctx: PassContext,
                absorbed: dict[str, _Group]) -> dict[str, int] | None:
    """Whether the group making `name` can join the instruction at i, which reads it: None when not, else the
    deltensors of its inputs that must move after i (input -> position)."""
    uses = rw.uses
    if ctx.pinned(name):
        return None
    temp = uses.temporary(name, g.root, through=True)
    if temp is None or temp[0] != [i]:
        return None  # read elsewhere too, or not deleted by the program
    made, b = rw.bounds[g.root].outs[0], rw.bounds[i]
    out = b.outs[0]
    if made is None or out is None or made.shape != out.shape or made.dtype != out.dtype:
        return None
    ops = g.ops + 1
    count = len(g.leaves) + len(b.names)
    for other in absorbed.values():
        ops += other.ops
        count += len(other.leaves)
    if ops > MAX_OPS:
        return None
    if count > MAX_INPUTS:
        leaves = set(g.leaves).union(*(other.leaves for other in absorbed.values()))
        leaves.update(n for n in b.names if isinstance(n, str) and n != name and n not in absorbed)
        if len(leaves) > MAX_INPUTS:
            return None
    # the inputs were checked up to the group's root; from there to i they must stay unchanged
    moves = dict(g.moves)
    pinned = ctx.pinned
    root = g.root
    for n in g.leaves:
        for q, kind in uses.after(n, root - 1):
            if q >= i:
                break
            if kind == READ and n not in moves:
                continue
            # the root writing its result into an input's name (a pooled name: t2 = t1 * d; t1 = t2 + c): that write
            # is the one this fusion removes, and the result is read by i alone, so the input keeps its value
            if q == root and n == name and n not in moves:
                continue
            # a temporary input deleted before i (its handle dropped): it lives until the fused instruction instead
            if kind == DELETE and n not in moves and not pinned(n) and uses.untouched(n, q, i, allowed=0):
                moves[n] = q
                break
            return None
    return moves


def _render(tree: Any, inputs: dict[str, int]) -> tuple[str, int]:
    """The expression's text and the precedence of its top operator."""
    if tree[0] == "leaf":
        return f"in{inputs.setdefault(tree[1], len(inputs))}", ATOM
    _, form, scalar, children = tree
    texts = []
    for need, child in zip(form.needs, children):
        text, prec = _render(child, inputs)
        texts.append(text if prec >= need else f"({text})")
    return form.text.format(*texts, s=scalar), form.precedence


def _emit(rw: Rewrite, g: _Group, deletes: list[str]) -> None:
    b = rw.bounds[g.root]
    inputs: dict[str, int] = {}
    expr = _render(g.tree, inputs)[0]
    out = b.outs[0]
    assert out is not None
    names = sorted(inputs, key=inputs.__getitem__)
    fused = Instr("fused", (Param.listtensor(names, out.dtype), Param.var(expr)), (b.instr.returns[0],), b.instr.meta)
    rw.edits[g.root] = (fused, *(deltensor(n, out.dtype) for n in deletes)) if deletes else fused
    for m in g.members:
        if m != g.root:
            rw.remove(m)
