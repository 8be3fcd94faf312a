"""The fused language as CUDA C: one renderer for the elementwise kernels (each op's `expr`) and the fused kernels (a
`fused` instruction's expression).

The language is `parse_fused`'s (deepx_core/ir/ops.py): numbers, names, + - * / **, unary -, one comparison at a time
(1 where it holds, 0 where not) and the calls of FUSED_FUNCTIONS. A value computes in the kernel's compute type `A`,
and what an operator means depends on the domain it computes in:

- FLOAT: A is float (float32 and the 16-bit floats) or double; IEEE operations and the math library, which the
  kernels are compiled to keep (no fast-math).
- INT: A is long long (integer and bool tensors, an integer scalar), as the CPU kernels compute: / truncates and
  sets the error flag on a zero divisor (`idiv`), ** is exact for a non-negative exponent (`ipw`).
- MIXED: an integer tensor with a float scalar, computed in double as numpy promotes; a division by the tensor (an
  integer) still sets the flag on zero (`fdiv`).
"""

from __future__ import annotations

import ast
import math
from collections.abc import Callable, Collection, Mapping
from typing import NamedTuple

from deepx_core.errors import DeepxError

FLOAT, INT, MIXED = "float", "int", "mixed"

_BINARY = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/"}
_COMPARE = {ast.Gt: ">", ast.Lt: "<", ast.GtE: ">=", ast.LtE: "<=", ast.Eq: "==", ast.NotEq: "!="}

#: FUSED_FUNCTIONS as C, per domain (math library overloads take float and double alike)
CALLS: dict[str, dict[str, str]] = {
    FLOAT: {"sqrt": "sqrt", "exp": "exp", "log": "log", "sin": "sin", "cos": "cos", "tan": "tan", "tanh": "tanh",
            "abs": "fabs", "maximum": "mx", "minimum": "mn", "floor": "floor", "ceil": "ceil", "round": "rint",
            "trunc": "trunc", "log1p": "log1p", "expm1": "expm1", "fmod": "fmod", "remainder": "pyrem",
            "floordiv": "pyfloordiv"},
    INT: {"abs": "iabs", "maximum": "mx", "minimum": "mn"},
}
CALLS[MIXED] = CALLS[FLOAT]

#: the C functions the INT and MIXED forms call, beside the header's mx, mn and ipow (elementwise modules include it)
HELPERS = r"""
__device__ __forceinline__ ll flag(int* err) { atomicExch(err, 1); return 0; }
__device__ __forceinline__ ll idiv(ll x, ll y, int* err) { return y == 0 ? flag(err) : x / y; }
__device__ __forceinline__ double fdiv(double x, double y, int* err) { return y == 0 ? (double)flag(err) : x / y; }
__device__ __forceinline__ ll iabs(ll x) { return x < 0 ? -x : x; }
__device__ __forceinline__ ll ipw(ll b, ll e) { return e >= 0 ? ipow(b, e) : (ll)pow((double)b, (double)e); }
"""


class CExpr(NamedTuple):
    """A rendered expression: its C text, whether it may set the error flag (an integer division by a tensor's
    zero), and whether it divides by the scalar itself (a zero scalar is refused before the launch, as the CPU
    refuses it)."""

    text: str
    flags: bool = False
    scalar_divisor: bool = False


def inline(value: float) -> str:
    """A number written into the kernel, in the compute type."""
    if isinstance(value, int):
        return f"(A){value}"
    if math.isnan(value):
        return "(A)(0.0 / 0.0)"
    if math.isinf(value):
        return f"(A)({'-' if value < 0 else ''}1.0 / 0.0)"
    return f"(A){value!r}"


def render(tree: ast.AST, names: Mapping[str, str], *, domain: str = FLOAT, integer: Collection[str] = (),
           scalar: str = "", constant: Callable[[float], str] = inline) -> CExpr:
    """`tree` (checked by parse_fused, or an op's expression) as C in `domain`. names: each name's C text; integer:
    the names whose values are integers (in MIXED); scalar: the name of the scalar (to tell a division by it);
    constant: how a number is written (inline, or lifted into a kernel argument by the caller)."""
    calls = CALLS[domain]
    flags = scalar_divisor = False
    whole = domain == INT

    def is_integer(node: ast.AST) -> bool:
        if isinstance(node, ast.Name):
            return whole or node.id in integer
        if isinstance(node, ast.Constant):
            return type(node.value) is int
        if isinstance(node, ast.UnaryOp):
            return is_integer(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in (ast.Add, ast.Sub, ast.Mult):
            return is_integer(node.left) and is_integer(node.right)
        return False

    def c(node: ast.AST) -> str:
        nonlocal flags, scalar_divisor
        if isinstance(node, ast.Expression):
            return c(node.body)
        if isinstance(node, ast.Constant):
            value = node.value
            if type(value) not in (int, float):
                raise DeepxError(f"cuda: constant {value!r} is not a number")
            if whole and type(value) is float and not value.is_integer():
                raise DeepxError(f"cuda: {value!r} is not an integer, and this computes in integers")
            return constant(value)  # type: ignore[arg-type]
        if isinstance(node, ast.Name):
            if node.id not in names:
                raise DeepxError(f"cuda: unknown name {node.id!r}")
            return names[node.id]
        if isinstance(node, ast.BinOp):
            left, right = c(node.left), c(node.right)
            if isinstance(node.op, ast.Pow):
                return f"{'ipw' if whole else 'pow'}({left}, {right})"
            if isinstance(node.op, ast.Div):
                by_scalar = isinstance(node.right, ast.Name) and node.right.id == scalar
                scalar_divisor |= by_scalar
                if domain != FLOAT and is_integer(node.right):
                    flags |= not by_scalar  # a zero scalar is refused before the launch
                    return f"{'idiv' if whole else 'fdiv'}({left}, {right}, err)"
            return f"({left} {_BINARY[type(node.op)]} {right})"
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            inner = c(node.operand)
            return f"(-{inner})" if isinstance(node.op, ast.USub) else inner
        if isinstance(node, ast.Compare) and len(node.ops) == 1:
            return f"((A)({c(node.left)} {_COMPARE[type(node.ops[0])]} {c(node.comparators[0])}))"
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.keywords:
            fn = calls.get(node.func.id)
            if fn is None:
                raise DeepxError(f"cuda: {node.func.id}() does not compute in {domain} ({', '.join(calls)} do)")
            return f"{fn}({', '.join(c(a) for a in node.args)})"
        raise DeepxError(f"cuda: cannot render {ast.unparse(node) if isinstance(node, ast.expr) else node!r}")

    text = c(tree)
    return CExpr(text, flags, scalar_divisor)
