"""transpose makes a view of its operand's buffer (CpuExecutor.view_of): every tensor must still behave as a value of
its own. Whatever writes a shared buffer in place, deletes, renames or replaces one of its names, the other names
keep the values they had."""

from __future__ import annotations

import numpy as np
import pytest

from deepx_core.ir.ops import check_program
from deepx_core.ir.text import parse_text
from deepxd.kernels.cpu import CpuExecutor, transient_transposes


def run(ex: CpuExecutor, text: str) -> None:
    for instr in parse_text(text.strip()):
        ex.run(instr)


class Every:
    """A transient set holding every transpose: the view mechanics, apart from the worker's choice of which."""

    def __contains__(self, item: object) -> bool:
        return True


@pytest.fixture
def ex() -> CpuExecutor:
    ex = CpuExecutor()
    ex.transient = Every()
    ex.put("x", np.arange(6, dtype=np.float32).reshape(2, 3))
    ex.put("y", np.ones((2, 3), np.float32))
    run(ex, "transpose (tensor<float32>:x, vector<int32>:[1 0]) -> (tensor<float32>:t)")
    return ex


X = np.arange(6, dtype=np.float32).reshape(2, 3)


def test_transpose_is_a_view(ex):
    assert ex.view_of["t"] == "x" and np.shares_memory(ex.get("t"), ex.get("x"))
    np.testing.assert_array_equal(ex.get("t"), X.T)


def test_writing_the_source_in_place_leaves_the_view_its_value(ex):
    run(ex, "add (tensor<float32>:x, tensor<float32>:y) -> (tensor<float32>:x)")
    np.testing.assert_array_equal(ex.get("t"), X.T)
    np.testing.assert_array_equal(ex.get("x"), X + 1)
    assert not ex.shared


def test_writing_the_view_in_place_leaves_the_source_its_value(ex):
    run(ex, "addscalar (tensor<float32>:t, var<float32>:10.0) -> (tensor<float32>:t)")
    np.testing.assert_array_equal(ex.get("t"), X.T + 10)
    np.testing.assert_array_equal(ex.get("x"), X)


def test_a_view_of_a_view_and_a_matmul_on_views(ex):
    run(ex, """
        transpose (tensor<float32>:t, vector<int32>:[1 0]) -> (tensor<float32>:u)
        matmul (tensor<float32>:x, tensor<float32>:t) -> (tensor<float32>:m)
        mulscalar (tensor<float32>:x, var<float32>:0.0) -> (tensor<float32>:x)
    """)
    np.testing.assert_array_equal(ex.get("u"), X)
    np.testing.assert_array_equal(ex.get("t"), X.T)
    np.testing.assert_allclose(ex.get("m"), X @ X.T)


@pytest.mark.parametrize("text", [
    "deltensor () -> (tensor<float32>:x)",
    "renametensor (var<string>:x2) -> (tensor<float32>:x)",
    "copytensor (tensor<float32>:y) -> (tensor<float32>:x)",
    "deltensor () -> (tensor<float32>:t)",
    "renametensor (var<string>:t2) -> (tensor<float32>:t)",
    "copytensor (tensor<float32>:y) -> (tensor<float32>:x)\n"
    "mulscalar (tensor<float32>:x, var<float32>:2.0) -> (tensor<float32>:x)",
])
def test_life_instructions_keep_every_value(ex, text):
    run(ex, text)
    names = dict(ex.tensors)
    if "t" in names:
        np.testing.assert_array_equal(names["t"], X.T)
    if "t2" in names:
        np.testing.assert_array_equal(names["t2"], X.T)
    if "x2" in names:
        np.testing.assert_array_equal(names["x2"], X)
    run(ex, "addscalar (tensor<float32>:y, var<float32>:1.0) -> (tensor<float32>:y)")  # nothing else changes
    for name, a in names.items():
        if name != "y":
            np.testing.assert_array_equal(ex.get(name), a)


def test_put_over_the_source_leaves_the_view(ex):
    ex.put("x", np.zeros((2, 3), np.float32))
    np.testing.assert_array_equal(ex.get("t"), X.T)


