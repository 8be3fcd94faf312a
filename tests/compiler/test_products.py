"""transpose_products: transpose(A @ B) -> B^T @ A^T over the last two dims, with transpose(transpose(X)) read as X;
where it applies, and the near misses where it must not."""

from __future__ import annotations

import pytest

from deepxd.compiler.products import transpose_products
from tests.compiler.helpers import assert_same_results, lines, random_inputs, rewrite

# a Linear's weight gradient as autograd's rules write it: dW = transpose(transpose(x) @ g)
WEIGHT_GRADIENT = """
    transpose (tensor<float32>:x, vector<int32>:[1 0]) -> (tensor<float32>:xt)
    matmul (tensor<float32>:xt, tensor<float32>:g) -> (tensor<float32>:p)
    deltensor () -> (tensor<float32>:xt)
    deltensor () -> (tensor<float32>:g)
    transpose (tensor<float32>:p, vector<int32>:[1 0]) -> (tensor<float32>:dw)
    deltensor () -> (tensor<float32>:p)
"""
SHAPES = {"x": (4, 6), "g": (4, 3)}


def test_a_weight_gradient_becomes_one_product_of_the_transposed_upstream_gradient(rng):
    inputs = random_inputs(rng, SHAPES, lo=-1)
    before, after, ctx = rewrite(transpose_products, WEIGHT_GRADIENT, inputs)
    assert lines(after) == [
        "transpose (tensor<float32>:g, vector<int32>:[1 0]) -> (tensor<float32>:p)",
        "matmul (tensor<float32>:p, tensor<float32>:x) -> (tensor<float32>:dw)",
        "deltensor () -> (tensor<float32>:g)",
        "deltensor () -> (tensor<float32>:p)",
    ]
    assert ctx.origins == [1, 1, 3, 5] and ctx.stats["transpose_products"] == 1
    assert_same_results(before, after, inputs)


def test_both_operands_transposed_need_no_new_transpose(rng):
    text = """
        transpose (tensor<float32>:x, vector<int32>:[1 0]) -> (tensor<float32>:xt)
        transpose (tensor<float32>:y, vector<int32>:[1 0]) -> (tensor<float32>:yt)
        matmul (tensor<float32>:xt, tensor<float32>:yt) -> (tensor<float32>:p)
        deltensor () -> (tensor<float32>:xt)
        deltensor () -> (tensor<float32>:yt)
        transpose (tensor<float32>:p, vector<int32>:[1 0]) -> (tensor<float32>:q)
        deltensor () -> (tensor<float32>:p)
    """
    inputs = random_inputs(rng, {"x": (4, 6), "y": (3, 4)}, lo=-1)
    before, after, _ = rewrite(transpose_products, text, inputs)
    assert lines(after) == ["matmul (tensor<float32>:y, tensor<float32>:x) -> (tensor<float32>:q)"]
    assert_same_results(before, after, inputs)


def test_a_batched_product_and_a_transpose_read_elsewhere_too(rng):
    """Batch dims too; xt is read by another instruction as well, so its transpose stays (the product reads x)."""
    text = """
        transpose (tensor<float64>:x, vector<int32>:[0 2 1]) -> (tensor<float64>:xt)
        matmul (tensor<float64>:xt, tensor<float64>:g) -> (tensor<float64>:p)
        transpose (tensor<float64>:p, vector<int32>:[0 -1 -2]) -> (tensor<float64>:dw)
        deltensor () -> (tensor<float64>:p)
        relu (tensor<float64>:xt) -> (tensor<float64>:r)
        deltensor () -> (tensor<float64>:xt)
    """
    inputs = random_inputs(rng, {"x": (2, 4, 6), "g": (2, 4, 3)}, "float64", lo=-1)
    before, after, _ = rewrite(transpose_products, text, inputs)
    assert [i.name for i in after] == ["transpose", "transpose", "matmul", "deltensor", "relu", "deltensor"]
    assert lines(after)[2] == "matmul (tensor<float64>:p, tensor<float64>:x) -> (tensor<float64>:dw)"
    assert_same_results(before, after, inputs)


NEAR_MISSES = {
    # the product read again: its value is needed as it is
    "product read twice": WEIGHT_GRADIENT.replace(
        "    deltensor () -> (tensor<float32>:p)", "    relu (tensor<float32>:p) -> (tensor<float32>:r)\n"
        "    deltensor () -> (tensor<float32>:p)"),
    # the product outlives the program
    "product not deleted": WEIGHT_GRADIENT.replace("    deltensor () -> (tensor<float32>:p)\n", ""),
    # not a swap of the last two dims
    "wrong perm": """
        transpose (tensor<float32>:b, vector<int32>:[1 0 2]) -> (tensor<float32>:bt)
        matmul (tensor<float32>:bt, tensor<float32>:c) -> (tensor<float32>:p)
        deltensor () -> (tensor<float32>:bt)
        transpose (tensor<float32>:p, vector<int32>:[1 0 2]) -> (tensor<float32>:q)
        deltensor () -> (tensor<float32>:p)
    """,
    # a 2-d operand broadcast over a batch: B^T @ A^T would have the ranks the other way round
    "rank mismatch": """
        transpose (tensor<float32>:x, vector<int32>:[1 0]) -> (tensor<float32>:xt)
        matmul (tensor<float32>:xt, tensor<float32>:c) -> (tensor<float32>:p)
        deltensor () -> (tensor<float32>:xt)
        transpose (tensor<float32>:p, vector<int32>:[0 2 1]) -> (tensor<float32>:q)
        deltensor () -> (tensor<float32>:p)
    """,
    # neither operand is a transpose: two new transposes to save one
    "no transposed operand": """
        matmul (tensor<float32>:g, tensor<float32>:y) -> (tensor<float32>:p)
        transpose (tensor<float32>:p, vector<int32>:[1 0]) -> (tensor<float32>:q)
        deltensor () -> (tensor<float32>:p)
    """,
    # the transpose's operand written in place before the product: xt no longer holds x^T... x does not
    "operand's source written": """
        transpose (tensor<float32>:x, vector<int32>:[1 0]) -> (tensor<float32>:xt)
        mulscalar (tensor<float32>:x, var<float32>:2.0) -> (tensor<float32>:x)
        matmul (tensor<float32>:xt, tensor<float32>:g) -> (tensor<float32>:p)
        deltensor () -> (tensor<float32>:xt)
        transpose (tensor<float32>:p, vector<int32>:[1 0]) -> (tensor<float32>:dw)
        deltensor () -> (tensor<float32>:p)
    """,
    # the result's name read between the product and the transpose: it cannot be written at the product
    "result read in between": WEIGHT_GRADIENT.replace(
        "    deltensor () -> (tensor<float32>:g)",
        "    deltensor () -> (tensor<float32>:g)\n    relu (tensor<float32>:dw) -> (tensor<float32>:r)"),
}


@pytest.mark.parametrize("case", sorted(NEAR_MISSES))
def test_near_misses_are_left_alone(rng, case):
    inputs = random_inputs(rng, {**SHAPES, "y": (3, 4), "b": (2, 2, 4), "c": (2, 4, 5), "dw": (3, 6)}, lo=-1)
    before, after, _ = rewrite(transpose_products, NEAR_MISSES[case], inputs)
    assert after == before


def test_a_heap_result_is_left_alone(rng):
    inputs = random_inputs(rng, SHAPES, lo=-1)
    before, after, _ = rewrite(transpose_products, WEIGHT_GRADIENT, inputs, keep=frozenset({"dw"}))
    assert after == before
