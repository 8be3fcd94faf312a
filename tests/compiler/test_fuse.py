"""fuse alone: chains and trees of elementwise ops on temporaries become one `fused` instruction whose results agree
with the unfused ops within the dtype's tolerance (float32, float64, float16; broadcasting; scalars; both kernels)."""

from __future__ import annotations

import numpy as np
import pytest

from deepx_core.ir.ops import OPS, parse_fused
from deepxd.compiler import fuse_elementwise as fuse
from deepxd.compiler.fuse import MAX_OPS, TEMPLATES
from deepxd.kernels.cpu import fused as fused_kernel
from tests.compiler.helpers import assert_same_results, executor, lines, program, random_inputs, rewrite

CHAIN = """
    mul (tensor<{d}>:x, tensor<{d}>:a) -> (tensor<{d}>:t1)
    add (tensor<{d}>:t1, tensor<{d}>:b) -> (tensor<{d}>:t2)
    deltensor () -> (tensor<{d}>:t1)
    exp (tensor<{d}>:t2) -> (tensor<{d}>:t3)
    deltensor () -> (tensor<{d}>:t2)
    mul (tensor<{d}>:t3, tensor<{d}>:c) -> (tensor<{d}>:t4)
    deltensor () -> (tensor<{d}>:t3)
    sub (tensor<{d}>:t4, tensor<{d}>:d) -> (tensor<{d}>:t5)
    deltensor () -> (tensor<{d}>:t4)
    abs (tensor<{d}>:t5) -> (tensor<{d}>:t6)
    deltensor () -> (tensor<{d}>:t5)
    sqrt (tensor<{d}>:t6) -> (tensor<{d}>:y)
    deltensor () -> (tensor<{d}>:t6)
"""


@pytest.fixture(params=list(fused_kernel.BACKENDS))
def backend(request: pytest.FixtureRequest):
    previous = fused_kernel.set_backend(request.param)
    yield request.param
    fused_kernel.set_backend(previous)


def tol(dtype: str, backend: str) -> tuple[float, float] | None:
    # numexpr's own exp/sqrt differ from numpy's by an ulp or two in float32; cancellation in `- d` amplifies it
    return (1e-4, 1e-5) if backend == "numexpr" and dtype == "float32" else None


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_a_chain_becomes_one_instruction(rng, backend, dtype):
    shapes = {"x": (64, 33), "a": (64, 33), "b": (33,), "c": (64, 1), "d": ()}
    inputs = random_inputs(rng, shapes, dtype)
    before, after, ctx = rewrite(fuse, CHAIN.format(d=dtype), inputs)
    assert lines(after) == [f"fused (listtensor<{dtype}>:[x a b c d], "
                            f"var<string>:sqrt(abs(exp(in0 * in1 + in2) * in3 - in4))) -> (tensor<{dtype}>:y)"]
    assert ctx.origins == [11] and ctx.stats["fuse"] == 7
    assert_same_results(before, after, inputs, tol(dtype, backend))


