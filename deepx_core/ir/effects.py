"""What an instruction does to the set of tensors: the effect each op declares, and `apply_effect`, which follows it.

An op's effect is part of its catalogue entry (`OpDef.effect`, made by `op(...)` in ops.py from the kind it declares
or, for the common case, from its family and returns): one kind for what it does to its tensor returns, and the
positions of the tensor args it only reads. Every layer that follows a program's effect on the set of tensors (the
check, the passes, the op workers, UDP's scope, the SDK) asks `apply_effect`, never the op's name.
"""

from __future__ import annotations

from collections.abc import Callable, MutableMapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, NamedTuple, overload

from deepx_core.cache import Cache
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
#: families whose ops touch what lies outside the tensors: files and the output (io), the other ranks (collective)
IO_FAMILIES = frozenset({"io", "collective"})


class Effect(NamedTuple):
    """What an op does to the set of tensors: `kind` (above) for its returns; `reads`, the positions of its tensor
    and tensor-list args, which it only reads; `reads_returns`: its result depends on a return as it was (that it
    exists, its value, or its meta), so that a return is read as well as written; `io`: it touches what lies outside
    the tensors (files, the executor's output, the other ranks of a process group)."""

    kind: str
    reads: tuple[int, ...] = ()
    reads_returns: bool = False
    io: bool = False

    @property
    def pure(self) -> bool:
        """It only writes (or fills) its returns from its args: no file or output, no change to the set of tensors
        or variables. What a pass may remove where its result is not used, and a check may remember."""
        return (self.kind is WRITES or self.kind is FILLS) and not self.io


def declare(kind: str | None, family: str, args: Sequence[Arg], returns: Sequence[Arg],
            reads_returns: bool = False) -> Effect:
    """The effect of an entry: its declared kind, or, where it declares none, FILLS for the init and optim families
    (they write existing tensors in place), READS for an op with no tensor returns, and WRITES for the rest; the io
    family (print, save, load, loadtensordata) touches files or the output, and the collective family the other
    ranks of a process group (so that no pass drops, merges or moves one)."""
    if kind is None:
        kind = (FILLS if family in ("init", "optim") else
                READS if not any(a.kind == "tensor" for a in returns) else WRITES)
    if kind not in KINDS:
        raise ValueError(f"effect {kind!r} is not one of {', '.join(KINDS)}")
    kind = KINDS[KINDS.index(kind)]  # the very string: apply_effect compares kinds by identity
    return Effect(kind, tuple(i for i, a in enumerate(args) if a.kind in ("tensor", "listtensor")),
                  reads_returns or kind in (FILLS, CREATES), family in IO_FAMILIES)


_NONE: tuple[Any, ...] = ()


class Change(NamedTuple):
    """What one instruction does to the set of tensors: the tensors it `reads`, and the names it gives a value,
    `created` and `written` split by whether they existed before, as the metas given to apply_effect say (without
    them, all are in `written`); a name renamed is neither (it moves, value and all). `sets`: the variables or
    vectors it sets. `of`: the instruction, as sent."""

    of: Any = None
    reads: tuple[str, ...] = _NONE
    created: tuple[str, ...] = _NONE
    written: tuple[str, ...] = _NONE
    deleted: tuple[str, ...] = _NONE
    renamed: tuple[tuple[str, str], ...] = _NONE
    sets: tuple[str, ...] = _NONE

    @property
    def writes(self) -> tuple[str, ...]:
        """Every name it gives a value: created or written."""
        return self.created + self.written if self.created else self.written

    @property
    def gone(self) -> tuple[str, ...]:
        """The names that no longer exist after it: deleted, or renamed away."""
        return self.deleted + tuple(old for old, new in self.renamed if old != new) if self.renamed else self.deleted

    def __repr__(self) -> str:
        return f"Change({', '.join(f'{k}={v!r}' for k, v in zip(self._fields[1:], self[1:]) if v)})"


