"""Sessions (issue 4, items 1 and 3): embedded by default, the same numbers against a deepxd subprocess, deepxIR over
UDP, errors at the right line, a flat tensor count over a long loop, lost connections, disconnect and reconnect."""

from __future__ import annotations

import gc
import inspect
import itertools
import signal
import sys
import threading
import time
import traceback

import numpy as np
import pytest

import deepx_sdk as dx
import deepx_sdk.nn.functional as F
from deepx_sdk.client import NativeClient
from deepxd.actors.messages import Fetch, SchedulerStats, WorkerTensors
from tests.compiler.test_fast_path import REWRITTEN_DIVIDE
from tests.daemon.conftest import Daemon
from tests.sdk.conftest import current_session

HERE = __file__


def session_module():
    return sys.modules["deepx_sdk.session"]


def lineno() -> int:
    """The line this is called from."""
    return inspect.currentframe().f_back.f_lineno


def user_lines(exc: BaseException) -> list[int]:
    """The lines of this file in an exception's traceback, outermost first."""
    return [f.lineno for f in traceback.extract_tb(exc.__traceback__) if f.filename == HERE]


def embedded_tensor_count() -> int:
    s = dx.session()
    return len(s.transport._call(s.transport.node.ref("op-cpu").ask(WorkerTensors())))


@pytest.fixture(scope="module")
def deepxd(tmp_path_factory):
    """One deepxd subprocess (native socket and UDP) shared by this module's tests that only talk to it. Its roles
    are the embedded session's (the CPU's), and so is its matmul library (here torch's OpenMP runtime keeps MKL out
    of this process; two libraries sum a product in different orders), so that the two give the same numbers bit
    for bit."""
    from deepxd.kernels.cpu import blas

    d = Daemon(tmp_path_factory.mktemp("deepxd"), extra=["--role", "registry,heapmem,scheduler,op-cpu"],
               env={"DEEPX_BLAS": "mkl" if blas.mkl() is not None else "numpy"}).start()
    yield d
    dx.disconnect()
    d.stop()


# ---------------------------------------------------------------- connecting


def test_embedded_by_default():
    dx.disconnect()
    assert current_session() is None
    x = dx.ones(2, 3) * 2  # using a tensor before connect connects with the defaults
    s = current_session()
    assert s is not None and type(s.transport).__name__ == "EmbeddedTransport"
    assert x._s is s and dx.session() is s
    assert s.transport.address.startswith("unix://")
    np.testing.assert_array_equal(x.numpy(), np.full((2, 3), 2.0, np.float32))
    s2 = dx.connect()
    assert type(s2.transport).__name__ == "EmbeddedTransport" and s2 is not s and s.closed
    assert dx.session() is s2


def test_connect_refuses_bad_addresses(tmp_path):
    with pytest.raises(dx.DeepxError, match="unknown address"):
        dx.connect("http://localhost:1")
    with pytest.raises(dx.DeepxError, match="cannot reach deepxd at tcp://"):
        dx.connect("tcp://127.0.0.1:1")
    with pytest.raises(dx.DeepxError, match="must be tcp://HOST:PORT"):
        dx.connect("tcp://localhost:port")
    with pytest.raises(dx.DeepxError, match="cannot reach deepxd"):
        dx.connect(f"unix://{tmp_path}/missing.sock")
    with pytest.raises(dx.DeepxError, match="bad address"):
        dx.connect("udp://localhost:port")
    np.testing.assert_array_equal(dx.arange(3).numpy(), [0, 1, 2])  # still usable: defaults again


def test_disconnect_then_use_reconnects_with_defaults():
    x = dx.tensor([1.0, 2.0])
    old = dx.session()
    dx.disconnect()
    assert old.closed and current_session() is None
    with pytest.raises(dx.DeepxError, match="closed"):
        x.numpy()  # a tensor of the closed session
    y = dx.tensor([3.0, 4.0]) + 1
    assert dx.session() is not old and type(dx.session().transport).__name__ == "EmbeddedTransport"
    np.testing.assert_array_equal(y.numpy(), [4.0, 5.0])
    dx.disconnect()
    dx.disconnect()  # twice is harmless
    np.testing.assert_array_equal(dx.ones(1).numpy(), [1.0])


