"""Batch norm, group norm and interpolate, forward and backward, through the SDK's embedded daemon on the CPU, in one
run:

    op         the ops (batchnorm + batchnormupdate, batchnormeval, groupnorm, interpnearest, interpbilinear; their
               gradient ops)
    composite  the same written with the small ops they replaced (means, centring, gathers: the SDK's code before)
    torch      torch.nn.functional on the CPU, eager (the peer)

for a few layer shapes, the inputs made once. Each figure is the median of the timed steps of y = f(x);
y.sum().backward(); reading the input's gradient back (batch norm in eval: the forward alone, read back). Prints a
table of milliseconds and the ratios op/torch and composite/op; writes bench/results/norms.json (norms_cuda.json with
--cuda).

    python bench/norms.py [--steps N] [--cuda]     # --cuda: deepx on op-cuda, torch on the GPU
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
from _common import deepx_then_torch, median_ms  # bench/_common.py, beside this file

CASES = [  # (name, input shape, what)
    ("batch_norm train", (32, 16, 32, 32), {}),
    ("batch_norm train", (64, 64, 16, 16), {}),
    ("batch_norm train 1d", (256, 512), {}),
    ("batch_norm eval", (32, 16, 32, 32), {}),
    ("group_norm", (16, 64, 16, 16), {"groups": 8}),
    ("group_norm", (8, 32, 32, 32), {"groups": 32}),
    ("interpolate nearest x2", (8, 32, 32, 32), {"scale_factor": 2, "mode": "nearest"}),
    ("interpolate bilinear x2", (8, 32, 32, 32), {"scale_factor": 2, "mode": "bilinear"}),
    ("interpolate bilinear to 23x17", (8, 32, 32, 32), {"size": (23, 17), "mode": "bilinear",
                                                        "align_corners": True}),
]


# -- the composites the ops replaced (deepx_sdk/nn/vision.py before them), with public SDK calls

def _per_channel(t: Any, ndim: int) -> Any:
    return t.reshape(1, t.shape[0], *([1] * (ndim - 2)))


def batch_norm_composite(x: Any, running_mean: Any, running_var: Any, weight: Any, bias: Any, training: bool,
                         momentum: float = 0.1, eps: float = 1e-5) -> Any:
    import deepx_sdk as dx

    dims = [0, *range(2, x.ndim)]
    if training:
        count = x.numel() // x.shape[1]
        mean = x.mean(dims, keepdim=True)
        centered = x - mean
        var = (centered * centered).mean(dims, keepdim=True)
        with dx.no_grad():
            running_mean.copy_(running_mean * (1 - momentum) + mean.detach().reshape(-1) * momentum)
            running_var.copy_(running_var * (1 - momentum) + var.detach().reshape(-1) * (count / (count - 1))
                              * momentum)
        out = centered / (var + eps).sqrt()
    else:
        out = (x - _per_channel(running_mean, x.ndim)) / (_per_channel(running_var, x.ndim) + eps).sqrt()
    return out * _per_channel(weight, x.ndim) + _per_channel(bias, x.ndim)


def group_norm_composite(x: Any, groups: int, weight: Any, bias: Any, eps: float = 1e-5) -> Any:
    g = x.reshape(x.shape[0], groups, -1)
    mean = g.mean(2, keepdim=True)
    centered = g - mean
    var = (centered * centered).mean(2, keepdim=True)
    out = (centered / (var + eps).sqrt()).reshape(x.shape)
    return out * _per_channel(weight, x.ndim) + _per_channel(bias, x.ndim)


def interpolate_composite(x: Any, size: Any = None, scale_factor: Any = None, mode: str = "nearest",
                          align_corners: bool | None = None) -> Any:
    """Gathers with indices and weights worked out on the host, one spatial dim at a time."""
    import deepx_sdk as dx

    spatial = x.shape[2:]
    if size is not None:
        outs = list(size) if isinstance(size, (tuple, list)) else [size] * len(spatial)
        scales = [s / o for s, o in zip(spatial, outs)]
    else:
        outs = [math.floor(s * scale_factor) for s in spatial]
        scales = [1.0 / scale_factor] * len(spatial)
    for axis, (n_in, n_out, scale) in enumerate(zip(spatial, outs, scales)):
        dim = 2 + axis
        head = (slice(None),) * dim
        dst = np.arange(n_out, dtype=np.float64)
        if mode == "nearest":
            x = x[(*head, dx.tensor(np.minimum(np.floor(dst * scale).astype(np.int64), n_in - 1)))]
            continue
        if align_corners:
            pos = dst * ((n_in - 1) / (n_out - 1)) if n_out > 1 else np.zeros(n_out)
        else:
            pos = np.maximum((dst + 0.5) * scale - 0.5, 0.0)
        lo = np.minimum(np.floor(pos).astype(np.int64), n_in - 1)
        hi = np.minimum(lo + 1, n_in - 1)
        wt = dx.tensor((pos - lo).reshape(-1, *([1] * (x.ndim - dim - 1))).astype(np.float32))
        a, b = x[(*head, dx.tensor(lo))], x[(*head, dx.tensor(hi))]
        x = a + (b - a) * wt
    return x


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--cuda", action="store_true", help="deepx on op-cuda and torch on the GPU")
    args = ap.parse_args()

    dx, torch, device = deepx_then_torch(args.cuda)
    import deepx_sdk.nn.functional as F
    tf = torch.nn.functional
    rng = np.random.default_rng(0)
    rows = []
    for name, shape, kw in CASES:
        x = rng.standard_normal(shape).astype(np.float32)
        c = shape[1]
        w, b = rng.uniform(0.5, 1.5, c).astype(np.float32), rng.uniform(-0.5, 0.5, c).astype(np.float32)
        rm, rv = np.zeros(c, np.float32), np.ones(c, np.float32)
        train = "eval" not in name
        d_rm, d_rv = dx.tensor(rm), dx.tensor(rv)
        t_rm, t_rv = torch.tensor(rm, device=device), torch.tensor(rv, device=device)

        def deepx_fn(kind: str, xd: Any, wd: Any, bd: Any) -> Any:
            if name.startswith("batch_norm"):
                f = F.batch_norm if kind == "op" else batch_norm_composite
                return f(xd, d_rm, d_rv, wd, bd, train)
            if name.startswith("group_norm"):
                return (F.group_norm(xd, kw["groups"], wd, bd) if kind == "op"
                        else group_norm_composite(xd, kw["groups"], wd, bd))
            return F.interpolate(xd, **kw) if kind == "op" else interpolate_composite(xd, **kw)

        def torch_fn(xt: Any, wt: Any, bt: Any) -> Any:
            if name.startswith("batch_norm"):
                return tf.batch_norm(xt, t_rm, t_rv, wt, bt, train)
            if name.startswith("group_norm"):
                return tf.group_norm(xt, kw["groups"], wt, bt)
            return tf.interpolate(xt, **kw)

        xd = dx.tensor(x, requires_grad=train)
        wd, bd = dx.tensor(w, requires_grad=train), dx.tensor(b, requires_grad=train)

        def deepx_step(kind: str) -> None:
            xd.grad = wd.grad = bd.grad = None
            y = deepx_fn(kind, xd, wd, bd)
            if train:
                y.sum().backward()
                xd.grad.numpy()
            else:
                y.numpy()

        xt = torch.tensor(x, requires_grad=train, device=device)
        wt = torch.tensor(w, requires_grad=train, device=device)
        bt = torch.tensor(b, requires_grad=train, device=device)

        def torch_step() -> None:
            xt.grad = wt.grad = bt.grad = None
            y = torch_fn(xt, wt, bt)
            if train:
                y.sum().backward()
                xt.grad.cpu()  # read back, as the deepx step reads its gradient
            else:
                y.detach().cpu()

        op = median_ms(lambda: deepx_step("op"), args.steps)
        composite = median_ms(lambda: deepx_step("composite"), args.steps)
        ref = median_ms(torch_step, args.steps)
        rows.append({"case": name, "shape": list(shape), "op_ms": op, "composite_ms": composite, "torch_ms": ref,
                     "torch_over_op": ref / op, "composite_over_op": composite / op})
    print("| case | shape | op ms | composite ms | torch ms | op speed / torch | op speed / composite |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['case']} | {r['shape']} | {r['op_ms']:.2f} | {r['composite_ms']:.2f} | {r['torch_ms']:.2f} | "
              f"{r['torch_over_op']:.2f}x | {r['composite_over_op']:.2f}x |")
    out = Path(__file__).parent / "results"
    out.mkdir(exist_ok=True)
    (out / ("norms_cuda.json" if args.cuda else "norms.json")).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
