"""A program again, by its plan (deepxd/actors/plan.py): a training loop sends the same step every time, and between
two steps nothing else writes the worker's tensors. The plan the step became (backward expanded, passes run, checked
and prepared by the worker) then runs as it is, on the condition that the worker's state (its tensor table and heap
tensors) has the version the plan's last run left, or else that the tensors it read are as it found them. A repeat
by its plan must give what the whole path gives, bit for bit; a write in between that changes what the plan read (a
put of another shape) must send the step the whole way again; an error on that path must read as on the whole
path."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest

from deepx_core.ir.instr import Instr
from deepx_core.ir.text import parse_text
from deepxd.actors.messages import Put, Run, RunPlan, RunProgram, SchedulerStats, WorkerTensors
from deepxd.actors.plan import Plan
from deepxd.actors.worker import RunResult
from tests.compiler.test_backward_instr import FORWARD, UPDATE, _marker, _spec
from tests.compiler.test_backward_instr import Node as GradNode
from tests.compiler.test_repeats import Node, fresh

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


def whole_way(node: Node) -> None:
    """Forget the plans, so that the next program takes the whole path (the reference)."""
    node.scheduler.plans.clear()


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
    # the first run makes a plan; the second finds s, which the first made: another state, another plan; from the
    # third on, each runs by that plan, as prepared
    assert looped.scheduler.plan_hits == 6 and reference.scheduler.plan_hits == 0
    assert (looped.scheduler.plan_misses, looped.scheduler.stale) == (2, 1)
    assert sorted(looped.worker.ex.tensors) == ["s", "w", "x"]
    stats = await looped.scheduler.ref.ask(SchedulerStats())
    assert (stats["plan_hits"], stats["plan_misses"]) == (6, 2)


async def test_a_write_in_between_sends_the_step_the_whole_way(nodes):
    nodes.append(await Node(PASSES).start())
    node = nodes[-1]
    for _ in range(4):
        assert not (await node.run(fresh(STEP), ["s"])).error
    hits = node.scheduler.plan_hits
    assert hits == 2
    # w of another shape: the step no longer checks, and says so as the whole path does
    await node.put("w", np.ones(5, np.float32))
    r = await node.run(fresh(STEP), ["s"])
    assert r.error.startswith("instruction 1: add") and r.error_index == 0 and r.done == 0
    assert node.scheduler.plan_hits == hits
    # w as it was, given anew (a put of the same shape writes too): the plan finds what it read, and runs
    await node.put("w", np.ones((3, 4), np.float32))
    for _ in range(3):
        assert not (await node.run(fresh(STEP), ["s"])).error
    assert node.scheduler.plan_hits == hits + 3
    hits += 3
    # another program that writes a tensor none of the step's: the step finds what it expects, and goes fast
    assert not (await node.run(fresh("addscalar (tensor<float32>:w, var<float32>:1.0) -> (tensor<float32>:v)"),
                               [])).error
    assert not (await node.run(fresh(STEP), ["s"])).error
    assert node.scheduler.plan_hits == hits + 1
    # one that only reads leaves the state as it was: the step after it still goes the fast way
    hits = node.scheduler.plan_hits
    assert not (await node.run(fresh("print (tensor<float32>:w) -> ()"), [])).error
    assert not (await node.run(fresh(STEP), ["s"])).error
    assert node.scheduler.plan_hits == hits + 1


async def test_the_worker_runs_a_plan_only_on_the_state_it_read(nodes):
    nodes.append(await Node(["off"]).start())
    node = nodes[-1]
    program = fresh("addscalar (tensor<float32>:w, var<float32>:1.0) -> (tensor<float32>:v)")

    async def run(plan: Plan) -> RunResult | None:
        return await node.worker.ref.ask(RunPlan(plan=plan))

    first = Plan(program, ("v",), (), node.worker.ref, program)
    r = await run(first)
    assert r is not None and not r.error and first.prepared is not None
    assert first.version == -1  # it made v: a run again would not find the state it found
    assert await run(first) is None  # v exists now: the plan does not stand, nothing ran
    second = Plan(program, ("v",), (), node.worker.ref, program)
    assert (await run(second)) is not None and second.version >= 0  # it leaves v as it found it
    await node.put("x", np.zeros((3, 4), np.float32))  # the version moves on; what the plan read stands
    r = await run(second)
    assert r is not None and not r.error and second.version >= 0
    np.testing.assert_array_equal(r.tensors["v"], node.worker.ex.get("w") + 1)
    before = node.worker.ex.get("v").copy()
    await node.put("w", np.zeros(5, np.float32))  # what it read changes: it does not stand, nothing runs
    assert await run(second) is None
    np.testing.assert_array_equal(node.worker.ex.get("v"), before)
    # a plan made on a state of the worker's runs first on that state only
    late = Plan(program, ("v",), (), node.worker.ref, program, seen=node.worker._state() - 1)
    assert await run(late) is None and late.prepared is None
    np.testing.assert_array_equal(node.worker.ex.get("v"), before)


# d moves towards zero on every run: the fifth run divides by zero, by then on the fast path
DIVIDE = """
    div (tensor<int32>:i, tensor<int32>:d) -> (tensor<int32>:q)
    subscalar (tensor<int32>:d, var<int32>:1) -> (tensor<int32>:d)
