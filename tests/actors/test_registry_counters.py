"""The registry's op counters from a worker that is always busy: with programs back to back, each longer than a
heartbeat, the answer to an ask that timed out is taken at the next heartbeat (counters only grow), where a fresh
ask sent behind the next program never came back in time and the plane never had the counters. Real actors (op-cpu,
registry) on a real in-memory plane."""

from __future__ import annotations

import asyncio
import math
import time

import numpy as np

from deepx_sdk.ir import parse_text
from deepxd.actors.opcpu import CpuWorker
from deepxd.actors.registry import Registry
from deepxd.kv.memory import MemoryKV


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
        await worker.ref.ask("put", name="a", dtype="float32", shape=list(a.shape), data=a.tobytes())
        one = "matmul (tensor<float32>:a, tensor<float32>:a) -> (tensor<float32>:b0)"
        seconds = []
        for _ in range(4):
            t0 = time.perf_counter()
            assert not (await worker.ref.ask("run", program=parse_text(one), fetch=[])).error
            seconds.append(time.perf_counter() - t0)
        # each program about ten heartbeats long on this machine (the fastest timing, after a warm one)
        links = max(4, math.ceil(10 * heartbeat / min(seconds[1:])))
        long_run = parse_text("\n".join(
            [one] + [f"matmul (tensor<float32>:b{k % 2}, tensor<float32>:a) -> (tensor<float32>:b{(k + 1) % 2})"
                     for k in range(links - 1)]))
        first = asyncio.ensure_future(worker.ref.ask("run", program=long_run, fetch=[]))
        await asyncio.sleep(0.01)
        await registry.flush()  # op-cpu busy: no answer within the heartbeat, nothing written
        assert not first.done()
        assert await kv.hget("ops:n1:op-cpu", "matmul.calls") is None
        assert not (await first).error
        # the next program is sent at once, ahead of anything the registry asks next
        second = asyncio.ensure_future(worker.ref.ask("run", program=long_run, fetch=[]))
        await asyncio.sleep(0.01)
        assert not second.done()
        await registry.flush()  # takes the answer that came late: the counters as they stood then
        calls = await kv.hget("ops:n1:op-cpu", "matmul.calls")
        assert calls is not None and int(float(calls)) == 4 + links, calls
        assert not (await second).error
    finally:
        await worker.stop()
        await kv.close()
