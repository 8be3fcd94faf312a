"""Activations, softmax, losses, norms and optimizer updates against torch (CPU, float64) on the same inputs."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from kernel_ref import T, V, assert_close, executor, f64, ordered, rand, run, run_op

from deepx_core.errors import DeepxError
from deepx_core.ir.dtypes import FLOATS, to_numpy
from deepx_core.ir.ops import OPS

FLOAT_DTYPES = ordered(FLOATS)
LOW = {"float16", "bfloat16"}


def tt(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(f64(a).copy())  # not ascontiguousarray: it makes a 0-d array 1-d


def tn(t: torch.Tensor) -> np.ndarray:
    return t.detach().numpy()


# ---------------------------------------------------------------- activations

ACTIVATIONS = {
    "relu": F.relu,
    "sigmoid": torch.sigmoid,
    "tanh": torch.tanh,
    "silu": F.silu,
    "erf": torch.erf,
}
SHAPES = [(), (0,), (1,), (3, 4), (2, 1, 5), (0, 3)]


def _act_input(rng, dtype, shape) -> np.ndarray:
    a = rand(rng, dtype, shape, -5, 5)
    if a.size >= 4 and dtype not in LOW:
        a.reshape(-1)[:4] = [-60.0, 60.0, -745.0, 30.0]  # far tails: no overflow, no nan
    return a


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("op", ACTIVATIONS)
def test_activation(op, dtype, rng):
    assert set(OPS[op].dtypes) == FLOATS
    for shape in SHAPES:
        a = _act_input(rng, dtype, shape)
        got = run_op(op, {"a": a}, [T("a", dtype)])
        assert_close(got, tn(ACTIVATIONS[op](tt(a))), dtype, what=f"{op} {shape}")


@pytest.mark.parametrize("approximate", ["none", "tanh", None])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_gelu(dtype, approximate, rng):
    for shape in SHAPES:
        a = _act_input(rng, dtype, shape)
        args = [T("a", dtype)] + ([V(approximate)] if approximate else [])
        got = run_op("gelu", {"a": a}, args)
        want = tn(F.gelu(tt(a), approximate=approximate or "none"))
        assert_close(got, want, dtype, what=f"gelu({approximate}) {shape}")


def test_gelu_refuses_unknown_approximation():
    with pytest.raises(DeepxError, match="approximate"):
        run_op("gelu", {"a": np.zeros(3)}, [T("a"), V("fast")])


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("op", ["relu", "sigmoid", "tanh", "silu", "gelu", "softmax", "logsoftmax"])
def test_activation_in_place(op, dtype, rng):
    a = rand(rng, dtype, (3, 5), -4, 4)
    ref = {"relu": F.relu, "sigmoid": torch.sigmoid, "tanh": torch.tanh, "silu": F.silu, "gelu": F.gelu,
           "softmax": lambda x: F.softmax(x, -1), "logsoftmax": lambda x: F.log_softmax(x, -1)}[op](tt(a))
    ex = executor(a=a.copy())
    run(ex, op, [T("a", dtype)], [T("a", dtype)])
    assert_close(ex.get("a"), tn(ref), dtype, what=f"{op} in place")


# ---------------------------------------------------------------- softmax, logsoftmax

SOFTMAX_CASES = [((3, 5), -1), ((3, 5), 0), ((2, 3, 4), 1), ((4,), 0), ((3, 0), -1), ((0, 3), 1), ((1, 1), -1),
                 ((2, 3, 4), -3), ((), 0)]


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("op", ["softmax", "logsoftmax"])
def test_softmax(op, dtype, rng):
    f = F.softmax if op == "softmax" else F.log_softmax
    for shape, dim in SOFTMAX_CASES:
        for offset in (0.0, 1000.0):  # stability: a large common offset changes nothing
            a = (rand(rng, dtype, shape, -4, 4).astype(np.float64) + offset).astype(to_numpy(dtype))
            got = run_op(op, {"a": a}, [T("a", dtype), V(dim)])
            assert_close(got, tn(f(tt(a), dim=dim)), dtype, what=f"{op} {shape} dim={dim} offset={offset}")
    a = rand(rng, dtype, (2, 6))
    got = run_op(op, {"a": a}, [T("a", dtype)])
    assert_close(got, tn(f(tt(a), dim=-1)), dtype, what=f"{op} default dim")


# ---------------------------------------------------------------- losses


def _ce_batches(rng, dtype, label_dtype):
    """(n, c, ignore_index, logits, labels): batches with an ignored label (out of range, or a class), one row, none."""
    for n, c, ignore in [(5, 4, -100), (8, 10, 2), (1, 3, -100), (4, 3, 1), (0, 3, -100)]:
        logits = rand(rng, dtype, (n, c), -4, 4)
        labels = rng.integers(0, c, n)
        if n >= 4:
            labels[1] = ignore
        yield n, c, ignore, logits, labels.astype(to_numpy(label_dtype))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("label_dtype", ["int64", "int32"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_crossentropy(dtype, label_dtype, reduction, rng):
    for n, c, ignore, logits, labels in _ce_batches(rng, dtype, label_dtype):
        args = [T("x", dtype), T("y", label_dtype), V(ignore), V(reduction)]
        got = run_op("crossentropy", {"x": logits, "y": labels}, args, out="loss")
        want = F.cross_entropy(tt(logits), torch.from_numpy(labels.astype(np.int64)), ignore_index=ignore,
                               reduction=reduction)
        assert_close(got, tn(want), dtype, what=f"crossentropy n={n} c={c} ignore={ignore} {reduction}")



@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("label_dtype", ["int64", "int32"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_crossentropygrad(dtype, label_dtype, reduction, rng):
    """crossentropy's gradient (what autograd emits for the CPU) against torch autograd, for an upstream gradient g;
    ignored rows (ignore_index out of range, or a class) get zeros."""
    for n, c, ignore, logits, labels in _ce_batches(rng, dtype, label_dtype):
        g = rand(rng, dtype, (n,) if reduction == "none" else (), 0.5, 2)
        args = [T("x", dtype), T("y", label_dtype), T("g", dtype), V(ignore), V(reduction)]
        got = run_op("crossentropygrad", {"x": logits, "y": labels, "g": g}, args, out="d")
        x = tt(logits).requires_grad_(True)
        loss = F.cross_entropy(x, torch.from_numpy(labels.astype(np.int64)), ignore_index=ignore, reduction=reduction)
        (want,) = torch.autograd.grad(loss, x, tt(g)) if n else (torch.zeros(n, c, dtype=torch.float64),)
        assert got.shape == (n, c) and got.dtype == to_numpy(dtype)
        assert_close(got, tn(want), dtype, what=f"crossentropygrad n={n} c={c} ignore={ignore} {reduction}")


CHAIN = """
newtensor (vector<int32>:[1 {c}]) -> (tensor<int64>:classes)
arange (var<int32>:0, var<int32>:1) -> (tensor<int64>:classes)
reshape (tensor<int64>:y, vector<int32>:[{n} 1]) -> (tensor<int64>:col)
equal (tensor<int64>:col, tensor<int64>:classes) -> (tensor<bool>:hit)
todtype (tensor<bool>:hit) -> (tensor<{dt}>:onehot)
notequalscalar (tensor<int64>:y, var<int32>:{ignore}) -> (tensor<bool>:kept)
todtype (tensor<bool>:kept) -> (tensor<{dt}>:keepf)
reshape (tensor<{dt}>:keepf, vector<int32>:[{n} 1]) -> (tensor<{dt}>:keep)
softmax (tensor<{dt}>:x, var<int32>:1) -> (tensor<{dt}>:p)
{scale}
fused (listtensor<{dt}>:[p onehot keep scale], var<string>:(in0 - in1) * in2 * in3) -> (tensor<{dt}>:d)
"""
SCALES = {
    "mean": "sum (tensor<{dt}>:keep, vector<int32>:[], var<bool>:false) -> (tensor<{dt}>:count)\n"
            "div (tensor<{dt}>:g, tensor<{dt}>:count) -> (tensor<{dt}>:scale)",
    "sum": "copytensor (tensor<{dt}>:g) -> (tensor<{dt}>:scale)",
    "none": "reshape (tensor<{dt}>:g, vector<int32>:[{n} 1]) -> (tensor<{dt}>:scale)",
}


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_crossentropygrad_gives_the_bits_of_the_chain_it_replaces(dtype, reduction, rng):
    """autograd's crossentropy rule was a chain of catalogue ops (softmax, the one-hot from equal and arange, the
    kept rows' mask and count, a fused product); crossentropygrad gives its bits, NaN and inf included."""
    from deepx_core.ir.text import parse_text

    n, c, ignore = 9, 6, 2
    logits = rand(rng, dtype, (n, c), -6, 6)
    logits[2, 3] = np.inf
    logits[4] = -np.inf
    labels = rng.integers(0, c, n).astype(np.int64)
    labels[[1, 5]] = ignore  # ignore_index is a class here
    g = rand(rng, dtype, (n,) if reduction == "none" else (), 0.5, 2)
    ex = executor(x=logits, y=labels, g=g)
    text = CHAIN.format(c=c, n=n, dt=dtype, ignore=ignore, scale=SCALES[reduction].format(dt=dtype, n=n))
    ex.run_all(parse_text(text.strip()))
    got = run_op("crossentropygrad", {"x": logits, "y": labels, "g": g},
                 [T("x", dtype), T("y", "int64"), T("g", dtype), V(ignore), V(reduction)], out="d")
    assert got.tobytes() == ex.get("d").tobytes()


