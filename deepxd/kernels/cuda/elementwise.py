"""Elementwise kernels: arithmetic, rounding, comparisons, activations and todtype, one CUDA module per dtype.

An op's kernel is its catalogue expression (`OpDef.expr`) rendered as C (`_cexpr.render`) over `x` (its first
tensor's value in the compute type A: float for the 16-bit floats, long long for integers and bool), `y` (its second
tensor's) and `S` (its scalar). The few ops the fused language cannot say have a C form here (`_SPECIAL`). Each op has
a contiguous kernel (4 elements per thread in 16-byte packs where the pointers allow, grid-stride) and, with two
tensors, a strided kernel that broadcasts through per-input strides. The results follow the CPU kernels: the 16-bit
floats compute in float32 and round once, integers wrap, integer division truncates and refuses a zero divisor, and a
Python float scalar with an integer tensor computes in float64 (the `_f` kernels).

The catalogue's ops share their dtype's module (its ops are read when this module is imported: an op with a family
other than "expr" has kernels in some module, so it is there by then); an op of family "expr", whose entry is all
there is of it, gets a module of its own per dtype on first use, from the same templates.
"""

from __future__ import annotations

import ast
import hashlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

from deepx_core.cache import memoize
from deepx_core.errors import DeepxError
from deepx_core.ir.ops import OPS, OpDef
from deepxd.kernels.cuda._cexpr import FLOAT, HELPERS, INT, MIXED, CExpr, render
from deepxd.kernels.cuda._src import CTYPES, FLOAT_TYPES, HEADER, INT_TYPES, MAXD, ctype, dims, dims_format, divisors

if TYPE_CHECKING:
    from deepxd.kernels.cuda import CudaExecutor, DeviceTensor

BOOL = "bool"

# what the fused language cannot say, as C over x, y, S and the launch's doubles s0 (the scalar) and s1 (eps), per
# domain (BOOL for bool tensors): erf, exact gelu and its gradient (numpy and numexpr, which run the CPU's fused
# kernels, have no erf), gelu's tanh forms (a string argument picks the form), bitwise not, and comparisons within
# eps (two scalars)
_CLOSE = "(s1 == 0 ? x == y : fabs((double)x - (double)y) <= s1)"
_CLOSE_S = "(s1 == 0 ? x == S : fabs((double)x - (double)S) <= s1)"
_CLOSE_F = "(s1 == 0 ? x == S : fabs((double)x - s0) <= s1)"
_CLOSE_MIXED = "(s1 == 0 ? (double)x == s0 : fabs((double)x - s0) <= s1)"
_SPECIAL: dict[str, dict[str, str]] = {
    "erf": {FLOAT: "erf(x)"},
    "gelu": {FLOAT: "(A)0.5 * x * ((A)1 + erf(x * (A)0.70710678118654752440))"},
    "gelu_tanh": {FLOAT: "(A)0.5 * x * ((A)1 + tanh((A)0.79788456080286535588 * (x + (A)0.044715 * x * x * x)))"},
    "gelugrad": {FLOAT: "y * gelugrad_exact<A>(x)"},
    "gelugrad_tanh": {FLOAT: "y * gelugrad_tanh<A>(x)"},
    "invert": {INT: "~x", BOOL: "!x"},
    "equal": {FLOAT: _CLOSE, INT: _CLOSE, BOOL: _CLOSE},
    "notequal": {FLOAT: f"!{_CLOSE}", INT: f"!{_CLOSE}", BOOL: f"!{_CLOSE}"},
    "equalscalar": {FLOAT: _CLOSE_F, INT: _CLOSE_S, BOOL: _CLOSE_S, MIXED: _CLOSE_MIXED},
    "notequalscalar": {FLOAT: f"!{_CLOSE_F}", INT: f"!{_CLOSE_S}", BOOL: f"!{_CLOSE_S}", MIXED: f"!{_CLOSE_MIXED}"},
}
#: a special form's op, where the form is not named after it
_FORM_OF = {"gelu_tanh": "gelu", "gelugrad_tanh": "gelugrad"}
#: the functions the special forms call: gelu's gradient for gelu's input x (gelugrad: y is the upstream gradient),
#: written as the CPU's kernels are (deepxd/kernels/cpu/native.py): Phi(x) from erfc, no cancellation in the negative
#: tail; the tanh form with s = (1 + tanh(u))/2 = 1/(1 + w) or w/(1 + w), w = exp(-2|u|), and s (1 - s) = w d^2,
#: d = 1/(1 + w), so that 1 + tanh(u) is never formed (it loses every digit below -4 in float32)
_SPECIAL_C = r"""
template <typename A> __device__ __forceinline__ A gelugrad_exact(A x) {
    return (A)0.5 * erfc(x * (A)-0.70710678118654752440) + x * (A)0.39894228040143267794 * exp((A)-0.5 * x * x);
}
template <typename A> __device__ __forceinline__ A gelugrad_tanh(A x) {
    const A k = (A)0.79788456080286535588;
    A x2 = x * x, u = k * (x + (A)0.044715 * x * x2);
    A w = exp((A)-2 * fabs(u)), d = (A)1 / ((A)1 + w);
    A vdu = (A)2 * x * k * ((A)1 + (A)0.134145 * x2), z = (A)0 * x;  // 2 x u'; z: 0, nan for an infinite x
    return u >= (A)0 ? d * ((A)1 + vdu * (w == (A)0 ? z : w * d)) : w * d * ((A)1 + vdu * (w == (A)0 ? z : d));
}
"""


