"""The SDK's batch norm, group norm and interpolate on their ops (batchnorm, batchnormupdate, groupnorm,
interpnearest, interpbilinear: deepx_sdk/nn/vision.py) against torch on the CPU: train and eval, running statistics,
num_batches_tracked, momentum=None, affine=False, track_running_stats=False, float64 and float32; a BatchNorm2d
layer trained a few steps ends with torch's parameters and statistics."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

import deepx_sdk as dx
import deepx_sdk.nn as nn
import deepx_sdk.nn.functional as F
from deepx_core.errors import DeepxError

TF = torch.nn.functional
TOL = {"float64": dict(rtol=1e-9, atol=1e-10), "float32": dict(rtol=2e-4, atol=2e-5)}


def _pair(a: np.ndarray, grad: bool = True):
    return dx.tensor(a, requires_grad=grad), torch.tensor(a, requires_grad=grad)


def _close(ours, theirs, dtype: str, what: str = "") -> None:
    """Equal to the dtype's tolerance, the absolute part relative to the largest value (sums cancel)."""
    want = theirs.detach().numpy()
    tol = TOL[dtype]
    scale = max(1.0, float(np.abs(want).max(initial=0.0)))
    np.testing.assert_allclose(ours.numpy(), want, rtol=tol["rtol"], atol=tol["atol"] * scale, err_msg=what)


def _state_matches(ours, theirs, dtype: str) -> None:
    for k, v in theirs.state_dict().items():
        got = ours.state_dict()[k].numpy()
        if v.dtype == torch.int64:
            assert int(got) == int(v), k
        else:
            np.testing.assert_allclose(got, v.numpy(), err_msg=k, **TOL[dtype])


def _step(ours, theirs, x: np.ndarray, dtype: str, seed: int):
    """One forward and backward of both on x, with the same random upstream gradient; the results compared."""
    xd, xt = _pair(x)
    y, ty = ours(xd), theirs(xt)
    _close(y, ty, dtype, "forward")
    up = np.random.default_rng(seed).standard_normal(tuple(ty.shape)).astype(dtype)
    (y * dx.tensor(up)).sum().backward()
    (ty * torch.from_numpy(up)).sum().backward()
    _close(xd.grad, xt.grad, dtype, "dx")
    return xd, xt


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_a_batchnorm2d_layer_trained_a_few_steps_ends_as_torch_s(dtype):
    """BatchNorm2d then a conv, SGD with momentum and weight decay: after 5 steps the same weight, bias, running
    statistics and num_batches_tracked; then eval() gives the same outputs and gradients."""

    def build(m):
        return m.Sequential(m.BatchNorm2d(5, momentum=0.3), m.Conv2d(5, 2, 3, padding=1))

    theirs = build(torch.nn).to(getattr(torch, dtype))
    ours = build(nn).to(getattr(dx, dtype))
    with torch.no_grad():
        theirs[0].weight.uniform_(0.5, 1.5)
        theirs[0].bias.uniform_(-0.5, 0.5)
    ours.load_state_dict({k: dx.tensor(v.numpy()) for k, v in theirs.state_dict().items()})
    opt = dx.optim.SGD(ours.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3)
    topt = torch.optim.SGD(theirs.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3)
    rng = np.random.default_rng(0)
    for step in range(5):
        x = (rng.standard_normal((6, 5, 7, 3)) * 3 + 2).astype(dtype)
        opt.zero_grad()
        topt.zero_grad()
        _step(ours, theirs, x, dtype, step)
        opt.step()
        topt.step()
    _state_matches(ours, theirs, dtype)
    assert int(ours[0].num_batches_tracked) == 5
    ours.eval()
    theirs.eval()
    _step(ours, theirs, rng.standard_normal((2, 5, 4, 4)).astype(dtype), dtype, 9)
    np.testing.assert_allclose(ours[0].weight.grad.numpy(), theirs[0].weight.grad.numpy(), **TOL[dtype])


@pytest.mark.parametrize(("make", "shape"), [
    (lambda m: m.BatchNorm1d(3, momentum=None), (6, 3)),
    (lambda m: m.BatchNorm1d(4, affine=False), (5, 4, 7)),
    (lambda m: m.BatchNorm2d(3, track_running_stats=False), (4, 3, 2, 5)),
    (lambda m: m.BatchNorm2d(3, affine=False, track_running_stats=False, momentum=None), (2, 3, 3, 3)),
], ids=["momentum=None", "affine=False", "no running statistics", "neither"])
def test_batch_norm_variants_train_and_evaluate_as_torch(make, shape):
    ours, theirs = make(nn).double(), make(torch.nn).double()
    rng = np.random.default_rng(1)
    for step in range(3):
        _step(ours, theirs, rng.standard_normal(shape) * 2 - 1, "float64", step)
    _state_matches(ours, theirs, "float64")
    if theirs.weight is not None:
        _close(ours.weight.grad, theirs.weight.grad, "float64")
        _close(ours.bias.grad, theirs.bias.grad, "float64")
    ours.eval()
    theirs.eval()
    _step(ours, theirs, rng.standard_normal(shape), "float64", 7)  # running statistics, or the batch's without them
    _state_matches(ours, theirs, "float64")


