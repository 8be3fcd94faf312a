"""torch's tensor functions that deepx computes with ops of their own (rounding, log1p, expm1, erf, cumsum): forward
and backward against torch on the CPU, float64 and float32, as functions and as methods."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import deepx_sdk as dx

TOL = {"float64": dict(rtol=1e-10, atol=1e-12), "float32": dict(rtol=2e-6, atol=1e-6)}


def _pair(a: np.ndarray, grad: bool = True) -> tuple[dx.Tensor, torch.Tensor]:
    return dx.tensor(a, requires_grad=grad), torch.tensor(a, requires_grad=grad)


def _backward_both(ours: dx.Tensor, theirs: torch.Tensor, rng: np.random.Generator) -> None:
    """The gradient of sum(out * w) for a random w, on both sides."""
    w = rng.standard_normal(tuple(theirs.shape)).astype(ours.dtype)
    (ours * dx.tensor(w)).sum().backward()
    (theirs * torch.from_numpy(w)).sum().backward()


UNARY = [
    ("floor", lambda m, x: m.floor(x)),
    ("ceil", lambda m, x: x.ceil()),
    ("round", lambda m, x: m.round(x)),
    ("round decimals", lambda m, x: x.round(decimals=2)),
    ("round negative decimals", lambda m, x: m.round(x * 100, decimals=-1)),
    ("trunc", lambda m, x: m.trunc(x)),
    ("fix", lambda m, x: x.fix()),
    ("frac", lambda m, x: m.frac(x)),
    ("log1p", lambda m, x: m.log1p(x.abs())),
    ("expm1", lambda m, x: x.expm1()),
    ("erf", lambda m, x: m.erf(x)),
]


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("name, f", UNARY, ids=[u[0] for u in UNARY])
def test_unary_functions_follow_torch(name, f, dtype, rng):
    a = rng.uniform(-4, 4, (5, 7)).astype(dtype)
    a[0, :6] = [0.5, 1.5, -2.5, -0.5, 0.125, 2.0]  # ties of round, whole numbers
    x, t = _pair(a)
    ours, theirs = f(dx, x), f(torch, t)
    np.testing.assert_allclose(ours.numpy(), theirs.detach().numpy(), **TOL[dtype])
    _backward_both(ours, theirs, rng)
    np.testing.assert_allclose(x.grad.numpy(), t.grad.numpy(), **TOL[dtype])


@pytest.mark.parametrize("dtype", ["int64", "int32"])
def test_rounding_an_integer_tensor_copies_it_as_torch(dtype):
    a = np.array([-3, 0, 7], dtype=dtype)
    for name in ("floor", "ceil", "round", "trunc"):
        got = getattr(dx.tensor(a), name)()
        want = getattr(torch.tensor(a), name)()
        assert got.dtype == dtype and str(want.dtype) == f"torch.{dtype}"
        np.testing.assert_array_equal(got.numpy(), want.numpy())
    with pytest.raises(dx.DeepxError, match="round: decimals=1 needs a float tensor"):
        dx.tensor(a).round(decimals=1)


def test_log1p_expm1_erf_of_an_integer_tensor_are_float32_as_torch():
    a = np.array([0, 1, 3])
    for name in ("log1p", "expm1", "erf"):
        got, want = getattr(dx.tensor(a), name)(), getattr(torch.tensor(a), name)()
        assert got.dtype == "float32"
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-6)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("dim", [0, 1, -1, -3])
def test_cumsum_follows_torch(dim, dtype, rng):
    a = rng.uniform(-3, 3, (3, 4, 5)).astype(dtype)
    x, t = _pair(a)
    ours, theirs = (dx.cumsum(x, dim), torch.cumsum(t, dim)) if dim % 2 else (x.cumsum(dim), t.cumsum(dim))
    np.testing.assert_allclose(ours.numpy(), theirs.detach().numpy(), **TOL[dtype])
    _backward_both(ours, theirs, rng)
    np.testing.assert_allclose(x.grad.numpy(), t.grad.numpy(), **TOL[dtype])


def test_cumsum_dtypes_as_torch():
    """Integers and bools sum in int64; dtype= casts first; a 0-d tensor is its own running sum."""
    for a in (np.array([1, 2, 3], dtype=np.int32), np.array([True, False, True]), np.array([100, 100], np.int8)):
        got, want = dx.tensor(a).cumsum(0), torch.tensor(a).cumsum(0)
        assert got.dtype == "int64" and want.dtype == torch.int64
        np.testing.assert_array_equal(got.numpy(), want.numpy())
    got = dx.cumsum(dx.tensor(np.array([1, 2, 3])), 0, dtype=dx.float32)
    assert got.dtype == "float32" and got.tolist() == [1.0, 3.0, 6.0]
    assert dx.tensor(2.5).cumsum(-1).item() == 2.5
    with pytest.raises(dx.DeepxError, match="cumsum: dim 2 out of range"):
        dx.ones(3, 4).cumsum(2)


def _index(rng: np.random.Generator, high: int, shape: tuple[int, ...]) -> tuple[dx.Tensor, torch.Tensor]:
    i = rng.integers(0, high, shape)
    return dx.tensor(i), torch.from_numpy(i)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("dim", [0, 1, -1])
def test_gather_follows_torch(dim, dtype, rng):
    a = rng.uniform(-3, 3, (3, 4, 5)).astype(dtype)
    x, t = _pair(a)
    shape = [2, 3, 4]
    shape[dim] = 7  # longer than A along dim: indices repeat
    ix, it = _index(rng, a.shape[dim], tuple(shape))
    ours, theirs = (x.gather(dim, ix), t.gather(dim, it)) if dim else (dx.gather(x, dim, ix), torch.gather(t, dim, it))
    np.testing.assert_array_equal(ours.numpy(), theirs.detach().numpy())
    _backward_both(ours, theirs, rng)
    np.testing.assert_allclose(x.grad.numpy(), t.grad.numpy(), **TOL[dtype])


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("how", ["scatter", "scatter value", "scatter_add", "reduce add", "src larger", "in place",
                                 "scatter_add_ in place"])
def test_scatter_follows_torch(how, dtype, rng):
    a = rng.uniform(-3, 3, (4, 5)).astype(dtype)
    s = rng.uniform(-3, 3, (3, 5)).astype(dtype)
    x, t = _pair(a)
    sx, st = _pair(s)
    index = np.stack([rng.permutation(4)[:3] for _ in range(5)], 1)  # one write per place: torch's order is unsaid
    if how in ("scatter_add", "reduce add", "scatter_add_ in place"):
        index = rng.integers(0, 4, (3, 5))  # repeats add up
    ix, it = dx.tensor(index), torch.from_numpy(index)
    if how == "scatter value":
        ours, theirs = x.scatter(0, ix, 1.25), t.scatter(0, it, 1.25)
    elif how == "scatter_add":
        ours, theirs = dx.scatter_add(x, 0, ix, sx), torch.scatter_add(t, 0, it, st)
    elif how == "reduce add":
        ours, theirs = x.scatter(0, ix, sx, reduce="add"), t.scatter_add(0, it, st)
    elif how == "src larger":  # src is read only as far as the index reaches (torch's own backward then fails)
        ix, it = ix[:2, :3], it[:2, :3]
        ours, theirs = x.scatter(0, ix, sx), t.scatter(0, it, st[:2, :3])
    elif how == "in place":
        ours, theirs = x * 1, t * 1
        ours.scatter_(0, ix, sx)
        theirs.scatter_(0, it, st)
    elif how == "scatter_add_ in place":
        ours, theirs = x * 1, t * 1
        ours.scatter_add_(0, ix, sx)
        theirs.scatter_add_(0, it, st)
    else:
        ours, theirs = dx.scatter(x, 0, ix, sx), torch.scatter(t, 0, it, st)
    np.testing.assert_allclose(ours.numpy(), theirs.detach().numpy(), **TOL[dtype])
    _backward_both(ours, theirs, rng)
    np.testing.assert_allclose(x.grad.numpy(), t.grad.numpy(), **TOL[dtype])
    if how != "scatter value":
        np.testing.assert_allclose(sx.grad.numpy(), st.grad.numpy(), **TOL[dtype])


def test_gather_and_scatter_refuse_what_torch_refuses():
    x = dx.ones(3, 4)
    with pytest.raises(dx.DeepxError, match="gather: index must be int64"):
        x.gather(1, dx.tensor(np.array([[0.0]])))
    with pytest.raises(dx.DeepxError, match=r"gather: index '.+' has rank 1 but"):
        x.gather(1, dx.tensor(np.array([0, 1])))
    with pytest.raises(dx.DeepxError, match=r"scatter: src is float64, '.+' is float32"):
        x.scatter(0, dx.tensor(np.array([[0]])), dx.tensor(np.array([[1.0]])))
    with pytest.raises(dx.DeepxError, match="scatter: reduce='multiply' is not supported"):
        x.scatter(0, dx.tensor(np.array([[0]])), 2.0, reduce="multiply")
    with pytest.raises(dx.DeepxError, match=r"gather: index 4 out of range for dim 1 of size 4 \(gather\("):
        x.gather(1, dx.tensor(np.array([[0, 4]]))).numpy()


def _ties(rng: np.random.Generator, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    """Values with ties (halves in a small range)."""
    return (np.round(rng.uniform(-3, 3, shape) * 2) / 2).astype(dtype)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize(("dim", "descending"), [(-1, False), (0, True), (1, False), (-2, True)])
def test_sort_and_argsort_follow_torch_s_stable_sort(dim, descending, dtype, rng):
    a = _ties(rng, (4, 6, 5), dtype)
    x, t = _pair(a)
    ours = x.sort(dim, descending) if dim % 2 else dx.sort(x, dim=dim, descending=descending, stable=True)
    theirs = torch.sort(t, dim=dim, descending=descending, stable=True)
    values, indices = ours
    np.testing.assert_array_equal(values.numpy(), theirs.values.detach().numpy())
    np.testing.assert_array_equal(ours.indices.numpy(), theirs.indices.numpy())
    assert indices.dtype == "int64" and ours.values is values
    np.testing.assert_array_equal(dx.argsort(x, dim, descending).numpy(),
                                  torch.argsort(t, dim=dim, descending=descending, stable=True).numpy())
    _backward_both(values, theirs.values, rng)
    np.testing.assert_allclose(x.grad.numpy(), t.grad.numpy(), **TOL[dtype])


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize(("k", "dim", "largest"), [(3, -1, True), (1, 0, False), (6, 1, True), (0, -1, False)])
def test_topk_follows_torch(k, dim, largest, dtype, rng):
    """torch's values; the indices of ties are the first ones (torch's tie order is unsaid); the gradient, on
    values without ties, torch's."""
    a = _ties(rng, (4, 6, 5), dtype)
    x, t = _pair(a)
    ours = x.topk(k, dim, largest) if k % 2 else dx.topk(x, k, dim=dim, largest=largest, sorted=True)
    theirs = torch.topk(t, k, dim=dim, largest=largest)
    np.testing.assert_array_equal(ours.values.numpy(), theirs.values.detach().numpy())
    stable = torch.sort(t, dim=dim, descending=largest, stable=True).indices.narrow(dim, 0, k)
    np.testing.assert_array_equal(ours.indices.numpy(), stable.numpy())
    x, t = _pair(rng.permutation(120).reshape(4, 6, 5).astype(dtype))
    ours, theirs = dx.topk(x, k, dim, largest), torch.topk(t, k, dim, largest)
    _backward_both(ours.values, theirs.values, rng)
    np.testing.assert_allclose(x.grad.numpy(), t.grad.numpy(), **TOL[dtype])