class Form(NamedTuple):
    """One kernel of an op for one dtype: its name in the module, its C, whether it computes in double (an integer
    tensor with a float scalar), and whether it reads two tensors."""

    name: str
    code: CExpr
    mixed: bool
    binary: bool


def _kind(dtype: str) -> str:
    return FLOAT if dtype in FLOAT_TYPES else INT if dtype in INT_TYPES else BOOL if dtype == "bool" else ""


@memoize("kernels.cuda.elementwise.tree", 1024)
def _tree(expr: str) -> ast.Expression:
    return ast.parse(expr, mode="eval")


def forms(op: OpDef, dtype: str) -> dict[str, Form]:
    """The kernels of `op` for A's dtype `dtype`, by name: its expression rendered for that dtype (and, for an
    integer dtype and an op with a scalar, once more for a float scalar: `<op>_f`), or its special forms. Empty where
    it has none (the op then runs its CPU kernel there)."""
    kind = _kind(dtype)
    tensors = [a.name for a in op.args if a.kind == "tensor"]
    if not kind or dtype not in op.dtypes or not 1 <= len(tensors) <= 2:
        return {}
    binary = len(tensors) == 2
    out: dict[str, Form] = {}
    specials = [name for name in _SPECIAL if _FORM_OF.get(name, name) == op.name]
    if specials:
        for name in specials:
            texts = _SPECIAL[name]
            if kind in texts:
                out[name] = Form(name, CExpr(texts[kind]), False, binary)
            if kind == INT and MIXED in texts:
                out[name + "_f"] = Form(name + "_f", CExpr(texts[MIXED]), True, binary)
        return out
    if not op.expr:
        return {}
    var = next((a.name for a in op.args if a.kind == "var"), "")
    names = dict(zip(tensors, ("x", "y")))
    if var:
        names[var] = "S"
    tree = _tree(op.expr)
    try:
        out[op.name] = Form(op.name, render(tree, names, domain=FLOAT if kind == FLOAT else INT, scalar=var), False,
                            binary)
        if kind != FLOAT and var:
            code = render(tree, names, domain=MIXED, integer=tensors, scalar=var)
            out[op.name + "_f"] = Form(op.name + "_f", code, True, binary)
    except DeepxError:
        return {}
    return out


