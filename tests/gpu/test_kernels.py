"""Every op of the catalogue x every dtype it claims, forward, on the CUDA executor against the CPU executor on the
same random inputs (integers and bools exactly, floats within a tolerance per dtype); the random init ops by their
statistics (Philox draws differ from numpy's). The cases are keyed by op and the test is parametrized over OPS, so
an op without a case here fails (`test_every_op_has_a_case` runs without a GPU too).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

from deepx_core.ir.dtypes import FLOAT8, from_numpy, to_numpy
from deepx_core.ir.instr import Instr
from deepx_core.ir.ops import OPS
from deepxd.kernels.cpu import CpuExecutor
from tests.kernels.kernel_ref import VEC, L, T, V, instr, ordered, rand

# (rtol, atol) of a CUDA result against the CPU's: about two units in the last place of each dtype
TOL = {"float64": (1e-9, 1e-12), "float32": (3e-5, 1e-6), "float16": (2.5e-3, 1e-4), "bfloat16": (1.6e-2, 1e-3),
       "float8e5m2": (0.26, 1e-2), "float8e4m3": (0.13, 1e-2)}


@dataclass
class Case:
    inputs: dict[str, np.ndarray]
    program: list[Instr]
    outputs: list[str]
    scale: str = "elem"  # "max": errors relative to the largest output (sums, products of matrices)
    check: str = "compare"  # "compare" | "names" | "vars" | custom
    extra: dict[str, Any] = field(default_factory=dict)


Builder = Callable[[np.random.Generator, str], list[Case]]
CASES: dict[str, Builder] = {}


def case(*ops: str) -> Callable[[Builder], Builder]:
    def deco(fn: Builder) -> Builder:
        for op in ops:
            CASES[op] = fn
        return fn

    return deco


def one(name: str, inputs: dict[str, np.ndarray], args: list[Any], out_dtype: str | None = None,
        out: str = "C", **kw: Any) -> Case:
    return Case(inputs, [instr(name, args, [T(out, out_dtype)])], [out], **kw)


def is_int(dt: str) -> bool:
    return dt.startswith("int")


def r(rng: np.random.Generator, dt: str, shape: tuple[int, ...], lo: float = -4.0, hi: float = 4.0,
      away: float = 0.0) -> np.ndarray:
    return rand(rng, dt, shape, lo, hi, away=away)


# ---------------------------------------------------------------- cases

@case("newtensor")
def _newtensor(rng, dt):
    return [Case({}, [instr("newtensor", [VEC((2, 3))], [T("t", dt)])], ["t"])]


@case("copytensor")
def _copytensor(rng, dt):
    a = r(rng, dt, (3, 5))
    b = r(rng, dt, (3, 5))
    return [Case({"a": a}, [instr("copytensor", [T("a")], [T("b")])], ["a", "b"]),
            Case({"a": a, "b": b}, [instr("copytensor", [T("a")], [T("b")])], ["b"])]


@case("deltensor")
def _deltensor(rng, dt):
    return [Case({"a": r(rng, dt, (2,)), "b": r(rng, dt, (3,))}, [instr("deltensor", [], [T("a")])], ["b"],
                 check="names")]


@case("renametensor")
def _renametensor(rng, dt):
    return [Case({"a": r(rng, dt, (2, 2))}, [instr("renametensor", [V("z")], [T("a")])], ["z"], check="names")]


@case("argset", "vecset")
def _vars(rng, dt):
    return [Case({}, [instr("argset", [V(2.5)], [V("x")]), instr("vecset", [VEC((1, 2))], [VEC("v")])], [],
                 check="vars")]


@case("constant")
def _constant(rng, dt):
    value = 1 if dt == "bool" else 3 if is_int(dt) else 1.75
    big = 300 if is_int(dt) else -2.5  # integers out of range wrap as C casts do
    return [Case({"t": np.zeros((3, 7), to_numpy(dt))}, [instr("constant", [V(value)], [T("t")])], ["t"]),
            Case({"t": np.zeros((5,), to_numpy(dt))}, [instr("constant", [V(big)], [T("t")])], ["t"])]


@case("arange")
def _arange(rng, dt):
    start, step = (3, -2) if is_int(dt) else (0.5, 0.25)
    return [Case({"t": np.zeros((4, 5), to_numpy(dt))}, [instr("arange", [V(start), V(step)], [T("t")])], ["t"]),
            Case({"t": np.zeros((7,), to_numpy(dt))}, [instr("arange", [V(1.5), V(2)], [T("t")])], ["t"])]


@case("uniform")
def _uniform(rng, dt):
    return [Case({"t": np.zeros((200, 500), to_numpy(dt))}, [instr("uniform", [V(-2.0), V(3.0), V(7)], [T("t")])],
                 ["t"], check="uniform", extra={"low": -2.0, "high": 3.0})]


@case("normal")
def _normal(rng, dt):
    return [Case({"t": np.zeros((200, 500), to_numpy(dt))}, [instr("normal", [V(1.5), V(2.0), V(11)], [T("t")])],
                 ["t"], check="normal", extra={"mean": 1.5, "std": 2.0})]


@case("dropout")
def _dropout(rng, dt):
    a = r(rng, dt, (300, 400), 0.5, 2.0)
    return [Case({"A": a}, [instr("dropout", [V(0.25), V(5)], [T("A")])], ["A"], check="dropout",
                 extra={"p": 0.25, "a": a})]


@case("print")
def _print(rng, dt):
    return [Case({"a": r(rng, dt, (2, 3))}, [instr("print", [T("a")], [])], [], check="print")]


@case("save", "load", "loadtensordata")
def _files(rng, dt):
    return [Case({"a": r(rng, dt, (3, 4))}, [], [], check="files")]


_BINARY = ("add", "sub", "mul", "div", "max", "min", "pow", "fmod", "remainder", "floordiv")


def _binary_inputs(rng, dt, op, sa, sb):
    if op == "pow":
        if is_int(dt):
            return r(rng, dt, sa, -3, 3), r(rng, dt, sb, 0, 3)
        return r(rng, dt, sa, 0.5, 2.0), r(rng, dt, sb, -2.0, 2.0)
    if op in ("div", "fmod", "remainder", "floordiv"):  # (the last three: negative operands of either sign)
        return r(rng, dt, sa, -50 if is_int(dt) else -4, 50 if is_int(dt) else 4), r(rng, dt, sb, away=1.0)
    return r(rng, dt, sa), r(rng, dt, sb)


def _make_binary(op):
    def build(rng, dt):
        out = []
        # (the last four: a row down a matrix, either way round, four a thread and one)
        for sa, sb in [((5, 7), (5, 7)), ((64,), (64,)), ((3, 4, 5), (4, 1)), ((2, 1, 3), (1, 4, 1)), ((), (3,)),
                       ((6, 8), (8,)), ((8,), (3, 6, 8)), ((5, 7), (7,)), ((7,), (3, 5, 7))]:
            a, b = _binary_inputs(rng, dt, op, sa, sb)
            out.append(one(op, {"A": a, "B": b}, [T("A"), T("B")]))
        a, b = _binary_inputs(rng, dt, op, (4, 6), (4, 6))
        out.append(Case({"A": a, "B": b}, [instr(op, [T("A"), T("B")], [T("A")])], ["A"]))  # in place
        return out

    return build


for _op in _BINARY:
    CASES[_op] = _make_binary(_op)

_SCALAR = ("addscalar", "subscalar", "mulscalar", "divscalar", "powscalar", "maxscalar", "minscalar", "rsubscalar",
           "rdivscalar", "rpowscalar", "fmodscalar", "remainderscalar", "floordivscalar", "rfmodscalar",
           "rremainderscalar", "rfloordivscalar")


def _make_scalar(op):
    rev = op.startswith("r") and op != "remainderscalar"  # the scalar comes first

    def build(rng, dt):
        shape = (6, 9)
        if op == "powscalar":
            a = r(rng, dt, shape, -3, 3) if is_int(dt) else r(rng, dt, shape, 0.5, 2.0)
            ss = [2, 0] if is_int(dt) else [1.5, 2, -0.5]
        elif op == "rpowscalar":
            a = r(rng, dt, shape, 0, 4) if is_int(dt) else r(rng, dt, shape, -2.0, 2.0)
            ss = [2, 3] if is_int(dt) else [1.5, 0.5]
        elif op in ("rdivscalar", "rfmodscalar", "rremainderscalar", "rfloordivscalar"):
            a = r(rng, dt, shape, away=1.0)
            ss = [7, -2.5] if is_int(dt) else [3.0, -1]
        elif op in ("fmodscalar", "remainderscalar", "floordivscalar"):
            a = r(rng, dt, shape)
            ss = [1.5, -2, 0.75]
        else:
            a = r(rng, dt, shape, -50, 50) if is_int(dt) else r(rng, dt, shape)
            # integers out of the dtype's range compute in int64 and wrap (divscalar refuses them on the CPU)
            ss = ([3, -2.5, 100 if op == "divscalar" else 1000]) if is_int(dt) else [1.5, -2]
        out = []
        for s in ss:
            args = [V(s), T("A")] if rev else [T("A"), V(s)]
            out.append(one(op, {"A": a}, args))
        return out

    return build


for _op in _SCALAR:
    CASES[_op] = _make_scalar(_op)


def _make_unary(op, lo=-3.0, hi=3.0):
    def build(rng, dt):
        a = r(rng, dt, (7, 9), lo, hi)
        if dt == "bool":
            a = rng.random((7, 9)) < 0.5
        args = [T("A")]
        cases = [one(op, {"A": a}, args), one(op, {"A": r(rng, dt, (1031,), lo, hi)}, args)]
        if op == "gelu":
            cases.append(one(op, {"A": a}, [T("A"), V("tanh")]))
        if op in ("floor", "ceil", "round", "trunc"):  # halves (round's ties go to even) and signed zeros
            halves = np.concatenate([np.arange(-20, 21) / 2, [-0.0, 0.25, -0.25]]).astype(to_numpy(dt))
            cases.append(one(op, {"A": halves}, args))
        return cases

    return build


for _op, _lo, _hi in [("sqrt", 0.0, 9.0), ("log", 0.01, 9.0), ("exp", -5.0, 5.0), ("sin", -4.0, 4.0),
                      ("cos", -4.0, 4.0), ("tan", -1.2, 1.2), ("neg", -9.0, 9.0), ("abs", -9.0, 9.0),
                      ("invert", -9.0, 9.0), ("relu", -3.0, 3.0), ("sigmoid", -8.0, 8.0), ("tanh", -4.0, 4.0),
                      ("gelu", -4.0, 4.0), ("erf", -3.0, 3.0), ("silu", -6.0, 6.0), ("floor", -9.0, 9.0),
                      ("ceil", -9.0, 9.0), ("round", -9.0, 9.0), ("trunc", -9.0, 9.0), ("log1p", -0.9, 9.0),
                      ("expm1", -5.0, 5.0)]:
    CASES[_op] = _make_unary(_op, _lo, _hi)


@case("gelugrad")
def _gelugrad(rng, dt):
    """gelu's gradient, both forms, over its tails (-6 to 6) too."""
    out = []
    for shape in ((7, 9), (1031,)):
        a, g = r(rng, dt, shape, -6.0, 6.0), r(rng, dt, shape, -2.0, 2.0)
        out += [one("gelugrad", {"A": a, "G": g}, [T("A"), T("G"), *extra]) for extra in ([], [V("tanh")])]
    return out


