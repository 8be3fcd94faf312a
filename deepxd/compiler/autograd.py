"""Autograd as an IR rewrite: from a forward program, the deepxIR instructions that compute its gradients.

`grad_program(forward, loss, wrt, env)` walks the forward program once (checking it with `bind` over a
`SymbolicEnv`, with a version per write of a name, so that in-place writes and reused names are told apart), finds
the instructions that lie on a path from a tensor in `wrt` to `loss`, and walks them backwards, asking the rule of
each op (`GRAD_RULES`, one small function per op, whose docstring is its formula: docs/ir.md shows it in the op's
row) for instructions that turn the gradient of its output into gradients of its inputs. Rules emit only ops of the
catalogue; every op the catalogue flags differentiable has one (tests/compiler/test_grad_rules.py holds it).
Gradients of a value read several times are summed; broadcasting is undone by `sum` over the broadcast dims and a
`reshape`. Every intermediate gets a fresh name that starts with `prefix`, and is deleted (`deltensor`) right after
its last use. docs/compiler.md tells the whole story.

The backward reads forward values (inputs, and for some rules outputs) by name: they must still hold the values the
forward program computed, i.e. neither be overwritten nor deleted later in the forward program; otherwise the rule
that needs one raises DeepxError.
"""

from __future__ import annotations

import ast
import inspect
import math
from collections.abc import Callable, Sequence
from typing import Any

from deepx_core.errors import DeepxError
from deepx_core.ir.dtypes import FLOATS
from deepx_core.ir.effects import DELETES, FILLS
from deepx_core.ir.instr import Instr, Param
from deepx_core.ir.ops import OPS, UNKNOWN, Bound, Env, PerOp, SymbolicEnv, TensorMeta, bind, check_program, parse_fused

Key = tuple[str, int]  # a value: (tensor name, version); version 0 is the tensor as it is before the program


class _Node:
    """One forward instruction, bound: the value keys of its inputs and of its outputs.

    `ins[i]` is the value read by tensor arg i (None for other args); after one entry per arg come the extra reads:
    the tensor an in-place op reads before writing it (dropout), then the items of each tensor list
    (`lists[i]` is where list arg i's items start). `in_metas` gives each input's shape and dtype."""

    def __init__(self, b: Bound, ins: list[Key | None], in_metas: list[TensorMeta | None], outs: list[Key | None],
                 lists: dict[int, int]) -> None:
        self.b = b
        self.ins = ins
        self.in_metas = in_metas
        self.outs = outs
        self.lists = lists


class Grad:
    """What a rule sees: the forward instruction, and an emitter for backward instructions."""

    def __init__(self, builder: _Builder, node: _Node) -> None:
        self._builder = builder
        self.node = node
        self.b = node.b
        self.op = node.b.op.name

    # -- reading the forward program
    def arg(self, i: int) -> Any:
        """The resolved value of arg i (scalars, vectors, strings)."""
        return self.b.args[i]

    def meta(self, i: int) -> TensorMeta:
        """The shape and dtype of input i (a tensor arg, or an extra read: see `item`)."""
        m = self.node.in_metas[i]
        assert m is not None
        return m

    def out_meta(self, i: int = 0) -> TensorMeta:
        return self.b.outs[i]  # type: ignore[return-value]

    def x(self, i: int) -> str:
        """The name of forward input i; it must still hold the value the instruction read."""
        key = self.node.ins[i]
        assert key is not None
        return self._builder.available(key, self.op)

    def item(self, i: int, j: int) -> int:
        """The input index of item j of tensor-list arg i (for x, meta, needs and the rule's result)."""
        return self.node.lists[i] + j

    def items(self, i: int) -> list[int]:
        """The input indices of every item of tensor-list arg i."""
        return [self.node.lists[i] + j for j in range(len(self.b.args[i]))]

    def y(self, i: int = 0) -> str:
        """The name of forward output i; it must still hold the value the instruction wrote."""
        key = self.node.outs[i]
        assert key is not None
        return self._builder.available(key, self.op)

    def needs(self, i: int) -> bool:
        """Does tensor arg i need a gradient (it is reachable from wrt)?"""
        key = self.node.ins[i]
        return key is not None and key in self._builder.reachable

    def transposed(self, i: int) -> str:
        """Input i (at least 2-d) transposed over its last two dims: the tensor the forward transposed to make it,
        when it still holds that value (a Linear's W for its W^T), else a transpose emitted here."""
        bld, key = self._builder, self.node.ins[i]
        rank = len(self.meta(i).shape)
        node = bld.made.get(key) if key is not None and rank >= 2 else None
        if node is not None and node.b.op.name == "transpose" and node.ins[0] is not None:
            src_name, src_ver = node.ins[0]
            perm = tuple(int(d) % rank for d in node.b.args[1])
            if (perm == _swap_last(rank) and src_name not in bld.deleted
                    and bld.version.get(src_name, 0) == src_ver):
                return src_name
        return self.emit("transpose", self.x(i), _swap_last(rank))

    # -- emitting
    def emit(self, op: str, *args: Any, dtype: str | None = None) -> str:
        """Append `op (args) -> (fresh)`; tensor args are names (str), the rest scalars, tuples (vectors). Returns the
        fresh output's name."""
        return self._builder.emit(op, args, dtype=dtype)

    def emit_all(self, op: str, *args: Any) -> list[str]:
        """Append `op (args) -> (fresh, fresh, ...)`, an op with several returns; their names, in order (the
        caller uses what it needs: the rest are deleted after it)."""
        return self._builder.emit_all(op, args)

    def unbroadcast(self, g: str, meta: TensorMeta) -> str:
        return self._builder.unbroadcast(g, meta)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._builder.meta(name).shape

    def shape_dtype(self, name: str) -> str:
        return self._builder.meta(name).dtype

    def filled(self, meta: TensorMeta, value: float) -> str:
        """A fresh tensor of meta's shape and dtype, every element `value`."""
        return self._builder.filled(meta, value)


Rule = Callable[[Grad, str], dict[int, str]]

#: op name -> rule(grad, g) giving {tensor arg index: gradient name}; `g` is the gradient of output 0
GRAD_RULES: dict[str, Rule] = {}


def rule(*names: str) -> Callable[[Rule], Rule]:
    def deco(fn: Rule) -> Rule:
        for n in names:
            if n not in OPS:
                raise ValueError(f"gradient rule for unknown op {n}")
            GRAD_RULES[n] = fn
        return fn

    return deco


class Handle:
    """A value in a gradient rule written as maths (OpDef.grad_rule): arithmetic with handles and numbers, `-h`,
    `abs(h)`, `h ** s`, comparisons with a number (a 0/1 mask of h's dtype) and h.exp(), .log(), .sqrt(), .tanh(),
    .sigmoid() emit the catalogue's instructions; binary ops broadcast as the ops do."""

    __slots__ = ("gr", "name")

    def __init__(self, gr: Grad, name: str) -> None:
        self.gr = gr
        self.name = name

    def _emit(self, op: str, *args: Any) -> Handle:
        return Handle(self.gr, self.gr.emit(op, *args))

    def _with(self, other: Any, op: str, scalar_op: str) -> Handle:
        if isinstance(other, Handle):
            return self._emit(op, self.name, other.name)
        return self._emit(scalar_op, self.name, float(other))

    def __add__(self, other: Any) -> Handle:
        return self._with(other, "add", "addscalar")

    __radd__ = __add__

    def __mul__(self, other: Any) -> Handle:
        return self._with(other, "mul", "mulscalar")

    __rmul__ = __mul__

    def __sub__(self, other: Any) -> Handle:
        return self._with(other, "sub", "subscalar")

    def __rsub__(self, other: Any) -> Handle:
        return self._emit("rsubscalar", float(other), self.name)

    def __truediv__(self, other: Any) -> Handle:
        return self._with(other, "div", "divscalar")

    def __rtruediv__(self, other: Any) -> Handle:
        return self._emit("rdivscalar", float(other), self.name)

    def __floordiv__(self, other: Any) -> Handle:
        return self._with(other, "floordiv", "floordivscalar")

    def __rfloordiv__(self, other: Any) -> Handle:
        return self._emit("rfloordivscalar", float(other), self.name)

    def __pow__(self, other: Any) -> Handle:
        return self._with(other, "pow", "powscalar")

    def __neg__(self) -> Handle:
        return self._emit("neg", self.name)

    def __abs__(self) -> Handle:
        return self._emit("abs", self.name)

    def _mask(self, op: str, s: float) -> Handle:
        return Handle(self.gr, self.gr.emit("todtype", self.gr.emit(op, self.name, float(s)),
                                            dtype=self.gr.shape_dtype(self.name)))

    def __gt__(self, s: float) -> Handle:  # type: ignore[override]
        return self._mask("greaterscalar", s)

    def __lt__(self, s: float) -> Handle:  # type: ignore[override]
        return self._mask("lessscalar", s)

    def exp(self) -> Handle:
        return self._emit("exp", self.name)

    def log(self) -> Handle:
        return self._emit("log", self.name)

    def sqrt(self) -> Handle:
        return self._emit("sqrt", self.name)

    def tanh(self) -> Handle:
        return self._emit("tanh", self.name)

    def sigmoid(self) -> Handle:
        return self._emit("sigmoid", self.name)

    def floor(self) -> Handle:
        return self._emit("floor", self.name)

    def trunc(self) -> Handle:
        return self._emit("trunc", self.name)


