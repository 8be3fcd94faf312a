"""nn and nn.functional at their edges, against torch on the CPU: what an audit of the layer found different (a fully
masked attention row, every target ignored, in-place activations, deepcopy of a model with buffers, torch's loss
signatures, promotion in mse_loss, rms_norm's default eps in float16, softmax's implicit dim, one_hot's inferred
classes)."""

from __future__ import annotations

import copy
import warnings

import numpy as np
import pytest
import torch

import deepx_sdk as dx
import deepx_sdk.nn as nn
import deepx_sdk.nn.functional as F
from deepx_core.errors import DeepxError
from deepx_core.ir.dtypes import to_numpy

LIBS = ((torch, torch.nn, torch.nn.functional), (dx, nn, F))


def _np(t):
    return np.asarray(t.detach().numpy())


@pytest.mark.parametrize("kind", ["bool", "float"])
def test_attention_with_a_fully_masked_row_attends_to_nothing_as_torch(kind):
    """A padded batch's fully masked row gave NaN, and NaN in every gradient; torch's safe softmax gives zeros."""
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 3, 4))
    m = np.ones((3, 3), bool)
    m[1] = False
    mask = m if kind == "bool" else np.where(m, 0.0, -np.inf)
    res = []
    for lib, _, Fn in LIBS:
        Q = lib.tensor(q, requires_grad=True)
        out = Fn.scaled_dot_product_attention(Q, Q * 0.5, Q, attn_mask=lib.tensor(mask))
        (out * out).sum().backward()
        res.append((_np(out), _np(Q.grad)))
    assert not np.isnan(res[1][1]).any()
    for mine, ref in zip(res[1], res[0]):
        np.testing.assert_allclose(mine, ref, rtol=1e-10, atol=1e-12)


def test_an_attention_mask_of_another_float_dtype_is_refused_as_in_torch():
    q = dx.tensor(np.ones((1, 2, 4), np.float32))
    with pytest.raises(DeepxError, match="attn_mask must be bool or float32"):
        F.scaled_dot_product_attention(q, q, q, attn_mask=dx.tensor(np.zeros((2, 2))))


def test_nll_loss_with_every_target_ignored_is_nan_with_a_zero_gradient():
    x0 = np.random.default_rng(1).standard_normal((2, 3))
    res = []
    for lib, _, Fn in LIBS:
        x = lib.tensor(x0, requires_grad=True)
        loss = Fn.nll_loss(x, lib.tensor(np.array([-100, -100])))
        loss.backward()
        res.append((_np(loss), _np(x.grad)))
    assert np.isnan(res[1][0]) and np.isnan(res[0][0])
    np.testing.assert_array_equal(res[1][1], res[0][1])


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_nll_loss_keeps_a_low_precision_input_s_dtype(dtype):
    """The all-ignored guard added a float32 NaN-or-zero and promoted a float16 loss to float32 (review)."""
    x = dx.tensor(np.random.default_rng(5).standard_normal((3, 4)).astype(np.float32)).type_as_dtype(dtype)
    assert F.nll_loss(x, dx.tensor(np.array([0, 1, -100]))).dtype == dtype
    assert nn.NLLLoss()(x, dx.tensor(np.array([2, 3, 0]))).dtype == dtype


def test_losses_take_torch_s_signature():
    """(input, target, weight, size_average, ignore_index, reduce, reduction): a positional third argument is the
    class weights, which deepx refuses with a DeepxError."""
    x0, t0 = np.random.default_rng(2).standard_normal((3, 4)), np.array([0, 3, -100])
    for fn in ("cross_entropy", "nll_loss"):
        got = getattr(F, fn)(dx.tensor(x0), dx.tensor(t0), None, None, -100, None, "sum")
        ref = getattr(torch.nn.functional, fn)(torch.tensor(x0), torch.tensor(t0), None, None, -100, None, "sum")
        np.testing.assert_allclose(got.numpy(), ref.numpy(), rtol=1e-12)
        with pytest.raises(DeepxError, match="class weights"):
            getattr(F, fn)(dx.tensor(x0), dx.tensor(t0), dx.ones(4))
        legacy = getattr(F, fn)(dx.tensor(x0), dx.tensor(t0), size_average=False)
        np.testing.assert_allclose(legacy.numpy(), ref.numpy(), rtol=1e-12)


