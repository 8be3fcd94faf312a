"""The gradient rule of every differentiable op against torch autograd, for every float dtype the op claims.

Each case is a one-instruction forward program (its result is `y`) on random inputs, with a random upstream gradient
`up` for `y`: the backward program that `grad_program` writes runs on a CpuExecutor, and each gradient is compared
with torch's, computed in float64 from the same (rounded) inputs. float64 is compared tightly; float32, float16 and
bfloat16 loosely, relative to the largest gradient. The cases are keyed by op, and the test is parametrized over the
catalogue: an op flagged differentiable without a case here fails.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

from deepx_core.errors import DeepxError
from deepx_core.ir.dtypes import to_numpy
from deepx_core.ir.ops import OPS, stats_dtype
from deepxd.comm import Collectives
from deepxd.compiler.autograd import GRAD_RULES, grad_program, grad_rule, rule_formula, unfuse
from tests.compiler.helpers import executor, program

TF = torch.nn.functional
#: (rtol, atol relative to the largest gradient) per dtype
TOL = {"float64": (1e-9, 1e-11), "float32": (2e-4, 2e-5), "float16": (2e-2, 4e-3), "bfloat16": (8e-2, 3e-2)}
ORDER = ("float64", "float32", "float16", "bfloat16")


@dataclass(frozen=True)
class R:
    """A random float input: uniform in [lo, hi), cast to the case's dtype."""

    shape: tuple[int, ...]
    lo: float = -1.0
    hi: float = 1.0


def r(*shape: int, lo: float = -1.0, hi: float = 1.0) -> R:
    return R(shape, lo, hi)


@dataclass(frozen=True)
class Fixed:
    """A given input: floats are cast to the case's dtype, integers and bools stay as they are."""

    value: np.ndarray


@dataclass
class Case:
    text: str  # deepxIR; <T> stands for the dtype; the result is y
    inputs: dict[str, R | Fixed]
    wrt: list[str]
    ref: Callable[[dict[str, torch.Tensor]], torch.Tensor]
    dtypes: tuple[str, ...] = ORDER  # the dtypes this case runs in (of those the op claims)
    extra: dict[str, str] = field(default_factory=dict)  # input name -> "stats": of the norm statistics' dtype


def c(text: str, inputs: Mapping[str, R | Fixed], wrt: str, ref: Callable[[dict[str, torch.Tensor]], torch.Tensor],
      dtypes: tuple[str, ...] = ORDER) -> Case:
    return Case(text, dict(inputs), wrt.split(), ref, dtypes)


def bin_(op: str, fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], lo: float = -1.0,
         blo: float = -1.0) -> list[Case]:
    text = f"{op} (tensor<T>:a, tensor<T>:b) -> (tensor<T>:y)"
    shapes = [((3, 4), (3, 4)), ((2, 3, 4), (4,)), ((3, 1), (2, 1, 5)), ((), (2, 3))]
    return [c(text, {"a": r(*sa, lo=lo), "b": r(*sb, lo=blo)}, "a b", lambda t: fn(t["a"], t["b"]))
            for sa, sb in shapes]


def scalar(op: str, s: float, fn: Callable[[torch.Tensor], torch.Tensor], lo: float = -1.0,
           rev: bool = False) -> list[Case]:
    args = f"var<float64>:{s}, tensor<T>:a" if rev else f"tensor<T>:a, var<float64>:{s}"
    return [c(f"{op} ({args}) -> (tensor<T>:y)", {"a": r(*shape, lo=lo, hi=2.0 if lo > 0 else 1.0)}, "a",
              lambda t: fn(t["a"])) for shape in [(3, 4), (), (2, 1, 3)]]


def unary(op: str, fn: Callable[[torch.Tensor], torch.Tensor], lo: float = -1.0, hi: float = 1.0,
          extra: str = "") -> list[Case]:
    return [c(f"{op} (tensor<T>:a{extra}) -> (tensor<T>:y)", {"a": r(*shape, lo=lo, hi=hi)}, "a",
              lambda t: fn(t["a"])) for shape in [(3, 4), (), (2, 3, 5)]]


def vecs(*vs: tuple[int, ...]) -> str:
    return ", ".join(f"vector<int32>:[{' '.join(map(str, v))}]" for v in vs)


def reduce_(op: str, fn: Callable[..., torch.Tensor], inputs: dict[str, R | Fixed] | None = None) -> list[Case]:
    out = []
    for shape, dims, keep in [((3, 4), (), False), ((3, 4), (1,), False), ((2, 3, 4), (0, 2), True),
                              ((2, 3, 4), (-1,), True), ((5,), (0,), False)]:
        tdims = dims or tuple(range(len(shape)))
        out.append(c(f"{op} (tensor<T>:a, {vecs(dims)}, var<bool>:{str(keep).lower()}) -> (tensor<T>:y)",
                     inputs or {"a": r(*shape)}, "a",
                     lambda t, d=tdims, k=keep: fn(t["a"], d, k)))
    return out


def _prod(a: torch.Tensor, dims: tuple[int, ...], keep: bool) -> torch.Tensor:
    for d in sorted((x % a.dim() for x in dims), reverse=True):
        a = a.prod(d, keepdim=keep)
    return a


_ZEROS = np.array([[0.5, 0.0, 1.5, -0.7], [0.0, 0.0, 0.9, 1.2], [1.1, -0.8, 0.6, 1.3]])


def _norm_ref(kind: str, eps: float, k: int) -> Callable[[dict[str, torch.Tensor]], torch.Tensor]:
    def fn(t: dict[str, torch.Tensor]) -> torch.Tensor:
        shape = t["w"].shape
        if kind == "layernorm":
            return TF.layer_norm(t["a"], shape, t["w"], t["b"], eps)
        return TF.rms_norm(t["a"], shape, t["w"], eps)
    return fn


def _switch_ref(t: dict[str, torch.Tensor]) -> torch.Tensor:
    k = t["k"]
    return torch.where(k == 0, t["a"], torch.where(k == 1, t["b"], t["c"]))


