"""Programs across nodes (docs/cluster.md, "Programs across nodes"; docs/decisions/0042-programs-across-nodes.md).

A program sent to this node may have instructions that only another node serves (an op of an executor registered
there), or that cost less there (a small op on a large heap tensor of another host, whose bytes would otherwise
cross the link; an op that node's worker, of another kind, runs clearly faster). Where a program's plan is not in
the scheduler's cache, and other nodes are linked, the scheduler asks `Across.plan`, which answers None (everything
here, as on one node) or a `Placed`: where each instruction runs and what moves.

- **What is known**: the live nodes of the plane and the ops each serves, with their mean time per call
  (`ops:<node>:<worker>`: the registries' op statistics, read again only where their version in the `nodes` index
  changed, and the index at most once per heartbeat), each peer link's round
  trip (its pings) and bandwidth (its transfers; `peer_bandwidth_mbs` until one is measured), and the bytes of the
  tensors the program reads (the worker's metas, the plane's heap records) and writes (the ops' shape rules).
- **The cost model** (`place`): instruction by instruction, each node that may run it costs the bytes its inputs
  must move there over the link (a heap tensor is free on its owner's host, where it is mapped), the op's mean time
  there where its worker is of another kind (op-cuda, op-cpu) and the means differ clearly (`CLEARLY`), and a round
  trip where a segment begins there; the cheapest wins, this node on a tie. The whole is taken only where it costs
  less than running every instruction here, the results brought back included.
- **Segments** (`segments`): consecutive instructions placed on one peer go to it as one program over the peer link
  (`peer_run`): the tensors of this node it reads sent with it, under names of this node's own there
  (`_dx.<node>.<name>`), another node's heap tensors reached by name (mapped or streamed as any program does), the
  results that are read elsewhere later, fetched, or left at the end brought back into this node's worker, and its
  temporaries kept there only until the last segment there that reads them.
- **What may go**: an instruction that only writes its returns (effect `writes`, no files or output), reads no
  variable by name and writes no heap tensor; a `deltensor` of a result that lives only on a peer goes there. All
  else runs here, and a program with a backward, a collective or a variable read by name stays here whole (a
  collective's ranks are nodes that wait for each other: a segment sent to one of them would wait behind it).
"""

from __future__ import annotations

import bisect
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from deepx_core.errors import DeepxError
from deepx_core.ir.dtypes import from_numpy, itemsize
from deepx_core.ir.effects import DELETES, WRITES, apply_effect
from deepx_core.ir.instr import Instr, Param
from deepx_core.ir.ops import OPS, SymbolicEnv, TensorMeta, bind
from deepx_core.ir.shapes import numel
from deepxd.actors.messages import Fetch, Metas, Put, Remote, Run, RunProgram, State, WorkerTensors
from deepxd.peers import INDEX_TRUSTED, NODES, indexed_ops

if TYPE_CHECKING:
    from deepxd.actors.base import ActorRef
    from deepxd.actors.heapmem import HeapMemory
    from deepxd.actors.scheduler import Scheduler
    from deepxd.actors.worker import OpWorker, RunResult
    from deepxd.kv.base import KV
    from deepxd.peers import Far, Peers

log = logging.getLogger(__name__)

#: what the names of this node's tensors on a peer begin with: `_dx.<node>.<name>`
TEMP = "_dx."
#: an op's mean time on two nodes counts only where one is this many times the other (and both ran it MIN_CALLS
#: times): closer means are noise, a first call's warm-up among them, and placement must not flip with them
CLEARLY = 2.0
MIN_CALLS = 8
#: a node's op statistics are news to placement (a new version in the index) where an op ran for the first time or
#: for the MIN_CALLS-th, or its mean time moved by this factor (well inside CLEARLY): not at every counter's change
DRIFT = 1.25
#: the longest program placed across nodes (a longer one runs here whole)
MAX_PLACED = 4096
#: a round trip assumed where a link has not been timed yet (seconds)
DEFAULT_RTT_S = 1e-3

_VALUE_CATEGORIES = frozenset(("var", "vector", ""))


def placement_view(ops: Mapping[str, Mapping[str, float]]) -> dict[str, float | None]:
    """What placement reads of a worker's op counters (`OpStats`): each op's mean seconds per call where it ran
    MIN_CALLS times, else None."""
    return {op: s.get("seconds", 0.0) / s["calls"] if s.get("calls", 0) >= MIN_CALLS else None
            for op, s in ops.items()}


def moved(before: Mapping[str, float | None], now: Mapping[str, float | None]) -> bool:
    """Whether placement_view `now` tells placement something `before` did not (see DRIFT)."""
    if before.keys() != now.keys():
        return True
    for op, m in now.items():
        b = before[op]
        if (m is None) != (b is None):
            return True
        if m is not None and b is not None and not b / DRIFT <= m <= b * DRIFT:
            return True
    return False


def temp_prefix(node: str) -> str:
    """The names node `node`'s tensors take on a peer that runs a segment of its program."""
    return f"{TEMP}{node}."


# ---------------------------------------------------------------- what placement knows


