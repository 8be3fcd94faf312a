"""deepxd as a real subprocess, driven over UDP (deepxIR text) and the native Unix socket."""

from __future__ import annotations

import os
import re
import signal
import socket
import struct
import subprocess
import sys
import textwrap
import threading
import time

import msgpack
import numpy as np
import pytest

from deepx_core.errors import DeepxError
from deepx_core.ir import parse_text
from deepx_sdk.client import NativeClient
from deepxd.shm import list_segments
from tests.daemon.conftest import Daemon, deepxd_command, eventually, udp_exchange


def op_calls(c: NativeClient) -> dict[str, int]:
    """op-cpu's calls per op, as the plane has them (written at a heartbeat), only the ops called."""
    return {o["op"]: o["calls"] for o in c.admin("ops") if o["worker"] == "op-cpu" and o["calls"]}


REPLY_OK = re.compile(r"^(\d+) ok// recv_at=(\d+) start_at=(\d+) finish_at=(\d+)$")
REPLY_ERR = re.compile(r"^(\d+) error// recv_at=(\d+) start_at=(\d+) finish_at=(\d+) (.+)$")

# every op family, as the existing front end sends it: outputs created first with newtensor
UDP_SCRIPT = """
newtensor (vector<int32>:[2 3]) -> (tensor<float32>:a) //  created_at=1744724799.06 id=1
newtensor (vector<int32>:[2 3]) -> (tensor<float32>:b) //  id=2
arange (var<int32>:0, var<int32>:1) -> (tensor<float32>:a) // author=miaobyte id=3
constant (var<float32>:0.5) -> (tensor<float32>:b) // author=miaobyte id=4
newtensor (vector<int32>:[2 3]) -> (tensor<float32>:c) // id=5
add (tensor<float32>:a, tensor<float32>:b) -> (tensor<float32>:c) // author=miaobyte id=6
rpowscalar (var<int32>:2, tensor<float32>:a) -> (tensor<float32>:p) // id=7
newtensor (vector<int32>:[3 2]) -> (tensor<float32>:t) // id=8
transpose (tensor<float32>:a, vector<int32>:[1 0]) -> (tensor<float32>:t) // id=9
matmul (tensor<float32>:a, tensor<float32>:t) -> (tensor<float32>:m) // author=cublas id=10
sum (tensor<float32>:c, vector<int32>:[1], var<bool>:False) -> (tensor<float32>:s) // id=11
reshape (tensor<float32>:c, vector<int32>:[3 2]) -> (tensor<float32>:r) // id=12
concat (listtensor<float32>:[a b], var<int32>:0) -> (tensor<float32>:cat) // id=13
lessscalar (tensor<float32>:a, var<int32>:3) -> (tensor<bool>:lt) // id=14
switch (listtensor<float32>:[b a], tensor<bool>:lt) -> (tensor<float32>:w) // id=15
newtensor (vector<int32>:[2]) -> (tensor<int64>:ix) // id=16
arange (var<int32>:1, var<int32>:-1) -> (tensor<int64>:ix) // id=17
indexselect (tensor<float32>:a, tensor<int64>:ix, var<int32>:0) -> (tensor<float32>:sel) // id=18
todtype (tensor<float32>:a) -> (tensor<int32>:ai) // id=19
exp (tensor<float32>:a) -> (tensor<float32>:e) // id=20
argset (var<float32>:1.5) -> (var<string>:k) // id=21
mulscalar (tensor<float32>:a, var<float32>:k) -> (tensor<float32>:ak) // id=22
save (tensor<float32>:a, var<string>:SAVEDIR/a_float32) -> () // id=23
load (var<string>:SAVEDIR/a_float32) -> () // id=24
print (tensor<float32>:c, var<string>:%.3f) -> () // id=25
"""


