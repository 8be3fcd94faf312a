"""dx.compile: a training step captured once, stored as graph:<name>, and replayed by name trains exactly as the
eager step does; signatures, refusals, listing, explain; against the embedded daemon and a deepxd subprocess."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import deepx_sdk as dx
import deepx_sdk.nn as nn
import deepx_sdk.nn.functional as F
from deepx_core.errors import DeepxError
from deepx_core.graphrecord import GraphRecord
from deepxd.actors.messages import WorkerTensors
from tests.daemon.conftest import Daemon


def mlp_run(compiled: bool, optimizer: str, steps: int = 10, arrays: bool = False, sched: bool = False):
    """Train a float64 MLP for `steps` steps; the losses, the final parameters, and the step function."""
    dx.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3)).double()
    if optimizer == "sgd":
        opt = dx.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3)
    elif optimizer == "sgd-plain":
        opt = dx.optim.SGD(model.parameters(), lr=0.05)
    else:
        opt = dx.optim.Adam(model.parameters(), lr=1e-2)
    lr_sched = dx.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5) if sched else None

    def train_step(x, y):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss

    step = dx.compile(train_step) if compiled else train_step
    rng = np.random.default_rng(7)
    losses = []
    for _ in range(steps):
        xa, ya = rng.standard_normal((6, 8)), rng.integers(0, 3, 6)
        x, y = (xa, ya) if arrays and compiled else (dx.tensor(xa), dx.tensor(ya))
        losses.append(step(x, y).item())
        if lr_sched is not None:
            lr_sched.step()
    return np.array(losses), [p.numpy() for p in model.parameters()], step


@pytest.mark.parametrize("optimizer", ["sgd", "sgd-plain", "adam"])
def test_replay_trains_exactly_as_eager(optimizer: str) -> None:
    eager_losses, eager_params, _ = mlp_run(False, optimizer)
    losses, params, step = mlp_run(True, optimizer)
    np.testing.assert_allclose(losses, eager_losses, rtol=1e-12, atol=1e-14)
    for a, b in zip(params, eager_params):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-14)
    assert losses[-1] < losses[0]
    # an optimizer whose first step makes its buffers is captured on the second call; plain SGD is captured on the
    # first (no gradients yet) and on the second (gradients held since: another signature); later calls replay
    assert step.captures == 2 and step.replays == 8
    assert len(step.graph_names) == (2 if optimizer == "sgd-plain" else 1)


def test_arrays_as_inputs_and_a_learning_rate_schedule() -> None:
    eager_losses, eager_params, _ = mlp_run(False, "adam", sched=True)
    losses, params, step = mlp_run(True, "adam", arrays=True, sched=True)
    np.testing.assert_allclose(losses, eager_losses, rtol=1e-12, atol=1e-14)
    for a, b in zip(params, eager_params):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-14)
    assert step.replays == 8


def test_changed_shape_captures_a_new_graph() -> None:
    w = dx.randn(8, 4, dtype=dx.float64)

    @dx.compile
    def f(x):
        return (x @ w).relu().sum(dim=1)

    a, b = np.random.rand(5, 8), np.random.rand(3, 8)
    for _ in range(2):
        ra, rb = f(dx.tensor(a)), f(dx.tensor(b))
    assert f.captures == 2 and f.replays == 2 and len(f.graph_names) == 2
    wn = w.numpy()
    np.testing.assert_allclose(ra.numpy(), np.maximum(a @ wn, 0).sum(1), rtol=1e-12)
    np.testing.assert_allclose(rb.numpy(), np.maximum(b @ wn, 0).sum(1), rtol=1e-12)
    assert ra.shape == (5,) and rb.shape == (3,) and ra.dtype == "float64"
    # another dtype, or a non-tensor argument's value, is another signature too
    f(dx.tensor(a.astype(np.float32)))
    assert f.captures == 3


def test_graphs_are_listed_and_stored_in_the_plane() -> None:
    @dx.compile(name="listed_step")
    def f(x, scale):
        return (x * scale + 1).exp()

    x = dx.tensor(np.arange(6.0).reshape(2, 3))
    out = f(x, 0.5)
    again = f(x, 0.5)
    np.testing.assert_allclose(again.numpy(), np.exp(np.arange(6.0).reshape(2, 3) * 0.5 + 1))
    np.testing.assert_array_equal(out.numpy(), again.numpy())
    (name,) = f.graph_names
    assert name.startswith("listed_step-")
    listed = {g.name: g for g in dx.graphs()}
    assert listed[name].instructions > 0 and listed[name].inputs == [(f"{name}.in0", "float64", (2, 3))]
    node = dx.session().transport.node
    data = node_kv_get(node, f"graph:{name}")
    rec = GraphRecord.unpack(data, name)
    assert len(rec.instrs) == listed[name].instructions and rec.outputs[0][2] == (2, 3)
    assert f"{name}.out0" in {str(p.value) for i in rec.instrs for p in i.returns}


def node_kv_get(node, key: str) -> bytes:
    import asyncio

    s = dx.session()
    return asyncio.run_coroutine_threadsafe(node.kv.get(key), s.transport.loop).result()


def test_accumulating_gradients_across_calls_replays_as_eager() -> None:
    """No zero_grad: each call adds to the last call's gradients, in place (as torch's .grad), so the step writes a
    tensor from outside in place, as the optimizer writes the parameters, and replays as it runs eagerly."""

    def run(compiled: bool) -> tuple[list[float], Any, np.ndarray]:
        dx.manual_seed(0)
        model = nn.Linear(3, 1).double()
        opt = dx.optim.SGD(model.parameters(), lr=0.1)

        def step(x):
            model(x).sum().backward()
            opt.step()
            return model.weight.sum()

        f = dx.compile(step) if compiled else step
        x = dx.tensor(np.ones((2, 3)))
        return [float(f(x).item()) for _ in range(5)], getattr(f, "replays", None), model.weight.grad.numpy()

    eager, _, eager_grad = run(False)
    replayed, replays, grad = run(True)
    assert replays == 3  # the first call (no gradients yet) and the second (the first to add) are captured
    np.testing.assert_allclose(replayed, eager, rtol=1e-12)
    np.testing.assert_allclose(grad, eager_grad, rtol=1e-12)


def test_zero_grad_outside_the_step() -> None:
    eager_losses, eager_params, _ = mlp_run(False, "sgd-plain")
    dx.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3)).double()
    opt = dx.optim.SGD(model.parameters(), lr=0.05)

    @dx.compile
    def step(x, y):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss

    rng = np.random.default_rng(7)
    losses = []
    for _ in range(10):
        opt.zero_grad()
        losses.append(step(rng.standard_normal((6, 8)), rng.integers(0, 3, 6)).item())
    np.testing.assert_allclose(losses, eager_losses, rtol=1e-12, atol=1e-14)
    for p, want in zip(model.parameters(), eager_params):
        np.testing.assert_allclose(p.numpy(), want, rtol=1e-12, atol=1e-14)
    assert step.captures == 1 and step.replays == 9


def test_python_runs_at_capture_only() -> None:
    calls = []

    @dx.compile
    def f(x):
        calls.append(1)  # a side effect: traced once per signature, as torch.compile and jax.jit do
        return x * 2

    x = dx.tensor(np.ones(3))
    for _ in range(4):
        y = f(x)
    assert calls == [1] and y.numpy().tolist() == [2.0, 2.0, 2.0]


def test_reading_a_value_inside_is_refused() -> None:
    @dx.compile
    def f(x):
        y = x.sum()
        if y.item() > 0:  # data-dependent control flow
            return y
        return -y

    with pytest.raises(dx.DeepxError, match=r"reads a tensor value .* Return the tensor"):
        f(dx.tensor(np.ones(3)))
    assert dx.tensor(np.ones(2)).sum().item() == 2.0  # the session works on, uncaptured


def test_sending_data_inside_is_refused() -> None:
    @dx.compile
    def f(x):
        return x + dx.tensor(np.ones(3))

    with pytest.raises(dx.DeepxError, match="sends data from Python"):
        f(dx.tensor(np.ones(3)))


def test_returning_an_input_is_refused() -> None:
    f = dx.compile(lambda x: x)
    with pytest.raises(dx.DeepxError, match="did not compute"):
        f(dx.tensor(np.ones(3)))


def test_no_grad_inside() -> None:
    w = dx.tensor(np.full((3, 2), 0.5), requires_grad=True)

    @dx.compile
    def predict(x):
        with dx.no_grad():
            return (x @ w).softmax(-1)

    x = np.random.rand(4, 3)
    for _ in range(3):
        p = predict(dx.tensor(x))
    assert not p.requires_grad and predict.replays == 2
    np.testing.assert_allclose(p.numpy(), np.full((4, 2), 0.5))


def test_explain_shows_before_and_after_the_passes() -> None:
    _, _, step = mlp_run(True, "sgd-plain", steps=2)
    e = step.explain()
    assert e.name == step.graph_names[-1] and e.passes
    before, after = e.before.splitlines(), e.after.splitlines()
    assert any(line.startswith("sgd ") for line in before) and any(line.startswith("fused") for line in after)
    # the folds show: a Linear's transposes read by its products, its bias gradients made in the fused loops
    assert any(line.startswith("transpose ") for line in before)
    assert not any(line.startswith("transpose ") for line in after)
    assert any(line.startswith("matmultransposed ") for line in after)
    assert any(line.startswith("fusedcolsum ") for line in after)
    assert len(after) < len(before)
    assert dx.explain(e.name).after == e.after
    assert "-- after the passes" in str(e)
    with pytest.raises(dx.DeepxError, match="no graph named"):
        dx.explain("no_such_graph")


def test_explain_without_a_graph_shows_where_the_last_program_ran(tmp_path) -> None:
    """dx.explain(): the session's last program, each instruction on the node and worker it ran on and what moved
    (nothing, on one node: docs/cluster.md shows programs across nodes), embedded and over the native socket."""
    x = dx.tensor(np.arange(6, dtype=np.float32))
    assert float((x * 2).sum().item()) == 30.0
    p = dx.explain()
    assert isinstance(p, dx.Placed) and p.bytes == 0 and not p.back
    assert p.instructions and all(r["worker"] == "op-cpu" and r["node"] == p.node and not r["moved"]
                                  for r in p.instructions)
    assert any(r["instr"].startswith("sum ") for r in p.instructions)
    assert f"program on node {p.node}:" in str(p) and "sum " in str(p)
    d = Daemon(tmp_path).start()
    try:
        dx.connect(d.address)
        with pytest.raises(dx.DeepxError, match="has run no program yet"):
            dx.explain()
        y = dx.tensor(np.ones(3, dtype=np.float32)) + 1
        assert y.numpy().tolist() == [2, 2, 2]
        p = dx.explain()
        assert p.node == d.node_id and [r["node"] for r in p.instructions] == [d.node_id] * len(p.instructions)
    finally:
        dx.connect()
        assert d.stop() == 0, d.output()


def test_against_a_deepxd_subprocess(tmp_path) -> None:
    d = Daemon(tmp_path).start()
    try:
        dx.connect(d.address)
        eager_losses, eager_params, _ = mlp_run(False, "adam", steps=5)
        losses, params, step = mlp_run(True, "adam", steps=5, arrays=True)
        np.testing.assert_allclose(losses, eager_losses, rtol=1e-12, atol=1e-14)
        for a, b in zip(params, eager_params):
            np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-14)
        assert step.replays == 3
        assert step.graph_names[0] in {g.name for g in dx.graphs()}
    finally:
        dx.disconnect()
        assert d.stop() == 0, d.output()


def scaled_relu_sum(x, w):
    return (x @ w).relu().sum()


def test_a_stored_graph_replays_after_a_daemon_restart(tmp_path) -> None:
    kv = f"memory://{tmp_path}/plane.aof"
    x, w = np.random.rand(4, 3), np.random.rand(3, 2) - 0.5
    want = np.maximum(x @ w, 0).sum()
    d = Daemon(tmp_path, kv=kv).start()
    try:
        dx.connect(d.address)
        f = dx.compile(scaled_relu_sum)
        assert f(x, w).item() == pytest.approx(want, rel=1e-12)
        assert f.captures == 1
        (name,) = f.graph_names
    finally:
        dx.disconnect()
        assert d.stop() == 0, d.output()
    d = Daemon(tmp_path, kv=kv).start()
    try:
        dx.connect(d.address)
        assert name in {g.name for g in dx.graphs()}
        g = dx.compile(scaled_relu_sum)  # a fresh compiled function, as a new process would make
        assert g(x, w).item() == pytest.approx(want, rel=1e-12)
        assert g.captures == 0 and g.replays == 1
        x2 = np.random.rand(4, 3)
        assert g(dx.tensor(x2), dx.tensor(w)).item() == pytest.approx(np.maximum(x2 @ w, 0).sum(), rel=1e-12)
    finally:
        dx.disconnect()
        assert d.stop() == 0, d.output()


def test_random_ops_draw_fresh_seeds_at_every_replay() -> None:
    def run(compiled: bool) -> list[np.ndarray]:
        dx.manual_seed(3)
        drop = nn.Dropout(0.5)

        def f(x):
            return drop(x) + dx.rand(4, 5, dtype=dx.float64)

        step = dx.compile(f) if compiled else f
        x = dx.tensor(np.ones((4, 5)))
        return [step(x).numpy() for _ in range(4)]

    got = run(True)
    assert not np.array_equal(got[2], got[3])  # not the captured mask and values again
    for a, b in zip(got, run(False)):  # the same draws as the eager calls, in the same order
        np.testing.assert_array_equal(a, b)


def test_a_compiled_step_with_dropout_takes_the_gradient_through_the_forward_mask() -> None:
    # the backward redraws dropout's mask from the forward's seed: a replay gives both the same fresh seed
    def run(compiled: bool) -> list[np.ndarray]:
        dx.manual_seed(3)
        lin = nn.Linear(5, 5).double()
        drop = nn.Dropout(0.5)
        opt = dx.optim.SGD(lin.parameters(), lr=0.1)

        def f(x):
            opt.zero_grad()
            loss = (drop(lin(x)) ** 2).sum()
            loss.backward()
            opt.step()
            return loss

        step = dx.compile(f) if compiled else f
        x = dx.tensor(np.ones((4, 5)))
        out = []
        for _ in range(5):
            out.append(step(x).item())
            out.append(lin.weight.numpy())
        if compiled:
            assert step.replays == 3
            assert len({k for _, _, k in step.last.record.scalars if k.startswith("seed.")}) == 1
        return out

    for a, b in zip(run(True), run(False)):
        np.testing.assert_array_equal(a, b)


def test_eval_mode_is_part_of_the_signature() -> None:
    dx.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5)).double()
    f = dx.compile(lambda x: model(x) * 1.0)
    x = dx.tensor(np.ones((2, 4)))
    f(x)
    f(x)
    model.eval()
    np.testing.assert_array_equal(f(x).numpy(), (model(x) * 1.0).numpy())  # no dropout: a graph of its own
    assert (f.captures, f.replays) == (2, 1)
    model.train()
    f(x)
    assert (f.captures, f.replays) == (2, 2)


def test_a_refused_replay_does_not_count_an_optimizer_step() -> None:
    from deepx_core.ir import parse_text

    dx.manual_seed(0)
    lin = nn.Linear(3, 1).double()
    opt = dx.optim.Adam(lin.parameters(), lr=0.1)

    def step(x):
        opt.zero_grad()
        loss = (lin(x) ** 2).mean()
        loss.backward()
        opt.step()
        return loss

    f = dx.compile(step)
    x = dx.tensor(np.ones((4, 3)))
    for _ in range(3):
        f(x)
    assert f.replays == 1
    counts = [opt.state[id(p)]["step"] for p in lin.parameters()]
    assert counts == [3, 3]
    held = sorted((v.name, v.shape) for st in opt.state.values() for v in st.values() if hasattr(v, "name"))
    s = dx.session()
    name, shape = held[0]
    s.transport.run(parse_text(f"deltensor () -> (tensor<float64>:{name})"), ())  # behind the SDK's back
    with pytest.raises(dx.DeepxError, match=name):
        f(x)
    assert [opt.state[id(p)]["step"] for p in lin.parameters()] == counts
    # put it back, so that the handle's deletion finds it when Python collects the optimizer
    dims = " ".join(map(str, shape))
    s.transport.run(parse_text(f"newtensor (vector<int32>:[{dims}]) -> (tensor<float64>:{name})"), ())


def test_a_compiled_method_finds_the_model_and_optimizer_on_its_instance() -> None:
    class Trainer:
        def __init__(self) -> None:
            dx.manual_seed(1)
            self.model = nn.Linear(3, 1).double()
            self.opt = dx.optim.Adam(self.model.parameters(), lr=0.1)

        def step(self, x, y):
            self.opt.zero_grad()
            loss = ((self.model(x) - y) ** 2).mean()
            loss.backward()
            self.opt.step()
            return loss

        compiled_step = dx.compile(step)

    x, y = dx.tensor(np.random.rand(8, 3)), dx.tensor(np.random.rand(8, 1))
    eager, compiled = Trainer(), Trainer()
    want = [eager.step(x, y).item() for _ in range(6)]
    got = [compiled.compiled_step(x, y).item() for _ in range(6)]
    np.testing.assert_allclose(got, want, rtol=1e-12)
    assert Trainer.compiled_step.replays == 4


def test_the_same_input_twice_is_one_input() -> None:
    f = dx.compile(lambda a, b: a * b + 1)
    x, y = np.random.rand(3), np.random.rand(3)
    tx, ty = dx.tensor(x), dx.tensor(y)
    for _ in range(2):
        same, other = f(tx, tx), f(tx, ty)
        arrays = f(x, x)
    np.testing.assert_allclose(same.numpy(), x * x + 1)
    np.testing.assert_allclose(other.numpy(), x * y + 1)
    np.testing.assert_allclose(arrays.numpy(), x * x + 1)
    assert f.captures == 3 and f.replays == 3


def test_an_in_place_update_of_an_outside_tensor_is_replayed_in_place() -> None:
    total = dx.zeros(3, dtype=dx.float64)

    @dx.compile
    def accumulate(x):
        total.add_(x)  # copytensor into a tensor the caller holds: state, updated by every replay
        return total * 1.0

    for k in range(4):
        out = accumulate(dx.tensor(np.full(3, k + 1.0)))
    np.testing.assert_array_equal(total.numpy(), [10.0, 10.0, 10.0])
    np.testing.assert_array_equal(out.numpy(), [10.0, 10.0, 10.0])
    assert accumulate.replays == 3


def test_a_small_output_comes_back_with_its_replay(monkeypatch) -> None:
    """A replay's small outputs (a loss) are read back with it: item() next costs no round trip. The value is used
    only while nothing else has been sent or recorded since."""
    s = dx.session()
    sent = []
    run = s.transport.run
    monkeypatch.setattr(s.transport, "run", lambda *a, **k: sent.append(a[0]) or run(*a, **k))
    w = dx.tensor(np.array([2.0]))

    @dx.compile
    def scaled(x):
        return (x * w).sum()

    x = dx.tensor(np.array([1.0, 2.0, 3.0]))
    for _ in range(2):
        scaled(x)  # captured, then replayed
    out = scaled(x)
    sent.clear()
    assert out.item() == 12.0
    assert sent == []  # no round trip
    out.add_(1)  # recorded: the value read back is no longer the tensor's
    assert out.item() == 13.0
    other = scaled(x)
    x.mul_(2)  # sent with the next read: `other` was made before it, and its value is still 12
    assert dx.tensor(np.zeros(1)).sum().item() == 0.0
    assert other.item() == 12.0
    again = scaled(x)
    w.add_(1)
    assert again.item() == 24.0  # the replay before the update
    assert scaled(x).item() == 36.0


def _a_replayed_function() -> tuple[Any, np.random.Generator, dx.Tensor, Any]:
    """A fresh session, a large input, and a compiled function of it whose output is large too."""
    s = dx.connect()
    rng = np.random.default_rng(0)
    x = dx.tensor(rng.standard_normal((256, 128)).astype(np.float32))

    @dx.compile
    def f(a):
        return (a * 2.0 + 1.0) * 3.0

    return s, rng, x, f


def test_a_replays_large_output_is_deleted_after_a_later_program_fails():
    """A replay's output may take the name of a large temporary deleted before (Session.reuse_name): the replay made
    it, so a later program that fails before writing that name must not count it as never made, or the tensor is
    never deleted when Python drops it (found in review: the daemon's tensor count grew by one per loop)."""
    import gc

    s, rng, x, f = _a_replayed_function()

    def count() -> int:
        return len(s.transport._call(s.transport.node.ref("op-cpu").ask(WorkerTensors())))

    for _ in range(3):
        y = f(x)
        y.numpy()
        del y
    counts = []
    for _ in range(4):
        t = x * 5.0  # a large temporary, dropped: its name is handed out again once its delete has gone
        del t
        s.sync()
        y = f(x)  # the replay's output takes that name
        logits = dx.tensor(rng.standard_normal((3, 4)).astype(np.float32))
        bad = dx.tensor(np.array([0, 9, 1], np.int64))
        loss = F.cross_entropy(logits, bad)  # fails when it runs, before the write into y below
        y.add_(1.0)
        with pytest.raises(DeepxError, match="label 9"):
            loss.item()
        np.testing.assert_allclose(y.numpy(), (x.numpy() * 2 + 1) * 3, rtol=1e-6)  # y kept its value
        del y, logits, bad, loss
        gc.collect()
        s.sync()
        counts.append(count())  # x, f's graph inputs and the pooled small tensors: the same every time
    assert counts == [counts[0]] * 4, counts


def test_a_replays_new_output_name_is_deleted_after_a_later_program_fails():
    """The same with a replay output under a new name (no free name of its shape): the replay moves the session's
    mark past it, so a later failing program does not count it as never made (found in review)."""
    import gc

    s, rng, x, f = _a_replayed_function()
    keep = [f(x) for _ in range(3)]  # recorded, then replayed; kept, so no name of this shape is free
    for k in keep:
        k.numpy()
    logits = dx.tensor(rng.standard_normal((3, 4)).astype(np.float32))
    labels = dx.tensor(np.array([0, 9, 1], np.int64))
    s.sync()
    y = f(x)  # a replay: its output takes a new name
    loss = F.cross_entropy(logits, labels)  # fails when it runs (label 9), before the write into y
    y.add_(1.0)
    with pytest.raises(DeepxError, match="label 9"):
        loss.item()
    name = y.name
    assert name not in s.names.lost
    del y, loss
    gc.collect()
    s.sync()
    held = {r["name"] for r in s.transport._call(s.transport.node.ref("op-cpu").ask(WorkerTensors()))}
    assert name not in held or any(name in v for v in s.names.pool.values())  # deleted, or pooled for reuse
    del keep


def test_a_module_registry_replaced_or_swapped_is_seen_by_the_signature() -> None:
    """Module.structure() keeps its walk only while every registry it went through is the same _Registry: a
    registry replaced by a plain dict, a __dict__ swapped, a shallow copy, or a module's state carried elsewhere (its
    __getstate__, what copy and pickle use) make it walk again."""
    import copy

    a, b = nn.Linear(3, 2).double(), nn.Linear(3, 2).double()
    with dx.no_grad():
        b.weight.fill_(2.0)
        b.bias.fill_(0.0)
    holder = nn.Module()
    holder.net = a
    f = dx.compile(lambda x: holder.net(x).sum(), name="holder_step")
    x = dx.tensor(np.ones((1, 3)))
    f(x)
    f(x)
    holder._modules = {"net": b}  # a plain dict, as a subclass's `self._modules = {...}` makes it
    assert float(f(x).item()) == float(holder.net(x).sum().item()) == 12.0
    assert (f.captures, f.replays) == (2, 1)
    c = nn.Linear(3, 2).double()
    c.structure()
    c.__dict__.update({k: v for k, v in b.__dict__.items() if k != "_structure"})  # a hand-written load in place
    assert [id(p) for _, p in c.structure()[0]] == [id(b.weight), id(b.bias)]
    drop = nn.Dropout(1.0)  # train: zeros; eval: the input
    g = dx.compile(lambda x: drop(x) + 0.0, name="drop_step")
    ones = dx.tensor(np.ones(3))
    g(ones)
    twin = copy.copy(drop)
    h = dx.compile(lambda x: twin(x) + 0.0, name="twin_step")
    assert h(ones).numpy().tolist() == h(ones).numpy().tolist() == [0.0, 0.0, 0.0]
    twin.eval()
    assert h(ones).numpy().tolist() == [1.0, 1.0, 1.0] and (h.captures, h.replays) == (2, 1)
    seq = nn.Sequential(nn.Dropout(1.0))
    seq.structure()
    assert "_structure" in seq.__dict__ and "_structure" not in seq.__getstate__()  # the walk is this process's
    assert "_structure" not in copy.deepcopy(seq).__dict__
    assert "_structure" not in copy.copy(seq).__dict__


def test_a_replay_after_a_failed_early_program_leaks_no_tensor() -> None:
    """A compiled call whose sync raises an earlier program's error: the output names it would take stay with the
    session (pooled), so that empty_cache deletes their tensors."""
    import gc

    dx.disconnect()
    s = dx.connect(max_pending=64)
    f = dx.compile(lambda x: x * 2.0, name="leak_step")
    x = dx.tensor(np.ones(3))
    f(x)
    f(x)
    t = x + 1.0  # a temporary of the output's shape and dtype
    dx.sync()
    name = t.name
    bad = x[dx.tensor([7])]  # out of range, in a program sent early (as record() sends one at max_pending)
    s.flush_full()
    assert not s.pending and s.recorder.error is not None
    del t
    gc.collect()
    with pytest.raises(DeepxError, match="out of range"):
        f(x)
    del bad
    gc.collect()
    dx.empty_cache()
    dx.sync()
    held = {r["name"] for r in s.transport._call(s.transport.node.ref("op-cpu").ask(WorkerTensors()))}
    assert name not in held
    dx.disconnect()


def test_module_settings_outside_parameters_are_part_of_the_signature() -> None:
    """Two lambdas of one code over two Dropouts (no parameters: alike but for p) are two graphs, and a Dropout's
    p changed between calls captures anew: a module's settings, as its extra_repr shows them, are in the signature."""
    ones = dx.tensor(np.ones(3))

    def make(drop: nn.Dropout) -> Any:
        return dx.compile(lambda x: drop(x) + 0.0)  # the same code, closing over another module

    graphs = [(drop, make(drop)) for drop in (nn.Dropout(1.0), nn.Dropout(0.0))]
    for drop, f in graphs:
        for _ in range(2):
            assert f(ones).numpy().tolist() == ([0.0] * 3 if drop.p == 1.0 else [1.0] * 3)
    drop, f = graphs[0]
    drop.p = 0.0  # now the other one's signature: its stored graph, or a capture of its own
    assert f(ones).numpy().tolist() == [1.0] * 3 and len(f.graph_names) == 2


def _linear_step(now: bool) -> tuple[Any, Any, np.ndarray, np.ndarray]:
    """A fresh embedded session (now=False: its scheduler answers every replay by the ask, the reference), its
    scheduler, and a compiled SGD step of a Linear(6, 5) under cross-entropy, with a batch as arrays."""
    dx.disconnect()
    sched = dx.session().transport.node.ref("scheduler")._actor
    if not now:
        sched.now_replay = lambda *args: None  # this session's scheduler answers every replay by the ask
    dx.manual_seed(4)
    model = nn.Linear(6, 5)
    opt = dx.optim.SGD(model.parameters(), lr=0.1)
    rng = np.random.default_rng(5)

    @dx.compile
    def step(x, y):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss

    return sched, step, rng.standard_normal((8, 6)).astype(np.float32), rng.integers(0, 5, 8)


@pytest.mark.parametrize("now", [True, False])
def test_replays_run_now_in_the_embedded_daemon_and_a_failing_one_reads_as_by_the_ask(now: bool) -> None:
    """The embedded daemon replays a graph bound as the last replay was with no event loop step (now_replay); a
    replay that fails in a kernel (a label out of range, put under the label's own name, so the bindings still fit)
    is finished as on_replay finishes it: the same error, its temporaries deleted. now=False: the ask's way, the
    reference."""
    sched, step, xa, ya = _linear_step(now)
    x, y = dx.tensor(xa), dx.tensor(ya)
    losses = []
    for k in range(8):
        loss = step(x, y)
        if k >= 2:  # a replay: the small output came back with it
            assert getattr(loss, "_v", None) is not None
        losses.append(loss.item())
    # the first replays go by the ask (each binding's first checks its inputs, and the worker learns its program;
    # the loss kept alive while the next call runs takes the other of two names: two bindings in turn)
    assert step.replays == 6 and losses[-1] < losses[0]
    hits = sched.now_hits
    assert hits >= 3 if now else hits == 0
    t = dx.session().transport
    good = np.array(y.numpy())
    bad = good.copy()
    bad[3] = 7
    t.put(y.name, bad, False)
    with pytest.raises(DeepxError) as e:
        step(x, y).item()
    assert f"replay of graph '{step.graph_names[-1]}'" in str(e.value) and "label 7" in str(e.value)
    assert sched.now_hits == (hits + 1 if now else 0)  # the failing one went that way too
    left = {r["name"] for r in t._call(t.node.worker().ask(WorkerTensors()))}
    assert not any(n.startswith(f"{step.graph_names[-1]}.") for n in left)
    assert not sched._busy and sched.stats.by_message.get("replay", 0) == sched.replays
    assert (sched.replays, sched.failed) == (7, 1)
    # fixed: the ask's way once (the worker learns the program again), then back to the now way
    t.put(y.name, good, False)
    for _ in range(4):
        step(x, y).item()
    assert sched.now_hits > hits + 1 if now else sched.now_hits == 0
    hits = sched.now_hits
    dx.disconnect()


def _array_replays(now: bool) -> tuple[int, int, int]:
    """A compiled step given numpy arrays (put with each replay): how many times bind_replay ran, the replays, and
    how many went now_replay's way, in a fresh embedded session (now=False: every replay by the ask)."""
    from deepxd.compiler import graphs

    sched, step, x, y = _linear_step(now)
    binds = []
    bind = graphs.bind_replay

    def counted(*args: Any) -> Any:
        binds.append(1)
        return bind(*args)

    graphs.bind_replay = counted  # type: ignore[assignment]
    try:
        for _ in range(6):
            step(x, y).item()
    finally:
        graphs.bind_replay = bind  # type: ignore[assignment]
    out = len(binds), step.replays, sched.now_hits
    dx.disconnect()
    return out


def test_replays_with_arrays_bind_once_each_by_the_ask() -> None:
    """Arrays are put with each replay, so its binding is never the last one again: now_replay leaves them to
    on_replay without binding them first (a review found each bound twice)."""
    binds, replays, hits = _array_replays(True)
    assert hits == 0 and replays >= 4
    assert (binds, replays) == _array_replays(False)[:2]


@pytest.mark.parametrize("returns, problem", [(7, "name output 7, of 1"), ({"dict": 5}, "not a returns spec"),
                                              ({"tuple": [0, -1]}, "name output -1"), ("x", "not a returns spec"),
                                              ({"list": [0, {"dict": [["a", 3]]}]}, "name output 3")])
def test_a_stored_graph_whose_returns_do_not_fit_its_outputs_is_refused(returns, problem) -> None:
    """A graph record corrupted in the plane (its returns naming an output it does not have) is refused with the
    graph's name when read, not a TypeError or IndexError at the replay."""
    import msgpack

    from deepx_core.graphrecord import GRAPH_VERSION, GraphRecord

    good = {"v": GRAPH_VERSION, "instrs": [], "inputs": [], "outputs": [["o", "float32", [2]]], "returns": 0}
    assert GraphRecord.unpack(msgpack.packb(good), "g").returns == 0
    with pytest.raises(DeepxError, match=f"graph 'g': its returns .*{problem}"):
        GraphRecord.unpack(msgpack.packb({**good, "returns": returns}), "g")


def test_a_backward_whose_gradients_nothing_uses_is_refused() -> None:
    """A compiled function that makes .grad and neither uses nor returns it (a micro-batch's backward, the step in
    another function): a replay would drop those gradients with no error (found in review: every other micro-batch
    lost). Refused, saying what to do; adding into a .grad that exists is state, replayed in place."""
    dx.manual_seed(0)
    model = nn.Linear(3, 1).double()
    x = dx.tensor(np.ones((2, 3)))

    @dx.compile
    def micro(x):
        model(x).sum().backward()

    with pytest.raises(dx.DeepxError, match=r"computes gradients it does not use \(weight, bias\)"):
        micro(x)  # .grad made here: refused (this call ran, as an eager one)
    np.testing.assert_allclose(model.weight.grad.numpy(), [[2.0, 2.0, 2.0]])
    for _ in range(3):
        micro(x)  # .grad exists: added into in place, a replay does it too
    assert micro.replays == 2
    np.testing.assert_allclose(model.weight.grad.numpy(), [[8.0, 8.0, 8.0]])


# ------------------------------------------------------------------ which optimizer a replay updates with (an audit)


def _torch_steps(w0: np.ndarray, make_opt: Any, steps: int) -> np.ndarray:
    import torch

    x, y = torch.ones((3, 4), dtype=torch.float64), torch.zeros((3, 2), dtype=torch.float64)
    w = torch.tensor(w0, requires_grad=True)
    opt = make_opt(torch.optim, [w])
    for _ in range(steps):
        opt.zero_grad()
        ((x @ w - y) ** 2).mean().backward()
        opt.step()
    return w.detach().numpy()


OPTIMIZERS = [
    lambda optim, ps: optim.SGD(ps, lr=0.1),
    lambda optim, ps: optim.SGD(ps, lr=0.1, momentum=0.9),
    lambda optim, ps: optim.Adam(ps, lr=0.1),
    lambda optim, ps: optim.SGD(ps, lr=0.1, momentum=0.9),
]


def _one_run(w0: np.ndarray, make: Any, kept: list[dx.Tensor], k: int) -> np.ndarray:
    from deepx_sdk import optim

    x, y = np.ones((3, 4)), np.zeros((3, 2))
    w = dx.tensor(w0, requires_grad=True)
    opt = make(optim, [w])

    def step(a: dx.Tensor, b: dx.Tensor) -> dx.Tensor:
        opt.zero_grad()
        loss = ((a @ w - b) ** 2).mean()
        loss.backward()
        opt.step()
        return loss

    f = dx.compile(step)
    for i in range(4):
        f(x, y)
        kept.append(dx.tensor(np.full(3, float(10 * k + i))))  # live tensors that may take deleted names
    return w.numpy()


def test_new_objects_in_each_run_replay_their_own_optimizer() -> None:
    """Each run makes its tensor, optimizer and compiled step afresh: a later run's names (taken from deleted ones)
    and signature matched an earlier run's stored graph, which then updated with the earlier optimizer's program
    (plain SGD's for momentum's; a KeyError for Adam). Found in an audit against torch."""
    import gc

    kept: list[dx.Tensor] = []
    for k, make in enumerate(OPTIMIZERS):
        w0 = np.full((4, 2), 0.5 + k / 10)
        np.testing.assert_allclose(_one_run(w0, make, kept, k), _torch_steps(w0, make, 4), rtol=1e-12)
        gc.collect()
    for t in kept:  # nothing of theirs was written by a replay
        assert len(set(t.numpy().tolist())) == 1


def test_a_new_optimizer_or_a_frozen_parameter_captures_again() -> None:
    """A replay read its numbers from the optimizer it was captured with: a new SGD(lr=0) still moved the weight,
    and a parameter frozen with requires_grad_(False) (in the optimizer only) kept being updated."""
    from deepx_sdk.optim import SGD, Adam

    w = dx.tensor(np.full((4, 2), 0.5), requires_grad=True)
    b = dx.tensor(np.zeros(2), requires_grad=True)
    x, y = np.ones((3, 4)), np.zeros((3, 2))
    opt: Any = SGD([w, b], lr=0.1)

    @dx.compile
    def step(a: dx.Tensor, c: dx.Tensor) -> dx.Tensor:
        opt.zero_grad()
        loss = ((a @ w + b - c) ** 2).mean()
        loss.backward()
        opt.step()
        return loss

    for _ in range(3):
        step(x, y)
    opt = SGD([w, b], lr=0.0)
    before = w.numpy()
    for _ in range(3):
        step(x, y)
    np.testing.assert_array_equal(w.numpy(), before)
    opt = Adam([w, b], lr=0.1)
    b.requires_grad_(False)
    b_before = b.numpy()
    for _ in range(3):
        step(x, y)
    np.testing.assert_array_equal(b.numpy(), b_before)
    assert not np.array_equal(w.numpy(), before)


def _compiled_round(x: np.ndarray, y: np.ndarray) -> None:
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))
    opt = dx.optim.SGD(model.parameters(), lr=0.1)

    def step(a: dx.Tensor, b: dx.Tensor) -> dx.Tensor:
        opt.zero_grad()
        loss = F.cross_entropy(model(a), b)
        loss.backward()
        opt.step()
        return loss

    f = dx.compile(step)
    for _ in range(3):
        f(x, y)


