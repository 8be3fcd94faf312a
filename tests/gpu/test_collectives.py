"""Collectives on op-cuda (deepxd/comm_gpu.py): a process group of one rank on the GPU executor, through NCCL (a
communicator of one rank on the one GPU) and staged through host memory over the ring, each collective against
numpy; and the SDK's group of one rank on an embedded op-cuda session through NCCL, the op stats saying so.
Two ranks need two GPUs for NCCL (tests/gpu/test_nccl.py) or two daemons (tests/gpu/test_gpu_ranks.py)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from deepx_core.errors import DeepxError
from deepx_core.ir import parse_text

REDUCE = ("sum", "mean", "max", "min", "product")
DTYPES = ("float32", "float64", "float16", "bfloat16", "int32", "int64", "int8", "int16")


def nccl_reason() -> str | None:
    from deepxd.kernels.cuda.nccl import available

    why = available()
    return None if why is None else f"NCCL does not load here ({why}): the NCCL tests need libnccl.so.2"


def group_of_one(ex: Any, backend: str) -> Any:
    """A daemon-less Collectives whose group 'default' has this executor's rank only, on `backend`."""
    from deepxd.comm import Collectives

    comm = Collectives()
    member: dict[str, Any] = {"node": "here", "worker": "", "host": "h"}
    nccl_id = None
    if backend == "nccl":
        from deepxd.kernels.cuda.nccl import unique_id

        member.update(gpu="gpu0", device="cuda:0", nccl=True)
        nccl_id = unique_id()
    assert comm.formed("default", "g1", 0, [member], 10.0, nccl_id) == backend
    ex.collectives = comm
    return comm


def values(dtype: str, shape: tuple[int, ...], seed: int) -> np.ndarray:
    from deepx_core.ir.dtypes import to_numpy

    rng = np.random.default_rng(seed)
    a = rng.standard_normal(shape) * 3
    return (np.round(a) if dtype.startswith("int") else a).astype(to_numpy(dtype))


def test_a_collective_on_a_bare_gpu_executor_says_it_has_no_group(gx) -> None:
    gx.collectives = None
    gx.put("a", np.ones((2, 3), np.float32))
    with pytest.raises(DeepxError, match=r"allreduce: this executor runs no collectives"):
        gx.run_all(parse_text("allreduce (tensor<float32>:a, var<string>:sum, var<string>:default) -> "
                              "(tensor<float32>:a)"))
    np.testing.assert_array_equal(gx.get("a"), np.ones((2, 3), np.float32))  # unchanged
    gx.run_all(parse_text("addscalar (tensor<float32>:a, var<float64>:1) -> (tensor<float32>:b)"))
    np.testing.assert_array_equal(gx.get("b"), np.full((2, 3), 2.0, np.float32))


