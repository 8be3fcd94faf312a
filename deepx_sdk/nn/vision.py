"""Convolution, pooling and batch statistics for convolutional nets, written with the ops deepx has.

A convolution is the `conv2d` op (on the CPU im2col as a strided view and one GEMM per group,
deepxd/kernels/cpu/conv.py; on op-cuda a direct kernel, deepxd/kernels/cuda/conv.py), its gradient the ops
conv2dgradinput and conv2dgradweight. Pooling takes strided slices of the padded input, one per tap of the window
(its stride the pooling's, its start the tap's offset times the dilation), and reduces them (`amax`, `sum`).
"""

from __future__ import annotations

import math
from typing import Any

from deepx_core.errors import DeepxError
from deepx_core.ir.ops import conv2d_geometry
from deepx_sdk.amp import lower, upper
from deepx_sdk.amp import state as _amp
from deepx_sdk.tensor import Tensor, _tp, _vec, _vp, stack

__all__ = ["adaptive_avg_pool2d", "avg_pool2d", "batch_norm", "conv1d", "conv2d", "conv_transpose2d", "dropout2d",
           "group_norm", "interpolate", "max_pool2d"]


def _pair(what: str, value: Any, name: str) -> tuple[int, int]:
    items = tuple(value) if isinstance(value, (tuple, list)) else (value, value)
    if len(items) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) for v in items):
        raise DeepxError(f"{what}: {name} must be an int or a pair of ints, got {value!r}")
    return int(items[0]), int(items[1])


def _out_size(what: str, size: int, k: int, s: int, p: int, d: int) -> int:
    n = (size + 2 * p - d * (k - 1) - 1) // s + 1
    if n < 1:
        raise DeepxError(f"{what}: the input's spatial size {size} (padded by {p}) is smaller than the kernel "
                         f"({k}, dilation {d})")
    return n


def _taps(x: Tensor, kh: int, kw: int, sh: int, sw: int, dh: int, dw: int, oh: int, ow: int) -> list[Tensor]:
    """The kernel's taps over a padded (N, C, H, W) input: kh * kw strided slices, each (N, C, oh, ow)."""
    out = []
    for i in range(kh):
        for j in range(kw):
            h0, w0 = i * dh, j * dw
            out.append(x[:, :, h0:h0 + sh * (oh - 1) + 1:sh, w0:w0 + sw * (ow - 1) + 1:sw])
    return out


def _padded(x: Tensor, ph: int, pw: int, value: float = 0.0) -> Tensor:
    from deepx_sdk.nn.functional import pad

    return pad(x, (pw, pw, ph, ph), value=value) if ph or pw else x


