"""The scheduler runs the passes on every program: same results and replies as the program sent, and after a failure
part way through a rewritten program, the same tensors as the program sent would have left."""

from __future__ import annotations

import numpy as np
import pytest

from deepxd.actors.base import ActorRef
from deepxd.actors.messages import Explain, Put, Run, SchedulerStats
from deepxd.actors.opcpu import CpuWorker
from deepxd.actors.scheduler import Scheduler
from deepxd.config import Config
from tests.compiler.helpers import program

CHAIN = """
    mul (tensor<float32>:x, tensor<float32>:x) -> (tensor<float32>:a)
    exp (tensor<float32>:x) -> (tensor<float32>:t)
    sqrt (tensor<float32>:t) -> (tensor<float32>:u)
    indexselect (tensor<float32>:x, tensor<int32>:i, var<int32>:0) -> (tensor<float32>:s)
    deltensor () -> (tensor<float32>:t)
    mulscalar (tensor<float32>:u, var<float32>:1.0) -> (tensor<float32>:v)
    neg (tensor<float32>:v) -> (tensor<float32>:y)
    deltensor () -> (tensor<float32>:u)
    deltensor () -> (tensor<float32>:v)
"""


class Node:
    def __init__(self, passes: list[str]) -> None:
        self.worker = CpuWorker(output_log=False)
        self.scheduler = Scheduler({"op-cpu": self.worker.ref}, config=Config(passes=passes))

    async def start(self, index: np.ndarray) -> Node:
        self.worker.start()
        self.scheduler.start()
        x = np.linspace(0.5, 2.0, 12, dtype=np.float32).reshape(4, 3)
        for name, a in (("x", x), ("i", index)):
            await self.worker.ref.ask(Put(name=name, dtype=str(a.dtype), shape=list(a.shape), data=a.tobytes()))
        return self

    @property
    def ref(self) -> ActorRef:
        return self.scheduler.ref

    def tensors(self) -> dict[str, np.ndarray]:
        return dict(self.worker.ex.tensors)

    async def stop(self) -> None:
        await self.scheduler.stop()
        await self.worker.stop()


async def pair(nodes: list[Node], index: list[int]) -> tuple[Node, Node]:
    """A node with every pass, and one with none (the reference)."""
    i = np.array(index, dtype=np.int32)
    nodes += [await Node(["simplify", "cse", "dce", "fuse"]).start(i), await Node(["off"]).start(i)]
    return nodes[-2], nodes[-1]


async def test_a_rewritten_program_replies_as_the_program_sent(nodes):
    fast, ref = await pair(nodes, [0, 3, 1])
    prog = program(CHAIN)
    got = await fast.ref.ask(Run(program=prog, fetch=["y"]))
    want = await ref.ref.ask(Run(program=prog, fetch=["y"]))
    assert not got.error and got.done == want.done == len(prog)
    assert len(got.times_us) == len(want.times_us) == 2 * len(prog)
    np.testing.assert_allclose(got.tensors["y"], want.tensors["y"], rtol=1e-6)
    assert sorted(fast.tensors()) == sorted(ref.tensors()) == ["a", "i", "s", "x", "y"]
    stats = await fast.ref.ask(SchedulerStats())
    assert stats["rewritten"] == 1 and stats["eliminated"] == 6 and stats["instructions"] == len(prog)
    assert (await ref.ref.ask(SchedulerStats()))["rewritten"] == 0


async def test_a_failure_part_way_leaves_what_the_program_sent_would_have(nodes):
    fast, ref = await pair(nodes, [0, 7, 1])  # 7 is out of range: indexselect fails at run time
    prog = program(CHAIN)
    got = await fast.ref.ask(Run(program=prog, fetch=[]))
    want = await ref.ref.ask(Run(program=prog, fetch=[]))
    assert want.error.startswith("instruction 4: indexselect: index 7 out of range")
    assert (got.error, got.error_index, got.done) == (want.error, want.error_index, want.done) == (want.error, 3, 3)
    assert len(got.times_us) == 2 * got.done
    have, expect = fast.tensors(), ref.tensors()
    assert {n: (a.shape, a.dtype) for n, a in have.items()} == {n: (a.shape, a.dtype) for n, a in expect.items()}
    for name in ("a", "t", "u"):  # t and u, which the fused program never made, made again with their values
        np.testing.assert_array_equal(have[name], expect[name])
    # a client sends again the deletions that did not run: they succeed on both
    rest = prog[4:5] + prog[7:8]
    for node in (fast, ref):
        again = await node.ref.ask(Run(program=rest, fetch=[]))
        assert not again.error, again.error
    assert sorted(fast.tensors()) == sorted(ref.tensors()) == ["a", "i", "x"]


