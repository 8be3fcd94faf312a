"""deepx_sdk.distributed.nn: torch.distributed.nn's differentiable collectives (`functional`)."""

from __future__ import annotations

from deepx_sdk.distributed.nn import functional

__all__ = ["functional"]