@case("todtype")
def _todtype(rng, dt):
    if dt == "bool":
        a = rng.random((5, 6)) < 0.5
    elif dt in FLOAT8:
        a = r(rng, dt, (5, 6), -100, 100)
    else:
        a = r(rng, dt, (5, 6), -100, 100)
    out = []
    for dst in ordered(OPS["todtype"].dtypes):
        out.append(Case({"A": a}, [instr("todtype", [T("A")], [T("C", dst)])], ["C"]))
    return out


def _near_copy(rng, a, b):
    """b with about 40% of its elements equal to a's (same shapes), so that equal and notequal see both answers."""
    if np.shape(a) != np.shape(b):
        return b
    return np.where(rng.random(np.shape(b)) < 0.4, a, b).astype(b.dtype)


def _make_compare(op):
    def build(rng, dt):
        out = []
        for sa, sb in [((6, 8), (6, 8)), ((3, 4, 5), (4, 1))]:
            if dt == "bool":
                a, b = rng.random(sa) < 0.5, rng.random(sb) < 0.5
            else:
                a, b = r(rng, dt, sa, -3, 3), r(rng, dt, sb, -3, 3)
                b = _near_copy(rng, a, b)
            args = [T("A"), T("B")]
            out.append(one(op, {"A": a, "B": b}, args, "bool"))
            if op in ("equal", "notequal"):
                out.append(one(op, {"A": a, "B": b}, [*args, V(0.5)], "bool"))
        return out

    return build


for _op in ("less", "greater", "equal", "notequal"):
    CASES[_op] = _make_compare(_op)


def _make_scalar_compare(op):
    def build(rng, dt):
        if dt == "bool":
            a = rng.random((6, 8)) < 0.5
            ss = [0, 1]
        else:
            a = r(rng, dt, (6, 8), -3, 3)
            ss = [1, -1.5, 0.5] if not is_int(dt) else [1, 2.5, -1000]
        out = []
        for s in ss:
            args = [T("A"), V(s)]
            if op.startswith(("equal", "notequal")):
                out.append(one(op, {"A": a}, args, "bool"))
                out.append(one(op, {"A": a}, [*args, V(1.0)], "bool"))
            else:
                out.append(one(op, {"A": a}, args, "bool"))
        return out

    return build