def _fused_ref(expr: str) -> Callable[[dict[str, torch.Tensor]], torch.Tensor]:
    def fn(t: dict[str, torch.Tensor]) -> torch.Tensor:
        names = {f"in{i}": t[n] for i, n in enumerate("abc") if n in t}
        ns = {**names, "sqrt": torch.sqrt, "exp": torch.exp, "log": torch.log, "sin": torch.sin, "cos": torch.cos,
              "tan": torch.tan, "tanh": torch.tanh, "abs": torch.abs, "floor": torch.floor, "ceil": torch.ceil,
              "round": torch.round, "trunc": torch.trunc, "log1p": torch.log1p, "expm1": torch.expm1,
              "maximum": lambda x, y: torch.maximum(torch.as_tensor(x, dtype=torch.float64),
                                                    torch.as_tensor(y, dtype=torch.float64)),
              "minimum": lambda x, y: torch.minimum(torch.as_tensor(x, dtype=torch.float64),
                                                    torch.as_tensor(y, dtype=torch.float64))}
        out = eval(expr, {"__builtins__": {}}, ns)  # the test's own expressions: numexpr syntax is Python's
        shape = torch.broadcast_shapes(*(x.shape for x in names.values()))
        return torch.as_tensor(out, dtype=torch.float64).expand(shape) if not torch.is_tensor(out) else \
            out.expand(shape)
    return fn


def _fused(expr: str, inputs: dict[str, R | Fixed], wrt: str) -> Case:
    lst = " ".join(inputs)
    return c(f"fused (listtensor<T>:[{lst}], var<string>:{expr}) -> (tensor<T>:y)", inputs, wrt,
             _fused_ref(expr))


_IDX = Fixed(np.array([2, 0, 2, 1], dtype=np.int64))
_IDX2 = Fixed(np.array([[1, 0], [1, 1]], dtype=np.int32))