def test_topk_gradient_goes_where_the_values_came_from():
    a = np.array([[1.0, 5.0, 3.0, 5.0], [0.0, -1.0, 2.0, 7.0]])
    x, t = _pair(a)
    x.topk(2).values.sum().backward()
    np.testing.assert_array_equal(x.grad.numpy(), [[0, 1, 0, 1], [0, 0, 1, 1]])
    t.topk(2).values.sum().backward()
    np.testing.assert_array_equal(x.grad.numpy(), t.grad.numpy())


def test_sort_of_bools_ints_nan_and_a_0d_tensor_as_torch():
    for a in (np.array([True, False, True, False]), np.array([3, -1, 3, 0], dtype=np.int32),
              np.array([2.0, np.nan, -0.0, 0.0, -np.inf, np.nan])):
        for descending in (False, True):
            ours, theirs = dx.tensor(a).sort(descending=descending), torch.tensor(a).sort(descending=descending,
                                                                                            stable=True)
            assert ours.values.dtype == str(theirs.values.dtype).removeprefix("torch.")
            np.testing.assert_array_equal(ours.values.numpy(), theirs.values.numpy())
            np.testing.assert_array_equal(ours.indices.numpy(), theirs.indices.numpy())
    ours = dx.tensor(2.5).sort()
    assert ours.values.item() == 2.5 and ours.indices.item() == 0 and ours.indices.shape == ()
    with pytest.raises(dx.DeepxError, match="argtopk: k=7 is out of range for the 6 elements along dim 0"):
        dx.tensor(np.arange(6.0)).topk(7)


