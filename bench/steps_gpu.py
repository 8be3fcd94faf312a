"""Warm training steps on the GPU, deepx with and without CUDA graphs against torch eager, in one run (issue 25).

The character transformer of examples/train_transformer.py (the example's size, and d_model 256, 4 layers, context
128, batch 32), one step as its script takes one (a random batch, AdamW, `loss.item()`), on an embedded daemon with
op-cuda (`cuda_graphs` 0 and 1) and on torch eager on the same GPU. Prints ms per step and the ratios; writes
$OUT/steps_gpu.json (else bench/results/steps_gpu.json).

    python bench/steps_gpu.py [--steps 30] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))

from coldstart import load_example, trainer  # noqa: E402  (bench/coldstart.py, beside this file)

SIZES = {"example (d64, 2 layers, ctx 32, batch 16)": (32, 64, 2, 16),
         "d256, 4 layers, ctx 128, batch 32": (128, 256, 4, 32)}


def timed(step: Any, warmup: int, steps: int) -> float:
    """Median ms per step over `steps` warm steps, each timed alone (each ends with loss.item(): synchronised)."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    times.sort()
    return 1e3 * times[len(times) // 2]


def deepx(size: tuple[int, int, int, int], graphs: bool, warmup: int, steps: int) -> tuple[float, int]:
    os.environ["DEEPX_CUDA_GRAPHS"] = "1" if graphs else "0"
    os.environ.setdefault("DEEPX_CUDA_WARM", "0")
    ex = load_example("deepx")
    s = ex["dx"].connect(roles=["heapmem", "op-cuda"])
    try:
        ms = timed(trainer(ex, *size), warmup, steps)
        stat = s.transport.node.ref("op-cuda")._actor.op_stats.get("cudagraph")
        return ms, stat.calls if stat is not None else 0
    finally:
        ex["dx"].disconnect()


def torch_eager(size: tuple[int, int, int, int], warmup: int, steps: int) -> float:
    ex = load_example("torch")
    ex["dx"].set_default_device("cuda")
    return timed(trainer(ex, *size), warmup, steps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--quick", action="store_true", help="the example's size only, 10 steps")
    opts = ap.parse_args()
    import torch

    sizes = dict(list(SIZES.items())[:1]) if opts.quick else SIZES
    steps = 10 if opts.quick else opts.steps
    results: dict[str, Any] = {"device": torch.cuda.get_device_name(0)}
    print(f"| model, {results['device']} | deepx graphs off (ms) | deepx graphs on (ms) | torch eager (ms) | "
          "graphs on / off | deepx speed / torch |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for label, size in sizes.items():
        off, _ = deepx(size, False, opts.warmup, steps)
        on, replays = deepx(size, True, opts.warmup, steps)
        t = torch_eager(size, opts.warmup, steps)
        results[label] = {"graphs_off_ms": off, "graphs_on_ms": on, "torch_ms": t, "replays": replays}
        print(f"| {label} | {off:.2f} | {on:.2f} ({replays} replays) | {t:.2f} | {off / on:.2f}x faster | "
              f"{t / on:.2f}x |", flush=True)
    out = Path(os.environ.get("OUT") or ROOT / "results")
    out.mkdir(parents=True, exist_ok=True)
    (out / "steps_gpu.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
