"""fuse_colsum: a fused result that the next instruction naming it sums over axis 0 becomes one fusedcolsum, which
makes the sums in the fused loop; the cases folded and the near misses left alone, and the tensors after each run
(before the native loop is compiled and after) bit for bit the unrewritten program's."""

from __future__ import annotations

import numpy as np
import pytest

from deepxd.compiler.colsum import fuse_colsum
from deepxd.kernels.cpu import native
from tests.compiler.helpers import executor, lines, program, rewrite

CASES = {
    # a ReLU's gradient, then its bias's
    "relu grad then bias grad": ("""
        fused (listtensor<float32>:[g y], var<string>:in0 * (in1 > 0.0)) -> (tensor<float32>:t)
        sum (tensor<float32>:t, vector<int32>:[0], var<bool>:False) -> (tensor<float32>:s)
        matmul (tensor<float32>:t, tensor<float32>:w) -> (tensor<float32>:u)
        deltensor () -> (tensor<float32>:t)
    """, True),
    "keepdims, axis -2, another name read between": ("""
        fused (listtensor<float32>:[g y], var<string>:in0 * (in1 > 0.0) + 0.5) -> (tensor<float32>:t)
        relu (tensor<float32>:g) -> (tensor<float32>:v)
        sum (tensor<float32>:t, vector<int32>:[-2], var<bool>:True) -> (tensor<float32>:s)
        deltensor () -> (tensor<float32>:t)
    """, True),
    "float64, a row broadcast": ("""
        fused (listtensor<float64>:[d r], var<string>:in0 * in1 + in0) -> (tensor<float64>:t)
        sum (tensor<float64>:t, vector<int32>:[0], var<bool>:False) -> (tensor<float64>:s)
    """, True),
    # near misses: another axis, a write of the result first, a single column, a sum read first by another
    "axis 1": ("""
        fused (listtensor<float32>:[g y], var<string>:in0 * in1 + in0) -> (tensor<float32>:t)
        sum (tensor<float32>:t, vector<int32>:[1], var<bool>:False) -> (tensor<float32>:s)
    """, False),
    "written before the sum": ("""
        fused (listtensor<float32>:[g y], var<string>:in0 * in1 + in0) -> (tensor<float32>:t)
        relu (tensor<float32>:g) -> (tensor<float32>:t)
        sum (tensor<float32>:t, vector<int32>:[0], var<bool>:False) -> (tensor<float32>:s)
    """, False),
    "read first by another": ("""
        fused (listtensor<float32>:[g y], var<string>:in0 * in1 + in0) -> (tensor<float32>:t)
        relu (tensor<float32>:t) -> (tensor<float32>:v)
        sum (tensor<float32>:t, vector<int32>:[0], var<bool>:False) -> (tensor<float32>:s)
    """, False),
    "one column": ("""
        fused (listtensor<float32>:[c c], var<string>:in0 * in1 + in0) -> (tensor<float32>:t)
        sum (tensor<float32>:t, vector<int32>:[0], var<bool>:False) -> (tensor<float32>:s)
    """, False),
    "not a matrix": ("""
        fused (listtensor<float32>:[g3 g3], var<string>:in0 * in1 + in0) -> (tensor<float32>:t)
        sum (tensor<float32>:t, vector<int32>:[0], var<bool>:False) -> (tensor<float32>:s)
    """, False),
    # the sums' tensor read (its old value) or written between the two
    "sums read between": ("""
        fused (listtensor<float32>:[g y], var<string>:in0 * in1 + in0) -> (tensor<float32>:t)
        relu (tensor<float32>:o) -> (tensor<float32>:v)
        sum (tensor<float32>:t, vector<int32>:[0], var<bool>:False) -> (tensor<float32>:o)
    """, False),
    # the sums into one of the fused inputs
    "sums into an input": ("""
        fused (listtensor<float32>:[g o], var<string>:in0 * in1 + in0) -> (tensor<float32>:t)
        sum (tensor<float32>:t, vector<int32>:[0], var<bool>:False) -> (tensor<float32>:o)
    """, False),
    "float16": ("""
        fused (listtensor<float16>:[h h], var<string>:in0 * in1 + in0) -> (tensor<float16>:t)
        sum (tensor<float16>:t, vector<int32>:[0], var<bool>:False) -> (tensor<float16>:s)
    """, False),
}


def tensors(rng: np.random.Generator) -> dict[str, np.ndarray]:
    rows = 300  # 300 x 256: above the native loop's least size, on one thread
    out = {"g": rng.standard_normal((rows, 256)).astype(np.float32),
           "y": rng.standard_normal((rows, 256)).astype(np.float32),
           "w": rng.standard_normal((256, 8)).astype(np.float32),
           "c": rng.standard_normal((40000, 1)).astype(np.float32),
           "g3": rng.standard_normal((2, 30, 256)).astype(np.float32),
           "d": rng.standard_normal((rows, 256)),
           "r": rng.standard_normal(256),
           "o": rng.standard_normal(256).astype(np.float32),
           "h": rng.standard_normal((rows, 256)).astype(np.float16)}
    out["g"][0, :3] = [-0.0, np.nan, np.inf]
    return out


@pytest.mark.parametrize("case", sorted(CASES))
def test_exactly_a_fused_result_summed_next_over_axis_0_is_joined(rng, case):
    text, joined = CASES[case]
    before, after, ctx = rewrite(fuse_colsum, text, tensors(rng))
    assert [i.name for i in after].count("fusedcolsum") == joined
    assert (after == before) != joined
    if joined:
        assert len(after) == len(before) - 1 and "sum" not in [i.name for i in after]
        assert ctx.stats["fuse_colsum"] == 1


def test_the_joined_instruction():
    _, after, ctx = rewrite(fuse_colsum, CASES["relu grad then bias grad"][0], tensors(np.random.default_rng(0)))
    assert lines(after)[0] == ("fusedcolsum (listtensor<float32>:[g y], var<string>:in0 * (in1 > 0.0), "
                               "var<bool>:False) -> (tensor<float32>:t, tensor<float32>:s)")
    assert ctx.origins == [0, 2, 3]


def test_a_heap_sums_tensor_is_left_alone(rng):
    before, after, _ = rewrite(fuse_colsum, CASES["relu grad then bias grad"][0], tensors(rng),
                               keep=frozenset({"s"}))
    assert after == before


@pytest.mark.parametrize("case", [c for c, (_, joined) in sorted(CASES.items()) if joined])
def test_every_run_gives_the_bits_of_the_unrewritten_program(case):
    """Run after run, before the native loop is compiled (HOT runs) and after: the same tensors, bit for bit."""
    text, _ = CASES[case]
    inputs = tensors(np.random.default_rng(5))
    before = program(text)
    _, after, _ = rewrite(fuse_colsum, text, inputs)
    plain, joined = executor(inputs), executor(inputs)
    for _ in range(native.HOT + 2):
        plain.run_all(before)
        joined.run_all(after)
        assert plain.tensors.keys() == joined.tensors.keys()
        for n, a in plain.tensors.items():
            assert joined.tensors[n].tobytes() == a.tobytes() and joined.tensors[n].shape == a.shape, (case, n)
