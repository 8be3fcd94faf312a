"""Param and Instr: the immutable values that every layer of deepx passes around.

An instruction is `name (args) -> (returns) // metadata`, exactly as deepxIR writes it. Params keep the sender's
category and precision annotations; values are Python scalars, strings, or tuples (vectors, tensor lists).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, NamedTuple, Union

Scalar = Union[bool, int, float, str]
Value = Union[Scalar, tuple[Scalar, ...]]

#: the parameter categories of deepxIR; "" is an untyped parameter whose category the op signature decides
CATEGORIES = ("tensor", "var", "vector", "listtensor", "")


class Param(NamedTuple):
    """One parameter: `category<precisions>:value`.

    - tensor: value is the tensor's name (a str, never a number: `tensor<float32>:7` names tensor "7")
    - var: a bool, int, float or str (a literal string, or the name of a stored variable)
    - vector: a tuple of numbers, or a str naming a stored vector
    - listtensor: a tuple of tensor names
    - "" (untyped): the raw text, resolved against the op signature
    """

    category: str
    precisions: tuple[str, ...]
    value: Value

    @property
    def dtype(self) -> str:
        """The first precision annotation, or "any"."""
        return self.precisions[0] if self.precisions else "any"

    @staticmethod
    def tensor(name: str, dtype: str | None = None) -> Param:
        return Param("tensor", (dtype,) if dtype else (), name)

    @staticmethod
    def var(value: Scalar, dtype: str | None = None) -> Param:
        if dtype is None:
            dtype = (
                "bool" if isinstance(value, bool)
                else "int32" if isinstance(value, int)
                else "float32" if isinstance(value, float)
                else "string"
            )
        return Param("var", (dtype,), value)

    @staticmethod
    def vector(values: Iterable[int | float] | str, dtype: str = "int32") -> Param:
        return Param("vector", (dtype,), values if isinstance(values, str) else tuple(values))

    @staticmethod
    def listtensor(names: Iterable[str], dtype: str | None = None) -> Param:
        return Param("listtensor", (dtype,) if dtype else (), tuple(names))



def request_id(raw: str | None) -> int:
    """The number of an `id=` metadata value: 0 where it is missing or not a number (however many digits)."""
    try:
        return int(raw) if raw is not None else 0
    except ValueError:
        return 0

class Instr(NamedTuple):
    """One deepxIR instruction. `meta` is the ordered `key=value` metadata, values kept as text."""

    name: str
    args: tuple[Param, ...] = ()
    returns: tuple[Param, ...] = ()
    meta: tuple[tuple[str, str], ...] = ()

    def get_meta(self, key: str, default: str | None = None) -> str | None:
        for k, v in self.meta:
            if k == key:
                return v
        return default

    @property
    def id(self) -> int:
        """The sender's request id (metadata `id`), 0 where missing or not a number."""
        return request_id(self.get_meta("id"))

    @property
    def author(self) -> str:
        return self.get_meta("author") or ""

    def with_meta(self, **items: object) -> Instr:
        """A copy with metadata keys set (added at the end, or replaced in place)."""
        new = {k: v for k, v in self.meta}
        for k, v in items.items():
            new[k.replace("__", ".")] = str(v)
        return self._replace(meta=tuple(new.items()))

    def __str__(self) -> str:
        from deepx_core.ir.text import format_text

        return format_text(self)


class Program(Sequence[Instr]):
    """An ordered, immutable sequence of instructions: the unit that travels in one frame."""

    __slots__ = ("_instrs",)

    def __init__(self, instrs: Iterable[Instr] = ()) -> None:
        self._instrs = tuple(instrs)

    def __getitem__(self, i):  # type: ignore[override]
        return self._instrs[i]

    def __len__(self) -> int:
        return len(self._instrs)

    def __iter__(self) -> Iterator[Instr]:
        return iter(self._instrs)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Program) and self._instrs == other._instrs

    def __hash__(self) -> int:
        return hash(self._instrs)

    def __repr__(self) -> str:
        return f"Program({len(self._instrs)} instructions)"

    @classmethod
    def from_text(cls, text: str) -> Program:
        from deepx_core.ir.text import parse_text

        return cls(parse_text(text))

    def to_text(self) -> str:
        from deepx_core.ir.text import format_text

        return "\n".join(format_text(i) for i in self._instrs)

    @classmethod
    def unpack(cls, data: bytes) -> Program:
        from deepx_core.ir.wire import unpack_program

        return cls(unpack_program(data))

    def pack(self) -> bytes:
        from deepx_core.ir.wire import pack_program

        return pack_program(self._instrs)


# ---------------------------------------------------------------- programs that repeat exactly


def _kind(v: Any) -> Any:
    """What == does not see in a value: its type (1 == 1.0 == True) and the sign of a zero (0.0 == -0.0)."""
    t = type(v)
    if t is float and v == 0.0:
        return "-0" if math.copysign(1.0, v) < 0 else "+0"
    if t is tuple:
        return tuple(map(_kind, v))
    return t