@dataclass(frozen=True)
class Node:
    """A node as placement sees it: its host (nodes of one host map each other's heap tensors), the worker that runs
    its programs, the ops it serves (None: this node, whose catalogue is OPS), each op's mean seconds per call where
    it ran MIN_CALLS times, the executors serving ops there, and its link's round trip and bandwidth."""

    node: str
    host: str
    worker: str = "op-cpu"
    ops: frozenset[str] | None = None
    mean_s: Mapping[str, float] = field(default_factory=dict)
    executors: Mapping[str, str] = field(default_factory=dict)  # op -> the executor that serves it there
    rtt_s: float = 0.0
    bytes_per_s: float = math.inf

    def serves(self, op: str) -> bool:
        return op in OPS if self.ops is None else op in self.ops

    def worker_of(self, op: str) -> str:
        return self.executors.get(op, self.worker)


@dataclass(frozen=True)
class Held:
    """A tensor the program reads that exists before it: its bytes, the node that holds it, and whether it is a heap
    tensor (reached by name from any node: mapped on its owner's host, streamed from another)."""

    nbytes: int
    home: str
    heap: bool = False


@dataclass(frozen=True)
class Step:
    """What placement needs of one instruction: its op, the tensors it reads, writes (with the bytes of each, 0
    where unknown) and deletes, and whether it may run here and on a peer that serves its op."""

    op: str
    reads: tuple[str, ...] = ()
    writes: tuple[tuple[str, int], ...] = ()
    deletes: tuple[str, ...] = ()
    here: bool = True
    away: bool = False

    @property
    def written(self) -> tuple[str, ...]:
        return tuple(n for n, _ in self.writes)


@dataclass(frozen=True)
class Move:
    """`nbytes` of tensor `tensor` moved from node `src` to node `dst` (through this node, `via`, between peers)."""

    tensor: str
    src: str
    dst: str
    nbytes: int
    via: str = ""

    def row(self) -> dict[str, Any]:
        return {"tensor": self.tensor, "from": self.src, "to": self.dst, "bytes": self.nbytes,
                **({"via": self.via} if self.via else {})}


@dataclass
class Placement:
    """Where each instruction runs (`nodes`), what moves for it (`moves`), what is brought back at the end
    (`back`), and the cost of that against running everything here (seconds; inf where this node cannot)."""

    nodes: list[str]
    moves: list[list[Move]]
    back: list[Move]
    cost_s: float
    here_s: float


# ---------------------------------------------------------------- the cost model


def _bandwidth(nodes: Mapping[str, Node], a: str, b: str) -> float:
    x, y = nodes.get(a), nodes.get(b)
    return min(x.bytes_per_s if x is not None else math.inf, y.bytes_per_s if y is not None else math.inf)


def _time(nodes: Mapping[str, Node], here: str, n: str, op: str) -> float:
    """The op's time on node n as placement counts it: its mean there where its worker is of another kind than this
    node's (op-cuda, op-cpu) and the means differ clearly, else this node's (0 where this node has none: no
    evidence, no difference). Two workers of one kind run an op alike: what their means say apart is the load of
    their machines when they ran it, which placement must not chase."""
    mine = nodes[here].mean_s.get(op)
    if n == here:
        return mine or 0.0
    theirs = nodes[n].mean_s.get(op)
    if theirs is None or mine is None or nodes[n].worker == nodes[here].worker:
        return mine or 0.0
    if theirs * CLEARLY <= mine or theirs >= mine * CLEARLY:
        return theirs
    return mine


