"""deepx_sdk.distributed: torch.distributed's collectives for CPU and GPU ranks (docs/distributed.md).

    import deepx_sdk.distributed as dist
    dist.init_process_group(world_size=2, rank=r)   # or WORLD_SIZE and RANK from the environment (torchrun's)
    dist.all_reduce(t, op=dist.ReduceOp.AVG)

The ranks meet through the storage plane of the daemons their sessions are connected to. Where each rank has a
daemon of its own (several deepxd on one Redis, on one host or several), a collective is an instruction of the
catalogue (`allreduce`, `broadcast`, `allgather`, `reducescatter`) recorded into the rank's program like any op: the
daemon runs it over a ring of peer links (deepxd/comm.py), autograd differentiates it, and dx.compile captures and
replays it. Where ranks share a daemon, a collective is a request after the pending program: each rank writes its
contribution into a heap tensor of its own, the ranks meet at a barrier in the plane, and each rank's daemon then
runs the reduction over the others' heap tensors (deepx_core/collectives.py, deepxd/groups.py).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from deepx_core.collectives import (
    IR_OPS,
    ReduceOp,
    buffer_key,
    buffer_name,
    check_reduce,
    copy,
    heap_buffer,
    reduce_into,
)
from deepx_core.errors import DeepxError
from deepx_core.ir.instr import Instr, Param
from deepx_sdk.session import Session, session
from deepx_sdk.tensor import Tensor, _tp

log = logging.getLogger(__name__)

__all__ = ["Backend", "DistBackendError", "DistError", "ProcessGroup", "ReduceOp", "Work", "all_gather",
           "all_gather_into_tensor", "all_reduce", "barrier", "broadcast", "destroy_process_group", "get_backend",
           "get_rank", "get_world_size", "init_process_group", "is_available", "is_initialized", "reduce_scatter",
           "reduce_scatter_tensor"]

#: torch's default for CPU groups (gloo): a collective waits this long for the slowest rank
DEFAULT_TIMEOUT = timedelta(minutes=30)


class DistError(DeepxError):
    """A collective failed (torch.distributed.DistError)."""


class DistBackendError(DistError):
    """A collective failed in the group itself: a rank died, left or did not come in time. The group is then broken:
    destroy_process_group() and init_process_group() again (torch.distributed.DistBackendError)."""


class Backend:
    """The backends: none (or `gloo`, torch's CPU backend's name) picks `nccl` where every rank runs on op-cuda, on
    a GPU of its own, with NCCL on its daemon; else `ring` where every rank has an op worker of its own (a deepxd
    each, or a GPU each of one deepxd); else `heap`. `nccl` (collectives as instructions, through NCCL on the GPUs'
    streams), `ring` (collectives as instructions, over a ring of peer links between the ranks' daemons; GPU ranks
    stage through host memory) and `heap` (collectives as requests, meeting through heap tensors and a barrier in
    the storage plane) ask for one."""

    GLOO = "gloo"
    NCCL = "nccl"
    RING = "ring"
    HEAP = "heap"


class Work:
    """What an `async_op=True` collective returns. A collective as a request runs when called (complete at once);
    one as an instruction is in the rank's program, and wait() sends what is pending and raises its error."""

    def __init__(self, group: ProcessGroup | None = None, what: str = "") -> None:
        self.group, self.what, self.done = group, what, group is None

    def wait(self, timeout: Any = None) -> bool:
        if not self.done:
            self.done = True
            assert self.group is not None
            self.group.run_now(self.what)
        return True

    def is_completed(self) -> bool:
        return self.done

    def is_success(self) -> bool:
        return self.done


