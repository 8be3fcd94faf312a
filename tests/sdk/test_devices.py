"""Devices as torch code writes them (deepx_sdk/devices.py): accepted everywhere a torch script names one, a no-op
for placement, checked for form; `x.device` and `dx.cuda.is_available()` tell what the daemon does."""

from __future__ import annotations

import numpy as np
import pytest

import deepx_sdk as dx
import deepx_sdk.nn as nn
from deepx_core.errors import DeepxError
from deepx_sdk.devices import device, is_device


def test_device_parses_and_compares_as_torch_device():
    import torch

    for spec in ("cpu", "cuda", "cuda:0", "cuda:3", "mps"):
        d, t = device(spec), torch.device(spec)
        assert (d.type, d.index, str(d), repr(d)) == (t.type, t.index, str(t), repr(t))
    assert device("cuda", 1) == "cuda:1" == device(device("cuda:1")) and device("cuda") != device("cuda:0")
    assert hash(device("cuda:1")) == hash(device("cuda", 1)) and device("cpu") != 3
    assert is_device("cuda:0") and is_device(device("cpu")) and not is_device("float32") and not is_device(None)
    with pytest.raises(DeepxError, match="unknown device type 'tpu'; deepx accepts cpu, cuda, deepx, mps, xpu"):
        device("tpu")
    with pytest.raises(DeepxError, match=r"invalid device string 'cuda:x'"):
        device("cuda:x")
    with pytest.raises(DeepxError, match="has an index already"):
        device("cuda:0", 1)
    with pytest.raises(DeepxError, match="expected a string"):
        device(3)


def test_a_cpu_daemon_says_cpu_and_takes_every_device_spelling():
    x = dx.tensor(np.arange(3, dtype=np.float32))
    assert x.device == device("cpu") and x.device.type == "cpu" and not x.is_cuda
    assert dx.cuda.is_available() is False and dx.cuda.device_count() == 0
    run = "cuda" if dx.cuda.is_available() else "cpu"
    for moved in (x.to("cuda"), x.to("cuda:0"), x.to(dx.device("cuda")), x.cuda(), x.cpu(), x.to(run),
                  x.to(device=x.device), x.to("cuda", non_blocking=True)):
        assert moved is x  # the daemon placed it already: nothing to send
    assert x.to("cuda", dtype=dx.float64).dtype == "float64" and x.to("cpu", dx.float16).dtype == "float16"
    assert x.to(dx.tensor(np.zeros(1))).dtype == "float64"  # another tensor's dtype, as torch
    copied = x.to("cuda", copy=True)
    assert copied is not x and np.array_equal(copied.numpy(), x.numpy())
    with pytest.raises(DeepxError, match=r"invalid device string 'cuda:one'"):
        x.to("cuda:one")
    with pytest.raises(DeepxError, match="unexpected keyword 'pin'"):
        x.to("cuda", pin=True)
    dx.cuda.synchronize()


def test_factories_take_device():
    d = dx.device("cuda")
    made = [dx.zeros(2, device=d), dx.ones(2, device="cuda:0"), dx.empty(2, device="cpu"),
            dx.full((2,), 1.5, device=d), dx.arange(2, device=d), dx.linspace(0, 1, 2, device=d),
            dx.rand(2, device=d), dx.randn(2, device=d), dx.randint(0, 3, (2,), device=d),
            dx.tensor([1.0, 2.0], device=d), dx.as_tensor(np.zeros(2), device=d)]
    made += [f(made[0], device=d) for f in (dx.zeros_like, dx.ones_like, dx.empty_like, dx.rand_like, dx.randn_like)]
    assert all(t.shape == (2,) for t in made)
    assert np.array_equal(made[1].numpy(), [1.0, 1.0]) and made[8].dtype == "int64"
    with pytest.raises(DeepxError, match="unknown device type 'gpu'"):
        dx.zeros(2, device="gpu")


def test_tensor_type_as_torch():
    x = dx.tensor(np.ones(2, np.float32))
    assert x.type() == "deepx.FloatTensor" and dx.tensor(np.ones(1, np.int64)).type() == "deepx.LongTensor"
    assert x.type(dx.float64).dtype == "float64" and x.type("torch.DoubleTensor").dtype == "float64"
    assert x.type(x.type(dx.int32).type()).dtype == "int32"
    with pytest.raises(DeepxError, match=r"unknown tensor type 'torch\.FooTensor'"):
        x.type("torch.FooTensor")


def test_a_model_moved_to_a_device_trains_unchanged():
    """torch's idiom: device picked once, model and batches moved to it; on a CPU daemon it trains as it would."""
    device_ = dx.device("cuda" if dx.cuda.is_available() else "cpu")
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).to(device_)
    model.cuda()
    opt = dx.optim.SGD(model.parameters(), lr=0.1)
    rng = np.random.default_rng(0)
    x = dx.tensor(rng.standard_normal((16, 4)).astype(np.float32)).to(device_)
    y = dx.tensor(rng.integers(0, 2, 16)).to(device_, non_blocking=True)
    first = None
    for _ in range(20):
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        first = first if first is not None else float(loss)
    assert float(loss) < first and next(model.parameters()).device == device_


def test_an_embedded_node_takes_the_gpu_settings_from_the_environment(monkeypatch, tmp_path):
    from deepxd.embedded import EmbeddedNode

    monkeypatch.setenv("DEEPX_CUDA_WARM", "0")
    monkeypatch.setenv("DEEPX_CUDA_TF32", "1")
    node = EmbeddedNode(str(tmp_path / "d.sock"), "envnode")
    assert (node.config.cuda_warm, node.config.cuda_tf32, node.config.cuda_device) == (0, 1, 0)
    monkeypatch.setenv("DEEPX_CUDA_DEVICE", "minus one")
    with pytest.raises(DeepxError, match="DEEPX_CUDA_DEVICE"):
        EmbeddedNode(str(tmp_path / "e.sock"), "envnode2")
