"""The scheduler: the middle end at run time. It receives programs, makes each a plan (its backward instructions
expanded, the compiler passes run: deepxd/actors/plan.py), places it on an op worker and answers with what
happened; a program that comes again runs by its plan. Programs run one at a time, in arrival order, so that each is
checked against the state the one before it left. Placement: with op-cuda running every program goes to op-cuda,
else to op-cpu; an instruction of an op that only executors of other processes serve, or that names one, goes to
one, the rest of its program in parts around it (_run_placed; deepxd/executors.py). Where other nodes are linked, a
program whose plan is not cached may have instructions placed on their workers (an op only they serve, a small op
on a large heap tensor of another host, an op that their worker of another kind runs clearly faster): the cost
model of deepxd/placement.py, the program run in segments (_run_across).

The passes see the tensors that exist on the worker (asked once per program, and only for a program in which a
value can end, by a deltensor or a second write to a name: without one every pass is a no-op) and the names the
client fetches. The reply always speaks of the client's program: `done`, `error_index` and the times count its
instructions, whatever the passes made of them.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import re
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterator, Mapping, Sequence
from collections.abc import Set as AbstractSet
from typing import TYPE_CHECKING, Any, TypeVar

from deepx_core.cache import Cache
from deepx_core.errors import DeepxError
from deepx_core.ir.effects import SETS, apply_effect, kind_of
from deepx_core.ir.instr import Instr, Param, input_probe, probe, scalar_kinds
from deepx_core.ir.ops import OPS, ProgramError, TensorMeta
from deepx_core.ir.renaming import Inputs, inputs_of, renamed_at
from deepxd.actors.base import Actor, ActorRef, Envelope
from deepxd.actors.messages import (
    Fetch,
    Interleaves,
    Metas,
    Put,
    Run,
    RunPlan,
    RunProgram,
    Stands,
    State,
    Variables,
    WorkerTensors,
)
from deepxd.actors.plan import BackwardSpec, Plan
from deepxd.actors.worker import (
    LONG_PROGRAM,
    REMEMBER_MAX,
    SLICE_S,
    RunResult,
    program_tensor_names,
    small_tensor_names,
)
from deepxd.compiler.analysis import BindMemo, PassContext, default_pair_min, has_ends, named_tensors
from deepxd.compiler.pipeline import (
    DEFAULT_PASSES,
    Rewrites,
    check_passes,
    explain,
    new_context,
    original_error,
    repair,
)
from deepxd.config import Config

if TYPE_CHECKING:
    from deepxd.access import UdpScope
    from deepxd.actors.worker import OpWorker
    from deepxd.compiler.graphs import Bound, GraphPlan
    from deepxd.executors import Executors, Link
    from deepxd.placement import Across

log = logging.getLogger(__name__)

T = TypeVar("T")
#: an answer, or a coroutine that finishes it (where the rest needs an await: a failed program set straight)
Finished = RunResult | Coroutine[Any, Any, RunResult]

#: how many plans the scheduler keeps (a bucket's each count)
PLANS = 256

_VALUE_CATEGORIES = frozenset(("var", "vector", ""))


def _names_of(forward: Sequence[Instr], loss: str, wrt: Sequence[str], grad_loss: str | None) -> set[str]:
    """The tensors a backward's derivation needs the metas of (named by each op's signature)."""
    names = {loss, *wrt, *([grad_loss] if grad_loss else [])}
    for instr in forward:
        names.update(named_tensors(instr))
    return names


def _backward_spec(spec: dict[str, Any]) -> tuple[list[Instr], str, list[str], str | None, str, dict[str, str] | None]:
    """(forward, loss, wrt, grad_loss, prefix, names) of a `backwards` entry of a run request, checked."""
    forward, loss, wrt = spec.get("forward"), spec.get("loss"), spec.get("wrt")
    grad_loss, prefix, names = spec.get("grad_loss"), spec.get("prefix", "g_"), spec.get("names")
    if (not isinstance(forward, list) or not all(isinstance(i, Instr) for i in forward) or not isinstance(loss, str)
            or not isinstance(wrt, list) or not all(isinstance(w, str) for w in wrt)
            or not (grad_loss is None or isinstance(grad_loss, str)) or not isinstance(prefix, str)
            or not (names is None or (isinstance(names, dict) and all(isinstance(v, str) for v in names.values())))):
        raise DeepxError("malformed request: it needs forward (instructions), loss (a name), wrt (names), prefix, "
                         "and optionally grad_loss and names")
    return forward, loss, wrt, grad_loss, prefix, names


def _renamed(program: list[Instr], grads: dict[str, str], names: dict[str, str],
             metas: dict[str, Any]) -> tuple[list[Instr], dict[str, str]]:
    """The backward program with each gradient under the name the client chose for it (names: wrt -> name)."""
    if set(names) != set(grads):
        raise DeepxError(f"names must give one name for each of wrt ({sorted(grads)}), not {sorted(names)}")
    mapping = {grads[w]: names[w] for w in grads}
    if len(set(mapping.values())) != len(mapping):
        raise DeepxError("names: two gradients cannot take the same name")
    taken = [n for n in mapping.values() if n in metas or n in grads]
    if taken:
        raise DeepxError(f"names: {taken[0]!r} is a tensor of the forward graph")

    def param(p: Param) -> Param:
        if p.category == "tensor" and p.value in mapping:
            return p._replace(value=mapping[p.value])  # type: ignore[arg-type]
        if p.category == "listtensor" and isinstance(p.value, tuple) and any(v in mapping for v in p.value):
            return p._replace(value=tuple(mapping.get(v, v) for v in p.value))  # type: ignore[arg-type]
        return p

    out = [i._replace(args=tuple(map(param, i.args)), returns=tuple(map(param, i.returns))) for i in program]
    return out, dict(names)


#: per op, whether each arg may name a variable: a string there is a variable's name unless the arg takes a string
#: (a reduction's "mean", a fused expression) or any value (as ops.py's binder reads them; None: the op is unknown)
_LITERAL_STRINGS: dict[str, tuple[bool, ...] | None] = {}


def _reads_by_name(op_name: str) -> tuple[bool, ...] | None:
    known = _LITERAL_STRINGS.get(op_name, False)
    if known is False:
        op = OPS.get(op_name)
        known = _LITERAL_STRINGS[op_name] = None if op is None else tuple(
            a.vtype not in ("str", "any") for a in op.args)
    return known  # type: ignore[return-value]


def _names_variables(program: Sequence[Instr]) -> bool:
    """Whether the program sets variables or may read one by name (a string where a value goes): then the passes
    need the worker's variables. A plain loop: this runs over every instruction of every program."""
    for instr in program:
        if kind_of(instr) is SETS:
            return True
        for p in instr.args:
            if type(p.value) is str and p.category in _VALUE_CATEGORIES:  # a string where a value goes: look closer
                if _variables_read(instr):
                    return True
                break
    return False


def _variables_read(instr: Instr) -> list[str]:
    """The names of the variables (and vectors) that `instr` reads by name."""
    by_name = _reads_by_name(instr.name) or ()
    return [p.value for k, p in enumerate(instr.args)  # type: ignore[misc]
            if type(p.value) is str and p.category in _VALUE_CATEGORIES and (k >= len(by_name) or by_name[k])]


def _set_again(prefix: Sequence[Instr], forward: Sequence[Instr]) -> str | None:
    """A variable that the forward reads by name and the instructions before the backward (`prefix`) set after a
    forward instruction that reads it ran (or when it ran in an earlier program): its derivation would take the new
    value, not the one the forward used. None where there is none."""
    readers: dict[str, list[Instr]] = {}
    for instr in forward:
        for v in _variables_read(instr):
            readers.setdefault(v, []).append(instr)
    if not readers:
        return None
    last: dict[str, int] = {}
    for k, instr in enumerate(prefix):
        for name in apply_effect(instr).sets:
            last[name] = k
    for v, users in readers.items():
        if v in last and not all(u in prefix[last[v] + 1:] for u in users):
            return v
    return None


def _cancelled_unrun() -> RunResult:
    return RunResult(error="instruction 1: cancelled: the client's connection ended before the program ran",
                     error_index=0, t0=time.time(), cancelled=True)


def _backward_key(spec: dict[str, Any]) -> tuple[str, ...] | None:
    """What the steps that carry a backward request are counted by (see Scheduler._apart): the tensors it
    differentiates, which a loop names alike every step (its parameters) while the names of its temporaries may come
    from the pool in another order; None where they are malformed (refused on the way)."""
    wrt = spec.get("wrt")
    if type(wrt) is not list or not all(type(w) is str for w in wrt):
        return None
    return tuple(sorted(wrt))


