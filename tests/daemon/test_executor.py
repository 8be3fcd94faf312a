"""Executors of other processes (issue 23 item 6, docs/executor.md): a numpy executor in a process of its own
(tests/daemon/numpy_executor.py, built on examples/executor_numpy.py and deepx_sdk.executor) registers with a real
deepxd, which places on it the instructions of the ops it declares, or of an op of the catalogue where a program
names it; results, errors that name the op, the tensors and the executor, an executor killed with SIGKILL in the
middle of a program, registering again, a TCP node with a token, and an executor written against the protocol alone
(no SDK), which answers badly."""

from __future__ import annotations

import json
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgpack
import numpy as np
import pytest

from deepx_core.client import NativeClient
from deepx_core.errors import DeepxError
from deepx_core.ir import parse_text
from tests.daemon.conftest import DEEPXCTL, Daemon, eventually, udp_exchange
from tests.daemon.test_tcp import tcp_daemon, token_file

HELPER = Path(__file__).with_name("numpy_executor.py")


class Executor:
    """tests/daemon/numpy_executor.py in a process of its own, registered with a daemon."""

    def __init__(self, daemon_address: str, tmp: Path, *, name: str = "numpy-extra", wait: bool = True,
                 token: Path | None = None, check: NativeClient | None = None) -> None:
        self.name = name
        self.marker = tmp / f"marker-{name}-{time.monotonic_ns()}"
        self.marker.mkdir()
        self.log = tmp / f"executor-{name}-{time.monotonic_ns()}.log"
        self._logf = open(self.log, "ab")
        args = [sys.executable, str(HELPER), daemon_address, "--name", name, "--marker", str(self.marker),
                *(["--token-file", str(token)] if token else [])]
        self.proc = subprocess.Popen(args, stdout=self._logf, stderr=subprocess.STDOUT)
        if wait:
            assert check is not None
            eventually(lambda: self.proc.poll() is not None or name in names(check), 30,
                       f"executor {name} registers")
            assert self.proc.poll() is None, self.output()

    def output(self) -> str:
        return self.log.read_text()

    def stop(self, sig: int = signal.SIGTERM) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._logf.close()
        return self.proc.returncode


def names(c: NativeClient) -> list[str]:
    return [r["name"] for r in c.admin("executors")]


@pytest.fixture
def served(tmp_path):
    """A daemon and the numpy executor registered with it."""
    d = Daemon(tmp_path, udp=False).start()
    c = d.client()
    ex = Executor(d.address, tmp_path, check=c)
    yield SimpleNamespace(daemon=d, client=c, executor=ex)
    ex.stop()
    c.close()
    assert d.stop() == 0, d.output()


def run(c: NativeClient, text: str, fetch: list[str] | None = None, **kw: Any) -> Any:
    return c.run(parse_text(text), fetch=fetch or [], **kw)


def test_a_program_runs_across_the_node_and_the_executor(served):
    """Local instructions and the executor's in one program: the new ops it declares, an op of the catalogue it
    serves where the program names it; the results are numpy's, the times one pair per instruction."""
    c = served.client
    rng = np.random.default_rng(23)
    x = rng.normal(size=(3, 4)).astype(np.float32)
    v, w = rng.normal(size=5), rng.normal(size=6)
    c.put("x", x)
    c.put("v", v)
    c.put("w", w)
    r = run(c, """
        mulscalar (tensor<float32>:x, var<float32>:0.5) -> (tensor<float32>:a)
        cummax (tensor<float32>:a, var<int32>:1) -> (tensor<float32>:b)
        addscalar (tensor<float32>:b, var<float32>:1.0) -> (tensor<float32>:e)
        mul (tensor<float32>:e, tensor<float32>:e) -> (tensor<float32>:f) // executor=numpy-extra
        outer (tensor<float64>:v, tensor<float64>:w) -> (tensor<float64>:o)
        sum (tensor<float64>:o, vector<int32>:[1], var<bool>:false) -> (tensor<float64>:s)
    """, ["f", "o", "s"])
    assert r.ok, r.error
    assert r.done == 6 and r.times_us.shape == (6, 2)
    want = (np.maximum.accumulate(x * np.float32(0.5), axis=1) + 1) ** 2
    np.testing.assert_allclose(r.tensors["f"], want, rtol=1e-6)
    assert r.tensors["f"].dtype == np.float32
    np.testing.assert_allclose(r.tensors["o"], np.outer(v, w), rtol=1e-12)
    np.testing.assert_allclose(r.tensors["s"], np.outer(v, w).sum(axis=1), rtol=1e-12)
    # what ran where: the executor's counters
    (listed,) = c.admin("executors")
    calls = {o["op"]: o["calls"] for o in listed["ops"]}
    assert calls["cummax"] == 1 and calls["mul"] == 1 and calls["outer"] == 1, listed
    # again: the parts between the executor's instructions run by their plans
    again = run(c, "cummax (tensor<float32>:x, var<int32>:0) -> (tensor<float32>:b)", ["b"])
    np.testing.assert_allclose(again.tensors["b"], np.maximum.accumulate(x, axis=0), rtol=1e-6)


