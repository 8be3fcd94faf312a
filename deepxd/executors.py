"""Executors of other processes (docs/executor.md): a process that connects to a node's native listener (the Unix
socket, or TCP with the token, as any client does) and registers as an op worker of the node (`executor_register`:
its name and the ops it serves, each with its cost) is sent the instructions that the scheduler places on it, over
the same connection, and answers each with its results.

- **Its ops.** An op of the catalogue that the executor serves in place of the node's kernels (an override: the
  catalogue's signature and shape rule, for ops that only write their returns), or a new op that it declares (its
  signature, dtypes and a shape rule of `like ARG` or dims taken from its args): the new op joins the catalogue while
  an executor serves it, so that programs are checked against it as against any op, and leaves with the last one.
- **Placement** (`placement`): an instruction goes to an executor where it names one (`// executor=NAME`), or where
  its op is one that only executors serve (the cheapest of them: what its calls took so far, else the cost it
  declared). An op of the catalogue runs on the node's worker unless named: a program's placement does not change
  under it from one run to the next. The scheduler runs such a program in parts (Scheduler._run_placed).
- **A call** (`run`): the instruction checked against the worker's tensors, its input tensors fetched from the
  worker (or, for a heap tensor of this node where the executor maps this host's /dev/shm, its segment's name), sent
  with the instruction; the results checked against the op's shape rule and put into the worker.
- **Its end**: a connection that closes (the process ended, was killed, or let go) fails the call in flight at once,
  naming the executor; its ops are no longer placed there, and an op that only it served leaves the catalogue.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from deepx_core.errors import DeepxError
from deepx_core.ir.dtypes import STORABLE, to_numpy
from deepx_core.ir.effects import WRITES
from deepx_core.ir.instr import Instr
from deepx_core.ir.ops import (
    OPS,
    UNKNOWN,
    Arg,
    Call,
    OpDef,
    ProgramCheck,
    ProgramError,
    SymbolicEnv,
    TensorMeta,
    bind,
    op,
    remove_op,
    tensor_list,
)
from deepx_core.ir.shapes import numel
from deepx_core.ir.text import format_text, is_name
from deepx_core.ir.wire import instr_to_obj
from deepxd.actors.messages import Fetch, Info, Metas, Put, Remote, Variables
from deepxd.net.frames import HEADER, unpack_body

if TYPE_CHECKING:
    from deepxd.actors.base import ActorRef
    from deepxd.actors.heapmem import HeapMemory
    from deepxd.actors.worker import OpWorker, RunResult

log = logging.getLogger(__name__)

#: the kernel family of an op that executors declare: no kernel of the node runs it (deepxd/kernels/cpu/executor.py)
FAMILY = "executor"
#: the names an executor may not take: the node's own workers and actors
ROLES = frozenset({"registry", "heapmem", "scheduler", "op-cpu", "op-cuda"})
#: how often a call in flight looks whether its asker went away
POLL_S = 0.05
_VALUE_CATEGORIES = frozenset(("var", "vector", ""))
_ARG = re.compile(r"^\s*(tensor|var|vector)(?:<(num|int|bool|str|any)>)?\s+([A-Za-z_][A-Za-z0-9_]*)\s*$")
_DIM = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)\.(-?[0-9]+)$")


# ---------------------------------------------------------------- the ops an executor offers


@dataclass(frozen=True)
class Offer:
    """One op an executor serves: its catalogue entry, its cost (microseconds per call, its tensors moved included;
    None: not given) and, for an op it declares, the declaration as sent."""

    name: str
    cost_us: float | None
    declared: dict[str, Any] | None = None


def _arg(text: Any, where: str) -> Arg:
    m = _ARG.match(text) if isinstance(text, str) else None
    if m is None:
        raise DeepxError(f"{where}: {text!r} is not a parameter as `tensor NAME`, `var NAME` (or `var<int> NAME`, "
                         "num, int, bool, str, any) or `vector NAME`")
    kind, vtype, name = m.groups()
    return Arg(name, kind, None, vtype or "num")


def _result_rule(name: str, ret: str, spec: Any, args: Sequence[Arg], where: str
                 ) -> Callable[[Call], TensorMeta]:
    """How return `ret` of declared op `name` is shaped: `like ARG` (the shape and dtype of tensor arg ARG), or
    {shape: [dims], dtype}, a dim being a number, `ARG.k` (dim k of tensor arg ARG), a var arg's name (its value) or
    a vector arg's name (its values, spliced), the dtype a dtype's name or a tensor arg's (its dtype)."""
    index = {a.name: i for i, a in enumerate(args)}

    def tensor_arg(arg: str) -> int:
        k = index.get(arg)
        if k is None or args[k].kind != "tensor":
            raise DeepxError(f"{where}: result {ret!r} refers to {arg!r}, which is not a tensor arg of {name}")
        return k

    if isinstance(spec, str):
        words = spec.split()
        if len(words) != 2 or words[0] != "like":
            raise DeepxError(f"{where}: result {ret!r} must be `like ARG` or {{shape, dtype}}, not {spec!r}")
        k = tensor_arg(words[1])

        def like(c: Call) -> TensorMeta:
            return TensorMeta(tuple(c.args[k].shape), c.args[k].dtype)
        return like
    if not isinstance(spec, dict) or set(spec) - {"shape", "dtype"} or not isinstance(spec.get("shape"), list):
        raise DeepxError(f"{where}: result {ret!r} must be `like ARG` or {{shape: [dims], dtype}}, not {spec!r}")
    parts: list[Callable[[Call], list[int]]] = []
    for d in spec["shape"]:
        if type(d) is int and d >= 0:
            def fixed(c: Call, n: int = d) -> list[int]:
                return [n]
            parts.append(fixed)
        elif isinstance(d, str) and _DIM.match(d):
            arg, at = _DIM.match(d).groups()  # type: ignore[union-attr]
            k, j = tensor_arg(arg), int(at)

            def dim(c: Call, k: int = k, j: int = j, d: str = d) -> list[int]:
                shape = c.args[k].shape
                if not -len(shape) <= j < len(shape):
                    raise DeepxError(f"{name}: result {ret!r} takes dim {j} of '{c.names[k]}' ({d}), which has "
                                     f"{len(shape)} dims")
                return [int(shape[j])]
            parts.append(dim)
        elif isinstance(d, str) and d in index and args[index[d]].kind in ("var", "vector"):
            k = index[d]

            def value(c: Call, k: int = k) -> list[int]:
                v = c.args[k]
                items = list(v) if isinstance(v, (list, tuple)) else [v]
                if not all(type(x) is int or (isinstance(x, float) and x.is_integer()) for x in items):
                    raise DeepxError(f"{name}: result {ret!r} is shaped by {args[k].name}={v!r}, which is not whole "
                                     "numbers")
                return [int(x) for x in items]
            parts.append(value)
        else:
            raise DeepxError(f"{where}: result {ret!r}: dim {d!r} is not a number, `ARG.k` or a var or vector arg")
    dtype = spec.get("dtype")
    if dtype in STORABLE:
        pick: Callable[[Call], str] = lambda c: dtype  # noqa: E731
    elif isinstance(dtype, str) and dtype in index:
        k = tensor_arg(dtype)
        pick = lambda c: c.args[k].dtype  # noqa: E731
    else:
        raise DeepxError(f"{where}: result {ret!r}: dtype {dtype!r} is neither a dtype nor a tensor arg")
    return lambda c: TensorMeta(tuple(x for p in parts for x in p(c)), pick(c))


