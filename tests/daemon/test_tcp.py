"""The native protocol over TCP (issue 23, items 1 and 2): a client proves it holds the token by answering an HMAC
challenge made for its connection alone, or is refused with one line; a listener off loopback needs a token; TLS
is optional; the SDK and deepxctl work over it as over the Unix socket."""

from __future__ import annotations

import os
import shutil
import socket
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest

import deepx_sdk as dx
from deepx_core.auth import NONCE_BYTES, client_answer, new_nonce, server_answer
from deepx_core.errors import DeepxError
from deepx_core.ir import parse_text
from deepx_sdk.client import NativeClient
from tests.daemon.conftest import DEEPXCTL, DEEPXD, Daemon, eventually

TOKEN = "0123456789abcdef0123456789abcdef"


def token_file(tmp: Path, token: str = TOKEN) -> Path:
    path = tmp / "token"
    path.write_text(token + "\n")
    path.chmod(0o600)
    return path


class TcpDaemon(Daemon):
    tcp = ""  # tcp://127.0.0.1:PORT, once started


def tcp_daemon(tmp: Path, *extra: str, token: bool = True) -> TcpDaemon:
    """A daemon with a TCP listener on a free loopback port (read back from its node record) besides its socket."""
    args = ["--listen", "tcp://127.0.0.1:0", *(["--token-file", str(token_file(tmp))] if token else []), *extra]
    d = TcpDaemon(tmp, udp=False, extra=args)
    d.start()
    with d.client() as c:
        (node,) = [n for n in c.admin("nodes") if n["node"] == d.node_id]
    d.tcp = node["addresses"]["tcp"]
    return d


@pytest.fixture
def tcp(tmp_path):
    d = tcp_daemon(tmp_path)
    yield d
    assert d.stop() == 0, d.output()


def send(sock: socket.socket, obj: dict[str, Any]) -> None:
    body = msgpack.packb(obj, use_bin_type=True)
    sock.sendall(struct.pack(">I", len(body)) + body)


def receive(sock: socket.socket) -> dict[str, Any] | None:
    """One frame, or None where the daemon closed the connection."""
    def exactly(n: int) -> bytes:
        data = b""
        while len(data) < n:
            more = sock.recv(n - len(data))
            if not more:
                raise EOFError
            data += more
        return data

    try:
        (n,) = struct.unpack(">I", exactly(4))
        return msgpack.unpackb(exactly(n), raw=False)  # type: ignore[no-any-return]
    except EOFError:
        return None


def raw_connection(address: str) -> socket.socket:
    host, _, port = address.removeprefix("tcp://").rpartition(":")
    return socket.create_connection((host, int(port)), timeout=10)


def test_a_client_with_the_token_puts_runs_and_fetches_as_over_the_socket(tcp: TcpDaemon) -> None:
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    big = np.random.default_rng(0).standard_normal(1 << 20).astype(np.float32)  # 4 MiB: several TCP reads
    with NativeClient(tcp.tcp, token=TOKEN, timeout=30) as c:
        assert c.server["node"] == tcp.node_id
        c.put("x", x)
        c.put("big", big)
        r = c.run(parse_text("mulscalar (tensor:x, var:2) -> (tensor:y)"), fetch=["y"]).raise_for_error()
        np.testing.assert_array_equal(r.tensors["y"], x * 2)
        np.testing.assert_array_equal(c.fetch("big")["big"], big)
        bad = c.run(parse_text("add (tensor:nope, tensor:x) -> (tensor:z)"))
    with tcp.client() as local:  # the same tensors, and the same error, on the Unix socket
        np.testing.assert_array_equal(local.fetch("y")["y"], x * 2)
        same = local.run(parse_text("add (tensor:nope, tensor:x) -> (tensor:z)"))
    assert not bad.ok and bad.error == same.error and "'nope' not found" in (bad.error or "")