def script(rng_seed: int = 7) -> dict[str, np.ndarray]:
    """A little model-like computation whose results can be compared bit for bit between two daemons."""
    rng = np.random.default_rng(rng_seed)
    s = dx.session()
    s.base_seed, s.seed_counter = 42, itertools.count(1)  # what dx.manual_seed(42) sets
    x = dx.tensor(rng.standard_normal((8, 16)).astype(np.float32))
    w = dx.tensor(rng.standard_normal((16, 10)).astype(np.float32))
    b = dx.tensor(rng.standard_normal(10).astype(np.float32))
    target = dx.tensor(rng.integers(0, 5, 8))
    h = F.gelu(x @ w + b)
    h = F.layer_norm(h, 10)
    logits = h[:, ::2] * 3 - h.mean(-1, keepdim=True)
    loss = F.cross_entropy(logits, target)
    p = logits.softmax(-1)
    top = p.max(-1)
    m = dx.where(x > 0, x, x * 0.1)
    m[0] = -1.0
    noise = dx.randn(4, 4) + dx.rand(4, 4)
    ints = dx.arange(24).reshape(2, 3, 4).permute(2, 0, 1).sum((0, 2))
    return {
        "loss": loss.numpy(), "p": p.numpy(), "values": top.values.numpy(), "indices": top.indices.numpy(),
        "masked": x[x > 0.5].numpy(), "m": m.numpy(), "noise": noise.numpy(), "ints": ints.numpy(),
        "cat": dx.cat([x[:2], m[-2:]], 0).std(0).numpy(), "item": np.array(loss.item()),
    }


def test_same_numbers_embedded_and_against_deepxd(deepxd):
    embedded = script()
    dx.connect(deepxd.address)
    assert type(dx.session().transport).__name__ == "NativeTransport"
    remote = script()
    assert embedded.keys() == remote.keys()
    for k in embedded:
        assert embedded[k].dtype == remote[k].dtype and embedded[k].shape == remote[k].shape, k
        np.testing.assert_array_equal(embedded[k], remote[k], err_msg=k)
    dx.disconnect()
    again = script()
    for k in embedded:
        np.testing.assert_array_equal(embedded[k], again[k], err_msg=k)


def training(steps: int = 12) -> list[np.ndarray]:
    """An MLP's SGD steps (each the same program: the scheduler's fast path from the seventh), losses and weights."""
    import deepx_sdk.nn as nn
    from deepx_sdk.optim import SGD

    rng = np.random.default_rng(3)
    model = nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 5))
    for p in model.parameters():
        p.data = dx.tensor(rng.standard_normal(p.shape).astype(np.float32) * 0.3)
    opt = SGD(model.parameters(), lr=0.05, momentum=0.9)
    x, y = dx.tensor(rng.standard_normal((32, 12)).astype(np.float32)), dx.tensor(rng.integers(0, 5, 32))
    out = []
    for _ in range(steps):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        out.append(np.array(loss.item()))
    return out + [p.numpy() for p in model.parameters()]


def test_training_steps_run_now_in_the_embedded_daemon_as_over_a_socket(deepxd):
    """The embedded daemon runs a repeated step with no event loop step (Scheduler.now_run, LoopThread.now); the
    same steps against a deepxd go through its actors' asks: the same bits."""
    dx.disconnect()
    embedded = training()
    stats = dx.session().transport._call(dx.session().transport.node.ref("scheduler").ask(SchedulerStats()))
    # (a plan hit by an ask comes only before the loop settles: a backward sent on its own)
    assert stats["now_hits"] >= 4 and stats["plan_hits"] - stats["now_hits"] <= 2
    dx.connect(deepxd.address)
    remote = training()
    for k, (a, b) in enumerate(zip(embedded, remote)):
        np.testing.assert_array_equal(a, b, err_msg=str(k))
    dx.disconnect()


