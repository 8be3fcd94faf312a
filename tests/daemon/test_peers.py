"""Peer links between deepxd nodes on one real redis-server (issue 23, items 3 and 4): a hold recorded before a
segment is mapped, a dead node's holds released, another host's heap tensors streamed over TCP with the token (hosts
told apart here by the `host` setting; tests/daemon/test_netns.py puts a node in a network namespace), writes to
them refused, and a node whose link refuses this one seen dead though its heartbeat goes on."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from deepx_core.errors import DeepxError
from deepx_core.ir import parse_text
from tests.daemon.conftest import DEEPXD, Daemon, eventually
from tests.daemon.test_cluster import Cluster
from tests.daemon.test_tcp import TOKEN, self_signed, token_file

#: quick heartbeats, and a node dead after 4 s of silence (a loaded machine's heartbeats come late)
QUICK = {"DEEPX_HEARTBEAT_S": "0.5", "DEEPX_PEER_TIMEOUT_S": "4"}


@pytest.fixture
def cluster(tmp_path: Path, redis_server: Any) -> Iterator[Cluster]:
    c = Cluster(tmp_path, redis_server.url)
    yield c
    c.stop()


def holders(cluster: Cluster, name: str) -> list[str]:
    return cluster.hash(f"tensor:{name}").get("holders", "").split(",")


def nodes(d: Daemon) -> dict[str, dict[str, Any]]:
    with d.client() as c:
        return {n["node"]: n for n in c.admin("nodes")}


def killed(d: Daemon) -> None:
    assert d.proc is not None
    d.proc.kill()  # kill -9: no goodbye, its heartbeat and its link go silent
    d.proc.wait()
    d.stop()


def test_a_hold_is_recorded_before_the_segment_is_mapped(cluster: Cluster) -> None:
    """Node 2's hold on node 1's tensor is in node 1's record when node 2's program answers: node 1 never frees
    (or pools, for another tensor) a segment that node 2 maps while it does not know of node 2's hold."""
    d1, d2 = cluster.start(1), cluster.start(2)
    hold = f"node:{d2.node_id}"
    w = np.arange(6, dtype=np.float32)
    with d1.client() as c1, d2.client() as c2:
        c1.put("w", w, heap=True)
        r = c2.run(parse_text("mulscalar (tensor<float32>:w, var<float32>:3.0) -> (tensor<float32>:o)"), fetch=["o"])
        np.testing.assert_array_equal(r.raise_for_error().tensors["o"], w * 3)
        assert holders(cluster, "w") == ["op-cpu", hold]  # no waiting: recorded before node 2 mapped it
        with pytest.raises(DeepxError, match=f"held by op-cpu, {hold}"):
            c1.request("delete", name="w", force=False)
        np.testing.assert_array_equal(c2.fetch("w")["w"], w)  # mapped already: no second hold
        assert holders(cluster, "w") == ["op-cpu", hold]
    assert d2.stop() == 0, d2.output()
    eventually(lambda: holders(cluster, "w") == ["op-cpu"], what="node 2's hold given back as it stopped")


def test_the_holds_of_a_node_killed_with_9_are_released_when_it_is_found_dead(cluster: Cluster) -> None:
    d1, d2 = cluster.start(1, QUICK), cluster.start(2, QUICK)
    with d1.client() as c1, d2.client() as c2:
        c1.put("w", np.ones(4, np.float32), heap=True)
        c1.put("other", np.ones(2, np.float32), heap=True)
        c2.run(parse_text("add (tensor<float32>:w, tensor<float32>:w) -> (tensor<float32>:o)")).raise_for_error()
        assert holders(cluster, "w") == ["op-cpu", f"node:{d2.node_id}"]
    killed(d2)
    eventually(lambda: nodes(d1)[d2.node_id]["state"] == "dead", what="node 2 dead for node 1")
    eventually(lambda: holders(cluster, "w") == ["op-cpu"], what="node 1 released the dead node's hold")
    assert f"released node {d2.node_id}'s hold on heap tensor 'w'" in d1.output()
    with d1.client() as c1:
        assert c1.request("delete", name="w", force=False)["tensor"]["forced"] is False  # freed as any other
        np.testing.assert_array_equal(c1.fetch("other")["other"], [1, 1])  # and node 1 goes on
    assert d1.stop() == 0, d1.output()


