"""A training loop's repeated `loss.backward()` is recorded into the step's program as a `backward` instruction, which
the daemon expands in place: one program per step, embedded and over the native socket, with the numbers torch
gives. The first backward of a graph (under its gradient names) is sent on its own, so that a graph without a
gradient raises at that line; a recorded one that fails raises at the next read, naming the line of its backward().
Whether a step that does not repeat runs whole or in parts is the daemon's to judge (Scheduler._apart)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

import deepx_sdk as dx
import deepx_sdk.nn as nn
import deepx_sdk.nn.functional as F
from deepx_core.errors import DeepxError
from deepx_sdk.names import NamePool
from deepx_sdk.optim import SGD
from tests.daemon.conftest import Daemon
from tests.sdk.conftest import cross_entropy_step


@contextlib.contextmanager
def _backwards_sent() -> Iterator[list[int]]:
    """Per program the session sends, how many backward instructions it carries."""
    transport = dx.session().transport
    run = transport.run
    sent: list[int] = []
    transport.run = lambda program, fetch, backwards=(): sent.append(len(backwards)) or run(program, fetch, backwards)
    try:
        yield sent
    finally:
        transport.run = run


def _paired_step(mine: tuple[Any, ...], theirs: tuple[Any, ...]) -> None:
    """One step of (x @ w).tanh().sum() with an optimizer and its scheduler, in deepx and in torch; the losses equal."""
    losses = []
    for x, w, opt, sched in (mine, theirs):
        opt.zero_grad()
        loss = (x @ w).tanh().sum()
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(losses[1], rel=1e-10)


def _train(rng: np.random.Generator, steps: int, sent: list[tuple[int, int]]) -> tuple[list[float], list[np.ndarray]]:
    """`steps` SGD steps of a small MLP in float64 against torch's; `sent`: per program, (instructions, backwards)."""
    transport = dx.session().transport
    run = transport.run

    def spy(program, fetch, backwards=()):  # type: ignore[no-untyped-def]
        sent.append((len(program), len(backwards)))
        return run(program, fetch, backwards)

    transport.run = spy
    x, y = rng.standard_normal((16, 6)), rng.integers(0, 3, 16)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3)).double()
    tmodel = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3)).double()
    with torch.no_grad():
        for p, tp in zip(model.parameters(), tmodel.parameters()):
            tp.copy_(torch.tensor(p.detach().numpy()))
    opt, topt = SGD(model.parameters(), lr=0.1, momentum=0.9), torch.optim.SGD(tmodel.parameters(), lr=0.1,
                                                                              momentum=0.9)
    dxx, dxy, tx, ty = dx.tensor(x), dx.tensor(y), torch.from_numpy(x), torch.from_numpy(y)
    losses = []
    try:
        for _ in range(steps):
            loss, tloss = cross_entropy_step(model, opt, dxx, dxy, tmodel, topt, tx, ty)
            losses.append(loss)
            assert loss == pytest.approx(tloss, rel=1e-12)
    finally:
        transport.run = run
    for p, tp in zip(model.parameters(), tmodel.parameters()):
        np.testing.assert_allclose(p.detach().numpy(), tp.detach().numpy(), rtol=1e-10, atol=1e-12)
    return losses, [p.detach().numpy() for p in model.parameters()]


def test_a_training_step_goes_as_one_program_with_its_backward_inside(rng):
    dx.connect()  # a fresh session: its name pool empty, as a script's is
    sent: list[tuple[int, int]] = []
    losses, _ = _train(rng, 8, sent)
    assert losses[-1] < losses[0]
    # the first steps send the forward, then the backward on its own (derived and checked the first time); once the
    # daemon has derived a step's backward, each step is a single program, the backward instruction in it
    assert sent[-3:] == [sent[-1]] * 3 and sent[-1][1] == 1
    assert len(sent) < 8 * 2


def test_over_the_native_socket_a_step_is_one_program_too(rng, tmp_path):
    d = Daemon(tmp_path, udp=False).start()
    try:
        s = dx.connect(d.address)
        assert type(s.transport).__name__ == "NativeTransport"
        sent: list[tuple[int, int]] = []
        _train(rng, 6, sent)  # the numbers torch gives, step by step
        assert sent[-2:] == [sent[-1]] * 2 and sent[-1][1] == 1
    finally:
        dx.disconnect()
        d.stop()


