"""dce alone: dead temporaries and their deltensors go; whatever lives outside the program, or has effects, stays."""

from __future__ import annotations

from deepxd.compiler import eliminate_dead_code
from tests.compiler.helpers import assert_same_results, lines, random_inputs, rewrite

SHAPES = {"x": (4, 5), "y": (4, 5)}


def test_a_dead_chain_goes_with_its_deltensors(rng):
    inputs = random_inputs(rng, SHAPES)
    before, after, ctx = rewrite(eliminate_dead_code, """
        exp (tensor<float32>:x) -> (tensor<float32>:t1)
        add (tensor<float32>:t1, tensor<float32>:y) -> (tensor<float32>:t2)
        mul (tensor<float32>:x, tensor<float32>:y) -> (tensor<float32>:z)
        deltensor () -> (tensor<float32>:t1)
        sqrt (tensor<float32>:z) -> (tensor<float32>:z2)
        deltensor () -> (tensor<float32>:t2)
    """, inputs)
    assert lines(after) == [
        "mul (tensor<float32>:x, tensor<float32>:y) -> (tensor<float32>:z)",
        "sqrt (tensor<float32>:z) -> (tensor<float32>:z2)",
    ]
    assert ctx.stats["dce"] == 2
    assert ctx.origins == [2, 4]
    assert_same_results(before, after, inputs)


def test_results_that_are_read_kept_or_fetched_stay(rng):
    inputs = random_inputs(rng, SHAPES)
    text = """
        exp (tensor<float32>:x) -> (tensor<float32>:read)
        sqrt (tensor<float32>:read) -> (tensor<float32>:kept)
        deltensor () -> (tensor<float32>:read)
        exp (tensor<float32>:y) -> (tensor<float32>:fetched)
        neg (tensor<float32>:y) -> (tensor<float32>:later)
    """
    before, after, _ = rewrite(eliminate_dead_code, text, inputs, fetch={"fetched"})
    assert after == before


def test_a_dead_write_to_a_tensor_that_lived_before_goes_but_the_tensor_stays_until_its_deltensor(rng):
    inputs = random_inputs(rng, SHAPES)
    before, after, _ = rewrite(eliminate_dead_code, """
        exp (tensor<float32>:y) -> (tensor<float32>:x)
        deltensor () -> (tensor<float32>:x)
    """, inputs)
    assert lines(after) == ["deltensor () -> (tensor<float32>:x)"]
    assert_same_results(before, after, inputs)


def test_heap_tensors_keep_every_write_and_fetched_ones_their_last(rng):
    inputs = random_inputs(rng, SHAPES)
    text = """
        exp (tensor<float32>:y) -> (tensor<float32>:x)
        deltensor () -> (tensor<float32>:x)
        exp (tensor<float32>:y) -> (tensor<float32>:f)
        neg (tensor<float32>:y) -> (tensor<float32>:f)
    """
    before, after, _ = rewrite(eliminate_dead_code, text, inputs, fetch={"f"}, keep=frozenset({"x"}))
    assert after == before[:2] + before[3:]
    assert_same_results(before, after, inputs)


def test_a_value_overwritten_before_any_read_is_dead(rng):
    """A client that reuses the names of dropped results (a pool) overwrites instead of deleting."""
    inputs = random_inputs(rng, SHAPES)
    before, after, _ = rewrite(eliminate_dead_code, """
        exp (tensor<float32>:x) -> (tensor<float32>:p)
        mul (tensor<float32>:x, tensor<float32>:y) -> (tensor<float32>:q)
        neg (tensor<float32>:y) -> (tensor<float32>:p)
        add (tensor<float32>:q, tensor<float32>:p) -> (tensor<float32>:r)
        sqrt (tensor<float32>:x) -> (tensor<float32>:q)
    """, inputs)
    assert lines(after) == lines(before)[1:]  # p's first value is never read; the others are, or survive
    assert_same_results(before, after, inputs)


