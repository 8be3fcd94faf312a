"""The recording hot path: the operator fast paths record what the general path records, every op remembers the
user's line (resolved only when needed), and the remembered shape rules give what the catalogue's rules give."""

from __future__ import annotations

import gc
import inspect

import numpy as np
import pytest

import deepx_sdk as dx
import deepx_sdk.nn as nn
import deepx_sdk.nn.functional as F
from deepx_core.ir.ops import TensorMeta
from deepx_sdk.recorder import origin_of, source_line
from deepx_sdk.tensor import _INFERRED, infer_meta

HERE = __file__


def last_origin() -> tuple[str, int, str]:
    code, offset = origin_of(dx.session().origins[-1])
    return code.co_filename, source_line(code, offset), code.co_name


def lineno() -> int:
    return inspect.currentframe().f_back.f_lineno


OPS = {
    "add": lambda a, b: a + b, "radd": lambda a, b: 2.0 + a, "sub": lambda a, b: a - b,
    "rsub": lambda a, b: 1.5 - a, "mul": lambda a, b: a * b, "mulscalar": lambda a, b: a * 3,
    "div": lambda a, b: a / b, "rdiv": lambda a, b: 2.0 / a, "pow": lambda a, b: a ** 2.0,
    "rpow": lambda a, b: 2.0 ** a, "relu": lambda a, b: a.relu(), "exp": lambda a, b: a.exp(),
}


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "int32"])
@pytest.mark.parametrize("op", sorted(OPS))
def test_fast_paths_record_what_the_general_path_records(op, dtype):
    a = dx.tensor(np.arange(1, 7).reshape(2, 3)).to(dtype)
    b = dx.tensor(np.arange(2, 8).reshape(2, 3)).to(dtype)
    s = dx.session()
    gc.collect()  # earlier tests' garbage: its deltensors go out with this sync, not into the programs compared
    dx.sync()
    got = OPS[op](a, b)
    fast = [i for i in s.pending if i.name != "deltensor"]  # a collection may still strike in between
    # the same through the general path (Tensor._binary_general, or _unary's cast branch)
    s.pending.clear()
    s.origins.clear()
    if op in ("relu", "exp"):
        a2 = a.to("float32") if dtype not in ("float32", "float64", "float16") else a
        want_dtype = "int32" if (op == "relu" and dtype == "int32") else a2.dtype
    else:
        want_dtype = got.dtype
    assert got.dtype == want_dtype
    general = {
        "add": lambda: a._binary_general("add", b, "addscalar", None, False, False),
        "radd": lambda: a._binary_general("add", 2.0, "addscalar", None, False, False),
        "sub": lambda: a._binary_general("sub", b, "subscalar", None, False, False),
        "rsub": lambda: a._binary_general("sub", 1.5, "subscalar", "rsubscalar", True, False),
        "mul": lambda: a._binary_general("mul", b, "mulscalar", None, False, False),
        "mulscalar": lambda: a._binary_general("mul", 3, "mulscalar", None, False, False),
        "div": lambda: a._binary_general("div", b, "divscalar", None, False, True),
        "rdiv": lambda: a._binary_general("div", 2.0, "divscalar", "rdivscalar", True, True),
        "pow": lambda: a._binary_general("pow", 2.0, "powscalar", None, False, False),
        "rpow": lambda: a._binary_general("pow", 2.0, "powscalar", "rpowscalar", True, False),
    }
    if op in general:
        want = general[op]()
        slow = [i for i in s.pending if i.name != "deltensor"]
        assert (want.shape, want.dtype) == (got.shape, got.dtype)
        # the same instructions but for the result's name
        assert [i.name for i in slow] == [i.name for i in fast]
        assert [i.args for i in slow[:-1]] == [i.args for i in fast[:-1]]
        assert [tuple((p.category, p.precisions, type(p.value)) for p in i.args[-2:]) for i in slow] == \
            [tuple((p.category, p.precisions, type(p.value)) for p in i.args[-2:]) for i in fast]
    s.pending.clear()
    s.origins.clear()
    np.testing.assert_allclose(OPS[op](a, b).numpy().astype(np.float64),
                               _reference(op, a.numpy(), b.numpy()).astype(np.float64), rtol=2e-3)


