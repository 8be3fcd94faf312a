"""deepx_sdk's tensors against torch on the CPU: creation, arithmetic, promotion, reductions, shapes, indexing,
conversions, repr, and nn.functional, on random values, shapes and dtypes (issue 4, item 2)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as TF

import deepx_sdk as dx
import deepx_sdk.nn.functional as F
from tests.sdk.conftest import (
    DTYPES,
    DX_DTYPE,
    FLOAT_DTYPES,
    INT_DTYPES,
    TORCH_DTYPE,
    assert_same,
    pair,
    random_array,
    to_torch,
)

NUMERIC = [d for d in DTYPES if d != "bool"]


# ---------------------------------------------------------------- creation


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(), (1,), (5,), (3, 4), (2, 3, 4), (2, 0, 3)])
def test_tensor_from_numpy_round_trips(rng, dtype, shape):
    a = random_array(rng, shape, dtype)
    x = dx.tensor(a)
    assert x.shape == shape and x.dtype == dtype and x.ndim == len(shape) and x.numel() == a.size
    got = x.numpy()
    assert got.dtype == a.dtype and got.shape == shape
    np.testing.assert_array_equal(got, a)
    assert_same(dx.from_numpy(a), to_torch(a, dtype))


@pytest.mark.parametrize("data", [
    [1, 2, 3], [[1, 2], [3, 4]], [1.5, -2.0], [[1, 2.5]], [True, False, True], 3, 2.5, True, [], [[1], [2]],
    [-(2**40), 7],
])
def test_tensor_from_python_lists_infers_torch_dtypes(data):
    assert_same(dx.tensor(data), torch.tensor(data))


@pytest.mark.parametrize("dtype", DTYPES)
def test_tensor_with_dtype(dtype):
    data = [[0, 1, 2], [3, -1, 0]] if dtype != "bool" else [[True, False, True], [False, False, True]]
    assert_same(dx.tensor(data, dtype=getattr(dx, dtype)), torch.tensor(data, dtype=TORCH_DTYPE[dtype]))


def test_tensor_of_a_tensor_copies_it():
    a = dx.tensor([1.0, 2.0])
    b = dx.tensor(a)
    assert b.name != a.name
    b += 1
    np.testing.assert_array_equal(a.numpy(), [1.0, 2.0])
    np.testing.assert_array_equal(b.numpy(), [2.0, 3.0])
    assert dx.as_tensor(a) is a


@pytest.mark.parametrize("shape", [(), (4,), (2, 3), (2, 0), (1, 2, 3)])
@pytest.mark.parametrize("dtype", [None, "float64", "int32", "bool", "bfloat16"])
def test_zeros_ones_empty(shape, dtype):
    kw_dx = {} if dtype is None else {"dtype": getattr(dx, dtype)}
    kw_t = {} if dtype is None else {"dtype": TORCH_DTYPE[dtype]}
    if shape:
        assert_same(dx.zeros(*shape, **kw_dx), torch.zeros(*shape, **kw_t))
        assert_same(dx.ones(*shape, **kw_dx), torch.ones(*shape, **kw_t))
    assert_same(dx.zeros(shape, **kw_dx), torch.zeros(shape, **kw_t))
    assert_same(dx.ones(list(shape), **kw_dx), torch.ones(list(shape), **kw_t))
    e = dx.empty(shape, **kw_dx)
    t = torch.empty(shape, **kw_t)
    assert (e.shape, e.dtype) == (tuple(t.shape), DX_DTYPE[t.dtype])
    assert e.numpy().shape == shape


@pytest.mark.parametrize("value", [2.5, 7, -3, True, False, 0, 0.0])
@pytest.mark.parametrize("dtype", [None, "float16", "int8", "float64"])
def test_full(value, dtype):
    kw_dx = {} if dtype is None else {"dtype": dtype}
    kw_t = {} if dtype is None else {"dtype": TORCH_DTYPE[dtype]}
    assert_same(dx.full((2, 3), value, **kw_dx), torch.full((2, 3), value, **kw_t))
    assert_same(dx.full([4], value, **kw_dx), torch.full([4], value, **kw_t))


@pytest.mark.parametrize("args", [(5,), (0,), (2, 10), (-3, 4), (10, 0, -3), (0, 1, 0.1), (1.5, 4), (0, 10, 3),
                                  (-1.0, 1.0, 0.25), (0.0, 2.0, 0.3), (3, 3)])
def test_arange(args):
    assert_same(dx.arange(*args), torch.arange(*args))


@pytest.mark.parametrize("dtype", ["float64", "int32", "float16"])
def test_arange_with_dtype(dtype):
    assert_same(dx.arange(0, 12, 2, dtype=dtype), torch.arange(0, 12, 2, dtype=TORCH_DTYPE[dtype]))


@pytest.mark.parametrize("args", [(0, 1, 5), (-2.0, 3.0, 11), (1, 1, 3), (5, -5, 7), (0, 1, 1), (0, 10, 100)])
def test_linspace(args):
    assert_same(dx.linspace(*args), torch.linspace(*args), atol=1e-5)


def test_linspace_with_dtype():
    assert_same(dx.linspace(0, 1, 9, dtype=dx.float64), torch.linspace(0, 1, 9, dtype=torch.float64))


def test_rand_statistics():
    x = dx.rand(200_000)
    assert (x.shape, x.dtype) == ((200_000,), "float32")
    a = x.numpy()
    assert a.min() >= 0.0 and a.max() < 1.0
    assert abs(a.mean() - 0.5) < 0.01
    assert abs(a.std() - math.sqrt(1 / 12)) < 0.01
    hist = np.histogram(a, bins=10, range=(0, 1))[0] / a.size
    assert np.all(np.abs(hist - 0.1) < 0.01)
    assert dx.rand(3, 4, dtype=dx.float64).numpy().dtype == np.float64
    assert dx.rand((2, 5)).shape == (2, 5)


def test_randn_statistics():
    x = dx.randn(200, 1000)
    assert (x.shape, x.dtype) == ((200, 1000), "float32")
    a = x.numpy().reshape(-1)
    # five standard errors of a standard normal's mean over 200,000 draws (randn is not seeded here: 0.01, the old
    # bound, was four and a half)
    assert abs(a.mean()) < 5 / np.sqrt(a.size)
    assert abs(a.std() - 1.0) < 0.01
    assert abs(np.mean(np.abs(a) < 1.0) - 0.6827) < 0.01
    assert abs(np.mean(a**3)) < 0.05  # symmetric
    assert dx.randn(4, dtype=dx.float16).dtype == "float16"


@pytest.mark.parametrize("low,high", [(0, 10), (-5, 5), (3, 4), (-100, -90)])
def test_randint_statistics(low, high):
    x = dx.randint(low, high, (50_000,))
    assert (x.shape, x.dtype) == ((50_000,), "int64")
    a = x.numpy()
    assert a.min() == low and a.max() == high - 1
    counts = np.bincount(a - low, minlength=high - low) / a.size
    assert np.all(np.abs(counts - 1 / (high - low)) < 0.02)


def test_randint_forms_and_dtype():
    x = dx.randint(6, (3, 4))  # torch.randint(high, size)
    assert (x.shape, x.dtype) == ((3, 4), "int64")
    assert x.numpy().min() >= 0 and x.numpy().max() < 6
    y = dx.randint(2, 9, size=(100,), dtype=dx.int32)
    assert y.dtype == "int32" and 2 <= y.numpy().min() and y.numpy().max() < 9


def _draw():
    return [dx.rand(5).numpy(), dx.randn(2, 3).numpy(), dx.randint(0, 100, (8,)).numpy()]


def test_manual_seed_reproduces_random_ops():
    dx.manual_seed(1234)
    first = _draw()
    dx.manual_seed(1234)
    for a, b in zip(first, _draw()):
        np.testing.assert_array_equal(a, b)


def test_seeded_session_reproduces_random_ops():
    """What dx.manual_seed sets: a base seed and a fresh counter (set directly while manual_seed is broken)."""

    def seed(n):
        s = dx.session()
        s.base_seed, s.seed_counter = n, itertools.count(1)

    seed(1234)
    first = _draw()
    seed(1234)
    again = _draw()
    seed(99)
    other = _draw()
    for a, b, c in zip(first, again, other):
        np.testing.assert_array_equal(a, b)
        assert not np.array_equal(a, c)
    assert not np.array_equal(first[0], dx.rand(5).numpy())  # successive draws under one seed differ
    dx.session().base_seed = None
    assert not np.array_equal(dx.rand(5).numpy(), dx.rand(5).numpy())


@pytest.mark.parametrize("dtype", ["float32", "float64", "int32", "bool", "float16"])
def test_like_functions(rng, dtype):
    x, t = pair(rng, (3, 2), dtype)
    assert_same(dx.zeros_like(x), torch.zeros_like(t))
    assert_same(dx.ones_like(x), torch.ones_like(t))
    assert_same(dx.full_like(x, 1), torch.full_like(t, 1))
    assert_same(dx.zeros_like(x, dtype=dx.int16), torch.zeros_like(t, dtype=torch.int16))
    assert_same(dx.ones_like(x, dtype=dx.float64), torch.ones_like(t, dtype=torch.float64))
    e = dx.empty_like(x)
    assert (e.shape, e.dtype) == ((3, 2), dtype)
    if dtype in FLOAT_DTYPES:
        r = dx.rand_like(x).numpy()
        assert r.shape == (3, 2) and r.dtype == x.numpy().dtype and (r >= 0).all() and (r < 1).all()
        assert dx.randn_like(x).shape == (3, 2)
        assert dx.randn_like(x).dtype == dtype


# ---------------------------------------------------------------- arithmetic

BROADCAST_SHAPES = [
    ((3, 4), (3, 4)), ((3, 4), (4,)), ((3, 1), (1, 4)), ((2, 3, 4), (3, 1)), ((4,), (2, 3, 4)), ((), (3,)),
    ((5,), ()), ((1,), (6,)), ((2, 1, 5), (1, 3, 1)), ((0, 3), (3,)),
]
BINARY = {
    "add": lambda a, b: a + b,
    "sub": lambda a, b: a - b,
    "mul": lambda a, b: a * b,
    "div": lambda a, b: a / b,
    "pow": lambda a, b: a**b,
    "maximum": lambda a, b: a.maximum(b),
    "minimum": lambda a, b: a.minimum(b),
}


@pytest.mark.parametrize("op", list(BINARY))
@pytest.mark.parametrize("shapes", BROADCAST_SHAPES, ids=str)
def test_binary_broadcasting(rng, op, shapes):
    low = 0.5 if op in ("pow", "div") else -3.0
    x, t = pair(rng, shapes[0], low=low)
    y, u = pair(rng, shapes[1], low=low)
    assert_same(BINARY[op](x, y), BINARY[op](t, u))


@pytest.mark.parametrize("dtype", ["float32", "float64", "int64", "int32", "int8", "float16", "bfloat16"])
@pytest.mark.parametrize("scalar", [2, -3, 0.5, 1.5, True])
@pytest.mark.parametrize("op", ["add", "radd", "sub", "rsub", "mul", "rmul", "div", "rdiv"])
def test_scalar_operands(rng, dtype, scalar, op):
    x, t = pair(rng, (2, 5), dtype, low=1, high=5)
    f = {
        "add": lambda a: a + scalar, "radd": lambda a: scalar + a, "sub": lambda a: a - scalar,
        "rsub": lambda a: scalar - a, "mul": lambda a: a * scalar, "rmul": lambda a: scalar * a,
        "div": lambda a: a / scalar, "rdiv": lambda a: scalar / a,
    }[op]
    if isinstance(scalar, bool) and op in ("sub", "rsub"):
        with pytest.raises(RuntimeError):
            f(t)  # torch refuses bool subtraction; deepx need not agree on an error
        return
    assert_same(f(x), f(t))


@pytest.mark.parametrize("dtype", ["float32", "float64", "int64", "int32"])
@pytest.mark.parametrize("exponent", [2, 3, 0.5, 2.0, 0])
def test_pow_scalars(rng, dtype, exponent):
    x, t = pair(rng, (7,), dtype, low=1, high=4)
    assert_same(x**exponent, t**exponent)
    assert_same(2**x, 2**t)
    assert_same(1.5**x, 1.5**t)
    assert_same(x.pow(exponent), t.pow(exponent))


@pytest.mark.parametrize("a,b", list(itertools.product(DTYPES, DTYPES)))
def test_promotion_matches_torch_result_type(rng, a, b):
    x, t = pair(rng, (4,), a, low=1, high=3)
    y, u = pair(rng, (4,), b, low=1, high=3)
    want = torch.result_type(t, u)
    out = x * y
    assert out.dtype == DX_DTYPE[want]
    assert_same(out, t * u)
    assert_same(x + y, t + u)
    if "bool" not in (a, b):
        assert_same(x - y, t - u)


@pytest.mark.parametrize("a,b", list(itertools.product(DTYPES, DTYPES)))
def test_promotion_with_zero_dim_tensors(rng, a, b):
    """A 0-d tensor next to a dimensioned one counts only when its category is higher (torch.result_type)."""
    x, t = pair(rng, (3,), a, low=1, high=3)
    z, u = pair(rng, (), b, low=1, high=3)
    assert (x * z).dtype == DX_DTYPE[torch.result_type(t, u)]
    assert_same(x * z, t * u)
    assert_same(z + x, u + t)
    assert_same(dx.where(x > 1, x, z), torch.where(t > 1, t, u))
    if "bool" not in (a, b):
        assert_same(x < z, t < u)


def _broadcastable_shapes(rng, k: int) -> list[tuple[int, ...]]:
    base = [int(d) for d in rng.integers(1, 5, size=rng.integers(0, 4))]
    shapes = []
    for _ in range(k):
        s = [1 if rng.random() < 0.3 else d for d in base]
        shapes.append(tuple(s[int(rng.integers(0, len(s) + 1)):]) if rng.random() < 0.3 else tuple(s))
    return shapes


def test_random_binary_ops_against_torch(rng):
    """Random ops, operand dtypes, broadcastable shapes (0-d included) and values."""
    ops = {**BINARY, **COMPARE}
    for case in range(300):
        name = str(rng.choice(list(ops)))
        da, db = (str(d) for d in rng.choice(DTYPES, 2))
        if name in ("sub", "pow") and "bool" in (da, db):
            continue  # torch refuses these on bool
        if name == "pow" and (da in INT_DTYPES and db in INT_DTYPES):
            continue  # integer overflow and negative exponents: undefined territory
        sa, sb = _broadcastable_shapes(rng, 2)
        x, t = pair(rng, sa, da, low=0.5 if name == "pow" else -4, high=4)
        y, u = pair(rng, sb, db, low=0.5 if name in ("pow", "div") else -4, high=4)
        want = ops[name](t, u)
        try:
            assert_same(ops[name](x, y), want, rtol=2e-2 if want.dtype in (torch.float16, torch.bfloat16) else None)
        except AssertionError as e:
            raise AssertionError(f"case {case}: {name} {da}{list(sa)} {db}{list(sb)}: {e}") from None


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scalar", [3, 2.5, True])
def test_promotion_with_python_scalars(rng, dtype, scalar):
    x, t = pair(rng, (3,), dtype, low=1, high=3)
    assert (x * scalar).dtype == DX_DTYPE[torch.result_type(t, scalar)]
    assert_same(x * scalar, t * scalar)


@pytest.mark.parametrize("a,b", [("int64", "int64"), ("int32", "int8"), ("int16", "int16"), ("bool", "int32"),
                                 ("int64", "float16"), ("bool", "bool")])
def test_true_division_of_integers_gives_float(rng, a, b):
    x, t = pair(rng, (3, 4), a, low=1, high=9)
    y, u = pair(rng, (4,), b, low=1, high=9)
    if b == "bool":
        y, u = dx.ones(4, dtype=dx.bool), torch.ones(4, dtype=torch.bool)
    assert_same(x / y, t / u)
    assert_same(x / 4, t / 4)
    assert_same(7 / y, 7 / u)
    assert (x / y).dtype == DX_DTYPE[(t / u).dtype]


def test_unary_methods(rng):
    x, t = pair(rng, (3, 5), low=0.1, high=3)
    for name in ["exp", "log", "sqrt", "sin", "cos", "tan", "tanh", "sigmoid", "relu", "abs", "neg", "rsqrt",
                 "square"]:
        assert_same(getattr(x, name)(), getattr(t, name)(), rtol=1e-5, atol=1e-5)
    y, u = pair(rng, (3, 5))
    assert_same(-y, -u)
    assert_same(abs(y), abs(u))
    assert_same(y.clamp(-1, 0.5), u.clamp(-1, 0.5))
    assert_same(y.clamp(min=0), u.clamp(min=0))
    assert_same(y.clamp(max=0.2), u.clamp(max=0.2))
    assert_same(dx.exp(y), torch.exp(u))
    assert_same(dx.maximum(x, y), torch.maximum(t, u))
    assert_same(dx.minimum(x, y), torch.minimum(t, u))


@pytest.mark.parametrize("dtype", ["int64", "int32"])
def test_unary_on_integers(rng, dtype):
    x, t = pair(rng, (6,), dtype, low=1, high=9)
    for name in ["exp", "log", "sqrt", "sin", "sigmoid", "tanh"]:
        assert_same(getattr(x, name)(), getattr(t, name)())
    z, v = pair(rng, (6,), dtype, low=-9, high=9)
    assert_same(z.abs(), v.abs())
    assert_same(-z, -v)
    assert_same(z.relu(), v.relu())
    assert_same(~z, ~v)
    b, c = pair(rng, (6,), "bool")
    assert_same(~b, ~c)


def test_in_place_methods(rng):
    x, t = pair(rng, (3, 4))
    y, u = pair(rng, (4,))
    x.add_(y)
    t.add_(u)
    x.mul_(2.0)
    t.mul_(2.0)
    x.sub_(y, alpha=0.5)
    t.sub_(u, alpha=0.5)
    x.div_(3)
    t.div_(3)
    x += 1
    t += 1
    x *= y
    t *= u
    assert_same(x, t)
    x.zero_()
    assert_same(x, torch.zeros(3, 4))
    x.fill_(2.5)
    assert_same(x, torch.full((3, 4), 2.5))
    x.copy_(y)
    assert_same(x, u.expand(3, 4))


# ---------------------------------------------------------------- comparisons, where, cat, stack

COMPARE = {
    "lt": lambda a, b: a < b, "gt": lambda a, b: a > b, "le": lambda a, b: a <= b, "ge": lambda a, b: a >= b,
    "eq": lambda a, b: a == b, "ne": lambda a, b: a != b,
}


@pytest.mark.parametrize("op", list(COMPARE))
@pytest.mark.parametrize("dtypes", [("float32", "float32"), ("int64", "int64"), ("int32", "float32"),
                                    ("float64", "int8"), ("bool", "bool"), ("bool", "int32")])
def test_comparisons(rng, op, dtypes):
    x, t = pair(rng, (3, 4), dtypes[0], low=-2, high=2)
    y, u = pair(rng, (4,), dtypes[1], low=-2, high=2)
    if dtypes[0] in FLOAT_DTYPES:  # some ties, so that == and <= mean something
        x, t = dx.tensor(np.round(x.numpy())), torch.round(t)
    assert_same(COMPARE[op](x, y), COMPARE[op](t, u))
    assert_same(COMPARE[op](x, x), COMPARE[op](t, t))
    for s in (0, 1, 0.5, -1.5):
        assert_same(COMPARE[op](x, s), COMPARE[op](t, s))
    assert_same(getattr(x, op)(y), getattr(t, op)(u))


@pytest.mark.parametrize("shapes", [((3, 4), (3, 4), (3, 4)), ((3, 4), (4,), (3, 1)), ((4,), (2, 4), ()),
                                    ((2, 1, 3), (4, 1), (3,))], ids=str)
@pytest.mark.parametrize("dtypes", [("float32", "float32"), ("int64", "float32"), ("int32", "int64"),
                                    ("float16", "float64")])
def test_where(rng, shapes, dtypes):
    c = random_array(rng, shapes[0], "bool")
    x, t = pair(rng, shapes[1], dtypes[0])
    y, u = pair(rng, shapes[2], dtypes[1])
    assert_same(dx.where(dx.tensor(c), x, y), torch.where(torch.from_numpy(c), t, u))


@pytest.mark.parametrize("dtype", ["float32", "int64", "int32", "float64"])
@pytest.mark.parametrize("scalars", [(0.5, None), (None, 2), (None, -1.5), (3, None), (1.0, 0.0), (1, 0)])
def test_where_with_scalars(rng, dtype, scalars):
    c = random_array(rng, (3, 4), "bool")
    x, t = pair(rng, (3, 4), dtype)
    a = scalars[0] if scalars[0] is not None else x
    b = scalars[1] if scalars[1] is not None else x
    ta = scalars[0] if scalars[0] is not None else t
    tb = scalars[1] if scalars[1] is not None else t
    assert_same(dx.where(dx.tensor(c), a, b), torch.where(torch.from_numpy(c), ta, tb))


@pytest.mark.parametrize("dim", [0, 1, -1, 2, -3])
def test_cat(rng, dim):
    shapes = [[2, 3, 4], [2, 3, 4], [2, 3, 4]]
    for i, s in enumerate(shapes):
        s[dim] = i + 1
    xs, ts = zip(*(pair(rng, s) for s in shapes))
    assert_same(dx.cat(list(xs), dim=dim), torch.cat(ts, dim=dim))
    assert_same(dx.cat(xs, dim), torch.cat(ts, dim))
    assert_same(dx.concat([xs[0]], dim), torch.concat([ts[0]], dim))


def test_cat_promotes_dtypes(rng):
    a, t = pair(rng, (2,), "int32")
    b, u = pair(rng, (3,), "float16")
    c, v = pair(rng, (1,), "int64")
    assert_same(dx.cat([a, b, c]), torch.cat([t, u, v]))
    assert_same(dx.cat([a, c]), torch.cat([t, v]))


@pytest.mark.parametrize("dim", [0, 1, 2, -1, -3])
def test_stack(rng, dim):
    xs, ts = zip(*(pair(rng, (3, 4)) for _ in range(3)))
    assert_same(dx.stack(xs, dim=dim), torch.stack(ts, dim=dim))
    s, u = pair(rng, ())
    assert_same(dx.stack([s, s]), torch.stack([u, u]))


def test_cat_stack_shape_errors(rng):
    a, _ = pair(rng, (2, 3))
    b, _ = pair(rng, (2, 4))
    with pytest.raises(dx.DeepxError, match="concat"):
        dx.cat([a, b], 0)
    with pytest.raises(dx.DeepxError):
        dx.stack([a, b])
    with pytest.raises(dx.DeepxError):
        dx.cat([])


# ---------------------------------------------------------------- reductions

REDUCE_DIMS = [None, 0, 1, -1, (0, 2), (-1, 0), (0, 1, 2)]


@pytest.mark.parametrize("op", ["sum", "mean", "prod", "amax", "amin"])
@pytest.mark.parametrize("dim", REDUCE_DIMS, ids=str)
@pytest.mark.parametrize("keepdim", [False, True])
def test_reductions(rng, op, dim, keepdim):
    x, t = pair(rng, (3, 4, 5), "float64", low=0.5, high=1.5)
    if dim is None:
        if keepdim:
            return
        assert_same(getattr(x, op)(), getattr(t, op)())
        return
    if op == "prod" and isinstance(dim, tuple):
        want = t
        for d in sorted((d % 3 for d in dim), reverse=True):
            want = want.prod(d, keepdim=keepdim)
        assert_same(x.prod(dim, keepdim=keepdim), want)
        return
    assert_same(getattr(x, op)(dim, keepdim=keepdim), getattr(t, op)(dim, keepdim=keepdim))
    assert_same(getattr(x, op)(dim=dim, keepdim=keepdim), getattr(t, op)(dim=dim, keepdim=keepdim))


@pytest.mark.parametrize("dtype", DTYPES)
def test_reduction_dtypes(rng, dtype):
    x, t = pair(rng, (4, 6), dtype, low=-2, high=2)
    assert_same(x.sum(), t.sum())
    assert_same(x.sum(1), t.sum(1))
    if dtype != "bool":
        assert_same(x.prod(0), t.prod(0))
        assert_same(x.amax(1), t.amax(1))
        assert_same(x.max(), t.max())
        assert_same(x.min(), t.min())
    if dtype in FLOAT_DTYPES:
        assert_same(x.mean(0), t.mean(0))
    assert_same(x.sum(dtype=dx.float64), t.sum(dtype=torch.float64))


@pytest.mark.parametrize("dtype", ["float32", "float64", "int32", "int64", "float16"])
@pytest.mark.parametrize("dim", [0, 1, -1])
@pytest.mark.parametrize("keepdim", [False, True])
def test_max_min_with_dim_return_values_and_indices(rng, dtype, dim, keepdim):
    a = rng.permutation(60).reshape(3, 4, 5).astype(dtype) - 30  # no ties
    x, t = dx.tensor(a), torch.from_numpy(a.copy())
    for name in ("max", "min"):
        got, want = getattr(x, name)(dim, keepdim=keepdim), getattr(t, name)(dim, keepdim=keepdim)
        values, indices = got
        assert_same(values, want.values)
        assert_same(indices, want.indices)
        assert_same(got.values, want[0])
        assert_same(got.indices, want[1])
        assert_same(getattr(x, "arg" + name)(dim, keepdim=keepdim), getattr(t, "arg" + name)(dim, keepdim=keepdim))
    assert_same(x.argmax(), t.argmax())
    assert_same(x.argmin(), t.argmin())
    assert_same(dx.max(x, dim)[0], torch.max(t, dim)[0])
    assert_same(dx.argmax(x), torch.argmax(t))


def test_max_of_two_tensors(rng):
    x, t = pair(rng, (3, 4))
    y, u = pair(rng, (4,))
    assert_same(x.max(y), t.max(u))
    assert_same(x.min(y), t.min(u))


@pytest.mark.parametrize("dim", [None, 0, 1, -1, (0, 1)], ids=str)
@pytest.mark.parametrize("unbiased", [True, False])
@pytest.mark.parametrize("keepdim", [False, True])
def test_var_std(rng, dim, unbiased, keepdim):
    x, t = pair(rng, (5, 6, 3), "float64")
    if dim is None:
        assert_same(x.var(unbiased=unbiased), t.var(unbiased=unbiased))
        assert_same(x.std(unbiased=unbiased), t.std(unbiased=unbiased))
        return
    assert_same(x.var(dim, keepdim=keepdim, unbiased=unbiased), t.var(dim, keepdim=keepdim, unbiased=unbiased))
    assert_same(x.std(dim, keepdim=keepdim, unbiased=unbiased), t.std(dim, keepdim=keepdim, unbiased=unbiased))
    y, u = pair(rng, (5, 6, 3), "float32")
    assert_same(y.var(dim, keepdim=keepdim), u.var(dim, keepdim=keepdim))


@pytest.mark.filterwarnings("ignore:.*degrees of freedom:UserWarning")  # var of one element: nan, in both
def test_random_reductions_against_torch(rng):
    """Random shapes, dims (ints, tuples, negative), keepdim and dtypes."""
    for case in range(200):
        shape = tuple(int(d) for d in rng.integers(1, 5, size=rng.integers(1, 5)))
        name = str(rng.choice(["sum", "mean", "amax", "amin", "prod", "argmax", "argmin", "var", "std", "max"]))
        dtype = str(rng.choice(["float64", "float32"] if name in ("mean", "var", "std") else
                               ["float64", "float32", "int64", "int32", "int8"]))
        x, t = pair(rng, shape, dtype, low=-2, high=2)
        keepdim = bool(rng.random() < 0.5)
        if name in ("argmax", "argmin", "max"):
            dim = int(rng.integers(-len(shape), len(shape)))
            x, t = dx.tensor(rng.permutation(t.numel()).reshape(shape).astype(dtype)), None
            t = torch.from_numpy(x.numpy())  # no ties: the index of the extreme is unique
        else:
            k = int(rng.integers(1, len(shape) + 1))
            dim = tuple(int(d) - len(shape) * int(rng.integers(0, 2)) for d in rng.permutation(len(shape))[:k])
            if name == "prod":
                dim = dim[0]  # torch.prod takes one dim
        got = getattr(x, name)(dim, keepdim=keepdim)
        want = getattr(t, name)(dim, keepdim=keepdim)
        try:
            if name == "max":
                assert_same(got.values, want.values)
                assert_same(got.indices, want.indices)
            else:
                assert_same(got, want, rtol=1e-4 if dtype == "float32" else None, atol=1e-5)
        except AssertionError as e:
            raise AssertionError(f"case {case}: {name} {dtype}{list(shape)} dim={dim} keepdim={keepdim}: {e}") from None


def test_reduction_errors(rng):
    x, _ = pair(rng, (2, 3))
    with pytest.raises(dx.DeepxError, match="out of range"):
        x.sum(2)
    with pytest.raises(dx.DeepxError):
        x.argmax(-3)


def test_all_any(rng):
    b, c = pair(rng, (3, 4), "bool")
    for x, t in [(b, c), (dx.ones(3, dtype=dx.bool), torch.ones(3, dtype=torch.bool)),
                 (dx.zeros(3, dtype=dx.bool), torch.zeros(3, dtype=torch.bool))]:
        assert_same(x.all(), t.all())
        assert_same(x.any(), t.any())


# ---------------------------------------------------------------- matmul

MATMUL_SHAPES = [
    ((3, 4), (4, 5)), ((2, 3, 4), (4, 5)), ((3, 4), (2, 4, 5)), ((2, 3, 4), (2, 4, 5)), ((2, 1, 3, 4), (5, 4, 6)),
    ((4,), (4, 5)), ((3, 4), (4,)), ((4,), (4,)), ((2, 3, 4), (4,)), ((4,), (2, 4, 5)), ((1, 4), (4, 1)),
    ((0, 4), (4, 3)), ((3, 0), (0, 2)),
]


@pytest.mark.parametrize("shapes", MATMUL_SHAPES, ids=str)
def test_matmul(rng, shapes):
    x, t = pair(rng, shapes[0])
    y, u = pair(rng, shapes[1])
    assert_same(x @ y, t @ u, rtol=1e-5, atol=1e-5)
    assert_same(dx.matmul(x, y), torch.matmul(t, u), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtypes", [("int64", "int64"), ("int32", "int64"), ("float64", "float32"),
                                    ("float16", "float16"), ("bfloat16", "float32")])
def test_matmul_dtypes(rng, dtypes):
    x, t = pair(rng, (3, 4), dtypes[0], low=-2, high=2)
    y, u = pair(rng, (4, 2), dtypes[1], low=-2, high=2)
    dt = torch.result_type(t, u)  # torch refuses mixed dtypes in matmul; deepx promotes first
    assert_same(x @ y, t.to(dt) @ u.to(dt))


def test_matmul_shape_errors(rng):
    x, _ = pair(rng, (3, 4))
    y, _ = pair(rng, (5, 2))
    with pytest.raises(dx.DeepxError, match="matmul"):
        x @ y
    with pytest.raises(dx.DeepxError):
        dx.ones(2, 3, 4) @ dx.ones(3, 4, 5)


# ---------------------------------------------------------------- shapes


def test_reshape_view_flatten(rng):
    x, t = pair(rng, (2, 3, 4))
    for shape in [(6, 4), (-1,), (4, -1), (2, 12), (24,), (1, 2, 3, 4), (2, 3, 4)]:
        assert_same(x.reshape(shape), t.reshape(shape))
        assert_same(x.reshape(*shape), t.reshape(*shape))
        assert_same(x.view(*shape), t.view(*shape))
    assert_same(x.flatten(), t.flatten())
    assert_same(x.flatten(1), t.flatten(1))
    assert_same(x.flatten(0, 1), t.flatten(0, 1))
    assert_same(x.flatten(-2, -1), t.flatten(-2, -1))
    s, u = pair(rng, ())
    assert_same(s.flatten(), u.flatten())
    assert_same(s.reshape(1, 1), u.reshape(1, 1))
    y, v = pair(rng, (6, 4))
    assert_same(x.view_as(y), t.view_as(v))
    assert_same(x.reshape_as(y), t.reshape_as(v))
    with pytest.raises(dx.DeepxError, match="reshape"):
        x.reshape(5, -1)
    with pytest.raises(dx.DeepxError):
        x.view(7, 3)


def test_permute_transpose(rng):
    x, t = pair(rng, (2, 3, 4))
    for perm in itertools.permutations(range(3)):
        assert_same(x.permute(*perm), t.permute(*perm))
        assert_same(x.permute(perm), t.permute(perm))
    assert_same(x.permute(-1, 0, 1), t.permute(-1, 0, 1))
    for a, b in [(0, 1), (1, 2), (-1, 0), (2, 2)]:
        assert_same(x.transpose(a, b), t.transpose(a, b))
    assert_same(x.mT, t.mT)
    m, u = pair(rng, (3, 5))
    assert_same(m.T, u.T)
    assert_same(m.t(), u.t())
    assert_same(m.mT, u.mT)
    v, w = pair(rng, (4,))
    assert_same(v.T, w)  # torch deprecates .T on other ranks than 2; it reverses the dims (none to reverse here)
    assert_same(v.t(), w.t())
    with pytest.raises(dx.DeepxError):
        x.permute(0, 1)
    with pytest.raises(dx.DeepxError):
        x.permute(0, 0, 1)


def test_squeeze_unsqueeze(rng):
    x, t = pair(rng, (1, 3, 1, 4))
    assert_same(x.squeeze(), t.squeeze())
    for d in [0, 1, 2, -1, -2, -4]:
        assert_same(x.squeeze(d), t.squeeze(d))
    for d in [0, 1, 4, -1, -5, 2]:
        assert_same(x.unsqueeze(d), t.unsqueeze(d))
    s, u = pair(rng, ())
    assert_same(s.unsqueeze(0), u.unsqueeze(0))
    one, v = pair(rng, (1, 1))
    assert_same(one.squeeze(), v.squeeze())
    assert_same(dx.squeeze(x), torch.squeeze(t))
    assert_same(dx.unsqueeze(x, 1), torch.unsqueeze(t, 1))


def test_expand_repeat(rng):
    x, t = pair(rng, (3, 1))
    assert_same(x.expand(3, 4), t.expand(3, 4))
    assert_same(x.expand(2, 3, 5), t.expand(2, 3, 5))
    assert_same(x.expand(-1, 6), t.expand(-1, 6))
    assert_same(x.expand((2, -1, 2)), t.expand((2, -1, 2)))
    y, u = pair(rng, (3, 4))
    assert_same(x.expand_as(y), t.expand_as(u))
    assert_same(x.repeat(2, 3), t.repeat(2, 3))
    assert_same(x.repeat(2, 1, 2), t.repeat(2, 1, 2))
    assert_same(y.repeat((1, 2)), u.repeat((1, 2)))
    with pytest.raises(dx.DeepxError):
        x.expand(4, 4)
    with pytest.raises(dx.DeepxError):
        y.repeat(2)


def test_len_size_iter(rng):
    x, t = pair(rng, (3, 2))
    assert len(x) == 3
    assert x.size() == tuple(t.size()) and x.size(1) == t.size(1) and x.size(-1) == 2
    assert x.dim() == 2 and x.numel() == 6
    rows = list(x)
    assert len(rows) == 3
    for r, u in zip(rows, t):
        assert_same(r, u)
    with pytest.raises(TypeError):
        len(dx.tensor(1.0))


# ---------------------------------------------------------------- indexing

INDICES = [
    0, -1, 2, (1, 2), (-1, -2, 3), slice(None), slice(1, 3), slice(None, None, 2), slice(-3, None),
    slice(1, 100), slice(5, 2), (slice(None), 1), (Ellipsis, 1), (Ellipsis,), (1, Ellipsis, 2), (None,),
    (None, 1), (slice(None), None, slice(1, 4, 2)), (0, None, None, 2), (Ellipsis, None),
    (slice(0, 3, 2), slice(None), slice(4, None)), (1, slice(None), -1), (None, Ellipsis, None),
]


@pytest.mark.parametrize("index", INDICES, ids=repr)
def test_basic_indexing(rng, index):
    x, t = pair(rng, (4, 5, 6))
    assert_same(x[index], t[index])


@pytest.mark.parametrize("index", [
    [0, 2], [3, 0, 0], [-1, 1], np.array([1, 3]), np.array([[0, 1], [2, 3]]), "tensor", "tensor2d", "tensor32",
    (slice(None), [4, 0]), (1, [0, 2, 4]), (Ellipsis, [5, 1]), (slice(1, 3), [0, 0, 1]), ([2, 1], slice(None, 2)),
    (None, [1, 2]),
], ids=repr)
def test_integer_tensor_and_list_indexing(rng, index):
    x, t = pair(rng, (4, 5, 6))
    if isinstance(index, str):
        data = {"tensor": [3, 1, 1], "tensor2d": [[0, 3], [2, 1]], "tensor32": [2, 0]}[index]
        dtype = "int32" if index == "tensor32" else "int64"
        xi, ti = dx.tensor(data, dtype=dtype), torch.tensor(data, dtype=TORCH_DTYPE[dtype])
    else:
        xi, ti = index, index
    if isinstance(ti, np.ndarray):
        ti = torch.from_numpy(ti)
    assert_same(x[xi], t[ti])


def test_negative_values_in_an_index_tensor(rng):
    x, t = pair(rng, (4, 3))
    assert_same(x[dx.tensor([-1, 0, -4])], t[torch.tensor([-1, 0, -4])])
    assert_same(x[:, dx.tensor([-1])], t[:, torch.tensor([-1])])


@pytest.mark.parametrize("mask_shape", [(4, 5, 6), (4, 5), (4,)], ids=str)
def test_boolean_mask_indexing(rng, mask_shape):
    x, t = pair(rng, (4, 5, 6))
    m = random_array(rng, mask_shape, "bool")
    assert_same(x[dx.tensor(m)], t[torch.from_numpy(m)])
    if mask_shape == (4, 5, 6):
        assert_same(x[x > 0.5], t[t > 0.5])


def test_numpy_and_list_masks(rng):
    x, t = pair(rng, (4, 3))
    m = np.array([True, False, True, True])
    assert_same(x[m], t[torch.from_numpy(m)])
    assert_same(x[[False, True, False, False]], t[[False, True, False, False]])
    x[m] = 0.0
    t[torch.from_numpy(m)] = 0.0
    assert_same(x, t)


def test_indexing_errors(rng):
    x, _ = pair(rng, (4, 5))
    with pytest.raises(dx.DeepxError, match="out of range"):
        x[4]
    with pytest.raises(dx.DeepxError, match="out of range"):
        x[0, -6]
    with pytest.raises(dx.DeepxError, match="too many indices"):
        x[0, 0, 0]
    with pytest.raises(dx.DeepxError):
        x[..., 0, ...]
    with pytest.raises(dx.DeepxError):
        x[dx.tensor([True, False])]  # mask shape does not match


@pytest.mark.parametrize("case", range(9))
def test_setitem(rng, case):
    x, t = pair(rng, (4, 5, 6))
    v, u = pair(rng, (5, 6))
    if case == 0:
        x[0], t[0] = v, u
    elif case == 1:
        x[1:3] = 2.5
        t[1:3] = 2.5
    elif case == 2:
        w, z = pair(rng, (6,))
        x[:, 1], t[:, 1] = w, z  # broadcast across dim 0
    elif case == 3:
        x[..., ::2] = -1
        t[..., ::2] = -1
    elif case == 4:
        x[2, 3, 4] = 7
        t[2, 3, 4] = 7
    elif case == 5:
        x[x > 0] = 0.0
        t[t > 0] = 0.0
    elif case == 6:
        w, z = pair(rng, (1, 5, 6))
        x[-1:], t[-1:] = w, z
    elif case == 7:
        w, z = pair(rng, (4, 1, 1), "int64")  # cast to the target's dtype
        x[:, 1:4, 2:3], t[:, 1:4, 2:3] = w, z
    else:
        x[None, 0, ..., 1] = 3.0
        t[None, 0, ..., 1] = 3.0
    assert_same(x, t)


def test_setitem_on_integers(rng):
    x, t = pair(rng, (3, 4), "int32")
    x[1] = 9
    t[1] = 9
    x[:, 0] = dx.tensor([1.9, -2.9, 3.0])
    t[:, 0] = torch.tensor([1.9, -2.9, 3.0])
    assert_same(x, t)


# ---------------------------------------------------------------- dtype conversion, reading values


@pytest.mark.parametrize("src", DTYPES)
def test_dtype_conversion_methods(rng, src):
    x, t = pair(rng, (3, 5), src, low=-100, high=100)
    for m in ["float", "double", "half", "bfloat16", "int", "long", "bool"]:
        assert_same(getattr(x, m)(), getattr(t, m)())
    for dst in DTYPES:
        assert_same(x.to(getattr(dx, dst)), t.to(TORCH_DTYPE[dst]))
        assert_same(x.to(dtype=dst), t.to(dtype=TORCH_DTYPE[dst]))
    assert_same(x.to(np.float64), t.to(torch.float64))
    assert x.to("cpu") is x
    assert x.to(x.dtype) is x
    y, u = pair(rng, (2,), "int16")
    assert_same(x.type_as(y), t.type_as(u))
    assert x.is_floating_point() == t.is_floating_point()


def test_float_to_int_truncates_toward_zero():
    a = np.array([-2.7, -0.5, 0.5, 1.99, 3.0], np.float32)
    assert_same(dx.tensor(a).long(), torch.from_numpy(a).long())
    assert_same(dx.tensor(a).int(), torch.from_numpy(a).int())


@pytest.mark.parametrize("dtype", DTYPES)
def test_numpy_item_tolist(rng, dtype):
    x, t = pair(rng, (2, 3), dtype)
    np.testing.assert_array_equal(x.numpy(), t.float().numpy() if dtype == "bfloat16" else t.numpy())
    assert x.tolist() == t.tolist()
    s, u = x[1, 2], t[1, 2]
    assert s.item() == u.item() and type(s.item()) is type(u.item())
    assert s.tolist() == u.tolist()
    assert np.asarray(x).shape == (2, 3)
    with pytest.raises(dx.DeepxError):
        x.item()


def test_python_scalar_conversions():
    assert float(dx.tensor(2.5)) == 2.5
    assert int(dx.tensor([7])) == 7
    assert bool(dx.tensor(True)) is True and bool(dx.tensor(0.0)) is False
    assert [10, 20, 30][dx.tensor(1)] == 20


# ---------------------------------------------------------------- repr

REPR_CASES = [
    np.array([0.5, 1.0, 1.5], np.float32), np.array(3.5, np.float32), np.array([1.0, 2.0], np.float32),
    np.array([1e-5, 1.0], np.float32), np.array([[1, 2], [3, 4]], np.int32), np.array([True, False]),
    np.array([[1, 2], [3, 4]]), np.zeros((0, 3), np.float32), np.array([], np.int64),
    np.array([np.nan, 1.0, np.inf], np.float32), np.arange(24, dtype=np.float64).reshape(2, 3, 4) / 7,
    np.arange(2000, dtype=np.float32).reshape(40, 50), np.array(7), np.array([1.5, -2.25], np.float16),
    np.array([1e10, 1.0], np.float32), np.arange(-5, 30, dtype=np.int8),
]


@pytest.mark.parametrize("i", range(len(REPR_CASES)))
def test_repr_like_torch(i):
    a = REPR_CASES[i]
    want = repr(torch.from_numpy(a.copy())).replace("torch.", "dx.")
    assert repr(dx.tensor(a)) == want
    assert str(dx.tensor(a)) == want


def test_repr_of_random_float_tensors_like_torch(rng):
    for shape in [(3,), (2, 4), (3, 2, 2), (30,)]:
        a = rng.standard_normal(shape).astype(np.float32)
        assert repr(dx.tensor(a)) == repr(torch.from_numpy(a))


def test_repr_bfloat16_and_requires_grad():
    assert repr(dx.tensor([1.5, 2.0], dtype=dx.bfloat16)) == "tensor([1.5000, 2.0000], dtype=dx.bfloat16)"
    assert repr(dx.ones(2, requires_grad=True)) == "tensor([1., 1.], requires_grad=True)"


# ---------------------------------------------------------------- nn.functional

ACTIVATIONS = [
    ("relu", {}), ("sigmoid", {}), ("tanh", {}), ("gelu", {}), ("gelu", {"approximate": "tanh"}), ("silu", {}),
    ("softmax", {"dim": -1}), ("softmax", {"dim": 0}), ("log_softmax", {"dim": 1}), ("log_softmax", {"dim": -1}),
]


@pytest.mark.parametrize("name,kw", ACTIVATIONS, ids=lambda v: str(v))
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_activations(rng, name, kw, dtype):
    x, t = pair(rng, (4, 7), dtype, low=-6, high=6)
    assert_same(getattr(F, name)(x, **kw), getattr(TF, name)(t, **kw), rtol=2e-5, atol=2e-6)


def test_softmax_dtype_and_method_forms(rng):
    x, t = pair(rng, (3, 5), "float32", low=-30, high=30)
    assert_same(F.softmax(x, dim=1, dtype=dx.float64), TF.softmax(t, dim=1, dtype=torch.float64))
    assert_same(x.softmax(-1), t.softmax(-1))
    assert_same(x.log_softmax(0), t.log_softmax(0))
    assert_same(dx.softmax(x, 1), torch.softmax(t, 1))
    i, u = pair(rng, (4,), "int64")
    assert_same(i.softmax(0), u.float().softmax(0))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("ignore", [False, True])
def test_cross_entropy_and_nll_loss(rng, reduction, ignore):
    x, t = pair(rng, (6, 5), low=-4, high=4)
    target = rng.integers(0, 5, size=6)
    if ignore:
        target[[1, 4]] = -100
    y, u = dx.tensor(target), torch.from_numpy(target)
    assert_same(F.cross_entropy(x, y, reduction=reduction), TF.cross_entropy(t, u, reduction=reduction))
    logp, tl = F.log_softmax(x, 1), TF.log_softmax(t, 1)
    assert_same(F.nll_loss(logp, y, reduction=reduction), TF.nll_loss(tl, u, reduction=reduction))
    # nll_loss is -input[i, target[i]] for any input, log-probabilities or not
    assert_same(F.nll_loss(x, y, reduction=reduction), TF.nll_loss(t, u, reduction=reduction))
    if not ignore:
        for f, tf in [(F.cross_entropy, TF.cross_entropy), (F.nll_loss, TF.nll_loss)]:
            assert_same(f(x, y, ignore_index=2, reduction=reduction), tf(t, u, ignore_index=2, reduction=reduction))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_mse_loss(rng, reduction):
    x, t = pair(rng, (3, 4, 2))
    y, u = pair(rng, (3, 4, 2))
    assert_same(F.mse_loss(x, y, reduction=reduction), TF.mse_loss(t, u, reduction=reduction), rtol=1e-5)


@pytest.mark.parametrize("affine", [False, True])
@pytest.mark.parametrize("shape,normalized", [((4, 8), (8,)), ((2, 3, 6), (6,)), ((2, 3, 6), (3, 6)), ((5,), 5)],
                         ids=str)
def test_layer_norm_and_rms_norm(rng, affine, shape, normalized):
    x, t = pair(rng, shape)
    ns = (normalized,) if isinstance(normalized, int) else normalized
    w, tw = pair(rng, ns) if affine else (None, None)
    b, tb = pair(rng, ns) if affine else (None, None)
    assert_same(F.layer_norm(x, normalized, w, b), TF.layer_norm(t, ns, tw, tb), rtol=1e-4, atol=1e-5)
    assert_same(F.layer_norm(x, normalized, w, b, eps=1e-2), TF.layer_norm(t, ns, tw, tb, eps=1e-2), rtol=1e-4,
                atol=1e-5)
    assert_same(F.rms_norm(x, normalized, w), TF.rms_norm(t, ns, tw), rtol=1e-4, atol=1e-5)
    assert_same(F.rms_norm(x, normalized, w, eps=0.1), TF.rms_norm(t, ns, tw, eps=0.1), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("pad", [(1, 2), (0, 0, 2, 1), (1, 1, 1, 1, 1, 1), (3, 0)], ids=str)
@pytest.mark.parametrize("value", [0.0, -1.5])
def test_pad(rng, pad, value):
    x, t = pair(rng, (2, 3, 4))
    assert_same(F.pad(x, pad, value=value), TF.pad(t, pad, value=value))
    i, u = pair(rng, (3, 4), "int64")
    assert_same(F.pad(i, pad[:4]), TF.pad(u, pad[:4]))


@pytest.mark.parametrize("index_shape", [(5,), (2, 3), ()], ids=str)
def test_embedding(rng, index_shape):
    w, tw = pair(rng, (10, 4))
    idx = rng.integers(0, 10, size=index_shape)
    assert_same(F.embedding(dx.tensor(idx), w), TF.embedding(torch.from_numpy(idx), tw))


@pytest.mark.parametrize("shape", [(4, 3), (2, 5, 3), (3,)], ids=str)
@pytest.mark.parametrize("bias", [False, True])
def test_linear(rng, shape, bias):
    x, t = pair(rng, shape)
    w, tw = pair(rng, (6, 3))
    b, tb = pair(rng, (6,)) if bias else (None, None)
    assert_same(F.linear(x, w, b), TF.linear(t, tw, tb), rtol=1e-5, atol=1e-5)


def test_dropout(rng):
    x, t = pair(rng, (50, 40))
    assert_same(F.dropout(x, 0.5, training=False), TF.dropout(t, 0.5, training=False))
    assert_same(F.dropout(x, 0.0), TF.dropout(t, 0.0))
    ones = dx.ones(200, 500)
    y = F.dropout(ones, p=0.3, training=True).numpy()
    kept = y != 0
    assert abs(kept.mean() - 0.7) < 0.01
    np.testing.assert_allclose(y[kept], 1 / 0.7, rtol=1e-6)
    np.testing.assert_array_equal(ones.numpy(), 1.0)  # not in place
    with pytest.raises(dx.DeepxError):
        F.dropout(x, 1.5)


def test_functional_misc(rng):
    x, t = pair(rng, (3, 4))
    assert_same(F.normalize(x, dim=1), TF.normalize(t, dim=1))
    idx = rng.integers(0, 5, size=(2, 3))
    assert_same(F.one_hot(dx.tensor(idx), 5), TF.one_hot(torch.from_numpy(idx), 5))
    assert_same(F.relu(-x), TF.relu(-t))


# ---------------------------------------------------------------- masks, attention and sampling


@pytest.mark.parametrize("dtype", ["float32", "int64", "bool"])
@pytest.mark.parametrize("shape", [(4, 4), (3, 5), (2, 5, 3)], ids=str)
@pytest.mark.parametrize("diagonal", [0, 1, -2])
def test_tril_triu(rng, dtype, shape, diagonal):
    x, t = pair(rng, shape, dtype)
    assert_same(x.tril(diagonal), t.tril(diagonal))
    assert_same(dx.triu(x, diagonal), torch.triu(t, diagonal))


def test_tril_of_a_vector_is_an_error():
    with pytest.raises(dx.DeepxError, match=r"tril: .* has 1 dims"):
        dx.ones(3).tril()


@pytest.mark.parametrize("value", [-math.inf, 2.5, 7])
@pytest.mark.parametrize("mask_shape", [(3, 4), (4,), (3, 1)], ids=str)
def test_masked_fill(rng, value, mask_shape):
    x, t = pair(rng, (3, 4))
    m = rng.random(mask_shape) > 0.5
    assert_same(x.masked_fill(dx.tensor(m), value), t.masked_fill(torch.from_numpy(m), value))
    i, ti = pair(rng, (3, 4), "int64")
    if value != -math.inf:
        assert_same(i.masked_fill(dx.tensor(m), value), ti.masked_fill(torch.from_numpy(m), value))


def test_masked_fill_and_tril_gradients(rng):
    # nanoGPT's causal mask: masked_fill(tril(ones) == 0, -inf) before a softmax; masked places take no gradient
    a, w = rng.standard_normal((2, 5, 5)).astype(np.float32), rng.standard_normal((2, 5, 5)).astype(np.float32)
    x, t = dx.tensor(a, requires_grad=True), torch.tensor(a, requires_grad=True)
    mask, tmask = dx.ones(5, 5).tril() == 0, torch.ones(5, 5).tril() == 0
    (x.masked_fill(mask, -math.inf).softmax(-1) * dx.tensor(w) + x.tril(1)).sum().backward()
    (t.masked_fill(tmask, -math.inf).softmax(-1) * torch.from_numpy(w) + t.tril(1)).sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), t.grad.numpy(), rtol=1e-5, atol=1e-6)


def test_masked_fill_checks_its_mask():
    x = dx.zeros(3, 4)
    with pytest.raises(dx.DeepxError, match="masked_fill: the mask must be a bool tensor, got float32"):
        x.masked_fill(dx.zeros(3, 4), 1.0)
    with pytest.raises(dx.DeepxError, match="masked_fill"):
        x.masked_fill(dx.ones(2, 3, 4).bool(), 1.0)
    y = x.clone()
    y.masked_fill_(dx.tensor([True, False, False, True]), 5.0)
    np.testing.assert_array_equal(y.numpy(), np.where([True, False, False, True], 5.0, 0.0) * np.ones((3, 1)))


@pytest.mark.parametrize("mask", ["none", "causal", "bool", "float"])
@pytest.mark.parametrize("shapes", [((2, 3, 5, 8), (2, 3, 5, 8)), ((4, 6), (7, 6)), ((2, 5, 4), (2, 6, 4))],
                         ids=str)
def test_scaled_dot_product_attention(rng, mask, shapes):
    (qs, ks) = shapes
    q, tq = pair(rng, qs)
    k, tk = pair(rng, ks)
    v, tv = pair(rng, (*ks[:-1], 3))
    kw: dict = {}
    tkw: dict = {}
    if mask == "causal":
        kw = tkw = {"is_causal": True}
    elif mask == "bool":
        m = rng.random((qs[-2], ks[-2])) > 0.3
        m[:, 0] = True  # every query sees at least one key
        kw, tkw = {"attn_mask": dx.tensor(m)}, {"attn_mask": torch.from_numpy(m)}
    elif mask == "float":
        m, tm = pair(rng, (qs[-2], ks[-2]))
        kw, tkw = {"attn_mask": m}, {"attn_mask": tm}
    assert_same(F.scaled_dot_product_attention(q, k, v, **kw), TF.scaled_dot_product_attention(tq, tk, tv, **tkw),
                rtol=1e-5, atol=1e-5)
    assert_same(F.scaled_dot_product_attention(q, k, v, scale=0.3, **kw),
                TF.scaled_dot_product_attention(tq, tk, tv, scale=0.3, **tkw), rtol=1e-5, atol=1e-5)


def test_scaled_dot_product_attention_gradients(rng):
    arrays = [rng.standard_normal((2, 2, 5, 4)).astype(np.float32) for _ in range(3)]
    mine = [dx.tensor(a, requires_grad=True) for a in arrays]
    ref = [torch.tensor(a, requires_grad=True) for a in arrays]
    out = F.scaled_dot_product_attention(*mine, is_causal=True)
    tout = TF.scaled_dot_product_attention(*ref, is_causal=True)
    w = rng.standard_normal(tout.shape).astype(np.float32)
    (out * dx.tensor(w)).sum().backward()
    (tout * torch.from_numpy(w)).sum().backward()
    for a, t in zip(mine, ref, strict=True):
        np.testing.assert_allclose(a.grad.numpy(), t.grad.numpy(), rtol=1e-4, atol=1e-5)


def test_scaled_dot_product_attention_errors():
    q = dx.zeros(2, 5, 4)
    with pytest.raises(dx.DeepxError, match="do not match"):
        F.scaled_dot_product_attention(q, dx.zeros(2, 5, 3), dx.zeros(2, 5, 4))
    with pytest.raises(dx.DeepxError, match="either attn_mask or is_causal"):
        F.scaled_dot_product_attention(q, q, q, attn_mask=dx.ones(5, 5).bool(), is_causal=True)


def test_multinomial_frequencies_and_shapes():
    dx.manual_seed(3)
    p = np.array([[0.1, 0.2, 0.7, 0.0], [2.0, 2.0, 0.0, 0.0]], np.float32)  # weights need not sum to one
    draws = dx.tensor(p).multinomial(4000, replacement=True)
    assert draws.shape == (2, 4000) and draws.dtype == "int64"
    counts = np.stack([np.bincount(r, minlength=4) for r in draws.numpy()]) / 4000
    np.testing.assert_allclose(counts, p / p.sum(1, keepdims=True), atol=0.03)
    assert counts[0, 3] == 0 and counts[1, 2:].sum() == 0  # zero weight: never drawn
    one = dx.multinomial(dx.tensor(p[0]), 1)
    assert one.shape == (1,) and one.item() in (0, 1, 2)


def test_multinomial_without_replacement_draws_distinct_indices():
    dx.manual_seed(4)
    p = dx.tensor(np.full((50, 6), 1.0, np.float32))
    d = p.multinomial(6).numpy()
    assert d.shape == (50, 6)
    for row in d:
        assert sorted(row.tolist()) == list(range(6))
    firsts = np.bincount(d[:, 0], minlength=6)
    assert (firsts > 0).sum() >= 4  # uniform weights: the first draw varies


def test_multinomial_errors():
    with pytest.raises(dx.DeepxError, match="cannot draw 5 samples without replacement from 3"):
        dx.ones(3).multinomial(5)
    with pytest.raises(dx.DeepxError, match="must be 1-D or 2-D"):
        dx.ones(2, 2, 2).multinomial(1)
    with pytest.raises(dx.DeepxError, match="at least 1"):
        dx.ones(3).multinomial(0)
