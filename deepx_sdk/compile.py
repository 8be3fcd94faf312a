"""dx.compile: capture one call of a function (a whole training step: forward, the backward expansion, optimizer
updates) as a program, store it in the storage plane as `graph:<name>`, and run later calls by replaying it by name.

    step = dx.compile(train_step)      # train_step(x, y) -> loss
    loss = step(x, y)                   # first call with these shapes: runs normally and stores the graph
    loss = step(x2, y2)                 # same shapes: one `replay` request, no tracing, no program sent
    loss.item()

A graph is traced once per signature (the inputs' shapes, dtypes and requires_grad, the values of non-tensor
arguments, the function's code, the parameters and train/eval mode of the modules and the state of the optimizers it
uses), as torch.compile and jax.jit do: Python side effects and data-dependent control flow happen at capture only.
See docs/graphs.md.

The stored record (msgpack, the program map of docs/storage.md plus what a replay needs):

    {"v": 1, "instrs": [...], "inputs": [[name, dtype, shape], ...], "outputs": [[name, dtype, shape], ...],
     "scalars": [[instruction, arg, key], ...], "state": [name, ...], "signature": str, "returns": spec,
     "source": str}
"""

from __future__ import annotations

import functools
import gc
import hashlib
import logging
import math
import re
import sys
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, overload

import numpy as np

from deepx_core.cache import Cache
from deepx_core.errors import DeepxError
from deepx_core.graphrecord import GraphRecord, check_graph_name
from deepx_core.ir.dtypes import to_numpy
from deepx_core.ir.effects import FILLS, apply_effect, kind_of
from deepx_core.ir.instr import Instr, Param
from deepx_core.ir.ops import OPS
from deepx_core.ir.wire import instr_from_obj
from deepx_sdk.optim import sgd_step
from deepx_sdk.session import Session, session
from deepx_sdk.transports import NativeTransport, Transport

log = logging.getLogger(__name__)

#: outputs of at most this many elements come back with each replay (Tensor._v): a loss read next costs nothing
SMALL_OUTPUT = 64
#: signatures a compiled function remembers the digest of (CompiledFunction._key)
KEYS_MAX = 256
_BAD_NAME_CHARS = re.compile(r"[^A-Za-z0-9_.-]")
#: ops whose output must exist before they run (they fill it): a first write by one of them is a use of a tensor
#: from outside the graph
_OPTIMIZER_OPS = frozenset({"sgd", "adam", "adamw"})


# ------------------------------------------------------------------------------------------------ capture


class _Capture(Transport):
    """Stands in for the session's transport while a call is captured: every program and every backward
    expansion is run as usual and also appended to `instrs`."""

    def __init__(self, inner: Transport, s: Session) -> None:
        self.inner = inner
        self.session = s
        self.instrs: list[Instr] = []
        self.can_read = inner.can_read
        self.explicit_broadcast = inner.explicit_broadcast
        self.address = getattr(inner, "address", "?")

    def run(self, program: Sequence[Instr], fetch: Sequence[str]) -> Any:
        # never backward instructions: Tensor.backward sends each on its own while a call is captured
        self.instrs.extend(program)
        return self.inner.run(program, fetch)

    def put(self, name: str, array: np.ndarray, heap: bool) -> None:
        self.session.names.never_made(name)  # its handle exists, its tensor never will: Python must not delete it
        raise DeepxError(f"dx.compile: the function sends data from Python (a {array.dtype}{list(array.shape)} "
                         "array, by dx.tensor or similar) while it is captured; such a constant would be frozen into "
                         "the graph. Pass it as an argument instead (or create it once, outside the function)")

    def backward(self, forward: Sequence[Instr], loss: str, wrt: Sequence[str], grad_loss: str | None,
                 prefix: str, names: dict[str, str] | None = None) -> dict[str, str]:
        grads, program = _link(self.inner).backward_program(forward, loss, wrt, grad_loss, prefix, names)
        self.instrs.extend(program)
        return grads

    def refuse_read(self, names: Sequence[str]) -> DeepxError:
        return DeepxError(
            f"dx.compile: the function reads a tensor value ({', '.join(names)}: .item(), .numpy(), print, bool() or "
            "a comparison used in an `if`) while it is captured; a stored graph runs without Python, so it cannot "
            "hand a value to Python midway. Return the tensor from the function and read it after the call")


def _graph_name(base: str) -> str:
    return _BAD_NAME_CHARS.sub("_", base.replace(".<locals>.", ".")).strip(".-_") or "graph"


class _Build:
    """Turns the captured instructions into a graph with private names."""

    def __init__(self, gname: str, inputs: dict[str, int], outside: Callable[[str], bool]) -> None:
        self.gname = gname
        self.outside = outside
        self.current: dict[str, str] = {n: f"{gname}.in{k}" for n, k in inputs.items()}  # capture name -> graph
        self.temps = 0
        self.state: dict[str, None] = {}
        self.deleted_state: set[str] = set()

    def read(self, name: str) -> str:
        g = self.current.get(name)
        if g is None:  # from outside the graph: a parameter, an optimizer buffer, a tensor fn closes over
            g = self.current[name] = name
            self.state[name] = None
        return g

    def write(self, name: str, instr: Instr) -> str:
        g = self.current.get(name)
        if g is None:
            # a write into a tensor from outside: an op that fills an existing tensor, or an assignment in place
            # (x.add_(1) is copytensor into x) into one Python held when the call began. Other results only ever
            # get a fresh name or one Python dropped (the session's pool), which belongs to the graph from here on
            if kind_of(instr) is FILLS or (instr.name == "copytensor" and self.outside(name)):
                return self.read(name)
            g = self.current[name] = f"{self.gname}.t{self.temps}"
            self.temps += 1
        return g

    def delete(self, name: str) -> str | None:
        g = self.current.pop(name, None)
        if g is None:
            return None  # a tensor from before the call, never used by it: not part of the graph
        if g == name:  # state, or the caller's input
            self.deleted_state.add(name)
            return None
        if g.startswith(f"{self.gname}.in"):
            self.deleted_state.add(name)
            return None
        return g