def test_a_node_started_again_gives_back_what_its_last_daemon_held(cluster: Cluster) -> None:
    """Killed with -9 and started again before node 1 found it dead: the new daemon maps nothing yet, so the holds
    its id has on other nodes' tensors are its last daemon's, and it gives them back."""
    patient = {"DEEPX_HEARTBEAT_S": "0.5", "DEEPX_PEER_TIMEOUT_S": "120"}
    d1, d2 = cluster.start(1, patient), cluster.start(2, patient)
    with d1.client() as c1, d2.client() as c2:
        c1.put("w", np.ones(4, np.float32), heap=True)
        c2.run(parse_text("add (tensor<float32>:w, tensor<float32>:w) -> (tensor<float32>:o)")).raise_for_error()
    killed(d2)
    d2 = cluster.start(2, patient)
    eventually(lambda: holders(cluster, "w") == ["op-cpu"], what="the new node 2 gave back its last daemon's hold")
    assert "released node" not in d1.output()  # not found dead: given back by node 2 itself
    with d2.client() as c2:  # and it maps the tensor again, with a hold of its own
        c2.run(parse_text("add (tensor<float32>:w, tensor<float32>:w) -> (tensor<float32>:o)")).raise_for_error()
    assert holders(cluster, "w") == ["op-cpu", f"node:{d2.node_id}"]


def hosts(cluster: Cluster, tmp: Path, *names: str, token: str = TOKEN, env: dict[str, str] | None = None,
          first: int = 1, extra: list[str] | None = None) -> list[Daemon]:
    """Daemons that say they run on hosts `names`: they reach each other over TCP, with the token."""
    out = []
    for k, host in enumerate(names, start=first):
        folder = tmp / f"t{k}"
        folder.mkdir(exist_ok=True)
        out.append(cluster.start(k, {"DEEPX_HOST": host, **QUICK, **(env or {})},
                                 ["--listen", "tcp://127.0.0.1:0", "--token-file", str(token_file(folder, token)),
                                  *(extra or [])]))
    return out


def test_peer_links_to_a_tls_listener_speak_tls(cluster: Cluster, tmp_path: Path) -> None:
    """Nodes that share one certificate (for 127.0.0.1) link over TLS, checking it against their own tls_cert."""
    cert, key = self_signed(tmp_path)
    d1, d2 = hosts(cluster, tmp_path, "host-a", "host-b", extra=["--tls-cert", str(cert), "--tls-key", str(key)])
    w = np.arange(100_000, dtype=np.float64)
    with d1.client() as c1, d2.client() as c2:
        c1.put("w", w, heap=True)
        np.testing.assert_array_equal(c2.fetch("w")["w"], w)
    assert cluster.hash(f"node:{d1.node_id}")["tls"] == "1"
    eventually(lambda: nodes(d2)[d1.node_id]["link"] == "tls", what="node 2 linked to node 1 over TLS")


def test_another_hosts_heap_tensor_is_streamed_over_the_peer_link(cluster: Cluster, tmp_path: Path) -> None:
    d1, d2 = hosts(cluster, tmp_path, "host-a", "host-b")
    big = np.random.default_rng(0).standard_normal((1200, 2000)).astype(np.float32)  # 9.6 MB: three chunks
    ints = np.arange(12, dtype=np.int64).reshape(3, 4)
    two = parse_text("mulscalar (tensor<float32>:wbig, var<float32>:2.0) -> (tensor<float32>:d)\n"
                     "add (tensor<int64>:wi, tensor<int64>:wi) -> (tensor<int64>:e)")
    with d1.client() as c1, d2.client() as c2:
        c1.put("wbig", big, heap=True)
        c1.put("wi", ints, heap=True)
        c1.put("wempty", np.zeros((0, 3), np.float32), heap=True)
        np.testing.assert_array_equal(c2.fetch("wbig")["wbig"], big)
        assert c2.fetch("wempty")["wempty"].shape == (0, 3)
        r = c2.run(two, fetch=["d", "e"]).raise_for_error()
        np.testing.assert_array_equal(r.tensors["d"], big * 2)
        np.testing.assert_array_equal(r.tensors["e"], ints * 2)
        assert holders(cluster, "wbig") == ["op-cpu"]  # streamed, not mapped: node 2 holds nothing
        c2.put("proj", np.ones((2000, 3), np.float32))  # a heavy program, on node 2's worker thread
        heavy = c2.run(parse_text("matmul (tensor<float32>:wbig, tensor<float32>:proj) -> (tensor<float32>:p)"),
                       fetch=["p"]).raise_for_error()
        np.testing.assert_allclose(heavy.tensors["p"], big @ np.ones((2000, 3), np.float32), rtol=1e-4, atol=1e-3)
        c1.put("wi", ints + 100, heap=True)  # read as it is when each program runs
        np.testing.assert_array_equal(c2.run(two, fetch=["e"]).raise_for_error().tensors["e"], (ints + 100) * 2)

        # a program on node 2 that writes (or deletes) it is refused whole, before anything runs
        bad = c2.run(parse_text("addscalar (tensor<int64>:wi, var<int64>:1) -> (tensor<int64>:e2)\n"
                                "addscalar (tensor<int64>:wi, var<int64>:1) -> (tensor<int64>:wi)"), fetch=[])
        assert not bad.ok and bad.done == 0 and bad.error_index == 1, bad
        assert f"tensor 'wi' is a heap tensor of node {d1.node_id}, on another host" in bad.error, bad.error
        assert "cannot write, delete or rename it" in bad.error
        bad = c2.run(parse_text("deltensor () -> (tensor<int64>:wi)"), fetch=[])
        assert not bad.ok and f"tensor 'wi' is a heap tensor of node {d1.node_id}" in bad.error, bad.error
        assert "cannot delete or rename it" in bad.error
        np.testing.assert_array_equal(c1.fetch("wi")["wi"], ints + 100)
        assert "e2" not in {t["name"] for t in c2.admin("tensors")}

        # the other way: node 1 reads node 2's
        c2.put("v2", np.full(3, 7, np.float32), heap=True)
        r1 = c1.run(parse_text("addscalar (tensor<float32>:v2, var<float32>:1.0) -> (tensor<float32>:o)"),
                    fetch=["o"])
        np.testing.assert_array_equal(r1.raise_for_error().tensors["o"], [8, 8, 8])

        # deepxctl tensors rm on node 2 of node 1's tensor: asked over the link
        info = c2.request("delete", name="wbig", force=False)["tensor"]
        assert (info["name"], info["node"]) == ("wbig", d1.node_id)
        assert not cluster.r.exists(cluster.key("tensor:wbig"))
        with pytest.raises(DeepxError, match="wbig"):
            c2.fetch("wbig")
    row = eventually(lambda: (n := nodes(d2)[d1.node_id])["link"] == "tcp" and n, what="node 1 linked over TCP")
    assert (row["state"], row["host"]) == ("running", "host-a")
    assert nodes(d2)[d2.node_id]["link"] == "self"
    for d in (d1, d2):
        assert d.stop() == 0, d.output()


