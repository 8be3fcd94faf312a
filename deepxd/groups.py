"""Process groups as a node serves them to every client, native or embedded: the ranks of a collective
(deepx_sdk.distributed) meet through the storage plane of the daemons they are connected to (one deepxd, or several
on one Redis), with three requests: join a group, meet at a barrier (and then run a program), leave it.

The plane holds one hash per group, `group:<name>`:

| field | holds |
| --- | --- |
| `gen` | the formation's id: rank 0 writes a fresh one each time it forms the group |
| `world_size` | how many ranks |
| `m<rank>` | the member, JSON: gen, token (fresh each join), pid, host, start (its process's start), node, worker, |
| | backend (the one asked for); on op-cuda: device, gpu (PCI bus id), nccl (whether NCCL loads there) |
| `nccl` | `<gen>:<ncclUniqueId, hex>`, made by rank 0's daemon once the formation is whole and runs on NCCL |
| | (comm_gpu.py); `<gen>:!<why>` where it could not make one |
| `a<rank>` | the formation this member saw whole: gen and its members' tokens, hashed |
| `b<rank>` | the last barrier it reached, `<gen>:<seq>`; `<gen>:<seq>:leave`: it leaves after `seq` collectives |

A rank waits by reading the hash again: at once where another rank of this node wrote it (a local wake-up), else
every few hundred microseconds (a plane shared with other daemons: Redis). While it waits it looks, every
`LIVENESS_S`, whether the ranks that have not arrived still run (their process, on this host; their node's
heartbeat): a rank that died fails the others at once, naming it, and the group's timeout bounds the rest.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import secrets
import socket
import time
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgpack

from deepx_core.collectives import buffer_rank
from deepx_core.errors import DeepxError
from deepx_core.ir.instr import Instr
from deepx_core.ir.text import is_name
from deepxd.actors.heapmem import node_lifecycle
from deepxd.actors.messages import ForgetRemote, Run
from deepxd.actors.worker import RunResult
from deepxd.peers import Peers

if TYPE_CHECKING:
    from deepxd.node import Node

LIVENESS_S = 0.1  # how often a waiting rank looks whether the ranks it waits for still run
POLL_MIN_S, POLL_MAX_S = 0.0002, 0.002  # re-reading a plane other daemons write (Redis): first wait, longest

# node -> group -> the events of the ranks waiting on it there (set when a rank of this node writes the group)
_waiting: weakref.WeakKeyDictionary[Any, dict[str, set[asyncio.Event]]] = weakref.WeakKeyDictionary()


def _key(group: str) -> str:
    return f"group:{group}"


def check_group_name(group: Any) -> str:
    if not isinstance(group, str) or not is_name(group) or ":" in group:
        raise DeepxError(f"process group: the name must be a non-empty string without whitespace, ':', ',', brackets "
                         f"or parentheses, got {group!r}")
    return group


def _whole(value: Any, what: str, low: int = 0) -> int:
    if type(value) is not int or value < low:
        raise DeepxError(f"process group: '{what}' must be a whole number >= {low}, got {value!r}")
    return value


def _seconds(value: Any) -> float:
    if not isinstance(value, int | float) or isinstance(value, bool) or not value > 0:
        raise DeepxError(f"process group: 'timeout' must be a number of seconds > 0, got {value!r}")
    return float(value)


def process_start(pid: int) -> str:
    """The start time of process `pid` on this host (clock ticks after boot, /proc/<pid>/stat field 22), which tells
    a process from a later one given the same pid; "" where there is no /proc."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return stat.rpartition(")")[2].split()[19]


def process_gone(member: dict[str, Any]) -> str | None:
    """How member's process ended ("exited"), where this host can tell; None while it runs or on another host."""
    if member.get("host") != socket.gethostname():
        return None
    pid = int(member.get("pid") or 0)
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return "exited"
    except OSError:  # no /proc: signal 0 says whether the pid exists
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return "exited"
        except PermissionError:
            pass
        return None
    fields = stat.rpartition(")")[2].split()
    if fields[0] in ("Z", "X"):  # a zombie: dead, its parent has not reaped it yet
        return "exited"
    if member.get("start") and fields[19] != member["start"]:
        return "exited (its pid is another process's now)"
    return None


