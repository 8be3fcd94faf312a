"""The last program again (Scheduler._run_fast): a training loop sends the same step every time, and between two
steps nothing else writes the worker's tensors. The program that step became (backward expanded, passes run, known
to the worker) then goes to the worker as it is, on the condition that the worker's state (its tensor table and heap
tensors) has the version the last run left. A repeat on that path must give what the whole path gives, bit for bit;
a write in between (a put, another program) must send the step the whole way again; an error on that path must read
as on the whole path."""

from __future__ import annotations

from collections.abc import AsyncIterator

import numpy as np
import pytest

from deepx_sdk.ir.instr import Instr
from deepx_sdk.ir.text import parse_text
from deepxd.actors.opcpu import RunResult
from tests.compiler.test_backward_instr import FORWARD, UPDATE, _marker, _spec
from tests.compiler.test_backward_instr import Node as GradNode
from tests.compiler.test_repeats import Node

# a step that keeps no tensor of its own from one run to the next (it deletes them) and moves x on every run: the
# same program finds the same metas each time, with other values
STEP = """
    add (tensor<float32>:x, tensor<float32>:w) -> (tensor<float32>:t1)
    mulscalar (tensor<float32>:t1, var<float32>:0.5) -> (tensor<float32>:t2)
    relu (tensor<float32>:t2) -> (tensor<float32>:t3)
    sum (tensor<float32>:t3, vector<int32>:[1], var<bool>:false) -> (tensor<float32>:s)
    addscalar (tensor<float32>:x, var<float32>:0.25) -> (tensor<float32>:x)
    deltensor () -> (tensor<float32>:t1)
    deltensor () -> (tensor<float32>:t2)
    deltensor () -> (tensor<float32>:t3)
"""
PASSES = ["simplify", "cse", "dce", "fuse"]


@pytest.fixture
async def nodes() -> AsyncIterator[list[Node]]:
    made: list[Node] = []
    yield made
    for n in made:
        await n.stop()


def fresh(text: str) -> list[Instr]:
    return parse_text(text.strip())


def whole_way(node: Node) -> None:
    """Forget the last program, so that the next one takes the whole path (the reference)."""
    node.scheduler._fast = []
    node.worker._last = None


@pytest.mark.parametrize("passes", [PASSES, ["off"]])
async def test_a_step_sent_again_takes_the_fast_path_and_gives_what_the_whole_path_gives(nodes, passes):
    nodes += [await Node(passes).start(), await Node(passes).start()]
    looped, reference = nodes[-2], nodes[-1]
    for _ in range(8):
        whole_way(reference)
        got = await looped.run(fresh(STEP), ["s", "x"])
        want = await reference.run(fresh(STEP), ["s", "x"])
        assert not got.error and not want.error and got.done == want.done == len(fresh(STEP))
        for name in ("s", "x"):
            np.testing.assert_array_equal(got.tensors[name], want.tensors[name])
        assert len(got.times_us) == 2 * got.done
    # the first run checks; the second is checked again (s and x were made by the first); the third is known and
    # leaves the state it found; from the fourth on, each goes the fast way
    assert looped.scheduler.fast_hits == 5 and reference.scheduler.fast_hits == 0
    assert sorted(looped.worker.ex.tensors) == ["s", "w", "x"]
    if passes != ["off"]:
        assert looped.scheduler.compiled.exact_hits >= 5  # a fast run counts as the plan it reuses


async def test_a_write_in_between_sends_the_step_the_whole_way(nodes):
    nodes.append(await Node(PASSES).start())
    node = nodes[-1]
    for _ in range(4):
        assert not (await node.run(fresh(STEP), ["s"])).error
    hits = node.scheduler.fast_hits
    assert hits == 1
    # w of another shape: the step no longer checks, and says so as the whole path does
    await node.put("w", np.ones(5, np.float32))
    r = await node.run(fresh(STEP), ["s"])
    assert r.error.startswith("instruction 1: add") and r.error_index == 0 and r.done == 0
    assert node.scheduler.fast_hits == hits
    # w as it was, given anew (a put of the same shape writes too): the whole way once (the worker knows the
    # program for this state from before), then fast again
    await node.put("w", np.ones((3, 4), np.float32))
    for _ in range(3):
        assert not (await node.run(fresh(STEP), ["s"])).error
    assert node.scheduler.fast_hits == hits + 2
    hits += 2
    # another program that writes a tensor between two steps: the next step is checked again
    assert not (await node.run(fresh("addscalar (tensor<float32>:w, var<float32>:1.0) -> (tensor<float32>:v)"),
                               [])).error
    assert not (await node.run(fresh(STEP), ["s"])).error
    assert node.scheduler.fast_hits == hits
    # (v is none of the step's tensors: the worker still knows the step, and the next goes the fast way)
    assert not (await node.run(fresh(STEP), ["s"])).error
    assert node.scheduler.fast_hits == hits + 1
    # one that only reads leaves the state as it was: the step after it still goes the fast way
    hits = node.scheduler.fast_hits
    assert not (await node.run(fresh("print (tensor<float32>:w) -> ()"), [])).error
    assert not (await node.run(fresh(STEP), ["s"])).error
    assert node.scheduler.fast_hits == hits + 1


