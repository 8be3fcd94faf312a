"""torch.Tensor's names on deepx's Tensor: every public one either works or raises DeepxAttributeError (never a bare
AttributeError); the in-place forms `name_`, the aliases and the composites added for them against torch on the CPU,
forward and backward (float64)."""

from __future__ import annotations

import inspect
from typing import Any

import numpy as np
import pytest

import deepx_sdk as dx
from deepx_core.errors import DeepxAttributeError, DeepxError
from deepx_sdk._torch_names import TENSOR
from deepx_sdk.tensor import Tensor

torch = pytest.importorskip("torch")


def test_the_stored_names_hold_every_public_name_of_the_installed_torch() -> None:
    public = {n for n in dir(torch.Tensor) if not n.startswith("_")}
    assert not public - TENSOR, f"regenerate deepx_sdk/_torch_names.py: new in torch {sorted(public - TENSOR)}"


def test_every_torch_name_works_or_says_deepx_lacks_it() -> None:
    for name in sorted(TENSOR):
        assert inspect.getattr_static(Tensor, name, None) is not None, name
    x = dx.tensor(np.ones((2, 3), np.float32))
    for name in ("stft", "lu", "qr", "squeeze_", "index_put"):
        with pytest.raises(DeepxAttributeError, match=f"Tensor.{name} is not supported by deepx"):
            getattr(x, name)
        assert not hasattr(x, name)
    with pytest.raises(DeepxAttributeError, match=r"deepx_sdk\.stft is not supported"):
        dx.stft  # noqa: B018


IN_PLACE: list[tuple[str, tuple[Any, ...], float, float]] = [  # name, args, low, high of the input
    ("exp_", (), -2, 2), ("abs_", (), -2, 2), ("sqrt_", (), 0.1, 4), ("clamp_", (-0.5, 0.5), -2, 2),
    ("clip_", (-0.5, 0.5), -2, 2), ("sigmoid_", (), -3, 3), ("tanh_", (), -3, 3), ("floor_", (), -3, 3),
    ("round_", (), -3, 3), ("trunc_", (), -3, 3), ("neg_", (), -2, 2), ("relu_", (), -2, 2), ("log_", (), 0.1, 4),
    ("cumsum_", (1,), -2, 2), ("tril_", (), -2, 2), ("fmod_", (0.3,), -2, 2), ("remainder_", (0.3,), -2, 2),
    ("reciprocal_", (), 0.5, 2), ("sinh_", (), -2, 2), ("lt_", (0.0,), -2, 2), ("multiply_", (3.0,), -2, 2),
]


@pytest.mark.parametrize(("name", "args", "lo", "hi"), IN_PLACE, ids=[c[0] for c in IN_PLACE])
def test_in_place_forms_write_what_torch_writes(name: str, args: tuple[Any, ...], lo: float, hi: float) -> None:
    a = np.random.default_rng(len(name)).uniform(lo, hi, (3, 4))
    x = dx.tensor(a.copy())
    assert getattr(x, name)(*args) is x
    t = torch.tensor(a.copy())
    getattr(t, name)(*args)
    np.testing.assert_allclose(x.numpy(), t.numpy(), rtol=1e-12, atol=1e-12)


def test_an_in_place_form_refuses_what_torch_refuses() -> None:
    from deepx_sdk.tensor import _in_place

    i = dx.tensor(np.arange(4, dtype=np.int64))
    with pytest.raises(DeepxError, match="exp_: the result type float32 can't be cast"):
        i.exp_()
    x = dx.tensor(np.ones((2, 3)))
    with pytest.raises(DeepxError, match=r"flatten_: the result's shape \(6,\) is not"):
        _in_place("flatten_")(x)  # a method whose result changes the shape has no in-place form


FUNCTIONS: list[tuple[str, Any, float, float]] = [  # name, call on (x, y), input range
    ("reciprocal", lambda x, y: x.reciprocal(), 0.5, 2), ("sinh", lambda x, y: x.sinh(), -2, 2),
    ("cosh", lambda x, y: x.cosh(), -2, 2), ("log2", lambda x, y: x.log2(), 0.1, 4),
    ("log10", lambda x, y: x.log10(), 0.1, 4), ("exp2", lambda x, y: x.exp2(), -2, 2),
    ("logit", lambda x, y: x.logit(), 0.1, 0.9), ("logit_eps", lambda x, y: x.logit(eps=0.2), 0.05, 0.95),
    ("hypot", lambda x, y: x.hypot(y), -2, 2), ("logaddexp", lambda x, y: x.logaddexp(y), -30, 30),
    ("movedim", lambda x, y: x.movedim(0, -1) * y.movedim(0, -1), -2, 2),
    ("moveaxis", lambda x, y: x.moveaxis([0, 1], [1, 0]), -2, 2), ("dot", lambda x, y: x[0].dot(y[1]), -2, 2),
    ("clamp_min", lambda x, y: x.clamp_min(0.3), -2, 2), ("clamp_max", lambda x, y: x.clamp_max(0.3), -2, 2),
    ("absolute", lambda x, y: x.absolute(), -2, 2), ("swapaxes", lambda x, y: x.swapaxes(0, 1) * 2, -2, 2),
    ("subtract", lambda x, y: x.subtract(y), -2, 2), ("true_divide", lambda x, y: x.true_divide(y + 3), -2, 2),
    ("sgn", lambda x, y: x.sgn() * y, -2, 2),
]


@pytest.mark.parametrize(("name", "fn", "lo", "hi"), FUNCTIONS, ids=[c[0] for c in FUNCTIONS])
def test_aliases_and_composites_against_torch_forward_and_backward(name: str, fn: Any, lo: float, hi: float) -> None:
    rng = np.random.default_rng(len(name))
    a, b = rng.uniform(lo, hi, (3, 3)), rng.uniform(lo, hi, (3, 3))
    x, y = dx.tensor(a, requires_grad=True), dx.tensor(b, requires_grad=True)
    tx, ty = torch.tensor(a, requires_grad=True), torch.tensor(b, requires_grad=True)
    out, want = fn(x, y), fn(tx, ty)
    np.testing.assert_allclose(out.numpy(), want.detach().numpy(), rtol=1e-10, atol=1e-12)
    (out * out).sum().backward()
    (want * want).sum().backward()
    for mine, theirs in ((x, tx), (y, ty)):
        want_grad = np.zeros((3, 3)) if theirs.grad is None else theirs.grad.numpy(force=True)  # (ZeroTensor)
        got = np.zeros((3, 3)) if mine.grad is None else mine.grad.numpy()  # (sign's path has no gradient: None)
        np.testing.assert_allclose(got, want_grad, rtol=1e-9, atol=1e-12)


def test_movedim_and_dot_refuse_what_torch_refuses() -> None:
    x = dx.tensor(np.ones((2, 3, 4)))
    with pytest.raises(DeepxError, match="movedim: source"):
        x.movedim([0, 1], 2)
    with pytest.raises(DeepxError, match="dot: 1-D tensors only"):
        x.dot(x)
