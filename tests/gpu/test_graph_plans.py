"""op-cuda replays plans that repeat as CUDA graphs (config `cuda_graphs`, deepxd/actors/opcuda.py GraphSlot): a
training loop through the SDK gives the same losses and weights with graphs as without, while the op stats show the
steps were replayed (`cudagraph`); Adam's step count and a new batch each step keep the graph; a bad label in a
replayed step fails with the message an instruction-by-instruction run gives, and the daemon keeps serving."""

from __future__ import annotations

import numpy as np
import pytest

from tests.gpu.conftest import gpu_reason

pytestmark = pytest.mark.skipif(gpu_reason() is not None, reason=gpu_reason() or "")

import deepx_sdk as dx  # noqa: E402
import deepx_sdk.nn as nn  # noqa: E402
import deepx_sdk.nn.functional as F  # noqa: E402
from deepx_sdk.optim import SGD, AdamW  # noqa: E402
from deepxd.actors import opcuda  # noqa: E402

STEPS = 16
#: a loop's step alternates between two programs (the names of one step's tensors are in use while the next is
#: recorded), and a plan is captured at its third run: the first replay comes at about the seventh step
REPLAYS = STEPS - 8


def _data(step: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(100 + step)
    return rng.standard_normal((64, 32)).astype(np.float32), rng.integers(0, 10, 64)


def _train(monkeypatch: pytest.MonkeyPatch, graphs: bool, optimizer: str, fresh: bool, compiled: bool = False,
           cycle: int = 0, held: bool = False) -> tuple[list[float], dict[str, np.ndarray], int]:
    """The losses, the final weights and how many programs op-cuda replayed as graphs. `cycle`: that many batches
    in turn; `held`: each put once, up front (else put anew each step)."""
    monkeypatch.setenv("DEEPX_CUDA_GRAPHS", "1" if graphs else "0")
    monkeypatch.delenv("DEEPX_ADDRESS", raising=False)
    s = dx.connect(roles=["heapmem", "op-cuda"])
    try:
        dx.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 64), nn.LayerNorm(64), nn.GELU(), nn.Linear(64, 64), nn.ReLU(),
                              nn.Linear(64, 10))
        params = list(model.parameters())
        opt = SGD(params, lr=0.05, momentum=0.9) if optimizer == "sgd" else AdamW(params, lr=3e-3)
        batches = [_data((i % cycle if cycle else i) if fresh else 0) for i in range(STEPS)]

        def step(x: dx.Tensor, y: dx.Tensor) -> dx.Tensor:
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            return loss

        run = dx.compile(step) if compiled else step
        if held:
            kept = [(dx.tensor(x), dx.tensor(y)) for x, y in batches[:cycle]]
            losses = [float(run(*kept[i % cycle]).item()) for i in range(STEPS)]
        else:
            losses = [float(run(dx.tensor(x), dx.tensor(y)).item()) for x, y in batches]
        weights = {k: v.numpy() for k, v in model.state_dict().items()}
        worker = s.transport.node.ref("op-cuda")._actor
        stat = worker.op_stats.get("cudagraph")
        assert len(worker._live) <= opcuda.GRAPHS_MAX
        return losses, weights, stat.calls if stat is not None else 0
    finally:
        dx.disconnect()


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("fresh", [False, True], ids=["same-batch", "new-batch-each-step"])
def test_a_training_loop_replayed_as_graphs_equals_the_loop_run_op_by_op(monkeypatch, optimizer, fresh):
    eager_losses, eager_weights, eager_graphs = _train(monkeypatch, False, optimizer, fresh)
    losses, weights, replays = _train(monkeypatch, True, optimizer, fresh)
    assert eager_graphs == 0
    assert replays >= REPLAYS, f"only {replays} of {STEPS} steps replayed as CUDA graphs"
    np.testing.assert_allclose(losses, eager_losses, rtol=1e-5)
    for k in eager_weights:
        np.testing.assert_allclose(weights[k], eager_weights[k], rtol=1e-5, atol=1e-6, err_msg=k)
    if not fresh:  # (a new batch of random labels each step need not lower the loss)
        assert losses[-1] < losses[0]


