"""Convolution, pooling, normalisation and resizing for convolutional nets, on the ops of the catalogue.

A convolution is the `conv2d` op (on the CPU direct loops, or im2col in chunks and one GEMM per group,
deepxd/kernels/cpu/conv.py; on op-cuda a direct kernel, deepxd/kernels/cuda/conv.py), its gradient the ops
conv2dgradinput and conv2dgradweight. Pooling pads the input and runs `maxpool2d` or `sumpool2d`. Batch norm in
training and group norm are the `batchnorm` and `groupnorm` ops, which also return the statistics their gradient ops
read (and batchnormupdate folds into the running ones); batch norm in eval is `batchnormeval`.
`interpolate` is `interpnearest` or `interpbilinear`, on torch's source positions.
"""

from __future__ import annotations

import math
from typing import Any

from deepx_core.errors import DeepxError
from deepx_core.ir.instr import Instr
from deepx_core.ir.ops import conv2d_geometry, stats_dtype
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


def _nearest_1d(n_in: int, n_out: int, factor: float) -> list[int] | None:
    """torch's 1-D nearest source indices where they differ from the interpnearest op's (which copies a size that
    stays and halves one that doubles, as torch's 2-D kernel does, whatever the scale factor); None where they do
    not differ."""
    if factor <= 0 or n_out not in (n_in, 2 * n_in):
        return None
    import numpy as np

    scale = np.float32(1.0 / factor)
    src = [min(int(np.floor(np.float32(i) * scale)), n_in - 1) for i in range(n_out)]
    return None if src == [i if n_out == n_in else i >> 1 for i in range(n_out)] else src


def interpolate(input: Tensor, size: Any = None, scale_factor: Any = None, mode: str = "nearest",
                align_corners: bool | None = None, recompute_scale_factor: bool | None = None,
                antialias: bool = False) -> Tensor:
    """Resize the spatial dims of (N, C, H, W) (or (N, C, L)) as torch's interpolate: mode 'nearest' or 'bilinear'
    ('linear' for 3-D), align_corners as torch; the ops interpnearest and interpbilinear, which follow torch's
    source positions (a 3-D input runs as (N, C, 1, L))."""
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
        factors = [0.0] * k
    else:
        factors = [float(v) for v in (scale_factor if isinstance(scale_factor, (tuple, list)) else
                                      [scale_factor] * k)]
        if len(factors) != k:
            raise DeepxError(f"interpolate: {len(factors)} scale factors for {k} spatial dims")
        out_sizes = [math.floor(s * f) for s, f in zip(spatial, factors)]
        if recompute_scale_factor:  # torch's: the sizes' ratio, not the factor, sets the positions
            factors = [0.0] * k
    if len(out_sizes) != k:
        raise DeepxError(f"interpolate: {len(out_sizes)} sizes for {k} spatial dims")
    if any(o < 1 for o in out_sizes) or any(s < 1 for s in spatial):
        raise DeepxError(f"interpolate: input and output sizes should be greater than 0, got input {list(spatial)} "
                         f"and output {out_sizes}")
    linear = {3: "linear", 4: "bilinear"}[input.ndim]
    if mode not in ("nearest", linear):
        raise DeepxError(f"interpolate: mode {mode!r} is not supported for a {input.ndim}-D input by deepx (nearest, "
                         f"{linear})")
    if mode == "nearest" and align_corners is not None:
        raise DeepxError("interpolate: align_corners applies to the linear modes only")
    x = input
    if k == 1:
        if mode == "nearest":
            src = _nearest_1d(spatial[0], out_sizes[0], factors[0])
            if src is not None:  # torch's 1-D kernel has no shortcut for a size kept or doubled
                from deepx_sdk.tensor import tensor

                return x[:, :, tensor(src)]
        x = x.unsqueeze(2)
        out_sizes, factors = [1, *out_sizes], [0.0, *factors]
    size_p, sh, sw = _vec(tuple(out_sizes)), _vp(float(factors[0])), _vp(float(factors[1]))
    shape = (*x.shape[:2], *out_sizes)
    if mode == "nearest":
        out = x._op("interpnearest", (_tp(x), size_p, sh, sw), shape, x.dtype, [x])
    else:
        out = x._op("interpbilinear", (_tp(x), size_p, _vp(bool(align_corners)), sh, sw), shape, x.dtype, [x])
    return out.squeeze(2) if k == 1 else out


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


def _norm_op(name: str, x: Tensor, weight: Tensor | None, bias: Tensor | None, params: tuple[Any, ...],
             stats: tuple[int, ...]) -> tuple[Tensor, Tensor, Tensor]:
    """`name` (batchnorm or groupnorm) of x: its result and its statistics (mean and biased variance, of shape
    `stats`). A missing weight is ones, a missing bias zeros; both are cast to x's dtype. The statistics are held by
    the result's autograd node, whose backward reads them (batchnormgrad, groupnormgrad)."""
    w, b = _affine(x, weight, bias)
    st = stats_dtype(x.dtype)
    out, mean, var = x._new(x.shape, x.dtype), x._new(stats, st), x._new(stats, st)
    instr = Instr(name, (_tp(x), _tp(w), _tp(b), *params), (_tp(out), _tp(mean), _tp(var)))
    s = x._s
    s.recorder.record(instr)
    if s.grad_enabled and (x.requires_grad or w.requires_grad or b.requires_grad):
        out.requires_grad = True
        s.tape.append((instr, out, (x, w, b, mean, var)))
    return out, mean, var


