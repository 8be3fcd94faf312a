"""Fixtures for the kernel reference tests; the helpers live in kernel_ref.py."""

from __future__ import annotations

import os
import zlib

import numpy as np
import pytest


@pytest.fixture
def rng(request: pytest.FixtureRequest) -> np.random.Generator:
    """A generator seeded from the test's id: fixed across runs, different between tests.

    DEEPX_TEST_SEED=n mixes n into every seed, to run the same tests on other random inputs.
    """
    extra = int(os.environ.get("DEEPX_TEST_SEED", "0"))
    return np.random.default_rng([zlib.crc32(request.node.nodeid.encode()), extra])
