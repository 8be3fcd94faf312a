"""The CUDA C that the elementwise and fused kernels are made of, rendered from the op table's expressions: checked
without a GPU. Every elementwise op of the table renders for every dtype it claims; a sample renders to the very C the
hand-written tables held before; fused expressions lower as they did; an op added in the test alone gets kernels of
its own. Where nvcc is installed, the modules compile (tests/gpu/test_elementwise_table.py runs them)."""

from __future__ import annotations

import ast
import shutil
import subprocess

import pytest

from deepx_core.errors import DeepxError
from deepx_core.ir.dtypes import FLOATS
from deepx_core.ir.ops import OPS, elementwise, op, remove_op, same, t, v
from deepxd.kernels import cuda
from deepxd.kernels.cuda import elementwise as ew
from deepxd.kernels.cuda import fused
from deepxd.kernels.cuda._cexpr import INT, MIXED, render
from deepxd.kernels.cuda._src import CTYPES, INT_TYPES

ELEMENTWISE = sorted(name for name, d in OPS.items() if name in ew.SUPPORT and name != "todtype")


def test_the_ops_with_an_expression_are_the_elementwise_kernels():
    with_expr = {name for name, d in OPS.items() if d.expr}
    assert with_expr <= set(ELEMENTWISE)
    # what the fused language cannot say keeps a C form of its own: no more than these
    assert set(ELEMENTWISE) - with_expr == {"erf", "gelu", "gelugrad", "invert", "equal", "notequal", "equalscalar",
                                            "notequalscalar"}


@pytest.mark.parametrize("name", ELEMENTWISE)
def test_every_elementwise_op_renders_for_every_dtype_it_claims(name):
    d = OPS[name]
    scalar = any(a.kind == "var" for a in d.args) and name not in ("equal", "notequal", "gelu", "gelugrad")
    binary = sum(a.kind == "tensor" for a in d.args) == 2
    assert d.dtypes <= ew.SUPPORT[name] and d.dtypes <= cuda.kernel_dtypes(name)
    for dtype in sorted(d.dtypes & set(CTYPES)):
        forms = ew.forms(d, dtype)
        want = {name} | ({f"{name}_f"} if scalar and dtype in INT_TYPES else set())
        assert want <= set(forms), (dtype, sorted(forms))
        src = ew.source(dtype)
        for kname, form in forms.items():
            assert form.binary == binary
            assert f" {kname}_c(" in src
            assert (f" {kname}_s(" in src) == binary
            assert form.code.text.count("(") == form.code.text.count(")")
    assert cuda.KERNELS[name] is ew.KERNELS[name]


def _bare(text: str) -> str:
    """The text without the parentheses that enclose all of it."""
    while text.startswith("(") and text.endswith(")"):
        depth = 0
        for k, ch in enumerate(text):
            depth += {"(": 1, ")": -1}.get(ch, 0)
            if depth == 0 and k < len(text) - 1:
                return text
        text = text[1:-1]
    return text


# the C that elementwise.py's hand-written tables held for these ops, which the expressions now render to
BEFORE = {
    "float32": {"add": "x + y", "sub": "x - y", "mul": "x * y", "div": "x / y", "max": "mx(x, y)", "min": "mn(x, y)",
                "pow": "pow(x, y)", "addscalar": "x + S", "subscalar": "x - S", "mulscalar": "x * S",
                "divscalar": "x / S", "powscalar": "pow(x, S)", "maxscalar": "mx(x, S)", "minscalar": "mn(x, S)",
                "rsubscalar": "S - x", "rdivscalar": "S / x", "rpowscalar": "pow(S, x)", "sqrt": "sqrt(x)",
                "exp": "exp(x)", "log": "log(x)", "sin": "sin(x)", "cos": "cos(x)", "tan": "tan(x)",
                "floor": "floor(x)", "ceil": "ceil(x)", "round": "rint(x)", "trunc": "trunc(x)",
                "log1p": "log1p(x)", "expm1": "expm1(x)", "neg": "-x", "abs": "fabs(x)", "relu": "mx(x, (A)0)",
                "tanh": "tanh(x)"},
    "int32": {"add": "x + y", "sub": "x - y", "mul": "x * y", "div": "idiv(x, y, err)", "max": "mx(x, y)",
              "min": "mn(x, y)", "addscalar": "x + S", "subscalar": "x - S", "mulscalar": "x * S",
              "divscalar": "idiv(x, S, err)", "maxscalar": "mx(x, S)", "minscalar": "mn(x, S)",
              "rsubscalar": "S - x", "rdivscalar": "idiv(S, x, err)", "neg": "-x"},
}


@pytest.mark.parametrize("dtype", sorted(BEFORE))
def test_the_rendered_c_is_what_the_kernels_used_before(dtype):
    for name, text in BEFORE[dtype].items():
        assert _bare(ew.forms(OPS[name], dtype)[name].code.text) == text, name
    # where the text differs the meaning does not: a comparison is 1 or 0 before it is stored as a bool, the stable
    # sigmoid multiplies by 1 where it selected r, and ipw is the old (y >= 0 ? ipow(x, y) : pow) as a function
    assert ew.forms(OPS["less"], "float32")["less"].code.text == "((A)(x < y))"
    assert ew.forms(OPS["pow"], "int32")["pow"].code.text == "ipw(x, y)"
    assert ew.forms(OPS["addscalar"], "int32")["addscalar_f"].code.text == "(x + S)"  # in double: A is double there


