"""One training step of an MLP, float32: deepx (embedded daemon) against torch eager on the CPU, in one run. Prints ms
per step and the ratio; writes bench/results/train.json (train_<model>.json with another --model).

    python bench/train.py [--steps 10] [--rounds 6] [--model mnist|digits|deep]

The eager step is timed in two styles: a function whose loss dies when it returns ("deepx"), and the body of a
top-level loop whose `out` and `loss` outlive the step ("deepx loop").

    mnist   784-512-512-10, batch 256, SGD with momentum: a step where the kernels dominate
    digits  64-128-64-10, batch 64, Adam: a small model whose step is host work (issue 25's item 7)
    deep    35 layers of 16, batch 8, Adam: 70 parameters of tiny tensors, the host cost per parameter (a replay's
            renumbered updates above all)

The four steps take turns, in rounds of `steps` timed steps each (after 3 untimed), with a short pause between
turns: on a shared machine whose speed drifts over seconds, a slow spell then falls on every side instead of on
one. Each row is its best step over all rounds; the ratio of the medians of the rounds' bests is printed too.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from deepxd.actors.messages import OpStats

# a benchmark times the steady state: a native kernel is compiled before the run that made it HOT returns
os.environ["DEEPX_NATIVE_BACKGROUND"] = "0"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--model", choices=("mnist", "digits", "deep"), default="mnist")
    opts = ap.parse_args()
    sizes, batch = {"mnist": ((784, 512, 512, 10), 256), "digits": ((64, 128, 64, 10), 64),
                    "deep": ((16,) * 35 + (10,), 8)}[opts.model]
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch, sizes[0])).astype(np.float32)
    y = rng.integers(0, 10, batch)

    import deepx_sdk as dx
    import deepx_sdk.nn as nn
    import deepx_sdk.nn.functional as F
    import deepx_sdk.optim

    def mlp(nn: Any) -> Any:
        layers: list[Any] = []
        for i, (a, b) in enumerate(itertools.pairwise(sizes)):
            layers += [nn.Linear(a, b)] + ([nn.ReLU()] if i < len(sizes) - 2 else [])
        return nn.Sequential(*layers)

    def optimizer(optim: Any, params: Any) -> Any:
        if opts.model == "mnist":
            return optim.SGD(params, lr=0.01, momentum=0.9)
        return optim.Adam(params, lr=1e-3)

    model = mlp(nn)
    opt = optimizer(sys.modules["deepx_sdk.optim"], model.parameters())
    dxx, dxy = dx.tensor(x), dx.tensor(y)

    def dx_step() -> float:
        opt.zero_grad()
        loss = F.cross_entropy(model(dxx), dxy)
        loss.backward()
        opt.step()
        return loss.item()

    # the same step written at the top level of a loop, as most scripts do: `out` and `loss` are assigned each step,
    # so the step before's live on while the next are recorded (held here in a dict, as a module's globals hold
    # them); its own model and optimizer
    lmodel = mlp(nn)
    lopt = optimizer(sys.modules["deepx_sdk.optim"], lmodel.parameters())
    held: dict[str, Any] = {}

    def dx_loop_step() -> float:
        lopt.zero_grad()
        held["out"] = lmodel(dxx)
        held["loss"] = F.cross_entropy(held["out"], dxy)
        held["loss"].backward()
        lopt.step()
        return held["loss"].item()

    # the same step as a stored graph (dx.compile): captured once, then replayed by name; its own model and
    # optimizer, so that the two deepx rows train independently
    cmodel = mlp(nn)
    copt = optimizer(sys.modules["deepx_sdk.optim"], cmodel.parameters())

    @dx.compile
    def train_step(x: dx.Tensor, y: dx.Tensor) -> dx.Tensor:
        copt.zero_grad()
        loss = F.cross_entropy(cmodel(x), y)
        loss.backward()
        copt.step()
        return loss

    def dx_compiled_step() -> float:
        return float(train_step(dxx, dxy).item())

    import torch

    tmodel = mlp(torch.nn)
    topt = optimizer(torch.optim, tmodel.parameters())
    tx, ty = torch.from_numpy(x), torch.from_numpy(y)

    def torch_step() -> float:
        topt.zero_grad()
        loss = torch.nn.functional.cross_entropy(tmodel(tx), ty)
        loss.backward()
        topt.step()
        return loss.item()

    sides = (("deepx", dx_step), ("deepx loop", dx_loop_step), ("deepx compiled", dx_compiled_step),
             ("torch", torch_step))
    rounds: dict[str, list[float]] = {name: [] for name, _ in sides}
    for _ in range(opts.rounds):
        for name, step in sides:
            for _ in range(3):
                step()
            best = float("inf")
            for _ in range(opts.steps):
                t0 = time.perf_counter()
                step()
                best = min(best, time.perf_counter() - t0)
            rounds[name].append(best)
            time.sleep(0.2)
    results = {name: min(v) for name, v in rounds.items()}
    from deepxd.kernels.cpu import blas

    name = "-".join(map(str, sizes))
    print(f"MLP {name}, batch {batch}, one {type(opt).__name__} step (best of {opts.rounds} rounds x "
          f"{opts.steps} steps, "
          f"the sides taking turns); deepx's matmul on {blas.describe()}")
    ratio = results["deepx"] / results["torch"]
    cratio = results["deepx compiled"] / results["torch"]
    lratio = results["deepx loop"] / results["torch"]
    print(f"  deepx (embedded)         : {results['deepx'] * 1e3:8.2f} ms   deepx/torch time {ratio:.2f}x")
    print(f"  deepx, top-level loop    : {results['deepx loop'] * 1e3:8.2f} ms   deepx/torch time {lratio:.2f}x")
    print(f"  deepx compiled (replayed): {results['deepx compiled'] * 1e3:8.2f} ms   deepx/torch time {cratio:.2f}x")
    print(f"  torch eager (CPU)        : {results['torch'] * 1e3:8.2f} ms")
    medians = {name: float(np.median(v)) for name, v in rounds.items()}
    print(f"  median of the rounds' bests: deepx/torch {medians['deepx'] / medians['torch']:.2f}x, "
          f"loop/torch {medians['deepx loop'] / medians['torch']:.2f}x, "
          f"compiled/torch {medians['deepx compiled'] / medians['torch']:.2f}x")
    print(f"aim: no slower than torch -> {'met' if results['deepx'] <= results['torch'] else 'NOT met'}")
    split = kernel_split(dx_step, opts.steps * 2)
    print(f"  where deepx's eager step goes (mean of {opts.steps * 2} steps): {split['step'] * 1e3:.2f} ms, of which "
          f"the op worker's kernels {split['kernels'] * 1e3:.2f} ms and the rest (recording, the hand-off to the "
          f"daemon's thread and back, the scheduler) {(split['step'] - split['kernels']) * 1e3:.2f} ms")
    results["split"] = split
    out = Path(__file__).parent / "results" / ("train.json" if opts.model == "mnist" else f"train_{opts.model}.json")
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({**results, "rounds": rounds, "blas": blas.describe()}, indent=2))


def kernel_split(step, n: int) -> dict[str, float]:
    """Mean step time over n steps, and the mean time the embedded op worker spent in its kernels (its op
    statistics, what `deepxctl ops` shows) in those steps."""
    import deepx_sdk as dx

    transport = dx.session().transport
    worker = transport.node.worker()

    def busy() -> float:
        return sum(s["seconds"] for s in transport._call(worker.ask(OpStats())).values())

    before = busy()
    t0 = time.perf_counter()
    for _ in range(n):
        step()
    elapsed = time.perf_counter() - t0
    return {"step": elapsed / n, "kernels": (busy() - before) / n}


if __name__ == "__main__":
    main()
