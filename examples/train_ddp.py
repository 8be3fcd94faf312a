"""Train the MLP of examples/train_mlp.py on N ranks with DistributedDataParallel, in one command.

    python examples/train_ddp.py [--ranks 2] [--epochs 30] [--daemons per-rank|shared]

It starts what it needs on this machine and stops it at the end: a redis-server and one deepxd per rank on it
(`per-rank`, the default where redis-server is on PATH: each rank computes on its own daemon), or one deepxd that
every rank uses (`shared`); then one process per rank, with RANK and WORLD_SIZE in its environment as torchrun sets
them. Each rank trains on its share of every batch; DistributedDataParallel averages the gradients, so every rank
takes the same steps. Rank 0 shows the progress and the test accuracy and saves the weights.

    RANK=0 WORLD_SIZE=2 python examples/train_ddp.py --rank-address unix:///path/deepxd.sock   # one rank, yours
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

CPU_ROLES = "registry,heapmem,scheduler,op-cpu"  # collectives run on op-cpu's heap tensors, not yet on a GPU


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait(check: object, what: str, proc: subprocess.Popen[bytes], log: Path, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():  # type: ignore[operator]
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not start:\n{log.read_text(errors='replace')[-3000:]}")
        time.sleep(0.05)


def _answers(address: str) -> bool:
    from deepx_sdk.client import NativeClient

    try:
        NativeClient(address, timeout=2).close()
        return True
    except Exception:
        return False


@contextlib.contextmanager
def daemons(ranks: int, mode: str, folder: Path) -> Iterator[list[str]]:
    """The deepxd address of each rank, with what serves them running until the block ends: one deepxd per rank on a
    redis-server of its own (`per-rank`), or one deepxd for every rank (`shared`)."""
    procs: list[tuple[subprocess.Popen[bytes], Any]] = []
    env = {**os.environ, "DEEPX_ROLES": CPU_ROLES, "DEEPX_KV_PREFIX": f"ddp{os.getpid()}:"}
    try:
        kv = "memory"
        if mode == "per-rank":
            redis = shutil.which("redis-server")
            if redis is None:
                raise SystemExit("--daemons per-rank needs redis-server on PATH (apt-get install redis-server); "
                                 "--daemons shared runs every rank on one deepxd")
            port = _free_port()
            log = folder / "redis.log"
            p = subprocess.Popen([redis, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
                                  "no", "--dir", str(folder), "--logfile", str(log)],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            procs.append((p, None))
            _wait(lambda: _redis_answers(port), "redis-server", p, log)
            kv = f"redis://127.0.0.1:{port}/0"
            # each daemon computes for one rank: share the cores between them rather than each taking them all
            threads = str(max(1, (os.cpu_count() or 1) // ranks))
            env.update(OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads, OPENBLAS_NUM_THREADS=threads)
        addresses = [f"unix://{folder / f'deepxd{i}.sock'}" for i in range(ranks if mode == "per-rank" else 1)]
        for i, address in enumerate(addresses):  # started together, then waited for
            logf = open(folder / f"deepxd{i}.log", "wb")  # (closed with the process, below)
            procs.append((subprocess.Popen([sys.executable, "-m", "deepxd", "start", "--listen", address, "--udp",
                                            "off", "--kv", kv, "--node-id", f"ddp{os.getpid()}-{i}", "--log-level",
                                            "warning"], stdout=logf, stderr=subprocess.STDOUT, env=env), logf))
        for i, address in enumerate(addresses):
            _wait(lambda a=address: _answers(a), f"deepxd {i}", procs[i - len(addresses)][0],
                  folder / f"deepxd{i}.log")
        yield addresses * (ranks if mode == "shared" else 1)
    finally:
        for p, logf in reversed(procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(20)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
            if logf is not None:
                logf.close()


def _redis_answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def launch(opts: argparse.Namespace, rest: list[str]) -> int:
    """Start the daemons and one process per rank running this script; the first rank that fails ends the others."""
    mode = opts.daemons or ("per-rank" if shutil.which("redis-server") else "shared")
    with tempfile.TemporaryDirectory(prefix="deepx-ddp-") as tmp, daemons(opts.ranks, mode, Path(tmp)) as addresses:
        print(f"{opts.ranks} ranks, {'one deepxd each on a redis-server' if mode == 'per-rank' else 'one deepxd'}",
              flush=True)
        ranks = [subprocess.Popen([sys.executable, __file__, "--rank-address", addresses[r], *rest],
                                  env={**os.environ, "RANK": str(r), "WORLD_SIZE": str(opts.ranks)})
                 for r in range(opts.ranks)]
        code = 0
        while any(p.poll() is None for p in ranks):
            failed = [p for p in ranks if p.poll() not in (None, 0)]
            if failed and not code:
                code = failed[0].returncode
                for p in ranks:  # the others would wait for it until the group's timeout
                    if p.poll() is None:
                        p.terminate()
            time.sleep(0.1)
        return code or max(p.returncode for p in ranks)


def train(opts: argparse.Namespace) -> None:
    """One rank: RANK and WORLD_SIZE from the environment."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    import deepx_sdk as dx
    import deepx_sdk.distributed as dist
    import deepx_sdk.nn as nn
    import deepx_sdk.nn.functional as F
    from deepx_sdk.nn.parallel import DistributedDataParallel
    from deepx_sdk.optim import Adam

    dx.connect(opts.rank_address)
    dist.init_process_group(timeout=60)
    rank, world = dist.get_rank(), dist.get_world_size()
    dx.manual_seed(rank)  # different initial weights on each rank: DistributedDataParallel takes rank 0's
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    x_train, x_test, y_train, y_test = train_test_split(x, digits.target.astype(np.int64), test_size=0.25,
                                                        random_state=0, stratify=digits.target)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(),
                                                  nn.Linear(64, 10)))
    opt = Adam(model.parameters(), lr=opts.lr)
    rng = np.random.default_rng(0)  # the same order on every rank; each takes its share of every batch
    n = len(x_train)
    started = time.perf_counter()
    with _progress(rank == 0) as progress:
        task = progress.add_task("training", total=opts.epochs) if progress else None
        for epoch in range(opts.epochs):
            order = rng.permutation(n)
            total = 0.0
            for i in range(0, n - opts.batch + 1, opts.batch):  # whole batches: each rank's share the same size
                idx = order[i:i + opts.batch][rank::world]
                opt.zero_grad()
                loss = F.cross_entropy(model(dx.tensor(x_train[idx])), dx.tensor(y_train[idx]))
                loss.backward()  # the gradients come back averaged over the ranks
                opt.step()
                if progress:
                    total += loss.item() * len(idx) * world  # rank 0's loss stands for its batch
            if progress:
                progress.update(task, advance=1, description=f"epoch {epoch + 1} loss {total / n:.4f}")
    if rank == 0:
        with dx.no_grad():
            predicted = model(dx.tensor(x_test)).argmax(1).numpy()
        took = time.perf_counter() - started
        print(f"test accuracy {float((predicted == y_test).mean()):.4f} after {opts.epochs} epochs on {world} ranks "
              f"in {took:.1f} s ({opts.epochs * (n // opts.batch) * opts.batch / took:.0f} samples/s)")
        dx.save(model.module.state_dict(), "mlp_digits_ddp.safetensors")
        print("weights saved to mlp_digits_ddp.safetensors")
    dist.destroy_process_group()


@contextlib.contextmanager
def _progress(show: bool) -> Iterator[Any]:
    if not show:
        yield None
        return
    from bars import progress_bar  # examples/bars.py

    with progress_bar() as progress:
        yield progress


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--daemons", choices=["per-rank", "shared"], default=None,
                    help="one deepxd per rank on a redis-server (default where redis-server is on PATH), or one")
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--batch", type=int, default=64, help="the whole batch, shared among the ranks")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--rank-address", default=None,
                    help="run one rank on this deepxd (RANK and WORLD_SIZE from the environment), starting nothing")
    opts = ap.parse_args()
    if opts.rank_address:
        train(opts)
        return
    sys.exit(launch(opts, ["--epochs", str(opts.epochs), "--batch", str(opts.batch), "--lr", str(opts.lr)]))


if __name__ == "__main__":
    main()
