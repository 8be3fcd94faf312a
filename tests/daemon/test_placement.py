"""Programs across nodes (issue 23, item 5; docs/cluster.md, "Programs across nodes"): real deepxd processes on one
real redis-server, a program sent to node b with instructions that run on node a's worker: an op that only an
executor registered on a serves (one host), a small op on a large heap tensor of a's on another host (hosts told
apart by the `host` setting; tests/daemon/test_netns.py does it across a network namespace), and a killed while it
runs b's segment, which fails b's program at once, naming it. The cost model alone: tests/actors/test_placement.py."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from deepx_core.client import NativeClient
from deepx_core.ir import parse_text
from deepx_core.ir.wire import pack_instr
from tests.daemon.conftest import Daemon, eventually
from tests.daemon.test_cluster import Cluster
from tests.daemon.test_executor import Executor
from tests.daemon.test_peers import QUICK, hosts, nodes


@pytest.fixture
def cluster(tmp_path: Path, redis_server: Any) -> Iterator[Cluster]:
    c = Cluster(tmp_path, redis_server.url)
    yield c
    c.stop()


def linked(b: Daemon, a: Daemon) -> None:
    """Until b knows a runs (a link opens when b places an instruction there)."""
    eventually(lambda: nodes(b)[a.node_id]["link"] in ("none", "unix", "tcp", "tls"),
               what=f"{b.node_id} knows {a.node_id}")


def run(c: NativeClient, text: str, fetch: list[str] | None = None) -> Any:
    return c.run(parse_text(text), fetch=fetch or [])


def temporaries(c: NativeClient) -> list[str]:
    """Tensors of other nodes' programs left on this one (`_dx.<node>.<name>`)."""
    return [t["name"] for t in c.admin("tensors") if t["name"].startswith("_dx.")]


def placed(r: Any) -> list[tuple[str, str]]:
    assert r.placement is not None, "the program ran on one node"
    return [(row["node"], row["worker"]) for row in r.placement["instructions"]]


CHAIN = """
    mulscalar (tensor<float32>:x, var<float32>:0.5) -> (tensor<float32>:h)
    cummax (tensor<float32>:h, var<int32>:1) -> (tensor<float32>:m)
    addscalar (tensor<float32>:m, var<float32>:1.0) -> (tensor<float32>:e)
"""


def test_an_op_only_another_node_serves_runs_there(cluster: Cluster, tmp_path: Path) -> None:
    """cummax is served by an executor registered on a, not on b: b's program sends it to a, its input with it, and
    takes its result back; the rest runs where the cost model says, the values as on one node, nothing left on a."""
    a, b = cluster.start(1, QUICK), cluster.start(2, QUICK)
    ca, cb = a.client(), b.client()
    ex = Executor(a.address, tmp_path, check=ca)
    try:
        eventually(lambda: "cummax.signature" in cluster.hash(f"ops:{a.node_id}:numpy-extra"),
                   what="a's registry wrote its executor's ops")
        linked(b, a)
        x = np.random.default_rng(5).normal(size=(3, 4)).astype(np.float32)
        cb.put("x", x)
        want = np.maximum.accumulate(x * np.float32(0.5), axis=1) + 1
        r = run(cb, CHAIN, ["e"])
        assert r.ok, r.error
        np.testing.assert_allclose(r.tensors["e"], want, rtol=1e-6)
        where = placed(r)
        assert where[0] == (b.node_id, "op-cpu") and where[1] == (a.node_id, "numpy-extra"), where
        moved = r.placement["instructions"][1]["moved"]
        assert {(m["tensor"], m["from"], m["to"], m["bytes"]) for m in moved} == {("h", b.node_id, a.node_id, 48)}
        assert r.done == 3 and r.times_us.shape == (3, 2)
        # the plan's explanation says the same before it runs
        shown = cb.request("explain", program=[pack_instr(i) for i in parse_text(CHAIN)], fetch=["e"])["placement"]
        assert [(row["node"], row["worker"]) for row in shown["instructions"]] == where
        assert temporaries(ca) == []  # what b sent and what a made for it went with the segment
        assert {"h", "m", "e"} <= {t["name"] for t in cb.admin("tensors")}  # b's program's tensors are on b
        (listed,) = ca.admin("executors")
        assert {o["op"]: o["calls"] for o in listed["ops"]}["cummax"] == 1
        # again: the same placement, the same values
        again = run(cb, CHAIN, ["e"])
        np.testing.assert_allclose(again.tensors["e"], want, rtol=1e-6)

        # a result of a's read here (print runs where the output goes) and on a again: brought back, and kept on a
        # for the later segment there, then deleted there
        r = run(cb, """
            cummax (tensor<float32>:x, var<int32>:1) -> (tensor<float32>:m)
            print (tensor<float32>:m) -> ()
            cummax (tensor<float32>:m, var<int32>:0) -> (tensor<float32>:m2)
            addscalar (tensor<float32>:m2, var<float32>:1.0) -> (tensor<float32>:e2)
        """, ["e2", "m"])
        assert r.ok, r.error
        m = np.maximum.accumulate(x, axis=1)
        np.testing.assert_allclose(r.tensors["m"], m, rtol=1e-6)
        np.testing.assert_allclose(r.tensors["e2"], np.maximum.accumulate(m, axis=0) + 1, rtol=1e-6)
        where = [n for n, _ in placed(r)]
        assert where[:3] == [a.node_id, b.node_id, a.node_id], where
        assert r.output and "print" not in r.output[0]
        assert temporaries(ca) == []
        # an error on a names the instruction, the node and the program's own tensor names
        bad = run(cb, "cummax (tensor<float32>:x, var<int32>:7) -> (tensor<float32>:m2)")
        assert not bad.ok and bad.error_index == 0 and bad.error.startswith("instruction 1: on node "), bad.error
        assert a.node_id in bad.error and "'x'" in bad.error and "_dx." not in bad.error, bad.error
        assert temporaries(ca) == []
        # an op no node serves: not found, as on one node
        none = run(cb, "nosuchop (tensor<float32>:x) -> (tensor<float32>:y)")
        assert not none.ok and "op 'nosuchop' not found" in none.error, none.error
        # a program of b's own ops runs on b, as on one node (no placement in its reply)
        mine = run(cb, "addscalar (tensor<float32>:x, var<float32>:1.0) -> (tensor<float32>:y)", ["y"])
        assert mine.ok and mine.placement is None
    finally:
        ex.stop()
        ca.close()
        cb.close()
    for d in (b, a):
        assert d.stop() == 0, d.output()


