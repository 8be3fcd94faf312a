"""The host side of op-cuda's CUDA graphs, checked without a GPU. What may be replayed as a graph
(CudaExecutor.capturable) is decided from the checked program alone: a random op whose seed is 0 draws a fresh seed
at each launch, which a graph would freeze (every replayed step the same dropout mask); with a seed of its own it may
be captured. A destroyed graph (graphs.Captured.destroy) lets go of every tensor it held, its segments' tables of
names included: a dropped graph lives on while its plan does, and must not pin a step's temporaries."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest

from deepx_core.ir import parse_text
from deepx_core.ir.ops import check_program
from deepxd.kernels.cpu import CpuExecutor
from deepxd.kernels.cuda import CudaExecutor, graphs

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


class _Buffer:
    """Stands for a device tensor a graph holds (only whether it is still referenced is looked at)."""


def test_a_destroyed_graph_holds_no_tensor():
    kept, mid, left = _Buffer(), _Buffer(), _Buffer()
    seen = [weakref.ref(b) for b in (kept, mid, left)]
    captured = graphs.Captured(
        [graphs.Segment(0, 0, (1, "crossentropy", "a label is out of range"), {"h": mid, "gone": None}),
         graphs.Segment(0, 0, None, {"h": None, "loss": left})],
        {"x": (0x1000, (4, 8), np.dtype(np.float32))}, [kept], numbers_host=np.zeros(32), calls={3: ([kept], [])})
    del kept, mid, left
    captured.destroy()
    gc.collect()
    assert [r() for r in seen] == [None, None, None]
    assert all(seg.after == {} and not seg.exe for seg in captured.segments)
    assert captured.numbers_host is None and not captured.valid({})
    captured.destroy()  # twice: nothing left to free