@pytest.mark.parametrize(("a", "b"), [
    (np.array([7.5, -7.5, 2.0, -0.5, 1.0]), np.array([2.0, 2.0, -3.0, 4.0, 0.1])),
    (np.array([7, -7, 9, -1, 0], dtype=np.int64), np.array([2, 2, -4, 3, 5], dtype=np.int64)),
    (np.array([7, -7, 9], dtype=np.int32), 2),
    (np.array([7, -7, 9], dtype=np.int32), 2.5),
    (9.0, np.array([2.0, -4.0, 0.7])),
])
def test_div_rounding_mode_trunc_as_torch(a, b):
    ours = dx.div(*(dx.tensor(v) if isinstance(v, np.ndarray) else v for v in (a, b)), rounding_mode="trunc")
    theirs = torch.div(*(torch.tensor(v) if isinstance(v, np.ndarray) else v for v in (a, b)), rounding_mode="trunc")
    assert ours.dtype == str(theirs.dtype).removeprefix("torch.")
    np.testing.assert_array_equal(ours.numpy(), theirs.numpy())


_DIVMOD_FORMS = {
    "//": lambda m, a, b: a // b, "%": lambda m, a, b: a % b, "fmod": lambda m, a, b: m.fmod(a, b),
    "remainder": lambda m, a, b: m.remainder(a, b), "floor_divide": lambda m, a, b: m.floor_divide(a, b),
    "div floor": lambda m, a, b: m.div(a, b, rounding_mode="floor"), "% 2.5": lambda m, a, b: a % 2.5,
    "fmod -1.5": lambda m, a, b: a.fmod(-1.5), "7 // b": lambda m, a, b: 7.0 // b, "-7 % b": lambda m, a, b: -7 % b,
    "a.remainder(b)": lambda m, a, b: a.remainder(b), "a.fmod(b)": lambda m, a, b: a.fmod(b)}
