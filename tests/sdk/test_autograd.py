"""loss.backward(): the daemon rewrites the recorded forward graph into its backward program; gradients against
torch autograd, accumulation, retain_graph, no_grad and detach, and training with an optimizer."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import deepx_sdk as dx
import deepx_sdk.nn as nn
import deepx_sdk.nn.functional as F
from deepx_sdk.errors import DeepxError
from deepx_sdk.optim import SGD


@pytest.fixture
def data():
    rng = np.random.default_rng(0)
    return {"W1": rng.standard_normal((6, 5)), "b1": rng.standard_normal(5), "W2": rng.standard_normal((5, 3)),
            "b2": rng.standard_normal(3), "X": rng.standard_normal((8, 6)), "y": rng.integers(0, 3, 8)}


def _forward(lib, p, X, y):
    F_ = F if lib is dx else torch.nn.functional
    h = (X @ p["W1"] + p["b1"]).relu()
    logits = h @ p["W2"] + p["b2"]
    return F_.cross_entropy(logits, y) + ((logits * logits).mean() * 0.1)


def test_mlp_gradients_equal_torch(data):
    p = {k: nn.Parameter(v) for k, v in data.items() if k not in ("X", "y")}
    tp = {k: torch.tensor(v, requires_grad=True) for k, v in data.items() if k not in ("X", "y")}
    loss = _forward(dx, p, dx.tensor(data["X"]), dx.tensor(data["y"]))
    tloss = _forward(torch, tp, torch.tensor(data["X"]), torch.tensor(data["y"]))
    loss.backward()
    tloss.backward()
    assert loss.item() == pytest.approx(tloss.item(), rel=1e-12)
    for k in p:
        np.testing.assert_allclose(p[k].grad.numpy(), tp[k].grad.numpy(), rtol=1e-9, atol=1e-12)


def test_gradients_accumulate_and_retain_graph(data):
    w = nn.Parameter(data["W1"])
    x = dx.tensor(data["X"])
    loss = (x @ w).sin().sum()
    loss.backward(retain_graph=True)
    first = w.grad.numpy().copy()
    loss.backward()
    np.testing.assert_allclose(w.grad.numpy(), 2 * first, rtol=1e-12)
    with pytest.raises(DeepxError, match="freed by an earlier backward"):
        loss.backward()
    tw = torch.tensor(data["W1"], requires_grad=True)
    (torch.tensor(data["X"]) @ tw).sin().sum().backward()
    np.testing.assert_allclose(first, tw.grad.numpy(), rtol=1e-9)


def test_non_scalar_output_with_a_given_gradient(data):
    w = nn.Parameter(data["W2"])
    out = dx.tensor(data["X"][:, :5]) @ w
    g = np.random.default_rng(1).standard_normal(out.shape)
    out.backward(dx.tensor(g))
    tw = torch.tensor(data["W2"], requires_grad=True)
    (torch.tensor(data["X"][:, :5]) @ tw).backward(torch.tensor(g))
    np.testing.assert_allclose(w.grad.numpy(), tw.grad.numpy(), rtol=1e-9)
    with pytest.raises(DeepxError, match="only for scalar outputs"):
        (dx.tensor(data["X"][:, :5]) @ w).backward()


def test_no_grad_and_detach_stop_gradients(data):
    w = nn.Parameter(data["W1"])
    x = dx.tensor(data["X"])
    with dx.no_grad():
        y = x @ w
    assert not y.requires_grad
    with pytest.raises(DeepxError, match="does not require grad"):
        y.sum().backward()
    z = (x @ w).detach()
    assert not z.requires_grad
    loss = ((x @ w) * z).sum()  # z counts as a constant
    loss.backward()
    tw = torch.tensor(data["W1"], requires_grad=True)
    tz = (torch.tensor(data["X"]) @ tw).detach()
    ((torch.tensor(data["X"]) @ tw) * tz).sum().backward()
    np.testing.assert_allclose(w.grad.numpy(), tw.grad.numpy(), rtol=1e-9)


def test_an_op_without_a_gradient_rule_is_named(data):
    w = nn.Parameter(np.ones(5))
    ln = F.layer_norm(dx.tensor(data["X"][:, :5]) * w, (5,))
    with pytest.raises(DeepxError, match="layernorm"):
        ln.sum().backward()


def test_training_an_mlp_reduces_the_loss_like_torch(data):
    torch.manual_seed(0)
    tmodel = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3)).double()
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3)).double()
    model.load_state_dict({k: v.detach().numpy() for k, v in tmodel.state_dict().items()})
    opt = SGD(model.parameters(), lr=0.1, momentum=0.9)
    topt = torch.optim.SGD(tmodel.parameters(), lr=0.1, momentum=0.9)
    X, y = dx.tensor(data["X"]), dx.tensor(data["y"])
    tX, ty = torch.tensor(data["X"]), torch.tensor(data["y"])
    losses = []
    for _ in range(15):
        opt.zero_grad()
        loss = F.cross_entropy(model(X), y)
        loss.backward()
        opt.step()
        topt.zero_grad()
        tloss = torch.nn.functional.cross_entropy(tmodel(tX), ty)
        tloss.backward()
        topt.step()
        losses.append(loss.item())
        assert losses[-1] == pytest.approx(tloss.item(), rel=1e-8)
    assert losses[-1] < 0.5 * losses[0]
