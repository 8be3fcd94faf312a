"""The pass pipeline: the enabled passes, in order, over one program; and what a result of the rewritten program
means for the program the client sent.

A pass is a function `(program, ctx) -> program` (deepxd/compiler/analysis.py has the context). The pipeline keeps,
for each instruction of the rewritten program, the index of the original instruction it stands for (a fused
instruction stands for the last op of its group), so that a failure is reported against the client's program.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

from deepx_core.cache import Cache
from deepx_core.errors import DeepxError
from deepx_core.ir.effects import CREATES, DELETES, WRITES, apply_effect, kind_of
from deepx_core.ir.instr import NUMBERED_OPS, Instr, Param
from deepx_core.ir.ops import OPS, UNKNOWN, PerOp, TensorMeta
from deepx_core.ir.text import format_text
from deepxd.compiler.analysis import BindMemo, PassContext, deltensor, existing_after, has_ends
from deepxd.compiler.colsum import fuse_colsum
from deepxd.compiler.cse import eliminate_common_subexpressions
from deepxd.compiler.dce import eliminate_dead_code
from deepxd.compiler.fold import fold_transpose
from deepxd.compiler.fuse import fuse_elementwise
from deepxd.compiler.products import transpose_products
from deepxd.compiler.simplify import simplify

log = logging.getLogger(__name__)

Pass = Callable[[list[Instr], PassContext], list[Instr]]

#: every pass by its name in the config (`passes`, DEEPX_PASSES)
PASSES: dict[str, Pass] = {
    "transpose_products": transpose_products,
    "simplify": simplify,
    "cse": eliminate_common_subexpressions,
    "dce": eliminate_dead_code,
    "fuse": fuse_elementwise,
    "fuse_colsum": fuse_colsum,
    "fold_transpose": fold_transpose,
}
#: transposed products first (a backward's weight gradients), then identities (they turn instructions into aliases),
#: repeats, what became dead, fusion, and last the folds into internal ops that the others do not know
DEFAULT_PASSES: tuple[str, ...] = ("transpose_products", "simplify", "cse", "dce", "fuse", "fuse_colsum",
                                   "fold_transpose")


def check_passes(names: Sequence[str]) -> list[str]:
    """`names` as a pass list; "off" or "none" alone means no passes. Raises DeepxError for an unknown name."""
    names = [n.strip() for n in names if n.strip()]
    if [n.lower() for n in names] in (["off"], ["none"]):
        return []
    bad = [n for n in names if n not in PASSES]
    if bad:
        raise DeepxError(f"passes: unknown pass {', '.join(map(repr, bad))}; passes are {', '.join(PASSES)} "
                         "(or off)")
    return names


def run_passes(program: Sequence[Instr], ctx: PassContext, passes: Sequence[str] = DEFAULT_PASSES) -> list[Instr]:
    """The program after the passes; ctx.origins maps each of its instructions to the original's index.

    A program that would be refused (it does not check against ctx) comes back unchanged, so that the worker
    reports the exact error."""
    out = list(program)
    ctx.origins = list(range(len(out)))
    if not passes or len(out) < 2 or not has_ends(out):
        return out
    try:
        ctx.bind(out)
    except DeepxError:
        return out
    for name in passes:
        out = PASSES[name](out, ctx)
    return out


class _Token(int):
    """A tensor's place in a cached plan: the n-th tensor name of the program, in order of first appearance."""


# per op: how each arg reaches the passes: 0 a value, 1 a tensor name, 2 a tensor list, 3 a value that must not name
# a variable (a string there is the name of one, whose value the plan would not see)
_ARG_ROLES: PerOp = PerOp(lambda op: tuple(1 if a.kind == "tensor" else 2 if a.kind == "listtensor" else
                                            0 if a.kind == "var" and a.vtype in ("str", "any") else 3
                                            for a in op.args))
_RETURN_TENSOR: PerOp = PerOp(lambda op: tuple(a.kind == "tensor" for a in op.returns))


