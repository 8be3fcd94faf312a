"""Where a training step's time goes: the character transformer of examples/train_transformer.py (or, with `--model
mlp`, bench/gpu.py's MLP step; with `--model digits`, bench/train.py's digits step; with `--model cnn`,
examples/train_cnn.py's step on a batch of 32, as bench/conv.py times it), warm steps profiled with yappi across
every thread (the SDK's, the event loop's, op-cuda's device thread), the functions that cost most printed per thread.
Not a benchmark (no peer): the map for making one faster.

    pip install yappi; python bench/profile_step.py [--roles heapmem,op-cuda] [--model mlp|digits|cnn] [--compiled]
        [--steps 30] [--top 40] [--clock wall|cpu]
    python bench/profile_step.py --roles registry,heapmem,scheduler,op-cpu --model cnn   # on the CPU

Writes the text to $OUT/profile_step.txt when OUT is set.
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))

from coldstart import load_example, trainer  # noqa: E402  (bench/coldstart.py, beside this file)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--roles", default="heapmem,op-cuda", help="the embedded daemon's roles")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--context", type=int, default=32)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--model", choices=("transformer", "mlp", "digits", "cnn"), default="transformer")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall", help="cpu: each thread's own CPU time")
    ap.add_argument("--compiled", action="store_true", help="the step under dx.compile")
    opts = ap.parse_args()
    import yappi

    os.environ.setdefault("DEEPX_CUDA_WARM", "0")  # no background compilation during the profiled steps
    os.environ.setdefault("DEEPX_NATIVE_BACKGROUND", "0")

    ex = load_example("deepx")
    ex["dx"].connect(roles=opts.roles.split(","))
    if opts.model == "mlp":
        step = mlp_step(opts.compiled)
    elif opts.model == "digits":
        step = digits_step(opts.compiled)
    elif opts.model == "cnn":
        step = cnn_step(opts.compiled)
    else:
        step = trainer(ex, opts.context, opts.d_model, opts.layers, opts.batch, compiled=opts.compiled)

    for _ in range(opts.warmup):
        step()
    yappi.set_clock_type(opts.clock)
    yappi.start(builtins=True, profile_threads=True)
    t0 = time.perf_counter()
    for _ in range(opts.steps):
        step()
    wall = time.perf_counter() - t0
    yappi.stop()
    out = io.StringIO()
    out.write(f"{opts.steps} warm {opts.model} steps{' (dx.compile)' if opts.compiled else ''}, "
              f"{1e3 * wall / opts.steps:.2f} ms per step (roles {opts.roles}, {opts.clock} clock)\n")
    threads = {t.id: t.name for t in yappi.get_thread_stats()}
    for tid, name in threads.items():
        stats = yappi.get_func_stats(filter_callback=lambda f, tid=tid: f.ctx_id == tid)
        stats.sort("tsub")
        rows = list(stats)[:opts.top]
        if not rows or sum(f.tsub for f in rows) < 0.01 * wall:
            continue
        out.write(f"\n== thread {name} (ctx {tid}): top {len(rows)} by own time, ms per step\n")
        for f in rows:
            where = f"{Path(f.module).name}:{f.lineno}" if f.module else ""
            out.write(f"{1e3 * f.tsub / opts.steps:9.3f} own {1e3 * f.ttot / opts.steps:9.3f} total "
                      f"{f.ncall / opts.steps:8.1f} calls  {f.name}  {where}\n")
    text_out = out.getvalue()
    sys.stdout.write(text_out)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "profile_step.txt").write_text(text_out)


def mlp_step(compiled: bool) -> Callable[[], None]:
    """bench/gpu.py's MLP step (784-512-512-10, SGD with momentum, batch 256, the loss read back)."""
    return _mlp((784, 512, 512, 10), 256, compiled, lambda optim, p: optim.SGD(p, lr=0.01, momentum=0.9))


def digits_step(compiled: bool) -> Callable[[], None]:
    """bench/train.py's digits step (64-128-64-10, Adam, batch 64, the loss read back)."""
    return _mlp((64, 128, 64, 10), 64, compiled, lambda optim, p: optim.Adam(p, lr=1e-3))


def _mlp(sizes: tuple[int, ...], batch: int, compiled: bool, optimizer: Callable[[Any, Any], Any]
         ) -> Callable[[], None]:
    """One step of an MLP of `sizes` (ReLU between), cross-entropy on a fixed random batch, the loss read back."""
    import numpy as np

    import deepx_sdk as dx
    import deepx_sdk.nn as nn
    import deepx_sdk.optim as optim

    rng = np.random.default_rng(0)
    x = dx.tensor(rng.standard_normal((batch, sizes[0])).astype(np.float32))
    y = dx.tensor(rng.integers(0, sizes[-1], batch))
    layers: list[Any] = []
    for k in range(len(sizes) - 1):
        layers += [nn.Linear(sizes[k], sizes[k + 1])] + ([nn.ReLU()] if k < len(sizes) - 2 else [])
    model = nn.Sequential(*layers)
    opt = optimizer(optim, model.parameters())

    return _stepper(model, opt, x, y, compiled)


def cnn_step(compiled: bool) -> Callable[[], None]:
    """examples/train_cnn.py's model, one Adam step on a batch of 32 digit-sized images, the loss read back."""
    import importlib.util

    import numpy as np

    import deepx_sdk as dx

    spec = importlib.util.spec_from_file_location("train_cnn", ROOT.parent / "examples" / "train_cnn.py")
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    rng = np.random.default_rng(0)
    x = dx.tensor(rng.random((32, 1, 8, 8)).astype(np.float32))
    y = dx.tensor(rng.integers(0, 10, 32))
    dx.manual_seed(0)
    model = example.model()
    opt = dx.optim.Adam(model.parameters(), lr=5e-3)

    return _stepper(model, opt, x, y, compiled)


def _stepper(model: Any, opt: Any, x: Any, y: Any, compiled: bool) -> Callable[[], None]:
    """A training step of `model` on (x, y) with cross-entropy, eager or under dx.compile, the loss read back."""
    import deepx_sdk as dx
    import deepx_sdk.nn.functional as F

    def core(x: Any, y: Any) -> Any:
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss

    run = dx.compile(core) if compiled else core
    return lambda: run(x, y).item()


if __name__ == "__main__":
    main()