def _derived_key(forward: Sequence[Instr], loss: str, wrt: Sequence[str], grad_loss: str | None, prefix: str,
                 names: dict[str, str] | None) -> tuple[Any, ...]:
    return (*probe(forward), loss, tuple(wrt), grad_loss, prefix, tuple(names.items()) if names else None)


class _Derived:
    """A backward program derived before (Scheduler._derive): its request, the metas it was derived against, the
    program and the gradients' names; `renamed` takes a forward that is its own with its inputs under other names."""

    __slots__ = ("fixed", "forward", "grads", "inputs", "kinds", "loss", "metas", "names", "program", "wrt")

    def __init__(self, forward: list[Instr], loss: str, wrt: Sequence[str], grad_loss: str | None,
                 names: dict[str, str] | None, metas: dict[str, Any], program: list[Instr],
                 grads: dict[str, str]) -> None:
        self.forward, self.kinds, self.loss, self.wrt = forward, scalar_kinds(forward), loss, list(wrt)
        self.names = dict(names) if names else None
        self.metas, self.program, self.grads = dict(metas), program, dict(grads)
        self.inputs: Inputs | bool | None = False  # worked out at the first renamed look
        self.fixed = (loss, *([grad_loss] if grad_loss else []), *self.grads.values())  # names that stay

    def renamed(self, forward: Sequence[Instr], loss: str, wrt: Sequence[str], names: dict[str, str] | None,
                metas: dict[str, Any]) -> bool:
        """Whether `forward` (with loss, wrt, names, and the metas of what it names) is this one's with its inputs
        under other names, the metas under those names the same: then it takes the names as its own, and its
        program reads them."""
        from deepx_core.ir.instr import same_program

        inputs = self.inputs
        if inputs is False:
            inputs = self.inputs = inputs_of([self.forward], [self.program], self.fixed)
        if inputs is None or loss != self.loss or len(wrt) != len(self.wrt):
            return False
        assert isinstance(inputs, Inputs)
        mapping = inputs.mapping([forward])
        if not mapping:
            return False
        known = renamed_at(self.forward, inputs.where(inputs.at[0], mapping), mapping)
        if (not same_program(forward, known, self.kinds) or list(wrt) != [mapping.get(w, w) for w in self.wrt]
                or (names or None) != ({mapping.get(w, w): g for w, g in self.names.items()} if self.names else None)
                or metas != {mapping.get(n, n): m for n, m in self.metas.items()}):
            return False
        self.forward, self.wrt, self.metas = known, list(wrt), dict(metas)
        self.names = dict(names) if names else None
        self.grads = {mapping.get(w, w): g for w, g in self.grads.items()}
        self.program = renamed_at(self.program, inputs.where(inputs.more[0], mapping), mapping)
        inputs.renamed(mapping)
        return True


class _Steps:
    """The steps carrying one backward request's parameters (see Scheduler._apart): how many in a row no plan
    matched, and whether they run in parts."""

    __slots__ = ("apart", "misses")

    def __init__(self) -> None:
        self.misses = 0
        self.apart = False


class _Parts:
    """A program's result put together from the results of its parts, run one after another (Scheduler._run_apart):
    counts, times (on the first part's clock), output, and the fetched tensors of the last."""

    def __init__(self) -> None:
        self.result = RunResult(t0=time.time())
        self.result.raw_times = []

    def add(self, part: RunResult, start: int, length: int, one: bool = False) -> bool:
        """The result of the part made of the program's instructions start..start+length (`one`: of the single
        instruction at `start`, which it stands for whole: a backward); whether it ran whole."""
        out = self.result
        shift = (part.t0 - out.t0) * 1e6
        times = [t + shift for t in part.times_us]
        if one:
            if part.error:
                part.error = original_error(part.error, [start])
            if times:
                times = [times[0], times[-1]] if not part.error else []
            done = 1 if not part.error else 0
        else:
            if part.error:
                part.error = original_error(part.error, range(start, start + length))
            done = part.done
        out.raw_times.extend(times[: 2 * done])
        out.output.extend(part.output)
        out.tensors = part.tensors
        out.done = start + done
        if part.error:
            out.error, out.error_index = part.error, start + (0 if one else part.error_index)
            out.cancelled = part.cancelled
            if part.failed_at >= 0:
                out.failed_at = part.failed_at + shift
            out.done = out.error_index
            return False
        return True


