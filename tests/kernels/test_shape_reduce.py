"""matmul, shape changes, gather/scatter and reductions against float64 numpy references."""

from __future__ import annotations

import numpy as np
import pytest
from kernel_ref import (
    VEC,
    L,
    T,
    V,
    assert_close,
    assert_exact,
    dtypes_of,
    executor,
    f64,
    is_float,
    is_int,
    ordered,
    rand,
    random_shape,
    run,
    run_op,
)

from deepx_core.errors import DeepxError
from deepx_core.ir.dtypes import INDEX, to_numpy


def values(rng, dtype: str, shape, lo: float = -50, hi: float = 50) -> np.ndarray:
    """Inputs for data-movement ops, where any value works (float8 included)."""
    return rand(rng, dtype, shape, lo, hi)


# ---------------------------------------------------------------- matmul

MATMUL_SHAPES = [
    ((3, 4), (4, 5)),
    ((1, 1), (1, 1)),
    ((0, 4), (4, 3)),
    ((3, 0), (0, 2)),
    ((2, 3, 4), (2, 4, 5)),
    ((2, 1, 3, 4), (5, 4, 2)),
    ((1, 3, 4), (2, 4, 6)),
    ((2, 3, 4), (4, 2)),
]


def _mm_inputs(rng, dtype, sa, sb):
    lo, hi = (-3, 3) if is_int(dtype) else (-1, 1)
    return rand(rng, dtype, sa, lo, hi), rand(rng, dtype, sb, lo, hi)


@pytest.mark.parametrize("dtype", dtypes_of("matmul"))
def test_matmul(dtype, rng):
    for sa, sb in MATMUL_SHAPES:
        a, b = _mm_inputs(rng, dtype, sa, sb)
        got = run_op("matmul", {"a": a, "b": b}, [T("a", dtype), T("b", dtype)])
        ref = np.matmul(f64(a), f64(b))
        assert_close(got, ref, dtype, scale=np.matmul(np.abs(f64(a)), np.abs(f64(b))), what=f"matmul {sa} @ {sb}")


@pytest.mark.parametrize("dtype", dtypes_of("matmul"))
def test_matmul_authors_agree(dtype, rng):
    """author=cblas / miaobyte / an unknown author all reach a kernel, with identical results."""
    a, b = _mm_inputs(rng, dtype, (2, 5, 7), (7, 3))
    results = {au: run_op("matmul", {"a": a, "b": b}, [T("a"), T("b")], author=au)
               for au in [None, "cblas", "miaobyte", "cublas", "unknownauthor", ""]}
    for au, got in results.items():
        assert_exact(got, results[None], f"matmul author={au!r}")
    assert_close(results["cblas"], np.matmul(f64(a), f64(b)), dtype,
                 scale=np.matmul(np.abs(f64(a)), np.abs(f64(b))), what="matmul cblas")


@pytest.mark.parametrize("where", ["C=A", "C=B"])
@pytest.mark.parametrize("dtype", dtypes_of("matmul"))
def test_matmul_in_place(dtype, where, rng):
    sa, sb = ((3, 4), (4, 4)) if where == "C=A" else ((4, 4), (4, 5))
    a, b = _mm_inputs(rng, dtype, sa, sb)
    ref, scale = np.matmul(f64(a), f64(b)), np.matmul(np.abs(f64(a)), np.abs(f64(b)))
    ex = executor(a=a, b=b)
    out = "a" if where == "C=A" else "b"
    run(ex, "matmul", [T("a"), T("b")], [T(out)])
    assert_close(ex.get(out), ref, dtype, scale=scale, what=f"matmul in place {where}")


def test_matmul_shape_mismatch_raises():
    with pytest.raises(DeepxError, match="do not match"):
        run_op("matmul", {"a": np.zeros((2, 3)), "b": np.zeros((4, 2))}, [T("a"), T("b")])


# ---------------------------------------------------------------- reshape, transpose, concat, broadcastTo, repeat

ANY_DTYPES = dtypes_of("reshape")