def test_a_collected_compiled_function_lets_go_of_its_graphs() -> None:
    """A sweep that makes a model, an optimizer and a compiled step afresh left each one's plan in the scheduler and
    its kept temporaries on the worker (found in an audit: 6 more tensors and 2 more plans per round)."""
    import gc

    s = dx.session()

    def counts() -> tuple[int, int]:
        dx.sync()
        node = s.transport.node
        return len(s.transport._call(node.worker().ask(WorkerTensors()))), len(node.ref("scheduler")._actor.graphs)

    x, y = np.ones((16, 32), np.float32), np.zeros(16, np.int64)
    seen = []
    for _ in range(3):
        _compiled_round(x, y)
        gc.collect()
        dx.empty_cache()
        seen.append(counts())
    assert seen[0] == seen[1] == seen[2], seen  # nothing left per round (before: +6 tensors, +2 plans)


@pytest.mark.parametrize("release", [True, False])
def test_closing_a_session_on_a_running_deepxd_releases_what_it_made(tmp_path, release) -> None:
    """A script against a running deepxd left every tensor it made (a training run: 48) and its compiled graphs'
    kept temporaries there when it exited (found in a docs audit). Closing the session (also at exit) deletes them
    and drops its graphs' plans, unless dx.connect(..., release=False); another client's tensors stay."""
    from deepx_sdk.client import NativeClient

    d = Daemon(tmp_path).start()
    try:
        with NativeClient(d.address) as other:
            other.put("theirs", np.ones(3, np.float32), heap=True)
            dx.connect(d.address, release=release)
            _, _, step = mlp_run(True, "sgd", steps=4)
            kept = dx.tensor(np.arange(3.0))
            assert kept.numpy().sum() == 3.0 and step.replays >= 1
            names = {t["name"] for t in other.admin("tensors")}
            assert len(names) > 5 and any(".t" in n for n in names)
            dx.disconnect()
            left = {t["name"] for t in other.admin("tensors")}
            if release:
                assert left == {"theirs"}, left
            else:
                assert left == names
            assert {g["name"] for g in other.admin("graphs")} >= set(step.graph_names)  # records stay
    finally:
        dx.disconnect()
        assert d.stop() == 0, d.output()