def place(steps: Sequence[Step], here: str, nodes: Mapping[str, Node], held: Mapping[str, Held],
          fetch: Sequence[str] = ()) -> Placement | None:
    """Where each instruction of a program runs (see the module's doc); None where every one runs here (or one
    cannot run anywhere: the program fails here as on one node)."""
    peers = sorted(n for n in nodes if n != here)
    heap = {name: h.home for name, h in held.items() if h.heap}
    where: dict[str, set[str]] = {name: {h.home} for name, h in held.items() if not h.heap}
    size: dict[str, int] = {name: h.nbytes for name, h in held.items()}

    reached: set[tuple[str, str]] = set()  # (heap tensor, node of another host) streamed there already

    def move(t: str, n: str) -> tuple[float, Move | None]:
        nbytes = size.get(t, 0)
        if t in heap:
            home = heap[t]
            if home == n or home not in nodes or nodes[home].host == nodes[n].host or (t, n) in reached:
                return 0.0, None  # mapped, or read there before (or its home is gone: the program's run says so)
            return nbytes / _bandwidth(nodes, home, n), Move(t, home, n, nbytes)
        holders = where.get(t)
        if not holders or n in holders:
            return 0.0, None
        if here in holders:
            return nbytes / _bandwidth(nodes, here, n), Move(t, here, n, nbytes)
        src = min(holders)
        via = here if n != here else ""
        s = nbytes / _bandwidth(nodes, src, here) + (nbytes / _bandwidth(nodes, here, n) if via else 0.0)
        return s, Move(t, src, n, nbytes, via)

    placed: list[str] = []
    moves: list[list[Move]] = []
    cost = 0.0
    here_s = 0.0  # every instruction here: the ops' times, and other hosts' heap tensors streamed once each
    prev = here
    for st in steps:
        candidates: list[str] = []
        gone = st.deletes and not st.reads and not st.writes and all(d not in heap for d in st.deletes)
        holders = set.intersection(*(where.get(d, set()) for d in st.deletes)) if gone else set()
        if gone and holders and here not in holders:
            candidates = [min(holders)]  # a result that lives on a peer only: deleted there
        else:
            if st.here:
                candidates.append(here)
            if st.away:
                candidates += [n for n in peers if nodes[n].serves(st.op)]
        if not candidates:
            return None
        best: tuple[float, str, list[Move]] | None = None
        for n in candidates:
            s = _time(nodes, here, n, st.op) + (nodes[n].rtt_s if n != here and n != prev else 0.0)
            ms = []
            for t in dict.fromkeys(st.reads):
                c, m = move(t, n)
                s += c
                if m is not None:
                    ms.append(m)
            if best is None or s < best[0]:
                best = (s, n, ms)
        assert best is not None
        s, n, ms = best
        if st.here:
            here_s += _time(nodes, here, here, st.op)
            for t in dict.fromkeys(st.reads):
                if t in heap and (t, "") not in reached:
                    reached.add((t, ""))  # ("": the program run here whole)
                    c, _ = move(t, here)
                    here_s += c
        else:
            here_s = math.inf
        cost += s
        for m in ms:
            if m.tensor in heap:
                reached.add((m.tensor, m.dst))
            else:
                where.setdefault(m.tensor, set()).update((m.dst, *((m.via,) if m.via else ())))
        for w, nbytes in st.writes:
            if w not in heap:
                where[w] = {n}
                size[w] = nbytes
        for d in st.deletes:
            where.pop(d, None)
        placed.append(n)
        moves.append(ms)
        prev = n
    if all(n == here for n in placed):
        return None
    back = []
    for t in dict.fromkeys((*(w for st in steps for w in st.written), *fetch)):
        left = where.get(t)
        if left and here not in left:
            src = min(left)
            back.append(Move(t, src, here, size.get(t, 0)))
            cost += size.get(t, 0) / _bandwidth(nodes, src, here)
    if here_s <= cost:
        return None
    return Placement(placed, moves, back, cost, here_s)


# ---------------------------------------------------------------- segments


@dataclass
class Segment:
    """Instructions start..end, run on `node`. For a peer's: the tensors this node sends with it (`ship`: under
    temporary names there), those it reads that are there already from a segment before (`reuse`), the results
    brought back after it (`back`), and the names there deleted after it (`drop`, temporaries no later segment
    there reads)."""

    node: str
    start: int
    end: int
    ship: list[str] = field(default_factory=list)
    reuse: list[str] = field(default_factory=list)
    back: list[str] = field(default_factory=list)
    drop: list[str] = field(default_factory=list)


def segments(steps: Sequence[Step], nodes: Sequence[str], here: str, heap: set[str] | frozenset[str],
             ) -> list[Segment]:
    """The runs of consecutive instructions on one node, each peer's with what goes to it, comes back and is
    deleted there (see Segment). A result is brought back where an instruction on another node reads it later (one
    on a third node gets it from here), where it is fetched, or where it is left at the end; it stays on its peer
    where a later segment there reads it, and goes there otherwise."""
    events: dict[str, list[int]] = {}  # name -> the instructions that read, write or delete it, in order
    for i, st in enumerate(steps):
        for t in (*st.reads, *st.written, *st.deletes):
            if t not in heap:
                lst = events.setdefault(t, [])
                if not lst or lst[-1] != i:
                    lst.append(i)

    def after(t: str, end: int) -> tuple[set[str], bool]:
        """The nodes of the instructions from `end` on that use t's value (read it, or delete it) before it is
        written again, and whether that value lasts to the end of the program."""
        uses: set[str] = set()
        lst = events.get(t, [])
        for j in lst[bisect.bisect_left(lst, end):]:
            st = steps[j]
            if t in st.reads:
                uses.add(nodes[j])
            if t in st.deletes:
                uses.add(nodes[j])
                return uses, False
            if t in st.written:
                return uses, False
        return uses, True

    out: list[Segment] = []
    kept: dict[str, set[str]] = {}  # node -> names there now (this node's, under temporary names)
    i = 0
    while i < len(steps):
        n, j = nodes[i], i
        while j < len(steps) and nodes[j] == n:
            j += 1
        seg = Segment(n, i, j)
        out.append(seg)
        if n != here:
            there = kept.setdefault(n, set())
            present, written = set(there), set()
            for st in steps[i:j]:
                for t in dict.fromkeys(st.reads):
                    if t in heap or t in present:
                        if t in there and t not in written and t not in seg.reuse:
                            seg.reuse.append(t)
                        continue
                    seg.ship.append(t)
                    present.add(t)
                for w in st.written:
                    if w not in heap:
                        present.add(w)
                        written.add(w)
                for d in st.deletes:
                    present.discard(d)
                    written.discard(d)
            there.clear()
            for t in sorted(present):
                uses, lasts = after(t, j)
                if t in written and (uses - {n} or lasts):
                    seg.back.append(t)
                if n in uses:
                    there.add(t)
                else:
                    seg.drop.append(t)
        i = j
    return out


