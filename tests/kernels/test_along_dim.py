"""The ops that work along one dim (cumsum, gather, scatter, scatteradd, argsort, argtopk) against torch on the CPU,
for every dtype each claims: random shapes, every dim (negative ones too), ties, nan and signed zeros for the sorts, in
place and not, and the errors of a bad index."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kernel_ref import T, V, assert_close, assert_exact, dtypes_of, executor, f64, is_int, rand, run, run_op

from deepx_core.errors import DeepxError
from deepx_core.ir.dtypes import to_numpy

SHAPES = [(7,), (3, 5), (2, 3, 4), (4, 1, 6), (0, 3), (3, 0), (2, 65, 3)]


def _torch(a: np.ndarray) -> torch.Tensor:
    """`a` as torch holds it for a reference: floats in float64, integers in int64 (the kernels' accumulators)."""
    return torch.from_numpy(a.astype(np.int64) if is_int(str(a.dtype)) else f64(a))


# ---------------------------------------------------------------- cumsum


def _cumsum_ref(a: np.ndarray, dim: int, reverse: bool) -> np.ndarray:
    t = _torch(a)
    if a.ndim == 0:
        return t.numpy()
    return (t.flip(dim).cumsum(dim).flip(dim) if reverse else t.cumsum(dim)).numpy()


@pytest.mark.parametrize("dtype", dtypes_of("cumsum"))
def test_cumsum(dtype, rng):
    for shape in [*SHAPES, ()]:
        for dim in range(-max(len(shape), 1), max(len(shape), 1)):
            for reverse in (False, True):
                a = rand(rng, dtype, shape, -9, 9)
                got = run_op("cumsum", {"a": a}, [T("a", dtype), V(dim), V(reverse)])
                ref = _cumsum_ref(a, dim, reverse)
                scale = _cumsum_ref(np.abs(f64(a)), dim, reverse) if not is_int(dtype) else None
                assert_close(got, ref, dtype, scale=scale, what=f"cumsum {shape} dim={dim} reverse={reverse}")


@pytest.mark.parametrize("dtype", dtypes_of("cumsum"))
def test_cumsum_in_place_and_wrapping(dtype, rng):
    """C = A: the sums replace A; integers wrap as C casts do (an int8 running past 127)."""
    a = rand(rng, dtype, (4, 50), 0, 100)
    ref = _cumsum_ref(a, 1, False)
    ex = executor(a=a.copy())
    run(ex, "cumsum", [T("a", dtype), V(1)], [T("a", dtype)])
    want = ref.astype(a.dtype) if is_int(dtype) else ref  # wraps
    assert_close(ex.get("a"), want, dtype, scale=ref, what="cumsum in place")


def test_cumsum_of_float32_adds_in_float64_as_torch():
    """1 + 1e-8 + ... : float32 running sums that add in float32 would never move; torch's CPU kernel adds in
    float64 and rounds each sum, as deepx's does."""
    a = np.full(10001, 1e-8, dtype=np.float32)
    a[0] = 1.0
    got = run_op("cumsum", {"a": a}, [T("a"), V(0)])
    np.testing.assert_array_equal(got, torch.from_numpy(a).cumsum(0).numpy())
    assert got[-1] > 1.00009


# ---------------------------------------------------------------- cumprod


@pytest.mark.parametrize("dtype", dtypes_of("cumprod"))
def test_cumprod(dtype, rng):
    for shape in [*SHAPES, ()]:
        for dim in range(-max(len(shape), 1), max(len(shape), 1)):
            a = rand(rng, dtype, shape, -2, 2) if is_int(dtype) else rand(rng, dtype, shape, -1.3, 1.3)
            got = run_op("cumprod", {"a": a}, [T("a", dtype), V(dim)])
            t = _torch(a)
            ref = t.numpy() if a.ndim == 0 else t.cumprod(dim).numpy()
            scale = None if is_int(dtype) else np.maximum(np.abs(ref), 1e-3)
            assert_close(got, ref, dtype, scale=scale, what=f"cumprod {shape} dim={dim}")


@pytest.mark.parametrize("dtype", dtypes_of("cumprodgrad"))
@pytest.mark.parametrize("zeros", [0, 1, 3])
def test_cumprodgrad_matches_torch_with_and_without_zeros(dtype, zeros, rng):
    """torch's gradient of cumprod, zeros in the input included (the first of a slice gets its own formula)."""
    for shape, dim in [((7,), 0), ((3, 6), 1), ((4, 3, 5), 0), ((2, 9, 3), -2), ((), 0)]:
        a = rand(rng, dtype, shape, -1.5, 1.5)
        if zeros and a.size:
            a.reshape(-1)[rng.integers(0, a.size, zeros)] = 0
        g = rand(rng, dtype, shape, -1, 1)
        xt = torch.tensor(f64(a), requires_grad=True)
        (xt.cumprod(dim) if a.ndim else xt * 1).backward(torch.tensor(f64(g)))
        ex = executor(a=a, g=g)
        run(ex, "cumprodgrad", [T("a", dtype), T("g", dtype), V(dim)], [T("d", dtype)])
        want = xt.grad.numpy()
        assert_close(ex.get("d"), want, dtype, scale=np.full(want.shape, np.abs(want).max(initial=1.0)),
                     what=f"cumprodgrad {shape} dim={dim}")


def test_cumprod_of_float32_multiplies_in_float64_as_torch():
    a = np.full(2000, 1 + 1e-7, dtype=np.float32)
    got = run_op("cumprod", {"a": a}, [T("a"), V(0)])
    np.testing.assert_array_equal(got, torch.from_numpy(a).cumprod(0).numpy())


# ---------------------------------------------------------------- gather, scatter, scatteradd


def _index_case(rng, shape: tuple[int, ...], dim: int, unique: bool, index_dtype: str
                ) -> tuple[np.ndarray, tuple[int, ...]]:
    """An index for A of `shape` along dim: smaller than A outside dim now and then, longer along dim for gather;
    `unique`: no two elements of one line along dim point at the same place (scatter's writes then never collide)."""
    d = dim % len(shape)
    ishape = tuple(n if k == d or rng.random() < 0.6 else int(rng.integers(0, n + 1)) for k, n in enumerate(shape))
    size = shape[d]
    if unique:
        ishape = (*ishape[:d], int(rng.integers(0, size + 1)), *ishape[d + 1:])
        lines = np.moveaxis(np.zeros(ishape, dtype=np.int64), d, -1)
        for pos in np.ndindex(*lines.shape[:-1]):
            lines[pos] = rng.permutation(size)[:lines.shape[-1]]
        index = np.moveaxis(lines, -1, d)
    else:
        ishape = (*ishape[:d], int(rng.integers(0, 2 * size + 1)), *ishape[d + 1:])
        index = rng.integers(0, max(size, 1), ishape) if size else np.zeros(ishape, dtype=np.int64)
    return np.ascontiguousarray(index).astype(index_dtype), ishape


_ALONG_SHAPES = [(5,), (3, 4), (2, 3, 4), (4, 1, 3), (3, 5, 2, 2)]


def _positions(shape: tuple[int, ...]) -> torch.Tensor:
    """Each element's flat position: what torch moves, for a reference of any dtype (float8 and bool too)."""
    return torch.arange(int(np.prod(shape)), dtype=torch.int64).reshape(shape)


@pytest.mark.parametrize("index_dtype", ["int64", "int32"])
@pytest.mark.parametrize("dtype", dtypes_of("gather"))
def test_gather(dtype, index_dtype, rng):
    for shape in _ALONG_SHAPES:
        for dim in range(-len(shape), len(shape)):
            a = rand(rng, dtype, shape, -50, 50)
            index, _ = _index_case(rng, shape, dim, False, index_dtype)
            got = run_op("gather", {"a": a, "i": index}, [T("a", dtype), T("i", index_dtype), V(dim)], out="b")
            picked = torch.gather(_positions(shape), dim, torch.from_numpy(index).long()).numpy()
            assert_exact(got, a.reshape(-1)[picked], f"gather {shape} index{index.shape} dim={dim}")
    got = run_op("gather", {"a": np.array(2.5), "i": np.array(0)}, [T("a"), T("i"), V(-1)], out="b")  # 0-d
    assert got.shape == () and got == 2.5


@pytest.mark.parametrize("op", ["scatter", "scatteradd"])
@pytest.mark.parametrize("index_dtype", ["int64", "int32"])
def test_scatter_every_dtype(op, index_dtype, rng):
    for dtype in dtypes_of(op):
        for shape in _ALONG_SHAPES:
            for dim in range(-len(shape), len(shape)):
                a = rand(rng, dtype, shape, -20, 20)
                index, ishape = _index_case(rng, shape, dim, op == "scatter", index_dtype)
                src = rand(rng, dtype, ishape, -20, 20)
                got = run_op(op, {"a": a, "i": index, "s": src},
                             [T("a", dtype), T("i", index_dtype), T("s", dtype), V(dim)])
                what = f"{op} {shape} index{ishape} dim={dim}"
                ti = torch.from_numpy(index).long()
                if op == "scatter":
                    flat = _positions(shape).scatter(dim, ti, -1 - _positions(ishape)).reshape(-1).numpy()
                    want, written = a.reshape(-1).copy(), flat < 0
                    want[written] = src.reshape(-1)[-1 - flat[written]]
                    assert_exact(got, want.reshape(shape), what)
                else:
                    want = _torch(a).scatter_add(dim, ti, _torch(src)).numpy()
                    scale = _torch(np.abs(f64(a))).scatter_add(dim, ti, _torch(np.abs(f64(src)))).numpy()
                    assert_close(got, want, dtype, scale=None if is_int(dtype) else scale, what=what)


@pytest.mark.parametrize("op", ["scatter", "scatteradd"])
def test_scatter_in_place_and_into_its_source(op, rng):
    """C = A (in place) and C = src (the source read before C is written): torch's values either way."""
    a, src = rng.uniform(-3, 3, (3, 4)), rng.uniform(-3, 3, (3, 4))
    index = np.array([[0, 1, 2, 3]] * 3)[:, ::-1].copy()
    want = getattr(torch.from_numpy(a), "scatter" if op == "scatter" else "scatter_add")(
        1, torch.from_numpy(index), torch.from_numpy(src)).numpy()
    for out in ("a", "s"):
        ex = executor(a=a.copy(), i=index, s=src.copy())
        run(ex, op, [T("a"), T("i"), T("s"), V(1)], [T(out)])
        np.testing.assert_allclose(ex.get(out), want, rtol=1e-15, err_msg=f"{op} into '{out}'")


@pytest.mark.parametrize(("op", "args", "message"), [
    ("gather", [T("a"), T("i"), V(1)], r"gather: index 4 out of range for dim 1 of size 4 \(gather\('a', 'i', 1\)"),
    ("gather", [T("a"), T("n"), V(0)], r"gather: index -1 out of range for dim 0 of size 3 \(gather\('a', 'n', 0\)"),
    ("scatter", [T("a"), T("i"), T("s"), V(-1)], r"scatter: index 4 out of range for dim 1 of size 4 \(scatter\('a'"),
    ("scatteradd", [T("a"), T("n"), T("s"), V(0)], r"scatteradd: index -1 out of range for dim 0 of size 3"),
])
def test_an_index_out_of_range_names_the_op_and_its_tensors(op, args, message):
    ex = executor(a=np.zeros((3, 4)), i=np.array([[0, 4]]), n=np.array([[0, -1]]), s=np.ones((1, 2)))
    with pytest.raises(DeepxError, match=message):
        run(ex, op, args, [T("C")])
    assert "C" not in ex.tensors


@pytest.mark.parametrize(("op", "tensors", "args", "message"), [
    ("gather", {"a": (3, 4), "i": (3,)}, [T("a"), T("i"), V(0)], "gather: index 'i' has rank 1 but 'a' has rank 2"),
    ("gather", {"a": (3, 4), "i": (4, 2)}, [T("a"), T("i"), V(1)],
     r"gather: index 'i' of shape \[4, 2\] is larger than 'a' \[3, 4\] in dim 0; only dim 1 may be larger"),
    ("gather", {"a": (3, 4), "i": (3, 4)}, [T("a"), T("i"), V(2)], "gather: dim 2 out of range"),
    ("scatter", {"a": (3, 4), "i": (2, 2), "s": (2, 3)}, [T("a"), T("i"), T("s"), V(1)],
     r"scatter: source 's' has shape \[2, 3\] but index 'i' has \[2, 2\]"),
    ("scatteradd", {"a": (3, 4), "i": (2, 2), "s": (2, 2)}, [T("a"), T("i"), T("f"), V(1)],
     "scatteradd: dtypes float64 \\('a'\\) and float32 \\('f'\\) differ"),
])
def test_a_bad_shape_is_refused_before_running(op, tensors, args, message):
    arrays = {n: np.zeros(s, dtype=np.int64 if n == "i" else np.float64) for n, s in tensors.items()}
    arrays["f"] = np.zeros((2, 2), np.float32)
    with pytest.raises(DeepxError, match=message):
        run(executor(**arrays), op, args, [T("C")])


# ---------------------------------------------------------------- argsort, argtopk


def _sortable(rng, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    """Values with many ties (a small range), and for floats nan, infinities and both zeros among them."""
    a = rand(rng, dtype, shape, -3, 3)
    if not is_int(dtype) and a.size:
        a = np.round(f64(a) * 2) / 2
        flat = a.reshape(-1)
        for v in (np.nan, np.inf, -np.inf, -0.0, 0.0, np.nan):
            flat[int(rng.integers(0, flat.size))] = v
        a = a.astype(to_numpy(dtype))
    return a


@pytest.mark.parametrize("dtype", dtypes_of("argsort"))
def test_argsort_is_torch_s_stable_sort(dtype, rng):
    for shape in [*SHAPES, (3, 2100), ()]:
        for dim in range(-max(len(shape), 1), max(len(shape), 1)):
            for descending in (False, True):
                a = _sortable(rng, dtype, shape)
                got = run_op("argsort", {"a": a}, [T("a", dtype), V(dim), V(descending)], out="b")
                want = torch.sort(_torch(a), dim=dim, descending=descending, stable=True).indices.numpy()
                assert_exact(got, want, f"argsort {shape} dim={dim} descending={descending}")


@pytest.mark.parametrize("dtype", dtypes_of("argtopk"))
def test_argtopk_is_torch_s_topk(dtype, rng):
    """torch.topk's values; the indices are the first k of the stable sort (torch's own tie order is unsaid)."""
    for shape in [*SHAPES, (2, 3000), ()]:
        for dim in range(-max(len(shape), 1), max(len(shape), 1)):
            size = shape[dim] if shape else 1
            for k in sorted({0, min(1, size), size // 2, size}):
                for largest in (True, False):
                    a = _sortable(rng, dtype, shape)
                    got = run_op("argtopk", {"a": a}, [T("a", dtype), V(k), V(dim), V(largest)], out="b")
                    what = f"argtopk {shape} k={k} dim={dim} largest={largest}"
                    t = _torch(a)
                    order = torch.sort(t, dim=dim, descending=largest, stable=True).indices
                    assert_exact(got, order.narrow(dim, 0, k).numpy() if shape else order.numpy(), what)
                    values = torch.topk(t, k, dim=dim, largest=largest).values
                    picked = torch.gather(t, dim, torch.from_numpy(got)) if shape else t
                    assert_exact(picked.numpy(), values.numpy(), what)


def test_argtopk_refuses_k_past_the_dim():
    with pytest.raises(DeepxError, match=r"argtopk: k=5 is out of range for the 4 elements along dim 1 of 'a'"):
        run(executor(a=np.zeros((3, 4))), "argtopk", [T("a"), V(5), V(-1)], [T("b")])
    with pytest.raises(DeepxError, match=r"argtopk: k=-1 is out of range"):
        run(executor(a=np.zeros((3, 4))), "argtopk", [T("a"), V(-1), V(0)], [T("b")])
