"""deepxIR over UDP is unauthenticated (issue 21, items 2 and 10): its clients reach only the tensors UDP made and
those shared with it, a non-loopback listener must be asked for, and a flood never starves the native socket."""

from __future__ import annotations

import logging
import socket
import subprocess
import threading
import time

import numpy as np
import pytest

from deepx_core.errors import DeepxError
from deepx_core.ir import parse_text
from tests.daemon.conftest import DEEPXCTL, Daemon, deepxd_command, udp_exchange

log = logging.getLogger(__name__)


def _ok(reply: str) -> bool:
    return reply.split(" ", 1)[1].startswith("ok//")


def test_udp_cannot_read_change_or_delete_a_native_sessions_tensors(daemon: Daemon) -> None:
    with daemon.client() as c:
        c.put("secret", np.arange(4, dtype=np.float32))
        c.put("hsecret", np.full(3, 7, np.float32), heap=True, owner="alice")
        c.put("1", np.array([42, 43], np.float32))  # the existing front end names its tensors 0, 1, 2...
    out = daemon.tmp / "leak"
    attacks = [
        f"save (tensor:secret, var:{out}) -> () // id=1",
        "print (tensor:secret) -> () // id=2",
        "deltensor () -> (tensor:hsecret) // id=3",
        "constant (var<float32>:0) -> (tensor<float32>:hsecret) // id=4",
        "newtensor (vector<int32>:[9]) -> (tensor<int64>:secret) // id=5",
        "add (tensor:secret, tensor:secret) -> (tensor:mine) // id=6",
        "renametensor (var<string>:stolen) -> (tensor:secret) // id=7",
        "copytensor (tensor:hsecret) -> (tensor:mine) // id=8",
        "concat ([secret u], 0) -> (mine) // id=9",
        "concat ([01 u], 0) -> (mine) // id=10",  # bind reads 01 as tensor '1'
        "concat ([+1 u], 0) -> (mine) // id=11",
    ]
    for line in attacks:
        (reply,) = udp_exchange(daemon.udp_port, line, 1)
        assert not _ok(reply) and "not made over UDP and is not shared with UDP clients" in reply, reply
        assert "start_at=0 " in reply  # refused before it ran
    assert not out.with_suffix(".data").exists() and not (daemon.tmp / "leak.data").exists()
    with daemon.client() as c:
        got = c.fetch("secret", "hsecret")
        np.testing.assert_array_equal(got["secret"], np.arange(4, dtype=np.float32))
        np.testing.assert_array_equal(got["hsecret"], np.full(3, 7, np.float32))
        rows = {r["name"]: r for r in c.admin("tensors")}
    assert "mine" not in rows and "stolen" not in rows
    assert rows["hsecret"]["refcount"] == 1 and rows["hsecret"].get("state", "live") == "live"


def test_udp_tensors_work_as_before_and_a_shared_tensor_is_reachable_until_revoked(daemon: Daemon) -> None:
    lines = ["newtensor (vector<int32>:[3]) -> (tensor<float32>:u) // id=1",
             "arange (var<float32>:1, var<float32>:1) -> (tensor<float32>:u) // id=2",
             "mulscalar (tensor:u, var<float32>:2) -> (tensor<float32>:v) // id=3",
             "renametensor (var<string>:w) -> (tensor:v) // id=4"]
    replies = udp_exchange(daemon.udp_port, "\n".join(lines), len(lines))
    assert all(_ok(r) for r in replies), replies
    with daemon.client() as c:
        np.testing.assert_array_equal(c.fetch("w")["w"], np.array([2, 4, 6], np.float32))
        c.put("weights", np.ones(3, np.float32))
    (reply,) = udp_exchange(daemon.udp_port, "add (tensor:w, tensor:weights) -> (tensor:w) // id=5", 1)
    assert not _ok(reply)
    shared = subprocess.run([*DEEPXCTL, "--address", daemon.address, "tensors", "share", "weights"],
                            capture_output=True, text=True)
    assert shared.returncode == 0 and "shared with UDP clients: 'weights'" in shared.stdout, shared.stderr
    (reply,) = udp_exchange(daemon.udp_port, "add (tensor:w, tensor:weights) -> (tensor:w) // id=6", 1)
    assert _ok(reply), reply
    revoked = subprocess.run([*DEEPXCTL, "--address", daemon.address, "tensors", "share", "weights", "--revoke"],
                             capture_output=True, text=True)
    assert revoked.returncode == 0 and "taken back from UDP clients" in revoked.stdout
    (reply,) = udp_exchange(daemon.udp_port, "add (tensor:w, tensor:weights) -> (tensor:w) // id=7", 1)
    assert not _ok(reply)
    with daemon.client() as c:
        np.testing.assert_array_equal(c.fetch("w")["w"], np.array([3, 5, 7], np.float32))
        with pytest.raises(DeepxError, match="no tensor named 'nope'"):
            c.request("udp_share", names=["nope"])
        with pytest.raises(DeepxError, match="'shared' must be true or false"):
            c.request("udp_share", names=["w"], shared="no")
        c.put("w", np.zeros(3, np.float32))  # a native put makes it the native user's: UDP loses it
    (reply,) = udp_exchange(daemon.udp_port, "print (tensor:w) -> () // id=8", 1)
    assert not _ok(reply)


