"""The fused elementwise kernel on the device: CUDA source generated from the `fused` op's expression tree.

The expression (checked by `parse_fused`) becomes one C expression over the inputs, its numbers lifted into a
constants argument, so `in0 * 2.5 + exp(in1)` and `in0 * 3.0 + exp(in1)` share one compiled kernel: kernels are
cached by structure (lifted text, input count, dtype), in memory and, compiled, on disk. Each structure has a
contiguous kernel (every input shaped like the output) and a broadcasting one (per-input strides). float64 computes
in double; float32, float16 and bfloat16 compute in float and round once into the output, as on the CPU.
fusedcolsum runs the fused kernel and then reduce's sum over axis 0.
"""

from __future__ import annotations

import ast
import hashlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from deepx_core.cache import memoize
from deepx_core.ir.dtypes import FLOATS
from deepx_core.ir.ops import OpDef, expr_instance, parse_fused
from deepxd.kernels.cuda._cexpr import render
from deepxd.kernels.cuda._src import HEADER, MAXD, ctype, dims, dims_format, divisors
from deepxd.kernels.cuda.elementwise import _strides, collapse

if TYPE_CHECKING:
    from deepxd.kernels.cuda import CudaExecutor, DeviceTensor

MAX_INPUTS = 16
MAX_CONSTANTS = 32

SUPPORT = {"fused": frozenset(FLOATS), "fusedcolsum": frozenset({"float32", "float64"})}


class Structure:
    """A compiled-expression plan: the C expression over x0.. and c.v[k], and the constants in order."""

    def __init__(self, text: str, constants: tuple[float, ...], n_inputs: int, used: tuple[int, ...]) -> None:
        self.text = text
        self.constants = constants
        self.n_inputs = n_inputs
        self.used = used
        self.key = hashlib.sha1(f"{n_inputs}|{text}".encode()).hexdigest()[:16]


@memoize("kernels.cuda.fused.lower", 4096)
def lower(expr: str, n_inputs: int) -> Structure:
    """The C form of a fused expression (cached by expression): rendered as the elementwise kernels' expressions
    are, over x0, x1, ... with its numbers lifted into c.v[k]."""
    tree = parse_fused(expr, n_inputs)
    constants: list[float] = []
    index: dict[tuple[type, Any], int] = {}

    def lift(value: float) -> str:
        k = index.setdefault((type(value), value), len(constants))
        if k == len(constants):
            constants.append(float(value))
        return f"(A)c.v[{k}]"

    used = sorted({int(n.id[2:]) for n in ast.walk(tree) if isinstance(n, ast.Name) and n.id.startswith("in")})
    names = {f"in{i}": f"x{i}" for i in used}
    text = render(tree, names, constant=lift).text
    return Structure(text, tuple(constants), n_inputs, tuple(used))


_CONSTS = f"struct Consts {{ double v[{MAX_CONSTANTS}]; }};\n"


def _params(n: int) -> str:
    return ", ".join(f"const T* in{i}" for i in range(n))


@memoize("kernels.cuda.fused.source", 1024)
def source(key: str, text: str, n: int, used: tuple[int, ...], dtype: str) -> str:
    loads_c = "".join(f"        A x{i} = ld(in{i}[i]);\n" for i in used)
    loads_s = "".join(f"        A x{i} = ld(in{i}[o{i}]);\n" for i in used)
    offs = "".join(f"ll o{i} = 0; " for i in used)
    step = "".join(f"o{i} += k * sts.d[{i}].v[d]; " for i in used) or "(void)k;"
    return (HEADER + f"typedef {ctype(dtype)} T;\ntypedef typename Acc<T>::type A;\n" + _CONSTS +
            f"struct DimsN {{ Dims d[{max(n, 1)}]; }};\n"
            f'extern "C" __global__ void fused_c(T* out, {_params(n)}, ll n, Consts c) {{\n'
            f"    GRID_STRIDE(i, n) {{\n{loads_c}        out[i] = st<T>({text});\n    }}\n}}\n"
            f'extern "C" __global__ void fused_s(T* out, {_params(n)}, ll n, Consts c, int nd, Dims shape, '
            f"Dims div, DimsN sts) {{\n"
            f"    GRID_STRIDE(i, n) {{\n        {offs}\n"
            f"        FOR_COORDS(i, nd, shape, div, {step})\n"
            f"{loads_s}        out[i] = st<T>({text});\n    }}\n}}\n")


def sources() -> list[tuple[str, str]]:
    return []  # generated per expression structure, compiled on first use


def fused(ex: CudaExecutor, inputs: list[DeviceTensor], expr: str, out: DeviceTensor) -> bool:
    n_in = len(inputs)
    if n_in > MAX_INPUTS:
        return False
    plan = lower(expr, n_in)
    if len(plan.constants) > MAX_CONSTANTS:
        return False
    n = out.size
    if n == 0:
        return True
    dt = out.dname
    src = source(plan.key, plan.text, n_in, plan.used, dt)
    consts = list(plan.constants) + [0.0] * (MAX_CONSTANTS - len(plan.constants))
    key = f"fused:{plan.key}:{dt}"
    ptrs = [t.ptr for t in inputs]
    if all(t.shape == out.shape for t in inputs):
        f = ex.function(key, src, "fused_c", "P" + "P" * n_in + "q" + f"{MAX_CONSTANTS}d", "fused")
        ex.launch("fused", f, ex.grid(n), (256, 1, 1), out.ptr, *ptrs, n, *consts)
        return True
    shape, sts = collapse(out.shape, *(_strides(t.shape, out.shape) for t in inputs))
    if len(shape) > MAXD:
        return False
    f = ex.function(key, src, "fused_s", "P" + "P" * n_in + "q" + f"{MAX_CONSTANTS}d" + "i" + dims_format(2 + n_in),
                    "fused")
    flat: list[int] = []
    for s in sts:
        flat += dims(s)
    ex.launch("fused", f, ex.grid(n), (256, 1, 1), out.ptr, *ptrs, n, *consts, len(shape), *dims(shape),
              *divisors(shape, n), *flat)
    return True


def fusedcolsum(ex: CudaExecutor, inputs: list[DeviceTensor], expr: str, keepdims: bool, out: DeviceTensor,
                sums: DeviceTensor) -> bool:
    """fused, then the sum over axis 0 of its result: the two kernels the instruction stands for, one after the
    other on the stream (a GPU reads the result back at its memory's speed; one kernel for both would save that)."""
    if not fused(ex, inputs, expr, out):
        return False
    from deepxd.kernels.cuda import reduce

    return reduce.sum(ex, out, (0,), keepdims, sums)


def expr_kernel(op: OpDef) -> Callable[..., bool]:
    """The CUDA kernel of an op of family "expr": its expression (OpDef.expr), run as a fused one."""

    def kernel(ex: CudaExecutor, *values: Any) -> bool:
        inputs, text = expr_instance(op, values[:-1])
        return fused(ex, inputs, text, values[-1])

    kernel.__name__ = op.name
    return kernel
