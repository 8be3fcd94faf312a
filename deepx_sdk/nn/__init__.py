"""deepx_sdk.nn: torch.nn's names for deepx."""

from deepx_sdk.nn import functional

__all__ = ["functional"]