for _op in ("lessscalar", "greaterscalar", "equalscalar", "notequalscalar"):
    CASES[_op] = _make_scalar_compare(_op)


@case("switch")
def _switch(rng, dt):
    x, y, z = (r(rng, dt, (4, 5)) for _ in range(3))
    cases = rng.integers(0, 3, (4, 5)).astype(np.int32)
    flags = rng.random((1, 5)) < 0.5
    return [Case({"x": x, "y": y, "z": z, "c": cases},
                 [instr("switch", [L(["x", "y", "z"]), T("c")], [T("C")])], ["C"]),
            Case({"x": x, "y": r(rng, dt, (5,)), "c": flags},
                 [instr("switch", [L(["x", "y"]), T("c")], [T("C")])], ["C"])]


@case("matmul")
def _matmul(rng, dt):
    lo, hi = (-3, 3) if is_int(dt) else (-1.0, 1.0)
    out = []
    for sa, sb in [((5, 7), (7, 3)), ((2, 3, 33, 17), (17, 9)), ((4, 6), (2, 6, 5)), ((3, 1, 4, 5), (1, 2, 5, 3)),
                   ((64, 128), (128, 96)), ((2, 0), (0, 3))]:
        out.append(one("matmul", {"A": r(rng, dt, sa, lo, hi), "B": r(rng, dt, sb, lo, hi)}, [T("A"), T("B")],
                       scale="max"))
    return out


@case("matmultransposed")
def _matmultransposed(rng, dt):
    out = []
    for sa, sb in [((5, 7), (7, 3)), ((2, 3, 33, 17), (17, 9)), ((3, 1, 4, 5), (1, 2, 5, 3)), ((2, 0), (0, 3))]:
        for ta, tb in [(False, False), (True, False), (False, True), (True, True)]:
            a = r(rng, dt, (*sa[:-2], sa[-1], sa[-2]) if ta else sa, -1.0, 1.0)
            b = r(rng, dt, (*sb[:-2], sb[-1], sb[-2]) if tb else sb, -1.0, 1.0)
            out.append(one("matmultransposed", {"A": a, "B": b}, [T("A"), T("B"), V(ta), V(tb)], scale="max"))
    return out


@case("reshape")
def _reshape(rng, dt):
    a = r(rng, dt, (3, 4))
    return [one("reshape", {"A": a}, [T("A"), VEC((-1, 2))], out="B"),
            Case({"A": a}, [instr("reshape", [T("A"), VEC((2, 6))], [T("A")])], ["A"])]


@case("transpose")
def _transpose(rng, dt):
    # a head split (inner rows of 16 items: copied in 16- or 8-byte items), odd inner rows (item by item), five dims
    return [one("transpose", {"A": r(rng, dt, (2, 3, 4))}, [T("A"), VEC((2, 0, 1))]),
            Case({"A": r(rng, dt, (5, 5))}, [instr("transpose", [T("A"), VEC((1, 0))], [T("A")])], ["A"]),
            one("transpose", {"A": r(rng, dt, (3, 7, 4, 16))}, [T("A"), VEC((0, 2, 1, 3))]),
            one("transpose", {"A": r(rng, dt, (3, 7, 4, 5))}, [T("A"), VEC((0, 2, 1, 3))]),
            one("transpose", {"A": r(rng, dt, (2, 3, 4, 5, 6))}, [T("A"), VEC((4, 2, 0, 3, 1))])]


@case("concat")
def _concat(rng, dt):
    ts = {"x": r(rng, dt, (2, 1, 4)), "y": r(rng, dt, (2, 3, 4)), "z": r(rng, dt, (2, 2, 4))}
    return [Case(ts, [instr("concat", [L(["x", "y", "z"]), V(1)], [T("C")])], ["C"]),
            Case(ts, [instr("concat", [L(["x", "x"]), V(-1)], [T("C")])], ["C"])]


@case("broadcastTo")
def _broadcast(rng, dt):
    return [one("broadcastTo", {"A": r(rng, dt, (3, 1))}, [T("A"), VEC((2, 3, 4))], out="B")]


@case("indexselect")
def _indexselect(rng, dt):
    a = r(rng, dt, (4, 5, 3))
    return [one("indexselect", {"A": a, "i": rng.integers(0, 5, (2, 3)).astype(np.int32)}, [T("A"), T("i"), V(1)],
                out="B"),
            one("indexselect", {"A": a, "i": rng.integers(0, 4, (6,)).astype(np.int64)}, [T("A"), T("i"), V(0)],
                out="B")]


@case("repeat")
def _repeat(rng, dt):
    return [one("repeat", {"A": r(rng, dt, (2, 3))}, [T("A"), VEC((2, 1, 3))], out="B")]


def _make_reduce(op):
    def build(rng, dt):
        lo, hi = ((0.5, 1.5) if op == "prod" else (-4, 4)) if not is_int(dt) else ((-2, 2) if op == "prod" else
                                                                                    (-50, 50))
        a = r(rng, dt, (3, 4, 5), lo, hi)
        out = [one(op, {"A": a}, [T("A"), VEC((1,))], out="B", scale="max"),
               one(op, {"A": a}, [T("A"), VEC((0, 2)), V(True)], out="B", scale="max"),
               one(op, {"A": a}, [T("A"), VEC(())], out="B", scale="max")]
        if op != "prod":
            big = r(rng, dt, (2, 40000), lo, hi)
            out.append(one(op, {"A": big}, [T("A"), VEC((1,))], out="B", scale="max"))
            out.append(one(op, {"A": r(rng, dt, (300, 70), lo, hi)}, [T("A"), VEC((0,))], out="B", scale="max"))
        return out

    return build


for _op in ("sum", "prod", "reducemax", "reducemin"):
    CASES[_op] = _make_reduce(_op)


def _make_arg(op):
    def build(rng, dt):
        a = r(rng, dt, (3, 40, 5), -3, 3)  # small integer range: ties
        return [one(op, {"A": a}, [T("A"), V(1)], out="B"), one(op, {"A": a}, [T("A"), V(-1), V(True)], out="B"),
                one(op, {"A": r(rng, dt, (2, 3000))}, [T("A"), V(1)], out="B")]

    return build


for _op in ("argmax", "argmin"):
    CASES[_op] = _make_arg(_op)