def test_a_pinned_tensors_transpose_is_a_view_until_the_tensor_is_written_in_place(ex):
    ex.pinned = {"x": None}  # a heap tensor: a weight, whose transpose x @ W.T reads
    run(ex, "transpose (tensor<float32>:x, vector<int32>:[1 0]) -> (tensor<float32>:p)")
    assert ex.view_of["p"] == "x" and np.shares_memory(ex.get("p"), ex.get("x"))
    x_buffer = ex.get("x")
    run(ex, "addscalar (tensor<float32>:x, var<float32>:1.0) -> (tensor<float32>:x)")  # an optimizer's update
    assert ex.get("x") is x_buffer  # a heap tensor keeps its memory
    assert "p" not in ex.view_of and not np.shares_memory(ex.get("p"), ex.get("x"))
    np.testing.assert_array_equal(ex.get("p"), X.T)
    assert ex.get("p").flags.f_contiguous and "p" in ex.strided  # laid out as x is: a straight copy
    run(ex, """
        transpose (tensor<float32>:p, vector<int32>:[1 0]) -> (tensor<float32>:q)
        addscalar (tensor<float32>:p, var<float32>:1.0) -> (tensor<float32>:p)
    """)
    assert ex.get("p").flags.c_contiguous and "p" not in ex.strided  # row-major before it is written in place
    np.testing.assert_array_equal(ex.get("p"), X.T + 1)
    np.testing.assert_array_equal(ex.get("q"), X)
    np.testing.assert_array_equal(ex.get("x"), X + 1)


def test_a_pinned_tensors_transpose_deleted_before_the_write_costs_no_copy():
    ex = CpuExecutor()  # what the op worker runs: views of transposes that die in the program, and of heap tensors
    ex.put("x", X.copy())
    ex.pinned = {"x": None}
    run(ex, """
        transpose (tensor<float32>:x, vector<int32>:[1 0]) -> (tensor<float32>:p)
        matmul (tensor<float32>:x, tensor<float32>:p) -> (tensor<float32>:m)
        deltensor () -> (tensor<float32>:p)
        addscalar (tensor<float32>:x, var<float32>:1.0) -> (tensor<float32>:x)
    """)
    np.testing.assert_allclose(ex.get("m"), X @ X.T, rtol=1e-6)
    assert not ex.shared and not ex.views and not ex.strided


def test_prepared_calls_see_views(ex):
    ex.put("w", np.full((3, 2), 2.0, np.float32))
    run(ex, "transpose (tensor<float32>:w, vector<int32>:[1 0]) -> (tensor<float32>:wt)")
    into_base = ex.plans.bind(parse_text("mulscalar (tensor<float32>:w, var<float32>:3.0) -> (tensor<float32>:w)")[0],
                              ex)
    ex.prepare(into_base)()  # in place into w, which wt views
    np.testing.assert_array_equal(ex.get("wt"), np.full((2, 3), 2.0))
    np.testing.assert_array_equal(ex.get("w"), np.full((3, 2), 6.0))
    into_view = ex.plans.bind(parse_text("addscalar (tensor<float32>:t, var<float32>:1.0) -> (tensor<float32>:t)")[0],
                              ex)
    ex.prepare(into_view)()  # in place into t, a view of x
    np.testing.assert_array_equal(ex.get("t"), X.T + 1)
    np.testing.assert_array_equal(ex.get("x"), X)


def test_only_transposes_that_die_in_their_program_become_views():
    ex = CpuExecutor()
    ex.put("x", X)
    bounds = check_program(parse_text("""
        transpose (tensor<float32>:x, vector<int32>:[1 0]) -> (tensor<float32>:dies)
        transpose (tensor<float32>:x, vector<int32>:[1 0]) -> (tensor<float32>:lives)
        transpose (tensor<float32>:x, vector<int32>:[1 0]) -> (tensor<float32>:again)
        matmul (tensor<float32>:x, tensor<float32>:dies) -> (tensor<float32>:m)
        addscalar (tensor<float32>:lives, var<float32>:1.0) -> (tensor<float32>:again)
        deltensor () -> (tensor<float32>:dies)
        deltensor () -> (tensor<float32>:again)
    """.strip()), ex, ex.plans)
    ex.transient = transient_transposes(bounds)
    assert ex.transient == {id(bounds[0])}  # "again" is written again before its deletion
    for b in bounds:
        ex.execute(b)
    assert ex.get("lives").flags.c_contiguous and not np.shares_memory(ex.get("lives"), ex.get("x"))
    np.testing.assert_allclose(ex.get("m"), X @ X.T)
    assert not ex.shared and not ex.views


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("op", ["add", "sub", "mul", "div", "max", "min", "addscalar", "subscalar", "mulscalar",
                                "divscalar", "maxscalar", "minscalar"])