def test_a_tree_with_scalars_and_broadcasting(rng, backend):
    inputs = random_inputs(rng, {"x": (8, 1, 5), "y": (7, 1), "z": (5,)}, "float64", -2, 2)
    before, after, _ = rewrite(fuse, """
        mulscalar (tensor<float64>:x, var<float64>:-2.5) -> (tensor<float64>:p)
        rsubscalar (var<int32>:3, tensor<float64>:y) -> (tensor<float64>:q)
        add (tensor<float64>:p, tensor<float64>:q) -> (tensor<float64>:s)
        deltensor () -> (tensor<float64>:p)
        deltensor () -> (tensor<float64>:q)
        sigmoid (tensor<float64>:z) -> (tensor<float64>:g)
        maxscalar (tensor<float64>:s, var<float64>:0.5) -> (tensor<float64>:m)
        mul (tensor<float64>:m, tensor<float64>:g) -> (tensor<float64>:out)
        deltensor () -> (tensor<float64>:s)
        deltensor () -> (tensor<float64>:m)
        deltensor () -> (tensor<float64>:g)
    """, inputs)
    # p and q broadcast into s (8, 7, 5): computed at their own shapes, they stay out; g (5,) too
    assert lines(after) == [
        "mulscalar (tensor<float64>:x, var<float64>:-2.5) -> (tensor<float64>:p)",
        "rsubscalar (var<int32>:3, tensor<float64>:y) -> (tensor<float64>:q)",
        "sigmoid (tensor<float64>:z) -> (tensor<float64>:g)",
        "fused (listtensor<float64>:[p q g], var<string>:maximum(in0 + in1, 0.5) * in2) -> (tensor<float64>:out)",
        "deltensor () -> (tensor<float64>:p)",
        "deltensor () -> (tensor<float64>:q)",
        "deltensor () -> (tensor<float64>:g)",
    ]
    assert_same_results(before, after, inputs, (1e-12, 1e-15))


def test_a_tree_of_same_shaped_temporaries_fuses_whole(rng, backend):
    inputs = random_inputs(rng, {"a": (300,), "b": (300,), "c": (300,), "d": (300,)}, "float32")
    before, after, _ = rewrite(fuse, """
        mul (tensor<float32>:a, tensor<float32>:b) -> (tensor<float32>:ab)
        mul (tensor<float32>:c, tensor<float32>:d) -> (tensor<float32>:cd)
        add (tensor<float32>:ab, tensor<float32>:cd) -> (tensor<float32>:s)
        neg (tensor<float32>:s) -> (tensor<float32>:n)
        powscalar (tensor<float32>:n, var<int32>:2) -> (tensor<float32>:out)
        deltensor () -> (tensor<float32>:ab)
        deltensor () -> (tensor<float32>:cd)
        deltensor () -> (tensor<float32>:s)
        deltensor () -> (tensor<float32>:n)
    """, inputs)
    assert lines(after) == [
        "fused (listtensor<float32>:[a b c d], var<string>:(-(in0 * in1 + in2 * in3)) ** 2) -> (tensor<float32>:out)"]
    assert_same_results(before, after, inputs, tol("float32", backend))


def test_what_does_not_join_a_group(rng):
    inputs = random_inputs(rng, {"x": (6,), "y": (6,)})
    text = """
        exp (tensor<float32>:x) -> (tensor<float32>:twice)
        add (tensor<float32>:twice, tensor<float32>:y) -> (tensor<float32>:u)
        mul (tensor<float32>:twice, tensor<float32>:y) -> (tensor<float32>:v)
        exp (tensor<float32>:y) -> (tensor<float32>:kept)
        sqrt (tensor<float32>:kept) -> (tensor<float32>:w)
        exp (tensor<float32>:y) -> (tensor<float32>:heap)
        neg (tensor<float32>:heap) -> (tensor<float32>:h2)
        deltensor () -> (tensor<float32>:twice)
        deltensor () -> (tensor<float32>:heap)
    """
    before, after, _ = rewrite(fuse, text, inputs, keep=frozenset({"heap"}))
    assert after == before  # read twice; survives the program; a heap tensor


def test_a_changed_input_keeps_the_ops_apart(rng):
    inputs = random_inputs(rng, {"x": (6,), "y": (6,)})
    before, after, _ = rewrite(fuse, """
        mul (tensor<float32>:x, tensor<float32>:y) -> (tensor<float32>:t)
        constant (var<float32>:1.0) -> (tensor<float32>:x)
        add (tensor<float32>:t, tensor<float32>:x) -> (tensor<float32>:z)
        deltensor () -> (tensor<float32>:t)
    """, inputs)
    assert after == before
    assert_same_results(before, after, inputs)