class ProcessGroup:
    """The ranks of one formation of a group: who they are (pid, host, node), this rank's count of collectives
    (every rank calls the same collectives in the same order, as in torch), and the buffers it made and read."""

    def __init__(self, s: Session, name: str, rank: int, world_size: int, timeout: float, gen: str,
                 members: dict[int, dict[str, Any]], instructions: bool = False, backend: str = "") -> None:
        self.session, self.name, self.rank, self.world_size = s, name, rank, world_size
        self.timeout, self.gen, self.members = timeout, gen, members
        # collectives as instructions of the rank's programs (its daemon runs them: the ring or NCCL), else as
        # requests; `backend`: which runs them (Backend)
        self.instructions = instructions
        self.backend = backend or (Backend.RING if instructions else Backend.HEAP)
        self.seq = 0
        self.made: dict[str, None] = {}  # this rank's heap buffers (made once each)
        self.making: list[str] = []  # those the collective about to run makes
        self.read: dict[str, None] = {}  # the other ranks' buffers this rank's reductions name
        self.broken: str | None = None

    def size(self) -> int:
        return self.world_size

    def __repr__(self) -> str:
        return f"ProcessGroup({self.name!r}, rank={self.rank}, world_size={self.world_size}, gen={self.gen})"

    # -- the parts of a collective
    def buffer(self, rank: int, key: str) -> str:
        """Rank `rank`'s buffer `key` for the collective about to run (its parity: see buffer_name)."""
        name = buffer_name(self.gen, rank, key, self.seq % 2)
        if rank != self.rank:
            self.read[name] = None
        return name

    def contribute(self, t: Tensor, key: str) -> list[Instr]:
        """The instructions that write `t` into this rank's buffer `key` (made the first time)."""
        mine = self.buffer(self.rank, key)
        out = []
        if mine not in self.made and mine not in self.making:
            self.making.append(mine)
            out.append(heap_buffer(mine, t.dtype, t.shape))
        out.append(copy(t.name, mine, t.dtype))
        return out

    def meet(self, what: str, before: Sequence[Instr], then: Sequence[Instr], written: Sequence[Tensor] = ()
             ) -> None:
        """Run what is pending and `before` (this rank's contribution), meet the other ranks at this collective's
        barrier, then have the daemon run `then` (the reduction), which writes the tensors `written`."""
        making, self.making = self.making, []
        s = self.usable(what)
        for t in written:
            t._check_write(what)
        rec = s.recorder
        if rec.pending:  # sent with what is pending (a training step's forward and backward), in its program
            for instr in before:
                rec.record(instr)
            s.sync()
            before = ()
        else:  # nothing else to send: the daemon runs it as part of the request
            s.sync()  # (raises an earlier program's error, as a sync does)
        self.made.update(dict.fromkeys(making))  # (or about to be, first in the request)
        seq, self.seq = self.seq, self.seq + 1
        try:
            s.transport.group("barrier", {"group": self.name, "gen": self.gen, "rank": self.rank, "seq": seq,
                                          "timeout": self.timeout, "what": f"{what} #{seq}", "before": list(before),
                                          "then": list(then)})
        except DeepxError as e:
            self.broken = str(e)
            raise DistBackendError(str(e)) from None
        finally:
            for t in written:
                s.tape.wrote(t)

    def usable(self, what: str) -> Session:
        if self.broken is not None:
            raise DistBackendError(f"{what}: process group {self.name!r} is broken ({self.broken}); call "
                                   "destroy_process_group() and init_process_group() again")
        s = self.session
        if s.closed or s is not session():
            raise DistError(f"{what}: the session of process group {self.name!r} was closed or replaced "
                            "(dx.connect or dx.disconnect after init_process_group)")
        if s.recorder.capture is not None and not self.instructions:
            raise DistError(f"{what} inside dx.compile: this group's ranks share a deepxd, so its collectives are "
                            "requests to the daemon, not instructions of the program, and a captured step could "
                            "not replay them; give each rank a deepxd of its own (docs/distributed.md)")
        return s

    # -- collectives as instructions
    def record(self, what: str, instrs: Sequence[Instr], written: Sequence[Tensor], async_op: bool = False
               ) -> Work | None:
        """Record a collective's instructions into the pending program (each writes a tensor of `written` in place,
        outside autograd, as torch's collectives do); then, unless async_op or inside dx.compile, send what is
        pending, so that the collective has run when this returns (and its failure raises here)."""
        s = self.usable(what)
        for t in written:
            t._check_write(what)
        rec = s.recorder
        for instr in instrs:
            rec.record(instr)
        for t in written:
            s.tape.wrote(t)
        if async_op:
            return Work(self, what)
        if rec.capture is None:
            self.run_now(what)
        return None

    def run_now(self, what: str) -> None:
        """Send what is pending; a collective's failure there breaks the group (DistBackendError)."""
        try:
            self.session.sync()
        except DeepxError as e:
            if f"process group {self.name!r}" not in str(e):
                raise
            self.broken = str(e)
            raise DistBackendError(str(e)) from None

    def instr(self, op: str, src: Tensor, out: Tensor, *args: Any, bucket: int | None = None) -> Instr:
        """The instruction `op (src, args..., group) -> (out)`."""
        params = tuple(Param.var(a) for a in (*args, self.name))
        meta = (("bucket", str(bucket)),) if bucket is not None else ()
        return Instr(op, (_tp(src), *params), (_tp(out),), meta)

    def leave(self) -> None:
        """Meet the other ranks as they leave (unless the group is broken), then leave: this rank's buffers are
        freed and its daemon lets go of the others' it mapped."""
        s = self.session
        if s.closed:
            return
        if self.instructions and self.broken is None:  # its last collectives may be pending: they run first
            try:
                self.run_now("destroy_process_group")
            except DeepxError as e:
                log.warning("destroy_process_group: %s", e)
        if self.broken is None and self.world_size > 1:
            try:
                s.transport.group("barrier", {"group": self.name, "gen": self.gen, "rank": self.rank,
                                              "seq": self.seq, "leaving": True, "timeout": self.timeout,
                                              "what": "destroy_process_group"})
            except DeepxError as e:
                log.warning("destroy_process_group: %s", e)
        try:
            s.transport.group("leave", {"group": self.name, "gen": self.gen, "rank": self.rank,
                                        "delete": list(self.made), "forget": list(self.read)})
        except DeepxError as e:
            log.warning("destroy_process_group: leaving process group %r: %s", self.name, e)