CASES: dict[str, list[Case]] = {
    "add": bin_("add", torch.add),
    "sub": bin_("sub", torch.sub),
    "mul": bin_("mul", torch.mul),
    "div": bin_("div", torch.div, blo=0.5),
    "max": bin_("max", torch.maximum),
    "min": bin_("min", torch.minimum),
    "pow": bin_("pow", torch.pow, lo=0.5),
    "addscalar": scalar("addscalar", 1.5, lambda a: a + 1.5),
    "subscalar": scalar("subscalar", 1.5, lambda a: a - 1.5),
    "mulscalar": scalar("mulscalar", -2.5, lambda a: a * -2.5),
    "divscalar": scalar("divscalar", 4.0, lambda a: a / 4.0),
    "powscalar": [*scalar("powscalar", 2.5, lambda a: a ** 2.5, lo=0.5), *scalar("powscalar", 3.0, lambda a: a ** 3),
                  c("powscalar (tensor<T>:a, var<float64>:0.0) -> (tensor<T>:y)", {"a": Fixed(np.array([0.0, 1.5]))},
                    "a", lambda t: t["a"] ** 0.0)],
    "maxscalar": scalar("maxscalar", 0.1, lambda a: a.clamp_min(0.1)),
    "minscalar": scalar("minscalar", 0.1, lambda a: a.clamp_max(0.1)),
    "rsubscalar": scalar("rsubscalar", 2.0, lambda a: 2.0 - a, rev=True),
    "rdivscalar": scalar("rdivscalar", 3.0, lambda a: 3.0 / a, lo=0.5, rev=True),
    "rpowscalar": [*scalar("rpowscalar", 2.0, lambda a: 2.0 ** a, rev=True),
                   *scalar("rpowscalar", 0.0, lambda a: torch.pow(0.0, a), lo=0.5, rev=True)],
    # torch has no gradient for a number's remainder or for floor_divide: their tensor forms' and div's (zero)
    "fmod": bin_("fmod", torch.fmod, blo=0.3),
    "remainder": bin_("remainder", torch.remainder, blo=0.3),
    "floordiv": bin_("floordiv", lambda a, b: torch.div(a, b, rounding_mode="floor"), blo=0.3),
    "fmodscalar": scalar("fmodscalar", -0.7, lambda a: torch.fmod(a, -0.7)),
    "remainderscalar": scalar("remainderscalar", -0.7, lambda a: torch.remainder(a, -0.7)),
    "floordivscalar": scalar("floordivscalar", 0.3, lambda a: torch.div(a, 0.3, rounding_mode="floor")),
    "rfmodscalar": scalar("rfmodscalar", -2.5, lambda a: torch.fmod(torch.full_like(a, -2.5), a), lo=0.5, rev=True),
    "rremainderscalar": scalar("rremainderscalar", -2.5, lambda a: torch.remainder(torch.full_like(a, -2.5), a),
                               lo=0.5, rev=True),
    "rfloordivscalar": scalar("rfloordivscalar", 2.5, lambda a: torch.div(torch.full_like(a, 2.5), a,
                                                                           rounding_mode="floor"), lo=0.5, rev=True),
    "sqrt": unary("sqrt", torch.sqrt, lo=0.5, hi=2.0),
    "exp": unary("exp", torch.exp),
    "log": unary("log", torch.log, lo=0.5, hi=2.0),
    "sin": unary("sin", torch.sin, lo=-3, hi=3),
    "cos": unary("cos", torch.cos, lo=-3, hi=3),
    "tan": unary("tan", torch.tan),
    "neg": unary("neg", torch.neg),
    "abs": unary("abs", torch.abs),
    "relu": unary("relu", torch.relu),
    "sigmoid": unary("sigmoid", torch.sigmoid, lo=-4, hi=4),
    "tanh": unary("tanh", torch.tanh, lo=-2, hi=2),
    "silu": unary("silu", TF.silu, lo=-4, hi=4),
    "erf": unary("erf", torch.erf, lo=-2, hi=2),
    "floor": unary("floor", torch.floor, lo=-3, hi=3),
    "ceil": unary("ceil", torch.ceil, lo=-3, hi=3),
    "round": unary("round", torch.round, lo=-3, hi=3),
    "trunc": unary("trunc", torch.trunc, lo=-3, hi=3),
    "log1p": unary("log1p", torch.log1p, lo=-0.9, hi=3),
    "expm1": unary("expm1", torch.expm1, lo=-2, hi=2),
    "gelu": [*unary("gelu", TF.gelu, lo=-4, hi=4),
             *unary("gelu", lambda a: TF.gelu(a, approximate="tanh"), lo=-4, hi=4, extra=", var<string>:tanh"),
             *unary("gelu", TF.gelu, lo=-4, hi=4, extra=", var<string>:none")],
    "softmax": [c(f"softmax (tensor<T>:a, var<int32>:{d}) -> (tensor<T>:y)", {"a": r(*s, lo=-2, hi=2)}, "a",
                  lambda t, d=d: torch.softmax(t["a"], d))
                for s, d in [((3, 4), -1), ((3, 4), 0), ((2, 3, 4), 1), ((), -1)]],
    "logsoftmax": [c(f"logsoftmax (tensor<T>:a, var<int32>:{d}) -> (tensor<T>:y)", {"a": r(*s, lo=-2, hi=2)},
                     "a", lambda t, d=d: torch.log_softmax(t["a"], d))
                   for s, d in [((3, 4), -1), ((3, 4), 0), ((2, 3, 4), 1), ((), 0)]],
    "matmul": [c("matmul (tensor<T>:a, tensor<T>:b) -> (tensor<T>:y)", {"a": r(*sa), "b": r(*sb)}, "a b",
                 lambda t: t["a"] @ t["b"])
               for sa, sb in [((3, 4), (4, 5)), ((2, 3, 4), (4, 5)), ((2, 1, 3, 4), (3, 4, 2)),
                              ((2, 4, 3, 5), (2, 4, 5, 3))]],
    "sum": reduce_("sum", lambda a, d, k: a.sum(d, keepdim=k)),
    "prod": reduce_("prod", _prod)
    + [c(f"prod (tensor<T>:a, {vecs(d)}, var<bool>:{k}) -> (tensor<T>:y)", {"a": Fixed(_ZEROS)}, "a",
         lambda t, d=d, k=k: _prod(t["a"], d or (0, 1), k == "true"))
       for d, k in [((1,), "false"), ((0,), "true"), ((), "false")]],
    "reducemax": reduce_("reducemax", lambda a, d, k: a.amax(d, keepdim=k)),
    "reducemin": [*reduce_("reducemin", lambda a, d, k: a.amin(d, keepdim=k)),
                  c("reducemin (tensor<T>:a, vector<int32>:[1], var<bool>:false) -> (tensor<T>:y)",  # ties share g
                    {"a": Fixed(np.array([[1.0, 0.5, 0.5], [0.25, 2.0, 0.25]]))}, "a", lambda t: t["a"].amin(1))],
    "cumsum": [c(f"cumsum (tensor<T>:a, var<int32>:{d}, var<bool>:{rev}) -> (tensor<T>:y)", {"a": r(*s)}, "a",
                 lambda t, d=d, rev=rev: t["a"].flip(d).cumsum(d).flip(d) if rev == "true" else t["a"].cumsum(d))
               for s, d, rev in [((3, 4), 1, "false"), ((2, 3, 4), -2, "true"), ((5,), 0, "false"),
                                 ((2, 6), -1, "true")]],
    "cumprod": [c(f"cumprod (tensor<T>:a, var<int32>:{d}) -> (tensor<T>:y)", {"a": a}, "a",
                  lambda t, d=d: t["a"].cumprod(d))
                for a, d in [(r(3, 4, lo=0.5, hi=1.5), 1), (r(2, 3, 4), -2), (r(5), 0),
                             (Fixed(np.array([[0.5, 0.0, 1.5, -0.7, 0.0], [1.2, 0.9, 0.0, 1.1, 0.8]])), 1),
                             (Fixed(np.array([[0.0, 0.5], [1.5, 0.0], [0.7, 2.0]])), 0)]],
    "reshape": [c(f"reshape (tensor<T>:a, {vecs(s)}) -> (tensor<T>:y)", {"a": r(2, 3, 4)}, "a",
                  lambda t, s=s: t["a"].reshape(s)) for s in [(6, 4), (24,), (4, -1, 2)]],
    "transpose": [c(f"transpose (tensor<T>:a, {vecs(p)}) -> (tensor<T>:y)", {"a": r(2, 3, 4)}, "a",
                    lambda t, p=p: t["a"].permute(*p)) for p in [(2, 0, 1), (0, 2, 1), (-1, -3, -2)]],
    "broadcastTo": [c(f"broadcastTo (tensor<T>:a, {vecs(s)}) -> (tensor<T>:y)", {"a": r(*a)}, "a",
                      lambda t, s=s: t["a"].broadcast_to(s)) for a, s in [((3, 1), (2, 3, 4)), ((4,), (3, 4))]],
    "concat": [c("concat (listtensor<T>:[a b a], var<int32>:0) -> (tensor<T>:y)", {"a": r(2, 3), "b": r(1, 3)},
                 "a b", lambda t: torch.cat([t["a"], t["b"], t["a"]], 0)),
               c("concat (listtensor<T>:[a b], var<int32>:-1) -> (tensor<T>:y)", {"a": r(2, 3, 1), "b": r(2, 3, 4)},
                 "b", lambda t: torch.cat([t["a"], t["b"]], -1))],
    "indexselect": [c("indexselect (tensor<T>:a, tensor<int64>:i, var<int32>:0) -> (tensor<T>:y)",
                      {"a": r(3, 4), "i": _IDX}, "a", lambda t: t["a"][t["i"]]),
                    c("indexselect (tensor<T>:a, tensor<int32>:i, var<int32>:1) -> (tensor<T>:y)",
                      {"a": r(3, 2, 2), "i": _IDX2}, "a", lambda t: t["a"][:, t["i"].long()])],
    "repeat": [c(f"repeat (tensor<T>:a, {vecs(p)}) -> (tensor<T>:y)", {"a": r(*s)}, "a",
                 lambda t, p=p: t["a"].repeat(*p)) for s, p in [((2, 3), (2, 1, 3)), ((2, 3), (1, 2)), ((4,), (3,))]],
    "slice": [c(f"slice (tensor<T>:a, {vecs(*v)}) -> (tensor<T>:y)", {"a": r(4, 6)}, "a",
                lambda t, sl=sl: t["a"][sl])
              for v, sl in [(((1, 0), (3, 6), (1, 2)), (slice(1, 3), slice(0, 6, 2))),
                            (((-3, 1), (4, -1), (2, 3)), (slice(-3, 4, 2), slice(1, -1, 3)))]],
    "sliceassign": [c(f"sliceassign (tensor<T>:a, {vecs((1, 0), (3, 6), (1, 2))}, tensor<T>:v) -> "
                      "(tensor<T>:y)", {"a": r(4, 6), "v": r(*vs)}, "a v",
                      lambda t: _sliceassign_ref(t["a"], t["v"])) for vs in [(2, 3), (3,), (1, 1)]],
    "pad": [c(f"pad (tensor<T>:a, {vecs(p)}, var<float64>:0.5) -> (tensor<T>:y)", {"a": r(2, 3)}, "a",
              lambda t, p=p: TF.pad(t["a"], (p[2], p[3], p[0], p[1]), value=0.5))
            for p in [(1, 0, 2, 1), (0, 0, 0, 3)]],
    "indexadd": [c("indexadd (tensor<T>:a, tensor<int64>:i, tensor<T>:s, var<int32>:0) -> (tensor<T>:y)",
                   {"a": r(3, 4), "i": _IDX, "s": r(4, 4)}, "a s", lambda t: t["a"].index_add(0, t["i"], t["s"])),
                 c("indexadd (tensor<T>:a, tensor<int32>:i, tensor<T>:s, var<int32>:-1) -> (tensor<T>:y)",
                   {"a": r(2, 3), "i": Fixed(np.array([2, 2], dtype=np.int32)), "s": r(2, 2)}, "s",
                   lambda t: t["a"].index_add(1, t["i"].long(), t["s"]))],
    "indexcopy": [c("indexcopy (tensor<T>:a, tensor<int64>:i, tensor<T>:s, var<int32>:0) -> (tensor<T>:y)",
                    {"a": r(4, 3), "i": Fixed(np.array([3, 0])), "s": r(2, 3)}, "a s",
                    lambda t: t["a"].index_copy(0, t["i"], t["s"])),
                  c("indexcopy (tensor<T>:a, tensor<int32>:i, tensor<T>:s, var<int32>:-1) -> (tensor<T>:y)",
                    {"a": r(2, 3, 5), "i": Fixed(np.array([4, 1, 2], dtype=np.int32)), "s": r(2, 3, 3)}, "s",
                    lambda t: t["a"].index_copy(-1, t["i"].long(), t["s"]))],
    "gather": [c("gather (tensor<T>:a, tensor<int64>:i, var<int32>:0) -> (tensor<T>:y)",
                 {"a": r(3, 4), "i": Fixed(np.array([[2, 0, 2, 1], [0, 0, 1, 2]]))}, "a",
                 lambda t: torch.gather(t["a"], 0, t["i"])),
               c("gather (tensor<T>:a, tensor<int32>:i, var<int32>:-1) -> (tensor<T>:y)",
                 {"a": r(2, 3, 4), "i": Fixed(np.array([[[3, 3, 0, 1, 1]], [[2, 0, 0, 0, 3]]], dtype=np.int32))},
                 "a", lambda t: torch.gather(t["a"], -1, t["i"].long()))],
    "scatter": [c("scatter (tensor<T>:a, tensor<int64>:i, tensor<T>:s, var<int32>:1) -> (tensor<T>:y)",
                  {"a": r(3, 4), "i": Fixed(np.array([[3, 0], [1, 2]])), "s": r(2, 2)}, "a s",
                  lambda t: t["a"].scatter(1, t["i"], t["s"])),
                c("scatter (tensor<T>:a, tensor<int32>:i, tensor<T>:s, var<int32>:0) -> (tensor<T>:y)",
                  {"a": r(3, 2), "i": Fixed(np.array([[2, 0], [0, 1], [1, 2]], dtype=np.int32)), "s": r(3, 2)},
                  "a s", lambda t: t["a"].scatter(0, t["i"].long(), t["s"]))],
    "scatteradd": [c("scatteradd (tensor<T>:a, tensor<int64>:i, tensor<T>:s, var<int32>:1) -> (tensor<T>:y)",
                     {"a": r(3, 4), "i": Fixed(np.array([[3, 3, 0], [1, 2, 1]])), "s": r(2, 3)}, "a s",
                     lambda t: t["a"].scatter_add(1, t["i"], t["s"])),
                   c("scatteradd (tensor<T>:a, tensor<int64>:i, tensor<T>:s, var<int32>:-2) -> (tensor<T>:y)",
                     {"a": r(2, 3), "i": Fixed(np.array([[1, 1, 0], [1, 0, 0], [0, 0, 0]])), "s": r(3, 3)}, "s",
                     lambda t: t["a"].scatter_add(-2, t["i"], t["s"]))],
    "switch": [c("switch (listtensor<T>:[a b c], tensor<int32>:k) -> (tensor<T>:y)",
                 {"a": r(3, 4), "b": r(4), "c": r(3, 1), "k": Fixed(np.array([[0, 1, 2, 1]] * 3, dtype=np.int32))},
                 "a b c", _switch_ref),
               c("switch (listtensor<T>:[b a], tensor<bool>:k) -> (tensor<T>:y)",
                 {"a": r(2, 3), "b": r(2, 3), "k": Fixed(np.array([True, False, True]))}, "a b",
                 lambda t: torch.where(t["k"], t["a"], t["b"]))],
    "todtype": [c("todtype (tensor<T>:a) -> (tensor<float64>:y)", {"a": r(3, 4)}, "a", lambda t: t["a"] * 1.0)],
    "copytensor": [c("copytensor (tensor<T>:a) -> (tensor<T>:y)", {"a": r(3, 4)}, "a", lambda t: t["a"] * 1.0)],
    "crossentropy": [c(f"crossentropy (tensor<T>:a, tensor<int64>:k, var<int32>:-1, var<string>:{red}) -> "
                       "(tensor<T>:y)",
                       {"a": r(5, 4, lo=-3, hi=3), "k": Fixed(np.array([3, -1, 0, 2, 1], dtype=np.int64))}, "a",
                       lambda t, red=red: TF.cross_entropy(t["a"], t["k"], ignore_index=-1, reduction=red))
                     for red in ("mean", "sum", "none")],
    "mse": [c(f"mse (tensor<T>:a, tensor<T>:b, var<string>:{red}) -> (tensor<T>:y)",
              {"a": r(4, 3), "b": r(4, 3)}, "a b", lambda t, red=red: TF.mse_loss(t["a"], t["b"], reduction=red))
            for red in ("mean", "sum", "none")],
    "layernorm": [c("layernorm (tensor<T>:a, tensor<T>:w, tensor<T>:b, var<float64>:1e-5) -> (tensor<T>:y)",
                    {"a": r(*a, lo=-2, hi=2), "w": r(*w), "b": r(*w)}, "a w b", _norm_ref("layernorm", 1e-5, len(w)))
                  for a, w in [((4, 6), (6,)), ((2, 3, 5), (5,)), ((2, 3, 4), (3, 4))]]
    + [c("layernorm (tensor<T>:a, tensor<T>:w, tensor<T>:b) -> (tensor<T>:y)",
         {"a": r(3, 5), "w": r(5), "b": r(5)}, "w b", _norm_ref("layernorm", 1e-5, 1))],
    "conv2d": [c(f"conv2d (tensor<T>:a, tensor<T>:w, {vecs(s, p, d)}, var<int32>:{g}) -> (tensor<T>:y)",
                 {"a": r(*a), "w": r(*w)}, "a w",
                 lambda t, s=s, p=p, d=d, g=g: torch.nn.functional.conv2d(t["a"], t["w"], stride=s, padding=p,
                                                                          dilation=d, groups=g))
               for a, w, s, p, d, g in [((2, 3, 6, 5), (4, 3, 3, 2), (1, 1), (1, 0), (1, 1), 1),
                                        ((1, 4, 7, 7), (4, 2, 3, 3), (2, 1), (1, 1), (1, 2), 2)]],
    "maxpool2d": [c(f"maxpool2d (tensor<T>:a, {vecs(k, st, d)}) -> (tensor<T>:y)", {"a": r(*a)}, "a",
                    lambda t, k=k, st=st, d=d: torch.nn.functional.max_pool2d(t["a"], k, st, 0, d))
                  for a, k, st, d in [((2, 3, 7, 6), (3, 2), (2, 1), (1, 2)), ((1, 2, 6, 6), (2, 2), (2, 2), (1, 1)),
                                      ((2, 1, 5, 5), (3, 3), (1, 1), (1, 1))]],
    "sumpool2d": [c(f"sumpool2d (tensor<T>:a, {vecs(k, st, d)}) -> (tensor<T>:y)", {"a": r(*a)}, "a",
                    lambda t, k=k, st=st, d=d, ch=a[1]: torch.nn.functional.conv2d(
                        t["a"], torch.ones((ch, 1, *k), dtype=t["a"].dtype), stride=st, dilation=d, groups=ch))
                  for a, k, st, d in [((2, 3, 7, 6), (3, 2), (2, 1), (1, 2)), ((1, 2, 6, 6), (2, 2), (2, 2), (1, 1))]],
    "attention": [c(f"attention (tensor<T>:q, tensor<T>:k, tensor<T>:v, var<float64>:{sc}, var<bool>:{str(cz).lower()})"
                    " -> (tensor<T>:y, tensor:lse)", {"q": r(*qs), "k": r(*ks), "v": r(*vs)}, wrt,
                    lambda t, sc=sc, cz=cz, gqa=qs[:-2] != ks[:-2]: TF.scaled_dot_product_attention(
                        t["q"], t["k"], t["v"], is_causal=cz, scale=sc, enable_gqa=gqa))
                  for qs, ks, vs, sc, cz, wrt in [((2, 5, 4), (2, 5, 4), (2, 5, 3), 0.5, True, "q k v"),
                                                  ((2, 3, 6, 4), (2, 3, 4, 4), (2, 3, 4, 5), 0.7, True, "q k v"),
                                                  ((1, 4, 3, 4), (1, 2, 7, 4), (1, 2, 7, 4), 0.3, False, "q k v"),
                                                  ((3, 4), (5, 4), (5, 2), 1.0, False, "k"),
                                                  ((3, 4), (5, 4), (5, 2), 1.0, True, "q v")]],
    "maskedattention": [c(f"maskedattention (tensor<T>:q, tensor<T>:k, tensor<T>:v, tensor<{mt}>:m, var<float64>:{sc})"
                          " -> (tensor<T>:y, tensor:lse)", {"q": r(*qs), "k": r(*ks), "v": r(*vs), "m": Fixed(m)}, wrt,
                          lambda t, sc=sc, gqa=qs[:-2] != ks[:-2]: TF.scaled_dot_product_attention(
                              t["q"], t["k"], t["v"], attn_mask=t["m"], scale=sc, enable_gqa=gqa))
                        for qs, ks, vs, m, mt, sc, wrt in [
                            ((2, 5, 4), (2, 5, 4), (2, 5, 3), np.tril(np.ones((5, 5), bool)), "bool", 0.5, "q k v"),
                            ((1, 4, 3, 4), (1, 2, 7, 4), (1, 2, 7, 4), np.arange(7) <= np.arange(3)[:, None] + 4,
                             "bool", 0.3, "q k v"),  # a chunk of 3 queries after 4 cached keys
                            ((2, 3, 4), (2, 6, 4), (2, 6, 2), np.where(np.arange(6) % 4 == 3, -np.inf,
                                                                       np.linspace(-1, 1, 6)), "T", 0.7, "q k v")]],
    "batchnorm": [c("batchnorm (tensor<T>:a, tensor<T>:w, tensor<T>:b, var<float64>:1e-5) -> (tensor<T>:y, tensor:m, "
                    "tensor:v)", {"a": r(*a, lo=-2, hi=3), "w": r(a[1]), "b": r(a[1])}, wrt,
                    lambda t: TF.batch_norm(t["a"], None, None, t["w"], t["b"], training=True))
                  for a, wrt in [((4, 3, 5, 6), "a w b"), ((7, 5), "a w b"), ((2, 6, 9), "a"),
                                 ((3, 2, 3, 1, 2), "w b")]],
    "batchnormeval": [Case("batchnormeval (tensor<T>:a, tensor<T>:w, tensor<T>:b, tensor<S>:m, tensor<S>:v, "
                           "var<float64>:1e-3) -> (tensor<T>:y)",
                           {"a": r(*a, lo=-2, hi=3), "w": r(a[1]), "b": r(a[1]), "m": r(a[1]), "v": r(a[1], lo=0.5,
                                                                                                     hi=2)},
                           wrt.split(), lambda t: TF.batch_norm(t["a"], t["m"], t["v"], t["w"], t["b"], eps=1e-3),
                           extra={"m": "stats", "v": "stats"})
                      for a, wrt in [((4, 3, 5, 6), "a w b"), ((7, 5), "a w b"), ((2, 6, 9), "a")]],
    "groupnorm": [c(f"groupnorm (tensor<T>:a, tensor<T>:w, tensor<T>:b, var<int32>:{k}, var<float64>:1e-5) -> "
                    "(tensor<T>:y, tensor:m, tensor:v)", {"a": r(*a, lo=-2, hi=3), "w": r(a[1]), "b": r(a[1])}, wrt,
                    lambda t, k=k: TF.group_norm(t["a"], k, t["w"], t["b"]))
                  for a, k, wrt in [((3, 6, 5, 4), 2, "a w b"), ((2, 4, 7), 4, "a w b"), ((5, 3, 2, 3), 1, "a"),
                                    ((2, 6, 3), 3, "w b")]],
    "interpnearest": [c(f"interpnearest (tensor<T>:a, {vecs(size)}, var<float64>:{sh}, var<float64>:{sw}) -> "
                        "(tensor<T>:y)", {"a": r(*a)}, "a",
                        lambda t, size=size, sh=sh, sw=sw: TF.interpolate(
                            t["a"], **({"size": size} if not sh else {"scale_factor": (sh, sw)}), mode="nearest"))
                      for a, size, sh, sw in [((2, 3, 5, 7), (9, 4), 0, 0), ((1, 2, 4, 3), (10, 7), 2.5, 2.5),
                                              ((2, 1, 6, 6), (3, 12), 0.5, 2.0)]],
    "interpbilinear": [c(f"interpbilinear (tensor<T>:a, {vecs(size)}, var<bool>:{str(ac).lower()}, var<float64>:{sh}, "
                         f"var<float64>:{sw}) -> (tensor<T>:y)", {"a": r(*a)}, "a",
                         lambda t, size=size, sh=sh, sw=sw, ac=ac: TF.interpolate(
                             t["a"], **({"size": size} if not sh else {"scale_factor": (sh, sw)}), mode="bilinear",
                             align_corners=ac))
                       for a, size, ac, sh, sw in [((2, 3, 5, 7), (9, 4), False, 0, 0),
                                                   ((2, 3, 5, 7), (9, 4), True, 0, 0),
                                                   ((1, 2, 4, 3), (10, 7), False, 2.5, 2.5),
                                                   ((2, 1, 6, 6), (3, 12), False, 0.5, 2.0),
                                                   ((1, 1, 1, 5), (1, 8), True, 0, 0)]],
    "rmsnorm": [c("rmsnorm (tensor<T>:a, tensor<T>:w, var<float64>:1e-6) -> (tensor<T>:y)",
                  {"a": r(*a, lo=-2, hi=2), "w": r(*w)}, "a w", _norm_ref("rmsnorm", 1e-6, len(w)))
                for a, w in [((4, 6), (6,)), ((2, 3, 5), (5,)), ((2, 3, 4), (3, 4))]],
    "fused": [
        _fused("abs(exp(in0 * in1 + in2) * 0.5 - in1)", {"a": r(3, 4), "b": r(4), "c": r(3, 1)}, "a b c"),
        _fused("maximum(in0, 0.3) * minimum(2.0, in1) / sqrt(in2) + maximum(in0, in1) - minimum(in1, in2)",
               {"a": r(2, 3), "b": r(2, 3), "c": r(2, 3, lo=0.5, hi=2)}, "a b c"),
        _fused("-(in0 ** 2.0) + 2.0 ** in1 - 3.0 / in2 + tanh(in0) * sin(in1) * cos(in2) * log(in2) * tan(in0)"
               " + in0 ** in2 - (1 - in1) / (2 + 3) + +in2",
               {"a": r(5, lo=0.5, hi=1.5), "b": r(5), "c": r(5, lo=0.5, hi=2)}, "a b c"),
        _fused("in0 * in0 - in0", {"a": r(3), "b": r(2, 1)}, "a b"),
        # the rounding steps pass no gradient; log1p and expm1 do
        _fused("log1p(in0) * floor(in1 * 3) + expm1(in2) * in1 - ceil(in0) * round(in1) + trunc(in2 * 2) * in0",
               {"a": r(3, 4, lo=0.1, hi=2), "b": r(4), "c": r(3, 1)}, "a b c"),
        # comparisons are masks (what the relu and clamp rules emit): they pass no gradient themselves
        _fused("in0 * (in1 > 0.25) + (in2 <= in0) * in1 - (in0 != 0.1) * in2 + (in2 == in2) * in0 * (0.5 < in1)"
               " + in1 * (in0 >= in2) - in2 * (-0.5 > in0) + (in1 < in0)", {"a": r(3, 4), "b": r(4), "c": r(3, 1)},
               "a b c"),
        _fused("in1", {"a": r(2, 3), "b": r(3)}, "a b"),
    ],
    "dropout": [],  # checked apart: test_dropout_gradient_is_the_mask_scaled
    # collectives, in a process group of one rank (SOLO): the identity, and so their gradients; their gradients over
    # several ranks are checked against one process in tests/sdk/test_distributed.py
    "allreduce": [c(f"allreduce (tensor<T>:a, var<string>:{how}, var<string>:default) -> (tensor<T>:y)",
                    {"a": r(3, 4)}, "a", lambda t: t["a"].clone()) for how in ("sum", "mean")],
    "allgather": [c("allgather (tensor<T>:a, var<int32>:1, var<string>:default) -> (tensor<T>:y)", {"a": r(2, 3)}, "a",
                    lambda t: t["a"].clone())],
    "reducescatter": [c(f"reducescatter (tensor<T>:a, var<int32>:1, var<string>:{how}, var<string>:default) -> "
                        "(tensor<T>:y)", {"a": r(2, 3)}, "a", lambda t: t["a"].clone()) for how in ("sum", "mean")],
}