def test_prepared_direct_ufuncs_equal_the_kernels(op, dtype):
    """CpuExecutor.prepare calls DIRECT_UFUNCS straight into the output: bitwise what the op's kernel gives."""
    from deepxd.kernels.cpu import DIRECT_UFUNCS

    rng = np.random.default_rng(3)
    x = rng.standard_normal((4, 5)).astype(dtype)
    y = rng.standard_normal((4, 5)).astype(dtype)
    y[0, 0] = 0.0  # a zero divisor too
    arg = {"scalar": f"var<float32>:{-0.75}", "tensor": f"tensor<{dtype}>:y"}
    args = f"tensor<{dtype}>:x, {arg['scalar' if op.endswith('scalar') else 'tensor']}"
    text = f"{op} ({args}) -> (tensor<{dtype}>:z)"
    results = []
    for prepared in (False, True):
        ex = CpuExecutor()
        ex.put("x", x)
        ex.put("y", y)
        b = ex.plans.bind(parse_text(text)[0], ex)
        if prepared:
            assert op in DIRECT_UFUNCS
            step = ex.prepare(b)
            step()
            step()  # into the output it made
        else:
            ex.execute(b)
        results.append(ex.get("z"))
    np.testing.assert_array_equal(results[0], results[1])


STEP = """
transpose (tensor<float32>:x, vector<int32>:[1 0]) -> (tensor<float32>:t)
reshape (tensor<float32>:t, vector<int32>:[6]) -> (tensor<float32>:r)
reshape (tensor<float32>:y, vector<int32>:[3 2]) -> (tensor<float32>:s)
reshape (tensor<float32>:s, vector<int32>:[6]) -> (tensor<float32>:s)
add (tensor<float32>:r, tensor<float32>:s) -> (tensor<float32>:z)
deltensor () -> (tensor<float32>:t)
deltensor () -> (tensor<float32>:r)
mulscalar (tensor<float32>:x, var<float32>:2.0) -> (tensor<float32>:x)
deltensor () -> (tensor<float32>:s)
"""


@pytest.mark.parametrize("views", [False, True])
def test_prepared_deletes_and_reshapes_equal_execute(views):
    """A known program's deltensor and reshape go straight to the tensor table unless a view is involved: the
    tensors afterwards, and their values, are what execute leaves, with and without transposes as views."""
    results = []
    for prepared in (False, True):
        ex = CpuExecutor()
        if views:
            ex.transient = Every()
        ex.put("x", X.copy())
        ex.put("y", np.arange(6, dtype=np.float32).reshape(2, 3) * 10)
        for _ in range(2):  # the second time, the outputs exist
            for instr in parse_text(STEP.strip()):
                b = ex.plans.bind(instr, ex)
                ex.prepare(b)() if prepared else ex.execute(b)
        results.append({n: ex.tensors[n].copy() for n in ex.tensors})
        assert not ex.shared and not ex.views
    assert results[0].keys() == results[1].keys() == {"x", "y", "z"}
    for n in results[0]:
        np.testing.assert_array_equal(results[1][n], results[0][n])
    np.testing.assert_array_equal(results[1]["x"], X * 4)


def test_a_prepared_newtensor_makes_zeros_and_keeps_a_tensor_already_there(caplog):
    """newtensor in a known program (a backward's seed): zeros of its shape and dtype, straight into the table; a
    tensor of that name already there is kept, with execute's warning."""
    for dtype in ("float32", "float64", "int64"):
        ex = CpuExecutor()
        made = ex.plans.bind(parse_text(f"newtensor (vector<int32>:[2 3]) -> (tensor<{dtype}>:s)")[0], ex)
        step = ex.prepare(made)
        step()
        assert ex.get("s").dtype == np.dtype(dtype) and ex.get("s").shape == (2, 3) and not ex.get("s").any()
        ex.get("s")[...] = 7
        caplog.clear()
        step()
        np.testing.assert_array_equal(ex.get("s"), np.full((2, 3), 7, dtype))
        assert "tensor 's' already exists; keeping the old one" in caplog.text
        ex.execute(ex.plans.bind(parse_text(f"deltensor () -> (tensor<{dtype}>:s)")[0], ex))
        step()
        np.testing.assert_array_equal(ex.get("s"), np.zeros((2, 3), dtype))


