"""NCCL through ctypes against libnccl.so.2, as cuBLAS is loaded (gemm.py): the unique id, a communicator of one
rank per GPU, and the collectives deepx runs on it (all-reduce, broadcast, all-gather, reduce-scatter), enqueued on a
stream with device pointers.

Communicators are made **non-blocking** (`ncclConfig_t.blocking = 0`): `ncclCommInitRankConfig` and the
collectives return at once, and the caller polls `state()` (`ncclCommGetAsyncError`) until the call has gone through,
so that a rank that never comes (killed, hung) is noticed by whoever polls, who then calls `abort()`
(`ncclCommAbort`: the kernels waiting on the device for the dead rank end too), instead of hanging inside NCCL.

The config struct is passed in its 2.17 layout (the fields up to `splitShare`) with `version` 2.17.0: NCCL copies
`min(size, its own size)` bytes of it and gives every later field its default, so one layout serves every NCCL from
2.17 on (the GPU machine has 2.28). Nothing here knows about process groups (deepxd/comm_gpu.py does): these are
functions of device pointers.
"""

from __future__ import annotations

import ctypes
import importlib.util
import logging
import os
from pathlib import Path

from deepx_core.errors import DeepxError
from deepxd.kernels.cuda._libs import load

log = logging.getLogger(__name__)

UNIQUE_ID_BYTES = 128
API_MAGIC = 0xCAFEBEEF
CONFIG_UNDEF_INT = -(2**31)  # NCCL_CONFIG_UNDEF_INT (INT_MIN): "NCCL's default"
CONFIG_VERSION = 21700  # NCCL_VERSION(2, 17, 0): the layout of `_Config`

# ncclResult_t
SUCCESS, IN_PROGRESS = 0, 7
RESULTS = {0: "ncclSuccess", 1: "ncclUnhandledCudaError", 2: "ncclSystemError", 3: "ncclInternalError",
           4: "ncclInvalidArgument", 5: "ncclInvalidUsage", 6: "ncclRemoteError", 7: "ncclInProgress",
           8: "ncclTimeout"}

#: ncclDataType_t of each deepx dtype NCCL reduces (int16 and bool have none: they move as bytes where nothing is
#: combined, and are reduced elsewhere: deepxd/comm_gpu.py)
DTYPES = {"int8": 0, "uint8": 1, "int32": 2, "uint32": 3, "int64": 4, "uint64": 5, "float16": 6, "float32": 7,
          "float64": 8, "bfloat16": 9}
BYTES = 1  # ncclUint8: a tensor of any dtype as its bytes (broadcast, all-gather)
#: ncclRedOp_t of each reduction the collective instructions name (deepx_core/ir/ops.py, REDUCE_OPS)
OPS = {"sum": 0, "product": 1, "max": 2, "min": 3, "mean": 4}


class UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_char * UNIQUE_ID_BYTES)]


class _Config(ctypes.Structure):
    """ncclConfig_t as of NCCL 2.17 (see the module's doc)."""

    _fields_ = [("size", ctypes.c_size_t), ("magic", ctypes.c_uint), ("version", ctypes.c_uint),
                ("blocking", ctypes.c_int), ("cgaClusterSize", ctypes.c_int), ("minCTAs", ctypes.c_int),
                ("maxCTAs", ctypes.c_int), ("netName", ctypes.c_char_p), ("splitShare", ctypes.c_int)]


def _config(blocking: bool) -> _Config:
    c = _Config()
    c.size = ctypes.sizeof(_Config)
    c.magic, c.version = API_MAGIC, CONFIG_VERSION
    c.blocking = 1 if blocking else 0
    c.cgaClusterSize = c.minCTAs = c.maxCTAs = c.splitShare = CONFIG_UNDEF_INT
    c.netName = None
    return c


_lib: ctypes.CDLL | None = None
_missing: str | None = None


def _candidates() -> list[str]:
    """libnccl from the nvidia-nccl wheel, where one is installed (its lib folder is not on the loader's path)."""
    out = []
    try:
        spec = importlib.util.find_spec("nvidia.nccl")
    except (ImportError, ValueError):
        spec = None
    for folder in (spec.submodule_search_locations or []) if spec is not None else []:
        p = Path(folder) / "lib" / "libnccl.so.2"
        if p.exists():
            out.append(str(p))
    return out


def library() -> ctypes.CDLL:
    """libnccl, found by name: $DEEPX_NCCL, then libnccl.so.2 (the loader's path), the nvidia-nccl wheel's, then
    whatever the loader finds. DeepxError saying where it looked when none loads (remembered: asked once)."""
    global _lib, _missing
    if _lib is None:
        if _missing is not None:
            raise DeepxError(_missing)
        try:
            _lib = load("DEEPX_NCCL", ("libnccl.so.2", *_candidates(), "libnccl.so"), "nccl", _declare, "NCCL")
        except DeepxError as e:
            _missing = f"NCCL: {e}"
            raise DeepxError(_missing) from None
    return _lib


