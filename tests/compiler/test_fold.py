"""fold_transpose: a transpose over the last two dims that only one matmul reads, and which then ends, becomes a
flag of a matmultransposed; the cases folded and the near misses left alone, with the tensors after each program
(run as it is, and prepared and run twice, as a repeated step runs) the same as the unrewritten program's."""

from __future__ import annotations

import numpy as np
import pytest

from deepx_core.ir.ops import check_program
from deepxd.compiler.fold import fold_transpose
from deepxd.kernels.cpu import CpuExecutor, blas, transient_transposes
from tests.compiler.helpers import assert_same_results, lines, program, rewrite

CASES = {
    # x @ w.t(), the forward of a Linear layer
    "forward": ("""
        transpose (tensor<float32>:w, vector<int32>:[1 0]) -> (tensor<float32>:wt)
        matmul (tensor<float32>:x, tensor<float32>:wt) -> (tensor<float32>:y)
        addscalar (tensor<float32>:y, var<float32>:1.0) -> (tensor<float32>:y)
        deltensor () -> (tensor<float32>:wt)
        mulscalar (tensor<float32>:w, var<float32>:0.5) -> (tensor<float32>:w)
    """, ["wt"]),
    # the backward's g.T @ x, g deleted between the transpose and the matmul: its deletion moves after the matmul
    "operand deleted": ("""
        mulscalar (tensor<float32>:x, var<float32>:2.0) -> (tensor<float32>:g)
        transpose (tensor<float32>:g, vector<int32>:[1 0]) -> (tensor<float32>:gt)
        deltensor () -> (tensor<float32>:g)
        matmul (tensor<float32>:gt, tensor<float32>:x) -> (tensor<float32>:dw)
        deltensor () -> (tensor<float32>:gt)
    """, ["gt"]),
    # both operands transposes that end after the matmul: both flags
    "both operands": ("""
        transpose (tensor<float32>:sq, vector<int32>:[1 0]) -> (tensor<float32>:a)
        transpose (tensor<float32>:x, vector<int32>:[1 0]) -> (tensor<float32>:b)
        matmul (tensor<float32>:a, tensor<float32>:b) -> (tensor<float32>:y)
        deltensor () -> (tensor<float32>:a)
        deltensor () -> (tensor<float32>:b)
    """, ["a", "b"]),
    # a batch of matrices, the last two dims swapped (given as -1 -2)
    "batched": ("""
        transpose (tensor<float32>:b3, vector<int32>:[0 -1 -2]) -> (tensor<float32>:bt)
        matmul (tensor<float32>:c3, tensor<float32>:bt) -> (tensor<float32>:y)
        deltensor () -> (tensor<float32>:bt)
    """, ["bt"]),
    # a transpose of a transpose whose base is written in place before the matmul: the operand s still holds it
    "of a view": ("""
        transpose (tensor<float32>:sq, vector<int32>:[1 0]) -> (tensor<float32>:s)
        transpose (tensor<float32>:s, vector<int32>:[1 0]) -> (tensor<float32>:n)
        mulscalar (tensor<float32>:sq, var<float32>:0.0) -> (tensor<float32>:sq)
        matmul (tensor<float32>:x, tensor<float32>:n) -> (tensor<float32>:y)
        deltensor () -> (tensor<float32>:n)
        deltensor () -> (tensor<float32>:s)
    """, ["n"]),
    # the transpose's name held a tensor before the program: it is still deleted at the end
    "name held before": ("""
        transpose (tensor<float32>:w, vector<int32>:[1 0]) -> (tensor<float32>:old)
        matmul (tensor<float32>:x, tensor<float32>:old) -> (tensor<float32>:y)
        deltensor () -> (tensor<float32>:old)
    """, ["old"]),
    # near misses. The operand written in place before the matmul: the transpose holds the old values
    "operand written": ("""
        transpose (tensor<float32>:w, vector<int32>:[1 0]) -> (tensor<float32>:wt)
        mulscalar (tensor<float32>:w, var<float32>:3.0) -> (tensor<float32>:w)
        matmul (tensor<float32>:x, tensor<float32>:wt) -> (tensor<float32>:y)
        deltensor () -> (tensor<float32>:wt)
    """, []),
    # ... or after the matmul, while the transpose's value lives on: a repair there could not make it again
    "operand written before the transpose ends": ("""
        transpose (tensor<float32>:w, vector<int32>:[1 0]) -> (tensor<float32>:wt)
        matmul (tensor<float32>:x, tensor<float32>:wt) -> (tensor<float32>:y)
        mulscalar (tensor<float32>:w, var<float32>:3.0) -> (tensor<float32>:w)
        deltensor () -> (tensor<float32>:wt)
    """, []),
    "read twice": ("""
        transpose (tensor<float32>:w, vector<int32>:[1 0]) -> (tensor<float32>:wt)
        matmul (tensor<float32>:x, tensor<float32>:wt) -> (tensor<float32>:y)
        addscalar (tensor<float32>:wt, var<float32>:1.0) -> (tensor<float32>:z)
        deltensor () -> (tensor<float32>:wt)
    """, []),
    "both operands one transpose": ("""
        transpose (tensor<float32>:sq, vector<int32>:[1 0]) -> (tensor<float32>:a)
        matmul (tensor<float32>:a, tensor<float32>:a) -> (tensor<float32>:y)
        deltensor () -> (tensor<float32>:a)
    """, []),
    "not deleted": ("""
        transpose (tensor<float32>:w, vector<int32>:[1 0]) -> (tensor<float32>:wt)
        matmul (tensor<float32>:x, tensor<float32>:wt) -> (tensor<float32>:y)
        deltensor () -> (tensor<float32>:x)
    """, []),
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
    # the identity permutation, and a swap of other dims than the last two
    "wrong perm": ("""
        transpose (tensor<float32>:sq, vector<int32>:[0 1]) -> (tensor<float32>:same)
        matmul (tensor<float32>:sq, tensor<float32>:same) -> (tensor<float32>:y)
        deltensor () -> (tensor<float32>:same)
        transpose (tensor<float32>:p3, vector<int32>:[1 0 2]) -> (tensor<float32>:bt)
        matmul (tensor<float32>:bt, tensor<float32>:c3) -> (tensor<float32>:z)
        deltensor () -> (tensor<float32>:bt)
    """, []),
    # the matmul writes the transpose's operand
    "into the operand": ("""
        copytensor (tensor<float32>:sq) -> (tensor<float32>:q)
        transpose (tensor<float32>:q, vector<int32>:[1 0]) -> (tensor<float32>:qt)
        matmul (tensor<float32>:qt, tensor<float32>:q) -> (tensor<float32>:q)
        deltensor () -> (tensor<float32>:qt)
    """, []),
    # integers: matmultransposed is for floats
    "integers": ("""
        transpose (tensor<int32>:i, vector<int32>:[1 0]) -> (tensor<int32>:it)
        matmul (tensor<int32>:i, tensor<int32>:it) -> (tensor<int32>:y)
        deltensor () -> (tensor<int32>:it)
    """, []),
}