def _rename(instr: Instr, args: tuple[Param, ...], rets: tuple[Param, ...]) -> Instr:
    return Instr(instr.name, args, rets, instr.meta)


Meta = tuple[str, str, tuple[int, ...]]
Slot = tuple[int, int, str]


def build_graph(gname: str, captured: Sequence[Instr], inputs: Sequence[Meta], outputs: Sequence[Meta],
                outside: Callable[[str], bool] | None = None) -> tuple[list[Instr], list[str], list[str], list[Slot]]:
    """The stored program of a capture: (instructions, output graph names, state names, scalar slots).

    Tensors the call made get private names (so a replay never touches a name the session hands out again); tensors
    from outside keep theirs (parameters and optimizer buffers, updated in place by every replay); deletions of
    tensors from before the call are not part of the graph; what the graph makes and does not return is deleted
    at its end. `outside(name)`: whether a tensor existed for Python when the call began (a copy into one is an
    update in place)."""
    b = _Build(gname, {n: k for k, (n, _, _) in enumerate(inputs)}, outside or (lambda name: False))
    out: list[Instr] = []
    slots: list[tuple[int, int, str]] = []
    seeds: dict[int, str] = {}  # a seed the call drew -> its key: a backward's dropout redraws the forward's mask
    for instr in captured:
        if apply_effect(instr).deleted:
            g = b.delete(str(instr.returns[0].value))
            if g is not None:
                out.append(_rename(instr, (), (instr.returns[0]._replace(value=g),)))
            continue
        args = []
        for p in instr.args:
            if p.category == "tensor":
                p = p._replace(value=b.read(str(p.value)))
            elif p.category == "listtensor" and isinstance(p.value, tuple):
                p = p._replace(value=tuple(b.read(str(v)) for v in p.value))
            args.append(p)
        rets = []
        for p in instr.returns:
            if p.category == "tensor":
                p = p._replace(value=b.write(str(p.value), instr))
            rets.append(p)
        op = OPS.get(instr.name)
        if op is not None and (instr.name in _OPTIMIZER_OPS or op.family == "init"):
            for j, (a, p) in enumerate(zip(op.args, instr.args)):
                if p.category != "var":
                    continue
                if instr.name in _OPTIMIZER_OPS:
                    slots.append((len(out), j, f"{args[0].value}.{a.name}"))
                elif a.name == "seed":
                    drawn = p.value if type(p.value) is int else None
                    key = f"seed.{len(out)}"
                    if drawn:  # 0 is fresh entropy per op; a drawn seed is shared by every op that uses it
                        key = seeds.setdefault(drawn, key)
                    slots.append((len(out), j, key))
        out.append(_rename(instr, tuple(args), tuple(rets)))
    if b.deleted_state:
        freed = ", ".join(sorted(b.deleted_state))
        raise DeepxError(f"dx.compile: the function frees tensors it did not make ({freed}) after reading them; a "
                         "replay would find them gone. Keep them alive, or pass them in")
    # the returned tensors become the graph's outputs; everything else the graph made is freed at its end
    out_names: list[str] = []
    final: dict[str, str] = {}
    for k, (name, _, _) in enumerate(outputs):
        g = b.current.get(name)
        if g is None or not g.startswith(f"{gname}.t"):
            raise DeepxError(f"dx.compile: the function returns tensor '{name}', which it did not compute (an input, a "
                             "parameter or a tensor from outside); return only tensors the function computes (use "
                             ".clone() to return a copy)")
        final[g] = f"{gname}.out{k}"
        out_names.append(final[g])
    live = {g for g in b.current.values() if g.startswith(f"{gname}.t")}
    for g in sorted(live - set(final), key=lambda s: int(s.rsplit(".t", 1)[1])):
        out.append(Instr("deltensor", (), (Param.tensor(g),)))
    if final:
        def sub(p: Param) -> Param:
            if p.category == "tensor" and str(p.value) in final:
                return p._replace(value=final[str(p.value)])
            if p.category == "listtensor" and isinstance(p.value, tuple) and any(str(v) in final for v in p.value):
                return p._replace(value=tuple(final.get(str(v), str(v)) for v in p.value))
            return p

        out = [Instr(i.name, tuple(map(sub, i.args)), tuple(map(sub, i.returns)), i.meta) for i in out]
    return out, out_names, list(b.state), slots


# ------------------------------------------------------------------------------------------------ the daemon link


