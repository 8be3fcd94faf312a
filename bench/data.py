"""Input preparation overlapped with training: an MLP trained from a dataset whose samples cost host work (a random
crop, flip and normalisation of a 28x28 image per sample), with `DataLoader(num_workers=0)` against worker processes
that make batches ahead as heap tensors; torch's DataLoader with the same workers and the same model as the peer.

    python bench/data.py [--batches 60] [--workers 2]

Prints samples per second and the ratios (workers / no workers, deepx / torch). On a machine with fewer free cores
than workers + 1 the overlap has nowhere to run: read the ratio against the core count.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import numpy as np


class Images:
    """n 32x32 images; a sample is a random 28x28 crop, flipped at random, normalised, flattened (host work)."""

    def __init__(self, n: int = 4096, work: int = 6) -> None:
        rng = np.random.default_rng(0)
        self.images = rng.random((n, 32, 32), dtype=np.float32)
        self.labels = rng.integers(0, 10, n)
        self.work = work

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        rng = np.random.default_rng(i)
        y0, x0 = rng.integers(0, 5, 2)
        img = self.images[i, y0:y0 + 28, x0:x0 + 28]
        if rng.random() < 0.5:
            img = img[:, ::-1]
        for _ in range(self.work):  # stands for decoding and augmentation
            img = (img - img.mean()) / (img.std() + 1e-6)
        return np.ascontiguousarray(img, dtype=np.float32).reshape(-1), int(self.labels[i])


def run_deepx(ds: Images, batches: int, batch: int, workers: int) -> float:
    import deepx_sdk as dx
    import deepx_sdk.nn as nn
    import deepx_sdk.nn.functional as F
    from deepx_sdk.utils.data import DataLoader, Dataset

    class Wrapped(Dataset):
        def __len__(self) -> int:
            return len(ds)

        def __getitem__(self, i: int) -> Any:
            return ds[i]

    dx.manual_seed(0)
    model = nn.Sequential(nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 10))
    opt = dx.optim.SGD(model.parameters(), lr=0.05)
    loader = DataLoader(Wrapped(), batch_size=batch, shuffle=True, num_workers=workers)
    return _loop(loader, model, opt, F, batches, batch)


def run_torch(ds: Images, batches: int, batch: int, workers: int) -> float:
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    from torch.utils.data import DataLoader

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = DataLoader(ds, batch_size=batch, shuffle=True, num_workers=workers)  # type: ignore[arg-type]
    return _loop(loader, model, opt, F, batches, batch)


#: batches before the clock starts: the workers' start, the first steps' compilation, and the batches the workers
#: made ahead while that went on (2 per worker at most), so that the timed ones are made at the loop's pace
SKIP = 8


def _loop(loader: Any, model: Any, opt: Any, F: Any, batches: int, batch: int) -> float:
    n = 0
    t0 = t1 = None
    for i, (x, y) in enumerate(loader):
        if i == SKIP:
            t0 = time.perf_counter()
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        loss.item()
        if i >= SKIP:
            n += batch
        if i + 1 >= batches + SKIP:
            t1 = time.perf_counter()  # before the loop's end closes the workers
            break
    assert t0 is not None and t1 is not None
    return n / (t1 - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, default=60)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--workers", type=int, default=2)
    opts = ap.parse_args()
    ds = Images()  # deepx's rows first: torch's OpenMP runtime, once loaded, keeps deepx off MKL
    rows = {
        "deepx, num_workers=0": run_deepx(ds, opts.batches, opts.batch, 0),
        f"deepx, num_workers={opts.workers}": run_deepx(ds, opts.batches, opts.batch, opts.workers),
        "torch, num_workers=0": run_torch(ds, opts.batches, opts.batch, 0),
        f"torch, num_workers={opts.workers}": run_torch(ds, opts.batches, opts.batch, opts.workers),
    }
    print(f"{os.cpu_count()} cores; batch {opts.batch}, {opts.batches} timed batches")
    for name, rate in rows.items():
        print(f"{name:24} {rate:10.0f} samples/s")
    w = opts.workers
    print(f"deepx workers / no workers: {rows[f'deepx, num_workers={w}'] / rows['deepx, num_workers=0']:.2f}x; "
          f"torch workers / no workers: {rows[f'torch, num_workers={w}'] / rows['torch, num_workers=0']:.2f}x; "
          f"deepx / torch with workers: {rows[f'deepx, num_workers={w}'] / rows[f'torch, num_workers={w}']:.2f}x")


if __name__ == "__main__":
    main()