def rename(instr: Instr, names: Callable[[str], str]) -> Instr:
    """`instr` with each tensor it names renamed by `names` (by its op's signature; by its params' categories for
    an op this node does not know)."""
    op = OPS.get(instr.name)

    def one(p: Param, kind: str) -> Param:
        if kind == "tensor" and p.category in ("tensor", "") and isinstance(p.value, str):
            return p._replace(value=names(p.value))
        if kind == "listtensor" and isinstance(p.value, tuple):
            return p._replace(value=tuple(names(str(v)) for v in p.value))
        if kind == "listtensor" and isinstance(p.value, str):  # written as text: [a, b]
            return p._replace(value=tuple(names(v) for v in p.value.strip()[1:-1].replace(",", " ").split()))
        return p

    if op is None:
        args = tuple(one(p, p.category) for p in instr.args)
        returns = tuple(one(p, p.category) for p in instr.returns)
    else:
        args = tuple(one(p, op.args[k].kind if k < len(op.args) else "") for k, p in enumerate(instr.args))
        returns = tuple(one(p, op.returns[k].kind if k < len(op.returns) else "")
                        for k, p in enumerate(instr.returns))
    return instr._replace(args=args, returns=returns)


# ---------------------------------------------------------------- a program's steps


def _category_names(params: Sequence[Param]) -> list[str]:
    out: list[str] = []
    for p in params:
        if p.category == "tensor":
            out.append(str(p.value))
        elif p.category == "listtensor" and isinstance(p.value, tuple):
            out.extend(str(v) for v in p.value)
    return out


def _reads_variable(instr: Instr) -> bool:
    """Whether `instr` may read a variable by name (a string where the op takes a number or a vector): such an
    instruction runs where the variable is, here."""
    op = OPS.get(instr.name)
    for k, p in enumerate(instr.args):
        if type(p.value) is not str or p.category not in _VALUE_CATEGORIES:
            continue
        if op is None or k >= len(op.args):
            return True
        a = op.args[k]
        if a.kind not in ("tensor", "listtensor") and a.vtype not in ("str", "any"):
            return True
    return False


def describe(program: Sequence[Instr], metas: Mapping[str, TensorMeta], heap: set[str] | frozenset[str]
             ) -> list[Step] | None:
    """The placement steps of `program` (see Step), the bytes of what it writes worked out from `metas` (the metas
    of the tensors it reads, here and on other nodes) by the ops' shape rules; None where an instruction of an op
    of the catalogue is refused by its rule (the program fails here, as on one node)."""
    from deepxd.compiler.analysis import read_tensors

    env = SymbolicEnv(dict(metas))
    out: list[Step] = []
    for instr in program:
        op = OPS.get(instr.name)
        if op is None:  # an op of another node's: by its params' categories
            reads = tuple(_category_names(instr.args))
            writes = tuple((n, 0) for n in _category_names(instr.returns))
            for n, _ in writes:
                env.tensors[n] = None
            away = not any(n in heap for n, _ in writes) and not _reads_variable(instr)
            out.append(Step(instr.name, reads, writes, (), here=False, away=away))
            continue
        effect = op.effect
        sizes: dict[str, int] = {}
        try:
            b = bind(instr, env)
        except DeepxError:
            if all(env.meta(n) is not None for n in read_tensors(instr)):
                return None  # refused by its rule: the check here says how
            change = apply_effect(instr)  # (it reads a result of an op of another node's: its size is unknown)
            for n in (*change.created, *change.written):
                env.tensors[n] = None
        else:
            env.apply(b)
            change = apply_effect(b)
            for n, m in zip(b.out_names, b.outs):
                if m is not None and m.shape[:1] != (-1,):
                    sizes[str(n)] = numel(m.shape) * itemsize(m.dtype)
        written = (*change.created, *change.written)
        deletes = tuple(change.deleted)
        if change.renamed:  # renametensor: a read of the old name, a write of the new one, here
            old, new = change.renamed[0]
            out.append(Step(instr.name, (old,), ((new, sizes.get(new, 0)),), (old,), here=True, away=False))
            continue
        if effect.kind is DELETES and any(n in heap for n in deletes):
            out.append(Step(instr.name, (), (), (), here=True, away=False))  # a heap tensor's: here, by its worker
            continue
        away = (effect.kind is WRITES and not effect.io and not effect.reads_returns and op.family != "executor"
                and not (instr.meta and instr.get_meta("executor") is not None)
                and not any(n in heap for n in written) and not _reads_variable(instr))
        out.append(Step(instr.name, tuple(change.reads), tuple((n, sizes.get(n, 0)) for n in written), deletes,
                        here=True, away=away))
    return out


