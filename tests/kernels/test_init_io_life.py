"""Init (constant, arange, random fills, dropout), tensor files and print, tensor life and named variables."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import yaml
from kernel_ref import (
    VEC,
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
    run,
)

from deepx_core.errors import DeepxError
from deepx_core.ir.dtypes import STORABLE, to_numpy
from deepxd.kernels.cpu import CpuExecutor


def fresh(dtype: str, shape, **tensors: np.ndarray) -> CpuExecutor:
    """An executor holding tensor 't' (zeros of dtype and shape) and `tensors`."""
    return executor(t=np.zeros(shape, to_numpy(dtype)), **tensors)


# ---------------------------------------------------------------- constant, arange

INIT_SHAPES = [(2, 3, 4), (), (0,), (1, 5)]


@pytest.mark.parametrize("dtype", dtypes_of("constant"))
def test_constant(dtype):
    values = [1, 0] if dtype == "bool" else ([3, -7, 3.0] if is_int(dtype) else [2.5, -3, 0.1])
    for shape in INIT_SHAPES:
        for value in values:
            ex = fresh(dtype, shape)
            run(ex, "constant", [V(value)], [T("t", dtype)])
            want = np.full(shape, np.float64(value)).astype(to_numpy(dtype))
            assert_exact(ex.get("t"), want, f"constant {value!r} {shape}")


def test_constant_needs_an_existing_output():
    with pytest.raises(DeepxError, match="does not exist"):
        run(CpuExecutor(), "constant", [V(1)], [T("nothere", "float32")])


@pytest.mark.parametrize("dtype", dtypes_of("arange"))
def test_arange(dtype):
    cases = [(-3, 2), (5, -1), (0, 1)] if is_int(dtype) else [(0.5, 0.25), (1, -0.1), (-2.0, 3)]
    for shape in INIT_SHAPES:
        n = int(np.prod(shape))
        for start, step in cases:
            ex = fresh(dtype, shape)
            run(ex, "arange", [V(start), V(step)], [T("t", dtype)])
            want = (start + np.arange(n, dtype=np.float64) * step).reshape(shape)
            assert_close(ex.get("t"), want, dtype, what=f"arange start={start} step={step} {shape}")


@pytest.mark.parametrize("dtype", ["int32", "int8", "float32"])
def test_arange_int_and_float_scalars_agree(dtype):
    a = fresh(dtype, (3, 4))
    b = fresh(dtype, (3, 4))
    run(a, "arange", [V(2), V(3)], [T("t")])
    run(b, "arange", [V(2.0), V(3.0)], [T("t")])
    assert_exact(a.get("t"), b.get("t"), "arange var<int32> vs var<float32>")
    assert a.get("t").reshape(-1).tolist() == [2 + 3 * i for i in range(12)]


# ---------------------------------------------------------------- uniform, normal, dropout

BIG = (100, 1000)


@pytest.mark.parametrize("dtype", dtypes_of("uniform"))
def test_uniform(dtype):
    low, high = -1.5, 2.5
    ex = fresh(dtype, BIG)
    run(ex, "uniform", [V(low), V(high), V(42)], [T("t", dtype)])
    x = f64(ex.get("t"))
    assert ex.get("t").dtype == to_numpy(dtype)
    below, above = int((x < low).sum()), int((x >= high).sum())
    assert below == 0, f"uniform[{dtype}]: {below} of {x.size} values < low={low}"
    assert above == 0, f"uniform[{dtype}]: {above} of {x.size} values >= high={high} (U[low, high) excludes high)"
    assert abs(x.mean() - (low + high) / 2) < 0.02
    assert abs(x.std() - (high - low) / np.sqrt(12)) < 0.02
    # spread over the whole interval
    hist = np.histogram(x, bins=8, range=(low, high))[0] / x.size
    assert np.all(np.abs(hist - 1 / 8) < 0.01), hist


@pytest.mark.parametrize("dtype", dtypes_of("normal"))
def test_normal(dtype):
    mean, std = 1.5, 0.5
    ex = fresh(dtype, BIG)
    run(ex, "normal", [V(mean), V(std), V(7)], [T("t", dtype)])
    x = f64(ex.get("t"))
    assert abs(x.mean() - mean) < 0.01 * std * 3
    assert abs(x.std() - std) < 0.02 * std
    assert abs(np.mean(np.abs(x - mean) < std) - 0.6827) < 0.01  # the shape of a normal, not just its moments


@pytest.mark.parametrize("op", ["uniform", "normal"])
@pytest.mark.parametrize("dtype", ["float32", "float64", "bfloat16"])
def test_random_seeds(op, dtype):
    def draw(seed: int) -> np.ndarray:
        ex = fresh(dtype, (64,))
        run(ex, op, [V(0), V(1), V(seed)], [T("t")])
        return ex.get("t")

    assert_exact(draw(5), draw(5), f"{op}: same seed, same values")
    assert not np.array_equal(draw(5), draw(6)), f"{op}: different seeds gave the same values"
    assert not np.array_equal(draw(0), draw(0)), f"{op}: seed 0 must be random, two draws were equal"


@pytest.mark.parametrize("p", [0.3, 0.5, 0.9])
@pytest.mark.parametrize("dtype", dtypes_of("dropout"))
def test_dropout(dtype, p, rng):
    x = rand(rng, dtype, BIG, 1, 2)  # no zeros in the input: a zero in the output was dropped
    ex = executor(a=x.copy())
    buf = ex.get("a")
    run(ex, "dropout", [V(p), V(123)], [T("a", dtype)])
    y = ex.get("a")
    assert y is buf, "dropout works in place"
    dropped = y == 0
    assert abs(dropped.mean() - p) < 0.01, f"dropout p={p}: {dropped.mean():.4f} of elements zeroed"
    assert_close(y[~dropped], f64(x[~dropped]) / (1 - p), dtype, what=f"dropout p={p} kept values = x/(1-p)")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_dropout_seeds(dtype, rng):
    x = rand(rng, dtype, (2000,), 1, 2)

    def drop(seed: int, p: float = 0.5) -> np.ndarray:
        ex = executor(a=x.copy())
        run(ex, "dropout", [V(p), V(seed)], [T("a")])
        return ex.get("a")

    assert_exact(drop(9), drop(9), "dropout: same seed, same mask")
    assert not np.array_equal(drop(9) == 0, drop(10) == 0)
    assert not np.array_equal(drop(0) == 0, drop(0) == 0), "dropout: seed 0 must be random"
    assert_exact(drop(9, 0.0), x, "dropout p=0 changes nothing")
    assert_exact(drop(9, 0), x, "dropout p=0 (var<int32>) changes nothing")


@pytest.mark.parametrize("p", [-0.1, 1.5])
def test_dropout_refuses_p_outside_0_1(p):
    with pytest.raises(DeepxError, match="dropout"):
        run(executor(a=np.ones(4, np.float32)), "dropout", [V(p), V(1)], [T("a")])


@pytest.mark.parametrize("dtype", ["float64", "float32", "float16", "bfloat16"])
def test_dropout_p_1_drops_everything_as_torch(dtype):
    """torch's dropout with p=1 is input * 0: zeros, a NaN stays NaN."""
    x = np.array([1.5, -2.0, np.nan, 0.0], np.float64)
    ex = executor(a=x.astype(to_numpy(dtype)))
    run(ex, "dropout", [V(1), V(7)], [T("a")])
    want = torch.nn.functional.dropout(torch.from_numpy(x), p=1.0).numpy()
    np.testing.assert_array_equal(ex.get("a").astype(np.float64), want)


