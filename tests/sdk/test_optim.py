"""Optimizers and schedulers against torch.optim: 20-step trajectories on the same gradients."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

import deepx_sdk as dx
import deepx_sdk.nn as nn
from deepx_core.errors import DeepxError
from deepx_sdk.optim import SGD, Adam, AdamW, CosineAnnealingLR, StepLR
from deepx_sdk.recorder import origin_of
from deepx_sdk.session import session as current_session_object


def _run(make_dx, make_torch, steps=20, dtype=np.float64, scheduler=None):
    rng = np.random.default_rng(0)
    shapes = [(4, 3), (3,)]
    init = [rng.standard_normal(s).astype(dtype) for s in shapes]
    grads = [[rng.standard_normal(s).astype(dtype) for s in shapes] for _ in range(steps)]
    params = [nn.Parameter(a.copy()) for a in init]
    tparams = [torch.nn.Parameter(torch.from_numpy(a.copy())) for a in init]
    opt, topt = make_dx(params), make_torch(tparams)
    sch = tsch = None
    if scheduler is not None:
        sch, tsch = scheduler[0](opt), scheduler[1](topt)
    for step in range(steps):
        for p, tp, g in zip(params, tparams, grads[step]):
            p.grad = dx.tensor(g)
            tp.grad = torch.from_numpy(g.copy())
        opt.step()
        topt.step()
        if sch is not None:
            sch.step()
            tsch.step()
            assert sch.get_last_lr() == pytest.approx(tsch.get_last_lr(), rel=1e-12)
    for p, tp in zip(params, tparams):
        np.testing.assert_allclose(p.numpy(), tp.detach().numpy(), rtol=1e-9 if dtype == np.float64 else 2e-5,
                                   atol=1e-12 if dtype == np.float64 else 1e-6)
    return opt, topt


@pytest.mark.parametrize("kw", [
    {"lr": 0.1},
    {"lr": 0.05, "momentum": 0.9},
    {"lr": 0.05, "momentum": 0.9, "dampening": 0.1, "weight_decay": 0.01},
    {"lr": 0.05, "momentum": 0.9, "nesterov": True, "weight_decay": 0.001},
])
def test_sgd_follows_torch(kw):
    _run(lambda ps: SGD(ps, **kw), lambda ps: torch.optim.SGD(ps, foreach=False, **kw))


@pytest.mark.parametrize("cls, tcls, kw", [
    (Adam, torch.optim.Adam, {"lr": 0.01}),
    (Adam, torch.optim.Adam, {"lr": 0.01, "betas": (0.8, 0.99), "weight_decay": 0.01}),
    (AdamW, torch.optim.AdamW, {"lr": 0.01}),
    (AdamW, torch.optim.AdamW, {"lr": 0.003, "weight_decay": 0.1, "eps": 1e-6}),
])
def test_adam_and_adamw_follow_torch(cls, tcls, kw):
    _run(lambda ps: cls(ps, **kw), lambda ps: tcls(ps, foreach=False, **kw))


def test_float32_trajectories():
    _run(lambda ps: Adam(ps, lr=0.01), lambda ps: torch.optim.Adam(ps, lr=0.01, foreach=False), dtype=np.float32)


def test_schedulers_follow_torch():
    _run(lambda ps: SGD(ps, lr=0.1, momentum=0.5), lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.5),
         scheduler=(lambda o: StepLR(o, step_size=5, gamma=0.5), lambda o: torch.optim.lr_scheduler.StepLR(o, 5, 0.5)))
    _run(lambda ps: Adam(ps, lr=0.01), lambda ps: torch.optim.Adam(ps, lr=0.01),
         scheduler=(lambda o: CosineAnnealingLR(o, T_max=10, eta_min=0.001),
                    lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=10, eta_min=0.001)))


def test_state_dict_round_trip_continues_the_trajectory():
    opt, topt = _run(lambda ps: Adam(ps, lr=0.01), lambda ps: torch.optim.Adam(ps, lr=0.01, foreach=False), steps=5)
    sd = opt.state_dict()
    assert sd["state"][0]["step"] == 5 and set(sd["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}
    np.testing.assert_allclose(sd["state"][0]["exp_avg"].numpy(),
                               topt.state_dict()["state"][0]["exp_avg"].numpy(), rtol=1e-9)
    params = [p for g in opt.param_groups for p in g["params"]]
    fresh = Adam(params, lr=0.5)
    fresh.load_state_dict(sd)
    assert fresh.param_groups[0]["lr"] == 0.01 and fresh.state_dict()["state"][1]["step"] == 5


@pytest.mark.parametrize("kw", [{"lr": 0.05, "momentum": 0.9}, {"lr": 0.05}, {"lr": 0.05, "momentum": 0.5,
                                                                           "nesterov": True}])
def test_torch_sgd_state_loaded_mid_training_continues_as_torch(kw):
    """torch's SGD state holds only momentum_buffer (None without momentum), no step count: loading it made the
    next step() fail with KeyError 'step' (found in review); it continues torch's trajectory now."""
    rng = np.random.default_rng(3)
    w0 = rng.standard_normal((4, 3))
    tp = torch.nn.Parameter(torch.from_numpy(w0.copy()))
    topt = torch.optim.SGD([tp], foreach=False, **kw)
    grads = [rng.standard_normal((4, 3)) for _ in range(6)]
    for g in grads[:3]:
        tp.grad = torch.from_numpy(g.copy())
        topt.step()
    p = nn.Parameter(tp.detach().numpy().copy())
    opt = SGD([p], **kw)
    opt.load_state_dict(topt.state_dict())
    for g in grads[3:]:
        tp.grad = torch.from_numpy(g.copy())
        topt.step()
        p.grad = dx.tensor(g)
        opt.step()
    np.testing.assert_allclose(p.numpy(), tp.detach().numpy(), rtol=1e-12)


