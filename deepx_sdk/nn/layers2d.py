"""Modules of convolutional nets: Conv1d, Conv2d, ConvTranspose2d, MaxPool2d, AvgPool2d, AdaptiveAvgPool2d,
BatchNorm1d/2d, GroupNorm, Dropout2d, Upsample, with torch's arguments, initialisation and state
(deepx_sdk/nn/vision.py computes them)."""

from __future__ import annotations

import math
from typing import Any

from deepx_core.errors import DeepxError
from deepx_sdk.nn import vision as V
from deepx_sdk.nn.module import Module
from deepx_sdk.nn.parameter import Parameter, heap_parameter
from deepx_sdk.tensor import Tensor, ones, tensor, zeros

__all__ = ["AdaptiveAvgPool2d", "AvgPool2d", "BatchNorm1d", "BatchNorm2d", "Conv1d", "Conv2d", "ConvTranspose2d",
           "Dropout2d", "GroupNorm", "MaxPool2d", "Upsample"]


class _ConvNd(Module):
    weight: Parameter
    bias: Parameter | None

    def __init__(self, dims: int, in_channels: int, out_channels: int, kernel_size: Any, stride: Any, padding: Any,
                 dilation: Any, groups: int, bias: bool, padding_mode: str, dtype: Any) -> None:
        super().__init__()
        name = type(self).__name__
        if padding_mode != "zeros":
            raise DeepxError(f"{name}: padding_mode={padding_mode!r} is not supported by deepx (only 'zeros')")
        if groups < 1 or in_channels % groups or out_channels % groups:
            raise DeepxError(f"{name}: in_channels ({in_channels}) and out_channels ({out_channels}) must be "
                             f"divisible by groups ({groups})")

        def tup(v: Any) -> tuple[int, ...]:
            return tuple(int(x) for x in v) if isinstance(v, (tuple, list)) else (int(v),) * dims

        self.in_channels, self.out_channels, self.groups = int(in_channels), int(out_channels), int(groups)
        self.kernel_size, self.stride, self.dilation = tup(kernel_size), tup(stride), tup(dilation)
        self.padding = padding if isinstance(padding, str) else tup(padding)
        self.padding_mode = padding_mode
        if getattr(self, "_transposed", False):
            self.weight = heap_parameter(in_channels, out_channels // groups, *self.kernel_size, dtype=dtype)
        else:
            self.weight = heap_parameter(out_channels, in_channels // groups, *self.kernel_size, dtype=dtype)
        if bias:
            self.bias = heap_parameter(out_channels, dtype=dtype)
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # kaiming_uniform_(a=sqrt(5)) is U(-1/sqrt(fan_in), 1/sqrt(fan_in)); the bias the same bound, as torch
        fan_in = self.weight.shape[1] * math.prod(self.kernel_size)
        bound = 1.0 / math.sqrt(fan_in) if fan_in > 0 else 0.0
        self.weight.uniform_(-bound, bound)
        if self.bias is not None:
            self.bias.uniform_(-bound, bound)

    def extra_repr(self) -> str:
        s = f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, stride={self.stride}"
        if self.padding != (0,) * len(self.kernel_size):
            s += f", padding={self.padding!r}" if isinstance(self.padding, str) else f", padding={self.padding}"
        if self.dilation != (1,) * len(self.kernel_size):
            s += f", dilation={self.dilation}"
        if self.groups != 1:
            s += f", groups={self.groups}"
        return s + (", bias=False" if self.bias is None else "")


class Conv2d(_ConvNd):
    def __init__(self, in_channels: int, out_channels: int, kernel_size: Any, stride: Any = 1, padding: Any = 0,
                 dilation: Any = 1, groups: int = 1, bias: bool = True, padding_mode: str = "zeros",
                 device: Any = None, dtype: Any = None) -> None:
        super().__init__(2, in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias,
                         padding_mode, dtype)

    def forward(self, x: Tensor) -> Tensor:
        return V.conv2d(x, self.weight, self.bias, self.stride, self.padding, self.dilation, self.groups)


class Conv1d(_ConvNd):
    def __init__(self, in_channels: int, out_channels: int, kernel_size: Any, stride: Any = 1, padding: Any = 0,
                 dilation: Any = 1, groups: int = 1, bias: bool = True, padding_mode: str = "zeros",
                 device: Any = None, dtype: Any = None) -> None:
        super().__init__(1, in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias,
                         padding_mode, dtype)

    def forward(self, x: Tensor) -> Tensor:
        return V.conv1d(x, self.weight, self.bias, self.stride, self.padding, self.dilation, self.groups)


class ConvTranspose2d(_ConvNd):
    """The transposed convolution: weight (in, out / groups, kh, kw), initialised as torch's (fan_in from the
    weight's second dim)."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: Any, stride: Any = 1, padding: Any = 0,
                 output_padding: Any = 0, groups: int = 1, bias: bool = True, dilation: Any = 1,
                 padding_mode: str = "zeros", device: Any = None, dtype: Any = None) -> None:
        self._transposed = True
        super().__init__(2, in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias,
                         padding_mode, dtype)
        self.output_padding = tuple(output_padding) if isinstance(output_padding, (tuple, list)) else (
            int(output_padding),) * 2

    def forward(self, x: Tensor) -> Tensor:
        return V.conv_transpose2d(x, self.weight, self.bias, self.stride, self.padding, self.output_padding,
                                  self.groups, self.dilation)


class Upsample(Module):
    def __init__(self, size: Any = None, scale_factor: Any = None, mode: str = "nearest",
                 align_corners: bool | None = None) -> None:
        super().__init__()
        self.size, self.scale_factor, self.mode, self.align_corners = size, scale_factor, mode, align_corners

    def forward(self, x: Tensor) -> Tensor:
        return V.interpolate(x, self.size, self.scale_factor, self.mode, self.align_corners)

    def extra_repr(self) -> str:
        return f"size={self.size}, scale_factor={self.scale_factor}, mode={self.mode!r}"


class MaxPool2d(Module):
    def __init__(self, kernel_size: Any, stride: Any = None, padding: Any = 0, dilation: Any = 1,
                 return_indices: bool = False, ceil_mode: bool = False) -> None:
        super().__init__()
        self.kernel_size, self.stride, self.padding, self.dilation = kernel_size, stride, padding, dilation
        self.return_indices, self.ceil_mode = return_indices, ceil_mode

    def forward(self, x: Tensor) -> Tensor:
        return V.max_pool2d(x, self.kernel_size, self.stride, self.padding, self.dilation, self.ceil_mode,
                            self.return_indices)

    def extra_repr(self) -> str:
        return (f"kernel_size={self.kernel_size}, stride={self.stride or self.kernel_size}, padding={self.padding}, "
                f"dilation={self.dilation}, ceil_mode={self.ceil_mode}")


class AvgPool2d(Module):
    def __init__(self, kernel_size: Any, stride: Any = None, padding: Any = 0, ceil_mode: bool = False,
                 count_include_pad: bool = True, divisor_override: int | None = None) -> None:
        super().__init__()
        self.kernel_size, self.stride, self.padding = kernel_size, stride, padding
        self.ceil_mode, self.count_include_pad, self.divisor_override = ceil_mode, count_include_pad, divisor_override

    def forward(self, x: Tensor) -> Tensor:
        return V.avg_pool2d(x, self.kernel_size, self.stride, self.padding, self.ceil_mode, self.count_include_pad,
                            self.divisor_override)

    def extra_repr(self) -> str:
        return f"kernel_size={self.kernel_size}, stride={self.stride or self.kernel_size}, padding={self.padding}"


class AdaptiveAvgPool2d(Module):
    def __init__(self, output_size: Any) -> None:
        super().__init__()
        self.output_size = output_size

    def forward(self, x: Tensor) -> Tensor:
        return V.adaptive_avg_pool2d(x, self.output_size)

    def extra_repr(self) -> str:
        return f"output_size={self.output_size}"


class _BatchNorm(Module):
    weight: Parameter | None
    bias: Parameter | None
    _ndims: tuple[int, ...] = ()

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1, affine: bool = True,
                 track_running_stats: bool = True, device: Any = None, dtype: Any = None) -> None:
        super().__init__()
        self.num_features, self.eps, self.momentum = int(num_features), eps, momentum
        self.affine, self.track_running_stats = affine, track_running_stats
        if affine:
            self.weight = heap_parameter(num_features, dtype=dtype)
            self.bias = heap_parameter(num_features, dtype=dtype)
            self.weight.fill_(1.0)
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)
        if track_running_stats:
            self.register_buffer("running_mean", zeros(num_features, dtype=dtype))
            self.register_buffer("running_var", ones(num_features, dtype=dtype))
            self.register_buffer("num_batches_tracked", tensor(0))
        else:
            self.register_buffer("running_mean", None)
            self.register_buffer("running_var", None)
            self.register_buffer("num_batches_tracked", None)
        # num_batches_tracked as Python knows it (momentum=None averages over it), and the write of the tensor it was
        # read from: another write (a state_dict loaded) makes it read again
        self._tracked = 0
        self._seen: int | None = None

    def forward(self, x: Tensor) -> Tensor:
        if x.ndim not in self._ndims:
            raise DeepxError(f"{type(self).__name__}: expected a {' or '.join(f'{n}-D' for n in self._ndims)} input, "
                             f"got shape {list(x.shape)}")
        if x.shape[1] != self.num_features:
            raise DeepxError(f"{type(self).__name__}: expected {self.num_features} channels (dim 1), got "
                             f"{x.shape[1]}")
        momentum = self.momentum
        if self.training and self.track_running_stats:
            tracked = self.num_batches_tracked
            if momentum is None and getattr(tracked, "_w", None) != self._seen:
                self._tracked = int(tracked.item())
            self._tracked += 1
            tracked.add_(1)
            self._seen = getattr(tracked, "_w", None)
            if momentum is None:
                momentum = 1.0 / self._tracked
        # as torch's: batch statistics in training and where none are kept; the running ones updated where kept
        batch_stats = self.training or self.running_mean is None
        keep = not self.training or self.track_running_stats
        return V.batch_norm(x, self.running_mean if keep else None, self.running_var if keep else None, self.weight,
                            self.bias, batch_stats, 0.0 if momentum is None else momentum, self.eps)

    def extra_repr(self) -> str:
        return (f"{self.num_features}, eps={self.eps}, momentum={self.momentum}, affine={self.affine}, "
                f"track_running_stats={self.track_running_stats}")


class BatchNorm1d(_BatchNorm):
    _ndims = (2, 3)


class BatchNorm2d(_BatchNorm):
    _ndims = (4,)


class GroupNorm(Module):
    weight: Parameter | None
    bias: Parameter | None

    def __init__(self, num_groups: int, num_channels: int, eps: float = 1e-5, affine: bool = True,
                 device: Any = None, dtype: Any = None) -> None:
        super().__init__()
        if num_channels % num_groups:
            raise DeepxError(f"GroupNorm: num_channels ({num_channels}) must be divisible by num_groups "
                             f"({num_groups})")
        self.num_groups, self.num_channels, self.eps, self.affine = num_groups, num_channels, eps, affine
        if affine:
            self.weight = heap_parameter(num_channels, dtype=dtype)
            self.bias = heap_parameter(num_channels, dtype=dtype)
            self.weight.fill_(1.0)
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)

    def forward(self, x: Tensor) -> Tensor:
        return V.group_norm(x, self.num_groups, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{self.num_groups}, {self.num_channels}, eps={self.eps}, affine={self.affine}"


class Dropout2d(Module):
    def __init__(self, p: float = 0.5, inplace: bool = False) -> None:
        super().__init__()
        if not 0 <= p <= 1:
            raise DeepxError(f"Dropout2d: p must be between 0 and 1, got {p}")
        self.p, self.inplace = p, inplace

    def forward(self, x: Tensor) -> Tensor:
        return V.dropout2d(x, self.p, self.training, self.inplace)

    def extra_repr(self) -> str:
        return f"p={self.p}, inplace={self.inplace}"