class _Link:
    """The graph requests, over whichever transport the session uses."""

    def __init__(self, transport: Transport) -> None:
        self.t = transport

    def _native(self) -> Any:
        return self.t.client if isinstance(self.t, NativeTransport) else None

    def _embedded(self, what: str) -> Any:
        """The embedded node (deepxd.embedded.EmbeddedNode) this session runs on; DeepxError naming `what` where the
        transport is neither it nor a native socket."""
        e = getattr(self.t, "embedded", None)
        if e is None:
            raise DeepxError(f"{what} needs a deepxd (embedded, unix:// or tcp://); {getattr(self.t, 'address', '?')} "
                             "cannot store or replay graphs")
        return e

    def _call(self, coro: Any) -> Any:
        return self.t._call(coro)  # type: ignore[attr-defined]

    def backward_program(self, forward: Sequence[Instr], loss: str, wrt: Sequence[str], grad_loss: str | None,
                         prefix: str, names: dict[str, str] | None = None) -> tuple[dict[str, str], list[Instr]]:
        c = self._native()
        if c is not None:
            from deepx_core.ir.wire import pack_instr_cached

            r = c.request("backward", forward=[pack_instr_cached(i) for i in forward], loss=loss, wrt=list(wrt),
                          grad_loss=grad_loss, prefix=prefix, capture=True, names=names)
            return dict(r["grads"]), [instr_from_obj(o) for o in r["program"]]
        r = self._call(self._embedded("dx.compile's gradients").backward(forward, loss, wrt, grad_loss, prefix,
                                                                           names, capture=True))
        return dict(r["grads"]), list(r["program"])

    def store(self, name: str, data: bytes) -> dict[str, Any]:
        c = self._native()
        if c is not None:
            r = c.request("graph_store", name=name, data=data)
            return {k: v for k, v in r.items() if k not in ("id", "ok")}
        return self._call(self._embedded("dx.compile").graph_store(name, data))  # type: ignore[no-any-return]

    def drop(self, name: str) -> dict[str, Any]:
        c = self._native()
        if c is not None:
            r = c.request("graph_drop", name=name)
            return {k: v for k, v in r.items() if k not in ("id", "ok")}
        return self._call(self._embedded("dx.compile").graph_drop(name))  # type: ignore[no-any-return]

    def get(self, name: str) -> bytes | None:
        c = self._native()
        if c is not None:
            data = c.request("graph_get", name=name).get("data")
            return bytes(data) if data is not None else None
        return self._call(self._embedded("dx.compile").graph_get(name))  # type: ignore[no-any-return]

    def replay(self, name: str, inputs: dict[str, Any], outputs: dict[str, str], scalars: dict[str, Any],
               fetch: Sequence[str] = ()) -> dict[str, np.ndarray]:
        c = self._native()
        if c is not None:
            from deepx_sdk.client import decode_tensor

            r = c.request("replay", name=name, inputs=inputs, outputs=outputs, scalars=scalars, fetch=list(fetch))
            if not r.get("ok"):
                raise DeepxError(r.get("error") or f"replay of graph {name!r} failed")
            return {k: decode_tensor(v) for k, v in (r.get("tensors") or {}).items()}
        e, args = self._embedded("dx.compile"), (name, inputs, outputs, scalars, list(fetch))
        # with no event loop step where the scheduler can (Scheduler.now_replay)
        result = self.t.now_or_ask(e.now_replay, args, lambda: e.replay(*args))  # type: ignore[attr-defined]
        if result.error:
            raise DeepxError(result.error)
        return dict(result.tensors)

    def explain(self, name: str) -> dict[str, Any]:
        c = self._native()
        if c is not None:
            r = c.request("explain", graph=name)
            return {k: r[k] for k in ("before", "after", "passes")}
        return self._call(self._embedded("dx.explain").explain(name))  # type: ignore[no-any-return]

    def graphs(self) -> list[dict[str, Any]]:
        c = self._native()
        if c is not None:
            return list(c.admin("graphs"))
        return list(self._call(self._embedded("dx.graphs").graphs()))


def _link(transport: Transport) -> _Link:
    return _Link(transport.inner if isinstance(transport, _Capture) else transport)


# ------------------------------------------------------------------------------------------------ signatures


def _is_tensor(x: Any) -> bool:
    from deepx_sdk.tensor import Tensor

    return isinstance(x, Tensor)


def _leaves(obj: Any, path: str, out: list[tuple[str, Any]]) -> None:
    """Tensors and arrays in an argument (through tuples, lists and dicts), in order; other values as they are."""
    if isinstance(obj, (tuple, list)):
        for k, v in enumerate(obj):
            _leaves(v, f"{path}[{k}]", out)
    elif isinstance(obj, dict):
        for k in sorted(obj, key=repr):
            _leaves(obj[k], f"{path}[{k!r}]", out)
    else:
        out.append((path, obj))


# code object -> _code_digest (code objects never change)
_DIGESTS: Cache[Any, str] = Cache("sdk.code_digests", 1024, counted=False)


def _code_digest(code: Any) -> str:
    known = _DIGESTS.get(code)
    if known is not None:
        return known
    parts = [code.co_code, repr(code.co_names)]
    for c in code.co_consts:
        parts.append(_code_digest(c) if hasattr(c, "co_code") else repr(c))
    digest = hashlib.sha1("|".join(p if isinstance(p, str) else p.hex() for p in parts).encode()).hexdigest()
    _DIGESTS.put(code, digest)
    return digest


def _discover(fn: Callable[..., Any], args: Sequence[Any]) -> tuple[list[Any], list[Any]]:
    """The modules and optimizers a function uses: in its arguments, its closure, the globals it names, and the
    object it is bound to (one or two levels into containers and attributes)."""
    from deepx_sdk.nn import Module
    from deepx_sdk.optim import Optimizer

    mods: list[Any] = []
    opts: list[Any] = []
    seen: set[int] = set()

    def visit(obj: Any, depth: int) -> None:
        if id(obj) in seen or obj is None or isinstance(obj, (str, bytes, int, float, np.ndarray, type)):
            return
        seen.add(id(obj))
        if isinstance(obj, Module):
            mods.append(obj)
        elif isinstance(obj, Optimizer):
            opts.append(obj)
        elif depth > 0:
            if isinstance(obj, (list, tuple, set, frozenset)):
                for o in obj:
                    visit(o, depth - 1)
            elif isinstance(obj, dict):
                for o in obj.values():
                    visit(o, depth - 1)
            elif hasattr(obj, "__dict__") and not callable(obj) and type(obj).__module__ != "builtins":
                for o in vars(obj).values():
                    visit(o, depth - 1)

    for a in args:
        visit(a, 2)
    target = getattr(fn, "__func__", fn)
    visit(getattr(fn, "__self__", None), 2)
    for cell in getattr(target, "__closure__", None) or ():
        try:
            visit(cell.cell_contents, 2)
        except ValueError:  # an empty cell
            pass
    code = getattr(target, "__code__", None)
    if code is not None:
        g = getattr(target, "__globals__", {})
        names: set[str] = set()
        stack = [code]
        while stack:
            c = stack.pop()
            names.update(c.co_names)
            stack.extend(k for k in c.co_consts if hasattr(k, "co_code"))
        for n in sorted(names):
            if n in g:
                visit(g[n], 1)
    return mods, opts