_group: ProcessGroup | None = None
_lock = threading.Lock()


def is_available() -> bool:
    return True


def is_initialized() -> bool:
    return _group is not None


def _seconds(timeout: Any) -> float:
    if timeout is None:
        return DEFAULT_TIMEOUT.total_seconds()
    if isinstance(timeout, timedelta):
        return timeout.total_seconds()
    return float(timeout)


def _from_env(value: int, var: str) -> int:
    if value is not None and value >= 0:
        return int(value)
    raw = os.environ.get(var)
    if raw is None:
        raise DistError(f"init_process_group: give {var.lower()}= or set {var} in the environment (torchrun sets "
                        "WORLD_SIZE and RANK)")
    try:
        return int(raw)
    except ValueError:
        raise DistError(f"init_process_group: {var}={raw!r} is not a whole number") from None


def init_process_group(backend: str | None = None, init_method: str | None = None, timeout: Any = None,
                       world_size: int = -1, rank: int = -1, store: Any = None, group_name: str = "default",
                       pg_options: Any = None, device_id: Any = None) -> None:
    """Join the default process group as `rank` of `world_size` (-1: RANK and WORLD_SIZE from the environment),
    through the current session's daemon; returns once every rank has joined (or raises after `timeout`, a
    timedelta or seconds: 30 minutes unless given, which also bounds each collective's wait for the slowest rank).
    Rank 0 forms the group: a group formed again after a rank died is formed anew by rank 0 calling this again.
    `backend`: see Backend (None and "gloo" pick)."""
    global _group
    if isinstance(backend, str) and backend in ("cuda:nccl", "cpu:gloo,cuda:nccl"):
        backend = Backend.NCCL if backend == "cuda:nccl" else None
    if backend not in (None, Backend.GLOO, Backend.NCCL, Backend.RING, Backend.HEAP, "cpu:gloo", "cpu"):
        raise DistError(f"init_process_group: backend {backend!r} is not available; deepx has 'nccl' (GPU ranks), "
                        "'ring' and 'heap' (none or 'gloo' picks one: docs/distributed.md)")
    if (init_method not in (None, "env://")) or store is not None:
        raise DistError("init_process_group: ranks meet through their daemons' storage plane; init_method and store "
                        "are not used (connect every rank to one deepxd, or to deepxds sharing one Redis)")
    world_size, rank = _from_env(world_size, "WORLD_SIZE"), _from_env(rank, "RANK")
    limit = _seconds(timeout)
    with _lock:
        if _group is not None:
            raise DistError("init_process_group: the default process group is already initialized; call "
                            "destroy_process_group() first")
        s = session()
        if world_size > 1 and type(s.transport).__name__ == "EmbeddedTransport":
            raise DistError(f"init_process_group: world_size {world_size} needs the ranks' sessions on a running "
                            "deepxd (dx.connect('unix:///...') or DEEPX_ADDRESS), one for all of them or one each "
                            "on one Redis plane; this session's daemon is embedded in the process, with a plane of "
                            "its own (examples/train_ddp.py starts what it needs)")
        if not getattr(s, "device_chosen", False) and type(s.transport).__name__ == "NativeTransport":
            # a deepxd with several GPUs puts each rank of this host on its own (LOCAL_RANK, as torchrun sets it),
            # where the session has made nothing yet
            from deepx_sdk.devices import placed_again

            local = os.environ.get("LOCAL_RANK", "")
            s.transport.place("auto", int(local) if local.isdigit() else rank)
            placed_again(s)
        asked = backend if backend in (Backend.RING, Backend.NCCL) else None
        reply = s.transport.group("join", {"group": group_name, "world_size": world_size, "rank": rank,
                                           "pid": os.getpid(), "host": socket.gethostname(), "timeout": limit,
                                           "backend": asked})
        members = {int(r): dict(m) for r, m in reply["members"].items()}
        ring = bool(reply.get("ring"))
        how = str(reply.get("backend", Backend.RING if ring else ""))
        if backend == Backend.NCCL and how != Backend.NCCL:
            with contextlib.suppress(DeepxError):
                s.transport.group("leave", {"group": group_name, "gen": str(reply["gen"]), "rank": rank})
            raise DistError(f"init_process_group(backend='nccl'): NCCL cannot serve these ranks: "
                            f"{reply.get('nccl_refused') or 'their daemons run no collectives in programs'} (none or "
                            "'ring' runs them over the ring: docs/distributed.md)")
        if backend == Backend.RING and not ring:
            nodes = [str(m.get("node")) for _, m in sorted(members.items())]
            with contextlib.suppress(DeepxError):
                s.transport.group("leave", {"group": group_name, "gen": str(reply["gen"]), "rank": rank})
            raise DistError(f"init_process_group(backend='ring'): ranks share a deepxd (nodes {', '.join(nodes)}); "
                            "the ring needs one deepxd per rank (backend='heap' or none for this layout)")
        instructions = ring and backend != Backend.HEAP
        _group = ProcessGroup(s, group_name, rank, world_size, limit, str(reply["gen"]), members, instructions,
                              (how or Backend.RING) if instructions else Backend.HEAP)
        log.info("process group %r formed: rank %d of %d (gen %s) on %s; collectives %s", group_name, rank,
                 world_size, _group.gen, reply.get("device", "?"),
                 "as instructions, run through NCCL on the GPUs" if _group.backend == Backend.NCCL else
                 "as instructions, run by the daemons over a ring of peer links" if instructions else
                 "as requests, meeting through heap tensors in the storage plane")