@pytest.mark.parametrize("dtype", ANY_DTYPES)
def test_reshape(dtype, rng):
    for shape, new, want in [((2, 3, 4), [4, -1], (4, 6)), ((0, 3), [3, 0], (3, 0)), ((), [1, 1], (1, 1)),
                             ((1,), [], ()), ((6,), [-1, 1, 2], (3, 1, 2)), ((2, 0), [-1, 5], (0, 5))]:
        if 0 in shape and -1 in new:
            continue  # -1 cannot be inferred next to a zero
        a = values(rng, dtype, shape)
        got = run_op("reshape", {"a": a}, [T("a", dtype), VEC(new)], out="b")
        assert_exact(got, a.reshape(want), f"reshape {shape} -> {new}")


@pytest.mark.parametrize("dtype", ANY_DTYPES)
def test_reshape_in_place(dtype, rng):
    a = values(rng, dtype, (2, 3, 4))
    ex = executor(a=a.copy())
    run(ex, "reshape", [T("a"), VEC([3, -1])], [T("a")])
    assert_exact(ex.get("a"), a.reshape(3, 8), "reshape in place")
    run(ex, "reshape", [T("a"), VEC([24])], [T("a")])
    assert_exact(ex.get("a"), a.reshape(24), "reshape in place again")


def test_reshape_refuses_wrong_count():
    with pytest.raises(DeepxError, match="cannot become"):
        run_op("reshape", {"a": np.zeros((2, 3))}, [T("a"), VEC([4, 2])], out="b")


@pytest.mark.parametrize("dtype", ANY_DTYPES)
def test_transpose(dtype, rng):
    for shape, perm in [((2, 3, 4), [2, 0, 1]), ((2, 3, 4), [-1, 0, 1]), ((0, 2), [1, 0]), ((), []),
                        ((1, 5), [1, 0]), ((2, 1, 3, 2), [3, 1, 0, 2])]:
        a = values(rng, dtype, shape)
        got = run_op("transpose", {"a": a}, [T("a", dtype), VEC(perm)])
        assert_exact(got, np.transpose(a, [p % max(a.ndim, 1) for p in perm]), f"transpose {shape} {perm}")


@pytest.mark.parametrize("shape", [(4, 4), (2, 3), (3, 3, 3)])
@pytest.mark.parametrize("dtype", ["float32", "int8", "bfloat16", "bool"])
def test_transpose_in_place(dtype, shape, rng):
    a = values(rng, dtype, shape)
    perm = list(range(a.ndim))[::-1]
    ex = executor(a=a.copy())
    run(ex, "transpose", [T("a"), VEC(perm)], [T("a")])
    assert_exact(ex.get("a"), np.transpose(a, perm), f"transpose in place {shape}")


@pytest.mark.parametrize("dtype", ANY_DTYPES)
def test_concat(dtype, rng):
    for shapes, dim in [([(2, 3), (4, 3), (0, 3)], 0), ([(2, 1, 3), (2, 4, 3)], -2), ([(3,)], 0),
                        ([(2, 2), (2, 0), (2, 1)], 1), ([(0, 2), (0, 2)], 0)]:
        arrays = [values(rng, dtype, s) for s in shapes]
        names = [f"t{i}" for i in range(len(arrays))]
        got = run_op("concat", dict(zip(names, arrays)), [L(names, dtype), V(dim)])
        assert_exact(got, np.concatenate(arrays, axis=dim), f"concat {shapes} dim={dim}")
    a = values(rng, dtype, (2, 3))
    got = run_op("concat", {"a": a}, [L(["a", "a"], dtype), V(1)])
    assert_exact(got, np.concatenate([a, a], axis=1), "concat [a a]")


@pytest.mark.parametrize("dtype", ANY_DTYPES)
def test_broadcast_to(dtype, rng):
    for shape, new in [((3, 1), (2, 3, 4)), ((), (2, 2)), ((1,), (0,)), ((2, 3), (2, 3)), ((1, 1), (1, 5))]:
        a = values(rng, dtype, shape)
        got = run_op("broadcastTo", {"a": a}, [T("a", dtype), VEC(new)], out="b")
        assert_exact(got, np.broadcast_to(a, new), f"broadcastTo {shape} -> {new}")
    with pytest.raises(DeepxError):
        run_op("broadcastTo", {"a": values(rng, dtype, (3, 2))}, [T("a"), VEC([3, 4])], out="b")