def _unused_grads(mods: Sequence[Any], instrs: Sequence[Instr], returned: set[str],
                  before: dict[int, Any]) -> list[str]:
    """The parameters whose .grad the captured call made (a new handle, written by one of its instructions) and then
    neither read nor returned. A .grad the call added into in place (the handle it had before) is state the replay
    updates, as the parameters."""
    made: dict[str, int] = {}
    last_read: dict[str, int] = {}
    for i, instr in enumerate(instrs):
        for p in instr.args:
            if p.category == "tensor":
                last_read[str(p.value)] = i
            elif p.category == "listtensor" and isinstance(p.value, tuple):
                for v in p.value:
                    last_read[str(v)] = i
        for name in apply_effect(instr).writes:
            made.setdefault(name, i)  # where it is made (an update may write it again)
    out = []
    for m in mods:
        for k, p in m.structure()[0]:
            g = p.grad
            if g is None or g is before.get(id(p)) or g.name in returned or g.name not in made:
                continue
            if last_read.get(g.name, -1) <= made[g.name]:
                out.append(k)
    return out


#: param-group settings a replay reads from the group at every call (the updates' scalars), and a schedule's own
_REPLAYED_SETTINGS = frozenset({"params", "lr", "momentum", "dampening", "weight_decay", "nesterov", "betas", "eps",
                                "initial_lr"})


def _state_signature(mods: Sequence[Any], opts: Sequence[Any], grads: bool = True) -> tuple[Any, ...]:
    """The parameters of the modules and the state tensors of the optimizers; with `grads`, also which parameters
    hold a gradient (a backward adds to it: a call that starts with gradients is another program)."""
    from deepx_sdk.tensor import Tensor

    parts: list[Any] = []
    for m in mods:
        parts.append(tuple([(k, p.name, p.shape, p.dtype, p.requires_grad) + ((p.grad is None,) if grads else ())
                            for k, p in m.structure()[0]]))
    for o in opts:
        # the optimizer itself: a graph's updates read their numbers from the optimizer they were captured with.
        # Its settings are read afresh at every replay (a schedule of lr, momentum or weight decay must not capture
        # anew at every call: review), except what shapes the program: whether SGD has momentum (a buffer), and
        # settings the replay does not know
        parts.append((type(o).__qualname__, id(o)))
        for group in o.param_groups:
            row: list[Any] = [bool(group.get("momentum")),
                              tuple(sorted((k, repr(v)) for k, v in group.items() if k not in _REPLAYED_SETTINGS))]
            for p in group["params"]:
                st = o.state.get(id(p), {})
                row.append((p.name, p.requires_grad, tuple(sorted((k, v.name) for k, v in st.items()
                                                                   if isinstance(v, Tensor))))
                           + ((p.grad is None,) if grads else ()))
            parts.append(tuple(row))
    return tuple(parts)


# ------------------------------------------------------------------------------------------------ compiled functions


@dataclass
class _Graph:
    name: str
    record: GraphRecord
    held: list[Any]  # tensors from outside that the graph reads: kept alive while the graph is in use
    updates: list[tuple[Any, Any, dict[str, Any]]] = field(default_factory=list)  # (optimizer, param, group)
    plan: list[tuple[int, str, Any, Any]] | None = None  # where each replay scalar comes from (_scalar_plan)

    @property
    def instructions(self) -> int:
        return len(self.record.instrs)


@dataclass
class Explained:
    """A stored program and what the daemon's passes make of it (the plan every replay runs)."""

    name: str
    before: str
    after: str
    passes: list[str]

    def __str__(self) -> str:
        return (f"graph {self.name}\n-- before the passes --\n{self.before}\n-- after the passes "
                f"({', '.join(self.passes) or 'none'}) --\n{self.after}")


@dataclass
class Placed:
    """Where a program ran (`dx.explain()`): the node it was sent to, each instruction's node and worker with what
    moved for it ({tensor, from, to, bytes}), what was brought back to the node at the end, and the bytes moved in
    all. A program placed on one node's worker alone moved nothing (docs/cluster.md, "Programs across nodes")."""

    node: str
    instructions: list[dict[str, Any]]
    back: list[dict[str, Any]]
    bytes: int

    def __str__(self) -> str:
        def moved(ms: list[dict[str, Any]]) -> str:
            return ", ".join(f"{m['tensor']} {m['from']} -> {m['to']} ({m['bytes']} B"
                             f"{', through ' + m['via'] if m.get('via') else ''})" for m in ms)

        lines = [f"program on node {self.node}: {len(self.instructions)} instructions, {self.bytes} bytes moved"]
        for r in self.instructions:
            lines.append(f"{r['index'] + 1:>4}  {r['node']:<16} {r['worker']:<12} {r['instr']}"
                         + (f"   moved: {moved(r['moved'])}" if r["moved"] else ""))
        if self.back:
            lines.append(f"      brought back: {moved(self.back)}")
        return "\n".join(lines)