def _run_program_twice(text: str, prepared: bool, tensors: dict[str, np.ndarray],
                       fetch: tuple[str, ...] = ()) -> tuple[CpuExecutor, list[dict[str, np.ndarray]]]:
    """Run a program twice (the way a training step repeats), with execute, or with prepare_program's steps made
    from the first run's checked program; the tensors after each run."""
    ex = CpuExecutor()
    for name, a in tensors.items():
        ex.put(name, a.copy())
    program = parse_text(text.strip())
    after = []
    steps = None
    for _ in range(2):
        bounds = check_program(program, ex, ex.plans)
        ex.transient = transient_transposes(bounds)
        if prepared:
            steps = steps or ex.prepare_program(bounds, fetch)[0]
            for step in steps:
                step()
        else:
            for b in bounds:
                ex.execute(b)
        after.append({n: ex.tensors[n].copy() for n in ex.tensors})
    return ex, after


FOLDS = {
    # x @ w.t(), the forward of a Linear layer: folded
    "forward": ("""
        transpose (tensor<float32>:w, vector<int32>:[1 0]) -> (tensor<float32>:wt)
        matmul (tensor<float32>:x, tensor<float32>:wt) -> (tensor<float32>:y)
        addscalar (tensor<float32>:y, var<float32>:1.0) -> (tensor<float32>:y)
        deltensor () -> (tensor<float32>:wt)
        mulscalar (tensor<float32>:w, var<float32>:0.5) -> (tensor<float32>:w)
    """, [(0, 1, 3)]),
    # the backward's g.T @ x, the operand deleted between the transpose and the matmul: folded (the array is held)
    "operand deleted": ("""
        mulscalar (tensor<float32>:x, var<float32>:2.0) -> (tensor<float32>:g)
        transpose (tensor<float32>:g, vector<int32>:[1 0]) -> (tensor<float32>:gt)
        deltensor () -> (tensor<float32>:g)
        matmul (tensor<float32>:gt, tensor<float32>:x) -> (tensor<float32>:dw)
        deltensor () -> (tensor<float32>:gt)
    """, [(1, 3, 4)]),
    # the operand written in place before the matmul: the view keeps the old values; not folded
    "operand written": ("""
        transpose (tensor<float32>:w, vector<int32>:[1 0]) -> (tensor<float32>:wt)
        mulscalar (tensor<float32>:w, var<float32>:3.0) -> (tensor<float32>:w)
        matmul (tensor<float32>:x, tensor<float32>:wt) -> (tensor<float32>:y)
        deltensor () -> (tensor<float32>:wt)
    """, []),
    # read twice, or kept: not folded
    "read twice": ("""
        transpose (tensor<float32>:w, vector<int32>:[1 0]) -> (tensor<float32>:wt)
        matmul (tensor<float32>:x, tensor<float32>:wt) -> (tensor<float32>:y)
        addscalar (tensor<float32>:wt, var<float32>:1.0) -> (tensor<float32>:z)
        deltensor () -> (tensor<float32>:wt)
    """, []),
    "kept": ("""
        transpose (tensor<float32>:w, vector<int32>:[1 0]) -> (tensor<float32>:wt)
        matmul (tensor<float32>:x, tensor<float32>:wt) -> (tensor<float32>:y)
    """, []),
    # read through a tensor list (fused, concat) before or after the matmul: not folded
    "read by a fused": ("""
        transpose (tensor<float32>:w, vector<int32>:[1 0]) -> (tensor<float32>:wt)
        matmul (tensor<float32>:x, tensor<float32>:wt) -> (tensor<float32>:y)
        fused (listtensor<float32>:[wt], var<string>:(in0 * 2.0 + 1.0) * 3.0 - 0.5) -> (tensor<float32>:z)
        deltensor () -> (tensor<float32>:wt)
    """, []),
    "read by a concat first": ("""
        transpose (tensor<float32>:w, vector<int32>:[1 0]) -> (tensor<float32>:wt)
        concat (listtensor<float32>:[wt wt], var<int32>:0) -> (tensor<float32>:z)
        matmul (tensor<float32>:x, tensor<float32>:wt) -> (tensor<float32>:y)
        deltensor () -> (tensor<float32>:wt)
    """, []),
    # the identity permutation is a transpose too (deepxIR allows it): not a swap, not folded
    "identity": ("""
        transpose (tensor<float32>:sq, vector<int32>:[0 1]) -> (tensor<float32>:same)
        matmul (tensor<float32>:sq, tensor<float32>:same) -> (tensor<float32>:y)
        deltensor () -> (tensor<float32>:same)
    """, []),
    # a transpose of a view (s of sq) whose base is written in place before the matmul: folded, on a copy of s
    "of a view": ("""
        transpose (tensor<float32>:sq, vector<int32>:[1 0]) -> (tensor<float32>:s)
        transpose (tensor<float32>:s, vector<int32>:[1 0]) -> (tensor<float32>:n)
        mulscalar (tensor<float32>:sq, var<float32>:0.0) -> (tensor<float32>:sq)
        matmul (tensor<float32>:x, tensor<float32>:n) -> (tensor<float32>:y)
        deltensor () -> (tensor<float32>:n)
        deltensor () -> (tensor<float32>:s)
    """, [(1, 3, 4)]),
    # both operands transposes that die after the matmul: the first is folded, not both (a second fold's step
    # replaced the first's, whose operand was then never made: found by a fuzzer)
    "both operands": ("""
        transpose (tensor<float32>:sq, vector<int32>:[1 0]) -> (tensor<float32>:a)
        transpose (tensor<float32>:x, vector<int32>:[1 0]) -> (tensor<float32>:b)
        matmul (tensor<float32>:a, tensor<float32>:b) -> (tensor<float32>:y)
        deltensor () -> (tensor<float32>:a)
        deltensor () -> (tensor<float32>:b)
    """, [(0, 2, 3)]),
    # the matmul writes its own operand: not folded
    "into the operand": ("""
        copytensor (tensor<float32>:sq) -> (tensor<float32>:q)
        transpose (tensor<float32>:q, vector<int32>:[1 0]) -> (tensor<float32>:qt)
        matmul (tensor<float32>:qt, tensor<float32>:q) -> (tensor<float32>:q)
        deltensor () -> (tensor<float32>:qt)
    """, []),
}