def test_a_root_in_place(rng, backend):
    inputs = random_inputs(rng, {"x": (4, 1000), "y": (1000,)})
    before, after, _ = rewrite(fuse, """
        mul (tensor<float32>:x, tensor<float32>:y) -> (tensor<float32>:t)
        add (tensor<float32>:t, tensor<float32>:x) -> (tensor<float32>:x)
        deltensor () -> (tensor<float32>:t)
    """, inputs, fuse_min_ops=2)
    assert lines(after) == ["fused (listtensor<float32>:[x y], var<string>:in0 * in1 + in0) -> (tensor<float32>:x)"]
    assert_same_results(before, after, inputs)


def test_only_float_tensors_finite_scalars_and_big_enough_results(rng):
    ints = {"i": rng.integers(1, 5, (6,)).astype(np.int32)}
    text = """
        mulscalar (tensor<int32>:i, var<int32>:2) -> (tensor<int32>:t)
        addscalar (tensor<int32>:t, var<int32>:1) -> (tensor<int32>:u)
        deltensor () -> (tensor<int32>:t)
    """
    assert rewrite(fuse, text, ints, fuse_min_ops=2)[1] == rewrite(fuse, text, ints)[0]
    floats = random_inputs(rng, {"x": (6,)})
    text = """
        exp (tensor<float32>:x) -> (tensor<float32>:t)
        maxscalar (tensor<float32>:t, var<float32>:-inf) -> (tensor<float32>:u)
        deltensor () -> (tensor<float32>:t)
    """
    before, after, _ = rewrite(fuse, text, floats, fuse_min_ops=2)
    assert after == before
    text = text.replace("-inf", "2.0")
    assert len(rewrite(fuse, text, floats, fuse_min_ops=2)[1]) == 1
    assert rewrite(fuse, text, floats, fuse_min_elements=7, fuse_min_ops=2)[1] == rewrite(fuse, text, floats)[0]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_low_precision_computes_in_float32_and_rounds_once(rng, dtype):
    inputs = random_inputs(rng, {"x": (50,), "a": (50,), "b": (50,), "c": (50,), "d": (50,)}, dtype)
    before, after, _ = rewrite(fuse, CHAIN.format(d=dtype), inputs)
    assert len(after) == 1
    rtol = {"float16": 1e-2, "bfloat16": 6e-2}[dtype]  # the unfused chain rounds six times
    assert_same_results(before, after, inputs, (rtol, rtol))


def test_every_template_is_a_valid_fused_expression():
    forms = [TEMPLATES[name] for name in OPS if TEMPLATES[name] is not None]
    assert len(forms) >= 27  # every op of the catalogue that has an expression (OpDef.expr)
    for form in forms:
        parse_fused(form.text.format("in0", "in1", s="2.5"), 2)