# ---------------------------------------------------------------- save, load, loadtensordata

ANY_DTYPES = ordered(STORABLE)


def _sample(rng, dtype, shape) -> np.ndarray:
    return rand(rng, dtype, shape, -50, 50)


@pytest.mark.parametrize("dtype", ANY_DTYPES)
def test_save_load_round_trip(dtype, tmp_path, rng):
    for i, shape in enumerate([(2, 3), (), (0, 4), (3, 1, 2)]):
        a = _sample(rng, dtype, shape)
        base = tmp_path / f"t{i}_{dtype}"
        ex = executor(a=a)
        run(ex, "save", [T("a", dtype), V(str(base))])
        doc = yaml.safe_load((tmp_path / f"{base.name}.shape").read_text())
        strides = [int(np.prod(shape[k + 1:])) for k in range(len(shape))]
        assert doc == {"dtype": dtype, "dim": len(shape), "shape": list(shape), "stride": strides,
                       "size": int(np.prod(shape))}, doc
        data = tmp_path / f"{base.name}.data"
        assert data.stat().st_size == a.size * to_numpy(dtype).itemsize
        assert data.read_bytes() == a.astype(to_numpy(dtype).newbyteorder("<")).tobytes()
        other = CpuExecutor()
        run(other, "load", [V(str(base))])
        assert set(other.tensors) == {base.name}
        assert_exact(other.get(base.name), a, f"load of a saved {dtype}{list(shape)}")


