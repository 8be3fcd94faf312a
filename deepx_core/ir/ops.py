"""The op catalogue: one entry per operator, the single place where an op's facts live.

An entry (`OpDef`) gives the op's signature (`args`, `returns`), the stored dtypes its kernels handle, its shape
and dtype rule (`infer`), whether it is differentiable, its effect on the set of tensors and beyond (`effect`,
followed by `effects.apply_effect`; `effect.pure` where it only writes its returns), and the kernel family that
implements it: the CPU kernel of op `x` in family `f` is `deepxd.kernels.cpu.<f>.<x>`.

`bind(instr, env)` checks one instruction against its entry and the tensors that exist (`env`), resolving named
variables and untyped params, and returns the shapes and dtypes of its outputs; `check_program` does it for a whole
program before anything runs, so that a bad program changes nothing.
"""

from __future__ import annotations

import ast
import math
import re
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

from deepx_core.cache import Cache
from deepx_core.errors import DeepxError
from deepx_core.ir.dtypes import ALL, FLOATS, INDEX, INTS, NUMERIC, STORABLE, itemsize
from deepx_core.ir.effects import (
    CREATES,
    DELETES,
    FILLS,
    LOADS,
    RENAMES,
    SETS,
    WRITES,
    Effect,
    apply_effect,
    declare,
    forget,
)
from deepx_core.ir.instr import Instr, Param
from deepx_core.ir.shapes import Shape, broadcast, check_perm, norm_dim, norm_dims, numel, reduced


class TensorMeta(NamedTuple):
    shape: Shape
    dtype: str


#: the meta of a tensor that exists but whose shape is known only at run time (a `load` not yet executed)
UNKNOWN = TensorMeta((-1,), "any")

_REQUIRED = object()


class Arg(NamedTuple):
    """One parameter of a signature.

    kind: tensor | var | vector | listtensor | shape (a vector, or a var<string> such as "[3 4 5]").
    dtypes: for tensors, the stored dtypes accepted (None: the op's `dtypes`).
    vtype: for vars, the value wanted: num | int | bool | str | any.
    """

    name: str
    kind: str
    dtypes: frozenset[str] | None = None
    vtype: str = "num"
    default: Any = _REQUIRED

    @property
    def required(self) -> bool:
        return self.default is _REQUIRED


class Call(NamedTuple):
    """What a shape rule sees: resolved args, and the return tensors that already exist."""

    op: OpDef
    args: list[Any]  # TensorMeta for tensors, list[TensorMeta] for tensor lists, Python values otherwise
    names: list[Any]  # the tensor name (or list of names) of each arg, None for non-tensors
    outs: list[TensorMeta | None]  # existing return tensors
    out_dtypes: list[str]  # the returns' annotated precision ("any" when not annotated)
    out_names: list[Any]
    meta: tuple[tuple[str, str], ...] = ()  # the instruction's metadata (newtensor's exists=keep)


Infer = Callable[[Call], list[TensorMeta | None]]
_WRITES = Effect(WRITES)


@dataclass(frozen=True, slots=True)
class OpDef:
    name: str
    family: str  # kernel module: deepxd/kernels/cpu/<family>.py
    args: tuple[Arg, ...]
    returns: tuple[Arg, ...]
    dtypes: frozenset[str]  # stored dtypes of the op's primary tensors that every kernel handles
    infer: Infer
    doc: str
    differentiable: bool = False
    deepxir: bool = True  # one of the 60 operators of the existing deepxIR
    min_args: int = 0  # required args (the rest have defaults)
    min_returns: int = 0
    # an elementwise op's value as an expression over its args' names, in the fused language (`parse_fused`:
    # numexpr's syntax): what the fuse pass inlines, and, for family "expr", what its CPU and CUDA kernels evaluate
    expr: str = ""
    # the gradient rule written on value handles (deepxd/compiler/autograd.py, `Handle`): a function of `g` (the
    # output's gradient), the op's args by name and `y` (its output), giving each tensor arg's gradient; ops without
    # one have a rule in autograd's GRAD_RULES
    grad_rule: Callable[..., Any] | None = None
    # each output element depends only on the input elements at its index: an output may share an input's buffer
    alias_safe: bool = False
    # what it does to the set of tensors: makes, fills, deletes or renames its returns, only reads its args, and
    # whether it touches files or the output (deepx_core/ir/effects.py; `op(..., effect=KIND)`, or derived from the
    # family and the returns); `effect.pure`: it does nothing but write its returns
    effect: Effect = _WRITES
    # the check of its numbers alone, for an op whose results' metas do not depend on them (the optimizer updates):
    # an instruction that only renumbers one already bound (rebind_numbers) runs this instead of `infer`
    numbers: Callable[[OpDef, Sequence[Any]], None] | None = None

    def signature(self) -> str:
        def fmt(a: Arg) -> str:
            kind = {"tensor": "T", "var": "V", "vector": "Vec", "listtensor": "L", "shape": "Vec|V<string>"}[a.kind]
            return f"{kind} {a.name}" + ("" if a.required else f"={a.default!r}")

        return f"{self.name}({', '.join(map(fmt, self.args))}) -> ({', '.join(map(fmt, self.returns))})"


class Env(Protocol):
    """The tensors and variables an instruction is checked against."""

    def meta(self, name: str) -> TensorMeta | None: ...
    def var(self, name: str) -> Any: ...
    def vector(self, name: str) -> tuple[Any, ...] | None: ...


class Bound(NamedTuple):
    """An instruction checked against its op: resolved args and the metas of its outputs."""

    op: OpDef
    instr: Instr
    args: list[Any]
    names: list[Any]
    outs: list[TensorMeta | None]
    out_names: list[Any]
    nbytes: int = 0  # bytes the outputs hold (for op statistics)


_ITEMSIZE = {name: itemsize(name) for name in STORABLE}


#: the most bytes one tensor may hold: what numpy can index (it refuses a shape whose non-zero dims multiply past it,
#: even where another dim is 0)
MAX_TENSOR_BYTES = (1 << 63) - 1


def _nbytes(op: OpDef, outs: list[TensorMeta | None], out_names: list[Any]) -> int:
    n = 0
    for i, m in enumerate(outs):
        if m is not None and m is not UNKNOWN:
            size = _ITEMSIZE.get(m.dtype, 0)
            k = numel(m.shape) * size
            if k > MAX_TENSOR_BYTES or (k == 0 and numel([d for d in m.shape if d]) * size > MAX_TENSOR_BYTES):
                name = f" '{out_names[i]}'" if i < len(out_names) else ""
                raise DeepxError(f"{op.name}: output{name} of shape {list(m.shape)} {m.dtype} is larger than any "
                                 f"tensor can be (its dims multiply past {MAX_TENSOR_BYTES} bytes)")
            n += k
    return n


# ---------------------------------------------------------------- shape and dtype rules


def _dtype_match(call: Call, *idx: int) -> str:
    metas = [call.args[i] for i in idx]
    first = metas[0].dtype
    for i, m in zip(idx[1:], metas[1:]):
        if m.dtype != first:
            raise DeepxError(
                f"{call.op.name}: dtypes {first} ('{call.names[idx[0]]}') and {m.dtype} ('{call.names[i]}') differ; "
                "convert one with todtype"
            )
    return first


def same(i: int = 0) -> Infer:
    """The output is shaped and typed like arg i."""
    return lambda c: [TensorMeta(c.args[i].shape, c.args[i].dtype)]


def same_as(i: int, dtype: str) -> Infer:
    return lambda c: [TensorMeta(c.args[i].shape, dtype)]


def elementwise(*idx: int, dtype: str | None = None) -> Infer:
    """Tensors idx broadcast together (numpy rules); the output takes their common dtype, or `dtype`."""

    def rule(c: Call) -> list[TensorMeta | None]:
        dt = _dtype_match(c, *idx)
        shape = broadcast(c.op.name, *(c.args[i].shape for i in idx), names=[c.names[i] for i in idx])
        return [TensorMeta(shape, dtype or dt)]

    if len(idx) == 2:
        i, j = idx

        def rule2(c: Call) -> list[TensorMeta | None]:
            a, b = c.args[i], c.args[j]
            if a.dtype != b.dtype or a.shape != b.shape:
                return rule(c)
            return [TensorMeta(a.shape, dtype or a.dtype)]

        return rule2
    return rule


def existing(c: Call) -> list[TensorMeta | None]:
    """The outputs must already exist (created by newtensor); they keep their shape and dtype."""
    for name, meta in zip(c.out_names, c.outs):
        if meta is None:
            raise DeepxError(f"{c.op.name}: output tensor '{name}' does not exist; create it with newtensor first")
    for m, n in zip(c.outs, c.out_names):
        if m is not None and m is not UNKNOWN and m.dtype not in c.op.dtypes:
            raise DeepxError(f"{c.op.name}: dtype {m.dtype} of '{n}' is not supported (supported: {_fmt(c.op.dtypes)})")
    return list(c.outs)


def nothing(c: Call) -> list[TensorMeta | None]:
    return []


def _fmt(dtypes: Iterable[str]) -> str:
    order = ("float64", "float32", "float16", "bfloat16", "float8e5m2", "float8e4m3", "int64", "int32", "int16",
             "int8", "bool")
    return " ".join(d for d in order if d in dtypes)


def _newtensor(c: Call) -> list[TensorMeta | None]:
    shape = c.args[0]
    if any(d < 0 for d in shape):
        raise DeepxError(f"newtensor: shape {list(shape)} of '{c.out_names[0]}' has a negative dimension")
    dtype = c.out_dtypes[0]
    dtype = {"any": "float32", "float": "float32", "int": "int32", "float8": "float8e4m3"}.get(dtype, dtype)
    if dtype not in STORABLE:
        raise DeepxError(f"newtensor: dtype {dtype} of '{c.out_names[0]}' cannot be stored (use {_fmt(STORABLE)})")
    made, old = TensorMeta(tuple(shape), dtype), c.outs[0]
    # a name that exists is kept when it has this shape and dtype (or the SDK asks, with exists=keep), else replaced:
    # the ecosystem's scripts all name their tensors 0, 1, 2...
    if old is not None and (old == made or ("exists", "keep") in c.meta):
        return [old]
    return [made]


def _copytensor(c: Call) -> list[TensorMeta | None]:
    src, dst = c.args[0], c.outs[0]
    if dst is not None and dst is not UNKNOWN and (dst.shape, dst.dtype) != (src.shape, src.dtype):
        raise DeepxError(
            f"copytensor: '{c.names[0]}' is {src.dtype}{list(src.shape)} but '{c.out_names[0]}' is "
            f"{dst.dtype}{list(dst.shape)}"
        )
    return [TensorMeta(src.shape, src.dtype)]


def _deltensor(c: Call) -> list[TensorMeta | None]:
    if c.outs[0] is None:
        raise DeepxError(f"deltensor: tensor '{c.out_names[0]}' not found")
    return [None]


def _renametensor(c: Call) -> list[TensorMeta | None]:
    if c.outs[0] is None:
        raise DeepxError(f"renametensor: tensor '{c.out_names[0]}' not found")
    if not c.args[0]:
        raise DeepxError("renametensor: the new name is empty")
    return [None]


def _dropout(c: Call) -> list[TensorMeta | None]:
    p = c.args[0]
    if not 0.0 <= p <= 1.0:
        raise DeepxError(f"dropout: p={p} must be in [0, 1]")
    return existing(c)


def _todtype(c: Call) -> list[TensorMeta | None]:
    a = c.args[0]
    out = c.outs[0]
    dtype = out.dtype if out is not None and out is not UNKNOWN else c.out_dtypes[0]
    if dtype not in STORABLE:
        raise DeepxError(
            f"todtype: give the output's dtype, as in tensor<float32>:{c.out_names[0]} (got {dtype}); "
            f"storable: {_fmt(STORABLE)}"
        )
    return [TensorMeta(a.shape, dtype)]


def _switch(c: Call) -> list[TensorMeta | None]:
    tensors, cases = c.args[0], c.args[1]
    if not tensors:
        raise DeepxError("switch: the tensor list is empty")
    dt = tensors[0].dtype
    for m, n in zip(tensors, c.names[0]):
        if m.dtype != dt:
            raise DeepxError(f"switch: tensors in the list differ in dtype ({dt} and {m.dtype} of '{n}')")
        if m.dtype not in c.op.dtypes:
            raise DeepxError(f"switch: dtype {m.dtype} of '{n}' is not supported (supported: {_fmt(c.op.dtypes)})")
    shape = broadcast("switch", cases.shape, *(m.shape for m in tensors), names=[c.names[1], *c.names[0]])
    return [TensorMeta(shape, dt)]


def _matmul(c: Call) -> list[TensorMeta | None]:
    a, b = c.args[0], c.args[1]
    dt = _dtype_match(c, 0, 1)
    op = c.op.name
    if len(a.shape) < 2 or len(b.shape) < 2:
        raise DeepxError(
            f"{op}: operands need rank >= 2, got {a.shape} ('{c.names[0]}') and {b.shape} ('{c.names[1]}')"
        )
    flags = (bool(c.args[2]), bool(c.args[3])) if len(c.args) > 2 else (False, False)  # matmultransposed's
    sa, sb = ((*m.shape[:-2], m.shape[-1], m.shape[-2]) if t else m.shape for m, t in zip((a, b), flags))
    if sa[-1] != sb[-2]:
        shown = [f"{m.shape} ('{n}'{', transposed' if t else ''})" for m, n, t in zip((a, b), c.names, flags)]
        raise DeepxError(f"{op}: shapes {shown[0]} and {shown[1]} do not match ({sa[-1]} != {sb[-2]})")
    batch = broadcast(op, sa[:-2], sb[:-2], names=c.names[:2])
    return [TensorMeta((*batch, sa[-2], sb[-1]), dt)]


