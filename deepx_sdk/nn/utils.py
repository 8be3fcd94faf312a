"""torch.nn.utils's gradient clipping: clip_grad_norm_ and clip_grad_value_, recorded as tensor ops (no value is read
back unless error_if_nonfinite asks for one)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from deepx_core.errors import DeepxError

__all__ = ["clip_grad_norm_", "clip_grad_value_"]


def _grads(parameters: Any) -> list[Any]:
    from deepx_sdk.tensor import Tensor

    params = [parameters] if isinstance(parameters, Tensor) else list(parameters)
    return [p.grad for p in params if p.grad is not None]


def clip_grad_norm_(parameters: Iterable[Any] | Any, max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False, foreach: Any = None) -> Any:
    """Scale the gradients in place so that their total norm (of all of them together, as one vector) is at most
    max_norm; returns that total norm (before clipping) as a 0-d tensor. As torch: the scale is
    min(1, max_norm / (total + 1e-6)), applied to every gradient. error_if_nonfinite: raise where the norm is nan or
    inf (this reads the norm back: one round trip)."""
    from deepx_sdk.grad_mode import no_grad
    from deepx_sdk.tensor import stack, tensor

    grads = _grads(parameters)
    if not grads:
        return tensor(0.0)
    p = float(norm_type)
    with no_grad():
        if math.isinf(p):
            parts = [g.abs().amax() for g in grads]
            total = stack([t.type_as_dtype(grads[0].dtype) for t in parts]).amax()
        else:
            parts = [(g.abs() ** p).sum() if p != 2.0 else (g * g).sum() for g in grads]
            total = stack([t.type_as_dtype(grads[0].dtype) for t in parts]).sum() ** (1.0 / p)
        if error_if_nonfinite and not math.isfinite(float(total)):
            raise DeepxError(f"clip_grad_norm_: the total norm of order {norm_type} of the gradients is "
                             f"{float(total)}; clipping them would make them nan (error_if_nonfinite=False skips this "
                             "check)")
        coef = (float(max_norm) / (total + 1e-6)).clamp(max=1.0)
        for g in grads:
            g.mul_(coef.type_as_dtype(g.dtype))
    return total


def clip_grad_value_(parameters: Iterable[Any] | Any, clip_value: float, foreach: Any = None) -> None:
    """Clamp every gradient in place to [-clip_value, clip_value]."""
    from deepx_sdk.grad_mode import no_grad

    v = float(clip_value)
    with no_grad():
        for g in _grads(parameters):
            g.copy_(g.clamp(-v, v))