def handle_rule(fn: Callable[..., Any]) -> Rule:
    """A rule written on value handles (OpDef.grad_rule) as a GRAD_RULES rule. `fn`'s parameters are named: `g` (the
    output's gradient), the op's args by their catalogue names (tensors as handles, vars as values) and `y` (the
    output); it returns one gradient per tensor arg, in order (a tuple, or the gradient alone where there is one
    tensor arg; None for an arg with none). Each is summed over its broadcast dims."""
    params = list(inspect.signature(fn).parameters)

    def rule(gr: Grad, g: str) -> dict[int, str]:
        op = gr.b.op
        tensors = [i for i, a in enumerate(op.args) if a.kind == "tensor"]
        by_name: dict[str, Any] = {"g": Handle(gr, g)}
        if "y" in params:
            by_name["y"] = Handle(gr, gr.y())
        for i, a in enumerate(op.args):
            if a.name in params:
                by_name[a.name] = Handle(gr, gr.x(i)) if a.kind == "tensor" else gr.arg(i)
        result = fn(*(by_name[p] for p in params))
        grads = result if isinstance(result, tuple) else (result,)
        if len(grads) != len(tensors):
            raise DeepxError(f"autograd: the rule of {op.name} gave {len(grads)} gradients for {len(tensors)} "
                             "tensor args")
        return {i: gr.unbroadcast(h.name, gr.meta(i)) for i, h in zip(tensors, grads)
                if h is not None and gr.needs(i)}

    rule.__doc__ = fn.__doc__
    return rule


class _Sym:
    """A value in a rule written on handles, run on symbols: the rule's formula as text (for docs/ir.md)."""

    def __init__(self, text: str, prec: int = 100) -> None:
        self.text, self.prec = text, prec

    @staticmethod
    def _of(x: Any, need: int) -> str:
        if isinstance(x, _Sym):
            return x.text if x.prec >= need else f"({x.text})"
        return f"{x:g}" if isinstance(x, float) else str(x)

    def _bin(self, other: Any, sym: str, prec: int, right: bool = False) -> _Sym:
        a, b = (other, self) if right else (self, other)
        return _Sym(f"{self._of(a, prec)} {sym} {self._of(b, prec + 1)}", prec)

    def __add__(self, o: Any) -> _Sym:
        return self._bin(o, "+", 50)

    def __radd__(self, o: Any) -> _Sym:
        return self._bin(o, "+", 50, True)

    def __sub__(self, o: Any) -> _Sym:
        return self._bin(o, "-", 50)

    def __rsub__(self, o: Any) -> _Sym:
        return self._bin(o, "-", 50, True)

    def __mul__(self, o: Any) -> _Sym:
        return self._bin(o, "*", 60)

    def __rmul__(self, o: Any) -> _Sym:
        return self._bin(o, "*", 60, True)

    def __truediv__(self, o: Any) -> _Sym:
        return self._bin(o, "/", 60)

    def __rtruediv__(self, o: Any) -> _Sym:
        return self._bin(o, "/", 60, True)

    def __floordiv__(self, o: Any) -> _Sym:
        return self._bin(o, "//", 60)

    def __rfloordiv__(self, o: Any) -> _Sym:
        return self._bin(o, "//", 60, True)

    def __pow__(self, o: Any) -> _Sym:
        return _Sym(f"{self._of(self, 100)}^{self._of(o, 100)}", 80)

    def __neg__(self) -> _Sym:
        return _Sym(f"-{self._of(self, 70)}", 70)

    def __abs__(self) -> _Sym:
        return _Sym(f"|{self.text}|")

    def __gt__(self, s: float) -> _Sym:  # type: ignore[override]
        return _Sym(f"[{self.text} > {self._of(s, 0)}]")

    def __lt__(self, s: float) -> _Sym:  # type: ignore[override]
        return _Sym(f"[{self.text} < {self._of(s, 0)}]")

    def __getattr__(self, fn: str) -> Callable[[], _Sym]:
        return lambda: _Sym(f"{fn}({self.text})")


def rule_formula(name: str) -> str:
    """The formula of op `name`'s gradient rule, for docs: a rule on handles run on symbols (dA = g * y), else the
    GRAD_RULES rule's docstring; "" where the op has no rule."""
    op = OPS[name]
    if op.grad_rule is None:
        fn = GRAD_RULES.get(name)
        return " ".join((fn.__doc__ or "yes").split()) if fn is not None else ""
    params = list(inspect.signature(op.grad_rule).parameters)
    args = {a.name: (_Sym(a.name) if a.kind == "tensor" else a.name) for a in op.args}
    result = op.grad_rule(*(_Sym(p) if p in ("g", "y") else args[p] for p in params))
    grads = result if isinstance(result, tuple) else (result,)
    tensors = [a.name for a in op.args if a.kind == "tensor"]
    return ", ".join(f"d{t} = {g.text}" for t, g in zip(tensors, grads) if g is not None)


_HANDLE_RULES: PerOp = PerOp(lambda op: handle_rule(op.grad_rule) if op.grad_rule is not None else None)


def grad_rule(name: str) -> Rule | None:
    """The gradient rule of op `name`: its own, from the op table (OpDef.grad_rule), or GRAD_RULES'; None where it
    has none."""
    return _HANDLE_RULES.get(name) or GRAD_RULES.get(name)