"""


async def divide_runs(nodes: list[Node], program: str, passes: list[str], fetch: list[str], run: Any
                      ) -> tuple[Node, Node, dict[int, list[RunResult]]]:
    """Two nodes with i and d put, `program` run five times on each: by `run(node, program, fetch)` on the first,
    the whole way every time on the second (the reference). Their results, by node."""
    nodes += [await Node(passes).start(), await Node(passes).start()]
    looped, reference = nodes[-2], nodes[-1]
    results: dict[int, list[RunResult]] = {0: [], 1: []}
    for n in (looped, reference):
        await n.put("i", np.array([7, 8], np.int32))
        await n.put("d", np.array([4, 4], np.int32))
    for _ in range(5):
        results[0].append(await run(looped, fresh(program), fetch))
        whole_way(reference)
        results[1].append(await reference.run(fresh(program), fetch))
    return looped, reference, results


async def test_a_kernel_error_on_the_fast_path_reads_as_on_the_whole_path(nodes):
    looped, reference, results = await divide_runs(nodes, DIVIDE, ["off"], ["q"], Node.run)
    assert looped.scheduler.plan_hits == 3 and reference.scheduler.plan_hits == 0
    for got, want in zip(*results.values()):
        assert (got.error, got.error_index, got.done) == (want.error, want.error_index, want.done)
        if not want.error:
            np.testing.assert_array_equal(got.tensors["q"], want.tensors["q"])
    assert "integer division by zero" in results[0][-1].error and results[0][-1].error_index == 0
    # after the error the step takes the whole path: checked, d as the error left it
    assert len(looped.scheduler.plans) == 0
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
        r = await node.scheduler.ref.ask(Run(program=list(program), fetch=["loss"], backwards=[_spec(3)]))
        assert not r.error and r.done == len(program) and len(r.times_us) == 2 * len(program)
        np.testing.assert_allclose(r.tensors["loss"], np.tanh(node.x @ w).sum(), rtol=1e-12)
        w = w - 0.1 * (node.x.T @ (1 - np.tanh(node.x @ w) ** 2))
        np.testing.assert_allclose(node.worker.ex.get("w"), w, rtol=1e-12)
    assert node.scheduler.plan_hits == 4  # from the third run on (the first made h, t and loss)
    # another loss (a different backward) is not the last program: the whole way, with its own gradient
    other = _spec(3, wrt=["x"], names={"x": "gw"})
    r = await node.scheduler.ref.ask(Run(program=[*parse_text(FORWARD.strip()), _marker({"x": "gw"}),
                                                     *parse_text("deltensor () -> (tensor<float64>:gw)")],
                                     fetch=[], backwards=[other]))
    assert not r.error and node.scheduler.plan_hits == 4


async def test_a_backward_spec_the_whole_path_refuses_is_refused_after_a_fast_run_too(grad_node: GradNode) -> None:
    node = grad_node
    program = [*parse_text(FORWARD.strip()), _marker({"w": "gw"}), *parse_text(UPDATE),
               *parse_text("deltensor () -> (tensor<float64>:gw)")]
    for _ in range(4):
        assert not (await node.scheduler.ref.ask(Run(program=list(program), fetch=[], backwards=[_spec(3)]))).error
    assert node.scheduler.plan_hits == 2
    for index in (3.0, True, np.int64(3)):  # equal to 3, and not an instruction's index
        r = await node.scheduler.ref.ask(Run(program=list(program), fetch=[], backwards=[_spec(index)]))
        assert r.error == f"backward: index {index!r} is not a backward instruction of the program" and r.done == 0
    forward = [tuple(i) for i in parse_text(FORWARD.strip())]  # instructions as plain tuples (equal to them)
    r = await node.scheduler.ref.ask(Run(program=list(program), fetch=[], backwards=[_spec(3, forward=forward)]))
    assert "malformed request" in r.error and node.scheduler.plan_hits == 2


async def test_a_fetched_tensor_deleted_in_between_is_refused_as_on_a_fresh_worker(nodes):
    nodes += [await Node(["off"]).start(), await Node(["off"]).start()]
    looped, fresh_node = nodes[-2], nodes[-1]
    step = "addscalar (tensor<float32>:x, var<float32>:1.0) -> (tensor<float32>:x)"
    for n in (looped, fresh_node):
        await n.put("z", np.zeros(2, np.float32))
    for _ in range(4):  # z is read back only: the plan's check covers it all the same
        assert not (await looped.run(fresh(step), ["z"])).error
    assert looped.scheduler.plan_hits == 3
    x = looped.worker.ex.get("x").copy()
    for n in (looped, fresh_node):
        assert not (await n.run(fresh("deltensor () -> (tensor<float32>:z)"), [])).error
    got, want = await looped.run(fresh(step), ["z"]), await fresh_node.run(fresh(step), ["z"])
    assert got.error == want.error == "fetch: tensor 'z' not found" and got.error_index == want.error_index
    np.testing.assert_array_equal(looped.worker.ex.get("x"), x)  # nothing ran


# a training loop that keeps the last loss while it records the next step: two programs in turn, the loss under
# two names, each deleting the other's
TURNS = [f"""
    mul (tensor<float32>:x, tensor<float32>:w) -> (tensor<float32>:t)
    sum (tensor<float32>:t, vector<int32>:[], var<bool>:false) -> (tensor<float32>:{a})
    deltensor () -> (tensor<float32>:{b})
    addscalar (tensor<float32>:x, var<float32>:0.125) -> (tensor<float32>:x)
    deltensor () -> (tensor<float32>:t)
