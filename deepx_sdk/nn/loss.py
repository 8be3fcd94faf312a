"""Loss modules: CrossEntropyLoss, NLLLoss, MSELoss, BCELoss, BCEWithLogitsLoss, L1Loss, SmoothL1Loss, HuberLoss
and KLDivLoss, with torch's arguments and input layouts."""

from __future__ import annotations

from deepx_core.errors import DeepxError
from deepx_sdk.nn import functional as F
from deepx_sdk.nn.module import Module
from deepx_sdk.tensor import Tensor


def _legacy_reduction(size_average: bool | None, reduce: bool | None, reduction: str) -> str:
    """torch's old size_average/reduce flags, when given, decide the reduction."""
    if size_average is None and reduce is None:
        return reduction
    if reduce is False:
        return "none"
    return "mean" if size_average is not False else "sum"


class _Loss(Module):
    def __init__(self, size_average: bool | None = None, reduce: bool | None = None, reduction: str = "mean") -> None:
        super().__init__()
        self.reduction = _legacy_reduction(size_average, reduce, reduction)
        if self.reduction not in ("mean", "sum", "none"):
            raise DeepxError(f"{type(self).__name__}: reduction must be 'mean', 'sum' or 'none', got "
                             f"{self.reduction!r}")


def _classes_last(x: Tensor, target: Tensor, name: str) -> tuple[Tensor, Tensor, tuple[int, ...] | None]:
    """torch's layouts (C) with target (), (N, C) with (N), (N, C, d1, ...) with (N, d1, ...) as the (M, C) and (M)
    that the crossentropy op takes; also the shape that reduction='none' gives back (None: keep (M,))."""
    if x.ndim == 1:
        if target.ndim != 0:
            raise DeepxError(f"{name}: an input of shape {list(x.shape)} needs a 0-d target, got {list(target.shape)}")
        return x.unsqueeze(0), target.reshape(1), ()
    if x.ndim == 2:
        return x, target, None
    want = (x.shape[0], *x.shape[2:])
    if target.shape != want:
        raise DeepxError(f"{name}: for an input of shape {list(x.shape)} the target must have shape {list(want)}, "
                         f"got {list(target.shape)}")
    moved = x.permute(0, *range(2, x.ndim), 1).reshape(-1, x.shape[1])
    return moved, target.reshape(-1), want


def _unflatten(loss: Tensor, reduction: str, shape: tuple[int, ...] | None) -> Tensor:
    return loss.reshape(shape) if reduction == "none" and shape is not None else loss


class CrossEntropyLoss(_Loss):
    """-log softmax(input)[target], averaged over the targets that are not ignore_index (reduction='mean')."""

    def __init__(self, weight: Tensor | None = None, size_average: bool | None = None, ignore_index: int = -100,
                 reduce: bool | None = None, reduction: str = "mean", label_smoothing: float = 0.0) -> None:
        super().__init__(size_average, reduce, reduction)
        if weight is not None:
            raise DeepxError("CrossEntropyLoss: per-class weight is not supported yet; leave weight=None")
        self.ignore_index = int(ignore_index)
        self.label_smoothing = label_smoothing

    def forward(self, input: Tensor, target: Tensor) -> Tensor:
        x, t, shape = _classes_last(input, target, "CrossEntropyLoss")
        loss = F.cross_entropy(x, t, ignore_index=self.ignore_index, reduction=self.reduction,
                               label_smoothing=self.label_smoothing)
        return _unflatten(loss, self.reduction, shape)


class NLLLoss(_Loss):
    """-input[target] for log-probabilities, averaged over the targets that are not ignore_index."""

    def __init__(self, weight: Tensor | None = None, size_average: bool | None = None, ignore_index: int = -100,
                 reduce: bool | None = None, reduction: str = "mean") -> None:
        super().__init__(size_average, reduce, reduction)
        if weight is not None:
            raise DeepxError("NLLLoss: per-class weight is not supported yet; leave weight=None")
        self.ignore_index = int(ignore_index)

    def forward(self, input: Tensor, target: Tensor) -> Tensor:
        x, t, shape = _classes_last(input, target, "NLLLoss")
        return _unflatten(F.nll_loss(x, t, ignore_index=self.ignore_index, reduction=self.reduction), self.reduction,
                          shape)


class MSELoss(_Loss):
    """mean((input - target)^2) (or their sum, or each, by reduction)."""

    def forward(self, input: Tensor, target: Tensor) -> Tensor:
        return F.mse_loss(input, target, reduction=self.reduction)


__all__ = ["CrossEntropyLoss", "MSELoss", "NLLLoss"]


class BCELoss(_Loss):
    def __init__(self, weight: Tensor | None = None, size_average: bool | None = None, reduce: bool | None = None,
                 reduction: str = "mean") -> None:
        super().__init__(size_average, reduce, reduction)
        self.weight = weight

    def forward(self, input: Tensor, target: Tensor) -> Tensor:
        return F.binary_cross_entropy(input, target, self.weight, reduction=self.reduction)


class BCEWithLogitsLoss(_Loss):
    def __init__(self, weight: Tensor | None = None, size_average: bool | None = None, reduce: bool | None = None,
                 reduction: str = "mean", pos_weight: Tensor | None = None) -> None:
        super().__init__(size_average, reduce, reduction)
        self.weight, self.pos_weight = weight, pos_weight

    def forward(self, input: Tensor, target: Tensor) -> Tensor:
        return F.binary_cross_entropy_with_logits(input, target, self.weight, reduction=self.reduction,
                                                  pos_weight=self.pos_weight)


class L1Loss(_Loss):
    def forward(self, input: Tensor, target: Tensor) -> Tensor:
        return F.l1_loss(input, target, reduction=self.reduction)


class SmoothL1Loss(_Loss):
    def __init__(self, size_average: bool | None = None, reduce: bool | None = None, reduction: str = "mean",
                 beta: float = 1.0) -> None:
        super().__init__(size_average, reduce, reduction)
        self.beta = beta

    def forward(self, input: Tensor, target: Tensor) -> Tensor:
        return F.smooth_l1_loss(input, target, reduction=self.reduction, beta=self.beta)


class HuberLoss(_Loss):
    def __init__(self, reduction: str = "mean", delta: float = 1.0) -> None:
        super().__init__(None, None, reduction)
        self.delta = delta

    def forward(self, input: Tensor, target: Tensor) -> Tensor:
        return F.huber_loss(input, target, reduction=self.reduction, delta=self.delta)


class KLDivLoss(Module):
    def __init__(self, size_average: bool | None = None, reduce: bool | None = None, reduction: str = "mean",
                 log_target: bool = False) -> None:
        super().__init__()
        self.reduction = _legacy_reduction(size_average, reduce, reduction)
        if self.reduction not in ("mean", "sum", "none", "batchmean"):
            raise DeepxError(f"KLDivLoss: reduction must be 'mean', 'batchmean', 'sum' or 'none', got "
                             f"{self.reduction!r}")
        self.log_target = log_target

    def forward(self, input: Tensor, target: Tensor) -> Tensor:
        return F.kl_div(input, target, reduction=self.reduction, log_target=self.log_target)