async def test_the_worker_runs_nothing_for_a_state_version_that_is_gone(nodes):
    nodes.append(await Node(["off"]).start())
    node = nodes[-1]
    program = fresh("addscalar (tensor<float32>:w, var<float32>:1.0) -> (tensor<float32>:v)")
    runs = [await node.worker.ref.ask("run", program=program, fetch=[]) for _ in range(3)]
    # checked (no v), checked again (v there now), known and leaving v as it found it
    assert [r.version >= 0 for r in runs] == [False, False, True]
    again = runs[-1]
    await node.put("x", np.zeros((3, 4), np.float32))
    before = node.worker.ex.get("v").copy()
    stale: RunResult = await node.worker.ref.ask("run", program=program, fetch=["v"], version=again.version)
    assert stale.stale and stale.done == 0 and not stale.tensors
    await node.put("w", np.zeros((3, 4), np.float32))  # what the program would change v to
    np.testing.assert_array_equal(node.worker.ex.get("v"), before)
    r = await node.worker.ref.ask("run", program=program, fetch=["v"])
    assert not r.stale and not r.error
    np.testing.assert_array_equal(r.tensors["v"], np.ones((3, 4), np.float32))


# d moves towards zero on every run: the fifth run divides by zero, by then on the fast path
DIVIDE = """
    div (tensor<int32>:i, tensor<int32>:d) -> (tensor<int32>:q)
    subscalar (tensor<int32>:d, var<int32>:1) -> (tensor<int32>:d)
"""


async def test_a_kernel_error_on_the_fast_path_reads_as_on_the_whole_path(nodes):
    nodes += [await Node(["off"]).start(), await Node(["off"]).start()]
    looped, reference = nodes[-2], nodes[-1]
    results: dict[int, list[RunResult]] = {0: [], 1: []}
    for k, n in enumerate((looped, reference)):
        await n.put("i", np.array([7, 8], np.int32))
        await n.put("d", np.array([4, 4], np.int32))
        for _ in range(5):
            if n is reference:
                whole_way(n)
            results[k].append(await n.run(fresh(DIVIDE), ["q"]))
    assert looped.scheduler.fast_hits == 2 and reference.scheduler.fast_hits == 0
    for got, want in zip(*results.values()):
        assert (got.error, got.error_index, got.done) == (want.error, want.error_index, want.done)
        if not want.error:
            np.testing.assert_array_equal(got.tensors["q"], want.tensors["q"])
    assert "integer division by zero" in results[0][-1].error and results[0][-1].error_index == 0
    # after the error the step takes the whole path: checked, d as the error left it
    assert looped.scheduler._fast == []
    np.testing.assert_array_equal(looped.worker.ex.get("d"), reference.worker.ex.get("d"))


@pytest.fixture
async def grad_node(rng: np.random.Generator) -> AsyncIterator[GradNode]:
    n = await GradNode().start(rng)
    yield n
    await n.stop()


async def test_a_training_step_with_its_backward_on_the_fast_path_matches_numpy(grad_node: GradNode) -> None:
    node = grad_node
    program = [*parse_text(FORWARD.strip()), _marker({"w": "gw"}), *parse_text(UPDATE),
               *parse_text("deltensor () -> (tensor<float64>:gw)")]
    w = node.w.copy()
    for _ in range(6):
        r = await node.scheduler.ref.ask("run", program=list(program), fetch=["loss"], backwards=[_spec(3)])
        assert not r.error and r.done == len(program) and len(r.times_us) == 2 * len(program)
        np.testing.assert_allclose(r.tensors["loss"], np.tanh(node.x @ w).sum(), rtol=1e-12)
        w = w - 0.1 * (node.x.T @ (1 - np.tanh(node.x @ w) ** 2))
        np.testing.assert_allclose(node.worker.ex.get("w"), w, rtol=1e-12)
    assert node.scheduler.fast_hits == 3
    assert node.scheduler.expansion_hits == 1 + 3  # the fast runs reuse the remembered expansion, and count so
    # another loss (a different backward) is not the last program: the whole way, with its own gradient
    other = _spec(3, wrt=["x"], names={"x": "gw"})
    r = await node.scheduler.ref.ask("run", program=[*parse_text(FORWARD.strip()), _marker({"x": "gw"}),
                                                     *parse_text("deltensor () -> (tensor<float64>:gw)")],
                                     fetch=[], backwards=[other])
    assert not r.error and node.scheduler.fast_hits == 3
