"""apply_effect against the CPU executor: for every op of the catalogue, random valid instructions, each run by a
real CpuExecutor; what apply_effect says the instruction creates, writes, deletes and renames is what the executor
did to its tensor table, and the metas it leaves are the executor's."""

from __future__ import annotations

import os
import subprocess
import sys
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from deepx_core.errors import DeepxError
from deepx_core.ir.dtypes import to_numpy
from deepx_core.ir.effects import (
    CREATES,
    DELETES,
    FILLS,
    KINDS,
    LOADS,
    READS,
    RENAMES,
    SETS,
    WRITES,
    Change,
    apply_effect,
    declare,
)
from deepx_core.ir.instr import Instr, Param
from deepx_core.ir.ops import OPS, UNKNOWN, SymbolicEnv, TensorMeta, bind, check_program, op, remove_op, same, t
from deepxd.comm import Collectives
from deepxd.kernels.cpu import CpuExecutor, check_instruction

T, V, VEC, L = Param.tensor, Param.var, Param.vector, Param.listtensor
Tensors = dict[str, np.ndarray]
CASES = 8  # random instructions per op


def rand(rng: np.random.Generator, shape: tuple[int, ...], dtype: str = "float32", lo: float = 0.5,
         hi: float = 2.0) -> np.ndarray:
    if dtype == "bool":
        return np.asarray(rng.random(shape) < 0.5)
    if dtype.startswith("int"):
        return rng.integers(int(lo), int(hi) + 1, size=shape).astype(to_numpy(dtype))
    return rng.uniform(lo, hi, size=shape).astype(to_numpy(dtype))


def shape2(rng: np.random.Generator) -> tuple[int, int]:
    return int(rng.integers(2, 5)), int(rng.integers(3, 6))


def fdtype(rng: np.random.Generator) -> str:
    return str(rng.choice(["float32", "float64"]))


# ---------------------------------------------------------------- one random valid instruction per op
# A builder gives (tensors the executor holds before, the instruction's args, its returns or None: the return is
# then picked by `_returns`, a fresh name, an existing tensor of the result's meta, or an input, written over).

Built = tuple[Tensors, list[Param], "list[Param] | None"]


def _binary(rng: np.random.Generator, name: str) -> Built:
    dt = fdtype(rng)
    s = shape2(rng)
    b_shape = s if rng.random() < 0.5 else (1, s[1])
    return {"a": rand(rng, s, dt), "b": rand(rng, b_shape, dt)}, [T("a"), T("b")], None


def _both_signs(rng: np.random.Generator, lo: float, hi: float) -> np.ndarray:
    """Random values between lo and hi, the first two lo and hi: an op written over its input (maxscalar, relu,
    abs) changes some of them."""
    a = rand(rng, shape2(rng), fdtype(rng), lo, hi)
    a.flat[:2] = lo, hi
    return a


def _scalar(rng: np.random.Generator, name: str) -> Built:
    return {"a": _both_signs(rng, -2, 2)}, [T("a"), V(float(rng.uniform(0.5, 1.5)))], None


def _rscalar(rng: np.random.Generator, name: str) -> Built:
    return {"a": rand(rng, shape2(rng), fdtype(rng))}, [V(float(rng.uniform(0.5, 2))), T("a")], None


def _unary(rng: np.random.Generator, name: str) -> Built:
    return {"a": _both_signs(rng, -0.9, 0.9)}, [T("a")], None


def _compare2(rng: np.random.Generator, name: str) -> Built:
    tensors, args, _ = _binary(rng, name)
    if name in ("equal", "notequal"):
        args.append(V(0.25))
    return tensors, args, None


def _compare1(rng: np.random.Generator, name: str) -> Built:
    tensors, args, _ = _scalar(rng, name)
    if name in ("equalscalar", "notequalscalar"):
        args.append(V(0.25))
    return tensors, args, None


def _reduce(rng: np.random.Generator, name: str) -> Built:
    dims = [[0], [1], [0, 1], []][int(rng.integers(0, 4))]
    return ({"a": rand(rng, shape2(rng), fdtype(rng))}, [T("a"), VEC(dims), V(bool(rng.random() < 0.5))], None)


def _argreduce(rng: np.random.Generator, name: str) -> Built:
    return ({"a": rand(rng, shape2(rng), fdtype(rng))}, [T("a"), V(int(rng.integers(0, 2))),
                                                         V(bool(rng.random() < 0.5))], None)


def _update(n_state: int) -> Callable[[np.random.Generator, str], Built]:
    def build(rng: np.random.Generator, name: str) -> Built:
        dt, s = fdtype(rng), shape2(rng)
        state = ["buf"] if n_state == 1 else ["m", "v"]
        tensors = {n: rand(rng, s, dt, 0.1, 1.0) for n in ("p", "g", *state)}
        # sgd with momentum writes its buffer (without, the buffer is declared written and keeps its values)
        hyper = [V(0.1), V(0.9)] if n_state == 1 else [V(0.01)]
        return tensors, [T("p"), T("g"), *map(T, state), *hyper], [T("p"), *map(T, state)]

    return build


