"""What every op worker shares: the result of a program (`RunResult`), op statistics, the view of heap tensors, and
the `OpWorker` actor base that checks a program whole against the worker's tensors, runs a plan again on the part
it kept of it (deepxd/actors/plan.py) and runs long programs in slices.
The CPU worker (opcpu.py) and the CUDA worker (opcuda.py) fill in the kernels.
"""


from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from deepx_core.errors import DeepxError
from deepx_core.ir.dtypes import to_numpy
from deepx_core.ir.effects import CREATES, DELETES, RENAMES, SETS, apply_effect
from deepx_core.ir.instr import Instr
from deepx_core.ir.ops import OPS, Bound, ProgramError, TensorMeta, check_program, rebind_numbers
from deepx_core.ir.shapes import numel
from deepxd.actors.base import Actor, ActorRef, Envelope
from deepxd.actors.messages import ArrayOf, Attach, Create, Fetch, Info, Put, Release, RunPlan, RunProgram
from deepxd.actors.plan import Plan, Prepared, renamed_bound
from deepxd.compiler.analysis import named_tensors
from deepxd.kernels.cpu import check_instruction, dtype_name
from deepxd.kernels.cpu.life import refused_heap_replace

if TYPE_CHECKING:
    from deepxd.actors.heapmem import HeapMemory

log = logging.getLogger(__name__)

#: a program longer than this is checked on the worker's thread and runs there in slices (the loop stays free)
LONG_PROGRAM = 4096
#: a program longer than this is never kept as a plan: a memo of it would outlive it
REMEMBER_MAX = 65536
#: about how long a slice of a program runs on the worker's thread before the worker looks up (cancel, queries)
SLICE_S = 0.05
#: what a worker answers between the slices of a long program: queries that read its state (`state`: for the passes
#: of a small program that may run between them, see OpWorker._interleave)
BETWEEN_SLICES = frozenset({"tensors", "metas", "op_stats", "state"})
#: a program this short, naming none of the tensors of the long program running and no variable, runs between the
#: long one's slices: programs that share no tensor commute, so another client's small step does not wait for it
SMALL_PROGRAM = 256
_VALUE_CATEGORIES = frozenset(("var", "vector", ""))


@dataclass
class RunResult:
    """What happened to a program: `done` instructions ran; `error` (with `error_index`) stopped it."""

    done: int = 0
    error: str = ""
    error_index: int = -1
    t0: float = 0.0  # wall-clock start, seconds since the epoch
    output: list[str] = field(default_factory=list)
    tensors: dict[str, np.ndarray] = field(default_factory=dict)
    # start, end of each instruction that ran, from t0, as the worker measured the program it ran; `times_us`
    # speaks of the client's program: the mappings (origins, done) of the passes in between (map_times) are applied
    # when it is read, which an embedded client never does
    raw_times: list[float] = field(default_factory=list)
    time_maps: list[tuple[Sequence[int], int]] = field(default_factory=list)
    # a prepared plan's clock: its start and each instruction's end (perf_counter), made into raw_times when read
    clock: tuple[float, list[float]] | None = None
    # where an instruction failed while running (not in its check): when it began, in us on the clock of the times;
    # -1 where none began (a UDP reply's start_at is 0 only for an op that never started, docs/deepxir.md section 2)
    failed_at: float = -1.0
    # stopped at an instruction boundary because its asker went away (the client's connection ended)
    cancelled: bool = False
    started: float = 0.0  # perf_counter when the first instruction began (a program run in slices)
    # a program run across nodes (deepxd/placement.py): each instruction's node and worker, what moved
    placement: dict[str, Any] | None = None

    @property
    def times_us(self) -> list[float]:
        if self.clock is not None:
            start, ends = self.clock
            self.clock = None
            prev = start
            for t in ends:
                self.raw_times.append((prev - start) * 1e6)
                self.raw_times.append((t - start) * 1e6)
                prev = t
        if self.time_maps:
            from deepxd.compiler.pipeline import original_times

            for origins, done in self.time_maps:
                self.raw_times = original_times(self.raw_times, origins, done)
            self.time_maps = []
        return self.raw_times

    def map_times(self, origins: Sequence[int], done: int) -> None:
        """The times now speak of a program of which instruction i of the one that ran came from origins[i]."""
        self.time_maps.append((origins, done))