""" for a, b in (("l1", "l2"), ("l2", "l1"))]


async def test_two_programs_in_turn_take_the_fast_path_by_their_expectations(nodes):
    nodes += [await Node(PASSES).start(), await Node(PASSES).start()]
    looped, reference = nodes[-2], nodes[-1]
    for n in (looped, reference):
        await n.put("l2", np.zeros((), np.float32))
    for k in range(10):
        whole_way(reference)
        text = TURNS[k % 2]
        got, want = await looped.run(fresh(text), [f"l{k % 2 + 1}"]), await reference.run(fresh(text),
                                                                                        [f"l{k % 2 + 1}"])
        assert not got.error and not want.error
        np.testing.assert_array_equal(got.tensors[f"l{k % 2 + 1}"], want.tensors[f"l{k % 2 + 1}"])
    np.testing.assert_array_equal(looped.worker.ex.get("x"), reference.worker.ex.get("x"))
    # neither leaves the state it found (the version moves on), so each compares what it read: from the second run
    # of each on, it finds the state the other left, as its first did
    assert looped.scheduler.plan_hits == 10 - 2 and reference.scheduler.plan_hits == 0


class RacedNode(GradNode):
    """A worker busy with a program on its thread while the scheduler asks its state: another client's put lands
    between the scheduler's look at the state and the run."""

    def __init__(self) -> None:
        from deepxd.actors.opcpu import CpuWorker
        from deepxd.actors.scheduler import Scheduler
        from deepxd.config import Config

        self.worker = CpuWorker(output_log=False, inline_elements=0)  # every program on the worker's thread
        self.scheduler = Scheduler({"op-cpu": self.worker.ref}, config=Config(passes=["off"]))


