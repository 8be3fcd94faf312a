"""Programs that repeat exactly: the scheduler reuses their rewrite (PlanCache's exact layer) and the worker their
check and prepared kernel calls (CpuWorker.known). A repeat must give what a fresh daemon gives, and anything that
makes it a different program (a number's type, a zero's sign, a tensor's shape, what is fetched) must miss."""

from __future__ import annotations

import numpy as np
import pytest

from deepx_core.ir.instr import Instr, Param, same_program, scalar_kinds
from deepx_core.ir.text import parse_text
from deepxd.actors.messages import Put, Run
from deepxd.actors.opcpu import CpuWorker
from deepxd.actors.scheduler import Scheduler
from deepxd.actors.worker import RunResult
from deepxd.config import Config

# a loop body as a client that reuses the names of dropped temporaries sends it: t1/t2 are overwritten every step
STEP = """
    add (tensor<float32>:x, tensor<float32>:w) -> (tensor<float32>:t1)
    mulscalar (tensor<float32>:t1, var<float32>:0.5) -> (tensor<float32>:t2)
    sub (tensor<float32>:t2, tensor<float32>:x) -> (tensor<float32>:t1)
    relu (tensor<float32>:t1) -> (tensor<float32>:t2)
    exp (tensor<float32>:t2) -> (tensor<float32>:y)
    sum (tensor<float32>:t2, vector<int32>:[1], var<bool>:false) -> (tensor<float32>:s)
    deltensor () -> (tensor<float32>:t1)
"""


class Node:
    def __init__(self, passes: list[str]) -> None:
        self.worker = CpuWorker(output_log=False)
        self.scheduler = Scheduler({"op-cpu": self.worker.ref}, config=Config(passes=passes))

    async def start(self, shape: tuple[int, ...] = (3, 4)) -> Node:
        self.worker.start()
        self.scheduler.start()
        rng = np.random.default_rng(7)
        for name in ("x", "w"):
            await self.put(name, rng.standard_normal(shape).astype(np.float32))
        return self

    async def put(self, name: str, a: np.ndarray) -> None:
        await self.worker.ref.ask(Put(name=name, dtype=str(a.dtype), shape=list(a.shape), data=a.tobytes()))

    async def run(self, program: list[Instr], fetch: list[str]) -> RunResult:
        return await self.scheduler.ref.ask(Run(program=program, fetch=fetch))

    async def stop(self) -> None:
        await self.scheduler.stop()
        await self.worker.stop()


def fresh(text: str) -> list[Instr]:
    """The program as new objects (a client builds its instructions anew every step)."""
    return parse_text(text.strip())


@pytest.mark.parametrize("passes", [["simplify", "cse", "dce", "fuse"], ["off"]])
async def test_a_repeated_program_gives_what_a_fresh_daemon_gives(nodes, passes):
    nodes += [await Node(passes).start(), await Node(passes).start()]
    looped, reference = nodes[-2], nodes[-1]
    for step in range(5):
        got = await looped.run(fresh(STEP), ["y", "s", "t2"])
        assert not got.error
        # the reference runs the same state from scratch: x changes every step in both
        want = await reference.run(fresh(STEP), ["y", "s", "t2"])
        for name in ("y", "s", "t2"):
            np.testing.assert_array_equal(got.tensors[name], want.tensors[name])
        assert got.done == want.done == len(fresh(STEP))
        assert len(got.times_us) == 2 * got.done
        x = np.full((3, 4), 0.25 * step, np.float32)
        await looped.put("x", x)
        await reference.put("x", x)
        reference.scheduler.plans.clear()  # the reference always plans and checks afresh
        reference.scheduler.rewrites = type(reference.scheduler.rewrites)(reference.scheduler.passes)
    assert looped.worker.prepared_runs >= 3
    if passes != ["off"]:  # the plan remembered, or the last program run again as it went (test_fast_path.py)
        assert looped.scheduler.plan_hits >= 3


async def test_a_changed_shape_or_fetch_is_checked_again(nodes):
    nodes.append(await Node(["simplify", "cse", "dce", "fuse"]).start())
    node = nodes[-1]
    for _ in range(2):
        assert not (await node.run(fresh(STEP), ["y"])).error
    hits = node.worker.prepared_runs
    # w with another shape: the same instructions no longer check (add cannot broadcast (3, 4) with (5,))
    await node.put("w", np.ones(5, np.float32))
    r = await node.run(fresh(STEP), ["y"])
    assert r.error.startswith("instruction 1: add") and r.error_index == 0
    assert node.worker.prepared_runs == hits
    # fetching a tensor that the program deletes is refused, though the instructions are known
    await node.put("w", np.ones((3, 4), np.float32))
    assert not (await node.run(fresh(STEP), ["y"])).error
    r = await node.run(fresh(STEP), ["t1"])
    assert "fetch: tensor 't1' not found" in r.error


