"""Train a small CNN on scikit-learn's bundled 8x8 digits (no download) with deepx's data utilities, then report
test accuracy.

    python examples/train_cnn.py [--epochs 12] [--address unix:///path/deepxd.sock]

Conv-BatchNorm-ReLU-MaxPool, a second convolution, global average pooling and a linear head, fed by a shuffled
DataLoader over a TensorDataset; written as the same model in PyTorch would be. With no address the SDK starts an
embedded deepxd inside this process.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import deepx_sdk as dx
import deepx_sdk.nn as nn
import deepx_sdk.nn.functional as F
from deepx_sdk.optim import Adam
from deepx_sdk.utils.data import DataLoader, Generator, TensorDataset


def model() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        nn.Linear(32, 10),
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=12)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=5e-3)
    ap.add_argument("--address", default=None, help="a running deepxd (unix:///...); default: embedded")
    opts = ap.parse_args()

    dx.connect(opts.address)
    dx.manual_seed(0)
    digits = load_digits()
    images = (digits.images / 16.0).astype(np.float32)[:, None]  # (N, 1, 8, 8)
    x_train, x_test, y_train, y_test = train_test_split(images, digits.target.astype(np.int64), test_size=0.25,
                                                        random_state=0, stratify=digits.target)
    loader = DataLoader(TensorDataset(dx.tensor(x_train), dx.tensor(y_train)), batch_size=opts.batch, shuffle=True,
                        generator=Generator().manual_seed(0))
    net = model()
    opt = Adam(net.parameters(), lr=opts.lr)
    started = time.perf_counter()
    for epoch in range(opts.epochs):
        net.train()
        total, seen = 0.0, 0
        for x, y in loader:
            opt.zero_grad()
            loss = F.cross_entropy(net(x), y)
            loss.backward()
            opt.step()
            total += loss.item() * x.shape[0]
            seen += x.shape[0]
        print(f"epoch {epoch + 1}: loss {total / seen:.4f}")
    net.eval()
    with dx.no_grad():
        predicted = net(dx.tensor(x_test)).argmax(1).numpy()
    accuracy = float((predicted == y_test).mean())
    print(f"test accuracy {accuracy:.4f} after {opts.epochs} epochs in {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main()