@pytest.mark.parametrize("case", sorted(FOLDS))
def test_a_transpose_that_only_feeds_one_matmul_is_folded_into_it(case):
    """prepare_program folds exactly the transposes whose result one matmul reads and the program then deletes; the
    tensors after every run are execute's, value for value, folded or not."""
    from deepxd.kernels.cpu import _foldable_transposes

    text, folds = FOLDS[case]
    rng = np.random.default_rng(3)
    tensors = {"x": rng.standard_normal((3, 4)).astype(np.float32),
               "w": rng.standard_normal((5, 4)).astype(np.float32) if case != "operand deleted"
               else rng.standard_normal((3, 4)).astype(np.float32),
               "sq": rng.standard_normal((4, 4)).astype(np.float32)}
    ex = CpuExecutor()
    for name, a in tensors.items():
        ex.put(name, a.copy())
    bounds = check_program(parse_text(text.strip()), ex, ex.plans)
    assert _foldable_transposes(bounds, (), ex.pinned) == folds
    _, plain = _run_program_twice(text, False, tensors)
    _, folded = _run_program_twice(text, True, tensors)
    from deepxd.kernels.cpu import blas

    # "of a view": unfolded, the transpose of a view whose base is then written is made contiguous, and MKL sums a
    # product of a contiguous operand in another order than of a transposed one (OpenBLAS does not): the same
    # values to float32's rounding. Everywhere else both read the same transposed array.
    rounding = case == "of a view" and blas.mkl() is not None
    for a, b in zip(plain, folded):
        assert a.keys() == b.keys()
        for n in a:
            if rounding:
                np.testing.assert_allclose(b[n], a[n], rtol=1e-5, atol=1e-6, err_msg=f"{case}: {n}")
            else:
                np.testing.assert_array_equal(b[n], a[n], err_msg=f"{case}: {n}")