_NO_TORCH_GRADIENT = ("//", "floor_divide", "7 // b")  # deepx's is zero (torch's div with rounding_mode)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("form", list(_DIVMOD_FORMS))
def test_float_floor_division_and_remainders_match_torch(rng, form, dtype):
    """Negative operands, a broadcast (a column against a row), exact multiples; the values and the gradients (1 for
    a, minus the whole quotient for b; zero for a floor division), where torch has them."""
    a = rng.uniform(-9, 9, (6, 1)) * np.array([[1], [1], [1], [1], [0], [1]])
    b = rng.uniform(0.5, 3, (1, 5)) * np.array([1, -1, 1, -1, 1])
    a[3, 0] = 3 * b[0, 2]  # a whole quotient: the remainder is 0
    a, b = a.astype(dtype), b.astype(dtype)
    x, y = dx.tensor(a, requires_grad=True), dx.tensor(b, requires_grad=True)
    ta, tb = torch.tensor(a, requires_grad=True), torch.tensor(b, requires_grad=True)
    ours, theirs = _DIVMOD_FORMS[form](dx, x, y), _DIVMOD_FORMS[form](torch, ta, tb)
    assert ours.dtype == dtype and ours.shape == tuple(theirs.shape)
    np.testing.assert_array_equal(ours.detach().numpy(), theirs.detach().numpy())
    w = rng.standard_normal(theirs.shape).astype(dtype)
    (ours * dx.tensor(w)).sum().backward()
    if form in _NO_TORCH_GRADIENT:
        with pytest.raises(RuntimeError, match="not implemented"):
            (theirs * torch.tensor(w)).sum().backward()
        assert all(g is None or not g.numpy().any() for g in (x.grad, y.grad))
        return
    if form == "-7 % b":  # torch has no gradient for a number's remainder: its tensor form's
        theirs = torch.remainder(torch.full_like(tb, -7), tb)
    (theirs * torch.tensor(w)).sum().backward()
    for got, want in ((x.grad, ta.grad), (y.grad, tb.grad)):
        if want is None or not want.any():
            assert got is None or not got.numpy().any()
        else:
            np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5 if dtype == "float32" else 1e-12)