def test_a_small_op_on_a_large_heap_tensor_of_another_host_runs_there(cluster: Cluster, tmp_path: Path) -> None:
    """a's 16 MiB heap tensor, and b on another host: a sum of it goes to a, and only the sum comes back; a chain
    with a temporary leaves nothing on a; c, started with placement local, streams the tensor and sums it itself."""
    a, b = hosts(cluster, tmp_path, "host-a", "host-b")
    (c,) = hosts(cluster, tmp_path, "host-c", first=3, env={"DEEPX_PLACEMENT": "local"})
    w = np.random.default_rng(7).standard_normal((2048, 2048)).astype(np.float32)
    with a.client() as ca, b.client() as cb, c.client() as cc:
        ca.put("w", w, heap=True)
        linked(b, a)
        r = run(cb, "sum (tensor<float32>:w, vector<int32>:[0 1], var<bool>:false) -> (tensor<float32>:s)", ["s"])
        assert r.ok, r.error
        assert r.tensors["s"] == pytest.approx(float(w.sum(dtype=np.float64)), rel=1e-4)
        assert placed(r) == [(a.node_id, "op-cpu")]
        assert r.placement["bytes"] == 4 and r.placement["back"] == [
            {"tensor": "s", "from": a.node_id, "to": b.node_id, "bytes": 4}]
        eventually(lambda: cluster.hash(f"ops:{a.node_id}:op-cpu").get("sum.calls") == "1", what="sum ran on a")

        chain = """
            mulscalar (tensor<float32>:w, var<float32>:2.0) -> (tensor<float32>:t)
            sum (tensor<float32>:t, vector<int32>:[1], var<bool>:false) -> (tensor<float32>:rows)
            deltensor () -> (tensor<float32>:t)
            addscalar (tensor<float32>:rows, var<float32>:1.0) -> (tensor<float32>:o)
        """
        r = run(cb, chain, ["o"])
        assert r.ok, r.error
        np.testing.assert_allclose(r.tensors["o"], (w * 2).sum(axis=1) + 1, rtol=1e-4, atol=1e-3)
        assert [n for n, _ in placed(r)][:3] == [a.node_id] * 3  # t, 16 MiB, never crossed
        assert r.placement["bytes"] <= 2 * 2048 * 4
        assert temporaries(ca) == [] and "t" not in {t["name"] for t in cb.admin("tensors")}
        assert {"rows", "o"} <= {t["name"] for t in cb.admin("tensors")}

        linked(c, a)
        local = run(cc, "sum (tensor<float32>:w, vector<int32>:[0 1], var<bool>:false) -> (tensor<float32>:s)",
                    ["s"])
        assert local.ok and local.placement is None
        eventually(lambda: cluster.hash(f"ops:{c.node_id}:op-cpu").get("sum.calls") == "1", what="sum ran on c")
    for d in (c, b, a):
        assert d.stop() == 0, d.output()