@pytest.mark.parametrize("dtype", ANY_DTYPES)
def test_repeat(dtype, rng):
    for shape, reps in [((2, 3), [2, 1]), ((2, 3), [1, 2, 3]), ((2, 3), [0, 2]), ((), [3]), ((0, 2), [2, 2]),
                        ((1,), [4])]:
        a = values(rng, dtype, shape)
        got = run_op("repeat", {"a": a}, [T("a", dtype), VEC(reps)], out="b")
        assert_exact(got, np.tile(a, reps), f"repeat {shape} x {reps}")


# ---------------------------------------------------------------- indexselect, indexadd


@pytest.mark.parametrize("index_dtype", ordered(INDEX))
@pytest.mark.parametrize("dtype", dtypes_of("indexselect"))
def test_indexselect(dtype, index_dtype, rng):
    for shape, ishape, axis in [((5, 4), (3,), 0), ((2, 5, 3), (2, 2), 1), ((2, 5, 3), (2, 2), -2),
                                ((4, 3), (0,), 1), ((5,), (), 0), ((3, 6), (7,), -1), ((0, 3), (2,), 1)]:
        a = values(rng, dtype, shape)
        ax = axis % a.ndim
        index = rng.integers(0, a.shape[ax], ishape).astype(to_numpy(index_dtype))
        got = run_op("indexselect", {"a": a, "i": index}, [T("a", dtype), T("i", index_dtype), V(axis)], out="b")
        want = np.take(a, index.astype(np.intp), axis=ax)
        assert got.shape == a.shape[:ax] + index.shape + a.shape[ax + 1:]
        assert_exact(got, want, f"indexselect {shape} index{ishape} axis={axis}")


@pytest.mark.parametrize("op", ["indexselect", "indexadd", "indexcopy"])
def test_index_out_of_range_raises(op):
    a = np.zeros((4, 3), np.float32)
    for bad in (4, -1):
        i = np.array([0, bad], np.int64)
        with pytest.raises(DeepxError, match=f"{op}: index {bad} out of range"):
            if op == "indexselect":
                run_op(op, {"a": a, "i": i}, [T("a"), T("i"), V(0)], out="b")
            else:
                run_op(op, {"a": a, "i": i, "s": np.ones((2, 3), np.float32)}, [T("a"), T("i"), T("s"), V(0)])


INDEXADD_CASES = [((6, 4), (10,), 0), ((3, 5, 2), (7,), 1), ((3, 4), (2, 3), -1), ((5,), (9,), 0),
                  ((4, 3), (0,), 0), ((2, 3, 4), (6,), -1)]


def _indexadd_ref(a, index, src, axis):
    ax = axis % a.ndim
    flat = index.reshape(-1).astype(np.intp)
    src2 = f64(src).reshape(*a.shape[:ax], flat.size, *a.shape[ax + 1:])
    ref, mag = f64(a).copy(), np.abs(f64(a))
    np.add.at(ref, (slice(None),) * ax + (flat,), src2)
    np.add.at(mag, (slice(None),) * ax + (flat,), np.abs(src2))
    return ref, mag


@pytest.mark.parametrize("shape,ishape,axis", INDEXADD_CASES, ids=[f"{c[0]}-index{c[1]}-axis{c[2]}".replace(" ", "")
                                                                    for c in INDEXADD_CASES])
@pytest.mark.parametrize("index_dtype", ordered(INDEX))
@pytest.mark.parametrize("dtype", dtypes_of("indexadd"))
def test_indexadd(dtype, index_dtype, shape, ishape, axis, rng):
    """Repeated indices accumulate: compared with np.add.at in float64."""
    for in_place in (False, True):
        if True:
            ax = axis % len(shape)
            a = rand(rng, dtype, shape, -3, 3)
            index = rng.integers(0, shape[ax], ishape).astype(to_numpy(index_dtype))
            src = rand(rng, dtype, shape[:ax] + ishape + shape[ax + 1:], -3, 3)
            ref, mag = _indexadd_ref(a, index, src, axis)
            ex = executor(a=a.copy(), i=index, s=src)
            out = "a" if in_place else "c"
            run(ex, "indexadd", [T("a", dtype), T("i", index_dtype), T("s", dtype), V(axis)], [T(out, dtype)])
            what = f"indexadd {shape} index{ishape} axis={axis} {'in place' if in_place else ''}"
            assert_close(ex.get(out), ref, dtype, scale=mag, what=what)
            if not in_place:
                assert_exact(ex.get("a"), a, "indexadd must not change A when C is another tensor")