class Scheduler(Actor):
    role = "scheduler"

    def __init__(self, workers: dict[str, ActorRef[OpWorker]], name: str = "scheduler", *, config: Config | None = None,
                 udp_scope: UdpScope | None = None, executors: Executors | None = None,
                 across: Across | None = None, node_id: str = "") -> None:
        super().__init__(name)
        self.workers = workers
        self.executors = executors  # executors of other processes, which instructions may go to (_run_placed)
        self.across = across  # other nodes' workers, which instructions may go to (_run_across); None: one node
        self.node_id = node_id
        self.udp_scope = udp_scope  # what deepxIR over UDP may name (deepxd/access.py); None: UDP is off
        self.passes: list[str] = check_passes(config.passes) if config is not None else list(DEFAULT_PASSES)
        self.fuse_min_elements = config.fuse_min_elements if config is not None else 0
        # the plans: every program that may come again, made runnable once (deepxd/actors/plan.py), by probe(); a
        # bucket holds the plans of one program for the states it came on
        self.plans: Cache[tuple[Any, ...], list[Plan]] = Cache("scheduler.plans", PLANS, per_key=8, owner=name)
        # the same plans by input_probe(): a program that is one of them with its inputs under other names (a batch
        # held among others) runs by it, under those names (Plan.renamed)
        self.renamable: Cache[tuple[Any, ...], list[Plan]] = Cache("scheduler.renamable", PLANS, per_key=8,
                                                                    owner=name, counted=False)
        # what a plan is made from: checks by structure (the passes check programs too), the passes' rewrites by
        # structure (a program under new names), and derived backward programs by forward graph (_derive)
        self.binds = BindMemo(owner=name)
        self.rewrites = Rewrites(self.passes, max_len=REMEMBER_MAX, owner=name)
        self.programs = 0
        self.instructions = 0
        self.failed = 0
        self.busy_s = 0.0
        self.rewritten = 0  # programs the passes changed
        self.eliminated = 0  # instructions they removed
        self.graphs: dict[str, GraphPlan] = {}  # stored graph name -> its plan (deepxd/compiler/graphs.py)
        self.replays = 0
        # backward programs derived before (_derive), by their request (_derived_key), and the same by input_probe
        # (a forward under new names for its inputs: a batch held among others)
        self.backwards: Cache[Any, list[_Derived]] = Cache("scheduler.backwards", 64, per_key=4, owner=name)
        self.backwards_renamed: Cache[Any, list[_Derived]] = Cache("scheduler.backwards_renamed", 64, per_key=4,
                                                                   owner=name, counted=False)
        self.backward_hits = 0
        self.backward_misses = 0
        # per backward request's parameters (_backward_key): [steps in a row carrying it that were no plan's,
        # whether its steps go in parts] (see _apart)
        self.steps: Cache[tuple[str, ...], _Steps] = Cache("scheduler.steps", 64, owner=name)
        self.plan_hits = 0  # runs of a plan from the cache
        self.renamed = 0  # plans from the cache that took new names for their inputs (then ran, or were stale)
        self.plan_misses = 0  # plans made
        self.stale = 0  # plans from the cache that did not stand on the worker's state
        self.now_hits = 0  # runs and replays taken by now_run and now_replay (the embedded daemon's, no loop step)
        self.apart = 0  # steps run in parts (_run_apart)
        self._cancel: Callable[[], bool] | None = None  # the running program's (on_run)
        self._beside: asyncio.Task[None] | None = None  # handling small programs beside a long one (_serving)
        self._passes_busy = False  # a long program's passes run on a thread (the memos are theirs meanwhile)
        # the step _serving awaits: (its end, the names a program beside it must not name, the worker)
        self._step: tuple[asyncio.Future[None], AbstractSet[str] | None, ActorRef[OpWorker]] | None = None
        self.beside = 0  # programs handled beside a long one

    async def on_run(self, program: Sequence[Instr], fetch: Sequence[str] = (),
                     backwards: Sequence[dict[str, Any]] | None = None,
                     cancel: Callable[[], bool] | None = None, origin: str = "") -> RunResult:
        """Run `program`; `origin` "udp": a UDP sender's, which may name only what UDP made or was shared (checked
        here, in the message that runs it, so that no other program comes between the check and the run)."""
        try:
            return await self._run_checked(program, fetch, backwards, cancel, origin)
        finally:
            self._cancel = None  # holds the connection's reader and writer

    async def _run_checked(self, program: Sequence[Instr], fetch: Sequence[str],
                           backwards: Sequence[dict[str, Any]] | None, cancel: Callable[[], bool] | None,
                           origin: str) -> RunResult:
        scope = self.udp_scope
        if scope is None or origin != "udp":
            self._taken_from_udp(program)  # (its backwards expanded take back their gradients where expanded)
            # (a peer's segment is placed here: it goes no further)
            return await self._run_one(program, fetch, backwards, cancel, across=origin != "peer")
        for i, instr in enumerate(program):
            try:
                refused = await scope.refuse(instr)
            except Exception as e:  # the check could not be made (a worker restarting): refused, never let through
                refused = f"{instr.name}: could not check the tensors it names against what UDP may reach: {e}"
            if refused is not None:
                self.failed += 1
                return RunResult(error=f"instruction {i + 1}: {refused}", error_index=i, t0=time.time())
        result = await self._run_one(program, fetch, backwards, cancel)
        for instr in program[:result.done]:
            scope.ran(instr)
        return result

    def _taken_from_udp(self, program: Sequence[Instr], names: Sequence[str] = ()) -> None:
        """What a native client's program (as it goes to the worker: backwards expanded, a replay bound) writes is
        no longer UDP's (deepxd/access.py); nothing to do while UDP holds no tensor."""
        if self.udp_scope:
            self.udp_scope.written_by_another(program)
            self.udp_scope.taken_back(names)

    async def _run_one(self, program: Sequence[Instr], fetch: Sequence[str] = (),
                       backwards: Sequence[dict[str, Any]] | None = None,
                       cancel: Callable[[], bool] | None = None, across: bool = False) -> RunResult:
        """Run `program`: its plan from the cache where it stands, else a plan made for the worker's state as it is.
        `backwards`: the SDK's recorded `loss.backward()` calls, each a `backward` instruction of the program (at its
        `index`) with what on_backward takes: it is expanded there, in place, into the backward program derived from
        its forward graph, so that a training step (forward, backward, optimizer, the loss read back) is one program,
        through the passes as a whole. `cancel`: whether the asker went away (its client's connection ended): a
        program still queued then is dropped, a running one stops at an instruction boundary (the worker asks it
        between slices). `across`: it may be placed on other nodes' workers (_run_across)."""
        if cancel is not None and cancel():
            self.failed += 1
            return _cancelled_unrun()
        self._cancel = cancel  # what the run sites below pass on (each on_run sets its own)
        t0 = time.perf_counter()
        executors = self.executors
        places: list[Link | None] | None = None
        if executors and executors.claims(program):  # an instruction goes to an executor of another process
            try:
                places = executors.placement(program)
            except ProgramError as e:
                self.failed += 1
                return RunResult(error=str(e), error_index=e.index, t0=time.time())
        if places is None:
            hit = await self._run_cached(program, fetch, backwards)
            if hit is not None:
                return self._counted(hit, t0)
            # other nodes linked: the program may go to them in part (a step of another's beside it: here)
            if across and self.across is not None and not backwards and self._step is None and self.across.active():
                placed = await self._run_across(program, fetch)
                if placed is not None:
                    return self._counted(placed, t0)
        marks = {}
        for spec in backwards or ():
            k = spec.get("index")
            if type(k) is not int or not 0 <= k < len(program) or program[k].name != "backward":
                self.failed += 1
                return RunResult(error=f"backward: index {k!r} is not a backward instruction of the program",
                                 error_index=0, t0=time.time())
            marks[k] = spec
        for i, instr in enumerate(program):
            if instr.name not in OPS and i not in marks:
                self.failed += 1
                gone = executors.missing(instr.name) if executors is not None else ""
                return RunResult(error=f"instruction {i + 1}: op '{instr.name}' not found{gone}", error_index=i,
                                 t0=time.time())
        refused = executors.refused(program) if executors is not None and not executors else None
        if refused is not None:  # it names an executor, and none is registered
            self.failed += 1
            return RunResult(error=str(refused), error_index=refused.index, t0=time.time())
        worker = self._place(program)
        t0 = time.perf_counter()
        if places is not None:
            result = await self._run_placed(worker, program, fetch, marks, places)
        elif marks and self._apart(marks):
            result = await self._run_apart(worker, program, fetch, marks)
        else:
            result = await self._run_new(worker, program, fetch, marks)
        return self._counted(result, t0)

    def _counted(self, result: RunResult, t0: float) -> RunResult:
        self.busy_s += time.perf_counter() - t0
        self.programs += 1
        self.instructions += result.done
        self.failed += bool(result.error)
        return result

    # -- plans
    async def _run_cached(self, program: Sequence[Instr], fetch: Sequence[str],
                          backwards: Sequence[dict[str, Any]] | None) -> RunResult | None:
        """The program run by its plan from the cache, the newest of its plans that stands on the worker's state
        (each matching plan asked in turn: one that does not stand ran nothing); None where none does."""
        key = probe(program)
        for plan in itertools.chain(self._matching(program, fetch, backwards, key),
                                    self._under_new_names(program, fetch, backwards, key)):
            result = await self._run_plan(plan, program)
            if result is None:
                self.stale += 1
                continue
            self._hit(key, plan, result)
            return result
        self.plans.miss()
        return None

    def _matching(self, program: Sequence[Instr], fetch: Sequence[str], backwards: Sequence[dict[str, Any]] | None,
                  key: tuple[Any, ...]) -> Iterator[Plan]:
        """The plans of `program` under its own names, newest first; one made before native kernels came or went is
        forgotten."""
        for plan in reversed(self.plans.bucket(key)):
            if not plan.matches(program, fetch, backwards):
                continue
            if plan.pair_min is not None and plan.pair_min != default_pair_min():
                self.plans.discard(key, plan)
                continue
            yield plan

    def _under_new_names(self, program: Sequence[Instr], fetch: Sequence[str],
                         backwards: Sequence[dict[str, Any]] | None, key: tuple[Any, ...]) -> Iterator[Plan]:
        """The plans that `program` is with its inputs under other names, each renamed so (Plan.renamed) and kept
        under `key` from then on, the newest first: the second look, after the plans under `key` missed."""
        look = input_probe(program)
        for plan in reversed(list(self.renamable.bucket(look))):
            before = probe(plan.program)
            if not plan.renamed(program, fetch, backwards):
                continue
            if plan.pair_min is not None and plan.pair_min != default_pair_min():
                self.renamable.discard(look, plan)
                continue
            self.renamed += 1
            if before != key:  # (its first or last instruction names a renamed input)
                self.plans.discard(before, plan)
                self.plans.add(key, plan)
            yield plan

    def _hit(self, key: tuple[Any, ...], plan: Plan, result: RunResult) -> None:
        """A plan from the cache ran: counted; where it failed, the program's plans go (the next run takes the whole
        path)."""
        self.plans.hit(key)
        self.plan_hits += 1
        if result.error:
            self.plans.pop(key)
            self.renamable.discard(input_probe(plan.program), plan)
        for k in plan.step_keys:  # its steps repeat: whole (see _apart)
            counts = self.steps.peek(k)
            if counts is not None:
                counts.misses = 0

    async def _run_plan(self, plan: Plan, program: Sequence[Instr]) -> RunResult | None:
        """Run `plan` on its worker, its result told of `program` (the client's); None where it does not stand (the
        worker ran nothing)."""
        if plan.expanded is not None:  # the gradients of its backwards (on_run took back the rest)
            self._taken_from_udp(plan.expanded)
        result: RunResult | None = await self._serving(plan.worker.ask(RunPlan(plan=plan, cancel=self._cancel)),
                                                       plan.worker)
        if result is None:
            return None
        done = self._plan_ran(plan, program, result)
        return done if isinstance(done, RunResult) else await done

    def _plan_ran(self, plan: Plan, program: Sequence[Instr], result: RunResult) -> Finished:
        """The worker's result of a plan, told of `program`: a coroutine to await where a rewritten program failed
        part-way (the tensors are set straight as `program` would have left them)."""
        plan.runs += 1
        if plan.origins is not None:
            if result.error:
                return self._plan_repaired(plan, program, result)
            result = self._compiled_ok(plan.planned, plan.sent, plan.origins, result)
        return self._plan_mapped(plan, program, result)

    async def _plan_repaired(self, plan: Plan, program: Sequence[Instr], result: RunResult) -> RunResult:
        assert plan.origins is not None and plan.ctx is not None
        result = await self._compiled_result(plan.worker, plan.planned, plan.sent, plan.fetch, plan.origins, plan.ctx,
                                             result)
        return self._plan_mapped(plan, program, result)

    def _plan_mapped(self, plan: Plan, program: Sequence[Instr], result: RunResult) -> RunResult:
        if plan.where is not None:
            result = self._map_expanded(result, program, plan.where, len(program), None)
        return result

    async def _run_new(self, worker: ActorRef[OpWorker], program: Sequence[Instr], fetch: Sequence[str],
                       marks: dict[int, dict[str, Any]], passes: bool = True) -> RunResult:
        """Make a plan for `program` on the worker's state as it is, run it, and keep it where it may come again.
        A plan the worker finds made for another state (a put came between the look and the run) is made again;
        the third time on whatever state the run finds, as the worker's check allows. `passes`: False for a program
        the passes made already (a stored graph's replay)."""
        for attempt in range(3):
            made = await self._make_plan(worker, program, fetch, marks, passes, loose=attempt == 2)
            if isinstance(made, RunResult):  # a backward that could not be derived
                return made
            plan, keep = made
            self.plan_misses += 1
            result = await self._run_plan(plan, program)
            if result is not None:
                break
            self.stale += 1
        else:
            raise AssertionError("a plan made on no state always runs")  # (loose: its check decides)
        if keep and not result.error and plan.prepared is not None and plan.runs == 1:
            if plan.ctx is not None:  # what a repair reads (the metas before) of the tensors the plan reads only:
                # the passes' context holds every tensor's meta and their work on the program
                p = plan.prepared
                plan.ctx = new_context({n: m for n, m in zip(p.names, p.metas) if m is not None}, fetch=plan.fetch,
                                       keep=[n for n, h in zip(p.names, p.heaped) if h], cache=self.binds)
            self.plans.add(probe(program), plan)
            self.renamable.add(input_probe(program), plan)
        return result

    async def _make_plan(self, worker: ActorRef[OpWorker], program: Sequence[Instr], fetch: Sequence[str],
                         marks: dict[int, dict[str, Any]], passes: bool, loose: bool
                         ) -> tuple[Plan, bool] | RunResult:
        """A plan for `program` on the worker's state as it is now: its backwards expanded (_expand), the passes
        run; and whether it may be kept (it names no variable, and what it was made of read only the metas of
        tensors). A RunResult where a backward could not be derived: the instructions before it ran, the error
        names it. `loose`: planned on no particular state (the worker's check decides)."""
        program = program if type(program) is list else list(program)
        fetch = tuple(fetch)
        ctx: PassContext | None = None
        seen: int | None = None
        expanded: list[Instr] | None = None
        where: list[int] | None = None
        keep = len(program) <= REMEMBER_MAX
        specs: tuple[BackwardSpec, ...] = ()
        if marks:
            ctx, seen = await self._context(worker, program, fetch, scan=False)
            found = await self._expand(worker, program, fetch, marks, ctx)
            if isinstance(found, RunResult):
                return found
            expanded, where, specs, remembered = found
            keep = keep and remembered
        planned = expanded if expanded is not None else program
        sent, origins = planned, None
        beside = self._beside is not None and asyncio.current_task() is self._beside
        if passes and self.passes and len(planned) > 1 and has_ends(planned):
            if beside and self._passes_busy:  # the memos are not for two threads: no passes beside the passes
                keep = False
            else:
                if ctx is None:
                    ctx, seen = await self._context(worker, planned, fetch)
                elif not ctx.variables and not ctx.vectors and _names_variables(planned):
                    ctx.variables, ctx.vectors = await self._variables(worker)
                rewritten = await self._rewrite(worker, planned, ctx)
                if rewritten is None:  # the asker went while the passes ran
                    return _cancelled_unrun()
                if len(rewritten) != len(planned) or any(a is not b for a, b in zip(rewritten, planned)):
                    sent, origins = rewritten, ctx.origins
        keep = keep and not _names_variables(program)
        reads: tuple[str, ...] = ()
        if ctx is not None and keep:  # what the derivation and the passes read: the metas of what the program and
            # its expansion name, and of what each backward's derivation reads
            seen_names: dict[str, None] = {}
            for part in (program, planned) if planned is not program else (program,):
                for instr in part:
                    seen_names.update(dict.fromkeys(named_tensors(instr)))
            for _, loss, wrt, grad_loss, _, _, forward, _ in specs:
                seen_names.update(dict.fromkeys(_names_of(forward, loss, wrt, grad_loss)))
            reads = tuple(seen_names)
        plan = Plan(program, fetch, specs, worker, sent, expanded=expanded, where=where, origins=origins, ctx=ctx,
                    reads=reads, seen=None if loose else seen,
                    step_keys=tuple(k for k in map(_backward_key, marks.values()) if k is not None))
        return plan, keep

    async def _rewrite(self, worker: ActorRef[OpWorker], program: list[Instr], ctx: PassContext) -> list[Instr] | None:
        """The passes over `program` (from the rewrite memo where it came before under other names); a long one's on
        a thread, small programs served beside meanwhile. None where the asker went away meanwhile."""
        try:
            if len(program) > LONG_PROGRAM:  # O(n) and more: on a thread
                # a program beside the passes must leave the metas they plan on as they were
                names = await asyncio.to_thread(program_tensor_names, program, ())
                self._passes_busy = True
                try:
                    rewritten: list[Instr] = await self._serving(
                        asyncio.to_thread(self.rewrites.run, program, ctx), worker, names)
                finally:
                    self._passes_busy = False
                if self._cancel is not None and self._cancel():  # the passes took seconds: the asker may be gone
                    return None
                return rewritten
            return self.rewrites.run(program, ctx)
        except Exception:  # a pass must never cost the client its program
            log.exception("compiler passes failed; running the program as sent")
            ctx.origins = list(range(len(program)))
            return program

    # -- the last programs again, with no coroutine
    def now_run(self, program: Sequence[Instr], fetch: Sequence[str] = (),
                backwards: Sequence[dict[str, Any]] | None = None, cancel: Callable[[], bool] | None = None,
                origin: str = "") -> Finished | None:
        """on_run for a program whose plan stands, with no coroutine, on a thread that stands in for the loop's
        (LoopThread.now: the embedded daemon's training steps, without the event loop's tasks and hand-offs). None,
        with nothing run and nothing counted, where on_run must answer: this scheduler or the worker busy or with
        messages waiting, no plan that matches and stands, a plan the worker cannot run inline (OpWorker.now_stands).
        Else on_run's answer, or a coroutine that finishes it (a rewritten program that failed part-way: its tensors
        are set straight). A program that may be cancelled is on_run's; so is a UDP sender's (`origin` "udp") that
        names anything UDP's scope must look up (UdpScope.reaches): one that names only UDP's tensors runs here, and
        its transport tells the scope what it did (the UDP server's quick way)."""
        if not self.plans or not self.idle() or cancel is not None:
            return None
        if self.executors and self.executors.claims(program):  # (on_run places it)
            return None
        if origin:
            scope = self.udp_scope
            if origin != "udp" or scope is None or backwards or not all(map(scope.reaches, program)):
                return None
        key = probe(program)
        plan = self._standing(program, fetch, backwards, key)
        if plan is None:
            return None
        return self.now("run", self._now_run, plan, program, origin, key)

    def _standing(self, program: Sequence[Instr], fetch: Sequence[str],
                  backwards: Sequence[dict[str, Any]] | None, key: Any = None) -> Plan | None:
        """The newest plan of `program` (`key`: its probe, where known) that its worker would run inline now
        (now_stands), found without running or counting anything."""
        worker = self._place(program)  # every plan's (a session's tensors live on one worker)
        for plan in reversed(self.plans.bucket(probe(program) if key is None else key)):
            if plan.worker is not worker or not plan.matches(program, fetch, backwards):
                continue
            if plan.pair_min is not None and plan.pair_min != default_pair_min():
                return None
            if worker.now(Stands(plan)):
                return plan
        for plan in self._under_new_names(program, fetch, backwards, probe(program) if key is None else key):
            if plan.worker is worker and worker.now(Stands(plan)):
                return plan
            break  # (on_run runs it, or the next)
        return None

    def _now_run(self, plan: Plan, program: Sequence[Instr], origin: str, key: Any) -> Finished:
        t0 = time.perf_counter()
        self.now_hits += 1
        if self.udp_scope:  # what it writes is no longer UDP's
            if not origin:  # (a UDP sender's names only UDP's tensors, and stays so)
                self._taken_from_udp(program)
            if plan.expanded is not None:
                self._taken_from_udp(plan.expanded)
        result = plan.worker.now(RunPlan(plan))
        assert result is not None  # (now_stands said it would run)
        done = self._plan_ran(plan, program, result)
        if not isinstance(done, RunResult):
            return self._finish_counted(done, t0, plan)
        self._hit(key, plan, done)
        return self._counted(done, t0)

    async def _finish_counted(self, done: Coroutine[Any, Any, RunResult], t0: float, plan: Plan) -> RunResult:
        result = await done
        self._hit(probe(plan.program), plan, result)
        return self._counted(result, t0)

    # -- a step that does not repeat: in parts
    def _apart(self, marks: dict[int, dict[str, Any]]) -> bool:
        """Whether a program with backward instructions, which no plan matched, runs in parts (_run_apart). A step
        that repeats (the same program, or new numbers in its optimizer updates) runs whole, through the passes
        once, its plan reused at every step; a step with a number of its own that changes every step (a monitor of
        the learning rate) would go through the passes and the worker's check whole at every step. So after two
        steps in a row carrying one backward request that no plan matched, that request's steps run in parts,
        whose backward repeats: its derived program's plan is reused, and only the parts around it are planned
        afresh. Once the parts all repeat, the steps run whole again."""
        apart = False
        for spec in marks.values():
            key = _backward_key(spec)
            if key is None:
                continue
            counts = self.steps.get(key)
            if counts is None:  # the first step with it
                self.steps.put(key, _Steps())
            elif counts.apart:
                apart = True
            else:
                counts.misses += 1
                if counts.misses >= 2:  # from the next step on
                    counts.apart = True
                    log.debug("scheduler: a step whose program does not repeat: its backward runs apart from here")
        return apart

    async def _run_apart(self, worker: ActorRef[OpWorker], program: Sequence[Instr], fetch: Sequence[str],
                         marks: dict[int, dict[str, Any]]) -> RunResult:
        """`program` run in parts, each by its plan: the instructions before each backward, the backward (derived
        from its forward as on_backward derives it, against the metas the part before it left), and the
        instructions after the last. The result speaks of `program`. Where every part came by a plan from the
        cache, the steps repeat: the next runs whole."""
        self.apart += 1
        parts = _Parts()
        repeated = True
        start, end = 0, len(program)  # (the last part takes `fetch`: a backward where the program ends with one)
        for i in [*sorted(marks), end]:
            if i > start:
                result, hit = await self._run_part(worker, program[start:i], fetch if i == end else ())
                repeated = repeated and hit
                if not parts.add(result, start, i - start):
                    return parts.result
            if i == len(program):
                break
            if self._cancel is not None and self._cancel():
                parts.add(self._cancelled(), i, 1)
                return parts.result
            result, hit = await self._run_backward(worker, program, i, marks[i], fetch if i == end - 1 else ())
            repeated = repeated and hit
            if not parts.add(result, i, 1, one=True):
                return parts.result
            start = i + 1
        if repeated:
            for spec in marks.values():
                key = _backward_key(spec)
                counts = self.steps.peek(key) if key is not None else None
                if counts is not None:
                    counts.misses, counts.apart = 0, False
        parts.result.done = len(program)
        return parts.result

    @staticmethod
    def _cancelled() -> RunResult:
        return RunResult(error="instruction 1: cancelled: the client's connection ended (the instructions before it "
                               "ran)", error_index=0, t0=time.time(), cancelled=True)

    async def _run_part(self, worker: ActorRef[OpWorker], part: Sequence[Instr], fetch: Sequence[str]
                        ) -> tuple[RunResult, bool]:
        """A part of a program run by its plan: (its result, whether the plan came from the cache)."""
        hit = await self._run_cached(part, fetch, None)
        if hit is not None:
            return hit, True
        return await self._run_new(worker, part, fetch, {}), False

    async def _run_backward(self, worker: ActorRef[OpWorker], program: Sequence[Instr], i: int, spec: dict[str, Any],
                            fetch: Sequence[str]) -> tuple[RunResult, bool]:
        """The backward instruction at `i` run on its own: derived against the metas its forward's tensors have now,
        then run by its plan."""
        try:
            forward, loss, wrt, grad_loss, prefix, names = _backward_spec(spec)
            variables: tuple[dict[str, Any], dict[str, tuple[Any, ...]]] | tuple[()] = ()
            if _names_variables(forward):
                again = _set_again(program[:i], forward)
                if again is not None:
                    raise DeepxError(f"variable '{again}', which its forward reads by name, is set again between "
                                     f"the forward and the backward: the gradient would take the new value; "
                                     f"set it after the backward")
                variables = await self._variables(worker)
            metas = await worker.ask(Metas(names=sorted(_names_of(forward, loss, wrt, grad_loss))))
            derived, _ = self._derive(forward, loss, wrt, grad_loss, prefix, metas, names, *variables)
        except DeepxError as e:
            return RunResult(error=f"instruction 1: backward: {e}", error_index=0, t0=time.time()), False
        self._taken_from_udp(derived)
        result, hit = await self._run_part(worker, derived, fetch)
        if result.error:  # told of the one instruction it stands for
            result.error = original_error(result.error, [0] * len(derived))
        return result, hit

    # -- instructions placed on executors of other processes (deepxd/executors.py, docs/executor.md)
    async def _run_placed(self, worker: ActorRef[OpWorker], program: Sequence[Instr], fetch: Sequence[str],
                          marks: dict[int, dict[str, Any]], places: list[Link | None]) -> RunResult:
        """`program`, of which the instructions at `places` go to executors: checked whole first (Executors.check),
        then run in parts, one after another: the instructions between two placed ones on the worker, each part by
        its plan; each placed one on its executor, its inputs taken from the worker and its results put there (small
        programs that name none of this one's tensors are served meanwhile); each backward as _run_apart runs it.
        The result speaks of `program`."""
        assert self.executors is not None
        refused = await self.executors.check(program, fetch, min(marks, default=len(program)), worker)
        if refused is not None:
            return refused
        parts = _Parts()
        avoid = program_tensor_names(program, fetch)
        start, end = 0, len(program)
        for i in [*(k for k in range(end) if places[k] is not None or k in marks), end]:
            if i > start:
                result, _ = await self._run_part(worker, program[start:i], ())
                if not parts.add(result, start, i - start):
                    return parts.result
            if i == end:
                break
            if self._cancel is not None and self._cancel():
                parts.add(self._cancelled(), i, 1)
                return parts.result
            link = places[i]
            if link is None:
                result, _ = await self._run_backward(worker, program, i, marks[i], ())
            else:
                result = await self._serving(self.executors.run(link, program[i], worker, self._cancel), worker,
                                             avoid)
            if not parts.add(result, i, 1, one=True):
                return parts.result
            start = i + 1
        out = parts.result
        out.done = end
        if fetch:
            try:
                out.tensors = await worker.ask(Fetch(names=list(fetch)))
            except DeepxError as e:
                out.error, out.error_index = f"fetch: {e}", end
        return out

    # -- instructions placed on other nodes' workers (deepxd/placement.py, docs/cluster.md)
    async def _run_across(self, program: Sequence[Instr], fetch: Sequence[str]) -> RunResult | None:
        """`program` where the cost model places some of it on other nodes (Across.plan), run in segments one after
        another: this node's by their plans, as _run_apart runs parts; each peer's sent over its link, its results
        brought back where read here or later (small programs that name none of this one's tensors are served
        meanwhile). None, with nothing run, where everything stays here. The result speaks of `program`, with
        `placement`: each instruction's node and worker, and what moved."""
        assert self.across is not None
        worker = self._place(program)
        try:
            placed = await self.across.plan(program, fetch, worker)
        except DeepxError as e:  # (the plane, say, unreadable: here, as on one node)
            log.warning("scheduler: could not place a program across nodes, running it here: %s", e)
            return None
        if placed is None:
            return None
        self.across.placed += 1
        parts = _Parts()
        avoid = program_tensor_names(program, fetch)
        stopped = len(placed.segments)
        for k, seg in enumerate(placed.segments):
            if self._cancel is not None and self._cancel():
                parts.add(self._cancelled(), seg.start, 1)
                stopped = k
                break
            if seg.node == placed.here:
                result, _ = await self._run_part(worker, program[seg.start:seg.end], ())
            else:
                result = await self._serving(self.across.run_segment(placed, seg, worker, self._cancel), worker,
                                             avoid)
            if not parts.add(result, seg.start, seg.end - seg.start):
                stopped = k
                break
        out = parts.result
        if out.error:  # what the peers kept for later segments goes (small programs served meanwhile)
            await self._serving(self.across.clean(placed, stopped), worker)
        else:
            out.done = len(program)
            if fetch:
                try:
                    out.tensors = await worker.ask(Fetch(names=list(fetch)))
                except DeepxError as e:
                    out.error, out.error_index = f"fetch: {e}", len(program)
        out.placement = placed.rows()
        return out

    async def _ask_run(self, worker: ActorRef[OpWorker], program: Sequence[Instr], fetch: Sequence[str] = (),
                       cancel: Callable[[], bool] | None = None) -> RunResult:
        """A program run once, unplanned (RunProgram), serving (_serving) meanwhile."""
        result: RunResult = await self._serving(worker.ask(RunProgram(program, fetch, cancel)), worker)
        return result

    async def _serving(self, step: Awaitable[T], worker: ActorRef[OpWorker],
                       avoid: AbstractSet[str] | None = None) -> T:
        """`await step`, a step of running a program on `worker` (the passes on a thread, the worker's run); while
        it goes on, the small programs that arrive meanwhile are handled, each whole, by a task beside this
        handler (_run_beside, started by the first message that waits: no cost where none does): a long program
        must not hold another client's step at the scheduler. The worker runs such a step between its slices
        where the two share no tensor (OpWorker._interleave), else after it. `avoid`: names that a program beside
        this step must not name (the tensors whose metas the passes planned on). This returns only after that
        task: messages are still handled one at a time, those beside a program as if before it."""
        if self._beside is not None or self._step is not None:  # a step of a program beside another: no deeper
            return await step
        self._step = (asyncio.get_running_loop().create_future(), avoid, worker)
        cancel = self._cancel
        try:
            if not self.mailbox.empty() or self._held is not None:
                self.message_waiting()
            return await step
        finally:
            ended, _, _ = self._step
            self._step = None
            ended.set_result(None)
            if self._beside is not None:
                try:
                    await self._beside
                finally:
                    self._beside = None
                    self._cancel = cancel

    def message_waiting(self) -> None:
        if self._step is not None and self._beside is None:
            self._beside = asyncio.get_running_loop().create_task(self._run_beside(*self._step),
                                                                  name=f"{self.name}:beside")

    async def _run_beside(self, ended: asyncio.Future[None], avoid: AbstractSet[str] | None,
                          worker: ActorRef[OpWorker]) -> None:
        """Until `ended`: handle the next message waiting that is a run of a small program (small_tensor_names) with
        no backward, that names nothing in `avoid` and that the worker would run now (OpWorker.now_interleaves), one
        at a time; or a segment of another node's program (deepxd/placement.py), which this step may be waiting for.
        It may overtake small runs that must wait (they name a tensor of the long program) where it shares no tensor
        with them; nothing else."""
        passed: set[str] = set()  # the names of the runs looked past, this look

        def small(env: Envelope) -> set[str] | None:
            m = env.message
            if not isinstance(m, Run) or m.backwards:
                return None
            return small_tensor_names(m.program, m.fetch)

        def accept(env: Envelope) -> bool:
            m = env.message
            if isinstance(m, Run) and m.origin == "peer" and not m.backwards:
                # another node's segment, which may be what this step waits for (two nodes placing on each other
                # at once): it names only its node's temporaries and reads heap tensors, so it commutes with
                # this program and the runs waiting, whatever its length
                return bool(worker.now(Interleaves(program_tensor_names(m.program, m.fetch))))
            names = small(env)
            return (names is not None and passed.isdisjoint(names) and (avoid is None or avoid.isdisjoint(names))
                    and bool(worker.now(Interleaves(names))))

        def passes(env: Envelope) -> bool:
            names = small(env)
            if names is not None:
                passed.update(names)
            return names is not None

        await asyncio.wait({ended}, timeout=SLICE_S)  # a step that ends within a slice is not held up
        while not ended.done():
            passed.clear()
            env = self.take_next(accept, passes)
            if env is None:
                await asyncio.wait({ended}, timeout=SLICE_S)
            else:
                self.beside += 1
                await self.handle_nested(env)

    async def _expand(self, worker: ActorRef[OpWorker], program: list[Instr], fetch: tuple[str, ...],
                      marks: dict[int, dict[str, Any]], ctx: PassContext
                      ) -> tuple[list[Instr], list[int], tuple[BackwardSpec, ...], bool] | RunResult:
        """`program` with each marked backward instruction replaced by its backward program: (the expansion, its
        positions in the program, the backwards as a plan keeps them, whether the expansion may be kept). The metas
        a derivation needs are those the instructions before it leave (worked out without running them). A backward
        that cannot be derived fails at its own instruction, after the ones before it ran: the RunResult of that."""
        from deepxd.compiler.analysis import PassContext

        before = ctx.metas
        named = _names_variables(program)
        forwards = any(isinstance(f, list) and all(isinstance(i, Instr) for i in f) and _names_variables(f)
                       for f in (m.get("forward") for m in marks.values()))  # (a malformed one fails below)
        if named or forwards:  # the passes (the program) or the derivation (a recorded forward) read variables
            ctx.variables, ctx.vectors = await self._variables(worker)
        expanded: list[Instr] = []
        where: list[int] = []  # expanded position -> the program's
        specs: list[BackwardSpec] = []
        start = 0
        failure: str | None = None
        at = len(program)
        for i in sorted(marks):
            expanded += program[start:i]
            where += range(start, i)
            start = i + 1
            spec = marks[i]
            try:
                metas = dict(before)
                variables, vectors = dict(ctx.variables), dict(ctx.vectors)  # as the instructions before leave them
                for b in PassContext(metas=before, variables=ctx.variables, vectors=ctx.vectors,
                                     cache=self.binds).bind(expanded):
                    apply_effect(b, metas, variables, vectors, None, True)
            except DeepxError:
                at = i  # the instructions before it are refused: running them says how
                break
            try:
                forward, loss, wrt, grad_loss, prefix, names = _backward_spec(spec)
                if forwards:
                    again = _set_again(program[:i], forward)
                    if again is not None:
                        raise DeepxError(f"variable '{again}', which its forward reads by name, is set again between "
                                         f"the forward and the backward: the gradient would take the new value; "
                                         f"set it after the backward")
                needed = _names_of(forward, loss, wrt, grad_loss)
                derived, _ = self._derive(forward, loss, wrt, grad_loss, prefix,
                                          {n: metas[n] for n in sorted(needed) if n in metas}, names,
                                          *((variables, vectors) if forwards else ()))
            except DeepxError as e:
                failure, at = f"instruction {i + 1}: backward: {e}", i
                break
            expanded += derived
            where += [i] * len(derived)
            # (copies: a client that edits its spec in place sends another one)
            specs.append((i, loss, list(wrt), grad_loss, prefix, dict(names) if names is not None else None,
                          list(forward), scalar_kinds(forward)))
        else:
            expanded += program[start:]
            where += range(start, len(program))
        self._taken_from_udp(expanded)  # the gradients it writes too
        if at == len(program):
            # what read variables took their values: not kept
            return expanded, where, tuple(specs), not forwards and not named and len(expanded) <= REMEMBER_MAX
        result = await self._run_program(worker, expanded, ())  # the instructions before the failed backward
        return self._map_expanded(result, program, where, at, failure)

    async def _run_program(self, worker: ActorRef[OpWorker], program: Sequence[Instr],
                           fetch: Sequence[str]) -> RunResult:
        """`program` run by a plan made for it now, never kept (a part of a program that failed)."""
        made = await self._make_plan(worker, program, fetch, {}, True, loose=True)
        assert not isinstance(made, RunResult)
        self.plan_misses += 1
        result = await self._run_plan(made[0], program)
        assert result is not None  # (loose: its check decides)
        return result

    @staticmethod
    def _map_expanded(result: RunResult, program: Sequence[Instr], where: list[int], at: int,
                      failure: str | None) -> RunResult:
        """The result of an expanded program, told of `program`; `at` < len(program): the backward there failed
        (`failure` says how), and only the instructions before it were sent."""
        if result.error:
            k = result.error_index
            result.error = original_error(result.error, where)
            result.error_index = where[k] if 0 <= k < len(where) else at
        elif at < len(program):
            result.error = failure or f"instruction {at + 1}: backward: the program before it was refused"
            result.error_index = at
        result.done = result.error_index if result.error else len(program)
        result.map_times(where, result.done)
        return result

    async def _variables(self, worker: ActorRef[OpWorker]) -> tuple[dict[str, Any], dict[str, tuple[Any, ...]]]:
        """The worker's named variables and vectors (argset's and vecset's)."""
        held = await worker.ask(Variables())
        return held.get("vars", {}), {k: tuple(v) for k, v in held.get("vectors", {}).items()}

    async def _context(self, worker: ActorRef[OpWorker], program: Sequence[Instr], fetch: Sequence[str],
                       scan: bool = True) -> tuple[PassContext, int]:
        """The passes' context: the worker's metas and heap names, and its variables where the program may name
        one (scan=False: not looked for; the caller knows the program names none, or looks itself); and the version
        of the worker's state they were read at."""
        metas, keep, version = await worker.ask(State())
        variables: dict[str, Any] = {}
        vectors: dict[str, Any] = {}
        if scan and _names_variables(program):
            variables, vectors = await self._variables(worker)
        return new_context(metas, fetch=fetch, keep=keep, variables=variables, vectors=vectors,
                           fuse_min_elements=self.fuse_min_elements, cache=self.binds), version

    async def _compiled_result(self, worker: ActorRef[OpWorker], program: Sequence[Instr], rewritten: list[Instr],
                               fetch: Sequence[str], origins: list[int], ctx: PassContext,
                               result: RunResult) -> RunResult:
        """The result of `rewritten` (the passes' program for `program`), told of `program`. Where it failed part-way
        the tensors are set straight as `program` would have left them (repair)."""
        if not result.error:
            return self._compiled_ok(program, rewritten, origins, result)
        if result.done == 0 and not result.cancelled:  # refused before anything ran: the program as sent gives the
            # exact refusal
            return await self._ask_run(worker, program=program, fetch=fetch)
        done, fix = repair(program, rewritten, origins, result.done, ctx)
        if fix:
            fixed: RunResult = await worker.ask(RunProgram(program=fix, fetch=()))
            if fixed.error:
                log.warning("after a failed rewritten program, setting the tensors straight failed: %s", fixed.error)
        result.error = original_error(result.error, origins)
        result.error_index = done
        result.map_times(origins, done)
        result.done = done
        return result

    def _compiled_ok(self, program: Sequence[Instr], rewritten: list[Instr], origins: list[int],
                     result: RunResult) -> RunResult:
        self.rewritten += 1
        self.eliminated += len(program) - len(rewritten)
        result.map_times(origins, len(program))
        result.done = len(program)
        return result

    def _place(self, program: Sequence[Instr]) -> ActorRef[OpWorker]:
        """All tensors of a session live on one worker: op-cuda when that role runs (its executor runs an op
        without a CUDA kernel on the CPU kernel itself), else op-cpu."""
        worker = self.workers.get("op-cuda") or self.workers.get("op-cpu")
        if worker is None:
            raise DeepxError("no op worker runs on this node: start deepxd with --role including op-cpu or op-cuda")
        return worker

    async def on_explain(self, program: Sequence[Instr], fetch: Sequence[str] = ()) -> dict[str, Any]:
        """The program's text before and after the passes, against the worker's tensors as they are now, and where
        each instruction would run and what would move (`placement`: deepxd/placement.py, explained)."""
        from deepxd.placement import explained

        worker = self._place(program)
        ctx, _ = await self._context(worker, program, fetch)
        before, after = explain(program, ctx.metas, fetch, self.passes, keep=ctx.keep, variables=ctx.variables,
                                vectors=ctx.vectors, fuse_min_elements=self.fuse_min_elements)
        if self.across is not None:
            placement = await self.across.explain(program, fetch, worker)
        else:
            placement = explained(program, self.node_id, {}, None, "op-cuda" if "op-cuda" in self.workers
                                  else "op-cpu")
        return {"before": before, "after": after, "passes": list(self.passes), "placement": placement}

    async def on_backward(self, forward: Sequence[Instr], loss: str, wrt: Sequence[str], grad_loss: str | None = None,
                          prefix: str = "g_", capture: bool = False, names: dict[str, str] | None = None
                          ) -> dict[str, Any]:
        """Autograd in the middle end: rewrite the recorded forward graph into its backward program (gradient rules
        from the catalogue's table in deepxd/compiler/autograd.py), run it, and say which tensor holds each
        gradient (`names`, where given: wrt -> the name its gradient takes). The forward has already run; its
        tensors are still there. `capture` (dx.compile): the answer carries the backward program too."""
        worker = self._place(forward)
        metas = await worker.ask(Metas(names=sorted(_names_of(forward, loss, wrt, grad_loss))))
        variables, vectors = await self._variables(worker) if _names_variables(forward) else ({}, {})
        program, grads = self._derive(forward, loss, wrt, grad_loss, prefix, metas, names, variables, vectors)
        self._taken_from_udp(program)  # the gradients it writes are the native client's
        result = await self._run_cached(program, (), None)  # by its plan, as a step's backward goes
        if result is None:
            result = await self._run_new(worker, program, (), {})
        if result.error:
            raise DeepxError(f"backward: {result.error}")
        self.programs += 1
        self.instructions += result.done
        return {"grads": grads, "instructions": len(program), **({"program": list(program)} if capture else {})}

    def _derive(self, forward: Sequence[Instr], loss: str, wrt: Sequence[str], grad_loss: str | None, prefix: str,
                metas: dict[str, Any], names: dict[str, str] | None = None,
                variables: Mapping[str, Any] | None = None, vectors: Mapping[str, Any] | None = None
                ) -> tuple[list[Instr], dict[str, str]]:
        """grad_program, remembered: a training step sends the same forward (the SDK's pooled names), loss, wrt and
        prefix every step, and the backward depends on nothing else but the metas of the tensors it names. A hit
        returns the very program derived before, so the worker's repeated-program path applies to it too.
        variables, vectors: the worker's, for a forward that reads one by name (argset's); its backward is derived
        afresh each time (it may depend on their values) and never remembered."""
        from deepx_core.ir.instr import same_program
        from deepx_core.ir.ops import SymbolicEnv
        from deepxd.compiler.autograd import grad_program

        forward = forward if type(forward) is list else list(forward)
        if variables or vectors:
            program, grads = grad_program(forward, loss, list(wrt), SymbolicEnv(metas, dict(variables or {}),
                                                                                dict(vectors or {})),
                                          grad_loss=grad_loss, prefix=prefix)
            return _renamed(program, grads, names, metas) if names else (program, grads)
        key = _derived_key(forward, loss, wrt, grad_loss, prefix, names)
        for known in self.backwards.bucket(key):
            if known.metas == metas and same_program(forward, known.forward, known.kinds):
                self.backward_hits += 1
                self.backwards.hit()
                return known.program, dict(known.grads)
        look = (input_probe(forward), loss, len(wrt), grad_loss, prefix, tuple(names.values()) if names else None)
        for known in reversed(list(self.backwards_renamed.bucket(look))):
            before = _derived_key(known.forward, known.loss, known.wrt, grad_loss, prefix, known.names)
            if known.renamed(forward, loss, wrt, names, metas):
                self.backward_hits += 1
                self.backwards.hit()
                self.backwards.discard(before, known)
                self.backwards.add(key, known)
                return known.program, dict(known.grads)
        self.backward_misses += 1
        self.backwards.miss()
        program, grads = grad_program(list(forward), loss, list(wrt), SymbolicEnv(metas), grad_loss=grad_loss,
                                      prefix=prefix)
        if names:
            program, grads = _renamed(program, grads, names, metas)
        if len(forward) + len(program) <= REMEMBER_MAX:
            derived = _Derived(forward, loss, wrt, grad_loss, names, metas, program, grads)
            self.backwards.add(key, derived)
            self.backwards_renamed.add(look, derived)
        return program, dict(grads)

    # -- stored graphs (dx.compile): the plan of each is made once, then every replay binds into it
    async def _plan_graph(self, name: str, data: bytes) -> GraphPlan:
        from deepxd.compiler.graphs import plan_graph

        rows = await self._place(()).ask(WorkerTensors())
        metas = {r["name"]: TensorMeta(tuple(r["shape"]), r["dtype"]) for r in rows}
        plan = plan_graph(name, data, metas, [r["name"] for r in rows if r.get("kind") == "heap"], self.passes,
                          self.fuse_min_elements)
        self.graphs[name] = plan
        return plan

    async def on_drop_graph(self, name: str) -> dict[str, Any]:
        """Forget a planned graph and delete the temporaries its replays keep allocated (`<name>.t<k>`, which only
        its plan writes): what the SDK asks when a compiled function goes. Nothing where it is not planned here."""
        plan = self.graphs.pop(name, None)
        if plan is None:
            return {"name": name, "planned": False, "deleted": 0}
        worker = self._place(plan.plan)
        metas, _, _ = await worker.ask(State())
        temporary = re.compile(re.escape(name) + r"\.t\d+")  # `.` may be in a graph's base name: digits only
        gone = [n for n in metas if temporary.fullmatch(n)]
        if gone:
            program = [Instr("deltensor", (), (Param.tensor(n, metas[n].dtype),)) for n in gone]
            result: RunResult = await worker.ask(RunProgram(program=program, fetch=[]))
            if result.error:
                log.warning("scheduler: deleting the temporaries of graph %s: %s", name, result.error)
        return {"name": name, "planned": True, "deleted": len(gone)}

    def on_graph_records(self) -> dict[str, bytes]:
        """The bytes of every stored graph planned here, by name (the registry writes back those the plane lost)."""
        return {name: plan.data for name, plan in self.graphs.items()}

    async def on_store_graph(self, name: str, data: bytes) -> dict[str, Any]:
        """Plan a graph just stored in the plane (the caller wrote `graph:<name>`)."""
        plan = await self._plan_graph(name, data)
        return {"name": name, "instructions": len(plan.record.instrs), "planned": len(plan.plan)}

    async def on_explain_graph(self, name: str, data: bytes | None = None) -> dict[str, Any] | None:
        """A stored graph's program and its plan as text; None when it is not planned here and no data came."""
        from deepx_core.ir.text import format_text

        plan = self.graphs.get(name)
        if plan is None or (data is not None and plan.data != data):
            if data is None:
                return None
            plan = await self._plan_graph(name, data)
        return {"before": "\n".join(map(format_text, plan.record.instrs)),
                "after": "\n".join(map(format_text, plan.plan)), "passes": list(plan.passes)}

    async def on_replay(self, name: str, inputs: dict[str, Any], outputs: dict[str, Any],
                        scalars: dict[str, Any] | None = None, fetch: Sequence[str] = (),
                        data: bytes | None = None) -> RunResult | None:
        """Run stored graph `name` with inputs bound to tensors (or data), outputs to names, and scalars set. None
        when the graph is not planned here and no data came (the caller reads it from the plane and asks again).
        The bound program runs by its plan where one stands (a loop replays with the same bindings); else its
        inputs are checked (and those given as data put) first."""
        from deepxd.compiler.graphs import bind_replay

        plan = self.graphs.get(name)
        if plan is None:
            if data is None:
                return None
            plan = await self._plan_graph(name, data)
        worker = self._place(plan.plan)
        t0 = time.perf_counter()
        bound = bind_replay(plan, inputs, outputs, scalars or {})
        self._taken_from_udp(bound.program, [p[0] for p in bound.puts])  # outputs, temporaries, inputs put
        result: RunResult | None = None
        if not bound.puts:  # (data to put: put first, every time)
            result = await self._run_cached(bound.program, fetch, None)
        if result is None:
            result = await self._replay_checked(name, worker, bound, fetch)
        done = self._replayed(name, plan, worker, bound, result, t0)
        return done if isinstance(done, RunResult) else await done

    def now_replay(self, name: str, inputs: dict[str, Any], outputs: dict[str, Any],
                   scalars: dict[str, Any] | None = None, fetch: Sequence[str] = (),
                   data: bytes | None = None) -> Finished | None:
        """on_replay with no coroutine (LoopThread.now: dx.compile's replays in the embedded daemon), where the graph
        is planned here, its bound program's plan stands, both actors are idle with nothing waiting, and the worker
        runs the plan inline (OpWorker.now_stands). None, with nothing run and nothing counted, where on_replay must
        answer; else its answer, or a coroutine that finishes it (a failed replay's temporaries deleted)."""
        from deepxd.compiler.graphs import bind_replay

        plan = self.graphs.get(name)
        # only a binding of tensor names can run by a plan as it is (data is put first)
        if (plan is None or data is not None or not self.plans or not self.idle()
                or not all(type(v) is str for v in inputs.values())):
            return None
        try:
            bound = bind_replay(plan, inputs, outputs, scalars or {})
        except DeepxError:  # on_replay says so, and counts it
            return None
        fetch = list(fetch)
        standing = self._standing(bound.program, fetch, None)
        if standing is None:
            return None
        return self.now("replay", self._now_replay, name, plan, bound, standing)

    def _now_replay(self, name: str, plan: GraphPlan, bound: Bound, standing: Plan) -> Finished:
        t0 = time.perf_counter()
        self.now_hits += 1
        self._taken_from_udp(bound.program)
        result = standing.worker.now(RunPlan(standing))
        assert result is not None  # (now_stands said it would run)
        self._hit(probe(bound.program), standing, result)
        return self._replayed(name, plan, standing.worker, bound, result, t0)

    def _replayed(self, name: str, plan: GraphPlan, worker: ActorRef[OpWorker], bound: Bound, result: RunResult,
                  t0: float) -> Finished:
        """on_replay's answer from the worker's: a coroutine to await where the replay failed (its temporaries are
        deleted, the error told of the graph's instructions)."""
        self.busy_s += time.perf_counter() - t0
        self.programs += 1
        self.replays += 1
        if result.error:
            self.failed += 1
            return self._replay_failed(name, plan, worker, bound, result)
        self.instructions += len(plan.record.instrs)
        result.done = len(plan.record.instrs)
        return result

    async def _replay_failed(self, name: str, plan: GraphPlan, worker: ActorRef[OpWorker], bound: Bound,
                             result: RunResult) -> RunResult:
        from deepxd.compiler.pipeline import original_error

        rows = await worker.ask(WorkerTensors())
        outs = set(bound.outputs)
        junk = [r["name"] for r in rows if r["name"].startswith(f"{name}.") or r["name"] in outs]
        if junk:
            await worker.ask(RunProgram(program=[Instr("deltensor", (), (Param.tensor(n),)) for n in junk]))
        k = result.error_index
        result.error = f"replay of graph {name!r}: {original_error(result.error, plan.origins)}"
        result.error_index = plan.origins[k] if 0 <= k < len(plan.origins) else k
        return result

    async def _replay_checked(self, name: str, worker: ActorRef[OpWorker], bound: Bound,
                              fetch: Sequence[str]) -> RunResult:
        """A replay's inputs checked against the tensors they name (a clear error for one that is missing or of
        another shape), the ones given as data put, then the run."""
        if bound.bound_inputs:
            have = await worker.ask(Metas(names=sorted(bound.bound_inputs)))
            for n, (dtype, shape) in bound.bound_inputs.items():
                m = have.get(n)
                if m is None:
                    raise DeepxError(f"replay of graph {name!r}: input tensor {n!r} not found")
                if (m.dtype, tuple(m.shape)) != (dtype, shape):
                    raise DeepxError(f"replay of graph {name!r}: input tensor {n!r} is {m.dtype}{list(m.shape)}; "
                                     f"the graph needs {dtype}{list(shape)}")
        for k, (n, dt, dims, buf) in enumerate(bound.puts):
            try:
                await worker.ask(Put(name=n, dtype=dt, shape=dims, data=buf))
            except DeepxError as e:  # the inputs put before this one are freed: a refused replay leaves nothing
                if k:
                    await worker.ask(RunProgram(program=[Instr("deltensor", (), (Param.tensor(p[0]),))
                                                     for p in bound.puts[:k]]))
                raise DeepxError(f"replay of graph {name!r}: {e}") from None
        # by a plan: made once for these bindings (the graph's binding memo gives the same program; one that puts
        # data deletes its inputs after it, the same program every time too)
        result = await self._run_cached(bound.program, fetch, None) if bound.puts else None
        if result is None:
            result = await self._run_new(worker, bound.program, fetch, {}, passes=False)
        return result

    def on_stats(self) -> dict[str, float]:
        return {"programs": self.programs, "instructions": self.instructions, "failed": self.failed,
                "busy_s": self.busy_s, "rewritten": self.rewritten, "eliminated": self.eliminated,
                "plan_hits": self.plan_hits, "plan_misses": self.plan_misses, "stale": self.stale,
                "renamed": self.renamed,
                "now_hits": self.now_hits, "apart": self.apart, "rewrite_hits": self.rewrites.hits,
                "graphs": len(self.graphs), "replays": self.replays, "beside": self.beside,
                "backward_hits": self.backward_hits, "backward_misses": self.backward_misses,
                **({"placed": self.across.placed, "segments": self.across.segments, "moved": self.across.moved}
                   if self.across is not None else {})}
