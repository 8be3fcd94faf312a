"""Helpers shared by the actor tests."""

from __future__ import annotations

import math
import time
from typing import Any

from deepx_core.ir import parse_text
from deepxd.actors.base import ActorRef
from deepxd.actors.messages import RunProgram


async def product_chain(worker: ActorRef, seconds: float, at_least: int) -> list[Any]:
    """A program of dependent products of the worker's tensor `a` (put before) that runs about `seconds` on this
    machine, and at least `at_least` of them: a fixed count runs inside a heartbeat on a machine fast enough. Sized
    by the fastest of three timed products, after a warm one, so that a moment of load while timing does not make
    it short; two output names taken in turn (b0, b1): the memory of two products, however many."""
    one = "matmul (tensor<float32>:a, tensor<float32>:a) -> (tensor<float32>:b0)"
    timed = []
    for _ in range(4):
        t0 = time.perf_counter()
        assert not (await worker.ask(RunProgram(program=parse_text(one), fetch=[]))).error
        timed.append(time.perf_counter() - t0)
    links = max(at_least, math.ceil(seconds / min(timed[1:])))
    return parse_text("\n".join(
        [one] + [f"matmul (tensor<float32>:b{k % 2}, tensor<float32>:a) -> (tensor<float32>:b{(k + 1) % 2})"
                 for k in range(links - 1)]))