def test_momentum_none_averages_from_a_loaded_count():
    """momentum=None averages over num_batches_tracked, as torch: a count loaded from a state_dict counts on."""
    ours, theirs = nn.BatchNorm1d(2, momentum=None).double(), torch.nn.BatchNorm1d(2, momentum=None).double()
    with torch.no_grad():
        theirs.num_batches_tracked.fill_(7)
        theirs.running_mean.fill_(0.5)
    rng = np.random.default_rng(2)
    _step(ours, theirs, rng.standard_normal((4, 2)), "float64", 0)  # ours counts from 0 first
    ours.load_state_dict({k: dx.tensor(v.numpy()) for k, v in theirs.state_dict().items()})
    for step in range(2):
        _step(ours, theirs, rng.standard_normal((4, 2)), "float64", step)
    _state_matches(ours, theirs, "float64")
    assert int(ours.num_batches_tracked) == 10


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_functional_batch_norm_updates_the_running_statistics_as_torch(dtype):
    rng = np.random.default_rng(3)
    rm, rv = rng.standard_normal(4).astype(dtype), rng.uniform(0.5, 2, 4).astype(dtype)
    ours_rm, ours_rv = dx.tensor(rm), dx.tensor(rv)
    their_rm, their_rv = torch.tensor(rm), torch.tensor(rv)
    w, tw = _pair(rng.standard_normal(4).astype(dtype))
    b, tb = _pair(rng.standard_normal(4).astype(dtype))
    for momentum in (0.1, 0.75):
        x, tx = _pair(rng.standard_normal((3, 4, 5)).astype(dtype))
        y = F.batch_norm(x, ours_rm, ours_rv, w, b, training=True, momentum=momentum, eps=1e-3)
        ty = TF.batch_norm(tx, their_rm, their_rv, tw, tb, training=True, momentum=momentum, eps=1e-3)
        _close(y, ty, dtype)
        y.sum().backward()
        ty.sum().backward()
        _close(x.grad, tx.grad, dtype)
    _close(ours_rm, their_rm, dtype)
    _close(ours_rv, their_rv, dtype)
    _close(w.grad, tw.grad, dtype)
    _close(b.grad, tb.grad, dtype)
    x, tx = _pair(rng.standard_normal((2, 4, 3)).astype(dtype))
    y = F.batch_norm(x, ours_rm, ours_rv, w, b, training=False, eps=1e-3)
    ty = TF.batch_norm(tx, their_rm, their_rv, tw, tb, training=False, eps=1e-3)
    _close(y, ty, dtype)


def test_training_batch_norm_is_one_op_and_its_backward_one_gradient_op():
    """The forward records batchnorm (and batchnormupdate for the running statistics), not a chain of small ops."""
    s = dx.session()
    m = nn.BatchNorm2d(3)
    x = dx.tensor(np.random.default_rng(4).standard_normal((2, 3, 4, 4)), requires_grad=True)
    gc.collect()
    dx.sync()
    y = m(x)
    names = [i.name for i in s.pending if i.name not in ("deltensor", "newtensor", "constant", "copytensor")]
    assert names.count("batchnorm") == 1 and names.count("batchnormupdate") == 1
    assert not {"sum", "mul", "sub", "div", "sqrt"} & set(names), names
    y.sum().backward()
    assert x.grad is not None and m.weight.grad is not None


def test_eval_batch_norm_is_one_op_and_refuses_running_statistics_that_require_grad():
    s = dx.session()
    m = nn.BatchNorm2d(3).eval()
    x = dx.tensor(np.random.default_rng(6).standard_normal((2, 3, 4, 4)).astype(np.float32), requires_grad=True)
    gc.collect()
    dx.sync()
    y = m(x)
    names = [i.name for i in s.pending if i.name not in ("deltensor", "newtensor", "constant", "copytensor")]
    assert names == ["batchnormeval"], names
    y.sum().backward()
    assert x.grad is not None and m.weight.grad is not None
    with pytest.raises(DeepxError, match="running_mean and running_var take no gradient"):
        F.batch_norm(x, dx.zeros(3, requires_grad=True), dx.ones(3), training=False)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize(("groups", "channels", "affine"), [(2, 6, True), (1, 4, True), (5, 5, False), (3, 6, False)])
