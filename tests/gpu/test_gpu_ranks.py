"""GPU ranks without NCCL: two deepxd, each with op-cuda on the one GPU, sharing a real redis-server. NCCL takes one
rank per GPU, so their group runs its collectives over the ring, staged through host memory (deepxd/comm_gpu.py):
each collective against numpy, then a 2-rank DistributedDataParallel MLP (eager and under dx.compile) whose
parameters equal one process's (float32 to 1e-5, float64 to 1e-9) (tests/sdk/distributed_worker.py's `train`)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.daemon.conftest import eventually
from tests.gpu.conftest import gpu_reason

GPU_ROLES = "registry,heapmem,scheduler,op-cuda"


def gpu_daemon_env(tmp: Path, device: int | None = 0) -> dict[str, str]:
    """A test daemon's settings for op-cuda (on `device`; None: every visible GPU), its kernels cached where the
    other daemons of the run find them."""
    cache = os.environ.get("DEEPX_CUDA_CACHE") or str(tmp.parent / "cuda-cache-daemons")
    return {"DEEPX_ROLES": GPU_ROLES, "DEEPX_CUDA_CACHE": cache, "DEEPX_CUDA_WARM": "0",
            **({"DEEPX_CUDA_DEVICES": str(device)} if device is not None else {})}


@pytest.fixture(autouse=True)
def _gpu() -> None:
    if reason := gpu_reason():
        pytest.skip(reason)


def test_two_daemons_on_one_gpu_reduce_through_host_memory_and_train_as_one_process(redis_server,
                                                                                   tmp_path: Path) -> None:
    from tests.sdk.test_distributed import daemons_on, train_on

    daemons = daemons_on(redis_server.url, tmp_path, 2, [gpu_daemon_env(tmp_path)] * 2)
    try:
        train_on(tmp_path, [d.address for d in daemons], wait=600)
        for d in daemons:
            out = d.output()
            assert "staged through host memory on this GPU rank" in out, out
            assert "Traceback" not in out, out
        # rank 1's daemon ran the group's collectives only (rank 0's also ran the reference's, a group of one)
        with daemons[1].client() as c:
            ops = eventually(lambda: {r["op"] for r in c.admin("ops") if r["node"] == daemons[1].node_id
                                      and r["worker"] == "op-cuda" and r["op"].startswith("allreduce")},
                             timeout=30, what="the op stats in the plane")
        assert ops == {"allreduce (ring, via host)"}, sorted(ops)
    finally:
        for d in daemons:
            assert d.stop() == 0, d.output()
