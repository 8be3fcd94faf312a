"""attention and attentiongrad on the CPU kernels, against torch's scaled_dot_product_attention and its autograd in
float64 on the CPU, for every float dtype the ops claim: causal or not, Tq != Tk both ways, odd sizes, batch and head
dims, grouped-query heads; blocks of rows smaller than the sequence (the memory bound) give the same values; and the
refusals name the tensors."""

from __future__ import annotations

import numpy as np
import pytest
from kernel_ref import T, V, assert_close, executor, f64, ordered, rand, run

from deepx_core.errors import DeepxError
from deepx_core.ir.ops import OPS
from deepxd.kernels.cpu import attention as attention_kernels

torch = pytest.importorskip("torch")

SHAPES = [  # q, k, value size
    ((2, 3, 5, 8), (2, 3, 5, 8), 8),  # batch and heads, square
    ((4, 6), (7, 6), 3),  # no batch dims, more keys than queries, another value size
    ((2, 2, 9, 5), (2, 2, 4, 5), 7),  # more queries than keys (causal rows past Tk see every key)
    ((3, 1, 13, 3), (3, 1, 17, 3), 1),  # odd sizes
    ((2, 6, 7, 4), (2, 2, 7, 4), 4),  # grouped-query heads: 3 query heads per key head
    ((1, 2, 3, 11, 6), (1, 2, 1, 10, 6), 5),  # grouped, under two batch dims, all query heads on one key head
]
# float64 to 1e-8 against torch; the others by their dtype's tolerance, relative to the largest value
RTOL = {"float64": 1e-8}


