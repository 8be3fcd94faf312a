"""BCE, BCE with logits, L1, smooth L1, Huber, KL divergence and softplus against torch: values and gradients, float64
and float32, every reduction."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import deepx_sdk as dx
import deepx_sdk.nn as nn
import deepx_sdk.nn.functional as F
from deepx_core.errors import DeepxError

# torch warns that kl_div's 'mean' will change; deepx follows what it computes today
pytestmark = pytest.mark.filterwarnings("ignore:reduction. 'mean' divides:UserWarning")

TOL = {"float64": dict(rtol=1e-10, atol=1e-12), "float32": dict(rtol=3e-5, atol=3e-6)}


def _data(dtype, kind, seed=0):
    rng = np.random.default_rng(seed)
    shape = (6, 5)
    if kind == "prob":
        x = rng.uniform(0.02, 0.98, shape)
        t = rng.uniform(0, 1, shape)
    elif kind == "logp":
        z = rng.standard_normal(shape)
        x = z - np.log(np.exp(z).sum(1, keepdims=True))
        p = rng.uniform(0, 1, shape)
        p[0, :2] = 0.0  # 0 log 0
        t = p / p.sum(1, keepdims=True)
    else:
        x = rng.standard_normal(shape) * 3
        t = rng.standard_normal(shape) if kind == "real" else (rng.uniform(0, 1, shape) > 0.5).astype(float)
    return x.astype(dtype), t.astype(dtype)


def _both(fn_dx, fn_t, x, t, dtype, extra=()):
    dxx, tx = dx.tensor(x, requires_grad=True), torch.tensor(x, requires_grad=True)
    dt, tt = dx.tensor(t), torch.tensor(t)
    ours, theirs = fn_dx(dxx, dt, *extra[0:1]), fn_t(tx, tt, *extra[1:2])
    np.testing.assert_allclose(ours.numpy(), theirs.detach().numpy(), **TOL[dtype])
    ours.sum().backward()
    theirs.sum().backward()
    np.testing.assert_allclose(dxx.grad.numpy(), tx.grad.numpy(), **TOL[dtype])


REDUCTIONS = ["mean", "sum", "none"]
CASES = [
    ("bce", "prob", lambda x, t, r: F.binary_cross_entropy(x, t, reduction=r),
     lambda x, t, r: torch.nn.functional.binary_cross_entropy(x, t, reduction=r)),
    ("bce_logits", "binary", lambda x, t, r: F.binary_cross_entropy_with_logits(x, t, reduction=r),
     lambda x, t, r: torch.nn.functional.binary_cross_entropy_with_logits(x, t, reduction=r)),
    ("l1", "real", lambda x, t, r: F.l1_loss(x, t, reduction=r),
     lambda x, t, r: torch.nn.functional.l1_loss(x, t, reduction=r)),
    ("smooth_l1", "real", lambda x, t, r: F.smooth_l1_loss(x, t, reduction=r, beta=0.7),
     lambda x, t, r: torch.nn.functional.smooth_l1_loss(x, t, reduction=r, beta=0.7)),
    ("huber", "real", lambda x, t, r: F.huber_loss(x, t, reduction=r, delta=1.5),
     lambda x, t, r: torch.nn.functional.huber_loss(x, t, reduction=r, delta=1.5)),
    ("kl_div", "logp", lambda x, t, r: F.kl_div(x, t, reduction=r),
     lambda x, t, r: torch.nn.functional.kl_div(x, t, reduction=r)),
    ("kl_div log_target", "logp", lambda x, t, r: F.kl_div(x, t.clamp(min=1e-3).log(), reduction=r, log_target=True),
     lambda x, t, r: torch.nn.functional.kl_div(x, t.clamp(min=1e-3).log(), reduction=r, log_target=True)),
]


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("name, kind, ours, theirs", CASES, ids=[c[0] for c in CASES])
def test_losses_follow_torch(name, kind, ours, theirs, reduction, dtype):
    x, t = _data(dtype, kind)
    _both(lambda a, b: ours(a, b, reduction), lambda a, b: theirs(a, b, reduction), x, t, dtype)


def test_weights_batchmean_and_modules():
    x, t = _data("float64", "binary", seed=3)
    w = np.random.default_rng(1).uniform(0.5, 2, (6, 5))
    pw = np.random.default_rng(2).uniform(0.5, 3, (5,))
    _both(lambda a, b: F.binary_cross_entropy_with_logits(a, b, weight=dx.tensor(w), pos_weight=dx.tensor(pw)),
          lambda a, b: torch.nn.functional.binary_cross_entropy_with_logits(a, b, weight=torch.tensor(w),
                                                                             pos_weight=torch.tensor(pw)),
          x, t, "float64")
    lp, p = _data("float64", "logp", seed=4)
    _both(lambda a, b: nn.KLDivLoss(reduction="batchmean")(a, b),
          lambda a, b: torch.nn.KLDivLoss(reduction="batchmean")(a, b), lp, p, "float64")
    for ours, theirs, kind in [(nn.BCELoss(), torch.nn.BCELoss(), "prob"), (nn.L1Loss(), torch.nn.L1Loss(), "real"),
                               (nn.SmoothL1Loss(beta=2.0), torch.nn.SmoothL1Loss(beta=2.0), "real"),
                               (nn.HuberLoss(delta=0.5), torch.nn.HuberLoss(delta=0.5), "real"),
                               (nn.BCEWithLogitsLoss(reduction="sum"), torch.nn.BCEWithLogitsLoss(reduction="sum"),
                                "binary")]:
        a, b = _data("float64", kind, seed=5)
        _both(ours, theirs, a, b, "float64")


def test_bce_clamps_its_logs_as_torch():
    x = np.array([0.0, 1.0, 0.5, 1e-50])
    t = np.array([1.0, 0.0, 1.0, 1.0])
    ours = F.binary_cross_entropy(dx.tensor(x), dx.tensor(t), reduction="none").numpy()
    theirs = torch.nn.functional.binary_cross_entropy(torch.tensor(x), torch.tensor(t), reduction="none").numpy()
    np.testing.assert_allclose(ours, theirs, rtol=1e-12)  # 100 where torch clamps log(0)


@pytest.mark.parametrize("beta, threshold", [(1.0, 20.0), (2.0, 5.0), (0.5, 1.0)])
def test_softplus_follows_torch(beta, threshold):
    x = np.linspace(-30, 30, 61)
    _both(lambda a, _: F.softplus(a, beta, threshold), lambda a, _: torch.nn.functional.softplus(a, beta, threshold),
          x, x, "float64")


def test_loss_refusals():
    a, b = dx.tensor(np.ones((2, 3))), dx.tensor(np.ones((3, 2)))
    with pytest.raises(DeepxError, match=r"l1_loss: the target's shape \[3, 2\] differs from the input's \[2, 3\]"):
        F.l1_loss(a, b)
    with pytest.raises(DeepxError, match="reduction must be 'mean', 'sum' or 'none', got 'avg'"):
        F.l1_loss(a, a, reduction="avg")
    with pytest.raises(DeepxError, match="beta must be >= 0"):
        F.smooth_l1_loss(a, a, beta=-1)
