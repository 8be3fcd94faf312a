"""Peer links opened on demand (docs/decisions/0047-links-on-demand.md): real deepxd processes on one real
redis-server, each saying it runs on a host of its own (links over TCP with the token). Idle nodes open no links;
a fetch of another node's tensor opens one, one connection, which closes after peer_idle_s unused; a killed node
that no link reaches is found dead from the plane alone; placement reads a node's op statistics again only when
their version in the `nodes` index changed."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from deepx_core.ir import parse_text
from tests.daemon.conftest import Daemon, eventually
from tests.daemon.test_cluster import Cluster
from tests.daemon.test_peers import hosts, killed, nodes

#: a link closed after 3 s unused (heartbeats of 0.5 s, and a node dead after 4 s of silence: test_peers.QUICK)
IDLE = {"DEEPX_PEER_IDLE_S": "3"}


@pytest.fixture
def cluster(tmp_path: Path, redis_server: Any) -> Iterator[Cluster]:
    c = Cluster(tmp_path, redis_server.url)
    yield c
    c.stop()


def tcp_port(cluster: Cluster, d: Daemon) -> int:
    import json

    return int(json.loads(cluster.hash(f"node:{d.node_id}")["addresses"])["tcp"].rsplit(":", 1)[1])


def connections(d: Daemon, port: int) -> int:
    """Established TCP connections of `d`'s process to local port `port` (its sockets in /proc/<pid>/fd, found in
    /proc/<pid>/net/tcp)."""
    assert d.proc is not None
    pid = d.proc.pid
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    n = 0
    for table in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if cols[3] == "01" and int(cols[2].rsplit(":", 1)[1], 16) == port and cols[9] in inodes:
                n += 1
    return n


def links(d: Daemon) -> dict[str, str]:
    """The LINK of each other node as `d` sees it."""
    return {n: row.get("link", "") for n, row in nodes(d).items() if n != d.node_id}


def test_idle_nodes_open_no_links_and_a_fetch_opens_one_that_closes_when_idle(cluster: Cluster,
                                                                              tmp_path: Path) -> None:
    ds = hosts(cluster, tmp_path, "host-a", "host-b", "host-c", env=IDLE)
    d1, d2, d3 = ds
    ports = {d.node_id: tcp_port(cluster, d) for d in ds}
    for d in ds:
        eventually(lambda d=d: set(links(d).values()) == {"none"}, what=f"{d.node_id} knows the others")  # type: ignore[misc]
    time.sleep(2.0)  # four heartbeats: nothing opens a link by itself
    for d in ds:
        assert set(links(d).values()) == {"none"}, links(d)
        assert all(connections(d, p) == 0 for n, p in ports.items() if n != d.node_id)

    w = np.arange(50_000, dtype=np.float32)
    with d1.client() as c1, d2.client() as c2:
        c1.put("w", w, heap=True)
        np.testing.assert_array_equal(c2.fetch("w")["w"], w)
        assert links(d2) == {d1.node_id: "tcp", d3.node_id: "none"}
        time.sleep(1.2)  # two pings over it: the same connection as the fetch's
        assert links(d2)[d1.node_id] == "tcp" and nodes(d2)[d1.node_id]["link_age_s"] < 1.0
        assert connections(d2, ports[d1.node_id]) == 1
        assert connections(d2, ports[d3.node_id]) == 0
        for d in (d1, d3):  # the other way, and the third node: nothing
            assert set(links(d).values()) == {"none"}, links(d)
            assert all(connections(d, p) == 0 for n, p in ports.items() if n != d.node_id)

        # unused for peer_idle_s: closed, and opened again by the next request
        eventually(lambda: links(d2)[d1.node_id] == "none", timeout=30, what="the idle link closed")
        assert connections(d2, ports[d1.node_id]) == 0
        assert f"closed the link to node {d1.node_id} (idle for" in d2.output()
        np.testing.assert_array_equal(c2.fetch("w")["w"], w)
        assert links(d2)[d1.node_id] == "tcp"
    for d in ds:
        assert d.stop() == 0, d.output()


def test_a_killed_node_no_link_reaches_is_found_dead_from_the_plane(cluster: Cluster, tmp_path: Path) -> None:
    d1, d2 = hosts(cluster, tmp_path, "host-a", "host-b", env=IDLE)
    with d2.client() as c2:
        c2.put("v", np.ones(3, np.float32), heap=True)
    eventually(lambda: links(d1) == {d2.node_id: "none"}, what="node 1 knows node 2")
    killed(d2)
    row = eventually(lambda: (n := nodes(d1)[d2.node_id])["state"] == "dead" and n, what="node 2 dead for node 1")
    assert row["link"] == "none" and row["heartbeat_age_s"] > 4, row
    with d1.client() as c1:
        assert {t["name"]: t["state"] for t in c1.admin("tensors")}["v"] == "unreachable"
        bad = c1.run(parse_text("addscalar (tensor<float32>:v, var<float32>:1.0) -> (tensor<float32>:o)"))
        assert not bad.ok and f"tensor 'v' is a heap tensor of node {d2.node_id}, which is dead" in bad.error, \
            bad.error
    assert links(d1) == {d2.node_id: "none"}  # found dead without opening a link
    assert d1.stop() == 0, d1.output()


def test_placement_reads_a_node_s_op_statistics_only_when_they_changed(cluster: Cluster, tmp_path: Path,
                                                                        redis_server: Any) -> None:
    """b places new programs over several heartbeats: a's `ops:*` hashes are read again only after a ran something
    (its version in the `nodes` index changed), and `ops:*` is never scanned."""
    import redis

    a, b = hosts(cluster, tmp_path, "host-a", "host-b")
    seen: list[str] = []
    watching = threading.Event()

    def monitor() -> None:
        r = redis.Redis.from_url(redis_server.url, decode_responses=True)
        with r.monitor() as m:
            watching.set()
            for x in m.listen():
                seen.append(str(x["command"]))
                if "stop-monitor" in x["command"]:
                    return

    def new_programs(c: Any, tag: str, count: int) -> None:
        for i in range(count):  # each a new plan (another name), so each asks placement
            r = c.run(parse_text(f"addscalar (tensor<float32>:x, var<float32>:1.0) -> (tensor<float32>:{tag}{i})"))
            assert r.ok, r.error
            time.sleep(0.1)

    eventually(lambda: links(b) == {a.node_id: "none"}, what="b knows a")
    with a.client() as ca, b.client() as cb:
        cb.put("x", np.ones(4, np.float32))
        ca.put("x", np.ones(4, np.float32))
        new_programs(cb, "warm", 5)  # b has read a's statistics once now
        t = threading.Thread(target=monitor, daemon=True)
        t.start()
        assert watching.wait(10)
        new_programs(cb, "p", 20)  # two seconds: four heartbeats of b's placement
        mark = len(seen)
        ca.run(parse_text("addscalar (tensor<float32>:x, var<float32>:2.0) -> (tensor<float32>:ona)")).raise_for_error()
        eventually(lambda: any(f"{cluster.prefix}ops:{a.node_id}:op-cpu" in c and "HSET" in c for c in seen[mark:]),
                   what="a's registry wrote its new counters")
        new_programs(cb, "q", 10)
        redis.Redis.from_url(redis_server.url).get("stop-monitor")
        t.join(10)

    def reads(commands: list[str]) -> int:
        return sum(1 for c in commands if c.startswith(f"HGETALL {cluster.prefix}ops:{a.node_id}:"))

    assert not [c for c in seen if c.startswith("SCAN") and "ops:" in c], "ops:* scanned"
    assert reads(seen[:mark]) == 0, "a's statistics read again though they did not change"
    assert reads(seen[mark:]) >= 1, "a's new statistics not read"
    for d in (b, a):
        assert d.stop() == 0, d.output()
