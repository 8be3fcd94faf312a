"""What an instruction does to the set of tensors: the effect each op declares, and `apply_effect`, which follows it.

An op's effect is part of its catalogue entry (`OpDef.effect`, made by `op(...)` in ops.py from the kind it declares
or, for the common case, from its family and returns): one kind for what it does to its tensor returns, and the
positions of the tensor args it only reads. Every layer that follows a program's effect on the set of tensors (the
check, the passes, the op workers, UDP's scope, the SDK) asks `apply_effect`, never the op's name.
"""

from __future__ import annotations

from collections.abc import Callable, MutableMapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, NamedTuple, overload

from deepx_core.errors import DeepxError
from deepx_core.ir.instr import Instr

if TYPE_CHECKING:
    from deepx_core.ir.ops import Arg, Bound

# the kinds: what an op does to its tensor returns (its tensor args are only read)
WRITES = "writes"  # each return holds the result: made where absent, else written (in place, or replaced)
FILLS = "fills"  # each return exists already and is written in place, keeping its shape and dtype
CREATES = "creates"  # newtensor: made where absent; one that exists is kept where the check kept it, else replaced
DELETES = "deletes"  # each return is deleted
RENAMES = "renames"  # the return takes the name its first arg gives
LOADS = "loads"  # made from a file, of a shape known when it runs: named by its return, or after the file
READS = "reads"  # no tensor returns: it only reads (print, save)
SETS = "sets"  # its return names a variable (argset) or a vector (vecset), not a tensor
KINDS = (WRITES, FILLS, CREATES, DELETES, RENAMES, LOADS, READS, SETS)


class Effect(NamedTuple):
    """What an op does to the set of tensors: `kind` (above) for its returns; `reads`, the positions of its tensor
    and tensor-list args, which it only reads; `reads_returns`: its result depends on a return as it was (that it
    exists, its value, or its meta), so that a return is read as well as written."""

    kind: str
    reads: tuple[int, ...] = ()
    reads_returns: bool = False


def declare(kind: str | None, family: str, args: Sequence[Arg], returns: Sequence[Arg],
            reads_returns: bool = False) -> Effect:
    """The effect of an entry: its declared kind, or, where it declares none, FILLS for the init and optim families
    (they write existing tensors in place), READS for an op with no tensor returns, and WRITES for the rest."""
    if kind is None:
        kind = (FILLS if family in ("init", "optim") else
                READS if not any(a.kind == "tensor" for a in returns) else WRITES)
    if kind not in KINDS:
        raise ValueError(f"effect {kind!r} is not one of {', '.join(KINDS)}")
    kind = KINDS[KINDS.index(kind)]  # the very string: apply_effect compares kinds by identity
    return Effect(kind, tuple(i for i, a in enumerate(args) if a.kind in ("tensor", "listtensor")),
                  reads_returns or kind in (FILLS, CREATES))


_NONE: tuple[Any, ...] = ()


class Change:
    """What one instruction does to the set of tensors. `created` and `written` split the names it gives a value by
    whether they existed before, as the metas given to apply_effect say (without them, all are in `written`); a
    name renamed is neither (it moves, value and all). `sets`: the variables or vectors it sets. `reads` is worked
    out when asked (most callers never ask)."""

    __slots__ = ("created", "deleted", "of", "renamed", "sets", "written")

    def __init__(self, of: Any = None, created: tuple[str, ...] = _NONE, written: tuple[str, ...] = _NONE,
                 deleted: tuple[str, ...] = _NONE, renamed: tuple[tuple[str, str], ...] = _NONE,
                 sets: tuple[str, ...] = _NONE) -> None:
        self.of = of  # the instruction (a Bound or an Instr) whose args `reads` names
        self.created = created
        self.written = written
        self.deleted = deleted
        self.renamed = renamed
        self.sets = sets

    @property
    def reads(self) -> tuple[str, ...]:
        """The tensors it reads: its tensor args, and the items of its tensor lists."""
        x = self.of
        if x is None:
            return _NONE
        if type(x) is Instr:
            return _instr_reads(_ops.OPS[x.name], x)
        return _reads(x.op, x.names)

    @property
    def writes(self) -> tuple[str, ...]:
        """Every name it gives a value: created or written."""
        return self.created + self.written if self.created else self.written

    @property
    def gone(self) -> tuple[str, ...]:
        """The names that no longer exist after it: deleted, or renamed away."""
        return self.deleted + tuple(old for old, new in self.renamed if old != new) if self.renamed else self.deleted

    def _key(self) -> tuple[Any, ...]:
        return self.reads, self.created, self.written, self.deleted, self.renamed, self.sets

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Change) and self._key() == other._key()

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        fields = zip(("reads", "created", "written", "deleted", "renamed", "sets"), self._key())
        return f"Change({', '.join(f'{k}={v!r}' for k, v in fields if v)})"


