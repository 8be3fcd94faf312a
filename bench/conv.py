"""conv2d, forward and backward, through the SDK's embedded daemon on the CPU, in one run:

    op      the `conv2d` op (im2col in cache-sized chunks of output rows, one GEMM per chunk; its gradient ops
            likewise, the input's through col2im)
    taps    the same convolution written with slices and matmul (what op-cuda gets until it has a kernel)
    torch   torch.nn.functional.conv2d on the CPU, eager (the peer)

for a few layer shapes (batch, channels, image, kernel). Each figure is the median of the timed steps of
y = conv2d(x, w); y.sum().backward(); reading the gradients back. Prints a table of milliseconds and the ratios
op/torch and taps/op; writes bench/results/conv.json (conv_cuda.json with --cuda).

    python bench/conv.py [--steps N] [--cuda]     # --cuda: deepx on op-cuda, torch on the GPU
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
from _common import deepx_then_torch, median_ms  # bench/_common.py, beside this file

SHAPES = [  # (N, C, H, W, O, k, stride, padding)
    (64, 1, 8, 8, 16, 3, 1, 1),  # examples/train_cnn.py's first layer (digits)
    (32, 16, 32, 32, 32, 3, 1, 1),
    (16, 64, 16, 16, 64, 3, 2, 1),
    (8, 32, 28, 28, 32, 5, 1, 2),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--cuda", action="store_true", help="deepx on op-cuda and torch on the GPU")
    args = ap.parse_args()

    dx, torch, device = deepx_then_torch(args.cuda)
    from deepx_sdk.nn import vision

    rng = np.random.default_rng(0)
    rows = []
    for n, c, h, w, o, k, s, p in SHAPES:
        x = rng.standard_normal((n, c, h, w)).astype(np.float32)
        wt = (rng.standard_normal((o, c, k, k)) * 0.1).astype(np.float32)

        def deepx_step(taps: bool) -> None:
            xd = dx.tensor(x, requires_grad=True)
            wd = dx.tensor(wt, requires_grad=True)
            if taps:
                oh = (h + 2 * p - k) // s + 1
                y = vision._conv2d_taps(xd, wd, n, c, o, c, k, k, (s, s), (p, p), (1, 1), 1, oh, oh)
            else:
                y = vision.conv2d(xd, wd, stride=s, padding=p)
            y.sum().backward()
            xd.grad.numpy()
            wd.grad.numpy()

        xt = torch.tensor(x, requires_grad=True, device=device)
        wtt = torch.tensor(wt, requires_grad=True, device=device)

        def torch_step() -> None:
            xt.grad = wtt.grad = None
            torch.nn.functional.conv2d(xt, wtt, stride=s, padding=p).sum().backward()
            xt.grad.cpu()  # read back, as the deepx step reads its gradients
            wtt.grad.cpu()

        op = median_ms(lambda: deepx_step(False), args.steps)
        taps = median_ms(lambda: deepx_step(True), args.steps)
        ref = median_ms(torch_step, args.steps)
        rows.append({"shape": [n, c, h, w, o, k, s, p], "op_ms": op, "taps_ms": taps, "torch_ms": ref,
                     "torch_over_op": ref / op, "taps_over_op": taps / op})
    print("| N, C, H, W -> O, k, stride, pad | op ms | taps ms | torch ms | op speed / torch | op speed / taps |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['shape']} | {r['op_ms']:.2f} | {r['taps_ms']:.2f} | {r['torch_ms']:.2f} | "
              f"{r['torch_over_op']:.2f}x | {r['taps_over_op']:.2f}x |")
    out = Path(__file__).parent / "results"
    out.mkdir(exist_ok=True)
    (out / ("conv_cuda.json" if args.cuda else "conv.json")).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
