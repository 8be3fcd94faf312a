"""Open a deepxd's GPU heap tensor from another process on the same machine, without a copy.

When op-cuda runs, heapmem puts heap tensors in GPU memory and writes a CUDA IPC handle into each one's
`tensor:<name>` record in the storage plane (`device`, `bytes`, `ipc_handle`, `refcount`, ...). This module reads that
record and opens the handle in this process, giving a device array over the daemon's memory: reads see the
daemon's values, writes are seen by the daemon. It needs only PyCUDA and the storage plane (no SDK, no deepxd
kernels).

    from deepxd.ipc import open_tensor

    with open_tensor("memory:///var/lib/deepx/plane.aof", "w") as t:     # the daemon's --kv URL
        w = t.get()              # a numpy copy of the daemon's tensor
        t.set(w * 2)             # write in place: the daemon sees it
        t.array                  # a pycuda GPUArray over the same memory

The handle must be opened in another process than the daemon's (CUDA refuses to open a handle in the process that
made it). Opening does not take a reference: the tensor is freed when the daemon's refcount reaches zero, so hold
one through the `tensor_lifecycle` list (a `get` command with a holder) while you use it for long.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from deepx_core.errors import DeepxError
from deepx_core.ir.dtypes import to_numpy


def read_record(kv_url: str, name: str, prefix: str = "deepx:") -> dict[str, str]:
    """The `tensor:<name>` hash of the storage plane at `kv_url` (`memory:///path/file` or `redis://...`), read
    without disturbing the daemon that owns it."""
    key = f"{prefix}tensor:{name}"
    if kv_url == "memory" or kv_url.startswith("memory:"):
        path = _memory_path(kv_url)
        return _read_memory_file(path, key)
    if kv_url.startswith(("redis://", "rediss://", "unix://")):
        from deepxd.kv.base import open_kv

        async def read() -> dict[str, str]:
            kv = open_kv(kv_url, prefix=prefix)
            await kv.connect()
            try:
                return await kv.hgetall(f"tensor:{name}")
            finally:
                await kv.close()
        return asyncio.run(read())
    raise DeepxError(f"storage plane URL {kv_url!r}: use memory:///path/file or redis://host:port/db")


def _memory_path(kv_url: str) -> str:
    from urllib.parse import unquote, urlsplit

    if kv_url == "memory":
        raise DeepxError("the storage plane 'memory' lives inside the daemon's process and cannot be read from "
                         "another; start deepxd with --kv memory:///path/file or --kv redis://host:port/db")
    path = unquote(urlsplit(kv_url).path)
    if not path:
        raise DeepxError(f"storage plane URL {kv_url!r} names no file; use memory:///path/file")
    return path


def _read_memory_file(path: str, key: str) -> dict[str, str]:
    """Replay the daemon's append-only file read-only (its writer holds a lock this reader does not take)."""
    from deepxd.kv.memory import MAGIC, apply_effect, read_records

    try:
        with open(path, "rb") as f:
            buf = f.read()
    except OSError as e:
        raise DeepxError(f"cannot read the storage file {path}: {e.strerror or e}") from None
    if not buf.startswith(MAGIC):
        raise DeepxError(f"{path} is not a deepx storage file")
    data: dict[str, Any] = {}
    records, _, _ = read_records(buf)  # a record being written at this moment ends the replay: it is not there yet
    for _, effects in records:
        for effect in effects:
            if effect[1] == key:
                apply_effect(data, effect)
    value = data.get(key)
    return dict(value) if isinstance(value, dict) else {}


class SharedTensor:
    """A heap tensor of a deepxd opened through its CUDA IPC handle: `array` (a pycuda GPUArray over the daemon's
    memory), `get()`, `set()`, `close()`. Made by `open_tensor`."""

    def __init__(self, name: str, dtype: np.dtype, shape: Sequence[int], nbytes: int, device: str, handle: Any,
                 array: Any, context: Any) -> None:
        self.name = name
        self.dtype = dtype
        self.shape = tuple(shape)
        self.nbytes = nbytes
        self.device = device
        self.array = array
        self._handle = handle
        self._context = context

    def get(self) -> np.ndarray:
        """A host copy of the tensor's current values."""
        self._check_open()
        out: np.ndarray = self.array.get()
        return out

    def set(self, values: np.ndarray) -> None:
        """Write `values` (same shape; cast to the tensor's dtype) into the daemon's memory."""
        self._check_open()
        a = np.ascontiguousarray(values, dtype=self.dtype)
        if a.shape != self.shape:
            raise DeepxError(f"set: heap tensor '{self.name}' is {list(self.shape)}; got {list(a.shape)}")
        self.array.set(a)

    def close(self) -> None:
        """Close the handle and let go of this process's CUDA context (the daemon's memory is untouched)."""
        if self._handle is None:
            return
        import pycuda.driver as drv

        try:
            self.array = None
            self._handle.close()
        finally:
            self._handle = None
            drv.Context.pop()
            self._context.detach()

    def _check_open(self) -> None:
        if self._handle is None:
            raise DeepxError(f"heap tensor '{self.name}' was closed")

    def __enter__(self) -> SharedTensor:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"SharedTensor({self.name!r}, {self.dtype}, {list(self.shape)}, {self.device})"


def open_tensor(kv_url: str, name: str, *, prefix: str = "deepx:") -> SharedTensor:
    """Open heap tensor `name` of the daemon whose storage plane is `kv_url`, in this process, on its GPU.

    Makes the GPU's primary context current on this thread (popped again by `close()`). Raises DeepxError when the
    tensor is unknown, is not on a GPU, is not live, or the handle cannot be opened."""
    f = read_record(kv_url, name, prefix)
    if not f:
        raise DeepxError(f"open_tensor: no tensor:{name} in the storage plane {kv_url}")
    device = f.get("device", "cpu")
    if not device.startswith("cuda") or not f.get("ipc_handle"):
        raise DeepxError(f"open_tensor: tensor {name!r} lives on {device}, with no CUDA IPC handle; a heap tensor "
                         f"on the CPU is opened with deepxd.shm.Segment.attach(handle={f.get('handle', '')!r})")
    if f.get("state", "live") != "live":
        raise DeepxError(f"open_tensor: tensor {name!r} is {f.get('state')}: its memory is gone")
    try:
        import json

        shape = json.loads(f["shape"])
        dtype = to_numpy(f["dtype"])
        raw = bytearray.fromhex(f["ipc_handle"])
        index = int(device.partition(":")[2] or 0)
    except (KeyError, ValueError) as e:
        raise DeepxError(f"open_tensor: tensor:{name} has a malformed record ({e})") from None
    import pycuda.driver as drv
    from pycuda import gpuarray

    drv.init()
    ctx = drv.Device(index).retain_primary_context()
    ctx.push()
    try:
        handle = drv.IPCMemoryHandle(raw)
    except drv.Error as e:
        drv.Context.pop()
        ctx.detach()
        raise DeepxError(f"open_tensor: the CUDA IPC handle of {name!r} on {device} did not open in process "
                         f"{os.getpid()} ({e}); a handle opens only in a process other than the daemon's, on the same "
                         "machine, while the tensor is live") from None
    array = gpuarray.GPUArray(tuple(shape), dtype, gpudata=handle)
    return SharedTensor(name, dtype, shape, int(f.get("bytes", array.nbytes)), device, handle, array, ctx)


__all__ = ["SharedTensor", "open_tensor", "read_record"]