def test_a_udp_listener_off_loopback_must_be_asked_for_and_is_logged(tmp_path) -> None:
    refused = subprocess.run([*deepxd_command(), "config", "--udp", "0.0.0.0:9090"], capture_output=True, text=True)
    assert refused.returncode == 2 and "not a loopback address" in refused.stderr and "--udp-remote 1" in refused.stderr
    for ok in ("127.0.0.1:9090", "[::1]:9090", "localhost:9090"):
        done = subprocess.run([*deepxd_command(), "config", "--udp", ok], capture_output=True, text=True)
        assert done.returncode == 0, (ok, done.stderr)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("0.0.0.0", 0))
        port = s.getsockname()[1]
    d = Daemon(tmp_path, udp=False, extra=["--udp", f"0.0.0.0:{port}", "--udp-remote", "1"]).start()
    try:
        (reply,) = udp_exchange(port, "newtensor (vector<int32>:[2]) -> (tensor<float32>:r) // id=1", 1)
        assert _ok(reply)
    finally:
        assert d.stop() == 0
    assert "which is not a loopback address: it is unauthenticated" in d.output()


def _rss(daemon: Daemon) -> int:
    assert daemon.proc is not None
    with open(f"/proc/{daemon.proc.pid}/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmRSS:"))


def test_a_udp_flood_does_not_starve_native_clients_or_other_senders(daemon: Daemon) -> None:
    rss0 = _rss(daemon)
    flood = b"x\n" * 32_000  # 64 KB of bad lines: 32,000 replies each
    latencies: list[float] = []
    stop = threading.Event()

    def pings() -> None:  # on one connection, and on a new one each time (connect, hello, ping)
        with daemon.client() as c:
            while not stop.is_set():
                t0 = time.perf_counter()
                c.ping()
                with daemon.client() as fresh:
                    fresh.ping()
                latencies.append(time.perf_counter() - t0)
                time.sleep(0.02)

    pinger = threading.Thread(target=pings)
    ports: list[socket.socket] = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as flooder:
        flooder.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 16)  # most replies are dropped here
        pinger.start()
        try:
            for _ in range(10):
                flooder.sendto(flood, ("127.0.0.1", daemon.udp_port))
            ports.extend(socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(40))  # one host, many ports
            for s in ports:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 12)
                for _ in range(4):
                    s.sendto(flood, ("127.0.0.1", daemon.udp_port))
            t0 = time.perf_counter()
            (reply,) = udp_exchange(daemon.udp_port, "newtensor (vector<int32>:[2]) -> (tensor<float32>:f) // id=9", 1)
            other = time.perf_counter() - t0
            time.sleep(1.0)
            rss = _rss(daemon)
        finally:
            stop.set()
            pinger.join()
            for s in ports:
                s.close()
    assert _ok(reply)
    worst = max(latencies)
    log.info("during a 10 x 64 KB UDP flood: worst native ping %.3f s over %d pings; another sender's line %.3f s",
             worst, len(latencies), other)
    assert worst < 2.0 and other < 2.0, (worst, other)  # well under 0.1 s here; slack for a loaded CI machine
    assert rss - rss0 < 200 << 20, (rss0, rss)  # waiting datagrams are capped at 64 MiB in all
    with daemon.client() as c:
        c.ping()