RACED_FORWARD = """
    add (tensor<float64>:x, tensor<float64>:b) -> (tensor<float64>:h)
    tanh (tensor<float64>:h) -> (tensor<float64>:t)
    sum (tensor<float64>:t, vector<int32>:[], var<bool>:false) -> (tensor<float64>:loss)
"""


async def test_a_plan_made_from_a_state_the_run_does_not_find_never_runs(rng):
    """The scheduler planned on b of shape (4, 3); a put of b of shape [3] lands before the run: that plan is not
    run, and the step is planned again on the state the worker has (the gradient of shape [3])."""
    from deepx_core.ir.instr import Param

    looped = await RacedNode().start(rng)
    program = [*parse_text(RACED_FORWARD.strip()),
               Instr("backward", (Param.tensor("loss", "float64"),), (Param.tensor("gb", "float64"),)),
               *parse_text("deltensor () -> (tensor<float64>:h)\ndeltensor () -> (tensor<float64>:t)\n"
                           "deltensor () -> (tensor<float64>:loss)")]
    spec = {"index": 3, "forward": parse_text(RACED_FORWARD.strip()), "loss": "loss", "wrt": ["b"],
            "grad_loss": None, "prefix": "g0_", "names": {"b": "gb"}}

    async def put(n: RacedNode, name: str, a: np.ndarray) -> None:
        await n.worker.ref.ask(Put(name=name, dtype=str(a.dtype), shape=list(a.shape), data=a.tobytes()))

    async def step(n: RacedNode) -> RunResult:
        return await n.scheduler.ref.ask(Run(program=list(program), fetch=["gb"], backwards=[spec]))

    async def raced(n: RacedNode) -> RunResult:
        busy = asyncio.create_task(n.worker.ref.ask(RunProgram(program=parse_text(
            "add (tensor<float64>:x, tensor<float64>:x) -> (tensor<float64>:junk)"), fetch=[])))
        stepped = asyncio.create_task(step(n))
        await asyncio.sleep(0)
        assert n.worker._busy and n.worker.mailbox.qsize() == 1  # the scheduler's ask, queued behind it
        put_b = n.worker.ref.ask_future(Put(name="b", dtype="float64", shape=[3], data=np.full(3, 0.5).tobytes()))
        await busy
        await put_b
        return await stepped

    try:
        for _ in range(3):
            await put(looped, "b", np.zeros((4, 3)))  # what the scheduler sees; the run finds b of shape [3]
            got = await raced(looped)
            assert not got.error, got.error
            np.testing.assert_allclose(got.tensors["gb"], (1 - np.tanh(looped.x + 0.5) ** 2).sum(0), rtol=1e-12)
        assert looped.scheduler.stale >= 1  # made on the state the scheduler saw, found another: made again
    finally:
        await looped.stop()


def state(n: Node) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    return {k: (str(v.dtype), v.shape, v.tobytes()) for k, v in n.worker.ex.tensors.items()}


async def run_spec(n: Node, program: list[Instr], fetch: list[str], spec: dict) -> RunResult:
    return await n.scheduler.ref.ask(Run(program=program, fetch=fetch, backwards=[spec]))