_new = tuple.__new__  # a Change made at C speed: _new(Change, (of, reads, created, written, deleted, renamed, sets))


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
    variables followed, and None returned (the check's loop, where making the Change would cost a third of the
    time). Without metas, variables or vectors, the answer depends on the instruction alone (a Bound's is its
    Instr's), and is remembered per Instr object."""
    if metas is None and variables is None and vectors is None:
        instr = x if type(x) is Instr else x.instr  # type: ignore[union-attr]
        known = _KNOWN.get(id(instr))
        if known is not None and known.of is instr:
            return known
        return _alone(instr)
    if type(x) is Instr:
        change = _apply_instr(x, metas, before)
        return None if quiet else change
    b: Bound = x  # type: ignore[assignment]
    kind = b.op.effect.kind
    if kind is WRITES or kind is FILLS or kind is CREATES:
        if metas is None:
            return None if quiet else _alone(b.instr)
        out_names, outs = b.out_names, b.outs
        if quiet:
            for n, m in zip(out_names, outs):
                if m is not None:
                    metas[n] = m
            return None
        get = before if before is not None else metas.get
        created: list[str] = []
        written: list[str] = []
        for n, m in zip(out_names, outs):
            if m is None:
                continue
            have = get(n)
            if have is None:
                created.append(n)
            elif kind is not CREATES or have != m:  # (newtensor keeps one of its meta, values and all)
                written.append(n)
            metas[n] = m
        return _new(Change, (b.instr, _alone(b.instr).reads, tuple(created), tuple(written), _NONE, _NONE, _NONE))
    if kind is DELETES:
        if metas is not None:
            for n in b.out_names:
                if before is None:
                    metas.pop(n, None)
                else:
                    metas[n] = None
        return None if quiet else _alone(b.instr)
    if kind is RENAMES:
        if metas is not None:
            _rename(str(b.out_names[0]), str(b.args[0]), metas, before)
    elif kind is LOADS:
        if metas is not None:
            return _load(b.instr, _alone(b.instr).written[0], metas, before, quiet)
    elif kind is SETS:
        store = vectors if b.op.returns[0].kind == "vector" else variables
        if store is not None:
            store[str(b.out_names[0])] = b.args[0]
    return None if quiet else _alone(b.instr)


#: the Change of an instruction alone (no state), per Instr object: the passes ask it of one instruction again and
#: again, and a client sends the same instruction objects every step. Its `of` holds the object, so that the id
#: stays that object's while it is remembered
_KNOWN: Cache[int, Change] = Cache("ir.effects", 1 << 15, counted=False)


def forget() -> None:
    """Forget the remembered Changes: an op left the catalogue (ops.remove_op)."""
    _KNOWN.clear()


def _alone(instr: Instr) -> Change:
    """apply_effect(instr) with no state, remembered."""
    known = _KNOWN.get(id(instr))
    if known is not None and known.of is instr:
        return known
    return _KNOWN.put(id(instr), _of_instr(instr))


def _of_instr(instr: Instr) -> Change:
    op = _ops.OPS.get(instr.name)
    if op is None:
        return Change(instr)
    kind = op.effect.kind
    returns = instr.returns
    if kind is WRITES or kind is FILLS or kind is CREATES:
        if len(returns) == 1 and op.returns[0].kind == "tensor":  # most ops
            v = returns[0].value
            names: tuple[str, ...] = (v if type(v) is str else str(v),)
        else:
            names = tuple(str(p.value) for a, p in zip(op.returns, returns) if a.kind == "tensor")
        return _new(Change, (instr, _instr_reads(op, instr), _NONE, names, _NONE, _NONE, _NONE))
    if kind is DELETES:
        return _new(Change, (instr, _NONE, _NONE, _NONE, tuple(str(p.value) for p in returns), _NONE, _NONE))
    if kind is RENAMES:
        if not returns or not instr.args:
            return Change(instr)
        return Change(instr, renamed=((str(returns[0].value), str(instr.args[0].value)),))
    if kind is LOADS:
        if returns:
            return Change(instr, written=(str(returns[0].value),))
        return Change(instr, written=(_ops.load_name(str(instr.args[0].value)),)) if instr.args else Change(instr)
    if kind is SETS:
        return Change(instr, sets=tuple(str(p.value) for p in returns))
    return Change(instr, _instr_reads(op, instr))


def _forget(metas: MutableMapping[str, Any], names: Sequence[str], before: Callable[[str], Any] | None) -> None:
    for n in names:
        if before is None:
            metas.pop(n, None)
        else:
            metas[n] = None


def _load(x: Any, name: str, metas: MutableMapping[str, Any], before: Callable[[str], Any] | None,
          quiet: bool = False) -> Change | None:
    """A load's: a tensor whose meta shows when it runs."""
    existed = (before or metas.get)(name) is not None
    metas[name] = _ops.UNKNOWN
    if quiet:
        return None
    return Change(x, written=(name,)) if existed else Change(x, created=(name,))


def _rename(old: str, new: str, metas: MutableMapping[str, Any], before: Callable[[str], Any] | None) -> None:
    if new != old:
        get = before or metas.get
        if get(new) is not None:
            raise DeepxError(f"renametensor: cannot rename '{old}' to '{new}': a tensor named '{new}' exists")
        metas[new] = get(old)
        _forget(metas, (old,), before)


def _apply_instr(instr: Instr, metas: MutableMapping[str, Any] | None, before: Callable[[str], Any] | None) -> Change:
    """An instruction as sent, on metas (what it makes: UNKNOWN)."""
    change = _alone(instr)
    if metas is None:
        return change
    op = _ops.OPS.get(instr.name)
    kind = op.effect.kind if op is not None else None
    if change.written and kind is not LOADS:
        get = before or metas.get
        created = tuple(n for n in change.written if get(n) is None)
        for n in change.written:
            if kind is not FILLS or n in created:  # a fill keeps the meta; what else it makes shows when it runs
                metas[n] = _ops.UNKNOWN
        return change._replace(created=created, written=tuple(n for n in change.written if n not in created))
    if change.written:
        return _load(instr, change.written[0], metas, before) or change
    _forget(metas, change.deleted, before)
    for old, new in change.renamed:
        _rename(old, new, metas, before)
    return change


def kind_of(x: Bound | Instr) -> str | None:
    """The kind of effect of an instruction's op (checked or as sent); None for a name that is no op."""
    if type(x) is Instr:
        op = _ops.OPS.get(x.name)
        return op.effect.kind if op is not None else None
    return x.op.effect.kind  # type: ignore[union-attr]


def heap_made(b: Bound) -> str | None:
    """The heap tensor a checked instruction makes (`newtensor ... // kind=heap`: heapmem's shared memory, which
    other processes see; docs/decisions/0009-heap-parameters.md), or None."""
    if b.instr.meta and b.op.effect.kind is CREATES and b.instr.get_meta("kind") == "heap":
        return str(b.out_names[0])
    return None


# last: ops imports this module for its kinds while it builds the table; this module reads ops only when it runs
from deepx_core.ir import ops as _ops  # noqa: E402
