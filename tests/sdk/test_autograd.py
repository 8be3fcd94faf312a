"""loss.backward(): the daemon rewrites the recorded forward graph into its backward program; gradients against
torch autograd, accumulation, retain_graph, no_grad and detach, and training with an optimizer."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import deepx_sdk as dx
import deepx_sdk.nn as nn
import deepx_sdk.nn.functional as F
from deepx_core.errors import DeepxError
from deepx_sdk.optim import SGD
from tests.sdk.conftest import cross_entropy_step


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
        loss, tloss = cross_entropy_step(model, opt, X, y, tmodel, topt, tX, ty)
        losses.append(loss)
        assert loss == pytest.approx(tloss, rel=1e-8)
    assert losses[-1] < 0.5 * losses[0]


# ---------------------------------------------------------------- the user-facing forms of each differentiable op


def _grads_equal_torch(fn, arrays: dict[str, np.ndarray], wrt: str, rtol: float = 1e-9, seed: int = 1) -> None:
    """fn(lib, tensors) in deepx and in torch (float64): the same result, and the same gradients of
    sum(result * u) for a random u, for the names in `wrt`."""
    names = wrt.split()
    p = {k: nn.Parameter(v) if k in names else dx.tensor(v) for k, v in arrays.items()}
    tp = {k: torch.tensor(v, requires_grad=k in names) for k, v in arrays.items()}
    out, tout = fn(dx, p), fn(torch, tp)
    np.testing.assert_allclose(out.numpy(), tout.detach().numpy(), rtol=rtol, atol=1e-12)
    u = np.random.default_rng(seed).standard_normal(tout.shape)
    (out * dx.tensor(u)).sum().backward()
    (tout * torch.tensor(u)).sum().backward()
    for k in names:
        np.testing.assert_allclose(p[k].grad.numpy(), tp[k].grad.numpy(), rtol=rtol, atol=1e-12, err_msg=k)


def _F(lib):
    return F if lib is dx else torch.nn.functional


@pytest.fixture
def rng():
    return np.random.default_rng(7)


def test_layer_norm_with_and_without_affine(rng):
    arrays = {"x": rng.standard_normal((4, 3, 6)), "w": rng.standard_normal(6), "b": rng.standard_normal(6)}
    _grads_equal_torch(lambda lib, t: _F(lib).layer_norm(t["x"], (6,), t["w"], t["b"], 1e-5), arrays, "x w b")
    _grads_equal_torch(lambda lib, t: _F(lib).layer_norm(t["x"] * t["w"], (3, 6)), arrays, "x w")
    ln, tln = nn.LayerNorm(6).double(), torch.nn.LayerNorm(6).double()
    x = rng.standard_normal((5, 6))
    ln(dx.tensor(x)).pow(2).sum().backward()
    tln(torch.tensor(x)).pow(2).sum().backward()
    np.testing.assert_allclose(ln.weight.grad.numpy(), tln.weight.grad.numpy(), rtol=1e-9)
    np.testing.assert_allclose(ln.bias.grad.numpy(), tln.bias.grad.numpy(), rtol=1e-9, atol=1e-12)


def test_rms_norm(rng):
    arrays = {"x": rng.standard_normal((4, 6)), "w": rng.standard_normal(6)}
    _grads_equal_torch(lambda lib, t: _F(lib).rms_norm(t["x"], (6,), t["w"], 1e-6), arrays, "x w")


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu(rng, approximate):
    arrays = {"x": rng.uniform(-4, 4, (5, 7))}
    _grads_equal_torch(lambda lib, t: _F(lib).gelu(t["x"], approximate=approximate), arrays, "x")


def test_activations_and_softmax(rng):
    arrays = {"x": rng.standard_normal((3, 5))}
    _grads_equal_torch(lambda lib, t: _F(lib).silu(t["x"]) + t["x"].sigmoid() * t["x"].tanh()
                       + _F(lib).softmax(t["x"], -1) * _F(lib).log_softmax(t["x"], 0), arrays, "x")


@pytest.mark.parametrize("seeded", [False, True])
def test_dropout_in_train_mode_scales_the_kept_gradient(rng, seeded):
    if seeded:
        dx.manual_seed(3)
    x = rng.uniform(0.5, 1.5, (40, 50))
    p = nn.Parameter(x)
    y = F.dropout(p, 0.3)
    y.sum().backward()
    kept = y.numpy() != 0  # the inputs are non-zero: zeros in y are the dropped elements
    assert 0.6 < kept.mean() < 0.8
    np.testing.assert_allclose(p.grad.numpy(), kept / 0.7, rtol=1e-12)
    np.testing.assert_allclose(y.numpy(), x * kept / 0.7, rtol=1e-12)
    q = nn.Parameter(x)
    F.dropout(q, 0.3, training=False).sum().backward()
    np.testing.assert_array_equal(q.grad.numpy(), np.ones_like(x))


def test_cat_and_stack(rng):
    arrays = {"a": rng.standard_normal((2, 3)), "b": rng.standard_normal((4, 3)), "c": rng.standard_normal((2, 3))}
    _grads_equal_torch(lambda lib, t: lib.cat([t["a"], t["b"], t["a"]], 0), arrays, "a b")
    _grads_equal_torch(lambda lib, t: lib.stack([t["a"], t["c"]], -1), arrays, "a c")


def test_slicing_and_indexing(rng):
    arrays = {"x": rng.standard_normal((5, 6, 4)), "i": np.array([4, 0, 4, 2])}
    _grads_equal_torch(lambda lib, t: t["x"][1:4, ::2, -1] * 2 + t["x"][0, :3, 1:3].sum(), arrays, "x")
    _grads_equal_torch(lambda lib, t: t["x"][t["i"]] * t["x"][..., 0:1][t["i"]], arrays, "x")
    _grads_equal_torch(lambda lib, t: t["x"][:, None, 2] + t["x"][-2:, 1:2].transpose(0, 1), arrays, "x")


def test_max_min_prod_with_dim(rng):
    arrays = {"x": rng.standard_normal((4, 5, 3))}
    _grads_equal_torch(lambda lib, t: t["x"].max(1).values.unsqueeze(1) + t["x"].min(-1, keepdim=True).values,
                       arrays, "x")
    _grads_equal_torch(lambda lib, t: t["x"].amax((0, 2)) * t["x"].max() + t["x"].amin(0).sum(), arrays, "x")
    _grads_equal_torch(lambda lib, t: t["x"].prod(1) + t["x"].prod(), arrays, "x")
    zeros = {"x": np.array([[1.5, 0.0, 2.0], [0.0, 0.0, 3.0], [0.5, -1.0, 2.0]])}
    _grads_equal_torch(lambda lib, t: t["x"].prod(1, keepdim=True) * t["x"].prod(0), zeros, "x")


def test_mean_var_and_reductions(rng):
    arrays = {"x": rng.standard_normal((4, 5))}
    _grads_equal_torch(lambda lib, t: t["x"].mean(0) * t["x"].var(0) + t["x"].std(1).sum() + t["x"].sum(),
                       arrays, "x")


def test_where_and_masked_fill(rng):
    arrays = {"x": rng.standard_normal((4, 5)), "y": rng.standard_normal(5), "c": rng.standard_normal((4, 5)) > 0}
    _grads_equal_torch(lambda lib, t: lib.where(t["c"], t["x"], t["y"]), arrays, "x y")
    _grads_equal_torch(lambda lib, t: lib.where(t["x"] > 0, t["x"] * 2.0, 0.5) + t["x"].masked_fill(t["c"], -1.0),
                       arrays, "x")
    _grads_equal_torch(lambda lib, t: (t["x"] @ t["x"].T).tril() + t["x"].clamp(-0.5, 0.5).sum(), arrays, "x")


def test_pad_repeat_expand_and_shape_ops(rng):
    arrays = {"x": rng.standard_normal((2, 3)), "y": rng.standard_normal((3, 1))}
    _grads_equal_torch(lambda lib, t: _F(lib).pad(t["x"], (1, 2, 0, 1), value=0.5), arrays, "x")
    _grads_equal_torch(lambda lib, t: t["x"].repeat(2, 1, 3) + t["y"].expand(2, 3, 3).flatten(0, 1).unsqueeze(0)
                       [:, :2, :].repeat(2, 1, 3), arrays, "x y")
    _grads_equal_torch(lambda lib, t: t["x"].permute(1, 0).unsqueeze(-1) * t["y"].squeeze(-1).reshape(3, 1, 1),
                       arrays, "x y")


def test_embedding_gradient_accumulates_repeated_indices(rng):
    weight = rng.standard_normal((6, 4))
    idx = np.array([[1, 3, 1], [5, 1, 0]])
    emb = nn.Embedding(6, 4).double()
    temb = torch.nn.Embedding(6, 4).double()
    emb.load_state_dict({"weight": weight})
    with torch.no_grad():
        temb.weight.copy_(torch.tensor(weight))
    u = rng.standard_normal((2, 3, 4))
    (emb(dx.tensor(idx)) * dx.tensor(u)).sum().backward()
    (temb(torch.tensor(idx)) * torch.tensor(u)).sum().backward()
    np.testing.assert_allclose(emb.weight.grad.numpy(), temb.weight.grad.numpy(), rtol=1e-12)


def _block(lib, p, idx, n_head: int = 2):
    """A character-level transformer block: embedding, causal self-attention with softmax, layer norm, MLP with gelu,
    then logits and a cross-entropy loss on the next character."""
    F_ = _F(lib)
    B, T = idx.shape
    C = p["wte"].shape[1]
    x = F_.embedding(idx, p["wte"]) + p["wpe"][:T]
    h = F_.layer_norm(x, (C,), p["ln1_w"], p["ln1_b"])
    qkv = h @ p["w_qkv"] + p["b_qkv"]
    q, k, v = qkv[..., :C], qkv[..., C:2 * C], qkv[..., 2 * C:]
    q = q.reshape(B, T, n_head, C // n_head).transpose(1, 2)
    k = k.reshape(B, T, n_head, C // n_head).transpose(1, 2)
    v = v.reshape(B, T, n_head, C // n_head).transpose(1, 2)
    att = (q @ k.transpose(-2, -1)) * (1.0 / np.sqrt(C // n_head))
    causal = lib.tensor(np.tril(np.ones((T, T), dtype=bool)))
    att = att.masked_fill(~causal, float("-inf")).softmax(-1)
    y = (att @ v).transpose(1, 2).reshape(B, T, C)
    x = x + y @ p["w_o"]
    h = F_.layer_norm(x, (C,), p["ln2_w"], p["ln2_b"])
    x = x + F_.gelu(h @ p["w_fc"] + p["b_fc"]) @ p["w_proj"]
    logits = F_.layer_norm(x, (C,), p["lnf_w"], p["lnf_b"]) @ p["wte"].T  # tied weights
    return logits


def test_transformer_block_gradients_equal_torch(rng):
    V, C, T, B = 11, 8, 6, 3
    shapes = {"wte": (V, C), "wpe": (T, C), "ln1_w": (C,), "ln1_b": (C,), "w_qkv": (C, 3 * C), "b_qkv": (3 * C,),
              "w_o": (C, C), "ln2_w": (C,), "ln2_b": (C,), "w_fc": (C, 4 * C), "b_fc": (4 * C,),
              "w_proj": (4 * C, C), "lnf_w": (C,), "lnf_b": (C,)}
    arrays = {k: rng.standard_normal(s) * (0.3 if len(s) == 2 else 1.0) for k, s in shapes.items()}
    text = rng.integers(0, V, (B, T + 1))
    idx, target = text[:, :-1], text[:, 1:]
    p = {k: nn.Parameter(v) for k, v in arrays.items()}
    tp = {k: torch.tensor(v, requires_grad=True) for k, v in arrays.items()}
    logits = _block(dx, p, dx.tensor(idx))
    tlogits = _block(torch, tp, torch.tensor(idx))
    loss = F.cross_entropy(logits.reshape(B * T, V), dx.tensor(target.reshape(-1)))
    tloss = torch.nn.functional.cross_entropy(tlogits.reshape(B * T, V), torch.tensor(target.reshape(-1)))
    assert loss.item() == pytest.approx(tloss.item(), rel=1e-10)
    loss.backward()
    tloss.backward()
    for k in arrays:
        np.testing.assert_allclose(p[k].grad.numpy(), tp[k].grad.numpy(), rtol=1e-8, atol=1e-12, err_msg=k)


def test_in_place_writes_are_on_the_tape(rng):
    """x[...] = v, x.add_(), x.masked_fill_() on a tensor in the graph: backward sees the new values."""
    arrays = {"w": rng.standard_normal((4, 3)), "v": rng.standard_normal(3), "m": rng.standard_normal((4, 3)) > 0}

    def fn(lib, t):
        h = t["w"] * 2
        h[1:3] = t["v"]
        h.add_(t["w"], alpha=0.5)
        h.mul_(3.0)
        h.masked_fill_(t["m"], 0.25)
        z = lib.zeros((2, 3), dtype=lib.float64)
        z[0] = t["v"].exp()
        return h.sum(0) + z.sum(0)

    _grads_equal_torch(fn, arrays, "w v")


def test_an_in_place_write_over_a_value_the_backward_needs_is_an_error(rng):
    w = nn.Parameter(rng.standard_normal(3))
    h = w.exp()  # exp's gradient reads its result
    h.add_(1.0)
    with pytest.raises(DeepxError, match="overwrites"):
        h.sum().backward()


def test_a_value_filled_in_place_takes_no_gradient(rng):
    arrays = {"w": rng.standard_normal((3, 4))}

    def fn(lib, t):
        h = t["w"] * 3
        k = h * 1.0
        h.fill_(2.0)  # the old value of h ends here: only k carries w's gradient
        return h * t["w"] + k

    _grads_equal_torch(fn, arrays, "w")


# -- the graph a backward takes: only what reaches its loss (issue #4)
def test_backward_frees_only_its_own_graph():
    """torch: two independent graphs on one session, the second's backward first; neither frees the other."""
    a = dx.tensor(np.ones(3, np.float32), requires_grad=True)
    y = (a * 2).sum()
    w = dx.tensor(np.ones(3, np.float32), requires_grad=True)
    z = (w * 3).sum()
    z.backward()
    y.backward()
    np.testing.assert_array_equal(a.grad.numpy(), [2, 2, 2])
    np.testing.assert_array_equal(w.grad.numpy(), [3, 3, 3])
    with pytest.raises(DeepxError, match="freed by an earlier backward"):
        z.backward()