async def test_a_wrt_outside_the_forward_is_part_of_what_the_fast_path_expects(nodes):
    """The gradient of a tensor the forward does not name is zeros of its shape: its meta is read by the
    derivation, so a change to it (another shape, deleted) sends the step the whole way."""
    from deepx_core.ir.instr import Param

    nodes += [await Node(PASSES).start(), await Node(PASSES).start()]
    looped, reference = nodes[-2], nodes[-1]
    marker = Instr("backward", (Param.tensor("loss", "float64"),),
                   (Param.tensor("gw", "float64"), Param.tensor("gz", "float64")))

    def program() -> list[Instr]:
        return [*fresh("deltensor () -> (tensor<float64>:gz)"), *fresh(FORWARD), marker,
                *fresh("deltensor () -> (tensor<float64>:gw)")]

    spec = {"index": 4, "forward": fresh(FORWARD), "loss": "loss", "wrt": ["w", "z"], "grad_loss": None,
            "prefix": "g0_", "names": {"w": "gw", "z": "gz"}}
    rng = np.random.default_rng(1)
    x, w = rng.standard_normal((4, 3)), rng.standard_normal((3, 2))
    for n in (looped, reference):
        for name, a in (("x", x), ("w", w), ("z", np.ones(5)), ("gz", np.zeros(5))):
            await n.put(name, a)
    for _ in range(5):
        whole_way(reference)
        for n in (looped, reference):
            assert not (await run_spec(n, program(), ["gz"], dict(spec))).error
    assert looped.scheduler.plan_hits == 3
    for n in (looped, reference):
        await n.put("z", np.ones(7))
    whole_way(reference)
    got, want = await run_spec(looped, program(), ["gz"], spec), await run_spec(reference, program(), ["gz"], spec)
    assert not got.error and got.tensors["gz"].shape == want.tensors["gz"].shape == (7,)
    for n in (looped, reference):
        assert not (await n.run(fresh("deltensor () -> (tensor<float64>:z)"), [])).error
    whole_way(reference)
    got, want = await run_spec(looped, program(), ["gz"], spec), await run_spec(reference, program(), ["gz"], spec)
    assert "wrt tensor 'z' does not exist" in want.error
    assert (got.error, got.error_index, got.done) == (want.error, want.error_index, want.done)


def _untyped_return() -> list[Instr]:
    """An untyped return (`-> (t)`), written and then deleted: the passes drop the write, the check reads it."""
    return fresh("add (tensor<float32>:x, tensor<float32>:w) -> (t)\n"
                 "mulscalar (tensor<float32>:x, var<float32>:2.0) -> (tensor<float32>:s)\n"
                 "deltensor () -> (t)")


def _untyped_list() -> list[Instr]:
    """An untyped tensor list (what the wire gives for `[x, w]` without a category), its result deleted unread."""
    from deepx_core.ir.instr import Param

    concat = Instr("concat", (Param("", (), ("x", "w")), Param.var(0, "int32")), (Param.tensor("c", "float32"),))
    return [concat, *fresh("mulscalar (tensor<float32>:x, var<float32>:2.0) -> (tensor<float32>:s)\n"
                           "deltensor () -> (tensor<float32>:c)")]


@pytest.mark.parametrize("step, changed", [(_untyped_return, ("t", np.zeros(5, np.float32))),
                                           (_untyped_list, ("w", np.zeros((3, 5), np.float32)))])
async def test_untyped_tensor_params_are_part_of_what_the_fast_path_expects(nodes, step, changed):
    nodes += [await Node(PASSES).start(), await Node(PASSES).start()]
    looped, reference = nodes[-2], nodes[-1]
    for _ in range(4):
        whole_way(reference)
        for n in (looped, reference):
            assert not (await n.run(step(), ["s"])).error
    assert looped.scheduler.plan_hits >= 1
    for n in (looped, reference):
        await n.put(*changed)
    whole_way(reference)
    got, want = await looped.run(step(), ["s"]), await reference.run(step(), ["s"])
    assert want.error and (got.error, got.error_index, got.done) == (want.error, want.error_index, want.done)
    assert state(looped) == state(reference)