def _reshape(c: Call) -> list[TensorMeta | None]:
    a, shape = c.args[0], list(c.args[1])
    if shape.count(-1) > 1:
        raise DeepxError(f"reshape: at most one -1 in {shape}")
    if -1 in shape:
        rest = numel([d for d in shape if d != -1])
        if rest == 0 or numel(a.shape) % rest:
            raise DeepxError(f"reshape: cannot infer -1 in {shape} for '{c.names[0]}' of shape {a.shape}")
        shape[shape.index(-1)] = numel(a.shape) // rest
    if any(d < 0 for d in shape) or numel(shape) != numel(a.shape):
        raise DeepxError(
            f"reshape: '{c.names[0]}' of shape {a.shape} ({numel(a.shape)} elements) cannot become {shape} "
            f"({numel(shape)} elements)"
        )
    return [TensorMeta(tuple(shape), a.dtype)]


def _transpose(c: Call) -> list[TensorMeta | None]:
    a = c.args[0]
    perm = check_perm("transpose", c.args[1], len(a.shape))
    return [TensorMeta(tuple(a.shape[p] for p in perm), a.dtype)]


def _concat(c: Call) -> list[TensorMeta | None]:
    metas, names = c.args[0], c.names[0]
    if not metas:
        raise DeepxError("concat: the tensor list is empty")
    first = metas[0]
    dim = norm_dim("concat", c.args[1], len(first.shape))
    total = 0
    for m, n in zip(metas, names):
        if m.dtype != first.dtype:
            raise DeepxError(f"concat: '{n}' is {m.dtype} but '{names[0]}' is {first.dtype}")
        if len(m.shape) != len(first.shape) or any(
            x != y for i, (x, y) in enumerate(zip(m.shape, first.shape)) if i != dim
        ):
            raise DeepxError(
                f"concat: '{n}' has shape {m.shape}, which does not match {first.shape} ('{names[0]}') "
                f"outside dim {dim}"
            )
        total += m.shape[dim]
    return [TensorMeta((*first.shape[:dim], total, *first.shape[dim + 1:]), first.dtype)]


def _broadcast_to(c: Call) -> list[TensorMeta | None]:
    a, shape = c.args[0], tuple(c.args[1])
    try:
        ok = len(shape) >= len(a.shape) and broadcast("broadcastTo", a.shape, shape) == shape
    except DeepxError:
        ok = False
    if not ok:
        raise DeepxError(f"broadcastTo: '{c.names[0]}' of shape {a.shape} cannot be broadcast to {list(shape)}")
    return [TensorMeta(shape, a.dtype)]


def _indexselect(c: Call) -> list[TensorMeta | None]:
    a, index = c.args[0], c.args[1]
    axis = norm_dim("indexselect", c.args[2], len(a.shape), "axis")
    return [TensorMeta((*a.shape[:axis], *index.shape, *a.shape[axis + 1:]), a.dtype)]


def _indexadd(c: Call) -> list[TensorMeta | None]:
    """indexadd's and indexcopy's: src holds A's slices along axis, one per element of the index."""
    a, index, src = c.args[0], c.args[1], c.args[2]
    op = c.op.name
    axis = norm_dim(op, c.args[3], len(a.shape), "axis")
    want = (*a.shape[:axis], *index.shape, *a.shape[axis + 1:])
    if src.shape != want:
        raise DeepxError(f"{op}: source '{c.names[2]}' has shape {src.shape}, expected {want}: the shape of "
                         f"'{c.names[0]}' {a.shape} with axis {axis} replaced by the index's {index.shape}")
    _dtype_match(c, 0, 2)
    return [TensorMeta(a.shape, a.dtype)]


def _index_along(c: Call, dim_arg: int) -> int:
    """gather's and scatter's index: A's rank, and no larger than A outside dim (it may be any size along dim).
    Returns dim, normalized."""
    a, index = c.args[0], c.args[1]
    op, an, iname = c.op.name, c.names[0], c.names[1]
    dim = norm_dim(op, c.args[dim_arg], len(a.shape), scalar_ok=True)
    if len(index.shape) != len(a.shape):
        raise DeepxError(f"{op}: index '{iname}' has rank {len(index.shape)} but '{an}' has rank {len(a.shape)}; they "
                         "must match")
    for d, (i, n) in enumerate(zip(index.shape, a.shape)):
        if d != dim and i > n:
            raise DeepxError(f"{op}: index '{iname}' of shape {list(index.shape)} is larger than '{an}' "
                             f"{list(a.shape)} in dim {d}; only dim {dim} may be larger")
    return dim


def _gather(c: Call) -> list[TensorMeta | None]:
    _index_along(c, 2)
    return [TensorMeta(c.args[1].shape, c.args[0].dtype)]


def _scatter(c: Call) -> list[TensorMeta | None]:
    _index_along(c, 3)
    index, src = c.args[1], c.args[2]
    if src.shape != index.shape:
        raise DeepxError(f"{c.op.name}: source '{c.names[2]}' has shape {list(src.shape)} but index '{c.names[1]}' "
                         f"has {list(index.shape)}; they must match (slice the source)")
    _dtype_match(c, 0, 2)
    return [TensorMeta(c.args[0].shape, c.args[0].dtype)]


def _repeat(c: Call) -> list[TensorMeta | None]:
    a, reps = c.args[0], tuple(c.args[1])
    if any(r < 0 for r in reps):
        raise DeepxError(f"repeat: negative repeat count in {list(reps)}")
    if len(reps) < len(a.shape):
        raise DeepxError(f"repeat: {len(reps)} repeat counts for '{c.names[0]}' of rank {len(a.shape)}")
    shape = (1,) * (len(reps) - len(a.shape)) + a.shape
    return [TensorMeta(tuple(s * r for s, r in zip(shape, reps)), a.dtype)]


def _reduce(empty: bool) -> Infer:
    """A reduction over dims; `empty`: it has a value over no elements (a sum, a product), unlike a maximum."""

    def rule(c: Call) -> list[TensorMeta | None]:
        a = c.args[0]
        dims = norm_dims(c.op.name, c.args[1], len(a.shape))
        if not empty and any(a.shape[d] == 0 for d in dims):
            raise DeepxError(f"{c.op.name}: cannot reduce the empty dim of '{c.names[0]}' (shape {a.shape})")
        return [TensorMeta(reduced(a.shape, dims, bool(c.args[2])), a.dtype)]

    return rule


def _argreduce(c: Call) -> list[TensorMeta | None]:
    a = c.args[0]
    dim = norm_dim(c.op.name, c.args[1], len(a.shape), scalar_ok=True)
    if a.shape and a.shape[dim] == 0:
        raise DeepxError(f"{c.op.name}: cannot reduce the empty dim {dim} of '{c.names[0]}' (shape {a.shape})")
    return [TensorMeta(reduced(a.shape, (dim,), bool(c.args[2])), "int64")]


def _along_dim(c: Call) -> list[TensorMeta | None]:
    """An op along one dim (softmax, cumsum): the output is shaped and typed like A."""
    a = c.args[0]
    norm_dim(c.op.name, c.args[1], len(a.shape), scalar_ok=True)
    return [TensorMeta(a.shape, a.dtype)]


def _cumprodgrad(c: Call) -> list[TensorMeta | None]:
    a, g = c.args[0], c.args[1]
    norm_dim(c.op.name, c.args[2], len(a.shape), scalar_ok=True)
    if g.shape != a.shape or g.dtype != a.dtype:
        raise DeepxError(f"cumprodgrad: the gradient '{c.names[1]}' is {g.dtype}{list(g.shape)}; expected "
                         f"{a.dtype}{list(a.shape)}, as '{c.names[0]}'")
    return [TensorMeta(a.shape, a.dtype)]


def _argsort(c: Call) -> list[TensorMeta | None]:
    a = c.args[0]
    norm_dim(c.op.name, c.args[1], len(a.shape), scalar_ok=True)
    return [TensorMeta(a.shape, "int64")]


def _argtopk(c: Call) -> list[TensorMeta | None]:
    a, k = c.args[0], c.args[1]
    dim = norm_dim("argtopk", c.args[2], len(a.shape), scalar_ok=True)
    size = a.shape[dim] if a.shape else 1
    if not 0 <= k <= size:
        raise DeepxError(f"argtopk: k={k} is out of range for the {size} elements along dim {dim} of '{c.names[0]}' "
                         f"(shape {list(a.shape)})")
    return [TensorMeta((*a.shape[:dim], k, *a.shape[dim + 1:]) if a.shape else (), "int64")]


def _reduction_shape(c: Call, n: int) -> Shape:
    mode = c.args[-1]
    if mode not in ("mean", "sum", "none"):
        raise DeepxError(f"{c.op.name}: reduction must be mean, sum or none, got {mode!r}")
    return () if mode != "none" else (n,)


def _crossentropy(c: Call) -> list[TensorMeta | None]:
    logits, labels = c.args[0], c.args[1]
    if len(logits.shape) != 2:
        raise DeepxError(f"crossentropy: logits '{c.names[0]}' must be (batch, classes), got {logits.shape}")
    if labels.shape != logits.shape[:1]:
        raise DeepxError(
            f"crossentropy: labels '{c.names[1]}' of shape {labels.shape} do not match logits {logits.shape}; "
            f"expected ({logits.shape[0]},)"
        )
    return [TensorMeta(_reduction_shape(c, logits.shape[0]), logits.dtype)]


def _crossentropygrad(c: Call) -> list[TensorMeta | None]:
    logits, labels, g = c.args[0], c.args[1], c.args[2]
    if len(logits.shape) != 2 or labels.shape != logits.shape[:1]:
        raise DeepxError(f"crossentropygrad: logits '{c.names[0]}' {logits.shape} and labels '{c.names[1]}' "
                         f"{labels.shape} are not (batch, classes) and (batch,)")
    want = _reduction_shape(c, logits.shape[0])
    if g.shape != want or g.dtype != logits.dtype:
        raise DeepxError(f"crossentropygrad: the upstream gradient '{c.names[2]}' is {g.dtype}{list(g.shape)}; "
                         f"expected {logits.dtype}{list(want)}")
    return [TensorMeta(logits.shape, logits.dtype)]


def _gelugrad(c: Call) -> list[TensorMeta | None]:
    a, g = c.args[0], c.args[1]
    if g.shape != a.shape or g.dtype != a.dtype:
        raise DeepxError(f"gelugrad: the upstream gradient '{c.names[1]}' is {g.dtype}{list(g.shape)}; expected "
                         f"{a.dtype}{list(a.shape)}, as gelu's input '{c.names[0]}'")
    return [TensorMeta(a.shape, a.dtype)]


def _mse(c: Call) -> list[TensorMeta | None]:
    a, b = c.args[0], c.args[1]
    dt = _dtype_match(c, 0, 1)
    if a.shape != b.shape:
        raise DeepxError(f"mse: shapes {a.shape} ('{c.names[0]}') and {b.shape} ('{c.names[1]}') differ")
    shape = _reduction_shape(c, numel(a.shape))
    return [TensorMeta(a.shape if shape else (), dt)]


def _normgrad(c: Call) -> list[TensorMeta | None]:
    """layernormgrad's and rmsnormgrad's: weight over A's trailing dims, G of A's shape; dA and the normalised A."""
    a, w, g = c.args[0], c.args[1], c.args[2]
    k = len(w.shape)
    if k == 0 or a.shape[len(a.shape) - k:] != w.shape:
        raise DeepxError(
            f"{c.op.name}: weight '{c.names[1]}' of shape {w.shape} must match the last dims of "
            f"'{c.names[0]}' {a.shape}"
        )
    if g.shape != a.shape:
        raise DeepxError(f"{c.op.name}: the gradient '{c.names[2]}' {list(g.shape)} must have the shape of "
                         f"'{c.names[0]}' {list(a.shape)}")
    _dtype_match(c, 0, 1, 2)
    return [TensorMeta(a.shape, a.dtype), TensorMeta(a.shape, a.dtype)]


def _norm(c: Call) -> list[TensorMeta | None]:
    a, w = c.args[0], c.args[1]
    k = len(w.shape)
    if k == 0 or a.shape[len(a.shape) - k:] != w.shape:
        raise DeepxError(
            f"{c.op.name}: weight '{c.names[1]}' of shape {w.shape} must match the last dims of "
            f"'{c.names[0]}' {a.shape}"
        )
    tensors = [0, 1]
    if c.op.args[2].kind == "tensor":  # layernorm's bias
        if c.args[2].shape != w.shape:
            raise DeepxError(f"{c.op.name}: bias '{c.names[2]}' of shape {c.args[2].shape} must match weight "
                             f"{w.shape}")
        tensors.append(2)
    _dtype_match(c, *tensors)
    return [TensorMeta(a.shape, a.dtype)]


def conv2d_geometry(what: str, a: Shape, w: Shape, stride: Sequence[int], padding: Sequence[int],
                    dilation: Sequence[int], groups: int) -> tuple[int, int]:
    """The output's spatial size (Hout, Wout) of a conv2d of input shape `a` by weight shape `w`; DeepxError naming
    the mismatch."""
    if len(a) != 4 or len(w) != 4:
        raise DeepxError(f"{what}: input and weight must be 4-D (N, C, H, W) and (O, C / groups, kh, kw), got {a} "
                         f"and {w}")
    for name, pair, low in (("stride", stride, 1), ("padding", padding, 0), ("dilation", dilation, 1)):
        if len(pair) != 2 or any(int(p) < low for p in pair):
            raise DeepxError(f"{what}: {name} must be two ints of at least {low}, got {list(pair)}")
    c, o = a[1], w[0]
    if groups < 1 or c % groups or o % groups or w[1] != c // groups:
        raise DeepxError(f"{what}: input of {c} channels, weight {w} and groups={groups} do not fit (the weight's "
                         "second dim must be channels / groups, and both channel counts divisible by groups)")
    out = []
    for k in range(2):
        n = (a[2 + k] + 2 * int(padding[k]) - int(dilation[k]) * (w[2 + k] - 1) - 1) // int(stride[k]) + 1
        if n < 1:
            raise DeepxError(f"{what}: the input's spatial size {a[2 + k]} (padded by {padding[k]}) is smaller than "
                             f"the kernel ({w[2 + k]}, dilation {dilation[k]})")
        out.append(n)
    return out[0], out[1]