def test_run_now_repairs_a_failed_step_and_leaves_heap_deletes_to_the_ask():
    """Through the embedded session's own loop (LoopThread.now): a rewritten step that fails part-way on the fast
    path is finished under the same turn, its tensors set straight as the whole path sets them; a step that deletes
    a heap tensor (heapmem is told) goes by the ask. Each run is one message to each actor."""
    from deepx_core.ir.text import parse_text

    dx.disconnect()
    t = dx.session().transport
    sched, worker = t.node.ref("scheduler")._actor, t.node.worker()._actor
    step = parse_text(REWRITTEN_DIVIDE.strip())
    for name, a in (("x", np.ones((3, 4), np.float32)), ("w", np.ones((3, 4), np.float32)),
                    ("i", np.array([7, 8], np.int32)), ("d", np.array([4, 4], np.int32))):
        t.put(name, a, False)
    before = (sched.programs, sched.now_hits, sched.stats.by_message.get("run", 0), t.runner.resumed)
    outcomes = [t.run(list(step), ["p", "x", "d"]) for _ in range(5)]
    assert [o.ok for o in outcomes] == [True] * 4 + [False]
    assert outcomes[-1].error == "instruction 4: div: integer division by zero (div('i', 'd') -> 'q')"
    assert outcomes[-1].done == 3
    assert sched.now_hits - before[1] == 3  # the third, the fourth and the failing fifth
    assert sched.programs - before[0] == sched.stats.by_message["run"] - before[2] == 5
    assert not sched._busy and not worker._busy and len(sched.plans) == 0  # the failed step's plans are gone
    # the first three instructions ran (x + w twice, their product), the division did not: d and x as they were;
    # a and b exist, as the step left them before its deletes (b, which the rewrite never made, made as zeros:
    # pipeline.repair)
    got = t._call(t.node.worker().ask(Fetch(names=["d", "x", "p", "a", "b"])))
    np.testing.assert_array_equal(got["d"], [0, 0])
    np.testing.assert_array_equal(got["x"], np.full((3, 4), 5, np.float32))
    np.testing.assert_array_equal(got["p"], np.full((3, 4), 36, np.float32))
    np.testing.assert_array_equal(got["a"], np.full((3, 4), 6, np.float32))
    assert got["b"].shape == (3, 4)
    # a heap tensor put afresh for each step, which the step deletes
    heap_step = parse_text("""
        add (tensor<float32>:x, tensor<float32>:h) -> (tensor<float32>:t1)
        sum (tensor<float32>:t1, vector<int32>:[1], var<bool>:false) -> (tensor<float32>:s)
        deltensor () -> (tensor<float32>:t1)
        deltensor () -> (tensor<float32>:h)""".strip())
    hits, runs = sched.now_hits, sched.stats.by_message["run"]
    for k in range(6):
        t.put("h", np.full((3, 4), k, np.float32), True)
        o = t.run(list(heap_step), ["s"])
        assert o.ok and list(o.tensors["s"]) == [4 * (5 + k)] * 3
    assert sched.now_hits == hits and sched.stats.by_message["run"] == runs + 6
    assert "h" not in worker.heap and "h" not in worker.ex.tensors
    dx.disconnect()


def test_deepx_address_in_the_environment(deepxd, monkeypatch):
    monkeypatch.setenv("DEEPX_ADDRESS", deepxd.address)
    dx.disconnect()
    x = dx.arange(4) * 3
    assert type(dx.session().transport).__name__ == "NativeTransport"
    assert dx.session().transport.address == deepxd.address
    np.testing.assert_array_equal(x.numpy(), [0, 3, 6, 9])


# ---------------------------------------------------------------- UDP


def test_udp_runs_instructions_and_refuses_to_read_values(deepxd):
    dx.connect(f"udp://127.0.0.1:{deepxd.udp_port}")
    assert type(dx.session().transport).__name__ == "UdpTransport"
    a = dx.ones(2, 3)
    b = dx.arange(3, dtype=dx.float32)
    c = (a + b) * 2 - 1  # broadcasting is sent as an explicit broadcastTo
    d = (a @ b.reshape(3, 1)).sum()
    dx.sync()  # runs, eagerly, one instruction per datagram
    with NativeClient(deepxd.address, timeout=10) as client:
        got = client.fetch(c.name, d.name)
    np.testing.assert_array_equal(got[c.name], np.array([[1, 3, 5], [1, 3, 5]], np.float32))
    assert got[d.name].item() == 6.0
    with pytest.raises(dx.DeepxError, match=r"cannot read tensor values over udp://") as ei:
        c.numpy()
    assert "unix://" in str(ei.value)  # and says what to do instead
    with pytest.raises(dx.DeepxError, match="udp"):
        d.item()
    assert "unavailable" in repr(c)
    with pytest.raises(dx.DeepxError, match="cannot send tensor data"):
        dx.tensor([1.0, 2.0])  # data cannot travel either


