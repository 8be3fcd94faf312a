"""The fused elementwise kernel: one expression over several inputs, made by the compiler's fuse pass.

An expression (`in0 * 2.5 + exp(in1)`, checked by `parse_fused`) is compiled once per structure: its numbers become
constants of the compute dtype, so `in0 * 2.5` and `in0 * 3.0` share one compiled form. Two backends evaluate it:

- "numpy" (the default): the expression becomes a tape of numpy ufunc calls over cache-sized blocks (64K elements),
  written in place into a few block buffers, so that no full-size temporary is ever made; large tensors are split
  across a small thread pool (numpy releases the GIL inside its loops).
- "numexpr": `numexpr.evaluate(..., out=)`, its compiled programs cached by numexpr under the structure string.

On this project's machines numexpr (built without Intel VML) evaluates float32 exp, sqrt and abs one element at a time
through libm and loses to numpy's SIMD loops; docs/compiler.md has the measurement (bench/fusion.py) and the choice.
float64 computes in float64; float32, float16 and bfloat16 compute in float32 and round once into the output.
"""

from __future__ import annotations

import ast
import itertools
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import numpy as np

from deepx_core.cache import Cache
from deepx_core.errors import DeepxError
from deepx_core.ir.ops import OpDef, expr_instance, parse_fused
from deepxd.kernels.cpu import native
from deepxd.kernels.cpu._util import F32, F64
from deepxd.kernels.cpu.reduce import sum as reduce_sum

#: elements per block of the numpy backend: a handful of float32 block buffers stay in a core's L2 cache
BLOCK = 1 << 16
#: the numpy backend uses threads only above this many elements per thread
THREAD_MIN = 1 << 19
MAX_THREADS = native.MAX_THREADS  # one pool size for both backends

_BINARY: dict[type, np.ufunc] = {ast.Add: np.add, ast.Sub: np.subtract, ast.Mult: np.multiply, ast.Div: np.divide,
                                 ast.Pow: np.power}
_COMPARE: dict[type, np.ufunc] = {ast.Gt: np.greater, ast.Lt: np.less, ast.GtE: np.greater_equal,
                                  ast.LtE: np.less_equal, ast.Eq: np.equal, ast.NotEq: np.not_equal}
_CALLS: dict[str, np.ufunc] = {"sqrt": np.sqrt, "exp": np.exp, "log": np.log, "sin": np.sin, "cos": np.cos,
                               "tan": np.tan, "tanh": np.tanh, "abs": np.absolute, "maximum": np.maximum,
                               "minimum": np.minimum, "floor": np.floor, "ceil": np.ceil, "round": np.rint,
                               "trunc": np.trunc, "log1p": np.log1p, "expm1": np.expm1, "fmod": np.fmod,
                               "remainder": np.remainder, "floordiv": np.floor_divide}
#: the calls numexpr lacks (its % is not exact): expressions making them run on the numpy backend
_NOT_NUMEXPR = ("fmod(", "remainder(", "floordiv(")

# an operand of a tape step: (0, k) input k, (1, k) constant k, (2, k) block register k
Ref = tuple[int, int]


class Step(NamedTuple):
    ufunc: np.ufunc
    operands: tuple[Ref, ...]
    dest: int  # register; -1: the output block


class Plan(NamedTuple):
    """A compiled expression: the numexpr text over in<k> and c<k>, its constants, and the numpy tape."""

    text: str
    constants: tuple[float, ...]
    steps: tuple[Step, ...]
    result: Ref  # where the value ends up when the tape does not write the output itself (a bare input/constant)
    registers: int
    typed: dict[np.dtype, tuple[Any, ...]]  # the constants as scalars of each compute dtype, made on first use
    run: Callable[..., None]  # run(inputs, constants, registers, out) on one block
    small: tuple[Step, ...]  # the steps `run` takes on a one-element block: none writes its own operand


_plans: Cache[tuple[str, int], Plan] = Cache("kernels.cpu.fused.plans", 4096)


def compile_expr(expr: str, n_inputs: int) -> Plan:
    """The plan of `expr` (cached by expression and input count)."""
    key = (expr, n_inputs)
    plan = _plans.get(key)
    if plan is None:
        plan = _plans.put(key, _compile(parse_fused(expr, n_inputs)))
    return plan