def test_group_norm_follows_torch(dtype, groups, channels, affine):
    ours = nn.GroupNorm(groups, channels, affine=affine).to(getattr(dx, dtype))
    theirs = torch.nn.GroupNorm(groups, channels, affine=affine).to(getattr(torch, dtype))
    if affine:
        with torch.no_grad():
            theirs.weight.uniform_(0.5, 1.5)
            theirs.bias.uniform_(-1, 1)
        ours.load_state_dict({k: dx.tensor(v.numpy()) for k, v in theirs.state_dict().items()})
    rng = np.random.default_rng(5)
    _step(ours, theirs, (rng.standard_normal((3, channels, 5, 3)) * 2 + 1).astype(dtype), dtype, 0)
    if affine:
        _close(ours.weight.grad, theirs.weight.grad, dtype)
        _close(ours.bias.grad, theirs.bias.grad, dtype)
    x, tx = _pair(rng.standard_normal((2, channels, 7)).astype(dtype))
    _close(F.group_norm(x, groups, eps=1e-3), TF.group_norm(tx, groups, eps=1e-3), dtype)


def test_norm_refusals_name_the_problem():
    with pytest.raises(DeepxError, match="more than 1 value per channel when training"):
        F.batch_norm(dx.ones(1, 3), None, None, training=True)
    with pytest.raises(DeepxError, match="running statistics are needed when not training"):
        F.batch_norm(dx.ones(2, 3), None, None, training=False)
    with pytest.raises(DeepxError, match="running_mean of shape \\[4\\] does not fit 3 channels"):
        F.batch_norm(dx.ones(2, 3), dx.zeros(4), dx.ones(3), training=False)
    with pytest.raises(DeepxError, match="give both running_mean and running_var"):
        F.batch_norm(dx.ones(2, 3), dx.zeros(3), None, training=True)
    with pytest.raises(DeepxError, match="6 channels do not split into 4 groups"):
        F.group_norm(dx.ones(2, 6, 3), 4)
    with pytest.raises(DeepxError, match="at least 2 dims"):
        F.group_norm(dx.ones(6), 2)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("kw", [
    dict(size=(7, 9)), dict(size=4), dict(scale_factor=2), dict(scale_factor=(0.5, 1.5)), dict(scale_factor=1.3),
    dict(scale_factor=1.3, recompute_scale_factor=True), dict(size=(7, 9), mode="bilinear"),
    dict(size=(3, 11), mode="bilinear", align_corners=True), dict(scale_factor=2.0, mode="bilinear"),
    dict(scale_factor=(1.7, 0.6), mode="bilinear", align_corners=False), dict(size=(1, 1), mode="bilinear",
                                                                              align_corners=True),
], ids=str)
def test_interpolate_follows_torch(dtype, kw):
    x, tx = _pair(np.random.default_rng(8).standard_normal((2, 3, 5, 6)).astype(dtype))
    y, ty = F.interpolate(x, **kw), TF.interpolate(tx, **kw)
    _close(y, ty, dtype)
    up = np.random.default_rng(1).standard_normal(tuple(ty.shape)).astype(dtype)
    (y * dx.tensor(up)).sum().backward()
    (ty * torch.from_numpy(up)).sum().backward()
    _close(x.grad, tx.grad, dtype)


@pytest.mark.parametrize("kw", [dict(size=11, mode="nearest"), dict(scale_factor=1.1, mode="nearest"),
                                dict(scale_factor=2.1, mode="nearest"), dict(scale_factor=2.0, mode="nearest"),
                                dict(scale_factor=1.1, mode="linear"), dict(size=3, mode="linear",
                                                                           align_corners=True)], ids=str)
def test_interpolate_1d_follows_torch(kw):
    """1-D inputs: torch's 1-D nearest forward keeps no shortcut for a size kept or doubled by a scale factor (5 * 1.1
    and 5 * 2.1), unlike its 2-D one; deepx follows each. Its backward does keep the shortcut, so that torch's
    gradient is not its forward's there: deepx's is (torch's gradient of the same gather)."""
    x, tx = _pair(np.random.default_rng(9).standard_normal((2, 3, 5)))
    y, ty = F.interpolate(x, **kw), TF.interpolate(tx, **kw)
    _close(y, ty, "float64")
    if kw.get("mode") == "nearest" and kw.get("scale_factor") in (1.1, 2.1):
        index = torch.tensor([min(int(np.floor(np.float32(i) * np.float32(1 / kw["scale_factor"]))), 4)
                              for i in range(ty.shape[-1])])
        ty = tx[:, :, index]
        _close(y, ty, "float64")
    y.sum().backward()
    ty.sum().backward()
    _close(x.grad, tx.grad, "float64")


def test_upsample_modules_follow_torch():
    x, tx = _pair(np.random.default_rng(10).standard_normal((1, 2, 3, 4)))
    for ours, theirs in [(nn.Upsample(scale_factor=3), torch.nn.Upsample(scale_factor=3)),
                         (nn.Upsample(size=(5, 7), mode="bilinear", align_corners=True),
                          torch.nn.Upsample(size=(5, 7), mode="bilinear", align_corners=True))]:
        _close(ours(x), theirs(tx), "float64")
    with pytest.raises(DeepxError, match="sizes should be greater than 0"):
        F.interpolate(x, scale_factor=0.1)
