"""deepx: write a model as plain maths; the daemon compiles and runs its IR graph."""

from deepx_sdk.errors import DeepxError, DeepxParseError

__version__ = "0.1.0"

__all__ = ["DeepxError", "DeepxParseError", "__version__"]