def test_a_node_killed_while_it_runs_a_segment_fails_the_program_at_once(cluster: Cluster, tmp_path: Path) -> None:
    """kill -9 of node a while it runs the middle of b's program (slowcopy, which only a's executor serves, asked
    to sleep 600 s): b answers at once, naming a and the instruction; the instruction before it ran on b; b goes on.
    The peer timeout is a minute: an answer before it is the link's end, not a timeout."""
    patient = {"DEEPX_HEARTBEAT_S": "0.5", "DEEPX_PEER_TIMEOUT_S": "60"}
    a, b = cluster.start(1, patient), cluster.start(2, patient)
    ca, cb = a.client(), b.client()
    ex = Executor(a.address, tmp_path, check=ca)
    result: dict[str, Any] = {}
    try:
        eventually(lambda: "slowcopy.signature" in cluster.hash(f"ops:{a.node_id}:numpy-extra"),
                   what="a's registry wrote its executor's ops")
        linked(b, a)
        cb.put("k", np.arange(6, dtype=np.float32))

        def program() -> None:
            with b.client() as c2:
                result["r"] = run(c2, """
                    addscalar (tensor<float32>:k, var<float32>:1.0) -> (tensor<float32>:k1)
                    slowcopy (tensor<float32>:k1, var<float32>:600) -> (tensor<float32>:k2)
                    addscalar (tensor<float32>:k2, var<float32>:1.0) -> (tensor<float32>:k3)
                """)

        t = threading.Thread(target=program)
        t.start()
        eventually(lambda: (ex.marker / "slow-began").exists(), 30, "a's executor runs slowcopy")
        assert a.proc is not None
        a.proc.send_signal(signal.SIGKILL)
        a.proc.wait()
        t.join(50)
        assert not t.is_alive(), "b waited for a dead node"
        r = result["r"]
        assert not r.ok and r.done == 1 and r.error_index == 1, r.error
        assert r.error.startswith(f"instruction 2: on node {a.node_id}: node {a.node_id} went away while it ran "
                                  "this"), r.error
        assert r.error.endswith("the instructions before it ran, none after"), r.error
        assert placed(r)[1][0] == a.node_id
        # b goes on: its own program, and k1 made by the instruction before
        ok = run(cb, "addscalar (tensor<float32>:k1, var<float32>:1.0) -> (tensor<float32>:k4)", ["k4"])
        assert ok.ok and np.array_equal(ok.tensors["k4"], np.arange(6, dtype=np.float32) + 2)
    finally:
        ex.stop(signal.SIGKILL)
        ca.close()
        cb.close()
    assert b.stop() == 0, b.output()