class _Waiter:
    """One rank's wait on a group's hash: reads it again when woken by a rank of this node or after the poll."""

    def __init__(self, node: Node, group: str) -> None:
        self.node, self.group = node, group
        self.event = asyncio.Event()
        self.shared = not node.config.kv.startswith("memory")  # other daemons write it too: poll
        self.poll = POLL_MIN_S

    def __enter__(self) -> _Waiter:
        _waiting.setdefault(self.node, {}).setdefault(self.group, set()).add(self.event)
        return self

    def __exit__(self, *exc: Any) -> None:
        groups = _waiting.get(self.node, {})
        events = groups.get(self.group, set())
        events.discard(self.event)
        if not events:
            groups.pop(self.group, None)

    async def wait(self, deadline: float) -> None:
        timeout = max(0.0, min(self.poll if self.shared else LIVENESS_S, deadline - time.monotonic()))
        self.poll = min(self.poll * 2, POLL_MAX_S)
        try:
            await asyncio.wait_for(self.event.wait(), timeout)
            self.poll = POLL_MIN_S
        except TimeoutError:
            pass
        self.event.clear()


def _wake(node: Node, group: str) -> None:
    for event in _waiting.get(node, {}).get(group, ()):
        event.set()


def member(record: dict[str, str], rank: int) -> dict[str, Any] | None:
    raw = record.get(f"m{rank}")
    if not raw:
        return None
    try:
        m = json.loads(raw)
    except json.JSONDecodeError:
        return None
    return m if isinstance(m, dict) else None


def who(rank: int, m: dict[str, Any] | None) -> str:
    if not m:
        return f"rank {rank}"
    return f"rank {rank} (pid {m.get('pid')} on node {m.get('node')})"


def _same_process(m: dict[str, Any], pid: int, host: str, start: str) -> bool:
    return int(m.get("pid") or 0) == pid and m.get("host") == host and m.get("start", "") == start


async def dead_ranks(node: Node, record: dict[str, str], ranks: Sequence[int]) -> list[str]:
    """Those of `ranks` whose process ended, or whose node is dead, in words naming them."""
    assert node.kv is not None
    out: list[str] = []
    for rank in ranks:
        m = member(record, rank)
        if m is None:
            continue
        gone = process_gone(m)
        if gone is None and m.get("node") and m["node"] != node.config.node_id:
            peers = node.peers or Peers(node.kv, node.config.node_id, timeout_s=node.config.peer_timeout_s)
            why = await peers.why_dead(m["node"])
            gone = f"lost its deepxd: node {m['node']} {why}" if why else None
        if gone is not None:
            out.append(f"{who(rank, m)} {gone}")
    return out


