"""Train an MLP on scikit-learn's bundled 8x8 digits (no download) with deepx, then report test accuracy.

    python examples/train_mlp.py [--epochs 30] [--address unix:///path/deepxd.sock]

With no address the SDK starts an embedded deepxd inside this process.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from bars import progress_bar  # examples/bars.py
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import deepx_sdk as dx
import deepx_sdk.nn as nn
import deepx_sdk.nn.functional as F
from deepx_sdk.optim import Adam


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--address", default=None, help="a running deepxd (unix:///...); default: embedded")
    opts = ap.parse_args()

    dx.connect(opts.address)
    dx.manual_seed(0)
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    x_train, x_test, y_train, y_test = train_test_split(x, digits.target.astype(np.int64), test_size=0.25,
                                                        random_state=0, stratify=digits.target)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 10))
    opt = Adam(model.parameters(), lr=opts.lr)
    rng = np.random.default_rng(0)
    n = len(x_train)
    started = time.perf_counter()
    with progress_bar() as progress:
        task = progress.add_task("training", total=opts.epochs)
        for epoch in range(opts.epochs):
            order = rng.permutation(n)
            total = 0.0
            for i in range(0, n, opts.batch):
                idx = order[i:i + opts.batch]
                opt.zero_grad()
                loss = F.cross_entropy(model(dx.tensor(x_train[idx])), dx.tensor(y_train[idx]))
                loss.backward()
                opt.step()
                total += loss.item() * len(idx)
            progress.update(task, advance=1, description=f"epoch {epoch + 1} loss {total / n:.4f}")
    with dx.no_grad():
        predicted = model(dx.tensor(x_test)).argmax(1).numpy()
    accuracy = float((predicted == y_test).mean())
    print(f"test accuracy {accuracy:.4f} after {opts.epochs} epochs in {time.perf_counter() - started:.1f} s")
    dx.save(model.state_dict(), "mlp_digits.safetensors")
    print("weights saved to mlp_digits.safetensors")


if __name__ == "__main__":
    main()
