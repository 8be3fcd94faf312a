"""What op-cuda may replay as a CUDA graph (CudaExecutor.capturable), decided from the checked program alone, so it
is checked here without a GPU: a random op whose seed is 0 draws a fresh seed at each launch, which a graph would
freeze (every replayed step the same dropout mask); with a seed of its own it may be captured."""

from __future__ import annotations

import numpy as np
import pytest

from deepx_core.ir import parse_text
from deepx_core.ir.ops import check_program
from deepxd.kernels.cpu import CpuExecutor
from deepxd.kernels.cuda import CudaExecutor

PROGRAMS = {
    "dropout": "dropout (var<float64>:0.5, var<int64>:{seed}) -> (tensor<float32>:a)",
    "uniform": "uniform (var<float64>:0.0, var<float64>:1.0, var<int64>:{seed}) -> (tensor<float32>:a)",
    "normal": "normal (var<float64>:0.0, var<float64>:1.0, var<int64>:{seed}) -> (tensor<float32>:a)",
}


def _bounds(text: str) -> list:
    ex = CpuExecutor()
    ex.tensors["a"] = np.ones((4, 8), np.float32)
    ex.tensors["x"] = np.ones((4, 8), np.float32)
    return check_program(parse_text("exp (tensor<float32>:x) -> (tensor<float32>:y)\n" + text), ex, ex.plans)


@pytest.mark.parametrize("op", sorted(PROGRAMS))
def test_a_random_op_of_seed_0_is_not_captured(op):
    why = CudaExecutor.capturable(_bounds(PROGRAMS[op].format(seed=0)))
    assert why is not None and op in why and "seed" in why


@pytest.mark.parametrize("op", sorted(PROGRAMS))
def test_a_random_op_of_its_own_seed_is_captured(op):
    assert CudaExecutor.capturable(_bounds(PROGRAMS[op].format(seed=1234))) is None