def test_a_node_whose_link_refuses_this_one_is_dead_though_its_heartbeat_goes_on(cluster: Cluster,
                                                                                   tmp_path: Path) -> None:
    """Another token: a program on node 1 that reads node 2's tensor opens a link, which node 2 refuses: the
    program fails at once, naming the tensor and the node; the link, tried each heartbeat, stays silent, and node 2
    is dead for node 1 after peer_timeout_s, while both heartbeats go on in the plane."""
    (d1,) = hosts(cluster, tmp_path, "host-a")
    (d2,) = hosts(cluster, tmp_path, "host-b", token="f" * 32, first=2)
    uses_v = parse_text("addscalar (tensor<float32>:v, var<float32>:1.0) -> (tensor<float32>:o)")
    with d2.client() as c2:
        c2.put("v", np.ones(2, np.float32), heap=True)
    with d1.client() as c1:
        bad = c1.run(uses_v)
        assert not bad.ok and "'v'" in bad.error and d2.node_id in bad.error and "peer link" in bad.error, bad.error
        assert "wrong token" in bad.error, bad.error
    row = eventually(lambda: (n := nodes(d1)[d2.node_id])["state"] == "dead" and n, what="node 2 dead for node 1")
    assert row["link"] == "down" and "wrong token" in row["link_error"], row
    assert row["heartbeat_age_s"] < 4  # its plane heartbeat is fresh
    with d1.client() as c1:
        bad = c1.run(uses_v)
        assert not bad.ok and "'v'" in bad.error and d2.node_id in bad.error and "peer link" in bad.error, bad.error
        assert {t["name"]: t["state"] for t in c1.admin("tensors")}["v"] == "unreachable"


def test_peer_timeout_is_a_setting_and_a_flag(tmp_path: Path) -> None:
    env = {**os.environ, "DEEPX_CONFIG": str(tmp_path / "none.toml")}
    (tmp_path / "none.toml").write_text("")
    shown = subprocess.run([*DEEPXD, "config", "--peer-timeout", "7"], capture_output=True, text=True, env=env)
    assert shown.returncode == 0 and "peer_timeout_s = 7.0" in shown.stdout, shown.stderr
    (tmp_path / "c.toml").write_text("[deepxd]\npeer_timeout_s = 30\n")
    shown = subprocess.run([*DEEPXD, "config", "--config", str(tmp_path / "c.toml")], capture_output=True, text=True,
                           env=env)
    assert "peer_timeout_s = 30.0" in shown.stdout, shown.stderr
    refused = subprocess.run([*DEEPXD, "start", "--peer-timeout", "1", "--listen", f"unix://{tmp_path}/d.sock"],
                             capture_output=True, text=True, env={**env, "DEEPX_HEARTBEAT_S": "2"}, timeout=60)
    assert refused.returncode == 2
    assert "peer_timeout_s: 1.0 s is less than two heartbeats (heartbeat_s = 2.0)" in refused.stderr