def test_crossentropy_all_ignored_mean_is_nan():
    logits = np.zeros((2, 3), np.float32)
    labels = np.array([-100, -100], np.int64)
    got = run_op("crossentropy", {"x": logits, "y": labels}, [T("x"), T("y")], out="loss")
    assert got.shape == () and np.isnan(got)
    # its gradient is zeros, as torch's (a batch whose labels are all ignored moves nothing)
    grad = run_op("crossentropygrad", {"x": logits, "y": labels, "g": np.ones((), np.float32)},
                  [T("x"), T("y"), T("g")], out="d")
    assert grad.shape == (2, 3) and not grad.any() and not np.isnan(grad).any()


def test_crossentropy_defaults_and_bad_label(rng):
    logits = rand(rng, "float32", (6, 5))
    labels = np.array([0, 4, -100, 2, 3, 1], np.int64)
    got = run_op("crossentropy", {"x": logits, "y": labels}, [T("x"), T("y")], out="loss")
    assert_close(got, tn(F.cross_entropy(tt(logits), torch.from_numpy(labels))), "float32")
    labels[0] = 5
    with pytest.raises(DeepxError, match="out of range"):
        run_op("crossentropy", {"x": logits, "y": labels}, [T("x"), T("y")], out="loss")


@pytest.mark.parametrize("reduction", ["mean", "sum", "none", None])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_mse(dtype, reduction, rng):
    for shape in [(3, 4), (), (0,), (2, 1, 3), (1,)]:
        a, b = rand(rng, dtype, shape), rand(rng, dtype, shape)
        args = [T("a", dtype), T("b", dtype)] + ([V(reduction)] if reduction else [])
        got = run_op("mse", {"a": a, "b": b}, args, out="loss")
        want = F.mse_loss(tt(a), tt(b), reduction=reduction or "mean")
        scale = None if reduction == "none" else np.sum((f64(a) - f64(b)) ** 2) / (a.size if reduction != "sum" else 1)
        assert_close(got, tn(want), dtype, scale=scale, what=f"mse {shape} {reduction}")


