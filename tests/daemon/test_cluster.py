"""Several deepxd nodes on one real redis-server: lifecycle commands reach the node that holds the tensor, a Redis
restarted empty under running daemons gets whole records back (stored graphs too), a put of a name another node
holds, a put of a lost tensor's name, and heap tensors adopted after a crash."""

from __future__ import annotations

import os
import signal
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import redis

from deepx_core.errors import DeepxError
from deepx_core.graphrecord import GraphRecord
from deepx_core.ir import parse_text
from deepx_sdk.client import decode_tensor
from deepxd.shm import list_segments, unlink_segment
from tests.daemon.conftest import Daemon, eventually

NODE_FIELDS = {"addresses", "roles", "pid", "devices", "started", "heartbeat", "state", "blas", "host"}
HEAP_FIELDS = {"dtype", "shape", "node", "device", "bytes", "kind", "owner", "state", "refcount", "holders", "handle",
               "ctime"}


G = "axpb"


def graph_record() -> bytes:
    """A stored graph's bytes: (2 x + 1) * y."""
    program = parse_text(f"""\
mulscalar (tensor<float32>:{G}.in0, var<float32>:2.0) -> (tensor<float32>:{G}.t0)
addscalar (tensor<float32>:{G}.t0, var<float32>:1.0) -> (tensor<float32>:{G}.t1)
deltensor () -> (tensor<float32>:{G}.t0)
mul (tensor<float32>:{G}.t1, tensor<float32>:{G}.in1) -> (tensor<float32>:{G}.out0)
deltensor () -> (tensor<float32>:{G}.t1)""")
    return GraphRecord(G, program, [(f"{G}.in0", "float32", (2, 3)), (f"{G}.in1", "float32", (2, 3))],
                       [(f"{G}.out0", "float32", (2, 3))]).pack()


def encode(a: np.ndarray) -> dict[str, Any]:
    return {"dtype": str(a.dtype), "shape": list(a.shape), "data": a.tobytes()}


def pack(cmd: dict[str, Any]) -> bytes:
    data: bytes = msgpack.packb(cmd)
    return data


class Cluster:
    """Daemons with node ids n1, n2, ... on one Redis under a prefix of their own."""

    def __init__(self, tmp: Path, url: str) -> None:
        self.tmp, self.url = tmp, url
        self.prefix = f"c{uuid.uuid4().hex[:8]}:"
        self.tag = f"cl{os.getpid()}{uuid.uuid4().hex[:4]}"  # node ids (and so segment names) start so
        self.r = redis.Redis.from_url(url, decode_responses=True)
        self.daemons: dict[str, Daemon] = {}

    def start(self, n: int, env: dict[str, str] | None = None, extra: list[str] | None = None) -> Daemon:
        folder = self.tmp / f"n{n}"
        folder.mkdir(exist_ok=True)
        d = Daemon(folder, kv=self.url, node_id=f"{self.tag}n{n}", env={"DEEPX_KV_PREFIX": self.prefix, **(env or {})},
                   udp=False, extra=extra)
        self.daemons[d.node_id] = d
        return d.start()

    def key(self, key: str) -> str:
        return self.prefix + key

    def hash(self, key: str) -> dict[str, str]:
        h: dict[str, str] = self.r.hgetall(self.key(key))  # type: ignore[assignment]
        return h

    def push(self, key: str, *cmds: dict[str, Any]) -> None:
        self.r.rpush(self.key(key), *[pack(c) for c in cmds])

    def stop(self) -> None:
        for d in self.daemons.values():
            if d.proc is not None and d.proc.poll() is None:
                os.kill(d.proc.pid, signal.SIGCONT)
                d.stop()
        for name in list_segments(f"deepx-{self.tag}"):
            unlink_segment(name)
        self.r.close()


@pytest.fixture
def cluster(tmp_path: Path, redis_server: Any) -> Iterator[Cluster]:
    c = Cluster(tmp_path, redis_server.url)
    yield c
    c.stop()