def conv2d(input: Tensor, weight: Tensor, bias: Tensor | None = None, stride: Any = 1, padding: Any = 0,
           dilation: Any = 1, groups: int = 1) -> Tensor:
    """torch.nn.functional.conv2d: input (N, C, H, W) or (C, H, W), weight (O, C / groups, kh, kw); padding an int,
    a pair, 'valid' or 'same' (stride 1)."""
    if _amp.dtype is not None:
        input, weight, bias = lower(input, weight, bias)
    if input.ndim == 3:
        return conv2d(input.unsqueeze(0), weight, bias, stride, padding, dilation, groups).squeeze(0)
    if input.ndim != 4 or weight.ndim != 4:
        raise DeepxError(f"conv2d: expected a 4-D input and weight, got shapes {list(input.shape)} and "
                         f"{list(weight.shape)}")
    n = input.shape[0]
    o, _, kh, kw = weight.shape
    sh, sw = _pair("conv2d", stride, "stride")
    dh, dw = _pair("conv2d", dilation, "dilation")
    if padding == "valid":
        ph = pw = 0
    elif padding == "same":
        if (sh, sw) != (1, 1):
            raise DeepxError("conv2d: padding='same' needs stride 1, as in torch")
        th, tw = dh * (kh - 1), dw * (kw - 1)
        if th % 2 or tw % 2:  # torch pads the extra one after
            from deepx_sdk.nn.functional import pad

            input = pad(input, (tw // 2, tw - tw // 2, th // 2, th - th // 2))
            return conv2d(input, weight, bias, 1, 0, (dh, dw), groups)
        ph, pw = th // 2, tw // 2
    else:
        ph, pw = _pair("conv2d", padding, "padding")
    oh, ow = conv2d_geometry("conv2d", input.shape, weight.shape, (sh, sw), (ph, pw), (dh, dw), groups)
    params = (_tp(input), _tp(weight), _vec((sh, sw)), _vec((ph, pw)), _vec((dh, dw)), _vp(int(groups)))
    out = input._op("conv2d", params, (n, o, oh, ow), weight.dtype, [input, weight])
    return out if bias is None else out + bias.reshape(1, o, 1, 1)


def _conv2d_taps(input: Tensor, weight: Tensor, n: int, c: int, o: int, cg: int, kh: int, kw: int,
                 stride: tuple[int, int], padding: tuple[int, int], dilation: tuple[int, int], groups: int, oh: int,
                 ow: int) -> Tensor:
    """conv2d without bias as im2col of strided slices and one batched matmul per group: what the op replaced,
    kept as the peer bench/conv.py measures it against."""
    (sh, sw), (ph, pw), (dh, dw) = stride, padding, dilation
    x = _padded(input, ph, pw)
    if (kh, kw, sh, sw) == (1, 1, 1, 1):
        cols = x.reshape(n, c, oh * ow)
    else:
        cols = stack(_taps(x, kh, kw, sh, sw, dh, dw, oh, ow), 2).reshape(n, c * kh * kw, oh * ow)
    if groups == 1:
        out = weight.reshape(o, c * kh * kw) @ cols
    else:
        out = weight.reshape(groups, o // groups, cg * kh * kw) @ cols.reshape(n, groups, cg * kh * kw, oh * ow)
    return out.reshape(n, o, oh, ow)


def conv1d(input: Tensor, weight: Tensor, bias: Tensor | None = None, stride: Any = 1, padding: Any = 0,
           dilation: Any = 1, groups: int = 1) -> Tensor:
    """torch.nn.functional.conv1d: conv2d over a height of one."""
    if _amp.dtype is not None:
        input, weight, bias = lower(input, weight, bias)
    if input.ndim == 2:
        return conv1d(input.unsqueeze(0), weight, bias, stride, padding, dilation, groups).squeeze(0)
    if input.ndim != 3 or weight.ndim != 3:
        raise DeepxError(f"conv1d: expected a 3-D input and weight, got shapes {list(input.shape)} and "
                         f"{list(weight.shape)}")
    def one(v: Any) -> Any:
        return v[0] if isinstance(v, (tuple, list)) else v

    pad_arg = padding if isinstance(padding, str) else (0, one(padding))
    out = conv2d(input.unsqueeze(2), weight.unsqueeze(2), bias, (1, one(stride)), pad_arg, (1, one(dilation)), groups)
    return out.squeeze(2)


def _spread(x: Tensor, sh: int, sw: int) -> Tensor:
    """(N, C, H, W) with sh - 1 zero rows between rows and sw - 1 zero columns between columns (a strided transposed
    convolution's input), by pad and reshape: (N, C, H, 1, W, 1) padded to (N, C, H, sh, W, sw), then cut."""
    from deepx_sdk.nn.functional import pad

    if (sh, sw) == (1, 1):
        return x
    n, c, h, w = x.shape
    y = pad(x.reshape(n, c, h, 1, w, 1), (0, sw - 1, 0, 0, 0, sh - 1))
    return y.reshape(n, c, h * sh, w * sw)[:, :, :(h - 1) * sh + 1, :(w - 1) * sw + 1]


def conv_transpose2d(input: Tensor, weight: Tensor, bias: Tensor | None = None, stride: Any = 1, padding: Any = 0,
                     output_padding: Any = 0, groups: int = 1, dilation: Any = 1) -> Tensor:
    """torch.nn.functional.conv_transpose2d (weight (C, O / groups, kh, kw)): the gradient of a convolution, made as
    one: the input spread by the stride, then a stride-1 convolution with the kernel flipped and in and out swapped,
    padded by dilation * (k - 1) - padding (and output_padding more at the end)."""
    if _amp.dtype is not None:
        input, weight, bias = lower(input, weight, bias)
    from deepx_sdk.nn.functional import pad

    if input.ndim == 3:
        return conv_transpose2d(input.unsqueeze(0), weight, bias, stride, padding, output_padding, groups,
                                dilation).squeeze(0)
    if input.ndim != 4 or weight.ndim != 4:
        raise DeepxError(f"conv_transpose2d: expected a 4-D input and weight, got shapes {list(input.shape)} and "
                         f"{list(weight.shape)}")
    c, og, kh, kw = weight.shape
    if input.shape[1] != c or c % groups:
        raise DeepxError(f"conv_transpose2d: input with {input.shape[1]} channels and weight {list(weight.shape)} "
                         f"(groups={groups}) do not fit")
    sh, sw = _pair("conv_transpose2d", stride, "stride")
    ph, pw = _pair("conv_transpose2d", padding, "padding")
    oph, opw = _pair("conv_transpose2d", output_padding, "output_padding")
    dh, dw = _pair("conv_transpose2d", dilation, "dilation")
    if oph >= max(sh, dh) or opw >= max(sw, dw):
        raise DeepxError("conv_transpose2d: output_padding must be smaller than either stride or dilation")
    eh, ew = dh * (kh - 1) - ph, dw * (kw - 1) - pw
    x = _spread(input, sh, sw)
    if eh < 0 or ew < 0:  # more padding than the kernel reaches: the result is cut instead
        x = pad(x, (max(ew, 0), max(ew, 0) + opw, max(eh, 0), max(eh, 0) + oph))
        cut_h, cut_w = max(-eh, 0), max(-ew, 0)
    else:
        x = pad(x, (ew, ew + opw, eh, eh + oph))
        cut_h = cut_w = 0
    # (C, O/g, kh, kw) -> (O, C/g, kh, kw), flipped in space
    w = weight.reshape(groups, c // groups, og, kh, kw).transpose(1, 2).reshape(groups * og, c // groups, kh, kw)
    from deepx_sdk.composite import flip

    out = conv2d(x, flip(w, [2, 3]), None, 1, 0, (dh, dw), groups)
    if cut_h or cut_w:
        out = out[:, :, cut_h:out.shape[2] - cut_h, cut_w:out.shape[3] - cut_w]
    return out if bias is None else out + bias.reshape(1, -1, 1, 1)


def interpolate(input: Tensor, size: Any = None, scale_factor: Any = None, mode: str = "nearest",
                align_corners: bool | None = None, recompute_scale_factor: bool | None = None,
                antialias: bool = False) -> Tensor:
    """Resize the spatial dims of (N, C, H, W) (or (N, C, L)): mode 'nearest' (torch's floor rule) or 'bilinear'
    ('linear' for 3-D), with align_corners as torch; gathers with indices and weights worked out on the host."""
    import numpy as np

    from deepx_sdk.tensor import tensor

    if antialias:
        raise DeepxError("interpolate: antialias=True is not supported by deepx")
    if input.ndim not in (3, 4):
        raise DeepxError(f"interpolate: expected a 3-D or 4-D input, got shape {list(input.shape)}")
    spatial = input.shape[2:]
    k = len(spatial)
    if (size is None) == (scale_factor is None):
        raise DeepxError("interpolate: give exactly one of size and scale_factor")
    if size is not None:
        out_sizes = [int(v) for v in (size if isinstance(size, (tuple, list)) else [size] * k)]
        scales = [s / o for s, o in zip(spatial, out_sizes)]
    else:
        factors = [float(v) for v in (scale_factor if isinstance(scale_factor, (tuple, list)) else
                                      [scale_factor] * k)]
        out_sizes = [math.floor(s * f) for s, f in zip(spatial, factors)]
        scales = [1.0 / f if not recompute_scale_factor else s / o for s, f, o in zip(spatial, factors, out_sizes)]
    if len(out_sizes) != k:
        raise DeepxError(f"interpolate: {len(out_sizes)} sizes for {k} spatial dims")
    linear = {3: "linear", 4: "bilinear"}[input.ndim]
    if mode not in ("nearest", linear):
        raise DeepxError(f"interpolate: mode {mode!r} is not supported for a {input.ndim}-D input by deepx (nearest, "
                         f"{linear})")
    if mode == "nearest" and align_corners is not None:
        raise DeepxError("interpolate: align_corners applies to the linear modes only")
    x = input
    for axis, (n_in, n_out, scale) in enumerate(zip(spatial, out_sizes, scales)):
        dim = 2 + axis
        head = (slice(None),) * dim
        dst = np.arange(n_out, dtype=np.float64)
        if mode == "nearest":
            src = np.minimum(np.floor(dst * scale).astype(np.int64), n_in - 1)
            x = x[(*head, tensor(src))]
            continue
        if align_corners:
            pos = dst * ((n_in - 1) / (n_out - 1)) if n_out > 1 else np.zeros(n_out)
        else:
            pos = np.maximum((dst + 0.5) * scale - 0.5, 0.0)
        lo = np.minimum(np.floor(pos).astype(np.int64), n_in - 1)
        hi = np.minimum(lo + 1, n_in - 1)
        frac = (pos - lo).reshape(-1, *([1] * (x.ndim - dim - 1)))
        wt = tensor(frac.astype(np.float32 if x.dtype == "float32" else np.float64)).to(x.dtype)
        a, b = x[(*head, tensor(lo))], x[(*head, tensor(hi))]
        x = a + (b - a) * wt
    return x


def _pool_args(what: str, kernel_size: Any, stride: Any, padding: Any, dilation: Any
               ) -> tuple[int, int, int, int, int, int, int, int]:
    kh, kw = _pair(what, kernel_size, "kernel_size")
    sh, sw = _pair(what, stride, "stride") if stride is not None and stride != [] else (kh, kw)
    ph, pw = _pair(what, padding, "padding")
    dh, dw = _pair(what, dilation, "dilation")
    if ph > kh // 2 or pw > kw // 2:
        raise DeepxError(f"{what}: padding should be at most half the kernel size, as torch requires")
    return kh, kw, sh, sw, ph, pw, dh, dw


def _pool_size(what: str, size: int, k: int, s: int, p: int, d: int, ceil_mode: bool) -> tuple[int, int]:
    """A pooling's output size along one dim, and how far its last window reaches past the padded input (ceil_mode:
    as torch, the last window may hang over the end, but must start inside the input or its left padding)."""
    n = _out_size(what, size, k, s, p, d)
    if ceil_mode:
        span = size + 2 * p - d * (k - 1) - 1
        n = -(-span // s) + 1
        if (n - 1) * s >= size + p:
            n -= 1
    return n, max(0, (n - 1) * s + d * (k - 1) + 1 - (size + 2 * p))


def _pool_padded(x: Tensor, ph: int, pw: int, over_h: int, over_w: int, value: float) -> Tensor:
    """x padded by (ph, pw) on each side and by (over_h, over_w) more after (where ceil_mode's last windows hang)."""
    from deepx_sdk.nn.functional import pad

    if not (ph or pw or over_h or over_w):
        return x
    return pad(x, (pw, pw + over_w, ph, ph + over_h), value=value)


def _spatial(x: Tensor, what: str) -> tuple[Tensor, bool]:
    if x.ndim == 3:
        return x.unsqueeze(0), True
    if x.ndim != 4:
        raise DeepxError(f"{what}: expected a 3-D or 4-D input, got shape {list(x.shape)}")
    return x, False


def _pool_op(op: str, x: Tensor, kernel: tuple[int, int], stride: tuple[int, int], dilation: tuple[int, int],
             oh: int, ow: int) -> Tensor:
    """maxpool2d or sumpool2d over x, padded already: one op (its gradient op, maxpool2dgrad or sumpool2dgrad)."""
    params = (_tp(x), _vec(kernel), _vec(stride), _vec(dilation))
    return x._op(op, params, (x.shape[0], x.shape[1], oh, ow), x.dtype, [x])


def max_pool2d(input: Tensor, kernel_size: Any, stride: Any = None, padding: Any = 0, dilation: Any = 1,
               ceil_mode: bool = False, return_indices: bool = False) -> Tensor:
    """The maximum over each window (padding counts as -inf, so it is never the maximum)."""
    if return_indices:
        raise DeepxError("max_pool2d: return_indices=True is not supported by deepx")
    x, one = _spatial(input, "max_pool2d")
    kh, kw, sh, sw, ph, pw, dh, dw = _pool_args("max_pool2d", kernel_size, stride, padding, dilation)
    oh, over_h = _pool_size("max_pool2d", x.shape[2], kh, sh, ph, dh, ceil_mode)
    ow, over_w = _pool_size("max_pool2d", x.shape[3], kw, sw, pw, dw, ceil_mode)
    padded = _pool_padded(x, ph, pw, over_h, over_w, -math.inf)
    out = _pool_op("maxpool2d", padded, (kh, kw), (sh, sw), (dh, dw), oh, ow)
    return out.squeeze(0) if one else out


def avg_pool2d(input: Tensor, kernel_size: Any, stride: Any = None, padding: Any = 0, ceil_mode: bool = False,
               count_include_pad: bool = True, divisor_override: int | None = None) -> Tensor:
    """The mean over each window; with count_include_pad=False the padding is left out of each window's count."""
    from deepx_sdk.tensor import ones

    x, one = _spatial(input, "avg_pool2d")
    kh, kw, sh, sw, ph, pw, _, _ = _pool_args("avg_pool2d", kernel_size, stride, padding, 1)
    oh, over_h = _pool_size("avg_pool2d", x.shape[2], kh, sh, ph, 1, ceil_mode)
    ow, over_w = _pool_size("avg_pool2d", x.shape[3], kw, sw, pw, 1, ceil_mode)
    total = _pool_op("sumpool2d", _pool_padded(x, ph, pw, over_h, over_w, 0.0), (kh, kw), (sh, sw), (1, 1), oh, ow)
    if divisor_override is not None:
        out = total / float(divisor_override)
    elif not (over_h or over_w) and (count_include_pad or not (ph or pw)):
        out = total / float(kh * kw)
    else:  # each window's count: its cells inside the input (and its padding, count_include_pad), never the overhang
        if count_include_pad:
            inside = _pool_padded(ones(1, 1, x.shape[2] + 2 * ph, x.shape[3] + 2 * pw, dtype=x.dtype), 0, 0,
                                  over_h, over_w, 0.0)
        else:
            inside = _pool_padded(ones(1, 1, x.shape[2], x.shape[3], dtype=x.dtype), ph, pw, over_h, over_w, 0.0)
        count = _pool_op("sumpool2d", inside, (kh, kw), (sh, sw), (1, 1), oh, ow)
        out = total / count
    return out.squeeze(0) if one else out


def adaptive_avg_pool2d(input: Tensor, output_size: Any) -> Tensor:
    """torch's bins: output cell i covers rows floor(i H / oh) to ceil((i + 1) H / oh); None keeps that size."""
    x, one = _spatial(input, "adaptive_avg_pool2d")
    sizes = tuple(output_size) if isinstance(output_size, (tuple, list)) else (output_size, output_size)
    oh, ow = (x.shape[2] if sizes[0] is None else int(sizes[0])), (x.shape[3] if sizes[1] is None else int(sizes[1]))
    h, w = x.shape[2], x.shape[3]
    if (oh, ow) == (1, 1):
        out = x.mean((2, 3), keepdim=True)
    elif h % oh == 0 and w % ow == 0:
        out = avg_pool2d(x, (h // oh, w // ow))
    else:
        rows = stack([x[:, :, (i * h) // oh:-((-(i + 1) * h) // oh)].mean(2) for i in range(oh)], 2)
        out = stack([rows[:, :, :, (j * w) // ow:-((-(j + 1) * w) // ow)].mean(3) for j in range(ow)], 3)
    return out.squeeze(0) if one else out


def _per_channel(t: Tensor, ndim: int) -> Tensor:
    return t.reshape(1, t.shape[0], *([1] * (ndim - 2)))


def batch_norm(input: Tensor, running_mean: Tensor | None, running_var: Tensor | None, weight: Tensor | None = None,
               bias: Tensor | None = None, training: bool = False, momentum: float | None = 0.1,
               eps: float = 1e-5) -> Tensor:
    """Normalise each channel (dim 1) by the batch's statistics (training, updating the running ones in place with
    `momentum`, the variance unbiased as torch keeps it) or by the running ones."""
    from deepx_sdk.grad_mode import no_grad

    if input.ndim < 2:
        raise DeepxError(f"batch_norm: expected an input of at least 2 dims (N, C, ...), got {list(input.shape)}")
    dims = [0, *range(2, input.ndim)]
    if training:
        count = input.numel() // input.shape[1]
        if count < 2:
            raise DeepxError(f"batch_norm: expected more than 1 value per channel when training, got input of shape "
                             f"{list(input.shape)}")
        mean = input.mean(dims, keepdim=True)
        centered = input - mean
        var = (centered * centered).mean(dims, keepdim=True)
        if running_mean is not None and running_var is not None:
            m = 0.1 if momentum is None else float(momentum)
            with no_grad():
                flat_mean = mean.detach().reshape(-1)
                unbiased = var.detach().reshape(-1) * (count / (count - 1))
                running_mean.copy_(running_mean * (1 - m) + flat_mean * m)
                running_var.copy_(running_var * (1 - m) + unbiased * m)
        out = centered / (var + eps).sqrt()
    else:
        if running_mean is None or running_var is None:
            raise DeepxError("batch_norm: running statistics are needed when not training")
        out = (input - _per_channel(running_mean, input.ndim)) / (_per_channel(running_var, input.ndim) + eps).sqrt()
    if weight is not None:
        out = out * _per_channel(weight, input.ndim)
    if bias is not None:
        out = out + _per_channel(bias, input.ndim)
    return out


def group_norm(input: Tensor, num_groups: int, weight: Tensor | None = None, bias: Tensor | None = None,
               eps: float = 1e-5) -> Tensor:
    """Normalise each group of channels of each sample by its own mean and (biased) variance."""
    if _amp.dtype is not None:
        input, weight, bias = upper(input), upper(weight), upper(bias)
    n, c = input.shape[0], input.shape[1]
    if c % num_groups:
        raise DeepxError(f"group_norm: {c} channels do not split into {num_groups} groups")
    g = input.reshape(n, num_groups, -1)
    mean = g.mean(2, keepdim=True)
    centered = g - mean
    var = (centered * centered).mean(2, keepdim=True)
    out = (centered / (var + eps).sqrt()).reshape(input.shape)
    if weight is not None:
        out = out * _per_channel(weight, input.ndim)
    if bias is not None:
        out = out + _per_channel(bias, input.ndim)
    return out


def dropout2d(input: Tensor, p: float = 0.5, training: bool = True, inplace: bool = False) -> Tensor:
    """Zero whole channels with probability p (one draw per sample and channel), scaling the rest by 1 / (1 - p)."""
    from deepx_sdk.tensor import rand

    if not 0 <= p <= 1:
        raise DeepxError(f"dropout2d: p must be between 0 and 1, got {p}")
    if not training or p == 0:
        return input
    if p == 1:
        out = input * 0.0
    else:
        keep = (rand(input.shape[0], input.shape[1], *([1] * (input.ndim - 2)), dtype=input.dtype) >= p)
        out = input * keep.to(input.dtype) * (1.0 / (1 - p))
    return input.copy_(out) if inplace else out
