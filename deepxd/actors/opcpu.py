"""The CPU op worker: owns the stack tensors and runs checked programs on the numpy kernels.

A program is checked whole against this worker's tensors before any of it runs (a bad program changes nothing).
Small programs run inline on the event loop (a thread hop costs more than they do); a program with a heavy
instruction runs on this worker's single thread, so control traffic keeps flowing and order is kept.
Heap tensors (held by heapmem) appear here as zero-copy views of their shared-memory segments; other nodes' heap
tensors as views of their segments (same host) or as copies streamed for one program (another host: read only;
deepxd/peers.py).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import time
from collections.abc import Callable, Sequence
from collections.abc import Set as AbstractSet
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np

from deepx_core.errors import DeepxError
from deepx_core.ir.effects import apply_effect, heap_made
from deepx_core.ir.instr import Instr
from deepx_core.ir.ops import Bound, ProgramCheck, ProgramError, check_program
from deepx_core.ir.shapes import numel
from deepxd.actors.base import ActorRef
from deepxd.actors.messages import Adopted, ArrayOf, Create, HeapDelete, Remote
from deepxd.actors.worker import (
    BETWEEN_SLICES,
    LONG_PROGRAM,
    REMEMBER_MAX,
    SLICE_S,
    HeapViews,
    LongNames,
    OpStat,
    OpWorker,
    Plan,
    Prepared,
    RunResult,
    deletions,
    program_tensor_names,
    touched_names,
)
from deepxd.comm import Collectives, Work, early_launches
from deepxd.compiler.analysis import named_tensors, read_tensors
from deepxd.kernels.cpu import CpuExecutor, dtype_name, repeat_count, transient_transposes, worded
from deepxd.peers import Peers, Reached

if TYPE_CHECKING:
    from deepxd.actors.heapmem import HeapMemory

log = logging.getLogger(__name__)


def _collective(bounds: Sequence[Bound]) -> bool:
    for b in bounds:
        if b.op.family == "collective":
            return True
    return False


def _check_step(checking: ProgramCheck, names: set[str], until: float) -> bool:
    """A slice of a long program's check, the names of the tensors it checked added to `names`."""
    start = len(checking.bound)
    try:
        return checking.step(until)
    finally:
        names.update(touched_names(checking.bound[start:]))


