"""The Dockerfile's daemon, without Docker (none runs on CI): what it copies exists, each DEEPX_* it sets is a
setting deepxd reads, and its ENTRYPOINT and CMD, run here with its environment (its paths moved under a temporary
directory, its UDP port to a free one), start a deepxd that answers deepxIR over UDP, deepxctl over the socket, and
stops cleanly on SIGTERM (`docker stop`)."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from deepx_sdk.client import NativeClient
from deepxd.config import Config
from tests.daemon.conftest import deepxd_command, free_udp_port, udp_exchange

ROOT = Path(__file__).resolve().parents[2]


def _dockerfile() -> tuple[list[str], dict[str, str], list[str]]:
    """The COPY sources, the ENV settings and ENTRYPOINT + CMD of the Dockerfile."""
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    copies, env, command = [], {}, []
    for line in text.splitlines():
        word, _, rest = line.strip().partition(" ")
        if word == "COPY":
            copies += shlex.split(rest)[:-1]
        elif word == "ENV":
            env.update(dict(item.split("=", 1) for item in shlex.split(rest)))
        elif word in ("ENTRYPOINT", "CMD"):
            command += json.loads(rest)
    return copies, env, command


def test_the_dockerfile_copies_what_exists_and_sets_settings_deepxd_reads() -> None:
    copies, env, command = _dockerfile()
    assert copies and all((ROOT / c).exists() for c in copies), copies
    fields = {f.name for f in dataclasses.fields(Config)}
    for name in env:
        assert name == "DEEPX_ADDRESS" or name.removeprefix("DEEPX_").lower() in fields, name
    assert command == ["deepxd", "start"]


def test_the_dockerfile_s_command_and_environment_run_a_daemon(tmp_path: Path) -> None:
    _, env, command = _dockerfile()
    port = free_udp_port()
    moved = {k: v.replace("/var/lib/deepx", str(tmp_path / "var")).replace("/run/deepx", str(tmp_path / "run"))
             for k, v in env.items()}
    moved["DEEPX_UDP"] = re.sub(r":\d+$", f":{port}", moved["DEEPX_UDP"])
    (tmp_path / "var").mkdir()
    (tmp_path / "run").mkdir()  # the image's `mkdir -p /var/lib/deepx /run/deepx`
    full = {**os.environ, **moved, "DEEPX_NODE_ID": "docker-test", "DEEPX_HEARTBEAT_S": "0.2"}
    log = (tmp_path / "deepxd.log").open("w")
    proc = subprocess.Popen(deepxd_command() + command[1:], env=full, stdout=log, stderr=subprocess.STDOUT)
    try:
        address = moved["DEEPX_ADDRESS"]
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, (tmp_path / "deepxd.log").read_text()
            try:
                NativeClient(address, timeout=2).close()
                break
            except Exception:
                assert time.monotonic() < deadline, (tmp_path / "deepxd.log").read_text()
                time.sleep(0.1)
        (reply,) = udp_exchange(port, "newtensor (vector<int32>:[2 3]) -> (tensor<float32>:dock_t) // id=5", 1)
        assert reply.startswith("5 ok//"), reply
        exe = shutil.which("deepxctl")
        deepxctl = [exe] if exe else [sys.executable, "-m", "deepxctl"]
        ls = subprocess.run([*deepxctl, "tensors", "ls"], env=full, capture_output=True, text=True, timeout=60)
        assert ls.returncode == 0 and "dock_t" in ls.stdout, ls.stdout + ls.stderr
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, (tmp_path / "deepxd.log").read_text()
        log.close()
    assert (tmp_path / "var" / "plane.aof").exists()  # the plane persisted in the volume
