"""Who made each tensor of a node, and what the client knows of it: the OWNER, PARAMETER and CALL SITE columns of
`deepxctl tensors ls`.

- A client says who it is in the native protocol's `hello`: its program's name, pid and host
  (deepx_core.identity). That is a `Session`; an embedded daemon's is its own process.
- What a session made is found by name, so that no program pays for it: an SDK session names all its tensors under
  one prefix (`x1f2e3a4b_`), which its `label` request gives; a graph stored over a connection names its
  temporaries under `<graph>.`; a tensor a connection put, or that its programs made where it gave no prefix (a
  script on NativeClient, `deepxctl ir`), is recorded by name.
- `label` also carries what only the SDK knows: a parameter's module path (`0.weight`) and the line of the user's
  code that made a tensor (`train.py:12`), sent once per tensor, when it is made.

Held in the daemon's memory; heapmem writes a heap tensor's into its plane record as well, so that other nodes and
`deepxctl --kv` show them. The labels of tensors that are gone are dropped whenever the node's tensors are listed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from deepx_core.errors import DeepxError
from deepx_core.identity import NAME_MAX
from deepx_core.ir.instr import Instr

SESSION_FIELDS = ("session", "client", "pid", "host")  # who made a tensor
LABEL_FIELDS = ("parameter", "call_site")  # what the SDK said of it
FIELDS = SESSION_FIELDS + LABEL_FIELDS
#: the op workers' names: a heap tensor's `owner` that is one of them was not named by a client
WORKERS = frozenset(("op-cpu", "op-cuda"))
LABEL_MAX = 1024  # characters of a label's value (a module path, a file:line)
LONG_PROGRAM = 4096  # a program this long is looked through off the loop
WRITES_MAX = 4096  # instructions whose written tensors are remembered (Owners._written)


@dataclass(frozen=True)
class Session:
    """A client process: its program's name, pid and host."""

    name: str
    pid: int
    host: str

    @property
    def text(self) -> str:
        """As OWNER shows it: `train.py[4242]@gpu-1`."""
        return f"{self.name}[{self.pid}]@{self.host}"

    def fields(self) -> dict[str, str]:
        return {"session": self.text, "client": self.name, "pid": str(self.pid), "host": self.host}

    def _fields(self) -> dict[str, str]:
        """fields(), made once (not to be changed: a copy goes into a tensor's record)."""
        made = self.__dict__.get("_made_fields")
        if made is None:
            made = self.fields()
            object.__setattr__(self, "_made_fields", made)
        return made


def session_of_hello(req: Mapping[str, Any]) -> Session | None:
    """The session a `hello` names (`name`, `pid`, `host`); None where it names none (a client from before them).
    A field of the wrong type is refused, never coerced."""
    name, pid, host = req.get("name"), req.get("pid"), req.get("host")
    if name is None and pid is None and host is None:
        return None
    if not isinstance(name, str) or not name.strip():
        raise DeepxError(f"hello: 'name' must be the client program's name (a string), got {name!r:.80}")
    if type(pid) is not int or pid <= 0:
        raise DeepxError(f"hello: 'pid' must be the client's process id (a positive whole number), got {pid!r:.80}")
    if not isinstance(host, str):
        raise DeepxError(f"hello: 'host' must be the client's host name (a string), got {host!r:.80}")
    return Session(_printable(name)[:NAME_MAX], pid, _printable(host)[:255])


def _printable(text: str) -> str:
    """A client's words as one line of text (a newline or a control character would break a table's row)."""
    return "".join(c if c.isprintable() else "?" for c in text.strip())


@dataclass
class _Prefix:
    session: Session
    ended: bool = False  # its connection ended, leaving its tensors (dropped once none is left)


