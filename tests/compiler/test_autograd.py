"""autograd as an IR rewrite: forward + generated backward on a CpuExecutor, against torch autograd (float64)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np
import pytest
import torch

from deepx_core.errors import DeepxError
from deepxd.compiler import DEFAULT_PASSES, PassContext, run_passes
from deepxd.compiler.autograd import grad_program, grad_rule
from tests.compiler.helpers import executor, program

F = "float64"


def check(text: str, inputs: Mapping[str, np.ndarray], loss: str, wrt: list[str],
          torch_fn: Callable[[dict[str, torch.Tensor]], torch.Tensor], *, before: bool = True,
          grad_loss: np.ndarray | None = None, passes: Sequence[str] = ()) -> list:
    """Run the forward program, then its backward (after `passes`, as the scheduler runs them); compare every
    gradient with torch's. `before`: build the backward against the tensors before the forward ran (else after).
    Returns the backward as it ran."""
    fwd = program(text)
    ex = executor(inputs)
    if grad_loss is not None:
        ex.put("upstream", grad_loss)
    if not before:
        ex.run_all(fwd)
    back, names = grad_program(fwd, loss, wrt, ex, grad_loss="upstream" if grad_loss is not None else None)
    if before:
        ex.run_all(fwd)
    existing = set(ex.tensors)
    back = run_passes(back, PassContext(metas=dict(ex.tensors.metas), fetch=frozenset(names.values())), passes)
    ex.run_all(back)
    # only the gradients are left behind
    assert set(ex.tensors) - existing == set(names.values())
    assert all(n.startswith("g_") for n in names.values())
    tt = {k: torch.tensor(v, requires_grad=k in wrt) for k, v in inputs.items()}
    out = torch_fn(tt)
    np.testing.assert_allclose(ex.get(loss), out.detach().numpy(), rtol=1e-10, atol=1e-12)
    if grad_loss is None:
        out.backward()
    else:
        out.backward(torch.tensor(grad_loss))
    for w in wrt:
        want = tt[w].grad
        want = np.zeros(inputs[w].shape) if want is None else want.numpy()
        got = ex.get(names[w])
        assert got.shape == inputs[w].shape and got.dtype == inputs[w].dtype, w
        np.testing.assert_allclose(got, want, rtol=1e-8, atol=1e-12, err_msg=w)
    return back


def rnd(rng: np.random.Generator, *shape: int, lo: float = -1.0, hi: float = 1.0) -> np.ndarray:
    return rng.uniform(lo, hi, shape).astype(F)


@pytest.mark.parametrize("before", [True, False])
def test_mlp_layer(rng, before):
    inputs = {"x": rnd(rng, 4, 3), "w": rnd(rng, 3, 5), "b": rnd(rng, 5)}
    back = check("""
        matmul (tensor<float64>:x, tensor<float64>:w) -> (tensor<float64>:h)
        add (tensor<float64>:h, tensor<float64>:b) -> (tensor<float64>:z)
        relu (tensor<float64>:z) -> (tensor<float64>:r)
        sum (tensor<float64>:r, vector<int32>:[], var<bool>:false) -> (tensor<float64>:loss)
    """, inputs, "loss", ["x", "w", "b"], lambda t: torch.relu(t["x"] @ t["w"] + t["b"]).sum(), before=before)
    assert any(i.name == "deltensor" for i in back)


def test_two_layer_mlp_with_crossentropy(rng):
    inputs = {"x": rnd(rng, 6, 4), "w1": rnd(rng, 4, 8), "b1": rnd(rng, 8), "w2": rnd(rng, 8, 3),
              "b2": rnd(rng, 3), "y": np.array([0, 2, 1, 1, 0, 2], dtype=np.int64)}
    check("""
        matmul (tensor<float64>:x, tensor<float64>:w1) -> (tensor<float64>:h)
        add (tensor<float64>:h, tensor<float64>:b1) -> (tensor<float64>:h1)
        maxscalar (tensor<float64>:h1, var<float64>:0.0) -> (tensor<float64>:a)
        matmul (tensor<float64>:a, tensor<float64>:w2) -> (tensor<float64>:o)
        add (tensor<float64>:o, tensor<float64>:b2) -> (tensor<float64>:logits)
        crossentropy (tensor<float64>:logits, tensor<int64>:y) -> (tensor<float64>:loss)
    """, inputs, "loss", ["w1", "b1", "w2", "b2"],
        lambda t: torch.nn.functional.cross_entropy(
            torch.relu(t["x"] @ t["w1"] + t["b1"]).clamp_min(0) @ t["w2"] + t["b2"], t["y"]))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_crossentropy_with_ignore_index(rng, reduction):
    inputs = {"z": rnd(rng, 5, 4, lo=-3, hi=3), "y": np.array([3, -1, 0, 2, -1], dtype=np.int32)}
    text = f"""
        crossentropy (tensor<float64>:z, tensor<int32>:y, var<int32>:-1, var<string>:{reduction})
            -> (tensor<float64>:loss)
    """
    if reduction == "none":
        check(text.replace("\n            ->", " ->"), inputs, "loss", ["z"],
              lambda t: torch.nn.functional.cross_entropy(t["z"], t["y"].long(), ignore_index=-1, reduction="none"),
              grad_loss=rnd(rng, 5))
    else:
        check(text.replace("\n            ->", " ->"), inputs, "loss", ["z"],
              lambda t: torch.nn.functional.cross_entropy(t["z"], t["y"].long(), ignore_index=-1,
                                                          reduction=reduction))


def test_softmax_and_logsoftmax(rng):
    inputs = {"a": rnd(rng, 3, 4), "c": rnd(rng, 3, 4)}
    check("""
        softmax (tensor<float64>:a, var<int32>:0) -> (tensor<float64>:s)
        logsoftmax (tensor<float64>:a, var<int32>:-1) -> (tensor<float64>:l)
        mul (tensor<float64>:s, tensor<float64>:c) -> (tensor<float64>:p)
        mul (tensor<float64>:l, tensor<float64>:c) -> (tensor<float64>:q)
        add (tensor<float64>:p, tensor<float64>:q) -> (tensor<float64>:r)
        sum (tensor<float64>:r, vector<int32>:[0 1], var<bool>:false) -> (tensor<float64>:loss)
    """, inputs, "loss", ["a", "c"],
        lambda t: (torch.softmax(t["a"], 0) * t["c"] + torch.log_softmax(t["a"], -1) * t["c"]).sum())


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_mse(rng, reduction):
    inputs = {"p": rnd(rng, 4, 3), "q": rnd(rng, 4, 3)}
    check(f"mse (tensor<float64>:p, tensor<float64>:q, var<string>:{reduction}) -> (tensor<float64>:loss)",
          inputs, "loss", ["p", "q"],
          lambda t: torch.nn.functional.mse_loss(t["p"], t["q"], reduction=reduction))


def test_mse_none_with_upstream_gradient(rng):
    inputs = {"p": rnd(rng, 2, 3), "q": rnd(rng, 2, 3)}
    check("mse (tensor<float64>:p, tensor<float64>:q, var<string>:none) -> (tensor<float64>:loss)",
          inputs, "loss", ["p"], lambda t: torch.nn.functional.mse_loss(t["p"], t["q"], reduction="none"),
          grad_loss=rnd(rng, 2, 3))


def test_elementwise_chain_with_scalars(rng):
    inputs = {"x": rnd(rng, 3, 4, lo=0.5, hi=2.0), "y": rnd(rng, 3, 4, lo=0.5, hi=2.0)}
    check("""
        mulscalar (tensor<float64>:x, var<float64>:3.0) -> (tensor<float64>:a)
        addscalar (tensor<float64>:a, var<float64>:1.5) -> (tensor<float64>:b)
        subscalar (tensor<float64>:b, var<float64>:0.25) -> (tensor<float64>:c)
        divscalar (tensor<float64>:c, var<float64>:2.0) -> (tensor<float64>:d)
        rsubscalar (var<float64>:5.0, tensor<float64>:d) -> (tensor<float64>:e)
        rdivscalar (var<float64>:2.0, tensor<float64>:y) -> (tensor<float64>:f)
        mul (tensor<float64>:e, tensor<float64>:f) -> (tensor<float64>:g)
        powscalar (tensor<float64>:x, var<float64>:2.5) -> (tensor<float64>:h)
        div (tensor<float64>:g, tensor<float64>:h) -> (tensor<float64>:i)
        sqrt (tensor<float64>:y) -> (tensor<float64>:j)
        exp (tensor<float64>:j) -> (tensor<float64>:k)
        log (tensor<float64>:k) -> (tensor<float64>:l)
        sub (tensor<float64>:i, tensor<float64>:l) -> (tensor<float64>:m)
        neg (tensor<float64>:m) -> (tensor<float64>:n)
        sigmoid (tensor<float64>:n) -> (tensor<float64>:o)
        tanh (tensor<float64>:o) -> (tensor<float64>:p)
        sum (tensor<float64>:p, vector<int32>:[], var<bool>:false) -> (tensor<float64>:loss)
    """, inputs, "loss", ["x", "y"], lambda t: torch.tanh(torch.sigmoid(-(
        (5.0 - ((t["x"] * 3 + 1.5 - 0.25) / 2)) * (2.0 / t["y"]) / t["x"] ** 2.5
        - torch.log(torch.exp(torch.sqrt(t["y"])))))).sum())


def test_more_unary_ops_and_pow(rng):
    inputs = {"x": rnd(rng, 5, lo=0.5, hi=1.5), "y": rnd(rng, 5, lo=-1, hi=1)}
    check("""
        pow (tensor<float64>:x, tensor<float64>:y) -> (tensor<float64>:a)
        sin (tensor<float64>:a) -> (tensor<float64>:b)
        cos (tensor<float64>:y) -> (tensor<float64>:c)
        tan (tensor<float64>:c) -> (tensor<float64>:d)
        silu (tensor<float64>:y) -> (tensor<float64>:e)
        abs (tensor<float64>:e) -> (tensor<float64>:f)
        max (tensor<float64>:b, tensor<float64>:d) -> (tensor<float64>:h)
        minscalar (tensor<float64>:f, var<float64>:0.1) -> (tensor<float64>:i)
        mul (tensor<float64>:h, tensor<float64>:i) -> (tensor<float64>:j)
        sum (tensor<float64>:j, vector<int32>:[0], var<bool>:false) -> (tensor<float64>:loss)
    """, inputs, "loss", ["x", "y"], lambda t: (
        torch.maximum(torch.sin(t["x"] ** t["y"]), torch.tan(torch.cos(t["y"])))
        * torch.nn.functional.silu(t["y"]).abs().clamp_max(0.1)).sum())


def test_a_tensor_used_twice_accumulates(rng):
    inputs = {"x": rnd(rng, 3, 3)}
    check("""
        mul (tensor<float64>:x, tensor<float64>:x) -> (tensor<float64>:a)
        matmul (tensor<float64>:a, tensor<float64>:x) -> (tensor<float64>:b)
        add (tensor<float64>:b, tensor<float64>:x) -> (tensor<float64>:c)
        sum (tensor<float64>:c, vector<int32>:[], var<bool>:false) -> (tensor<float64>:loss)
    """, inputs, "loss", ["x"], lambda t: ((t["x"] * t["x"]) @ t["x"] + t["x"]).sum())


def test_broadcasting_and_shape_ops(rng):
    inputs = {"a": rnd(rng, 2, 3, 4), "b": rnd(rng, 3, 1), "c": rnd(rng, 4), "s": rnd(rng, 1, 1)}
    check("""
        mul (tensor<float64>:a, tensor<float64>:b) -> (tensor<float64>:p)
        sub (tensor<float64>:p, tensor<float64>:c) -> (tensor<float64>:q)
        div (tensor<float64>:q, tensor<float64>:s) -> (tensor<float64>:q2)
        transpose (tensor<float64>:q2, vector<int32>:[2 0 1]) -> (tensor<float64>:r)
        reshape (tensor<float64>:r, vector<int32>:[4 6]) -> (tensor<float64>:u)
        sum (tensor<float64>:u, vector<int32>:[1], var<bool>:true) -> (tensor<float64>:v)
        broadcastTo (tensor<float64>:v, vector<int32>:[2 4 3]) -> (tensor<float64>:w)
        mul (tensor<float64>:w, tensor<float64>:w) -> (tensor<float64>:x)
        sum (tensor<float64>:x, vector<int32>:[-1], var<bool>:false) -> (tensor<float64>:y)
        sum (tensor<float64>:y, vector<int32>:[], var<bool>:false) -> (tensor<float64>:loss)
    """, inputs, "loss", ["a", "b", "c", "s"], lambda t: (
        ((t["a"] * t["b"] - t["c"]) / t["s"]).permute(2, 0, 1).reshape(4, 6).sum(1, keepdim=True)
        .broadcast_to(2, 4, 3) ** 2).sum(-1).sum())


def test_batched_matmul_todtype_copy_and_indexselect(rng):
    inputs = {"a": rnd(rng, 2, 3, 4), "w": rnd(rng, 4, 2), "e": rnd(rng, 5, 3).astype(np.float32),
              "i": np.array([4, 0, 4], dtype=np.int64)}
    check("""
        matmul (tensor<float64>:a, tensor<float64>:w) -> (tensor<float64>:h)
        indexselect (tensor<float32>:e, tensor<int64>:i, var<int32>:0) -> (tensor<float32>:sel)
        todtype (tensor<float32>:sel) -> (tensor<float64>:sel64)
        matmul (tensor<float64>:sel64, tensor<float64>:h) -> (tensor<float64>:k)
        copytensor (tensor<float64>:k) -> (tensor<float64>:k2)
        sum (tensor<float64>:k2, vector<int32>:[], var<bool>:false) -> (tensor<float64>:loss)
    """, inputs, "loss", ["a", "w", "e"],
        lambda t: (t["e"][t["i"]].double() @ (t["a"] @ t["w"])).sum())


def test_unrelated_instructions_are_skipped_and_unreached_wrt_gets_zeros(rng):
    inputs = {"x": rnd(rng, 3), "z": rnd(rng, 3), "u": rnd(rng, 3)}
    back = check("""
        exp (tensor<float64>:x) -> (tensor<float64>:a)
        argmax (tensor<float64>:z, var<int32>:0) -> (tensor<int64>:k)
        prod (tensor<float64>:z, vector<int32>:[], var<bool>:false) -> (tensor<float64>:pz)
        sum (tensor<float64>:a, vector<int32>:[], var<bool>:false) -> (tensor<float64>:s)
        add (tensor<float64>:s, tensor<float64>:pz) -> (tensor<float64>:loss)
    """, inputs, "loss", ["x", "u"], lambda t: t["x"].exp().sum() + t["z"].prod())
    assert not any(i.name in ("prod", "argmax") for i in back)


def test_op_without_rule_on_the_path_is_an_error(rng):
    fwd = program("""
        sgd (tensor<float64>:p, tensor<float64>:x, tensor<float64>:m, var<float64>:0.1) -> (tensor<float64>:p, m)
        sum (tensor<float64>:p, vector<int32>:[], var<bool>:false) -> (tensor<float64>:loss)
    """)
    ex = executor({"x": rnd(rng, 3), "p": rnd(rng, 3), "m": rnd(rng, 3)})
    with pytest.raises(DeepxError, match="'sgd' has no gradient rule"):
        grad_program(fwd, "loss", ["x"], ex)


def test_overwritten_value_needed_by_a_rule_is_an_error(rng):
    fwd = program("""
        mul (tensor<float64>:x, tensor<float64>:y) -> (tensor<float64>:a)
        addscalar (tensor<float64>:y, var<float64>:1.0) -> (tensor<float64>:y)
        sum (tensor<float64>:a, vector<int32>:[], var<bool>:false) -> (tensor<float64>:loss)
    """)
    ex = executor({"x": rnd(rng, 3), "y": rnd(rng, 3)})
    with pytest.raises(DeepxError, match="overwrites"):
        grad_program(fwd, "loss", ["x"], ex)


def test_non_scalar_loss_needs_grad_loss(rng):
    fwd = program("exp (tensor<float64>:x) -> (tensor<float64>:loss)")
    with pytest.raises(DeepxError, match="grad_loss"):
        grad_program(fwd, "loss", ["x"], executor({"x": rnd(rng, 3)}))


def test_rules_cover_the_brief():
    want = ("add sub mul div addscalar subscalar mulscalar divscalar rsubscalar rdivscalar neg exp log sqrt "
            "powscalar maxscalar relu sigmoid tanh matmul sum reshape transpose broadcastTo todtype softmax "
            "logsoftmax crossentropy mse copytensor").split()
    assert all(grad_rule(n) is not None for n in want)


def _made_by(back: list, op: str) -> dict[str, object]:
    return {str(i.returns[0].value): i for i in back if i.name == op}


LINEAR = """
    transpose (tensor<float64>:W, vector<int32>:[1 0]) -> (tensor<float64>:Wt)
    matmul (tensor<float64>:x, tensor<float64>:Wt) -> (tensor<float64>:y)
    add (tensor<float64>:y, tensor<float64>:b) -> (tensor<float64>:z)
    tanh (tensor<float64>:z) -> (tensor<float64>:t)
    sum (tensor<float64>:t, vector<int32>:[], var<bool>:false) -> (tensor<float64>:loss)