def declared_op(name: str, spec: dict[str, Any], where: str) -> OpDef:
    """The catalogue entry of a new op as an executor declares it (not added to the catalogue: `op(...)` adds it)."""
    args = [_arg(a, f"{where}: args") for a in _list(spec.get("args", []), f"{where}: args")]
    returns = [_arg(a, f"{where}: returns") for a in _list(spec.get("returns"), f"{where}: returns")]
    if not returns or any(r.kind != "tensor" for r in returns):
        raise DeepxError(f"{where}: returns must name at least one tensor (`tensor NAME`), and only tensors")
    names = [a.name for a in (*args, *returns)]
    if len(set(names)) != len(names):
        raise DeepxError(f"{where}: a name is given twice among args and returns ({', '.join(names)})")
    dtypes = spec.get("dtypes", sorted(STORABLE))
    if not isinstance(dtypes, list) or not dtypes or not all(d in STORABLE for d in dtypes):
        raise DeepxError(f"{where}: dtypes must be a list of dtype names (of {', '.join(sorted(STORABLE))}), got "
                         f"{dtypes!r}")
    results = spec.get("results")
    if not isinstance(results, dict) or set(results) != {r.name for r in returns}:
        raise DeepxError(f"{where}: results must give each return ({', '.join(r.name for r in returns)}) its "
                         "shape: `like ARG` or {shape: [dims], dtype}")
    rules = [_result_rule(name, r.name, results[r.name], args, where) for r in returns]
    doc = spec.get("doc", "")
    if not isinstance(doc, str):
        raise DeepxError(f"{where}: doc must be a string")
    return OpDef(name, FAMILY, tuple(args), tuple(returns), frozenset(dtypes), lambda c: [r(c) for r in rules],
                 doc or "served by an executor of another process (docs/executor.md)")