_CONTIG = r"""
extern "C" __global__ void {name}_c(TC* c, const TA* a, const TA* b, ll n, double s0, double s1, ll si, int* err,
                                     int vec) {{
    typedef {acc} A;
    const {stype} S = {sval};
    (void)S; (void)b; (void)si; (void)s1; (void)err;
    ll nv = vec ? (n >> 2) : 0;
    const Pack<TA, 4>* av = (const Pack<TA, 4>*)a;
    Pack<TC, 4>* cv = (Pack<TC, 4>*)c;
    GRID_STRIDE(j, nv) {{
        Pack<TA, 4> pa = av[j];
        {loadb_vec}
        Pack<TC, 4> pc;
        #pragma unroll
        for (int k = 0; k < 4; ++k) {{
            A x = ld(pa.v[k]);
            {y_vec}
            pc.v[k] = st<TC>({expr});
        }}
        cv[j] = pc;
    }}
    for (ll j = nv * 4 + (ll)blockIdx.x * blockDim.x + threadIdx.x; j < n; j += (ll)gridDim.x * blockDim.x) {{
        A x = ld(a[j]);
        {y_one}
        c[j] = st<TC>({expr});
    }}
}}
"""

_STRIDED = r"""
extern "C" __global__ void {name}_s(TC* c, const TA* a, const TA* b, ll n, double s0, double s1, ll si, int* err,
                                     int nd, Dims shape, Dims div, Dims sa, Dims sb) {{
    typedef {acc} A;
    const {stype} S = {sval};
    (void)S; (void)si; (void)s1; (void)err;
    GRID_STRIDE(i, n) {{
        ll oa = 0, ob = 0;
        FOR_COORDS(i, nd, shape, div, oa += k * sa.v[d]; ob += k * sb.v[d];)
        A x = ld(a[oa]);
        A y = ld(b[ob]);
        c[i] = st<TC>({expr});
    }}
}}
"""

# one operand whole, the other a row repeated down it ([M, C] and [C], either way round: `swap` when A is the row),
# four elements a thread where C and the pointers allow (`vec`): a Linear's bias add
_ROWS = r"""
extern "C" __global__ void {name}_r(TC* c, const TA* a, const TA* b, ll n, double s0, double s1, ll si, int* err,
                                     ll cols, int swap, int vec) {{
    typedef {acc} A;
    const {stype} S = {sval};
    (void)S; (void)si; (void)s1; (void)err;
    const TA* whole = swap ? b : a;
    const TA* row = swap ? a : b;
    ll nv = vec ? (n >> 2) : 0;
    ll rv = cols >> 2;
    GRID_STRIDE(j, nv) {{
        Pack<TA, 4> pw = ((const Pack<TA, 4>*)whole)[j];
        Pack<TA, 4> pr = ((const Pack<TA, 4>*)row)[j % rv];
        Pack<TC, 4> pc;
        #pragma unroll
        for (int k = 0; k < 4; ++k) {{
            A x = ld(swap ? pr.v[k] : pw.v[k]);
            A y = ld(swap ? pw.v[k] : pr.v[k]);
            pc.v[k] = st<TC>({expr});
        }}
        ((Pack<TC, 4>*)c)[j] = pc;
    }}
    for (ll j = nv * 4 + (ll)blockIdx.x * blockDim.x + threadIdx.x; j < n; j += (ll)gridDim.x * blockDim.x) {{
        A x = ld(swap ? row[j % cols] : whole[j]);
        A y = ld(swap ? whole[j] : row[j % cols]);
        c[j] = st<TC>({expr});
    }}
}}
"""

_TODTYPE = r"""
extern "C" __global__ void todtype_{dst}(TD* c, const TA* a, ll n) {{
    GRID_STRIDE(i, n) c[i] = st<TD>(wide(a[i]));
}}
"""

CONTIG_FMT = "PPPqddqPi"
STRIDED_FMT = "PPPqddqPi" + dims_format(4)
ROWS_FMT = "PPPqddqPqii"


