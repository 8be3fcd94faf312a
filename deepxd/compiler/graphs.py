"""Stored graphs at run time: the plan the passes make of a stored program (made once per graph and kept by the
scheduler), and a replay's inputs, outputs and scalars bound into that plan.

A stored program names its own tensors `<graph>.in<k>`, `<graph>.out<k>` and `<graph>.t<k>`, and tensors from
outside (parameters, optimizer buffers) by their names (deepx_sdk/compile.py writes it). A replay binds each input
either to an existing tensor (its name replaces the input's in the plan) or to data (put under the input's own
name and freed after the run), each output to the name the client wants, and may set the scalars the record lists
(an optimizer's step and learning rate, a random op's seed). The graph's temporaries that live to its end are kept
between replays (`<graph>.t<k>` in `deepxctl tensors ls`), so that every replay writes into the same buffers.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from deepx_core.cache import Cache
from deepx_core.errors import DeepxError
from deepx_core.graphrecord import GraphRecord
from deepx_core.ir.effects import CREATES, apply_effect, kind_of
from deepx_core.ir.instr import Instr, Param
from deepx_core.ir.ops import TensorMeta
from deepxd.compiler.analysis import tensor_names
from deepxd.compiler.pipeline import new_context, run_passes

log = logging.getLogger(__name__)


#: how many replays' bindings a graph's plan remembers (GraphPlan.recent)
RECENT_BINDINGS = 4


@dataclass
class GraphPlan:
    record: GraphRecord
    data: bytes
    plan: list[Instr]  # the program after the passes; what every replay runs
    origins: list[int]  # for each plan instruction, the stored instruction it stands for
    passes: list[str]
    touches: dict[str, list[int]] = field(default_factory=dict)  # input/output name -> plan indices naming it
    slots: dict[str, list[tuple[int, int]]] = field(default_factory=dict)  # scalar key -> (plan index, arg)
    # the bindings of the last few replays without data (their names, and their scalars' keys and kinds) and what
    # bind_replay made of them, with the scalars' values: a training loop replays with the same ones every step (two
    # in turn where it keeps the last loss alive while it calls the next step: its output takes the other name), and
    # the same program object lets the worker know it; new values (Adam's step count) change only their slots
    recent: Cache[Any, tuple[Bound, tuple[Any, ...]]] = field(
        default_factory=lambda: Cache("graph.bindings", RECENT_BINDINGS))

    def __post_init__(self) -> None:
        self.recent.owner = self.record.name

    @property
    def name(self) -> str:
        return self.record.name


def plan_graph(name: str, data: bytes, metas: Mapping[str, TensorMeta], keep: Collection[str],
               passes: Sequence[str], fuse_min_elements: int = 0) -> GraphPlan:
    """Decode a stored graph and run the passes over it once, against the tensors that exist now (`metas`, with
    `keep` the heap ones) and its inputs' shapes."""
    rec = GraphRecord.unpack(data, name)
    all_metas = dict(metas)
    for n, dtype, shape in rec.inputs:
        all_metas[n] = TensorMeta(tuple(shape), dtype)
    ctx = new_context(all_metas, fetch=[n for n, _, _ in rec.outputs], keep=keep,
                      fuse_min_elements=fuse_min_elements)
    try:
        plan = run_passes(rec.instrs, ctx, passes)
        origins = list(ctx.origins)
    except Exception:  # a pass must never cost a graph its replay
        log.exception("graph %s: the passes failed; replaying the program as stored", name)
        plan, origins = list(rec.instrs), list(range(len(rec.instrs)))
    slots = _slots(rec, plan, origins)
    if slots is None:  # a scalar's instruction was merged away: replay the program as stored
        plan, origins = list(rec.instrs), list(range(len(rec.instrs)))
        slots = _slots(rec, plan, origins) or {}
    # the temporaries still alive at the end stay allocated between replays (as a CUDA graph's memory does): the
    # next replay writes into the buffers it has instead of faulting in fresh memory (about 5x faster for an MLP
    # step). Their deletions were there for the passes, which have seen them; not those of a newtensor's, which would
    # keep the values the name holds instead of making zeros.
    made_by_newtensor = {n for i in plan if kind_of(i) is CREATES for n in apply_effect(i).writes}
    tail = len(plan)
    while tail and apply_effect(plan[tail - 1]).deleted:
        tail -= 1
    kept = [k for k in range(tail, len(plan)) if not all(n.startswith(f"{name}.t") and n not in made_by_newtensor
                                                          for n in apply_effect(plan[k]).deleted)]
    plan, origins = plan[:tail] + [plan[k] for k in kept], origins[:tail] + [origins[k] for k in kept]
    g = GraphPlan(rec, data, plan, origins, list(passes), slots=slots)
    names = {n for n, _, _ in rec.inputs} | {n for n, _, _ in rec.outputs}
    for k, instr in enumerate(plan):
        for n in tensor_names(instr):
            if n in names:
                g.touches.setdefault(n, []).append(k)
    return g


