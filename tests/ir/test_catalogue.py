"""The op catalogue: completeness against deepxIR, kernels for every op, and clear errors for bad instructions."""

from __future__ import annotations

import numpy as np
import pytest

from deepx_core.errors import DeepxError
from deepx_core.ir import OPS, Instr, Param, SymbolicEnv, TensorMeta, bind, check_program
from deepx_core.ir.dtypes import STORABLE
from deepxd.kernels.cpu import KERNELS, CpuExecutor

# the 60 operator names of docs/deepxir.md section 4, in its order
DEEPXIR_OPS = """
newtensor copytensor deltensor renametensor argset vecset constant arange uniform normal dropout print save load
loadtensordata add sub mul div addscalar subscalar mulscalar divscalar rsubscalar rdivscalar pow powscalar rpowscalar
sqrt exp log sin cos tan invert max min maxscalar minscalar less greater lessscalar greaterscalar equal notequal
equalscalar notequalscalar switch todtype matmul reshape transpose concat broadcastTo indexselect repeat sum prod
reducemax reducemin
""".split()

TRAINING_OPS = """relu sigmoid tanh gelu silu softmax logsoftmax crossentropy mse layernorm rmsnorm slice pad sgd adam
adamw""".split()


def T(name: str, dtype: str = "float32") -> Param:
    return Param.tensor(name, dtype)


def test_every_deepxir_op_is_in_the_catalogue():
    assert len(DEEPXIR_OPS) == 60
    assert sorted(n for n, op in OPS.items() if op.deepxir) == sorted(DEEPXIR_OPS)


def test_training_ops_are_in_the_catalogue():
    missing = [n for n in TRAINING_OPS if n in OPS and OPS[n].deepxir] + [n for n in TRAINING_OPS if n not in OPS]
    assert missing == []


def test_every_op_has_a_cpu_kernel_in_its_family_module():
    """Each op's CPU kernel is deepxd.kernels.cpu.<family>.<op>; an op of family "expr" runs its expression."""
    for name, op in OPS.items():
        want = "deepxd.kernels.cpu.fused" if op.family == "expr" else f"deepxd.kernels.cpu.{op.family}"
        assert KERNELS[name].__module__ == want, name


def test_entries_are_well_formed():
    for name, op in OPS.items():
        assert op.name == name
        assert op.doc, name
        assert op.dtypes and op.dtypes <= STORABLE, name
        assert name in op.signature()
        for a in (*op.args, *op.returns):
            assert a.kind in ("tensor", "var", "vector", "listtensor", "shape"), (name, a)
            assert a.vtype in ("num", "int", "bool", "str", "any"), (name, a)


@pytest.fixture
def env() -> SymbolicEnv:
    return SymbolicEnv(
        {
            "a": TensorMeta((2, 3), "float32"),
            "b": TensorMeta((3, 2), "float32"),
            "c": TensorMeta((2, 3), "float32"),
            "i": TensorMeta((2, 3), "int32"),
            "idx": TensorMeta((4,), "int64"),
            "q": TensorMeta((2, 3), "int4") if False else TensorMeta((2,), "bool"),
        }
    )


