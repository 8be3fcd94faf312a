"""cse alone: a repeated instruction whose output is a temporary reuses the first result, only when that is safe."""

from __future__ import annotations

from deepxd.compiler import eliminate_common_subexpressions as cse
from tests.compiler.helpers import assert_same_results, lines, random_inputs, rewrite

SHAPES = {"x": (3, 4), "y": (3, 4)}


def test_a_repeat_reuses_the_first_result(rng):
    inputs = random_inputs(rng, SHAPES)
    before, after, ctx = rewrite(cse, """
        mul (tensor<float32>:x, tensor<float32>:y) -> (tensor<float32>:a)
        mul (tensor<float32>:x, tensor<float32>:y) -> (tensor<float32>:b)
        add (tensor<float32>:a, tensor<float32>:b) -> (tensor<float32>:c)
        concat (listtensor<float32>:[b a], var<int32>:0) -> (tensor<float32>:d)
        deltensor () -> (tensor<float32>:b)
    """, inputs)
    assert lines(after) == [
        "mul (tensor<float32>:x, tensor<float32>:y) -> (tensor<float32>:a)",
        "add (tensor<float32>:a, tensor<float32>:a) -> (tensor<float32>:c)",
        "concat (listtensor<float32>:[a a], var<int32>:0) -> (tensor<float32>:d)",
    ]
    assert ctx.stats["cse"] == 1 and ctx.origins == [0, 2, 3]
    assert_same_results(before, after, inputs)


def test_chains_of_repeats_collapse(rng):
    inputs = random_inputs(rng, SHAPES)
    before, after, _ = rewrite(cse, """
        exp (tensor<float32>:x) -> (tensor<float32>:a1)
        mulscalar (tensor<float32>:a1, var<float32>:2.0) -> (tensor<float32>:a2)
        exp (tensor<float32>:x) -> (tensor<float32>:b1)
        mulscalar (tensor<float32>:b1, var<float32>:2.0) -> (tensor<float32>:b2)
        sub (tensor<float32>:a2, tensor<float32>:b2) -> (tensor<float32>:z)
        deltensor () -> (tensor<float32>:b1)
        deltensor () -> (tensor<float32>:b2)
    """, inputs)
    assert lines(after) == [
        "exp (tensor<float32>:x) -> (tensor<float32>:a1)",
        "mulscalar (tensor<float32>:a1, var<float32>:2.0) -> (tensor<float32>:a2)",
        "sub (tensor<float32>:a2, tensor<float32>:a2) -> (tensor<float32>:z)",
    ]
    assert_same_results(before, after, inputs)


def test_the_first_result_deleted_early_is_deleted_later_instead(rng):
    inputs = random_inputs(rng, SHAPES)
    before, after, _ = rewrite(cse, """
        exp (tensor<float32>:x) -> (tensor<float32>:a)
        neg (tensor<float32>:a) -> (tensor<float32>:n)
        deltensor () -> (tensor<float32>:a)
        exp (tensor<float32>:x) -> (tensor<float32>:b)
        add (tensor<float32>:n, tensor<float32>:b) -> (tensor<float32>:z)
        deltensor () -> (tensor<float32>:b)
    """, inputs)
    assert lines(after) == [
        "exp (tensor<float32>:x) -> (tensor<float32>:a)",
        "neg (tensor<float32>:a) -> (tensor<float32>:n)",
        "add (tensor<float32>:n, tensor<float32>:a) -> (tensor<float32>:z)",
        "deltensor () -> (tensor<float32>:a)",
    ]
    assert_same_results(before, after, inputs)


def test_what_is_not_a_repeat(rng):
    inputs = random_inputs(rng, SHAPES)
    text = """
        mulscalar (tensor<float32>:x, var<float32>:1.0) -> (tensor<float32>:a)
        mulscalar (tensor<float32>:x, var<int32>:1) -> (tensor<float32>:b)
        todtype (tensor<float32>:x) -> (tensor<float64>:c)
        todtype (tensor<float32>:x) -> (tensor<float16>:d)
        exp (tensor<float32>:x) -> (tensor<float32>:e)
        addscalar (tensor<float32>:x, var<float32>:1.0) -> (tensor<float32>:x)
        exp (tensor<float32>:x) -> (tensor<float32>:f)
        deltensor () -> (tensor<float32>:b)
        deltensor () -> (tensor<float32>:d)
        deltensor () -> (tensor<float32>:f)
    """
    before, after, _ = rewrite(cse, text, inputs)
    assert after == before  # 1.0 vs 1, other dtype, input changed in between


def test_random_fills_effects_and_live_outputs_are_never_merged(rng):
    inputs = random_inputs(rng, SHAPES)
    before, after, _ = rewrite(cse, """
        newtensor (vector<int32>:[5]) -> (tensor<float32>:r1)
        newtensor (vector<int32>:[5]) -> (tensor<float32>:r2)
        uniform (var<float32>:0.0, var<float32>:1.0, var<int32>:0) -> (tensor<float32>:r1)
        uniform (var<float32>:0.0, var<float32>:1.0, var<int32>:0) -> (tensor<float32>:r2)
        exp (tensor<float32>:x) -> (tensor<float32>:kept)
        exp (tensor<float32>:x) -> (tensor<float32>:fetched)
        deltensor () -> (tensor<float32>:r2)
    """, inputs, fetch={"fetched"})
    assert after == before


def test_named_variables_are_compared_by_value(rng):
    inputs = random_inputs(rng, SHAPES)
    before, after, _ = rewrite(cse, """
        argset (var<float32>:2.0) -> (var<float32>:k)
        mulscalar (tensor<float32>:x, var<float32>:k) -> (tensor<float32>:a)
        argset (var<float32>:3.0) -> (var<float32>:k)
        mulscalar (tensor<float32>:x, var<float32>:k) -> (tensor<float32>:b)
        add (tensor<float32>:a, tensor<float32>:b) -> (tensor<float32>:c)
        deltensor () -> (tensor<float32>:b)
    """, inputs)
    assert after == before
    assert_same_results(before, after, inputs)


def test_the_first_result_must_survive_the_reads(rng):
    inputs = random_inputs(rng, SHAPES)
    before, after, _ = rewrite(cse, """
        exp (tensor<float32>:x) -> (tensor<float32>:a)
        exp (tensor<float32>:x) -> (tensor<float32>:b)
        constant (var<float32>:0.0) -> (tensor<float32>:a)
        add (tensor<float32>:a, tensor<float32>:b) -> (tensor<float32>:c)
        deltensor () -> (tensor<float32>:b)
    """, inputs)
    assert after == before


def test_a_repeat_whose_name_is_written_again_is_reused(rng):
    inputs = random_inputs(rng, SHAPES)
    before, after, _ = rewrite(cse, """
        exp (tensor<float32>:x) -> (tensor<float32>:a)
        exp (tensor<float32>:x) -> (tensor<float32>:b)
        add (tensor<float32>:a, tensor<float32>:b) -> (tensor<float32>:c)
        neg (tensor<float32>:c) -> (tensor<float32>:b)
    """, inputs)
    assert lines(after) == [
        "exp (tensor<float32>:x) -> (tensor<float32>:a)",
        "add (tensor<float32>:a, tensor<float32>:a) -> (tensor<float32>:c)",
        "neg (tensor<float32>:c) -> (tensor<float32>:b)",
    ]
    assert_same_results(before, after, inputs)