def _kernels(op: OpDef, dtype: str) -> str:
    """The C of `op`'s kernels in a module whose TA is `dtype`'s storage type."""
    bool_out = op.returns[0].dtypes == frozenset({"bool"})
    parts = []
    for form in forms(op, dtype).values():
        # the scalar: in the compute type for floats and the float-scalar kernels, as long long for integers
        acc, stype, sval = (("double", "A", "(A)s0") if form.mixed else
                            ("typename Acc<TA>::type", "A", "(A)s0") if dtype in FLOAT_TYPES else
                            ("typename Acc<TA>::type", "ll", "si"))
        b = form.binary
        text = "#define TC " + ("bool" if bool_out else "TA") + "\n"
        text += _CONTIG.format(name=form.name, acc=acc, stype=stype, sval=sval, expr=form.code.text,
                               loadb_vec="Pack<TA, 4> pb = ((const Pack<TA, 4>*)b)[j];" if b else "",
                               y_vec="A y = ld(pb.v[k]); (void)y;" if b else "",
                               y_one="A y = ld(b[j]); (void)y;" if b else "")
        if b:
            text += _STRIDED.format(name=form.name, acc=acc, stype=stype, sval=sval, expr=form.code.text)
            text += _ROWS.format(name=form.name, acc=acc, stype=stype, sval=sval, expr=form.code.text)
        parts.append(text + "#undef TC\n")
    return "".join(parts)


def _shared(op: OpDef) -> bool:
    """Whether the op's kernels are in its dtype's module (the others: family "expr", a module each)."""
    return op.family != "expr" and (bool(op.expr) or any(_FORM_OF.get(n, n) == op.name for n in _SPECIAL))


#: the ops of the dtype modules, as the catalogue has them when this module is imported
_SHARED = tuple(name for name, op in OPS.items() if _shared(op))


@memoize("kernels.cuda.elementwise.source", 64)
def source(dtype: str) -> str:
    """The module of every shared elementwise kernel of `dtype` (as A's dtype), and todtype from it."""
    parts = [HEADER, HELPERS, _SPECIAL_C, f"typedef {ctype(dtype)} TA;\n"]
    parts += [_kernels(OPS[name], dtype) for name in _SHARED if name in OPS]
    for dst, (td, _) in CTYPES.items():
        parts.append(f"#define TD {td}\n" + _TODTYPE.format(dst=dst) + "#undef TD\n")
    return "".join(parts)


@memoize("kernels.cuda.elementwise.own_source", 256)
def own_source(name: str, expr: str, dtype: str) -> str:
    """The module of one op's kernels for `dtype` (an op of family "expr"; its expression is part of the key)."""
    return HEADER + HELPERS + f"typedef {ctype(dtype)} TA;\n" + _kernels(OPS[name], dtype)


def sources() -> list[tuple[str, str]]:
    return [(source(d), f"elementwise ({d})") for d in CTYPES]


def _supported() -> dict[str, frozenset[str]]:
    sup = {name: frozenset(d for d in CTYPES if forms(OPS[name], d)) for name in _SHARED}
    sup["todtype"] = frozenset(CTYPES)
    return {k: v for k, v in sup.items() if v}


#: op -> dtypes with a CUDA kernel here (the op's A dtype)
SUPPORT = _supported()


# ---------------------------------------------------------------- launching


def _strides(shape: tuple[int, ...], out_shape: tuple[int, ...]) -> list[int]:
    """Element strides of a contiguous tensor of `shape` read as `out_shape` (broadcast dims: stride 0)."""
    st = [0] * len(out_shape)
    step = 1
    off = len(out_shape) - len(shape)
    for i in range(len(shape) - 1, -1, -1):
        if shape[i] != 1:
            st[off + i] = step
        step *= shape[i]
    return st


def collapse(shape: tuple[int, ...], *strides: list[int]) -> tuple[list[int], list[list[int]]]:
    """Drop size-1 dims and merge neighbours that every stride list walks as one."""
    dims_: list[int] = []
    sts: list[list[int]] = [[] for _ in strides]
    for d, size in enumerate(shape):
        if size == 1:
            continue
        if dims_ and all(s[-1] == st[d] * size for s, st in zip(sts, strides)):
            dims_[-1] *= size
            for s, st in zip(sts, strides):
                s[-1] = st[d]
            continue
        dims_.append(size)
        for s, st in zip(sts, strides):
            s.append(st[d])
    return dims_, sts


def _vec_ok(*ts: DeviceTensor) -> int:
    for t in ts:
        if t.ptr % (4 * t.dtype.itemsize):
            return 0
    return 1


