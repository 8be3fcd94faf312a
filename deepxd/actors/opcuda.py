"""The CUDA op worker: owns the stack tensors on one GPU and runs checked programs on the CUDA kernels.

- Every CUDA call runs on this worker's one thread: a PyCUDA context belongs to the thread that made it, so the
  executor (`deepxd.kernels.cuda.CudaExecutor`) is created there and used nowhere else. The event loop only checks
  programs (plain dict lookups on the tensors' metas) and hands each whole program to that thread in one hop.
- A program is checked whole before any of it runs, as on op-cpu: a bad program changes nothing.
- An op without a CUDA kernel runs on the CPU kernel (the executor copies its inputs to the host and its outputs
  back); the op stats say so, under the name `<op> (cpu fallback)`, which `deepxctl ops ls` and `deepxctl top` show.
- Out of GPU memory is an error naming the tensors and the bytes asked for; the worker keeps serving.
- Heap tensors live in GPU memory that heapmem allocates through this worker's `DeviceHeap` (on the same thread), with
  a CUDA IPC handle in their `tensor:<name>` record, so another process opens them (`deepxd.ipc`).

A collective instruction (deepxd/comm.py, comm_gpu.py) runs through NCCL on this worker's stream where its process
group's ranks each have a GPU of their own, else over the ring on host copies; its bucket (consecutive collectives
marked alike: DistributedDataParallel's gradients) starts at its first collective's place, and the op stats name
the way it ran: `allreduce (nccl)`, `allreduce (ring, via host)`.

Op stats count host time per instruction (kernel launches are asynchronous): the sum over a program is its real
time because each program ends with its results fetched or the stream synchronised before the reply.

A plan that runs again as prepared is captured as CUDA graphs at its second prepared run (`GraphSlot`, config
`cuda_graphs`) and replayed from then on: one graph launch per segment instead of a launch (and Python) per
instruction. Its optimizer updates' new numbers are written into the graph's slots; a replay whose tensors moved, or
whose other numbers changed, drops the graph and runs the instructions as before; inputs it only reads that moved (a
batch put anew each step) are copied into buffers of the graph's own by the next capture's launches. At most
GRAPHS_MAX graphs live at once (each keeps its program's temporaries), the least recently run given back first, and
all of them when an op-by-op run finds the GPU out of memory. Replays are counted in the op stats under `cudagraph`,
not per op.
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from deepx_core.errors import DeepxError
from deepx_core.ir.dtypes import to_numpy
from deepx_core.ir.effects import heap_made
from deepx_core.ir.instr import Instr
from deepx_core.ir.ops import OPS, Bound, ProgramError
from deepx_core.ir.shapes import numel
from deepxd.actors.base import ActorRef, ActorStopped
from deepxd.actors.messages import ArrayOf, Create, HeapDelete, HeapFree
from deepxd.actors.plan import Prepared
from deepxd.actors.worker import HeapViews, OpStat, OpWorker, Plan, RunResult, deletions
from deepxd.kernels.cpu import dtype_name

if TYPE_CHECKING:
    from deepxd.actors.heapmem import HeapMemory

log = logging.getLogger(__name__)

FALLBACK = " (cpu fallback)"  # op stats of an op that ran on the CPU kernel: "<op> (cpu fallback)"
GRAPH_STAT = "cudagraph"  # op stats of the programs replayed as CUDA graphs
#: prepared runs of a plan before it is captured (a program run twice never is)
GRAPH_AFTER = 1
#: times a plan's graph may be dropped (its tensors moved, numbers the graph holds changed) before it runs without one
GRAPH_MISSES = 3
#: graphs alive at once per worker (each keeps its program's temporaries): the least recently run goes first
GRAPHS_MAX = 16


class GraphSlot:
    """op-cuda's CUDA graph of one prepared plan (`Prepared.graph`): the executor's `graphs.Captured` once captured;
    the prepared runs so far; the updates whose numbers changed since the last replay (`redo`: refreshed on the
    CUDA thread before the next); why the plan runs without a graph (`off`, "" while it may have one); the inputs
    its captures copy into buffers of their own (`stage`: ones found in other memory at a replay); the new names its
    plan took for its inputs since (`renames`: the graph reads them under those before the next replay)."""

    __slots__ = ("captured", "heap", "misses", "off", "redo", "renames", "runs", "stage")

    def __init__(self) -> None:
        self.captured: Any = None
        self.heap: tuple[tuple[str, int], ...] = ()  # the heap tensors the plan touches, and their memory
        self.runs = 0
        self.misses = 0
        self.redo: list[int] = []
        self.off = ""
        self.stage: set[str] = set()
        self.renames: list[dict[str, str]] = []


def _is_oom(e: BaseException) -> bool:
    try:
        import pycuda.driver as drv
    except ImportError:
        return False
    return isinstance(e, drv.MemoryError) or "out of memory" in str(e).lower()


@dataclass(eq=False)
class DeviceBlock:
    """One heap tensor's GPU memory: the allocation, its size, and the CUDA IPC handle other processes open."""

    allocation: Any  # pycuda.driver.DeviceAllocation
    nbytes: int
    ipc_handle: bytes
    device: str


