"""Data-parallel figures on one host, 2 ranks, one deepxd each on a redis-server (examples/train_ddp.py's daemons):

- all_reduce of 1 MiB and 64 MiB float32 by the ring (collectives as instructions, over the peer links) against a
  bare socket copy of the same bytes (two processes on a Unix socket pair, each sending and receiving what a rank
  of the ring sends and receives: 2 (N-1)/N of the tensor), and against the plane path (backend 'heap': buffers
  met at a barrier in the storage plane), and numpy shared memory running the plane path's algorithm;
- training samples/s of an MLP 784-512-512-10 (batch 256 a rank, SGD) under DistributedDataParallel on 2 ranks
  against 1: by the ring with torch's buckets (overlapped with the backward), by the ring with one bucket (all
  gradients after the backward), and by the plane path.

Prints ms and ratios; writes bench/results/ddp.json.

    python bench/ddp.py [--iters 20] [--steps 20] [--rounds 3]

`--gpu` (the GPU machine, 2 GPUs; with fewer it prints why and stops): one deepxd with op-cuda on both GPUs (a worker
per GPU, each rank placed on its own), 2 ranks:

- all_reduce of 256 MiB float32 through NCCL, against torch.distributed's NCCL all_reduce of the same tensor on the
  same GPUs (algorithm bandwidth, and deepx's time over torch's);
- training samples/s of the example's character transformer (bench/coldstart.py's trainer model, batch 64 a rank,
  AdamW) under DistributedDataParallel on 2 GPUs against 1 GPU.

    python bench/ddp.py --gpu [--iters 20] [--steps 20] [--rounds 2]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from multiprocessing import Barrier, Process, Queue, shared_memory
from pathlib import Path
from typing import Any

import numpy as np

os.environ["DEEPX_NATIVE_BACKGROUND"] = "0"  # a benchmark times the steady state: native kernels compiled at once

ROOT = Path(__file__).resolve().parents[1]
SIZES = {"1 MiB": 1 << 18, "64 MiB": 1 << 24}  # float32 elements
WORLD = 2
#: training variants: the backend, and DDP's bucket_cap_mb (None: torch's 25 MB with a first bucket of 1 MiB)
TRAIN = {"ring, buckets": ("ring", None), "ring, one bucket": ("ring", 1e6), "plane": ("heap", None)}


def _launcher() -> Any:
    spec = importlib.util.spec_from_file_location("train_ddp", ROOT / "examples" / "train_ddp.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# -- deepx: one process per rank (this script with --worker)
def worker(kind: str, backend: str, cap: str, address: str, world: int, rank: int, iters: int, steps: int) -> None:
    import deepx_sdk as dx
    import deepx_sdk.distributed as dist

    dx.connect(address)
    dist.init_process_group(backend if world > 1 else None, world_size=world, rank=rank, timeout=120,
                            group_name=f"bench{world}")
    out: dict[str, float] = {}
    if kind == "allreduce":
        for label, n in SIZES.items():
            t = dx.tensor(np.full(n, rank + 1.0, np.float32))
            for _ in range(3):
                dist.all_reduce(t)
            times = []
            for _ in range(iters):
                dist.barrier()
                start = time.perf_counter()
                dist.all_reduce(t)
                times.append(time.perf_counter() - start)
            out[label] = float(np.median(times))
    else:
        out["samples/s"] = _train(dx, dist, world, rank, steps, None if cap == "-" else float(cap))
    dist.destroy_process_group()
    if rank == 0:
        print(json.dumps(out), flush=True)


def _train(dx: Any, dist: Any, world: int, rank: int, steps: int, cap: float | None) -> float:
    import deepx_sdk.nn as nn
    import deepx_sdk.nn.functional as F
    from deepx_sdk.nn.parallel import DistributedDataParallel
    from deepx_sdk.optim import SGD

    rng = np.random.default_rng(rank)
    x, y = dx.tensor(rng.standard_normal((256, 784)).astype(np.float32)), dx.tensor(rng.integers(0, 10, 256))
    model: Any = nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))
    if world > 1:
        model = DistributedDataParallel(model, bucket_cap_mb=cap)
    opt = SGD(model.parameters(), lr=0.01, momentum=0.9)

    def step() -> float:
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return float(loss.item())

    for _ in range(3):
        step()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    dist.barrier()
    return 256 * world * steps / (time.perf_counter() - start)


def run_ranks(kind: str, backend: str, cap: float | None, addresses: list[str], iters: int, steps: int
              ) -> dict[str, float]:
    world = len(addresses)
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", kind, backend, "-" if cap is None else str(cap),
                               addresses[r], str(world), str(r), str(iters), str(steps)], stdout=subprocess.PIPE,
                              text=True) for r in range(world)]
    outs = [p.communicate()[0] for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit(f"a {kind} rank ({backend}) failed: {[p.returncode for p in procs]}")
    return dict(json.loads(outs[0].strip().splitlines()[-1]))


# -- a bare socket copy: what the ring's bytes cost on the wire alone
def _socket_rank(sock: socket.socket, nbytes: int, iters: int, barrier: Any, q: Queue, rank: int) -> None:
    out = np.ones(nbytes, np.uint8)
    into = np.empty(nbytes, np.uint8)
    view = memoryview(into)
    times = []
    for _ in range(iters + 3):
        barrier.wait()
        start = time.perf_counter()
        sender = threading.Thread(target=sock.sendall, args=(memoryview(out),))
        sender.start()
        got = 0
        while got < nbytes:
            got += sock.recv_into(view[got:], nbytes - got)
        sender.join()
        times.append(time.perf_counter() - start)
    q.put((rank, float(np.median(times[3:]))))


def socket_baseline(iters: int) -> dict[str, float]:
    """Each of 2 processes sends and receives 2 (N-1)/N of the tensor's bytes at once over a Unix socket pair."""
    out = {}
    for label, n in SIZES.items():
        nbytes = 2 * (WORLD - 1) * n * 4 // WORLD
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        barrier, q = Barrier(2), Queue()  # type: ignore[var-annotated]
        procs = [Process(target=_socket_rank, args=(s, nbytes, iters, barrier, q, r)) for r, s in enumerate((a, b))]
        for p in procs:
            p.start()
        results = dict(q.get() for _ in procs)
        for p in procs:
            p.join()
        a.close()
        b.close()
        out[label] = max(results.values())
    return out


