"""The registry: this node's entry, its workers' op lists and counters, in the storage plane; and the answers to
operators' questions (tensors, ops, nodes, actors, memory, graphs), gathered from the actors and the plane; and an
operator's `delete` of a tensor.

The plane is kept off the per-instruction path: op counters are pulled from the workers and written in one batch
per tick, only when they changed; the node's heartbeat is one hash write per tick. Each tick also reads one field of
`node:<id>`: where the plane lost the record (a Redis restarted empty, a FLUSHDB), the tick writes the whole node
record, the op signatures and every counter again, never a heartbeat alone into an emptied hash.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from deepx_core.errors import DeepxError
from deepx_core.ir.instr import Instr, Param
from deepx_core.ir.ops import OPS
from deepxd.actors.base import A, Actor, ActorRef, Message, R, end_task
from deepxd.actors.messages import (
    GraphRecords,
    HeapDelete,
    HeapStats,
    Info,
    Mapped,
    OpStats,
    RunProgram,
    Unmap,
    WorkerTensors,
)
from deepxd.kv.base import KV, Batch, escape_glob
from deepxd.owners import Owners, shown
from deepxd.peers import Peers, index_node, index_ops
from deepxd.placement import moved, placement_view

if TYPE_CHECKING:
    from deepxd.actors.heapmem import HeapMemory
    from deepxd.actors.scheduler import Scheduler
    from deepxd.actors.worker import OpWorker
    from deepxd.executors import Executors

log = logging.getLogger(__name__)

#: how long a listing waits for an op worker busy with a program before it says so (the registry answers one
#: query at a time: `deepxctl actors ls` queued behind `tensors ls` waited for the whole program)
BUSY_WORKER_S = 5.0


class Registry(Actor):
    role = "registry"

    def __init__(self, kv: KV, node_id: str, *, roles: list[str], addresses: dict[str, str],
                 workers: dict[str, ActorRef[OpWorker]] | None = None, heapmem: ActorRef[HeapMemory] | None = None,
                 actors: Callable[[], list[dict[str, Any]]] | None = None, heartbeat_s: float = 2.0,
                 devices: list[str] | None = None, name: str = "registry", blas: str = "",
                 scheduler: ActorRef[Scheduler] | None = None, owners: Owners | None = None,
                 peers: Peers | None = None, tls: bool = False, executors: Executors | None = None) -> None:
        super().__init__(name)
        self.executors = executors  # executors of other processes registered here: their ops as a worker's
        self.peers = peers if peers is not None else Peers(kv, node_id, heartbeat_s=heartbeat_s)  # who else lives
        self.tls = tls  # the TCP listener speaks TLS: peer links to it do too
        self.owners = owners or Owners()  # who made this node's tensors, and their labels (deepxd/owners.py)
        self.kv = kv
        self.node_id = node_id
        self.roles = roles
        self.addresses = addresses
        self.workers = workers or {}
        self.heapmem = heapmem
        self.actors_view = actors
        self.heartbeat_s = heartbeat_s
        self.devices = ["cpu"] if devices is None else devices  # where this node's op workers compute
        self.blas = blas  # the library op-cpu's matmul runs on ("" without op-cpu)
        self.scheduler = scheduler  # its planned graphs are written back where the plane lost them
        self._graphs_lost = False  # the plane lost this node's record: its graphs to write back (until it works)
        self.started = time.time()
        self._written_stats: dict[str, dict[str, dict[str, float]]] = {}
        # per worker, what placement read of its counters at the version last written to the index (placement_view)
        self._indexed: dict[str, dict[str, float | None]] = {}
        # the executors whose ops:NODE:NAME hash this registry wrote: name -> when that one registered
        self._executors: dict[str, float] = {}
        self._tick: asyncio.Task[None] | None = None
        self._asked: dict[tuple[str, str], asyncio.Future[Any]] = {}  # (actor, message): an ask not yet answered

    async def _ask_once(self, ref: ActorRef[A], message: Message[A, R], timeout: float, late: bool = False) -> R:
        """ref's answer to `message` within `timeout` seconds, else a DeepxError; where an earlier ask of it is not
        answered yet (an op worker running a long program), that one is waited on again rather than another sent:
        a timed-out ask stayed in the worker's mailbox, one op_stats per heartbeat, and `actors ls` showed the
        pile as a backlog. late: an answer that came after its asker gave up is taken (op counters, which only
        grow: with programs back to back, each longer than a heartbeat, a fresh ask never came back in time)."""
        key = (ref.name, message.message)
        fut: asyncio.Future[Any] | None = self._asked.get(key)
        if late and fut is not None and fut.done() and not fut.cancelled():
            del self._asked[key]
            return fut.result()
        if fut is None or fut.done():
            if fut is not None and not fut.cancelled():
                fut.exception()  # (an answer that came after its asker gave up: not read, so not logged as lost)
            fut = self._asked[key] = ref.ask_future(message)
        done, _ = await asyncio.wait({fut}, timeout=timeout)
        if not done:
            raise DeepxError(f"actor '{ref.name}' did not answer '{message.message}' within {timeout:g} s")
        if self._asked.get(key) is fut:  # (a flush at a heartbeat and one asked for may wait on one ask)
            del self._asked[key]
        answer: R = fut.result()
        return answer

    def _record(self) -> dict[str, Any]:
        """This node's whole `node:<id>` record, as running now."""
        return {"addresses": json.dumps(self.addresses), "roles": ",".join(self.roles), "pid": os.getpid(),
                "devices": ",".join(self.devices), "started": self.started, "heartbeat": time.time(),
                "state": "running", "blas": self.blas, "host": self.peers.host, "shm": self.peers.shm,
                "tls": "1" if self.tls else "", "heartbeat_s": self.heartbeat_s,
                "peer_timeout_s": self.peers.timeout_s}

    def _signatures(self, b: Batch) -> None:
        for worker in self.workers:
            b.hset(f"ops:{self.node_id}:{worker}", {f"{name}.signature": op.signature() for name, op in OPS.items()})

    async def on_start(self) -> None:
        async with self.kv.batch() as b:  # the record and its entry in the index together (peers.index_node)
            b.hset(f"node:{self.node_id}", self._record())
            # the counters are this daemon's since it started: a restart on a persisted plane left the last run's,
            # which those of ops not yet run again kept beside the new ones of the others
            b.delete(*(f"ops:{self.node_id}:{worker}" for worker in self.workers))
            self._signatures(b)
            index_node(b, self.node_id)
            index_ops(b, self.node_id, list(self.workers))
        if self._tick is None:
            self._tick = asyncio.get_running_loop().create_task(self._ticker(), name="registry:tick")

    async def _ticker(self) -> None:
        while self.alive:  # until the actor stops, not only until cancelled (see end_task)
            await asyncio.sleep(self.heartbeat_s)
            try:
                await self.flush()
            except Exception as e:  # a lost plane must not kill the heartbeat loop
                log.warning("registry: heartbeat failed: %s", e)

    async def flush(self) -> None:
        """Write the heartbeat and any op counters that changed since the last flush, in one batch; the whole node
        record, op signatures and counters where the plane lost the node's record."""
        stats = {}
        for worker, ref in self.workers.items():
            try:
                stats[worker] = await self._ask_once(ref, OpStats(), self.heartbeat_s, late=True)
            except DeepxError as e:
                log.debug("registry: no op stats from %s: %s", worker, e)
        executors = self.executors.registered() if self.executors is not None else {}
        if self.executors is not None:
            stats.update(self.executors.op_stats())
        key = f"node:{self.node_id}"
        lost = await self.kv.hget(key, "roles") is None  # its first field: none means the record is gone
        if lost:
            log.warning("registry: the storage plane had lost %s (a Redis restarted empty?); writing this node's "
                        "record, op signatures and counters again", key)
            self._written_stats = {}
        async with self.kv.batch() as b:
            b.hset(key, self._record() if lost else {"heartbeat": time.time()})
            if lost:
                self._signatures(b)
                index_node(b, self.node_id)
                self._executors = {}
            news = self._executors_written(b, executors) or lost
            views = {}
            for worker, ops in stats.items():
                before = self._written_stats.get(worker, {})
                changed = {f"{op}.{k}": v for op, s in ops.items() if s != before.get(op) for k, v in s.items()}
                if changed:
                    b.hset(f"ops:{self.node_id}:{worker}", changed)
                    views[worker] = placement_view(ops)
                    news = news or moved(self._indexed.get(worker, {}), views[worker])
                self._written_stats[worker] = ops
            if news:  # placement reads a node's op statistics again only when their version changed
                index_ops(b, self.node_id, [*self.workers, *executors])
                self._indexed.update(views)
        if lost and self.scheduler is not None:
            self._graphs_lost = True
        if self._graphs_lost:
            await self._write_back_graphs()

    async def _write_back_graphs(self) -> None:
        """The stored graphs this node's scheduler has planned (it keeps each one's bytes), written again where the
        plane lost them: a replay by name, here or on another node, finds them as before. Each only where no graph
        of that name stands (one stored meanwhile is newer); tried again at the next tick until it went through
        (a scheduler busy with a long program, a plane that failed a write)."""
        assert self.scheduler is not None
        try:
            records: dict[str, bytes] = await self._ask_once(self.scheduler, GraphRecords(), self.heartbeat_s)
        except DeepxError as e:
            log.warning("registry: could not read the scheduler's graphs to write them back (tried again at the "
                        "next heartbeat): %s", e)
            return
        written = []
        for name, data in records.items():
            if await self.kv.set_if_absent(f"graph:{name}", data):
                written.append(name)
        self._graphs_lost = False
        if written:
            log.warning("registry: the storage plane had lost %d stored graphs planned here; wrote them again: %s",
                        len(written), ", ".join(sorted(written)))

    def _executors_written(self, b: Batch, now: dict[str, float]) -> bool:
        """The ops of the executors registered now, as a worker's (`ops:NODE:NAME`: signature and cost, then the
        counters), those of the executors gone deleted, and those of an executor registered again under its name
        written afresh; whether any was."""
        gone = [name for name, since in self._executors.items() if now.get(name) != since]
        if gone:
            b.delete(*(f"ops:{self.node_id}:{name}" for name in gone))
            for name in gone:
                self._written_stats.pop(name, None)
        new = [name for name, since in now.items() if self._executors.get(name) != since]
        if new and self.executors is not None:
            signatures = self.executors.signatures()
            for name in new:
                b.hset(f"ops:{self.node_id}:{name}", signatures.get(name, {}))
        self._executors = dict(now)
        return bool(gone or new)

    def on_flush(self) -> Any:
        return self.flush()

    async def on_stop(self) -> None:
        if self._tick is not None:
            await end_task(self._tick, self.heartbeat_s + 5.0)
        try:
            await self.flush()
            async with self.kv.batch() as b:
                b.hset(f"node:{self.node_id}", {"state": "stopped", "heartbeat": time.time()})
                index_node(b, self.node_id)
        except Exception as e:
            log.warning("registry: could not mark node %s stopped: %s", self.node_id, e)
        for fut in self._asked.values():
            fut.cancel()  # (the actor asked skips a cancelled ask)
        self._asked.clear()

    # -- operators' questions
    async def on_tensors(self, prefix: str = "") -> list[dict[str, Any]]:
        rows: list[dict[str, Any]] = []
        heap_names: set[str] = set()
        for key in await self.kv.keys(f"tensor:{escape_glob(prefix)}*"):
            h = await self.kv.hgetall(key)
            if not h:
                continue
            row: dict[str, Any] = {"name": key.split(":", 1)[1], **h}
            for k in ("bytes", "refcount"):
                if k in row:
                    row[k] = int(float(row[k]))
            if isinstance(row.get("shape"), str):
                try:
                    row["shape"] = json.loads(row["shape"])
                except ValueError:
                    pass
            heap_names.add(row["name"])
            if row.get("node") == self.node_id:  # what this node knows now (the record may lag a label)
                row.update(self.owners.fields(row["name"]))
            rows.append(shown(row))
        alive: dict[str, bool] = {self.node_id: True}  # a live tensor of a dead node is `unreachable`
        for row in rows:
            node = row.get("node")
            if row.get("state") == "live" and isinstance(node, str):
                if node not in alive:
                    alive[node] = await self.peers.why_dead(node) is None
                if not alive[node]:
                    row["state"] = "unreachable"
        for worker, ref in self.workers.items():
            try:  # a worker answers between programs: a long one must not hold every other query behind this one
                listed = await self._ask_once(ref, WorkerTensors(), BUSY_WORKER_S)
            except DeepxError:
                raise DeepxError(f"{worker} is running a program and did not list its tensors within "
                                 f"{BUSY_WORKER_S:.0f} s (it answers between programs): try again later; the "
                                 "plane's records (heap tensors) are listed by deepxctl --kv URL tensors ls") from None
            for row in listed:
                if not row["name"].startswith(prefix):
                    continue
                if row["kind"] == "stack" or row["name"] not in heap_names:
                    rows.append(shown({**row, "node": self.node_id, "state": "live",
                                       **self.owners.fields(row["name"])}))
        self.owners.keep_only(r["name"] for r in rows if r.get("node") == self.node_id)
        return sorted(rows, key=lambda r: r["name"])

    async def on_ops(self) -> list[dict[str, Any]]:
        rows = []
        for key in await self.kv.keys("ops:*"):
            _, node, worker = key.split(":", 2)
            h = await self.kv.hgetall(key)
            ops: dict[str, dict[str, float]] = {}
            for field, value in h.items():
                op, _, stat = field.rpartition(".")
                if stat in ("calls", "seconds", "bytes"):
                    ops.setdefault(op, {})[stat] = float(value)
            for op, s in ops.items():
                calls = int(s.get("calls", 0))
                secs = s.get("seconds", 0.0)
                rows.append({"node": node, "worker": worker, "op": op, "calls": calls, "total_s": secs,
                             "mean_us": secs / calls * 1e6 if calls else 0.0, "bytes": int(s.get("bytes", 0))})
        return sorted(rows, key=lambda r: -r["total_s"])

    def on_caches(self) -> list[dict[str, Any]]:
        """Every cache of this daemon's process (deepx_core.cache): size, capacity, hits, misses, evictions. Read
        from the process, not the plane: each daemon answers for its own."""
        from deepx_core.cache import stats

        return [{"node": self.node_id, **row} for row in stats()]

    async def on_nodes(self) -> list[dict[str, Any]]:
        now = time.time()
        rows = []
        for key in await self.kv.keys("node:*"):
            h = await self.kv.hgetall(key)
            hb = float(h.get("heartbeat", 0) or 0)
            node = key.split(":", 1)[1]
            state = h.get("state", "")
            if state == "running" and node != self.node_id and await self.peers.why_dead(node, h) is not None:
                state = "dead"  # silent for peer_timeout_s: in the plane, or over its peer link
            rows.append({"node": node, "roles": h.get("roles", ""), "pid": h.get("pid", ""),
                         "state": state, "addresses": json.loads(h.get("addresses", "{}") or "{}"),
                         "devices": h.get("devices", ""), "heartbeat_age_s": round(now - hb, 3) if hb else None,
                         "started": float(h.get("started", 0) or 0), "blas": h.get("blas", ""),
                         "host": h.get("host", ""), **self.peers.link_row(node)})
        return sorted(rows, key=lambda r: r["node"])

    def on_actors(self) -> list[dict[str, Any]]:
        return self.actors_view() if self.actors_view is not None else []

    def on_executors(self) -> list[dict[str, Any]]:
        return self.executors.listing() if self.executors is not None else []

    async def on_memory(self) -> dict[str, Any]:
        tensors = await self.on_tensors()
        by_kind: dict[str, int] = {}
        by_owner: dict[str, int] = {}
        by_node: dict[str, int] = {}
        for t in tensors:
            n = int(t.get("bytes", 0))
            by_kind[t.get("kind", "?")] = by_kind.get(t.get("kind", "?"), 0) + n
            by_owner[t.get("owner", "?")] = by_owner.get(t.get("owner", "?"), 0) + n
            by_node[t.get("node", "?")] = by_node.get(t.get("node", "?"), 0) + n
        largest = sorted(tensors, key=lambda t: -int(t.get("bytes", 0)))[:10]
        heap = [{"name": t["name"], "refcount": t.get("refcount", 0), "holders": t.get("holders", ""),
                 "bytes": t.get("bytes", 0), "state": t.get("state", "")} for t in tensors if t.get("kind") == "heap"]
        pool = await self.heapmem.ask(HeapStats()) if self.heapmem is not None else {}
        return {"by_node": by_node, "by_owner": by_owner, "by_kind": by_kind, "largest": largest, "heap": heap,
                "heapmem": pool}

    async def on_graphs(self) -> list[dict[str, Any]]:
        """The stored programs (`graph:<name>` strings) as they are: name and msgpack bytes."""
        rows: list[dict[str, Any]] = []
        for key in await self.kv.keys("graph:*"):
            try:
                data = await self.kv.get(key)
            except DeepxError as e:  # a key of another type
                rows.append({"name": key.split(":", 1)[1], "data": None, "error": str(e)})
                continue
            if data is not None:
                rows.append({"name": key.split(":", 1)[1], "data": data})
        return rows

    async def _delete_elsewhere(self, name: str, node: str, force: bool) -> dict[str, Any]:
        """Delete heap tensor `name` of node `node`: this node lets go of its mapping first (its hold would refuse
        the delete, so the release is waited for), then asks that node over the peer link (deepxd/peers.py). A
        tensor of this node by that name (a stack tensor) is deleted here instead: on_delete looks here first."""
        assert self.heapmem is not None
        if await self.heapmem.ask(Unmap(name=name)):  # its release goes through the owner's lifecycle list
            holder = f"node:{self.node_id}"
            for _ in range(40):  # (applied at the owner's next poll, 50 ms)
                if holder not in (await self.kv.hget(f"tensor:{name}", "holders") or "").split(","):
                    break
                await asyncio.sleep(0.05)
        try:
            reply = await self.peers.ask(node, "delete", name=name, force=force)
        except DeepxError as e:
            raise DeepxError(f"delete: heap tensor {name!r} of node {node}: {e}") from None
        info: dict[str, Any] = reply["tensor"]
        return info

    async def on_delete(self, name: str, force: bool = False) -> dict[str, Any]:
        """Free tensor `name` of this node: a stack tensor at once; a heap tensor only while at most one reference
        is held (refcount <= 1), unless force. A forced heap tensor is freed in heapmem, which unlinks memory others
        still map rather than pooling it and tells the workers (`heap_gone`) to drop their views."""
        heap: dict[str, Any] | None = None
        if self.heapmem is not None:
            heap = await self.heapmem.ask(Info(name=name, missing_ok=True))
            if heap is None:
                mapped = await self.heapmem.ask(Mapped(name=name))  # another node's, mapped here
                if mapped is not None:
                    return await self._delete_elsewhere(name, mapped, force)
        holding: dict[str, int] = {}  # worker -> bytes of its view
        for worker, ref in self.workers.items():
            for row in await ref.ask(WorkerTensors()):
                if row["name"] == name:
                    holding[worker] = int(row["bytes"])
        if heap is None and not holding:
            other = await self.kv.hgetall(f"tensor:{name}")
            node = other.get("node")
            if other.get("kind") == "heap" and node and node != self.node_id and self.heapmem is not None:
                return await self._delete_elsewhere(name, node, force)
            if other and other.get("node") != self.node_id:
                raise DeepxError(f"delete: tensor {name!r} is a stack tensor of node {other.get('node')}, not "
                                 f"{self.node_id}; ask that node's deepxd")
            raise DeepxError(f"delete: no tensor named {name!r} on node {self.node_id}")
        shared = heap is not None and int(heap["refcount"]) > 1
        if shared and not force:
            assert heap is not None
            raise DeepxError(f"delete: heap tensor {name!r} is still referenced {heap['refcount']} times (held by "
                             f"{', '.join(heap['holders']) or 'unnamed holders'}); release it first, or force")
        # a worker that only views it (another holds it) cannot free it with a deltensor, which is refused then
        viewing_only = heap is not None and not set(holding) & set(heap["holders"])
        if (shared or viewing_only) and self.heapmem is not None:
            await self.heapmem.ask(HeapDelete(name=name, force=shared))  # it tells the workers to drop their views
            holding = {}
        for worker in holding:
            result = await self.workers[worker].ask(RunProgram(program=[Instr("deltensor", (), (Param.tensor(name),))]))
            if result.error:
                raise DeepxError(f"delete: {worker} could not free {name!r}: {result.error}")
        if heap is not None and not shared and self.heapmem is not None:
            # none any more where the worker's release was the last reference
            if await self.heapmem.ask(Info(name=name, missing_ok=True)) is not None:
                await self.heapmem.ask(HeapDelete(name=name))
        nbytes = int(heap["bytes"]) if heap is not None else max(holding.values())
        kind = "heap" if heap is not None else "stack"
        log.info("registry: deleted %s tensor %r (%d bytes)%s", kind, name, nbytes, " by force" if shared else "")
        return {"name": name, "kind": kind, "bytes": nbytes, "node": self.node_id, "forced": shared}