def launch(ex: CudaExecutor, op: str, kname: str, dtype: str, out: DeviceTensor, a: DeviceTensor,
           b: DeviceTensor | None = None, s0: float = 0.0, s1: float = 0.0, si: int = 0, flagged: str = "",
           module: tuple[str, str] | None = None) -> bool:
    """Run kernel `kname` of module `dtype` (or of `module`, a (key, source) pair); False when the broadcast needs
    more dims than the indexer has."""
    n = out.size
    if n == 0:
        return True
    key, src = module or (f"ew:{dtype}", source(dtype))
    if flagged:
        ex.clear_flag()
    if b is None or (a.shape == out.shape and b.shape == out.shape):
        f = ex.function(key, src, kname + "_c", CONTIG_FMT, op)
        vec = _vec_ok(out, a, b) if b is not None else _vec_ok(out, a)
        ex.launch(op, f, ex.grid(n, 4 if vec else 1), (256, 1, 1), out.ptr, a.ptr, (b or a).ptr, n, float(s0),
                  float(s1), si, ex.flag_ptr, vec)
    else:
        shape, (sa, sb) = collapse(out.shape, _strides(a.shape, out.shape), _strides(b.shape, out.shape))
        if len(shape) == 2 and sorted((sa, sb)) == [[0, 1], [shape[1], 1]]:  # a row down a matrix
            cols = shape[1]
            vec = _vec_ok(out, a, b) if cols % 4 == 0 else 0
            f = ex.function(key, src, kname + "_r", ROWS_FMT, op)
            ex.launch(op, f, ex.grid(n, 4 if vec else 1), (256, 1, 1), out.ptr, a.ptr, b.ptr, n, float(s0),
                      float(s1), si, ex.flag_ptr, cols, int(sa[0] == 0), vec)
            if flagged:
                ex.raise_flag(op, flagged)
            return True
        if len(shape) > MAXD:
            return False
        f = ex.function(key, src, kname + "_s", STRIDED_FMT, op)
        ex.launch(op, f, ex.grid(n), (256, 1, 1), out.ptr, a.ptr, b.ptr, n, float(s0), float(s1), si,
                  ex.flag_ptr, len(shape), *dims(shape), *divisors(shape, n), *dims(sa), *dims(sb))
    if flagged:
        ex.raise_flag(op, flagged)
    return True


def _int_scalar(s: Any) -> bool:
    return type(s) is int or (hasattr(s, "dtype") and s.dtype.kind in "iu")


def kernel_of(op: OpDef) -> Callable[..., bool]:
    """The CUDA kernel of an op with an expression of one or two tensors and at most one scalar: called with the
    resolved args in the op's order, then the output."""
    tensors = tuple(i for i, a in enumerate(op.args) if a.kind == "tensor")
    var = next((i for i, a in enumerate(op.args) if a.kind == "var"), -1)
    own = not _shared(op)
    name = op.name
    found: dict[tuple[str, str], tuple[Form, tuple[str, str] | None] | None] = {}

    def find(dtype: str, kname: str) -> tuple[Form, tuple[str, str] | None] | None:
        form = forms(OPS[name], dtype).get(kname)
        if form is None:
            return None
        if not own:
            return form, None
        src = own_source(name, OPS[name].expr, dtype)
        return form, ("ew:" + hashlib.sha1(src.encode()).hexdigest()[:20], src)

    def kernel(ex: CudaExecutor, *values: Any) -> bool:
        a = values[tensors[0]]
        b = values[tensors[1]] if len(tensors) > 1 else None
        dt = a.dname
        kname, s0, si, s = name, 0.0, 0, None
        if var >= 0:
            s = values[var]
            if dt in FLOAT_TYPES:
                s0 = float(s)
            elif _int_scalar(s):
                si = int(s)
                if not -(2**63) <= si < 2**63:
                    return False  # beyond int64: the CPU kernel's Python integers
                s0 = float(si)
            else:
                kname += "_f"
                s0 = float(s)
        key = (dt, kname)
        if key not in found:
            found[key] = find(dt, kname)
        plan = found[key]
        if plan is None:
            return False
        form, module = plan
        if form.code.scalar_divisor and dt not in FLOAT_TYPES and s == 0:
            raise DeepxError(f"{name}: integer division by zero")
        return launch(ex, name, kname, dt, values[-1], a, b, s0=s0, si=si, module=module,
                      flagged="integer division by zero" if form.code.flags else "")

    kernel.__name__ = name
    return kernel


