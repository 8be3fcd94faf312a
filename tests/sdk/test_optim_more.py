"""RMSprop, LambdaLR, LinearLR, OneCycleLR and gradient clipping against torch: trajectories on the same gradients."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import deepx_sdk as dx
import deepx_sdk.nn as nn
from deepx_core.errors import DeepxError
from deepx_sdk.optim import SGD, Adam, LambdaLR, LinearLR, OneCycleLR, RMSprop, lr_scheduler
from tests.sdk.test_optim import _run


@pytest.mark.parametrize("kw", [
    {"lr": 0.01},
    {"lr": 0.01, "alpha": 0.9, "eps": 1e-6, "weight_decay": 0.01},
    {"lr": 0.005, "momentum": 0.9},
    {"lr": 0.005, "momentum": 0.5, "centered": True, "weight_decay": 0.001},
])
def test_rmsprop_follows_torch(kw):
    opt, topt = _run(lambda ps: RMSprop(ps, **kw), lambda ps: torch.optim.RMSprop(ps, foreach=False, **kw))
    keys = {"step", "square_avg"} | ({"grad_avg"} if kw.get("centered") else set()) | (
        {"momentum_buffer"} if kw.get("momentum") else set())
    assert set(opt.state_dict()["state"][0]) == keys
    for k in keys - {"step"}:
        np.testing.assert_allclose(opt.state_dict()["state"][0][k].numpy(),
                                   topt.state_dict()["state"][0][k].numpy(), rtol=1e-9, atol=1e-12)


def test_rmsprop_float32():
    _run(lambda ps: RMSprop(ps, lr=0.01, momentum=0.9), lambda ps: torch.optim.RMSprop(ps, lr=0.01, momentum=0.9),
         dtype=np.float32)


def test_rmsprop_refuses_negative_hyperparameters():
    with pytest.raises(DeepxError, match="RMSprop: lr=-1"):
        RMSprop([nn.Parameter(np.zeros(2))], lr=-1)


@pytest.mark.parametrize("make, tmake", [
    (lambda o: LambdaLR(o, lambda e: min(1.0, (e + 1) / 5)),
     lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda e: min(1.0, (e + 1) / 5))),
    (lambda o: LinearLR(o, start_factor=0.1, total_iters=8),
     lambda o: torch.optim.lr_scheduler.LinearLR(o, start_factor=0.1, total_iters=8)),
    (lambda o: LinearLR(o, start_factor=1.0, end_factor=0.25, total_iters=6),
     lambda o: torch.optim.lr_scheduler.LinearLR(o, start_factor=1.0, end_factor=0.25, total_iters=6)),
    (lambda o: OneCycleLR(o, max_lr=0.1, total_steps=21),
     lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.1, total_steps=21)),
    (lambda o: lr_scheduler.OneCycleLR(o, max_lr=0.05, epochs=3, steps_per_epoch=7, anneal_strategy="linear",
                                       three_phase=True, pct_start=0.25),
     lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.05, epochs=3, steps_per_epoch=7,
                                                   anneal_strategy="linear", three_phase=True, pct_start=0.25)),
])
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_schedulers_follow_torch(make, tmake, optimizer):
    """The lr after construction and after every step, the momentum or beta1 OneCycleLR cycles, and the parameters
    they move, as torch's."""
    if optimizer == "sgd":
        pair = (lambda ps: SGD(ps, lr=0.1, momentum=0.9), lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9))
    else:
        pair = (lambda ps: Adam(ps, lr=0.01), lambda ps: torch.optim.Adam(ps, lr=0.01))
    made = {}

    def both(o, maker, key):
        s = maker(o)
        made[key] = (o, s)
        assert s.get_last_lr() == pytest.approx([g["lr"] for g in o.param_groups], rel=1e-15)
        return s

    opt, topt = _run(pair[0], pair[1], scheduler=(lambda o: both(o, make, "dx"), lambda o: both(o, tmake, "torch")))
    for g, tg in zip(opt.param_groups, topt.param_groups):
        assert g["lr"] == pytest.approx(tg["lr"], rel=1e-12)
        if optimizer == "sgd":
            assert g["momentum"] == pytest.approx(tg["momentum"], rel=1e-12)
        else:
            assert g["betas"][0] == pytest.approx(tg["betas"][0], rel=1e-12)


