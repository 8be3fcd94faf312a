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