def scalar_kinds(program: Sequence[Instr]) -> tuple[tuple[int, int, Any], ...]:
    """(instruction, arg, kind) of every number or vector among the program's args: with ==, two programs that
    this also matches are the same program (see `same_program`)."""
    out = []
    for i, instr in enumerate(program):
        for j, p in enumerate(instr.args):
            t = type(p.value)
            if t is not str:
                out.append((i, j, _kind(p.value)))
    return tuple(out)


def rekinded(kinds: tuple[tuple[int, int, Any], ...], program: Sequence[Instr], varied: Sequence[int]
             ) -> tuple[tuple[int, int, Any], ...]:
    """scalar_kinds(program), where `kinds` are those of a program that `program` repeats with new numbers at the
    positions `varied` (renumbered's): only those instructions' numbers are looked at again."""
    if not varied:
        return kinds
    at = set(varied)
    lo = bisect.bisect_left(kinds, (min(at),))
    hi = bisect.bisect_left(kinds, (max(at) + 1,))
    out = list(kinds)
    for pos in range(lo, hi):
        i, j, _ = out[pos]
        if i in at:
            out[pos] = (i, j, _kind(program[i].args[j].value))
    return tuple(out)


def same_program(program: Sequence[Instr], known: Sequence[Instr], kinds: tuple[tuple[int, int, Any], ...]) -> bool:
    """Whether `program` is exactly `known` (whose scalar_kinds are `kinds`): the same instructions, with numbers of
    the same types. Instructions that a client built once and sends again compare by identity, at C speed."""
    if program is known:
        return True
    if type(program) is not type(known):
        program = list(program) if type(known) is list else tuple(program)
    if len(program) != len(known) or program != known:
        return False
    for i, j, k in kinds:
        instr, was = program[i], known[i]
        if instr is was:  # the very instruction (or below, the very param): its numbers are the known ones
            continue
        p = instr.args[j]
        if p is was.args[j]:
            continue
        v = p.value
        if type(v) is not k and _kind(v) != k:
            return False
    return True


#: ops whose numbers (a learning rate, a step count) change from step to step without changing what the program does
#: with its tensors: a training step with Adam, or with a learning-rate schedule, is the same program every step
#: with new numbers in these (see `renumbered`)
NUMBERED_OPS = frozenset({"sgd", "adam", "adamw"})


def renumbered(program: Sequence[Instr], known: Sequence[Instr]) -> list[int] | None:
    """The positions where `program` differs from `known` only in the numbers of a NUMBERED_OPS instruction (the same
    tensors, categories and precisions, each number of the same type as before; a zero's sign may change there too);
    None where they differ otherwise (anything else, a number's type or, outside those, a zero's sign included, or a
    variable's name in place of a number)."""
    if len(program) != len(known):
        return None
    out = []
    for i, (a, b) in enumerate(zip(program, known)):
        if a is b:
            continue
        if a == b and all(p is q or _kind(p.value) == _kind(q.value) for p, q in zip(a.args, b.args)):
            continue
        if (a.name != b.name or a.name not in NUMBERED_OPS or a.returns != b.returns or a.meta != b.meta
                or len(a.args) != len(b.args)):
            return None
        for p, q in zip(a.args, b.args):
            if p is q:
                continue
            t = type(p.value)
            if p.category != q.category or p.precisions != q.precisions or t is not type(q.value):
                return None
            if p.value != q.value and (p.category != "var" or t not in (int, float, bool)):
                return None
        out.append(i)
    return out


def probe(program: Sequence[Instr]) -> tuple[Any, ...]:
    """The key a program is remembered by (the scheduler's plans, expansions' derivations: a Cache's buckets): its
    length and its first and last instructions, an optimizer update's numbers left out, so that a program it repeats
    with new numbers there (see `renumbered`) shares its key; the program itself is then compared with
    `same_program` or `renumbered`. It may not hash (a list inside a param): a Cache's bucket() and add() then find
    and keep nothing."""
    if not program:
        return (0, None, None)
    first, last = program[0], program[-1]
    return (len(program), (first.name, first.returns) if first.name in NUMBERED_OPS else first,
            (last.name, last.returns) if last.name in NUMBERED_OPS else last)


def _blanked(instr: Instr) -> Any:
    def blank(params: tuple[Param, ...]) -> tuple[Any, ...]:
        return tuple((p.category, p.precisions) if p.category in ("tensor", "listtensor") else p for p in params)

    if instr.name in NUMBERED_OPS:
        return instr.name, blank(instr.returns)
    return instr.name, blank(instr.args), blank(instr.returns), instr.meta


def input_probe(program: Sequence[Instr]) -> tuple[Any, ...]:
    """The key a plan is found by under other names for its inputs (the scheduler's second look, after `probe`'s
    misses): probe's with the tensors its first and last instructions name left out (a deletion's returns may be
    inputs too). The plans found are then matched one to one (Plan.renamed)."""
    if not program:
        return (0, None, None)
    return (len(program), _blanked(program[0]), _blanked(program[-1]))
