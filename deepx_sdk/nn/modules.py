"""Layers and activations with torch.nn's names, arguments, initialization and repr."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from deepx_core.errors import DeepxError
from deepx_sdk.nn import functional as F
from deepx_sdk.nn.module import Module
from deepx_sdk.nn.parameter import Parameter, heap_parameter
from deepx_sdk.tensor import Tensor


class Linear(Module):
    """y = x @ weight.T + bias, initialized as torch does: weight and bias ~ U(-1/sqrt(in), 1/sqrt(in))."""

    weight: Parameter
    bias: Parameter | None

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device: Any = None,
                 dtype: Any = None) -> None:
        super().__init__()
        self.in_features = int(in_features)
        self.out_features = int(out_features)
        self.weight = heap_parameter(out_features, in_features, dtype=dtype)
        if bias:
            self.bias = heap_parameter(out_features, dtype=dtype)
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # kaiming_uniform_(a=sqrt(5)) on (out, in) is U(-1/sqrt(in), 1/sqrt(in)); the bias uses the same bound
        bound = 1.0 / math.sqrt(self.in_features) if self.in_features > 0 else 0.0
        self.weight.uniform_(-bound, bound)
        if self.bias is not None:
            self.bias.uniform_(-bound, bound)

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class Identity(Module):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()

    def forward(self, x: Any) -> Any:
        return x


class Embedding(Module):
    """A lookup table: weight[index]. weight ~ N(0, 1); the row of padding_idx is zeros."""

    weight: Parameter

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: int | None = None,
                 max_norm: float | None = None, norm_type: float = 2.0, scale_grad_by_freq: bool = False,
                 sparse: bool = False, _weight: Any = None, _freeze: bool = False, device: Any = None,
                 dtype: Any = None) -> None:
        super().__init__()
        if max_norm is not None:
            raise DeepxError("Embedding: max_norm is not supported yet; leave it None")
        if sparse:
            raise DeepxError("Embedding: sparse gradients are not supported; leave sparse=False")
        self.num_embeddings = int(num_embeddings)
        self.embedding_dim = int(embedding_dim)
        if padding_idx is not None:
            if not -self.num_embeddings <= padding_idx < self.num_embeddings:
                raise DeepxError(f"Embedding: padding_idx {padding_idx} must be within num_embeddings "
                                 f"({self.num_embeddings})")
            padding_idx %= self.num_embeddings
        self.padding_idx = padding_idx
        self.max_norm = max_norm
        self.norm_type = norm_type
        self.scale_grad_by_freq = scale_grad_by_freq
        self.sparse = sparse
        if _weight is None:
            self.weight = heap_parameter(num_embeddings, embedding_dim, dtype=dtype, requires_grad=not _freeze)
            self.reset_parameters()
        else:
            w = Parameter(_weight, requires_grad=not _freeze)
            if w.shape != (self.num_embeddings, self.embedding_dim):
                raise DeepxError(f"Embedding: _weight has shape {list(w.shape)}, expected "
                                 f"{[self.num_embeddings, self.embedding_dim]}")
            self.weight = w

    def reset_parameters(self) -> None:
        self.weight.normal_(0.0, 1.0)
        if self.padding_idx is not None:
            self.weight[self.padding_idx] = 0.0

    @classmethod
    def from_pretrained(cls, embeddings: Any, freeze: bool = True, padding_idx: int | None = None,
                        **kwargs: Any) -> Embedding:
        shape = embeddings.shape
        if len(shape) != 2:
            raise DeepxError(f"Embedding.from_pretrained: embeddings must be 2-D, got shape {list(shape)}")
        return cls(shape[0], shape[1], padding_idx=padding_idx, _weight=embeddings, _freeze=freeze, **kwargs)

    def forward(self, index: Tensor) -> Tensor:
        return F.embedding(index, self.weight, self.padding_idx, scale_grad_by_freq=self.scale_grad_by_freq)

    def extra_repr(self) -> str:
        s = f"{self.num_embeddings}, {self.embedding_dim}"
        if self.padding_idx is not None:
            s += f", padding_idx={self.padding_idx}"
        if self.norm_type != 2:
            s += f", norm_type={self.norm_type}"
        if self.scale_grad_by_freq:
            s += f", scale_grad_by_freq={self.scale_grad_by_freq}"
        return s


_FLOAT32_EPS = float(np.finfo(np.float32).eps)


def _shape(normalized_shape: Any) -> tuple[int, ...]:
    if isinstance(normalized_shape, int):
        return (normalized_shape,)
    return tuple(int(d) for d in normalized_shape)


class LayerNorm(Module):
    """(x - mean) / sqrt(var + eps) * weight + bias over the last len(normalized_shape) dims."""

    weight: Parameter | None
    bias: Parameter | None

    def __init__(self, normalized_shape: Any, eps: float = 1e-5, elementwise_affine: bool = True, bias: bool = True,
                 device: Any = None, dtype: Any = None) -> None:
        super().__init__()
        self.normalized_shape = _shape(normalized_shape)
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        if elementwise_affine:
            self.weight = heap_parameter(*self.normalized_shape, dtype=dtype)
            if bias:
                self.bias = heap_parameter(*self.normalized_shape, dtype=dtype)
            else:
                self.register_parameter("bias", None)
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.weight is not None:
            self.weight.fill_(1.0)
        # the bias is a new heap tensor: zero-filled already

    def forward(self, x: Tensor) -> Tensor:
        return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return (f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}, "
                f"bias={self.bias is not None}")


class RMSNorm(Module):
    """x / sqrt(mean(x^2) + eps) * weight; eps=None uses the machine epsilon of the input's dtype, as torch."""

    weight: Parameter | None

    def __init__(self, normalized_shape: Any, eps: float | None = None, elementwise_affine: bool = True,
                 device: Any = None, dtype: Any = None) -> None:
        super().__init__()
        self.normalized_shape = _shape(normalized_shape)
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        if elementwise_affine:
            self.weight = heap_parameter(*self.normalized_shape, dtype=dtype)
        else:
            self.register_parameter("weight", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.weight is not None:
            self.weight.fill_(1.0)

    def forward(self, x: Tensor) -> Tensor:
        eps = self.eps
        if eps is None and x.dtype in ("float16", "bfloat16"):
            eps = _FLOAT32_EPS  # torch computes these in float32 (its opmath type) and takes float32's epsilon
        return F.rms_norm(x, self.normalized_shape, self.weight, eps)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"


class Dropout(Module):
    """In training, zeroes each element with probability p and scales the rest by 1/(1-p); in eval, the identity."""

    def __init__(self, p: float = 0.5, inplace: bool = False) -> None:
        super().__init__()
        if not 0.0 <= p <= 1.0:
            raise DeepxError(f"dropout probability has to be between 0 and 1, but got {p}")
        self.p = p
        self.inplace = inplace

    def forward(self, x: Tensor) -> Tensor:
        return F.dropout(x, self.p, self.training, self.inplace)

    def extra_repr(self) -> str:
        return f"p={self.p}, inplace={self.inplace}"


class _InplaceActivation(Module):
    """An activation with torch's `inplace` flag: the result is written back into the input when set."""

    def __init__(self, inplace: bool = False) -> None:
        super().__init__()
        self.inplace = inplace

    fn: Callable[..., Tensor] = staticmethod(F.relu)  # each subclass names its function

    def forward(self, x: Tensor) -> Tensor:
        return self.fn(x, inplace=self.inplace)

    def extra_repr(self) -> str:
        return "inplace=True" if self.inplace else ""


class ReLU(_InplaceActivation):
    fn = staticmethod(F.relu)


class GELU(Module):
    def __init__(self, approximate: str = "none") -> None:
        super().__init__()
        if approximate not in ("none", "tanh"):
            raise DeepxError(f"GELU: approximate must be 'none' or 'tanh', got {approximate!r}")
        self.approximate = approximate

    def forward(self, x: Tensor) -> Tensor:
        return F.gelu(x, approximate=self.approximate)

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}"


