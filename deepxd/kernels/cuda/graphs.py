"""CUDA graphs through the driver API (ctypes on libcuda; PyCUDA has no graph API): a program's kernel launches,
captured once from the executor's stream, replayed as one launch.

A capture records what the program's instructions put on the stream (kernels, cuBLAS calls, memsets, device copies)
while their host side runs as usual (allocations, the tensor table). It fails, and the program runs as before, where
an instruction needs the host in the middle (a copy to or from the host, a synchronization, a CPU fallback): see
`CudaExecutor.capture`. A `Captured` keeps every device tensor the graph reads or writes alive, and knows which
tensors (by name and address) it reads before writing them: a replay is valid only while those are the same memory.
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass, field
from typing import Any

from deepx_core.errors import DeepxError

#: CU_STREAM_CAPTURE_MODE_RELAXED: allocations (the memory pool's cuMemAlloc) may happen during a capture
_RELAXED = 2

_lib: ctypes.CDLL | None = None
_lock = threading.Lock()


class NotCapturable(DeepxError):
    """An instruction cannot be part of a CUDA graph (it needs the host mid-program); the program runs as before."""


def _driver() -> ctypes.CDLL:
    global _lib
    with _lock:
        if _lib is None:
            lib = ctypes.CDLL("libcuda.so.1")
            p, vp = ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p)
            lib.cuStreamBeginCapture_v2.argtypes = [p, ctypes.c_int]
            lib.cuStreamEndCapture.argtypes = [p, vp]
            lib.cuGraphInstantiateWithFlags.argtypes = [vp, p, ctypes.c_ulonglong]
            lib.cuGraphLaunch.argtypes = [p, p]
            lib.cuGraphExecDestroy.argtypes = [p]
            lib.cuGraphDestroy.argtypes = [p]
            lib.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
            for f in (lib.cuStreamBeginCapture_v2, lib.cuStreamEndCapture, lib.cuGraphInstantiateWithFlags,
                      lib.cuGraphLaunch, lib.cuGraphExecDestroy, lib.cuGraphDestroy, lib.cuGetErrorString):
                f.restype = ctypes.c_int
            _lib = lib
        return _lib


def _check(rc: int, what: str) -> None:
    if rc:
        msg = ctypes.c_char_p()
        _driver().cuGetErrorString(rc, ctypes.byref(msg))
        raise DeepxError(f"cuda: {what} failed: {(msg.value or b'').decode() or rc}")


def begin(stream: int) -> None:
    _check(_driver().cuStreamBeginCapture_v2(ctypes.c_void_p(stream), _RELAXED), "cuStreamBeginCapture")


def end(stream: int) -> int:
    """End the capture; the graph handle (0 where the capture was invalidated)."""
    graph = ctypes.c_void_p()
    rc = _driver().cuStreamEndCapture(ctypes.c_void_p(stream), ctypes.byref(graph))
    if rc and graph.value:
        _driver().cuGraphDestroy(graph)
    _check(rc, "cuStreamEndCapture")
    return graph.value or 0


def instantiate(graph: int) -> int:
    exe = ctypes.c_void_p()
    _check(_driver().cuGraphInstantiateWithFlags(ctypes.byref(exe), ctypes.c_void_p(graph), 0),
           "cuGraphInstantiate")
    return exe.value or 0


def launch(exe: int, stream: int) -> None:
    _check(_driver().cuGraphLaunch(ctypes.c_void_p(exe), ctypes.c_void_p(stream)), "cuGraphLaunch")


@dataclass(eq=False)
class Segment:
    """Part of a captured program, up to and including an instruction whose kernel may set the error flag (its
    `check`: (index, op, message)), which is read before the next segment runs, as the instruction-by-instruction
    run reads it; `after`: the tensor table's state of the program's names once this segment ran (None: absent)."""

    graph: int
    exe: int
    check: tuple[int, str, str] | None
    after: dict[str, Any]


@dataclass(eq=False)
class Captured:
    """One program's graphs: `reads` (the tensors read before written, as recorded) must hold for a replay; `keep`
    pins every tensor and scratch buffer the graphs use."""

    segments: list[Segment]
    reads: dict[str, tuple[int, tuple[int, ...], Any]]  # name -> (address, shape, dtype) it is read at
    keep: list[Any]
    replays: int = 0
    numbers_dev: Any = None  # the optimizer updates' numbers, read by their kernels (None: no update)
    numbers_host: Any = None  # what is copied there before each launch (page-locked)
    copied: Any = None  # the event of that copy, waited for before refresh() writes the buffer again
    slots: dict[int, int] = field(default_factory=dict)  # instruction index -> offset in numbers_host
    calls: dict[int, Any] = field(default_factory=dict)  # instruction index -> (its arguments, outputs): refresh()
    staged: dict[str, Any] = field(default_factory=dict)  # input name -> the graph's own copy, filled at each launch
    stageable: frozenset[str] = frozenset()  # the inputs the program only reads (staging them keeps it right)

    @property
    def checks(self) -> list[tuple[int, str, str]]:
        return [s.check for s in self.segments if s.check is not None]

    def valid(self, tensors: Any) -> bool:
        for name, (ptr, shape, dtype) in self.reads.items():
            t = tensors.get(name)
            if t is None or (ptr and t.ptr != ptr) or t.shape != shape or t.dtype != dtype:
                return False
        return all(s.exe for s in self.segments)

    def movable(self, tensors: Any) -> list[str] | None:
        """The inputs that made `valid` false by being other memory of the same shape and dtype, where the program
        only reads them (a capture that stages them holds); None where something else changed."""
        moved = []
        for name, (ptr, shape, dtype) in self.reads.items():
            t = tensors.get(name)
            if t is None or t.shape != shape or t.dtype != dtype:
                return None
            if ptr and t.ptr != ptr:
                if name not in self.stageable:
                    return None
                moved.append(name)
        return moved or None

    def destroy(self) -> None:
        """Free the graphs and let go of every tensor they held, the tables of names included (a dropped graph may
        outlive this while its plan lives); on the executor's thread, whose context frees the page-locked numbers."""
        for seg in self.segments:
            if seg.exe:
                _driver().cuGraphExecDestroy(ctypes.c_void_p(seg.exe))
                seg.exe = 0
            if seg.graph:
                _driver().cuGraphDestroy(ctypes.c_void_p(seg.graph))
                seg.graph = 0
            seg.after = {}
        self.keep.clear()
        self.calls.clear()
        self.staged = {}
        self.numbers_dev = None
        if self.copied is not None:  # the last launch's copy reads numbers_host until it is done
            self.copied.synchronize()
            self.copied = None
        free = getattr(getattr(self.numbers_host, "base", None), "free", None)  # pycuda's PagelockedHostAllocation
        if free is not None:
            free()
        self.numbers_host = None


def destroy_graph(graph: int) -> None:
    if graph:
        _driver().cuGraphDestroy(ctypes.c_void_p(graph))
