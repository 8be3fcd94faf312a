"""A live deepxd (on a real Redis plane, so that tests can also read the plane and play a second process) holding
known tensors and op counters, and a runner for deepxctl commands in this process (click's CliRunner)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner, Result

from deepx_core.identity import this_process
from deepx_core.ir import parse_text
from deepxctl.cli import cli
from tests.daemon.conftest import Daemon

MATMULS = 5  # matmul runs in the fixture (and nowhere else in these tests, so its counters are known)
_ME = this_process()
#: the owner deepxctl shows for what this test process's clients made: its session (deepxd/owners.py)
ME = f"{_ME['name']}[{_ME['pid']}]@{_ME['host']}"


@dataclass
class Live:
    daemon: Daemon
    redis_url: str
    prefix: str

    @property
    def node(self) -> str:
        return self.daemon.node_id

    def ctl(self, *args: str, kv: bool = False) -> Result:
        """`deepxctl --address <this daemon> ARGS` (or `--kv <its plane>` when kv)."""
        target = ["--kv", self.redis_url, "--kv-prefix", self.prefix] if kv else ["--address", self.daemon.address]
        return ctl(*target, *args)


def ctl(*args: str) -> Result:
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def wait_for(predicate: Any, timeout: float = 60.0, what: str = "condition") -> Any:
    """predicate()'s first true value (a heartbeat's flush, a lifecycle command applied: each a moment's work that a
    loaded machine may take seconds to get to)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"{what} did not hold within {timeout} s")


def one_line_error(result: Result, code: int = 1) -> str:
    """The refusal as deepxctl must give it: exit code, one line on stderr, no traceback, nothing on stdout."""
    assert result.exit_code == code, (result.exit_code, result.output)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("Error: ")
    assert "Traceback" not in result.output
    assert result.stdout == ""
    return lines[0]


@pytest.fixture(scope="session")
def live(tmp_path_factory: pytest.TempPathFactory, redis_server: Any) -> Iterator[Live]:
    prefix = f"ctl{uuid.uuid4().hex[:8]}:"
    d = Daemon(tmp_path_factory.mktemp("deepxctl"), kv=redis_server.url, env={"DEEPX_KV_PREFIX": prefix}).start()
    try:
        with d.client() as c:
            c.put("x", np.arange(6, dtype=np.float32).reshape(2, 3))
            c.put("w", np.ones((3, 2), np.float32), heap=True)
            c.put("v", np.array([1, -2, 3, 4], np.int32), heap=True, owner="alice")
            for _ in range(MATMULS):
                c.run(parse_text("matmul (tensor:x, tensor:w) -> (tensor:y)")).raise_for_error()
            wait_for(lambda: any(r["op"] == "matmul" and r["calls"] == MATMULS for r in c.admin("ops")),
                     what="op counters flushed")
        yield Live(d, redis_server.url, prefix)
    finally:
        rc = d.stop()
        assert rc == 0, d.output()
