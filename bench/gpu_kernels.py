"""Where a warm training step's GPU time goes: the character transformer of examples/train_transformer.py on op-cuda,
its kernels timed by torch's profiler (CUPTI sees every kernel in the process, PyCUDA's and cuBLAS's included),
against torch eager's own step profiled the same way. Prints per step: wall time, GPU busy time, kernel launches,
and the kernels that cost most on each side. Not a benchmark with an aim: the map for making the step faster.

    python bench/gpu_kernels.py [--d-model 256 --layers 4 --context 128 --batch 32] [--steps 10]

Writes the text to $OUT/gpu_kernels.txt when OUT is set.
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))

from coldstart import load_example, trainer  # noqa: E402  (bench/coldstart.py, beside this file)


def profiled(step: Any, warmup: int, steps: int, out: io.StringIO, label: str, top: int) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    for _ in range(warmup):
        step()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    per: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    busy = 0.0
    for e in prof.events():
        if e.device_type.name != "CUDA":
            continue
        us = e.time_range.elapsed_us()
        per[e.name][0] += 1
        per[e.name][1] += us
        busy += us
    launches = sum(c for c, _ in per.values())
    out.write(f"\n== {label}: {1e3 * wall / steps:.2f} ms per step wall, GPU busy {busy / 1e3 / steps:.2f} ms, "
              f"{launches / steps:.0f} kernels and copies per step\n")
    for name, (calls, us) in sorted(per.items(), key=lambda kv: -kv[1][1])[:top]:
        out.write(f"{us / steps:10.1f} us {calls / steps:7.1f} x  {name[:110]}\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--warmup", type=int, default=15)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--graphs", type=int, default=1, help="op-cuda's cuda_graphs setting")
    opts = ap.parse_args()
    import torch

    os.environ.setdefault("DEEPX_CUDA_WARM", "0")
    os.environ["DEEPX_CUDA_GRAPHS"] = str(opts.graphs)
    size = (opts.context, opts.d_model, opts.layers, opts.batch)
    out = io.StringIO()
    out.write(f"transformer d_model {opts.d_model}, {opts.layers} layers, context {opts.context}, batch "
              f"{opts.batch} on {torch.cuda.get_device_name(0)}; cuda_graphs {opts.graphs}\n")
    ex = load_example("deepx")
    ex["dx"].connect(roles=["heapmem", "op-cuda"])
    try:
        profiled(trainer(ex, *size), opts.warmup, opts.steps, out, "deepx eager", opts.top)
        profiled(trainer(ex, *size, compiled=True), opts.warmup, opts.steps, out, "deepx dx.compile", opts.top)
    finally:
        ex["dx"].disconnect()
    tex = load_example("torch")
    torch.set_default_device("cuda")
    profiled(trainer(tex, *size), opts.warmup, opts.steps, out, "torch eager", opts.top)
    text = out.getvalue()
    sys.stdout.write(text)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gpu_kernels.txt").write_text(text)


if __name__ == "__main__":
    main()
