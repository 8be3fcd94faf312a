"""The fused kernel against a float64 numpy reference, on both backends: every function of the expression language,
broadcasting, scalars, every float dtype, outputs that alias an input, and expressions refused at check time."""

from __future__ import annotations

import numpy as np
import pytest
from kernel_ref import L, T, V, assert_close, executor, ordered, rand, random_broadcast_pair, run

from deepx_core.errors import DeepxError
from deepx_core.ir.ops import FUSED_FUNCTIONS, OPS
from deepxd.kernels.cpu import fused as fused_kernel

BACKENDS = list(fused_kernel.BACKENDS)
DTYPES = ordered(OPS["fused"].dtypes)

_REF = {"sqrt": np.sqrt, "exp": np.exp, "log": np.log, "sin": np.sin, "cos": np.cos, "tan": np.tan, "tanh": np.tanh,
        "abs": np.abs, "maximum": np.maximum, "minimum": np.minimum, "floor": np.floor, "ceil": np.ceil,
        "round": np.rint, "trunc": np.trunc, "log1p": np.log1p, "expm1": np.expm1, "fmod": np.fmod,
        "remainder": np.remainder, "floordiv": np.floor_divide}
assert set(_REF) == set(FUSED_FUNCTIONS)

# (expression, input value range): every function and operator, with inputs where the result is well-conditioned
EXPRESSIONS = [
    ("in0 + in1 * in2 - in0 / in1", (0.5, 2.0)),
    ("sqrt(abs(exp(in0 * 0.5 + in1) * 0.5 - in2 * 0 - 3)) + maximum(in0, 0)", (-2.0, 2.0)),
    ("log(in0) ** 2 + in1 ** in2", (0.5, 2.0)),
    ("sin(in0) * cos(in1) + tan(in2 * 0.25) - tanh(-in0)", (-1.0, 1.0)),
    ("minimum(in0, in1) + maximum(in1, 2.5) - (-in2)", (-4.0, 4.0)),
    ("in0 / (1 + exp(-in1)) + 2 ** in2 + 1e-05", (-2.0, 2.0)),
    # rounding of the inputs themselves (exact in every dtype; round's halves go to even), log1p and expm1
    ("floor(in0) + ceil(in1) - round(in2) * trunc(in0) + log1p(abs(in1)) - expm1(in2 * 0.5)", (-4.0, 4.0)),
    # the rounded divisions of whole numbers (exact in every dtype)
    ("fmod(floor(in0 * 8), floor(in1) + 0.5) + remainder(floor(in1 * 4), -2.5) * floordiv(floor(in2 * 8), 3)",
     (-4.0, 4.0)),
    # comparisons are 1 where they hold, 0 where not (gradient masks: relu's is in0 * (in1 > 0.0))
    ("in0 * (in1 > 0.25) + (in2 <= in0) * in1 - (in1 != in2) * 0.5 + (in0 == in0) - (in1 < -0.5) + (in2 >= 0)",
     (-1.0, 1.0)),
]


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest):
    previous = fused_kernel.set_backend(request.param)
    yield request.param
    fused_kernel.set_backend(previous)


def reference(expr: str, inputs: list[np.ndarray]) -> np.ndarray:
    env = {f"in{k}": a.astype(np.float64) for k, a in enumerate(inputs)}
    with np.errstate(all="ignore"):
        return np.asarray(eval(expr, {"__builtins__": {}, **_REF}, env))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("expr,bounds", EXPRESSIONS, ids=[f"e{k}" for k in range(len(EXPRESSIONS))])
def test_fused_matches_reference(rng, backend, dtype, expr, bounds):
    for _ in range(4):
        sa, sb = random_broadcast_pair(rng)
        shapes = [sa, sb, sa[1:]]
        inputs = [rand(rng, dtype, s, *bounds) for s in shapes]
        ex = executor(a=inputs[0], b=inputs[1], c=inputs[2])
        run(ex, "fused", [L(["a", "b", "c"], dtype), V(expr)], [T("y", dtype)])
        got = ex.get("y")
        want = reference(expr, inputs)
        assert got.shape == np.broadcast_shapes(*shapes)
        # float16/bfloat16 round once instead of after every op; measure against the result's own magnitude
        rtol = {"float64": 1e-12, "float32": 2e-5}.get(dtype)
        assert_close(got, want, dtype, rtol=rtol, what=f"{expr} {shapes} [{backend}]")