def test_one_cycle_stepped_past_its_end_raises():
    opt = SGD([nn.Parameter(np.zeros(2))], lr=0.1, momentum=0.9)
    sch = OneCycleLR(opt, max_lr=0.1, total_steps=2)
    sch.step()
    sch.step()
    with pytest.raises(DeepxError, match="stepped 3 times; total_steps is 2"):
        sch.step()
    with pytest.raises(DeepxError, match="give total_steps, or epochs and steps_per_epoch"):
        OneCycleLR(opt, max_lr=0.1)


def _grads_pair(seed=0, dtype=np.float64):
    rng = np.random.default_rng(seed)
    shapes = [(5, 4), (4,), (3, 2, 2)]
    values = [rng.standard_normal(s).astype(dtype) * 3 for s in shapes]
    params = [nn.Parameter(np.zeros(s, dtype)) for s in shapes]
    tparams = [torch.nn.Parameter(torch.zeros(s, dtype=torch.from_numpy(np.zeros(1, dtype)).dtype)) for s in shapes]
    for p, tp, v in zip(params, tparams, values):
        p.grad = dx.tensor(v)
        tp.grad = torch.from_numpy(v.copy())
    return params, tparams


@pytest.mark.parametrize("max_norm, norm_type", [(1.0, 2.0), (100.0, 2.0), (0.5, 1.0), (2.0, math.inf), (0.7, 3.0)])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_clip_grad_norm_follows_torch(max_norm, norm_type, dtype):
    params, tparams = _grads_pair(dtype=dtype)
    total = nn.utils.clip_grad_norm_(params, max_norm, norm_type=norm_type)
    ttotal = torch.nn.utils.clip_grad_norm_(tparams, max_norm, norm_type=norm_type)
    rtol = 1e-12 if dtype == np.float64 else 1e-5
    assert total.shape == () and float(total) == pytest.approx(float(ttotal), rel=rtol)
    for p, tp in zip(params, tparams):
        np.testing.assert_allclose(p.grad.numpy(), tp.grad.numpy(), rtol=rtol, atol=rtol)


def test_clip_grad_norm_of_nothing_and_of_nonfinite():
    assert float(nn.utils.clip_grad_norm_([nn.Parameter(np.zeros(2))], 1.0)) == 0.0  # no gradient: torch's 0
    p = nn.Parameter(np.zeros(3))
    p.grad = dx.tensor(np.array([1.0, np.inf, 0.0]))
    with pytest.raises(DeepxError, match=r"total norm of order 2\.0 of the gradients is inf"):
        nn.utils.clip_grad_norm_([p], 1.0, error_if_nonfinite=True)


def test_clip_grad_value_follows_torch():
    params, tparams = _grads_pair(seed=1)
    nn.utils.clip_grad_value_(params, 0.8)
    torch.nn.utils.clip_grad_value_(tparams, 0.8)
    for p, tp in zip(params, tparams):
        np.testing.assert_array_equal(p.grad.numpy(), tp.grad.numpy())


def test_clipped_training_step_matches_torch():
    """A Linear trained with clip_grad_norm_ between backward and step: the same weights as torch after 5 steps."""
    rng = np.random.default_rng(2)
    w, b = rng.standard_normal((3, 4)), rng.standard_normal(3)
    x, y = rng.standard_normal((8, 4)), rng.standard_normal((8, 3))
    lin, tlin = nn.Linear(4, 3, dtype="float64"), torch.nn.Linear(4, 3, dtype=torch.float64)
    with dx.no_grad():
        lin.weight.copy_(dx.tensor(w))
        lin.bias.copy_(dx.tensor(b))
    with torch.no_grad():
        tlin.weight.copy_(torch.from_numpy(w))
        tlin.bias.copy_(torch.from_numpy(b))
    opt, topt = SGD(lin.parameters(), lr=0.5), torch.optim.SGD(tlin.parameters(), lr=0.5)
    for _ in range(5):
        loss = ((lin(dx.tensor(x)) - dx.tensor(y)) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(lin.parameters(), 0.3)
        opt.step()
        tloss = ((tlin(torch.from_numpy(x)) - torch.from_numpy(y)) ** 2).mean()
        topt.zero_grad()
        tloss.backward()
        torch.nn.utils.clip_grad_norm_(tlin.parameters(), 0.3)
        topt.step()
    np.testing.assert_allclose(lin.weight.numpy(), tlin.weight.detach().numpy(), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(lin.bias.numpy(), tlin.bias.detach().numpy(), rtol=1e-10, atol=1e-12)