@pytest.mark.parametrize(
    "instr, message",
    [
        (Instr("foo", (T("a"),), (T("c"),)), "op 'foo' not found"),
        (Instr("add", (T("a"),), (T("c"),)), "add: expects 2 arguments (A, B), got 1"),
        (Instr("add", (T("a"), T("a"), T("a")), (T("c"),)), "add: expects 2 arguments (A, B), got 3"),
        (Instr("add", (T("a"), T("a")), ()), "add: expects 1 returns (C), got 0"),
        (Instr("add", (T("a"), T("b")), (T("d"),)), "add: shapes (2, 3) ('a') and (3, 2) ('b') do not broadcast"),
        (Instr("add", (T("a"), T("i")), (T("d"),)), "add: dtypes float32 ('a') and int32 ('i') differ"),
        (Instr("add", (T("a"), T("zz")), (T("d"),)), "add: argument tensor 'zz' not found"),
        (Instr("add", (T("a"), Param.var(1.0)), (T("d"),)), "add: argument 'B' must be a tensor, got var<float32>:1.0"),
        (Instr("sqrt", (T("i"),), (T("d"),)), "sqrt: dtype int32 of 'i' is not supported"),
        (Instr("invert", (T("a"),), (T("d"),)), "invert: dtype float32 of 'a' is not supported"),
        (
            Instr("matmul", (T("a"), T("a")), (T("d"),)),
            "matmul: shapes (2, 3) ('a') and (2, 3) ('a') do not match (3 != 2)",
        ),
        (
            Instr("transpose", (T("a"), Param.vector([0, 0])), (T("d"),)),
            "transpose: [0, 0] is not a permutation of the 2 dims [0, 1]",
        ),
        (Instr("transpose", (T("a"), Param.vector([0, 1, 2])), (T("d"),)), "is not a permutation"),
        (
            Instr("indexselect", (T("a"), T("idx", "int64"), Param.var(2)), (T("d"),)),
            "indexselect: axis 2 out of range for a tensor of rank 2",
        ),
        (
            Instr("indexselect", (T("a"), T("a"), Param.var(0)), (T("d"),)),
            "indexselect: dtype float32 of 'a' is not supported (supported: int64 int32)",
        ),
        (Instr("sum", (T("a"), Param.vector([0, 0]), Param.var(False)), (T("d"),)), "sum: repeated dim"),
        (Instr("sum", (T("a"), Param.vector([5]), Param.var(False)), (T("d"),)), "sum: dim 5 out of range"),
        (
            Instr("reshape", (T("a"), Param.vector([4, 2])), (T("d"),)),
            "reshape: 'a' of shape (2, 3) (6 elements) cannot become [4, 2] (8 elements)",
        ),
        (
            Instr("add", (T("a"), T("a")), (T("b"),)),
            "add: output 'b' has shape (3, 2), but the result has shape (2, 3)",
        ),
        (
            Instr("addscalar", (T("a"), Param.var("nosuchvar")), (T("d"),)),
            "addscalar: s='nosuchvar' is not a number and no variable of that name is set",
        ),
        (
            Instr("concat", (Param.listtensor(["a", "b"]), Param.var(0)), (T("d"),)),
            "concat: 'b' has shape (3, 2), which does not match (2, 3) ('a') outside dim 0",
        ),
        (Instr("constant", (Param.var(1),), (T("nosuch"),)), "constant: output tensor 'nosuch' does not exist"),
        (Instr("newtensor", (Param.vector([2, -1]),), (T("n"),)), "newtensor: shape [2, -1] of 'n' has a negative"),
        (Instr("newtensor", (Param.vector([2]),), (T("n", "int4"),)), "newtensor: dtype int4 of 'n' cannot be stored"),
        (
            Instr("newtensor", (Param.vector([1 << 62, 0]),), (T("n"),)),
            "newtensor: output 'n' of shape [4611686018427387904, 0] float32 is larger than any tensor can be",
        ),
        (
            Instr("broadcastTo", (T("a"), Param.vector([1 << 40, 1 << 40, 2, 3])), (T("d"),)),
            "broadcastTo: output 'd' of shape [1099511627776, 1099511627776, 2, 3] float32 is larger than any tensor",
        ),
        (Instr("dropout", (Param.var(1.5), Param.var(0)), (T("a"),)), "dropout: p=1.5 must be in [0, 1]"),
        (
            Instr("broadcastTo", (T("a"), Param.vector([3, 3])), (T("d"),)),
            "broadcastTo: 'a' of shape (2, 3) cannot be broadcast to [3, 3]",
        ),
        (Instr("deltensor", (), (T("nosuch"),)), "deltensor: tensor 'nosuch' not found"),
        (
            Instr("crossentropy", (T("a"), T("i", "int32")), (T("d"),)),
            "crossentropy: labels 'i' of shape (2, 3) do not match logits (2, 3); expected (2,)",
        ),
        (
            Instr("slice", (T("a"), Param.vector([0]), Param.vector([1]), Param.vector([1])), (T("d"),)),
            "slice: starts, ends and steps need one entry per dim of 'a' (rank 2)",
        ),
        (Instr("pad", (T("a"), Param.vector([1, 1])), (T("d"),)), "pad: pads must be 4 non-negative counts"),
        (
            Instr("sgd", (T("a"), T("b"), T("a"), Param.var(0.1)), (T("a"), T("a"))),
            "sgd: 'b' has shape (3, 2) but param 'a' has (2, 3)",
        ),
    ],
)
def test_bad_instructions_name_the_op_the_operands_and_the_problem(env, instr, message):
    with pytest.raises(DeepxError) as e:
        bind(instr, env)
    assert message in str(e.value)