def test_a_recorded_backward_that_fails_raises_at_the_next_read_naming_its_line(rng, monkeypatch):
    w = nn.Parameter(rng.standard_normal(3))
    h = w.exp()  # exp's gradient reads its result, which the next line overwrites: no backward exists
    loss = h.sum()
    h.add_(1.0)
    # as if this graph's backward had been derived before: recorded, and derived by the daemon only when it runs
    monkeypatch.setattr(NamePool, "differentiated", lambda self, k, spec, metas: True)
    loss.backward(); line = _line()  # noqa: E702
    grad = w.grad
    with pytest.raises(DeepxError, match=rf"backward: .*overwrites.*test_backward_program.py:{line}"):
        grad.numpy()
    assert grad.name in dx.session().names.lost  # its tensor never came to exist: Python does not delete it
    k = int(grad.name[len(dx.session().names.grad_root):].partition("_")[0])
    assert dx.session().names._grad_live[k] == -1  # what ran of it may be left: its prefix is not handed out again
    del grad
    w.grad = None
    np.testing.assert_allclose((w * 2).numpy(), w.detach().numpy() * 2)  # the session goes on


def _line() -> int:
    import inspect

    frame = inspect.currentframe()
    assert frame is not None and frame.f_back is not None
    return frame.f_back.f_lineno


def test_a_weights_transpose_is_gone_before_the_optimizer_writes_the_weight(rng):
    """x @ W.T reads a view of W; the SDK deletes the transpose before opt.step(), so the update copies nothing."""
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = SGD(model.parameters(), lr=0.1)
    x, y = dx.tensor(rng.standard_normal((8, 64)).astype(np.float32)), dx.tensor(rng.integers(0, 4, 8))
    worker = dx.session().transport.node.worker()._actor
    for _ in range(4):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        dx.sync()
        ex = worker.ex
        heap = set(worker.heap)
        assert not ex.strided and not any(base in heap for base in ex.views)


def test_a_recorded_backward_keeps_its_place_when_deletions_fill_the_program(rng):
    """The collected handles' deletions go in before the backward instruction, and a program filled to max_pending
    is sent with the instruction and its expansion together, never one without the other."""
    s = dx.connect(max_pending=200)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    opt = SGD(model.parameters(), lr=0.1)
    x, y = dx.tensor(rng.standard_normal((16, 6)).astype(np.float32)), dx.tensor(rng.integers(0, 3, 16))
    z = dx.tensor(np.ones(5, np.float32))
    losses = []
    for _ in range(4):
        opt.zero_grad()
        dx.sync()
        junk = [z * 2 for _ in range(40)]  # 40 handles collected just before backward()
        loss = F.cross_entropy(model(x), y)
        pad = []
        while len(s.pending) < s.max_pending - 3:
            pad.append(z + 1.0)
        del junk
        loss.backward()
        opt.step()
        losses.append(loss.item())
        del pad
    assert losses[-1] < losses[0]
    assert (z * 3).numpy().tolist() == [3.0] * 5  # the session goes on


def test_deleted_transposes_are_not_deleted_again(rng):
    """A transpose's name is deleted when collected and pooled: dx.empty_cache() and a failed program that handed
    the name out again must not delete it a second time."""
    s = dx.session()
    a = dx.tensor(np.arange(6, dtype=np.float32).reshape(2, 3))
    t = a.permute(1, 0)
    dx.sync()
    del t
    dx.sync()
    dx.empty_cache()
    dx.sync()  # no "deltensor: tensor not found"
    t = a.permute(1, 0)
    dx.sync()
    del t
    bad = F.cross_entropy(dx.zeros(4, 3), dx.tensor(np.array([0, 1, 2, 7])))  # label 7: fails when it runs
    u = a.permute(1, 0)  # takes the deleted transpose's name, and never runs
    with pytest.raises(DeepxError, match="label 7 out of range"):
        dx.sync()
    assert u.name in s.names.lost
    del u, bad
    np.testing.assert_array_equal((a + 1).numpy(), np.arange(6, dtype=np.float32).reshape(2, 3) + 1)
    np.testing.assert_array_equal(a.permute(1, 0).numpy(), np.arange(6, dtype=np.float32).reshape(2, 3).T)


