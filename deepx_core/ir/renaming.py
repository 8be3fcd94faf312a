"""A program under new names for its inputs: the tensors it reads or deletes and never makes (`Inputs`,
`inputs_of`), and the program with them put in (`renamed_at`). The scheduler runs a plan so (decision 0049), and
the SDK records a backward of a known forward so."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from deepx_core.ir.effects import DELETES, RENAMES
from deepx_core.ir.instr import Instr, Param
from deepx_core.ir.ops import OPS


class Inputs:
    """The inputs of a plan: the tensors it reads or deletes and never makes, writes or renames (`names`), where each
    is first named in the parts a client sends (`first`: part, instruction, arg or -1 - return, list index or -1),
    and per part, per input, the positions of the instructions that name it (`at`: the parts sent; `more`: those the
    scheduler made of them). What a plan under new names needs: the names it makes stay (`fixed`: none may take one)."""

    __slots__ = ("at", "first", "fixed", "more", "names")

    def __init__(self, names: list[str], first: list[tuple[int, int, int, int]], at: list[dict[str, list[int]]],
                 more: list[dict[str, list[int]]], fixed: frozenset[str]) -> None:
        self.names, self.first, self.at, self.more, self.fixed = names, first, at, more, fixed

    def renamed(self, mapping: dict[str, str]) -> None:
        """The inputs under their new names (a plan took them)."""
        self.names = [mapping.get(n, n) for n in self.names]
        for uses in (*self.at, *self.more):
            moved = {n: uses.pop(n) for n in mapping if n in uses}
            uses.update((mapping[n], k) for n, k in moved.items())

    @staticmethod
    def where(uses: dict[str, list[int]], mapping: dict[str, str]) -> list[int]:
        """The positions of the instructions of a part (`uses`: one of `at` or `more`) that name an input renamed."""
        found = [uses[n] for n in mapping if n in uses]
        return found[0] if len(found) == 1 else sorted(set().union(*found))

    def mapping(self, sources: Sequence[Any]) -> dict[str, str] | None:
        """Each input's new name (old -> new, those that changed), read where it is first named in `sources` (the
        client's parts); None where a name there is missing, not one to one, or one the plan makes."""
        mapping: dict[str, str] = {}
        for name, (part, i, j, k) in zip(self.names, self.first):
            try:
                instr = sources[part][i]
                v = (instr.args[j] if j >= 0 else instr.returns[-1 - j]).value
                if k >= 0:
                    v = v[k]
            except (IndexError, TypeError, AttributeError):
                return None
            if type(v) is not str:
                return None
            if v != name:
                mapping[name] = v
        if not mapping:
            return None
        new = set(mapping.values())
        if len(new) != len(mapping) or not self.fixed.isdisjoint(new):
            return None
        if len(mapping) < len(self.names) and not new.isdisjoint(n for n in self.names if n not in mapping):
            return None
        return mapping


_WORDS = re.compile(r"[^\s,\[\]()]+")


def _names_in(p: Param) -> tuple[str, ...]:
    v = p.value
    if p.category == "tensor" and type(v) is str:
        return (v,)
    if p.category == "listtensor" and type(v) is tuple:
        return tuple(x for x in v if type(x) is str)
    return ()


def _renamable(instr: Instr) -> list[tuple[int, Param]]:
    """The params of `instr` whose tensors may take new names, by position (an arg's, or -1 - k for return k): the
    tensor args of an op of the catalogue (the backward marker's too; a rename's none), and a deletion's returns."""
    op = OPS.get(instr.name)
    if op is None:
        return list(enumerate(instr.args)) if instr.name == "backward" else []
    kind = op.effect.kind
    if kind is RENAMES:
        return []
    out = list(enumerate(instr.args))
    if kind is DELETES:
        out += [(-1 - k, p) for k, p in enumerate(instr.returns)]
    return out


def inputs_of(sent: Sequence[Sequence[Instr]], more: Sequence[Sequence[Instr] | None],
              fixed: Sequence[str] = ()) -> Inputs | None:
    """The Inputs of a plan whose client sends the parts `sent` (its program, each backward's forward) and which made
    `more` of them (its expansion, what the worker runs; None: none); `fixed`: names that stay besides those it makes.
    An input is read or deleted (a batch of the step before), never made or written. None where it has none. A name
    written as text where a tensor goes (an untyped param), or named by an op outside the catalogue (but the
    backward marker) or a rename, stays."""
    seen: dict[str, None] = {}
    made = set(fixed)
    parts = [*sent, *(m for m in more if m is not None)]
    for part in parts:
        for instr in part:
            free = {id(p) for _, p in _renamable(instr)}
            for p in (*instr.args, *instr.returns):
                names = _names_in(p)
                if names and id(p) in free:
                    seen.update(dict.fromkeys(names))
                elif names:
                    made.update(names)
                elif p.category not in ("var", "vector") and type(p.value) is str:
                    made.update(_WORDS.findall(p.value))  # (text where a tensor may go: what it may name stays)
    names = [n for n in seen if n not in made]
    if not names:
        return None
    first: dict[str, tuple[int, int, int, int]] = {}
    for s, part in enumerate(sent):
        for i, instr in enumerate(part):
            for j, p in _renamable(instr):
                if p.category == "tensor":
                    if type(p.value) is str and p.value not in first:
                        first[p.value] = (s, i, j, -1)
                elif p.category == "listtensor" and type(p.value) is tuple:
                    for k, v in enumerate(p.value):
                        if v not in first:
                            first[v] = (s, i, j, k)
    names = [n for n in names if n in first]  # (one named only by what the scheduler made of them stays)
    if not names:
        return None
    names.sort(key=first.__getitem__)
    inputs = set(names)
    made.update(n for n in seen if n not in inputs)

    def at(part: Sequence[Instr] | None) -> dict[str, list[int]]:
        uses: dict[str, list[int]] = {}
        for i, instr in enumerate(part or ()):
            for n in dict.fromkeys(n for _, p in _renamable(instr) for n in _names_in(p) if n in inputs):
                uses.setdefault(n, []).append(i)
        return uses

    return Inputs(names, [first[n] for n in names], [at(part) for part in sent], [at(part) for part in more],
                  frozenset(made))


def _renamed_param(p: Param, mapping: dict[str, str]) -> Param:
    v = p.value
    if p.category == "tensor":
        new = mapping.get(v) if type(v) is str else None
        return p if new is None else p._replace(value=new)
    if p.category == "listtensor" and type(v) is tuple and any(x in mapping for x in v):
        return p._replace(value=tuple(mapping.get(x, x) for x in v))
    return p


def renamed_at(program: Sequence[Instr], at: Sequence[int], mapping: dict[str, str]) -> list[Instr]:
    """`program` with the tensors its instructions at `at` read renamed by `mapping` (the rest the very objects)."""
    out = list(program)
    for i in at:
        instr = out[i]
        args = tuple(_renamed_param(p, mapping) for p in instr.args)
        if any(a is not b for a, b in zip(args, instr.args)):
            instr = out[i] = instr._replace(args=args)
        op = OPS.get(instr.name)
        if op is not None and op.effect.kind is DELETES:
            out[i] = instr._replace(returns=tuple(_renamed_param(p, mapping) for p in instr.returns))
    return out