def test_lifecycle_commands_reach_the_node_that_holds_the_tensor(cluster: Cluster) -> None:
    d1, d2 = cluster.start(1), cluster.start(2)
    n1, n2 = d1.node_id, d2.node_id
    with d1.client() as c:
        c.put("h1", np.full((2, 3), 1, np.float32), heap=True, owner="trainer1")
    with d2.client() as c:
        c.put("h2", np.full((2, 3), 2, np.float32), heap=True, owner="trainer2")
    assert d1.proc is not None
    os.kill(d1.proc.pid, signal.SIGSTOP)  # n1 polls nothing: n2 pops every command from the shared list
    try:
        cluster.push("tensor_lifecycle", *[{"cmd": "get", "name": "h1", "holder": f"x{k}"} for k in range(9)],
                     {"cmd": "get", "name": "h2", "holder": "y"},
                     {"cmd": "create", "name": "lc1", "shape": [2], "dtype": "float32", "owner": "ext", "node": n1},
                     {"cmd": "create", "name": "lc2", "shape": [3], "dtype": "int32", "owner": "ext"},
                     {"cmd": "get", "name": "nosuch", "holder": "z"})
        eventually(lambda: cluster.r.llen(cluster.key("tensor_lifecycle")) == 0, what="n2 popped the shared list")
        eventually(lambda: cluster.r.llen(cluster.key(f"tensor_lifecycle:{n1}")) == 10,
                   what=f"n2 forwarded n1's ten commands to tensor_lifecycle:{n1}")
        assert cluster.hash("tensor:h2")["refcount"] == "2"  # n2's own applied at once
        assert cluster.hash("tensor:lc2")["node"] == n2  # no node named: the node that popped it makes it
        assert cluster.hash("tensor:h1")["refcount"] == "1"  # waiting for n1
    finally:
        os.kill(d1.proc.pid, signal.SIGCONT)
    eventually(lambda: cluster.hash("tensor:h1").get("refcount") == "10", what="n1 applied the forwarded gets")
    h1 = cluster.hash("tensor:h1")
    assert h1["holders"] == "trainer1," + ",".join(f"x{k}" for k in range(9)) and h1["node"] == n1
    eventually(lambda: cluster.hash("tensor:lc1").get("node") == n1, what="the create naming n1 made on n1")
    assert cluster.r.llen(cluster.key(f"tensor_lifecycle:{n1}")) == 0

    # a release popped by either node reaches n1; nothing was dropped without a word
    cluster.push("tensor_lifecycle", *[{"cmd": "delete", "name": "h1", "holder": f"x{k}"} for k in range(9)])
    eventually(lambda: cluster.hash("tensor:h1").get("refcount") == "1", what="the releases reached n1")
    eventually(lambda: "'nosuch'" in d2.output(), what="n2 logged the get of a tensor no node holds")
    assert "no node holds a heap tensor by that name" in d2.output()
    assert "has no heap tensor by that name" not in d1.output() + d2.output()


def test_a_put_of_a_name_another_node_holds_says_where_it_is(cluster: Cluster) -> None:
    d1, d2 = cluster.start(1), cluster.start(2)
    with d1.client() as c:
        c.put("shared", np.ones(2, np.float32), heap=True, owner="o1")
    with d2.client() as c, pytest.raises(DeepxError) as caught:
        c.put("shared", np.ones(2, np.float32), heap=True, owner="o2")
    where = f"(a heap tensor on node {d1.node_id})"
    assert f"tensor:shared already exists in the storage plane {where}" in str(caught.value)
    assert "no heap tensor by that name" not in str(caught.value)
    assert cluster.hash("tensor:shared")["holders"] == "o1"