@pytest.mark.parametrize("dtype", ANY_DTYPES)
def test_load_written_by_hand(dtype, tmp_path, rng):
    """load reads a tensor file laid out as docs/deepxir.md section 5 says (keys in any order), not through save."""
    a = _sample(rng, dtype, (2, 3))
    (tmp_path / "w.shape").write_text(f"size: 6\nstride: [3, 1]\nshape: [2, 3]\ndim: 2\ndtype: {dtype}\n")
    (tmp_path / "w.data").write_bytes(a.astype(to_numpy(dtype).newbyteorder("<")).tobytes())
    ex = CpuExecutor()
    run(ex, "load", [V(str(tmp_path / "w"))])
    assert_exact(ex.get("w"), a, f"load of a hand-written {dtype} file")
    (tmp_path / "w.shape").write_text(f"dtype: {dtype}\nshape: [2, 3]\nstride: [1, 2]\nsize: 6\ndim: 2\n")
    with pytest.raises(DeepxError, match="stride"):
        run(ex, "load", [V(str(tmp_path / "w"))])


def test_load_names_the_tensor_after_the_whole_base_name(tmp_path):
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    base = tmp_path / "model.layers.0.weight"
    run(executor(a=a), "save", [T("a"), V(str(base))])
    ex = CpuExecutor()
    run(ex, "load", [V(str(base))])
    assert list(ex.tensors) == ["model.layers.0.weight"]
    assert_exact(ex.get("model.layers.0.weight"), a, "load by base name")
    run(ex, "load", [V(str(base))], [T("w")])
    assert_exact(ex.get("w"), a, "load into a named return")


def test_load_missing_file_raises(tmp_path):
    with pytest.raises(DeepxError, match="not found"):
        run(CpuExecutor(), "load", [V(str(tmp_path / "nothing"))])


@pytest.mark.parametrize("dtype", ANY_DTYPES)
def test_loadtensordata(dtype, tmp_path, rng):
    a = _sample(rng, dtype, (3, 4))
    path = tmp_path / "raw.bin"
    path.write_bytes(a.astype(to_numpy(dtype).newbyteorder("<")).tobytes())
    ex = fresh(dtype, (3, 4))
    run(ex, "loadtensordata", [V(str(path))], [T("t", dtype)])
    assert_exact(ex.get("t"), a, f"loadtensordata {dtype}")
    path.write_bytes(path.read_bytes()[:-1])
    with pytest.raises(DeepxError, match="bytes"):
        run(ex, "loadtensordata", [V(str(path))], [T("t", dtype)])


# ---------------------------------------------------------------- print


def _print(a: np.ndarray, fmt: str | None = None, name: str = "x") -> str:
    lines: list[str] = []
    ex = CpuExecutor(output=lines.append)
    ex.put(name, a)
    run(ex, "print", [T(name)] + ([V(fmt)] if fmt is not None else []))
    assert len(lines) == 1
    return lines[0]


def test_print_format():
    out = _print(np.array([1.5, -2.25, 1000.0], np.float32), "%.3f", name="weights")
    assert "weights" in out
    for s in ("1.500", "-2.250", "1000.000"):
        assert s in out, out
    out = _print(np.array([[7, -3], [12, 0]], np.int32), "%04d")
    for s in ("0007", "-003", "0012", "0000"):
        assert s in out, out


