"""simplify alone: identities become aliases (temporaries), nothing (in place) or copies (everything else)."""

from __future__ import annotations

import pytest

from deepx_core.tensorfile import write_tensor
from deepxd.compiler import simplify
from tests.compiler.helpers import assert_same_results, lines, random_inputs, rewrite

SHAPES = {"x": (2, 3, 4), "y": (2, 3, 4)}

IDENTITIES = [
    "mulscalar (tensor<float32>:x, var<float32>:1.0) -> (tensor<float32>:t)",
    "mulscalar (tensor<float32>:x, var<int32>:1) -> (tensor<float32>:t)",
    "divscalar (tensor<float32>:x, var<float32>:1.0) -> (tensor<float32>:t)",
    "powscalar (tensor<float32>:x, var<float32>:1.0) -> (tensor<float32>:t)",
    "addscalar (tensor<float32>:x, var<float32>:-0.0) -> (tensor<float32>:t)",
    "subscalar (tensor<float32>:x, var<int32>:0) -> (tensor<float32>:t)",
    "subscalar (tensor<float32>:x, var<float32>:0.0) -> (tensor<float32>:t)",
    "reshape (tensor<float32>:x, vector<int32>:[2 3 4]) -> (tensor<float32>:t)",
    "reshape (tensor<float32>:x, vector<int32>:[2 -1 4]) -> (tensor<float32>:t)",
    "broadcastTo (tensor<float32>:x, vector<int32>:[2 3 4]) -> (tensor<float32>:t)",
    "transpose (tensor<float32>:x, vector<int32>:[0 1 2]) -> (tensor<float32>:t)",
    "todtype (tensor<float32>:x) -> (tensor<float32>:t)",
]


@pytest.mark.parametrize("identity", IDENTITIES)
def test_an_identity_on_a_temporary_becomes_an_alias(rng, identity):
    inputs = random_inputs(rng, SHAPES)
    before, after, ctx = rewrite(simplify, f"""
        {identity}
        add (tensor<float32>:t, tensor<float32>:y) -> (tensor<float32>:z)
        deltensor () -> (tensor<float32>:t)
    """, inputs)
    assert lines(after) == ["add (tensor<float32>:x, tensor<float32>:y) -> (tensor<float32>:z)"]
    assert ctx.stats["simplify"] == 1 and ctx.origins == [1]
    assert_same_results(before, after, inputs)


@pytest.mark.parametrize("identity", IDENTITIES)
def test_an_identity_on_a_kept_tensor_becomes_a_copy(rng, identity):
    inputs = random_inputs(rng, SHAPES)
    before, after, _ = rewrite(simplify, f"""
        {identity}
        deltensor () -> (tensor<float32>:y)
    """, inputs)
    assert lines(after) == ["copytensor (tensor<float32>:x) -> (tensor<float32>:t)",
                            "deltensor () -> (tensor<float32>:y)"]
    assert_same_results(before, after, inputs)


def test_an_identity_in_place_disappears(rng):
    inputs = random_inputs(rng, SHAPES)
    before, after, _ = rewrite(simplify, """
        mulscalar (tensor<float32>:x, var<float32>:1.0) -> (tensor<float32>:x)
        reshape (tensor<float32>:y, vector<int32>:[2 3 4]) -> (tensor<float32>:y)
        deltensor () -> (tensor<float32>:y)
    """, inputs)
    assert lines(after) == ["deltensor () -> (tensor<float32>:y)"]
    assert_same_results(before, after, inputs)


def test_what_is_not_an_identity(rng):
    inputs = random_inputs(rng, SHAPES)
    before, after, _ = rewrite(simplify, """
        mulscalar (tensor<float32>:x, var<float32>:2.0) -> (tensor<float32>:a)
        addscalar (tensor<float32>:x, var<float32>:1.0) -> (tensor<float32>:b)
        reshape (tensor<float32>:x, vector<int32>:[6 4]) -> (tensor<float32>:c)
        transpose (tensor<float32>:x, vector<int32>:[1 0 2]) -> (tensor<float32>:d)
        todtype (tensor<float32>:x) -> (tensor<float64>:e)
        broadcastTo (tensor<float32>:x, vector<int32>:[5 2 3 4]) -> (tensor<float32>:f)
        rsubscalar (var<float32>:0.0, tensor<float32>:x) -> (tensor<float32>:g)
        addscalar (tensor<float32>:x, var<float32>:0.0) -> (tensor<float32>:h)
        subscalar (tensor<float32>:x, var<float32>:-0.0) -> (tensor<float32>:k)
        deltensor () -> (tensor<float32>:a)
    """, inputs)
    assert after == before


