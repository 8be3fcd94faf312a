"""What an executor's registration may say of its ops (deepxd/executors.py, docs/executor.md): the shape rules of
the ops it declares, read as the node's check reads any op's, and the entries refused, each with the words that say
what is wrong. The catalogue is not touched here (parse_offer and declared_op only read it)."""

from __future__ import annotations

import pytest

from deepx_core.errors import DeepxError
from deepx_core.ir import parse_text
from deepx_core.ir.ops import OPS, SymbolicEnv, TensorMeta, bind, op, remove_op
from deepxd.executors import declared_op, parse_offer

ENV = SymbolicEnv({"a": TensorMeta((2, 3), "float32"), "b": TensorMeta((4,), "float32"),
                   "i": TensorMeta((5,), "int64")})


def infer(spec: dict, line: str) -> list[TensorMeta | None]:
    """The metas of the returns of `line`, checked against ENV by the op `spec` declares (named `newop`)."""
    d = declared_op("newop", spec, "test")
    op(d.name, d.family, d.args, d.returns, d.dtypes, d.infer, d.doc, deepxir=False)
    try:
        return bind(parse_text(line)[0], ENV).outs
    finally:
        remove_op("newop")


def test_results_like_an_arg_or_shaped_by_dims_values_and_vectors():
    like = {"args": ["tensor A"], "returns": ["tensor C"], "results": {"C": "like A"}}
    assert infer(like, "newop (tensor:a) -> (tensor:c)") == [TensorMeta((2, 3), "float32")]
    outer = {"args": ["tensor A", "tensor B"], "returns": ["tensor C"],
             "results": {"C": {"shape": ["A.0", "B.-1", 7], "dtype": "B"}}}
    assert infer(outer, "newop (tensor:a, tensor:b) -> (tensor:c)") == [TensorMeta((2, 4, 7), "float32")]
    made = {"args": ["var<int> n", "vector dims"], "returns": ["tensor C", "tensor D"],
            "results": {"C": {"shape": ["n"], "dtype": "int32"}, "D": {"shape": ["dims", 2], "dtype": "bool"}}}
    assert infer(made, "newop (var:3, vector:[4 5]) -> (tensor:c, tensor:d)") == [
        TensorMeta((3,), "int32"), TensorMeta((4, 5, 2), "bool")]


def test_a_declared_op_checks_its_args_as_any():
    spec = {"args": ["tensor A"], "returns": ["tensor C"], "results": {"C": {"shape": ["A.2"], "dtype": "A"}},
            "dtypes": ["float32"]}
    with pytest.raises(DeepxError, match=r"newop: result 'C' takes dim 2 of 'a' \(A.2\), which has 2 dims"):
        infer(spec, "newop (tensor:a) -> (tensor:c)")
    with pytest.raises(DeepxError, match="dtype int64 of 'i' is not supported"):
        infer(spec, "newop (tensor:i) -> (tensor:c)")
    with pytest.raises(DeepxError, match="argument tensor 'nosuch' not found"):
        infer(spec, "newop (tensor:nosuch) -> (tensor:c)")


@pytest.mark.parametrize(("entry", "words"), [
    ({"name": "twice"}, "no op of the catalogue has this name; declare it"),
    ({"name": "twice", "args": ["tensor A"], "returns": ["tensor C"]}, r"results must give each return \(C\)"),
    ({"name": "twice", "args": ["tensor A"], "returns": ["tensor C"], "results": {"C": "as A"}},
     "must be `like ARG`"),
    ({"name": "twice", "args": ["tensor A"], "returns": ["tensor C"], "results": {"C": "like B"}},
     "refers to 'B', which is not a tensor arg"),
    ({"name": "twice", "args": ["matrix A"], "returns": ["tensor C"], "results": {"C": "like A"}},
     "'matrix A' is not a parameter"),
    ({"name": "twice", "args": ["tensor A"], "returns": ["var C"], "results": {"C": "like A"}},
     "returns must name at least one tensor"),
    ({"name": "twice", "args": ["tensor A", "tensor A"], "returns": ["tensor C"], "results": {"C": "like A"}},
     "a name is given twice"),
    ({"name": "twice", "args": ["tensor A"], "returns": ["tensor C"], "results": {"C": {"shape": ["A.x"]}}},
     "dim 'A.x' is not a number"),
    ({"name": "twice", "args": ["tensor A"], "returns": ["tensor C"], "results": {"C": {"shape": [], "dtype": "x"}}},
     "dtype 'x' is neither a dtype nor a tensor arg"),
    ({"name": "twice", "args": ["tensor A"], "returns": ["tensor C"], "results": {"C": "like A"}, "dtypes": ["x"]},
     "dtypes must be a list of dtype names"),
    ({"name": "twice", "grad": True}, "unknown keys grad"),
    ({"name": "twice", "cost_us": -1}, "cost_us must be a number of microseconds"),
    ({"name": "two words"}, "not a name deepxIR text can write"),
    ({"name": "backward"}, "taken by the protocol"),
    ({"name": "mul", "args": ["tensor A"]}, r"it is an op of the catalogue, whose signature .*\(mul\(T A, T B\)"),
    ({"name": "deltensor"}, "changes the set of tensors"),
    ({"name": "print"}, "touches files or the output"),
    ({"name": "sgd"}, "changes the set of tensors, or reads its returns"),
])
def test_entries_refused_with_their_reason(entry, words):
    with pytest.raises(DeepxError, match=words):
        parse_offer(entry, "x")


def test_an_entry_of_the_catalogue_or_a_new_op_is_read():
    assert parse_offer({"name": "mul", "cost_us": 5}, "x").declared is None
    offer = parse_offer({"name": "twice", "args": ["tensor A"], "returns": ["tensor C"],
                         "results": {"C": "like A"}}, "x")
    assert offer.cost_us is None and offer.declared == {"args": ["tensor A"], "returns": ["tensor C"],
                                                        "results": {"C": "like A"}}
    assert "twice" not in OPS