def tensors(rng: np.random.Generator, case: str) -> dict[str, np.ndarray]:
    return {"x": rng.standard_normal((3, 4)).astype(np.float32),
            "w": rng.standard_normal((3 if case == "operand deleted" else 5, 4)).astype(np.float32),
            "sq": rng.standard_normal((4, 4)).astype(np.float32),
            "b3": rng.standard_normal((2, 5, 4)).astype(np.float32),
            "c3": rng.standard_normal((2, 4, 4)).astype(np.float32),
            "p3": rng.standard_normal((2, 2, 4)).astype(np.float32),
            "i": rng.integers(-3, 4, (3, 4)).astype(np.int32),
            "old": np.zeros((4, 5), np.float32)}


def folded(before: list, after: list) -> list[str]:
    """The transposes of `before` whose result `after` no longer makes."""
    made = {str(i.returns[0].value) for i in after if i.name == "transpose"}
    return [str(i.returns[0].value) for i in before if i.name == "transpose" and str(i.returns[0].value) not in made]


@pytest.mark.parametrize("case", sorted(CASES))
def test_exactly_the_transposes_that_only_feed_one_matmul_are_folded(rng, case):
    text, want = CASES[case]
    inputs = tensors(rng, case)
    before, after, ctx = rewrite(fold_transpose, text, inputs)
    assert folded(before, after) == want
    products = 1 if case == "both operands" else len(want)  # one matmul reads both there
    assert sum(i.name == "matmultransposed" for i in after) == products
    assert ctx.stats["fold_transpose"] == len(want)
    assert len(ctx.origins) == (len(after) if want else 0)  # kept by apply_edits
    # "of a view": the unfolded transpose of a view whose base is then written is made contiguous, and MKL sums a
    # product of a contiguous operand in another order than of a transposed one: the same to float32's rounding
    assert_same_results(before, after, inputs, tol=(1e-5, 1e-6))


