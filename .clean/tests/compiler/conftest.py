"""Fixtures for the compiler tests."""

from __future__ import annotations

import zlib
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest


@pytest.fixture
def rng(request: pytest.FixtureRequest) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture
async def nodes() -> AsyncIterator[list[Any]]:
    """A list a test puts the in-process nodes it starts into (anything with `async stop()`): stopped after it."""
    made: list[Any] = []
    yield made
    for n in made:
        await n.stop()