class Owners:
    """Who made which tensor of this node (by prefix or by name), and the labels clients gave."""

    def __init__(self) -> None:
        self._prefixes: dict[str, _Prefix] = {}
        self._named: dict[str, dict[str, str]] = {}  # tensor name -> its fields (a session's, labels)
        self._writes: dict[Instr, tuple[str, ...]] = {}  # an instruction -> the tensors it gives a value (_written)

    def bind(self, prefix: str, session: Session) -> None:
        """Tensors named `prefix...` are `session`'s."""
        if prefix:
            self._prefixes[prefix] = _Prefix(session)

    def ended(self, prefixes: Iterable[str], released: bool) -> None:
        """The connection that bound `prefixes` ended. `released`: its tensors were deleted, so their labels and the
        prefixes go now; else they stay while any of its tensors does (a session closed with release=False)."""
        gone = [p for p in prefixes if p in self._prefixes]
        for p in gone:
            if released:
                del self._prefixes[p]
            else:
                self._prefixes[p].ended = True
        if released and gone:
            starts = tuple(gone)
            for name in [n for n in self._named if n.startswith(starts)]:
                del self._named[name]

    def made(self, names: Iterable[str], session: Session) -> None:
        """`session` made (or put) these tensors."""
        fields = session._fields()
        text = fields["session"]
        named = self._named
        for name in names:
            own = named.get(name)
            if own is None:
                named[name] = dict(fields)
            elif own.get("session") != text:  # (the same text: the same fields already)
                own.update(fields)

    def label(self, tensors: Any) -> list[str]:
        """Record what a client says of its tensors: `{name: {"parameter": ..., "call_site": ...}}` (either may be
        absent; "" clears it). Returns the names labelled. Refused whole where any entry is malformed."""
        if not isinstance(tensors, dict):
            raise DeepxError(f"label: 'tensors' must map tensor names to their labels, got {type(tensors).__name__}")
        checked: list[tuple[str, dict[str, str]]] = []
        for name, label in tensors.items():
            if not isinstance(name, str) or not name or not isinstance(label, dict):
                raise DeepxError(f"label: 'tensors' must map tensor names to maps of labels, got {name!r:.80}: "
                                 f"{label!r:.80}")
            for key, value in label.items():
                if key not in LABEL_FIELDS or not isinstance(value, str):
                    raise DeepxError(f"label of '{name}': {key!r:.40} must be one of {', '.join(LABEL_FIELDS)} with a "
                                     f"string value, got {value!r:.80}")
            checked.append((name, {k: _printable(v)[:LABEL_MAX] for k, v in label.items()}))
        for name, label in checked:
            own = self._named.setdefault(name, {})
            for key, value in label.items():
                if value:
                    own[key] = value
                else:
                    own.pop(key, None)
        return [name for name, _ in checked]

    def label_request(self, req: Mapping[str, Any], session: Session | None, prefixes: set[str]) -> None:
        """A `label` request over a connection: `prefix` (the tensors named under it are the connection's session's;
        added to `prefixes`, the connection's) and `tensors` (label())."""
        prefix = req.get("prefix")
        if prefix is not None:
            if not isinstance(prefix, str) or len(prefix) < 4:
                raise DeepxError(f"label: 'prefix' must be a session's tensor-name prefix (a string of 4 characters "
                                 f"or more), got {prefix!r:.80}")
            if session is not None:
                self.bind(prefix, session)
                prefixes.add(prefix)
        tensors = req.get("tensors")
        if tensors is not None:
            self.label(tensors)

    async def made_by(self, op: str, req: Mapping[str, Any], session: Session, prefixed: bool) -> None:
        """Before a connection's `put` or `run`: what it makes is `session`'s (known before heapmem writes a heap
        tensor's record). A run's tensors are looked for only where the connection gave no prefix (an SDK session's
        are its by their names: nothing per program). What a refused request named is dropped at the next listing."""
        if not self.made_now(op, req, session, prefixed):  # off the loop, as the daemon unpacks a long program
            self.made(await asyncio.to_thread(written_by, req["program"]), session)

    def made_now(self, op: str, req: Mapping[str, Any], session: Session, prefixed: bool,
                 decoded: Sequence[Instr] | None = None) -> bool:
        """made_by without an await where it needs none (all but a run of more than LONG_PROGRAM instructions, whose
        names are looked for on a thread): whether it was done. `decoded`: the run's program, decoded already (what
        each of its instructions writes is remembered)."""
        if op == "put":
            if isinstance(req.get("name"), str):
                self.made([req["name"]], session)
            return True
        program = req.get("program")
        if prefixed or not isinstance(program, list) or not program:
            return True
        if len(program) > LONG_PROGRAM:
            return False
        if decoded is not None:
            self.made(self._written(decoded), session)
        else:  # (a loop's instructions decode from the wire's cache)
            self.made(written_by(program, cached=True), session)
        return True

    def _written(self, program: Sequence[Instr]) -> Iterable[str]:
        """written_by for decoded instructions, what each writes remembered (a client's loop sends the same ones)."""
        if len(program) == 1:
            return self._writes_of(program[0])
        names: dict[str, None] = {}
        for instr in program:
            names.update(dict.fromkeys(self._writes_of(instr)))
        return names

    def _writes_of(self, instr: Instr) -> Sequence[str]:
        memo = self._writes
        try:
            names = memo.get(instr)
        except TypeError:  # a value that does not hash
            return writes_of(instr)
        if names is None:
            if len(memo) >= WRITES_MAX:
                memo.clear()
            names = memo[instr] = tuple(writes_of(instr))
        return names

    def fields(self, name: str) -> dict[str, str]:
        """What is known of tensor `name`: its session's fields (by name, else by the longest prefix) and labels."""
        out: dict[str, str] = {}
        best = ""
        for prefix, bound in self._prefixes.items():
            if len(prefix) > len(best) and name.startswith(prefix):
                best = prefix
                out = bound.session.fields()
        own = self._named.get(name)
        if own:
            out.update(own)
        return out

    def keep_only(self, names: Iterable[str]) -> None:
        """The node's tensors are `names`: labels of others are dropped, and ended prefixes none of them is under."""
        live = set(names)
        for name in [n for n in self._named if n not in live]:
            del self._named[name]
        ended = [p for p, b in self._prefixes.items() if b.ended]
        if ended:
            used = {p for p in ended for n in live if n.startswith(p)}
            for p in ended:
                if p not in used:
                    del self._prefixes[p]


