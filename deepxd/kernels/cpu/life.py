"""Tensor life and variables. These kernels change the set of tensors, so they get the executor and the checked
instruction instead of arrays."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import numpy as np

from deepx_core.errors import DeepxError
from deepx_core.ir.dtypes import to_numpy

if TYPE_CHECKING:
    from deepx_core.ir.ops import Bound, TensorMeta
    from deepxd.kernels.cpu import CpuExecutor

log = logging.getLogger(__name__)


def keeps(b: Bound, have: TensorMeta | None) -> bool:
    """Whether `newtensor` keeps the tensor of its name that exists (`have`): where the check kept it (its rule in
    deepx_core/ir/ops.py: same shape and dtype, or exists=keep). Said in the log either way; both executors ask it."""
    meta = b.outs[0]
    if have is None or meta is None:
        return False
    name = str(b.out_names[0])
    if have == meta or b.instr.get_meta("exists") == "keep":
        if b.instr.get_meta("exists") != "keep":  # the SDK's own (deleting a stale value) asks for it quietly
            log.warning("newtensor: tensor '%s' already exists; keeping the old one (%s%s, values and all)",
                        name, have.dtype, list(have.shape))
        return True
    log.debug("newtensor: replacing '%s' (%s%s) by %s%s zeros", name, have.dtype, list(have.shape), meta.dtype,
              list(meta.shape))
    return False


def newtensor(ex: CpuExecutor, b: Bound) -> None:
    """Zeros of the checked shape and dtype; a tensor of that name is kept where the check kept it, and replaced
    otherwise (keeps)."""
    name = str(b.out_names[0])
    meta = b.outs[0]
    assert meta is not None
    have = ex.tensors.metas.get(name)
    if keeps(b, have):
        return
    if have is not None and name in ex.pinned:
        raise DeepxError(refused_heap_replace(name, have, meta))
    ex.tensors[name] = np.zeros(meta.shape, to_numpy(meta.dtype))


def refused_heap_replace(name: str, have: TensorMeta, want: TensorMeta) -> str:
    """Why newtensor may not replace heap tensor `name`: other processes map its memory."""
    return (f"newtensor: heap tensor '{name}' is {have.dtype}{list(have.shape)}; it cannot be replaced by "
            f"{want.dtype}{list(want.shape)} (other processes map it): delete it first, or use another name")


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