def _affine(x: Tensor, weight: Tensor | None, bias: Tensor | None) -> tuple[Tensor, Tensor]:
    """A norm's weight and bias in x's dtype: ones and zeros where there are none (affine=False)."""
    from deepx_sdk.tensor import full

    c = x.shape[1]
    w = full((c,), 1.0, dtype=x.dtype) if weight is None else weight.type_as_dtype(x.dtype)
    b = full((c,), 0.0, dtype=x.dtype) if bias is None else bias.type_as_dtype(x.dtype)
    return w, b


def _channels(what: str, input: Tensor) -> int:
    if input.ndim < 2:
        raise DeepxError(f"{what}: expected an input of at least 2 dims (N, C, ...), got {list(input.shape)}")
    return input.shape[1]


def batch_norm(input: Tensor, running_mean: Tensor | None, running_var: Tensor | None, weight: Tensor | None = None,
               bias: Tensor | None = None, training: bool = False, momentum: float | None = 0.1,
               eps: float = 1e-5) -> Tensor:
    """Normalise each channel (dim 1) by the batch's statistics (training: the batchnorm op, then batchnormupdate
    folds them into the running ones in place with `momentum`, the variance unbiased, as torch) or by the running
    ones (batchnormeval)."""
    c = _channels("batch_norm", input)
    if training:
        count = input.numel() // c if c else 0
        if count < 2:
            raise DeepxError(f"batch_norm: expected more than 1 value per channel when training, got input of shape "
                             f"{list(input.shape)}")
        out, mean, var = _norm_op("batchnorm", input, weight, bias, (_vp(float(eps)),), (c,))
        if running_mean is not None or running_var is not None:
            if running_mean is None or running_var is None:
                raise DeepxError("batch_norm: give both running_mean and running_var, or neither")
            _update_running(running_mean, running_var, mean, var, 0.1 if momentum is None else float(momentum),
                            count)
        return out
    if running_mean is None or running_var is None:
        raise DeepxError("batch_norm: running statistics are needed when not training")
    for name, t in (("running_mean", running_mean), ("running_var", running_var), ("weight", weight),
                    ("bias", bias)):
        if t is not None and t.shape != (c,):
            raise DeepxError(f"batch_norm: {name} of shape {list(t.shape)} does not fit {c} channels (dim 1 of "
                             f"{list(input.shape)})")
    if input._s.grad_enabled and (running_mean.requires_grad or running_var.requires_grad):
        raise DeepxError("batch_norm: running_mean and running_var take no gradient (torch refuses them too); pass "
                         "them detached")
    st = stats_dtype(input.dtype)
    w, b = _affine(input, weight, bias)
    rm, rv = running_mean.type_as_dtype(st), running_var.type_as_dtype(st)
    return input._op("batchnormeval", (_tp(input), _tp(w), _tp(b), _tp(rm), _tp(rv), _vp(float(eps))), input.shape,
                     input.dtype, [input, w, b, rm, rv])


def _update_running(running_mean: Tensor, running_var: Tensor, mean: Tensor, var: Tensor, momentum: float,
                    count: int) -> None:
    """batchnormupdate: the running statistics, in place (no gradient, as torch's buffers)."""
    if running_mean.shape != mean.shape or running_var.shape != var.shape:
        raise DeepxError(f"batch_norm: running statistics of shapes {list(running_mean.shape)} and "
                         f"{list(running_var.shape)} do not fit {mean.shape[0]} channels")
    if running_var.dtype != running_mean.dtype:
        raise DeepxError(f"batch_norm: running_mean is {running_mean.dtype} but running_var {running_var.dtype}")
    for t in (running_mean, running_var):
        t._check_write("batch_norm's running statistics")
    s = mean._s
    s.recorder.record(Instr("batchnormupdate", (_tp(running_mean), _tp(running_var), _tp(mean), _tp(var),
                                                _vp(float(momentum)), _vp(int(count))),
                            (_tp(running_mean), _tp(running_var))))
    s.tape.wrote(running_mean)  # a graph that read the old values must not take the new ones for them
    s.tape.wrote(running_var)


def group_norm(input: Tensor, num_groups: int, weight: Tensor | None = None, bias: Tensor | None = None,
               eps: float = 1e-5) -> Tensor:
    """Normalise each group of channels of each sample by its own mean and (biased) variance: the groupnorm op."""
    if _amp.dtype is not None:
        input, weight, bias = upper(input), upper(weight), upper(bias)
    c = _channels("group_norm", input)
    if not isinstance(num_groups, int) or num_groups < 1 or c % num_groups:
        raise DeepxError(f"group_norm: {c} channels do not split into {num_groups} groups")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and t.shape != (c,):
            raise DeepxError(f"group_norm: {name} of shape {list(t.shape)} does not fit {c} channels")
    return _norm_op("groupnorm", input, weight, bias, (_vp(int(num_groups)), _vp(float(eps))),
                    (input.shape[0], num_groups))[0]


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
