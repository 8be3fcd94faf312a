"""newtensor of a name that exists (issue 21, item 12): kept when it has the asked shape and dtype, replaced by zeros
when it has another, refused for a heap tensor of another; the check (bind, check_program, the passes' context),
the executor, its prepared steps and the op worker's known programs all agree."""

from __future__ import annotations

import asyncio
import logging

import numpy as np
import pytest
from kernel_ref import VEC, T, run

from deepx_core.errors import DeepxError
from deepx_core.ir import parse_text
from deepx_core.ir.instr import Instr, Param
from deepx_core.ir.ops import SymbolicEnv, TensorMeta, check_program
from deepxd.actors.messages import Run
from deepxd.actors.opcpu import CpuWorker
from deepxd.compiler.analysis import PassContext
from deepxd.compiler.pipeline import run_passes
from deepxd.kernels.cpu import CpuExecutor

# one program that makes 'a' twice, of two shapes, and reads the second
TWICE = """
newtensor (vector<int32>:[2 3]) -> (tensor<float32>:a)
arange (var<int32>:0, var<int32>:1) -> (tensor<float32>:a)
newtensor (vector<int32>:[4]) -> (tensor<float32>:a)
addscalar (tensor<float32>:a, var<float32>:1) -> (tensor<float32>:a)
newtensor (vector<int32>:[4]) -> (tensor<float32>:b)
add (tensor<float32>:a, tensor<float32>:a) -> (tensor<float32>:b)
"""


def test_same_shape_and_dtype_keeps_the_tensor_and_its_values(caplog):
    ex = CpuExecutor()
    ex.put("a", np.full((2, 3), 7, np.float32))
    held = ex.get("a")
    with caplog.at_level(logging.WARNING):
        run(ex, "newtensor", [VEC([2, 3])], [T("a", "float32")])
    assert ex.get("a") is held and (held == 7).all()
    assert "tensor 'a' already exists; keeping the old one (float32[2, 3], values and all)" in caplog.text


@pytest.mark.parametrize(("shape", "dtype"), [([4], "float32"), ([2, 3], "float64"), ([3, 2], "int8"), ([], "bool")])
def test_another_shape_or_dtype_replaces_with_zeros(shape, dtype, caplog):
    ex = CpuExecutor()
    ex.put("a", np.full((2, 3), 7, np.float32))
    with caplog.at_level(logging.WARNING):
        run(ex, "newtensor", [VEC(shape)], [T("a", dtype)])
    got = ex.get("a")
    assert got.shape == tuple(shape) and got.dtype == np.dtype(dtype) and not got.any()
    assert ex.tensors.metas["a"] == TensorMeta(tuple(shape), dtype)
    assert "keeping" not in caplog.text


def test_exists_keep_keeps_any_tensor_quietly(caplog):
    """The SDK's own newtensor before deleting a stale name keeps whatever stands there."""
    ex = CpuExecutor()
    ex.put("a", np.full((2, 3), 7, np.float32))
    keep = Instr("newtensor", (Param.vector(()),), (Param("tensor", ("float64",), "a"),), (("exists", "keep"),))
    with caplog.at_level(logging.WARNING):
        ex.run(keep)
    assert ex.get("a").shape == (2, 3) and (ex.get("a") == 7).all() and not caplog.text
    # the same instruction without the metadata, bound from the same cache: replaced
    ex.run(keep._replace(meta=()))
    assert ex.get("a").shape == () and ex.get("a").dtype == np.float64
    ex.put("a", np.full((2, 3), 7, np.float32))
    ex.run(keep)
    assert ex.get("a").shape == (2, 3), "a bound instruction without exists=keep was reused for one with it"


def test_a_heap_tensor_is_not_replaced():
    ex = CpuExecutor()
    ex.put("w", np.ones((2, 3), np.float32))
    ex.pinned = {"w": ex.get("w")}  # as the op worker marks its heap tensors
    with pytest.raises(DeepxError) as caught:
        run(ex, "newtensor", [VEC([4])], [T("w", "float32")])
    assert str(caught.value).startswith("newtensor: heap tensor 'w' is float32[2, 3]; it cannot be replaced by "
                                        "float32[4] (other processes map it): delete it first, or use another name")
    assert ex.get("w").shape == (2, 3) and (ex.get("w") == 1).all()


def test_the_check_follows_the_new_shape():
    env = SymbolicEnv({"a": TensorMeta((5,), "int32")})
    bounds = check_program(parse_text(TWICE), env)
    assert bounds[0].outs == [TensorMeta((2, 3), "float32")]
    assert bounds[2].outs == [TensorMeta((4,), "float32")]
    assert bounds[5].args == [TensorMeta((4,), "float32"), TensorMeta((4,), "float32")]
    assert bounds[5].outs == [TensorMeta((4,), "float32")]


