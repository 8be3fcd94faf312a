"""Collectives on op-cuda: not wired yet (NCCL: docs/distributed.md, "Not yet"). A collective instruction placed on
the GPU worker fails with an error that says so, and the daemon keeps serving; on two GPUs, NCCL's tests will go
here (they need a machine with two)."""

from __future__ import annotations

import numpy as np
import pytest

from deepx_core.errors import DeepxError
from deepx_core.ir import parse_text


def test_a_collective_on_op_cuda_says_nccl_is_not_wired(gx) -> None:
    gx.put("a", np.ones((2, 3), np.float32))
    with pytest.raises(DeepxError, match=r"allreduce: this executor runs no collectives.*NCCL is not wired"):
        gx.run_all(parse_text("allreduce (tensor<float32>:a, var<string>:sum, var<string>:default) -> "
                              "(tensor<float32>:a)"))
    np.testing.assert_array_equal(gx.get("a"), np.ones((2, 3), np.float32))  # unchanged
    gx.run_all(parse_text("addscalar (tensor<float32>:a, var<float64>:1) -> (tensor<float32>:b)"))
    np.testing.assert_array_equal(gx.get("b"), np.full((2, 3), 2.0, np.float32))
