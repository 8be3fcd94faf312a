"""CPU kernels (numpy), one module per op family, and the executor that runs checked instructions on them.

The kernel of op `x` is `deepxd.kernels.cpu.<OPS[x].family>.x`. Array kernels take the resolved args (arrays for
tensors, Python values otherwise) then the preallocated outputs; the `life` and `io` families change the set of
tensors or touch files, so they take the executor and the checked instruction.
"""

from __future__ import annotations

import importlib
import logging
import os
import warnings
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from deepx_sdk.errors import DeepxError
from deepx_sdk.ir.dtypes import from_numpy, to_numpy
from deepx_sdk.ir.instr import Instr
from deepx_sdk.ir.ops import OPS, Bound, TensorMeta, bind

log = logging.getLogger(__name__)

# inf and nan follow IEEE rules as in torch; numpy's RuntimeWarnings from our kernels are noise. A module-scoped
# filter costs nothing per call, where np.errstate costs microseconds.
warnings.filterwarnings("ignore", category=RuntimeWarning, module=r"deepxd\.kernels\.cpu")

#: families whose kernels take (executor, bound instruction)
STORE_FAMILIES = frozenset({"life", "io"})


def _load_kernels() -> dict[str, Callable[..., None]]:
    kernels = {}
    for name, op in OPS.items():
        module = importlib.import_module(f"deepxd.kernels.cpu.{op.family}")
        kernels[name] = getattr(module, name)
    return kernels


#: op name -> CPU kernel, for every op in the catalogue
KERNELS: dict[str, Callable[..., None]] = _load_kernels()

_NAMES: dict[np.dtype, str] = {}


def dtype_name(dt: np.dtype) -> str:
    try:
        return _NAMES[dt]
    except KeyError:
        _NAMES[dt] = from_numpy(dt)
        return _NAMES[dt]


class CpuExecutor:
    """Tensors, variables and vectors held in this process, and the numpy kernels that work on them.

    `run(instr)` checks the instruction (nothing changes when it is refused) and executes it. Outputs that do not
    exist yet are created; an output that is also an input and changes shape gets a new buffer.
    """

    def __init__(self, *, io_roots: Iterable[str | os.PathLike[str]] | None = None,
                 output: Callable[[str], None] | None = None) -> None:
        self.tensors: dict[str, np.ndarray] = {}
        self.variables: dict[str, Any] = {}
        self.vectors: dict[str, tuple[Any, ...]] = {}
        self.io_roots = None if io_roots is None else [Path(r).resolve() for r in io_roots]
        self.output: Callable[[str], None] = output or (lambda text: log.info("%s", text))

    # -- the Env that instructions are checked against
    def meta(self, name: str) -> TensorMeta | None:
        a = self.tensors.get(name)
        if a is None:
            return None
        dt = _NAMES.get(a.dtype)
        return TensorMeta(a.shape, dt if dt is not None else dtype_name(a.dtype))

    def var(self, name: str) -> Any:
        return self.variables.get(name)

    def vector(self, name: str) -> tuple[Any, ...] | None:
        return self.vectors.get(name)

    # -- running
    def run(self, instr: Instr) -> None:
        self.execute(bind(instr, self))

    def run_all(self, instrs: Sequence[Instr]) -> None:
        for instr in instrs:
            self.run(instr)

    def execute(self, b: Bound) -> None:
        """Run an instruction already checked by `bind` against this executor's current state."""
        name = b.op.name
        kernel = KERNELS[name]
        try:
            if b.op.family in STORE_FAMILIES:
                kernel(self, b)
                return
            if name == "reshape" and b.out_names[0] == b.names[0]:
                self.tensors[b.names[0]] = self.tensors[b.names[0]].reshape(b.outs[0].shape)
                return
            tensors = self.tensors
            args = []
            for a, value, n in zip(b.op.args, b.args, b.names):
                if a.kind == "tensor":
                    args.append(tensors[n])
                elif a.kind == "listtensor":
                    args.append([tensors[x] for x in n])
                else:
                    args.append(value)
            outs = []
            for n, meta in zip(b.out_names, b.outs):
                arr = tensors.get(n)
                if arr is None or arr.shape != meta.shape or dtype_name(arr.dtype) != meta.dtype:
                    arr = np.empty(meta.shape, to_numpy(meta.dtype))
                outs.append(arr)
            repeat = b.instr.get_meta("benchmark.repeat") if b.instr.meta else None
            for _ in range(int(repeat) if repeat and repeat.isdigit() else 1):
                kernel(*args, *outs)
            for n, arr in zip(b.out_names, outs):
                tensors[n] = arr
        except DeepxError:
            raise
        except MemoryError:
            sizes = ", ".join(f"'{n}' {m.dtype}{list(m.shape)}" for n, m in zip(b.out_names, b.outs) if m)
            raise DeepxError(f"{name}: out of memory (outputs {sizes})") from None
        except (ValueError, TypeError, IndexError, OverflowError, KeyError, FloatingPointError) as e:
            raise DeepxError(f"{name}: {type(e).__name__}: {e} (in {b.instr.name} of {b.names})") from None

    def check_path(self, op: str, path: str) -> str:
        """`path` resolved (.. and links), refused when it falls outside every io root."""
        if not path:
            raise DeepxError(f"{op}: empty path")
        resolved = Path(path).expanduser().resolve()
        if self.io_roots is not None and not any(resolved.is_relative_to(r) for r in self.io_roots):
            roots = ", ".join(str(r) for r in self.io_roots)
            raise DeepxError(f"{op}: path {path} is outside the allowed io roots ({roots})")
        return str(resolved)

    def put(self, name: str, array: np.ndarray) -> None:
        """Store `array` (any dtype deepx knows) as tensor `name`."""
        dtype_name(array.dtype)
        self.tensors[name] = np.asarray(array, order="C")

    def get(self, name: str) -> np.ndarray:
        try:
            return self.tensors[name]
        except KeyError:
            raise DeepxError(f"tensor '{name}' not found") from None


__all__ = ["KERNELS", "STORE_FAMILIES", "CpuExecutor", "dtype_name", "to_numpy"]
