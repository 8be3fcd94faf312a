"""Round trips answered in the transports' callbacks (docs/decisions/0033-round-trips-and-gelu.md): a UDP line, or a
native `run` frame, that the scheduler runs at once as it ran it before (Scheduler.now_run) is answered as it
arrives, with no task woken and no actor asked. Such an answer must be the one the whole path gives, in its order
among the sender's other requests; whatever needs more (a check of UDP's scope, a program not run before, a
malformed request, a rewritten program that fails part-way) takes the whole path, with its error, and the daemon
serves on.

A node runs in the test's loop with its real sockets; the clients are blocking ones, on a thread."""

from __future__ import annotations

import asyncio
import socket
import struct
import time
from collections.abc import AsyncIterator
from pathlib import Path

import msgpack
import numpy as np
import pytest

from deepx_core.client import NativeClient
from deepx_core.ir.text import parse_text
from deepx_core.ir.wire import instr_to_obj
from deepxd.config import Config
from deepxd.node import Node
from tests.compiler.test_fast_path import REWRITTEN_DIVIDE as REWRITTEN_DIVIDE_TEXT


def free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
async def node(tmp_path: Path) -> AsyncIterator[Node]:
    n = Node(Config(kv="memory", node_id=f"rt-{time.monotonic_ns()}", udp=f"127.0.0.1:{free_udp_port()}",
                    roles=["registry", "heapmem", "scheduler", "op-cpu"], listen=[f"unix://{tmp_path}/d.sock"],
                    io_roots=[str(tmp_path)]))
    await n.start()
    yield n
    await n.shutdown()


def udp_port(node: Node) -> int:
    return int(node.config.udp.rsplit(":", 1)[1])


def udp_lines(port: int, datagrams: list[str], expect: int) -> list[str]:
    """Send each datagram (after the replies of the one before), collect `expect` reply lines in all."""
    out: list[str] = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.settimeout(20)
        s.connect(("127.0.0.1", port))
        for d in datagrams:
            lines = sum(1 for line in d.split("\n") if line.strip())
            s.send(d.encode())
            for _ in range(lines):
                out.append(s.recv(65536).decode())
    assert len(out) == expect
    return out


def status(reply: str) -> tuple[int, str]:
    head = reply.split("//", 1)[0].split()
    return int(head[0]), head[1]


LINE = "addscalar (tensor<float32>:u, var<float32>:0.5) -> (tensor<float32>:u) // author=miaobyte  id={}  created_at={}"


async def test_a_udp_line_sent_again_is_answered_as_it_arrives_with_its_own_id(node: Node) -> None:
    port = udp_port(node)
    setup = ["newtensor (vector<int32>:[3]) -> (tensor<float32>:u) // id=1", "constant (var<float32>:1) -> "
             "(tensor<float32>:u) // id=2"]
    assert [status(r) for r in await asyncio.to_thread(udp_lines, port, setup, 2)] == [(1, "ok"), (2, "ok")]
    sends = [LINE.format(10 + i, time.time()) for i in range(20)]
    replies = await asyncio.to_thread(udp_lines, port, sends, 20)
    assert [status(r) for r in replies] == [(10 + i, "ok") for i in range(20)]
    for r in replies:  # the times, as the whole path writes them
        recv, start, finish = (int(kv.split("=")[1]) for kv in r.split("//", 1)[1].split())
        assert 0 < recv <= start <= finish
    # the line differs from one send to the next only in the sender's metadata: after the scheduler has run it twice,
    # it runs at once
    assert node.udp.answered_now >= 17
    np.testing.assert_array_equal(node.supervisor.actors["op-cpu"].ex.get("u"), np.full(3, 11.0, np.float32))


async def test_metadata_that_changes_what_runs_still_counts_on_the_quick_way(node: Node) -> None:
    port = udp_port(node)
    setup = ["newtensor (vector<int32>:[2]) -> (tensor<float32>:u) // id=1", "constant (var<float32>:0) -> "
             "(tensor<float32>:u) // id=2"]
    await asyncio.to_thread(udp_lines, port, setup, 2)
    repeated = "addscalar (tensor<float32>:u, var<float32>:1) -> (tensor<float32>:u) // id={}  benchmark.repeat=3"
    replies = await asyncio.to_thread(udp_lines, port, [repeated.format(i) for i in range(10)], 10)
    assert all(status(r)[1] == "ok" for r in replies)
    assert node.udp.answered_now >= 7
    np.testing.assert_array_equal(node.supervisor.actors["op-cpu"].ex.get("u"), np.full(2, 30.0, np.float32))