class DeviceHeap:
    """GPU memory for heapmem's heap tensors, allocated and freed on the CUDA worker's thread.

    heapmem calls `alloc` (awaited: it needs the IPC handle), `view` (awaited: building a device array reads the
    context) and `free` (queued on the thread; the thread's order keeps it after every use queued before it)."""

    def __init__(self, worker: CudaWorker) -> None:
        self.worker = worker

    @property
    def device(self) -> str:
        return self.worker.device

    async def alloc(self, name: str, nbytes: int, zero: bool) -> DeviceBlock:
        return await self.worker.call(self.worker.alloc_block, name, nbytes, zero)

    async def view(self, block: DeviceBlock, shape: Sequence[int], dtype: str) -> Any:
        return await self.worker.call(self.worker.block_view, block, tuple(shape), dtype)

    def free(self, block: DeviceBlock) -> None:
        # through the worker's mailbox, after heapmem's `heap_gone` and every program queued before it; with the
        # worker stopped, straight to its thread (which frees nothing once the context is gone)
        try:
            self.worker.ref.tell(HeapFree(block=block))
        except ActorStopped:
            self.worker.submit(self.worker.free_block, block)


class CudaWorker(OpWorker):
    """The op-cuda role. Its asks mirror op-cpu's (run, fetch, put, tensors, metas, variables, op_stats, attach_heap)
    plus `sync` (wait for the GPU) and `kernels` (the ops with a CUDA kernel)."""

    role = "op-cuda"

    def __init__(self, name: str = "op-cuda", *, heapmem: ActorRef[HeapMemory] | None = None,
                 io_roots: Sequence[str] | None = None, device: int = 0, tf32: bool = False,
                 output_log: bool = True, warm: bool = False, graphs: bool = True, comm: Any = None) -> None:
        super().__init__(name)
        self.comm = comm  # process groups: what runs the collective family (deepxd/comm.py)
        self.gpu = ""  # the GPU's PCI bus id (two workers of one host on one GPU share it), once the executor opens
        self._output: list[str] = []
        self.ex: Any = None  # the CudaExecutor, made on the thread by the first call
        self.device_index = device
        self.device = f"cuda:{device}"
        self.tf32 = tf32
        self.warm = warm  # compile the kernel modules not on disk in background threads when the executor opens
        self.graphs = graphs  # replay plans that repeat as CUDA graphs (GraphSlot)
        # the plans with a graph alive, least recently run first (touched on the CUDA thread only)
        self._live: OrderedDict[GraphSlot, None] = OrderedDict()
        self.io_roots = io_roots
        self.heapmem = heapmem
        self.heap = HeapViews()  # heap tensor name -> its device array (memory heapmem allocated)
        self.heap_held: set[str] = set()
        self.output_log = output_log
        self.op_stats: dict[str, OpStat] = {}
        self._unfolded: list[Any] = []  # (prepared plans here run through _execute, which counts as it goes)
        self.device_heap = DeviceHeap(self)
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="deepx-op-cuda")

    # -- the CUDA thread
    def _open(self) -> None:
        from deepxd.kernels.cuda import CudaExecutor

        self.ex = CudaExecutor(io_roots=self.io_roots, output=self._print, device=self.device_index, tf32=self.tf32)
        self.ex.collectives = self.comm
        self.ex.worker_name = self.name
        self.ex.defer = self.submit
        try:
            self.gpu = str(self.ex.device.pci_bus_id())
        except Exception:  # (a driver that cannot say: the ordinal, which tells GPUs of one daemon apart)
            self.gpu = self.device
        log.info("%s: CUDA executor up on %s (%s), kernels compiled by %s", self.name, self.device,
                 self.ex.device.name(), self.ex.modules.compiler.kind)
        if self.warm:
            self.ex.warm()

    def _job(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> Any:
        if self.ex is None:
            self._open()
        return fn(*args)

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run `fn(*args)` on the CUDA thread and wait for it."""
        return await asyncio.get_running_loop().run_in_executor(self._thread, self._job, fn, args)

    async def _ready(self) -> None:
        if self.ex is None:
            await self.call(lambda: None)

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        """Queue `fn(*args)` on the CUDA thread without waiting; failures are logged."""
        def job() -> None:
            try:
                self._job(fn, args)
            except Exception as e:
                log.warning("%s: %s failed: %s", self.name, getattr(fn, "__name__", fn), e)
        try:
            self._thread.submit(job)
        except RuntimeError:  # the thread is shut down: the context, and the memory with it, is gone already
            pass

    async def on_stop(self) -> None:
        def close() -> None:
            self.heap.clear()
            for slot in list(self._live):
                self._release(slot)
            if self.ex is not None:
                self.ex.tensors.clear()
                closer = getattr(self.ex, "close", None)
                if closer is not None:
                    closer()
        try:
            await self.call(close)
        finally:
            self._thread.shutdown(wait=True)

    # -- heap memory for heapmem (on the thread)
    def alloc_block(self, name: str, nbytes: int, zero: bool) -> DeviceBlock:
        import pycuda.driver as drv

        try:
            allocation = drv.mem_alloc(max(nbytes, 1))
        except drv.Error as e:
            if not _is_oom(e):
                raise DeepxError(f"heapmem: cannot allocate heap tensor {name!r} ({nbytes} bytes) on "
                                 f"{self.device}: {e}") from None
            free, total = drv.mem_get_info()
            raise DeepxError(f"heapmem: out of GPU memory: heap tensor {name!r} needs {nbytes} bytes; {self.device} "
                             f"has {free} of {total} bytes free") from None
        if zero and nbytes:
            drv.memset_d8(allocation, 0, nbytes)
        handle = bytes(drv.mem_get_ipc_handle(allocation))
        return DeviceBlock(allocation, nbytes, handle, self.device)

    def block_view(self, block: DeviceBlock, shape: tuple[int, ...], dtype: str) -> Any:
        from deepxd.kernels.cuda import DeviceTensor

        return DeviceTensor(block.allocation, int(block.allocation), shape, dtype)

    def on_heap_free(self, block: DeviceBlock) -> None:
        self.submit(self.free_block, block)

    def free_block(self, block: DeviceBlock) -> None:
        self.ex.synchronize()  # kernels queued before the free may still read it
        block.allocation.free()

    # -- programs
    async def on_run(self, program: Sequence[Instr], fetch: Sequence[str] = (), cancel: Any = None) -> RunResult:
        """As op-cpu's: run `program` once, send back `fetch`; `cancel`: asked before it starts (a program here runs
        on the device whole)."""
        await self._ready()
        if cancel is not None and cancel():
            return self._cancelled(RunResult(t0=time.time()))
        return await self._run_checked(program, fetch, None)

    async def on_run_plan(self, plan: Plan, cancel: Any = None) -> RunResult | None:
        """As op-cpu's: run `plan`, as prepared where it stands here; None, with nothing run, where it does not."""
        await self._ready()
        stands = self._stands(plan)
        if stands is False:
            return None
        if cancel is not None and cancel():
            return self._cancelled(RunResult(t0=time.time()))
        if stands is None:
            return await self._run_checked(plan.sent, plan.fetch, plan)
        prepared = plan.prepared
        assert prepared is not None
        result = self._begin_prepared(prepared)
        await self.call(self._run_on_device, prepared.bounds, result, {}, list(plan.fetch), prepared)
        if prepared.deletes and self.heap:
            await self._forget_deleted(prepared, result.done)
        return self._end_prepared(plan, result)

    async def _run_checked(self, program: Sequence[Instr], fetch: Sequence[str], plan: Plan | None) -> RunResult:
        """Check `program` whole and run it; `plan`: the plan it is the program of, which keeps the check."""
        result = RunResult(t0=time.time())
        begun = self._state()
        self._output = []
        try:
            bounds = self._check_program(program, fetch)
        except ProgramError as e:
            result.error, result.error_index = str(e), e.index
            return result
        heap_new: dict[int, Any] = {}
        failed = None
        if self.heapmem is not None and any(b.instr.meta and heap_made(b) for b in bounds):
            failed = await self._create_heap(bounds, heap_new)
        if failed is None:
            if not heap_new and plan is not None:
                self._prepare(plan, bounds, begun)
            await self.call(self._run_on_device, bounds, result, heap_new, list(fetch))
        else:  # a heap tensor heapmem could not make: the instructions before it run, as if it failed when reached
            await self.call(self._run_on_device, bounds[: failed[1]], result, heap_new, [])
            if not result.error:
                result.error, result.error_index = failed
        await self._give_back(bounds, heap_new, result.done)
        if self.heap:
            for _, name in deletions(bounds[: result.done]):
                await self._forget_heap(name)
        result.output = self._output
        if plan is not None:
            self._ran(plan, result)
        return result

    def _now_ok(self, prepared: Prepared) -> bool:
        """Not a plan with a collective: it waits for the other ranks, which the event loop serves (a ring's reads,
        the liveness looks), so it must not run with the loop waiting on it."""
        return not any(b.op.family == "collective" for b in prepared.bounds)

    def run_prepared(self, plan: Plan) -> RunResult:
        """on_run_plan for a plan that stands (now_run_plan): on the CUDA thread, this thread waiting for it (with
        the loop borrowed: LoopThread.now)."""
        prepared = plan.prepared
        assert prepared is not None
        result = self._begin_prepared(prepared)
        self._thread.submit(self._job, self._run_on_device,
                            (prepared.bounds, result, {}, list(plan.fetch), prepared)).result()
        return self._end_prepared(plan, result)

    async def _create_heap(self, bounds: list[Bound], out: dict[int, Any]) -> tuple[str, int] | None:
        """`newtensor ... // kind=heap`: heapmem allocates it on the GPU before the program runs; it is put in
        place when its instruction is reached. A refusal (out of memory) is the error of that instruction: creating
        stops there, and (message, index) is returned."""
        assert self.heapmem is not None
        for i, b in enumerate(bounds):
            name = heap_made(b) if b.instr.meta else None
            if name is not None:
                meta = b.outs[0]
                if meta is None or self.ex.tensors.metas.get(name) == meta:  # kept (of another meta: replaced)
                    continue
                try:
                    await self.heapmem.ask(Create(name=name, shape=list(meta.shape), dtype=meta.dtype,
                                           owner=self.name, zero=True, device=self.device))
                except DeepxError as e:
                    return f"instruction {i + 1}: newtensor: {e}", i
                self.heap_held.add(name)
                out[i] = await self.heapmem.ask(ArrayOf(name=name, device=self.device))
        return None

    async def _give_back(self, bounds: list[Bound], heap_new: dict[int, Any], done: int) -> None:
        for name in (str(bounds[i].out_names[0]) for i in heap_new if i >= done):
            self.heap.pop(name, None)
            self.heap_held.discard(name)  # never reached: give the memory back
            assert self.heapmem is not None
            await self.heapmem.ask(HeapDelete(name=name, force=True))

    def _run_on_device(self, bounds: list[Bound], result: RunResult, heap_new: dict[int, Any],
                       fetch: list[str], prepared: Prepared | None = None) -> None:
        if prepared is None or not self.graphs or not self._run_graph(prepared, result):
            self._execute(bounds, result, heap_new)
            if "out of GPU memory" in result.error and self._live:
                n = self._release_all()
                result.error += f" (op-cuda gave back the memory of {n} CUDA graphs: running it again may fit)"
        if not result.error:
            result.tensors = {name: self.ex.get(name) for name in fetch}
        heap = self.heap
        if heap and not fetch and any(n in heap for b in bounds[: result.done] for n in b.out_names):
            self.ex.synchronize()  # a heap tensor changed: other processes see it once the reply arrives

    def _execute(self, bounds: list[Bound], result: RunResult, heap_new: dict[int, Any] | None = None) -> None:
        try:
            self._execute_all(bounds, result, heap_new)
        finally:
            if self.ex.launched:
                self.ex.settle_collectives()

    def _launch(self, bounds: list[Bound], i: int) -> None:
        """Start the bucket of collectives beginning at instruction i (consecutive ones marked alike: deepxd/comm.py)
        in one go; each of its instructions then waits for it at its place. A bucket that cannot start fails at its
        first collective."""
        from deepxd.comm import _bucket_key
        from deepxd.comm_gpu import Failed

        key = _bucket_key(bounds[i])
        members = [bounds[i]]
        while key is not None and i + len(members) < len(bounds) and _bucket_key(bounds[i + len(members)]) == key:
            members.append(bounds[i + len(members)])
        try:
            work: Any = self.comm.start(self.ex, members)
        except DeepxError as e:
            work = Failed(str(e))
        except Exception as e:  # (a bug, said at the collective's place rather than taking the worker down)
            log.exception("%s: starting a collective failed", self.name)
            work = Failed(f"{members[0].op.name}: could not start: {type(e).__name__}: {e}")
        for b in members:
            self.ex.launched[id(b)] = work

    def _execute_all(self, bounds: list[Bound], result: RunResult, heap_new: dict[int, Any] | None) -> None:
        ex = self.ex
        times = result.times_us
        stats = self.op_stats
        fallbacks = ex.fallbacks
        start = time.perf_counter()
        for i, b in enumerate(bounds):
            op = b.op.name
            before = fallbacks.get(op, 0)
            t0 = time.perf_counter()
            try:
                if heap_new and i in heap_new:
                    view = heap_new[i]
                    name = str(b.out_names[0])
                    self.heap[name] = view
                    ex.tensors[name] = view
                else:
                    if b.op.family == "collective" and self.comm is not None and id(b) not in ex.launched:
                        self._launch(bounds, i)
                    ex.execute(b)
            except DeepxError as e:
                result.error, result.error_index = f"instruction {i + 1}: {e}", i
                result.failed_at = (t0 - start) * 1e6
                return
            except Exception as e:
                result.error, result.error_index = f"instruction {i + 1}: {self._describe(b, e)}", i
                result.failed_at = (t0 - start) * 1e6
                return
            t1 = time.perf_counter()
            times.append((t0 - start) * 1e6)
            times.append((t1 - start) * 1e6)
            result.done = i + 1
            key = (op if fallbacks.get(op, 0) == before else op + FALLBACK) if b.op.family != "collective" else \
                f"{op} ({ex.via})"
            s = stats.get(key)
            if s is None:
                s = stats[key] = OpStat()
            s.calls += 1
            s.seconds += t1 - t0
            s.bytes += b.nbytes

    # -- CUDA graphs (on the thread)
    def _prepare_again(self, prepared: Prepared, changed: list[int]) -> None:
        """Updates bound again with new numbers (OpWorker._rebind): a captured graph takes them before its next
        replay (GraphSlot.redo)."""
        super()._prepare_again(prepared, changed)
        slot = prepared.graph
        if slot is not None and slot.captured is not None:
            slot.redo.extend(changed)

    def _prepare_renamed(self, prepared: Prepared, changed: list[int], mappings: list[dict[str, str]]) -> None:
        """Instructions bound again under new names (OpWorker._rename): a graph reads its inputs under those before
        its next replay (GraphSlot.renames)."""
        super()._prepare_renamed(prepared, changed, mappings)
        slot = prepared.graph
        if slot is not None:
            slot.renames.extend(mappings)

    @staticmethod
    def _rename_graph(slot: GraphSlot) -> None:
        """A graph's inputs under the names its plan took (on the CUDA thread): what a replay checks (the address
        of each input read, where not staged), copies in (staged inputs) and leaves in the table, by name. An input
        is never written, so its memory is not among the heap tensors the graph writes (`heap`)."""
        captured = slot.captured
        for mapping in slot.renames:
            slot.stage = {mapping.get(n, n) for n in slot.stage}
            slot.heap = tuple((n, ptr) for n, ptr in slot.heap if n not in mapping)
            if captured is not None:
                captured.reads = {mapping.get(n, n): r for n, r in captured.reads.items()}
                captured.staged = {mapping.get(n, n): t for n, t in captured.staged.items()}
                captured.stageable = frozenset(mapping.get(n, n) for n in captured.stageable)
                for seg in captured.segments:  # (an input it deletes: the name a replay takes out of the table)
                    seg.after = {mapping.get(n, n): t for n, t in seg.after.items()}
        slot.renames.clear()

    def _run_graph(self, prepared: Prepared, result: RunResult) -> bool:
        """Run a prepared plan as its CUDA graph: replayed, or captured now at its run after GRAPH_AFTER (the
        capture runs the program too). False, with nothing run, where it runs instruction by instruction."""
        slot = prepared.graph
        if slot is None:
            slot = prepared.graph = GraphSlot()
        if slot.renames:
            self._rename_graph(slot)
        if slot.off:
            return False
        ex = self.ex
        captured = slot.captured
        start = time.perf_counter()
        if captured is None:
            slot.runs += 1
            if slot.runs <= GRAPH_AFTER:
                return False
            why = ex.capturable(prepared.bounds)
            if why is None and any(name in self.heap for _, name in prepared.deletes):
                why = "it deletes a heap tensor (heapmem would free memory the graph writes)"
            if why is not None:
                slot.off = why
                log.debug("%s: a plan runs without a CUDA graph: %s", self.name, why)
                return False
            while len(self._live) >= GRAPHS_MAX:  # room for this one: the least recently run graph goes
                self._release(next(iter(self._live)))
            try:
                captured = ex.capture(prepared.bounds, slot.stage)
            except Exception as e:  # it was captured, and its first launch failed (a kernel's flag, a fault)
                self._miss(slot, "its capture's launch failed")
                return self._graph_failed(result, e, start)
            if captured is None:
                slot.off = "an instruction needs the host mid-program"
                return False
            slot.captured = captured
            heap = self.heap
            # the heap tensors it writes (one it only reads is an input: the replay's own check, and staging where
            # it moves, as a prefetched batch does)
            slot.heap = tuple((n, heap[n].ptr) for n in prepared.names if n in heap and n not in captured.stageable)
            self._live[slot] = None
            weakref.finalize(prepared, self.submit, self._release, slot)
        else:
            heap = self.heap
            for n, ptr in slot.heap:  # a heap tensor made again elsewhere: the graph would write the old memory
                t = heap.get(n)
                if t is None or t.ptr != ptr:
                    return self._drop_graph(slot, f"heap tensor '{n}' is other memory now")
            self._live.move_to_end(slot)
            try:
                if slot.redo:
                    redo = sorted(set(slot.redo))
                    slot.redo.clear()
                    if not all(ex.refresh(captured, i, prepared.bounds[i]) for i in redo):
                        return self._drop_graph(slot, "numbers the graph holds changed")
                if not ex.replay(captured):
                    moved = captured.movable(ex.tensors)
                    if moved:  # inputs put anew each run (a batch): the next capture copies them in
                        slot.stage.update(moved)
                    return self._drop_graph(slot, "a tensor it reads is other memory now")
            except Exception as e:
                if not isinstance(e, DeepxError) or not hasattr(e, "index"):  # not a kernel's flag: a fault
                    self._drop_graph(slot, f"its replay failed: {type(e).__name__}")
                return self._graph_failed(result, e, start)
        end = time.perf_counter()
        n = len(prepared.bounds)
        result.done = n
        result.clock = (start, [end] * n)  # one launch: the first instruction holds its time
        s = self.op_stats.get(GRAPH_STAT)
        if s is None:
            s = self.op_stats[GRAPH_STAT] = OpStat()
        s.calls += 1
        s.seconds += end - start
        return True

    def _drop_graph(self, slot: GraphSlot, why: str) -> bool:
        """Forget a plan's graph (captured again at its next run, or never after GRAPH_MISSES); False: run the
        instructions this time."""
        self._release(slot)
        self._miss(slot, why)
        log.debug("%s: a plan's CUDA graph dropped: %s", self.name, why)
        return False

    @staticmethod
    def _miss(slot: GraphSlot, why: str) -> None:
        slot.runs = GRAPH_AFTER
        slot.misses += 1
        if slot.misses >= GRAPH_MISSES:
            slot.off = why

    def _release(self, slot: GraphSlot) -> None:
        """Destroy a plan's graph and give its memory back (on the CUDA thread: evicted, dropped, its plan gone, or
        the worker stopping); its plan may capture again."""
        self._live.pop(slot, None)
        if slot.captured is not None:
            slot.captured.destroy()
            slot.captured = None
            slot.runs = GRAPH_AFTER

    def _release_all(self) -> int:
        """Every graph's memory back (out of GPU memory): how many there were."""
        n = len(self._live)
        for slot in list(self._live):
            self._release(slot)
        return n

    @staticmethod
    def _graph_failed(result: RunResult, e: Exception, start: float) -> bool:
        """A graph's launch failed: at a kernel's error flag (`e.index`: the instructions before it ran), or, without
        an index, a fault the device reported (where it stopped is not known)."""
        index = getattr(e, "index", None)
        if isinstance(e, DeepxError) and index is not None:
            result.error, result.error_index, result.done = f"instruction {index + 1}: {e}", index, index
            result.clock = (start, [start] * index)
        else:
            result.error, result.error_index = f"a CUDA graph of this program failed: {type(e).__name__}: {e}", 0
            result.clock = (start, [])
        result.failed_at = 0.0
        return True

    def _describe(self, b: Bound, e: Exception) -> str:
        """A CUDA failure of one instruction as a sentence naming the op and its outputs."""
        outs = [(n, m) for n, m in zip(b.out_names, b.outs) if m is not None]
        sizes = ", ".join(f"'{n}' {m.dtype}{list(m.shape)}" for n, m in outs)
        if _is_oom(e):
            import pycuda.driver as drv

            want = sum(numel(m.shape) * to_numpy(m.dtype).itemsize for _, m in outs)
            free, total = drv.mem_get_info()
            return (f"{b.op.name}: out of GPU memory: outputs {sizes} need {want} bytes; {self.device} has {free} of "
                    f"{total} bytes free")
        log.warning("%s: %s failed on %s: %s: %s", self.name, b.op.name, self.device, type(e).__name__, e)
        return f"{b.op.name}: CUDA error on {self.device}: {type(e).__name__}: {e} (outputs {sizes or 'none'})"

    # -- data in and out
    async def on_fetch(self, names: Sequence[str]) -> dict[str, np.ndarray]:
        def read() -> dict[str, np.ndarray]:
            return {name: self.ex.get(name) for name in names}
        out: dict[str, np.ndarray] = await self.call(read)
        return out

    async def on_put(self, name: str, dtype: str, shape: Sequence[int], data: bytes | memoryview,
                     heap: bool = False, owner: str = "") -> dict[str, Any]:
        array = self._put_array(name, dtype, shape, data)
        await self._ready()
        if not heap:
            if name in self.heap:
                raise DeepxError(f"put: '{name}' is a heap tensor; put it with heap=true")
            await self.call(self._put_stack, name, array)
            return {"name": name, "dtype": dtype, "shape": list(array.shape), "kind": "stack", "device": self.device}
        view = await self._heap_for_put(name, dtype, array.shape, owner)
        await self.call(self.ex.write, view, array)
        self.ex.tensors[name] = view
        return {"name": name, "dtype": dtype, "shape": list(array.shape), "kind": "heap", "device": self.device}

    def _put_stack(self, name: str, array: np.ndarray) -> None:
        try:
            self.ex.put(name, array)
        except DeepxError:
            raise
        except Exception as e:
            if _is_oom(e):
                import pycuda.driver as drv

                free, total = drv.mem_get_info()
                what = f"'{name}' {dtype_name(array.dtype)}{list(array.shape)}"
                raise DeepxError(f"put: out of GPU memory: {what} needs {array.nbytes} bytes; {self.device} has "
                                 f"{free} of {total} bytes free") from None
            raise DeepxError(f"put: '{name}' could not be copied to {self.device}: {type(e).__name__}: {e}") from None

    async def on_attach_heap(self, name: str, hold: bool = True) -> dict[str, Any]:
        """Make an existing heap tensor visible to programs here, with a reference of this worker's; hold=False:
        without a new one (as op-cpu's: where this worker is among its holders already, it holds it)."""
        info, view = await self._heap_reference(name, hold)
        self.heap[name] = view
        await self._ready()
        self.ex.tensors[name] = view
        return dict(info)

    # -- what an operator sees
    def on_tensors(self) -> list[dict[str, Any]]:
        if self.ex is None:
            return []
        return [{"name": name, "dtype": dtype_name(a.dtype), "shape": list(a.shape), "bytes": int(a.nbytes),
                 "kind": "heap" if name in self.heap else "stack", "owner": self.name, "device": self.device}
                for name, a in list(self.ex.tensors.items())]

    def on_metas(self, names: Sequence[str]) -> dict[str, Any]:
        """Shape and dtype of each named tensor that exists here."""
        metas = self.ex.tensors.metas if self.ex is not None else {}
        return {n: metas[n] for n in names if n in metas}

    def on_variables(self) -> dict[str, Any]:
        if self.ex is None:
            return {"vars": {}, "vectors": {}}
        return {"vars": dict(self.ex.variables), "vectors": {k: list(v) for k, v in self.ex.vectors.items()}}

    async def on_sync(self) -> None:
        """Wait until the GPU has finished everything queued so far (benchmarks time whole programs with it)."""
        await self.call(lambda: self.ex.synchronize())

    async def on_tf32(self, on: bool) -> bool:
        """Run float32 matmul on TF32 tensor cores (on) or in IEEE float32 (off); returns the setting before."""
        def flip() -> bool:
            before = bool(self.ex.tf32)
            self.ex.tf32 = bool(on)
            return before
        before: bool = await self.call(flip)
        return before

    async def on_device_info(self) -> dict[str, Any]:
        """What a process group asks of this worker's GPU: its device, its PCI bus id, and whether NCCL loads here
        (`nccl_why` where not)."""
        from deepxd.kernels.cuda.nccl import available

        await self._ready()
        why = available()
        return {"device": self.device, "gpu": self.gpu, "nccl": why is None, "nccl_why": why or ""}

    async def on_kernels(self) -> list[str]:
        """The ops that run on a CUDA kernel here (every other op falls back to its CPU kernel)."""
        names: list[str] = await self.call(lambda: sorted(op for op in OPS if self.ex.has_kernel(op)))
        return names
