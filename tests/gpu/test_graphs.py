"""CUDA graphs (deepxd/kernels/cuda/graphs.py, CudaExecutor.capture/replay): a training step captured once and
replayed gives bit for bit what running it instruction by instruction gives, step after step, with a new batch put
into the same memory each step; a replay whose inputs moved is refused; a program that needs the host mid-way is not
captured and leaves the tensor table as it was; a kernel's error flag is read after each replay."""

from __future__ import annotations

import numpy as np
import pytest

from deepx_core.errors import DeepxError
from deepx_core.ir import parse_text
from deepx_core.ir.ops import check_program
from tests.gpu.conftest import gpu_reason

pytestmark = pytest.mark.skipif(gpu_reason() is not None, reason=gpu_reason() or "")

PROLOGUE = """
newtensor (vector<int32>:[]) -> (tensor<float32>:loss)
"""

#: an MLP step: forward, a squared error, its backward by hand, SGD in place; temporaries made and deleted inside,
#: the loss of the step before deleted first (as the SDK's programs delete the names collected since)
STEP = """
deltensor () -> (tensor<float32>:loss)
matmul (tensor<float32>:x, tensor<float32>:w1) -> (tensor<float32>:h)
relu (tensor<float32>:h) -> (tensor<float32>:a)
matmul (tensor<float32>:a, tensor<float32>:w2) -> (tensor<float32>:y)
sub (tensor<float32>:y, tensor<float32>:t) -> (tensor<float32>:d)
mul (tensor<float32>:d, tensor<float32>:d) -> (tensor<float32>:e)
sum (tensor<float32>:e, vector<int32>:[0 1], var<bool>:false) -> (tensor<float32>:loss)
mulscalar (tensor<float32>:d, var<float32>:2.0) -> (tensor<float32>:gy)
transpose (tensor<float32>:a, vector<int32>:[1 0]) -> (tensor<float32>:at)
matmul (tensor<float32>:at, tensor<float32>:gy) -> (tensor<float32>:gw2)
transpose (tensor<float32>:w2, vector<int32>:[1 0]) -> (tensor<float32>:w2t)
matmul (tensor<float32>:gy, tensor<float32>:w2t) -> (tensor<float32>:ga)
greaterscalar (tensor<float32>:h, var<float32>:0.0) -> (tensor<bool>:mask)
todtype (tensor<bool>:mask) -> (tensor<float32>:maskf)
mul (tensor<float32>:ga, tensor<float32>:maskf) -> (tensor<float32>:gh)
transpose (tensor<float32>:x, vector<int32>:[1 0]) -> (tensor<float32>:xt)
matmul (tensor<float32>:xt, tensor<float32>:gh) -> (tensor<float32>:gw1)
{SGD1}
{SGD2}
deltensor () -> (tensor<float32>:h)
deltensor () -> (tensor<float32>:a)
deltensor () -> (tensor<float32>:y)
deltensor () -> (tensor<float32>:d)
deltensor () -> (tensor<float32>:e)
deltensor () -> (tensor<float32>:gy)
deltensor () -> (tensor<float32>:at)
deltensor () -> (tensor<float32>:gw2)
deltensor () -> (tensor<float32>:w2t)
deltensor () -> (tensor<float32>:ga)
deltensor () -> (tensor<bool>:mask)
deltensor () -> (tensor<float32>:maskf)
deltensor () -> (tensor<float32>:gh)
deltensor () -> (tensor<float32>:xt)
deltensor () -> (tensor<float32>:gw1)
""".format(**{f"SGD{i}": f"sgd (tensor<float32>:w{i}, tensor<float32>:gw{i}, tensor<float32>:b{i}, var<float32>:0.01, "
                           f"var<float32>:0.9) -> (tensor<float32>:w{i}, tensor<float32>:b{i})" for i in (1, 2)})

#: a loss whose kernel may flag a bad label: a capture is cut after it
LABELLED = """
exp (tensor<float32>:z) -> (tensor<float32>:ez)
crossentropy (tensor<float32>:ez, tensor<int64>:k, var<int32>:-100, var<string>:mean) -> (tensor<float32>:l)
mulscalar (tensor<float32>:l, var<float32>:2.0) -> (tensor<float32>:l2)
"""