INDEXCOPY_CASES = [((6, 4), (3,), 0), ((3, 5, 2), (4,), 1), ((3, 4), (2,), -1), ((5,), (5,), 0), ((4, 3), (0,), 0),
                   ((2, 3, 4), (1,), -1), ((1, 2, 8, 4), (1,), 2)]


@pytest.mark.parametrize("shape,ishape,axis", INDEXCOPY_CASES, ids=[f"{c[0]}-index{c[1]}-axis{c[2]}".replace(" ", "")
                                                                      for c in INDEXCOPY_CASES])
@pytest.mark.parametrize("index_dtype", ordered(INDEX))
@pytest.mark.parametrize("dtype", dtypes_of("indexcopy"))
def test_indexcopy(dtype, index_dtype, shape, ishape, axis, rng):
    """Distinct indices (which write wins on a repeat is unsaid): numpy's assignment through the index, exactly, in
    place and into another tensor."""
    ax = axis % len(shape)
    for in_place in (False, True):
        a = values(rng, dtype, shape)
        index = rng.permutation(shape[ax])[:ishape[0]].astype(to_numpy(index_dtype))
        src = values(rng, dtype, shape[:ax] + ishape + shape[ax + 1:])
        want = a.copy()
        want[(slice(None),) * ax + (index.astype(np.intp),)] = src
        ex = executor(a=a.copy(), i=index, s=src)
        out = "a" if in_place else "c"
        run(ex, "indexcopy", [T("a", dtype), T("i", index_dtype), T("s", dtype), V(axis)], [T(out, dtype)])
        assert_exact(ex.get(out), want, f"indexcopy {shape} index{ishape} axis={axis} {'in place' if in_place else ''}")
        if not in_place:
            assert_exact(ex.get("a"), a, "indexcopy must not change A when C is another tensor")


def test_indexcopy_refuses_a_source_of_another_shape():
    with pytest.raises(DeepxError, match=r"indexcopy: source 's' has shape \(2, 2\), expected \(2, 3\)"):
        run_op("indexcopy", {"a": np.zeros((4, 3), np.float32), "i": np.array([0, 1]),
                             "s": np.ones((2, 2), np.float32)}, [T("a"), T("i"), T("s"), V(0)])