@dataclass
class OpStat:
    calls: int = 0
    seconds: float = 0.0
    bytes: int = 0


class HeapViews(dict[str, Any]):
    """A worker's heap tensors (name -> its array), with `version` counting the changes (see OpWorker._state)."""

    def __init__(self) -> None:
        super().__init__()
        self.version = 0

    def __setitem__(self, name: str, view: Any) -> None:
        dict.__setitem__(self, name, view)
        self.version += 1

    def __delitem__(self, name: str) -> None:
        dict.__delitem__(self, name)
        self.version += 1

    def pop(self, name: str, *default: Any) -> Any:  # type: ignore[override]
        if name in self:
            self.version += 1
        return dict.pop(self, name, *default)

    def clear(self) -> None:
        dict.clear(self)
        self.version += 1


def _state_free(bounds: list[Bound]) -> bool:
    """Whether checking the program reads nothing but the metas of its tensors: no files, no named variables, no heap
    tensors made (those ask heapmem)."""
    for b in bounds:
        op = b.op
        if op.family == "io" or (op.effect.kind is CREATES and b.instr.meta):  # (kind=heap, exists=keep)
            return False
        for a, p in zip(op.args, b.instr.args):
            if type(p.value) is str and a.kind in ("var", "vector", "shape") and a.vtype not in ("str", "any"):
                return False
    return True


def touched_names(bounds: list[Bound]) -> tuple[str, ...]:
    """The names of every tensor a checked program touches, in order of first touch."""
    names: dict[str, None] = {}
    for b in bounds:
        for n in b.names:
            if type(n) is str:
                names[n] = None
            elif type(n) is list:
                names.update(dict.fromkeys(n))
        for n in b.out_names:
            names[str(n)] = None
        if b.op.effect.kind is RENAMES:  # and the name it renames to
            names.update((new, None) for _, new in apply_effect(b).renamed)
    return tuple(names)


def program_tensor_names(program: Sequence[Instr], fetch: Sequence[str]) -> frozenset[str]:
    """Every tensor a program names (named_tensors), and those it fetches."""
    names = set(fetch)
    for instr in program:
        names.update(named_tensors(instr))
    return frozenset(names)


def small_tensor_names(program: Sequence[Instr], fetch: Sequence[str]) -> set[str] | None:
    """The tensors a program that may run beside a long one names (with those it fetches); None where it may not:
    longer than SMALL_PROGRAM, an op outside the catalogue (a backward marker) or one that sets variables, or a
    string where a value goes (a variable read by name: the long program may set it)."""
    if len(program) > SMALL_PROGRAM:
        return None
    names = set(fetch)
    for instr in program:
        op = OPS.get(instr.name)
        if op is None or op.effect.kind is SETS:
            return None
        for p in instr.args:
            if type(p.value) is str and p.category in _VALUE_CATEGORIES:
                return None
        names.update(named_tensors(instr))
    return names


def deletions(bounds: Sequence[Bound]) -> Iterator[tuple[int, str]]:
    """(index, name) of each tensor the checked program deletes."""
    for i, b in enumerate(bounds):
        if b.op.effect.kind is DELETES:
            for name in apply_effect(b).deleted:
                yield i, name


class LongNames:
    """The names of the tensors of a long program that a worker runs in slices: `now`, where known (the live set
    its sliced check fills, or a prepared plan's), else worked out once by `get` (with `work`, on a thread)."""

    def __init__(self, now: AbstractSet[str] | None = None,
                 work: Callable[[], Awaitable[AbstractSet[str]]] | None = None) -> None:
        self.now = now
        self._work = work

    async def get(self) -> AbstractSet[str]:
        if self.now is None:
            assert self._work is not None
            self.now = await self._work()
        return self.now