def test_a_redis_restarted_empty_gets_whole_records_back(tmp_path: Path,
                                                         new_redis_server: Callable[[], Any]) -> None:
    server = new_redis_server()
    cluster = Cluster(tmp_path, server.url)
    try:
        d1, d2 = cluster.start(1), cluster.start(2)
        n1 = d1.node_id
        with d1.client() as c:
            c.put("k2", np.arange(4, dtype=np.float32), heap=True)
            c.put("idle", np.zeros(3, np.int32), heap=True, owner="keeper")
            c.request("graph_store", name=G, data=graph_record())
        server.stop()
        server.start()  # the same port, empty: no persistence
        # the attach of a lost record writes it whole, at once
        cluster.push(f"tensor_lifecycle:{n1}", {"cmd": "get", "name": "k2", "holder": "reader"})
        eventually(lambda: cluster.hash("tensor:k2").get("holders") == "op-cpu,reader", what="the get applied")
        assert HEAP_FIELDS <= set(cluster.hash("tensor:k2")), cluster.hash("tensor:k2")
        # the node records and a held tensor nobody touches come back whole from the periodic checks
        for d in (d1, d2):
            eventually(lambda d=d: NODE_FIELDS <= set(cluster.hash(f"node:{d.node_id}")), what="node record")  # type: ignore[misc]
            assert cluster.hash(f"node:{d.node_id}")["state"] == "running"
        eventually(lambda: HEAP_FIELDS <= set(cluster.hash("tensor:idle")), what="the idle tensor's record")
        idle = cluster.hash("tensor:idle")
        assert (idle["node"], idle["kind"], idle["dtype"], idle["shape"], idle["state"]) == (
            n1, "heap", "int32", "[3]", "live")
        eventually(lambda: any(k.endswith(".signature") for k in cluster.hash(f"ops:{n1}:op-cpu")), what="ops")
        with d2.client() as c:
            rows = {t["name"]: t for t in c.admin("tensors")}
            assert (rows["k2"]["kind"], rows["k2"]["dtype"], rows["k2"]["shape"], rows["k2"]["node"]) == (
                "heap", "float32", [4], n1)
            nodes = {r["node"]: r for r in c.admin("nodes")}
            assert nodes[n1]["state"] == "running" and nodes[n1]["roles"] and nodes[n1]["addresses"]
            with pytest.raises(DeepxError, match=f"a heap tensor on node {n1}"):
                c.put("k2", np.ones(4, np.float32), heap=True)
        assert "the storage plane had lost" in d1.output()
        # the graph n1 planned is written back whole, and another node replays it by name from the plane
        eventually(lambda: cluster.r.exists(cluster.key(f"graph:{G}")), what="the stored graph written back")
        assert redis.Redis.from_url(server.url).get(cluster.key(f"graph:{G}")) == graph_record()
        with d2.client() as c:
            a = np.arange(6, dtype=np.float32).reshape(2, 3)
            r = c.request("replay", name=G, inputs={f"{G}.in0": encode(a), f"{G}.in1": encode(a)},
                          outputs={f"{G}.out0": "replayed"}, scalars={}, fetch=["replayed"])
            assert r["ok"], r
            np.testing.assert_array_equal(decode_tensor(r["tensors"]["replayed"]), (a * 2 + 1) * a)
        # said once the write-back is done: n1 logs it after its last write, which the replay above may outrun
        eventually(lambda: "lost 1 stored graphs planned here" in d1.output(), what="n1 said it wrote the graph back")
    finally:
        cluster.stop()


def test_adopted_heap_tensors_are_usable_and_a_put_replaces_a_lost_one(cluster: Cluster) -> None:
    d = cluster.start(2)
    with d.client() as c:
        c.put("k2", np.arange(4, dtype=np.float32), heap=True)
        c.put("kept", np.arange(2, dtype=np.float32), heap=True, owner="trainer")
    assert d.proc is not None
    d.proc.kill()  # kill -9: the segments outlive it
    d.proc.wait()
    d.stop()
    d = cluster.start(2)
    assert "adopted heap tensor 'k2'" in d.output()
    add = parse_text("addscalar (tensor:k2, var:1) -> (tensor:out)\naddscalar (tensor:kept, var:1) -> (tensor:out2)")
    with d.client() as c:
        r = c.run(add, fetch=["out", "out2"]).raise_for_error()
        assert r.tensors["out"].tolist() == [1, 2, 3, 4] and r.tensors["out2"].tolist() == [1, 2]
        assert c.fetch("k2")["k2"].tolist() == [0, 1, 2, 3]
        c.put("k2", np.full(4, 7, np.float32), heap=True)  # written in place: no second holder
        assert cluster.hash("tensor:k2")["holders"] == "op-cpu"
        assert c.fetch("k2")["k2"].tolist() == [7] * 4
        c.request("delete", name="k2", force=False)  # one reference, the worker's: no --force needed
        assert not cluster.r.exists(cluster.key("tensor:k2"))
    assert d.stop() == 0

    # a clean stop unlinks the segments: the next start finds 'kept' lost, and a put of its name replaces it
    d = cluster.start(2)
    with d.client() as c:
        assert {t["name"]: t["state"] for t in c.admin("tensors")}["kept"] == "lost"
        c.put("kept", np.full(3, 5, np.int32), heap=True)
        row = {t["name"]: t for t in c.admin("tensors")}["kept"]
        assert (row["state"], row["dtype"], row["shape"], row["refcount"], row["holders"]) == (
            "live", "int32", [3], 1, "op-cpu")
        r = c.run(parse_text("addscalar (tensor:kept, var:1) -> (tensor:o)"), fetch=["o"]).raise_for_error()
        assert r.tensors["o"].tolist() == [6] * 3
    assert "replaces the lost one" in d.output()
    # the old record's fields went with it; the new one names the session that put it (deepxd/owners.py)
    assert set(cluster.hash("tensor:kept")) == HEAP_FIELDS | {"session", "client", "pid", "host"}