class Rewrites:
    """What the passes made of a program, remembered by structure, so that a program that comes again under other
    names for its temporaries (a client that names them afresh every step) pays for the passes once. A program
    that comes again exactly does not get here: the scheduler's plan for it holds its rewrite (Scheduler.plans).

    The key is the program with its tensors numbered in order of first appearance, and for each whether it exists
    before the program (and its shape and dtype), whether the client fetches it and whether it is a heap tensor. A
    hit rebuilds the rewritten program from the current instructions (metadata and all) and names. Programs whose
    params name variables (argset) are not cached: their meaning depends on values the key does not hold."""

    def __init__(self, passes: Sequence[str] = DEFAULT_PASSES, size: int = 256, max_len: int | None = None,
                 owner: str = "") -> None:
        self.passes = tuple(passes)
        self.size = size
        self.max_len = max_len  # a longer program is never remembered: a memo of it would outlive it
        self._plans: Cache[Any, tuple[tuple[Any, ...], tuple[int, ...]]] = Cache("scheduler.rewrites", size,
                                                                                 owner=owner)

    @property
    def hits(self) -> int:
        return self._plans.hits

    @property
    def misses(self) -> int:
        return self._plans.misses

    def run(self, program: Sequence[Instr], ctx: PassContext) -> list[Instr]:
        """run_passes(program, ctx, self.passes), from the cache when the structure was seen before."""
        if not self.passes or len(program) < 2 or not has_ends(program):
            ctx.origins = list(range(len(program)))
            return list(program)
        program = program if type(program) is list else list(program)
        if self.max_len is not None and len(program) > self.max_len:
            return run_passes(program, ctx, self.passes)
        found = self._key(program, ctx)
        if found is None:
            return run_passes(program, ctx, self.passes)
        key, names = found
        plan = self._plans.get(key)
        if plan is not None:
            entries, origins = plan
            ctx.origins = list(origins)
            return [program[e] if type(e) is int else _instantiate(e, names, program[o].meta)
                    for e, o in zip(entries, origins)]
        out = run_passes(program, ctx, self.passes)
        kept = {id(i) for i in out}
        if any(i.name in NUMBERED_OPS and id(i) not in kept for i in program):
            # a pass rewrote an update (none does today): its plan would hold these numbers, so it is not kept
            return out
        tokens = {n: _Token(k) for k, n in enumerate(names)}
        entries_list: list[Any] = []
        for instr, o in zip(out, ctx.origins):
            entries_list.append(o if instr is program[o] else _template(instr, tokens))
        self._plans.put(key, (tuple(entries_list), tuple(ctx.origins)))
        return out

    def _key(self, program: Sequence[Instr], ctx: PassContext) -> tuple[Any, list[str]] | None:
        ids: dict[str, int] = {}
        names: list[str] = []

        def token(value: Any) -> int:
            n = value if type(value) is str else str(value)
            k = ids.get(n)
            if k is None:
                k = ids[n] = len(names)
                names.append(n)
            return k

        parts: list[Any] = []
        for instr in program:
            roles = _ARG_ROLES[instr.name]
            numbered = instr.name in NUMBERED_OPS
            args: list[Any] = []
            for role, p in zip(roles, instr.args):
                v = p.value
                if numbered and role in (0, 3) and type(v) in (int, float, bool):
                    # an optimizer update's numbers (Adam's step, a scheduled lr) are not part of the structure: the
                    # passes keep every update as it comes (see run), so the plan holds for any of them
                    args.append((p.category, type(v)))
                elif role == 1:
                    args.append(token(v))
                elif role == 2:
                    if type(v) is not tuple:
                        return None
                    args.append(tuple(token(x) for x in v))
                elif role == 3 and type(v) is str:
                    return None
                else:
                    args.append((p.category, type(v), repr(v) if type(v) is float else v))
            rets = tuple((p.category, p.precisions, token(p.value) if is_tensor else p.value)
                         for p, is_tensor in zip(instr.returns, _RETURN_TENSOR[instr.name]))
            parts.append((instr.name, tuple(p.category for p in instr.args), tuple(p.precisions for p in instr.args),
                          tuple(args), rets, instr.meta if kind_of(instr) is CREATES else ()))  # keep, heap
        metas, fetch, keep = ctx.metas, ctx.fetch, ctx.keep
        # what the rewrite depends on besides the structure: which tensors exist before (and their metas), and
        # which are fetched or heap; never the names themselves (a client's pool hands out names in any order)
        flags = tuple((metas.get(n), n in fetch, n in keep) for n in names)
        return (tuple(parts), flags, ctx.fuse_min_elements, ctx.fuse_min_ops, ctx.fuse_pair_min_elements), names


def _template(instr: Instr, tokens: Mapping[str, _Token]) -> Instr:
    def sub(p: Param, tensor: bool, listed: bool) -> Param:
        if listed and type(p.value) is tuple:
            return p._replace(value=tuple(tokens.get(str(x), str(x)) for x in p.value))
        if tensor and str(p.value) in tokens:
            return p._replace(value=tokens[str(p.value)])
        return p

    roles = _ARG_ROLES[instr.name]
    args = tuple(sub(p, r == 1, r == 2) for p, r in zip(instr.args, roles))
    rets = tuple(sub(p, t, False) for p, t in zip(instr.returns, _RETURN_TENSOR[instr.name]))
    return Instr(instr.name, args, rets, ())