# programs a differential fuzzer of the passes (all of them against none) found wrong, each run both ways
FUZZED = {
    # x + 0.0 is +0.0 for x = -0.0: 1 / x then gave -inf for +inf
    "plus zero": ("""
        addscalar (tensor<float32>:x, var<float32>:0.0) -> (tensor<float32>:t)
        rdivscalar (var<float32>:1.0, tensor<float32>:t) -> (tensor<float32>:y)
        deltensor () -> (tensor<float32>:t)
    """, {"x": [-0.0, 1.0, -2.0]}),
    # an undo of a transpose (or reshape) written in place: its input was gone, and the undo read it
    "undo in place": ("""
        transpose (tensor<float32>:x, vector<int32>:[1 0]) -> (tensor<float32>:t)
        transpose (tensor<float32>:t, vector<int32>:[1 0]) -> (tensor<float32>:t)
        transpose (tensor<float32>:t, vector<int32>:[1 0]) -> (tensor<float32>:y)
    """, {"x": [[1.0, 2.0], [3.0, 4.0]]}),
    "reshape undo in place": ("""
        reshape (tensor<float32>:x, vector<int32>:[4]) -> (tensor<float32>:t)
        reshape (tensor<float32>:t, vector<int32>:[4 1]) -> (tensor<float32>:t)
        reshape (tensor<float32>:t, vector<int32>:[4]) -> (tensor<float32>:y)
    """, {"x": [[1.0, 2.0], [3.0, 4.0]]}),
    # a deltensor moved by one rewrite was dropped by the next: `a` stayed alive
    "moved delete kept": ("""
        addscalar (tensor<float32>:a, var<float32>:-0.0) -> (tensor<float32>:t)
        deltensor () -> (tensor<float32>:a)
        copytensor (tensor<float32>:t) -> (tensor<float32>:y)
        reshape (tensor<float32>:x, vector<int32>:[2 3]) -> (tensor<float32>:t)
    """, {"a": [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], "x": [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]}),
    "moved delete kept 2": ("""
        mulscalar (tensor<float32>:a, var<float32>:1.0) -> (tensor<float32>:p)
        deltensor () -> (tensor<float32>:a)
        neg (tensor<float32>:p) -> (tensor<float32>:y)
        mulscalar (tensor<float32>:x, var<float32>:1.0) -> (tensor<float32>:p)
        neg (tensor<float32>:p) -> (tensor<float32>:z)
        deltensor () -> (tensor<float32>:p)
    """, {"a": [1.0, 2.0], "x": [3.0, 4.0]}),
    # a copy read the source after its moved delete (an invalid program: the passes were dropped)
    "read after a moved delete": ("""
        mulscalar (tensor<float32>:a, var<float32>:1.0) -> (tensor<float32>:t)
        deltensor () -> (tensor<float32>:a)
        reshape (tensor<float32>:t, vector<int32>:[6]) -> (tensor<float32>:u)
        deltensor () -> (tensor<float32>:t)
        reshape (tensor<float32>:u, vector<int32>:[2 3]) -> (tensor<float32>:v)
    """, {"a": [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]}),
}


@pytest.mark.parametrize("case", sorted(FUZZED))
def test_what_a_fuzzer_found_runs_as_the_program_sent(case):
    import numpy as np

    from deepx_core.ir.ops import check_program
    from tests.compiler.helpers import executor

    text, values = FUZZED[case]
    inputs = {k: np.array(v, np.float32) for k, v in values.items()}
    before, after, _ = rewrite(simplify, text, inputs)
    check_program(after, executor(inputs))  # a valid program: every read finds its tensor
    ex1, ex2 = executor(inputs), executor(inputs)
    ex1.run_all(before)
    ex2.run_all(after)
    assert set(ex1.tensors) == set(ex2.tensors)
    for name, want in ex1.tensors.items():
        got = ex2.tensors[name]
        assert got.shape == want.shape and got.dtype == want.dtype, name
        np.testing.assert_array_equal(got, want, err_msg=name)
        assert (np.signbit(got) == np.signbit(want)).all(), name


