"""Cases a review found: each was a crash, a hang or a wrong result."""

from __future__ import annotations

import numpy as np
import pytest

from deepx_core.errors import DeepxError
from deepx_core.ir import Instr, Param
from deepxd.kernels.cpu import CpuExecutor


def T(name: str, dtype: str | None = None) -> Param:
    return Param.tensor(name, dtype)


def V(value, dtype: str | None = None) -> Param:
    return Param.var(value, dtype)


@pytest.fixture
def ex() -> CpuExecutor:
    e = CpuExecutor()
    e.put("a", np.arange(6, dtype=np.float32).reshape(2, 3))
    e.put("s", np.array(3.0, np.float32))
    return e


@pytest.mark.parametrize("low, high, dtype", [(0.0, 1e39, "float32"), (0.0, float("inf"), "float32"),
                                               (-1e5, 1e5, "float16")])
def test_uniform_refuses_ranges_the_dtype_cannot_hold(ex, low, high, dtype):
    ex.run(Instr("newtensor", (Param.vector([100]),), (T("u", dtype),)))
    with pytest.raises(DeepxError, match="uniform"):
        ex.run(Instr("uniform", (V(low), V(high), V(1)), (T("u"),)))


def test_uniform_on_a_range_with_no_value_inside_is_refused(ex):
    ex.run(Instr("newtensor", (Param.vector([1000]),), (T("u", "bfloat16"),)))
    with pytest.raises(DeepxError, match=r"has .almost. no values in"):
        ex.run(Instr("uniform", (V(1.005), V(1.006), V(1)), (T("u"),)))


@pytest.mark.parametrize("instr", [
    Instr("concat", (Param.listtensor(["s", "s"]), V(0)), (T("c"),)),
    Instr("reducemax", (T("s"), Param.vector([0]), V(False)), (T("c"),)),
    Instr("sum", (T("s"), Param.vector([0]), V(False)), (T("c"),)),
    Instr("indexselect", (T("s"), T("i"), V(0)), (T("c"),)),
])
def test_dims_of_a_rank_0_tensor_are_refused(ex, instr):
    ex.put("i", np.array([0], np.int64))
    with pytest.raises(DeepxError, match="rank 0"):
        ex.run(instr)


def test_rank_0_reductions_over_all_dims_and_softmax_work(ex):
    ex.run(Instr("sum", (T("s"), Param.vector([]), V(False)), (T("c"),)))
    assert ex.get("c").shape == () and ex.get("c") == 3
    ex.run(Instr("softmax", (T("s"), V(-1)), (T("c"),)))
    assert ex.get("c") == 1


def test_newtensor_with_a_number_for_shape(ex):
    ex.run(Instr("newtensor", (V(5),), (T("n", "float32"),)))
    assert ex.get("n").shape == (5,)


@pytest.mark.parametrize("name, extra, message", [
    ("adam", {"step": 0}, "step=0 must count from 1"),
    ("adamw", {"beta1": 1.0}, "beta1=1.0 must be in"),
    ("adam", {"lr": -1.0}, "lr=-1.0 must be >= 0"),
])
def test_optimizer_hyper_parameters_are_checked(ex, name, extra, message):
    for n in ("p", "g", "m", "v"):
        ex.put(n, np.ones(3, np.float32))
    hp = {"lr": 0.1, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.0, "step": 1, **extra}
    args = (T("p"), T("g"), T("m"), T("v"), *(V(hp[k]) for k in ("lr", "beta1", "beta2", "eps", "weight_decay",
                                                                  "step")))
    with pytest.raises(DeepxError, match=message):
        ex.run(Instr(name, args, (T("p"), T("m"), T("v"))))


def test_an_instr_built_with_lists_runs(ex):
    ex.run(Instr("add", [T("a"), T("a")], [T("c")]))  # type: ignore[arg-type]
    np.testing.assert_array_equal(ex.get("c"), 2 * ex.get("a"))


def test_in_place_forms_read_before_they_write(ex):
    a = ex.get("a").copy()
    ex.run(Instr("pad", (T("a"), Param.vector([0, 0, 0, 0]), V(7)), (T("a"),)))
    np.testing.assert_array_equal(ex.get("a"), a)
    ex.put("v", a + 100)
    ex.run(Instr("sliceassign", (T("a"), Param.vector([0, 0]), Param.vector([2, 3]), Param.vector([1, 1]), T("v")),
                 (T("v"),)))
    np.testing.assert_array_equal(ex.get("v"), a + 100)
    ex.put("src", a + 100)
    ex.put("ix", np.array([0, 1], np.int64))
    ex.run(Instr("indexadd", (T("a"), T("ix"), T("src"), V(0)), (T("src"),)))
    np.testing.assert_array_equal(ex.get("src"), 2 * a + 100)
    ex.put("ix", np.array([1, 0], np.int64))
    ex.run(Instr("indexselect", (T("a"), T("ix"), V(0)), (T("a"),)))
    np.testing.assert_array_equal(ex.get("a"), a[[1, 0]])