class _Builder:
    def __init__(self, forward: Sequence[Instr], env: Env, prefix: str) -> None:
        self.prefix = prefix
        self.env = env
        self.sym = SymbolicEnv(base=env)
        self.version: dict[str, int] = {}
        self.deleted: set[str] = set()
        self.nodes: list[_Node] = []
        self.made: dict[Key, _Node] = {}  # value -> the forward instruction that wrote it
        self.reachable: set[Key] = set()
        self.out: list[Instr] = []
        self.created: set[str] = set()
        self.taken: set[str] = set()
        self._n = 0
        for instr in forward:
            for p in (*instr.args, *instr.returns):
                if p.category in ("tensor", "listtensor", ""):
                    vals = p.value if isinstance(p.value, tuple) else (p.value,)
                    self.taken.update(str(v) for v in vals)
        for i, instr in enumerate(forward):
            try:
                b = bind(instr, self.sym)
            except DeepxError as e:
                raise DeepxError(f"autograd: forward instruction {i + 1}: {e}") from None
            ins: list[Key | None] = []
            in_metas: list[TensorMeta | None] = []
            for a, n, m in zip(b.op.args, b.names, b.args):
                if a.kind == "tensor":
                    ins.append((n, self.version.get(n, 0)))
                    in_metas.append(m)
                else:
                    ins.append(None)
                    in_metas.append(None)
            if b.op.differentiable and b.op.effect.kind is FILLS:  # dropout: reads the tensor it writes
                ins.append((b.out_names[0], self.version.get(b.out_names[0], 0)))
                in_metas.append(self.sym.meta(b.out_names[0]))
            lists: dict[int, int] = {}
            for i, (a, n, m) in enumerate(zip(b.op.args, b.names, b.args)):
                if a.kind == "listtensor":
                    lists[i] = len(ins)
                    ins.extend((x, self.version.get(x, 0)) for x in n)
                    in_metas.extend(m)
            self.sym.apply(b)
            outs: list[Key | None] = []
            for a, n in zip(b.op.returns, b.out_names):
                if a.kind != "tensor":
                    outs.append(None)
                    continue
                self.version[n] = self.version.get(n, 0) + 1
                if b.op.effect.kind is DELETES:
                    self.deleted.add(n)
                    outs.append(None)
                else:
                    self.deleted.discard(n)
                    outs.append((n, self.version[n]))
            node = _Node(b, ins, in_metas, outs, lists)
            self.nodes.append(node)
            for k in outs:
                if k is not None:
                    self.made[k] = node

    # -- forward values
    def current(self, name: str) -> Key:
        return (name, self.version.get(name, 0))

    def available(self, key: Key, op: str) -> str:
        name, ver = key
        if name in self.deleted or self.version.get(name, 0) != ver:
            what = "deletes" if name in self.deleted else "overwrites"
            raise DeepxError(
                f"autograd: the gradient of {op} needs the value of '{name}', which the forward program {what} later; "
                "keep it (or write the later value under another name). From the SDK: the tensor was written in "
                "place after the op read it (an in-place op, under no_grad too, or an optimizer's step), as torch's "
                "'modified by an inplace operation': compute the loss again after the write, or clone() the value "
                "before it"
            )
        return name

    def meta(self, name: str) -> TensorMeta:
        m = self.sym.meta(name)
        if m is None or m is UNKNOWN:
            raise DeepxError(f"autograd: the shape of tensor '{name}' is not known")
        return m

    # -- emitting
    def fresh(self) -> str:
        while True:
            self._n += 1
            name = f"{self.prefix}{self._n}"
            if name not in self.taken and self.sym.meta(name) is None:
                self.taken.add(name)
                return name

    def _param(self, a: Any) -> Param:
        if isinstance(a, Param):
            return a
        if isinstance(a, str):
            return Param.tensor(a, self.meta(a).dtype)
        if isinstance(a, tuple):
            return Param.vector(a)
        if isinstance(a, float):
            return Param.var(a, "float64")
        return Param.var(a)

    def append(self, instr: Instr) -> None:
        try:
            b = bind(instr, self.sym)
        except DeepxError as e:  # a rule that emits a bad instruction: a bug here, said plainly
            raise DeepxError(f"autograd: emitted an invalid instruction ({instr.name}): {e}") from None
        self.sym.apply(b)
        self.out.append(instr)

    def emit(self, op: str, args: Sequence[Any], *, dtype: str | None = None) -> str:
        name = self.fresh()
        params = tuple(self._param(a) for a in args)
        if dtype is None:
            probe = bind(Instr(op, params, (Param.tensor(name),)), self.sym)
            dtype = probe.outs[0].dtype  # type: ignore[union-attr]
        self.append(Instr(op, params, (Param.tensor(name, dtype),)))
        self.created.add(name)
        return name

    def emit_all(self, op: str, args: Sequence[Any]) -> list[str]:
        params = tuple(self._param(a) for a in args)
        names = [self.fresh() for _ in OPS[op].returns]
        probe = bind(Instr(op, params, tuple(Param.tensor(n) for n in names)), self.sym)
        self.append(Instr(op, params, tuple(Param.tensor(n, m.dtype) for n, m in zip(names, probe.outs)
                                            if m is not None)))
        self.created.update(names)
        return names

    def filled(self, meta: TensorMeta, value: float) -> str:
        name = self.fresh()
        out = (Param.tensor(name, meta.dtype),)
        self.append(Instr("newtensor", (Param.vector(meta.shape),), out))
        self.append(Instr("constant", (Param.var(float(value), "float64"),), out))
        self.created.add(name)
        return name

    def unbroadcast(self, g: str, meta: TensorMeta) -> str:
        """Sum g (broadcast from a tensor of meta's shape) back to meta's shape."""
        gshape = self.meta(g).shape
        target = meta.shape
        if gshape == target:
            return g
        lead = len(gshape) - len(target)
        inner = [i + lead for i, d in enumerate(target) if d == 1 and gshape[i + lead] != 1]
        if lead and not inner and gshape[lead:] == target:  # a bias's: the leading dims summed away, no reshape
            return self.emit("sum", [g, tuple(range(lead)), False])
        dims = list(range(lead)) + inner
        if dims:
            g = self.emit("sum", [g, tuple(dims), True])
        if self.meta(g).shape != target:
            g = self.emit("reshape", [g, tuple(target)])
        return g

    def accumulate(self, grads: dict[Key, str], key: Key, g: str) -> None:
        if key in grads:
            grads[key] = self.emit("add", [grads[key], g])
        else:
            grads[key] = g


def _is_float(meta: TensorMeta | None) -> bool:
    return meta is not None and meta is not UNKNOWN and meta.dtype in FLOATS


def grad_program(forward: list[Instr], loss: str, wrt: list[str], env: Env, *, grad_loss: str | None = None,
                 prefix: str = "g_") -> tuple[list[Instr], dict[str, str]]:
    """The backward instructions of `forward` (run, or about to run, on tensors whose metas `env` gives) computing
    d loss / d w for each w in `wrt`, and the map w -> its gradient's tensor name.

    `loss` is scalar unless `grad_loss` names the upstream gradient (loss's shape and dtype). A tensor of `wrt` that
    does not reach the loss gets a gradient of zeros. An op without a gradient rule on a path from `wrt` to `loss`
    raises DeepxError naming it."""
    bld = _Builder(forward, env, prefix)
    for w in wrt:
        m = env.meta(w)
        if m is None:
            raise DeepxError(f"autograd: wrt tensor '{w}' does not exist before the forward program")
        if not _is_float(m):
            raise DeepxError(f"autograd: wrt tensor '{w}' is {m.dtype}; only float tensors have gradients")
        bld.reachable.add((w, 0))
    # forward: which values depend on wrt (through float tensors)
    for node in bld.nodes:
        if any(k is not None and k in bld.reachable for k in node.ins):
            for k, m in zip(node.outs, node.b.outs):
                if k is not None and _is_float(m):
                    bld.reachable.add(k)
    if (bld.version.get(loss, 0) == 0 and env.meta(loss) is None) or loss in bld.deleted:
        raise DeepxError(f"autograd: loss tensor '{loss}' does not exist after the forward program")
    loss_key = bld.current(loss)
    loss_meta = bld.meta(loss)
    if not _is_float(loss_meta):
        raise DeepxError(f"autograd: loss '{loss}' is {loss_meta.dtype}; it must be a float tensor")
    grads: dict[Key, str] = {}
    if grad_loss is None:
        if loss_meta.shape != ():
            raise DeepxError(f"autograd: loss '{loss}' has shape {list(loss_meta.shape)}; a non-scalar loss needs "
                             "grad_loss (its upstream gradient)")
        grads[loss_key] = bld.filled(loss_meta, 1.0)
    else:
        gm = bld.meta(grad_loss)
        if gm != loss_meta:
            raise DeepxError(f"autograd: grad_loss '{grad_loss}' is {gm.dtype}{list(gm.shape)} but loss '{loss}' is "
                             f"{loss_meta.dtype}{list(loss_meta.shape)}")
        grads[loss_key] = grad_loss
    # backward
    for node in reversed(bld.nodes):
        outs_with_grad = [i for i, k in enumerate(node.outs) if k is not None and k in grads]
        if not outs_with_grad:
            continue
        if not any(k is not None and k in bld.reachable for k in node.ins):
            continue
        name = node.b.op.name
        fn = grad_rule(name)
        if fn is None:
            raise DeepxError(f"autograd: op '{name}' has no gradient rule, and it lies between {sorted(wrt)} and the "
                             f"loss '{loss}'")
        if outs_with_grad != [0]:  # a rule turns the gradient of the first result; no other carries one
            held = node.b.out_names[next(i for i in outs_with_grad if i)]
            raise DeepxError(f"autograd: the loss '{loss}' depends on result '{held}' of {name}, which carries no "
                             f"gradient ({name}'s gradient flows from its first result only, but '{held}' lies "
                             f"between {sorted(wrt)} and the loss)")
        g = grads[node.outs[0]]  # type: ignore[index]
        result = fn(Grad(bld, node), g)
        for i, gi in result.items():
            key = node.ins[i]
            assert key is not None
            want = node.in_metas[i]
            assert want is not None
            got = bld.meta(gi)
            if (got.shape, got.dtype) != (want.shape, want.dtype):
                raise DeepxError(f"autograd: the rule of {name} gave a gradient {got.dtype}{list(got.shape)} for "
                                 f"'{key[0]}' of {want.dtype}{list(want.shape)}")
            bld.accumulate(grads, key, gi)
    # results: one distinct tensor per wrt, never the caller's grad_loss
    result_names: dict[str, str] = {}
    used: set[str] = set()
    for w in wrt:
        found = grads.get((w, 0))
        if found is None:
            g = bld.filled(env.meta(w), 0.0)  # type: ignore[arg-type]
        elif found in used or found not in bld.created:
            g = bld.emit("copytensor", [found])
        else:
            g = found
        used.add(g)
        result_names[w] = g
    return _free(bld.out, bld.created - used), result_names