def test_a_backward_takes_no_leaf_of_another_graph():
    """A leaf that requires grad but does not reach the loss keeps grad None, as in torch."""
    a = nn.Parameter(np.ones(3))
    b = nn.Parameter(np.ones(3))
    left = (b * 5).sum()  # an unrelated graph left over (a notebook cell)
    (a.exp()).sum().backward()
    assert b.grad is None
    np.testing.assert_allclose(a.grad.numpy(), np.exp(np.ones(3)))
    left.backward()
    np.testing.assert_array_equal(b.grad.numpy(), [5, 5, 5])


def test_two_losses_sharing_a_prefix():
    """torch refuses the second backward through a freed node that saved tensors (here `w * x` saved x); deepx
    refuses any freed node on the path. With retain_graph on the first, both run and add up."""
    x = dx.tensor(np.arange(3.0))
    w = nn.Parameter(np.ones(3))
    h = w * x
    y1, y2 = h.sum(), (h * h).sum()
    y1.backward()
    with pytest.raises(DeepxError, match=r"freed by an earlier backward.*'mul'"):
        y2.backward()
    tw = torch.ones(3, dtype=torch.float64, requires_grad=True)
    th = tw * torch.arange(3.0, dtype=torch.float64)
    th.sum().backward()
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        (th * th).sum().backward()

    w.grad = None
    h = w * x
    y1, y2 = h.sum(), (h * h).sum()
    y1.backward(retain_graph=True)
    y2.backward()
    tw.grad = None
    th = tw * torch.arange(3.0, dtype=torch.float64)
    th.sum().backward(retain_graph=True)
    (th * th).sum().backward()
    np.testing.assert_allclose(w.grad.numpy(), tw.grad.numpy(), rtol=1e-12)