def _fill(*args: Callable[[np.random.Generator], Param], dtype: str | None = None
          ) -> Callable[[np.random.Generator, str], Built]:
    def build(rng: np.random.Generator, name: str) -> Built:
        return ({"x": rand(rng, shape2(rng), dtype or fdtype(rng), -3, 3)}, [a(rng) for a in args], [T("x")])

    return build


def _newtensor(rng: np.random.Generator, name: str) -> Built:
    s, dt = shape2(rng), fdtype(rng)
    mode = int(rng.integers(0, 4))
    tensors: Tensors = {"a": rand(rng, (3,), "float32")}
    if mode == 1:
        tensors["x"] = rand(rng, s, dt)  # kept: values and all
    elif mode == 2:
        tensors["x"] = rand(rng, (7,), "int32")  # replaced by zeros of the shape and dtype asked for
    ret = [T("x", dt)]
    return tensors, [VEC(s)], ret


def _newtensor_keep(rng: np.random.Generator) -> Instr:
    return Instr("newtensor", (VEC((2, 2)),), (T("x", "float32"),), (("exists", "keep"),))


def _copytensor(rng: np.random.Generator, name: str) -> Built:
    return {"a": rand(rng, shape2(rng), fdtype(rng))}, [T("a")], None


def _deltensor(rng: np.random.Generator, name: str) -> Built:
    return {"a": rand(rng, (3,)), "b": rand(rng, (2,))}, [], [T(str(rng.choice(["a", "b"])))]


def _renametensor(rng: np.random.Generator, name: str) -> Built:
    new = str(rng.choice(["c", "a2", "a"]))  # "a": to its own name, which changes nothing
    return {"a": rand(rng, (3,)), "b": rand(rng, (2,))}, [V(new, "string")], [T("a")]


def _argset(rng: np.random.Generator, name: str) -> Built:
    return {"a": rand(rng, (3,))}, [V(float(rng.uniform(0, 1)))], [V("lr", "string")]


def _vecset(rng: np.random.Generator, name: str) -> Built:
    return {"a": rand(rng, (3,))}, [VEC([int(x) for x in rng.integers(1, 5, 2)])], [VEC("dims")]


def _print(rng: np.random.Generator, name: str) -> Built:
    return {"a": rand(rng, shape2(rng))}, [T("a")], []


def _save(rng: np.random.Generator, name: str) -> Built:
    return {"a": rand(rng, shape2(rng))}, [T("a"), V("{root}/saved", "string")], []


def _load(rng: np.random.Generator, name: str) -> Built:
    mode = int(rng.integers(0, 3))
    tensors = {"a": rand(rng, (3,))}
    if mode == 0:
        return tensors, [V("{root}/w.x", "string")], []  # named after the file: "w.x"
    if mode == 1:
        return tensors, [V("{root}/w.x", "string")], [T("a")]  # replaces a
    return tensors, [V("{root}/w.x", "string")], [T("fresh")]


def _loadtensordata(rng: np.random.Generator, name: str) -> Built:
    return {"x": rand(rng, (2, 3), "float32", -3, 3)}, [V("{root}/raw.data", "string")], [T("x")]


def _switch(rng: np.random.Generator, name: str) -> Built:
    dt, s = fdtype(rng), shape2(rng)
    return ({"y": rand(rng, s, dt), "x": rand(rng, s, dt), "c": rand(rng, s, "bool")}, [L(["y", "x"]), T("c")],
            None)


def _matmul(rng: np.random.Generator, name: str) -> Built:
    m, k, n = (int(x) for x in rng.integers(2, 5, 3))
    dt = fdtype(rng)
    return {"a": rand(rng, (m, k), dt), "b": rand(rng, (k, n), dt)}, [T("a"), T("b")], None


def _reshape(rng: np.random.Generator, name: str) -> Built:
    s = shape2(rng)
    return {"a": rand(rng, s, fdtype(rng))}, [T("a"), VEC([s[1], s[0]] if rng.random() < 0.5 else [-1])], None


def _transpose(rng: np.random.Generator, name: str) -> Built:
    return {"a": rand(rng, shape2(rng), fdtype(rng))}, [T("a"), VEC([1, 0])], None


def _concat(rng: np.random.Generator, name: str) -> Built:
    dt, (m, n) = fdtype(rng), shape2(rng)
    return ({"a": rand(rng, (m, n), dt), "b": rand(rng, (m + 1, n), dt)}, [L(["a", "b"]), V(0)], None)


def _broadcast_to(rng: np.random.Generator, name: str) -> Built:
    m, n = shape2(rng)
    return {"a": rand(rng, (1, n), fdtype(rng))}, [T("a"), VEC([m, n])], None