def _placed(s: Session) -> Placed:
    """Placed of the session's last program: from its reply where it ran across nodes, else all on the node's
    worker."""
    from deepx_core.ir.text import format_text

    last = s.recorder.last_run
    if last is None:
        raise DeepxError("dx.explain(): this session has run no program yet (give a graph, or run something first)")
    program, placement = last
    if placement is not None:
        return Placed(str(placement.get("node", "")), list(placement.get("instructions") or []),
                      list(placement.get("back") or []), int(placement.get("bytes", 0)))
    node, worker = s.transport.where()
    return Placed(node, [{"index": i, "instr": format_text(instr), "node": node, "worker": worker, "moved": []}
                         for i, instr in enumerate(program)], [], 0)


def _drop_when_gone(made: list[tuple[Any, str]]) -> None:
    """A compiled function was collected (in any thread): its graphs go with the sessions' next programs."""
    for s, name in made:
        s.recorder.drop_graph(name)


class CompiledFunction:
    """What dx.compile returns: call it as the function itself."""

    def __init__(self, fn: Callable[..., Any], name: str | None = None) -> None:
        if not callable(fn):
            raise DeepxError(f"dx.compile: expected a function, got {type(fn).__name__}")
        self.fn = fn
        self.base = _graph_name(name if name is not None else str(getattr(fn, "__qualname__", None) or
                                                                   getattr(fn, "__name__", "graph")))
        if name is not None:
            check_graph_name(self.base)
        self._graphs: dict[str, _Graph] = {}
        self._keys: dict[tuple[Any, ...], str] = {}  # signature -> its digest (_key)
        # (session, graph name) of every graph this function stored or took from the plane: when the function goes,
        # each session lets go of their plans and the temporaries their replays keep allocated (Recorder.graph_drops)
        self._made: list[tuple[Any, str]] = []
        weakref.finalize(self, _drop_when_gone, self._made).atexit = False
        self.captures = 0  # calls that traced the function
        self.replays = 0
        self.last: _Graph | None = None
        functools.update_wrapper(self, fn)

    def __get__(self, obj: Any, objtype: Any = None) -> Any:
        """As a method decorator: the instance is the first argument (its modules and optimizers are found on it)."""
        if obj is None:
            return self
        return functools.partial(self, obj)

    @property
    def graph_names(self) -> list[str]:
        """The stored graphs this function has used, one per signature."""
        return [g.name for g in self._graphs.values()]

    def _signature(self, s: Session, leaves: list[tuple[str, Any]], mods: Sequence[Any],
                   opts: Sequence[Any]) -> tuple[Any, ...]:
        """What tells this function's graphs apart, as nested tuples (hashable where its values are: _key)."""
        target = getattr(self.fn, "__func__", self.fn)
        code = getattr(target, "__code__", None)
        parts: list[Any] = [self.base, _code_digest(code) if code is not None else repr(self.fn), s.grad_enabled]
        first: dict[Any, int] = {}  # the same tensor twice is one input: which leaves alias is part of the signature
        for k, (path, v) in enumerate(leaves):
            if _is_tensor(v):
                parts.append((path, "T", v.shape, v.dtype, v.requires_grad, first.setdefault(v.name, k)))
            elif isinstance(v, np.ndarray):
                parts.append((path, "A", v.shape, str(v.dtype), first.setdefault(id(v), k)))
            elif isinstance(v, (bool, int, float, str, bytes, type(None))):
                parts.append((path, "V", type(v).__name__, repr(v)))
            else:  # modules, optimizers and other objects: by identity (their tensors are in the state part)
                parts.append((path, "O", type(v).__qualname__, id(v)))
        parts.append(_state_signature(mods, opts))
        # train() and eval() trace apart, and so do settings a module holds outside its parameters (Dropout's p,
        # a layer's eps): what its extra_repr shows (two lambdas of one code over two Dropouts are two graphs)
        parts.append(tuple([(type(mm).__qualname__, mm.training, mm.extra_repr())
                            for m in mods for mm in m.structure()[1]]))
        # the process group a collective in it names, and this rank of it (the graphs of the ranks of one job, and of
        # two jobs, are told apart in the plane they share)
        dist = sys.modules.get("deepx_sdk.distributed")
        if dist is not None and dist.is_initialized():
            g = dist._default(None, "dx.compile")
            parts.append(("group", g.name, g.gen, g.rank, g.world_size))
        return tuple(parts)

    def _key(self, sig: tuple[Any, ...]) -> str:
        """The signature's digest (its stored graphs' names), remembered per signature: a replay's call then hashes
        the tuple instead of printing and digesting it."""
        try:
            key = self._keys.get(sig)
        except TypeError:  # (a value in it that does not hash)
            return hashlib.sha1(repr(sig).encode()).hexdigest()[:12]
        if key is None:
            if len(self._keys) >= KEYS_MAX:
                self._keys.clear()
            key = self._keys[sig] = hashlib.sha1(repr(sig).encode()).hexdigest()[:12]
        return key

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        s = session()
        leaves: list[tuple[str, Any]] = []
        _leaves(list(args), "args", leaves)
        _leaves(kwargs, "kwargs", leaves)
        mods, opts = _discover(self.fn, [*args, *kwargs.values()])
        key = self._key(self._signature(s, leaves, mods, opts))
        g = self._graphs.get(key)
        if g is None:
            g = self._find_stored(s, key, opts)
        if g is not None:
            self.last = g
            return self._replay(s, g, leaves)
        return self._capture(s, key, args, kwargs, leaves, mods, opts)

    # -- a stored graph of this signature (another process, or before a daemon restart, stored it)
    def _find_stored(self, s: Session, key: str, opts: Sequence[Any]) -> _Graph | None:
        name = f"{self.base}-{key}"
        s.sync()
        data = _link(s.transport).get(name)
        if data is None:
            return None
        try:
            rec = GraphRecord.unpack(data, name)
        except DeepxError as e:
            log.warning("dx.compile: ignoring stored graph %s: %s", name, e)
            return None
        if rec.signature != key:
            return None
        g = _Graph(name, rec, [], [])
        if not self._bind_state(g, opts):
            return None
        self._graphs[key] = g
        self._made.append((s, name))
        s.recorder.graph_made(name)
        return g

    def _bind_state(self, g: _Graph, opts: Sequence[Any]) -> bool:
        """Find the optimizer entry for each update in the graph, and keep the tensors it reads alive."""
        by_name: dict[str, tuple[Any, Any, dict[str, Any]]] = {}
        for o in opts:
            for group in o.param_groups:
                for p in group["params"]:
                    by_name[p.name] = (o, p, group)
        g.updates = []
        g.plan = None
        for i, j, _ in g.record.scalars:
            if _is_step(g.record.instrs[i], j):
                pname = str(g.record.instrs[i].args[0].value)
                if pname not in by_name:
                    return False
                g.updates.append(by_name[pname])
        want = set(g.record.state)
        g.held = _alive(want, opts)
        return {t.name for t in g.held} >= want

    # -- capture
    def _capture(self, s: Session, key: str, args: tuple[Any, ...], kwargs: dict[str, Any],
                 leaves: list[tuple[str, Any]], mods: Sequence[Any], opts: Sequence[Any]) -> Any:
        """Capture one call: under the session's lock, since the recorder stands in for the session's transport
        and another thread's instructions meanwhile would be taken into the graph."""
        with s._lock:
            return self._capture_locked(s, key, args, kwargs, leaves, mods, opts)

    def _capture_locked(self, s: Session, key: str, args: tuple[Any, ...], kwargs: dict[str, Any],
                        leaves: list[tuple[str, Any]], mods: Sequence[Any], opts: Sequence[Any]) -> Any:
        from deepx_sdk.tensor import tensor

        # arrays become tensors first (they are the graph's inputs, sent before the capture starts)
        arrays = {id(v): tensor(v) for _, v in leaves if isinstance(v, np.ndarray)}
        if arrays:
            args, kwargs = _swap_arrays((args, kwargs), arrays)
        in_leaves: list[tuple[str, Any]] = []
        _leaves([list(args), kwargs], "", in_leaves)
        inputs: dict[str, tuple[str, str, tuple[int, ...]]] = {}
        for _, v in in_leaves:
            if _is_tensor(v) and v.name not in inputs:
                inputs[v.name] = (v.name, v.dtype, v.shape)
        s.sync()
        before = repr(_state_signature(mods, opts, grads=False))
        grads_before = {id(p): p.grad for m in mods for _, p in m.structure()[0]}
        outside = _outside(s)
        rec = _Capture(s.transport, s)
        with s.recorder.capturing(rec):
            result = self.fn(*args, **kwargs)
            s.sync()
        self.captures += 1
        if repr(_state_signature(mods, opts, grads=False)) != before:
            # the call made new state (an optimizer's first step creates its buffers): what it recorded makes them,
            # which a replay must not do again. It ran; the next call with this signature is captured.
            log.debug("dx.compile: %s created state; capturing on the next call", self.base)
            return result
        outs: list[tuple[str, str, tuple[int, ...]]] = []
        spec = _spec(result, outs)
        unused = _unused_grads(mods, rec.instrs, {n for n, _, _ in outs}, grads_before)
        if unused:
            # a replay's gradients are its own temporaries: ones nothing in the call reads would be dropped, and a
            # later call (an optimizer step, another micro-batch) would not see them, with no error
            raise DeepxError(f"dx.compile: the function computes gradients it does not use ({', '.join(unused)}): a "
                             "replay would drop them, leaving .grad as the captured call left it. Do the "
                             "optimizer step inside the function after the backward, or return the gradients, or "
                             "leave this function uncompiled")
        name = f"{self.base}-{key}"
        instrs, out_names, state, slots = build_graph(name, rec.instrs, list(inputs.values()), outs, outside)
        record = GraphRecord(name, instrs, [(f"{name}.in{k}", d, sh) for k, (_, d, sh) in enumerate(inputs.values())],
                             [(n, d, sh) for n, (_, d, sh) in zip(out_names, outs)], slots, state, key, spec,
                             getattr(self.fn, "__qualname__", ""))
        g = _Graph(name, record, [])
        if not self._bind_state(g, opts):
            missing = sorted(set(state) - {t.name for t in g.held})
            if missing:
                raise DeepxError(f"dx.compile: the function reads tensors from outside ({', '.join(missing)}) that "
                                 "nothing holds after the call (temporaries it dropped); a replay would find them "
                                 "gone or reused. Compute them inside the function, or keep them alive")
            raise DeepxError("dx.compile: the function updates parameters through an optimizer it cannot see (not "
                             "an argument, not in its closure or globals); pass the optimizer to the function")
        _link(s.transport).store(name, record.pack())
        self._graphs[key] = g
        self._made.append((s, name))
        s.recorder.graph_made(name)
        self.last = g
        return result

    # -- replay
    def _replay(self, s: Session, g: _Graph, leaves: list[tuple[str, Any]]) -> Any:
        from deepx_sdk.tensor import Tensor

        rec = g.record
        # where nothing is recorded, only collected handles wait: the outputs take their names first, so that a
        # loop's last result (the loss of the step before) hands its name straight over, with no program of its
        # delete sent ahead of the replay
        early = not s.pending and s.recorder.error is None  # (a sync that raises would take the names with it)
        out_names = [s.recorder.reuse_name(tuple(sh), d) for _, d, sh in rec.outputs] if early else None
        s.sync()  # what was recorded before the call runs first
        if out_names is None:
            out_names = [s.recorder.reuse_name(tuple(sh), d) for _, d, sh in rec.outputs]
        inputs: dict[str, Any] = {}
        tensors = [v for _, v in leaves if _is_tensor(v) or isinstance(v, np.ndarray)]
        seen: set[Any] = set()
        k = 0
        for v in tensors:
            ident = v.name if _is_tensor(v) else id(v)
            if ident in seen:
                continue
            seen.add(ident)
            if k >= len(rec.inputs):
                raise DeepxError(f"replay of graph {g.name!r}: more tensor arguments than its {len(rec.inputs)} "
                                 "inputs")
            gname = rec.inputs[k][0]
            if _is_tensor(v):
                inputs[gname] = v.name
            else:
                a = np.ascontiguousarray(v, dtype=to_numpy(rec.inputs[k][1]))
                inputs[gname] = {"dtype": str(rec.inputs[k][1]), "shape": list(a.shape),
                                 "data": a.reshape(-1).view(np.uint8).data}
            k += 1
        scalars: dict[str, Any] = {}
        steps: list[tuple[dict[str, Any], int]] = []  # counted once the replay has run: a refused one updates nothing
        for kind, key, a, b in self._scalar_plan(g):
            if kind == _STEP:  # one per update, counted as Optimizer.step counts
                o, p, _ = g.updates[a]
                st = o.state.setdefault(id(p), {"step": 0})
                steps.append((st, int(st["step"]) + 1))
                scalars[key] = sgd_step(steps[-1][1]) if b else steps[-1][1]
            elif kind == _SEED:  # one draw per seed the eager call drew
                if key not in scalars:
                    from deepx_sdk.tensor import _seed

                    scalars[key] = _seed(s)
            else:  # a hyperparameter, read from its group now (a scheduler may change lr)
                scalars[key] = _hyper(b, a)
        # small outputs (a loss) come back with the replay: reading one next (loss.item()) then costs no round trip
        small = [t for t, (_, _, sh) in zip(out_names, rec.outputs) if math.prod(sh) <= SMALL_OUTPUT]
        s.recorder.sent_request()
        try:
            values = _link(s.transport).replay(g.name, inputs, {n: t for (n, _, _), t in zip(rec.outputs, out_names)},
                                               scalars, small)
        finally:
            # made or failed, no pending program makes these names: nothing of a later program's failure is to be read
            # off them. A name reused from the pool (Recorder.reuse_name) is not waiting on a program any more
            s.names.not_pending(out_names)
        # the replay made them: a later program that fails must not count one as never made (its tensor would then
        # never be deleted). A name reused from a deleted tensor is not waiting on a program any more; a new one is
        # numbered above the mark, which moves past it, as a put moves it, where nothing pending makes a tensor (only
        # deletes of collected handles can be pending here: the call synced first)
        s.names.made(out_names)
        with s._lock:
            if all(apply_effect(i).deleted for i in s.pending):
                s.names.all_made()
        for st, step in steps:
            st["step"] = step
        for _, p, _ in g.updates:  # written in place by the replay: as an eager step marks them (Tape.wrote)
            s.tape.wrote(p)
        self.replays += 1
        outs = [Tensor(n, tuple(sh), d, s) for n, (_, d, sh) in zip(out_names, rec.outputs)]
        for t in outs:
            v = values.get(t.name)
            if v is not None:
                t._v = (s.recorder.runs, v)
        return _unspec(rec.returns, outs)

    def _scalar_plan(self, g: _Graph) -> list[tuple[int, str, Any, Any]]:
        """Per scalar of the graph, in order, where a replay takes it from: (_STEP, key, index of the update, whether
        sgd), (_SEED, key, None, None) or (_HYPER, key, the param group, the arg's name). Worked out once per binding
        of the graph's updates."""
        if g.plan is None:
            rec = g.record
            plan: list[tuple[int, str, Any, Any]] = []
            hypers: list[tuple[int, str, Any, Any]] = []
            k = 0
            for i, j, key in rec.scalars:
                instr = rec.instrs[i]
                if instr.name in _OPTIMIZER_OPS:
                    if _is_step(instr, j):
                        plan.append((_STEP, key, k, instr.name == "sgd"))
                        k += 1
                    else:
                        found = self._group_of(g, str(instr.args[0].value))
                        if found is not None:
                            hypers.append((_HYPER, key, found, OPS[instr.name].args[j].name))
                elif key.startswith("seed."):
                    plan.append((_SEED, key, None, None))
            g.plan = plan + hypers
        return g.plan

    @staticmethod
    def _group_of(g: _Graph, pname: str) -> dict[str, Any] | None:
        for _, p, group in g.updates:
            if p.name == pname:
                return group
        return None

    def explain(self) -> Explained:
        """The last graph this function used: its stored program and the plan the daemon's passes made of it."""
        if self.last is None:
            raise DeepxError(f"dx.compile: {self.base} has no graph yet; call it first (a function whose first call "
                             "creates optimizer state is captured on its second call)")
        return explain(self.last.name)


