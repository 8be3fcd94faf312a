"""Collectives of GPU ranks: a bucket of a program's collective instructions on op-cuda's tensors (deepxd/comm.py's
`start` hands them here when the executor is op-cuda's).

- **NCCL** (the formation's backend `nccl`: deepxd/comm.py, `backend_of`): this rank's communicator is made at the
  formation's first collective, on the op-cuda worker's thread (its GPU's context current), from rank 0's
  ncclUniqueId, which the join carried through the group's record in the plane (deepxd/groups.py). The bucket's
  collectives are enqueued on the worker's stream with the tensors' device pointers (one ncclGroupStart/End for a
  bucket of several), then an event is recorded after them. The kernel, at the collective's place, polls the event
  and ncclCommGetAsyncError, and every LIVENESS_S looks whether the other ranks still run: a rank that died, left or
  did not come within the group's timeout fails the collective naming it, after ncclCommAbort (NCCL's kernels would
  wait for it on the device forever). The communicator lives as long as the formation: destroyed when the rank
  leaves (destroy_process_group), the group is formed again, or the daemon stops (`close_communicator`).
- **Staged** (the backend `ring`: ranks that share a GPU, a group mixing GPU and CPU ranks, `backend="ring"`; and a
  reduction of a dtype NCCL has none for, int16): the inputs are copied to the host, the ring runs on the copies
  (comm.py's `start_host`), and the results are copied back to the device at the collective's place.

Work.via says which ran (op-cuda's op stats show it: `allreduce (nccl)`, `allreduce (ring, via host)`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from deepx_core.errors import DeepxError
from deepx_core.ir.ops import Bound
from deepxd.kernels.cpu import CpuExecutor

if TYPE_CHECKING:
    from deepxd.comm import Collectives, Formation

log = logging.getLogger(__name__)

NCCL_VIA = "nccl"
STAGED_VIA = "ring, via host"


class Staged:
    """A bucket run over the ring on host copies; wait() waits for the ring, then writes the results to the device
    (on the CUDA thread: the kernel's place)."""

    via = STAGED_VIA

    def __init__(self, ex: Any, host: CpuExecutor, bounds: Sequence[Bound], inner: Any) -> None:
        self.ex, self.host, self.bounds, self.inner = ex, host, bounds, inner
        self.done = False

    def wait(self) -> None:
        if self.done:
            return
        self.inner.wait()
        self.done = True
        for b in self.bounds:
            name, meta = str(b.out_names[0]), b.outs[0]
            assert meta is not None
            out = _output(self.ex, name, meta)
            self.ex.write(out, self.host.tensors[name])

    def settle(self) -> None:
        settle = getattr(self.inner, "settle", None)
        if settle is not None:
            settle()


class Enqueued:
    """A bucket enqueued through NCCL on the worker's stream; wait() polls its event until the device has run it,
    and the communicator's state (ncclCommGetAsyncError) all the while: NCCL reports a failure there (a peer's
    connection lost, ncclRemoteError) and leaves it to the caller to abort, its kernels waiting meanwhile, so the
    event alone would wait for the group's timeout where the peer's process still runs. Where the group failed,
    the communicator is aborted and DeepxError names the rank."""

    via = NCCL_VIA

    def __init__(self, comm: Collectives, f: Formation, seq: int, event: Any, said: str, c: Any, op: str) -> None:
        self.comm, self.f, self.seq, self.event, self.said = comm, f, seq, event, said
        self.c, self.op = c, op
        self.done = False

    def _arrived(self) -> bool:
        return self.c.ready(f"nccl {self.op}") and bool(self.event.query())

    def wait(self) -> None:
        if self.done:
            return
        self.done = True
        try:
            _guarded(self.comm, self.f, f"collective #{self.seq}", self._arrived)
        except DeepxError as e:
            raise DeepxError(f"{self.said}: {e}") from None

    def settle(self) -> None:
        try:
            self.wait()
        except DeepxError as e:
            log.debug("a collective of a program that stopped before it: %s", e)


class Failed:
    """A bucket that could not start: its error, at its first collective's place."""

    via = ""

    def __init__(self, error: str) -> None:
        self.error = error

    def wait(self) -> None:
        raise DeepxError(self.error)

    def settle(self) -> None:
        pass


def _output(ex: Any, name: str, meta: Any) -> Any:
    """The device tensor a collective writes: the existing one where it has the result's shape and dtype (written in
    place), else a new one, put in the table."""
    t = ex.tensors.get(name)
    if t is None or ex.tensors.metas.get(name) != meta:
        t = ex.empty(meta.shape, meta.dtype, "collective", name)
        ex.tensors[name] = t
    return t


def _nccl_ready(b: Bound) -> bool:
    """Whether NCCL can run this collective: a reduction needs an NCCL type for its dtype (broadcast and all-gather
    move bytes)."""
    from deepxd.kernels.cuda.nccl import DTYPES

    meta = b.outs[0]
    return b.op.name in ("broadcast", "allgather") or (meta is not None and meta.dtype in DTYPES)


def start_on_gpu(comm: Collectives, ex: Any, f: Formation, bounds: Sequence[Bound]) -> Any:
    """Begin a bucket of collectives on op-cuda executor `ex`'s tensors (on its thread); see the module's doc."""
    if f.backend == "nccl" and all(_nccl_ready(b) for b in bounds):
        return _start_nccl(comm, ex, f, bounds)
    return _start_staged(comm, ex, f, bounds)


def _start_staged(comm: Collectives, ex: Any, f: Formation, bounds: Sequence[Bound]) -> Staged:
    host = CpuExecutor()
    for b in bounds:
        src = str(b.names[0])
        if src not in host.tensors:
            host.tensors[src] = ex.to_host(ex.tensors[src])  # (waits for the kernels that make it)
    return Staged(ex, host, bounds, comm.start_host(host, f, bounds))


def _start_nccl(comm: Collectives, ex: Any, f: Formation, bounds: Sequence[Bound]) -> Enqueued:
    op = bounds[0].op.name
    f.seq += 1
    seq = f.seq
    said = f"{op}: collective #{seq} of process group {f.name!r}"
    if f.broken is not None:
        raise DeepxError(f"{said}: the group is broken ({f.broken}); call destroy_process_group() and "
                         "init_process_group() again")
    try:
        c = _communicator(comm, ex, f)
    except DeepxError as e:
        raise DeepxError(f"{said}: {e}") from None
    stream = int(ex.stream.handle)
    group = len(bounds) > 1
    try:
        if group:
            c.group_start()
        try:
            for b in bounds:
                a = ex.tensors[str(b.names[0])]
                meta = b.outs[0]
                assert meta is not None
                o = _output(ex, str(b.out_names[0]), meta)
                if op == "allreduce":
                    c.all_reduce(a.ptr, o.ptr, a.size, meta.dtype, str(b.args[1]), stream)
                elif op == "broadcast":
                    c.broadcast(a.ptr, o.ptr, a.nbytes, int(b.args[1]), stream)
                elif op == "allgather":
                    c.all_gather(a.ptr, o.ptr, a.nbytes, stream)
                else:  # reducescatter
                    c.reduce_scatter(a.ptr, o.ptr, o.size, meta.dtype, str(b.args[2]), stream)
        finally:
            if group:
                c.group_end()
        _guarded(comm, f, f"collective #{seq}", lambda: c.ready(f"nccl {op}"))
    except Exception as e:  # (whatever stopped it, a group half enqueued must not stay: the others would wait)
        cause = str(e) if isinstance(e, DeepxError) else f"{type(e).__name__}: {e}"
        _fail(f, cause)
        raise DeepxError(f"{said}: {cause}") from None
    event = ex.cuda.Event()
    event.record(ex.stream)
    comm.runs += 1
    return Enqueued(comm, f, seq, event, said, c, op)


def _communicator(comm: Collectives, ex: Any, f: Formation) -> Any:
    """This rank's NCCL communicator of formation `f`, made now where it is not yet (every rank makes it at the
    group's first collective: the init waits for all of them, as a collective does)."""
    if f.nccl is not None:
        return f.nccl
    from deepxd.kernels.cuda import nccl

    if f.nccl_id is None:
        raise DeepxError("the group's record carries no NCCL id from rank 0 (its daemon could not make one); form "
                         "the group again")
    # known before the communicator is: a formation dropped from the event loop meanwhile ends it on this thread
    f.nccl_close = getattr(ex, "defer", None)
    c = nccl.Communicator(f.world, f.nccl_id, f.rank)
    f.nccl = c
    owned = getattr(ex, "communicators", None)
    if owned is not None:  # the executor's close() ends those still open (the daemon stops)
        for k in [k for k, old in owned.items() if old.closed]:
            del owned[k]
        owned[id(c)] = c
    _guarded(comm, f, "its NCCL communicator (made at the group's first collective)",
             lambda: c.ready("ncclCommInitRankConfig"))
    log.info("process group %r: rank %d of %d: NCCL %s communicator ready on %s", f.name, f.rank, f.world,
             nccl.version(), getattr(ex, "device_name", "the GPU"))
    return c


def _guarded(comm: Collectives, f: Formation, what: str, done: Any) -> None:
    """comm.wait_until, aborting the communicator where it fails (a dead rank's peers would wait on the device),
    whatever the failure: a look at the plane that raised (Redis gone) leaves NCCL's kernels waiting all the same."""
    try:
        comm.wait_until(f, done, what)
    except DeepxError as e:
        _fail(f, str(e))
        raise
    except Exception as e:
        cause = f"waiting for {what} failed: {type(e).__name__}: {e}"
        _fail(f, cause)
        raise DeepxError(cause) from None


def _fail(f: Formation, cause: str) -> None:
    """The group is broken here: NCCL's communicator aborted now (on this, its thread), later collectives refused."""
    if f.broken is None:
        f.broken = cause
    c, f.nccl = f.nccl, None
    if c is not None:
        c.abort()


def close_communicator(f: Formation, abort: bool) -> None:
    """The formation ended (left, formed again, the daemon stops; called on the event loop): its communicator
    destroyed (aborted where the group broke) on its own thread, after whatever runs there now. The formation keeps
    it until then, so that a collective of it waiting there now (for a rank that is gone) still finds it to abort
    (`_fail`): taken from the loop, the wait would fail without aborting it, its kernels would hold the stream, and
    the worker's next wait for the stream would never end."""

    def end() -> None:
        c, f.nccl = f.nccl, None
        if c is not None:
            (c.abort if abort else c.destroy)()

    run = f.nccl_close
    if run is None:  # (a bare executor's formation: no worker thread to hand it to)
        end()
        return
    run(end)