def _instantiate(template: Instr, names: Sequence[str], meta: tuple[tuple[str, str], ...]) -> Instr:
    def sub(p: Param) -> Param:
        v = p.value
        if type(v) is _Token:
            return p._replace(value=names[v])
        if type(v) is tuple and any(type(x) is _Token for x in v):
            return p._replace(value=tuple(names[x] if type(x) is _Token else x for x in v))
        return p

    return Instr(template.name, tuple(map(sub, template.args)), tuple(map(sub, template.returns)),
                 meta if kind_of(template) is not DELETES else ())  # (a delete the passes added has none)


def explain(program: Sequence[Instr], metas: Mapping[str, TensorMeta] | None = None, fetch: Collection[str] = (),
            passes: Sequence[str] = DEFAULT_PASSES, **context: Any) -> tuple[str, str]:
    """The program's text before and after the passes, given the tensors that exist before it (`metas`) and the
    ones the client fetches; `context` sets other PassContext fields (variables, vectors, fuse_min_elements)."""
    ctx = PassContext(metas=dict(metas or {}), fetch=frozenset(fetch), **context)
    after = run_passes(program, ctx, passes)
    return "\n".join(map(format_text, program)), "\n".join(map(format_text, after))


# ---------------------------------------------------------------- results of a rewritten program


def original_times(times_us: Sequence[float], origins: Sequence[int], done: int) -> list[float]:
    """Start and end per original instruction from those of the rewritten ones; an eliminated instruction takes
    no time, at the end of the one before."""
    if done >= 256 and times_us:
        fast = _original_times_sorted(times_us, origins, done)
        if fast is not None:
            return fast
    out: list[float] = []
    j = 0
    last = times_us[0] if times_us else 0.0
    ran = len(times_us) // 2
    for i in range(done):
        start = end = last
        first = True
        while j < len(origins) and origins[j] <= i:
            if j < ran and origins[j] == i:
                if first:
                    start, first = times_us[2 * j], False
                end = last = times_us[2 * j + 1]
            j += 1
        out += (start, end)
    return out


def _original_times_sorted(times_us: Sequence[float], origins: Sequence[int], done: int) -> list[float] | None:
    """original_times in numpy, for origins in order (the passes keep them so; None otherwise): long programs
    repeat every step."""
    import numpy as np

    t = np.asarray(times_us, dtype=np.float64)
    ran = len(t) // 2
    if (np.diff(np.asarray(origins, dtype=np.int64)) < 0).any():
        return None
    o = np.asarray(origins[:ran], dtype=np.int64)
    i = np.arange(done)
    first = np.searchsorted(o, i, "left")
    last = np.searchsorted(o, i, "right") - 1
    has = first <= last
    # an original with no rewritten instruction of its own takes none, at the last end before it
    ends = np.where(has, t[2 * np.clip(last, 0, None) + 1], -np.inf)
    ends = np.maximum.accumulate(np.where(has, ends, -np.inf))
    before = np.concatenate(([t[0]], ends[:-1]))
    before = np.where(np.isneginf(before), t[0], before)
    starts = np.where(has, t[2 * np.clip(first, 0, ran - 1)], before)
    ends = np.where(has, ends, before)
    out = np.empty(2 * done)
    out[0::2], out[1::2] = starts, ends
    return list(out.tolist())


_PREFIX = re.compile(r"instruction (\d+): ")


def original_error(message: str, origins: Sequence[int]) -> str:
    """A worker's "instruction N: ..." message, N counted in the original program."""
    m = _PREFIX.match(message)
    if m is None or not 0 < int(m.group(1)) <= len(origins):
        return message
    return f"instruction {origins[int(m.group(1)) - 1] + 1}: {message[m.end():]}"


def repair(original: Sequence[Instr], rewritten: Sequence[Instr], origins: Sequence[int], ran: int,
           ctx: PassContext) -> tuple[int, list[Instr]]:
    """The rewritten program stopped after `ran` instructions. Returns how many of the original's count as done
    (the index of the failing one), and a program that makes the set of tensors what those would have left: the
    client then knows exactly which tensors exist. It makes the tensors the rewrite never made (a folded transpose,
    a fused chain's temporaries), each by its instruction of the original where that gives the value the original
    had (`_remake`), else zeroed, and then deletes the tensors the rewrite kept longer."""
    done = origins[ran] if ran < len(origins) else len(original)
    before = ctx.metas
    want = existing_after(original[:done], before)
    have = existing_after(rewritten[:ran], before)
    make: list[str] = []
    drop: list[str] = []
    for name in sorted(set(want) | set(have)):
        w = want.get(name, name in before)
        h = have.get(name, name in before)
        if h and not w:
            drop.append(name)
        elif w and not h:
            make.append(name)
    fix = _remake(original[:done], rewritten[:ran], origins[:ran], make, ctx,
                  lambda n: have.get(n, n in before)) if make else []
    return done, fix + [deltensor(n) for n in drop]