def _setup(ex, rng_seed: int = 0) -> None:
    rng = np.random.default_rng(rng_seed)
    ex.put("w1", (rng.standard_normal((16, 32)) * 0.2).astype(np.float32))
    ex.put("w2", (rng.standard_normal((32, 4)) * 0.2).astype(np.float32))
    ex.put("b1", np.zeros((16, 32), np.float32))
    ex.put("b2", np.zeros((32, 4), np.float32))
    for instr in parse_text(PROLOGUE):
        ex.run(instr)


def _batch(ex, k: int) -> None:
    rng = np.random.default_rng(100 + k)
    ex.put("x", rng.standard_normal((8, 16)).astype(np.float32))
    ex.put("t", rng.standard_normal((8, 4)).astype(np.float32))


def _eager(ex, program) -> None:
    for b in check_program(program, ex, ex.plans):
        ex.execute(b)


def test_a_captured_step_replays_as_the_eager_steps_bit_for_bit(tmp_path):
    from deepxd.kernels.cuda import CudaExecutor

    program = parse_text(STEP)
    steps = 6
    with CudaExecutor(cache_dir=tmp_path) as eager, CudaExecutor(cache_dir=tmp_path) as graphed:
        _setup(eager)
        _setup(graphed)
        want, got = [], []
        captured = None
        for k in range(steps):
            _batch(eager, k)
            _eager(eager, program)
            want.append(eager.get("loss"))
            _batch(graphed, k)
            if k == 0:
                _eager(graphed, program)
            elif captured is None:
                bounds = check_program(program, graphed, graphed.plans)
                assert graphed.capturable(bounds) is None
                captured = graphed.capture(bounds)
                assert captured is not None
            else:
                assert graphed.replay(captured), "the step's inputs stayed where the graph reads them"
            got.append(graphed.get("loss"))
        assert captured.replays == steps - 2
        np.testing.assert_array_equal(np.array(got), np.array(want))
        for name in ("w1", "w2", "b1", "b2"):
            np.testing.assert_array_equal(graphed.get(name), eager.get(name))
        assert "h" not in graphed.tensors and "loss" in graphed.tensors  # the table as the program leaves it
        # an input put into new memory (another shape, then back): the graph refuses, the eager run goes on
        graphed.put("x", np.zeros((9, 16), np.float32))
        graphed.tensors.pop("x")
        graphed.put("x", np.zeros((8, 16), np.float32))
        assert not graphed.replay(captured)
        captured.destroy()


def test_inputs_in_new_memory_each_step_replay_through_staged_copies(tmp_path):
    """A batch put into other memory each step (the last one still held under another name): the graph refuses it
    and says which inputs moved; captured again with those staged, it copies them in at each launch, gives the eager
    steps' losses and weights bit for bit, leaves the inputs' names on the caller's memory and the older batches as
    they were."""
    from deepxd.kernels.cuda import CudaExecutor

    program = parse_text(STEP)
    steps = 6
    with CudaExecutor(cache_dir=tmp_path) as eager, CudaExecutor(cache_dir=tmp_path) as graphed:
        _setup(eager)
        _setup(graphed)
        want, got, held = [], [], []
        captured = None
        for k in range(steps):
            _batch(eager, k)
            _eager(eager, program)
            want.append(eager.get("loss"))
            if k:  # the last batch stays alive under its own names: this one lands in other memory
                held.append((k - 1, graphed.tensors.pop("x"), graphed.tensors.pop("t")))
                graphed.tensors[f"old_x{k - 1}"], graphed.tensors[f"old_t{k - 1}"] = held[-1][1:]
            _batch(graphed, k)
            if k == 0:
                _eager(graphed, program)
            elif k == 1:
                bounds = check_program(program, graphed, graphed.plans)
                first = graphed.capture(bounds)
                assert first is not None
            elif k == 2:
                assert not graphed.replay(first)
                assert sorted(first.movable(graphed.tensors)) == ["t", "x"]
                first.destroy()
                captured = graphed.capture(check_program(program, graphed, graphed.plans), ["x", "t", "w1"])
                assert captured is not None and sorted(captured.staged) == ["t", "x"]  # w1 is written: not staged
            else:
                assert graphed.replay(captured), "staged inputs hold wherever their memory is"
                assert graphed.tensors["x"] is not captured.staged["x"]
            got.append(graphed.get("loss"))
        assert captured.replays == steps - 3
        np.testing.assert_array_equal(np.array(got), np.array(want))
        for name in ("w1", "w2", "b1", "b2"):
            np.testing.assert_array_equal(graphed.get(name), eager.get(name))
        for k, _, _ in held:
            rng = np.random.default_rng(100 + k)
            np.testing.assert_array_equal(graphed.get(f"old_x{k}"), rng.standard_normal((8, 16)).astype(np.float32))
        graphed.put("x", np.zeros((9, 16), np.float32))  # another shape: refused, and not by moving
        assert not graphed.replay(captured) and captured.movable(graphed.tensors) is None
        captured.destroy()


