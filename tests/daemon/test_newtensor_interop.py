"""Two scripts of the existing deepx front end on one daemon (issue 21, item 12): each names its tensors 0, 1, 2...,
so the second's `newtensor` meets the first's tensors. A newtensor of another shape or dtype replaces the tensor, so
both compute their own results; a heap tensor is not replaced, and the refusal says so."""

from __future__ import annotations

import numpy as np

from deepx_core.ir import parse_text
from tests.daemon.conftest import udp_exchange

# as the front end writes them: every output made with newtensor first, tensors numbered from 0 in each process
SCRIPT_A = """
newtensor (vector<int32>:[2 3]) -> (tensor<float32>:0) // id=1
newtensor (vector<int32>:[2 3]) -> (tensor<float32>:1) // id=2
newtensor (vector<int32>:[2 3]) -> (tensor<float32>:2) // id=3
arange (var<int32>:0, var<int32>:1) -> (tensor<float32>:0) // author=miaobyte id=4
constant (var<float32>:0.5) -> (tensor<float32>:1) // author=miaobyte id=5
add (tensor<float32>:0, tensor<float32>:1) -> (tensor<float32>:2) // author=miaobyte id=6
"""
SCRIPT_B = """
newtensor (vector<int32>:[5]) -> (tensor<int64>:0) // id=1
newtensor (vector<int32>:[5]) -> (tensor<int64>:1) // id=2
newtensor (vector<int32>:[5]) -> (tensor<int64>:2) // id=3
arange (var<int32>:10, var<int32>:2) -> (tensor<int64>:0) // author=miaobyte id=4
constant (var<int32>:3) -> (tensor<int64>:1) // author=miaobyte id=5
mul (tensor<int64>:0, tensor<int64>:1) -> (tensor<int64>:2) // author=miaobyte id=6
"""
WANT_A = np.arange(6, dtype=np.float32).reshape(2, 3) + np.float32(0.5)
WANT_B = (np.arange(10, 20, 2) * 3).astype(np.int64)


def _send(port: int, script: str) -> None:
    lines = [ln for ln in script.strip().splitlines()]
    replies = udp_exchange(port, "\n".join(lines), len(lines))
    assert all(" ok//" in r for r in replies), replies


def test_two_front_end_scripts_naming_tensors_alike_both_compute_right(daemon):
    for _ in range(3):  # taking turns: later turns find the other's tensors under their names
        for script, want in ((SCRIPT_A, WANT_A), (SCRIPT_B, WANT_B)):
            _send(daemon.udp_port, script)
            with daemon.client() as c:
                got = c.fetch("2")["2"]
            assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, got.shape)
            np.testing.assert_array_equal(got, want)


def test_same_shape_keeps_and_a_heap_tensor_is_not_replaced(daemon):
    with daemon.client() as c:
        c.put("kept", np.full((2, 2), 4, np.float32))
        r = c.run(parse_text("newtensor (vector<int32>:[2 2]) -> (tensor<float32>:kept)"), fetch=["kept"])
        assert r.ok, r.error
        np.testing.assert_array_equal(r.tensors["kept"], np.full((2, 2), 4, np.float32))
        c.put("w", np.ones((2, 3), np.float32), heap=True)
        r = c.run(parse_text("newtensor (vector<int32>:[4]) -> (tensor<float32>:w)"))
        assert not r.ok and r.error_index == 0
        assert ("newtensor: heap tensor 'w' is float32[2, 3]; it cannot be replaced by float32[4] (other processes "
                "map it): delete it first, or use another name") in r.error, r.error
        np.testing.assert_array_equal(c.fetch("w")["w"], np.ones((2, 3), np.float32))
        r = c.run(parse_text("newtensor (vector<int32>:[2 3]) -> (tensor<float32>:w)"), fetch=["w"])
        assert r.ok, r.error
        np.testing.assert_array_equal(r.tensors["w"], np.ones((2, 3), np.float32))
