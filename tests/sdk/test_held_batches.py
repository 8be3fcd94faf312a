"""A training loop over batches held as tensors of their own (a list put up front, a prefetching loader's) sends a
program that differs from the last step's only in its inputs' names: the daemon runs it by the plan it made for
the first, under the new names (Plan.renamed), with the numbers of a loop that puts a fresh tensor every step."""

from __future__ import annotations

import gc

import numpy as np

import deepx_sdk as dx
import deepx_sdk.nn as nn
import deepx_sdk.nn.functional as F
from deepx_core.client import NativeClient
from deepx_sdk.optim import Adam
from deepx_sdk.session import session
from deepx_sdk.utils.data import DataLoader, Dataset


def _train(data: list[tuple[np.ndarray, np.ndarray]], held: bool, steps: int, warm: int,
           programs: list[int] | None = None) -> tuple[list[float], list[np.ndarray], dict[str, float]]:
    """Losses, weights, and the scheduler's counts from step `warm` on; `programs` takes each step's programs."""
    dx.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 3)).double()
    opt = Adam(model.parameters(), lr=1e-2)
    batches = [(dx.tensor(x), dx.tensor(y)) for x, y in data] if held else None
    scheduler = dx.session().transport.node.ref("scheduler")._actor
    losses = []
    for k in range(steps):
        if k == warm:
            before = dict(scheduler.on_stats())
        x, y = batches[k % len(data)] if batches is not None else (dx.tensor(data[k % len(data)][0]),
                                                                   dx.tensor(data[k % len(data)][1]))
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if programs is not None:
            programs.append(scheduler.on_stats()["programs"])
    after = scheduler.on_stats()
    counts = {k: after[k] - before[k] for k in ("programs", "plan_hits", "plan_misses", "backward_misses", "renamed")}
    return losses, [p.detach().numpy() for p in model.parameters()], counts


def test_held_batches_train_as_fresh_ones_by_one_plan(rng):
    dx.connect()
    data = [(rng.standard_normal((10, 6)), rng.integers(0, 3, 10)) for _ in range(5)]
    fresh_losses, fresh_weights, _ = _train(data, held=False, steps=24, warm=8)
    held_losses, held_weights, counts = _train(data, held=True, steps=24, warm=8)
    assert held_losses == fresh_losses
    for a, b in zip(held_weights, fresh_weights):
        np.testing.assert_array_equal(a, b)
    assert counts["plan_misses"] == 0 and counts["backward_misses"] == 0, counts
    assert counts["renamed"] >= 16 and counts["plan_hits"] >= 16, counts


def test_a_held_batch_step_is_one_program(rng):
    """The SDK knows a forward differentiated before under its batch's new names (NamePool.differentiated): the
    step's backward goes in its program, one program a step as with a fresh tensor; a batch of another shape is
    another graph, whose backward is sent on its own first."""
    dx.connect()
    data = [(rng.standard_normal((10, 6)), rng.integers(0, 3, 10)) for _ in range(5)]
    _, _, fresh = _train(data, held=False, steps=24, warm=8)
    _, _, held = _train(data, held=True, steps=24, warm=8)
    assert fresh["programs"] == held["programs"] == 16, (fresh, held)
    assert held["renamed"] == 16, held
    short = [*data, (rng.standard_normal((4, 6)), rng.integers(0, 3, 4))]  # a last batch of 4 rows
    programs: list[int] = []
    losses, weights, counts = _train(short, held=True, steps=24, warm=12, programs=programs)
    fresh_losses, fresh_weights, _ = _train(short, held=False, steps=24, warm=12)
    assert losses == fresh_losses
    for a, b in zip(weights, fresh_weights):
        np.testing.assert_array_equal(a, b)
    per_step = np.diff(programs)
    assert per_step[4] == 3 and per_step[5:11].tolist() == [1] * 6, programs  # (step 5: the short batch's first)
    assert counts["programs"] == 12 and counts["plan_misses"] == 0, counts


class _Samples(Dataset):
    def __init__(self) -> None:
        rng = np.random.default_rng(5)
        self.x, self.y = rng.standard_normal((60, 6)), rng.integers(0, 3, 60)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        return self.x[i], int(self.y[i])


def test_a_prefetching_loader_trains_by_one_plan():
    """A loader's workers put each batch as a heap tensor of its own ahead of the step, and the step deletes the one
    before: its program is the last but one's under new names, and trains as the loop without workers."""
    dx.connect()
    scheduler = dx.session().transport.node.ref("scheduler")._actor

    def train(workers: int) -> tuple[list[float], dict[str, float]]:
        dx.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3)).double()
        opt = Adam(model.parameters(), lr=1e-2)
        losses = []
        for epoch in range(3):
            if epoch == 1:
                before = dict(scheduler.on_stats())
            for x, y in DataLoader(_Samples(), batch_size=10, num_workers=workers):
                opt.zero_grad()
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                opt.step()
                losses.append(loss.item())
        after = scheduler.on_stats()
        return losses, {k: after[k] - before[k] for k in ("programs", "plan_misses", "backward_misses", "renamed")}

    prefetched, counts = train(1)
    assert prefetched == train(0)[0]
    assert counts["plan_misses"] == 0 and counts["backward_misses"] == 0 and counts["renamed"] >= 12, counts
    assert counts["programs"] == 12, counts  # one a step: its backward in it (NamePool.differentiated)
    gc.collect()
    dx.ones(1).numpy()  # a program, which carries the deletes of collected handles
    with NativeClient(session().transport.address) as c:  # each batch's heap tensors went, under its own name
        assert not [t["name"] for t in c.admin("tensors") if t["name"].startswith("dl") and t["kind"] == "heap"]


def test_an_input_of_another_shape_is_another_graph():
    """A batch whose shape the forward's instructions do not show (broadcast to the same result): its forward is not
    taken as a known one under new names, and its backward is sent on its own first, as a new graph's."""
    dx.connect()
    scheduler = dx.session().transport.node.ref("scheduler")._actor
    w = nn.Parameter(dx.tensor(np.arange(3.0)))
    values = [np.ones(3), np.full(3, 2.0), np.full(3, 3.0), np.array(4.0), np.full(3, 5.0)]
    held = [dx.tensor(v) for v in values]
    programs = []
    for x, v in zip(held, values):
        before = scheduler.on_stats()["programs"]
        w.grad = None
        loss = (w * x).sum()
        loss.backward()
        assert loss.item() == float((np.arange(3.0) * v).sum())
        np.testing.assert_array_equal(w.grad.numpy(), np.broadcast_to(v, 3))
        programs.append(scheduler.on_stats()["programs"] - before)
    # steps 1 and 2 differentiate new graphs (the loss takes two names in turn); 3 and 5 are 1's under new names;
    # 4's input is a scalar where 2's was a vector
    assert programs[2] == programs[4] < programs[3] == programs[1], programs
