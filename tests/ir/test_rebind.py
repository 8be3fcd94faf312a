"""rebind_numbers (deepx_core/ir/ops.py): an instruction that differs only in its numbers, bound from the old Bound,
equals what bind gives and refuses what bind refuses, with bind's message."""

from __future__ import annotations

import pytest

from deepx_core.errors import DeepxError
from deepx_core.ir import parse_text
from deepx_core.ir.ops import SymbolicEnv, TensorMeta, bind, rebind_numbers

ENV = SymbolicEnv({n: TensorMeta((3, 4), "float32") for n in ("w", "g", "m", "v", "b")})


def _adamw(lr: str, step: int) -> object:
    (instr,) = parse_text(f"adamw (tensor<float32>:w, tensor<float32>:g, tensor<float32>:m, tensor<float32>:v, "
                          f"var<float64>:{lr}, var<float64>:0.9, var<float64>:0.999, var<float64>:1e-8, "
                          f"var<float64>:0.01, var<int32>:{step}) -> (tensor<float32>:w, tensor<float32>:m, "
                          f"tensor<float32>:v)")
    return instr


@pytest.mark.parametrize(("lr", "step"), [("0.001", 2), ("0.0005", 17), ("0.001", 1)])
def test_new_numbers_bind_as_bind_binds_them(lr, step):
    old = bind(_adamw("0.001", 1), ENV)
    new = _adamw(lr, step)
    assert rebind_numbers(old, new) == bind(new, ENV)
    (sgd,) = parse_text("sgd (tensor<float32>:w, tensor<float32>:g, tensor<float32>:b, var<float64>:0.1, "
                        "var<float64>:0.9) -> (tensor<float32>:w, tensor<float32>:b)")
    (sgd2,) = parse_text("sgd (tensor<float32>:w, tensor<float32>:g, tensor<float32>:b, var<float64>:0.05, "
                         "var<float64>:0.9) -> (tensor<float32>:w, tensor<float32>:b)")
    assert rebind_numbers(bind(sgd, ENV), sgd2) == bind(sgd2, ENV)


def test_numbers_bind_refuses_are_refused_with_its_message():
    old = bind(_adamw("0.001", 1), ENV)
    for bad in (_adamw("-1.0", 2), _adamw("0.001", 0)):
        with pytest.raises(DeepxError) as want:
            bind(bad, ENV)
        with pytest.raises(DeepxError) as got:
            rebind_numbers(old, bad)
        assert str(got.value) == str(want.value)
    with pytest.raises(DeepxError, match="no variable"):  # a variable's name: the caller binds it whole
        rebind_numbers(old, _adamw("lr_var", 2))


def test_ops_with_a_numbers_check_are_the_updates_and_rebind_as_bind_binds():
    """An op's `numbers` check stands for its rule where only numbers change: each such op, renumbered, binds as
    bind binds it (the same metas, bytes and args)."""
    from deepx_core.ir.ops import OPS

    assert sorted(name for name, d in OPS.items() if d.numbers is not None) == ["adam", "adamw", "sgd"]
    (adam,) = parse_text(str(_adamw("0.001", 1)).replace("adamw", "adam", 1))
    (adam2,) = parse_text(str(_adamw("0.002", 5)).replace("adamw", "adam", 1))
    assert rebind_numbers(bind(adam, ENV), adam2) == bind(adam2, ENV)
    text = ("sgd (tensor<float32>:w, tensor<float32>:g, tensor<float32>:b, var<float64>:0.1, var<float64>:{m}, "
            "var<float64>:0.0, var<float64>:0.0, var<bool>:{nesterov}, var<int32>:1) -> (tensor<float32>:w, "
            "tensor<float32>:b)")
    (sgd,) = parse_text(text.format(m="0.9", nesterov="false"))
    (bad,) = parse_text(text.format(m="0.0", nesterov="true"))
    with pytest.raises(DeepxError, match="nesterov needs momentum"):
        rebind_numbers(bind(sgd, ENV), bad)