# -- numpy arrays in shared memory, the plane path's algorithm (copy in, meet, sum the peer's into one's own)
def _shm_rank(rank: int, n: int, iters: int, names: list[list[str]], barrier: Any, q: Queue) -> None:
    segs = [[shared_memory.SharedMemory(name=nm) for nm in pair] for pair in names]
    bufs = [[np.ndarray(n, np.float32, buffer=s.buf) for s in pair] for pair in segs]
    mine = np.full(n, rank + 1.0, np.float32)
    times = []
    for i in range(iters + 3):
        barrier.wait()
        start = time.perf_counter()
        parity = i % 2  # two buffers a rank, in turn: one meeting a call, as deepx's
        np.copyto(bufs[rank][parity], mine)
        barrier.wait()
        np.add(bufs[0][parity], bufs[1][parity], out=mine)
        times.append(time.perf_counter() - start)
    q.put((rank, float(np.median(times[3:]))))
    del bufs
    for pair in segs:
        for s in pair:
            s.close()


def shm_baseline(iters: int) -> dict[str, float]:
    out = {}
    for label, n in SIZES.items():
        segs = [[shared_memory.SharedMemory(create=True, size=n * 4) for _ in range(2)] for _ in range(2)]
        try:
            barrier, q = Barrier(2), Queue()  # type: ignore[var-annotated]
            procs = [Process(target=_shm_rank, args=(r, n, iters, [[s.name for s in p] for p in segs], barrier, q))
                     for r in range(2)]
            for p in procs:
                p.start()
            results = dict(q.get() for _ in procs)
            for p in procs:
                p.join()
            out[label] = results[0]
        finally:
            for pair in segs:
                for s in pair:
                    s.close()
                    s.unlink()
    return out