@pytest.mark.parametrize("a, b", [
    (np.zeros((0, 3)), np.zeros((0, 3))),  # empty: NaN, an empty gradient (a ZeroDivisionError in the rule)
    (np.ones(3), np.array([1, 2, 3])),  # an integer target takes the input's dtype
    (np.ones(3, np.float32), np.arange(3.0)),  # two floats: the wider
])
def test_mse_loss_promotes_and_takes_empty_inputs_as_torch(a, b):
    """The value and dtype as torch's forward; the gradient as the formula's, 2 (x - y) / n (torch's own backward
    refuses mixed dtypes in some versions: 'Found dtype Long but expected Double')."""
    ref = torch.nn.functional.mse_loss(torch.tensor(a), torch.tensor(b))
    x = dx.tensor(a, requires_grad=True)
    loss = F.mse_loss(x, dx.tensor(b))
    loss.backward()
    np.testing.assert_allclose(loss.numpy(), ref.numpy(), rtol=1e-6)
    assert loss.dtype == str(ref.dtype).replace("torch.", "")
    want = 2 * (a.astype(np.float64) - b) / max(a.size, 1)
    np.testing.assert_allclose(x.grad.numpy(), want, rtol=1e-6)
    assert x.grad.dtype == x.dtype


def test_in_place_activations_and_dropout_write_their_input_and_train_as_torch():
    """nn.SiLU(inplace=True) made backward refuse (silu's gradient reads the input it overwrote); F.relu and
    F.dropout ignored inplace=True; F.dropout(x, 1.0) raised."""
    w0 = np.array([[0.5, -1.0], [2.0, 0.25]], np.float32)
    for make in (lambda m: m.SiLU(inplace=True), lambda m: m.ReLU(inplace=True)):
        res = []
        for lib, mod, _ in LIBS:
            lin = mod.Linear(2, 2, bias=False)
            with (torch.no_grad() if lib is torch else dx.no_grad()):
                lin.weight.copy_(lib.tensor(w0))
            x = lib.tensor(np.array([[1.0, -2.0]], np.float32), requires_grad=True)
            out = mod.Sequential(lin, make(mod))(x)
            out.sum().backward()
            res.append((_np(out), _np(x.grad), _np(lin.weight.grad)))
        for mine, ref in zip(res[1], res[0]):
            np.testing.assert_allclose(mine, ref, rtol=1e-6)
    for lib, _, Fn in LIBS:
        x = lib.tensor(np.array([1.0, -2.0]))
        assert Fn.relu(x, inplace=True) is x
        np.testing.assert_array_equal(_np(x), [1.0, 0.0])
        y = lib.tensor(np.array([1.0, -2.0]))
        Fn.dropout(y, 1.0, inplace=True)
        np.testing.assert_array_equal(_np(y), [0.0, 0.0])


def test_deepcopy_of_a_model_with_buffers_and_gradients():
    """copy.deepcopy(model) (an EMA, the best model so far) failed on a buffer: a plain Tensor had no deepcopy and
    the copy walked into the session. Values, requires_grad and .grad are copied, into tensors of their own."""
    m = nn.Linear(2, 2)
    m.register_buffer("seen", dx.zeros(2))
    m(dx.ones(1, 2)).sum().backward()
    c = copy.deepcopy(m)
    assert c.weight.name != m.weight.name and c.seen.name != m.seen.name
    np.testing.assert_array_equal(c.weight.numpy(), m.weight.numpy())
    np.testing.assert_array_equal(c.weight.grad.numpy(), m.weight.grad.numpy())
    assert c.weight.requires_grad and not c.seen.requires_grad
    with dx.no_grad():
        c.weight.mul_(0.0)
        c.seen.add_(1.0)
    assert m.weight.numpy().any() and not m.seen.numpy().any()
    y = m.weight * 2
    with pytest.raises(DeepxError, match="graph leaves"):
        copy.deepcopy(y)


def test_rms_norm_in_float16_takes_float32_s_epsilon_as_torch():
    x0 = (np.random.default_rng(3).standard_normal((2, 4)) * 0.01).astype(np.float16)
    ref = torch.nn.functional.rms_norm(torch.tensor(x0), (4,))
    got = F.rms_norm(dx.tensor(x0), (4,))
    np.testing.assert_allclose(got.numpy().astype(np.float32), ref.numpy().astype(np.float32), rtol=2e-3)


@pytest.mark.parametrize("shape", [(3,), (2, 3), (2, 3, 4), (2, 3, 4, 5)])
def test_softmax_without_a_dim_takes_torch_s_implicit_one(shape):
    x0 = np.random.default_rng(4).standard_normal(shape)
    with warnings.catch_warnings():  # both warn that the implicit dim is deprecated
        warnings.simplefilter("ignore")
        ref = torch.nn.functional.softmax(torch.tensor(x0))
        lref = torch.nn.functional.log_softmax(torch.tensor(x0))
        got, lgot = F.softmax(dx.tensor(x0)), F.log_softmax(dx.tensor(x0))
    np.testing.assert_allclose(got.numpy(), ref.numpy(), rtol=1e-12)
    np.testing.assert_allclose(lgot.numpy(), lref.numpy(), rtol=1e-12)


