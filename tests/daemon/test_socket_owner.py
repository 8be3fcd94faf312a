"""Runtime-directory squatting (issue 21, item 3): a daemon refuses a socket directory another user could take over,
and a client sends nothing to a socket whose listener runs as another user."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from deepx_core.errors import DeepxError
from deepx_core.paths import check_socket_dir
from deepx_sdk.client import NativeClient
from tests.daemon.conftest import deepxd_command

NOBODY = 65534
SYSTEM_PYTHON = "/usr/bin/python3"  # one a second user can run (this interpreter may sit in root's home)
as_root = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                             reason="needs root and setpriv (util-linux) to act as a second user")
as_another_user = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None
                                     or not os.access(SYSTEM_PYTHON, os.X_OK),
                                     reason=f"needs root, setpriv (util-linux) and {SYSTEM_PYTHON} to run a listener "
                                            "as a second user")


def _start(sock: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*deepxd_command(), "start", "--listen", f"unix://{sock}", "--udp", "off",
                           "--role", "scheduler,op-cpu"], capture_output=True, text=True, timeout=60)


def test_a_daemon_refuses_a_socket_directory_others_can_write(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    done = _start(shared / "deepxd.sock")
    assert done.returncode == 1
    assert "can be written by others (mode 0777)" in done.stderr and "chmod 700" in done.stderr
    assert not (shared / "deepxd.sock").exists()
    shared.chmod(0o1777)  # sticky, as /tmp: nobody may remove or rename another's file there
    check_socket_dir(shared)


@as_root
def test_a_daemon_refuses_a_socket_directory_another_user_owns(tmp_path: Path) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, NOBODY, NOBODY)
    done = _start(theirs / "deepxd.sock")
    assert done.returncode == 1 and f"belongs to uid {NOBODY}" in done.stderr
    link = tmp_path / "link"
    link.symlink_to(theirs)
    with pytest.raises(DeepxError, match=f"the directory it links to belongs to uid {NOBODY}"):
        check_socket_dir(link)


SQUATTER = textwrap.dedent("""
    import socket, sys, time
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(sys.argv[1]); s.listen(1)
    print("listening", flush=True)
    conn, _ = s.accept()
    conn.settimeout(3)
    got = b""
    try:
        while True:
            chunk = conn.recv(65536)
            if not chunk:
                break
            got += chunk
    except OSError:
        pass
    print("got", len(got), flush=True)
""")


def _squatter(sock: Path) -> subprocess.Popen[str]:
    proc = subprocess.Popen(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
                             SYSTEM_PYTHON, "-c", SQUATTER, str(sock)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "listening"
    return proc


@pytest.fixture
def squat() -> Iterator[Path]:
    """A socket path in a directory mode 0777, what a squatter made of the runtime directory (outside pytest's
    private temp tree, which a second user cannot enter)."""
    top = Path(tempfile.mkdtemp(prefix="deepx-squat-"))
    top.chmod(0o755)
    (top / "squat").mkdir()
    (top / "squat").chmod(0o777)
    yield top / "squat" / "deepxd.sock"
    shutil.rmtree(top, ignore_errors=True)


@as_another_user
def test_a_client_sends_nothing_to_a_listener_of_another_user(squat: Path) -> None:
    sock = squat
    proc = _squatter(sock)
    try:
        t0 = time.monotonic()
        with pytest.raises(DeepxError, match=f"runs as uid {NOBODY}, not as you .* nothing was sent"):
            NativeClient(f"unix://{sock}", timeout=5)
        assert time.monotonic() - t0 < 3
        out, _ = proc.communicate(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert out.strip() == "got 0"  # the squatter received no hello, no tensor bytes


@as_another_user
def test_a_client_may_name_the_user_its_daemon_runs_as(squat: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sock = squat
    for how in ("argument", "environment"):
        proc = _squatter(sock)
        try:
            if how == "argument":
                c = NativeClient(f"unix://{sock}", hello=False, peer_uid=NOBODY)
            else:
                monkeypatch.setenv("DEEPX_PEER_UID", str(NOBODY))
                c = NativeClient(f"unix://{sock}", hello=False)
            with c:
                c.send_frame({"id": 1, "op": "ping"})
            out, _ = proc.communicate(timeout=10)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        assert out.strip() != "got 0"
        sock.unlink()


@as_root
def test_an_embedded_session_works_beside_a_squatted_runtime_directory() -> None:
    """A /tmp/deepx-<uid> another user made cannot stop a notebook's embedded session: it takes a fresh private
    directory instead (a daemon's default socket there is refused, and clients refuse its squatter)."""
    tmp_path = Path(tempfile.mkdtemp(prefix="dxsq-"))  # short: a socket path holds at most 107 bytes
    try:
        _embedded_beside_a_squatter(tmp_path)
    finally:
        shutil.rmtree(tmp_path, ignore_errors=True)


def _embedded_beside_a_squatter(tmp_path: Path) -> None:
    squatted = tmp_path / f"deepx-{os.getuid()}"
    squatted.mkdir()
    squatted.chmod(0o777)
    os.chown(squatted, NOBODY, NOBODY)
    env = {k: v for k, v in os.environ.items() if k not in ("XDG_RUNTIME_DIR", "DEEPX_ADDRESS")}
    env["TMPDIR"] = str(tmp_path)
    script = "import deepx_sdk as dx; print(float(dx.tensor([1.0, 2.0]).sum().item()))"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "3.0", done.stderr
    assert "cannot hold a private socket" in done.stderr
    assert list(squatted.iterdir()) == []