def test_a_fetched_or_heap_transpose_is_not_folded():
    from deepxd.kernels.cpu import _foldable_transposes

    text = """
        transpose (tensor<float32>:w, vector<int32>:[1 0]) -> (tensor<float32>:wt)
        matmul (tensor<float32>:x, tensor<float32>:wt) -> (tensor<float32>:y)
        deltensor () -> (tensor<float32>:wt)
    """
    ex = CpuExecutor()
    ex.put("x", np.ones((3, 4), np.float32))
    ex.put("w", np.ones((5, 4), np.float32))
    bounds = check_program(parse_text(text.strip()), ex, ex.plans)
    assert _foldable_transposes(bounds, (), ()) == [(0, 1, 2)]
    assert _foldable_transposes(bounds, ("wt",), ()) == []
    assert _foldable_transposes(bounds, (), {"wt"}) == []


def test_a_folded_transposes_name_held_from_before_is_still_deleted():
    """The name a folded transpose would make may hold a tensor from before the program (a name used again): the
    transpose would have replaced it and the delete removed it; folded, the delete removes the old one."""
    text = """
        transpose (tensor<float32>:w, vector<int32>:[1 0]) -> (tensor<float32>:wt)
        matmul (tensor<float32>:x, tensor<float32>:wt) -> (tensor<float32>:y)
        deltensor () -> (tensor<float32>:wt)
    """
    tensors = {"x": np.ones((3, 4), np.float32), "w": np.full((5, 4), 2.0, np.float32),
               "wt": np.zeros((4, 5), np.float32)}
    _, after = _run_program_twice(text, True, tensors)
    assert "wt" not in after[0] and "wt" not in after[1]
    np.testing.assert_array_equal(after[1]["y"], np.full((3, 5), 8.0))


def test_a_program_that_stops_between_a_folded_transpose_and_its_delete_leaves_execute_s_tensors():
    """A known program that fails after a folded transpose ran and before its delete: the transpose's name exists
    afterwards with its value, as execute leaves it, so the client's resent delete finds it; the operand's array is
    not held past the run."""
    from deepx_core.errors import DeepxError

    text = """
        transpose (tensor<float32>:w, vector<int32>:[1 0]) -> (tensor<float32>:wt)
        indexselect (tensor<float32>:x, tensor<int64>:i, var<int32>:0) -> (tensor<float32>:xs)
        matmul (tensor<float32>:xs, tensor<float32>:wt) -> (tensor<float32>:y)
        deltensor () -> (tensor<float32>:wt)
    """
    w = np.arange(20, dtype=np.float32).reshape(5, 4)
    ex = CpuExecutor()
    ex.put("x", np.ones((3, 4), np.float32))
    ex.put("w", w)
    ex.put("i", np.array([0, 2], np.int64))
    bounds = check_program(parse_text(text.strip()), ex, ex.plans)
    steps, recover = ex.prepare_program(bounds)
    for step in steps:
        step()
    assert "wt" not in ex.tensors
    ex.tensors["i"][...] = [0, 7]  # out of range: the indexselect fails, after the transpose
    done = 0
    with pytest.raises((DeepxError, IndexError)):
        for done, step in enumerate(steps):  # noqa: B007
            step()
    recover(done)
    np.testing.assert_array_equal(ex.get("wt"), w.T)
    ex.run(parse_text("deltensor () -> (tensor<float32>:wt)")[0])
    assert "wt" not in ex.tensors