def expr_kernel(op: OpDef) -> Callable[..., bool]:
    """The CUDA kernel of an op of family "expr": its own elementwise kernel, or, with more than two tensors, its
    expression run as a fused kernel."""
    if sum(a.kind == "tensor" for a in op.args) <= 2:
        return kernel_of(op)
    from deepxd.kernels.cuda.fused import expr_kernel as fused_kernel

    return fused_kernel(op)


def gelu(ex: CudaExecutor, a: DeviceTensor, approximate: str, out: DeviceTensor) -> bool:
    if approximate not in ("none", "tanh"):
        raise DeepxError(f"gelu: approximate must be 'none' or 'tanh', got {approximate!r}")
    return launch(ex, "gelu", "gelu" if approximate == "none" else "gelu_tanh", a.dname, out, a)


def gelugrad(ex: CudaExecutor, a: DeviceTensor, g: DeviceTensor, approximate: str, out: DeviceTensor) -> bool:
    if approximate not in ("none", "tanh"):
        raise DeepxError(f"gelugrad: approximate must be 'none' or 'tanh', got {approximate!r}")
    return launch(ex, "gelugrad", "gelugrad" if approximate == "none" else "gelugrad_tanh", a.dname, out, a, g)


def equal(ex: CudaExecutor, a: DeviceTensor, b: DeviceTensor, eps: Any, out: DeviceTensor) -> bool:
    return launch(ex, "equal", "equal", a.dname, out, a, b, s1=float(eps))


def notequal(ex: CudaExecutor, a: DeviceTensor, b: DeviceTensor, eps: Any, out: DeviceTensor) -> bool:
    return launch(ex, "notequal", "notequal", a.dname, out, a, b, s1=float(eps))


def _scalar_cmp(op: str, ex: CudaExecutor, a: DeviceTensor, s: Any, eps: Any, out: DeviceTensor) -> bool:
    dt = a.dname
    if dt in INT_TYPES or dt == "bool":
        if _int_scalar(s) or isinstance(s, bool):
            si = int(s)
            if not -(2**63) <= si < 2**63:
                return False
            return launch(ex, op, op, dt, out, a, s0=float(si), s1=float(eps), si=si)
        if dt == "bool":
            return False
        return launch(ex, op, op + "_f", dt, out, a, s0=float(s), s1=float(eps))
    return launch(ex, op, op, dt, out, a, s0=float(s), s1=float(eps))


def equalscalar(ex: CudaExecutor, a: DeviceTensor, s: Any, eps: Any, out: DeviceTensor) -> bool:
    return _scalar_cmp("equalscalar", ex, a, s, eps, out)


def notequalscalar(ex: CudaExecutor, a: DeviceTensor, s: Any, eps: Any, out: DeviceTensor) -> bool:
    return _scalar_cmp("notequalscalar", ex, a, s, eps, out)


def todtype(ex: CudaExecutor, a: DeviceTensor, out: DeviceTensor) -> bool:
    n = out.size
    if n == 0:
        return True
    f = ex.function(f"ew:{a.dname}", source(a.dname), f"todtype_{out.dname}", "PPq", "todtype")
    ex.launch("todtype", f, ex.grid(n), (256, 1, 1), out.ptr, a.ptr, n)
    return True


#: op -> its kernel here: by its signature (x, y, S), or by hand where the scalars are more than one number
KERNELS: dict[str, Callable[..., bool]] = {name: kernel_of(OPS[name]) for name in _SHARED}
KERNELS.update(gelu=gelu, gelugrad=gelugrad, equal=equal, notequal=notequal, equalscalar=equalscalar,
               notequalscalar=notequalscalar, todtype=todtype)

__all__ = ["KERNELS", "SUPPORT", "collapse", "expr_kernel", "forms", "kernel_of", "launch", "source", "sources"]