def _alive(names: set[str], opts: Sequence[Any]) -> list[Any]:
    """The live tensors of these names (their handles, so that a graph keeps what it reads alive): the optimizers'
    parameters and state first; a scan of all objects only for what is not found there."""
    from deepx_sdk.tensor import Tensor

    found: dict[str, Any] = {}
    for o in opts:
        for group in o.param_groups:
            for p in group["params"]:
                for t in (p, *o.state.get(id(p), {}).values()):
                    if isinstance(t, Tensor) and t.name in names:
                        found.setdefault(t.name, t)
    if len(found) < len(names):
        # issubclass(type(o)), not isinstance: isinstance consults __class__, which some lazy modules compute
        for o in gc.get_objects():
            if issubclass(type(o), Tensor) and o.name in names and o.name not in found:
                found[o.name] = o
    return list(found.values())


_STEP, _SEED, _HYPER = 0, 1, 2  # the kinds of _scalar_plan's entries


def _is_step(instr: Instr, j: int) -> bool:
    return instr.name in _OPTIMIZER_OPS and OPS[instr.name].args[j].name == "step"


def _outside(s: Session) -> Callable[[str], bool]:
    """Whether a name stood for a tensor Python held when the capture began: not one the session makes from here on
    (numbered after the mark) and not one it had dropped (pooled, a deleted transpose's, or collected: free for
    reuse)."""
    prefix = s.names.prefix
    mark = int(s.names.new_name()[len(prefix):])
    dropped = s.names.dropped() | {c[0] for c in list(s.collected)}

    def outside(name: str) -> bool:
        if name in dropped:
            return False
        rest = name[len(prefix):]
        return not (name.startswith(prefix) and rest.isdigit() and int(rest) > mark)

    return outside


