"""A plan: one program as the scheduler made it runnable, cached once and run again by the worker it was placed on.

The scheduler makes a plan the first time a program comes (its backward instructions expanded, the passes run) and
keeps it in its one plan cache, keyed by `probe(program)`; the worker checks the plan's program the first time it
runs it and keeps its part on the plan (`Prepared`: each instruction checked and prepared for the executor, and
what that check read of the worker's tensors). A repeat of the program (the same instructions, new numbers in its
optimizer updates, or new names for its inputs: `Plan.renamed`) finds the plan, and the worker runs it on one
condition: its state's version is the one the plan's last run left, or else the tensors the plan read are as it
found them. Where neither holds the plan does not stand (the worker runs nothing and answers None) and the scheduler
makes another for the state as it is.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from deepx_core.ir.instr import Instr, rekinded, renumbered, same_program, scalar_kinds
from deepx_core.ir.ops import Bound, TensorMeta
from deepx_core.ir.renaming import Inputs, inputs_of, renamed_at

if TYPE_CHECKING:
    from deepxd.actors.base import ActorRef
    from deepxd.actors.worker import OpWorker
    from deepxd.compiler.analysis import PassContext

#: a backward instruction of the program, as a plan keeps it: (index, loss, wrt, grad_loss, prefix, names, forward,
#: the forward's scalar kinds)
BackwardSpec = tuple[int, str, list[str], "str | None", str, "dict[str, str] | None", list[Instr], Any]

_ids = itertools.count(1)


class Prepared:
    """The worker's part of a plan: its program checked against the worker's tensors (`bounds`), the calls prepared
    for the executor (`steps`, at the second run: a program run once is never prepared), and the state that check
    read: per tensor name the plan touches or was planned on (`names`), its meta before the program (None: absent)
    and whether it was a heap tensor. While those hold, the program checks the same way."""

    __slots__ = ("__weakref__", "after", "bounds", "deletes", "graph", "heaped", "heavy", "launches", "metas", "names",
                 "slots", "steps", "transient")

    def __init__(self, names: tuple[str, ...], metas: list[TensorMeta | None], heaped: list[bool],
                 bounds: list[Bound], heavy: bool, deletes: tuple[tuple[int, str], ...], transient: set[int]) -> None:
        self.names, self.metas, self.heaped = names, metas, heaped
        self.bounds = bounds
        self.steps: list[Any] = []  # prepared at the first repeat
        self.slots: list[Any] = []  # per instruction, its op's statistics and its bytes (filled at the first repeat)
        self.heavy = heavy  # it runs on the worker's thread
        self.deletes = deletes  # (index, name) of each deltensor
        self.transient = transient  # the transposes that become views
        self.after: list[bool] = []  # [whether a run leaves the metas of `names` as `metas`], worked out once
        self.graph: Any = None  # the executor's own record of the plan (op-cuda: its CUDA graph, opcuda.GraphSlot)
        # where its collectives start (deepxd/comm.py, early_launches), set with `steps` where it has any
        self.launches: dict[int, list[list[int]]] = {}


class Plan:
    """One program made runnable (see the module's doc). The scheduler's part is fixed once made, but for the numbers
    of optimizer updates (`renumber`); the worker's (`prepared`, `version`, `redo`) is the worker's to write."""

    __slots__ = ("_inputs", "backwards", "ctx", "expanded", "fetch", "id", "kinds", "origins", "pair_min", "prepared",
                 "program", "reads", "redo", "renames", "runs", "seen", "sent", "step_keys", "version", "where",
                 "worker")

    def __init__(self, program: list[Instr], fetch: tuple[str, ...], backwards: tuple[BackwardSpec, ...],
                 worker: ActorRef[OpWorker], sent: list[Instr], *, expanded: list[Instr] | None = None,
                 where: list[int] | None = None, origins: list[int] | None = None, ctx: PassContext | None = None,
                 reads: tuple[str, ...] = (), seen: int | None = None, step_keys: tuple[Any, ...] = ()) -> None:
        self.id = next(_ids)
        self.program, self.kinds, self.fetch, self.backwards = program, scalar_kinds(program), fetch, backwards
        self.worker = worker
        self.expanded, self.where = expanded, where  # the backwards expanded, and expanded position -> program's
        self.sent, self.origins = sent, origins  # what the worker runs; sent position -> planned (None: the same)
        self.ctx = ctx  # what the passes read (None: no pass ran): a failed run is set straight from it
        self.pair_min = ctx.fuse_pair_min_elements if ctx is not None else None
        self.reads = reads  # the names whose metas the derivation and the passes read, beyond what `sent` names
        # the version of the worker's state the scheduler planned on: the worker runs the plan first on that state
        # only (None: planned on none; the worker's check decides)
        self.seen = seen
        self.step_keys = step_keys  # its backward requests, as the scheduler counts the steps that repeat them
        self.runs = 0
        # the worker's part: its check and prepared calls (None: not yet, or not to keep), the version of its state
        # at which the plan stands as it is (-1: compare what it read), and the positions of `sent` whose numbers
        # changed since it was prepared
        self.prepared: Prepared | None = None
        self.version = -1
        self.redo: list[int] = []
        # inputs renamed since the worker bound it: (old name -> new, the positions of `sent` that name them)
        self.renames: list[tuple[dict[str, str], list[int]]] = []
        self._inputs: Inputs | bool | None = False  # worked out at the first renamed look (False: not yet)

    def __repr__(self) -> str:
        return f"Plan(#{self.id}, {len(self.program)} instructions -> {len(self.sent)})"

    @property
    def planned(self) -> list[Instr]:
        """What the passes took: the program with its backwards expanded."""
        return self.expanded if self.expanded is not None else self.program

    def matches(self, program: Sequence[Instr], fetch: Sequence[str], backwards: Sequence[dict[str, Any]] | None
                ) -> bool:
        """Whether `program` (with `fetch` and `backwards`) is this plan's again; or the same with new numbers in
        its optimizer updates (Adam's step count, a scheduled lr), which the plan then takes as its own."""
        if len(backwards or ()) != len(self.backwards) or tuple(fetch) != self.fetch:
            return False
        varied = None
        if not same_program(program, self.program, self.kinds):
            varied = renumbered(program, self.program)
            if not varied:
                return False
        if self.backwards and not self._same_backwards(backwards):
            return False
        return varied is None or self.renumber(program, varied)

    def renumber(self, program: Sequence[Instr], varied: list[int]) -> bool:
        """Take `program`'s updates (at positions `varied`) in place of this plan's, in the program, its expansion and
        what the worker runs, where each update stands alone (an update is never expanded, and the passes keep it
        as it came); the worker binds and prepares those again (`redo`). False, with the plan as it was, where an
        update cannot be found so."""
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
            sent, changed = found
        elif list(self.sent) == list(planned_old):  # (compared in C, the same objects first)
            sent = list(planned)
        else:
            return False
        self.kinds = rekinded(self.kinds, program, varied)
        self.program, self.expanded, self.sent = program, expanded, sent
        self.redo.extend(sorted(changed))
        return True

    def renamed(self, program: Sequence[Instr], fetch: Sequence[str], backwards: Sequence[dict[str, Any]] | None
                ) -> bool:
        """Whether `program` (with `fetch` and `backwards`) is this plan's with its inputs (Inputs) under other names,
        one to one, and perhaps new numbers in its optimizer updates: then the plan takes the names (and numbers) as
        its own, in its program, its expansion, what the worker runs and its backwards; the worker binds the
        instructions that name them again (`renames`), and compares the new tensors' metas with those it planned
        on, as it compares any state (a plan that does not stand there runs nothing)."""
        if len(program) != len(self.program) or len(backwards or ()) != len(self.backwards) or (
                tuple(fetch) != self.fetch):
            return False
        inputs = self._inputs
        if inputs is False:
            inputs = self._inputs = inputs_of([self.program, *(b[6] for b in self.backwards)],
                                              [self.expanded, self.sent], (*self.fetch, *self.reads_fixed()))
        if inputs is None:
            return False
        assert isinstance(inputs, Inputs)
        sources = [program, *((spec.get("forward") for spec in backwards) if backwards else ())]
        mapping = inputs.mapping(sources)
        if not mapping:
            return False
        known = renamed_at(self.program, inputs.where(inputs.at[0], mapping), mapping)
        varied = None
        if not same_program(program, known, self.kinds):
            varied = renumbered(program, known)
            if not varied:
                return False
        specs = tuple(_renamed_spec(spec, renamed_at(spec[6], at, mapping), mapping)
                      for spec, at in zip(self.backwards, (inputs.where(u, mapping) for u in inputs.at[1:])))
        if specs and not _same_backwards(backwards, specs):
            return False
        planned = self.planned
        expanded = None
        if self.expanded is not None:
            expanded = renamed_at(self.expanded, inputs.where(inputs.more[0], mapping), mapping)
        new_planned = expanded if expanded is not None else known
        at = inputs.where(inputs.more[1], mapping)
        sent = new_planned if self.sent is planned else renamed_at(self.sent, at, mapping)
        changed = [k for k in at if sent[k] is not self.sent[k]]
        self.program, self.expanded, self.sent, self.backwards = known, expanded, sent, specs
        self.reads = tuple(mapping.get(n, n) for n in self.reads)
        self.step_keys = tuple(tuple(sorted(spec[2])) for spec in self.backwards)
        inputs.renamed(mapping)
        if self.ctx is not None:  # a failed run is set straight from it: the metas under the new names
            from deepxd.compiler.pipeline import new_context

            ctx = self.ctx
            self.ctx = new_context({mapping.get(n, n): m for n, m in ctx.metas.items()}, fetch=ctx.fetch,
                                   keep=[mapping.get(n, n) for n in ctx.keep], cache=ctx.cache)
        self.renames.append((mapping, changed))
        if varied is not None:
            return self.renumber(program, varied)
        self.program = program if type(program) is list else list(program)
        return True

    def reads_fixed(self) -> tuple[str, ...]:
        """The names of its backwards that stay: each loss, gradient given to the loss, and gradient's name."""
        out: list[str] = []
        for _, loss, _, grad_loss, _, names, _, _ in self.backwards:
            out.append(loss)
            if grad_loss is not None:
                out.append(grad_loss)
            if names:
                out.extend(names.values())
        return tuple(out)

    def _same_backwards(self, backwards: Sequence[dict[str, Any]] | None) -> bool:
        return _same_backwards(backwards, self.backwards)


def _same_backwards(backwards: Sequence[dict[str, Any]] | None, known: Sequence[BackwardSpec]) -> bool:
    for spec, (index, loss, wrt, grad_loss, prefix, names, forward, kinds) in zip(backwards or (), known):
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


# ---------------------------------------------------------------- the same plan under new input names


def _renamed_spec(spec: BackwardSpec, forward: list[Instr], mapping: dict[str, str]) -> BackwardSpec:
    index, loss, wrt, grad_loss, prefix, names, _, kinds = spec
    return (index, loss, [mapping.get(w, w) for w in wrt], grad_loss, prefix,
            {mapping.get(w, w): g for w, g in names.items()} if names is not None else None, forward, kinds)


def renamed_bound(b: Bound, mapping: dict[str, str]) -> Bound:
    """A checked instruction with the tensors it reads (or deletes) renamed (the same metas: the caller compares
    them)."""
    def new(names: list[Any]) -> list[Any]:
        return [mapping.get(n, n) if type(n) is str else
                type(n)(mapping.get(x, x) for x in n) if type(n) in (list, tuple) else n for n in names]

    return b._replace(names=new(b.names), out_names=new(b.out_names))
