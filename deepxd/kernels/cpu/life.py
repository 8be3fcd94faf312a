"""Tensor life and variables. These kernels change the set of tensors, so they get the executor and the checked
instruction instead of arrays."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import numpy as np

from deepx_sdk.errors import DeepxError
from deepx_sdk.ir.dtypes import to_numpy

if TYPE_CHECKING:
    from deepx_sdk.ir.ops import Bound
    from deepxd.kernels.cpu import CpuExecutor

log = logging.getLogger(__name__)


def newtensor(ex: CpuExecutor, b: Bound) -> None:
    name = str(b.out_names[0])
    if name in ex.tensors:
        if b.instr.get_meta("exists") != "keep":  # the SDK's own (deleting a stale value) asks for it quietly
            log.warning("newtensor: tensor '%s' already exists; keeping the old one", name)
        return
    meta = b.outs[0]
    assert meta is not None
    ex.tensors[name] = np.zeros(meta.shape, to_numpy(meta.dtype))


def copytensor(ex: CpuExecutor, b: Bound) -> None:
    src = ex.tensors[b.names[0]]
    dst = ex.tensors.get(str(b.out_names[0]))
    if dst is None:
        ex.tensors[str(b.out_names[0])] = src.copy()
    elif dst is not src:
        np.copyto(dst, src)


def deltensor(ex: CpuExecutor, b: Bound) -> None:
    del ex.tensors[str(b.out_names[0])]


def renametensor(ex: CpuExecutor, b: Bound) -> None:
    old, new = str(b.out_names[0]), str(b.args[0])
    if new == old:
        return
    if new in ex.tensors:
        raise DeepxError(f"renametensor: cannot rename '{old}' to '{new}': a tensor named '{new}' exists")
    ex.tensors[new] = ex.tensors.pop(old)


def argset(ex: CpuExecutor, b: Bound) -> None:
    ex.variables[str(b.out_names[0])] = b.args[0]


def vecset(ex: CpuExecutor, b: Bound) -> None:
    ex.vectors[str(b.out_names[0])] = b.args[0]
