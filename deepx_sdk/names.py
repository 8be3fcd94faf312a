"""A session's tensor names: new ones, those of collected temporaries kept for reuse, and what the pending program
did with them.

Names are unique across the clients of one daemon: the session's prefix and a number. A loop sends the same program
every step only if its results are named alike every step, so the names of collected temporaries are kept per
(shape, dtype) and handed out again, the lowest-numbered first (decision 0008). A program that fails part-way leaves
names that were handed out to results it never made: those must neither be read nor deleted (`lost`), and a name
whose older value may still stand is deleted before it is used again (`stale`).
"""

from __future__ import annotations

import itertools
from bisect import insort
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, cast

from deepx_core.ir.effects import apply_effect
from deepx_core.ir.instr import Instr, same_program, scalar_kinds
from deepx_core.ir.renaming import Inputs, inputs_of, renamed_at

# a named tuple made without its Python-level __new__ (one flush, one call fewer)
_tuple_new = tuple.__new__


#: the mark of a backward, which the daemon expands into the backward program of its forward (no op of the catalogue)
_BACKWARD = "backward"


def _given(instr: Instr) -> tuple[str, ...]:
    """The tensors an instruction gives a value (its op's effect); a backward mark's: its gradients."""
    if instr.name == _BACKWARD:
        return tuple(str(p.value) for p in instr.returns if p.category == "tensor")
    return apply_effect(instr).writes



def name_order(name: str) -> tuple[int, str]:
    """A session's names are its prefix and a number: by length, then text, is by number."""
    return len(name), name


#: a tensor's (shape, dtype)
Meta = tuple[Any, str]


class _Graph:
    """A forward graph differentiated before (NamePool.differentiated): the request, and the metas of the tensors
    its forward reads, for a forward under new names (`renamed`)."""

    __slots__ = ("forward", "grad_loss", "inputs", "kinds", "loss", "metas", "wrt")

    def __init__(self, spec: dict[str, Any], metas: dict[str, Meta]) -> None:
        self.forward = list(spec["forward"])
        self.kinds = scalar_kinds(self.forward)
        self.loss, self.wrt, self.grad_loss = spec["loss"], list(spec["wrt"]), spec["grad_loss"]
        self.metas = metas
        self.inputs: Inputs | bool | None = False  # worked out at the first renamed look

    def same(self, spec: dict[str, Any]) -> bool:
        return (self.loss == spec["loss"] and self.wrt == spec["wrt"] and self.grad_loss == spec["grad_loss"]
                and same_program(spec["forward"], self.forward, self.kinds))

    def renamed(self, spec: dict[str, Any], metas: Callable[[], dict[str, Meta]]) -> bool:
        """Whether `spec` is this request with the forward's inputs (what it reads and never makes; the parameters
        it differentiates stay) renamed one to one, each new name of its old one's shape and dtype."""
        if self.loss != spec["loss"] or self.wrt != spec["wrt"] or self.grad_loss != spec["grad_loss"]:
            return False
        inputs = self.inputs
        if inputs is False:
            fixed = (self.loss, *self.wrt, *([self.grad_loss] if self.grad_loss else []))
            inputs = self.inputs = inputs_of([self.forward], [], fixed)
        if inputs is None:
            return False
        assert isinstance(inputs, Inputs)
        forward = spec["forward"]
        mapping = inputs.mapping([forward])
        if not mapping:
            return False
        known = renamed_at(self.forward, inputs.where(inputs.at[0], mapping), mapping)
        if not same_program(forward, known, self.kinds):
            return False
        now = metas()
        return all(old in self.metas and self.metas[old] == now.get(new) for old, new in mapping.items())


class HandOut(NamedTuple):
    """What the names did in one program, taken when it is sent (NamePool.sent) and read if it fails."""

    mark: int  # names numbered above this were made for it
    revived: set[str]  # deleted names handed out again
    reused: set[str]  # pooled names (or a replaced handle's) handed out: an older value stands under each
    taken: dict[str, int]  # name -> where in the program its result stands, the last time it was handed out


#: what the next program must do after a failure: (name, dtype, None) deletes whatever stands under the name;
#: (name, dtype, instr) sends that deletion again
Redo = tuple[str, Any, Instr | None]


