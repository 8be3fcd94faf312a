"""print, save, load, loadtensordata. Paths are checked against the executor's io roots before any file is touched,
and files are opened relative to the checked directory, never through a link (CpuExecutor.io_dir)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from deepx_sdk.errors import DeepxError
from deepx_sdk.ir.dtypes import from_numpy
from deepx_sdk.ir.ops import load_name
from deepx_sdk.tensorfile import read_data_at, read_tensor_at, write_tensor_at
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
    name, path = b.names[0], b.args[1]
    with ex.io_dir("save", name, path, create=True) as (fd, stem, where):
        try:
            write_tensor_at(fd, stem, ex.tensors[name], where)
        except DeepxError as e:
            raise DeepxError(f"save: cannot write '{name}' to {path}: {e}") from None


def load(ex: CpuExecutor, b: Bound) -> None:
    path = b.args[0]
    name = str(b.out_names[0]) if b.out_names and b.out_names[0] is not None else load_name(path)
    with ex.io_dir("load", name, path) as (fd, stem, where):
        try:
            ex.tensors[name] = read_tensor_at(fd, stem, where)
        except DeepxError as e:
            raise DeepxError(f"load: cannot read '{name}' from {path}: {e}") from None


def loadtensordata(ex: CpuExecutor, b: Bound) -> None:
    name, path = str(b.out_names[0]), b.args[0]
    t = ex.tensors[name]
    with ex.io_dir("loadtensordata", name, path) as (fd, file, where):
        try:
            t[...] = read_data_at(fd, file, t.shape, from_numpy(t.dtype), where)
        except DeepxError as e:
            raise DeepxError(f"loadtensordata: cannot read '{name}' from {path}: {e}") from None