def _list(value: Any, where: str) -> list[Any]:
    if not isinstance(value, list):
        raise DeepxError(f"{where} must be a list, got {value!r}")
    return value


_DECLARED_KEYS = frozenset({"args", "returns", "dtypes", "results", "doc"})


def parse_offer(entry: Any, executor: str) -> Offer:
    """One entry of a registration's `ops` ({name, cost_us, and for a new op args, returns, dtypes, results,
    doc}), checked (the catalogue is not changed here)."""
    if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
        raise DeepxError(f"executor_register of {executor!r}: each of 'ops' must be a map with a 'name', got "
                         f"{str(entry)[:80]}")
    name = entry["name"]
    where = f"executor_register of {executor!r}: op {name!r}"
    if not is_name(name) or name == "backward":
        raise DeepxError(f"{where}: not a name deepxIR text can write, or one taken by the protocol")
    unknown = set(entry) - _DECLARED_KEYS - {"name", "cost_us"}
    if unknown:
        raise DeepxError(f"{where}: unknown keys {', '.join(sorted(unknown))}")
    cost = entry.get("cost_us")
    if cost is not None and (type(cost) not in (int, float) or not math.isfinite(cost) or cost < 0):
        raise DeepxError(f"{where}: cost_us must be a number of microseconds (0 or more), got {cost!r}")
    declared = {k: entry[k] for k in _DECLARED_KEYS if k in entry}
    known = OPS.get(name)
    if known is not None and known.family != FAMILY:  # an op of the catalogue: its signature is the catalogue's
        if declared:
            raise DeepxError(f"{where}: it is an op of the catalogue, whose signature and shape rule are the "
                             f"catalogue's ({known.signature()}); give only its name and cost_us")
        if known.effect.kind is not WRITES or known.effect.io or known.effect.reads_returns:
            what = ("touches files or the output" if known.effect.io else
                    "changes the set of tensors, or reads its returns")
            raise DeepxError(f"{where}: an executor may serve only ops that write their returns from their args; "
                             f"{name} {what}")
        return Offer(name, None if cost is None else float(cost), None)
    if not declared:
        raise DeepxError(f"{where}: no op of the catalogue has this name; declare it: args, returns, results "
                         "(and dtypes, doc), docs/executor.md")
    declared_op(name, declared, where)  # checked now: a bad declaration is refused at registration
    return Offer(name, None if cost is None else float(cost), declared)


# ---------------------------------------------------------------- one executor


class ExecutorGone(DeepxError):
    """The executor a call was sent to went away (its connection closed) before it answered."""


@dataclass
class OpCount:
    calls: int = 0
    seconds: float = 0.0
    bytes: int = 0