@case("cumsum")
def _cumsum(rng, dt):
    lo, hi = (0, 100) if dt == "int8" else (-9, 9)  # int8: running sums wrap
    return [one("cumsum", {"A": r(rng, dt, (3, 700), lo, hi)}, [T("A"), V(1)], scale="max"),  # a block per row
            one("cumsum", {"A": r(rng, dt, (2, 5000), lo, hi)}, [T("A"), V(-1), V(True)], scale="max"),  # 3 tiles
            one("cumsum", {"A": r(rng, dt, (4, 6, 5), lo, hi)}, [T("A"), V(1), V(True)], scale="max"),  # strided
            one("cumsum", {"A": r(rng, dt, (40, 20), lo, hi)}, [T("A"), V(-1)], scale="max"),  # short rows
            one("cumsum", {"A": r(rng, dt, (0, 7), lo, hi)}, [T("A"), V(0)]),
            Case({"A": r(rng, dt, (2, 300), lo, hi)}, [instr("cumsum", [T("A"), V(1)], [T("A")])], ["A"],
                 scale="max")]


@case("cumprod", "cumprodgrad")
def _cumprod(rng, dt):
    """Rows, columns and a middle dim; zeros in the gradient's input (the first zero of a column is special)."""
    out = []
    for shape, dim in [((3, 700), 1), ((40, 20), -1), ((4, 6, 5), 1), ((0, 7), 0)]:
        lo, hi = (0, 2) if is_int(dt) else (0.8, 1.25)  # products that stay in range
        a = r(rng, dt, shape, lo, hi)
        if not is_int(dt) and a.size:
            a.reshape(-1)[rng.integers(0, a.size, max(1, a.size // 50))] = 0
        out.append(one("cumprod", {"A": a}, [T("A"), V(dim)], scale="max"))
        if not is_int(dt):
            out.append(one("cumprodgrad", {"A": a, "G": r(rng, dt, shape, -1, 1)}, [T("A"), T("G"), V(dim)],
                           scale="max"))
    return out


def _sortable(rng, dt, shape):
    """Many ties (a small range), and for floats nan, infinities and both zeros among them."""
    a = r(rng, dt, shape, -3, 3)
    if not is_int(dt) and a.size:
        a = (np.round(a.astype(np.float64) * 2) / 2).reshape(-1)
        a[rng.integers(0, a.size, 6)] = [np.nan, np.inf, -np.inf, -0.0, 0.0, np.nan]
        a = a.reshape(shape).astype(to_numpy(dt))
    return a


@case("argsort")
def _argsort(rng, dt):
    return [one("argsort", {"A": _sortable(rng, dt, (3, 700))}, [T("A"), V(1)], out="B"),  # one run per line
            one("argsort", {"A": _sortable(rng, dt, (2, 5000))}, [T("A"), V(-1), V(True)], out="B"),  # merges
            one("argsort", {"A": _sortable(rng, dt, (30, 4, 5))}, [T("A"), V(0)], out="B"),  # strided
            one("argsort", {"A": _sortable(rng, dt, (9, 1))}, [T("A"), V(1), V(True)], out="B"),
            one("argsort", {"A": _sortable(rng, dt, (0, 6))}, [T("A"), V(1)], out="B")]


@case("argtopk")
def _argtopk(rng, dt):
    return [one("argtopk", {"A": _sortable(rng, dt, (3, 700))}, [T("A"), V(5), V(1)], out="B"),
            one("argtopk", {"A": _sortable(rng, dt, (2, 20000))}, [T("A"), V(40), V(-1), V(False)], out="B"),
            one("argtopk", {"A": _sortable(rng, dt, (30, 4, 5))}, [T("A"), V(30), V(0)], out="B"),
            one("argtopk", {"A": _sortable(rng, dt, (4, 6))}, [T("A"), V(0), V(1)], out="B")]


def _make_softmax(op):
    def build(rng, dt):
        return [one(op, {"A": r(rng, dt, (3, 4, 5))}, [T("A"), V(1)]),
                one(op, {"A": r(rng, dt, (3, 4, 5))}, [T("A")]),
                one(op, {"A": r(rng, dt, (2, 5000), -10, 10)}, [T("A"), V(-1)]),
                one(op, {"A": r(rng, dt, (2, 12000), -10, 10)}, [T("A"), V(-1)])]  # rows past shared memory

    return build


for _op in ("softmax", "logsoftmax"):
    CASES[_op] = _make_softmax(_op)


@case("crossentropy")
def _crossentropy(rng, dt):
    logits = r(rng, dt, (6, 10))
    out = []
    for idt in ("int32", "int64"):
        labels = rng.integers(0, 10, (6,)).astype(idt)
        labels[2] = -100
        for red in ("mean", "sum", "none"):
            out.append(one("crossentropy", {"x": logits, "l": labels}, [T("x"), T("l"), V(-100), V(red)],
                           out="loss", scale="max"))
    return out


@case("crossentropygrad")
def _crossentropygrad(rng, dt):
    out = []
    for n, c in ((6, 10), (3, 3000)):  # a warp per row, and a block per row (more than 2048 classes)
        logits = r(rng, dt, (n, c))
        for idt in ("int32", "int64"):
            labels = rng.integers(0, c, (n,)).astype(idt)
            labels[2] = -100
            for red in ("mean", "sum", "none"):
                g = r(rng, dt, (n,) if red == "none" else (), 0.5, 2)
                out.append(one("crossentropygrad", {"x": logits, "l": labels, "g": g},
                               [T("x"), T("l"), T("g"), V(-100), V(red)], out="d", scale="max"))
    ignored = np.full((4,), -100, np.int64)  # every label ignored: zeros, as on the CPU
    out.append(one("crossentropygrad", {"x": r(rng, dt, (4, 5)), "l": ignored, "g": r(rng, dt, (), 0.5, 2)},
                   [T("x"), T("l"), T("g")], out="d", scale="max"))
    return out


@case("mse")
def _mse(rng, dt):
    a, b = r(rng, dt, (4, 5)), r(rng, dt, (4, 5))
    big_a, big_b = r(rng, dt, (1000, 300)), r(rng, dt, (1000, 300))
    return [one("mse", {"A": a, "B": b}, [T("A"), T("B"), V(red)], out="loss", scale="max")
            for red in ("mean", "sum", "none")] + [
        one("mse", {"A": big_a, "B": big_b}, [T("A"), T("B")], out="loss", scale="max")]


@case("layernorm")
def _layernorm(rng, dt):
    a = r(rng, dt, (3, 4, 8))
    return [one("layernorm", {"A": a, "w": r(rng, dt, (8,)), "b": r(rng, dt, (8,))}, [T("A"), T("w"), T("b")]),
            one("layernorm", {"A": a, "w": r(rng, dt, (4, 8)), "b": r(rng, dt, (4, 8))},
                [T("A"), T("w"), T("b"), V(1e-3)]),
            one("layernorm", {"A": r(rng, dt, (2, 5000)), "w": r(rng, dt, (5000,)), "b": r(rng, dt, (5000,))},
                [T("A"), T("w"), T("b")]),
            one("layernorm", {"A": r(rng, dt, (2, 12000)), "w": r(rng, dt, (12000,)), "b": r(rng, dt, (12000,))},
                [T("A"), T("w"), T("b")])]


@case("layernormgrad", "rmsnormgrad")
def _normgrad(rng, dt):
    """Both outputs (dA and the normalised A), rows a warp holds and rows a block walks, against the CPU kernels."""
    out = []
    for op in ("layernormgrad", "rmsnormgrad"):
        for shape, ws in (((3, 4, 8), (8,)), ((3, 4, 8), (4, 8)), ((5, 1000), (1000,)), ((2, 5000), (5000,))):
            prog = [instr(op, [T("A"), T("w"), T("g"), V(1e-5)], [T("dA"), T("xn")])]
            out.append(Case({"A": r(rng, dt, shape), "w": r(rng, dt, ws, 0.5, 1.5), "g": r(rng, dt, shape, -1, 1)},
                            prog, ["dA", "xn"], scale="max"))
    return out


@case("conv2d", "conv2dgradinput", "conv2dgradweight")
def _conv(rng, dt):
    """Each of the three on a few geometries (stride, padding, dilation, groups), against the CPU kernels."""
    out = []
    for (n, c, h, w, o, kh, kw, s, p, d, g) in [(2, 3, 7, 6, 4, 3, 2, (1, 1), (1, 0), (1, 1), 1),
                                                (2, 4, 9, 8, 6, 3, 3, (2, 1), (1, 2), (2, 1), 2),
                                                (1, 4, 5, 5, 4, 1, 1, (1, 1), (0, 0), (1, 1), 4)]:
        oh, ow = (h + 2 * p[0] - d[0] * (kh - 1) - 1) // s[0] + 1, (w + 2 * p[1] - d[1] * (kw - 1) - 1) // s[1] + 1
        x, wt, gy = r(rng, dt, (n, c, h, w)), r(rng, dt, (o, c // g, kh, kw)), r(rng, dt, (n, o, oh, ow))
        geometry = [VEC(s), VEC(p), VEC(d), V(g)]
        out += [one("conv2d", {"x": x, "w": wt}, [T("x"), T("w"), *geometry], scale="max"),
                one("conv2dgradinput", {"g": gy, "w": wt}, [T("g"), T("w"), VEC(x.shape), *geometry], scale="max"),
                one("conv2dgradweight", {"x": x, "g": gy}, [T("x"), T("g"), VEC(wt.shape), *geometry], scale="max")]
    return out


@case("maxpool2d", "maxpool2dgrad", "sumpool2d", "sumpool2dgrad")
def _pool(rng, dt):
    """Each of the four on a few windows (stride, dilation, overlapping), against the CPU kernels."""
    out = []
    for (n, c, h, w, kh, kw, s, d) in [(2, 3, 7, 6, 3, 2, (2, 1), (1, 2)), (2, 1, 5, 5, 3, 3, (1, 1), (1, 1)),
                                       (1, 4, 8, 8, 2, 2, (2, 2), (1, 1))]:
        oh, ow = (h - d[0] * (kh - 1) - 1) // s[0] + 1, (w - d[1] * (kw - 1) - 1) // s[1] + 1
        x, gy = r(rng, dt, (n, c, h, w)), r(rng, dt, (n, c, oh, ow))
        geometry = [VEC((kh, kw)), VEC(s), VEC(d)]
        out += [one("maxpool2d", {"x": x}, [T("x"), *geometry]),
                one("maxpool2dgrad", {"x": x, "g": gy}, [T("x"), T("g"), *geometry], scale="max"),
                one("sumpool2d", {"x": x}, [T("x"), *geometry], scale="max"),
                one("sumpool2dgrad", {"g": gy}, [T("g"), VEC(x.shape), *geometry], scale="max")]
    return out


@case("attention", "attentiongrad")
def _attention(rng, dt):
    """The forward and the backward kernels on head sizes 32, 64 and 128 and odd ones, causal or not, Tq != Tk both
    ways, several tiles of rows and keys, grouped-query heads: result, logsumexp and the three gradients."""
    out = []
    lse = "float64" if dt == "float64" else "float32"
    for qs, ks, dv, causal in [((2, 3, 70, 64), (2, 3, 70, 64), 64, True), ((1, 2, 33, 32), (1, 2, 100, 32), 32, False),
                               ((2, 1, 130, 128), (2, 1, 45, 128), 128, True), ((3, 37, 5), (3, 29, 5), 7, False),
                               ((1, 4, 66, 80), (1, 2, 66, 80), 80, True), ((2, 17, 40), (2, 17, 40), 24, True)]:
        ins = {"q": r(rng, dt, qs, -2, 2), "k": r(rng, dt, ks, -2, 2), "v": r(rng, dt, (*ks[:-1], dv), -2, 2),
               "g": r(rng, dt, (*qs[:-1], dv), -1, 1)}
        attend = [T("q"), T("k"), T("v"), V(1.0 / qs[-1] ** 0.5), V(causal)]
        program = [instr("attention", attend, [T("y"), T("lse", lse)]),
                   instr("attentiongrad", [*attend[:3], T("y"), T("lse"), T("g"), *attend[3:]],
                         [T("dq"), T("dk"), T("dv")])]
        out.append(Case(ins, program, ["y", "lse", "dq", "dk", "dv"], scale="max"))
    return out


@case("maskedattention", "maskedattentiongrad")
def _masked_attention(rng, dt):
    """Under bool and additive masks: one shared by every head, one per batch item, a decoding step's single row
    over a static cache of keys, grouped heads, and rows that see no key; result, logsumexp and the gradients."""
    out = []
    lse = "float64" if dt == "float64" else "float32"
    for qs, ks, dv, ms, kind in [((2, 3, 70, 64), (2, 3, 70, 64), 64, (70, 70), "bool"),
                                 ((1, 4, 1, 32), (1, 2, 256, 32), 32, (1, 256), "bool"),
                                 ((2, 2, 33, 80), (2, 2, 45, 80), 80, (2, 1, 33, 45), "float"),
                                 ((3, 37, 5), (3, 29, 5), 7, (29,), "float"),
                                 ((2, 2, 12, 16), (2, 2, 12, 16), 16, (2, 2, 12, 12), "dead")]:
        keep = rng.random(ms) < 0.6
        if kind == "dead":
            keep[..., 3, :] = False
        mask = keep
        if kind == "float":
            mask = r(rng, dt, ms, -1, 1)
            mask[~keep] = -np.inf
        ins = {"q": r(rng, dt, qs, -2, 2), "k": r(rng, dt, ks, -2, 2), "v": r(rng, dt, (*ks[:-1], dv), -2, 2),
               "g": r(rng, dt, (*qs[:-1], dv), -1, 1), "m": mask}
        attend = [T("q"), T("k"), T("v"), T("m"), V(1.0 / qs[-1] ** 0.5)]
        program = [instr("maskedattention", attend, [T("y"), T("lse", lse)]),
                   instr("maskedattentiongrad", [*attend[:4], T("y"), T("lse"), T("g"), attend[4]],
                         [T("dq"), T("dk"), T("dv")])]
        out.append(Case(ins, program, ["y", "lse", "dq", "dk", "dv"], scale="max"))
    return out


@case("batchnorm", "batchnormgrad", "groupnorm", "groupnormgrad")
def _norms(rng, dt):
    """batchnorm and groupnorm with their statistics, then their gradient ops on those statistics, on shapes from a
    vector's (N, C) to images whose channels hold many values (the statistics split across blocks)."""
    from deepx_core.ir.ops import stats_dtype

    st = stats_dtype(dt)
    out = []
    for shape, groups in [((4, 3, 5, 7), 3), ((7, 6), 2), ((2, 8, 9), 4), ((64, 4, 33, 35), 1), ((1, 2, 13, 3), 2)]:
        c = shape[1]
        ins = {"x": r(rng, dt, shape, -2, 3), "w": r(rng, dt, (c,)), "b": r(rng, dt, (c,)), "g": r(rng, dt, shape)}
        for name, extra in (("batchnorm", []), ("groupnorm", [V(groups)])):
            out.append(Case(ins, [
                instr(name, [T("x"), T("w"), T("b"), *extra, V(1e-5)], [T("y", dt), T("m", st), T("v", st)]),
                instr(f"{name}grad", [T("x"), T("g"), T("w"), T("m"), T("v"), *extra, V(1e-5)],
                      [T("dx", dt), T("dw", dt), T("db", dt)])], ["y", "m", "v", "dx", "dw", "db"], scale="max"))
    return out


@case("batchnormeval")
def _batchnormeval(rng, dt):
    """Given (running) statistics, then batchnormgrad on them with batch false (dA = g w / sqrt(var + eps))."""
    from deepx_core.ir.ops import stats_dtype

    st = stats_dtype(dt)
    out = []
    for shape in [(4, 3, 5, 7), (7, 6), (64, 4, 33, 35)]:
        c = shape[1]
        ins = {"x": r(rng, dt, shape, -2, 3), "w": r(rng, dt, (c,)), "b": r(rng, dt, (c,)), "g": r(rng, dt, shape),
               "m": r(rng, st, (c,)), "v": r(rng, st, (c,), 0.5, 2)}
        out.append(Case(ins, [
            instr("batchnormeval", [T("x"), T("w"), T("b"), T("m"), T("v"), V(1e-3)], [T("y", dt)]),
            instr("batchnormgrad", [T("x"), T("g"), T("w"), T("m"), T("v"), V(1e-3), V(False)],
                  [T("dx", dt), T("dw", dt), T("db", dt)])], ["y", "dx", "dw", "db"], scale="max"))
    return out


@case("batchnormupdate")
def _batchnormupdate(rng, dt):
    from deepx_core.ir.ops import stats_dtype

    st = stats_dtype(dt)
    ins = {"rm": r(rng, dt, (37,)), "rv": r(rng, dt, (37,), 0.5, 2), "m": r(rng, st, (37,)),
           "v": r(rng, st, (37,), 0.1, 3)}
    return [Case(ins, [instr("batchnormupdate", [T("rm"), T("rv"), T("m"), T("v"), V(mom), V(n)], [T("rm"), T("rv")])],
                 ["rm", "rv"]) for mom, n in [(0.1, 12), (1 / 3, 2), (1.0, 1000)]]


@case("interpnearest", "interpnearestgrad", "interpbilinear", "interpbilineargrad")
def _interp(rng, dt):
    """Each of the four on sizes up and down, with scale factors and without, both align_corners."""
    out = []
    for shape, size, scales in [((2, 3, 5, 7), (9, 4), (0.0, 0.0)), ((1, 2, 4, 3), (10, 7), (2.5, 2.5)),
                                ((2, 1, 6, 6), (3, 12), (0.5, 2.0)), ((2, 2, 7, 9), (9, 11), (1.3, 1.3)),
                                ((3, 5, 1, 5), (1, 13), (0.0, 0.0)), ((2, 4, 32, 32), (64, 64), (0.0, 0.0))]:
        x, gy = r(rng, dt, shape), r(rng, dt, (*shape[:2], *size))
        sh, sw = V(scales[0]), V(scales[1])
        out += [one("interpnearest", {"x": x}, [T("x"), VEC(size), sh, sw]),
                one("interpnearestgrad", {"g": gy}, [T("g"), VEC(shape), sh, sw], scale="max")]
        for ac in (False, True):
            out += [one("interpbilinear", {"x": x}, [T("x"), VEC(size), V(ac), sh, sw]),
                    one("interpbilineargrad", {"g": gy}, [T("g"), VEC(shape), V(ac), sh, sw], scale="max")]
    return out


@case("rmsnorm")
def _rmsnorm(rng, dt):
    a = r(rng, dt, (3, 4, 8))
    return [one("rmsnorm", {"A": a, "w": r(rng, dt, (8,))}, [T("A"), T("w")]),
            one("rmsnorm", {"A": a, "w": r(rng, dt, (4, 8))}, [T("A"), T("w"), V(1e-3)]),
            one("rmsnorm", {"A": r(rng, dt, (2, 12000)), "w": r(rng, dt, (12000,))}, [T("A"), T("w")])]


@case("slice")
def _slice(rng, dt):
    return [one("slice", {"A": r(rng, dt, (5, 6, 7))}, [T("A"), VEC((1, -5, 0)), VEC((4, 6, 7)), VEC((1, 2, 3))],
                out="B")]


@case("sliceassign")
def _sliceassign(rng, dt):
    a, v = r(rng, dt, (5, 6)), r(rng, dt, (1, 3))
    args = [T("A"), VEC((1, 0)), VEC((4, 6)), VEC((1, 2)), T("V")]
    return [one("sliceassign", {"A": a, "V": v}, args),
            Case({"A": a, "V": v}, [instr("sliceassign", args, [T("A")])], ["A"])]


@case("pad")
def _pad(rng, dt):
    value = 7 if is_int(dt) else 1 if dt == "bool" else 1.5
    return [one("pad", {"A": r(rng, dt, (2, 3))}, [T("A"), VEC((1, 0, 2, 1)), V(value)], out="B")]


@case("gather")
def _gather(rng, dt):
    a = r(rng, dt, (4, 5, 6), -9, 9)
    return [one("gather", {"A": a, "i": rng.integers(0, 5, (4, 7, 6)).astype(np.int64)}, [T("A"), T("i"), V(1)],
                out="B"),
            one("gather", {"A": a, "i": rng.integers(0, 6, (2, 3, 9)).astype(np.int32)}, [T("A"), T("i"), V(-1)],
                out="B"),
            one("gather", {"A": a, "i": rng.integers(0, 4, (1, 5, 6)).astype(np.int64)}, [T("A"), T("i"), V(0)],
                out="B")]


def _make_scatter(op):
    def build(rng, dt):
        a, src = r(rng, dt, (4, 6), -9, 9), r(rng, dt, (3, 6), -9, 9)
        kw = {"scale": "max"} if op == "scatteradd" else {}  # atomic adds: sums in any order
        once = np.stack([rng.permutation(4)[:3] for _ in range(6)], 1)  # no two writes to one place
        cases = [one(op, {"A": a, "i": once.astype(np.int64), "s": src}, [T("A"), T("i"), T("s"), V(0)], **kw),
                 one(op, {"A": a, "i": np.array([[5, 0, 2], [1, 4, 3]], np.int32), "s": src[:2, :3].copy()},
                     [T("A"), T("i"), T("s"), V(-1)], **kw)]
        if op == "scatteradd":  # repeated indices: their sums
            cases.append(one(op, {"A": a, "i": rng.integers(0, 4, (3, 6)).astype(np.int64), "s": src},
                             [T("A"), T("i"), T("s"), V(0)], **kw))
        return cases

    return build


for _op in ("scatter", "scatteradd"):
    CASES[_op] = _make_scatter(_op)


@case("indexadd")
def _indexadd(rng, dt):
    a = r(rng, dt, (5, 3))
    idx = np.array([0, 3, 3, 1], np.int64)
    src = r(rng, dt, (4, 3))
    src1 = r(rng, dt, (5, 2))
    return [one("indexadd", {"A": a, "i": idx, "s": src}, [T("A"), T("i"), T("s"), V(0)]),
            one("indexadd", {"A": a, "i": np.array([2, 2], np.int32), "s": src1}, [T("A"), T("i"), T("s"), V(1)]),
            Case({"A": a, "i": idx, "s": src}, [instr("indexadd", [T("A"), T("i"), T("s"), V(0)], [T("A")])], ["A"])]


@case("indexcopy")
def _indexcopy(rng, dt):
    a = r(rng, dt, (5, 3))
    idx = np.array([4, 0, 2], np.int64)
    src = r(rng, dt, (3, 3))
    cache, k = r(rng, dt, (1, 2, 16, 8)), r(rng, dt, (1, 2, 1, 8))
    return [one("indexcopy", {"A": a, "i": idx, "s": src}, [T("A"), T("i"), T("s"), V(0)]),
            one("indexcopy", {"A": a, "i": np.array([2, 0], np.int32), "s": r(rng, dt, (5, 2))},
                [T("A"), T("i"), T("s"), V(1)]),
            Case({"A": cache, "i": np.array([7], np.int64), "s": k},
                 [instr("indexcopy", [T("A"), T("i"), T("s"), V(2)], [T("A")])], ["A"])]


@case("sgd")
def _sgd(rng, dt):
    out = []
    for hp, step in [((0.1, 0.0, 0.0, 0.0, False), 1), ((0.05, 0.9, 0.1, 0.01, False), 3),
                     ((0.05, 0.9, 0.0, 0.0, True), 1)]:
        lr, mom, damp, wd, nest = hp
        ins = {"p": r(rng, dt, (6, 7)), "g": r(rng, dt, (6, 7)), "b": r(rng, dt, (6, 7))}
        args = [T("p"), T("g"), T("b"), V(lr), V(mom), V(damp), V(wd), V(nest), V(step)]
        out.append(Case(ins, [instr("sgd", args, [T("p"), T("b")])], ["p", "b"]))
    return out


def _make_adam(op):
    def build(rng, dt):
        out = []
        for wd, step in [(0.0, 1), (0.05, 4)]:
            ins = {"p": r(rng, dt, (6, 7)), "g": r(rng, dt, (6, 7)), "m": r(rng, dt, (6, 7), -0.1, 0.1),
                   "v": r(rng, dt, (6, 7), 0.0, 0.1)}
            args = [T("p"), T("g"), T("m"), T("v"), V(0.01), V(0.9), V(0.999), V(1e-8), V(wd), V(step)]
            out.append(Case(ins, [instr(op, args, [T("p"), T("m"), T("v")])], ["p", "m", "v"]))
        return out

    return build


for _op in ("adam", "adamw"):
    CASES[_op] = _make_adam(_op)


@case("fused")
def _fused(rng, dt):
    expr = "in0 * 2.5 + exp(in1) - maximum(in0, in2) ** 2 / (abs(in1) + 1) + sqrt(abs(in2)) * tanh(-in0)"
    same = {"x": r(rng, dt, (7, 9), -2, 2), "y": r(rng, dt, (7, 9), -2, 2), "z": r(rng, dt, (7, 9), -2, 2)}
    bc = {"x": r(rng, dt, (3, 4, 5), -2, 2), "y": r(rng, dt, (4, 1), -2, 2), "z": r(rng, dt, (5,), -2, 2)}
    return [Case(ins, [instr("fused", [L(["x", "y", "z"]), V(expr)], [T("C")])], ["C"]) for ins in (same, bc)]


@case("fusedcolsum")
def _fusedcolsum(rng, dt):
    ins = {"g": r(rng, dt, (300, 64), -2, 2), "y": r(rng, dt, (300, 64), -2, 2), "b": r(rng, dt, (64,), -2, 2)}
    return [Case(ins, [instr("fusedcolsum", [L(["g", "y", "b"]), V("in0 * (in1 > 0.0) + in2"), V(keepdims)],
                             [T("C"), T("S")])], ["C", "S"], scale="max") for keepdims in (False, True)]


# ---------------------------------------------------------------- checking


#: ops with no CUDA kernel by design: the collectives run on op-cpu's ring (NCCL, their CUDA side, is not wired:
#: docs/distributed.md, "Not yet")
NO_CUDA = frozenset(name for name, d in OPS.items() if d.family == "collective")


def _params() -> list[Any]:
    out = []
    for op in OPS:
        if op in NO_CUDA:
            continue
        for dt in ordered(OPS[op].dtypes):
            out.append(pytest.param(op, dt, id=f"{op}-{dt}"))
    return out


def test_every_op_has_a_case():
    missing = sorted(set(OPS) - set(CASES) - NO_CUDA)
    assert not missing, f"ops with no CUDA test case in tests/gpu/test_kernels.py: {missing}"


def test_every_claimed_dtype_runs_on_the_device():
    """The catalogue's dtypes all have CUDA kernels (no op needs the CPU fallback for a dtype it claims)."""
    from deepxd.kernels.cuda import has_kernel, kernel_dtypes

    lacking = {op: sorted(OPS[op].dtypes - kernel_dtypes(op)) for op in OPS if not has_kernel(op)
               and op not in NO_CUDA}
    assert not lacking, f"claimed dtypes without a CUDA kernel: {lacking}"


@pytest.mark.parametrize(("op", "dtype"), _params())
def test_case_runs_on_cpu(op, dtype):
    """Each case is a valid program (checked and run by the CPU executor), so a GPU visit is not spent on a typo."""
    rng = np.random.default_rng(zlib.crc32(f"{op}-{dtype}".encode()))
    for c in CASES[op](rng, dtype):
        if c.check in ("files", "print"):
            continue
        cpu = CpuExecutor()
        for n, a in c.inputs.items():
            cpu.put(n, a)
        cpu.run_all(c.program)


def compare(got: np.ndarray, want: np.ndarray, dtype: str, scale: str, what: str) -> None:
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype}, CPU {want.dtype}"
    assert got.shape == want.shape, f"{what}: shape {got.shape}, CPU {want.shape}"
    if got.dtype.kind in "iub":
        bad = got != want
        assert not bad.any(), (f"{what}: {int(bad.sum())} of {got.size} differ; got {got[bad][:6]}, CPU "
                               f"{want[bad][:6]}")
        return
    rt, at = TOL[from_numpy(want.dtype)]  # the output's dtype (todtype changes it)
    g, w = got.astype(np.float64), want.astype(np.float64)
    mag = np.abs(w)
    if scale == "max" and w.size:
        mag = np.maximum(mag, np.nanmax(np.where(np.isfinite(w), np.abs(w), 0)))
    with np.errstate(invalid="ignore"):
        ok = (np.isnan(g) & np.isnan(w)) | (g == w) | (np.abs(g - w) <= rt * mag + at)
    if not ok.all():
        raise AssertionError(f"{what}: {int((~ok).sum())} of {got.size} off (rtol {rt}, atol {at}); got "
                             f"{g[~ok][:6]}, CPU {w[~ok][:6]}")


def _run_both(gx, c: Case) -> CpuExecutor:
    cpu = CpuExecutor()
    for n, a in c.inputs.items():
        cpu.put(n, a)
        gx.put(n, a)
        if cpu.tensors[n].shape != np.shape(a):  # keep 0-d inputs 0-d on both
            cpu.tensors[n] = cpu.tensors[n].reshape(np.shape(a))
            gx.tensors[n] = gx.tensors[n].view(np.shape(a))
    cpu.run_all(c.program)
    gx.run_all(c.program)
    return cpu


@pytest.mark.parametrize(("op", "dtype"), _params())
def test_op_matches_cpu(gx, op, dtype, tmp_path):
    rng = np.random.default_rng(zlib.crc32(f"{op}-{dtype}".encode()))
    builder = CASES[op]
    for k, c in enumerate(builder(rng, dtype)):
        gx.tensors.clear()
        what = f"{op}[{dtype}] case {k}"
        if c.check == "files":
            _check_files(gx, c, dtype, tmp_path)
            continue
        if c.check == "print":
            _check_print(gx, c)
            continue
        cpu = _run_both(gx, c)
        if c.check == "names":
            assert set(gx.tensors) == set(cpu.tensors), what
            for n in c.outputs:
                compare(gx.get(n), cpu.get(n), dtype, c.scale, f"{what} '{n}'")
        elif c.check == "vars":
            assert gx.variables == cpu.variables and gx.vectors == cpu.vectors, what
        elif c.check == "uniform":
            t = gx.get("t").astype(np.float64)
            assert t.min() >= c.extra["low"] and t.max() < c.extra["high"], what
            assert abs(t.mean() - 0.5) < 0.05 and abs(t.std() - 5 / 12**0.5) < 0.05, what
        elif c.check == "normal":
            t = gx.get("t").astype(np.float64)
            assert abs(t.mean() - c.extra["mean"]) < 0.05 and abs(t.std() - c.extra["std"]) < 0.05, what
        elif c.check == "dropout":
            got, a, p = gx.get("A").astype(np.float64), c.extra["a"].astype(np.float64), c.extra["p"]
            zero = got == 0
            assert abs(zero.mean() - p) < 0.01, f"{what}: dropped {zero.mean():.3f}, p {p}"
            rt, at = TOL[dtype]
            assert np.allclose(got[~zero], a[~zero] / (1 - p), rtol=rt, atol=at), what
        else:
            for n in c.outputs:
                compare(gx.get(n), cpu.get(n), dtype, c.scale, f"{what} '{n}'")
        assert not gx.fallbacks, f"{what}: ran on the CPU fallback: {dict(gx.fallbacks)}"


def _check_files(gx, c: Case, dtype: str, tmp_path) -> None:
    a = c.inputs["a"]
    gx.put("a", a)
    path = str(tmp_path / f"t_{dtype}")
    gx.run(instr("save", [T("a"), V(path)]))
    gx.run(instr("load", [V(path)], [T("b")]))
    np.testing.assert_array_equal(gx.get("b").view(np.uint8), a.view(np.uint8))
    gx.put("z", np.zeros_like(a))
    gx.run(instr("loadtensordata", [V(path + ".data")], [T("z")]))
    np.testing.assert_array_equal(gx.get("z").view(np.uint8), a.view(np.uint8))
    cpu = CpuExecutor()
    cpu.run(instr("load", [V(path)], [T("c")]))
    np.testing.assert_array_equal(cpu.get("c").view(np.uint8), a.view(np.uint8))


def _check_print(gx, c: Case) -> None:
    lines: list[str] = []
    cpu_lines: list[str] = []
    old = gx.output
    gx.output = lines.append
    try:
        _run_both(gx, c)
    finally:
        gx.output = old
    cpu = CpuExecutor(output=cpu_lines.append)
    for n, a in c.inputs.items():
        cpu.put(n, a)
    cpu.run_all(c.program)
    assert lines == cpu_lines and lines


# ---------------------------------------------------------------- dtypes the catalogue does not claim


@pytest.mark.parametrize("dtype", sorted(FLOAT8))
def test_float8_shape_ops_and_casts(gx, dtype):
    rng = np.random.default_rng(3)
    a = r(rng, dtype, (4, 6), -8, 8)
    for c in [*CASES["transpose"](rng, dtype), *CASES["concat"](rng, dtype), *CASES["slice"](rng, dtype),
              *CASES["pad"](rng, dtype), *CASES["todtype"](rng, dtype)]:
        gx.tensors.clear()
        cpu = _run_both(gx, c)
        for n in c.outputs:
            compare(gx.get(n), cpu.get(n), str(cpu.tensors.metas[n].dtype), "elem", f"{dtype} {c.program[0].name}")
    gx.put("a", a)
    np.testing.assert_array_equal(gx.get("a").view(np.uint8), a.view(np.uint8))
    assert not gx.fallbacks