class CpuWorker(OpWorker):
    role = "op-cpu"
    device = "cpu"

    def __init__(self, name: str = "op-cpu", *, heapmem: ActorRef[HeapMemory] | None = None,
                 io_roots: Sequence[str] | None = None, inline_elements: int = 1 << 16,
                 output_log: bool = True, peers: Peers | None = None, comm: Collectives | None = None) -> None:
        super().__init__(name)
        self.peers = peers  # other nodes: their heap tensors, mapped or streamed (deepxd/peers.py)
        self.comm = comm  # process groups: what runs the collective family (deepxd/comm.py)
        self.copies: dict[str, str] = {}  # other hosts' heap tensors streamed for the program running: name -> node
        self._output: list[str] = []
        self.ex = CpuExecutor(io_roots=io_roots, output=self._print)
        self.ex.collectives = comm
        self.heapmem = heapmem
        self.heap = HeapViews()  # heap tensor name -> its shared-memory view
        self.heap_held: set[str] = set()  # heap tensors this worker holds a reference to (others only view)
        self.ex.pinned = self.heap  # never replaced by a view of another buffer (their arrays are shared memory)
        self.inline_elements = inline_elements
        self.output_log = output_log
        self.op_stats: dict[str, OpStat] = {}
        self._unfolded: list[tuple[list[tuple[OpStat, int]], float, list[float]]] = []  # see _fold
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="deepx-op-cpu")

    async def on_start(self) -> None:
        """The heap tensors heapmem adopted at its start (a daemon of this node that died left them) are this
        worker's again, as the worker of that daemon saw them: programs and fetches see them, a put writes into them."""
        if self.heapmem is None:
            return
        try:
            adopted = await self.heapmem.ask(Adopted())
        except DeepxError as e:
            log.warning("%s: could not ask heapmem for the heap tensors it adopted: %s", self.name, e)
            return
        for info in adopted:
            name = info["name"]
            if name in self.heap or name in self.ex.tensors:
                continue
            try:
                await self.on_attach_heap(name, hold=False)
            except DeepxError as e:
                log.warning("%s: could not view adopted heap tensor '%s': %s", self.name, name, e)
            else:
                log.info("%s: sees adopted heap tensor '%s' (%s%s)", self.name, name, info["dtype"], info["shape"])

    async def on_stop(self) -> None:
        self._thread.shutdown(wait=True)
        self.ex.tensors.clear()
        self.heap.clear()

    # -- programs
    async def _offload(self, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args) on this worker's thread, off the event loop. While the interpreter exits (an embedded session's
        last program, sent by its atexit handler) the thread takes no new work: it then runs here. Meanwhile, every
        SLICE_S, the queries waiting (BETWEEN_SLICES) are answered: fn must only read the tensors."""
        try:
            fut = asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)
        except RuntimeError:  # "cannot schedule new futures after interpreter shutdown"
            return fn(*args)
        while True:
            done, _ = await asyncio.wait({fut}, timeout=SLICE_S)
            if done:
                return fut.result()
            self.answer_waiting(BETWEEN_SLICES)

    async def _sliced(self, fn: Callable[..., bool], *args: Any, cancel: Callable[[], bool] | None,
                      running: LongNames) -> bool:
        """Run fn(*args, until) on this worker's thread, slice after slice (fn runs instructions until the
        perf_counter passes `until` or the program ends, which it says), answering the queries waiting between
        slices and running the small programs that share no tensor with it (`running`: its tensor names; see
        _interleave). False where the asker went away (`cancel()`): the program stopped at an instruction
        boundary."""
        loop = asyncio.get_running_loop()
        outer = self._long is None
        if outer:
            self._long = running
        try:
            return await self._slices(loop, fn, args, cancel, running)
        finally:
            if outer:
                self._long = None

    async def _slices(self, loop: asyncio.AbstractEventLoop, fn: Callable[..., bool], args: tuple[Any, ...],
                      cancel: Callable[[], bool] | None, running: LongNames) -> bool:
        while True:
            until = time.perf_counter() + SLICE_S
            try:
                ended = await loop.run_in_executor(self._thread, functools.partial(fn, *args, until))
            except RuntimeError:  # the interpreter exits (see _offload): the rest here, whole
                return bool(fn(*args, math.inf))
            if ended:
                return True
            self.answer_waiting(BETWEEN_SLICES)
            await self._interleave(running)
            if cancel is not None and cancel():
                return False

    def _names_of(self, program: Sequence[Instr], prepared: Prepared | None, fetch: Sequence[str],
                  live: set[str] | None = None) -> LongNames:
        """The names of the program _sliced runs: `live` where its sliced check fills it (the names checked so
        far: a program run beside it before the check reads a name comes before it), a prepared plan's, else worked
        out once, on the thread."""
        if live is not None:
            return LongNames(live)
        if prepared is not None:
            return LongNames(frozenset(prepared.names).union(fetch))

        async def work() -> AbstractSet[str]:
            names: frozenset[str] = await asyncio.get_running_loop().run_in_executor(
                self._thread, program_tensor_names, program, fetch)
            return names
        return LongNames(None, work)

    async def on_run(self, program: Sequence[Instr], fetch: Sequence[str] = (),
                     cancel: Callable[[], bool] | None = None) -> RunResult:
        """Run `program` once (checked whole first; nothing of it kept) and send back the tensors named in `fetch`.
        `cancel`: whether the asker went away (its client's connection ended), asked between the slices of a program
        on the thread: it stops at that boundary."""
        return await self._run_checked(program, fetch, cancel, None)

    async def on_run_plan(self, plan: Plan, cancel: Callable[[], bool] | None = None) -> RunResult | None:
        """Run `plan` (deepxd/actors/plan.py) and send back the tensors it fetches: as prepared where it stands here
        (_stands), else its program checked whole, its first run keeping the check on it. None, with nothing run,
        where it does not stand. `cancel`: as on_run's."""
        stands = self._stands(plan)
        if stands is False:
            return None
        if stands is None:
            return await self._run_checked(plan.sent, plan.fetch, cancel, plan)
        prepared = plan.prepared
        assert prepared is not None
        result = self._begin_prepared(prepared)  # (`cancel` was asked by the scheduler a moment ago)
        if prepared.heavy:
            if not await self._sliced(self._execute_prepared, prepared, result, cancel=cancel,
                                      running=self._names_of(plan.sent, prepared, plan.fetch)):
                self._stop_prepared(prepared, self._cancelled(result))
                await self._offload(self._settle)
        else:
            self._execute_prepared(prepared, result)
        if prepared.deletes and self.heap:
            await self._forget_deleted(prepared, result.done)
        return self._end_prepared(plan, self._fetched(result, plan.fetch))

    async def _run_checked(self, program: Sequence[Instr], fetch: Sequence[str], cancel: Callable[[], bool] | None,
                           plan: Plan | None) -> RunResult:
        """Check `program` whole and run it; `plan`: the plan it is the program of, which keeps the check."""
        result = RunResult(t0=time.time())
        begun = self._state()
        self._output = []
        live = set(fetch) if len(program) > LONG_PROGRAM else None
        running = self._names_of(program, None, fetch, live)
        outer = live is not None and self._long is None
        if outer:  # from its check on (see _interleave)
            self._long = running
        streamed = set(self.copies)  # (a long program's, where this one runs between its slices)
        try:
            return await self._run_new(program, fetch, cancel, result, live, running, plan, begun)
        finally:
            if outer:
                self._long = None
            if len(self.copies) > len(streamed):
                self._drop_copies(keep=streamed)

    async def _run_new(self, program: Sequence[Instr], fetch: Sequence[str], cancel: Callable[[], bool] | None,
                       result: RunResult, live: set[str] | None, running: LongNames, plan: Plan | None = None,
                       begun: int = -1) -> RunResult:
        """_run_checked's work: checked (`live`: in slices, the names it checked into it), then run. A
        check that stops at a tensor not found here checks again after mapping it where it is another node's heap
        tensor on this host (_map_remote)."""
        while True:
            try:
                if live is not None:  # O(n): in slices on the thread (the check only reads the tensors)
                    checking = ProgramCheck(program, self.ex, self.ex.plans)
                    if not await self._sliced(_check_step, checking, live, cancel=cancel, running=running):
                        return self._cancelled(result)  # the check took seconds: its asker went meanwhile
                    bounds, heavy, transient = await self._offload(self._check_rest, checking.bound, fetch,
                                                                   len(program))
                else:
                    bounds, heavy, transient = self._check(program, fetch)
                break
            except ProgramError as e:
                try:
                    mapped = await self._map_remote(program, e.index)
                except DeepxError as refused:
                    result.error, result.error_index = f"instruction {e.index + 1}: {refused}", e.index
                    return result
                if not mapped:
                    result.error, result.error_index = str(e), e.index
                    return result
        heap_new = (await self._heap_tensors_to_create(bounds)
                    if any(b.instr.meta and heap_made(b) for b in bounds) else {})
        self.ex.transient = transient
        if plan is not None and not heap_new and not self.copies and len(program) <= REMEMBER_MAX:
            self._prepare(plan, bounds, begun, heavy, transient)  # (copies: read again next time)
        launches = early_launches(bounds) if self.comm is not None and _collective(bounds) else None
        if heavy:
            if not await self._sliced(self._execute, bounds, result, heap_new, launches, cancel=cancel,
                                      running=running):
                self._cancelled(result)
                await self._offload(self._settle)
        else:
            self._execute(bounds, result, heap_new, launches)
        for name in (str(bounds[i].out_names[0]) for i in heap_new if i >= result.done):
            self.heap.pop(name, None)
            self.heap_held.discard(name)  # never reached: give the segment back
            if self.heapmem is not None:
                await self.heapmem.ask(HeapDelete(name=name, force=True))
        if self.heap:
            for _, name in deletions(bounds[: result.done]):
                await self._forget_heap(name)
        result.output = self._output
        if not result.error:
            result.tensors = {name: self.ex.tensors[name].copy() for name in fetch}
        if plan is not None:
            self._ran(plan, result)
        return result

    def _now_ok(self, prepared: Prepared) -> bool:
        return not prepared.heavy

    def run_prepared(self, plan: Plan) -> RunResult:
        """on_run_plan for a plan that stands (now_run_plan)."""
        prepared = plan.prepared
        assert prepared is not None
        result = self._begin_prepared(prepared)
        self._execute_prepared(prepared, result)
        return self._end_prepared(plan, self._fetched(result, plan.fetch) if plan.fetch else result)

    def _prepare_again(self, prepared: Prepared, changed: list[int]) -> None:
        """The prepared steps of the instructions bound again; a step that can take its instruction's new numbers
        (a prepared adam update's `renumber`: its step count changes every step) keeps itself."""
        if prepared.steps:
            steps, bounds = prepared.steps, prepared.bounds
            for i in changed:
                renumber = getattr(steps[i], "renumber", None)
                if renumber is None or not renumber(bounds[i]):
                    steps[i] = self._launching(prepared, i, self.ex.prepare(bounds[i]))

    def _prepare_renamed(self, prepared: Prepared, changed: list[int], mappings: list[dict[str, str]]) -> None:
        """The prepared steps of the instructions bound again under new names: prepared again (a step reads its
        tensors by name)."""
        if prepared.steps:
            steps, bounds = prepared.steps, prepared.bounds
            for i in changed:
                steps[i] = self._launching(prepared, i, self.ex.prepare(bounds[i]))

    def _begin_prepared(self, prepared: Prepared) -> RunResult:
        """As OpWorker's, with the plan's steps prepared the first time."""
        result = super()._begin_prepared(prepared)
        if not prepared.steps:
            prepared.steps.extend(map(self.ex.prepare, prepared.bounds))
            if self.comm is not None and _collective(prepared.bounds):
                prepared.launches = early_launches(prepared.bounds)
                for i in {max(k, 0) for k in prepared.launches}:
                    prepared.steps[i] = self._launching(prepared, i, prepared.steps[i])
        self.ex.transient = prepared.transient
        return result

    # -- collectives (deepxd/comm.py): each bucket started as early as its tensors allow, waited for in its place
    def _launching(self, prepared: Prepared, i: int, step: Callable[[], None]) -> Callable[[], None]:
        """Step i, starting the buckets of collectives due before it (only before the first step: those that read
        nothing the program writes first) and after it."""
        before, after = (prepared.launches.get(-1) if i == 0 else None), prepared.launches.get(i)
        if not before and not after:
            return step
        bounds = prepared.bounds

        def run() -> None:
            if before:
                self._launch(bounds, before, -1)
            step()
            if after:
                self._launch(bounds, after, i)

        return run

    def _launch(self, bounds: Sequence[Bound], buckets: list[list[int]], at: int) -> None:
        """Start these buckets of collectives, after instruction `at`; a bucket that cannot start fails at its first
        collective's place."""
        assert self.comm is not None
        launched = self.ex.launched
        for members in buckets:
            chosen = [bounds[m] for m in members]
            try:
                work: Any = self.comm.start(self.ex, chosen, at < members[0] - 1)
            except DeepxError as e:
                work = Work(error=str(e))
            except Exception as e:  # (a bug, said at the collective's place rather than taking the worker down)
                log.exception("%s: starting a collective failed", self.name)
                work = Work(error=f"{chosen[0].op.name}: could not start: {type(e).__name__}: {e}")
            for b in chosen:
                launched[id(b)] = work

    def _settle(self) -> None:
        """The collectives started by a program that stopped before their place: waited for, whatever their outcome
        (their arrays must not change under the next program)."""
        launched = self.ex.launched
        for work in {id(w): w for w in launched.values()}.values():
            work.settle()
        launched.clear()

    def _fetched(self, result: RunResult, fetch: Sequence[str]) -> RunResult:
        if not result.error:
            result.tensors = {name: self.ex.tensors[name].copy() for name in fetch}
        return result

    async def _heap_tensors_to_create(self, bounds: list[Bound]) -> dict[int, np.ndarray]:
        """`newtensor ... // kind=heap` makes a heap tensor (in heapmem's shared memory): created before the program
        runs, put in place when its instruction is reached."""
        out: dict[int, np.ndarray] = {}
        if self.heapmem is None:
            return out
        for i, b in enumerate(bounds):
            name = heap_made(b) if b.instr.meta else None
            if name is not None:
                meta = b.outs[0]
                if meta is None or self.ex.tensors.metas.get(name) == meta:  # kept (of another meta: replaced)
                    continue
                await self.heapmem.ask(Create(name=name, shape=list(meta.shape), dtype=meta.dtype,
                                       owner=self.name, zero=True))
                self.heap_held.add(name)
                out[i] = await self.heapmem.ask(ArrayOf(name=name))
        return out

    def _check(self, program: Sequence[Instr], fetch: Sequence[str]) -> tuple[list[Bound], bool, set[int]]:
        """The program checked whole against the tensors here (ProgramError at the first refusal): its bound
        instructions, whether it is heavy (_heavy) and its transient transposes."""
        return self._check_rest(check_program(program, self.ex, self.ex.plans), fetch, len(program))

    def _checked(self, bounds: list[Bound], fetch: Sequence[str], length: int) -> list[Bound]:
        """OpWorker's checks, after this one: a program here may read another host's heap tensor (a copy, streamed
        for it), never write, delete or rename it (docs/decisions/0034-tensors-across-hosts.md)."""
        if self.copies:
            for i, b in enumerate(bounds):
                change = apply_effect(b)
                for name in (*change.writes, *change.gone):
                    node = self.copies.get(name)
                    if node is not None:
                        raise ProgramError(
                            f"instruction {i + 1}: {b.op.name}: tensor '{name}' is a heap tensor of node {node}, on "
                            "another host: this program reads a copy of it, streamed over the peer link, and cannot "
                            f"write, delete or rename it; run that on node {node}, or write another name here and "
                            "put it there (docs/cluster.md)", i)
        return super()._checked(bounds, fetch, length)

    def _check_rest(self, bounds: list[Bound], fetch: Sequence[str],
                    length: int) -> tuple[list[Bound], bool, set[int]]:
        """_check after check_program's checks."""
        bounds = self._checked(bounds, fetch, length)
        heavy = self._heavy(bounds) or (self.inline_elements >= 0 and len(bounds) > LONG_PROGRAM)
        return bounds, heavy, transient_transposes(bounds)

    def _execute(self, bounds: list[Bound], result: RunResult, heap_new: dict[int, np.ndarray] | None = None,
                 launches: dict[int, list[list[int]]] | None = None, until: float = math.inf) -> bool:
        """Run the program's instructions from `result.done` on, until the perf_counter passes `until` (the end of
        a slice, after an instruction) or the program ends or fails; whether it ended. `launches`: where its
        collectives start (early_launches)."""
        if launches is None:
            return self._execute_all(bounds, result, heap_new, None, until)
        try:
            ended = self._execute_all(bounds, result, heap_new, launches, until)
        except BaseException:
            self._settle()
            raise
        if ended and self.ex.launched:
            self._settle()
        return ended

    def _execute_all(self, bounds: list[Bound], result: RunResult, heap_new: dict[int, np.ndarray] | None,
                     launches: dict[int, list[list[int]]] | None, until: float) -> bool:
        times = result.raw_times
        stats = self.op_stats
        if not result.done:
            result.started = time.perf_counter()
            if launches and -1 in launches:
                self._launch(bounds, launches[-1], -1)
        start = result.started
        for i in range(result.done, len(bounds)):
            b = bounds[i]
            t0 = time.perf_counter()
            try:
                if heap_new and i in heap_new:
                    view = heap_new[i]
                    name = str(b.out_names[0])
                    if name in self.ex.shared:  # a stack tensor of another shape it replaces: its views keep copies
                        self.ex.unshare(name)
                    self.heap[name] = view
                    self.ex.tensors[name] = view
                else:
                    self.ex.execute(b)
                if launches and i in launches:
                    self._launch(bounds, launches[i], i)
            except DeepxError as e:
                result.error, result.error_index = f"instruction {i + 1}: {e}", i
                result.failed_at = (t0 - start) * 1e6
                return True
            t1 = time.perf_counter()
            times.append((t0 - start) * 1e6)
            times.append((t1 - start) * 1e6)
            result.done = i + 1
            s = stats.get(b.op.name)
            if s is None:
                s = stats[b.op.name] = OpStat()
            s.calls += 1
            s.seconds += t1 - t0
            s.bytes += b.nbytes
            if t1 > until:
                return result.done == len(bounds)
        return True

    def _execute_prepared(self, prepared: Prepared, result: RunResult, until: float = math.inf) -> bool:
        """_execute for a prepared plan: its instructions prepared, one clock read each; the statistics after, into
        the OpStat of each instruction's op (found once per program), and the times worked out only if read.
        `until`: as _execute's (a slice), the steps run in blocks that grow while they are quick."""
        now = time.perf_counter
        if result.clock is None:
            ends: list[float] = []
            start = now()
            result.clock = (start, ends)
        else:
            start, ends = result.clock
        add = ends.append
        steps = prepared.steps
        i = result.done
        paused = False
        try:
            if until == math.inf:
                for step in steps[i:] if i else steps:
                    step()
                    add(now())
                    i += 1
            else:
                block = 1
                while i < len(steps):
                    t0 = now()
                    for step in steps[i:i + block]:
                        step()
                        add(now())
                        i += 1
                    t = ends[-1]
                    if t > until and i < len(steps):
                        paused = True
                        break
                    block = block * 2 if (t - t0) * 4 < until - t else max(1, block // 2)
        except DeepxError as e:
            result.error, result.error_index = f"instruction {i + 1}: {worded(prepared.bounds[i], e)}", i
        except Exception as e:  # what execute() makes of a kernel's error, with its message
            try:
                self.ex.explain_failure(prepared.bounds[i], e)
            except DeepxError as d:
                result.error, result.error_index = f"instruction {i + 1}: {d}", i
            else:
                raise
        finally:
            result.done = i
            if i < len(steps) and not paused:  # stopped part-way: when the failing step began
                result.failed_at = ((ends[-1] if ends else start) - start) * 1e6
            if not paused and self.ex.launched:
                self._settle()
        if paused:
            return False
        self._count_prepared(prepared, start, ends)
        return True

    def _stop_prepared(self, prepared: Prepared, result: RunResult) -> None:
        """A prepared plan run in slices stopped between two (cancelled): the instructions that ran counted."""
        assert result.clock is not None
        self._count_prepared(prepared, *result.clock)

    def _count_prepared(self, prepared: Prepared, start: float, ends: list[float]) -> None:
        slots = prepared.slots
        if not slots:
            stats = self.op_stats
            for b in prepared.bounds:
                s = stats.get(b.op.name)
                if s is None:
                    s = stats[b.op.name] = OpStat()
                slots.append((s, b.nbytes))
        unfolded = self._unfolded
        unfolded.append((slots, start, ends))
        if len(unfolded) >= 64:
            self._fold()

    def _heavy(self, bounds: list[Bound]) -> bool:
        """Whether the program goes to the worker's thread: it touches files, has a large matmul, or writes more
        than `inline_elements` elements in all, each instruction's counted as many times as `benchmark.repeat` runs
        it (a small op repeated ten thousand times is heavy work: inline it would hold the event loop)."""
        if self.inline_elements < 0:  # every program inline (an embedded daemon)
            return False
        total = 0
        for b in bounds:
            if b.op.family == "io" or b.op.family == "collective":  # (a collective waits for the other ranks)
                return True
            repeat = repeat_count(b.instr) if b.instr.meta else 1  # checked already (check_instruction)
            if b.op.family == "matmul":  # m * k * n multiply-adds, for either operand read transposed
                n = b.args[1].shape[-2 if b.op.name == "matmultransposed" and b.args[3] else -1]
                if numel(b.args[0].shape) * n * repeat >= 1 << 16:
                    return True
            for m in b.outs:
                if m is not None and m.shape[:1] != (-1,):
                    total += numel(m.shape) * repeat
            if total > self.inline_elements:
                return True
        return False

    # -- data in and out
    def on_fetch(self, names: Sequence[str]) -> Any:
        """Copies of the tensors `names`; one not here is mapped first where it is another node's heap tensor on
        this host (then the answer is a coroutine: see _map_remote)."""
        tensors = self.ex.tensors
        if self.heapmem is not None and not all(name in tensors for name in names):
            return self._fetch_mapped(names)
        return {name: self.ex.get(name).copy() for name in names}

    async def _fetch_mapped(self, names: Sequence[str]) -> dict[str, np.ndarray]:
        reached = await self._reach([n for n in names if n not in self.ex.tensors])
        self._view_mapped(reached.views)
        return {name: reached.copies[name] if name in reached.copies else self.ex.get(name).copy() for name in names}

    async def _reach(self, names: Sequence[str]) -> Reached:
        """Other nodes' heap tensors among `names`: mapped (this host) or streamed (another host; Peers.reach)."""
        if self.peers is None or self.heapmem is None or not names:
            return Reached()
        return await self.peers.reach(names)

    async def on_put(self, name: str, dtype: str, shape: Sequence[int], data: bytes | memoryview,
                     heap: bool = False, owner: str = "") -> dict[str, Any]:
        array = self._put_array(name, dtype, shape, data)
        if name in self.ex.shared:
            self.ex.unshare(name)  # written in place below: views of its buffer keep their values
        if heap:
            view = await self._heap_for_put(name, dtype, array.shape, owner)
            view[...] = array
            self.ex.tensors[name] = view
        else:
            if name in self.heap:
                raise DeepxError(f"put: '{name}' is a heap tensor; put it with heap=true")
            self.ex.put(name, array.copy())
        return {"name": name, "dtype": dtype, "shape": list(array.shape), "kind": "heap" if heap else "stack"}

    async def _map_remote(self, program: Sequence[Instr], index: int) -> bool:
        """The tensors that instruction `index` reads and that neither this worker nor an instruction before it
        names, where they are heap tensors of other nodes: mapped from this host's segments, or streamed from other
        hosts for this program (Peers.reach: DeepxError where one is unreachable); whether any was. They are viewed
        here as heap tensors this worker does not hold."""
        if self.heapmem is None or index >= len(program):
            return False
        made = {n for instr in program[:index] for n in named_tensors(instr)}  # (returns, a rename's new name)
        gone = [n for n in apply_effect(program[index]).gone if n not in self.ex.tensors and n not in made]
        if gone:
            _, far = await self.heapmem.ask(Remote(names=gone))
            if far:
                raise DeepxError(f"{program[index].name}: tensor '{far[0].name}' is a heap tensor of node "
                                 f"{far[0].node}: a program here cannot delete or rename it; `deepxctl tensors rm "
                                 f"{far[0].name}` on any node frees it (docs/cluster.md)")
        names = [n for n in read_tensors(program[index]) if n not in self.ex.tensors and n not in made]
        if not names:
            return False
        reached = await self._reach(names)
        for name, copy in reached.copies.items():
            self.copies[name] = reached.nodes[name]
            self.heap[name] = copy
            self.ex.tensors[name] = copy
        return self._view_mapped(reached.views) or bool(reached.copies)

    def _drop_copies(self, keep: set[str]) -> None:
        """The program that read other hosts' tensors ended: the copies streamed for it go (the next one reads them
        again); those of `keep`, a program's it ran between the slices of, stay until that one ends."""
        for name in [n for n in self.copies if n not in keep]:
            del self.copies[name]
            copy = self.heap.pop(name, None)
            if copy is not None and self.ex.tensors.get(name) is copy:
                self.ex.tensors.pop(name)

    def _view_mapped(self, views: dict[str, np.ndarray]) -> bool:
        """Other nodes' heap tensors heapmem mapped (on_remote), seen here as heap tensors this worker does not
        hold; whether there were any."""
        for name, view in views.items():
            self.heap[name] = view
            self.ex.tensors[name] = view
        return bool(views)

    async def on_attach_heap(self, name: str, hold: bool = True) -> dict[str, Any]:
        """Make an existing heap tensor visible to programs here, with a reference of this worker's; hold=False:
        without a new one (this worker holds it already where it is among the holders: a tensor adopted from a
        daemon of this node that died, whose worker had put it)."""
        info, view = await self._heap_reference(name, hold)
        if name in self.ex.shared:
            self.ex.unshare(name)
        self.heap[name] = view
        self.ex.tensors[name] = view
        return dict(info)

    # -- what an operator sees
    def on_tensors(self) -> list[dict[str, Any]]:
        rows = []
        for name, a in self.ex.tensors.items():
            rows.append({"name": name, "dtype": dtype_name(a.dtype), "shape": list(a.shape), "bytes": int(a.nbytes),
                         "kind": "heap" if name in self.heap else "stack", "owner": self.name, "device": "cpu"})
        return rows

    def on_metas(self, names: Sequence[str]) -> dict[str, Any]:
        """Shape and dtype of each named tensor that exists here."""
        metas = self.ex.tensors.metas
        return {n: metas[n] for n in names if n in metas}

    def on_variables(self) -> dict[str, Any]:
        return {"vars": dict(self.ex.variables), "vectors": {k: list(v) for k, v in self.ex.vectors.items()}}