@dataclass(eq=False)
class Link:
    """A registered executor: its connection, the ops it serves, the calls in flight and its counters."""

    name: str
    offers: dict[str, Offer]
    writer: asyncio.StreamWriter
    pid: int | None = None
    host: str = ""
    peer: str = ""  # where it connected from (the listener's address and the peer's)
    attach: bool = False  # it maps this host's shared memory: heap tensors go by their segment's name
    since: float = field(default_factory=time.time)
    pending: dict[int, asyncio.Future[dict[str, Any]]] = field(default_factory=dict)  # calls waited for
    # calls it has not answered yet (a call whose asker went away too): id -> (op, since), the oldest first
    running: dict[int, tuple[str, float]] = field(default_factory=dict)
    ids: Any = field(default_factory=lambda: itertools.count(1))
    counts: dict[str, OpCount] = field(default_factory=dict)
    calls: int = 0
    errors: int = 0
    busy_s: float = 0.0
    last_error: str = ""
    gone: str = ""  # why it went (its connection closed): set once

    def who(self) -> str:
        return f"executor '{self.name}'" + (f" (pid {self.pid})" if self.pid else "")

    def estimate_us(self, op_name: str) -> float:
        """What a call of `op_name` costs here: what it took on average so far, else the cost it declared (inf where
        it gave none: it comes last among the executors that serve the op)."""
        c = self.counts.get(op_name)
        if c is not None and c.calls:
            return c.seconds / c.calls * 1e6
        offer = self.offers[op_name]
        return math.inf if offer.cost_us is None else offer.cost_us

    async def request(self, frame: dict[str, Any], cancel: Callable[[], bool] | None, what: str = ""
                      ) -> dict[str, Any] | None:
        """Send `frame` (with an id of this link's; `what`: the op it runs) and wait for its reply; None where
        `cancel()` said the asker went away first (the reply, when it comes, is dropped). ExecutorGone where the
        executor is or goes away."""
        if self.gone:
            raise ExecutorGone(f"{self.who()} went away ({self.gone})")
        rid = next(self.ids)
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self.pending[rid] = fut
        self.running[rid] = (what, time.perf_counter())
        try:
            body = _pack({**frame, "id": rid})
            if len(body) < 1 << 16:
                self.writer.write(HEADER.pack(len(body)) + body)
            else:  # (tensor data: no concatenated copy)
                self.writer.write(HEADER.pack(len(body)))
                self.writer.write(body)
            await self.writer.drain()
            if cancel is None:
                return await fut
            while True:
                done, _ = await asyncio.wait({fut}, timeout=POLL_S)
                if done:
                    return fut.result()
                if cancel is not None and cancel():
                    return None
        except (ConnectionError, RuntimeError) as e:  # (RuntimeError: a closed transport)
            self.close(f"its connection failed: {e}")
            raise ExecutorGone(f"{self.who()} went away ({self.gone})") from None
        finally:
            self.pending.pop(rid, None)

    def close(self, why: str) -> None:
        """The executor is gone: every call in flight fails now, naming it."""
        if self.gone:
            return
        self.gone = why
        self.running.clear()
        for fut in self.pending.values():
            if not fut.done():
                fut.set_exception(ExecutorGone(f"{self.who()} went away while running it ({why})"))
        self.writer.close()


def _pack(obj: dict[str, Any]) -> bytes:
    import msgpack

    return msgpack.packb(obj, use_bin_type=True)  # type: ignore[no-any-return]


# ---------------------------------------------------------------- every executor of the node


