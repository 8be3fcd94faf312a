"""The scheduler: the middle end at run time. It receives programs, places them on an op worker and answers with
what happened. Programs run one at a time, in arrival order, so that each is checked against the state the one
before it left. (Compiler passes and placement across several workers and nodes build on this.)"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from deepx_sdk.errors import DeepxError
from deepx_sdk.ir.instr import Instr
from deepx_sdk.ir.ops import OPS
from deepxd.actors.base import Actor, ActorRef
from deepxd.actors.opcpu import RunResult

log = logging.getLogger(__name__)


class Scheduler(Actor):
    role = "scheduler"

    def __init__(self, workers: dict[str, ActorRef], name: str = "scheduler") -> None:
        super().__init__(name)
        self.workers = workers
        self.programs = 0
        self.instructions = 0
        self.failed = 0
        self.busy_s = 0.0

    async def on_run(self, program: Sequence[Instr], fetch: Sequence[str] = ()) -> RunResult:
        for i, instr in enumerate(program):
            if instr.name not in OPS:
                self.failed += 1
                return RunResult(error=f"instruction {i + 1}: op '{instr.name}' not found", error_index=i,
                                 t0=time.time())
        worker = self._place(program)
        t0 = time.perf_counter()
        result: RunResult = await worker.ask("run", program=program, fetch=fetch)
        self.busy_s += time.perf_counter() - t0
        self.programs += 1
        self.instructions += result.done
        self.failed += bool(result.error)
        return result

    def _place(self, program: Sequence[Instr]) -> ActorRef:
        worker = self.workers.get("op-cpu")
        if worker is None:
            raise DeepxError("no op worker runs on this node: start deepxd with --role including op-cpu")
        return worker

    def on_stats(self) -> dict[str, float]:
        return {"programs": self.programs, "instructions": self.instructions, "failed": self.failed,
                "busy_s": self.busy_s}
