"""F.scaled_dot_product_attention as one `attention` op (without a mask or dropout) or one `maskedattention` op (with
a mask) against torch, forward and backward; where it stays the composite; and a small transformer trained on either
op gives the composite's losses and weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import deepx_sdk as dx
from deepx_sdk.nn import functional as F

TF = torch.nn.functional
TOL = {"float64": dict(rtol=1e-10, atol=1e-12), "float32": dict(rtol=2e-5, atol=2e-6)}


def _recorded(fn) -> list[str]:  # type: ignore[no-untyped-def]
    """The ops `fn()` records, before anything runs."""
    s = dx.session()
    dx.sync()
    fn()
    names = [i.name for i in s.pending]
    dx.sync()
    return names


def _pairs(rng, dtype, *shapes):  # type: ignore[no-untyped-def]
    arrays = [rng.standard_normal(s).astype(dtype) for s in shapes]
    return [dx.tensor(a, requires_grad=True) for a in arrays], [torch.tensor(a, requires_grad=True) for a in arrays]


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize(("shapes", "kw"), [
    (((2, 3, 7, 8), (2, 3, 7, 8), (2, 3, 7, 8)), {"is_causal": True}),
    (((2, 3, 5, 8), (2, 3, 9, 8), (2, 3, 9, 6)), {}),
    (((4, 9, 6), (4, 5, 6), (4, 5, 2)), {"is_causal": True, "scale": 0.3}),  # Tq > Tk, top-left
    (((6, 4), (11, 4), (11, 3)), {"is_causal": True}),  # Tq < Tk
    (((2, 6, 5, 4), (2, 2, 7, 4), (2, 2, 7, 3)), {"enable_gqa": True}),
    (((2, 4, 6, 4), (2, 1, 6, 4), (2, 1, 6, 4)), {"enable_gqa": True, "is_causal": True}),
], ids=str)
def test_the_op_matches_torch_forward_and_backward(rng, dtype, shapes, kw):
    mine, ref = _pairs(rng, dtype, *shapes)
    ops = _recorded(lambda: F.scaled_dot_product_attention(*mine, **kw))
    assert "attention" in ops and "softmax" not in ops and "matmul" not in ops, ops
    out = F.scaled_dot_product_attention(*mine, **kw)
    tout = TF.scaled_dot_product_attention(*ref, **kw)
    np.testing.assert_allclose(out.numpy(), tout.detach().numpy(), **TOL[dtype])
    w = rng.standard_normal(tout.shape).astype(dtype)
    (out * dx.tensor(w)).sum().backward()
    (tout * torch.from_numpy(w)).sum().backward()
    for a, t in zip(mine, ref, strict=True):
        np.testing.assert_allclose(a.grad.numpy(), t.grad.numpy(), **TOL[dtype])


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.parametrize(("shapes", "mask_shape", "kw"), [
    (((2, 3, 7, 8), (2, 3, 7, 8), (2, 3, 7, 8)), (7, 7), {}),
    (((2, 3, 5, 8), (2, 3, 9, 8), (2, 3, 9, 6)), (2, 1, 5, 9), {"scale": 0.3}),
    (((1, 4, 1, 8), (1, 2, 16, 8), (1, 2, 16, 8)), (1, 16), {"enable_gqa": True}),  # a decoding step, a static cache
    (((6, 4), (11, 4), (11, 3)), (6, 11), {}),
], ids=str)
def test_the_masked_op_matches_torch_forward_and_backward(rng, dtype, kind, shapes, mask_shape, kw):
    mine, ref = _pairs(rng, dtype, *shapes)
    keep = rng.random(mask_shape) < 0.6
    keep[..., 0] = True
    mask = keep if kind == "bool" else np.where(keep, rng.standard_normal(mask_shape), -np.inf).astype(dtype)
    ops = _recorded(lambda: F.scaled_dot_product_attention(*mine, attn_mask=dx.tensor(mask), **kw))
    assert "maskedattention" in ops and "softmax" not in ops and "matmul" not in ops, ops
    out = F.scaled_dot_product_attention(*mine, attn_mask=dx.tensor(mask), **kw)
    tout = TF.scaled_dot_product_attention(*ref, attn_mask=torch.from_numpy(mask), **kw)
    np.testing.assert_allclose(out.numpy(), tout.detach().numpy(), **TOL[dtype])
    w = rng.standard_normal(tout.shape).astype(dtype)
    (out * dx.tensor(w)).sum().backward()
    (tout * torch.from_numpy(w)).sum().backward()
    for a, t in zip(mine, ref, strict=True):
        np.testing.assert_allclose(a.grad.numpy(), t.grad.numpy(), **TOL[dtype])


def test_dropout_a_learned_mask_or_mismatched_operands_take_the_composite(rng):
    (q, k, v), _ = _pairs(rng, "float32", (2, 5, 4), (2, 5, 4), (2, 5, 4))
    mask = dx.tensor(np.tril(np.ones((5, 5), bool)))
    learned = dx.tensor(np.where(np.tril(np.ones((5, 5), bool)), 0, -np.inf).astype(np.float32), requires_grad=True)
    for call in (lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=learned),
                 lambda: F.scaled_dot_product_attention(q, k, v, dropout_p=0.1),
                 lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.1),
                 lambda: F.scaled_dot_product_attention(q, k[:1], v[:1]),  # a broadcast batch
                 lambda: F.scaled_dot_product_attention(q, k.double(), v.double())):
        ops = _recorded(call)
        assert "attention" not in ops and "maskedattention" not in ops and "softmax" in ops, ops
    # the same values every way: a causal mask as a tensor, the composite's, and is_causal
    np.testing.assert_allclose(F.scaled_dot_product_attention(q, k, v, attn_mask=learned).detach().numpy(),
                               F.scaled_dot_product_attention(q, k, v, is_causal=True).numpy(), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(F.scaled_dot_product_attention(q, k, v, attn_mask=mask).numpy(),
                               F.scaled_dot_product_attention(q, k, v, is_causal=True).numpy(), rtol=1e-6, atol=1e-7)


def test_the_graph_holds_the_logsumexp_and_no_grad_makes_no_graph(rng):
    (q, k, v), _ = _pairs(rng, "float32", (2, 5, 4), (2, 5, 4), (2, 5, 4))
    with dx.no_grad():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert out.grad_fn is None and not out.requires_grad
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    lse = out.grad_fn.inputs[3]  # held by the graph, for attentiongrad
    assert lse.shape == (2, 5) and lse.dtype == "float32"


def test_autocast_runs_the_op_in_bfloat16(rng):
    (q, k, v), _ = _pairs(rng, "float32", (2, 2, 5, 4), (2, 2, 5, 4), (2, 2, 5, 4))
    with dx.autocast(dtype="bfloat16"):
        ops = _recorded(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert "attention" in ops and out.dtype == "bfloat16"
    out.float().sum().backward()
    assert q.grad.dtype == "float32" and np.isfinite(q.grad.numpy()).all()


def _transformer(seed: int, how: str) -> tuple[list[float], dict[str, np.ndarray]]:
    """A two-block causal transformer trained 4 steps with AdamW: its losses and final weights, its attention the
    op (causal), the masked op (the causal mask as a bool tensor) or the composite (as a float mask that requires
    grad)."""
    nn = dx.nn
    dx.manual_seed(seed)
    vocab, d, heads, t = 11, 16, 4, 9

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv = nn.Linear(d, 3 * d, bias=False)  # (a key bias has a zero gradient: Adam would step on noise)
            self.proj = nn.Linear(d, d)

        def forward(self, x):  # type: ignore[no-untyped-def]
            b, n, _ = x.shape
            q, k, v = self.qkv(x).view(b, n, 3, heads, d // heads).permute(2, 0, 3, 1, 4).unbind(0)
            mask = dx.arange(n) <= dx.arange(n).unsqueeze(-1)
            if how == "causal":
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            elif how == "mask":
                y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            else:
                learned = dx.where(mask, 0.0, -float("inf")).requires_grad_()
                y = F.scaled_dot_product_attention(q, k, v, attn_mask=learned)
            return self.proj(y.transpose(1, 2).reshape(b, n, d))

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.attn = Attention()
            self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

        def forward(self, x):  # type: ignore[no-untyped-def]
            x = x + self.attn(self.ln1(x))
            return x + self.mlp(self.ln2(x))

    model = nn.Sequential(nn.Embedding(vocab, d), Block(), Block(), nn.LayerNorm(d), nn.Linear(d, vocab))
    start = np.random.default_rng(seed + 100)  # the same start on every worker (a daemon's RNG is its own)
    with dx.no_grad():
        for p in model.parameters():
            p.copy_(dx.tensor((start.standard_normal(p.shape) * 0.3).astype(np.float32)))
    opt = dx.optim.AdamW(model.parameters(), lr=3e-2)
    data = np.random.default_rng(seed).integers(0, vocab, (4, t + 1))
    x, y = dx.tensor(data[:, :-1]), dx.tensor(data[:, 1:])
    losses = []
    for _ in range(4):
        loss = F.cross_entropy(model(x).reshape(-1, vocab), y.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {n: p.numpy() for n, p in model.named_parameters()}


@pytest.mark.parametrize("how", ["causal", "mask"])
def test_a_transformer_trains_on_the_op_as_on_the_composite(how):
    fused_losses, fused_weights = _transformer(3, how)
    losses, weights = _transformer(3, "composite")
    np.testing.assert_allclose(fused_losses, losses, rtol=1e-5)
    assert fused_losses[-1] < fused_losses[0]
    for name, w in weights.items():
        np.testing.assert_allclose(fused_weights[name], w, rtol=1e-4, atol=1e-5, err_msg=name)


def test_a_compiled_step_with_the_op_replays_as_the_eager_step():
    """dx.compile captures the op, its gradient op and the logsumexp between them, and replays them."""

    def run(compiled: bool) -> list[float]:
        dx.manual_seed(0)
        emb, qkv, head = dx.nn.Embedding(11, 16), dx.nn.Linear(16, 48, bias=False), dx.nn.Linear(16, 11)
        params = [*emb.parameters(), *qkv.parameters(), *head.parameters()]
        opt = dx.optim.Adam(params, lr=1e-2)

        def step(x, y):  # type: ignore[no-untyped-def]
            opt.zero_grad()
            b, t = x.shape
            q, k, v = qkv(emb(x)).view(b, t, 3, 2, 8).permute(2, 0, 3, 1, 4).unbind(0)
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, 16)
            loss = F.cross_entropy(head(out).reshape(-1, 11), y.reshape(-1))
            loss.backward()
            opt.step()
            return loss

        fn = dx.compile(step) if compiled else step
        data = np.random.default_rng(0).integers(0, 11, (4, 9))
        x, y = dx.tensor(data[:, :-1]), dx.tensor(data[:, 1:])
        return [fn(x, y).item() for _ in range(5)]

    eager, compiled = run(False), run(True)
    np.testing.assert_array_equal(compiled, eager)
    assert eager[-1] < eager[0]