class Executors:
    """The executors registered with this node (see the module's doc): the scheduler asks which instructions of a
    program go to them (`claims`, `placement`) and runs those (`run`); the native listener registers them and reads
    their replies (`register`, `serve`); the registry and deepxctl read what they serve and how they are doing."""

    def __init__(self, node_id: str, *, shm: str = "", max_frame: int = 1 << 30) -> None:
        self.node_id = node_id
        self.shm = shm  # which /dev/shm this node sees (deepx_core.identity.shm_identity): one an executor shares
        self.max_frame = max_frame
        self.heapmem: ActorRef[HeapMemory] | None = None  # this node's heap tensors: their segments' names
        self.links: dict[str, Link] = {}
        self.served: dict[str, list[Link]] = {}  # op -> the executors that serve it, in order of registration
        self.declared: dict[str, dict[str, Any]] = {}  # the ops executors added to the catalogue: their declaration
        self.left: dict[str, str] = {}  # op -> the executor that served it last, gone: said where a program names it

    def __bool__(self) -> bool:
        return bool(self.links)

    # -- registration
    def register(self, req: dict[str, Any], writer: asyncio.StreamWriter, peer: str,
                 client: dict[str, Any] | None) -> Link:
        """An `executor_register` request: {name, ops: [...], shm}; `client`: who the connection said it is
        (hello's name, pid, host). The link, registered, its new ops in the catalogue."""
        name = req.get("name")
        if not isinstance(name, str) or not is_name(name) or len(name) > 64:
            raise DeepxError(f"executor_register: 'name' must be a name of at most 64 characters (no whitespace, "
                             f"',', '->', brackets or parentheses), got {str(name)[:80]!r}")
        if name in ROLES:
            raise DeepxError(f"executor_register: {name!r} is the name of a role of deepxd; choose another")
        old = self.links.get(name)
        if old is not None:
            raise DeepxError(f"executor_register: an executor named {name!r} is registered already ({old.who()}, "
                             f"from {old.peer}); choose another name, or stop that one first")
        ops = req.get("ops")
        if not isinstance(ops, list) or not ops:
            raise DeepxError(f"executor_register of {name!r}: 'ops' must list at least one op it serves")
        offers: dict[str, Offer] = {}
        for entry in ops:
            offer = parse_offer(entry, name)
            if offer.name in offers:
                raise DeepxError(f"executor_register of {name!r}: op {offer.name!r} is listed twice")
            have = self.declared.get(offer.name)
            if offer.declared is not None and have is not None and have != offer.declared:
                served = ", ".join(repr(k.name) for k in self.served.get(offer.name, ()))
                raise DeepxError(f"executor_register of {name!r}: op {offer.name!r} is declared otherwise by the "
                                 f"executors serving it now ({served}): {have}; declare it as they do")
            offers[offer.name] = offer
        shm = req.get("shm")
        client = client or {}
        link = Link(name, offers, writer, pid=client.get("pid") if type(client.get("pid")) is int else None,
                    host=str(client.get("host") or ""), peer=peer,
                    attach=bool(self.shm) and isinstance(shm, str) and shm == self.shm)
        for offer in offers.values():
            if offer.declared is not None and offer.name not in self.declared:
                d = declared_op(offer.name, offer.declared, f"executor_register of {name!r}")
                op(d.name, FAMILY, d.args, d.returns, d.dtypes, d.infer, d.doc, deepxir=False)
                self.declared[offer.name] = offer.declared
            self.served.setdefault(offer.name, []).append(link)
            self.left.pop(offer.name, None)
        self.links[name] = link
        log.info("executor %r registered (pid %s, from %s): %s%s", name, link.pid, peer, ", ".join(offers),
                 "; it maps this host's shared memory" if link.attach else "")
        return link

    def unregister(self, link: Link, why: str) -> None:
        """The executor went (`why`): calls in flight fail, its ops are placed elsewhere, those only it served leave
        the catalogue."""
        link.close(why)
        if self.links.get(link.name) is not link:
            return
        del self.links[link.name]
        for name in link.offers:
            serving = [k for k in self.served.get(name, ()) if k is not link]
            if serving:
                self.served[name] = serving
                continue
            self.served.pop(name, None)
            self.left[name] = link.name
            if self.declared.pop(name, None) is not None and name in OPS:
                remove_op(name)
        log.warning("executor %r (pid %s) went away: %s; its ops are no longer placed there", link.name, link.pid, why)

    async def serve(self, link: Link, reader: asyncio.StreamReader) -> None:
        """Read the executor's replies until its connection ends, each to the call that waits for it; then it is
        unregistered."""
        why = "its connection closed: the process ended, was killed, or let go"
        try:
            while True:
                (n,) = HEADER.unpack(await reader.readexactly(HEADER.size))
                if n > self.max_frame:
                    why = f"it sent a frame of {n} bytes, over the limit of {self.max_frame} (max_frame_bytes)"
                    break
                reply = unpack_body(await reader.readexactly(n))
                link.running.pop(reply.get("id"), None)  # type: ignore[arg-type]
                fut = link.pending.get(reply.get("id"))  # type: ignore[arg-type]
                if fut is not None and not fut.done():
                    fut.set_result(reply)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        except DeepxError as e:  # a body that is not msgpack: what it sends cannot be trusted
            why = f"it sent a malformed frame ({e})"
        finally:
            self.unregister(link, why)

    async def close(self) -> None:
        """The node stops: every executor's connection is closed (their calls in flight fail)."""
        for link in list(self.links.values()):
            self.unregister(link, "the node stopped")

    # -- placement
    def claims(self, program: Sequence[Instr]) -> bool:
        """Whether an instruction of `program` goes to an executor: its op is one that only executors serve, or it
        names one (a plain loop: it runs over every program while an executor is registered)."""
        declared = self.declared
        for instr in program:
            if instr.name in declared or (instr.meta and instr.get_meta("executor") is not None):
                return True
        return False

    def refused(self, program: Sequence[Instr]) -> ProgramError | None:
        """An instruction that names an executor (`// executor=NAME`) while none is registered: refused, naming it
        (where executors are registered, `placement` says so)."""
        for i, instr in enumerate(program):
            if instr.meta:
                asked = instr.get_meta("executor")
                if asked is not None:
                    return ProgramError(f"instruction {i + 1}: {instr.name}: no executor {asked!r} is registered on "
                                        f"node {self.node_id} (asked by // executor={asked}); none is", i)
        return None

    async def held_elsewhere(self, names: Sequence[str]) -> bool:
        """Whether any of `names` (tensors the worker does not have) is another node's heap tensor, which a program's
        part reaches when it reads it (the plane is read; nothing is mapped)."""
        if self.heapmem is None or not names:
            return False
        views, far = await self.heapmem.ask(Remote(names=list(names)))
        return bool(views or far)

    def missing(self, name: str) -> str:
        """What to add to "op NAME not found" where an executor that served it went away."""
        who = self.left.get(name)
        return "" if who is None else (f": executor {who!r}, which served it, went away; start it again (docs/"
                                       "executor.md)")

    def placement(self, program: Sequence[Instr]) -> list[Link | None] | None:
        """Where each instruction of `program` runs: the executor it names (`// executor=NAME`), or for an op only
        executors serve the cheapest of them, or None (the node's worker); None for the whole where every instruction
        stays. ProgramError for an instruction that names an executor that is not registered or does not serve its
        op."""
        places: list[Link | None] = [None] * len(program)
        for i, instr in enumerate(program):
            asked = instr.get_meta("executor") if instr.meta else None
            if asked is not None:
                link = self.links.get(asked)
                if link is None:
                    registered = ", ".join(sorted(self.links))
                    raise ProgramError(f"instruction {i + 1}: {instr.name}: no executor {asked!r} is registered on "
                                       f"node {self.node_id} (asked by // executor={asked}); registered: "
                                       f"{registered}", i)
                if instr.name not in link.offers:
                    raise ProgramError(f"instruction {i + 1}: {instr.name}: {link.who()} does not serve "
                                       f"{instr.name} (asked by // executor={asked}); it serves "
                                       f"{', '.join(sorted(link.offers))}", i)
                places[i] = link
            elif instr.name in self.declared:
                places[i] = min(self.served[instr.name], key=lambda k: k.estimate_us(instr.name))
        return places if any(p is not None for p in places) else None

    async def check(self, program: Sequence[Instr], fetch: Sequence[str], upto: int, worker: ActorRef[OpWorker]
                    ) -> RunResult | None:
        """A program that goes in parts (Scheduler._run_placed) checked whole, its first `upto` instructions (up to its
        first backward, whose gradients are known once derived), against the worker's tensors before any part runs:
        its refusal, or None. A program that reads a tensor another node holds (which the worker reaches when a part
        reads it) is left to its parts' checks."""
        from deepxd.actors.worker import RunResult, program_tensor_names
        from deepxd.compiler.analysis import named_tensors

        metas = await worker.ask(Metas(names=sorted(program_tensor_names(program[:upto], fetch))))
        variables, vectors = await _variables(program[:upto], worker)
        check = ProgramCheck(program[:upto], SymbolicEnv(metas, variables, vectors))
        try:
            check.step()
        except ProgramError as e:
            made = {n for instr in program[:e.index] for n in named_tensors(instr)}
            absent = [n for n in _tensors_read(program[e.index]) if n not in metas and n not in made]
            if absent and await self.held_elsewhere(absent):
                return None
            return RunResult(error=str(e), error_index=e.index, t0=time.time())
        missing = [n for n in fetch if check.sym.meta(n) is None] if upto == len(program) else []
        if missing:
            return RunResult(error=f"fetch: tensor '{missing[0]}' not found", error_index=len(program),
                             t0=time.time())
        return None

    # -- a call
    async def run(self, link: Link, instr: Instr, worker: ActorRef[OpWorker],
                  cancel: Callable[[], bool] | None = None) -> RunResult:
        """`instr` run on executor `link`, its inputs taken from `worker` and its results put there: the result of
        a one-instruction program (its error "instruction 1: OP: ..." naming the op, its tensors and the executor)."""
        from deepxd.actors.worker import RunResult

        start = time.perf_counter()
        result = RunResult(t0=time.time())
        try:  # checked against the worker's tensors as they are now; nothing is sent where that refuses it
            b = await self._bind(instr, worker, self.heapmem)
            args = await self._inputs(link, b, worker)
        except DeepxError as e:
            result.error, result.error_index = f"instruction 1: {e}", 0
            return result
        returns = [{"tensor": n, "dtype": m.dtype, "shape": list(m.shape)} if m is not None and m is not UNKNOWN
                   else {"tensor": n} for n, m in zip(b.out_names, b.outs)]
        began = (time.perf_counter() - start) * 1e6
        try:
            reply = await link.request({"op": "execute", "instr": instr_to_obj(instr), "text": format_text(instr),
                                        "args": args, "returns": returns}, cancel, instr.name)
            if reply is None:
                result.error, result.error_index, result.cancelled = (
                    f"instruction 1: {instr.name}: cancelled: the client's connection ended while {link.who()} ran "
                    "it", 0, True)
                return result
            if not reply.get("ok"):
                raise DeepxError(f"{link.who()} failed on {_described(b)}: {reply.get('error') or 'no reason given'}")
            nbytes = await self._outputs(link, b, reply.get("returns"), worker)
        except DeepxError as e:
            message = f"{instr.name}: {e}"
            if isinstance(e, ExecutorGone):
                message += ("; the instructions before it ran, none after; its ops are no longer placed there: "
                            "run the program again, or start the executor again")
            link.errors += 1
            link.last_error = message
            result.error, result.error_index = f"instruction 1: {message}", 0
            result.failed_at = began
            return result
        end = time.perf_counter()
        count = link.counts.setdefault(instr.name, OpCount())
        count.calls += 1
        count.seconds += end - start
        count.bytes += nbytes
        link.calls += 1
        link.busy_s += end - start
        result.done = 1
        result.raw_times = [began, (end - start) * 1e6]
        return result

    @staticmethod
    async def _bind(instr: Instr, worker: ActorRef[OpWorker], heapmem: ActorRef[HeapMemory] | None = None) -> Any:
        """`instr` checked against the worker's tensors (and variables, where it names one) as they are now, and
        against other nodes' heap tensors that it reads and the worker does not have (their records in the plane:
        the worker's fetch maps or streams them, as a program's check does)."""
        from deepxd.compiler.analysis import named_tensors, read_tensors

        metas = await worker.ask(Metas(names=named_tensors(instr)))
        missing = [n for n in read_tensors(instr) if n not in metas]
        if missing and heapmem is not None:
            _, far = await heapmem.ask(Remote(names=missing))
            metas.update({f.name: TensorMeta(tuple(f.shape), f.dtype) for f in far})
        return bind(instr, SymbolicEnv(metas, *await _variables((instr,), worker)))

    async def _inputs(self, link: Link, b: Any, worker: ActorRef[OpWorker]) -> list[dict[str, Any]]:
        """The args as the executor gets them: each tensor's bytes (or its segment's name, for a heap tensor of this
        node where the executor maps this host's shared memory), each other arg's value as bound."""
        names = [n for a, n in zip(b.op.args, b.names) if a.kind == "tensor" and n is not None]
        handles: dict[str, str] = {}
        if link.attach and self.heapmem is not None:
            for n in names:
                info = await self.heapmem.ask(Info(name=n, missing_ok=True))
                if info and info.get("state") == "live" and info.get("device") == "cpu" and info.get("handle"):
                    handles[n] = info["handle"]
        wanted = [n for n in dict.fromkeys(names) if n not in handles]
        arrays = await worker.ask(Fetch(names=wanted)) if wanted else {}
        out: list[dict[str, Any]] = []
        for a, n, v in zip(b.op.args, b.names, b.args):
            if a.kind == "tensor":
                meta = {"tensor": n, "dtype": v.dtype, "shape": list(v.shape)}
                if n in handles:
                    out.append({**meta, "handle": handles[n]})
                else:
                    flat = np.ascontiguousarray(arrays[n]).reshape(-1)
                    out.append({**meta, "data": flat.view(np.uint8).data})
            else:
                out.append({"value": list(v) if isinstance(v, tuple) else v})
        return out

    async def _outputs(self, link: Link, b: Any, got: Any, worker: ActorRef[OpWorker]) -> int:
        """The executor's results checked against the op's shape rule, then put into the worker (a heap tensor of
        this node's written in place): the bytes put."""
        heapmem = self.heapmem
        if not isinstance(got, list) or len(got) != len(b.out_names):
            raise DeepxError(f"{link.who()} answered {len(got) if isinstance(got, list) else 'no'} results for "
                             f"{_described(b)}; it writes {len(b.out_names)}")
        arrays = []
        for name, want, r in zip(b.out_names, b.outs, got):
            if not isinstance(r, dict) or not isinstance(r.get("dtype"), str) or not isinstance(r.get("shape"), list) \
                    or not isinstance(r.get("data"), (bytes, bytearray, memoryview)):
                raise DeepxError(f"{link.who()} answered a malformed result for '{name}' (it needs dtype, shape and "
                                 "data)")
            dtype, shape = r["dtype"], [int(d) for d in r["shape"]]
            if want is not None and want is not UNKNOWN and (dtype, tuple(shape)) != (want.dtype, tuple(want.shape)):
                raise DeepxError(f"{link.who()} answered {dtype}{shape} for '{name}'; the op's rule says "
                                 f"{want.dtype}{list(want.shape)}")
            try:
                npdt = to_numpy(dtype)
            except DeepxError as e:
                raise DeepxError(f"{link.who()} answered '{name}' as {e}") from None
            if len(r["data"]) != numel(shape) * npdt.itemsize:
                raise DeepxError(f"{link.who()} answered {len(r['data'])} bytes for '{name}' ({dtype}{shape}: "
                                 f"{numel(shape) * npdt.itemsize} bytes)")
            arrays.append((name, dtype, shape, r["data"]))
        for name, dtype, shape, data in arrays:
            heap = heapmem is not None and await heapmem.ask(Info(name=name, missing_ok=True)) is not None
            await worker.ask(Put(name=name, dtype=dtype, shape=shape, data=data, heap=heap))
        return sum(len(a[3]) for a in arrays)

    # -- what operators see
    def rows(self) -> list[dict[str, Any]]:
        """`deepxctl actors ls`: each executor as an op worker of the node."""
        now = time.perf_counter()
        rows = []
        for k in self.links.values():
            doing, since = next(iter(k.running.values()), ("", now))
            rows.append({"name": k.name, "role": "executor", "state": "running", "doing": doing,
                         "doing_s": round(now - since, 6) if doing else None, "mailbox": len(k.running),
                         "handled": k.calls, "errors": k.errors, "restarts": 0, "busy_s": round(k.busy_s, 6),
                         "last_error": k.last_error})
        return rows

    def listing(self) -> list[dict[str, Any]]:
        """`deepxctl executors ls`: each executor, who it is and the ops it serves with their costs."""
        rows = []
        for k in self.links.values():
            ops = []
            for name, offer in sorted(k.offers.items()):
                c = k.counts.get(name, OpCount())
                ops.append({"op": name, "signature": OPS[name].signature() if name in OPS else name,
                            "declared": offer.declared is not None, "cost_us": offer.cost_us, "calls": c.calls,
                            "mean_us": c.seconds / c.calls * 1e6 if c.calls else None})
            rows.append({"name": k.name, "node": self.node_id, "pid": k.pid, "host": k.host, "peer": k.peer,
                         "attach": k.attach, "since": k.since, "calls": k.calls, "errors": k.errors,
                         "ops": ops})
        return rows

    def registered(self) -> dict[str, float]:
        """Each executor's name and when it registered (one registered again under its name is another)."""
        return {k.name: k.since for k in self.links.values()}

    def op_stats(self) -> dict[str, dict[str, dict[str, float]]]:
        """Per executor, each op's calls, seconds and bytes (the registry writes them as a worker's: ops:NODE:NAME)."""
        return {k.name: {n: {"calls": c.calls, "seconds": c.seconds, "bytes": c.bytes} for n, c in k.counts.items()}
                for k in self.links.values()}

    def signatures(self) -> dict[str, dict[str, str]]:
        """Per executor, each op's signature and cost (the registry writes them beside the counters)."""
        return {k.name: {**{f"{n}.signature": OPS[n].signature() for n in k.offers if n in OPS},
                         **{f"{n}.cost_us": repr(o.cost_us) for n, o in k.offers.items() if o.cost_us is not None}}
                for k in self.links.values()}