#: a process group of one rank, "default", as a daemon holds it (deepxd/comm.py)
SOLO = Collectives()
SOLO.formed("default", "solo", 0, [{"node": "here"}], 5.0)


def _sliceassign_ref(a: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    out = a.clone()
    out[1:3, 0:6:2] = v
    return out


DIFFERENTIABLE = sorted(n for n, op in OPS.items() if op.differentiable)


def _param(op: str) -> list:
    dts = [d for d in ORDER if d in OPS[op].dtypes]
    return [pytest.param(op, d, id=f"{op}-{d}") for d in dts] or [pytest.param(op, None, id=op)]


def check(case: Case, dtype: str, rng: np.random.Generator) -> None:
    inputs: dict[str, np.ndarray] = {}
    for name, spec in case.inputs.items():
        np_dt = to_numpy(stats_dtype(dtype) if case.extra.get(name) == "stats" else dtype)
        if isinstance(spec, R):
            inputs[name] = rng.uniform(spec.lo, spec.hi, spec.shape).astype(np_dt)
        elif spec.value.dtype.kind == "f":
            inputs[name] = spec.value.astype(np_dt)
        else:
            inputs[name] = spec.value
    fwd = program(case.text.replace("<T>", f"<{dtype}>").replace("<S>", f"<{stats_dtype(dtype)}>"))
    ex = executor(inputs)
    ex.collectives = SOLO
    ex.run_all(fwd)
    y = ex.get("y")
    up = rng.uniform(-1, 1, y.shape).astype(y.dtype)
    ex.put("up", up)
    before = set(ex.tensors)
    back, names = grad_program(fwd, "y", case.wrt, ex, grad_loss="up")
    ex.run_all(back)
    assert set(ex.tensors) - before == set(names.values()), "the backward leaves only the gradients behind"
    tt = {k: torch.tensor(v.astype(np.float64) if v.dtype.kind == "f" or v.dtype.kind == "V" else v,
                          requires_grad=k in case.wrt) for k, v in inputs.items()}
    out = case.ref(tt)
    rtol, atol = TOL[dtype]
    np.testing.assert_allclose(y.astype(np.float64), out.detach().numpy(), rtol=rtol * 10, atol=atol * 10 + rtol,
                               err_msg="forward")
    out.backward(torch.tensor(up.astype(np.float64)))
    for w in case.wrt:
        want = tt[w].grad
        want = np.zeros(inputs[w].shape) if want is None else want.numpy()
        got = ex.get(names[w])
        assert got.shape == inputs[w].shape and got.dtype == inputs[w].dtype, w
        scale = max(1.0, float(np.abs(want).max(initial=0.0)))
        np.testing.assert_allclose(got.astype(np.float64), want, rtol=rtol, atol=atol * scale,
                                   err_msg=f"d{w} ({dtype})")


@pytest.mark.parametrize(("op", "dtype"), [p for op in DIFFERENTIABLE for p in _param(op)])
def test_gradient_against_torch(op, dtype, rng):
    assert op in CASES, f"{op} is differentiable but has no gradient test here: add its cases to CASES"
    if op == "dropout":
        return  # test_dropout_gradient_is_the_mask_scaled
    assert CASES[op], op
    for case in CASES[op]:
        if dtype in case.dtypes:
            check(case, dtype, rng)


def test_every_differentiable_op_has_a_rule_and_no_other_op_has_one():
    assert sorted(n for n in OPS if grad_rule(n) is not None) == DIFFERENTIABLE
    assert not set(GRAD_RULES) & {n for n in OPS if OPS[n].grad_rule}, "a rule in the op table and in GRAD_RULES"
    assert set(CASES) <= set(DIFFERENTIABLE), sorted(set(CASES) - set(DIFFERENTIABLE))


def test_every_rule_states_its_formula():
    for name, fn in GRAD_RULES.items():
        assert fn.__doc__ and fn.__doc__.strip(), f"the rule of {name} has no docstring (its formula, for docs/ir.md)"
    assert rule_formula("sigmoid") == "dA = g * (y * (1 - y))"  # a rule in the op table, run on symbols
    assert rule_formula("log") == "dA = g / A"


def _dropout_backward(x: np.ndarray, dtype: str, p: float, seed: int, rng) -> tuple[np.ndarray, np.ndarray,
                                                                                  np.ndarray]:
    """y = dropout(p, seed) of a copy of x, and dx for a random upstream gradient: (y, up, dx)."""
    fwd = program(f"""
        copytensor (tensor<{dtype}>:x) -> (tensor<{dtype}>:y)
        dropout (var<float64>:{p}, var<int64>:{seed}) -> (tensor<{dtype}>:y)
    """)
    ex = executor({"x": x})
    ex.run_all(fwd)
    up = rng.uniform(-1, 1, x.shape).astype(x.dtype)
    ex.put("up", up)
    back, names = grad_program(fwd, "y", ["x"], ex, grad_loss="up")
    ex.run_all(back)
    return ex.get("y"), up, ex.get(names["x"])


@pytest.mark.parametrize("dtype", ORDER)
@pytest.mark.parametrize("seed", [0, 1234])
def test_dropout_gradient_is_the_mask_scaled(dtype, seed, rng):
    p = 0.4
    x = rng.uniform(0.5, 1.5, (50, 40)).astype(to_numpy(dtype))
    x[0, :5] = 0  # zeros in the input: with a seed the mask is drawn again, so their gradient is exact too
    y, up, dx = _dropout_backward(x, dtype, p, seed, rng)
    got = dx.astype(np.float64)
    y = y.astype(np.float64)
    nz = x != 0
    kept = np.zeros(x.shape, dtype=bool)
    kept[nz] = y[nz] != 0
    if seed:  # the mask of the zero inputs, drawn from the same seed on ones
        ones = executor({"o": np.ones(x.shape, x.dtype)})
        ones.run(program(f"dropout (var<float64>:{p}, var<int64>:{seed}) -> (tensor<{dtype}>:o)")[0])
        kept[~nz] = ones.get("o")[~nz] != 0
    want = up.astype(np.float64) * kept / (1 - p)
    assert 0.45 < kept.mean() < 0.75
    rtol, atol = TOL[dtype]
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol)