def test_udp_reports_a_failed_instruction(deepxd):
    dx.connect(f"udp://127.0.0.1:{deepxd.udp_port}")
    a = dx.ones(3)
    idx = dx.full((1,), 5, dtype=dx.int64)
    line = lineno() + 1
    bad = a[idx]  # index 5 of 3: only the executor can tell
    with pytest.raises(dx.DeepxError, match="indexselect") as ei:
        dx.sync()
    assert f"{HERE}:{line}" in str(ei.value)
    del bad


# ---------------------------------------------------------------- errors at the right line


@pytest.mark.parametrize("case", ["broadcast", "matmul", "reshape", "cat", "index", "dim", "permute", "expand",
                                  "layer_norm", "cross_entropy"])
def test_shape_error_is_raised_at_the_line_that_caused_it(case):
    a, b = dx.ones(2, 3), dx.ones(4, 5)
    labels = dx.zeros(3, dtype=dx.int64)
    dx.sync()
    pending = len(dx.session().pending)
    make = {
        "broadcast": lambda: a + b,
        "matmul": lambda: a @ b,
        "reshape": lambda: a.reshape(4, 2),
        "cat": lambda: dx.cat([a, b], 0),
        "index": lambda: a[5],
        "dim": lambda: a.sum(3),
        "permute": lambda: a.permute(0, 2),
        "expand": lambda: a.expand(3, 3),
        "layer_norm": lambda: F.layer_norm(a, 5),
        "cross_entropy": lambda: F.cross_entropy(a, labels),
    }[case]
    line = lineno() + 2
    with pytest.raises(dx.DeepxError) as ei:
        make()
    lines = user_lines(ei.value)
    assert lines[-1] == inspect.getsourcelines(make)[1], "the innermost user frame is the line that made the op"
    assert line in lines
    assert len(dx.session().pending) == pending, "a refused op records nothing"
    np.testing.assert_array_equal((a * 2).numpy(), np.full((2, 3), 2.0, np.float32))  # the session goes on


def test_shape_error_traceback_points_at_the_statement():
    x = dx.ones(3, 4)
    y = dx.ones(5, 4)
    line = lineno() + 2
    try:
        z = x @ y  # noqa: F841
    except dx.DeepxError as e:
        assert user_lines(e)[-1] == line
        assert "matmul" in str(e) and "(3, 4)" in str(e) and "(5, 4)" in str(e)
    else:
        pytest.fail("x @ y with mismatched shapes was accepted")


def test_runtime_error_is_raised_at_the_next_read_naming_the_source_line():
    x = dx.tensor([1.0, 2.0, 3.0])
    line = lineno() + 1
    y = x[dx.tensor([9])]  # the shape check cannot know that 9 is out of range
    z = y * 2  # recorded after the failing instruction
    w = dx.ones(2) + 1
    with pytest.raises(dx.DeepxError) as ei:
        w.numpy()  # the next read, of an unrelated tensor
    msg = str(ei.value)
    assert "indexselect" in msg and "9" in msg and "out of range" in msg
    assert f"{HERE}:{line}" in msg and "test_runtime_error_is_raised_at_the_next_read" in msg
    # the session goes on: later reads work, and collecting the handles that never came to exist is harmless
    del y, z, w
    gc.collect()
    np.testing.assert_array_equal((x * 2).numpy(), [2.0, 4.0, 6.0])
    dx.sync()
    np.testing.assert_array_equal(dx.ones(2).sum().numpy(), 2.0)


def _helper_that_fails(x):
    return x[dx.tensor([5])] + 1  # the failing line is here, in user code below the SDK