async def _variables(program: Sequence[Instr], worker: ActorRef[OpWorker]
                     ) -> tuple[dict[str, Any], dict[str, tuple[Any, ...]]]:
    """The worker's variables and vectors, where `program` may name one (a string where a value goes); else none."""
    if not any(type(p.value) is str and p.category in _VALUE_CATEGORIES for instr in program for p in instr.args):
        return {}, {}
    held = await worker.ask(Variables())
    return held.get("vars", {}), {k: tuple(v) for k, v in held.get("vectors", {}).items()}


def _tensors_read(instr: Instr) -> list[str]:
    """The tensors an unchecked instruction reads, where it names them as tensors (a var where a tensor goes is
    refused by the check, and names no tensor)."""
    op = OPS.get(instr.name)
    names: list[str] = []
    if op is None:
        return names
    for k in op.effect.reads:
        p = instr.args[k] if k < len(instr.args) else None
        if p is not None and p.category not in ("var", "vector"):
            names.extend(tensor_list(p.value) or () if op.args[k].kind == "listtensor" else (str(p.value),))
    return names


def _described(b: Any) -> str:
    """An instruction's tensors as an error names them: `'a' (float32[2, 3]), 'b' (...) -> 'c'`."""
    ins = [f"'{n}' ({m.dtype}{list(m.shape)})" for a, n, m in zip(b.op.args, b.names, b.args) if a.kind == "tensor"]
    outs = ", ".join(f"'{n}'" for n in b.out_names)
    return f"{', '.join(ins) or 'no tensor'} -> {outs}"