class SiLU(_InplaceActivation):
    fn = staticmethod(F.silu)


class Sigmoid(Module):
    def forward(self, x: Tensor) -> Tensor:
        return F.sigmoid(x)


class Tanh(Module):
    def forward(self, x: Tensor) -> Tensor:
        return F.tanh(x)


def _softmax_dim(dim: int | None, ndim: int) -> int:
    """torch's implicit dim for Softmax(dim=None): 0 for 0-, 1- and 3-d inputs, else 1 (torch also warns)."""
    if dim is not None:
        return dim
    return 0 if ndim in (0, 1, 3) else 1


class Softmax(Module):
    def __init__(self, dim: int | None = None) -> None:
        super().__init__()
        self.dim = dim

    def forward(self, x: Tensor) -> Tensor:
        return F.softmax(x, _softmax_dim(self.dim, x.ndim))

    def extra_repr(self) -> str:
        return f"dim={self.dim}"


class LogSoftmax(Module):
    def __init__(self, dim: int | None = None) -> None:
        super().__init__()
        self.dim = dim

    def forward(self, x: Tensor) -> Tensor:
        return F.log_softmax(x, _softmax_dim(self.dim, x.ndim))

    def extra_repr(self) -> str:
        return f"dim={self.dim}"


class Flatten(Module):
    def __init__(self, start_dim: int = 1, end_dim: int = -1) -> None:
        super().__init__()
        self.start_dim = start_dim
        self.end_dim = end_dim

    def forward(self, x: Tensor) -> Tensor:
        return x.flatten(self.start_dim, self.end_dim)

    def extra_repr(self) -> str:
        return f"start_dim={self.start_dim}, end_dim={self.end_dim}"


__all__ = ["GELU", "Dropout", "Embedding", "Flatten", "Identity", "LayerNorm", "Linear", "LogSoftmax", "RMSNorm",
           "ReLU", "SiLU", "Sigmoid", "Softmax", "Tanh"]