def _slots(rec: GraphRecord, plan: Sequence[Instr], origins: Sequence[int]) -> dict[str, list[tuple[int, int]]] | None:
    at: dict[int, list[int]] = {}
    for k, o in enumerate(origins):
        at.setdefault(o, []).append(k)
    slots: dict[str, list[tuple[int, int]]] = {}
    for i, j, key in rec.scalars:
        hits = [k for k in at.get(i, []) if plan[k].name == rec.instrs[i].name and j < len(plan[k].args)]
        if len(hits) != 1:
            return None
        slots.setdefault(key, []).append((hits[0], j))
    return slots


def _show(meta: tuple[str, Sequence[int]]) -> str:
    return f"{meta[0]}{list(meta[1])}"


@dataclass
class Bound:
    program: list[Instr]
    puts: list[tuple[str, str, list[int], Any]]  # (name, dtype, shape, data) to put before the program
    bound_inputs: dict[str, tuple[str, tuple[int, ...]]]  # existing tensor -> the (dtype, shape) the graph needs
    outputs: list[str]


def bind_replay(g: GraphPlan, inputs: Mapping[str, Any], outputs: Mapping[str, Any],
                scalars: Mapping[str, Any]) -> Bound:
    """The program one replay runs. Raises DeepxError naming the graph and the problem for an input, output or
    scalar that does not fit."""
    rec, name = g.record, g.name
    want_in = {n: (d, tuple(s)) for n, d, s in rec.inputs}
    want_out = {n: (d, tuple(s)) for n, d, s in rec.outputs}

    def listing(w: Mapping[str, tuple[str, tuple[int, ...]]]) -> str:
        return ", ".join(f"{n} ({_show(m)})" for n, m in w.items()) or "none"

    if not isinstance(inputs, Mapping) or not isinstance(outputs, Mapping) or not isinstance(scalars, Mapping):
        raise DeepxError(f"replay of graph {name!r}: inputs, outputs and scalars must be maps")
    memo: Any = None
    if all(type(v) is str for v in inputs.values()):  # no data: the same bindings bind the same way
        try:
            memo = (tuple(inputs.items()), tuple(outputs.items()),
                    tuple((k, type(v), math.copysign(1.0, v) if type(v) is float else 0) for k, v in scalars.items()))
            hash(memo)
        except TypeError:
            memo = None
        if memo is not None:
            found = g.recent.get(memo)
            if found is not None:
                return _renumbered(g, memo, found, scalars)
    unknown = [k for k in inputs if k not in want_in]
    if unknown:
        raise DeepxError(f"replay of graph {name!r}: it has no input {', '.join(map(repr, unknown))}; its inputs are "
                         f"{listing(want_in)}")
    missing = [k for k in want_in if k not in inputs]
    if missing:
        raise DeepxError(f"replay of graph {name!r}: input {', '.join(map(repr, missing))} is not given; its inputs "
                         f"are {listing(want_in)}")
    unknown = [k for k in outputs if k not in want_out]
    missing = [k for k in want_out if k not in outputs]
    if unknown or missing:
        raise DeepxError(f"replay of graph {name!r}: outputs must name a tensor for each of {listing(want_out)}; "
                         + (f"unknown: {', '.join(map(repr, unknown))}" if unknown else
                            f"missing: {', '.join(map(repr, missing))}"))
    rename: dict[str, str] = {}
    puts: list[tuple[str, str, list[int], Any]] = []
    bound: dict[str, tuple[str, tuple[int, ...]]] = {}
    for n, v in inputs.items():
        dtype, shape = want_in[n]
        if isinstance(v, str) and v:
            rename[n] = v
            bound[v] = (dtype, shape)
        elif isinstance(v, Mapping) and {"dtype", "shape", "data"} <= set(v):
            dims, buf = v["shape"], v["data"]
            if not isinstance(dims, (list, tuple)) or not all(type(x) is int for x in dims) \
                    or not isinstance(buf, (bytes, bytearray, memoryview)):
                raise DeepxError(f"replay of graph {name!r}: input {n!r} must be {{dtype, shape, data}} with shape a "
                                 "list of integers and data bytes")
            got = (str(v["dtype"]), tuple(dims))
            if got != (dtype, shape):
                raise DeepxError(f"replay of graph {name!r}: input {n!r} is {_show(want_in[n])}; got {_show(got)} "
                                 "(a new shape or dtype needs a new graph: call the compiled function, which "
                                 "captures one)")
            puts.append((n, dtype, list(shape), v["data"]))
        else:
            raise DeepxError(f"replay of graph {name!r}: input {n!r} must be a tensor name or "
                             "{dtype, shape, data}")
    for n, v in outputs.items():
        if not isinstance(v, str) or not v:
            raise DeepxError(f"replay of graph {name!r}: output {n!r} must be bound to a tensor name")
        if v in bound or v.startswith(f"{name}.") or v in rec.state or v in rename.values():
            raise DeepxError(f"replay of graph {name!r}: output {n!r} cannot be written to {v!r} (an input, a tensor "
                             "the graph reads or updates, another output, or a name of the graph's own)")
        rename[n] = v
    values: dict[int, dict[int, Any]] = {}
    for key, v in scalars.items():
        where = g.slots.get(key)
        if where is None:
            raise DeepxError(f"replay of graph {name!r}: it has no scalar {key!r}; its scalars are "
                             f"{', '.join(sorted(g.slots)) or 'none'}")
        if type(v) not in (int, float, bool):
            raise DeepxError(f"replay of graph {name!r}: scalar {key!r} must be a number, got {type(v).__name__}")
        for k, j in where:
            values.setdefault(k, {})[j] = v
    program = list(g.plan)
    touched = {k for n in rename for k in g.touches.get(n, ())} | set(values)
    for k in sorted(touched):
        program[k] = _substitute(program[k], rename, values.get(k, {}))
    program.extend(Instr("deltensor", (), (Param.tensor(n, d),)) for n, d, _, _ in puts)
    made = Bound(program, puts, bound, list(outputs.values()))
    if memo is not None and not puts:
        g.recent.put(memo, (made, tuple(scalars.values())))
    return made


