"""Fixtures for the GPU tests. They run where PyCUDA is installed and a CUDA device answers (docs/cuda.md says how);
elsewhere each test module skips with the reason.

`cuda_session` is one CudaExecutor for the whole session (one context on the main thread; its kernel modules are
compiled once, in parallel, at the start); `gx` hands it to a test with an empty tensor table.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

NO_PYCUDA = ("PyCUDA is not installed: the CUDA kernel tests need an NVIDIA GPU (pip install -e '.[cuda]' there: "
             "docs/cuda.md)")


def gpu_reason() -> str | None:
    """Why the GPU tests cannot run here, or None when they can."""
    try:
        import pycuda.driver as drv
    except ImportError:
        return NO_PYCUDA
    try:
        drv.init()
        if drv.Device.count() == 0:
            return "no CUDA device answers here: the CUDA kernel tests need an NVIDIA GPU"
    except Exception as e:  # pycuda.driver.Error: no driver, no device
        return f"no CUDA device answers here ({e}): the CUDA kernel tests need an NVIDIA GPU"
    return None


@pytest.fixture(scope="session")
def cuda_session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    reason = gpu_reason()
    if reason:
        pytest.skip(reason)
    import os

    from deepxd.kernels.cuda import CudaExecutor

    cache = os.environ.get("DEEPX_CUDA_CACHE") or str(tmp_path_factory.mktemp("cuda-cache"))
    ex = CudaExecutor(cache_dir=cache)
    try:
        ex.precompile()
        yield ex
    finally:
        ex.close()


@pytest.fixture
def gx(cuda_session: Any) -> Iterator[Any]:
    ex = cuda_session
    ex.tensors.clear()
    ex.variables.clear()
    ex.vectors.clear()
    ex.fallbacks.clear()
    ex.tf32 = False
    yield ex
    ex.synchronize()
    ex.tensors.clear()


@pytest.fixture
def rng(request: pytest.FixtureRequest) -> np.random.Generator:
    """A generator seeded by the test's id, as tests/compiler's and tests/kernels' fixtures are."""
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))