def _free(prog: list[Instr], temps: set[str]) -> list[Instr]:
    """Insert a deltensor for each temporary right after its last use."""
    last: dict[str, int] = {}
    dtypes: dict[str, str] = {}
    for i, instr in enumerate(prog):
        for p in (*instr.args, *instr.returns):
            if p.category == "tensor" and p.value in temps:
                last[p.value] = i  # type: ignore[index]
                if p.precisions:
                    dtypes[p.value] = p.dtype  # type: ignore[index]
            elif p.category == "listtensor" and isinstance(p.value, tuple):  # fused's inputs, concat's
                for v in p.value:
                    if v in temps:
                        last[v] = i
                        if p.precisions:
                            dtypes[v] = p.dtype
    after: dict[int, list[str]] = {}
    for name, i in last.items():
        after.setdefault(i, []).append(name)
    out: list[Instr] = []
    for i, instr in enumerate(prog):
        out.append(instr)
        for name in sorted(after.get(i, ())):
            out.append(Instr("deltensor", (), (Param.tensor(name, dtypes.get(name)),)))
    return out


# ---------------------------------------------------------------- the rules
# Each rule's docstring is its formula, in terms of the upstream gradient g, the inputs and the output y: docs/ir.md
# shows it in the op's row of the catalogue (python -m deepxd.compiler.doc --write).

_LOW = ("float16", "bfloat16")


def _float_mask(gr: Grad, mask: str, like: TensorMeta) -> str:
    return gr.emit("todtype", mask, dtype=like.dtype)


def _masked(gr: Grad, g: str, x: str, op: str, s: float) -> str:
    """g where `x op s` holds (op: >, <, >= or <=), else 0: mul(g, todtype(greaterscalar(x, s))) as one fused
    instruction (one pass instead of three; the same values, signed zeros included)."""
    m = gr._builder.meta(g)
    if not math.isfinite(s) or gr._builder.meta(x) != m:
        mask = _float_mask(gr, gr.emit("greaterscalar" if op[0] == ">" else "lessscalar", x, s), m)
        if op.endswith("="):  # or equal: the two masks never overlap
            mask = gr.emit("add", mask, _float_mask(gr, gr.emit("equalscalar", x, s), m))
        return gr.emit("mul", g, mask)
    return gr.emit("fused", Param.listtensor([g, x], m.dtype), Param.var(f"in0 * (in1 {op} {s!r})"))


def _up(gr: Grad, name: str) -> str:
    """float16 and bfloat16 values as float32, so that a long gradient formula rounds once, as the kernels do."""
    return gr.emit("todtype", name, dtype="float32") if gr.shape_dtype(name) in _LOW else name


def _down(gr: Grad, name: str, dtype: str) -> str:
    return gr.emit("todtype", name, dtype=dtype) if dtype in _LOW else name


def _mean(gr: Grad, x: str, dims: tuple[int, ...], n: int) -> str:
    return gr.emit("mulscalar", gr.emit("sum", x, dims, True), 1.0 / max(n, 1))


def _keepdims(gr: Grad, g: str, shape: tuple[int, ...], dims: set[int], keepdims: bool) -> str:
    """g of a reduction's result, reshaped to the input's rank (size 1 on the reduced dims)."""
    return g if keepdims else gr.emit("reshape", g, tuple(1 if i in dims else d for i, d in enumerate(shape)))


def _reduced_dims(gr: Grad) -> set[int]:
    shape = gr.meta(0).shape
    return {d % len(shape) for d in gr.arg(1)} if gr.arg(1) else set(range(len(shape)))


@rule("add")
def _add(gr: Grad, g: str) -> dict[int, str]:
    """dA = g, dB = g (each summed over its broadcast dims)"""
    out = {}
    if gr.needs(0):
        out[0] = gr.unbroadcast(g, gr.meta(0))
    if gr.needs(1):
        out[1] = gr.unbroadcast(g, gr.meta(1))
    return out


@rule("sub")
def _sub(gr: Grad, g: str) -> dict[int, str]:
    """dA = g, dB = -g (each summed over its broadcast dims)"""
    out = {}
    if gr.needs(0):
        out[0] = gr.unbroadcast(g, gr.meta(0))
    if gr.needs(1):
        out[1] = gr.unbroadcast(gr.emit("neg", g), gr.meta(1))
    return out


@rule("mul")
def _mul(gr: Grad, g: str) -> dict[int, str]:
    """dA = g B, dB = g A (each summed over its broadcast dims)"""
    out = {}
    if gr.needs(0):
        out[0] = gr.unbroadcast(gr.emit("mul", g, gr.x(1)), gr.meta(0))
    if gr.needs(1):
        out[1] = gr.unbroadcast(gr.emit("mul", g, gr.x(0)), gr.meta(1))
    return out


@rule("div")
def _div(gr: Grad, g: str) -> dict[int, str]:
    """dA = g / B, dB = -g A / B^2"""
    out = {}
    t = gr.emit("div", g, gr.x(1))  # g / B
    if gr.needs(0):
        out[0] = gr.unbroadcast(t, gr.meta(0))
    if gr.needs(1):  # -g A / B^2
        q = gr.emit("div", gr.x(0), gr.x(1))
        out[1] = gr.unbroadcast(gr.emit("neg", gr.emit("mul", t, q)), gr.meta(1))
    return out


@rule("pow")
def _pow(gr: Grad, g: str) -> dict[int, str]:
    """dA = g B A^(B-1), 0 where B = 0; dB = g y log A, 0 where A = 0 and B >= 0 (torch's masks: 0^0 gives both
    gradients 0, not nan and -inf)"""
    out = {}
    a, b = gr.x(0), gr.x(1)
    m = gr.out_meta()
    zero = gr.filled(TensorMeta((), m.dtype), 0.0)
    if gr.needs(0):  # g B A^(B-1)
        p = gr.emit("pow", a, gr.emit("subscalar", b, 1.0))
        d = gr.emit("switch", Param.listtensor([gr.emit("mul", b, p), zero], m.dtype), gr.emit("equalscalar", b, 0.0))
        out[0] = gr.unbroadcast(gr.emit("mul", g, d), gr.meta(0))
    if gr.needs(1):  # g A^B log A
        a_zero = _float_mask(gr, gr.emit("equalscalar", a, 0.0), m)
        at_zero = gr.emit("mul", a_zero, _float_mask(gr, gr.emit("lessscalar", b, 0.0), m))  # and B < 0: kept (inf)
        mask = gr.emit("sub", a_zero, at_zero)  # A = 0 and B >= 0
        d = gr.emit("mul", gr.y(), gr.emit("log", a))
        d = gr.emit("switch", Param.listtensor([d, zero], m.dtype), gr.emit("todtype", mask, dtype="int32"))
        out[1] = gr.unbroadcast(gr.emit("mul", g, d), gr.meta(1))
    return out


@rule("max", "min")
def _maxmin(gr: Grad, g: str) -> dict[int, str]:
    """g goes to the input picked (A where A > B for max, A < B for min), split in halves where they tie, as torch's
    maximum and minimum"""
    a, b = gr.x(0), gr.x(1)
    dt = gr.out_meta().dtype
    pick_a = gr.emit("todtype", gr.emit("greater" if gr.op == "max" else "less", a, b), dtype=dt)
    tie = gr.emit("mulscalar", gr.emit("todtype", gr.emit("equal", a, b), dtype=dt), 0.5)
    m = gr.emit("add", pick_a, tie)
    out = {}
    ga = gr.emit("mul", g, m)
    if gr.needs(0):
        out[0] = gr.unbroadcast(ga, gr.meta(0))
    if gr.needs(1):
        out[1] = gr.unbroadcast(gr.emit("sub", g, ga), gr.meta(1))
    return out


@rule("addscalar", "subscalar", "copytensor")
def _identity(gr: Grad, g: str) -> dict[int, str]:
    """dA = g"""
    return {0: g}


@rule("mulscalar")
def _mulscalar(gr: Grad, g: str) -> dict[int, str]:
    """dA = g s"""
    return {0: gr.emit("mulscalar", g, float(gr.arg(1)))}


@rule("divscalar")
def _divscalar(gr: Grad, g: str) -> dict[int, str]:
    """dA = g / s"""
    return {0: gr.emit("divscalar", g, float(gr.arg(1)))}


@rule("rsubscalar")
def _rsubscalar(gr: Grad, g: str) -> dict[int, str]:
    """dA = -g"""
    return {1: gr.emit("neg", g)}


@rule("rdivscalar")
def _rdivscalar(gr: Grad, g: str) -> dict[int, str]:
    """dA = -g s / A^2"""
    a = gr.x(1)
    r = gr.emit("rdivscalar", -float(gr.arg(0)), gr.emit("mul", a, a))
    return {1: gr.emit("mul", g, r)}


@rule("powscalar")
def _powscalar(gr: Grad, g: str) -> dict[int, str]:
    """dA = g s A^(s-1) (0 for s = 0, as torch)"""
    s = float(gr.arg(1))
    if s == 0.0:
        return {0: gr.emit("mulscalar", g, 0.0)}
    p = gr.emit("mulscalar", gr.emit("powscalar", gr.x(0), s - 1.0), s)
    return {0: gr.emit("mul", g, p)}