COLSUMS = {
    # a ReLU's gradient, then its bias's: folded (keepdims either way, axis 0 given as -2 too)
    "relu grad then bias grad": ("""
        fused (listtensor<float32>:[g y], var<string>:in0 * (in1 > 0.0)) -> (tensor<float32>:t)
        sum (tensor<float32>:t, vector<int32>:[0], var<bool>:False) -> (tensor<float32>:s)
        matmul (tensor<float32>:t, tensor<float32>:w) -> (tensor<float32>:u)
        deltensor () -> (tensor<float32>:t)
    """, [(0, 1)]),
    "keepdims, axis -2, a read of another name between": ("""
        fused (listtensor<float32>:[g y], var<string>:in0 * (in1 > 0.0) + 0.5) -> (tensor<float32>:t)
        relu (tensor<float32>:g) -> (tensor<float32>:v)
        sum (tensor<float32>:t, vector<int32>:[-2], var<bool>:True) -> (tensor<float32>:s)
    """, [(0, 2)]),
    # not folded: another axis, a write of the output first, a single column
    "axis 1": ("""
        fused (listtensor<float32>:[g y], var<string>:in0 * in1 + in0) -> (tensor<float32>:t)
        sum (tensor<float32>:t, vector<int32>:[1], var<bool>:False) -> (tensor<float32>:s)
    """, []),
    "written before the sum": ("""
        fused (listtensor<float32>:[g y], var<string>:in0 * in1 + in0) -> (tensor<float32>:t)
        relu (tensor<float32>:g) -> (tensor<float32>:t)
        sum (tensor<float32>:t, vector<int32>:[0], var<bool>:False) -> (tensor<float32>:s)
    """, []),
    "one column": ("""
        fused (listtensor<float32>:[c c], var<string>:in0 * in1 + in0) -> (tensor<float32>:t)
        sum (tensor<float32>:t, vector<int32>:[0], var<bool>:False) -> (tensor<float32>:s)
    """, []),
}


@pytest.mark.parametrize("case", sorted(COLSUMS))
def test_a_sum_over_axis_0_of_a_fused_result_is_made_in_its_loop(case, monkeypatch):
    """prepare_program folds a sum over axis 0 of a fused instruction's result (the next instruction naming it) into
    the fused C loop; every run's tensors are execute's, bit for bit, before the loop is compiled (HOT runs) and
    after."""
    from deepxd.kernels.cpu import _foldable_colsums, native

    text, folds = COLSUMS[case]
    rng = np.random.default_rng(5)
    rows = 300  # 300 x 256: above BROADCAST_MIN and FUSED_MIN, on one thread
    tensors = {"g": rng.standard_normal((rows, 256)).astype(np.float32),
               "y": rng.standard_normal((rows, 256)).astype(np.float32),
               "w": rng.standard_normal((256, 8)).astype(np.float32),
               "c": rng.standard_normal((40000, 1)).astype(np.float32)}
    tensors["g"][0, :3] = [-0.0, np.nan, np.inf]
    ex = CpuExecutor()
    for name, a in tensors.items():
        ex.put(name, a.copy())
    bounds = check_program(parse_text(text.strip()), ex, ex.plans)
    assert _foldable_colsums(bounds) == folds
    done = []
    real = native.fused

    def counting(plan, inputs, out, sums=None):
        ok = real(plan, inputs, out, sums)
        done.append(sums is not None and ok)
        return ok

    real_call = native.fused_call

    def counting_call(plan, shapes, dt, shape, with_sums=False):  # the prepared form, which the fold uses
        call = real_call(plan, shapes, dt, shape, with_sums)

        def counted(inputs, out, sums=None):
            ok = call(inputs, out, sums)
            done.append(sums is not None and ok)
            return ok

        return counted

    monkeypatch.setattr(native, "fused", counting)
    monkeypatch.setattr(native, "fused_call", counting_call)
    results: dict[bool, list[dict[str, np.ndarray]]] = {}
    for prepared in (False, True):
        ex = CpuExecutor()
        for name, a in tensors.items():
            ex.put(name, a.copy())
        program = parse_text(text.strip())
        steps = None
        runs = []
        for _ in range(native.HOT + 2):
            bounds = check_program(program, ex, ex.plans)
            if prepared:
                steps = steps or ex.prepare_program(bounds)[0]
                for step in steps:
                    step()
            else:
                for b in bounds:
                    ex.execute(b)
            runs.append({n: ex.tensors[n].copy() for n in ex.tensors})
        results[prepared] = runs
    for a, b in zip(results[False], results[True]):
        assert a.keys() == b.keys()
        for n in a:
            assert a[n].tobytes() == b[n].tobytes() and a[n].shape == b[n].shape, f"{case}: {n}"
    assert any(done) == bool(folds)  # once compiled, the fold's loop made the sums