#: what deepx calls, each in every NCCL since 2.14 (non-blocking communicators, ncclCommFinalize)
REQUIRED = ("ncclGetVersion", "ncclGetUniqueId", "ncclCommInitRankConfig", "ncclCommGetAsyncError", "ncclCommAbort",
            "ncclCommFinalize", "ncclCommDestroy", "ncclAllReduce", "ncclBroadcast", "ncclAllGather",
            "ncclReduceScatter", "ncclGroupStart", "ncclGroupEnd", "ncclGetErrorString")


def _declare(lib: ctypes.CDLL) -> None:
    """The functions' types; DeepxError where the library lacks one (an NCCL before 2.14, or not NCCL), so that it
    counts as NCCL not loading (a GPU daemon then starts, its groups on the ring) rather than failing op-cuda."""
    missing = [name for name in REQUIRED if not hasattr(lib, name)]
    if missing:
        raise DeepxError(f"{getattr(lib, '_name', 'the library')} lacks {', '.join(missing)}: deepx needs NCCL 2.14 "
                         "or later")
    vp, i, sz = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
    lib.ncclGetVersion.argtypes = [ctypes.POINTER(i)]
    lib.ncclGetUniqueId.argtypes = [ctypes.POINTER(UniqueId)]
    lib.ncclCommInitRankConfig.argtypes = [ctypes.POINTER(vp), i, UniqueId, i, ctypes.POINTER(_Config)]
    lib.ncclCommGetAsyncError.argtypes = [vp, ctypes.POINTER(i)]
    lib.ncclCommAbort.argtypes = [vp]
    lib.ncclCommFinalize.argtypes = [vp]
    lib.ncclCommDestroy.argtypes = [vp]
    lib.ncclAllReduce.argtypes = [vp, vp, sz, i, i, vp, vp]
    lib.ncclBroadcast.argtypes = [vp, vp, sz, i, i, vp, vp]
    lib.ncclAllGather.argtypes = [vp, vp, sz, i, vp, vp]
    lib.ncclReduceScatter.argtypes = [vp, vp, sz, i, i, vp, vp]
    lib.ncclGroupStart.argtypes = []
    lib.ncclGroupEnd.argtypes = []
    lib.ncclGetErrorString.argtypes = [i]
    lib.ncclGetErrorString.restype = ctypes.c_char_p
    if hasattr(lib, "ncclGetLastError"):  # (2.13 on; describe() does without)
        lib.ncclGetLastError.argtypes = [vp]
        lib.ncclGetLastError.restype = ctypes.c_char_p
    for name in REQUIRED:
        if name != "ncclGetErrorString":
            getattr(lib, name).restype = ctypes.c_int


def available() -> str | None:
    """Why NCCL cannot be used in this process (its library does not load), or None where it can."""
    try:
        library()
    except DeepxError as e:
        return str(e)
    return None


def version() -> str:
    """The loaded NCCL's version, as "2.28.3"."""
    v = ctypes.c_int()
    _check(library().ncclGetVersion(ctypes.byref(v)), "ncclGetVersion")
    code = v.value
    major, rest = divmod(code, 10000) if code >= 10000 else divmod(code, 1000)
    minor, patch = divmod(rest, 100)
    return f"{major}.{minor}.{patch}"


def unique_id() -> bytes:
    """A fresh ncclUniqueId (rank 0 makes it: it also starts NCCL's bootstrap listener in this process), as bytes."""
    uid = UniqueId()
    _check(library().ncclGetUniqueId(ctypes.byref(uid)), "ncclGetUniqueId")
    return ctypes.string_at(ctypes.addressof(uid), UNIQUE_ID_BYTES)


def describe(status: int, comm: int | None = None) -> str:
    """An ncclResult_t in words, with NCCL's last error message where it has one."""
    name = RESULTS.get(status, f"ncclResult {status}")
    lib = library()
    text = ""
    try:
        last = lib.ncclGetLastError(ctypes.c_void_p(comm) if comm else None)
        text = last.decode(errors="replace").strip() if last else ""
    except (AttributeError, OSError):  # an NCCL without ncclGetLastError
        pass
    if not text:
        raw = lib.ncclGetErrorString(status)
        text = raw.decode(errors="replace") if raw else ""
    return f"{name}{f': {text}' if text else ''}"


def _check(status: int, what: str, comm: int | None = None) -> int:
    """The status where it is success or in progress; DeepxError naming the call otherwise."""
    if status not in (SUCCESS, IN_PROGRESS):
        raise DeepxError(f"NCCL: {what} failed: {describe(status, comm)}")
    return status


