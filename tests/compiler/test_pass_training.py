"""A small Linear-ReLU-Linear model trained for a few SGD steps, each step one program as the SDK sends it (forward,
a backward instruction, updates, deletions), on a node with the default passes and on one with none: the same
parameters to 1e-5 (float32), both as a float64 numpy reference computes them; and the passes did rewrite the step
(its transposes folded into the products, the bias gradients made in the ReLU gradient's loop)."""

from __future__ import annotations

import numpy as np

from deepx_core.ir.instr import Instr, Param
from deepx_core.ir.text import parse_text
from deepxd.actors.messages import OpStats, Put, Run
from deepxd.actors.opcpu import CpuWorker
from deepxd.actors.scheduler import Scheduler
from deepxd.compiler import DEFAULT_PASSES
from deepxd.config import Config

BATCH, IN, HIDDEN, OUT = 64, 16, 512, 4  # the hidden layer's 32K elements: its ReLU gradient is fused
PARAMS = ("w1", "b1", "w2", "b2")
FORWARD = """
    transpose (tensor<float32>:w1, vector<int32>:[1 0]) -> (tensor<float32>:w1t)
    matmul (tensor<float32>:x, tensor<float32>:w1t) -> (tensor<float32>:a1)
    add (tensor<float32>:a1, tensor<float32>:b1) -> (tensor<float32>:z1)
    relu (tensor<float32>:z1) -> (tensor<float32>:h1)
    transpose (tensor<float32>:w2, vector<int32>:[1 0]) -> (tensor<float32>:w2t)
    matmul (tensor<float32>:h1, tensor<float32>:w2t) -> (tensor<float32>:a2)
    add (tensor<float32>:a2, tensor<float32>:b2) -> (tensor<float32>:o)
    mse (tensor<float32>:o, tensor<float32>:y, var<string>:mean) -> (tensor<float32>:loss)
"""
LR, MOMENTUM = 0.05, 0.9


def step_program() -> tuple[list[Instr], list[dict[str, object]]]:
    forward = parse_text(FORWARD.strip())
    grads = {p: f"g{p}" for p in PARAMS}
    marker = Instr("backward", (Param.tensor("loss", "float32"),),
                   tuple(Param.tensor(g, "float32") for g in grads.values()))
    rest = [f"deltensor () -> (tensor<float32>:{n})" for n in ("w1t", "a1", "z1", "h1", "w2t", "a2", "o")]
    rest += [f"sgd (tensor<float32>:{p}, tensor<float32>:g{p}, tensor<float32>:m{p}, var<float32>:{LR}, "
             f"var<float32>:{MOMENTUM}, var<float32>:0.0, var<float32>:0.0, var<bool>:false, var<int32>:2) -> "
             f"(tensor<float32>:{p}, tensor<float32>:m{p})" for p in PARAMS]
    rest += [f"deltensor () -> (tensor<float32>:g{p})" for p in PARAMS]
    spec = {"index": len(forward), "forward": forward, "loss": "loss", "wrt": list(PARAMS), "grad_loss": None,
            "prefix": "g0_", "names": grads}
    return [*forward, marker, *parse_text("\n".join(rest))], [spec]


def initial(rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {"x": rng.standard_normal((BATCH, IN)), "y": rng.standard_normal((BATCH, OUT)),
            "w1": rng.standard_normal((HIDDEN, IN)) * 0.25, "b1": rng.standard_normal(HIDDEN) * 0.1,
            "w2": rng.standard_normal((OUT, HIDDEN)) * 0.05, "b2": rng.standard_normal(OUT) * 0.1,
            **{f"m{p}": np.zeros(s) for p, s in (("w1", (HIDDEN, IN)), ("b1", (HIDDEN,)), ("w2", (OUT, HIDDEN)),
                                                  ("b2", (OUT,)))}}


def reference(t: dict[str, np.ndarray], steps: int) -> dict[str, np.ndarray]:
    """The same training in float64 numpy (SGD with momentum, the buffer starting at zero as step=2 reads it)."""
    t = {k: v.astype(np.float64).copy() for k, v in t.items()}
    for _ in range(steps):
        z1 = t["x"] @ t["w1"].T + t["b1"]
        h1 = np.maximum(z1, 0)
        o = h1 @ t["w2"].T + t["b2"]
        go = 2 * (o - t["y"]) / o.size
        grads = {"w2": go.T @ h1, "b2": go.sum(0)}
        gz1 = (go @ t["w2"]) * (h1 > 0)
        grads |= {"w1": gz1.T @ t["x"], "b1": gz1.sum(0)}
        for p in PARAMS:
            t[f"m{p}"] = MOMENTUM * t[f"m{p}"] + grads[p]
            t[p] = t[p] - LR * t[f"m{p}"]
    return t


async def train(passes: list[str], start: dict[str, np.ndarray], steps: int) -> tuple[dict[str, np.ndarray], dict]:
    worker = CpuWorker(output_log=False)
    scheduler = Scheduler({"op-cpu": worker.ref}, config=Config(passes=passes))
    worker.start()
    scheduler.start()
    try:
        for name, a in start.items():
            a32 = a.astype(np.float32)
            await worker.ref.ask(Put(name=name, dtype="float32", shape=list(a.shape), data=a32.tobytes()))
        program, backwards = step_program()
        for _ in range(steps):
            r = await scheduler.ref.ask(Run(program=program, fetch=["loss"], backwards=backwards))
            assert not r.error, r.error
        stats = await worker.ref.ask(OpStats())
        return {p: worker.ex.get(p).copy() for p in PARAMS}, stats
    finally:
        await scheduler.stop()
        await worker.stop()


async def test_training_with_the_passes_gives_the_parameters_of_training_without(rng):
    start = initial(rng)
    steps = 5
    on, on_ops = await train(list(DEFAULT_PASSES), start, steps)
    off, off_ops = await train(["off"], start, steps)
    assert {"matmultransposed", "fusedcolsum"} <= set(on_ops) and "transpose" not in on_ops
    assert not {"matmultransposed", "fusedcolsum"} & set(off_ops) and "transpose" in off_ops
    want = reference(start, steps)
    for p in PARAMS:
        np.testing.assert_allclose(on[p], off[p], rtol=1e-5, atol=1e-6, err_msg=p)
        np.testing.assert_allclose(on[p], want[p], rtol=1e-4, atol=1e-5, err_msg=p)
        assert not np.allclose(want[p], start[p].astype(np.float64))  # it trained