@pytest.mark.parametrize("dtype", ORDER)
@pytest.mark.parametrize("seed", [0, 1234])
def test_dropout_with_p_1_has_torch_s_gradient(dtype, seed, rng):
    """p = 1 drops everything (y = x * 0, as torch): the gradient is g * 0; the rule divided by 1 - p = 0."""
    x = rng.uniform(0.5, 1.5, (6, 5)).astype(to_numpy(dtype))
    y, up, dx = _dropout_backward(x, dtype, 1, seed, rng)
    tx = torch.from_numpy(x.astype(np.float64)).requires_grad_()
    torch.nn.functional.dropout(tx, p=1.0).backward(torch.from_numpy(up.astype(np.float64)))
    np.testing.assert_array_equal(y.astype(np.float64), 0.0)
    np.testing.assert_array_equal(dx.astype(np.float64), tx.grad.numpy())


def test_fused_rule_unfuses_the_expression():
    names = iter(f"t{i}" for i in range(100))
    prog, root = unfuse("maximum(in0, 2) * (3 - in1) / 2.0 ** in0 + (1 + 2) * -in1", ["x", "y"], "float32",
                        lambda: next(names))
    ops = [i.name for i in prog]
    assert ops == ["maxscalar", "rsubscalar", "mul", "rpowscalar", "div", "neg", "mulscalar", "add"]
    assert root == "t7"
    assert unfuse("1.0 + 2.0 * 3.0", ["x"], "float64", lambda: next(names)) == ([], 7.0)
    # round's halves go to even, as numpy's and numexpr's do; the steps keep an infinity
    whole = "floor(2.7) + round(2.5) * 10 + trunc(-1.5) * 100 + ceil(0.2) * 1000 + log1p(0) + expm1(0)"
    assert unfuse(whole, ["x"], "float64", lambda: next(names)) == ([], 922.0)
    assert unfuse("floor(1e999)", ["x"], "float64", lambda: next(names)) == ([], math.inf)
    # the rounded divisions: a scalar first has ops of its own; numbers alone fold as Python's % and // do
    prog, _ = unfuse("fmod(in0, in1) + remainder(2.5, in0) - floordiv(in1, -2) + fmod(-7, in1)", ["x", "y"],
                     "float32", lambda: next(names))
    assert [i.name for i in prog] == ["fmod", "rremainderscalar", "add", "floordivscalar", "sub", "rfmodscalar", "add"]
    assert unfuse("remainder(-7, 2) + floordiv(-7, 2) * 10 + fmod(-7, 2) * 100", ["x"], "float64",
                  lambda: next(names)) == ([], 1.0 - 40.0 - 100.0)
    assert unfuse("floordiv(-1, 0)", ["x"], "float64", lambda: next(names)) == ([], -math.inf)  # x / 0, as numpy
    assert math.isnan(unfuse("remainder(1, 0)", ["x"], "float64", lambda: next(names))[1])