def test_a_capture_out_of_memory_for_its_staged_copies_leaves_the_table(tmp_path):
    """Two inputs to stage, each 30% of the free memory: the second copy does not fit. The capture fails with the
    allocation's error and the inputs' names are still the caller's memory (not a half-made graph's buffers)."""
    from deepxd.kernels.cuda import CudaExecutor

    program = parse_text("add (tensor<float32>:x, tensor<float32>:t) -> (tensor<float32>:y)")
    with CudaExecutor(cache_dir=tmp_path) as ex:
        free, _ = ex.cuda.mem_get_info()
        n = int(free * 0.3) // 4
        ex.tensors["x"] = ex.zeros((n,), "float32")
        ex.tensors["t"] = ex.zeros((n,), "float32")
        x, t = ex.tensors["x"], ex.tensors["t"]
        bounds = check_program(program, ex, ex.plans)
        with pytest.raises(DeepxError, match="out of device memory"):
            ex.capture(bounds, ["x", "t"])
        assert ex.tensors["x"] is x and ex.tensors["t"] is t and "y" not in ex.tensors


def test_a_program_that_needs_the_host_is_not_captured_and_the_table_is_kept(tmp_path):
    from deepxd.kernels.cuda import CudaExecutor

    with CudaExecutor(cache_dir=tmp_path) as ex:
        ex.put("a", np.arange(6, dtype=np.float32))
        program = parse_text("""
exp (tensor<float32>:a) -> (tensor<float32>:b)
print (tensor<float32>:b) -> ()
""")
        bounds = check_program(program, ex, ex.plans)
        assert "touches the host" in ex.capturable(bounds)
        # a CPU fallback inside: capture gives up, nothing it made stays
        ex.put("i", np.arange(6, dtype=np.int16))
        fallback = parse_text("exp (tensor<float32>:a) -> (tensor<float32>:c)\n"
                              "cumsum (tensor<int16>:i, var<int32>:0, var<bool>:false) -> (tensor<int16>:s)")
        bounds = check_program(fallback, ex, ex.plans)
        before = dict(ex.tensors)
        if ex.capturable(bounds) is None:
            result = ex.capture(bounds)
            if result is None:
                assert dict(ex.tensors) == before
            else:  # every op of it had a kernel on this build: it ran
                np.testing.assert_allclose(ex.get("c"), np.exp(np.arange(6, dtype=np.float32)), rtol=1e-6)


def test_a_kernel_error_stops_a_replay_where_it_stops_a_run(tmp_path):
    """The graph is cut after crossentropy (its kernel may flag a bad label): a replay with a bad label raises,
    naming the instruction, and the instruction after it does not run, as instruction by instruction."""
    from deepxd.kernels.cuda import CudaExecutor

    program = parse_text(LABELLED)
    with CudaExecutor(cache_dir=tmp_path) as ex:
        ex.put("z", np.zeros((3, 4), np.float32))
        ex.put("k", np.array([0, 1, 2], np.int64))
        captured = ex.capture(check_program(program, ex, ex.plans))
        assert captured is not None and [c[0] for c in captured.checks] == [1] and len(captured.segments) == 2
        np.testing.assert_allclose(ex.get("l2"), 2 * np.log(4.0), rtol=1e-6)
        ex.put("z", np.ones((3, 4), np.float32))  # in place: the graph reads it; l2 would stay the same
        ex.put("l2", np.array(7.0, np.float32))  # in place too: shows whether the last instruction ran
        ex.put("k", np.array([0, 9, 2], np.int64))
        with pytest.raises(DeepxError, match="label is out of range") as e:
            ex.replay(captured)
        assert e.value.index == 1
        assert ex.get("l2") == 7.0  # the instruction after the failing one did not run
        ex.put("k", np.array([3, 1, 2], np.int64))
        assert ex.replay(captured)
        np.testing.assert_allclose(ex.get("l2"), 2 * np.log(4.0), rtol=1e-6)
        captured.destroy()