def _indexselect(rng: np.random.Generator, name: str) -> Built:
    m, n = shape2(rng)
    index = rng.integers(0, m, 3).astype(np.int64)
    return {"a": rand(rng, (m, n), fdtype(rng)), "i": index}, [T("a"), T("i"), V(0)], None


def _repeat(rng: np.random.Generator, name: str) -> Built:
    return {"a": rand(rng, shape2(rng), fdtype(rng))}, [T("a"), VEC([2, 1])], None


def _gather(rng: np.random.Generator, name: str) -> Built:
    (m, n), dt = shape2(rng), fdtype(rng)
    tensors = {"a": rand(rng, (m, n), dt), "i": rng.permutation(m)[:2].reshape(2, 1).repeat(n, 1).astype(np.int64)}
    if name == "gather":
        return tensors, [T("a"), T("i"), V(0)], None
    tensors["s"] = rand(rng, (2, n), dt, 5, 6)
    return tensors, [T("a"), T("i"), T("s"), V(0)], None


def _sort(rng: np.random.Generator, name: str) -> Built:
    (m, n), dt = shape2(rng), fdtype(rng)
    order = [V(int(rng.integers(-2, 2))), V(bool(rng.random() < 0.5))]
    if name == "argtopk":
        order.insert(0, V(int(rng.integers(1, 3))))
    return {"a": rand(rng, (m, n), dt)}, [T("a"), *order], None


def _cumsum(rng: np.random.Generator, name: str) -> Built:
    return ({"a": rand(rng, shape2(rng), fdtype(rng))}, [T("a"), V(int(rng.integers(-2, 2))),
                                                         V(bool(rng.random() < 0.5))], None)


def _cumprod(rng: np.random.Generator, name: str) -> Built:
    s, dt = shape2(rng), fdtype(rng)
    tensors = {"a": rand(rng, s, dt)}
    args = [T("a")]
    if name == "cumprodgrad":
        tensors["g"] = rand(rng, s, dt)
        args.append(T("g"))
    return tensors, [*args, V(int(rng.integers(-2, 2)))], None


def _softmax(rng: np.random.Generator, name: str) -> Built:
    return {"a": rand(rng, shape2(rng), fdtype(rng))}, [T("a"), V(int(rng.integers(0, 2)))], None


def _gelu(rng: np.random.Generator, name: str) -> Built:
    return {"a": rand(rng, shape2(rng), fdtype(rng))}, [T("a"), V(str(rng.choice(["none", "tanh"])), "string")], None


def _gelugrad(rng: np.random.Generator, name: str) -> Built:
    dt, s = fdtype(rng), shape2(rng)
    return ({"a": rand(rng, s, dt), "g": rand(rng, s, dt)},
            [T("a"), T("g"), V(str(rng.choice(["none", "tanh"])), "string")], None)


def _crossentropy(rng: np.random.Generator, name: str) -> Built:
    b, c = shape2(rng)
    dt = fdtype(rng)
    reduction = str(rng.choice(["mean", "sum", "none"]))
    tensors = {"z": rand(rng, (b, c), dt), "y": rng.integers(0, c, b).astype(np.int64)}
    args = [T("z"), T("y")]
    if name == "crossentropygrad":
        tensors["g"] = rand(rng, () if reduction != "none" else (b,), dt)
        args.append(T("g"))
    return tensors, [*args, V(-100), V(reduction, "string")], None


def _mse(rng: np.random.Generator, name: str) -> Built:
    s, dt = shape2(rng), fdtype(rng)
    return ({"a": rand(rng, s, dt), "b": rand(rng, s, dt)},
            [T("a"), T("b"), V(str(rng.choice(["mean", "sum", "none"])), "string")], None)


def _norm(rng: np.random.Generator, name: str) -> Built:
    (m, n), dt = shape2(rng), fdtype(rng)
    tensors = {"a": rand(rng, (m, n), dt), "w": rand(rng, (n,), dt)}
    args = [T("a"), T("w")]
    if name == "layernorm":
        tensors["bias"] = rand(rng, (n,), dt)
        args.append(T("bias"))
    if name.endswith("grad"):  # layernormgrad, rmsnormgrad: the gradient of the result in, dA and xhat out
        tensors["g"] = rand(rng, (m, n), dt)
        return tensors, [*args, T("g"), V(1e-5)], [T("da"), T("xn")]
    return tensors, [*args, V(1e-5)], None


def _slice(rng: np.random.Generator, name: str) -> Built:
    (m, n), dt = shape2(rng), fdtype(rng)
    tensors = {"a": rand(rng, (m, n), dt)}
    args = [T("a"), VEC([0, 1]), VEC([m, n]), VEC([1, 2])]
    if name == "sliceassign":
        tensors["v"] = rand(rng, (1,), dt, 5, 6)
        args.append(T("v"))
    return tensors, args, None


def _pad(rng: np.random.Generator, name: str) -> Built:
    return {"a": rand(rng, shape2(rng), fdtype(rng))}, [T("a"), VEC([1, 0, 0, 2]), V(0.0)], None