def _conv2d(c: Call) -> list[TensorMeta | None]:
    a, w = c.args[0], c.args[1]
    dt = _dtype_match(c, 0, 1)
    oh, ow = conv2d_geometry("conv2d", a.shape, w.shape, c.args[2], c.args[3], c.args[4], int(c.args[5]))
    return [TensorMeta((a.shape[0], w.shape[0], oh, ow), dt)]


def _conv2dgrad(by_input: bool) -> Infer:
    """conv2dgradinput (G, weight, input_shape, ...) and conv2dgradweight (A, G, weight_shape, ...)."""

    def rule(c: Call) -> list[TensorMeta | None]:
        dt = _dtype_match(c, 0, 1)
        shape = tuple(int(d) for d in c.args[2])
        a, w = (shape, c.args[1].shape) if by_input else (c.args[0].shape, shape)
        g = c.args[0].shape if by_input else c.args[1].shape
        oh, ow = conv2d_geometry(c.op.name, a, w, c.args[3], c.args[4], c.args[5], int(c.args[6]))
        if g != (a[0], w[0], oh, ow):
            raise DeepxError(f"{c.op.name}: the gradient '{c.names[0 if by_input else 1]}' has shape {g}, the "
                             f"conv2d's result has {(a[0], w[0], oh, ow)}")
        return [TensorMeta(shape, dt)]

    return rule


def pool2d_geometry(what: str, a: Shape, kernel: Sequence[int], stride: Sequence[int], dilation: Sequence[int]
                    ) -> tuple[int, int]:
    """The output's spatial size (Hout, Wout) of a pooling window over an input of shape `a` (N, C, H, W), already
    padded; DeepxError naming what does not fit."""
    if len(a) != 4:
        raise DeepxError(f"{what}: the input must be 4-D (N, C, H, W), got {a}")
    for name, pair in (("kernel", kernel), ("stride", stride), ("dilation", dilation)):
        if len(pair) != 2 or any(int(p) < 1 for p in pair):
            raise DeepxError(f"{what}: {name} must be two ints of at least 1, got {list(pair)}")
    out = []
    for k in range(2):
        n = (a[2 + k] - int(dilation[k]) * (int(kernel[k]) - 1) - 1) // int(stride[k]) + 1
        if n < 1:
            raise DeepxError(f"{what}: the input's spatial size {a[2 + k]} is smaller than the window "
                             f"({kernel[k]}, dilation {dilation[k]})")
        out.append(n)
    return out[0], out[1]


def _pool2d(c: Call) -> list[TensorMeta | None]:
    a = c.args[0]
    oh, ow = pool2d_geometry(c.op.name, a.shape, c.args[1], c.args[2], c.args[3])
    return [TensorMeta((a.shape[0], a.shape[1], oh, ow), a.dtype)]


def _pool2dgrad(shape_arg: int) -> Callable[[Call], list[TensorMeta | None]]:
    """maxpool2dgrad (A, G, ...): dA has A's shape; sumpool2dgrad (G, input_shape, ...): input_shape. G must have
    the pooling's result shape."""
    def rule(c: Call) -> list[TensorMeta | None]:
        g = c.args[1] if shape_arg == 0 else c.args[0]
        shape = c.args[0].shape if shape_arg == 0 else tuple(int(d) for d in c.args[1])
        if shape_arg == 0:
            _dtype_match(c, 0, 1)
        oh, ow = pool2d_geometry(c.op.name, shape, c.args[2], c.args[3], c.args[4])
        if g.shape != (shape[0], shape[1], oh, ow):
            raise DeepxError(f"{c.op.name}: the gradient '{c.names[1 if shape_arg == 0 else 0]}' has shape "
                             f"{g.shape}, the pooling's result has {(shape[0], shape[1], oh, ow)}")
        return [TensorMeta(shape, g.dtype)]
    return rule


def attention_heads(what: str, q: Shape, k: Shape, v: Shape, names: Sequence[Any] = ("q", "k", "v")) -> int:
    """How many query heads read each key/value head: 1, or Hq / Hk where k and v have fewer heads (dim -3) than q
    (grouped-query attention, torch's enable_gqa). DeepxError naming the shapes that do not fit
    (q (..., Tq, D), k (..., Tk, D), v (..., Tk, Dv))."""
    nq, nk, nv = (f"'{n}'" for n in names)
    if len(q) < 2 or len(k) != len(q) or len(v) != len(q):
        raise DeepxError(f"{what}: q {nq} {list(q)}, k {nk} {list(k)} and v {nv} {list(v)} must be (..., T, E) "
                         "tensors of one rank (at least 2)")
    if q[-1] != k[-1]:
        raise DeepxError(f"{what}: q {nq} {list(q)} and k {nk} {list(k)} differ in their last dim ({q[-1]} != "
                         f"{k[-1]}); they share the head size")
    if k[:-1] != v[:-1]:
        raise DeepxError(f"{what}: k {nk} {list(k)} and v {nv} {list(v)} differ outside their last dim; they "
                         "share every dim but the value size")
    if q[:-2] == k[:-2]:
        return 1
    if len(q) >= 3 and q[:-3] == k[:-3] and k[-3] > 0 and q[-3] % k[-3] == 0:
        return q[-3] // k[-3]
    raise DeepxError(f"{what}: q {nq} {list(q)} and k {nk} {list(k)} differ in their leading dims; they must "
                     "match, but for k and v having fewer heads (dim -3) than q, a divisor of q's (grouped-query "
                     "attention)")


def lse_dtype(dtype: str) -> str:
    """The dtype of attention's row logsumexp for inputs of `dtype`: the compute dtype (float64 for float64)."""
    return "float64" if dtype == "float64" else "float32"


def _attention(c: Call) -> list[TensorMeta | None]:
    q, k, v = c.args[0], c.args[1], c.args[2]
    dt = _dtype_match(c, 0, 1, 2)
    attention_heads(c.op.name, q.shape, k.shape, v.shape, c.names[:3])
    return [TensorMeta((*q.shape[:-1], v.shape[-1]), dt), TensorMeta(q.shape[:-1], lse_dtype(dt))]


def _attentiongrad(c: Call) -> list[TensorMeta | None]:
    q, k, v, lse = c.args[0], c.args[1], c.args[2], c.args[4]
    dt = _dtype_match(c, 0, 1, 2, 3, 5)
    attention_heads(c.op.name, q.shape, k.shape, v.shape, c.names[:3])
    want = (*q.shape[:-1], v.shape[-1])
    for i in (3, 5):
        if c.args[i].shape != want:
            raise DeepxError(f"{c.op.name}: '{c.names[i]}' has shape {list(c.args[i].shape)}; attention's result "
                             f"has {list(want)}")
    if lse.shape != q.shape[:-1] or lse.dtype != lse_dtype(dt):
        raise DeepxError(f"{c.op.name}: the logsumexp '{c.names[4]}' is {lse.dtype}{list(lse.shape)}; attention "
                         f"gives {lse_dtype(dt)}{list(q.shape[:-1])}")
    return [TensorMeta(q.shape, dt), TensorMeta(k.shape, dt), TensorMeta(v.shape, dt)]


def attention_mask(what: str, q: Shape, tk: int, mask: TensorMeta, dtype: str, name: Any = "mask") -> None:
    """DeepxError unless `mask` is bool or `dtype` and broadcasts to the scores (..., Hq, Tq, Tk) as they are."""
    scores = (*q[:-1], tk)
    if mask.dtype not in ("bool", dtype):
        raise DeepxError(f"{what}: the mask '{name}' is {mask.dtype}; give bool (True: the key takes part) or "
                         f"{dtype} as q (added to the scores)")
    m = mask.shape
    if len(m) > len(scores) or any(a not in (1, b) for a, b in zip(m[::-1], scores[::-1])):
        raise DeepxError(f"{what}: the mask '{name}' {list(m)} does not broadcast to the scores {list(scores)} "
                         "(..., query heads, Tq, Tk)")


def _maskedattention(c: Call) -> list[TensorMeta | None]:
    q, k, v, mask = c.args[0], c.args[1], c.args[2], c.args[3]
    dt = _dtype_match(c, 0, 1, 2)
    attention_heads(c.op.name, q.shape, k.shape, v.shape, c.names[:3])
    attention_mask(c.op.name, q.shape, k.shape[-2], mask, dt, c.names[3])
    return [TensorMeta((*q.shape[:-1], v.shape[-1]), dt), TensorMeta(q.shape[:-1], lse_dtype(dt))]


def _maskedattentiongrad(c: Call) -> list[TensorMeta | None]:
    """As attentiongrad's rule, with the mask (arg 3) between v and C."""
    q, k, mask = c.args[0], c.args[1], c.args[3]
    dt = _dtype_match(c, 0, 1, 2)
    attention_mask(c.op.name, q.shape, k.shape[-2], mask, dt, c.names[3])
    keep = [0, 1, 2, 4, 5, 6, 7]
    return _attentiongrad(c._replace(args=[c.args[i] for i in keep], names=[c.names[i] for i in keep]))


def _slices(c: Call) -> tuple[Shape, tuple[slice, ...]]:
    a, starts, ends, steps = c.args[0], c.args[1], c.args[2], c.args[3]
    n = len(a.shape)
    if not len(starts) == len(ends) == len(steps) == n:
        raise DeepxError(
            f"{c.op.name}: starts, ends and steps need one entry per dim of '{c.names[0]}' (rank {n}), "
            f"got {len(starts)}, {len(ends)}, {len(steps)}"
        )
    if any(s <= 0 for s in steps):
        raise DeepxError(f"{c.op.name}: steps must be positive, got {list(steps)}")
    sl = tuple(slice(int(b), int(e), int(s)) for b, e, s in zip(starts, ends, steps))
    return tuple(len(range(*s.indices(d))) for s, d in zip(sl, a.shape)), sl


def _slice(c: Call) -> list[TensorMeta | None]:
    return [TensorMeta(_slices(c)[0], c.args[0].dtype)]


def _sliceassign(c: Call) -> list[TensorMeta | None]:
    a, v = c.args[0], c.args[4]
    shape = _slices(c)[0]
    _dtype_match(c, 0, 4)
    if broadcast("sliceassign", v.shape, shape, names=[c.names[4]]) != shape:
        raise DeepxError(f"sliceassign: value '{c.names[4]}' of shape {v.shape} does not fit the slice {shape}")
    return [TensorMeta(a.shape, a.dtype)]


def _pad(c: Call) -> list[TensorMeta | None]:
    a, pads = c.args[0], c.args[1]
    if len(pads) != 2 * len(a.shape) or any(p < 0 for p in pads):
        raise DeepxError(
            f"pad: pads must be {2 * len(a.shape)} non-negative counts (before, after per dim of '{c.names[0]}'), "
            f"got {list(pads)}"
        )
    return [TensorMeta(tuple(d + pads[2 * i] + pads[2 * i + 1] for i, d in enumerate(a.shape)), a.dtype)]


def _update(n_state: int) -> Infer:
    """Optimizer updates: param, grad and n_state state tensors all alike; written in place."""

    def rule(c: Call) -> list[TensorMeta | None]:
        idx = list(range(2 + n_state))
        _dtype_match(c, *idx)
        _update_numbers(c.op, c.args)
        p = c.args[0]
        for i in idx[1:]:
            if c.args[i].shape != p.shape:
                raise DeepxError(
                    f"{c.op.name}: '{c.names[i]}' has shape {c.args[i].shape} but param '{c.names[0]}' has {p.shape}"
                )
        outs = [TensorMeta(p.shape, p.dtype)] * (1 + n_state)
        for name, want in zip(c.out_names, [c.names[0], *c.names[2:2 + n_state]]):
            if name != want:
                raise DeepxError(f"{c.op.name}: updates in place; return '{name}' should be '{want}'")
        return list(outs)

    return rule


def _update_numbers(op: OpDef, args: Sequence[Any]) -> None:
    """An optimizer update's numbers (its `numbers` check): rates and eps >= 0, betas in [0, 1), steps from 1."""
    hp = {a.name: v for a, v in zip(op.args, args) if a.kind == "var"}
    problems = [f"{k}={hp[k]} must be >= 0" for k in ("lr", "eps", "weight_decay", "momentum", "dampening")
                if k in hp and not hp[k] >= 0]
    problems += [f"{k}={hp[k]} must be in [0, 1)" for k in ("beta1", "beta2") if k in hp and not 0 <= hp[k] < 1]
    if hp.get("step", 1) < 1:
        problems.append(f"step={hp['step']} must count from 1")
    if hp.get("nesterov") and not (hp.get("momentum", 0) > 0 and hp.get("dampening", 0) == 0):
        problems.append("nesterov needs momentum > 0 and dampening 0")
    if problems:
        raise DeepxError(f"{op.name}: {'; '.join(problems)}")


def stats_dtype(dtype: str) -> str:
    """The dtype of a norm's batch statistics (batchnorm's, groupnorm's mean and var): what its kernels compute in,
    float64 for float64 and float32 for the rest (a 16-bit mean would be rounded before the backward reads it)."""
    return "float64" if dtype == "float64" else "float32"


def _per_channel(c: Call, a: TensorMeta, idx: Sequence[int], want: Shape, dtype: str) -> None:
    """The tensors idx are of shape `want` and dtype `dtype` (a norm's weight, bias or statistics)."""
    for i in idx:
        m = c.args[i]
        if m.shape != want or m.dtype != dtype:
            raise DeepxError(f"{c.op.name}: '{c.names[i]}' is {m.dtype}{list(m.shape)}; expected {dtype}{list(want)} "
                             f"for '{c.names[0]}' {a.dtype}{list(a.shape)}")


def _channels(c: Call) -> TensorMeta:
    a = c.args[0]
    if len(a.shape) < 2:
        raise DeepxError(f"{c.op.name}: '{c.names[0]}' of shape {list(a.shape)} needs at least 2 dims (N, C, ...)")
    return a  # type: ignore[no-any-return]


def _batchnorm(c: Call) -> list[TensorMeta | None]:
    """batchnorm (A, weight, bias, eps) -> (C, mean, var): weight and bias per channel (dim 1)."""
    a = _channels(c)
    ch = (a.shape[1],)
    _per_channel(c, a, (1, 2), ch, a.dtype)
    st = stats_dtype(a.dtype)
    return [TensorMeta(a.shape, a.dtype), TensorMeta(ch, st), TensorMeta(ch, st)]


