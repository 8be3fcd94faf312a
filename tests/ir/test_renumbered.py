"""instr.renumbered: a program that repeats a known one with new numbers in its optimizer updates only (Adam's step
count, a scheduled learning rate), which the daemon's caches then take as the same program."""

from __future__ import annotations

from deepx_core.ir import parse_text
from deepx_core.ir.instr import probe, rekinded, renumbered, scalar_kinds

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


def test_the_kinds_of_a_renumbered_program_are_found_again_at_its_updates_only():
    known = step()
    for new in (step(lr="0.05", step=2), step(lr="-0.0", wd="-0.0"), step(nesterov="true"), step()):
        varied = renumbered(new, known)
        assert rekinded(scalar_kinds(known), new, varied) == scalar_kinds(new)