def test_runtime_error_names_the_innermost_user_line():
    line = inspect.getsourcelines(_helper_that_fails)[1] + 1
    r = _helper_that_fails(dx.ones(3))
    with pytest.raises(dx.DeepxError, match=rf"{HERE}:{line}, in _helper_that_fails"):
        dx.sync()
    del r


def test_a_temporary_of_a_failed_program_is_not_pooled():
    """`x[bad] + 1`: the index result is a temporary, collected (and pooled for reuse) before its program was sent;
    that program then failed at the index, so the temporary never came to exist. The pool must not hand out its
    name, nor empty_cache delete it (a deltensor of a tensor that is not there fails the next program)."""
    s = dx.session()
    s.sync()
    r = _helper_that_fails(dx.ones(3))
    with pytest.raises(dx.DeepxError, match="out of range"):
        dx.sync()
    del r
    gc.collect()
    dx.sync()
    pooled = {n for names in s.names.pool.values() for n in names}
    assert not pooled & s.names.lost
    reused = [dx.ones(1) * k for k in range(4)]  # names of the failed program's shape come from the pool, if any
    np.testing.assert_array_equal(np.concatenate([t.numpy() for t in reused]), [0.0, 1.0, 2.0, 3.0])
    del reused
    dx.empty_cache()
    dx.sync()
    assert (dx.ones(2) + 1).numpy().tolist() == [2.0, 2.0]


def test_runtime_error_at_sync_and_at_item():
    a = dx.tensor([[1.0, 2.0], [3.0, 4.0]])
    line = lineno() + 1
    b = a[:, dx.tensor([2])]
    with pytest.raises(dx.DeepxError, match=rf":{line}"):
        dx.sync()
    dx.sync()  # raised once, then cleared
    c = a[dx.tensor([-3])].sum()  # -3 is out of range for 2 rows
    with pytest.raises(dx.DeepxError, match="out of range"):
        c.item()
    del b, c


def test_the_first_error_is_reported_when_the_program_was_flushed_early():
    """Past max_pending the program goes out without a read; its error waits for the next read, which reports it
    rather than what followed from it."""
    dx.connect(max_pending=8)
    x = dx.tensor([1.0, 2.0, 3.0])
    line = lineno() + 1
    y = x[dx.tensor([7])]
    for _ in range(30):
        y = y * 2 + 1  # these depend on the failed one and fail in later frames
    with pytest.raises(dx.DeepxError) as ei:
        y.numpy()
    assert "indexselect" in str(ei.value) and f":{line}," in str(ei.value)
    np.testing.assert_array_equal((dx.ones(2) + 1).numpy(), [2.0, 2.0])
    dx.disconnect()


# ---------------------------------------------------------------- memory


def test_loop_of_10000_iterations_keeps_the_tensor_count_flat():
    gc.collect()
    dx.empty_cache()  # what earlier tests of this session left pooled is not this loop's
    x = dx.randn(16, 16)
    w = dx.randn(16, 16)
    dx.sync()
    before = embedded_tensor_count()
    peak = before
    for i in range(10_000):
        y = (x @ w * 0.5 + i).relu()
        z = y.sum(0) - y.mean()
        if i % 2500 == 0:
            dx.sync()
            peak = max(peak, embedded_tensor_count())
    dx.sync()
    after = embedded_tensor_count()
    # collected temporaries are pooled for reuse (at most 16 per shape and dtype): flat, not growing
    assert after <= before + 16, f"{before} tensors before the loop, {after} after"
    assert peak <= before + 20, f"{peak} tensors at the peak"
    assert z.shape == (16,)
    del y, z
    gc.collect()
    dx.empty_cache()
    dx.sync()
    assert embedded_tensor_count() == before


def test_loop_against_deepxd_keeps_the_tensor_count_flat(deepxd):
    dx.connect(deepxd.address)
    x = dx.tensor(np.ones((8, 8), np.float32))
    dx.sync()
    with NativeClient(deepxd.address, timeout=10) as admin:
        def count():
            return len([t for t in admin.admin("tensors") if t["name"].startswith(dx.session().names.prefix)])

        before = count()
        for i in range(3000):
            y = x * i + 1
            x2 = y.softmax(-1)
        dx.sync()
        assert count() <= before + 16  # at most 16 pooled temporaries per shape and dtype
        del y, x2
        gc.collect()
        dx.empty_cache()
        dx.sync()
        assert count() == before
    dx.disconnect()