def inputs(program: Sequence[Instr]) -> list[str]:
    """The tensors `program` reads before it writes them (by its ops' effects; an op this node does not know by its
    params' categories)."""
    from deepxd.compiler.analysis import read_tensors

    made: set[str] = set()
    out: dict[str, None] = {}
    for instr in program:
        op = OPS.get(instr.name)
        if op is None:
            reads, writes = _category_names(instr.args), _category_names(instr.returns)
        else:
            reads = read_tensors(instr)
            change = apply_effect(instr)
            writes = [*change.created, *change.written, *(new for _, new in change.renamed)]
        for n in reads:
            if n not in made:
                out[n] = None
        made.update(writes)
    return list(out)


# ---------------------------------------------------------------- a program placed, and its run


@dataclass
class Placed:
    """A program placed across nodes: its steps, the placement, the segments, the names reached by name (heap
    tensors), and the nodes as placement saw them."""

    program: Sequence[Instr]
    steps: list[Step]
    placement: Placement
    segments: list[Segment]
    heap: frozenset[str]
    nodes: Mapping[str, Node]
    here: str

    def rows(self) -> dict[str, Any]:
        """What explain and a run's reply say of it: each instruction's node and worker and what moved for it, what
        came back at the end, and the estimates."""
        return explained(self.program, self.here, self.nodes, self.placement)


def explained(program: Sequence[Instr], here: str, nodes: Mapping[str, Node], placement: Placement | None,
              worker: str = "") -> dict[str, Any]:
    """Each instruction's node and worker and what moved for it (all here, nothing moved, where `placement` is
    None), what came back at the end, the bytes moved in all, and the cost model's estimates (ms)."""
    from deepx_core.ir.text import format_text

    rows = []
    moved = 0
    for i, instr in enumerate(program):
        n = placement.nodes[i] if placement is not None else here
        ms = placement.moves[i] if placement is not None else []
        node = nodes.get(n)
        rows.append({"index": i, "instr": format_text(instr), "node": n,
                     "worker": node.worker_of(instr.name) if node is not None else worker,
                     "moved": [m.row() for m in ms]})
        moved += sum(m.nbytes * (2 if m.via else 1) for m in ms)
    back = [m.row() for m in placement.back] if placement is not None else []
    moved += sum(m.nbytes for m in placement.back) if placement is not None else 0
    out: dict[str, Any] = {"node": here, "instructions": rows, "back": back, "bytes": moved}
    if placement is not None:
        out["cost_ms"] = round(placement.cost_s * 1e3, 3)
        out["here_ms"] = round(placement.here_s * 1e3, 3) if math.isfinite(placement.here_s) else None
    return out