class Communicator:
    """This rank's ncclComm_t of `world` ranks, made non-blocking on the CUDA device current on the calling thread
    (its context pushed: the op-cuda worker's thread). Every call returns at once; `ready()` says whether the last
    one has gone through (raising DeepxError where the communicator failed), `abort()` ends it whatever its state."""

    def __init__(self, world: int, uid: bytes, rank: int) -> None:
        if len(uid) != UNIQUE_ID_BYTES:
            raise DeepxError(f"NCCL: a unique id is {UNIQUE_ID_BYTES} bytes, got {len(uid)}")
        self.lib = library()
        self.world, self.rank = world, rank
        self.handle = ctypes.c_void_p()
        nid = UniqueId()
        ctypes.memmove(ctypes.addressof(nid), uid, UNIQUE_ID_BYTES)
        config = _config(blocking=False)
        _check(self.lib.ncclCommInitRankConfig(ctypes.byref(self.handle), world, nid, rank, ctypes.byref(config)),
               f"ncclCommInitRankConfig (rank {rank} of {world})")
        self.closed = False

    @property
    def ptr(self) -> int:
        return int(self.handle.value or 0)

    def _live(self, what: str) -> None:
        """DeepxError where the communicator was ended: NCCL freed it, so no call may be given its handle."""
        if self.closed:
            raise DeepxError(f"NCCL: {what}: rank {self.rank}'s communicator of {self.world} ranks was ended "
                             "(aborted or destroyed: the group broke or was left)")

    def state(self) -> int:
        """ncclCommGetAsyncError: SUCCESS, IN_PROGRESS (the last call is still going through), or an error."""
        self._live("ncclCommGetAsyncError")
        err = ctypes.c_int()
        st = self.lib.ncclCommGetAsyncError(self.handle, ctypes.byref(err))
        if st != SUCCESS:
            return int(st)
        return int(err.value)

    def ready(self, what: str) -> bool:
        """Whether the last call (`what`, for the error) has gone through; DeepxError where it failed."""
        st = self.state()
        if st == IN_PROGRESS:
            return False
        if st != SUCCESS:
            raise DeepxError(f"NCCL: {what} failed: {describe(st, self.ptr)}")
        return True

    # -- collectives (device pointers; `stream`: a CUstream handle)
    def all_reduce(self, send: int, recv: int, count: int, dtype: str, op: str, stream: int) -> None:
        self._live("ncclAllReduce")
        _check(self.lib.ncclAllReduce(_p(send), _p(recv), count, DTYPES[dtype], OPS[op], self.handle, _p(stream)),
               "ncclAllReduce", self.ptr)

    def broadcast(self, send: int, recv: int, nbytes: int, root: int, stream: int) -> None:
        self._live("ncclBroadcast")
        _check(self.lib.ncclBroadcast(_p(send), _p(recv), nbytes, BYTES, root, self.handle, _p(stream)),
               "ncclBroadcast", self.ptr)

    def all_gather(self, send: int, recv: int, nbytes: int, stream: int) -> None:
        """Each rank's `nbytes` from `send` into block r of `recv` (world * nbytes)."""
        self._live("ncclAllGather")
        _check(self.lib.ncclAllGather(_p(send), _p(recv), nbytes, BYTES, self.handle, _p(stream)),
               "ncclAllGather", self.ptr)

    def reduce_scatter(self, send: int, recv: int, count: int, dtype: str, op: str, stream: int) -> None:
        """Block r (of `count` elements) of the ranks' `send` (world * count) reduced, into `recv`."""
        self._live("ncclReduceScatter")
        _check(self.lib.ncclReduceScatter(_p(send), _p(recv), count, DTYPES[dtype], OPS[op], self.handle,
                                          _p(stream)), "ncclReduceScatter", self.ptr)

    def group_start(self) -> None:
        _check(self.lib.ncclGroupStart(), "ncclGroupStart")

    def group_end(self) -> None:
        _check(self.lib.ncclGroupEnd(), "ncclGroupEnd", self.ptr)

    # -- the end
    def abort(self) -> None:
        """End the communicator now, its kernels on the device too (a rank died: they would wait for it forever)."""
        if self.closed:
            return
        self.closed = True
        st = self.lib.ncclCommAbort(self.handle)
        if st not in (SUCCESS, IN_PROGRESS):
            log.warning("NCCL: ncclCommAbort: %s", describe(st))

    def destroy(self, settle: float = 5.0) -> None:
        """Finalize then destroy (every rank does, after its last collective); aborted where finalizing fails or
        takes longer than `settle` seconds (a rank gone)."""
        if self.closed:
            return
        import time

        st = self.lib.ncclCommFinalize(self.handle)
        deadline = time.monotonic() + settle
        while st in (SUCCESS, IN_PROGRESS):
            st = self.state()
            if st != IN_PROGRESS:
                break
            if time.monotonic() >= deadline:
                st = -1
                break
            time.sleep(0.001)
        if st != SUCCESS:
            self.abort()
            return
        self.closed = True
        st = self.lib.ncclCommDestroy(self.handle)
        if st not in (SUCCESS, IN_PROGRESS):
            log.warning("NCCL: ncclCommDestroy: %s", describe(st))


def _p(address: int) -> ctypes.c_void_p:
    return ctypes.c_void_p(address or None)


def environment_note() -> str:
    """NCCL's own settings in the environment (NCCL_*), for the log line of a communicator."""
    keys = sorted(k for k in os.environ if k.startswith("NCCL_"))
    return ", ".join(f"{k}={os.environ[k]}" for k in keys)