@pytest.mark.parametrize("dtype", ANY_DTYPES)
def test_print_every_dtype(dtype):
    values = [True, False] if dtype == "bool" else [1.5, -2.0, 3.0] if is_float(dtype) else [1, -2, 3]
    out = _print(np.array(values).astype(to_numpy(dtype)))
    assert dtype in out
    for v in values:
        assert str(v) in out or (isinstance(v, float) and f"{v:g}" in out), (v, out)


def test_print_bad_format_raises():
    with pytest.raises(DeepxError, match="format"):
        _print(np.ones(2, np.float32), "%q")


# ---------------------------------------------------------------- io roots


@pytest.fixture
def rooted(tmp_path):
    root = tmp_path / "root"
    outside = tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    os.symlink(outside, root / "link")
    ex = CpuExecutor(io_roots=[root])
    ex.put("a", np.arange(4, dtype=np.float32))
    return ex, root, outside


def test_io_roots_allow_inside(rooted):
    ex, root, _ = rooted
    run(ex, "save", [T("a"), V(str(root / "sub" / "a"))])
    run(ex, "load", [V(str(root / "sub" / "a"))], [T("b")])
    assert_exact(ex.get("b"), ex.get("a"), "load inside the io root")


@pytest.mark.parametrize("how", ["outside", "dotdot", "symlink"])
@pytest.mark.parametrize("op", ["save", "load", "loadtensordata"])
def test_io_roots_refuse_outside(rooted, op, how):
    ex, root, outside = rooted
    # a tensor file outside the root, so that load would succeed if the path were allowed
    ok = CpuExecutor()
    ok.put("a", np.arange(4, dtype=np.float32))
    run(ok, "save", [T("a"), V(str(outside / "a"))])
    path = {"outside": outside / "a", "dotdot": root / ".." / "outside" / "a", "symlink": root / "link" / "a"}[how]
    if op == "loadtensordata":
        path = path.with_name("a.data")
    before = sorted(p.name for p in outside.iterdir())
    with pytest.raises(DeepxError, match="outside"):
        if op == "save":
            run(ex, "save", [T("a"), V(str(path) + "_new")])
        elif op == "load":
            run(ex, "load", [V(str(path))], [T("b")])
        else:
            run(ex, "loadtensordata", [V(str(path))], [T("a")])
    assert sorted(p.name for p in outside.iterdir()) == before, "a refused save wrote a file"
    assert "b" not in ex.tensors
    assert_exact(ex.get("a"), np.arange(4, dtype=np.float32), "a refused loadtensordata changes nothing")


# ---------------------------------------------------------------- tensor life


def test_put_keeps_0d():
    """ex.put of a 0-d array must store a 0-d tensor (np.ascontiguousarray would make it shape (1,))."""
    ex = CpuExecutor()
    ex.put("s", np.array(2.5, np.float32))
    assert ex.get("s").shape == ()


@pytest.mark.parametrize("dtype", ANY_DTYPES)
def test_newtensor(dtype):
    ex = CpuExecutor()
    run(ex, "newtensor", [VEC([2, 3])], [T("a", dtype)])
    run(ex, "newtensor", [V("[3 4 5]")], [T("b", dtype)])
    run(ex, "newtensor", [VEC([])], [T("c", dtype)])
    run(ex, "newtensor", [VEC([0, 2])], [T("d", dtype)])
    for name, shape in [("a", (2, 3)), ("b", (3, 4, 5)), ("c", ()), ("d", (0, 2))]:
        assert_exact(ex.get(name), np.zeros(shape, to_numpy(dtype)), f"newtensor {name} {dtype}{list(shape)}")


