"""conv2d and pooling, forward and backward, and a small CNN's training step, through the SDK's embedded daemon on
the CPU, in one run:

    op      the `conv2d` op (im2col in cache-sized chunks of output rows, one GEMM per chunk; its gradient ops
            likewise, the input's through col2im)
    taps    the same convolution written with slices and matmul (what op-cuda gets until it has a kernel)
    torch   torch.nn.functional.conv2d on the CPU, eager (the peer)

for a few layer shapes (batch, channels, image, kernel). Each figure is the median of the timed steps of
y = conv2d(x, w); y.sum().backward(); reading the gradients back. Then max_pool2d and avg_pool2d (forward, backward,
the input's gradient read back) against torch's, and examples/train_cnn.py's model: one training step (forward,
cross entropy, backward, Adam, the loss read back) on a batch of 32 digits against the same model in torch. Prints
tables of milliseconds and the ratios torch/op; writes bench/results/conv.json (conv_cuda.json with --cuda,
conv_cpu_time.json with --cpu-time).

    python bench/conv.py [--steps N] [--cuda]     # --cuda: deepx on op-cuda, torch on the GPU
    python bench/conv.py --cpu-time               # one thread each, the process's CPU time (a loaded machine)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import time
from pathlib import Path

import numpy as np
from _common import deepx_then_torch, median_ms  # bench/_common.py, beside this file

SHAPES = [  # (N, C, H, W, O, k, stride, padding)
    (64, 1, 8, 8, 16, 3, 1, 1),  # examples/train_cnn.py's first layer (digits)
    (32, 16, 32, 32, 32, 3, 1, 1),
    (16, 64, 16, 16, 64, 3, 2, 1),
    (8, 32, 28, 28, 32, 5, 1, 2),
]
POOLS = [  # (kind, N, C, H, W, k, stride, padding)
    ("max", 32, 16, 8, 8, 2, 2, 0),  # examples/train_cnn.py's MaxPool2d(2)
    ("max", 32, 32, 32, 32, 2, 2, 0),
    ("max", 16, 64, 32, 32, 3, 2, 1),  # ResNet's stem pooling
    ("avg", 32, 32, 32, 32, 2, 2, 0),
    ("avg", 16, 64, 16, 16, 3, 1, 1),
]
EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "train_cnn.py"


CLOCK = time.perf_counter  # time.process_time with --cpu-time


def _pools(dx, torch, device: str, steps: int) -> list[dict]:
    """max_pool2d and avg_pool2d, forward and backward, deepx against torch."""
    rng = np.random.default_rng(0)
    rows = []
    for kind, n, c, h, w, k, s, p in POOLS:
        x = rng.standard_normal((n, c, h, w)).astype(np.float32)
        fd = dx.nn.functional.max_pool2d if kind == "max" else dx.nn.functional.avg_pool2d
        ft = torch.nn.functional.max_pool2d if kind == "max" else torch.nn.functional.avg_pool2d

        def deepx_step() -> None:
            xd = dx.tensor(x, requires_grad=True)
            fd(xd, k, s, p).sum().backward()
            xd.grad.numpy()

        xt = torch.tensor(x, requires_grad=True, device=device)

        def torch_step() -> None:
            xt.grad = None
            ft(xt, k, s, p).sum().backward()
            xt.grad.cpu()

        op = median_ms(deepx_step, steps, CLOCK)
        ref = median_ms(torch_step, steps, CLOCK)
        rows.append({"pool": kind, "shape": [n, c, h, w, k, s, p], "op_ms": op, "torch_ms": ref,
                     "torch_over_op": ref / op})
    return rows


def _cnn(dx, torch, device: str, steps: int) -> dict:
    """examples/train_cnn.py's model, one training step on a batch of 32 digit-sized images, against torch's."""
    spec = importlib.util.spec_from_file_location("train_cnn", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    tn = torch.nn
    rng = np.random.default_rng(0)
    x = rng.random((32, 1, 8, 8)).astype(np.float32)
    y = rng.integers(0, 10, 32)

    dx.manual_seed(0)
    net = example.model()
    opt = dx.optim.Adam(net.parameters(), lr=5e-3)
    xd, yd = dx.tensor(x), dx.tensor(y)

    def deepx_step() -> None:
        opt.zero_grad()
        loss = dx.nn.functional.cross_entropy(net(xd), yd)
        loss.backward()
        opt.step()
        loss.item()

    ref = tn.Sequential(tn.Conv2d(1, 16, 3, padding=1), tn.BatchNorm2d(16), tn.ReLU(), tn.MaxPool2d(2),
                        tn.Conv2d(16, 32, 3, padding=1), tn.ReLU(), tn.AdaptiveAvgPool2d(1), tn.Flatten(),
                        tn.Linear(32, 10)).to(device)
    topt = torch.optim.Adam(ref.parameters(), lr=5e-3)
    xt, yt = torch.tensor(x, device=device), torch.tensor(y, device=device)

    def torch_step() -> None:
        topt.zero_grad()
        loss = torch.nn.functional.cross_entropy(ref(xt), yt)
        loss.backward()
        topt.step()
        loss.item()

    op = median_ms(deepx_step, steps * 5, CLOCK)
    t = median_ms(torch_step, steps * 5, CLOCK)
    return {"op_ms": op, "torch_ms": t, "torch_over_op": t / op}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--cuda", action="store_true", help="deepx on op-cuda and torch on the GPU")
    ap.add_argument("--no-conv", action="store_true", help="pooling and the CNN step only")
    ap.add_argument("--cpu-time", action="store_true",
                    help="deepx and torch on one thread each, timed by the process's CPU time, not wall time")
    args = ap.parse_args()

    global CLOCK
    if args.cpu_time:  # before deepx and torch start their threads
        os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = "1"
        CLOCK = time.process_time
    dx, torch, device = deepx_then_torch(args.cuda)
    if args.cpu_time:
        torch.set_num_threads(1)
    from deepx_sdk.nn import vision

    rng = np.random.default_rng(0)
    rows = []
    for n, c, h, w, o, k, s, p in [] if args.no_conv else SHAPES:
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

        op = median_ms(lambda: deepx_step(False), args.steps, CLOCK)
        taps = median_ms(lambda: deepx_step(True), args.steps, CLOCK)
        ref = median_ms(torch_step, args.steps, CLOCK)
        rows.append({"shape": [n, c, h, w, o, k, s, p], "op_ms": op, "taps_ms": taps, "torch_ms": ref,
                     "torch_over_op": ref / op, "taps_over_op": taps / op})
    print("| N, C, H, W -> O, k, stride, pad | op ms | taps ms | torch ms | op speed / torch | op speed / taps |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['shape']} | {r['op_ms']:.2f} | {r['taps_ms']:.2f} | {r['torch_ms']:.2f} | "
              f"{r['torch_over_op']:.2f}x | {r['taps_over_op']:.2f}x |")
    pools = _pools(dx, torch, device, args.steps)
    print()
    print("| pool: N, C, H, W, k, stride, pad | op ms | torch ms | op speed / torch |")
    print("| --- | ---: | ---: | ---: |")
    for r in pools:
        print(f"| {r['pool']} {r['shape']} | {r['op_ms']:.3f} | {r['torch_ms']:.3f} | {r['torch_over_op']:.2f}x |")
    cnn = _cnn(dx, torch, device, args.steps)
    print()
    print("| examples/train_cnn.py step, batch 32 | op ms | torch ms | op speed / torch |")
    print("| --- | ---: | ---: | ---: |")
    print(f"| train step | {cnn['op_ms']:.3f} | {cnn['torch_ms']:.3f} | {cnn['torch_over_op']:.2f}x |")
    out = Path(__file__).parent / "results"
    out.mkdir(exist_ok=True)
    (out / ("conv_cuda.json" if args.cuda else "conv_cpu_time.json" if args.cpu_time else "conv.json")).write_text(
        json.dumps({"conv": rows, "pool": pools, "cnn_step": cnn}, indent=1))


if __name__ == "__main__":
    main()