def _indexadd(rng: np.random.Generator, name: str) -> Built:
    (m, n), dt = shape2(rng), fdtype(rng)
    return ({"a": rand(rng, (m, n), dt), "i": rng.integers(0, m, 3).astype(np.int64), "s": rand(rng, (3, n), dt)},
            [T("a"), T("i"), T("s"), V(0)], None)


def _todtype(rng: np.random.Generator, name: str) -> Built:
    return {"a": rand(rng, shape2(rng), "float32")}, [T("a")], None


def _invert(rng: np.random.Generator, name: str) -> Built:
    return {"a": rand(rng, shape2(rng), str(rng.choice(["int32", "bool"])), 0, 9)}, [T("a")], None


def _fused(rng: np.random.Generator, name: str) -> Built:
    s, dt = shape2(rng), fdtype(rng)
    return ({"a": rand(rng, s, dt), "b": rand(rng, s, dt)}, [L(["a", "b"]), V("in0 * in1 + 1", "string")], None)


def _collective(rng: np.random.Generator, name: str) -> Built:
    """A collective in SOLO, a process group of one rank (the identity)."""
    how = V(str(rng.choice(["sum", "mean", "max", "min", "product"])), "string")
    extra = {"allreduce": [how], "broadcast": [V(0)], "allgather": [V(1)], "reducescatter": [V(1), how]}[name]
    return {"a": rand(rng, shape2(rng), fdtype(rng))}, [T("a"), *extra, V("default", "string")], None


def _matmultransposed(rng: np.random.Generator, name: str) -> Built:
    m, k, n = (int(x) for x in rng.integers(2, 5, 3))
    dt = fdtype(rng)
    ta, tb = bool(rng.random() < 0.5), bool(rng.random() < 0.5)
    return ({"a": rand(rng, (k, m) if ta else (m, k), dt), "b": rand(rng, (n, k) if tb else (k, n), dt)},
            [T("a"), T("b"), V(ta), V(tb)], None)


def _conv(rng: np.random.Generator, name: str) -> Built:
    """conv2d and its gradient ops, on one small geometry (N, C, H, W) = (2, 3, 5, 4), weight (4, 3, 3, 2)."""
    dt = fdtype(rng)
    x, w, gy = rand(rng, (2, 3, 5, 4), dt), rand(rng, (4, 3, 3, 2), dt), rand(rng, (2, 4, 3, 3), dt)
    geometry = [VEC((1, 1)), VEC((0, 0)), VEC((1, 1)), V(1)]
    if name == "conv2d":
        return {"x": x, "w": w}, [T("x"), T("w"), *geometry], None
    if name == "conv2dgradinput":
        return {"gy": gy, "w": w}, [T("gy"), T("w"), VEC(x.shape), *geometry], None
    return {"x": x, "gy": gy}, [T("x"), T("gy"), VEC(w.shape), *geometry], None


def _pool(rng: np.random.Generator, name: str) -> Built:
    """maxpool2d, sumpool2d and their gradient ops on (2, 3, 5, 4), a 3x2 window of stride 1 (result (2, 3, 3, 3))."""
    dt = fdtype(rng)
    x, gy = rand(rng, (2, 3, 5, 4), dt), rand(rng, (2, 3, 3, 3), dt)
    geometry = [VEC((3, 2)), VEC((1, 1)), VEC((1, 1))]
    if name in ("maxpool2d", "sumpool2d"):
        return {"x": x}, [T("x"), *geometry], None
    if name == "maxpool2dgrad":
        return {"x": x, "gy": gy}, [T("x"), T("gy"), *geometry], None
    return {"gy": gy}, [T("gy"), VEC(x.shape), *geometry], None


def _norms(rng: np.random.Generator, name: str) -> Built:
    """batchnorm, groupnorm (three fresh results) and their gradient ops on (2, 4, 3, 2); batchnormupdate in place."""
    dt = fdtype(rng)
    x, g, w, b = rand(rng, (2, 4, 3, 2), dt), rand(rng, (2, 4, 3, 2), dt), rand(rng, (4,), dt), rand(rng, (4,), dt)
    stats = (2, 2) if name.startswith("group") else (4,)
    m, v = rand(rng, stats, dt), rand(rng, stats, dt)
    three = [T("r0"), T("r1"), T("r2")]
    if name == "batchnorm":
        return {"x": x, "w": w, "b": b}, [T("x"), T("w"), T("b"), V(1e-5)], three
    if name == "groupnorm":
        return {"x": x, "w": w, "b": b}, [T("x"), T("w"), T("b"), V(2), V(1e-5)], three
    if name == "batchnormeval":
        return {"x": x, "w": w, "b": b, "m": m, "v": v}, [T("x"), T("w"), T("b"), T("m"), T("v"), V(1e-5)], None
    if name == "batchnormupdate":
        return ({"rm": rand(rng, (4,), dt), "rv": rand(rng, (4,), dt), "m": m, "v": v},
                [T("rm"), T("rv"), T("m"), T("v"), V(0.1), V(12)], [T("rm"), T("rv")])
    groups = [V(2)] if name == "groupnormgrad" else [V(1e-5), V(bool(rng.random() < 0.5))]
    if name == "groupnormgrad":
        groups.append(V(1e-5))
    return {"x": x, "g": g, "w": w, "m": m, "v": v}, [T("x"), T("g"), T("w"), T("m"), T("v"), *groups], three