def test_two_backwards_in_one_step_expand_in_order(rng):
    """Two losses differentiated in one step (the second after the first accumulated into .grad): once both graphs
    were derived, both backward instructions go in the one program, expanded where each stands."""
    dx.connect()
    w0, v0, x = rng.standard_normal((4, 3)), rng.standard_normal(3), rng.standard_normal((5, 4))
    w, v = nn.Parameter(w0), nn.Parameter(v0)
    tw, tv = torch.tensor(w0, requires_grad=True), torch.tensor(v0, requires_grad=True)
    dxx, tx = dx.tensor(x), torch.tensor(x)
    with _backwards_sent() as sent:
        for _ in range(5):
            for p in (w, v):
                p.grad = None
            (dxx @ w).tanh().sum().backward()
            ((dxx @ w) * v).square().mean().backward()
            gw, gv = w.grad.numpy(), v.grad.numpy()
            tw.grad = tv.grad = None
            (tx @ tw).tanh().sum().backward()
            ((tx @ tw) * tv).square().mean().backward()
            np.testing.assert_allclose(gw, tw.grad.numpy(), rtol=1e-10)
            np.testing.assert_allclose(gv, tv.grad.numpy(), rtol=1e-10)
    assert 2 in sent  # the last steps: one program carrying both backward instructions


def test_a_loop_over_new_batches_names_them_alike_and_records_its_backward(rng):
    """dx.tensor takes a collected tensor's name of its shape and dtype, and a free name goes to the lowest-numbered
    first whatever order Python collected them in: a loop over fresh batches sends the same programs every step."""
    dx.connect()
    s = dx.session()
    a, b, c = (dx.zeros(3) + k for k in range(3))
    names = sorted((a.name, b.name, c.name), key=lambda n: (len(n), n))
    del c, a, b
    d = dx.ones(3) * 5.0
    assert d.name == names[0]  # the lowest of the three, though it was collected second
    np.testing.assert_array_equal(d.numpy(), [5.0] * 3)
    x = dx.tensor(np.arange(4.0))
    first = x.name
    del x
    x = dx.tensor(np.arange(4.0) + 10)
    assert x.name == first
    np.testing.assert_array_equal(x.numpy(), np.arange(4.0) + 10)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3)).double()
    opt = SGD(model.parameters(), lr=0.1)
    recorded = []
    seen = NamePool.differentiated

    def spy(self, k, spec, metas):  # type: ignore[no-untyped-def]
        r = seen(self, k, spec, metas)
        recorded.append(r)
        return r

    NamePool.differentiated = spy  # type: ignore[method-assign]
    try:
        for _ in range(8):
            xb, yb = dx.tensor(rng.standard_normal((16, 6))), dx.tensor(rng.integers(0, 3, 16))
            opt.zero_grad()
            loss = F.cross_entropy(model(xb), yb)
            loss.backward()
            opt.step()
            loss.item()
    finally:
        NamePool.differentiated = seen  # type: ignore[method-assign]
    assert recorded[-4:] == [True] * 4, recorded
    assert s is dx.session()


def test_an_adam_step_is_one_program_though_its_numbers_change(rng):
    """Adam's step count changes every step (and a schedule changes the lr): the daemon's caches take the step as
    the same program with new numbers in its updates (instr.renumbered), so the backward stays in the step's program
    and the step takes the scheduler's fast path and the worker's known program. The numbers are torch's
    throughout."""
    dx.connect()
    s = dx.session()
    from deepx_sdk.optim import Adam, StepLR

    node = s.transport.node
    scheduler, worker = node.ref("scheduler")._actor, node.worker()._actor
    w0 = rng.standard_normal((4, 3))
    w, tw = nn.Parameter(w0), torch.tensor(w0, requires_grad=True)
    x = rng.standard_normal((5, 4))
    dxx, tx = dx.tensor(x), torch.tensor(x)
    opt, topt = Adam([w], lr=0.1), torch.optim.Adam([tw], lr=0.1)
    sched, tsched = StepLR(opt, 3, 0.5), torch.optim.lr_scheduler.StepLR(topt, 3, 0.5)
    fast, renumbered = scheduler.plan_hits, worker.renumbered_runs
    with _backwards_sent() as sent:
        for _ in range(12):
            _paired_step((dxx, w, opt, sched), (tx, tw, topt, tsched))
    np.testing.assert_allclose(w.detach().numpy(), tw.detach().numpy(), rtol=1e-9)
    assert scheduler.apart == 0 and sent[-6:] == [1] * 6  # each step one program, its backward in it, run whole
    assert scheduler.plan_hits - fast >= 6 and worker.renumbered_runs - renumbered >= 6