NOTHING = Change()


def _reads(op: Any, names: Sequence[Any]) -> tuple[str, ...]:
    """The tensors a checked instruction reads: its tensor args' names and its tensor lists' items."""
    out: list[str] = []
    n = len(names)
    for i in op.effect.reads:
        if i < n:
            x = names[i]
            if type(x) is list:
                out.extend(x)
            elif x is not None:
                out.append(x)
    return tuple(out)


def _instr_reads(op: Any, instr: Instr) -> tuple[str, ...]:
    """The tensors an unchecked instruction reads, by its op's signature, a tensor list as bind reads it."""
    out: list[str] = []
    args = instr.args
    for i in op.effect.reads:
        if i < len(args):
            if op.args[i].kind == "listtensor":
                out.extend(_ops.tensor_list(args[i].value) or ())
            else:
                out.append(str(args[i].value))
    return tuple(out)


@overload
def apply_effect(x: Bound | Instr, metas: MutableMapping[str, Any] | None = None,
                 variables: MutableMapping[str, Any] | None = None, vectors: MutableMapping[str, Any] | None = None,
                 before: Callable[[str], Any] | None = None, quiet: Literal[False] = False) -> Change: ...


@overload
def apply_effect(x: Bound | Instr, metas: MutableMapping[str, Any] | None, variables: MutableMapping[str, Any] | None,
                 vectors: MutableMapping[str, Any] | None, before: Callable[[str], Any] | None,
                 quiet: Literal[True]) -> None: ...


def apply_effect(x: Bound | Instr, metas: MutableMapping[str, Any] | None = None,
                 variables: MutableMapping[str, Any] | None = None, vectors: MutableMapping[str, Any] | None = None,
                 before: Callable[[str], Any] | None = None, quiet: bool = False) -> Change | None:
    """What instruction `x` (checked, a Bound, or as sent, an Instr) does to the set of tensors, and, given them,
    that done to `metas` (name -> meta: the tensors before, left as they are after), `variables` and `vectors`.

    `before`: how to read the state before where `metas` is a layer over it (SymbolicEnv's over its base): a name
    that goes is then set to None in `metas`, hiding the one beneath, instead of removed. With a Bound, a name made
    gets the meta the check inferred (UNKNOWN for a load); with an Instr, UNKNOWN. DeepxError for a rename to a
    name that exists (given the metas). An instruction of no known op changes nothing. `quiet`: the metas and
    variables followed, and None returned (the check's loop, where the Change would cost a third of the time)."""
    if type(x) is Instr:
        return _apply_instr(x, metas, before)
    b: Bound = x  # type: ignore[assignment]
    kind = b.op.effect.kind
    if kind is WRITES or kind is FILLS or kind is CREATES:
        out_names, outs = b.out_names, b.outs
        if quiet:
            for n, m in zip(out_names, outs):
                if m is not None:
                    metas[n] = m  # type: ignore[index]
            return None
        if metas is None:
            return Change(b, _NONE, tuple(n for n, m in zip(out_names, outs) if m is not None))
        get = before if before is not None else metas.get
        if len(out_names) == 1:  # most ops
            n, m = out_names[0], outs[0]
            if m is None:
                return Change(b)
            have = get(n)
            metas[n] = m
            if have is None:
                return Change(b, (n,))
            if kind is CREATES and have == m:
                return Change(b)  # kept, values and all
            return Change(b, _NONE, (n,))
        created: list[str] = []
        written: list[str] = []
        for n, m in zip(out_names, outs):
            if m is None:
                continue
            have = get(n)
            if have is None:
                created.append(n)
            elif kind is not CREATES or have != m:
                written.append(n)
            metas[n] = m
        return Change(b, tuple(created), tuple(written))
    if kind is DELETES:
        if quiet:  # one name, the check's own (deltensor)
            for n in b.out_names:
                if before is None:
                    metas.pop(n, None)  # type: ignore[union-attr]
                else:
                    metas[n] = None  # type: ignore[index]
            return None
        gone = tuple(str(n) for n in b.out_names)
        if metas is not None:
            _forget(metas, gone, before)
        return Change(None, _NONE, _NONE, gone)
    if kind is RENAMES:
        change = _rename(str(b.out_names[0]), str(b.args[0]), metas, before, quiet)
    elif kind is LOADS:
        change = _made(str(b.out_names[0]) if b.out_names else _ops.load_name(str(b.args[0])), metas, before)
    elif kind is SETS:
        name = str(b.out_names[0])
        store = vectors if b.op.returns[0].kind == "vector" else variables
        if store is not None:
            store[name] = b.args[0]
        change = Change(sets=(name,))
    else:
        change = Change(b)
    return None if quiet else change