def test_fused_of_numbers_alone_gives_no_gradient(rng):
    x = rng.uniform(-1, 1, (3,))
    fwd = program("fused (listtensor<float64>:[x], var<string>:2.0 * 3.0) -> (tensor<float64>:y)")
    ex = executor({"x": x})
    ex.run_all(fwd)
    ex.put("up", np.ones(3))
    back, names = grad_program(fwd, "y", ["x"], ex, grad_loss="up")
    ex.run_all(back)
    np.testing.assert_array_equal(ex.get(names["x"]), np.zeros(3))


def test_crossentropy_labels_take_no_gradient_and_say_so(rng):
    fwd = program("""
        todtype (tensor<float64>:f) -> (tensor<int64>:k)
        crossentropy (tensor<float64>:a, tensor<int64>:k) -> (tensor<float64>:y)
    """)
    ex = executor({"a": rng.uniform(-1, 1, (3, 4)), "f": np.array([0.0, 1.0, 2.0])})
    back, names = grad_program(fwd, "y", ["a", "f"], ex)  # int labels cut the path from f: it gets zeros
    ex.run_all(fwd)
    ex.run_all(back)
    np.testing.assert_array_equal(ex.get(names["f"]), np.zeros(3))


def test_attention_s_gradient_flows_from_its_result_only(rng):
    """A loss that reads attention's logsumexp is refused by name (the rule turns the result's gradient only); one
    that reads only the result leaves the unused gradients deleted."""
    attend = "attention (tensor<float64>:q, tensor<float64>:q, tensor<float64>:q, var<float64>:0.5)"
    fwd = program(attend + """ -> (tensor<float64>:y, tensor<float64>:lse)
        sum (tensor<float64>:lse, vector<int32>:[]) -> (tensor<float64>:s)
        sum (tensor<float64>:y, vector<int32>:[]) -> (tensor<float64>:t)
        add (tensor<float64>:s, tensor<float64>:t) -> (tensor<float64>:loss)
    """)
    ex = executor({"q": rng.uniform(-1, 1, (3, 4))})
    with pytest.raises(DeepxError, match="depends on result 'lse' of attention, which carries no gradient "
                                         "\\(attention's gradient flows from its first result only, but 'lse' lies "
                                         "between \\['q'\\]"):
        grad_program(fwd, "loss", ["q"], ex)
    back, names = grad_program(fwd[:1] + fwd[2:3], "t", ["q"], ex)
    assert [i.name for i in back if i.name != "deltensor"] == ["newtensor", "constant", "reshape", "broadcastTo",
                                                                "attentiongrad", "add", "add"]
    ex.run_all(fwd[:1] + fwd[2:3])
    ex.run_all(back)
    assert set(ex.tensors) == {"q", "y", "lse", "t", names["q"]}