async def test_a_refused_program_gets_the_exact_refusal(nodes):
    fast, ref = await pair(nodes, [0, 1])
    prog = program(CHAIN.replace("tensor<float32>:x, tensor<float32>:x", "tensor<float32>:x, tensor<float32>:zz"))
    got = await fast.ref.ask(Run(program=prog, fetch=[]))
    want = await ref.ref.ask(Run(program=prog, fetch=[]))
    assert (got.error, got.error_index, got.done) == (want.error, want.error_index, 0)
    assert "tensor 'zz' not found" in got.error


async def test_explain_shows_the_program_before_and_after(nodes):
    fast, _ = await pair(nodes, [0, 1])
    out = await fast.ref.ask(Explain(program=program(CHAIN), fetch=["y"]))
    assert out["passes"] == ["simplify", "cse", "dce", "fuse"]
    assert len(out["before"].splitlines()) == 9
    assert out["after"].splitlines() == [
        "mul (tensor<float32>:x, tensor<float32>:x) -> (tensor<float32>:a)",
        "indexselect (tensor<float32>:x, tensor<int32>:i, var<int32>:0) -> (tensor<float32>:s)",
        "fused (listtensor<float32>:[x], var<string>:-sqrt(exp(in0))) -> (tensor<float32>:y)",
    ]


POOLED = """
    mul (tensor<float32>:x, tensor<float32>:x) -> (tensor<float32>:p3)
    exp (tensor<float32>:p3) -> (tensor<float32>:p4)
    indexselect (tensor<float32>:x, tensor<int32>:i, var<int32>:0) -> (tensor<float32>:s)
    sqrt (tensor<float32>:p4) -> (tensor<float32>:p3)
    neg (tensor<float32>:p3) -> (tensor<float32>:p4)
    add (tensor<float32>:p4, tensor<float32>:x) -> (tensor<float32>:y)
"""


@pytest.mark.parametrize("index", [[0, 3, 1], [0, 7, 1]], ids=["runs", "fails"])
async def test_a_client_that_reuses_names(nodes, index):
    """Results written into the names of dropped ones (p3, p4): fused all the same; after a failure part way, the
    same tensors exist with the same shapes (the values of names whose values had ended are not reproduced)."""
    fast, ref = await pair(nodes, index)
    prog = program(POOLED)
    got = await fast.ref.ask(Run(program=prog, fetch=[] if index[1] == 7 else ["y"]))
    want = await ref.ref.ask(Run(program=prog, fetch=[] if index[1] == 7 else ["y"]))
    assert (got.error, got.error_index, got.done) == (want.error, want.error_index, want.done)
    have, expect = fast.tensors(), ref.tensors()
    assert {n: (a.shape, a.dtype) for n, a in have.items()} == {n: (a.shape, a.dtype) for n, a in expect.items()}
    if not got.error:
        np.testing.assert_allclose(got.tensors["y"], want.tensors["y"], rtol=1e-6)
        for name in ("p3", "p4", "s"):
            np.testing.assert_allclose(have[name], expect[name], rtol=1e-6)
        # mul and exp join sqrt; p3, p4 keep last values
        assert (await fast.ref.ask(SchedulerStats()))["eliminated"] == 2


def test_only_a_string_where_a_value_goes_makes_the_scheduler_read_the_variables():
    """A program may read a variable by name (a string where a number goes): then the passes need the worker's
    variables. A string an op takes as such (a reduction's "mean", a fused expression) names none, so a training
    step's program does not ask the worker for them."""
    from deepx_core.ir.text import parse_text
    from deepxd.actors.scheduler import _names_variables

    literal = parse_text("""
        crossentropy (tensor<float32>:z, tensor<int64>:y, var<int32>:-100, var<string>:mean) -> (tensor<float32>:l)
        fused (listtensor<float32>:[a b], var<string>:in0 * in1) -> (tensor<float32>:c)
    """.strip())
    assert not _names_variables(literal)
    by_name = parse_text("mulscalar (tensor<float32>:a, var<float32>:alpha) -> (tensor<float32>:b)")
    assert _names_variables(by_name)
    assert _names_variables(parse_text("argset (var<float32>:1.5) -> (var<float32>:alpha)"))


FOLDED = """
    transpose (tensor<float32>:w, vector<int32>:[1 0]) -> (tensor<float32>:wt)
    indexselect (tensor<float32>:x, tensor<int32>:i, var<int32>:0) -> (tensor<float32>:xs)
    matmul (tensor<float32>:xs, tensor<float32>:wt) -> (tensor<float32>:y)
    deltensor () -> (tensor<float32>:wt)
"""