_UNARY = ["neg", "abs", "tanh", "sigmoid", "relu", "silu", "sin", "cos", "exp"]
_BINARY = ["add", "sub", "mul", "max", "min"]
_SCALAR = ["addscalar", "subscalar", "mulscalar", "maxscalar", "minscalar", "rsubscalar", "divscalar"]


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_random_chains_agree_with_the_unfused_ops(rng, backend, dtype):
    """Random trees over every op the pass fuses (sqrt, log, pow, div after abs and +1): fused == unfused."""
    fused_ops = set()
    groups = 0
    for _ in range(25):
        shapes = {"x": (5, 40), "y": (40,), "z": (5, 1)}
        inputs = random_inputs(rng, shapes, dtype, -2, 2)
        live = [("x", (5, 40)), ("y", (40,)), ("z", (5, 1))]
        text: list[str] = []
        temps: list[str] = []
        for k in range(int(rng.integers(3, 9))):
            t = f"t{k}"
            kind = rng.integers(0, 4)
            a = live[int(rng.integers(0, len(live)))][0]
            if kind == 0:
                op = str(rng.choice(_UNARY))
                text.append(f"{op} (tensor<{dtype}>:{a}) -> (tensor<{dtype}>:{t})")
            elif kind == 1:
                op = str(rng.choice(_BINARY))
                b = live[int(rng.integers(0, len(live)))][0]
                text.append(f"{op} (tensor<{dtype}>:{a}, tensor<{dtype}>:{b}) -> (tensor<{dtype}>:{t})")
            elif kind == 2:
                op = str(rng.choice(_SCALAR))
                s = float(np.round(rng.uniform(0.5, 2), 3))
                args = (f"var<float64>:{s}, tensor<{dtype}>:{a}" if op.startswith("r")
                        else f"tensor<{dtype}>:{a}, var<float64>:{s}")
                text.append(f"{op} ({args}) -> (tensor<{dtype}>:{t})")
            else:  # domain-safe: f(|a| + 1)
                op = str(rng.choice(["sqrt", "log", "powscalar", "rdivscalar", "div"]))
                text.append(f"abs (tensor<{dtype}>:{a}) -> (tensor<{dtype}>:{t}a)")
                text.append(f"addscalar (tensor<{dtype}>:{t}a, var<float64>:1.0) -> (tensor<{dtype}>:{t}b)")
                temps += [f"{t}a", f"{t}b"]
                if op in ("sqrt", "log"):
                    text.append(f"{op} (tensor<{dtype}>:{t}b) -> (tensor<{dtype}>:{t})")
                elif op == "powscalar":
                    text.append(f"powscalar (tensor<{dtype}>:{t}b, var<float64>:1.5) -> (tensor<{dtype}>:{t})")
                elif op == "rdivscalar":
                    text.append(f"rdivscalar (var<float64>:2.0, tensor<{dtype}>:{t}b) -> (tensor<{dtype}>:{t})")
                else:
                    text.append(f"div (tensor<{dtype}>:{a}, tensor<{dtype}>:{t}b) -> (tensor<{dtype}>:{t})")
            fused_ops.add(op)
            live.append((t, ()))
            temps.append(t)
        text += [f"deltensor () -> (tensor<{dtype}>:{t})" for t in temps[:-1]]
        before, after, _ = rewrite(fuse, "\n".join(text), inputs)
        groups += sum(i.name == "fused" for i in after)
        rtol = {"float32": 1e-4 if backend == "numexpr" else 2e-5, "float64": 1e-12}[dtype]
        assert_same_results(before, after, inputs, (rtol, rtol))
    assert len(fused_ops) > 10 and groups >= 10


POOLED = """
    mul (tensor<float32>:x, tensor<float32>:a) -> (tensor<float32>:p3)
    add (tensor<float32>:p3, tensor<float32>:b) -> (tensor<float32>:p4)
    exp (tensor<float32>:p4) -> (tensor<float32>:p3)
    mulscalar (tensor<float32>:p3, var<float32>:0.5) -> (tensor<float32>:p4)
    sub (tensor<float32>:p4, tensor<float32>:a) -> (tensor<float32>:p3)
    abs (tensor<float32>:p3) -> (tensor<float32>:p4)
    sqrt (tensor<float32>:p4) -> (tensor<float32>:p3)
"""


def test_a_client_that_reuses_names_gets_its_chain_fused(rng, backend):
    """The SDK writes new results into the names of dropped ones (p3, p4 ping-pong): each value ends when its name
    is written again. p4's last value survives the program, so the last op stays apart."""
    inputs = random_inputs(rng, {"x": (30, 40), "a": (30, 40), "b": (40,), "p3": (30, 40), "p4": (30, 40)})
    before, after, _ = rewrite(fuse, POOLED, inputs, fetch={"p3"})
    assert lines(after) == [
        "fused (listtensor<float32>:[x a b], var<string>:abs(exp(in0 * in1 + in2) * 0.5 - in1)) -> "
        "(tensor<float32>:p4)",
        "sqrt (tensor<float32>:p4) -> (tensor<float32>:p3)",
    ]
    assert_same_results(before, after, inputs, tol("float32", backend))
    fresh = {k: v for k, v in inputs.items() if k not in ("p3", "p4")}  # the first time, the names are new
    before, after, _ = rewrite(fuse, POOLED, fresh, fetch={"p3"})
    assert len(after) == 2
    assert_same_results(before, after, fresh, tol("float32", backend))