def test_a_rule_that_needs_an_overwritten_input_names_it(rng):
    fwd = program("""
        layernorm (tensor<float64>:a, tensor<float64>:w, tensor<float64>:b) -> (tensor<float64>:y)
        mulscalar (tensor<float64>:a, var<float64>:2.0) -> (tensor<float64>:a)
    """)
    ex = executor({"a": rng.uniform(-1, 1, (2, 3)), "w": np.ones(3), "b": np.zeros(3)})
    ex.put("up", np.ones((2, 3)))
    for wrt in (["a"], ["w"]):  # the weight's gradient needs the normalized input too
        with pytest.raises(DeepxError, match="layernorm needs the value of 'a', which the forward program overwrites"):
            grad_program(fwd, "y", wrt, ex, grad_loss="up")
    grad_program(fwd, "y", ["b"], ex, grad_loss="up")  # the bias's does not


def test_a_norm_s_statistics_carry_no_gradient_and_say_so(rng):
    fwd = program("""
        batchnorm (tensor<float64>:a, tensor<float64>:w, tensor<float64>:b) -> (tensor<float64>:y, tensor:m, tensor:v)
        sum (tensor<float64>:m, vector<int32>:[]) -> (tensor<float64>:loss)
    """)
    ex = executor({"a": rng.uniform(-1, 1, (4, 3)), "w": np.ones(3), "b": np.zeros(3)})
    ex.run_all(fwd)
    with pytest.raises(DeepxError, match="depends on result 'm' of batchnorm, which carries no gradient"):
        grad_program(fwd, "loss", ["a"], ex)