async def test_numbers_of_another_type_or_sign_are_another_program(nodes):
    nodes.append(await Node(["off"]).start())
    node = nodes[-1]
    base = "mulscalar (tensor<float32>:x, var<float32>:{}) -> (tensor<float32>:z)"
    results = {}
    for value in ("0.0", "-0.0", "2.0", "2"):
        for _ in range(2):  # the second run of each is a known program
            r = await node.run(fresh(base.format(value)), ["z"])
            assert not r.error
        results[value] = r.tensors["z"]
    # x has no zeros: times -0.0 every sign flips against times 0.0 (a plan reused across the two would not)
    np.testing.assert_array_equal(np.signbit(results["-0.0"]), ~np.signbit(results["0.0"]))
    np.testing.assert_array_equal(results["2.0"], results["2"])


def test_same_program_sees_what_equality_does_not():
    a = [Instr("mulscalar", (Param.tensor("x", "float32"), Param("var", ("float32",), 1.0)),
               (Param.tensor("y", "float32"),))]
    kinds = scalar_kinds(a)
    for other, same in ((1.0, True), (1, False), (True, False), (2.0, False)):
        b = [a[0]._replace(args=(a[0].args[0], Param("var", ("float32",), other)))]
        assert same_program(b, a, kinds) is same
    z = [a[0]._replace(args=(a[0].args[0], Param("var", ("float32",), 0.0)))]
    nz = [a[0]._replace(args=(a[0].args[0], Param("var", ("float32",), -0.0)))]
    assert nz == z  # what == says
    assert not same_program(nz, z, scalar_kinds(z))
    assert same_program(list(z), tuple(z), scalar_kinds(z))
    v = [Instr("reshape", (Param.tensor("x"), Param.vector((2, 3))), (Param.tensor("y"),))]
    vf = [Instr("reshape", (Param.tensor("x"), Param("vector", ("int32",), (2.0, 3))), (Param.tensor("y"),))]
    assert vf == v and not same_program(vf, v, scalar_kinds(v))


async def test_a_kernel_error_in_a_known_program_reads_as_in_a_fresh_one(nodes):
    nodes.append(await Node(["off"]).start())
    node = nodes[-1]
    await node.put("i", np.array([0, 1], np.int32))
    await node.put("d", np.array([1, 0], np.int32))
    prog = "div (tensor<int32>:i, tensor<int32>:d) -> (tensor<int32>:q)"
    first = await node.run(fresh(prog), [])
    assert "integer division by zero" in first.error
    await node.put("d", np.array([1, 2], np.int32))
    assert not (await node.run(fresh(prog), [])).error
    assert not (await node.run(fresh(prog), [])).error  # known now
    await node.put("d", np.array([1, 0], np.int32))
    hits = node.worker.prepared_runs
    again = await node.run(fresh(prog), [])
    assert node.worker.prepared_runs == hits + 1
    assert again.error == first.error and again.error_index == first.error_index == 0 and again.done == 0


def _times_by_loop(times_us, origins, done):
    """original_times as a plain walk (the reference for the numpy form that long programs take)."""
    out, j, last, ran = [], 0, times_us[0], len(times_us) // 2
    for i in range(done):
        start = end = last
        first = True
        while j < len(origins) and origins[j] <= i:
            if j < ran and origins[j] == i:
                if first:
                    start, first = times_us[2 * j], False
                end = last = times_us[2 * j + 1]
            j += 1
        out += (start, end)
    return out


@pytest.mark.parametrize("seed", range(20))
def test_times_of_a_long_rewritten_program_map_back_as_the_walk_does(seed):
    from deepxd.compiler.pipeline import original_times

    rng = np.random.default_rng(seed)
    n = int(rng.integers(256, 1200))
    origins = sorted(rng.choice(n, int(rng.integers(1, n)), replace=False).tolist())
    origins = sorted(origins + origins[: int(rng.integers(0, 4))])  # a few that two instructions stand for
    ran = int(rng.integers(1, len(origins) + 1))
    times = np.sort(rng.uniform(0, 1000, 2 * ran)).tolist()
    done = int(rng.integers(256, n + 1))
    assert original_times(times, origins, done) == _times_by_loop(times, origins, done)