@pytest.mark.parametrize("n", [0, 1, 1000, 70_000, 1_200_000])
def test_large_and_threaded_blocks(rng, backend, n):
    """Sizes around the block and threading thresholds, contiguous and broadcast (a bias over rows)."""
    x = rand(rng, "float32", (n,), -2, 2)
    bias = rand(rng, "float32", (1,), -2, 2)
    out = np.empty_like(x)
    fused_kernel.fused([x, bias], "maximum(in0 * 2 + in1, 0)", out)
    assert_close(out, np.maximum(x.astype(np.float64) * 2 + bias, 0), "float32")
    rows = rand(rng, "float64", (max(n // 1000, 1), 1000), -2, 2)
    col = rand(rng, "float64", (1000,), -2, 2)
    out2 = np.empty_like(rows)
    fused_kernel.fused([rows, col], "exp(in0 - in1)", out2)
    assert_close(out2, np.exp(rows - col), "float64")


def test_numpy_backend_is_bitwise_the_unfused_float32_ops(rng):
    x, y = (rand(rng, "float32", (300_000,), -2, 2) for _ in range(2))
    out = np.empty_like(x)
    previous = fused_kernel.set_backend("numpy")
    try:
        fused_kernel.fused([x, y], "sqrt(abs(exp(in0 * 0.5 + in1) * 0.5 - 3))", out)
    finally:
        fused_kernel.set_backend(previous)
    h, three = np.float32(0.5), np.float32(3)
    assert np.array_equal(out, np.sqrt(np.abs(np.exp(x * h + y) * h - three)))


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_output_may_be_an_input(rng, backend, dtype):
    a = rand(rng, dtype, (3, 70_000), 1, 2)
    b = rand(rng, dtype, (70_000,), 1, 2)
    ex = executor(a=a, b=b)
    run(ex, "fused", [L(["a", "b", "a"]), V("in0 * 2 + in1 - in2 / 4")], [T("a")])
    assert_close(ex.get("a"), a.astype(np.float64) * 1.75 + b, dtype)


def test_scalars_and_bare_operands(backend):
    ex = executor(a=np.arange(6, dtype=np.float32).reshape(2, 3))
    run(ex, "fused", [L(["a"]), V("in0")], [T("c")])
    assert np.array_equal(ex.get("c"), ex.get("a"))
    run(ex, "fused", [L(["a"]), V("2.5")], [T("c")])
    assert np.array_equal(ex.get("c"), np.full((2, 3), 2.5, np.float32))
    run(ex, "fused", [L(["a"]), V("in0 ** 2 + -in0 + +1")], [T("d")])
    a = ex.get("a")
    assert np.array_equal(ex.get("d"), a**2 - a + 1)


@pytest.mark.parametrize("expr,message", [
    ("in0 + in3", "unknown name 'in3'"),
    ("in0 + x", "unknown name 'x'"),
    ("erf(in0)", "call 'erf(in0)'"),
    ("maximum(in0)", "call 'maximum(in0)'"),
    ("in0 % 2", "Mod"),
    ("in0 < in1 < 1", "chains comparisons"),
    ("in0 +", "cannot parse"),
    ("'a'", "is not a number"),
    ("True + in0", "is not a number"),
    ("exp", "unknown name 'exp'"),
    ("", "non-empty"),
])
def test_bad_expressions_are_refused_before_running(expr, message):
    ex = executor(a=np.ones(3, np.float32))
    with pytest.raises(DeepxError, match="fused: .*" + message.replace("(", r"\(").replace(")", r"\)")):
        run(ex, "fused", [L(["a"]), V(expr)], [T("c")])
    assert "c" not in ex.tensors


def test_inputs_must_share_one_float_dtype():
    ex = executor(a=np.ones(3, np.float32), b=np.ones(3, np.float64), i=np.ones(3, np.int32))
    with pytest.raises(DeepxError, match="fused: inputs differ in dtype"):
        run(ex, "fused", [L(["a", "b"]), V("in0 + in1")], [T("c")])
    with pytest.raises(DeepxError, match="fused: dtype int32 of 'i' is not supported"):
        run(ex, "fused", [L(["i"]), V("in0 + 1")], [T("c")])
    with pytest.raises(DeepxError, match="fused: the input list is empty"):
        run(ex, "fused", [L([]), V("1")], [T("c")])
    with pytest.raises(DeepxError, match=r"fused: shapes .* do not broadcast"):
        run(executor(a=np.ones(3), b=np.ones(4)), "fused", [L(["a", "b"]), V("in0 + in1")], [T("c")])


def test_compiled_form_is_shared_by_structure():
    p1 = fused_kernel.compile_expr("in0 * 2.5 + 1", 1)
    p2 = fused_kernel.compile_expr("in0 * 3.5 + 7", 1)
    assert p1.text == p2.text == "in0 * c0 + c1"
    assert p1.constants == (2.5, 1.0) and p2.constants == (3.5, 7.0)
    assert fused_kernel.compile_expr("in0 * 2.5 + 1", 1) is p1