class Across:
    """This node's side of programs across nodes: the view of the other nodes (`nodes`, read from the plane at most
    once per heartbeat), a program's placement (`plan`), a peer's segment run over its link (`run_segment`), and
    the temporaries left on peers by a program that failed (`clean`)."""

    def __init__(self, kv: KV, peers: Peers, node_id: str, *, worker: str, heapmem: ActorRef[HeapMemory] | None,
                 bytes_per_s: float, heartbeat_s: float) -> None:
        self.kv = kv
        self.peers = peers
        self.node_id = node_id
        self.worker = worker  # the op worker that holds this node's tensors: op-cuda or op-cpu
        self.heapmem = heapmem
        self.bytes_per_s = bytes_per_s  # a link's bandwidth until one of its transfers is timed
        self.heartbeat_s = heartbeat_s
        self.prefix = temp_prefix(node_id)
        self._nodes: dict[str, Node] = {}
        self._records: dict[str, dict[str, str]] = {}  # the nodes' records as read with _nodes
        self._read_at = -math.inf
        # each node's op statistics as last read, by the version the index gave them (deepxd/peers.py, index_ops)
        self._ops: dict[str, tuple[str, dict[str, dict[str, str]]]] = {}
        self._ops_trusted = 0  # reads of the index the versions are trusted for, before all are read again
        self.ops_read = 0  # op statistics hashes read (a test's count)
        # other nodes' heap tensors as their records said, and when read: kept a heartbeat (a segment reaches a
        # tensor by name, so a record gone stale costs an estimate, never a wrong value)
        self._far: dict[str, tuple[Far, float]] = {}
        self.placed = 0  # programs run across nodes
        self.segments = 0  # segments run on peers
        self.moved = 0  # bytes sent to and brought back from peers

    def active(self) -> bool:
        """Whether another node is linked now (a plain look at the peer links: no cost on one node)."""
        return self.peers.linked()

    async def nodes(self) -> dict[str, Node]:
        """This node and the live peers that run a scheduler, as placement sees them (the plane read at most once
        per heartbeat)."""
        now = time.monotonic()
        if now - self._read_at < self.heartbeat_s and self._nodes:
            return self._nodes
        self._read_at = now
        records: dict[str, dict[str, str]] = {}
        index = await self.kv.hgetall(NODES)
        ids = (sorted(n[len("node:"):] for n in index if n.startswith("node:")) if index
               else [key.split(":", 1)[1] for key in await self.kv.keys("node:*")])
        for node in ids:
            record = await self.kv.hgetall(f"node:{node}")
            if node != self.node_id and (record.get("state") != "running" or
                                         "scheduler" not in record.get("roles", "").split(",")):
                continue
            if node != self.node_id and await self.peers.why_dead(node, record) is not None:
                continue
            records[node] = record
        stats = await self._op_stats(index, records)
        out: dict[str, Node] = {}
        for node, record in records.items():
            roles = record.get("roles", "").split(",")
            worker = "op-cuda" if "op-cuda" in roles else "op-cpu"
            served: set[str] = set()
            mean: dict[str, float] = {}
            executors: dict[str, str] = {}
            for w, h in sorted(stats.get(node, {}).items(), key=lambda kv: kv[0] != worker):
                ops = {f.rpartition(".")[0] for f in h if f.endswith(".signature")}
                served |= ops
                if w not in ("op-cpu", "op-cuda"):
                    for o in ops:
                        executors.setdefault(o, w)
                elif w != worker:
                    continue
                for o in ops | {f.rpartition(".")[0] for f in h if f.endswith(".calls")}:
                    try:
                        calls, secs = float(h.get(f"{o}.calls", 0)), float(h.get(f"{o}.seconds", 0))
                    except ValueError:
                        continue
                    if calls >= MIN_CALLS and o not in mean:
                        mean[o] = secs / calls
                    elif o not in mean and f"{o}.cost_us" in h:
                        try:
                            mean[o] = float(h[f"{o}.cost_us"]) * 1e-6
                        except ValueError:
                            pass
            mine = f"{self.peers.host}|{self.peers.shm}"
            if node == self.node_id:
                out[node] = Node(node, mine, self.worker, None, mean)
                continue
            host = mine if self.peers.same_host(record) else f"{record.get('host', '')}|{record.get('shm', '')}"
            rtt = self.peers.rtt_s(node)
            bw = self.peers.bandwidth(node)
            out[node] = Node(node, host, worker, frozenset(served), mean, executors,
                             rtt if rtt is not None else DEFAULT_RTT_S, bw if bw is not None else self.bytes_per_s)
        if self.node_id not in out:
            out[self.node_id] = Node(self.node_id, f"{self.peers.host}|{self.peers.shm}", self.worker)
        self._nodes = out
        self._records = records
        return out

    async def _op_stats(self, index: dict[str, str], records: Mapping[str, object]) -> dict[str, dict[str, dict[str,
                                                                                                       str]]]:
        """Each node's op statistics by worker: read again only where the index gives them a version not seen
        (and all once in INDEX_TRUSTED reads, so that a plane edited by hand heals); a scan of `ops:*` only where a
        node has no version there (a plane that lost its index)."""
        self._ops_trusted -= 1
        if self._ops_trusted <= 0:
            self._ops.clear()
            self._ops_trusted = INDEX_TRUSTED
        for node in [n for n in self._ops if n not in records]:
            del self._ops[node]
        unindexed = []
        for node in records:
            entry = indexed_ops(index, node)
            if entry is None:
                unindexed.append(node)
                continue
            version, workers = entry
            if node in self._ops and self._ops[node][0] == version:
                continue
            by_worker = {}
            for w in workers:
                by_worker[w] = await self.kv.hgetall(f"ops:{node}:{w}")
                self.ops_read += 1
            self._ops[node] = (version, by_worker)
        stats = {node: by_worker for node, (_, by_worker) in self._ops.items()}
        if unindexed:
            for key in await self.kv.keys("ops:*"):
                _, node, worker = key.split(":", 2)
                if node in unindexed:
                    stats.setdefault(node, {})[worker] = await self.kv.hgetall(key)
                    self.ops_read += 1
        return stats

    def forget_nodes(self) -> None:
        """The next placement reads the plane again (a peer failed a segment)."""
        self._read_at = -math.inf

    async def plan(self, program: Sequence[Instr], fetch: Sequence[str], worker: ActorRef[OpWorker]) -> Placed | None:
        """Where `program`'s instructions run (see the module's doc): None for here, whole. Asks nothing of the
        worker or the plane where no instruction could go elsewhere: every op served here, every tensor read here,
        and no peer clearly faster at one of its ops."""
        if len(program) > MAX_PLACED:
            return None
        unknown = False
        for instr in program:
            op = OPS.get(instr.name)
            if op is None:
                unknown = True
            elif op.family == "collective":  # (the other ranks wait for this one: see the module's doc)
                return None
        nodes = await self.nodes()
        if len(nodes) < 2:
            return None
        me = nodes[self.node_id]
        faster = any(_time(nodes, self.node_id, n, instr.name) < me.mean_s.get(instr.name, 0.0)
                     for instr in program for n in nodes if n != self.node_id)
        names = inputs(program)
        metas: dict[str, TensorMeta] = await worker.ask(Metas(names=names)) if names else {}
        missing = [n for n in names if n not in metas]
        if not unknown and not missing and not faster:
            return None
        far = await self._far_records(missing)
        if len(far) < len(missing):  # not found, or another node's that cannot be reached: the check here says so
            return None
        _, heap_here, _ = await worker.ask(State())
        held: dict[str, Held] = {}
        heap = set(heap_here) if self.worker == "op-cpu" else set()
        for n, m in metas.items():
            held[n] = Held(_nbytes(m), self.node_id, n in heap)
        all_metas = dict(metas)
        for f in far:
            held[f.name] = Held(f.nbytes, f.node, True)
            heap.add(f.name)
            all_metas[f.name] = TensorMeta(tuple(f.shape), f.dtype)
        steps = describe(program, all_metas, heap)
        if steps is None:
            return None
        placement = place(steps, self.node_id, nodes, held, fetch)
        if placement is None:
            return None
        frozen = frozenset(heap)
        return Placed(program, steps, placement, segments(steps, placement.nodes, self.node_id, frozen), frozen,
                      nodes, self.node_id)

    async def _far_records(self, names: Sequence[str]) -> list[Far]:
        """The live heap tensors of other nodes in host memory among `names` (the plane's records, read at most once
        a heartbeat each)."""
        if not names or self.heapmem is None:
            return []
        now = time.monotonic()
        known = {n: f for n, (f, at) in ((n, self._far[n]) for n in names if n in self._far)
                 if now - at < self.heartbeat_s}
        ask = [n for n in names if n not in known]
        if ask:
            _, records = await self.heapmem.ask(Remote(names=ask))
            if len(self._far) > 4096:
                self._far.clear()
            for f in records:
                known[f.name] = f
                self._far[f.name] = (f, now)
        return [f for f in (known.get(n) for n in names) if f is not None and f.state == "live" and f.device == "cpu"]

    async def explain(self, program: Sequence[Instr], fetch: Sequence[str], worker: ActorRef[OpWorker]
                      ) -> dict[str, Any]:
        """explained() of `program` as it would be placed now."""
        placed = await self.plan(program, fetch, worker) if self.active() else None
        if placed is not None:
            return placed.rows()
        nodes = self._nodes or {self.node_id: Node(self.node_id, "", self.worker)}
        return explained(program, self.node_id, nodes, None, self.worker)

    # -- a segment on a peer
    async def run_segment(self, placed: Placed, seg: Segment, worker: ActorRef[OpWorker],
                          cancel: Callable[[], bool] | None) -> RunResult:
        """Segment `seg` run on its peer (`peer_run`), its results brought back into `worker`: the result of the
        segment as a program of its own, its times on the peer's clock from when it was sent, its errors
        "instruction K: on node N: ..." numbered in it and naming the tensors as the program does."""
        from deepx_core.client import decode_tensor
        from deepx_core.ir.wire import pack_instr_cached
        from deepxd.actors.worker import RunResult

        prefix, heap, node = self.prefix, placed.heap, seg.node
        where = f"on node {node}"
        result = RunResult(t0=time.time())

        def temp(name: str) -> str:
            return name if name in heap else prefix + name

        sent = 0
        try:
            arrays = await worker.ask(Fetch(names=list(seg.ship))) if seg.ship else {}
            puts = []
            for name in seg.ship:
                a = np.ascontiguousarray(arrays[name])
                puts.append({"name": prefix + name, "dtype": from_numpy(a.dtype), "shape": list(a.shape),
                             "data": a.reshape(-1).view(np.uint8).data})
                sent += a.nbytes
            program = [pack_instr_cached(rename(placed.program[k], temp)) for k in range(seg.start, seg.end)]
            result.t0 = time.time()
            began = time.perf_counter()
            reply = await self.peers.call(node, "peer_run", cancel, self._records.get(node), node=self.node_id,
                                          prefix=prefix, program=program, puts=puts,
                                          fetch=[prefix + n for n in seg.back], drop=[prefix + n for n in seg.drop])
        except DeepxError as e:
            self.forget_nodes()  # (a node that went: the next placement reads the plane again)
            result.error = f"instruction 1: {where}: {e}; the instructions before it ran, none after"
            result.error_index = 0
            return result
        if reply is None:
            result.error = f"instruction 1: {where}: cancelled: the client's connection ended while it ran"
            result.error_index, result.cancelled = 0, True
            return result
        elapsed = time.perf_counter() - began
        r = reply.get("result") or {}
        done = int(r.get("done", 0))
        result.done = done
        result.raw_times = [float(t) for t in np.frombuffer(r.get("times") or b"", dtype=np.float64)[: 2 * done]]
        if not r.get("ok"):
            k = r.get("error_index")
            k = k if type(k) is int and 0 <= k < seg.end - seg.start else done
            error = str(r.get("error") or "failed").replace(prefix, "")  # its tensors under the program's names
            head = f"instruction {k + 1}: "
            result.error = f"{head}{where}: {error.removeprefix(head)}"
            result.error_index = k
            return result
        back = 0
        try:
            tensors = r.get("tensors") or {}
            for name in seg.back:
                obj = tensors.get(prefix + name)
                if obj is None:
                    raise DeepxError(f"node {node} did not send back '{name}'")
                a = decode_tensor(obj)
                back += a.nbytes
                await worker.ask(Put(name=name, dtype=obj["dtype"], shape=list(a.shape), data=obj["data"]))
        except DeepxError as e:
            n = seg.end - seg.start
            result.error = f"instruction {n}: {where}: its results could not be brought back here: {e}"
            result.error_index = result.done = n - 1
            return result
        self.segments += 1
        self.moved += sent + back
        if sent + back >= 1 << 20:
            self.peers.note_transfer(node, sent + back, elapsed)
        return result

    async def clean(self, placed: Placed, upto: int) -> None:
        """The temporaries of this node's that the peers' segments before segment `upto` (where the program
        stopped) kept for a later one: deleted (a peer that cannot be reached keeps them until this node's next
        program there writes them again)."""
        for node in sorted({s.node for s in placed.segments[:upto] if s.node != self.node_id}):
            try:
                await self.peers.call(node, "peer_run", None, self._records.get(node), node=self.node_id,
                                      prefix=self.prefix, clean=True)
            except DeepxError as e:
                log.info("placement: this node's temporaries on node %s were not deleted: %s", node, e)


