"""Training on the GPU matches training on the CPU: the same MLP, the same start, a few SGD (momentum) and Adam
steps through the embedded daemon with op-cuda (`dx.connect(roles=["heapmem", "op-cuda"])`) and with op-cpu; the
losses and the final weights agree within float32 tolerance, and the parameters live on the GPU."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("pycuda.driver", reason="PyCUDA is not installed: training on op-cuda needs an NVIDIA GPU "
                    "(pip install -e '.[cuda]' there: docs/cuda.md)")
from deepxd.actors.messages import ListTensors
from deepxd.config import cuda_available

if not cuda_available():
    pytest.skip("no CUDA device answers here: training on op-cuda needs an NVIDIA GPU", allow_module_level=True)

import deepx_sdk as dx
import deepx_sdk.nn as nn
import deepx_sdk.nn.functional as F
from deepx_sdk.optim import SGD, Adam

STEPS = 6


def _start() -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray]:
    rng = np.random.default_rng(3)
    shapes = {"0.weight": (64, 32), "0.bias": (64,), "2.weight": (64, 64), "2.bias": (64,), "4.weight": (10, 64),
              "4.bias": (10,)}
    weights = {k: (rng.standard_normal(s) / np.sqrt(s[-1])).astype(np.float32) for k, s in shapes.items()}
    x = rng.standard_normal((128, 32)).astype(np.float32)
    y = rng.integers(0, 10, 128)
    return weights, x, y


def _train(roles: list[str] | None, optimizer: str, steps: int = STEPS, now: bool = True
           ) -> tuple[list[float], dict[str, np.ndarray], list[dict], int]:
    """The losses, the final weights, the registry's rows, and how many runs took the way with no event loop step
    (Scheduler.now_run; now=False: every run by the ask)."""
    s = dx.connect(roles=roles)
    try:
        sched = s.transport.node.ref("scheduler")._actor
        if not now:
            sched.now_run = lambda *args: None
        weights, x, y = _start()
        model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
        model.load_state_dict(weights)
        params = list(model.parameters())
        opt = SGD(params, lr=0.05, momentum=0.9) if optimizer == "sgd" else Adam(params, lr=1e-3)
        X, Y = dx.tensor(x), dx.tensor(y)
        losses = []
        for _ in range(steps):
            opt.zero_grad()
            loss = F.cross_entropy(model(X), Y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        final = {k: v.numpy() for k, v in model.state_dict().items()}
        node = s.transport.node
        rows = s.transport._call(node.ref("registry").ask(ListTensors()))
        return losses, final, rows, sched.now_hits
    finally:
        dx.disconnect()


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_an_mlp_trained_on_the_gpu_matches_the_same_mlp_trained_on_the_cpu(optimizer, monkeypatch):
    monkeypatch.delenv("DEEPX_ADDRESS", raising=False)
    monkeypatch.delenv("DEEPX_ROLES", raising=False)
    gpu_losses, gpu_weights, gpu_rows, _ = _train(["heapmem", "op-cuda"], optimizer)
    cpu_losses, cpu_weights, cpu_rows, _ = _train(None, optimizer)
    np.testing.assert_allclose(gpu_losses, cpu_losses, rtol=1e-4)
    assert gpu_losses[-1] < gpu_losses[0]
    for k in cpu_weights:
        np.testing.assert_allclose(gpu_weights[k], cpu_weights[k], rtol=1e-3, atol=1e-5, err_msg=k)
    heap = [r for r in gpu_rows if r.get("kind") == "heap"]
    assert len(heap) >= 6 and all(r["device"] == "cuda:0" for r in heap)  # the parameters (and optimizer state)
    assert all(r.get("device", "cpu") == "cpu" for r in cpu_rows)


def test_repeated_steps_on_the_gpu_run_now_as_by_the_ask(monkeypatch):
    monkeypatch.delenv("DEEPX_ADDRESS", raising=False)
    monkeypatch.delenv("DEEPX_ROLES", raising=False)
    """op-cuda's repeated steps with no event loop step (CudaWorker.run_prepared, on its CUDA thread) give what the
    ask's way gives."""
    now_losses, now_weights, _, hits = _train(["heapmem", "op-cuda"], "sgd", steps=12)
    ask_losses, ask_weights, _, none = _train(["heapmem", "op-cuda"], "sgd", steps=12, now=False)
    assert hits >= 4 and none == 0
    np.testing.assert_allclose(now_losses, ask_losses, rtol=1e-6)
    for k in ask_weights:
        np.testing.assert_allclose(now_weights[k], ask_weights[k], rtol=1e-6, atol=1e-7, err_msg=k)
    assert now_losses[-1] < now_losses[0]
