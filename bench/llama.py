"""Greedy decoding with the LLaMA-style model of examples/llama_generate.py: deepx (embedded daemon) against torch
eager on the CPU, the same code and weights, in one run. Prints tokens per second with the key/value cache and
without it (the whole sequence recomputed every token), and deepx's ratio to torch; writes bench/results/llama.json.

    python bench/llama.py [--tokens 48] [--rounds 3]

Each side decodes `tokens` tokens after a 16-byte prompt, `rounds` times in turn (after one untimed run); each row is
its best round.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("DEEPX_NATIVE_BACKGROUND", "0")  # steady state: native kernels compiled before timing

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    opts = ap.parse_args()
    import deepx_sdk as dx  # before torch: the BLAS's OpenMP runtime is deepx's choice (docs/decisions/0016)

    dx.tensor([0.0]).numpy()
    import torch

    spec = importlib.util.spec_from_file_location("llama_generate", ROOT / "examples" / "llama_generate.py")
    assert spec is not None and spec.loader is not None
    llama = importlib.util.module_from_spec(spec)
    sys.modules["llama_generate"] = llama
    spec.loader.exec_module(llama)
    cfg = llama.Config()
    torch.manual_seed(0)
    torch.set_num_threads(os.cpu_count() or 1)
    theirs = llama.build(torch, torch.nn, torch.nn.functional, cfg)()
    ours = llama.build(dx, dx.nn, dx.nn.functional, cfg)()
    ours.load_state_dict({k: dx.tensor(v.numpy()) for k, v in theirs.state_dict().items()})
    prompt = list(b"First Citizen:\n ")
    sides = {("deepx", True): (dx, ours), ("torch", True): (torch, theirs),
             ("deepx", False): (dx, ours), ("torch", False): (torch, theirs)}
    best = {k: float("inf") for k in sides}
    outputs = {}
    for r in range(opts.rounds + 1):
        for (name, cache), (fw, model) in sides.items():
            t0 = time.perf_counter()
            out = llama.generate(fw, model, prompt, opts.tokens, use_cache=cache)
            took = time.perf_counter() - t0
            outputs[name, cache] = out
            if r:
                best[name, cache] = min(best[name, cache], took)
    same = len({tuple(v) for v in outputs.values()}) == 1
    rows = []
    print(f"greedy decoding, {opts.tokens} tokens after a {len(prompt)}-token prompt ({cfg.layers} layers, dim "
          f"{cfg.dim}); tokens identical on every side: {same}\n")
    print("| | deepx tokens/s | torch tokens/s | deepx / torch |\n| --- | ---: | ---: | ---: |")
    for cache in (True, False):
        d, t = opts.tokens / best["deepx", cache], opts.tokens / best["torch", cache]
        label = "with the KV cache" if cache else "recomputing every token"
        print(f"| {label} | {d:.1f} | {t:.1f} | {d / t:.2f}x |")
        rows.append({"cache": cache, "deepx_tokens_s": d, "torch_tokens_s": t, "ratio": d / t})
    gain = (opts.tokens / best["deepx", True]) / (opts.tokens / best["deepx", False])
    print(f"\nthe cache's gain for deepx: {gain:.2f}x")
    out_dir = Path(os.environ.get("OUT") or ROOT / "bench" / "results")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "llama.json").write_text(json.dumps({"rows": rows, "same_tokens": same, "cache_gain": gain}, indent=1))


if __name__ == "__main__":
    main()
