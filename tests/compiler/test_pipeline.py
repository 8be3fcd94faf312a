"""The pipeline: passes in order, switches, explain, and the bookkeeping that maps a rewritten program's result back
onto the program the client sent."""

from __future__ import annotations

import pytest

from deepx_core.errors import DeepxError
from deepx_core.ir.ops import TensorMeta
from deepxd.compiler import DEFAULT_PASSES, PASSES, PassContext, check_passes, explain, run_passes
from deepxd.compiler.analysis import existing_after
from deepxd.compiler.pipeline import Rewrites, original_error, original_times, repair
from deepxd.config import load_config
from tests.compiler.helpers import assert_same_results, lines, program, random_inputs

TEXT = """
    mulscalar (tensor<float32>:x, var<float32>:1.0) -> (tensor<float32>:t0)
    mul (tensor<float32>:t0, tensor<float32>:w) -> (tensor<float32>:t1)
    deltensor () -> (tensor<float32>:t0)
    mul (tensor<float32>:x, tensor<float32>:w) -> (tensor<float32>:t2)
    add (tensor<float32>:t1, tensor<float32>:t2) -> (tensor<float32>:t3)
    deltensor () -> (tensor<float32>:t1)
    deltensor () -> (tensor<float32>:t2)
    exp (tensor<float32>:t3) -> (tensor<float32>:dead)
    relu (tensor<float32>:t3) -> (tensor<float32>:y)
    deltensor () -> (tensor<float32>:t3)
    deltensor () -> (tensor<float32>:dead)
"""
METAS = {"x": TensorMeta((16, 8), "float32"), "w": TensorMeta((8,), "float32")}


def test_every_pass_in_order(rng):
    before, after = explain(program(TEXT), METAS, fetch={"y"})
    assert before.splitlines() == lines(program(TEXT))
    # simplify: t0 is x; cse: t2 is t1; dce: dead goes; fuse: the rest is one expression
    assert after.splitlines() == [
        "fused (listtensor<float32>:[x w], var<string>:maximum(in0 * in1 + in0 * in1, 0)) -> (tensor<float32>:y)"]
    inputs = random_inputs(rng, {"x": (16, 8), "w": (8,)}, lo=-2)
    assert_same_results(program(TEXT), program(after), inputs)


@pytest.mark.parametrize("name", list(PASSES))
def test_each_pass_can_run_alone_or_be_left_out(rng, name):
    inputs = random_inputs(rng, {"x": (16, 8), "w": (8,)}, lo=-2)
    alone = run_passes(program(TEXT), PassContext(metas=METAS), [name])
    without = run_passes(program(TEXT), PassContext(metas=METAS), [p for p in DEFAULT_PASSES if p != name])
    assert without != program(TEXT)
    # t2 repeats t1 only once simplify has made t0 x; TEXT has no products, colsums or transposes
    assert (alone != program(TEXT)) == (name in ("simplify", "dce", "fuse"))
    assert_same_results(program(TEXT), alone, inputs)
    assert_same_results(program(TEXT), without, inputs)


def test_origins_point_at_the_instruction_each_stands_for():
    ctx = PassContext(metas=METAS)
    out = run_passes(program(TEXT), ctx, ["simplify", "dce"])
    assert [i.name for i in out] == ["mul", "mul", "add", "deltensor", "deltensor", "relu", "deltensor"]
    assert ctx.origins == [1, 3, 4, 5, 6, 8, 9]


def test_programs_left_alone():
    no_delete = program("exp (tensor<float32>:x) -> (tensor<float32>:a)\n"
                        "exp (tensor<float32>:x) -> (tensor<float32>:b)")
    assert run_passes(no_delete, PassContext(metas=METAS)) == no_delete
    refused = program(TEXT.replace("tensor<float32>:w)", "tensor<float32>:nowhere)", 1))
    assert run_passes(refused, PassContext(metas=METAS)) == refused  # the worker reports the exact error
    assert run_passes(program(TEXT), PassContext(metas=METAS), []) == program(TEXT)


def test_switches_in_the_config():
    assert load_config(env={}).resolved().passes == list(DEFAULT_PASSES)
    assert load_config(env={"DEEPX_PASSES": "dce,fuse"}).resolved().passes == ["dce", "fuse"]
    assert load_config(env={"DEEPX_PASSES": "off"}).resolved().passes == []
    assert load_config(env={"DEEPX_FUSE_MIN_ELEMENTS": "4096"}).resolved().fuse_min_elements == 4096
    with pytest.raises(DeepxError, match="unknown pass 'fusion'"):
        load_config(env={"DEEPX_PASSES": "dce,fusion"}).resolved()
    assert check_passes(["none"]) == [] and check_passes([" cse "]) == ["cse"]


