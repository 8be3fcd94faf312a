"""deepx_sdk.nn: torch.nn's names for deepx. Parameters are heap tensors (held by the daemon's heapmem);
activations are stack tensors.

Where deepx differs from torch: `state_dict()` holds the module's own tensors rather than detached copies (deepx
has one handle per daemon tensor); `load_state_dict` checks every key before copying anything, and refuses a lossy
change of kind (float values into an int tensor); devices given to `.to()` are ignored.
"""

from deepx_sdk.nn import functional, init, utils
from deepx_sdk.nn.containers import ModuleDict, ModuleList, Sequential
from deepx_sdk.nn.layers2d import (
    AdaptiveAvgPool2d,
    AvgPool2d,
    BatchNorm1d,
    BatchNorm2d,
    Conv1d,
    Conv2d,
    ConvTranspose2d,
    Dropout2d,
    GroupNorm,
    MaxPool2d,
    Upsample,
)
from deepx_sdk.nn.loss import (
    BCELoss,
    BCEWithLogitsLoss,
    CrossEntropyLoss,
    HuberLoss,
    KLDivLoss,
    L1Loss,
    MSELoss,
    NLLLoss,
    SmoothL1Loss,
)
from deepx_sdk.nn.module import IncompatibleKeys, Module
from deepx_sdk.nn.modules import (
    GELU,
    Dropout,
    Embedding,
    Flatten,
    Identity,
    LayerNorm,
    Linear,
    LogSoftmax,
    ReLU,
    RMSNorm,
    Sigmoid,
    SiLU,
    Softmax,
    Tanh,
)
from deepx_sdk.nn.parameter import Parameter

__all__ = [
    "GELU",
    "AdaptiveAvgPool2d",
    "AvgPool2d",
    "BCELoss",
    "BCEWithLogitsLoss",
    "BatchNorm1d",
    "BatchNorm2d",
    "Conv1d",
    "Conv2d",
    "ConvTranspose2d",
    "CrossEntropyLoss",
    "Dropout",
    "Dropout2d",
    "Embedding",
    "Flatten",
    "GroupNorm",
    "HuberLoss",
    "Identity",
    "IncompatibleKeys",
    "KLDivLoss",
    "L1Loss",
    "LayerNorm",
    "Linear",
    "LogSoftmax",
    "MSELoss",
    "MaxPool2d",
    "Module",
    "ModuleDict",
    "ModuleList",
    "NLLLoss",
    "Parameter",
    "RMSNorm",
    "ReLU",
    "Sequential",
    "SiLU",
    "Sigmoid",
    "SmoothL1Loss",
    "Softmax",
    "Tanh",
    "Upsample",
    "functional",
    "init",
    "utils",
]


def __getattr__(name: str) -> object:
    if name == "parallel":  # imported when first named: it brings deepx_sdk.distributed
        import importlib

        return importlib.import_module("deepx_sdk.nn.parallel")
    raise AttributeError(f"module 'deepx_sdk.nn' has no attribute {name!r}")
