"""print, save, load, loadtensordata. Paths are checked against the executor's io roots before any file is touched."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from deepx_sdk.errors import DeepxError
from deepx_sdk.ir.dtypes import from_numpy
from deepx_sdk.ir.ops import load_name
from deepx_sdk.tensorfile import read_data, read_tensor, write_tensor
from deepxd.kernels.cpu._util import LOW, up

if TYPE_CHECKING:
    from deepx_sdk.ir.ops import Bound
    from deepxd.kernels.cpu import CpuExecutor


def format_tensor(name: str, a: np.ndarray, fmt: str = "") -> str:
    """A tensor as text: a header line, then the values (elements in printf format `fmt` when given)."""
    header = f"{name} {from_numpy(a.dtype)}{list(a.shape)}"
    values = up(a) if a.dtype in LOW else a
    if fmt:
        try:
            fmt % values.flat[0] if values.size else fmt % 0
        except (TypeError, ValueError) as e:
            raise DeepxError(f"print: format {fmt!r} does not format one {from_numpy(a.dtype)} element: {e}") from None
        body = np.array2string(values, formatter={"all": lambda x: fmt % x}, threshold=1000, max_line_width=120)
    else:
        body = np.array2string(values, threshold=1000, max_line_width=120)
    return f"{header}\n{body}"


def print(ex: CpuExecutor, b: Bound) -> None:
    ex.output(format_tensor(b.names[0], ex.tensors[b.names[0]], b.args[1]))


def save(ex: CpuExecutor, b: Bound) -> None:
    path = ex.check_path("save", b.args[1])
    try:
        write_tensor(path, ex.tensors[b.names[0]])
    except OSError as e:
        raise DeepxError(f"save: cannot write '{b.names[0]}' to {path}: {e}") from None


def load(ex: CpuExecutor, b: Bound) -> None:
    path = ex.check_path("load", b.args[0])
    name = str(b.out_names[0]) if b.out_names and b.out_names[0] is not None else load_name(b.args[0])
    ex.tensors[name] = read_tensor(path)


def loadtensordata(ex: CpuExecutor, b: Bound) -> None:
    path = ex.check_path("loadtensordata", b.args[0])
    t = ex.tensors[str(b.out_names[0])]
    t[...] = read_data(path, t.shape, from_numpy(t.dtype))
