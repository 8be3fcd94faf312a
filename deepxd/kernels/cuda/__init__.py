"""CUDA kernels (PyCUDA `SourceModule` compilation, cuBLAS GEMM) and the executor that runs checked instructions on
one GPU.

`CudaExecutor` has the interface of `deepxd.kernels.cpu.CpuExecutor`: a `tensors` table with `metas` (so
`BindCache`/`bind` check instructions identically), `run`, `run_all`, `execute`, `put` (host -> device), `get`
(device -> host), plus `has_kernel(op, dtype)`. It owns one CUDA context (the device's primary context) and one
stream, and must be created, used and closed on one thread. Kernels of op `x` live in the module of its family
(`elementwise`, `reduce`, `sort`, `shape`, `nn`, `init`, `optim`, `matmul`, `fused`); tensor life, variables, files
and print run on the host side (`host.py`). An op or dtype with no CUDA kernel runs its CPU kernel on host copies,
counted in `executor.fallbacks[op]`. docs/cuda.md has the whole story.
"""

from __future__ import annotations

import collections
import importlib
import logging
import math
import os
import threading
from collections.abc import Callable, Collection, Iterable, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import numpy as np

from deepx_core.errors import DeepxError
from deepx_core.ir.dtypes import FLOATS, to_numpy
from deepx_core.ir.effects import DELETES, LOADS, RENAMES, SETS
from deepx_core.ir.instr import Instr
from deepx_core.ir.ops import OPS, BindCache, Bound, OpDef, PerOp, TensorMeta
from deepxd.kernels.cpu import CpuExecutor, TensorTable, dtype_name, repeat_count, worded

log = logging.getLogger(__name__)

#: families whose ops run on the host side of the executor (they change the set of tensors, or touch files)
HOST_FAMILIES = frozenset({"life", "io"})

#: CUDA kernel modules, in the order their SUPPORT tables are merged
MODULES = ("elementwise", "matmul", "shape", "reduce", "sort", "nn", "conv", "attention", "norm", "resize", "init",
           "optim", "fused")



def _load() -> tuple[dict[str, Callable[..., Any]], dict[str, frozenset[str]]]:
    kernels: dict[str, Callable[..., Any]] = {}
    support: dict[str, frozenset[str]] = {}
    for mod_name in MODULES:
        mod = importlib.import_module(f"deepxd.kernels.cuda.{mod_name}")
        table = getattr(mod, "KERNELS", None)  # a module whose kernels are made from the catalogue lists them
        for op, dtypes in mod.SUPPORT.items():
            kernels[op] = table[op] if table is not None else getattr(mod, op)
            support[op] = support.get(op, frozenset()) | dtypes
    return kernels, support


_MODULE_KERNELS, _MODULE_SUPPORT = _load()


def _kernel(op: OpDef) -> Callable[..., Any] | None:
    if op.family == "expr":  # no kernel module: its expression, rendered by the elementwise templates
        from deepxd.kernels.cuda.elementwise import expr_kernel

        return expr_kernel(op)
    return _MODULE_KERNELS.get(op.name)


#: op -> CUDA kernel function (executor, resolved args..., outputs...) -> True, or False to run the CPU kernel;
#: None where the op has none (it runs on the CPU kernel)
KERNELS: PerOp = PerOp(_kernel)
#: op -> the dtypes its CUDA kernel handles
SUPPORT: PerOp = PerOp(lambda op: frozenset(FLOATS) & op.dtypes if op.family == "expr"
                       else _MODULE_SUPPORT.get(op.name, frozenset()))

_ARG_KINDS: PerOp = PerOp(lambda op: tuple(1 if a.kind == "tensor" else 2 if a.kind == "listtensor" else 0
                                            for a in op.args))
#: op -> the position of its `seed` argument (the random ops; seed 0 draws a fresh one at each launch), or None
_SEED_AT: PerOp = PerOp(lambda op: next((i for i, a in enumerate(op.args) if a.name == "seed"), None))


def all_sources() -> list[tuple[str, str]]:
    """Every CUDA module source the executor can load, as (source, description): for `precompile`."""
    out: list[tuple[str, str]] = []
    for mod_name in MODULES:
        mod = importlib.import_module(f"deepxd.kernels.cuda.{mod_name}")
        out.extend(mod.sources())
    return out


#: the dtypes whose modules `CudaExecutor.warm` compiles first, in this order; the rest follow
WARM_ORDER = ("float32", "int64", "bool", "int32", "float64", "float16", "bfloat16")


def _warm_rank(source: tuple[str, str]) -> int:
    what = source[1]
    dtype = what[what.find("(") + 1:-1] if what.endswith(")") else ""
    rank = WARM_ORDER.index(dtype) if dtype in WARM_ORDER else (-1 if not dtype else len(WARM_ORDER))
    return rank