def test_every_op_family_over_udp_then_read_back_natively(daemon):
    script = UDP_SCRIPT.replace("SAVEDIR", str(daemon.tmp))
    n = len([ln for ln in script.splitlines() if ln.strip()])
    replies = udp_exchange(daemon.udp_port, script, n)
    ids = []
    for r in replies:
        m = REPLY_OK.match(r)
        assert m, r
        ids.append(int(m.group(1)))
        recv, start, finish = map(int, m.groups()[1:])
        assert recv <= start <= finish and recv > 1.7e12
    assert ids == list(range(1, n + 1))
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    b = np.full((2, 3), 0.5, np.float32)
    with daemon.client() as c:
        got = c.fetch("c", "p", "m", "s", "r", "cat", "lt", "w", "sel", "ai", "e", "ak", "a_float32")
    np.testing.assert_array_equal(got["c"], a + b)
    np.testing.assert_allclose(got["p"], 2.0 ** a)
    np.testing.assert_allclose(got["m"], a @ a.T)
    np.testing.assert_allclose(got["s"], (a + b).sum(1))
    assert got["r"].shape == (3, 2)
    np.testing.assert_array_equal(got["cat"], np.concatenate([a, b]))
    np.testing.assert_array_equal(got["lt"], a < 3)
    np.testing.assert_array_equal(got["w"], np.where(a < 3, a, b))
    np.testing.assert_array_equal(got["sel"], a[[1, 0]])
    assert got["ai"].dtype == np.int32
    np.testing.assert_allclose(got["e"], np.exp(a), rtol=1e-6)
    np.testing.assert_allclose(got["ak"], a * 1.5)
    np.testing.assert_array_equal(got["a_float32"], a)
    assert (daemon.tmp / "a_float32.shape").exists()
    time.sleep(0.2)
    assert "c float32[2, 3]" in daemon.output()


def test_bad_lines_get_clear_errors_and_the_daemon_keeps_serving(daemon):
    lines = [
        "this is not an instruction",
        "foo (tensor<float32>:a) -> (tensor<float32>:b) // id=7",
        "newtensor (vector<int32>:[2 3]) -> (tensor<float32>:x) // id=8",
        "newtensor (vector<int32>:[3 3]) -> (tensor<float32>:y) // id=9",
        "add (tensor<float32>:x, tensor<float32>:y) -> (tensor<float32>:z) // id=10",
        "matmul (tensor<float32>:x, tensor<float32>:x) -> (tensor<float32>:z) // id=11",
        "save (tensor<float32>:x, var<string>:/etc/deepx_x) -> () // id=12",
        "addscalar (tensor<float32>:x, var<float32>:1) -> (tensor<float32>:x) // id=13",
    ]
    replies = udp_exchange(daemon.udp_port, "\n".join(lines), len(lines))
    errs = [REPLY_ERR.match(r) for r in replies]
    assert errs[0] and errs[0].group(1) == "0" and "line 1" in errs[0].group(5)
    assert errs[1] and errs[1].group(1) == "7" and "op 'foo' not found" in errs[1].group(5)
    assert errs[1].group(3) == "0"  # never started
    assert REPLY_OK.match(replies[2]) and REPLY_OK.match(replies[3])
    assert errs[4] and "add: shapes (2, 3) ('x') and (3, 3) ('y') do not broadcast" in errs[4].group(5)
    assert errs[5] and "matmul: shapes (2, 3) ('x') and (2, 3) ('x') do not match (3 != 2)" in errs[5].group(5)
    assert errs[6] and "outside the allowed io roots" in errs[6].group(5)
    assert REPLY_OK.match(replies[7])
    # a datagram that is not UTF-8, and an empty one, do not stop the server
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.settimeout(5)
        s.sendto(b"\xff\xfe\x00 garbage", ("127.0.0.1", daemon.udp_port))
        assert "not UTF-8" in s.recvfrom(65536)[0].decode()
    ok = udp_exchange(daemon.udp_port, "addscalar (tensor<float32>:x, var<float32>:1) -> (tensor<float32>:x) // id=99",
                      1)
    assert REPLY_OK.match(ok[0]) and ok[0].startswith("99 ok")
    with daemon.client() as c:
        np.testing.assert_array_equal(c.fetch("x")["x"], np.full((2, 3), 2, np.float32))


def test_a_64k_datagram_is_accepted(daemon):
    line = "newtensor (vector<int32>:[1]) -> (tensor<float32>:t{i})"
    lines, size, i = [], 0, 0
    while size < 60_000:
        lines.append(line.format(i=i))
        size += len(lines[-1]) + 1
        i += 1
    replies = udp_exchange(daemon.udp_port, "\n".join(lines), len(lines), timeout=30)
    assert all(REPLY_OK.match(r) for r in replies)


