"""Whether `loss.backward()` is recorded into the step's program or sent on its own.

Recording it pays when the steps' programs repeat exactly (the daemon's caches then hold the whole step); a step
whose numbers change (a monitor computed from the learning rate) would put the whole step through the passes and
checks afresh each time, which costs more than the round trip it saves (decision 0011). This judgement is the SDK's
for now; it belongs to the daemon, which sees the repeats, and this module goes when the daemon takes it.
"""

from __future__ import annotations

import logging
from typing import Any

from deepx_core.cache import Cache
from deepx_core.ir.instr import Instr, renumbered, same_program, scalar_kinds

log = logging.getLogger(__name__)

#: how many backwards of a graph whose steps did not repeat go on their own before recording is tried again
LAZY_RETRY = 64


def backward_probe(spec: dict[str, Any]) -> Any:
    """What a backward request is looked up by (its forward's length and ends, loss, wrt, upstream gradient, prefix
    and names); None where it cannot be hashed (a list inside a param)."""
    forward = spec["forward"]
    try:
        probe = (len(forward), forward[0] if forward else None, forward[-1] if forward else None, spec["loss"],
                 tuple(spec["wrt"]), spec["grad_loss"], spec["prefix"], tuple(spec["names"].items()))
        hash(probe)
    except TypeError:
        return None
    return probe


class LazyBackward:
    """A repeat of a backward request the daemon derived before is recorded into the program (seen); the programs
    that carry one are compared (judge): after two in a row that repeat none of the last few, that graph's backward
    goes on its own again for the next LAZY_RETRY backwards of it, then is tried again (a learning-rate warm-up ends;
    the steps repeat from there)."""

    def __init__(self) -> None:
        self.enabled = True  # False: never recorded (a session may turn it off)
        # backward requests the daemon derived before, by probe
        self._seen: Cache[Any, list[tuple[list[Instr], Any]]] = Cache("sdk.backwards_seen", 64, per_key=4)
        self._programs: Cache[int, tuple[list[Instr], Any]] = Cache("sdk.step_programs", 4)  # by id
        self._misses: dict[Any, int] = {}  # probe -> programs in a row that repeated none
        self._off: dict[Any, int] = {}  # probe -> how many more of its backwards go on their own

    def seen(self, spec: dict[str, Any], remember: bool = False) -> bool:
        """Whether the daemon derived this backward request before (the same forward graph, loss, wrt, upstream
        gradient and names); `remember`: it just did."""
        forward = spec["forward"]
        probe = backward_probe(spec)
        if probe is None:
            return False
        off = self._off.get(probe)
        if off is not None:
            if off > 1:
                self._off[probe] = off - 1
            else:
                del self._off[probe]
                self._misses.pop(probe, None)
            return False
        for known, kinds in self._seen.bucket(probe):
            if same_program(forward, known, kinds):
                self._seen.hit()
                return True
        self._seen.miss()
        # only an exact repeat: a graph that differs from step to step (dropout's seed, names from a pool that
        # overflows) would send the whole step through the passes afresh, which costs more than the round trip saved
        if remember:
            self._seen.add(probe, (list(forward), scalar_kinds(forward)))
        return False

    def judge(self, program: list[Instr], backwards: list[dict[str, Any]]) -> None:
        """A program carrying backward instructions is being sent: does it repeat one of the last few exactly?"""
        probes = [p for p in map(backward_probe, backwards) if p is not None]
        for known, kinds in self._programs.newest():
            # a repeat, or one with new numbers in its optimizer updates (Adam's step count, a scheduled lr): the
            # daemon's caches hold both (instr.renumbered)
            if same_program(program, known, kinds) or renumbered(program, known):
                self._programs.hit()
                for p in probes:
                    self._misses.pop(p, None)
                return
        self._programs.miss()
        if self._programs:
            for p in probes:
                misses = self._misses[p] = self._misses.get(p, 0) + 1
                if misses >= 2:
                    self._off[p] = LAZY_RETRY
                    log.debug("this graph's backward() goes on its own from here: its steps do not repeat")
        self._programs.put(id(program), (program, scalar_kinds(program)))
