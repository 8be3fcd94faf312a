"""A program that is a known one with its inputs under other names (a batch held among others) runs by that plan,
under the new names (Plan.renamed), where the new tensors have the metas the plan was made for; elsewhere it is
planned afresh, or refused as any program is. The names a program makes are never taken for inputs."""

from __future__ import annotations

import zlib
from collections.abc import AsyncIterator

import numpy as np
import pytest

from deepx_core.ir.instr import Instr, Param
from deepx_core.ir.renaming import inputs_of
from deepxd.actors.messages import Put, Run, SchedulerStats
from deepxd.actors.opcpu import CpuWorker
from deepxd.actors.scheduler import Scheduler
from tests.compiler.helpers import program

STEP = """
    matmul (tensor<float64>:{x}, tensor<float64>:w) -> (tensor<float64>:h)
    relu (tensor<float64>:h) -> (tensor<float64>:{r})
    add (tensor<float64>:{r}, tensor<float64>:b) -> (tensor<float64>:out)
    deltensor () -> (tensor<float64>:h)
    deltensor () -> (tensor<float64>:{r})
"""


def step(x: str, r: str = "r") -> list[Instr]:
    return program(STEP.format(x=x, r=r))


class Node:
    def __init__(self) -> None:
        self.worker = CpuWorker(output_log=False)
        self.scheduler = Scheduler({"op-cpu": self.worker.ref})

    async def start(self) -> Node:
        self.worker.start()
        self.scheduler.start()
        return self

    async def put(self, name: str, a: np.ndarray) -> None:
        await self.worker.ref.ask(Put(name=name, dtype=str(a.dtype), shape=list(a.shape), data=a.tobytes()))

    async def run(self, prog: list[Instr], fetch: list[str]) -> dict[str, np.ndarray]:
        """`prog` run, and what it fetches deleted after (each run finds the state the one before found)."""
        result = await self.scheduler.ref.ask(Run(program=prog, fetch=fetch))
        assert not result.error, result.error
        gone = await self.scheduler.ref.ask(Run(program=[Instr("deltensor", (), (Param.tensor(n),)) for n in fetch]))
        assert not gone.error, gone.error
        return result.tensors

    async def stats(self) -> dict[str, float]:
        return await self.scheduler.ref.ask(SchedulerStats())

    async def stop(self) -> None:
        await self.scheduler.stop()
        await self.worker.stop()


@pytest.fixture
def rng(request: pytest.FixtureRequest) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture
async def node(rng: np.random.Generator) -> AsyncIterator[Node]:
    n = await Node().start()
    await n.put("w", rng.standard_normal((3, 5)))
    await n.put("b", rng.standard_normal(5))
    yield n
    await n.stop()