def test_times_and_errors_speak_of_the_original_program():
    # rewritten [a, b, c] standing for original instructions 1, 4 and 6 (of 7)
    times = [0.0, 1.0, 1.0, 3.0, 3.0, 6.0]
    assert original_times(times, [1, 4, 6], 7) == [0, 0, 0, 1, 1, 1, 1, 1, 1, 3, 3, 3, 3, 6]
    assert original_times(times[:2], [1, 4, 6], 4) == [0, 0, 0, 1, 1, 1, 1, 1]
    assert original_error("instruction 2: indexselect: index 9 out of range", [1, 4, 6]) == \
        "instruction 5: indexselect: index 9 out of range"
    assert original_error("fetch: tensor 'q' not found", [1]) == "fetch: tensor 'q' not found"


def test_repair_gives_the_tensors_the_original_prefix_would_have_left():
    original = program("""
        exp (tensor<float32>:x) -> (tensor<float32>:t)
        sqrt (tensor<float32>:t) -> (tensor<float32>:u)
        indexselect (tensor<float32>:x, tensor<int32>:i, var<int32>:0) -> (tensor<float32>:s)
        deltensor () -> (tensor<float32>:t)
        neg (tensor<float32>:u) -> (tensor<float32>:y)
        deltensor () -> (tensor<float32>:u)
    """)
    metas = {**METAS, "i": TensorMeta((3,), "int32")}
    ctx = PassContext(metas=metas)
    rewritten = run_passes(original, ctx, ["fuse"])
    assert [i.name for i in rewritten] == ["indexselect", "fused"]
    # the indexselect fails at run time: the original got as far as making t and u, which the rewrite never made;
    # their instructions make them again, with the values they had (x is as it was, t is made again first)
    done, fix = repair(original, rewritten, ctx.origins, 0, ctx)
    assert done == 2
    assert fix == original[:2]
    assert existing_after(original[:done], metas) == {"t": True, "u": True}


def test_repair_makes_zeros_where_the_values_are_gone():
    """A value made again needs its inputs as they were: x written since (or a named variable, which may have
    changed) leaves the name zeroed, as the only thing a client does with it is delete it."""
    original = program("""
        exp (tensor<float32>:x) -> (tensor<float32>:t)
        mulscalar (tensor<float32>:x, var<float32>:2.0) -> (tensor<float32>:x)
        mulscalar (tensor<float32>:w, var<float32>:alpha) -> (tensor<float32>:v)
        indexselect (tensor<float32>:x, tensor<int32>:i, var<int32>:0) -> (tensor<float32>:s)
    """)
    rewritten = [original[1], original[3]]  # as if a pass had dropped t and v, whose values end after the failure
    metas = {**METAS, "i": TensorMeta((3,), "int32")}
    ctx = PassContext(metas=metas, variables={"alpha": 3.0})
    done, fix = repair(original, rewritten, [1, 3], 1, ctx)
    assert done == 3
    assert lines(fix) == ["newtensor (vector<int32>:[16 8]) -> (tensor<float32>:t)",
                          "newtensor (vector<int32>:[8]) -> (tensor<float32>:v)"]
    # x untouched on both sides: t is made again
    done, fix = repair(original[:1] + original[2:], original[3:], [2], 0, ctx)
    assert done == 2 and lines(fix)[0] == "exp (tensor<float32>:x) -> (tensor<float32>:t)"


def renamed(prog: list, suffix: str, keep: frozenset[str] = frozenset({"x", "w"})) -> list:
    def sub(p):
        if p.category == "tensor" and p.value not in keep:
            return p._replace(value=f"{p.value}{suffix}")
        return p

    return [i._replace(args=tuple(map(sub, i.args)), returns=tuple(map(sub, i.returns)), meta=(("id", suffix),))
            for i in prog]


