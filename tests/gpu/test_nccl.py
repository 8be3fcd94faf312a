"""NCCL between GPU ranks, and several GPUs in one daemon. NCCL takes one rank per GPU, so every test here needs two
visible GPUs and skips with the reason on fewer (one GPU: tests/gpu/test_collectives.py runs a group of one rank
through NCCL, tests/gpu/test_gpu_ranks.py two ranks on one GPU over the ring).

- two deepxd on one redis-server, each with op-cuda on a GPU of its own: backend none picks NCCL; every collective
  against numpy, then a 2-rank DistributedDataParallel MLP (eager and under dx.compile) equal to one process's;
- a rank killed mid-step: the other fails its all_reduce within the group's timeout naming it (its communicator
  aborted, never a hang), and the group forms again with a new communicator;
- one deepxd with op-cuda on both GPUs: one worker per GPU (`deepxctl actors ls` shows each with its device), two
  ranks on it each placed on its own GPU by init_process_group, collectives through NCCL between them.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.daemon.conftest import Daemon, eventually
from tests.gpu.conftest import gpu_reason
from tests.gpu.test_gpu_ranks import gpu_daemon_env


def two_gpus_reason() -> str | None:
    reason = gpu_reason()
    if reason:
        return reason
    import pycuda.driver as drv

    n = drv.Device.count()
    if n < 2:
        return f"{n} GPU visible here: NCCL takes one rank per GPU, so two ranks need two GPUs (a 2-GPU machine)"
    from deepxd.kernels.cuda.nccl import available

    why = available()
    return None if why is None else f"NCCL does not load here: {why}"


@pytest.fixture(autouse=True)
def _two_gpus() -> None:
    if reason := two_gpus_reason():
        pytest.skip(reason)


def ops_of(d: Daemon, worker_prefix: str = "op-cuda") -> set[str]:
    with d.client() as c:
        return eventually(lambda: {r["op"] for r in c.admin("ops") if r["node"] == d.node_id
                                   and str(r["worker"]).startswith(worker_prefix)
                                   and r["op"].startswith("allreduce")}, timeout=30, what="the op stats in the plane")


def test_two_daemons_on_two_gpus_reduce_through_nccl_and_train_as_one_process(redis_server, tmp_path: Path) -> None:
    from tests.sdk.test_distributed import daemons_on, train_on

    daemons = daemons_on(redis_server.url, tmp_path, 2, [gpu_daemon_env(tmp_path, 0), gpu_daemon_env(tmp_path, 1)])
    try:
        train_on(tmp_path, [d.address for d in daemons], wait=600)
        for d in daemons:
            out = d.output()
            assert "collectives run in programs, through NCCL" in out, out
            assert "NCCL" in out and "communicator ready" in out, out
            assert "Traceback" not in out, out
        assert ops_of(daemons[1]) == {"allreduce (nccl)"}
    finally:
        for d in daemons:
            assert d.stop() == 0, d.output()


def test_a_killed_rank_fails_the_nccl_collective_naming_it_and_the_group_forms_again(redis_server,
                                                                                     tmp_path: Path) -> None:
    from tests.sdk.test_distributed import Rank, daemons_on

    daemons = daemons_on(redis_server.url, tmp_path, 2, [gpu_daemon_env(tmp_path, 0), gpu_daemon_env(tmp_path, 1)])
    timeout = 20.0
    try:
        ranks = [Rank(tmp_path, "killed", d.address, 2, r, timeout) for r, d in enumerate(daemons)]
        eventually(lambda: "ready to be killed" in ranks[1].output(), timeout=300, what="rank 1 ready")
        ranks[1].proc.kill()  # kill -9, after its first all_reduce (the communicator is made)
        ranks[1].proc.wait()
        eventually(lambda: "failed after" in ranks[0].output() or ranks[0].proc.poll() is not None,
                   timeout=timeout + 30, what="rank 0's all_reduce fails")
        line = next(x for x in ranks[0].output().splitlines() if x.startswith("failed after"))
        assert "rank 1 (pid" in line and "exited" in line, line
        assert float(line.split()[2]) < timeout, line
        again = Rank(tmp_path, "rejoined", daemons[1].address, 2, 1, timeout)
        for r in (ranks[0], again):
            np.testing.assert_array_equal(r.result(300)["sum"], np.full(4, 3.0))
        for d in daemons:
            assert "Traceback" not in d.output(), d.output()
    finally:
        for d in daemons:
            assert d.stop() == 0, d.output()


def test_one_daemon_runs_a_worker_per_gpu_and_places_each_rank_on_its_own(tmp_path: Path) -> None:
    from tests.sdk.test_distributed import Rank

    d = Daemon(tmp_path, udp=False, env=gpu_daemon_env(tmp_path, None)).start(wait=False)
    try:
        d.wait_ready(120)
        listing = subprocess.run([sys.executable, "-m", "deepxctl", "--address", d.address, "actors", "ls",
                                  "--format", "json", "--detail"], capture_output=True, text=True, timeout=60)
        assert listing.returncode == 0, listing.stderr
        devices = {a["name"]: a["device"] for a in json.loads(listing.stdout) if a["role"] == "op-cuda"}
        assert devices["op-cuda"] == "cuda:0" and devices["op-cuda:1"] == "cuda:1", devices
        ranks = [Rank(tmp_path, "train", d.address, 2, r) for r in range(2)]
        reference = Rank(tmp_path, "train", d.address, 1, 0, worlds=2)
        results = [r.result(600) for r in ranks]
        ref = reference.result(600)
        for k in ref:
            if k.startswith("rank"):
                continue
            tol = 1e-5 if "float32" in k else 1e-9
            np.testing.assert_array_equal(results[1][k], results[0][k], err_msg=f"rank 1 differs from rank 0 in {k}")
            np.testing.assert_allclose(results[0][k], ref[k], rtol=tol, atol=tol, err_msg=k)
        out = d.output()
        assert "through NCCL on cuda:0" in out and "through NCCL on cuda:1" in out, out
        assert ops_of(d, "op-cuda:1") == {"allreduce (nccl)"}
        assert "Traceback" not in out, out
    finally:
        assert d.stop() == 0, d.output()


def test_a_session_on_the_second_gpu_keeps_its_heap_tensors_on_that_gpu(tmp_path: Path) -> None:
    """A module's parameters are heap tensors: heapmem makes them on the GPU of the worker that asks (its kernels
    cannot read the first GPU's memory), and the forward and backward on them equal numpy's."""
    import deepx_sdk as dx
    import deepx_sdk.nn as nn

    d = Daemon(tmp_path, udp=False, env=gpu_daemon_env(tmp_path, None)).start(wait=False)
    try:
        d.wait_ready(120)
        dx.connect(d.address, device="cuda:1")
        try:
            model = nn.Linear(4, 3)
            x = np.arange(8, dtype=np.float32).reshape(2, 4)
            out = model(dx.tensor(x))
            out.sum().backward()
            w, b = (p.numpy() for p in model.parameters())
            np.testing.assert_allclose(out.numpy(), x @ w.T + b, rtol=1e-5)
            np.testing.assert_allclose(model.weight.grad.numpy(), np.tile(x.sum(axis=0), (3, 1)), rtol=1e-5)
            listing = subprocess.run([sys.executable, "-m", "deepxctl", "--address", d.address, "tensors", "ls",
                                      "--format", "json", "--detail"], capture_output=True, text=True, timeout=60)
            assert listing.returncode == 0, listing.stderr
            heap = {t["name"]: t["device"] for t in json.loads(listing.stdout) if t["kind"] == "heap"}
            assert heap and set(heap.values()) == {"cuda:1"}, heap
        finally:
            dx.disconnect()
        assert "Traceback" not in d.output(), d.output()
    finally:
        assert d.stop() == 0, d.output()
