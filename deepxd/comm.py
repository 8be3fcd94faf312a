"""Collectives as instructions: how a daemon runs the collective family of a program (allreduce, broadcast,
allgather, reducescatter) for the rank of a process group whose session it serves (docs/distributed.md).

- **The formation.** A rank joins its group through its daemon (deepxd/groups.py, `group_join`); once the group is
  whole, the daemon keeps what it needs here (`formed`): this rank, the group's size, the node of every rank and
  who each is (pid, host: to tell a rank that died). This needs one rank per daemon (each rank's daemon runs its
  programs, and a program cannot wait in the middle for another program of the same worker); where ranks share a
  daemon, the group keeps meeting in the storage plane (collectives are then requests: deepx_sdk.distributed), and
  the join says so (`ring` false), in the log too.
- **The ring.** Rank r reads from rank r-1 over a peer link of its own (deepxd/peers.py, `open_link`: a Unix
  socket on one host, TCP with the cluster's token across), and serves rank r+1's reads (`coll_read`, answered by
  `serve_read`); deepxd/ring.py says what goes where. The plane is used for nothing but the meeting (the join) and
  for telling a rank that died.
- **When.** The op worker starts each bucket of a program's collectives (consecutive ones marked with the same
  `bucket`: DistributedDataParallel's gradients) as soon as the instructions before it that name its tensors have
  run (`early_launches`); one thread of this object's runs them in that order, and the kernel, at the collective's
  place, waits for it. So a gradient bucket's all-reduce runs while the rest of the backward is computed.
- **Faults.** Every wait looks, every LIVENESS_S, whether the rank it waits for still runs (its process, on this
  host; its daemon's heartbeat): a rank that died fails the collective at once, naming it, and the group's timeout
  bounds the rest. The group is then broken here: its later collectives fail at once, and so do the reads of the
  rank after this one, with the same cause, which so goes round the ring.

- **GPU ranks** (deepxd/comm_gpu.py): where a rank's programs run on op-cuda, `start` hands the bucket to
  deepxd/comm_gpu.py: through NCCL on the worker's stream where the formation's backend is `nccl` (every rank on
  op-cuda, each on a GPU of its own, NCCL loadable on every daemon: `backend_of`), else staged through host memory
  over the same ring. The kernels only call `start`.

A node may serve several ranks of one group (one per op worker: several GPUs in one daemon), so formations are kept
by (group, rank), the worker side finds its own by the executor's `worker_name`, and a ring read names the rank it
reads from.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import socket
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from deepx_core.errors import DeepxError
from deepx_core.ir.ops import Bound
from deepxd import ring
from deepxd.groups import LIVENESS_S, dead_ranks, process_gone, who
from deepxd.kernels.cpu.collective import arrays_of
from deepxd.net.peerlink import recv_chunk

if TYPE_CHECKING:
    from deepx_core.client import NativeClient
    from deepxd.node import Node

log = logging.getLogger(__name__)

#: a ring link's socket waits this much longer than the group's timeout (the other side answers within it)
SOCKET_SLACK_S = 30.0


class PeerLink:
    """The ring's link to rank r-1's daemon (ring.Link) over a native connection."""

    def __init__(self, client: NativeClient, rank: int, node: str) -> None:
        self.client, self.rank, self.node = client, rank, node

    def send(self, frame: dict[str, Any]) -> None:
        try:
            self.client.send_frame(frame)
        except OSError as e:
            raise DeepxError(self._lost(e)) from None

    def receive(self, rid: int, unit: int, dest: memoryview) -> None:
        try:
            recv_chunk(self.client.sock, dest, rid, unit)
        except TimeoutError:
            raise DeepxError(f"rank {self.rank}'s daemon (node {self.node}) sent nothing for "
                             f"{self.client.sock.gettimeout():g} s") from None
        except OSError as e:
            raise DeepxError(self._lost(e)) from None

    def _lost(self, e: OSError) -> str:
        return f"lost the peer link to rank {self.rank}'s daemon (node {self.node}): {e.strerror or e}"

    def close(self) -> None:
        self.client.close()


@dataclass
class Exchange:
    """The collective a rank runs now, as its successor reads it: the bytes of each unit it publishes, how many are
    ready, and how many the successor has (served: a request for unit u arrives once those before it are written)."""

    seq: int
    pubs: list[memoryview]
    published: int = 0
    served: int = 0


@dataclass
class Formation:
    """This daemon's rank of one formation of a process group. `backend`: `ring` (the peer links; GPU ranks staged
    through host memory) or `nccl` (deepxd/comm_gpu.py: `nccl_id` is rank 0's ncclUniqueId, `nccl` this rank's
    communicator once made, on the worker's thread)."""

    name: str
    gen: str
    rank: int
    world: int
    nodes: list[str]
    members: list[dict[str, Any]]
    timeout: float
    worker: str = ""
    backend: str = "ring"
    nccl_id: bytes | None = None
    nccl: Any = None
    nccl_close: Callable[[Callable[[], None]], None] | None = None  # runs a call on the communicator's thread
    seq: int = 0  # collectives started
    done: int = 0  # the last one that ended here
    broken: str | None = None
    exchange: Exchange | None = None
    link: PeerLink | None = None
    cond: threading.Condition = field(default_factory=threading.Condition)
    event: asyncio.Event = field(default_factory=asyncio.Event)

    def who(self, rank: int) -> str:
        return who(rank, self.members[rank])


class Work:
    """A bucket of collectives started (kernels/cpu/collective.py's Work): wait() returns once it is done, or raises
    DeepxError."""

    def __init__(self, future: concurrent.futures.Future[None] | None = None, error: str = "") -> None:
        self.future, self.error = future, error

    def wait(self) -> None:
        if self.error:
            raise DeepxError(self.error)
        if self.future is not None:
            try:
                self.future.result()
            except concurrent.futures.CancelledError:
                raise DeepxError("the collective was cancelled: its daemon stops") from None

    def settle(self) -> None:
        """Wait, whatever the outcome (a program that stopped before the collective's place: its arrays must not be
        written after the program)."""
        if self.future is not None:
            try:
                self.future.result()
            except (Exception, concurrent.futures.CancelledError) as e:
                log.debug("a collective of a program that stopped before it: %s", e)


_DONE = Work()


def _bucket_key(b: Bound) -> tuple[Any, ...] | None:
    """What the collectives of one bucket share (op, its args but the tensors, dtype and the `bucket` mark); None
    for one that is a bucket of its own."""
    mark = b.instr.get_meta("bucket") if b.instr.meta else None
    if mark is None or b.op.name not in ("allreduce", "broadcast"):
        return None
    meta = b.outs[0]
    return (b.op.name, tuple(b.args[1:]), meta.dtype if meta is not None else None, mark)


def _touched(b: Bound) -> list[str]:
    names = [n for n in b.names if type(n) is str]
    for n in b.names:
        if type(n) is list:
            names.extend(n)
    names.extend(str(n) for n in b.out_names)
    return names


def early_launches(bounds: Sequence[Bound]) -> dict[int, list[list[int]]]:
    """Where each bucket of a checked program's collectives starts: after instruction k (-1: before the first), the
    last one before it that names one of its tensors, and not before the bucket before it started (every rank starts
    them in the same order). {k: [the positions of each bucket starting there]}; empty where there is none."""
    out: dict[int, list[list[int]]] = {}
    last: dict[str, int] = {}
    started = -1
    i, n = 0, len(bounds)
    while i < n:
        b = bounds[i]
        if b.op.family != "collective":
            for name in _touched(b):
                last[name] = i
            i += 1
            continue
        members = [i]
        key = _bucket_key(b)
        while key is not None and i + len(members) < n and _bucket_key(bounds[i + len(members)]) == key:
            members.append(i + len(members))
        names = [name for m in members for name in _touched(bounds[m])]
        started = max([started, *(last.get(name, -1) for name in names)])
        out.setdefault(started, []).append(members)
        for name in names:
            last[name] = members[-1]
        i += len(members)
    return out


class Collectives:
    """A node's process-group formations and the thread that runs their collectives (see the module's doc)."""

    def __init__(self, node: Node | None = None) -> None:
        """`node`: the daemon's (started: on its event loop); None: groups of one rank only (a bare executor's)."""
        self.node = node
        self.loop = asyncio.get_running_loop() if node is not None else None
        self.formations: dict[tuple[str, int], Formation] = {}
        # one thread per rank formed here runs its collectives in order (ranks of one group on several workers of
        # this node each wait for the others on their own)
        self._threads: dict[tuple[str, int], ThreadPoolExecutor] = {}
        self.started = 0  # buckets started
        self.early = 0  # ...of which before the instruction just before them: overlapping the program
        self.runs = 0  # ...of which run over the ring

    # -- formations (deepxd/groups.py)
    def formed(self, name: str, gen: str, rank: int, members: Sequence[dict[str, Any]], timeout: float,
               nccl_id: bytes | None = None) -> str:
        """Rank `rank` of formation `gen` of group `name` joined through this node (members: every rank's record in
        the plane: node, worker, and for a rank on op-cuda its GPU and whether NCCL loads there). How its
        collectives run: "ring" or "nccl" (instructions of its programs, run here: `backend_of`), or "" where ranks
        share an op worker (requests meeting in the plane)."""
        world = len(members)
        for key, old in list(self.formations.items()):
            if key[0] == name and (old.gen != gen or key[1] == rank):
                del self.formations[key]
                self._drop(old, "it was formed again")
        backend = backend_of(members)
        if not backend:
            places = [_place(m) for m in members]
            shared = sorted({p for p in places if places.count(p) > 1})
            log.info("process group %r: ranks share op worker %s: its collectives are requests that meet in the "
                     "storage plane (the ring needs a worker per rank)", name, ", ".join(shared))
            return ""
        me = members[rank] if rank < world else {}
        self.formations[name, rank] = Formation(name, gen, rank, world, [str(m.get("node")) for m in members],
                                                [dict(m) for m in members], timeout, worker=str(me.get("worker", "")),
                                                backend=backend, nccl_id=nccl_id)
        if world > 1:
            if backend == "nccl":
                log.info("process group %r: rank %d of %d; collectives run in programs, through NCCL on %s",
                         name, rank, world, me.get("device") or "the GPU")
            else:
                log.info("process group %r: rank %d of %d; collectives run in programs, over a ring of peer links "
                         "(reads from node %s, read by node %s)%s", name, rank, world, members[(rank - 1) % world].get(
                             "node"), members[(rank + 1) % world].get("node"),
                         ", staged through host memory on this GPU rank" if me.get("gpu") else "")
        return backend

    def left(self, name: str, gen: str, rank: int | None = None) -> None:
        for key, f in list(self.formations.items()):
            if key[0] == name and f.gen == gen and (rank is None or key[1] == rank):
                del self.formations[key]
                self._drop(f, "its rank left")

    def _drop(self, f: Formation, why: str) -> None:
        broken = f.broken is not None
        f.broken = f.broken or f"process group {f.name!r}: {why}"
        self._wake(f)
        link, f.link = f.link, None
        if link is not None:
            self._thread_of(f).submit(link.close)  # after the collective running, if any
        if f.nccl is not None or f.nccl_close is not None:  # (made, or being made on its worker's thread)
            from deepxd.comm_gpu import close_communicator

            close_communicator(f, abort=broken or why != "its rank left")  # (finalized only on a clean leave)

    async def stop(self) -> None:
        for f in list(self.formations.values()):
            self._drop(f, "its daemon stops")
        self.formations.clear()
        for pool in self._threads.values():
            pool.shutdown(wait=False, cancel_futures=True)
        self._threads.clear()

    # -- the worker's side (its thread)
    def _formation(self, b: Bound, ex: Any = None) -> Formation:
        group = str(b.args[-1])
        mine = [f for (name, _), f in self.formations.items() if name == group]
        if len(mine) > 1:  # ranks of this group on several workers of this node: the executor's own
            worker = getattr(ex, "worker_name", "")
            mine = [f for f in mine if f.worker == worker]
        f = mine[0] if mine else None
        if f is None:
            raise DeepxError(f"{b.op.name}: no process group {group!r} on this daemon: init_process_group() through "
                             "this deepxd first (or its ranks share a deepxd: then collectives are requests, not "
                             "instructions; docs/distributed.md)")
        op = b.op.name
        if op in ("allgather", "reducescatter") and b.args[1] != f.world:
            raise DeepxError(f"{op}: world {b.args[1]} is not the size of process group {group!r} ({f.world})")
        if op == "broadcast" and not 0 <= b.args[1] < f.world:
            raise DeepxError(f"broadcast: src {b.args[1]} is not a rank of process group {group!r} (world_size "
                             f"{f.world})")
        return f

    def start(self, ex: Any, bounds: Sequence[Bound], early: bool = False) -> Work:
        """Begin the bucket `bounds` on executor `ex`'s tensors (on the worker's thread: the arrays are made and
        filled here, the ring runs on this object's thread). A group of one rank is done at once. `early`: started
        before the instruction just before it ran (counted)."""
        f = self._formation(bounds[0], ex)
        self.started += 1
        self.early += early
        if getattr(ex, "device_collectives", False):  # op-cuda's executor: NCCL, or staged through host memory
            from deepxd.comm_gpu import start_on_gpu

            return start_on_gpu(self, ex, f, bounds)
        return self.start_host(ex, f, bounds)

    def start_host(self, ex: Any, f: Formation, bounds: Sequence[Bound]) -> Work:
        """`start` on the host arrays of executor `ex` (op-cpu's, or a GPU rank's copies), over the ring."""
        b0 = bounds[0]
        op = b0.op.name
        pairs = [arrays_of(ex, b) for b in bounds]
        how = str(b0.args[1]) if op == "allreduce" else str(b0.args[2]) if op == "reducescatter" else ""
        rank, world = f.rank, f.world
        chunk = max(1, ring.CHUNK_BYTES // pairs[0][1].itemsize)
        finish: Callable[[], None] | None = None
        if op in ("allreduce", "broadcast"):
            src = int(b0.args[1]) if op == "broadcast" else -1
            for a, o in pairs:
                if o is not a and (op == "allreduce" or rank == src):
                    o[...] = a
            arrays = [o.reshape(-1) for _, o in pairs]
            if world == 1:
                return _DONE
            sizes = [x.size for x in arrays]
            sched = (ring.all_reduce(sizes, world, rank, chunk) if op == "allreduce"
                     else ring.broadcast(sizes, world, rank, src, chunk))
            if how == "mean":
                def finish() -> None:
                    for x in arrays:
                        np.divide(x, world, out=x, casting="unsafe")
        elif op == "allgather":
            a, o = pairs[0]
            flat = o.reshape(-1)
            flat[rank * a.size:(rank + 1) * a.size] = a.reshape(-1)
            if world == 1:
                return _DONE
            arrays, sched = [flat], ring.all_gather(flat.size, world, rank, chunk)
        else:  # reducescatter: on a copy of A, rank r's block of the result into C
            a, o = pairs[0]
            if world == 1:
                o[...] = a
                return _DONE
            work = a.reshape(-1).copy()
            arrays, sched = [work], ring.reduce_scatter(work.size, world, rank, chunk)
            m = o.size

            def finish() -> None:
                out = o.reshape(-1)
                out[...] = work[rank * m:(rank + 1) * m]
                if how == "mean":
                    np.divide(out, world, out=out, casting="unsafe")
        f.seq += 1
        said = f"{op}: collective #{f.seq} of process group {f.name!r}"
        combine = ring.COMBINE.get(how)
        return Work(self._thread_of(f).submit(self._run, f, f.seq, said, sched, arrays, combine, finish))

    def _thread_of(self, f: Formation) -> ThreadPoolExecutor:
        pool = self._threads.get((f.name, f.rank))
        if pool is None:
            pool = self._threads[f.name, f.rank] = ThreadPoolExecutor(
                max_workers=1, thread_name_prefix=f"deepx-collective-{f.name}-{f.rank}")
        return pool

    # -- this object's thread
    def _run(self, f: Formation, seq: int, said: str, sched: ring.Schedule, arrays: list[np.ndarray],
             combine: Any, finish: Callable[[], None] | None) -> None:
        if f.broken is not None:
            raise DeepxError(f"{said}: the group is broken ({f.broken}); call destroy_process_group() and "
                             "init_process_group() again")
        ex = Exchange(seq, [ring.as_bytes(arrays[u.array][u.start:u.stop]) for u in sched.pubs])
        with f.cond:
            f.exchange = ex
        try:
            link = self._link(f) if sched.recvs else None
            ring.run(sched, arrays, combine, link,
                     {"op": "coll_read", "group": f.name, "gen": f.gen, "seq": seq, "timeout": f.timeout,
                      "rank": (f.rank - 1) % f.world},
                     lambda n: self._published(f, ex, n), lambda n: self._wait_served(f, ex, n, seq))
            if finish is not None:
                finish()
            self.runs += 1
        except DeepxError as e:
            cause = str(e)
            if f.broken is None:
                f.broken = cause
            link, f.link = f.link, None
            if link is not None:
                link.close()
            raise DeepxError(f"{said}: {cause}") from None
        finally:
            with f.cond:
                f.exchange = None
                f.done = max(f.done, seq)
            self._wake(f)

    def _link(self, f: Formation) -> PeerLink:
        if f.link is None:
            prev = (f.rank - 1) % f.world
            node = f.nodes[prev]
            peers = self.node.peers if self.node is not None else None
            if peers is None or self.loop is None:
                raise DeepxError(f"this daemon has no peer links, so it cannot reach rank {prev} (node {node})")
            try:
                client = asyncio.run_coroutine_threadsafe(peers.open_link(node), self.loop).result(f.timeout)
            except (DeepxError, concurrent.futures.TimeoutError) as e:
                raise DeepxError(f"{f.who(prev)} cannot be reached over a peer link: {e}") from None
            client.sock.settimeout(f.timeout + SOCKET_SLACK_S)
            f.link = PeerLink(client, prev, node)
            log.info("process group %r: the ring reads from rank %d (node %s) over %s", f.name, prev, node,
                     client.address)
        return f.link

    def _published(self, f: Formation, ex: Exchange, n: int) -> None:
        ex.published = n
        self._wake(f)

    def _wake(self, f: Formation) -> None:
        if self.loop is None:
            return
        try:
            self.loop.call_soon_threadsafe(f.event.set)
        except RuntimeError:  # the loop is closed: nobody waits on it any more
            pass

    def _wait_served(self, f: Formation, ex: Exchange, n: int, seq: int) -> None:
        """Until rank r+1 has the first n units published (or it died, or the group's timeout)."""
        deadline = time.monotonic() + f.timeout
        succ = (f.rank + 1) % f.world
        while True:
            with f.cond:
                if ex.served < n and f.broken is None:
                    f.cond.wait(LIVENESS_S)
                if ex.served >= n:
                    return
            if f.broken is not None:
                raise DeepxError(f.broken)
            dead = self._dead(f, succ)
            if dead:
                raise DeepxError(f"{dead} before it took this rank's part of collective #{seq}")
            if time.monotonic() >= deadline:
                raise DeepxError(f"{f.who(succ)} did not take this rank's part of collective #{seq} within "
                                 f"{f.timeout:g} s (the group's timeout)")

    def _dead(self, f: Formation, rank: int | None) -> str:
        """Why rank `rank` (None: any rank, this one's own too) no longer runs (its process ended, its daemon is
        dead, it left), in words naming it; "" while it runs."""
        if self.loop is None:
            return ""
        try:
            return asyncio.run_coroutine_threadsafe(self._why_dead(f, rank), self.loop).result(min(f.timeout, 5.0))
        except concurrent.futures.TimeoutError:
            return ""

    async def _why_dead(self, f: Formation, rank: int | None) -> str:
        assert self.node is not None and self.node.kv is not None
        kv = self.node.kv
        record = await kv.hgetall(f"group:{f.name}")
        # (this rank's own process too: a script killed while its daemon waits in a collective for it leaves
        # nobody to read the result, and the wait, its kernels on the GPU, would hold the worker until the others
        # left or the group's timeout)
        ranks = [rank] if rank is not None else [*(r for r in range(f.world) if r != f.rank), f.rank]
        if record.get("gen") != f.gen:
            return (f"process group {f.name!r} was formed again or destroyed meanwhile, so "
                    f"{f.who(ranks[0]) if len(ranks) == 1 else 'the other ranks are'} gone")
        for r in ranks:
            if not record.get(f"m{r}"):
                return f"{f.who(r)} left the group (destroy_process_group, or its script ended)"
        return "; ".join(await dead_ranks(self.node, record, ranks))

    def wait_until(self, f: Formation, done: Callable[[], bool], what: str) -> None:
        """Until `done()` (polled: a GPU rank's NCCL call or its kernels), or raise DeepxError, naming the rank,
        where another rank of `f` died or left, the group broke, or the group's timeout passed (each LIVENESS_S
        looked at). `what`: the collective, for the error."""
        start = time.monotonic()
        deadline = start + f.timeout
        next_look = start + LIVENESS_S
        pause = 0.0
        while not done():
            if f.broken is not None:
                raise DeepxError(f.broken)
            now = time.monotonic()
            if now >= next_look:
                dead = self._dead(f, None)
                if dead:
                    raise DeepxError(f"{dead} before it reached {what}")
                next_look = time.monotonic() + LIVENESS_S
            if now >= deadline:
                others = ", ".join(f.who(r) for r in range(f.world) if r != f.rank)
                raise DeepxError(f"{others or 'the other ranks'} did not reach {what} within {f.timeout:g} s (the "
                                 "group's timeout)")
            time.sleep(pause)
            # a few microseconds at first (a collective of some MiB ends within a millisecond: the wait must not
            # add one), up to a millisecond once it has lasted a while
            pause = min(pause * 2 or 2e-6, 5e-5 if now - start < 0.05 else 1e-3)

    # -- the serving side: rank r+1's reads (native `coll_read`, on the event loop)
    async def serve_read(self, req: dict[str, Any]) -> dict[str, Any]:
        """Unit `unit` of collective `seq` of this rank of group `group` (formation `gen`), once published; a unit
        one past the last says the reader has all of them. DeepxError, naming the rank, where this rank died, broke
        or did not come within the group's timeout."""
        name, gen, seq, unit, timeout = (req.get(k) for k in ("group", "gen", "seq", "unit", "timeout"))
        rank = req.get("rank")
        if (not isinstance(name, str) or not isinstance(gen, str) or type(seq) is not int or type(unit) is not int
                or unit < 0 or not isinstance(timeout, int | float) or isinstance(timeout, bool) or timeout <= 0
                or not (rank is None or type(rank) is int)):
            raise DeepxError("coll_read: 'group' and 'gen' must be strings, 'seq', 'unit' and 'rank' whole numbers, "
                             "'timeout' seconds")
        deadline = time.monotonic() + float(timeout)
        f = await self._formation_of(name, gen, deadline, rank)
        next_look = time.monotonic() + LIVENESS_S
        while True:
            ex = f.exchange
            if ex is not None and ex.seq == seq:
                if unit > ex.served:
                    with f.cond:
                        ex.served = unit
                        f.cond.notify_all()
                if unit == len(ex.pubs):
                    return {"offset": unit, "data": b""}
                if unit > len(ex.pubs):
                    raise DeepxError(f"coll_read: collective #{seq} has {len(ex.pubs)} units here, not {unit + 1}")
                if unit < ex.published:
                    return {"offset": unit, "data": ex.pubs[unit]}
            if f.broken is not None:
                raise DeepxError(f.broken)
            if (ex.seq if ex is not None else f.done) > seq or (ex is None and f.done == seq):
                raise DeepxError(f"coll_read: collective #{seq} of process group {name!r} is over here (a rank ran "
                                 "another program's collectives)")
            now = time.monotonic()
            if now >= next_look:
                next_look = now + LIVENESS_S
                gone = process_gone(f.members[f.rank])
                if gone is not None:
                    raise DeepxError(f"{f.who(f.rank)} {gone} before it reached collective #{seq}")
            if now >= deadline:
                raise DeepxError(f"{f.who(f.rank)} did not reach collective #{seq} within {f.timeout:g} s (the "
                                 "group's timeout)")
            f.event.clear()  # (set by every publish and every change of exchange: look again after it)
            if f.exchange is not ex or f.broken is not None or (ex is not None and ex.seq == seq
                                                                 and ex.published > unit):
                continue
            try:
                await asyncio.wait_for(f.event.wait(), min(LIVENESS_S, max(0.0, deadline - now)))
            except TimeoutError:
                pass

    async def _formation_of(self, name: str, gen: str, deadline: float, rank: int | None = None) -> Formation:
        """This node's rank `rank` (None: its one rank) of formation `gen` of group `name`, waiting for it to be
        formed here (the reader's join may end before this one's)."""
        while True:
            for (n, r), f in self.formations.items():
                if n == name and f.gen == gen and (rank is None or r == rank):
                    return f
            if time.monotonic() >= deadline:
                node = self.node.config.node_id if self.node is not None else "?"
                raise DeepxError(f"process group {name!r} (formation {gen}) has no rank on node {node} (host "
                                 f"{socket.gethostname()})")
            await asyncio.sleep(0.005)


def _place(m: dict[str, Any]) -> str:
    """Where a member's programs run: its node and op worker."""
    return f"{m.get('node')}/{m.get('worker') or 'op-cpu'}"


def backend_of(members: Sequence[dict[str, Any]]) -> str:
    """How a formation's collectives run, the same on every rank (from the same records): "" where two ranks share
    an op worker (requests meeting in the plane: a worker runs one program at a time); "nccl" where rank 0 did not
    ask for the ring and every rank runs on op-cuda, on a GPU of its own, with NCCL loadable (`why_not_nccl`);
    else "ring"."""
    places = [_place(m) for m in members]
    if len(set(places)) != len(places):
        return ""
    want = str(members[0].get("backend") or "") if members else ""
    return "nccl" if want != "ring" and not why_not_nccl(members) else "ring"


def why_not_nccl(members: Sequence[dict[str, Any]]) -> str:
    """Why these ranks cannot run their collectives through NCCL, in words; "" where they can."""
    for r, m in enumerate(members):
        if not m.get("gpu"):
            return f"rank {r} runs on {m.get('worker') or 'op-cpu'} of node {m.get('node')}, not on a GPU"
        if not m.get("nccl"):
            return f"NCCL does not load on node {m.get('node')} (rank {r}): {m.get('nccl_why') or 'libnccl.so.2'}"
    seen: dict[tuple[str, str], int] = {}
    for r, m in enumerate(members):
        key = (str(m.get("host")), str(m.get("gpu")))
        if key in seen:
            return (f"ranks {seen[key]} and {r} share GPU {m.get('device') or m.get('gpu')} of host {key[0]} (NCCL "
                    "takes one rank per GPU)")
        seen[key] = r
    return ""