def test_a_write_that_a_fill_depends_on_stays(rng):
    inputs = random_inputs(rng, SHAPES)
    before, after, _ = rewrite(eliminate_dead_code, """
        exp (tensor<float32>:x) -> (tensor<float32>:t)
        constant (var<float32>:2.0) -> (tensor<float32>:t)
        add (tensor<float32>:t, tensor<float32>:x) -> (tensor<float32>:z)
        todtype (tensor<float32>:x) -> (tensor<float64>:u)
        todtype (tensor<float32>:y) -> (tensor<float32>:u)
        deltensor () -> (tensor<float32>:t)
    """, inputs)
    # constant needs t to exist; the second todtype casts into u's existing dtype (float64)
    assert after == before
    assert_same_results(before, after, inputs)


def test_in_place_writes_and_effects_stay(rng):
    inputs = random_inputs(rng, SHAPES)
    before, after, _ = rewrite(eliminate_dead_code, """
        exp (tensor<float32>:x) -> (tensor<float32>:t)
        addscalar (tensor<float32>:t, var<float32>:1.0) -> (tensor<float32>:t)
        print (tensor<float32>:t) -> ()
        deltensor () -> (tensor<float32>:t)
        newtensor (vector<int32>:[3]) -> (tensor<float32>:n)
        argset (var<float32>:2.0) -> (var<float32>:two)
        deltensor () -> (tensor<float32>:n)
    """, inputs)
    assert after == before


def test_a_heap_tensor_made_in_the_program_stays(rng):
    inputs = random_inputs(rng, SHAPES)
    before, after, _ = rewrite(eliminate_dead_code, """
        newtensor (vector<int32>:[4 5]) -> (tensor<float32>:h) // kind=heap
        exp (tensor<float32>:x) -> (tensor<float32>:h)
        deltensor () -> (tensor<float32>:h)
    """, inputs)
    assert after == before


def test_a_write_overwritten_before_any_read_is_dead_only_when_the_last_one_is(rng):
    inputs = random_inputs(rng, SHAPES)
    before, after, _ = rewrite(eliminate_dead_code, """
        exp (tensor<float32>:x) -> (tensor<float32>:t)
        neg (tensor<float32>:x) -> (tensor<float32>:t)
        deltensor () -> (tensor<float32>:t)
        constant (var<float32>:3.0) -> (tensor<float32>:x)
    """, inputs)
    assert lines(after) == ["constant (var<float32>:3.0) -> (tensor<float32>:x)"]
    assert_same_results(before, after, inputs)


def test_a_fill_of_a_new_tensor_goes_but_its_newtensor_stays(rng):
    inputs = random_inputs(rng, SHAPES)
    before, after, _ = rewrite(eliminate_dead_code, """
        newtensor (vector<int32>:[3]) -> (tensor<float64>:n)
        uniform (var<float64>:0.0, var<float64>:1.0, var<int32>:0) -> (tensor<float64>:n)
        deltensor () -> (tensor<float64>:n)
    """, inputs)
    assert lines(after) == ["newtensor (vector<int32>:[3]) -> (tensor<float64>:n)",
                            "deltensor () -> (tensor<float64>:n)"]
    assert_same_results(before, after, inputs)


def test_no_deltensor_no_work(rng):
    inputs = random_inputs(rng, SHAPES)
    before, after, _ = rewrite(eliminate_dead_code, "exp (tensor<float32>:x) -> (tensor<float32>:t)", inputs)
    assert after == before


def test_random_programs_agree(rng):
    """Chains whose results are dropped at random: the rewrite leaves exactly the original's tensors and values."""
    removed = 0
    for _ in range(20):
        inputs = random_inputs(rng, SHAPES, "float64")
        text, live = [], ["x", "y"]
        for k in range(8):
            a, b = rng.choice(live, 2)
            text.append(f"{rng.choice(['add', 'mul', 'max'])} (tensor<float64>:{a}, tensor<float64>:{b}) -> "
                        f"(tensor<float64>:t{k})")
            live.append(f"t{k}")
        for k in rng.permutation(8)[: rng.integers(1, 8)]:
            text.append(f"deltensor () -> (tensor<float64>:t{k})")
        before, after, _ = rewrite(eliminate_dead_code, "\n".join(text), inputs)
        removed += len(before) - len(after)
        assert_same_results(before, after, inputs)
    assert removed > 0
