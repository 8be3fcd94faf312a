"""Convolution, pooling and normalisation layers (deepx_sdk/nn/vision.py, layers2d.py) against torch on the CPU:
forward and backward, float64 and float32; a small CNN trains as torch's does from the same weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import deepx_sdk as dx
import deepx_sdk.nn as nn
import deepx_sdk.nn.functional as F
from deepx_core.errors import DeepxError

# torch notes that its own 'same' padding with an even kernel copies the input
pytestmark = pytest.mark.filterwarnings("ignore:Using padding='same':UserWarning")

TOL = {"float64": dict(rtol=1e-9, atol=1e-11), "float32": dict(rtol=1e-4, atol=1e-5)}
TF = torch.nn.functional


def _t(a, grad=True):
    return dx.tensor(a, requires_grad=grad), torch.tensor(a, requires_grad=grad)


def _grads_match(ours, theirs, pairs, dtype, seed=1):
    np.testing.assert_allclose(ours.numpy(), theirs.detach().numpy(), **TOL[dtype])
    w = np.random.default_rng(seed).standard_normal(tuple(theirs.shape)).astype(dtype)
    (ours * dx.tensor(w)).sum().backward()
    (theirs * torch.from_numpy(w)).sum().backward()
    for a, b in pairs:
        np.testing.assert_allclose(a.grad.numpy(), b.grad.numpy(), **TOL[dtype])


CONV2D = [
    dict(),
    dict(stride=2, padding=1),
    dict(stride=(2, 1), padding=(0, 2), dilation=(2, 1)),
    dict(groups=2, padding=1),
    dict(groups=4, padding="same", dilation=2),
    dict(padding="same"),
    dict(padding="valid", stride=3),
]


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("kw", CONV2D, ids=[str(k) for k in CONV2D])
def test_conv2d_follows_torch(kw, dtype):
    rng = np.random.default_rng(0)
    g = kw.get("groups", 1)
    x, tx = _t(rng.standard_normal((2, 4, 9, 8)).astype(dtype))
    w, tw = _t(rng.standard_normal((8, 4 // g, 3, 2)).astype(dtype))
    b, tb = _t(rng.standard_normal(8).astype(dtype))
    _grads_match(F.conv2d(x, w, b, **kw), TF.conv2d(tx, tw, tb, **kw), [(x, tx), (w, tw), (b, tb)], dtype)


@pytest.mark.parametrize("kw", [dict(), dict(stride=2, padding=2, dilation=2), dict(groups=3, padding="same")])
def test_conv1d_follows_torch(kw):
    rng = np.random.default_rng(1)
    x, tx = _t(rng.standard_normal((2, 6, 11)))
    w, tw = _t(rng.standard_normal((3, 6 // kw.get("groups", 1), 3)))
    _grads_match(F.conv1d(x, w, None, **kw), TF.conv1d(tx, tw, None, **kw), [(x, tx), (w, tw)], "float64")


@pytest.mark.parametrize("f, tf", [
    (lambda x: F.max_pool2d(x, 2), lambda x: TF.max_pool2d(x, 2)),
    (lambda x: F.max_pool2d(x, 3, 2, 1), lambda x: TF.max_pool2d(x, 3, 2, 1)),
    (lambda x: F.max_pool2d(x, (3, 2), (1, 2), (1, 0), dilation=(1, 2)),
     lambda x: TF.max_pool2d(x, (3, 2), (1, 2), (1, 0), dilation=(1, 2))),
    (lambda x: F.avg_pool2d(x, 2), lambda x: TF.avg_pool2d(x, 2)),
    (lambda x: F.avg_pool2d(x, 3, 2, 1), lambda x: TF.avg_pool2d(x, 3, 2, 1)),
    (lambda x: F.avg_pool2d(x, 3, 2, 1, count_include_pad=False),
     lambda x: TF.avg_pool2d(x, 3, 2, 1, count_include_pad=False)),
    (lambda x: F.avg_pool2d(x, 2, divisor_override=3), lambda x: TF.avg_pool2d(x, 2, divisor_override=3)),
    (lambda x: F.max_pool2d(x, 2, ceil_mode=True), lambda x: TF.max_pool2d(x, 2, ceil_mode=True)),
    (lambda x: F.max_pool2d(x, 3, 2, 1, ceil_mode=True), lambda x: TF.max_pool2d(x, 3, 2, 1, ceil_mode=True)),
    (lambda x: F.max_pool2d(x, (2, 3), (3, 2), ceil_mode=True, dilation=(2, 1)),
     lambda x: TF.max_pool2d(x, (2, 3), (3, 2), ceil_mode=True, dilation=(2, 1))),
    (lambda x: F.avg_pool2d(x, 2, ceil_mode=True), lambda x: TF.avg_pool2d(x, 2, ceil_mode=True)),
    (lambda x: F.avg_pool2d(x, 3, 2, 1, ceil_mode=True), lambda x: TF.avg_pool2d(x, 3, 2, 1, ceil_mode=True)),
    (lambda x: F.avg_pool2d(x, 3, 2, 1, ceil_mode=True, count_include_pad=False),
     lambda x: TF.avg_pool2d(x, 3, 2, 1, ceil_mode=True, count_include_pad=False)),
    (lambda x: F.avg_pool2d(x, (3, 2), (2, 3), ceil_mode=True, divisor_override=2),
     lambda x: TF.avg_pool2d(x, (3, 2), (2, 3), ceil_mode=True, divisor_override=2)),
    (lambda x: F.adaptive_avg_pool2d(x, 1), lambda x: TF.adaptive_avg_pool2d(x, 1)),
    (lambda x: F.adaptive_avg_pool2d(x, (4, 2)), lambda x: TF.adaptive_avg_pool2d(x, (4, 2))),
    (lambda x: F.adaptive_avg_pool2d(x, (3, 5)), lambda x: TF.adaptive_avg_pool2d(x, (3, 5))),
    (lambda x: F.adaptive_avg_pool2d(x[0], (3, None)), lambda x: TF.adaptive_avg_pool2d(x[0], (3, None))),
])
@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_pools_follow_torch(f, tf, dtype, ties):
    """With ties (inputs from a handful of values) max pooling's gradient goes to each window's first maximum."""
    rng = np.random.default_rng(2)
    a = rng.integers(-2, 3, (2, 3, 8, 10)) if ties else rng.standard_normal((2, 3, 8, 10))
    x, tx = _t(a.astype(dtype))
    _grads_match(f(x), tf(tx), [(x, tx)], dtype)


def test_batch_norm_trains_and_evaluates_as_torch():
    rng = np.random.default_rng(3)
    f64 = torch.float64
    for ours, theirs, shape in [(nn.BatchNorm2d(4), torch.nn.BatchNorm2d(4, dtype=f64), (5, 4, 3, 2)),
                                (nn.BatchNorm1d(3, momentum=None), torch.nn.BatchNorm1d(3, momentum=None, dtype=f64),
                                 (6, 3)),
                                (nn.BatchNorm1d(3, affine=False), torch.nn.BatchNorm1d(3, affine=False, dtype=f64),
                                 (4, 3, 5))]:
        ours = ours.double()
        for step in range(3):
            x, tx = _t(rng.standard_normal(shape) * 2 + 1)
            _grads_match(ours(x), theirs(tx), [(x, tx)], "float64", seed=step)
        np.testing.assert_allclose(ours.running_mean.numpy(), theirs.running_mean.numpy(), rtol=1e-10)
        np.testing.assert_allclose(ours.running_var.numpy(), theirs.running_var.numpy(), rtol=1e-10)
        assert int(ours.num_batches_tracked) == int(theirs.num_batches_tracked) == 3
        if ours.weight is not None:
            np.testing.assert_allclose(ours.weight.grad.numpy(), theirs.weight.grad.numpy(), rtol=1e-9)
        ours.eval()
        theirs.eval()
        x, tx = _t(rng.standard_normal(shape))
        _grads_match(ours(x), theirs(tx), [(x, tx)], "float64")
        assert set(ours.state_dict()) == set(theirs.state_dict())


def test_group_norm_follows_torch():
    rng = np.random.default_rng(4)
    ours, theirs = nn.GroupNorm(2, 6).double(), torch.nn.GroupNorm(2, 6, dtype=torch.float64)
    x, tx = _t(rng.standard_normal((3, 6, 4, 2)))
    _grads_match(ours(x), theirs(tx), [(x, tx)], "float64")
    np.testing.assert_allclose(ours.weight.grad.numpy(), theirs.weight.grad.numpy(), rtol=1e-9)


def test_conv_modules_initialise_as_torch():
    torch.manual_seed(0)
    for ours, theirs in [(nn.Conv2d(6, 8, 3, groups=2), torch.nn.Conv2d(6, 8, 3, groups=2)),
                         (nn.Conv1d(4, 5, 2, bias=False), torch.nn.Conv1d(4, 5, 2, bias=False))]:
        assert set(ours.state_dict()) == set(theirs.state_dict())
        for k, v in theirs.state_dict().items():
            got = ours.state_dict()[k].numpy()
            assert got.shape == tuple(v.shape)
            bound = float(v.abs().max()) * 1.5 + 1e-6  # the same U(-1/sqrt(fan_in), ...) range
            assert np.abs(got).max() <= bound and np.abs(got).max() > bound / 6
    assert repr(nn.Conv2d(3, 4, 3, stride=2, padding=1)) == repr(torch.nn.Conv2d(3, 4, 3, stride=2, padding=1))


def test_dropout2d_zeroes_whole_channels():
    x = dx.ones(8, 16, 3, 3)
    y = nn.Dropout2d(0.5)(x).numpy()
    per_channel = y.reshape(8, 16, 9)
    assert set(np.unique(per_channel)) <= {0.0, 2.0}
    assert (per_channel.min(2) == per_channel.max(2)).all()  # a channel is dropped whole or kept whole
    assert 0.2 < (per_channel[:, :, 0] == 0).mean() < 0.8
    m = nn.Dropout2d(0.5)
    m.eval()
    assert m(x) is x


def test_refusals_name_the_problem():
    x = dx.ones(1, 4, 5, 5)
    with pytest.raises(DeepxError, match="groups=3 do not fit"):
        F.conv2d(x, dx.ones(6, 1, 3, 3), groups=3)
    with pytest.raises(DeepxError, match="smaller than the kernel"):
        F.conv2d(x, dx.ones(2, 4, 7, 7))
    with pytest.raises(DeepxError, match="padding='same' needs stride 1"):
        F.conv2d(x, dx.ones(2, 4, 3, 3), stride=2, padding="same")
    with pytest.raises(DeepxError, match="expected 3 channels"):
        nn.BatchNorm2d(3)(x)
    with pytest.raises(DeepxError, match="padding_mode='reflect' is not supported"):
        nn.Conv2d(4, 4, 3, padding_mode="reflect")


def test_a_small_cnn_trains_as_torch():
    """Conv-BN-ReLU-Pool twice, a Linear head, SGD with momentum: the same weights after 4 steps."""

    def build(m):
        return m.Sequential(m.Conv2d(1, 4, 3, padding=1), m.BatchNorm2d(4), m.ReLU(), m.MaxPool2d(2),
                            m.Conv2d(4, 6, 3), m.ReLU(), m.AdaptiveAvgPool2d(1), m.Flatten(), m.Linear(6, 3))

    ours, theirs = build(nn).double(), build(torch.nn).double()
    ours.load_state_dict({k: dx.tensor(v.detach().numpy()) for k, v in theirs.state_dict().items()})
    rng = np.random.default_rng(5)
    x, y = rng.standard_normal((8, 1, 8, 8)), rng.integers(0, 3, 8)
    opt, topt = dx.optim.SGD(ours.parameters(), lr=0.1, momentum=0.9), torch.optim.SGD(theirs.parameters(), lr=0.1,
                                                                                        momentum=0.9)
    for _ in range(4):
        loss = F.cross_entropy(ours(dx.tensor(x)), dx.tensor(y))
        opt.zero_grad()
        loss.backward()
        opt.step()
        tloss = TF.cross_entropy(theirs(torch.tensor(x)), torch.tensor(y))
        topt.zero_grad()
        tloss.backward()
        topt.step()
        assert float(loss) == pytest.approx(tloss.item(), rel=1e-9)
    for k, v in theirs.state_dict().items():
        np.testing.assert_allclose(ours.state_dict()[k].numpy(), v.detach().numpy(), rtol=1e-8, atol=1e-10)


CONVT = [
    dict(),
    dict(stride=2),
    dict(stride=2, padding=1, output_padding=1),
    dict(stride=(3, 2), padding=(2, 0), dilation=(1, 2)),
    dict(groups=2, stride=2, padding=1),
    dict(padding=3),
]


@pytest.mark.parametrize("kw", CONVT, ids=[str(k) for k in CONVT])
def test_conv_transpose2d_follows_torch(kw):
    rng = np.random.default_rng(7)
    g = kw.get("groups", 1)
    x, tx = _t(rng.standard_normal((2, 4, 5, 6)))
    w, tw = _t(rng.standard_normal((4, 6 // g, 3, 4)))
    b, tb = _t(rng.standard_normal(6))
    _grads_match(F.conv_transpose2d(x, w, b, **kw), TF.conv_transpose2d(tx, tw, tb, **kw), [(x, tx), (w, tw), (b, tb)],
                 "float64")


@pytest.mark.parametrize("kw", [
    dict(size=(7, 9)), dict(scale_factor=2), dict(scale_factor=(0.5, 1.5)),
    dict(size=(7, 9), mode="bilinear", align_corners=False), dict(size=(3, 11), mode="bilinear", align_corners=True),
    dict(scale_factor=2.0, mode="bilinear"), dict(size=(1, 1), mode="bilinear", align_corners=True),
], ids=str)
def test_interpolate_follows_torch(kw):
    x, tx = _t(np.random.default_rng(8).standard_normal((2, 3, 5, 6)))
    _grads_match(F.interpolate(x, **kw), TF.interpolate(tx, **kw), [(x, tx)], "float64")


def test_interpolate_1d_and_modules():
    x, tx = _t(np.random.default_rng(9).standard_normal((2, 3, 7)))
    _grads_match(F.interpolate(x, size=12, mode="linear"), TF.interpolate(tx, size=12, mode="linear"), [(x, tx)],
                 "float64")
    up, tup = nn.Upsample(scale_factor=2, mode="nearest"), torch.nn.Upsample(scale_factor=2, mode="nearest")
    y, ty = _t(np.random.default_rng(10).standard_normal((1, 2, 3, 3)))
    _grads_match(up(y), tup(ty), [(y, ty)], "float64")
    torch.manual_seed(0)
    ours = nn.ConvTranspose2d(4, 6, 3, stride=2, groups=2)
    theirs = torch.nn.ConvTranspose2d(4, 6, 3, stride=2, groups=2)
    assert {k: tuple(v.shape) for k, v in ours.state_dict().items()} == {
        k: tuple(v.shape) for k, v in theirs.state_dict().items()}
    bound = 1 / np.sqrt(3 * 3 * 3)  # fan_in: the weight's second dim (out / groups) times the kernel
    assert np.abs(ours.weight.numpy()).max() <= bound
    with pytest.raises(DeepxError, match="exactly one of size and scale_factor"):
        F.interpolate(y)
    with pytest.raises(DeepxError, match="mode 'bicubic' is not supported"):
        F.interpolate(y, size=4, mode="bicubic")