def _compile(tree: ast.Expression) -> Plan:
    constants: list[float] = []
    const_index: dict[tuple[type, Any], int] = {}

    class Lift(ast.NodeTransformer):
        def visit_Constant(self, node: ast.Constant) -> ast.AST:
            k = const_index.setdefault((type(node.value), node.value), len(constants))
            if k == len(constants):
                constants.append(float(node.value))  # type: ignore[arg-type]
            return ast.copy_location(ast.Name(f"c{k}", ast.Load()), node)

    lifted = Lift().visit(ast.parse(ast.unparse(tree), mode="eval"))
    text = ast.unparse(lifted)

    # a DAG of distinct subexpressions, in evaluation order, each with how many times it is used
    nodes: list[tuple[np.ufunc | None, tuple[int, ...], Ref | None]] = []  # (ufunc, operand node ids, leaf ref)
    ids: dict[str, int] = {}

    def visit(node: ast.expr) -> int:
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.UAdd):
            return visit(node.operand)
        key = ast.dump(node)
        if key in ids:
            return ids[key]
        entry: tuple[np.ufunc | None, tuple[int, ...], Ref | None]
        if isinstance(node, ast.Name):
            leaf: Ref = (0, int(node.id[2:])) if node.id.startswith("in") else (1, int(node.id[1:]))
            entry = (None, (), leaf)
        elif isinstance(node, ast.BinOp):
            entry = (_BINARY[type(node.op)], (visit(node.left), visit(node.right)), None)
        elif isinstance(node, ast.UnaryOp):
            entry = (np.negative, (visit(node.operand),), None)
        elif isinstance(node, ast.Compare):  # true/false written as 1/0 into a block of the compute dtype
            entry = (_COMPARE[type(node.ops[0])], (visit(node.left), visit(node.comparators[0])), None)
        elif isinstance(node, ast.Call):
            assert isinstance(node.func, ast.Name)
            entry = (_CALLS[node.func.id], tuple(visit(a) for a in node.args), None)
        else:  # parse_fused admits nothing else
            raise DeepxError(f"fused: cannot compile {ast.unparse(node)!r}")
        nodes.append(entry)
        ids[key] = len(nodes) - 1
        return ids[key]

    assert isinstance(lifted, ast.Expression)
    root = visit(lifted.body)
    steps, result, n_regs = _allocate(nodes, root, in_place=True)
    # numpy (2.x) takes a slow path for a ufunc writing into its own operand when the arrays have one element
    # (+0.5 us a step): one-element blocks run a tape that never does
    small, _, n_small = _allocate(nodes, root, in_place=False)
    return Plan(text, tuple(constants), tuple(steps), result, max(n_regs, n_small), {},
                _generate(steps, result, small), tuple(small))


def _allocate(nodes: Sequence[tuple[np.ufunc | None, tuple[int, ...], Ref | None]], root: int,
              in_place: bool) -> tuple[list[Step], Ref, int]:
    """The tape's steps, where the value ends up, and how many block registers it uses. A node's register is freed
    after its last use and reused: by the step that reads it (in place, fewest buffers) when `in_place`, else only by
    a later step."""
    uses = [0] * len(nodes)
    for _, operands, _ in nodes:
        for o in operands:
            uses[o] += 1
    where: dict[int, Ref] = {}
    free: list[int] = []
    n_regs = 0
    steps: list[Step] = []
    for i, (ufunc, operands, leaf) in enumerate(nodes):
        if ufunc is None:
            assert leaf is not None
            where[i] = leaf
            continue
        refs = tuple(where[o] for o in operands)
        released = []
        for o in operands:
            uses[o] -= 1
            if uses[o] == 0 and where[o][0] == 2 and where[o][1] not in free and where[o][1] not in released:
                released.append(where[o][1])
        if in_place:
            free.extend(released)
        if i == root:
            steps.append(Step(ufunc, refs, -1))
            where[i] = (2, -1)
            continue
        reg = next((r for k, r in refs[::-1] if k == 2 and r in free), None) if in_place else None
        if reg is None:
            reg = free.pop() if free else n_regs
            n_regs = max(n_regs, reg + 1)
        else:
            free.remove(reg)
        if not in_place:
            free.extend(released)
        steps.append(Step(ufunc, refs, reg))
        where[i] = (2, reg)
    return steps, where[root], n_regs


# ---------------------------------------------------------------- the numpy backend