def test_an_mlp_step_with_transposed_weights_sends_one_program_every_step(rng):
    """A Linear's transposed weight and its ReLU's output have one shape (64-128-64-10's first layer): the transpose
    takes a deleted name before a pooled one, so the two keep their names from step to step. Pooled first, they
    swapped names every step, and the steps alternated between two programs and two plans."""
    dx.connect()
    scheduler = dx.session().transport.node.ref("scheduler")._actor
    from deepx_sdk.optim import Adam

    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 3))
    opt = Adam(model.parameters(), lr=1e-3)
    x, y = dx.tensor(rng.standard_normal((8, 8)).astype(np.float32)), dx.tensor(rng.integers(0, 3, 8))
    programs: list[list[Any]] = []
    run = type(scheduler).now_run

    def spy(self, program, *args, **kwargs):  # type: ignore[no-untyped-def]
        programs.append([(i.name, i.returns) for i in program])
        return run(self, program, *args, **kwargs)

    def train_step() -> float:  # (a loss kept across steps would alternate between two names of its own)
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss.item()

    type(scheduler).now_run = spy  # type: ignore[method-assign]
    try:
        for step in range(10):
            if step == 6:
                misses = scheduler.plan_misses
            train_step()
    finally:
        type(scheduler).now_run = run  # type: ignore[method-assign]
    assert scheduler.plan_misses == misses
    assert len(programs) >= 4 and all(p == programs[-1] for p in programs[-4:])


def test_a_step_whose_numbers_change_runs_in_parts_in_the_daemon(rng):
    """A number that changes every step outside the optimizer's updates (here a monitor the step computes) makes a
    new program every step: the SDK still sends one program per step, its backward inside, and after two such steps
    the daemon runs them in parts (Scheduler._apart): the backward by the plan of its derived program, only the parts
    around it planned afresh (the whole step would go through the passes and the worker's check every time). The
    numbers are torch's throughout."""
    dx.connect()
    s = dx.session()
    scheduler = s.transport.node.ref("scheduler")._actor
    w0 = rng.standard_normal((4, 3))
    w, tw = nn.Parameter(w0), torch.tensor(w0, requires_grad=True)
    x = rng.standard_normal((5, 4))
    dxx, tx = dx.tensor(x), torch.tensor(x)
    opt, topt = SGD([w], lr=0.1), torch.optim.SGD([tw], lr=0.1)
    apart, hits = [], []
    with _backwards_sent() as sent:
        for step in range(12):
            opt.zero_grad()
            loss = (dxx @ w).tanh().sum()
            loss.backward()
            opt.step()
            monitor = (dxx * (1.0 + step / 10)).sum()  # a new number every step
            topt.zero_grad()
            tloss = (tx @ tw).tanh().sum()
            tloss.backward()
            topt.step()
            assert loss.item() == pytest.approx(tloss.item(), rel=1e-10)
            apart.append(scheduler.apart)
            hits.append(scheduler.plan_hits)
    assert monitor.item() == pytest.approx(x.sum() * 2.1, rel=1e-10)
    np.testing.assert_allclose(w.detach().numpy(), tw.detach().numpy(), rtol=1e-9)
    assert sent[-8:] == [1] * 8  # each step one program, its backward recorded in it
    assert apart[-1] - apart[-7] == 6  # the last steps: each run in parts by the daemon
    assert hits[-1] - hits[-7] >= 6  # ...the backward of each by its plan, reused from step to step


def test_data_sent_from_python_takes_only_names_whose_tensors_exist():
    """dx.tensor takes a pooled name (its tensor is replaced), never a deleted transpose's (whose deletion may still
    be queued behind a failed program), and a tensor it made is not taken for one never made when a later program
    fails; a refused put (inside dx.compile) leaves nothing behind."""
    import gc

    dx.connect()
    s = dx.session()
    ex = s.transport.node.worker()._actor.ex
    w = dx.tensor(np.arange(6.0).reshape(2, 3))
    a, idx = dx.tensor(np.arange(3.0)), dx.tensor(np.array([5]))
    t = w.t()
    dx.sync()
    bad = a[idx]  # fails in the daemon at the next flush
    del t  # its deletion is queued after the failing instruction
    c = dx.tensor(np.ones((3, 2)))
    with pytest.raises(DeepxError, match="out of range"):
        dx.sync()
    np.testing.assert_array_equal(c.numpy(), np.ones((3, 2)))
    del bad
    bad = a[idx]
    c.add_(1.0)  # after the failure: never runs
    with pytest.raises(DeepxError, match="out of range"):
        dx.sync()
    assert c.name not in s.names.lost  # it exists: deleted (or pooled) when collected, not leaked
    name = c.name
    del c, bad
    gc.collect()
    dx.sync()
    assert name not in ex.tensors or any(name in v for v in s.names.pool.values())

    @dx.compile
    def f(x):  # type: ignore[no-untyped-def]
        return x * dx.tensor(np.ones(3, np.float32))

    x = dx.tensor(np.ones(3, np.float32))
    counts = []
    for _ in range(3):
        tmp = x + 1.0
        dx.sync()
        del tmp  # a pooled name of shape (3,)
        with pytest.raises(DeepxError, match="sends data from Python"):
            f(x)
        gc.collect()
        dx.sync()
        counts.append(len(ex.tensors))
    assert counts[0] == counts[-1]


