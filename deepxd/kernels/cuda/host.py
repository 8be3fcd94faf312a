"""The host side of the CUDA executor: tensor life, variables, print and tensor files.

These ops change the set of tensors or touch files; they get the executor and the checked instruction, like their
CPU counterparts in deepxd/kernels/cpu/life.py and io.py, and move data with the executor's stream. deltensor,
renametensor, argset and vecset only touch the executor's name tables: they are the CPU ones.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from deepx_core.ir.ops import load_name
from deepx_core.tensorfile import read_data_at, read_tensor_at, write_tensor_at
from deepxd.kernels.cpu.io import at_file, format_tensor
from deepxd.kernels.cpu.life import argset, deltensor, keeps, renametensor, vecset  # noqa: F401

if TYPE_CHECKING:
    from deepx_core.ir.ops import Bound
    from deepxd.kernels.cuda import CudaExecutor


def newtensor(ex: CudaExecutor, b: Bound) -> None:
    """As the CPU one: a tensor of that name is kept where the check kept it (same shape and dtype, or exists=keep),
    replaced otherwise. A heap tensor is never replaced: the op worker's check refuses that (OpWorker._check_heap)."""
    name = str(b.out_names[0])
    meta = b.outs[0]
    assert meta is not None
    if keeps(b, ex.tensors.metas.get(name)):
        return
    ex.tensors[name] = ex.zeros(meta.shape, meta.dtype, "newtensor", name)


def copytensor(ex: CudaExecutor, b: Bound) -> None:
    src = ex.tensors[b.names[0]]
    name = str(b.out_names[0])
    dst = ex.tensors.get(name)
    if dst is None:
        dst = ex.empty(src.shape, src.dtype, "copytensor", name)
        ex.copy(dst, src)
        ex.tensors[name] = dst
    elif dst is not src:
        ex.copy(dst, src)


def print(ex: CudaExecutor, b: Bound) -> None:
    ex.output(format_tensor(b.names[0], ex.get(b.names[0]), b.args[1]))


def save(ex: CudaExecutor, b: Bound) -> None:
    name, path = b.names[0], b.args[1]
    at_file(ex, "save", name, path, f"write '{name}' to",
            lambda fd, stem, where: write_tensor_at(fd, stem, ex.get(name), where), create=True)


def load(ex: CudaExecutor, b: Bound) -> None:
    path = b.args[0]
    name = str(b.out_names[0]) if b.out_names and b.out_names[0] is not None else load_name(path)
    array = at_file(ex, "load", name, path, f"read '{name}' from", read_tensor_at)
    ex.tensors[name] = ex.to_device(array, "load", name)


def loadtensordata(ex: CudaExecutor, b: Bound) -> None:
    name, path = str(b.out_names[0]), b.args[0]
    t = ex.tensors[name]
    ex.write(t, at_file(ex, "loadtensordata", name, path, f"read '{name}' from",
                        lambda fd, file, where: read_data_at(fd, file, t.shape, t.dname, where)))