class DeviceTensor:
    """A contiguous tensor in device memory: `ptr` (device address), `shape`, `dtype` (numpy), `dname` (deepx
    dtype name). `buf` keeps the allocation alive (a pooled allocation, an IPC mapping, or another tensor's)."""

    __slots__ = ("buf", "dname", "dtype", "nbytes", "ptr", "shape", "size")

    def __init__(self, buf: Any, ptr: int, shape: Sequence[int], dtype: np.dtype | str) -> None:
        self.buf = buf
        self.ptr = int(ptr)
        self.shape = tuple(int(d) for d in shape)
        self.dtype = to_numpy(dtype) if isinstance(dtype, str) else np.dtype(dtype)
        self.dname = dtype_name(self.dtype)
        self.size = math.prod(self.shape)
        self.nbytes = self.size * self.dtype.itemsize

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def view(self, shape: Sequence[int]) -> DeviceTensor:
        """The same memory with another shape of as many elements."""
        return DeviceTensor(self.buf, self.ptr, shape, self.dtype)

    def __repr__(self) -> str:
        return f"DeviceTensor({self.dname}{list(self.shape)} at {self.ptr:#x})"


class CudaExecutor:
    """Tensors in one GPU's memory and the CUDA kernels that work on them.

    device: the CUDA device ordinal. cache_dir: where compiled modules are kept (default
    $DEEPX_CUDA_CACHE or $XDG_CACHE_HOME/deepx/cuda). tf32: float32 matmul on TF32 tensor cores (off: IEEE float32).
    compiler: "nvrtc" or "nvcc" (default: $DEEPX_CUDA_COMPILER, else NVRTC where it loads).
    """

    def __init__(self, *, device: int = 0, io_roots: Iterable[str | os.PathLike[str]] | None = None,
                 output: Callable[[str], None] | None = None, cache_dir: str | os.PathLike[str] | None = None,
                 tf32: bool = False, compiler: str | None = None) -> None:
        try:
            import pycuda.driver as cuda
        except ImportError as e:
            raise DeepxError(f"cuda: PyCUDA is not installed ({e}); pip install 'deepx[cuda]'") from None
        from pycuda.tools import DeviceMemoryPool

        from deepxd.kernels.cuda._build import Compiler, ModuleCache

        self.cuda = cuda
        try:
            cuda.init()
            if device >= cuda.Device.count():
                raise DeepxError(f"cuda: device {device} not found ({cuda.Device.count()} devices)")
            self.device = cuda.Device(device)
            self.context = self.device.retain_primary_context()
            self.context.push()
        except cuda.Error as e:
            raise DeepxError(f"cuda: cannot open device {device}: {e}") from None
        self._thread = threading.get_ident()
        try:
            self.stream = cuda.Stream()
            self.pool = DeviceMemoryPool()
        except cuda.Error as e:
            self.context.pop()
            self.context.detach()
            raise DeepxError(f"cuda: cannot set up device {device}: {e}") from None
        major, minor = self.device.compute_capability()
        self.arch = f"sm_{major}{minor}"
        self.sm_count = self.device.get_attribute(cuda.device_attribute.MULTIPROCESSOR_COUNT)
        self.max_blocks = self.sm_count * 32
        self.modules = ModuleCache(Compiler(self.arch, cache_dir, compiler=compiler))
        # name -> DeviceTensor; the CPU's table keeps `metas` beside it (it reads only .shape and .dtype)
        self.tensors: Any = TensorTable()
        self.meta: Callable[[str], TensorMeta | None] = self.tensors.metas.get
        self.plans = BindCache()
        self.variables: dict[str, Any] = {}
        self.vectors: dict[str, tuple[Any, ...]] = {}
        self.io_roots = None if io_roots is None else [Path(r).resolve() for r in io_roots]
        self.output: Callable[[str], None] = output or (lambda text: log.info("%s", text))
        #: op -> how many times it ran its CPU kernel on host copies
        self.fallbacks: collections.Counter[str] = collections.Counter()
        self._tf32 = tf32
        self._blas: Any = None
        self._capturing: _Capture | None = None  # a CUDA graph capture in progress (capture())
        self._refreshing: tuple[Any, int] | None = None  # (captured, slot) whose numbers refresh() writes
        self._flag = self.alloc(4, "executor", "error flag")
        self.flag_ptr = int(self._flag)
        self._flag_host = np.zeros(1, np.int32)
        # the collective family (deepxd/comm.py and comm_gpu.py, set by the op worker; None: none here): what runs
        # them, the buckets started at their first collective's place (by id() of each instruction), how the last
        # one ran (NCCL or staged: op-cuda's op stats say it), the worker whose formations they are, a way to run a
        # call on this thread later (a communicator's end) and the NCCL communicators made here (ended at close())
        self.collectives: Any = None
        self.device_collectives = True
        self.launched: dict[int, Any] = {}
        self.via = ""
        self.worker_name = ""
        self.defer: Callable[[Callable[[], None]], None] | None = None
        self.communicators: dict[int, Any] = {}
        self.device_name = f"cuda:{device}"
        self.closed = False

    # -- configuration
    @property
    def tf32(self) -> bool:
        return self._tf32

    @tf32.setter
    def tf32(self, on: bool) -> None:
        self._tf32 = bool(on)
        if self._blas is not None:
            self._blas.tf32 = self._tf32

    def blas(self) -> Any:
        if self._blas is None:
            from deepxd.kernels.cuda.gemm import Blas

            self._blas = Blas(self.stream.handle, tf32=self._tf32)
        return self._blas

    # -- the Env that instructions are checked against
    def var(self, name: str) -> Any:
        return self.variables.get(name)

    def vector(self, name: str) -> tuple[Any, ...] | None:
        return self.vectors.get(name)

    def has_kernel(self, op: str, dtype: str | None = None) -> bool:
        """Does `op` run on the device for `dtype` (None: for every dtype the catalogue claims)? Host-side ops
        (tensor life, variables, files, print) count as having one."""
        return has_kernel(op, dtype)

    # -- memory
    def _own(self) -> None:
        if threading.get_ident() != self._thread:
            raise DeepxError("cuda: the executor is used from a thread other than the one that created it (CUDA "
                             "contexts are per thread)")
        if self.closed:
            raise DeepxError("cuda: the executor is closed")

    def alloc(self, nbytes: int, op: str, name: str) -> Any:
        try:
            buf = self.pool.allocate(max(int(nbytes), 1))
            if self._capturing is not None:  # scratch a graph writes: never back to the pool while it lives
                self._capturing.keep.append(buf)
            return buf
        except self.cuda.MemoryError:
            free, total = self.cuda.mem_get_info()
            raise DeepxError(f"{op}: out of device memory allocating {nbytes} bytes for '{name}' ({free} of "
                             f"{total} bytes free, {self.pool.active_bytes} in use by tensors)") from None

    def empty(self, shape: Sequence[int], dtype: str | np.dtype, op: str = "alloc", name: str = "") -> DeviceTensor:
        dt = to_numpy(dtype) if isinstance(dtype, str) else np.dtype(dtype)
        cap = self._capturing
        if cap is not None:  # the memory a deleted tensor of this name had: the graph's addresses stay fixed
            old = cap.freed.pop(name, None)
            if old is not None and old.shape == tuple(shape) and old.dtype == dt:
                return old
        nbytes = math.prod(shape) * dt.itemsize
        buf = self.alloc(nbytes, op, name)  # (kept by alloc during a capture)
        return DeviceTensor(buf, int(buf), shape, dt)

    def zeros(self, shape: Sequence[int], dtype: str | np.dtype, op: str = "alloc", name: str = "") -> DeviceTensor:
        t = self.empty(shape, dtype, op, name)
        if t.nbytes:
            self.cuda.memset_d8_async(t.ptr, 0, t.nbytes, self.stream)
        return t

    def copy(self, dst: DeviceTensor, src: DeviceTensor) -> None:
        if src.nbytes and dst.ptr != src.ptr:
            self.cuda.memcpy_dtod_async(dst.ptr, src.ptr, src.nbytes, self.stream)

    def to_device(self, array: np.ndarray, op: str = "put", name: str = "") -> DeviceTensor:
        self._not_capturing(op, "copies host memory to the device")
        a = np.asarray(array)
        if not a.flags.c_contiguous:
            a = a.copy(order="C")  # np.ascontiguousarray would turn a 0-d array into shape (1,)
        t = self.empty(a.shape, a.dtype, op, name)
        if t.nbytes:
            self.cuda.memcpy_htod_async(t.ptr, a.reshape(-1).view(np.uint8), self.stream)
        return t

    def to_host(self, t: DeviceTensor) -> np.ndarray:
        self._not_capturing("get", "copies device memory to the host")
        host = np.empty(t.shape, t.dtype)
        if t.nbytes:
            try:
                self.cuda.memcpy_dtoh_async(host.reshape(-1).view(np.uint8), t.ptr, self.stream)
                self.stream.synchronize()
            except self.cuda.Error as e:
                raise DeepxError(f"cuda: copying {t!r} to the host failed: {e}") from None
        return host

    def write(self, t: DeviceTensor, array: np.ndarray) -> None:
        """Copy host `array` (same number of elements and dtype) into device tensor `t`."""
        self._not_capturing("write", "copies host memory to the device")
        a = np.asarray(array, dtype=t.dtype)
        if not a.flags.c_contiguous:
            a = a.copy(order="C")
        if a.size != t.size:
            raise DeepxError(f"cuda: writing {a.size} elements into {t!r}")
        if t.nbytes:
            self.cuda.memcpy_htod_async(t.ptr, a.reshape(-1).view(np.uint8), self.stream)

    def synchronize(self) -> None:
        self._not_capturing("synchronize", "waits for the device")
        try:
            self.stream.synchronize()
        except self.cuda.Error as e:
            raise DeepxError(f"cuda: a kernel failed: {e}") from None

    # -- kernels
    def function(self, key: str, source: str, name: str, fmt: str, what: str) -> Any:
        return self.modules.function(key, source, name, fmt, what)

    def grid(self, n: int, per_thread: int = 1, block: int = 256) -> tuple[int, int, int]:
        return (max(1, min(self.max_blocks, -(-n // (block * per_thread)))), 1, 1)

    def launch(self, op: str, f: Any, grid: tuple[int, int, int], block: tuple[int, int, int], *args: Any,
               shared: int = 0) -> None:
        try:
            f.prepared_async_call(grid, block, self.stream, *args, shared_size=shared)
        except self.cuda.Error as e:
            raise DeepxError(f"{op}: kernel launch failed ({type(e).__name__}: {e}; grid {grid}, block {block})"
                             ) from None

    def clear_flag(self) -> None:
        self.cuda.memset_d32_async(self.flag_ptr, 0, 1, self.stream)

    def raise_flag(self, op: str, message: str) -> None:
        """Raise DeepxError(op: message) when a kernel since clear_flag set the error flag (waits for it). In a
        capture the check is kept for after each replay of the graph."""
        cap = self._capturing
        if cap is not None:  # cut the capture: the flag is read before anything after this launches
            from deepxd.kernels.cuda import graphs

            stream = self.stream.handle
            # what the instructions before this one left (its own outputs are not bound yet); the names later
            # instructions make are left as a replay finds them, as a run stopped here leaves them
            after = {n: self.tensors.get(n) for n in cap.done}
            cap.segments.append(graphs.Segment(graphs.end(stream), 0, (cap.index, op, message), after))
            graphs.begin(stream)
            return
        self.cuda.memcpy_dtoh_async(self._flag_host, self.flag_ptr, self.stream)
        self.synchronize()
        if self._flag_host[0]:
            raise DeepxError(f"{op}: {message}")

    def precompile(self, workers: int | None = None) -> int:
        """Compile every kernel module into the disk cache, in parallel; returns how many were compiled (0 when all
        were cached)."""
        return self.modules.precompile(all_sources(), workers)

    def warm(self, workers: int | None = None) -> Any:
        """Compile the kernel modules of the dtypes models use (`WARM_ORDER`, in that order) not yet on disk, in
        background threads while this executor works: a fresh machine's first step finds its modules compiled or in
        flight instead of compiling them one after another. The others compile on first use. Returns the
        `_build.Warming` (join, stop); close() stops it."""
        chosen = [s for s in all_sources() if _warm_rank(s) < len(WARM_ORDER)]
        return self.modules.warm(sorted(chosen, key=_warm_rank), workers)

    # -- running
    def run(self, instr: Instr) -> None:
        self.execute(self.plans.bind(instr, self))

    def run_all(self, instrs: Sequence[Instr]) -> None:
        for instr in instrs:
            self.run(instr)

    def execute(self, b: Bound) -> None:
        """Run an instruction already checked by `bind` against this executor's current state."""
        self._own()
        name = b.op.name
        try:
            if b.op.family == "collective":
                self._collective(b)
                return
            if b.op.family in HOST_FAMILIES:
                from deepxd.kernels.cuda import host

                cap = self._capturing
                if cap is not None and b.op.effect.kind == DELETES:
                    for n in b.out_names:
                        t = self.tensors.get(str(n))
                        if t is not None:
                            cap.freed[str(n)] = t
                            cap.keep.append(t)
                getattr(host, name)(self, b)
                return
            if name == "reshape":
                self._reshape(b)
                return
            kernel = KERNELS.get(name)
            if kernel is None or _dtype_of(b, self.tensors.metas) not in SUPPORT[name]:
                self._fallback(b)
                return
            tensors = self.tensors
            args = [tensors[n] if k == 1 else value if k == 0 else [tensors[x] for x in n]
                    for k, value, n in zip(_ARG_KINDS[name], b.args, b.names)]
            outs, fresh = self._outputs(b)
            cap = self._capturing
            if cap is not None and b.op.family == "optim":  # refresh() calls its kernel with these again
                cap.calls[cap.index] = (args, outs)
            repeat = repeat_count(b.instr) if b.instr.meta else 1  # bounded (MAX_REPEAT), as op-cpu's
            for _ in range(repeat):
                if kernel(self, *args, *outs) is False:
                    self._fallback(b)
                    return
            if fresh:
                for n, t in zip(b.out_names, outs):
                    if tensors.get(n) is not t:
                        tensors[n] = t
        except DeepxError as e:
            raise worded(b, e) from None
        except self.cuda.Error as e:
            raise DeepxError(f"{name}: CUDA error {type(e).__name__}: {e} (in {b.instr.name} of {b.names})") from None

    def _outputs(self, b: Bound) -> tuple[list[DeviceTensor], bool]:
        metas = self.tensors.metas
        outs: list[DeviceTensor] = []
        fresh = False
        safe = b.op.alias_safe  # an output may be an input's buffer (the catalogue says)
        inputs = set()
        if not safe:
            for k, n in zip(_ARG_KINDS[b.op.name], b.names):
                if k == 1:
                    inputs.add(n)
                elif k == 2:
                    inputs.update(n)
        for n, meta in zip(b.out_names, b.outs):
            assert meta is not None
            if metas.get(n) == meta and n not in inputs:
                outs.append(self.tensors[n])
            else:
                outs.append(self.empty(meta.shape, meta.dtype, b.op.name, n))
                fresh = True
        return outs, fresh

    def _collective(self, b: Bound) -> None:
        """A collective instruction: its bucket started by the worker at the bucket's first place (else started here
        alone), waited for (deepxd/comm_gpu.py: NCCL on this stream, or the ring on host copies)."""
        self._not_capturing(b.op.name, "waits for the other ranks of its process group")
        work = self.launched.pop(id(b), None) if self.launched else None
        if work is None:
            comm = self.collectives
            if comm is None:
                raise DeepxError(f"{b.op.name}: this executor runs no collectives: a process group lives on a "
                                 "deepxd's op worker (init_process_group() through a running deepxd, or an "
                                 "embedded session: docs/distributed.md)")
            work = comm.start(self, [b])
        self.via = getattr(work, "via", "") or self.via
        work.wait()

    def settle_collectives(self) -> None:
        """The buckets started by a program that stopped before their place: waited for, whatever their outcome
        (their memory must not change under the next program)."""
        launched = self.launched
        for work in {id(w): w for w in launched.values()}.values():
            settle = getattr(work, "settle", None)
            if settle is not None:
                settle()
        launched.clear()

    def _reshape(self, b: Bound) -> None:
        src = self.tensors[b.names[0]]
        meta = b.outs[0]
        assert meta is not None
        out = str(b.out_names[0])
        if out == b.names[0]:
            self.tensors[out] = src.view(meta.shape)
            return
        dst = self.tensors.get(out)
        if dst is None or self.tensors.metas[out] != meta:
            dst = self.empty(meta.shape, meta.dtype, "reshape", out)
            self.copy(dst, src)
            self.tensors[out] = dst
        else:
            self.copy(dst, src)

    def _fallback(self, b: Bound) -> None:
        """Run the CPU kernel on host copies of the instruction's tensors and copy the outputs back."""
        name = b.op.name
        self._not_capturing(name, "runs its CPU kernel")
        self.fallbacks[name] += 1
        cpu = CpuExecutor(io_roots=self.io_roots, output=self.output)
        cpu.variables = self.variables
        cpu.vectors = self.vectors
        names: list[str] = []
        for k, n in zip(_ARG_KINDS[name], b.names):
            if k == 1:
                names.append(n)
            elif k == 2:
                names.extend(n)
        names.extend(str(n) for n in b.out_names if n in self.tensors)
        for n in dict.fromkeys(names):
            cpu.tensors[n] = self.to_host(self.tensors[n])
        cpu.execute(b)
        for n in b.out_names:
            arr = cpu.tensors[str(n)]
            cur = self.tensors.get(str(n))
            if cur is not None and cur.shape == arr.shape and cur.dtype == arr.dtype:
                self.write(cur, arr)
            else:
                self.tensors[str(n)] = self.to_device(arr, name, str(n))

    # -- host <-> device
    def io_dir(self, op: str, tensor: str, path: str, create: bool = False
               ) -> AbstractContextManager[tuple[int, str, str]]:
        return CpuExecutor.io_dir(self, op, tensor, path, create)  # type: ignore[arg-type]

    def put(self, name: str, array: np.ndarray) -> None:
        """Copy `array` (any dtype deepx knows) to the device as tensor `name`."""
        self._own()
        a = np.asarray(array)
        dtype_name(a.dtype)
        t = self.tensors.get(name)
        if t is not None and t.shape == a.shape and t.dtype == a.dtype:
            self.write(t, a)  # the same memory: a CUDA graph that reads this tensor stays valid (a batch a step)
            return
        self.tensors[name] = self.to_device(a, "put", name)

    def get(self, name: str) -> np.ndarray:
        """Tensor `name` copied to the host (waits for the kernels before it)."""
        self._own()
        try:
            t = self.tensors[name]
        except KeyError:
            raise DeepxError(f"tensor '{name}' not found") from None
        return self.to_host(t)

    # -- CUDA graphs
    def _not_capturing(self, op: str, what: str) -> None:
        if self._capturing is not None:
            from deepxd.kernels.cuda.graphs import NotCapturable

            raise NotCapturable(f"{op}: {what}, which a CUDA graph cannot hold")

    def numbers(self, values: Sequence[float]) -> int | None:
        """Where an optimizer update of a program being captured reads its numbers (the device address of its slot,
        written with `values`); 0 while refresh() rewrites a captured update's slot (launch nothing); None
        otherwise (pass them as arguments)."""
        refreshing = self._refreshing
        if refreshing is not None:
            captured, offset = refreshing
            if captured.copied is not None:  # the last replay's copy of these numbers has left the host buffer
                captured.copied.synchronize()
                captured.copied = None
            captured.numbers_host[offset:offset + len(values)] = values
            return 0
        cap = self._capturing
        if cap is None or cap.numbers_dev is None:
            return None
        got = cap.slots.get(cap.index)
        offset = cap.slot_width * len(cap.slots) if got is None else got
        cap.slots[cap.index] = offset  # (a repeated instruction's later updates read the same numbers)
        cap.numbers_host[offset:offset + len(values)] = values
        return int(cap.numbers_dev) + 8 * offset

    def refresh(self, captured: Any, index: int, bound: Bound) -> bool:
        """Give instruction `index` of a captured program its new numbers (an optimizer update's step and learning
        rate, bound again): written into its slot, read by the next replay. False where that instruction's numbers
        are part of the graph (not an optimizer update): the graph no longer stands for the program."""
        offset = captured.slots.get(index)
        call = captured.calls.get(index)
        if offset is None or call is None:
            return False
        name = bound.op.name
        tensors, outs = call  # its tensors as captured (a gradient may be gone by now), its new numbers
        args = [value if k == 0 else t for k, value, t in zip(_ARG_KINDS[name], bound.args, tensors)]
        self._refreshing = (captured, offset)
        try:
            KERNELS[name](self, *args, *outs)
        except DeepxError as e:
            raise worded(bound, e) from None
        finally:
            self._refreshing = None
        return True

    @staticmethod
    def capturable(bounds: Sequence[Bound]) -> str | None:
        """Why these checked instructions cannot run as one CUDA graph (files, output, variables, a random op that
        draws a fresh seed each run, an op without a CUDA kernel), or None. Some reasons show only while capturing (a
        kernel that waits for the device): `capture` returns None for those."""
        for b in bounds:
            seed = _SEED_AT[b.op.name]
            if seed is not None and not b.args[seed]:  # a replay would draw what the capture drew, every time
                return f"{b.op.name} draws a fresh seed at each run (seed 0), which a graph would replay"
            eff = b.op.effect
            if eff.io or eff.kind in (SETS, LOADS):
                return f"{b.op.name} touches the host (files, output or variables)"
            if eff.kind == RENAMES:
                return f"{b.op.name} gives a tensor another name, which a graph's table of names cannot follow"
            if b.op.family == "collective":
                return f"{b.op.name} waits for the other ranks of its process group, which a graph cannot hold"
            if b.op.family in HOST_FAMILIES or b.op.name == "reshape":
                continue
            if KERNELS.get(b.op.name) is None:
                return f"{b.op.name} has no CUDA kernel"
        return None

    def capture(self, bounds: Sequence[Bound], stage: Collection[str] = ()) -> Any:
        """Run these checked instructions once, recording their launches as CUDA graphs, then launch them (this
        run's work); returns the `graphs.Captured` to `replay`, or None where an instruction needs the host mid-way
        (the tensor table is then as before and the caller runs the program as usual). Where a kernel may set the
        error flag (raise_flag), the capture is cut: the flag is read before anything after it runs, as an
        instruction-by-instruction run reads it. Tensors deleted and made again under one name keep their memory,
        so that each replay finds the addresses it recorded. A kernel error raises DeepxError with `.index`.

        `stage`: names of inputs that move between runs (a batch put anew each step): each one the program only
        reads gets a buffer of the graph's own, which the graph reads and each launch first copies the input into
        (`Captured.staged`), so a replay holds wherever the input's memory is."""
        from deepxd.kernels.cuda import graphs

        self._own()
        tensors = self.tensors
        touched: dict[str, None] = {}
        reads: dict[str, tuple[int, tuple[int, ...], np.dtype]] = {}
        written: set[str] = set()
        for b in bounds:
            ins = [n for k, n in zip(_ARG_KINDS[b.op.name], b.names) if k == 1]
            for k, n in zip(_ARG_KINDS[b.op.name], b.names):
                if k == 2:
                    ins.extend(n)
            outs = [str(n) for n in b.out_names if n is not None]
            given = len(ins)
            if b.op.effect.reads_returns:
                ins.extend(outs)
            for at, n in enumerate(ins):
                touched[n] = None
                if n not in written and n not in reads:
                    t = tensors.get(n)
                    if t is None:
                        if at >= given:  # an output it would read where it exists (todtype's): made here
                            continue
                        return None  # checked against another state
                    reads[n] = (t.ptr, t.shape, t.dtype)
            for n in outs:
                touched[n] = None
                written.add(n)
        before = {n: tensors.get(n) for n in touched}
        staged: dict[str, DeviceTensor] = {}
        for n in stage:
            if n in reads and n not in written:
                t = tensors[n]
                staged[n] = self.empty(t.shape, t.dtype, "capture", f"(staged copy of {n})")
                reads[n] = (0, t.shape, t.dtype)  # any memory: the launch copies it
        cap = _Capture()
        cap.touched = touched
        cap.keep.extend(staged.values())
        updates = sum(max(1, repeat_count(b.instr) if b.instr.meta else 1) for b in bounds if b.op.family == "optim")
        if updates:  # the optimizer updates read their numbers from here (numbers())
            cap.numbers_dev = self.alloc(8 * cap.slot_width * updates, "capture", "optimizer numbers")
            cap.numbers_host = self.cuda.pagelocked_zeros(cap.slot_width * updates, np.float64)
        # (a staged input's own memory is the caller's: the graph reads its copy, so it does not hold that)
        cap.keep.extend(t for n, t in before.items() if t is not None and n not in staged)
        # the table names the staged copies only once every allocation above is made (one out of memory raises
        # with the table as it was)
        for n, buf in staged.items():
            tensors[n] = buf
        self._capturing = cap
        stream = self.stream.handle
        begun = False
        try:
            graphs.begin(stream)
            begun = True
            self.clear_flag()
            for at, b in enumerate(bounds):
                cap.index = at
                self.execute(b)
                cap.done.update((str(n), None) for n in b.out_names if n is not None)
            begun = False
            cap.segments.append(graphs.Segment(graphs.end(stream), 0, None, {n: tensors.get(n) for n in cap.done}))
            for seg in cap.segments:
                seg.exe = graphs.instantiate(seg.graph)
        except Exception as e:  # whatever stopped it, the table goes back and the caller runs eagerly
            if begun:
                try:
                    graphs.destroy_graph(graphs.end(stream))
                except DeepxError:
                    pass
            graphs.Captured(cap.segments, {}, []).destroy()
            _set_names(tensors, before)  # the host side ran, the device side did not: as before
            log.debug("cuda: no graph for this program: %s: %s", type(e).__name__, e)
            return None
        finally:
            self._capturing = None
        for seg in cap.segments:  # a staged input keeps the caller's memory under its name
            for n, buf in staged.items():
                if seg.after.get(n) is buf:
                    del seg.after[n]
        captured = graphs.Captured(cap.segments, reads, cap.keep, numbers_dev=cap.numbers_dev,
                                   numbers_host=cap.numbers_host, slots=cap.slots, calls=cap.calls,
                                   staged=staged, stageable=frozenset(n for n in reads if n not in written))
        # the host side ran the whole program: the table goes back to where it began and the launch takes it on
        # segment by segment, so that a kernel error leaves it as a run stopped at that instruction leaves it
        _set_names(tensors, before)
        try:
            self._launch(captured)
        except BaseException:
            try:
                self.synchronize()
            except DeepxError:
                pass
            captured.destroy()
            raise
        return captured

    def replay(self, captured: Any) -> bool:
        """Run a captured program again, one launch per segment, where the tensors it reads first are the memory it
        recorded (False, nothing run, where not); the tensor table then holds what the program leaves. A kernel
        error raises DeepxError whose `.index` is the failing instruction's (those after it did not run)."""
        self._own()
        if not captured.valid(self.tensors):
            return False
        self._launch(captured)
        captured.replays += 1
        return True

    def _launch(self, captured: Any) -> None:
        from deepxd.kernels.cuda import graphs

        tensors = self.tensors
        if captured.numbers_dev is not None:  # the updates' numbers of this step, from page-locked memory
            self.cuda.memcpy_htod_async(int(captured.numbers_dev), captured.numbers_host, self.stream)
            captured.copied = self.cuda.Event()
            captured.copied.record(self.stream)
        for n, buf in captured.staged.items():  # the inputs that move, into the graph's own buffers
            self.copy(buf, tensors[n])
        for seg in captured.segments:
            graphs.launch(seg.exe, self.stream.handle)
            failed = False
            if seg.check is not None:
                self.cuda.memcpy_dtoh_async(self._flag_host, self.flag_ptr, self.stream)
                self.synchronize()
                failed = bool(self._flag_host[0])
            _set_names(tensors, seg.after)
            if failed:
                index, op, message = seg.check
                err = DeepxError(f"{op}: {message}")
                err.index = index  # type: ignore[attr-defined]
                raise err

    def close(self) -> None:
        """Free every tensor and the pool, and release the context (on the owning thread)."""
        if self.closed:
            return
        self._own()
        self.modules.stop_warming()
        try:
            self.stream.synchronize()
        except self.cuda.Error as e:
            log.warning("cuda: a kernel failed before close: %s", e)
        if self._blas is not None:
            self._blas.close()
            self._blas = None
        for c in list(self.communicators.values()):  # process groups still formed: the daemon stops
            if not c.closed:
                c.abort()
        self.communicators.clear()
        self.tensors.clear()
        self._flag = None
        self.modules.functions.clear()
        self.modules.modules.clear()
        self.pool.stop_holding()
        self.closed = True
        self.context.pop()
        self.context.detach()

    def __enter__(self) -> CudaExecutor:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class _Capture:
    """A capture in progress: tensors deleted by name (their memory kept for the next of that name), every tensor
    the graph uses, the segments cut so far."""

    slot_width = 16  # numbers per optimizer update

    def __init__(self) -> None:
        self.freed: dict[str, DeviceTensor] = {}
        self.keep: list[Any] = []  # tensors and scratch buffers
        self.index = 0  # the instruction being captured
        self.touched: dict[str, None] = {}  # the names the program reads or writes
        self.done: dict[str, None] = {}  # the names the instructions captured so far wrote or deleted
        self.calls: dict[int, tuple[list[Any], list[Any]]] = {}  # optimizer update index -> its arguments, outputs
        self.segments: list[Any] = []  # graphs.Segment, cut where a kernel's error flag is read
        self.slots: dict[int, int] = {}  # instruction index -> offset of its numbers
        self.numbers_dev: Any = None
        self.numbers_host: np.ndarray = np.zeros(0, np.float64)


def _set_names(tensors: Any, state: dict[str, Any]) -> None:
    """Make each name of `state` in the tensor table what `state` says (None: absent)."""
    for n, t in state.items():
        if t is None:
            if n in tensors:  # (a replay's temporaries are gone already: no write, no new version)
                tensors.pop(n)
        elif tensors.get(n) is not t:
            tensors[n] = t


def _dtype_of(b: Bound, metas: dict[str, TensorMeta]) -> str:
    """The dtype that picks an op's kernel: its first tensor argument's, else its first output's."""
    for k, n in zip(_ARG_KINDS[b.op.name], b.names):
        if k == 1:
            return metas[n].dtype
        if k == 2 and n:
            return metas[n[0]].dtype
    meta = b.outs[0] if b.outs else None
    return meta.dtype if meta is not None else ""


def has_kernel(op: str, dtype: str | None = None) -> bool:
    """Does `op` run on the device for `dtype` (None: every dtype the catalogue claims for it)?"""
    spec = OPS.get(op)
    if spec is None:
        return False
    if spec.family in HOST_FAMILIES or op == "reshape":
        return True
    have = SUPPORT.get(op, frozenset())
    if dtype is None:
        return spec.dtypes <= have
    return dtype in have


def kernel_dtypes(op: str) -> frozenset[str]:
    """The dtypes `op` runs on the device for (the rest run the CPU kernel on host copies)."""
    spec = OPS.get(op)
    if spec is None:
        return frozenset()
    if spec.family in HOST_FAMILIES or op == "reshape":
        return spec.dtypes
    return SUPPORT.get(op, frozenset()) & spec.dtypes


__all__ = ["KERNELS", "SUPPORT", "CudaExecutor", "DeviceTensor", "all_sources", "has_kernel", "kernel_dtypes"]
