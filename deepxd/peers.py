"""Other nodes of this plane, as one node sees them, and the peer links that reach them.

- A link is a native connection (deepx_core.client.NativeClient) to the address in the peer's `node:<id>` record:
  its Unix socket where it runs on this host (the same `host` and /dev/shm), else its TCP listener, where both sides
  prove the shared token (deepx_core/auth.py: the HMAC challenge each way), over TLS where it listens so.
- Links are opened on demand (docs/decisions/0047-links-on-demand.md): a request to a peer (a tensor of its, a
  segment placed there, a hold, a delete) or a ring neighbour's connection (`open_link`) opens one; a link no
  request used for `idle_s` (peer_idle_s) is closed. An idle plane has no links: each node reads one field of the
  `nodes` index per heartbeat, and its heartbeat in the plane is what the others know of it.
- A peer is dead once it has been silent `timeout_s` (peer_timeout_s, 10 s by default): its heartbeat in the plane
  that old, or, while a link to it is open, nothing over that link (pinged every `heartbeat_s` with `peer_ping`,
  which tells the peer that this node is alive too). Its heap tensors are then unreachable, and the holds it took
  on this node's are released (HeapMemory.on_release_dead).
- A program here that names another node's heap tensor reaches it (`reach`): on this host, the owner records this
  node's hold over the link first, then the segment is mapped (no copy); on another host, its bytes are streamed
  over the link in bounded chunks (deepxd/net/peerlink.py) into a copy that lives for one program.
- Requests are blocking clients run on a small thread pool of this object's: a slow or vanished peer holds a thread
  of its own, never the event loop or another peer's link.
- What placement reads of a peer (deepxd/placement.py): its round trip (the pings'), its bandwidth (the transfers
  of a MiB or more over its link), both kept when the link closes, and `call`, a request that may run as long as the
  peer lives (a segment of a program).
"""

from __future__ import annotations

import asyncio
import collections
import functools
import json
import logging
import os
import secrets
import socket
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from deepx_core.errors import DeepxError
from deepx_core.identity import shm_identity
from deepx_core.ir.dtypes import to_numpy
from deepx_core.paths import tcp_address
from deepxd.actors.messages import Hold, Map, Read, Remote
from deepxd.kv.base import KV, Batch

if TYPE_CHECKING:
    from deepx_core.client import NativeClient
    from deepxd.actors.base import ActorRef
    from deepxd.actors.heapmem import HeapMemory

log = logging.getLogger(__name__)

#: the default of peer_timeout_s: a node silent this long is dead
PEER_TIMEOUT_S = 10.0
#: a holder that is another node (its heap tensors mapped there): `node:<id>`
REMOTE_HOLDER = "node:"
#: the plane's index of nodes, a hash: a field `node:<id>` per node that started on the plane (any id, `version`
#: too), `version`, new whenever a node's record changed what the others read of it (its state, its addresses), and
#: `ops:<id>`, a version and the node's `ops:<id>:*` hashes, new whenever they tell placement something new
#: (index_ops; deepxd/placement.py, DRIFT)
NODES = "nodes"
#: the index is trusted this many heartbeats (5 min at 2 s); then every record is read again, so that a plane edited
#: by hand heals (one that lost its keys has no index: each node reads every record until they are written again)
INDEX_TRUSTED = 150
#: idle connections kept per peer link for requests, reads and pings
IDLE_LINKS = 2
#: the default of peer_idle_s: a link no request used this long is closed
PEER_IDLE_S = 60.0
#: threads that run the blocking requests of all peer links
LINK_THREADS = 8
#: a link's round trip is the least of its last pings this many
RTT_SAMPLES = 16
#: a transfer this large or larger times a link's bandwidth (smaller ones are mostly round trips)
BANDWIDTH_MIN_BYTES = 1 << 20


def unreachable(record: dict[str, str], node: str, dead_after_s: float) -> str | None:
    """Why node `node` (its `node:<id>` record) cannot be reached now by what the plane says, in words that follow
    "node X"; None where it is alive there."""
    if not record:
        return "is not in the storage plane"
    state = record.get("state")
    if state != "running":
        return f"is {state or 'in an unknown state'}"
    try:
        beat = float(record.get("heartbeat") or 0)
    except ValueError:
        beat = 0.0
    age = time.time() - beat
    if age > dead_after_s:
        return f"is dead (its last heartbeat in the storage plane was {age:.1f} s ago)"
    return None