async def test_a_spec_edited_in_place_and_sent_again_is_another_spec(grad_node: GradNode) -> None:
    node = grad_node
    spec = _spec(3)
    program = [*parse_text(FORWARD.strip()), _marker({"w": "gw"}), *parse_text("deltensor () -> (tensor<float64>:gw)")]
    for _ in range(4):
        assert not (await node.scheduler.ref.ask(Run(program=list(program), fetch=[], backwards=[spec]))).error
    assert node.scheduler.plan_hits == 2
    spec["wrt"].append("x")  # the same objects, now asking for x's gradient too
    spec["names"]["x"] = "gx"
    r = await node.scheduler.ref.ask(Run(program=list(program), fetch=[], backwards=[spec]))
    assert not r.error and node.scheduler.plan_hits == 2
    np.testing.assert_allclose(node.worker.ex.get("gx"), (1 - np.tanh(node.x @ node.w) ** 2) @ node.w.T, rtol=1e-12)


async def test_a_rename_before_a_backward_instruction_is_seen_by_its_derivation(grad_node: GradNode) -> None:
    from deepx_core.ir.instr import Param

    node = grad_node
    forward = FORWARD.replace("tensor<float64>:x,", "tensor<float64>:x2,")
    program = [Instr("renametensor", (Param.var("x2", "string"),), (Param.tensor("x", "float64"),)),
               *parse_text(forward.strip()), _marker({"w": "gw"})]
    r = await node.scheduler.ref.ask(Run(program=program, fetch=["gw"],
                                     backwards=[_spec(4, forward=parse_text(forward.strip()))]))
    assert not r.error
    np.testing.assert_allclose(r.tensors["gw"], node.x.T @ (1 - np.tanh(node.x @ node.w) ** 2), rtol=1e-12)


# -- the same path with no coroutine (Scheduler.now_run, which the embedded daemon's LoopThread.now calls)
async def now_or_ask(node: Node, program: list[Instr], fetch: list[str]) -> tuple[RunResult, str]:
    """now_run where it takes the program (called on the loop's thread, as LoopThread.now would), else the ask; and
    which answered: "now", "now, then awaited" (a coroutine that finishes it) or "ask"."""
    done = node.scheduler.now_run(program, fetch)
    if done is None:
        return await node.run(program, fetch), "ask"
    if isinstance(done, RunResult):
        return done, "now"
    return await done, "now, then awaited"


@pytest.mark.parametrize("passes", [PASSES, ["off"]])
async def test_run_now_gives_what_the_whole_path_gives(nodes, passes):
    nodes += [await Node(passes).start(), await Node(passes).start()]
    looped, reference = nodes[-2], nodes[-1]
    ways = []
    for _ in range(8):
        whole_way(reference)
        got, way = await now_or_ask(looped, fresh(STEP), ["s", "x"])
        ways.append(way)
        want = await reference.run(fresh(STEP), ["s", "x"])
        assert not got.error and got.done == want.done == len(fresh(STEP))
        for name in ("s", "x"):
            np.testing.assert_array_equal(got.tensors[name], want.tensors[name])
        assert len(got.times_us) == 2 * got.done
    # as the ask runs a plan from the cache: from the third run on (the first made s: another state)
    assert ways == ["ask"] * 2 + ["now"] * 6
    stats = await looped.scheduler.ref.ask(SchedulerStats())
    assert stats["plan_hits"] == stats["now_hits"] == 6 and stats["programs"] == 8
    assert looped.worker.stats.by_message["run_plan"] == 8 + looped.scheduler.stale  # (one stale, which ran nothing)
    assert looped.worker.prepared_runs == 6