def tiny_training() -> list[np.ndarray]:
    import deepx_sdk.nn as nn
    import deepx_sdk.nn.functional as F
    from deepx_sdk.optim import SGD

    rng = np.random.default_rng(5)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    for p in model.parameters():
        p.data = dx.tensor(rng.standard_normal(p.shape).astype(np.float32) * 0.3)
    opt = SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = dx.tensor(rng.standard_normal((16, 6)).astype(np.float32)), dx.tensor(rng.integers(0, 3, 16))
    losses = []
    for _ in range(8):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(np.array(loss.item()))
    return losses + [p.numpy() for p in model.parameters()]


def test_the_sdk_trains_a_model_over_tcp_as_over_the_socket(tcp: TcpDaemon, monkeypatch) -> None:
    try:
        dx.connect(tcp.tcp, token=TOKEN)
        remote = tiny_training()
        assert remote[-1].shape == (3,) and float(remote[7]) < float(remote[0])  # it learns
        monkeypatch.setenv("DEEPX_ADDRESS", tcp.tcp)  # the address and the token from the environment
        monkeypatch.setenv("DEEPX_TOKEN", TOKEN)
        s = dx.connect()
        assert type(s.transport).__name__ == "NativeTransport" and s.transport.address == tcp.tcp
        again = tiny_training()
        monkeypatch.delenv("DEEPX_TOKEN")
        dx.connect(tcp.address)
        local = tiny_training()
    finally:
        dx.disconnect()
    for a, b, c in zip(remote, again, local):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(a, c)
    with tcp.client() as c:  # each session's tensors went with it (release_on_close over TCP too)
        assert not [t["name"] for t in c.admin("tensors")]
    with pytest.raises(DeepxError, match=r"token= given, but unix://.* is not a tcp://host:port address"):
        dx.connect(tcp.address, token=TOKEN)


def test_a_client_killed_over_tcp_leaves_nothing_behind(tcp: TcpDaemon) -> None:
    """The connection's end releases the session's tensors, as on the Unix socket (release_on_close)."""
    code = (f"import time, numpy as np, deepx_sdk as dx\n"
            f"dx.connect({tcp.tcp!r}, token={TOKEN!r})\n"
            "w = dx.tensor(np.ones((4, 4), np.float32), requires_grad=True)\n"
            "((w * 2).sum()).backward(); w.grad.numpy()\n"
            "print('ready', flush=True); time.sleep(60)\n")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        with tcp.client() as c:
            assert c.admin("tensors")
    finally:
        p.kill()
        p.wait(30)
    with tcp.client() as c:
        eventually(lambda: not c.admin("tensors"), 30, "the killed client's tensors deleted")


def test_no_token_or_a_wrong_one_is_refused_with_one_line(tcp: TcpDaemon) -> None:
    with pytest.raises(DeepxError, match=r"asks for a token and none was given: pass token="):
        NativeClient(tcp.tcp, timeout=10)
    with pytest.raises(DeepxError) as wrong:
        NativeClient(tcp.tcp, token="f" * 32, timeout=10)
    assert str(wrong.value) == (f"deepxd at {tcp.tcp} refused the connection: wrong token: the answer to the "
                                "challenge does not match this daemon's token (or answers another connection's "
                                "challenge)")
    with raw_connection(tcp.tcp) as s:  # a client that skips the challenge: refused before any request is served
        greeting = receive(s)
        assert greeting is not None and greeting["auth"] == "hmac-sha256" and "node" not in greeting
        send(s, {"id": 1, "op": "hello", "version": 1})
        reply = receive(s)
        assert reply == {"id": 1, "ok": False, "error": reply["error"]} and "needs a token" in reply["error"]
        assert receive(s) is None  # and closed
    with raw_connection(tcp.tcp) as s:  # nor may it send a large first frame
        receive(s)
        s.sendall(struct.pack(">I", 1 << 30))
        reply = receive(s)
        assert reply is not None and "at most 4096 bytes" in reply["error"] and receive(s) is None
    with pytest.raises(DeepxError, match=r"cannot reach deepxd at tcp://127\.0\.0\.1:1\b"):
        NativeClient("tcp://127.0.0.1:1", token=TOKEN, timeout=10)
    assert "refused a connection from 127.0.0.1:" in tcp.output()
    assert TOKEN not in tcp.output()


