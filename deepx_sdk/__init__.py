"""deepx: write a model as plain maths; the daemon compiles and runs its IR graph.

    import deepx_sdk as dx
    x = dx.randn(4, 3)
    w = dx.ones(3, 2, requires_grad=True)
    y = (x @ w).relu().sum()
    value = y.item()      # the recorded program runs here

With no address (and no DEEPX_ADDRESS) the first use starts an embedded daemon in this process; `dx.connect(
"unix:///path")` uses a running deepxd, `dx.connect("tcp://host:port", token=...)` one on another machine,
`dx.connect("udp://host:port")` any deepx executor (eager, write-only).
"""

from __future__ import annotations

import builtins
from typing import Any

from deepx_core import __version__
from deepx_core.errors import DeepxAttributeError, DeepxError, DeepxParseError
from deepx_sdk.compile import CompiledFunction, Placed, compile, explain, graphs
from deepx_sdk.grad_mode import enable_grad, inference_mode, is_grad_enabled, no_grad, set_grad_enabled
from deepx_sdk.io import load, save
from deepx_sdk.session import Session, connect, disconnect, session
from deepx_sdk.tensor import (
    Tensor,
    add,
    arange,
    as_tensor,
    cat,
    concat,
    div,
    empty,
    empty_like,
    floor_divide,
    fmod,
    from_numpy,
    full,
    full_like,
    linspace,
    matmul,
    maximum,
    minimum,
    mul,
    ones,
    ones_like,
    pow,
    rand,
    rand_like,
    randint,
    randn,
    randn_like,
    remainder,
    rsub,
    stack,
    sub,
    tensor,
    where,
    zeros,
    zeros_like,
)

# dtypes: the deepxIR precision names, so that `x.dtype == dx.float32` and `dtype=dx.int64` read as in torch
float64 = double = "float64"
float32 = float = "float32"
float16 = half = "float16"
bfloat16 = "bfloat16"
int64 = long = "int64"
int32 = int = "int32"
int16 = short = "int16"
int8 = "int8"
bool = "bool"
float8_e5m2 = "float8e5m2"
float8_e4m3fn = "float8e4m3"


def sync() -> None:
    """Run everything recorded so far; raise the first error since the last sync."""
    session().sync()


def empty_cache() -> None:
    """Free the temporaries the session keeps for reuse (a loop's results reuse the names, and the daemon's
    buffers, of those Python collected; at most 16 per shape and dtype are kept)."""
    session().empty_cache()


def manual_seed(seed: Any) -> None:
    """Make random ops (rand, randn, dropout, init) reproducible from here on."""
    import builtins

    s = session()
    s.base_seed = builtins.int(seed)
    import itertools

    s.seed_counter = itertools.count(1)


def is_tensor(x: Any) -> builtins.bool:
    return isinstance(x, Tensor)


def _lazy(name: str) -> Any:
    import importlib

    return importlib.import_module(f"deepx_sdk.{name}")


def __getattr__(name: str) -> Any:
    if name in ("nn", "optim", "io", "utils", "distributed", "amp"):
        return _lazy(name)
    if name in ("autocast", "GradScaler", "is_autocast_enabled", "get_autocast_dtype"):
        return getattr(_lazy("amp"), name)
    if name == "Generator":
        return _lazy("utils.data").Generator
    if name in ("device", "cuda"):
        return getattr(_lazy("devices"), name)
    composite = _lazy("composite")
    if name in composite.__all__:
        return getattr(composite, name)
    from deepx_sdk._torch_names import TENSOR

    if name in TENSOR:  # as Tensor's: a DeepxError that is an AttributeError (hasattr answers False)
        raise DeepxAttributeError(f"deepx_sdk.{name} is not supported by deepx (no op in its catalogue computes it); "
                                  "`deepxctl ops catalogue` lists the ops there are")
    raise AttributeError(f"module 'deepx_sdk' has no attribute {name!r}")


for _f in ("exp", "log", "sqrt", "sin", "cos", "tan", "tanh", "sigmoid", "relu", "abs", "softmax", "log_softmax",
           "sum", "mean", "prod", "max", "min", "argmax", "argmin", "reshape", "flatten", "permute", "transpose",
           "squeeze", "unsqueeze", "clamp", "var", "std", "amax", "amin", "t", "tril", "triu", "masked_fill",
           "multinomial", "mm", "bmm", "neg", "floor", "ceil", "round", "trunc", "fix", "frac", "log1p", "expm1",
           "erf", "cumsum", "cumprod", "gather", "scatter", "scatter_add", "index_copy", "index_add", "sort", "argsort",
           "topk", "kthvalue", "median"):
    globals()[_f] = (lambda m: lambda x, *a, **k: getattr(x, m)(*a, **k))(_f)

__all__ = ["CompiledFunction", "DeepxError", "DeepxParseError", "Placed", "Session", "Tensor", "__version__", "add",
           "arange", "as_tensor", "cat", "compile", "concat", "connect", "disconnect", "div", "divide", "empty",
           "empty_cache", "empty_like", "enable_grad", "explain", "floor_divide", "fmod", "from_numpy", "full",
           "full_like", "graphs", "inference_mode", "is_grad_enabled", "linspace", "load", "manual_seed", "matmul",
           "maximum", "minimum", "mul", "multiply", "no_grad", "ones", "ones_like", "pow", "rand", "rand_like",
           "randint", "randn", "randn_like", "remainder", "rsub", "save", "session", "set_grad_enabled", "stack",
           "sub", "subtract", "sync", "tensor", "true_divide", "where", "zeros", "zeros_like"]


multiply, subtract, divide, true_divide = mul, sub, div, div