def test_a_kernel_error_in_a_replay_of_staged_inputs_leaves_their_names_on_the_callers_memory(tmp_path):
    """Both inputs staged, then put anew in other memory with a bad label: the replay stops at crossentropy, the
    inputs' names are the caller's new tensors (not the graph's copies) and the next replay reads them again."""
    from deepxd.kernels.cuda import CudaExecutor

    program = parse_text(LABELLED)
    with CudaExecutor(cache_dir=tmp_path) as ex:
        ex.put("z", np.zeros((3, 4), np.float32))
        ex.put("k", np.array([0, 1, 2], np.int64))
        captured = ex.capture(check_program(program, ex, ex.plans), ["z", "k"])
        assert captured is not None and sorted(captured.staged) == ["k", "z"]
        np.testing.assert_allclose(ex.get("l2"), 2 * np.log(4.0), rtol=1e-6)
        held = ex.tensors.pop("z"), ex.tensors.pop("k")  # still alive: the new ones land elsewhere
        ex.put("z", np.ones((3, 4), np.float32))
        ex.put("k", np.array([0, 9, 2], np.int64))
        z, k = ex.tensors["z"], ex.tensors["k"]
        assert (z.ptr, k.ptr) != (held[0].ptr, held[1].ptr)
        ex.put("l2", np.array(7.0, np.float32))
        with pytest.raises(DeepxError, match="label is out of range") as e:
            ex.replay(captured)
        assert e.value.index == 1 and ex.get("l2") == 7.0
        assert ex.tensors["z"] is z and ex.tensors["k"] is k
        np.testing.assert_array_equal(ex.get("k"), [0, 9, 2])
        ex.put("k", np.array([3, 1, 2], np.int64))  # in place: the caller's memory, copied in at the launch
        assert ex.replay(captured) and ex.tensors["z"] is z and ex.tensors["k"] is k
        np.testing.assert_allclose(ex.get("l2"), 2 * np.log(4.0), rtol=1e-6)
        captured.destroy()


def test_a_kernel_error_in_the_captures_own_run_leaves_the_table_as_a_run_stopped_there(tmp_path):
    """The capture runs the host side of the whole program before its first launch: where that launch stops at a
    flagged kernel, the names of the instructions after it are as they were (a tensor made later absent, one deleted
    later still there with its value), as instruction by instruction."""
    from deepxd.kernels.cuda import CudaExecutor

    program = parse_text("""
exp (tensor<float32>:z) -> (tensor<float32>:ez)
crossentropy (tensor<float32>:ez, tensor<int64>:k, var<int32>:-100, var<string>:mean) -> (tensor<float32>:l)
mulscalar (tensor<float32>:l, var<float32>:2.0) -> (tensor<float32>:l2)
deltensor () -> (tensor<float32>:old)
""")
    names = {}
    for graphed in (False, True):
        with CudaExecutor(cache_dir=tmp_path) as ex:
            ex.put("z", np.zeros((3, 4), np.float32))
            ex.put("k", np.array([0, 9, 2], np.int64))  # 9: out of range for 4 classes
            ex.put("old", np.arange(5, dtype=np.float32))
            bounds = check_program(program, ex, ex.plans)
            with pytest.raises(DeepxError, match="label is out of range") as e:
                if graphed:
                    ex.capture(bounds)
                else:
                    _eager(ex, program)
            if graphed:
                assert e.value.index == 1
            names[graphed] = set(ex.tensors)
            np.testing.assert_array_equal(ex.get("old"), np.arange(5, dtype=np.float32))
            np.testing.assert_allclose(ex.get("ez"), np.ones((3, 4), np.float32))
    assert names[True] == names[False] == {"z", "k", "old", "ez"}


def _adam_step(k: int, lr: float):
    return parse_text(f"""
mul (tensor<float32>:w, tensor<float32>:x) -> (tensor<float32>:g)
adamw (tensor<float32>:w, tensor<float32>:g, tensor<float32>:m, tensor<float32>:v, var<float64>:{lr}, var<float64>:0.9, var<float64>:0.999, var<float64>:1e-8, var<float64>:0.01, var<int32>:{k}) -> (tensor<float32>:w, tensor<float32>:m, tensor<float32>:v)
deltensor () -> (tensor<float32>:g)
""")  # noqa: E501