@rule("rpowscalar")
def _rpowscalar(gr: Grad, g: str) -> dict[int, str]:
    """dA = g y log s (0 for s = 0 and nan for s < 0, as torch)"""
    s = float(gr.arg(0))
    if s == 0.0:
        return {1: gr.emit("mulscalar", g, 0.0)}
    return {1: gr.emit("mulscalar", gr.emit("mul", g, gr.y()), math.log(s) if s > 0 else math.nan)}


@rule("maxscalar", "minscalar")
def _maxminscalar(gr: Grad, g: str) -> dict[int, str]:
    """dA = g where A >= s (max) or A <= s (min), else 0: at the bound itself the gradient passes, as torch's
    clamp(min=s) and clamp(max=s) give it"""
    return {0: _masked(gr, g, gr.x(0), ">=" if gr.op == "maxscalar" else "<=", float(gr.arg(1)))}


@rule("relu")
def _relu(gr: Grad, g: str) -> dict[int, str]:
    """dA = g where y > 0, else 0 (the same mask as A > 0; reading the output, as torch does, lets A go)"""
    return {0: _masked(gr, g, gr.y(), ">", 0.0)}


@rule("abs")
def _abs(gr: Grad, g: str) -> dict[int, str]:
    """dA = g sign(A) (0 at 0)"""
    a, m = gr.x(0), gr.meta(0)
    pos = _float_mask(gr, gr.emit("greaterscalar", a, 0.0), m)
    neg = _float_mask(gr, gr.emit("lessscalar", a, 0.0), m)
    return {0: gr.emit("mul", g, gr.emit("sub", pos, neg))}


@rule("sin")
def _sin(gr: Grad, g: str) -> dict[int, str]:
    """dA = g cos A"""
    return {0: gr.emit("mul", g, gr.emit("cos", gr.x(0)))}


@rule("cos")
def _cos(gr: Grad, g: str) -> dict[int, str]:
    """dA = -g sin A"""
    return {0: gr.emit("neg", gr.emit("mul", g, gr.emit("sin", gr.x(0))))}


@rule("tan")
def _tan(gr: Grad, g: str) -> dict[int, str]:
    """dA = g (1 + y^2)"""
    y = gr.y()
    return {0: gr.emit("mul", g, gr.emit("addscalar", gr.emit("mul", y, y), 1.0))}


@rule("floor", "ceil", "round", "trunc", "floordiv", "floordivscalar", "rfloordivscalar")
def _step(gr: Grad, g: str) -> dict[int, str]:
    """dA = 0 (a step function: nothing flows back, so nothing is emitted)"""
    return {}


@rule("silu")
def _silu(gr: Grad, g: str) -> dict[int, str]:
    """dA = g s (1 + A (1 - s)), s = sigmoid(A)"""
    a = gr.x(0)
    s = gr.emit("sigmoid", a)
    inner = gr.emit("addscalar", gr.emit("mul", a, gr.emit("rsubscalar", 1.0, s)), 1.0)
    return {0: gr.emit("mul", g, gr.emit("mul", s, inner))}



@rule("erf")
def _erf(gr: Grad, g: str) -> dict[int, str]:
    """dA = g 2/sqrt(pi) exp(-A^2)"""
    a = gr.x(0)
    e = gr.emit("exp", gr.emit("neg", gr.emit("mul", a, a)))
    return {0: gr.emit("mul", g, gr.emit("mulscalar", e, 2.0 / math.sqrt(math.pi)))}


@rule("gelu")
def _gelu(gr: Grad, g: str) -> dict[int, str]:
    """dA = g (Phi(A) + A phi(A)), Phi(A) = (1 + erf(A/sqrt 2))/2; approximate='tanh': the derivative of its tanh
    form, with t = tanh(sqrt(2/pi) (A + 0.044715 A^3)): g ((1 + t)/2 + A/2 (1 - t^2) sqrt(2/pi) (1 + 3 0.044715 A^2)).
    One instruction, `gelugrad` (its kernels compute the 16-bit floats in float32 and round once)"""
    return {0: gr.emit("gelugrad", gr.x(0), g, Param.var(gr.arg(1)))}


def _swap_last(rank: int) -> tuple[int, ...]:
    return (*range(rank - 2), rank - 1, rank - 2)


@rule("matmul")
def _matmul(gr: Grad, g: str) -> dict[int, str]:
    """dA = g @ B^T, dB = A^T @ g (each summed over its broadcast batch dims)"""
    out = {}
    if gr.needs(0):  # g @ B^T
        out[0] = gr.unbroadcast(gr.emit("matmul", g, gr.transposed(1)), gr.meta(0))
    if gr.needs(1):  # A^T @ g (a transpose of it becomes g^T @ A: the transpose_products pass)
        out[1] = gr.unbroadcast(gr.emit("matmul", gr.transposed(0), g), gr.meta(1))
    return out


@rule("sum")
def _sum(gr: Grad, g: str) -> dict[int, str]:
    """dA = g broadcast back over the summed dims"""
    shape = gr.meta(0).shape
    g = _keepdims(gr, g, shape, _reduced_dims(gr), bool(gr.arg(2)))
    return {0: gr.emit("broadcastTo", g, tuple(shape))}


@rule("prod")
def _prod(gr: Grad, g: str) -> dict[int, str]:
    """dA = g times the product of the other elements: g y / A without zeros; with one zero, only it gets g times
    the product of the rest; with two or more, 0"""
    x, m = gr.x(0), gr.meta(0)
    dims = _reduced_dims(gr)
    gk = _keepdims(gr, g, m.shape, dims, bool(gr.arg(2)))
    d = tuple(sorted(dims))
    zero = _float_mask(gr, gr.emit("equalscalar", x, 0.0), m)  # 1 where A == 0
    nzero = gr.emit("sum", zero, d, True)
    x1 = gr.emit("add", x, zero)  # zeros become ones
    rest = gr.emit("prod", x1, d, True)  # the product of the non-zero elements
    no_zero = _float_mask(gr, gr.emit("equalscalar", nzero, 0.0), m)
    one_zero = _float_mask(gr, gr.emit("equalscalar", nzero, 1.0), m)
    where_nonzero = gr.emit("mul", gr.emit("div", rest, x1), no_zero)
    where_zero = gr.emit("mul", zero, gr.emit("mul", rest, one_zero))
    return {0: gr.emit("mul", gk, gr.emit("add", where_nonzero, where_zero))}


@rule("cumsum")
def _cumsum(gr: Grad, g: str) -> dict[int, str]:
    """dA = the running sums of g from the other end (cumsum with reverse flipped)"""
    return {0: gr.emit("cumsum", g, int(gr.arg(1)), not gr.arg(2))}


@rule("cumprod")
def _cumprod(gr: Grad, g: str) -> dict[int, str]:
    """dA = cumprodgrad(A, g): dA[i] = the sum over j >= i of g[j] prod(A[k], k <= j, k != i)"""
    return {0: gr.emit("cumprodgrad", gr.x(0), g, int(gr.arg(1)))}


@rule("reducemax", "reducemin")
def _reducemaxmin(gr: Grad, g: str) -> dict[int, str]:
    """dA = g shared evenly between the elements equal to the result (as torch.amax and amin do)"""
    x, m = gr.x(0), gr.meta(0)
    dims = _reduced_dims(gr)
    keep = bool(gr.arg(2))
    gk = _keepdims(gr, g, m.shape, dims, keep)
    yk = _keepdims(gr, gr.y(), m.shape, dims, keep)
    hit = _float_mask(gr, gr.emit("equal", x, yk), m)
    count = gr.emit("sum", hit, tuple(sorted(dims)), True)
    return {0: gr.emit("mul", hit, gr.emit("div", gk, count))}


@rule("reshape")
def _reshape(gr: Grad, g: str) -> dict[int, str]:
    """dA = g reshaped to A's shape"""
    return {0: gr.emit("reshape", g, tuple(gr.meta(0).shape))}


@rule("transpose")
def _transpose(gr: Grad, g: str) -> dict[int, str]:
    """dA = g transposed by the inverse permutation"""
    perm = [p % len(gr.meta(0).shape) for p in gr.arg(1)]
    inv = [0] * len(perm)
    for i, p in enumerate(perm):
        inv[p] = i
    return {0: gr.emit("transpose", g, tuple(inv))}


@rule("broadcastTo")
def _broadcast_to(gr: Grad, g: str) -> dict[int, str]:
    """dA = g summed over the broadcast dims"""
    return {0: gr.unbroadcast(g, gr.meta(0))}