def _interp(rng: np.random.Generator, name: str) -> Built:
    """interpnearest and interpbilinear of (2, 3, 4, 5) to (6, 3), and their gradients."""
    dt = fdtype(rng)
    flags = [V(bool(rng.random() < 0.5))] if "bilinear" in name else []
    if name.endswith("grad"):
        return {"g": rand(rng, (2, 3, 6, 3), dt)}, [T("g"), VEC((2, 3, 4, 5)), *flags, V(0.0), V(0.0)], None
    return {"x": rand(rng, (2, 3, 4, 5), dt)}, [T("x"), VEC((6, 3)), *flags, V(0.0), V(0.0)], None


def _fusedcolsum(rng: np.random.Generator, name: str) -> Built:
    s, dt = shape2(rng), ("float32", "float64")[int(rng.integers(0, 2))]
    return ({"a": rand(rng, s, dt), "b": rand(rng, s, dt)}, [L(["a", "b"]), V("in0 * in1 + 1", "string"), V(False)],
            [T("out"), T("sums")])  # two results: both fresh


def _attention(rng: np.random.Generator, name: str) -> Built:
    """attention on (2, 3, 4) queries and (2, 5, 4) keys, and its gradient op; both fresh or written over an input."""
    dt = fdtype(rng)
    tensors = {"q": rand(rng, (2, 3, 4), dt), "k": rand(rng, (2, 5, 4), dt), "v": rand(rng, (2, 5, 4), dt),
               "y": rand(rng, (2, 3, 4), dt), "lse": rand(rng, (2, 3), dt), "g": rand(rng, (2, 3, 4), dt),
               "mask": np.arange(5) <= np.arange(3)[:, None] + 2}
    over = bool(rng.integers(0, 2))
    if name == "attention":
        return tensors, [T("q"), T("k"), T("v"), V(0.5), V(bool(rng.integers(0, 2)))], [
            T("y" if over else "out"), T("lse" if over else "lse_out")]
    if name == "maskedattention":
        return tensors, [T("q"), T("k"), T("v"), T("mask"), V(0.5)], [
            T("y" if over else "out"), T("lse" if over else "lse_out")]
    if name == "maskedattentiongrad":
        args = [T("q"), T("k"), T("v"), T("mask"), T("y"), T("lse"), T("g"), V(0.5)]
    else:
        args = [T("q"), T("k"), T("v"), T("y"), T("lse"), T("g"), V(0.5), V(True)]
    return tensors, args, [T("g" if over else "dq"), T("dk"), T("v" if over else "dv")]


BUILDERS: dict[str, Callable[[np.random.Generator, str], Built]] = {
    "newtensor": _newtensor, "copytensor": _copytensor, "deltensor": _deltensor, "renametensor": _renametensor,
    "argset": _argset, "vecset": _vecset,
    "constant": _fill(lambda r: V(float(r.uniform(5, 6)))), "arange": _fill(lambda r: V(5.0), lambda r: V(1.0)),
    "uniform": _fill(lambda r: V(5.0), lambda r: V(6.0), lambda r: V(int(r.integers(1, 99)))),
    "normal": _fill(lambda r: V(5.0), lambda r: V(1.0), lambda r: V(int(r.integers(1, 99)))),
    "dropout": _fill(lambda r: V(0.5), lambda r: V(int(r.integers(1, 99)))),
    "print": _print, "save": _save, "load": _load, "loadtensordata": _loadtensordata,
    "invert": _invert, "todtype": _todtype, "switch": _switch, "matmul": _matmul, "reshape": _reshape,
    "transpose": _transpose, "concat": _concat, "broadcastTo": _broadcast_to, "indexselect": _indexselect,
    "repeat": _repeat, "argmax": _argreduce, "argmin": _argreduce, "softmax": _softmax, "logsoftmax": _softmax,
    "gelu": _gelu, "gelugrad": _gelugrad, "crossentropy": _crossentropy, "crossentropygrad": _crossentropy, "mse": _mse,
    "layernorm": _norm, "rmsnorm": _norm, "layernormgrad": _norm, "rmsnormgrad": _norm, "slice": _slice,
    "sliceassign": _slice, "pad": _pad,
    "indexadd": _indexadd, "indexcopy": _indexadd, "sgd": _update(1), "adam": _update(2), "adamw": _update(2),
    "fused": _fused,
    "matmultransposed": _matmultransposed, "fusedcolsum": _fusedcolsum, "cumsum": _cumsum,
    "cumprod": _cumprod, "cumprodgrad": _cumprod,
    "gather": _gather, "scatter": _gather, "scatteradd": _gather, "argsort": _sort, "argtopk": _sort,
    "conv2d": _conv, "conv2dgradinput": _conv, "conv2dgradweight": _conv,
    "maxpool2d": _pool, "maxpool2dgrad": _pool, "sumpool2d": _pool, "sumpool2dgrad": _pool,
    "attention": _attention, "attentiongrad": _attention, "maskedattention": _attention,
    "maskedattentiongrad": _attention,
    "batchnorm": _norms, "batchnormeval": _norms, "batchnormgrad": _norms, "batchnormupdate": _norms,
    "groupnorm": _norms, "groupnormgrad": _norms, "interpnearest": _interp, "interpnearestgrad": _interp,
    "interpbilinear": _interp, "interpbilineargrad": _interp,
}
for _n in ("add", "sub", "mul", "div", "max", "min", "pow", "fmod", "remainder", "floordiv"):
    BUILDERS[_n] = _binary