"""


def _linear(t: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.tanh(t["x"] @ t["W"].T + t["b"]).sum()


def test_linear_weight_gradient_is_one_product_without_transposing_it(rng):
    """y = x @ W^T (torch's Linear): the rules give dW = transpose(transpose(x) @ g), which the transpose_products
    pass rewrites to transpose(g) @ x (the transpose of g is a temporary: fold_transpose folds it into the product),
    and dx = g @ W reads W itself."""
    inputs = {"x": rnd(rng, 4, 6), "W": rnd(rng, 3, 6), "b": rnd(rng, 3)}
    raw = check(LINEAR, inputs, "loss", ["x", "W", "b"], _linear)
    assert len(_made_by(raw, "transpose")) == 2  # x^T, and the product's: what the rules emit
    back = check(LINEAR, inputs, "loss", ["x", "W", "b"], _linear, passes=["transpose_products"])
    products = _made_by(back, "matmul")
    transposes = _made_by(back, "transpose")
    assert len(products) == 2 and len(transposes) == 1
    assert not any(str(i.args[0].value) in products for i in transposes.values())  # no product is transposed
    (t,) = transposes.values()
    assert str(t.args[0].value) not in ("x", "W", "Wt")  # the one transpose is of the upstream gradient
    reads = {tuple(str(p.value) for p in i.args) for i in products.values()}
    assert (next(iter(transposes)), "x") in reads  # dW = g^T @ x
    assert any(r[1] == "W" for r in reads)  # dx = g @ W, not g @ transpose(Wt)
    # db: one sum over the batch dim straight to b's shape (no keepdims and reshape)
    sums = [i for i in back if i.name == "sum"]
    assert len(sums) == 1 and sums[0].args[1].value == (0,) and sums[0].args[2].value is False
    db = str(sums[0].returns[0].value)
    assert not any(i.name == "reshape" and str(i.args[0].value) == db for i in back)
    # the default pipeline: no transpose left; the weight gradient is one product reading g transposed
    folded = check(LINEAR, inputs, "loss", ["x", "W", "b"], _linear, passes=DEFAULT_PASSES)
    assert not _made_by(folded, "transpose") and len(_made_by(folded, "matmultransposed")) == 1


@pytest.mark.parametrize("shapes", [((2, 5, 4), (2, 3, 4)), ((5, 4), (3, 4))])
def test_transposed_products_in_batches_and_chains_keep_their_values(rng, shapes):
    """transpose(A @ B) -> B^T @ A^T over the last two dims, with a batch dim too, and through two layers."""
    xs, ws = shapes
    inputs = {"x": rnd(rng, *xs), "W": rnd(rng, *ws), "V": rnd(rng, *ws[:-2], 3, 3)}
    r = len(xs)
    perm = " ".join(map(str, [*range(r - 2), r - 1, r - 2]))
    text = f"""
        transpose (tensor<float64>:W, vector<int32>:[{perm}]) -> (tensor<float64>:Wt)
        matmul (tensor<float64>:x, tensor<float64>:Wt) -> (tensor<float64>:h)
        transpose (tensor<float64>:V, vector<int32>:[{perm}]) -> (tensor<float64>:Vt)
        matmul (tensor<float64>:h, tensor<float64>:Vt) -> (tensor<float64>:y)
        mul (tensor<float64>:y, tensor<float64>:y) -> (tensor<float64>:y2)
        sum (tensor<float64>:y2, vector<int32>:[], var<bool>:false) -> (tensor<float64>:loss)
    """

    def torch_fn(t: dict[str, torch.Tensor]) -> torch.Tensor:
        return ((t["x"] @ t["W"].transpose(-1, -2)) @ t["V"].transpose(-1, -2)).pow(2).sum()

    back = check(text, inputs, "loss", ["x", "W", "V"], torch_fn, passes=["transpose_products"])
    transposes = _made_by(back, "transpose").values()
    assert len(transposes) == 2  # one per weight gradient: of its upstream gradient, never of x, W, V or a result
    assert not {str(i.args[0].value) for i in transposes} & {"x", "W", "V", "Wt", "Vt"}
    folded = check(text, inputs, "loss", ["x", "W", "V"], torch_fn, passes=DEFAULT_PASSES)
    assert not _made_by(folded, "transpose")