def test_collecting_a_tensor_in_another_thread_never_blocks():
    """Garbage collection runs in whichever thread allocates (the embedded daemon's too) while the session's lock
    may be held by a thread that waits on that daemon: a collected handle must not wait for the lock."""

    class Cycle:
        pass

    s = dx.session()
    s.sync()  # started before the cycle is made (a node's start freezes what exists then out of collection)
    c = Cycle()
    c.self, c.t = c, dx.ones(2)
    name = c.t.name
    dx.sync()
    del c
    collected = threading.Event()
    with s._lock:
        t = threading.Thread(target=lambda: (gc.collect(), collected.set()), daemon=True)
        t.start()
        t.join(10)
        assert collected.is_set(), "gc.collect() in another thread blocked on the session"
    dx.empty_cache()  # the collected name may have been pooled for reuse rather than deleted
    dx.sync()
    names = [r["name"] for r in s.transport._call(s.transport.node.ref("op-cpu").ask(WorkerTensors()))]
    assert name not in names


# ---------------------------------------------------------------- lost connections


@pytest.mark.timeout(60)
def test_lost_connection_raises_a_clear_error_and_never_hangs(tmp_path):
    d = Daemon(tmp_path, udp=False).start()
    try:
        dx.connect(d.address)
        x = dx.tensor([1.0, 2.0]) * 2
        np.testing.assert_array_equal(x.numpy(), [2.0, 4.0])
        d.proc.send_signal(signal.SIGKILL)
        d.proc.wait(10)
        y = x + 1  # recording needs no connection

        outcome: list[BaseException | None] = []

        def read():
            try:
                y.numpy()
                outcome.append(None)
            except BaseException as e:
                outcome.append(e)

        t = threading.Thread(target=read, daemon=True)
        start = time.monotonic()
        t.start()
        t.join(10)
        assert not t.is_alive(), "reading after the daemon died hung"
        assert time.monotonic() - start < 10
        err = outcome[0]
        assert isinstance(err, dx.DeepxError), f"expected a DeepxError, got {err!r}"
        assert "lost the connection to deepxd" in str(err)
        with pytest.raises(dx.DeepxError, match="lost the connection to deepxd"):
            (x * 5).numpy()  # and at every use after
        with pytest.raises(dx.DeepxError):
            dx.tensor([1.0])
        dx.disconnect()  # does not hang or raise
        np.testing.assert_array_equal((dx.ones(2) * 3).numpy(), [3.0, 3.0])  # defaults again: embedded
        assert type(dx.session().transport).__name__ == "EmbeddedTransport"
    finally:
        d.stop()


@pytest.mark.timeout(60)
def test_embedded_daemon_stopped_raises_a_clear_error():
    s = dx.connect()
    x = dx.ones(2)
    dx.sync()
    s.transport.close()  # the embedded node stops under the session
    with pytest.raises(dx.DeepxError, match="embedded deepxd has stopped"):
        (x + 1).numpy()
    dx.disconnect()
    np.testing.assert_array_equal(dx.ones(1).numpy(), [1.0])


# ---------------------------------------------------------------- lazy recording


def test_recording_is_lazy_and_a_read_sends_one_program():
    s = dx.session()
    dx.sync()
    sent: list[int] = []
    run = s.transport.run

    def counting_run(program, fetch):
        sent.append(len(program))
        return run(program, fetch)

    s.transport.run = counting_run
    try:
        a = dx.ones(4)
        b = (a + 1) * 3
        c = b.sum()
        assert sent == [] and len(s.pending) >= 4
        assert c.item() == 24.0
        assert len(sent) == 1 and sent[0] >= 4
        assert s.pending == []
    finally:
        del s.transport.run