for _n in ("addscalar", "subscalar", "mulscalar", "divscalar", "powscalar", "maxscalar", "minscalar", "fmodscalar",
           "remainderscalar", "floordivscalar"):
    BUILDERS[_n] = _scalar
for _n in ("rsubscalar", "rdivscalar", "rpowscalar", "rfmodscalar", "rremainderscalar", "rfloordivscalar"):
    BUILDERS[_n] = _rscalar
for _n in ("sqrt", "exp", "log", "sin", "cos", "tan", "neg", "abs", "relu", "sigmoid", "tanh", "erf", "silu", "floor",
           "ceil", "round", "trunc", "log1p", "expm1"):
    BUILDERS[_n] = _unary
for _n in ("less", "greater"):
    BUILDERS[_n] = _compare2
for _n in ("lessscalar", "greaterscalar", "equalscalar", "notequalscalar"):
    BUILDERS[_n] = _compare1
for _n in ("equal", "notequal"):
    BUILDERS[_n] = _compare2
for _n in ("sum", "prod", "reducemax", "reducemin"):
    BUILDERS[_n] = _reduce
for _n in ("allreduce", "broadcast", "allgather", "reducescatter"):
    BUILDERS[_n] = _collective

#: a process group of one rank, "default", as a daemon holds it: the executors' collectives
SOLO = Collectives()
SOLO.formed("default", "solo", 0, [{"node": "here"}], 5.0)


def _executor(root: str, tensors: Tensors) -> CpuExecutor:
    ex = CpuExecutor(io_roots=[root], output=lambda text: None)
    ex.collectives = SOLO
    for name, a in tensors.items():
        ex.put(name, a)
    return ex


def _differ(before: np.ndarray, after: np.ndarray) -> bool:
    """Whether a tensor holds another value (or buffer) than it did."""
    return (after is not before[0] or after.shape != before[1].shape or after.dtype != before[1].dtype
            or after.tobytes() != before[1].tobytes())


def _changed_by(a: np.ndarray) -> np.ndarray:
    """Values unlike `a` everywhere: what an existing output holds before the instruction writes it."""
    if a.dtype == np.bool_:
        return ~a
    if a.dtype.kind in "iu":
        return a + 1
    b = np.where(np.isfinite(a), a, 0).astype(a.dtype) + a.dtype.type(1)
    return np.where(b == a, a.dtype.type(0.5), b).astype(a.dtype)


def _returns(rng: np.random.Generator, root: str, name: str, tensors: Tensors, args: list[Param]
             ) -> list[Param]:
    """A return for an op that writes its result: a fresh name, an existing tensor of the result's meta (holding
    other values), or one of its inputs (written over)."""
    dtype = "float64" if name == "todtype" else None
    scratch = _executor(root, tensors)
    scratch.run(Instr(name, tuple(args), (T("out", dtype),)))
    result = scratch.get("out")
    mode = int(rng.integers(0, 3))
    inputs = [str(p.value) for p in args if p.category == "tensor"]
    if mode == 1:
        tensors["o"] = _changed_by(result)
        return [T("o")]
    if mode == 2 and inputs and name not in ("copytensor", "todtype") and OPS[name].family != "collective":
        # (a copy onto itself writes nothing, nor does a collective of one rank)
        return [T(str(rng.choice(inputs)))]
    return [T("out", dtype)]


def _case(rng: np.random.Generator, root: str, name: str) -> tuple[Tensors, Instr]:
    tensors, args, rets = BUILDERS[name](rng, name)
    args = [p._replace(value=p.value.format(root=root)) if isinstance(p.value, str) else p for p in args]
    if rets is None:
        rets = _returns(rng, root, name, tensors, args)
    return tensors, Instr(name, tuple(args), tuple(rets))


def _files(root: str, rng: np.random.Generator) -> None:
    ex = _executor(root, {"w.x": rand(rng, (2, 3), "float64")})
    ex.run(Instr("save", (T("w.x"), V(f"{root}/w.x", "string")), ()))
    rand(rng, (2, 3), "float32", -3, 3).tofile(f"{root}/raw.data")


