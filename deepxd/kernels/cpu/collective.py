"""The collective family's kernels (allreduce, broadcast, allgather, reducescatter): each hands its instruction to
the executor's `collectives` (the daemon's, deepxd/comm.py: a ring over the peer links) and waits for it. op-cuda's
executor runs the family itself (deepxd/kernels/cuda/__init__.py, `_collective`: NCCL or staged, deepxd/comm_gpu.py).

The op worker starts a program's collectives as early as their tensors allow (deepxd/comm.py, early_launches), so
that the communication runs while the instructions before each one's place go on; the kernel, reached at that
place, then only waits. Started here where the worker did not (a bare executor's `run`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from deepx_core.errors import DeepxError
from deepx_core.ir.dtypes import to_numpy
from deepx_core.ir.ops import Bound


class Work(Protocol):
    """A collective started: wait() returns once it is done here, or raises DeepxError naming what failed."""

    def wait(self) -> None: ...


class Collectives(Protocol):
    """What runs collectives for an executor: start(ex, bounds) begins the collectives `bounds` (one bucket: the same
    op, group and dtype) on the executor's tensors (`early`: ahead of their place in the program)."""

    def start(self, ex: Any, bounds: Sequence[Bound], early: bool = False) -> Work: ...


def arrays_of(ex: Any, b: Bound) -> tuple[np.ndarray, np.ndarray]:
    """A collective's input and output arrays, the output made (and put in the table) where it does not exist with
    its shape and dtype; neither shares its buffer with another tensor (the communication writes the output and reads
    the input while other instructions run)."""
    src, out, meta = str(b.names[0]), str(b.out_names[0]), b.outs[0]
    assert meta is not None
    for n in (src, out):
        if n in ex.shared:
            ex.unshare(n)
    tensors = ex.tensors
    a = tensors[src]
    o = tensors.get(out)
    if o is None or tensors.metas.get(out) != meta:
        o = np.empty(meta.shape, to_numpy(meta.dtype))
        tensors[out] = o
    elif not o.flags.c_contiguous:  # (a strided copy of a transpose: laid out as the kernels expect)
        o = tensors[out] = np.ascontiguousarray(o)
    return a, o


def _run(ex: Any, b: Bound) -> None:
    launched = ex.launched
    work = launched.pop(id(b), None) if launched else None
    if work is None:
        comm = ex.collectives
        if comm is None:
            raise DeepxError(f"{b.op.name}: this executor runs no collectives: a process group lives on a deepxd's "
                             "op worker (init_process_group() through it: docs/distributed.md)")
        work = comm.start(ex, [b])
    work.wait()


def allreduce(ex: Any, b: Bound) -> None:
    _run(ex, b)


def broadcast(ex: Any, b: Bound) -> None:
    _run(ex, b)


def allgather(ex: Any, b: Bound) -> None:
    _run(ex, b)


def reducescatter(ex: Any, b: Bound) -> None:
    _run(ex, b)
