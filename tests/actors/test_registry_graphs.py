"""The registry writes back the stored graphs its scheduler planned when the storage plane lost its data: only where
no graph of that name stands, and again at the next heartbeat where the scheduler could not answer in time. Real
actors (op-cpu, scheduler, registry) on a real in-memory plane."""

from __future__ import annotations

import asyncio

import numpy as np

from deepx_core.graphrecord import GraphRecord
from deepx_core.ir import parse_text
from deepxd.actors.messages import Put, Run, StoreGraph
from deepxd.actors.opcpu import CpuWorker
from deepxd.actors.registry import Registry
from deepxd.actors.scheduler import Scheduler
from deepxd.config import Config
from deepxd.kv.memory import MemoryKV
from tests.actors.conftest import product_chain

#: how long the busy scheduler's program runs, at the speed measured before it: 40 heartbeats of the test's 0.05 s
LONG_RUN_S = 2.0


def record(name: str, scale: float) -> bytes:
    program = parse_text(f"mulscalar (tensor<float32>:{name}.in0, var<float32>:{scale}) -> "
                         f"(tensor<float32>:{name}.out0)")
    return GraphRecord(name, program, [(f"{name}.in0", "float32", (2,))], [(f"{name}.out0", "float32", (2,))]).pack()


async def test_graphs_come_back_only_where_missing_and_after_a_busy_scheduler() -> None:
    kv = MemoryKV()
    await kv.connect()
    worker = CpuWorker(output_log=False)
    scheduler = Scheduler({"op-cpu": worker.ref}, config=Config())
    registry = Registry(kv, "n1", roles=["scheduler", "op-cpu"], addresses={}, heartbeat_s=0.05,
                        scheduler=scheduler.ref)
    worker.start()
    scheduler.start()
    try:
        for name, scale in (("g1", 2.0), ("g2", 3.0)):
            await kv.set(f"graph:{name}", record(name, scale))
            await scheduler.ref.ask(StoreGraph(name=name, data=record(name, scale)))
        await registry.flush()
        for key in await kv.keys("*"):  # the plane restarted empty...
            await kv.delete(key)
        await kv.set("graph:g2", record("g2", 5.0))  # ...and g2 was stored again, newer, before the heartbeat
        a = np.full((1536, 1536), 1 / 1536, np.float32)
        await worker.ref.ask(Put(name="a", dtype="float32", shape=list(a.shape), data=a.tobytes()))
        # dependent products far longer than a heartbeat on this machine: a fixed twelve took 0.85 s on one machine
        # and would end inside the flush on one that computes them 15 times as fast
        long_run = await product_chain(worker.ref, LONG_RUN_S, at_least=12)
        busy = asyncio.ensure_future(scheduler.ref.ask(Run(program=long_run, fetch=[])))
        await asyncio.sleep(0.01)
        await registry.flush()  # the record is lost; the scheduler, busy, does not answer within the heartbeat
        assert not busy.done()
        assert not await kv.exists("graph:g1")
        assert not (await busy).error
        await registry.flush()  # the next heartbeat tries again
        assert await kv.get("graph:g1") == record("g1", 2.0)
        assert await kv.get("graph:g2") == record("g2", 5.0)  # the newer one stands
        await kv.delete("graph:g1")
        await registry.flush()  # written back once: a graph deleted later, with the node record there, stays gone
        assert not await kv.exists("graph:g1")
    finally:
        await scheduler.stop()
        await worker.stop()
        await kv.close()
