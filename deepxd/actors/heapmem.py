"""heapmem: the lifetime of heap tensors (weights, loaded data) that outlive sessions and are shared by processes.

- Each heap tensor lives in one shared-memory segment (`deepxd.shm`); any process attaches to it by the segment
  name that the `tensor:<name>` hash in the storage plane holds as `handle`, and sees the same bytes.
- A tensor is freed when its refcount reaches zero. Freed segments go to a pool, kept by size class (a power of two
  of at least 4 KiB) up to `pool_bytes`, and `create` takes from it before it makes a fresh segment, because
  faulting in fresh shared memory is ten times slower than reusing a mapped one (design.md section 4).
- Metadata is written to the plane on change only, one batch per request (or per tick of the lifecycle list).
- The `tensor_lifecycle` list carries create/get/delete commands (msgpack maps) from processes that have no actor
  ref; a tick pops them and applies them through the mailbox, so they are serialized with every other message.
  Several nodes may share it (one Redis): a command for a tensor another node holds (its `tensor:<name>` hash names
  the node), or a `create` that names another `node`, is forwarded to that node's own list,
  `tensor_lifecycle:<node>`, which each node polls too and applies as it comes; a `create` that names no node is
  made by the node that pops it. A command that cannot be applied or forwarded is logged with the reason.
- The plane's records are always written whole (never a field or two into a hash that may have gone), and a check
  every `check_s` writes a held tensor's record again when the plane lost it (a Redis restarted empty).
- On stop every segment is unlinked and the live tensors' hashes say "stopped"; on start a tensor of this node whose
  segment is gone is marked "lost" (its metadata is kept for the operator), one whose segment survived a daemon
  that died without stopping is adopted, and segments that dead daemons of this node left behind are unlinked.
- With a device heap (the op-cuda worker's `DeviceHeap`, when that role runs) heap tensors live in GPU memory
  instead: the record carries `device` and `ipc_handle` (hex of the CUDA IPC handle another process opens with
  `deepxd.ipc.open_tensor`), refcount zero frees the memory, and GPU memory never outlives its daemon (a restart
  finds such tensors `lost`).
- Other nodes' heap tensors (deepxd/peers.py): a node of this host holds one (`node:<id>` among its holders, recorded
  by `hold` over the peer link before it maps the segment) and gives the hold back through the owner's lifecycle
  list; a node of another host reads its bytes (`read`) over the link. The holds of a node found dead are released
  (`release_dead`, every check_s), and a node's start gives back the holds that a daemon of its id took before it
  died.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import operator
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgpack
import numpy as np

from deepx_core.errors import DeepxError
from deepx_core.ir.dtypes import to_numpy
from deepxd.actors.base import Actor, ActorRef, ActorStopped, end_task
from deepxd.actors.messages import CheckRemote, HeapGone, Lifecycle, ReleaseDead, Republish
from deepxd.kv.base import KV, Batch
from deepxd.owners import FIELDS as OWNER_FIELDS
from deepxd.owners import Owners
from deepxd.peers import REMOTE_HOLDER, Far, Peers
from deepxd.shm import (
    OutOfSharedMemory,
    Segment,
    SegmentExists,
    orphan_segments,
    pid_alive,
    segment_exists,
    segment_name,
    segment_pid,
    unlink_segment,
)

if TYPE_CHECKING:
    from deepxd.actors.worker import OpWorker

log = logging.getLogger(__name__)

LIFECYCLE = "tensor_lifecycle"
CHECK_S = 2.0  # how often heapmem checks that the plane still has its tensors' records
WHOLE_CHECK = 15  # every record of the node's tensors read once in this many checks (one key in the others)
#: `heap_checked:<node>`: a key that only the record check writes; the light check reads it alone (a plane that lost
#: its keys lost it too, where a tensor's record may already be written again by a change to that tensor)
CHECKED = "heap_checked"
MIN_CLASS = 4096  # the smallest segment: one page
REUSE_CLASSES = 3  # a pooled segment up to 4x the needed class is reused rather than a fresh one made
TICK_BATCH = 100  # lifecycle commands popped per tick
#: how long one wait for a lifecycle command lasts on a store that wakes its waiters on a push (a stop that meets a
#: wait redis-py retried instead of cancelling waits this long at most)
WAKE_WAIT_S = 1.0
ZERO_IN_THREAD = 1 << 24  # reused segments this large are zeroed off the event loop


def size_class(nbytes: int) -> int:
    """The segment size for a tensor of `nbytes`: the next power of two, at least MIN_CLASS."""
    return max(MIN_CLASS, 1 << max(nbytes - 1, 0).bit_length())


def _key(name: str) -> str:
    return f"tensor:{name}"


def node_lifecycle(node: str) -> str:
    """The lifecycle list of one node: commands for its heap tensors, forwarded by the node that popped them from
    the shared `tensor_lifecycle` (or pushed there by a client that knows the node)."""
    return f"{LIFECYCLE}:{node}"


@dataclass(eq=False)
class _Heap:
    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    node: str
    owner: str
    holders: list[str]
    refcount: int
    handle: str
    ctime: float
    state: str = "live"  # live | lost | stopped
    segment: Segment | None = None
    view: Any = field(default=None, repr=False)  # an ndarray; a device array for a GPU tensor
    device: str = "cpu"
    ipc_handle: str = ""  # hex of the CUDA IPC handle of a GPU tensor
    block: Any = field(default=None, repr=False)  # a GPU tensor's memory (deepxd.actors.opcuda.DeviceBlock)
    lent: bool = False  # another node of this host mapped its segment (never pooled: see _drop)
    labels: dict[str, str] = field(default_factory=dict)  # who made it and what it is (deepxd/owners.py FIELDS)

    @property
    def present(self) -> bool:
        """Its memory exists (a segment, or a block of GPU memory); a lost or stopped tensor has none."""
        return self.segment is not None or self.block is not None

    def fields(self) -> dict[str, str]:
        return {"dtype": self.dtype, "shape": str(list(self.shape)), "node": self.node, "device": self.device,
                "bytes": str(self.nbytes), "kind": "heap", "owner": self.owner, "state": self.state,
                "refcount": str(self.refcount), "holders": ",".join(self.holders), "handle": self.handle,
                "ctime": repr(self.ctime), **({"ipc_handle": self.ipc_handle} if self.ipc_handle else {}),
                **self.labels}

    def info(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape), "node": self.node,
                "device": self.device, "bytes": self.nbytes, "kind": "heap", "owner": self.owner, "state": self.state,
                "refcount": self.refcount, "holders": list(self.holders), "handle": self.handle,
                "ctime": self.ctime}

    def who(self) -> str:
        unnamed = self.refcount - len(self.holders)
        parts = list(self.holders) + ([f"{unnamed} unnamed"] if unnamed > 0 else [])
        return ", ".join(parts) or "nobody"

    @classmethod
    def from_fields(cls, name: str, f: Mapping[str, str]) -> _Heap:
        """Parse a `tensor:<name>` hash; ValueError when a field is missing or malformed."""
        try:
            shape = json.loads(f["shape"])
            if not isinstance(shape, list) or not all(isinstance(d, int) for d in shape):
                raise ValueError(f"shape {f['shape']!r} is not a list of integers")
            return cls(name=name, dtype=f["dtype"], shape=tuple(shape), nbytes=int(f["bytes"]), node=f["node"],
                       owner=f.get("owner", ""), holders=[h for h in f.get("holders", "").split(",") if h],
                       refcount=int(f.get("refcount", "0")), handle=f.get("handle", ""),
                       ctime=float(f.get("ctime", "0")), state=f.get("state", "live"),
                       device=f.get("device", "cpu"), ipc_handle=f.get("ipc_handle", ""),
                       labels={k: f[k] for k in OWNER_FIELDS if f.get(k)})
        except KeyError as e:
            raise ValueError(f"field {e.args[0]!r} is missing") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"shape {f.get('shape')!r} does not parse: {e}") from None


class _Writes:
    """The plane writes of one request, or of one lifecycle tick: sent as one batch."""

    def __init__(self, kv: KV) -> None:
        self.batch: Batch = kv.batch()
        self.count = 0
        self.freed: set[str] = set()  # names deleted in this batch: free to create again before it is sent

    def hset(self, name: str, mapping: Mapping[str, str]) -> None:
        self.batch.hset(_key(name), mapping)
        self.count += 1

    def delete(self, name: str) -> None:
        self.batch.delete(_key(name))
        self.freed.add(name)
        self.count += 1

    def forward(self, node: str, raw: bytes) -> None:
        self.batch.rpush(node_lifecycle(node), raw)
        self.count += 1

    async def execute(self) -> None:
        if self.count:
            await self.batch.execute()


def _dims(shape: Any, what: str) -> tuple[int, ...]:
    bad = DeepxError(f"{what}: shape {shape!r} is not a list of integers")
    if isinstance(shape, (str, bytes)) or not isinstance(shape, (Sequence, np.ndarray)):
        raise bad
    dims: list[int] = []
    for d in shape:
        if isinstance(d, (bool, np.bool_)):
            raise bad
        try:
            dims.append(operator.index(d))
        except TypeError:
            raise bad from None
    for d in dims:
        if d < 0:
            raise DeepxError(f"{what}: shape {dims} has the negative dimension {d}")
    return tuple(dims)


def _holder(holder: Any, what: str) -> str:
    if not isinstance(holder, str) or "," in holder:
        raise DeepxError(f"{what}: holder {holder!r} must be a string without commas")
    return holder


class HeapMemory(Actor):
    """Heap tensors of one node in shared memory, their refcounts, and their metadata in the storage plane.

    Messages (all answer through `ask`; refusals are DeepxError naming the tensor): create, attach, release,
    delete, array, info, list, stats, relabel (deepxd/owners.py), lifecycle (the commands that the tick popped
    from `tensor_lifecycle`), and, for other nodes' tensors and other nodes' holds and reads: remote, map, mapped,
    unmap, forget_remote, check_remote, hold, read, release_dead.
    """

    role = "heapmem"

    def __init__(self, kv: KV, node_id: str, *, pool_bytes: int = 256 << 20, poll_s: float = 0.05,
                 check_s: float = CHECK_S, name: str | None = None, device: Any = None,
                 devices: dict[str, Any] | None = None, peers: Peers | None = None,
                 owners: Owners | None = None) -> None:
        super().__init__(name)
        # other nodes, and whether they live (a dead one's tensors are unreachable, its holds here released)
        self.peers = peers if peers is not None else Peers(kv, node_id)
        # heap tensors of other nodes of this host that programs here use: name -> (segment, node, handle)
        self._remote: dict[str, tuple[Segment, str, str]] = {}
        self.owners = owners  # who made the tensors, and their labels: written into their records
        self.kv = kv
        self.device = device  # a DeviceHeap (deepxd.actors.opcuda): heap tensors then live in its GPU memory
        # every GPU's DeviceHeap by its device (cuda:N), where op-cuda has a worker per GPU: a worker's heap tensors
        # go on its own GPU (its kernels cannot read another's memory); `device` serves the rest
        self.devices: dict[str, Any] = dict(devices or {})
        self.node = node_id
        self.pool_bytes = pool_bytes
        self.poll_s = poll_s
        self.check_s = check_s
        self.own_list = node_lifecycle(node_id)  # this node's lifecycle list (commands forwarded to it)
        self._checked = f"{CHECKED}:{node_id}"  # the record check's own key (on_republish)
        self._checked_written = False  # deleted at stop where written
        self._adopted: set[str] = set()  # tensors adopted at start from a daemon of this node that died
        self._conflicts: set[str] = set()  # tensors whose plane record names another node (warned once)
        self._verify_next = False  # on_republish: the plane lost records of ours in the last check
        self._check: asyncio.Task[None] | None = None
        self._tensors: dict[str, _Heap] = {}  # this node's heap tensors, live and lost
        self._pool: dict[int, list[Segment]] = {}  # size class -> free segments
        self._pooled_bytes = 0
        self._tick: asyncio.Task[None] | None = None
        self._waits: dict[str, asyncio.Future[None]] = {}  # the lifecycle lists' waits, kept across ticks
        # op workers that view heap tensors (their arrays are this memory): told `heap_gone` when one is freed, so
        # that no later program of theirs touches memory that is gone or given to another tensor
        self.viewers: list[ActorRef[OpWorker]] = []

    # -- lifecycle
    async def on_start(self) -> None:
        await self._recover()
        loop = asyncio.get_running_loop()
        if self._tick is None or self._tick.done():
            self._tick = loop.create_task(self._poll(), name=f"{self.name}:lifecycle")
        if self._check is None or self._check.done():
            self._check = loop.create_task(self._checker(), name=f"{self.name}:check")

    async def on_stop(self) -> None:
        for task in (self._tick, self._check):
            if task is not None:
                await end_task(task, self.poll_s + 5.0)
        self._tick = self._check = None
        for name in list(self._remote):
            await self._forget_remote(name)
        live = [t for t in self._tensors.values() if t.present]
        try:
            async with self.kv.batch() as b:
                if self._checked_written:
                    b.delete(self._checked)
                for t in live:
                    b.hset(_key(t.name), {**t.fields(), "state": "stopped"})
        except Exception as e:
            log.warning("%s: could not mark %d heap tensors stopped in the storage plane: %s", self.name, len(live), e)
        finally:
            for t in live:
                t.state, t.view = "stopped", None
                if t.block is not None:
                    self._gpu(t.device).free(t.block)
                    t.block = None
                    continue
                assert t.segment is not None
                t.segment.close()
                t.segment.unlink()
                t.segment = None
            for segs in self._pool.values():
                for seg in segs:
                    seg.close()
                    seg.unlink()
            self._pool.clear()
            self._pooled_bytes = 0

    async def _recover(self) -> None:
        """Find this node's heap tensors in the plane: adopt those whose segment survived, mark the rest lost,
        and unlink segments that dead daemons of this node left with no tensor naming them."""
        w = _Writes(self.kv)
        keep = {seg.name for seg in self._segments()}
        for key in await self.kv.keys("tensor:*"):
            name = key[len("tensor:"):]
            if name in self._tensors:
                continue  # known already (a restart after a crash)
            f = await self.kv.hgetall(key)
            if f.get("kind") == "heap" and f.get("handle"):
                keep.add(f["handle"])  # any node's record: its segment is no orphan
            if f.get("kind") == "heap" and f.get("node") not in (None, self.node):
                # holds a daemon of this node took before it died: this one maps nothing yet
                for _ in range(f.get("holders", "").split(",").count(REMOTE_HOLDER + self.node)):
                    await self._give_back_hold(name, f["node"])
                continue
            if f.get("kind") != "heap" or f.get("node") != self.node:
                continue
            try:
                t = _Heap.from_fields(name, f)
            except ValueError as e:
                log.warning("%s: %s has malformed metadata (%s); left as it is", self.name, key, e)
                continue
            if t.state == "live" and t.handle and segment_exists(t.handle):
                pid = segment_pid(t.handle, self.node)
                if pid is None or pid_alive(pid):
                    log.warning("%s: heap tensor %r is served by segment %r of live process %s; is another daemon "
                                "running as node %r? left alone", self.name, name, t.handle, pid, self.node)
                    keep.add(t.handle)
                    continue
                try:
                    t.segment = Segment.attach(t.handle, reserve=t.nbytes)
                except OutOfSharedMemory as e:  # a sparse segment of an older daemon: adopted, its values kept
                    log.error("%s: heap tensor %r is adopted without its memory reserved (%s); a write may fault "
                              "until shared memory is freed", self.name, name, e)
                    t.segment = Segment.attach(t.handle)
                except DeepxError as e:  # gone between the two looks
                    log.warning("%s: could not adopt heap tensor %r: %s", self.name, name, e)
                    t.segment = None
            if t.segment is not None:
                keep.add(t.handle)
                self._tensors[name] = t
                self._adopted.add(name)
                log.info("%s: adopted heap tensor %r from a daemon that died (segment %s)", self.name, name, t.handle)
                continue
            if t.state != "lost":
                log.warning("%s: heap tensor %r was lost when its daemon stopped (it was %s)", self.name, name, t.state)
                t.state = "lost"
                w.hset(name, t.fields())
            self._tensors[name] = t
        await w.execute()
        self._remove_orphans(keep)

    def _remove_orphans(self, keep: set[str]) -> None:
        """Unlink the segments of dead processes that no heap record refers to, where they are this node's, or an
        embedded session's (node `embedded-<pid>`, whose in-memory plane died with it). Others' are only listed
        (`deepxctl memory`): a daemon of another plane may adopt them."""
        for orphan in orphan_segments(keep):
            mine = segment_pid(orphan.name, self.node) is not None
            embedded = orphan.node.startswith("embedded-") and orphan.node[len("embedded-"):].isdigit()
            if not mine and not (embedded and not pid_alive(int(orphan.node[len("embedded-"):]))):
                continue
            if unlink_segment(orphan.name):
                log.info("%s: unlinked segment %s (%d bytes held) left by dead process %d%s", self.name, orphan.name,
                         orphan.held, orphan.pid, "" if mine else f" (node {orphan.node})")

    async def _poll(self) -> None:
        """The lifecycle tick: pop up to TICK_BATCH commands from this node's list and from the shared one, and apply
        (or forward) them through the mailbox; then wait until more are pushed (on a store that wakes waiters, as
        Redis and the embedded one do; else every poll_s). Until the actor stops (not only until cancelled: see
        end_task)."""
        try:
            await self._tick_loop()
        finally:
            await self._end_waits()

    async def _tick_loop(self) -> None:
        while self.alive:
            try:
                mine = await self.kv.lpop(self.own_list, TICK_BATCH)
                shared = await self.kv.lpop(LIFECYCLE, TICK_BATCH)
                if mine or shared:
                    if not self.alive:  # stopping: give them back for the next heapmem of this plane
                        if mine:
                            await self.kv.rpush(self.own_list, *mine)
                        if shared:
                            await self.kv.rpush(LIFECYCLE, *shared)
                        return
                    await self.ref.ask(Lifecycle(commands=shared, mine=mine))
                if len(mine) == TICK_BATCH or len(shared) == TICK_BATCH:
                    await asyncio.sleep(0)
                else:  # until a command comes (no tick while idle; on a store that wakes no waiter, every poll_s)
                    await self._wait_push()
            except ActorStopped:
                return
            except Exception as e:
                log.warning("%s: polling %s and %s failed: %s", self.name, LIFECYCLE, self.own_list, e)
                await asyncio.sleep(self.poll_s)  # the store refuses: try again at a poll's pace

    async def _wait_push(self) -> None:
        """Until either lifecycle list may have items (wait_push of both; the first to return ends the wait). The
        other list's wait is kept for the next tick, not cancelled (a cancelled BLMOVE drops its connection): it
        began before this tick's pops, so a push since ends it."""
        wait = WAKE_WAIT_S if self.kv.wakes_on_push else self.poll_s
        for key in (LIFECYCLE, self.own_list):
            if key not in self._waits:
                self._waits[key] = asyncio.ensure_future(self.kv.wait_push(key, wait))
        done, _ = await asyncio.wait(self._waits.values(), return_when=asyncio.FIRST_COMPLETED)
        for key, task in list(self._waits.items()):
            if task in done:
                del self._waits[key]
        for task in done:
            task.result()  # a store's refusal: the tick's retry handles it

    async def _end_waits(self) -> None:
        waits, self._waits = list(self._waits.values()), {}
        for task in waits:
            task.cancel()
        await asyncio.gather(*waits, return_exceptions=True)

    async def _checker(self) -> None:
        """Every check_s: have the plane's records of this node's tensors written again where it lost them, forget
        the other nodes' tensors mapped here that went (_check_remote), and release dead nodes' holds here."""
        checks = 0
        while self.alive:
            await asyncio.sleep(self.check_s)
            if not self._tensors and not self._remote:
                continue
            try:
                if self._remote:
                    await self.ref.ask(CheckRemote())
                if self._tensors:  # every record once in WHOLE_CHECK checks, one record in the others
                    checks += 1
                    await self.ref.ask(Republish(whole=checks % WHOLE_CHECK == 0))
                if any(h.startswith(REMOTE_HOLDER) for t in self._tensors.values() for h in t.holders):
                    await self.ref.ask(ReleaseDead())
            except ActorStopped:
                return
            except Exception as e:
                log.warning("%s: checking the storage plane's heap tensor records failed: %s", self.name, e)

    def unlink_all(self) -> None:
        """Unlink every segment now, without the storage plane: the forced-exit path (a second signal)."""
        for seg in self._segments():
            with contextlib.suppress(Exception):
                seg.unlink()

    def _segments(self) -> list[Segment]:
        live = [t.segment for t in self._tensors.values() if t.segment is not None]
        return live + [seg for segs in self._pool.values() for seg in segs]

    # -- handlers
    async def on_create(self, name: str, shape: Sequence[int], dtype: str, owner: str = "",
                        zero: bool = True, replace_lost: bool = False, device: str = "") -> dict[str, Any]:
        """A new heap tensor (refcount 1, held by `owner` if given); its memory is zeroed unless zero=False.
        replace_lost: a lost tensor of that name is replaced (a put), rather than refused. `device`: the asking
        worker's, whose GPU it goes on (the first where it is not a GPU of this node)."""
        w = _Writes(self.kv)
        t = await self._create(w, name, shape, dtype, owner, zero, replace_lost, device)
        try:
            await w.execute()
        except Exception as e:
            self._drop(t, pool=True)
            raise DeepxError(f"heapmem: could not record heap tensor {name!r} in the storage plane: {e}") from e
        return t.info()

    async def on_attach(self, name: str, holder: str) -> dict[str, Any]:
        """One more reference to `name`, held by `holder`."""
        w = _Writes(self.kv)
        t = self._attach(w, name, holder)
        await w.execute()
        return t.info()

    async def on_release(self, name: str, holder: str) -> int:
        """Drop `holder`'s reference; at refcount 0 the tensor is freed. Returns the refcount left."""
        w = _Writes(self.kv)
        left = self._release(w, name, holder)
        await w.execute()
        return left

    async def on_delete(self, name: str, force: bool = False) -> None:
        """Free `name` now; refused while others hold it, unless force."""
        w = _Writes(self.kv)
        self._delete(w, name, force)
        await w.execute()

    async def on_array(self, name: str, device: str = "") -> Any:
        """The tensor's memory as an array, in place (zero-copy): writes are seen by every process. A GPU tensor's
        is a device array, refused to a worker on another GPU (`device`: its kernels would fault on it)."""
        t = self._live(name, "view")
        if t.block is not None and device.startswith("cuda") and device != t.device:
            raise DeepxError(f"heapmem: heap tensor {name!r} lives on {t.device}, and the session asking for it runs "
                             f"on {device}, whose kernels cannot read another GPU's memory (a session's heap "
                             "tensors live on its own GPU; docs/distributed.md, \"Several GPUs in one daemon\")")
        if t.view is None and t.block is not None:
            t.view = await self._gpu(t.device).view(t.block, t.shape, t.dtype)
        if t.view is None:
            assert t.segment is not None
            t.view = t.segment.array(t.shape, t.dtype)
        return t.view

    async def on_remote(self, names: Sequence[str]) -> tuple[dict[str, np.ndarray], list[Far]]:
        """Heap tensors of other nodes that a program here names (Peers.reach): the views of those mapped here
        already (their records unchanged), and the records of the others, to be held and mapped, or streamed. A
        name the plane has no other node's heap tensor for is left out (the program's own check says it is not
        found). Reads the plane only: never waits for a peer (a heapmem waiting for another node's, which waits
        for this one's, would stop both)."""
        views: dict[str, np.ndarray] = {}
        far: list[Far] = []
        for name in names:
            if name in self._tensors:
                continue
            f = await self.kv.hgetall(_key(name))
            if name in self._remote:
                seg, held_on, handle = self._remote[name]
                if f.get("handle") == handle and f.get("node") == held_on:
                    views[name] = seg.array(json.loads(f["shape"]), to_numpy(f["dtype"]))
                    continue
                await self._forget_remote(name, release=False)  # another tensor now, or none: that one's hold went
            node = f.get("node")
            if f.get("kind") != "heap" or not node or node == self.node:
                continue
            try:
                t = _Heap.from_fields(name, f)
            except ValueError as e:
                raise DeepxError(f"tensor '{name}' of node {node}: its record in the storage plane is malformed: "
                                 f"{e}") from None
            far.append(Far(name=name, node=node, dtype=t.dtype, shape=t.shape, nbytes=t.nbytes, handle=t.handle,
                           ctime=f.get("ctime", ""), state=t.state, device=t.device, holders=tuple(t.holders)))
        return views, far

    async def on_map(self, far: Far) -> np.ndarray:
        """Map another node's heap tensor on this host, whose owner recorded this node's hold on it (Peers.reach):
        no copy, both nodes read and write the same bytes. Where it is mapped already (a second worker asked at
        once), the view of that mapping, and the extra hold given back."""
        held = self._remote.get(far.name)
        if held is not None and held[1] == far.node and held[2] == far.handle:
            await self._give_back_hold(far.name, far.node)
            return held[0].array(far.shape, to_numpy(far.dtype))
        if held is not None:
            await self._forget_remote(far.name, release=False)
        try:
            seg = Segment.attach(far.handle)
        except (OSError, DeepxError) as e:
            await self._give_back_hold(far.name, far.node)
            raise DeepxError(f"tensor '{far.name}' is a heap tensor of node {far.node}, whose segment {far.handle} "
                             f"could not be mapped: {e}") from None
        self._remote[far.name] = (seg, far.node, far.handle)
        log.info("%s: maps heap tensor '%s' of node %s (%s%s), no copy", self.name, far.name, far.node, far.dtype,
                 list(far.shape))
        return seg.array(far.shape, to_numpy(far.dtype))

    async def _give_back_hold(self, name: str, node: str) -> None:
        """This node's hold on node `node`'s tensor `name`, given back through that node's lifecycle list."""
        try:
            await self.kv.rpush(node_lifecycle(node), msgpack.packb(
                {"cmd": "delete", "name": name, "holder": REMOTE_HOLDER + self.node}))
        except Exception as e:  # a lost plane: the owner keeps a hold that nothing gives back (logged)
            log.warning("%s: could not give back the hold on heap tensor '%s' of node %s: %s", self.name, name, node, e)

    async def _forget_remote(self, name: str, release: bool = True) -> None:
        """Drop the mapping of another node's tensor: this node's workers are told (heap_gone), and, with `release`,
        its hold on the tensor is given back (not where the owner dropped it already, or the tensor went)."""
        seg, node, _ = self._remote.pop(name)
        for viewer in self.viewers:
            with contextlib.suppress(ActorStopped):
                viewer.tell(HeapGone(name=name))
        seg.close()
        if release:
            await self._give_back_hold(name, node)

    def on_mapped(self, name: str) -> str | None:
        """The node whose heap tensor `name` is mapped here (on_remote), else None."""
        entry = self._remote.get(name)
        return entry[1] if entry is not None else None

    async def on_unmap(self, name: str) -> bool:
        """Let go of another node's tensor mapped here (before that node deletes it): whether it was."""
        if name not in self._remote:
            return False
        await self._forget_remote(name)
        return True

    async def on_forget_remote(self, names: Sequence[str]) -> int:
        """Let go of the mappings of other nodes' tensors among `names` (a process group's, which its members
        leave); how many there were."""
        mapped = [name for name in names if name in self._remote]
        for name in mapped:
            await self._forget_remote(name)
        return len(mapped)

    async def on_check_remote(self) -> None:
        await self._check_remote()

    async def _check_remote(self) -> None:
        """The other nodes' tensors mapped here: one whose record changed or went, whose owner no longer counts this
        node's hold (it took this node for dead), or whose node died, is forgotten (its views here go)."""
        for name, (_, node, handle) in list(self._remote.items()):
            f = await self.kv.hgetall(_key(name))
            same = f.get("node") == node and f.get("handle") == handle
            held = same and REMOTE_HOLDER + self.node in f.get("holders", "").split(",")
            dead = await self.peers.why_dead(node) if held else None
            if not held or dead is not None:
                log.info("%s: heap tensor '%s' of node %s is %s: its mapping here goes", self.name, name, node,
                         "gone" if not same else "no longer held by this node" if not held else f"unreachable "
                         f"(node {node} {dead})")
                # a dead owner applies the release when it starts again and adopts the tensor
                await self._forget_remote(name, release=held)

    async def on_hold(self, name: str, holder: str, handle: str, ctime: str) -> dict[str, Any]:
        """Another node of this host is about to map heap tensor `name` (its segment `handle`, made at `ctime`): one
        more reference, held by `holder` (`node:<id>`), recorded now, before it maps. The segment is never pooled
        after that (see _drop)."""
        t = self._live(name, "hold")
        if t.block is not None or t.handle != handle or repr(t.ctime) != ctime:
            raise DeepxError(f"heapmem: heap tensor {name!r} of node {self.node} is another one than the one asked "
                             "for (made again, or moved): look it up again")
        return await self.on_attach(name, holder)

    def on_read(self, name: str, handle: str, ctime: str, offset: int, length: int) -> memoryview:
        """Bytes [offset, offset + length) of heap tensor `name` (its segment `handle`, made at `ctime`), in place:
        a chunk for a node of another host (Peers.serve_read)."""
        t = self._live(name, "read")
        if t.segment is None or t.handle != handle or repr(t.ctime) != ctime:
            raise DeepxError(f"heapmem: heap tensor {name!r} of node {self.node} changed while it was read (freed, "
                             "made again, or it is in GPU memory): read it again")
        if offset + length > t.nbytes:
            raise DeepxError(f"heapmem: heap tensor {name!r} holds {t.nbytes} bytes; bytes {offset} to "
                             f"{offset + length} were asked for")
        if t.view is None:
            t.view = t.segment.array(t.shape, t.dtype)
        flat: np.ndarray = t.view.reshape(-1).view(np.uint8)
        return flat[offset:offset + length].data

    async def on_release_dead(self) -> int:
        """Release the holds that dead nodes took on this node's tensors (a node killed with -9 never gives back
        its own): each `node:<id>` holder whose node is dead, as Peers says with its record in the plane. A tensor
        freed so goes as any other (its segment unlinked, never pooled: see _drop). Returns how many."""
        nodes = {h[len(REMOTE_HOLDER):] for t in self._tensors.values() for h in t.holders
                 if h.startswith(REMOTE_HOLDER)}
        dead: dict[str, str] = {}
        for node in nodes:
            why = await self.peers.dead_for_sure(node)
            if why is not None:
                dead[node] = why
        if not dead:
            return 0
        w = _Writes(self.kv)
        released = 0
        for t in list(self._tensors.values()):
            for holder in [h for h in t.holders if h.startswith(REMOTE_HOLDER) and h[len(REMOTE_HOLDER):] in dead]:
                node = holder[len(REMOTE_HOLDER):]
                left = self._release(w, t.name, holder)
                released += 1
                log.warning("%s: released node %s's hold on heap tensor '%s' (node %s %s)%s", self.name, node, t.name,
                            node, dead[node], "; it is freed" if left == 0 else "")
                if left == 0:
                    break
        await w.execute()
        return released

    def on_info(self, name: str, missing_ok: bool = False) -> dict[str, Any] | None:
        """The record of heap tensor `name`; None where there is none and `missing_ok` (a lookup that expects a miss
        often, which must not count as an error in the actor's statistics: `deepxctl actors ls` ERRORS)."""
        if missing_ok and (not isinstance(name, str) or name not in self._tensors):
            return None
        return self._find(name, "describe").info()

    def on_list(self) -> list[dict[str, Any]]:
        return [self._tensors[n].info() for n in sorted(self._tensors)]

    def on_stats(self) -> dict[str, Any]:
        live = [t for t in self._tensors.values() if t.present]
        return {"node": self.node, "device": self.device.device if self.device is not None else "cpu",
                "tensors": len(live), "bytes": sum(t.nbytes for t in live),
                "segments": sum(t.segment is not None for t in live),
                "segment_bytes": sum(t.segment.size for t in live if t.segment),
                "lost": sum(t.state == "lost" for t in self._tensors.values()),
                "pooled_segments": sum(len(s) for s in self._pool.values()), "pooled_bytes": self._pooled_bytes,
                "pool_limit": self.pool_bytes}

    async def on_lifecycle(self, commands: Sequence[bytes] = (), mine: Sequence[bytes] = ()) -> int:
        """Apply msgpack commands: `mine` from this node's list (applied here), then `commands` from the shared
        `tensor_lifecycle` (applied here, or forwarded to the node that holds the tensor); a malformed or refused one
        is logged and skipped. Returns how many were applied or forwarded."""
        w = _Writes(self.kv)
        handled = 0
        nodes: dict[str, str | None] = {}  # node id -> its state in the plane, looked up once per tick
        for source, raws in ((self.own_list, mine), (LIFECYCLE, commands)):
            for raw in raws:
                try:
                    cmd = self._parse(raw)
                    if source == LIFECYCLE:
                        target = await self._route(w, cmd)
                    else:
                        self._mine(cmd)
                        target = None
                    if target is None:
                        await self._apply(w, cmd)
                    else:
                        await self._forward(w, cmd, raw, target, nodes)
                    handled += 1
                except DeepxError as e:
                    log.warning("%s: skipped a %s command: %s", self.name, source, e)
        try:
            await w.execute()
        except Exception as e:
            log.warning("%s: could not write the metadata of %d lifecycle commands: %s", self.name, handled, e)
        return handled

    async def on_republish(self, whole: bool = True) -> int:
        """Write again, whole, the records of this node's tensors that the plane lost (a Redis that restarted
        empty, a FLUSHDB, a key deleted by hand). Not `whole`: the check's own key stands for all (a plane that
        lost its keys lost it too; no change to a tensor writes it again, as one writes that tensor's record), and
        the records are read only where it is gone. Returns how many were written."""
        if not whole and not self._verify_next and not await self.kv.missing([self._checked]):
            return 0
        await self.kv.set(self._checked, b"1")  # before the reads: a loss after them takes it, for the next check
        self._checked_written = True
        # this node's records only (not a scan of every node's: the check's cost stays this node's tensors)
        gone = {key[len("tensor:"):] for key in await self.kv.missing([_key(name) for name in self._tensors])}
        # whose record a name holds is read (one request each) only where the plane lost some of ours, in this check
        # or the last: only then can another node have made a name of ours meanwhile
        lost = bool(gone)
        verify, self._verify_next = lost or self._verify_next, lost
        w = _Writes(self.kv)
        for name, t in self._tensors.items():
            if name in gone:
                w.hset(name, t.fields())
                self._conflicts.discard(name)
                continue
            if not verify or name in self._conflicts or t.state != "live":
                continue
            node = await self.kv.hget(_key(name), "node")
            if node != self.node:  # made by another node while the plane had lost ours: warned once, left alone
                self._conflicts.add(name)
                log.error("%s: heap tensor %r of node %s is recorded in the storage plane as node %s's (made there "
                          "while the plane had lost this node's record); this node's copy is left out of the plane "
                          "until one of them is deleted", self.name, name, self.node, node)
        if w.count:
            await w.execute()
            log.warning("%s: the storage plane had lost the records of %d heap tensors of node %s; wrote them "
                        "again", self.name, w.count, self.node)
        return w.count

    async def on_relabel(self, names: Sequence[str]) -> int:
        """A client labelled these tensors (deepxd/owners.py): the records of those that are heap tensors here are
        written again with what the node now knows of them. Returns how many."""
        if self.owners is None:
            return 0
        w = _Writes(self.kv)
        for name in names:
            t = self._tensors.get(name)
            if t is not None:
                labels = {**t.labels, **self.owners.fields(name)}
                if labels != t.labels:
                    t.labels = labels
                    w.hset(name, t.fields())
        await w.execute()
        return w.count

    def on_adopted(self) -> list[dict[str, Any]]:
        """The heap tensors adopted at start from a daemon of this node that died, still held: the op worker
        views them again (CpuWorker.on_start)."""
        return [self._tensors[n].info() for n in sorted(self._adopted)
                if n in self._tensors and self._tensors[n].present]

    # -- the work
    def _gpu(self, device: Any) -> Any:
        """The DeviceHeap of GPU `device` (cuda:N) where op-cuda runs a worker on it, else the first GPU's."""
        return (self.devices.get(device) or self.device) if isinstance(device, str) else self.device

    async def _create(self, w: _Writes, name: Any, shape: Any, dtype: Any, owner: Any, zero: bool,
                      replace_lost: bool = False, device: str = "") -> _Heap:
        if not isinstance(name, str) or not name:
            raise DeepxError(f"heapmem: a heap tensor needs a non-empty string name, not {name!r}")
        what = f"heapmem: cannot create heap tensor {name!r}"
        known = self._tensors.get(name)
        if known is not None and known.present:
            raise DeepxError(f"{what}: it already exists ({known.dtype} {list(known.shape)}, held by "
                             f"{known.who()}); delete it or pick another name")
        if known is not None and not replace_lost:
            raise DeepxError(f"{what}: a lost tensor of that name (its memory went when its daemon stopped) is still "
                             f"recorded, held by {known.who()}; delete it first (deepxctl tensors rm {name} --force, "
                             "or a lifecycle delete with force), or put it again with heap=true, which replaces it")
        if not isinstance(dtype, str):
            raise DeepxError(f"{what}: dtype {dtype!r} is not a precision name")
        try:
            itemsize = to_numpy(dtype).itemsize
        except DeepxError as e:
            raise DeepxError(f"{what}: {e}") from None
        dims = _dims(shape, what)
        owner = _holder(owner, what)
        if known is None and name not in w.freed:  # (a lost tensor's record is this node's own, replaced below)
            other = await self.kv.hgetall(_key(name))
            if other and not other.get("node"):
                raise DeepxError(f"{what}: tensor:{name} already exists in the storage plane, as a partial record "
                                 f"that names no node (fields: {', '.join(sorted(other))}); delete that key or pick "
                                 "another name")
            if other:
                raise DeepxError(f"{what}: tensor:{name} already exists in the storage plane (a "
                                 f"{other.get('kind', '?')} tensor on node {other.get('node', '?')}); "
                                 "delete it there or pick another name")
        nbytes = math.prod(dims) * itemsize
        labels = self.owners.fields(name) if self.owners is not None else {}
        if self.device is not None:
            block = await self._gpu(device).alloc(name, nbytes, zero)
            t = _Heap(name=name, dtype=dtype, shape=dims, nbytes=nbytes, node=self.node, owner=owner,
                      holders=[owner] if owner else [], refcount=1, handle="", ctime=time.time(),
                      device=block.device, ipc_handle=block.ipc_handle.hex(), block=block, labels=labels)
            self._replace_lost(w, known)
            self._tensors[name] = t
            w.hset(name, t.fields())
            return t
        try:
            seg, reused = self._take_segment(nbytes)
        except OutOfSharedMemory as e:
            free = "an unknown number of bytes" if e.free is None else f"{e.free} bytes"
            raise DeepxError(f"{what} ({dtype} {list(dims)}): it needs {nbytes} bytes of shared memory and {free} "
                             f"are free in /dev/shm; free heap tensors (deepxctl memory), make it smaller, or give "
                             f"/dev/shm more room") from None
        if reused and zero:
            if nbytes >= ZERO_IN_THREAD:
                await asyncio.to_thread(seg.zero, nbytes)
            else:
                seg.zero(nbytes)
        t = _Heap(name=name, dtype=dtype, shape=dims, nbytes=nbytes, node=self.node, owner=owner,
                  holders=[owner] if owner else [], refcount=1, handle=seg.name, ctime=time.time(), segment=seg,
                  labels=labels)
        self._replace_lost(w, known)
        self._tensors[name] = t
        w.hset(name, t.fields())
        return t

    def _replace_lost(self, w: _Writes, lost: _Heap | None) -> None:
        """A put of a lost tensor's name: its record is deleted in the batch that writes the new one's (so fields
        of the old one, an ipc_handle, never linger), and its references, to memory that is gone, with it."""
        if lost is None:
            return
        log.info("%s: heap tensor %r replaces the lost one of that name (%s %s, held by %s)", self.name, lost.name,
                 lost.dtype, list(lost.shape), lost.who())
        self._tensors.pop(lost.name, None)
        self._adopted.discard(lost.name)
        w.delete(lost.name)

    def _attach(self, w: _Writes, name: Any, holder: Any) -> _Heap:
        t = self._live(name, "attach to")
        holder = _holder(holder, f"heapmem: cannot attach to heap tensor {name!r}")
        t.refcount += 1
        if holder:
            t.holders.append(holder)
            t.lent = t.lent or holder.startswith(REMOTE_HOLDER)
        w.hset(name, t.fields())  # whole: a record the plane lost comes back complete, never as two fields
        return t

    def _release(self, w: _Writes, name: Any, holder: Any) -> int:
        t = self._find(name, "release")
        holder = _holder(holder, f"heapmem: cannot release heap tensor {name!r}")
        if holder in t.holders:
            t.holders.remove(holder)
        elif holder or t.refcount <= len(t.holders):
            raise DeepxError(f"heapmem: cannot release heap tensor {name!r}: {holder or 'an unnamed holder'} does "
                             f"not hold it (held by {t.who()}); release with the holder that attached it")
        t.refcount -= 1
        if t.refcount <= 0:
            self._free(w, t, pool=True)
            return 0
        w.hset(name, t.fields())
        return t.refcount

    def _delete(self, w: _Writes, name: Any, force: bool) -> None:
        t = self._find(name, "delete")
        if t.refcount > 1 and not force:
            raise DeepxError(f"heapmem: cannot delete heap tensor {name!r}: it has {t.refcount} references (held by "
                             f"{t.who()}); release them first, or delete with force=True")
        # memory others may still be using is unlinked, never pooled, so a new tensor cannot overwrite it
        self._free(w, t, pool=t.refcount <= 1)

    @staticmethod
    def _parse(raw: Any) -> dict[str, Any]:
        """A lifecycle command: a msgpack map with a string `name`."""
        try:
            cmd = msgpack.unpackb(raw, raw=False)
        except Exception as e:
            raise DeepxError(f"{raw[:60]!r} is not msgpack ({e})") from None
        if not isinstance(cmd, dict):
            raise DeepxError(f"{cmd!r} is not a map")
        name = cmd.get("name")
        if not isinstance(name, str) or not name:
            raise DeepxError(f"{cmd!r} has no string 'name'")
        op = cmd.get("cmd")
        if op not in ("create", "get", "delete"):
            raise DeepxError(f"{cmd!r}: unknown cmd {op!r}; use create, get or delete")
        if op == "get" and "holder" not in cmd:
            raise DeepxError(f"{cmd!r}: 'get' needs a 'holder'")
        node = cmd.get("node")
        if node is not None and (not isinstance(node, str) or not node):
            raise DeepxError(f"{cmd!r}: 'node' must be a node id (a non-empty string), not {node!r}")
        return cmd

    def _mine(self, cmd: dict[str, Any]) -> None:
        """A command from this node's own list is applied here; one that names another node was misdirected."""
        node = cmd.get("node")
        if node is not None and node != self.node:
            raise DeepxError(f"{cmd.get('cmd')} of heap tensor {cmd['name']!r} names "
                             f"node {node}, but it was in {self.own_list}; push it to {node_lifecycle(node)} or to "
                             f"{LIFECYCLE}")

    async def _route(self, w: _Writes, cmd: dict[str, Any]) -> str | None:
        """Where a command from the shared list goes: None for this node, else the node to forward it to. A
        `create` goes to the node it names, else stays here; a get or delete goes to the node that holds the tensor
        (here when this node knows it, else as its `tensor:<name>` hash says)."""
        op, name = cmd.get("cmd"), cmd["name"]
        if op == "create":
            node = cmd.get("node")
            return None if node is None or node == self.node else str(node)
        if op not in ("get", "delete") or name in self._tensors or name in w.freed:
            return None  # applied (or refused) here
        f = await self.kv.hgetall(_key(name))
        if not f:
            raise DeepxError(f"{op} of heap tensor {name!r}: no node holds a heap tensor by that name (tensor:{name} "
                             "is not in the storage plane)")
        node = f.get("node")
        if f.get("kind") != "heap" or not node:
            raise DeepxError(f"{op} of heap tensor {name!r}: tensor:{name} in the storage plane is not a heap "
                             f"tensor's record (fields: {', '.join(sorted(f))})")
        return None if node == self.node else node

    async def _forward(self, w: _Writes, cmd: dict[str, Any], raw: bytes, node: str,
                       nodes: dict[str, str | None]) -> None:
        """Push a command, as it came, to node `node`'s own list; warn when that node does not look alive."""
        w.forward(node, raw)
        if node not in nodes:
            nodes[node] = await self.kv.hget(f"node:{node}", "state")
        state = nodes[node]
        what = f"{cmd.get('cmd')} of heap tensor {cmd['name']!r}"
        if state == "running":
            log.debug("%s: forwarded the %s to node %s (%s)", self.name, what, node, node_lifecycle(node))
        else:
            log.warning("%s: forwarded the %s to %s, where it waits until node %s polls it: that node is %s", self.name,
                        what, node_lifecycle(node), node, f"{state}" if state else "not in the storage plane")

    async def _apply(self, w: _Writes, cmd: dict[str, Any]) -> None:
        op, name = cmd.get("cmd"), cmd["name"]
        if op == "create":
            await self._create(w, name, cmd.get("shape"), cmd.get("dtype"), cmd.get("owner", ""),
                               bool(cmd.get("zero", True)))
        elif op == "get":
            self._attach(w, name, cmd["holder"])
        elif cmd.get("holder") is not None:  # delete (_parse checked the cmd)
            self._release(w, name, cmd["holder"])
        else:
            self._delete(w, name, bool(cmd.get("force", False)))

    def _find(self, name: Any, verb: str) -> _Heap:
        t = self._tensors.get(name) if isinstance(name, str) else None
        if t is None:
            raise DeepxError(f"heapmem: cannot {verb} heap tensor {name!r}: node {self.node} has no heap tensor "
                             "by that name")
        return t

    def _live(self, name: Any, verb: str) -> _Heap:
        t = self._find(name, verb)
        if not t.present:
            raise DeepxError(f"heap tensor {name!r} was lost when its daemon stopped; put or load it again (a put "
                             "with heap=true replaces the lost record; deepxctl tensors rm --force deletes it)")
        return t

    # -- segments and the pool
    def _take_segment(self, nbytes: int) -> tuple[Segment, bool]:
        """A segment for `nbytes`, its first `nbytes` reserved (so writing them cannot fault): a pooled one, else a
        fresh one; OutOfSharedMemory when /dev/shm cannot hold them."""
        need = size_class(nbytes)
        for i in range(REUSE_CLASSES):
            segs = self._pool.get(need << i)
            if segs:
                seg = segs.pop()
                self._pooled_bytes -= seg.size
                try:
                    seg.reserve(nbytes)
                except DeepxError:
                    seg.close()
                    seg.unlink()  # its memory goes back to /dev/shm; a fresh segment may fit where this did not
                    break
                return seg, True
        for _ in range(1000):
            try:
                return Segment.create(segment_name(self.node), need, reserve=nbytes), False
            except SegmentExists:
                continue  # a name left by an earlier process with our pid
        raise DeepxError(f"heapmem: could not find a free segment name for node {self.node}")

    def _free(self, w: _Writes, t: _Heap, pool: bool) -> None:
        w.delete(t.name)
        self._drop(t, pool)

    def _drop(self, t: _Heap, pool: bool) -> None:
        self._tensors.pop(t.name, None)
        self._adopted.discard(t.name)
        self._conflicts.discard(t.name)
        viewed = False
        for viewer in self.viewers:
            with contextlib.suppress(ActorStopped):
                viewer.tell(HeapGone(name=t.name))
                viewed = True
        if t.block is not None:
            # told after heap_gone, into the CUDA worker's mailbox: freed after every program queued before it
            self._gpu(t.device).free(t.block)
            t.block, t.view = None, None
            return
        seg, t.segment, t.view = t.segment, None, None
        if seg is None:
            return
        # a worker's view goes only when it reads its mailbox, another node's when it next checks: until then the
        # segment must not hold another tensor, so it is unlinked (the mapping lives on under the view until that is
        # collected), never pooled
        if (pool and not viewed and not t.lent and seg.size == size_class(seg.size)
                and self._pooled_bytes + seg.size <= self.pool_bytes):
            self._pool.setdefault(seg.size, []).append(seg)
            self._pooled_bytes += seg.size
        else:
            seg.close()
            seg.unlink()