# ---------------------------------------------------------------- norms

NORM_CASES = [((4, 6), (6,)), ((2, 3, 4), (3, 4)), ((5,), (5,)), ((0, 4), (4,)), ((3, 1), (1,)), ((2, 2, 3), (3,))]


@pytest.mark.parametrize("eps", [None, 1e-3])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_layernorm(dtype, eps, rng):
    for xs, ws in NORM_CASES:
        x = rand(rng, dtype, xs, -3, 5)
        w = rand(rng, dtype, ws, 0.5, 1.5)
        b = rand(rng, dtype, ws, -1, 1)
        args = [T("x", dtype), T("w", dtype), T("b", dtype)] + ([V(eps)] if eps else [])
        got = run_op("layernorm", {"x": x, "w": w, "b": b}, args)
        want = F.layer_norm(tt(x), ws, tt(w), tt(b), eps=eps or 1e-5)
        assert_close(got, tn(want), dtype, what=f"layernorm {xs} over {ws} eps={eps}")


@pytest.mark.parametrize("eps", [None, 1e-3])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_rmsnorm(dtype, eps, rng):
    for xs, ws in NORM_CASES:
        x = rand(rng, dtype, xs, -3, 5)
        w = rand(rng, dtype, ws, 0.5, 1.5)
        args = [T("x", dtype), T("w", dtype)] + ([V(eps)] if eps else [])
        got = run_op("rmsnorm", {"x": x, "w": w}, args)
        want = F.rms_norm(tt(x), ws, tt(w), eps=eps or 1e-6)
        assert_close(got, tn(want), dtype, what=f"rmsnorm {xs} over {ws} eps={eps}")


