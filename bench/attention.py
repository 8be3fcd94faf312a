"""Scaled dot-product attention, forward and forward + backward, through the SDK's embedded daemon, in one run:

    op         F.scaled_dot_product_attention: one `attention` op (its gradient one `attentiongrad`)
    composite  the same attention written with deepx's ops (q k^T * scale, the causal mask, softmax, @ v): what the
               SDK recorded before the op, holding the (T, T) scores
    torch      torch.nn.functional.scaled_dot_product_attention, eager (the peer)

for a few shapes (batch, heads, sequence, head size, causal): the character transformer's (examples/
train_transformer.py), the mid-size one of bench/gpu.py, and longer sequences. Each figure is the median of the timed
steps, each ending in reading a scalar back (the sum of the result, or of the three gradients), so that the work is
done. Prints milliseconds and the ratios torch/op and composite/op (above 1: the op is faster); writes
bench/results/attention.json (attention_cuda.json with --cuda).

    python bench/attention.py [--steps N] [--cuda] [--dtype bfloat16]   # --cuda: op-cuda, torch on the GPU
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np
from _common import deepx_then_torch, median_ms  # bench/_common.py, beside this file

SHAPES = [  # (batch, heads, T, head size, causal)
    (16, 4, 32, 16, True),  # examples/train_transformer.py
    (32, 4, 128, 64, True),  # bench/gpu.py's mid-size transformer
    (8, 8, 512, 64, True),
    (4, 8, 256, 128, False),
    (2, 8, 1024, 64, True),
]
CUDA_SHAPES = [*SHAPES, (8, 16, 2048, 64, True), (4, 16, 4096, 128, True), (16, 32, 1024, 128, False)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--cuda", action="store_true", help="deepx on op-cuda and torch on the GPU")
    ap.add_argument("--dtype", default="float32", help="float32 (default), float16 or bfloat16")
    args = ap.parse_args()

    dx, torch, device = deepx_then_torch(args.cuda)
    from deepx_sdk.nn import functional as F
    sync = torch.cuda.synchronize if args.cuda else (lambda: None)
    tdtype = getattr(torch, args.dtype)

    def composite(q, k, v, causal: bool):  # type: ignore[no-untyped-def]
        s = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
        if causal:
            t = q.shape[-2]
            s = dx.where(dx.arange(t) <= dx.arange(t).unsqueeze(-1), s, -math.inf)
        return s.softmax(-1) @ v

    rng = np.random.default_rng(0)
    rows = []
    for b, h, t, d, causal in CUDA_SHAPES if args.cuda else SHAPES:
        arrays = [rng.standard_normal((b, h, t, d)).astype(np.float32) for _ in range(3)]
        mine = [dx.tensor(a).type_as_dtype(args.dtype).detach().requires_grad_() for a in arrays]
        theirs = [torch.tensor(a, device=device, dtype=tdtype, requires_grad=True) for a in arrays]

        def deepx_step(fused: bool, backward: bool) -> None:
            for x in mine:
                x.grad = None
            q, k, v = mine
            y = F.scaled_dot_product_attention(q, k, v, is_causal=causal) if fused else composite(q, k, v, causal)
            if not backward:
                y.float().sum().item()
                return
            y.float().sum().backward()
            (q.grad.float().sum() + k.grad.float().sum() + v.grad.float().sum()).item()

        def torch_step(backward: bool) -> None:
            for x in theirs:
                x.grad = None
            y = torch.nn.functional.scaled_dot_product_attention(*theirs, is_causal=causal)
            if not backward:
                y.float().sum().item()
            else:
                y.float().sum().backward()
                (theirs[0].grad.float().sum() + theirs[1].grad.float().sum() + theirs[2].grad.float().sum()).item()
            sync()

        row: dict = {"shape": [b, h, t, d], "causal": causal, "dtype": args.dtype}
        for part, backward in (("fwd", False), ("fwd_bwd", True)):
            op = median_ms(lambda backward=backward: deepx_step(True, backward), args.steps)
            comp = median_ms(lambda backward=backward: deepx_step(False, backward), args.steps)
            ref = median_ms(lambda backward=backward: torch_step(backward), args.steps)
            row.update({f"{part}_op_ms": op, f"{part}_composite_ms": comp, f"{part}_torch_ms": ref,
                        f"{part}_torch_over_op": ref / op, f"{part}_composite_over_op": comp / op})
        rows.append(row)
        print(f"{row['shape']} causal={causal}: " + ", ".join(
            f"{p} op {row[p + '_op_ms']:.2f} ms, composite {row[p + '_composite_ms']:.2f}, torch "
            f"{row[p + '_torch_ms']:.2f}" for p in ("fwd", "fwd_bwd")), flush=True)
    where = f"{'op-cuda, torch on the GPU' if args.cuda else 'the CPU'}, {args.dtype}"
    print(f"\n{where}: op speed / torch and op speed / composite (above 1: the op is faster)\n")
    print("| B, H, T, D | causal | fwd op ms | fwd / torch | fwd / composite | fwd+bwd op ms | fwd+bwd / torch | "
          "fwd+bwd / composite |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['shape']} | {r['causal']} | {r['fwd_op_ms']:.2f} | {r['fwd_torch_over_op']:.2f}x | "
              f"{r['fwd_composite_over_op']:.2f}x | {r['fwd_bwd_op_ms']:.2f} | {r['fwd_bwd_torch_over_op']:.2f}x | "
              f"{r['fwd_bwd_composite_over_op']:.2f}x |")
    out = Path(__file__).parent / "results"
    out.mkdir(exist_ok=True)
    (out / ("attention_cuda.json" if args.cuda else "attention.json")).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