@pytest.mark.parametrize("keepdims", [False, True])
def test_integer_reductions_wrap_the_same_way_with_and_without_keepdims(ex, keepdims):
    ex.put("q", np.full(4, 1000, np.int32))
    ex.run(Instr("prod", (T("q"), Param.vector([]), V(keepdims)), (T("r"),)))
    assert int(ex.get("r").reshape(-1)[0]) == np.array(1000**4, np.int64).astype(np.int32)


def test_benchmark_repeat_zero_still_runs_once(ex):
    ex.run(Instr("add", (T("a"), T("a")), (T("c"),), (("benchmark.repeat", "0"),)))
    np.testing.assert_array_equal(ex.get("c"), 2 * ex.get("a"))


def test_untyped_numeric_return_names_are_strings(ex):
    ex.run(Instr("add", (T("a"), T("a")), (Param("", (), 7),)))
    assert ex.get("7").shape == (2, 3)


def test_a_failed_sgd_step_changes_nothing(ex):
    ex.put("p", np.ones(3, np.float64))
    ex.put("g", np.ones(3, np.float64))
    ex.put("b", np.full(3, 5.0))
    with pytest.raises(DeepxError):
        ex.run(Instr("sgd", (T("p"), T("g"), T("b"), V(10**400), V(0.9), V(0.0), V(0.0), V(False), V(2)),
                     (T("p"), T("b"))))
    np.testing.assert_array_equal(ex.get("b"), 5.0)
    np.testing.assert_array_equal(ex.get("p"), 1.0)


def test_the_bind_cache_keeps_scalars_that_python_calls_equal_apart(ex):
    ex.put("u", np.ones(2, np.float32))
    ex.run(Instr("mulscalar", (T("u"), V(0.0, "float32")), (T("z"),)))
    ex.run(Instr("mulscalar", (T("u"), V(-0.0, "float32")), (T("z"),)))
    assert np.signbit(ex.get("z")).all()
    ex.put("big", np.array([2**53 + 1], np.int64))
    ex.run(Instr("addscalar", (T("big"), V(1.0, "float32")), (T("r"),)))
    ex.run(Instr("addscalar", (T("big"), V(1, "float32")), (T("r"),)))
    assert int(ex.get("r")[0]) == 2**53 + 2


def test_the_bind_cache_ignores_metadata_and_sees_shape_changes(ex):
    i1 = Instr("add", (T("a"), T("a")), (T("c"),), (("created_at", "1.0"),))
    i2 = i1._replace(meta=(("created_at", "2.0"),))
    ex.run(i1)
    ex.run(i1)
    ex.run(i2)
    assert len(ex.plans._plans) == 1
    ex.put("a", np.ones((3, 3), np.float32))
    with pytest.raises(DeepxError, match="output 'c' has shape"):
        ex.run(i2)
    ex.run(Instr("deltensor", (), (T("c"),)))
    ex.run(i2)
    assert ex.get("c").shape == (3, 3)


def test_sigmoid_and_silu_keep_their_tails(ex):
    ex.put("x", np.array([-20.0, 20.0], np.float32))
    ex.run(Instr("sigmoid", (T("x"),), (T("y"),)))
    np.testing.assert_allclose(ex.get("y"), [2.0611537e-09, 1.0], rtol=1e-6)
    ex.put("x64", np.array([-40.0], np.float64))
    ex.run(Instr("silu", (T("x64"),), (T("y64"),)))
    np.testing.assert_allclose(ex.get("y64"), [-40.0 / (1 + np.exp(40.0))], rtol=1e-12)


def test_numpy_scalars_are_accepted(ex):
    ex.run(Instr("mulscalar", (T("a"), V(np.float32(0.5), "float32")), (T("c"),)))
    ex.run(Instr("addscalar", (T("c"), V(np.int64(1), "int32")), (T("c"),)))
    np.testing.assert_allclose(ex.get("c"), ex.get("a") * 0.5 + 1)


def test_the_tensor_table_stays_in_step(ex):
    with pytest.raises(DeepxError):
        ex.tensors["u8"] = np.zeros(2, np.uint8)
    assert "u8" not in ex.tensors and "u8" not in ex.tensors.metas
    ex.tensors |= {"k": np.zeros(4, np.int32)}
    assert ex.meta("k") == ((4,), "int32")
    mine = np.zeros(6, np.float32)
    ex.put("mine", mine)
    mine.shape = (2, 3)
    assert ex.get("mine").shape == (6,) and ex.meta("mine").shape == (6,)


