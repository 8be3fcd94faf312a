"""An executor of another process (docs/executor.md) beside op-cuda: the node's tensors live on the GPU, so an
executor's inputs are copied to the host for it and its results put back on the device; a heap tensor on the GPU
goes by its bytes (no shared-memory segment to map)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("pycuda.driver", reason="PyCUDA is not installed: the op-cuda tests need an NVIDIA GPU "
                    "(pip install -e '.[cuda]' there: docs/cuda.md)")
from deepxd.config import cuda_available

if not cuda_available():
    pytest.skip("no CUDA device answers here: the op-cuda tests need an NVIDIA GPU", allow_module_level=True)

from deepx_core.ir import parse_text
from tests.daemon.conftest import Daemon
from tests.daemon.test_executor import Executor


def test_an_executor_serves_a_node_whose_tensors_are_on_the_gpu(tmp_path):
    d = Daemon(tmp_path, kv=f"memory://{tmp_path}/plane.aof", extra=["--role", "heapmem,op-cuda"], udp=False)
    d.start(wait=False)
    d.wait_ready(120)
    c = d.client()
    ex = Executor(d.address, tmp_path, check=c)
    try:
        rng = np.random.default_rng(37)
        a = rng.normal(size=(8, 16)).astype(np.float32)
        w = rng.normal(size=(16, 4)).astype(np.float32)
        c.put("ga", a)
        c.put("gw", w, heap=True)
        assert {t["name"]: t["device"] for t in c.admin("tensors")}["ga"].startswith("cuda")
        r = c.run(parse_text("""
            matmul (tensor<float32>:ga, tensor<float32>:gw) -> (tensor<float32>:gy)
            cumprod (tensor<float32>:gy, var<int32>:1) -> (tensor<float32>:gc)
            attached (tensor<float32>:gw) -> (tensor<int64>:gn)
            mulscalar (tensor<float32>:gc, var<float32>:2.0) -> (tensor<float32>:gd)
        """), fetch=["gd", "gn"])
        assert r.ok, r.error
        np.testing.assert_allclose(r.tensors["gd"], 2 * np.cumprod(a @ w, axis=1), rtol=1e-4, atol=1e-4)
        assert int(r.tensors["gn"]) == 0  # a heap tensor on the GPU has no segment to map: its bytes went
        assert {t["name"]: t["device"] for t in c.admin("tensors")}["gc"].startswith("cuda")
    finally:
        ex.stop()
        c.close()
        assert d.stop() == 0, d.output()
