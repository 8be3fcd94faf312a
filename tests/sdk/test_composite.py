"""torch functions written with deepx's ops (deepx_sdk/composite.py): forward and backward against torch on the CPU,
float64 and float32."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import deepx_sdk as dx
from deepx_core.errors import DeepxError

TOL = {"float64": dict(rtol=1e-10, atol=1e-12), "float32": dict(rtol=2e-5, atol=2e-6)}


def _pair(shape, dtype, seed=0, positive=False):
    a = np.random.default_rng(seed).standard_normal(shape).astype(dtype)
    if positive:
        a = np.abs(a) + 0.5
    x = dx.tensor(a, requires_grad=True)
    t = torch.tensor(a, requires_grad=True)
    return x, t


def _check(ours, theirs, inputs, dtype):
    """Forward equal; then the gradient of sum(out * w) for a random w, equal."""
    tol = TOL[dtype]
    np.testing.assert_allclose(ours.numpy(), theirs.detach().numpy(), **tol)
    w = np.random.default_rng(9).standard_normal(tuple(theirs.shape)).astype(dtype)
    (ours * dx.tensor(w)).sum().backward()
    (theirs * torch.from_numpy(w)).sum().backward()
    for x, t in inputs:
        np.testing.assert_allclose(x.grad.numpy(), t.grad.numpy(), **tol)


CASES = [
    ("flip", (3, 4, 5), lambda m, x: m.flip(x, [0, 2]), False),
    ("flip method", (3, 4), lambda m, x: x.flip(1), False),
    ("roll", (3, 4, 5), lambda m, x: m.roll(x, (1, -2), (0, 2)), False),
    ("roll flat", (3, 4), lambda m, x: m.roll(x, 5), False),
    ("repeat_interleave", (3, 4), lambda m, x: x.repeat_interleave(3, dim=1), False),
    ("repeat_interleave flat", (2, 3), lambda m, x: x.repeat_interleave(2), False),
    ("logsumexp", (3, 4, 5), lambda m, x: x.logsumexp(1), False),
    ("logsumexp keepdim", (3, 4, 5), lambda m, x: m.logsumexp(x, (0, 2), keepdim=True), False),
    ("norm", (3, 4), lambda m, x: x.norm(), False),
    ("norm p1 dim", (3, 4), lambda m, x: x.norm(p=1, dim=1), False),
    ("norm p3", (3, 4), lambda m, x: x.norm(p=3, dim=0, keepdim=True), True),
    ("norm inf", (3, 4), lambda m, x: x.norm(p=float("inf"), dim=1), False),
    ("rsqrt", (3, 4), lambda m, x: m.rsqrt(x), True),
    ("lerp", (3, 4), lambda m, x: x.lerp(x * 2 + 1, 0.3), False),
    ("diff", (3, 6), lambda m, x: x.diff(n=2, dim=1), False),
    ("outer", (5,), lambda m, x: m.outer(x, x * 3), False),
]


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("name, shape, f, positive", CASES, ids=[c[0] for c in CASES])
def test_composites_follow_torch(name, shape, f, positive, dtype):
    x, t = _pair(shape, dtype, positive=positive)
    _check(f(dx, x), f(torch, t), [(x, t)], dtype)


@pytest.mark.parametrize("equation, shapes", [
    ("ij,jk->ik", [(3, 4), (4, 5)]),
    ("bhid,bhjd->bhij", [(2, 3, 4, 5), (2, 3, 6, 5)]),
    ("bhij,bhjd->bhid", [(2, 3, 4, 6), (2, 3, 6, 5)]),
    ("i,j->ij", [(3,), (4,)]),
    ("ij->ji", [(3, 4)]),
    ("ij->", [(3, 4)]),
    ("ij,ij->i", [(3, 4), (3, 4)]),
    ("...ij,...jk", [(2, 3, 4), (2, 4, 5)]),
    ("bi,bj,bk->bijk", [(2, 3), (2, 4), (2, 5)]),
    ("ik,kj", [(3, 4), (4, 2)]),
    ("bij,jk->bik", [(2, 3, 4), (4, 5)]),
])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_einsum_follows_torch(equation, shapes, dtype):
    pairs = [_pair(s, dtype, seed=k) for k, s in enumerate(shapes)]
    ours = dx.einsum(equation, *[p[0] for p in pairs])
    theirs = torch.einsum(equation, *[p[1] for p in pairs])
    assert ours.shape == tuple(theirs.shape)
    _check(ours, theirs, pairs, dtype)


def test_einsum_refuses_what_it_cannot_do():
    x = dx.tensor(np.ones((3, 3)))
    with pytest.raises(DeepxError, match="a diagonal"):
        dx.einsum("ii->i", x)
    with pytest.raises(DeepxError, match="names 2 operands, 1 given"):
        dx.einsum("ij,jk->ik", x)
    with pytest.raises(DeepxError, match="subscripts 'ijk' for an operand of rank 2"):
        dx.einsum("ijk->i", x)
    with pytest.raises(DeepxError, match="has size 3 in one operand and 4 in the other"):
        dx.einsum("ij,jk->ik", x, dx.tensor(np.ones((4, 2))))


def test_sign_masks_and_closeness_as_torch():
    a = np.array([-2.0, -0.0, 0.0, 3.5, np.inf, -np.inf], np.float32)
    np.testing.assert_array_equal(dx.tensor(a).sign().numpy(), torch.tensor(a).sign().numpy())
    np.testing.assert_array_equal(dx.sign(dx.tensor(np.array([-3, 0, 4]))).numpy(), [-1, 0, 1])
    m1, m2 = np.array([True, False, True, False]), np.array([True, True, False, False])
    x1, x2 = dx.tensor(m1), dx.tensor(m2)
    assert (x1 & x2).numpy().tolist() == (m1 & m2).tolist()
    assert (x1 | x2).numpy().tolist() == (m1 | m2).tolist()
    assert (x1 ^ x2).numpy().tolist() == (m1 ^ m2).tolist()
    assert dx.logical_or(x1, m2).numpy().tolist() == (m1 | m2).tolist()
    with pytest.raises(DeepxError, match="on bool tensors"):
        dx.tensor(np.array([1, 2])) & dx.tensor(np.array([3, 1]))
    u = np.array([1.0, 2.0, np.nan, np.inf, 1e-9], np.float64)
    v = np.array([1.0 + 1e-7, 2.1, np.nan, np.inf, 0.0], np.float64)
    for eq in (False, True):
        want = torch.isclose(torch.tensor(u), torch.tensor(v), equal_nan=eq).numpy()
        np.testing.assert_array_equal(dx.isclose(dx.tensor(u), dx.tensor(v), equal_nan=eq).numpy(), want)
    assert dx.allclose(dx.tensor(u[:2]), dx.tensor(u[:2] + 1e-9)) is True
    assert dx.tensor(u[:2]).allclose(dx.tensor(v[:2])) is False


def test_addmm_baddbmm_and_repeat_counts():
    rng = np.random.default_rng(4)
    c, a, b = rng.standard_normal((3, 5)), rng.standard_normal((3, 4)), rng.standard_normal((4, 5))
    got = dx.addmm(dx.tensor(c), dx.tensor(a), dx.tensor(b), beta=0.5, alpha=2.0).numpy()
    want = torch.addmm(torch.tensor(c), torch.tensor(a), torch.tensor(b), beta=0.5, alpha=2.0).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-12)
    c3, a3, b3 = rng.standard_normal((2, 3, 5)), rng.standard_normal((2, 3, 4)), rng.standard_normal((2, 4, 5))
    np.testing.assert_allclose(dx.baddbmm(dx.tensor(c3), dx.tensor(a3), dx.tensor(b3)).numpy(),
                               torch.baddbmm(torch.tensor(c3), torch.tensor(a3), torch.tensor(b3)).numpy(), rtol=1e-12)
    x = np.arange(6.0).reshape(3, 2)
    counts = np.array([2, 0, 3])
    np.testing.assert_array_equal(dx.tensor(x).repeat_interleave(dx.tensor(counts), dim=0).numpy(),
                                  torch.tensor(x).repeat_interleave(torch.tensor(counts), dim=0).numpy())
    with pytest.raises(DeepxError, match="2 repeats for a dim of size 3"):
        dx.tensor(x).repeat_interleave([1, 2], dim=0)


def test_randperm_is_a_permutation_and_follows_the_seed():
    dx.manual_seed(11)
    a = dx.randperm(10).numpy()
    dx.manual_seed(11)
    b = dx.randperm(10).numpy()
    assert sorted(a.tolist()) == list(range(10)) and a.tolist() == b.tolist() and dx.randperm(10).dtype == "int64"
    assert dx.randperm(4, dtype=dx.float32).dtype == "float32" and dx.randperm(0).shape == (0,)
    with pytest.raises(DeepxError, match="non-negative integer"):
        dx.randperm(-1)


def test_a_missing_method_raises_a_deepx_error():
    x = dx.tensor(np.ones(2))
    for name in ("mode", "unique", "index_fill", "nonzero"):
        with pytest.raises(DeepxError, match=f"Tensor.{name} is not supported by deepx"):
            getattr(x, name)
        assert not hasattr(x, name)


@pytest.mark.parametrize("dtype", ["float64", "float32", "float16", "int64"])
def test_le_and_ge_as_torch_nan_included(dtype):
    """x <= y was recorded as not(x > y), true where either is nan; torch (IEEE) says false."""
    a = np.array([np.nan, 1.0, 2.0, -np.inf, 0.0, 3.0]) if dtype != "int64" else np.array([1, 2, 3, -4, 0, 3])
    b = np.array([np.nan, 1.0, 1.0, -np.inf, np.nan, 5.0]) if dtype != "int64" else np.array([1, 1, 5, -4, 2, 3])
    x, y = dx.tensor(a.astype(dtype)), dx.tensor(b.astype(dtype))
    tx, ty = torch.tensor(a.astype(dtype)), torch.tensor(b.astype(dtype))
    for got, want in [(x <= y, tx <= ty), (x >= y, tx >= ty), (x <= 1, tx <= 1), (x >= 2, tx >= 2)]:
        assert got.dtype == "bool"
        np.testing.assert_array_equal(got.numpy(), want.numpy())
    if dtype != "int64":
        np.testing.assert_array_equal((x <= float("nan")).numpy(), np.zeros(6, bool))


def test_scaled_dot_product_attention_with_grouped_query_heads_as_torch():
    rng = np.random.default_rng(6)
    q, tq = (lambda a: (dx.tensor(a, requires_grad=True), torch.tensor(a, requires_grad=True)))(
        rng.standard_normal((2, 6, 5, 4)))
    k, tk = (lambda a: (dx.tensor(a, requires_grad=True), torch.tensor(a, requires_grad=True)))(
        rng.standard_normal((2, 2, 7, 4)))
    v, tv = (lambda a: (dx.tensor(a, requires_grad=True), torch.tensor(a, requires_grad=True)))(
        rng.standard_normal((2, 2, 7, 3)))
    ours = dx.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    theirs = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, enable_gqa=True)
    _check(ours, theirs, [(q, tq), (k, tk), (v, tv)], "float64")
    with pytest.raises(DeepxError, match="query's 6 heads to be a multiple"):
        dx.nn.functional.scaled_dot_product_attention(q, dx.tensor(np.ones((2, 4, 7, 4))), dx.tensor(
            np.ones((2, 4, 7, 3))), enable_gqa=True)
