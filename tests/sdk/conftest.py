"""Fixtures for the SDK tests: an embedded session, torch as the reference, and helpers that compare the two."""

from __future__ import annotations

import contextlib
import os
import sys
import zlib

import numpy as np
import pytest
import torch

import deepx_sdk as dx
from deepx_core.ir.dtypes import to_numpy

DTYPES = ["float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "bool"]
FLOAT_DTYPES = ["float64", "float32", "float16", "bfloat16"]
INT_DTYPES = ["int64", "int32", "int16", "int8"]

TORCH_DTYPE = {name: getattr(torch, name) for name in DTYPES}
DX_DTYPE = {v: k for k, v in TORCH_DTYPE.items()}

# (rtol, atol) per dtype for results computed in one precision by both sides
TOL = {"float64": (1e-10, 1e-12), "float32": (1e-5, 1e-6), "float16": (2e-3, 1e-3), "bfloat16": (1.6e-2, 1e-2)}


def current_session() -> dx.Session | None:
    return sys.modules["deepx_sdk.session"]._current


def _not_embedded() -> bool:
    s = current_session()
    return s is not None and type(s.transport).__name__ != "EmbeddedTransport"


@pytest.fixture(autouse=True)
def embedded_session(monkeypatch):
    """Every SDK test starts from the default session: embedded, unless the test itself connects elsewhere."""
    monkeypatch.delenv("DEEPX_ADDRESS", raising=False)
    if _not_embedded():
        dx.disconnect()
    yield
    if _not_embedded():
        dx.disconnect()
    elif current_session() is not None:
        # a test that stopped between recording and reading leaves its instructions (and their error) pending
        with contextlib.suppress(dx.DeepxError):
            dx.sync()


@pytest.fixture
def rng(request):
    """A numpy generator seeded from the test's id: random, but the same on every run (DEEPX_TEST_SEED=n mixes n
    in, to run the same tests on other random inputs)."""
    extra = int(os.environ.get("DEEPX_TEST_SEED", "0"))
    return np.random.default_rng([zlib.crc32(request.node.nodeid.encode()), extra])


def random_array(rng: np.random.Generator, shape, dtype: str, low: float = -3.0, high: float = 3.0) -> np.ndarray:
    shape = tuple(shape)
    if dtype == "bool":
        return rng.random(shape) < 0.5
    if dtype in INT_DTYPES:
        lo, hi = int(np.floor(low)), int(np.ceil(high))
        return rng.integers(lo, hi + 1, size=shape).astype(dtype)
    a = rng.uniform(low, high, size=shape)
    return a.astype(np.float32).astype(to_numpy(dtype))


def to_torch(a: np.ndarray, dtype: str | None = None) -> torch.Tensor:
    """The same values as a torch tensor (bfloat16 through float32, which holds every bfloat16 exactly)."""
    a = np.asarray(a)
    if a.dtype.name == "bfloat16" or dtype == "bfloat16":
        return torch.from_numpy(a.astype(np.float32).copy()).to(torch.bfloat16)
    t = torch.from_numpy(a.copy())
    return t.to(TORCH_DTYPE[dtype]) if dtype else t


def pair(rng: np.random.Generator, shape, dtype: str = "float32", **kw) -> tuple[dx.Tensor, torch.Tensor]:
    """One random tensor, as deepx and as torch."""
    a = random_array(rng, shape, dtype, **kw)
    return dx.tensor(a), to_torch(a, dtype)


def torch_numpy(t: torch.Tensor) -> np.ndarray:
    t = t.detach()
    if t.dtype == torch.bfloat16:
        return t.float().numpy()
    return t.numpy()


def assert_same(x: dx.Tensor, ref: torch.Tensor, rtol: float | None = None, atol: float | None = None,
                dtype: bool = True) -> None:
    """x has ref's shape, its dtype (unless dtype=False) and its values (within the dtype's tolerance)."""
    assert isinstance(x, dx.Tensor), f"expected a dx.Tensor, got {type(x).__name__}"
    assert x.shape == tuple(ref.shape), f"shape {x.shape} != torch's {tuple(ref.shape)}"
    if dtype:
        assert x.dtype == DX_DTYPE[ref.dtype], f"dtype {x.dtype} != torch's {ref.dtype}"
    got = x.numpy()
    assert got.shape == tuple(ref.shape), f"values of shape {got.shape} for a tensor of shape {x.shape}"
    assert got.dtype == to_numpy(x.dtype), f"values of dtype {got.dtype} for a tensor of dtype {x.dtype}"
    want = torch_numpy(ref)
    if x.dtype in TOL and np.asarray(want).dtype.kind == "f":
        r, a = TOL[x.dtype]
        np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64),
                                   rtol=r if rtol is None else rtol, atol=a if atol is None else atol, equal_nan=True)
    else:
        np.testing.assert_array_equal(got, want)


def cross_entropy_step(model, opt, x, y, tmodel, topt, tx, ty) -> tuple[float, float]:
    """One SGD step of a deepx classifier and of its torch twin on the same batch: both losses, deepx's first."""
    import deepx_sdk.nn.functional as F

    opt.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    topt.zero_grad()
    tloss = torch.nn.functional.cross_entropy(tmodel(tx), ty)
    tloss.backward()
    topt.step()
    return loss.item(), tloss.item()