async def test_lines_of_one_datagram_are_answered_in_order_whichever_way_each_goes(node: Node) -> None:
    port = udp_port(node)
    setup = ["newtensor (vector<int32>:[3]) -> (tensor<float32>:u) // id=1",
             "constant (var<float32>:1) -> (tensor<float32>:u) // id=2"]
    await asyncio.to_thread(udp_lines, port, setup, 2)
    await asyncio.to_thread(udp_lines, port, [LINE.format(3 + i, 0) for i in range(4)], 4)  # known from now on
    before = node.udp.answered_now
    # known, new (the scope's check and the ask), known, not deepxIR, not UTF-8, an unknown op, known, an error
    datagram = "\n".join([LINE.format(20, 1), "newtensor (vector<int32>:[2]) -> (tensor<float32>:v) // id=21",
                          LINE.format(22, 1), "add (tensor<float32>:u // id=23", LINE.format(24, 1),
                          "nosuchop (tensor<float32>:u) -> (tensor<float32>:u) // id=25", LINE.format(26, 1),
                          "add (tensor<float32>:u, tensor<float32>:v) -> (tensor<float32>:w) // id=27"])
    data = datagram.encode().replace(b"add (tensor<float32>:u // id=23", b"add (\xff // id=23")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.settimeout(20)
        s.sendto(data, ("127.0.0.1", port))
        replies = [(await asyncio.to_thread(s.recv, 65536)).decode() for _ in range(8)]
    got = [status(r) for r in replies]
    assert [rid for rid, _ in got] == [20, 21, 22, 23, 24, 25, 26, 27]
    assert [s for _, s in got] == ["ok", "ok", "ok", "error", "ok", "error", "ok", "error"]
    assert "not UTF-8" in replies[3] and "nosuchop" in replies[5] and "shape" in replies[7]
    assert node.udp.answered_now > before  # the first line at least, as the datagram arrived
    np.testing.assert_array_equal(node.supervisor.actors["op-cpu"].ex.get("u"), np.full(3, 5.0, np.float32))
    # and the daemon serves on, the quick way too
    replies = await asyncio.to_thread(udp_lines, port, [LINE.format(30 + i, 0) for i in range(3)], 3)
    assert [status(r) for r in replies] == [(30, "ok"), (31, "ok"), (32, "ok")]


async def test_a_name_taken_back_from_udp_is_refused_after_lines_answered_the_quick_way(node: Node) -> None:
    port = udp_port(node)
    setup = ["newtensor (vector<int32>:[3]) -> (tensor<float32>:u) // id=1",
             "constant (var<float32>:1) -> (tensor<float32>:u) // id=2"]
    await asyncio.to_thread(udp_lines, port, setup, 2)
    await asyncio.to_thread(udp_lines, port, [LINE.format(3 + i, 0) for i in range(6)], 6)
    assert node.udp.answered_now >= 3
    run = parse_text("mulscalar (tensor<float32>:u, var<float32>:2) -> (tensor<float32>:u)")

    def native() -> None:
        with NativeClient(node.config.listen[0], timeout=20) as c:
            for _ in range(5):  # the native client writes u: it is no longer UDP's (the quick way too)
                c.run(run).raise_for_error()

    await asyncio.to_thread(native)
    (reply,) = await asyncio.to_thread(udp_lines, port, [LINE.format(40, 0)], 1)
    assert status(reply) == (40, "error") and "was not made over UDP" in reply


# -- the native socket


def frame(obj: dict) -> bytes:
    body = msgpack.packb(obj, use_bin_type=True)
    return struct.pack(">I", len(body)) + body


def read_frames(sock: socket.socket, n: int) -> list[dict]:
    out, buf = [], b""
    while len(out) < n:
        chunk = sock.recv(65536)
        assert chunk, "the daemon closed the connection"
        buf += chunk
        while len(buf) >= 4 and len(buf) >= 4 + struct.unpack_from(">I", buf)[0]:
            k = struct.unpack_from(">I", buf)[0]
            out.append(msgpack.unpackb(buf[4:4 + k], raw=False))
            buf = buf[4 + k:]
    return out