def _norm_grad(c: Call, stats: Shape) -> list[TensorMeta | None]:
    """batchnormgrad and groupnormgrad (A, G, weight, mean, var, ...) -> (dA, dweight, dbias)."""
    a = _channels(c)
    g = c.args[1]
    if g.shape != a.shape or g.dtype != a.dtype:
        raise DeepxError(f"{c.op.name}: the gradient '{c.names[1]}' is {g.dtype}{list(g.shape)}; expected "
                         f"{a.dtype}{list(a.shape)}, as '{c.names[0]}'")
    ch = (a.shape[1],)
    _per_channel(c, a, (2,), ch, a.dtype)
    _per_channel(c, a, (3, 4), stats, stats_dtype(a.dtype))
    return [TensorMeta(a.shape, a.dtype), TensorMeta(ch, a.dtype), TensorMeta(ch, a.dtype)]


def _batchnormeval(c: Call) -> list[TensorMeta | None]:
    """batchnormeval (A, weight, bias, mean, var, eps) -> (C): everything per channel."""
    a = _channels(c)
    ch = (a.shape[1],)
    _per_channel(c, a, (1, 2), ch, a.dtype)
    _per_channel(c, a, (3, 4), ch, stats_dtype(a.dtype))
    return [TensorMeta(a.shape, a.dtype)]


def _batchnormgrad(c: Call) -> list[TensorMeta | None]:
    return _norm_grad(c, (_channels(c).shape[1],))


def _groups(c: Call, arg: int) -> int:
    a, groups = _channels(c), int(c.args[arg])
    if groups < 1 or a.shape[1] % groups:
        raise DeepxError(f"{c.op.name}: {a.shape[1]} channels of '{c.names[0]}' do not split into groups={groups}")
    return groups


def _groupnorm(c: Call) -> list[TensorMeta | None]:
    """groupnorm (A, weight, bias, groups, eps) -> (C, mean, var): statistics per sample and group."""
    a = _channels(c)
    groups = _groups(c, 3)
    _per_channel(c, a, (1, 2), (a.shape[1],), a.dtype)
    st = stats_dtype(a.dtype)
    return [TensorMeta(a.shape, a.dtype), TensorMeta((a.shape[0], groups), st), TensorMeta((a.shape[0], groups), st)]


def _groupnormgrad(c: Call) -> list[TensorMeta | None]:
    return _norm_grad(c, (_channels(c).shape[0], _groups(c, 5)))


def _batchnormupdate(c: Call) -> list[TensorMeta | None]:
    """batchnormupdate (running_mean, running_var, mean, var, momentum, count) -> (running_mean, running_var)."""
    rm, mean = c.args[0], c.args[2]
    if len(rm.shape) != 1:
        raise DeepxError(f"batchnormupdate: running_mean '{c.names[0]}' must be 1-D (one value per channel), got "
                         f"{list(rm.shape)}")
    _per_channel(c, rm, (1,), rm.shape, rm.dtype)
    _per_channel(c, rm, (3,), rm.shape, mean.dtype)
    if mean.shape != rm.shape:
        raise DeepxError(f"batchnormupdate: mean '{c.names[2]}' has shape {list(mean.shape)}, the running "
                         f"statistics {list(rm.shape)}")
    momentum, count = c.args[4], c.args[5]
    if not 0.0 <= momentum <= 1.0:
        raise DeepxError(f"batchnormupdate: momentum={momentum} must be in [0, 1]")
    if count < 2:
        raise DeepxError(f"batchnormupdate: count={count} values per channel; the unbiased variance needs at least 2")
    for name, want in zip(c.out_names, c.names[:2]):
        if name != want:
            raise DeepxError(f"batchnormupdate: updates in place; return '{name}' should be '{want}'")
    return [TensorMeta(rm.shape, rm.dtype), TensorMeta(rm.shape, rm.dtype)]


def _scales(c: Call, first: int) -> None:
    for k in (first, first + 1):
        s = c.args[k]
        if not (s >= 0.0 and math.isfinite(s)):
            raise DeepxError(f"{c.op.name}: {c.op.args[k].name}={s} must be a finite scale factor >= 0 (0: none, "
                             "the sizes' ratio is used)")


def _spatial4(c: Call, what: str, shape: Shape, size: Sequence[int]) -> None:
    if len(shape) != 4 or len(size) != 2:
        raise DeepxError(f"{c.op.name}: {what} must be 4-D (N, C, H, W) with an output size of 2 (OH, OW), got "
                         f"{list(shape)} and {list(size)}")
    if any(d < 1 for d in (*shape[2:], *size)):
        raise DeepxError(f"{c.op.name}: input and output sizes should be greater than 0, got input "
                         f"{list(shape[2:])} and output {list(size)}")


def _interp(c: Call) -> list[TensorMeta | None]:
    """interpnearest and interpbilinear (A, size, ...) -> (C) of shape (N, C, *size)."""
    a, size = c.args[0], tuple(int(d) for d in c.args[1])
    _spatial4(c, f"'{c.names[0]}'", a.shape, size)
    _scales(c, len(c.args) - 2)
    return [TensorMeta((*a.shape[:2], *size), a.dtype)]


def _interpgrad(c: Call) -> list[TensorMeta | None]:
    """interpnearestgrad and interpbilineargrad (G, input_shape, ...) -> (dA) of shape input_shape."""
    g, shape = c.args[0], tuple(int(d) for d in c.args[1])
    _spatial4(c, "input_shape", shape, g.shape[2:])
    if len(g.shape) != 4 or g.shape[:2] != shape[:2]:
        raise DeepxError(f"{c.op.name}: the gradient '{c.names[0]}' has shape {list(g.shape)}, the input "
                         f"{list(shape)}: they must agree in N and C")
    _scales(c, len(c.args) - 2)
    return [TensorMeta(shape, g.dtype)]


# ---------------------------------------------------------------- the table

def t(name: str, dtypes: frozenset[str] | None = None) -> Arg:
    return Arg(name, "tensor", dtypes)


def v(name: str, vtype: str = "num", default: Any = _REQUIRED) -> Arg:
    return Arg(name, "var", None, vtype, default)


def vec(name: str) -> Arg:
    return Arg(name, "vector")


def lst(name: str, dtypes: frozenset[str] | None = None) -> Arg:
    return Arg(name, "listtensor", dtypes)


#: the functions a fused expression may call, and how many arguments each takes
FUSED_FUNCTIONS: dict[str, int] = {"sqrt": 1, "exp": 1, "log": 1, "sin": 1, "cos": 1, "tan": 1, "tanh": 1, "abs": 1,
                                   "maximum": 2, "minimum": 2, "floor": 1, "ceil": 1, "round": 1, "trunc": 1,
                                   "log1p": 1, "expm1": 1, "fmod": 2, "remainder": 2, "floordiv": 2}

_A, _B, _C = t("A"), t("B"), t("C")
_BOOL_OUT = t("C", frozenset({"bool"}))
_ANY = frozenset(STORABLE)

OPS: dict[str, OpDef] = {}


#: families whose kernels read and write each element at one index (an output may be an input's buffer)
ALIAS_SAFE_FAMILIES = frozenset({"elementwise", "compare", "optim", "fused", "expr", "init"})


def op(name: str, family: str, args: Sequence[Arg], returns: Sequence[Arg], dtypes: frozenset[str], infer: Infer,
       doc: str, *, grad: bool | Callable[..., Any] = False, deepxir: bool = True,
       expr: str = "", alias_safe: bool = False, effect: str | None = None, reads_returns: bool = False,
       numbers: Callable[[OpDef, Sequence[Any]], None] | None = None) -> OpDef:
    """Add an op to the catalogue. `grad`: True where autograd's GRAD_RULES has the op's rule, or the rule itself
    written on value handles (see OpDef.grad_rule). Family "expr" needs no kernel: its CPU and CUDA kernels evaluate
    `expr` (an elementwise op on float tensors, whose scalar args are vars). `effect`: what it does to its tensor
    returns, a kind of effects.py (derived where not given: see effects.declare); `reads_returns`: its result
    depends on a return as it was; `numbers`: see OpDef.numbers."""
    if name in OPS:
        raise ValueError(f"op {name} defined twice")
    if expr:
        check_expr(name, expr, args)
    elif family == "expr":
        raise ValueError(f"op {name}: family 'expr' needs an expression")
    d = OpDef(name, family, tuple(args), tuple(returns), frozenset(dtypes), infer, doc, bool(grad), deepxir,
              sum(a.required for a in args), sum(a.required for a in returns), expr,
              grad if callable(grad) else None, alias_safe or family in ALIAS_SAFE_FAMILIES,
              declare(effect, family, args, returns, reads_returns), numbers)
    OPS[name] = d
    return d


def remove_op(name: str) -> None:
    """Take an op out of the catalogue and out of every table derived from it (PerOp): for tests that add one."""
    del OPS[name]
    for table in PerOp.tables:
        table.pop(name, None)
    forget()


class PerOp(dict[str, Any]):
    """A table derived from the catalogue, one value per op (`fn(OPS[name])`), made on first use: an op added to
    OPS later gets its row as well. KeyError for a name that is not an op."""

    tables: list[PerOp] = []

    def __init__(self, fn: Callable[[OpDef], Any]) -> None:
        super().__init__()
        self.fn = fn
        PerOp.tables.append(self)

    def __missing__(self, name: str) -> Any:
        value = self[name] = self.fn(OPS[name])
        return value

    def get(self, name: str, default: Any = None) -> Any:  # type: ignore[override]
        try:
            return self[name]
        except KeyError:
            return default

    def __contains__(self, name: object) -> bool:
        return name in OPS



def _literal(value: Any) -> str:
    """A scalar as fused-expression text (a negative one in parentheses; infinities as 1e999)."""
    x = float(value)
    if x != x:
        return "(1e999 - 1e999)"
    text = repr(x) if abs(x) != float("inf") else "1e999"
    return f"({'-' if x < 0 and text[0] != '-' else ''}{text})" if x < 0 else text


def expr_instance(op: OpDef, args: Sequence[Any]) -> tuple[list[Any], str]:
    """An op of family "expr" bound to its resolved args, as a fused call: its tensor args in order, and its
    expression over in0, in1... with its scalar written in. What the CPU and CUDA kernels of such an op evaluate."""
    inputs: list[Any] = []
    scalar = "0"
    for a, value in zip(op.args, args):
        if a.kind == "tensor":
            inputs.append(value)
        else:
            scalar = _literal(value)
    return inputs, expr_template(op).format(*(f"in{k}" for k in range(len(inputs))), s=scalar)

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def check_expr(name: str, expr: str, args: Sequence[Arg]) -> None:
    """An op's expression names only its args (tensors, and at most one var) and the fused language's functions."""
    names = {a.name for a in args}
    used = set(_NAME.findall(expr)) - set(FUSED_FUNCTIONS)
    vars_ = [a for a in args if a.kind == "var"]
    if used - names or len(vars_) > 1 or any(a.kind not in ("tensor", "var") for a in args):
        raise ValueError(f"op {name}: expression {expr!r} must name only the op's tensor args and at most one var "
                         f"(args: {sorted(names)}; functions: {sorted(FUSED_FUNCTIONS)})")
    try:
        ast.parse(expr, mode="eval")
    except SyntaxError as e:
        raise ValueError(f"op {name}: expression {expr!r} does not parse: {e}") from None


def expr_template(op: OpDef) -> str:
    """`op.expr` with its tensor args as {0}, {1}... (in arg order) and its var as {s}: for str.format."""
    index: dict[str, str] = {}
    k = 0
    for a in op.args:
        if a.kind == "tensor":
            index[a.name] = f"{{{k}}}"
            k += 1
        else:
            index[a.name] = "{s}"
    return _NAME.sub(lambda m: index.get(m.group(0), m.group(0)), op.expr.replace("{", "{{").replace("}", "}}"))


# -- tensor life: create, copy, free, rename (they change the set of tensors; kernels get the store)
op("newtensor", "life", [Arg("shape", "shape")], [t("t", _ANY)], _ANY, _newtensor,
   "create t (zeros) with the given shape; its dtype is the return's precision (float32 when absent). An existing t "
   "of that shape and dtype is kept, values and all (with a warning); one of another shape or dtype is replaced, "
   "except a heap tensor, which is refused", effect=CREATES)
op("copytensor", "life", [t("src")], [t("dst")], _ANY, _copytensor, "copy src into dst (same shape and dtype)",
   grad=True)
op("deltensor", "life", [], [t("t")], _ANY, _deltensor, "free t", effect=DELETES)
op("renametensor", "life", [v("new_name", "str")], [t("t")], _ANY, _renametensor, "give t a new name",
   effect=RENAMES)
# -- variables: named scalars and vectors that later var/vector params may name
op("argset", "life", [v("value", "any")], [v("name", "str")], _ANY, nothing, "store a named scalar",
   effect=SETS)
op("vecset", "life", [vec("value")], [Arg("name", "vector")], _ANY, nothing, "store a named vector",
   effect=SETS)

# -- init: fill existing tensors
op("constant", "init", [v("value")], [t("t")], _ANY, existing, "fill t with value")
op("arange", "init", [v("start"), v("step")], [t("t")], NUMERIC, existing, "t.flat[i] = start + i * step")
op("uniform", "init", [v("low"), v("high"), v("seed", "int")], [t("t")], FLOATS, existing,
   "t ~ U[low, high); seed 0 means random")
op("normal", "init", [v("mean"), v("std"), v("seed", "int")], [t("t")], FLOATS, existing,
   "t ~ N(mean, std^2); seed 0 means random")
op("dropout", "init", [v("p"), v("seed", "int")], [t("A")], FLOATS, _dropout,
   "in place: zero each element with probability p, scale the kept ones by 1/(1-p)", grad=True)