def _seen(before: dict[str, tuple[np.ndarray, np.ndarray]], ex: CpuExecutor) -> tuple[Any, ...]:
    """What the executor did to its tensor table: created, written, deleted and renamed names."""
    after = dict(ex.tensors)
    renamed = tuple((old, new) for old, (a, _) in before.items() for new, b in after.items()
                    if b is a and old not in after and new not in before)
    moved = {n for pair in renamed for n in pair}
    return (tuple(sorted(n for n in after if n not in before and n not in moved)),
            tuple(sorted(n for n in after if n in before and _differ(before[n], after[n]))),
            tuple(sorted(n for n in before if n not in after and n not in moved)), renamed)


def test_every_op_has_a_builder():
    assert set(BUILDERS) == set(OPS)
    assert all(OPS[n].effect.kind in KINDS for n in OPS)


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_apply_effect_says_what_the_executor_does(name, tmp_path):
    rng = np.random.default_rng([zlib.crc32(name.encode()), int(os.environ.get("DEEPX_TEST_SEED", "0"))])
    root = str(tmp_path)
    _files(root, rng)
    instrs = [_case(rng, root, name) for _ in range(CASES)]
    if name == "newtensor":
        instrs.append(({"x": rand(rng, (3,), "int32")}, _newtensor_keep(rng)))
    for tensors, instr in instrs:
        ex = _executor(root, tensors)
        b = bind(instr, ex)
        check_instruction(b)
        metas: dict[str, Any] = dict(ex.tensors.metas)
        variables: dict[str, Any] = {}
        vectors: dict[str, Any] = {}
        change = apply_effect(b, metas, variables, vectors)
        before = {n: (a, a.copy()) for n, a in ex.tensors.items()}
        ex.execute(b)
        seen = _seen(before, ex)
        said = (tuple(sorted(change.created)), tuple(sorted(change.written)), tuple(sorted(change.deleted)),
                tuple(pair for pair in change.renamed if pair[0] != pair[1]))
        assert said == seen, f"{instr}: apply_effect said {said}, the executor did {seen}"
        assert {n: m for n, m in metas.items() if m is not UNKNOWN} == {
            n: m for n, m in ex.tensors.metas.items() if metas.get(n) is not UNKNOWN}, str(instr)
        assert set(metas) == set(ex.tensors.metas), str(instr)
        assert variables == ex.variables and vectors == ex.vectors, str(instr)
        reads = [x for p in instr.args if p.category in ("tensor", "listtensor")
                 for x in (p.value if p.category == "listtensor" else (p.value,))]
        assert change.reads == tuple(reads) == _read_by_bind(b), str(instr)
        _same_by_name(instr, change, dict(ex.tensors.metas), before)


def _read_by_bind(b: Any) -> tuple[str, ...]:
    """The tensors the check resolved the instruction's tensor args to (apply_effect reads them off the Instr)."""
    names = [b.names[i] for i, a in enumerate(b.op.args) if a.kind in ("tensor", "listtensor") and b.names[i]]
    return tuple(x for n in names for x in (n if isinstance(n, list) else [n]))


def _same_by_name(instr: Instr, change: Change, after: dict[str, Any], before: dict[str, Any]) -> None:
    """The unchecked instruction's effect agrees with the checked one's: the same reads, deletes and renames; the
    names it gives a value include those the check's says (newtensor keeping a tensor writes nothing)."""
    by_name = apply_effect(instr)
    assert (by_name.reads, by_name.deleted, by_name.renamed, by_name.sets) == (
        change.reads, change.deleted, change.renamed, change.sets), str(instr)
    assert set(change.writes) <= set(by_name.writes), str(instr)
    assert by_name.created == ()
    metas = {n: TensorMeta(a.shape, "float32") for n, (a, _) in before.items()}
    counted = apply_effect(instr, metas)
    assert counted.created == change.created and set(metas) == set(after), str(instr)


def test_a_program_checked_leaves_the_metas_its_run_leaves(tmp_path):
    """check_program follows a program's effect (SymbolicEnv.apply) as the executor runs it, a rename to its own
    name included (it changes nothing)."""
    root = str(tmp_path)
    ex = _executor(root, {"a": np.ones((2, 3), np.float32)})
    program = [
        Instr("newtensor", (VEC((4,)),), (T("n", "float64"),)),
        Instr("renametensor", (V("a", "string"),), (T("a"),)),
        Instr("addscalar", (T("a"), V(1.0)), (T("b"),)),
        Instr("renametensor", (V("c", "string"),), (T("b"),)),
        Instr("reshape", (T("c"), VEC((3, 2))), (T("c"),)),
        Instr("argset", (V(2.0),), (V("s", "string"),)),
        Instr("mulscalar", (T("c"), V("s")), (T("d"),)),
        Instr("save", (T("d"), V(f"{root}/d", "string")), ()),
        Instr("load", (V(f"{root}/d", "string"),), ()),
        Instr("deltensor", (), (T("n"),)),
    ]
    sym = SymbolicEnv(base=ex)
    for b in check_program(program, ex):
        sym.apply(b)
    ex.run_all(program)
    assert {n: sym.meta(n) for n in ("a", "b", "c", "d", "n")} == {
        "a": TensorMeta((2, 3), "float32"), "b": None, "c": TensorMeta((3, 2), "float32"), "d": UNKNOWN, "n": None}
    assert {n for n in ex.tensors} == {"a", "c", "d"} and ex.tensors.metas["d"] == TensorMeta((3, 2), "float32")
    assert sym.var("s") == ex.variables["s"] == 2.0