def _writers(program: Sequence[Instr]) -> dict[str, list[int]]:
    """name -> the positions that give it a value (a rename gives both names one), in order."""
    out: dict[str, list[int]] = {}
    for k, instr in enumerate(program):
        change = apply_effect(instr)
        for n in (*change.writes, *(x for pair in change.renamed for x in pair)):
            out.setdefault(n, []).append(k)
    return out


def _remake(prefix: Sequence[Instr], ran: Sequence[Instr], ran_origins: Sequence[int], names: Sequence[str],
            ctx: PassContext, exists: Callable[[str], bool]) -> list[Instr]:
    """Instructions that make `names`, which `prefix` (the original's part that counts as done) made and the
    rewritten program's first instructions (`ran`) did not, in the original's order. A name's last writer in the
    prefix runs again where it only writes its returns, all of them among `names`, and each tensor it reads holds
    now the value it had there: made again here, or untouched since before the program on both sides, or last
    written by the very instruction on both sides (a pass keeps an instruction only where it reads the values it
    read). Else the name is made zeroed (a client only ever deletes such a name)."""
    wanted = set(names)
    orig = _writers(prefix)
    new = _writers(ran)
    remade: dict[str, int] = {}  # name -> the position in the prefix of the instruction that made it again
    before = ctx.metas

    def holds(n: str, k: int) -> bool:
        """Whether tensor n holds now, or once made again, the value it had at position k of the prefix."""
        last = max((p for p in orig.get(n, ()) if p < k), default=-1)
        if n in remade:
            return remade[n] == last
        if n in wanted or not exists(n):
            return False
        writes = new.get(n, [])
        if last < 0:
            return not writes and n in before
        return bool(writes) and ran_origins[writes[-1]] == last and ran[writes[-1]] == prefix[last]

    def again(k: int) -> bool:
        instr = prefix[k]
        op = OPS.get(instr.name)
        if op is None or not op.effect.pure or op.effect.kind is not WRITES or op.effect.reads_returns:
            return False
        for a, p in zip(op.args, instr.args):
            if a.kind in ("var", "vector", "shape") and a.vtype not in ("str", "any") and isinstance(p.value, str):
                return False  # a named variable, which may have changed since
        change = apply_effect(instr)
        if not change.writes or set(change.reads) & set(change.writes):
            return False
        return (all(w in wanted and orig[w][-1] == k for w in change.writes)
                and all(holds(n, k) for n in change.reads))

    fix: list[Instr] = []
    for name in sorted(names, key=lambda n: (orig[n][-1] if n in orig else -1, n)):
        if name in remade:
            continue  # made with another return of its instruction
        k = orig[name][-1] if name in orig else -1
        if k >= 0 and again(k):
            fix.append(prefix[k])
            remade.update(dict.fromkeys(apply_effect(prefix[k]).writes, k))
            continue
        meta = _meta_after(prefix, name, ctx)
        if meta is None or meta is UNKNOWN:
            log.warning("cannot recreate '%s' after a failed rewritten program: its shape is unknown", name)
            continue
        fix.append(Instr("newtensor", (Param.vector(meta.shape),), (Param.tensor(name, meta.dtype),)))
    return fix


def _meta_after(program: Sequence[Instr], name: str, ctx: PassContext) -> TensorMeta | None:
    probe = PassContext(metas=ctx.metas, variables=ctx.variables, vectors=ctx.vectors, cache=ctx.cache)
    try:
        bounds = probe.bind(list(program))
    except DeepxError:
        return None
    meta = None
    for b in bounds:
        for n, m in zip(b.out_names, b.outs):
            if n == name and m is not None:
                meta = m
    return meta


def new_context(metas: Mapping[str, TensorMeta], *, fetch: Collection[str] = (), keep: Collection[str] = (),
                variables: Mapping[str, Any] | None = None, vectors: Mapping[str, tuple[Any, ...]] | None = None,
                fuse_min_elements: int = 0, cache: BindMemo | None = None) -> PassContext:
    return PassContext(metas=metas, fetch=frozenset(fetch), keep=frozenset(keep), variables=variables or {},
                       vectors=vectors or {}, fuse_min_elements=fuse_min_elements, cache=cache)