async def join(node: Node, group: Any, world_size: Any, rank: Any, pid: Any, host: Any, timeout: Any,
               backend: Any = None) -> dict[str, Any]:
    """Join group `group` as `rank` of `world_size`; answers once every rank has joined this formation: `gen`,
    `members` (rank -> {pid, host, node}), `backend` ("nccl" or "ring": its collectives run in programs, this
    node's deepxd/comm.py running them; "": requests meeting in the plane, where ranks share an op worker), `ring`
    (backend not "") and `nccl_refused` (why NCCL cannot serve these ranks; "" where it can). `backend` asked:
    "ring" keeps GPU ranks off NCCL (rank 0's choice holds for the group). Rank 0 forms it afresh (a new gen); the
    others join the formation rank 0 made, and again when it makes another (a group formed again after a rank
    died)."""
    group = check_group_name(group)
    world_size = _whole(world_size, "world_size", 1)
    rank = _whole(rank, "rank")
    pid = _whole(pid, "pid", 1)
    if backend not in (None, "", "ring", "nccl"):
        raise DeepxError(f"process group: 'backend' must be 'ring', 'nccl' or none, got {backend!r}")
    deadline = time.monotonic() + _seconds(timeout)
    if rank >= world_size:
        raise DeepxError(f"process group {group!r}: rank {rank} is out of range for world_size {world_size}")
    if not isinstance(host, str) or not host:
        raise DeepxError(f"process group: 'host' must be a host name, got {host!r}")
    kv, key = node.kv, _key(group)
    assert kv is not None
    start = process_start(pid) if host == socket.gethostname() else ""
    token = secrets.token_hex(8)
    # worker: the holder of the heap tensors this rank's programs make (see leave), and where its collectives run
    worker = node.worker().name
    me = {"token": token, "pid": pid, "host": host, "start": start, "node": node.config.node_id,
          "worker": worker, **node.gpus.get(worker, {}), "backend": backend or ""}
    if rank == 0:
        record = await kv.hgetall(key)
        m0 = member(record, 0)
        if m0 is not None and not _same_process(m0, pid, host, start) and process_gone(m0) is None \
                and host == m0.get("host"):
            raise DeepxError(f"process group {group!r} is in use: its rank 0 is pid {m0.get('pid')} on node "
                             f"{m0.get('node')}, which still runs; choose another group_name, or end that job")
        gen = secrets.token_hex(4)
        formation: dict[str, Any] = {"gen": gen, "world_size": world_size, "m0": json.dumps({**me, "gen": gen})}
        async with kv.batch() as b:
            b.delete(key)
            b.hset(key, formation)
        _wake(node, group)
    with _Waiter(node, group) as waiter:
        while True:
            waiting_id = False  # the formation is whole, and waits for rank 0's NCCL id
            record = await kv.hgetall(key)
            gen = record.get("gen", "")
            if gen and record.get("world_size") != str(world_size):
                raise DeepxError(f"process group {group!r}: rank 0 formed it with world_size "
                                 f"{record.get('world_size')}, and this rank asks for {world_size}")
            leader = member(record, 0)
            if gen and leader is not None and process_gone(leader) is None:
                mine = member(record, rank)
                if mine is None or mine.get("gen") != gen or mine.get("token") != token:
                    if (rank and mine is not None and mine.get("gen") == gen
                            and not _same_process(mine, pid, host, start) and process_gone(mine) is None):
                        raise DeepxError(f"process group {group!r}: rank {rank} is taken by pid {mine.get('pid')} "
                                         f"on node {mine.get('node')}, which still runs; each rank joins once")
                    await kv.hset(key, {f"m{rank}": json.dumps({**me, "gen": gen})})
                    _wake(node, group)
                    continue
                members = [member(record, r) for r in range(world_size)]
                if all(m is not None and m.get("gen") == gen for m in members):
                    whole = hashlib.sha1((gen + "".join(str(m["token"]) for m in members if m)).encode()
                                         ).hexdigest()[:16]
                    if record.get(f"a{rank}") != whole:
                        await kv.hset(key, {f"a{rank}": whole})
                        _wake(node, group)
                        continue
                    whole_members = [m for m in members if m]
                    seen_whole = all(record.get(f"a{r}") == whole for r in range(world_size))
                    waiting_id = seen_whole and not await _nccl_id_known(node, key, group, gen, rank, record,
                                                                         whole_members)
                    if seen_whole and not waiting_id:
                        comm = node.comm
                        nccl_id = _nccl_id(record, gen)
                        how = (comm.formed(group, gen, rank, whole_members, _seconds(timeout), nccl_id)
                               if comm is not None else "")
                        from deepxd.comm import why_not_nccl

                        refused = why_not_nccl(whole_members) or ("rank 0 asked for the ring" if str(
                            whole_members[0].get("backend")) == "ring" else "")
                        return {"gen": gen, "ring": bool(how), "backend": how, "nccl_refused": refused,
                                "device": me.get("device", "cpu"),
                                "members": {str(r): {k: m.get(k) for k in ("pid", "host", "node", "device")}
                                            for r, m in enumerate(members) if m}}
            if time.monotonic() >= deadline:
                if not gen or leader is None:
                    raise DeepxError(f"process group {group!r}: rank 0 did not form it within {timeout} s")
                if waiting_id:
                    raise DeepxError(f"process group {group!r}: rank 0's daemon (node {leader.get('node')}) did not "
                                     f"give it NCCL's unique id within {timeout} s")
                missing = [r for r in range(world_size) if (member(record, r) or {}).get("gen") != gen] or [
                    r for r in range(world_size) if record.get(f"a{r}") is None]  # joined, and went again
                raise DeepxError(f"process group {group!r}: ranks {', '.join(map(str, missing))} of {world_size} did "
                                 f"not join within {timeout} s")
            await waiter.wait(deadline)


def _nccl_id(record: dict[str, str], gen: str) -> bytes | None:
    """Formation `gen`'s ncclUniqueId from its record (`nccl`: `<gen>:<hex>`), None where it has none."""
    g, _, value = record.get("nccl", "").partition(":")
    return bytes.fromhex(value) if g == gen and value and not value.startswith("!") else None