def test_it_is_an_op_worker_of_the_node_for_operators(served):
    """deepxctl: the executor among the node's actors, its ops and costs in `executors ls`, its op counters in
    `ops ls` (from the plane), the ops it declared in the catalogue it serves."""
    d, c, ex = served.daemon, served.client, served.executor
    c.put("q", np.ones(4, np.float32))
    assert run(c, "cummax (tensor<float32>:q, var<int32>:0) -> (tensor<float32>:q2)").ok

    def ctl(*args: str) -> Any:
        out = subprocess.run([*DEEPXCTL, "--address", d.address, *args, "--format", "json"], capture_output=True,
                             text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    (actor,) = [a for a in ctl("actors", "ls") if a["name"] == "numpy-extra"]
    assert actor["role"] == "executor" and actor["state"] == "running" and actor["handled"] == 1
    (row,) = ctl("executors", "ls")
    assert row["name"] == "numpy-extra" and row["pid"] == ex.proc.pid and row["calls"] == 1
    ops = {o["op"]: o for o in row["ops"]}
    assert ops["cummax"]["signature"] == "cummax(T A, V axis) -> (T C)" and ops["cummax"]["cost_us"] == 40
    assert ops["mul"]["declared"] is False and ops["cummax"]["declared"] is True
    eventually(lambda: any(o["worker"] == "numpy-extra" and o["op"] == "cummax" and o["calls"] == 1
                           for o in ctl("ops", "ls")), 30, "the executor's counters in the plane")


def test_an_error_names_the_op_the_tensors_and_the_executor(served):
    """The executor's exception reaches the client as the instruction's error; the instructions before it ran,
    none after; the node and the executor go on serving."""
    c = served.client
    c.put("m", np.ones((2, 3), np.float32))
    r = run(c, """
        addscalar (tensor<float32>:m, var<float32>:1.0) -> (tensor<float32>:m1)
        cummax (tensor<float32>:m1, var<int32>:5) -> (tensor<float32>:m2)
        addscalar (tensor<float32>:m1, var<float32>:1.0) -> (tensor<float32>:m3)
    """)
    assert not r.ok and r.done == 1 and r.error_index == 1
    assert r.error.startswith("instruction 2: cummax: executor 'numpy-extra'"), r.error
    assert "'m1' (float32[2, 3]) -> 'm2'" in r.error and "AxisError" in r.error, r.error
    have = {t["name"] for t in c.admin("tensors")}
    assert "m1" in have and "m2" not in have and "m3" not in have
    # refused whole where the check can tell, before anything runs: a shape that the op's rule refuses
    r = run(c, """
        addscalar (tensor<float32>:m, var<float32>:1.0) -> (tensor<float32>:m4)
        outer (tensor<float32>:m4, tensor<float32>:m4) -> (tensor<float32>:m5)
        cummax (tensor<float32>:m4, var<int32>:0) -> (tensor<float32>:m6)
        mul (tensor<float32>:m4, tensor<float32>:nosuch) -> (tensor<float32>:m7) // executor=numpy-extra
    """)
    assert not r.ok and r.done == 0 and r.error_index == 3, r.error
    assert "instruction 4: mul" in r.error and "'nosuch' not found" in r.error, r.error
    assert "m4" not in {t["name"] for t in c.admin("tensors")}
    # an executor that is not there, or does not serve the op
    r = run(c, "mul (tensor<float32>:m, tensor<float32>:m) -> (tensor<float32>:m8) // executor=nobody")
    assert not r.ok and "no executor 'nobody' is registered" in r.error and "numpy-extra" in r.error, r.error
    r = run(c, "sqrt (tensor<float32>:m) -> (tensor<float32>:m8) // executor=numpy-extra")
    assert not r.ok and "does not serve sqrt" in r.error and "cummax" in r.error, r.error
    ok = run(c, "cummax (tensor<float32>:m, var<int32>:1) -> (tensor<float32>:m9)", ["m9"])
    assert ok.ok, ok.error
    np.testing.assert_array_equal(ok.tensors["m9"], np.ones((2, 3), np.float32))


def test_an_executor_killed_mid_program_fails_it_at_once_and_the_node_goes_on(served, tmp_path):
    """SIGKILL while the executor runs an instruction: the program fails at once with an error naming the executor,
    the node serves the next program, the executor's ops are no longer placed there (its new ops leave the
    catalogue, an op of the catalogue runs on the node again); the executor registers again, under its name."""
    d, c, ex = served.daemon, served.client, served.executor
    c.put("k", np.arange(6, dtype=np.float32))
    result: dict[str, Any] = {}

    def long_program() -> None:
        with d.client() as c2:
            t0 = time.monotonic()
            result["r"] = run(c2, """
                addscalar (tensor<float32>:k, var<float32>:1.0) -> (tensor<float32>:k1)
                slowcopy (tensor<float32>:k1, var<float32>:600) -> (tensor<float32>:k2)
                addscalar (tensor<float32>:k2, var<float32>:1.0) -> (tensor<float32>:k3)
            """)
            result["s"] = time.monotonic() - t0

    t = threading.Thread(target=long_program)
    t.start()
    eventually(lambda: (ex.marker / "slow-began").exists(), 30, "the executor runs slowcopy")
    killed_at = time.monotonic()
    ex.proc.send_signal(signal.SIGKILL)
    t.join(60)
    assert not t.is_alive()
    r = result["r"]
    assert not r.ok and r.done == 1 and r.error_index == 1
    assert r.error.startswith("instruction 2: slowcopy: executor 'numpy-extra' (pid "), r.error
    assert "went away" in r.error, r.error
    assert time.monotonic() - killed_at < 30  # at once: not the 600 s it was asked to sleep
    assert {"k1"} <= {x["name"] for x in c.admin("tensors")}
    assert "numpy-extra" not in names(c)
    assert not any(a["name"] == "numpy-extra" for a in c.admin("actors"))
    gone = run(c, "cummax (tensor<float32>:k, var<int32>:0) -> (tensor<float32>:k4)")
    assert not gone.ok and "op 'cummax' not found" in gone.error and "'numpy-extra'" in gone.error, gone.error
    asked = run(c, "mul (tensor<float32>:k, tensor<float32>:k) -> (tensor<float32>:k5) // executor=numpy-extra")
    assert not asked.ok and "no executor 'numpy-extra'" in asked.error, asked.error
    here = run(c, "mul (tensor<float32>:k, tensor<float32>:k) -> (tensor<float32>:k5)", ["k5"])
    assert here.ok and np.array_equal(here.tensors["k5"], np.arange(6, dtype=np.float32) ** 2)
    # the same name again, from a new process
    again = Executor(d.address, tmp_path, check=c)
    try:
        r = run(c, "cummax (tensor<float32>:k1, var<int32>:0) -> (tensor<float32>:k6)", ["k6"])
        assert r.ok, r.error
        np.testing.assert_allclose(r.tensors["k6"], np.maximum.accumulate(np.arange(6, dtype=np.float32) + 1),
                                   rtol=1e-6)
        (row,) = c.admin("executors")
        assert row["pid"] == again.proc.pid
    finally:
        again.stop()
    ex.stop()


def test_a_name_is_one_executor_at_a_time(served, tmp_path):
    d, c = served.daemon, served.client
    second = Executor(d.address, tmp_path, wait=False)
    assert second.proc.wait(60) != 0
    assert "an executor named 'numpy-extra' is registered already" in second.output(), second.output()
    other = Executor(d.address, tmp_path, name="numpy-two", check=c)
    try:
        assert sorted(names(c)) == ["numpy-extra", "numpy-two"]
        c.put("p", np.arange(1, 5, dtype=np.float64))
        r = run(c, "cummax (tensor<float64>:p, var<int32>:0) -> (tensor<float64>:p1) // executor=numpy-two", ["p1"])
        assert r.ok and np.array_equal(r.tensors["p1"], [1, 2, 3, 4])
        calls = {row["name"]: row["calls"] for row in c.admin("executors")}
        assert calls == {"numpy-extra": 0, "numpy-two": 1}
    finally:
        other.stop()
    # one of two that serve an op went: the other serves it, and the op stays in the catalogue
    eventually(lambda: names(c) == ["numpy-extra"], 30, "numpy-two unregistered")
    assert run(c, "cummax (tensor<float64>:p, var<int32>:0) -> (tensor<float64>:p2)").ok


def test_a_heap_tensor_goes_by_its_segment_on_the_same_host(served):
    """A heap tensor of the node reaches an executor that maps this host's /dev/shm by its segment's name (not
    sent); a stack tensor by its bytes."""
    c = served.client
    (row,) = c.admin("executors")
    assert row["attach"] is True
    c.put("hw", np.arange(12, dtype=np.float32).reshape(3, 4), heap=True)
    c.put("sw", np.arange(12, dtype=np.float32).reshape(3, 4))
    r = run(c, """
        attached (tensor<float32>:sw) -> (tensor<int64>:n0)
        attached (tensor<float32>:hw) -> (tensor<int64>:n1)
        cummax (tensor<float32>:hw, var<int32>:1) -> (tensor<float32>:hc)
    """, ["n0", "n1", "hc"])
    assert r.ok, r.error
    assert int(r.tensors["n0"]) == 0 and int(r.tensors["n1"]) == 1
    np.testing.assert_allclose(r.tensors["hc"],
                               np.maximum.accumulate(np.arange(12, dtype=np.float32).reshape(3, 4), axis=1))


def test_a_backward_and_an_executor_op_in_one_program(served):
    """A training step's backward, expanded by the scheduler, beside an instruction placed on the executor."""
    c = served.client
    w = np.array([1.0, 2.0, 3.0], np.float32)
    c.put("bw", w)
    step = parse_text("mul (tensor:bw, tensor:bw) -> (tensor:by)\n"
                      "sum (tensor:by, vector:[0], var:False) -> (tensor:bl)\n"
                      "backward (tensor:bl) -> ()\n"
                      "cummax (tensor<float32>:gbw, var<int32>:0) -> (tensor<float32>:cg)")
    spec = {"index": 2, "forward": list(step[:2]), "loss": "bl", "wrt": ["bw"], "prefix": "g_",
            "names": {"bw": "gbw"}}
    for _ in range(2):
        r = c.run(step, fetch=["gbw", "cg"], backwards=[spec])
        assert r.ok, r.error
        assert r.done == 4
        np.testing.assert_allclose(r.tensors["gbw"], 2 * w)
        np.testing.assert_allclose(r.tensors["cg"], np.maximum.accumulate(2 * w))


def test_an_executor_on_a_tcp_node_proves_the_token(tmp_path):
    d = tcp_daemon(tmp_path)
    c = d.client()
    try:
        ex = Executor(d.tcp, tmp_path, token=token_file(tmp_path), check=c)
        try:
            (row,) = c.admin("executors")
            assert row["peer"].startswith(f"{d.tcp} from 127.0.0.1:")
            c.put("t", np.arange(1, 4, dtype=np.float32))
            r = run(c, "cummax (tensor<float32>:t, var<int32>:0) -> (tensor<float32>:t1)", ["t1"])
            assert r.ok and np.array_equal(r.tensors["t1"], [1, 2, 3])
        finally:
            ex.stop()
        wrong = tmp_path / "wrong"
        wrong.mkdir()
        bad = Executor(d.tcp, tmp_path, name="wrong-token", token=token_file(wrong, "x" * 32), wait=False)
        assert bad.proc.wait(60) != 0
        assert "wrong token" in bad.output(), bad.output()
        assert names(c) == []
    finally:
        c.close()
        assert d.stop() == 0, d.output()


# ---------------------------------------------------------------- an executor written against the protocol alone


def _send(sock: socket.socket, obj: dict[str, Any]) -> None:
    body = msgpack.packb(obj, use_bin_type=True)
    sock.sendall(struct.pack(">I", len(body)) + body)


def _receive(sock: socket.socket) -> dict[str, Any]:
    def exactly(n: int) -> bytes:
        data = b""
        while len(data) < n:
            more = sock.recv(n - len(data))
            assert more, "the node closed the connection"
            data += more
        return data

    (n,) = struct.unpack(">I", exactly(4))
    return msgpack.unpackb(exactly(n), raw=False)  # type: ignore[no-any-return]


def test_an_executor_written_against_the_protocol_alone(tmp_path):
    """docs/executor.md is enough to write one: a socket, msgpack frames, a hello, a registration; then execute
    requests answered with results. One that answers a result of the wrong shape, or an error, fails the
    instruction with the node's words; one that closes its connection is gone."""
    d = Daemon(tmp_path, udp=False).start()
    c = d.client()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(d.sock)
        _send(sock, {"id": 1, "op": "hello", "version": 1, "client": "raw", "name": "raw", "pid": 1, "host": "h"})
        assert _receive(sock)["ok"]
        _send(sock, {"id": 2, "op": "executor_register", "name": "raw",
                     "ops": [{"name": "twice", "args": ["tensor A"], "returns": ["tensor C"],
                              "results": {"C": "like A"}, "dtypes": ["float32"], "doc": "2 A"}]})
        reg = _receive(sock)
        assert reg["ok"] and reg["ops"] == ["twice"] and reg["node"] == d.node_id, reg
        c.put("r", np.array([1.0, 2.5], np.float32))
        replies: list[Any] = []
        program = "twice (tensor<float32>:r) -> (tensor<float32>:r2)"
        t = threading.Thread(target=lambda: replies.append(run(c, program, ["r2"])))
        t.start()
        req = _receive(sock)
        assert req["op"] == "execute" and req["text"] == program and req["instr"][0] == "twice"
        (arg,) = req["args"]
        assert arg["tensor"] == "r" and arg["dtype"] == "float32" and arg["shape"] == [2]
        assert req["returns"] == [{"tensor": "r2", "dtype": "float32", "shape": [2]}]
        a = np.frombuffer(arg["data"], np.float32)
        _send(sock, {"id": req["id"], "ok": True,
                     "returns": [{"dtype": "float32", "shape": [2], "data": (2 * a).tobytes()}]})
        t.join(30)
        assert replies[0].ok and np.array_equal(replies[0].tensors["r2"], [2.0, 5.0])
        # a result of the wrong shape, then an error
        replies.clear()
        t = threading.Thread(target=lambda: replies.append(run(c, program)))
        t.start()
        req = _receive(sock)
        _send(sock, {"id": req["id"], "ok": True, "returns": [{"dtype": "float32", "shape": [3],
                                                               "data": np.zeros(3, np.float32).tobytes()}]})
        t.join(30)
        assert not replies[0].ok, replies[0]
        assert "executor 'raw' (pid 1) answered float32[3] for 'r2'; the op's rule says float32[2]" in replies[0].error
        replies.clear()
        t = threading.Thread(target=lambda: replies.append(run(c, program)))
        t.start()
        req = _receive(sock)
        _send(sock, {"id": req["id"], "ok": False, "error": "out of ideas"})
        t.join(30)
        assert replies[0].error == ("instruction 1: twice: executor 'raw' (pid 1) failed on 'r' (float32[2]) -> "
                                    "'r2': out of ideas"), replies[0].error
        assert [o["op"] for o in c.admin("executors")[0]["ops"]] == ["twice"]
    finally:
        sock.close()
    eventually(lambda: names(c) == [], 30, "raw unregistered")
    r = run(c, "twice (tensor<float32>:r) -> (tensor<float32>:r3)")
    assert not r.ok and "op 'twice' not found: executor 'raw', which served it, went away" in r.error, r.error
    c.close()
    assert d.stop() == 0, d.output()



def test_a_client_that_leaves_while_the_executor_runs_stops_waiting(served):
    """The node stops waiting for an executor's call once the client that asked for it has gone: its program is
    cancelled, the scheduler is free (the executor is still busy with the call, whose answer is dropped)."""
    d, c, ex = served.daemon, served.client, served.executor
    c.put("z", np.ones(3, np.float32))
    leaving = NativeClient(d.address, timeout=120)
    said: list[str] = []

    def ask() -> None:
        try:
            run(leaving, "slowcopy (tensor<float32>:z, var<float32>:600) -> (tensor<float32>:z2)")
        except DeepxError as e:  # (its connection ended under it)
            said.append(str(e))

    t = threading.Thread(target=ask, daemon=True)
    t.start()
    eventually(lambda: (ex.marker / "slow-began").exists(), 30, "the executor runs slowcopy")
    leaving.sock.shutdown(socket.SHUT_RDWR)  # its connection ends
    t.join(30)
    assert len(said) == 1 and ("closed the connection" in said[0] or "lost the connection" in said[0]), said

    def doing() -> dict[str, str]:
        return {a["name"]: a["doing"] for a in c.admin("actors")}

    eventually(lambda: doing()["scheduler"] == "", 30, "the scheduler stops waiting")
    assert doing()["numpy-extra"] == "slowcopy"
    assert "z2" not in {x["name"] for x in c.admin("tensors")}
    leaving.close()


def test_a_new_op_is_declared_alike_by_every_executor_that_serves_it(served):
    d, c = served.daemon, served.client
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(d.sock)
        _send(sock, {"id": 1, "op": "executor_register", "name": "other",
                     "ops": [{"name": "cummax", "args": ["tensor A"], "returns": ["tensor C"],
                              "results": {"C": "like A"}}]})
        reply = _receive(sock)
        assert not reply["ok"]
        assert "op 'cummax' is declared otherwise by the executors serving it now ('numpy-extra')" in reply["error"]
        _send(sock, {"id": 2, "op": "ping"})  # refused, the connection is a client's still
        assert _receive(sock)["ok"]
    finally:
        sock.close()
    assert names(c) == ["numpy-extra"]


def test_deepxir_over_udp_reaches_an_executor(tmp_path):
    """A UDP sender's line of an executor's op runs there, on tensors UDP made, and gets its one reply."""
    d = Daemon(tmp_path).start()
    c = d.client()
    ex = Executor(d.address, tmp_path, check=c)
    try:
        lines = ["newtensor (vector<int32>:[4]) -> (tensor<float32>:u) // id=1",
                 "arange (var<int32>:1, var<int32>:1) -> (tensor<float32>:u) // id=2",
                 "cummax (tensor<float32>:u, var<int32>:0) -> (tensor<float32>:v) // id=3",
                 "cummax (tensor<float32>:u, var<int32>:3) -> (tensor<float32>:v) // id=4"]
        replies = udp_exchange(d.udp_port, "\n".join(lines), 4)
        assert [r.split("//")[0] for r in replies] == ["1 ok", "2 ok", "3 ok", "4 error"], replies
        assert "cummax: executor 'numpy-extra'" in replies[3] and "AxisError" in replies[3], replies[3]
        assert np.array_equal(c.fetch("v")["v"], [1, 2, 3, 4])
    finally:
        ex.stop()
        c.close()
        assert d.stop() == 0, d.output()