def test_a_pooled_chain_longer_than_a_group_is_cut_only_at_the_op_limit(rng):
    """A ping-pong chain of 70 ops through two pooled names: groups of MAX_OPS ops, never 2-op groups (the root of
    a group writing into its own input's name does not stop the next op from joining it)."""
    lines_ = ["mul (tensor<float32>:x, tensor<float32>:a) -> (tensor<float32>:p0)"]
    for k in range(1, 70):
        src, dst = f"p{(k + 1) % 2}", f"p{k % 2}"
        lines_.append(f"addscalar (tensor<float32>:{src}, var<float32>:0.5) -> (tensor<float32>:{dst})" if k % 2
                      else f"mul (tensor<float32>:{src}, tensor<float32>:a) -> (tensor<float32>:{dst})")
    inputs = random_inputs(rng, {"x": (64,), "a": (64,), "p0": (64,), "p1": (64,)}, lo=0.2, hi=0.9)
    before, after, _ = rewrite(fuse, "\n".join(lines_), inputs)
    sizes = [i.args[1].value.count("*") + i.args[1].value.count("+") for i in after if i.name == "fused"]
    # the last op's operand (p0) survives the program: the last op stays apart
    assert sizes == [MAX_OPS, MAX_OPS, 5] and [i.name for i in after] == ["fused"] * 3 + ["addscalar"]
    assert_same_results(before, after, inputs)


_POOL_UNARY = ["neg", "abs", "tanh", "relu", "exp", "sigmoid"]
_POOL_BINARY = ["add", "sub", "mul", "max"]


def _pooled_program(rng: np.random.Generator, dtype: str, exists: set[str]) -> tuple[str, set[str]]:
    """A random program as a client with a name pool records it: results go into a few names (p0..p3) again and
    again, in place too; some are deleted, some read by an op the pass never fuses (matmul, sum), whose results
    survive; x, a and b are overwritten now and then. Returns its text and the names it may fetch."""
    pool = [f"p{k}" for k in range(4)]
    live = [n for n in ("x", "a", "b", *pool) if n in exists]
    out: list[str] = []
    kept = 0
    for _ in range(int(rng.integers(8, 40))):
        roll = rng.random()
        src = str(rng.choice(live))
        dst = str(rng.choice(pool if rng.random() < 0.9 else ["x", "a", "b"]))
        if roll < 0.08 and len(live) > 2 and src in pool:
            out.append(f"deltensor () -> (tensor<{dtype}>:{src})")
            live.remove(src)
            continue
        if roll < 0.16:
            op = ("matmul (tensor<{d}>:{a}, tensor<{d}>:{b}) -> (tensor<{d}>:k{k})" if rng.random() < 0.5 else
                  "sum (tensor<{d}>:{a}, vector<int32>:[0], var<bool>:false) -> (tensor<{d}>:k{k})")
            out.append(op.format(d=dtype, a=src, b=str(rng.choice(live)), k=kept))
            kept += 1
            continue
        if roll < 0.45:
            text = f"{rng.choice(_POOL_UNARY)} (tensor<{dtype}>:{src}) -> (tensor<{dtype}>:{dst})"
        elif roll < 0.75:
            other = str(rng.choice(live))
            text = (f"{rng.choice(_POOL_BINARY)} (tensor<{dtype}>:{src}, tensor<{dtype}>:{other}) -> "
                    f"(tensor<{dtype}>:{dst})")
        else:
            s = float(np.round(rng.uniform(0.25, 0.75), 3))
            op = str(rng.choice(["mulscalar", "addscalar", "rsubscalar"]))
            args = f"var<float64>:{s}, tensor<{dtype}>:{src}" if op == "rsubscalar" else \
                f"tensor<{dtype}>:{src}, var<float64>:{s}"
            text = f"{op} ({args}) -> (tensor<{dtype}>:{dst})"
        out.append(text)
        if dst not in live:
            live.append(dst)
    fetchable = {n for n in live if rng.random() < 0.3}
    return "\n".join(out), fetchable


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_random_programs_with_reused_names_agree_with_the_unfused_ops(rng, dtype):
    """Fusing across names a program writes again is safe: random pooled programs (in place writes, deletes, reads
    by unfusable ops, inputs overwritten) give the same tensors, every one that exists afterwards with its value,
    fused or not, with the pool's names existing before the program or new in it."""
    fused_ops = 0
    for trial in range(120):
        shapes = {n: (6, 6) for n in ("x", "a", "b", "p0", "p1", "p2", "p3")}
        if trial % 3 == 0:  # the first program of a session: the pool's names are new
            shapes = {n: s for n, s in shapes.items() if not n.startswith("p")}
        inputs = random_inputs(rng, shapes, dtype, -1, 1)
        text, fetch = _pooled_program(rng, dtype, set(shapes))
        before, after, _ = rewrite(fuse, text, inputs, fetch=fetch, fuse_min_ops=2)  # pairs too: more cases
        fused_ops += sum(i.name == "fused" for i in after)
        rtol = {"float32": 2e-5, "float64": 1e-12}[dtype]
        assert_same_results(before, after, inputs, (rtol, 1e-6 if dtype == "float32" else 1e-12))
    assert fused_ops >= 100


