"""What a session tells the daemon about its tensors, for `deepxctl tensors ls`: a parameter's module path
(`0.weight`, PARAMETER) and the line of user code that made a tensor (`train.py:12`, CALL SITE). Each is sent once,
in a `label` request after the program or put that made the tensor (deepxd/owners.py), and again only where it
changed: a training loop sends none after its first step.

Call sites are taken for parameters and for data sent from Python (dx.tensor, nn.Parameter(array)): one look up the
stack each, where the tensor is made. DEEPX_CALLSITES=1 takes them for every tensor: the line each instruction came
from is kept anyway (for error messages), and at each flush the results' lines are compared with what was sent.
A loop hands its temporaries' names to other lines from step to step, so these are sent at most once a second
(CALLSITES_EVERY_S), never per step (bench/labels.py measures what the mode costs).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

#: DEEPX_CALLSITES=1: the call sites of results are sent at most this often
CALLSITES_EVERY_S = 1.0


def all_callsites() -> bool:
    """Whether DEEPX_CALLSITES=1: every tensor's call site, not only parameters' and data's."""
    return os.environ.get("DEEPX_CALLSITES", "").strip() == "1"


class Labels:
    """The labels of one session's tensors: those to send (`pending`) and those the daemon has.

    `describe` turns an origin (deepx_sdk.recorder.origin: a code object and an offset, packed) into `file:line`."""

    def __init__(self, describe: Callable[[Any], str | None], all_sites: bool = False) -> None:
        self.describe = describe
        self.all_sites = all_sites
        self.pending: dict[str, dict[str, str]] = {}
        self._sent: dict[str, dict[str, str]] = {}  # name -> the labels the daemon has
        self._origins: dict[str, Any] = {}  # name -> the origin its call site was worked out from
        self.enabled = True  # False once a daemon refused the request (one from before it)
        self.requests = 0  # label requests sent: a training loop's stay as its first step left them
        self.urgent = False  # a parameter's or data's label is pending: sent with the next request
        self._last = 0.0  # monotonic time of the last take()

    def made_at(self, name: str, where: Any) -> None:
        """Parameter or data tensor `name` was made at `where` (an origin entry; None: unknown)."""
        if self._site(name, where):
            self.urgent = True

    def made(self, taken: dict[str, int], where: list[Any]) -> None:
        """Each name in `taken` was handed to the result of the instruction at that index of a program whose
        instructions came from `where` (DEEPX_CALLSITES=1)."""
        origins = self._origins
        n = len(where)
        for name, i in taken.items():
            if i < n:
                w = where[i]
                if w is not None and origins.get(name) != w:
                    self._site(name, w)

    def parameter(self, name: str, path: str) -> None:
        """Tensor `name` is the parameter at `path` of a module (named_parameters' name)."""
        if self._set(name, "parameter", path):
            self.urgent = True

    def due(self) -> bool:
        """Whether to send the pending labels now: a parameter's or data's at once, results' call sites at most
        every CALLSITES_EVERY_S."""
        return bool(self.pending) and (self.urgent or time.monotonic() - self._last >= CALLSITES_EVERY_S)

    def _site(self, name: str, where: Any) -> bool:
        if where is None or self._origins.get(name) == where:
            return False
        self._origins[name] = where
        site = self.describe(where)
        return site is not None and self._set(name, "call_site", site)

    def _set(self, name: str, key: str, value: str) -> bool:
        """Queue a label; False where the daemon has it already."""
        pending = self.pending.get(name)
        if pending is not None:
            pending[key] = value
        elif self._sent.get(name, {}).get(key) != value:
            self.pending[name] = {key: value}
        else:
            return False
        return True

    def take(self) -> dict[str, dict[str, str]]:
        """The labels to send now, counted as sent."""
        out, self.pending = self.pending, {}
        self.urgent, self._last = False, time.monotonic()
        for name, label in out.items():
            self._sent.setdefault(name, {}).update(label)
        return out