def test_pending_program_is_sent_when_it_grows_past_the_limit():
    s = dx.connect(max_pending=64)
    sent: list[int] = []
    run = s.transport.run
    s.transport.run = lambda program, fetch: (sent.append(len(program)), run(program, fetch))[1]
    x = dx.ones(3)
    for _ in range(200):
        x = x + 1
    assert len(sent) >= 3 and max(sent) <= 2 * 64  # 64 recorded, and the deltensor of collected temporaries
    np.testing.assert_array_equal(x.numpy(), [201.0] * 3)
    dx.disconnect()


def test_a_program_still_pending_at_exit_runs_on_the_embedded_daemon(tmp_path):
    """The atexit handler flushes the last program, which runs (the embedded daemon runs every program on its event
    loop; a worker that offloads heavy programs runs them inline once concurrent.futures refuses new work at exit,
    instead of failing with 'cannot schedule new futures')."""
    import subprocess

    script = tmp_path / "pending.py"
    script.write_text(
        "import deepx_sdk as dx, deepx_sdk.nn as nn\n"
        "from deepx_sdk.optim import AdamW\n"
        "m = nn.Linear(512, 512); opt = AdamW(m.parameters())\n"
        "m(dx.randn(256, 512)).sum().backward(); opt.step()\n"  # heavy for a worker that offloads
    )
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr and "Error" not in r.stderr, r.stderr


def test_large_temporaries_are_deleted_where_their_program_ends_and_keep_their_names():
    """A result of DELETE_MIN elements or more is deleted once Python lets it go (its name is reused by the next
    result of its shape, so a loop still sends the same program every step): the daemon then knows the value is dead
    when the program ends, and fuses a Linear's bias add into the ReLU after it. Smaller results stay pooled with
    their buffers and need no deltensor."""
    from deepx_sdk.tensor import DELETE_MIN

    s = dx.connect()  # a fresh session: the name pool empty
    rows = DELETE_MIN // 128
    rng = np.random.default_rng(3)
    x, w = dx.tensor(rng.standard_normal((rows, 64)).astype(np.float32)), dx.tensor(
        rng.standard_normal((64, 128)).astype(np.float32))
    b = dx.tensor(rng.standard_normal(128).astype(np.float32))
    small = dx.tensor(rng.standard_normal((4, 4)).astype(np.float32))
    sent: list[list[str]] = []
    run = s.transport.run

    def recording_run(program, fetch):
        sent.append([str(i) for i in program])
        return run(program, fetch)

    s.transport.run = recording_run
    want = np.maximum(x.numpy() @ w.numpy() + b.numpy(), 0).sum(dtype=np.float64)
    try:
        for _ in range(6):
            y = (x @ w + b).relu()  # x @ w and its sum with b: large temporaries, gone by the next line
            got = y.sum().item()
            assert got == pytest.approx(want, rel=1e-4)
            z = (small * 2 + 1).sum().item()
            assert z == pytest.approx(float((small.numpy() * 2 + 1).sum()), rel=1e-5)
            del y
    finally:
        del s.transport.run
    steps = [p for p in sent if any(line.startswith("matmul") for line in p)]
    # the programs repeat (the daemon's caches see a repeat): y, deleted at the start of the next step's program, is
    # named again only after that program has gone, so two programs take turns
    assert len({tuple(p) for p in steps[-4:]}) <= 2
    last = steps[-1]
    deleted = " ".join(line for line in last if line.startswith("deltensor"))

    def made(*ops: str) -> set[str]:
        return {line.rsplit(":", 1)[1].rstrip(")") for line in last if line.startswith(ops)}

    assert made("matmul", "add ") and all(name in deleted for name in made("matmul", "add "))
    small_steps = [p for p in sent if any(line.startswith("mulscalar") for line in p)]
    assert small_steps and not any(line.startswith("deltensor") for line in small_steps[-1])
    # the daemon fused the bias add into the relu: the plan for the step, as the worker checked it, has no add
    sched = s.transport.node.ref("scheduler")._actor
    programs = [[bd.op.name for bd in p.prepared.bounds] for bucket in sched.plans.values() for p in bucket
                if p.prepared is not None]
    assert any("matmul" in ops and "fused" in ops and "add" not in ops for ops in programs), programs
