"""Autograd as an IR rewrite: from a forward program, the deepxIR instructions that compute its gradients.

`grad_program(forward, loss, wrt, env)` walks the forward program once (checking it with `bind` over a
`SymbolicEnv`, with a version per write of a name, so that in-place writes and reused names are told apart), finds
the instructions that lie on a path from a tensor in `wrt` to `loss`, and walks them backwards, asking the rule of
each op (`GRAD_RULES`, one small function per op) for instructions that turn the gradient of its output into
gradients of its inputs. Rules emit only ops of the catalogue. Gradients of a value read several times are summed;
broadcasting is undone by `sum` over the broadcast dims and a `reshape`. Every intermediate gets a fresh name that
starts with `prefix`, and is deleted (`deltensor`) right after its last use.

The backward reads forward values (inputs, and for some rules outputs) by name: they must still hold the values the
forward program computed, i.e. neither be overwritten nor deleted later in the forward program; otherwise the rule
that needs one raises DeepxError.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from deepx_sdk.errors import DeepxError
from deepx_sdk.ir.dtypes import FLOATS
from deepx_sdk.ir.instr import Instr, Param
from deepx_sdk.ir.ops import OPS, UNKNOWN, Bound, Env, SymbolicEnv, TensorMeta, bind

Key = tuple[str, int]  # a value: (tensor name, version); version 0 is the tensor as it is before the program


class _Node:
    """One forward instruction, bound: the value keys of its tensor args and of its outputs."""

    def __init__(self, b: Bound, ins: list[Key | None], outs: list[Key | None]) -> None:
        self.b = b
        self.ins = ins
        self.outs = outs


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
        return self.b.args[i]

    def out_meta(self, i: int = 0) -> TensorMeta:
        return self.b.outs[i]  # type: ignore[return-value]

    def x(self, i: int) -> str:
        """The name of forward tensor arg i; it must still hold the value the instruction read."""
        key = self.node.ins[i]
        assert key is not None
        return self._builder.available(key, self.op)

    def y(self, i: int = 0) -> str:
        """The name of forward output i; it must still hold the value the instruction wrote."""
        key = self.node.outs[i]
        assert key is not None
        return self._builder.available(key, self.op)

    def needs(self, i: int) -> bool:
        """Does tensor arg i need a gradient (it is reachable from wrt)?"""
        key = self.node.ins[i]
        return key is not None and key in self._builder.reachable

    # -- emitting
    def emit(self, op: str, *args: Any, dtype: str | None = None) -> str:
        """Append `op (args) -> (fresh)`; tensor args are names (str), the rest scalars, tuples (vectors). Returns the
        fresh output's name."""
        return self._builder.emit(op, args, dtype=dtype)

    def unbroadcast(self, g: str, meta: TensorMeta) -> str:
        return self._builder.unbroadcast(g, meta)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._builder.meta(name).shape


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


