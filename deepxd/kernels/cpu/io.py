"""print, save, load, loadtensordata. Paths are checked against the executor's io roots before any file is touched,
and files are opened relative to the checked directory, never through a link (CpuExecutor.io_dir)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

import numpy as np

from deepx_core.errors import DeepxError
from deepx_core.ir.dtypes import from_numpy
from deepx_core.ir.ops import load_name
from deepx_core.tensorfile import read_data_at, read_tensor_at, write_tensor_at
from deepxd.kernels.cpu._util import LOW, up

if TYPE_CHECKING:
    from deepx_core.ir.ops import Bound
    from deepxd.kernels.cpu import CpuExecutor
    from deepxd.kernels.cuda import CudaExecutor

_T = TypeVar("_T")


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


def at_file(ex: CpuExecutor | CudaExecutor, op: str, name: str, path: str, what: str,
            fn: Callable[[int, str, str], _T], create: bool = False) -> _T:
    """fn(directory fd, file name, directory) on the tensor file at `path`, in its checked directory (io_dir); an
    error there said as `{op}: cannot {what} {path}` (what: "write 'x' to", "read 'x' from")."""
    with ex.io_dir(op, name, path, create) as (fd, file, where):
        try:
            return fn(fd, file, where)
        except DeepxError as e:
            raise DeepxError(f"{op}: cannot {what} {path}: {e}") from None


def save(ex: CpuExecutor, b: Bound) -> None:
    name, path = b.names[0], b.args[1]
    at_file(ex, "save", name, path, f"write '{name}' to",
            lambda fd, stem, where: write_tensor_at(fd, stem, ex.tensors[name], where), create=True)


def load(ex: CpuExecutor, b: Bound) -> None:
    path = b.args[0]
    name = str(b.out_names[0]) if b.out_names and b.out_names[0] is not None else load_name(path)
    ex.tensors[name] = at_file(ex, "load", name, path, f"read '{name}' from", read_tensor_at)


def loadtensordata(ex: CpuExecutor, b: Bound) -> None:
    name, path = str(b.out_names[0]), b.args[0]
    t = ex.tensors[name]
    t[...] = at_file(ex, "loadtensordata", name, path, f"read '{name}' from",
                     lambda fd, file, where: read_data_at(fd, file, t.shape, from_numpy(t.dtype), where))