@dataclass(frozen=True)
class Far:
    """Another node's heap tensor, as its `tensor:<name>` record says."""

    name: str
    node: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    handle: str  # its segment's name
    ctime: str  # when it was made (the record's text): with the handle, which tensor this is
    state: str
    device: str
    holders: tuple[str, ...] = ()


@dataclass
class Reached:
    """Other nodes' heap tensors a program here names: `views` mapped from segments of this host (no copy), `copies`
    streamed from other hosts (for one program), `nodes` the node of each copy."""

    views: dict[str, Any] = field(default_factory=dict)
    copies: dict[str, np.ndarray] = field(default_factory=dict)
    nodes: dict[str, str] = field(default_factory=dict)


@dataclass
class _Measured:
    """What placement knows of a peer's link, kept while the peer runs (a link closed when idle opens again)."""

    rtts: collections.deque[float] = field(default_factory=lambda: collections.deque(maxlen=RTT_SAMPLES))
    bytes_per_s: float | None = None  # measured by transfers (an average that leans to the latest)


@dataclass
class _Link:
    """An open link to a peer: its connections and what its pings found."""

    since: float  # when it was opened
    kind: str  # unix, tcp or tls: how it is reached
    address: str
    used: float  # when a request over it last began or ended (time.monotonic)
    heard: float | None = None  # its last answer, or its last ping to this node
    error: str = ""  # why the last ping or connection failed
    task: asyncio.Task[None] | None = None  # its pinger
    idle: list[NativeClient] = field(default_factory=list)  # connections free for a request or a ping
    busy: int = 0  # requests in flight over it
    owned: list[NativeClient] = field(default_factory=list)  # connections given out whole (a ring's), open or not


async def node_ids(kv: KV) -> list[str]:
    """Every node of the plane: from the `nodes` index, or where the plane has none, from a scan of `node:*`."""
    index = await kv.hgetall(NODES)
    if index:
        return sorted(n[len("node:"):] for n in index if n.startswith("node:"))
    return [key.split(":", 1)[1] for key in await kv.keys("node:*")]


def index_node(b: Batch, node: str) -> None:
    """In a batch that writes node `node`'s record: list it in the index, and tell every node to read the records
    again (a version no one saw, not a counter: a plane that restarted empty would count up to an old one)."""
    b.hset(NODES, {f"node:{node}": "1", "version": secrets.token_hex(8)})


def index_ops(b: Batch, node: str, workers: Sequence[str]) -> None:
    """In a batch that writes node `node`'s op statistics (`ops:<node>:<worker>` for each of `workers`) where they
    tell placement something new: a new version of them in the index, so that placement reads them again only then
    (deepxd/placement.py)."""
    b.hset(NODES, {f"ops:{node}": f"{secrets.token_hex(8)} {','.join(sorted(workers))}"})


def indexed_ops(index: dict[str, str], node: str) -> tuple[str, list[str]] | None:
    """The version of node `node`'s op statistics and its workers, as the index says (None where it says nothing)."""
    entry = index.get(f"ops:{node}")
    if entry is None:
        return None
    version, _, workers = entry.partition(" ")
    return version, [w for w in workers.split(",") if w]