def test_the_rewrite_memo_rewrites_a_renamed_program_as_the_passes_would():
    cache = Rewrites()
    first = cache.run(program(TEXT), PassContext(metas=METAS, fetch=frozenset({"y"})))
    for suffix in ("_1", "_2"):
        prog = renamed(program(TEXT), suffix)
        ctx = PassContext(metas=METAS, fetch=frozenset({f"y{suffix}"}))
        got = cache.run(prog, ctx)
        want_ctx = PassContext(metas=METAS, fetch=frozenset({f"y{suffix}"}))
        assert got == run_passes(prog, want_ctx) and ctx.origins == want_ctx.origins
        assert got[0].meta == (("id", suffix),)  # the current program's metadata
    assert (cache.hits, cache.misses) == (2, 1)
    assert lines(first) != lines(got)


def test_the_rewrite_memo_tells_apart_what_changes_the_rewrite():
    cache = Rewrites()
    cache.run(program(TEXT), PassContext(metas=METAS))
    cache.run(program(TEXT), PassContext(metas=METAS, fetch=frozenset({"t3"})))  # a temporary fetched
    cache.run(program(TEXT), PassContext(metas={**METAS, "w": TensorMeta((16, 8), "float32")}))  # other metas
    cache.run(program(TEXT), PassContext(metas={**METAS, "t2": TensorMeta((16, 8), "float32")}))  # t2 exists
    assert (cache.hits, cache.misses) == (0, 4)
    for limit in (2, 3, 2):  # the least fused group: the same program, another rewrite; then the first again
        out = cache.run(program(TEXT), PassContext(metas=METAS, fuse_min_ops=limit))
        assert out == run_passes(program(TEXT), PassContext(metas=METAS, fuse_min_ops=limit))
    assert (cache.hits, cache.misses) == (2, 5)  # 2 missed once, then each limit found its own
    named = program("argset (var<float32>:1.0) -> (var<float32>:k)\n" + TEXT.replace(
        "var<float32>:1.0) -> (tensor<float32>:t0)", "var<float32>:k) -> (tensor<float32>:t0)"))
    for _ in range(2):
        out = cache.run(named, PassContext(metas=METAS))
    assert (cache.hits, cache.misses) == (2, 5) and out != named  # rewritten, never cached


def test_one_instruction_object_used_twice_is_checked_where_it_stands(rng):
    """A program may hold the same Instr object twice, seeing other tensors each time (here x's shape changes)."""
    twice = program("exp (tensor<float32>:x) -> (tensor<float32>:t)")[0]
    prog = [twice, *program("""
        neg (tensor<float32>:t) -> (tensor<float32>:u)
        deltensor () -> (tensor<float32>:t)
        reshape (tensor<float32>:x, vector<int32>:[8 16]) -> (tensor<float32>:x)
    """), twice, *program("""
        neg (tensor<float32>:t) -> (tensor<float32>:v)
        deltensor () -> (tensor<float32>:t)
    """)]
    prog += program("""
        sqrt (tensor<float32>:w) -> (tensor<float32>:dead)
        deltensor () -> (tensor<float32>:dead)
    """)
    inputs = random_inputs(rng, {"x": (16, 8), "w": (8,)})
    ctx = PassContext(metas=METAS)
    out = run_passes(prog, ctx, ["dce"])  # changes the program: the rest is checked again, twice twice
    assert len(out) == len(prog) - 2
    assert [b.outs[0].shape for b in ctx.bind(out) if b.instr is twice] == [(16, 8), (8, 16)]
    out = run_passes(prog, PassContext(metas=METAS, fuse_min_ops=2))  # the exp/neg pairs fused
    assert [b.outs[0].shape for b in PassContext(metas=METAS).bind(out) if b.op.name == "fused"] == [(16, 8), (8, 16)]
    assert_same_results(prog, out, inputs)


ADAM_STEP = TEXT + """
    adam (tensor<float32>:w, tensor<float32>:g, tensor<float32>:m, tensor<float32>:v, var<float32>:{lr}, \
var<float32>:0.9, var<float32>:0.999, var<float32>:1e-08, var<float32>:0.0, var<int32>:{step}) \
-> (tensor<float32>:w, tensor<float32>:m, tensor<float32>:v)
"""
ADAM_METAS = {**METAS, **{n: TensorMeta((8,), "float32") for n in ("g", "m", "v")}}