@pytest.mark.parametrize("prepared", [False, True])
def test_the_program_runs_with_the_new_shape(prepared):
    for start in ({}, {"a": np.ones(4, np.float32)}, {"a": np.ones((2, 3), np.float32)}):
        ex = CpuExecutor()
        for n, v in start.items():
            ex.put(n, v)
        bounds = check_program(parse_text(TWICE), ex, ex.plans)
        if prepared:
            for step in map(ex.prepare, bounds):
                step()
        else:
            for b in bounds:
                ex.execute(b)
        np.testing.assert_array_equal(ex.get("a"), np.ones(4, np.float32))
        np.testing.assert_array_equal(ex.get("b"), np.full(4, 2, np.float32))


def test_the_passes_see_the_new_shape():
    """The scheduler's passes bind the program as the worker does: after them, it computes the same."""
    prog = parse_text(TWICE)
    ctx = PassContext(metas={"a": TensorMeta((2, 3), "float32")}, fetch=frozenset({"a", "b"}))
    assert ctx.bind(prog)[5].outs == [TensorMeta((4,), "float32")]
    after = run_passes(prog, ctx)
    ex = CpuExecutor()
    ex.put("a", np.ones((2, 3), np.float32))
    ex.run_all(after)
    np.testing.assert_array_equal(ex.get("b"), np.full(4, 2, np.float32))


def test_a_replaced_view_leaves_its_transpose_its_values():
    ex = CpuExecutor()
    ex.put("x", np.arange(6, dtype=np.float32).reshape(2, 3))
    b = ex.plans.bind(parse_text("transpose (tensor<float32>:x, vector<int32>:[1 0]) -> (tensor<float32>:t)")[0], ex)
    ex.transient = {id(b)}  # a transpose whose result dies in the program becomes a view
    ex.execute(b)
    assert ex.views, "the transpose is a view of x"
    run(ex, "newtensor", [VEC([4])], [T("x", "float32")])
    assert ex.get("x").shape == (4,) and not ex.get("x").any()
    np.testing.assert_array_equal(ex.get("t"), np.arange(6, dtype=np.float32).reshape(2, 3).T)


def test_the_op_worker_runs_two_scripts_that_name_their_tensors_alike():
    """Two front-end scripts on one worker, both naming tensors 0, 1, 2, taking turns three times (later turns run by
    the plans the scheduler made of them): every run computes its own script's result."""
    a = parse_text("""
        newtensor (vector<int32>:[2 3]) -> (tensor<float32>:0)
        newtensor (vector<int32>:[2 3]) -> (tensor<float32>:1)
        newtensor (vector<int32>:[2 3]) -> (tensor<float32>:2)
        arange (var<int32>:0, var<int32>:1) -> (tensor<float32>:0)
        constant (var<float32>:0.5) -> (tensor<float32>:1)
        add (tensor<float32>:0, tensor<float32>:1) -> (tensor<float32>:2)
    """.replace("\n        ", "\n").strip())
    b = parse_text("""
        newtensor (vector<int32>:[4]) -> (tensor<int32>:0)
        newtensor (vector<int32>:[4]) -> (tensor<int32>:1)
        newtensor (vector<int32>:[4]) -> (tensor<int32>:2)
        arange (var<int32>:10, var<int32>:1) -> (tensor<int32>:0)
        constant (var<int32>:3) -> (tensor<int32>:1)
        mul (tensor<int32>:0, tensor<int32>:1) -> (tensor<int32>:2)
    """.replace("\n        ", "\n").strip())
    want_a = np.arange(6, dtype=np.float32).reshape(2, 3) + 0.5
    want_b = (np.arange(10, 14) * 3).astype(np.int32)

    async def scripts() -> None:
        from deepxd.actors.scheduler import Scheduler
        from deepxd.config import Config

        w = CpuWorker()
        sched = Scheduler({"op-cpu": w.ref}, config=Config(passes=["off"]))
        w.start()
        sched.start()
        try:
            for _ in range(3):
                for prog, want in ((a, want_a), (b, want_b)):
                    r = await sched.ref.ask(Run(program=prog, fetch=["2"]))
                    assert not r.error, r.error
                    np.testing.assert_array_equal(r.tensors["2"], want)
                    assert r.tensors["2"].dtype == want.dtype
        finally:
            await sched.stop()
            await w.stop()
        assert w.prepared_runs == 3, "from the second B on, each script finds the state its plan read: as prepared"

    asyncio.run(scripts())