def _forget(metas: MutableMapping[str, Any], names: Sequence[str], before: Callable[[str], Any] | None) -> None:
    for n in names:
        if before is None:
            metas.pop(n, None)
        else:
            metas[n] = None


def _made(name: str, metas: MutableMapping[str, Any] | None, before: Callable[[str], Any] | None) -> Change:
    """A load's: a tensor whose meta shows when it runs."""
    if metas is None:
        return Change(None, _NONE, (name,))
    existed = (before or metas.get)(name) is not None
    metas[name] = _ops.UNKNOWN
    return Change(None, _NONE, (name,)) if existed else Change(None, (name,))


def _rename(old: str, new: str, metas: MutableMapping[str, Any] | None, before: Callable[[str], Any] | None,
            quiet: bool = False) -> Change | None:
    if metas is not None and new != old:
        get = before or metas.get
        if get(new) is not None:
            raise DeepxError(f"renametensor: cannot rename '{old}' to '{new}': a tensor named '{new}' exists")
        metas[new] = get(old)
        if before is None:
            metas.pop(old, None)
        else:
            metas[old] = None
    return None if quiet else Change(None, renamed=((old, new),))


def _apply_instr(instr: Instr, metas: MutableMapping[str, Any] | None, before: Callable[[str], Any] | None) -> Change:
    op = _ops.OPS.get(instr.name)
    if op is None:
        return NOTHING
    kind = op.effect.kind
    returns = instr.returns
    if kind is WRITES or kind is FILLS or kind is CREATES:
        names = tuple(str(p.value) for a, p in zip(op.returns, returns) if a.kind == "tensor")
        if metas is None:
            return Change(instr, _NONE, names)
        get = before or metas.get
        created = tuple(n for n in names if get(n) is None)
        for n in names:
            if kind is not FILLS or n in created:  # a fill keeps the meta; what else it makes shows when it runs
                metas[n] = _ops.UNKNOWN
        return Change(instr, created, tuple(n for n in names if n not in created))
    if kind is DELETES:
        gone = tuple(str(p.value) for p in returns)
        if metas is not None:
            _forget(metas, gone, before)
        return Change(None, _NONE, _NONE, gone)
    if kind is RENAMES:
        if not returns or not instr.args:
            return NOTHING
        return _rename(str(returns[0].value), str(instr.args[0].value), metas, before) or NOTHING
    if kind is LOADS:
        if returns:
            return _made(str(returns[0].value), metas, before)
        return _made(_ops.load_name(str(instr.args[0].value)), metas, before) if instr.args else NOTHING
    if kind is SETS:
        return Change(sets=tuple(str(p.value) for p in returns))
    return Change(instr)


# last: ops imports this module for its kinds while it builds the table; this module reads ops only when it runs
from deepx_core.ir import ops as _ops  # noqa: E402
