"""An op added in one catalogue entry, here in the test alone: an expression and a gradient rule on value handles,
and nothing else. It runs on the CPU (through an embedded daemon), fuses with its neighbours, and its gradient matches
finite differences. tests/gpu/test_new_op.py runs it on CUDA."""

from __future__ import annotations

import numpy as np
import pytest

import deepx_sdk as dx
from deepx_core.ir.dtypes import FLOATS
from deepx_core.ir.ops import op, remove_op, same, t
from deepx_core.ir.text import format_text
from deepxd.compiler import run_passes
from deepxd.compiler.autograd import grad_program, rule_formula
from tests.compiler.helpers import context, executor, program


def softsign(a: np.ndarray) -> np.ndarray:
    return a / (1 + np.abs(a))


@pytest.fixture
def new_op():
    """softsign(A) = A / (1 + |A|), whose derivative is 1 / (1 + |A|)^2: one entry, taken out again after."""
    entry = op("softsign", "expr", [t("A")], [t("C")], FLOATS, same(0), "A / (1 + |A|)", deepxir=False,
               expr="A / (1 + abs(A))", grad=lambda g, A: g / (1 + abs(A)) ** 2)
    yield entry
    remove_op("softsign")


def test_the_new_op_runs_on_the_cpu_through_a_daemon(new_op, rng):
    x = rng.normal(size=(5, 7)).astype(np.float32)
    t = dx.session().transport  # the embedded daemon: scheduler, passes, op-cpu worker, kernels
    t.put("new_op_x", x, heap=False)
    out = t.run(program("softsign (tensor<float32>:new_op_x) -> (tensor<float32>:new_op_y)"), ["new_op_y"])
    assert out.ok, out.error
    np.testing.assert_allclose(out.tensors["new_op_y"], softsign(x), rtol=1e-6)
    t.put("new_op_i", np.arange(3), heap=False)
    bad = t.run(program("softsign (tensor<int64>:new_op_i) -> (tensor<int64>:new_op_z)"), [])
    assert not bad.ok and "softsign" in bad.error and "int64" in bad.error, bad.error


def test_the_new_op_fuses_with_its_neighbours(new_op, rng):
    x = rng.normal(size=(64,))
    prog = program("""
        softsign (tensor<float64>:x) -> (tensor<float64>:a)
        mulscalar (tensor<float64>:a, var<float64>:2.0) -> (tensor<float64>:b)
        addscalar (tensor<float64>:b, var<float64>:1.0) -> (tensor<float64>:c)
        deltensor () -> (tensor<float64>:a)
        deltensor () -> (tensor<float64>:b)
    """)
    fused = run_passes(prog, context({"x": x}, fetch={"c"}))
    assert [i.name for i in fused] == ["fused"], [format_text(i) for i in fused]
    assert "abs(in0)" in format_text(fused[0])
    ex = executor({"x": x})
    ex.run_all(fused)
    np.testing.assert_allclose(ex.get("c"), softsign(x) * 2 + 1, rtol=1e-12)


def test_the_new_op_differentiates_as_finite_differences_say(new_op, rng):
    x = rng.normal(size=(3, 4))
    fwd = program("""
        softsign (tensor<float64>:x) -> (tensor<float64>:y)
        mul (tensor<float64>:y, tensor<float64>:y) -> (tensor<float64>:z)
        sum (tensor<float64>:z, vector<int32>:[], var<bool>:false) -> (tensor<float64>:loss)
    """)
    ex = executor({"x": x})
    back, names = grad_program(fwd, "loss", ["x"], ex)
    ex.run_all(fwd)
    ex.run_all(back)
    got = ex.get(names["x"])

    def loss(v: np.ndarray) -> float:
        return float((softsign(v) ** 2).sum())

    want = np.zeros_like(x)
    h = 1e-6
    for i in np.ndindex(*x.shape):
        e = np.zeros_like(x)
        e[i] = h
        want[i] = (loss(x + e) - loss(x - e)) / (2 * h)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-9)
    assert rule_formula("softsign") == "dA = g / (1 + |A|)^2"


def test_an_entry_is_checked_when_it_is_added():
    with pytest.raises(ValueError, match="must name only"):
        op("bad_expr", "expr", [t("A")], [t("C")], FLOATS, same(0), "", expr="A + Q")
    with pytest.raises(ValueError, match="needs an expression"):
        op("bad_family", "expr", [t("A")], [t("C")], FLOATS, same(0), "")