def test_programs_over_the_native_socket(daemon):
    with daemon.client() as c:
        assert c.server["version"] == 1 and c.server["node"] == daemon.node_id
        x = np.random.default_rng(0).standard_normal((4, 3)).astype(np.float32)
        c.put("x", x)
        prog = parse_text("""
            newtensor (vector<int32>:[3 2]) -> (tensor<float32>:w)
            normal (var<float32>:0, var<float32>:1, var<int32>:7) -> (tensor<float32>:w)
            matmul (tensor<float32>:x, tensor<float32>:w) -> (tensor<float32>:y)
            relu (tensor<float32>:y) -> (tensor<float32>:h)
            print (tensor<float32>:h, var<string>:%.2f) -> ()
        """)
        r = c.run(prog, fetch=["w", "h"]).raise_for_error()
        assert r.done == 5 and r.times_us.shape == (5, 2) and (np.diff(r.times_us, axis=1) >= 0).all()
        np.testing.assert_allclose(r.tensors["h"], np.maximum(x @ r.tensors["w"], 0), rtol=1e-5)
        assert r.output and r.output[0].startswith("h float32[4, 2]")
        # a bad program changes nothing: instruction 2 is fine, instruction 3 is not
        bad = parse_text("""
            mulscalar (tensor<float32>:x, var<int32>:10) -> (tensor<float32>:x)
            newtensor (vector<int32>:[5]) -> (tensor<float32>:fresh)
            matmul (tensor<float32>:x, tensor<float32>:x) -> (tensor<float32>:z)
        """)
        r = c.run(bad)
        assert not r.ok and r.done == 0 and r.error_index == 2
        assert "instruction 3: matmul: shapes (4, 3) ('x') and (4, 3) ('x') do not match (3 != 4)" in r.error
        np.testing.assert_array_equal(c.fetch("x")["x"], x)
        with pytest.raises(DeepxError, match="tensor 'fresh' not found"):
            c.fetch("fresh")
        # an error at run time stops the program where it happened
        c.put("idx", np.array([0, 9], np.int64))
        r = c.run(parse_text("""
            addscalar (tensor<float32>:x, var<int32>:1) -> (tensor<float32>:x1)
            indexselect (tensor<float32>:x, tensor<int64>:idx, var<int32>:0) -> (tensor<float32>:g)
        """))
        assert not r.ok and r.done == 1 and r.error_index == 1 and "index 9 out of range" in r.error
        # all dtypes travel both ways
        for dt in ("float64", "float16", "bfloat16", "int8", "int64", "bool", "float8e4m3"):
            from deepx_core.ir.dtypes import to_numpy

            v = (np.arange(6) % 3).astype(to_numpy(dt)).reshape(3, 2)
            c.put(f"v_{dt}", v)
            back = c.fetch(f"v_{dt}")[f"v_{dt}"]
            assert back.dtype == v.dtype and back.shape == (3, 2)
            np.testing.assert_array_equal(back.astype(np.float64), v.astype(np.float64))


def _raw(daemon: Daemon) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(daemon.sock)
    return s


def _read_reply(s: socket.socket) -> dict:
    head = b""
    while len(head) < 4:
        chunk = s.recv(4 - len(head))
        assert chunk, "connection closed before a reply"
        head += chunk
    (n,) = struct.unpack(">I", head)
    body = b""
    while len(body) < n:
        body += s.recv(n - len(body))
    return msgpack.unpackb(body, raw=False)


def test_bad_frames_get_errors_and_the_daemon_keeps_serving(tmp_path):
    d = Daemon(tmp_path, env={"DEEPX_MAX_FRAME_BYTES": "65536"}).start()
    try:
        # malformed msgpack: an error, and the same connection keeps working
        s = _raw(d)
        s.sendall(struct.pack(">I", 3) + b"\xc1\xc1\xc1")
        assert "malformed frame" in _read_reply(s)["error"]
        s.sendall(struct.pack(">I", 3) + msgpack.packb("hi"))
        assert "expected a map" in _read_reply(s)["error"]
        body = msgpack.packb({"id": 3, "op": "nosuch"})
        s.sendall(struct.pack(">I", len(body)) + body)
        r = _read_reply(s)
        assert r["id"] == 3 and "unknown request op 'nosuch'" in r["error"]
        body = msgpack.packb({"id": 4, "op": "run", "program": [["add", [["tensor", "", 5]], [], []]]})
        s.sendall(struct.pack(">I", len(body)) + body)
        r = _read_reply(s)
        assert r["id"] == 4 and not r["ok"] and "add" in r["error"]
        s.close()
        # oversized: an error naming the limit, then the connection closes
        s = _raw(d)
        s.sendall(struct.pack(">I", 1 << 20) + b"x" * 100)
        r = _read_reply(s)
        assert "frame of 1048576 bytes exceeds the limit of 65536 bytes" in r["error"]
        assert s.recv(10) == b""
        s.close()
        # truncated: the peer half-closes mid-frame
        s = _raw(d)
        s.sendall(struct.pack(">I", 100) + b"y" * 10)
        s.shutdown(socket.SHUT_WR)
        assert "truncated frame: expected 100 bytes, got 10" in _read_reply(s)["error"]
        s.close()
        # an oversized put through the client is refused the same way
        with d.client() as c:
            with pytest.raises(DeepxError, match="exceeds the limit"):
                c.put("big", np.zeros(100_000, np.float32))
        with d.client() as c:
            c.put("ok", np.ones(3, np.float32))
            assert c.fetch("ok")["ok"].sum() == 3
        assert d.stop() == 0
    finally:
        if d.proc.poll() is None:
            d.stop()