def _nbytes(m: TensorMeta) -> int:
    if m.shape[:1] == (-1,):
        return 0
    try:
        return numel(m.shape) * itemsize(m.dtype)
    except Exception:
        return 0


# ---------------------------------------------------------------- a peer's segment, run here


async def serve_peer_run(scheduler: ActorRef[Scheduler], worker: ActorRef[OpWorker], req: dict[str, Any],
                         program: list[Instr], gone: Callable[[], bool] | None = None) -> dict[str, Any]:
    """A segment of another node's program (`peer_run`): its tensors put here under its temporary names, the
    program run (placed here: it goes no further; `gone`: whether the asking node hung up, which stops it), the
    results it asks for fetched, and its temporaries that no later segment reads deleted; all of them where it
    failed, or where it asks (`clean`)."""
    from deepxd.net.native import encode_result

    prefix = req.get("prefix")
    if not isinstance(prefix, str) or not prefix.startswith(TEMP) or len(prefix) <= len(TEMP):
        raise DeepxError(f"peer_run: 'prefix' must be a node's temporary prefix ({TEMP}<node>.)")
    puts, fetch, drop = req.get("puts") or [], req.get("fetch") or [], req.get("drop") or []
    for what, names in (("fetch", fetch), ("drop", drop)):
        if not isinstance(names, list) or not all(isinstance(n, str) and n.startswith(prefix) for n in names):
            raise DeepxError(f"peer_run: '{what}' must list names under the prefix {prefix}")
    if not isinstance(puts, list) or not all(isinstance(p, dict) and isinstance(p.get("name"), str)
                                             and p["name"].startswith(prefix) for p in puts):
        raise DeepxError(f"peer_run: 'puts' must be tensors named under the prefix {prefix}")
    result: RunResult | None = None
    try:
        if req.get("clean"):
            return {"result": None}
        for p in puts:
            await worker.ask(Put(name=p["name"], dtype=p.get("dtype"), shape=p.get("shape") or [],
                                 data=p.get("data") or b""))
        result = await scheduler.ask(Run(program=program, fetch=fetch, cancel=gone, origin="peer"))
        return {"result": encode_result(result)}
    finally:
        await _delete_temporaries(worker, prefix, req, puts, program, drop, result)