def test_a_replayed_answer_to_the_challenge_is_refused(tcp: TcpDaemon) -> None:
    """An answer seen on the wire is worth nothing on another connection: each gets its own nonce."""
    with raw_connection(tcp.tcp) as s:
        challenge = receive(s)
        assert challenge is not None and len(challenge["nonce"]) == NONCE_BYTES
        answer, mine = client_answer(TOKEN, challenge["nonce"]), new_nonce()
        send(s, {"id": 0, "op": "auth", "answer": answer, "nonce": mine})
        reply = receive(s)
        assert reply is not None and reply["ok"]
        assert reply["answer"] == server_answer(TOKEN, mine, challenge["nonce"])  # the daemon proves it too
        send(s, {"id": 1, "op": "ping"})
        assert receive(s) == {"id": 1, "ok": True}
    with raw_connection(tcp.tcp) as s:
        other = receive(s)
        assert other is not None and other["nonce"] != challenge["nonce"]
        send(s, {"id": 0, "op": "auth", "answer": answer, "nonce": new_nonce()})  # the first connection's answer
        reply = receive(s)
        assert reply is not None and not reply["ok"] and reply["error"].startswith("wrong token")
        assert receive(s) is None


def test_a_client_with_a_token_refuses_a_listener_that_asks_none(tmp_path) -> None:
    """A loopback listener may go without a token (logged); a client holding one will not talk to it, since such a
    listener cannot prove it is the daemon the token is for."""
    d = tcp_daemon(tmp_path, token=False)
    try:
        with NativeClient(d.tcp, timeout=10) as c:
            c.ping()
        with pytest.raises(DeepxError, match="asks no token, so it cannot prove"):
            NativeClient(d.tcp, token=TOKEN, timeout=10)
    finally:
        assert d.stop() == 0
    assert "asks no token: every user of this machine can use this daemon" in d.output()