@rule("allreduce")
def _allreduce(gr: Grad, g: str) -> dict[int, str]:
    """dA = allreduce(g) with the same op (sum, mean): every rank's loss took every rank's A; max, min and product
    have none"""
    how, group = gr.arg(1), gr.arg(2)
    if how not in ("sum", "mean"):
        raise DeepxError(f"autograd: allreduce with op {how} has no gradient (op sum and mean have)")
    return {0: gr.emit("allreduce", g, Param.var(how), Param.var(group))}


@rule("allgather")
def _allgather(gr: Grad, g: str) -> dict[int, str]:
    """dA = reducescatter(g, sum): rank r's block of g summed over the ranks"""
    return {0: gr.emit("reducescatter", g, Param.var(gr.arg(1)), Param.var("sum"), Param.var(gr.arg(2)))}


@rule("reducescatter")
def _reducescatter(gr: Grad, g: str) -> dict[int, str]:
    """dA = allgather(g) (divided by world for op mean); max, min and product have none"""
    world, how, group = gr.arg(1), gr.arg(2), gr.arg(3)
    if how not in ("sum", "mean"):
        raise DeepxError(f"autograd: reducescatter with op {how} has no gradient (op sum and mean have)")
    out = gr.emit("allgather", g, Param.var(world), Param.var(group))
    return {0: gr.emit("divscalar", out, float(world)) if how == "mean" else out}


@rule("concat")
def _concat(gr: Grad, g: str) -> dict[int, str]:
    """d tensors[k] = the slice of g along dim that tensors[k] filled"""
    metas = gr.b.args[0]
    rank = len(metas[0].shape)
    dim = gr.arg(1) % rank
    out, offset = {}, 0
    for k, i in enumerate(gr.items(0)):
        size = metas[k].shape[dim]
        if gr.needs(i):
            starts = tuple(offset if d == dim else 0 for d in range(rank))
            ends = tuple(offset + size if d == dim else n for d, n in enumerate(metas[k].shape))
            out[i] = gr.emit("slice", g, starts, ends, (1,) * rank)
        offset += size
    return out


@rule("slice")
def _slice(gr: Grad, g: str) -> dict[int, str]:
    """dA = zeros with g written into the slice (sliceassign)"""
    zeros = gr.filled(gr.meta(0), 0.0)
    return {0: gr.emit("sliceassign", zeros, gr.arg(1), gr.arg(2), gr.arg(3), g)}


@rule("sliceassign")
def _sliceassign(gr: Grad, g: str) -> dict[int, str]:
    """dA = g with the slice zeroed; dV = the slice of g (summed over V's broadcast dims)"""
    out = {}
    if gr.needs(0):
        zero = gr.filled(TensorMeta((), gr.meta(0).dtype), 0.0)
        out[0] = gr.emit("sliceassign", g, gr.arg(1), gr.arg(2), gr.arg(3), zero)
    if gr.needs(4):
        out[4] = gr.unbroadcast(gr.emit("slice", g, gr.arg(1), gr.arg(2), gr.arg(3)), gr.meta(4))
    return out


@rule("pad")
def _pad(gr: Grad, g: str) -> dict[int, str]:
    """dA = the slice of g that A filled (without the padding)"""
    shape, pads = gr.meta(0).shape, gr.arg(1)
    starts = tuple(pads[0::2])
    ends = tuple(b + d for b, d in zip(starts, shape))
    return {0: gr.emit("slice", g, starts, ends, (1,) * len(shape))}


@rule("repeat")
def _repeat(gr: Grad, g: str) -> dict[int, str]:
    """dA = g viewed as (r0, n0, r1, n1, ...) and summed over the repeats r"""
    shape, reps = gr.meta(0).shape, tuple(gr.arg(1))
    full = (1,) * (len(reps) - len(shape)) + tuple(shape)
    split = tuple(x for r, n in zip(reps, full) for x in (r, n))
    s = gr.emit("sum", gr.emit("reshape", g, split), tuple(range(0, 2 * len(reps), 2)), False)
    if tuple(full) != tuple(shape):
        s = gr.emit("reshape", s, tuple(shape))
    return {0: s}


@rule("indexselect")
def _indexselect(gr: Grad, g: str) -> dict[int, str]:
    """dA = zeros, then g added at the selected indices (indexadd; repeats accumulate)"""
    zeros = gr.filled(gr.meta(0), 0.0)
    return {0: gr.emit("indexadd", zeros, gr.x(1), g, int(gr.arg(2)))}


@rule("indexadd")
def _indexadd(gr: Grad, g: str) -> dict[int, str]:
    """dA = g; dsrc = g at the indices (indexselect)"""
    out = {}
    if gr.needs(0):
        out[0] = g
    if gr.needs(2):
        out[2] = gr.emit("indexselect", g, gr.x(1), int(gr.arg(3)))
    return out


def _overwritten(gr: Grad, g: str, write: str, read: str) -> dict[int, str]:
    """The gradient of an op that writes src into A at indices (`write`: indexcopy, scatter; args A, index, src,
    axis): dA = g with zeros written where src went (`write` of zeros), dsrc = g read back from there (`read`)."""
    out = {}
    axis = int(gr.arg(3))
    if gr.needs(0):
        out[0] = gr.emit(write, g, gr.x(1), gr.filled(gr.meta(2), 0.0), axis)
    if gr.needs(2):
        out[2] = gr.emit(read, g, gr.x(1), axis)
    return out


@rule("indexcopy")
def _indexcopy(gr: Grad, g: str) -> dict[int, str]:
    """dA = g, 0 where src was written (indexcopy of zeros); dsrc = g at the indices (indexselect)"""
    return _overwritten(gr, g, "indexcopy", "indexselect")


@rule("gather")
def _gather(gr: Grad, g: str) -> dict[int, str]:
    """dA = zeros, then g added where each element was read from (scatteradd; repeats accumulate)"""
    zeros = gr.filled(gr.meta(0), 0.0)
    return {0: gr.emit("scatteradd", zeros, gr.x(1), g, int(gr.arg(2)))}


@rule("scatter")
def _scatter(gr: Grad, g: str) -> dict[int, str]:
    """dA = g, 0 where src was written (scatter of zeros); dsrc = g where each element went (gather)"""
    return _overwritten(gr, g, "scatter", "gather")


@rule("scatteradd")
def _scatteradd(gr: Grad, g: str) -> dict[int, str]:
    """dA = g; dsrc = g where each element went (gather)"""
    out = {}
    if gr.needs(0):
        out[0] = g
    if gr.needs(2):
        out[2] = gr.emit("gather", g, gr.x(1), int(gr.arg(3)))
    return out


@rule("switch")
def _switch(gr: Grad, g: str) -> dict[int, str]:
    """d tensors[k] = g where cases == k, else 0 (summed over broadcast dims)"""
    dt = gr.out_meta().dtype
    cases = gr.emit("todtype", gr.x(1), dtype=dt)
    out = {}
    for k, i in enumerate(gr.items(0)):
        if gr.needs(i):
            mask = gr.emit("todtype", gr.emit("equalscalar", cases, float(k)), dtype=dt)
            out[i] = gr.unbroadcast(gr.emit("mul", g, mask), gr.meta(i))
    return out


@rule("todtype")
def _todtype(gr: Grad, g: str) -> dict[int, str]:
    """dA = g cast back to A's dtype"""
    return {0: gr.emit("todtype", g, dtype=gr.meta(0).dtype)}


@rule("dropout")
def _dropout(gr: Grad, g: str) -> dict[int, str]:
    """dA = g mask / (1 - p): the mask drawn again from the same seed (seed 0: taken from y != 0)"""
    p, seed = float(gr.arg(0)), int(gr.arg(1))
    m = gr.meta(2)
    if seed != 0:  # the kernel draws the mask from the seed alone: dropout of ones is mask / (1 - p), exactly
        ones = gr.filled(m, 1.0)
        b = gr._builder
        b.append(Instr("dropout", (Param.var(p, "float64"), Param.var(seed)), (Param.tensor(ones, m.dtype),)))
        return {2: gr.emit("mul", g, ones)}
    if p >= 1:  # everything dropped: y = x * 0, whose gradient is g * 0
        return {2: gr.emit("mulscalar", g, 0.0)}
    kept = _float_mask(gr, gr.emit("notequalscalar", gr.y(), 0.0), m)
    return {2: gr.emit("mul", g, gr.emit("mulscalar", kept, 1.0 / (1.0 - p)))}


@rule("softmax")
def _softmax(gr: Grad, g: str) -> dict[int, str]:
    """dA = y (g - sum(g y)), the sum along dim"""
    y, dim = gr.y(), gr.arg(1)
    if not gr.meta(0).shape:
        return {0: gr.emit("mulscalar", g, 0.0)}
    s = gr.emit("sum", gr.emit("mul", g, y), (dim,), True)
    return {0: gr.emit("mul", y, gr.emit("sub", g, s))}


