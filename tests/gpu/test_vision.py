"""A small CNN (convolution, batch norm, pooling: deepx_sdk/nn/vision.py) trained on op-cuda matches the same CNN
trained on op-cpu, and so does one of group norm and both interpolate modes (the norm and resize ops' CUDA kernels
through the SDK: statistics held for the backward, running statistics updated in place)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("pycuda.driver", reason="PyCUDA is not installed: op-cuda needs an NVIDIA GPU "
                    "(pip install -e '.[cuda]' there: docs/cuda.md)")
from deepxd.config import cuda_available

if not cuda_available():
    pytest.skip("no CUDA device answers here: op-cuda needs an NVIDIA GPU", allow_module_level=True)

import deepx_sdk as dx
import deepx_sdk.nn as nn
import deepx_sdk.nn.functional as F
from deepx_sdk.optim import SGD


def _train(roles: list[str] | None) -> tuple[list[float], dict[str, np.ndarray]]:
    dx.connect(roles=roles)
    try:
        rng = np.random.default_rng(0)
        model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
                              nn.Conv2d(8, 8, 3, stride=2, groups=2), nn.ReLU(), nn.AvgPool2d(2, padding=1),
                              nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))
        start = {k: (rng.standard_normal(v.shape) * 0.3).astype(np.float32) for k, v in model.state_dict().items()
                 if v.dtype == "float32"}
        model.load_state_dict({**{k: v for k, v in model.state_dict().items()}, **start})
        opt = SGD(model.parameters(), lr=0.05, momentum=0.9)
        x = dx.tensor(rng.standard_normal((6, 3, 12, 12)).astype(np.float32))
        y = dx.tensor(rng.integers(0, 4, 6))
        losses = []
        for _ in range(5):
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses, {k: v.numpy() for k, v in model.state_dict().items()}
    finally:
        dx.disconnect()


def test_a_cnn_trained_on_the_gpu_matches_the_cpu(monkeypatch):
    monkeypatch.delenv("DEEPX_ADDRESS", raising=False)
    monkeypatch.delenv("DEEPX_ROLES", raising=False)
    gpu_losses, gpu_state = _train(["heapmem", "op-cuda"])
    cpu_losses, cpu_state = _train(None)
    np.testing.assert_allclose(gpu_losses, cpu_losses, rtol=1e-4)
    assert gpu_losses[-1] < gpu_losses[0]
    for k in cpu_state:
        np.testing.assert_allclose(gpu_state[k], cpu_state[k], rtol=1e-3, atol=1e-5, err_msg=k)


def _train_norms(roles: list[str] | None) -> tuple[list[float], dict[str, np.ndarray]]:
    """BatchNorm2d (momentum=None: the count), GroupNorm, nearest and bilinear Upsample, 4 steps of SGD, then an eval
    forward on the running statistics."""
    dx.connect(roles=roles)
    try:
        rng = np.random.default_rng(1)
        model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8, momentum=None), nn.ReLU(),
                              nn.Upsample(scale_factor=2, mode="nearest"), nn.Conv2d(8, 8, 3, stride=2),
                              nn.GroupNorm(4, 8), nn.ReLU(), nn.Upsample(size=(9, 7), mode="bilinear"),
                              nn.Upsample(scale_factor=0.5, mode="bilinear", align_corners=True),
                              nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))
        start = {k: (rng.standard_normal(v.shape) * 0.3).astype(np.float32) for k, v in model.state_dict().items()
                 if v.dtype == "float32" and not k.endswith(("running_mean", "running_var"))}
        model.load_state_dict({**dict(model.state_dict()), **start})
        opt = SGD(model.parameters(), lr=0.05, momentum=0.9)
        x = dx.tensor(rng.standard_normal((6, 3, 10, 10)).astype(np.float32))
        y = dx.tensor(rng.integers(0, 4, 6))
        losses = []
        for _ in range(4):
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        model.eval()
        losses.append(F.cross_entropy(model(x), y).item())
        return losses, {k: v.numpy() for k, v in model.state_dict().items()}
    finally:
        dx.disconnect()


def test_norms_and_resizing_trained_on_the_gpu_match_the_cpu(monkeypatch):
    monkeypatch.delenv("DEEPX_ADDRESS", raising=False)
    monkeypatch.delenv("DEEPX_ROLES", raising=False)
    gpu_losses, gpu_state = _train_norms(["heapmem", "op-cuda"])
    cpu_losses, cpu_state = _train_norms(None)
    np.testing.assert_allclose(gpu_losses, cpu_losses, rtol=1e-4)
    for k in cpu_state:
        np.testing.assert_allclose(gpu_state[k], cpu_state[k], rtol=1e-3, atol=1e-5, err_msg=k)
    assert int(gpu_state["1.num_batches_tracked"]) == 4