def test_two_nodes_that_place_on_each_other_at_once_both_finish(cluster: Cluster, tmp_path: Path) -> None:
    """a's program goes to b (b's large tensor) while b's goes to a (a's), each after a part of its own that both
    start at once and that reads the node's own tensor, which the other's segment reads too: each node, waiting for
    its segment on the other, runs the other's segment beside it, so that neither waits for ever."""
    a, b = hosts(cluster, tmp_path, "host-a", "host-b")
    rng = np.random.default_rng(11)
    wa, wb = (rng.standard_normal((2048, 2048)).astype(np.float32) for _ in range(2))
    x = rng.standard_normal((768, 768)).astype(np.float32)
    with a.client() as ca, b.client() as cb:
        ca.put("wa", wa, heap=True)
        cb.put("wb", wb, heap=True)
        for c in (ca, cb):
            c.put("x", x)
        linked(a, b)
        linked(b, a)
    results: dict[str, Any] = {}
    start = threading.Barrier(2)

    def send(d: Daemon, mine: str, w: str) -> None:
        with d.client() as c:
            start.wait()
            results[d.node_id] = run(c, f"""
                matmul (tensor<float32>:x, tensor<float32>:x) -> (tensor<float32>:y)
                sum (tensor<float32>:y, vector<int32>:[0 1], var<bool>:false) -> (tensor<float32>:ys)
                sum (tensor<float32>:{mine}, vector<int32>:[0 1], var<bool>:false) -> (tensor<float32>:own)
                mulscalar (tensor<float32>:{w}, var<float32>:2.0) -> (tensor<float32>:t)
                sum (tensor<float32>:t, vector<int32>:[0 1], var<bool>:false) -> (tensor<float32>:s)
                deltensor () -> (tensor<float32>:t)
            """, ["s", "ys"])

    threads = [threading.Thread(target=send, args=(a, "wa", "wb")), threading.Thread(target=send, args=(b, "wb", "wa"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "the two nodes wait for each other"

    ys = float((x.astype(np.float64) @ x.astype(np.float64)).sum())
    for d, w, other in ((a, wb, b), (b, wa, a)):
        r = results[d.node_id]
        assert r.ok, r.error
        assert [n for n, _ in placed(r)] == [d.node_id] * 3 + [other.node_id] * 3
        assert float(r.tensors["s"]) == pytest.approx(2 * float(w.sum(dtype=np.float64)), rel=1e-3, abs=1e-1)
        assert float(r.tensors["ys"]) == pytest.approx(ys, rel=1e-3, abs=1e-1)
    for d in (b, a):
        assert d.stop() == 0, d.output()


def test_a_client_that_leaves_while_a_peer_runs_its_segment_frees_both_nodes(cluster: Cluster, tmp_path: Path) -> None:
    """b's client hangs up while a's executor runs b's segment (slowcopy, asked to sleep 600 s): b stops waiting and
    hangs up on a, whose run of the segment stops as a run whose client went does; both nodes serve the next
    program at once, and a keeps none of b's temporaries."""
    a, b = cluster.start(1, QUICK), cluster.start(2, QUICK)
    ca, cb = a.client(), b.client()
    ex = Executor(a.address, tmp_path, check=ca)
    try:
        eventually(lambda: "slowcopy.signature" in cluster.hash(f"ops:{a.node_id}:numpy-extra"),
                   what="a's registry wrote its executor's ops")
        linked(b, a)
        cb.put("k", np.arange(6, dtype=np.float32))
        leaving = b.client()
        errors: list[BaseException] = []

        def program() -> None:
            try:
                run(leaving, "slowcopy (tensor<float32>:k, var<float32>:600) -> (tensor<float32>:k2)")
            except BaseException as e:  # (its connection shut under it)
                errors.append(e)

        t = threading.Thread(target=program)
        t.start()
        eventually(lambda: (ex.marker / "slow-began").exists(), 30, "a's executor runs slowcopy")
        leaving.sock.shutdown(2)
        t.join(30)
        assert not t.is_alive() and errors
        ca.put("z", np.ones(3, np.float32))
        r = run(ca, "addscalar (tensor<float32>:z, var<float32>:1.0) -> (tensor<float32>:z1)", ["z1"])
        assert r.ok and r.tensors["z1"].tolist() == [2, 2, 2]  # a's scheduler is not held by the segment
        mine = run(cb, "addscalar (tensor<float32>:k, var<float32>:1.0) -> (tensor<float32>:k1)", ["k1"])
        assert mine.ok and mine.tensors["k1"].tolist() == list(range(1, 7))
        eventually(lambda: temporaries(ca) == [], what="a deleted b's temporaries")
    finally:
        leaving.close()
        ex.stop(signal.SIGKILL)
        ca.close()
        cb.close()
    for d in (b, a):
        assert d.stop() == 0, d.output()


def test_a_heap_tensor_of_b_goes_to_a_on_another_host_by_name(cluster: Cluster, tmp_path: Path) -> None:
    """b's segment on a, on another host, reads b's heap tensor: a streams it from b by name as any program of a's
    does (b's heapmem serves it while b's scheduler waits for the segment); b's stack tensor goes with the request."""
    a, b = hosts(cluster, tmp_path, "host-a", "host-b")
    with a.client() as ca, b.client() as cb:
        ex = Executor(a.address, tmp_path, check=ca)
        try:
            eventually(lambda: "outer.signature" in cluster.hash(f"ops:{a.node_id}:numpy-extra"),
                       what="a's registry wrote its executor's ops")
            linked(b, a)
            v, w = np.arange(3, dtype=np.float64), np.arange(4, dtype=np.float64) + 1
            cb.put("v", v, heap=True)
            cb.put("w", w)
            r = run(cb, "outer (tensor<float64>:v, tensor<float64>:w) -> (tensor<float64>:o)", ["o"])
            assert r.ok, r.error
            np.testing.assert_array_equal(r.tensors["o"], np.outer(v, w))
            (row,) = r.placement["instructions"]
            assert (row["node"], row["worker"]) == (a.node_id, "numpy-extra")
            assert sorted((m["tensor"], m["from"], m["to"], m["bytes"]) for m in row["moved"]) == [
                ("v", b.node_id, a.node_id, 24), ("w", b.node_id, a.node_id, 32)]
            assert temporaries(ca) == []
        finally:
            ex.stop()
    for d in (b, a):
        assert d.stop() == 0, d.output()