def test_one_element_blocks_run_a_tape_that_never_writes_its_operand(rng):
    """numpy is slow writing a one-element ufunc result into its own operand: those blocks run a second tape with no
    in-place step, which computes what the in-place tape does."""
    expr = "-maximum(maximum(in0 * in1 + 0.5 - in0, 0) * 0.5 + in1, in0) + exp(in1) * (in0 - 1.5)"
    plan = fused_kernel.compile_expr(expr, 2)
    assert any((2, s.dest) in s.operands for s in plan.steps)  # the big blocks' tape works in place
    assert not any((2, s.dest) in s.operands for s in plan.small) and len(plan.small) == len(plan.steps)
    x = rng.uniform(-1, 1, (2, 9))
    consts = tuple(np.float64(c) for c in plan.constants)
    regs = [np.empty(9) for _ in range(plan.registers)]
    want = np.empty(9)
    plan.run([x[0], x[1]], consts, regs, want)
    np.testing.assert_allclose(want, -np.maximum(np.maximum(x[0] * x[1] + 0.5 - x[0], 0) * 0.5 + x[1], x[0])
                               + np.exp(x[1]) * (x[0] - 1.5), rtol=1e-15)
    for k in range(9):
        one = np.empty(1)
        plan.run([x[0, k:k + 1], x[1, k:k + 1]], consts, [r[:1] for r in regs], one)
        assert one[0] == want[k]


def test_pairs_stay_unfused_by_default(rng):
    """A fused pair costs more than its two ops (bench/fusion.py --crossover): groups of fuse_min_ops (3) or more,
    below fuse_pair_min_elements."""
    inputs = random_inputs(rng, {"x": (64,), "a": (64,)})
    pair = """
        mul (tensor<float32>:x, tensor<float32>:a) -> (tensor<float32>:t)
        addscalar (tensor<float32>:t, var<float32>:0.5) -> (tensor<float32>:y)
        deltensor () -> (tensor<float32>:t)
    """
    before, after, ctx = rewrite(fuse, pair, inputs)
    assert after == before and ctx.fuse_min_ops == 3
    assert [i.name for i in rewrite(fuse, pair, inputs, fuse_min_ops=2)[1]] == ["fused"]
    three = pair.replace(":y)", ":u)") + """
        neg (tensor<float32>:u) -> (tensor<float32>:y)
        deltensor () -> (tensor<float32>:u)
    """
    before, after, _ = rewrite(fuse, three, inputs)
    assert lines(after) == ["fused (listtensor<float32>:[x a], var<string>:-(in0 * in1 + 0.5)) -> (tensor<float32>:y)"]
    assert_same_results(before, after, inputs)