@rule("logsoftmax")
def _logsoftmax(gr: Grad, g: str) -> dict[int, str]:
    """dA = g - exp(y) sum(g), the sum along dim"""
    y, dim = gr.y(), gr.arg(1)
    if not gr.meta(0).shape:
        return {0: gr.emit("mulscalar", g, 0.0)}
    s = gr.emit("sum", g, (dim,), True)
    return {0: gr.emit("sub", g, gr.emit("mul", gr.emit("exp", y), s))}


@rule("crossentropy")
def _crossentropy(gr: Grad, g: str) -> dict[int, str]:
    """dlogits = g (softmax(logits) - onehot(labels)) on rows whose label is kept (/ their count for mean): one
    crossentropygrad"""
    if gr.needs(1):
        raise DeepxError("autograd: crossentropy labels cannot take a gradient")
    return {0: gr.emit("crossentropygrad", gr.x(0), gr.x(1), g, int(gr.arg(2)), Param.var(gr.arg(3)))}


@rule("attention")
def _attention(gr: Grad, g: str) -> dict[int, str]:
    """dq, dk, dv = attentiongrad(q, k, v, y, lse, g): with P = exp(q k^T * scale - lse) and D = rowsum(g y),
    dv = P^T g, dS = P (g v^T - D), dq = dS k * scale, dk = dS^T q * scale (no gradient flows through lse)"""
    grads = gr.emit_all("attentiongrad", gr.x(0), gr.x(1), gr.x(2), gr.y(0), gr.y(1), g, float(gr.arg(3)),
                        bool(gr.arg(4)))
    return {i: grads[i] for i in range(3) if gr.needs(i)}


@rule("maskedattention")
def _maskedattention(gr: Grad, g: str) -> dict[int, str]:
    """as attention's, with the mask added to the recomputed scores; the mask takes no gradient"""
    if gr.needs(3):
        raise DeepxError("autograd: maskedattention's mask cannot take a gradient; use the composite of matmul, add "
                         "and softmax for a learned mask")
    grads = gr.emit_all("maskedattentiongrad", gr.x(0), gr.x(1), gr.x(2), gr.x(3), gr.y(0), gr.y(1), g,
                        float(gr.arg(4)))
    return {i: grads[i] for i in range(3) if gr.needs(i)}


@rule("mse")
def _mse(gr: Grad, g: str) -> dict[int, str]:
    """dA = 2 g (A - B) (/ numel for mean), dB = -dA"""
    a, b = gr.x(0), gr.x(1)
    n = 1
    for d in gr.meta(0).shape:
        n *= d
    k = 2.0 / max(n, 1) if gr.arg(2) == "mean" else 2.0  # (empty: no element to scale)
    ga = gr.emit("mul", gr.emit("mulscalar", gr.emit("sub", a, b), k), g)
    out = {}
    if gr.needs(0):
        out[0] = ga
    if gr.needs(1):
        out[1] = gr.emit("neg", ga)
    return out


def _norm_dims(gr: Grad) -> tuple[tuple[int, ...], int]:
    rank, wshape = len(gr.meta(0).shape), gr.meta(1).shape
    n = 1
    for d in wshape:
        n *= d
    return tuple(range(rank - len(wshape), rank)), n


@rule("layernorm")
def _layernorm(gr: Grad, g: str) -> dict[int, str]:
    """with xh = (A - mean) / sqrt(var + eps) over weight's dims and d = g weight: dA = (d - mean(d) - xh mean(d xh))
    / sqrt(var + eps), one layernormgrad; dweight = sum(g xh); dbias = sum(g) (over the leading dims)"""
    dt = gr.meta(0).dtype
    out = {}
    if gr.needs(2):
        out[2] = gr.unbroadcast(g, gr.meta(2))
    if not (gr.needs(0) or gr.needs(1)):
        return out
    da, xh = gr.emit_all("layernormgrad", gr.x(0), gr.x(1), g, float(gr.arg(3)))
    if gr.needs(1):
        out[1] = _down(gr, gr.unbroadcast(gr.emit("mul", _up(gr, g), _up(gr, xh)), gr.meta(1)), dt)
    if gr.needs(0):
        out[0] = da
    return out


@rule("conv2d")
def _conv2d(gr: Grad, g: str) -> dict[int, str]:
    """dA = conv2dgradinput(g, weight) (weight^T g, scattered back over the taps); dweight = conv2dgradweight(A, g)
    (g contracted with A's taps)"""
    geometry = tuple(gr.arg(k) for k in (2, 3, 4, 5))
    out = {}
    if gr.needs(0):
        out[0] = gr.emit("conv2dgradinput", g, gr.x(1), gr.meta(0).shape, *geometry)
    if gr.needs(1):
        out[1] = gr.emit("conv2dgradweight", gr.x(0), g, gr.meta(1).shape, *geometry)
    return out



@rule("maxpool2d")
def _maxpool2d(gr: Grad, g: str) -> dict[int, str]:
    """dA = maxpool2dgrad(A, g): each window's g to its first maximum"""
    return {0: gr.emit("maxpool2dgrad", gr.x(0), g, gr.arg(1), gr.arg(2), gr.arg(3))}


@rule("sumpool2d")
def _sumpool2d(gr: Grad, g: str) -> dict[int, str]:
    """dA = sumpool2dgrad(g): each input position gets g summed over the windows that read it"""
    return {0: gr.emit("sumpool2dgrad", g, gr.meta(0).shape, gr.arg(1), gr.arg(2), gr.arg(3))}

@rule("batchnorm")
def _batchnorm(gr: Grad, g: str) -> dict[int, str]:
    """dA, dweight, dbias = batchnormgrad(A, g, weight, mean, var) from the forward's statistics: with xh = (A - mean)
    / sqrt(var + eps), dbias = sum(g), dweight = sum(g xh) (over all but dim 1), dA = weight / sqrt(var + eps)
    (g - dbias / n - xh dweight / n)"""
    return _norm_grads(gr, gr.emit_all("batchnormgrad", gr.x(0), g, gr.x(1), gr.y(1), gr.y(2), float(gr.arg(3))))


@rule("batchnormeval")
def _batchnormeval(gr: Grad, g: str) -> dict[int, str]:
    """dA, dweight, dbias = batchnormgrad(A, g, weight, mean, var, batch=false): dA = g weight / sqrt(var + eps),
    dweight = sum(g xh), dbias = sum(g); the given statistics take none (torch's running ones take none)"""
    return _norm_grads(gr, gr.emit_all("batchnormgrad", gr.x(0), g, gr.x(1), gr.x(3), gr.x(4), float(gr.arg(5)),
                                       False))


@rule("groupnorm")
def _groupnorm(gr: Grad, g: str) -> dict[int, str]:
    """dA, dweight, dbias = groupnormgrad(A, g, weight, mean, var) from the forward's statistics: with xh = (A - mean)
    / sqrt(var + eps) and d = g weight, dA = (d - mean(d) - xh mean(d xh)) / sqrt(var + eps) over each group;
    dweight = sum(g xh), dbias = sum(g)"""
    return _norm_grads(gr, gr.emit_all("groupnormgrad", gr.x(0), g, gr.x(1), gr.y(1), gr.y(2), int(gr.arg(3)),
                                       float(gr.arg(4))))


def _norm_grads(gr: Grad, grads: list[str]) -> dict[int, str]:
    """The gradients of a norm's A, weight and bias (those that need one) from its gradient op's three results."""
    return {i: name for i, name in enumerate(grads) if gr.needs(i)}


@rule("interpnearest")
def _interpnearest(gr: Grad, g: str) -> dict[int, str]:
    """dA = interpnearestgrad(g): each input position gets g summed over the outputs that read it"""
    return {0: gr.emit("interpnearestgrad", g, gr.meta(0).shape, float(gr.arg(2)), float(gr.arg(3)))}


@rule("interpbilinear")
def _interpbilinear(gr: Grad, g: str) -> dict[int, str]:
    """dA = interpbilineargrad(g): each output's g scattered to its 2 x 2 source neighbours with their weights"""
    return {0: gr.emit("interpbilineargrad", g, gr.meta(0).shape, bool(gr.arg(2)), float(gr.arg(3)),
                       float(gr.arg(4)))}


@rule("rmsnorm")
def _rmsnorm(gr: Grad, g: str) -> dict[int, str]:
    """with r = 1 / sqrt(mean(A^2) + eps) over weight's dims and d = g weight: dA = r (d - A r mean(d A r)), one
    rmsnormgrad; dweight = sum(g A r) (over the leading dims)"""
    dt = gr.meta(0).dtype
    da, xr = gr.emit_all("rmsnormgrad", gr.x(0), gr.x(1), g, float(gr.arg(2)))
    out = {}
    if gr.needs(1):
        out[1] = _down(gr, gr.unbroadcast(gr.emit("mul", _up(gr, g), _up(gr, xr)), gr.meta(1)), dt)
    if gr.needs(0):
        out[0] = da
    return out