def test_a_listener_off_loopback_needs_a_token(tmp_path) -> None:
    bare = subprocess.run([*DEEPXD, "start", "--listen", "tcp://0.0.0.0:0", "--listen", f"unix://{tmp_path}/d.sock",
                           "--udp", "off"], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert bare.returncode == 2 and not os.path.exists(tmp_path / "d.sock")
    assert bare.stderr.strip().splitlines() == [
        "deepxd: listen: tcp://0.0.0.0:0 is not a loopback address, and no token is set: anyone who can reach the "
        "port could use this daemon. Give a token (--token-file FILE, DEEPX_TOKEN_FILE or DEEPX_TOKEN; make one with "
        "`openssl rand -hex 32`), or listen on 127.0.0.1 (docs/daemon.md, 'who can do what')"]
    ok = subprocess.run([*DEEPXD, "config", "--listen", "tcp://0.0.0.0:7070", "--token-file",
                         str(token_file(tmp_path))], capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0, ok.stderr
    short = subprocess.run([*DEEPXD, "config", "--listen", "tcp://0.0.0.0:7070"], capture_output=True, text=True,
                           timeout=60, env={**os.environ, "DEEPX_TOKEN": "hunter2"})
    assert short.returncode == 2 and "too few to resist guessing" in short.stderr and "hunter2" not in short.stderr
    loose = token_file(tmp_path)
    loose.chmod(0o644)
    bad = subprocess.run([*DEEPXD, "config", "--listen", "tcp://127.0.0.1:7070", "--token-file", str(loose)],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "can be read by others" in bad.stderr and TOKEN not in bad.stderr


def test_deepxd_config_never_shows_the_token(tmp_path) -> None:
    for how in (["--token-file", str(token_file(tmp_path))], []):
        env = {**os.environ, **({} if how else {"DEEPX_TOKEN": TOKEN})}
        shown = subprocess.run([*DEEPXD, "config", "--listen", "tcp://127.0.0.1:7070", *how], capture_output=True,
                               text=True, env=env, timeout=60)
        assert shown.returncode == 0, shown.stderr
        assert TOKEN not in shown.stdout and 'token = "***"' in shown.stdout
        assert 'listen = ["unix://' in shown.stdout and '"tcp://127.0.0.1:7070"]' in shown.stdout
    d = tcp_daemon(tmp_path)
    try:
        with d.client() as c:
            config = c.admin("config")
        assert config["token"] == "***" and TOKEN not in str(config)
    finally:
        assert d.stop() == 0
    assert TOKEN not in d.output()


def test_deepxctl_over_tcp_with_a_token_file_or_the_environment(tcp: TcpDaemon) -> None:
    with tcp.client() as c:
        c.put("w", np.ones(3, np.float32))
    path = tcp.tmp / "token"
    env = {k: v for k, v in os.environ.items() if not k.startswith("DEEPX_")}
    by_file = subprocess.run([*DEEPXCTL, "--address", tcp.tcp, "--token-file", str(path), "tensors", "ls"],
                             capture_output=True, text=True, env=env, timeout=60)
    assert by_file.returncode == 0, by_file.stderr
    assert "w " in by_file.stdout and f"at {tcp.tcp}" in by_file.stdout + by_file.stderr
    by_env = subprocess.run([*DEEPXCTL, "tensors", "ls"], capture_output=True, text=True, timeout=60,
                            env={**env, "DEEPX_ADDRESS": tcp.tcp, "DEEPX_TOKEN": TOKEN})
    assert by_env.returncode == 0 and "w " in by_env.stdout, by_env.stderr
    none = subprocess.run([*DEEPXCTL, "--address", tcp.tcp, "tensors", "ls"], capture_output=True, text=True,
                          env=env, timeout=60)
    assert none.returncode == 1 and none.stderr.strip().splitlines() == [
        f"Error: deepxd at {tcp.tcp} asks for a token and none was given: pass token= (NativeClient, dx.connect), "
        "or set DEEPX_TOKEN or DEEPX_TOKEN_FILE (deepxctl: --token-file)"]


def self_signed(tmp: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 and its key: made with `cryptography` where installed, else `openssl`."""
    cert, key = tmp / "cert.pem", tmp / "key.pem"
    try:
        import datetime

        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID
    except ImportError:
        if shutil.which("openssl") is None:
            pytest.skip("making a self-signed certificate needs the cryptography package or the openssl command")
        subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                        "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=127.0.0.1",
                        "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True, timeout=60)
        return cert, key
    import ipaddress

    pk = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    c = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(pk.public_key())
         .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
         .not_valid_after(now + datetime.timedelta(days=1))
         .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
         .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
         .sign(pk, hashes.SHA256()))
    cert.write_bytes(c.public_bytes(serialization.Encoding.PEM))
    key.write_bytes(pk.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                     serialization.NoEncryption()))
    key.chmod(0o600)
    return cert, key


def test_tls_with_a_self_signed_certificate(tmp_path) -> None:
    cert, key = self_signed(tmp_path)
    d = tcp_daemon(tmp_path, "--tls-cert", str(cert), "--tls-key", str(key))
    try:
        x = np.arange(5, dtype=np.int32)
        with NativeClient(d.tcp, token=TOKEN, cafile=str(cert), timeout=30) as c:
            c.put("x", x)
            np.testing.assert_array_equal(c.fetch("x")["x"], x)
        with pytest.raises(DeepxError, match="its certificate is not trusted"):
            NativeClient(d.tcp, token=TOKEN, tls=True, timeout=10)  # the system's CAs do not know it
        with pytest.raises(DeepxError, match="sent no greeting within 1 s: a TLS listener"):
            NativeClient(d.tcp, token=TOKEN, timeout=1)  # no TLS asked for
        ctl = subprocess.run([*DEEPXCTL, "--address", d.tcp, "--tls-cafile", str(cert), "tensors", "ls"],
                             capture_output=True, text=True, timeout=60, env={**os.environ, "DEEPX_TOKEN": TOKEN})
        assert ctl.returncode == 0 and "x " in ctl.stdout, ctl.stderr
    finally:
        assert d.stop() == 0, d.output()
    assert "asks for the token, over TLS" in d.output()