def test_out_of_range_integer_scalars_wrap_like_c(ex):
    ex.put("i8", np.array([1, 2], np.int8))
    ex.run(Instr("addscalar", (T("i8"), V(300)), (T("o"),)))
    np.testing.assert_array_equal(ex.get("o"), (np.array([1, 2]) + 300).astype(np.int8))
    ex.run(Instr("lessscalar", (T("i8"), V(300)), (T("lt"),)))
    assert ex.get("lt").all()
    ex.run(Instr("constant", (V(300),), (T("i8"),)))
    np.testing.assert_array_equal(ex.get("i8"), np.array(300).astype(np.int8))


@pytest.mark.parametrize("value, message", [
    ("100000000", r"mulscalar: benchmark.repeat=100000000 is more runs than one instruction may ask for \(at most "
                  r"10000\)"),
    ("-1", r"mulscalar: benchmark.repeat=-1 is negative"),
    ("abc", r"mulscalar: benchmark.repeat='abc' is not a whole number of runs"),
    ("2.5", r"mulscalar: benchmark.repeat='2.5' is not a whole number of runs"),
    ("", r"mulscalar: benchmark.repeat='' is not a whole number of runs"),
])
def test_a_benchmark_repeat_count_out_of_range_is_refused_before_anything_runs(ex, value, message):
    """An unbounded count held the daemon's event loop (a hundred million runs of a small op); -1 and abc ran once."""
    with pytest.raises(DeepxError, match=message):
        ex.run(Instr("mulscalar", (T("a"), V(2)), (T("m"),), (("benchmark.repeat", value),)))
    assert "m" not in ex.tensors


def test_a_benchmark_repeat_count_at_the_limit_runs(ex):
    from deepxd.kernels.cpu import MAX_REPEAT

    ex.run(Instr("addscalar", (T("a"), V(1)), (T("a"),), (("benchmark.repeat", str(MAX_REPEAT)),)))
    np.testing.assert_array_equal(ex.get("a"), np.arange(6, dtype=np.float32).reshape(2, 3) + MAX_REPEAT)


@pytest.mark.parametrize("instr, message", [
    (Instr("constant", (V(float("inf")),), (T("i"),)), "constant: value inf does not fit int32 (constant(inf) -> 'i')"),
    (Instr("constant", (V(float("nan")),), (T("i"),)), "constant: value nan does not fit int32 (constant(nan) -> 'i')"),
    (Instr("addscalar", (T("i"), V(10**23)), (T("i"),)),
     f"addscalar: value {10**23} does not fit int32 (addscalar('i', {10**23}) -> 'i')"),
    (Instr("addscalar", (T("i"), V(10**23)), (T("j"),)),
     f"addscalar: value {10**23} does not fit int32 (addscalar('i', {10**23}) -> 'j')"),
])
def test_kernel_failures_name_the_problem_and_the_tensors_not_the_python_class(ex, instr, message):
    """They read 'constant: OverflowError: cannot convert float infinity to integer (in constant of [None])'."""
    ex.put("i", np.ones(4, np.int32))
    with pytest.raises(DeepxError) as e:
        ex.run(instr)
    assert str(e.value) == message
    assert "Error" not in str(e.value) and "None" not in str(e.value)


def test_a_known_programs_kernel_failure_reads_the_same(ex):
    """explain_failure (a prepared step's exception) words it as execute does."""
    ex.put("i", np.ones(4, np.int32))
    b = ex.plans.bind(Instr("addscalar", (T("i"), V(10**23)), (T("i"),)), ex)
    with pytest.raises(Exception) as raw:
        ex.prepare(b)()
    with pytest.raises(DeepxError, match=r"^addscalar: value 10+ does not fit int32 \(addscalar\('i', 10+\) -> 'i'\)$"):
        ex.explain_failure(b, raw.value)


@pytest.mark.parametrize("new", ["a b", "x\ny", "a,b", "t->u", "[q]", "f(x)", ""])
def test_renametensor_refuses_a_name_that_deepxir_text_cannot_write(ex, new):
    with pytest.raises(DeepxError, match="renametensor: "):
        ex.run(Instr("renametensor", (V(new, "string"),), (T("a"),)))
    assert "a" in ex.tensors and new not in ex.tensors
    ex.run(Instr("renametensor", (V("linear_0.weight", "string"),), (T("a"),)))
    assert "linear_0.weight" in ex.tensors