def _best(side: dict[str, float], got: dict[str, float], better: Any = min) -> None:
    for label, value in got.items():
        side[label] = better(side.get(label, value), value)


# -- GPUs (--gpu): NCCL against torch's, and the transformer on 2 GPUs against 1
GPU_ELEMENTS = 1 << 26  # 256 MiB of float32
GPU_BATCH = 64


def gpu_count() -> int:
    try:
        import pycuda.driver as drv

        drv.init()
        return int(drv.Device.count())
    except Exception:
        return 0


def gpu_worker(kind: str, address: str, world: int, rank: int, iters: int, steps: int) -> None:
    """One rank on the multi-GPU deepxd at `address`: placed on GPU `rank` by init_process_group."""
    import deepx_sdk as dx
    import deepx_sdk.distributed as dist

    dx.connect(address)
    dist.init_process_group(None, world_size=world, rank=rank, timeout=300, group_name=f"gpubench{world}{kind}")
    assert world == 1 or dist.get_backend() == "nccl", dist.get_backend()
    out: dict[str, float] = {}
    if kind == "allreduce":
        t = dx.tensor(np.full(GPU_ELEMENTS, rank + 1.0, np.float32))
        for _ in range(3):
            dist.all_reduce(t)
        times = []
        for _ in range(iters):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(t)  # (has run on the device when it returns)
            times.append(time.perf_counter() - start)
        out["s"] = float(np.median(times))
        assert float(t[0].item()) == 3.0 * 2 ** (iters + 3 - 1), "all_reduce sums"
    else:
        out["samples/s"] = _train_transformer(dx, dist, world, steps)
    dist.destroy_process_group()
    if rank == 0:
        print(json.dumps(out), flush=True)


def _train_transformer(dx: Any, dist: Any, world: int, steps: int) -> float:
    sys.path.insert(0, str(ROOT / "bench"))
    from coldstart import load_example

    from deepx_sdk.nn.parallel import DistributedDataParallel

    ex = load_example("deepx")
    F = ex["F"]
    text = ex["DATA"].read_text(encoding="utf-8")
    tok = ex["CharTokenizer"](text)
    data = tok.encode(text)
    context = 64
    model = ex["CharTransformer"](len(tok), context, 256, 4, 4)
    wrapped = DistributedDataParallel(model) if world > 1 else model
    opt = ex["AdamW"](model.parameters(), lr=4e-3)
    rng = np.random.default_rng(dist.get_rank())

    def step() -> None:
        starts = rng.integers(0, len(data) - context - 1, GPU_BATCH)
        window = np.stack([data[s:s + context + 1] for s in starts])
        x, y = dx.tensor(window[:, :-1]), dx.tensor(window[:, 1:])
        opt.zero_grad()
        F.cross_entropy(wrapped(x).view(-1, len(tok)), y.view(-1)).backward()
        opt.step()

    for _ in range(5):
        step()
    dx.cuda.synchronize()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    dx.cuda.synchronize()
    dist.barrier()
    return GPU_BATCH * world * steps / (time.perf_counter() - start)


def torch_rank(rank: int, port: int, iters: int, q: Queue) -> None:
    """torch.distributed's NCCL all_reduce of the same 256 MiB on GPU `rank` (the peer of deepx's)."""
    import torch
    import torch.distributed as tdist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    tdist.init_process_group("nccl", world_size=2, rank=rank)
    t = torch.full((GPU_ELEMENTS,), rank + 1.0, device="cuda")
    for _ in range(3):
        tdist.all_reduce(t)
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        tdist.barrier()
        torch.cuda.synchronize()
        start = time.perf_counter()
        tdist.all_reduce(t)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    tdist.destroy_process_group()
    q.put((rank, float(np.median(times))))