def test_an_optimizer_update_takes_new_numbers_each_step_without_a_new_graph(tmp_path):
    """AdamW's step count and a schedule's learning rate change every step: the captured update reads them from a
    slot that refresh() rewrites, and the replays match the runs instruction by instruction."""
    from deepxd.kernels.cuda import CudaExecutor

    rng = np.random.default_rng(5)
    w0 = rng.standard_normal(1000).astype(np.float32)
    with CudaExecutor(cache_dir=tmp_path) as eager, CudaExecutor(cache_dir=tmp_path) as graphed:
        for ex in (eager, graphed):
            ex.put("w", w0)
            ex.put("m", np.zeros(1000, np.float32))
            ex.put("v", np.zeros(1000, np.float32))
        captured = None
        for k in range(1, 7):
            lr = 0.1 / k
            x = rng.standard_normal(1000).astype(np.float32)
            eager.put("x", x)
            _eager(eager, _adam_step(k, lr))
            graphed.put("x", x)
            bounds = check_program(_adam_step(k, lr), graphed, graphed.plans)
            if k == 1:
                _eager(graphed, _adam_step(k, lr))
            elif captured is None:
                captured = graphed.capture(bounds)
                assert captured is not None and list(captured.slots) == [1]
            else:
                assert graphed.refresh(captured, 1, bounds[1])
                assert not graphed.refresh(captured, 0, bounds[0])  # not an update: its numbers are the graph's
                assert graphed.replay(captured)
            np.testing.assert_array_equal(graphed.get("w"), eager.get("w"), err_msg=f"step {k}")
        np.testing.assert_array_equal(graphed.get("m"), eager.get("m"))
        np.testing.assert_array_equal(graphed.get("v"), eager.get("v"))
        captured.destroy()


def test_scratch_memory_a_graph_writes_is_not_handed_out_under_it(tmp_path):
    """crossentropy and a split reduction allocate scratch inside their kernels: a tensor made and filled between two
    replays must not share it (both keep their values)."""
    from deepxd.kernels.cuda import CudaExecutor

    program = parse_text("""
crossentropy (tensor<float32>:z, tensor<int64>:k, var<int32>:-100, var<string>:mean) -> (tensor<float32>:l)
sum (tensor<float32>:big, vector<int32>:[0], var<bool>:false) -> (tensor<float32>:s)
""")
    rng = np.random.default_rng(9)
    z = rng.standard_normal((64, 10)).astype(np.float32)
    big = rng.standard_normal(1 << 20).astype(np.float32)
    with CudaExecutor(cache_dir=tmp_path) as ex:
        ex.put("z", z)
        ex.put("k", rng.integers(0, 10, 64))
        ex.put("big", big)
        captured = ex.capture(check_program(program, ex, ex.plans))
        assert captured is not None
        l0, s0 = ex.get("l"), ex.get("s")
        fillers = [rng.standard_normal(1 << 16).astype(np.float32) for _ in range(8)]
        for i, f in enumerate(fillers):  # new tensors from the pool between the replays
            ex.put(f"fill{i}", f)
        assert ex.replay(captured)
        np.testing.assert_array_equal(ex.get("l"), l0)
        np.testing.assert_array_equal(ex.get("s"), s0)
        for i, f in enumerate(fillers):
            np.testing.assert_array_equal(ex.get(f"fill{i}"), f)
        captured.destroy()


def test_an_index_out_of_range_stops_a_replay_before_the_gather(tmp_path):
    from deepxd.kernels.cuda import CudaExecutor

    program = parse_text("""
indexselect (tensor<float32>:w, tensor<int64>:i, var<int32>:0) -> (tensor<float32>:e)
mulscalar (tensor<float32>:e, var<float32>:2.0) -> (tensor<float32>:e2)
""")
    with CudaExecutor(cache_dir=tmp_path) as ex:
        ex.put("w", np.arange(12, dtype=np.float32).reshape(4, 3))
        ex.put("i", np.array([0, 3], np.int64))
        captured = ex.capture(check_program(program, ex, ex.plans))
        if captured is None:
            pytest.skip("indexselect is not captured on this build")
        ex.put("i", np.array([0, 99], np.int64))
        with pytest.raises(DeepxError) as e:
            ex.replay(captured)
        assert e.value.index == 0
        ex.put("i", np.array([1, 2], np.int64))
        assert ex.replay(captured)  # the context is still usable
        np.testing.assert_array_equal(ex.get("e2"), 2 * np.arange(12, dtype=np.float32).reshape(4, 3)[[1, 2]])
        captured.destroy()