def _hyper(arg: str, group: dict[str, Any]) -> Any:
    if arg == "beta1":
        return float(group["betas"][0])
    if arg == "beta2":
        return float(group["betas"][1])
    if arg == "nesterov":
        return bool(group["nesterov"])
    return float(group[arg])


def _swap_arrays(obj: Any, arrays: dict[int, Any]) -> Any:
    if isinstance(obj, np.ndarray):
        return arrays.get(id(obj), obj)
    if isinstance(obj, tuple):
        return tuple(_swap_arrays(o, arrays) for o in obj)
    if isinstance(obj, list):
        return [_swap_arrays(o, arrays) for o in obj]
    if isinstance(obj, dict):
        return {k: _swap_arrays(v, arrays) for k, v in obj.items()}
    return obj


def _spec(result: Any, outs: list[tuple[str, str, tuple[int, ...]]]) -> Any:
    """How the function's return value is made of its output tensors: an index, or a tagged list."""
    if _is_tensor(result):
        for k, (n, _, _) in enumerate(outs):
            if n == result.name:
                return k
        outs.append((result.name, result.dtype, result.shape))
        return len(outs) - 1
    if result is None:
        return None
    if isinstance(result, (tuple, list)):
        return {"tuple" if isinstance(result, tuple) else "list": [_spec(r, outs) for r in result]}
    if isinstance(result, dict):
        return {"dict": [[k, _spec(v, outs)] for k, v in result.items()]}
    raise DeepxError(f"dx.compile: the function returns a {type(result).__name__}; a compiled function returns "
                     "tensors (or None, or tuples, lists and dicts of them): a Python value would be frozen at "
                     "capture")