# -- io: print to the executor's output, tensor files (docs/deepxir.md section 5)
op("print", "io", [t("t", _ANY), v("format", "str", "")], [], _ANY, nothing,
   "write t to the executor's output, elements in a printf format")
op("save", "io", [t("t", _ANY), v("path", "str")], [], _ANY, nothing, "write path.shape and path.data")
op("load", "io", [v("path", "str")], [Arg("t", "tensor", _ANY, default=None)], _ANY, nothing,
   "create a tensor from path.shape and path.data, named after the file's whole base name (or the return, "
   "when given)", effect=LOADS)
op("loadtensordata", "io", [v("path", "str")], [t("t", _ANY)], _ANY, existing,
   "read raw bytes from exactly path into the existing t", effect=FILLS)

# -- elementwise arithmetic; binary forms broadcast (numpy rules), dtypes must match, output dtype = input dtype
for _n, _d, _e in [("add", "A + B", "A + B"), ("sub", "A - B", "A - B"), ("mul", "A * B", "A * B"),
                   ("div", "A / B (integers: truncated)", "A / B"), ("max", "elementwise maximum", "maximum(A, B)"),
                   ("min", "elementwise minimum", "minimum(A, B)"), ("pow", "A ** B", "A ** B")]:
    op(_n, "elementwise", [_A, _B], [_C], NUMERIC, elementwise(0, 1), _d, grad=True, expr=_e)
for _n, _d, _e in [("addscalar", "A + s", "A + s"), ("subscalar", "A - s", "A - s"), ("mulscalar", "A * s", "A * s"),
                   ("divscalar", "A / s", "A / s"), ("powscalar", "A ** s", "A ** s"),
                   ("maxscalar", "max(A, s); relu is maxscalar(A, 0)", "maximum(A, s)"),
                   ("minscalar", "min(A, s)", "minimum(A, s)")]:
    op(_n, "elementwise", [_A, v("s")], [_C], NUMERIC, same(0), _d, grad=True, expr=_e)
for _n, _d in [("rsubscalar", "s - A"), ("rdivscalar", "s / A"), ("rpowscalar", "s ** A")]:
    op(_n, "elementwise", [v("s"), _A], [_C], NUMERIC, same(1), _d, grad=True, expr=_d)
for _n in ("sqrt", "exp", "log", "sin", "cos", "tan"):
    op(_n, "elementwise", [_A], [_C], FLOATS, same(0), f"{_n}(A)", expr=f"{_n}(A)",
       grad={"sqrt": lambda g, y: g / y * 0.5, "exp": lambda g, y: g * y, "log": lambda g, A: g / A}.get(_n, True))
op("invert", "elementwise", [_A], [_C], INTS | {"bool"}, same(0), "bitwise not (integers), logical not (bool)")
op("todtype", "elementwise", [t("A", _ANY)], [t("C", _ANY)], _ANY, _todtype,
   "cast A into C's dtype (a gradient flows between float dtypes only)", grad=True, reads_returns=True)

# -- comparisons, to a bool tensor; eps 0 means exact
op("less", "compare", [_A, _B], [_BOOL_OUT], NUMERIC, elementwise(0, 1, dtype="bool"), "A < B", expr="A < B")
op("greater", "compare", [_A, _B], [_BOOL_OUT], NUMERIC, elementwise(0, 1, dtype="bool"), "A > B", expr="A > B")
op("lessscalar", "compare", [_A, v("s")], [_BOOL_OUT], NUMERIC, same_as(0, "bool"), "A < s", expr="A < s")
op("greaterscalar", "compare", [_A, v("s")], [_BOOL_OUT], NUMERIC, same_as(0, "bool"), "A > s", expr="A > s")
op("equal", "compare", [_A, _B, v("eps", default=0)], [_BOOL_OUT], ALL, elementwise(0, 1, dtype="bool"),
   "|A - B| <= eps")
op("notequal", "compare", [_A, _B, v("eps", default=0)], [_BOOL_OUT], ALL, elementwise(0, 1, dtype="bool"),
   "|A - B| > eps")
op("equalscalar", "compare", [_A, v("s"), v("eps", default=0)], [_BOOL_OUT], ALL, same_as(0, "bool"),
   "|A - s| <= eps")
op("notequalscalar", "compare", [_A, v("s"), v("eps", default=0)], [_BOOL_OUT], ALL, same_as(0, "bool"),
   "|A - s| > eps")
op("switch", "compare", [lst("tensors", _ANY), t("cases", INTS | {"bool"})], [t("C", _ANY)], _ANY, _switch,
   "C[i] = tensors[cases[i]][i]; where(c, x, y) is switch([y x], c)", grad=True)

# -- matmul: batched over leading dims (which broadcast); authors cblas, cublas, miaobyte all reach the best kernel
op("matmul", "matmul", [_A, _B], [_C], NUMERIC, _matmul, "C = A @ B", grad=True)
op("matmultransposed", "matmul", [_A, _B, v("transpose_a", "bool", False), v("transpose_b", "bool", False)], [_C],
   FLOATS, _matmul, "C = A @ B, each operand read with its last two dims swapped where its flag is set; what the "
   "fold_transpose pass makes of a transpose that only a matmul reads", deepxir=False)

# -- change shape
op("reshape", "shape", [t("A", _ANY), vec("shape")], [t("B", _ANY)], _ANY, _reshape,
   "B = A viewed with a new shape (one -1 allowed); in place when B is A", grad=True)
op("transpose", "shape", [t("A", _ANY), vec("dim_order")], [t("C", _ANY)], _ANY, _transpose,
   "permute the dims", grad=True)
op("concat", "shape", [lst("tensors", _ANY), v("dim", "int")], [t("C", _ANY)], _ANY, _concat,
   "join along dim", grad=True)
op("broadcastTo", "shape", [t("A", _ANY), vec("new_shape")], [t("B", _ANY)], _ANY, _broadcast_to,
   "expand size-1 dims (and missing leading dims)", grad=True)
op("indexselect", "shape", [t("A", _ANY), t("index", INDEX), v("axis", "int")], [t("B", _ANY)], _ANY, _indexselect,
   "gather along axis: B.shape = A.shape[:axis] + index.shape + A.shape[axis+1:]", grad=True)
op("repeat", "shape", [t("A", _ANY), vec("repeats")], [t("B", _ANY)], _ANY, _repeat, "tile A", grad=True)

# -- reduce over dims (empty dims: every dim)
for _n, _d, _empty in [("sum", "sum", True), ("prod", "product", True), ("reducemax", "maximum", False),
                       ("reducemin", "minimum", False)]:
    op(_n, "reduce", [_A, vec("dims"), v("keepdims", "bool", False)], [t("B")], NUMERIC, _reduce(_empty),
       f"{_d} over dims", grad=True)

# ---------------------------------------------------------------- beyond deepxIR: what training needs
_F = FLOATS
# the stable sigmoid, as the kernels compute it to the bit: e = exp(-|A|), r = 1 / (1 + e), then r where A >= 0 and
# e * r below (maximum(e, A >= 0) is 1 or e); 1 / (1 + exp(-A)) underflows to 0 where the kernels keep e
_SIGMOID = "1 / (1 + exp(-abs(A))) * maximum(exp(-abs(A)), A >= 0)"
op("neg", "elementwise", [_A], [_C], NUMERIC, same(0), "-A", grad=lambda g: -g, deepxir=False, expr="-A")
op("abs", "elementwise", [_A], [_C], NUMERIC, same(0), "|A|", grad=True, deepxir=False, expr="abs(A)")
op("relu", "nn", [_A], [_C], _F, same(0), "max(A, 0)", grad=True, deepxir=False, expr="maximum(A, 0)",
   alias_safe=True)
op("sigmoid", "nn", [_A], [_C], _F, same(0), "1 / (1 + exp(-A))", grad=lambda g, y: g * (y * (1 - y)), deepxir=False,
   expr=_SIGMOID, alias_safe=True)
op("tanh", "nn", [_A], [_C], _F, same(0), "tanh(A)", grad=lambda g, y: g * (1 - y * y), deepxir=False, expr="tanh(A)",
   alias_safe=True)
op("gelu", "nn", [_A, v("approximate", "str", "none")], [_C], _F, same(0),
   "A * Phi(A) (approximate='none', exact erf) or its tanh form (approximate='tanh')", grad=True, deepxir=False,
   alias_safe=True)
op("gelugrad", "nn", [_A, t("g"), v("approximate", "str", "none")], [_C], _F, _gelugrad,
   "gelu's gradient for upstream gradient g: g (Phi(A) + A phi(A)), or the tanh form's derivative; what autograd "
   "emits", deepxir=False, alias_safe=True)
op("erf", "nn", [_A], [_C], _F, same(0), "the Gauss error function erf(A)", grad=True, deepxir=False)
op("silu", "nn", [_A], [_C], _F, same(0), "A * sigmoid(A)", grad=True, deepxir=False, expr=f"A * ({_SIGMOID})",
   alias_safe=True)
# -- rounding to whole numbers (a step: its gradient is zero, as torch's) and log/exp accurate near 0
for _n, _d in [("floor", "the largest whole number <= A"), ("ceil", "the smallest whole number >= A"),
               ("round", "A rounded to the nearest whole number, halves to even (torch.round)"),
               ("trunc", "A rounded toward zero")]:
    op(_n, "elementwise", [_A], [_C], _F, same(0), _d, grad=True, deepxir=False, expr=f"{_n}(A)")