class OpWorker(Actor):
    """What the op workers (op-cpu here, op-cuda in opcuda.py) share: running programs and plans, the heap tensors
    they view, and their op statistics. A subclass sets these attributes and an executor `ex` (None
    until it exists) whose `tensors` table has `metas`."""

    ex: Any
    device: str  # where it computes: cpu, or its GPU (cuda:N), whose memory its heap tensors are in
    heap: HeapViews  # heap tensor name -> its array (memory heapmem allocated)
    heap_held: set[str]  # heap tensors this worker holds a reference to (others only view)
    heapmem: ActorRef[HeapMemory] | None
    op_stats: dict[str, OpStat]
    output_log: bool
    _output: list[str]
    _unfolded: list[Any]  # prepared plans' clocks not yet in op_stats (see _fold)
    run_prepared: Callable[[Plan], RunResult]  # on_run_plan for a plan that stands, inline (now_run_plan)
    prepared_runs = 0  # plans run as prepared (their check a version or a comparison)
    renumbered_runs = 0  # ...of which with new numbers in their optimizer updates, bound again

    _nested = False  # a small program runs between the slices of a long one (see _interleave): none deeper
    _long: LongNames | None = None  # the long program running in slices (see _interleave)

    def _may_interleave(self, names: AbstractSet[str]) -> bool:
        """Whether a program naming `names` may run between the slices of the long program running: it names
        none of its tensors (as far as they are known) and no tensor that shares its buffer with another (a write
        there would give views copies under the long program's prepared steps)."""
        shared = getattr(self.ex, "shared", None)
        if shared and not shared.keys().isdisjoint(names):
            return False
        long = self._long
        return long is None or long.now is None or long.now.isdisjoint(names)

    def now_interleaves(self, names: AbstractSet[str]) -> bool:
        """`ref.now(Interleaves(names))`: whether a small program naming `names` sent now would run before the end
        of the long program running here (True where none runs or its names are not known yet): the scheduler
        sends on only those, so that one that must wait holds up no other."""
        return self._may_interleave(names)

    async def _interleave(self, running: LongNames) -> int:
        """Between two slices of a long program (its tensors whole): run, each whole, the small programs (and
        fetches and puts) waiting that name none of its tensors and no variable (small_tensor_names): programs that
        share no tensor commute, so the results are those of some serial order. A message may overtake only
        small ones it shares no tensor with. `running`: the long program's names, worked out at the first
        candidate. How many ran."""
        if self._nested:
            return 0
        candidate = False

        def names_of(env: Envelope) -> set[str] | None:
            m = env.message
            if isinstance(m, RunProgram):
                return small_tensor_names(m.program, m.fetch)
            if isinstance(m, RunPlan) and isinstance(m.plan, Plan):
                return small_tensor_names(m.plan.sent, m.plan.fetch)
            if isinstance(m, Fetch) and all(type(n) is str for n in m.names):
                return set(m.names)
            if isinstance(m, Put) and type(m.name) is str:
                return {m.name}
            return None

        ran = 0
        passed: set[str] = set()  # the names of the messages looked past, this look
        while True:
            passed.clear()

            def accept(env: Envelope) -> bool:
                nonlocal candidate
                small = names_of(env)
                if small is None or not passed.isdisjoint(small):
                    return False
                candidate = True
                return running.now is not None and self._may_interleave(small)

            def passes(env: Envelope) -> bool:
                small = names_of(env)
                if small is None:
                    return False
                passed.update(small)
                return True

            env = self.take_next(accept, passes)
            if env is None:
                if not candidate or running.now is not None:
                    return ran
                await running.get()
                continue
            output, transient = self._output, getattr(self.ex, "transient", None)
            launched = getattr(self.ex, "launched", None)  # the long program's collectives under way
            if launched is not None:
                self.ex.launched = {}
            self._nested = True
            try:
                await self.handle_nested(env)
            finally:
                self._nested = False
                self._output = output
                if transient is not None:
                    self.ex.transient = transient
                if launched is not None:
                    self.ex.launched = launched
            ran += 1

    def _print(self, text: str) -> None:
        self._output.append(text)
        if self.output_log:
            log.info("print: %s", text)

    def _stands(self, plan: Plan) -> bool | None:
        """Whether `plan` runs here now as prepared (True: its state's version is the one its last run left, or the
        tensors it read are as it found them); False where it does not stand (nothing runs); None where it has no
        prepared part (its first run, or one whose part was not kept, or whose new numbers an op refuses): then its
        program is checked whole, as any program's. Renumbered updates are bound and prepared again here."""
        prepared = plan.prepared
        if prepared is None:  # its first run: on the state it was planned on
            plan.renames.clear()  # (its program is checked whole, under the names it has)
            return None if plan.seen is None or (self.ex is not None and plan.seen == self._state()) else False
        if self.ex is None:
            return False
        if plan.renames:
            self._rename(plan, prepared)
        if plan.version < 0 or plan.version != self._state():
            if not self._meets(prepared.names, prepared.metas,
                               prepared.heaped if self.heap or any(prepared.heaped) else None):
                return False
            heap = self.heap
            if heap and prepared.deletes and any(n in heap and n not in self.heap_held for _, n in prepared.deletes):
                return False  # (a heap tensor held by others: the whole check says why it may not be deleted here)
        if plan.redo and not self._rebind(plan, prepared):
            plan.prepared = None
            return None
        return True

    def _rebind(self, plan: Plan, prepared: Prepared) -> bool:
        """Bind again the instructions of `plan` whose numbers changed (Plan.renumber), against the metas their
        tensors were bound with, and prepare them again; False where an op refuses its new numbers (the whole check
        says how)."""
        bounds = prepared.bounds
        redo = sorted(set(plan.redo))
        plan.redo.clear()
        for i in redo:
            try:
                bounds[i] = rebind_numbers(bounds[i], plan.sent[i])
            except DeepxError:
                return False
        self._prepare_again(prepared, redo)
        self.renumbered_runs += 1
        return True

    def _prepare_again(self, prepared: Prepared, changed: list[int]) -> None:
        """The prepared steps at positions `changed`, bound again: none here (prepared again at the next run)."""
        prepared.steps.clear()

    def _rename(self, plan: Plan, prepared: Prepared) -> None:
        """Bind again, under their new names, the instructions of `plan` that name inputs it took new names for
        (Plan.renamed), and prepare them again. The metas stay: the comparison that follows (its version forgotten)
        finds whether the new tensors have them; where not, the plan does not stand."""
        bounds, redo = prepared.bounds, plan.redo
        before: dict[int, Bound] = {}
        mappings = []
        for mapping, at in plan.renames:
            mappings.append(mapping)
            prepared.names = tuple([mapping.get(n, n) for n in prepared.names])
            for i in at:
                before.setdefault(i, bounds[i])
                bounds[i] = renamed_bound(bounds[i], mapping)
        plan.renames.clear()
        plan.version = -1
        if prepared.deletes:
            for mapping in mappings:
                prepared.deletes = tuple((i, mapping.get(n, n)) for i, n in prepared.deletes)
        transient = prepared.transient
        for i, old in before.items():
            b = bounds[i]
            if i not in redo:  # (one whose numbers changed too keeps the instruction its numbers are read against)
                b = bounds[i] = b._replace(instr=plan.sent[i])
            if id(old) in transient:
                transient.discard(id(old))
                transient.add(id(b))
        self._prepare_renamed(prepared, sorted(before), mappings)

    def _prepare_renamed(self, prepared: Prepared, changed: list[int], mappings: list[dict[str, str]]) -> None:
        """The prepared steps at positions `changed`, bound again under new names (`mappings`, old -> new, in
        order): none here (prepared again at the next run)."""
        prepared.steps.clear()

    def now_stands(self, plan: Plan) -> bool:
        """`ref.now(Stands(plan))`: whether on_run_plan would run this plan as prepared with no coroutine, were it
        asked now: this worker idle, the plan prepared and standing (_stands), not one for a thread (_now_ok), and
        deleting no heap tensor (heapmem would be told). Nothing runs; the scheduler's look before it commits to a
        run on its caller's thread (now_run_plan)."""
        if not self.idle() or self.ex is None:
            return False
        prepared = plan.prepared
        if prepared is None or not self._now_ok(prepared):
            return False
        if plan.renames:  # (what it deletes under the new names)
            self._rename(plan, prepared)
        heap = self.heap
        if heap and any(name in heap for _, name in prepared.deletes):
            return False
        return self._stands(plan) is True

    def now_run_plan(self, plan: Plan, cancel: Callable[[], bool] | None = None) -> RunResult:
        """`ref.now(RunPlan(plan))`, right after now_stands said yes: run_prepared answered as message `run_plan`
        on the caller's thread (counted and marked busy as an ask is; see Actor.now)."""
        result: RunResult = self.now("run_plan", self.run_prepared, plan)
        return result

    def _now_ok(self, prepared: Prepared) -> bool:
        """Whether run_prepared may run this plan inline (op-cpu: not one for its thread pool)."""
        return True

    @staticmethod
    def _cancelled(result: RunResult) -> RunResult:
        """A run stopped where it was (after `result.done` instructions) because its asker went away."""
        result.cancelled = True
        result.error_index = result.done
        result.error = (f"instruction {result.done + 1}: cancelled: the client's connection ended (the instructions "
                        "before it ran)")
        return result

    def _begin_prepared(self, prepared: Prepared) -> RunResult:
        """A prepared plan about to run: its result begun."""
        result = RunResult(t0=time.time())
        self._output = []
        self.prepared_runs += 1
        return result

    def _end_prepared(self, plan: Plan, result: RunResult) -> RunResult:
        result.output = self._output
        self._ran(plan, result)
        return result

    def _meets(self, names: Sequence[str], metas: list[Any], heaped: list[bool] | None) -> bool:
        """Whether the tensors `names` have these metas here now (None: absent), and these heap flags (None: not
        asked). C loops, and list compares."""
        return list(map(self.ex.tensors.metas.get, names)) == metas and (
            heaped is None or list(map(self.heap.__contains__, names)) == heaped)

    def _ran(self, plan: Plan, result: RunResult) -> None:
        """After a plan ran: where it ran to the end and left the metas it read as it found them (a training step
        deletes its temporaries and gradients and makes them again), the version of the state then is noted on it:
        while the version stands, the plan finds the state it found, and runs again without comparing."""
        prepared = plan.prepared
        if prepared is None:
            return
        if result.error:
            plan.version = -1
            return
        after = prepared.after
        if not after:  # the same program from the same state leaves the same state: worked out once
            after.append(self._meets(prepared.names, prepared.metas, prepared.heaped))
        plan.version = self._state() if after[0] else -1

    def _state(self) -> int:
        """The version of what a program's check reads here: the tensor table's and the heap tensors' (both only
        grow, so their sum stands exactly while neither changes)."""
        return int(self.ex.tensors.version) + self.heap.version

    def _missing(self, names: Sequence[str], bounds: list[Bound]) -> str | None:
        """The first of `names` that no tensor will have after the program; None where all will."""
        exists = {name: name in self.ex.tensors for name in names}
        for b in bounds:
            change = apply_effect(b)
            for name in change.gone:
                if name in exists:
                    exists[name] = False
            for name in (*change.writes, *(new for _, new in change.renamed)):
                if name in exists:
                    exists[name] = True
        return next((name for name in names if not exists[name]), None)

    def _check_program(self, program: Sequence[Instr], fetch: Sequence[str]) -> list[Bound]:
        """The program checked whole against the tensors here, its fetch and its heap tensors included (ProgramError
        at the first refusal): its bound instructions."""
        return self._checked(check_program(program, self.ex, self.ex.plans), fetch, len(program))

    def _checked(self, bounds: list[Bound], fetch: Sequence[str], length: int) -> list[Bound]:
        """_check_program's checks after check_program's (of a program of `length` instructions)."""
        self._check_instructions(bounds)
        self._check_heap(bounds)
        missing = self._missing(fetch, bounds) if fetch else None
        if missing is not None:
            raise ProgramError(f"fetch: tensor '{missing}' not found", length)
        return bounds

    @staticmethod
    def _check_instructions(bounds: list[Bound]) -> None:
        """check_instruction (a repeat count, a rename's new name) for each checked instruction that has what it
        reads: ProgramError at the first it refuses, before anything runs."""
        for i, b in enumerate(bounds):
            if b.instr.meta or b.op.effect.kind is RENAMES:
                try:
                    check_instruction(b)
                except DeepxError as e:
                    raise ProgramError(f"instruction {i + 1}: {e}", i) from None

    def _check_heap(self, bounds: list[Bound]) -> None:
        if not self.heap:
            return
        for i, b in enumerate(bounds):
            for n, m in zip(b.out_names, b.outs):
                view = self.heap.get(n) if isinstance(n, str) else None
                if view is not None and m is not None and (tuple(m.shape) != tuple(view.shape)
                                                           or m.dtype != dtype_name(view.dtype)):
                    if b.op.effect.kind is CREATES:
                        have = TensorMeta(tuple(view.shape), dtype_name(view.dtype))
                        raise ProgramError(f"instruction {i + 1}: {refused_heap_replace(n, have, m)}", i)
                    raise ProgramError(
                        f"instruction {i + 1}: {b.op.name}: heap tensor '{n}' is {dtype_name(view.dtype)}"
                        f"{list(view.shape)}; it cannot become {m.dtype}{list(m.shape)}", i)
            if b.op.effect.kind is not RENAMES and b.op.effect.kind is not DELETES:
                continue
            change = apply_effect(b)
            for old, _ in change.renamed:
                if old in self.heap:
                    raise ProgramError(f"instruction {i + 1}: {b.op.name}: heap tensor '{old}' cannot be renamed", i)
            # a deltensor releases this worker's own reference only: one it does not hold would stay live
            for name in change.deleted:
                if name in self.heap and name not in self.heap_held:
                    raise ProgramError(
                        f"instruction {i + 1}: {b.op.name}: heap tensor '{name}' is held by others, not by "
                        f"{self.name}, so deleting it here would free nothing; its holders release it, or "
                        f"`deepxctl tensors rm {name} --force` frees it", i)

    async def _forget_deleted(self, prepared: Prepared, done: int) -> None:
        """The heap tensors that a prepared plan's first `done` instructions deleted: forgotten (_forget_heap)."""
        heap = self.heap
        for i, name in prepared.deletes:
            if i >= done:
                break
            if name in heap:
                await self._forget_heap(name)

    async def _forget_heap(self, name: str) -> None:
        """deltensor of a heap tensor: drop the view, and this worker's reference if it holds one (an owner's
        reference keeps the tensor alive until the owner releases it)."""
        if self.heap.pop(name, None) is not None and name in self.heap_held and self.heapmem is not None:
            self.heap_held.discard(name)
            try:
                await self.heapmem.ask(Release(name=name, holder=self.name))
            except DeepxError as e:
                log.warning("releasing heap tensor '%s': %s", name, e)

    @staticmethod
    def _put_array(name: str, dtype: str, shape: Sequence[int], data: bytes | memoryview) -> np.ndarray:
        """The bytes of a put as an array of `dtype` and `shape` (no copy), refused when they do not fit."""
        npdt = to_numpy(dtype)
        shape = tuple(int(d) for d in shape)
        if any(d < 0 for d in shape):
            raise DeepxError(f"put: shape {list(shape)} of '{name}' has a negative dimension")
        want = numel(shape) * npdt.itemsize
        if len(data) != want:
            raise DeepxError(f"put: '{name}' is {dtype}{list(shape)}, which needs {want} bytes; got {len(data)}")
        return np.frombuffer(data, dtype=npdt).reshape(shape)

    async def _heap_reference(self, name: str, hold: bool) -> tuple[dict[str, Any], Any]:
        """attach_heap's part common to the workers: heap tensor `name`'s record and its view, with a reference of
        this worker's (hold=False: none new; it holds one already where it is among the holders)."""
        if self.heapmem is None:
            raise DeepxError("no heapmem role runs on this node")
        info: dict[str, Any] | None
        if hold:
            info = await self.heapmem.ask(Attach(name=name, holder=self.name))
            self.heap_held.add(name)
        else:
            info = await self.heapmem.ask(Info(name=name))
            assert info is not None  # (missing_ok=False: a missing one raised)
            if self.name in info["holders"]:
                self.heap_held.add(name)
        view = await self.heapmem.ask(ArrayOf(name=name, device=self.device))
        return info, view

    async def _heap_for_put(self, name: str, dtype: str, shape: tuple[int, ...], owner: str) -> Any:
        """The heap tensor a put writes into: the one this worker views, else another worker's or process's of that
        name on this node, attached once it is known to fit, else a new one (which replaces a lost one of that name;
        heapmem refuses a name another node holds, with its own message)."""
        if self.heapmem is None:
            raise DeepxError("put: no heapmem role runs on this node; heap tensors need it")
        view = self.heap.get(name)
        if view is not None:
            if tuple(view.shape) != shape or view.dtype != to_numpy(dtype):
                raise DeepxError(f"put: heap tensor '{name}' is {dtype_name(view.dtype)}{list(view.shape)}; it "
                                 f"cannot take {dtype}{list(shape)}")
            return view
        if name in self.ex.tensors:
            raise DeepxError(f"put: '{name}' exists as a stack tensor; delete it before making it heap")
        have = await self.heapmem.ask(Info(name=name, missing_ok=True))  # another worker's or process's here
        if have is None or have["state"] == "lost":
            await self.heapmem.ask(Create(name=name, shape=list(shape), dtype=dtype, owner=owner or self.name,
                                   zero=False, replace_lost=True, device=self.device))
            if not owner or owner == self.name:
                self.heap_held.add(name)
        else:
            if tuple(have["shape"]) != tuple(shape) or have["dtype"] != dtype:
                raise DeepxError(f"put: heap tensor '{name}' is {have['dtype']}{have['shape']}; it cannot take "
                                 f"{dtype}{list(shape)}")
            await self.heapmem.ask(Attach(name=name, holder=self.name))
            self.heap_held.add(name)
        view = self.heap[name] = await self.heapmem.ask(ArrayOf(name=name, device=self.device))
        return view

    def _prepare(self, plan: Plan, bounds: list[Bound], begun: int, heavy: bool = False,
                 transient: set[int] | None = None) -> None:
        """Keep the check of a plan's first run on it, with the state that check read (see Prepared), where that
        check reads nothing but the metas of its tensors and the plan was made on the state the run began on
        (`begun`). `heavy`: it runs on the worker's thread; `transient`: the transposes that become views."""
        if not bounds or not _state_free(bounds) or (plan.seen is not None and plan.seen != begun):
            return
        names = touched_names(bounds)
        more = [n for n in dict.fromkeys((*plan.fetch, *plan.reads)) if n not in names]
        if more:  # a name it reads back or was planned on: its meta is part of the check
            names += tuple(more)
        metas, heap = self.ex.tensors.metas, self.heap
        plan.renames.clear()  # (checked under the names it has)
        plan.prepared = Prepared(names, [metas.get(n) for n in names], [n in heap for n in names], bounds, heavy,
                                 tuple(deletions(bounds)), transient if transient is not None else set())

    def on_heap_gone(self, name: str) -> None:
        """heapmem freed heap tensor `name`: forget its array, so no later program touches that memory."""
        view = self.heap.pop(name, None)
        self.heap_held.discard(name)
        if view is not None and self.ex is not None and self.ex.tensors.get(name) is view:
            self.ex.tensors.pop(name)  # (a plan that names it no longer stands: its heap flag and meta are gone)

    def _fold(self) -> None:
        """Add the clocks of the prepared plans run since the last fold to their ops' statistics: kept as they came
        until the statistics are read (or 64 are waiting), off the path of the program that just ran."""
        unfolded, self._unfolded = self._unfolded, []
        for slots, start, ends in unfolded:
            prev = start
            for (s, nbytes), t in zip(slots, ends):
                s.calls += 1
                s.seconds += t - prev
                s.bytes += nbytes
                prev = t

    def on_op_stats(self) -> dict[str, dict[str, float]]:
        self._fold()
        return {op: {"calls": s.calls, "seconds": s.seconds, "bytes": s.bytes} for op, s in self.op_stats.items()}

    def on_state(self) -> tuple[dict[str, Any], list[str], int]:
        """The shape and dtype of every tensor here, the names of the heap tensors, and the version of both
        (_state): what the scheduler's passes check a program against (a copy: cheaper than the rows of `tensors`,
        asked once per program)."""
        if self.ex is None:
            return {}, [], -1
        return dict(self.ex.tensors.metas), list(self.heap), self._state()