def want(x: np.ndarray, w: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.maximum(x @ w, 0.0) + b


async def test_held_inputs_run_by_one_plan_under_their_names(node, rng):
    xs = [rng.standard_normal((4, 3)) for _ in range(4)]
    for k, x in enumerate(xs):
        await node.put(f"x{k}", x)
    w, b = (node.worker.ex.tensors[n].copy() for n in ("w", "b"))
    for _ in range(3):  # planned, then by its plan
        await node.run(step("x0"), ["out"])
    before = await node.stats()
    for k in [1, 2, 3, 0, 2, 1]:
        got = await node.run(step(f"x{k}"), ["out"])
        np.testing.assert_allclose(got["out"], want(xs[k], w, b), rtol=1e-12, atol=1e-12)
    after = await node.stats()
    assert after["plan_misses"] == before["plan_misses"]
    assert after["renamed"] - before["renamed"] == 6


async def test_an_input_of_another_shape_or_dtype_is_planned_afresh(node, rng):
    await node.put("x0", rng.standard_normal((4, 3)))
    for _ in range(3):
        await node.run(step("x0"), ["out"])
    w, b = (node.worker.ex.tensors[n].copy() for n in ("w", "b"))
    short = rng.standard_normal((2, 3))  # a right program: out is (2, 5)
    await node.put("short", short)
    misses = (await node.stats())["plan_misses"]
    got = await node.run(step("short"), ["out"])
    np.testing.assert_allclose(got["out"], want(short, w, b), rtol=1e-12, atol=1e-12)
    assert (await node.stats())["plan_misses"] > misses
    # another dtype, where the program names none: planned afresh, and right
    relu = "relu (tensor:{x}) -> (tensor:q)"
    await node.put("f64", rng.standard_normal(6))
    await node.put("f32", rng.standard_normal(6).astype(np.float32))
    for _ in range(3):
        await node.run(program(relu.format(x="f64")), ["q"])
    misses = (await node.stats())["plan_misses"]
    got = await node.run(program(relu.format(x="f32")), ["q"])
    assert got["q"].dtype == np.float32
    np.testing.assert_array_equal(got["q"], np.maximum(node.worker.ex.tensors["f32"], 0))
    assert (await node.stats())["plan_misses"] > misses


async def test_an_input_the_program_does_not_fit_is_refused_as_any_program(node, rng):
    await node.put("x0", rng.standard_normal((4, 3)))
    for _ in range(3):
        await node.run(step("x0"), ["out"])
    await node.put("wide", rng.standard_normal((4, 4)))
    await node.put("ints", np.arange(12, dtype=np.int64).reshape(4, 3))
    for bad in ("wide", "ints"):
        result = await node.scheduler.ref.ask(Run(program=step(bad), fetch=["out"]))
        assert result.error.startswith("instruction 1: matmul") and result.done == 0, result.error
        assert "out" not in node.worker.ex.tensors  # nothing ran


async def test_names_the_program_makes_are_not_taken_for_inputs(node, rng):
    await node.put("x0", rng.standard_normal((4, 3)))
    for _ in range(3):
        await node.run(step("x0"), ["out"])
    before = await node.stats()
    await node.run(step("x0", r="r2"), ["out"])  # a made name renamed: another program
    after = await node.stats()
    assert after["plan_misses"] > before["plan_misses"] and after["renamed"] == before["renamed"]
    inputs = inputs_of([step("x0")], [])
    assert inputs is not None and inputs.names == ["x0", "w", "b"] and {"h", "r", "out"} <= inputs.fixed


async def test_inputs_swapped_run_by_the_plan(node, rng):
    text = """
        sub (tensor<float64>:{a}, tensor<float64>:{b}) -> (tensor<float64>:d)
        mul (tensor<float64>:d, tensor<float64>:{a}) -> (tensor<float64>:e)
    """
    p, q = rng.standard_normal(5), rng.standard_normal(5)
    await node.put("p", p)
    await node.put("q", q)
    for _ in range(3):
        await node.run(program(text.format(a="p", b="q")), ["e"])
    hits = (await node.stats())["renamed"]
    got = await node.run(program(text.format(a="q", b="p")), ["e"])
    np.testing.assert_array_equal(got["e"], (q - p) * q)
    assert (await node.stats())["renamed"] == hits + 1


def test_a_mapping_is_one_to_one_and_takes_no_made_name() -> None:
    inputs = inputs_of([step("x0")], [])
    assert inputs is not None
    assert inputs.mapping([step("x1")]) == {"x0": "x1"}
    assert inputs.mapping([step("x0")]) is None  # nothing renamed: the exact look's
    assert inputs.mapping([step("h")]) is None  # a name the program makes
    assert inputs.mapping([step("w")]) is None  # two inputs under one name


async def test_an_input_deleted_before_the_next_is_read_renames_too(node, rng):
    """A loader's step deletes the batch before it and reads its own: both take new names, step after step."""
    text = """
        deltensor () -> (tensor<float64>:{prev})
        mul (tensor<float64>:{cur}, tensor<float64>:{cur}) -> (tensor<float64>:sq)
    """
    xs = [rng.standard_normal(4) for _ in range(8)]
    for k, x in enumerate(xs):
        await node.put(f"b{k}", x)
    for k in range(1, 3):  # planned (the first run leaves sq, which the second finds)
        await node.run(program(text.format(prev=f"b{k - 1}", cur=f"b{k}")), ["sq"])
    before = await node.stats()
    for k in range(3, 8):
        got = await node.run(program(text.format(prev=f"b{k - 1}", cur=f"b{k}")), ["sq"])
        np.testing.assert_array_equal(got["sq"], xs[k] * xs[k])
        assert f"b{k - 1}" not in node.worker.ex.tensors
    after = await node.stats()
    assert after["plan_misses"] == before["plan_misses"] and after["renamed"] - before["renamed"] == 5
    inputs = inputs_of([program(text.format(prev="b0", cur="b1"))], [])
    assert inputs is not None and inputs.names == ["b0", "b1"]
    made_again = program("deltensor () -> (tensor<float64>:g)\nneg (tensor<float64>:x) -> (tensor<float64>:g)")
    inputs = inputs_of([made_again], [])
    assert inputs is not None and inputs.names == ["x"] and "g" in inputs.fixed  # deleted and made: it stays