STEP = [instr_to_obj(i) for i in parse_text("""
    add (tensor<float32>:x, tensor<float32>:w) -> (tensor<float32>:t)
    mulscalar (tensor<float32>:t, var<float32>:0.5) -> (tensor<float32>:y)
    addscalar (tensor<float32>:x, var<float32>:1) -> (tensor<float32>:x)
""")]


def connect(node: Node) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(20)
    s.connect(node.config.listen[0].removeprefix("unix://"))
    return s


def put(sock: socket.socket, name: str, a: np.ndarray, rid: int) -> None:
    sock.sendall(frame({"id": rid, "op": "put", "name": name, "dtype": str(a.dtype), "shape": list(a.shape),
                        "data": a.tobytes()}))
    (reply,) = read_frames(sock, 1)
    assert reply["ok"], reply


async def test_a_run_sent_again_is_answered_as_it_arrives_as_the_whole_path_answers(node: Node) -> None:
    sched = node.supervisor.actors["scheduler"]

    def client() -> list[dict]:
        with connect(node) as s:
            put(s, "x", np.arange(4, dtype=np.float32), 1)
            put(s, "w", np.ones(4, np.float32), 2)
            replies = []
            for i in range(8):
                s.sendall(frame({"id": 10 + i, "op": "run", "program": STEP, "fetch": ["y"]}))
                replies += read_frames(s, 1)
            return replies

    replies = await asyncio.to_thread(client)
    assert [r["id"] for r in replies] == list(range(10, 18)) and all(r["ok"] for r in replies)
    assert sched.now_hits >= 5  # after the whole path has seen it three times
    for i, r in enumerate(replies):  # x moves on by one every run
        assert r["done"] == 3 and r["error"] is None and len(r["times"]) == 6 * 8
        y = np.frombuffer(r["tensors"]["y"]["data"], np.float32)
        np.testing.assert_array_equal(y, (np.arange(4, dtype=np.float32) + i + 1) * 0.5)
    assert set(replies[-1]) == set(replies[0])  # the same fields either way


async def test_requests_sent_together_are_answered_in_order(node: Node) -> None:
    def client() -> list[dict]:
        with connect(node) as s:
            put(s, "x", np.zeros(4, np.float32), 1)
            put(s, "w", np.ones(4, np.float32), 2)
            for i in range(5):
                s.sendall(frame({"id": 10 + i, "op": "run", "program": STEP, "fetch": []}))
                read_frames(s, 1)
            # two runs and a ping in one write; a run, then a malformed run and a run at once after it
            s.sendall(frame({"id": 20, "op": "run", "program": STEP, "fetch": ["x"]})
                      + frame({"id": 21, "op": "run", "program": STEP, "fetch": ["x"]})
                      + frame({"id": 22, "op": "ping"}))
            out = read_frames(s, 3)
            s.sendall(frame({"id": 23, "op": "run", "program": STEP, "fetch": ["x"]}))
            s.sendall(frame({"id": 24, "op": "run", "program": STEP, "fetch": "x"}))
            s.sendall(frame({"id": 25, "op": "run", "program": STEP, "fetch": ["x"]}))
            return out + read_frames(s, 3)

    replies = await asyncio.to_thread(client)
    assert [r["id"] for r in replies] == [20, 21, 22, 23, 24, 25]
    assert [r["ok"] for r in replies] == [True, True, True, True, False, True]
    assert "'fetch' must be a list of tensor names" in replies[4]["error"]
    xs = [np.frombuffer(r["tensors"]["x"]["data"], np.float32)[0] for r in replies if r.get("tensors")]
    assert xs == [6.0, 7.0, 8.0, 9.0]  # each run once, in order (five before)


# DIVIDE after work that the passes rewrite (a and b are one sum, both deleted): the fifth run fails part-way on the
# rewritten program, which the scheduler repairs after now_run has handed on a coroutine: the reply must wait for it,
# and a request arriving meanwhile must be answered after it
REWRITTEN_DIVIDE = [instr_to_obj(i) for i in parse_text(REWRITTEN_DIVIDE_TEXT)]  # the fast path tests' own