class Peers:
    """This node's view of the other nodes and its links to them (see the module's docstring). Without `start()`, no
    pings and no idle links closed: liveness is then what the plane says."""

    def __init__(self, kv: KV, node_id: str, *, host: str = "", token: str = "", tls_cafile: str = "",
                 heartbeat_s: float = 2.0, timeout_s: float = PEER_TIMEOUT_S, idle_s: float = PEER_IDLE_S) -> None:
        self.kv = kv
        self.node_id = node_id
        self.host = host or socket.gethostname()
        self.shm = shm_identity()
        self.token = token
        self.tls_cafile = tls_cafile
        self.heartbeat_s = heartbeat_s
        self.timeout_s = timeout_s
        self.idle_s = idle_s
        # this node's heapmem: what peers' holds and reads are served from
        self.heapmem: ActorRef[HeapMemory] | None = None
        self._links: dict[str, _Link] = {}  # the open links, by node id
        self._measured: dict[str, _Measured] = {}  # round trips and bandwidth, by node id
        self.opened = 0  # links opened since start (a test's and a benchmark's count)
        self._running: dict[str, str] = {}  # the running peers by the records last read, and how each is reached
        self._seen: str | None = None  # the index's version when they were read
        self._trusted = 0  # heartbeats the index is trusted for, before every record is read again
        self._executor: ThreadPoolExecutor | None = None
        self._task: asyncio.Task[None] | None = None
        self._stopped = False

    # -- where a peer is
    def same_host(self, record: dict[str, str]) -> bool:
        """Whether the node of `record` runs on this host: the same `host`, and the same /dev/shm where both say."""
        if record.get("host", self.host) != self.host:
            return False
        other = record.get("shm")
        return not other or not self.shm or other == self.shm

    def address(self, node: str, record: dict[str, str]) -> tuple[str, str]:
        """The address a link to `node` uses, and its kind (unix, tcp, tls); DeepxError where it publishes none."""
        try:
            addresses = json.loads(record.get("addresses") or "{}")
        except json.JSONDecodeError:
            addresses = {}
        if self.same_host(record):
            unix = str(addresses.get("unix") or "")
            if not unix:
                raise DeepxError(f"node {node} publishes no Unix socket address in node:{node}")
            return (unix if unix.startswith("unix://") else f"unix://{unix}"), "unix"
        tcp = str(addresses.get("tcp") or "")
        if not tcp:
            raise DeepxError(f"node {node} runs on host {record.get('host', '?')} and listens on no TCP address, so "
                             "this node cannot reach it: start it with --listen tcp://HOST:PORT and the cluster's "
                             "token (docs/cluster.md)")
        host, port = tcp_address(tcp)
        if host in ("0.0.0.0", "::", ""):  # every interface: reached by its host's name
            name = record.get("host", host)
            tcp = f"tcp://{f'[{name}]' if ':' in name else name}:{port}"
        return tcp, "tls" if record.get("tls") == "1" else "tcp"

    # -- liveness
    async def start(self) -> None:
        """Read which peers run (so that a node started after them knows them at once), then every heartbeat_s:
        read it again where the index changed, ping the open links, close the idle ones; until stop()."""
        if self._task is None:
            try:
                await self._running_peers()
            except Exception as e:  # (the watch tries again at each heartbeat)
                log.warning("peers: could not read the nodes of the storage plane: %s", e)
            self._task = asyncio.get_running_loop().create_task(self._watch(), name="peers:watch")

    async def stop(self) -> None:
        self._stopped = True
        tasks = [t for t in (self._task, *(link.task for link in self._links.values())) if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for link in self._links.values():
            for client in link.idle:
                client.close()
        self._links.clear()
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)

    async def _running_peers(self) -> dict[str, str]:
        """The running peers and how each is reached: the records read again only where the index's version
        changed (a node started, stopped or moved) or has been trusted INDEX_TRUSTED heartbeats; where the plane has
        no index, every `node:*` record, found by a scan."""
        version = await self.kv.hget(NODES, "version")
        self._trusted -= 1
        if version is not None and version == self._seen and self._trusted > 0:
            return self._running
        nodes = await node_ids(self.kv)
        running = {}
        for node in nodes:
            if node == self.node_id:
                continue
            record = await self.kv.hgetall(f"node:{node}")
            if record.get("state") != "running":
                continue
            try:
                _, running[node] = self.address(node, record)
            except DeepxError:
                continue  # no address to reach it at: the plane alone says whether it lives
        self._running, self._seen, self._trusted = running, version, INDEX_TRUSTED
        return running

    async def _watch(self) -> None:
        """Every heartbeat: the links of peers that stopped, and those idle for idle_s, closed."""
        while not self._stopped:
            await asyncio.sleep(self.heartbeat_s)
            try:
                running = await self._running_peers()
                for node in [n for n in self._links if n not in running]:
                    self._drop_link(node, "it stopped")
                for node in [n for n in self._measured if n not in running]:
                    del self._measured[node]
                self._close_idle()
            except Exception as e:  # a lost plane must not end the watch
                log.warning("peers: could not read the nodes of the storage plane: %s", e)

    def _close_idle(self) -> None:
        now = time.monotonic()
        for node, link in list(self._links.items()):
            link.owned = [c for c in link.owned if c.sock.fileno() != -1]
            if not link.busy and not link.owned and now - link.used >= self.idle_s:
                self._drop_link(node, f"idle for {now - link.used:.0f} s")

    def _drop_link(self, node: str, why: str) -> None:
        link = self._links.pop(node)
        log.info("peers: closed the link to node %s (%s)", node, why)
        if link.task is not None:
            link.task.cancel()
        for client in link.idle:
            client.close()
        link.idle.clear()

    def _open(self, node: str, record: dict[str, str]) -> _Link:
        """The link to `node` (its record as read now): the open one, else a new one, pinged from now on."""
        address, kind = self.address(node, record)
        link = self._links.get(node)
        if link is not None and link.address != address:
            self._drop_link(node, f"it moved to {address}")
            link = None
        if link is None:
            link = self._links[node] = _Link(since=time.time(), kind=kind, address=address, used=time.monotonic())
            self.opened += 1
            log.debug("peers: opened a link to node %s at %s", node, address)
            if self._task is not None and not self._stopped:
                link.task = asyncio.get_running_loop().create_task(self._pinger(node, link), name=f"peers:ping:{node}")
        return link

    async def _pinger(self, node: str, link: _Link) -> None:
        """Ping `node` every heartbeat over a connection of the link's (the first a heartbeat after it opened: the
        request that opened it is the first word from the peer)."""
        while not self._stopped:
            await asyncio.sleep(self.heartbeat_s)
            client: NativeClient | None = None
            try:
                client = link.idle.pop() if link.idle else await self._run(self._connect, link.address, link.kind)
                sent = time.perf_counter()
                reply = await self._run(functools.partial(client.request, "peer_ping", node=self.node_id))
                self._measure(node).rtts.append(time.perf_counter() - sent)
                if reply.get("node") != node:
                    raise DeepxError(f"its address is answered by node {reply.get('node')!r}")
                self._answered(node, link)
                self._keep(node, link, client)
            except asyncio.CancelledError:
                if client is not None:
                    client.close()
                raise
            except Exception as e:
                if not link.error:  # (a node just started may not listen yet: said only once it was linked)
                    log.log(logging.WARNING if link.heard else logging.DEBUG,
                            "peers: node %s does not answer over its peer link: %s", node, e)
                link.error = str(e) or type(e).__name__
                if client is not None:
                    client.close()

    def _answered(self, node: str, link: _Link) -> None:
        """`node` answered over `link` (a connection made, a ping answered)."""
        if link.heard is None or link.error:
            log.info("peers: linked to node %s over %s", node, link.address)
        link.heard, link.error = time.time(), ""

    def _measure(self, node: str) -> _Measured:
        m = self._measured.get(node)
        if m is None:
            m = self._measured[node] = _Measured()
        return m

    def linked(self) -> bool:
        """Whether another node runs in the plane, as read at the last heartbeat, or answers over a link (a look at
        two dicts: no cost on one node, or an embedded one)."""
        if self._running:
            return True
        return any(link.heard is not None and not link.error for link in self._links.values())

    def links(self) -> list[str]:
        """The peers a link is open to now."""
        return sorted(self._links)

    def rtt_s(self, node: str) -> float | None:
        """The round trip to `node`: the least of its last pings (None before one answered)."""
        m = self._measured.get(node)
        return min(m.rtts) if m is not None and m.rtts else None

    def bandwidth(self, node: str) -> float | None:
        """Bytes per second over a link to `node`, as its transfers of a MiB or more went (None before one)."""
        m = self._measured.get(node)
        return m.bytes_per_s if m is not None else None

    def note_transfer(self, node: str, nbytes: int, seconds: float) -> None:
        """`nbytes` went over the link to `node` in `seconds` (a request's whole time: its round trip included)."""
        if nbytes < BANDWIDTH_MIN_BYTES or seconds <= 0:
            return
        m = self._measure(node)
        rate = nbytes / seconds
        m.bytes_per_s = rate if m.bytes_per_s is None else 0.5 * m.bytes_per_s + 0.5 * rate

    def heard_from(self, node: str) -> None:
        """A peer pinged this node: it is alive."""
        link = self._links.get(node)
        if link is not None:
            link.heard = time.time()

    async def why_dead(self, node: str, record: dict[str, str] | None = None) -> str | None:
        """Why node `node` cannot be reached now, in words that follow "node X": its record says so, its heartbeat in
        the plane or its open peer link has been silent timeout_s; None where it is alive."""
        if record is None:
            record = await self.kv.hgetall(f"node:{node}")
        why = unreachable(record, node, self.timeout_s)
        if why is not None:
            return why
        link = self._links.get(node)
        if link is not None:
            age = time.time() - (link.heard or link.since)
            if age > self.timeout_s:
                return (f"is dead (nothing over its peer link for {age:.1f} s"
                        f"{f': {link.error}' if link.error else ''})")
        return None

    async def dead_for_sure(self, node: str) -> str | None:
        """why_dead, where its record is in the plane (a plane that lost the records says nothing of who lives)."""
        record = await self.kv.hgetall(f"node:{node}")
        return await self.why_dead(node, record) if record else None

    def link_row(self, node: str) -> dict[str, Any]:
        """What `deepxctl nodes ls` shows of the link to `node`: its kind, or `down` and why; seconds since it was
        last heard; `none` for a running peer with no link open."""
        if node == self.node_id:
            return {"link": "self"}
        link = self._links.get(node)
        if link is None:
            return {"link": "none" if node in self._running else ""}
        age = time.time() - (link.heard or link.since)
        silent = age > self.timeout_s
        return {"link": "down" if link.error or silent else link.kind,
                "link_age_s": round(age, 3) if link.heard else None,
                "link_error": link.error or (f"silent for {age:.1f} s" if silent else "")}

    # -- requests
    async def _run(self, fn: Callable[..., Any], *args: Any) -> Any:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=LINK_THREADS, thread_name_prefix="deepx-peer")
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def _connect(self, address: str, kind: str) -> NativeClient:
        from deepx_core.client import NativeClient

        me = f"deepxd {self.node_id}"
        if kind == "unix":
            return NativeClient(address, timeout=self.timeout_s, client=me, peer_uid=os.geteuid())
        tls = kind == "tls"
        return NativeClient(address, timeout=self.timeout_s, client=me, token=self.token or None, tls=tls,
                            cafile=(self.tls_cafile or None) if tls else None)

    async def _client(self, node: str, record: dict[str, str]) -> tuple[_Link, NativeClient]:
        """A connection for one request to `node`, over its link (opened now where none is): give it back with
        _done (one that failed: _lost)."""
        link = self._open(node, record)
        link.busy += 1
        link.used = time.monotonic()
        if link.idle:
            return link, link.idle.pop()
        try:
            client: NativeClient = await self._run(self._connect, link.address, link.kind)
        except DeepxError as e:
            link.busy -= 1
            link.error = str(e) or type(e).__name__
            raise DeepxError(f"node {node} does not answer over its peer link: {e}") from None
        except BaseException:
            link.busy -= 1
            raise
        self._answered(node, link)  # (it proved itself: the same token, or this host's socket)
        return link, client

    def _keep(self, node: str, link: _Link, client: NativeClient) -> None:
        if self._links.get(node) is link and len(link.idle) < IDLE_LINKS and not self._stopped:
            link.idle.append(client)
        else:
            client.close()

    def _done(self, node: str, link: _Link, client: NativeClient) -> None:
        """A request over `link` was answered: the peer lives, and the connection is kept for the next."""
        link.busy -= 1
        link.used = time.monotonic()
        link.heard = time.time()
        self._keep(node, link, client)

    def _lost(self, link: _Link, client: NativeClient) -> None:
        """A request over `link` failed: its connection is closed (a refusal leaves it usable, a lost one does not:
        a new one is cheap)."""
        link.busy -= 1
        link.used = time.monotonic()
        client.close()

    async def _alive(self, node: str) -> dict[str, str]:
        """`node`'s record; DeepxError naming the node where it is not alive."""
        record = await self.kv.hgetall(f"node:{node}")
        why = await self.why_dead(node, record)
        if why is not None:
            raise DeepxError(f"node {node} {why}")
        return record

    async def ask(self, node: str, op: str, **fields: Any) -> dict[str, Any]:
        """Node `node`'s reply to native request `op`, over a link (DeepxError with its error, or why it cannot be
        reached)."""
        record = await self._alive(node)
        link, client = await self._client(node, record)
        try:
            reply: dict[str, Any] = await self._run(functools.partial(client.request, op, **fields))
        except BaseException:
            self._lost(link, client)
            raise
        self._done(node, link, client)
        return reply

    async def call(self, peer: str, op: str, cancel: Callable[[], bool] | None = None,
                   record: dict[str, str] | None = None, **fields: Any) -> dict[str, Any] | None:
        """Node `peer`'s reply to request `op`, waited for as long as it takes while the node lives (a segment of a
        program may run for minutes): DeepxError naming the node where it cannot be reached, went away (its
        connection closed: at once), or was found dead meanwhile; None where `cancel()` said the asker went away
        first (the connection is closed, and with it the request). `record`: its node record as read within a
        heartbeat (else it is read now)."""
        if record is None:
            record = await self._alive(peer)
        else:
            why = await self.why_dead(peer, record)
            if why is not None:
                raise DeepxError(f"node {peer} {why}")
        link, client = await self._client(peer, record)
        client.sock.settimeout(None)
        fut = asyncio.ensure_future(self._run(functools.partial(client.request, op, **fields)))
        try:
            looked = time.monotonic()
            while True:
                done, _ = await asyncio.wait({fut}, timeout=0.05 if cancel is not None else self.heartbeat_s)
                if done:
                    break
                if cancel is not None and cancel():
                    fut.add_done_callback(_quiet)
                    _shut(client)
                    self._lost(link, client)
                    return None
                if time.monotonic() - looked >= self.heartbeat_s:
                    looked = time.monotonic()
                    why = await self.why_dead(peer)
                    if why is not None:
                        _shut(client)
                        raise DeepxError(f"node {peer} {why}")
            try:
                reply: dict[str, Any] = fut.result()
            except DeepxError as e:  # refused, or the connection ended (the node went away)
                if _closed(client):
                    raise DeepxError(f"node {peer} went away while it ran this ({e})") from None
                raise DeepxError(f"node {peer}: {e}") from None
        except BaseException:
            if not fut.done():
                fut.add_done_callback(_quiet)
            self._lost(link, client)
            raise
        client.sock.settimeout(self.timeout_s)
        self._done(peer, link, client)
        return reply

    async def open_link(self, node: str) -> NativeClient:
        """A connection of its own to node `node`, outside the link's pool (a process group's ring reads over it,
        one request after another, for as long as the group lasts): the link stays open while it is:
        DeepxError naming the node where it cannot be made."""
        record = await self._alive(node)
        link = self._open(node, record)
        link.used = time.monotonic()
        try:
            client: NativeClient = await self._run(self._connect, link.address, link.kind)
        except DeepxError as e:
            link.error = str(e) or type(e).__name__
            raise DeepxError(f"node {node} does not answer over its peer link: {e}") from None
        link.owned.append(client)
        self._answered(node, link)
        return client

    async def read(self, far: Far, record: dict[str, str]) -> np.ndarray:
        """A copy of another node's heap tensor, streamed over a link in chunks (deepxd/net/peerlink.py)."""
        from deepxd.net.peerlink import read_chunks

        out = np.empty(far.shape, to_numpy(far.dtype))
        if out.nbytes != far.nbytes:
            raise DeepxError(f"tensor '{far.name}' of node {far.node}: its record says {far.nbytes} bytes, and "
                             f"{far.dtype}{list(far.shape)} is {out.nbytes}")
        if not out.nbytes:
            return out
        try:
            link, client = await self._client(far.node, record)
        except DeepxError as e:
            raise DeepxError(f"tensor '{far.name}' is a heap tensor of node {far.node}, which cannot be read: {e}") \
                from None
        t0 = time.perf_counter()
        try:
            await self._run(read_chunks, client, far.name, far.handle, far.ctime, out.reshape(-1).view(np.uint8))
        except DeepxError as e:
            self._lost(link, client)
            raise DeepxError(f"tensor '{far.name}' of node {far.node} could not be read over the peer link: {e}") \
                from None
        except BaseException:
            self._lost(link, client)
            raise
        self._done(far.node, link, client)
        self.note_transfer(far.node, far.nbytes, time.perf_counter() - t0)
        log.debug("peers: read tensor '%s' of node %s (%d bytes) in %.3f s", far.name, far.node, far.nbytes,
                  time.perf_counter() - t0)
        return out

    async def reach(self, names: Sequence[str]) -> Reached:
        """Other nodes' heap tensors among `names` (those this node's heapmem finds in the plane; the rest are left
        out), for a program or a fetch here: mapped where their node runs on this host, after it recorded this
        node's hold; streamed where it runs on another. DeepxError naming the tensor and its node where one cannot
        be reached (its node dead, the tensor lost, in GPU memory)."""
        out = Reached()
        if self.heapmem is None:
            return out
        views, far = await self.heapmem.ask(Remote(names=list(dict.fromkeys(names))))
        out.views.update(views)
        for t in far:
            record = await self.kv.hgetall(f"node:{t.node}")
            why = await self.why_dead(t.node, record)
            if why is not None:
                raise DeepxError(f"tensor '{t.name}' is a heap tensor of node {t.node}, which {why}: unreachable")
            if t.state != "live":
                raise DeepxError(f"tensor '{t.name}' is a heap tensor of node {t.node}, {t.state} there: unreachable")
            if t.device != "cpu":
                raise DeepxError(f"tensor '{t.name}' is a heap tensor in GPU memory of node {t.node} ({t.device}): "
                                 "another node cannot use it yet (docs/cluster.md)")
            if self.same_host(record):
                try:  # the hold recorded before the mapping: the owner cannot free the segment under it
                    await self.ask(t.node, "peer_hold", name=t.name, holder=REMOTE_HOLDER + self.node_id,
                                   handle=t.handle, ctime=t.ctime)
                except DeepxError as e:
                    raise DeepxError(f"tensor '{t.name}' is a heap tensor of node {t.node}, which could not record "
                                     f"this node's hold on it: {e}") from None
                out.views[t.name] = await self.heapmem.ask(Map(far=t))
            else:
                out.copies[t.name] = await self.read(t, record)
                out.nodes[t.name] = t.node
        return out

    # -- what peers ask of this node (native requests peer_*)
    def _heapmem(self) -> ActorRef[HeapMemory]:
        if self.heapmem is None:
            raise DeepxError(f"node {self.node_id} runs no heapmem: it has no heap tensors to serve")
        return self.heapmem

    async def serve_ping(self, req: dict[str, Any]) -> dict[str, Any]:
        node = req.get("node")
        if isinstance(node, str) and node:
            self.heard_from(node)
        return {"node": self.node_id}

    async def serve_hold(self, req: dict[str, Any]) -> dict[str, Any]:
        """A peer on this host is about to map a heap tensor: its hold, recorded now (HeapMemory.on_hold)."""
        name, holder, handle, ctime = _strings(req, ("name", "holder", "handle", "ctime"), "peer_hold")
        info = await self._heapmem().ask(Hold(name=name, holder=holder, handle=handle, ctime=ctime))
        return {"tensor": info}

    async def serve_read(self, req: dict[str, Any]) -> dict[str, Any]:
        """A chunk of a heap tensor's bytes, for a peer on another host (deepxd/net/peerlink.py); `data` last."""
        from deepxd.net.peerlink import CHUNK_MAX

        name, handle, ctime = _strings(req, ("name", "handle", "ctime"), "peer_read")
        offset, length = req.get("offset"), req.get("length")
        if type(offset) is not int or type(length) is not int or offset < 0 or not 0 <= length <= CHUNK_MAX:
            raise DeepxError(f"peer_read of '{name}': 'offset' and 'length' must be whole numbers, length at most "
                             f"{CHUNK_MAX}")
        data = await self._heapmem().ask(Read(name=name, handle=handle, ctime=ctime, offset=offset, length=length))
        return {"offset": offset, "data": data}


def _quiet(fut: asyncio.Future[Any]) -> None:
    """A request given up on: its error, when it comes, is read (not logged as lost)."""
    if not fut.cancelled():
        fut.exception()


def _closed(client: NativeClient) -> bool:
    """Whether the peer closed the connection (or it broke)."""
    try:
        return client.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def _shut(client: NativeClient) -> None:
    """End a connection that a thread of the pool waits on (its read returns at once, with an error)."""
    try:
        client.sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    client.close()


def _strings(req: dict[str, Any], keys: Sequence[str], what: str) -> list[str]:
    """The fields `keys` of a peer's request, each a string, else DeepxError naming them."""
    values = [v for v in (req.get(k) for k in keys) if isinstance(v, str)]
    if len(values) != len(keys):
        raise DeepxError(f"{what}: {', '.join(repr(k) for k in keys[:-1])} and {keys[-1]!r} must be strings")
    return values
