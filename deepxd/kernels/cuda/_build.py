"""Compiling CUDA sources to cubins and caching them, in memory and on disk.

Two compilers: NVRTC (`nvrtc.py`, in-process, the default where libnvrtc loads) and nvcc through PyCUDA (a process
per module: `DEEPX_CUDA_COMPILER=nvcc`, or where NVRTC is missing). The cache key is the source text, the options,
the target architecture and the compiler's version: a hit is one file read. The cubins live in `cache_dir` (default
`$DEEPX_CUDA_CACHE`, else `$XDG_CACHE_HOME/deepx/cuda`, else `~/.cache/deepx/cuda`), so a restarted daemon loads
them without compiling.

Compiling needs no context (the architecture is given), so `precompile` and `warm` compile several modules at once in
threads (NVRTC and the nvcc processes both run without the GIL), and a module the executor asks for while a thread
compiles it is waited for, not compiled twice; loading a module (`cuModuleLoadData`) happens on the executor's thread.
"""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import subprocess
import threading
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from deepx_core.errors import DeepxError

#: how long closing an executor waits for the warm-up's modules in flight (one module each)
STOP_WAIT_S = 30.0
log = logging.getLogger(__name__)

# no --use_fast_math: it turns exp/log/sin/division into approximate forms, and the kernels keep IEEE results
OPTIONS = ("-O3", "-std=c++17")
# NVRTC optimises by default; unannotated helpers are device code, as nvcc's sources declare them
NVRTC_OPTIONS = ("-std=c++17", "--device-as-default-execution-space")

_nvcc_version: str | None = None
_version_lock = threading.Lock()


