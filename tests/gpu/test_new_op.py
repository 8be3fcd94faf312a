"""The op that tests/compiler/test_new_op.py adds in the test alone (one catalogue entry: an expression and a
gradient rule), on the GPU: its CUDA kernel is its expression, rendered into the elementwise kernels' templates (a
module of its own), with no CPU fallback; fused with its neighbours it runs as one kernel; its backward program runs
on the device as well."""

from __future__ import annotations

import numpy as np
import pytest

from deepx_core.ir.dtypes import FLOATS, to_numpy
from deepx_core.ir.ops import op, remove_op, same, t
from deepxd.compiler import run_passes
from deepxd.compiler.autograd import grad_program
from tests.compiler.helpers import context, executor, program


def softsign(a: np.ndarray) -> np.ndarray:
    return a / (1 + np.abs(a))


@pytest.fixture
def new_op():
    entry = op("softsign", "expr", [t("A")], [t("C")], FLOATS, same(0), "A / (1 + |A|)", deepxir=False,
               expr="A / (1 + abs(A))", grad=lambda g, A: g / (1 + abs(A)) ** 2)
    yield entry
    remove_op("softsign")


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "bfloat16"])
def test_the_new_op_runs_on_the_device(gx, new_op, rng, dtype):
    x = rng.normal(size=(33, 65)).astype(np.float32)
    gx.put("x", x.astype(np.float64).astype(to_numpy(dtype)))
    gx.run_all(program(f"softsign (tensor<{dtype}>:x) -> (tensor<{dtype}>:y)"))
    assert not gx.fallbacks, dict(gx.fallbacks)
    tol = {"float64": 1e-12, "float32": 1e-6, "float16": 2e-3, "bfloat16": 1.6e-2}[dtype]
    want = softsign(gx.get("x").astype(np.float64))
    np.testing.assert_allclose(gx.get("y").astype(np.float64), want, rtol=tol, atol=tol)


def test_the_new_op_fused_and_differentiated_on_the_device(gx, new_op, rng):
    x = rng.normal(size=(8, 16))
    fwd = program("""
        softsign (tensor<float64>:x) -> (tensor<float64>:y)
        mulscalar (tensor<float64>:y, var<float64>:2.0) -> (tensor<float64>:z)
        mul (tensor<float64>:z, tensor<float64>:z) -> (tensor<float64>:w)
        sum (tensor<float64>:w, vector<int32>:[], var<bool>:false) -> (tensor<float64>:loss)
    """)
    cpu = executor({"x": x})
    back, names = grad_program(fwd, "loss", ["x"], cpu)
    whole = fwd + back
    planned = run_passes(whole, context({"x": x}, fetch={"loss", names["x"]}))
    assert "fused" in [i.name for i in planned]
    gx.put("x", x)
    gx.run_all(planned)
    assert not gx.fallbacks, dict(gx.fallbacks)
    cpu.run_all(whole)
    np.testing.assert_allclose(gx.get("loss"), cpu.get("loss"), rtol=1e-12)
    np.testing.assert_allclose(gx.get(names["x"]), cpu.get(names["x"]), rtol=1e-10, atol=1e-12)
    d = 1 / (1 + np.abs(x)) ** 2
    np.testing.assert_allclose(gx.get(names["x"]), 8 * softsign(x) * d, rtol=1e-10)