def test_the_folded_program_and_its_moved_deletion():
    text, _ = CASES["operand deleted"]
    inputs = tensors(np.random.default_rng(0), "operand deleted")
    _, after, ctx = rewrite(fold_transpose, text, inputs)
    assert lines(after) == [
        "mulscalar (tensor<float32>:x, var<float32>:2.0) -> (tensor<float32>:g)",
        "matmultransposed (tensor<float32>:g, tensor<float32>:x, var<bool>:True, var<bool>:False) -> "
        "(tensor<float32>:dw)",
        "deltensor () -> (tensor<float32>:g)",
    ]
    assert ctx.origins == [0, 3, 4]  # g's deletion stands where gt's did: until then gt can be made again
    text = text.replace("deltensor () -> (tensor<float32>:gt)",
                        "exp (tensor<float32>:dw) -> (tensor<float32>:e)\ndeltensor () -> (tensor<float32>:gt)")
    before, after, ctx = rewrite(fold_transpose, text, inputs)
    assert [i.name for i in after] == ["mulscalar", "matmultransposed", "exp", "deltensor"]
    assert ctx.origins == [0, 3, 4, 5]
    assert_same_results(before, after, inputs, tol=(1e-5, 1e-6))


def test_a_fetched_or_heap_transpose_is_not_folded(rng):
    text, _ = CASES["forward"]
    inputs = tensors(rng, "forward")
    for kw in ({"fetch": {"wt"}}, {"keep": frozenset({"wt"})}):
        before, after, _ = rewrite(fold_transpose, text, inputs, **kw)
        assert after == before, kw
    # a heap operand is read where it lies; its deletion between is never moved
    before, after, _ = rewrite(fold_transpose, text, inputs, keep=frozenset({"w"}))
    assert folded(before, after) == ["wt"]
    text, _ = CASES["operand deleted"]
    before, after, _ = rewrite(fold_transpose, text, tensors(rng, "operand deleted"), keep=frozenset({"g"}))
    assert after == before


def _run_twice(prog: list, inputs: dict[str, np.ndarray], prepared: bool) -> list[dict[str, np.ndarray]]:
    """Run a program twice, as the op worker runs a repeated one (transposes that end in it made views): executed,
    or through the prepared calls of its first check; the tensors after each run."""
    ex = CpuExecutor()
    for n, a in inputs.items():
        ex.put(n, a.copy())
    after, steps = [], None
    for _ in range(2):
        bounds = check_program(prog, ex, ex.plans)
        ex.transient = transient_transposes(bounds)
        if prepared:
            steps = steps or [ex.prepare(b) for b in bounds]
            for step in steps:
                step()
        else:
            for b in bounds:
                ex.execute(b)
        after.append({n: ex.tensors[n].copy() for n in ex.tensors})
    return after


# ("name held before" is rewritten for a state where `old` exists, which its first run ends: a repeat is planned
# again, as the plan cache's key holds which tensors exist before)
@pytest.mark.parametrize("case", [c for c, (_, want) in sorted(CASES.items()) if want and c != "name held before"])
def test_a_folded_program_repeated_gives_the_bits_of_the_unfolded_one(case):
    """The matmul reads the transposed operand as it read the transpose's view: bit for bit, run after run."""
    text, _ = CASES[case]
    inputs = tensors(np.random.default_rng(3), case)
    before = program(text)
    _, after, _ = rewrite(fold_transpose, text, inputs)
    plain = _run_twice(before, inputs, prepared=False)
    rounding = case == "of a view" and blas.mkl() is not None  # see above
    for prepared in (False, True):
        for a, b in zip(plain, _run_twice(after, inputs, prepared)):
            assert a.keys() == b.keys()
            for n in a:
                if rounding:
                    np.testing.assert_allclose(b[n], a[n], rtol=1e-5, atol=1e-6, err_msg=f"{case}: {n}")
                else:
                    assert b[n].tobytes() == a[n].tobytes() and b[n].shape == a[n].shape, f"{case}: {n}"