def destroy_process_group(group: ProcessGroup | None = None) -> None:
    """Leave the default group: wait until every rank leaves it too (so that none still reads this rank's buffers),
    then free this rank's buffers. A broken group (a rank died) is left at once."""
    global _group
    with _lock:
        g = _group
        if g is None or (group is not None and group is not g):
            return
        _group = None
    g.leave()


def _default(group: ProcessGroup | None, what: str) -> ProcessGroup:
    g = group if group is not None else _group
    if g is None:
        raise DistError(f"{what}: the default process group has not been initialized; call init_process_group() "
                        "first")
    return g


def _begin(group: ProcessGroup | None, what: str) -> ProcessGroup:
    """The group a collective runs on, checked before any of it is built."""
    g = _default(group, what)
    g.making = []
    if g.world_size > 1:
        g.usable(what)
    return g


def get_rank(group: ProcessGroup | None = None) -> int:
    return _default(group, "get_rank").rank


def get_world_size(group: ProcessGroup | None = None) -> int:
    return _default(group, "get_world_size").world_size


def get_backend(group: ProcessGroup | None = None) -> str:
    return _default(group, "get_backend").backend


def _same(what: str, tensors: Sequence[Tensor], like: Tensor) -> None:
    for t in tensors:
        if t.shape != like.shape or t.dtype != like.dtype:
            raise DistError(f"{what}: tensor '{t.name}' is {t.dtype}{list(t.shape)}; every tensor must be "
                            f"{like.dtype}{list(like.shape)}")


