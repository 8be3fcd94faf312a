"""The internal ops that passes make (fold_transpose's matmultransposed, fuse_colsum's fusedcolsum) against a float64
numpy reference in every dtype they claim, and bit for bit against the instructions they stand for: executed,
prepared, and before and after the native loop is compiled."""

from __future__ import annotations

import numpy as np
import pytest
from kernel_ref import L, T, V, assert_close, executor, f64, ordered, rand, run

from deepx_core.errors import DeepxError
from deepx_core.ir.ops import OPS
from deepx_core.ir.text import parse_text
from deepxd.kernels.cpu import CpuExecutor, native

MM_DTYPES = ordered(OPS["matmultransposed"].dtypes)
COLSUM_DTYPES = ordered(OPS["fusedcolsum"].dtypes)
FLAGS = [(False, False), (True, False), (False, True), (True, True)]


def _stored(shape: tuple[int, ...], transposed: bool) -> tuple[int, ...]:
    return (*shape[:-2], shape[-1], shape[-2]) if transposed else shape


@pytest.mark.parametrize("dtype", MM_DTYPES)
@pytest.mark.parametrize(("ta", "tb"), FLAGS)
@pytest.mark.parametrize(("sa", "sb"), [((5, 3), (3, 4)), ((2, 5, 3), (2, 3, 4)), ((2, 5, 3), (3, 1)),
                                        ((1, 7), (7, 1))])
def test_matmultransposed_matches_reference(rng, dtype, ta, tb, sa, sb):
    """op(A) @ op(B) with op(X) = X with its last two dims swapped where its flag is set; batch dims broadcast."""
    a = rand(rng, dtype, _stored(sa, ta), -1, 1)
    b = rand(rng, dtype, _stored(sb, tb), -1, 1)
    ex = executor(a=a, b=b)
    run(ex, "matmultransposed", [T("a", dtype), T("b", dtype), V(ta), V(tb)], [T("c", dtype)])
    want = (np.swapaxes(f64(a), -1, -2) if ta else f64(a)) @ (np.swapaxes(f64(b), -1, -2) if tb else f64(b))
    assert_close(ex.get("c"), want, dtype, scale=np.abs(want).max(), what="matmultransposed")


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_matmultransposed_gives_the_bits_of_a_transpose_and_a_matmul(rng, dtype):
    """The view BLAS reads transposed is what the transpose made a view of: the same product, bit for bit."""
    w = rand(rng, dtype, (64, 48), -1, 1)
    x = rand(rng, dtype, (32, 48), -1, 1)
    plain = executor(w=w, x=x)
    for instr in parse_text(f"transpose (tensor<{dtype}>:w, vector<int32>:[1 0]) -> (tensor<{dtype}>:wt)\n"
                            f"matmul (tensor<{dtype}>:x, tensor<{dtype}>:wt) -> (tensor<{dtype}>:y)"):
        b = plain.plans.bind(instr, plain)
        plain.transient = {id(b)}  # a view, as the op worker makes a transpose whose result dies in the program
        plain.execute(b)
    folded = executor(w=w, x=x)
    run(folded, "matmultransposed", [T("x", dtype), T("w", dtype), V(False), V(True)], [T("y", dtype)])
    assert folded.get("y").tobytes() == plain.get("y").tobytes()


def test_matmultransposed_refuses_shapes_that_do_not_match():
    ex = executor(a=np.ones((3, 4), np.float32), b=np.ones((5, 4), np.float32))
    with pytest.raises(DeepxError, match=r"matmultransposed: shapes \(3, 4\) \('a'\) and \(5, 4\) \('b'\) do not "
                                         r"match \(4 != 5\)"):
        run(ex, "matmultransposed", [T("a"), T("b"), V(False), V(False)], [T("c")])
    run(ex, "matmultransposed", [T("a"), T("b"), V(False), V(True)], [T("c")])
    assert ex.get("c").shape == (3, 5)
    with pytest.raises(DeepxError, match="dtype"):
        executor(a=np.ones((3, 4), np.int32), b=np.ones((4, 2), np.int32)).run(
            parse_text("matmultransposed (tensor<int32>:a, tensor<int32>:b, var<bool>:false, var<bool>:false) -> "
                       "(tensor<int32>:c)")[0])


EXPR = "in0 * (in1 > 0.0) + in2 * 0.5"


def colsum_instr(dtype: str, keepdims: bool, inputs: tuple[str, ...] = ("g", "y", "r")) -> list:
    return [L(list(inputs), dtype), V(EXPR), V(keepdims)]


@pytest.mark.parametrize("dtype", COLSUM_DTYPES)
@pytest.mark.parametrize("keepdims", [False, True])
@pytest.mark.parametrize("rows", [3, 300])  # small (numpy's tape and sum), large (the native loop, once compiled)
def test_fusedcolsum_matches_reference(rng, dtype, keepdims, rows):
    g, y = rand(rng, dtype, (rows, 256)), rand(rng, dtype, (rows, 256))
    r = rand(rng, dtype, (256,))  # a row, broadcast
    ex = executor(g=g, y=y, r=r)
    for _ in range(native.HOT + 1):
        run(ex, "fusedcolsum", colsum_instr(dtype, keepdims), [T("c", dtype), T("s", dtype)])
    want = f64(g) * (f64(y) > 0) + f64(r) * 0.5
    assert_close(ex.get("c"), want, dtype, what="fusedcolsum's result")
    sums = want.sum(axis=0, keepdims=keepdims)
    assert_close(ex.get("s"), sums, dtype, scale=np.abs(want).sum(axis=0, keepdims=keepdims), what="its sums")