async def _delete_temporaries(worker: ActorRef[OpWorker], prefix: str, req: dict[str, Any], puts: list[Any],
                              program: list[Instr], drop: list[str], result: RunResult | None) -> None:
    """After a peer's segment: `drop`, the temporaries no later segment there reads; where the segment failed
    (or was refused, or cancelled), every name it put or names under the prefix; where the node asks (`clean`, its
    program stopped: it sends nothing else meanwhile), every one of its names here."""
    from deepxd.compiler.analysis import named_tensors

    gone = list(drop)
    if req.get("clean"):
        gone = [r["name"] for r in await worker.ask(WorkerTensors()) if r["name"].startswith(prefix)]
    elif result is None or result.error:
        mine = {p["name"] for p in puts} | set(drop)
        for instr in program:
            mine.update(n for n in (named_tensors(instr) if instr.name in OPS else _category_names(instr.returns))
                        if n.startswith(prefix))
        have = await worker.ask(Metas(names=sorted(mine)))
        gone = [n for n in sorted(mine) if n in have]
    if not gone:
        return
    done = await worker.ask(RunProgram(program=[Instr("deltensor", (), (Param.tensor(n),)) for n in gone]))
    if done.error:  # one was not there after all: those that are
        have = await worker.ask(Metas(names=list(gone)))
        done = await worker.ask(RunProgram(program=[Instr("deltensor", (), (Param.tensor(n),))
                                                    for n in gone if n in have]))
    if done.error:
        log.warning("placement: deleting node %s's temporaries here failed: %s", prefix, done.error)


__all__ = ["Across", "Held", "Move", "Node", "Placed", "Placement", "Segment", "Step", "describe", "explained",
           "inputs", "place", "rename", "segments", "serve_peer_run", "temp_prefix"]