def _done(async_op: bool) -> Work | None:
    return Work() if async_op else None


def all_reduce(tensor: Tensor, op: Any = ReduceOp.SUM, group: ProcessGroup | None = None, async_op: bool = False
               ) -> Work | None:
    """Reduce `tensor` over the ranks, in place on every rank."""
    g = _begin(group, "all_reduce")
    return all_reduce_coalesced([tensor], op, g, async_op)


def all_reduce_coalesced(tensors: Sequence[Tensor], op: Any = ReduceOp.SUM, group: ProcessGroup | None = None,
                         async_op: bool = False, bucket: int | None = None) -> Work | None:
    """all_reduce of each of `tensors`, in one go (DistributedDataParallel's gradients): as instructions, one ring
    pass over them all (one bucket: `bucket`, or a mark of their own, tells the daemon so), else at one barrier."""
    g = _begin(group, "all_reduce")
    reduce = ReduceOp.of(op)
    if g.instructions:
        for t in tensors:
            check_reduce(reduce, t.dtype)
        mark = bucket if bucket is not None or len(tensors) < 2 else -1
        instrs = [g.instr("allreduce", t, t, IR_OPS[reduce], bucket=mark) for t in tensors]
        return g.record("all_reduce", instrs, tensors, async_op)
    if g.world_size == 1:
        for t in tensors:
            reduce_into(reduce, [t.name], t.name, t.dtype, 1)  # refuses what it would refuse with more ranks
        return _done(async_op)
    before: list[Instr] = []
    then: list[Instr] = []
    for slot, t in enumerate(tensors):
        key = buffer_key(t.dtype, t.shape, slot)
        before += g.contribute(t, key)
        then += reduce_into(reduce, [g.buffer(r, key) for r in range(g.world_size)], t.name, t.dtype, g.world_size)
    g.meet("all_reduce", before, then, tensors)
    return _done(async_op)


def broadcast(tensor: Tensor, src: int, group: ProcessGroup | None = None, async_op: bool = False) -> Work | None:
    """Every rank's `tensor` takes rank `src`'s values."""
    return broadcast_coalesced([tensor], src, group, async_op)


def broadcast_coalesced(tensors: Sequence[Tensor], src: int, group: ProcessGroup | None = None,
                        async_op: bool = False) -> Work | None:
    """broadcast of each of `tensors` from rank `src`, in one go (DistributedDataParallel's parameters)."""
    g = _begin(group, "broadcast")
    if not 0 <= src < g.world_size:
        raise DistError(f"broadcast: src {src} is not a rank of the group (world_size {g.world_size})")
    if g.instructions:
        mark = -1 if len(tensors) > 1 else None
        return g.record("broadcast", [g.instr("broadcast", t, t, int(src), bucket=mark) for t in tensors], tensors,
                        async_op)
    if g.world_size == 1:
        return None
    before: list[Instr] = []
    then: list[Instr] = []
    for slot, t in enumerate(tensors):
        key = buffer_key(t.dtype, t.shape, slot)
        if g.rank == src:
            before += g.contribute(t, key)
        else:
            then.append(copy(g.buffer(src, key), t.name, t.dtype))
    g.meet("broadcast", before, then, tensors if g.rank != src else ())
    return _done(async_op)