def test_a_rename_onto_an_existing_name_is_refused():
    metas = {"a": TensorMeta((2,), "float32"), "b": TensorMeta((3,), "float32")}
    b = bind(Instr("renametensor", (V("b", "string"),), (T("a"),)), SymbolicEnv(metas))
    with pytest.raises(DeepxError, match="cannot rename 'a' to 'b': a tensor named 'b' exists"):
        apply_effect(b, dict(metas))


def test_effects_are_declared_or_derived_from_the_family_and_the_returns():
    kinds = {n: o.effect.kind for n, o in OPS.items()}
    assert {n for n, k in kinds.items() if k == FILLS} == {"constant", "arange", "uniform", "normal", "dropout",
                                                           "loadtensordata", "sgd", "adam", "adamw", "batchnormupdate"}
    assert (kinds["newtensor"], kinds["deltensor"], kinds["renametensor"], kinds["load"]) == (
        CREATES, DELETES, RENAMES, LOADS)
    assert kinds["argset"] == kinds["vecset"] == SETS and kinds["print"] == kinds["save"] == READS
    assert kinds["copytensor"] == kinds["add"] == WRITES and OPS["todtype"].effect.reads_returns
    assert OPS["switch"].effect.reads == (0, 1) and OPS["deltensor"].effect.reads == ()
    with pytest.raises(ValueError, match="is not one of"):
        declare("moves", "elementwise", [], [])


def test_pure_ops_only_write_their_returns():
    """`effect.pure`, what dce drops, cse merges and a check remembers: every op but those that change the set of
    tensors or variables and those that touch files or the output (the io family) or the other ranks of a process
    group (the collective family)."""
    impure = {n for n, o in OPS.items() if not o.effect.pure}
    outside = {"print", "save", "load", "loadtensordata", "allreduce", "broadcast", "allgather", "reducescatter"}
    assert impure == {"newtensor", "deltensor", "renametensor", "argset", "vecset", *outside}
    assert {n for n, o in OPS.items() if o.effect.io} == outside
    assert OPS["copytensor"].effect.pure and OPS["uniform"].effect.pure and OPS["sgd"].effect.pure


def test_an_op_added_at_run_time_gets_its_effect():
    added = op("twice_effect", "expr", [t("A")], [t("C")], frozenset({"float32"}), same(0), "2 A", expr="A + A")
    try:
        assert added.effect.kind == WRITES and added.effect.reads == (0,)
        b = bind(Instr("twice_effect", (T("a"),), (T("c"),)), SymbolicEnv({"a": TensorMeta((2,), "float32")}))
        metas: dict[str, Any] = {"a": TensorMeta((2,), "float32")}
        change = apply_effect(b, metas)
        assert (change.reads, change.created, change.written) == (("a",), ("c",), ())
        assert metas["c"] == TensorMeta((2,), "float32")
    finally:
        remove_op("twice_effect")


def test_the_module_imports_on_its_own():
    """effects.py and ops.py import each other: either may come first."""
    for module in ("deepx_core.ir.effects", "deepx_core.ir.ops"):
        subprocess.run([sys.executable, "-c", f"import {module}"], check=True, env={**os.environ})


def test_an_instruction_as_sent_names_what_the_check_resolves():
    """Untyped params, numbers as names and tensor lists as text: apply_effect reads an Instr by the rules bind
    resolves it by, so that a checked instruction's effect can be its Instr's."""
    from deepx_core.ir.text import parse_text

    metas = {n: TensorMeta((2,), "float32") for n in ("a", "1", "u", "7")}
    for instr in parse_text("add (a, 1) -> (c)\n"
                            "concat ([01 u], 0) -> (tensor:2)\n"
                            "renametensor (8) -> (7)\n"
                            "deltensor () -> (tensor<float32>:7)\n"
                            "copytensor (tensor:u) -> (u2)"):
        b = bind(instr, SymbolicEnv(metas))
        change = apply_effect(instr)
        assert change.reads == _read_by_bind(b), str(instr)
        if b.op.effect.kind == RENAMES:
            assert change.renamed == ((b.out_names[0], str(b.args[0])),)
        elif b.op.effect.kind == DELETES:
            assert change.deleted == tuple(b.out_names)
        else:
            assert change.written == tuple(b.out_names), str(instr)