def _generate(steps: Sequence[Step], result: Ref, small: Sequence[Step]) -> Callable[..., None]:
    """The tape as straight-line Python calling the ufuncs (no interpretation per step): generated from the plan's
    integers and the ufuncs above only, never from the expression's text. `small` runs on one-element blocks."""
    space = ("i", "c", "r")
    ufuncs: dict[np.ufunc, str] = {}

    def body(tape: Sequence[Step], indent: str) -> list[str]:
        lines = []
        for _, (ufunc, operands, dest) in enumerate(tape):
            name = ufuncs.setdefault(ufunc, f"u{len(ufuncs)}")
            args = ", ".join(f"{space[kind]}[{index}]" for kind, index in operands)
            lines.append(f"{indent}{name}({args}, out={'out' if dest < 0 else f'r[{dest}]'})")
        if not tape:
            lines.append(f"{indent}out[...] = {space[result[0]]}[{result[1]}]")
        return lines

    lines = ["def tape(i, c, r, out):"]
    if steps:
        lines += ["    if len(out) == 1:", *body(small, "        "), "        return"]
    lines += body(steps, "    ")
    namespace: dict[str, Any] = {name: ufunc for ufunc, name in ufuncs.items()}
    namespace["__name__"] = __name__  # numpy's RuntimeWarnings are filtered by module (see __init__.py)
    exec(compile("\n".join(lines), "<fused tape>", "exec"), namespace)
    return namespace["tape"]


def _run_tape(plan: Plan, ins: Sequence[np.ndarray], consts: Sequence[Any], out: np.ndarray,
              bufs: list[np.ndarray]) -> None:
    """Evaluate the tape on one block: `ins`, `out` and the registers `bufs` are 1-d blocks of one length (inputs
    may be broadcast views)."""
    plan.run(ins, consts, bufs, out)


def _flat_blocks(plan: Plan, ins: Sequence[np.ndarray], consts: Sequence[Any], out: np.ndarray, lo: int,
                 hi: int) -> None:
    cdt = out.dtype
    regs = [np.empty(min(BLOCK, hi - lo), cdt) for _ in range(plan.registers)]
    for i in range(lo, hi, BLOCK):
        j = min(i + BLOCK, hi)
        _run_tape(plan, [a[i:j] for a in ins], consts, out[i:j], regs if j - i == BLOCK else [r[:j - i] for r in regs])


def _iter_blocks(plan: Plan, ins: Sequence[np.ndarray], consts: Sequence[Any], out: np.ndarray,
                 cdt: np.dtype) -> None:
    """Broadcasting, strided or low-precision operands: numpy's buffered iterator hands out 1-d blocks, casting to
    and from the compute dtype as needed."""
    it = np.nditer([*ins, out], flags=["external_loop", "buffered", "zerosize_ok", "copy_if_overlap"],  # type: ignore[call-overload]
                   op_flags=[["readonly"]] * len(ins) + [["writeonly"]], op_dtypes=[cdt] * (len(ins) + 1),
                   casting="unsafe", buffersize=BLOCK)
    regs = [np.empty(BLOCK, cdt) for _ in range(plan.registers)]
    with it:
        for chunk in it:
            *blocks, o = chunk
            n = o.shape[0]
            _run_tape(plan, blocks, consts, o, regs if n == BLOCK else [r[:n] for r in regs])


_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _threads() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=MAX_THREADS, thread_name_prefix="deepx-fused")
        return _pool


