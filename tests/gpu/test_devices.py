"""On a daemon running op-cuda, x.device says cuda:0 and dx.cuda.is_available() is true; torch's device idioms run
unchanged (deepx_sdk/devices.py)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("pycuda.driver", reason="PyCUDA is not installed: op-cuda needs an NVIDIA GPU "
                    "(pip install -e '.[cuda]' there: docs/cuda.md)")
from deepxd.config import cuda_available

if not cuda_available():
    pytest.skip("no CUDA device answers here: op-cuda needs an NVIDIA GPU", allow_module_level=True)

import deepx_sdk as dx
import deepx_sdk.nn as nn


def test_an_op_cuda_daemon_says_cuda():
    dx.connect(roles=["heapmem", "op-cuda"])
    try:
        assert dx.cuda.is_available() and dx.cuda.device_count() == 1
        device = dx.device("cuda" if dx.cuda.is_available() else "cpu")
        model = nn.Linear(4, 2).to(device)
        x = dx.tensor(np.ones((3, 4), np.float32), device=device).to(device)
        out = model(x)
        assert x.device == "cuda:0" and x.is_cuda and out.device == dx.device("cuda", 0)
        assert next(model.parameters()).is_cuda
        assert x.cuda() is x and x.to("cpu") is x  # placement stays the daemon's
        assert out.shape == (3, 2)
        dx.cuda.synchronize()
    finally:
        dx.disconnect()
