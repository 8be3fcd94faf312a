"""The ops that executors of other processes declare (deepxd/executors.py, docs/executor.md) have no kernel here:
the scheduler places their instructions on an executor. An instruction of one that reaches an op worker by another
way (a stored graph's replay, a separate backward request) is refused by this stand-in, naming the op."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from deepx_core.errors import DeepxError


def __getattr__(name: str) -> Callable[..., Any]:
    if name.startswith("__"):
        raise AttributeError(name)

    def served_elsewhere(*args: Any) -> None:
        raise DeepxError(f"{name}: only an executor of another process runs this op (docs/executor.md), and this "
                         "instruction reached the node's own worker, which has no kernel for it: send it in a "
                         "program of its own (`run`), where the scheduler places it on the executor")

    return served_elsewhere