def test_integer_division_sets_the_flag_where_a_tensor_divides():
    def code(name: str, kname: str, dtype: str = "int32"):
        return ew.forms(OPS[name], dtype)[kname].code

    assert code("div", "div").flags and not code("div", "div").scalar_divisor
    assert not code("div", "div", "float32").flags
    divscalar = code("divscalar", "divscalar")  # a zero scalar is refused before the launch: no flag to read back
    assert divscalar.scalar_divisor and not divscalar.flags
    assert code("divscalar", "divscalar_f").scalar_divisor and code("divscalar", "divscalar_f").text == "(x / S)"
    assert code("rdivscalar", "rdivscalar").flags and code("rdivscalar", "rdivscalar").text == "idiv(S, x, err)"
    assert code("rdivscalar", "rdivscalar_f").text == "fdiv(S, x, err)" and code("rdivscalar", "rdivscalar_f").flags


# fused expressions and the C the fused kernel's own renderer gave them before this one replaced it
LOWERED = [
    ("in0 * 2.5 + exp(in1) * (in0 > 0) - maximum(in1, 2.5)", 2,
     "(((x0 * (A)c.v[0]) + (exp(x1) * ((A)(x0 > (A)c.v[1])))) - mx(x1, (A)c.v[0]))", (2.5, 0.0)),
    ("abs(exp(in0 * in1 + in2) * 0.5 - in1)", 3, "fabs(((exp(((x0 * x1) + x2)) * (A)c.v[0]) - x1))", (0.5,)),
    ("-in0 ** 2 / sqrt(in1 + 1e-08) + minimum(tanh(in0), -3)", 2,
     "(((-pow(x0, (A)c.v[0])) / sqrt((x1 + (A)c.v[1]))) + mn(tanh(x0), (-(A)c.v[2])))", (2.0, 1e-08, 3.0)),
    ("(in0 <= in1) * log(in0) + +in1 - cos(sin(tan(in0)))", 2,
     "(((((A)(x0 <= x1)) * log(x0)) + x1) - cos(sin(tan(x0))))", ()),
]


@pytest.mark.parametrize("expr,n,text,constants", LOWERED)
def test_fused_expressions_lower_as_they_did(expr, n, text, constants):
    plan = fused.lower(expr, n)
    assert (plan.text, plan.constants) == (text, constants)


def test_the_new_functions_lower_for_the_fused_kernel():
    plan = fused.lower("floor(in0) + ceil(in1) - round(in0) * trunc(in1) + log1p(abs(in0)) + expm1(in1)", 2)
    assert plan.text == "((((floor(x0) + ceil(x1)) - (rint(x0) * trunc(x1))) + log1p(fabs(x0))) + expm1(x1))"


def test_a_domain_refuses_what_it_cannot_compute():
    tree = ast.parse("sqrt(A)", mode="eval")
    with pytest.raises(DeepxError, match=r"sqrt\(\) does not compute in int"):
        render(tree, {"A": "x"}, domain=INT)
    with pytest.raises(DeepxError, match="not an integer"):
        render(ast.parse("A * 0.5", mode="eval"), {"A": "x"}, domain=INT)
    assert render(ast.parse("A * 0.5", mode="eval"), {"A": "x"}, domain=MIXED, integer=("A",)).text == \
        "(x * (A)0.5)"


@pytest.fixture
def new_ops():
    """Ops added in the test alone: two tensors and a scalar; three tensors; one that claims integers but calls a
    function that does not compute in them."""
    added = [op("lerp_t", "expr", [t("A"), t("B"), v("w")], [t("C")], FLOATS, elementwise(0, 1), "A + w (B - A)",
                deepxir=False, expr="A + w * (B - A)"),
             op("fma_t", "expr", [t("A"), t("B"), t("D")], [t("C")], FLOATS, elementwise(0, 1, 2), "A * B + D",
                deepxir=False, expr="A * B + D"),
             op("root_t", "expr", [t("A")], [t("C")], FLOATS | {"int32"}, same(0), "sqrt(A)", deepxir=False,
                expr="sqrt(A)")]
    yield added
    for d in added:
        remove_op(d.name)


def test_an_op_added_in_one_entry_gets_kernels_of_its_own(new_ops):
    lerp, _, root = new_ops
    src = ew.own_source("lerp_t", lerp.expr, "float16")
    assert " lerp_t_c(" in src and " lerp_t_s(" in src and "st<TC>((x + (S * (y - x))))" in src
    assert "lerp_t" not in ew.source("float16")  # the catalogue's modules stay as they are
    assert cuda.KERNELS["lerp_t"].__qualname__.startswith("kernel_of")  # the elementwise templates, not fused
    assert cuda.SUPPORT["lerp_t"] == FLOATS
    assert cuda.KERNELS["fma_t"].__module__ == fused.__name__  # three tensors: its expression as a fused kernel
    assert set(ew.forms(root, "float32")) == {"root_t"} and ew.forms(root, "int32") == {}


NVCC = shutil.which("nvcc")


@pytest.mark.skipif(NVCC is None, reason="nvcc is not installed: the modules are compiled on a GPU machine")
@pytest.mark.parametrize("dtype", ["float16", "int32", "bool"])
def test_the_modules_compile(dtype, tmp_path, new_ops):
    """One module per kind of compute type (float with a 16-bit storage type; integers with the float-scalar
    kernels; bool), and one op's own module, compiled for sm_90 as the kernels are (no fast-math)."""
    sources = {dtype: ew.source(dtype)}
    if dtype == "float16":
        sources["own"] = ew.own_source("lerp_t", new_ops[0].expr, "bfloat16")
    for name, src in sources.items():
        path = tmp_path / f"{name}.cu"
        path.write_text(src)
        done = subprocess.run([NVCC, "-cubin", "-arch=sm_90", "-O3", "-std=c++17", "-o", str(tmp_path / "m.cubin"),
                               str(path)], capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-4000:]