def test_a_later_in_place_write_outside_the_loss_graph_is_still_refused(rng):
    """A value the backward needs, overwritten after the loss was computed: refused as torch does."""
    w = nn.Parameter(rng.standard_normal(3))
    h = w.exp()
    loss = h.sum()
    h.add_(1.0)
    with pytest.raises(DeepxError, match="overwrites"):
        loss.backward()


def test_graphs_never_backwarded_do_not_pile_up():
    """Evaluation without no_grad: every step builds a graph that is never differentiated. Python drops each with
    its tensors, so the recorded nodes and the daemon's tensors stay bounded."""
    import gc

    from deepx_sdk.tape import Node

    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    x = dx.tensor(np.ones((4, 8), np.float32))

    def live_nodes():
        gc.collect()
        return sum(type(o) is Node for o in gc.get_objects())

    def daemon_tensors():
        dx.sync()
        return len(dx.session().transport.node.worker()._actor.ex.tensors.metas)

    for _ in range(5):
        model(x).sum().item()
    nodes, tensors = live_nodes(), daemon_tensors()
    for _ in range(200):
        model(x).sum().item()
    assert live_nodes() <= nodes
    assert daemon_tensors() <= tensors
    loss = model(x).sum()  # and a backward after all that takes only its own graph
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())


