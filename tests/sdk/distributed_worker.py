"""One rank of the distributed tests (tests/sdk/test_distributed.py), run as its own process:

    python tests/sdk/distributed_worker.py SCENARIO ADDRESS WORLD RANK OUT [TIMEOUT [WORLDS]]

It connects to ADDRESS, joins the default group (with the backend DEEPX_TEST_BACKEND names, if set) and runs
SCENARIO; it writes what the test compares to OUT (a .npz of plain arrays), and exits 0 when every check in it
passed. SCENARIO: `train` (every collective against numpy, then DistributedDataParallel, eager and under dx.compile;
world 1 is the reference run, of one process on the whole batches of WORLDS ranks), `killed` (the last rank waits to
be killed) or `rejoined` (a rank that comes in place of the killed one).
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

import deepx_sdk as dx
import deepx_sdk.distributed as dist
import deepx_sdk.distributed.nn.functional as distF
import deepx_sdk.nn as nn
import deepx_sdk.nn.functional as F
from deepx_sdk.nn.parallel import DistributedDataParallel
from deepx_sdk.optim import SGD, Adam

STEPS, BATCH, FEATURES, CLASSES = 4, 12, 5, 3
WORLDS = 1  # how many ranks share each batch: the world, or for the reference (world 1) the ranks' (argv)
OUT_DIR = Path(".")  # where the ranks' results go (argv), and the killed scenario's marks


def inputs(rank: int, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    """What rank `rank` contributes (any rank can work out every other's)."""
    values = np.random.default_rng(100 + rank).standard_normal(shape) * 4
    return values.astype(dtype)


def collectives(world: int, rank: int) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for dtype in ("float32", "float64"):
        tol = 1e-5 if dtype == "float32" else 1e-12
        for shape in ((7,), (1,), (5, 3), (3, 4)):  # sizes the world divides, and sizes it does not
            ins = [inputs(r, dtype, shape) for r in range(world)]
            for op, ref in ((dist.ReduceOp.SUM, np.sum), (dist.ReduceOp.AVG, np.mean), (dist.ReduceOp.MAX, np.max),
                            (dist.ReduceOp.MIN, np.min), (dist.ReduceOp.PRODUCT, np.prod)):
                t = dx.tensor(ins[rank])
                dist.all_reduce(t, op=op)
                np.testing.assert_allclose(t.numpy(), ref(np.stack(ins), axis=0), rtol=tol,
                                           err_msg=f"{op} {dtype} {shape}")
        t = dx.tensor(ins[rank])
        dist.broadcast(t, src=world - 1)
        np.testing.assert_array_equal(t.numpy(), ins[world - 1])
        got = [dx.zeros(3, 4, dtype=dtype) for _ in range(world)]
        dist.all_gather(got, dx.tensor(ins[rank]))
        for r in range(world):
            np.testing.assert_array_equal(got[r].numpy(), ins[r])
        whole = dx.zeros(3 * world, 4, dtype=dtype)
        dist.all_gather_into_tensor(whole, dx.tensor(ins[rank]))
        np.testing.assert_array_equal(whole.numpy(), np.concatenate(ins))
        lists = [[inputs(10 * r + j, dtype, (2, 2)) for j in range(world)] for r in range(world)]
        mine = dx.zeros(2, 2, dtype=dtype)
        dist.reduce_scatter(mine, [dx.tensor(a) for a in lists[rank]])
        np.testing.assert_allclose(mine.numpy(), sum(lists[r][rank] for r in range(world)), rtol=tol)
    n = dx.tensor(np.arange(4, dtype=np.int64) * (rank + 1))
    dist.all_reduce(n)  # integers are summed exactly
    np.testing.assert_array_equal(n.numpy(), np.arange(4) * sum(range(1, world + 1)))
    for _ in range(3):  # the same shape again: its buffers are reused, in turn
        t = dx.tensor(ins[rank])
        dist.all_reduce(t)
    np.testing.assert_allclose(t.numpy(), np.sum(np.stack(ins), axis=0), rtol=1e-12)
    whole = np.stack([inputs(r, "float64", (world * 2, 3)) for r in range(world)])
    mine = dx.zeros(2, 3, dtype="float64")
    work = dist.reduce_scatter_tensor(mine, dx.tensor(whole[rank]), op=dist.ReduceOp.MAX, async_op=True)
    assert work is not None and work.wait()
    np.testing.assert_array_equal(mine.numpy(), whole.max(axis=0)[rank * 2:(rank + 1) * 2])
    if dist.get_backend() in ("ring", "nccl"):  # collectives are instructions: dx.compile captures and replays them
        @dx.compile
        def doubled_sum(x: dx.Tensor) -> dx.Tensor:
            y = x * 1.0
            dist.all_reduce(y)
            return y * 2

        for k in range(3):
            x = inputs(50 + k, "float64", (5,)) * (rank + 1)
            want = 2 * sum(inputs(50 + k, "float64", (5,)) * (r + 1) for r in range(world))
            np.testing.assert_allclose(doubled_sum(dx.tensor(x)).numpy(), want, rtol=1e-12)
        assert doubled_sum.replays == 2, doubled_sum.replays
        out.update(differentiated(world, rank))
    if world > 1 and dist.get_backend() == "heap":  # ranks sharing a deepxd: collectives are requests
        @dx.compile
        def step(x: dx.Tensor) -> dx.Tensor:
            dist.all_reduce(x)
            return x * 2

        try:
            step(dx.tensor([1.0]))
        except dist.DistError as e:
            assert "inside dx.compile" in str(e), e
        else:
            raise AssertionError("dx.compile captured a collective")
    dist.barrier()
    out["rank"] = np.array([dist.get_rank(), dist.get_world_size()])
    return out


def differentiated(world: int, rank: int) -> dict[str, np.ndarray]:
    """Autograd through the collectives (deepx_sdk.distributed.nn.functional): each rank's loss reads every rank's
    x, so x's gradient on a rank sums what every rank's loss makes of it."""
    xs = [inputs(60 + r, "float64", (4, 3)) for r in range(world)]
    ws = [inputs(70 + r, "float64", (world * 4, 3)) for r in range(world)]
    x = dx.tensor(xs[rank], requires_grad=True)
    summed = distF.all_reduce(x * 2.0)  # d(sum_r w_r[:4] * 2 sum_r' x_r') / d x_rank
    joined = dx.cat(list(distF.all_gather(x)))
    mine = distF.reduce_scatter(dx.zeros(4, 3, dtype="float64"), [x * (k + 1) for k in range(world)])
    loss = (summed * dx.tensor(ws[rank][:4])).sum() + (joined * dx.tensor(ws[rank])).sum() + (mine * mine).sum()
    loss.backward()
    total = sum(ws)
    # mine on rank r = (r + 1) * sum_r' x_r': its square's gradient reaches x_rank as (k + 1) * 2 mine_k summed
    mines = [(k + 1) * sum(xs) for k in range(world)]
    want = 2 * total[:4] + total[rank * 4:(rank + 1) * 4] + sum(2 * mines[k] * (k + 1) for k in range(world))
    np.testing.assert_allclose(x.grad.numpy(), want, rtol=1e-12)
    np.testing.assert_allclose(summed.numpy(), 2 * sum(xs), rtol=1e-12)
    return {}


def model(dtype: str, seed: int) -> nn.Module:
    """The MLP, its weights from numpy: rank 0's seed is the reference's, the others' differ (DDP broadcasts)."""
    m = nn.Sequential(nn.Linear(FEATURES, 8, dtype=dtype), nn.Tanh(), nn.Linear(8, CLASSES, dtype=dtype))
    rng = np.random.default_rng(seed)
    m.load_state_dict({k: dx.tensor(rng.standard_normal(v.shape).astype(dtype) * 0.5)
                       for k, v in m.state_dict().items()})
    return m


def training_step(wrapped: Any, opt: Any, world: int) -> Any:
    """A step on two micro-batches, the first accumulated under no_sync."""

    def step(xa: dx.Tensor, ya: dx.Tensor, xb: dx.Tensor, yb: dx.Tensor) -> None:
        opt.zero_grad()
        with wrapped.no_sync() if world > 1 else contextlib.nullcontext():
            F.cross_entropy(wrapped(xa), ya).backward()
        F.cross_entropy(wrapped(xb), yb).backward()
        opt.step()

    return step


def ddp(world: int, rank: int) -> dict[str, np.ndarray]:
    """STEPS steps of SGD (float64) and Adam (float32) on the whole batch split over the ranks, the first half of each
    step's shard accumulated under no_sync; then the SGD steps again with the step under dx.compile
    (`compiled.float64.*`). World 1 is the reference (one process, the whole batches)."""
    out: dict[str, np.ndarray] = {}
    data = np.random.default_rng(7)
    xs = data.standard_normal((STEPS, BATCH, FEATURES))
    ys = data.integers(0, CLASSES, (STEPS, BATCH))
    sgd = ("float64", lambda p: SGD(p, lr=0.3, momentum=0.5), False)
    runs = [sgd, ("float32", lambda p: Adam(p, 0.05), False)]
    if world == 1 or dist.get_backend() in ("ring", "nccl"):  # (ranks sharing a deepxd: collectives are requests)
        runs.append((*sgd[:2], True))
    for dtype, make_opt, compiled in runs:
        net = model(dtype, seed=rank if world > 1 else 0)
        wrapped = DistributedDataParallel(net, bucket_cap_mb=1e-4) if world > 1 else net  # a bucket a layer or so
        opt = make_opt(net.parameters())

        step_fn = training_step(wrapped, opt, world)
        step = dx.compile(step_fn) if compiled else step_fn
        for k in range(STEPS):
            # two micro-batches per step, the first accumulated on this rank only; a rank's share of each is half of
            # its shard, and the reference (world 1) takes every rank's at once: the mean over the ranks of their
            # mean losses' gradients is the gradient of the mean over the whole micro-batch
            ranks = range(WORLDS) if world == 1 else [rank]
            share = BATCH // WORLDS
            rows = [np.concatenate([np.arange(r * share, (r + 1) * share)[part] for r in ranks])
                    for part in (slice(0, share // 2), slice(share // 2, share))]
            micro = [(xs[k, i].astype(dtype), ys[k, i]) for i in rows]
            step(*(dx.tensor(a) for pair in micro for a in pair))
        if compiled:
            assert step.replays >= 1, step.replays  # (the first step makes the momentum buffers: captured twice)
        for k, v in net.state_dict().items():
            out[f"{'compiled.' if compiled else ''}{dtype}.{k}"] = v.numpy()
    return out


def killed(world: int, rank: int, timeout: float) -> dict[str, np.ndarray]:
    """The last rank waits to be killed; the others fail their all_reduce naming it, form the group again with the
    rank that comes in its place, and all_reduce with it."""
    t = dx.tensor(np.full(4, rank + 1.0))
    dist.all_reduce(t)
    if rank == world - 1:
        print("ready to be killed", flush=True)
        time.sleep(600)
    started = time.monotonic()
    try:
        dist.all_reduce(t)
    except dist.DistBackendError as e:
        took = time.monotonic() - started
        print(f"failed after {took:.2f} s: {e}", flush=True)
        assert f"rank {world - 1}" in str(e), e
        assert took < timeout, took
        try:
            dist.all_reduce(t)
        except dist.DistBackendError as again:
            assert "broken" in str(again), again
        else:
            raise AssertionError("a broken group ran a collective") from None
    else:
        raise AssertionError("all_reduce succeeded without the killed rank")
    dist.destroy_process_group()
    (OUT_DIR / f"failed-{rank}").touch()  # saw the death and left
    if rank == 0:  # form the group again only once every survivor saw the death and left (else it sees the new one)
        while not all((OUT_DIR / f"failed-{r}").exists() for r in range(world - 1)):
            time.sleep(0.01)
    dist.init_process_group(os.environ.get("DEEPX_TEST_BACKEND"), world_size=world, rank=rank, timeout=timeout * 4)
    return rejoined(world, rank)


def rejoined(world: int, rank: int) -> dict[str, np.ndarray]:
    t = dx.tensor(np.full(4, rank + 1.0))
    dist.all_reduce(t)
    np.testing.assert_array_equal(t.numpy(), np.full(4, world * (world + 1) / 2))
    return {"sum": t.numpy()}


def main() -> None:
    global WORLDS, OUT_DIR
    scenario, address, world, rank, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    OUT_DIR = Path(out).parent
    timeout = float(sys.argv[6]) if len(sys.argv) > 6 else 20.0
    WORLDS = int(sys.argv[7]) if world == 1 and len(sys.argv) > 7 else world
    dx.connect(address)
    # a reference run (world 1) beside the ranks, on their daemon, forms a group of its own
    dist.init_process_group(os.environ.get("DEEPX_TEST_BACKEND"), world_size=world, rank=rank, timeout=timeout,
                            group_name="default" if world > 1 else "reference")
    if scenario == "train":  # every collective against numpy, then DistributedDataParallel
        arrays = {**collectives(world, rank), **ddp(world, rank)}
    elif scenario == "killed":
        arrays = killed(world, rank, timeout)
    else:
        arrays = rejoined(world, rank)
    dist.destroy_process_group()
    np.savez(out, **arrays)
    print("ok", flush=True)


if __name__ == "__main__":
    main()