async def test_a_run_that_fails_part_way_on_the_quick_way_reads_as_on_the_whole_path(node: Node) -> None:
    sched = node.supervisor.actors["scheduler"]

    def client() -> list[dict]:
        with connect(node) as s:
            put(s, "x", np.zeros(2, np.float32), 1)
            put(s, "w", np.ones(2, np.float32), 2)
            put(s, "i", np.array([7, 8], np.int32), 3)
            put(s, "d", np.array([4, 4], np.int32), 4)
            out = []
            for k in range(4):
                s.sendall(frame({"id": 10 + k, "op": "run", "program": REWRITTEN_DIVIDE, "fetch": ["q"]}))
                out += read_frames(s, 1)
            s.sendall(frame({"id": 14, "op": "run", "program": REWRITTEN_DIVIDE, "fetch": ["q"]}))
            deadline = time.monotonic() + 20
            while sched.now_hits < 2 and time.monotonic() < deadline:  # begun as it arrived (alone, so it was)
                time.sleep(0.001)
            s.sendall(frame({"id": 15, "op": "fetch", "names": ["d", "x"]}))  # while it is repaired, or after
            return out + read_frames(s, 2)

    replies = await asyncio.to_thread(client)
    assert [r["id"] for r in replies] == [10, 11, 12, 13, 14, 15]
    assert [r["ok"] for r in replies] == [True] * 4 + [False, True]
    assert "integer division by zero" in replies[4]["error"] and replies[4]["error_index"] == 3
    assert replies[4]["done"] == 3
    assert sched.now_hits == 2 and not sched._busy  # the fourth and the fifth; set straight after the fifth
    t = replies[5]["tensors"]
    np.testing.assert_array_equal(np.frombuffer(t["d"]["data"], np.int32), [0, 0])
    np.testing.assert_array_equal(np.frombuffer(t["x"]["data"], np.float32), [4.0, 4.0])
    # as the whole path leaves them: the program as sent ran up to its division (a and b made, not yet deleted)
    assert sorted(node.supervisor.actors["op-cpu"].ex.tensors) == ["a", "b", "d", "i", "p", "q", "w", "x"]


async def test_a_failure_on_the_quick_way_is_answered_once_and_the_daemon_serves_on(node: Node, monkeypatch) -> None:
    """A run that raises after it began (here the worker's inline run of a prepared plan, made to raise once) is
    answered with its error, not run again the whole way; the next one runs (the failed line left UDP's scope as it
    was)."""
    port = udp_port(node)
    worker = node.supervisor.actors["op-cpu"]
    setup = ["newtensor (vector<int32>:[3]) -> (tensor<float32>:u) // id=1",
             "constant (var<float32>:1) -> (tensor<float32>:u) // id=2"]
    await asyncio.to_thread(udp_lines, port, setup, 2)
    await asyncio.to_thread(udp_lines, port, [LINE.format(3 + i, 0) for i in range(4)], 4)
    calls = []
    run_prepared = worker.run_prepared

    def failing(plan):
        calls.append(plan)
        if len(calls) == 1:
            raise RuntimeError("the kernel's machine caught fire")
        return run_prepared(plan)

    monkeypatch.setattr(worker, "run_prepared", failing)
    replies = await asyncio.to_thread(udp_lines, port, [LINE.format(10, 0), LINE.format(11, 0)], 2)
    assert status(replies[0]) == (10, "error") and "internal error: RuntimeError: the kernel's machine" in replies[0]
    assert status(replies[1]) == (11, "ok") and len(calls) == 2, replies  # each once
    # the native socket the same way
    run = [instr_to_obj(i) for i in parse_text("mulscalar (tensor<float32>:x, var<float32>:1) -> (tensor<float32>:y)")]
    calls.clear()

    def client() -> list[dict]:
        with connect(node) as s:
            put(s, "x", np.ones(3, np.float32), 1)
            out = []
            for k in range(6):
                s.sendall(frame({"id": 20 + k, "op": "run", "program": run, "fetch": []}))
                out += read_frames(s, 1)
            return out

    replies_n = await asyncio.to_thread(client)
    failed = [r for r in replies_n if not r["ok"]]
    assert len(failed) == 1 and "internal error: RuntimeError" in failed[0]["error"]
    assert [r["id"] for r in replies_n] == list(range(20, 26)) and replies_n[-1]["ok"]
    # the failed run reached the worker once; each run after it once more (the quick way is taken again)
    after = replies_n[replies_n.index(failed[0]) + 1:]
    assert len(calls) == 1 + len(after)