def test_a_program_on_one_node_uses_another_nodes_heap_tensor_on_the_same_host(cluster: Cluster) -> None:
    """Node 2 runs a program that names node 1's heap tensor: mapped from node 1's segment, no copy (a write on
    either node is seen by the other), node 2 a holder of it (so node 1 frees it only after node 2 lets go); a
    tensor of a node killed with -9 fails a program at once, naming the tensor and the node."""
    quick = {"DEEPX_HEARTBEAT_S": "1", "DEEPX_PEER_TIMEOUT_S": "5"}  # (a loaded machine's heartbeats come late)
    d1, d2 = cluster.start(1, quick), cluster.start(2, quick)
    w = np.arange(6, dtype=np.float32).reshape(2, 3)
    with d1.client() as c1, d2.client() as c2:
        c1.put("wshared", w, heap=True)
        c1.put("wother", np.ones(3, np.float32), heap=True)
        np.testing.assert_array_equal(c2.fetch("wshared")["wshared"], w)  # a fetch on node 2 maps it too
        step = parse_text("mulscalar (tensor<float32>:wshared, var<float32>:2.0) -> (tensor<float32>:doubled)")
        r = c2.run(step, fetch=["doubled"]).raise_for_error()
        np.testing.assert_array_equal(r.tensors["doubled"], w * 2)
        eventually(lambda: cluster.hash("tensor:wshared")["holders"] == f"op-cpu,node:{d2.node_id}",
                   what="node 2 a holder of node 1's tensor")
        c1.put("wshared", w + 10, heap=True)  # written in place on node 1: node 2 reads the same bytes
        np.testing.assert_array_equal(c2.run(step, fetch=["doubled"]).raise_for_error().tensors["doubled"],
                                      (w + 10) * 2)
        c2.run(parse_text("addscalar (tensor<float32>:wshared, var<float32>:1.0) -> (tensor<float32>:wshared)"))
        np.testing.assert_array_equal(c1.fetch("wshared")["wshared"], w + 11)  # and node 1 sees node 2's write
        with pytest.raises(DeepxError, match="held by"):  # node 2 holds it: not freed under its mapping
            c1.request("delete", name="wshared", force=False)
        c1.put("wrm", np.ones(2, np.float32), heap=True)  # deepxctl tensors rm on node 2 of node 1's tensor
        assert c2.fetch("wrm")["wrm"].tolist() == [1, 1]
        info = c2.request("delete", name="wrm", force=False)["tensor"]
        assert (info["name"], info["node"]) == ("wrm", d1.node_id)
        assert not cluster.r.exists(cluster.key("tensor:wrm"))
        with pytest.raises(DeepxError, match="wrm"):
            c2.fetch("wrm")
        c1.put("wboth", np.ones(2, np.float32), heap=True)  # and node 2's own stack tensor of that name
        c2.put("wboth", np.zeros(2, np.float32))
        assert c2.request("delete", name="wboth", force=False)["tensor"]["node"] == d2.node_id  # its own goes
        assert cluster.r.exists(cluster.key("tensor:wboth"))
        bad = c2.run(parse_text("add (tensor<float32>:wshared, tensor<float32>:nowhere) -> (tensor<float32>:o)"))
        assert not bad.ok and "nowhere" in bad.error and "not found" in bad.error, bad.error
    assert d2.stop() == 0, d2.output()  # its hold goes with it
    with d1.client() as c1:
        eventually(lambda: cluster.hash("tensor:wshared")["holders"] == "op-cpu", what="node 2's hold given back")
        c1.request("delete", name="wshared", force=False)
    d2 = cluster.start(2, quick)
    assert d1.proc is not None
    d1.proc.kill()  # kill -9: its heartbeat stops
    d1.proc.wait()
    uses = parse_text("addscalar (tensor<float32>:wother, var<float32>:1.0) -> (tensor<float32>:o2)")
    with d2.client() as c2:
        at_once = c2.run(uses)  # before it is found dead: its socket refuses the hold
        assert not at_once.ok and "wother" in at_once.error and d1.node_id in at_once.error, at_once.error
        eventually(lambda: {n["node"]: n["state"] for n in c2.admin("nodes")}[d1.node_id] == "dead", timeout=30,
                   what="node 1 dead")
        dead = c2.run(uses)
        assert "wother" in dead.error and d1.node_id in dead.error and "dead" in dead.error, dead.error
        assert {t["name"]: t["state"] for t in c2.admin("tensors")}["wother"] == "unreachable"
    assert d2.stop() == 0, d2.output()