class NamePool:
    """The names of one session and their bookkeeping.

    `lost`, `reused`, `taken` and `pool` are read and written in place by the recording hot path (tensor._emit and
    Recorder.reuse_name: one call per op, decision 0007); everything else goes through the methods."""

    def __init__(self, prefix: str, pool_per_shape: int = 16, freed_per_shape: int = 256) -> None:
        self.prefix = prefix
        self._numbers = itertools.count()
        self._mark = -1  # names numbered above it were made since the last program was sent
        # gradient names: f"{grad_root}{k}_{i}" for backward k; k is taken again once every gradient handle of the
        # backward that had it is gone (deleted in the daemon), so that a training step sends the same backward
        # request every time and the daemon's caches see a repeat. Those names are never pooled (see release)
        self.grad_root = f"{prefix}g"
        self._grad_live: dict[int, int] = {}  # k -> live gradient handles; -1: never handed out again
        # k -> the last few graphs differentiated under it, their backward run whole (see differentiated)
        self._grad_graphs: dict[int, list[_Graph]] = {}
        # names of collected temporaries kept for reuse, by (shape, dtype), with their tensors: the next result of
        # that shape and dtype takes one, so a loop sends the same instructions every step (the daemon's checks are
        # then cached, and it writes into the buffer it already has) and needs no deltensor at all
        self.pool: dict[tuple[Any, str], list[str]] = {}
        self.pool_per_shape = pool_per_shape
        # deleted names kept for reuse per shape and dtype (names only, no buffers: a model that makes a few dozen
        # large results of one shape every step, a transformer's (batch, length, width), names them alike each step)
        self.freed: dict[tuple[Any, str], list[str]] = {}
        self.freed_per_shape = freed_per_shape
        # names deleted by the pending program: handed out again only once it has gone, so that a name is never
        # written again by the program that deleted it (a later value in a dead one's name would keep the daemon's
        # fuse pass from joining the op that wrote the dead value to the op that read it)
        self._freed_now: dict[tuple[Any, str], list[str]] = {}
        # the pending program's hand-outs (see HandOut): taken and reset when it is sent
        self._revived: set[str] = set()
        self.reused: set[str] = set()
        self.taken: dict[str, int] = {}
        # tensors whose creating instruction never ran (a program failed before it): Python must not delete them
        self.lost: set[str] = set()
        # names handed out to results whose older value's deletion is pending (in `lost` as well): sent again, not
        # dropped, where it does not run
        self._stale: set[str] = set()

    def new_name(self) -> str:
        return f"{self.prefix}{next(self._numbers)}"

    def take_freed(self, shape: Any, dtype: str, at: int) -> str:
        """A name for the result of the instruction at index `at` of the pending program: a deleted one of this
        shape and dtype where there is one (its tensor exists again once the program has run), else a new one."""
        names = self.freed.get((shape, dtype))
        if names:
            name = names.pop(0)
            self._revived.add(name)
        else:
            name = f"{self.prefix}{next(self._numbers)}"
        self.taken[name] = at
        return name

    def take_pooled(self, shape: Any, dtype: str) -> str | None:
        """A pooled name of this shape and dtype (its tensor exists), for data sent from Python; None where none is."""
        names = self.pool.get((shape, dtype))
        return names.pop(0) if names else None

    def release(self, collected: deque[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
        """The names of collected handles (name, dtype, shape or None: never pooled[, True: deleted all the same]),
        taken from `collected` in the order Python collected them: pooled, kept for reuse once deleted, or let go.
        Returns the handles whose tensors are to be deleted, in order; a lost one's tensor never came to exist."""
        dead = []
        lost, pool, freed_now = self.lost, self.pool, self._freed_now
        while collected:
            try:
                item = collected.popleft()
            except IndexError:  # another thread took it
                break
            name, dtype, shape = item[0], item[1], item[2]
            if lost and name in lost:
                lost.discard(name)
                continue
            if shape is None and name.startswith(self.grad_root):
                self._grad_gone(name)
            elif shape is not None:
                pooled = len(item) == 3
                kept = pool if pooled else freed_now
                names = kept.get((shape, dtype))
                if names is None:
                    names = kept[(shape, dtype)] = []
                if len(names) < (self.pool_per_shape if pooled else self.freed_per_shape):
                    insort(names, name, key=name_order)
                    if pooled:
                        continue  # kept, buffer and all, for the next result of its shape
                elif pooled:  # the pool is full: deleted, its name kept as a large result's (so that a model with
                    # more temporaries of one shape than the pool holds names them alike every step)
                    freed = freed_now.get((shape, dtype))
                    if freed is None:
                        freed = freed_now[(shape, dtype)] = []
                    if len(freed) < self.freed_per_shape:
                        insort(freed, name, key=name_order)
            dead.append(item)
        return dead

    def clear_pool(self) -> list[tuple[str, str]]:
        """Forget every kept name: returns (name, dtype) of the pooled ones, whose tensors are to be deleted (the
        freed ones are deleted already)."""
        dead = [(name, dtype) for (_, dtype), names in self.pool.items() for name in names]
        self.pool.clear()
        self.freed.clear()
        self._freed_now.clear()
        return dead

    def dropped(self) -> set[str]:
        """The names kept for reuse (pooled or freed): no handle stands for them."""
        return {n for names in self.pool.values() for n in names} | {n for names in self.freed.values() for n in names}

    def sent(self) -> HandOut:
        """The pending program is being sent: its hand-outs (for forget_unrun, should it fail), and a fresh start for
        the next one; the names it deletes may be handed out from now on."""
        out = _tuple_new(HandOut, (self._mark, self._revived, self.reused, self.taken))
        self._revived, self.reused, self.taken = set(), set(), {}
        if self._freed_now:
            freed, cap = self.freed, self.freed_per_shape
            for key, names in self._freed_now.items():
                kept = freed.get(key)
                if kept is None:
                    kept = freed[key] = []
                for name in names:
                    if len(kept) < cap:
                        insort(kept, name, key=name_order)
            self._freed_now = {}
        self._mark = next(self._numbers)
        return out

    def all_made(self) -> None:
        """Every name numbered so far was made or is known lost (data was put, or a replay made its outputs with
        nothing else pending), as after a program: a later failed program that writes one in place does not count it
        among the tensors never made."""
        self._mark = next(self._numbers)

    def not_pending(self, names: Sequence[str]) -> None:
        """These names were handed out to results that no pending program makes (a graph replay made them, or
        failed): nothing of a later program's failure is to be read off them."""
        self.reused.difference_update(names)
        for name in names:
            self.taken.pop(name, None)

    def made(self, names: Sequence[str]) -> None:
        """These names' tensors exist (a graph replay made them): a later failed program must not count one as never
        made, or its tensor would never be deleted."""
        self._revived.difference_update(names)

    def never_made(self, name: str) -> None:
        """The tensor of this handle never came to exist (its data never arrived): Python must not delete it."""
        self.lost.add(name)

    def forget_unrun(self, program: Sequence[Instr], done: int, out: HandOut) -> list[Redo]:
        """Instructions from `done` on did not run: the tensors they would have made do not exist (Python must not
        delete them when it collects their handles), and the deletions among them did not happen. Returns what the
        next program must do (Redo), in order.

        A result's name handed out in this program (`out.taken`: where its instruction stands) whose instruction did
        not run has no value: counted as never made, so that reading it raises. Where an older value may stand under
        that name (a pooled temporary's, `out.reused`, or one an instruction that ran wrote before the name was
        handed out again) the next program deletes it (a newtensor first, which keeps what stands there and makes a
        tensor where nothing does, so that the delete finds one either way). A result made before `done` and written
        in place after it keeps its value. Names handed out otherwise are counted as never made where they are new
        since `out.mark`, or revived (a deleted name handed out again), and nothing that ran wrote them."""
        made = {name for instr in program[:done] for name in _given(instr)}
        taken, reused, revived, mark = out.taken, out.reused, out.revived, out.mark
        lost = self.lost
        prefix, n = self.prefix, len(self.prefix)
        unrun_deletes = []
        stale: dict[str, Any] = {}
        for instr in program[done:]:
            if apply_effect(instr).deleted:
                unrun_deletes.append(instr)
                continue
            if instr.name == _BACKWARD:  # its gradients never came to exist, and its prefix is not handed out again
                names = [str(p.value) for p in instr.returns]
                lost.update(names)
                head = names[0][len(self.grad_root):].partition("_")[0] if names else ""
                if head.isdigit():
                    self.grad_prefix_failed(int(head))
                continue
            given = _given(instr)
            for p in instr.returns:
                name = p.value
                if p.category != "tensor" or name not in given:
                    continue
                at = taken.get(name)
                if at is not None:
                    if at < done:
                        continue  # its value was made; a later write in place did not run
                    if name in reused or name in made:
                        stale.setdefault(name, p.precisions[0])
                    else:
                        lost.add(name)
                elif name not in made and (name in revived or (name.startswith(prefix) and name[n:].isdigit()
                                                               and int(name[n:]) > mark)):
                    lost.add(name)
        if self._stale:
            self._stale.difference_update(name for i in program[:done] for name in apply_effect(i).deleted)
        redo: list[Redo] = []
        for name, dtype in stale.items():  # deleted first, so that no older value stays under a result's name
            redo.append((name, dtype, None))
            lost.add(name)
            self._stale.add(name)
        for instr in unrun_deletes:
            name = cast(str, instr.returns[0].value)
            if name in self._stale:
                if name in stale:  # made and dropped in this program: no handle left, its deletion queued above
                    lost.discard(name)
                else:  # an older value's deletion, queued by an earlier failure: still to be done
                    redo.append((name, instr.returns[0].precisions[0], None))
            elif name in lost:
                lost.discard(name)
            else:
                redo.append((name, instr.returns[0].precisions[0], instr))
        if lost:
            # a temporary collected while its program was pending was pooled as the flush began (a pooled name has no
            # handle left): it never came to exist, so it is neither pooled nor waited for
            for names in self.pool.values():
                for name in [m for m in names if m in lost]:
                    names.remove(name)
                    lost.discard(name)
        return redo

    def ran(self) -> None:
        """A program ran whole: the older values' deletions it carried are done."""
        if self._stale:
            self._stale.clear()

    # -- gradient names
    def grad_prefix(self) -> tuple[str, int]:
        """The name prefix of the next backward's gradients and temporaries: the first whose gradients are all gone."""
        k = 0
        live = self._grad_live
        while k in live:
            k += 1
        return f"{self.grad_root}{k}_", k

    def grad_prefix_taken(self, k: int, handles: int) -> None:
        """Backward k made `handles` gradient handles: k is handed out again once they are all gone."""
        if handles:
            self._grad_live[k] = handles

    def grad_prefix_failed(self, k: int) -> None:
        """A backward that failed may have left tensors of prefix k in the daemon: never hand k out again."""
        self._grad_live[k] = -1
        self._grad_graphs.pop(k, None)

    def differentiated(self, k: int, spec: dict[str, Any], metas: Callable[[], dict[str, Meta]]) -> bool:
        """Whether backward request `spec` (forward graph, loss, wrt, upstream gradient, gradient names) was run
        under gradient prefix k before: then it is recorded into the step's program, and a loop sends one program
        per step. The first backward of a graph under a prefix is sent on its own, so that its errors are raised at
        the line of backward(), as torch raises them. Whether the step then repeats is the daemon's to judge.
        A known forward with its inputs under other names of the same shapes and dtypes (a held batch: `metas()`,
        those of the tensors the forward reads) is known too: its backward is derived alike (decision 0049)."""
        graphs = self._grad_graphs.get(k)
        if not graphs:
            return False
        for graph in graphs:
            if graph.same(spec):
                return True
        return any(graph.renamed(spec, metas) for graph in graphs)

    def note_differentiated(self, k: int, spec: dict[str, Any], metas: dict[str, Meta]) -> None:
        """Backward request `spec` ran under gradient prefix k (see differentiated), `metas` those of the tensors its
        forward reads; the last four are kept per k."""
        graphs = self._grad_graphs.setdefault(k, [])
        if not any(graph.same(spec) for graph in graphs):
            graphs.append(_Graph(spec, metas))
            del graphs[:-4]

    def _grad_gone(self, name: str) -> None:
        head = name[len(self.grad_root):].partition("_")[0]
        if head.isdigit():
            k = int(head)
            n = self._grad_live.get(k)
            if n is not None and n > 0:
                if n == 1:
                    del self._grad_live[k]
                else:
                    self._grad_live[k] = n - 1
