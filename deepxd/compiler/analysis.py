"""What every pass needs to know about a program: the context it runs in, its instructions checked in order, where
each tensor is read, written and deleted, and a safe way to apply edits.

A pass only ever removes a *value that ends inside the program*: one written and then, after nothing but reads,
deleted (`deltensor`) or overwritten by a later instruction. Whatever survives the program (every tensor's final
value, which the client may fetch, and which tensors exist) is left as it was. Heap tensors, whose memory other
processes see, are never touched at all.
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Callable, Container, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from deepx_core.cache import Cache
from deepx_core.ir.effects import DELETES, LOADS, RENAMES, apply_effect, heap_made, kind_of
from deepx_core.ir.instr import Instr, Param
from deepx_core.ir.ops import OPS, UNKNOWN, Bound, PerOp, SymbolicEnv, TensorMeta, bind

READ, WRITE, DELETE, RENAME = 1, 2, 4, 8

#: per op, the positions of its tensor returns (those of the tensor and tensor-list args it reads: op.effect.reads)
_TENSOR_RETURNS: PerOp = PerOp(lambda op: tuple(i for i, a in enumerate(op.returns) if a.kind == "tensor"))


#: ops whose events Uses takes from refs: those that delete, rename or load, and those whose result depends on the
#: output tensor as it was (it must exist, or its value, shape or dtype is kept), whose returns count as read as well
#: as written
_BY_REFS: PerOp = PerOp(lambda op: op.effect.kind in (DELETES, RENAMES, LOADS) or op.effect.reads_returns)


def tensor_names(instr: Instr) -> list[str]:
    """The tensors an instruction names by its params' categories, its args' and its returns', tensor lists
    included (a stored graph's, whose params are all typed: what bind_replay renames)."""
    out: list[str] = []
    for p in (*instr.args, *instr.returns):
        if p.category == "tensor":
            out.append(str(p.value))
        elif p.category == "listtensor" and isinstance(p.value, tuple):
            out.extend(str(v) for v in p.value)
    return out


def read_tensors(instr: Instr) -> list[str]:
    """The tensors an instruction reads (its op's reads: no return, no rename's new name)."""
    op = OPS.get(instr.name)
    if op is None:
        return []
    out: list[str] = []
    for i in op.effect.reads:
        if i < len(instr.args):
            v = instr.args[i].value
            if op.args[i].kind != "listtensor":
                out.append(str(v))
            elif isinstance(v, tuple):
                out.extend(str(x) for x in v)
            else:  # a tensor list written as text
                out.extend(str(v).strip()[1:-1].replace(",", " ").split())
    return out


def named_tensors(instr: Instr) -> list[str]:
    """The tensors an instruction names, by its op's signature (an untyped param where a tensor goes included, a
    tensor list written as text too, and renametensor's new name): what a check of it reads the metas of. An
    instruction of no op in the catalogue (a backward marker): by its params' categories (tensor_names)."""
    op = OPS.get(instr.name)
    if op is None:
        return tensor_names(instr)
    out = read_tensors(instr)
    args, returns = instr.args, instr.returns
    if op.effect.kind is RENAMES and args:  # the new name
        out.append(str(args[0].value))
    for i in _TENSOR_RETURNS[instr.name]:
        if i < len(returns):
            out.append(str(returns[i].value))
    return out


def settle(program: list[Instr], ctx: PassContext, one_round: Callable[[list[Instr], PassContext], list[Instr]],
           rounds: int) -> list[Instr]:
    """`one_round` again on its own result until it returns its input (the very list) or `rounds` have run: a pass
    whose round rewrites each value at most once, so that a chain takes a round per link."""
    for _ in range(rounds):
        rewritten = one_round(program, ctx)
        if rewritten is program:
            break
        program = rewritten
    return program


def has_ends(program: Iterable[Instr]) -> bool:
    """Whether a value can end inside the program: it deletes a tensor, or writes one name twice. Without either,
    every pass is a no-op (the fast path)."""
    written: set[Any] = set()
    add = written.add
    for instr in program:
        if kind_of(instr) is DELETES:
            return True
        for p in instr.returns:
            v = p.value
            if v in written:
                return True
            add(v)
    return False


def tensor_reads(b: Bound) -> list[str]:
    """Tensors an instruction reads (its tensor args, and the items of its tensor lists)."""
    return list(apply_effect(b).reads)


def tensor_writes(b: Bound) -> list[str]:
    """Tensors an instruction gives a value (not those it deletes or renames; load's derived name included)."""
    return list(apply_effect(b).written)


def refs(b: Bound) -> list[tuple[str, int]]:
    """(tensor name, READ|WRITE|DELETE|RENAME) for every tensor an instruction touches."""
    change = apply_effect(b)
    if change.deleted:
        return [(n, DELETE) for n in change.deleted]
    if change.renamed:
        return [(n, RENAME) for pair in change.renamed for n in pair]
    out = [(n, READ) for n in change.reads]
    kind = READ | WRITE if b.op.effect.reads_returns else WRITE
    out.extend((n, kind) for n in change.written)
    return out


class Uses:
    """Where each tensor is touched in a checked program: name -> positions and kinds, in program order."""

    def __init__(self, bounds: Sequence[Bound]) -> None:
        pos: dict[str, list[int]] = {}
        kinds: dict[str, list[int]] = {}

        def add(name: str, i: int, kind: int) -> None:
            p = pos.get(name)
            if p is None:
                pos[name] = [i]
                kinds[name] = [kind]
            elif p[-1] == i:
                kinds[name][-1] |= kind
            else:
                p.append(i)
                kinds[name].append(kind)

        by_refs = _BY_REFS
        for i, b in enumerate(bounds):
            op = b.op.name
            if by_refs[op]:
                for name, kind in refs(b):
                    add(name, i, kind)
                continue
            names = b.names
            for k in b.op.effect.reads:
                n = names[k]
                if type(n) is str:
                    add(n, i, READ)
                elif n is not None:
                    for x in n:
                        add(x, i, READ)
            out_names = b.out_names
            for k in _TENSOR_RETURNS[op]:
                if k < len(out_names):
                    add(str(out_names[k]), i, WRITE)
        self.pos = pos
        self.kinds = kinds

    def after(self, name: str, position: int) -> Iterator[tuple[int, int]]:
        """(position, kind) of the events of `name` after `position`, in order."""
        p = self.pos.get(name)
        if not p:
            return iter(())
        kinds = self.kinds[name]
        return ((p[j], kinds[j]) for j in range(bisect.bisect_right(p, position), len(p)))

    def writer(self, name: str, position: int) -> int | None:
        """The position of the write that gave `name` the value it holds at `position`, where nothing but reads come
        between (and the write did not read `name`: not in place); None otherwise."""
        p = self.pos.get(name)
        if not p:
            return None
        kinds = self.kinds[name]
        for j in range(bisect.bisect_left(p, position) - 1, -1, -1):
            if kinds[j] == READ:
                continue
            return p[j] if kinds[j] == WRITE else None
        return None

    def untouched(self, name: str, start: int, end: int, allowed: int = READ) -> bool:
        """Nothing but `allowed` kinds of events on `name` in (start, end]."""
        for p, kind in self.after(name, start):
            if p > end:
                break
            if kind & ~allowed:
                return False
        return True

    def temporary(self, name: str, position: int, through: bool = False) -> tuple[list[int], int] | None:
        """When the value of `name` written at `position` ends inside the program: (the positions that read it, the
        position where it ends: its deltensor, or the next instruction that writes `name` without reading it).
        through: an instruction that reads the value and overwrites it also ends it (it is then among the reads)."""
        reads: list[int] = []
        for p, kind in self.after(name, position):
            if kind == READ:
                reads.append(p)
            elif kind == DELETE or kind == WRITE:
                return reads, p
            elif through and kind == READ | WRITE:
                reads.append(p)
                return reads, p
            else:
                return None
        return None


class _ProgramEnv(SymbolicEnv):
    """A SymbolicEnv whose metas are one flat dict (looked up at C speed)."""

    def __init__(self, metas: Mapping[str, TensorMeta], variables: Mapping[str, Any],
                 vectors: Mapping[str, tuple[Any, ...]]) -> None:
        super().__init__(dict(metas), dict(variables), dict(vectors))
        self.meta = self.tensors.get  # type: ignore[method-assign,assignment]


_UNMEMO_FAMILIES = frozenset({"life", "io"})  # they change the set of tensors or touch files


class BindMemo:
    """Checked instructions remembered by structure: the op, the metas of its tensors (not their names) and its
    scalar params. A client names its temporaries afresh in every program (t1001, t1002, ...), so a cache keyed by
    names never hits; by structure, a training loop's programs check at the cost of a few dict lookups per
    instruction. Instructions with named variables, and those that change the set of tensors, are checked in full."""

    def __init__(self, size: int = 8192, owner: str = "") -> None:
        self._bounds: Cache[tuple[Any, ...], Bound] = Cache("scheduler.binds", size, owner=owner)

    def bind(self, instr: Instr, meta: Any, env: SymbolicEnv) -> Bound:
        op = OPS.get(instr.name)
        if op is None or op.family in _UNMEMO_FAMILIES:
            return bind(instr, env)
        key: list[Any] = [instr.name]
        names: list[Any] = []
        for a, p in zip(op.args, instr.args):
            value = p.value
            if a.kind == "tensor":
                n = value if type(value) is str else str(value)
                key.append(meta(n))
                names.append(n)
            elif a.kind == "listtensor" and type(value) is tuple:
                items = [str(x) for x in value]
                key.append(tuple(meta(x) for x in items))
                names.append(items)
            elif (type(value) is str and a.vtype not in ("str", "any")) or a.kind == "listtensor":
                return bind(instr, env)  # a named variable or vector, or a list as text
            else:
                key.append((p.category, type(value), repr(value) if type(value) is float else value))  # -0.0
                names.append(None)
        out_names: list[Any] = []
        for a, p in zip(op.returns, instr.returns):
            n = p.value if type(p.value) is str else str(p.value)
            out_names.append(n)
            key.append((p.category, p.precisions, meta(n) if a.kind == "tensor" else None))
        k = (*key, len(instr.args), len(instr.returns))
        b = self._bounds.get(k)
        if b is None:
            b = bind(instr, env)
            self._bounds.put(k, b)
            return b
        return Bound(op, instr, b.args, names + [None] * (len(b.names) - len(names)), b.outs, out_names, b.nbytes)


#: smaller groups of elementwise ops stay unfused: a fused pair cost more than the two ops it replaces at every size
#: up to 256K elements, three or more ops fused pay from one element up (bench/fusion.py --crossover, docs/compiler.md)
FUSE_MIN_OPS = 3
#: ...except a pair whose result has at least this many elements, where the CPU's native kernels run a fused
#: expression as one C loop (deepxd/kernels/cpu/native.py, FUSED_MIN): one pass over memory instead of two, such as
#: a Linear's bias add and the ReLU after it (docs/compiler.md, "When fusion pays")
FUSE_PAIR_MIN_ELEMENTS = 1 << 15


def default_pair_min() -> int:
    """FUSE_PAIR_MIN_ELEMENTS where this process has native kernels, else 0 (pairs stay apart: numpy's tape runs a
    fused pair slower than its two ops). (Asked at every run of a plan: the module is imported once.)"""
    native = _kernels[0]
    if native is None:
        from deepxd.kernels.cpu import native

        _kernels[0] = native
    return FUSE_PAIR_MIN_ELEMENTS if native.available() else 0


_kernels: list[Any] = [None]  # deepxd.kernels.cpu.native, once default_pair_min imported it


@dataclass
class PassContext:
    """What the passes know about the world around a program.

    metas: the tensors that exist before the program (name -> shape and dtype); variables and vectors: named values
    set by earlier argset/vecset; fetch: tensors the client reads after the program; keep: heap tensors, no write to
    which is ever removed or moved; fuse_min_elements and fuse_min_ops: the least result size and group length the
    fuse pass fuses, and fuse_pair_min_elements the least result size of a fused pair (0: none). `origins[k]` is
    the index, in the program the pipeline started from, of the instruction that the k-th instruction of the
    current program stands for.
    """

    metas: Mapping[str, TensorMeta] = field(default_factory=dict)
    fetch: frozenset[str] = frozenset()
    keep: frozenset[str] = frozenset()
    variables: Mapping[str, Any] = field(default_factory=dict)
    vectors: Mapping[str, tuple[Any, ...]] = field(default_factory=dict)
    fuse_min_elements: int = 0
    fuse_min_ops: int = FUSE_MIN_OPS
    fuse_pair_min_elements: int = field(default_factory=default_pair_min)
    cache: BindMemo | None = None
    origins: list[int] = field(default_factory=list)
    stats: Counter[str] = field(default_factory=Counter)
    _program: Sequence[Instr] | None = None
    _bounds: list[Bound] = field(default_factory=list)
    _before: list[list[TensorMeta | None]] = field(default_factory=list)
    _pinned: set[str] = field(default_factory=set)
    _memo: dict[int, tuple[Instr, Bound] | None] = field(default_factory=dict)
    _uses: Uses | None = None

    def pinned(self, name: str) -> bool:
        """Whether the passes must leave every write of `name` alone: a heap tensor (other processes see it)."""
        return name in self.keep or name in self._pinned

    def bind(self, program: Sequence[Instr]) -> list[Bound]:
        """Every instruction checked in order against the state the ones before it leave.

        Cached per program object (a pass that changes nothing returns the same list, and the next pass reuses the
        work), and per instruction object: the passes never change what an instruction they leave alone sees (they
        remove writes whose values end unread, and redirect or remove reads of values that end), so only the
        instructions a pass made are checked again. An instruction object that occurs twice in a program may see
        different tensors each time: it goes through the BindMemo, whose key holds the metas it sees. Raises
        DeepxError for a program the worker would refuse."""
        if program is self._program:
            return self._bounds
        env = _ProgramEnv(self.metas, self.variables, self.vectors)
        cache = self.cache if self.cache is not None else BindMemo()
        memo = self._memo
        bounds: list[Bound] = []
        before: list[list[TensorMeta | None]] = []
        new_memo: dict[int, tuple[Instr, Bound] | None] = {}
        tensors, variables, vectors = env.tensors, env.variables, env.vectors
        meta = env.meta
        ops = OPS
        for instr in program:
            m = memo.get(id(instr))
            if m is not None and m[0] is instr:  # None: it occurred more than once
                b = m[1]
            elif ((op := ops.get(instr.name)) is not None and op.effect.kind is DELETES and len(instr.returns) == 1
                  and not instr.args):
                name = instr.returns[0].value  # a training step has dozens: checked here, without bind
                name = name if type(name) is str else str(name)
                if meta(name) is None:
                    b = bind(instr, env)  # raises: not found
                b = Bound(op, instr, [], [], [None], [name])
            else:
                b = cache.bind(instr, meta, env)
            new_memo[id(instr)] = None if id(instr) in new_memo else (instr, b)
            out_names = b.out_names
            before.append([meta(str(n)) for n in out_names] if out_names else [])
            apply_effect(b, tensors, variables, vectors, meta, True)
            bounds.append(b)
            if instr.meta:
                made = heap_made(b)
                if made is not None:
                    self._pinned.add(made)  # a heap tensor: heapmem and other processes see it
        self._program, self._bounds, self._before, self._memo = program, bounds, before, new_memo
        self._uses = None
        return bounds

    def uses(self, program: Sequence[Instr]) -> Uses:
        """Where each tensor is touched in `program` (cached with its checked instructions)."""
        bounds = self.bind(program)
        if self._uses is None:
            self._uses = Uses(bounds)
        return self._uses

    def metas_before(self, program: Sequence[Instr], position: int) -> list[TensorMeta | None]:
        """The metas of an instruction's returns just before it runs (None: the tensor does not exist yet)."""
        self.bind(program)
        return self._before[position]


def known(meta: TensorMeta | None) -> bool:
    return meta is not None and meta is not UNKNOWN


def swap_last(rank: int) -> tuple[int, ...]:
    """The permutation of `rank` dims that swaps the last two."""
    return (*range(rank - 2), rank - 1, rank - 2)


def swaps_last_two(b: Bound) -> bool:
    """Whether `b` is a transpose, without metadata, that swaps the last two dims of an operand of rank 2 or more
    (of known shape)."""
    if b.op.name != "transpose" or b.instr.meta or not known(b.args[0]):
        return False
    rank = len(b.args[0].shape)
    return rank >= 2 and tuple(int(d) % rank for d in b.args[1]) == swap_last(rank)


def rename_reads(instr: Instr, renames: Mapping[str, str]) -> Instr:
    """`instr` reading renames[n] wherever it read tensor n (tensor and tensor-list args only)."""
    op = OPS[instr.name]
    args = list(instr.args)
    for i in op.effect.reads:
        if i >= len(args):
            continue
        p = args[i]
        if op.args[i].kind == "listtensor":
            text = str(p.value).strip()[1:-1]
            items = p.value if isinstance(p.value, tuple) else tuple(text.replace(",", " ").split())
            if any(str(x) in renames for x in items):
                args[i] = Param("listtensor", p.precisions, tuple(renames.get(str(x), str(x)) for x in items))
        elif isinstance(p.value, str) and p.value in renames:
            args[i] = p._replace(value=renames[p.value])
        elif not isinstance(p.value, (str, tuple)) and str(p.value) in renames:
            args[i] = p._replace(value=renames[str(p.value)])
    return instr._replace(args=tuple(args))


def deltensor(name: str, dtype: str | None = None) -> Instr:
    return Instr("deltensor", (), (Param.tensor(name, dtype),))


Edit = Instr | None | tuple[Instr, ...]


def apply_edits(ctx: PassContext, program: Sequence[Instr], edits: Mapping[int, Edit]) -> list[Instr]:
    """The program with instructions replaced (an Instr), removed (None) or expanded (a tuple), then without the
    deltensors of tensors that no longer come to exist; keeps ctx.origins in step."""
    if not edits:
        return list(program)
    origins = ctx.origins if len(ctx.origins) == len(program) else list(range(len(program)))
    out: list[Instr] = []
    out_origins: list[int] = []
    for i, instr in enumerate(program):
        e = edits.get(i, instr) if edits else instr
        if e is None:
            continue
        if isinstance(e, tuple) and not isinstance(e, Instr):
            out.extend(e)
            out_origins.extend([origins[i]] * len(e))
        else:
            out.append(e)
            out_origins.append(origins[i])
    keep = [k for k, ok in enumerate(existence_checks(out, ctx.metas)) if ok]
    if len(keep) != len(out):
        out = [out[k] for k in keep]
        out_origins = [out_origins[k] for k in keep]
    ctx.origins = out_origins
    return out


def _simulate(program: Sequence[Instr], before: Container[str], state: dict[str, bool],
              ok: list[bool] | None = None) -> None:
    """Follow which tensors exist through `program` (state: name -> exists, for the names touched so far)."""
    get = state.get
    for instr in program:
        change = apply_effect(instr)
        deleted = change.deleted
        if ok is not None:
            ok.append(all(t in before if get(t) is None else get(t) for t in deleted) if deleted else True)
        for t in deleted:
            state[t] = False
        for old, new in change.renamed:
            state[old] = False
            state[new] = True
        for n in change.written:
            state[n] = True


def existence_checks(program: Sequence[Instr], before: Container[str]) -> list[bool]:
    """For each instruction, False when it is a deltensor of a tensor that does not exist at that point."""
    ok: list[bool] = []
    _simulate(program, before, {}, ok)
    return ok


def existing_after(program: Sequence[Instr], before: Container[str]) -> dict[str, bool]:
    """name -> whether it exists after `program`, for every tensor the program touches."""
    state: dict[str, bool] = {}
    _simulate(program, before, state)
    return state


class Rewrite:
    """Edits to one checked program under construction, and the reads being redirected from a temporary to the
    tensor that holds the same value (until the temporary's deltensor)."""

    def __init__(self, ctx: PassContext, program: list[Instr]) -> None:
        self.ctx = ctx
        self.program = program
        self.bounds = ctx.bind(program)
        self.uses = ctx.uses(program)
        self.edits: dict[int, Edit] = {}
        self.alias: dict[str, str] = {}
        self._expire: dict[int, list[str]] = {}
        self._moved: set[str] = set()

    def at(self, position: int) -> None:
        """Call before looking at the instruction at `position`: ends the redirections that end there."""
        for n in self._expire.pop(position, ()):
            self.alias.pop(n, None)

    def name(self, n: str) -> str:
        """The tensor that reads of `n` now go to."""
        return self.alias.get(n, n)

    def redirect(self, temp: str, src: str, reads: Iterable[int], delete_at: int) -> None:
        """Make the instructions at `reads` read `src` instead of `temp` (which is deleted at `delete_at`)."""
        for r in reads:
            cur = self.edits.get(r, self.program[r])
            if isinstance(cur, Instr):
                self.edits[r] = rename_reads(cur, {temp: src})
        self.alias[temp] = src
        self._expire.setdefault(delete_at, []).append(temp)

    def reuse(self, temp: str, src: str, since: int, reads: list[int], delete_at: int, dtype: str | None) -> bool:
        """Let the reads of `temp` (deleted at `delete_at`) go to `src`, which holds the same value from `since` on.

        `src` must stay unchanged until the last read. When the program deletes it sooner (a client drops its
        handle once nothing refers to it), its deltensor moves to where the temporary's was. False: not safe."""
        last = max(reads, default=since)
        moved_from = -1
        for p, kind in self.uses.after(src, since):
            if p > last:
                break
            if kind == DELETE and not self.ctx.pinned(src) and self.uses.untouched(src, p, delete_at, allowed=0) \
                    and type(self.edits.get(delete_at, self.program[delete_at])) is not tuple:
                moved_from = p
                break
            if kind != READ:
                return False
        self.redirect(temp, src, reads, delete_at)
        if moved_from >= 0:
            self.edits[moved_from] = None
            self.edits[delete_at] = (self.program[delete_at], deltensor(src, dtype))
            self._moved.add(src)
        return True

    def moved(self, name: str) -> bool:
        """Whether this rewrite moved `name`'s deltensor (its events no longer say where it dies)."""
        return name in self._moved

    def remove(self, position: int) -> None:
        self.edits[position] = None

    def result(self) -> list[Instr]:
        """The edited program (the same object when nothing changed)."""
        return apply_edits(self.ctx, self.program, self.edits) if self.edits else self.program