def default_cache_dir() -> Path:
    env = os.environ.get("DEEPX_CUDA_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "deepx" / "cuda"


def nvcc_version(nvcc: str = "nvcc") -> str:
    global _nvcc_version
    with _version_lock:
        if _nvcc_version is None:
            try:
                _nvcc_version = subprocess.run([nvcc, "--version"], capture_output=True, text=True,
                                               check=True).stdout
            except (OSError, subprocess.CalledProcessError) as e:
                raise DeepxError(f"cuda: cannot run nvcc ({e}); the CUDA toolkit's nvcc must be on PATH") from None
        return _nvcc_version


def choose_compiler(name: str | None = None) -> str:
    """"nvrtc" or "nvcc": `name`, else $DEEPX_CUDA_COMPILER, else NVRTC where libnvrtc loads."""
    from deepxd.kernels.cuda import nvrtc

    name = (name or os.environ.get("DEEPX_CUDA_COMPILER") or "").strip().lower()
    if name not in ("", "nvrtc", "nvcc"):
        raise DeepxError(f"cuda: unknown compiler {name!r} (DEEPX_CUDA_COMPILER is nvrtc or nvcc)")
    if name == "nvrtc":
        nvrtc.library()  # a clear error where it is missing
        return "nvrtc"
    if name == "nvcc":
        return "nvcc"
    return "nvrtc" if nvrtc.available() else "nvcc"


class Compiler:
    """Source -> cubin bytes, through NVRTC or nvcc, with a disk cache keyed by the source.

    Thread-safe: `cubin` may be called from several threads; one source is compiled once, the other callers wait.
    """

    def __init__(self, arch: str, cache_dir: str | os.PathLike[str] | None = None, *,
                 compiler: str | None = None) -> None:
        self.arch = arch
        self.kind = choose_compiler(compiler)
        self.cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        try:
            self.cache_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            log.warning("cuda: cache dir %s is not usable (%s); compiled kernels are kept in memory only",
                        self.cache_dir, e)
        self.compiled = 0  # compiler runs in this process (cache misses), for tests and statistics
        self.loaded_from_disk = 0
        self.compile_seconds = 0.0
        self._lock = threading.Lock()
        self._inflight: dict[str, threading.Event] = {}
        self.writable = os.access(self.cache_dir, os.W_OK)
        self._version = self._compiler_version()

    def _compiler_version(self) -> str:
        if self.kind == "nvrtc":
            from deepxd.kernels.cuda import nvrtc

            return "nvrtc " + ".".join(map(str, nvrtc.version()))
        return nvcc_version()

    def key(self, source: str) -> str:
        h = hashlib.sha256()
        options = NVRTC_OPTIONS if self.kind == "nvrtc" else OPTIONS
        for part in (source, " ".join(options), self.arch, self._version):
            h.update(part.encode())
            h.update(b"\0")
        return h.hexdigest()[:40]

    def cached(self, source: str) -> bool:
        return (self.cache_dir / f"{self.key(source)}.cubin").exists()

    def cubin(self, source: str, what: str) -> bytes:
        key = self.key(source)
        while True:
            with self._lock:
                event = self._inflight.get(key)
                if event is None:
                    event = self._inflight[key] = threading.Event()
                    break
            event.wait()  # another thread compiles it into the disk cache, where _read_or_compile finds it
        try:
            data = self._read_or_compile(key, source, what)
        finally:
            with self._lock:
                del self._inflight[key]
            event.set()
        return data

    def compile_ahead(self, source: str, what: str) -> None:
        """Compile into the disk cache, unless it is there or being compiled."""
        key = self.key(source)
        with self._lock:
            if key in self._inflight or (self.cache_dir / f"{key}.cubin").exists():
                return
            event = self._inflight[key] = threading.Event()
        try:
            self._read_or_compile(key, source, what)
        except DeepxError as e:
            log.warning("%s", e)
        finally:
            with self._lock:
                del self._inflight[key]
            event.set()

    def _read_or_compile(self, key: str, source: str, what: str) -> bytes:
        path = self.cache_dir / f"{key}.cubin"
        try:
            data = path.read_bytes()
            self.loaded_from_disk += 1
            return data
        except OSError:
            pass
        t0 = time.perf_counter()
        data = self._nvrtc(source, what) if self.kind == "nvrtc" else self._nvcc(source, what)
        with self._lock:
            self.compiled += 1
            self.compile_seconds += time.perf_counter() - t0
        try:
            tmp = path.with_suffix(f".tmp{os.getpid()}.{threading.get_ident()}")
            tmp.write_bytes(data)
            os.replace(tmp, path)
        except OSError as e:
            log.warning("cuda: cannot write %s: %s", path, e)
        return data

    def _nvrtc(self, source: str, what: str) -> bytes:
        from deepxd.kernels.cuda import nvrtc

        try:
            return nvrtc.compile_cubin(source, what.replace(" ", "_") + ".cu", self.arch, NVRTC_OPTIONS)
        except DeepxError as e:
            raise DeepxError(f"cuda: compiling the kernels of {what} failed: {e}") from None

    def _nvcc(self, source: str, what: str) -> bytes:
        from pycuda.compiler import compile
        from pycuda.driver import CompileError

        try:
            return compile(source, options=list(OPTIONS), no_extern_c=True, arch=self.arch, cache_dir=False)
        except CompileError as e:
            raise DeepxError(f"cuda: compiling the kernels of {what} failed: {str(e)[-4000:]}") from None


class ModuleCache:
    """Loaded modules and prepared functions, by source key; owned by the executor's thread."""

    def __init__(self, compiler: Compiler) -> None:
        self.compiler = compiler
        self.modules: dict[str, Any] = {}
        self.functions: dict[tuple[str, str], Any] = {}
        self._warming: Warming | None = None

    def module(self, key: str, source: str, what: str) -> Any:
        mod = self.modules.get(key)
        if mod is None:
            import pycuda.driver as cuda

            mod = self.modules[key] = cuda.module_from_buffer(self.compiler.cubin(source, what))
        return mod

    def function(self, key: str, source: str, name: str, fmt: str, what: str) -> Any:
        f = self.functions.get((key, name))
        if f is None:
            mod = self.module(key, source, what)
            try:
                f = mod.get_function(name)
            except Exception as e:  # pycuda.driver.LogicError: named symbol not found
                raise DeepxError(f"{what}: kernel {name} not found in its module ({e})") from None
            f.prepare(fmt)
            self.functions[(key, name)] = f
        return f

    def precompile(self, sources: Iterable[tuple[str, str]], workers: int | None = None) -> int:
        """Compile (source, what) pairs into the disk cache in parallel; returns how many were compiled."""
        todo = [(s, w) for s, w in sources if not self.compiler.cached(s)]
        if not todo:
            return 0
        workers = workers or max(1, min(16, (os.cpu_count() or 2)))
        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(lambda sw: self.compiler.cubin(*sw), todo))
        return len(todo)

    def warm(self, sources: Iterable[tuple[str, str]], workers: int | None = None) -> Warming:
        """Compile `sources` not yet on disk, in order, in background daemon threads, while the executor goes on:
        the modules a first step needs are ready (or in flight) when it asks for them. The threads never hold up the
        process's exit (a module half compiled is not written), and `stop_warming()` ends them after their current
        one."""
        todo = [(s, w) for s, w in sources if not self.compiler.cached(s)] if self.compiler.writable else []
        workers = workers or max(1, min(16, (os.cpu_count() or 2) - 1))
        self._warming = Warming(self.compiler, todo, workers)
        return self._warming

    def stop_warming(self, wait_s: float = STOP_WAIT_S) -> None:
        """End the warm-up after the modules in flight, waiting up to `wait_s` for them: a thread still inside NVRTC
        while Python finalises aborts the process (executor close, before the exit)."""
        if self._warming is not None:
            self._warming.stop()
            self._warming.join(wait_s)


class Warming:
    """The background compilation of `ModuleCache.warm`: daemon threads that take sources from a queue in order."""

    def __init__(self, compiler: Compiler, todo: list[tuple[str, str]], workers: int) -> None:
        self._queue: queue.SimpleQueue[tuple[str, str]] = queue.SimpleQueue()
        for item in todo:
            self._queue.put(item)
        self._stopped = threading.Event()
        self._compiler = compiler
        self.threads = [threading.Thread(target=self._run, name=f"deepx-cuda-warm-{k}", daemon=True)
                        for k in range(min(workers, len(todo)))]
        for t in self.threads:
            t.start()

    def _run(self) -> None:
        while not self._stopped.is_set():
            try:
                source, what = self._queue.get_nowait()
            except queue.Empty:
                return
            self._compiler.compile_ahead(source, what)

    def stop(self) -> None:
        self._stopped.set()

    def join(self, timeout: float | None = None) -> None:
        """Wait for every thread, `timeout` seconds in all (None: as long as they take)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for t in self.threads:
            t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