def test_a_name_udp_claimed_first_is_taken_back_when_a_native_program_writes_it(daemon: Daemon) -> None:
    """UDP may make a name nobody uses; a native program that later makes, replaces, writes or deletes that name
    takes it back, so that UDP cannot claim the names a native user will use and read what they put there."""
    lines = ["newtensor (vector<int32>:[3]) -> (tensor<float32>:weights) // id=1",
             "newtensor (vector<int32>:[2]) -> (tensor<float32>:bias) // id=2",
             "newtensor (vector<int32>:[2]) -> (tensor<float32>:mine) // id=3"]
    assert all(_ok(r) for r in udp_exchange(daemon.udp_port, "\n".join(lines), 3))
    with daemon.client() as c:
        same = parse_text("newtensor (vector<int32>:[3]) -> (tensor<float32>:weights)\n"  # kept: same shape
                          "constant (var<float32>:9.25) -> (tensor<float32>:weights)")
        assert c.run(same).ok
        other = parse_text("deltensor () -> (tensor:bias)\n"
                           "newtensor (vector<int32>:[2]) -> (tensor<float32>:bias)\n"
                           "constant (var<float32>:4.5) -> (tensor<float32>:bias)")
        assert c.run(other).ok
    for i, name in enumerate(("weights", "bias")):
        (reply,) = udp_exchange(daemon.udp_port, f"print (tensor:{name}) -> () // id={10 + i}", 1)
        assert not _ok(reply) and "not made over UDP" in reply, reply
    (reply,) = udp_exchange(daemon.udp_port, "print (tensor:mine) -> () // id=12", 1)
    assert _ok(reply)  # UDP's own tensor, which no native program touched, stays UDP's


def test_a_malformed_replay_is_refused_while_udp_holds_tensors(daemon: Daemon) -> None:
    """bench/soak.py found it: with UDP tensors about, a replay whose `outputs` is not a map raised AttributeError
    (an internal error) where the replay's own check answers."""
    (reply,) = udp_exchange(daemon.udp_port, "newtensor (vector<int32>:[2]) -> (tensor<float32>:u1) // id=1", 1)
    assert _ok(reply)
    with daemon.client() as c:
        for outputs in ("x", b"x", 7, ["x"]):
            with pytest.raises(DeepxError) as e:
                c.request("replay", name="nosuchgraph", inputs={}, outputs=outputs)
            assert "internal error" not in str(e.value)
        c.ping()


def test_gradients_a_native_backward_writes_are_taken_back_from_udp(daemon: Daemon) -> None:
    """A backward request writes its gradients under names the client chose: one UDP made first is the native
    client's after it (else UDP would read the gradient)."""
    from deepx_core.ir.wire import instr_to_obj

    (reply,) = udp_exchange(daemon.udp_port, "newtensor (vector<int32>:[3]) -> (tensor<float32>:gw) // id=1", 1)
    assert _ok(reply)
    with daemon.client() as c:
        c.put("bw_w", np.array([1, 2, 3], np.float32))
        forward = parse_text("mul (tensor:bw_w, tensor:bw_w) -> (tensor:bw_y)\n"
                             "sum (tensor:bw_y, vector:[0], var:False) -> (tensor:bw_l)")
        assert c.run(forward).ok
        out = c.request("backward", forward=[instr_to_obj(i) for i in forward], loss="bw_l", wrt=["bw_w"],
                        names={"bw_w": "gw"})
        assert out["grads"] == {"bw_w": "gw"}
        np.testing.assert_array_equal(c.fetch("gw")["gw"], np.array([2, 4, 6], np.float32))
    (reply,) = udp_exchange(daemon.udp_port, "print (tensor:gw) -> () // id=2", 1)
    assert not _ok(reply) and "not made over UDP" in reply, reply
    # a run whose backward instruction is expanded in place, its gradients named by a prefix and a count (the SDK's
    # way): UDP claims those names first; twice, the second on the scheduler's fast path for a repeated step
    claims = [f"newtensor (vector<int32>:[3]) -> (tensor<float32>:bwg_{n}) // id={100 + n}" for n in range(12)]
    assert all(_ok(r) for r in udp_exchange(daemon.udp_port, "\n".join(claims), len(claims)))
    step = parse_text("mul (tensor:bw_w, tensor:bw_w) -> (tensor:bw_y)\n"
                      "sum (tensor:bw_y, vector:[0], var:False) -> (tensor:bw_l)\n"
                      "backward (tensor:bw_l) -> ()")
    spec = {"index": 2, "forward": list(step[:2]), "loss": "bw_l", "wrt": ["bw_w"], "prefix": "bwg_"}
    for _ in range(2):
        with daemon.client() as c:
            assert c.run(step, backwards=[spec]).ok
            rows = [r["name"] for r in c.admin("tensors") if r["name"].startswith("bwg_")]
            grads = [n for n in rows if np.array_equal(c.fetch(n)[n], np.array([2, 4, 6], np.float32))]
        assert grads, rows
        for n in grads:
            (reply,) = udp_exchange(daemon.udp_port, f"print (tensor:{n}) -> () // id=7", 1)
            assert not _ok(reply) and "not made over UDP" in reply, reply