def test_a_double_transpose_and_a_reshape_back_cancel(rng):
    inputs = random_inputs(rng, SHAPES)
    before, after, _ = rewrite(simplify, """
        transpose (tensor<float32>:x, vector<int32>:[2 0 1]) -> (tensor<float32>:t)
        transpose (tensor<float32>:t, vector<int32>:[1 2 0]) -> (tensor<float32>:u)
        reshape (tensor<float32>:y, vector<int32>:[6 4]) -> (tensor<float32>:r)
        reshape (tensor<float32>:r, vector<int32>:[2 3 4]) -> (tensor<float32>:s)
        add (tensor<float32>:u, tensor<float32>:s) -> (tensor<float32>:z)
        deltensor () -> (tensor<float32>:t)
        deltensor () -> (tensor<float32>:u)
        deltensor () -> (tensor<float32>:r)
        deltensor () -> (tensor<float32>:s)
    """, inputs)
    assert lines(after) == [
        "transpose (tensor<float32>:x, vector<int32>:[2 0 1]) -> (tensor<float32>:t)",
        "reshape (tensor<float32>:y, vector<int32>:[6 4]) -> (tensor<float32>:r)",
        "add (tensor<float32>:x, tensor<float32>:y) -> (tensor<float32>:z)",
        "deltensor () -> (tensor<float32>:t)",
        "deltensor () -> (tensor<float32>:r)",
    ]  # the first transpose and reshape are now dead: dce's work
    assert_same_results(before, after, inputs)


def test_a_transpose_that_does_not_undo_stays(rng):
    inputs = random_inputs(rng, SHAPES)
    before, after, _ = rewrite(simplify, """
        transpose (tensor<float32>:x, vector<int32>:[2 0 1]) -> (tensor<float32>:t)
        transpose (tensor<float32>:t, vector<int32>:[2 0 1]) -> (tensor<float32>:u)
        deltensor () -> (tensor<float32>:t)
    """, inputs)
    assert after == before


def test_the_source_deleted_early_is_deleted_later_instead(rng):
    inputs = random_inputs(rng, SHAPES)
    before, after, _ = rewrite(simplify, """
        exp (tensor<float32>:x) -> (tensor<float32>:a)
        mulscalar (tensor<float32>:a, var<float32>:1.0) -> (tensor<float32>:b)
        deltensor () -> (tensor<float32>:a)
        sqrt (tensor<float32>:b) -> (tensor<float32>:c)
        deltensor () -> (tensor<float32>:b)
    """, inputs)
    assert lines(after) == [
        "exp (tensor<float32>:x) -> (tensor<float32>:a)",
        "sqrt (tensor<float32>:a) -> (tensor<float32>:c)",
        "deltensor () -> (tensor<float32>:a)",
    ]
    assert_same_results(before, after, inputs)


def test_the_source_changed_before_the_reads_gives_a_copy(rng):
    inputs = random_inputs(rng, SHAPES)
    before, after, _ = rewrite(simplify, """
        mulscalar (tensor<float32>:x, var<float32>:1.0) -> (tensor<float32>:t)
        constant (var<float32>:0.0) -> (tensor<float32>:x)
        add (tensor<float32>:t, tensor<float32>:y) -> (tensor<float32>:z)
        deltensor () -> (tensor<float32>:t)
    """, inputs)
    assert lines(after)[0] == "copytensor (tensor<float32>:x) -> (tensor<float32>:t)"
    assert lines(after)[1:] == lines(before)[1:]
    assert_same_results(before, after, inputs)


def test_unknown_shapes_are_left_alone(rng, tmp_path):
    inputs = random_inputs(rng, SHAPES)
    write_tensor(tmp_path / "w", inputs["x"])
    before, after, _ = rewrite(simplify, f"""
        load (var<string>:{tmp_path}/w) -> ()
        reshape (tensor<float32>:w, vector<int32>:[2 3 4]) -> (tensor<float32>:t)
        deltensor () -> (tensor<float32>:w)
    """, inputs)
    assert after == before
