"""Mixed precision as torch.amp has it: `autocast` and `GradScaler`.

Inside `with dx.autocast(dtype="bfloat16"):` (or `dx.amp.autocast("cuda", dtype=...)`; float16 too) the ops that gain
from tensor cores run in the lower precision, their float32 inputs cast on the way in (matmul, mm, bmm, linear,
conv1d/2d, conv_transpose2d, addmm, baddbmm, scaled_dot_product_attention), and the ops that need range or
accumulation run in float32, their half inputs cast up (softmax, log_softmax, layer_norm, group_norm, rms_norm,
cross_entropy, nll_loss, mse_loss, l1_loss, smooth_l1_loss, huber_loss, kl_div, binary_cross_entropy(_with_logits),
softplus, sum, prod, cumsum, exp, log, pow, rsqrt): torch's CUDA lists, whatever the daemon runs on. Every other op
runs in the dtype its inputs have (mixed inputs promote, as always). float64 and integer tensors are never cast.
Parameters stay float32; the casts are ops like any other, so autograd carries gradients back through them in the
parameters' dtype. The state is per thread, as torch's; nested `autocast(enabled=False)` turns it off.

`GradScaler` keeps float16 gradients from underflowing: `scaler.scale(loss).backward()`, `scaler.step(opt)` (unscales
the gradients, skips the step when any is inf or NaN), `scaler.update()` (halves the scale after a skipped step,
doubles it after `growth_interval` good ones). bfloat16 has float32's range and needs no scaler.
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from deepx_core.errors import DeepxError

__all__ = ["GradScaler", "autocast", "get_autocast_dtype", "is_autocast_enabled"]

_LOWER = frozenset({"bfloat16", "float16"})


class _State(threading.local):
    dtype: str | None = None  # what autocast lowers to in this thread; None: off


#: read by the ops' hooks as `state.dtype` (one attribute load where autocast is off)
state = _State()
F = TypeVar("F", bound=Callable[..., Any])


def get_autocast_dtype() -> str | None:
    """The dtype autocast lowers to in this thread, or None where it is off."""
    return state.dtype


def is_autocast_enabled(device_type: str | None = None) -> bool:
    return get_autocast_dtype() is not None


class autocast:
    """A context manager and decorator: `with dx.autocast(dtype="bfloat16"): loss = model(x)`.

    device_type ("cuda", "cpu") is accepted for torch's scripts and means nothing: the daemon places the ops.
    dtype: "bfloat16" (the default) or "float16" (or dx.bfloat16 / torch-style names). enabled=False: off inside."""

    def __init__(self, device_type: str = "cuda", dtype: Any = None, enabled: bool = True,
                 cache_enabled: bool | None = None) -> None:
        if not isinstance(device_type, str):
            raise DeepxError(f"autocast: device_type must be a string such as 'cuda', got {device_type!r}")
        from deepx_sdk.tensor import dtype_name

        name = dtype_name(dtype) if dtype is not None else "bfloat16"
        if enabled and name not in _LOWER:
            raise DeepxError(f"autocast: dtype must be bfloat16 or float16, got {name}")
        self.dtype = name if enabled else None
        self._saved: list[str | None] = []

    def __enter__(self) -> autocast:
        self._saved.append(get_autocast_dtype())
        state.dtype = self.dtype
        return self

    def __exit__(self, *exc: Any) -> None:
        state.dtype = self._saved.pop()

    def __call__(self, fn: F) -> F:
        @functools.wraps(fn)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            with autocast(dtype=self.dtype, enabled=self.dtype is not None):
                return fn(*args, **kwargs)

        return wrapped  # type: ignore[return-value]


def lower(*tensors: Any) -> tuple[Any, ...]:
    """The tensors for a lower-precision op: float32 and the other half type cast to the autocast dtype (call only
    where get_autocast_dtype() is not None); None and other dtypes pass."""
    dt = state.dtype
    return tuple(t.type_as_dtype(dt) if t is not None and (t.dtype == "float32" or t.dtype in _LOWER) else t
                 for t in tensors)


def upper(t: Any) -> Any:
    """A half tensor cast to float32 for a float32 op (call only where autocast is on)."""
    return t.type_as_dtype("float32") if t is not None and t.dtype in _LOWER else t


class GradScaler:
    """torch.amp.GradScaler: loss scaling for float16 training (docstring of this module)."""

    def __init__(self, device: str = "cuda", init_scale: float = 2.0 ** 16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000, enabled: bool = True) -> None:
        if growth_factor <= 1.0 or not 0.0 < backoff_factor < 1.0:
            raise DeepxError(f"GradScaler: growth_factor must be > 1 and backoff_factor in (0, 1), got "
                             f"{growth_factor} and {backoff_factor}")
        if growth_interval < 1:
            raise DeepxError(f"GradScaler: growth_interval must be a positive integer, got {growth_interval}")
        self._scale = float(init_scale)
        self._growth_factor, self._backoff_factor = float(growth_factor), float(backoff_factor)
        self._growth_interval = int(growth_interval)
        self._enabled = bool(enabled)
        self._growth_tracker = 0
        self._unscaled: dict[int, bool] = {}  # id(optimizer) -> found inf while unscaling
        self._stepped = False

    def is_enabled(self) -> bool:
        return self._enabled

    def get_scale(self) -> float:
        return self._scale if self._enabled else 1.0

    def scale(self, outputs: Any) -> Any:
        """outputs * scale (a tensor, or lists and tuples of them)."""
        if not self._enabled:
            return outputs
        if isinstance(outputs, (list, tuple)):
            return type(outputs)(self.scale(o) for o in outputs)
        return outputs * self._scale

    def _grads(self, optimizer: Any) -> list[Any]:
        return [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]

    def unscale_(self, optimizer: Any) -> None:
        """Divide the optimizer's gradients by the scale, in place, once per step; remember whether any is inf or
        NaN (one value read back for all of them)."""
        if not self._enabled:
            return
        key = id(optimizer)
        if key in self._unscaled:
            raise DeepxError("GradScaler.unscale_ was already called on this optimizer since the last update()")
        grads = self._grads(optimizer)
        if not grads:
            self._unscaled[key] = False
            return
        from deepx_sdk.tensor import stack

        inv = 1.0 / self._scale
        bad = stack([(~g.isfinite()).any() for g in grads]).any()  # before unscaling: inf * inv stays inf
        for g in grads:
            g.mul_(inv)
        self._unscaled[key] = bool(bad.item())

    def step(self, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        """unscale_ (unless done) and optimizer.step(), skipped when a gradient is inf or NaN; returns what step
        returned, or None when skipped."""
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if id(optimizer) not in self._unscaled:
            self.unscale_(optimizer)
        self._stepped = True
        if self._unscaled[id(optimizer)]:
            return None
        return optimizer.step(*args, **kwargs)

    def update(self, new_scale: float | None = None) -> None:
        """After the step: back off after a skipped step, grow after growth_interval good ones (or set new_scale)."""
        if not self._enabled:
            return
        if new_scale is not None:
            self._scale = float(new_scale)
        elif self._stepped or self._unscaled:
            if any(self._unscaled.values()):
                self._scale *= self._backoff_factor
                self._growth_tracker = 0
            else:
                self._growth_tracker += 1
                if self._growth_tracker == self._growth_interval:
                    grown = self._scale * self._growth_factor
                    if math.isfinite(grown):
                        self._scale = grown
                    self._growth_tracker = 0
        self._unscaled.clear()
        self._stepped = False

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self._scale, "growth_factor": self._growth_factor, "backoff_factor": self._backoff_factor,
                "growth_interval": self._growth_interval, "_growth_tracker": self._growth_tracker}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._scale = float(state["scale"])
        self._growth_factor = float(state["growth_factor"])
        self._backoff_factor = float(state["backoff_factor"])
        self._growth_interval = int(state["growth_interval"])
        self._growth_tracker = int(state["_growth_tracker"])