# -- a repeated training step's backward is derived once (issue #5)
def _scheduler():
    return dx.session().transport.node.ref("scheduler")._actor


def test_a_repeated_step_reuses_the_derived_backward(rng, monkeypatch):
    dx.connect()  # a fresh session: the name pool as a script's is, so that the steps repeat as a script's do
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    opt = SGD(model.parameters(), lr=0.1, momentum=0.9)
    x = dx.tensor(rng.standard_normal((5, 6)).astype(np.float32))
    y = dx.tensor(rng.integers(0, 3, 5))
    sched = _scheduler()

    def step(x, y):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        grads = [p.grad.numpy().copy() for p in model.parameters()]
        opt.step()
        return grads

    step(x, y)
    step(x, y)  # the pool hands the names out in two alternating orders (the last loss is alive at the next forward)
    hits, misses = sched.backward_hits, sched.backward_misses
    ran = []  # the plans run from the scheduler's cache
    hit = sched._hit

    def spy(key, plan, result):  # type: ignore[no-untyped-def]
        ran.append(plan)
        return hit(key, plan, result)

    monkeypatch.setattr(sched, "_hit", spy)
    # a backward the daemon derived before is recorded into the step's program, and expanded there from the
    # derived program it keeps
    transport = dx.session().transport
    sent = []
    run = transport.run
    monkeypatch.setattr(transport, "run", lambda program, fetch, backwards=(): sent.append(backwards) or run(
        program, fetch, backwards))
    got = step(x, y)
    assert (sched.backward_hits, sched.backward_misses) == (hits + 1, misses)
    assert [len(b) for b in sent][:2] == [1, 0]  # the backward went with the forward, the first gradient read back
    step(x, y)
    hits, ran[:] = sched.plan_hits, []
    step(x, y)  # the same program as two steps ago: its plan, the backward expanded in it, runs again
    assert sched.plan_hits >= hits + 1
    assert any(any(i.name == "matmul" for i in p.sent) and any(i.name == "crossentropygrad" for i in p.sent)
               for p in ran)
    # the same step from the same weights, derived afresh (the cache cleared): the same gradients, bitwise
    state = [p.detach().numpy().copy() for p in model.parameters()]
    for _ in range(3):
        step(x, y)
    for p, v in zip(model.parameters(), state):
        with dx.no_grad():
            p.copy_(dx.tensor(v))
    cached = step(x, y)
    for p, v in zip(model.parameters(), state):
        with dx.no_grad():
            p.copy_(dx.tensor(v))
    sched.backwards.clear()
    sched.plans.clear()
    fresh = step(x, y)
    assert sched.backward_misses == misses + 1
    for a, b in zip(cached, fresh):
        np.testing.assert_array_equal(a, b)
    assert len(got) == len(fresh)
    # a changed shape (batch 4) and a changed graph (another loss) derive again
    misses = sched.backward_misses
    step(x[:4], y[:4])
    assert sched.backward_misses == misses + 1
    opt.zero_grad()
    (model(x) ** 2).mean().backward()
    assert sched.backward_misses == misses + 2


def test_gradient_names_repeat_only_once_the_old_gradients_are_gone():
    w = nn.Parameter(np.ones(3))
    (w * 2).sum().backward()
    first = w.grad.name
    kept = w.grad
    w.grad = None
    (w * 2).sum().backward()
    assert w.grad.name != first  # the first gradient is still held: its names are not handed out again
    del kept
    w.grad = None
    dx.sync()
    (w * 2).sum().backward()
    assert w.grad.name == first
    np.testing.assert_array_equal(w.grad.numpy(), [2, 2, 2])


def test_backward_of_a_leaf_gives_ones_as_torch():
    w = nn.Parameter(np.array(3.0))
    w.backward()
    assert w.grad.item() == 1.0
    v = nn.Parameter(np.array([2.0]))
    v.backward()
    np.testing.assert_array_equal(v.grad.numpy(), [1.0])
    tv = torch.tensor([2.0], requires_grad=True)
    tv.backward()
    assert tv.grad.tolist() == [1.0]
