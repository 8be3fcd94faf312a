"""torch.nn.init's in-place initializers, recorded on the tensor they fill (parameters stay the same heap tensor)."""

from __future__ import annotations

import math
from typing import Any

from deepx_core.errors import DeepxError
from deepx_sdk.tensor import Tensor

_GAINS = {"linear": 1.0, "conv1d": 1.0, "conv2d": 1.0, "conv3d": 1.0, "sigmoid": 1.0, "tanh": 5.0 / 3,
          "relu": math.sqrt(2.0), "selu": 3.0 / 4}


def calculate_gain(nonlinearity: str, param: float | None = None) -> float:
    if nonlinearity == "leaky_relu":
        slope = 0.01 if param is None else float(param)
        return math.sqrt(2.0 / (1 + slope**2))
    if nonlinearity not in _GAINS:
        raise DeepxError(f"calculate_gain: unsupported nonlinearity {nonlinearity!r}")
    return _GAINS[nonlinearity]


def _fans(t: Tensor) -> tuple[int, int]:
    if t.ndim < 2:
        raise DeepxError(f"fan in and fan out can not be computed for a tensor with fewer than 2 dimensions "
                         f"(shape {list(t.shape)})")
    field = math.prod(t.shape[2:])
    return t.shape[1] * field, t.shape[0] * field


def _fan(t: Tensor, mode: str) -> int:
    if mode not in ("fan_in", "fan_out"):
        raise DeepxError(f"mode {mode!r} is not supported; use 'fan_in' or 'fan_out'")
    fan_in, fan_out = _fans(t)
    return fan_in if mode == "fan_in" else fan_out


def uniform_(tensor: Tensor, a: float = 0.0, b: float = 1.0, generator: Any = None) -> Tensor:
    return tensor.uniform_(a, b)


def normal_(tensor: Tensor, mean: float = 0.0, std: float = 1.0, generator: Any = None) -> Tensor:
    return tensor.normal_(mean, std)


def constant_(tensor: Tensor, val: float) -> Tensor:
    return tensor.fill_(val)


def zeros_(tensor: Tensor) -> Tensor:
    return tensor.zero_()


def ones_(tensor: Tensor) -> Tensor:
    return tensor.fill_(1)


def xavier_uniform_(tensor: Tensor, gain: float = 1.0, generator: Any = None) -> Tensor:
    fan_in, fan_out = _fans(tensor)
    a = gain * math.sqrt(6.0 / (fan_in + fan_out))
    return tensor.uniform_(-a, a)


def xavier_normal_(tensor: Tensor, gain: float = 1.0, generator: Any = None) -> Tensor:
    fan_in, fan_out = _fans(tensor)
    return tensor.normal_(0.0, gain * math.sqrt(2.0 / (fan_in + fan_out)))


def kaiming_uniform_(tensor: Tensor, a: float = 0.0, mode: str = "fan_in", nonlinearity: str = "leaky_relu",
                     generator: Any = None) -> Tensor:
    std = calculate_gain(nonlinearity, a) / math.sqrt(_fan(tensor, mode))
    bound = math.sqrt(3.0) * std
    return tensor.uniform_(-bound, bound)


def kaiming_normal_(tensor: Tensor, a: float = 0.0, mode: str = "fan_in", nonlinearity: str = "leaky_relu",
                    generator: Any = None) -> Tensor:
    return tensor.normal_(0.0, calculate_gain(nonlinearity, a) / math.sqrt(_fan(tensor, mode)))


__all__ = ["calculate_gain", "constant_", "kaiming_normal_", "kaiming_uniform_", "normal_", "ones_", "uniform_",
           "xavier_normal_", "xavier_uniform_", "zeros_"]
