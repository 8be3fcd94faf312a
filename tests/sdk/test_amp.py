"""Mixed precision (deepx_sdk/amp.py) against torch: autocast's dtypes per op, values and gradients against torch's
CPU autocast where its lists agree with CUDA's (linear, matmul, conv, the losses), and GradScaler's trajectory
against torch.amp.GradScaler."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

import deepx_sdk as dx
import deepx_sdk.nn as nn
import deepx_sdk.nn.functional as F
from deepx_core.errors import DeepxError


def _mlp(seed: int = 0):
    rng = np.random.default_rng(seed)
    w1, b1 = rng.standard_normal((16, 8)).astype(np.float32) * 0.3, rng.standard_normal(16).astype(np.float32) * 0.1
    w2, b2 = rng.standard_normal((5, 16)).astype(np.float32) * 0.3, rng.standard_normal(5).astype(np.float32) * 0.1
    x = rng.standard_normal((12, 8)).astype(np.float32)
    y = rng.integers(0, 5, 12)
    ours = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 5))
    theirs = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 5))
    for mod, params in ((ours, (w1, b1, w2, b2)), (theirs, (w1, b1, w2, b2))):
        for p, v in zip(mod.parameters(), params):
            p.data.copy_(dx.tensor(v) if mod is ours else torch.from_numpy(v))
    return ours, theirs, x, y


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_an_mlp_step_under_autocast_matches_torch(dtype):
    ours, theirs, x, y = _mlp()
    with dx.autocast("cuda", dtype=dtype):
        logits = ours(dx.tensor(x))
        loss = F.cross_entropy(logits, dx.tensor(y))
    with torch.autocast("cpu", dtype=getattr(torch, dtype)):
        tlogits = theirs(torch.from_numpy(x))
        tloss = torch.nn.functional.cross_entropy(tlogits, torch.from_numpy(y))
    assert (logits.dtype, loss.dtype) == (dtype, "float32")
    assert (str(tlogits.dtype), str(tloss.dtype)) == (f"torch.{dtype}", "torch.float32")
    tol = 2e-2 if dtype == "bfloat16" else 2e-3
    np.testing.assert_allclose(logits.float().numpy(), tlogits.float().detach().numpy(), rtol=tol, atol=tol)
    np.testing.assert_allclose(loss.item(), tloss.item(), rtol=tol)
    loss.backward()
    tloss.backward()
    for p, q in zip(ours.parameters(), theirs.parameters()):
        assert p.grad.dtype == "float32"  # parameters and their gradients stay float32
        np.testing.assert_allclose(p.grad.numpy(), q.grad.numpy(), rtol=5 * tol, atol=tol)


def test_each_list_casts_as_torch_on_cuda_says():
    a32 = dx.randn(4, 6)
    b32 = dx.randn(6, 3)
    a64 = dx.randn(4, 6, dtype=dx.float64)
    with dx.autocast(dtype=dx.bfloat16):
        assert (a32 @ b32).dtype == "bfloat16"
        assert dx.matmul(a32, b32).dtype == "bfloat16" and a32.mm(b32).dtype == "bfloat16"
        assert (a64 @ a64.t()).dtype == "float64"  # float64 is never cast
        h = a32 @ b32
        for out in (h.softmax(-1), h.log_softmax(-1), h.sum(), h.exp(), h.log(), h.pow(2), h.rsqrt(), h.cumsum(0),
                    F.layer_norm(h, (3,)), F.mse_loss(h, h.detach()), F.l1_loss(h, h.detach()),
                    F.softplus(h), F.rms_norm(h, (3,))):
            assert out.dtype == "float32", out
        for out in (h.relu(), h + 1.0, h * h, h.tanh(), F.gelu(h)):  # the rest keep their inputs' dtype
            assert out.dtype == "bfloat16", out
        assert (h + a32[:, :3]).dtype == "float32"  # mixed inputs promote, as always
        img = dx.randn(2, 3, 8, 8)
        conv = nn.Conv2d(3, 4, 3)
        assert conv(img).dtype == "bfloat16" and conv.weight.dtype == "float32"
        q = dx.randn(2, 2, 5, 4)
        assert F.scaled_dot_product_attention(q, q, q, is_causal=True).dtype == "bfloat16"
        with dx.autocast(enabled=False):
            assert (a32 @ b32).dtype == "float32"
        assert dx.is_autocast_enabled() and dx.get_autocast_dtype() == "bfloat16"
    assert not dx.is_autocast_enabled() and (a32 @ b32).dtype == "float32"


def test_conv_under_autocast_matches_torch():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 3, 9, 9)).astype(np.float32)
    w = rng.standard_normal((4, 3, 3, 3)).astype(np.float32) * 0.2
    with dx.autocast(dtype="bfloat16"):
        ours = F.conv2d(dx.tensor(x), dx.tensor(w), padding=1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        theirs = torch.nn.functional.conv2d(torch.from_numpy(x), torch.from_numpy(w), padding=1)
    assert ours.dtype == "bfloat16" and theirs.dtype == torch.bfloat16
    np.testing.assert_allclose(ours.float().numpy(), theirs.float().numpy(), rtol=3e-2, atol=3e-2)


def test_the_state_is_per_thread_and_a_decorator_works():
    seen = []

    @dx.autocast(dtype="float16")
    def f(a, b):
        return (a @ b).dtype

    a = dx.randn(3, 3)
    with dx.autocast(dtype="bfloat16"):
        t = threading.Thread(target=lambda: seen.append(dx.get_autocast_dtype()))
        t.start()
        t.join()
        assert f(a, a) == "float16" and dx.get_autocast_dtype() == "bfloat16"
    assert seen == [None]
    with pytest.raises(DeepxError, match="dtype must be bfloat16 or float16, got float32"):
        dx.autocast(dtype="float32")


def _scaler_run(inf_at: set[int], steps: int):
    """Ours and torch's GradScaler over the same SGD steps; at the steps in inf_at a gradient is made inf."""
    ours, theirs, x, y = _mlp(3)
    opt = dx.optim.SGD(ours.parameters(), lr=0.1)
    topt = torch.optim.SGD(theirs.parameters(), lr=0.1)
    scaler = dx.amp.GradScaler(init_scale=2.0 ** 10, growth_interval=3)
    tscaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=3)
    scales = []
    for step in range(steps):
        opt.zero_grad()
        topt.zero_grad()
        bad = float("inf") if step in inf_at else 1.0
        loss = F.cross_entropy(ours(dx.tensor(x)), dx.tensor(y)) * bad
        tloss = torch.nn.functional.cross_entropy(theirs(torch.from_numpy(x)), torch.from_numpy(y)) * bad
        scaler.scale(loss).backward()
        tscaler.scale(tloss).backward()
        scaler.step(opt)
        tscaler.step(topt)
        scaler.update()
        tscaler.update()
        scales.append((scaler.get_scale(), tscaler.get_scale()))
    return ours, theirs, scales