def _reference(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, scale: float,
               causal: bool) -> list[np.ndarray]:
    tq, tk, tv = (torch.tensor(f64(a), requires_grad=True) for a in (q, k, v))
    y = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=causal, scale=scale,
                                                         enable_gqa=q.shape[:-2] != k.shape[:-2])
    s = (tq @ tk.repeat_interleave(q.shape[-3] // k.shape[-3], -3).transpose(-1, -2) if q.ndim > 2
         else tq @ tk.T) * scale
    if causal:
        s = s.masked_fill(~torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril(), -torch.inf)
    lse = torch.logsumexp(s, -1)
    y.backward(torch.tensor(f64(g)))
    return [y.detach().numpy(), lse.detach().numpy(), tq.grad.numpy(), tk.grad.numpy(), tv.grad.numpy()]


def _check(rng: np.random.Generator, dtype: str, qs: tuple[int, ...], ks: tuple[int, ...], dv: int, causal: bool,
           scale: float = 0.4) -> None:
    q, k = rand(rng, dtype, qs, -1, 1), rand(rng, dtype, ks, -1, 1)
    v, g = rand(rng, dtype, (*ks[:-1], dv), -1, 1), rand(rng, dtype, (*qs[:-1], dv), -1, 1)
    want = _reference(q, k, v, g, scale, causal)
    ex = executor(q=q, k=k, v=v, g=g)
    lse_dt = "float64" if dtype == "float64" else "float32"
    run(ex, "attention", [T("q", dtype), T("k", dtype), T("v", dtype), V(scale), V(causal)],
        [T("y", dtype), T("lse", lse_dt)])
    run(ex, "attentiongrad", [T("q", dtype), T("k", dtype), T("v", dtype), T("y", dtype), T("lse", lse_dt),
                              T("g", dtype), V(scale), V(causal)], [T("dq", dtype), T("dk", dtype), T("dv", dtype)])
    rtol = RTOL.get(dtype)
    for name, w, dt in zip(("y", "lse", "dq", "dk", "dv"), want, (dtype, lse_dt, dtype, dtype, dtype)):
        scale_of = np.full(w.shape, np.abs(w).max(initial=1.0))
        assert_close(ex.get(name), w, dt, scale=scale_of, rtol=rtol, atol=rtol and 1e-12,
                     what=f"attention {name} {qs} {ks} causal={causal}")


@pytest.mark.parametrize("dtype", ordered(OPS["attention"].dtypes))
@pytest.mark.parametrize("shapes", SHAPES, ids=str)
@pytest.mark.parametrize("causal", [False, True])
def test_attention_and_its_gradient_op_match_torch(rng, dtype, shapes, causal):
    _check(rng, dtype, *shapes, causal)


@pytest.mark.parametrize("causal", [False, True])
def test_blocks_of_rows_and_batch_items_give_the_same_values(rng, causal, monkeypatch):
    """A block smaller than the sequence (a few rows, then one batch item's rows in several blocks): what a long
    sequence does to keep its scores O(T x block)."""
    monkeypatch.setattr(attention_kernels, "CAUSAL_ROWS", 16)
    for block in (64, 7 * 40, 3 * 2 * 40 * 40):
        monkeypatch.setattr(attention_kernels, "BLOCK", block)
        _check(rng, "float64", (3, 2, 37, 5), (3, 2, 40, 5), 4, causal)
        _check(rng, "float32", (2, 4, 23, 8), (2, 2, 19, 8), 6, causal, scale=0.9)


@pytest.mark.parametrize("causal", [False, True])
def test_blocks_bound_the_scores_held_at_once(causal):
    for b, g, tq, tk in [(64, 1, 4096, 4096), (1, 8, 100000, 100000), (4096, 4, 1, 512), (32, 1, 128, 128)]:
        blocks = list(attention_kernels._blocks(b, g, tq, tk, causal))
        rows = max(i1 - i0 for _, i0, i1 in blocks)
        items = max(s.stop - s.start for s, _, _ in blocks)
        assert items * rows * g * tk <= max(attention_kernels.BLOCK, g * tk)
        assert sum((s.stop - s.start) * (i1 - i0) for s, i0, i1 in blocks) == b * tq  # every row once
        assert rows <= attention_kernels.CAUSAL_ROWS or not causal


def test_no_keys_attend_to_nothing(rng):
    """Tk = 0: zeros (torch's empty softmax times an empty v), lse -inf, and a zero gradient for q."""
    q, g = rng.standard_normal((2, 3, 4)), rng.standard_normal((2, 3, 5))
    ex = executor(q=q, k=np.zeros((2, 0, 4)), v=np.zeros((2, 0, 5)), g=g)
    run(ex, "attention", [T("q"), T("k"), T("v"), V(0.5), V(True)], [T("y"), T("lse")])
    run(ex, "attentiongrad", [T("q"), T("k"), T("v"), T("y"), T("lse"), T("g"), V(0.5), V(True)],
        [T("dq"), T("dk"), T("dv")])
    np.testing.assert_array_equal(ex.get("y"), np.zeros((2, 3, 5)))
    np.testing.assert_array_equal(ex.get("lse"), np.full((2, 3), -np.inf))
    np.testing.assert_array_equal(ex.get("dq"), np.zeros((2, 3, 4)))
    assert ex.get("dk").shape == (2, 0, 4) and ex.get("dv").shape == (2, 0, 5)


@pytest.mark.parametrize(("shapes", "message"), [
    (((2, 5, 4), (2, 6, 3), (2, 6, 4)), "q 'q' \\[2, 5, 4\\] and k 'k' \\[2, 6, 3\\] differ in their last dim"),
    (((2, 5, 4), (2, 6, 4), (2, 5, 4)), "k 'k' \\[2, 6, 4\\] and v 'v' \\[2, 5, 4\\] differ outside their last"),
    (((2, 5, 4), (3, 6, 4), (3, 6, 4)), "differ in their leading dims"),
    (((1, 6, 5, 4), (1, 4, 6, 4), (1, 4, 6, 4)), "differ in their leading dims"),  # 4 heads do not divide 6
    (((5, 4), (1, 6, 4), (1, 6, 4)), "of one rank"),
    (((4,), (4,), (4,)), "of one rank \\(at least 2\\)"),
])
def test_shapes_that_do_not_fit_are_refused_by_name(shapes, message):
    qs, ks, vs = shapes
    ex = executor(q=np.ones(qs), k=np.ones(ks), v=np.ones(vs))
    with pytest.raises(DeepxError, match="attention: .*" + message):
        run(ex, "attention", [T("q"), T("k"), T("v"), V(1.0)], [T("y"), T("lse")])


def test_the_gradient_op_checks_its_result_and_logsumexp():
    ex = executor(q=np.ones((2, 5, 4)), k=np.ones((2, 6, 4)), v=np.ones((2, 6, 3)), y=np.ones((2, 5, 3)),
                  bad=np.ones((2, 5, 4)), lse=np.ones((2, 5)), lse32=np.ones((2, 5), np.float32))
    with pytest.raises(DeepxError, match="attentiongrad: 'bad' has shape \\[2, 5, 4\\]; attention's result has "
                                         "\\[2, 5, 3\\]"):
        run(ex, "attentiongrad", [T("q"), T("k"), T("v"), T("y"), T("lse"), T("bad"), V(1.0)],
            [T("a"), T("b"), T("c")])
    with pytest.raises(DeepxError, match="attentiongrad: the logsumexp 'lse32' is float32\\[2, 5\\]; attention gives "
                                         "float64\\[2, 5\\]"):
        run(ex, "attentiongrad", [T("q"), T("k"), T("v"), T("y"), T("lse32"), T("y"), V(1.0)],
            [T("a"), T("b"), T("c")])
    with pytest.raises(DeepxError, match="attention: dtypes float64 \\('q'\\) and float32 \\('lse32'\\) differ"):
        run(ex, "attention", [T("q"), T("lse32"), T("v"), V(1.0)], [T("y2"), T("l2")])


MASKED = [  # q, k, value size, mask shape
    ((2, 3, 5, 8), (2, 3, 5, 8), 8, (5, 5)),  # one mask for every batch item and head
    ((2, 6, 7, 4), (2, 2, 9, 4), 4, (2, 6, 7, 9)),  # a mask per query head, grouped-query heads
    ((2, 4, 3, 5), (2, 2, 6, 5), 3, (2, 1, 3, 6)),  # per batch item, shared by heads: read an item at a time
    ((3, 2, 1, 6), (3, 2, 11, 6), 5, (3, 1, 1, 11)),  # one query row (a decoding step), padding-like keys
    ((4, 6), (7, 6), 3, (7,)),  # no batch dims, a mask over keys alone
]


def _masked_reference(q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray, g: np.ndarray,
                      scale: float) -> list[np.ndarray]:
    tq, tk, tv = (torch.tensor(f64(a), requires_grad=True) for a in (q, k, v))
    tm = torch.tensor(mask if mask.dtype == np.bool_ else f64(mask))
    y = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, attn_mask=tm, scale=scale,
                                                         enable_gqa=q.shape[:-2] != k.shape[:-2])
    kr = tk.repeat_interleave(q.shape[-3] // k.shape[-3], -3) if q.ndim > 2 else tk
    s = (tq @ kr.transpose(-1, -2)) * scale
    s = s.masked_fill(~tm, -torch.inf) if mask.dtype == np.bool_ else s + tm
    lse = torch.logsumexp(s, -1)
    y.backward(torch.tensor(f64(g)))
    return [y.detach().numpy(), lse.detach().numpy(), tq.grad.numpy(), tk.grad.numpy(), tv.grad.numpy()]


def _check_masked(rng: np.random.Generator, dtype: str, qs: tuple[int, ...], ks: tuple[int, ...], dv: int,
                  ms: tuple[int, ...], kind: str, scale: float = 0.4) -> None:
    q, k = rand(rng, dtype, qs, -1, 1), rand(rng, dtype, ks, -1, 1)
    v, g = rand(rng, dtype, (*ks[:-1], dv), -1, 1), rand(rng, dtype, (*qs[:-1], dv), -1, 1)
    keep = rng.random(ms) < 0.7
    keep[..., 0] = True  # every row sees a key: torch's lse of a row that sees none is -inf, as ours, but nan's grad
    mask = keep if kind == "bool" else np.where(keep, rand(rng, dtype, ms, -1, 1), -np.inf).astype(dtype)
    want = _masked_reference(q, k, v, mask, g, scale)
    ex = executor(q=q, k=k, v=v, g=g, mask=mask)
    lse_dt = "float64" if dtype == "float64" else "float32"
    run(ex, "maskedattention", [T("q", dtype), T("k", dtype), T("v", dtype), T("mask"), V(scale)],
        [T("y", dtype), T("lse", lse_dt)])
    run(ex, "maskedattentiongrad", [T("q", dtype), T("k", dtype), T("v", dtype), T("mask"), T("y", dtype),
                                    T("lse", lse_dt), T("g", dtype), V(scale)],
        [T("dq", dtype), T("dk", dtype), T("dv", dtype)])
    rtol = RTOL.get(dtype)
    for name, w, dt in zip(("y", "lse", "dq", "dk", "dv"), want, (dtype, lse_dt, dtype, dtype, dtype)):
        scale_of = np.full(w.shape, np.abs(w).max(initial=1.0))
        assert_close(ex.get(name), w, dt, scale=scale_of, rtol=rtol, atol=rtol and 1e-12,
                     what=f"maskedattention {name} {qs} {ks} mask {ms} {kind}")


@pytest.mark.parametrize("dtype", ordered(OPS["maskedattention"].dtypes))
@pytest.mark.parametrize("shapes", MASKED, ids=str)
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_masked_attention_and_its_gradient_op_match_torch(rng, dtype, shapes, kind):
    _check_masked(rng, dtype, *shapes, kind)


def test_masked_blocks_give_the_same_values(rng, monkeypatch):
    """Blocks of a few rows and of single batch items, the mask read per block (a view, or an item at a time)."""
    monkeypatch.setattr(attention_kernels, "BLOCK", 7 * 40)
    for ms in [(37, 40), (3, 1, 37, 40), (3, 2, 1, 40)]:
        _check_masked(rng, "float64", (3, 2, 37, 5), (3, 2, 40, 5), 4, ms, "bool")
        _check_masked(rng, "float32", (3, 2, 37, 5), (3, 2, 40, 5), 4, ms, "float")


def test_rows_that_see_no_key_give_zeros(rng):
    """A row whose every key is masked: zeros and lse -inf, as torch's safe softmax, and a zero gradient for it."""
    q, k, v, g = (rng.standard_normal(s) for s in [(2, 3, 4), (2, 5, 4), (2, 5, 6), (2, 3, 6)])
    mask = np.ones((3, 5), bool)
    mask[1] = False
    ex = executor(q=q, k=k, v=v, g=g, mask=mask)
    run(ex, "maskedattention", [T("q"), T("k"), T("v"), T("mask"), V(0.5)], [T("y"), T("lse")])
    run(ex, "maskedattentiongrad", [T("q"), T("k"), T("v"), T("mask"), T("y"), T("lse"), T("g"), V(0.5)],
        [T("dq"), T("dk"), T("dv")])
    tq, tk, tv = (torch.tensor(a, requires_grad=True) for a in (q, k, v))
    y = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, attn_mask=torch.tensor(mask), scale=0.5)
    y.backward(torch.tensor(g))
    np.testing.assert_array_equal(ex.get("y")[:, 1], 0)
    np.testing.assert_array_equal(ex.get("lse")[:, 1], -np.inf)
    np.testing.assert_array_equal(ex.get("dq")[:, 1], 0)
    for name, want in (("y", y), ("dq", tq.grad), ("dk", tk.grad), ("dv", tv.grad)):
        np.testing.assert_allclose(ex.get(name), want.detach().numpy(), rtol=1e-10, atol=1e-12, err_msg=name)


@pytest.mark.parametrize(("mask", "message"), [
    (np.ones((5, 6), np.int64), "dtype int64 of 'mask' is not supported"),
    (np.ones((5, 6), np.float32), "the mask 'mask' is float32; give bool \\(True: the key takes part\\) or float64"),
    (np.ones((5, 7), bool), "the mask 'mask' \\[5, 7\\] does not broadcast to the scores \\[2, 5, 6\\]"),
    (np.ones((3, 2, 5, 6), bool), "does not broadcast"),
])
def test_masks_that_do_not_fit_are_refused_by_name(mask, message):
    ex = executor(q=np.ones((2, 5, 4)), k=np.ones((2, 6, 4)), v=np.ones((2, 6, 3)), mask=mask)
    with pytest.raises(DeepxError, match="maskedattention: .*" + message):
        run(ex, "maskedattention", [T("q"), T("k"), T("v"), T("mask"), V(1.0)], [T("y"), T("lse")])