@pytest.mark.parametrize("dtype", COLSUM_DTYPES)
@pytest.mark.parametrize("prepared", [False, True])
def test_fusedcolsum_gives_the_bits_of_a_fused_and_a_sum(rng, dtype, prepared, monkeypatch):
    """Every run, before the native loop is compiled (HOT runs) and after, executed or prepared, gives the result
    and sums that `fused` then `sum` give, bit for bit; nan, inf and -0.0 included."""
    g, y = rand(rng, dtype, (300, 256)), rand(rng, dtype, (300, 256))
    g[0, :3] = [-0.0, np.nan, np.inf]
    r = rand(rng, dtype, (256,))
    summed = []  # whether each call of the native loop with sums made them
    real, real_call = native.fused, native.fused_call

    def counting(plan, inputs, out, sums=None):
        ok = real(plan, inputs, out, sums)
        summed.append(sums is not None and ok)
        return ok

    def counting_call(plan, shapes, dt, shape, with_sums=False):
        call = real_call(plan, shapes, dt, shape, with_sums)

        def counted(inputs, out, sums=None):
            ok = call(inputs, out, sums)
            summed.append(sums is not None and ok)
            return ok

        return counted

    monkeypatch.setattr(native, "fused", counting)
    monkeypatch.setattr(native, "fused_call", counting_call)
    for keepdims in ("false", "true"):
        plain, joined = executor(g=g, y=y, r=r), executor(g=g, y=y, r=r)
        pair = parse_text(f"fused (listtensor<{dtype}>:[g y r], var<string>:{EXPR}) -> (tensor<{dtype}>:c)\n"
                          f"sum (tensor<{dtype}>:c, vector<int32>:[0], var<bool>:{keepdims}) -> (tensor<{dtype}>:s)")
        one = parse_text(f"fusedcolsum (listtensor<{dtype}>:[g y r], var<string>:{EXPR}, var<bool>:{keepdims}) -> "
                         f"(tensor<{dtype}>:c, tensor<{dtype}>:s)")[0]
        step = joined.prepare(joined.plans.bind(one, joined)) if prepared else None
        for _ in range(native.HOT + 2):
            plain.run_all(pair)
            if step is not None:
                step()
            else:
                joined.run(one)
            for n in ("c", "s"):
                assert joined.get(n).shape == plain.get(n).shape
                assert joined.get(n).tobytes() == plain.get(n).tobytes(), (n, keepdims)
    assert any(summed)  # once compiled, the native loop made the sums


def test_fusedcolsum_writes_into_an_existing_output_and_makes_a_missing_one(rng):
    g = rand(rng, "float32", (300, 256))
    ex = executor(g=g, y=g, r=g[0], c=np.zeros((300, 256), np.float32))
    c_buffer = ex.get("c")
    step = ex.prepare(ex.plans.bind(parse_text(
        "fusedcolsum (listtensor<float32>:[g y r], var<string>:in0 * in1 + in2, var<bool>:false) -> "
        "(tensor<float32>:c, tensor<float32>:s)")[0], ex))
    step()
    assert ex.get("c") is c_buffer and ex.get("s").shape == (256,)
    want = f64(g) * f64(g) + f64(g[0])
    assert_close(ex.get("s"), want.sum(axis=0), "float32", scale=np.abs(want).sum(axis=0), what="sums")


@pytest.mark.parametrize("text,message", [
    ("fusedcolsum (listtensor<float32>:[v], var<string>:in0 * 2.0, var<bool>:false) -> "
     "(tensor<float32>:c, tensor<float32>:s)", "must be a matrix"),
    ("fusedcolsum (listtensor<float32>:[m], var<string>:in0 * 2.0, var<bool>:false) -> "
     "(tensor<float32>:c, tensor<float32>:m)", "neither the result nor an input"),
    ("fusedcolsum (listtensor<float32>:[m], var<string>:in0 * 2.0, var<bool>:false) -> "
     "(tensor<float32>:c, tensor<float32>:c)", "neither the result nor an input"),
    ("fusedcolsum (listtensor<float32>:[m m64], var<string>:in0 * in1, var<bool>:false) -> "
     "(tensor<float32>:c, tensor<float32>:s)", "fusedcolsum: inputs differ in dtype"),
])
def test_fusedcolsum_refusals(text, message):
    ex = CpuExecutor()
    ex.put("v", np.ones(4, np.float32))
    ex.put("m", np.ones((3, 4), np.float32))
    ex.put("m64", np.ones((3, 4), np.float64))
    with pytest.raises(DeepxError, match=message):
        ex.run(parse_text(text)[0])
    assert set(ex.tensors) == {"v", "m", "m64"}


def test_the_ops_are_internal():
    for name in ("matmultransposed", "fusedcolsum"):
        assert not OPS[name].deepxir and OPS[name].doc and not OPS[name].differentiable