@pytest.mark.parametrize("bad", [10, -1])
def test_a_class_index_out_of_range_fails_as_torch_s_does(bad):
    """nll_loss and one_hot gave a row of zeros for a class outside [0, classes) (torch raises); the step fails now,
    at the line that made the loss, and the session goes on."""
    logp = dx.tensor(np.log(np.full((3, 10), 0.1, np.float32)), requires_grad=True)
    target = np.array([1, bad, 2])
    with pytest.raises(IndexError):
        torch.nn.functional.nll_loss(torch.from_numpy(logp.numpy()), torch.from_numpy(target))
    with pytest.raises(dx.DeepxError, match="out of range for axis 0 of size 10") as e:
        F.nll_loss(logp, dx.tensor(target)).backward()
    assert "test_nn_edges.py" in str(e.value)
    with pytest.raises(dx.DeepxError, match="out of range for axis 0 of size 10"):
        F.one_hot(dx.tensor(target), 10).numpy()
    # an ignored target is no index; the rest match torch, forward and backward
    target = np.array([1, -100, 9])
    loss = F.nll_loss(logp, dx.tensor(target))
    loss.backward()
    t = torch.from_numpy(logp.numpy()).requires_grad_()
    want = torch.nn.functional.nll_loss(t, torch.from_numpy(target))
    want.backward()
    assert loss.item() == pytest.approx(want.item())
    np.testing.assert_allclose(logp.grad.numpy(), t.grad.numpy())
    np.testing.assert_array_equal(F.one_hot(dx.tensor(np.array([0, 9])), 10).numpy(),
                                  torch.nn.functional.one_hot(torch.tensor([0, 9]), 10).numpy())


@pytest.mark.parametrize("dtype", ["int64", "int32", "int16", "int8"])
def test_one_hot_takes_every_integer_dtype_as_torch(dtype):
    index = np.array([0, 2, 1], to_numpy(dtype))
    np.testing.assert_array_equal(F.one_hot(dx.tensor(index), 3).numpy(),
                                  torch.nn.functional.one_hot(torch.from_numpy(index.astype(np.int64)), 3).numpy())


def test_nll_loss_gathers_along_the_classes_whatever_the_target_dtype(monkeypatch):
    """input[i, target[i]] is one gather along the classes: no flat index i * classes + target[i], which in an int32
    target's dtype wrapped from 2**31 elements (65,536 tokens of a 32K vocabulary)."""
    from deepx_sdk.tensor import Tensor

    seen = []
    op = Tensor._op

    def spy(self, name, params, *rest, **kw):
        seen.append((name, [p.precisions[0] if p.precisions else None for p in params]))
        return op(self, name, params, *rest, **kw)

    monkeypatch.setattr(Tensor, "_op", spy)
    logp = dx.tensor(np.log(np.full((4, 3), 1 / 3, np.float32)))
    loss = F.nll_loss(logp, dx.tensor(np.array([0, 2, 1, -100], np.int32)))
    gathers = [p for name, p in seen if name == "gather"]
    assert gathers == [["float32", "int32", "int32"]], seen
    assert not [p for name, p in seen if name == "indexselect" and p[0] == "float32"], seen
    assert loss.item() == pytest.approx(np.log(3), rel=1e-6)


def test_nll_loss_of_no_class_with_every_target_ignored_is_nan_as_torch():
    x = np.zeros((2, 0), np.float32)
    t = np.array([-100, -100])
    logp = dx.tensor(x, requires_grad=True)
    loss = F.nll_loss(logp, dx.tensor(t))
    loss.backward()
    assert np.isnan(loss.item()) and np.isnan(torch.nn.functional.nll_loss(torch.from_numpy(x),
                                                                         torch.from_numpy(t)).item())
    assert logp.grad.numpy().shape == (2, 0)


def test_one_hot_infers_the_number_of_classes_as_torch():
    idx = np.array([0, 3, 1])
    np.testing.assert_array_equal(F.one_hot(dx.tensor(idx)).numpy(), torch.nn.functional.one_hot(torch.tensor(idx)))
    with pytest.raises(DeepxError, match="empty"):
        F.one_hot(dx.tensor(np.zeros(0, np.int64)))


def test_the_review_s_smaller_cases():
    """dx.pow(2.0, t) and friends take a number first (AttributeError before); index_add refuses a source of another
    dtype, as torch; copy.copy says what to use instead of copying silently; softmax without dim warns once per line
    (a log line per call before)."""
    t = dx.tensor(np.array([1.0, 2.0]))
    np.testing.assert_array_equal(dx.pow(2.0, t).numpy(), [2.0, 4.0])
    np.testing.assert_array_equal(dx.add(1.0, t, alpha=3).numpy(), [4.0, 7.0])
    np.testing.assert_array_equal(dx.div(1.0, t).numpy(), [1.0, 0.5])
    with pytest.raises(DeepxError, match="source is float32"):
        dx.zeros(3, dtype=dx.float64).index_add(0, dx.tensor(np.array([0])), dx.ones(1))
    with pytest.raises(DeepxError, match="clone"):
        copy.copy(t)
    with pytest.warns(UserWarning, match="implicit dimension"):
        F.softmax(dx.tensor(np.ones((2, 3))))