def test_a_node_id_in_use_on_another_host_is_refused(cluster: Cluster, tmp_path: Path) -> None:
    (d1,) = hosts(cluster, tmp_path, "host-a")
    folder = tmp_path / "twin"
    folder.mkdir()
    twin = Daemon(folder, kv=cluster.url, node_id=d1.node_id, udp=False,
                  env={"DEEPX_KV_PREFIX": cluster.prefix, "DEEPX_HOST": "host-b", **QUICK})
    done = subprocess.run(twin.args, env=twin.env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert (f"node id '{d1.node_id}' is in use by a running deepxd on host host-a (pid {d1.proc.pid if d1.proc else 0})"
            in done.stderr), done.stderr
    assert cluster.hash(f"node:{d1.node_id}")["host"] == "host-a"  # the running one's record untouched
    with d1.client() as c1:
        c1.ping()


def test_nodes_read_the_index_not_every_record_each_heartbeat(tmp_path: Path, new_redis_server: Any) -> None:
    """The plane's `nodes` index lists every node and changes its version when one starts or stops; a node reads the
    others' records only then (and once in INDEX_TRUSTED heartbeats), not all of them every heartbeat; a link to a
    node that stops is closed."""
    import time

    import redis

    from deepxd.peers import INDEX_TRUSTED

    server = new_redis_server()
    cluster = Cluster(tmp_path, server.url)
    try:
        ds = [cluster.start(i, QUICK) for i in (1, 2, 3)]
        index = cluster.hash("nodes")
        assert set(index) == {f"{k}:{d.node_id}" for d in ds for k in ("node", "ops")} | {"version"}
        for d in ds:
            others = {o.node_id for o in ds} - {d.node_id}
            eventually(lambda d=d, others=others: all(nodes(d)[o].get("link") == "none" for o in others),
                       what="every node knows the others")
        with ds[0].client() as c0, ds[2].client() as c2:  # a link from node 1 to node 3
            c2.put("w3", np.ones(2, np.float32), heap=True)
            np.testing.assert_array_equal(c0.fetch("w3")["w3"], [1, 1])
        assert nodes(ds[0])[ds[2].node_id].get("link") in ("tcp", "unix")
        r = redis.Redis.from_url(server.url, decode_responses=True)
        r.config_resetstat()
        start = time.monotonic()
        time.sleep(3.0)  # six heartbeats of 0.5 s
        beats = (time.monotonic() - start) / 0.5
        reads = int(r.info("commandstats").get("cmdstat_hgetall", {}).get("calls", 0))
        every_record = 3 * 2 * beats  # what reading every other node's record each heartbeat costs
        assert reads <= 3 * 2 * (beats / INDEX_TRUSTED + 1), (reads, every_record)
        version = index["version"]
        assert ds[2].stop() == 0, ds[2].output()
        assert cluster.hash("nodes")["version"] != version
        eventually(lambda: nodes(ds[0])[ds[2].node_id].get("link") == "",
                   what="node 1 let go of its link to the stopped node 3")
    finally:
        cluster.stop()


def test_a_node_s_record_and_its_entry_in_the_index_are_written_in_one_transaction(tmp_path: Path,
                                                                                     new_redis_server: Any) -> None:
    """At start, `node:<id>` and the `nodes` index's entry and version are written in one MULTI: a plane that kept
    one (a Redis restored from its last second of writes) kept the other, so no running record waits unread behind
    a version the other nodes have seen."""
    import threading

    import redis

    server = new_redis_server()
    cluster = Cluster(tmp_path, server.url)
    seen: list[tuple[str, str]] = []
    watching = threading.Event()

    def monitor() -> None:
        r = redis.Redis.from_url(server.url, decode_responses=True)
        with r.monitor() as m:
            watching.set()
            for x in m.listen():
                seen.append((str(x["client_port"]), str(x["command"])))
                if "stop-monitor" in x["command"]:
                    return

    t = threading.Thread(target=monitor, daemon=True)
    t.start()
    assert watching.wait(10)
    try:
        d = cluster.start(1, QUICK)
        with d.client() as c:
            c.ping()
        redis.Redis.from_url(server.url).get("stop-monitor")
        t.join(10)
        record, index = f"HSET {cluster.prefix}node:{d.node_id} ", f"HSET {cluster.prefix}nodes "
        at = next(i for i, (_, cmd) in enumerate(seen) if cmd.startswith(record) and " running" in cmd)
        port = seen[at][0]
        mine = [cmd for p, cmd in seen if p == port]
        k = mine.index(seen[at][1])
        start = max(i for i in range(k) if mine[i] in ("MULTI", "EXEC")) if "MULTI" in mine[:k] else -1
        assert start >= 0 and mine[start] == "MULTI", mine[max(0, k - 3):k + 3]
        end = mine.index("EXEC", k)
        assert any(cmd.startswith(index) for cmd in mine[start:end]), mine[start:end + 1]
    finally:
        cluster.stop()