def test_mixed_integer_and_float_operands_divide_in_floats_as_torch():
    i, f = dx.tensor([7, -7, 3]), dx.tensor([2.0, 2.0, -0.5])
    ti, tf = torch.tensor([7, -7, 3]), torch.tensor([2.0, 2.0, -0.5])
    for ours, theirs in ((i % 1.5, ti % 1.5), (i // f, ti // tf), (f.fmod(i), tf.fmod(ti)), (2.5 % i, 2.5 % ti)):
        assert ours.dtype == str(theirs.dtype).removeprefix("torch.")
        np.testing.assert_array_equal(ours.numpy(), theirs.numpy())


@pytest.mark.parametrize("dtype", ["int64", "int32", "int16", "int8"])
def test_integer_floor_division_and_remainders_match_torch(rng, dtype):
    a = rng.integers(-50, 50, 40).astype(dtype)
    b = rng.integers(-7, 8, 40).astype(dtype)
    b[b == 0] = 3
    x, y, ta, tb = dx.tensor(a), dx.tensor(b), torch.from_numpy(a), torch.from_numpy(b)
    cases = [(x // y, ta // tb), (x % y, ta % tb), (x.fmod(y), torch.fmod(ta, tb)),
             (x.remainder(y), torch.remainder(ta, tb)), (x.floor_divide(y), torch.floor_divide(ta, tb)),
             (dx.div(x, y, rounding_mode="floor"), torch.div(ta, tb, rounding_mode="floor")),
             (x // 3, ta // 3), (x % -3, ta % -3), (17 // y, 17 // tb), (17 % y, 17 % tb)]
    for ours, theirs in cases:
        assert ours.dtype == str(theirs.dtype).removeprefix("torch."), (ours.dtype, theirs.dtype)
        np.testing.assert_array_equal(ours.numpy(), theirs.numpy())
    with pytest.raises(dx.DeepxError, match="divi"):
        (x // dx.zeros_like(x)).numpy()


def test_a_torch_function_deepx_lacks_raises_a_deepx_error_from_the_module_too():
    for name in ("mode", "nonzero", "unique"):
        with pytest.raises(dx.DeepxError, match=f"deepx_sdk.{name} is not supported by deepx"):
            getattr(dx, name)
        assert not hasattr(dx, name)
    with pytest.raises(AttributeError, match="has no attribute 'no_such_function'"):
        dx.no_such_function  # noqa: B018


def test_multinomial_without_replacement_draws_distinct_categories_by_weight():
    """The Gumbel top-k sample (one argtopk): distinct categories, never a zero-weight one while others remain, the
    heavy one most often first."""
    dx.manual_seed(3)
    w = dx.tensor(np.array([[0.0, 1.0, 8.0, 1.0, 0.0]] * 400))
    draws = w.multinomial(3).numpy()
    assert draws.shape == (400, 3) and draws.dtype == np.int64
    assert all(len(set(row)) == 3 for row in draws.tolist())
    assert set(np.unique(draws)) == {1, 2, 3}
    assert (draws[:, 0] == 2).mean() > 0.7


@pytest.mark.parametrize("dtype", ["float64", "float32", "int64"])
def test_cumprod_follows_torch_and_its_gradient_zeros_included(dtype):
    rng = np.random.default_rng(11)
    a = rng.uniform(-1.5, 1.5, (3, 6)).astype(dtype) if dtype != "int64" else rng.integers(-3, 4, (3, 6))
    if dtype != "int64":
        a[0, 2] = a[1, 0] = a[1, 4] = 0  # the first zero of a row has a gradient of its own
    x, tx = dx.tensor(a, requires_grad=dtype != "int64"), torch.tensor(a, requires_grad=dtype != "int64")
    for dim in (1, 0, -1):
        y, ty = x.cumprod(dim), tx.cumprod(dim)
        assert y.dtype == str(ty.dtype).removeprefix("torch.")
        np.testing.assert_allclose(y.numpy(), ty.detach().numpy(), rtol=1e-6)
    assert dx.cumprod(x, 1).shape == (3, 6)
    assert dx.tensor([1, 2, 3], dtype=dx.int32).cumprod(0).dtype == "int64"  # as torch's: integers in int64
    if dtype != "int64":
        x.cumprod(1).sum().backward()
        tx.cumprod(1).sum().backward()
        np.testing.assert_allclose(x.grad.numpy(), tx.grad.numpy(), rtol=1e-5, atol=1e-6)


def test_kthvalue_and_median_follow_torch():
    """Values as torch's; indices as torch's where the k-th value is not tied (torch names any of tied ones); nan the
    largest for kthvalue, and median nan where a row holds one (the first nan's index); gradients to the picked
    element."""
    nan = float("nan")
    a = np.array([[3.0, 1.0, 2.0, 0.5, 5.0, nan], [2.5, 2.0, 7.0, 1.0, nan, nan], [4.0, 3.0, 2.0, 1.0, 0.0, -1.0]])
    x, tx = dx.tensor(a, requires_grad=True), torch.tensor(a, requires_grad=True)
    for k in (1, 2, 4, 6):
        got, want = x.kthvalue(k, 1), tx.kthvalue(k, 1)
        np.testing.assert_array_equal(got.values.numpy(), want.values.detach().numpy())
        np.testing.assert_array_equal(got.indices.numpy(), want.indices.numpy())
    got, want = dx.median(x, 1, keepdim=True), torch.median(tx, 1, keepdim=True)
    np.testing.assert_array_equal(got.values.numpy(), want.values.detach().numpy())
    np.testing.assert_array_equal(got.indices.numpy(), want.indices.numpy())
    got, want = x.kthvalue(3, 0), tx.kthvalue(3, 0)
    np.testing.assert_array_equal(got.values.numpy(), want.values.detach().numpy())
    (x.kthvalue(2, 1).values.sum() + x[2].median() * 3).backward()
    (tx.kthvalue(2, 1).values.sum() + tx[2].median() * 3).backward()
    np.testing.assert_array_equal(x.grad.numpy(), tx.grad.numpy())
    assert np.isnan(x.median().item()) and np.isnan(torch.median(tx).item())
    ints = dx.tensor([5, 3, 3, 1])
    assert ints.median().item() == 3 and ints.median(0).indices.dtype == "int64"
    with pytest.raises(dx.DeepxError, match="kthvalue: k \\(7\\) out of range"):
        x.kthvalue(7, 1)