@pytest.mark.parametrize("setting, values", [("momentum", [0.5, 0.6, 0.7, 0.8, 0.9]),
                                             ("weight_decay", [0.0, 0.01, 0.02, 0.03, 0.04]),
                                             ("lr", [0.1, 0.05, 0.02, 0.01, 0.005])])
def test_a_schedule_of_an_optimizer_setting_replays_without_capturing_again(setting, values) -> None:
    """Settings a replay reads from the group at every call (lr, momentum, weight decay, betas...) are not in the
    signature: a momentum warm-up captured a new graph every call (review). The replayed steps are the eager ones."""
    from deepx_sdk.optim import SGD

    rng = np.random.default_rng(0)
    w0, x, y = rng.standard_normal((4, 2)), rng.standard_normal((3, 4)), rng.standard_normal((3, 2))
    results = []
    for compiled in (False, True):
        w = dx.tensor(w0, requires_grad=True)
        opt = SGD([w], lr=0.1, momentum=0.5)

        def step(a: dx.Tensor, b: dx.Tensor, w: Any = w, opt: Any = opt) -> dx.Tensor:
            opt.zero_grad()
            loss = ((a @ w - b) ** 2).mean()
            loss.backward()
            opt.step()
            return loss

        f = _compiled_with(step, w, opt) if compiled else step
        for v in values:
            opt.param_groups[0][setting] = v
            f(dx.tensor(x), dx.tensor(y))
        results.append(w.numpy())
        if compiled:
            assert f.captures <= 2, f.captures  # the first call, and the one after the buffers exist
    np.testing.assert_allclose(results[1], results[0], rtol=1e-12)


