"""Module buffers are heap tensors, as parameters are: the handle registered is the buffer, written in place by a
slice assignment (sliceassign into the same daemon tensor), kept in state_dict when persistent, converted by
model.to(dtype) without a new handle."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import deepx_sdk as dx
from deepx_core.client import NativeClient
from deepx_sdk.session import session


def _kinds() -> dict[str, str]:
    dx.sync()  # what is recorded reaches the daemon
    with NativeClient(session().transport.address) as c:
        return {t["name"]: t["kind"] for t in c.admin("tensors")}


class Cache(dx.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = dx.nn.Linear(4, 4)
        self.register_buffer("steps", dx.zeros(3))
        self.register_buffer("k", dx.zeros(2, 3, 8, 4), persistent=False)


def test_a_buffer_is_the_handle_registered_made_a_heap_tensor():
    t = dx.arange(6.0).reshape(2, 3)
    m = dx.nn.Module()
    m.register_buffer("b", t)
    assert m.b is t
    np.testing.assert_array_equal(t.numpy(), np.arange(6.0).reshape(2, 3))
    assert _kinds()[t.name] == "heap"
    name = t.name
    m.register_buffer("again", t)  # the same tensor in a second place: still the one heap tensor
    m.b = t
    assert t.name == name and m.again is t
    m.b = dx.ones(2)  # a new value: the new tensor made a heap tensor too
    assert _kinds()[m.b.name] == "heap"


def test_slice_assignment_writes_the_heap_tensor_in_place_and_nothing_else(rng):
    m = Cache()
    k, steps = m.k, m.steps
    name, before = k.name, steps.numpy().copy()
    value = rng.standard_normal((2, 3, 2, 4)).astype(np.float32)
    v = dx.tensor(value)
    m.k[:, :, 5:7] = v
    m.k[:1, 1, 0] = 9.0
    want = np.zeros((2, 3, 8, 4), np.float32)
    want[:, :, 5:7] = value
    want[:1, 1, 0] = 9.0
    np.testing.assert_array_equal(k.numpy(), want)
    assert k.name == name and m.k is k and _kinds()[name] == "heap"  # the same daemon tensor, written in place
    np.testing.assert_array_equal(steps.numpy(), before)  # the other buffer untouched
    np.testing.assert_array_equal(v.numpy(), value)  # and the value
    tk = torch.zeros(2, 3, 8, 4)
    tk[:, :, 5:7] = torch.from_numpy(value)
    tk[:1, 1, 0] = 9.0
    np.testing.assert_array_equal(k.numpy(), tk.numpy())


def test_a_slice_assignment_of_the_wrong_shape_names_the_op_and_the_tensors():
    m = Cache()
    v = dx.ones(2, 3, 3, 4)
    with pytest.raises(dx.DeepxError, match=rf"setitem \(sliceassign\): value '{v.name}' of shape \[2, 3, 3, 4\] "
                                            rf"does not fit '{m.k.name}'\[:, :, 5:7\] of shape \[2, 3, 2, 4\]"):
        m.k[:, :, 5:7] = v
    np.testing.assert_array_equal(m.k.numpy(), 0)  # nothing written


def test_persistent_buffers_are_in_the_state_dict_and_load_in_place():
    m = Cache()
    sd = m.state_dict()
    assert list(sd) == ["steps", "proj.weight", "proj.bias"] or set(sd) == {"steps", "proj.weight", "proj.bias"}
    assert sd["steps"] is m.steps and "k" not in sd
    steps = m.steps
    m.load_state_dict({**{k: v.numpy() for k, v in sd.items()}, "steps": np.array([1.0, 2.0, 3.0], np.float32)})
    assert m.steps is steps and _kinds()[steps.name] == "heap"
    np.testing.assert_array_equal(m.steps.numpy(), [1.0, 2.0, 3.0])


def test_model_to_converts_buffers_on_the_heap_keeping_the_handle():
    m = Cache()
    k = m.k
    m.k[0, 0, 0] = 2.5
    m.to(dx.float64)
    assert m.k is k and k.dtype == "float64" and _kinds()[k.name] == "heap"
    assert k.numpy()[0, 0, 0, 0] == 2.5 and m.steps.dtype == "float64"
