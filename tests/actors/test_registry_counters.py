"""The registry's op counters from a worker that is always busy: with programs back to back, each longer than a
heartbeat, the answer to an ask that timed out is taken at the next heartbeat (counters only grow), where a fresh
ask sent behind the next program never came back in time and the plane never had the counters. Real actors (op-cpu,
registry) on a real in-memory plane."""

from __future__ import annotations

import asyncio

import numpy as np

from deepxd.actors.messages import Put, RunProgram
from deepxd.actors.opcpu import CpuWorker
from deepxd.actors.registry import Registry
from deepxd.kv.memory import MemoryKV
from tests.actors.conftest import product_chain


async def test_counters_reach_the_plane_while_programs_run_back_to_back() -> None:
    kv = MemoryKV()
    await kv.connect()
    worker = CpuWorker(output_log=False)
    heartbeat = 0.05
    registry = Registry(kv, "n1", roles=["op-cpu"], addresses={}, heartbeat_s=heartbeat,
                        workers={"op-cpu": worker.ref})
    worker.start()
    try:
        a = np.full((1024, 1024), 1 / 1024, np.float32)
        await worker.ref.ask(Put(name="a", dtype="float32", shape=list(a.shape), data=a.tobytes()))
        # each program about ten heartbeats long on this machine
        long_run = await product_chain(worker.ref, 10 * heartbeat, at_least=4)
        links = len(long_run)
        first = asyncio.ensure_future(worker.ref.ask(RunProgram(program=long_run, fetch=[])))
        await asyncio.sleep(0.01)
        await registry.flush()  # op-cpu busy: answered between its slices, or late
        assert not first.done()
        assert not (await first).error
        # the next program is sent at once, ahead of anything the registry asks next
        second = asyncio.ensure_future(worker.ref.ask(RunProgram(program=long_run, fetch=[])))
        await asyncio.sleep(0.01)
        assert not second.done()
        await registry.flush()  # an answer of between slices, or one that came late: the counters as they stood
        calls = await kv.hget("ops:n1:op-cpu", "matmul.calls")
        assert calls is not None and 4 < int(float(calls)) <= 4 + 2 * links, calls  # (product_chain timed four)
        assert not (await second).error
        for _ in range(2):  # (the first may take an answer that came late)
            await registry.flush()
        assert int(float(await kv.hget("ops:n1:op-cpu", "matmul.calls"))) == 4 + 2 * links
    finally:
        await worker.stop()
        await kv.close()