def all_gather(tensor_list: list[Tensor], tensor: Tensor, group: ProcessGroup | None = None, async_op: bool = False
               ) -> Work | None:
    """tensor_list[r] takes rank r's `tensor`, on every rank (tensor_list: world_size tensors of its shape)."""
    g = _begin(group, "all_gather")
    if len(tensor_list) != g.world_size:
        raise DistError(f"all_gather: tensor_list has {len(tensor_list)} tensors; the group has {g.world_size} ranks")
    _same("all_gather", tensor_list, tensor)
    if g.instructions:  # gathered along a new first dim, then one tensor each
        s = g.usable("all_gather")
        joined = _gathered(g, tensor.reshape(1, *tensor.shape))
        for r, t in enumerate(tensor_list):
            t._check_write("all_gather")
            s.recorder.record(Instr("copytensor", (_tp(joined[r]),), (_tp(t),)))
            s.tape.wrote(t)
        return g.record("all_gather", [], [], async_op)
    key = buffer_key(tensor.dtype, tensor.shape)
    own = [copy(tensor.name, tensor_list[g.rank].name, tensor.dtype)] if tensor_list[g.rank] is not tensor else []
    if g.world_size == 1:
        for instr in own:
            g.usable("all_gather").recorder.record(instr)
        return _done(async_op)
    then = [copy(g.buffer(r, key), t.name, t.dtype) for r, t in enumerate(tensor_list) if r != g.rank]
    g.meet("all_gather", g.contribute(tensor, key) + own, then, tensor_list)
    return _done(async_op)


def all_gather_into_tensor(output_tensor: Tensor, input_tensor: Tensor, group: ProcessGroup | None = None,
                           async_op: bool = False) -> Work | None:
    """output_tensor (world_size times input_tensor's first dim) takes the ranks' input_tensor, in rank order."""
    g = _begin(group, "all_gather_into_tensor")
    t = input_tensor
    want = ((t.shape[0] if t.shape else 1) * g.world_size, *t.shape[1:])
    if output_tensor.shape != want or output_tensor.dtype != t.dtype:
        raise DistError(f"all_gather_into_tensor: output_tensor is {output_tensor.dtype}{list(output_tensor.shape)};"
                        f" it must be {t.dtype}{list(want)}")
    if not t.shape:
        raise DistError("all_gather_into_tensor: input_tensor is 0-d; give it a dimension (t.reshape(1))")
    if g.instructions:
        return g.record("all_gather_into_tensor", [g.instr("allgather", t, output_tensor, g.world_size)],
                        [output_tensor], async_op)
    if g.world_size == 1:
        g.usable("all_gather_into_tensor").recorder.record(copy(t.name, output_tensor.name, t.dtype))
        return _done(async_op)
    key = buffer_key(t.dtype, t.shape)
    before = g.contribute(t, key)
    names = [t.name if r == g.rank else g.buffer(r, key) for r in range(g.world_size)]
    out = Param.tensor(output_tensor.name, t.dtype)
    join = Instr("concat", (Param.listtensor(names, t.dtype), Param.var(0)), (out,))
    g.meet("all_gather_into_tensor", before, [join], [output_tensor])
    return _done(async_op)


