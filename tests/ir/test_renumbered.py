"""instr.renumbered: a program that repeats a known one with new numbers in its optimizer updates only (Adam's step
count, a scheduled learning rate), which the daemon's caches then take as the same program."""

from __future__ import annotations

from deepx_core.ir import parse_text
from deepx_core.ir.instr import probe, renumbered, same_kinds, scalar_kinds

STEP = """
    mul (tensor<float32>:x, tensor<float32>:w) -> (tensor<float32>:t)
    mulscalar (tensor<float32>:t, var<float32>:{scale}) -> (tensor<float32>:y)
    sgd (tensor<float32>:w, tensor<float32>:g, tensor<float32>:b, var<float32>:{lr}, var<float32>:0.9, \
var<float32>:0.0, var<float32>:0.0, var<bool>:{nesterov}, var<int32>:{step}) -> (tensor<float32>:w, tensor<float32>:b)
    adam (tensor<float32>:p, tensor<float32>:q, tensor<float32>:m, tensor<float32>:v, var<float32>:{lr}, \
var<float32>:0.9, var<float32>:0.999, var<float32>:1e-08, var<float32>:{wd}, var<int32>:{step}) \
-> (tensor<float32>:p, tensor<float32>:m, tensor<float32>:v)
"""


def step(scale="2.0", lr="0.1", nesterov="false", step=1, wd="0.0", **replace):
    text = STEP.format(scale=scale, lr=lr, nesterov=nesterov, step=step, wd=wd)
    for a, b in replace.items():
        text = text.replace(a, b)
    return parse_text(text)


def test_only_the_updates_numbers_may_differ():
    known = step()
    assert renumbered(step(), known) == []
    assert renumbered(step(lr="0.05", step=2), known) == [2, 3]
    assert renumbered(step(step=7), known) == [2, 3]
    assert renumbered(step(nesterov="true"), known) == [2]
    assert probe(step(lr="0.05", step=9)) == probe(known)  # one key for both


def test_anything_else_makes_another_program():
    known = step()
    assert renumbered(step(scale="3.0"), known) is None  # a number outside an update
    assert renumbered(step(lr="-0.0"), step(lr="0.0")) == [2, 3]  # an update's zero may change sign
    assert renumbered(step(scale="-0.0"), step(scale="0.0")) is None  # elsewhere the sign of a zero counts
    assert renumbered(step(lr="1"), known) is None  # a number of another type
    assert renumbered(step(lr="lr_var"), known) is None  # a variable's name in place of a number
    assert renumbered(step(**{"tensor<float32>:g": "tensor<float32>:h"}), known) is None  # another tensor
    assert renumbered(step()[:-1], known) is None


def test_same_kinds_tells_whether_a_renumbered_program_keeps_the_scalar_kinds():
    """A plan renumbered keeps its scalar_kinds where same_kinds says so: they are then the new program's."""
    known = step()
    for new in (step(lr="0.05", step=2), step(step=7), step(nesterov="true"), step(lr="-0.0"), step(wd="1e-4"),
                step(lr="0.0")):
        varied = renumbered(new, known)
        assert varied is not None
        assert same_kinds(new, known, varied) == (scalar_kinds(new) == scalar_kinds(known)), new
    assert not same_kinds(step(lr="-0.0"), known, [2, 3]) and not same_kinds(step(wd="-0.0"), known, [3])
    assert not same_kinds(step(wd="0.5"), known, [3]) and same_kinds(step(wd="0.5"), step(wd="0.25"), [3])