# -- division rounded to whole quotients, as torch's (and Python's) on floats: fmod truncates (C's fmod, exact),
# remainder takes B's sign, floordiv is (A - fmod(A, B)) / B rounded down (x / 0 where B is 0); the SDK computes
# integers' from div, which truncates. Their gradients are torch's: 1 for A, minus the whole quotient for B
# (trunc(A / B), A // B); floordiv is a step (zero, as torch's div with rounding_mode='floor')
for _n, _d, _g, _gs, _gr in [
        ("fmod", "the remainder of A / B truncated toward zero (C's fmod; the sign of A)",
         lambda g, A, B: (g, -g * (A / B).trunc()), lambda g: g, lambda g, s, A: -g * (s / A).trunc()),
        ("remainder", "A - B * floor(A / B), exact: fmod(A, B), plus B where that is non-zero and its sign is not B's",
         lambda g, A, B: (g, -g * (A // B)), lambda g: g, lambda g, s, A: -g * (s // A)),
        ("floordiv", "A / B rounded toward minus infinity, from the exact fmod (Python's float //)", True, True,
         True)]:
    op(_n, "elementwise", [_A, _B], [_C], _F, elementwise(0, 1), _d, grad=_g, deepxir=False, expr=f"{_n}(A, B)")
    op(f"{_n}scalar", "elementwise", [_A, v("s")], [_C], _F, same(0), f"{_n}(A, s)", grad=_gs, deepxir=False,
       expr=f"{_n}(A, s)")
    op(f"r{_n}scalar", "elementwise", [v("s"), _A], [_C], _F, same(1), f"{_n}(s, A)", grad=_gr, deepxir=False,
       expr=f"{_n}(s, A)")
op("log1p", "elementwise", [_A], [_C], _F, same(0), "log(1 + A), accurate near 0", grad=lambda g, A: g / (1 + A),
   deepxir=False, expr="log1p(A)")
op("expm1", "elementwise", [_A], [_C], _F, same(0), "exp(A) - 1, accurate near 0", grad=lambda g, y: g * (y + 1),
   deepxir=False, expr="expm1(A)")
op("softmax", "nn", [_A, v("dim", "int", -1)], [_C], _F, _along_dim, "exp(A) / sum(exp(A)) along dim, stable",
   grad=True, deepxir=False)
op("logsoftmax", "nn", [_A, v("dim", "int", -1)], [_C], _F, _along_dim, "A - logsumexp(A) along dim, stable",
   grad=True, deepxir=False)
op("crossentropy", "nn", [t("logits"), t("labels", INDEX), v("ignore_index", "int", -100),
                          v("reduction", "str", "mean")], [t("loss")], _F, _crossentropy,
   "-log_softmax(logits)[i, labels[i]], averaged over labels != ignore_index (or summed, or per row)",
   grad=True, deepxir=False)
op("crossentropygrad", "nn", [t("logits"), t("labels", INDEX), t("g"), v("ignore_index", "int", -100),
                              v("reduction", "str", "mean")], [t("dlogits")], _F, _crossentropygrad,
   "crossentropy's gradient for upstream gradient g: (softmax(logits) - onehot(labels)) on rows whose label is kept, "
   "times g (divided by their count for mean; g[i] per row for none); what autograd emits for the CPU",
   deepxir=False)
op("mse", "nn", [_A, _B, v("reduction", "str", "mean")], [t("loss")], _F, _mse, "mean((A - B)^2)", grad=True,
   deepxir=False)
op("layernorm", "nn", [_A, t("weight"), t("bias"), v("eps", default=1e-5)], [_C], _F, _norm,
   "normalize over the trailing dims of weight's shape, then * weight + bias", grad=True, deepxir=False)
op("rmsnorm", "nn", [_A, t("weight"), v("eps", default=1e-6)], [_C], _F, _norm,
   "A / sqrt(mean(A^2) + eps) * weight over the trailing dims of weight's shape", grad=True, deepxir=False)
op("layernormgrad", "nn", [_A, t("weight"), t("G"), v("eps", default=1e-5)], [t("dA"), t("xhat")], _F, _normgrad,
   "layernorm's gradient for A from the gradient G of its result, one pass per row: with xhat = (A - mean) rstd "
   "over weight's trailing dims and d = G weight, dA = rstd (d - mean(d) - xhat mean(d xhat)); xhat too (weight's "
   "gradient is sum(G xhat)); what autograd emits", deepxir=False)
op("rmsnormgrad", "nn", [_A, t("weight"), t("G"), v("eps", default=1e-6)], [t("dA"), t("xr")], _F, _normgrad,
   "rmsnorm's gradient for A from the gradient G of its result, one pass per row: with r = 1 / sqrt(mean(A^2) + "
   "eps) over weight's trailing dims, xr = A r and d = G weight, dA = r (d - xr mean(d xr)); xr too (weight's "
   "gradient is sum(G xr)); what autograd emits", deepxir=False)
_LSE = frozenset({"float32", "float64"})
op("attention", "attention", [t("q"), t("k"), t("v"), v("scale"), v("causal", "bool", False)], [_C, t("lse", _LSE)],
   _F, _attention,
   "scaled dot-product attention in one op: C = softmax(q k^T * scale) v over the last two dims, and each row's "
   "logsumexp lse = log(sum(exp(q k^T * scale))) (float32, float64 for float64); q (..., Tq, D), k (..., Tk, D), v "
   "(..., Tk, Dv); causal: query i sees keys j <= i (torch's is_causal, aligned top-left); k and v may have fewer "
   "heads (dim -3) than q, a divisor (query head h reads head h // (Hq / Hk): torch's enable_gqa)",
   grad=True, deepxir=False)
op("attentiongrad", "attention", [t("q"), t("k"), t("v"), t("C"), t("lse", _LSE), t("g"), v("scale"),
                                  v("causal", "bool", False)], [t("dq"), t("dk"), t("dv")], _F, _attentiongrad,
   "attention's gradients for upstream gradient g of its result C, from the probabilities recomputed with lse "
   "(FlashAttention-2's scheme): with P = exp(q k^T * scale - lse) and D = rowsum(g C), dv = P^T g, "
   "dS = P (g v^T - D), dq = dS k * scale, dk = dS^T q * scale (summed over a key head's query heads); what "
   "autograd emits", deepxir=False)
_MASK = t("mask", frozenset({"bool", *_F}))
op("maskedattention", "attention", [t("q"), t("k"), t("v"), _MASK, v("scale")], [_C, t("lse", _LSE)], _F,
   _maskedattention,
   "attention under a mask: C = softmax(q k^T * scale + mask) v, lse as attention's; mask broadcasts to (..., Hq, "
   "Tq, Tk), bool (True: the key takes part, torch's attn_mask) or q's dtype (added); a row whose every key is "
   "masked gives zeros and lse -inf (torch's safe softmax); grouped heads as attention's; no gradient for the mask",
   grad=True, deepxir=False)
op("maskedattentiongrad", "attention", [t("q"), t("k"), t("v"), _MASK, t("C"), t("lse", _LSE), t("g"), v("scale")],
   [t("dq"), t("dk"), t("dv")], _F, _maskedattentiongrad,
   "maskedattention's gradients for q, k and v, as attentiongrad's with the mask added to the recomputed scores; what "
   "autograd emits", deepxir=False)
_CONV = [vec("stride"), vec("padding"), vec("dilation"), v("groups", "int", 1)]
op("conv2d", "conv", [_A, t("weight"), *_CONV], [_C], _F, _conv2d,
   "C[n, o] = sum over c (of o's group), i, j of weight[o, c, i, j] A_padded[n, c, y*stride + i*dilation, ...]: "
   "A (N, C, H, W), weight (O, C / groups, kh, kw), C (N, O, Hout, Wout), as torch's conv2d without its bias",
   grad=True, deepxir=False)
op("conv2dgradinput", "conv", [t("G"), t("weight"), vec("input_shape"), *_CONV], [t("dA")], _F, _conv2dgrad(True),
   "conv2d's gradient for its input A (of shape input_shape) from the gradient G of its result", deepxir=False)
op("conv2dgradweight", "conv", [_A, t("G"), vec("weight_shape"), *_CONV], [t("dweight")], _F, _conv2dgrad(False),
   "conv2d's gradient for its weight (of shape weight_shape) from its input A and the gradient G of its result",
   deepxir=False)
op("argmax", "reduce", [_A, v("dim", "int"), v("keepdims", "bool", False)], [t("B", frozenset({"int64"}))], NUMERIC,
   _argreduce, "index of the maximum along dim (the first on ties)", deepxir=False)
op("cumsum", "reduce", [_A, v("dim", "int"), v("reverse", "bool", False)], [_C], NUMERIC, _along_dim,
   "running sums along dim, from the end where reverse (low-precision floats add in float32, float32 in float64, "
   "integers in int64, then round into C)", grad=True, deepxir=False)
op("cumprod", "reduce", [_A, v("dim", "int")], [_C], NUMERIC, _along_dim,
   "running products along dim (low-precision floats multiply in float32, float32 in float64, integers in int64, "
   "then round into C)", grad=True, deepxir=False)
op("cumprodgrad", "reduce", [_A, t("G"), v("dim", "int")], [t("dA")], FLOATS, _cumprodgrad,
   "cumprod's gradient for its input A from the gradient G of its result: dA[i] = the sum over j >= i of G[j] times "
   "the product of A[k] for k <= j, k != i (along dim; right where A holds zeros, as torch's)", deepxir=False)
op("argsort", "sort", [_A, v("dim", "int", -1), v("descending", "bool", False)], [t("B", frozenset({"int64"}))],
   NUMERIC, _argsort, "the indices that sort A along dim, ascending or descending; stable (ties keep their order) "
   "with nan the largest and -0.0 equal to 0.0, as torch.sort(stable=True)", deepxir=False)
op("argtopk", "sort", [_A, v("k", "int"), v("dim", "int", -1), v("largest", "bool", True)],
   [t("B", frozenset({"int64"}))], NUMERIC, _argtopk,
   "the indices of the k largest (or smallest) elements along dim, in order: argsort's first k (ties: the first)",
   deepxir=False)
op("argmin", "reduce", [_A, v("dim", "int"), v("keepdims", "bool", False)], [t("B", frozenset({"int64"}))], NUMERIC,
   _argreduce, "index of the minimum along dim (the first on ties)", deepxir=False)
op("slice", "shape", [t("A", _ANY), vec("starts"), vec("ends"), vec("steps")], [t("B", _ANY)], _ANY, _slice,
   "B = A[starts:ends:steps] per dim, Python semantics (negative starts/ends count from the end), steps > 0",
   grad=True, deepxir=False)
op("sliceassign", "shape", [t("A", _ANY), vec("starts"), vec("ends"), vec("steps"), t("V", _ANY)], [t("C", _ANY)],
   _ANY, _sliceassign, "C = A with C[starts:ends:steps] = V (V broadcasts); in place when C is A", grad=True,
   deepxir=False, alias_safe=True)
op("pad", "shape", [t("A", _ANY), vec("pads"), v("value", default=0)], [t("B", _ANY)], _ANY, _pad,
   "constant padding; pads = [before0, after0, before1, after1, ...]", grad=True, deepxir=False)
op("indexadd", "shape", [t("A"), t("index", INDEX), t("src"), v("axis", "int")], [t("C")], NUMERIC, _indexadd,
   "C = A, then C[.., index[j], ..] += src[.., j, ..] along axis (repeated indices accumulate)", grad=True,
   deepxir=False, alias_safe=True)
op("indexcopy", "shape", [t("A", _ANY), t("index", INDEX), t("src", _ANY), v("axis", "int")], [t("C", _ANY)], _ANY,
   _indexadd, "C = A, then C[.., index[j], ..] = src[.., j, ..] along axis (where indices repeat, one of the writes "
   "is kept: the last on the CPU); in place when C is A", grad=True, deepxir=False, alias_safe=True)
op("gather", "shape", [t("A", _ANY), t("index", INDEX), v("dim", "int")], [t("B", _ANY)], _ANY, _gather,
   "B[i][j] = A[index[i][j]][j] for dim 0 (any rank): B has index's shape, which may be smaller than A's outside dim",
   grad=True, deepxir=False)
op("scatter", "shape", [t("A", _ANY), t("index", INDEX), t("src", _ANY), v("dim", "int")], [t("C", _ANY)], _ANY,
   _scatter, "C = A, then C[index[i][j]][j] = src[i][j] for dim 0 (src has index's shape; where indices repeat, one "
   "of the writes is kept: the last on the CPU)", grad=True, deepxir=False)
op("scatteradd", "shape", [t("A"), t("index", INDEX), t("src"), v("dim", "int")], [t("C")], NUMERIC, _scatter,
   "C = A, then C[index[i][j]][j] += src[i][j] for dim 0 (src has index's shape; repeated indices accumulate)",
   grad=True, deepxir=False)
_POOL = [vec("kernel"), vec("stride"), vec("dilation")]
op("maxpool2d", "conv", [_A, *_POOL], [_C], _F, _pool2d,
   "C[n, c, y, x] = the maximum of A[n, c, y*stride + i*dilation, x*stride + j*dilation] over the window (i, j) "
   "(NaN wins); A is padded already (by -inf: the SDK's max_pool2d)", grad=True, deepxir=False)
op("maxpool2dgrad", "conv", [_A, t("G"), *_POOL], [t("dA")], _F, _pool2dgrad(0),
   "maxpool2d's gradient: each window's G goes to the first position (row by row) holding its maximum, or to its "
   "last NaN where it holds any (torch's choice)",
   deepxir=False)
op("sumpool2d", "conv", [_A, *_POOL], [_C], _F, _pool2d,
   "C[n, c, y, x] = the sum of A[n, c, y*stride + i*dilation, x*stride + j*dilation] over the window (i, j) "
   "(float32 sums for 16-bit floats); the SDK's avg_pool2d divides it by the window's count", grad=True,
   deepxir=False)
op("sumpool2dgrad", "conv", [t("G"), vec("input_shape"), *_POOL], [t("dA")], _F, _pool2dgrad(1),
   "sumpool2d's gradient: each input position gets the sum of G over the windows that read it", deepxir=False)
# -- norms over channels with their statistics (deepxd/kernels/cpu/norm.py): the forward returns the mean and the
# biased variance its backward reads (in stats_dtype: float32 for the 16-bit floats), batchnormupdate folds them into
# the running statistics as torch does
_STATS = frozenset({"float32", "float64"})
op("batchnorm", "norm", [_A, t("weight"), t("bias"), v("eps", default=1e-5)],
   [_C, t("mean", _STATS), t("var", _STATS)], _F, _batchnorm,
   "A (N, C, ...) normalised per channel by the batch's statistics over N and the spatial dims, then * weight + bias "
   "(weight and bias (C,)); mean and var (the biased variance) are those statistics (C,), as torch's training batch "
   "norm", grad=True, deepxir=False)
op("batchnormeval", "norm", [_A, t("weight"), t("bias"), t("mean", _STATS), t("var", _STATS),
                             v("eps", default=1e-5)], [_C], _F, _batchnormeval,
   "A (N, C, ...) normalised per channel by given statistics (the running ones: torch's batch norm in eval), "
   "(A - mean) / sqrt(var + eps) * weight + bias", grad=True, deepxir=False)
op("batchnormgrad", "norm", [_A, t("G"), t("weight"), t("mean", _STATS), t("var", _STATS), v("eps", default=1e-5),
                             v("batch", "bool", True)],
   [t("dA"), t("dweight"), t("dbias")], _F, _batchnormgrad,
   "batchnorm's gradients from the gradient G of its result and its statistics: with xh = (A - mean) / "
   "sqrt(var + eps), dbias = sum(G), dweight = sum(G xh) (over all but dim 1), dA = weight / sqrt(var + eps) (G - "
   "dbias / n - xh dweight / n), n the values per channel; batchnormeval's (batch false: the statistics are given, "
   "not the batch's), dA = G weight / sqrt(var + eps)", deepxir=False)
op("batchnormupdate", "norm", [t("running_mean"), t("running_var"), t("mean", _STATS), t("var", _STATS),
                               v("momentum"), v("count", "int")],
   [t("running_mean"), t("running_var")], _F, _batchnormupdate,
   "the running statistics, in place, as torch's training batch norm updates them: running_mean = momentum * mean + "
   "(1 - momentum) * running_mean, running_var likewise with var * count / (count - 1) (the unbiased variance of "
   "count values per channel); computed in float64, rounded once", deepxir=False, effect=FILLS, alias_safe=True)
op("groupnorm", "norm", [_A, t("weight"), t("bias"), v("groups", "int"), v("eps", default=1e-5)],
   [_C, t("mean", _STATS), t("var", _STATS)], _F, _groupnorm,
   "A (N, C, ...) normalised over each sample's group of C / groups channels (and the spatial dims), then * weight + "
   "bias per channel; mean and var (the biased variance) are the statistics (N, groups), as torch's group_norm",
   grad=True, deepxir=False)
op("groupnormgrad", "norm", [_A, t("G"), t("weight"), t("mean", _STATS), t("var", _STATS), v("groups", "int"),
                             v("eps", default=1e-5)],
   [t("dA"), t("dweight"), t("dbias")], _F, _groupnormgrad,
   "groupnorm's gradients from the gradient G of its result and its statistics: with xh = (A - mean) / sqrt(var + "
   "eps) and d = G weight, dA = (d - mean(d) - xh mean(d xh)) / sqrt(var + eps) (means over each sample's group), "
   "dweight = sum(G xh), dbias = sum(G) (over all but dim 1)", deepxir=False)
# -- resizing the spatial dims as torch's interpolate (deepxd/kernels/cpu/resize.py); scale_h and scale_w are the
# scale factors interpolate was given (0: none), which torch's source positions follow
_SCALES = [v("scale_h", default=0.0), v("scale_w", default=0.0)]
op("interpnearest", "resize", [_A, vec("size"), *_SCALES], [_C], _F, _interp,
   "C[n, c, y, x] = A[n, c, min(floor(y * sh), H - 1), min(floor(x * sw), W - 1)] for A (N, C, H, W) and C (N, C, "
   "*size), sh = 1 / scale_h (H / OH where 0) in float32 as torch's mode='nearest'", grad=True, deepxir=False)
op("interpnearestgrad", "resize", [t("G"), vec("input_shape"), *_SCALES], [t("dA")], _F, _interpgrad,
   "interpnearest's gradient: each input position gets the sum of G over the outputs that read it", deepxir=False)
op("interpbilinear", "resize", [_A, vec("size"), v("align_corners", "bool", False), *_SCALES], [_C], _F, _interp,
   "bilinear resize of A (N, C, H, W) to (N, C, *size) as torch's interpolate(mode='bilinear'): each output the "
   "weighted sum of its 2 x 2 neighbours at source position y * (H - 1) / (OH - 1) (align_corners) or (y + 0.5) sh "
   "- 0.5 clamped at 0, sh = 1 / scale_h (H / OH where 0)", grad=True, deepxir=False)
op("interpbilineargrad", "resize", [t("G"), vec("input_shape"), v("align_corners", "bool", False), *_SCALES],
   [t("dA")], _F, _interpgrad,
   "interpbilinear's gradient: each output's G scattered to its 2 x 2 neighbours with their weights, added",
   deepxir=False)
op("sgd", "optim", [t("param"), t("grad"), t("momentum_buffer"), v("lr"), v("momentum", default=0.0),
                    v("dampening", default=0.0), v("weight_decay", default=0.0), v("nesterov", "bool", False),
                    v("step", "int", 1)],
   [t("param"), t("momentum_buffer")], _F, _update(1),
   "torch.optim.SGD's update, in place; step is 1 on the first call (the buffer then starts as the gradient)",
   deepxir=False, numbers=_update_numbers)
for _n, _d in [("adam", "torch.optim.Adam's update (L2 weight decay), in place; step counts from 1"),
               ("adamw", "torch.optim.AdamW's update (decoupled weight decay), in place; step counts from 1")]:
    op(_n, "optim", [t("param"), t("grad"), t("exp_avg"), t("exp_avg_sq"), v("lr"), v("beta1", default=0.9),
                     v("beta2", default=0.999), v("eps", default=1e-8),
                     v("weight_decay", default=0.0 if _n == "adam" else 0.01), v("step", "int", 1)],
       [t("param"), t("exp_avg"), t("exp_avg_sq")], _F, _update(2), _d, deepxir=False, numbers=_update_numbers)


# -- collectives: the ranks of a process group combine their tensors (deepx_sdk.distributed; docs/distributed.md).
# `group` names a process group this rank joined through its daemon; every rank runs the same collectives in the
# same order. The daemon runs them (deepxd/comm.py: a ring over the peer links); `world` is the group's size, given
# so that the result's shape is known when the program is checked.

#: how all_reduce and reduce_scatter combine the ranks' tensors (torch.distributed.ReduceOp's, `mean` for AVG)
REDUCE_OPS = ("sum", "mean", "max", "min", "product")


def _group_arg(c: Call, i: int) -> str:
    group = c.args[i]
    if not group or any(ch.isspace() or ch in ":,()[]" for ch in group):
        raise DeepxError(f"{c.op.name}: group {group!r} is not a process group's name (a non-empty string without "
                         "whitespace, ':', ',', brackets or parentheses)")
    return str(group)


def _reduce_arg(c: Call, i: int, dtype: str) -> str:
    how = c.args[i]
    if how not in REDUCE_OPS:
        raise DeepxError(f"{c.op.name}: op {how!r} is not one of {', '.join(REDUCE_OPS)}")
    if how == "mean" and dtype not in FLOATS:
        raise DeepxError(f"{c.op.name}: the mean of '{c.names[0]}' ({dtype}) is not an integer; use op sum")
    return str(how)


def _world_arg(c: Call, i: int) -> int:
    world = c.args[i]
    if world < 1:
        raise DeepxError(f"{c.op.name}: world {world} must be the group's size, at least 1")
    return int(world)


def _allreduce(c: Call) -> list[TensorMeta | None]:
    a = c.args[0]
    _reduce_arg(c, 1, a.dtype)
    _group_arg(c, 2)
    return [TensorMeta(a.shape, a.dtype)]


def _broadcast(c: Call) -> list[TensorMeta | None]:
    if c.args[1] < 0:
        raise DeepxError(f"{c.op.name}: src {c.args[1]} is not a rank")
    _group_arg(c, 2)
    return [TensorMeta(c.args[0].shape, c.args[0].dtype)]


def _allgather(c: Call) -> list[TensorMeta | None]:
    a = c.args[0]
    world = _world_arg(c, 1)
    _group_arg(c, 2)
    if not a.shape:
        raise DeepxError(f"allgather: '{c.names[0]}' is 0-d; the ranks' tensors are joined along dim 0 (reshape "
                         "it to [1])")
    return [TensorMeta((a.shape[0] * world, *a.shape[1:]), a.dtype)]


def _reducescatter(c: Call) -> list[TensorMeta | None]:
    a = c.args[0]
    world = _world_arg(c, 1)
    _reduce_arg(c, 2, a.dtype)
    _group_arg(c, 3)
    if not a.shape or a.shape[0] % world:
        raise DeepxError(f"reducescatter: '{c.names[0]}' of shape {list(a.shape)} cannot be split into {world} "
                         "equal blocks along dim 0")
    return [TensorMeta((a.shape[0] // world, *a.shape[1:]), a.dtype)]


_GROUP = v("group", "str", "default")
op("allreduce", "collective", [_A, v("op", "str", "sum"), _GROUP], [_C], NUMERIC, _allreduce,
   "C = the ranks' A combined elementwise by op (sum, mean, max, min, product): the same C on every rank",
   grad=True, deepxir=False)
op("broadcast", "collective", [_A, v("src", "int"), _GROUP], [_C], NUMERIC, _broadcast,
   "C = rank src's A, on every rank", deepxir=False)
op("allgather", "collective", [_A, v("world", "int"), _GROUP], [_C], NUMERIC, _allgather,
   "C = the ranks' A joined along dim 0 in rank order (world: the group's size)", grad=True, deepxir=False)
op("reducescatter", "collective", [_A, v("world", "int"), v("op", "str", "sum"), _GROUP], [_C], NUMERIC,
   _reducescatter, "C on rank r = block r (of world, along dim 0) of the ranks' A combined by op", grad=True,
   deepxir=False)

# -- fused: what the compiler's fuse pass makes of a chain or tree of elementwise ops (deepxd/compiler/fuse.py)

_FUSED_NODES = (ast.Expression, ast.BinOp, ast.UnaryOp, ast.Call, ast.Name, ast.Constant, ast.Load, ast.Add, ast.Sub,
                ast.Mult, ast.Div, ast.Pow, ast.USub, ast.UAdd, ast.Compare, ast.Gt, ast.Lt, ast.GtE, ast.LtE,
                ast.Eq, ast.NotEq)
_FUSED_INPUT = re.compile(r"in(0|[1-9][0-9]*)\Z")
_FUSED_MAX_CHARS = 20000
_fused_parsed: Cache[tuple[str, int], ast.Expression] = Cache("ir.fused_parsed", 4096)


def parse_fused(expr: str, n_inputs: int) -> ast.Expression:
    """The syntax tree of a fused expression, checked: numbers, the inputs in0..in<n-1>, + - * / ** and unary -,
    the calls of FUSED_FUNCTIONS, and one comparison (> < >= <= == !=) at a time, which is 1 where it holds and 0
    where not (gradient masks: `in0 * (in1 > 0)`). It is also a numexpr expression with the same meaning, but for
    fmod, remainder and floordiv, which numexpr lacks."""
    key = (expr, n_inputs)
    tree = _fused_parsed.get(key)
    if tree is not None:
        return tree
    if not isinstance(expr, str) or not expr.strip():
        raise DeepxError(f"fused: the expression must be a non-empty string, got {expr!r}")
    if len(expr) > _FUSED_MAX_CHARS:
        raise DeepxError(f"fused: the expression has {len(expr)} characters (at most {_FUSED_MAX_CHARS})")
    try:
        tree = ast.parse(expr.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        raise DeepxError(f"fused: cannot parse the expression {expr!r}: {e}") from None
    called: set[int] = set()
    for node in ast.walk(tree):
        if not isinstance(node, _FUSED_NODES):
            raise DeepxError(f"fused: {type(node).__name__} ({ast.unparse(node) if isinstance(node, ast.expr) else ''}"
                             f") is not allowed in {expr!r}; use numbers, in0..in{n_inputs - 1}, + - * / **, "
                             f"comparisons and {', '.join(FUSED_FUNCTIONS)}")
        if isinstance(node, ast.Call):
            name = node.func.id if isinstance(node.func, ast.Name) else ""
            if name not in FUSED_FUNCTIONS or node.keywords or len(node.args) != FUSED_FUNCTIONS[name]:
                raise DeepxError(f"fused: call {ast.unparse(node)!r} in {expr!r}: use "
                                 + ", ".join(f"{f}/{n}" for f, n in FUSED_FUNCTIONS.items()))
            called.add(id(node.func))
        elif isinstance(node, ast.Name) and id(node) not in called:
            m = _FUSED_INPUT.match(node.id)
            if m is None or int(m.group(1)) >= n_inputs:
                raise DeepxError(f"fused: unknown name {node.id!r} in {expr!r}; the {n_inputs} inputs are "
                                 f"in0..in{n_inputs - 1}")
        elif isinstance(node, ast.Constant) and type(node.value) not in (int, float):
            raise DeepxError(f"fused: constant {node.value!r} in {expr!r} is not a number")
        elif isinstance(node, ast.Compare) and len(node.ops) != 1:
            raise DeepxError(f"fused: {ast.unparse(node)!r} in {expr!r} chains comparisons; compare two values")
    _fused_parsed.put(key, tree)
    return tree


def _fused(c: Call) -> list[TensorMeta | None]:
    metas, names = c.args[0], c.names[0]
    op = c.op.name
    if not metas:
        raise DeepxError(f"{op}: the input list is empty")
    dt = metas[0].dtype
    for m, n in zip(metas, names):
        if m.dtype != dt:
            raise DeepxError(f"{op}: inputs differ in dtype ({dt} of '{names[0]}' and {m.dtype} of '{n}')")
    parse_fused(c.args[1], len(metas))
    return [TensorMeta(broadcast(op, *(m.shape for m in metas), names=names), dt)]


def _fusedcolsum(c: Call) -> list[TensorMeta | None]:
    (out,) = _fused(c)
    assert out is not None
    if len(out.shape) != 2:
        raise DeepxError(f"fusedcolsum: the result '{c.out_names[0]}' would be {list(out.shape)}; it must be a "
                         "matrix, whose rows the sums add up")
    sums = str(c.out_names[1])
    if sums == str(c.out_names[0]) or sums in c.names[0]:
        raise DeepxError(f"fusedcolsum: the sums '{sums}' must be a tensor of their own, neither the result nor an "
                         "input (they are written while the inputs are read)")
    return [out, TensorMeta((1, out.shape[1]) if c.args[2] else (out.shape[1],), out.dtype)]


op("fused", "fused", [lst("inputs"), v("expr", "str")], [_C], _F, _fused,
   "C = expr over the inputs in0, in1, ... (broadcast; one float dtype, float16 and bfloat16 computed in float32); "
   "expr is a numexpr expression of numbers, + - * / **, unary -, one comparison at a time (1 where it holds, 0 "
   "where not), sqrt exp log sin cos tan tanh abs maximum minimum floor ceil round (halves to even) trunc log1p "
   "expm1, and fmod remainder floordiv (which numexpr lacks: the numpy backend runs them); made by the fuse pass "
   "from a chain or tree of elementwise ops", grad=True, deepxir=False)
op("fusedcolsum", "fused", [lst("inputs"), v("expr", "str"), v("keepdims", "bool", False)], [_C, t("S")],
   frozenset({"float32", "float64"}), _fusedcolsum,
   "C = expr over the inputs, as fused computes it, and S = C summed over axis 0 (its rows), in one pass; what the "
   "fuse_colsum pass makes of a fused whose result a sum over axis 0 reads next (a bias's gradient)", deepxir=False)


# ---------------------------------------------------------------- checking an instruction

_INT_RE = re.compile(r"[+-]?\d+\Z")
_FLOAT_RE = re.compile(r"[+-]?(\d+\.?\d*([eE][+-]?\d+)?|\.\d+([eE][+-]?\d+)?|inf|nan|infinity)\Z", re.I)


def literal(text: str) -> Any:
    """The value of an untyped literal: bool, int, float, or the text itself."""
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    if _INT_RE.match(text):
        return int(text)
    if _FLOAT_RE.match(text):
        return float(text)
    return text


def _vector_text(text: str) -> tuple[Any, ...] | None:
    s = text.strip()
    if s.startswith("[") and s.endswith("]"):
        return tuple(literal(x) for x in s[1:-1].replace(",", " ").split())
    return None


def tensor_list(value: Any) -> list[str] | None:
    """The tensor names a listtensor parameter's value names, as bind reads them (`[01 u]` names '1' and 'u');
    None when it is not a list."""
    items = value if isinstance(value, tuple) else _vector_text(str(value))
    return None if items is None else [str(x) for x in items]


def _describe(p: Param) -> str:
    from deepx_core.ir.text import format_param

    return format_param(p)


def _var(op: OpDef, a: Arg, p: Param, env: Env | None) -> Any:
    value = p.value
    if hasattr(value, "item") and not isinstance(value, (str, tuple)):  # a numpy scalar
        value = value.item()
    if p.category == "":
        value = literal(str(value)) if a.vtype != "str" else value
    if a.vtype == "str":
        return value if isinstance(value, str) else _describe(p).split(":", 1)[-1]
    if a.vtype == "any":
        return value
    if isinstance(value, str):
        if a.vtype == "bool" and value.lower() in ("true", "false"):
            return value.lower() == "true"
        stored = env.var(value) if env is not None else None
        if stored is None:
            raise DeepxError(f"{op.name}: {a.name}={value!r} is not a {_VTYPE[a.vtype]} and no variable of that "
                             "name is set (argset)")
        value = stored
    if a.vtype == "bool":
        if isinstance(value, bool) or value in (0, 1):
            return bool(value)
        raise DeepxError(f"{op.name}: {a.name} must be true or false, got {value!r}")
    if isinstance(value, bool):  # docs/deepxir.md: a var literal is a number or true/false (`var<bool>:True`)
        value = int(value)
    elif not isinstance(value, (int, float)):
        raise DeepxError(f"{op.name}: {a.name} must be a {_VTYPE[a.vtype]}, got {value!r}")
    if a.vtype == "int":
        if isinstance(value, float):
            if not value.is_integer():
                raise DeepxError(f"{op.name}: {a.name} must be an integer, got {value!r}")
            return int(value)
    return value


_VTYPE = {"num": "number", "int": "integer", "bool": "boolean", "str": "string"}


def _vector(op: OpDef, a: Arg, p: Param, env: Env | None) -> tuple[Any, ...]:
    value = p.value
    if a.kind == "shape" and isinstance(value, (int, float)) and not isinstance(value, bool):
        value = (value,)  # newtensor (var<int32>:5): a 1-d shape
    if isinstance(value, list):
        value = tuple(value)
    if isinstance(value, str):
        parsed = _vector_text(value)
        if parsed is None and env is not None:  # a name: the vector vecset stored (`x` too, which reads as `[]`)
            parsed = env.vector(value)
        if parsed is None and a.kind == "shape" and value.strip():
            parsed = tuple(literal(x) for x in re.split(r"[\s,x]+", value.strip()) if x)
            if not all(isinstance(x, (int, float)) for x in parsed):
                parsed = None
        if parsed is None:
            raise DeepxError(f"{op.name}: {a.name}={value!r} is not a vector and no vector of that name is set "
                             "(vecset)")
        value = parsed
    if not isinstance(value, tuple):
        raise DeepxError(f"{op.name}: {a.name} must be a vector like [2 3], got {value!r}")
    out = []
    for x in value:
        if isinstance(x, bool) or not isinstance(x, (int, float)) or (isinstance(x, float) and not x.is_integer()):
            raise DeepxError(f"{op.name}: {a.name} must hold integers, got {list(value)}")
        out.append(int(x))
    return tuple(out)


_KINDS = {"tensor": ("tensor",), "var": ("var",), "vector": ("vector",), "listtensor": ("listtensor",),
          "shape": ("vector", "var")}


def _check_kind(op: OpDef, a: Arg, p: Param, pos: str) -> None:
    if p.category and p.category != a.kind and p.category not in _KINDS[a.kind]:
        raise DeepxError(f"{op.name}: {pos} '{a.name}' must be a {a.kind}, got {_describe(p)}")


def _arity_error(op: OpDef, given: int, spec: tuple[Arg, ...], what: str) -> DeepxError:
    need = sum(a.required for a in spec)
    names = ", ".join(a.name if a.required else f"[{a.name}]" for a in spec)
    count = str(need) if need == len(spec) else f"{need} to {len(spec)}"
    return DeepxError(f"{op.name}: expects {count} {what} ({names}), got {given}")


def _tensor(op: OpDef, a: Arg, name: Any, env: Env, pos: str) -> TensorMeta:
    meta = env.meta(name)
    if meta is None:
        raise DeepxError(f"{op.name}: {pos} tensor '{name}' not found")
    if meta is not UNKNOWN and meta.dtype not in (a.dtypes or op.dtypes):
        raise DeepxError(
            f"{op.name}: dtype {meta.dtype} of '{name}' is not supported (supported: {_fmt(a.dtypes or op.dtypes)})"
        )
    return meta


def bind(instr: Instr, env: Env) -> Bound:
    """Check `instr` against its catalogue entry and `env`; resolve its params; infer its outputs.

    Raises DeepxError naming the op, the operands and the problem.
    """
    op = OPS.get(instr.name)
    if op is None:
        raise DeepxError(f"op '{instr.name}' not found")
    if not op.min_args <= len(instr.args) <= len(op.args):
        raise _arity_error(op, len(instr.args), op.args, "arguments")
    if not op.min_returns <= len(instr.returns) <= len(op.returns):
        raise _arity_error(op, len(instr.returns), op.returns, "returns")
    args: list[Any] = []
    names: list[Any] = []
    unknown = False
    params = instr.args
    n = len(params)
    meta_of = env.meta
    for i, a in enumerate(op.args):
        if i >= n:
            args.append(a.default)
            names.append(None)
            continue
        p = params[i]
        kind = a.kind
        if p.category and p.category != kind:
            _check_kind(op, a, p, "argument")
        if kind == "tensor":
            name = p.value if type(p.value) is str else str(p.value)
            meta = meta_of(name)
            if meta is None or (meta is not UNKNOWN and meta.dtype not in (a.dtypes or op.dtypes)):
                meta = _tensor(op, a, name, env, "argument")
            unknown |= meta is UNKNOWN
            args.append(meta)
            names.append(name)
        elif kind == "listtensor":
            items = tensor_list(p.value)
            if items is None:
                raise DeepxError(f"{op.name}: {a.name} must be a tensor list like [a b], got {_describe(p)}")
            metas = [_tensor(op, a, x, env, "argument") for x in items]
            unknown |= any(m is UNKNOWN for m in metas)
            args.append(metas)
            names.append(items)
        elif kind == "vector" or kind == "shape":
            args.append(_vector(op, a, p, env))
            names.append(None)
        else:
            args.append(_var(op, a, p, env))
            names.append(None)
    outs: list[TensorMeta | None] = []
    out_dtypes: list[str] = []
    out_names: list[Any] = []
    for i, a in enumerate(op.returns):
        if i >= len(instr.returns):
            continue
        p = instr.returns[i]
        _check_kind(op, a, p, "return")
        name = p.value if type(p.value) is str else str(p.value)
        out_names.append(name)
        out_dtypes.append(p.dtype)
        outs.append(meta_of(name) if a.kind == "tensor" else None)
    if unknown:
        return Bound(op, instr, args, names, [UNKNOWN if a.kind == "tensor" else None for a in op.returns],
                     out_names)
    inferred = op.infer(Call(op, args, names, outs, out_dtypes, out_names, instr.meta))
    read = None
    for i, (want, have) in enumerate(zip(inferred, outs)):
        if want is None or have is None or have is UNKNOWN or op.family == "life":
            continue
        if read is None:  # an output that is also an input (one of a list's too) is replaced, whatever it was
            read = {x for n in names for x in (n if type(n) is list else (n,))}
        if have.shape != want.shape and out_names[i] not in read and op.name != "reshape":
            raise DeepxError(
                f"{op.name}: output '{out_names[i]}' has shape {have.shape}, but the result has shape {want.shape}"
            )
        if have.dtype != want.dtype and out_names[i] not in read:
            raise DeepxError(
                f"{op.name}: output '{out_names[i]}' is {have.dtype}, but the result is {want.dtype}"
            )
    return Bound(op, instr, args, names, inferred, out_names, _nbytes(op, inferred, out_names))


def rebind_numbers(old: Bound, instr: Instr) -> Bound:
    """`old` for `instr`, the same instruction but for its numbers (an optimizer update's step count, a schedule's
    learning rate): its scalar arguments read and checked as `bind` reads them, and the op's rule run on them with
    the metas `old` holds (its `numbers` check alone where it has one), without looking its tensors up again.
    DeepxError as `bind` raises it; a number given as a variable's name is refused here (the caller binds such an
    instruction whole)."""
    op = old.op
    params, before = instr.args, old.instr.args
    args = list(old.args)
    for i, a in enumerate(op.args):
        if a.kind in ("var", "") and i < len(params):
            p = params[i]
            # the very param old was bound from, a number (the SDK records an unchanged one as the same object)
            if i < len(before) and p is before[i] and type(p.value) is not str:
                continue
            args[i] = _var(op, a, p, None)
    if args == old.args:
        return old._replace(instr=instr)
    if op.numbers is not None:  # its results' metas are its tensors' alone, as old holds them
        op.numbers(op, args)
        return old._replace(instr=instr, args=args)
    out_dtypes = [p.dtype for p in instr.returns]
    inferred = op.infer(Call(op, args, old.names, list(old.outs), out_dtypes, old.out_names, instr.meta))
    nbytes = old.nbytes if inferred == old.outs else _nbytes(op, inferred, old.out_names)
    return Bound(op, instr, args, old.names, inferred, old.out_names, nbytes)


class SymbolicEnv:
    """Tensor metas and variables as a program would leave them: checks a program without running it."""

    def __init__(self, tensors: dict[str, TensorMeta] | None = None, variables: dict[str, Any] | None = None,
                 vectors: dict[str, tuple[Any, ...]] | None = None, base: Env | None = None) -> None:
        self.tensors: dict[str, TensorMeta | None] = dict(tensors or {})
        self.variables = dict(variables or {})
        self.vectors = dict(vectors or {})
        self.base = base

    def meta(self, name: str) -> TensorMeta | None:
        if name in self.tensors:
            return self.tensors[name]
        return self.base.meta(name) if self.base is not None else None

    def var(self, name: str) -> Any:
        if name in self.variables:
            return self.variables[name]
        return self.base.var(name) if self.base is not None else None

    def vector(self, name: str) -> tuple[Any, ...] | None:
        if name in self.vectors:
            return self.vectors[name]
        return self.base.vector(name) if self.base is not None else None

    def apply(self, b: Bound) -> None:
        """Record what `b` does to the set of tensors and variables."""
        apply_effect(b, self.tensors, self.variables, self.vectors, self.meta, True)


def load_name(path: str) -> str:
    """The tensor name that `load` gives a file: its whole base name, dots included."""
    return path.replace("\\", "/").rstrip("/").rsplit("/", 1)[-1]


class ProgramError(DeepxError):
    """A program refused by `check_program`: `index` is the 0-based position of the bad instruction."""

    def __init__(self, message: str, index: int) -> None:
        super().__init__(message)
        self.index = index


def check_program(instrs: Iterable[Instr], env: Env, cache: BindCache | None = None) -> list[Bound]:
    """Check every instruction in order, as the program would run, before any runs.

    Raises ProgramError ("instruction 3: add: ...", with .index) for the first bad one."""
    bind_one = cache.bind if cache is not None else bind
    if isinstance(instrs, (list, tuple)) and len(instrs) == 1:
        try:  # one instruction: nothing runs before it, so the live state is the state it runs on
            return [bind_one(instrs[0], env)]
        except DeepxError as e:
            raise ProgramError(f"instruction 1: {e}", 0) from None
    check = ProgramCheck(instrs, env, cache)
    check.step()
    return check.bound


class ProgramCheck:
    """check_program in steps (a long program's, between which its worker does other work): `step(until)` checks
    instructions, in order, until the perf_counter passes `until` (looked at every 256) or all are checked, which it
    says. The env's tensors that the program names must stay as they are from the first step to the last."""

    def __init__(self, instrs: Iterable[Instr], env: Env, cache: BindCache | None = None) -> None:
        self.instrs = instrs if isinstance(instrs, (list, tuple)) else list(instrs)
        self.bind_one = cache.bind if cache is not None else bind
        self.sym = SymbolicEnv(base=env)
        self.bound: list[Bound] = []

    def step(self, until: float = math.inf) -> bool:
        sym, bind_one, bound, instrs = self.sym, self.bind_one, self.bound, self.instrs
        tensors, variables, vectors, before = sym.tensors, sym.variables, sym.vectors, sym.meta
        clock = time.perf_counter
        for i in range(len(bound), len(instrs)):
            try:
                b = bind_one(instrs[i], sym)
                apply_effect(b, tensors, variables, vectors, before, True)
            except DeepxError as e:
                raise ProgramError(f"instruction {i + 1}: {e}", i) from None
            bound.append(b)
            if not i & 255 and clock() > until:
                return len(bound) == len(instrs)
        return True


def _cacheable(b: Bound) -> bool:
    """A checked instruction whose outcome depends only on the metas of its tensors (no named variables, no
    change to the set of tensors), so that it can be reused while those metas hold."""
    if not b.op.effect.pure or b.op.family == "life":
        return False
    for a, p in zip(b.op.args, b.instr.args):
        if a.kind in ("var", "vector", "shape") and a.vtype not in ("str", "any") and isinstance(p.value, str):
            return False
    return True


def _same_scalars(a: Instr, b: Instr) -> bool:
    """Equal params can still differ where Python's == is loose: 1 == 1.0 == True, 0.0 == -0.0."""
    if a is b:
        return True
    for p, q in zip(a.args, b.args):
        if p.category in ("var", "") and (type(p.value) is not type(q.value) or
                                          (type(p.value) is float and repr(p.value) != repr(q.value))):
            return False
    return True


_NEWTENSOR = OPS["newtensor"]


class BindCache:
    """Remembers checked instructions: a training loop sends the same instructions every step, and checking one
    again costs a few dict lookups instead of the whole of `bind`."""

    def __init__(self, size: int = 8192, owner: str = "") -> None:
        self._plans: Cache[tuple[Any, ...], tuple[Bound, tuple[tuple[str, TensorMeta | None], ...],
                                                  tuple[tuple[str, TensorMeta | None, TensorMeta | None], ...]]] = (
            Cache("executor.binds", size, owner=owner))

    def bind(self, instr: Instr, env: Env) -> Bound:
        key = instr[:3]  # metadata (ids, timestamps) does not change what an instruction does
        try:
            plan = self._plans.get(key)
        except TypeError:  # lists inside: not hashable, check it the long way
            return bind(instr, env)
        if plan is not None and not _same_scalars(plan[0].instr, instr):
            plan = None
        if plan is not None:
            b, ins, outs = plan
            if b.instr.meta != instr.meta:  # benchmark.repeat and error messages read the instruction
                if b.op is _NEWTENSOR and b.instr.get_meta("exists") != instr.get_meta("exists"):
                    return bind(instr, env)  # its rule reads exists=keep
                b = b._replace(instr=instr)
            meta = env.meta
            for name, m in ins:
                if meta(name) != m:
                    break
            else:
                for name, before, after in outs:
                    cur = meta(name)
                    if cur != after and cur != before:
                        break
                else:
                    return b
        b = bind(instr, env)
        if _cacheable(b):
            ins_list: list[tuple[str, TensorMeta | None]] = []
            for a, n, m in zip(b.op.args, b.names, b.args):
                if a.kind == "tensor":
                    ins_list.append((n, m))
                elif a.kind == "listtensor":
                    ins_list.extend(zip(n, m))
            outs_t = tuple((str(n), env.meta(str(n)), m) for n, m in zip(b.out_names, b.outs) if m is not None)
            self._plans.put(key, (b, tuple(ins_list), outs_t))
        return b

    def clear(self) -> None:
        self._plans.clear()
