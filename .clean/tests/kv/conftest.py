"""Fixtures for the storage plane: `kv`, one connected store per backend (the redis-server fixtures are in
tests/conftest.py)."""

from __future__ import annotations

import socket
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from deepxd.kv.base import KV, open_kv


@pytest.fixture
def unused_port() -> int:
    """A loopback port where nothing listens."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def prefix() -> str:
    """A prefix of its own for each test, so that tests never see each other's keys on the shared server."""
    return f"t{uuid.uuid4().hex[:10]}:"


@pytest.fixture(params=["memory", "file", "redis"])
async def kv(request: pytest.FixtureRequest, tmp_path: Path, prefix: str) -> AsyncIterator[KV]:
    """A connected store, once per backend: in memory, in memory persisted to a file, and on a real Redis."""
    if request.param == "memory":
        url = "memory"
    elif request.param == "file":
        url = f"memory://{tmp_path}/kv.aof"
    else:
        url = request.getfixturevalue("redis_server").url
    store = open_kv(url, prefix=prefix)
    async with store:
        yield store