def test_zero_grad_and_a_step_without_gradients():
    p = nn.Parameter(np.ones(3))
    opt = SGD([p], lr=0.1)
    opt.step()  # no gradient: nothing changes
    np.testing.assert_array_equal(p.numpy(), 1.0)
    p.grad = dx.ones(3, dtype=dx.float64)
    opt.zero_grad()
    assert p.grad is None


def test_bad_settings_are_refused():
    p = nn.Parameter(np.ones(3))
    with pytest.raises(DeepxError, match="nesterov needs momentum"):
        SGD([p], lr=0.1, nesterov=True)
    with pytest.raises(DeepxError, match="out of range"):
        Adam([p], betas=(1.0, 0.9))
    with pytest.raises(DeepxError, match="empty parameter list"):
        SGD([], lr=0.1)
    opt = SGD([p], lr=0.1)
    p.grad = dx.ones(4, dtype=dx.float64)
    with pytest.raises(DeepxError, match=r"gradient of .* has shape"):
        opt.step()


def test_sgd_sends_the_same_update_every_step_after_the_first():
    """The sgd kernel only tells the first step from the rest, so from step 2 on the update instruction (and a
    training loop's program) is the same every step, which the daemon runs without checking it again; the values
    still follow torch (test_sgd_follows_torch)."""
    w = nn.Parameter(dx.tensor(np.ones(4, np.float32)))
    opt = SGD([w], lr=0.1, momentum=0.9)
    sent = []
    for _ in range(4):
        opt.zero_grad()
        (w * w).sum().backward()
        s = current_session_object()
        opt.step()
        sent.append([i for i in s.pending if i.name == "sgd"])
        dx.sync()
    steps = [[p.value for p in instrs[0].args if p.category == "var"][-1] for instrs in sent]
    assert steps == [1, 2, 2, 2]
    assert sent[1] == sent[2] == sent[3]
    assert w.numpy().tolist() == pytest.approx(
        [float(v) for v in _torch_sgd_four_steps()], rel=1e-6)


def _torch_sgd_four_steps() -> list[float]:
    tw = torch.ones(4, requires_grad=True)
    topt = torch.optim.SGD([tw], lr=0.1, momentum=0.9)
    for _ in range(4):
        topt.zero_grad()
        (tw * tw).sum().backward()
        topt.step()
    return tw.detach().tolist()