def _renumbered(g: GraphPlan, memo: Any, found: tuple[Bound, tuple[Any, ...]], scalars: Mapping[str, Any]) -> Bound:
    """The program of a replay bound as one before it (`found`: its Bound, and its scalars' values), with the
    scalars that changed put in their slots (same keys and types, the memo says): the instructions without one are
    the very objects of that program (as the worker and the plan cache compare them first)."""
    made, before = found
    values = tuple(scalars.values())
    if values == before:
        return made
    changed: dict[int, dict[int, Any]] = {}
    for (key, v), old in zip(scalars.items(), before):
        if v == old and v == v:  # (a NaN is put again)
            continue
        for k, j in g.slots[key]:
            changed.setdefault(k, {})[j] = v
    program = list(made.program)
    for k, at in changed.items():
        instr = program[k]
        args = tuple(p._replace(value=at[j]) if j in at else p for j, p in enumerate(instr.args))
        program[k] = Instr(instr.name, args, instr.returns, instr.meta)
    new = Bound(program, [], made.bound_inputs, made.outputs)
    g.recent.put(memo, (new, values))
    return new


def _substitute(instr: Instr, rename: Mapping[str, str], values: Mapping[int, Any]) -> Instr:
    def sub(p: Param) -> Param:
        if p.category == "tensor":
            v = rename.get(str(p.value))
            return p if v is None else p._replace(value=v)
        if p.category == "listtensor" and isinstance(p.value, tuple):
            return p._replace(value=tuple(rename.get(str(x), str(x)) for x in p.value))
        return p

    args = tuple(p._replace(value=values[j]) if j in values else sub(p) for j, p in enumerate(instr.args))
    return Instr(instr.name, args, tuple(map(sub, instr.returns)), instr.meta)