def test_newtensor_defaults_and_existing_name():
    ex = CpuExecutor()
    run(ex, "newtensor", [VEC([2])], [T("a")])
    assert ex.get("a").dtype == np.float32
    ex.get("a")[:] = 5
    run(ex, "newtensor", [VEC([2])], [T("a", "float32")])  # the same shape and dtype: kept, with a warning
    assert_exact(ex.get("a"), np.full(2, 5, np.float32), "newtensor keeps an existing tensor of its shape and dtype")
    run(ex, "newtensor", [VEC([3, 3])], [T("a", "int8")])  # another shape and dtype: replaced (test_newtensor_replace)
    assert_exact(ex.get("a"), np.zeros((3, 3), np.int8), "newtensor replaces a tensor of another shape and dtype")
    run(ex, "newtensor", [V("2x3")], [T("b", "int16")])
    assert ex.get("b").shape == (2, 3) and ex.get("b").dtype == np.int16
    with pytest.raises(DeepxError, match="negative"):
        run(ex, "newtensor", [VEC([2, -1])], [T("c")])


@pytest.mark.parametrize("dtype", ANY_DTYPES)
def test_copytensor(dtype, rng):
    a = _sample(rng, dtype, (3, 4))
    ex = executor(a=a.copy(), d=np.zeros((3, 4), to_numpy(dtype)))
    dst = ex.get("d")
    run(ex, "copytensor", [T("a")], [T("d")])
    assert ex.get("d") is dst, "copying into an existing tensor keeps its buffer"
    assert_exact(ex.get("d"), a, "copytensor into an existing tensor")
    run(ex, "copytensor", [T("a")], [T("n")])
    assert_exact(ex.get("n"), a, "copytensor into a new tensor")
    ex.get("a")[...] = ex.get("a")[::-1].copy()
    assert_exact(ex.get("n"), a, "the copy is independent of the source")
    ex.put("z", np.zeros((4, 3), to_numpy(dtype)))
    with pytest.raises(DeepxError):
        run(ex, "copytensor", [T("a")], [T("z")])


def test_deltensor():
    ex = executor(a=np.zeros(3))
    run(ex, "deltensor", [], [T("a")])
    assert "a" not in ex.tensors
    with pytest.raises(DeepxError, match="not found"):
        run(ex, "deltensor", [], [T("a")])


def test_renametensor():
    a = np.arange(3.0)
    ex = executor(a=a.copy(), b=np.zeros(2))
    run(ex, "renametensor", [V("model.w")], [T("a")])
    assert "a" not in ex.tensors
    assert_exact(ex.get("model.w"), a, "renamed")
    with pytest.raises(DeepxError, match="exists"):
        run(ex, "renametensor", [V("b")], [T("model.w")])
    assert_exact(ex.get("model.w"), a, "a refused rename changes nothing")
    with pytest.raises(DeepxError, match="not found"):
        run(ex, "renametensor", [V("c")], [T("a")])


def test_argset_then_a_scalar_op_names_the_variable(rng):
    a = rand(rng, "float32", (2, 3))
    ex = executor(a=a.copy())
    run(ex, "argset", [V(2.5)], [V("myvar")])
    run(ex, "addscalar", [T("a"), V("myvar")], [T("c")])
    assert_close(ex.get("c"), f64(a) + 2.5, "float32", what="addscalar(a, myvar)")
    run(ex, "argset", [V(-3)], [V("myvar")])
    run(ex, "mulscalar", [T("a"), V("myvar")], [T("c")])
    assert_close(ex.get("c"), f64(a) * -3, "float32", what="mulscalar(a, myvar) after resetting myvar")
    with pytest.raises(DeepxError, match="argset"):
        run(ex, "addscalar", [T("a"), V("nosuchvar")], [T("c")])


def test_vecset_then_reshape_names_the_vector(rng):
    a = rand(rng, "int32", (2, 6))
    ex = executor(a=a.copy())
    run(ex, "vecset", [VEC([3, 4])], [VEC("myvec")])
    run(ex, "reshape", [T("a"), VEC("myvec")], [T("b")])
    assert_exact(ex.get("b"), a.reshape(3, 4), "reshape(a, myvec)")
    run(ex, "reshape", [T("a"), VEC("myvec")], [T("a")])
    assert_exact(ex.get("a"), a.reshape(3, 4), "reshape(a, myvec) in place")
    with pytest.raises(DeepxError, match="vecset"):
        run(ex, "reshape", [T("a"), VEC("novec")], [T("b")])