def test_the_rewrite_memo_takes_an_optimizer_update_with_new_numbers_as_the_same_program():
    """Adam's step count and a scheduled lr change every step: the plan holds for any of them, and each rewrite
    carries the update as it came (its numbers are never the plan's)."""
    cache = Rewrites()
    for step, lr in ((1, 0.1), (2, 0.1), (3, 0.05), (4, 0.025)):
        prog = program(ADAM_STEP.format(lr=lr, step=step))
        ctx = PassContext(metas=ADAM_METAS, fetch=frozenset({"y"}))
        got = cache.run(prog, ctx)
        want_ctx = PassContext(metas=ADAM_METAS, fetch=frozenset({"y"}))
        assert got == run_passes(prog, want_ctx) and ctx.origins == want_ctx.origins
        assert got[-1] is prog[-1]  # the very update sent
    assert (cache.hits, cache.misses) == (3, 1)
    other = program(ADAM_STEP.format(lr=0.1, step=5).replace("var<float32>:1.0)", "var<float32>:2.0)"))
    cache.run(other, PassContext(metas=ADAM_METAS, fetch=frozenset({"y"})))  # a number outside the update: new
    assert cache.misses == 2


# a Linear layer's forward and the weight and bias gradients after a ReLU, as autograd's rules write them
LINEAR_STEP = """
    transpose (tensor<float32>:w, vector<int32>:[1 0]) -> (tensor<float32>:wt)
    matmul (tensor<float32>:x, tensor<float32>:wt) -> (tensor<float32>:h)
    deltensor () -> (tensor<float32>:wt)
    fused (listtensor<float32>:[g h], var<string>:in0 * (in1 > 0.0)) -> (tensor<float32>:gh)
    sum (tensor<float32>:gh, vector<int32>:[0], var<bool>:false) -> (tensor<float32>:db)
    transpose (tensor<float32>:x, vector<int32>:[1 0]) -> (tensor<float32>:xt)
    matmul (tensor<float32>:xt, tensor<float32>:gh) -> (tensor<float32>:p)
    deltensor () -> (tensor<float32>:xt)
    deltensor () -> (tensor<float32>:gh)
    transpose (tensor<float32>:p, vector<int32>:[1 0]) -> (tensor<float32>:dw)
    deltensor () -> (tensor<float32>:p)
    deltensor () -> (tensor<float32>:h)
"""
LINEAR_METAS = {"x": TensorMeta((8, 6), "float32"), "w": TensorMeta((5, 6), "float32"),
                "g": TensorMeta((8, 5), "float32")}


def test_explain_shows_the_rewrites_into_internal_ops(rng):
    _, after = explain(program(LINEAR_STEP), LINEAR_METAS, fetch={"dw", "db"})
    assert after.splitlines() == [
        "matmultransposed (tensor<float32>:x, tensor<float32>:w, var<bool>:False, var<bool>:True) -> "
        "(tensor<float32>:h)",
        "fusedcolsum (listtensor<float32>:[g h], var<string>:in0 * (in1 > 0.0), var<bool>:False) -> "
        "(tensor<float32>:gh, tensor<float32>:db)",
        "matmultransposed (tensor<float32>:gh, tensor<float32>:x, var<bool>:True, var<bool>:False) -> "
        "(tensor<float32>:dw)",
        "deltensor () -> (tensor<float32>:gh)",
        "deltensor () -> (tensor<float32>:h)",
    ]
    inputs = random_inputs(rng, {"x": (8, 6), "w": (5, 6), "g": (8, 5)}, lo=-1)
    assert_same_results(program(LINEAR_STEP), program(after), inputs)


@pytest.mark.parametrize(("name", "shows"), [("transpose_products", "transpose (tensor<float32>:p"),
                                             ("fuse_colsum", "sum "), ("fold_transpose", "transpose ")])
def test_each_rewrite_into_internal_ops_can_be_switched_off(rng, name, shows):
    without = [p for p in DEFAULT_PASSES if p != name]
    _, after = explain(program(LINEAR_STEP), LINEAR_METAS, fetch={"dw", "db"}, passes=without)
    assert any(line.startswith(shows) for line in after.splitlines())
    _, full = explain(program(LINEAR_STEP), LINEAR_METAS, fetch={"dw", "db"})
    assert not any(line.startswith(shows) for line in full.splitlines())
    inputs = random_inputs(rng, {"x": (8, 6), "w": (5, 6), "g": (8, 5)}, lo=-1)
    assert_same_results(program(LINEAR_STEP), program(after), inputs)
    env = ",".join(without)
    assert load_config(env={"DEEPX_PASSES": env}).resolved().passes == without