def test_graceful_shutdown_leaves_nothing_behind(tmp_path):
    d = Daemon(tmp_path).start()
    with d.client() as c:
        c.put("w", np.ones((64, 64), np.float32), heap=True)
        c.put("s", np.ones(10, np.float32))
        rows = {t["name"]: t for t in c.admin("tensors")}
        assert rows["w"]["kind"] == "heap" and rows["s"]["kind"] == "stack"
        assert list_segments(f"deepx-{d.node_id}")
    assert d.stop(signal.SIGINT) == 0
    assert not os.path.exists(d.sock)
    assert list_segments(f"deepx-{d.node_id}") == []
    assert "stopped" in d.output()


def test_restart_on_a_persisted_plane_finds_heap_tensor_metadata(tmp_path):
    kv = f"memory://{tmp_path}/plane.aof"
    d = Daemon(tmp_path, kv=kv, node_id="restart-node").start()
    with d.client() as c:
        c.put("weights", np.arange(12, dtype=np.float32).reshape(3, 4), heap=True)
    assert d.stop() == 0
    d2 = Daemon(tmp_path, kv=kv, node_id="restart-node").start()
    try:
        with d2.client() as c:
            rows = {t["name"]: t for t in c.admin("tensors")}
            assert rows["weights"]["kind"] == "heap"
            assert rows["weights"]["shape"] == [3, 4] and rows["weights"]["dtype"] == "float32"
            assert rows["weights"]["state"] == "lost"
            nodes = {n["node"]: n for n in c.admin("nodes")}
            assert nodes["restart-node"]["state"] == "running"
    finally:
        assert d2.stop() == 0


def test_a_second_daemon_of_a_running_node_id_is_refused_and_a_dead_one_s_id_is_taken(tmp_path, redis_server):
    """Two daemons of one node id on one plane overwrote each other's record (the default id is the host name), and
    the one left running was then listed stopped, at the other's address. A second start is refused while the first
    runs; after a kill -9 its record is taken over."""
    kv, node = redis_server.url, f"same-node-{os.getpid()}"
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first = Daemon(tmp_path / "a", kv=kv, node_id=node).start()
    try:
        second = Daemon(tmp_path / "b", kv=kv, node_id=node).start(wait=False)
        assert second.proc.wait(30) != 0
        out = second.output()
        assert f"node id '{node}' is in use by a running deepxd" in out and str(first.proc.pid) in out, out
        with first.client() as c:
            nodes = {n["node"]: n for n in c.admin("nodes")}
            assert nodes[node]["state"] == "running" and int(nodes[node]["pid"]) == first.proc.pid
    finally:
        first.stop(signal.SIGKILL)
    again = Daemon(tmp_path / "b", kv=kv, node_id=node).start()
    try:
        with again.client() as c:
            assert int({n["node"]: n for n in c.admin("nodes")}[node]["pid"]) == again.proc.pid
    finally:
        assert again.stop() == 0


