"""The scheduler: the middle end at run time. It receives programs, runs the compiler passes over them, places them
on an op worker and answers with what happened. Programs run one at a time, in arrival order, so that each is
checked against the state the one before it left. Placement: with op-cuda running every program goes to op-cuda,
else to op-cpu (placement across several workers and nodes builds on this).

The passes see the tensors that exist on the worker (asked once per program, and only for a program in which a
value can end, by a deltensor or a second write to a name: without one every pass is a no-op) and the names the
client fetches. The reply always speaks of the client's program: `done`, `error_index` and the times count its
instructions, whatever the passes made of them.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from types import CoroutineType
from typing import TYPE_CHECKING, Any

from deepx_core.cache import Cache
from deepx_core.errors import DeepxError
from deepx_core.ir.effects import SETS, apply_effect, kind_of
from deepx_core.ir.instr import Instr, Param
from deepx_core.ir.ops import OPS, TensorMeta
from deepxd.actors.base import Actor, ActorRef, Envelope
from deepxd.actors.worker import (
    LONG_PROGRAM,
    REMEMBER_MAX,
    SLICE_S,
    RunResult,
    program_tensor_names,
    small_tensor_names,
)
from deepxd.compiler.analysis import BindMemo, default_pair_min, has_ends, named_tensors
from deepxd.compiler.pipeline import (
    DEFAULT_PASSES,
    PlanCache,
    check_passes,
    explain,
    new_context,
    original_error,
    repair,
)
from deepxd.config import Config

if TYPE_CHECKING:
    from deepxd.access import UdpScope

log = logging.getLogger(__name__)


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


def _note(note: dict[str, Any], given: Sequence[Instr], sent: Sequence[Instr], origins: list[int] | None, ctx: Any,
          planned: bool) -> None:
    """What a program became on its way to the worker (see Scheduler._next_fast): `given` went through the passes
    (`planned`) or not, `sent` went to the worker, `origins` maps it back to `given` (None: it is `given`), `ctx`
    is the state the passes read."""
    note.update(given=given, sent=sent, origins=origins, ctx=ctx, planned=planned, runs=note.get("runs", 0) + 1)


class _Fast:
    """A program run lately, as the passes left it (see Scheduler._run_fast): what went to the worker, how its
    result maps back, what it expects of the worker's tensors, and the version of the worker's state after it ran
    (-1 where that run changed what it found)."""

    __slots__ = ("backwards", "ctx", "expanded", "expect", "fetch", "kinds", "origins", "planned", "program",
                 "sent", "version", "where", "worker")

    def __init__(self, program: list[Instr], fetch: tuple[str, ...], backwards: list[tuple[Any, ...]],
                 worker: ActorRef, expanded: list[Instr] | None, where: list[int] | None, sent: list[Instr],
                 origins: list[int] | None, ctx: Any, planned: bool, version: int, expect: Any) -> None:
        from deepx_core.ir.instr import scalar_kinds

        self.program, self.kinds, self.fetch, self.backwards = program, scalar_kinds(program), fetch, backwards
        self.worker, self.expanded, self.where = worker, expanded, where
        self.sent, self.origins, self.ctx, self.planned = sent, origins, ctx, planned
        self.version, self.expect = version, expect

    def matches(self, program: Sequence[Instr], fetch: Sequence[str],
                backwards: Sequence[dict[str, Any]] | None) -> bool:
        """Whether `program` is this one again; or this one with new numbers in its optimizer updates (Adam's step
        count, a scheduled lr: instr.renumbered), which the entry then takes as its own, in the program, its
        expansion and what went to the worker (each update stands in those as it came: the passes and the
        expansion keep updates as they are), so that the worker finds its known program renumbered too."""
        from deepx_core.ir.instr import renumbered, same_program

        mine = self.backwards
        if len(backwards or ()) != len(mine) or tuple(fetch) != self.fetch:
            return False
        varied = None
        if not same_program(program, self.program, self.kinds):
            varied = renumbered(program, self.program)
            if not varied:
                return False
        if not self._same_backwards(backwards):
            return False
        return varied is None or self._renumber(program, varied)

    def _renumber(self, program: Sequence[Instr], varied: list[int]) -> bool:
        """Take `program`'s updates in place of this entry's, by position: an update stands alone where it stood in
        the program (never expanded: `where` maps exactly one expanded instruction to it) and goes to the worker as
        it came (`origins` maps exactly one sent instruction to it), as an instruction equal to the old one though
        maybe another object (an expansion remembered from an earlier, equal program). False, with the entry left as
        it was, where an update cannot be found so."""
        from deepx_core.ir.instr import scalar_kinds

        old, changed = self.program, set(varied)
        program = program if type(program) is list else list(program)
        expanded: list[Instr] | None = None
        planned_old, planned = old, program
        if self.expanded is not None:
            assert self.where is not None
            found = _substituted(self.expanded, self.where, changed, old, program)
            if found is None:
                return False
            expanded, changed = found
            planned_old, planned = self.expanded, expanded
        if self.origins is not None:
            found = _substituted(self.sent, self.origins, changed, planned_old, planned)
            if found is None:
                return False
            sent = found[0]
        elif len(self.sent) == len(planned_old) and all(a == b for a, b in zip(self.sent, planned_old)):
            sent = list(planned)
        else:
            return False
        self.program, self.kinds, self.expanded, self.sent = program, scalar_kinds(program), expanded, sent
        return True

    def _same_backwards(self, backwards: Sequence[dict[str, Any]] | None) -> bool:
        from deepx_core.ir.instr import same_program

        for spec, (index, loss, wrt, grad_loss, prefix, names, forward, kinds) in zip(backwards or (),
                                                                                     self.backwards):
            f, k = spec.get("forward"), spec.get("index")
            # what the whole path checks too: an index 3.0 or a tuple for an instruction are refused there
            if (type(k) is not int or k != index or spec.get("loss") != loss or spec.get("wrt") != wrt
                    or spec.get("grad_loss") != grad_loss or spec.get("prefix", "g_") != prefix
                    or spec.get("names") != names or type(f) is not list or not all(type(i) is Instr for i in f)
                    or not same_program(f, forward, kinds)):
                return False
        return True


def _substituted(items: Sequence[Instr], origins: Sequence[int], changed: set[int], old: Sequence[Instr],
                 new: Sequence[Instr]) -> tuple[list[Instr], set[int]] | None:
    """`items` (each standing for old[origins[k]]) with the one that stands for each `changed` position replaced by
    new's, and where those stand in `items`; None where a changed position has not exactly one item, equal to old's."""
    at = [k for k, o in enumerate(origins) if o in changed]
    if len(at) != len(changed) or any(items[k] != old[origins[k]] for k in at):
        return None
    out = list(items)
    for k in at:
        out[k] = new[origins[k]]
    return out, set(at)


def _cancelled_unrun() -> RunResult:
    return RunResult(error="instruction 1: cancelled: the client's connection ended before the program ran",
                     error_index=0, t0=time.time(), cancelled=True)


class Scheduler(Actor):
    role = "scheduler"

    def __init__(self, workers: dict[str, ActorRef], name: str = "scheduler", *, config: Config | None = None,
                 udp_scope: UdpScope | None = None) -> None:
        super().__init__(name)
        self.workers = workers
        self.udp_scope = udp_scope  # what deepxIR over UDP may name (deepxd/access.py); None: UDP is off
        self.passes: list[str] = check_passes(config.passes) if config is not None else list(DEFAULT_PASSES)
        self.fuse_min_elements = config.fuse_min_elements if config is not None else 0
        self.plans = BindMemo(owner=name)  # the passes check programs too: the same instructions every training step
        self.compiled = PlanCache(self.passes, max_len=REMEMBER_MAX, owner=name)
        self.programs = 0
        self.instructions = 0
        self.failed = 0
        self.busy_s = 0.0
        self.rewritten = 0  # programs the passes changed
        self.eliminated = 0  # instructions they removed
        self.graphs: dict[str, Any] = {}  # stored graph name -> its plan (deepxd/compiler/graphs.py)
        self.replays = 0
        # backward programs derived before (_derive): probe -> [(forward, its scalar kinds, metas, program, grads)]
        self.backwards: Cache[Any, list[tuple[list[Instr], Any, dict[str, Any], list[Instr], dict[str, str]]]] = (
            Cache("scheduler.backwards", 64, per_key=4, owner=name))
        self.backward_hits = 0
        self.backward_misses = 0
        # backward instructions expanded before (_expansion): probe -> [(program, kinds, forwards, (names, their
        # metas before), expanded, where)]
        self.expansions: Cache[Any, list[tuple[Any, ...]]] = Cache("scheduler.expansions", 64, per_key=4, owner=name)
        self.expansion_hits = 0
        # the last few programs, to run again as they went (see _run_fast), by id
        self._fast: Cache[int, _Fast] = Cache("scheduler.recent", 4, owner=name)
        self.fast_hits = 0
        self.now_hits = 0  # runs and replays taken by now_run and now_replay (the embedded daemon's, no loop step)
        self._cancel: Callable[[], bool] | None = None  # the running program's (on_run)
        self._beside: asyncio.Task[None] | None = None  # handling small programs beside a long one (_serving)
        self._passes_busy = False  # a long program's passes run on a thread (the plan caches are theirs meanwhile)
        # the step _serving awaits: (its end, the names a program beside it must not name, the worker)
        self._step: tuple[asyncio.Future[None], AbstractSet[str] | None, ActorRef] | None = None
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
            return await self._run_one(program, fetch, backwards, cancel)
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
                       cancel: Callable[[], bool] | None = None) -> RunResult:
        """Run `program`. `backwards`: the SDK's recorded `loss.backward()` calls, each a `backward` instruction of
        the program (at its `index`) with what on_backward takes: it is expanded there, in place, into the backward
        program derived from its forward graph, so that a training step (forward, backward, optimizer, the loss
        read back) is one program, through the passes as a whole. `cancel`: whether the asker went away (its
        client's connection ended): a program still queued then is dropped, a running one stops at an instruction
        boundary (the worker asks it between slices)."""
        if cancel is not None and cancel():
            self.failed += 1
            return _cancelled_unrun()
        self._cancel = cancel  # what the run sites below pass on (each on_run sets its own)
        for fast in self._fast.newest():
            if fast.matches(program, fetch, backwards):
                self._fast.get(id(fast))
                t0 = time.perf_counter()
                hit = await self._run_fast(fast, program, fetch)
                if hit is not None:
                    return self._counted(hit, t0)
                break
        else:
            self._fast.miss()
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
                return RunResult(error=f"instruction {i + 1}: op '{instr.name}' not found", error_index=i,
                                 t0=time.time())
        worker = self._place(program)
        t0 = time.perf_counter()
        note: dict[str, Any] = {}  # what went to the worker, and how its result maps back (for _next_fast)
        if marks:
            result = await self._run_expanded(worker, program, fetch, marks, note)
        else:
            result = await self._run_program(worker, program, fetch, note=note)
        self._counted(result, t0)
        made = self._next_fast(program, fetch, marks, worker, note, result)
        if made is not None:
            self._fast.put(id(made), made)  # a read between two steps (a fetch, a print) keeps the step
        return result

    # -- the last program again
    def _next_fast(self, program: Sequence[Instr], fetch: Sequence[str], marks: dict[int, dict[str, Any]],
                   worker: ActorRef, note: dict[str, Any], result: RunResult) -> _Fast | None:
        """The fast path for the program that just ran, where it may take one: it ran whole, as one program the
        worker knew (it repeats), and what the passes and the derivation made of it depended on the worker's
        tensors only (no variable is named, the expansion was one to remember), as the run found them (a write
        queued at the worker between the scheduler's look at its state and the run would leave a plan made for
        another state). Its expectation: the metas and heap flags, as the passes saw them, of every tensor that
        the program, its forward graphs and its expansion name. Else None."""
        from deepx_core.ir.instr import scalar_kinds

        if (result.error or not result.known or note.get("runs") != 1 or (marks and "where" not in note)
                or note.get("seen", result.begun) != result.begun or _names_variables(program)):
            return None
        backwards = []
        for i, spec in sorted(marks.items()):
            forward = spec["forward"]
            if _names_variables(forward):
                return None
            names = spec.get("names")  # (copies: a client that edits its spec in place sends another one)
            backwards.append((i, spec["loss"], list(spec["wrt"]), spec.get("grad_loss"), spec.get("prefix", "g_"),
                              dict(names) if names is not None else None, list(forward), scalar_kinds(forward)))
        ctx = note["ctx"]
        if ctx is None:  # the program went as it was: only the worker's own check stands for it
            expect: Any = ((), [], [])
        else:  # what the passes and the derivation read: the metas of what the program and its expansion name, and
            # of what each backward's derivation reads
            seen: dict[str, None] = {}
            for part in (program, note["given"]):
                for instr in part:
                    seen.update(dict.fromkeys(named_tensors(instr)))
            for _, loss, wrt, grad_loss, _, _, forward, _ in backwards:
                seen.update(dict.fromkeys(_names_of(forward, loss, wrt, grad_loss)))
            order = tuple(seen)
            expect = (order, [ctx.metas.get(n) for n in order], [n in ctx.keep for n in order])
        return _Fast(list(program), tuple(fetch), backwards, worker, note["given"] if marks else None,
                     note.get("where"), note["sent"], note["origins"], ctx, note["planned"], result.version, expect)

    async def _run_fast(self, fast: _Fast, program: Sequence[Instr], fetch: Sequence[str]) -> RunResult | None:
        """A training loop sends the same step every time: the program it became (backward expanded, passes run,
        known to the worker) goes to the worker again as it is, on the condition that the worker's tensors still
        meet its expectation (what the derivation and the passes read of them), which the worker takes as met
        without comparing while its state's version is still the one the last run left. None where it is not
        (the worker ran nothing): the program takes the whole path."""
        if fast.planned and fast.ctx.fuse_pair_min_elements != default_pair_min():  # native kernels came or went
            self._fast.pop(id(fast))
            return None
        if fast.expanded is not None:  # the gradients of its backwards (on_run took back the rest)
            self._taken_from_udp(fast.expanded)
        result = await self._ask_run(fast.worker, program=fast.sent, fetch=fetch, cancel=self._cancel,
                                     version=fast.version if fast.version >= 0 else None, expect=fast.expect)
        done = self._fast_ran(fast, program, fetch, result)
        return await done if isinstance(done, CoroutineType) else done

    def now_run(self, program: Sequence[Instr], fetch: Sequence[str],
                backwards: Sequence[dict[str, Any]] | None = None) -> Any:
        """on_run's fast path with no coroutine, on a thread that stands in for the loop's (LoopThread.now: the
        embedded daemon's training steps, without the event loop's tasks and hand-offs). None, with nothing run and
        nothing counted, where on_run must answer: this scheduler or the worker busy or with messages waiting, no
        entry that matches, a run the worker cannot make inline (OpWorker.now_known), a stale entry (dropped).
        Else on_run's answer, or a coroutine that finishes it (a rewritten program that failed part-way: its
        tensors are set straight)."""
        if not self._fast or not self.idle():
            return None
        worker = self._place(program)  # every entry's (a session's tensors live on one worker)
        for fast in self._fast.newest():
            if fast.matches(program, fetch, backwards):
                self._fast.get(id(fast))
                break
        else:
            return None
        if fast.worker is not worker or (
                fast.planned and fast.ctx.fuse_pair_min_elements != default_pair_min()):
            return None
        known = worker.now("known", fast.sent, fetch, fast.version if fast.version >= 0 else None, fast.expect)
        if known is None:
            return None
        if isinstance(known, RunResult):  # stale: the entry goes, and the ask takes the whole path
            self._fast.pop(id(fast))
            return None
        return self.now("run", self._now_run, fast, worker, known, program, fetch)

    def _now_run(self, fast: _Fast, worker: ActorRef, known: Any, program: Sequence[Instr],
                 fetch: Sequence[str]) -> Any:
        t0 = time.perf_counter()
        self.now_hits += 1
        done = self._fast_ran(fast, program, fetch, worker.now("run_known", known, fetch))
        if isinstance(done, CoroutineType):
            return self._finish_counted(done, t0)
        return self._counted(done, t0)

    async def _finish_counted(self, done: Any, t0: float) -> RunResult:
        return self._counted(await done, t0)

    def _fast_ran(self, fast: _Fast, program: Sequence[Instr], fetch: Sequence[str], result: RunResult) -> Any:
        """The worker's answer to a fast run, told of the program as the SDK sent it: None where it was stale (it
        ran nothing; the entry goes); a coroutine to await where a rewritten program failed part-way."""
        if result.stale:
            self._fast.pop(id(fast))
            return None
        self.fast_hits += 1
        if fast.origins is not None:
            planned = fast.expanded if fast.expanded is not None else program
            if result.error:
                return self._fast_repaired(fast, planned, program, fetch, result)
            result = self._compiled_ok(planned, fast.sent, fast.origins, result)
        return self._fast_mapped(fast, program, result)

    async def _fast_repaired(self, fast: _Fast, planned: Sequence[Instr], program: Sequence[Instr],
                             fetch: Sequence[str], result: RunResult) -> RunResult:
        assert fast.origins is not None
        result = await self._compiled_result(fast.worker, planned, fast.sent, fetch, fast.origins, fast.ctx, result)
        return self._fast_mapped(fast, program, result)

    def _fast_mapped(self, fast: _Fast, program: Sequence[Instr], result: RunResult) -> RunResult:
        if fast.where is not None:
            result = self._map_expanded(result, program, fast.where, len(program), None)
        if result.error:
            self._fast.pop(id(fast))
        else:
            fast.version = result.version  # -1 where the run changed what it found: the expectation is compared
        return result

    def _counted(self, result: RunResult, t0: float) -> RunResult:
        self.busy_s += time.perf_counter() - t0
        self.programs += 1
        self.instructions += result.done
        self.failed += bool(result.error)
        return result

    async def _run_program(self, worker: ActorRef, program: Sequence[Instr], fetch: Sequence[str],
                           ctx: Any = None, note: dict[str, Any] | None = None) -> RunResult:
        if self.passes and len(program) > 1 and has_ends(program):
            return await self._run_compiled(worker, program, fetch, ctx, note)
        if note is not None:
            _note(note, program, program, None, ctx, False)
        return await self._ask_run(worker, program=program, fetch=fetch, cancel=self._cancel)

    async def _ask_run(self, worker: ActorRef, **kwargs: Any) -> RunResult:
        """worker.ask("run", **kwargs), serving (_serving) meanwhile."""
        result: RunResult = await self._serving(worker.ask("run", **kwargs), worker)
        return result

    async def _serving(self, step: Awaitable[Any], worker: ActorRef, avoid: AbstractSet[str] | None = None) -> Any:
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
                          worker: ActorRef) -> None:
        """Until `ended`: handle the next message waiting that is a run of a small program (small_tensor_names) with
        no backward, that names nothing in `avoid` and that the worker would run now (OpWorker.now_interleaves), one
        at a time. It may overtake small runs that must wait (they name a tensor of the long program) where it
        shares no tensor with them; nothing else."""
        passed: set[str] = set()  # the names of the runs looked past, this look

        def small(env: Envelope) -> set[str] | None:
            if env.name != "run" or env.kwargs.get("backwards"):
                return None
            return small_tensor_names(env.kwargs.get("program", ()), env.kwargs.get("fetch", ()))

        def accept(env: Envelope) -> bool:
            names = small(env)
            return (names is not None and passed.isdisjoint(names) and (avoid is None or avoid.isdisjoint(names))
                    and bool(worker.now("interleaves", names)))

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

    async def _run_expanded(self, worker: ActorRef, program: Sequence[Instr], fetch: Sequence[str],
                            marks: dict[int, dict[str, Any]], note: dict[str, Any] | None = None) -> RunResult:
        """on_run with each marked backward instruction replaced by its backward program. The metas its derivation
        needs are those the instructions before it leave (worked out without running them). A backward that cannot
        be derived fails at its own instruction, after the ones before it ran."""
        from deepxd.compiler.analysis import PassContext

        ctx = await self._context(worker, program, fetch, scan=False, note=note)
        before = ctx.metas
        hit = self._expansion(program, marks, before)
        if hit is not None:
            if not self.compiled.seen(hit[0]) and _names_variables(hit[0]):  # a remembered one names none
                ctx.variables, ctx.vectors = await self._variables(worker)
            self._taken_from_udp(hit[0])
            result = await self._run_program(worker, hit[0], fetch, ctx, note)
            if note is not None:
                note["where"] = hit[1]
            return self._map_expanded(result, program, hit[1], len(program), None)
        named = _names_variables(program)
        forwards = any(isinstance(f, list) and all(isinstance(i, Instr) for i in f) and _names_variables(f)
                       for f in (m.get("forward") for m in marks.values()))  # (a malformed one fails below)
        if named or forwards:  # the passes (the program) or the derivation (a recorded forward) read variables
            ctx.variables, ctx.vectors = await self._variables(worker)
        expanded: list[Instr] = []
        where: list[int] = []  # expanded position -> the program's
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
                                     cache=self.plans).bind(expanded):
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
        else:
            expanded += program[start:]
            where += range(start, len(program))
        if at == len(program) and not forwards and not named and len(expanded) <= REMEMBER_MAX:  # what read
            # variables took their values: not kept
            self._remember_expansion(program, marks, before, expanded, where)
            if note is not None:
                note["where"] = where
        self._taken_from_udp(expanded)  # the gradients it writes too
        result = await self._run_program(worker, expanded, fetch if at == len(program) else (), ctx, note)
        return self._map_expanded(result, program, where, at, failure)

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

    # expansions remembered: a training loop sends the same step, backward instruction and all, every time
    def _expansion_key(self, program: Sequence[Instr], marks: dict[int, dict[str, Any]]) -> Any:
        from deepx_core.ir.instr import numbers_probe

        try:
            key: Any = (*numbers_probe(program),
                        tuple((i, m.get("loss"), tuple(m.get("wrt") or ()), m.get("grad_loss"), m.get("prefix"),
                               tuple((m.get("names") or {}).items()), len(m.get("forward") or ()))
                              for i, m in sorted(marks.items())))
            hash(key)
        except TypeError:
            return None
        return key

    def _expansion(self, program: Sequence[Instr], marks: dict[int, dict[str, Any]],
                   before: dict[str, Any]) -> tuple[list[Instr], list[int]] | None:
        """A remembered expansion of this program; or of one it repeats with new numbers in its optimizer updates
        (Adam's step count, a scheduled lr: instr.renumbered), with the new updates in place of the old (an update
        is never a backward's: it stands in the expansion as it stood in the program)."""
        from deepx_core.ir.instr import renumbered, same_program

        key = self._expansion_key(program, marks)
        for e in self.expansions.bucket(key) if key is not None else ():
            known, kinds, forwards, (names, metas), expanded, where = e
            if not (all(type(marks[i]["forward"]) is list and all(type(x) is Instr for x in marks[i]["forward"])
                        and same_program(marks[i]["forward"], f, k) for i, (f, k) in forwards.items())
                    and list(map(before.get, names)) == metas):  # (a malformed forward: refused by _backward_spec)
                continue
            if same_program(program, known, kinds):
                self.expansion_hits += 1
                self.expansions.hit()
                return expanded, where
            varied = renumbered(program, known)
            if varied:  # each update stands alone where it stood (only a backward expands into several)
                new = set(varied)
                self.expansion_hits += 1
                self.expansions.hit()
                return [program[w] if w in new else x for x, w in zip(expanded, where)], where
        self.expansions.miss()
        return None

    def _remember_expansion(self, program: Sequence[Instr], marks: dict[int, dict[str, Any]],
                            before: dict[str, Any], expanded: list[Instr], where: list[int]) -> None:
        """Keep an expansion with what it depended on: the program, the forward graphs, and the shape and dtype
        (or absence) of each tensor they name as it was before the program."""
        from deepx_core.ir.instr import scalar_kinds

        key = self._expansion_key(program, marks)
        if key is None:
            return
        names: set[str] = set()
        for m in marks.values():
            names |= _names_of(m["forward"], m["loss"], m["wrt"], m.get("grad_loss"))
        for instr in program:
            names.update(named_tensors(instr))
        order = tuple(sorted(names))
        self.expansions.add(key, (list(program), scalar_kinds(program),
                                  {i: (list(m["forward"]), scalar_kinds(m["forward"])) for i, m in marks.items()},
                                  (order, [before.get(n) for n in order]), expanded, where))

    async def _variables(self, worker: ActorRef) -> tuple[dict[str, Any], dict[str, tuple[Any, ...]]]:
        """The worker's named variables and vectors (argset's and vecset's)."""
        held = await worker.ask("variables")
        return held.get("vars", {}), {k: tuple(v) for k, v in held.get("vectors", {}).items()}

    async def _context(self, worker: ActorRef, program: Sequence[Instr], fetch: Sequence[str],
                       scan: bool = True, note: dict[str, Any] | None = None) -> Any:
        """The passes' context: the worker's metas and heap names, and its variables where the program may name
        one (scan=False: not looked for; the caller knows the program names none, or looks itself). `note` takes
        the version of the worker's state they were read at (`seen`: see _next_fast)."""
        metas, keep, version = await worker.ask("state")
        if note is not None:
            note["seen"] = version
        variables: dict[str, Any] = {}
        vectors: dict[str, Any] = {}
        if scan and not self.compiled.seen(program) and _names_variables(program):  # a remembered one names none
            variables, vectors = await self._variables(worker)
        return new_context(metas, fetch=fetch, keep=keep, variables=variables, vectors=vectors,
                           fuse_min_elements=self.fuse_min_elements, cache=self.plans)

    async def _run_compiled(self, worker: ActorRef, program: Sequence[Instr], fetch: Sequence[str],
                            ctx: Any = None, note: dict[str, Any] | None = None) -> RunResult:
        beside = self._beside is not None and asyncio.current_task() is self._beside
        if beside and self._passes_busy:  # the plan caches are not for two threads: no passes beside the passes
            return await self._ask_run(worker, program=program, fetch=fetch, cancel=self._cancel)
        if ctx is None:
            ctx = await self._context(worker, program, fetch, note=note)
        try:
            if len(program) > LONG_PROGRAM and not self.compiled.seen(program):  # O(n) and more: on a thread
                # a program beside the passes must leave the metas they plan on as they were
                names = await asyncio.to_thread(program_tensor_names, program, ())
                self._passes_busy = True
                try:
                    rewritten = await self._serving(asyncio.to_thread(self.compiled.run, program, ctx), worker,
                                                    names)
                finally:
                    self._passes_busy = False
                if self._cancel is not None and self._cancel():  # the passes took seconds: the asker may be gone
                    self.failed += 1
                    return _cancelled_unrun()
            else:
                rewritten = self.compiled.run(program, ctx)
        except Exception:  # a pass must never cost the client its program
            log.exception("compiler passes failed; running the program as sent")
            rewritten = list(program)
        if len(rewritten) == len(program) and all(a is b for a, b in zip(rewritten, program)):
            if note is not None:
                _note(note, program, program, None, ctx, True)
            return await self._ask_run(worker, program=program, fetch=fetch, cancel=self._cancel)
        origins = ctx.origins
        if note is not None:
            _note(note, program, rewritten, origins, ctx, True)
        if beside:  # planned on the metas of a moment between a long program's slices: only on those metas
            order = tuple(program_tensor_names(program, fetch))
            expect = (order, [ctx.metas.get(n) for n in order], [n in ctx.keep for n in order])
            result = await self._ask_run(worker, program=rewritten, fetch=fetch, cancel=self._cancel, expect=expect)
            if result.stale:  # the long program changed them first: the program as sent, which the worker checks
                return await self._ask_run(worker, program=program, fetch=fetch, cancel=self._cancel)
        else:
            result = await self._ask_run(worker, program=rewritten, fetch=fetch, cancel=self._cancel)
        return await self._compiled_result(worker, program, rewritten, fetch, origins, ctx, result, note)

    async def _compiled_result(self, worker: ActorRef, program: Sequence[Instr], rewritten: list[Instr],
                               fetch: Sequence[str], origins: list[int], ctx: Any, result: RunResult,
                               note: dict[str, Any] | None = None) -> RunResult:
        """The result of `rewritten` (the passes' program for `program`), told of `program`. Where it failed part-way
        the tensors are set straight as `program` would have left them (repair)."""
        if not result.error:
            return self._compiled_ok(program, rewritten, origins, result)
        if note is not None:
            note["runs"] += 1
        if result.done == 0 and not result.cancelled:  # refused before anything ran: the program as sent gives the
            # exact refusal
            return await worker.ask("run", program=program, fetch=fetch)
        done, fix = repair(program, rewritten, origins, result.done, ctx)
        if fix:
            fixed: RunResult = await worker.ask("run", program=fix, fetch=())
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

    def _place(self, program: Sequence[Instr]) -> ActorRef:
        """All tensors of a session live on one worker: op-cuda when that role runs (its executor runs an op
        without a CUDA kernel on the CPU kernel itself), else op-cpu."""
        worker = self.workers.get("op-cuda") or self.workers.get("op-cpu")
        if worker is None:
            raise DeepxError("no op worker runs on this node: start deepxd with --role including op-cpu or op-cuda")
        return worker

    async def on_explain(self, program: Sequence[Instr], fetch: Sequence[str] = ()) -> dict[str, Any]:
        """The program's text before and after the passes, against the worker's tensors as they are now."""
        ctx = await self._context(self._place(program), program, fetch)
        before, after = explain(program, ctx.metas, fetch, self.passes, keep=ctx.keep, variables=ctx.variables,
                                vectors=ctx.vectors, fuse_min_elements=self.fuse_min_elements)
        return {"before": before, "after": after, "passes": list(self.passes)}

    async def on_backward(self, forward: Sequence[Instr], loss: str, wrt: Sequence[str], grad_loss: str | None = None,
                          prefix: str = "g_", capture: bool = False, names: dict[str, str] | None = None
                          ) -> dict[str, Any]:
        """Autograd in the middle end: rewrite the recorded forward graph into its backward program (gradient rules
        from the catalogue's table in deepxd/compiler/autograd.py), run it, and say which tensor holds each
        gradient (`names`, where given: wrt -> the name its gradient takes). The forward has already run; its
        tensors are still there. `capture` (dx.compile): the answer carries the backward program too."""
        worker = self._place(forward)
        metas = await worker.ask("metas", names=sorted(_names_of(forward, loss, wrt, grad_loss)))
        variables, vectors = await self._variables(worker) if _names_variables(forward) else ({}, {})
        program, grads = self._derive(forward, loss, wrt, grad_loss, prefix, metas, names, variables, vectors)
        self._taken_from_udp(program)  # the gradients it writes are the native client's
        result = await self._run_program(worker, program, [])  # through the passes, as a step's backward goes
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
        from deepx_core.ir.instr import probe, same_program, scalar_kinds
        from deepx_core.ir.ops import SymbolicEnv
        from deepxd.compiler.autograd import grad_program

        forward = forward if type(forward) is list else list(forward)
        if variables or vectors:
            program, grads = grad_program(forward, loss, list(wrt), SymbolicEnv(metas, dict(variables or {}),
                                                                                dict(vectors or {})),
                                          grad_loss=grad_loss, prefix=prefix)
            return _renamed(program, grads, names, metas) if names else (program, grads)
        key = (*probe(forward), loss, tuple(wrt), grad_loss, prefix, tuple(names.items()) if names else None)
        for known, kinds, known_metas, program, grads in self.backwards.bucket(key):
            if known_metas == metas and same_program(forward, known, kinds):
                self.backward_hits += 1
                self.backwards.hit()
                return program, dict(grads)
        self.backward_misses += 1
        self.backwards.miss()
        program, grads = grad_program(list(forward), loss, list(wrt), SymbolicEnv(metas), grad_loss=grad_loss,
                                      prefix=prefix)
        if names:
            program, grads = _renamed(program, grads, names, metas)
        if len(forward) + len(program) <= REMEMBER_MAX:
            self.backwards.add(key, (forward, scalar_kinds(forward), dict(metas), program, grads))
        return program, dict(grads)

    # -- stored graphs (dx.compile): the plan of each is made once, then every replay binds into it
    async def _plan_graph(self, name: str, data: bytes) -> Any:
        from deepxd.compiler.graphs import plan_graph

        rows = await self._place(()).ask("tensors")
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
        metas, _, _ = await worker.ask("state")
        temporary = re.compile(re.escape(name) + r"\.t\d+")  # `.` may be in a graph's base name: digits only
        gone = [n for n in metas if temporary.fullmatch(n)]
        if gone:
            program = [Instr("deltensor", (), (Param.tensor(n, metas[n].dtype),)) for n in gone]
            result: RunResult = await worker.ask("run", program=program, fetch=[])
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
        when the graph is not planned here and no data came (the caller reads it from the plane and asks again)."""
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
        if bound.expect is not None:  # bound as the last replay was, which found its inputs fit: run if they still do
            result = await worker.ask("run", program=bound.program, fetch=list(fetch), expect=bound.expect)
            if result.stale:
                result = None
        if result is None:
            result = await self._replay_checked(name, worker, bound, fetch)
        done = self._replayed(name, plan, worker, bound, result, t0)
        return await done if isinstance(done, CoroutineType) else done

    def now_replay(self, name: str, inputs: dict[str, Any], outputs: dict[str, Any],
                   scalars: dict[str, Any] | None = None, fetch: Sequence[str] = ()) -> Any:
        """on_replay with no coroutine (LoopThread.now: dx.compile's replays in the embedded daemon), where the graph
        is planned here and bound as the last replay was (its inputs found to fit), both actors are idle with
        nothing waiting, and the worker runs the program inline (OpWorker.now_known). None, with nothing run and
        nothing counted, where on_replay must answer; else its answer, or a coroutine that finishes it (a failed
        replay's temporaries deleted)."""
        from deepxd.compiler.graphs import bind_replay

        plan = self.graphs.get(name)
        # only a binding of tensor names can be the last one again (with data to put, bind_replay binds afresh and
        # on_replay would bind once more)
        if plan is None or not plan.recent or not self.idle() or not all(type(v) is str for v in inputs.values()):
            return None
        worker = self._place(plan.plan)
        try:
            bound = bind_replay(plan, inputs, outputs, scalars or {})
        except DeepxError:  # on_replay says so, and counts it
            return None
        if bound.expect is None:
            return None
        fetch = list(fetch)
        known = worker.now("known", bound.program, fetch, None, bound.expect)
        if known is None or isinstance(known, RunResult):  # not inline, or stale: on_replay checks the inputs
            return None
        return self.now("replay", self._now_replay, name, plan, worker, bound, known, fetch)

    def _now_replay(self, name: str, plan: Any, worker: ActorRef, bound: Any, known: Any, fetch: list[str]) -> Any:
        t0 = time.perf_counter()
        self.now_hits += 1
        return self._replayed(name, plan, worker, bound, worker.now("run_known", known, fetch), t0)

    def _replayed(self, name: str, plan: Any, worker: ActorRef, bound: Any, result: RunResult, t0: float) -> Any:
        """on_replay's answer from the worker's: a coroutine to await where the replay failed (its temporaries are
        deleted, the error told of the graph's instructions)."""
        self.busy_s += time.perf_counter() - t0
        self.programs += 1
        self.replays += 1
        if result.error:
            self.failed += 1
            return self._replay_failed(name, plan, worker, bound, result)
        if not bound.puts and bound.bound_inputs:
            bound.expect = (tuple(bound.bound_inputs), [TensorMeta(shape, dtype) for dtype, shape in
                                                        bound.bound_inputs.values()], None)
        self.instructions += len(plan.record.instrs)
        result.done = len(plan.record.instrs)
        return result

    async def _replay_failed(self, name: str, plan: Any, worker: ActorRef, bound: Any,
                             result: RunResult) -> RunResult:
        from deepxd.compiler.pipeline import original_error

        rows = await worker.ask("tensors")
        outs = set(bound.outputs)
        junk = [r["name"] for r in rows if r["name"].startswith(f"{name}.") or r["name"] in outs]
        if junk:
            await worker.ask("run", program=[Instr("deltensor", (), (Param.tensor(n),)) for n in junk])
        k = result.error_index
        result.error = f"replay of graph {name!r}: {original_error(result.error, plan.origins)}"
        result.error_index = plan.origins[k] if 0 <= k < len(plan.origins) else k
        return result

    async def _replay_checked(self, name: str, worker: ActorRef, bound: Any, fetch: Sequence[str]) -> RunResult:
        """A replay's inputs checked against the tensors they name (a clear error for one that is missing or of
        another shape), the ones given as data put, then the run."""
        if bound.bound_inputs:
            have = await worker.ask("metas", names=sorted(bound.bound_inputs))
            for n, (dtype, shape) in bound.bound_inputs.items():
                m = have.get(n)
                if m is None:
                    raise DeepxError(f"replay of graph {name!r}: input tensor {n!r} not found")
                if (m.dtype, tuple(m.shape)) != (dtype, shape):
                    raise DeepxError(f"replay of graph {name!r}: input tensor {n!r} is {m.dtype}{list(m.shape)}; "
                                     f"the graph needs {dtype}{list(shape)}")
        for k, (n, dt, dims, buf) in enumerate(bound.puts):
            try:
                await worker.ask("put", name=n, dtype=dt, shape=dims, data=buf)
            except DeepxError as e:  # the inputs put before this one are freed: a refused replay leaves nothing
                if k:
                    await worker.ask("run", program=[Instr("deltensor", (), (Param.tensor(p[0]),))
                                                     for p in bound.puts[:k]])
                raise DeepxError(f"replay of graph {name!r}: {e}") from None
        result: RunResult = await worker.ask("run", program=bound.program, fetch=list(fetch))
        return result

    def on_stats(self) -> dict[str, float]:
        return {"programs": self.programs, "instructions": self.instructions, "failed": self.failed,
                "busy_s": self.busy_s, "rewritten": self.rewritten, "eliminated": self.eliminated,
                "plan_hits": self.compiled.hits, "plan_misses": self.compiled.misses, "graphs": len(self.graphs),
                "replays": self.replays, "fast_hits": self.fast_hits, "now_hits": self.now_hits, "beside": self.beside,
                "backward_hits": self.backward_hits, "backward_misses": self.backward_misses}
