"""Greedy decoding with the LLaMA-style model of examples/llama_generate.py: deepx (embedded daemon) against torch
eager on the CPU, the same code and weights, in one run. Prints tokens per second with the key/value cache (deepx's
step under dx.compile, as the example runs it, and eager) and without it (the whole sequence recomputed every
token), and deepx's ratio to torch; writes bench/results/llama.json.

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
    compiled = dx.compile(llama.next_token)
    # (framework, mode): mode "compiled" is the cache with deepx's step under dx.compile (torch's is eager)
    sides = {("deepx", "compiled"): (dx, ours, compiled), ("torch", "compiled"): (torch, theirs, llama.next_token),
             ("deepx", "eager"): (dx, ours, llama.next_token), ("deepx", "recompute"): (dx, ours, None),
             ("torch", "recompute"): (torch, theirs, None)}
    best = {k: float("inf") for k in sides}
    outputs = {}
    for r in range(opts.rounds + 1):
        for (name, mode), (fw, model, step) in sides.items():
            t0 = time.perf_counter()
            out = llama.generate(fw, model, prompt, opts.tokens, use_cache=step is not None,
                                 step=step or llama.next_token)
            took = time.perf_counter() - t0
            outputs[name, mode] = out
            if r:
                best[name, mode] = min(best[name, mode], took)
    same = len({tuple(v) for v in outputs.values()}) == 1
    rows = []
    print(f"greedy decoding, {opts.tokens} tokens after a {len(prompt)}-token prompt ({cfg.layers} layers, dim "
          f"{cfg.dim}); tokens identical on every side: {same}\n")
    print("| | deepx tokens/s | torch tokens/s | deepx / torch |\n| --- | ---: | ---: | ---: |")
    labels = {"compiled": "with the KV cache (dx.compile)", "eager": "with the KV cache, eager",
              "recompute": "recomputing every token"}
    for mode, label in labels.items():
        d, t = opts.tokens / best["deepx", mode], opts.tokens / best["torch", "recompute" if mode == "recompute"
                                                                      else "compiled"]
        print(f"| {label} | {d:.1f} | {t:.1f} | {d / t:.2f}x |")
        rows.append({"mode": mode, "cache": mode != "recompute", "deepx_tokens_s": d, "torch_tokens_s": t,
                     "ratio": d / t})
    gain = best["deepx", "recompute"] / best["deepx", "compiled"]
    print(f"\nthe cache's gain for deepx: {gain:.2f}x")
    out_dir = Path(os.environ.get("OUT") or ROOT / "bench" / "results")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "llama.json").write_text(json.dumps({"rows": rows, "same_tokens": same, "cache_gain": gain}, indent=1))


if __name__ == "__main__":
    main()