def test_an_update_records_the_same_hyperparameter_params_until_one_changes():
    """A group's hyperparameters become var params once, and again only when one changes (a scheduler's lr), so
    every step records the same objects; -0.0 is not taken for 0.0. An update's instruction names the line that
    called step()."""
    p = nn.Parameter(np.ones(4, np.float32))
    opt = SGD([p], lr=0.1, momentum=0.9)
    s = current_session_object()
    s.sync()

    def recorded() -> tuple[Any, ...]:
        p.grad = dx.ones(4)
        opt.step()  # the line the update's origin names: in this function
        instr = s.pending[-1]
        where = origin_of(s.origins[-1])
        assert instr.name == "sgd" and where is not None and where[0].co_name == "recorded"
        return instr.args[3:8]

    first, second = recorded(), recorded()
    assert all(a is b for a, b in zip(first, second))
    opt.param_groups[0]["lr"] = 0.05
    third = recorded()
    assert third[0] is not first[0] and third[0].value == 0.05 and all(a is b for a, b in zip(first[1:], third[1:]))
    opt.param_groups[0]["weight_decay"] = -0.0
    fourth = recorded()
    assert str(fourth[3].value) == "-0.0" and str(third[3].value) == "0.0"
    # a value that can change in place (a 0-d array) is read again every step, not taken for the same by identity
    lr = np.array(0.2)
    opt.param_groups[0]["lr"] = lr
    assert recorded()[0].value == 0.2
    lr[...] = 0.3
    assert recorded()[0].value == 0.3
    s.sync()
    np.testing.assert_array_less(p.numpy(), 1.0)  # the updates ran


def test_an_update_recorded_by_a_subclass_step_names_that_step():
    """A subclass whose own step records updates (through _update) gets its own line in their origins, also after
    an Optimizer.step ran before it (found in review: the line of the earlier step was kept)."""

    class Halving(SGD):
        def step(self) -> None:
            for p in self.param_groups[0]["params"]:
                state = self.state.setdefault(id(p), {"step": 0})
                state["step"] += 1
                self._update(p, p.grad, state, self.param_groups[0])  # the line an update names

    p = nn.Parameter(np.ones(4, np.float32))
    opt = Halving([p], lr=0.1)
    s = current_session_object()
    s.sync()
    p.grad = dx.ones(4)
    SGD.step(opt)
    where = origin_of(s.origins[-1])
    assert where is not None and where[0].co_name.startswith("test_an_update")
    opt.step()
    where = origin_of(s.origins[-1])
    assert where is not None and where[0].co_name == "step" and s.pending[-1].name == "sgd"
    s.sync()


@pytest.mark.parametrize("make", [
    (lambda o: StepLR(o, step_size=2, gamma=0.5), lambda o: torch.optim.lr_scheduler.StepLR(o, 2, 0.5)),
    (lambda o: CosineAnnealingLR(o, T_max=4, eta_min=0.01),
     lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=4, eta_min=0.01)),
])
def test_schedulers_follow_an_lr_set_by_hand_as_torch(make):
    """torch's schedulers are chainable: an lr set in between steps is decayed from where it stands."""
    p, tp = dx.tensor([1.0], requires_grad=True), torch.tensor([1.0], requires_grad=True)
    opt, topt = SGD([p], lr=0.1), torch.optim.SGD([tp], lr=0.1)
    sch, tsch = make[0](opt), make[1](topt)
    got, want = [], []
    for i in range(11):
        if i == 4:
            opt.param_groups[0]["lr"] = topt.param_groups[0]["lr"] = 0.5
        opt.step()
        topt.step()
        sch.step()
        tsch.step()
        got.append(sch.get_last_lr()[0])
        want.append(tsch.get_last_lr()[0])
    np.testing.assert_allclose(got, want, rtol=1e-12)


def test_add_param_group_trains_the_new_group_with_its_own_lr():
    w0, b0 = np.array([1.0, -2.0]), np.array([0.5])
    p, q = dx.tensor(w0, requires_grad=True), dx.tensor(b0, requires_grad=True)
    tp, tq = torch.tensor(w0, requires_grad=True), torch.tensor(b0, requires_grad=True)
    opt, topt = SGD([p], lr=0.1, momentum=0.9), torch.optim.SGD([tp], lr=0.1, momentum=0.9)
    for step in range(4):
        if step == 2:
            opt.add_param_group({"params": [q], "lr": 0.01})
            topt.add_param_group({"params": [tq], "lr": 0.01})
        for o, a, b in ((opt, p, q), (topt, tp, tq)):
            o.zero_grad()
            ((a * a).sum() * (b * 3).sum()).backward()
            o.step()
    np.testing.assert_allclose(p.numpy(), tp.detach().numpy(), rtol=1e-10)
    np.testing.assert_allclose(q.numpy(), tq.detach().numpy(), rtol=1e-10)
    with pytest.raises(DeepxError, match="more than one group"):
        opt.add_param_group({"params": [p]})