def _compiled_with(step: Any, w: dx.Tensor, opt: Any) -> Any:
    """dx.compile of a step that finds its tensor and optimizer in its closure."""
    def closed(a: dx.Tensor, b: dx.Tensor) -> dx.Tensor:
        return step(a, b, w, opt)

    return dx.compile(closed)


def test_a_replay_marks_the_parameters_it_updated() -> None:
    """A graph recorded before a compiled step that updated its parameters refuses their old values at backward,
    as after an eager step (Tape.wrote from the replay)."""
    m = nn.Linear(3, 2)
    opt = dx.optim.SGD(m.parameters(), lr=0.1)
    x = dx.tensor(np.ones((4, 3), np.float32))

    @dx.compile
    def step(a: dx.Tensor) -> dx.Tensor:
        opt.zero_grad()
        loss = m(a).square().sum()
        loss.backward()
        opt.step()
        return loss

    for _ in range(3):
        step(x)
    y = m(x).square().sum() + (m.weight * m.weight).sum()  # w * w's gradient needs w's value
    step(x)
    assert step.replays >= 1
    with pytest.raises(DeepxError, match="written in place after the op read it"):
        y.backward()


def test_a_forked_child_s_exit_leaves_the_parent_s_tensors(tmp_path) -> None:
    """A forked child (a DataLoader worker, a Pool) inherits the session; its exit closed it and deleted every
    tensor the parent had made on the daemon (found in review)."""
    import multiprocessing as mp

    d = Daemon(tmp_path).start()
    try:
        dx.connect(d.address)
        m = nn.Linear(4, 2)
        before = m.weight.numpy()
        p = mp.get_context("fork").Process(target=_child_touches_nothing)
        p.start()
        p.join(60)
        assert p.exitcode == 0
        np.testing.assert_array_equal(m.weight.numpy(), before)
    finally:
        dx.disconnect()
        assert d.stop() == 0, d.output()


def _child_touches_nothing() -> None:
    pass