def test_op_counters_after_a_restart_are_the_new_daemon_s(tmp_path):
    """The counters were absolute since-start values written over the last run's only for ops that ran again: after
    a restart on a persisted plane, newtensor showed this run's count and addscalar the last run's."""
    kv = f"memory://{tmp_path}/plane.aof"
    prog = parse_text("newtensor (vector<int32>:[4]) -> (tensor<float32>:q)\n"
                      "addscalar (tensor<float32>:q, var<int32>:1) -> (tensor<float32>:q)")
    d = Daemon(tmp_path, kv=kv, node_id="counting-node").start()
    with d.client() as c:
        for _ in range(3):
            c.run(prog).raise_for_error()
            c.run(parse_text("deltensor () -> (tensor<float32>:q)")).raise_for_error()
        # a heartbeat flushes op counters (a fixed 0.6 s, three heartbeats, took one to have come: a loaded machine
        # need not have); one may come between the runs, so the count is read once it stands at three or more
        eventually(lambda: op_calls(c).get("addscalar", 0) >= 3, what="addscalar's calls")
        assert op_calls(c)["addscalar"] == 3
    assert d.stop() == 0
    d2 = Daemon(tmp_path, kv=kv, node_id="counting-node").start()
    try:
        with d2.client() as c:
            c.run(parse_text("newtensor (vector<int32>:[4]) -> (tensor<float32>:r)")).raise_for_error()
            # until a heartbeat has flushed this run's counters: then the last run's must not stand beside them
            eventually(lambda: "newtensor" in op_calls(c), what="newtensor's call")
            ops = op_calls(c)
            assert ops == {"newtensor": 1}, ops
    finally:
        assert d2.stop() == 0


