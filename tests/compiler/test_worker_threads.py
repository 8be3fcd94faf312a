"""Where an op worker runs a program: heavy ones on its own thread, off the event loop, unless every program runs
inline (inline_elements -1, the embedded daemon)."""

from __future__ import annotations

import numpy as np
import pytest

from deepx_core.ir.text import parse_text
from deepxd.actors.messages import Put, RunProgram
from deepxd.actors.opcpu import CpuWorker
from tests.compiler.helpers import execute_threads


@pytest.mark.parametrize("inline", [65536, -1])
async def test_a_heavy_program_runs_off_the_event_loop_unless_every_program_runs_inline(inline: int) -> None:
    """A worker hands heavy programs (a large matmul) to its thread; inline_elements -1 (the embedded daemon) runs
    every program on the event loop. Same results either way."""
    import threading

    worker = CpuWorker(output_log=False, inline_elements=inline)
    worker.start()
    try:
        a = np.ones((256, 512))
        await worker.ref.ask(Put(name="a", dtype="float64", shape=[256, 512], data=a.tobytes()))
        threads = execute_threads(worker)
        prog = parse_text("transpose (tensor<float64>:a, vector<int32>:[1 0]) -> (tensor<float64>:t)\n"
                          "matmul (tensor<float64>:a, tensor<float64>:t) -> (tensor<float64>:m)")
        r = await worker.ref.ask(RunProgram(program=prog, fetch=["m"]))
        assert not r.error
        np.testing.assert_array_equal(r.tensors["m"], a @ a.T)
        loop_thread = threading.current_thread().name
        assert (threads == {loop_thread}) == (inline < 0)
    finally:
        await worker.stop()