@pytest.mark.parametrize("case", ["indexadd-axis0", "indexadd-axis1", "sum", "matmul"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_low_precision_accumulates_wide(dtype, case, rng):
    """4096 terms ~1 into one element: deepx computes low precision in float32 and rounds once, so the result is
    within an ulp or two of the exact sum (accumulating in the storage dtype stalls: bfloat16 near 256-512,
    float16 at 2048)."""
    n = 4096
    if case.startswith("indexadd"):
        axis = int(case[-1])
        shape = (2, 3) if axis == 0 else (3, 2)
        a = np.ones(shape, to_numpy(dtype))
        index = np.zeros(n, np.int64)
        src = rand(rng, dtype, (n, shape[1]) if axis == 0 else (shape[0], n), 0.9, 1.1)
        ref, _ = _indexadd_ref(a, index, src, axis)
        got = run_op("indexadd", {"a": a, "i": index, "s": src}, [T("a"), T("i"), T("s"), V(axis)])
    elif case == "sum":
        a = rand(rng, dtype, (3, n), 0.9, 1.1)
        ref = f64(a).sum(axis=1)
        got = run_op("sum", {"a": a}, [T("a"), VEC([1])], out="b")
    else:
        a, b = rand(rng, dtype, (2, n), 0.9, 1.1), rand(rng, dtype, (n, 3), 0.9, 1.1)
        ref = f64(a) @ f64(b)
        got = run_op("matmul", {"a": a, "b": b}, [T("a"), T("b")])
    assert_close(got, ref, dtype, what=f"{case}: {n} terms into one element")


# ---------------------------------------------------------------- slice, sliceassign, pad

SLICES = [
    ((5, 6), [-4, 1], [-1, 6], [2, 2]),
    ((5, 6), [0, 0], [100, 100], [1, 3]),
    ((5, 6), [-100, 4], [2, 2], [1, 1]),  # the second dim is empty (start > end)
    ((7,), [1], [-1], [3]),
    ((0, 3), [0, 1], [0, 3], [1, 1]),
    ((2, 3, 4), [1, -3, 0], [2, 3, 4], [1, 1, 2]),
    ((), [], [], []),
]


@pytest.mark.parametrize("dtype", dtypes_of("slice"))
def test_slice(dtype, rng):
    for shape, starts, ends, steps in SLICES:
        a = values(rng, dtype, shape)
        got = run_op("slice", {"a": a}, [T("a", dtype), VEC(starts), VEC(ends), VEC(steps)], out="b")
        want = a[tuple(slice(b, e, s) for b, e, s in zip(starts, ends, steps))]
        assert_exact(got, want.copy(), f"slice {shape} {starts}:{ends}:{steps}")


def test_slice_refuses_nonpositive_step():
    with pytest.raises(DeepxError, match="positive"):
        run_op("slice", {"a": np.zeros(4)}, [T("a"), VEC([0]), VEC([4]), VEC([0])], out="b")


@pytest.mark.parametrize("dtype", dtypes_of("sliceassign"))
def test_sliceassign(dtype, rng):
    for in_place in (False, True):
        for shape, starts, ends, steps in SLICES:
            a = values(rng, dtype, shape)
            sl = tuple(slice(b, e, s) for b, e, s in zip(starts, ends, steps))
            region = a[sl].shape
            for vshape in {region, (1,) * len(region), region[1:]}:
                v = values(rng, dtype, vshape)
                want = a.copy()
                want[sl] = v
                ex = executor(a=a.copy(), v=v)
                out = "a" if in_place else "c"
                run(ex, "sliceassign", [T("a", dtype), VEC(starts), VEC(ends), VEC(steps), T("v", dtype)],
                    [T(out, dtype)])
                assert_exact(ex.get(out), want, f"sliceassign {shape} {starts}:{ends}:{steps} value{vshape}")
                if not in_place:
                    assert_exact(ex.get("a"), a, "sliceassign must not change A when C is another tensor")


@pytest.mark.parametrize("dtype", dtypes_of("pad"))
def test_pad(dtype, rng):
    fill = 1 if dtype == "bool" or is_int(dtype) else 1.5
    for shape, pads, value in [((2, 3), [1, 0, 2, 1], 0), ((2, 3), [0, 2, 0, 0], fill), ((), [], fill),
                               ((0, 2), [1, 1, 0, 0], fill), ((3,), [0, 0], 7 if dtype != "bool" else 0),
                               ((1, 2, 1), [1, 1, 0, 1, 2, 0], fill)]:
        a = values(rng, dtype, shape)
        out_shape = tuple(d + pads[2 * i] + pads[2 * i + 1] for i, d in enumerate(shape))
        want = np.full(out_shape, value).astype(to_numpy(dtype))
        want[tuple(slice(pads[2 * i], pads[2 * i] + d) for i, d in enumerate(shape))] = a
        got = run_op("pad", {"a": a}, [T("a", dtype), VEC(pads), V(value)], out="b")
        assert_exact(got, want, f"pad {shape} {pads} value={value}")


# ---------------------------------------------------------------- reductions

REDUCE = {"sum": np.sum, "prod": np.prod, "reducemax": np.max, "reducemin": np.min}
DIMS = [[], [0], [-1], [0, 2], [-3, -1], [0, 1, 2], [1]]


def _reduce_input(rng, op: str, dtype: str, shape) -> np.ndarray:
    if op == "prod":
        if is_int(dtype):
            x = rng.choice([-1, 1], size=shape)
            x.reshape(-1)[::7] = 2
            return x.astype(to_numpy(dtype))
        return (rng.uniform(0.5, 1.5, shape) * rng.choice([-1, 1], shape)).astype(to_numpy(dtype))
    if is_int(dtype):
        return rand(rng, dtype, shape, -3 if dtype == "int8" else -100, 3 if dtype == "int8" else 100)
    return rand(rng, dtype, shape)


def _reduce_ref(op: str, a: np.ndarray, dims, keepdims: bool):
    axis = tuple(d % a.ndim for d in dims) if dims else None
    x = f64(a)
    ref = REDUCE[op](x, axis=axis, keepdims=keepdims)
    scale = None
    if op == "sum":
        scale = np.sum(np.abs(x), axis=axis, keepdims=keepdims)
    return ref, scale


@pytest.mark.parametrize("op,dtype", [pytest.param(o, d, id=f"{o}-{d}") for o in REDUCE for d in dtypes_of(o)])
def test_reduce(op, dtype, rng):
    cases = [((2, 3, 4), d) for d in DIMS] + [((), []), ((1, 5), [0]), ((5,), [0]), ((3, 1), [-1])]
    if op in ("sum", "prod"):
        cases += [((0, 3), [0]), ((0, 3), []), ((2, 0), [1]), ((0, 3), [1])]
    for _ in range(4):
        shape = random_shape(rng, 4)
        dims = [int(d) - len(shape) * int(rng.integers(0, 2)) for d in range(len(shape)) if rng.random() < 0.5]
        if op in ("sum", "prod") or all(shape[d] for d in (dims or range(len(shape)))):
            cases.append((shape, dims))
    for shape, dims in cases:
        a = _reduce_input(rng, op, dtype, shape)
        for keepdims in (False, True):
            ref, scale = _reduce_ref(op, a, dims, keepdims)
            got = run_op(op, {"a": a}, [T("a", dtype), VEC(dims), V(keepdims)], out="b")
            assert_close(got, ref, dtype, scale=scale, what=f"{op} {shape} dims={dims} keepdims={keepdims}")


def test_reduce_default_keepdims_is_false(rng):
    a = rng.standard_normal((2, 3))
    got = run_op("sum", {"a": a}, [T("a"), VEC([1])], out="b")
    assert_close(got, np.sum(a, axis=1), "float64")


@pytest.mark.parametrize("op", ["reducemax", "reducemin", "argmax", "argmin"])
def test_reduce_empty_dim_raises(op):
    a = np.zeros((0, 3), np.float32)
    with pytest.raises(DeepxError, match="empty"):
        if op.startswith("arg"):
            run_op(op, {"a": a}, [T("a"), V(0)], out="b")
        else:
            run_op(op, {"a": a}, [T("a"), VEC([0])], out="b")


@pytest.mark.parametrize("op,dtype", [pytest.param(o, d, id=f"{o}-{d}") for o in ("argmax", "argmin")
                                      for d in dtypes_of(o)])
def test_argreduce(op, dtype, rng):
    f = np.argmax if op == "argmax" else np.argmin
    for shape, dim in [((3, 5), 0), ((3, 5), 1), ((3, 5), -1), ((2, 3, 4), 1), ((2, 3, 4), -3), ((1,), 0),
                       ((0, 3), 1), ((4, 1), 1)]:
        # few distinct values, so that ties are common: the first index must win
        x = rng.integers(-2, 3, shape)
        a = (x * 0.5).astype(to_numpy(dtype)) if is_float(dtype) else x.astype(to_numpy(dtype))
        for keepdims in (False, True):
            got = run_op(op, {"a": a}, [T("a", dtype), V(dim), V(keepdims)], out="b")
            want = f(f64(a), axis=dim, keepdims=keepdims).astype(np.int64)
            assert_exact(got, want, f"{op}[{dtype}] {shape} dim={dim} keepdims={keepdims}")
    a = np.array(3, dtype=to_numpy(dtype))
    assert_exact(run_op(op, {"a": a}, [T("a"), V(0)], out="b"), np.array(0, np.int64), f"{op} of a 0-d tensor")