async def _nccl_id_known(node: Node, key: str, group: str, gen: str, rank: int, record: dict[str, str],
                         members: list[dict[str, Any]]) -> bool:
    """Whether the whole formation `gen` has what its ranks need to answer: NCCL's unique id where its collectives
    run on NCCL. Rank 0's daemon makes the id only now (making one starts NCCL's bootstrap root in that daemon, a
    thread that waits for the ranks' communicators without end: made for a group that runs over the ring, or
    whose rank 0 is on op-cuda while another rank is not, it would wait there for ever) and writes it with its gen;
    the others wait for it. DeepxError where rank 0 could not make it."""
    from deepxd.comm import backend_of

    if backend_of(members) != "nccl":
        return True
    g, _, value = record.get("nccl", "").partition(":")
    if g == gen and value.startswith("!"):
        raise DeepxError(f"process group {group!r}: rank 0's daemon could not make NCCL's unique id: {value[1:]}")
    if g == gen:
        return True
    if rank != 0:
        return False
    from deepxd.kernels.cuda.nccl import unique_id

    try:
        made = f"{gen}:{(await asyncio.to_thread(unique_id)).hex()}"
    except DeepxError as e:
        made = f"{gen}:!{e}"
    assert node.kv is not None
    await node.kv.hset(key, {"nccl": made})
    _wake(node, group)
    record["nccl"] = made
    return await _nccl_id_known(node, key, group, gen, rank, record, members)


def _reached(value: str | None, gen: str) -> tuple[int, bool] | None:
    """The barrier a member reached (`b<rank>`: `<gen>:<seq>`, or `<gen>:<seq>:leave` where it is leaving after
    `seq` collectives) and whether it is leaving; None where it reached none of this formation."""
    if not value:
        return None
    g, _, rest = value.partition(":")
    if g != gen:
        return None
    seq, _, leaving = rest.partition(":")
    return int(seq), leaving == "leave"


async def barrier(node: Node, group: Any, gen: Any, rank: Any, seq: Any, timeout: Any, what: Any = "barrier",
                  then: Sequence[Instr] | None = None, leaving: Any = False, before: Sequence[Instr] | None = None
                  ) -> dict[str, Any]:
    """Run `before` here (a collective's contribution: saves the rank a round trip), reach barrier `seq` of the
    formation `gen` and wait until every rank has reached it; then run `then` here (its reduction, reading the others'
    heap tensors). `leaving`: this rank leaves after `seq` collectives, and waits until every rank leaves. Fails,
    naming the rank, where one died, left, or did not come in time."""
    group = check_group_name(group)
    rank, seq = _whole(rank, "rank"), _whole(seq, "seq")
    limit = _seconds(timeout)
    if not isinstance(gen, str) or not isinstance(what, str) or not isinstance(leaving, bool):
        raise DeepxError("process group: 'gen' and 'what' must be strings, 'leaving' true or false")
    kv, key = node.kv, _key(group)
    assert kv is not None
    deadline = time.monotonic() + limit
    said = f"{what} on process group {group!r}"
    if before:
        ran: RunResult = await node.ref("scheduler").ask(Run(program=list(before), fetch=[]))
        if ran.error:  # this rank's own program: it does not arrive, and the others learn why from its next step
            raise DeepxError(f"{said}: this rank's contribution failed: {ran.error}")
    await kv.hset(key, {f"b{rank}": f"{gen}:{seq}{':leave' if leaving else ''}"})
    _wake(node, group)
    next_look = time.monotonic() + LIVENESS_S
    with _Waiter(node, group) as waiter:
        while True:
            record = await kv.hgetall(key)
            if record.get("gen") != gen:
                if leaving:
                    break  # formed again, or every other rank left and the last removed it: nothing to wait for
                raise DeepxError(f"{said}: the group was formed again or destroyed meanwhile (rank 0 called "
                                 "init_process_group or destroy_process_group)")
            world = int(record.get("world_size") or 0)
            waiting_for: list[int] = []
            left: int | None = None
            for r in range(world):
                at = _reached(record.get(f"b{r}"), gen)
                if leaving:
                    if (at is None or not at[1]) and member(record, r) is not None:
                        waiting_for.append(r)
                elif (at is not None and at[1] and at[0] <= seq) or (member(record, r) is None and r != rank):
                    left = r if left is None else left
                elif at is None or at[0] < seq:
                    waiting_for.append(r)
            if left is not None:
                # a rank that left after a death (its collective failed first) is not the cause: name the dead one
                dead = await dead_ranks(node, record, waiting_for)
                if dead:
                    raise DeepxError(f"{said}: {'; '.join(dead)}, before it reached this {what}")
                raise DeepxError(f"{said}: {who(left, member(record, left))} left the group (destroy_process_group, "
                                 "or its script ended) before it reached this one")
            if not waiting_for:
                break
            now = time.monotonic()
            if now >= next_look:
                next_look = now + LIVENESS_S
                dead = await dead_ranks(node, record, waiting_for)
                if dead:
                    raise DeepxError(f"{said}: {'; '.join(dead)}, before it reached this {what}")
            if now >= deadline:
                ranks = ", ".join(who(r, member(record, r)) for r in waiting_for)
                raise DeepxError(f"{said}: {ranks} did not reach it within {limit:g} s (the group's timeout)")
            await waiter.wait(deadline)
    if not then:
        return {"done": 0}
    result: RunResult = await node.ref("scheduler").ask(Run(program=list(then), fetch=[]))
    if result.error:
        dead = await dead_ranks(node, await kv.hgetall(key), [r for r in range(int(record.get("world_size") or 0))
                                                         if r != rank])
        cause = f" ({'; '.join(dead)})" if dead else ""
        raise DeepxError(f"{said}: the reduction failed{cause}: {result.error}")
    return {"done": result.done}