def test_a_tensor_listing_during_a_long_program_says_so_and_holds_no_other_query(daemon):
    """`deepxctl tensors ls` during a long program waited for its end inside the registry, and every query after it
    (`actors ls`, the command for spotting a backlog) waited behind it: the listing now gives up after
    BUSY_WORKER_S, saying why, and the queries after it are answered."""
    from deepxd.actors.registry import BUSY_WORKER_S
    from deepxd.kernels.cpu import MAX_REPEAT

    def product(repeat: int, out: str = "busy_m") -> str:
        return (f"matmul (tensor<float32>:busy_a, tensor<float32>:busy_a) -> (tensor<float32>:{out}) "
                f"// benchmark.repeat={repeat}")

    with daemon.client() as c:
        c.put("busy_a", np.ones((1024, 1024), np.float32))
        assert c.run(parse_text(product(1))).ok  # (warm)
        timed = []
        for _ in range(3):
            t0 = time.monotonic()
            assert c.run(parse_text(product(10))).ok
            timed.append((time.monotonic() - t0) / 10)
        each = min(timed)
    # long enough to outlast the listing's wait on this machine (a fixed 400 products took 2.2 s on one machine and
    # ended inside the 5 s wait, so the listing was answered after it): three times the wait at the fastest of three
    # timings, so that a machine loaded while it was timed (the other test worker busy: one product took 0.033 s to
    # 0.052 s from one timing to the next) and idle after still runs the program past the wait
    repeat = int(3 * BUSY_WORKER_S / each) + 1
    # in lines of at most MAX_REPEAT products each (one line of more is refused: a machine that makes a product in
    # under 1.5 ms would ask for more), each its own output (no pass drops one as a repeat or as overwritten)
    lines = -(-repeat // MAX_REPEAT)
    program = parse_text("\n".join(product(-(-repeat // lines), f"busy_m{k}") for k in range(lines)))
    done: list = []

    def long_program() -> None:
        # its client waits as long as the program may take on a machine loaded more than while it was timed
        with NativeClient(daemon.address, timeout=110) as c:
            done.append(c.run(program))

    runner = threading.Thread(target=long_program)
    runner.start()
    try:
        with daemon.client() as c:
            # wait until op-cpu is running it (a fixed sleep was too short on a loaded machine: the listing was
            # answered before the program reached the worker); `actors ls` says what each actor is doing
            def running() -> dict[str, str] | None:
                doing = {a["name"]: a["doing"] for a in c.admin("actors")}
                return doing if done or doing["op-cpu"] in ("run", "run_plan") else None

            doing = eventually(running, what="op-cpu running the program")
            assert not done, "the program ended before op-cpu was seen running it"
            assert doing["op-cpu"] in ("run", "run_plan") and doing["registry"] == "actors", doing
            t0 = time.monotonic()
            with pytest.raises(DeepxError, match="op-cpu is running a program and did not list its tensors"):
                c.admin("tensors")
            assert time.monotonic() - t0 < BUSY_WORKER_S + 3
            t1 = time.monotonic()
            actors = {a["name"]: a for a in c.admin("actors")}
            assert time.monotonic() - t1 < 2
            assert actors["op-cpu"]["doing"] in ("run", "run_plan") and actors["op-cpu"]["doing_s"] >= BUSY_WORKER_S
            # what waits for op-cpu meanwhile: one op_stats and the listing, not one op_stats per heartbeat (0.2 s
            # here: the ones that timed out stayed in its mailbox, which looked like a backlog)
            assert actors["op-cpu"]["mailbox"] <= 2, actors["op-cpu"]
    finally:
        runner.join(120)
    assert done and done[0].ok


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM], ids=["kill", "sigterm"])
def test_a_client_killed_mid_run_leaves_nothing_behind(tmp_path, how):
    """A session closes itself at the interpreter's exit and deletes what it made; a client killed (kill -9, OOM) or
    ended by a SIGTERM that skips that exit left its tensors and its compiled graphs' plans until the daemon
    restarted. The daemon now does the same release when the session's connection ends."""
    d = Daemon(tmp_path).start()
    script = tmp_path / "client.py"
    script.write_text(textwrap.dedent(f"""
        import sys, time
        import numpy as np
        import deepx_sdk as dx, deepx_sdk.nn as nn, deepx_sdk.nn.functional as F
        from deepx_sdk.optim import SGD
        dx.connect({d.address!r})
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
        opt = SGD(model.parameters(), lr=0.1, momentum=0.9)

        @dx.compile
        def step(x, y):
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            return loss

        x, y = np.ones((4, 8), np.float32), np.array([0, 1, 2, 0])
        for _ in range(4):
            step(x, y).item()
            F.cross_entropy(model(dx.tensor(x)), dx.tensor(y)).item()
        print("ready", flush=True)
        time.sleep(60)
    """))
    try:
        with d.client() as c:
            before = {t["name"] for t in c.admin("tensors")}
        p = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
        assert p.stdout.readline().strip() == "ready"
        with d.client() as c:
            made = {t["name"] for t in c.admin("tensors")} - before
            assert len(made) > 10  # parameters, optimizer state, the graphs' kept temporaries, the eager loss
        p.send_signal(how)
        p.wait(30)
        deadline = time.monotonic() + 60  # the daemon sees the connection end at once; a loaded machine is slow
        while True:
            with d.client() as c:
                left = {t["name"] for t in c.admin("tensors")} - before
            if not left or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert not left, left
        # logged once the deletes are done: a listing may come between the two
        eventually(lambda: "deleted" in d.output() and "of its tensors" in d.output(), what="the release logged")
    finally:
        assert d.stop() == 0


def test_admin_queries(daemon):
    with daemon.client() as c:
        c.run(parse_text("newtensor (vector<int32>:[8]) -> (tensor<float32>:q)\n"
                         "addscalar (tensor<float32>:q, var<int32>:1) -> (tensor<float32>:q)")).raise_for_error()
        # a heartbeat flushes op counters (a fixed 0.6 s took one to have come: a loaded machine need not have)
        eventually(lambda: "addscalar" in op_calls(c), what="addscalar's call")
        ops = {(o["worker"], o["op"]): o for o in c.admin("ops")}
        assert ops[("op-cpu", "addscalar")]["calls"] >= 1
        actors = {a["name"]: a for a in c.admin("actors")}
        assert set(actors) >= {"registry", "heapmem", "scheduler", "op-cpu"}
        assert all(a["state"] == "running" for a in actors.values())
        nodes = {n["node"]: n for n in c.admin("nodes")}
        assert nodes[daemon.node_id]["heartbeat_age_s"] < 5
        mem = c.admin("memory")
        assert mem["by_kind"]["stack"] >= 32
        assert c.admin("config")["node_id"] == daemon.node_id
        with pytest.raises(DeepxError, match="admin: unknown query 'bogus'"):
            c.admin("bogus")
        c.put("pre?_h", np.ones(2, np.float32), heap=True)  # a glob's `?` in the prefix matches itself only
        c.put("pre?_s", np.ones(2, np.float32))
        c.put("prex_h", np.ones(2, np.float32), heap=True)
        assert [t["name"] for t in c.admin("tensors", prefix="pre?")] == ["pre?_h", "pre?_s"]
        assert {"pre?_h", "prex_h", "q"} <= {t["name"] for t in c.admin("tensors")}
        with pytest.raises(DeepxError, match="admin tensors: prefix must be a string"):
            c.admin("tensors", prefix=3)


def test_start_up_failures_are_one_clear_line(tmp_path, daemon):
    def fails(*args: str, env: dict | None = None) -> str:
        p = subprocess.run([*deepxd_command(), "start", *args], capture_output=True, text=True, timeout=30,
                           env={**os.environ, **(env or {})})
        assert p.returncode != 0
        return p.stderr.strip().splitlines()[-1]

    line = fails("--listen", daemon.address, "--udp", "off")
    assert "is in use by another deepxd" in line
    line = fails("--listen", f"unix://{tmp_path}/x.sock", "--udp", "off", "--kv", "redis://127.0.0.1:1/0")
    assert "cannot reach Redis at redis://127.0.0.1:1/0" in line
    (tmp_path / "bad.toml").write_text("[deepxd]\nno_such_setting = 1\n")
    line = fails("--config", str(tmp_path / "bad.toml"))
    assert "unknown setting 'no_such_setting'" in line
    line = fails("--role", "op-gpu")
    assert "unknown role op-gpu" in line
    line = fails("--listen", f"unix://{tmp_path}/y.sock", "--udp", f"127.0.0.1:{daemon.udp_port}")
    assert f"cannot listen on udp://127.0.0.1:{daemon.udp_port}" in line
    assert not os.path.exists(tmp_path / "y.sock")
    line = fails(env={"DEEPX_HEARTBEAT_S": "soon"})
    assert "DEEPX_HEARTBEAT_S" in line


def test_version_and_config_commands():
    out = subprocess.run([*deepxd_command(), "version"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and out.stdout.startswith("deepxd 0.")
    out = subprocess.run([*deepxd_command(), "config", "--udp", "off"], capture_output=True, text=True, timeout=30,
                         env={**os.environ, "DEEPX_NODE_ID": "from-env"})
    assert out.returncode == 0
    assert 'node_id = "from-env"' in out.stdout and 'udp = "off"' in out.stdout


def test_a_second_signal_forces_exit(tmp_path):
    d = Daemon(tmp_path).start()
    with d.client() as c:
        c.put("w", np.ones(1000, np.float32), heap=True)
    assert d.proc is not None
    d.proc.send_signal(signal.SIGTERM)
    d.proc.send_signal(signal.SIGTERM)
    d.proc.wait(20)
    assert list_segments(f"deepx-{d.node_id}") == []
    d._logf.close()


def test_the_native_client_reports_a_missing_daemon(tmp_path):
    with pytest.raises(DeepxError, match=r"cannot reach deepxd at unix://.*is it running"):
        NativeClient(f"unix://{tmp_path}/none.sock")


def test_restart_on_redis_finds_heap_tensor_metadata(tmp_path, redis_server):
    d = Daemon(tmp_path, kv=redis_server.url, node_id=f"redis-node-{os.getpid()}").start()
    with d.client() as c:
        c.put("emb", np.ones((5, 2), np.float16), heap=True)
    assert d.stop() == 0
    # as many more records as a daemon with 3,000 heap tensors leaves (copies of emb's): the new daemon serves only
    # once its heapmem has gone through them all (it answered while doing so, and listed most still `stopped`)
    import redis

    r = redis.Redis.from_url(redis_server.url)
    record = r.hgetall("deepx:tensor:emb")  # (the plane's keys are prefixed "deepx:")
    assert record[b"state"] == b"stopped"
    with r.pipeline(transaction=False) as p:
        for k in range(3000):
            p.hset(f"deepx:tensor:emb{k}", mapping=record)
        p.execute()
    d2 = None
    try:
        d2 = Daemon(tmp_path, kv=redis_server.url, node_id=d.node_id).start()
        with d2.client() as c:
            rows = {t["name"]: t for t in c.admin("tensors")}
            assert rows["emb"]["kind"] == "heap" and rows["emb"]["dtype"] == "float16"
            assert rows["emb"]["shape"] == [5, 2] and rows["emb"]["state"] == "lost"
            assert rows["emb"]["node"] == d.node_id
            assert sum(row["state"] == "lost" for row in rows.values()) == 3001
    finally:
        r.delete("deepx:tensor:emb", *(f"deepx:tensor:emb{k}" for k in range(3000)))  # (the server is shared)
        assert d2 is None or d2.stop() == 0