# -- fused: its expression tree becomes the elementwise ops it stands for, whose rules then apply

_FUSED_BINARY = {ast.Add: ("add", "addscalar", "addscalar"), ast.Sub: ("sub", "subscalar", "rsubscalar"),
                 ast.Mult: ("mul", "mulscalar", "mulscalar"), ast.Div: ("div", "divscalar", "rdivscalar"),
                 ast.Pow: ("pow", "powscalar", "rpowscalar")}
def _py_floordiv(a: float, b: float) -> float:
    """Python's float //, and a / b (an infinity or nan) where b is 0, as the kernels give."""
    if b == 0:
        return math.copysign(math.inf, a) * math.copysign(1.0, b) if a == a and a != 0 else math.nan
    return a // b


def _py_remainder(a: float, b: float) -> float:
    return a % b if b != 0 else math.nan


# two-argument calls: (op of two tensors, of a tensor and a scalar, of a scalar and a tensor, of two numbers)
_FUSED_CALLS: dict[str, tuple[str, str, str, Callable[[float, float], float]]] = {
    "maximum": ("max", "maxscalar", "maxscalar", max), "minimum": ("min", "minscalar", "minscalar", min),
    "fmod": ("fmod", "fmodscalar", "rfmodscalar", math.fmod),
    "remainder": ("remainder", "remainderscalar", "rremainderscalar", _py_remainder),
    "floordiv": ("floordiv", "floordivscalar", "rfloordivscalar", _py_floordiv)}
_CONST_OPS: dict[type, Callable[[float, float], float]] = {
    ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b, ast.Pow: lambda a, b: a ** b}


def _whole(fn: Callable[[float], Any]) -> Callable[[float], float]:
    """A rounding to a whole number that keeps infinities and nan, as numpy's does (Python's raises)."""
    return lambda a: float(fn(a)) if math.isfinite(a) else a


# the functions of the fused language where Python's math has none of that name or meaning (round: halves to even)
_CONST_CALLS: dict[str, Callable[[float], float]] = {"abs": math.fabs, "floor": _whole(math.floor),
                                                     "ceil": _whole(math.ceil), "trunc": _whole(math.trunc),
                                                     "round": _whole(round)}


def _constant(fn: Callable[..., float], *args: float) -> float:
    """A part of a fused expression made of numbers alone, folded (as numexpr would compute it: nan, not an error)."""
    try:
        return float(fn(*args))
    except (ValueError, ZeroDivisionError, OverflowError):
        return math.nan


_COMPARE_OPS: dict[type, tuple[str, ...]] = {ast.Gt: ("greater",), ast.Lt: ("less",), ast.Eq: ("equal",),
                                             ast.NotEq: ("notequal",), ast.GtE: ("greater", "equal"),
                                             ast.LtE: ("less", "equal")}
_COMPARE_FLIP: dict[type, type] = {ast.Gt: ast.Lt, ast.Lt: ast.Gt, ast.GtE: ast.LtE, ast.LtE: ast.GtE, ast.Eq: ast.Eq,
                                   ast.NotEq: ast.NotEq}
_COMPARE_CONST: dict[type, Callable[[float, float], bool]] = {
    ast.Gt: lambda a, b: a > b, ast.Lt: lambda a, b: a < b, ast.GtE: lambda a, b: a >= b,
    ast.LtE: lambda a, b: a <= b, ast.Eq: lambda a, b: a == b, ast.NotEq: lambda a, b: a != b}


def unfuse(expr: str, inputs: Sequence[str], dtype: str, fresh: Callable[[], str]) -> tuple[list[Instr], str | float]:
    """The elementwise instructions that a fused expression over `inputs` stands for, and the name of the tensor
    holding its value (or the number, for an expression of numbers alone). Intermediates are named by `fresh`."""
    tree = parse_fused(expr, len(inputs))
    prog: list[Instr] = []

    def emit(op: str, *args: str | float) -> str:
        name = fresh()
        params = tuple(Param.tensor(a, dtype) if isinstance(a, str) else Param.var(float(a), "float64") for a in args)
        prog.append(Instr(op, params, (Param.tensor(name, dtype),)))
        return name

    def compare(op: type, a: str | float, b: str | float) -> str | float:
        if isinstance(a, float) and isinstance(b, float):
            return float(_COMPARE_CONST[op](a, b))
        if isinstance(a, float):  # s < A is A > s
            a, b, op = b, a, _COMPARE_FLIP[op]
        assert isinstance(a, str)
        floats = []
        for kind in _COMPARE_OPS[op]:  # >= is > or ==, as a max of the two masks (false for nan, as >= is)
            mask = fresh()
            op_name = kind + ("scalar" if isinstance(b, float) else "")
            other = Param.var(b, "float64") if isinstance(b, float) else Param.tensor(b, dtype)
            params = (Param.tensor(a, dtype), other)
            prog.append(Instr(op_name, params, (Param.tensor(mask, "bool"),)))
            floats.append(fresh())
            prog.append(Instr("todtype", (Param.tensor(mask, "bool"),), (Param.tensor(floats[-1], dtype),)))
        return floats[0] if len(floats) == 1 else emit("max", floats[0], floats[1])

    def walk(node: ast.AST) -> str | float:
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant):
            return float(node.value)  # type: ignore[arg-type]  # parse_fused allows int and float only
        if isinstance(node, ast.Name):
            return inputs[int(node.id[2:])]
        if isinstance(node, ast.UnaryOp):
            v = walk(node.operand)
            if isinstance(node.op, ast.UAdd):
                return v
            return -v if isinstance(v, float) else emit("neg", v)
        if isinstance(node, ast.BinOp):
            a, b = walk(node.left), walk(node.right)
            if isinstance(a, float) and isinstance(b, float):
                return _constant(_CONST_OPS[type(node.op)], a, b)
            both, right, left = _FUSED_BINARY[type(node.op)]
            if isinstance(b, float):
                return emit(right, a, b)
            if isinstance(a, float):  # s + A, s * A commute; s - A, s / A, s ** A have their own ops
                return emit(left, b, a) if left in ("addscalar", "mulscalar") else emit(left, a, b)
            return emit(both, a, b)
        if isinstance(node, ast.Compare):  # a mask: 1 where it holds, 0 where not; no gradient flows through it
            return compare(type(node.ops[0]), walk(node.left), walk(node.comparators[0]))
        assert isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
        name, args = node.func.id, [walk(x) for x in node.args]
        if name in _FUSED_CALLS:
            both, scalar, rscalar, const = _FUSED_CALLS[name]
            a, b = args
            if isinstance(a, float) and isinstance(b, float):
                return _constant(const, a, b)
            if isinstance(b, float):
                return emit(scalar, a, b)
            if isinstance(a, float):  # maximum and minimum commute; the divisions have ops of the scalar first
                return emit(rscalar, b, a) if rscalar == scalar else emit(rscalar, a, b)
            return emit(both, a, b)
        (a,) = args
        if isinstance(a, float):
            return _constant(_CONST_CALLS.get(name) or getattr(math, name), a)
        return emit(name, a)

    return prog, walk(tree)


@rule("fused")
def _fused(gr: Grad, g: str) -> dict[int, str]:
    """the rules of the elementwise ops that expr stands for, applied to expr's tree"""
    b = gr._builder
    idx = gr.items(0)
    names = [gr.x(i) for i in idx]
    shape, dt = gr.out_meta().shape, gr.out_meta().dtype
    fwd, root = unfuse(str(gr.arg(1)), names, dt, b.fresh)
    if isinstance(root, float):
        return {}
    if not fwd or check_program(fwd, b.sym)[-1].outs[0].shape != shape:  # type: ignore[union-attr]  # a bare input, or one the unused inputs broadcast
        name = b.fresh()
        fwd.append(Instr("broadcastTo", (Param.tensor(root, dt), Param.vector(shape)), (Param.tensor(name, dt),)))
        root = name
    wrt = sorted({n for i, n in zip(idx, names) if gr.needs(i)})
    back, grads = grad_program(fwd, root, wrt, b.sym, grad_loss=g, prefix=f"{b.fresh()}_")
    for instr in (*fwd, *back):
        b.append(instr)
    b.created.update(str(i.returns[0].value) for i in fwd)
    b.created.update(grads.values())
    out, seen = {}, set()
    for i, n in zip(idx, names):
        if gr.needs(i) and n not in seen:  # a name given twice: its gradient is already the sum
            seen.add(n)
            out[i] = grads[n]
    return out


__all__ = ["GRAD_RULES", "Grad", "Handle", "grad_program", "grad_rule", "rule_formula", "unfuse"]