async def leave(node: Node, group: Any, gen: Any, rank: Any, delete: Any = (), forget: Any = ()) -> dict[str, Any]:
    """Leave the formation `gen`, once no rank reads another's buffers any more (the ranks met as they leave, or the
    group broke): this member's fields go from the plane (the hash with the last live member). This node lets go of
    `forget`, the other members' buffers it mapped, and of `delete`, this member's; the first member to leave after
    one died lets go of that one's among `forget` for it (so that they do not outlive it on its node). Each buffer is
    freed once the last node that mapped it let go: all of this goes through the owners' lifecycle lists, behind the
    holds the mappings took there, so that a buffer is never freed before a hold on it arrives."""
    group = check_group_name(group)
    rank = _whole(rank, "rank")
    if not isinstance(gen, str):
        raise DeepxError("process group: 'gen' must be a string")
    for field, value in (("delete", delete), ("forget", forget)):
        if not isinstance(value, list | tuple) or not all(isinstance(n, str) for n in value):
            raise DeepxError(f"process group: '{field}' must be a list of tensor names")
    kv, key = node.kv, _key(group)
    assert kv is not None
    if node.comm is not None:
        node.comm.left(group, gen, rank)
    record = await kv.hgetall(key)
    releases: dict[tuple[str, str], list[str]] = {}  # (node, holder) -> names
    if delete:
        releases[node.config.node_id, node.worker().name] = list(delete)
    if record.get("gen") == gen:
        await kv.hdel(key, f"m{rank}", f"a{rank}")  # b<rank> stays (leaving), for the ranks still leaving
        members = {r: m for r in range(int(record.get("world_size") or 0)) if r != rank
                   and (m := member(record, r)) is not None}
        dead = {r: m for r, m in members.items() if process_gone(m) is not None}
        for r, m in dead.items():
            if await kv.set_if_absent(f"{key}:{gen}:released:{r}", b"1"):
                names = [n for n in forget if buffer_rank(n, gen) == r]
                releases.setdefault((str(m.get("node")), str(m.get("worker"))), []).extend(names)
        if len(dead) == len(members):  # the last live member: the group's record goes, unless formed again since
            released = [f"{key}:{gen}:released:{r}" for r in range(int(record.get("world_size") or 0))]
            if await kv.hget(key, "gen") == gen:
                await kv.delete(key, *released)
            else:
                await kv.delete(*released)
        _wake(node, group)
    heapmem = node.refs.get("heapmem")
    if forget and heapmem is not None:
        await heapmem.ask(ForgetRemote(names=list(forget)))
    for (owner, holder), names in releases.items():
        if names:
            await kv.rpush(node_lifecycle(owner),
                           *(msgpack.packb({"cmd": "delete", "name": n, "holder": holder}) for n in names))
    return {}