def _reference(op: str, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    import torch

    ta, tb = torch.from_numpy(a), torch.from_numpy(b)
    return OPS[op](ta, tb).numpy()


def test_the_fast_path_keeps_the_graph_for_backward():
    dx.connect()  # a session of its own: backward walks the whole session's recorded graph
    w = dx.tensor([1.0, 2.0, 3.0], requires_grad=True)
    x = dx.tensor([4.0, 5.0, 6.0])
    loss = ((w * x + w) * 0.5).sum()
    loss.backward()
    np.testing.assert_allclose(w.grad.numpy(), (x.numpy() + 1) * 0.5)


def _user_helper(a, b):
    return (a * b).relu()  # the line the user's helper records


def test_every_path_remembers_the_users_line():
    a, b = dx.ones(4, 4), dx.ones(4, 4)
    dx.sync()
    cases = []
    line = lineno() + 1
    c = a + b
    cases.append((line, "test_every_path_remembers_the_users_line"))
    assert last_origin() == (HERE, *cases[-1])
    line = lineno() + 1
    c = a * 0.5
    assert last_origin() == (HERE, line, "test_every_path_remembers_the_users_line")
    line = lineno() + 1
    c = a.reshape(16).sum(0)
    assert last_origin() == (HERE, line, "test_every_path_remembers_the_users_line")
    line = lineno() + 1
    c = F.relu(a)  # through the SDK's functional module
    assert last_origin() == (HERE, line, "test_every_path_remembers_the_users_line")
    line = inspect.getsourcelines(_user_helper)[1] + 1
    c = _user_helper(a, b)
    assert last_origin() == (HERE, line, "_user_helper")
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU())
    line = lineno() + 1
    c = model(a)  # several SDK frames deep
    assert last_origin() == (HERE, line, "test_every_path_remembers_the_users_line")
    make = lambda: b - a  # noqa: E731
    c = make()
    assert last_origin() == (HERE, lineno() - 2, "<lambda>")
    del c


def test_source_line_reads_a_frames_offset():
    frame = inspect.currentframe()
    assert source_line(frame.f_code, frame.f_lasti) == frame.f_lineno


SHAPES = [(), (1,), (5,), (2, 3), (4, 1, 3), (2, 3, 4, 5), (1, 6, 1)]


def _cases(rng: np.random.Generator) -> list[tuple[str, list]]:
    out = []
    for shape in SHAPES:
        m = TensorMeta(shape, "float32")
        nd = len(shape)
        out.append(("sum", [m, tuple(sorted(set(rng.integers(-max(nd, 1), max(nd, 1), 2).tolist()))) if nd else (),
                            bool(rng.integers(2))]))
        out.append(("reshape", [m, (-1,)]))
        out.append(("reshape", [m, (int(np.prod(shape)) + 1,)]))  # refused
        out.append(("transpose", [m, tuple(rng.permutation(nd).tolist())]))
        other = tuple(int(d) for d in rng.integers(1, 6, 2))
        out.append(("matmul", [TensorMeta((*shape[-1:], 3) if nd else (3, 3), "float32"),
                               TensorMeta((3, other[0]), "float32")]))
        out.append(("matmul", [TensorMeta((2, 3), "float32"), TensorMeta((other[0], 4), "float32")]))
        out.append(("broadcastTo", [m, (2, *shape)]))
    return out


@pytest.mark.parametrize("seed", range(5))
def test_remembered_shape_rules_equal_the_catalogue(seed):
    rng = np.random.default_rng(seed)
    t = dx.ones(1)
    for name, args in _cases(rng):
        names = [f"t{i}" for i in range(len(args))]
        try:
            want = infer_meta(name, args, names)
        except dx.DeepxError as e:
            for _ in range(2):  # a refusal is never remembered: it is raised every time, with the same words
                with pytest.raises(dx.DeepxError) as again:
                    t._infer(name, args, names)
                assert str(again.value) == str(e)
            continue
        first = t._infer(name, args, names)
        assert (name, *args) in _INFERRED
        assert t._infer(name, args, names) == first == want


def test_a_repeated_step_reading_a_transpose_twice_keeps_its_values():
    """A step whose W.t() feeds a matmul and an elementwise chain (recorded as one fused instruction, which reads it
    through a tensor list): once the step repeats, the op worker runs it as a known program, where only a transpose
    that one matmul alone reads is left unmade. W changes between steps; every step's values are numpy's."""
    rng = np.random.default_rng(0)
    w0 = rng.standard_normal((32, 16)).astype(np.float32)
    x0 = rng.standard_normal((8, 16)).astype(np.float32)
    w, x = dx.tensor(w0), dx.tensor(x0)
    for _ in range(6):
        wt = w.t()
        y = x @ wt
        z = (wt * 2.0 + 1.0) * 3.0 - 0.5
        del wt
        np.testing.assert_allclose(z.numpy(), (w0.T * 2 + 1) * 3 - 0.5, rtol=1e-6)
        np.testing.assert_allclose(y.numpy(), x0 @ w0.T, rtol=1e-5, atol=1e-5)
        del y, z
        w.mul_(1.5)
        w0 = w0 * np.float32(1.5)