class _Builder:
    def __init__(self, forward: Sequence[Instr], env: Env, prefix: str) -> None:
        self.prefix = prefix
        self.env = env
        self.sym = SymbolicEnv(base=env)
        self.version: dict[str, int] = {}
        self.deleted: set[str] = set()
        self.nodes: list[_Node] = []
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
            for a, n in zip(b.op.args, b.names):
                if a.kind == "tensor":
                    ins.append((n, self.version.get(n, 0)))
                else:
                    ins.append(None)
            if b.op.name == "dropout":  # reads the tensor it writes
                ins.append((b.out_names[0], self.version.get(b.out_names[0], 0)))
            self.sym.apply(b)
            outs: list[Key | None] = []
            for a, n in zip(b.op.returns, b.out_names):
                if a.kind != "tensor":
                    outs.append(None)
                    continue
                self.version[n] = self.version.get(n, 0) + 1
                if b.op.name == "deltensor":
                    self.deleted.add(n)
                    outs.append(None)
                else:
                    self.deleted.discard(n)
                    outs.append((n, self.version[n]))
            self.nodes.append(_Node(b, ins, outs))

    # -- forward values
    def current(self, name: str) -> Key:
        return (name, self.version.get(name, 0))

    def available(self, key: Key, op: str) -> str:
        name, ver = key
        if name in self.deleted or self.version.get(name, 0) != ver:
            what = "deleted" if name in self.deleted else "overwritten"
            raise DeepxError(
                f"autograd: the gradient of {op} needs the value of '{name}', which the forward program {what} later; "
                "keep it (or write the later value under another name)"
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
        dims = list(range(lead)) + [i + lead for i, d in enumerate(target) if d == 1 and gshape[i + lead] != 1]
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
        fn = GRAD_RULES.get(name)
        if fn is None:
            raise DeepxError(f"autograd: op '{name}' has no gradient rule, and it lies between {sorted(wrt)} and the "
                             f"loss '{loss}'")
        g = grads[node.outs[0]]  # type: ignore[index]
        result = fn(Grad(bld, node), g)
        for i, gi in result.items():
            key = node.ins[i]
            assert key is not None
            want = node.b.args[i] if i < len(node.b.args) else bld.meta(key[0])
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


def _float_mask(gr: Grad, mask: str, like: TensorMeta) -> str:
    return gr.emit("todtype", mask, dtype=like.dtype)


@rule("add")
def _add(gr: Grad, g: str) -> dict[int, str]:
    out = {}
    if gr.needs(0):
        out[0] = gr.unbroadcast(g, gr.meta(0))
    if gr.needs(1):
        out[1] = gr.unbroadcast(g, gr.meta(1))
    return out


@rule("sub")
def _sub(gr: Grad, g: str) -> dict[int, str]:
    out = {}
    if gr.needs(0):
        out[0] = gr.unbroadcast(g, gr.meta(0))
    if gr.needs(1):
        out[1] = gr.unbroadcast(gr.emit("neg", g), gr.meta(1))
    return out


@rule("mul")
def _mul(gr: Grad, g: str) -> dict[int, str]:
    out = {}
    if gr.needs(0):
        out[0] = gr.unbroadcast(gr.emit("mul", g, gr.x(1)), gr.meta(0))
    if gr.needs(1):
        out[1] = gr.unbroadcast(gr.emit("mul", g, gr.x(0)), gr.meta(1))
    return out


@rule("div")
def _div(gr: Grad, g: str) -> dict[int, str]:
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
    out = {}
    a, b = gr.x(0), gr.x(1)
    if gr.needs(0):  # g B A^(B-1)
        p = gr.emit("pow", a, gr.emit("subscalar", b, 1.0))
        out[0] = gr.unbroadcast(gr.emit("mul", g, gr.emit("mul", b, p)), gr.meta(0))
    if gr.needs(1):  # g A^B log A
        out[1] = gr.unbroadcast(gr.emit("mul", g, gr.emit("mul", gr.y(), gr.emit("log", a))), gr.meta(1))
    return out


@rule("max", "min")
def _maxmin(gr: Grad, g: str) -> dict[int, str]:
    a, b = gr.x(0), gr.x(1)
    pick_a = gr.emit("greater" if gr.op == "max" else "less", a, b)  # ties go to B
    m = gr.emit("todtype", pick_a, dtype=gr.out_meta().dtype)
    out = {}
    ga = gr.emit("mul", g, m)
    if gr.needs(0):
        out[0] = gr.unbroadcast(ga, gr.meta(0))
    if gr.needs(1):
        out[1] = gr.unbroadcast(gr.emit("sub", g, ga), gr.meta(1))
    return out


@rule("addscalar", "subscalar", "copytensor")
def _identity(gr: Grad, g: str) -> dict[int, str]:
    return {0: g}


@rule("mulscalar")
def _mulscalar(gr: Grad, g: str) -> dict[int, str]:
    return {0: gr.emit("mulscalar", g, float(gr.arg(1)))}


@rule("divscalar")
def _divscalar(gr: Grad, g: str) -> dict[int, str]:
    return {0: gr.emit("divscalar", g, float(gr.arg(1)))}


@rule("rsubscalar")
def _rsubscalar(gr: Grad, g: str) -> dict[int, str]:
    return {1: gr.emit("neg", g)}


@rule("rdivscalar")
def _rdivscalar(gr: Grad, g: str) -> dict[int, str]:  # d(s/A) = -s / A^2
    a = gr.x(1)
    r = gr.emit("rdivscalar", -float(gr.arg(0)), gr.emit("mul", a, a))
    return {1: gr.emit("mul", g, r)}


@rule("powscalar")
def _powscalar(gr: Grad, g: str) -> dict[int, str]:  # s A^(s-1)
    s = float(gr.arg(1))
    p = gr.emit("mulscalar", gr.emit("powscalar", gr.x(0), s - 1.0), s)
    return {0: gr.emit("mul", g, p)}


@rule("rpowscalar")
def _rpowscalar(gr: Grad, g: str) -> dict[int, str]:  # s^A log s
    import math

    return {1: gr.emit("mulscalar", gr.emit("mul", g, gr.y()), math.log(float(gr.arg(0))))}


@rule("maxscalar", "minscalar")
def _maxminscalar(gr: Grad, g: str) -> dict[int, str]:
    mask = gr.emit("greaterscalar" if gr.op == "maxscalar" else "lessscalar", gr.x(0), float(gr.arg(1)))
    return {0: gr.emit("mul", g, _float_mask(gr, mask, gr.meta(0)))}


@rule("relu")
def _relu(gr: Grad, g: str) -> dict[int, str]:
    mask = gr.emit("greaterscalar", gr.x(0), 0.0)
    return {0: gr.emit("mul", g, _float_mask(gr, mask, gr.meta(0)))}


@rule("neg")
def _neg(gr: Grad, g: str) -> dict[int, str]:
    return {0: gr.emit("neg", g)}


@rule("abs")
def _abs(gr: Grad, g: str) -> dict[int, str]:
    a, m = gr.x(0), gr.meta(0)
    pos = _float_mask(gr, gr.emit("greaterscalar", a, 0.0), m)
    neg = _float_mask(gr, gr.emit("lessscalar", a, 0.0), m)
    return {0: gr.emit("mul", g, gr.emit("sub", pos, neg))}


@rule("exp")
def _exp(gr: Grad, g: str) -> dict[int, str]:
    return {0: gr.emit("mul", g, gr.y())}


@rule("log")
def _log(gr: Grad, g: str) -> dict[int, str]:
    return {0: gr.emit("div", g, gr.x(0))}


@rule("sqrt")
def _sqrt(gr: Grad, g: str) -> dict[int, str]:
    return {0: gr.emit("mulscalar", gr.emit("div", g, gr.y()), 0.5)}


@rule("sin")
def _sin(gr: Grad, g: str) -> dict[int, str]:
    return {0: gr.emit("mul", g, gr.emit("cos", gr.x(0)))}


@rule("cos")
def _cos(gr: Grad, g: str) -> dict[int, str]:
    return {0: gr.emit("neg", gr.emit("mul", g, gr.emit("sin", gr.x(0))))}


@rule("tan")
def _tan(gr: Grad, g: str) -> dict[int, str]:  # 1 + tan^2
    y = gr.y()
    return {0: gr.emit("mul", g, gr.emit("addscalar", gr.emit("mul", y, y), 1.0))}


@rule("sigmoid")
def _sigmoid(gr: Grad, g: str) -> dict[int, str]:
    y = gr.y()
    return {0: gr.emit("mul", g, gr.emit("mul", y, gr.emit("rsubscalar", 1.0, y)))}


@rule("tanh")
def _tanh(gr: Grad, g: str) -> dict[int, str]:
    y = gr.y()
    return {0: gr.emit("mul", g, gr.emit("rsubscalar", 1.0, gr.emit("mul", y, y)))}


@rule("silu")
def _silu(gr: Grad, g: str) -> dict[int, str]:  # s (1 + A (1 - s))
    a = gr.x(0)
    s = gr.emit("sigmoid", a)
    inner = gr.emit("addscalar", gr.emit("mul", a, gr.emit("rsubscalar", 1.0, s)), 1.0)
    return {0: gr.emit("mul", g, gr.emit("mul", s, inner))}


def _swap_last(rank: int) -> tuple[int, ...]:
    return (*range(rank - 2), rank - 1, rank - 2)


@rule("matmul")
def _matmul(gr: Grad, g: str) -> dict[int, str]:
    out = {}
    if gr.needs(0):  # g @ B^T
        b = gr.x(1)
        bt = gr.emit("transpose", b, _swap_last(len(gr.meta(1).shape)))
        out[0] = gr.unbroadcast(gr.emit("matmul", g, bt), gr.meta(0))
    if gr.needs(1):  # A^T @ g
        a = gr.x(0)
        at = gr.emit("transpose", a, _swap_last(len(gr.meta(0).shape)))
        out[1] = gr.unbroadcast(gr.emit("matmul", at, g), gr.meta(1))
    return out


@rule("sum")
def _sum(gr: Grad, g: str) -> dict[int, str]:
    shape = gr.meta(0).shape
    dims = {d % len(shape) for d in gr.arg(1)} if gr.arg(1) else set(range(len(shape)))
    if not gr.arg(2):
        g = gr.emit("reshape", g, tuple(1 if i in dims else d for i, d in enumerate(shape)))
    return {0: gr.emit("broadcastTo", g, tuple(shape))}


@rule("reshape")
def _reshape(gr: Grad, g: str) -> dict[int, str]:
    return {0: gr.emit("reshape", g, tuple(gr.meta(0).shape))}


@rule("transpose")
def _transpose(gr: Grad, g: str) -> dict[int, str]:
    perm = [p % len(gr.meta(0).shape) for p in gr.arg(1)]
    inv = [0] * len(perm)
    for i, p in enumerate(perm):
        inv[p] = i
    return {0: gr.emit("transpose", g, tuple(inv))}


@rule("broadcastTo")
def _broadcast_to(gr: Grad, g: str) -> dict[int, str]:
    return {0: gr.unbroadcast(g, gr.meta(0))}


@rule("todtype")
def _todtype(gr: Grad, g: str) -> dict[int, str]:
    return {0: gr.emit("todtype", g, dtype=gr.meta(0).dtype)}


@rule("softmax")
def _softmax(gr: Grad, g: str) -> dict[int, str]:  # y (g - sum(g y))
    y, dim = gr.y(), gr.arg(1)
    s = gr.emit("sum", gr.emit("mul", g, y), (dim,), True)
    return {0: gr.emit("mul", y, gr.emit("sub", g, s))}


@rule("logsoftmax")
def _logsoftmax(gr: Grad, g: str) -> dict[int, str]:  # g - exp(y) sum(g)
    y, dim = gr.y(), gr.arg(1)
    s = gr.emit("sum", g, (dim,), True)
    return {0: gr.emit("sub", g, gr.emit("mul", gr.emit("exp", y), s))}


@rule("crossentropy")
def _crossentropy(gr: Grad, g: str) -> dict[int, str]:
    """(softmax(logits) - onehot(labels)) * keep, scaled by g (and 1 / count of kept labels for mean)."""
    if gr.needs(1):
        raise DeepxError("autograd: crossentropy labels cannot take a gradient")
    logits, labels = gr.x(0), gr.x(1)
    (n, c), lm = gr.meta(0).shape, gr.meta(1)
    dt = gr.meta(0).dtype
    ignore, reduction = int(gr.arg(2)), gr.arg(3)
    b = gr._builder
    classes = b.fresh()
    b.append(Instr("newtensor", (Param.vector((1, c)),), (Param.tensor(classes, lm.dtype),)))
    b.append(Instr("arange", (Param.var(0), Param.var(1)), (Param.tensor(classes, lm.dtype),)))
    b.created.add(classes)
    col = gr.emit("reshape", labels, (n, 1))
    onehot = gr.emit("todtype", gr.emit("equal", col, classes), dtype=dt)
    keep = gr.emit("reshape", gr.emit("todtype", gr.emit("notequalscalar", labels, ignore), dtype=dt), (n, 1))
    diff = gr.emit("mul", gr.emit("sub", gr.emit("softmax", logits, 1), onehot), keep)
    if reduction == "none":
        scale = gr.emit("reshape", g, (n, 1))
    elif reduction == "mean":
        scale = gr.emit("div", g, gr.emit("sum", keep, (), False))
    else:
        scale = g
    return {0: gr.emit("mul", diff, scale)}


@rule("mse")
def _mse(gr: Grad, g: str) -> dict[int, str]:
    a, b = gr.x(0), gr.x(1)
    n = 1
    for d in gr.meta(0).shape:
        n *= d
    k = 2.0 / n if gr.arg(2) == "mean" else 2.0
    ga = gr.emit("mul", gr.emit("mulscalar", gr.emit("sub", a, b), k), g)
    out = {}
    if gr.needs(0):
        out[0] = ga
    if gr.needs(1):
        out[1] = gr.emit("neg", ga)
    return out


@rule("indexselect")
def _indexselect(gr: Grad, g: str) -> dict[int, str]:
    zeros = gr._builder.filled(gr.meta(0), 0.0)
    return {0: gr.emit("indexadd", zeros, gr.x(1), g, int(gr.arg(2)))}


__all__ = ["GRAD_RULES", "Grad", "grad_program"]
