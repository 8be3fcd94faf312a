"""NVRTC, the CUDA run-time compiler, through ctypes: CUDA C++ source -> cubin in this process, without an nvcc process.

An nvcc run costs a process start, a host-compiler pass and a fresh parse of the toolkit headers (1-3 s per module);
NVRTC compiles the device code only, in-process, and releases the GIL while it works (ctypes does), so several
modules compile at once in threads. The library is found as libcublas is: `$DEEPX_NVRTC`, then the versioned names,
then whatever the loader finds. The toolkit headers our sources include (cuda_fp16.h, cuda_bf16.h, cuda_fp8.h) are
found through `include_dirs()`.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import logging
import os
import shutil
import sys
import threading
from pathlib import Path

from deepx_core.errors import DeepxError
from deepxd.kernels.cuda._libs import load

log = logging.getLogger(__name__)

_SUCCESS = 0
_lib: ctypes.CDLL | None = None
_lib_error: str | None = None
_lock = threading.Lock()


def library() -> ctypes.CDLL:
    """libnvrtc, loaded once; DeepxError naming every place tried where none loads."""
    global _lib, _lib_error
    with _lock:
        if _lib is not None:
            return _lib
        if _lib_error is not None:
            raise DeepxError(_lib_error)
        try:
            _lib = load("DEEPX_NVRTC", ("libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"), "nvrtc", _declare,
                        "NVRTC")
        except DeepxError as e:
            _lib_error = f"cuda: {e}"
            raise DeepxError(_lib_error) from None
        return _lib


def available() -> bool:
    try:
        library()
    except DeepxError:
        return False
    return True


def _declare(lib: ctypes.CDLL) -> None:
    p = ctypes.c_void_p
    cp = ctypes.c_char_p
    sz = ctypes.POINTER(ctypes.c_size_t)
    lib.nvrtcGetErrorString.restype = cp
    lib.nvrtcGetErrorString.argtypes = [ctypes.c_int]
    lib.nvrtcVersion.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_int)]
    lib.nvrtcCreateProgram.argtypes = [ctypes.POINTER(p), cp, cp, ctypes.c_int, ctypes.POINTER(cp),
                                       ctypes.POINTER(cp)]
    lib.nvrtcDestroyProgram.argtypes = [ctypes.POINTER(p)]
    lib.nvrtcCompileProgram.argtypes = [p, ctypes.c_int, ctypes.POINTER(cp)]
    lib.nvrtcGetProgramLogSize.argtypes = [p, sz]
    lib.nvrtcGetProgramLog.argtypes = [p, ctypes.c_char_p]
    lib.nvrtcGetCUBINSize.argtypes = [p, sz]
    lib.nvrtcGetCUBIN.argtypes = [p, ctypes.c_char_p]
    for f in (lib.nvrtcVersion, lib.nvrtcCreateProgram, lib.nvrtcDestroyProgram, lib.nvrtcCompileProgram,
              lib.nvrtcGetProgramLogSize, lib.nvrtcGetProgramLog, lib.nvrtcGetCUBINSize, lib.nvrtcGetCUBIN):
        f.restype = ctypes.c_int


def version(lib: ctypes.CDLL | None = None) -> tuple[int, int]:
    lib = lib or library()
    major, minor = ctypes.c_int(), ctypes.c_int()
    lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
    return major.value, minor.value


@functools.cache
def include_dirs() -> tuple[str, ...]:
    """Directories holding cuda_fp16.h: $DEEPX_CUDA_INCLUDE, $CUDA_HOME/$CUDA_PATH, beside nvcc, /usr/local/cuda,
    and the include folders of NVIDIA's wheels (nvidia/cuda_runtime, nvidia/cu13) on sys.path; looked for once."""
    found: list[str] = []
    candidates = [os.environ.get("DEEPX_CUDA_INCLUDE", "")]
    for env in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(env):
            candidates.append(os.path.join(os.environ[env], "include"))
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(str(Path(nvcc).resolve().parent.parent / "include"))
    candidates += ["/usr/local/cuda/include"]
    for entry in sys.path:
        candidates += sorted(glob.glob(os.path.join(entry, "nvidia", "*", "include")))
    for c in candidates:
        if c and os.path.isfile(os.path.join(c, "cuda_fp16.h")) and c not in found:
            found.append(c)
    return tuple(found)


def compile_cubin(source: str, name: str, arch: str, options: tuple[str, ...] = ()) -> bytes:
    """Compile `source` for `arch` (e.g. "sm_90") to cubin bytes; DeepxError with NVRTC's log on failure."""
    lib = library()
    prog = ctypes.c_void_p()
    rc = lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), name.encode(), 0, None, None)
    if rc != _SUCCESS:
        raise DeepxError(f"cuda: NVRTC cannot create a program for {name}: {_error(lib, rc)}")
    try:
        opts = [f"--gpu-architecture={arch}", *options, *(f"--include-path={d}" for d in include_dirs())]
        argv = (ctypes.c_char_p * len(opts))(*(o.encode() for o in opts))
        rc = lib.nvrtcCompileProgram(prog, len(opts), argv)
        if rc != _SUCCESS:
            raise DeepxError(f"cuda: compiling {name} failed ({_error(lib, rc)}): {_log(lib, prog)[-4000:]}")
        size = ctypes.c_size_t()
        _check(lib, lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)), name)
        out = ctypes.create_string_buffer(size.value)
        _check(lib, lib.nvrtcGetCUBIN(prog, out), name)
        return out.raw
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def _log(lib: ctypes.CDLL, prog: ctypes.c_void_p) -> str:
    size = ctypes.c_size_t()
    if lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size)) != _SUCCESS or size.value <= 1:
        return "(no log)"
    buf = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, buf)
    return buf.value.decode(errors="replace")


def _error(lib: ctypes.CDLL, rc: int) -> str:
    msg = lib.nvrtcGetErrorString(rc)
    return msg.decode() if msg else f"error {rc}"


def _check(lib: ctypes.CDLL, rc: int, name: str) -> None:
    if rc != _SUCCESS:
        raise DeepxError(f"cuda: NVRTC failed on {name}: {_error(lib, rc)}")