def written_by(program: list[Any], cached: bool = False) -> list[str]:
    """The tensors a program as sent (instructions packed, or as lists; or decoded) gives a value, from its ops'
    effects (read from the catalogue only: safe on a thread, unless `cached`: packed instructions decoded through
    the wire's cache, on the event loop). What does not decode is skipped: the run says so."""
    from deepx_core.ir.wire import instr_from_obj, unpack_instr, unpack_instr_cached

    unpack = unpack_instr_cached if cached else unpack_instr
    names: dict[str, None] = {}
    for obj in program:
        try:
            instr = obj if type(obj) is Instr else unpack(obj) if type(obj) is bytes else instr_from_obj(obj)
        except (DeepxError, ValueError, TypeError):
            continue
        names.update(dict.fromkeys(writes_of(instr)))
    return list(names)


def writes_of(instr: Instr) -> list[str]:
    """The tensors one instruction gives a value (written_by's)."""
    from deepx_core.ir.effects import DELETES, READS, RENAMES, SETS
    from deepx_core.ir.ops import OPS

    op = OPS.get(instr.name)
    if op is None or op.effect.kind in (DELETES, READS, SETS):
        return []
    if op.effect.kind is RENAMES:  # the name its first arg gives
        return [str(instr.args[0].value)] if instr.args else []
    names: list[str] = []
    for p in instr.returns:
        if p.category == "tensor" and type(p.value) is str:
            names.append(p.value)
        elif p.category == "listtensor" and isinstance(p.value, tuple):
            names.extend(str(n) for n in p.value)
    return names


def shown(row: dict[str, Any]) -> dict[str, Any]:
    """A tensor's row as listings show it: OWNER is the name a client gave (a heap tensor put with `owner=`), else
    the session that made it, else the worker that holds it; `pid` a number."""
    session = row.get("session")
    if session and (not row.get("owner") or row.get("owner") in WORKERS
                    or str(row.get("owner")).startswith("op-cuda:")):
        row["owner"] = session
    pid = row.get("pid")
    if isinstance(pid, str):
        row["pid"] = int(pid) if pid.isdigit() else None
    return row