def _after_fork_in_child() -> None:
    """A forked child has none of the pool's threads: it makes a pool of its own when it needs one."""
    global _pool, _pool_lock
    _pool, _pool_lock = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _split(total: int) -> list[tuple[int, int]]:
    parts = max(1, min(MAX_THREADS, total // THREAD_MIN))
    edges = [total * k // parts for k in range(parts + 1)]
    return [(edges[k], edges[k + 1]) for k in range(parts) if edges[k + 1] > edges[k]]


def evaluate_numpy(plan: Plan, inputs: Sequence[np.ndarray], out: np.ndarray, cdt: np.dtype) -> None:
    consts = plan.typed.get(cdt)
    if consts is None:
        consts = plan.typed[cdt] = tuple(cdt.type(c) for c in plan.constants)
    shape = out.shape
    flat = out.dtype == cdt and out.flags.c_contiguous
    if flat:
        for a in inputs:
            if a.shape != shape or a.dtype != cdt or not a.flags.c_contiguous:
                flat = False
                break
    if flat:
        n = out.size
        flat_out = out if out.ndim == 1 else out.reshape(-1)
        flat_in = [a if a.ndim == 1 else a.reshape(-1) for a in inputs]
        if n <= BLOCK:  # one block: every input is read before the last step writes the output
            _run_tape(plan, flat_in, consts, flat_out, [np.empty(n, cdt) for _ in range(plan.registers)])
            return
        if any(a is not out and np.may_share_memory(a, out) and not _same_buffer(a, out) for a in inputs):
            flat_in = [a.copy() for a in flat_in]  # a partial overlap: a block could read what another wrote
        ranges = _split(n)
        if len(ranges) == 1:
            _flat_blocks(plan, flat_in, consts, flat_out, 0, n)
        else:
            for f in [_threads().submit(_flat_blocks, plan, flat_in, consts, flat_out, lo, hi) for lo, hi in ranges]:
                f.result()
        return
    parts = min(MAX_THREADS, out.size // THREAD_MIN, shape[0] if shape else 1)
    if parts > 1:  # split the rows between threads
        views = [np.broadcast_to(a, shape) for a in inputs]
        rows = [shape[0] * k // parts for k in range(parts + 1)]
        futures = [_threads().submit(_iter_blocks, plan, [v[r0:r1] for v in views], consts, out[r0:r1], cdt)
                   for r0, r1 in itertools.pairwise(rows)]
        for f in futures:
            f.result()
        return
    _iter_blocks(plan, inputs, consts, out, cdt)


def _same_buffer(a: np.ndarray, b: np.ndarray) -> bool:
    return a.__array_interface__["data"][0] == b.__array_interface__["data"][0] and a.strides == b.strides


# ---------------------------------------------------------------- the numexpr backend


def evaluate_numexpr(plan: Plan, inputs: Sequence[np.ndarray], out: np.ndarray, cdt: np.dtype) -> None:
    import numexpr

    if any(call in plan.text for call in _NOT_NUMEXPR):
        evaluate_numpy(plan, inputs, out, cdt)
        return
    names: dict[str, Any] = {f"in{k}": (a if a.dtype == cdt else a.astype(cdt)) for k, a in enumerate(inputs)}
    names.update((f"c{k}", c) for k, c in enumerate(plan.typed.get(cdt) or [cdt.type(c) for c in plan.constants]))
    direct = out.dtype == cdt and not any(np.may_share_memory(a, out) for a in inputs)
    target = out if direct else np.empty(out.shape, cdt)
    numexpr.evaluate(plan.text, local_dict=names, global_dict={}, out=target, casting="unsafe")
    if not direct:
        out[...] = target


BACKENDS: dict[str, Callable[[Plan, Sequence[np.ndarray], np.ndarray, np.dtype], None]] = {
    "native": evaluate_numpy,  # where native.fused declines
    "numpy": evaluate_numpy,
    "numexpr": evaluate_numexpr,
}
_backend = "native"


def set_backend(name: str) -> str:
    """Choose the backend ("native", "numpy" or "numexpr") for the fused kernels of this process; returns the
    previous one."""
    global _backend
    if name not in BACKENDS:
        raise DeepxError(f"fused: backend {name!r} is not one of {', '.join(BACKENDS)}")
    previous, _backend = _backend, name
    return previous


def backend() -> str:
    return _backend


def fused(inputs, expr, out):
    plan = compile_expr(expr, len(inputs))
    if _backend == "native" and native.fused(plan, inputs, out):
        return
    cdt = F64 if out.dtype == F64 else F32
    BACKENDS[_backend](plan, inputs, out, cdt)


def fusedcolsum(inputs, expr, keepdims, out, sums):
    """fused, with out's column sums made in the same native C loop; where that loop declines (not compiled yet, a
    layout it does not take), fused and then sum, which give the same bits."""
    if _backend == "native" and sums.flags.c_contiguous:
        if native.fused(compile_expr(expr, len(inputs)), inputs, out, sums.reshape(-1)):
            return
    fused(inputs, expr, out)
    reduce_sum(out, (0,), keepdims, sums)


def expr_kernel(op: OpDef) -> Callable[..., None]:
    """The CPU kernel of an op of family "expr": its expression (OpDef.expr), run as a fused one."""

    def kernel(*values: Any) -> None:
        inputs, text = expr_instance(op, values[:-1])
        fused(inputs, text, values[-1])

    kernel.__name__ = op.name
    return kernel