def reduce_scatter(output: Tensor, input_list: list[Tensor], op: Any = ReduceOp.SUM,
                   group: ProcessGroup | None = None, async_op: bool = False) -> Work | None:
    """`output` on rank r takes the reduction over the ranks of their input_list[r]."""
    g = _begin(group, "reduce_scatter")
    reduce = ReduceOp.of(op)
    if len(input_list) != g.world_size:
        raise DistError(f"reduce_scatter: input_list has {len(input_list)} tensors; the group has {g.world_size} "
                        "ranks")
    _same("reduce_scatter", input_list, output)
    if g.instructions:
        check_reduce(reduce, output.dtype)
        s = g.usable("reduce_scatter")
        from deepx_sdk.tensor import stack

        joined = stack(list(input_list)) if output.shape else stack([t.reshape(1) for t in input_list])
        one = _scattered(g, joined, reduce)
        output._check_write("reduce_scatter")
        s.recorder.record(Instr("copytensor", (_tp(one.reshape(output.shape)),), (_tp(output),)))
        s.tape.wrote(output)
        return g.record("reduce_scatter", [], [], async_op)
    if g.world_size == 1:
        for instr in reduce_into(reduce, [input_list[0].name], output.name, output.dtype, 1):
            g.usable("reduce_scatter").recorder.record(instr)
        return _done(async_op)
    before: list[Instr] = []
    for slot, t in enumerate(input_list):
        if slot != g.rank:  # the others read slot r of rank r's list; this rank reads its own where it is
            before += g.contribute(t, buffer_key(t.dtype, t.shape, slot))
    key = buffer_key(output.dtype, output.shape, g.rank)
    sources = [input_list[g.rank].name if r == g.rank else g.buffer(r, key) for r in range(g.world_size)]
    g.meet("reduce_scatter", before, reduce_into(reduce, sources, output.name, output.dtype, g.world_size), [output])
    return _done(async_op)


def reduce_scatter_tensor(output: Tensor, input: Tensor, op: Any = ReduceOp.SUM, group: ProcessGroup | None = None,
                          async_op: bool = False) -> Work | None:
    """`output` on rank r takes block r (along dim 0, of world_size) of the ranks' `input` reduced (torch's)."""
    g = _begin(group, "reduce_scatter_tensor")
    reduce = ReduceOp.of(op)
    check_reduce(reduce, input.dtype)
    want = ((input.shape[0] if input.shape else 1) // g.world_size, *input.shape[1:])
    if not input.shape or input.shape[0] % g.world_size or output.shape != want or output.dtype != input.dtype:
        raise DistError(f"reduce_scatter_tensor: input is {input.dtype}{list(input.shape)}: its first dim must "
                        f"split into {g.world_size} blocks, and output ({output.dtype}{list(output.shape)}) be one")
    if g.instructions:
        return g.record("reduce_scatter_tensor",
                        [g.instr("reducescatter", input, output, g.world_size, IR_OPS[reduce])], [output], async_op)
    return reduce_scatter(output, [input[r * want[0]:(r + 1) * want[0]] for r in range(g.world_size)], reduce, g,
                          async_op)


def _gathered(g: ProcessGroup, t: Tensor) -> Tensor:
    """A new tensor: the ranks' `t` joined along dim 0 (the allgather instruction)."""
    from deepx_sdk.tensor import _emit

    s = g.usable("all_gather")
    return _emit(s, "allgather", (_tp(t), Param.var(g.world_size), Param.var(g.name)),
                 (t.shape[0] * g.world_size, *t.shape[1:]), t.dtype, 3)


def _scattered(g: ProcessGroup, t: Tensor, reduce: ReduceOp) -> Tensor:
    """A new tensor: this rank's block of the ranks' `t` reduced (the reducescatter instruction)."""
    from deepx_sdk.tensor import _emit

    s = g.usable("reduce_scatter")
    return _emit(s, "reducescatter", (_tp(t), Param.var(g.world_size), Param.var(IR_OPS[reduce]),
                                      Param.var(g.name)), (t.shape[0] // g.world_size, *t.shape[1:]), t.dtype, 3)


def barrier(group: ProcessGroup | None = None, async_op: bool = False, device_ids: Any = None) -> Work | None:
    """Return once every rank of the group has called barrier (after its pending program ran)."""
    g = _begin(group, "barrier")
    if g.world_size > 1:
        g.meet("barrier", [], [])
    return _done(async_op)


def _at_exit() -> None:
    """A script that ends without destroy_process_group() leaves its group, as torch asks the script to: the others
    read its buffers until they leave too. (Registered after the session's exit hook, so it runs before it.)"""
    with contextlib.suppress(Exception):
        destroy_process_group()


_register = getattr(threading, "_register_atexit", None)
if _register is not None:
    _register(_at_exit)
else:  # pragma: no cover
    import atexit

    atexit.register(_at_exit)