def test_steps_run_whole_again_once_they_repeat(rng):
    """A warm-up that changes a number of the step (not an optimizer's: those the daemon takes as the same program)
    for a while: the daemon runs those steps in parts, and whole again once the parts repeat."""
    dx.connect()
    scheduler = dx.session().transport.node.ref("scheduler")._actor
    w0, x = rng.standard_normal((4, 3)), rng.standard_normal((5, 4))
    w, tw = nn.Parameter(w0), torch.tensor(w0, requires_grad=True)
    dxx, tx = dx.tensor(x), torch.tensor(x)
    opt, topt = SGD([w], lr=0.1, momentum=0.9), torch.optim.SGD([tw], lr=0.1, momentum=0.9)
    apart, hits = [], []
    with _backwards_sent() as sent:
        for step in range(24):
            lr = 0.01 * (step + 1) if step < 8 else 0.1  # warm-up, then constant
            for o in (opt, topt):
                o.param_groups[0]["lr"] = lr
            opt.zero_grad()
            loss = (dxx @ w).tanh().sum()
            loss.backward()
            opt.step()
            monitor = dxx.sum() * lr  # a number of the step's own that warms up too
            topt.zero_grad()
            (tx @ tw).tanh().sum().backward()
            topt.step()
            loss.item()
            apart.append(scheduler.apart)
            hits.append(scheduler.plan_hits)
    assert monitor.item() == pytest.approx(x.sum() * 0.1, rel=1e-10)
    np.testing.assert_allclose(w.detach().numpy(), tw.detach().numpy(), rtol=1e-9)
    assert sent[-16:] == [1] * 16  # one program per step, its backward recorded in it
    assert apart[7] > apart[2]  # in parts during the warm-up
    assert apart[-1] == apart[-6] and hits[-1] - hits[-6] == 5  # whole again, each step by its plan


@pytest.mark.parametrize("opt_name", ["sgd", "adam"])
def test_an_lr_that_holds_then_changes_is_the_lr_the_step_runs(rng, opt_name):
    """A StepLR keeps the lr for a few steps and then changes it: the steps in between repeat exactly (the fast
    entry's program may come from a remembered expansion of an equal, earlier program), and the step after takes the
    new lr, not the one the entry held (found in review: every other such step ran the old lr). The scheduler's plans
    stay bounded."""
    dx.connect()
    s = dx.session()
    from deepx_sdk.optim import SGD, Adam, StepLR

    scheduler = s.transport.node.ref("scheduler")._actor
    w0 = rng.standard_normal((4, 3))
    w, tw = nn.Parameter(w0), torch.tensor(w0, requires_grad=True)
    x = rng.standard_normal((5, 4))
    dxx, tx = dx.tensor(x), torch.tensor(x)
    if opt_name == "sgd":
        opt, topt = SGD([w], lr=0.1, momentum=0.9), torch.optim.SGD([tw], lr=0.1, momentum=0.9)
    else:
        opt, topt = Adam([w], lr=0.1), torch.optim.Adam([tw], lr=0.1)
    sched, tsched = StepLR(opt, 3, 0.5), torch.optim.lr_scheduler.StepLR(topt, 3, 0.5)
    keys = []
    for _ in range(20):
        _paired_step((dxx, w, opt, sched), (tx, tw, topt, tsched))
        keys.append(len(scheduler.plans))
    np.testing.assert_allclose(w.detach().numpy(), tw.detach().numpy(), rtol=1e-9)
    assert keys[-1] <= keys[5] + 2  # no entry (empty or not) per step
