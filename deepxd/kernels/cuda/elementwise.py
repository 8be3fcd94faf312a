"""Elementwise kernels: arithmetic, rounding, comparisons, activations and todtype, one CUDA module per dtype.

Every op is a C expression over `x` (A's value in the compute type: float for the 16-bit floats, long long for
integers and bool), `y` (B's value), the scalar `S` and `err` (a flag set on integer division by zero). Each op has
a contiguous kernel (4 elements per thread in 16-byte packs where the pointers allow, grid-stride) and, for the
binary forms, a strided kernel that broadcasts through per-input strides. The results follow the CPU kernels: the
16-bit floats compute in float32 and round once, integers wrap, integer division truncates, a Python float scalar
with an integer tensor computes in float64.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from deepx_core.cache import memoize
from deepx_core.errors import DeepxError
from deepx_core.ir.ops import OPS
from deepxd.kernels.cuda._src import CTYPES, FLOAT_TYPES, HEADER, INT_TYPES, MAXD, ctype, dims, dims_format

if TYPE_CHECKING:
    from deepxd.kernels.cuda import CudaExecutor, DeviceTensor

# kind: u unary, b binary, s scalar (A op s), r reversed scalar (s op A)
_FLOAT: dict[str, tuple[str, str]] = {
    "add": ("b", "x + y"), "sub": ("b", "x - y"), "mul": ("b", "x * y"), "div": ("b", "x / y"),
    "max": ("b", "mx(x, y)"), "min": ("b", "mn(x, y)"), "pow": ("b", "pow(x, y)"),
    "addscalar": ("s", "x + S"), "subscalar": ("s", "x - S"), "mulscalar": ("s", "x * S"),
    "divscalar": ("s", "x / S"), "powscalar": ("s", "pow(x, S)"), "maxscalar": ("s", "mx(x, S)"),
    "minscalar": ("s", "mn(x, S)"), "rsubscalar": ("r", "S - x"), "rdivscalar": ("r", "S / x"),
    "rpowscalar": ("r", "pow(S, x)"),
    "sqrt": ("u", "sqrt(x)"), "exp": ("u", "exp(x)"), "log": ("u", "log(x)"), "sin": ("u", "sin(x)"),
    "erf": ("u", "erf(x)"), "floor": ("u", "floor(x)"), "ceil": ("u", "ceil(x)"), "round": ("u", "rint(x)"),
    "trunc": ("u", "trunc(x)"), "log1p": ("u", "log1p(x)"), "expm1": ("u", "expm1(x)"),
    "cos": ("u", "cos(x)"), "tan": ("u", "tan(x)"), "neg": ("u", "-x"), "abs": ("u", "fabs(x)"),
    "relu": ("u", "mx(x, (A)0)"), "sigmoid": ("u", "sigm(x)"), "tanh": ("u", "tanh(x)"),
    "gelu": ("u", "(A)0.5 * x * ((A)1 + erf(x * (A)0.70710678118654752440))"),
    "gelu_tanh": ("u", "(A)0.5 * x * ((A)1 + tanh((A)0.79788456080286535588 * (x + (A)0.044715 * x * x * x)))"),
    "silu": ("u", "x * sigm(x)"),
    "gelugrad": ("b", "y * gelugrad_exact<A>(x)"), "gelugrad_tanh": ("b", "y * gelugrad_tanh<A>(x)"),
    "less": ("b", "x < y"), "greater": ("b", "x > y"),
    "lessscalar": ("s", "x < S"), "greaterscalar": ("s", "x > S"),
    "equal": ("b", "(s1 == 0 ? x == y : fabs((double)x - (double)y) <= s1)"),
    "notequal": ("b", "!(s1 == 0 ? x == y : fabs((double)x - (double)y) <= s1)"),
    "equalscalar": ("s", "(s1 == 0 ? x == S : fabs((double)x - s0) <= s1)"),
    "notequalscalar": ("s", "!(s1 == 0 ? x == S : fabs((double)x - s0) <= s1)"),
}

# integers (x, y long long); S is the scalar as long long for a Python int scalar
_INT: dict[str, tuple[str, str]] = {
    "add": ("b", "x + y"), "sub": ("b", "x - y"), "mul": ("b", "x * y"), "div": ("b", "idiv(x, y, err)"),
    "max": ("b", "mx(x, y)"), "min": ("b", "mn(x, y)"),
    "pow": ("b", "(y >= 0 ? ipow(x, y) : (ll)pow((double)x, (double)y))"),
    "addscalar": ("s", "x + S"), "subscalar": ("s", "x - S"), "mulscalar": ("s", "x * S"),
    "divscalar": ("s", "idiv(x, S, err)"),
    "powscalar": ("s", "(S >= 0 ? ipow(x, S) : (ll)pow((double)x, (double)S))"),
    "maxscalar": ("s", "mx(x, S)"), "minscalar": ("s", "mn(x, S)"), "rsubscalar": ("r", "S - x"),
    "rdivscalar": ("r", "idiv(S, x, err)"),
    "rpowscalar": ("r", "(x >= 0 ? ipow(S, x) : (ll)pow((double)S, (double)x))"),
    "neg": ("u", "-x"), "abs": ("u", "(x < 0 ? -x : x)"), "invert": ("u", "~x"),
    "less": ("b", "x < y"), "greater": ("b", "x > y"),
    "lessscalar": ("s", "x < S"), "greaterscalar": ("s", "x > S"),
    "equal": ("b", "(s1 == 0 ? x == y : fabs((double)x - (double)y) <= s1)"),
    "notequal": ("b", "!(s1 == 0 ? x == y : fabs((double)x - (double)y) <= s1)"),
    "equalscalar": ("s", "(s1 == 0 ? x == S : fabs((double)x - (double)S) <= s1)"),
    "notequalscalar": ("s", "!(s1 == 0 ? x == S : fabs((double)x - (double)S) <= s1)"),
}

# integers with a Python float scalar: computed in float64 (numpy promotes), then cast
_INT_FLOAT_SCALAR: dict[str, tuple[str, str]] = {
    "addscalar": ("s", "(double)x + s0"), "subscalar": ("s", "(double)x - s0"), "mulscalar": ("s", "(double)x * s0"),
    "divscalar": ("s", "(double)x / s0"), "powscalar": ("s", "pow((double)x, s0)"),
    "maxscalar": ("s", "mx((double)x, s0)"), "minscalar": ("s", "mn((double)x, s0)"),
    "rsubscalar": ("r", "s0 - (double)x"), "rdivscalar": ("r", "(x == 0 ? (double)flag(err) : s0 / (double)x)"),
    "rpowscalar": ("r", "pow(s0, (double)x)"),
    "lessscalar": ("s", "(double)x < s0"), "greaterscalar": ("s", "(double)x > s0"),
    "equalscalar": ("s", "(s1 == 0 ? (double)x == s0 : fabs((double)x - s0) <= s1)"),
    "notequalscalar": ("s", "!(s1 == 0 ? (double)x == s0 : fabs((double)x - s0) <= s1)"),
}

_BOOL: dict[str, tuple[str, str]] = {
    "invert": ("u", "!x"),
    "equal": ("b", "(s1 == 0 ? x == y : fabs((double)x - (double)y) <= s1)"),
    "notequal": ("b", "!(s1 == 0 ? x == y : fabs((double)x - (double)y) <= s1)"),
    "equalscalar": ("s", "(s1 == 0 ? x == S : fabs((double)x - (double)S) <= s1)"),
    "notequalscalar": ("s", "!(s1 == 0 ? x == S : fabs((double)x - (double)S) <= s1)"),
}

_BOOL_OUT = frozenset({"less", "greater", "lessscalar", "greaterscalar", "equal", "notequal", "equalscalar",
                       "notequalscalar"})

_EXTRA = r"""
// gelu's gradient (gelugrad: x is A, y the upstream gradient): Phi(x) + x phi(x), Phi from erfc (no cancellation in
// the negative tail); the tanh form's derivative
template <typename A> __device__ __forceinline__ A gelugrad_exact(A x) {
    return (A)0.5 * erfc(x * (A)-0.70710678118654752440) + x * (A)0.39894228040143267794 * exp((A)-0.5 * x * x);
}
template <typename A> __device__ __forceinline__ A gelugrad_tanh(A x) {
    const A k = (A)0.79788456080286535588;
    A t = tanh(k * (x + (A)0.044715 * x * x * x));
    return (A)0.5 * ((A)1 + t) + (A)0.5 * x * ((A)1 - t * t) * k * ((A)1 + (A)0.134145 * x * x);
}
__device__ __forceinline__ ll flag(int* err) { atomicExch(err, 1); return 0; }
__device__ __forceinline__ ll idiv(ll x, ll y, int* err) { return y == 0 ? flag(err) : x / y; }
"""

_CONTIG = r"""
extern "C" __global__ void {name}_c(TC* c, const TA* a, const TA* b, ll n, double s0, double s1, ll si, int* err,
                                     int vec) {{
    typedef typename Acc<TA>::type A;
    const {stype} S = {sval};
    (void)S; (void)b; (void)si;
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
                                     int nd, Dims shape, Dims sa, Dims sb) {{
    typedef typename Acc<TA>::type A;
    const {stype} S = {sval};
    (void)S; (void)si;
    GRID_STRIDE(i, n) {{
        ll r = i, oa = 0, ob = 0;
        for (int d = nd - 1; d >= 0; --d) {{
            ll q = r / shape.v[d], k = r - q * shape.v[d];
            r = q; oa += k * sa.v[d]; ob += k * sb.v[d];
        }}
        A x = ld(a[oa]);
        A y = ld(b[ob]);
        c[i] = st<TC>({expr});
    }}
}}
"""

_TODTYPE = r"""
extern "C" __global__ void todtype_{dst}(TD* c, const TA* a, ll n) {{
    GRID_STRIDE(i, n) c[i] = st<TD>(wide(a[i]));
}}
"""

CONTIG_FMT = "PPPqddqPi"
STRIDED_FMT = "PPPqddqPi" + dims_format(3)


def _table(dtype: str) -> dict[str, tuple[str, str]]:
    if dtype in FLOAT_TYPES:
        return _FLOAT
    if dtype in INT_TYPES:
        return _INT
    if dtype == "bool":
        return _BOOL
    return {}


#: kernels that are another form of an op (its `approximate`): the op they belong to
_FORMS = {"gelu_tanh": "gelu", "gelugrad_tanh": "gelugrad"}


def _claims(op: str, dtype: str) -> bool:
    base = _FORMS.get(op, op)
    return base in OPS and dtype in OPS[base].dtypes


def _kernel(name: str, kind: str, expr: str, tc: str, scalar: str) -> str:
    """One op's kernels for the module's TA; scalar is 'acc' (S in A), 'int' (S = si) or 'float' (S = s0)."""
    stype, sval = {"acc": ("A", "(A)s0"), "int": ("ll", "si"), "float": ("double", "s0")}[scalar]
    binary = kind == "b"
    text = "#define TC " + tc + "\n"
    text += _CONTIG.format(name=name, stype=stype, sval=sval, expr=expr,
                           loadb_vec="Pack<TA, 4> pb = ((const Pack<TA, 4>*)b)[j];" if binary else "",
                           y_vec="A y = ld(pb.v[k]); (void)y;" if binary else "",
                           y_one="A y = ld(b[j]); (void)y;" if binary else "")
    if binary:
        text += _STRIDED.format(name=name, stype=stype, sval=sval, expr=expr)
    return text + "#undef TC\n"


@memoize("kernels.cuda.elementwise.source", 64)
def source(dtype: str) -> str:
    """The module of every elementwise kernel of `dtype` (as A's dtype)."""
    ta = ctype(dtype)
    parts = [HEADER, _EXTRA, f"typedef {ta} TA;\n"]
    for op, (kind, expr) in _table(dtype).items():
        if not _claims(op, dtype):
            continue
        tc = "bool" if op in _BOOL_OUT else ta
        parts.append(_kernel(op, kind, expr, tc, "int" if dtype not in FLOAT_TYPES else "acc"))
    if dtype in INT_TYPES:
        for op, (kind, expr) in _INT_FLOAT_SCALAR.items():
            if _claims(op, dtype):
                tc = "bool" if op in _BOOL_OUT else ta
                parts.append(_kernel(op + "_f", kind, expr, tc, "float"))
    for dst, (td, _) in CTYPES.items():
        parts.append(f"#define TD {td}\n" + _TODTYPE.format(dst=dst) + "#undef TD\n")
    return "".join(parts)


def sources() -> list[tuple[str, str]]:
    return [(source(d), f"elementwise ({d})") for d in CTYPES]


def _supported() -> dict[str, frozenset[str]]:
    sup: dict[str, set[str]] = {}
    for dtype in CTYPES:
        for op in _table(dtype):
            if _claims(op, dtype):
                sup.setdefault(_FORMS.get(op, op), set()).add(dtype)
    sup["todtype"] = set(CTYPES)
    return {k: frozenset(v) for k, v in sup.items()}


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
           b: DeviceTensor | None = None, s0: float = 0.0, s1: float = 0.0, si: int = 0, flagged: str = "") -> bool:
    """Run kernel `kname` of module `dtype`; False when the broadcast needs more dims than the indexer has."""
    n = out.size
    if n == 0:
        return True
    src = source(dtype)
    if flagged:
        ex.clear_flag()
    if b is None or (a.shape == out.shape and b.shape == out.shape):
        f = ex.function(f"ew:{dtype}", src, kname + "_c", CONTIG_FMT, op)
        vec = _vec_ok(out, a, b) if b is not None else _vec_ok(out, a)
        ex.launch(op, f, ex.grid(n, 4 if vec else 1), (256, 1, 1), out.ptr, a.ptr, (b or a).ptr, n, float(s0),
                  float(s1), si, ex.flag_ptr, vec)
    else:
        shape, (sa, sb) = collapse(out.shape, _strides(a.shape, out.shape), _strides(b.shape, out.shape))
        if len(shape) > MAXD:
            return False
        f = ex.function(f"ew:{dtype}", src, kname + "_s", STRIDED_FMT, op)
        ex.launch(op, f, ex.grid(n), (256, 1, 1), out.ptr, a.ptr, b.ptr, n, float(s0), float(s1), si,
                  ex.flag_ptr, len(shape), *dims(shape), *dims(sa), *dims(sb))
    if flagged:
        ex.raise_flag(op, flagged)
    return True


def _binary(op: str) -> Any:
    def kernel(ex: CudaExecutor, a: DeviceTensor, b: DeviceTensor, out: DeviceTensor) -> bool:
        return launch(ex, op, op, a.dname, out, a, b,
                      flagged="integer division by zero" if op == "div" and a.dname in INT_TYPES else "")

    kernel.__name__ = op
    return kernel


def _int_scalar(s: Any) -> bool:
    return type(s) is int or (hasattr(s, "dtype") and s.dtype.kind in "iu")


def _scalar(op: str) -> Any:
    def kernel(ex: CudaExecutor, a: DeviceTensor, s: Any, out: DeviceTensor) -> bool:
        dt = a.dname
        if dt in INT_TYPES:
            if op == "divscalar" and s == 0:
                raise DeepxError("divscalar: integer division by zero")
            if _int_scalar(s):
                si = int(s)
                if not -(2**63) <= si < 2**63:
                    return False  # beyond int64: the CPU kernel's Python integers
                return launch(ex, op, op, dt, out, a, si=si)
            return launch(ex, op, op + "_f", dt, out, a, s0=float(s))
        return launch(ex, op, op, dt, out, a, s0=float(s))

    kernel.__name__ = op
    return kernel


def _rscalar(op: str) -> Any:
    def kernel(ex: CudaExecutor, s: Any, a: DeviceTensor, out: DeviceTensor) -> bool:
        dt = a.dname
        flagged = "integer division by zero" if op == "rdivscalar" and dt in INT_TYPES else ""
        if dt in INT_TYPES:
            if _int_scalar(s):
                si = int(s)
                if not -(2**63) <= si < 2**63:
                    return False
                return launch(ex, op, op, dt, out, a, si=si, flagged=flagged)
            return launch(ex, op, op + "_f", dt, out, a, s0=float(s), flagged=flagged)
        return launch(ex, op, op, dt, out, a, s0=float(s))

    kernel.__name__ = op
    return kernel


def _unary(op: str) -> Any:
    def kernel(ex: CudaExecutor, a: DeviceTensor, out: DeviceTensor) -> bool:
        return launch(ex, op, op, a.dname, out, a)

    kernel.__name__ = op
    return kernel


add, sub, mul, div, max, min, pow = (_binary(n) for n in ("add", "sub", "mul", "div", "max", "min", "pow"))
addscalar, subscalar, mulscalar, divscalar, powscalar, maxscalar, minscalar = (
    _scalar(n) for n in ("addscalar", "subscalar", "mulscalar", "divscalar", "powscalar", "maxscalar", "minscalar"))
rsubscalar, rdivscalar, rpowscalar = (_rscalar(n) for n in ("rsubscalar", "rdivscalar", "rpowscalar"))
sqrt, exp, log, sin, cos, tan, neg, abs, invert = (
    _unary(n) for n in ("sqrt", "exp", "log", "sin", "cos", "tan", "neg", "abs", "invert"))
relu, sigmoid, tanh, silu, erf = (_unary(n) for n in ("relu", "sigmoid", "tanh", "silu", "erf"))
floor, ceil, round, trunc, log1p, expm1 = (_unary(n) for n in ("floor", "ceil", "round", "trunc", "log1p", "expm1"))
less, greater = _binary("less"), _binary("greater")
lessscalar, greaterscalar = _scalar("lessscalar"), _scalar("greaterscalar")


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


__all__ = ["SUPPORT", "collapse", "launch", "source", "sources"]