async def test_a_failure_after_a_folded_transpose_leaves_its_name_as_the_program_sent_would_have(nodes):
    """fold_transpose never makes wt: when the program stops between the transpose and its deletion (the indexselect
    fails), repair makes wt, value and all, so that the same tensors exist as with the passes off, and the client's
    deletion of wt, sent again, succeeds on both. The first run, and a run of the program the worker knows (prepared
    calls)."""
    from deepxd.compiler import DEFAULT_PASSES

    i = np.array([0, 2], dtype=np.int32)
    nodes += [await Node(list(DEFAULT_PASSES)).start(i), await Node(["off"]).start(i)]
    fast, ref = nodes[-2], nodes[-1]
    w = np.linspace(-1, 1, 15, dtype=np.float32).reshape(5, 3)
    bad = np.array([0, 7], dtype=np.int32)
    prog = program(FOLDED)
    for repeats in (0, 3):
        for node in (fast, ref):
            await node.worker.ref.ask(Put(name="w", dtype="float32", shape=[5, 3], data=w.tobytes()))
            await node.worker.ref.ask(Put(name="i", dtype="int32", shape=[2], data=i.tobytes()))
            for _ in range(repeats):  # a step that repeats: the worker knows it and runs its prepared calls
                ok = await node.ref.ask(Run(program=prog, fetch=["y"]))
                assert not ok.error, ok.error
            await node.worker.ref.ask(Put(name="i", dtype="int32", shape=[2], data=bad.tobytes()))
        explained = await fast.ref.ask(Explain(program=prog, fetch=[]))
        assert [line.split(" ")[0] for line in explained["after"].splitlines()] == ["indexselect", "matmultransposed"]
        got = await fast.ref.ask(Run(program=prog, fetch=[]))
        want = await ref.ref.ask(Run(program=prog, fetch=[]))
        assert want.error.startswith("instruction 2: indexselect: index 7 out of range")
        assert (got.error, got.error_index, got.done) == (want.error, want.error_index, want.done)
        have, expect = fast.tensors(), ref.tensors()
        assert "wt" in expect
        assert {n: (a.shape, a.dtype) for n, a in have.items()} == {n: (a.shape, a.dtype) for n, a in expect.items()}
        np.testing.assert_array_equal(have["wt"], w.T)
        np.testing.assert_array_equal(have["wt"], expect["wt"])
        for node in (fast, ref):
            again = await node.ref.ask(Run(program=prog[3:], fetch=[]))
            assert not again.error, again.error
        assert sorted(fast.tensors()) == sorted(ref.tensors())
        assert "wt" not in fast.tensors()
    assert fast.worker.prepared_runs > 0  # the repeats ran as a program the worker knew


FOLDED_LATE = """
    copytensor (tensor<float32>:w) -> (tensor<float32>:v)
    transpose (tensor<float32>:v, vector<int32>:[1 0]) -> (tensor<float32>:vt)
    deltensor () -> (tensor<float32>:v)
    matmul (tensor<float32>:x, tensor<float32>:vt) -> (tensor<float32>:y)
    indexselect (tensor<float32>:x, tensor<int32>:i, var<int32>:0) -> (tensor<float32>:xs)
    deltensor () -> (tensor<float32>:vt)
"""


async def test_a_failure_after_the_folded_product_still_finds_the_transposed_value(nodes):
    """The transpose's operand v is deleted before the product reads vt; folded, the product reads v, whose deletion
    moves to where vt's value ends. A failure after the product (the indexselect) leaves vt to make again: v is still
    there, as it was, and goes after."""
    from deepxd.compiler import DEFAULT_PASSES

    i = np.array([0, 2], dtype=np.int32)
    nodes += [await Node(list(DEFAULT_PASSES)).start(i), await Node(["off"]).start(i)]
    fast, ref = nodes[-2], nodes[-1]
    w = np.linspace(-1, 1, 15, dtype=np.float32).reshape(5, 3)
    bad = np.array([0, 9], dtype=np.int32)
    prog = program(FOLDED_LATE)
    for node in (fast, ref):
        await node.worker.ref.ask(Put(name="w", dtype="float32", shape=[5, 3], data=w.tobytes()))
        await node.worker.ref.ask(Put(name="i", dtype="int32", shape=[2], data=bad.tobytes()))
    explained = await fast.ref.ask(Explain(program=prog, fetch=[]))
    assert [line.split(" ")[0] for line in explained["after"].splitlines()] == [
        "copytensor", "matmultransposed", "indexselect", "deltensor"]
    got = await fast.ref.ask(Run(program=prog, fetch=[]))
    want = await ref.ref.ask(Run(program=prog, fetch=[]))
    assert want.error.startswith("instruction 5: indexselect: index 9 out of range")
    assert (got.error, got.error_index, got.done) == (want.error, want.error_index, want.done)
    have, expect = fast.tensors(), ref.tensors()
    assert sorted(have) == sorted(expect) == ["i", "vt", "w", "x", "y"]
    for name in ("vt", "w", "x", "i"):
        np.testing.assert_array_equal(have[name], expect[name])
    np.testing.assert_allclose(have["y"], expect["y"], rtol=1e-6)  # BLAS may sum a transposed operand otherwise
    np.testing.assert_array_equal(have["vt"], w.T)
