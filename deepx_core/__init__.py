"""The base layer every other package of deepx stands on, and which imports none of them: the deepxIR instruction
language and op catalogue (`deepx_core.ir`), the error types, the tensor file format, the stored graph's record and
the default paths. The SDK (`deepx_sdk`), the daemon (`deepxd`) and the operator CLI (`deepxctl`) share these; the
import contracts in pyproject.toml keep it so."""

__version__ = "0.1.0"