def test_held_batches_replay_as_graphs_under_their_names(monkeypatch):
    """Batches held as tensors of their own, in turn (a list put up front): each step is the plan of the first under
    new names for its inputs (Plan.renamed), and its graph reads them under those names (copied in: staged), so the
    loop replays as graphs and trains as the loop that puts each batch anew, op by op."""
    eager_losses, eager_weights, _ = _train(monkeypatch, False, "adamw", True, cycle=4)
    losses, weights, replays = _train(monkeypatch, True, "adamw", True, cycle=4, held=True)
    assert replays >= REPLAYS, f"only {replays} of {STEPS} steps replayed as CUDA graphs"
    np.testing.assert_allclose(losses, eager_losses, rtol=1e-5)
    for k in eager_weights:
        np.testing.assert_allclose(weights[k], eager_weights[k], rtol=1e-5, atol=1e-6, err_msg=k)


def test_at_most_graphs_max_graphs_live_and_the_loop_still_trains_as_op_by_op(monkeypatch):
    """One graph alive at a time: a loop alternating between two programs gives one back at each capture of the
    other (they capture again and again) and still trains as the op-by-op loop does."""
    monkeypatch.setattr(opcuda, "GRAPHS_MAX", 1)
    eager_losses, eager_weights, _ = _train(monkeypatch, False, "adamw", True)
    losses, weights, _ = _train(monkeypatch, True, "adamw", True)
    np.testing.assert_allclose(losses, eager_losses, rtol=1e-5)
    for k in eager_weights:
        np.testing.assert_allclose(weights[k], eager_weights[k], rtol=1e-5, atol=1e-6, err_msg=k)


def test_a_compiled_step_replays_as_graphs(monkeypatch):
    eager_losses, eager_weights, _ = _train(monkeypatch, False, "adamw", True, compiled=True)
    losses, weights, replays = _train(monkeypatch, True, "adamw", True, compiled=True)
    assert replays >= REPLAYS
    np.testing.assert_allclose(losses, eager_losses, rtol=1e-5)
    for k in eager_weights:
        np.testing.assert_allclose(weights[k], eager_weights[k], rtol=1e-5, atol=1e-6, err_msg=k)


def test_a_bad_label_in_a_replayed_step_fails_as_op_by_op_and_the_daemon_goes_on(monkeypatch):
    monkeypatch.setenv("DEEPX_CUDA_GRAPHS", "1")
    monkeypatch.delenv("DEEPX_ADDRESS", raising=False)
    s = dx.connect(roles=["heapmem", "op-cuda"])
    try:
        dx.manual_seed(0)
        model = nn.Linear(32, 10)
        opt = SGD(model.parameters(), lr=0.1)
        x, y = _data(0)
        for _ in range(12):
            opt.zero_grad()
            loss = F.cross_entropy(model(dx.tensor(x)), dx.tensor(y))
            loss.backward()
            opt.step()
            loss.item()
        worker = s.transport.node.ref("op-cuda")._actor
        replays = worker.op_stats["cudagraph"].calls
        assert replays >= 3
        before = model.weight.numpy()
        bad = y.copy()
        bad[5] = 99
        with pytest.raises(dx.DeepxError, match="crossentropy"):
            opt.zero_grad()
            loss = F.cross_entropy(model(dx.tensor(x)), dx.tensor(bad))
            loss.backward()
            opt.step()
            loss.item()
        np.testing.assert_array_equal(model.weight.numpy(), before)  # the update after the failure never ran
        opt.zero_grad()
        loss = F.cross_entropy(model(dx.tensor(x)), dx.tensor(y))
        loss.backward()
        opt.step()
        assert np.isfinite(loss.item())
        assert worker.op_stats["cudagraph"].calls > replays  # the failed replay did not take the graph away
    finally:
        dx.disconnect()


def test_dropout_without_a_seed_draws_a_new_mask_each_step_with_graphs_on(monkeypatch):
    """Seed 0 (no dx.manual_seed) draws a fresh seed at each launch: a graph would replay the capture's, the same
    mask every step. With lr 0 and one batch, only the masks change the loss from step to step."""
    monkeypatch.setenv("DEEPX_CUDA_GRAPHS", "1")
    monkeypatch.delenv("DEEPX_ADDRESS", raising=False)
    dx.connect(roles=["heapmem", "op-cuda"])
    try:
        model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Dropout(0.5), nn.Linear(64, 10))
        opt = SGD(model.parameters(), lr=0.0)
        x, y = _data(0)
        losses = []
        for _ in range(STEPS):
            opt.zero_grad()
            loss = F.cross_entropy(model(dx.tensor(x)), dx.tensor(y))
            loss.backward()
            opt.step()
            losses.append(float(loss.item()))
        assert len(set(losses)) == STEPS, f"steps repeated a dropout mask: {losses}"
    finally:
        dx.disconnect()