def test_grad_scaler_skips_bad_steps_and_moves_its_scale_as_torch():
    ours, theirs, scales = _scaler_run({1, 5}, 10)
    assert [a for a, _ in scales] == [b for _, b in scales]
    assert scales[1][0] == 2.0 ** 9 and max(a for a, _ in scales) > 2.0 ** 9  # backed off, then grew again
    for p, q in zip(ours.parameters(), theirs.parameters()):
        np.testing.assert_allclose(p.numpy(), q.detach().numpy(), rtol=1e-5, atol=1e-6)


def test_grad_scaler_unscale_for_clipping_and_state():
    ours, _, x, y = _mlp(4)
    opt = dx.optim.SGD(ours.parameters(), lr=0.1)
    scaler = dx.amp.GradScaler(init_scale=8.0)
    loss = F.cross_entropy(ours(dx.tensor(x)), dx.tensor(y))
    scaler.scale(loss).backward()
    scaled = [p.grad.numpy().copy() for p in ours.parameters()]
    scaler.unscale_(opt)
    for p, g in zip(ours.parameters(), scaled):
        np.testing.assert_allclose(p.grad.numpy(), g / 8.0, rtol=1e-6)
    with pytest.raises(DeepxError, match="unscale_ was already called"):
        scaler.unscale_(opt)
    scaler.step(opt)  # not unscaled twice
    scaler.update()
    state = scaler.state_dict()
    other = dx.amp.GradScaler()
    other.load_state_dict(state)
    assert other.get_scale() == scaler.get_scale() == 8.0
    assert dx.amp.GradScaler(enabled=False).scale(loss) is loss