# DIVIDE after work that the passes rewrite (a and b are one sum, and both are deleted): the fifth run fails at its
# fourth instruction with the rewritten program part-way, which the scheduler repairs (a coroutine on now_run's path)
REWRITTEN_DIVIDE = """
    add (tensor<float32>:x, tensor<float32>:w) -> (tensor<float32>:a)
    add (tensor<float32>:x, tensor<float32>:w) -> (tensor<float32>:b)
    mul (tensor<float32>:a, tensor<float32>:b) -> (tensor<float32>:p)
    div (tensor<int32>:i, tensor<int32>:d) -> (tensor<int32>:q)
    subscalar (tensor<int32>:d, var<int32>:1) -> (tensor<int32>:d)
    addscalar (tensor<float32>:x, var<float32>:1.0) -> (tensor<float32>:x)
    deltensor () -> (tensor<float32>:a)
    deltensor () -> (tensor<float32>:b)
"""


@pytest.mark.parametrize("program, passes, last, div_at", [(DIVIDE, ["off"], "now", 0), (DIVIDE, PASSES, "now", 0),
                                                           (REWRITTEN_DIVIDE, PASSES, "now, then awaited", 3)])
async def test_a_kernel_error_in_run_now_reads_as_on_the_whole_path(nodes, program, passes, last, div_at):
    ways = []

    async def run(node: Node, instrs: list[Instr], fetch: list[str]) -> RunResult:
        r, way = await now_or_ask(node, instrs, fetch)
        ways.append(way)
        return r

    looped, reference, results = await divide_runs(nodes, program, passes, ["q", "x"], run)
    assert ways == ["ask"] * 2 + ["now", "now", last]
    for got, want in zip(*results.values()):
        assert (got.error, got.error_index, got.done) == (want.error, want.error_index, want.done)
        if not want.error:
            for name in ("q", "x"):
                np.testing.assert_array_equal(got.tensors[name], want.tensors[name])
    assert "integer division by zero" in results[0][-1].error and results[0][-1].error_index == div_at
    # set straight as the whole path leaves them; one message each, counted once
    assert len(looped.scheduler.plans) == 0 and not looped.scheduler._busy and not looped.worker._busy
    for name in ("d", "x"):
        np.testing.assert_array_equal(looped.worker.ex.get(name), reference.worker.ex.get(name))
    assert looped.scheduler.stats.by_message["run"] == looped.scheduler.programs == 5
    assert looped.scheduler.now_hits == 3 and looped.scheduler.failed == 1
    assert (await looped.run(fresh(program), ["q"])).error  # d is 0: it fails again, the whole way


async def test_run_now_leaves_a_busy_actor_and_a_heap_tensor_to_the_ask(nodes):
    """A message waiting for the worker or the scheduler (a deepxctl ask, say), or a step whose tensor became a heap
    tensor in between (its expectation fails; deleting it tells heapmem, which takes an await): now_run runs nothing
    and answers None; the ask then runs it."""
    nodes.append(await Node(PASSES).start())
    node = nodes[-1]
    for _ in range(4):
        await now_or_ask(node, fresh(STEP), ["s"])
    x = node.worker.ex.get("x").copy()
    waiting = node.worker.ref.ask_future(WorkerTensors())
    assert node.scheduler.now_run(fresh(STEP), ["s"]) is None
    np.testing.assert_array_equal(node.worker.ex.get("x"), x)  # nothing ran
    assert {r["name"] for r in await waiting} >= {"x", "w"}
    waiting = node.scheduler.ref.ask_future(SchedulerStats())
    assert node.scheduler.now_run(fresh(STEP), ["s"]) is None
    await waiting
    r, way = await now_or_ask(node, fresh(STEP), ["s"])
    assert way == "now" and not r.error
    # t1 as a heap tensor of this worker (as an attached one is): the step deletes it
    node.worker.heap["t1"] = np.zeros((3, 4), np.float32)
    node.worker.heap_held.add("t1")  # held here, so that the program's deltensor may release it
    assert node.scheduler.now_run(fresh(STEP), ["s"]) is None
    r, way = await now_or_ask(node, fresh(STEP), ["s"])
    assert way == "ask" and not r.error and "t1" not in node.worker.heap
    # a declined now_run counts no message: each run is counted once, by the ask that ran it
    assert node.scheduler.stats.by_message["run"] == node.scheduler.programs