def test_a_bad_program_is_refused_before_anything_runs():
    ex = CpuExecutor()
    ex.put("a", np.arange(6, dtype=np.float32).reshape(2, 3))
    prog = [
        Instr("mulscalar", (T("a"), Param.var(2)), (T("a"),)),  # would change a
        Instr("newtensor", (Param.vector([3]),), (T("n"),)),
        Instr("add", (T("a"), T("n")), (T("c"),)),  # (2, 3) + (3,) broadcasts: fine
        Instr("matmul", (T("a"), T("n")), (T("m"),)),  # rank 1: refused
    ]
    with pytest.raises(DeepxError, match=r"instruction 4: matmul: operands need rank >= 2"):
        check_program(prog, ex)
    assert set(ex.tensors) == {"a"}
    np.testing.assert_array_equal(ex.get("a"), np.arange(6, dtype=np.float32).reshape(2, 3))


def test_check_program_follows_tensor_life_and_variables():
    prog = [
        Instr("newtensor", (Param.vector([2, 2]),), (T("x"),)),
        Instr("argset", (Param.var(3.5),), (Param("var", ("string",), "k"),)),
        Instr("vecset", (Param.vector([4]),), (Param("vector", ("int32",), "shp"),)),
        Instr("addscalar", (T("x"), Param("var", ("float32",), "k")), (T("y"),)),
        Instr("reshape", (T("y"), Param("vector", ("int32",), "shp")), (T("z"),)),
        Instr("renametensor", (Param.var("w"),), (T("z"),)),
        Instr("deltensor", (), (T("x"),)),
        Instr("sum", (T("w"), Param.vector([]), Param.var(False)), (T("s"),)),
    ]
    bound = check_program(prog, SymbolicEnv())
    assert bound[4].outs == [TensorMeta((4,), "float32")]
    assert bound[-1].outs == [TensorMeta((), "float32")]
    with pytest.raises(DeepxError, match="instruction 3: add: argument tensor 'x' not found"):
        check_program(
            [prog[0], Instr("deltensor", (), (T("x"),)), Instr("add", (T("x"), T("x")), (T("y"),))], SymbolicEnv()
        )


def test_a_failed_instruction_touches_no_tensor():
    ex = CpuExecutor()
    ex.put("a", np.ones((2, 3), np.float32))
    ex.put("b", np.ones((3, 2), np.float32))
    ex.put("i", np.array([0, 5], np.int64))
    ex.put("z", np.array([1, 0], np.int32))
    before = {k: v.copy() for k, v in ex.tensors.items()}
    for instr in [
        Instr("add", (T("a"), T("b")), (T("a"),)),
        Instr("indexselect", (T("a"), T("i", "int64"), Param.var(0)), (T("a"),)),  # 5 is out of range at run time
        Instr("div", (T("z", "int32"), T("z", "int32")), (T("z", "int32"),)),  # integer division by zero
        Instr("nosuchop", (), ()),
    ]:
        with pytest.raises(DeepxError) as e:
            ex.run(instr)
        assert instr.name in str(e.value)
    assert set(ex.tensors) == set(before)
    for k, v in before.items():
        np.testing.assert_array_equal(ex.tensors[k], v)


def test_untyped_params_resolve_from_the_signature():
    ex = CpuExecutor()
    ex.put("a", np.arange(6, dtype=np.float32).reshape(2, 3))
    ex.run(Instr("mulscalar", (Param("", (), "a"), Param("", (), "2")), (Param("", (), "c"),)))
    np.testing.assert_array_equal(ex.get("c"), np.arange(6).reshape(2, 3) * 2)
    ex.run(Instr("reshape", (Param("", (), "c"), Param("", (), "[3 2]")), (Param("", (), "d"),)))
    assert ex.get("d").shape == (3, 2)
    ex.run(Instr("concat", (Param("", (), "[a c]"), Param("", (), "0")), (Param("", (), "e"),)))
    assert ex.get("e").shape == (4, 3)
    with pytest.raises(DeepxError, match="mulscalar: s='zz' is not a number"):
        ex.run(Instr("mulscalar", (Param("", (), "a"), Param("", (), "zz")), (Param("", (), "c"),)))


def test_the_stored_dtype_wins_over_the_annotation():
    ex = CpuExecutor()
    ex.put("a", np.arange(4, dtype=np.float64))
    ex.run(Instr("addscalar", (T("a", "float32"), Param.var(1, "int32")), (T("c", "float32"),)))
    assert ex.get("c").dtype == np.float64
    np.testing.assert_array_equal(ex.get("c"), np.arange(4) + 1.0)


def test_docs_ir_md_is_generated_from_the_catalogue():
    from pathlib import Path

    from deepxd.compiler import doc

    text = (Path(__file__).resolve().parents[2] / "docs" / "ir.md").read_text()
    assert f"{doc.BEGIN}\n{doc.render()}\n{doc.END}" in text, "run: python -m deepxd.compiler.doc --write"