def torch_allreduce(iters: int) -> float:
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")  # (CUDA in forked children: not once the parent touched it)
    q = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=torch_rank, args=(r, port, iters, q)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(q.get(timeout=600) for _ in procs)
    for p in procs:
        p.join()
    return max(results.values())


def run_gpu_ranks(kind: str, address: str, world: int, iters: int, steps: int) -> dict[str, float]:
    procs = [subprocess.Popen([sys.executable, __file__, "--gpu-worker", kind, address, str(world), str(r),
                               str(iters), str(steps)], stdout=subprocess.PIPE, text=True) for r in range(world)]
    outs = [p.communicate(timeout=900)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit(f"a GPU {kind} rank failed: {[p.returncode for p in procs]}")
    return dict(json.loads(outs[0].strip().splitlines()[-1]))


def gpu_main(opts: Any) -> None:
    n = gpu_count()
    if n < 2:
        print(f"bench/ddp.py --gpu: skipped: {n} GPU visible here; NCCL takes one rank per GPU, so the NCCL "
              "all_reduce against torch's and 2-GPU training against 1 need a machine with 2 GPUs")
        return
    from deepxd.kernels.cuda.nccl import available, version

    if why := available():
        print(f"bench/ddp.py --gpu: skipped: {why}")
        return
    results: dict[str, Any] = {"gpus": n, "nccl": version(), "rounds": opts.rounds}
    deepx_s = torch_s = float("inf")
    one = two = 0.0
    with tempfile.TemporaryDirectory(prefix="deepx-bench-ddp-gpu-") as tmp:
        sock = f"{tmp}/deepxd.sock"
        env = {**os.environ, "DEEPX_ROLES": "registry,heapmem,scheduler,op-cuda", "DEEPX_CUDA_DEVICES": "0,1"}
        with open(f"{tmp}/deepxd.log", "wb") as logf:
            daemon = subprocess.Popen([sys.executable, "-m", "deepxd", "start", "--listen", f"unix://{sock}",
                                       "--kv", "memory", "--udp", "off", "--node-id", f"gpubench{os.getpid()}"],
                                      stdout=logf, stderr=subprocess.STDOUT, env=env, cwd=tmp)
        try:
            deadline = time.monotonic() + 120
            while not os.path.exists(sock):
                if daemon.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit("deepxd did not start:\n" + Path(f"{tmp}/deepxd.log").read_text())
                time.sleep(0.1)
            address = f"unix://{sock}"
            for _ in range(opts.rounds):
                deepx_s = min(deepx_s, run_gpu_ranks("allreduce", address, 2, opts.iters, opts.steps)["s"])
                torch_s = min(torch_s, torch_allreduce(opts.iters))
                one = max(one, run_gpu_ranks("train", address, 1, opts.iters, opts.steps)["samples/s"])
                two = max(two, run_gpu_ranks("train", address, 2, opts.iters, opts.steps)["samples/s"])
        finally:
            daemon.terminate()
            daemon.wait(60)
    nbytes = GPU_ELEMENTS * 4
    print(f"{n} GPUs, NCCL {results['nccl']}; 2 ranks on one deepxd (a worker per GPU); the best of {opts.rounds} "
          "rounds, each the median of its calls")
    print(f"all_reduce 256 MiB float32: deepx {deepx_s * 1e3:.2f} ms ({nbytes / deepx_s / 1e9:.1f} GB/s algbw), "
          f"torch NCCL {torch_s * 1e3:.2f} ms ({nbytes / torch_s / 1e9:.1f} GB/s): "
          f"torch/deepx {torch_s / deepx_s:.2f}x")
    print(f"training the character transformer (d 256, 4 layers, context 64, batch {GPU_BATCH} a GPU): 1 GPU "
          f"{one:.0f} samples/s, 2 GPUs {two:.0f} samples/s: {two / one:.2f}x")
    results["all_reduce 256 MiB"] = {"deepx_s": deepx_s, "torch_s": torch_s, "torch_over_deepx": torch_s / deepx_s}
    results["training"] = {"one_gpu_samples_s": one, "two_gpus_samples_s": two, "two_over_one": two / one}
    out = ROOT / "bench" / "results"
    out.mkdir(exist_ok=True)
    (out / "ddp_gpu.json").write_text(json.dumps(results, indent=2) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--gpu", action="store_true", help="NCCL and 2-GPU training (the GPU machine, 2 GPUs)")
    ap.add_argument("--worker", nargs=8, help=argparse.SUPPRESS)
    ap.add_argument("--gpu-worker", nargs=6, help=argparse.SUPPRESS)
    opts = ap.parse_args()
    if opts.worker:
        kind, backend, cap, address, world, rank, iters, steps = opts.worker
        worker(kind, backend, cap, address, int(world), int(rank), int(iters), int(steps))
        return
    if opts.gpu_worker:
        kind, address, world, rank, iters, steps = opts.gpu_worker
        gpu_worker(kind, address, int(world), int(rank), int(iters), int(steps))
        return
    if opts.gpu:
        gpu_main(opts)
        return
    if shutil.which("redis-server") is None:
        raise SystemExit("bench/ddp.py needs redis-server on PATH: one deepxd per rank on one plane")
    launcher = _launcher()
    results: dict[str, Any] = {"cpus": os.cpu_count(), "rounds": opts.rounds}
    # the sides take turns, round after round, and each keeps its best round: on a shared machine whose speed drifts
    # over seconds, a slow spell then falls on every side instead of on one
    ring: dict[str, float] = {}
    plane: dict[str, float] = {}
    wire: dict[str, float] = {}
    shm: dict[str, float] = {}
    one = 0.0
    two: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="deepx-bench-ddp-") as tmp:
        with launcher.daemons(WORLD, "per-rank", Path(tmp)) as addresses:
            for _ in range(opts.rounds):
                _best(wire, socket_baseline(opts.iters))
                _best(ring, run_ranks("allreduce", "ring", None, addresses, opts.iters, opts.steps))
                _best(plane, run_ranks("allreduce", "heap", None, addresses, opts.iters, opts.steps))
                _best(shm, shm_baseline(opts.iters))
                one = max(one, run_ranks("train", "ring", None, addresses[:1], opts.iters, opts.steps)["samples/s"])
                for label, (backend, cap) in TRAIN.items():
                    got = run_ranks("train", backend, cap, addresses, opts.iters, opts.steps)["samples/s"]
                    _best(two, {label: got}, max)
    print(f"{os.cpu_count()} CPUs; 2 ranks, a deepxd each; the best of {opts.rounds} rounds, each the median of its "
          "calls")
    print(f"{'all_reduce float32':20} {'ring ms':>9} {'socket ms':>10} {'ring/socket':>12} {'plane ms':>9} "
          f"{'plane/ring':>11} {'numpy shm ms':>13} {'plane/shm':>10}")
    for label in SIZES:
        print(f"{label:20} {ring[label] * 1e3:9.2f} {wire[label] * 1e3:10.2f} {ring[label] / wire[label]:11.2f}x "
              f"{plane[label] * 1e3:9.2f} {plane[label] / ring[label]:10.2f}x {shm[label] * 1e3:13.2f} "
              f"{plane[label] / shm[label]:9.2f}x")
        results[f"all_reduce {label}"] = {"ring_s": ring[label], "socket_s": wire[label], "plane_s": plane[label],
                                          "numpy_shm_s": shm[label], "ring_over_socket": ring[label] / wire[label],
                                          "plane_over_ring": plane[label] / ring[label]}
    print(f"training MLP 784-512-512-10, batch 256 a rank: 1 rank {one:.0f} samples/s; 2 ranks:")
    results["training"] = {"one_rank_samples_s": one}
    for label, value in two.items():
        print(f"  {label:18} {value:8.0f} samples/s  {value / one:5.2f}x of 1 rank")
        results["training"][label] = {"samples_s": value, "over_one_rank": value / one}
    out = ROOT / "bench" / "results"
    out.mkdir(exist_ok=True)
    (out / "ddp.json").write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