def test_a_large_pair_fuses_where_native_kernels_run_it(rng):
    """From fuse_pair_min_elements (32K, where this process has native kernels) a pair fuses: a Linear's bias add
    and the ReLU after it become one pass over memory. Smaller pairs, and every pair with the threshold at 0 (no
    native kernels), stay apart."""
    from deepxd.compiler.analysis import FUSE_PAIR_MIN_ELEMENTS, default_pair_min
    from deepxd.kernels.cpu import native

    assert default_pair_min() == (FUSE_PAIR_MIN_ELEMENTS if native.available() else 0)
    rows = FUSE_PAIR_MIN_ELEMENTS // 64
    pair = """
        add (tensor<float32>:z, tensor<float32>:b) -> (tensor<float32>:t)
        relu (tensor<float32>:t) -> (tensor<float32>:y)
        deltensor () -> (tensor<float32>:t)
    """
    inputs = random_inputs(rng, {"z": (rows, 64), "b": (64,)})
    before, after, _ = rewrite(fuse, pair, inputs, fuse_pair_min_elements=FUSE_PAIR_MIN_ELEMENTS)
    assert lines(after) == ["fused (listtensor<float32>:[z b], var<string>:maximum(in0 + in1, 0)) -> "
                            "(tensor<float32>:y)"]
    assert_same_results(before, after, inputs)
    assert rewrite(fuse, pair, inputs, fuse_pair_min_elements=0)[1] == before
    small = random_inputs(rng, {"z": (rows - 1, 64), "b": (64,)})
    assert rewrite(fuse, pair, small, fuse_pair_min_elements=FUSE_PAIR_MIN_ELEMENTS)[1] == program(pair)
    # a pair whose intermediate lives on (not deleted) stays apart at any size
    kept = pair.replace("deltensor () -> (tensor<float32>:t)", "")
    assert rewrite(fuse, kept, inputs, fuse_pair_min_elements=FUSE_PAIR_MIN_ELEMENTS)[1] == program(kept)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("op", ["sigmoid", "silu"])
def test_fused_sigmoid_and_silu_are_the_kernels_bit_for_bit_in_both_tails(backend, dtype, op):
    """The fused forms were 1 / (1 + exp(-x)): -log(sigmoid(-100)) came out inf where the kernel gives 100, and
    values within range differed in the last bit (found by a differential fuzzer). They are the kernels' stable form
    now: the same bits everywhere, infinities, signed zeros and NaN included."""
    rng = np.random.default_rng(7)
    x = np.concatenate([rng.standard_normal(4000) * 30, [-1e4, -100, -90, -20, -0.0, 0.0, 20, 1e4, np.inf, -np.inf,
                                                          np.nan]]).astype(dtype)
    before, after, _ = rewrite(fuse, f"""
        {op} (tensor<{dtype}>:x) -> (tensor<{dtype}>:a)
        log (tensor<{dtype}>:a) -> (tensor<{dtype}>:b)
        neg (tensor<{dtype}>:b) -> (tensor<{dtype}>:y)
        deltensor () -> (tensor<{dtype}>:a)
        deltensor () -> (tensor<{dtype}>:b)
    """, {"x": x})
    assert after[0].name == "fused"
    # numexpr's exp is libm's, not numpy's: there the same values within the dtype's rounding, tails included
    want = assert_same_results(before, after, {"x": x}, (0, 0) if backend != "numexpr" else None)
    got = executor({"x": x})
    got.run_all(after)
    if backend != "numexpr":
        np.testing.assert_array_equal(got.tensors["y"], want["y"])  # NaN where NaN, to the bit
    assert np.array_equal(np.isinf(got.tensors["y"]), np.isinf(want["y"]))
