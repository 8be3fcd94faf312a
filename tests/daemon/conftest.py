"""A real deepxd, started through its console script, for the daemon tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from deepx_sdk.client import NativeClient


def free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: deepxd and deepxctl as this interpreter runs them: the venv's bin need not be on PATH
DEEPXD = [sys.executable, "-m", "deepxd"]
DEEPXCTL = [sys.executable, "-m", "deepxctl"]


def deepxd_command() -> list[str]:
    return list(DEEPXD)


def eventually(check: Callable[[], Any], timeout: float = 60.0, what: str = "") -> Any:
    """check()'s first true value, asked again every 50 ms (at most `timeout` seconds: what a daemon does at its next
    heartbeat, poll or check, which a loaded machine may take seconds to get to)."""
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what or check}")
        time.sleep(0.05)


class Daemon:
    def __init__(self, tmp: Path, *, kv: str = "memory", node_id: str | None = None, env: dict | None = None,
                 extra: list[str] | None = None, udp: bool = True) -> None:
        self.tmp = tmp
        self.sock = str(tmp / "deepxd.sock")
        self.address = f"unix://{self.sock}"
        self.udp_port = free_udp_port() if udp else None
        self.node_id = node_id or f"test-{os.getpid()}-{time.monotonic_ns() % 10**9}"
        self.kv = kv
        self.args = [*deepxd_command(), "start", "--listen", self.address, "--kv", kv, "--node-id", self.node_id,
                     "--udp", f"127.0.0.1:{self.udp_port}" if udp else "off", "--io-root", str(tmp),
                     "--log-level", "info", *(extra or [])]
        # the CPU daemon's roles, also on a machine with a GPU (where op-cuda would join them and hold the tensors):
        # these tests describe op-cpu; tests/gpu starts op-cuda itself
        self.env = {**os.environ, "DEEPX_HEARTBEAT_S": "0.2", "DEEPX_ROLES": "registry,heapmem,scheduler,op-cpu",
                    **(env or {})}
        self.log = tmp / f"deepxd-{self.node_id}.log"
        self.proc: subprocess.Popen | None = None

    def start(self, wait: bool = True) -> Daemon:
        self._logf = open(self.log, "ab")
        self.proc = subprocess.Popen(self.args, stdout=self._logf, stderr=subprocess.STDOUT, env=self.env,
                                     cwd=self.tmp)
        if wait:
            self.wait_ready()
        return self

    def wait_ready(self, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"deepxd exited with {self.proc.returncode}:\n{self.log.read_text()}")
            if os.path.exists(self.sock):
                try:
                    NativeClient(self.address, timeout=2).close()
                    return
                except Exception:
                    pass
            time.sleep(0.05)
        raise RuntimeError(f"deepxd did not come up within {timeout} s:\n{self.log.read_text()}")

    def client(self) -> NativeClient:
        return NativeClient(self.address, timeout=30)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._logf.close()
        return self.proc.returncode

    def output(self) -> str:
        return self.log.read_text()


@pytest.fixture
def daemon(tmp_path):
    d = Daemon(tmp_path).start()
    yield d
    if d.proc is not None and d.proc.poll() is None:
        rc = d.stop()
        assert rc == 0, d.output()


def udp_exchange(port: int, text: str, expect: int, timeout: float = 10.0) -> list[str]:
    """Send one datagram, collect `expect` reply datagrams."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.settimeout(timeout)
        s.sendto(text.encode(), ("127.0.0.1", port))
        return [s.recvfrom(65536)[0].decode() for _ in range(expect)]