@pytest.mark.parametrize("backend", ["nccl", "ring"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_collectives_of_one_rank_on_the_gpu_equal_numpy(gx, backend: str, dtype: str) -> None:
    """NCCL (a communicator of one rank) or the ring on host copies: every reduction, broadcast, all-gather and
    reduce-scatter of a group of one rank is numpy's over one rank; int16 (no NCCL type) reduces staged."""
    if backend == "nccl" and (reason := nccl_reason()):
        pytest.skip(reason)
    comm = group_of_one(gx, backend)
    try:
        one_rank(gx, backend, dtype)
    finally:
        comm.left("default", "g1")  # its communicator destroyed
        gx.collectives = None


def one_rank(gx: Any, backend: str, dtype: str) -> None:
    a = values(dtype, (4, 3), 1)
    gx.put("a", a)
    floats = dtype.startswith(("float", "bfloat"))
    for how in REDUCE:  # over one rank, each reduction is the identity
        if how == "mean" and not floats:
            continue
        gx.run_all(parse_text(f"allreduce (tensor<{dtype}>:a, var<string>:{how}, var<string>:default) -> "
                              f"(tensor<{dtype}>:r_{how})"))
        np.testing.assert_array_equal(gx.get(f"r_{how}"), a, err_msg=how)
        staged = backend == "ring" or dtype == "int16"
        assert gx.via == ("ring, via host" if staged else "nccl"), gx.via
    gx.run_all(parse_text(f"""
        broadcast (tensor<{dtype}>:a, var<int32>:0, var<string>:default) -> (tensor<{dtype}>:b)
        allgather (tensor<{dtype}>:a, var<int32>:1, var<string>:default) -> (tensor<{dtype}>:g)
        reducescatter (tensor<{dtype}>:a, var<int32>:1, var<string>:sum, var<string>:default) -> (tensor<{dtype}>:s)
        copytensor (tensor<{dtype}>:a) -> (tensor<{dtype}>:i)
        allreduce (tensor<{dtype}>:i, var<string>:sum, var<string>:default) -> (tensor<{dtype}>:i)
    """))
    for name in "bgsi":
        np.testing.assert_array_equal(gx.get(name), a, err_msg=name)
    bad = "allgather (tensor:a, var<int32>:2, var<string>:default) -> (tensor:x)"
    with pytest.raises(DeepxError, match="allgather: world 2 is not the size of process group 'default'"):
        gx.run_all(parse_text(bad))


def test_a_bucket_of_collectives_runs_in_one_nccl_group(gx) -> None:
    """Consecutive all-reduces marked alike (DDP's bucket) start together at the first one's place."""
    if reason := nccl_reason():
        pytest.skip(reason)
    comm = group_of_one(gx, "nccl")
    from deepx_core.ir.ops import check_program

    xs = {n: values("float32", (5,), k) for k, n in enumerate("xyz")}
    for n, v in xs.items():
        gx.put(n, v)
    bounds = check_program(parse_text("""
        allreduce (tensor<float32>:x, var<string>:mean, var<string>:default) -> (tensor<float32>:x) // bucket=0
        allreduce (tensor<float32>:y, var<string>:mean, var<string>:default) -> (tensor<float32>:y) // bucket=0
        allreduce (tensor<float32>:z, var<string>:mean, var<string>:default) -> (tensor<float32>:z) // bucket=0
    """), gx)
    work = comm.start(gx, bounds)
    for b in bounds:
        gx.launched[id(b)] = work
    for b in bounds:
        gx.execute(b)
    assert comm.runs == 1 and gx.via == "nccl"
    for n, v in xs.items():
        np.testing.assert_array_equal(gx.get(n), v)
    comm.left("default", "g1")
    gx.collectives = None


def test_an_embedded_op_cuda_session_forms_a_group_of_one_rank_through_nccl() -> None:
    """init_process_group(backend='nccl') on an embedded op-cuda session: every collective equals numpy's, runs on
    op-cuda through NCCL (its op stats say `(nccl)`), and dx.compile replays a step that holds one."""
    from tests.gpu.conftest import gpu_reason

    if reason := gpu_reason() or nccl_reason():
        pytest.skip(reason)
    import deepx_sdk as dx
    import deepx_sdk.distributed as dist

    s = dx.connect(roles=["heapmem", "op-cuda"])
    try:
        dist.init_process_group("nccl", world_size=1, rank=0, timeout=60)
        assert dist.get_backend() == "nccl"
        a = values("float32", (6, 4), 3)
        for op, ref in ((dist.ReduceOp.SUM, np.sum), (dist.ReduceOp.AVG, np.mean), (dist.ReduceOp.MAX, np.max),
                        (dist.ReduceOp.MIN, np.min), (dist.ReduceOp.PRODUCT, np.prod)):
            t = dx.tensor(a)
            dist.all_reduce(t, op=op)
            np.testing.assert_allclose(t.numpy(), ref(np.stack([a]), axis=0), rtol=1e-6, err_msg=str(op))
        t = dx.tensor(a)
        dist.broadcast(t, src=0)
        np.testing.assert_array_equal(t.numpy(), a)
        whole = dx.zeros(6, 4)
        dist.all_gather_into_tensor(whole, dx.tensor(a))
        np.testing.assert_array_equal(whole.numpy(), a)
        mine = dx.zeros(6, 4)
        dist.reduce_scatter_tensor(mine, dx.tensor(a))
        np.testing.assert_array_equal(mine.numpy(), a)

        @dx.compile
        def doubled(x: dx.Tensor) -> dx.Tensor:
            y = x * 1.0
            dist.all_reduce(y)
            return y * 2

        for k in range(3):
            np.testing.assert_allclose(doubled(dx.tensor(a + k)).numpy(), 2 * (a + k), rtol=1e-6)
        assert doubled.replays == 2
        stats = s.transport.node.ref("op-cuda")._actor.op_stats
        for op in ("allreduce", "broadcast", "allgather", "reducescatter"):
            assert stats[f"{op} (nccl)"].calls >= 1, sorted(stats)
        assert not [k for k in stats if k.startswith("allreduce") and k != "allreduce (nccl)"], sorted(stats)
        formation = next(iter(s.transport.node.comm.formations.values()))
        assert formation.backend == "nccl" and formation.nccl is not None
        c = formation.nccl
        dist.destroy_process_group()
        worker = s.transport.node.ref("op-cuda")._actor
        worker._thread.submit(lambda: None).result(30)  # the communicator ends on the worker's thread, queued
        assert formation.nccl is None and c.closed  # the communicator went with the group
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        dx.disconnect()