@pytest.mark.parametrize("op", ["layernormgrad", "rmsnormgrad"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_norm_gradients(op, dtype, rng):
    """layernormgrad / rmsnormgrad against torch's autograd of layer_norm / rms_norm (float64): dA, and the
    normalised A whose product with G sums to weight's gradient."""
    eps = 1e-5
    for xs, ws in NORM_CASES:
        x, w, g = rand(rng, dtype, xs, -3, 5), rand(rng, dtype, ws, 0.5, 1.5), rand(rng, dtype, xs, -1, 1)
        ex = executor(x=x, w=w, g=g)
        run(ex, op, [T("x", dtype), T("w", dtype), T("g", dtype), V(eps)], [T("da", dtype), T("xn", dtype)])
        tx, tw = tt(x).double().requires_grad_(), tt(w).double().requires_grad_()
        y = (F.layer_norm(tx, ws, tw, None, eps) if op == "layernormgrad" else F.rms_norm(tx, ws, tw, eps))
        y.backward(tt(g).double())
        what = f"{op} {xs} over {ws}"
        assert_close(ex.get("da"), tn(tx.grad), dtype, scale=np.abs(tn(tx.grad)).max(initial=1.0), what=what)
        lead = tuple(range(len(xs) - len(ws)))
        dw = (tt(g).double() * tt(ex.get("xn")).double()).sum(lead) if lead else tt(g).double() * tt(ex.get("xn"))
        assert_close(tn(dw).astype(to_numpy(dtype)), tn(tw.grad), dtype, scale=np.abs(tn(tw.grad)).max(initial=1.0),
                     what=what + " weight")


def test_norm_gradients_refuse_a_gradient_of_another_shape():
    with pytest.raises(DeepxError, match="layernormgrad: the gradient 'g'"):
        ex = executor(x=np.zeros((2, 3)), w=np.ones(3), g=np.zeros((3, 3)))
        run(ex, "layernormgrad", [T("x"), T("w"), T("g")], [T("da"), T("xn")])


def test_norm_weight_must_match_trailing_dims():
    with pytest.raises(DeepxError, match="last dims"):
        run_op("rmsnorm", {"x": np.zeros((2, 3)), "w": np.ones(2)}, [T("x"), T("w")])


# ---------------------------------------------------------------- optimizer updates

# (op, deepx params, torch kwargs); None = leave the op's defaults
OPTIM_CASES = [
    ("sgd", {}, {"lr": 0.1}),
    ("sgd", {"momentum": 0.9}, {"lr": 0.1, "momentum": 0.9}),
    ("sgd", {"momentum": 0.9, "dampening": 0.1, "weight_decay": 0.01},
     {"lr": 0.05, "momentum": 0.9, "dampening": 0.1, "weight_decay": 0.01}),
    ("sgd", {"momentum": 0.8, "weight_decay": 0.1, "nesterov": True},
     {"lr": 0.05, "momentum": 0.8, "weight_decay": 0.1, "nesterov": True}),
    ("adam", {}, {"lr": 0.01}),
    ("adam", {"beta1": 0.8, "beta2": 0.99, "eps": 1e-6, "weight_decay": 0.1},
     {"lr": 0.01, "betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": 0.1}),
    ("adamw", {}, {"lr": 0.01}),
    ("adamw", {"beta1": 0.8, "beta2": 0.99, "eps": 1e-6, "weight_decay": 0.1},
     {"lr": 0.01, "betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": 0.1}),
]
STATE = {"sgd": ["momentum_buffer"], "adam": ["exp_avg", "exp_avg_sq"], "adamw": ["exp_avg", "exp_avg_sq"]}
TORCH = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}


def _optim_instr_args(op: str, dx: dict, lr: float, step: int) -> list:
    names = [a.name for a in OPS[op].args]
    args = [T("p"), T("g")] + [T(s) for s in STATE[op]] + [V(lr)]
    # every optional var up to and including step, taking the op's default where the case does not set it
    for a in OPS[op].args[names.index("lr") + 1:]:
        value = step if a.name == "step" else dx.get(a.name, a.default)
        args.append(V(value))
    return args


def _torch_state(op: str, ex, step: int) -> dict:
    if op == "sgd":
        return {"momentum_buffer": tt(ex.get("momentum_buffer"))} if step > 1 else {}
    return {"step": torch.tensor(float(step - 1)), "exp_avg": tt(ex.get("exp_avg")),
            "exp_avg_sq": tt(ex.get("exp_avg_sq"))}


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("case", range(len(OPTIM_CASES)),
                         ids=[f"{c[0]}-{'-'.join(c[1]) or 'defaults'}" for c in OPTIM_CASES])
def test_optimizer_steps(case, dtype, rng):
    """Three steps (step=1, 2, 3) against torch.optim (foreach=False) in float64, comparing param and state.

    float64/float32: one torch optimizer runs alongside for all three steps. float16/bfloat16: the kernel stores
    rounded state, so each step's reference starts from the kernel's own rounded param and state.
    """
    op, dx, kw = OPTIM_CASES[case]
    shape = (4, 3)
    param = rand(rng, dtype, shape, -1, 1)
    state = {s: np.zeros(shape, to_numpy(dtype)) for s in STATE[op]}
    ex = executor(p=param.copy(), **state)
    tp = torch.nn.Parameter(tt(param))
    opt = TORCH[op]([tp], foreach=False, **kw)
    continuous = dtype not in LOW
    for step in (1, 2, 3):
        grad = rand(rng, dtype, shape, -1, 1)
        ex.put("g", grad)
        if not continuous:
            tp = torch.nn.Parameter(tt(ex.get("p")))
            opt = TORCH[op]([tp], foreach=False, **kw)
            opt.state[tp] = _torch_state(op, ex, step)
        tp.grad = tt(grad)
        opt.step()
        returns = [T("p")] + [T(s) for s in STATE[op]]
        run(ex, op, _optim_instr_args(op, dx, kw["lr"], step), returns)
        assert_close(ex.get("p"), tn(tp), dtype, what=f"{op} {dx} param after step {step}")
        for s in STATE[op]:
            if s in opt.state[tp]:
                assert_close(ex.get(s), tn(opt.state[tp][s]), dtype, what=f"{op} {dx} {s} after step {step}")


@pytest.mark.parametrize("op", ["sgd", "adam", "adamw"])
def test_optimizer_updates_in_place_only(op):
    z = np.zeros(3, np.float32)
    ex = executor(p=z, g=z, **{s: z for s in STATE[op]})
    returns = [T("q")] + [T(s) for s in STATE[op]]
    with pytest.raises(DeepxError, match="in place"):
        run(ex, op, [T("p"), T("g")] + [T(s) for s in STATE[op]] + [V(0.1)], returns)


def test_sgd_first_step_takes_the_gradient_as_buffer(rng):
    p, g = rand(rng, "float64", (5,)), rand(rng, "float64", (5,))
    buf = np.full(5, 123.0)  # whatever the buffer holds, step 1 starts it from the gradient
    ex = executor(p=p.copy(), g=g, b=buf)
    run(ex, "sgd", [T("p"), T("g"), T("b"), V(0.1), V(0.9), V(0.5), V(0.0), V(False), V(1)], [T("p"), T("b")])
    assert_close(ex.get("b"), g, "float64")
    assert_close(ex.get("p"), p - 0.1 * g, "float64")
