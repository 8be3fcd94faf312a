"""Compiling CUDA sources with PyCUDA's compiler and caching the results, in memory and on disk.

`pycuda.compiler.compile` runs nvcc; its own disk cache keys a source that has `#include`s by nvcc's preprocessed
output, which costs an nvcc run on every lookup. Our sources all include the same toolkit headers, so the key here is
the source text, the options, the target architecture and the nvcc version (read once): a hit is one file read. The
cubins live in `cache_dir` (default `$DEEPX_CUDA_CACHE`, else `$XDG_CACHE_HOME/deepx/cuda`, else
`~/.cache/deepx/cuda`), so a restarted daemon loads them without compiling.

Compiling needs no context (the architecture is given), so `precompile` runs several nvcc processes in threads;
loading a module (`cuModuleLoadData`) happens on the executor's thread.
"""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import threading
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from deepx_core.errors import DeepxError

log = logging.getLogger(__name__)

# no --use_fast_math: it turns exp/log/sin/division into approximate forms, and the kernels keep IEEE results
OPTIONS = ("-O3", "-std=c++17")

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


class Compiler:
    """Source -> cubin bytes, through pycuda.compiler.compile, with a disk cache keyed by the source."""

    def __init__(self, arch: str, cache_dir: str | os.PathLike[str] | None = None) -> None:
        self.arch = arch
        self.cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        try:
            self.cache_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            log.warning("cuda: cache dir %s is not usable (%s); compiled kernels are kept in memory only",
                        self.cache_dir, e)
        self.compiled = 0  # nvcc runs in this process (cache misses), for tests and statistics
        self.loaded_from_disk = 0

    def key(self, source: str) -> str:
        h = hashlib.sha256()
        for part in (source, " ".join(OPTIONS), self.arch, nvcc_version()):
            h.update(part.encode())
            h.update(b"\0")
        return h.hexdigest()[:40]

    def cubin(self, source: str, what: str) -> bytes:
        path = self.cache_dir / f"{self.key(source)}.cubin"
        try:
            data = path.read_bytes()
            self.loaded_from_disk += 1
            return data
        except OSError:
            pass
        from pycuda.compiler import compile
        from pycuda.driver import CompileError

        try:
            data = compile(source, options=list(OPTIONS), no_extern_c=True, arch=self.arch, cache_dir=False)
        except CompileError as e:
            raise DeepxError(f"cuda: compiling the kernels of {what} failed: {str(e)[-4000:]}") from None
        self.compiled += 1
        try:
            tmp = path.with_suffix(f".tmp{os.getpid()}.{threading.get_ident()}")
            tmp.write_bytes(data)
            os.replace(tmp, path)
        except OSError as e:
            log.warning("cuda: cannot write %s: %s", path, e)
        return data


class ModuleCache:
    """Loaded modules and prepared functions, by source key; owned by the executor's thread."""

    def __init__(self, compiler: Compiler) -> None:
        self.compiler = compiler
        self.modules: dict[str, Any] = {}
        self.functions: dict[tuple[str, str], Any] = {}

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
        todo = [(s, w) for s, w in sources if not (self.compiler.cache_dir / f"{self.compiler.key(s)}.cubin").exists()]
        if not todo:
            return 0
        workers = workers or max(1, min(16, (os.cpu_count() or 2)))
        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(lambda sw: self.compiler.cubin(*sw), todo))
        return len(todo)