def _unspec(spec: Any, outs: list[Any]) -> Any:
    if spec is None:
        return None
    if isinstance(spec, int):
        return outs[spec]
    if "tuple" in spec:
        return tuple(_unspec(x, outs) for x in spec["tuple"])
    if "list" in spec:
        return [_unspec(x, outs) for x in spec["list"]]
    return {k: _unspec(v, outs) for k, v in spec["dict"]}


# ------------------------------------------------------------------------------------------------ public functions


def compile(fn: Callable[..., Any] | None = None, *, name: str | None = None) -> Any:
    """Capture `fn` once per signature as a stored graph (`graph:<name>-<hash>`) and replay it on later calls.

    Use as `step = dx.compile(train_step)` or as a decorator (`@dx.compile`, `@dx.compile(name="step")`)."""
    if fn is None:
        return lambda f: CompiledFunction(f, name)
    return CompiledFunction(fn, name)


@dataclass
class GraphInfo:
    name: str
    instructions: int
    inputs: list[tuple[str, str, tuple[int, ...]]]
    outputs: list[tuple[str, str, tuple[int, ...]]]
    source: str
    bytes: int


def graphs() -> list[GraphInfo]:
    """The graphs stored in the daemon's storage plane, by name."""
    s = session()
    s.sync()
    out = []
    for row in _link(s.transport).graphs():
        data = row.get("data")
        if data is None:
            continue
        try:
            rec = GraphRecord.unpack(bytes(data), row["name"])
        except DeepxError as e:
            log.warning("dx.graphs: %s", e)
            continue
        out.append(GraphInfo(rec.name, len(rec.instrs), rec.inputs, rec.outputs, rec.source, len(data)))
    return sorted(out, key=lambda g: g.name)


@overload
def explain(graph: str | CompiledFunction) -> Explained: ...


@overload
def explain(graph: None = None) -> Placed: ...


def explain(graph: str | CompiledFunction | None = None) -> Explained | Placed:
    """A stored graph's program before and after the daemon's passes; with no graph, where the session's last
    program ran: each instruction's node and worker, and what moved between nodes (`Placed`)."""
    if isinstance(graph, CompiledFunction):
        return graph.explain()
    s = session()
    s.sync()
    if graph is None:
        return _placed(s)
    r = _link(s.transport).explain(check_graph_name(graph))
    return Explained(graph, r["before"], r["after"], list(r["passes"]))


__all__ = ["CompiledFunction", "Explained", "GraphInfo", "GraphRecord", "Placed", "compile", "explain", "graphs"]
